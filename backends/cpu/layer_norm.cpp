// Layer normalisation on the CPU (ops layer_norm and layer_norm_backward): a row at a time,
// in float32 (float64 for float64), each row's sums in float64. Written by hand: oneDNN 2.6
// has a layer normalisation primitive, but for float32 and bfloat16 alone (no float16, no
// float64) and with its own statistics' layout; the op table needs all four dtypes and the
// same kernel contract on every backend.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// Rows per block of the dgamma / dbeta partial sums: fixed, so the sums' order does not
// depend on the number of threads.
constexpr int64_t kRowsPerBlock = 32;

// One row's statistics and output: mean and rstd from float64 sums, y = (x - mean) rstd
// gamma + beta in C.
template <typename C>
MIXTAPE_ALWAYS_INLINE void normalize_row_impl(const C* xr, int64_t n, const C* gamma, const C* beta,
                                              double epsilon, C* y, C* mean, C* rstd) {
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += static_cast<double>(xr[j]);
  const C mu = static_cast<C>(s / static_cast<double>(n));
  double v = 0;
#pragma omp simd reduction(+ : v)
  for (int64_t j = 0; j < n; ++j) {
    const double c = static_cast<double>(xr[j] - mu);
    v += c * c;
  }
  const C rs = static_cast<C>(1.0 / std::sqrt(v / static_cast<double>(n) + epsilon));
  *mean = mu;
  *rstd = rs;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    C o = (xr[j] - mu) * rs;
    if (gamma) o *= gamma[j];
    if (beta) o += beta[j];
    y[j] = o;
  }
}

// One row's dx (before its rounding) and its terms of the dgamma / dbeta sums: g = dy gamma,
// dx = rstd (g - mean(g) - xhat mean(g xhat)), the means from float64 sums; xhat and gg are
// the row's scratch.
template <typename C>
MIXTAPE_ALWAYS_INLINE void backward_row_impl(const C* xr, const C* gr, int64_t n, const C* gamma,
                                             C mu, C rs, C* xhat, C* gg, C* res, C* pg, C* pb) {
  double sg = 0, sgx = 0;
#pragma omp simd reduction(+ : sg, sgx)
  for (int64_t j = 0; j < n; ++j) {
    const C xh = (xr[j] - mu) * rs;
    const C g = gamma ? gr[j] * gamma[j] : gr[j];
    xhat[j] = xh;
    gg[j] = g;
    sg += static_cast<double>(g);
    sgx += static_cast<double>(g * xh);
  }
  const C mg = static_cast<C>(sg / static_cast<double>(n));
  const C mgx = static_cast<C>(sgx / static_cast<double>(n));
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) res[j] = rs * (gg[j] - mg - xhat[j] * mgx);
  if (pg) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      pg[j] += gr[j] * xhat[j];
      pb[j] += gr[j];
    }
  }
}

// Each row body compiled for the baseline and for AVX2 + FMA (the float64 sums four lanes
// wide), picked at run time as the other kernels pick theirs. As in those, FMA contraction may
// change the last bit of a result (xhat gamma + beta, dx, dgamma's terms) and the float64
// reductions group their terms by other lanes; dbeta's sums are the same additions.
template <typename C>
void normalize_row_base(const C* xr, int64_t n, const C* gamma, const C* beta, double epsilon, C* y,
                        C* mean, C* rstd) {
  normalize_row_impl(xr, n, gamma, beta, epsilon, y, mean, rstd);
}
template <typename C>
void backward_row_base(const C* xr, const C* gr, int64_t n, const C* gamma, C mu, C rs, C* xhat,
                       C* gg, C* res, C* pg, C* pb) {
  backward_row_impl(xr, gr, n, gamma, mu, rs, xhat, gg, res, pg, pb);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
template <typename C>
__attribute__((target("avx2,fma"))) void normalize_row_avx2(const C* xr, int64_t n, const C* gamma,
                                                            const C* beta, double epsilon, C* y,
                                                            C* mean, C* rstd) {
  normalize_row_impl(xr, n, gamma, beta, epsilon, y, mean, rstd);
}
template <typename C>
__attribute__((target("avx2,fma"))) void backward_row_avx2(const C* xr, const C* gr, int64_t n,
                                                           const C* gamma, C mu, C rs, C* xhat,
                                                           C* gg, C* res, C* pg, C* pb) {
  backward_row_impl(xr, gr, n, gamma, mu, rs, xhat, gg, res, pg, pb);
}
#endif
template <typename C>
auto normalize_row() {
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) return &normalize_row_avx2<C>;
#endif
  return &normalize_row_base<C>;
}
template <typename C>
auto backward_row() {
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) return &backward_row_avx2<C>;
#endif
  return &backward_row_base<C>;
}

template <typename T>
void layer_norm_kernel(const Tensor& x_t, const Tensor& gamma_t, const Tensor& beta_t,
                       double epsilon, const Tensor& out_t, const Tensor& mean_t,
                       const Tensor& rstd_t) {
  using C = compute_t<T>;
  const int64_t n = x_t.shape().back(), rows = x_t.numel() / n;
  const T* x = static_cast<const T*>(x_t.const_data_ptr());
  const C* gamma = gamma_t.defined() ? static_cast<const C*>(gamma_t.const_data_ptr()) : nullptr;
  const C* beta = beta_t.defined() ? static_cast<const C*>(beta_t.const_data_ptr()) : nullptr;
  T* out = static_cast<T*>(out_t.data_ptr());
  C* mean = static_cast<C*>(mean_t.data_ptr());
  C* rstd = static_cast<C*>(rstd_t.data_ptr());
  const auto row_fn = normalize_row<C>();
  for_each_row<C>(rows, n, [&](int64_t r, RowBuffers<C>& buf) {
    C* y = buf.out(n);
    row_fn(as_compute(x + r * n, n, buf.in), n, gamma, beta, epsilon, y, mean + r, rstd + r);
    from_compute(y, out + r * n, n);
  });
}

template <typename T>
void layer_norm_backward_kernel(const Tensor& x_t, const Tensor& gamma_t, const Tensor& mean_t,
                                const Tensor& rstd_t, const Tensor& dy_t, const Tensor& dx_t,
                                const Tensor& dgamma_t, const Tensor& dbeta_t) {
  using C = compute_t<T>;
  const int64_t n = x_t.shape().back(), rows = x_t.numel() / n;
  const T* x = static_cast<const T*>(x_t.const_data_ptr());
  const C* gamma = gamma_t.defined() ? static_cast<const C*>(gamma_t.const_data_ptr()) : nullptr;
  const C* mean = static_cast<const C*>(mean_t.const_data_ptr());
  const C* rstd = static_cast<const C*>(rstd_t.const_data_ptr());
  const T* dy = static_cast<const T*>(dy_t.const_data_ptr());
  T* dx = static_cast<T*>(dx_t.data_ptr());
  const bool params = dgamma_t.defined() || dbeta_t.defined();
  const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  // Per block of rows: its sums of dy xhat and of dy, then added up block by block.
  std::vector<C> part_g(params ? static_cast<std::size_t>(blocks * n) : 0, C(0)),
      part_b(params ? static_cast<std::size_t>(blocks * n) : 0, C(0));
  const auto row_fn = backward_row<C>();
  parallel_region(rows * n > kParallelGrain, [&] {
    std::vector<C> xin(kReduced<T> ? static_cast<std::size_t>(n) : 0),
        gin(kReduced<T> ? static_cast<std::size_t>(n) : 0), xhat(static_cast<std::size_t>(n)),
        gg(static_cast<std::size_t>(n)), res(static_cast<std::size_t>(n));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      C* pg = params ? part_g.data() + b * n : nullptr;
      C* pb = params ? part_b.data() + b * n : nullptr;
      for (int64_t r = b * kRowsPerBlock; r < std::min(rows, (b + 1) * kRowsPerBlock); ++r) {
        row_fn(as_compute(x + r * n, n, xin), as_compute(dy + r * n, n, gin), n, gamma, mean[r],
               rstd[r], xhat.data(), gg.data(), res.data(), pg, pb);
        from_compute(res.data(), dx + r * n, n);
      }
    }
  });
  if (!params) return;
  C* dgamma = dgamma_t.defined() ? static_cast<C*>(dgamma_t.data_ptr()) : nullptr;
  C* dbeta = dbeta_t.defined() ? static_cast<C*>(dbeta_t.data_ptr()) : nullptr;
  for (int64_t j = 0; j < n; ++j) {
    C sg = 0, sb = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      sg += part_g[static_cast<std::size_t>(b * n + j)];
      sb += part_b[static_cast<std::size_t>(b * n + j)];
    }
    if (dgamma) dgamma[j] = sg;
    if (dbeta) dbeta[j] = sb;
  }
}

}  // namespace

void register_layer_norm_kernels() {
  MIXTAPE_CPU_KERNEL(layer_norm, layer_norm_kernel);
  MIXTAPE_CPU_KERNEL(layer_norm_backward, layer_norm_backward_kernel);
}

}  // namespace mixtape::cpu
