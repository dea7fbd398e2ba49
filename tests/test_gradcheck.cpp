// Numeric gradient checks (float64) for every differentiable op in mixtape/autograd/ops.h.
#include <fmt/ranges.h>

#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gradcheck.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using mtest::Inputs;
using mtest::rand64;
using mtest::randn64;

namespace {

const mt::Shape kScalar{};

// Broadcasting pairs for the binary ops: same shape, both directions, and scalars.
struct ShapePair {
  mt::Shape a, b;
};
const std::vector<ShapePair> kBroadcastPairs = {
    {{3, 4}, {3, 4}},    {{3, 4}, {4}},       {{4}, {3, 4}},     {{3, 1}, {1, 4}},
    {{2, 3, 4}, {3, 1}}, {{1, 4}, {2, 3, 1}}, {kScalar, {3, 4}}, {{3, 4}, kScalar},
};

}  // namespace

TEST_CASE("gradcheck: add / sub / mul / div with broadcasting", "[grad]") {
  std::uint64_t seed = 100;
  for (const auto& sp : kBroadcastPairs) {
    const auto a = randn64(sp.a, ++seed);
    const auto b = randn64(sp.b, ++seed);
    const auto bpos = rand64(sp.b, 0.5, 2.0, ++seed);
    const std::string shapes = sp.a.str() + " . " + sp.b.str();
    CHECK_GRADCHECK("add " + shapes, [](const Inputs& v) { return mt::add(v[0], v[1]); }, {a, b});
    CHECK_GRADCHECK("sub " + shapes, [](const Inputs& v) { return mt::sub(v[0], v[1]); }, {a, b});
    CHECK_GRADCHECK("mul " + shapes, [](const Inputs& v) { return mt::mul(v[0], v[1]); }, {a, b});
    CHECK_GRADCHECK("div " + shapes, [](const Inputs& v) { return mt::div(v[0], v[1]); },
                    {a, bpos});
    CHECK_GRADCHECK("operator+ " + shapes, [](const Inputs& v) { return v[0] + v[1]; }, {a, b});
    CHECK_GRADCHECK("operator- " + shapes, [](const Inputs& v) { return v[0] - v[1]; }, {a, b});
    CHECK_GRADCHECK("operator* " + shapes, [](const Inputs& v) { return v[0] * v[1]; }, {a, b});
    CHECK_GRADCHECK("operator/ " + shapes, [](const Inputs& v) { return v[0] / v[1]; }, {a, bpos});
  }
}

TEST_CASE("gradcheck: the same tensor on both sides of a binary op", "[grad]") {
  const auto x = randn64({3, 4}, 7);
  CHECK_GRADCHECK("mul(x, x)", [](const Inputs& v) { return mt::mul(v[0], v[0]); }, {x});
  CHECK_GRADCHECK("sub(x, x*x)", [](const Inputs& v) { return mt::sub(v[0], v[0] * v[0]); }, {x});
  const auto p = rand64({3, 4}, 0.5, 2.0, 8);
  CHECK_GRADCHECK("div(x, x+1)", [](const Inputs& v) { return mt::div(v[0], v[0] + 1.0); }, {p});
}

TEST_CASE("gradcheck: maximum / minimum", "[grad]") {
  const std::vector<ShapePair> pairs = {
      {{3, 4}, {3, 4}}, {{3, 4}, {4}}, {{3, 1}, {1, 4}}, {kScalar, {2, 3}}};
  std::uint64_t seed = 200;
  for (const auto& sp : pairs) {
    const auto a = mtest::grid64(sp.a, 0.0, ++seed);
    const auto b = mtest::grid64(sp.b, 0.1, ++seed);
    const std::string shapes = sp.a.str() + " . " + sp.b.str();
    CHECK_GRADCHECK("maximum " + shapes, [](const Inputs& v) { return mt::maximum(v[0], v[1]); },
                    {a, b});
    CHECK_GRADCHECK("minimum " + shapes, [](const Inputs& v) { return mt::minimum(v[0], v[1]); },
                    {a, b});
  }
}

TEST_CASE("gradcheck: pow", "[grad]") {
  std::uint64_t seed = 300;
  for (const auto& sp : kBroadcastPairs) {
    const auto base = rand64(sp.a, 0.5, 2.0, ++seed);
    const auto expo = rand64(sp.b, -1.5, 1.5, ++seed);
    CHECK_GRADCHECK("pow(tensor, tensor) " + sp.a.str() + " . " + sp.b.str(),
                    [](const Inputs& v) { return mt::pow(v[0], v[1]); }, {base, expo});
  }
  const auto base = rand64({3, 4}, 0.5, 2.0, 310);
  for (double e : {2.0, 3.0, 0.5, -1.5, 1.0, 0.0}) {
    CHECK_GRADCHECK(fmt::format("pow(tensor, {})", e),
                    [e](const Inputs& v) { return mt::pow(v[0], e); }, {base});
  }
}

TEST_CASE("gradcheck: operators with double scalars on both sides", "[grad]") {
  const auto x = randn64({2, 3}, 400);
  const auto p = rand64({2, 3}, 0.5, 2.0, 401);
  CHECK_GRADCHECK("x + 2.5", [](const Inputs& v) { return v[0] + 2.5; }, {x});
  CHECK_GRADCHECK("x - 2.5", [](const Inputs& v) { return v[0] - 2.5; }, {x});
  CHECK_GRADCHECK("x * 2.5", [](const Inputs& v) { return v[0] * 2.5; }, {x});
  CHECK_GRADCHECK("x / 2.5", [](const Inputs& v) { return v[0] / 2.5; }, {x});
  CHECK_GRADCHECK("2.5 + x", [](const Inputs& v) { return 2.5 + v[0]; }, {x});
  CHECK_GRADCHECK("2.5 - x", [](const Inputs& v) { return 2.5 - v[0]; }, {x});
  CHECK_GRADCHECK("2.5 * x", [](const Inputs& v) { return 2.5 * v[0]; }, {x});
  CHECK_GRADCHECK("2.5 / x", [](const Inputs& v) { return 2.5 / v[0]; }, {p});
  CHECK_GRADCHECK("-x", [](const Inputs& v) { return -v[0]; }, {x});
  CHECK_GRADCHECK("scalar tensor * 3", [](const Inputs& v) { return v[0] * 3.0; },
                  {randn64(kScalar, 402)});
}

TEST_CASE("gradcheck: unary math", "[grad]") {
  const mt::Shape s{3, 4};
  const auto x = randn64(s, 500);
  const auto pos = rand64(s, 0.3, 2.5, 501);
  const auto nz = mtest::away_from_zero(s, 0.1, 2.0, 502);
  const auto small = rand64(s, -2.5, 2.5, 503);
  CHECK_GRADCHECK("neg", [](const Inputs& v) { return mt::neg(v[0]); }, {x});
  CHECK_GRADCHECK("abs", [](const Inputs& v) { return mt::abs(v[0]); }, {nz});
  CHECK_GRADCHECK("exp", [](const Inputs& v) { return mt::exp(v[0]); }, {small});
  CHECK_GRADCHECK("log", [](const Inputs& v) { return mt::log(v[0]); }, {pos});
  CHECK_GRADCHECK("sqrt", [](const Inputs& v) { return mt::sqrt(v[0]); }, {pos});
  CHECK_GRADCHECK("rsqrt", [](const Inputs& v) { return mt::rsqrt(v[0]); }, {pos});
  CHECK_GRADCHECK("square", [](const Inputs& v) { return mt::square(v[0]); }, {x});
  CHECK_GRADCHECK("tanh", [](const Inputs& v) { return mt::tanh(v[0]); }, {small});
  CHECK_GRADCHECK("sigmoid", [](const Inputs& v) { return mt::sigmoid(v[0]); }, {small});
  CHECK_GRADCHECK("relu", [](const Inputs& v) { return mt::relu(v[0]); }, {nz});
  CHECK_GRADCHECK("gelu", [](const Inputs& v) { return mt::gelu(v[0]); }, {small});
  CHECK_GRADCHECK("gelu_tanh", [](const Inputs& v) { return mt::gelu_tanh(v[0]); }, {small});
  CHECK_GRADCHECK("erf", [](const Inputs& v) { return mt::erf(v[0]); }, {small});
  // On non-contiguous operands.
  const auto y = randn64({4, 3}, 504);
  CHECK_GRADCHECK("exp(transpose)", [](const Inputs& v) { return mt::exp(mt::transpose(v[0])); },
                  {y});
  CHECK_GRADCHECK("tanh(slice step 2)",
                  [](const Inputs& v) { return mt::tanh(mt::slice(v[0], 0, 0, 4, 2)); }, {y});
  // A composition (chain rule through several unary ops).
  CHECK_GRADCHECK(
      "log(1 + exp(sigmoid(x) * tanh(x)))",
      [](const Inputs& v) { return mt::log(1.0 + mt::exp(mt::sigmoid(v[0]) * mt::tanh(v[0]))); },
      {small});
}

TEST_CASE("gradcheck: where", "[grad]") {
  const std::vector<bool> c = {true,  false, true, true,  false, false,
                               false, true,  true, false, true,  false};
  const auto cond = mt::from_vector(c, {3, 4});
  const auto a = randn64({3, 4}, 600);
  const auto b = randn64({3, 4}, 601);
  CHECK_GRADCHECK("where", [cond](const Inputs& v) { return mt::where(cond, v[0], v[1]); }, {a, b});
  // Broadcasting: cond [3, 1], a [3, 4], b [4]; and b a scalar.
  const auto cond31 = mt::from_vector(std::vector<bool>{true, false, true}, {3, 1});
  CHECK_GRADCHECK("where broadcast cond[3,1] a[3,4] b[4]",
                  [cond31](const Inputs& v) { return mt::where(cond31, v[0], v[1]); },
                  {a, randn64({4}, 602)});
  CHECK_GRADCHECK("where broadcast a[1,4] b[]",
                  [cond](const Inputs& v) { return mt::where(cond, v[0], v[1]); },
                  {randn64({1, 4}, 603), randn64(kScalar, 604)});
  // A condition computed from a comparison (not differentiable itself).
  const auto x = mtest::away_from_zero({3, 4}, 0.1, 2.0, 605);
  CHECK_GRADCHECK("where(x > 0, x*x, -x)",
                  [](const Inputs& v) {
                    const auto zero = mt::zeros_like(v[0]);
                    return mt::where(mt::greater(v[0], zero), v[0] * v[0], -v[0]);
                  },
                  {x});
}

TEST_CASE("gradcheck: sum / mean", "[grad]") {
  const auto x = randn64({2, 3, 4}, 700);
  const std::vector<std::vector<int>> axes_list = {{}, {0}, {1}, {-1}, {0, 2}, {1, -1}, {0, 1, 2}};
  for (const auto& axes : axes_list) {
    for (bool keep : {false, true}) {
      const std::string tag = fmt::format("axes {{{}}} keepdims {}", fmt::join(axes, ","), keep);
      CHECK_GRADCHECK("sum " + tag,
                      [axes, keep](const Inputs& v) { return mt::sum(v[0], axes, keep); }, {x});
      CHECK_GRADCHECK("mean " + tag,
                      [axes, keep](const Inputs& v) { return mt::mean(v[0], axes, keep); }, {x});
    }
  }
  CHECK_GRADCHECK("sum of transpose axis 0",
                  [](const Inputs& v) { return mt::sum(mt::transpose(v[0], 0, 2), {0}); }, {x});
}

TEST_CASE("gradcheck: max / min reductions (distinct values)", "[grad]") {
  const auto x = mtest::distinct64({2, 3, 4}, 800);
  const std::vector<std::vector<int>> axes_list = {{}, {0}, {1}, {-1}, {0, 2}};
  for (const auto& axes : axes_list) {
    for (bool keep : {false, true}) {
      const std::string tag = fmt::format("axes {{{}}} keepdims {}", fmt::join(axes, ","), keep);
      CHECK_GRADCHECK("max " + tag,
                      [axes, keep](const Inputs& v) { return mt::max(v[0], axes, keep); }, {x});
      CHECK_GRADCHECK("min " + tag,
                      [axes, keep](const Inputs& v) { return mt::min(v[0], axes, keep); }, {x});
    }
  }
}

TEST_CASE("gradcheck: sum_to", "[grad]") {
  const auto x = randn64({2, 3, 4}, 900);
  const std::vector<mt::Shape> targets = {{3, 4},    {3, 1}, {4},     {1, 3, 4},
                                          {2, 1, 4}, {1},    kScalar, {2, 3, 4}};
  for (const auto& t : targets) {
    CHECK_GRADCHECK("sum_to " + t.str(), [t](const Inputs& v) { return mt::sum_to(v[0], t); }, {x});
  }
}

TEST_CASE("gradcheck: softmax / log_softmax", "[grad]") {
  const auto x = randn64({3, 5}, 1000);
  const auto x3 = randn64({2, 3, 4}, 1001);
  for (int axis : {-1, 0, 1}) {
    CHECK_GRADCHECK(fmt::format("softmax [3,5] axis {}", axis),
                    [axis](const Inputs& v) { return mt::softmax(v[0], axis); }, {x});
    CHECK_GRADCHECK(fmt::format("log_softmax [3,5] axis {}", axis),
                    [axis](const Inputs& v) { return mt::log_softmax(v[0], axis); }, {x});
  }
  for (int axis : {0, 1, -1}) {
    CHECK_GRADCHECK(fmt::format("softmax [2,3,4] axis {}", axis),
                    [axis](const Inputs& v) { return mt::softmax(v[0], axis); }, {x3});
    CHECK_GRADCHECK(fmt::format("log_softmax [2,3,4] axis {}", axis),
                    [axis](const Inputs& v) { return mt::log_softmax(v[0], axis); }, {x3});
  }
  // Large logits: the stable formulation must keep finite gradients.
  const auto big = randn64({2, 4}, 1002) * 30.0 + 100.0;
  CHECK_GRADCHECK("log_softmax large logits",
                  [](const Inputs& v) { return mt::log_softmax(v[0], -1); }, {big});
}

TEST_CASE("gradcheck: masked_softmax (no mask, a padding mask, a causal mask)", "[grad]") {
  const auto x = randn64({2, 3, 4, 5}, 1003);
  CHECK_GRADCHECK("masked_softmax no mask, scale 0.7",
                  [](const Inputs& v) { return mt::masked_softmax(v[0], mt::Tensor(), 0.7); }, {x});
  // [batch, 1, 1, keys]: the last two keys of batch 1 padded; broadcast over heads, queries.
  std::vector<std::uint8_t> pad(10, 1);
  pad[8] = pad[9] = 0;
  const mt::Tensor padding = mt::from_vector(pad, {2, 1, 1, 5}).to(mt::kBool);
  CHECK_GRADCHECK("masked_softmax padding mask",
                  [padding](const Inputs& v) { return mt::masked_softmax(v[0], padding, 0.5); },
                  {x});
  // Causal over [queries 4, keys 5] (query i sees keys <= i + 1), broadcast over batch and
  // heads; and a mask with a wholly masked row (its gradient is 0).
  std::vector<std::uint8_t> causal(20), holes(20);
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 5; ++j) {
      causal[static_cast<std::size_t>(i * 5 + j)] = j <= i + 1;
      holes[static_cast<std::size_t>(i * 5 + j)] = i != 2 && (i + j) % 3 != 0;
    }
  const mt::Tensor causal_mask = mt::from_vector(causal, {4, 5}).to(mt::kBool);
  const mt::Tensor hole_mask = mt::from_vector(holes, {4, 5}).to(mt::kBool);
  CHECK_GRADCHECK(
      "masked_softmax causal mask",
      [causal_mask](const Inputs& v) { return mt::masked_softmax(v[0], causal_mask, 1.3); }, {x});
  CHECK_GRADCHECK("masked_softmax a wholly masked row",
                  [hole_mask](const Inputs& v) { return mt::masked_softmax(v[0], hole_mask); },
                  {x});
  CHECK_GRADGRADCHECK(
      "masked_softmax causal mask",
      [causal_mask](const Inputs& v) { return mt::masked_softmax(v[0], causal_mask, 1.3); },
      {randn64({2, 4, 5}, 1004)});
}

TEST_CASE("gradcheck: cast float64 -> float32 -> float64", "[grad]") {
  // Numeric differences through float32 are too coarse for eps = 1e-6, so this checks the
  // analytic gradient directly: d/dx sum(cast(cast(x)) * R) = R (to float32 precision).
  const auto x = mtest::clone_f64(randn64({3, 4}, 1100));
  const auto r = randn64({3, 4}, 1101);
  mt::GradientTape tape;
  tape.watch(x);
  const auto mid = mt::cast(x, mt::kFloat32);
  CHECK(mid.dtype() == mt::kFloat32);
  const auto y = mt::cast(mid, mt::kFloat64);
  CHECK(y.dtype() == mt::kFloat64);
  const auto g = tape.gradient(mt::sum(y * r), x);
  REQUIRE(g.defined());
  CHECK(g.dtype() == mt::kFloat64);
  CHECK(g.shape() == x.shape());
  const auto gv = g.to_vector<double>();
  const auto rv = r.to_vector<double>();
  for (std::size_t i = 0; i < gv.size(); ++i) CHECK(gv[i] == Approx(rv[i]).epsilon(1e-6));

  // With a larger step the numeric check works through float32 too.
  mtest::GradCheckOptions coarse;
  coarse.eps = 1e-2;
  coarse.atol = 1e-4;
  coarse.rtol = 1e-3;
  CHECK_GRADCHECK(
      "cast f64->f32->f64 (coarse)",
      [](const Inputs& v) { return mt::cast(mt::cast(v[0], mt::kFloat32) * 2.0, mt::kFloat64); },
      {x}, coarse);
  // A float64 -> float64 cast is the identity.
  CHECK_GRADCHECK("cast f64->f64", [](const Inputs& v) { return mt::cast(v[0], mt::kFloat64); },
                  {x});
  CHECK_GRADCHECK("Tensor::to(float64)", [](const Inputs& v) { return v[0].to(mt::kFloat64); },
                  {x});
}

TEST_CASE("gradcheck: shape ops", "[grad]") {
  const auto x = randn64({2, 3, 4}, 1200);
  CHECK_GRADCHECK("reshape [6,4]", [](const Inputs& v) { return mt::reshape(v[0], {6, 4}); }, {x});
  CHECK_GRADCHECK("reshape [-1,2]",
                  [](const Inputs& v) {
                    return mt::reshape(v[0], {-1, 2});
                  },
                  {x});
  CHECK_GRADCHECK("reshape [24]", [](const Inputs& v) { return v[0].reshape({24}); }, {x});
  CHECK_GRADCHECK("reshape of a transposed view",
                  [](const Inputs& v) {
                    return mt::reshape(mt::transpose(v[0]), {2, 12});
                  },
                  {x});
  CHECK_GRADCHECK("permute {2,0,1}",
                  [](const Inputs& v) {
                    return mt::permute(v[0], {2, 0, 1});
                  },
                  {x});
  CHECK_GRADCHECK("permute {1,2,0} method",
                  [](const Inputs& v) {
                    return v[0].permute({1, 2, 0});
                  },
                  {x});
  CHECK_GRADCHECK("transpose default", [](const Inputs& v) { return mt::transpose(v[0]); }, {x});
  CHECK_GRADCHECK("transpose (0, 2)", [](const Inputs& v) { return mt::transpose(v[0], 0, 2); },
                  {x});
  const auto y = randn64({5, 6}, 1201);
  CHECK_GRADCHECK("slice axis 1 [0:6:2]",
                  [](const Inputs& v) { return mt::slice(v[0], 1, 0, 6, 2); }, {y});
  CHECK_GRADCHECK("slice axis 0 [1:5:2]",
                  [](const Inputs& v) { return mt::slice(v[0], 0, 1, 5, 2); }, {y});
  CHECK_GRADCHECK("slice axis -1 [2:5]", [](const Inputs& v) { return mt::slice(v[0], -1, 2, 5); },
                  {y});
  CHECK_GRADCHECK("slice of slice",
                  [](const Inputs& v) { return mt::slice(mt::slice(v[0], 0, 1, 5), 1, 1, 6, 2); },
                  {y});
  const auto c = randn64({3, 1}, 1202);
  CHECK_GRADCHECK("expand [3,1]->[2,3,4]",
                  [](const Inputs& v) {
                    return mt::expand(v[0], {2, 3, 4});
                  },
                  {c});
  CHECK_GRADCHECK("expand [4]->[3,4]",
                  [](const Inputs& v) {
                    return mt::expand(v[0], {3, 4});
                  },
                  {randn64({4}, 1203)});
  CHECK_GRADCHECK("expand []->[2,2]",
                  [](const Inputs& v) {
                    return v[0].expand({2, 2});
                  },
                  {randn64(kScalar, 1204)});
  const auto s = randn64({3, 1, 4}, 1205);
  CHECK_GRADCHECK("squeeze axis 1", [](const Inputs& v) { return mt::squeeze(v[0], 1); }, {s});
  CHECK_GRADCHECK("squeeze axis -2", [](const Inputs& v) { return mt::squeeze(v[0], -2); }, {s});
  const auto u = randn64({3, 4}, 1206);
  CHECK_GRADCHECK("unsqueeze axis 0", [](const Inputs& v) { return mt::unsqueeze(v[0], 0); }, {u});
  CHECK_GRADCHECK("unsqueeze axis 1", [](const Inputs& v) { return mt::unsqueeze(v[0], 1); }, {u});
  CHECK_GRADCHECK("unsqueeze axis -1", [](const Inputs& v) { return mt::unsqueeze(v[0], -1); },
                  {u});
  CHECK_GRADCHECK("flatten default", [](const Inputs& v) { return mt::flatten(v[0]); }, {x});
  CHECK_GRADCHECK("flatten start 0", [](const Inputs& v) { return mt::flatten(v[0], 0); }, {x});
  CHECK_GRADCHECK("flatten of a permuted view",
                  [](const Inputs& v) {
                    return mt::flatten(mt::permute(v[0], {0, 2, 1}));
                  },
                  {x});
  CHECK_GRADCHECK("contiguous of a transposed view",
                  [](const Inputs& v) { return mt::contiguous(mt::transpose(v[0], 0, 1)); }, {x});
  CHECK_GRADCHECK("contiguous of a contiguous tensor",
                  [](const Inputs& v) { return v[0].contiguous(); }, {x});
}

TEST_CASE("gradcheck: concat", "[grad]") {
  const auto a = randn64({2, 3}, 1300);
  const auto b = randn64({1, 3}, 1301);
  const auto c = randn64({3, 3}, 1302);
  CHECK_GRADCHECK("concat axis 0",
                  [](const Inputs& v) {
                    return mt::concat({v[0], v[1], v[2]}, 0);
                  },
                  {a, b, c});
  const auto d = randn64({2, 1}, 1303);
  const auto e = randn64({2, 4}, 1304);
  CHECK_GRADCHECK("concat axis 1",
                  [](const Inputs& v) {
                    return mt::concat({v[0], v[1], v[2]}, 1);
                  },
                  {a, d, e});
  CHECK_GRADCHECK("concat axis -1 with a transposed view",
                  [](const Inputs& v) {
                    return mt::concat({v[0], mt::transpose(v[1])}, -1);
                  },
                  {a, randn64({3, 2}, 1305)});
  CHECK_GRADCHECK("concat the same tensor twice",
                  [](const Inputs& v) {
                    return mt::concat({v[0], v[0]}, 0);
                  },
                  {a});
  CHECK_GRADCHECK("concat rank 3 axis 1",
                  [](const Inputs& v) {
                    return mt::concat({v[0], v[1]}, 1);
                  },
                  {randn64({2, 2, 3}, 1306), randn64({2, 1, 3}, 1307)});
}

TEST_CASE("gradcheck: matmul", "[grad]") {
  auto mm = [](const Inputs& v) { return mt::matmul(v[0], v[1]); };
  CHECK_GRADCHECK("matmul [3,4]x[4,5]", mm, {randn64({3, 4}, 1400), randn64({4, 5}, 1401)});
  CHECK_GRADCHECK("matmul [1,1]x[1,1]", mm, {randn64({1, 1}, 1402), randn64({1, 1}, 1403)});
  CHECK_GRADCHECK("matmul batched [2,3,4]x[2,4,5]", mm,
                  {randn64({2, 3, 4}, 1404), randn64({2, 4, 5}, 1405)});
  CHECK_GRADCHECK("matmul broadcast [2,3,4]x[4,5]", mm,
                  {randn64({2, 3, 4}, 1406), randn64({4, 5}, 1407)});
  CHECK_GRADCHECK("matmul broadcast [3,4]x[2,4,5]", mm,
                  {randn64({3, 4}, 1408), randn64({2, 4, 5}, 1409)});
  CHECK_GRADCHECK("matmul broadcast [2,1,3,4]x[3,4,2]", mm,
                  {randn64({2, 1, 3, 4}, 1410), randn64({3, 4, 2}, 1411)});
  CHECK_GRADCHECK("matmul transpose(a) [4,3]^T x [4,5]",
                  [](const Inputs& v) { return mt::matmul(mt::transpose(v[0]), v[1]); },
                  {randn64({4, 3}, 1412), randn64({4, 5}, 1413)});
  CHECK_GRADCHECK("matmul a x transpose(b) [3,4] x [5,4]^T",
                  [](const Inputs& v) { return mt::matmul(v[0], mt::transpose(v[1])); },
                  {randn64({3, 4}, 1414), randn64({5, 4}, 1415)});
  CHECK_GRADCHECK(
      "matmul both transposed",
      [](const Inputs& v) { return mt::matmul(mt::transpose(v[0]), mt::transpose(v[1])); },
      {randn64({4, 3}, 1416), randn64({5, 4}, 1417)});
  CHECK_GRADCHECK("matmul batched transposed [2,4,3]^T x [2,5,4]^T",
                  [](const Inputs& v) { return mt::matmul(v[0].transpose(), v[1].transpose()); },
                  {randn64({2, 4, 3}, 1418), randn64({2, 5, 4}, 1419)});
  CHECK_GRADCHECK("matmul x with itself (x x^T)",
                  [](const Inputs& v) { return mt::matmul(v[0], mt::transpose(v[0])); },
                  {randn64({3, 4}, 1420)});
  CHECK_GRADCHECK("matmul of a sliced operand",
                  [](const Inputs& v) { return mt::matmul(mt::slice(v[0], 1, 0, 8, 2), v[1]); },
                  {randn64({3, 8}, 1421), randn64({4, 2}, 1422)});
}

TEST_CASE("gradcheck: gather", "[grad]") {
  const auto x = randn64({3, 5}, 1500);
  // Duplicated indices check the accumulation in the backward (scatter_add).
  const auto idx_last =
      mt::from_vector(std::vector<std::int64_t>{0, 4, 2, 2, 1, 3, 3, 3, 0}, {3, 3});
  CHECK_GRADCHECK("gather axis -1",
                  [idx_last](const Inputs& v) { return mt::gather(v[0], idx_last, -1); }, {x});
  const auto idx0 =
      mt::from_vector(std::vector<std::int64_t>{0, 1, 2, 2, 0, 2, 2, 1, 0, 0}, {2, 5});
  CHECK_GRADCHECK("gather axis 0", [idx0](const Inputs& v) { return mt::gather(v[0], idx0, 0); },
                  {x});
  const auto idx32 = mt::from_vector(std::vector<std::int32_t>{1, 1, 0, 4, 2, 3}, {3, 2});
  CHECK_GRADCHECK("gather axis 1 int32 index",
                  [idx32](const Inputs& v) { return mt::gather(v[0], idx32, 1); }, {x});
  const auto x3 = randn64({2, 4, 3}, 1501);
  const auto idx3 =
      mt::from_vector(std::vector<std::int64_t>{3, 0, 1, 1, 1, 2, 0, 3, 3, 2, 0, 0}, {2, 2, 3});
  CHECK_GRADCHECK("gather rank 3 axis 1",
                  [idx3](const Inputs& v) { return mt::gather(v[0], idx3, 1); }, {x3});
}

TEST_CASE("gradcheck: conv2d", "[grad]") {
  struct Case {
    mt::Shape x, w;
    std::array<std::int64_t, 2> strides;
    mt::Padding padding;
  };
  const std::vector<Case> cases = {
      {{1, 5, 5, 2}, {3, 3, 2, 3}, {1, 1}, mt::Padding::Valid},
      {{1, 5, 5, 2}, {3, 3, 2, 3}, {1, 1}, mt::Padding::Same},
      {{2, 6, 6, 2}, {3, 3, 2, 2}, {2, 2}, mt::Padding::Valid},
      {{2, 6, 6, 2}, {3, 3, 2, 2}, {2, 2}, mt::Padding::Same},
      {{1, 5, 5, 1}, {3, 3, 1, 2}, {2, 2}, mt::Padding::Same},
      {{1, 4, 4, 2}, {2, 2, 2, 1}, {1, 1}, mt::Padding::Same},
      {{1, 5, 4, 1}, {3, 2, 1, 2}, {2, 1}, mt::Padding::Same},
      {{1, 5, 4, 2}, {1, 1, 2, 3}, {1, 1}, mt::Padding::Valid},
      {{2, 3, 3, 3}, {3, 3, 3, 2}, {1, 1}, mt::Padding::Valid},
  };
  std::uint64_t seed = 1600;
  for (const auto& c : cases) {
    const auto x = randn64(c.x, ++seed);
    const auto w = randn64(c.w, ++seed);
    const std::string name =
        fmt::format("conv2d x{} w{} strides {}x{} {}", c.x.str(), c.w.str(), c.strides[0],
                    c.strides[1], c.padding == mt::Padding::Same ? "same" : "valid");
    CHECK_GRADCHECK(name,
                    [c](const Inputs& v) { return mt::conv2d(v[0], v[1], c.strides, c.padding); },
                    {x, w});
    // The bias added in the convolution's kernel.
    const auto b = randn64({c.w[3]}, ++seed);
    CHECK_GRADCHECK(
        name + " with a bias",
        [c](const Inputs& v) { return mt::conv2d(v[0], v[1], v[2], c.strides, c.padding); },
        {x, w, b});
  }
}

TEST_CASE("gradcheck: max_pool2d / avg_pool2d", "[grad]") {
  struct Case {
    mt::Shape x;
    std::array<std::int64_t, 2> pool, strides;
    mt::Padding padding;
  };
  const std::vector<Case> cases = {
      {{1, 4, 4, 2}, {2, 2}, {2, 2}, mt::Padding::Valid},
      {{1, 5, 5, 1}, {2, 2}, {2, 2}, mt::Padding::Valid},
      {{1, 5, 5, 1}, {2, 2}, {2, 2}, mt::Padding::Same},
      {{2, 4, 4, 2}, {3, 3}, {1, 1}, mt::Padding::Valid},
      {{1, 4, 4, 2}, {3, 3}, {1, 1}, mt::Padding::Same},
      {{1, 5, 4, 2}, {3, 2}, {2, 1}, mt::Padding::Same},
  };
  std::uint64_t seed = 1700;
  for (const auto& c : cases) {
    const auto x = mtest::distinct64(c.x, ++seed);
    const std::string tag =
        fmt::format("x{} pool {}x{} strides {}x{} {}", c.x.str(), c.pool[0], c.pool[1],
                    c.strides[0], c.strides[1], c.padding == mt::Padding::Same ? "same" : "valid");
    CHECK_GRADCHECK(
        "max_pool2d " + tag,
        [c](const Inputs& v) { return mt::max_pool2d(v[0], c.pool, c.strides, c.padding); }, {x});
    CHECK_GRADCHECK(
        "avg_pool2d " + tag,
        [c](const Inputs& v) { return mt::avg_pool2d(v[0], c.pool, c.strides, c.padding); }, {x});
  }
  // Pooling after a convolution (chained NHWC ops).
  CHECK_GRADCHECK(
      "max_pool2d(conv2d)",
      [](const Inputs& v) {
        return mt::max_pool2d(mt::conv2d(v[0], v[1], {1, 1}, mt::Padding::Same), {2, 2}, {2, 2});
      },
      {mtest::distinct64({1, 4, 4, 1}, 1750), randn64({1, 1, 1, 2}, 1751)});
}

TEST_CASE("gradcheck: a small network (matmul, bias, gelu, log_softmax, gather)", "[grad]") {
  const auto x = randn64({4, 3}, 1800);
  const auto w = randn64({3, 5}, 1801);
  const auto b = randn64({5}, 1802);
  const auto labels = mt::from_vector(std::vector<std::int64_t>{1, 4, 0, 2}, {4, 1});
  CHECK_GRADCHECK("mlp loss",
                  [labels](const Inputs& v) {
                    const auto h = mt::gelu(mt::matmul(v[0], v[1]) + v[2]);
                    const auto lp = mt::log_softmax(h, -1);
                    return -mt::mean(mt::gather(lp, labels, 1));
                  },
                  {x, w, b});
}

// The checker itself: a wrong backward rule, a missing gradient and an exception must
// all be reported.
namespace {
mt::Tensor cube_with_backward(const mt::Tensor& x, int variant) {
  mt::Tensor out;
  {
    mt::NoGradGuard guard;
    out = x * x * x;
  }
  if (mt::should_record({x})) {
    mt::record_op("test_cube", {x}, out,
                  [x, variant](const mt::Tensor& go, const std::vector<bool>&) {
                    std::vector<mt::Tensor> g(1);
                    if (variant == 0) g[0] = go * 3.0 * x * x;  // right
                    if (variant == 1) g[0] = go * 2.0 * x * x;  // wrong values
                    if (variant == 2) g[0] = mt::Tensor();      // missing
                    return g;
                  });
  }
  return out;
}
}  // namespace

TEST_CASE("gradcheck: the checker reports wrong gradients", "[grad]") {
  const auto x = randn64({2, 3}, 1900);
  auto run = [&](int variant) {
    return mtest::gradcheck(
        "test_cube", [variant](const Inputs& v) { return cube_with_backward(v[0], variant); }, {x});
  };
  const auto good = run(0);
  INFO(good.report);
  CHECK(good.ok);
  const auto wrong = run(1);
  CHECK_FALSE(wrong.ok);
  CHECK_THAT(wrong.report, Catch::Matchers::Contains("test_cube") &&
                               Catch::Matchers::Contains("input 0") &&
                               Catch::Matchers::Contains("worst element"));
  const auto missing = run(2);
  CHECK_FALSE(missing.ok);
  CHECK_THAT(missing.report, Catch::Matchers::Contains("undefined"));
  const auto throws =
      mtest::gradcheck("thrower", [](const Inputs& v) { return mt::matmul(v[0], v[0]); }, {x});
  CHECK_FALSE(throws.ok);
  CHECK_THAT(throws.report, Catch::Matchers::Contains("threw"));
}

TEST_CASE("gradcheck: second order (backward rules are differentiable)", "[grad]") {
  const auto a = randn64({3, 4}, 2000);
  const auto b = randn64({4}, 2001);
  const auto pos = rand64({3, 4}, 0.5, 2.0, 2002);
  const auto small = rand64({3, 4}, -2.0, 2.0, 2003);
  const auto nz = mtest::away_from_zero({3, 4}, 0.1, 2.0, 2004);
  CHECK_GRADGRADCHECK("mul broadcast", [](const Inputs& v) { return mt::mul(v[0], v[1]); }, {a, b});
  CHECK_GRADGRADCHECK("div", [](const Inputs& v) { return mt::div(v[0], v[1]); }, {a, pos});
  CHECK_GRADGRADCHECK("scalar / x", [](const Inputs& v) { return 2.0 / v[0]; }, {pos});
  CHECK_GRADGRADCHECK("pow(tensor, tensor)", [](const Inputs& v) { return mt::pow(v[0], v[1]); },
                      {pos, small});
  CHECK_GRADGRADCHECK("pow(x, 3)", [](const Inputs& v) { return mt::pow(v[0], 3.0); }, {pos});
  CHECK_GRADGRADCHECK("maximum", [](const Inputs& v) { return mt::maximum(v[0] * v[0], v[1]); },
                      {mtest::grid64({3, 4}, 0.0, 2005), mtest::grid64({3, 4}, 0.1, 2006)});
  CHECK_GRADGRADCHECK("abs(x)*x", [](const Inputs& v) { return mt::abs(v[0]) * v[0]; }, {nz});
  CHECK_GRADGRADCHECK("exp", [](const Inputs& v) { return mt::exp(v[0]); }, {small});
  CHECK_GRADGRADCHECK("log", [](const Inputs& v) { return mt::log(v[0]); }, {pos});
  CHECK_GRADGRADCHECK("sqrt", [](const Inputs& v) { return mt::sqrt(v[0]); }, {pos});
  CHECK_GRADGRADCHECK("rsqrt", [](const Inputs& v) { return mt::rsqrt(v[0]); }, {pos});
  CHECK_GRADGRADCHECK("square", [](const Inputs& v) { return mt::square(v[0]); }, {a});
  CHECK_GRADGRADCHECK("tanh", [](const Inputs& v) { return mt::tanh(v[0]); }, {small});
  CHECK_GRADGRADCHECK("sigmoid", [](const Inputs& v) { return mt::sigmoid(v[0]); }, {small});
  CHECK_GRADGRADCHECK("relu(x)*x", [](const Inputs& v) { return mt::relu(v[0]) * v[0]; }, {nz});
  CHECK_GRADGRADCHECK("gelu", [](const Inputs& v) { return mt::gelu(v[0]); }, {small});
  CHECK_GRADGRADCHECK("gelu_tanh", [](const Inputs& v) { return mt::gelu_tanh(v[0]); }, {small});
  CHECK_GRADGRADCHECK("erf", [](const Inputs& v) { return mt::erf(v[0]); }, {small});
  CHECK_GRADGRADCHECK("mean(x^2, axis 1)",
                      [](const Inputs& v) { return mt::mean(v[0] * v[0], {1}, true); }, {a});
  CHECK_GRADGRADCHECK("max(x, axis 0) * x",
                      [](const Inputs& v) { return mt::max(v[0], {0}, true) * v[0]; },
                      {mtest::distinct64({3, 4}, 2007)});
  CHECK_GRADGRADCHECK("softmax", [](const Inputs& v) { return mt::softmax(v[0], -1); }, {a});
  CHECK_GRADGRADCHECK("log_softmax axis 0",
                      [](const Inputs& v) { return mt::log_softmax(v[0], 0); }, {a});
  CHECK_GRADGRADCHECK("matmul", [](const Inputs& v) { return mt::matmul(v[0], v[1]); },
                      {randn64({2, 3, 4}, 2008), randn64({4, 2}, 2009)});
  CHECK_GRADGRADCHECK("where",
                      [](const Inputs& v) {
                        return mt::square(mt::where(mt::greater(v[0], v[1]), v[0] * v[1], v[1]));
                      },
                      {mtest::grid64({3, 4}, 0.0, 2010), mtest::grid64({3, 4}, 0.1, 2011)});
  CHECK_GRADGRADCHECK(
      "shape ops",
      [](const Inputs& v) {
        const auto t = mt::transpose(mt::reshape(v[0], {4, 3}));
        return mt::square(mt::concat(
            {mt::slice(t, 1, 0, 4, 2), mt::expand(mt::unsqueeze(mt::sum(t, {1}), 1), {3, 2}),
             mt::flatten(mt::permute(mt::unsqueeze(mt::mean(t, {1}), 0), {1, 0}), 0)
                 .reshape({3, 1})},
            1));
      },
      {a});
  const auto idx = mt::from_vector(std::vector<std::int64_t>{0, 3, 3, 1, 2, 2}, {3, 2});
  CHECK_GRADGRADCHECK("gather",
                      [idx](const Inputs& v) { return mt::square(mt::gather(v[0], idx, 1)); }, {a});
  CHECK_GRADGRADCHECK("cast f64 -> f64",
                      [](const Inputs& v) { return mt::square(mt::cast(v[0], mt::kFloat64)); },
                      {a});
  CHECK_GRADGRADCHECK("square(sum_to)",
                      [](const Inputs& v) {
                        return mt::square(mt::sum_to(v[0], {3, 1}));
                      },
                      {a});
  CHECK_GRADGRADCHECK("square(broadcast add)",
                      [](const Inputs& v) { return mt::square(v[0] + v[1]); }, {a, b});
}

// tape.h: a backward rule "composes differentiable ops, so it can itself be recorded by an
// outer tape" - this holds for convolution and pooling too.
TEST_CASE("gradcheck: second order through conv2d and pooling", "[grad]") {
  CHECK_GRADGRADCHECK("conv2d",
                      [](const Inputs& v) {
                        return mt::conv2d(v[0], v[1], {2, 2}, mt::Padding::Same);
                      },
                      {randn64({1, 5, 5, 2}, 2012), randn64({3, 3, 2, 2}, 2013)});
  CHECK_GRADGRADCHECK(
      "square(conv2d with a bias)",
      [](const Inputs& v) {
        return mt::square(mt::conv2d(v[0], v[1], v[2], {1, 1}, mt::Padding::Same));
      },
      {randn64({1, 4, 4, 2}, 2015), randn64({3, 3, 2, 2}, 2016), randn64({2}, 2017)});
  CHECK_GRADGRADCHECK("square(max_pool2d)",
                      [](const Inputs& v) {
                        return mt::square(mt::max_pool2d(v[0], {2, 2}, {2, 2}, mt::Padding::Same));
                      },
                      {mtest::distinct64({1, 5, 5, 1}, 2014)});
  CHECK_GRADGRADCHECK("square(avg_pool2d)",
                      [](const Inputs& v) {
                        return mt::square(mt::avg_pool2d(v[0], {3, 3}, {2, 2}, mt::Padding::Same));
                      },
                      {randn64({1, 5, 5, 2}, 2015)});
}

// gelu's gradient is one kernel pass (gelu_backward) computed in float32 and rounded once:
// in float16 and bfloat16 nearly always the float64 gradient correctly rounded and never more
// than one unit away; in float32 within a few units except where Phi(x) + x phi(x) cancels.
// (The composition of a dozen ops it replaced rounded after each of them.)
TEST_CASE("gradient of gelu in float32 / float16 / bfloat16: rounded once", "[grad]") {
  const mt::Tensor x64 = mt::uniform({4096}, -6.0, 6.0, mt::kFloat64);
  const mt::Tensor g64 = mt::uniform({4096}, -2.0, 2.0, mt::kFloat64);
  for (const mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
    INFO("dtype " << dt.name());
    // The inputs in dt; their float64 copies are exact.
    const mt::Tensor x = mt::cast(x64, dt), g = mt::cast(g64, dt);
    mt::Variable xv(x, "x");
    mt::GradientTape tape;
    const mt::Tensor loss = mt::sum(mt::gelu(xv) * g);  // d loss / d gelu = g, exactly
    const mt::Tensor dx = tape.gradient(loss, std::vector<mt::Variable>{xv})[0];
    REQUIRE(dx.dtype() == dt);
    const auto xs = mt::cast(x, mt::kFloat64).to_vector<double>();
    const auto gs = mt::cast(g, mt::kFloat64).to_vector<double>();
    std::vector<double> exact(xs.size());
    for (std::size_t i = 0; i < xs.size(); ++i) {
      const double cdf = 0.5 * std::erfc(-xs[i] / std::sqrt(2.0));
      const double pdf = std::exp(-0.5 * xs[i] * xs[i]) / std::sqrt(2.0 * 3.14159265358979323846);
      exact[i] = gs[i] * (cdf + xs[i] * pdf);
    }
    const auto rounded =
        mt::cast(mt::cast(mt::from_vector(exact, {4096}), dt), mt::kFloat64).to_vector<double>();
    const auto got = mt::cast(dx, mt::kFloat64).to_vector<double>();
    const double eps = dt == mt::kBFloat16 ? 0x1p-7 : dt == mt::kFloat16 ? 0x1p-10 : 0x1p-21;
    const double tiny = dt == mt::kFloat16 ? 0x1p-24 : 0.0;  // float16's smallest subnormal
    std::size_t same = 0, outside = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      same += got[i] == rounded[i];
      // float32: Phi + x phi cancels near x = -0.75, where float32's own error in the two
      // terms (about 1e-7 of g) is what is left.
      const double allowed = eps * std::abs(exact[i]) + tiny + (dt == mt::kFloat32 ? 1e-7 : 0.0);
      outside += std::abs(got[i] - exact[i]) > allowed;
    }
    CHECK(outside == 0);
    if (dt != mt::kFloat32) CHECK(same >= got.size() * 99 / 100);
  }
}
