// The two 8-bit floating formats of the OCP FP8 specification (OFP8, v1.0), scalar types
// for storage and conversion; tensors of them only store, copy and cast (no arithmetic:
// a matmul of FP8 operands is its own scaled op).
//
//   float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinities; one NaN
//                  pattern per sign (S.1111.111). Largest finite 448, smallest subnormal
//                  2^-9.
//   float8_e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like: infinities
//                  (S.11111.00) and NaNs (S.11111.xx). Largest finite 57344, smallest
//                  subnormal 2^-16.
//
// Conversions to FP8 round to nearest, ties to even, from the exact value. A value whose
// rounding lies beyond the largest finite number either saturates to +-max (Saturation::
// finite, the default, as Transformer Engine and torchao cast, and CUDA's __NV_SATFINITE:
// infinities saturate too) or overflows (Saturation::none: infinity for e5m2, NaN for
// e4m3fn, which has no infinity). Every NaN becomes 0x7F, the positive NaN of both formats,
// as CUDA's conversions write it. Conversions from FP8 to float32 are exact.
#pragma once

#include <cstdint>

namespace mixtape {

enum class Saturation : std::uint8_t { finite, none };

// The two formats.
enum class Float8Format : std::uint8_t { e4m3fn, e5m2 };

namespace detail {
std::uint8_t float_to_float8_bits(Float8Format format, float f, Saturation s);
// The same conversion of x[0, n) into out (the CPU kernels' bulk path: one call, a vectorised
// loop).
void floats_to_float8_bits(Float8Format format, const float* x, std::uint8_t* out, std::int64_t n,
                           Saturation s);
float float8_bits_to_float(Float8Format format, std::uint8_t b);
// The 256 values of a format as float32, indexed by the bits (the table the conversion reads).
const float* float8_values(Float8Format format);
}  // namespace detail

// One byte of a float8 format: float8_e4m3fn and float8_e5m2 below.
template <Float8Format F>
struct float8 {
  std::uint8_t bits = 0;

  float8() = default;
  // Saturating (see above); float8(f, Saturation::none) overflows (NaN for e4m3fn, infinity
  // for e5m2).
  float8(float f, Saturation s = Saturation::finite)  // NOLINT(google-explicit-constructor)
      : bits(detail::float_to_float8_bits(F, f, s)) {}
  static float8 from_bits(std::uint8_t b) {
    float8 v;
    v.bits = b;
    return v;
  }
  operator float() const { return detail::float8_bits_to_float(F, bits); }  // NOLINT
  // The largest finite value.
  static constexpr float max() { return F == Float8Format::e4m3fn ? 448.0f : 57344.0f; }
};

using float8_e4m3fn = float8<Float8Format::e4m3fn>;
using float8_e5m2 = float8<Float8Format::e5m2>;

}  // namespace mixtape
