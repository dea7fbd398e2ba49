// The CUDA memory and elementwise kernels against the CPU backend:
//  - copy / fill / cast: bit for bit (NaN matches any NaN), every dtype and every dtype
//    pair, strided and broadcast views (more than 8 dimensions too), unaligned and odd
//    sizes, special values;
//  - unary, binary, comparisons, where: every registered dtype, through the public ops and
//    through the kernels directly (poisoned outputs, unaligned views, relu_backward);
//    broadcast and non-contiguous views, empty tensors, special values (NaN, inf, -0,
//    subnormals), integer wrap-around and division edge cases; floating math within the
//    per-dtype tolerances, exact ops bit for bit;
//  - large tensors (> 2^20 elements, and more elements than one grid has threads, so that
//    the grid-stride loops wrap);
//  - gradients of a small composite through a GradientTape, GPU against CPU.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "mixtape/core/kernels.h"

namespace {

namespace mt = mixtape;
namespace cu = ctest_util;
using mt::DType;
using mt::OpId;
using mt::Shape;
using mt::Tensor;
using std::int64_t;

const std::vector<DType> kAllTypes = {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64,
                                      mt::kInt32,   mt::kInt64,   mt::kUInt8,    mt::kBool};

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// More elements than the largest grid of blocks_for (65535 * 8 blocks of 256 threads) has
// threads, so every grid-stride loop over them runs twice.
constexpr int64_t kWrapSide = 11600;  // 11600^2 = 134,560,000 > 134,215,680

template <typename Fn>
Fn* gpu_kernel(OpId op, DType dt) {
  return mt::find_kernel<Fn>(op, mt::DeviceType::CUDA, dt).raw();
}
template <typename Fn>
Fn* cpu_kernel(OpId op, DType dt) {
  return mt::find_kernel<Fn>(op, mt::DeviceType::CPU, dt).raw();
}

Tensor gpu(const Tensor& t) { return t.to(cu::kGpu); }

// Element i of host bytes as a double.
using cu::check_bits;

// Random values of any dtype (never all zero): floats in [lo, hi), integers in [-1000, 1000),
// uint8 in [0, 256), bool 50/50. A draw whose first elements are all zero (a one-element bool
// tensor, say) is redrawn with another seed.
Tensor random_of(const Shape& shape, DType dt, std::uint64_t seed, double lo = -1.0,
                 double hi = 1.0) {
  if (dt == mt::kUInt8) {
    lo = 0.0, hi = 256.0;
  } else if (dt == mt::kBool) {
    lo = -1.0, hi = 1.0;  // floor gives -1 (true) or 0 (false)
  } else if (dt.is_integral()) {
    lo = -1000.0, hi = 1000.0;
  }
  for (std::uint64_t attempt = 0;; ++attempt) {
    mt::Generator gen(seed * 1000003 + attempt);
    Tensor t = mt::uniform(shape, lo, hi, dt, mt::Device::cpu(), &gen);
    if (t.numel() == 0) return t;
    const Tensor head = t.reshape({t.numel()}).slice(0, 0, std::min<int64_t>(t.numel(), 64));
    const auto v = head.to_vector<double>();
    if (std::any_of(v.begin(), v.end(), [](double x) { return x != 0.0; })) return t;
    REQUIRE(attempt < 50);
  }
}

// A CPU tensor of `values` (float64) converted to dt by the CPU backend.
Tensor values_of(const std::vector<double>& values, DType dt) {
  return mt::from_vector(values, Shape{static_cast<int64_t>(values.size())}, dt);
}

// Special floating values: zeros of both signs, infinities, NaN, float32 and float64
// subnormals, float16 limits (65504 and the halfway 65520), rounding ties, large values.
std::vector<double> special_values() {
  return {0.0,
          -0.0,
          1.0,
          -1.0,
          0.5,
          -2.5,
          3.75,
          kInf,
          -kInf,
          kNaN,
          1e-40,
          -1e-40,
          1e-310,
          65504.0,
          65520.0,
          1e5,
          -3e38,
          1e-8,
          6e-8,
          -6e-8,
          1.0 + std::ldexp(1.0, -11),
          1.0 + std::ldexp(1.0, -11) + 1e-12,
          100.25,
          -7.0,
          2.0,
          0.1,
          -0.3,
          1e300,
          -1e-300};
}

// A view of `base` (same device) with the given geometry.
Tensor view(const Tensor& base, const Shape& shape, const mt::Strides& strides, int64_t offset) {
  return Tensor::view_of(base, shape, strides, offset);
}

}  // namespace

// --- copy ------------------------------------------------------------------------------------

TEST_CASE("cuda copy: strided views of every dtype", "[cuda]") {
  struct Case {
    std::string name;
    Shape base, shape;
    mt::Strides strides;
    int64_t offset;
  };
  // Ten size-2 dimensions with reversed strides: nothing merges, so the copy needs more
  // than 8 dimensions (the host splits it into slices).
  mt::Strides rev10;
  for (int d = 0; d < 10; ++d) rev10.push_back(int64_t{1} << d);
  const std::vector<Case> cases = {
      {"contiguous with offset", {4, 5, 6}, {3, 5, 6}, {30, 6, 1}, 30},
      {"permuted (2, 0, 1)", {4, 5, 6}, {6, 4, 5}, {1, 30, 6}, 0},
      {"transposed last two", {4, 5, 6}, {4, 6, 5}, {30, 1, 6}, 0},
      {"sliced [:, 1:4, ::2]", {4, 5, 6}, {4, 3, 3}, {30, 6, 2}, 6},
      {"expanded [5] -> [3, 4, 5]", {5}, {3, 4, 5}, {0, 0, 1}, 0},
      {"expanded [4, 1] -> [4, 7]", {4, 1}, {4, 7}, {1, 0}, 0},
      {"single element", {4}, {}, {}, 2},
      {"size-1 dims with odd strides", {6}, {1, 3, 1, 2}, {99, 2, 7, 1}, 0},
      {"empty", {4, 5}, {0, 5}, {5, 1}, 0},
      {"large transpose", {300, 200}, {200, 300}, {1, 200}, 0},
      {"large strided", {300, 400}, {300, 200}, {400, 2}, 1},
      {"rank 10, reversed strides", {1024}, Shape{2, 2, 2, 2, 2, 2, 2, 2, 2, 2}, rev10, 0},
      {"rank 9 broadcast and strided",
       {64},
       Shape{2, 3, 2, 1, 2, 2, 3, 2, 2},
       {32, 0, 1, 5, 16, 2, 0, 8, 4},
       0},
      {"> 2^20 elements, permuted", {64, 128, 160}, {160, 64, 128}, {1, 20480, 160}, 0},
  };
  std::uint64_t seed = 100;
  for (DType dt : kAllTypes) {
    for (const Case& c : cases) {
      INFO(fmt::format("{} {}", dt.name(), c.name));
      Tensor base = random_of(c.base, dt, ++seed);
      Tensor base_gpu = gpu(base);
      Tensor src = view(base, c.shape, c.strides, c.offset);
      Tensor src_gpu = view(base_gpu, c.shape, c.strides, c.offset);
      // The kernel directly, into a poisoned output.
      Tensor want = Tensor::empty(c.shape, dt);
      if (want.numel() > 0) cpu_kernel<mt::kernels::CopyFn>(OpId::copy, dt)(src, want);
      Tensor got = cu::poisoned(c.shape, dt);
      gpu_kernel<mt::kernels::CopyFn>(OpId::copy, dt)(src_gpu, got);
      check_bits(got, want, "copy kernel");
      // The public op.
      check_bits(mt::contiguous(src_gpu), want, "contiguous()");
    }
  }
}

TEST_CASE("cuda copy: devices and round trips keep the bits", "[cuda]") {
  for (DType dt : kAllTypes) {
    INFO(dt.name());
    Tensor x = random_of({1000, 37}, dt, 7);
    Tensor back = gpu(x).to(mt::Device::cpu());
    check_bits(back, x, "host -> device -> host");
    Tensor twice = gpu(gpu(x).transpose().contiguous().transpose().contiguous());
    check_bits(twice, x, "transposed copies on the device");
  }
}

// --- fill ------------------------------------------------------------------------------------

TEST_CASE("cuda fill: every dtype, converted as the CPU converts", "[cuda]") {
  const std::vector<double> values = {
      3.7,          -2.5,
      0.0,          -0.0,
      1e10,         0.1,
      kNaN,         kInf,
      -kInf,        1e-45,
      65520.0,      65519.0,
      300.7,        -1.5,
      9.3e18,       -1e30,
      0.5,          255.5,
      256.0,        -1.0,
      1e-310,       1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40),
      2147483647.5, -2147483648.7,
      3.0e9};
  for (DType dt : kAllTypes) {
    for (double v : values) {
      INFO(fmt::format("{} fill {}", dt.name(), v));
      // Odd size: vector stores plus a scalar tail (or the memset path).
      Tensor want = mt::full({1000003}, v, dt);
      check_bits(mt::full({1000003}, v, dt, cu::kGpu), want, "full()");
      // The kernel on an unaligned contiguous view (offset 1 element): the scalar path, and
      // the element before the view stays untouched.
      Tensor base = cu::poisoned({1001}, dt);
      Tensor out = view(base, {1000}, {1}, 1);
      gpu_kernel<mt::kernels::FillFn>(OpId::fill, dt)(out, v);
      check_bits(out, mt::full({1000}, v, dt), "fill kernel, unaligned view");
      check_bits(view(base, {1}, {1}, 0), cu::poisoned({1}, dt), "element before the view");
    }
  }
}

// --- cast ------------------------------------------------------------------------------------

TEST_CASE("cuda cast: every pair of dtypes, bit for bit", "[cuda]") {
  // Sources: random values, special floats (through the CPU's conversion to the source
  // dtype), and integer extremes (int64 values a double cannot hold exactly).
  std::vector<double> doubles = special_values();
  for (double v : {2147483647.0,
                   -2147483648.0,
                   2147483648.0,
                   -2147483649.0,
                   9.3e18,
                   -9.3e18,
                   9223372036854775807.0,
                   -9223372036854775808.0,
                   1e20,
                   -1e20,
                   255.9,
                   256.0,
                   -0.7,
                   0.7,
                   1.5,
                   2.5,
                   -1.5,
                   65519.0,
                   16777217.0,
                   3.4e38,
                   3.5e38})
    doubles.push_back(v);
  const std::vector<std::int64_t> ints = {0,
                                          1,
                                          -1,
                                          255,
                                          256,
                                          -129,
                                          2147483647,
                                          -2147483647 - 1,
                                          2147483648LL,
                                          (int64_t{1} << 53) + 1,
                                          (int64_t{1} << 62) + 12345,
                                          std::numeric_limits<int64_t>::max(),
                                          std::numeric_limits<int64_t>::min(),
                                          16777217,
                                          -16777219,
                                          2049,
                                          4097,
                                          65535,
                                          65536 + 33,
                                          (int64_t{1} << 40) + (int64_t{1} << 16) + 1};
  std::uint64_t seed = 500;
  for (DType src_dt : kAllTypes) {
    std::vector<Tensor> sources = {
        random_of({2049}, src_dt, ++seed, -300.0, 300.0), values_of(doubles, src_dt),
        mt::from_vector(ints, Shape{static_cast<int64_t>(ints.size())}, mt::kInt64).to(src_dt)};
    for (const Tensor& src : sources) {
      Tensor src_gpu = gpu(src);
      for (DType dst_dt : kAllTypes) {
        INFO(
            fmt::format("cast {} -> {} of {} elements", src_dt.name(), dst_dt.name(), src.numel()));
        Tensor want = Tensor::empty(src.shape(), dst_dt);
        cpu_kernel<mt::kernels::CastFn>(OpId::cast, src_dt)(src, want);
        Tensor got = cu::poisoned(src.shape(), dst_dt);
        gpu_kernel<mt::kernels::CastFn>(OpId::cast, src_dt)(src_gpu, got);
        check_bits(got, want, "cast kernel");
        check_bits(mt::cast(src_gpu, dst_dt), want, "cast()");
      }
    }
  }
}

TEST_CASE("cuda cast: empty and strided inputs", "[cuda]") {
  Tensor e = gpu(Tensor::empty({0, 3}, mt::kFloat32));
  CHECK(mt::cast(e, mt::kFloat16).numel() == 0);
  Tensor x = random_of({40, 30}, mt::kFloat64, 3, -5.0, 5.0);
  for (DType dt : kAllTypes) {
    INFO(dt.name());
    check_bits(mt::cast(gpu(x).transpose(), dt), mt::cast(x.transpose(), dt), "transposed");
  }
}

// --- unary -----------------------------------------------------------------------------------

namespace {

struct UnaryCase {
  const char* name;
  OpId op;
  Tensor (*fn)(const Tensor&);
  double lo, hi;  // the random input range
  bool integers;  // registered for int32 / int64 too
  bool exact;     // bit-exact against the CPU (no library math)
};

const std::vector<UnaryCase>& unary_cases() {
  static const std::vector<UnaryCase> cases = {
      {"neg", OpId::neg, &mt::neg, -3.0, 3.0, true, true},
      {"abs", OpId::abs, &mt::abs, -3.0, 3.0, true, true},
      {"exp", OpId::exp, &mt::exp, -4.0, 4.0, false, false},
      {"log", OpId::log, &mt::log, 0.01, 5.0, false, false},
      {"sqrt", OpId::sqrt, &mt::sqrt, 0.0, 9.0, false, false},
      {"rsqrt", OpId::rsqrt, &mt::rsqrt, 0.05, 9.0, false, false},
      {"tanh", OpId::tanh, &mt::tanh, -4.0, 4.0, false, false},
      {"sigmoid", OpId::sigmoid, &mt::sigmoid, -8.0, 8.0, false, false},
      {"relu", OpId::relu, &mt::relu, -3.0, 3.0, false, true},
      {"gelu", OpId::gelu, &mt::gelu, -5.0, 5.0, false, false},
      {"erf", OpId::erf, &mt::erf, -3.0, 3.0, false, false},
  };
  return cases;
}

// Compares a GPU result with the CPU's: bit for bit for exact ops and integers, else within
// the dtype's tolerance.
void check_result(const Tensor& got, const Tensor& want, bool exact, const std::string& what) {
  if (exact || !want.dtype().is_floating())
    check_bits(got, want, what);
  else
    cu::check_close(got, want, cu::tolerance(want.dtype()), what);
}

}  // namespace

TEST_CASE("cuda unary ops: every registered dtype against the CPU", "[cuda]") {
  const std::vector<DType> ints = {mt::kInt32, mt::kInt64};
  std::uint64_t seed = 1000;
  for (const UnaryCase& c : unary_cases()) {
    std::vector<DType> types = cu::kFloatTypes;
    if (c.integers) types.insert(types.end(), ints.begin(), ints.end());
    for (DType dt : types) {
      INFO(fmt::format("{} {}", c.name, dt.name()));
      CHECK(mt::supports(c.op, mt::DeviceType::CUDA, dt));
      // Through the op: small, odd-sized (vector + tail) and > 2^20 elements.
      for (const Shape& shape : {Shape{7}, Shape{3, 5, 7}, Shape{1 << 20 | 5}, Shape{0, 4}}) {
        Tensor x = shape.numel() == 0 ? Tensor::empty(shape, dt)
                                      : random_of(shape, dt, ++seed, c.lo, c.hi);
        check_result(c.fn(gpu(x)), c.fn(x), c.exact, "op, shape " + shape.str());
      }
      // Non-contiguous input (the op makes it contiguous first).
      Tensor m = random_of({33, 17}, dt, ++seed, c.lo, c.hi);
      check_result(c.fn(gpu(m).transpose()), c.fn(m.transpose()), c.exact, "transposed input");
      // The kernel on unaligned views (offset 1): the scalar path; poisoned output.
      Tensor xb = random_of({1001}, dt, ++seed, c.lo, c.hi);
      Tensor xv = view(xb, {1000}, {1}, 1);
      Tensor want = Tensor::empty({1000}, dt);
      cpu_kernel<mt::kernels::UnaryFn>(c.op, dt)(xv, want);
      Tensor ob = cu::poisoned({1001}, dt);
      Tensor ov = view(ob, {1000}, {1}, 1);
      gpu_kernel<mt::kernels::UnaryFn>(c.op, dt)(view(gpu(xb), {1000}, {1}, 1), ov);
      check_result(ov, want, c.exact, "kernel, unaligned views");
    }
  }
}

TEST_CASE("cuda unary ops: special values", "[cuda]") {
  for (const UnaryCase& c : unary_cases()) {
    for (DType dt : cu::kFloatTypes) {
      INFO(fmt::format("{} {}", c.name, dt.name()));
      Tensor x = values_of(special_values(), dt);
      check_result(c.fn(gpu(x)), c.fn(x), c.exact, "special values");
    }
  }
  // Integer neg / abs wrap: -INT_MIN is INT_MIN.
  for (DType dt : {mt::kInt32, mt::kInt64}) {
    INFO(dt.name());
    const std::vector<int64_t> v =
        dt == mt::kInt32 ? std::vector<int64_t>{0, 1, -1, 2147483647, -2147483648LL, 7}
                         : std::vector<int64_t>{0,
                                                1,
                                                -1,
                                                std::numeric_limits<int64_t>::max(),
                                                std::numeric_limits<int64_t>::min(),
                                                -5};
    Tensor x = mt::from_vector(v, Shape{static_cast<int64_t>(v.size())}, mt::kInt64).to(dt);
    check_bits(mt::neg(gpu(x)), mt::neg(x), "neg");
    check_bits(mt::abs(gpu(x)), mt::abs(x), "abs");
  }
}

// --- binary ----------------------------------------------------------------------------------

namespace {

struct BinaryCase {
  const char* name;
  OpId op;
  std::function<Tensor(const Tensor&, const Tensor&)> fn;  // empty: kernel only
  bool integers;
  bool exact;
  double lo, hi;  // b's range (a's is [-3, 3), [0.1, 3) for pow)
};

const std::vector<BinaryCase>& binary_cases() {
  static const std::vector<BinaryCase> cases = {
      {"add", OpId::add, [](const Tensor& a, const Tensor& b) { return mt::add(a, b); }, true, true,
       -3.0, 3.0},
      {"sub", OpId::sub, [](const Tensor& a, const Tensor& b) { return mt::sub(a, b); }, true, true,
       -3.0, 3.0},
      {"mul", OpId::mul, [](const Tensor& a, const Tensor& b) { return mt::mul(a, b); }, true, true,
       -3.0, 3.0},
      {"div", OpId::div, [](const Tensor& a, const Tensor& b) { return mt::div(a, b); }, true, true,
       0.25, 3.0},
      {"maximum", OpId::maximum, [](const Tensor& a, const Tensor& b) { return mt::maximum(a, b); },
       true, true, -3.0, 3.0},
      {"minimum", OpId::minimum, [](const Tensor& a, const Tensor& b) { return mt::minimum(a, b); },
       true, true, -3.0, 3.0},
      {"pow", OpId::pow, [](const Tensor& a, const Tensor& b) { return mt::pow(a, b); }, false,
       false, -2.0, 2.0},
      {"relu_backward", OpId::relu_backward, nullptr, false, true, -3.0, 3.0},
  };
  return cases;
}

// The broadcast view of t to shape (stride 0 on broadcast axes), as the ops pass operands.
Tensor broadcast(const Tensor& t, const Shape& shape) {
  const std::size_t r = shape.rank(), tr = t.rank();
  mt::Strides strides(r, 0);
  for (std::size_t i = 0; i < tr; ++i) {
    const std::size_t o = r - tr + i;
    strides[o] = t.shape()[i] == 1 && shape[o] != 1 ? 0 : t.strides()[i];
  }
  return Tensor::view_of(t, shape, strides, t.offset());
}

// Runs a BinaryFn kernel on the CPU and on the GPU (operands broadcast to `shape`, outputs
// poisoned) and compares.
void check_binary_kernel(OpId op, DType dt, const Tensor& a, const Tensor& b, const Shape& shape,
                         bool comparison, bool exact, const std::string& what) {
  const DType out_dt = comparison ? mt::kBool : dt;
  Tensor want = Tensor::empty(shape, out_dt);
  if (want.numel() > 0)
    cpu_kernel<mt::kernels::BinaryFn>(op, dt)(broadcast(a, shape), broadcast(b, shape), want);
  Tensor got = cu::poisoned(shape, out_dt);
  gpu_kernel<mt::kernels::BinaryFn>(op, dt)(broadcast(gpu(a), shape), broadcast(gpu(b), shape),
                                            got);
  check_result(got, want, exact, what);
}

}  // namespace

namespace {

struct BroadcastPattern {
  Shape a, b;
};

// Every binary case and dtype over the operand shapes of `patterns`, through the op and the
// kernel; with `views`, also transposed, sliced and unaligned operands.
void check_binary_patterns(const std::vector<BroadcastPattern>& patterns, bool views,
                           std::uint64_t seed) {
  for (const BinaryCase& c : binary_cases()) {
    std::vector<DType> types = cu::kFloatTypes;
    if (c.integers) types.insert(types.end(), {mt::kInt32, mt::kInt64});
    for (DType dt : types) {
      CHECK(mt::supports(c.op, mt::DeviceType::CUDA, dt));
      const double alo = c.op == OpId::pow ? 0.1 : -3.0;
      for (const BroadcastPattern& p : patterns) {
        INFO(fmt::format("{} {} {} x {}", c.name, dt.name(), p.a.str(), p.b.str()));
        const Shape out = mt::broadcast_shapes(p.a, p.b, "test");
        Tensor a = out.numel() == 0 ? mt::zeros(p.a, dt) : random_of(p.a, dt, ++seed, alo, 3.0);
        Tensor b = out.numel() == 0 ? mt::zeros(p.b, dt) : random_of(p.b, dt, ++seed, c.lo, c.hi);
        if (c.fn) check_result(c.fn(gpu(a), gpu(b)), c.fn(a, b), c.exact, "op");
        check_binary_kernel(c.op, dt, a, b, out, false, c.exact, "kernel");
      }
      if (!views) continue;
      // Non-contiguous operands through the op: transposed and sliced views.
      INFO(fmt::format("{} {} strided views", c.name, dt.name()));
      Tensor a = random_of({40, 30}, dt, ++seed, alo, 3.0);
      Tensor b = random_of({30, 80}, dt, ++seed, c.lo, c.hi);
      Tensor bs = b.slice(1, 1, 80, 2);  // [30, 40] with a column stride of 2
      if (c.fn)
        check_result(c.fn(gpu(a).transpose(), gpu(b).slice(1, 1, 80, 2)), c.fn(a.transpose(), bs),
                     c.exact, "transposed and sliced");
      // Unaligned contiguous views (offset 1): the scalar contiguous path.
      Tensor ab = random_of({1001}, dt, ++seed, alo, 3.0);
      Tensor bb = random_of({1001}, dt, ++seed, c.lo, c.hi);
      Tensor want = Tensor::empty({1000}, dt);
      cpu_kernel<mt::kernels::BinaryFn>(c.op, dt)(view(ab, {1000}, {1}, 1),
                                                  view(bb, {1000}, {1}, 1), want);
      Tensor ob = cu::poisoned({1001}, dt);
      Tensor ov = view(ob, {1000}, {1}, 1);
      gpu_kernel<mt::kernels::BinaryFn>(c.op, dt)(view(gpu(ab), {1000}, {1}, 1),
                                                  view(gpu(bb), {1000}, {1}, 1), ov);
      check_result(ov, want, c.exact, "kernel, unaligned views");
    }
  }
}

}  // namespace

TEST_CASE("cuda binary arithmetic: broadcast patterns, every registered dtype", "[cuda]") {
  // (Hundreds of blocks in the two of about 10^5 elements, an odd vector tail in the first;
  // the case below takes them to millions.)
  check_binary_patterns({{{3, 4, 5}, {3, 4, 5}},
                         {{3, 4, 5}, {5}},
                         {{3, 1, 5}, {1, 4, 1}},
                         {{}, {7}},
                         {{2, 3}, {}},
                         {{}, {}},
                         {{100003}, {100003}},
                         {{1 << 15, 3}, {1, 3}},
                         {{0, 5}, {5}},
                         {{2, 3, 1, 4, 1, 2, 3, 1, 2, 3}, {3, 1, 4, 1, 3, 2, 1, 3}}},  // 10-D
                        true, 2000);
}

// [large]: about 10^8 emulated threads in all, half a minute of the emulated suite's time for
// what the shapes above reach too (the kernels have no path of their own at these sizes).
TEST_CASE("cuda binary arithmetic: operands of millions of elements, every registered dtype",
          "[cuda][large]") {
  check_binary_patterns({{{1000003}, {1000003}}, {{1 << 20, 3}, {1, 3}}}, false, 3000);
}

TEST_CASE("cuda binary arithmetic: integer and special-value edge cases", "[cuda]") {
  // Integers: wrap-around, x / 0 == 0, INT_MIN / -1 == INT_MIN, truncating division.
  for (DType dt : {mt::kInt32, mt::kInt64}) {
    INFO(dt.name());
    const int64_t big = dt == mt::kInt32 ? 2147483647 : std::numeric_limits<int64_t>::max();
    const int64_t small = dt == mt::kInt32 ? -2147483648LL : std::numeric_limits<int64_t>::min();
    const std::vector<int64_t> av = {big, small, small, 7, -7, 7, -7, 0, 5, big, small, 3};
    const std::vector<int64_t> bv = {1, -1, 1, 2, 2, -2, -2, 0, 0, big, small, -1};
    const Shape s{static_cast<int64_t>(av.size())};
    Tensor a = mt::from_vector(av, s, mt::kInt64).to(dt);
    Tensor b = mt::from_vector(bv, s, mt::kInt64).to(dt);
    for (const BinaryCase& c : binary_cases()) {
      if (!c.integers) continue;
      INFO(c.name);
      check_bits(c.fn(gpu(a), gpu(b)), c.fn(a, b), "integer edge cases");
    }
  }
  // Floats: NaN propagation of maximum / minimum, signed zeros, infinities, division by
  // zero, pow's special cases.
  const std::vector<double> sv = special_values();
  std::vector<double> av, bv;
  for (double x : sv)
    for (double y : sv) av.push_back(x), bv.push_back(y);
  const Shape s{static_cast<int64_t>(av.size())};
  for (DType dt : cu::kFloatTypes) {
    Tensor a = values_of(av, dt), b = values_of(bv, dt);
    for (const BinaryCase& c : binary_cases()) {
      INFO(fmt::format("{} {}", c.name, dt.name()));
      check_binary_kernel(c.op, dt, a, b, s, false, c.exact, "special values (all pairs)");
    }
  }
}

// --- comparisons -----------------------------------------------------------------------------

TEST_CASE("cuda comparisons: every dtype, bool output", "[cuda]") {
  struct Cmp {
    const char* name;
    OpId op;
    Tensor (*fn)(const Tensor&, const Tensor&);
  };
  const std::vector<Cmp> cmps = {
      {"eq", OpId::equal, &mt::equal},     {"ne", OpId::not_equal, &mt::not_equal},
      {"lt", OpId::less, &mt::less},       {"le", OpId::less_equal, &mt::less_equal},
      {"gt", OpId::greater, &mt::greater}, {"ge", OpId::greater_equal, &mt::greater_equal}};
  std::uint64_t seed = 3000;
  for (DType dt : kAllTypes) {
    // b equals a in about half of the places, so that eq / le / ge see ties.
    Tensor a = random_of({64, 50}, dt, ++seed, -2.0, 2.0);
    Tensor other = random_of({64, 50}, dt, ++seed, -2.0, 2.0);
    Tensor mask = random_of({64, 50}, mt::kBool, ++seed);
    Tensor b = mt::where(mask, a, other);
    Tensor row = random_of({50}, dt, ++seed, -2.0, 2.0);
    for (const Cmp& c : cmps) {
      INFO(fmt::format("{} {}", c.name, dt.name()));
      CHECK(mt::supports(c.op, mt::DeviceType::CUDA, dt));
      check_bits(c.fn(gpu(a), gpu(b)), c.fn(a, b), "same shapes");
      check_bits(c.fn(gpu(a), gpu(row)), c.fn(a, row), "broadcast row");
      check_bits(c.fn(gpu(a).transpose(), gpu(b).transpose()), c.fn(a.transpose(), b.transpose()),
                 "transposed");
      Tensor big = random_of({(1 << 20) + 3}, dt, ++seed, -2.0, 2.0);
      Tensor big2 = random_of({(1 << 20) + 3}, dt, ++seed, -2.0, 2.0);
      check_bits(c.fn(gpu(big), gpu(big2)), c.fn(big, big2), "> 2^20 elements");
      if (dt.is_floating()) {
        const std::vector<double> sv = special_values();
        std::vector<double> av, bv;
        for (double x : sv)
          for (double y : sv) av.push_back(x), bv.push_back(y);
        Tensor sa = values_of(av, dt), sb = values_of(bv, dt);
        check_bits(c.fn(gpu(sa), gpu(sb)), c.fn(sa, sb), "special values (NaN, -0, inf)");
      }
      Tensor e = Tensor::empty({0, 3}, dt);
      CHECK(c.fn(gpu(e), gpu(e)).numel() == 0);
    }
  }
}

// --- where -----------------------------------------------------------------------------------

TEST_CASE("cuda where: every dtype, broadcast operands", "[cuda]") {
  struct Pattern {
    Shape c, a, b;
  };
  const std::vector<Pattern> patterns = {
      {{4, 5}, {4, 5}, {4, 5}},
      {{3, 1, 5}, {3, 4, 5}, {5}},
      {{}, {6}, {2, 6}},
      {{7, 1}, {}, {1, 9}},
      {{(1 << 20) + 1}, {(1 << 20) + 1}, {}},
      {{2, 1, 2, 3, 1, 2, 3, 1, 3, 2}, {2, 1, 2, 2, 1, 2, 3, 1}, {3, 2}},  // 10-D
      {{0, 3}, {3}, {0, 3}},
  };
  std::uint64_t seed = 4000;
  for (DType dt : kAllTypes) {
    CHECK(mt::supports(OpId::where, mt::DeviceType::CUDA, dt));
    for (const Pattern& p : patterns) {
      INFO(fmt::format("where {} {} {} {}", dt.name(), p.c.str(), p.a.str(), p.b.str()));
      const bool empty =
          mt::broadcast_shapes(mt::broadcast_shapes(p.c, p.a, "t"), p.b, "t").numel() == 0;
      Tensor c = empty ? mt::zeros(p.c, mt::kBool) : random_of(p.c, mt::kBool, ++seed);
      Tensor a = empty ? mt::zeros(p.a, dt) : random_of(p.a, dt, ++seed);
      Tensor b = empty ? mt::zeros(p.b, dt) : random_of(p.b, dt, ++seed);
      check_bits(mt::where(gpu(c), gpu(a), gpu(b)), mt::where(c, a, b), "where()");
    }
    INFO(fmt::format("where {} transposed operands", dt.name()));
    Tensor c = random_of({20, 30}, mt::kBool, ++seed);
    Tensor a = random_of({30, 20}, dt, ++seed);
    Tensor b = random_of({20, 30}, dt, ++seed);
    check_bits(mt::where(gpu(c), gpu(a).transpose(), gpu(b)), mt::where(c, a.transpose(), b),
               "transposed");
  }
  // NaN and -0 move through where untouched (bits, not values).
  Tensor x = values_of(special_values(), mt::kFloat32);
  Tensor y = mt::neg(x);
  Tensor c = random_of(x.shape(), mt::kBool, 77);
  check_bits(mt::where(gpu(c), gpu(x), gpu(y)), mt::where(c, x, y), "special values");
}

// --- large tensors ---------------------------------------------------------------------------

TEST_CASE("cuda elementwise: tensors larger than one grid (grid-stride loops wrap)",
          "[cuda][large]") {
  const Shape shape{kWrapSide, kWrapSide};
  const int64_t n = kWrapSide * kWrapSide;
  // uint8 data from a cheap generator (134M elements).
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(n));
  std::uint32_t state = 12345;
  for (auto& v : bytes) {
    state = state * 1664525u + 1013904223u;
    v = static_cast<std::uint8_t>(state >> 24);
  }
  Tensor x = mt::from_vector(bytes, shape, mt::kUInt8);
  bytes = {};
  Tensor xg = gpu(x);
  // Strided copy (a transpose), the 32-bit index path.
  check_bits(xg.transpose().contiguous(), x.transpose().contiguous(), "transposed copy");
  // A comparison with a broadcast scalar (strided path, stride 0), and a contiguous one.
  Tensor t = mt::full({}, 100.0, mt::kUInt8);
  check_bits(mt::greater(xg, gpu(t)), mt::greater(x, t), "greater than a scalar");
  check_bits(mt::equal(xg, xg.transpose()), mt::equal(x, x.transpose()), "equal to transpose");
  // cast (scalar grid loop) and fill (memset and vector paths).
  check_bits(mt::cast(xg, mt::kBool), mt::cast(x, mt::kBool), "cast to bool");
  check_bits(mt::full(shape, 3.0, mt::kUInt8, cu::kGpu), mt::full(shape, 3.0, mt::kUInt8),
             "fill uint8");
  Tensor f = cu::poisoned(shape, mt::kFloat16);
  mt::find_kernel<mt::kernels::FillFn>(OpId::fill, mt::DeviceType::CUDA, mt::kFloat16)(f, 1.5);
  check_bits(f, mt::full(shape, 1.5, mt::kFloat16), "fill float16");
  // where with a broadcast row.
  Tensor c = mt::greater(x, t);
  Tensor row = random_of({kWrapSide}, mt::kUInt8, 9);
  check_bits(mt::where(gpu(c), xg, gpu(row)), mt::where(c, x, row), "where");
  // A float32 unary and binary op beyond one grid's threads on the vector path is 4x more
  // data; the vector loops share the scalar loops' grid-stride macro, so 2^25 elements check
  // the large-size vector path instead.
  Tensor a = random_of({1 << 25}, mt::kFloat32, 10);
  Tensor b = random_of({1 << 25}, mt::kFloat32, 11);
  check_bits(mt::add(gpu(a), gpu(b)), mt::add(a, b), "add, 2^25 float32");
  cu::check_close(mt::exp(gpu(a)), mt::exp(a), cu::tolerance(mt::kFloat32), "exp, 2^25 float32");
}

// --- gradients -------------------------------------------------------------------------------

TEST_CASE("cuda gradients: elementwise composites through a GradientTape", "[cuda]") {
  for (DType dt : {mt::kFloat32, mt::kFloat64}) {
    INFO(dt.name());
    Tensor x = random_of({6, 5}, dt, 21, -2.0, 2.0);
    Tensor w = random_of({5}, dt, 22, -2.0, 2.0);
    auto grads_on = [&](mt::Device d) {
      Tensor xd = x.to(d), wd = w.to(d);
      mt::GradientTape tape;
      tape.watch(std::vector<Tensor>{xd, wd});
      Tensor h = mt::tanh(xd * wd) / 3.0;
      Tensor r = mt::relu(h) + mt::sigmoid(xd) * mt::gelu(wd) - mt::maximum(xd, wd);
      Tensor s = mt::where(mt::greater(xd, wd), mt::exp(r), mt::sqrt(mt::abs(r) + 1.0));
      Tensor y = mt::sum(s * mt::erf(xd) + mt::pow(mt::abs(xd) + 0.5, wd));
      return tape.gradient(y, std::vector<Tensor>{xd, wd});
    };
    const auto g_gpu = grads_on(cu::kGpu);
    const auto g_cpu = grads_on(mt::Device::cpu());
    REQUIRE(g_gpu.size() == 2);
    CHECK(g_gpu[0].device() == cu::kGpu);
    const double tol = dt == mt::kFloat64 ? 1e-11 : 1e-5;
    cu::check_close(g_gpu[0], g_cpu[0], tol, "d/dx");
    cu::check_close(g_gpu[1], g_cpu[1], tol, "d/dw");
  }
}
