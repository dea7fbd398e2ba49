// Test support: the FP8 types of CUDA's cuda_fp8.h for the host emulation of the CUDA
// backend's kernels (tests/cudaemu/include/cuda_runtime.h says what it is); mixtape's own
// conversions (mixtape/core/float8.h).
#pragma once

#include <cstdint>

#include "cuda_fp16.h"
#include "mixtape/core/float8.h"

using __nv_fp8_storage_t = unsigned char;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

namespace mixtape::cuda_emu {
inline Float8Format format_of(__nv_fp8_interpretation_t i) {
  return i == __NV_E4M3 ? Float8Format::e4m3fn : Float8Format::e5m2;
}
}  // namespace mixtape::cuda_emu

inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float f, __nv_saturation_t s,
                                                __nv_fp8_interpretation_t i) {
  return ::mixtape::detail::float_to_float8_bits(
      ::mixtape::cuda_emu::format_of(i), f,
      s == __NV_SATFINITE ? ::mixtape::Saturation::finite : ::mixtape::Saturation::none);
}
// Every FP8 value is a float16 value: exact.
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t i) {
  return {::mixtape::detail::float_to_half_bits(
      ::mixtape::detail::float8_bits_to_float(::mixtape::cuda_emu::format_of(i), x))};
}

struct __nv_fp8_e4m3 {
  __nv_fp8_storage_t __x;
};
struct __nv_fp8_e5m2 {
  __nv_fp8_storage_t __x;
};
