// FP8 (OCP E4M3FN and E5M2) conversions, bit-exact and portable (mixtape/core/float8.h).
//
// Encoding works on the float32's bits: a normal FP8 result rounds the mantissa to 3 (2)
// bits to nearest even and rebiases the exponent (a carry into the next binade needs no
// special case), a subnormal one counts the smallest steps. Tests compare every boundary
// with a reference written from the definition (tests/test_float8.cpp).
#include "mixtape/core/float8.h"

#include <bit>
#include <cmath>
#include <cstdint>

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

// Written without branches (every case computed, the result selected by masks), so that the
// bulk conversion's loop below vectorises; the scalar conversion is the same function.
inline std::uint8_t encode(const Format& f, float x, bool saturate) {
  const auto u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t a = u & 0x7FFFFFFFu;  // |x|
  const auto sign = static_cast<std::uint32_t>((u >> 24) & 0x80u);
  const int emin = 1 - f.bias;  // the smallest normal exponent
  // |x| below the smallest normal FP8 number, as float32 bits.
  const std::uint32_t below_normal = static_cast<std::uint32_t>(127 + emin) << 23;
  // An FP8 subnormal (or zero, or the smallest normal): the number of smallest steps, exact in
  // float32 (a power-of-two scaling up), rounded to the nearest integer, ties to even, by the
  // float32 addition of 2^23 (steps < 2^M <= 8). The count is the pattern. (Other inputs
  // count 0 steps here, so that the conversion to an integer stays in range.)
  const std::uint32_t is_small = 0u - static_cast<std::uint32_t>(a < below_normal);  // all ones
  const float small = std::bit_cast<float>(a & is_small);
  const float steps =
      small * std::bit_cast<float>(static_cast<std::uint32_t>(127 + f.mantissa_bits - emin)
                                   << 23);  // 2^(M - emin)
  // (Through int32: SSE has no conversion to an unsigned integer, which a branch would stand in
  // for.)
  const auto subnormal =
      static_cast<std::uint32_t>(static_cast<std::int32_t>((steps + 8388608.0f) - 8388608.0f));
  // A normal FP8 number: the float32's exponent and mantissa, the mantissa rounded to M bits
  // (to nearest, ties to even; a carry moves into the exponent), the exponent rebiased. An
  // infinity lands past the largest finite number, as a finite overflow does.
  const int shift = 23 - f.mantissa_bits;
  const std::uint32_t rounded = (a + (1u << (shift - 1)) - 1u + ((a >> shift) & 1u)) >> shift;
  const std::uint32_t normal =
      rounded - (static_cast<std::uint32_t>(127 - f.bias) << f.mantissa_bits);
  // Beyond the largest finite number: saturated, or infinity (e5m2) / NaN (e4m3fn, whose 0x7F
  // is NaN and e5m2's 0x7C infinity).
  const std::uint32_t overflow = saturate ? f.max_bits : (f.ieee ? f.inf_bits : f.nan_bits);
  const std::uint32_t is_over = 0u - static_cast<std::uint32_t>(normal > f.max_bits);
  const std::uint32_t large = (overflow & is_over) | (normal & ~is_over);
  const std::uint32_t magnitude = (subnormal & is_small) | (large & ~is_small);
  // Every NaN becomes the one positive NaN pattern 0x7F, as CUDA's conversions write it.
  const std::uint32_t is_nan = 0u - static_cast<std::uint32_t>(a > 0x7F800000u);
  return static_cast<std::uint8_t>((f.nan_bits & is_nan) | ((sign | magnitude) & ~is_nan));
}

// The bulk conversion's loop, for the baseline instruction set and for AVX2 (twice the lanes;
// the same arithmetic, chosen at run time as half.cpp's conversions are).
template <const Format& F, bool kSaturate>
void encode_all(const float* x, std::uint8_t* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = encode(F, x[i], kSaturate);
}
#if defined(__x86_64__) && defined(__GNUC__)
template <const Format& F, bool kSaturate>
__attribute__((target("avx2"))) void encode_all_avx2(const float* x, std::uint8_t* out,
                                                     std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = encode(F, x[i], kSaturate);
}
bool use_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}
#endif

template <const Format& F, bool kSaturate>
void encode_any(const float* x, std::uint8_t* out, std::int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (use_avx2()) return encode_all_avx2<F, kSaturate>(x, out, n);
#endif
  encode_all<F, kSaturate>(x, out, n);
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

std::uint8_t float_to_float8_bits(Float8Format format, float f, Saturation s) {
  return encode(format == Float8Format::e4m3fn ? kE4M3FN : kE5M2, f, s == Saturation::finite);
}
void floats_to_float8_bits(Float8Format format, const float* x, std::uint8_t* out, std::int64_t n,
                           Saturation s) {
  const bool saturate = s == Saturation::finite;
  if (format == Float8Format::e4m3fn)
    saturate ? encode_any<kE4M3FN, true>(x, out, n) : encode_any<kE4M3FN, false>(x, out, n);
  else
    saturate ? encode_any<kE5M2, true>(x, out, n) : encode_any<kE5M2, false>(x, out, n);
}
float float8_bits_to_float(Float8Format format, std::uint8_t b) { return float8_values(format)[b]; }
const float* float8_values(Float8Format format) {
  return (format == Float8Format::e4m3fn ? e4m3fn_table() : e5m2_table()).value;
}

}  // namespace mixtape::detail
