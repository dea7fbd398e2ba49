// Dropout on the CPU (op dropout): each element times its factor, 1 / (1 - rate) or 0, from the
// counter-based hash of mixtape/core/dropout_hash.h (the mask is never stored: the backward
// pass runs this kernel on the gradient). A block of kBlock elements at a time, in float32 for
// the 16-bit floats.
#include <cstdint>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "mixtape/core/dropout_hash.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

template <typename T>
void dropout_kernel(const Tensor& x_t, double rate, std::uint64_t seed_value, const Tensor& seed_at,
                    const Tensor& out_t) {
  using C = compute_t<T>;
  const std::uint64_t seed = seed_of(seed_value, seed_at);
  const std::uint32_t threshold = dropout_threshold(rate);
  const auto keep = static_cast<C>(1.0 / (1.0 - rate));
  const T* x = static_cast<const T*>(x_t.const_data_ptr());
  T* out = static_cast<T*>(out_t.data_ptr());
  // x * Z, not a select: a NaN or an infinity dropped still gives NaN (a loss scale's overflow
  // check sees it).
  const auto apply = [&](const C* in, C* res, int64_t begin, int64_t len) {
#pragma omp simd
    for (int64_t c = 0; c < len; ++c)
      res[c] =
          in[c] *
          (dropout_keeps(seed, static_cast<std::uint64_t>(begin + c), threshold) ? keep : C(0));
  };
  parallel_blocks(x_t.numel(), [&](int64_t begin, int64_t end) {
    const int64_t len = end - begin;
    if constexpr (kReduced<T>) {
      C in[kBlock], res[kBlock];
      to_float(x + begin, in, len);
      apply(in, res, begin, len);
      from_float(res, out + begin, len);
    } else {
      apply(x + begin, out + begin, begin, len);
    }
  });
}

}  // namespace

void register_dropout_kernels() { MIXTAPE_CPU_KERNEL(dropout, dropout_kernel); }

}  // namespace mixtape::cpu
