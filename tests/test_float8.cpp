// The float8 dtypes (float8_e4m3fn, float8_e5m2) against a reference written here from the
// OCP FP8 definition: every one of the 256 patterns of each decoded, and conversions to them
// from float32 inputs at every rounding boundary (each midpoint between neighbours and the
// floats on either side of it), ties, subnormals, saturation, infinities and NaN, plus
// random floats; from float64 inputs closer to a midpoint than float32 can tell; from every
// other dtype; fill, printing, safetensors, promotion.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "error_of.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using Catch::Matchers::Contains;
using mixtape_test::error_of;

namespace {

// n samples of four separable blobs in 16 dimensions (labels i % 4), drawn after seed 5.
std::pair<mt::Tensor, mt::Tensor> blobs(std::int64_t n) {
  mt::manual_seed(5);
  const mt::Tensor centers = mt::normal({4, 16}) * 3.0;
  std::vector<std::int64_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) labels[static_cast<std::size_t>(i)] = i % 4;
  const mt::Tensor y = mt::from_vector(labels, {n});
  return {mt::take(centers, y, 0) + mt::normal({n, 16}), y};
}

// A format as the specification defines it.
struct Spec {
  mt::DType dtype;
  int exponent_bits, mantissa_bits, bias;
  bool ieee;  // all-ones exponent: infinities and NaNs (e5m2); else only S.1111.111 is NaN
};
const Spec kE4M3{mt::kFloat8E4M3FN, 4, 3, 7, false};
const Spec kE5M2{mt::kFloat8E5M2, 5, 2, 15, true};

// The value of a bit pattern, from the definition.
double reference_decode(const Spec& f, int b) {
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e = (b >> f.mantissa_bits) & ((1 << f.exponent_bits) - 1);
  const int m = b & ((1 << f.mantissa_bits) - 1);
  const int all_ones = (1 << f.exponent_bits) - 1;
  if (f.ieee && e == all_ones) return m == 0 ? sign * INFINITY : NAN;
  if (!f.ieee && e == all_ones && m == (1 << f.mantissa_bits) - 1) return NAN;
  const double fraction = static_cast<double>(m) / (1 << f.mantissa_bits);
  if (e == 0) return sign * std::ldexp(fraction, 1 - f.bias);
  return sign * std::ldexp(1.0 + fraction, e - f.bias);
}

// The non-negative finite patterns in increasing order of value, then one pattern past the
// largest (-1): the value the rounding would reach with one more code (2^(emax+1) for e5m2,
// whose next code is an infinity; 480 = 1.111b * 2^8 for e4m3fn, whose next code is NaN).
struct Ladder {
  std::vector<int> code;
  std::vector<double> value;
};
Ladder ladder(const Spec& f) {
  Ladder l;
  for (int b = 0; b < 128; ++b) {
    const double v = reference_decode(f, b);
    if (std::isfinite(v)) {
      l.code.push_back(b);
      l.value.push_back(v);
    }
  }
  const int last = l.code.back();
  const double spacing = l.value.back() - l.value[l.value.size() - 2];
  l.code.push_back(-1);
  // e4m3fn's max is 1.110b * 2^8: the next value 1.111b * 2^8 (odd mantissa); e5m2's max
  // is 1.11b * 2^15: the next is 2^16 (even).
  l.value.push_back(l.value.back() + spacing);
  (void)last;
  return l;
}

// The reference conversion of the exact value x: the nearest value of the ladder, ties to
// the even pattern (the virtual one past the max counts as odd for e4m3fn, even for e5m2,
// as its mantissa would be); beyond the max it saturates or overflows; NaN is 0x7F.
int reference_encode(const Spec& f, double x, bool saturate) {
  if (std::isnan(x)) return 0x7F;
  const int sign = std::signbit(x) ? 0x80 : 0;
  const double a = std::fabs(x);
  static const Ladder l4 = ladder(kE4M3), l5 = ladder(kE5M2);
  const Ladder& l = f.ieee ? l5 : l4;
  const int overflow = saturate ? (f.ieee ? 0x7B : 0x7E) : (f.ieee ? 0x7C : 0x7F);
  if (std::isinf(a)) return sign | overflow;
  std::size_t best = 0;
  for (std::size_t i = 1; i < l.value.size(); ++i) {
    const double d = std::fabs(l.value[i] - a), db = std::fabs(l.value[best] - a);
    const bool even = l.code[i] == -1 ? f.ieee : (l.code[i] & 1) == 0;
    if (d < db || (d == db && even)) best = i;
  }
  if (l.code[best] == -1) return sign | overflow;
  // A value past the virtual code is further from every code than the virtual one.
  if (a > l.value.back()) return sign | overflow;
  return sign | l.code[best];
}

// float32 inputs at every boundary of the format: each value, each midpoint between
// neighbours (and past the max), the floats right beside them, both signs; zeros,
// infinities, NaN, float32 extremes.
std::vector<float> boundary_inputs(const Spec& f) {
  const Ladder l = ladder(f);
  std::vector<float> out;
  auto add = [&](double v) {
    const float x = static_cast<float>(v);
    for (float y : {x, std::nextafter(x, 0.0f), std::nextafter(x, INFINITY)}) {
      out.push_back(y);
      out.push_back(-y);
    }
  };
  for (std::size_t i = 0; i < l.value.size(); ++i) {
    add(l.value[i]);
    if (i + 1 < l.value.size()) add((l.value[i] + l.value[i + 1]) / 2);
  }
  add(l.value.back() * 2);
  for (float x : {0.0f, std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::max(), INFINITY, NAN})
    add(x);
  return out;
}

// Random float32 bit patterns (every exponent), reproducible.
std::vector<float> random_floats(std::size_t n) {
  std::mt19937 gen(8);
  std::vector<float> out(n);
  for (float& x : out) {
    const std::uint32_t bits = gen();
    std::memcpy(&x, &bits, sizeof x);
  }
  return out;
}

std::vector<std::uint8_t> bytes_of(const mt::Tensor& t) {
  const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
  return {p, p + t.numel()};
}

// x cast to the format by the tensor cast kernel, as bytes.
std::vector<std::uint8_t> cast_bytes(const mt::Tensor& x, const Spec& f) {
  return bytes_of(mt::cast(x, f.dtype));
}

bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

// A tensor's values as doubles (exact from every floating dtype).
std::vector<double> as_doubles(const mt::Tensor& t) {
  return mt::cast(t, mt::kFloat64).to_vector<double>();
}

// The RMS of got - want relative to want's.
double rms_error(const std::vector<double>& got, const std::vector<double>& want) {
  double e = 0, n = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    e += (got[i] - want[i]) * (got[i] - want[i]);
    n += want[i] * want[i];
  }
  return std::sqrt(e / n);
}

}  // namespace

TEST_CASE("float8: names, sizes, and what the dtypes are", "[float8]") {
  CHECK(mt::DType("float8_e4m3fn") == mt::kFloat8E4M3FN);
  CHECK(mt::DType("e4m3") == mt::kFloat8E4M3FN);
  CHECK(mt::DType("fp8_e5m2") == mt::kFloat8E5M2);
  CHECK(mt::kFloat8E5M2.name() == "float8_e5m2");
  CHECK(mt::kFloat8E4M3FN.itemsize() == 1);
  CHECK(mt::kFloat8E4M3FN.is_float8());
  CHECK_FALSE(mt::kFloat8E4M3FN.is_floating());
  CHECK_FALSE(mt::kFloat8E5M2.is_integral());
  CHECK(mt::promote_types(mt::kFloat8E5M2, mt::kFloat8E5M2) == mt::kFloat8E5M2);
  CHECK_THAT(
      error_of<mt::DTypeError>([] { (void)mt::promote_types(mt::kFloat8E4M3FN, mt::kFloat32); }),
      Contains("no promotion between float8_e4m3fn and float32") && Contains("cast it"));
  CHECK_THROWS_AS(mt::promote_types(mt::kFloat8E4M3FN, mt::kFloat8E5M2), mt::DTypeError);
  // No op computes in float8: an addition names the op and the dtype.
  const mt::Tensor a = mt::cast(mt::ones({3}), mt::kFloat8E4M3FN);
  CHECK_THROWS_WITH(mt::add(a, a), Contains("add: no kernel for dtype float8_e4m3fn"));
}

TEST_CASE("float8: all 256 patterns of each format decode as the definition says", "[float8]") {
  for (const Spec& f : {kE4M3, kE5M2}) {
    CAPTURE(f.dtype.name());
    mt::Tensor all = mt::Tensor::empty({256}, f.dtype);
    auto* p = static_cast<std::uint8_t*>(all.data_ptr());
    for (int b = 0; b < 256; ++b) p[b] = static_cast<std::uint8_t>(b);
    const std::vector<float> kernel = mt::cast(all, mt::kFloat32).to_vector<float>();
    const std::vector<double> wide = mt::cast(all, mt::kFloat64).to_vector<double>();
    int nans = 0, infs = 0;
    for (int b = 0; b < 256; ++b) {
      CAPTURE(b);
      const double expected = reference_decode(f, b);
      const float scalar =
          f.ieee ? static_cast<float>(mt::float8_e5m2::from_bits(static_cast<std::uint8_t>(b)))
                 : static_cast<float>(mt::float8_e4m3fn::from_bits(static_cast<std::uint8_t>(b)));
      CHECK(same_value(scalar, expected));
      CHECK(same_value(kernel[static_cast<std::size_t>(b)], expected));
      CHECK(same_value(wide[static_cast<std::size_t>(b)], expected));
      CHECK((std::signbit(scalar) == ((b & 0x80) != 0) || std::isnan(expected)));
      nans += std::isnan(expected) ? 1 : 0;
      infs += std::isinf(expected) ? 1 : 0;
    }
    // e4m3fn: one NaN per sign, no infinity; e5m2: 3 NaNs per sign, one infinity.
    CHECK(nans == (f.ieee ? 6 : 2));
    CHECK(infs == (f.ieee ? 2 : 0));
  }
  CHECK(static_cast<float>(mt::float8_e4m3fn::from_bits(0x7E)) == 448.0f);
  CHECK(static_cast<float>(mt::float8_e4m3fn::from_bits(0x01)) == std::ldexp(1.0f, -9));
  CHECK(static_cast<float>(mt::float8_e5m2::from_bits(0x7B)) == 57344.0f);
  CHECK(static_cast<float>(mt::float8_e5m2::from_bits(0x01)) == std::ldexp(1.0f, -16));
}

TEST_CASE("float8: float32 -> float8 rounds to nearest even and saturates, at every boundary",
          "[float8]") {
  const std::vector<float> random = random_floats(200000);
  for (const Spec& f : {kE4M3, kE5M2}) {
    CAPTURE(f.dtype.name());
    std::vector<float> inputs = boundary_inputs(f);
    inputs.insert(inputs.end(), random.begin(), random.end());
    const mt::Tensor x = mt::from_vector(inputs, {static_cast<std::int64_t>(inputs.size())});
    const std::vector<std::uint8_t> kernel = cast_bytes(x, f);
    // The bulk conversion (quantize_float8's CPU kernel), both saturations.
    const mt::Float8Format format = f.ieee ? mt::Float8Format::e5m2 : mt::Float8Format::e4m3fn;
    std::vector<std::uint8_t> bulk(inputs.size()), bulk_nosat(inputs.size());
    const auto count = static_cast<std::int64_t>(inputs.size());
    mt::detail::floats_to_float8_bits(format, inputs.data(), bulk.data(), count,
                                      mt::Saturation::finite);
    mt::detail::floats_to_float8_bits(format, inputs.data(), bulk_nosat.data(), count,
                                      mt::Saturation::none);
    std::size_t wrong = 0;
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const float v = inputs[i];
      const int sat = reference_encode(f, v, true), nosat = reference_encode(f, v, false);
      const int got_sat = f.ieee ? mt::float8_e5m2(v).bits : mt::float8_e4m3fn(v).bits;
      const int got_nosat = f.ieee ? mt::float8_e5m2(v, mt::Saturation::none).bits
                                   : mt::float8_e4m3fn(v, mt::Saturation::none).bits;
      if (got_sat != sat || got_nosat != nosat || kernel[i] != sat || bulk[i] != sat ||
          bulk_nosat[i] != nosat) {
        if (++wrong <= 5)
          FAIL_CHECK(
              fmt::format("{:a}: reference {:#04x} / {:#04x} (no saturation), scalar "
                          "{:#04x} / {:#04x}, cast kernel {:#04x}, bulk {:#04x} / {:#04x}",
                          v, sat, nosat, got_sat, got_nosat, kernel[i], bulk[i], bulk_nosat[i]));
      }
    }
    CHECK(wrong == 0);
  }
  // The boundaries by name: e4m3fn's max and the tie above it, e5m2's tie that overflows.
  CHECK(mt::float8_e4m3fn(464.0f, mt::Saturation::none).bits == 0x7E);  // tie: to 448 (even)
  CHECK(mt::float8_e4m3fn(465.0f, mt::Saturation::none).bits == 0x7F);  // NaN
  CHECK(mt::float8_e4m3fn(1e9f).bits == 0x7E);                          // saturates
  CHECK(mt::float8_e4m3fn(-INFINITY).bits == 0xFE);
  CHECK(mt::float8_e5m2(61440.0f, mt::Saturation::none).bits == 0x7C);  // tie: to infinity
  CHECK(mt::float8_e5m2(61439.0f, mt::Saturation::none).bits == 0x7B);
  CHECK(mt::float8_e5m2(INFINITY, mt::Saturation::none).bits == 0x7C);
  CHECK(mt::float8_e5m2(INFINITY).bits == 0x7B);
  CHECK(mt::float8_e4m3fn(std::ldexp(1.0f, -10)).bits == 0x00);  // half the smallest: to 0
  CHECK(mt::float8_e4m3fn(std::nextafter(std::ldexp(1.0f, -10), 1.0f)).bits == 0x01);
  CHECK(mt::float8_e4m3fn(-0.0f).bits == 0x80);
  CHECK(mt::float8_e5m2(-NAN).bits == 0x7F);
}

TEST_CASE("float8: from float64 and the other dtypes, rounded once from the exact value",
          "[float8]") {
  for (const Spec& f : {kE4M3, kE5M2}) {
    CAPTURE(f.dtype.name());
    // Midpoints nudged by less than float32 can hold: a rounding through float32 to nearest
    // would land on the midpoint and tie; the exact value is on one side.
    const Ladder l = ladder(f);
    std::vector<double> wide;
    for (std::size_t i = 0; i + 1 < l.value.size(); ++i) {
      const double mid = (l.value[i] + l.value[i + 1]) / 2;
      for (double s : {1.0, -1.0})
        for (double nudge : {-std::ldexp(1.0, -40), 0.0, std::ldexp(1.0, -40)})
          wide.push_back(s * mid * (1.0 + nudge));
    }
    wide.push_back(1e300);
    wide.push_back(-1e-300);
    const mt::Tensor x = mt::from_vector(wide, {static_cast<std::int64_t>(wide.size())});
    const std::vector<std::uint8_t> got = cast_bytes(x, f);
    for (std::size_t i = 0; i < wide.size(); ++i) {
      CAPTURE(wide[i]);
      CHECK(static_cast<int>(got[i]) == reference_encode(f, wide[i], true));
    }
    // Integers (int64 beyond float32's 24 bits), 16-bit floats, uint8 and bool.
    const std::vector<std::int64_t> ints = {
        0, 1, -3, 17, 300, -300, 449, 463, 465, 61439, 61441, (std::int64_t{1} << 40) + 1};
    const std::vector<std::uint8_t> from_ints =
        cast_bytes(mt::from_vector(ints, {static_cast<std::int64_t>(ints.size())}), f);
    for (std::size_t i = 0; i < ints.size(); ++i)
      CHECK(static_cast<int>(from_ints[i]) ==
            reference_encode(f, static_cast<double>(ints[i]), true));
    const std::vector<float> boundaries = boundary_inputs(f);
    const mt::Tensor floats =
        mt::from_vector(boundaries, {static_cast<std::int64_t>(boundaries.size())});
    for (mt::DType source : {mt::kFloat16, mt::kBFloat16, mt::kInt32, mt::kUInt8, mt::kBool}) {
      CAPTURE(source.name());
      const mt::Tensor s = mt::cast(floats, source);
      const std::vector<double> exact = mt::cast(s, mt::kFloat64).to_vector<double>();
      const std::vector<std::uint8_t> got8 = cast_bytes(s, f);
      for (std::size_t i = 0; i < exact.size(); ++i)
        CHECK(static_cast<int>(got8[i]) == reference_encode(f, exact[i], true));
    }
  }
}

TEST_CASE("float8: to every dtype exactly, fill, printing and safetensors", "[float8]") {
  mixtape_test::TempDir dir;
  for (const Spec& f : {kE4M3, kE5M2}) {
    CAPTURE(f.dtype.name());
    mt::Tensor all = mt::Tensor::empty({256}, f.dtype);
    auto* p = static_cast<std::uint8_t*>(all.data_ptr());
    for (int b = 0; b < 256; ++b) p[b] = static_cast<std::uint8_t>(b);
    // Every floating dtype holds every float8 value exactly; integers truncate, bool is != 0.
    for (mt::DType d : {mt::kFloat16, mt::kBFloat16, mt::kFloat32, mt::kFloat64}) {
      const std::vector<double> v = mt::cast(mt::cast(all, d), mt::kFloat64).to_vector<double>();
      for (int b = 0; b < 256; ++b)
        CHECK(same_value(v[static_cast<std::size_t>(b)], reference_decode(f, b)));
      // and back, bit for bit (NaNs become 0x7F, e5m2's infinities saturate to +-max)
      const std::vector<std::uint8_t> back = cast_bytes(mt::cast(all, d), f);
      for (int b = 0; b < 256; ++b) {
        const double v = reference_decode(f, b);
        const int expected = std::isnan(v) ? 0x7F : std::isinf(v) ? (b & 0x80) | 0x7B : b;
        CHECK(static_cast<int>(back[static_cast<std::size_t>(b)]) == expected);
      }
    }
    const std::vector<std::int32_t> ints = mt::cast(all, mt::kInt32).to_vector<std::int32_t>();
    CHECK(ints[0x40 | 0x01] == static_cast<std::int32_t>(std::trunc(reference_decode(f, 0x41))));
    // fill: rounded as a cast of the float64 value.
    for (double v : {0.3, -1000.0, 1e6, 3.0}) {
      const mt::Tensor t = mt::full({5}, v, f.dtype);
      CHECK(static_cast<int>(bytes_of(t)[4]) == reference_encode(f, v, true));
    }
    // Printing goes through float32.
    const mt::Tensor small =
        mt::cast(mt::from_vector(std::vector<float>{0.5f, -2.0f, 448.0f}, {3}), f.dtype);
    CHECK_THAT(mt::to_string(small), Contains(std::string(f.dtype.name())) && Contains("-2"));
    // safetensors: F8_E4M3 / F8_E5M2, the bytes as they are.
    const std::string path = (dir.path() / (std::string(f.dtype.name()) + ".safetensors")).string();
    mt::save_safetensors(path, {{"w", all}});
    const mt::SafetensorsFile file = mt::load_safetensors(path);
    REQUIRE(file.tensors.size() == 1);
    CHECK(file.tensors[0].second.dtype() == f.dtype);
    CHECK(bytes_of(file.tensors[0].second) == bytes_of(all));
    std::ifstream in(path, std::ios::binary);
    std::string header(200, '\0');
    in.read(header.data(), 200);
    CHECK_THAT(header, Contains(f.ieee ? "\"F8_E5M2\"" : "\"F8_E4M3\""));
  }
}

TEST_CASE("float8: quantize_float8 scales into the format, scaled_matmul multiplies back",
          "[float8]") {
  mt::manual_seed(31);
  const mt::Tensor x = mt::normal({24, 64}) * 3.0, w = mt::normal({40, 64}) * 0.05;
  for (const Spec& f : {kE4M3, kE5M2}) {
    CAPTURE(f.dtype.name());
    const mt::Float8Quantized q = mt::quantize_float8(x, f.dtype);
    CHECK(q.data.dtype() == f.dtype);
    CHECK(q.data.shape() == x.shape());
    const float amax = mt::max(mt::abs(x)).item<float>();
    CHECK(q.amax.item<float>() == amax);
    const double top = f.ieee ? 57344.0 : 448.0;
    CHECK(q.scale.item<float>() == static_cast<float>(1.0 / static_cast<float>(top / amax)));
    // The largest element lands on the format's largest value; dequantised, every element
    // is within half a step of the format (relative 2^-4 for e4m3, 2^-3 for e5m2).
    const std::vector<float> back = (mt::cast(q.data, mt::kFloat32) * q.scale).to_vector<float>();
    const std::vector<float> orig = x.to_vector<float>();
    const double step = f.ieee ? 0.125 : 0.0625;
    for (std::size_t i = 0; i < orig.size(); ++i)
      CHECK(std::fabs(back[i] - orig[i]) <=
            step * std::fabs(orig[i]) + amax * std::ldexp(1.0, f.ieee ? -30 : -17));
  }
  // An all-zero tensor: scale 1, zeros.
  const mt::Float8Quantized z = mt::quantize_float8(mt::zeros({3, 4}), mt::kFloat8E4M3FN);
  CHECK(z.scale.item<float>() == 1.0f);
  CHECK(mt::cast(z.data, mt::kFloat32).to_vector<float>() == std::vector<float>(12, 0.0f));

  // scaled_matmul against the float64 product of the dequantised operands.
  const mt::Float8Quantized qa = mt::quantize_float8(x, mt::kFloat8E4M3FN);
  for (const mt::DType b_dtype : {mt::kFloat8E4M3FN, mt::kFloat8E5M2}) {
    const mt::Float8Quantized qb = mt::quantize_float8(w, b_dtype);
    const mt::Tensor a64 = mt::cast(qa.data, mt::kFloat64) * mt::cast(qa.scale, mt::kFloat64);
    const mt::Tensor b64 = mt::cast(qb.data, mt::kFloat64) * mt::cast(qb.scale, mt::kFloat64);
    const std::vector<double> want = mt::matmul(a64, mt::transpose(b64)).to_vector<double>();
    // Both of the CPU's products: oneDNN's bfloat16 matmul (where the CPU has bfloat16
    // instructions) and sgemm on float32 copies.
    for (const bool onednn : {true, false}) {
      const mt::cpu::OneDnnScope path(onednn);
      for (const mt::DType out : {mt::kFloat32, mt::kBFloat16, mt::kFloat16}) {
        CAPTURE(b_dtype.name(), out.name(), onednn);
        const mt::Tensor y =
            mt::scaled_matmul(qa.data, qb.data, qa.scale, qb.scale, {.out_dtype = out});
        REQUIRE(y.shape() == mt::Shape{24, 40});
        CHECK(y.dtype() == out);
        const std::vector<double> got = mt::cast(y, mt::kFloat64).to_vector<double>();
        const double rel = out == mt::kFloat32 ? 1e-5 : out == mt::kFloat16 ? 1e-3 : 8e-3;
        for (std::size_t i = 0; i < got.size(); ++i)
          CHECK(std::fabs(got[i] - want[i]) <= rel * std::fabs(want[i]) + 1e-4);
      }
    }
    // and close to the unquantised product (the FP8 rounding of both operands)
    const std::vector<double> exact =
        mt::matmul(mt::cast(x, mt::kFloat64), mt::transpose(mt::cast(w, mt::kFloat64)))
            .to_vector<double>();
    const std::vector<double> got = mt::cast(mt::scaled_matmul(qa.data, qb.data, qa.scale, qb.scale,
                                                               {.out_dtype = mt::kFloat32}),
                                             mt::kFloat64)
                                        .to_vector<double>();
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      err += (got[i] - exact[i]) * (got[i] - exact[i]);
      norm += exact[i] * exact[i];
    }
    CHECK(std::sqrt(err / norm) < (b_dtype == mt::kFloat8E5M2 ? 0.08 : 0.05));
  }
}

TEST_CASE("float8: scaled_matmul refuses what it cannot multiply, by name", "[float8]") {
  const mt::Tensor a = mt::cast(mt::ones({4, 16}), mt::kFloat8E4M3FN);
  const mt::Tensor b5 = mt::cast(mt::ones({8, 16}), mt::kFloat8E5M2);
  const mt::Tensor a5 = mt::cast(mt::ones({4, 16}), mt::kFloat8E5M2);
  const mt::Tensor one = mt::ones({1});
  CHECK_THAT(error_of<mt::DTypeError>([&] { mt::scaled_matmul(a5, b5, one, one); }),
             Contains("two float8_e5m2 operands are not supported"));
  CHECK_THAT(error_of<mt::DTypeError>([&] {
               mt::scaled_matmul(mt::ones({4, 16}), b5, one, one);
             }),
             Contains("the operands must be float8_e4m3fn or float8_e5m2"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::scaled_matmul(a, mt::cast(mt::ones({8, 15}), mt::kFloat8E4M3FN), one, one);
             }),
             Contains("must share k") && Contains("float8_e4m3fn[8, 15]"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::scaled_matmul(a, b5, mt::ones({2}), one); }),
             Contains("scale_a and scale_b must be float32 tensors of one element"));
  for (const double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(),
                           std::numeric_limits<double>::quiet_NaN()})
    CHECK_THAT(error_of<mt::ValueError>(
                   [&] { mt::scaled_matmul(a, b5, one, mt::full({1}, bad, mt::kFloat32)); }),
               Contains("scaled_matmul: scale_b is") &&
                   Contains("a dequantisation scale must be positive and finite"));
  CHECK_THAT(error_of<mt::DTypeError>(
                 [&] { mt::scaled_matmul(a, b5, one, one, {.out_dtype = mt::kFloat64}); }),
             Contains("out_dtype must be float32, bfloat16 or float16"));
  CHECK_THAT(error_of<mt::DTypeError>([&] { mt::quantize_float8(mt::ones({2}), mt::kFloat16); }),
             Contains("the target must be float8_e4m3fn or float8_e5m2"));
  // e4m3 x e5m2 works; k = 0 gives zeros.
  CHECK(mt::scaled_matmul(a, b5, one, one).shape() == mt::Shape{4, 8});
  const mt::Tensor empty_k = mt::scaled_matmul(mt::cast(mt::ones({2, 0}), mt::kFloat8E4M3FN),
                                               mt::cast(mt::ones({3, 0}), mt::kFloat8E4M3FN), one,
                                               one, {.out_dtype = mt::kFloat32});
  CHECK(empty_k.to_vector<float>() == std::vector<float>(6, 0.0f));
}

TEST_CASE("float8: float8_linear is scaled_matmul forward and backward, gradients e5m2",
          "[float8]") {
  mt::manual_seed(41);
  const mt::Tensor x = mt::cast(mt::normal({3, 5, 32}), mt::kBFloat16);
  mt::Variable w(mt::normal({32, 48}) * 0.2, "w");
  const mt::Tensor dy = mt::cast(mt::normal({3, 5, 48}) * 1e-3, mt::kBFloat16);
  mt::GradientTape tape;
  tape.watch(x);
  const mt::Tensor y = mt::float8_linear(x, w);
  CHECK(y.shape() == mt::Shape{3, 5, 48});
  CHECK(y.dtype() == mt::kBFloat16);
  const std::vector<mt::Tensor> grads = tape.gradient(y, {x, w}, dy);
  REQUIRE(grads.size() == 2);
  CHECK(grads[0].dtype() == mt::kBFloat16);
  CHECK(grads[1].dtype() == mt::kFloat32);

  // The same, composed here from quantize_float8 and scaled_matmul: bit for bit.
  const mt::Float8Quantized qx = mt::quantize_float8(mt::reshape(x, {15, 32}), mt::kFloat8E4M3FN);
  const mt::Float8Quantized qwt = mt::quantize_float8(mt::transpose(w), mt::kFloat8E4M3FN);
  const mt::Float8Quantized qg = mt::quantize_float8(mt::reshape(dy, {15, 48}), mt::kFloat8E5M2);
  CHECK(as_doubles(y) == as_doubles(mt::scaled_matmul(qx.data, qwt.data, qx.scale, qwt.scale,
                                                      {.out_dtype = mt::kBFloat16})));
  const mt::Tensor dx = mt::scaled_matmul(qg.data, mt::transpose(qwt.data).contiguous(), qg.scale,
                                          qwt.scale, {.out_dtype = mt::kBFloat16});
  CHECK(as_doubles(grads[0]) == as_doubles(dx));
  const mt::Tensor dw =
      mt::scaled_matmul(mt::transpose(qx.data).contiguous(), mt::transpose(qg.data).contiguous(),
                        qx.scale, qg.scale, {.out_dtype = mt::kFloat32});
  CHECK(as_doubles(grads[1]) == as_doubles(dw));

  // And near the float64 gradients (FP8 keeps 2 or 3 mantissa bits).
  const mt::Tensor x64 = mt::reshape(mt::cast(x, mt::kFloat64), {15, 32});
  const mt::Tensor w64 = mt::cast(w, mt::kFloat64);
  const mt::Tensor dy64 = mt::reshape(mt::cast(dy, mt::kFloat64), {15, 48});
  CHECK(rms_error(as_doubles(y), as_doubles(mt::matmul(x64, w64))) < 0.06);
  CHECK(rms_error(as_doubles(grads[0]), as_doubles(mt::matmul(dy64, mt::transpose(w64)))) < 0.12);
  CHECK(rms_error(as_doubles(grads[1]), as_doubles(mt::matmul(mt::transpose(x64), dy64))) < 0.12);

  // An infinite input is no error inside the layer: NaN comes out (as on a GPU), which the
  // loss then shows.
  std::vector<float> with_inf(32, 1.0f);
  with_inf[3] = std::numeric_limits<float>::infinity();
  const mt::Tensor yinf = mt::float8_linear(mt::from_vector(with_inf, {1, 32}), w);
  CHECK(std::isnan(mt::cast(yinf, mt::kFloat32).to_vector<float>()[0]));

  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::float8_linear(x, mt::ones({31, 4}));
             }),
             Contains("float8_linear: x [..., k] and w [k, n] must share k"));
  CHECK_THAT(error_of<mt::DTypeError>([&] { mt::float8_linear(mt::cast(x, mt::kFloat64), w); }),
             Contains("must be float32, bfloat16 or float16"));
}

TEST_CASE(
    "float8: float8_linear with a bias and an activation: linear()'s epilogue on the FP8 "
    "product, its gradients through linear_backward",
    "[float8]") {
  mt::manual_seed(43);
  const mt::Tensor x = mt::cast(mt::normal({3, 5, 32}), mt::kBFloat16);
  const mt::Tensor x64 = mt::reshape(mt::cast(x, mt::kFloat64), {15, 32});
  mt::Variable w(mt::normal({32, 48}) * 0.2, "w"), bias(mt::normal({48}), "bias");
  const mt::Tensor dy = mt::cast(mt::normal({3, 5, 48}) * 1e-3, mt::kBFloat16);
  const mt::Tensor dy64 = mt::reshape(mt::cast(dy, mt::kFloat64), {15, 48});
  const mt::Float8Quantized qx = mt::quantize_float8(mt::reshape(x, {15, 32}), mt::kFloat8E4M3FN);
  const mt::Float8Quantized qwt = mt::quantize_float8(mt::transpose(w), mt::kFloat8E4M3FN);
  const mt::Tensor product =
      mt::scaled_matmul(qx.data, qwt.data, qx.scale, qwt.scale,
                        {.out_dtype = mt::kFloat32, .fast_accumulation = true});
  for (const std::string activation : {"linear", "relu", "gelu", "gelu_tanh"}) {
    CAPTURE(activation);
    mt::GradientTape tape;
    tape.watch(x);
    const mt::Tensor y = mt::float8_linear(x, w, mt::kBFloat16, nullptr, bias, activation);
    CHECK(y.shape() == mt::Shape{3, 5, 48});
    CHECK(y.dtype() == mt::kBFloat16);
    const std::vector<mt::Tensor> grads = tape.gradient(y, {x, w, bias}, dy);
    REQUIRE(grads.size() == 3);
    CHECK(grads[2].dtype() == mt::kFloat32);
    const auto apply = [&](const mt::Tensor& v) {
      return activation == "relu"        ? mt::relu(v)
             : activation == "gelu"      ? mt::gelu(v)
             : activation == "gelu_tanh" ? mt::gelu_tanh(v)
                                         : v * 1.0;
    };
    // dy act'(v), v float64, by the tape.
    const auto gradient_at = [&](const mt::Tensor& v) {
      mt::GradientTape inner;
      inner.watch(v);
      return inner.gradient(apply(v), std::vector<mt::Tensor>{v}, dy64)[0];
    };
    // Forward: the float32 product, + the bias rounded to the output's dtype (kernels.h, as
    // autocast reads it), the activation, one rounding: bit for bit the same ops composed.
    const mt::Tensor z = product + mt::cast(mt::cast(bias, mt::kBFloat16), mt::kFloat32);
    CHECK(as_doubles(y) == as_doubles(mt::reshape(mt::cast(apply(z), mt::kBFloat16), {3, 5, 48})));
    // Backward, against float64: dz = dy act'(z) (z from the float64 product), dx and dw from
    // FP8 products.
    const mt::Tensor dz64 =
        gradient_at(mt::matmul(x64, mt::cast(w, mt::kFloat64)) + mt::cast(bias, mt::kFloat64));
    // The bias gradient is not quantised: dy act'(z) from the forward's own z (rounded to
    // bfloat16 as linear_backward reads it), summed in float32.
    const mt::Tensor dz_kept = gradient_at(mt::cast(mt::cast(z, mt::kBFloat16), mt::kFloat64));
    CHECK(rms_error(as_doubles(grads[2]), as_doubles(mt::sum(dz_kept, {0}))) < 1e-5);
    CHECK(rms_error(as_doubles(grads[0]),
                    as_doubles(mt::reshape(
                        mt::matmul(dz64, mt::transpose(mt::cast(w, mt::kFloat64))), {3, 5, 32}))) <
          0.12);
    CHECK(rms_error(as_doubles(grads[1]), as_doubles(mt::matmul(mt::transpose(x64), dz64))) < 0.12);
  }
  // The bias's gradient alone (x and w constants): the same as with the others.
  {
    const mt::Tensor w_const = mt::cast(w, mt::kFloat32) * 1.0;
    mt::GradientTape tape;
    const mt::Tensor y = mt::float8_linear(x, w_const, mt::kBFloat16, nullptr, bias, "gelu");
    const mt::Tensor alone = tape.gradient(y, std::vector<mt::Tensor>{bias}, dy)[0];
    mt::GradientTape tape2;
    tape2.watch(x);
    const mt::Tensor y2 = mt::float8_linear(x, w, mt::kBFloat16, nullptr, bias, "gelu");
    const mt::Tensor all = tape2.gradient(y2, std::vector<mt::Tensor>{x, w, bias}, dy)[2];
    CHECK(as_doubles(alone) == as_doubles(all));
  }
  // A tape that records the backward pass (second derivatives) gets it from ordinary ops:
  // near the FP8 pass's gradients (taken first, with no other tape), and differentiable.
  std::vector<mt::Tensor> want;
  {
    mt::GradientTape plain;
    plain.watch(x);
    const mt::Tensor y = mt::float8_linear(x, w, mt::kBFloat16, nullptr, bias, "gelu");
    want = plain.gradient(y, {x, w, bias}, dy);
  }
  {
    mt::GradientTape outer;
    std::vector<mt::Tensor> g;
    {
      mt::GradientTape inner;
      inner.watch(x);
      const mt::Tensor y = mt::float8_linear(x, w, mt::kBFloat16, nullptr, bias, "gelu");
      g = inner.gradient(y, {x, w, bias}, dy);
    }
    for (std::size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(rms_error(as_doubles(g[i]), as_doubles(want[i])) < 0.12);
    }
    const mt::Tensor second =
        outer.gradient(mt::sum(g[2] * g[2]), std::vector<mt::Tensor>{bias})[0];
    CHECK(second.shape() == mt::Shape{48});
  }
  CHECK_THAT(error_of<mt::ValueError>(
                 [&] { mt::float8_linear(x, w, mt::kBFloat16, nullptr, bias, "tanh"); }),
             Contains("float8_linear: unknown activation 'tanh'"));
  CHECK_THAT(error_of<mt::ShapeError>(
                 [&] { mt::float8_linear(x, w, mt::kBFloat16, nullptr, mt::ones({47}), "relu"); }),
             Contains("float8_linear: bias must be floating [48]"));
}

TEST_CASE("float8: mixed_float8 trains Dense layers in FP8, the last layer in float32 if asked",
          "[float8]") {
  CHECK(mt::Policy("mixed_float8").float8_matmuls());
  CHECK(mt::Policy("mixed_float8").compute_dtype() == mt::kBFloat16);
  CHECK(mt::Policy("mixed_float8").variable_dtype() == mt::kFloat32);
  CHECK_FALSE(mt::Policy("mixed_float8").loss_scale());
  CHECK_FALSE(mt::Policy("mixed_bfloat16").float8_matmuls());

  const auto [x, y] = blobs(1024);

  mt::PolicyScope scope("mixed_float8");
  mt::Sequential model({ml::Dense(64, {.activation = "relu"}),
                        ml::Dense(64, {.activation = "relu"}), ml::Dense(4, {.dtype = "float32"})});
  model.build_for({-1, 16});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mt::optim::Adam({.learning_rate = 3e-3}),
                 .metrics = {"accuracy"}});
  const mt::History h = model.fit(x, y, {.batch_size = 64, .epochs = 4, .seed = 2, .verbose = 0});
  CHECK(h.history.at("loss").back() < 0.5 * h.history.at("loss").front());
  CHECK(model.evaluate(x, y, {.batch_size = 256}).at("accuracy") > 0.95);
  for (const mt::Variable& v : model.weights()) CHECK(v.dtype() == mt::kFloat32);

  // The dtype trace says which products ran in FP8.
  const mt::DTypeTrace trace = mt::trace_dtypes(model, x.slice(0, 0, 16));
  REQUIRE(trace.rows.size() == 3);
  CHECK(trace.rows[0].policy == "mixed_float8");
  CHECK(trace.rows[0].note == "float8 matmul (e4m3, gradients e5m2; bias, relu fused)");
  CHECK(trace.rows[0].output == mt::kBFloat16);
  CHECK(trace.rows[2].policy == "float32");
  CHECK(trace.rows[2].note == "fused linear (bias)");  // float32: the fused op
  CHECK(trace.rows[2].output == mt::kFloat32);
  // Shapes FP8 GEMMs cannot take (a dimension not a multiple of 16) stay in bfloat16.
  const mt::DTypeTrace odd = mt::trace_dtypes(model, x.slice(0, 0, 12));
  CHECK(odd.rows[0].note == "bfloat16 matmul ([12, 16] x [16, 64]: FP8 needs multiples of 16)");
  mt::Sequential narrow({ml::Dense(10)});
  const mt::DTypeTrace n10 = mt::trace_dtypes(narrow, x.slice(0, 0, 16));
  CHECK(n10.rows[0].note == "bfloat16 matmul ([16, 16] x [16, 10]: FP8 needs multiples of 16)");
}

TEST_CASE("float8: delayed scaling is a policy, its parameters in its name", "[float8]") {
  using Kind = mt::Float8Scaling::Kind;
  const mt::Policy d("mixed_float8_delayed");
  CHECK(d.float8_matmuls());
  CHECK(d.compute_dtype() == mt::kBFloat16);
  CHECK(d.float8_scaling() ==
        mt::Float8Scaling{.kind = Kind::Delayed, .history = 1024, .margin = 0});
  CHECK(d.name() == "mixed_float8_delayed");
  CHECK(mt::Policy("mixed_float8").float8_scaling().kind == Kind::Current);
  CHECK_THAT(mt::Policy::valid_names(), Contains("mixed_float8_delayed"));

  const mt::Policy p("mixed_float8", {.kind = Kind::Delayed, .history = 16, .margin = 1});
  CHECK(p.name() == "mixed_float8_delayed(history=16, margin=1)");
  CHECK(mt::Policy(p.name()) == p);  // what a model file reads back
  CHECK(mt::Policy(p.name()).float8_scaling() == p.float8_scaling());
  CHECK(mt::Policy("mixed_float8", mt::Float8Scaling{}).name() == "mixed_float8");

  CHECK_THAT(
      error_of<mt::ValueError>([] { mt::Policy("mixed_float8_delayed(history=0, margin=0)"); }),
      Contains("the amax history must be 1 to 1048576 steps; got 0"));
  CHECK_THAT(error_of<mt::ValueError>([] { mt::Policy("mixed_float8_delayed(history=16)"); }),
             Contains("expected mixed_float8_delayed(history=N, margin=M)"));
  CHECK_THAT(error_of<mt::ValueError>([] {
               mt::Policy("mixed_float8", {.kind = Kind::Delayed, .history = 8, .margin = 65});
             }),
             Contains("the margin must be 0 to 64; got 65"));
  CHECK_THAT(error_of<mt::ValueError>([] { mt::Policy("mixed_bfloat16", mt::Float8Scaling{}); }),
             Contains("a Float8Scaling goes with mixed_float8 only"));
}

TEST_CASE("float8: quantize_float8 with an amax history scales by the history, rolls it in",
          "[float8]") {
  const mt::Tensor history = mt::zeros({3});
  auto dequantised = [](const mt::Float8Quantized& q) {
    return (mt::cast(q.data, mt::kFloat32) * q.scale).to_vector<float>();
  };
  // An empty history: this step's amax, as current scaling.
  const mt::Tensor x1 = mt::from_vector<float>({1.0f, -3.0f, 0.5f}, {3});
  const mt::Float8Quantized q1 = mt::quantize_float8(x1, mt::kFloat8E4M3FN, history, 0, true);
  const mt::Float8Quantized c1 = mt::quantize_float8(x1, mt::kFloat8E4M3FN);
  CHECK(q1.scale.item<float>() == c1.scale.item<float>());
  CHECK(history.to_vector<float>() == std::vector<float>{3.0f, 0.0f, 0.0f});
  // A larger amax than the history's: it saturates at the history's (3), then enters it.
  const mt::Tensor x2 = mt::from_vector<float>({6.0f, 1.5f, -0.75f}, {3});  // 224, -112 in e4m3
  const mt::Float8Quantized q2 = mt::quantize_float8(x2, mt::kFloat8E4M3FN, history, 0, true);
  CHECK(q2.scale.item<float>() == static_cast<float>(1.0 / (448.0f / 3.0f)));
  CHECK(dequantised(q2) == std::vector<float>{3.0f, 1.5f, -0.75f});
  CHECK(q2.amax.item<float>() == 6.0f);
  CHECK(history.to_vector<float>() == std::vector<float>{6.0f, 3.0f, 0.0f});
  // The margin leaves room: 2^1 below the history's 6, so 6 is exact.
  const mt::Float8Quantized q3 = mt::quantize_float8(x2, mt::kFloat8E4M3FN, history, 1, false);
  CHECK(q3.scale.item<float>() == static_cast<float>(1.0 / (224.0f / 6.0f)));
  CHECK(dequantised(q3)[0] == 6.0f);
  CHECK(history.to_vector<float>() == std::vector<float>{6.0f, 3.0f, 0.0f});  // not updated
  // The oldest amax drops out: the scale follows the newest `length` steps.
  for (int i = 0; i < 3; ++i) mt::quantize_float8(x1 * 0.25, mt::kFloat8E4M3FN, history, 0, true);
  CHECK(history.to_vector<float>() == std::vector<float>{0.75f, 0.75f, 0.75f});

  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::quantize_float8(x1, mt::kFloat8E4M3FN, mt::zeros({3}, mt::kFloat64), 0, true);
             }),
             Contains("the amax history must be a contiguous float32 vector"));
  CHECK_THAT(error_of<mt::ValueError>(
                 [&] { mt::quantize_float8(x1, mt::kFloat8E4M3FN, history, -1, true); }),
             Contains("the margin must be in [0, 64]; got -1"));
}

// quantize_float8 is one op with a kernel per backend; here it is checked against the ops it
// is defined by (docs/dtypes.md): amax = max |float32(x)|, factor = max_of(format) / 2^margin /
// reference (1 when the reference is not > 0), data = float8(float32(x) * factor), scale =
// 1 / factor, the history rolled after its largest element was read.
TEST_CASE("float8: quantize_float8's kernel is the composition that defines it, bit for bit",
          "[float8]") {
  std::mt19937_64 rng(77);
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> binade(-20, 20);
  struct Composed {
    mt::Tensor data, scale, amax;
  };
  const auto composed = [](const mt::Tensor& x, mt::DType dtype, const mt::Tensor* history,
                           int margin) {
    const double top = dtype == mt::kFloat8E4M3FN ? 448.0 : 57344.0;
    const mt::Tensor wide = mt::cast(x, mt::kFloat32);
    const mt::Tensor amax = mt::reshape(mt::max(mt::abs(wide)), {1});
    const mt::Tensor zero = mt::zeros({1});
    mt::Tensor reference = amax;
    if (history) {
      const mt::Tensor recorded = mt::reshape(mt::max(*history), {1});
      reference = mt::where(mt::greater(recorded, zero), recorded, amax);
    }
    const mt::Tensor factor =
        mt::where(mt::greater(reference, zero), mt::full({1}, std::ldexp(top, -margin)) / reference,
                  mt::ones({1}));
    return Composed{mt::cast(wide * factor, dtype), mt::ones({1}) / factor, amax};
  };
  for (const mt::DType in : {mt::kFloat32, mt::kBFloat16, mt::kFloat16, mt::kFloat64})
    for (const Spec& f : {kE4M3, kE5M2})
      for (const int margin : {0, 3}) {
        CAPTURE(in.name(), f.dtype.name(), margin);
        // Magnitudes over 2^-20 .. 2^20 (the formats' subnormals to beyond their range), and
        // a tensor large enough for several blocks of the kernels' passes.
        std::vector<double> values(300 * 1031);
        for (double& v : values) v = std::ldexp(normal(rng), binade(rng));
        const mt::Tensor x = mt::cast(mt::from_vector(values, {300, 1031}), in);
        // Current scaling (no margin), then delayed.
        const Composed want = composed(x, f.dtype, nullptr, 0);
        const mt::Float8Quantized got = mt::quantize_float8(x, f.dtype);
        CHECK(bytes_of(got.data) == bytes_of(want.data));
        CHECK(same_value(got.amax.item<float>(), want.amax.item<float>()));
        CHECK(same_value(got.scale.item<float>(), want.scale.item<float>()));
        // Delayed: a history below this amax (saturation), one with a NaN (this step's amax).
        for (const float recorded : {0.5f, std::numeric_limits<float>::quiet_NaN()}) {
          const mt::Tensor history = mt::from_vector<float>({0.25f, recorded, 0.125f}, {3});
          const Composed delayed = composed(x, f.dtype, &history, margin);
          const mt::Float8Quantized q = mt::quantize_float8(x, f.dtype, history, margin, true);
          CHECK(bytes_of(q.data) == bytes_of(delayed.data));
          CHECK(same_value(q.scale.item<float>(), delayed.scale.item<float>()));
          const std::vector<float> rolled = history.to_vector<float>();
          CHECK(rolled[0] == q.amax.item<float>());
          CHECK(rolled[1] == 0.25f);
          CHECK((rolled[2] == recorded || (std::isnan(rolled[2]) && std::isnan(recorded))));
        }
      }
  // NaN and infinity in x: a NaN amax leaves the factor 1, an infinite one makes it 0.
  const float inf = std::numeric_limits<float>::infinity();
  for (const float bad : {std::numeric_limits<float>::quiet_NaN(), inf}) {
    const mt::Tensor x = mt::from_vector<float>({1.0f, bad, -2.0f, 0.5f}, {2, 2});
    const Composed want = composed(x, mt::kFloat8E4M3FN, nullptr, 0);
    const mt::Float8Quantized got = mt::quantize_float8(x, mt::kFloat8E4M3FN);
    CHECK(bytes_of(got.data) == bytes_of(want.data));
    CHECK(same_value(got.scale.item<float>(), want.scale.item<float>()));
    CHECK(same_value(got.amax.item<float>(), want.amax.item<float>()));
  }
  // Empty: amax 0, scale 1.
  const mt::Float8Quantized empty = mt::quantize_float8(mt::zeros({0, 7}), mt::kFloat8E5M2);
  CHECK(empty.data.shape() == mt::Shape{0, 7});
  CHECK(empty.amax.item<float>() == 0.0f);
  CHECK(empty.scale.item<float>() == 1.0f);
}

TEST_CASE(
    "float8: float8_linear with delayed scaling: the first step as current scaling, the "
    "histories of x, w and the gradient rolled",
    "[float8]") {
  mt::manual_seed(41);
  const mt::Variable x(mt::normal({32, 48}), "x"), w(mt::normal({48, 16}) * 0.1, "w");
  const mt::Tensor g = mt::normal({32, 16});
  auto step = [&](const mt::Float8History* h) {
    mt::GradientTape tape;
    const mt::Tensor y = mt::float8_linear(x, w, mt::kFloat32, h);
    const std::vector<mt::Tensor> grads =
        tape.gradient(mt::sum(y * g), std::vector<mt::Tensor>{x, w});
    return std::vector<mt::Tensor>{y, grads[0], grads[1]};
  };
  const mt::Float8History h{
      .input = mt::zeros({4}), .weight = mt::zeros({4}), .grad = mt::zeros({4})};
  const std::vector<mt::Tensor> current = step(nullptr), delayed = step(&h);
  for (std::size_t i = 0; i < 3; ++i)
    CHECK(delayed[i].to_vector<float>() == current[i].to_vector<float>());
  CHECK(h.input.to_vector<float>()[0] == mt::max(mt::abs(x)).item<float>());
  CHECK(h.weight.to_vector<float>()[0] == mt::max(mt::abs(w)).item<float>());
  CHECK(h.grad.to_vector<float>()[0] == mt::max(mt::abs(g)).item<float>());
  CHECK(h.input.to_vector<float>()[1] == 0.0f);
  // Without `update` (inference) nothing moves.
  const mt::Float8History frozen{
      .input = h.input, .weight = h.weight, .grad = h.grad, .update = false};
  const std::vector<float> before = h.input.to_vector<float>();
  step(&frozen);
  CHECK(h.input.to_vector<float>() == before);
}

TEST_CASE("float8: mixed_float8_delayed trains, keeps its histories as weights, saves them",
          "[float8]") {
  const auto [x, y] = blobs(512);

  const mt::Policy policy("mixed_float8", {.kind = mt::Float8Scaling::Kind::Delayed, .history = 8});
  mt::PolicyScope scope(policy);
  auto inputs = ml::Input({16}, {.name = "x"});
  auto h = ml::Dense(64, {.activation = "relu", .name = "hidden"})(inputs);
  auto outputs = ml::Dense(4, {.dtype = "float32", .name = "logits"})(h);
  mt::Model model(inputs, outputs);
  // The FP8 layer has its three histories, non-trainable; the float32 layer has none.
  std::vector<std::string> names;
  for (const auto& w : ml::weight_paths(model)) names.push_back(w.path);
  CHECK(names == std::vector<std::string>{"hidden/kernel", "hidden/bias",
                                          "hidden/input_amax_history", "hidden/kernel_amax_history",
                                          "hidden/grad_amax_history", "logits/kernel",
                                          "logits/bias"});
  CHECK(model.trainable_variables().size() == 4);
  const mt::Variable kernel_history = model.get_layer("hidden")->weights().at(3);
  CHECK(kernel_history.shape() == mt::Shape{8});

  // Inference reads the histories and leaves them as they are.
  (void)model.predict(x.slice(0, 0, 64));
  CHECK(mt::max(kernel_history).item<float>() == 0.0f);
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mt::optim::Adam({.learning_rate = 3e-3}),
                 .metrics = {"accuracy"}});
  const mt::History hist =
      model.fit(x, y, {.batch_size = 64, .epochs = 4, .seed = 2, .verbose = 0});
  CHECK(hist.history.at("loss").back() < 0.5 * hist.history.at("loss").front());
  CHECK(model.evaluate(x, y, {.batch_size = 256}).at("accuracy") > 0.95);
  // Every slot of the 8-step history holds a step's amax now (32 steps ran).
  CHECK(mt::min(kernel_history).item<float>() > 0.0f);
  const mt::DTypeTrace trace = mt::trace_dtypes(model, x.slice(0, 0, 16));
  CHECK(trace.rows[1].note ==
        "float8 matmul (e4m3, gradients e5m2; delayed scaling, 8 steps, margin 0; bias, relu "
        "fused)");

  // A whole-model file holds the policy and the histories: the loaded model predicts the same.
  mixtape_test::TempDir dir("mixtape-float8");
  model.save(dir.file("m.safetensors"));
  std::shared_ptr<mt::Model> loaded = mt::load_model(dir.file("m.safetensors"));
  CHECK(loaded->get_layer("hidden")->dtype_policy() == policy);
  CHECK(loaded->get_layer("hidden")->weights().at(3).to_vector<float>() ==
        kernel_history.to_vector<float>());
  CHECK(loaded->predict(x.slice(0, 0, 32)).to_vector<float>() ==
        model.predict(x.slice(0, 0, 32)).to_vector<float>());
}

TEST_CASE("float8: MultiHeadAttention's four projections keep histories of their own", "[float8]") {
  mt::PolicyScope scope(mt::Policy("mixed_float8_delayed"));
  auto mha = ml::MultiHeadAttention(2, 8, {.use_causal_mask = true, .name = "mha"});
  mt::manual_seed(3);
  const mt::Variable x(mt::normal({2, 16, 16}), "x");
  {
    mt::GradientTape tape;
    const mt::Tensor y = mha(std::vector<mt::Tensor>{x, x}, {.training = true});
    (void)tape.gradient(mt::sum(mt::cast(y, mt::kFloat32)), std::vector<mt::Tensor>{x});
  }
  int histories = 0;
  for (const auto& w : ml::weight_paths(*mha))
    if (w.path.find("amax_history") != std::string::npos) {
      ++histories;
      CAPTURE(w.path);
      CHECK_FALSE(w.variable.trainable());
      CHECK(w.variable.to_vector<float>()[0] > 0.0f);  // the training call rolled its amax in
    }
  CHECK(histories == 12);
  CHECK(mha->trainable_variables().size() == 8);
}
