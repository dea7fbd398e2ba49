// The 16-bit copy a float32 autocast variable keeps between reads (mixtape/autograd/
// autocast.h): reused while the variable is unwritten (reads of any kind keep it), made again
// after any writer's access to its data, and written by the optimizers beside their update,
// bit for bit the cast.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;

namespace {

// The raw bits of a tensor (copied to the host), for bit-for-bit comparisons.
std::vector<unsigned char> bits(const mt::Tensor& t) {
  const mt::Tensor host = t.contiguous().to(mt::Device::cpu());
  std::vector<unsigned char> out(host.nbytes());
  if (!out.empty()) std::memcpy(out.data(), host.data_ptr(), out.size());
  return out;
}

// The variable read as an op under autocast to `dtype` reads it.
mt::Tensor read(const mt::Variable& v, mt::DType dtype) {
  mt::AutocastScope scope(dtype);
  return mt::autocast(v);
}

// A float32 autocast variable with values in [-2, 2) and a few beyond float16's range.
mt::Variable weights(std::int64_t n, std::uint64_t seed) {
  mt::manual_seed(seed);
  mt::Tensor init = mt::uniform({n}, -2.0, 2.0);
  init.data<float>()[1] = 70000.0f;  // float16: inf
  init.data<float>()[2] = -1e-30f;   // float16: -0; bfloat16: a normal number
  init.data<float>()[3] = 3.0e-39f;  // subnormal in float32 and bfloat16
  mt::Variable v(init, "layer/kernel");
  v.set_autocast(true);
  return v;
}

// The copy a variable keeps now (null when none).
const mt::TensorImpl* kept_copy(const mt::Tensor& v) {
  mt::VariableInfo& info = *v.impl_ptr()->variable;
  std::lock_guard<std::mutex> lock(info.mutex);
  return info.autocast_copy.copy.get();
}

}  // namespace

TEST_CASE("autocast copy: reused while the variable is unwritten, made again after any write",
          "[autocast]") {
  for (const mt::DType dt : {mt::kBFloat16, mt::kFloat16}) {
    INFO(dt.name());
    mt::Variable w = weights(3000, 5);
    const auto want = bits(mt::cast(w, dt));
    const mt::Tensor first = read(w, dt);
    CHECK(first.dtype() == dt);
    CHECK(bits(first) == want);

    // A second read casts nothing (no kernel touched the variable) and shares the data, as
    // a tensor of its own.
    const std::uint64_t version = w.storage()->version();
    const mt::Tensor second = read(w, dt);
    CHECK(w.storage()->version() == version);
    CHECK(second.storage() == first.storage());
    CHECK(second.id() != first.id());

    // Reading the variable is no write: kernels reading it in float32, its values copied to
    // the host, a view of it read; the version stays and the next read reuses the copy.
    const std::vector<std::pair<std::string, std::function<void()>>> reads = {
        {"a reduction", [&] { (void)mt::sum(w).item<double>(); }},
        {"a product",
         [&] {
           (void)mt::matmul(w.reshape({1, 3000}), mt::ones({3000, 2}));
         }},
        {"a cast", [&] { (void)mt::cast(w, dt); }},
        {"to_vector", [&] { (void)w.to_vector<float>(); }},
        {"const_data", [&] { CHECK(w.const_data<float>()[17] == w.to_vector<float>()[17]); }},
        {"a view's const_data_ptr",
         [&] { (void)mt::Tensor::view_of(w, {10}, {1}, 100).const_data_ptr(); }},
    };
    for (const auto& [name, read_it] : reads) {
      INFO(name);
      read_it();
      CHECK(w.storage()->version() == version);
      CHECK(read(w, dt).storage() == first.storage());
    }

    // The gradient through a reused copy reaches the variable in float32.
    {
      mt::GradientTape tape;
      const mt::Tensor x = mt::uniform({3000}, -1.0, 1.0, dt);
      mt::Tensor y;
      {
        mt::AutocastScope scope(dt);
        y = mt::sum(x * w);
      }
      const mt::Tensor g = tape.gradient(y, w);
      REQUIRE(g.defined());
      CHECK(g.dtype() == mt::kFloat32);
      CHECK(bits(g) == bits(mt::cast(x, mt::kFloat32)));
    }

    // Every way of changing the variable: the next read is the new values' cast.
    const std::vector<std::pair<std::string, std::function<void()>>> changes = {
        {"assign", [&] { w.assign(mt::uniform({3000}, -1.0, 1.0)); }},
        {"assign_add", [&] { w.assign_add(mt::full({3000}, 0.25, mt::kFloat32)); }},
        {"assign_sub", [&] { w.assign_sub(mt::full({3000}, 0.125, mt::kFloat32)); }},
        {"a write through data()", [&] { w.data<float>()[17] = 1.00390625f; }},
        {"a write through a view",
         [&] {
           const mt::Tensor view = mt::Tensor::view_of(w, {10}, {1}, 100);
           static_cast<float*>(view.data_ptr())[0] = -3.5f;
         }},
        {"an optimizer step",
         [&] {
           mo::SGD sgd;
           sgd.apply_gradients({mt::uniform({3000}, -1.0, 1.0)}, {w});
         }},
    };
    mt::Tensor before = read(w, dt);
    for (const auto& [name, change] : changes) {
      INFO(name);
      change();
      const mt::Tensor after = read(w, dt);
      CHECK(after.storage() != before.storage());
      CHECK(bits(after) == bits(mt::cast(w, dt)));
      before = after;
    }
  }
}

TEST_CASE("autocast copy: the optimizers write it beside the update, bit for bit the cast",
          "[autocast][optim]") {
  const std::vector<std::pair<std::string, std::function<std::shared_ptr<mo::Optimizer>()>>>
      optimizers = {
          {"sgd", [] { return std::make_shared<mo::SGD>(); }},
          {"sgd momentum",
           [] { return std::make_shared<mo::SGD>(mo::SGDOptions{.momentum = 0.9}); }},
          {"rmsprop centered momentum",
           [] {
             return std::make_shared<mo::RMSprop>(
                 mo::RMSpropOptions{.momentum = 0.3, .centered = true});
           }},
          {"adam", [] { return std::make_shared<mo::Adam>(); }},
          {"adamw", [] { return std::make_shared<mo::AdamW>(); }},
      };
  std::uint64_t seed = 40;
  for (const auto& [name, make] : optimizers) {
    for (const mt::DType dt : {mt::kBFloat16, mt::kFloat16}) {
      // 70,001 elements: several parallel blocks and a ragged end.
      for (const std::int64_t n : {std::int64_t{5}, std::int64_t{70001}}) {
        INFO(fmt::format("{} {} {} elements", name, dt.name(), n));
        mt::Variable w = weights(n, ++seed);
        auto opt = make();
        read(w, dt);  // the first read casts and keeps the copy's dtype
        for (int step = 0; step < 3; ++step) {
          opt->apply_gradients({mt::uniform({n}, -1.0, 1.0)}, {w});
          const std::uint64_t version = w.storage()->version();
          const mt::Tensor r = read(w, dt);
          CHECK(w.storage()->version() == version);  // the optimizer's copy, no cast
          CHECK(bits(r) == bits(mt::cast(w, dt)));
        }
      }
    }
  }
}

TEST_CASE("autocast copy: a step the loss scale skips leaves the copy the variable's cast",
          "[autocast][optim]") {
  for (const mo::StepDecision decision : {mo::StepDecision::Host, mo::StepDecision::Device}) {
    INFO((decision == mo::StepDecision::Host ? "decided on the host" : "decided on the device"));
    // w takes a step and a skipped one; twin the same step alone (reading w's values
    // between the steps would touch it).
    mt::Variable w = weights(4099, 77), twin = weights(4099, 77);
    mo::LossScaleOptimizer opt(mo::Adam(), mt::LossScale::dynamic(), {.decision = decision});
    mo::LossScaleOptimizer twin_opt(mo::Adam(), mt::LossScale::dynamic(), {.decision = decision});
    read(w, mt::kFloat16);
    const mt::Tensor g = mt::uniform({4099}, -1.0, 1.0);
    opt.apply_gradients({g}, {w});
    twin_opt.apply_gradients({g}, {twin});
    mt::Tensor bad = mt::uniform({4099}, -1.0, 1.0);
    bad.data<float>()[7] = std::numeric_limits<float>::infinity();
    opt.apply_gradients({bad}, {w});
    CHECK(opt.last_step_skipped());
    const std::uint64_t version = w.storage()->version();
    const mt::Tensor r = read(w, mt::kFloat16);
    CHECK(w.storage()->version() == version);  // the copy of the first step, or the skip's
    CHECK(bits(w) == bits(twin));
    CHECK(bits(r) == bits(mt::cast(w, mt::kFloat16)));
  }
}

TEST_CASE("autocast copy: training reads the kept copies and ends bit for bit where casts would",
          "[autocast][training]") {
  for (const std::string policy : {"mixed_bfloat16", "mixed_float16"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    auto train = [&](bool drop_copies) {
      mt::manual_seed(3);
      auto model = mt::Sequential({ml::Dense(64, {.activation = "relu"}), ml::Dense(4)});
      mo::LossScaleOptimizer opt(mo::Adam({.learning_rate = 1e-2}), mt::LossScale::dynamic());
      auto loss_object = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
      std::uint64_t untouched_reads = 0;
      model(mt::uniform({32, 20}, -1.0, 1.0));  // builds the variables
      for (int step = 0; step < 6; ++step) {
        mt::manual_seed(100 + static_cast<std::uint64_t>(step));
        const mt::Tensor x = mt::uniform({32, 20}, -1.0, 1.0);
        std::vector<std::int64_t> labels(32);
        for (std::size_t i = 0; i < labels.size(); ++i)
          labels[i] = static_cast<std::int64_t>((i * 7 + static_cast<std::size_t>(step)) % 4);
        const mt::Tensor y = mt::from_vector<std::int64_t>(labels, {32});
        std::vector<const mt::TensorImpl*> copies;
        for (const auto& v : model.trainable_variables()) {
          // A writer's access is what drops a copy: the next read casts again.
          if (drop_copies) v.storage()->mutable_data();
          copies.push_back(kept_copy(v));
        }
        mt::GradientTape tape;
        const mt::Tensor loss = loss_object(y, model(x, {.training = true}));
        const auto vars = model.trainable_variables();
        for (std::size_t i = 0; i < vars.size(); ++i)
          if (kept_copy(vars[i]) == copies[i]) ++untouched_reads;
        auto grads = opt.get_unscaled_gradients(
            tape.gradient(opt.get_scaled_loss(loss), model.trainable_variables()));
        opt.apply_gradients(grads, model.trainable_variables());
      }
      std::vector<std::vector<unsigned char>> out;
      for (const auto& v : model.trainable_variables()) out.push_back(bits(v));
      return std::make_pair(out, untouched_reads);
    };
    const auto [kept, kept_untouched] = train(false);
    const auto [dropped, dropped_untouched] = train(true);
    CHECK(kept == dropped);
    // Each step's forward pass read all four variables without touching them (the copies
    // of the building call, then the optimizer's); with the copies dropped, it cast each one
    // again: the kernels, and the biases, whose 16-bit values the fused linear op of Dense adds
    // (it records the float32 bias, for a float32 gradient).
    CHECK(kept_untouched == 6 * 4);
    CHECK(dropped_untouched == 0);
  }
}

TEST_CASE("autocast copy: keep_autocast_copy refuses a copy that does not fit", "[autocast]") {
  mt::Variable w = weights(6, 1);
  const auto message = [&](const mt::Tensor& copy) {
    try {
      mt::keep_autocast_copy(w, copy);
    } catch (const mt::ValueError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(message(mt::zeros({5}, mt::kBFloat16)),
             Catch::Contains("bfloat16[5]") && Catch::Contains("layer/kernel"));
  CHECK_THAT(message(mt::zeros({6}, mt::kFloat64)), Catch::Contains("float64"));
  CHECK_THAT(message(mt::Tensor()), Catch::Contains("undefined"));
  mt::Tensor plain = mt::zeros({6});
  CHECK_THROWS_AS(mt::keep_autocast_copy(plain, mt::zeros({6}, mt::kFloat16)), mt::ValueError);
  // A fitting one is kept: the next read returns its data.
  const mt::Tensor fit = mt::cast(w, mt::kFloat16);
  mt::keep_autocast_copy(w, fit);
  CHECK(read(w, mt::kFloat16).storage() == fit.storage());
}

TEST_CASE("the tape widens the gradients of variables read through 16-bit copies together",
          "[autocast][tape][census]") {
  // Variables read under autocast get float16 / bfloat16 gradients that the cast's backward
  // widens; the tape defers those casts to one cast_list call per dtype pair. The gradients
  // are those of the cast-by-cast walk to the bit (a tape recording the walk, which needs
  // recorded casts, takes it), also for a variable read twice through its copy and once in
  // float32, whose contributions add up in the same order.
  for (const mt::DType dt : {mt::kBFloat16, mt::kFloat16}) {
    INFO(dt.name());
    std::vector<mt::Variable> vars;
    for (int i = 0; i < 12; ++i) vars.push_back(weights(40 + i, 100 + i));
    mt::Variable f64(mt::uniform({5}, -1.0, 1.0).to(mt::kFloat64), "f64");
    const mt::Tensor x = mt::uniform({40}, -1.0, 1.0);
    const auto loss_of = [&] {
      mt::Tensor total = mt::sum(mt::cast(f64, mt::kFloat32) * 0.5);
      for (std::size_t i = 0; i < vars.size(); ++i) {
        const mt::Tensor a = read(vars[i], dt), b = read(vars[i], dt);
        const mt::Tensor head = mt::cast((a * b).slice(0, 0, 40), mt::kFloat32);
        total = total + mt::sum(head * x) + mt::sum(vars[i] * 0.25);
      }
      return total;
    };
    std::vector<mt::Tensor> sources(vars.begin(), vars.end());
    sources.push_back(f64);
    // The kernels of the backward walks alone.
    std::vector<mt::Tensor> together;
    std::int64_t casts = 0;
    {
      mt::GradientTape tape;
      const mt::Tensor loss = loss_of();
      mt::KernelCensus census;
      together = tape.gradient(loss, sources);
      casts = census.count(mt::OpId::cast);
      CHECK(census.count(mt::OpId::cast_list) == 2);  // dt -> float32, float32 -> float64
    }
    std::vector<mt::Tensor> one_by_one;
    {
      mt::GradientTape outer;  // recording: the tape casts one by one, as recorded ops
      mt::GradientTape tape;
      const mt::Tensor loss = loss_of();
      mt::KernelCensus census;
      one_by_one = tape.gradient(loss, sources);
      CHECK(census.count(mt::OpId::cast_list) == 0);
      // Each read's gradient widened on its own: two reads of 12 variables, and f64.
      CHECK(census.count(mt::OpId::cast) == casts + 2 * 12 + 1);
    }
    for (std::size_t i = 0; i < sources.size(); ++i) {
      INFO("source " << i);
      REQUIRE(together[i].dtype() == sources[i].dtype());
      CHECK(bits(together[i]) == bits(one_by_one[i]));
    }
  }
}
