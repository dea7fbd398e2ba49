// FP8 (OCP E4M3FN and E5M2) conversions, bit-exact and portable (mixtape/core/float8.h).
//
// Encoding works on the float's exact value: |f| is divided by the spacing of the FP8
// numbers at its magnitude (a power of two: exact in double), rounded to an integer with
// ties to even, and multiplied back; the result is then encoded, or overflows. A rounding
// that carries into the next binade (0.1111 -> 1.0000) needs no special case: the encoder
// reads the exponent from the rounded value.
#include "mixtape/core/float8.h"

#include <bit>
#include <cmath>

namespace mixtape::detail {
namespace {

// A format: exponent bits, mantissa bits, bias; whether the all-ones exponent holds
// infinities and NaNs (IEEE-like, e5m2) or is an ordinary binade whose all-ones mantissa
// alone is NaN (e4m3fn).
struct Format {
  int mantissa_bits;
  int bias;
  bool ieee;
  std::uint8_t max_bits;  // the largest finite number's bits (sign clear)
  std::uint8_t nan_bits;  // the NaN written
  std::uint8_t inf_bits;  // the infinity written (e5m2); unused for e4m3fn
};

constexpr Format kE4M3FN{3, 7, false, 0x7E, 0x7F, 0x00};
constexpr Format kE5M2{2, 15, true, 0x7B, 0x7F, 0x7C};

float decode(const Format& f, std::uint8_t b) {
  const bool negative = (b & 0x80) != 0;
  const int exponent_field = (b & 0x7F) >> f.mantissa_bits;
  const int mantissa = b & ((1 << f.mantissa_bits) - 1);
  const int all_ones = (1 << (7 - f.mantissa_bits)) - 1;
  float v;
  if (f.ieee && exponent_field == all_ones)
    v = mantissa == 0 ? INFINITY : NAN;
  else if (!f.ieee && exponent_field == all_ones && mantissa == (1 << f.mantissa_bits) - 1)
    v = NAN;
  else if (exponent_field == 0)  // subnormal: m * 2^(1 - bias - mantissa_bits)
    v = std::ldexp(static_cast<float>(mantissa), 1 - f.bias - f.mantissa_bits);
  else
    v = std::ldexp(static_cast<float>(mantissa + (1 << f.mantissa_bits)),
                   exponent_field - f.bias - f.mantissa_bits);
  return negative ? -v : v;
}

std::uint8_t encode(const Format& f, float x, Saturation s) {
  // Every NaN becomes the one positive NaN pattern 0x7F, as CUDA's conversions write it.
  if (std::isnan(x)) return f.nan_bits;
  const std::uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  const float max = decode(f, f.max_bits);
  const auto overflow = [&]() -> std::uint8_t {
    if (s == Saturation::finite) return sign | f.max_bits;
    return sign | (f.ieee ? f.inf_bits : f.nan_bits);
  };
  const double a = std::fabs(static_cast<double>(x));
  if (std::isinf(a)) return overflow();
  if (a == 0.0) return sign;
  // The spacing of FP8 numbers at a's magnitude: 2^(e - mantissa_bits) for a in [2^e,
  // 2^(e+1)), never below the subnormals' 2^(1 - bias - mantissa_bits).
  const int e = std::max(std::ilogb(a), 1 - f.bias);
  const double spacing = std::ldexp(1.0, e - f.mantissa_bits);
  const double rounded = std::nearbyint(a / spacing) * spacing;  // ties to even (default mode)
  if (rounded > static_cast<double>(max)) return overflow();
  if (rounded == 0.0) return sign;
  const int re = std::ilogb(rounded);
  if (re < 1 - f.bias)  // subnormal: exponent field 0
    return sign |
           static_cast<std::uint8_t>(rounded / std::ldexp(1.0, 1 - f.bias - f.mantissa_bits));
  const int mantissa =
      static_cast<int>(rounded / std::ldexp(1.0, re - f.mantissa_bits)) - (1 << f.mantissa_bits);
  return sign | static_cast<std::uint8_t>(((re + f.bias) << f.mantissa_bits) | mantissa);
}

// The 256 values of each format, decoded once.
struct Table {
  float value[256];
  explicit Table(const Format& f) {
    for (int b = 0; b < 256; ++b) value[b] = decode(f, static_cast<std::uint8_t>(b));
  }
};

const Table& e4m3fn_table() {
  static const Table t(kE4M3FN);
  return t;
}
const Table& e5m2_table() {
  static const Table t(kE5M2);
  return t;
}

}  // namespace

std::uint8_t float_to_e4m3fn_bits(float f, Saturation s) { return encode(kE4M3FN, f, s); }
std::uint8_t float_to_e5m2_bits(float f, Saturation s) { return encode(kE5M2, f, s); }
float e4m3fn_bits_to_float(std::uint8_t b) { return e4m3fn_table().value[b]; }
float e5m2_bits_to_float(std::uint8_t b) { return e5m2_table().value[b]; }

}  // namespace mixtape::detail
