// Step capture (mixtape/core/capture.h) on the CPU: a captured training step replayed against
// the same steps run eagerly, bit for bit, under float32 and mixed_bfloat16 with each built-in
// optimizer, a learning-rate schedule and clipping; dropout and random augmentation, which
// draw afresh at each replay; what a capture cannot do (CaptureError, nothing recorded); the
// checks that every replay repeats.
#include <catch2/catch.hpp>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "error_of.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace mo = mixtape::optim;
using mixtape_test::error_of;

namespace {

struct Batch {
  mt::Tensor x, y;
};

// Batches of a 3-class problem in `dims` dimensions, fresh random values.
std::vector<Batch> make_batches(int count, std::uint64_t seed, std::int64_t dims = 12) {
  mt::Generator gen(seed);
  std::vector<Batch> out;
  for (int b = 0; b < count; ++b) {
    std::vector<double> xs;
    std::vector<std::int64_t> ys;
    for (int i = 0; i < 32; ++i) {
      const auto label = static_cast<std::int64_t>(gen.next_u64() % 3);
      ys.push_back(label);
      for (std::int64_t d = 0; d < dims; ++d)
        xs.push_back(0.5 * static_cast<double>(label) + gen.next_normal());
    }
    out.push_back({mt::from_vector(xs, {32, dims}), mt::from_vector(ys, {32})});
  }
  return out;
}

// The model of these tests (the same weights every time), and the same one on the heap.
std::pair<mt::layers::SymbolicTensor, mt::layers::SymbolicTensor> model_graph() {
  mt::manual_seed(11);
  auto inputs = mt::layers::Input({12});
  auto x = mt::layers::Dense(24, {.activation = "relu"})(inputs);
  x = mt::layers::Dense(3, {.dtype = "float32"})(x);
  return {inputs, x};
}
mt::Model make_model() {
  const auto [inputs, outputs] = model_graph();
  return mt::Model(inputs, outputs);
}
std::unique_ptr<mt::Model> new_model() {
  const auto [inputs, outputs] = model_graph();
  return std::make_unique<mt::Model>(inputs, outputs);
}

// One training step of `model` on (x, y); returns the loss.
mt::Tensor train_step(mt::Model& model, mo::Optimizer& opt, const mt::Tensor& x,
                      const mt::Tensor& y) {
  static const mt::losses::Loss loss_fn =
      mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  const auto vars = model.trainable_variables();
  mt::GradientTape tape;
  const mt::Tensor loss = loss_fn(y, model(x, {.training = true}));
  const auto grads = opt.compute_gradients(tape, loss, vars);
  opt.apply_gradients(grads, vars);
  return loss;
}

std::vector<double> values(const mt::Tensor& t) { return t.to_vector<double>(); }

using MakeOptimizer = std::function<std::shared_ptr<mo::Optimizer>()>;

// SGD as an optimizer of one's own would be before its update honours the step's flag.
class HostDecidedSGD : public mo::SGD {
 public:
  using mo::SGD::SGD;

 protected:
  bool supports_device_skip() const override { return false; }
};

}  // namespace

TEST_CASE("a captured step replays as the same steps run eagerly, bit for bit", "[capture]") {
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"AdamW, a cosine schedule, global clipping",
       [] {
         return std::make_shared<mo::AdamW>(
             mo::AdamWOptions{.learning_rate = mo::schedules::cosine_decay(0.05, 6, 0.1),
                              .weight_decay = 0.01,
                              .clipping = {.global_clipnorm = 0.5}});
       }},
      {"SGD, Nesterov momentum, a piecewise schedule",
       [] {
         return std::make_shared<mo::SGD>(mo::SGDOptions{
             .learning_rate = mo::schedules::piecewise_constant({2, 4}, {0.2, 0.1, 0.05}),
             .momentum = 0.9,
             .nesterov = true});
       }},
      {"RMSprop, centered, momentum",
       [] {
         return std::make_shared<mo::RMSprop>(
             mo::RMSpropOptions{.learning_rate = 0.01, .momentum = 0.5, .centered = true});
       }},
  };
  const std::vector<Batch> batches = make_batches(6, 3);
  for (const std::string policy : {"float32", "mixed_bfloat16"}) {
    for (const auto& [what, make_optimizer] : optimizers) {
      INFO(policy << ", " << what);
      mt::set_global_policy(policy);
      // Eagerly.
      mt::Model eager = make_model();
      auto eager_opt = make_optimizer();
      mt::Tensor eager_loss;
      for (const auto& b : batches) eager_loss = train_step(eager, *eager_opt, b.x, b.y);

      // Captured: the inputs where the step reads them, the first batch for the warm-up.
      mt::Model model = make_model();
      auto opt = make_optimizer();
      mt::Variable x(batches[0].x, "x", /*trainable=*/false);
      mt::Variable y(batches[0].y, "y", /*trainable=*/false);
      mt::Tensor loss;
      mt::StepGraph graph =
          mt::StepGraph::capture(mt::Device::cpu(), [&] { loss = train_step(model, *opt, x, y); });
      // The capture ran nothing: the state is the warm-up step's.
      CHECK(opt->iterations() == 1);
      {
        mt::Model one = make_model();
        auto one_opt = make_optimizer();
        train_step(one, *one_opt, batches[0].x, batches[0].y);
        for (std::size_t i = 0; i < one.weights().size(); ++i)
          CHECK(values(model.weights()[i]) == values(one.weights()[i]));
      }
      for (std::size_t k = 1; k < batches.size(); ++k) {
        x.assign(batches[k].x);
        y.assign(batches[k].y);
        graph.replay();
      }
      CHECK(graph.replays() == 5);
      CHECK(opt->iterations() == eager_opt->iterations());
      CHECK(loss.item<double>() == eager_loss.item<double>());
      const auto vars = model.trainable_variables(), eager_vars = eager.trainable_variables();
      REQUIRE(vars.size() == eager_vars.size());
      for (std::size_t i = 0; i < vars.size(); ++i) {
        INFO(vars[i].name());
        CHECK(values(vars[i]) == values(eager_vars[i]));
        const auto slots = opt->slots(vars[i]), eager_slots = eager_opt->slots(eager_vars[i]);
        REQUIRE(slots.size() == eager_slots.size());
        for (std::size_t s = 0; s < slots.size(); ++s)
          CHECK(values(slots[s]) == values(eager_slots[s]));
      }
      // After the replays the model is used as usual: the same predictions.
      CHECK(values(model(batches[0].x)) == values(eager(batches[0].x)));
    }
  }
  mt::set_global_policy("float32");
}

namespace {

// A model build() makes, trained with SGD on every batch: eagerly, or with the first batch's
// step captured (the warm-up, then the capture) and the other batches replayed.
struct Trained {
  std::unique_ptr<mt::Model> model;
  std::unique_ptr<mo::SGD> opt;
  mt::Tensor loss;
};
Trained train_on(const std::function<std::unique_ptr<mt::Model>()>& build,
                 const std::vector<Batch>& batches, bool capture) {
  Trained t{build(),
            std::make_unique<mo::SGD>(mo::SGDOptions{.learning_rate = 0.1, .momentum = 0.5}),
            mt::Tensor()};
  if (!capture) {
    for (const auto& b : batches) t.loss = train_step(*t.model, *t.opt, b.x, b.y);
    return t;
  }
  mt::Variable x(batches[0].x, "x", false);
  mt::Variable y(batches[0].y, "y", false);
  mt::StepGraph graph = mt::StepGraph::capture(
      mt::Device::cpu(), [&] { t.loss = train_step(*t.model, *t.opt, x, y); });
  for (std::size_t k = 1; k < batches.size(); ++k) {
    x.assign(batches[k].x);
    y.assign(batches[k].y);
    graph.replay();
  }
  return t;
}

// The captured run of build() against the eager one: the last loss and every weight, bit for
// bit; then one more eager step of each, which draws the same numbers if the layers'
// generators agree.
void check_captured_as_eager(const std::function<std::unique_ptr<mt::Model>()>& build,
                             const std::vector<Batch>& batches) {
  Trained eager = train_on(build, batches, false), captured = train_on(build, batches, true);
  CHECK(captured.loss.item<double>() == eager.loss.item<double>());
  const auto w = captured.model->get_weights(), eager_w = eager.model->get_weights();
  REQUIRE(w.size() == eager_w.size());
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(values(w[i]) == values(eager_w[i]));
  CHECK(values(train_step(*captured.model, *captured.opt, batches[1].x, batches[1].y)) ==
        values(train_step(*eager.model, *eager.opt, batches[1].x, batches[1].y)));
}

}  // namespace

TEST_CASE("a captured step with dropout draws each replay's masks as eager steps do",
          "[capture][dropout]") {
  // A Dropout layer and self-attention with dropout on its weights (the fused op): their seeds
  // are device tensors in the capture, each replay's drawn before it from the layers'
  // generators. Were a replay's masks the capture's, the weights would differ from the eager
  // run's.
  const auto build = [] {
    mt::manual_seed(19);
    namespace ml = mt::layers;
    auto inputs = ml::Input({12});
    auto h = ml::Dense(24, {.activation = "relu"})(inputs);
    h = ml::Dropout(0.3, {.seed = 4})(h);
    auto seq = ml::Reshape({3, 8})(h);
    seq = ml::MultiHeadAttention(2, 4, {.dropout = 0.25, .seed = 6})({seq, seq});
    auto outputs = ml::Dense(3, {.dtype = "float32"})(ml::Flatten()(seq));
    return std::make_unique<mt::Model>(inputs, outputs);
  };
  const std::vector<Batch> batches = make_batches(6, 7);
  for (const std::string policy : {"float32", "mixed_bfloat16"}) {
    INFO(policy);
    mt::set_global_policy(policy);
    check_captured_as_eager(build, batches);
  }
  mt::set_global_policy("float32");
}

TEST_CASE("a captured step with random augmentation draws new moves at each replay",
          "[capture][augmentation]") {
  // RandomTranslation (constant fill: a table that may take the fill row) and RandomFlip draw
  // their tables on the host; in the capture before each replay (host_computed), in the
  // order and with the numbers of eager steps.
  const auto build = [] {
    mt::manual_seed(29);
    namespace ml = mt::layers;
    auto inputs = ml::Input({6, 6, 1});
    auto h = ml::RandomTranslation(0.34, 0.34, {.fill_mode = "constant", .seed = 9})(inputs);
    h = ml::RandomFlip("horizontal_and_vertical", {.seed = 4})(h);
    auto outputs = ml::Dense(3, {.dtype = "float32"})(ml::Flatten()(h));
    return std::make_unique<mt::Model>(inputs, outputs);
  };
  std::vector<Batch> batches;
  mt::Generator gen(31);
  for (int b = 0; b < 6; ++b)
    batches.push_back({mt::uniform({16, 6, 6, 1}, -1.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen),
                       mt::from_vector(std::vector<std::int64_t>(16, b % 3), {16})});
  for (const std::string policy : {"float32", "mixed_float16"}) {
    INFO(policy);
    mt::set_global_policy(policy);
    check_captured_as_eager(build, batches);
  }
  mt::set_global_policy("float32");
  // A host tensor of another shape than declared is an error of the call.
  CHECK_THROWS_AS(mt::host_computed({3}, mt::kInt64, mt::Device::cpu(),
                                    [] { return mt::zeros({2}, mt::kInt64); }),
                  mt::ShapeError);
}

TEST_CASE("a captured step under mixed_float8 scales each replay as eager steps do",
          "[capture][float8]") {
  // The FP8 products' scales come from amaxes computed on the device: this step's (current
  // scaling) or the largest of an amax history that each step rolls (delayed scaling, the
  // histories layer weights). A replay that kept the capture's scales, or did not roll the
  // histories, would give other weights than the eager steps.
  const auto build = [] {
    mt::manual_seed(37);
    namespace ml = mt::layers;
    auto inputs = ml::Input({32});
    auto h = ml::Dense(32, {.activation = "relu"})(inputs);
    h = ml::Dense(16, {.activation = "gelu"})(h);
    auto outputs = ml::Dense(3, {.dtype = "float32"})(h);
    return std::make_unique<mt::Model>(inputs, outputs);
  };
  const std::vector<Batch> batches = make_batches(6, 41, 32);
  for (const std::string policy : {"mixed_float8", "mixed_float8_delayed(history=4, margin=1)"}) {
    INFO(policy);
    mt::set_global_policy(mt::Policy(policy));
    {
      // The products do run in FP8 (not the bfloat16 fallback of shapes FP8 cannot take).
      const auto model = build();
      const std::string trace = mt::trace_dtypes(*model, batches[0].x).table();
      CHECK_THAT(trace, Catch::Contains("float8 matmul"));
      CHECK_THAT(trace, !Catch::Contains("bfloat16 matmul"));
    }
    check_captured_as_eager(build, batches);
  }
  mt::set_global_policy("float32");
}

TEST_CASE("what a captured step cannot do throws CaptureError and leaves nothing recorded",
          "[capture]") {
  mt::set_global_policy("float32");
  const std::vector<Batch> batches = make_batches(2, 5);
  mt::Model model = make_model();
  mo::SGD opt({.learning_rate = 0.1});
  mt::Variable x(batches[0].x, "x", false);
  mt::Variable y(batches[0].y, "y", false);
  const auto capture_error = [&](const std::function<void()>& step) {
    mt::StepGraph graph;
    const std::string message = error_of<mt::CaptureError>(
        [&] { graph = mt::StepGraph::capture(mt::Device::cpu(), step); });
    CHECK(graph.empty());
    CHECK_FALSE(mt::capture::active());
    return message;
  };

  SECTION("a host read of a value the capture computes") {
    const std::string m = capture_error([&] {
      const mt::Tensor loss = train_step(model, opt, x, y);
      (void)loss.item<float>();
    });
    CHECK_THAT(m, Catch::Contains("Tensor::item / to_vector") && Catch::Contains("cpu"));
  }
  SECTION("a random draw from a Generator") {
    const std::string m = capture_error([&] {
      const mt::Tensor noise = mt::normal({32, 12}, 0.0, 0.1);
      train_step(model, opt, x + noise, y);
    });
    CHECK_THAT(m, Catch::Contains("random draw"));
  }
  SECTION("a LossScaleOptimizer around an optimizer whose updates ignore the step's flag") {
    mo::LossScaleOptimizer lso(std::make_shared<HostDecidedSGD>(mo::SGDOptions{}));
    const std::string m = capture_error([&] { train_step(model, lso, x, y); });
    CHECK_THAT(m, Catch::Contains("keeps the loss scale on the device") &&
                      Catch::Contains("it wraps SGD"));
  }
  SECTION("a capture inside a capture") {
    const std::string m = capture_error([&] { mt::StepGraph::capture(mt::Device::cpu(), [] {}); });
    CHECK_THAT(m, Catch::Contains("do not nest"));
  }
  SECTION("a replay of another captured step") {
    mt::StepGraph inner =
        mt::StepGraph::capture(mt::Device::cpu(), [&] { train_step(model, opt, x, y); });
    const std::string m = capture_error([&] { inner.replay(); });
    CHECK_THAT(m, Catch::Contains("StepGraph::replay") && Catch::Contains("inside another"));
    CHECK(inner.replays() == 1);  // the warm-up's, before the capture
  }
  SECTION("work a backend queues on another device than the captured one") {
    // What a GPU kernel's launch checks (capture::detail::check_launch), called as the CUDA
    // backend's kernels call it, after the step's kernels, for another device (a GPU's work
    // while the CPU captures: what a kernel on cuda:0 meets while cuda:1 captures).
    const std::string m = capture_error([&] {
      train_step(model, opt, x, y);
      mt::capture::detail::check_launch(mt::Device::cpu());  // the captured device: nothing
      mt::capture::detail::check_launch(mt::Device::cuda(0));
    });
    CHECK_THAT(m, Catch::Contains("work queued on cuda:0 while capturing a step on cpu") &&
                      Catch::Contains("not be replayed") && Catch::StartsWith("sgd_update"));
    mt::capture::detail::check_launch(mt::Device::cuda(0));  // not capturing: nothing
  }
  // After each failure the thread steps eagerly as before.
  const auto before = opt.iterations();
  train_step(model, opt, x, y);
  CHECK(opt.iterations() == before + 1);
  CHECK_THAT(error_of<mt::Error>([] { mt::StepGraph().replay(); }),
             Catch::Contains("nothing captured"));
}

TEST_CASE("every replay of a captured step checks its indices and its gradients", "[capture]") {
  mt::set_global_policy("float32");
  const std::vector<Batch> batches = make_batches(2, 9);
  mt::Model model = make_model();
  mo::SGD opt({.learning_rate = 0.1});
  mt::Variable x(batches[0].x, "x", false);
  mt::Variable y(batches[0].y, "y", false);
  mt::StepGraph graph =
      mt::StepGraph::capture(mt::Device::cpu(), [&] { train_step(model, opt, x, y); });

  SECTION("a label out of range: IndexError from the replay") {
    std::vector<std::int64_t> labels(32, 1);
    labels[7] = 3;
    y.assign(mt::from_vector(labels, {32}));
    CHECK_THAT(error_of<mt::IndexError>([&] { graph.replay(); }),
               Catch::Contains("labels must lie in [0, 3)") && Catch::Contains("got 3"));
  }
  SECTION("a non-finite gradient: the replay changes nothing, the next one reports it") {
    graph.replay();  // a finite step
    const auto weights = model.get_weights();
    std::vector<double> xs = values(batches[1].x);
    xs[5] = std::numeric_limits<double>::infinity();
    x.assign(mt::from_vector(xs, {32, 12}));
    graph.replay();  // skipped on the device
    const auto after = model.get_weights();
    for (std::size_t i = 0; i < weights.size(); ++i) CHECK(values(after[i]) == values(weights[i]));
    x.assign(batches[1].x);
    CHECK_THAT(error_of<mt::NumericError>([&] { graph.replay(); }),
               Catch::Contains("SGD") && Catch::Contains("at step 3"));
  }
  SECTION("a non-finite gradient in the last replay: check_pending reports it") {
    graph.replay();
    std::vector<double> xs = values(batches[1].x);
    xs[5] = std::numeric_limits<double>::quiet_NaN();
    x.assign(mt::from_vector(xs, {32, 12}));
    graph.replay();
    CHECK_THAT(error_of<mt::NumericError>([&] { opt.check_pending(); }),
               Catch::Contains("SGD") && Catch::Contains("at step 3"));
    opt.check_pending();  // reported once
  }
}

TEST_CASE("weights assigned between replays are what the next replay reads", "[capture]") {
  // Under mixed_bfloat16 the forward pass reads the weights' 16-bit copies, which the captured
  // updates write: an assignment between replays must reach them.
  mt::set_global_policy("mixed_bfloat16");
  const std::vector<Batch> batches = make_batches(4, 13);
  mt::Model eager = make_model();
  mo::Adam eager_opt({.learning_rate = 0.02});
  const auto initial = eager.get_weights();
  for (int k = 0; k < 2; ++k) train_step(eager, eager_opt, batches[k].x, batches[k].y);
  eager.set_weights(initial);
  for (int k = 2; k < 4; ++k) train_step(eager, eager_opt, batches[k].x, batches[k].y);

  mt::Model model = make_model();
  mo::Adam opt({.learning_rate = 0.02});
  mt::Variable x(batches[0].x, "x", false);
  mt::Variable y(batches[0].y, "y", false);
  mt::StepGraph graph =
      mt::StepGraph::capture(mt::Device::cpu(), [&] { train_step(model, opt, x, y); });
  x.assign(batches[1].x);
  y.assign(batches[1].y);
  graph.replay();
  model.set_weights(initial);
  for (int k = 2; k < 4; ++k) {
    x.assign(batches[k].x);
    y.assign(batches[k].y);
    graph.replay();
  }
  const auto w = model.get_weights(), eager_w = eager.get_weights();
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(values(w[i]) == values(eager_w[i]));
  mt::set_global_policy("float32");
}

TEST_CASE("a captured step under loss scaling skips and rescales as eager steps do", "[capture]") {
  // mixed_float16 with a dynamic scale that grows every 2 good steps, and batches with an
  // infinity: the replays skip them and halve the scale as the eager steps do. The host reads
  // a replay's flag only when it queues the third replay after it, so the wrapped optimizer's
  // count is not known on the host when a replay is queued after a skipped one: the replay
  // picks its learning rate and Adam's bias correction on the device: row 1 of its rates for
  // the replays of batches 4, 5, 8 and 10, row 2 for batch 9's (two of the three flags unread
  // set), row 0 for the others.
  mt::set_global_policy("mixed_float16");
  std::vector<Batch> batches = make_batches(12, 17);
  const std::vector<std::size_t> skipped_batches = {3, 7, 8};
  for (std::size_t k : skipped_batches) {
    std::vector<double> xs = values(batches[k].x);
    xs[40 + k] = std::numeric_limits<double>::infinity();
    batches[k].x = mt::from_vector(xs, {32, 12});
  }
  // A fixed scale that is not a power of two: its inverse is read on the device as a float64,
  // as the eager step's is passed as a number.
  const mt::LossScale scale =
      GENERATE(mt::LossScale::dynamic({.initial_scale = 256, .growth_interval = 2}),
               mt::LossScale::fixed(1000));
  INFO(scale.str());
  const auto make_lso = [&] {
    return std::make_shared<mo::LossScaleOptimizer>(
        std::make_shared<mo::Adam>(
            mo::AdamOptions{.learning_rate = mo::schedules::exponential_decay(0.02, 3, 0.5)}),
        scale);
  };
  mt::Model eager = make_model();
  auto eager_opt = make_lso();
  std::vector<double> eager_scales;  // after each step
  std::vector<std::int64_t> eager_counts;
  for (const auto& b : batches) {
    train_step(eager, *eager_opt, b.x, b.y);
    eager_scales.push_back(eager_opt->loss_scale());
    eager_counts.push_back(eager_opt->iterations());
  }

  mt::Model model = make_model();
  auto opt = make_lso();
  mt::Variable x(batches[0].x, "x", false);
  mt::Variable y(batches[0].y, "y", false);
  // The step's loss scaled again after its update: by the scale the replay left on the device.
  mt::Tensor loss, rescaled;
  mt::StepGraph graph = mt::StepGraph::capture(mt::Device::cpu(), [&] {
    loss = train_step(model, *opt, x, y);
    rescaled = opt->get_scaled_loss(loss);
  });
  for (std::size_t k = 1; k < batches.size(); ++k) {
    x.assign(batches[k].x);
    y.assign(batches[k].y);
    graph.replay();
    INFO("replay " << k);
    // The flags of the last three replays are not read yet: the wrapped optimizer counts
    // those skipped (the eager count plus them).
    std::int64_t unread_skips = 0;
    for (std::size_t s : skipped_batches) unread_skips += s + 3 > k && s <= k ? 1 : 0;
    CHECK(opt->inner_optimizer().iterations() == eager_counts[k] + unread_skips);
    // Bit for bit (the batch with an infinity gives NaN on both sides).
    CHECK(mt::detail::host_bytes(rescaled) == mt::detail::host_bytes(loss * eager_scales[k]));
  }
  CHECK(eager_opt->skipped_steps() == 3);
  CHECK(opt->skipped_steps() == eager_opt->skipped_steps());
  CHECK(opt->applied_steps() == eager_opt->applied_steps());
  CHECK(opt->loss_scale() == eager_opt->loss_scale());
  CHECK(opt->iterations() == eager_opt->iterations());
  const auto w = model.get_weights(), eager_w = eager.get_weights();
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(values(w[i]) == values(eager_w[i]));
  mt::set_global_policy("float32");
}

TEST_CASE("fit with compile({.capture_step = true}) trains as fit without it, bit for bit",
          "[capture]") {
  // 200 samples in batches of 64: three replayed batches and a partial one stepped as usual
  // each epoch; validation between epochs; every policy (mixed_float16 with loss scaling).
  std::vector<double> xs;
  std::vector<std::int64_t> ys;
  mt::Generator gen(23);
  for (int i = 0; i < 200; ++i) {
    const auto label = static_cast<std::int64_t>(gen.next_u64() % 3);
    ys.push_back(label);
    for (int d = 0; d < 12; ++d) xs.push_back(0.5 * static_cast<double>(label) + gen.next_normal());
  }
  const mt::Tensor x = mt::from_vector(xs, {200, 12}), y = mt::from_vector(ys, {200});
  for (const std::string policy : {"float32", "mixed_float16", "mixed_bfloat16"}) {
    INFO(policy);
    mt::set_global_policy(policy);
    const auto train = [&](bool capture) {
      auto model = new_model();
      model->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                      .optimizer = mo::Adam({.learning_rate = 0.01}),
                      .metrics = {"accuracy"},
                      .capture_step = capture});
      const mt::History h = model->fit(
          x, y, {.batch_size = 64, .epochs = 3, .validation_split = 0.1, .seed = 5, .verbose = 0});
      return std::make_pair(std::move(model), h);
    };
    const auto [eager, eager_history] = train(false);
    const auto [captured, history] = train(true);
    CHECK(history.history == eager_history.history);
    const auto w = captured->get_weights(), eager_w = eager->get_weights();
    for (std::size_t i = 0; i < w.size(); ++i) CHECK(values(w[i]) == values(eager_w[i]));
    CHECK(captured->optimizer()->iterations() == eager->optimizer()->iterations());
    // A batch of the captured shapes is a replay: a few kernels beside the graph (the batch's
    // copies, the metrics), against the whole step's.
    const mt::Tensor xb = mt::slice(x, 0, 0, 64), yb = mt::slice(y, 0, 0, 64);
    mt::KernelCensus replayed;
    captured->train_step(xb, yb);
    const std::int64_t replayed_kernels = replayed.total();
    mt::KernelCensus stepped;
    eager->train_step(xb, yb);
    INFO(replayed.table() << " against " << stepped.table());
    CHECK(replayed_kernels * 2 < stepped.total());
  }
  mt::set_global_policy("float32");
}
