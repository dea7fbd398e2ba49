// CPU memory, elementwise, reduction and index kernels, called straight through the
// dispatch table and checked against double-precision references computed here.
// Outputs are poisoned with 0xFF bytes (NaN for floats, -1 / 255 for integers, an invalid
// byte for bool) before every call, so unwritten elements show up.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

using namespace mixtape;
using std::int64_t;

namespace {

const std::vector<DType> kAllTypes = {kFloat32, kFloat16, kBFloat16, kFloat64,
                                      kInt32,   kInt64,   kUInt8,    kBool};
const std::vector<DType> kFloatTypes = {kFloat32, kFloat16, kBFloat16, kFloat64};
const std::vector<DType> kArithTypes = {kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64};

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// Relative tolerance of one computed result per dtype (integers are exact).
double tolerance(DType dt) {
  if (dt == kFloat64) return 1e-12;
  if (dt == kFloat32) return 1e-6;
  if (dt == kFloat16) return 1e-3;
  if (dt == kBFloat16) return 1e-2;
  return 0.0;
}

std::mt19937_64& rng() {
  static std::mt19937_64 gen(12345);
  return gen;
}

// Writes the exact value v (representable in dt) into element i of a contiguous tensor.
void put(const Tensor& t, int64_t i, double v) {
  char* p = static_cast<char*>(t.data_ptr()) + i * static_cast<int64_t>(t.dtype().itemsize());
  switch (t.dtype().code()) {
    case DType::Float32:
      *reinterpret_cast<float*>(p) = static_cast<float>(v);
      break;
    case DType::Float16:
      *reinterpret_cast<half*>(p) = half(static_cast<float>(v));
      break;
    case DType::BFloat16:
      *reinterpret_cast<bfloat16*>(p) = bfloat16(static_cast<float>(v));
      break;
    case DType::Float64:
      *reinterpret_cast<double*>(p) = v;
      break;
    case DType::Int32:
      *reinterpret_cast<std::int32_t*>(p) = static_cast<std::int32_t>(v);
      break;
    case DType::Int64:
      *reinterpret_cast<int64_t*>(p) = static_cast<int64_t>(v);
      break;
    case DType::UInt8:
      *reinterpret_cast<std::uint8_t*>(p) = static_cast<std::uint8_t>(v);
      break;
    case DType::Bool:
      *reinterpret_cast<std::uint8_t*>(p) = v != 0 ? 1 : 0;
      break;
    case DType::Float8E4M3FN:
      *reinterpret_cast<float8_e4m3fn*>(p) = float8_e4m3fn(static_cast<float>(v));
      break;
    case DType::Float8E5M2:
      *reinterpret_cast<float8_e5m2*>(p) = float8_e5m2(static_cast<float>(v));
      break;
  }
}

// Element i of a contiguous tensor, exactly, as a double.
double get(const Tensor& t, int64_t i) {
  const char* p =
      static_cast<const char*>(t.data_ptr()) + i * static_cast<int64_t>(t.dtype().itemsize());
  return detail::read_as_double(p, t.dtype());
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<std::size_t>(i)] = get(t, i);
  return v;
}

Tensor from_values(const std::vector<double>& v, const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  for (std::size_t i = 0; i < v.size(); ++i) put(t, static_cast<int64_t>(i), v[i]);
  return t;
}

// Random data: uniform reals in [lo, hi) for floating dtypes (through mixtape::uniform),
// uniform integers in [lo, hi] otherwise (bool: 0 or 1).
Tensor random(const Shape& shape, DType dt, double lo = -1.0, double hi = 1.0) {
  if (dt.is_floating()) return uniform(shape, lo, hi, dt);
  if (dt == kBool) lo = 0, hi = 1;
  if (dt == kUInt8) lo = std::max(lo, 0.0), hi = std::min(hi, 255.0);
  std::uniform_int_distribution<int64_t> dist(static_cast<int64_t>(lo), static_cast<int64_t>(hi));
  std::vector<double> v(static_cast<std::size_t>(shape.numel()));
  for (double& x : v) x = static_cast<double>(dist(rng()));
  return from_values(v, shape, dt);
}

void poison(const Tensor& t) { std::memset(t.data_ptr(), 0xFF, t.nbytes()); }

Tensor empty_poisoned(const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  poison(t);
  return t;
}

// True when a is within tol of e, relative to max(|e|, floor); NaN only matches NaN.
bool close(double a, double e, double tol, double floor) {
  if (std::isnan(e)) return std::isnan(a);
  if (std::isinf(e)) return a == e;
  return std::fabs(a - e) <= tol * std::max(std::fabs(e), floor);
}

// Checks every element, reporting the first mismatch.
void check_close(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
                 double floor = 1e-6) {
  REQUIRE(actual.size() == expected.size());
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (!close(actual[i], expected[i], tol, floor)) {
      INFO("element " << i << ": got " << actual[i] << ", expected " << expected[i]);
      CHECK(false);
      return;
    }
  }
}

// Storage offsets (in elements) of each element of a view, in row-major order.
std::vector<int64_t> view_offsets(const Shape& shape, const Strides& strides, int64_t offset) {
  std::vector<int64_t> out(static_cast<std::size_t>(shape.numel()));
  std::vector<int64_t> idx(shape.rank(), 0);
  for (auto& o : out) {
    int64_t off = offset;
    for (std::size_t d = 0; d < shape.rank(); ++d) off += idx[d] * strides[d];
    o = off;
    for (std::size_t d = shape.rank(); d-- > 0;) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// The values of a view of a contiguous base, in row-major order.
std::vector<double> view_values(const Tensor& base, const Shape& shape, const Strides& strides,
                                int64_t offset) {
  std::vector<double> out;
  for (int64_t off : view_offsets(shape, strides, offset)) out.push_back(get(base, off));
  return out;
}

// A view over a freshly made random base: shape, strides and the base's shape.
struct View {
  Tensor base, view;
  Shape shape;
  Strides strides;
  std::vector<double> vals;  // the view's values, row-major
};

View make_view(const Shape& base_shape, const Shape& shape, const Strides& strides, DType dt,
               double lo, double hi) {
  View v;
  v.base = random(base_shape, dt, lo, hi);
  v.view = Tensor::view_of(v.base, shape, strides, 0);
  v.shape = shape;
  v.strides = strides;
  v.vals = view_values(v.base, shape, strides, 0);
  return v;
}

// Broadcast patterns of two operands onto out's shape.
struct Pattern {
  std::string name;
  Shape out;
  Shape a_base, b_base;
  Strides a_strides, b_strides;
};

std::vector<Pattern> patterns() {
  return {
      {"contiguous", {130, 300}, {130, 300}, {130, 300}, {300, 1}, {300, 1}},
      {"scalar b", {130, 300}, {130, 300}, {1}, {300, 1}, {0, 0}},
      {"scalar a", {7, 9}, {1}, {7, 9}, {0, 0}, {9, 1}},
      {"row broadcast", {130, 300}, {130, 300}, {300}, {300, 1}, {0, 1}},
      {"column broadcast", {13, 30}, {13, 30}, {13}, {30, 1}, {1, 0}},
      {"general [3,1,5]x[1,4,1]", {3, 4, 5}, {3, 1, 5}, {1, 4, 1}, {5, 0, 1}, {0, 1, 0}},
      {"general large", {64, 40, 30}, {64, 1, 30}, {1, 40, 1}, {30, 0, 1}, {0, 1, 0}},
      {"transposed a", {40, 50}, {50, 40}, {40, 50}, {1, 40}, {50, 1}},
      {"single element", {}, {1}, {1}, {}, {}},
  };
}

template <typename Fn>
Fn* kernel(OpId op, DType dt) {
  return find_kernel<Fn>(op, DeviceType::CPU, dt).raw();
}

// Integer wrap-around as the kernels define it.
double wrap(double v, DType dt) {
  const auto i = static_cast<int64_t>(v);
  if (dt == kInt32) return static_cast<std::int32_t>(static_cast<std::uint32_t>(i));
  if (dt == kUInt8) return static_cast<std::uint8_t>(i);
  return static_cast<double>(i);
}

}  // namespace

// --- Memory ------------------------------------------------------------------------------

TEST_CASE("copy: strided views of every dtype", "[cpu_kernels]") {
  struct Case {
    std::string name;
    Shape base, shape;
    Strides strides;
    int64_t offset;
  };
  const std::vector<Case> cases = {
      {"contiguous with offset", {4, 5, 6}, {3, 5, 6}, {30, 6, 1}, 30},
      {"permuted (2, 0, 1)", {4, 5, 6}, {6, 4, 5}, {1, 30, 6}, 0},
      {"transposed last two", {4, 5, 6}, {4, 6, 5}, {30, 1, 6}, 0},
      {"sliced [:, 1:4, ::2]", {4, 5, 6}, {4, 3, 3}, {30, 6, 2}, 6},
      {"expanded [5] -> [3, 4, 5]", {5}, {3, 4, 5}, {0, 0, 1}, 0},
      {"expanded [4, 1] -> [4, 7]", {4, 1}, {4, 7}, {1, 0}, 0},
      {"single element", {4}, {}, {}, 2},
      {"large transpose", {300, 200}, {200, 300}, {1, 200}, 0},
      {"large strided", {300, 400}, {300, 200}, {400, 2}, 1},
  };
  for (DType dt : kAllTypes) {
    for (const Case& c : cases) {
      SECTION(std::string(dt.name()) + " " + c.name) {
        Tensor base = random(c.base, dt, -100, 100);
        Tensor src = Tensor::view_of(base, c.shape, c.strides, c.offset);
        Tensor dst = empty_poisoned(c.shape, dt);
        kernel<kernels::CopyFn>(OpId::copy, dt)(src, dst);
        const auto item = static_cast<int64_t>(dt.itemsize());
        const auto offs = view_offsets(c.shape, c.strides, c.offset);
        const char* b = static_cast<const char*>(base.data_ptr());
        const char* d = static_cast<const char*>(dst.data_ptr());
        bool same = true;
        for (std::size_t i = 0; i < offs.size() && same; ++i)
          same = std::memcmp(d + static_cast<int64_t>(i) * item, b + offs[i] * item,
                             static_cast<std::size_t>(item)) == 0;
        CHECK(same);
      }
    }
  }
}

TEST_CASE("fill: every dtype, with correct rounding", "[cpu_kernels]") {
  const std::vector<double> vals = {3.7, -2.5, 0.0, 1e10, 0.1};
  for (DType dt : kAllTypes) {
    for (double v : vals) {
      for (int64_t n : {int64_t{7}, int64_t{100000}}) {
        Tensor t = empty_poisoned({n}, dt);
        kernel<kernels::FillFn>(OpId::fill, dt)(t, v);
        double expected = 0;
        switch (dt.code()) {
          case DType::Float32:
            expected = static_cast<float>(v);
            break;
          case DType::Float16:
            expected = half(static_cast<float>(v));
            break;
          case DType::BFloat16:
            expected = bfloat16(static_cast<float>(v));
            break;
          case DType::Float64:
            expected = v;
            break;
          case DType::Int32:
            expected = v > 2147483647.0 ? 2147483647.0 : std::trunc(v);
            break;
          case DType::Int64:
            expected = std::trunc(v);
            break;
          case DType::UInt8:
            expected = std::clamp(std::trunc(v), 0.0, 255.0);
            break;
          case DType::Bool:
            expected = v != 0 ? 1 : 0;
            break;
          case DType::Float8E4M3FN:  // not in kAllTypes (tests/test_float8.cpp)
          case DType::Float8E5M2:
            FAIL("float8 fill is tested in tests/test_float8.cpp");
            break;
        }
        INFO(dt.name() << " fill " << v << " n=" << n);
        check_close(values(t), std::vector<double>(static_cast<std::size_t>(n), expected), 0.0);
        if (dt == kBool) {
          const auto* p = static_cast<const std::uint8_t*>(t.data_ptr());
          CHECK(std::all_of(p, p + n, [&](std::uint8_t x) { return x == expected; }));
        }
      }
    }
  }
  SECTION("double rounding is avoided for 16-bit floats") {
    // Just above the midpoint between 1 and the next 16-bit value: rounding to float32
    // first would land exactly on the midpoint and round down to 1.
    Tensor h = empty_poisoned({3}, kFloat16);
    kernel<kernels::FillFn>(OpId::fill, kFloat16)(
        h, 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40));
    CHECK(h.data<half>()[2].bits == 0x3C01);
    Tensor b = empty_poisoned({3}, kBFloat16);
    kernel<kernels::FillFn>(OpId::fill, kBFloat16)(
        b, 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40));
    CHECK(b.data<bfloat16>()[1].bits == 0x3F81);
  }
}

namespace {

// The expected result of casting the exact value v of dtype src to dtype dst.
double expected_cast(double v, DType src, DType dst) {
  switch (dst.code()) {
    case DType::Float64:
      return v;
    case DType::Float32:
      return static_cast<float>(v);
    case DType::Float16:
      return half(static_cast<float>(v));  // v is float-exact here
    case DType::BFloat16:
      return bfloat16(static_cast<float>(v));
    case DType::Bool:
      return v != 0 ? 1.0 : 0.0;
    default:
      break;
  }
  if (src.is_floating()) {  // truncate, saturate, NaN -> 0
    if (std::isnan(v)) return 0;
    const double t = std::trunc(v);
    if (dst == kInt32) return std::clamp(t, -2147483648.0, 2147483647.0);
    if (dst == kUInt8) return std::clamp(t, 0.0, 255.0);
    return std::clamp(t, -9223372036854775808.0, 9223372036854775807.0);
  }
  return wrap(v, dst);
}

// Source values for a cast test: specials plus random values, all exact in dt.
std::vector<double> cast_sources(DType dt) {
  std::vector<double> v;
  if (dt.is_floating()) {
    v = {0.0, -0.0, 0.7, -0.7, 2.5, -2.5, 255.5, 256.0, -1.0, 100.25, kNaN};
    if (dt != kFloat16) v.insert(v.end(), {1e10, -1e10, 3e9});
    if (dt == kFloat16) v.push_back(65504.0);
    // float64 sources are float32 values, so that the reference's rounding through
    // float32 is exact (double rounding has its own section).
    Tensor r = random({2000}, dt == kFloat64 ? kFloat32 : dt, -300, 300);
    for (double x : values(r)) v.push_back(x);
  } else if (dt == kBool) {
    v = {0, 1, 1, 0, 1};
  } else if (dt == kUInt8) {
    v = {0, 1, 127, 128, 255, 37};
  } else {
    v = {0, 1, -1, 127, 255, 256, 300, -300, 70000, -2147483648.0, 2147483647.0, 16777217};
    if (dt == kInt64) v.insert(v.end(), {5e9, -5e9, 9007199254740993.0});
    Tensor r = random({2000}, dt, -100000, 100000);
    for (double x : values(r)) v.push_back(x);
  }
  return v;
}

}  // namespace

TEST_CASE("cast: every pair of dtypes", "[cpu_kernels]") {
  for (DType src : kAllTypes) {
    const std::vector<double> sv = cast_sources(src);
    const Shape shape{static_cast<int64_t>(sv.size())};
    Tensor x = from_values(sv, shape, src);
    const std::vector<double> xv = values(x);  // the exact stored source values
    for (DType dst : kAllTypes) {
      SECTION(std::string(src.name()) + " -> " + std::string(dst.name())) {
        Tensor out = empty_poisoned(shape, dst);
        kernel<kernels::CastFn>(OpId::cast, src)(x, out);
        const std::vector<double> ov = values(out);
        for (std::size_t i = 0; i < xv.size(); ++i) {
          const double e = expected_cast(xv[i], src, dst);
          INFO("element " << i << " = " << xv[i] << ": got " << ov[i] << ", expected " << e);
          if (std::isnan(e))
            REQUIRE(std::isnan(ov[i]));
          else
            REQUIRE(ov[i] == e);
        }
        if (dst == kBool) {
          const auto* p = static_cast<const std::uint8_t*>(out.data_ptr());
          CHECK(std::all_of(p, p + out.numel(), [](std::uint8_t b) { return b <= 1; }));
        }
        if (dst == kFloat16 && src.is_floating() && src != kFloat64) {
          for (std::size_t i = 0; i < xv.size(); ++i)
            REQUIRE(out.data<half>()[i].bits == half(static_cast<float>(xv[i])).bits);
        }
        if (dst == kBFloat16 && src.is_floating() && src != kFloat64) {
          for (std::size_t i = 0; i < xv.size(); ++i)
            REQUIRE(out.data<bfloat16>()[i].bits == bfloat16(static_cast<float>(xv[i])).bits);
        }
      }
    }
  }
  SECTION("large float32 <-> 16-bit casts (bulk converters, parallel)") {
    Tensor x = random({100000}, kFloat32, -1000, 1000);
    for (DType dt : {kFloat16, kBFloat16}) {
      Tensor h = empty_poisoned({100000}, dt);
      kernel<kernels::CastFn>(OpId::cast, kFloat32)(x, h);
      Tensor back = empty_poisoned({100000}, kFloat32);
      kernel<kernels::CastFn>(OpId::cast, dt)(h, back);
      const float* xp = x.data<float>();
      const float* bp = back.data<float>();
      bool ok = true;
      for (int64_t i = 0; i < 100000 && ok; ++i) {
        const float r =
            dt == kFloat16 ? static_cast<float>(half(xp[i])) : static_cast<float>(bfloat16(xp[i]));
        ok = bp[i] == r;
      }
      CHECK(ok);
    }
  }
  SECTION("wide sources round to 16 bits once") {
    const double d = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
    Tensor x = from_values({d, -d}, {2}, kFloat64);
    Tensor h = empty_poisoned({2}, kFloat16);
    kernel<kernels::CastFn>(OpId::cast, kFloat64)(x, h);
    CHECK(h.data<half>()[0].bits == 0x3C01);
    CHECK(h.data<half>()[1].bits == 0xBC01);
    // int64 2^40 + 2^32 + 1: just above a bfloat16 midpoint that float32 cannot see.
    Tensor i = Tensor::empty({1}, kInt64);
    i.data<int64_t>()[0] = (int64_t{1} << 40) + (int64_t{1} << 32) + 1;
    Tensor b = empty_poisoned({1}, kBFloat16);
    kernel<kernels::CastFn>(OpId::cast, kInt64)(i, b);
    CHECK(static_cast<double>(static_cast<float>(b.data<bfloat16>()[0])) ==
          std::ldexp(1.0, 40) + std::ldexp(1.0, 33));
  }
}

// --- Unary -------------------------------------------------------------------------------

namespace {

struct UnaryCase {
  OpId op;
  std::function<double(double)> ref;
  double lo, hi;
  // Times the dtype's tolerance: for functions whose float32 evaluation amplifies the
  // rounding of an intermediate (gelu_tanh's tail: the error of u = c (x + 0.044715 x^3)
  // grows by |2u|, up to 6 over [-3, 3]).
  double tol_scale = 1.0;
};

std::vector<UnaryCase> unary_cases() {
  return {
      {OpId::neg, [](double x) { return -x; }, -3, 3},
      {OpId::abs, [](double x) { return std::fabs(x); }, -3, 3},
      {OpId::exp, [](double x) { return std::exp(x); }, -5, 5},
      {OpId::log, [](double x) { return std::log(x); }, 0.05, 4},
      {OpId::sqrt, [](double x) { return std::sqrt(x); }, 0.0, 4},
      {OpId::rsqrt, [](double x) { return 1 / std::sqrt(x); }, 0.05, 4},
      {OpId::tanh, [](double x) { return std::tanh(x); }, -3, 3},
      {OpId::sigmoid, [](double x) { return 1 / (1 + std::exp(-x)); }, -8, 8},
      {OpId::relu, [](double x) { return x < 0 ? 0.0 : x; }, -3, 3},
      {OpId::gelu, [](double x) { return 0.5 * x * std::erfc(-x / std::sqrt(2.0)); }, -3, 3},
      {OpId::gelu_tanh,
       [](double x) {
         return 0.5 * x *
                (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
       },
       -3, 3, 6.0},
      {OpId::erf, [](double x) { return std::erf(x); }, -3, 3},
  };
}

}  // namespace

TEST_CASE("unary ops: every floating dtype", "[cpu_kernels]") {
  for (const UnaryCase& c : unary_cases()) {
    for (DType dt : kFloatTypes) {
      SECTION(std::string(op_name(c.op)) + " " + std::string(dt.name())) {
        for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{70001}}) {
          Tensor x = random({n}, dt, c.lo, c.hi);
          Tensor out = empty_poisoned({n}, dt);
          kernel<kernels::UnaryFn>(c.op, dt)(x, out);
          std::vector<double> expected;
          for (double v : values(x)) expected.push_back(c.ref(v));
          INFO("n = " << n);
          // 16-bit outputs of tiny values are subnormal: compare those absolutely.
          check_close(values(out), expected, c.tol_scale * tolerance(dt),
                      dt.is_reduced_float() ? 1e-2 : 1e-6);
        }
      }
    }
  }
}

TEST_CASE("unary ops: integers, special values", "[cpu_kernels]") {
  SECTION("neg and abs of int32 / int64 wrap at the minimum") {
    for (DType dt : {kInt32, kInt64}) {
      const double lo = dt == kInt32 ? -2147483648.0 : -9007199254740992.0;
      Tensor x = from_values({lo, -5, 0, 7, 123456}, {5}, dt);
      if (dt == kInt64) x.data<int64_t>()[0] = std::numeric_limits<int64_t>::min();
      Tensor neg = empty_poisoned({5}, dt), abs = empty_poisoned({5}, dt);
      kernel<kernels::UnaryFn>(OpId::neg, dt)(x, neg);
      kernel<kernels::UnaryFn>(OpId::abs, dt)(x, abs);
      const std::vector<double> xv = values(x);
      CHECK(values(neg)[0] == xv[0]);  // -INT_MIN wraps to INT_MIN
      CHECK(values(abs)[0] == xv[0]);
      CHECK(values(neg)[1] == 5);
      CHECK(values(abs)[1] == 5);
      CHECK(values(neg)[4] == -123456);
      CHECK(values(abs)[3] == 7);
      CHECK(values(abs)[2] == 0);
    }
  }
  SECTION("sigmoid is stable for large |x|; NaN propagates") {
    for (DType dt : kFloatTypes) {
      Tensor x = from_values({-1000, -100, 100, 1000, 0, kNaN}, {6}, dt);
      Tensor out = empty_poisoned({6}, dt);
      kernel<kernels::UnaryFn>(OpId::sigmoid, dt)(x, out);
      const auto v = values(out);
      INFO(dt.name());
      CHECK(v[0] == 0.0);
      CHECK(v[1] >= 0.0);
      CHECK(v[1] < 1e-40);
      CHECK(v[2] == 1.0);
      CHECK(v[3] == 1.0);
      CHECK(v[4] == 0.5);
      CHECK(std::isnan(v[5]));
    }
  }
  SECTION("float32 exp and tanh (vectorised polynomials) at the edges of their ranges") {
    const double inf = std::numeric_limits<double>::infinity();
    const std::vector<double> xs = {-1000, -103.9, -95,  -87.5, -50,  -1e-8, 0,    1e-8,
                                    0.3,   50,     88.5, 88.75, 1000, inf,   -inf, kNaN};
    Tensor x = from_values(xs, {static_cast<int64_t>(xs.size())}, kFloat32);
    Tensor out = empty_poisoned(x.shape(), kFloat32);
    kernel<kernels::UnaryFn>(OpId::exp, kFloat32)(x, out);
    std::vector<double> e;
    for (double v : values(x)) e.push_back(static_cast<float>(std::exp(v)));  // inf past FLT_MAX
    // Subnormal results carry fewer bits: compare those within 2 of the smallest step.
    const auto ov = values(out);
    for (std::size_t i = 0; i < ov.size(); ++i) {
      INFO("exp(" << xs[i] << ") = " << ov[i] << ", expected " << e[i]);
      if (std::isnan(e[i]))
        CHECK(std::isnan(ov[i]));
      else if (std::isinf(e[i]))
        CHECK(ov[i] == e[i]);
      else
        CHECK(std::fabs(ov[i] - e[i]) <= 1e-6 * std::fabs(e[i]) + 3e-45);
    }

    const std::vector<double> ts = {-0.0, 0.0, 1e-6, -1e-6, 0.6249, 0.6251, -0.6251, 0.9,
                                    -2.5, 9.0, 20,   -20,   inf,    -inf,   kNaN};
    Tensor tx = from_values(ts, {static_cast<int64_t>(ts.size())}, kFloat32);
    Tensor tout = empty_poisoned(tx.shape(), kFloat32);
    kernel<kernels::UnaryFn>(OpId::tanh, kFloat32)(tx, tout);
    std::vector<double> te;
    for (double v : values(tx)) te.push_back(std::tanh(v));
    check_close(values(tout), te, 1e-6, 1e-30);
    CHECK(std::signbit(tout.data<float>()[0]));  // tanh(-0) = -0
  }
  SECTION("gelu keeps its negative tail") {
    Tensor x = from_values({-8, -6, -5}, {3}, kFloat32);
    Tensor out = empty_poisoned({3}, kFloat32);
    kernel<kernels::UnaryFn>(OpId::gelu, kFloat32)(x, out);
    std::vector<double> e;
    for (double v : {-8.0, -6.0, -5.0}) e.push_back(0.5 * v * std::erfc(-v / std::sqrt(2.0)));
    check_close(values(out), e, 1e-5);
  }
}

// --- Binary --------------------------------------------------------------------------------

namespace {

struct BinaryCase {
  OpId op;
  std::function<double(double, double)> ref;
  double alo, ahi, blo, bhi;
  bool ints;
};

std::vector<BinaryCase> binary_cases() {
  return {
      {OpId::add, [](double a, double b) { return a + b; }, -3, 3, -3, 3, true},
      {OpId::sub, [](double a, double b) { return a - b; }, -3, 3, -3, 3, true},
      {OpId::mul, [](double a, double b) { return a * b; }, -3, 3, -3, 3, true},
      {OpId::div, [](double a, double b) { return a / b; }, -3, 3, 0.5, 2, true},
      {OpId::maximum, [](double a, double b) { return std::max(a, b); }, -3, 3, -3, 3, true},
      {OpId::minimum, [](double a, double b) { return std::min(a, b); }, -3, 3, -3, 3, true},
      {OpId::pow, [](double a, double b) { return std::pow(a, b); }, 0.5, 2, -2, 2, false},
  };
}

// Integer reference: truncating division, x / 0 = 0.
double int_ref(OpId op, double a, double b) {
  if (op == OpId::div) return b == 0 ? 0.0 : std::trunc(a / b);
  if (op == OpId::maximum) return std::max(a, b);
  if (op == OpId::minimum) return std::min(a, b);
  if (op == OpId::add) return a + b;
  if (op == OpId::sub) return a - b;
  return a * b;
}

}  // namespace

TEST_CASE("binary arithmetic: broadcast patterns", "[cpu_kernels]") {
  for (const BinaryCase& c : binary_cases()) {
    for (DType dt : kArithTypes) {
      if (!dt.is_floating() && !c.ints) continue;
      for (const Pattern& p : patterns()) {
        SECTION(std::string(op_name(c.op)) + " " + std::string(dt.name()) + " " + p.name) {
          const bool ints = !dt.is_floating();
          View a = make_view(p.a_base, p.out, p.a_strides, dt, ints ? -1000 : c.alo,
                             ints ? 1000 : c.ahi);
          View b =
              make_view(p.b_base, p.out, p.b_strides, dt, ints ? -50 : c.blo, ints ? 50 : c.bhi);
          Tensor out = empty_poisoned(p.out, dt);
          kernel<kernels::BinaryFn>(c.op, dt)(a.view, b.view, out);
          std::vector<double> expected;
          for (std::size_t i = 0; i < a.vals.size(); ++i)
            expected.push_back(ints ? int_ref(c.op, a.vals[i], b.vals[i])
                                    : c.ref(a.vals[i], b.vals[i]));
          check_close(values(out), expected, tolerance(dt), dt.is_reduced_float() ? 1e-2 : 1e-6);
        }
      }
    }
  }
}

TEST_CASE("binary arithmetic: integer and NaN edge cases", "[cpu_kernels]") {
  SECTION("integer division by zero is 0; INT_MIN / -1 wraps") {
    for (DType dt : {kInt32, kInt64}) {
      Tensor a = from_values({7, -7, 7, -7, 5, 0}, {6}, dt);
      Tensor b = from_values({2, 2, -2, 0, 0, 0}, {6}, dt);
      Tensor out = empty_poisoned({6}, dt);
      kernel<kernels::BinaryFn>(OpId::div, dt)(a, b, out);
      CHECK(values(out) == std::vector<double>{3, -3, -3, 0, 0, 0});
    }
    Tensor a = from_values({-2147483648.0}, {1}, kInt32);
    Tensor b = from_values({-1}, {1}, kInt32);
    Tensor out = empty_poisoned({1}, kInt32);
    kernel<kernels::BinaryFn>(OpId::div, kInt32)(a, b, out);
    CHECK(values(out)[0] == -2147483648.0);
  }
  SECTION("maximum / minimum propagate NaN") {
    for (DType dt : kFloatTypes) {
      Tensor a = from_values({kNaN, 1, kNaN, 2}, {4}, dt);
      Tensor b = from_values({1, kNaN, kNaN, 3}, {4}, dt);
      for (OpId op : {OpId::maximum, OpId::minimum}) {
        Tensor out = empty_poisoned({4}, dt);
        kernel<kernels::BinaryFn>(op, dt)(a, b, out);
        const auto v = values(out);
        CHECK(std::isnan(v[0]));
        CHECK(std::isnan(v[1]));
        CHECK(std::isnan(v[2]));
        CHECK(v[3] == (op == OpId::maximum ? 3 : 2));
      }
    }
  }
}

// float16 / bfloat16 relu and relu_backward work on the bits (no float32 round trip): every
// one of the 65536 patterns (NaNs, infinities, signed zeros, subnormals) against the float32
// definition, bit for bit (a signalling NaN comes out quiet, as through float32),
// contiguous and through a strided (transposed) view.
template <typename H>
void check_relu_bits(DType dt) {
  constexpr int64_t kAll = 65536;
  Tensor x = Tensor::empty({256, 256}, dt), g = Tensor::empty({256, 256}, dt);
  std::mt19937 rng(77);
  for (int64_t i = 0; i < kAll; ++i) {
    x.data<H>()[i] = H::from_bits(static_cast<std::uint16_t>(i));
    g.data<H>()[i] = H::from_bits(static_cast<std::uint16_t>(rng()));
  }
  auto relu_ref = [](H v) {
    const float f = v;
    return H(f < 0.0f ? 0.0f : f).bits;
  };
  auto back_ref = [](H y, H gv) {
    return H(static_cast<float>(y) > 0.0f ? static_cast<float>(gv) : 0.0f).bits;
  };
  for (bool strided : {false, true}) {
    INFO((strided ? "strided" : "contiguous"));
    const Tensor xv = strided ? Tensor::view_of(x, Shape{256, 256}, Strides{1, 256}, 0) : x;
    const Tensor gv = strided ? Tensor::view_of(g, Shape{256, 256}, Strides{1, 256}, 0) : g;
    Tensor r = Tensor::empty({256, 256}, dt), b = Tensor::empty({256, 256}, dt);
    if (!strided) kernel<kernels::UnaryFn>(OpId::relu, dt)(xv, r);
    kernel<kernels::BinaryFn>(OpId::relu_backward, dt)(xv, gv, b);
    std::int64_t bad_relu = 0, bad_back = 0;
    for (int64_t i = 0; i < 256; ++i)
      for (int64_t j = 0; j < 256; ++j) {
        const int64_t src = strided ? j * 256 + i : i * 256 + j;  // the view's (i, j)
        const H xs = x.data<H>()[src], gs = g.data<H>()[src];
        if (!strided && r.data<H>()[i * 256 + j].bits != relu_ref(xs)) ++bad_relu;
        if (b.data<H>()[i * 256 + j].bits != back_ref(xs, gs)) ++bad_back;
      }
    CHECK(bad_relu == 0);
    CHECK(bad_back == 0);
  }
}

TEST_CASE("relu and relu_backward on float16 / bfloat16 bits: all 65536 patterns",
          "[cpu_kernels]") {
  check_relu_bits<half>(kFloat16);
  check_relu_bits<bfloat16>(kBFloat16);
}

TEST_CASE("comparisons: every dtype, bool output", "[cpu_kernels]") {
  const std::vector<std::pair<OpId, std::function<bool(double, double)>>> ops = {
      {OpId::equal, [](double a, double b) { return a == b; }},
      {OpId::not_equal, [](double a, double b) { return a != b; }},
      {OpId::less, [](double a, double b) { return a < b; }},
      {OpId::less_equal, [](double a, double b) { return a <= b; }},
      {OpId::greater, [](double a, double b) { return a > b; }},
      {OpId::greater_equal, [](double a, double b) { return a >= b; }},
  };
  for (const auto& [op, ref] : ops) {
    for (DType dt : kAllTypes) {
      for (const Pattern& p : patterns()) {
        SECTION(std::string(op_name(op)) + " " + std::string(dt.name()) + " " + p.name) {
          // Small integers (exact in every dtype), so that equal pairs are common.
          auto small = [&](const Shape& base, const Shape& shape, const Strides& strides) {
            View v;
            std::vector<double> raw(static_cast<std::size_t>(base.numel()));
            std::uniform_int_distribution<int> dist(dt == kBool ? 0 : (dt == kUInt8 ? 0 : -2),
                                                    dt == kBool ? 1 : 2);
            for (double& x : raw) x = dist(rng());
            v.base = from_values(raw, base, dt);
            v.view = Tensor::view_of(v.base, shape, strides, 0);
            v.vals = view_values(v.base, shape, strides, 0);
            return v;
          };
          View a = small(p.a_base, p.out, p.a_strides);
          View b = small(p.b_base, p.out, p.b_strides);
          Tensor out = empty_poisoned(p.out, kBool);
          kernel<kernels::BinaryFn>(op, dt)(a.view, b.view, out);
          const auto* o = static_cast<const std::uint8_t*>(out.data_ptr());
          bool ok = true;
          for (std::size_t i = 0; i < a.vals.size() && ok; ++i)
            ok = o[i] == (ref(a.vals[i], b.vals[i]) ? 1 : 0);
          CHECK(ok);
        }
      }
    }
  }
  SECTION("NaN compares unequal") {
    for (DType dt : kFloatTypes) {
      Tensor a = from_values({kNaN, kNaN, 1}, {3}, dt);
      Tensor b = from_values({kNaN, 1, 1}, {3}, dt);
      for (OpId op : {OpId::equal, OpId::not_equal, OpId::less, OpId::less_equal, OpId::greater,
                      OpId::greater_equal}) {
        Tensor out = empty_poisoned({3}, kBool);
        kernel<kernels::BinaryFn>(op, dt)(a, b, out);
        const auto* o = static_cast<const std::uint8_t*>(out.data_ptr());
        const std::uint8_t nan_result = op == OpId::not_equal ? 1 : 0;
        CHECK(o[0] == nan_result);
        CHECK(o[1] == nan_result);
        CHECK(o[2] ==
              ((op == OpId::equal || op == OpId::less_equal || op == OpId::greater_equal) ? 1 : 0));
      }
    }
  }
}

TEST_CASE("where: every dtype, broadcast operands", "[cpu_kernels]") {
  const Shape out_shape{70, 600};
  for (DType dt : kAllTypes) {
    SECTION(std::string(dt.name())) {
      // cond: [70, 1] broadcast along rows; a: a row [600]; b: a scalar.
      View cond = make_view({70, 1}, out_shape, {1, 0}, kBool, 0, 1);
      View a = make_view({600}, out_shape, {0, 1}, dt, -100, 100);
      View b = make_view({1}, out_shape, {0, 0}, dt, -100, 100);
      // Also a fully contiguous variant.
      Tensor cond2 = random(out_shape, kBool);
      Tensor a2 = random(out_shape, dt, -100, 100), b2 = random(out_shape, dt, -100, 100);
      for (int variant = 0; variant < 2; ++variant) {
        Tensor out = empty_poisoned(out_shape, dt);
        const auto where = kernel<kernels::WhereFn>(OpId::where, dt);
        std::vector<double> cv, av, bv;
        if (variant == 0) {
          where(cond.view, a.view, b.view, out);
          cv = cond.vals, av = a.vals, bv = b.vals;
        } else {
          where(cond2, a2, b2, out);
          cv = values(cond2), av = values(a2), bv = values(b2);
        }
        std::vector<double> expected;
        for (std::size_t i = 0; i < cv.size(); ++i) expected.push_back(cv[i] != 0 ? av[i] : bv[i]);
        check_close(values(out), expected, 0.0);
      }
    }
  }
}

// --- Reductions ----------------------------------------------------------------------------

namespace {

struct Geometry {
  int64_t outer, n, inner;
};

const std::vector<Geometry> kGeometries = {
    {1, 1, 1},     {3, 1, 4},     {1, 7, 1},   {5, 13, 1},  {1, 13, 6},
    {4, 9, 300},   {1, 50000, 1}, {2, 3, 1},   {7, 1, 1},   {1, 4000, 20},
    {1, 1, 40000}, {3, 20000, 1}, {2, 300, 2}, {1, 2, 700}, {100, 40, 17},
};

}  // namespace

TEST_CASE("reductions: sum, mean, max, min, argmax over [outer, n, inner]", "[cpu_kernels]") {
  const std::vector<OpId> ops = {OpId::sum, OpId::mean, OpId::max, OpId::min, OpId::argmax};
  for (OpId op : ops) {
    for (DType dt : kArithTypes) {
      if (op == OpId::mean && !dt.is_floating()) continue;
      SECTION(std::string(op_name(op)) + " " + std::string(dt.name())) {
        for (const Geometry& g : kGeometries) {
          // Integers from a small range, so argmax sees ties.
          Tensor x = dt.is_floating() ? random({g.outer, g.n, g.inner}, dt, -2, 3)
                                      : random({g.outer, g.n, g.inner}, dt, -20, 20);
          const DType odt = op == OpId::argmax ? kInt64 : dt;
          Tensor out = empty_poisoned({g.outer, g.inner}, odt);
          kernel<kernels::ReduceFn>(op, dt)(x, g.outer, g.n, g.inner, out);
          const std::vector<double> xv = values(x);
          std::vector<double> expected, scale;
          for (int64_t o = 0; o < g.outer; ++o) {
            for (int64_t i = 0; i < g.inner; ++i) {
              double s = 0, sa = 0, mx = -INFINITY, mn = INFINITY;
              int64_t am = 0;
              for (int64_t j = 0; j < g.n; ++j) {
                const double v = xv[static_cast<std::size_t>((o * g.n + j) * g.inner + i)];
                s += v;
                sa += std::fabs(v);
                if (v > mx) mx = v, am = j;
                mn = std::min(mn, v);
              }
              double e = s;
              if (op == OpId::mean)
                e = s / static_cast<double>(g.n), sa /= static_cast<double>(g.n);
              if (op == OpId::max) e = mx;
              if (op == OpId::min) e = mn;
              if (op == OpId::argmax) e = static_cast<double>(am);
              expected.push_back(e);
              scale.push_back(sa);
            }
          }
          const std::vector<double> ov = values(out);
          INFO("outer " << g.outer << " n " << g.n << " inner " << g.inner);
          bool ok = true;
          std::size_t bad = 0;
          for (std::size_t q = 0; q < ov.size() && ok; ++q) {
            // The result is rounded once to the dtype; allow the accumulation a little
            // error relative to sum |x| as well.
            const double tol = tolerance(odt);
            ok = std::fabs(ov[q] - expected[q]) <=
                 tol * std::fabs(expected[q]) + tol * 1e-3 * scale[q];
            bad = q;
          }
          INFO("element " << bad << ": got " << ov[bad] << ", expected " << expected[bad]);
          CHECK(ok);
        }
      }
    }
  }
}

TEST_CASE("reductions: NaN, accuracy", "[cpu_kernels]") {
  SECTION("max / min propagate NaN; argmax finds the first NaN") {
    for (DType dt : kFloatTypes) {
      // Row layout (inner == 1) and column layout (inner == 3), NaN at j = 3 and 7.
      for (int64_t inner : {int64_t{1}, int64_t{3}}) {
        const int64_t n = 10;
        std::vector<double> v(static_cast<std::size_t>(n * inner));
        for (int64_t j = 0; j < n; ++j)
          for (int64_t i = 0; i < inner; ++i)
            v[static_cast<std::size_t>(j * inner + i)] = (j == 3 || j == 7) && i == 0 ? kNaN
                                                         : j == 5                     ? 9.0
                                                                                      : 1.0;
        Tensor x = from_values(v, {1, n, inner}, dt);
        Tensor mx = empty_poisoned({1, inner}, dt), mn = empty_poisoned({1, inner}, dt);
        Tensor am = empty_poisoned({1, inner}, kInt64);
        kernel<kernels::ReduceFn>(OpId::max, dt)(x, 1, n, inner, mx);
        kernel<kernels::ReduceFn>(OpId::min, dt)(x, 1, n, inner, mn);
        kernel<kernels::ReduceFn>(OpId::argmax, dt)(x, 1, n, inner, am);
        CHECK(std::isnan(values(mx)[0]));
        CHECK(std::isnan(values(mn)[0]));
        CHECK(values(am)[0] == 3);
        if (inner > 1) {
          CHECK(values(mx)[1] == 9);
          CHECK(values(mn)[1] == 1);
          CHECK(values(am)[1] == 5);
        }
      }
    }
  }
  SECTION("a float32 sum of 1e7 values is accurate to 1e-6") {
    const int64_t n = 10000000;
    Tensor x = Tensor::empty({n}, kFloat32);
    float* p = x.data<float>();
    std::uint64_t s = 88172645463325252ULL;
    double ref = 0;
    for (int64_t i = 0; i < n; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift64
      p[i] = static_cast<float>(static_cast<double>(s >> 40) / 16777216.0);
      ref += p[i];
    }
    for (auto [outer, nn, inner] : {Geometry{1, n, 1}, Geometry{1, n / 10, 10}}) {
      Tensor out = empty_poisoned({outer, inner}, kFloat32);
      kernel<kernels::ReduceFn>(OpId::sum, kFloat32)(x, outer, nn, inner, out);
      double total = 0;
      for (double v : values(out)) total += v;
      CHECK(std::fabs(total - ref) <= 1e-6 * ref);
    }
  }
}

TEST_CASE("softmax and log_softmax", "[cpu_kernels]") {
  const std::vector<std::pair<Shape, double>> cases = {
      {{7, 33}, 3.0}, {{3, 1000}, 1000.0}, {{1, 1}, 5.0}, {{5}, 2.0}, {{200, 300}, 10.0}};
  for (DType dt : kFloatTypes) {
    for (const auto& [shape, range] : cases) {
      SECTION(std::string(dt.name()) + " " + shape.str() + " range " + std::to_string(range)) {
        Tensor x = random(shape, dt, -range, range);
        Tensor sm = empty_poisoned(shape, dt), lsm = empty_poisoned(shape, dt);
        kernel<kernels::RowFn>(OpId::softmax, dt)(x, sm);
        kernel<kernels::RowFn>(OpId::log_softmax, dt)(x, lsm);
        const int64_t cols = shape.back(), rows = x.numel() / cols;
        const std::vector<double> xv = values(x);
        std::vector<double> esm, elsm;
        for (int64_t r = 0; r < rows; ++r) {
          const auto row = xv.begin() + r * cols;
          const double m = *std::max_element(row, row + cols);
          double s = 0;
          for (int64_t c = 0; c < cols; ++c) s += std::exp(row[c] - m);
          for (int64_t c = 0; c < cols; ++c) {
            esm.push_back(std::exp(row[c] - m) / s);
            elsm.push_back((row[c] - m) - std::log(s));  // log(softmax), without underflow
          }
        }
        const std::vector<double> smv = values(sm);
        const double tol = tolerance(dt);
        // Each row sums to 1; probabilities compare absolutely (tiny ones underflow).
        for (int64_t r = 0; r < rows; ++r) {
          double s = 0;
          for (int64_t c = 0; c < cols; ++c) s += smv[static_cast<std::size_t>(r * cols + c)];
          REQUIRE(std::fabs(s - 1) <= 4 * tol);
        }
        check_close(smv, esm, 2 * tol, 1.0 / static_cast<double>(cols));
        // log_softmax vs log(softmax) in double; finite everywhere, even for large inputs.
        const std::vector<double> lv = values(lsm);
        CHECK(std::all_of(lv.begin(), lv.end(), [](double v) { return std::isfinite(v); }));
        check_close(lv, elsm, 2 * tol, 1.0);
      }
    }
  }
}

// --- Index ---------------------------------------------------------------------------------

TEST_CASE("gather and scatter_add", "[cpu_kernels]") {
  const std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> geoms = {
      {3, 5, 4, 6}, {1, 10, 7, 1}, {2, 100, 300, 64}, {4, 1, 3, 2}};
  for (DType dt : kArithTypes) {
    for (auto [outer, n, k, inner] : geoms) {
      SECTION(std::string(dt.name()) + " outer " + std::to_string(outer) + " n " +
              std::to_string(n) + " k " + std::to_string(k) + " inner " + std::to_string(inner)) {
        Tensor x = random({outer, n, inner}, dt, -100, 100);
        Tensor index = Tensor::empty({outer, k, inner}, kInt64);
        std::uniform_int_distribution<int64_t> dist(0, n - 1);
        int64_t* ip = index.data<int64_t>();
        for (int64_t q = 0; q < index.numel(); ++q) ip[q] = dist(rng());

        Tensor g = empty_poisoned({outer, k, inner}, dt);
        kernel<kernels::GatherFn>(OpId::gather, dt)(x, index, outer, n, k, inner, g);
        const std::vector<double> xv = values(x);
        std::vector<double> eg;
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t j = 0; j < k; ++j)
            for (int64_t i = 0; i < inner; ++i)
              eg.push_back(
                  xv[static_cast<std::size_t>((o * n + ip[(o * k + j) * inner + i]) * inner + i)]);
        check_close(values(g), eg, 0.0);

        Tensor src = random({outer, k, inner}, dt, -100, 100);
        Tensor out = random({outer, n, inner}, dt, -100, 100);
        std::vector<double> eo = values(out), scale(eo.size());
        for (std::size_t q = 0; q < eo.size(); ++q) scale[q] = std::fabs(eo[q]);
        const std::vector<double> sv = values(src);
        for (int64_t o = 0; o < outer; ++o)
          for (int64_t j = 0; j < k; ++j)
            for (int64_t i = 0; i < inner; ++i) {
              const int64_t q = (o * k + j) * inner + i;
              const auto t = static_cast<std::size_t>((o * n + ip[q]) * inner + i);
              eo[t] += sv[static_cast<std::size_t>(q)];
              scale[t] += std::fabs(sv[static_cast<std::size_t>(q)]);
            }
        kernel<kernels::ScatterAddFn>(OpId::scatter_add, dt)(src, index, outer, n, k, inner, out);
        const std::vector<double> ov = values(out);
        bool ok = true;
        std::size_t bad = 0;
        for (std::size_t q = 0; q < ov.size() && ok; ++q) {
          // Each addition rounds to the dtype: allow a few roundings of the magnitudes.
          ok = std::fabs(ov[q] - eo[q]) <= 4 * tolerance(dt) * scale[q];
          bad = q;
        }
        INFO("element " << bad << ": got " << ov[bad] << ", expected " << eo[bad]);
        CHECK(ok);
      }
    }
  }
}
