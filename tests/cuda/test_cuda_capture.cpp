// Step capture on the GPU (mixtape/core/capture.h: a CUDA graph): replays against the same
// steps run eagerly on the GPU, bit for bit (with dropout too: its seeds on the device, redrawn
// before each replay); host constants made during the capture; the
// capture's memory pool; what a GPU capture refuses.
#include <catch2/catch.hpp>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace mo = mixtape::optim;
using ctest_util::kGpu;

namespace {

struct Batch {
  mt::Tensor x, y;
};

std::vector<Batch> gpu_batches(int count, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<Batch> out;
  for (int b = 0; b < count; ++b) {
    std::vector<double> xs;
    std::vector<std::int64_t> ys;
    for (int i = 0; i < 64; ++i) {
      const auto label = static_cast<std::int64_t>(gen.next_u64() % 5);
      ys.push_back(label);
      for (int d = 0; d < 32; ++d)
        xs.push_back(0.3 * static_cast<double>(label) + gen.next_normal());
    }
    out.push_back({mt::from_vector(xs, {64, 32}).to(kGpu), mt::from_vector(ys, {64}).to(kGpu)});
  }
  return out;
}

// With dropout: a Dropout layer and self-attention with dropout on its weights (their seeds
// device tensors in the capture, redrawn before each replay).
std::unique_ptr<mt::Model> gpu_model(bool dropout = false) {
  mt::manual_seed(21);
  auto inputs = mt::layers::Input({32});
  auto x = mt::layers::Dense(64, {.activation = "gelu"})(inputs);
  if (dropout) {
    x = mt::layers::Dropout(0.2, {.seed = 3})(x);
    auto seq = mt::layers::Reshape({2, 32})(x);
    seq = mt::layers::MultiHeadAttention(1, 32, {.dropout = 0.1, .seed = 5})({seq, seq});
    x = mt::layers::Flatten()(seq);
  }
  x = mt::layers::LayerNormalization()(x);
  x = mt::layers::Dense(5, {.dtype = "float32"})(x);
  auto m = std::make_unique<mt::Model>(inputs, x);
  m->to(kGpu);
  return m;
}

mt::Tensor step(mt::Model& model, mo::Optimizer& opt, const mt::Tensor& x, const mt::Tensor& y) {
  static const mt::losses::Loss loss_fn =
      mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  const auto vars = model.trainable_variables();
  mt::GradientTape tape;
  const mt::Tensor loss = loss_fn(y, model(x, {.training = true}));
  opt.apply_gradients(opt.compute_gradients(tape, loss, vars), vars);
  return loss;
}

std::vector<double> values(const mt::Tensor& t) { return t.to_vector<double>(); }

}  // namespace

TEST_CASE("cuda capture: a CUDA graph replays the eager steps bit for bit", "[cuda][capture]") {
  const std::vector<Batch> batches = gpu_batches(5, 4);
  for (const bool dropout : {false, true})
    for (const std::string policy : {"float32", "mixed_bfloat16", "mixed_float16"}) {
      INFO(policy << (dropout ? ", with dropout" : ""));
      mt::set_global_policy(policy);
      // mixed_float16: loss scaling, decided on the device in both runs.
      const auto make_opt = [&]() -> std::shared_ptr<mo::Optimizer> {
        auto adamw = std::make_shared<mo::AdamW>(
            mo::AdamWOptions{.learning_rate = mo::schedules::cosine_decay(0.01, 5, 0.1),
                             .clipping = {.global_clipnorm = 1.0}});
        if (policy != "mixed_float16") return adamw;
        return std::make_shared<mo::LossScaleOptimizer>(
            adamw, mt::LossScale::dynamic({.initial_scale = 1024, .growth_interval = 2}));
      };
      const auto eager = gpu_model(dropout);
      auto eager_opt = make_opt();
      mt::Tensor eager_loss;
      for (const auto& b : batches) eager_loss = step(*eager, *eager_opt, b.x, b.y);

      const auto model = gpu_model(dropout);
      auto opt = make_opt();
      mt::Variable x(batches[0].x, "x", false), y(batches[0].y, "y", false);
      mt::Tensor loss;
      mt::StepGraph graph = mt::StepGraph::capture(kGpu, [&] { loss = step(*model, *opt, x, y); });
      for (std::size_t k = 1; k < batches.size(); ++k) {
        x.assign(batches[k].x);
        y.assign(batches[k].y);
        graph.replay();
      }
      CHECK(opt->iterations() == 5);
      CHECK(loss.item<double>() == eager_loss.item<double>());
      const auto vars = model->trainable_variables(), eager_vars = eager->trainable_variables();
      for (std::size_t i = 0; i < vars.size(); ++i) {
        INFO(vars[i].name());
        CHECK(values(vars[i]) == values(eager_vars[i]));
      }
    }
  mt::set_global_policy("float32");
}

TEST_CASE("cuda capture: skipped replays under loss scaling, their flags read late",
          "[cuda][capture]") {
  // Batches with an infinity: the replays skip them on the device, and the host reads each
  // replay's flag only when it queues the third replay after it, so the replays after a skipped
  // one pick their learning rate and bias correction on the device (Optimizer::LateCount).
  mt::set_global_policy("mixed_float16");
  std::vector<Batch> batches = gpu_batches(10, 6);
  const std::vector<std::size_t> skipped_batches = {3, 6, 7};
  for (std::size_t k : skipped_batches) {
    std::vector<double> xs = values(batches[k].x);
    xs[5 * k] = std::numeric_limits<double>::infinity();
    batches[k].x = mt::from_vector(xs, {64, 32}).to(kGpu);
  }
  const auto make_opt = [] {
    return std::make_shared<mo::LossScaleOptimizer>(
        std::make_shared<mo::Adam>(
            mo::AdamOptions{.learning_rate = mo::schedules::exponential_decay(0.01, 2, 0.5)}),
        mt::LossScale::dynamic({.initial_scale = 1024, .growth_interval = 2}));
  };
  const auto eager = gpu_model();
  auto eager_opt = make_opt();
  std::vector<std::int64_t> eager_counts;
  for (const auto& b : batches) {
    step(*eager, *eager_opt, b.x, b.y);
    eager_counts.push_back(eager_opt->iterations());
  }
  const auto model = gpu_model();
  auto opt = make_opt();
  mt::Variable x(batches[0].x, "x", false), y(batches[0].y, "y", false);
  mt::StepGraph graph = mt::StepGraph::capture(kGpu, [&] { step(*model, *opt, x, y); });
  for (std::size_t k = 1; k < batches.size(); ++k) {
    x.assign(batches[k].x);
    y.assign(batches[k].y);
    graph.replay();
    INFO("replay " << k);
    std::int64_t unread_skips = 0;  // among the last three replays, whose flags are not read
    for (std::size_t s : skipped_batches) unread_skips += s + 3 > k && s <= k ? 1 : 0;
    CHECK(opt->inner_optimizer().iterations() == eager_counts[k] + unread_skips);
  }
  CHECK(opt->skipped_steps() == 3);
  CHECK(opt->iterations() == eager_opt->iterations());
  CHECK(opt->loss_scale() == eager_opt->loss_scale());
  const auto vars = model->trainable_variables(), eager_vars = eager->trainable_variables();
  for (std::size_t i = 0; i < vars.size(); ++i) {
    INFO(vars[i].name());
    CHECK(values(vars[i]) == values(eager_vars[i]));
  }
  mt::set_global_policy("float32");
}

TEST_CASE("cuda capture: fit on a prefetched GPU dataset, captured and not, bit for bit",
          "[cuda][capture]") {
  // The MNIST app's pipeline on a GPU: batches copied up by a prefetch thread, which copies the
  // next ones while fit captures its first step (its copies wait for the capture to end: had
  // they been recorded into the graph, those batches would hold garbage).
  mt::set_global_policy("float32");
  std::vector<Batch> batches = gpu_batches(6, 8);
  std::vector<double> xs, ys;
  for (const Batch& b : batches) {
    const auto bx = values(b.x), by = values(b.y);
    xs.insert(xs.end(), bx.begin(), bx.end());
    ys.insert(ys.end(), by.begin(), by.end());
  }
  const auto n = static_cast<std::int64_t>(ys.size());
  const mt::Tensor x = mt::from_vector(xs, {n, 32});
  const mt::Tensor y = mt::cast(mt::from_vector(ys, {n}), mt::kInt64);
  const auto train = [&](bool capture) {
    auto model = gpu_model();
    model->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                    .optimizer = mo::Adam({.learning_rate = 0.01}),
                    .capture_step = capture});
    const auto ds = mt::data::Dataset::from_tensors(x, y).batch(64).to(kGpu).prefetch(2);
    const mt::History h = model->fit(ds, {.epochs = 2, .verbose = 0});
    return std::make_pair(std::move(model), h);
  };
  const auto [eager, eager_history] = train(false);
  const auto [captured, history] = train(true);
  CHECK(history.history == eager_history.history);
  const auto w = captured->get_weights(), eager_w = eager->get_weights();
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(values(w[i]) == values(eager_w[i]));
}

TEST_CASE("cuda capture: host constants, the memory pool, what is refused", "[cuda][capture]") {
  mt::set_global_policy("float32");
  mt::Variable acc(mt::zeros({4}, mt::kFloat32, kGpu), "acc", false);
  mt::Tensor out;
  {
    // A constant copied up during the capture is copied again by every replay.
    mt::StepGraph graph = mt::StepGraph::capture(kGpu, [&] {
      out = mt::from_vector(std::vector<double>{1, 2, 3, 4}, {4}).to(kGpu);
      acc.assign_add(out);
    });
    for (int i = 0; i < 3; ++i) graph.replay();
    CHECK(values(acc) == std::vector<double>{4, 8, 12, 16});  // the warm-up and 3 replays
  }
  // The graph is gone; the tensor kept from the capture still holds its last value.
  CHECK(values(out) == std::vector<double>{1, 2, 3, 4});
  // Refused during a GPU capture, with nothing recorded.
  const auto refused = [](const std::function<void()>& f) {
    mt::StepGraph g;
    CHECK_THROWS_AS(g = mt::StepGraph::capture(kGpu, f), mt::CaptureError);
    CHECK(g.empty());
    CHECK_FALSE(mt::capture::active());
  };
  mt::Tensor t = mt::ones({8}, mt::kFloat32, kGpu);
  refused([&] { (void)mt::sum(t).item<float>(); });
  refused([&] { mt::cuda::synchronize(0); });
  refused([&] { (void)(mt::ones({2}) + mt::ones({2})); });  // a CPU kernel
  if (mt::cuda::device_count() >= 2) {
    // A kernel on another GPU: it would run once, now, and not be replayed.
    const mt::Tensor other = mt::ones({8}, mt::kFloat32, mt::Device::cuda(1));
    refused([&] { (void)(other + other); });
  } else {
    WARN("one GPU: a kernel on another GPU during a capture is not checked here");
  }
  // The device works as before.
  CHECK(mt::sum(t).item<float>() == 8.0f);
}

TEST_CASE("cuda capture: a block of a destroyed graph, freed during another capture, stays its",
          "[cuda][capture]") {
  mt::set_global_policy("float32");
  mt::Variable acc(mt::zeros({4}, mt::kFloat32, kGpu), "acc", false);
  mt::Tensor y;  // made by the first graph: a block of its pool
  {
    mt::StepGraph first = mt::StepGraph::capture(kGpu, [&] {
      y = mt::from_vector(std::vector<double>{1, 2, 3, 4}, {4}).to(kGpu);
    });
    // A capture computes nothing on a GPU: the replay writes y (the copy it recorded).
    first.replay();
  }
  mt::StepGraph second = mt::StepGraph::capture(kGpu, [&] {
    acc.assign_add(y);
    if (mt::capture::active()) y = mt::Tensor();  // freed in the capture: the graph reads it
  });
  // Allocations of y's size class after the capture must not get y's block.
  std::vector<mt::Tensor> others;
  for (int i = 0; i < 16; ++i) others.push_back(mt::full({4}, 100.0, mt::kFloat32, kGpu));
  second.replay();
  second.replay();
  CHECK(values(acc) == std::vector<double>{3, 6, 9, 12});  // the warm-up and 2 replays
}
