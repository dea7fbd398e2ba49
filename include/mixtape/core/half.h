// half (IEEE 754 binary16) and bfloat16 scalar types.
//
// Conversions from float32 round to nearest, ties to even, bit-exactly: subnormals are
// kept, values past the largest finite number become +-inf, NaN stays NaN (quiet).
// Arithmetic on the scalars goes through float32 and rounds the result back, so
// half(256) * half(256) is inf and half(1e-5) * half(1e-5) is 0.
// Bulk conversion routines (F16C on x86 when the CPU has it) live at the bottom.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace mixtape {

namespace detail {
// Scalar bit-level conversions (portable, bit-exact).
std::uint16_t float_to_half_bits(float f);
float half_bits_to_float(std::uint16_t h);
std::uint16_t float_to_bfloat16_bits(float f);
// v as a float32 rounded to odd: exact values stay, inexact ones are truncated toward zero
// and get their last mantissa bit set, so that a later rounding to 16 or 8 bits (half,
// bfloat16, float8) is the correct rounding of v itself. NaN stays NaN; beyond the float32
// range, +-FLT_MAX (which still rounds to infinity or saturates there).
float round_to_odd_float(double v);
inline float bfloat16_bits_to_float(std::uint16_t b) {
  std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
}  // namespace detail

// IEEE binary16: 1 sign, 5 exponent, 10 mantissa bits.
struct half {
  std::uint16_t bits = 0;

  half() = default;
  half(float f) : bits(detail::float_to_half_bits(f)) {}  // NOLINT(google-explicit-constructor)
  static half from_bits(std::uint16_t b) {
    half h;
    h.bits = b;
    return h;
  }
  operator float() const { return detail::half_bits_to_float(bits); }  // NOLINT
};

// bfloat16: the top 16 bits of a float32 (1 sign, 8 exponent, 7 mantissa bits).
struct bfloat16 {
  std::uint16_t bits = 0;

  bfloat16() = default;
  bfloat16(float f) : bits(detail::float_to_bfloat16_bits(f)) {}  // NOLINT
  static bfloat16 from_bits(std::uint16_t b) {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  operator float() const { return detail::bfloat16_bits_to_float(bits); }  // NOLINT
};

#define MIXTAPE_REDUCED_FLOAT_OPS(T)                              \
  inline T operator+(T a, T b) { return T(float(a) + float(b)); } \
  inline T operator-(T a, T b) { return T(float(a) - float(b)); } \
  inline T operator*(T a, T b) { return T(float(a) * float(b)); } \
  inline T operator/(T a, T b) { return T(float(a) / float(b)); } \
  inline T operator-(T a) { return T::from_bits(static_cast<std::uint16_t>(a.bits ^ 0x8000u)); }
MIXTAPE_REDUCED_FLOAT_OPS(half)
MIXTAPE_REDUCED_FLOAT_OPS(bfloat16)
#undef MIXTAPE_REDUCED_FLOAT_OPS

// Bulk conversions, vectorised (F16C / AVX2 where the CPU has them, chosen at run time).
void convert_half_to_float(const half* src, float* dst, std::size_t n);
void convert_float_to_half(const float* src, half* dst, std::size_t n);
void convert_bfloat16_to_float(const bfloat16* src, float* dst, std::size_t n);
void convert_float_to_bfloat16(const float* src, bfloat16* dst, std::size_t n);

// True when the bulk half conversions use the F16C instructions on this CPU.
bool has_f16c();

}  // namespace mixtape
