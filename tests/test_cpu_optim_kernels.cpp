// The CPU kernels of whole rows and of training, called straight through the dispatch
// table:
//  - take / index_add against naive loops, exactly (index_add repeats the dtype's rounding
//    of every addition, in the order of j), over geometries with repeated indices, k = 0,
//    inner = 1 and sizes that run threaded;
//  - unscale_check against grad * scale computed in double and rounded once to the dtype,
//    and its non-finite flag for an inf or NaN anywhere in the list;
//  - sgd_update / rmsprop_update / adam_update against references written here in double
//    precision, over consecutive steps that carry the optimizer slots, and against a few
//    values computed by hand.
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "kernel_cases.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

using namespace mixtape;
using std::int64_t;

namespace {

const std::vector<DType> kFloatTypes = {kFloat32, kFloat16, kBFloat16, kFloat64};
const std::vector<DType> kRowTypes = {kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64};

std::mt19937_64& rng() {
  static std::mt19937_64 gen(20240611);
  return gen;
}

template <typename Fn>
Fn* kernel(OpId op, DType dt) {
  return find_kernel<Fn>(op, DeviceType::CPU, dt).raw();
}

std::size_t sz(int64_t i) { return static_cast<std::size_t>(i); }

// Calls f(T{}) with T the element type of dt.
template <typename F>
void with_type(DType dt, F&& f) {
  switch (dt.code()) {
    case DType::Float32:
      f(float{});
      break;
    case DType::Float16:
      f(half{});
      break;
    case DType::BFloat16:
      f(bfloat16{});
      break;
    case DType::Float64:
      f(double{});
      break;
    case DType::Int32:
      f(std::int32_t{});
      break;
    case DType::Int64:
      f(std::int64_t{});
      break;
    default:
      FAIL("no element type for " << dt.name());
  }
}

// Element i of a contiguous tensor, exactly, as a double.
double get(const Tensor& t, int64_t i) {
  const char* p =
      static_cast<const char*>(t.data_ptr()) + i * static_cast<int64_t>(t.dtype().itemsize());
  return detail::read_as_double(p, t.dtype());
}

std::vector<double> values(const Tensor& t) {
  std::vector<double> v(sz(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i) v[sz(i)] = get(t, i);
  return v;
}

// Writes v (exactly representable in t's floating dtype) into element i.
void put(const Tensor& t, int64_t i, double v) {
  with_type(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_same_v<T, half> || std::is_same_v<T, bfloat16>)
      static_cast<T*>(t.data_ptr())[i] = T(static_cast<float>(v));
    else
      static_cast<T*>(t.data_ptr())[i] = static_cast<T>(v);
  });
}

std::vector<std::uint8_t> bytes(const Tensor& t) {
  std::vector<std::uint8_t> b(t.nbytes());
  if (!b.empty()) std::memcpy(b.data(), t.data_ptr(), b.size());
  return b;
}

// Random values, never all zero: uniform reals in [lo, hi) for floating dtypes, uniform
// integers in [lo, hi] otherwise.
Tensor random(const Shape& shape, DType dt, double lo = -1.0, double hi = 1.0) {
  Tensor t;
  if (dt.is_floating()) {
    t = uniform(shape, lo, hi, dt);
  } else {
    t = Tensor::empty(shape, dt);
    std::uniform_int_distribution<int64_t> dist(static_cast<int64_t>(lo), static_cast<int64_t>(hi));
    for (int64_t i = 0; i < t.numel(); ++i)
      detail::write_from_double(
          static_cast<char*>(t.data_ptr()) + i * static_cast<int64_t>(dt.itemsize()), dt,
          static_cast<double>(dist(rng())));
  }
  if (t.numel() > 0) {
    const auto v = values(t);
    REQUIRE(std::any_of(v.begin(), v.end(), [](double x) { return x != 0.0; }));
  }
  return t;
}

// An uninitialised tensor filled with a value no kernel result takes: NaN (0xFF bytes)
// for floating dtypes, the most negative integer for integers.
Tensor empty_poisoned(const Shape& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt);
  if (dt.is_floating()) {
    std::memset(t.data_ptr(), 0xFF, t.nbytes());
  } else {
    with_type(dt, [&](auto tag) {
      using T = decltype(tag);
      std::fill_n(static_cast<T*>(t.data_ptr()), t.numel(), std::numeric_limits<T>::min());
    });
  }
  return t;
}

// --- take / index_add ----------------------------------------------------------------------

// a + b as index_add adds: integers wrapping, floats as they are (16-bit floats are added
// in float32, their sums rounded once).
template <typename T>
T add_in_dtype(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

struct RowGeom {
  int64_t outer, n, k, inner;
};

std::string geom_name(const RowGeom& g) {
  return "outer " + std::to_string(g.outer) + " n " + std::to_string(g.n) + " k " +
         std::to_string(g.k) + " inner " + std::to_string(g.inner);
}

const std::vector<RowGeom> kRowGeoms = {
    {3, 5, 4, 6},         // small
    {2, 4, 9, 3},         // k > n: repeated indices
    {3, 5, 0, 4},         // k = 0
    {0, 3, 2, 5},         // outer = 0
    {4, 7, 10, 1},        // inner = 1
    {1, 1, 5, 8},         // n = 1: every index is 0
    {2, 50, 120, 300},    // threaded, repeated indices
    {1, 1000, 40000, 1},  // threaded, inner = 1, one outer: destination rows split
    {1, 10, 5000, 16},    // threaded, few destination rows, many repeats
    {1, 30, 64, 2000},    // rows longer than a block of columns
    {1, 3, 4, 9000},      // take copies rows in several chunks
    {300, 2, 3, 64},      // many outer slices
};

// k random indices in [0, n).
Tensor random_index(int64_t k, int64_t n) {
  Tensor index = Tensor::empty({k}, kInt64);
  std::uniform_int_distribution<int64_t> dist(0, n - 1);
  auto* ip = static_cast<int64_t*>(index.data_ptr());
  for (int64_t j = 0; j < k; ++j) ip[j] = dist(rng());
  return index;
}

}  // namespace

TEST_CASE("take: whole rows against a naive loop", "[optim_kernels][take]") {
  for (DType dt : kRowTypes) {
    for (const RowGeom& g : kRowGeoms) {
      SECTION(std::string(dt.name()) + " " + geom_name(g)) {
        Tensor x = random({std::max<int64_t>(g.outer, 1), g.n, g.inner}, dt, -1000, 1000);
        Tensor index = random_index(g.k, g.n);
        Tensor out = empty_poisoned({g.outer, g.k, g.inner}, dt);
        kernel<kernels::TakeFn>(OpId::take, dt)(x, index, g.outer, g.n, g.k, g.inner, out);
        const auto item = dt.itemsize();
        const auto* ip = static_cast<const int64_t*>(index.data_ptr());
        const auto* xp = static_cast<const char*>(x.data_ptr());
        const auto* yp = static_cast<const char*>(out.data_ptr());
        const std::size_t row = sz(g.inner) * item;
        bool same = true;
        for (int64_t o = 0; o < g.outer && same; ++o) {
          for (int64_t j = 0; j < g.k && same; ++j) {
            same =
                std::memcmp(yp + sz(o * g.k + j) * row, xp + sz(o * g.n + ip[j]) * row, row) == 0;
            if (!same) {
              INFO("row o " << o << " j " << j << " (index " << ip[j] << ") differs");
              CHECK(false);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("index_add: rows added in order against a naive loop", "[optim_kernels][take]") {
  for (DType dt : kRowTypes) {
    for (const RowGeom& g : kRowGeoms) {
      SECTION(std::string(dt.name()) + " " + geom_name(g)) {
        Tensor src = random({std::max<int64_t>(g.outer, 1), std::max<int64_t>(g.k, 1), g.inner}, dt,
                            -1000, 1000);
        Tensor index = random_index(g.k, g.n);
        Tensor out = random({std::max<int64_t>(g.outer, 1), g.n, g.inner}, dt, -1000, 1000);
        // The reference: the same additions in the same order, in the dtype (16-bit floats:
        // in float32, each sum rounded once at the end).
        std::vector<std::uint8_t> expected = bytes(out);
        const auto* ip = static_cast<const int64_t*>(index.data_ptr());
        with_type(dt, [&](auto tag) {
          using T = decltype(tag);
          using A =
              std::conditional_t<std::is_same_v<T, half> || std::is_same_v<T, bfloat16>, float, T>;
          auto* e = reinterpret_cast<T*>(expected.data());
          const auto* s = static_cast<const T*>(src.data_ptr());
          std::vector<A> acc(static_cast<std::size_t>(out.numel()));
          for (std::size_t q = 0; q < acc.size(); ++q) acc[q] = static_cast<A>(e[q]);
          for (int64_t o = 0; o < g.outer; ++o)
            for (int64_t j = 0; j < g.k; ++j)
              for (int64_t i = 0; i < g.inner; ++i) {
                A& d = acc[static_cast<std::size_t>((o * g.n + ip[j]) * g.inner + i)];
                d = add_in_dtype(d, static_cast<A>(s[(o * g.k + j) * g.inner + i]));
              }
          for (std::size_t q = 0; q < acc.size(); ++q) e[q] = T(acc[q]);
        });
        kernel<kernels::IndexAddFn>(OpId::index_add, dt)(src, index, g.outer, g.n, g.k, g.inner,
                                                         out);
        const std::vector<std::uint8_t> actual = bytes(out);
        const std::size_t item = dt.itemsize();
        std::size_t bad = actual.size();
        for (std::size_t q = 0; q < actual.size() / item && bad == actual.size(); ++q)
          if (std::memcmp(actual.data() + q * item, expected.data() + q * item, item) != 0) bad = q;
        if (bad != actual.size()) {
          Tensor e = Tensor::empty(out.shape(), dt);
          std::memcpy(e.data_ptr(), expected.data(), expected.size());
          INFO("element " << bad << ": got " << get(out, static_cast<int64_t>(bad)) << ", expected "
                          << get(e, static_cast<int64_t>(bad)));
          CHECK(false);
        }
      }
    }
  }
}

TEST_CASE("index_add: repeated indices add up and untouched rows keep their values",
          "[optim_kernels][take]") {
  // out [1, 3, 2]; rows 0 and 2 of src go to row 1, row 1 of src to row 0; row 2 untouched.
  Tensor out = from_vector<double>({1, 2, 3, 4, 5, 6}, {1, 3, 2}, kFloat64);
  Tensor src = from_vector<double>({10, 20, 30, 40, 50, 60}, {1, 3, 2}, kFloat64);
  Tensor index = from_vector<int64_t>({1, 0, 1}, {3}, kInt64);
  kernel<kernels::IndexAddFn>(OpId::index_add, kFloat64)(src, index, 1, 3, 3, 2, out);
  CHECK(values(out) == std::vector<double>{31, 42, 63, 84, 5, 6});
  // take of the same index: rows 1, 0, 1.
  Tensor t = empty_poisoned({1, 3, 2}, kFloat64);
  kernel<kernels::TakeFn>(OpId::take, kFloat64)(out, index, 1, 3, 3, 2, t);
  CHECK(values(t) == std::vector<double>{63, 84, 31, 42, 63, 84});
}

// --- unscale_check -------------------------------------------------------------------------

namespace {

// v rounded once (to nearest, ties to even) to dt, as a double. For the 16-bit types this
// does not rely on the library's converters alone: the 16-bit values around the rounding
// of float(v) are compared to v by their exact distances (the infinity pattern standing
// for the next power of two, so that overflow rounds as IEEE rounding does).
double round_to(double v, DType dt) {
  if (dt == kFloat64) return v;
  if (dt == kFloat32) return static_cast<double>(static_cast<float>(v));
  if (std::isnan(v) || std::isinf(v)) return v;
  const bool is_half = dt == kFloat16;
  const std::uint32_t inf = is_half ? 0x7C00u : 0x7F80u;
  auto value = [&](std::uint32_t b) {
    if (b == inf) return is_half ? 65536.0 : std::ldexp(1.0, 128);
    const auto bits = static_cast<std::uint16_t>(b);
    return static_cast<double>(is_half ? static_cast<float>(half::from_bits(bits))
                                       : static_cast<float>(bfloat16::from_bits(bits)));
  };
  const double m = std::fabs(v);
  const float mf = static_cast<float>(m);
  const std::uint32_t c = is_half ? half(mf).bits : bfloat16(mf).bits;
  std::uint32_t best = c;
  double best_d = std::fabs(value(c) - m);
  for (std::uint32_t b : {c - 1, c + 1}) {
    if ((c == 0 && b == c - 1) || b > inf) continue;
    const double d = std::fabs(value(b) - m);
    if (d < best_d || (d == best_d && b % 2 == 0)) best = b, best_d = d;
  }
  const double r = best == inf ? std::numeric_limits<double>::infinity() : value(best);
  return std::signbit(v) ? -r : r;
}

// Same value, and the same sign for zeros; NaN matches NaN.
bool same_value(double a, double e) {
  if (std::isnan(e)) return std::isnan(a);
  return a == e && std::signbit(a) == std::signbit(e);
}

// The smallest subnormal and the largest finite value of a floating dtype.
double denorm_min(DType dt) {
  if (dt == kFloat16) return std::ldexp(1.0, -24);
  if (dt == kBFloat16) return std::ldexp(1.0, -133);
  if (dt == kFloat32) return std::numeric_limits<float>::denorm_min();
  return std::numeric_limits<double>::denorm_min();
}
double max_finite(DType dt) {
  if (dt == kFloat16) return 65504.0;
  if (dt == kBFloat16) return std::ldexp(255.0, 120);
  if (dt == kFloat32) return std::numeric_limits<float>::max();
  return std::numeric_limits<double>::max();
}

Tensor flag_tensor(float v) { return full(Shape{}, v, kFloat32); }
float flag_value(const Tensor& f) { return *static_cast<const float*>(f.data_ptr()); }

// Gradients of the given sizes: random in [-100, 100); the first tensor of at least 8
// elements starts with special values: +-the smallest subnormal, -0, the largest finite
// value and 1 (which a scale just above a 16-bit midpoint rounds up).
std::vector<Tensor> make_grads(const std::vector<int64_t>& sizes, DType dt) {
  std::vector<Tensor> grads;
  bool specials = false;
  for (int64_t n : sizes) {
    grads.push_back(random({n}, dt, -100, 100));
    if (n >= 8 && !specials) {
      const double vals[] = {denorm_min(dt), -denorm_min(dt), -0.0, max_finite(dt), 1.0};
      for (int64_t i = 0; i < 5; ++i) put(grads.back(), i, vals[i]);
      specials = true;
    }
  }
  return grads;
}

void call_unscale(DType dt, const std::vector<Tensor>& grads, const std::vector<Tensor>& outs,
                  double scale, const Tensor& flag) {
  kernel<kernels::UnscaleCheckFn>(OpId::unscale_check, dt)(grads, outs, scale, Tensor(), flag);
}

// Checks out == round_to(x * scale) element by element (x: the gradient's values before
// the call).
void check_scaled(const std::vector<double>& x, const Tensor& out, double scale) {
  REQUIRE(static_cast<int64_t>(x.size()) == out.numel());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double e = round_to(x[i] * scale, out.dtype());
    const double a = get(out, static_cast<int64_t>(i));
    if (!same_value(a, e)) {
      INFO(out.dtype().name() << " element " << i << ": " << x[i] << " * " << scale << " gave " << a
                              << ", expected " << e);
      CHECK(false);
      return;
    }
  }
}

}  // namespace

TEST_CASE("unscale_check: finite gradients scale exactly and leave the flag clear",
          "[optim_kernels]") {
  // Powers of two (the loss-scale case), float32 values that are not, float64 values that
  // are not float32, a scale above 1, and scales just above a float16 / bfloat16 midpoint
  // for the value 1 (rounding the product to float32 first would make it a tie).
  const std::vector<double> scales = {1.0 / 1024,
                                      static_cast<double>(0.7f),
                                      0.3,
                                      1.0 / 3,
                                      3.0,
                                      1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40),
                                      1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)};
  const std::vector<int64_t> sizes = {1, 7, 1000, 100000, 3};
  for (DType dt : kFloatTypes) {
    for (std::size_t si = 0; si < scales.size(); ++si) {
      const double scale = scales[si];
      SECTION(std::string(dt.name()) + " scale #" + std::to_string(si)) {
        std::vector<Tensor> grads = make_grads(sizes, dt);
        std::vector<std::vector<double>> x;
        for (const Tensor& g : grads) x.push_back(values(g));

        // Separate outputs.
        std::vector<Tensor> outs;
        for (const Tensor& g : grads) outs.push_back(empty_poisoned(g.shape(), dt));
        Tensor flag = flag_tensor(0.0f);
        call_unscale(dt, grads, outs, scale, flag);
        CHECK(flag_value(flag) == 0.0f);
        for (std::size_t i = 0; i < grads.size(); ++i) {
          check_scaled(x[i], outs[i], scale);
          CHECK(values(grads[i]) == x[i]);  // inputs untouched (no NaN among them)
        }

        // Check only: undefined outputs, gradients untouched.
        std::vector<std::vector<std::uint8_t>> before;
        for (const Tensor& g : grads) before.push_back(bytes(g));
        call_unscale(dt, grads, std::vector<Tensor>(grads.size()), scale, flag);
        CHECK(flag_value(flag) == 0.0f);
        for (std::size_t i = 0; i < grads.size(); ++i) CHECK(bytes(grads[i]) == before[i]);

        // The scale read from a float64 tensor (a scale kept on the device): the number
        // passed is not used.
        std::vector<Tensor> from_tensor;
        for (const Tensor& g : grads) from_tensor.push_back(empty_poisoned(g.shape(), dt));
        kernel<kernels::UnscaleCheckFn>(OpId::unscale_check, dt)(
            grads, from_tensor, 5.0, full(Shape{}, scale, kFloat64), flag);
        CHECK(flag_value(flag) == 0.0f);
        for (std::size_t i = 0; i < grads.size(); ++i) check_scaled(x[i], from_tensor[i], scale);

        // In place: outs[i] is grads[i].
        call_unscale(dt, grads, grads, scale, flag);
        CHECK(flag_value(flag) == 0.0f);
        for (std::size_t i = 0; i < grads.size(); ++i) check_scaled(x[i], grads[i], scale);
      }
    }
  }
}

TEST_CASE("unscale_check: a single inf or NaN anywhere sets the flag", "[optim_kernels]") {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<int64_t> sizes = {5, 100000, 3};
  struct Where {
    std::string name;
    std::size_t tensor;
    int64_t element;
  };
  const std::vector<Where> places = {{"first element of the first tensor", 0, 0},
                                     {"last element of the last tensor", 2, 2},
                                     {"middle of the large tensor", 1, 61234},
                                     {"last element of the large tensor", 1, 99999}};
  const double scale = 1.0 / 256;
  for (DType dt : kFloatTypes) {
    for (const Where& w : places) {
      for (double bad : {inf, -inf, nan}) {
        SECTION(std::string(dt.name()) + " " + std::to_string(bad) + " at " + w.name) {
          std::vector<Tensor> grads = make_grads(sizes, dt);
          put(grads[w.tensor], w.element, bad);
          std::vector<std::vector<double>> x;
          for (const Tensor& g : grads) x.push_back(values(g));

          // Mixed outputs: a separate tensor, none (check only), in place.
          std::vector<Tensor> outs = {empty_poisoned(grads[0].shape(), dt), Tensor(), grads[2]};
          const std::vector<std::uint8_t> before1 = bytes(grads[1]);
          Tensor flag = flag_tensor(0.0f);
          call_unscale(dt, grads, outs, scale, flag);
          CHECK(flag_value(flag) == 1.0f);
          check_scaled(x[0], outs[0], scale);  // non-finite values scale to themselves
          CHECK(bytes(grads[1]) == before1);
          check_scaled(x[2], grads[2], scale);

          // Check only, on a fresh flag.
          std::vector<Tensor> fresh = make_grads(sizes, dt);
          put(fresh[w.tensor], w.element, bad);
          Tensor flag2 = flag_tensor(0.0f);
          call_unscale(dt, fresh, {}, scale, flag2);  // an empty list: no outputs at all
          CHECK(flag_value(flag2) == 1.0f);
        }
      }
    }
  }
}

TEST_CASE("unscale_check: the flag is never cleared and an empty list does nothing",
          "[optim_kernels]") {
  for (DType dt : kFloatTypes) {
    std::vector<Tensor> grads = make_grads({10, 40000}, dt);
    Tensor flag = flag_tensor(1.0f);
    call_unscale(dt, grads, std::vector<Tensor>(2), 0.5, flag);
    CHECK(flag_value(flag) == 1.0f);
    Tensor flag0 = flag_tensor(0.0f);
    call_unscale(dt, {}, {}, 0.5, flag0);
    CHECK(flag_value(flag0) == 0.0f);
    // Accumulates over calls: a non-finite call, then a finite one.
    put(grads[1], 123, std::numeric_limits<double>::infinity());
    call_unscale(dt, {grads[1]}, {Tensor()}, 0.5, flag0);
    CHECK(flag_value(flag0) == 1.0f);
    call_unscale(dt, {grads[0]}, {Tensor()}, 0.5, flag0);
    CHECK(flag_value(flag0) == 1.0f);
  }
}

// --- loss_scale_update ---------------------------------------------------------------------

TEST_CASE("loss_scale_update: a dynamic scale on the device moves by the step's flag",
          "[optim_kernels]") {
  // A multiplier of 4, a floor of 2, a ceiling of 2^10 and growth every 2 good steps, from
  // 64: each row is the flag of a step and the scale and count after it, worked out by hand.
  const kernels::LossScaleRule rule{.dynamic = true,
                                    .multiplier = 4.0,
                                    .min_scale = 2.0,
                                    .max_scale = 1024.0,
                                    .growth_interval = 2};
  struct Row {
    float flag;
    double scale, good;
  };
  const std::vector<Row> rows = {
      {0.0f, 64.0, 1.0},   {0.0f, 256.0, 0.0},  {0.0f, 256.0, 1.0}, {0.0f, 1024.0, 0.0},
      {0.0f, 1024.0, 1.0}, {0.0f, 1024.0, 0.0},  // the ceiling holds it
      {1.0f, 256.0, 0.0},  {0.0f, 256.0, 1.0},  {1.0f, 64.0, 0.0},  {1.0f, 16.0, 0.0},
      {1.0f, 4.0, 0.0},    {1.0f, 2.0, 0.0},    {1.0f, 2.0, 0.0},  // the floor holds it
      {0.0f, 2.0, 1.0}};
  Tensor scale = full(Shape{}, 64.0, kFloat64), inverse = full(Shape{}, 0.5, kFloat64),
         good = full(Shape{}, 0.0, kFloat64);
  auto* fn = kernel<kernels::LossScaleUpdateFn>(OpId::loss_scale_update, kFloat64);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    INFO("step " << i);
    fn(flag_tensor(rows[i].flag), scale, inverse, good, rule);
    CHECK(scale.item<double>() == rows[i].scale);
    CHECK(good.item<double>() == rows[i].good);
    CHECK(inverse.item<double>() == 1.0 / rows[i].scale);
  }
  // A fixed scale never moves; a non-finite step restarts the count.
  const kernels::LossScaleRule fixed{.dynamic = false, .max_scale = 1024.0};
  Tensor fixed_scale = full(Shape{}, 1000.0, kFloat64), fixed_good = full(Shape{}, 3.0, kFloat64);
  fn(flag_tensor(0.0f), fixed_scale, inverse, fixed_good, fixed);
  CHECK(fixed_scale.item<double>() == 1000.0);
  CHECK(fixed_good.item<double>() == 3.0);
  fn(flag_tensor(1.0f), fixed_scale, inverse, fixed_good, fixed);
  CHECK(fixed_scale.item<double>() == 1000.0);
  CHECK(fixed_good.item<double>() == 0.0);
  CHECK(inverse.item<double>() == 1.0 / 1000.0);
  // float64 alone.
  CHECK_FALSE(supports(OpId::loss_scale_update, DeviceType::CPU, kFloat32));
}

// --- Optimizer updates ---------------------------------------------------------------------

namespace {

using mtest::op_of;
using mtest::Opt;
using mtest::uses_slot;
using mtest::Variant;
using mtest::variants;

// An optimizer state written out: in double (reference_step) or float (float32_step).
template <typename T>
struct StateOf {
  std::vector<T> var, s1, s2, s3;
};
using State = StateOf<double>;
using State32 = StateOf<float>;

// Adam's alpha = lr sqrt(1 - beta2^step) / (1 - beta1^step), in double (as the kernels compute it).
double adam_alpha(const kernels::OptimizerUpdate& p, int64_t step) {
  return p.lr * std::sqrt(1.0 - std::pow(p.beta2, static_cast<double>(step))) /
         (1.0 - std::pow(p.beta1, static_cast<double>(step)));
}

// One step of the variant in double precision, straight from the formulas of Keras'
// SGD, RMSprop and Adam / AdamW as kernels.h states them.
void reference_step(const Variant& v, const std::vector<double>& g, int64_t step, State& st) {
  const kernels::OptimizerUpdate& p = v.p;
  const double alpha = adam_alpha(p, step);
  for (std::size_t i = 0; i < g.size(); ++i) {
    double& x = st.var[i];
    switch (v.opt) {
      case Opt::kSgd:
        if (p.momentum == 0.0) {
          x -= p.lr * g[i];
        } else {
          double& vel = st.s1[i];
          vel = p.momentum * vel - p.lr * g[i];
          x += p.nesterov ? p.momentum * vel - p.lr * g[i] : vel;
        }
        break;
      case Opt::kRmsprop: {
        const double rho = p.beta2;
        double& ms = st.s1[i];
        ms = rho * ms + (1.0 - rho) * g[i] * g[i];
        double d = ms;
        if (p.centered) {
          double& mg = st.s3[i];
          mg = rho * mg + (1.0 - rho) * g[i];
          d = ms - mg * mg;
        }
        const double inc = p.lr * g[i] / std::sqrt(d + p.epsilon);
        if (p.momentum > 0.0) {
          double& mom = st.s2[i];
          mom = p.momentum * mom + inc;
          x -= mom;
        } else {
          x -= inc;
        }
        break;
      }
      case Opt::kAdam: {
        x -= p.lr * p.weight_decay * x;
        double& m = st.s1[i];
        double& vv = st.s2[i];
        m += (g[i] - m) * (1.0 - p.beta1);
        vv += (g[i] * g[i] - vv) * (1.0 - p.beta2);
        double d = vv;
        if (p.amsgrad) {
          st.s3[i] = std::max(st.s3[i], vv);
          d = st.s3[i];
        }
        x -= alpha * m / (std::sqrt(d) + p.epsilon);
        break;
      }
    }
  }
}

// The CPU kernels' float32 arithmetic, written out: the formulas of reference_step in the
// order in which backends/cpu/optim.cpp evaluates them, each operation rounded to float32 and
// no fused multiply-add (so that the result does not depend on the CPU). A float16 / bfloat16
// variable is updated through it (its values widened, the result rounded once), so the
// kernels must match it bit for bit; reference_step checks its formulas.
void float32_step(const Variant& v, const std::vector<double>& g64, int64_t step, State32& st) {
  const kernels::OptimizerUpdate& p = v.p;
  const auto lr = static_cast<float>(p.lr), momentum = static_cast<float>(p.momentum);
  const auto rho = static_cast<float>(p.beta2), one_minus_rho = static_cast<float>(1.0 - p.beta2);
  const auto eps = static_cast<float>(p.epsilon), alpha = static_cast<float>(adam_alpha(p, step));
  const auto omb1 = static_cast<float>(1.0 - p.beta1), omb2 = static_cast<float>(1.0 - p.beta2);
  const auto lr_wd = static_cast<float>(p.lr * p.weight_decay);
  for (std::size_t i = 0; i < g64.size(); ++i) {
    float& x = st.var[i];
    const auto g = static_cast<float>(g64[i]);
    switch (v.opt) {
      case Opt::kSgd:
        if (p.momentum == 0.0) {
          x -= lr * g;
        } else {
          const float nv = momentum * st.s1[i] - lr * g;
          st.s1[i] = nv;
          x += p.nesterov ? momentum * nv - lr * g : nv;
        }
        break;
      case Opt::kRmsprop: {
        const float ms = rho * st.s1[i] + one_minus_rho * (g * g);
        st.s1[i] = ms;
        float d = ms;
        if (p.centered) {
          const float mg = rho * st.s3[i] + one_minus_rho * g;
          st.s3[i] = mg;
          d = std::max(ms - mg * mg, 0.0f);
        }
        const float inc = lr * g / std::sqrt(d + eps);
        if (p.momentum > 0.0) {
          st.s2[i] = momentum * st.s2[i] + inc;
          x -= st.s2[i];
        } else {
          x -= inc;
        }
        break;
      }
      case Opt::kAdam: {
        if (p.weight_decay != 0.0) x -= lr_wd * x;
        const float m = st.s1[i] + (g - st.s1[i]) * omb1;
        st.s1[i] = m;
        const float vv = st.s2[i] + (g * g - st.s2[i]) * omb2;
        st.s2[i] = vv;
        float d = vv;
        if (p.amsgrad) {
          st.s3[i] = std::max(st.s3[i], vv);
          d = st.s3[i];
        }
        x = x - alpha * m / (std::sqrt(d) + eps);
        break;
      }
    }
  }
}

// The largest |e| of a vector.
double max_abs(const std::vector<double>& v) {
  double m = 0.0;
  for (double e : v) m = std::max(m, std::fabs(e));
  return m;
}

// Checks actual against expected within tol relative to max(|e|, the largest |e| of the
// tensor, floor): the absolute error allowed scales with the quantity's magnitude, so that
// values that cancel to near zero (a momentum term against a new step of the other sign)
// are not held to a relative bound. floor: the magnitude the quantity reached over a large
// random tensor, for tensors too small to show it.
void check_close(const std::vector<double>& actual, const std::vector<double>& expected, double tol,
                 double floor, const std::string& what) {
  REQUIRE(actual.size() == expected.size());
  const double scale = std::max(max_abs(expected), floor);
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double e = expected[i], a = actual[i];
    if (!(std::fabs(a - e) <= tol * std::max(std::fabs(e), scale))) {
      INFO(what << " element " << i << ": got " << a << ", expected " << e << " (tolerance " << tol
                << " x " << std::max(std::fabs(e), scale) << ")");
      CHECK(false);
      return;
    }
  }
}

// The bits of v rounded to dt (float32, float16 or bfloat16).
std::uint32_t bits_in(float v, DType dt) {
  if (dt == kFloat16) return half(v).bits;
  if (dt == kBFloat16) return bfloat16(v).bits;
  std::uint32_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

// What a run saw: the variable and slot elements compared bit for bit against float32_step
// (float32 and 16-bit variables), how many matched, and the largest magnitude of the
// variable and of each slot over its steps.
struct RunResult {
  int64_t total = 0, exact = 0;
  std::array<double, 4> magnitude{};  // variable, slot1, slot2, slot3
};

// Runs `steps` consecutive steps (step = 1, 2, ...) of the variant on a variable of
// `numel` random elements of dtype dt, with zero-initialised slots and a new random
// gradient per step, comparing the variable and the slots to the double reference after
// every step (float32 tolerance; a 16-bit variable's double result is compared before it is
// rounded to 16 bits, as the kernel computes it in float32). Float32 and 16-bit variables and
// their float32 slots are also compared bit for bit against float32_step, which starts each
// step from the kernel's variable. floors: magnitudes of the variable and the slots from an
// earlier, larger run (see check_close).
RunResult run_updates(const Variant& v, DType dt, int64_t numel,
                      const std::array<double, 4>& floors, int steps = 3) {
  const bool reduced = dt == kFloat16 || dt == kBFloat16;
  const bool float32_math = dt != kFloat64;
  const DType slot_dt = dt == kFloat64 ? kFloat64 : kFloat32;
  const double tol = dt == kFloat64 ? 1e-12 : 1e-6;
  Tensor var = random({numel}, dt);
  Tensor slots[3];
  for (int s = 1; s <= 3; ++s)
    if (uses_slot(v, s)) slots[s - 1] = zeros({numel}, slot_dt);
  State st{values(var), std::vector<double>(sz(numel), 0.0), std::vector<double>(sz(numel), 0.0),
           std::vector<double>(sz(numel), 0.0)};
  State32 st32{{},
               std::vector<float>(sz(numel), 0.0f),
               std::vector<float>(sz(numel), 0.0f),
               std::vector<float>(sz(numel), 0.0f)};
  RunResult r;
  for (int64_t step = 1; step <= steps; ++step) {
    INFO(v.name << " " << dt.name() << " numel " << numel << " step " << step);
    Tensor grad = random({numel}, dt);
    const std::vector<double> before = values(var);
    if (reduced) st.var = before;
    reference_step(v, values(grad), step, st);
    if (float32_math) {
      st32.var.assign(before.begin(), before.end());  // exact: the values are float32's or narrower
      float32_step(v, values(grad), step, st32);
    }

    kernels::OptimizerUpdate u = v.p;
    u.var = var;
    u.grad = grad;
    u.slot1 = slots[0];
    u.slot2 = slots[1];
    u.slot3 = slots[2];
    u.step = step;
    kernel<kernels::OptimizerUpdateFn>(op_of(v.opt), dt)(std::span(&u, 1));

    const std::vector<double> got = values(var);
    if (float32_math) {
      // The first element that differs: what (variable / slotN), the kernel's value and
      // float32_step's.
      const std::vector<float>* mirror_slots[3] = {&st32.s1, &st32.s2, &st32.s3};
      std::string what;
      double kernel_value = 0.0, mirror_value = 0.0;
      int64_t first_bad = -1;
      for (std::size_t i = 0; i < got.size(); ++i) {
        bool same = bits_in(static_cast<float>(got[i]), dt) == bits_in(st32.var[i], dt);
        if (!same && first_bad < 0) {
          what = "variable";
          kernel_value = got[i];
          mirror_value = st32.var[i];
        }
        for (std::size_t s = 0; s < 3; ++s) {
          if (!slots[s].defined()) continue;
          const auto k = static_cast<float>(get(slots[s], static_cast<int64_t>(i)));
          const float m = (*mirror_slots[s])[i];
          const bool slot_same = bits_in(k, kFloat32) == bits_in(m, kFloat32);
          if (!slot_same && same && first_bad < 0) {
            what = "slot" + std::to_string(s + 1);
            kernel_value = k;
            mirror_value = m;
          }
          same = same && slot_same;
        }
        ++r.total;
        r.exact += same;
        if (!same && first_bad < 0) first_bad = static_cast<int64_t>(i);
      }
      INFO(what << " element " << first_bad << ": kernel " << kernel_value
                << ", float32 arithmetic " << mirror_value);
      CHECK(first_bad < 0);
    }
    if (reduced) {
      const std::vector<double> unrounded(st32.var.begin(), st32.var.end());
      check_close(unrounded, st.var, tol, floors[0], "variable before rounding");
    } else {
      check_close(got, st.var, tol, floors[0], "variable");
    }
    r.magnitude[0] = std::max(r.magnitude[0], max_abs(st.var));
    const std::vector<double>* ref_slots[3] = {&st.s1, &st.s2, &st.s3};
    for (std::size_t s = 0; s < 3; ++s) {
      if (!slots[s].defined()) continue;
      check_close(values(slots[s]), *ref_slots[s], tol, floors[s + 1],
                  "slot" + std::to_string(s + 1));
      r.magnitude[s + 1] = std::max(r.magnitude[s + 1], max_abs(*ref_slots[s]));
    }
  }
  if (v.p.amsgrad && numel >= 100) {
    // The maximum must have mattered somewhere (v fell below an earlier v).
    int64_t differs = 0;
    for (std::size_t i = 0; i < st.s2.size(); ++i) differs += st.s3[i] > st.s2[i];
    CHECK(differs > 0);
  }
  return r;
}

}  // namespace

TEST_CASE("optimizer updates: three steps against a double reference", "[optim_kernels]") {
  // 100k elements (threaded), several blocks, a partial block and 1 element; the largest
  // run first, as it sets the magnitudes the smaller ones are compared at.
  const std::vector<int64_t> sizes = {100000, 2500, 37, 1};
  for (const Variant& v : variants()) {
    for (DType dt : kFloatTypes) {
      SECTION(v.name + " " + std::string(dt.name())) {
        RunResult total;
        for (int64_t numel : sizes) {
          const RunResult u = run_updates(v, dt, numel, total.magnitude);
          for (std::size_t q = 0; q < 4; ++q)
            total.magnitude[q] = std::max(total.magnitude[q], u.magnitude[q]);
          total.total += u.total;
          total.exact += u.exact;
        }
        // The CPU kernels' float32 arithmetic (backends/cpu/optim.cpp): every element, bit for bit.
        INFO(total.exact << " of " << total.total << " elements match the float32 arithmetic");
        CHECK(total.exact == total.total);
      }
    }
  }
}

TEST_CASE("optimizer updates: values computed by hand", "[optim_kernels]") {
  // One element per case (a second, negated copy checks the sign), constant gradient.
  for (DType dt : {kFloat64, kFloat32}) {
    const double tol = dt == kFloat64 ? 1e-12 : 1e-6;
    auto run = [&](OpId op, kernels::OptimizerUpdate p, double g, int nslots,
                   const std::vector<double>& expected_var) {
      Tensor var = from_vector<double>({1.0, -1.0}, {2}, dt);
      Tensor grad = from_vector<double>({g, -g}, {2}, dt);
      Tensor slots[3];
      for (int s = 0; s < nslots; ++s) slots[s] = zeros({2}, dt);
      for (std::size_t step = 1; step <= expected_var.size(); ++step) {
        kernels::OptimizerUpdate u = p;
        u.var = var;
        u.grad = grad;
        u.slot1 = slots[0];
        u.slot2 = slots[1];
        u.slot3 = slots[2];
        u.step = static_cast<int64_t>(step);
        kernel<kernels::OptimizerUpdateFn>(op, dt)(std::span(&u, 1));
        const double e = expected_var[step - 1];
        INFO(op_name(op) << " " << dt.name() << " step " << step);
        CHECK(std::fabs(get(var, 0) - e) <= tol * std::fabs(e));
        CHECK(std::fabs(get(var, 1) + e) <= tol * std::fabs(e));
      }
    };
    kernels::OptimizerUpdate p;
    // SGD: var -= 0.1 * 0.5 each step.
    p.lr = 0.1;
    run(OpId::sgd_update, p, 0.5, 0, {0.95, 0.9, 0.85});
    // Momentum 0.9: v = -0.05, -0.095, -0.1355; var 0.95, 0.855, 0.7195.
    p.momentum = 0.9;
    run(OpId::sgd_update, p, 0.5, 1, {0.95, 0.855, 0.7195});
    // Nesterov: var += 0.9 v - 0.05: 0.905, 0.7695, 0.59755.
    p.nesterov = true;
    run(OpId::sgd_update, p, 0.5, 1, {0.905, 0.7695, 0.59755});
    // RMSprop, g = 2, rho 0.9, lr 0.01, eps 0: ms = 0.4, var = 1 - 0.02 / sqrt(0.4).
    p = {};
    p.lr = 0.01;
    p.beta2 = 0.9;
    run(OpId::rmsprop_update, p, 2.0, 1, {1.0 - 0.01 * std::sqrt(10.0)});
    // Centered: mg = 0.2, d = 0.4 - 0.04 = 0.36, var = 1 - 0.02 / 0.6.
    p.centered = true;
    run(OpId::rmsprop_update, p, 2.0, 3, {1.0 - 0.02 / 0.6});
    // Adam with eps 0 and a constant gradient moves by exactly lr per step (the bias
    // corrections cancel): 0.9, 0.8, 0.7.
    p = {};
    p.lr = 0.1;
    p.beta1 = 0.9;
    p.beta2 = 0.999;
    run(OpId::adam_update, p, 0.5, 2, {0.9, 0.8, 0.7});
    p.amsgrad = true;  // v only grows here: the same
    run(OpId::adam_update, p, 0.5, 3, {0.9, 0.8, 0.7});
    // AdamW, weight decay 0.5: var = var * (1 - 0.05) - 0.1 each step.
    p.amsgrad = false;
    p.weight_decay = 0.5;
    run(OpId::adam_update, p, 0.5, 2, {0.85, 0.7075, 0.572125});
  }
}
