// Layer normalisation on CUDA (ops layer_norm and layer_norm_backward), a first plain form:
// a warp per row for the forward pass and for dx (the row's sums with shuffles, in float64 as
// the CPU backend's: a float32 sum of a wide row whose mean is large next to its spread would
// put an error of about 1e-4 into every output); dgamma and dbeta as the CPU backend sums
// them: per column, partial sums over fixed blocks of 32 rows (a thread per column and block:
// enough threads to fill the GPU at a training batch's 8192 rows), then the blocks' sums added
// in block order (the same on every run). Written without a GPU at hand; the conformance sweep
// checks it.
#include <cmath>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/warp.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

template <typename T>
__global__ void layer_norm_forward_kernel(const T* __restrict__ x,
                                          const compute_of<T>* __restrict__ gamma,
                                          const compute_of<T>* __restrict__ beta, double epsilon,
                                          T* __restrict__ out, compute_of<T>* __restrict__ mean,
                                          compute_of<T>* __restrict__ rstd, int64_t rows,
                                          int64_t n) {
  using C = compute_of<T>;
  for_each_warp_item(rows, [&](int64_t r, int lane) {
    const T* xr = x + r * n;
    // The CPU's arithmetic: sums in float64, x - mu in C, mean and rstd rounded once to C.
    double s = 0.0;
    for (int64_t j = lane; j < n; j += kWarp) s += static_cast<double>(load(xr[j]));
    const C mu = static_cast<C>(warp_sum(s) / static_cast<double>(n));
    double v = 0.0;
    for (int64_t j = lane; j < n; j += kWarp) {
      const double c = static_cast<double>(load(xr[j]) - mu);
      v += c * c;
    }
    const C rs = static_cast<C>(1.0 / sqrt(warp_sum(v) / static_cast<double>(n) + epsilon));
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
    for (int64_t j = lane; j < n; j += kWarp) {
      C o = (load(xr[j]) - mu) * rs;
      if (gamma) o *= gamma[j];
      if (beta) o += beta[j];
      out[r * n + j] = store<T>(o);
    }
  });
}

template <typename T>
__global__ void layer_norm_dx_kernel(const T* __restrict__ x,
                                     const compute_of<T>* __restrict__ gamma,
                                     const compute_of<T>* __restrict__ mean,
                                     const compute_of<T>* __restrict__ rstd,
                                     const T* __restrict__ dy, T* __restrict__ dx, int64_t rows,
                                     int64_t n) {
  using C = compute_of<T>;
  for_each_warp_item(rows, [&](int64_t r, int lane) {
    const T* xr = x + r * n;
    const T* gr = dy + r * n;
    const C mu = mean[r], rs = rstd[r];
    double sg = 0.0, sgx = 0.0;  // in float64, as the CPU's
    for (int64_t j = lane; j < n; j += kWarp) {
      const C g = gamma ? mul_rn(load(gr[j]), gamma[j]) : load(gr[j]);
      const C xh = (load(xr[j]) - mu) * rs;
      sg += static_cast<double>(g);
      sgx += static_cast<double>(g * xh);
    }
    const C mg = static_cast<C>(warp_sum(sg) / static_cast<double>(n));
    const C mgx = static_cast<C>(warp_sum(sgx) / static_cast<double>(n));
    for (int64_t j = lane; j < n; j += kWarp) {
      // dy * gamma rounded on its own, as in the sums: contracted into the subtraction (an
      // FMA), g - mg would not be 0 where it must be (a row of width 1, whose dx is 0).
      const C g = gamma ? mul_rn(load(gr[j]), gamma[j]) : load(gr[j]);
      const C xh = (load(xr[j]) - mu) * rs;
      dx[r * n + j] = store<T>(rs * (g - mg - xh * mgx));
    }
  });
}

// Rows per block of the dgamma / dbeta partial sums (the CPU backend's).
constexpr int64_t kRowsPerBlock = 32;

// The partial sums of dy xhat and of dy over the rows of block b (blockIdx.y, and every
// gridDim.y-th after it) for column j = blockIdx.x * blockDim.x + threadIdx.x, into
// part_g[b, j] and part_b[b, j].
template <typename T>
__global__ void layer_norm_params_part_kernel(const T* __restrict__ x,
                                              const compute_of<T>* __restrict__ mean,
                                              const compute_of<T>* __restrict__ rstd,
                                              const T* __restrict__ dy,
                                              compute_of<T>* __restrict__ part_g,
                                              compute_of<T>* __restrict__ part_b, int64_t rows,
                                              int64_t n) {
  using C = compute_of<T>;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  for (int64_t b = blockIdx.y; b < blocks; b += gridDim.y) {
    const int64_t end =
        b * kRowsPerBlock + kRowsPerBlock < rows ? b * kRowsPerBlock + kRowsPerBlock : rows;
    C sg = C(0), sb = C(0);
    // kAhead rows read before any is added (in order): more loads in flight a thread
    // (linear.cu's linear_dz_kernel says why).
    constexpr int kAhead = 8;
    for (int64_t r0 = b * kRowsPerBlock; r0 < end; r0 += kAhead) {
      C g[kAhead] = {}, xv[kAhead] = {}, mu[kAhead] = {}, rs[kAhead] = {};
#pragma unroll
      for (int q = 0; q < kAhead; ++q) {
        const int64_t r = r0 + q;
        if (r >= end) continue;
        g[q] = load(dy[r * n + j]);
        xv[q] = load(x[r * n + j]);
        mu[q] = mean[r];
        rs[q] = rstd[r];
      }
#pragma unroll
      for (int q = 0; q < kAhead; ++q) {
        if (r0 + q >= end) continue;
        const C xh = (xv[q] - mu[q]) * rs[q];
        sg += g[q] * xh;
        sb += g[q];
      }
    }
    part_g[b * n + j] = sg;
    part_b[b * n + j] = sb;
  }
}

// dgamma[j] and dbeta[j]: the blocks' partial sums of column j, added in block order.
template <typename C>
__global__ void layer_norm_params_sum_kernel(const C* __restrict__ part_g,
                                             const C* __restrict__ part_b, C* __restrict__ dgamma,
                                             C* __restrict__ dbeta, int64_t blocks, int64_t n) {
  MIXTAPE_GRID_LOOP(j, n) {
    if (dgamma) dgamma[j] = ordered_column_sum(part_g, blocks, n, j);
    if (dbeta) dbeta[j] = ordered_column_sum(part_b, blocks, n, j);
  }
}

template <typename T>
void layer_norm_host(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon,
                     const Tensor& out, const Tensor& mean, const Tensor& rstd) {
  using C = compute_of<T>;
  const int64_t n = x.shape().back(), rows = x.numel() / n;
  if (rows == 0) return;
  OnDevice on(out);
  launch_1d({"layer_norm kernel", rows * kWarp, on.s}, layer_norm_forward_kernel<T>,
            static_cast<const T*>(x.const_data_ptr()),
            gamma.defined() ? static_cast<const C*>(gamma.const_data_ptr()) : nullptr,
            beta.defined() ? static_cast<const C*>(beta.const_data_ptr()) : nullptr, epsilon,
            static_cast<T*>(out.data_ptr()), static_cast<C*>(mean.data_ptr()),
            static_cast<C*>(rstd.data_ptr()), rows, n);
}

template <typename T>
void layer_norm_backward_host(const Tensor& x, const Tensor& gamma, const Tensor& mean,
                              const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                              const Tensor& dgamma, const Tensor& dbeta) {
  using C = compute_of<T>;
  const int64_t n = x.shape().back(), rows = x.numel() / n;
  if (rows == 0) return;
  OnDevice on(dx);
  const auto* xp = static_cast<const T*>(x.const_data_ptr());
  const auto* mp = static_cast<const C*>(mean.const_data_ptr());
  const auto* rp = static_cast<const C*>(rstd.const_data_ptr());
  const auto* gp = static_cast<const T*>(dy.const_data_ptr());
  launch_1d({"layer_norm dx kernel", rows * kWarp, on.s}, layer_norm_dx_kernel<T>, xp,
            gamma.defined() ? static_cast<const C*>(gamma.const_data_ptr()) : nullptr, mp, rp, gp,
            static_cast<T*>(dx.data_ptr()), rows, n);
  if (!dgamma.defined() && !dbeta.defined()) return;
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  Workspace part(2 * static_cast<std::size_t>(blocks * n) * sizeof(C), on.index);
  C* part_g = static_cast<C*>(part.data());
  C* part_b = part_g + blocks * n;
  const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads),
                  static_cast<unsigned>(blocks < 65535 ? blocks : 65535));
  MIXTAPE_CUDA_LAUNCH(grid, kThreads, on.s, layer_norm_params_part_kernel<T>)
  (xp, mp, rp, gp, part_g, part_b, rows, n);
  check_cuda(cudaGetLastError(), "layer_norm dgamma/dbeta kernel", __FILE__, __LINE__);
  launch_1d({"layer_norm dgamma/dbeta sum kernel", n, on.s}, layer_norm_params_sum_kernel<C>,
            static_cast<const C*>(part_g), static_cast<const C*>(part_b),
            dgamma.defined() ? static_cast<C*>(dgamma.data_ptr()) : nullptr,
            dbeta.defined() ? static_cast<C*>(dbeta.data_ptr()) : nullptr, blocks, n);
}

}  // namespace

void register_layer_norm_kernels() {
  MIXTAPE_CUDA_KERNEL(layer_norm, layer_norm_host);
  MIXTAPE_CUDA_KERNEL(layer_norm_backward, layer_norm_backward_host);
}

}  // namespace mixtape::cuda_backend
