// GradientTape / Variable semantics.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;

namespace {

mt::Tensor vec64(const std::vector<double>& v) {
  return mt::from_vector(v, {static_cast<std::int64_t>(v.size())}, mt::kFloat64);
}

void check_values(const mt::Tensor& t, const std::vector<double>& expected, double eps = 1e-12) {
  REQUIRE(t.defined());
  const auto v = t.to_vector<double>();
  REQUIRE(v.size() == expected.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    INFO("element " << i);
    CHECK(v[i] == Approx(expected[i]).epsilon(eps).margin(eps));
  }
}

// A user-defined op: cube(x) = x^3 with an explicit backward 3 x^2 (composed of
// differentiable ops, so an outer tape can differentiate it again).
int g_cube_backward_calls = 0;
mt::Tensor cube(const mt::Tensor& x) {
  mt::Tensor out;
  {
    mt::NoGradGuard guard;  // the forward's own ops are not recorded
    out = x * x * x;
  }
  if (mt::should_record({x})) {
    mt::record_op("cube", {x}, out,
                  [x](const mt::Tensor& grad_output, const std::vector<bool>& needs_grad) {
                    ++g_cube_backward_calls;
                    std::vector<mt::Tensor> grads(1);
                    if (needs_grad.at(0)) grads[0] = grad_output * (3.0 * (x * x));
                    return grads;
                  });
  }
  return out;
}

}  // namespace

TEST_CASE("autograd: a trainable Variable is watched automatically", "[autograd]") {
  mt::Variable w(vec64({1.0, -2.0, 3.0}), "w");
  CHECK(w.is_variable());
  CHECK(w.name() == "w");
  CHECK(w.trainable());
  mt::GradientTape tape;
  const auto y = mt::sum(w * w);
  CHECK(tape.size() >= 1);
  const auto grads = tape.gradient(y, std::vector<mt::Variable>{w});
  REQUIRE(grads.size() == 1);
  CHECK(grads[0].dtype() == mt::kFloat64);
  CHECK(grads[0].shape() == w.shape());
  check_values(grads[0], {2.0, -4.0, 6.0});
}

TEST_CASE("autograd: a plain tensor is recorded only after watch()", "[autograd]") {
  const auto x = vec64({1.0, 2.0});
  {
    mt::GradientTape tape;
    const auto y = mt::sum(x * x);
    CHECK(tape.size() == 0);
    const auto g = tape.gradient(y, x);
    CHECK_FALSE(g.defined());
  }
  {
    mt::GradientTape tape;
    tape.watch(x);
    const auto y = mt::sum(x * x);
    CHECK(tape.size() >= 1);
    check_values(tape.gradient(y, x), {2.0, 4.0});
  }
  {
    // watch() of a vector of tensors.
    const auto a = vec64({3.0});
    const auto b = vec64({5.0});
    mt::GradientTape tape;
    tape.watch(std::vector<mt::Tensor>{a, b});
    const auto g = tape.gradient(mt::sum(a * b), std::vector<mt::Tensor>{a, b});
    REQUIRE(g.size() == 2);
    check_values(g[0], {5.0});
    check_values(g[1], {3.0});
  }
}

TEST_CASE("autograd: non-trainable Variables and watch_accessed_variables", "[autograd]") {
  mt::Variable frozen(vec64({2.0}), "frozen", /*trainable=*/false);
  CHECK_FALSE(frozen.trainable());
  {
    mt::GradientTape tape;
    const auto y = mt::sum(frozen * frozen);
    CHECK_FALSE(tape.gradient(y, frozen.value()).defined());
  }
  {
    mt::GradientTape tape;
    tape.watch(frozen);
    check_values(tape.gradient(mt::sum(frozen * frozen), frozen.value()), {4.0});
  }
  mt::Variable v(vec64({3.0}), "v");
  {
    mt::GradientTapeOptions opts;
    opts.watch_accessed_variables = false;
    mt::GradientTape tape(opts);
    const auto y = mt::sum(v * v);
    CHECK(tape.size() == 0);
    CHECK_FALSE(tape.gradient(y, v.value()).defined());
  }
  {
    mt::GradientTapeOptions opts;
    opts.watch_accessed_variables = false;
    mt::GradientTape tape(opts);
    tape.watch(v);
    check_values(tape.gradient(mt::sum(v * v), v.value()), {6.0});
  }
  v.set_trainable(false);
  CHECK_FALSE(v.trainable());
  {
    mt::GradientTape tape;
    CHECK_FALSE(tape.gradient(mt::sum(v * v), v.value()).defined());
  }
}

TEST_CASE("autograd: an unconnected source gives an undefined gradient", "[autograd]") {
  mt::Variable a(vec64({1.0, 2.0}), "a");
  mt::Variable b(vec64({3.0, 4.0}), "b");
  mt::GradientTape tape;
  const auto y = mt::sum(a * 2.0);
  const auto g = tape.gradient(y, std::vector<mt::Tensor>{a, b});
  REQUIRE(g.size() == 2);
  check_values(g[0], {2.0, 2.0});
  CHECK_FALSE(g[1].defined());
}

TEST_CASE("autograd: on_ready reports each source once, as soon as its gradient is final",
          "[autograd]") {
  mt::Variable w0(vec64({1.5, -2.0}), "w0");
  mt::Variable w1(vec64({0.5, 3.0}), "w1");
  mt::Variable w2(vec64({7.0, 8.0}), "w2");  // not connected to the loss
  mt::GradientTape tape;
  const auto loss = mt::sum(cube(w0) * w1);
  g_cube_backward_calls = 0;
  struct Report {
    std::size_t source;
    int cube_backward_calls;  // how far the walk was when the source was reported
    mt::Tensor gradient;
  };
  std::vector<Report> reports;
  const auto grads = tape.gradient(loss, {w0, w1, w2}, [&](std::size_t i, const mt::Tensor& g) {
    reports.push_back({i, g_cube_backward_calls, g});
  });
  // w1's last use (the product) is walked before cube's backward rule, w0's after it; the
  // unconnected w2 comes at the end, undefined.
  REQUIRE(reports.size() == 3);
  CHECK(reports[0].source == 1);
  CHECK(reports[0].cube_backward_calls == 0);
  CHECK(reports[1].source == 0);
  CHECK(reports[1].cube_backward_calls == 1);
  CHECK(reports[2].source == 2);
  CHECK_FALSE(reports[2].gradient.defined());
  check_values(reports[0].gradient, {1.5 * 1.5 * 1.5, -8.0});
  check_values(reports[1].gradient, {3.0 * 1.5 * 1.5 * 0.5, 3.0 * 4.0 * 3.0});
  REQUIRE(grads.size() == 3);
  check_values(grads[0], {3.0 * 1.5 * 1.5 * 0.5, 36.0});
  check_values(grads[1], {3.375, -8.0});
  CHECK_FALSE(grads[2].defined());
}

TEST_CASE("autograd: a tensor used twice accumulates its gradient", "[autograd]") {
  mt::Variable x(vec64({-1.5, 0.0, 2.0}), "x");
  {
    mt::GradientTape tape;
    const auto y = x * x + x;  // dy/dx = 2x + 1
    const auto g = tape.gradient(mt::sum(y), x.value());
    check_values(g, {-2.0, 1.0, 5.0});
  }
  {
    // Through two different branches that join later.
    mt::GradientTape tape;
    const auto a = mt::exp(x);
    const auto b = x * 3.0;
    const auto g = tape.gradient(mt::sum(a + b + x), x.value());  // e^x + 3 + 1
    check_values(g, {std::exp(-1.5) + 4.0, std::exp(0.0) + 4.0, std::exp(2.0) + 4.0}, 1e-10);
  }
}

TEST_CASE("autograd: persistent and non-persistent tapes", "[autograd]") {
  mt::Variable x(vec64({2.0}), "x");
  {
    mt::GradientTape tape(mt::GradientTapeOptions{true, true});
    CHECK(tape.persistent());
    const auto y = mt::sum(x * x);
    const auto z = mt::sum(x * x * x);
    check_values(tape.gradient(y, x.value()), {4.0});
    check_values(tape.gradient(z, x.value()), {12.0});
    check_values(tape.gradient(y, x.value()), {4.0});
  }
  {
    mt::GradientTape tape;
    CHECK_FALSE(tape.persistent());
    const auto y = mt::sum(x * x);
    check_values(tape.gradient(y, x.value()), {4.0});
    CHECK_THROWS_AS(tape.gradient(y, x.value()), mt::AutogradError);
  }
}

TEST_CASE("autograd: non-scalar targets need an output gradient", "[autograd]") {
  mt::Variable x(vec64({1.0, 2.0, 3.0}), "x");
  {
    mt::GradientTape tape;
    const auto y = x * x;
    CHECK_THROWS_AS(tape.gradient(y, x.value()), mt::AutogradError);
  }
  {
    mt::GradientTape tape;
    const auto y = x * x;
    const auto seed = vec64({1.0, 10.0, 100.0});
    check_values(tape.gradient(y, x.value(), seed), {2.0, 40.0, 600.0});
  }
  {
    // A rank-0 target needs no seed.
    mt::GradientTape tape;
    const auto y = mt::sum(x * x, {}, false);
    CHECK(y.rank() == 0);
    check_values(tape.gradient(y, x.value()), {2.0, 4.0, 6.0});
  }
}

TEST_CASE("autograd: nested tapes give second derivatives", "[autograd]") {
  mt::Variable x(vec64({-1.0, 0.5, 2.0}), "x");
  mt::GradientTape outer;
  mt::Tensor dy;
  {
    mt::GradientTape inner;
    const auto y = mt::sum(x * x * x);
    dy = inner.gradient(y, x.value());  // 3x^2
  }
  check_values(dy, {3.0, 0.75, 12.0});
  const auto d2 = outer.gradient(mt::sum(dy), x.value());  // 6x
  check_values(d2, {-6.0, 3.0, 12.0});

  // Second derivative of tanh through a persistent outer tape and a seeded inner call.
  mt::Variable z(vec64({0.3, -0.7}), "z");
  mt::GradientTape outer2(mt::GradientTapeOptions{true, true});
  mt::Tensor dt;
  {
    mt::GradientTape inner;
    dt = inner.gradient(mt::tanh(z), z.value(), mt::ones_like(z));  // 1 - tanh^2
  }
  const auto d2t = outer2.gradient(mt::sum(dt), z.value());  // -2 tanh (1 - tanh^2)
  std::vector<double> expect;
  for (double v : {0.3, -0.7})
    expect.push_back(-2.0 * std::tanh(v) * (1.0 - std::tanh(v) * std::tanh(v)));
  check_values(d2t, expect, 1e-10);
}

TEST_CASE("autograd: NoGradGuard stops recording", "[autograd]") {
  mt::Variable x(vec64({1.0, 2.0}), "x");
  mt::GradientTape tape;
  const auto a = x * 2.0;
  const std::size_t before = tape.size();
  CHECK(before >= 1);
  CHECK(mt::should_record({x}));
  mt::Tensor b;
  {
    mt::NoGradGuard guard;
    CHECK_FALSE(mt::should_record({x}));
    b = mt::exp(x) * a + 1.0;
    auto c = mt::sum(b);
    (void)c;
  }
  CHECK(tape.size() == before);
  CHECK(mt::should_record({x}));
  // b was not recorded: x does not reach it through the tape.
  const auto g = tape.gradient(mt::sum(b), x.value());
  CHECK_FALSE(g.defined());
}

TEST_CASE("autograd: nested NoGradGuards restore the previous state", "[autograd]") {
  mt::Variable x(vec64({1.0}), "x");
  mt::GradientTape tape;
  {
    mt::NoGradGuard g1;
    {
      mt::NoGradGuard g2;
      CHECK_FALSE(mt::should_record({x}));
    }
    CHECK_FALSE(mt::should_record({x}));
  }
  CHECK(mt::should_record({x}));
}

TEST_CASE("autograd: gradient through a reduced-precision cast keeps the source dtype",
          "[autograd]") {
  for (mt::DType low : {mt::kFloat16, mt::kBFloat16}) {
    INFO("low precision dtype " << low.name());
    mt::Variable w(mt::from_vector(std::vector<float>{0.5f, -1.25f, 2.0f}, {3}), "w");
    CHECK(w.dtype() == mt::kFloat32);
    mt::GradientTape tape;
    const auto h = mt::cast(w, low);
    CHECK(h.dtype() == low);
    const auto y = mt::sum(h * h * 3.0);  // dy/dw = 6 w
    const auto g = tape.gradient(y, w.value());
    REQUIRE(g.defined());
    CHECK(g.dtype() == mt::kFloat32);
    CHECK(g.shape() == w.shape());
    const auto v = g.to_vector<float>();
    CHECK(v[0] == Approx(3.0).epsilon(1e-2));
    CHECK(v[1] == Approx(-7.5).epsilon(1e-2));
    CHECK(v[2] == Approx(12.0).epsilon(1e-2));
    // Tensor::to() is the same op.
    mt::GradientTape tape2;
    const auto g2 = tape2.gradient(mt::sum(w.to(low)), w.value());
    REQUIRE(g2.defined());
    CHECK(g2.dtype() == mt::kFloat32);
    CHECK(g2.to_vector<float>() == std::vector<float>{1.0f, 1.0f, 1.0f});
  }
}

TEST_CASE("autograd: a long chain does not overflow the stack in backward", "[autograd]") {
  constexpr int kSteps = 100000;
  mt::Variable x(mt::full({}, 1.0, mt::kFloat64), "x");
  mt::Tensor g;
  {
    mt::GradientTape tape;
    mt::Tensor y = x;
    for (int i = 0; i < kSteps; ++i) y = y * 1.00001;
    CHECK(tape.size() >= static_cast<std::size_t>(kSteps));
    g = tape.gradient(y, x.value());
  }  // destroying the tape (and the chain) must not recurse either
  REQUIRE(g.defined());
  CHECK(g.item<double>() == Approx(std::pow(1.00001, kSteps)).epsilon(1e-9));
  {
    mt::GradientTape tape;
    mt::Tensor y = x;
    for (int i = 0; i < kSteps; ++i) y = y + 0.0;
    CHECK(tape.gradient(y, x.value()).item<double>() == 1.0);
  }
}

TEST_CASE("autograd: Variable assign / assign_add / assign_sub", "[autograd]") {
  mt::Variable v(vec64({1.0, 2.0, 3.0}), "v");
  const auto id = v.id();
  mt::Variable alias = v;  // copies refer to the same variable
  CHECK(alias.id() == id);
  mt::GradientTape tape;
  v.assign(vec64({4.0, 5.0, 6.0}));
  CHECK(v.to_vector<double>() == std::vector<double>{4.0, 5.0, 6.0});
  CHECK(alias.to_vector<double>() == std::vector<double>{4.0, 5.0, 6.0});
  v.assign_add(vec64({1.0, 1.0, 1.0}));
  CHECK(v.to_vector<double>() == std::vector<double>{5.0, 6.0, 7.0});
  v.assign_sub(vec64({0.5, 1.0, 1.5}));
  CHECK(v.to_vector<double>() == std::vector<double>{4.5, 5.0, 5.5});
  // Broadcast and cast to the variable's dtype.
  v.assign_add(mt::full({}, 0.5, mt::kFloat32));
  CHECK(v.to_vector<double>() == std::vector<double>{5.0, 5.5, 6.0});
  CHECK(v.dtype() == mt::kFloat64);
  v.assign(mt::full({1}, 2.0, mt::kFloat32));
  CHECK(v.to_vector<double>() == std::vector<double>{2.0, 2.0, 2.0});
  CHECK(v.id() == id);
  CHECK(v.shape() == mt::Shape{3});
  CHECK(tape.size() == 0);  // assignments are never recorded
  // The variable's storage is its own: the initial value is copied.
  const auto init = vec64({1.0, 1.0});
  mt::Variable w(init, "w");
  w.assign_add(vec64({1.0, 1.0}));
  CHECK(init.to_vector<double>() == std::vector<double>{1.0, 1.0});
  CHECK(w.to_vector<double>() == std::vector<double>{2.0, 2.0});
  // A gradient computed after assign sees the new value.
  mt::GradientTape t2;
  check_values(t2.gradient(mt::sum(v * v), v.value()), {4.0, 4.0, 4.0});
}

TEST_CASE("autograd: tape.reset() forgets what was recorded and watched", "[autograd]") {
  mt::Variable v(vec64({2.0}), "v");
  const auto x = vec64({3.0});
  mt::GradientTape tape(mt::GradientTapeOptions{true, true});
  tape.watch(x);
  const auto y0 = mt::sum(v * x);
  CHECK(tape.size() >= 1);
  tape.reset();
  CHECK(tape.size() == 0);
  // x is no longer watched; v (a Variable) still is.
  const auto y1 = mt::sum(x * x);
  CHECK(tape.size() == 0);
  CHECK_FALSE(tape.gradient(y1, x).defined());
  const auto y2 = mt::sum(v * v * 5.0);
  CHECK(tape.size() >= 1);
  check_values(tape.gradient(y2, v.value()), {20.0});
  // y0 was recorded before the reset: v no longer reaches it.
  CHECK_FALSE(tape.gradient(y0, v.value()).defined());
}

TEST_CASE("autograd: non-differentiable paths give undefined gradients", "[autograd]") {
  mt::Variable x(mt::from_vector(std::vector<double>{0.3, -1.2, 2.5, 0.7}, {2, 2}), "x");
  mt::GradientTape tape(mt::GradientTapeOptions{true, true});
  const std::size_t before = tape.size();
  const auto am = mt::argmax(x, -1);
  CHECK(am.dtype() == mt::kInt64);
  const auto cmp = mt::greater(x, mt::zeros_like(x));
  CHECK(cmp.dtype() == mt::kBool);
  const auto eq = mt::equal(x, x);
  CHECK(tape.size() == before);  // never recorded
  CHECK_FALSE(tape.gradient(mt::sum(mt::cast(am, mt::kFloat64)), x.value()).defined());
  CHECK_FALSE(tape.gradient(mt::sum(mt::cast(cmp, mt::kFloat64)), x.value()).defined());
  CHECK_FALSE(tape.gradient(mt::sum(mt::cast(eq, mt::kFloat64)), x.value()).defined());
  // detach() cuts the graph.
  CHECK_FALSE(tape.gradient(mt::sum(x.detach() * 2.0), x.value()).defined());
  CHECK_FALSE(tape.gradient(mt::sum(mt::detach(x) * 2.0), x.value()).defined());
  // where: differentiable in a and b, not in cond.
  const auto w = mt::where(cmp, x, x * 3.0);
  check_values(tape.gradient(mt::sum(w), x.value()), {1.0, 3.0, 1.0, 1.0});
}

TEST_CASE("autograd: record_op with a user-defined op", "[autograd]") {
  mt::Variable x(vec64({1.0, -2.0, 0.5}), "x");
  g_cube_backward_calls = 0;
  {
    mt::GradientTape tape;
    const auto y = cube(x);
    CHECK(tape.size() == 1);  // only "cube"; its forward ran under NoGradGuard
    check_values(y, {1.0, -8.0, 0.125});
    const auto g = tape.gradient(mt::sum(y), x.value());
    check_values(g, {3.0, 12.0, 0.75});
    CHECK(g_cube_backward_calls == 1);
  }
  {
    // Not recorded when nothing is watched.
    const auto plain = vec64({2.0});
    mt::GradientTape tape;
    CHECK_FALSE(mt::should_record({plain}));
    const auto y = cube(plain);
    CHECK(tape.size() == 0);
    check_values(y, {8.0});
  }
  {
    // The backward rule composes differentiable ops: an outer tape differentiates it.
    mt::GradientTape outer;
    mt::Tensor g;
    {
      mt::GradientTape inner;
      g = inner.gradient(mt::sum(cube(x)), x.value());
    }
    check_values(g, {3.0, 12.0, 0.75});
    check_values(outer.gradient(mt::sum(g), x.value()), {6.0, -12.0, 3.0});
  }
  {
    // Custom op mixed with built-in ops, and the gradient of an input that is not needed.
    mt::Variable a(vec64({2.0}), "a");
    const auto c = vec64({5.0});
    mt::GradientTape tape;
    const auto y = mt::sum(cube(a * c) + a);  // 3 (ac)^2 c + 1 = 3*100*5 + 1
    check_values(tape.gradient(y, a.value()), {1501.0});
  }
}

namespace {

// An identity op whose backward rule holds `held` (as a rule holds the tensors it saved) and
// runs `check` when the walk reaches it.
mt::Tensor holding(const mt::Tensor& x, std::shared_ptr<int> held, std::function<void()> check) {
  mt::Tensor out;
  {
    mt::NoGradGuard guard;
    out = x * 1.0;
  }
  if (mt::should_record({x}))
    mt::record_op("holding", {x}, out,
                  [held = std::move(held), check = std::move(check)](const mt::Tensor& grad_output,
                                                                     const std::vector<bool>&) {
                    check();
                    return std::vector<mt::Tensor>{grad_output};
                  });
  return out;
}

}  // namespace

TEST_CASE("autograd: a non-persistent tape releases each op's rule once its walk is past it",
          "[autograd]") {
  mt::Variable x(vec64({1.5, -2.0}), "x");
  for (const bool persistent : {false, true}) {
    INFO("persistent " << persistent);
    auto later = std::make_shared<int>(0);  // held by the op recorded second, walked first
    const std::weak_ptr<int> watch = later;
    bool checked = false, released_before = false;
    mt::GradientTape tape(mt::GradientTapeOptions{.persistent = persistent});
    const auto a = holding(x, std::make_shared<int>(0), [&] {
      checked = true;
      released_before = watch.expired();
    });
    const auto b = holding(a, std::move(later), [] {});
    check_values(tape.gradient(mt::sum(b), x.value()), {1.0, 1.0});
    CHECK(checked);
    CHECK(released_before == !persistent);
    CHECK(watch.expired() == !persistent);  // a persistent tape keeps its rules until it goes
  }
}

TEST_CASE("autograd: the saved tensors of a walked op are gone before the rest of the walk",
          "[autograd]") {
  // y_{i+1} = y_i w_i over 8 ops of 1 MiB tensors: walking back, each w_i's gradient is
  // kept while y_i (saved by op i) is no longer needed. A persistent tape holds every y_i
  // and every gradient at the walk's end; a non-persistent one about as much as at its start.
  const mt::Device cpu = mt::Device::cpu();
  constexpr std::int64_t n = 1 << 18;  // 1 MiB of float32
  const auto peak_of_walk = [&](bool persistent) {
    std::vector<mt::Variable> w;
    for (int i = 0; i < 8; ++i)
      w.emplace_back(mt::uniform({n}, 0.5, 1.5, mt::kFloat32, cpu), "w" + std::to_string(i));
    mt::GradientTape tape(mt::GradientTapeOptions{.persistent = persistent});
    mt::Tensor y = mt::uniform({n}, -1.0, 1.0, mt::kFloat32, cpu);
    for (const auto& v : w) y = y * v;
    const mt::Tensor loss = mt::sum(y);
    y = mt::Tensor();
    mt::reset_peak_memory(cpu);
    const std::uint64_t before = mt::memory_stats(cpu).in_use;
    const auto grads = tape.gradient(loss, w);
    REQUIRE(grads.size() == 8);
    return static_cast<double>(mt::memory_stats(cpu).peak - before) / (1 << 20);
  };
  const double released = peak_of_walk(false), kept = peak_of_walk(true);
  INFO("walk's peak above its start: " << released << " MiB released, " << kept << " MiB kept");
  CHECK(released + 5.0 < kept);
}
