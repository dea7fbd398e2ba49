// The CUDA reduction kernels (sum, mean, max, min, argmax over [outer, n, inner]) and row
// kernels (softmax, log_softmax) against the CPU backend:
//  - the kernels directly over geometries that take every launch shape (a warp or a block per
//    row, 32-column tiles, n split over several blocks with a merge pass, grids that wrap),
//    every registered dtype, poisoned outputs;
//  - sums and means within a bound for float32 accumulation (the CPU accumulates in float64),
//    max / min / argmax exactly, NaN propagation and the first-index rule (ties, first NaN)
//    across splits;
//  - the public ops over axes (keepdims, several axes, non-contiguous inputs, empty tensors);
//  - softmax / log_softmax: short and long rows, huge row counts, -inf / +inf / NaN rows;
//  - gradients of a composite with reductions and softmax through a GradientTape.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
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

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

const std::vector<DType> kReduceTypes = {mt::kFloat32, mt::kFloat16, mt::kBFloat16,
                                         mt::kFloat64, mt::kInt32,   mt::kInt64};

Tensor gpu(const Tensor& t) { return t.to(cu::kGpu); }

// Random values (never all zero): floats in [lo, hi), integers in [lo, hi) floored.
Tensor random_of(const Shape& shape, DType dt, std::uint64_t seed, double lo = -1.0,
                 double hi = 1.0) {
  if (dt.is_integral() && hi - lo < 2.0) lo = -1000.0, hi = 1000.0;
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

using cu::check_bits;

// The bound of a float32-accumulated sum against the CPU's float64 one, per output: the
// rounding of the result to the dtype (relative) plus the accumulation error relative to the
// sum of the magnitudes reduced (sum_abs), plus float16's smallest subnormal step.
struct SumBound {
  double rel_out, acc, abs_floor;
};
SumBound sum_bound(DType dt) {
  if (dt == mt::kFloat64) return {2e-16, 1e-14, 0.0};
  if (dt == mt::kFloat32) return {2.4e-7, 4e-6, 0.0};
  if (dt == mt::kFloat16) return {1e-3, 4e-6, 6e-8};
  return {7.9e-3, 4e-6, 0.0};  // bfloat16
}

// Sums / means: |got - want| <= rel_out |want| + acc sum|x| (/ n for a mean) per output.
void check_sum(const Tensor& got, const Tensor& want, const Tensor& x, int64_t outer, int64_t n,
               int64_t inner, bool mean, const std::string& what) {
  INFO(what);
  REQUIRE(got.numel() == outer * inner);
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  const auto xv = x.to_vector<double>();
  const SumBound b = sum_bound(x.dtype());
  std::size_t bad = 0, first = 0;
  double first_err = 0.0, first_bound = 0.0;
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < inner; ++i) {
      double s = 0.0;
      for (int64_t j = 0; j < n; ++j)
        s += std::abs(xv[static_cast<std::size_t>((o * n + j) * inner + i)]);
      if (mean) s /= static_cast<double>(n);
      const auto q = static_cast<std::size_t>(o * inner + i);
      const double err = std::abs(g[q] - w[q]);
      const double bound = b.rel_out * std::abs(w[q]) + (1.0 + b.rel_out) * b.acc * s + b.abs_floor;
      const bool same = g[q] == w[q] || (std::isnan(g[q]) && std::isnan(w[q]));  // inf, NaN
      if (!same && !(err <= bound)) {
        if (bad++ == 0) first = q, first_err = err, first_bound = bound;
      }
    }
  }
  INFO(fmt::format(
      "{} of {} outputs out of bounds; first at {}: got {}, want {}, error {:.3g} "
      "> bound {:.3g}",
      bad, g.size(), first, bad ? g[first] : 0.0, bad ? w[first] : 0.0, first_err, first_bound));
  CHECK(bad == 0);
}

// Sums over any axes: |got - want| <= rel_out |want| + acc sum|x| over all of x (a bound
// on every output's own sum of magnitudes).
void check_total(const Tensor& got, const Tensor& want, const Tensor& x, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  double total = 0.0;
  for (double v : x.to_vector<double>()) total += std::abs(v);
  const SumBound b = sum_bound(x.dtype());
  // Several axes reduce in several kernels, with the intermediate rounded to the dtype in
  // between: for the 16-bit floats, one ulp of every intermediate may differ.
  const double staged = x.dtype().is_reduced_float() ? b.rel_out * total : 0.0;
  std::size_t bad = 0;
  for (std::size_t q = 0; q < g.size(); ++q) {
    const double bound =
        b.rel_out * std::abs(w[q]) + (1.0 + b.rel_out) * b.acc * total + b.abs_floor + staged;
    if (!(std::abs(g[q] - w[q]) <= bound)) ++bad;
  }
  CHECK(bad == 0);
}

const char* op_label(OpId op) { return mt::op_name(op); }

// A ReduceFn on the CPU and on the GPU (poisoned output), compared: sums and means within
// check_sum's bound, integer results and argmax bit for bit, float max / min by value (the
// sign of a zero maximum may depend on the order).
void check_reduce(OpId op, const Tensor& x, int64_t outer, int64_t n, int64_t inner,
                  const std::string& what) {
  const DType dt = x.dtype();
  const DType out_dt = op == OpId::argmax ? mt::kInt64 : dt;
  INFO(fmt::format("{} {} [{}, {}, {}] {}", op_label(op), dt.name(), outer, n, inner, what));
  Tensor want = Tensor::empty({outer * inner}, out_dt);
  mt::find_kernel<mt::kernels::ReduceFn>(op, mt::DeviceType::CPU, dt)(x, outer, n, inner, want);
  Tensor got = cu::poisoned({outer * inner}, out_dt);
  mt::find_kernel<mt::kernels::ReduceFn>(op, mt::DeviceType::CUDA, dt)(gpu(x), outer, n, inner,
                                                                       got);
  if ((op == OpId::sum || op == OpId::mean) && dt.is_floating())
    check_sum(got, want, x, outer, n, inner, op == OpId::mean, "sum / mean");
  else if (op == OpId::argmax || !dt.is_floating())
    check_bits(got, want, "exact");
  else
    cu::check_equal(got, want, "max / min");
}

std::vector<OpId> reduce_ops(DType dt) {
  if (dt.is_floating()) return {OpId::sum, OpId::mean, OpId::max, OpId::min, OpId::argmax};
  return {OpId::sum, OpId::max, OpId::min, OpId::argmax};
}

}  // namespace

// --- The kernels directly ---------------------------------------------------------------------

TEST_CASE("cuda reductions: every geometry and registered dtype", "[cuda]") {
  struct Geo {
    int64_t outer, n, inner;
  };
  const std::vector<Geo> geos = {
      {1, 1, 1},     {64, 1, 1},    {2, 1, 1000},   {1, 7, 1},
      {3, 5, 4},     {5, 50, 1},    {7, 129, 1},    {1000, 3, 1},
      {2, 1000, 3},  {4, 129, 33},  {1, 100000, 1}, {3, 4097, 1},
      {1, 3000, 70}, {1, 20000, 2}, {3, 257, 31},   {1, (1 << 20) + 3, 1},
      {3, 1024, 1},  {3, 1025, 1},  {2, 5000, 1},
  };
  std::uint64_t seed = 100;
  for (DType dt : kReduceTypes) {
    for (OpId op : reduce_ops(dt)) {
      CHECK(mt::supports(op, mt::DeviceType::CUDA, dt));
      for (const Geo& g : geos) {
        Tensor x = random_of({g.outer * g.n * g.inner}, dt, ++seed);
        check_reduce(op, x, g.outer, g.n, g.inner, "random");
      }
    }
  }
}

TEST_CASE("cuda reductions: grids that wrap and wide splits", "[cuda][large]") {
  // Rows of 4 (a warp per row): 5M rows need more warps than one grid has; 600000 x 3 x 2
  // needs more column blocks than one grid has; a sum of 2^24 + 5 elements splits n.
  struct Geo {
    int64_t outer, n, inner;
  };
  const std::vector<Geo> geos = {
      {5000000, 4, 1}, {600000, 3, 2}, {1, (1 << 24) + 5, 1}, {2, 3000000, 3}};
  std::uint64_t seed = 200;
  for (DType dt : {mt::kFloat32, mt::kInt32}) {
    for (const Geo& g : geos) {
      Tensor x = random_of({g.outer * g.n * g.inner}, dt, ++seed);
      for (OpId op : reduce_ops(dt)) check_reduce(op, x, g.outer, g.n, g.inner, "large");
    }
  }
}

TEST_CASE("cuda reductions: NaN, infinities and the first-index rule", "[cuda]") {
  for (DType dt : cu::kFloatTypes) {
    INFO(dt.name());
    // Rows of 1000 with NaN in some (first NaN at 10 in row 3), one row of -inf only, one
    // with +inf; as rows (inner 1) and transposed (inner 6).
    const int64_t rows = 6, n = 1000;
    std::vector<double> v(static_cast<std::size_t>(rows * n));
    mt::Generator gen(5);
    for (auto& e : v) e = gen.next_uniform() * 2.0 - 1.0;
    auto at = [&](int64_t r, int64_t j) -> double& {
      return v[static_cast<std::size_t>(r * n + j)];
    };
    at(1, 500) = kNaN;
    at(2, 0) = kNaN;
    at(2, 999) = kNaN;
    at(3, 900) = kNaN;
    at(3, 10) = kNaN;
    for (int64_t j = 0; j < n; ++j) at(4, j) = -kInf;
    at(5, 700) = kInf;
    at(5, 3) = kInf;  // two +inf: argmax 3
    Tensor x = mt::from_vector(v, Shape{rows, n}, dt);
    Tensor xt = x.transpose().contiguous();  // [n, rows]: inner = rows
    for (OpId op : {OpId::sum, OpId::mean, OpId::max, OpId::min, OpId::argmax}) {
      check_reduce(op, x, rows, n, 1, "special rows");
      check_reduce(op, xt, 1, n, rows, "special columns");
    }
    // NaN far into a long row (n split over blocks): the first NaN wins across splits.
    const int64_t big = 200000;
    std::vector<double> w(static_cast<std::size_t>(big));
    for (auto& e : w) e = gen.next_uniform();
    w[199999] = kNaN;
    w[150000] = kNaN;
    w[3] = 2.0;
    Tensor y = mt::from_vector(w, Shape{big}, dt);
    for (OpId op : {OpId::max, OpId::min, OpId::argmax}) check_reduce(op, y, 1, big, 1, "late NaN");
  }
  // Ties: values in {0, 1, 2}, the first 2 wins, across splits and in column tiles.
  for (DType dt : kReduceTypes) {
    INFO(dt.name());
    Tensor x = random_of({200000}, mt::kInt32, 33, 0.0, 3.0).to(dt);
    check_reduce(OpId::argmax, x, 1, 200000, 1, "ties, one long row");
    check_reduce(OpId::argmax, x, 1, 5000, 40, "ties, columns");
    check_reduce(OpId::argmax, x, 400, 500, 1, "ties, rows");
    check_reduce(OpId::argmax, x, 50000, 4, 1, "ties, short rows");
    check_reduce(OpId::max, x, 1, 5000, 40, "max with ties");
  }
  // Integer extremes: sums wrap, max / min reach the limits.
  for (DType dt : {mt::kInt32, mt::kInt64}) {
    INFO(dt.name());
    const int64_t hi = dt == mt::kInt32 ? 2147483647 : std::numeric_limits<int64_t>::max();
    const int64_t lo = dt == mt::kInt32 ? -2147483647 - 1 : std::numeric_limits<int64_t>::min();
    std::vector<int64_t> v(3000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = i % 3 == 0 ? hi : (i % 3 == 1 ? lo : 12345);
    Tensor x = mt::from_vector(v, Shape{3000}, mt::kInt64).to(dt);
    for (OpId op : {OpId::sum, OpId::max, OpId::min, OpId::argmax}) {
      check_reduce(op, x, 1, 3000, 1, "extremes, one row");
      check_reduce(op, x, 3, 500, 2, "extremes, columns");
    }
  }
}

// --- The public ops ---------------------------------------------------------------------------

TEST_CASE("cuda reductions: the public ops over axes", "[cuda]") {
  struct Axes {
    std::vector<int> axes;
    bool keepdims;
  };
  const std::vector<Axes> cases = {{{}, false},    {{0}, false},     {{1}, true},
                                   {{2}, false},   {{-1}, true},     {{0, 2}, false},
                                   {{1, 2}, true}, {{0, 1, 2}, true}};
  std::uint64_t seed = 300;
  for (DType dt : kReduceTypes) {
    Tensor x = random_of({6, 37, 19}, dt, ++seed);
    Tensor xg = gpu(x);
    for (const Axes& a : cases) {
      INFO(fmt::format("{} axes [{}] keepdims {}", dt.name(), fmt::join(a.axes, ", "), a.keepdims));
      // Sums within the float32-accumulation bound, taken against the total magnitude.
      auto close = [&](const Tensor& got, const Tensor& want, const char* what) {
        if (dt.is_floating())
          check_total(got, want, x, what);
        else
          check_bits(got, want, what);
      };
      close(mt::sum(xg, a.axes, a.keepdims), mt::sum(x, a.axes, a.keepdims), "sum");
      if (dt.is_floating())
        close(mt::mean(xg, a.axes, a.keepdims), mt::mean(x, a.axes, a.keepdims), "mean");
      cu::check_equal(mt::max(xg, a.axes, a.keepdims), mt::max(x, a.axes, a.keepdims), "max");
      cu::check_equal(mt::min(xg, a.axes, a.keepdims), mt::min(x, a.axes, a.keepdims), "min");
      // A non-contiguous input (made contiguous by the op).
      close(mt::sum(xg.permute({2, 0, 1}), a.axes, a.keepdims),
            mt::sum(x.permute({2, 0, 1}), a.axes, a.keepdims), "sum of a permuted view");
    }
    for (int axis : {0, 1, 2, -1}) {
      INFO(fmt::format("{} argmax axis {}", dt.name(), axis));
      check_bits(mt::argmax(xg, axis), mt::argmax(x, axis), "argmax");
      check_bits(mt::argmax(xg, axis, true), mt::argmax(x, axis, true), "argmax keepdims");
    }
  }
  // Empty tensors: nothing to reduce, or an empty reduced axis (sum 0, mean NaN, max throws).
  Tensor e = Tensor::empty({3, 0}, mt::kFloat32);
  Tensor eg = gpu(e);
  check_bits(mt::sum(eg, {1}), mt::sum(e, {1}), "sum over an empty axis");
  check_bits(mt::mean(eg, {1}), mt::mean(e, {1}), "mean over an empty axis");
  CHECK(mt::sum(eg, {0}).numel() == 0);
  CHECK_THROWS_AS(mt::max(eg, {1}), mt::ValueError);
  // A large full sum (split over many blocks, then merged).
  Tensor big = random_of({(1 << 24) + 5}, mt::kFloat32, 9, 0.0, 1.0);
  cu::check_close(mt::sum(gpu(big)), mt::sum(big), 1e-5, "sum of 2^24 + 5 elements");
  cu::check_close(mt::mean(gpu(big)), mt::mean(big), 1e-5, "mean of 2^24 + 5 elements");
}

// --- softmax / log_softmax ------------------------------------------------------------------

namespace {
double softmax_tolerance(DType dt) { return dt == mt::kFloat32 ? 4e-6 : cu::tolerance(dt); }
}  // namespace

namespace {

// softmax and log_softmax of every floating dtype over each shape, along the last axis and the
// first, through the ops and the kernels (into poisoned outputs).
void check_softmax_shapes(const std::vector<Shape>& shapes, std::uint64_t seed) {
  for (DType dt : cu::kFloatTypes) {
    CHECK(mt::supports(OpId::softmax, mt::DeviceType::CUDA, dt));
    CHECK(mt::supports(OpId::log_softmax, mt::DeviceType::CUDA, dt));
    const double tol = softmax_tolerance(dt);
    for (const Shape& s : shapes) {
      INFO(fmt::format("{} {}", dt.name(), s.str()));
      Tensor x = s.numel() == 0 ? Tensor::empty(s, dt) : random_of(s, dt, ++seed, -5.0, 5.0);
      Tensor xg = gpu(x);
      cu::check_close(mt::softmax(xg), mt::softmax(x), tol, "softmax");
      cu::check_close(mt::log_softmax(xg), mt::log_softmax(x), tol, "log_softmax");
      if (s.rank() >= 2) {
        cu::check_close(mt::softmax(xg, 0), mt::softmax(x, 0), tol, "softmax axis 0");
        cu::check_close(mt::log_softmax(xg, 0), mt::log_softmax(x, 0), tol, "log_softmax axis 0");
      }
      if (s.numel() > 0) {
        // The kernel directly, into a poisoned output.
        for (OpId op : {OpId::softmax, OpId::log_softmax}) {
          Tensor want = Tensor::empty(s, dt);
          mt::find_kernel<mt::kernels::RowFn>(op, mt::DeviceType::CPU, dt)(x, want);
          Tensor got = cu::poisoned(s, dt);
          mt::find_kernel<mt::kernels::RowFn>(op, mt::DeviceType::CUDA, dt)(xg, got);
          cu::check_close(got, want, tol, std::string("kernel ") + mt::op_name(op));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("cuda softmax and log_softmax: every floating dtype", "[cuda]") {
  // ({2, 10000}: rows longer than a block's threads, and along axis 0 ten thousand rows of two,
  // a warp each; the case below takes 100,000.)
  check_softmax_shapes(
      {{1, 1}, {3, 7}, {5, 256}, {5, 257}, {4, 300}, {9}, {2, 3, 40}, {2, 10000}, {6, 1}, {0, 4}},
      400);
  for (DType dt : cu::kFloatTypes) {
    const double tol = softmax_tolerance(dt);
    // Large values (stability), -inf entries, a NaN row, an all -inf row, a +inf row.
    INFO(fmt::format("{} special rows", dt.name()));
    std::vector<double> v = {1e4,   1e4 - 1.0, 1e4 - 2.0, -1e4,   // large: no overflow
                             0.5,   -kInf,     1.0,       -kInf,  // -inf entries give 0
                             0.5,   kNaN,      1.0,       2.0,    // NaN row
                             -kInf, -kInf,     -kInf,     -kInf,  // all -inf: NaN
                             0.5,   kInf,      1.0,       2.0};   // +inf: NaN
    Tensor x = mt::from_vector(v, Shape{5, 4}, dt);
    cu::check_close(mt::softmax(gpu(x)), mt::softmax(x), tol, "softmax special rows");
    cu::check_close(mt::log_softmax(gpu(x)), mt::log_softmax(x), tol, "log_softmax special rows");
  }
}

// [large]: 3.2 million emulated threads a launch along axis 0, most of the emulated suite's
// time for this op, for the paths the case above takes.
TEST_CASE("cuda softmax and log_softmax: rows of 100,000 and 100,000 rows", "[cuda][large]") {
  check_softmax_shapes({{2, 100000}}, 500);
}

TEST_CASE("cuda softmax: more rows than one grid has warps", "[cuda][large]") {
  Tensor x = random_of({4300000, 3}, mt::kFloat32, 77, -3.0, 3.0);
  Tensor xg = gpu(x);
  cu::check_close(mt::softmax(xg), mt::softmax(x), 4e-6, "softmax");
  cu::check_close(mt::log_softmax(xg), mt::log_softmax(x), 4e-6, "log_softmax");
}

// --- gradients ------------------------------------------------------------------------------

TEST_CASE("cuda gradients: reductions and softmax through a GradientTape", "[cuda]") {
  for (DType dt : {mt::kFloat32, mt::kFloat64}) {
    INFO(dt.name());
    Tensor x = random_of({4, 6, 5}, dt, 41, -2.0, 2.0);
    Tensor w = random_of({5}, dt, 42, -2.0, 2.0);
    auto grads_on = [&](mt::Device d) {
      Tensor xd = x.to(d), wd = w.to(d);
      mt::GradientTape tape;
      tape.watch(std::vector<Tensor>{xd, wd});
      Tensor h = mt::tanh(xd * wd);
      Tensor p = mt::softmax(h, -1) * mt::log_softmax(h * 2.0, 1);
      Tensor m = mt::max(h, {1}, true) + mt::min(xd, {2}, true) * mt::mean(h, {0, 2}, true);
      Tensor y = mt::sum(p * m) + mt::mean(mt::sum(h * h, {2})) / 3.0;
      return tape.gradient(y, std::vector<Tensor>{xd, wd});
    };
    const auto g_gpu = grads_on(cu::kGpu);
    const auto g_cpu = grads_on(mt::Device::cpu());
    REQUIRE(g_gpu.size() == 2);
    const double tol = dt == mt::kFloat64 ? 1e-11 : 2e-5;
    cu::check_close(g_gpu[0], g_cpu[0], tol, "d/dx");
    cu::check_close(g_gpu[1], g_cpu[1], tol, "d/dw");
  }
}

// The bias and LayerNorm parameter gradients are column sums of per-32-row partial sums, added
// in block order (backends/cuda/elementwise_util.cuh's ordered_column_sum loads them 16 blocks
// at a time): 1100 rows (35 blocks: two batches and a rest) and 300 columns (two blocks of
// threads), the sums of plain additions bit for bit the CPU's.
TEST_CASE("cuda column sums: bias and LayerNorm parameter gradients of many rows, as the CPU's",
          "[cuda]") {
  const int64_t m = 1100, n = 300;
  const Tensor x = cu::random({m, n}, mt::kFloat32, 61);
  const Tensor w = cu::random({n, n}, mt::kFloat32, 62);
  const Tensor b = cu::random({n}, mt::kFloat32, 63);
  const Tensor gamma = cu::random({n}, mt::kFloat32, 64, 0.5, 1.5);
  const Tensor beta = cu::random({n}, mt::kFloat32, 65);
  const Tensor r = cu::random({m, n}, mt::kFloat32, 66);
  const auto grads_on = [&](mt::Device d) {
    Tensor bd = b.to(d), gd = gamma.to(d), ed = beta.to(d);
    mt::GradientTape tape;
    tape.watch(std::vector<Tensor>{bd, gd, ed});
    const Tensor y = mt::linear(x.to(d), w.to(d), bd);
    const Tensor z = mt::layer_norm(x.to(d), gd, ed, 1e-5);
    const Tensor loss = mt::sum(y * r.to(d)) + mt::sum(z * r.to(d));
    return tape.gradient(loss, std::vector<Tensor>{bd, gd, ed});
  };
  const auto gpu = grads_on(cu::kGpu), cpu = grads_on(mt::Device::cpu());
  REQUIRE(gpu.size() == 3);
  cu::check_bits(gpu[0], cpu[0], "dbias: the column sums of r");
  cu::check_bits(gpu[2], cpu[2], "dbeta: the column sums of r");
  // dgamma sums dy xhat: products that nvcc may contract into the sums (FMA).
  cu::check_close(gpu[1], cpu[1], 1e-5, "dgamma");
}

// batch_norm's statistics and gradients on a GPU against the CPU backend's (the same float64
// partial sums over 32-row blocks, added in block order): 1100 rows (35 blocks: two batches of
// ordered_column_sum and a rest) of 300 columns (two blocks of threads), a 16-bit x read in
// float32, with a column mean far from 0 next to its spread.
TEST_CASE("cuda batch_norm: statistics and gradients over many rows, as the CPU's", "[cuda]") {
  const int64_t m = 1100, n = 300;
  for (const mt::DType dt : {mt::kFloat32, mt::kBFloat16}) {
    INFO(dt.name());
    const Tensor x = mt::cast(cu::random({m, n}, mt::kFloat32, 71, 4.0, 6.0), dt);
    const Tensor gamma = cu::random({n}, mt::kFloat32, 72, 0.5, 1.5);
    const Tensor beta = cu::random({n}, mt::kFloat32, 73);
    const Tensor r = cu::random({m, n}, mt::kFloat32, 74);
    const auto run_on = [&](mt::Device d) {
      Tensor xd = x.to(d), gd = gamma.to(d), ed = beta.to(d);
      mt::GradientTape tape;
      tape.watch(std::vector<Tensor>{xd, gd, ed});
      const mt::BatchNormResult y = mt::batch_norm(xd, gd, ed, 1e-3);
      auto out = tape.gradient(mt::sum(mt::cast(y.out, mt::kFloat32) * r.to(d)),
                               std::vector<Tensor>{xd, gd, ed});
      out.insert(out.begin(), {y.out, y.mean, y.variance});
      return out;
    };
    const auto gpu = run_on(cu::kGpu), cpu = run_on(mt::Device::cpu());
    REQUIRE(gpu.size() == 6);
    // The mean's sums of plain additions: bit for bit; the rest may contract into FMAs.
    cu::check_bits(gpu[1], cpu[1], "mean");
    cu::check_close(gpu[2], cpu[2], 1e-6, "variance");
    cu::check_close(gpu[0], cpu[0], dt == mt::kFloat32 ? 1e-5 : 2e-2, "out");
    cu::check_close(gpu[3], cpu[3], dt == mt::kFloat32 ? 1e-5 : 2e-2, "dx");
    cu::check_close(gpu[4], cpu[4], 1e-4, "dgamma");
    cu::check_bits(gpu[5], cpu[5], "dbeta: the column sums of r");
  }
}
