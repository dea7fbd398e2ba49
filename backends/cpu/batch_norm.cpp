// Batch normalisation on the CPU (ops batch_norm and batch_norm_backward): the columns' sums
// over fixed blocks of rows (each block's in float64, in parallel over the blocks), then the
// blocks' sums added in block order, so that the result does not depend on the number of
// threads; the normalisation and dx a block of rows at a time, in float32 (float64 for
// float64). Three passes over x forward (mean, variance, output; one with given statistics)
// and two over x and dy backward (one with given statistics and no parameter gradients), where
// BatchNormalization composed of ops made about ten, half of them in float32 over a 16-bit x.
// Written by hand: oneDNN 2.6's batch normalisation primitive takes float32 and bfloat16 alone (no
// float16, no float64) with its own statistics' layout; the op table needs all four dtypes and the
// same kernel contract on every backend.
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

// Rows per block of the partial sums: fixed, so the sums' order does not depend on the
// number of threads.
constexpr int64_t kBatchRows = 32;

int64_t batch_blocks(int64_t rows) { return (rows + kBatchRows - 1) / kBatchRows; }

// Each thread's buffers for a block's x and dy in the compute type and its results.
template <typename C>
struct BatchBlockBuffers {
  std::vector<C> x, dy, results;
  C* out(int64_t count) {
    results.resize(static_cast<std::size_t>(count));
    return results.data();
  }
};

// body(b, r0, count, buffers) for each block b of rows [r0, r0 + count), in parallel over the
// blocks when they hold more than kParallelGrain elements.
template <typename C, typename Body>
void for_each_batch_block(int64_t rows, int64_t n, Body&& body) {
  const int64_t blocks = batch_blocks(rows);
  const auto run = [&](int64_t b, BatchBlockBuffers<C>& buf) {
    const int64_t r0 = b * kBatchRows;
    body(b, r0, std::min(kBatchRows, rows - r0), buf);
  };
  if (rows * n <= kParallelGrain || blocks == 1) {
    BatchBlockBuffers<C> buf;
    for (int64_t b = 0; b < blocks; ++b) run(b, buf);
    return;
  }
#pragma omp parallel
  {
    BatchBlockBuffers<C> buf;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) run(b, buf);
  }
}

// sums[j] = the blocks' partial sums part[b * n + j] added in block order.
void add_batch_blocks(const std::vector<double>& part, int64_t blocks, int64_t n, double* sums) {
  std::fill(sums, sums + n, 0.0);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < n; ++j) sums[j] += part[static_cast<std::size_t>(b * n + j)];
}

// 1 / sqrt(var + epsilon) in float64, rounded once: the forward pass and the backward pass
// find the same rstd from the var the forward pass wrote.
template <typename C>
C batch_rstd(C var, double epsilon) {
  return static_cast<C>(1.0 / std::sqrt(static_cast<double>(var) + epsilon));
}

// out[j] = the mean over the rows of term(x[r, j] in the compute type, j), the sums in float64
// per block of rows, the blocks' sums added in block order.
template <typename T, typename Term>
void column_means(const T* x, int64_t rows, int64_t n, Term term, compute_t<T>* out) {
  using C = compute_t<T>;
  const int64_t blocks = batch_blocks(rows);
  std::vector<double> part(static_cast<std::size_t>(blocks * n)), sums(static_cast<std::size_t>(n));
  for_each_batch_block<C>(rows, n,
                          [&](int64_t b, int64_t r0, int64_t count, BatchBlockBuffers<C>& buf) {
                            const C* xb = as_compute(x + r0 * n, count * n, buf.x);
                            double* p = part.data() + b * n;
                            std::fill(p, p + n, 0.0);
                            for (int64_t r = 0; r < count; ++r) {
#pragma omp simd
                              for (int64_t j = 0; j < n; ++j) p[j] += term(xb[r * n + j], j);
                            }
                          });
  add_batch_blocks(part, blocks, n, sums.data());
  for (int64_t j = 0; j < n; ++j)
    out[j] = static_cast<C>(sums[static_cast<std::size_t>(j)] / static_cast<double>(rows));
}

// Each column's mean and biased variance over the rows (rows >= 1): the mean, then the
// variance as the mean of (x - mean)^2 (two passes: one pass's sum of squares loses the spread
// of a column whose mean is large next to it).
template <typename T>
void batch_statistics(const T* x, int64_t rows, int64_t n, compute_t<T>* mean, compute_t<T>* var) {
  using C = compute_t<T>;
  column_means(
      x, rows, n, [](C v, int64_t) { return static_cast<double>(v); }, mean);
  column_means(
      x, rows, n,
      [mean](C v, int64_t j) {
        const double c = static_cast<double>(v - mean[j]);
        return c * c;
      },
      var);
}

template <typename T>
void batch_norm_kernel(const Tensor& x_t, const Tensor& gamma_t, const Tensor& beta_t,
                       double epsilon, bool given, const Tensor& out_t, const Tensor& mean_t,
                       const Tensor& var_t) {
  using C = compute_t<T>;
  const int64_t n = x_t.shape().back(), rows = x_t.numel() / n;
  const T* x = static_cast<const T*>(x_t.const_data_ptr());
  const C* gamma = gamma_t.defined() ? static_cast<const C*>(gamma_t.const_data_ptr()) : nullptr;
  const C* beta = beta_t.defined() ? static_cast<const C*>(beta_t.const_data_ptr()) : nullptr;
  T* out = static_cast<T*>(out_t.data_ptr());
  C* mean = static_cast<C*>(mean_t.data_ptr());
  C* var = static_cast<C*>(var_t.data_ptr());
  if (!given) batch_statistics(x, rows, n, mean, var);
  std::vector<C> rstd(static_cast<std::size_t>(n));
  for (int64_t j = 0; j < n; ++j) rstd[static_cast<std::size_t>(j)] = batch_rstd(var[j], epsilon);
  const C* rs = rstd.data();
  const auto normalise = [&](int64_t, int64_t r0, int64_t count, BatchBlockBuffers<C>& buf) {
    const C* xb = as_compute(x + r0 * n, count * n, buf.x);
    C* y = buf.out(count * n);
    for (int64_t r = 0; r < count; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        C o = (xb[r * n + j] - mean[j]) * rs[j];
        if (gamma) o *= gamma[j];
        if (beta) o += beta[j];
        y[r * n + j] = o;
      }
    }
    from_compute(y, out + r0 * n, count * n);
  };
  for_each_batch_block<C>(rows, n, normalise);
}

template <typename T>
void batch_norm_backward_kernel(const Tensor& x_t, const Tensor& gamma_t, const Tensor& mean_t,
                                const Tensor& var_t, double epsilon, bool given, const Tensor& dy_t,
                                const Tensor& dx_t, const Tensor& dgamma_t, const Tensor& dbeta_t) {
  using C = compute_t<T>;
  const int64_t n = x_t.shape().back(), rows = x_t.numel() / n, blocks = batch_blocks(rows);
  const T* x = static_cast<const T*>(x_t.const_data_ptr());
  const C* gamma = gamma_t.defined() ? static_cast<const C*>(gamma_t.const_data_ptr()) : nullptr;
  const C* mean = static_cast<const C*>(mean_t.const_data_ptr());
  const C* var = static_cast<const C*>(var_t.const_data_ptr());
  const T* dy = static_cast<const T*>(dy_t.const_data_ptr());
  T* dx = static_cast<T*>(dx_t.data_ptr());
  C* dgamma = dgamma_t.defined() ? static_cast<C*>(dgamma_t.data_ptr()) : nullptr;
  C* dbeta = dbeta_t.defined() ? static_cast<C*>(dbeta_t.data_ptr()) : nullptr;
  std::vector<C> rstd(static_cast<std::size_t>(n));
  for (int64_t j = 0; j < n; ++j) rstd[static_cast<std::size_t>(j)] = batch_rstd(var[j], epsilon);
  const C* rs = rstd.data();
  // Per block: the sums of dy and of dy xhat, then added up block by block (not needed for
  // given statistics without dgamma and dbeta).
  std::vector<double> part_b(static_cast<std::size_t>(blocks * n)),
      part_g(static_cast<std::size_t>(blocks * n)), sum_b(static_cast<std::size_t>(n), 0.0),
      sum_g(static_cast<std::size_t>(n), 0.0);
  const auto sums = [&](int64_t b, int64_t r0, int64_t count, BatchBlockBuffers<C>& buf) {
    const C* xb = as_compute(x + r0 * n, count * n, buf.x);
    const C* gb = as_compute(dy + r0 * n, count * n, buf.dy);
    double* pb = part_b.data() + b * n;
    double* pg = part_g.data() + b * n;
    std::fill(pb, pb + n, 0.0);
    std::fill(pg, pg + n, 0.0);
    for (int64_t r = 0; r < count; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const C g = gb[r * n + j], xh = (xb[r * n + j] - mean[j]) * rs[j];
        pb[j] += static_cast<double>(g);
        pg[j] += static_cast<double>(g * xh);
      }
    }
  };
  if (!given || dgamma || dbeta) {
    for_each_batch_block<C>(rows, n, sums);
    add_batch_blocks(part_b, blocks, n, sum_b.data());
    add_batch_blocks(part_g, blocks, n, sum_g.data());
  }
  // dx = k (dy - mean(dy) - xhat mean(dy xhat)) with k = gamma rstd, per column; the means 0
  // for given statistics (no gradient through them).
  std::vector<C> k(static_cast<std::size_t>(n)), mdy(static_cast<std::size_t>(n), C(0)),
      mdyx(static_cast<std::size_t>(n), C(0));
  for (int64_t j = 0; j < n; ++j) {
    const auto u = static_cast<std::size_t>(j);
    if (dgamma) dgamma[j] = static_cast<C>(sum_g[u]);
    if (dbeta) dbeta[j] = static_cast<C>(sum_b[u]);
    k[u] = gamma ? gamma[j] * rs[j] : rs[j];
    if (given) continue;
    mdy[u] = static_cast<C>(sum_b[u] / static_cast<double>(rows));
    mdyx[u] = static_cast<C>(sum_g[u] / static_cast<double>(rows));
  }
  const auto input_gradient = [&](int64_t, int64_t r0, int64_t count, BatchBlockBuffers<C>& buf) {
    const C* xb = as_compute(x + r0 * n, count * n, buf.x);
    const C* gb = as_compute(dy + r0 * n, count * n, buf.dy);
    C* res = buf.out(count * n);
    for (int64_t r = 0; r < count; ++r) {
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const auto u = static_cast<std::size_t>(j);
        const C xh = (xb[r * n + j] - mean[j]) * rs[j];
        res[r * n + j] = k[u] * (gb[r * n + j] - mdy[u] - xh * mdyx[u]);
      }
    }
    from_compute(res, dx + r0 * n, count * n);
  };
  for_each_batch_block<C>(rows, n, input_gradient);
}

}  // namespace

void register_batch_norm_kernels() {
  MIXTAPE_CPU_KERNEL(batch_norm, batch_norm_kernel);
  MIXTAPE_CPU_KERNEL(batch_norm_backward, batch_norm_backward_kernel);
}

}  // namespace mixtape::cpu
