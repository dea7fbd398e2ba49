// Tests for the half / bfloat16 conversions: exhaustive 16-bit decoding and round trips,
// float -> 16-bit rounding against independent references, and bulk == scalar.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "mixtape/core/half.h"

namespace {

using mixtape::bfloat16;
using mixtape::half;
namespace detail = mixtape::detail;

std::uint32_t fbits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

bool half_is_nan(std::uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }
bool bf16_is_nan(std::uint16_t b) { return (b & 0x7F80u) == 0x7F80u && (b & 0x7Fu) != 0; }

// Reference decoding of an fp16 pattern from its fields (NaN handled by the caller).
double ref_half_value(std::uint16_t h) {
  const int e = (h >> 10) & 0x1F;
  const int m = h & 0x3FF;
  const double sign = (h & 0x8000u) ? -1.0 : 1.0;
  if (e == 31) return sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -24);
  return sign * std::ldexp(1024 + m, e - 25);
}

// Reference decoding of a bf16 pattern from its fields (NaN handled by the caller).
double ref_bf16_value(std::uint16_t b) {
  const int e = (b >> 7) & 0xFF;
  const int m = b & 0x7F;
  const double sign = (b & 0x8000u) ? -1.0 : 1.0;
  if (e == 255) return sign * std::numeric_limits<double>::infinity();
  if (e == 0) return sign * std::ldexp(m, -133);
  return sign * std::ldexp(128 + m, e - 134);
}

// Independent reference rounding of a non-NaN float to a format with `mant` stored mantissa
// bits, minimum normal exponent `emin` and maximum exponent `emax`, in double arithmetic:
// round |f| / ulp to an integer with nearbyint (ties to even), then re-encode the result.
std::uint16_t ref_round(float f, int mant, int emin, int emax) {
  const std::uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
  const int bias = -emin + 1;
  const std::uint16_t inf = static_cast<std::uint16_t>(((2 * bias + 1) << mant));
  const double d = std::fabs(static_cast<double>(f));
  if (std::isinf(d)) return sign | inf;
  if (d == 0.0) return sign;
  int e2;
  std::frexp(d, &e2);  // d = x * 2^e2 with x in [0.5, 1)
  const int expo = e2 - 1 < emin ? emin : e2 - 1;
  const double ulp = std::ldexp(1.0, expo - mant);
  const double r = std::nearbyint(d / ulp) * ulp;  // exact: ulp is a power of two
  if (r >= std::ldexp(1.0, emax + 1)) return sign | inf;
  if (r < std::ldexp(1.0, emin)) {
    const auto q = static_cast<std::uint16_t>(r / std::ldexp(1.0, emin - mant));
    return static_cast<std::uint16_t>(sign | q);
  }
  std::frexp(r, &e2);
  const int re = e2 - 1;
  const auto frac = static_cast<std::uint32_t>(std::ldexp(r, mant - re)) - (1u << mant);
  return static_cast<std::uint16_t>(sign | ((re + bias) << mant) | frac);
}

std::uint16_t ref_half(float f) { return ref_round(f, 10, -14, 15); }
std::uint16_t ref_bf16(float f) { return ref_round(f, 7, -126, 127); }

#if defined(__FLT16_MAX__)
std::uint16_t compiler_half(float f) {
  const auto h = static_cast<_Float16>(f);
  std::uint16_t b;
  std::memcpy(&b, &h, sizeof b);
  return b;
}
#endif

// Checks float -> half and float -> bf16 for one input against the references.
// Returns false (after reporting) on the first mismatch so callers can stop early.
bool check_float(float f) {
  const std::uint16_t h = detail::float_to_half_bits(f);
  const std::uint16_t b = detail::float_to_bfloat16_bits(f);
  const std::uint32_t u = fbits(f);
  if (std::isnan(f)) {
    // Sign kept, quiet NaN, top payload bits kept.
    const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
    const auto want_h = static_cast<std::uint16_t>(sign | 0x7E00u | ((u >> 13) & 0x3FFu));
    const auto want_b = static_cast<std::uint16_t>((u >> 16) | 0x40u);
    if (h != want_h || b != want_b || !half_is_nan(h) || !bf16_is_nan(b)) {
      INFO("NaN input " << std::hex << u << " half " << h << " bf16 " << b);
      CHECK(false);
      return false;
    }
    return true;
  }
  const std::uint16_t rh = ref_half(f);
  const std::uint16_t rb = ref_bf16(f);
  bool ok = h == rh && b == rb;
#if defined(__FLT16_MAX__)
  ok = ok && h == compiler_half(f);
#endif
  if (!ok) {
    INFO("input " << std::hex << u << " half " << h << " ref " << rh << " bf16 " << b << " ref "
                  << rb);
    CHECK(false);
  }
  return ok;
}

}  // namespace

TEST_CASE("half: every fp16 pattern decodes exactly and round-trips", "[half]") {
  std::size_t nans = 0;
  std::size_t bad = 0;
  for (std::uint32_t i = 0; i < 0x10000u; ++i) {
    const auto h = static_cast<std::uint16_t>(i);
    const float f = detail::half_bits_to_float(h);
    const std::uint16_t back = detail::float_to_half_bits(f);
    if (half_is_nan(h)) {
      ++nans;
      // Decoding gives a quiet float NaN with the same sign and the payload in the top bits;
      // re-encoding sets the fp16 quiet bit (0x0200) and otherwise keeps the bits.
      const std::uint32_t want = ((h & 0x8000u) << 16) | 0x7FC00000u | ((h & 0x3FFu) << 13);
      if (fbits(f) != want || back != (h | 0x0200u)) ++bad;
      continue;
    }
    const auto ref = static_cast<float>(ref_half_value(h));
    if (fbits(f) != fbits(ref) || back != h) ++bad;  // bit compare also checks -0
  }
  CHECK(nans == 2 * 1023);
  CHECK(bad == 0);
}

TEST_CASE("half/bfloat16: every bf16 pattern decodes exactly and round-trips", "[half]") {
  std::size_t bad = 0;
  for (std::uint32_t i = 0; i < 0x10000u; ++i) {
    const auto b = static_cast<std::uint16_t>(i);
    const float f = detail::bfloat16_bits_to_float(b);
    const std::uint16_t back = detail::float_to_bfloat16_bits(f);
    if (bf16_is_nan(b)) {
      // Decoding is exact (signalling NaNs stay signalling in float32); re-encoding quiets.
      if (!std::isnan(f) || fbits(f) != (std::uint32_t{b} << 16) || back != (b | 0x0040u)) ++bad;
      continue;
    }
    const auto ref = static_cast<float>(ref_bf16_value(b));
    if (fbits(f) != fbits(ref) || back != b) ++bad;
  }
  CHECK(bad == 0);
}

TEST_CASE("half/bfloat16: edge cases round to nearest even", "[half]") {
  const float inf = std::numeric_limits<float>::infinity();
  // Exact expectations for the documented edge cases.
  CHECK(detail::float_to_half_bits(65504.0f) == 0x7BFF);
  CHECK(detail::float_to_half_bits(65519.99f) == 0x7BFF);
  CHECK(detail::float_to_half_bits(std::nextafter(65520.0f, 0.0f)) == 0x7BFF);
  CHECK(detail::float_to_half_bits(65520.0f) == 0x7C00);
  CHECK(detail::float_to_half_bits(-65520.0f) == 0xFC00);
  CHECK(detail::float_to_half_bits(1e9f) == 0x7C00);
  CHECK(detail::float_to_half_bits(inf) == 0x7C00);
  CHECK(detail::float_to_half_bits(-inf) == 0xFC00);
  CHECK(detail::float_to_half_bits(0.0f) == 0x0000);
  CHECK(detail::float_to_half_bits(-0.0f) == 0x8000);
  CHECK(detail::float_to_half_bits(std::ldexp(1.0f, -14)) == 0x0400);       // min normal
  CHECK(detail::float_to_half_bits(bits_to_float(0x387FFFFFu)) == 0x0400);  // up into normal
  CHECK(detail::float_to_half_bits(std::ldexp(1023.0f, -24)) == 0x03FF);    // max subnormal
  CHECK(detail::float_to_half_bits(std::ldexp(1023.5f, -24)) == 0x0400);    // tie -> even
  CHECK(detail::float_to_half_bits(std::ldexp(1022.5f, -24)) == 0x03FE);    // tie -> even
  CHECK(detail::float_to_half_bits(std::ldexp(1.0f, -24)) == 0x0001);       // min subnormal
  CHECK(detail::float_to_half_bits(std::ldexp(1.0f, -25)) == 0x0000);       // tie -> 0
  CHECK(detail::float_to_half_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001);
  CHECK(detail::float_to_half_bits(-std::ldexp(1.5f, -24)) == 0x8002);  // tie -> even
  CHECK(detail::float_to_half_bits(std::ldexp(1.0f, -30)) == 0x0000);
  CHECK(detail::float_to_half_bits(-std::numeric_limits<float>::denorm_min()) == 0x8000);
  CHECK(detail::float_to_half_bits(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);      // tie -> even
  CHECK(detail::float_to_half_bits(1.0f + 3 * std::ldexp(1.0f, -11)) == 0x3C02);  // tie -> even
  CHECK(detail::float_to_half_bits(1023.75f) == 0x6400);                          // tie -> 1024
  CHECK(detail::float_to_half_bits(1023.25f) == 0x63FE);                          // tie -> 1023

  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x3F808000u)) == 0x3F80);  // tie -> even
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x3F818000u)) == 0x3F82);  // tie -> even
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x3F808001u)) == 0x3F81);
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x7F7FFFFFu)) == 0x7F80);  // FLT_MAX -> inf
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x7F7F7FFFu)) == 0x7F7F);
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x00008000u)) == 0x0000);  // subnormal tie
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x00018000u)) == 0x0002);
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x807FFFFFu)) == 0x8080);  // into min normal
  // NaNs whose payload lives only in the low 16 bits must stay NaN, not become inf.
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x7F800001u)) == 0x7FC0);
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0xFF800001u)) == 0xFFC0);
  CHECK(detail::float_to_bfloat16_bits(bits_to_float(0x7FFFFFFFu)) == 0x7FFF);
  CHECK(detail::float_to_half_bits(bits_to_float(0x7F800001u)) == 0x7E00);
  CHECK(detail::float_to_half_bits(bits_to_float(0xFFA00000u)) == 0xFF00);

  // Every midpoint between adjacent finite fp16 values, and its float neighbours.
  bool ok = true;
  for (std::uint32_t i = 0; i < 0x7BFFu && ok; ++i) {
    for (std::uint32_t s : {0u, 0x8000u}) {
      const auto lo = static_cast<std::uint16_t>(i | s);
      const auto hi = static_cast<std::uint16_t>((i + 1) | s);
      const float mid =
          0.5f * (detail::half_bits_to_float(lo) + detail::half_bits_to_float(hi));  // exact
      const std::uint16_t even = (lo & 1u) ? hi : lo;
      ok = ok && detail::float_to_half_bits(mid) == even;
      ok = ok && detail::float_to_half_bits(std::nextafter(mid, 0.0f)) == lo;
      ok = ok && detail::float_to_half_bits(std::nextafter(mid, 2.0f * mid)) == hi;
      ok = ok && check_float(mid) && check_float(std::nextafter(mid, 0.0f)) &&
           check_float(std::nextafter(mid, 2.0f * mid));
    }
  }
  CHECK(ok);

  // Every midpoint between adjacent finite bf16 values, and its float neighbours.
  ok = true;
  for (std::uint32_t i = 0; i < 0x7F7Fu && ok; ++i) {
    for (std::uint32_t s : {0u, 0x8000u}) {
      const std::uint32_t lo = i | s;
      const std::uint32_t mid = (lo << 16) | 0x8000u;
      const auto even = static_cast<std::uint16_t>((lo & 1u) ? lo + 1 : lo);
      ok = ok && detail::float_to_bfloat16_bits(bits_to_float(mid)) == even;
      ok = ok && detail::float_to_bfloat16_bits(bits_to_float(mid - 1)) == lo;
      ok = ok && detail::float_to_bfloat16_bits(bits_to_float(mid + 1)) == lo + 1;
      ok = ok && check_float(bits_to_float(mid)) && check_float(bits_to_float(mid - 1)) &&
           check_float(bits_to_float(mid + 1));
    }
  }
  CHECK(ok);
}

TEST_CASE("half/bfloat16: random float32 patterns match the references", "[half]") {
  std::mt19937 rng(12345);
  constexpr std::size_t kSamples = 10'000'000;
  std::size_t failures = 0;
  for (std::size_t i = 0; i < kSamples && failures < 10; ++i) {
    if (!check_float(bits_to_float(static_cast<std::uint32_t>(rng())))) ++failures;
  }
  CHECK(failures == 0);
  // Values concentrated around the fp16 range, where most rounding happens.
  std::uniform_int_distribution<std::uint32_t> near(0x32000000u, 0x48000000u);
  for (std::size_t i = 0; i < 2'000'000 && failures < 10; ++i) {
    const std::uint32_t u = near(rng) | (static_cast<std::uint32_t>(rng() & 1u) << 31);
    if (!check_float(bits_to_float(u))) ++failures;
  }
  CHECK(failures == 0);
}

namespace {

// Random 32-bit patterns salted with special values, so every bulk path sees NaN, inf,
// subnormal, zero and overflow inputs in both vector lanes and tails.
std::vector<float> special_floats(std::size_t n, std::mt19937& rng) {
  static const std::uint32_t specials[] = {
      0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7FC00000u, 0xFFC00000u,
      0x7F800001u, 0xFF800001u, 0x7FBFFFFFu, 0x7FFFFFFFu, 0x00000001u, 0x807FFFFFu,
      0x33000000u, 0x33000001u, 0x387FFFFFu, 0x38800000u, 0x477FE000u, 0x477FF000u,
      0x477FEFFFu, 0x7F7FFFFFu, 0x3F808000u, 0x3F818000u, 0x00008000u, 0x37800000u};
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t r = rng();
    const std::uint32_t u = (r % 5 == 0) ? specials[(r >> 8) % std::size(specials)] : rng();
    v[i] = bits_to_float(u);
  }
  return v;
}

}  // namespace

TEST_CASE("half/bfloat16: bulk conversion equals scalar conversion", "[half]") {
  std::mt19937 rng(777);
  INFO("F16C path: " << mixtape::has_f16c());
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                        std::size_t{9}, std::size_t{17}, std::size_t{33}, std::size_t{1000003}}) {
    INFO("n = " << n);
    const std::vector<float> src = special_floats(n, rng);

    std::vector<half> h(n);
    std::vector<bfloat16> b(n);
    mixtape::convert_float_to_half(src.data(), h.data(), n);
    mixtape::convert_float_to_bfloat16(src.data(), b.data(), n);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      bad += h[i].bits != detail::float_to_half_bits(src[i]);
      bad += b[i].bits != detail::float_to_bfloat16_bits(src[i]);
    }
    CHECK(bad == 0);

    // 16-bit -> float on every kind of pattern (random bits hit NaNs 1 time in 32 for fp16).
    std::vector<half> hs(n);
    std::vector<bfloat16> bs(n);
    for (std::size_t i = 0; i < n; ++i) {
      hs[i] = half::from_bits(static_cast<std::uint16_t>(rng()));
      bs[i] = bfloat16::from_bits(static_cast<std::uint16_t>(rng()));
    }
    std::vector<float> fh(n), fb(n);
    mixtape::convert_half_to_float(hs.data(), fh.data(), n);
    mixtape::convert_bfloat16_to_float(bs.data(), fb.data(), n);
    bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
      bad += fbits(fh[i]) != fbits(detail::half_bits_to_float(hs[i].bits));
      bad += fbits(fb[i]) != fbits(detail::bfloat16_bits_to_float(bs[i].bits));
    }
    CHECK(bad == 0);
  }
}

// The bulk float32 -> bfloat16 conversion on the patterns where a CPU instruction and the
// rule part ways (AVX512-BF16 flushes subnormals; NaNs keep their payload's top bits): every
// zero and subnormal of both signs, and NaNs and infinities across their payloads, in arrays
// whose lengths leave tails of every size.
TEST_CASE("half/bfloat16: bulk conversion of every subnormal and of NaN payloads", "[half]") {
  std::vector<float> src;
  std::vector<bfloat16> out;
  std::size_t bad = 0, checked = 0;
  auto check = [&] {
    out.assign(src.size(), bfloat16{});
    mixtape::convert_float_to_bfloat16(src.data(), out.data(), src.size());
    for (std::size_t i = 0; i < src.size(); ++i)
      bad += out[i].bits != detail::float_to_bfloat16_bits(src[i]);
    checked += src.size();
    src.clear();
  };
  auto push = [&](std::uint32_t bits) {
    float f;
    std::memcpy(&f, &bits, sizeof f);
    src.push_back(f);
    // Arrays of 65,536 + 0..15 elements: every tail length, and several parallel blocks.
    if (src.size() == 65536 + (checked / 65536) % 16) check();
  };
  for (const std::uint32_t sign : {0u, 0x80000000u}) {
    for (std::uint32_t m = 0; m < (1u << 23); ++m) push(sign | m);  // zeros and subnormals
    for (std::uint32_t m = 0; m < (1u << 23); m += 61) push(sign | 0x7F800000u | m);  // inf, NaN
  }
  check();
  CHECK(checked == 2 * ((1u << 23) + ((1u << 23) + 60) / 61));
  CHECK(bad == 0);
}

TEST_CASE("half/bfloat16: arithmetic rounds through the 16-bit format", "[half]") {
  // The guide's examples: 256 * 256 = 65536 overflows fp16, 1e-10 underflows it.
  const half big = half(256.0f) * half(256.0f);
  CHECK(big.bits == 0x7C00);
  CHECK(std::isinf(static_cast<float>(big)));
  CHECK(static_cast<float>(big) > 0.0f);
  CHECK(static_cast<float>(half(1e-5f) * half(1e-5f)) == 0.0f);
  // bfloat16 has float32's range, so the same products stay finite and non-zero.
  CHECK(static_cast<float>(bfloat16(256.0f) * bfloat16(256.0f)) == 65536.0f);
  CHECK(static_cast<float>(bfloat16(1e-5f) * bfloat16(1e-5f)) > 0.0f);
  CHECK((-half(1.5f)).bits == 0xBE00);
  CHECK(static_cast<float>(half(1.0f) + half(std::ldexp(1.0f, -11))) == 1.0f);
}
