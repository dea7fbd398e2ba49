// Batch normalisation on CUDA (ops batch_norm and batch_norm_backward), a first plain form,
// with the CPU backend's arithmetic and order of sums (backends/cpu/batch_norm.cpp): the
// columns' partial sums in float64 over fixed blocks of 32 rows (a thread per column and
// block, as layer_norm.cu's gamma and beta gradients), the blocks' sums added in block order
// by one thread per column, then the output (or dx) element by element. Forward: the mean's
// sums, the mean, the variance's sums, the variance and rstd, the output (five launches; with
// given statistics rstd and the output); backward: rstd, the sums of dy and dy xhat, the
// per-column factors and the parameters' gradients, dx (four). Written without a GPU at hand; the
// conformance sweep checks it on the host emulation, not yet on a GPU. Written by hand: cuDNN's
// batch normalisation takes NCHW or NHWC images of float16, bfloat16 and float32 with its own saved
// statistics, no float64, and the op table needs all four dtypes and the same kernel contract on
// every backend.
#include <cmath>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// Rows per block of the partial sums (the CPU backend's).
constexpr int64_t kBatchRows = 32;

__host__ __device__ inline int64_t batch_blocks(int64_t rows) {
  return (rows + kBatchRows - 1) / kBatchRows;
}

// 1 / sqrt(var + epsilon) in float64, rounded once (the CPU backend's).
template <typename C>
__device__ __forceinline__ C batch_rstd(C var, double epsilon) {
  return static_cast<C>(1.0 / sqrt(static_cast<double>(var) + epsilon));
}

// What a partial-sums pass adds up per column: x; (x - mean)^2; dy and dy xhat.
enum class BatchSums : int { x, squares, grads };

// The partial sums over the rows of block b (blockIdx.y, and every gridDim.y-th after it) of
// column j = blockIdx.x * blockDim.x + threadIdx.x, in float64, into part0[b, j] (and
// part1[b, j] for the gradients' second sum). mean and rstd: the columns' (unused by BatchSums::x).
template <typename T, BatchSums kSums>
__global__ void batch_norm_partials_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                           const compute_of<T>* __restrict__ mean,
                                           const compute_of<T>* __restrict__ rstd,
                                           double* __restrict__ part0, double* __restrict__ part1,
                                           int64_t rows, int64_t n) {
  using C = compute_of<T>;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const C mu = kSums == BatchSums::x ? C(0) : mean[j];
  const C rs = kSums == BatchSums::grads ? rstd[j] : C(0);
  for (int64_t b = blockIdx.y; b < batch_blocks(rows); b += gridDim.y) {
    const int64_t end = b * kBatchRows + kBatchRows < rows ? b * kBatchRows + kBatchRows : rows;
    double s0 = 0.0, s1 = 0.0;
    for (int64_t r = b * kBatchRows; r < end; ++r) {
      const C v = load(x[r * n + j]);
      if constexpr (kSums == BatchSums::x) {
        s0 += static_cast<double>(v);
      } else if constexpr (kSums == BatchSums::squares) {
        const double c = static_cast<double>(v - mu);
        s0 += c * c;
      } else {
        const C g = load(dy[r * n + j]);
        const C xh = (v - mu) * rs;
        s0 += static_cast<double>(g);
        s1 += static_cast<double>(g * xh);
      }
    }
    part0[b * n + j] = s0;
    if constexpr (kSums == BatchSums::grads) part1[b * n + j] = s1;
  }
}

// The mean of column j (the blocks' sums added in block order, over rows); with rstd given,
// that mean is a variance and rstd[j] its 1 / sqrt(var + epsilon).
template <typename C>
__global__ void batch_norm_stats_kernel(const double* __restrict__ part, int64_t blocks,
                                        int64_t rows, int64_t n, double epsilon,
                                        C* __restrict__ out, C* __restrict__ rstd) {
  MIXTAPE_GRID_LOOP(j, n) {
    out[j] = static_cast<C>(ordered_column_sum(part, blocks, n, j) / static_cast<double>(rows));
    if (rstd) rstd[j] = batch_rstd(out[j], epsilon);
  }
}

// rstd[j] from the variance the forward pass wrote, as that pass found it.
template <typename C>
__global__ void batch_norm_rstd_kernel(const C* __restrict__ var, int64_t n, double epsilon,
                                       C* __restrict__ rstd) {
  MIXTAPE_GRID_LOOP(j, n) rstd[j] = batch_rstd(var[j], epsilon);
}

template <typename T>
__global__ void batch_norm_out_kernel(const T* __restrict__ x,
                                      const compute_of<T>* __restrict__ gamma,
                                      const compute_of<T>* __restrict__ beta,
                                      const compute_of<T>* __restrict__ mean,
                                      const compute_of<T>* __restrict__ rstd, T* __restrict__ out,
                                      int64_t total, int64_t n) {
  using C = compute_of<T>;
  MIXTAPE_GRID_LOOP(i, total) {
    const int64_t j = i % n;
    C o = (load(x[i]) - mean[j]) * rstd[j];
    if (gamma) o = mul_rn(o, gamma[j]);  // rounded before beta is added, as on the CPU
    if (beta) o += beta[j];
    out[i] = store<T>(o);
  }
}

// The backward pass's per-column values from the sums of dy (part_b) and of dy xhat (part_g):
// dgamma and dbeta when asked, and coef = [gamma rstd, mean(dy), mean(dy xhat)], each [n] (the
// means 0 for given statistics).
template <typename C>
__global__ void batch_norm_grad_stats_kernel(const double* __restrict__ part_b,
                                             const double* __restrict__ part_g, int64_t blocks,
                                             int64_t rows, int64_t n, bool given,
                                             const C* __restrict__ gamma,
                                             const C* __restrict__ rstd, C* __restrict__ dgamma,
                                             C* __restrict__ dbeta, C* __restrict__ coef) {
  MIXTAPE_GRID_LOOP(j, n) {
    const double sb = ordered_column_sum(part_b, blocks, n, j);
    const double sg = ordered_column_sum(part_g, blocks, n, j);
    if (dgamma) dgamma[j] = static_cast<C>(sg);
    if (dbeta) dbeta[j] = static_cast<C>(sb);
    coef[j] = gamma ? gamma[j] * rstd[j] : rstd[j];
    // Given statistics take no gradient: their means' terms are 0.
    coef[n + j] = given ? C(0) : static_cast<C>(sb / static_cast<double>(rows));
    coef[2 * n + j] = given ? C(0) : static_cast<C>(sg / static_cast<double>(rows));
  }
}

template <typename T>
__global__ void batch_norm_dx_kernel(const T* __restrict__ x, const T* __restrict__ dy,
                                     const compute_of<T>* __restrict__ mean,
                                     const compute_of<T>* __restrict__ rstd,
                                     const compute_of<T>* __restrict__ coef, T* __restrict__ dx,
                                     int64_t total, int64_t n) {
  using C = compute_of<T>;
  MIXTAPE_GRID_LOOP(i, total) {
    const int64_t j = i % n;
    // xhat mean(dy xhat) rounded on its own, as the CPU computes it (not contracted into the
    // subtraction: a single row, whose dx is 0, keeps 0).
    const C xh = (load(x[i]) - mean[j]) * rstd[j];
    const C t = mul_rn(xh, coef[2 * n + j]);
    dx[i] = store<T>(coef[j] * (load(dy[i]) - coef[n + j] - t));
  }
}

// The grid of a partial-sums pass: a thread per column, blocks of rows along y.
dim3 batch_partials_grid(int64_t rows, int64_t n) {
  const int64_t blocks = batch_blocks(rows);
  return dim3(static_cast<unsigned>((n + kThreads - 1) / kThreads),
              static_cast<unsigned>(blocks < 65535 ? blocks : 65535));
}

// The columns' mean and variance (and rstd, into the workspace) of x [rows, n], rows >= 1.
template <typename T>
void batch_statistics_host(const T* x, int64_t rows, int64_t n, double epsilon, double* part,
                           compute_of<T>* mean, compute_of<T>* var, compute_of<T>* rstd,
                           cudaStream_t s) {
  using C = compute_of<T>;
  const int64_t blocks = batch_blocks(rows);
  const dim3 grid = batch_partials_grid(rows, n);
  MIXTAPE_CUDA_LAUNCH(grid, kThreads, s, batch_norm_partials_kernel<T, BatchSums::x>)
  (x, nullptr, nullptr, nullptr, part, nullptr, rows, n);
  check_cuda(cudaGetLastError(), "batch_norm mean sums kernel", __FILE__, __LINE__);
  launch_1d({"batch_norm mean kernel", n, s}, batch_norm_stats_kernel<C>,
            static_cast<const double*>(part), blocks, rows, n, epsilon, mean,
            static_cast<C*>(nullptr));
  MIXTAPE_CUDA_LAUNCH(grid, kThreads, s, batch_norm_partials_kernel<T, BatchSums::squares>)
  (x, nullptr, mean, nullptr, part, nullptr, rows, n);
  check_cuda(cudaGetLastError(), "batch_norm variance sums kernel", __FILE__, __LINE__);
  launch_1d({"batch_norm variance kernel", n, s}, batch_norm_stats_kernel<C>,
            static_cast<const double*>(part), blocks, rows, n, epsilon, var, rstd);
}

template <typename T>
void batch_norm_host(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon,
                     bool given, const Tensor& out, const Tensor& mean, const Tensor& var) {
  using C = compute_of<T>;
  const int64_t n = x.shape().back(), rows = x.numel() / n;
  const int64_t blocks = given ? 0 : batch_blocks(rows);
  OnDevice on(out);
  Workspace work(static_cast<std::size_t>(blocks * n) * sizeof(double) +
                     static_cast<std::size_t>(n) * sizeof(C),
                 on.index);
  auto* part = static_cast<double*>(work.data());
  auto* rstd = reinterpret_cast<C*>(part + blocks * n);
  const auto* xp = static_cast<const T*>(x.const_data_ptr());
  auto* mp = static_cast<C*>(mean.data_ptr());
  auto* vp = static_cast<C*>(var.data_ptr());
  if (given)
    launch_1d({"batch_norm rstd kernel", n, on.s}, batch_norm_rstd_kernel<C>,
              static_cast<const C*>(vp), n, epsilon, rstd);
  else
    batch_statistics_host<T>(xp, rows, n, epsilon, part, mp, vp, rstd, on.s);
  launch_1d({"batch_norm kernel", rows * n, on.s}, batch_norm_out_kernel<T>, xp,
            gamma.defined() ? static_cast<const C*>(gamma.const_data_ptr()) : nullptr,
            beta.defined() ? static_cast<const C*>(beta.const_data_ptr()) : nullptr,
            static_cast<const C*>(mp), static_cast<const C*>(rstd), static_cast<T*>(out.data_ptr()),
            rows * n, n);
}

template <typename T>
void batch_norm_backward_host(const Tensor& x, const Tensor& gamma, const Tensor& mean,
                              const Tensor& var, double epsilon, bool given, const Tensor& dy,
                              const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  using C = compute_of<T>;
  const int64_t n = x.shape().back(), rows = x.numel() / n;
  // The sums: not needed for given statistics without dgamma and dbeta (0 blocks of them).
  const bool sums = !given || dgamma.defined() || dbeta.defined();
  const int64_t blocks = sums ? batch_blocks(rows) : 0;
  OnDevice on(dx);
  Workspace work(2 * static_cast<std::size_t>(blocks * n) * sizeof(double) +
                     4 * static_cast<std::size_t>(n) * sizeof(C),
                 on.index);
  auto* part_b = static_cast<double*>(work.data());
  auto* part_g = part_b + blocks * n;
  auto* rstd = reinterpret_cast<C*>(part_g + blocks * n);
  C* coef = rstd + n;
  const auto* xp = static_cast<const T*>(x.const_data_ptr());
  const auto* mp = static_cast<const C*>(mean.const_data_ptr());
  const auto* gp = static_cast<const T*>(dy.const_data_ptr());
  launch_1d({"batch_norm rstd kernel", n, on.s}, batch_norm_rstd_kernel<C>,
            static_cast<const C*>(var.const_data_ptr()), n, epsilon, rstd);
  if (sums) {
    MIXTAPE_CUDA_LAUNCH(batch_partials_grid(rows, n), kThreads, on.s,
                        batch_norm_partials_kernel<T, BatchSums::grads>)
    (xp, gp, mp, static_cast<const C*>(rstd), part_b, part_g, rows, n);
    check_cuda(cudaGetLastError(), "batch_norm gradient sums kernel", __FILE__, __LINE__);
  }
  launch_1d({"batch_norm gradient factors kernel", n, on.s}, batch_norm_grad_stats_kernel<C>,
            static_cast<const double*>(part_b), static_cast<const double*>(part_g), blocks, rows, n,
            given, gamma.defined() ? static_cast<const C*>(gamma.const_data_ptr()) : nullptr,
            static_cast<const C*>(rstd),
            dgamma.defined() ? static_cast<C*>(dgamma.data_ptr()) : nullptr,
            dbeta.defined() ? static_cast<C*>(dbeta.data_ptr()) : nullptr, coef);
  launch_1d({"batch_norm dx kernel", rows * n, on.s}, batch_norm_dx_kernel<T>, xp, gp, mp,
            static_cast<const C*>(rstd), static_cast<const C*>(coef),
            static_cast<T*>(dx.data_ptr()), rows * n, n);
}

}  // namespace

void register_batch_norm_kernels() {
  MIXTAPE_CUDA_KERNEL(batch_norm, batch_norm_host);
  MIXTAPE_CUDA_KERNEL(batch_norm_backward, batch_norm_backward_host);
}

}  // namespace mixtape::cuda_backend
