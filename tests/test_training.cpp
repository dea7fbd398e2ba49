// Model.compile / fit / evaluate / predict, the guide's custom training loop, and automatic
// mixed precision (which dtype each op ran in, with and without it).
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;

namespace {

// A separable task: `classes` Gaussian blobs in `dims` dimensions, at corners of the cube
// [-2, 2]^dims (the same for every seed: the seed draws the samples).
struct Blobs {
  mt::Tensor x, y;
};
Blobs blobs(std::int64_t n, std::int64_t dims, std::int64_t classes, std::uint64_t seed) {
  std::vector<std::vector<double>> centres(static_cast<std::size_t>(classes));
  for (std::size_t k = 0; k < centres.size(); ++k)
    for (std::int64_t d = 0; d < dims; ++d)
      centres[k].push_back(((k >> (d % 4)) & 1) != 0 ? 2.0 : -2.0);
  mt::Generator gen(seed);
  std::vector<double> xs;
  std::vector<std::int64_t> ys;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(classes));
    ys.push_back(k);
    for (std::int64_t d = 0; d < dims; ++d)
      xs.push_back(centres[static_cast<std::size_t>(k)][static_cast<std::size_t>(d)] +
                   0.5 * gen.next_normal());
  }
  return {mt::from_vector(xs, {n, dims}), mt::from_vector(ys, {n})};
}

mt::Model classifier(std::int64_t dims, std::int64_t classes) {
  auto inputs = ml::Input({dims});
  auto x = ml::Dense(32, {.activation = "relu"})(inputs);
  x = ml::Dense(classes)(x);
  auto outputs = ml::Activation("softmax", {.dtype = "float32"})(x);
  return mt::Model(inputs, outputs);
}

// Turns automatic mixed precision off at the end of a scope.
struct AmpOff {
  ~AmpOff() { mo::disable_auto_mixed_precision(); }
};

}  // namespace

TEST_CASE("fit: an MLP learns a separable task under float32, mixed_float16, mixed_bfloat16",
          "[training][fit]") {
  const Blobs train = blobs(2000, 8, 4, 1), test = blobs(500, 8, 4, 2);
  for (const char* policy : {"float32", "mixed_float16", "mixed_bfloat16"}) {
    INFO("policy " << policy);
    mt::manual_seed(3);
    mt::PolicyScope scope(policy);
    mt::Model model = classifier(8, 4);
    model.compile({.loss = mt::losses::SparseCategoricalCrossentropy(),
                   .optimizer = mo::Adam({.learning_rate = 1e-2}),
                   .metrics = {"accuracy"}});
    const bool scaled = std::string(policy) == "mixed_float16";
    CHECK((dynamic_cast<mo::LossScaleOptimizer*>(model.optimizer().get()) != nullptr) == scaled);
    const mt::History h = model.fit(
        train.x, train.y,
        {.batch_size = 64, .epochs = 4, .validation_split = 0.2, .seed = 5, .verbose = 2});
    REQUIRE(h.epoch.size() == 4);
    CHECK(h.history.at("loss").back() < h.history.at("loss").front());
    CHECK(h.history.count("val_loss") == 1);
    CHECK(h.history.count("val_accuracy") == 1);
    CHECK(h.history.count("loss_scale") == (scaled ? 1u : 0u));
    const mt::Logs scores = model.evaluate(test.x, test.y, {.batch_size = 128});
    INFO("test loss " << scores.at("loss") << " accuracy " << scores.at("accuracy"));
    CHECK(scores.at("accuracy") > 0.99);
    // predict matches calling the model, and its output is float32.
    const mt::Tensor p = model.predict(test.x, {.batch_size = 100});
    CHECK(p.shape() == mt::Shape{500, 4});
    CHECK(p.dtype() == mt::kFloat32);
    const auto direct = model(test.x).to_vector<double>();
    const auto batched = p.to_vector<double>();
    for (std::size_t i = 0; i < direct.size(); i += 97)
      CHECK(batched[i] == Approx(direct[i]).epsilon(1e-5));
  }
}

TEST_CASE("fit: a NaN loss without loss scaling is an error and leaves the weights", "[training]") {
  mt::Model model = classifier(3, 2);
  model.compile({.loss = "sparse_categorical_crossentropy", .optimizer = "sgd"});
  Blobs data = blobs(64, 3, 2, 4);
  model.fit(data.x, data.y, {.batch_size = 64, .epochs = 1, .verbose = 0});
  const auto weights = model.get_weights();
  std::vector<double> xs = data.x.to_vector<double>();
  xs[5] = std::numeric_limits<double>::quiet_NaN();
  const mt::Tensor bad = mt::from_vector(xs, data.x.shape());
  CHECK_THROWS_AS(model.fit(bad, data.y, {.batch_size = 64, .epochs = 1, .verbose = 0}),
                  mt::NumericError);
  const auto after = model.get_weights();
  for (std::size_t i = 0; i < weights.size(); ++i)
    CHECK(after[i].to_vector<double>() == weights[i].to_vector<double>());
}

TEST_CASE("fit: bad input", "[training]") {
  mt::Model model = classifier(3, 2);
  const Blobs data = blobs(10, 3, 2, 4);
  CHECK_THROWS_WITH(model.fit(data.x, data.y), Catch::Contains("not compiled"));
  CHECK_THROWS_AS(model.compile({.optimizer = "adam"}), mt::ValueError);  // no loss
  CHECK_THROWS_AS(model.compile({.loss = "hinge"}), mt::ValueError);
  CHECK_THROWS_AS(model.compile({.loss = "mse", .optimizer = "adagrad"}), mt::ValueError);
  model.compile({.loss = "sparse_categorical_crossentropy"});
  CHECK_THROWS_AS(model.fit(data.x, mt::zeros({9}, mt::kInt64)), mt::ShapeError);
  CHECK_THROWS_AS(model.fit(data.x, data.y, {.batch_size = 0}), mt::ValueError);
  CHECK_THROWS_AS(model.fit(data.x, data.y, {.validation_split = 1.0}), mt::ValueError);
  // Labels out of range name the loss.
  CHECK_THROWS_WITH(model.fit(data.x, mt::full({10}, 7, mt::kInt64), {.verbose = 0}),
                    Catch::Contains("sparse_categorical_crossentropy"));
}

TEST_CASE("fit: callbacks and early stopping", "[training]") {
  struct Counter : mt::Callback {
    int epochs = 0, batches = 0;
    void on_epoch_end(mt::Model&, int, const mt::Logs&) override { ++epochs; }
    void on_batch_end(mt::Model&, std::int64_t, const mt::Logs&) override { ++batches; }
  };
  auto counter = std::make_shared<Counter>();
  // Monitoring a value that never improves stops after patience + 1 epochs.
  auto stop = std::make_shared<mt::EarlyStopping>(
      mt::EarlyStopping::Options{.monitor = "loss", .patience = 1, .maximize = true});
  mt::Model model = classifier(3, 2);
  model.compile(
      {.loss = "sparse_categorical_crossentropy", .optimizer = mo::SGD({.learning_rate = 0.1})});
  const Blobs data = blobs(100, 3, 2, 6);
  const mt::History h = model.fit(
      data.x, data.y, {.batch_size = 25, .epochs = 10, .verbose = 0, .callbacks = {counter, stop}});
  CHECK(counter->epochs == 3);
  CHECK(counter->batches == 12);
  CHECK(h.epoch.size() == 3);
  CHECK(stop->stopped_epoch() == 2);
}

TEST_CASE("fit: batch logs are read only for callbacks that want them", "[training]") {
  // Records the batch logs it gets; `wants` is what it answers to wants_batch_logs().
  struct Recorder : mt::Callback {
    explicit Recorder(bool w) : wants(w) {}
    bool wants;
    std::vector<mt::Logs> seen;
    std::vector<mt::Logs> epochs;
    bool wants_batch_logs() const override { return wants; }
    void on_batch_end(mt::Model&, std::int64_t, const mt::Logs& logs) override {
      seen.push_back(logs);
    }
    void on_epoch_end(mt::Model&, int, const mt::Logs& logs) override { epochs.push_back(logs); }
  };
  const Blobs data = blobs(100, 3, 2, 6);
  auto run = [&](std::vector<std::shared_ptr<mt::Callback>> callbacks) {
    mt::manual_seed(5);
    mt::Model model = classifier(3, 2);
    model.compile({.loss = "sparse_categorical_crossentropy",
                   .optimizer = mo::SGD({.learning_rate = 0.1}),
                   .metrics = {"accuracy"}});
    return model.fit(data.x, data.y,
                     {.batch_size = 25,
                      .epochs = 2,
                      .seed = 3,
                      .verbose = 0,
                      .callbacks = std::move(callbacks)});
  };
  auto quiet = std::make_shared<Recorder>(false);
  const mt::History h_quiet = run({quiet});
  auto eager = std::make_shared<Recorder>(true);
  const mt::History h_eager = run({eager});
  // The same training either way.
  CHECK(h_quiet.history.at("loss") == h_eager.history.at("loss"));
  CHECK(h_quiet.history.at("accuracy") == h_eager.history.at("accuracy"));
  REQUIRE(quiet->seen.size() == 8);
  REQUIRE(eager->seen.size() == 8);
  for (std::size_t b = 0; b < 8; ++b) {
    const bool last_of_epoch = b % 4 == 3;
    CHECK(eager->seen[b].count("loss") == 1);
    CHECK(eager->seen[b].count("accuracy") == 1);
    // Empty unless it is an epoch's last batch, which carries the running means too.
    CHECK(quiet->seen[b].empty() == !last_of_epoch);
    if (last_of_epoch) CHECK(quiet->seen[b] == eager->seen[b]);
  }
  // The last batch's running means are the epoch's training values.
  CHECK(eager->seen[3].at("loss") == eager->epochs[0].at("loss"));
  CHECK(eager->seen[7].at("accuracy") == eager->epochs[1].at("accuracy"));
  // The built-in callbacks read only epoch logs.
  CHECK_FALSE(mt::EarlyStopping({}).wants_batch_logs());
  CHECK_FALSE(mt::ModelCheckpoint({.filepath = "unused.safetensors"}).wants_batch_logs());
}

// --- The guide's custom training loop ----------------------------------------------------------

TEST_CASE("custom loop: GradientTape + LossScaleOptimizer as in the guide", "[training][guide]") {
  mt::PolicyScope scope("mixed_float16");
  mt::manual_seed(11);
  mt::Model model = classifier(8, 4);
  const Blobs data = blobs(1024, 8, 4, 7);
  auto initial_weights = model.get_weights();

  mo::LossScaleOptimizer optimizer(mo::RMSprop({.learning_rate = 1e-2}), mt::LossScale::dynamic());
  auto loss_object = mt::losses::SparseCategoricalCrossentropy();
  double first_loss = 0, last_loss = 0;
  for (int epoch = 0; epoch < 5; ++epoch) {
    mt::metrics::Mean epoch_loss;
    for (std::int64_t b0 = 0; b0 < 1024; b0 += 128) {
      const mt::Tensor xb = data.x.slice(0, b0, b0 + 128), yb = data.y.slice(0, b0, b0 + 128);
      mt::GradientTape tape;
      auto predictions = model(xb, {.training = true});
      auto loss = loss_object(yb, predictions);
      auto scaled_loss = optimizer.get_scaled_loss(loss);
      auto scaled_grads = tape.gradient(scaled_loss, model.trainable_variables());
      auto grads = optimizer.get_unscaled_gradients(scaled_grads);
      optimizer.apply_gradients(grads, model.trainable_variables());
      epoch_loss(loss);
    }
    if (epoch == 0) first_loss = epoch_loss.result();
    last_loss = epoch_loss.result();
    fmt::print("epoch {} loss {:.4f} loss scale {}\n", epoch, epoch_loss.result(),
               optimizer.loss_scale());
  }
  CHECK(last_loss < first_loss);
  CHECK(optimizer.applied_steps() + optimizer.skipped_steps() == 40);
  for (const auto& v : model.trainable_variables()) CHECK(v.dtype() == mt::kFloat32);
  mt::metrics::SparseCategoricalAccuracy accuracy("test_accuracy");
  accuracy.update_state(data.y, model(data.x));
  CHECK(accuracy.result() > 0.95);
  // set_weights brings back the initial model.
  model.set_weights(initial_weights);
  const auto w = model.get_weights();
  CHECK(w[0].to_vector<double>() == initial_weights[0].to_vector<double>());
}

// --- Automatic mixed precision ------------------------------------------------------------------

TEST_CASE("amp: which dtype each op of a float32 model ran in, with and without the rewrite",
          "[training][amp]") {
  AmpOff off;
  // sigmoid is not one of the fused linear op's activations: the first Dense composes matmul,
  // add and sigmoid; the second runs as one linear op.
  auto model = mt::Sequential({ml::Dense(16, {.activation = "sigmoid"}), ml::Dense(4)});
  const mt::Tensor x = mt::uniform({8, 5}, -1.0, 1.0);
  const mt::Tensor y = mt::from_vector<std::int64_t>({0, 1, 2, 3, 0, 1, 2, 3}, {8});
  auto loss_object = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  model(x);  // build

  auto trace_step = [&](mo::Optimizer& opt) {
    mt::OpTraceScope ops;
    mt::GradientTape tape;
    const mt::Tensor logits = model(x, {.training = true});
    const mt::Tensor loss = loss_object(y, logits);
    std::vector<mt::Tensor> grads;
    auto* lso = dynamic_cast<mo::LossScaleOptimizer*>(&opt);
    grads = tape.gradient(lso ? lso->get_scaled_loss(loss) : loss, model.trainable_variables());
    if (lso) grads = lso->get_unscaled_gradients(grads);
    opt.apply_gradients(grads, model.trainable_variables());
    return std::make_pair(ops.rows(), logits.dtype());
  };
  auto first = [](const std::vector<mt::OpTraceRow>& rows, const std::string& op) {
    for (const auto& r : rows)
      if (r.op == op) return r;
    FAIL("op " << op << " did not run");
    return rows.front();
  };

  mo::SGD sgd;
  const auto [plain, plain_out] = trace_step(sgd);
  fmt::print("without the rewrite:\n");
  for (const auto& r : plain) fmt::print("  {} -> {}\n", r.op, r.computation);
  for (const auto& r : plain) CHECK(r.computation != mt::kFloat16);
  CHECK(plain_out == mt::kFloat32);

  mo::LossScaleOptimizer amp_opt = mo::enable_auto_mixed_precision(mo::SGD());
  CHECK(mt::auto_mixed_precision_enabled());
  CHECK(amp_opt.loss_scale_config().is_dynamic());
  const auto [rewritten, amp_out] = trace_step(amp_opt);
  fmt::print("with enable_auto_mixed_precision:\n");
  for (const auto& r : rewritten) fmt::print("  {} -> {}\n", r.op, r.computation);
  CHECK(first(rewritten, "matmul").computation == mt::kFloat16);   // allow
  CHECK(first(rewritten, "add").computation == mt::kFloat16);      // infer: the bias add
  CHECK(first(rewritten, "sigmoid").computation == mt::kFloat16);  // infer
  CHECK(first(rewritten, "reshape").computation == mt::kFloat16);  // clear: linear's input
  CHECK(first(rewritten, "linear").computation == mt::kFloat16);   // allow
  CHECK(first(rewritten, "mean").computation == mt::kFloat32);     // deny (the loss)
  CHECK(amp_out == mt::kFloat16);
  // The variables stay float32 and their gradients too.
  for (const auto& v : model.trainable_variables()) CHECK(v.dtype() == mt::kFloat32);

  // Outside a tape (evaluation) the model runs as written.
  {
    mt::OpTraceScope ops;
    CHECK(model(x).dtype() == mt::kFloat32);
    for (const auto& r : ops.rows()) CHECK(r.computation != mt::kFloat16);
  }
  // ... unless asked for.
  {
    mt::AutoMixedPrecisionScope amp;
    CHECK(model(x).dtype() == mt::kFloat16);
  }
}

TEST_CASE("amp: a float32 model trains with the rewrite through fit", "[training][amp]") {
  AmpOff off;
  const Blobs train = blobs(1000, 8, 4, 21);
  mt::manual_seed(4);
  mt::Model model = classifier(8, 4);
  model.compile({.loss = "sparse_categorical_crossentropy",
                 .optimizer = mo::enable_auto_mixed_precision(mo::Adam({.learning_rate = 1e-2})),
                 .metrics = {"accuracy"}});
  const mt::History h = model.fit(train.x, train.y, {.batch_size = 50, .epochs = 3, .verbose = 0});
  CHECK(h.history.count("loss_scale") == 1);
  CHECK(model.evaluate(train.x, train.y).at("accuracy") > 0.98);
}

TEST_CASE("amp: the op lists are data, printable and editable", "[amp]") {
  mt::AmpLists lists = mt::AmpLists::defaults();
  CHECK(lists.category("matmul") == mt::AmpCategory::Allow);
  CHECK(lists.category("add") == mt::AmpCategory::Infer);
  CHECK(lists.category("exp") == mt::AmpCategory::Deny);
  CHECK(lists.category("reshape") == mt::AmpCategory::Clear);
  const std::string text = lists.str();
  fmt::print("{}", text);
  CHECK(text.find("allow: attention, conv2d, linear, matmul") != std::string::npos);
  lists.set("gelu", mt::AmpCategory::Allow);
  CHECK(lists.category("gelu") == mt::AmpCategory::Allow);
  lists.remove("matmul");
  CHECK_FALSE(lists.listed("matmul"));
  CHECK_THROWS_AS(lists.set("conv3d", mt::AmpCategory::Allow), mt::ValueError);

  ::setenv("MIXTAPE_AMP_DENYLIST_ADD", "softmax, gelu", 1);
  ::setenv("MIXTAPE_AMP_INFERLIST_REMOVE", "tanh", 1);
  mt::AmpLists env = mt::AmpLists::defaults();
  env.apply_environment();
  CHECK(env.category("softmax") == mt::AmpCategory::Deny);
  CHECK(env.category("gelu") == mt::AmpCategory::Deny);
  CHECK_FALSE(env.listed("tanh"));
  ::setenv("MIXTAPE_AMP_ALLOWLIST_ADD", "bogus_op", 1);
  mt::AmpLists bad = mt::AmpLists::defaults();
  CHECK_THROWS_WITH(bad.apply_environment(),
                    Catch::Contains("MIXTAPE_AMP_ALLOWLIST_ADD") && Catch::Contains("bogus_op"));
  ::unsetenv("MIXTAPE_AMP_DENYLIST_ADD");
  ::unsetenv("MIXTAPE_AMP_INFERLIST_REMOVE");
  ::unsetenv("MIXTAPE_AMP_ALLOWLIST_ADD");
}
