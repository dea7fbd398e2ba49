// Tensor basics: shapes and strides, views, value semantics, casts, factories, formatting,
// reduced-precision arithmetic through ops.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
using Catch::Matchers::Contains;

namespace {

// [0, 1, ..., n-1] as float32 in the given shape.
mt::Tensor iota(const mt::Shape& shape) {
  std::vector<float> v(static_cast<std::size_t>(shape.numel()));
  std::iota(v.begin(), v.end(), 0.0f);
  return mt::from_vector(v, shape);
}

double mean_of(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

double stddev_of(const std::vector<double>& v) {
  const double m = mean_of(v);
  double s = 0.0;
  for (double x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

}  // namespace

TEST_CASE("tensor: Shape basics", "[tensor]") {
  const mt::Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s[0] == 2);
  CHECK(s.dim(-1) == 4);
  CHECK(s.dim(0) == 2);
  CHECK(s.back() == 4);
  CHECK(s.str() == "[2, 3, 4]");
  CHECK(fmt::format("{}", s) == "[2, 3, 4]");
  CHECK(s == mt::Shape(std::vector<std::int64_t>{2, 3, 4}));
  CHECK_FALSE(s == mt::Shape{2, 3});
  const mt::Shape scalar{};
  CHECK(scalar.rank() == 0);
  CHECK(scalar.numel() == 1);
  CHECK(scalar.str() == "[]");
  CHECK(mt::Shape{3, 0}.numel() == 0);
  CHECK(mt::contiguous_strides({2, 3, 4}) == mt::Strides{12, 4, 1});
  CHECK(mt::contiguous_strides({5}) == mt::Strides{1});
  CHECK(mt::contiguous_strides({}).empty());
  CHECK(mt::broadcast_shapes({3, 1}, {1, 4}, "t") == mt::Shape{3, 4});
  CHECK(mt::broadcast_shapes({}, {2, 2}, "t") == mt::Shape{2, 2});
  CHECK(mt::broadcast_shapes({5, 1, 3}, {4, 1}, "t") == mt::Shape{5, 4, 3});
}

TEST_CASE("tensor: geometry of a new tensor", "[tensor]") {
  const auto t = mt::zeros({2, 3, 4});
  CHECK(t.defined());
  CHECK(t.shape() == mt::Shape{2, 3, 4});
  CHECK(t.strides() == mt::Strides{12, 4, 1});
  CHECK(t.offset() == 0);
  CHECK(t.rank() == 3);
  CHECK(t.numel() == 24);
  CHECK(t.dim(1) == 3);
  CHECK(t.dtype() == mt::kFloat32);
  CHECK(t.device() == mt::Device::cpu());
  CHECK(t.nbytes() == 96);
  CHECK(t.is_contiguous());
  CHECK_FALSE(t.is_variable());
  CHECK(t.storage()->nbytes() >= 96);
  CHECK_FALSE(mt::Tensor().defined());
  const auto e = mt::Tensor::empty({3, 2}, mt::kFloat64);
  CHECK(e.shape() == mt::Shape{3, 2});
  CHECK(e.dtype() == mt::kFloat64);
  CHECK(e.nbytes() == 48);
  // Every tensor has its own identity.
  CHECK(mt::zeros({2}).id() != mt::zeros({2}).id());
}

TEST_CASE("tensor: views share storage", "[tensor]") {
  const auto base = iota({2, 3, 4});
  const auto base_data = base.storage();

  SECTION("reshape") {
    const auto r = base.reshape({6, 4});
    CHECK(r.storage() == base_data);
    CHECK(r.shape() == mt::Shape{6, 4});
    CHECK(r.strides() == mt::Strides{4, 1});
    CHECK(r.to_vector<float>() == base.to_vector<float>());
    const auto r2 = mt::reshape(base, {-1, 8});
    CHECK(r2.shape() == mt::Shape{3, 8});
    CHECK(r2.storage() == base_data);
  }
  SECTION("permute / transpose") {
    const auto p = base.permute({2, 0, 1});
    CHECK(p.storage() == base_data);
    CHECK(p.shape() == mt::Shape{4, 2, 3});
    CHECK(p.strides() == mt::Strides{1, 12, 4});
    CHECK_FALSE(p.is_contiguous());
    const auto pv = p.to_vector<float>();
    // p[k, i, j] = base[i, j, k] = 12 i + 4 j + k
    CHECK(pv[0] == 0.0f);
    CHECK(pv[1] == 4.0f);
    CHECK(pv[3] == 12.0f);
    CHECK(pv[6] == 1.0f);
    const auto t = mt::transpose(iota({2, 3}));
    CHECK(t.shape() == mt::Shape{3, 2});
    CHECK(t.strides() == mt::Strides{1, 3});
    CHECK(t.to_vector<float>() == std::vector<float>{0, 3, 1, 4, 2, 5});
  }
  SECTION("slice") {
    const auto m = iota({4, 6});
    const auto s = m.slice(1, 1, 6, 2);  // columns 1, 3, 5
    CHECK(s.storage() == m.storage());
    CHECK(s.shape() == mt::Shape{4, 3});
    CHECK(s.strides() == mt::Strides{6, 2});
    CHECK(s.offset() == 1);
    CHECK(s.to_vector<float>() == std::vector<float>{1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23});
    const auto rows = mt::slice(m, 0, 2, 4);
    CHECK(rows.offset() == 12);
    CHECK(rows.shape() == mt::Shape{2, 6});
    CHECK(rows.is_contiguous());
  }
  SECTION("expand") {
    const auto c = iota({3, 1});
    const auto e = c.expand({2, 3, 4});
    CHECK(e.storage() == c.storage());
    CHECK(e.shape() == mt::Shape{2, 3, 4});
    CHECK(e.strides()[0] == 0);
    CHECK(e.strides()[2] == 0);
    const auto ev = e.to_vector<float>();
    CHECK(ev.size() == 24);
    CHECK(ev[0] == 0.0f);
    CHECK(ev[5] == 1.0f);
    CHECK(ev[23] == 2.0f);
  }
  SECTION("writes through the base are visible in views") {
    const auto t = mt::transpose(base, 0, 2);
    const auto s = base.slice(2, 1, 3);
    base.data<float>()[1] = 100.0f;                // base[0, 0, 1]
    CHECK(t.to_vector<float>()[3 * 2] == 100.0f);  // t[1, 0, 0]
    CHECK(s.to_vector<float>()[0] == 100.0f);      // s[0, 0, 0]
  }
  SECTION("squeeze / unsqueeze / flatten") {
    const auto u = mt::unsqueeze(base, 1);
    CHECK(u.shape() == mt::Shape{2, 1, 3, 4});
    CHECK(u.storage() == base_data);
    CHECK(mt::squeeze(u, 1).shape() == mt::Shape{2, 3, 4});
    CHECK(mt::unsqueeze(base, -1).shape() == mt::Shape{2, 3, 4, 1});
    CHECK(mt::flatten(base).shape() == mt::Shape{2, 12});
    CHECK(mt::flatten(base, 0).shape() == mt::Shape{24});
  }
}

TEST_CASE("tensor: contiguous() copies correctly", "[tensor]") {
  const auto base = iota({2, 3, 4});
  CHECK(base.contiguous().id() == base.id());  // already contiguous: *this
  const auto p = base.permute({1, 2, 0});
  const auto c = p.contiguous();
  CHECK(c.is_contiguous());
  CHECK(c.storage() != base.storage());
  CHECK(c.shape() == mt::Shape{3, 4, 2});
  CHECK(c.strides() == mt::Strides{8, 2, 1});
  CHECK(c.to_vector<float>() == p.to_vector<float>());
  // c[j, k, i] = base[i, j, k]
  const auto cv = c.to_vector<float>();
  CHECK(cv[1] == 12.0f);
  CHECK(cv[2] == 1.0f);
  // Expanded and strided views materialise too.
  const auto e = mt::contiguous(iota({1, 3}).expand({2, 3}));
  CHECK(e.to_vector<float>() == std::vector<float>{0, 1, 2, 0, 1, 2});
  const auto s = mt::contiguous(iota({6}).slice(0, 0, 6, 3));
  CHECK(s.to_vector<float>() == std::vector<float>{0, 3});
  // The copy does not alias the base.
  c.data<float>()[0] = -1.0f;
  CHECK(base.to_vector<float>()[0] == 0.0f);
}

TEST_CASE("tensor: value semantics", "[tensor]") {
  const auto a = mt::zeros({3});
  mt::Tensor b = a;  // NOLINT(performance-unnecessary-copy-initialization)
  CHECK(b.id() == a.id());
  CHECK(b.storage() == a.storage());
  CHECK(b.data_ptr() == a.data_ptr());
  a.data<float>()[2] = 7.0f;
  CHECK(b.to_vector<float>() == std::vector<float>{0.0f, 0.0f, 7.0f});
  mt::Tensor c;
  c = b;
  CHECK(c.id() == a.id());
  const auto d = a.detach();
  CHECK(d.storage() == a.storage());  // same data
  CHECK(d.to_vector<float>() == a.to_vector<float>());
}

TEST_CASE("tensor: to(dtype) for every float dtype", "[tensor]") {
  const std::vector<double> exact = {0.5, -1.25, 3.0, 1024.0, -0.0, 2.0};
  for (mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
    INFO(dt.name());
    const auto src = mt::from_vector(exact, {2, 3}, mt::kFloat64);
    const auto t = src.to(dt);
    CHECK(t.dtype() == dt);
    CHECK(t.shape() == mt::Shape{2, 3});
    CHECK(t.to_vector<double>() == exact);
    CHECK(t.to(dt).id() == t.id());  // no-op returns *this
    CHECK(t.to(mt::kFloat32).to_vector<double>() == exact);
    CHECK(mt::cast(t, mt::kFloat64).to_vector<double>() == exact);
    // Through every other float dtype and back.
    for (mt::DType other : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
      INFO("via " << other.name());
      CHECK(t.to(other).to(dt).to_vector<double>() == exact);
    }
  }
  // Rounding on the way down.
  const auto third = mt::full({}, 1.0 / 3.0, mt::kFloat64);
  CHECK(third.to(mt::kFloat16).item<double>() == Approx(0.333251953125));
  CHECK(third.to(mt::kBFloat16).item<double>() == Approx(0.333984375));
  CHECK(third.to(mt::kFloat32).item<double>() == static_cast<double>(1.0f / 3.0f));
  CHECK(std::isinf(mt::full({}, 70000.0, mt::kFloat32).to(mt::kFloat16).item<float>()));
  CHECK(mt::full({}, 70000.0, mt::kFloat32).to(mt::kBFloat16).item<float>() ==
        Approx(70000.0).epsilon(0.01));
  // Floating -> integer truncates toward zero; anything -> bool is (x != 0).
  const auto f = mt::from_vector(std::vector<float>{2.7f, -2.7f, 0.0f, 5.0f}, {4});
  CHECK(f.to(mt::kInt32).to_vector<std::int32_t>() == std::vector<std::int32_t>{2, -2, 0, 5});
  CHECK(f.to(mt::kInt64).to_vector<std::int64_t>() == std::vector<std::int64_t>{2, -2, 0, 5});
  CHECK(f.to(mt::kBool).to_vector<bool>() == std::vector<bool>{true, true, false, true});
  CHECK(f.to(mt::kInt32).to(mt::kFloat32).to_vector<float>() == std::vector<float>{2, -2, 0, 5});
  // A strided source.
  const auto t = mt::transpose(iota({2, 3})).to(mt::kFloat16);
  CHECK(t.to_vector<float>() == std::vector<float>{0, 3, 1, 4, 2, 5});
}

TEST_CASE("tensor: from_vector / to_vector / item round-trips", "[tensor]") {
  {
    const std::vector<float> v = {1.5f, -2.25f, 3.0f, 0.0f, 1e-3f, 6.0f};
    const auto t = mt::from_vector(v, {2, 3});
    CHECK(t.dtype() == mt::kFloat32);
    CHECK(t.to_vector<float>() == v);
    CHECK(t.slice(1, 1, 2).slice(0, 0, 1).item<float>() == -2.25f);
    CHECK(t.data<float>()[4] == 1e-3f);
  }
  {
    const std::vector<double> v = {0.1, 1e-300, -1e300};
    const auto t = mt::from_vector(v, {3});
    CHECK(t.dtype() == mt::kFloat64);
    CHECK(t.to_vector<double>() == v);
  }
  {
    const std::vector<std::int32_t> v = {-7, 0, 2147483647};
    CHECK(mt::from_vector(v, {3}).to_vector<std::int32_t>() == v);
    CHECK(mt::from_vector(v, {3}).dtype() == mt::kInt32);
  }
  {
    const std::vector<std::int64_t> v = {-9, 1LL << 40, 3};
    CHECK(mt::from_vector(v, {3, 1}).to_vector<std::int64_t>() == v);
    CHECK(mt::from_vector(v, {3, 1}).dtype() == mt::kInt64);
  }
  {
    const std::vector<std::uint8_t> v = {0, 255, 17};
    CHECK(mt::from_vector(v, {3}).to_vector<std::uint8_t>() == v);
    CHECK(mt::from_vector(v, {3}).dtype() == mt::kUInt8);
  }
  {
    const std::vector<bool> v = {true, false, true};
    const auto t = mt::from_vector(v, {3});
    CHECK(t.dtype() == mt::kBool);
    CHECK(t.to_vector<bool>() == v);
  }
  {
    const std::vector<mt::half> v = {mt::half(1.5f), mt::half(-0.25f)};
    const auto t = mt::from_vector(v, {2});
    CHECK(t.dtype() == mt::kFloat16);
    CHECK(t.to_vector<float>() == std::vector<float>{1.5f, -0.25f});
    CHECK(t.data<mt::half>()[0].bits == mt::half(1.5f).bits);
  }
  {
    // Converting on the way in.
    const auto t = mt::from_vector(std::vector<double>{1.0, 2.5}, {2}, mt::kBFloat16);
    CHECK(t.dtype() == mt::kBFloat16);
    CHECK(t.to_vector<double>() == std::vector<double>{1.0, 2.5});
    CHECK(mt::from_vector(std::vector<int>{3, 4}, {2}, mt::kFloat32).to_vector<float>() ==
          std::vector<float>{3.0f, 4.0f});
  }
  CHECK(mt::full({}, 42.0, mt::kInt64).item<std::int64_t>() == 42);
  CHECK(mt::full({1, 1, 1}, -3.5, mt::kFloat16).item<float>() == -3.5f);
  CHECK_THROWS_AS(mt::from_vector(std::vector<float>{1, 2, 3}, {2, 2}), mt::Error);
}

TEST_CASE("tensor: constant factories", "[tensor]") {
  CHECK(mt::zeros({2, 2}).to_vector<float>() == std::vector<float>(4, 0.0f));
  CHECK(mt::ones({3}, mt::kFloat64).to_vector<double>() == std::vector<double>(3, 1.0));
  CHECK(mt::ones({3}, mt::kFloat64).dtype() == mt::kFloat64);
  CHECK(mt::full({2, 3}, 2.5, mt::kBFloat16).to_vector<float>() == std::vector<float>(6, 2.5f));
  CHECK(mt::full({2}, 7.0, mt::kInt32).to_vector<std::int32_t>() ==
        std::vector<std::int32_t>{7, 7});
  CHECK(mt::full({2}, 1.0, mt::kBool).to_vector<bool>() == std::vector<bool>{true, true});
  CHECK(mt::full({}, 3.0).shape() == mt::Shape{});
  const auto t = mt::full({2, 3}, 4.0, mt::kFloat16);
  CHECK(mt::zeros_like(t).dtype() == mt::kFloat16);
  CHECK(mt::zeros_like(t).shape() == t.shape());
  CHECK(mt::zeros_like(t).to_vector<float>() == std::vector<float>(6, 0.0f));
  CHECK(mt::ones_like(t).to_vector<float>() == std::vector<float>(6, 1.0f));
  CHECK(mt::full_like(t, -2.0).to_vector<float>() == std::vector<float>(6, -2.0f));
  CHECK(mt::full_like(t, -2.0).id() != t.id());
}

TEST_CASE("tensor: arange", "[tensor]") {
  const auto a = mt::arange(0.0, 5.0);
  CHECK(a.dtype() == mt::kFloat32);
  CHECK(a.shape() == mt::Shape{5});
  CHECK(a.to_vector<float>() == std::vector<float>{0, 1, 2, 3, 4});
  CHECK(mt::arange(1.0, 2.0, 0.25).to_vector<double>() ==
        std::vector<double>{1.0, 1.25, 1.5, 1.75});
  CHECK(mt::arange(3.0, 0.0, -1.0).to_vector<double>() == std::vector<double>{3.0, 2.0, 1.0});
  const auto i = mt::arange(std::int64_t{4});
  CHECK(i.dtype() == mt::kInt64);
  CHECK(i.to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 1, 2, 3});
  CHECK(mt::arange(std::int64_t{3}, mt::kInt32).dtype() == mt::kInt32);
  CHECK(mt::arange(0.0, 3.0, 1.0, mt::kFloat64).dtype() == mt::kFloat64);
}

TEST_CASE("tensor: random factories", "[tensor]") {
  const std::int64_t n = 20000;
  SECTION("uniform in range with a sane mean") {
    mt::Generator gen(1);
    const auto u = mt::uniform({n}, -2.0, 6.0, mt::kFloat64, mt::Device::cpu(), &gen);
    const auto v = u.to_vector<double>();
    double lo = 1e9, hi = -1e9;
    for (double x : v) {
      lo = std::min(lo, x);
      hi = std::max(hi, x);
    }
    CHECK(lo >= -2.0);
    CHECK(hi < 6.0);
    CHECK(lo < -1.9);
    CHECK(hi > 5.9);
    CHECK(mean_of(v) == Approx(2.0).margin(0.1));
    CHECK(stddev_of(v) == Approx(8.0 / std::sqrt(12.0)).epsilon(0.03));
    // float32 and reduced dtypes too.
    const auto u16 = mt::uniform({1000}, 0.0, 1.0, mt::kFloat16, mt::Device::cpu(), &gen);
    CHECK(u16.dtype() == mt::kFloat16);
    for (float x : u16.to_vector<float>()) {
      CHECK(x >= 0.0f);
      CHECK(x <= 1.0f);
    }
  }
  SECTION("normal with a sane mean and stddev") {
    mt::Generator gen(2);
    const auto z = mt::normal({n}, 3.0, 0.5, mt::kFloat32, mt::Device::cpu(), &gen);
    CHECK(z.dtype() == mt::kFloat32);
    const auto v = z.to_vector<double>();
    CHECK(mean_of(v) == Approx(3.0).margin(0.02));
    CHECK(stddev_of(v) == Approx(0.5).epsilon(0.03));
  }
  SECTION("the same seed gives the same values, a different seed different ones") {
    mt::Generator g1(1234), g2(1234), g3(4321);
    const auto a = mt::normal({64}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &g1);
    const auto b = mt::normal({64}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &g2);
    const auto c = mt::normal({64}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &g3);
    CHECK(a.to_vector<float>() == b.to_vector<float>());
    CHECK(a.to_vector<float>() != c.to_vector<float>());
    // The generator advances: a second draw differs from the first.
    const auto a2 = mt::normal({64}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &g1);
    CHECK(a2.to_vector<float>() != a.to_vector<float>());
    // Reseeding restarts the sequence.
    g1.seed(1234);
    CHECK(mt::normal({64}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &g1).to_vector<float>() ==
          a.to_vector<float>());
    mt::Generator g4(99), g5(99);
    CHECK(g4.next_u64() == g5.next_u64());
    const double x = g4.next_uniform();
    CHECK(x >= 0.0);
    CHECK(x < 1.0);
    CHECK(mt::uniform({8}, 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &g4).to_vector<double>() !=
          mt::uniform({8}, 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &g4).to_vector<double>());
  }
  SECTION("manual_seed makes the default generator reproducible") {
    mt::manual_seed(77);
    const auto a = mt::uniform({16});
    mt::manual_seed(77);
    const auto b = mt::uniform({16});
    CHECK(a.to_vector<float>() == b.to_vector<float>());
    mt::manual_seed(78);
    CHECK(mt::uniform({16}).to_vector<float>() != a.to_vector<float>());
  }
}

TEST_CASE("tensor: fmt formatting", "[tensor]") {
  const auto t = mt::from_vector(std::vector<float>{1.5f, -2.0f, 3.25f, 4.0f}, {2, 2});
  const std::string s = fmt::format("{}", t);
  CHECK_THAT(s, Contains("1.5") && Contains("-2") && Contains("3.25") && Contains("4"));
  CHECK_THAT(s, Contains("float32"));
  CHECK(s == mt::to_string(t));
  const std::string h = fmt::format("{}", mt::full({3}, 0.5, mt::kFloat16));
  CHECK_THAT(h, Contains("0.5") && Contains("float16"));
  const std::string i = fmt::format("{}", mt::arange(std::int64_t{3}));
  CHECK_THAT(i, Contains("0") && Contains("1") && Contains("2") && Contains("int64"));
  // Large tensors are summarised.
  const std::string big = fmt::format("{}", mt::zeros({100, 100}));
  CHECK_THAT(big, Contains("..."));
  CHECK(big.size() < 20000);
  // A strided view prints its logical values.
  CHECK_THAT(fmt::format("{}", mt::transpose(t)), Contains("3.25"));
}

TEST_CASE("tensor: reduced-precision arithmetic through ops", "[tensor]") {
  // float16 overflows at 65504.
  const auto big = mt::full({}, 256.0, "float16") * mt::full({}, 256.0, "float16");
  CHECK(big.dtype() == mt::kFloat16);
  CHECK(std::isinf(big.item<float>()));
  CHECK(big.item<float>() > 0.0f);
  // ... and underflows below ~6e-8.
  const auto tiny = mt::full({}, 1e-5, "float16") * mt::full({}, 1e-5, "float16");
  CHECK(tiny.dtype() == mt::kFloat16);
  CHECK(tiny.item<float>() == 0.0f);
  // bfloat16 keeps float32's range.
  const auto bbig = mt::full({}, 256.0, "bfloat16") * mt::full({}, 256.0, "bfloat16");
  CHECK(bbig.item<float>() == 65536.0f);
  // float16 + bfloat16 -> float32.
  const auto mixed = mt::full({2}, 1.5, "float16") + mt::full({2}, 0.25, "bfloat16");
  CHECK(mixed.dtype() == mt::kFloat32);
  CHECK(mixed.to_vector<float>() == std::vector<float>{1.75f, 1.75f});
  // A double scalar takes the tensor's dtype (no widening).
  CHECK((mt::full({2}, 1.0, "float16") * 2.0).dtype() == mt::kFloat16);
  CHECK((3.0 + mt::full({2}, 1.0, "bfloat16")).dtype() == mt::kBFloat16);
  CHECK((mt::full({}, 300.0, "float16") * 300.0).item<float>() ==
        std::numeric_limits<float>::infinity());
  // float16 rounding: 1 + 2^-11 rounds to 1 (ties to even), 1 + 2^-10 is representable.
  CHECK((mt::full({}, 1.0, "float16") + std::ldexp(1.0, -11)).item<double>() == 1.0);
  CHECK((mt::full({}, 1.0, "float16") + std::ldexp(1.0, -10)).item<double>() ==
        1.0 + std::ldexp(1.0, -10));
  // The scalar types agree.
  CHECK(std::isinf(static_cast<float>(mt::half(256.0f) * mt::half(256.0f))));
  CHECK(static_cast<float>(mt::half(1e-5f) * mt::half(1e-5f)) == 0.0f);
  // Reductions of reduced floats accumulate in float32: 4096 ones sum exactly in float16
  // output range (a float16 accumulator would stall at 2048).
  const auto ones16 = mt::ones({4096}, mt::kFloat16);
  const auto s = mt::sum(ones16);
  CHECK(s.dtype() == mt::kFloat16);
  CHECK(s.item<float>() == 4096.0f);
  CHECK(mt::mean(ones16).item<float>() == 1.0f);
}

TEST_CASE("tensor: memory_stats counts the bytes tensors' storages hold, and their peak",
          "[tensor]") {
  const mt::Device cpu = mt::Device::cpu();
  const std::uint64_t start = mt::memory_stats(cpu).in_use;
  mt::reset_peak_memory(cpu);
  CHECK(mt::memory_stats(cpu).peak == start);
  {
    const auto a = mt::Tensor::empty({1000}, mt::kFloat32, cpu);
    CHECK(mt::memory_stats(cpu).in_use == start + 4000);
    {
      const auto b = mt::Tensor::empty({10, 50}, mt::kFloat16, cpu);
      const auto view = b.reshape({500});  // a view: no storage of its own
      CHECK(mt::memory_stats(cpu).in_use == start + 5000);
    }
    CHECK(mt::memory_stats(cpu).in_use == start + 4000);
    CHECK(mt::memory_stats(cpu).peak == start + 5000);
    mt::reset_peak_memory(cpu);  // from what is held now
    CHECK(mt::memory_stats(cpu).peak == start + 4000);
  }
  CHECK(mt::memory_stats(cpu).in_use == start);
  CHECK(mt::memory_stats(cpu).peak == start + 4000);
  // Another device's counts are its own; an index past the table reads 0.
  CHECK(mt::memory_stats(mt::Device::cuda(mt::kMemoryStatsDevices)).in_use == 0);
}
