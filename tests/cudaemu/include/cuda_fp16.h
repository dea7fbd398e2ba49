// Test support: the 16-bit float of CUDA's cuda_fp16.h for the host emulation of the CUDA
// backend's kernels (tests/cudaemu/include/cuda_runtime.h says what it is). Its conversions
// are mixtape's own (mixtape/core/half.h: round to nearest even, exact), as the GPU's are.
#pragma once

#include <cstdint>

#include "mixtape/core/half.h"

struct __half_raw {
  unsigned short x;
};

struct __half {
  unsigned short __x;
  __half() = default;
  constexpr __half(__half_raw r) : __x(r.x) {}  // NOLINT(google-explicit-constructor)
  __half(float f) : __x(::mixtape::detail::float_to_half_bits(f)) {}             // NOLINT
  __half(double d) : __half(static_cast<float>(d)) {}                            // NOLINT
  __half(int i) : __half(static_cast<float>(i)) {}                               // NOLINT
  operator float() const { return ::mixtape::detail::half_bits_to_float(__x); }  // NOLINT
};

inline float __half2float(__half h) { return ::mixtape::detail::half_bits_to_float(h.__x); }
inline __half __float2half_rn(float f) {
  return __half(__half_raw{::mixtape::detail::float_to_half_bits(f)});
}
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
