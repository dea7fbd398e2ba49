// The softmax cross-entropy on the CPU (ops softmax_cross_entropy and its backward): a row
// at a time, the maximum, the sum of exponentials (float64 accumulation) and the picked
// logit in one pass over the row; the gradient recomputes the softmax from the saved
// log-sum-exp. Written by hand: a fused loss is not a BLAS or oneDNN operation.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

template <typename C>
MIXTAPE_ALWAYS_INLINE C row_lse(const C* x, int64_t c) {
  C m = -std::numeric_limits<C>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < c; ++j) m = x[j] > m ? x[j] : m;
  double s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < c; ++j) s += static_cast<double>(exp_any(x[j] - m));
  // A NaN logit makes the sum NaN (it is skipped by the maximum, not by the sum).
  return m + static_cast<C>(std::log(s));
}

template <typename T>
void cross_entropy_kernel(const Tensor& logits, const Tensor& labels_t, const Tensor& loss_t,
                          const Tensor& lse_t) {
  using C = compute_t<T>;
  const int64_t n = logits.dim(0), c = logits.dim(1);
  const T* x = static_cast<const T*>(logits.const_data_ptr());
  const auto* labels = static_cast<const int64_t*>(labels_t.const_data_ptr());
  C* loss = static_cast<C*>(loss_t.data_ptr());
  C* lse = static_cast<C*>(lse_t.data_ptr());
  for_each_row<C>(n, c, [&](int64_t i, RowBuffers<C>& buf) {
    const C* xr = as_compute(x + i * c, c, buf.in);
    const C l = row_lse(xr, c);
    const int64_t y = labels[i];
    lse[i] = l;
    loss[i] = y >= 0 && y < c ? l - xr[y] : std::numeric_limits<C>::quiet_NaN();
  });
}

template <typename T>
void cross_entropy_backward_kernel(const Tensor& logits, const Tensor& labels_t,
                                   const Tensor& lse_t, const Tensor& dloss_t,
                                   const Tensor& dlogits) {
  using C = compute_t<T>;
  const int64_t n = logits.dim(0), c = logits.dim(1);
  const T* x = static_cast<const T*>(logits.const_data_ptr());
  const auto* labels = static_cast<const int64_t*>(labels_t.const_data_ptr());
  const C* lse = static_cast<const C*>(lse_t.const_data_ptr());
  const C* dloss = static_cast<const C*>(dloss_t.const_data_ptr());
  T* dx = static_cast<T*>(dlogits.data_ptr());
  for_each_row<C>(n, c, [&](int64_t i, RowBuffers<C>& buf) {
    const C* xr = as_compute(x + i * c, c, buf.in);
    C* out = buf.out(c);
    const C l = lse[i], g = dloss[i];
#pragma omp simd
    for (int64_t j = 0; j < c; ++j) out[j] = g * exp_any(xr[j] - l);
    const int64_t y = labels[i];
    if (y >= 0 && y < c)
      out[y] -= g;
    else
      std::fill(out, out + c, std::numeric_limits<C>::quiet_NaN());
    from_compute(out, dx + i * c, c);
  });
}

}  // namespace

void register_cross_entropy_kernels() {
  MIXTAPE_CPU_KERNEL(softmax_cross_entropy, cross_entropy_kernel);
  MIXTAPE_CPU_KERNEL(softmax_cross_entropy_backward, cross_entropy_backward_kernel);
}

}  // namespace mixtape::cpu
