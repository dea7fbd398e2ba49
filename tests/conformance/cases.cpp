// The sweep's drivers: one per kernel signature of the op table, each running the kernel of
// (op, dtype) on the device under test and the CPU's float64 kernel of the op on the same
// values (tests/conformance/conformance.h). Op-specific knowledge is limited to input
// domains (positive inputs for log, denominators away from zero, ...): a new op of an
// existing signature is swept without a line here.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include "mixtape/autograd/ops.h"
#include "mixtape/core/dropout_hash.h"
#include "mixtape/core/kernels.h"
#include "tests/conformance/conformance.h"

namespace mixtape::conformance {
namespace {

using std::int64_t;
using Pair = Context::Pair;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

bool is(const Context& c, const char* kernel) { return op_info(c.op()).kernel == kernel; }

std::string shape_name(const Shape& s) { return s.str(); }

// --- Elementwise ---------------------------------------------------------------------------

// Where the values of a unary op's input come from.
struct Domain {
  double lo, hi;
};
Domain unary_domain(const Context& c) {
  if (!c.dtype().is_floating()) return {-20, 20};
  switch (c.op()) {
    case OpId::log:
    case OpId::sqrt:
    case OpId::rsqrt:
      return {0.05, 5.0};
    case OpId::exp:
      return {-5.0, 5.0};
    default:
      return {-3.0, 3.0};
  }
}

const std::vector<Shape>& elementwise_shapes() {
  static const std::vector<Shape> shapes{{}, {0}, {1}, {7}, {3, 5}, {2, 0, 3}, {1031}, {70001}};
  return shapes;
}

// Special values: NaN, infinities, signed zeros, and values that overflow 16 bits.
const std::vector<double>& special_values() {
  static const std::vector<double> v{kNaN, kInf, -kInf, 0.0, -0.0, 1.0, -2.0, 0.5, 100.0, 7e4};
  return v;
}

void unary(Context& c) {
  auto* fn = tested_kernel<kernels::UnaryFn>(c);
  auto* ref = reference_kernel<kernels::UnaryFn>(c);
  const Domain d = unary_domain(c);
  auto run = [&](const std::string& what, const Pair& x) {
    const Pair out = c.output(x.tested.shape());
    if (x.tested.numel() > 0) {
      fn(x.tested, out.tested);
      ref(x.ref, out.ref);
    }
    c.expect_close(what, out.tested, out.ref);
  };
  for (const Shape& s : elementwise_shapes())
    run("shape " + shape_name(s), c.uniform(s, d.lo, d.hi));
  if (c.dtype().is_floating()) {
    const auto& v = special_values();
    std::size_t i = 0;
    run("special values", c.make({static_cast<int64_t>(v.size())}, [&] { return v[i++]; }));
  }
}

// The inputs of a binary op: a, b and the output's shape.
struct BinaryShapes {
  Shape a, b;
};
const std::vector<BinaryShapes>& binary_shapes() {
  static const std::vector<BinaryShapes> shapes{
      {{3, 5}, {3, 5}},   {{3, 1}, {1, 5}},    {{2, 3, 4}, {4}}, {{7}, {}},
      {{}, {}},           {{0, 5}, {5}},       {{5, 1}, {5, 0}}, {{1031}, {1031}},
      {{70001}, {70001}}, {{4, 1, 6}, {3, 1}}, {{33, 64}, {64}}, {{64}, {33, 64}},
      {{300, 520}, {520}}};
  return shapes;
}

Shape broadcast_shape(const Shape& a, const Shape& b) {
  const std::size_t rank = std::max(a.rank(), b.rank());
  std::vector<int64_t> dims(rank, 1);
  for (std::size_t i = 0; i < rank; ++i) {
    const int64_t da = i < rank - a.rank() ? 1 : a.dim(static_cast<int>(i - (rank - a.rank())));
    const int64_t db = i < rank - b.rank() ? 1 : b.dim(static_cast<int>(i - (rank - b.rank())));
    dims[i] = da == 1 ? db : da;
  }
  return Shape(dims);
}

bool is_comparison(const Context& c) {
  switch (c.op()) {
    case OpId::equal:
    case OpId::not_equal:
    case OpId::less:
    case OpId::less_equal:
    case OpId::greater:
    case OpId::greater_equal:
      return true;
    default:
      return false;
  }
}

void binary(Context& c) {
  auto* fn = tested_kernel<kernels::BinaryFn>(c);
  auto* ref = reference_kernel<kernels::BinaryFn>(c);
  const bool floating = c.dtype().is_floating();
  const bool comparison = is_comparison(c);
  const bool divides = c.op() == OpId::div;
  // Operand values: few distinct ones for comparisons (so that ties happen), bases > 0
  // and moderate exponents for pow, denominators away from zero.
  auto draw_a = [&]() -> double {
    if (comparison) return static_cast<double>(c.integer(-2, 2)) * 0.5;
    if (c.op() == OpId::pow) return c.uniform(0.1, 3.0);
    if (c.op() == OpId::relu_backward) return c.integer(0, 3) == 0 ? 0.0 : c.uniform(-1.0, 1.0);
    return floating ? c.uniform(-3.0, 3.0) : c.uniform(-20, 20);
  };
  auto draw_b = [&]() -> double {
    if (comparison) return static_cast<double>(c.integer(-2, 2)) * 0.5;
    if (c.op() == OpId::pow) return c.uniform(-2.0, 2.0);
    if (divides) {
      const double sign = c.integer(0, 1) ? 1.0 : -1.0;
      return floating ? sign * c.uniform(0.5, 2.0) : sign * static_cast<double>(c.integer(1, 7));
    }
    return floating ? c.uniform(-3.0, 3.0) : c.uniform(-20, 20);
  };
  auto run = [&](const std::string& what, const Pair& a, const Pair& b) {
    const Shape shape = broadcast_shape(a.tested.shape(), b.tested.shape());
    const Pair out = comparison ? c.output(shape, kBool) : c.output(shape);
    if (shape.numel() > 0) {
      const Pair av = Context::broadcast(a, shape), bv = Context::broadcast(b, shape);
      fn(av.tested, bv.tested, out.tested);
      ref(av.ref, bv.ref, out.ref);
    }
    // Integer quotients truncate toward zero.
    c.expect_close(what, out.tested, out.ref, {}, divides && !floating);
  };
  for (const auto& s : binary_shapes())
    run(fmt::format("shapes {} and {}", shape_name(s.a), shape_name(s.b)), c.make(s.a, draw_a),
        c.make(s.b, draw_b));
  // Strided operands: a transposed view and a view taking every other element.
  {
    const Pair base = c.make({5, 3}, draw_a);
    run("a transposed view", Context::view(base, {3, 5}, Strides({1, 3})), c.make({3, 5}, draw_b));
    const Pair every_other = c.make({20}, draw_b);
    run("a view of stride 2", c.make({10}, draw_a),
        Context::view(every_other, {10}, Strides({2}), 1));
  }
  if (floating) {
    // Every pair of special values.
    const auto& v = special_values();
    const auto n = static_cast<int64_t>(v.size());
    std::size_t i = 0, j = 0;
    const Pair a = c.make({n, 1}, [&] { return v[i++]; });
    const Pair b = c.make({1, n}, [&] { return v[j++]; });
    run("special values", a, b);
  }
}

void where(Context& c) {
  auto* fn = tested_kernel<kernels::WhereFn>(c);
  auto* ref = reference_kernel<kernels::WhereFn>(c);
  struct Shapes {
    Shape cond, a, b;
  };
  const std::vector<Shapes> cases{{{7}, {7}, {7}},
                                  {{3, 1}, {1, 5}, {3, 5}},
                                  {{}, {4, 2}, {2}},
                                  {{0, 3}, {3}, {1}},
                                  {{1031}, {1031}, {}}};
  for (const auto& s : cases) {
    const Pair cond = c.make(
        s.cond, [&] { return static_cast<double>(c.integer(0, 1)); }, kBool);
    const Pair a = c.uniform(s.a, -3.0, 3.0), b = c.uniform(s.b, -3.0, 3.0);
    const Shape shape = broadcast_shape(broadcast_shape(s.cond, s.a), s.b);
    const Pair out = c.output(shape);
    if (shape.numel() > 0) {
      const Pair cv = Context::broadcast(cond, shape), av = Context::broadcast(a, shape),
                 bv = Context::broadcast(b, shape);
      fn(cv.tested, av.tested, bv.tested, out.tested);
      ref(cv.ref, av.ref, bv.ref, out.ref);
    }
    c.expect_equal(
        fmt::format("shapes {}, {}, {}", shape_name(s.cond), shape_name(s.a), shape_name(s.b)),
        out.tested, out.ref);
  }
}

// --- Reductions and rows -------------------------------------------------------------------

void reduce(Context& c) {
  auto* fn = tested_kernel<kernels::ReduceFn>(c);
  auto* ref = reference_kernel<kernels::ReduceFn>(c);
  const bool argmax = c.op() == OpId::argmax;
  // max, min and argmax see few distinct values, so that ties (the first index wins) happen.
  const bool coarse = argmax || c.op() == OpId::max || c.op() == OpId::min;
  struct Extents {
    int64_t outer, n, inner;
  };
  const std::vector<Extents> cases{{1, 1, 1},    {1, 7, 1}, {3, 5, 4}, {2, 1000, 3},
                                   {1, 4099, 1}, {5, 1, 7}, {0, 3, 2}, {4, 33, 0}};
  for (const auto& e : cases) {
    const Pair x = c.make({e.outer * e.n * e.inner}, [&] {
      return coarse ? static_cast<double>(c.integer(-3, 3)) : c.uniform(-1.0, 1.0);
    });
    const Shape out_shape{e.outer * e.inner};
    const Pair out = argmax ? c.output(out_shape, kInt64) : c.output(out_shape);
    if (out_shape.numel() > 0) {
      fn(x.tested, e.outer, e.n, e.inner, out.tested);
      ref(x.ref, e.outer, e.n, e.inner, out.ref);
    }
    c.expect_close(fmt::format("[outer {}, n {}, inner {}]", e.outer, e.n, e.inner), out.tested,
                   out.ref, {static_cast<double>(e.n), 0.0});
  }
}

void rows(Context& c) {
  auto* fn = tested_kernel<kernels::RowFn>(c);
  auto* ref = reference_kernel<kernels::RowFn>(c);
  const bool log = c.op() == OpId::log_softmax;
  const std::vector<Shape> shapes{{3, 5}, {1, 4099}, {0, 5}, {64, 10}, {7, 1}, {2, 3, 33}};
  for (const Shape& s : shapes) {
    const Pair x = c.uniform(s, -5.0, 5.0);
    const Pair out = c.output(s);
    if (s.numel() > 0) {
      fn(x.tested, out.tested);
      ref(x.ref, out.ref);
    }
    // Row sums: a relative error for softmax, an absolute one (through the log) for
    // log_softmax, both growing with the row's length.
    const auto cols = static_cast<double>(s.dim(-1));
    c.expect_close("shape " + shape_name(s), out.tested, out.ref,
                   log ? Scale{cols + 5.0, 0.0} : Scale{0.0, cols});
  }
}

// masked_softmax: with no mask and with masks that drop about a third of each row and all of
// the first row; the masked inputs are NaN (a kernel that reads them fails).
void masked_rows(Context& c) {
  auto* fn = tested_kernel<kernels::MaskedSoftmaxFn>(c);
  auto* ref = reference_kernel<kernels::MaskedSoftmaxFn>(c);
  const std::vector<Shape> shapes{{3, 5}, {1, 4099}, {0, 5}, {64, 10}, {7, 1}, {2, 3, 33}};
  for (const Shape& s : shapes)
    for (const bool masked : {false, true}) {
      const int64_t cols = s.dim(-1), n = s.numel();
      std::vector<bool> keep(static_cast<std::size_t>(n), true);
      if (masked)
        for (int64_t i = 0; i < n; ++i)
          keep[static_cast<std::size_t>(i)] = i >= cols && c.integer(0, 2) != 0;
      std::size_t at = 0, at_x = 0;
      const Pair mask = c.make(
          s, [&] { return keep[at++] ? 1.0 : 0.0; }, kBool);
      const Pair x = c.make(s, [&] {
        return keep[at_x++] ? c.uniform(-5.0, 5.0) : std::numeric_limits<double>::quiet_NaN();
      });
      const double scale = masked ? 0.125 : 1.7;
      const Pair out = c.output(s);
      if (n > 0) {
        fn(x.tested, masked ? mask.tested : Tensor(), scale, out.tested);
        ref(x.ref, masked ? mask.ref : Tensor(), scale, out.ref);
      }
      c.expect_close(fmt::format("shape {}{}", shape_name(s), masked ? ", masked" : ""), out.tested,
                     out.ref, Scale{0.0, static_cast<double>(cols)});
    }
}

// --- Fused attention -------------------------------------------------------------------------

// attention and attention_backward against the composed computation in float64, written out
// here (the logits, a softmax over each row's attended keys, the weighted values, and the
// gradients of those), not against the CPU kernel's own tiling. Cases: one position; rows
// that cross the kernels' 64-row tiles; causal with more keys than queries; a random mask with
// a row that attends nothing (its output 0, its log-sum-exp -inf); the head dims of the CUDA
// tensor-core kernel.
struct AttentionCase {
  int64_t n, t, s, d, dv;
  bool masked, causal;
  int64_t padded = 0;    // > 0: a key-padding mask, one row of s per group of `padded` heads
  double dropout = 0.0;  // the rate of dropout on the weights
  // The kernels read q, k, v, dout and write out, dq, dk, dv as views [2, n / 2, rows, width]
  // of [2, rows, n / 2, width]: the heads of a projection, where they lie (kernels.h).
  bool in_place = false;
};

// x [n, rows, width] as attention's kernels see a projection's heads: a view [2, n / 2, rows,
// width] of a copy laid out [2, rows, n / 2, width]; x itself unless in_place.
Tensor as_projection(const Tensor& x, bool in_place) {
  if (!in_place) return x;
  const int64_t n = x.dim(0), rows = x.dim(1), w = x.dim(2);
  return permute(contiguous(permute(reshape(x, {2, n / 2, rows, w}), {0, 2, 1, 3})), {0, 2, 1, 3});
}

// An output of attention's kernels [n, rows, width] (NaN where unwritten), as as_projection
// lays it out when in_place; `read` gives its values as [n, rows, width].
struct HeadsOutput {
  Tensor kernel;
  Tensor read() const {
    return reshape(contiguous(kernel), {kernel.numel() / (kernel.dim(-2) * kernel.dim(-1)),
                                        kernel.dim(-2), kernel.dim(-1)});
  }
};
HeadsOutput heads_output(Context& c, int64_t n, int64_t rows, int64_t w, bool in_place) {
  if (!in_place) return {c.output({n, rows, w}).tested};
  return {permute(c.output({2, rows, n / 2, w}).tested, {0, 2, 1, 3})};
}

void attention(Context& c) {
  const bool backward = is(c, "AttentionBackwardFn");
  // The backward pass needs the forward's out and lse: the same device's forward kernel.
  const auto forward =
      find_kernel<kernels::AttentionFn>(OpId::attention, c.device().type(), c.dtype());
  const DType stat = c.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const std::vector<AttentionCase> cases{
      {1, 1, 1, 1, 1, false, false},
      {2, 5, 7, 3, 4, false, false},
      {3, 70, 70, 16, 8, false, true},
      {2, 65, 130, 8, 12, true, false},
      {1, 33, 33, 4, 4, true, true},
      {2, 5, 9, 6, 3, false, true},
      {6, 9, 70, 5, 4, true, false, 3},
      {4, 66, 66, 8, 8, true, true, 2},
      {3, 70, 70, 16, 8, false, true, 0, 0.3},
      {2, 5, 9, 6, 3, true, false, 0, 0.5},
      // Head dims the CUDA backend's tiled kernels take (16-bit: 32 to 128, dk and dv in two
      // kernels beyond 64; float32: multiples of 4 up to 64, the cases of widths 4 and 8 above
      // too): rows and keys that cross their blocks and tiles.
      {2, 100, 100, 64, 64, false, true},
      {1, 70, 130, 32, 32, true, false},
      {4, 66, 66, 128, 128, true, true, 2},
      {2, 70, 70, 64, 64, false, true, 0, 0.2},
      {1, 9, 20, 96, 96, false, false},
      // The heads of a projection read and written where they lie.
      {4, 70, 70, 64, 64, false, true, 2, 0.2, true},
      {2, 9, 13, 6, 4, true, false, 0, 0.0, true}};
  for (const AttentionCase& a : cases) {
    const std::string what = fmt::format("n {} t {} s {} d {} dv {}{}{}", a.n, a.t, a.s, a.d, a.dv,
                                         a.padded   ? ", key padding"
                                         : a.masked ? ", masked"
                                                    : "",
                                         a.causal ? ", causal" : "") +
                             (a.dropout > 0 ? fmt::format(", dropout {}", a.dropout) : "") +
                             (a.in_place ? ", heads in place" : "");
    const Pair q = c.uniform({a.n, a.t, a.d}, -1.0, 1.0), k = c.uniform({a.n, a.s, a.d}, -1.0, 1.0),
               v = c.uniform({a.n, a.s, a.dv}, -1.0, 1.0);
    std::vector<bool> keep(static_cast<std::size_t>(a.n * a.t * a.s), true);
    Tensor m;
    if (a.padded) {
      // The mask as kernels.h allows it: [n / padded, padded, t, s] read from one row of s
      // keys per group of heads (strides s, 0, 0, 1), never made [n, t, s]; the last keys of
      // each group padded away (the first group's all but one).
      const int64_t groups = a.n / a.padded;
      std::vector<bool> row(static_cast<std::size_t>(groups * a.s));
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < a.s; ++j)
          row[static_cast<std::size_t>(g * a.s + j)] = j < (g == 0 ? 1 : a.s - 3 * g);
      for (std::size_t i = 0; i < keep.size(); ++i) {
        const auto h = static_cast<int64_t>(i) / (a.t * a.s), j = static_cast<int64_t>(i) % a.s;
        keep[i] = row[static_cast<std::size_t>(h / a.padded * a.s + j)];
      }
      std::size_t at = 0;
      const Pair rows = c.make(
          {groups, a.s}, [&] { return row[at++] ? 1.0 : 0.0; }, kBool);
      m = Context::view(rows, {groups, a.padded, a.t, a.s}, Strides({a.s, 0, 0, 1})).tested;
    } else if (a.masked) {
      for (std::size_t i = 0; i < keep.size(); ++i)
        keep[i] = i >= static_cast<std::size_t>(a.s) && c.integer(0, 2) != 0;  // row 0: none
      std::size_t at = 0;
      const Pair mask = c.make(
          {a.n, a.t, a.s}, [&] { return keep[at++] ? 1.0 : 0.0; }, kBool);
      m = Context::view(mask, {a.n, 1, a.t, a.s}, Strides({a.t * a.s, a.t * a.s, a.s, 1})).tested;
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(a.d)) + 0.1;
    const HeadsOutput out = heads_output(c, a.n, a.t, a.dv, a.in_place);
    const Pair lse = c.output({a.n, a.t}, stat);
    const std::uint64_t seed = 0x5eed0000u + static_cast<std::uint64_t>(a.t);
    // The seed by value, or (the in-place cases) read from the device, as a captured step gives
    // it (kernels.h: seed_at).
    kernels::AttentionDropout dropout{a.dropout, seed, {}};
    if (a.in_place) {
      dropout.seed = 0;
      dropout.seed_at = from_vector<std::int64_t>(
          std::vector<std::int64_t>{static_cast<std::int64_t>(seed)}, Shape{1}, kInt64, c.device());
    }
    // The operands as the kernels take them.
    const Tensor oq = as_projection(q.tested, a.in_place), ok = as_projection(k.tested, a.in_place),
                 ov = as_projection(v.tested, a.in_place);
    forward(oq, ok, ov, m, a.causal, scale, dropout, out.kernel, lse.tested);
    // Dropout's factor Z of each weight (kernels.h), from the same hash.
    const std::uint32_t threshold = dropout_threshold(a.dropout);
    const auto z = [&](int64_t h, int64_t i, int64_t j) {
      if (a.dropout == 0.0) return 1.0;
      const auto index = static_cast<std::uint64_t>((h * a.t + i) * a.s + j);
      return dropout_keeps(seed, index, threshold) ? 1.0 / (1.0 - a.dropout) : 0.0;
    };

    // The reference: P, out and lse in float64 (for the backward pass, from the out and lse
    // the kernel is given, as its contract says).
    const auto qv = q.ref.to_vector<double>(), kv = k.ref.to_vector<double>(),
               vv = v.ref.to_vector<double>();
    const auto attends = [&](int64_t h, int64_t i, int64_t j) {
      return keep[static_cast<std::size_t>((h * a.t + i) * a.s + j)] && (!a.causal || j <= i);
    };
    const auto logit = [&](int64_t h, int64_t i, int64_t j) {
      double x = 0;
      for (int64_t e = 0; e < a.d; ++e)
        x += qv[static_cast<std::size_t>((h * a.t + i) * a.d + e)] *
             kv[static_cast<std::size_t>((h * a.s + j) * a.d + e)];
      return x * scale;
    };
    std::vector<double> ref_out(static_cast<std::size_t>(a.n * a.t * a.dv), 0.0),
        ref_lse(static_cast<std::size_t>(a.n * a.t), -kInf);
    for (int64_t h = 0; h < a.n; ++h)
      for (int64_t i = 0; i < a.t; ++i) {
        double mx = -kInf;
        for (int64_t j = 0; j < a.s; ++j)
          if (attends(h, i, j)) mx = std::max(mx, logit(h, i, j));
        if (mx == -kInf) continue;
        double sum = 0;
        for (int64_t j = 0; j < a.s; ++j)
          if (attends(h, i, j)) sum += std::exp(logit(h, i, j) - mx);
        ref_lse[static_cast<std::size_t>(h * a.t + i)] = mx + std::log(sum);
        for (int64_t j = 0; j < a.s; ++j) {
          if (!attends(h, i, j)) continue;
          const double p = std::exp(logit(h, i, j) - mx) / sum * z(h, i, j);
          for (int64_t e = 0; e < a.dv; ++e)
            ref_out[static_cast<std::size_t>((h * a.t + i) * a.dv + e)] +=
                p * vv[static_cast<std::size_t>((h * a.s + j) * a.dv + e)];
        }
      }
    const double terms = static_cast<double>(a.s + a.d + a.dv);
    if (!backward) {
      c.expect_close(what + ", out", out.read(), from_vector(ref_out, {a.n, a.t, a.dv}, kFloat64),
                     Scale{terms, 0.0});
      c.expect_close(what + ", lse", lse.tested, from_vector(ref_lse, {a.n, a.t}, kFloat64),
                     Scale{terms, 0.0});
      continue;
    }
    const Pair dout = c.uniform({a.n, a.t, a.dv}, -1.0, 1.0);
    const HeadsOutput dq = heads_output(c, a.n, a.t, a.d, a.in_place),
                      dk = heads_output(c, a.n, a.s, a.d, a.in_place),
                      dv = heads_output(c, a.n, a.s, a.dv, a.in_place);
    tested_kernel<kernels::AttentionBackwardFn>(c)(
        oq, ok, ov, m, a.causal, scale, dropout, out.kernel, lse.tested,
        as_projection(dout.tested, a.in_place), dq.kernel, dk.kernel, dv.kernel);
    const auto given_out = out.read().to(kFloat64).to_vector<double>();
    const auto given_lse = lse.tested.to(kFloat64).to_vector<double>();
    const auto gv = dout.ref.to_vector<double>();
    std::vector<double> rq(static_cast<std::size_t>(a.n * a.t * a.d), 0.0),
        rk(static_cast<std::size_t>(a.n * a.s * a.d), 0.0),
        rv(static_cast<std::size_t>(a.n * a.s * a.dv), 0.0);
    for (int64_t h = 0; h < a.n; ++h)
      for (int64_t i = 0; i < a.t; ++i) {
        const double li = given_lse[static_cast<std::size_t>(h * a.t + i)];
        if (li == -kInf) continue;
        double di = 0;  // sum_e dout[i, e] out[i, e]
        for (int64_t e = 0; e < a.dv; ++e)
          di += gv[static_cast<std::size_t>((h * a.t + i) * a.dv + e)] *
                given_out[static_cast<std::size_t>((h * a.t + i) * a.dv + e)];
        for (int64_t j = 0; j < a.s; ++j) {
          if (!attends(h, i, j)) continue;
          const double p = std::exp(logit(h, i, j) - li), zij = z(h, i, j);
          double dp = 0;
          for (int64_t e = 0; e < a.dv; ++e) {
            const double g = gv[static_cast<std::size_t>((h * a.t + i) * a.dv + e)];
            dp += g * vv[static_cast<std::size_t>((h * a.s + j) * a.dv + e)];
            rv[static_cast<std::size_t>((h * a.s + j) * a.dv + e)] += p * zij * g;
          }
          const double ds = p * (dp * zij - di) * scale;
          for (int64_t e = 0; e < a.d; ++e) {
            rq[static_cast<std::size_t>((h * a.t + i) * a.d + e)] +=
                ds * kv[static_cast<std::size_t>((h * a.s + j) * a.d + e)];
            rk[static_cast<std::size_t>((h * a.s + j) * a.d + e)] +=
                ds * qv[static_cast<std::size_t>((h * a.t + i) * a.d + e)];
          }
        }
      }
    // A gradient element sums over the keys (dq) or the queries (dk, dv) products whose factors
    // are themselves sums over the head dims (the logits, dP): the lengths add, as the forward
    // pass's do. (Before 2026-12-01 they multiplied, a bound 70 to 130 times looser that let a
    // float32 dv 1.001 times too large pass.)
    const double grad_terms = static_cast<double>(std::max(a.t, a.s) + a.d + a.dv);
    c.expect_close(what + ", dq", dq.read(), from_vector(rq, {a.n, a.t, a.d}, kFloat64),
                   Scale{grad_terms, 0.0});
    c.expect_close(what + ", dk", dk.read(), from_vector(rk, {a.n, a.s, a.d}, kFloat64),
                   Scale{grad_terms, 0.0});
    c.expect_close(what + ", dv", dv.read(), from_vector(rv, {a.n, a.s, a.dv}, kFloat64),
                   Scale{grad_terms, 0.0});
  }
}

// --- Fused linear ----------------------------------------------------------------------------

// The activations of the linear op and their derivatives in float64 (kernels.h's definitions).
double linear_act(kernels::LinearActivation a, double z) {
  switch (a) {
    case kernels::LinearActivation::relu:
      return z < 0 ? 0.0 : z;
    case kernels::LinearActivation::gelu:
      return 0.5 * z * std::erfc(-z / std::sqrt(2.0));
    case kernels::LinearActivation::gelu_tanh:
      return 0.5 * z *
             (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (z + 0.044715 * z * z * z)));
    case kernels::LinearActivation::none:
      break;
  }
  return z;
}
double linear_act_grad(kernels::LinearActivation a, double s) {
  switch (a) {
    case kernels::LinearActivation::relu:
      return s > 0 ? 1.0 : 0.0;
    case kernels::LinearActivation::gelu:
      return 0.5 * std::erfc(-s / std::sqrt(2.0)) +
             s * std::exp(-0.5 * s * s) / std::sqrt(2 * std::numbers::pi);
    case kernels::LinearActivation::gelu_tanh: {
      const double c = std::sqrt(2.0 / std::numbers::pi),
                   t = std::tanh(c * (s + 0.044715 * s * s * s));
      return 0.5 * (1.0 + t) + 0.5 * s * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * s * s);
    }
    case kernels::LinearActivation::none:
      break;
  }
  return 1.0;
}

// The values v rounded to dtype (the CPU's correctly rounding cast), read back.
std::vector<double> rounded_to(const std::vector<double>& v, DType dtype) {
  const Shape shape{static_cast<int64_t>(v.size())};
  return cast(from_vector(v, shape, kFloat64), dtype).to_vector<double>();
}

// linear and linear_backward against float64 formulas written out here: every activation, with
// and without a bias (in the dtype under test, kernels.h: a 16-bit product's bias is 16-bit)
// and a pre-activation output, over shapes with odd and aligned extents (a GPU's epilogue path
// and its fallback), and more rows than one block of the bias gradient's partial sums.
void linear(Context& c) {
  using kernels::LinearActivation;
  const bool backward = is(c, "LinearBackwardFn");
  const DType ct = c.dtype() == kFloat64 ? kFloat64 : kFloat32;
  struct Case {
    int64_t m, n, k;
  };
  const std::vector<Case> cases{{1, 1, 1},     {7, 5, 3},    {33, 17, 65},
                                {64, 64, 300}, {130, 24, 8}, {16, 256, 64}};
  const auto at = [](const std::vector<double>& v, int64_t i) {
    return v[static_cast<std::size_t>(i)];
  };
  for (const auto activation : {LinearActivation::none, LinearActivation::relu,
                                LinearActivation::gelu, LinearActivation::gelu_tanh})
    for (const auto& cs : cases)
      for (const bool with_bias : {false, true}) {
        const std::string what =
            fmt::format("[{}x{}] x [{}x{}]{}, activation {}", cs.m, cs.k, cs.k, cs.n,
                        with_bias ? " + bias" : "", static_cast<int>(activation));
        if (!backward) {
          const Pair x = c.uniform({cs.m, cs.k}, -1.0, 1.0), w = c.uniform({cs.k, cs.n}, -1.0, 1.0);
          const Pair bias = c.make({cs.n}, [&] { return c.uniform(-1.0, 1.0); });
          const Pair out = c.output({cs.m, cs.n}), pre = c.output({cs.m, cs.n});
          kernels::LinearArgs args;
          args.x = x.tested, args.w = w.tested, args.out = out.tested, args.pre = pre.tested;
          args.bias = with_bias ? bias.tested : Tensor();
          args.activation = activation;
          tested_kernel<kernels::LinearFn>(c)(args);
          const auto xv = x.ref.to_vector<double>(), wv = w.ref.to_vector<double>(),
                     bv = bias.ref.to_vector<double>();
          std::vector<double> z(static_cast<std::size_t>(cs.m * cs.n)), y(z.size());
          for (int64_t i = 0; i < cs.m; ++i)
            for (int64_t j = 0; j < cs.n; ++j) {
              double s = with_bias ? at(bv, j) : 0.0;
              for (int64_t l = 0; l < cs.k; ++l) s += at(xv, i * cs.k + l) * at(wv, l * cs.n + j);
              z[static_cast<std::size_t>(i * cs.n + j)] = s;
              y[static_cast<std::size_t>(i * cs.n + j)] = linear_act(activation, s);
            }
          const Scale scale{1.2 * static_cast<double>(cs.k + 1), 0.0};
          const Tensor y_ref = from_vector(y, {cs.m, cs.n}, kFloat64);
          // kernels.h lets a GPU kernel round the pre-activation to out's dtype before the
          // activation reads it (cuBLASLt's epilogues do, and backends/cuda/linear.cu's plain
          // path): where the gelus' slope is steep against their value (z near -2), that moves
          // a 16-bit out by more than its own rounding. There, out is held to act(z) or, when
          // it is not close to that, to act(z rounded); on the CPU, to act(z) alone.
          const auto out_ref = [&](const Tensor& got) {
            if (c.device().type() == DeviceType::CPU || !c.dtype().is_reduced_float() ||
                activation == LinearActivation::none || c.is_close(got, y_ref, scale))
              return y_ref;
            std::vector<double> y_rounded = rounded_to(z, c.dtype());
            for (auto& v : y_rounded) v = linear_act(activation, v);
            return from_vector(y_rounded, {cs.m, cs.n}, kFloat64);
          };
          c.expect_close(what + ", out", out.tested, out_ref(out.tested), scale);
          c.expect_close(what + ", pre", pre.tested, from_vector(z, {cs.m, cs.n}, kFloat64), scale);
          // Without pre the same out (a kernel may take another path).
          const Pair out2 = c.output({cs.m, cs.n});
          args.out = out2.tested, args.pre = Tensor();
          tested_kernel<kernels::LinearFn>(c)(args);
          c.expect_close(what + ", out (no pre)", out2.tested, out_ref(out2.tested), scale);
          continue;
        }
        // The backward pass from a random dy and saved tensor (relu: an output, >= 0).
        const Pair dy = c.uniform({cs.m, cs.n}, -1.0, 1.0);
        const Pair saved = c.make({cs.m, cs.n}, [&] {
          const double v = c.uniform(-4.0, 4.0);
          return activation == LinearActivation::relu && v < 0 ? 0.0 : v;
        });
        const Pair dz = c.output({cs.m, cs.n}), dbias = c.output({cs.n}, ct);
        kernels::LinearBackwardArgs args;
        args.dy = dy.tested, args.activation = activation;
        if (activation != LinearActivation::none) args.saved = saved.tested, args.dz = dz.tested;
        if (with_bias) args.dbias = dbias.tested;
        tested_kernel<kernels::LinearBackwardFn>(c)(args);
        const auto gv = dy.ref.to_vector<double>(), sv = saved.ref.to_vector<double>();
        std::vector<double> d(gv.size()), db(static_cast<std::size_t>(cs.n), 0.0);
        for (int64_t i = 0; i < cs.m * cs.n; ++i) {
          d[static_cast<std::size_t>(i)] = at(gv, i) * linear_act_grad(activation, at(sv, i));
          db[static_cast<std::size_t>(i % cs.n)] += d[static_cast<std::size_t>(i)];
        }
        if (activation != LinearActivation::none)
          c.expect_close(what + ", dz", dz.tested, from_vector(d, {cs.m, cs.n}, kFloat64),
                         Scale{4.0, 0.0});
        if (with_bias)
          c.expect_close(what + ", dbias", dbias.tested, from_vector(db, {cs.n}, kFloat64),
                         Scale{2.0 * static_cast<double>(cs.m), 0.0});
      }
}

// --- Fused layer normalisation -----------------------------------------------------------------

// layer_norm and layer_norm_backward against the float64 formulas written out here: rows of
// 1, 7, 64 and 1000 values (offset from 0, so that the mean matters), with and without gamma
// and beta, and a row of equal values (variance 0: the epsilon alone).
void layer_norm(Context& c) {
  const bool backward = is(c, "LayerNormBackwardFn");
  const auto forward =
      find_kernel<kernels::LayerNormFn>(OpId::layer_norm, c.device().type(), c.dtype());
  const DType ct = c.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const double eps = 1e-5;
  for (const int64_t n : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{1000}})
    for (const bool affine : {false, true}) {
      const int64_t rows = 5;
      const std::string what =
          fmt::format("rows {} of {}{}", rows, n, affine ? ", gamma and beta" : "");
      int64_t at = 0;
      const Pair x = c.make({rows, n}, [&] {
        return at++ < n ? 0.75 : 3.0 + c.uniform(-2.0, 2.0);  // row 0: all equal
      });
      const Pair gamma = c.make(
          {n}, [&] { return c.uniform(0.5, 1.5); }, ct);
      const Pair beta = c.make(
          {n}, [&] { return c.uniform(-1.0, 1.0); }, ct);
      const Pair out = c.output({rows, n}), mean = c.output({rows}, ct),
                 rstd = c.output({rows}, ct);
      const Tensor g = affine ? gamma.tested : Tensor(), b = affine ? beta.tested : Tensor();
      forward(x.tested, g, b, eps, out.tested, mean.tested, rstd.tested);
      const auto xv = x.ref.to_vector<double>(), gv = gamma.ref.to_vector<double>(),
                 bv = beta.ref.to_vector<double>();
      std::vector<double> ref_out(static_cast<std::size_t>(rows * n)),
          ref_mean(static_cast<std::size_t>(rows)), ref_rstd(static_cast<std::size_t>(rows));
      for (int64_t r = 0; r < rows; ++r) {
        double s = 0, v = 0;
        for (int64_t j = 0; j < n; ++j) s += xv[static_cast<std::size_t>(r * n + j)];
        const double mu = s / static_cast<double>(n);
        for (int64_t j = 0; j < n; ++j) {
          const double d = xv[static_cast<std::size_t>(r * n + j)] - mu;
          v += d * d;
        }
        const double rs = 1.0 / std::sqrt(v / static_cast<double>(n) + eps);
        ref_mean[static_cast<std::size_t>(r)] = mu;
        ref_rstd[static_cast<std::size_t>(r)] = rs;
        for (int64_t j = 0; j < n; ++j) {
          double o = (xv[static_cast<std::size_t>(r * n + j)] - mu) * rs;
          if (affine) o = o * gv[static_cast<std::size_t>(j)] + bv[static_cast<std::size_t>(j)];
          ref_out[static_cast<std::size_t>(r * n + j)] = o;
        }
      }
      // rstd reaches 1 / sqrt(eps) ~ 316 on the equal row: a relative error there.
      const Scale scale{static_cast<double>(n) + 4.0, static_cast<double>(n) + 4.0};
      if (!backward) {
        c.expect_close(what + ", out", out.tested, from_vector(ref_out, {rows, n}, kFloat64),
                       scale);
        c.expect_close(what + ", mean", mean.tested, from_vector(ref_mean, {rows}, kFloat64),
                       scale);
        c.expect_close(what + ", rstd", rstd.tested, from_vector(ref_rstd, {rows}, kFloat64),
                       scale);
        continue;
      }
      // The backward pass from the mean and rstd the kernel is given.
      const Pair dy = c.uniform({rows, n}, -1.0, 1.0);
      const Pair dx = c.output({rows, n}), dgamma = c.output({n}, ct), dbeta = c.output({n}, ct);
      tested_kernel<kernels::LayerNormBackwardFn>(c)(
          x.tested, g, mean.tested, rstd.tested, dy.tested, dx.tested,
          affine ? dgamma.tested : Tensor(), affine ? dbeta.tested : Tensor());
      const auto mv = mean.tested.to(kFloat64).to_vector<double>(),
                 rv = rstd.tested.to(kFloat64).to_vector<double>(),
                 dyv = dy.ref.to_vector<double>();
      std::vector<double> rdx(static_cast<std::size_t>(rows * n)),
          rdg(static_cast<std::size_t>(n), 0.0), rdb(static_cast<std::size_t>(n), 0.0);
      for (int64_t r = 0; r < rows; ++r) {
        double sg = 0, sgx = 0;
        const double mu = mv[static_cast<std::size_t>(r)], rs = rv[static_cast<std::size_t>(r)];
        const auto xh = [&](int64_t j) {
          return (xv[static_cast<std::size_t>(r * n + j)] - mu) * rs;
        };
        const auto gg = [&](int64_t j) {
          return dyv[static_cast<std::size_t>(r * n + j)] *
                 (affine ? gv[static_cast<std::size_t>(j)] : 1.0);
        };
        for (int64_t j = 0; j < n; ++j) {
          sg += gg(j);
          sgx += gg(j) * xh(j);
          rdg[static_cast<std::size_t>(j)] += dyv[static_cast<std::size_t>(r * n + j)] * xh(j);
          rdb[static_cast<std::size_t>(j)] += dyv[static_cast<std::size_t>(r * n + j)];
        }
        for (int64_t j = 0; j < n; ++j)
          rdx[static_cast<std::size_t>(r * n + j)] =
              rs * (gg(j) - sg / static_cast<double>(n) - xh(j) * sgx / static_cast<double>(n));
      }
      // dx: the row's sums of n terms (absolute), times rstd (316 on the equal row: relative).
      c.expect_close(what + ", dx", dx.tested, from_vector(rdx, {rows, n}, kFloat64),
                     Scale{static_cast<double>(n) + 4.0, static_cast<double>(n) + 4.0});
      if (affine) {
        c.expect_close(what + ", dgamma", dgamma.tested, from_vector(rdg, {n}, kFloat64),
                       Scale{4.0 * static_cast<double>(rows), 0.0});
        c.expect_close(what + ", dbeta", dbeta.tested, from_vector(rdb, {n}, kFloat64),
                       Scale{static_cast<double>(rows), 0.0});
      }
    }
}

// --- Fused batch normalisation ----------------------------------------------------------------

// batch_norm and batch_norm_backward against the float64 formulas written out here: columns
// over 1 to 2000 rows (offset from 0, so that the mean matters), 1 to 130 of them, with and
// without gamma and beta, and a column of equal values (variance 0: the epsilon alone); with
// the batch's statistics and with given ones (inference).
void batch_norm(Context& c) {
  const bool backward = is(c, "BatchNormBackwardFn");
  const auto forward =
      find_kernel<kernels::BatchNormFn>(OpId::batch_norm, c.device().type(), c.dtype());
  const DType ct = c.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const double eps = 1e-3;
  const std::vector<std::pair<int64_t, int64_t>> shapes = {{1, 5},   {7, 3},    {64, 16},
                                                           {300, 1}, {33, 130}, {2000, 7}};
  for (const bool given : {false, true})
    for (const auto& [rows, n] : shapes)
      for (const bool affine : {false, true}) {
        const std::string what =
            fmt::format("{} rows of {}{}{}", rows, n, affine ? ", gamma and beta" : "",
                        given ? ", given statistics" : "");
        int64_t at = 0;
        const Pair x = c.make({rows, n}, [&] {
          return at++ % n == 0 && n > 1 ? 0.75 : 3.0 + c.uniform(-2.0, 2.0);  // column 0: equal
        });
        const Pair gamma = c.make(
            {n}, [&] { return c.uniform(0.5, 1.5); }, ct);
        const Pair beta = c.make(
            {n}, [&] { return c.uniform(-1.0, 1.0); }, ct);
        const Pair out = c.output({rows, n});
        const Pair mean = given ? c.make(
                                      {n}, [&] { return c.uniform(2.0, 4.0); }, ct)
                                : c.output({n}, ct);
        const Pair var = given ? c.make(
                                     {n}, [&] { return c.uniform(0.2, 2.0); }, ct)
                               : c.output({n}, ct);
        const Tensor g = affine ? gamma.tested : Tensor(), b = affine ? beta.tested : Tensor();
        forward(x.tested, g, b, eps, given, out.tested, mean.tested, var.tested);
        const auto xv = x.ref.to_vector<double>(), gv = gamma.ref.to_vector<double>(),
                   bv = beta.ref.to_vector<double>();
        const auto at_x = [&](int64_t r, int64_t j) {
          return xv[static_cast<std::size_t>(r * n + j)];
        };
        std::vector<double> ref_out(static_cast<std::size_t>(rows * n)),
            ref_mean(static_cast<std::size_t>(n)), ref_var(static_cast<std::size_t>(n));
        const auto given_mean = mean.ref.to_vector<double>(),
                   given_var = var.ref.to_vector<double>();
        for (int64_t j = 0; j < n; ++j) {
          double s = 0, v = 0;
          for (int64_t r = 0; r < rows; ++r) s += at_x(r, j);
          const double mu =
              given ? given_mean[static_cast<std::size_t>(j)] : s / static_cast<double>(rows);
          for (int64_t r = 0; r < rows; ++r) v += (at_x(r, j) - mu) * (at_x(r, j) - mu);
          const double var_j =
              given ? given_var[static_cast<std::size_t>(j)] : v / static_cast<double>(rows);
          const double rs = 1.0 / std::sqrt(var_j + eps);
          ref_mean[static_cast<std::size_t>(j)] = mu;
          ref_var[static_cast<std::size_t>(j)] = var_j;
          for (int64_t r = 0; r < rows; ++r) {
            double o = (at_x(r, j) - mu) * rs;
            if (affine) o = o * gv[static_cast<std::size_t>(j)] + bv[static_cast<std::size_t>(j)];
            ref_out[static_cast<std::size_t>(r * n + j)] = o;
          }
        }
        const Scale scale{8.0, 8.0};
        if (!backward) {
          c.expect_close(what + ", out", out.tested, from_vector(ref_out, {rows, n}, kFloat64),
                         scale);
          if (given) continue;  // read, not written
          c.expect_close(what + ", mean", mean.tested, from_vector(ref_mean, {n}, kFloat64), scale);
          c.expect_close(what + ", var", var.tested, from_vector(ref_var, {n}, kFloat64), scale);
          continue;
        }
        // The backward pass from the mean and var the kernel is given.
        const Pair dy = c.uniform({rows, n}, -1.0, 1.0);
        const Pair dx = c.output({rows, n}), dgamma = c.output({n}, ct), dbeta = c.output({n}, ct);
        tested_kernel<kernels::BatchNormBackwardFn>(c)(
            x.tested, g, mean.tested, var.tested, eps, given, dy.tested, dx.tested,
            affine ? dgamma.tested : Tensor(), affine ? dbeta.tested : Tensor());
        const auto mv = mean.tested.to(kFloat64).to_vector<double>(),
                   vv = var.tested.to(kFloat64).to_vector<double>(),
                   dyv = dy.ref.to_vector<double>();
        std::vector<double> rdx(static_cast<std::size_t>(rows * n)),
            rdg(static_cast<std::size_t>(n), 0.0), rdb(static_cast<std::size_t>(n), 0.0);
        for (int64_t j = 0; j < n; ++j) {
          const double mu = mv[static_cast<std::size_t>(j)];
          const double rs = 1.0 / std::sqrt(vv[static_cast<std::size_t>(j)] + eps);
          const double gm = affine ? gv[static_cast<std::size_t>(j)] : 1.0;
          const auto xh = [&](int64_t r) { return (at_x(r, j) - mu) * rs; };
          const auto d = [&](int64_t r) { return dyv[static_cast<std::size_t>(r * n + j)]; };
          double sb = 0, sg = 0;
          for (int64_t r = 0; r < rows; ++r) {
            sb += d(r);
            sg += d(r) * xh(r);
          }
          rdb[static_cast<std::size_t>(j)] = sb;
          rdg[static_cast<std::size_t>(j)] = sg;
          for (int64_t r = 0; r < rows; ++r)
            rdx[static_cast<std::size_t>(r * n + j)] =
                given ? gm * rs * d(r)
                      : gm * rs *
                            (d(r) - sb / static_cast<double>(rows) -
                             xh(r) * sg / static_cast<double>(rows));
        }
        // dx: the column's sums over the rows (absolute), times rstd (31.6 on the equal column).
        c.expect_close(what + ", dx", dx.tested, from_vector(rdx, {rows, n}, kFloat64),
                       Scale{64.0, 64.0});
        if (affine) {
          c.expect_close(what + ", dgamma", dgamma.tested, from_vector(rdg, {n}, kFloat64),
                         Scale{4.0 * static_cast<double>(rows), 0.0});
          c.expect_close(what + ", dbeta", dbeta.tested, from_vector(rdb, {n}, kFloat64),
                         Scale{static_cast<double>(rows), 0.0});
        }
      }
}

// --- Dropout -------------------------------------------------------------------------------------

// dropout against its formula written out here (kernels.h): x times 1 / (1 - rate) where
// dropout_keeps() keeps the element, 0 elsewhere (x * 0: NaN for a dropped NaN or infinity),
// at three rates and several sizes; which elements survive must match exactly, and the seed
// read from a device tensor must give the same bits as the seed given by value.
void dropout_cases(Context& c) {
  auto* fn = tested_kernel<kernels::DropoutFn>(c);
  for (const Shape& s : {Shape{1}, Shape{7}, Shape{3, 5}, Shape{1031}, Shape{70001}})
    for (const double rate : {0.1, 0.5, 0.9}) {
      const std::string what = fmt::format("shape {}, rate {}", shape_name(s), rate);
      const auto seed = static_cast<std::uint64_t>(c.integer(0, std::int64_t{1} << 62)) * 3 + 1;
      std::size_t i = 0;
      const auto& special = special_values();
      const Pair x = c.make(s, [&] {
        return i < special.size() && s.numel() > 1000 ? special[i++] : c.uniform(-2.0, 2.0);
      });
      const Pair out = c.output(s), again = c.output(s);
      fn(x.tested, rate, seed, Tensor(), out.tested);
      const std::vector<std::int64_t> bits{static_cast<std::int64_t>(seed)};  // the seed's bits
      const Tensor seed_at = from_vector<std::int64_t>(bits, Shape{1}, kInt64, c.device());
      fn(x.tested, rate, 0, seed_at, again.tested);
      const std::uint32_t threshold = dropout_threshold(rate);
      const auto xv = x.ref.to_vector<double>();
      std::vector<double> want(xv.size());
      std::vector<std::uint8_t> kept_want(xv.size()), kept_got(xv.size());
      const auto got = out.tested.to(kFloat64).to_vector<double>();
      for (std::size_t j = 0; j < xv.size(); ++j) {
        const bool keep = dropout_keeps(seed, j, threshold);
        want[j] = xv[j] * (keep ? 1.0 / (1.0 - rate) : 0.0);
        kept_want[j] = keep || !std::isfinite(xv[j]) || xv[j] == 0.0 ? 1 : 0;
        kept_got[j] = got[j] != 0.0 || !std::isfinite(xv[j]) || xv[j] == 0.0 ? 1 : 0;
      }
      c.expect_close(what, out.tested, from_vector(want, s, kFloat64));
      c.expect_equal(what + ", which survive", from_vector(kept_got, s, kUInt8),
                     from_vector(kept_want, s, kUInt8));
      c.expect_equal(what + ", the seed read from the device", again.tested, out.tested);
    }
}

// --- Fused softmax cross-entropy ---------------------------------------------------------------

// softmax_cross_entropy and its backward against the float64 formulas written out here: rows
// of 1, 10, 300 and 5000 classes, logits spread over [-8, 8] (so that the maximum matters).
void cross_entropy(Context& c) {
  const bool backward = is(c, "SoftmaxCrossEntropyBackwardFn");
  const auto forward = find_kernel<kernels::SoftmaxCrossEntropyFn>(OpId::softmax_cross_entropy,
                                                                   c.device().type(), c.dtype());
  const DType ct = c.dtype() == kFloat64 ? kFloat64 : kFloat32;
  for (const int64_t classes : {int64_t{1}, int64_t{10}, int64_t{300}, int64_t{5000}}) {
    const int64_t n = 6;
    const std::string what = fmt::format("{} rows of {} classes", n, classes);
    const Pair x = c.uniform({n, classes}, -8.0, 8.0);
    const Pair labels = c.indices({n}, 0, classes - 1);
    const Pair loss = c.output({n}, ct), lse = c.output({n}, ct);
    forward(x.tested, labels.tested, loss.tested, lse.tested);
    const auto xv = x.ref.to_vector<double>();
    const auto yv = labels.ref.to_vector<std::int64_t>();
    std::vector<double> ref_lse(static_cast<std::size_t>(n)), ref_loss(static_cast<std::size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      double m = -kInf, s = 0;
      for (int64_t j = 0; j < classes; ++j)
        m = std::max(m, xv[static_cast<std::size_t>(i * classes + j)]);
      for (int64_t j = 0; j < classes; ++j)
        s += std::exp(xv[static_cast<std::size_t>(i * classes + j)] - m);
      ref_lse[static_cast<std::size_t>(i)] = m + std::log(s);
      ref_loss[static_cast<std::size_t>(i)] =
          ref_lse[static_cast<std::size_t>(i)] -
          xv[static_cast<std::size_t>(i * classes + yv[static_cast<std::size_t>(i)])];
    }
    const Scale scale{static_cast<double>(classes) + 8.0, 0.0};
    if (!backward) {
      c.expect_close(what + ", loss", loss.tested, from_vector(ref_loss, {n}, kFloat64), scale);
      c.expect_close(what + ", lse", lse.tested, from_vector(ref_lse, {n}, kFloat64), scale);
      continue;
    }
    const Pair dloss = c.make(
        {n}, [&] { return c.uniform(-2.0, 2.0); }, ct);
    const Pair dx = c.output({n, classes});
    tested_kernel<kernels::SoftmaxCrossEntropyBackwardFn>(c)(x.tested, labels.tested, lse.tested,
                                                             dloss.tested, dx.tested);
    const auto given_lse = lse.tested.to(kFloat64).to_vector<double>();
    const auto gv = dloss.ref.to_vector<double>();
    std::vector<double> ref_dx(static_cast<std::size_t>(n * classes));
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < classes; ++j) {
        const auto at = static_cast<std::size_t>(i * classes + j);
        ref_dx[at] = gv[static_cast<std::size_t>(i)] *
                     (std::exp(xv[at] - given_lse[static_cast<std::size_t>(i)]) -
                      (j == yv[static_cast<std::size_t>(i)] ? 1.0 : 0.0));
      }
    c.expect_close(what + ", dlogits", dx.tested, from_vector(ref_dx, {n, classes}, kFloat64),
                   Scale{8.0, 0.0});
  }
}

// --- Indexing --------------------------------------------------------------------------------

struct IndexExtents {
  int64_t outer, n, k, inner;
};
const std::vector<IndexExtents>& index_cases() {
  static const std::vector<IndexExtents> cases{{1, 5, 3, 1}, {2, 7, 11, 3}, {3, 1, 4, 2},
                                               {0, 4, 2, 3}, {2, 3, 0, 5},  {1, 64, 300, 17}};
  return cases;
}

// gather / scatter_add (an index per element, [outer, k, inner]) and take / index_add (an
// index per row, [k]): the first of each pair moves elements (exact), the second adds them
// into its output (repeated indices add up). The four share one C++ signature.
void indexing(Context& c) {
  static_assert(std::is_same_v<kernels::GatherFn, kernels::TakeFn> &&
                std::is_same_v<kernels::ScatterAddFn, kernels::IndexAddFn>);
  const bool per_row = is(c, "TakeFn") || is(c, "IndexAddFn");
  const bool adds = is(c, "ScatterAddFn") || is(c, "IndexAddFn");
  for (const auto& e : index_cases()) {
    const Pair index =
        per_row ? c.indices({e.k}, 0, e.n - 1) : c.indices({e.outer, e.k, e.inner}, 0, e.n - 1);
    const std::string what =
        fmt::format("[outer {}, n {}, k {}, inner {}]", e.outer, e.n, e.k, e.inner);
    if (!adds) {
      const Pair x = c.uniform({e.outer, e.n, e.inner}, -3.0, 3.0);
      const Pair out = c.output({e.outer, e.k, e.inner});
      if (out.tested.numel() > 0) {
        tested_kernel<kernels::GatherFn>(c)(x.tested, index.tested, e.outer, e.n, e.k, e.inner,
                                            out.tested);
        reference_kernel<kernels::GatherFn>(c)(x.ref, index.ref, e.outer, e.n, e.k, e.inner,
                                               out.ref);
      }
      c.expect_equal(what, out.tested, out.ref);
    } else {
      // Accumulates into its output: both start from the same values.
      const Pair src = c.uniform({e.outer, e.k, e.inner}, -3.0, 3.0);
      const Pair out = c.uniform({e.outer, e.n, e.inner}, -3.0, 3.0);
      if (src.tested.numel() > 0) {
        tested_kernel<kernels::ScatterAddFn>(c)(src.tested, index.tested, e.outer, e.n, e.k,
                                                e.inner, out.tested);
        reference_kernel<kernels::ScatterAddFn>(c)(src.ref, index.ref, e.outer, e.n, e.k, e.inner,
                                                   out.ref);
      }
      c.expect_close(what, out.tested, out.ref, {3.0 * static_cast<double>(e.k + 1), 0.0});
    }
  }
}

// --- Matmul ------------------------------------------------------------------------------------

void gemm(Context& c) {
  struct Case {
    int64_t batch, m, n, k;
    bool ta, tb;
    int64_t pad;   // extra elements in every leading dimension
    bool share_b;  // one B for every batch item (batch stride 0)
  };
  const std::vector<Case> cases{
      {1, 1, 1, 1, false, false, 0, false},     {1, 7, 5, 3, false, false, 0, false},
      {1, 33, 17, 65, true, false, 2, false},   {1, 16, 24, 8, false, true, 0, false},
      {3, 9, 10, 11, true, true, 1, false},     {4, 5, 6, 7, false, false, 3, true},
      {1, 64, 64, 300, false, false, 0, false}, {2, 0, 5, 3, false, false, 0, false},
      {1, 1, 300, 1, true, true, 0, false},     {1, 128, 1, 50, false, true, 0, false}};
  for (const auto& cs : cases) {
    kernels::GemmArgs g, r;
    g.batch = cs.batch, g.m = cs.m, g.n = cs.n, g.k = cs.k;
    g.trans_a = cs.ta, g.trans_b = cs.tb;
    const int64_t rows_a = cs.ta ? cs.k : cs.m, cols_a = cs.ta ? cs.m : cs.k;
    const int64_t rows_b = cs.tb ? cs.n : cs.k, cols_b = cs.tb ? cs.k : cs.n;
    g.lda = cols_a + cs.pad, g.ldb = cols_b + cs.pad, g.ldc = cs.n + cs.pad;
    g.stride_a = rows_a * g.lda, g.stride_b = cs.share_b ? 0 : rows_b * g.ldb;
    g.stride_c = cs.m * g.ldc;
    auto count = [](int64_t n) { return std::max<int64_t>(n, 1); };
    const Pair a = c.uniform({count(cs.batch * g.stride_a)}, -1.0, 1.0);
    const Pair b = c.uniform({count((cs.share_b ? 1 : cs.batch) * rows_b * g.ldb)}, -1.0, 1.0);
    const Pair out = c.output({count(cs.batch * g.stride_c)});
    r = g;
    g.a = a.tested, g.b = b.tested, g.out = out.tested;
    r.a = a.ref, r.b = b.ref, r.out = out.ref;
    if (cs.m > 0 && cs.n > 0) {
      tested_kernel<kernels::GemmFn>(c)(g);
      reference_kernel<kernels::GemmFn>(c)(r);
    }
    // Compare the m x n matrices only (the gaps of ldc are not the kernel's).
    const Pair result = Context::view(out, {cs.batch, cs.m, cs.n}, Strides({g.stride_c, g.ldc, 1}));
    c.expect_close(
        fmt::format("batch {} [{}x{}] x [{}x{}]{}{}{}{}", cs.batch, cs.m, cs.k, cs.k, cs.n,
                    cs.ta ? " A^T" : "", cs.tb ? " B^T" : "",
                    cs.pad ? " (leading-dimension gaps)" : "", cs.share_b ? " (B shared)" : ""),
        result.tested.contiguous(), result.ref.contiguous(), {static_cast<double>(cs.k), 0.0});
  }
}

// scaled_matmul with the linear op's epilogue: out = act(scale_a scale_b a b_t^T + bias) and pre
// = the sum before the activation, against float64 (e4m3 x e4m3, the forward product of
// mixed_float8's Dense layers, and e5m2 x e4m3 when a is e5m2).
void scaled_matmul_epilogues(Context& c) {
  using kernels::LinearActivation;
  const DType b_dtype = kFloat8E4M3FN;
  const auto draw = [&c] { return static_cast<double>(c.integer(-400, 400)) / 100.0; };
  int number = 0;
  for (const DType out_dtype : {kFloat32, kBFloat16, kFloat16})
    for (const auto activation : {LinearActivation::none, LinearActivation::relu,
                                  LinearActivation::gelu, LinearActivation::gelu_tanh})
      for (const bool with_bias : {true, false}) {
        if (activation == LinearActivation::none && !with_bias) continue;  // no epilogue
        const int64_t m = number % 2 ? 7 : 33, n = 32, k = number % 2 ? 48 : 256;
        ++number;
        const Pair a = c.make({m, k}, draw), b = c.make({n, k}, draw, b_dtype);
        const double sa = 0.125,
                     sb = std::ldexp(1.0 + static_cast<double>(c.integer(0, 7)) / 8, -4);
        std::vector<double> bias_v(static_cast<std::size_t>(n));
        for (double& v : bias_v) v = c.uniform(-2.0, 2.0);
        const Tensor bias = from_vector(bias_v, {n}, out_dtype);  // (kernels.h: out's dtype)
        const Tensor out = full({m, n}, kNaN, out_dtype, c.device()),
                     pre = full({m, n}, kNaN, out_dtype, c.device());
        kernels::ScaledMatmulArgs g{.a = a.tested,
                                    .b_t = b.tested,
                                    .scale_a = full({1}, sa, kFloat32, c.device()),
                                    .scale_b = full({1}, sb, kFloat32, c.device()),
                                    .out = out,
                                    .m = m,
                                    .n = n,
                                    .k = k};
        if (with_bias) g.bias = bias.to(c.device());
        g.pre = pre;
        g.activation = activation;
        tested_kernel<kernels::ScaledMatmulFn>(c)(g);
        const std::vector<double> av = a.ref.to_vector<double>(),
                                  bv = b.ref.to(kFloat64).to_vector<double>(),
                                  bias_f = bias.to(kFloat64).to_vector<double>();
        std::vector<double> z(static_cast<std::size_t>(m * n)), y(z.size());
        double terms = 0.0;
        for (int64_t i = 0; i < m; ++i)
          for (int64_t j = 0; j < n; ++j) {
            double sum = 0.0, magnitude = 0.0;
            for (int64_t p = 0; p < k; ++p) {
              const double t =
                  av[static_cast<std::size_t>(i * k + p)] * bv[static_cast<std::size_t>(j * k + p)];
              sum += t;
              magnitude += std::fabs(t);
            }
            const auto at = static_cast<std::size_t>(i * n + j);
            z[at] = sum * sa * sb + (with_bias ? bias_f[static_cast<std::size_t>(j)] : 0.0);
            y[at] = linear_act(activation, z[at]);
            terms = std::max(terms, magnitude * sa * sb + 2.0);
          }
        // As scaled_matmul's plain cases: FP8 tensor cores' accumulation, 2^-13 of the terms.
        const double accumulation =
            c.device().is_cpu() ? terms : terms * std::max(1.0, 0x1p-13 / tolerance(out_dtype).acc);
        const std::string what = fmt::format(
            "{}[{}, {}] x {}[{}, {}]^T -> {}{}, activation {}", c.dtype(), m, k, b_dtype, n, k,
            out_dtype, with_bias ? " + bias" : "", static_cast<int>(activation));
        // A GPU kernel may round z to out's dtype before the activation (kernels.h; cuBLASLt's
        // BIAS epilogue writes it so): where the gelus' slope is steep against their value,
        // that moves out by more than its own rounding. There out is held to act(z rounded),
        // as in linear's cases.
        const Scale out_scale{1.2 * accumulation, 0.0};
        Tensor y_ref = from_vector(y, {m, n});
        if (!c.device().is_cpu() && out_dtype != kFloat32 && activation != LinearActivation::none &&
            !c.is_close(out, y_ref, out_scale)) {
          std::vector<double> y_rounded = rounded_to(z, out_dtype);
          for (auto& v : y_rounded) v = linear_act(activation, v);
          y_ref = from_vector(y_rounded, {m, n});
        }
        c.expect_close(what + ", out", out, y_ref, out_scale);
        c.expect_close(what + ", pre", pre, from_vector(z, {m, n}), {accumulation, 0.0});
        // Without pre, the same out (a GPU's z then goes through out itself).
        const Tensor out2 = full({m, n}, kNaN, out_dtype, c.device());
        g.out = out2;
        g.pre = Tensor();
        tested_kernel<kernels::ScaledMatmulFn>(c)(g);
        c.expect_close(what + ", out (no pre)", out2, y_ref, out_scale);
      }
}

// scaled_matmul: a (the dtype under test) and b_t (each float8 dtype, but not e5m2 x e5m2)
// against a float64 product of the same float8 values, scaled by the same float32 scales;
// shapes with k and n multiples of 16 (what FP8 tensor cores take).
void scaled_matmul(Context& c) {
  struct Case {
    int64_t m, n, k;
  };
  const std::vector<Case> cases{{1, 16, 16}, {7, 32, 48}, {33, 16, 256}, {64, 64, 1024}};
  // Values spread over the formats' binades: +-10 with two decimals, quantised by make.
  const auto draw = [&c] { return static_cast<double>(c.integer(-1000, 1000)) / 100.0; };
  for (const DType b_dtype : {kFloat8E4M3FN, kFloat8E5M2}) {
    if (c.dtype() == kFloat8E5M2 && b_dtype == kFloat8E5M2) continue;
    for (const DType out_dtype : {kFloat32, kBFloat16, kFloat16}) {
      for (const auto& cs : cases) {
        const Pair a = c.make({cs.m, cs.k}, draw);
        const Pair b = c.make({cs.n, cs.k}, draw, b_dtype);
        const double sa = std::ldexp(1.0 + static_cast<double>(c.integer(0, 7)) / 8, -3);
        const double sb = std::ldexp(1.0 + static_cast<double>(c.integer(0, 7)) / 8, 2);
        const Tensor scale_a = full({1}, sa, kFloat32, c.device());
        const Tensor scale_b = full({1}, sb, kFloat32, c.device());
        const Tensor out = full({cs.m, cs.n}, 0.0, out_dtype, c.device());
        tested_kernel<kernels::ScaledMatmulFn>(c)({.a = a.tested,
                                                   .b_t = b.tested,
                                                   .scale_a = scale_a,
                                                   .scale_b = scale_b,
                                                   .out = out,
                                                   .m = cs.m,
                                                   .n = cs.n,
                                                   .k = cs.k});
        // The reference: the float64 product of the stored values.
        const std::vector<double> av = a.ref.to_vector<double>(),
                                  bv = b.ref.to(kFloat64).to_vector<double>();
        std::vector<double> ref(static_cast<std::size_t>(cs.m * cs.n));
        double terms = 0.0;
        for (int64_t i = 0; i < cs.m; ++i)
          for (int64_t j = 0; j < cs.n; ++j) {
            double sum = 0.0, magnitude = 0.0;
            for (int64_t p = 0; p < cs.k; ++p) {
              const double t = av[static_cast<std::size_t>(i * cs.k + p)] *
                               bv[static_cast<std::size_t>(j * cs.k + p)];
              sum += t;
              magnitude += std::fabs(t);
            }
            ref[static_cast<std::size_t>(i * cs.n + j)] = sum * sa * sb;
            terms = std::max(terms, magnitude * sa * sb);
          }
        // FP8 tensor cores add a block of products in an accumulator narrower than float32
        // before each promotion to float32 (cuBLASLt promotes periodically with fast
        // accumulation off, not at every product; DeepSeek-V3's report measured about 14 bits
        // on Hopper): 2^-13 of the terms' magnitude is allowed there, not float32's
        // accumulation. The CPU's emulation sums in float32.
        const double accumulation =
            c.device().is_cpu() ? terms : terms * std::max(1.0, 0x1p-13 / tolerance(out_dtype).acc);
        c.expect_close(fmt::format("{}[{}, {}] x {}[{}, {}]^T -> {}", c.dtype(), cs.m, cs.k,
                                   b_dtype, cs.n, cs.k, out_dtype),
                       out, from_vector(ref, {cs.m, cs.n}), {accumulation, 0.0});
      }
    }
  }
  scaled_matmul_epilogues(c);
}

// quantize_float8: x (the dtype under test) against the CPU's float64 kernel on the same
// values, which widens x to float32 first: the same arithmetic, so the FP8 bytes (x's layout
// and its transpose), the scale, the amax and the rolled history must agree exactly. Both
// formats, current and delayed scaling (a history of zeros, of amaxes below and above x's,
// with a NaN), margins, an all-zero x, NaN and infinity in x, empty and odd shapes, shapes in
// 16s (the CUDA kernel's tiles of 64, with edges), x not 16-byte aligned, and more elements than
// the CUDA kernel's amax blocks cover in one pass.
void quantize_float8_cases(Context& c) {
  enum class Values { spread, zeros, special, infinite };
  enum class History { none, zeros, low, high, nan };
  struct Case {
    int64_t rows, cols;
    bool own, transposed;
    Values values;
    History history;
    int margin;
    bool update;
    int64_t offset = 0;  // x starts this many elements into its storage (unaligned)
  };
  const std::vector<Case> cases{{7, 300, true, false, Values::spread, History::none, 0, false, 1},
                                {7, 300, true, true, Values::spread, History::low, 0, true, 3},
                                {1, 1, true, false, Values::spread, History::none, 0, false},
                                {7, 33, true, true, Values::spread, History::none, 0, false},
                                {64, 96, false, true, Values::spread, History::none, 0, false},
                                {37, 70, true, true, Values::spread, History::low, 0, true},
                                {37, 70, true, false, Values::spread, History::high, 2, true},
                                {5, 300, true, true, Values::spread, History::zeros, 1, true},
                                {9, 16, true, true, Values::zeros, History::none, 0, false},
                                {9, 16, true, true, Values::zeros, History::high, 0, false},
                                {3, 40, true, true, Values::special, History::none, 0, false},
                                {3, 40, true, true, Values::infinite, History::none, 0, false},
                                {6, 20, true, false, Values::spread, History::nan, 0, true},
                                {0, 8, true, true, Values::spread, History::low, 0, true},
                                {8, 0, true, true, Values::spread, History::none, 0, false},
                                {1031, 300, true, true, Values::spread, History::low, 3, true},
                                // Dims in 16s, aligned: the CUDA kernel's 64 x 64 tiles, whole
                                // and cut at both edges; with NaN and infinities; unaligned.
                                {80, 208, true, true, Values::spread, History::low, 0, true},
                                {1040, 48, true, true, Values::spread, History::none, 1, false},
                                {16, 48, true, true, Values::special, History::none, 0, false},
                                {128, 64, false, true, Values::spread, History::high, 0, false},
                                {32, 48, true, true, Values::spread, History::none, 0, false, 1}};
  int number = 0;
  for (const DType format : {kFloat8E4M3FN, kFloat8E5M2})
    for (const Case& cs : cases) {
      int64_t i = 0;
      // Magnitudes over many binades: the formats' subnormals, normals and beyond their range.
      const Pair base = c.make({cs.rows * cs.cols + cs.offset}, [&]() -> double {
        const int64_t k = i++;
        if (cs.values == Values::zeros) return k % 3 == 0 ? -0.0 : 0.0;
        if (cs.values == Values::special && k < 3) return k == 0 ? kInf : k == 1 ? -kInf : kNaN;
        if (cs.values == Values::infinite && k == 5) return -kInf;
        return c.uniform(-1.0, 1.0) * std::ldexp(1.0, static_cast<int>(c.integer(-12, 12)));
      });
      const Pair x = Context::view(base, {cs.rows, cs.cols}, Strides({cs.cols, 1}), cs.offset);
      const int64_t length = 5;
      Tensor history, ref_history;
      if (cs.history != History::none) {
        std::vector<double> h(length, 0.0);
        for (int64_t j = 0; j < length; ++j) {
          if (cs.history == History::low) h[static_cast<std::size_t>(j)] = c.uniform(0.5, 2.0);
          if (cs.history == History::high) h[static_cast<std::size_t>(j)] = c.uniform(1e4, 2e4);
          if (cs.history == History::nan) h[static_cast<std::size_t>(j)] = j == 2 ? kNaN : 1.0;
        }
        ref_history = from_vector(h, {length}, kFloat32);
        history = from_vector(h, {length}, kFloat32, c.device());  // its own copy on the CPU too
      }
      const auto outputs = [&](Device d) {
        kernels::QuantizeFloat8Args a;
        if (cs.own) a.data = full({cs.rows, cs.cols}, 0.0, format, d);
        if (cs.transposed) a.data_t = full({cs.cols, cs.rows}, 0.0, format, d);
        a.scale = full({1}, kNaN, kFloat32, d);
        a.amax = full({1}, kNaN, kFloat32, d);
        a.rows = cs.rows, a.cols = cs.cols, a.margin = cs.margin, a.update = cs.update;
        return a;
      };
      kernels::QuantizeFloat8Args got = outputs(c.device()), want = outputs(Device::cpu());
      got.x = x.tested, got.history = history;
      want.x = x.ref, want.history = ref_history;
      tested_kernel<kernels::QuantizeFloat8Fn>(c)(got);
      reference_kernel<kernels::QuantizeFloat8Fn>(c)(want);
      const std::string what =
          fmt::format("case {}: [{}, {}] to {}", number++, cs.rows, cs.cols, format.name());
      if (cs.own) c.expect_equal(what + " data", got.data, want.data);
      if (cs.transposed) c.expect_equal(what + " data_t", got.data_t, want.data_t);
      c.expect_equal(what + " scale", got.scale, want.scale);
      c.expect_equal(what + " amax", got.amax, want.amax);
      if (history.defined()) c.expect_equal(what + " history", history, ref_history);
    }
}

// --- Convolution and pooling ------------------------------------------------------------------

struct Window {
  int64_t n, h, w, c, kh, kw, cout, sh, sw, pad_top, pad_left;
};
const std::vector<Window>& windows() {
  // (n, h, w, c, kh, kw, cout, strides, top/left padding): 'same' and 'valid', strides 1 to 3,
  // asymmetric padding, 1x1 and windows as large as the input.
  static const std::vector<Window> w{
      {2, 7, 6, 3, 3, 3, 4, 1, 1, 1, 1}, {1, 8, 8, 2, 3, 3, 5, 2, 2, 0, 0},
      {3, 5, 9, 4, 1, 1, 6, 1, 1, 0, 0}, {1, 9, 7, 3, 2, 3, 2, 3, 2, 0, 1},
      {2, 4, 4, 1, 4, 4, 3, 1, 1, 0, 0}, {1, 11, 10, 8, 5, 5, 16, 2, 2, 2, 2},
      {0, 5, 5, 2, 3, 3, 2, 1, 1, 1, 1}};
  return w;
}
int64_t extent(int64_t in, int64_t k, int64_t stride, int64_t pad) {
  // The output extent with `pad` on the leading side and as much as 'same' puts on the
  // trailing one (what TensorFlow's padding rules give for these geometries).
  const int64_t same = (in + stride - 1) / stride;
  return pad > 0 ? same : (in - k) / stride + 1;
}

kernels::Conv2dGeometry conv_geometry(const Window& w) {
  kernels::Conv2dGeometry g;
  g.n = w.n, g.h = w.h, g.w = w.w, g.c = w.c, g.kh = w.kh, g.kw = w.kw, g.cout = w.cout;
  g.oh = extent(w.h, w.kh, w.sh, w.pad_top), g.ow = extent(w.w, w.kw, w.sw, w.pad_left);
  g.stride_h = w.sh, g.stride_w = w.sw, g.pad_top = w.pad_top, g.pad_left = w.pad_left;
  return g;
}

std::string describe(const Window& w) {
  return fmt::format("x [{}, {}, {}, {}], window {}x{}, stride {}x{}, padding {}/{}", w.n, w.h, w.w,
                     w.c, w.kh, w.kw, w.sh, w.sw, w.pad_top, w.pad_left);
}

void conv(Context& c) {
  bool with_bias = false;  // every other geometry's forward pass adds a bias
  for (const Window& w : windows()) {
    const kernels::Conv2dGeometry g = conv_geometry(w);
    const Shape xs{g.n, g.h, g.w, g.c}, ws{g.kh, g.kw, g.c, g.cout}, ys{g.n, g.oh, g.ow, g.cout};
    std::string what = describe(w) + fmt::format(", {} filters", g.cout);
    if (is(c, "Conv2dFn")) {
      with_bias = !with_bias;
      const Pair x = c.uniform(xs, -1.0, 1.0), f = c.uniform(ws, -1.0, 1.0);
      const Pair b = with_bias ? c.uniform(Shape{g.cout}, -1.0, 1.0) : Pair{};
      if (with_bias) what += ", with a bias";
      const Pair out = c.output(ys);
      if (out.tested.numel() > 0) {  // the ops call kernels for non-empty outputs only
        tested_kernel<kernels::Conv2dFn>(c)(x.tested, f.tested, b.tested, out.tested, g);
        reference_kernel<kernels::Conv2dFn>(c)(x.ref, f.ref, b.ref, out.ref, g);
      }
      // The bias is one more term of each sum.
      c.expect_close(what, out.tested, out.ref,
                     {static_cast<double>(g.kh * g.kw * g.c + (with_bias ? 1 : 0)), 0.0});
    } else if (is(c, "Conv2dBackwardInputFn")) {
      const Pair dy = c.uniform(ys, -1.0, 1.0), f = c.uniform(ws, -1.0, 1.0);
      const Pair dx = c.output(xs);
      if (dx.tested.numel() > 0) {
        tested_kernel<kernels::Conv2dBackwardInputFn>(c)(dy.tested, f.tested, dx.tested, g);
        reference_kernel<kernels::Conv2dBackwardInputFn>(c)(dy.ref, f.ref, dx.ref, g);
      }
      c.expect_close(what, dx.tested, dx.ref, {static_cast<double>(g.kh * g.kw * g.cout), 0.0});
    } else {
      const Pair x = c.uniform(xs, -1.0, 1.0), dy = c.uniform(ys, -1.0, 1.0);
      const Pair dw = c.output(ws);  // written even for an empty batch (zeros)
      tested_kernel<kernels::Conv2dBackwardWeightFn>(c)(x.tested, dy.tested, dw.tested, g);
      reference_kernel<kernels::Conv2dBackwardWeightFn>(c)(x.ref, dy.ref, dw.ref, g);
      c.expect_close(what, dw.tested, dw.ref, {static_cast<double>(g.n * g.oh * g.ow), 0.0});
    }
  }
}

void pool(Context& c) {
  const bool backward = is(c, "Pool2dBackwardFn");
  for (const Window& w : windows()) {
    if (w.kh > w.h || w.kw > w.w) continue;
    kernels::Pool2dGeometry g;
    g.n = w.n, g.h = w.h, g.w = w.w, g.c = w.c, g.kh = w.kh, g.kw = w.kw;
    g.oh = extent(w.h, w.kh, w.sh, w.pad_top), g.ow = extent(w.w, w.kw, w.sw, w.pad_left);
    g.stride_h = w.sh, g.stride_w = w.sw, g.pad_top = w.pad_top, g.pad_left = w.pad_left;
    const Shape xs{g.n, g.h, g.w, g.c}, ys{g.n, g.oh, g.ow, g.c};
    // Few distinct values, so that a window's maximum is often tied (the first one wins).
    const Pair x = c.make(xs, [&] { return static_cast<double>(c.integer(-4, 4)) * 0.25; });
    const auto taps = static_cast<double>(g.kh * g.kw);
    if (!backward) {
      const Pair out = c.output(ys);
      if (out.tested.numel() > 0) {
        tested_kernel<kernels::Pool2dFn>(c)(x.tested, out.tested, g);
        reference_kernel<kernels::Pool2dFn>(c)(x.ref, out.ref, g);
      }
      c.expect_close(describe(w), out.tested, out.ref, {taps, 0.0});
    } else {
      const Pair dy = c.uniform(ys, -1.0, 1.0);
      const Pair dx = c.output(xs);
      if (dx.tested.numel() > 0) {
        tested_kernel<kernels::Pool2dBackwardFn>(c)(x.tested, dy.tested, dx.tested, g);
        reference_kernel<kernels::Pool2dBackwardFn>(c)(x.ref, dy.ref, dx.ref, g);
      }
      c.expect_close(describe(w), dx.tested, dx.ref, {taps, 0.0});
    }
  }
}

// --- Training --------------------------------------------------------------------------------

void unscale_check(Context& c) {
  auto* fn = tested_kernel<kernels::UnscaleCheckFn>(c);
  auto* ref = reference_kernel<kernels::UnscaleCheckFn>(c);
  struct Case {
    std::vector<Shape> shapes;
    double special;  // 0: all finite; NaN or inf: one element of the last gradient
  };
  const std::vector<Case> cases{{{{7}, {3, 5}, {0}, {1031}}, 0.0},
                                {{{4}, {70001}}, kInf},
                                {{{2, 3}, {9}}, kNaN},
                                {{{5}}, -kInf}};
  int number = 0;
  // Each case with the scale passed as a number and read from a float64 scalar on the device
  // (the number then unused), a power of two and a scale that is not a float32 value.
  struct ScaleCase {
    double value;
    bool on_device;
  };
  for (const ScaleCase scale : {ScaleCase{1.0 / 128.0, false}, ScaleCase{1.0 / 128.0, true},
                                ScaleCase{0.3, false}, ScaleCase{0.3, true}})
    for (const auto& cs : cases) {
      std::vector<Tensor> grads, outs, ref_grads, ref_outs;
      std::vector<Pair> separate;
      for (std::size_t i = 0; i < cs.shapes.size(); ++i) {
        Pair g = c.uniform(cs.shapes[i], -100.0, 100.0);
        if (cs.special != 0.0 && i + 1 == cs.shapes.size()) {
          std::vector<double> v = g.ref.to_vector<double>();
          v[v.size() / 2] = cs.special;
          std::size_t j = 0;
          g = c.make(cs.shapes[i], [&] { return v[j++]; });
        }
        grads.push_back(g.tested);
        ref_grads.push_back(g.ref);
        // Outputs: in place, into a separate tensor, or none.
        switch (i % 3) {
          case 0:
            outs.push_back(g.tested), ref_outs.push_back(g.ref);
            break;
          case 1:
            separate.push_back(c.output(cs.shapes[i]));
            outs.push_back(separate.back().tested), ref_outs.push_back(separate.back().ref);
            break;
          default:
            outs.emplace_back(), ref_outs.emplace_back();
        }
      }
      const Pair flag = c.make(
          {}, [] { return 0.0; }, kFloat32);
      const Tensor ref_flag = zeros({}, kFloat32);
      const Tensor scale_on_device = scale.on_device
                                         ? c.make(
                                                {}, [&] { return scale.value; }, kFloat64)
                                               .tested
                                         : Tensor();
      fn(grads, outs, scale.on_device ? 5.0 : scale.value, scale_on_device, flag.tested);
      ref(ref_grads, ref_outs, scale.value, Tensor(), ref_flag);
      const std::string what =
          fmt::format("case {} ({} gradients, scale {}{})", number++, cs.shapes.size(), scale.value,
                      scale.on_device ? " read on the device" : "");
      for (std::size_t i = 0; i < outs.size(); ++i)
        if (outs[i].defined())
          c.expect_close(what + fmt::format(", output {}", i), outs[i], ref_outs[i]);
      c.expect_equal(what + ", the non-finite flag", flag.tested, ref_flag);
    }
}

// The loss scale kept on the device, through a script of flags that grows it to its ceiling
// and drops it to its floor, against the rule written out here (kernels.h): the scale, its
// inverse and the count of good steps bit for bit after every step; then a fixed scale.
void loss_scale_update(Context& c) {
  auto* fn = tested_kernel<kernels::LossScaleUpdateFn>(c);
  struct Expected {
    double scale, inverse, good;
  };
  const auto run = [&](const std::string& name, const kernels::LossScaleRule& rule, double start,
                       const std::vector<float>& flags) {
    const auto scalar = [&](double v) {
      return c
          .make(
              {}, [v] { return v; }, kFloat64)
          .tested;
    };
    const Tensor scale = scalar(start), inverse = scalar(kNaN), good = scalar(0.0);
    Expected e{start, 1.0 / start, 0.0};
    for (std::size_t i = 0; i < flags.size(); ++i) {
      if (flags[i] != 0.0f) {
        e.good = 0.0;
        if (rule.dynamic) e.scale = std::max(e.scale / rule.multiplier, rule.min_scale);
      } else if (rule.dynamic && ++e.good == static_cast<double>(rule.growth_interval)) {
        e.scale = std::min(e.scale * rule.multiplier, rule.max_scale);
        e.good = 0.0;
      }
      e.inverse = 1.0 / e.scale;
      fn(c.make(
              {}, [f = flags[i]] { return f; }, kFloat32)
             .tested,
         scale, inverse, good, rule);
      const std::string what = fmt::format("{}, step {}", name, i);
      const auto value = [](double v) { return from_vector(std::vector<double>{v}, {}, kFloat64); };
      c.expect_equal(what + ", scale", scale, value(e.scale));
      c.expect_equal(what + ", inverse", inverse, value(e.inverse));
      c.expect_equal(what + ", good steps", good, value(e.good));
    }
  };
  const std::vector<float> flags = {0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0};
  run("dynamic",
      {.dynamic = true,
       .multiplier = 3.0,
       .min_scale = 0.75,
       .max_scale = 1000.0,
       .growth_interval = 2},
      48.0, flags);
  run("fixed", {.dynamic = false, .max_scale = 1000.0}, 1000.0, flags);
}

// Global-norm clipping's kernels over lists that cross the CUDA backend's chunks of 128
// tensors and its blocks: sum_squares against float64 sums of the stored values (added to an
// out that is not 0, and the same bits when called again), scale_list against the float64
// products, in place and into separate outputs.
void clip_lists(Context& c) {
  const bool squares = is(c, "SumSquaresFn");
  const std::vector<std::vector<Shape>> cases{
      {{7}, {3, 5}, {0}, {1031}}, {{70001}, {4}}, std::vector<Shape>(130, Shape{33}), {{1}}};
  int number = 0;
  for (const auto& shapes : cases) {
    std::vector<Tensor> xs, ref_xs;
    for (const Shape& shape : shapes) {
      const Pair x = c.uniform(shape, -3.0, 3.0);
      xs.push_back(x.tested);
      ref_xs.push_back(x.ref);
    }
    const std::string what = fmt::format("case {} ({} tensors)", number++, shapes.size());
    if (squares) {
      double sum = 0.5, terms = 1;
      for (const Tensor& r : ref_xs)
        for (const double v : r.to_vector<double>()) sum += v * v, ++terms;
      const auto out = [&] {
        return c
            .make(
                {}, [] { return 0.5; }, kFloat64)
            .tested;
      };
      const Tensor first = out(), again = out();
      tested_kernel<kernels::SumSquaresFn>(c)(xs, first);
      tested_kernel<kernels::SumSquaresFn>(c)(xs, again);
      c.expect_close(what, first, from_vector(std::vector<double>{sum}, {}, kFloat64),
                     Scale{terms, 0.0});
      c.expect_equal(what + ", called again", again, first);
      continue;
    }
    const double f = 0.3 + c.uniform(0.0, 1.0);
    const Tensor factor = c.make(
                               {}, [f] { return f; }, kFloat64)
                              .tested;
    std::vector<Tensor> outs, refs;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      outs.push_back(i % 2 == 0 ? xs[i] : c.output(xs[i].shape()).tested);  // in place, or not
      std::vector<double> v = ref_xs[i].to_vector<double>();
      for (double& e : v) e *= f;
      refs.push_back(from_vector(v, ref_xs[i].shape(), kFloat64));
    }
    tested_kernel<kernels::ScaleListFn>(c)(xs, outs, factor);
    for (std::size_t i = 0; i < outs.size(); ++i)
      c.expect_close(what + fmt::format(", tensor {}", i), outs[i], refs[i]);
  }
}

// cast_list: lists crossing the CUDA chunks of 128 tensors widened to float32 (where that is
// at least as wide) and to float64, exactly.
void cast_list(Context& c) {
  const std::vector<std::vector<Shape>> cases{{{7}, {3, 5}, {0}, {1031}},
                                              std::vector<Shape>(130, Shape{9})};
  int number = 0;
  for (const auto& shapes : cases)
    for (const DType to : {kFloat32, kFloat64}) {
      if (to == kFloat32 && c.dtype() == kFloat64) continue;
      std::vector<Tensor> xs, outs;
      std::vector<Pair> pairs;
      for (const Shape& shape : shapes) {
        pairs.push_back(c.uniform(shape, -60000.0, 60000.0));
        xs.push_back(pairs.back().tested);
        outs.push_back(c.output(shape, to).tested);
      }
      tested_kernel<kernels::CastListFn>(c)(xs, outs);
      for (std::size_t i = 0; i < xs.size(); ++i)
        c.expect_equal(fmt::format("case {} to {}, tensor {}", number, to.name(), i), outs[i],
                       pairs[i].ref.to(to));
      ++number;
    }
}

void optimizer(Context& c) {
  auto* fn = tested_kernel<kernels::OptimizerUpdateFn>(c);
  auto* ref = reference_kernel<kernels::OptimizerUpdateFn>(c);
  // Slots are float64 for float64 variables, float32 for every other.
  const DType slot = c.dtype() == kFloat64 ? kFloat64 : kFloat32;
  struct Variant {
    std::string name;
    double momentum, weight_decay;
    bool nesterov, centered, amsgrad;
  };
  std::vector<Variant> variants;
  if (c.op() == OpId::sgd_update)
    variants = {{"plain", 0.0, 0.0, false, false, false},
                {"momentum", 0.9, 0.0, false, false, false},
                {"nesterov", 0.9, 0.0, true, false, false}};
  else if (c.op() == OpId::rmsprop_update)
    variants = {{"plain", 0.0, 0.0, false, false, false},
                {"momentum", 0.5, 0.0, false, false, false},
                {"centered", 0.0, 0.0, false, true, false},
                {"centered momentum", 0.5, 0.0, false, true, false}};
  else
    variants = {{"adam", 0.0, 0.0, false, false, false},
                {"amsgrad", 0.0, 0.0, false, false, true},
                {"adamw", 0.0, 0.004, false, false, false}};
  // Every variant updates a list of variables in one call, as a step does (kernels.h): four
  // shapes (one empty), then 45 small ones, more than one launch's worth on a GPU.
  std::vector<Shape> shapes{{7}, {3, 5}, {0}, {4099}};
  for (int i = 0; i < 45; ++i) shapes.push_back(Shape{5 + i % 3});
  int copies = 0;
  // Each variant also with global-norm clipping's factor read by the update (grad_scale).
  const std::size_t plain = variants.size();
  for (std::size_t i = 0; i < plain; ++i) {
    variants.push_back(variants[i]);
    variants.back().name += ", gradients scaled";
  }
  for (const auto& v : variants) {
    const bool scaled = &v - variants.data() >= static_cast<std::ptrdiff_t>(plain);
    const Tensor factor = full({}, 0.3728, kFloat64, c.device()),
                 factor_ref = full({}, 0.3728, kFloat64, Device::cpu());
    struct Entry {
      Pair var, s1, s2, s3, ms;
      kernels::OptimizerUpdate u, r;
      bool use1, use2, use3;
      std::string what;
    };
    std::vector<Entry> entries;
    for (const Shape& shape : shapes) {
      Entry e{c.uniform(shape, -1.0, 1.0),
              // Slots that hold what a few steps would: mean squares >= 0, max >= the mean
              // square.
              c.make(
                  shape, [&] { return c.uniform(-0.1, 0.1); }, slot),
              c.make(
                  shape, [&] { return c.uniform(0.0, 0.01); }, slot),
              c.make(
                  shape, [&] { return c.uniform(0.01, 0.02); }, slot),
              c.make(
                  shape, [&] { return c.uniform(0.02, 0.04); }, slot),
              {},
              {},
              false,
              false,
              false,
              fmt::format("{}, shape {}", v.name, shape_name(shape))};
      const Pair grad = c.uniform(shape, -1.0, 1.0);
      kernels::OptimizerUpdate& u = e.u;
      kernels::OptimizerUpdate& r = e.r;
      u.lr = 0.01, u.beta1 = 0.9, u.beta2 = 0.999, u.epsilon = 1e-7;
      if (c.op() == OpId::rmsprop_update) u.beta2 = 0.9;
      u.momentum = v.momentum, u.weight_decay = v.weight_decay, u.step = 3;
      u.nesterov = v.nesterov, u.centered = v.centered, u.amsgrad = v.amsgrad;
      r = u;
      u.var = e.var.tested, u.grad = grad.tested, r.var = e.var.ref, r.grad = grad.ref;
      // Scaled: the reference reads the product the kernel rounds (kernels.h: computed in the
      // slot dtype, rounded to grad's dtype), the float64 kernel the factor itself.
      if (scaled) {
        u.grad_scale = factor;
        if (c.dtype() == kFloat64)
          r.grad_scale = factor_ref;
        else
          r.grad = cast(cast(cast(grad.ref, kFloat32) * cast(factor_ref, kFloat32), c.dtype()),
                        kFloat64);
      }
      const bool rms = c.op() == OpId::rmsprop_update, adam = c.op() == OpId::adam_update;
      // Which slots the variant uses (kernels.h): sgd's velocity with momentum; rmsprop's
      // mean square, momentum buffer and mean gradient; adam's m, v and max v.
      e.use1 = adam || rms || v.momentum > 0.0;
      e.use2 = adam || (rms && v.momentum > 0.0);
      e.use3 = (adam && v.amsgrad) || (rms && v.centered);
      const Pair& first = rms ? e.ms : e.s1;
      if (e.use1) u.slot1 = first.tested, r.slot1 = first.ref;
      // Every slot its own tensor, as an optimizer's are (the kernels may assume they do not
      // overlap): rmsprop's momentum buffer s2, its mean gradient s1.
      if (e.use2) u.slot2 = e.s2.tested, r.slot2 = e.s2.ref;
      const Pair& third = rms ? e.s1 : e.s3;
      if (e.use3) u.slot3 = third.tested, r.slot3 = third.ref;
      // float32 variables: the 16-bit copy written beside the update (kernels.h), float16
      // and bfloat16 by turns; unwritten elements show as NaN.
      if (c.dtype() == kFloat32)
        u.copy = c.output(shape, copies++ % 2 == 0 ? kFloat16 : kBFloat16).tested;
      entries.push_back(std::move(e));
    }
    std::vector<kernels::OptimizerUpdate> us, rs;
    for (const Entry& e : entries) us.push_back(e.u), rs.push_back(e.r);
    fn(us);
    ref(rs);
    for (const Entry& e : entries) {
      c.expect_close(e.what + ", the variable", e.var.tested, e.var.ref);
      if (e.use1) c.expect_close(e.what + ", slot 1", e.u.slot1, e.r.slot1);
      if (e.use2) c.expect_close(e.what + ", slot 2", e.u.slot2, e.r.slot2);
      if (e.use3) c.expect_close(e.what + ", slot 3", e.u.slot3, e.r.slot3);
      // The updated variable (as the kernel left it, in float64) rounded to the copy's dtype.
      if (e.u.copy.defined())
        c.expect_equal(e.what + ", the 16-bit copy", e.u.copy,
                       e.var.tested.to(Device::cpu()).to(kFloat64));
    }
  }
}

// --- Memory ------------------------------------------------------------------------------------

void copy(Context& c) {
  auto* fn = tested_kernel<kernels::CopyFn>(c);
  auto* ref = reference_kernel<kernels::CopyFn>(c);
  auto draw = [&] { return c.dtype() == kBool ? c.integer(0, 1) : c.uniform(-100.0, 100.0); };
  const Pair base = c.make({6, 5, 4}, draw);
  struct View {
    std::string name;
    Shape shape;
    Strides strides;
    int64_t offset;
  };
  const std::vector<View> views{{"contiguous", {6, 5, 4}, Strides({20, 4, 1}), 0},
                                {"transposed", {4, 5, 6}, Strides({1, 4, 20}), 0},
                                {"every other row", {3, 5, 4}, Strides({40, 4, 1}), 20},
                                {"broadcast", {6, 3, 4}, Strides({20, 0, 1}), 4},
                                {"empty", {0, 4}, Strides({4, 1}), 0},
                                {"scalar", {}, Strides(std::vector<int64_t>{}), 7}};
  for (const auto& v : views) {
    const Pair src = Context::view(base, v.shape, v.strides, v.offset);
    const Pair out = c.output(v.shape);
    if (v.shape.numel() > 0) {
      fn(src.tested, out.tested);
      ref(src.ref, out.ref);
    }
    c.expect_equal(v.name, out.tested, out.ref);
  }
}

void fill(Context& c) {
  auto* fn = tested_kernel<kernels::FillFn>(c);
  auto* ref = reference_kernel<kernels::FillFn>(c);
  std::vector<double> values{0.0, 1.0};
  if (c.dtype().is_floating()) values.insert(values.end(), {-2.5, 65504.0, 1e10, kInf, kNaN});
  if (c.dtype().is_integral()) values.insert(values.end(), {-3.0, 100.0});
  for (double v : values) {
    for (const Shape& s : std::vector<Shape>{{}, {0}, {1031}, {3, 7}}) {
      const Pair out = c.output(s);
      if (s.numel() > 0) {
        fn(out.tested, v);
        ref(out.ref, v);
      }
      c.expect_equal(fmt::format("value {}, shape {}", v, shape_name(s)), out.tested, out.ref);
    }
  }
}

void cast(Context& c) {
  auto* fn = tested_kernel<kernels::CastFn>(c);
  // Floating sources are compared with the cast from float64; integer and bool sources with
  // the cast from int64 (docs/dtypes.md: integers narrow by wrapping, floats saturate, so
  // float64 is not their reference; float8 values are exact in float64).
  const DType ref_source = c.dtype().is_floating() || c.dtype().is_float8() ? kFloat64 : kInt64;
  const auto ref = find_kernel<kernels::CastFn>(OpId::cast, DeviceType::CPU, ref_source);
  // Values of the source dtype: ordinary ones, halves (rounding ties), the integer types'
  // limits, and for floats special values and magnitudes beyond 16 bits.
  std::vector<double> special;
  switch (c.dtype().code()) {
    case DType::Bool:
      special = {0, 1};
      break;
    case DType::UInt8:
      special = {0, 1, 127, 128, 255};
      break;
    case DType::Int32:
      special = {0, -1, 255, 256, -129, 2147483647.0, -2147483648.0, 65505, 16777217};
      break;
    case DType::Int64:
      special = {0, -1, 255, 256, 2147483648.0, -2147483649.0, 9007199254740991.0, 16777217};
      break;
    default:
      special = {kNaN,  kInf,   -kInf,   0.0,     -0.0, 0.5, -0.5, 1.5,  2.5, 255.5,
                 256.0, -129.0, 65504.0, 65520.0, 7e4,  3e9, -3e9, 1e-8, 3e38};
  }
  const bool small = c.dtype() == kBool || c.dtype() == kUInt8;
  for (int target = 0; target < DType::kCount; ++target) {
    const DType to = DType::all()[target];
    std::size_t i = 0;
    const auto n = static_cast<int64_t>(special.size()) + 1031;
    const Pair x = c.make({n}, [&]() -> double {
      if (i < special.size()) return special[i++];
      return small ? static_cast<double>(c.integer(0, c.dtype() == kBool ? 1 : 255))
                   : c.uniform(-300.0, 300.0);
    });
    // The reference's output is `to` too.
    const Tensor out = full({n}, 0.0, to, c.device());
    const Tensor ref_out = zeros({n}, to);
    fn(x.tested, out);
    ref(x.ref.dtype() == ref_source ? x.ref : x.ref.to(ref_source), ref_out);
    c.expect_equal(fmt::format("to {}", to.name()), out, ref_out);
  }
}

using Driver = void (*)(Context&);

Driver driver_for(OpId op) {
  const std::string_view k = op_info(op).kernel;
  if (k == "UnaryFn") return unary;
  if (k == "BinaryFn") return binary;
  if (k == "WhereFn") return where;
  if (k == "ReduceFn") return reduce;
  if (k == "RowFn") return rows;
  if (k == "MaskedSoftmaxFn") return masked_rows;
  if (k == "AttentionFn" || k == "AttentionBackwardFn") return attention;
  if (k == "LayerNormFn" || k == "LayerNormBackwardFn") return layer_norm;
  if (k == "BatchNormFn" || k == "BatchNormBackwardFn") return batch_norm;
  if (k == "DropoutFn") return dropout_cases;
  if (k == "LinearFn" || k == "LinearBackwardFn") return linear;
  if (k == "SoftmaxCrossEntropyFn" || k == "SoftmaxCrossEntropyBackwardFn") return cross_entropy;
  if (k == "GatherFn" || k == "ScatterAddFn" || k == "TakeFn" || k == "IndexAddFn") return indexing;
  if (k == "GemmFn") return gemm;
  if (k == "ScaledMatmulFn") return scaled_matmul;
  if (k == "QuantizeFloat8Fn") return quantize_float8_cases;
  if (k == "Conv2dFn" || k == "Conv2dBackwardInputFn" || k == "Conv2dBackwardWeightFn") return conv;
  if (k == "Pool2dFn" || k == "Pool2dBackwardFn") return pool;
  if (k == "UnscaleCheckFn") return unscale_check;
  if (k == "LossScaleUpdateFn") return loss_scale_update;
  if (k == "SumSquaresFn" || k == "ScaleListFn") return clip_lists;
  if (k == "CastListFn") return cast_list;
  if (k == "OptimizerUpdateFn") return optimizer;
  if (k == "CopyFn") return copy;
  if (k == "FillFn") return fill;
  if (k == "CastFn") return cast;
  return nullptr;
}

}  // namespace

bool has_driver(OpId op) { return driver_for(op) != nullptr; }

void run_cases(Context& c) { driver_for(c.op())(c); }

}  // namespace mixtape::conformance
