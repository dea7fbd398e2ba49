// Test support: the bfloat16 of CUDA's cuda_bf16.h for the host emulation of the CUDA
// backend's kernels (tests/cudaemu/include/cuda_runtime.h says what it is); mixtape's own
// conversions (mixtape/core/half.h: round to nearest even).
#pragma once

#include <cstdint>

#include "mixtape/core/half.h"

struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(::mixtape::detail::float_to_bfloat16_bits(f)) {}      // NOLINT
  __nv_bfloat16(double d) : __nv_bfloat16(static_cast<float>(d)) {}                  // NOLINT
  __nv_bfloat16(int i) : __nv_bfloat16(static_cast<float>(i)) {}                     // NOLINT
  operator float() const { return ::mixtape::detail::bfloat16_bits_to_float(__x); }  // NOLINT
};

inline float __bfloat162float(__nv_bfloat16 h) {
  return ::mixtape::detail::bfloat16_bits_to_float(h.__x);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
