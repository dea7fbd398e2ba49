// Optimizers through their public API against hand-computed references, clipping, state,
// bad input, and the LossScaleOptimizer driven through a scripted sequence of steps.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "error_of.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace mo = mixtape::optim;

namespace {

mt::Tensor vec(const std::vector<double>& v, mt::DType dt = mt::kFloat32) {
  return mt::from_vector(v, {static_cast<std::int64_t>(v.size())}, dt);
}

std::vector<double> values(const mt::Tensor& t) { return t.to_vector<double>(); }

void check_close(const std::vector<double>& got, const std::vector<double>& want, double rel) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("element " << i << ": got " << got[i] << ", want " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= rel * std::max(1.0, std::abs(want[i])));
  }
}

// Three steps of `opt` on w (initial w0) with gradients gs[step], against `reference`, a
// function that advances the double-precision reference state one step.
struct Reference {
  std::vector<double> w;
  std::function<void(std::vector<double>& w, const std::vector<double>& g, int step)> step;
};

void run_reference(mo::Optimizer& opt, const std::vector<double>& w0,
                   const std::vector<std::vector<double>>& gs, Reference ref, mt::DType dt,
                   double rel) {
  mt::Variable w(vec(w0, dt), "w");
  ref.w = w0;
  for (std::size_t s = 0; s < gs.size(); ++s) {
    INFO(opt.name() << " step " << s + 1);
    opt.apply_gradients({vec(gs[s], dt)}, {w});
    ref.step(ref.w, gs[s], static_cast<int>(s) + 1);
    check_close(values(w), ref.w, rel);
    CHECK(opt.iterations() == static_cast<std::int64_t>(s) + 1);
  }
}

const std::vector<double> kW0 = {0.5, -1.25, 2.0, 0.0};
const std::vector<std::vector<double>> kGrads = {
    {0.1, -0.2, 0.3, 1.5}, {-0.4, 0.05, 0.3, -1.0}, {0.2, 0.2, -0.6, 0.25}};

}  // namespace

TEST_CASE("optim: SGD plain, momentum and nesterov against hand-computed steps", "[optim]") {
  for (mt::DType dt : {mt::kFloat32, mt::kFloat64}) {
    const double rel = dt == mt::kFloat64 ? 1e-12 : 1e-6;
    mo::SGD plain({.learning_rate = 0.1});
    run_reference(plain, kW0, kGrads,
                  {{},
                   [](auto& w, const auto& g, int) {
                     for (std::size_t i = 0; i < w.size(); ++i) w[i] -= 0.1 * g[i];
                   }},
                  dt, rel);
    for (bool nesterov : {false, true}) {
      mo::SGD sgd({.learning_rate = 0.05, .momentum = 0.9, .nesterov = nesterov});
      std::vector<double> v(4, 0.0);
      run_reference(sgd, kW0, kGrads,
                    {{},
                     [&v, nesterov](auto& w, const auto& g, int) {
                       for (std::size_t i = 0; i < w.size(); ++i) {
                         v[i] = 0.9 * v[i] - 0.05 * g[i];
                         w[i] += nesterov ? 0.9 * v[i] - 0.05 * g[i] : v[i];
                       }
                     }},
                    dt, rel);
    }
  }
}

TEST_CASE("optim: RMSprop (Keras defaults, momentum, centered) against hand-computed steps",
          "[optim]") {
  const mo::RMSprop defaults;
  CHECK(defaults.current_learning_rate() == 1e-3);
  for (mt::DType dt : {mt::kFloat32, mt::kFloat64}) {
    const double rel = dt == mt::kFloat64 ? 1e-12 : 1e-6;
    for (double momentum : {0.0, 0.5})
      for (bool centered : {false, true}) {
        mo::RMSprop opt({.learning_rate = 0.01, .momentum = momentum, .centered = centered});
        std::vector<double> ms(4, 0.0), mg(4, 0.0), mom(4, 0.0);
        run_reference(opt, kW0, kGrads,
                      {{},
                       [&](auto& w, const auto& g, int) {
                         for (std::size_t i = 0; i < w.size(); ++i) {
                           ms[i] = 0.9 * ms[i] + 0.1 * g[i] * g[i];
                           double d = ms[i];
                           if (centered) {
                             mg[i] = 0.9 * mg[i] + 0.1 * g[i];
                             d = ms[i] - mg[i] * mg[i];
                           }
                           const double step = 0.01 * g[i] / std::sqrt(d + 1e-7);
                           if (momentum > 0) {
                             mom[i] = momentum * mom[i] + step;
                             w[i] -= mom[i];
                           } else {
                             w[i] -= step;
                           }
                         }
                       }},
                      dt, rel);
      }
  }
}

TEST_CASE("optim: Adam, AMSGrad and AdamW against hand-computed steps", "[optim]") {
  for (mt::DType dt : {mt::kFloat32, mt::kFloat64}) {
    const double rel = dt == mt::kFloat64 ? 1e-12 : 1e-6;
    for (int variant = 0; variant < 3; ++variant) {
      const bool amsgrad = variant == 1;
      const double wd = variant == 2 ? 0.1 : 0.0;
      std::shared_ptr<mo::Optimizer> opt;
      if (variant == 2)
        opt = std::make_shared<mo::AdamW>(
            mo::AdamWOptions{.learning_rate = 0.01, .weight_decay = wd});
      else
        opt =
            std::make_shared<mo::Adam>(mo::AdamOptions{.learning_rate = 0.01, .amsgrad = amsgrad});
      std::vector<double> m(4, 0.0), v(4, 0.0), vmax(4, 0.0);
      run_reference(*opt, kW0, kGrads,
                    {{},
                     [&](auto& w, const auto& g, int t) {
                       const double alpha =
                           0.01 * std::sqrt(1 - std::pow(0.999, t)) / (1 - std::pow(0.9, t));
                       for (std::size_t i = 0; i < w.size(); ++i) {
                         w[i] -= 0.01 * wd * w[i];
                         m[i] += (g[i] - m[i]) * 0.1;
                         v[i] += (g[i] * g[i] - v[i]) * 0.001;
                         vmax[i] = std::max(vmax[i], v[i]);
                         w[i] -= alpha * m[i] / (std::sqrt(amsgrad ? vmax[i] : v[i]) + 1e-7);
                       }
                     }},
                    dt, rel);
    }
  }
}

TEST_CASE("optim: learning rate schedules", "[optim]") {
  const auto exp_decay = mo::schedules::exponential_decay(0.1, 10, 0.5);
  CHECK(exp_decay(0) == Approx(0.1));
  CHECK(exp_decay(10) == Approx(0.05));
  CHECK(exp_decay(5) == Approx(0.1 * std::sqrt(0.5)));
  CHECK(mo::schedules::exponential_decay(0.1, 10, 0.5, true)(15) == Approx(0.05));
  const auto pieces = mo::schedules::piecewise_constant({2, 4}, {1.0, 0.5, 0.25});
  CHECK(pieces(0) == 1.0);
  CHECK(pieces(2) == 1.0);
  CHECK(pieces(3) == 0.5);
  CHECK(pieces(5) == 0.25);
  const auto cosine = mo::schedules::cosine_decay(1.0, 10, 0.1);
  CHECK(cosine(0) == Approx(1.0));
  CHECK(cosine(5) == Approx(0.55));
  CHECK(cosine(20) == Approx(0.1));
  // An optimizer uses the schedule at its iteration count.
  mo::SGD sgd({.learning_rate = pieces});
  mt::Variable w(vec({0.0}), "w");
  const std::vector<double> lrs_used = {1.0, 1.0, 1.0, 0.5, 0.5};
  double expect = 0.0;
  for (double lr : lrs_used) {
    CHECK(sgd.current_learning_rate() == lr);
    sgd.apply_gradients({vec({1.0})}, {w});
    expect -= lr;
    CHECK(w.item<double>() == Approx(expect));
  }
  CHECK_THROWS_AS(mo::schedules::piecewise_constant({1}, {1.0}), mt::ValueError);
}

TEST_CASE("optim: clipping by value, by norm and by global norm", "[optim]") {
  {
    mo::SGD sgd({.learning_rate = 1.0, .clipping = {.clipvalue = 0.5}});
    mt::Variable w(vec({0, 0, 0}), "w");
    sgd.apply_gradients({vec({2.0, -3.0, 0.25})}, {w});
    check_close(values(w), {-0.5, 0.5, -0.25}, 1e-7);
  }
  {
    mo::SGD sgd({.learning_rate = 1.0, .clipping = {.clipnorm = 1.0}});
    mt::Variable a(vec({0, 0}), "a"), b(vec({0, 0}), "b");
    sgd.apply_gradients({vec({3.0, 4.0}), vec({0.3, 0.4})}, {a, b});
    check_close(values(a), {-0.6, -0.8}, 1e-6);  // norm 5 -> 1
    check_close(values(b), {-0.3, -0.4}, 1e-6);  // norm 0.5: unchanged
  }
  {
    mo::SGD sgd({.learning_rate = 1.0, .clipping = {.global_clipnorm = 1.0}});
    mt::Variable a(vec({0, 0}), "a"), b(vec({0}), "b");
    sgd.apply_gradients({vec({3.0, 0.0}), vec({4.0})}, {a, b});  // global norm 5
    check_close(values(a), {-0.6, 0.0}, 1e-6);
    check_close(values(b), {-0.8}, 1e-6);
  }
  CHECK_THROWS_AS(mo::SGD({.clipping = {.clipnorm = 1.0, .clipvalue = 1.0}}), mt::ValueError);
  CHECK_THROWS_AS(mo::SGD({.clipping = {.clipnorm = -1.0}}), mt::ValueError);
}

TEST_CASE("optim: global_clipnorm over gradients of several dtypes and sizes", "[optim]") {
  // Many gradients (more than the CUDA kernels' 128 a launch), float32, bfloat16 and float64
  // together: each step is -g * clipnorm / norm, norm the float64 L2 norm of them all (the
  // squares summed in float64); the gradients given are not written to.
  mt::manual_seed(3);
  std::vector<mt::Tensor> grads;
  std::vector<mt::Variable> vars;
  double squares = 0.0;
  for (int i = 0; i < 150; ++i) {
    const mt::DType dt = i % 3 == 0 ? mt::kFloat32 : i % 3 == 1 ? mt::kBFloat16 : mt::kFloat64;
    const mt::Tensor g = mt::uniform({1 + i % 7, 3}, -2.0, 2.0).to(dt);
    for (const double v : values(g)) squares += v * v;
    grads.push_back(g);
    vars.emplace_back(mt::zeros(g.shape(), dt), fmt::format("v{}", i));
  }
  std::vector<std::vector<double>> given;
  for (const auto& g : grads) given.push_back(values(g));
  const double clipnorm = 0.75, factor = clipnorm / std::sqrt(squares);
  mo::SGD sgd({.learning_rate = 1.0, .clipping = {.global_clipnorm = clipnorm}});
  sgd.apply_gradients(grads, vars);
  for (std::size_t i = 0; i < grads.size(); ++i) {
    INFO("gradient " << i << " in " << grads[i].dtype().name());
    CHECK(values(grads[i]) == given[i]);
    std::vector<double> want = given[i];
    for (double& w : want) w *= -factor;
    // The product in float32 rounded to the dtype (float64 for float64).
    const double tol = grads[i].dtype() == mt::kBFloat16 ? 8e-3 : 1e-6;
    check_close(values(vars[i]), want, tol);
  }
  // Below the threshold nothing changes: the factor is exactly 1.
  mo::SGD loose({.learning_rate = 1.0, .clipping = {.global_clipnorm = 1e6}});
  mt::Variable w(vec({0.0, 0.0}, mt::kBFloat16), "w");
  loose.apply_gradients({vec({0.3, -1.7}, mt::kBFloat16)}, {w});
  CHECK(values(w) == values(mt::neg(vec({0.3, -1.7}, mt::kBFloat16))));
}

TEST_CASE(
    "optim: a steady AdamW step with global_clipnorm dispatches the same kernels for "
    "any number of variables",
    "[optim][census]") {
  // The kernels of the second step (the first makes the slots), counted on the host: the
  // clipping and the updates are a few calls per dtype, never one per variable (on a GPU each
  // call is a launch; kernels.h's list kernels take every variable of a dtype).
  const auto census_of_step = [](int count) {
    std::vector<mt::Tensor> grads;
    std::vector<mt::Variable> vars;
    for (int i = 0; i < count; ++i) {
      const mt::DType dt = i % 3 == 0 ? mt::kFloat32 : i % 3 == 1 ? mt::kBFloat16 : mt::kFloat64;
      grads.push_back(mt::uniform({2 + i % 5}, -1.0, 1.0).to(dt));
      vars.emplace_back(mt::zeros({2 + i % 5}, dt), fmt::format("v{}", i));
    }
    mo::AdamW adamw({.clipping = {.global_clipnorm = 0.5}});
    adamw.apply_gradients(grads, vars);
    mt::KernelCensus census;
    adamw.apply_gradients(grads, vars);
    return census.table();
  };
  const std::string small = census_of_step(30), large = census_of_step(300);
  INFO("30 variables:\n" << small << "300 variables:\n" << large);
  CHECK(small == large);
  // Two dtypes: a sum_squares call each, and the factor applied by the updates (no scale_list).
  mo::SGD sgd({.clipping = {.global_clipnorm = 1.0}});
  mt::Variable a(vec({0.0, 0.0}), "a"), b(vec({0.0}, mt::kBFloat16), "b");
  const std::vector<mt::Tensor> grads{vec({3.0, 4.0}), vec({1.0}, mt::kBFloat16)};
  mt::KernelCensus census;
  sgd.apply_gradients(grads, {a, b});
  CHECK(census.count(mt::OpId::sum_squares) == 2);
  CHECK(census.count(mt::OpId::scale_list) == 0);
  CHECK(census.count(mt::OpId::sgd_update) == 2);
}

namespace {
// The built-in optimizers with global_clipnorm's factor applied by a scale_list pass before
// their updates, as an optimizer whose kernels do not take it gets it.
template <class Base>
class Unfused : public Base {
 public:
  using Base::Base;

 protected:
  bool fuses_gradient_scale() const override { return false; }
};
}  // namespace

TEST_CASE(
    "optim: global_clipnorm's factor applied inside the update kernels gives the values of a "
    "scale_list pass, bit for bit",
    "[optim]") {
  const mo::Clipping clip{.global_clipnorm = 0.3};
  const auto run = [](mo::Optimizer& opt, std::vector<mt::Variable>& vars) {
    for (int step = 0; step < 3; ++step) {
      std::vector<mt::Tensor> grads;
      for (std::size_t i = 0; i < vars.size(); ++i)
        grads.push_back(mt::uniform(vars[i].shape(), -2.0, 2.0).to(vars[i].dtype()));
      mt::KernelCensus census;
      opt.apply_gradients(grads, vars);
      if (step == 2) return census.count(mt::OpId::scale_list);
    }
    return std::int64_t{-1};
  };
  const auto variables = [] {
    std::vector<mt::Variable> vars;
    const mt::DType dtypes[] = {mt::kFloat32, mt::kBFloat16, mt::kFloat16, mt::kFloat64};
    for (int i = 0; i < 8; ++i)
      vars.emplace_back(mt::uniform({3 + i * 5}, -1.0, 1.0).to(dtypes[i % 4]),
                        fmt::format("v{}", i));
    return vars;
  };
  const auto compare = [&](mo::Optimizer& fused, mo::Optimizer& unfused) {
    mt::manual_seed(17);
    std::vector<mt::Variable> a = variables();
    const std::int64_t fused_passes = run(fused, a);
    mt::manual_seed(17);
    std::vector<mt::Variable> b = variables();
    const std::int64_t unfused_passes = run(unfused, b);
    CHECK(fused_passes == 0);
    CHECK(unfused_passes == 4);  // one per dtype
    for (std::size_t i = 0; i < a.size(); ++i) {
      INFO(a[i].name() << " " << a[i].dtype().name());
      CHECK(values(a[i]) == values(b[i]));
      const auto sa = fused.slots(a[i]), sb = unfused.slots(b[i]);
      REQUIRE(sa.size() == sb.size());
      for (std::size_t k = 0; k < sa.size(); ++k) CHECK(values(sa[k]) == values(sb[k]));
    }
  };
  SECTION("SGD with momentum") {
    mo::SGD fused({.learning_rate = 0.1, .momentum = 0.9, .clipping = clip});
    Unfused<mo::SGD> unfused({.learning_rate = 0.1, .momentum = 0.9, .clipping = clip});
    compare(fused, unfused);
  }
  SECTION("RMSprop, centered") {
    mo::RMSprop fused({.centered = true, .clipping = clip});
    Unfused<mo::RMSprop> unfused({.centered = true, .clipping = clip});
    compare(fused, unfused);
  }
  SECTION("AdamW") {
    mo::AdamW fused({.weight_decay = 0.1, .clipping = clip});
    Unfused<mo::AdamW> unfused({.weight_decay = 0.1, .clipping = clip});
    compare(fused, unfused);
  }
}

TEST_CASE("optim: slots are float32 for float32 and 16-bit variables, float64 for float64",
          "[optim]") {
  for (mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
    INFO(std::string(dt.name()));
    mo::Adam adam;
    mt::Variable w(vec({1.0, 2.0}, dt), "w");
    CHECK(adam.slots(w).empty());
    adam.apply_gradients({vec({0.5, -0.5}, dt)}, {w});
    const auto slots = adam.slots(w);
    REQUIRE(slots.size() == 2);
    for (const auto& s : slots)
      CHECK(s.dtype() == (dt == mt::kFloat64 ? mt::kFloat64 : mt::kFloat32));
    CHECK(w.dtype() == dt);
    // One Adam step moves each weight by about lr against the gradient's sign.
    check_close(values(w), {1.0 - 1e-3, 2.0 + 1e-3}, dt == mt::kBFloat16 ? 1e-2 : 1e-3);
  }
}

TEST_CASE("optim: state saves and restores exactly", "[optim]") {
  auto run = [](mo::Optimizer& opt, mt::Variable& w, int from, int to) {
    for (int s = from; s < to; ++s) opt.apply_gradients({vec(kGrads[s % 3])}, {w});
  };
  for (auto make : std::vector<std::function<std::shared_ptr<mo::Optimizer>()>>{
           [] { return std::make_shared<mo::Adam>(); },
           [] {
             return std::make_shared<mo::RMSprop>(
                 mo::RMSpropOptions{.momentum = 0.3, .centered = true});
           },
           [] { return std::make_shared<mo::SGD>(mo::SGDOptions{.momentum = 0.9}); }}) {
    auto a = make();
    mt::Variable wa(vec(kW0), "layer/w");
    run(*a, wa, 0, 2);
    const mo::OptimizerState saved = a->state({wa});
    const auto w_saved = values(wa);
    CHECK(saved.iterations == 2);
    run(*a, wa, 2, 4);

    auto b = make();
    mt::Variable wb(vec(w_saved), "layer/w");
    b->load_state(saved, {wb});
    CHECK(b->iterations() == 2);
    run(*b, wb, 2, 4);
    INFO(a->name());
    CHECK(values(wb) == values(wa));
  }
  // A state for another variable layout is refused, naming the slot.
  mo::Adam adam;
  mt::Variable w(vec({1, 2, 3}), "layer/w");
  mo::OptimizerState bad;
  bad.tensors["layer/w/m"] = mt::zeros({2});
  bad.tensors["layer/w/v"] = mt::zeros({2});
  CHECK_THROWS_WITH(adam.load_state(bad, {w}), Catch::Contains("layer/w/m"));
  bad.tensors.erase("layer/w/v");
  bad.tensors["layer/w/m"] = mt::zeros({3});
  CHECK_THROWS_WITH(adam.load_state(bad, {w}), Catch::Contains("layer/w/v"));
}

TEST_CASE("optim: bad gradients are refused and change nothing", "[optim]") {
  mo::Adam adam;
  mt::Variable w(vec({1, 2}), "w"), u(vec({3}), "u");
  adam.apply_gradients({vec({0.1, 0.1}), vec({0.1})}, {w, u});
  const auto w_before = values(w), u_before = values(u);
  const auto m_before = values(adam.slots(w)[0]);
  CHECK_THROWS_WITH(adam.apply_gradients({vec({0.1, 0.1})}, {w, u}),
                    Catch::Contains("1 gradients for 2 variables"));
  CHECK_THROWS_AS(adam.apply_gradients({vec({0.1, 0.1, 0.1}), vec({0.1})}, {w, u}), mt::ShapeError);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  CHECK_THROWS_AS(adam.apply_gradients({vec({0.1, 0.1}), vec({nan})}, {w, u}), mt::NumericError);
  CHECK_THROWS_WITH(adam.apply_gradients({vec({0.1, INFINITY}), vec({0.1})}, {w, u}),
                    Catch::Contains("'w'") && Catch::Contains("no variable was changed"));
  CHECK(values(w) == w_before);
  CHECK(values(u) == u_before);
  CHECK(values(adam.slots(w)[0]) == m_before);
  CHECK(adam.iterations() == 1);
  // An undefined gradient leaves its variable alone.
  adam.apply_gradients({vec({0.1, 0.1}), mt::Tensor()}, {w, u});
  CHECK(values(u) == u_before);
  CHECK(values(w) != w_before);
  CHECK(adam.iterations() == 2);
}

TEST_CASE("optim: a finiteness check decided on the device reports the step one call later",
          "[optim]") {
  // StepDecision::Device (a GPU's default) on the CPU: the updates skip a non-finite step on
  // the flag, the host reads it behind the step, and the next apply_gradients or
  // check_pending throws, with the step not counted and nothing changed by it.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const bool by_check_pending : {false, true}) {
    INFO((by_check_pending ? "check_pending" : "the next apply_gradients"));
    mo::Adam adam({.learning_rate = 0.1});
    mo::Adam host({.learning_rate = 0.1});
    adam.set_finite_check(mo::StepDecision::Device);
    mt::Variable w(vec({1, 2}), "w"), u(vec({3}), "u");
    mt::Variable hw(vec({1, 2}), "w"), hu(vec({3}), "u");
    adam.apply_gradients({vec({0.1, -0.2}), vec({0.3})}, {w, u});
    host.apply_gradients({vec({0.1, -0.2}), vec({0.3})}, {hw, hu});
    const auto w_before = values(w), u_before = values(u);
    const auto m_before = values(adam.slots(w)[0]), v_before = values(adam.slots(w)[1]);
    // The step with a NaN: no throw yet; the updates changed nothing.
    adam.apply_gradients({vec({0.1, 0.1}), vec({nan})}, {w, u});
    CHECK(values(w) == w_before);
    CHECK(values(u) == u_before);
    CHECK(values(adam.slots(w)[0]) == m_before);
    CHECK(values(adam.slots(w)[1]) == v_before);
    const auto report = [&] {
      if (by_check_pending)
        adam.check_pending();
      else
        adam.apply_gradients({vec({0.5, 0.5}), vec({0.5})}, {w, u});
    };
    CHECK_THROWS_WITH(report(), Catch::Contains("Adam") && Catch::Contains("at step 2") &&
                                    Catch::Contains("not counted"));
    CHECK(adam.iterations() == 1);
    CHECK(values(w) == w_before);
    adam.check_pending();  // read: nothing left to report
    // The run goes on as the host-decided one does, bit for bit.
    for (const double g : {0.25, -0.5}) {
      adam.apply_gradients({vec({g, g}), vec({g})}, {w, u});
      host.apply_gradients({vec({g, g}), vec({g})}, {hw, hu});
    }
    adam.check_pending();
    CHECK(adam.iterations() == host.iterations());
    CHECK(values(w) == values(hw));
    CHECK(values(u) == values(hu));
  }
  // state() reads a pending check first (a checkpoint never counts a step taken back);
  // load_state drops the checks of the steps before it.
  {
    mo::SGD sgd({.learning_rate = 0.1});
    sgd.set_finite_check(mo::StepDecision::Device);
    mt::Variable w(vec({1}), "w");
    sgd.apply_gradients({vec({0.5})}, {w});
    const mo::OptimizerState one_step = sgd.state({w});
    sgd.apply_gradients({vec({nan})}, {w});
    CHECK_THROWS_WITH(sgd.state({w}), Catch::Contains("at step 2"));
    CHECK(sgd.state({w}).iterations == 1);
    sgd.apply_gradients({vec({nan})}, {w});
    sgd.load_state(one_step, {w});
    sgd.check_pending();  // the NaN step before the load is not reported against its count
    CHECK(sgd.iterations() == 1);
  }
  // The CPU's default (Auto) and Host read before any update: the same call throws.
  mo::SGD sgd({.learning_rate = 0.1});
  mt::Variable w(vec({1}), "w");
  CHECK_THROWS_WITH(sgd.apply_gradients({vec({nan})}, {w}), Catch::Contains("no variable"));
  sgd.set_finite_check(mo::StepDecision::Host);
  CHECK_THROWS_AS(sgd.apply_gradients({vec({nan})}, {w}), mt::NumericError);
  CHECK(sgd.iterations() == 0);
}

TEST_CASE(
    "optim: with global_clipnorm the finiteness check is read from the gradients' sum of squares, "
    "and is the same check",
    "[optim]") {
  // The float64 sum of squares that global_clipnorm makes is finite exactly when every gradient
  // of 32 bits or fewer is: a NaN or an infinity anywhere is caught, on the host and on the
  // device, the largest finite values are not; float64 gradients, whose squares can overflow,
  // are checked element by element.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const double big32 = 3.0e38;  // near float32's (and bfloat16's) largest
  for (const mt::DType dt : {mt::kFloat32, mt::kBFloat16, mt::kFloat64}) {
    for (const mo::StepDecision decision : {mo::StepDecision::Host, mo::StepDecision::Device}) {
      INFO(dt.name() << (decision == mo::StepDecision::Host ? ", host" : ", device"));
      const auto make = [&] {
        mo::AdamW adamw({.learning_rate = 0.01, .clipping = {.global_clipnorm = 0.5}});
        adamw.set_finite_check(decision);
        return adamw;
      };
      // Reports a step with these gradients: true when it was refused as non-finite (at once
      // on the host, at the next check on the device).
      const auto refused = [&](const std::vector<double>& g1, const std::vector<double>& g2) {
        mo::AdamW adamw = make();
        mt::Variable w(vec({1, 2, 3}, dt), "w"), u(vec({4, 5}, dt), "u");
        const auto w_before = values(w);
        try {
          adamw.apply_gradients({vec(g1, dt), vec(g2, dt)}, {w, u});
          adamw.check_pending();
        } catch (const mt::NumericError& e) {
          CHECK_THAT(e.what(), Catch::Contains("NaN or infinite"));
          CHECK(values(w) == w_before);
          CHECK(adamw.iterations() == 0);
          return true;
        }
        CHECK(adamw.iterations() == 1);
        return false;
      };
      CHECK(refused({0.1, nan, 0.3}, {0.4, 0.5}));
      CHECK(refused({0.1, 0.2, 0.3}, {-inf, 0.5}));
      CHECK(refused({inf, -inf, 0.3}, {0.4, 0.5}));  // (squares inf + inf, no inf - inf)
      CHECK_FALSE(refused({0.1, 0.2, 0.3}, {0.4, 0.5}));
      CHECK_FALSE(refused({big32, -big32, big32}, {big32, 0.5}));
      if (dt == mt::kFloat64) CHECK_FALSE(refused({1e200, -1e200, 0.3}, {1e300, 0.5}));
    }
  }
  // One check of one element, whatever the gradients' dtypes (the full check is a call per
  // dtype): gradients of two dtypes, counted by the kernel census.
  const auto checks = [&](mt::DType second, const mo::Clipping& clipping) {
    mo::AdamW adamw({.learning_rate = 0.01, .clipping = clipping});
    mt::Variable w(vec({1, 2, 3}), "w"), u(vec({4, 5}, second), "u");
    mt::KernelCensus census;
    adamw.apply_gradients({vec({0.1, 0.2, 0.3}), vec({0.4, 0.5}, second)}, {w, u});
    return census.count(mt::OpId::unscale_check);
  };
  CHECK(checks(mt::kBFloat16, {.global_clipnorm = 0.5}) == 1);
  CHECK(checks(mt::kBFloat16, {}) == 2);
  CHECK(checks(mt::kFloat64, {.global_clipnorm = 0.5}) == 2);
}

// --- LossScaleOptimizer ------------------------------------------------------------------------

TEST_CASE("loss scale optimizer: a scripted sequence of finite and non-finite steps",
          "[optim][loss_scale]") {
  mo::LossScaleOptimizer opt(
      mo::SGD({.learning_rate = 0.5, .momentum = 0.5}),
      mt::LossScale::dynamic(
          {.initial_scale = 8, .growth_interval = 2, .multiplier = 2, .min_scale = 2}));
  mt::Variable w(vec({1.0, -1.0}), "w");
  CHECK(opt.loss_scale() == 8);
  CHECK(opt.get_scaled_loss(mt::full({}, 1.5)).item<double>() == 12.0);

  struct Step {
    double g0;           // first gradient element (the second is 0.25), unscaled
    bool finite;         // whether the step applies
    double scale_after;  // loss scale afterwards
    std::int64_t good_after;
  };
  const double inf = INFINITY, nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Step> script = {
      {0.5, true, 8, 1},  {0.25, true, 16, 0}, {inf, false, 8, 0}, {1.0, true, 8, 1},
      {nan, false, 4, 0}, {inf, false, 2, 0},  {inf, false, 2, 0}, {0.5, true, 2, 1},
      {-0.5, true, 4, 0}, {0.0, true, 4, 1},
  };
  std::int64_t applied = 0, skipped = 0;
  std::vector<double> velocity(2, 0.0), ref = values(w);
  for (std::size_t s = 0; s < script.size(); ++s) {
    const Step& st = script[s];
    INFO("step " << s);
    const double scale = opt.loss_scale();
    // The gradients as a tape would give them for the scaled loss.
    const auto unscaled = opt.get_unscaled_gradients({vec({st.g0 * scale, 0.25 * scale})});
    if (st.finite) check_close(values(unscaled[0]), {st.g0, 0.25}, 1e-7);
    const auto slots_before = opt.inner_optimizer().slots(w);
    const auto slot_values_before =
        slots_before.empty() ? std::vector<double>{} : values(slots_before[0]);
    const auto w_before = values(w);
    opt.apply_gradients(unscaled, {w});
    if (st.finite) {
      ++applied;
      const double g[2] = {st.g0, 0.25};
      for (int i = 0; i < 2; ++i) {
        velocity[i] = 0.5 * velocity[i] - 0.5 * g[i];
        ref[i] += velocity[i];
      }
      check_close(values(w), ref, 1e-6);
    } else {
      ++skipped;
      CHECK(values(w) == w_before);  // nothing changes on a skipped step
      if (!slots_before.empty())
        CHECK(values(opt.inner_optimizer().slots(w)[0]) == slot_values_before);
    }
    CHECK(opt.last_step_skipped() == !st.finite);
    CHECK(opt.loss_scale() == st.scale_after);
    CHECK(opt.good_steps() == st.good_after);
    CHECK(opt.applied_steps() == applied);
    CHECK(opt.skipped_steps() == skipped);
    CHECK(opt.iterations() == applied);
  }
}

TEST_CASE("loss scale optimizer: fixed scales, the ceiling and the stuck-scale guard",
          "[optim][loss_scale]") {
  {
    mo::LossScaleOptimizer fixed(mo::SGD(), mt::LossScale::fixed(1024));
    mt::Variable w(vec({1.0}), "w");
    fixed.apply_gradients(fixed.get_unscaled_gradients({vec({INFINITY})}), {w});
    CHECK(fixed.loss_scale() == 1024);
    for (int i = 0; i < 3000; ++i) fixed.apply_gradients({vec({0.0})}, {w});
    CHECK(fixed.loss_scale() == 1024);
    CHECK(fixed.applied_steps() == 3000);
  }
  {
    const double top = std::ldexp(1.0, 127);
    mo::LossScaleOptimizer grow(
        mo::SGD(),
        mt::LossScale::dynamic({.initial_scale = std::ldexp(1.0, 126), .growth_interval = 1}));
    mt::Variable w(vec({1.0}), "w");
    for (int i = 0; i < 3; ++i) grow.apply_gradients({vec({0.0})}, {w});
    CHECK(grow.loss_scale() == top);  // never beyond 2^127, never inf
  }
  {
    mo::LossScaleOptimizer stuck(mo::SGD(), mt::LossScale::dynamic({.initial_scale = 4}),
                                 {.max_consecutive_skips = 5});
    mt::Variable w(vec({1.0}), "w");
    for (int i = 0; i < 4; ++i) stuck.apply_gradients({vec({NAN})}, {w});
    CHECK(stuck.loss_scale() == 1);  // the floor
    CHECK_THROWS_AS(stuck.apply_gradients({vec({NAN})}, {w}), mt::NumericError);
    CHECK_THROWS_WITH(stuck.apply_gradients({vec({NAN})}, {w}),
                      Catch::Contains("diverged") && Catch::Contains("floor"));
    CHECK(w.item<double>() == 1.0);
  }
}

TEST_CASE("loss scale optimizer: clipping applies to the unscaled gradients",
          "[optim][loss_scale]") {
  mo::LossScaleOptimizer opt(mo::SGD({.learning_rate = 1.0, .clipping = {.clipvalue = 0.5}}),
                             mt::LossScale::fixed(1024));
  mt::Variable w(vec({0.0, 0.0}), "w");
  // Scaled gradients 1024 * (0.3, 2.0): unscaled 0.3 passes, 2.0 is clipped to 0.5.
  opt.apply_gradients(opt.get_unscaled_gradients({vec({0.3 * 1024, 2.0 * 1024})}), {w});
  check_close(values(w), {-0.3, -0.5}, 1e-6);
}

TEST_CASE("loss scale optimizer: state with the scale and counters", "[optim][loss_scale]") {
  auto make = [] {
    return mo::LossScaleOptimizer(
        mo::Adam(), mt::LossScale::dynamic({.initial_scale = 64, .growth_interval = 3}));
  };
  mo::LossScaleOptimizer a = make();
  mt::Variable wa(vec(kW0), "w");
  a.apply_gradients({vec(kGrads[0])}, {wa});
  a.apply_gradients({vec({INFINITY, 0, 0, 0})}, {wa});
  a.apply_gradients({vec(kGrads[1])}, {wa});
  const auto saved = a.state({wa});
  CHECK(saved.scalars.at("loss_scale") == 32);
  CHECK(saved.scalars.at("skipped_steps") == 1);
  CHECK(saved.scalars.at("applied_steps") == 2);
  CHECK(saved.scalars.at("good_steps") == 1);
  const auto w_saved = values(wa);
  a.apply_gradients({vec(kGrads[2])}, {wa});

  mo::LossScaleOptimizer b = make();
  mt::Variable wb(vec(w_saved), "w");
  b.load_state(saved, {wb});
  CHECK(b.loss_scale() == 32);
  CHECK(b.iterations() == 2);
  b.apply_gradients({vec(kGrads[2])}, {wb});
  CHECK(values(wb) == values(wa));
  CHECK(b.loss_scale() == a.loss_scale());
}

TEST_CASE("loss scale optimizer: steps decided on the device end as steps decided on the host",
          "[optim][loss_scale]") {
  // StepDecision::Device on the CPU: the update kernels read the flag, and the counts, the
  // scale and the iteration count are recorded by the next call. A learning rate schedule
  // (it reads the iteration count), Adam's bias correction (the step number), the first
  // step skipped, skips in a row, and accessors read only now and then: bit for bit the
  // same weights, slots and numbers as the flag read before each update.
  auto make = [](mo::StepDecision decision) {
    return mo::LossScaleOptimizer(
        mo::Adam({.learning_rate = mo::schedules::cosine_decay(0.1, 10)}),
        mt::LossScale::dynamic({.initial_scale = 256, .growth_interval = 2}),
        {.max_consecutive_skips = 3, .decision = decision});
  };
  mo::LossScaleOptimizer host = make(mo::StepDecision::Host);
  mo::LossScaleOptimizer device = make(mo::StepDecision::Device);
  mt::Variable wh(vec({0.5, -1.0, 2.0}), "w"), wd(vec({0.5, -1.0, 2.0}), "w");
  const double inf = INFINITY, nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<double> first = {inf, 0.3, 0.2, nan, -0.4, inf, 0.1, 0.7, -0.2, 0.05, 0.3};
  for (std::size_t s = 0; s < first.size(); ++s) {
    INFO("step " << s);
    // The loss scaled with the scale kept on the device (moved there by the last step's flag,
    // not read by the host yet) as with the host's.
    const mt::Tensor loss = vec({1.0 + 0.1 * static_cast<double>(s)});
    CHECK(values(device.get_scaled_loss(loss)) == values(host.get_scaled_loss(loss)));
    const std::vector<double> g = {first[s], -0.25, 0.125};
    const auto gh = host.get_unscaled_gradients({vec({g[0] * 256, g[1] * 256, g[2] * 256})});
    const auto gd = device.get_unscaled_gradients({vec({g[0] * 256, g[1] * 256, g[2] * 256})});
    host.apply_gradients(gh, {wh});
    device.apply_gradients(gd, {wd});
    CHECK(values(wd) == values(wh));  // the kernels skipped or applied already
    if (s % 3 == 2) {                 // accessors now and then (each records the last step)
      CHECK(device.loss_scale() == host.loss_scale());
      CHECK(device.iterations() == host.iterations());
      CHECK(device.last_step_skipped() == host.last_step_skipped());
    }
  }
  CHECK(host.skipped_steps() == 3);
  CHECK(device.skipped_steps() == host.skipped_steps());
  CHECK(device.applied_steps() == host.applied_steps());
  CHECK(device.good_steps() == host.good_steps());
  CHECK(device.loss_scale() == host.loss_scale());
  CHECK(device.iterations() == host.iterations());
  CHECK(device.current_learning_rate() == host.current_learning_rate());
  const auto sh = host.inner_optimizer().slots(wh), sd = device.inner_optimizer().slots(wd);
  REQUIRE(sh.size() == sd.size());
  for (std::size_t i = 0; i < sh.size(); ++i) CHECK(values(sd[i]) == values(sh[i]));
  const auto state_h = host.state({wh}), state_d = device.state({wd});
  CHECK(state_d.scalars == state_h.scalars);
  CHECK(state_d.iterations == state_h.iterations);

  // A loaded state replaces the scale on the device too: the next step scales and unscales
  // with the loaded one.
  mo::OptimizerState loaded = state_d;
  loaded.scalars["loss_scale"] = 1000.0;
  device.load_state(loaded, {wd});
  CHECK(values(device.get_scaled_loss(vec({1.5}))) == std::vector<double>{1500.0});
  CHECK(values(device.get_unscaled_gradients({vec({500.0})})[0]) == std::vector<double>{0.5});

  // The stuck-scale guard: the third skip in a row throws from the call after it.
  mo::LossScaleOptimizer stuck = make(mo::StepDecision::Device);
  mt::Variable w(vec({1.0}), "w");
  for (int i = 0; i < 3; ++i) stuck.apply_gradients({vec({NAN})}, {w});
  CHECK_THROWS_WITH(stuck.sync_step(), Catch::Contains("diverged"));
  CHECK(stuck.skipped_steps() == 3);
  CHECK(stuck.iterations() == 0);
  CHECK(w.item<double>() == 1.0);
  // A copy starts from recorded numbers.
  stuck.apply_gradients({vec({0.5})}, {w});
  const mo::LossScaleOptimizer copy = stuck;
  CHECK(copy.applied_steps() == 1);
  CHECK(copy.iterations() == 1);
}

namespace {
bool same_bits(const mt::Tensor& a, const mt::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         mt::detail::host_bytes(a) == mt::detail::host_bytes(b);
}
}  // namespace

TEST_CASE("optimizer chain: compute_gradients is the loss scale's manual step, bit for bit",
          "[optim][loss_scale]") {
  for (bool scaled : {false, true}) {
    CAPTURE(scaled);
    mt::manual_seed(21);
    const mt::Tensor x = mt::normal({6, 4}), y = mt::normal({6, 3});
    mt::Variable w1(mt::normal({4, 3}), "w1"), w2(w1, "w2");  // the same values, apart
    std::shared_ptr<mo::Optimizer> chain = std::make_shared<mo::Adam>(mo::AdamOptions{});
    std::shared_ptr<mo::Optimizer> manual = std::make_shared<mo::Adam>(mo::AdamOptions{});
    if (scaled) {
      chain = std::make_shared<mo::LossScaleOptimizer>(chain, mt::LossScale::dynamic());
      manual = std::make_shared<mo::LossScaleOptimizer>(manual, mt::LossScale::dynamic());
    }
    CHECK(chain->distributed_optimizer() == nullptr);
    CHECK((chain->loss_scale_optimizer() == chain.get()) == scaled);
    const auto loss_of = [&](const mt::Variable& w) {
      return mt::mean(mt::square(mt::matmul(x, w) - y));
    };
    for (int step = 0; step < 3; ++step) {
      {
        mt::GradientTape tape;
        const mt::Tensor loss = loss_of(w1);
        CHECK(same_bits(chain->scale_loss(loss), scaled ? loss * 32768.0 : loss));
        chain->apply_gradients(chain->compute_gradients(tape, loss, {w1}), {w1});
      }
      {  // the seed's custom loop: scale, gradient, unscale, apply
        mt::GradientTape tape;
        const mt::Tensor loss = loss_of(w2);
        auto* lso = manual->loss_scale_optimizer();
        std::vector<mt::Tensor> g =
            tape.gradient(lso ? lso->get_scaled_loss(loss) : loss, std::vector<mt::Variable>{w2});
        if (lso) g = lso->get_unscaled_gradients(g);
        manual->apply_gradients(g, {w2});
      }
      CHECK(same_bits(w1, w2));
    }
    // No loss (no samples this step): undefined gradients, and nothing moves.
    mt::GradientTape tape;
    const auto none = chain->compute_gradients(tape, mt::Tensor(), {w1});
    REQUIRE(none.size() == 1);
    CHECK_FALSE(none[0].defined());
  }
}

using Catch::Matchers::Contains;
using mixtape_test::error_of;

namespace {
// A small classifier with fixed initial weights (the same for every call with one seed).
std::shared_ptr<mt::Model> accumulation_model(std::uint64_t seed) {
  mt::manual_seed(seed);
  auto in = mt::layers::Input({6});
  auto h = mt::layers::Dense(8, {.activation = "tanh"})(in);
  auto out = mt::layers::Activation("linear", {.dtype = "float32"})(mt::layers::Dense(3)(h));
  return std::make_shared<mt::Model>(in, out);
}

double max_rel_diff(const std::vector<mt::Variable>& a, const std::vector<mt::Variable>& b) {
  double worst = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto va = a[i].to_vector<double>(), vb = b[i].to_vector<double>();
    for (std::size_t k = 0; k < va.size(); ++k)
      worst = std::max(worst, std::abs(va[k] - vb[k]) / (1.0 + std::abs(vb[k])));
  }
  return worst;
}
}  // namespace

TEST_CASE("gradient accumulation: N micro-batches step as one batch of all their samples",
          "[optim][accumulation]") {
  const char* policy = GENERATE("float32", "mixed_float16");
  CAPTURE(policy);
  mt::PolicyScope scope(policy);
  auto accumulated = accumulation_model(3), whole = accumulation_model(3);
  const auto loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  // clipnorm: clipping happens once, on the mean.
  const mo::AdamOptions adam{.learning_rate = 0.05, .clipping = {.global_clipnorm = 0.5}};
  accumulated->compile(
      {.loss = loss, .optimizer = mo::Adam(adam), .gradient_accumulation_steps = 4});
  whole->compile({.loss = loss, .optimizer = mo::Adam(adam)});
  REQUIRE(accumulated->optimizer()->name() == "GradientAccumulationOptimizer");
  CHECK((accumulated->optimizer()->loss_scale_optimizer() != nullptr) ==
        (std::string(policy) == "mixed_float16"));
  mt::manual_seed(4);
  for (int step = 0; step < 3; ++step) {
    const mt::Tensor x = mt::normal({32, 6});
    const mt::Tensor y = mt::cast(mt::uniform({32}, 0.0, 3.0), mt::kInt64);
    whole->train_step(x, y);
    for (int m = 0; m < 4; ++m) {
      CHECK(accumulated->optimizer()->iterations() == step);  // not before the 4th
      accumulated->train_step(x.slice(0, 8 * m, 8 * m + 8), y.slice(0, 8 * m, 8 * m + 8));
    }
    CHECK(accumulated->optimizer()->iterations() == step + 1);
  }
  // To float32 rounding (measured 4e-8), and to 16-bit rounding under mixed_float16 (7e-5:
  // each micro-batch rounds its own forward pass to float16).
  CHECK(max_rel_diff(accumulated->weights(), whole->weights()) <
        (std::string(policy) == "float32" ? 1e-6 : 5e-4));
}

TEST_CASE("gradient accumulation: one overflowing micro-batch skips the whole step",
          "[optim][accumulation][loss_scale]") {
  mt::PolicyScope scope("mixed_float16");
  auto model = accumulation_model(5);
  model->compile({.loss = mt::losses::MeanSquaredError(),
                  .optimizer = mo::SGD({.learning_rate = 0.1}),
                  .gradient_accumulation_steps = 3});
  const mo::LossScaleOptimizer* lso = model->optimizer()->loss_scale_optimizer();
  REQUIRE(lso != nullptr);
  const double scale = lso->loss_scale();
  std::vector<std::vector<float>> before;
  for (const auto& w : model->weights()) before.push_back(w.to_vector<float>());
  const mt::Tensor x = mt::normal({4, 6});
  const mt::Tensor y = mt::normal({4, 3});
  model->train_step(x, y);
  model->train_step(x, y * 1e4);  // its scaled gradients overflow float16
  model->train_step(x, y);
  CHECK(lso->skipped_steps() == 1);
  CHECK(lso->applied_steps() == 0);
  CHECK(lso->loss_scale() == scale / 2);
  CHECK(model->optimizer()->iterations() == 0);
  for (std::size_t i = 0; i < before.size(); ++i)
    CHECK(model->weights()[i].to_vector<float>() == before[i]);
  // The next three finite micro-batches step once.
  for (int m = 0; m < 3; ++m) model->train_step(x, y);
  CHECK(lso->applied_steps() == 1);
  CHECK(model->optimizer()->iterations() == 1);
  CHECK(model->weights()[0].to_vector<float>() != before[0]);
}

TEST_CASE("gradient accumulation: a custom loop through the chain, and bad input",
          "[optim][accumulation]") {
  mt::manual_seed(6);
  mt::Variable w(mt::normal({4, 2}), "w"), v(mt::normal({4, 2}), "v");
  mt::Variable reference(w, "reference");
  const mt::Tensor x = mt::normal({8, 4}), y = mt::normal({8, 2});
  mo::GradientAccumulationOptimizer acc(mo::SGD({.learning_rate = 0.5}), 2);
  mo::SGD sgd({.learning_rate = 0.5});
  const auto loss_of = [](const mt::Tensor& xs, const mt::Tensor& ys, const mt::Variable& p) {
    return mt::mean(mt::square(mt::matmul(xs, p) - ys));
  };
  for (int m = 0; m < 2; ++m) {
    mt::GradientTape tape;
    const mt::Tensor loss = loss_of(x.slice(0, 4 * m, 4 * m + 4), y.slice(0, 4 * m, 4 * m + 4), w);
    acc.apply_gradients(acc.compute_gradients(tape, loss, {w}), {w});
    CHECK(acc.pending() == (m == 0 ? 1 : 0));
  }
  {
    mt::GradientTape tape;
    const mt::Tensor loss = loss_of(x, y, reference);
    sgd.apply_gradients(sgd.compute_gradients(tape, loss, {reference}), {reference});
  }
  CHECK(max_rel_diff({w}, {reference}) < 1e-6);
  CHECK(acc.iterations() == 1);

  CHECK_THAT(error_of<mt::ValueError>([] { mo::GradientAccumulationOptimizer(mo::SGD(), 0); }),
             Contains("gradient_accumulation_steps must be >= 1; got 0"));
  auto model = accumulation_model(7);
  CHECK_THAT(
      error_of<mt::ValueError>([&] {
        model->compile({.loss = mt::losses::MeanSquaredError(), .gradient_accumulation_steps = -2});
      }),
      Contains("gradient_accumulation_steps must be >= 1; got -2"));
  CHECK_FALSE(model->compiled());
  // Other variables in the middle of a step.
  acc.apply_gradients({mt::ones({4, 2})}, {w});
  CHECK_THAT(error_of<mt::ValueError>([&] {
               acc.apply_gradients({mt::ones({4, 2})}, {v});
             }),
             Contains("micro-batch 2 of 2 gives other variables"));
  CHECK(acc.pending() == 1);
}
