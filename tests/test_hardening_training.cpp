// Hardening of the training side (issue 18, items 5, 6, 7, 11, 15, 16): empty batches give
// 0 and change nothing, fit refuses a negative initial_epoch, labels and embedding ids that
// are not class indices (NaN, infinities, out of range) are refused naming the position,
// checkpoints with impossible state are refused before anything changes, the wrong-shape
// error names the shape a model expects, and uint8 / integer data trains as Keras does.
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// The message of the mixtape::Error that `f` throws, with its type checked.
template <typename E>
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  } catch (const mt::Error& e) {
    return fmt::format("(wrong error type: {})", e.what());
  }
  return "(no error)";
}

std::vector<std::uint8_t> bytes_of(const mt::Tensor& t) { return mt::detail::host_bytes(t); }

std::vector<std::vector<std::uint8_t>> weight_bytes(const ml::Layer& model) {
  std::vector<std::vector<std::uint8_t>> out;
  for (const auto& w : model.weights()) out.push_back(bytes_of(w));
  return out;
}

std::map<std::string, std::vector<std::uint8_t>> slot_bytes(const mo::Optimizer& opt,
                                                            const ml::Layer& model) {
  std::map<std::string, std::vector<std::uint8_t>> out;
  for (const auto& [name, t] : opt.state(model.trainable_variables()).tensors)
    out[name] = bytes_of(t);
  return out;
}

std::map<std::string, std::vector<std::uint8_t>> slot_bytes_of(
    const mo::Optimizer& opt, const std::vector<mt::Variable>& variables) {
  std::map<std::string, std::vector<std::uint8_t>> out;
  for (const auto& [name, t] : opt.state(variables).tensors) out[name] = bytes_of(t);
  return out;
}

// Random features and labels of a small classification task (fresh values per seed).
struct Data {
  mt::Tensor x, y;
};
Data task_data(std::int64_t n, std::int64_t dims, std::int64_t classes, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<std::int64_t> ys;
  for (std::int64_t i = 0; i < n; ++i)
    ys.push_back(static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(classes)));
  return {mt::normal({n, dims}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen),
          mt::from_vector(ys, {n})};
}

mt::Model classifier(std::int64_t dims, std::int64_t classes, std::uint64_t seed) {
  mt::manual_seed(seed);
  auto inputs = ml::Input({dims});
  auto x = ml::Dense(8, {.activation = "relu"})(inputs);
  x = ml::BatchNormalization()(x);
  x = ml::Dense(classes)(x);
  auto outputs = ml::Activation("softmax", {.dtype = "float32"})(x);
  return mt::Model(inputs, outputs);
}

using mixtape_test::TempDir;

}  // namespace

// --- Item 5: empty batches ----------------------------------------------------------------

TEST_CASE("hardening: every loss over an empty batch is 0 (Keras), never NaN",
          "[hardening-training]") {
  using mt::losses::Reduction;
  const mt::Tensor probs = mt::zeros({0, 3}), labels = mt::zeros({0}, mt::kInt64);
  for (bool from_logits : {false, true}) {
    const std::vector<std::pair<mt::losses::Loss, std::pair<mt::Tensor, mt::Tensor>>> cases = {
        {mt::losses::SparseCategoricalCrossentropy({.from_logits = from_logits}), {labels, probs}},
        {mt::losses::CategoricalCrossentropy({.from_logits = from_logits}), {probs, probs}},
        {mt::losses::BinaryCrossentropy({.from_logits = from_logits}), {probs, probs}},
        {mt::losses::MeanSquaredError(), {probs, probs}},
    };
    for (const auto& [loss, args] : cases) {
      INFO(loss.name() << " from_logits " << from_logits);
      const mt::Tensor mean = loss(args.first, args.second);
      CHECK(mean.shape() == mt::Shape{});
      CHECK(mean.item<double>() == 0.0);
      // Weighted (all weights of an empty batch): still 0.
      CHECK(loss(args.first, args.second, mt::zeros({0})).item<double>() == 0.0);
    }
  }
  // The other reductions: the sum is 0, the per-sample losses are empty.
  const auto sum = mt::losses::MeanSquaredError({.reduction = Reduction::Sum});
  CHECK(sum(probs, probs).item<double>() == 0.0);
  const auto none = mt::losses::SparseCategoricalCrossentropy({.reduction = Reduction::None});
  CHECK(none(labels, probs).shape() == mt::Shape{0});
  // The gradient of the mean over nothing is empty and finite.
  mt::Variable p(mt::zeros({0, 3}), "p");
  mt::GradientTape tape;
  const mt::Tensor l = mt::losses::CategoricalCrossentropy({.from_logits = true})(probs, p);
  const auto g = tape.gradient(l, std::vector<mt::Variable>{p});
  CHECK(g[0].shape() == mt::Shape{0, 3});
}

TEST_CASE("hardening: per-sample means over an empty feature axis are refused, not NaN",
          "[hardening-training]") {
  // [4, 0]: four samples with nothing to average: the mean would be 0/0.
  const mt::Tensor empty_features = mt::zeros({4, 0});
  for (const auto& loss : {mt::losses::MeanSquaredError(), mt::losses::BinaryCrossentropy()}) {
    INFO(loss.name());
    const std::string msg = error_of<mt::ShapeError>([&] { loss(empty_features, empty_features); });
    CHECK_THAT(msg, Contains(loss.name()) && Contains("[4, 0]"));
  }
  // Crossentropies need a class.
  CHECK_THAT(error_of<mt::ShapeError>(
                 [&] { mt::losses::CategoricalCrossentropy()(empty_features, empty_features); }),
             Contains("categorical_crossentropy") && Contains("class"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::losses::SparseCategoricalCrossentropy()(mt::zeros({4}, mt::kInt64),
                                                           empty_features);
             }),
             Contains("sparse_categorical_crossentropy") && Contains("class"));
}

TEST_CASE("hardening: train_step on 0 rows reports loss 0 and changes nothing",
          "[hardening-training]") {
  for (const char* policy : {"float32", "mixed_float16"}) {
    INFO("policy " << policy);
    mt::PolicyScope scope(policy);
    mt::Model model = classifier(5, 3, 21);
    model.compile({.loss = "sparse_categorical_crossentropy",
                   .optimizer = mo::Adam({.learning_rate = 0.01}),
                   .metrics = {"accuracy"}});
    const Data data = task_data(16, 5, 3, 22);
    model.train_step(data.x, data.y);  // slots exist and hold momentum
    const auto weights = weight_bytes(model);
    const auto slots = slot_bytes(*model.optimizer(), model);
    const std::int64_t iterations = model.optimizer()->iterations();
    const auto* lso = dynamic_cast<const mo::LossScaleOptimizer*>(model.optimizer().get());
    const double scale = lso ? lso->loss_scale() : 0.0;

    // BatchNormalization trained on an empty batch keeps its moving statistics.
    CHECK(model(mt::zeros({0, 5}), {.training = true}).shape() == mt::Shape{0, 3});
    CHECK(weight_bytes(model) == weights);

    const mt::Logs logs = model.train_step(mt::zeros({0, 5}), mt::zeros({0}, mt::kInt64));
    CHECK(logs.at("loss") == 0.0);
    CHECK(std::isfinite(logs.at("accuracy")));
    CHECK(weight_bytes(model) == weights);  // BatchNormalization's moving statistics too
    CHECK(slot_bytes(*model.optimizer(), model) == slots);
    CHECK(model.optimizer()->iterations() == iterations);
    if (lso) {
      CHECK(lso->loss_scale() == scale);
      CHECK(lso->skipped_steps() == 0);
      CHECK(lso->applied_steps() == 1);
    }
    // Bad shapes are still refused on 0 rows.
    CHECK_THROWS_AS(model.train_step(mt::zeros({0, 4}), mt::zeros({0}, mt::kInt64)),
                    mt::ShapeError);
  }
}

TEST_CASE("hardening: evaluate and the metrics over 0 rows give 0, never NaN",
          "[hardening-training]") {
  mt::Model model = classifier(5, 3, 23);
  model.compile({.loss = "sparse_categorical_crossentropy", .metrics = {"accuracy"}});
  const mt::Logs logs = model.evaluate(mt::zeros({0, 5}), mt::zeros({0}, mt::kInt64));
  CHECK(logs.at("loss") == 0.0);
  CHECK(logs.at("accuracy") == 0.0);

  const mt::Tensor p = mt::zeros({0, 3});
  mt::metrics::SparseCategoricalAccuracy sparse;
  sparse.update_state(mt::zeros({0}, mt::kInt64), p);
  CHECK(sparse.result() == 0.0);
  mt::metrics::CategoricalAccuracy categorical;
  categorical.update_state(p, p);
  CHECK(categorical.result() == 0.0);
  mt::metrics::BinaryAccuracy binary;
  binary.update_state(p, p);
  CHECK(binary.result() == 0.0);
  mt::metrics::Accuracy exact;
  exact.update_state(p, p);
  CHECK(exact.result() == 0.0);
  mt::metrics::Mean mean;
  CHECK(mean(mt::zeros({0})) == 0.0);
  // An empty batch after real ones leaves the running value alone.
  mean(mt::full({2}, 3.0));
  CHECK(mean(mt::zeros({0})) == 3.0);
}

// --- Item 6: initial_epoch ------------------------------------------------------------------

TEST_CASE("hardening: fit refuses a negative initial_epoch", "[hardening-training]") {
  mt::Model model = classifier(5, 3, 24);
  model.compile({.loss = "sparse_categorical_crossentropy", .optimizer = "sgd"});
  const Data data = task_data(8, 5, 3, 25);
  const auto weights = weight_bytes(model);
  const std::string msg = error_of<mt::ValueError>(
      [&] { model.fit(data.x, data.y, {.epochs = 1, .verbose = 0, .initial_epoch = -2}); });
  CHECK_THAT(msg, Contains("initial_epoch") && Contains("-2"));
  CHECK(weight_bytes(model) == weights);
  CHECK(model.optimizer()->iterations() == 0);
  // initial_epoch at or past epochs trains nothing (Keras).
  const mt::History h = model.fit(data.x, data.y, {.epochs = 2, .verbose = 0, .initial_epoch = 2});
  CHECK(h.epoch.empty());
}

// --- Item 7: labels and ids that are not class indices -------------------------------------

TEST_CASE("hardening: sparse labels that are not class indices name the position",
          "[hardening-training]") {
  const auto loss = mt::losses::SparseCategoricalCrossentropy();
  mt::Generator gen(31);
  const mt::Tensor probs = mt::uniform({5, 3}, 0.1, 1.0, mt::kFloat32, mt::Device::cpu(), &gen);
  for (double bad : {kNaN, kInf, -kInf, 3.0, -0.5, 1e300}) {
    for (mt::DType dt : {mt::kFloat32, mt::kFloat64, mt::kFloat16}) {
      if (dt != mt::kFloat64 && bad == 1e300) continue;  // infinite in 16 or 32 bits
      INFO("label " << bad << " as " << dt.name());
      const mt::Tensor labels = mt::from_vector(std::vector<double>{0, 1, 2, bad, 1}, {5}, dt);
      const std::string msg = error_of<mt::IndexError>([&] { loss(labels, probs); });
      CHECK_THAT(msg, Contains("sparse_categorical_crossentropy") && Contains("position 3") &&
                          Contains("[0, 3)"));
      const std::string value = std::isnan(bad)   ? "nan"
                                : std::isinf(bad) ? (bad > 0 ? "inf" : "-inf")
                                                  : fmt::format("{}", bad);
      CHECK_THAT(msg, Contains(value));
    }
  }
  // Integer labels out of range: the same words (the position and the value).
  const std::string msg = error_of<mt::IndexError>([&] {
    loss(mt::from_vector(std::vector<std::int64_t>{0, 1, 2, 7, 1}, {5}), probs);
  });
  CHECK_THAT(msg, Contains("sparse_categorical_crossentropy") && Contains("position 3") &&
                      Contains("7") && Contains("[0, 3)"));
  // Fractional labels are truncated toward zero (as Keras casts them).
  const mt::Tensor fractional = mt::from_vector(std::vector<double>{0.5, 1.9, 2.2, 0.0, 1.0}, {5});
  const mt::Tensor whole = mt::from_vector(std::vector<std::int64_t>{0, 1, 2, 0, 1}, {5});
  CHECK(loss(fractional, probs).item<double>() == loss(whole, probs).item<double>());
  // The metric refuses them too.
  mt::metrics::SparseCategoricalAccuracy acc;
  CHECK_THAT(error_of<mt::IndexError>([&] {
               acc.update_state(mt::from_vector(std::vector<double>{0, kNaN, 1, 1, 1}, {5}), probs);
             }),
             Contains("position 1") && Contains("nan"));
}

TEST_CASE("hardening: fit names a bad label by its sample, before any step",
          "[hardening-training]") {
  mt::manual_seed(31);
  auto in = ml::Input({4});
  mt::Model model(in, ml::Dense(3, {.name = "classes"})(in), {.name = "m"});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = "sgd"});
  const std::vector<float> before = model.weights().front().to_vector<float>();
  const mt::Tensor x = mt::normal({40, 4});
  std::vector<std::int64_t> labels(40, 1);
  labels[37] = 3;  // one class too far, late in the data: a shuffled batch would hide where
  const std::string msg = error_of<mt::IndexError>([&] {
    model.fit(x, mt::from_vector(labels, {40}), {.batch_size = 8, .epochs = 1, .verbose = 0});
  });
  CHECK_THAT(msg, Contains("the label of sample 37 of the data is 3, outside [0, 3)") &&
                      Contains("output 'classes' has 3 classes") &&
                      Contains("nothing was trained"));
  CHECK(model.optimizer()->iterations() == 0);
  CHECK(model.weights().front().to_vector<float>() == before);
  labels[37] = 1;
  std::vector<double> val(8, 0.0);
  val[5] = kNaN;
  CHECK_THAT(error_of<mt::IndexError>([&] {
               model.fit(x, mt::from_vector(labels, {40}),
                         {.batch_size = 8,
                          .epochs = 1,
                          .validation_data = {mt::normal({8, 4}), mt::from_vector(val, {8})},
                          .verbose = 0});
             }),
             Contains("sample 5 of the validation data is nan"));
}

TEST_CASE("hardening: embedding ids that are NaN or out of range name the position",
          "[hardening-training]") {
  auto emb = ml::Embedding(10, 4, {.name = "words"});
  const mt::Tensor ok = emb(mt::from_vector(std::vector<std::int64_t>{1, 2, 9}, {3}));
  for (double bad : {kNaN, kInf, -1.0, 10.0, -kInf}) {
    INFO("id " << bad);
    const mt::Tensor ids = mt::from_vector(std::vector<double>{1, 2, 3, 4, bad, 5}, {2, 3});
    const std::string msg = error_of<mt::IndexError>([&] { emb(ids); });
    CHECK_THAT(msg, Contains("words") && Contains("position 4") && Contains("[0, 10)") &&
                        Contains(fmt::format(" {} ", bad)));
  }
  // Integer ids out of range: position and value.
  CHECK_THAT(error_of<mt::IndexError>([&] {
               emb(mt::from_vector(std::vector<std::int64_t>{1, 12, 3}, {3}));
             }),
             Contains("words") && Contains("position 1") && Contains("12"));
  // Fractional float ids are truncated.
  const mt::Tensor truncated = emb(mt::from_vector(std::vector<double>{1.5, 2.99, 9.2}, {3}));
  CHECK(bytes_of(truncated) == bytes_of(ok));
}

// --- Item 11: checkpoints with impossible state -------------------------------------------

namespace {

std::unique_ptr<mt::Sequential> small_model(std::uint64_t seed) {
  mt::manual_seed(seed);
  auto model = std::make_unique<mt::Sequential>(std::vector<ml::LayerPtr<ml::Layer>>{
      ml::Dense(4, {.activation = "relu", .name = "hidden"}), ml::Dense(2, {.name = "out"})});
  (*model)(mt::zeros({1, 3}));
  return model;
}

void lso_step(mt::Sequential& model, mo::Optimizer& opt, std::uint64_t seed) {
  mt::Generator gen(seed);
  const mt::Tensor x = mt::normal({8, 3}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen);
  const mt::Tensor y = mt::normal({8, 2}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen);
  auto* lso = dynamic_cast<mo::LossScaleOptimizer*>(&opt);
  mt::GradientTape tape;
  const mt::Tensor loss = mt::losses::MeanSquaredError()(y, model(x, {.training = true}));
  auto grads = tape.gradient(lso ? lso->get_scaled_loss(loss) : loss, model.trainable_variables());
  if (lso) grads = lso->get_unscaled_gradients(grads);
  opt.apply_gradients(grads, model.trainable_variables());
}

// Saves `file` with one change made by `edit`.
std::string rewritten(const TempDir& dir, const std::string& good, const std::string& name,
                      const std::function<void(mt::SafetensorsFile&)>& edit) {
  mt::SafetensorsFile f = mt::load_safetensors(good);
  edit(f);
  const std::string path = dir.file(name);
  mt::save_safetensors(path, f.tensors, f.metadata);
  return path;
}

}  // namespace

TEST_CASE("hardening: load_checkpoint refuses impossible state and changes nothing",
          "[hardening-training]") {
  TempDir dir;
  const std::string good = dir.file("good.safetensors");
  auto a = small_model(41);
  mo::LossScaleOptimizer opt_a(
      mo::Adam({.learning_rate = 0.01}),
      mt::LossScale::dynamic({.initial_scale = 256, .growth_interval = 5}));
  lso_step(*a, opt_a, 1);
  lso_step(*a, opt_a, 2);
  mt::save_checkpoint(good, *a, opt_a, {.epoch = 2});

  // The target: trained a little, with its own state.
  auto target = small_model(42);
  mo::LossScaleOptimizer opt_t(
      mo::Adam({.learning_rate = 0.01}),
      mt::LossScale::dynamic({.initial_scale = 256, .growth_interval = 5}));
  lso_step(*target, opt_t, 3);
  const auto weights = weight_bytes(*target);
  const auto slots = slot_bytes(opt_t, *target);
  auto unchanged = [&] {
    CHECK(weight_bytes(*target) == weights);
    CHECK(slot_bytes(opt_t, *target) == slots);
    CHECK(opt_t.iterations() == 1);
    CHECK(opt_t.loss_scale() == 256.0);
    CHECK(opt_t.good_steps() == 1);
    CHECK(opt_t.applied_steps() == 1);
    CHECK(opt_t.skipped_steps() == 0);
  };
  auto refused = [&](const std::string& path, const std::vector<std::string>& words) {
    INFO("file " << path);
    const std::string msg =
        error_of<mt::ValueError>([&] { mt::load_checkpoint(path, *target, opt_t); });
    CHECK_THAT(msg, Contains(path));
    for (const auto& w : words) CHECK_THAT(msg, Contains(w));
    unchanged();
  };
  int edits = 0;
  auto meta = [&](const std::string& key, const std::string& value) {
    return rewritten(dir, good, fmt::format("meta_{}.safetensors", edits++),
                     [&](mt::SafetensorsFile& f) { f.metadata[key] = value; });
  };

  refused(meta("epoch", "-3"), {"\"epoch\"", "-3"});
  refused(meta("iterations", "-5"), {"\"iterations\"", "-5"});
  refused(meta("optimizer.scalar.good_steps", "nan"), {"good_steps", "nan"});
  refused(meta("optimizer.scalar.applied_steps", "1e300"), {"applied_steps", "1e+300"});
  refused(meta("optimizer.scalar.skipped_steps", "-1"), {"skipped_steps", "-1"});
  refused(meta("optimizer.scalar.good_steps", "1.5"), {"good_steps", "1.5"});
  refused(meta("optimizer.scalar.loss_scale", "inf"), {"loss_scale", "inf"});
  refused(meta("optimizer.scalar.surprise", "1"), {"surprise"});
  // A variable's slots missing while iterations > 0: its state would restart.
  refused(rewritten(dir, good, "no_slots.safetensors",
                    [](mt::SafetensorsFile& f) {
                      std::erase_if(f.tensors, [](const auto& t) {
                        return t.first.starts_with("optimizer/out/kernel/");
                      });
                    }),
          {"out/kernel/m", "missing", "iterations"});
  // One slot of a variable missing.
  refused(rewritten(dir, good, "half_slots.safetensors",
                    [](mt::SafetensorsFile& f) {
                      std::erase_if(f.tensors, [](const auto& t) {
                        return t.first == "optimizer/hidden/bias/v";
                      });
                    }),
          {"hidden/bias/v", "missing"});
  // A slot of the wrong dtype.
  refused(rewritten(dir, good, "f64_slot.safetensors",
                    [](mt::SafetensorsFile& f) {
                      for (auto& [name, t] : f.tensors)
                        if (name == "optimizer/hidden/bias/m") t = mt::zeros({4}, mt::kFloat64);
                    }),
          {"hidden/bias/m", "float64"});

  // The good file loads.
  mt::load_checkpoint(good, *target, opt_t);
  CHECK(weight_bytes(*target) == weight_bytes(*a));
  CHECK(opt_t.iterations() == 2);
}

TEST_CASE("hardening: optimizer state has every variable's slots once it has stepped",
          "[hardening-training]") {
  // w2 gets no gradient in the first step: it has no slots yet, but the state holds the
  // zeros its first step starts from, so that a load does not see "slots missing".
  mt::Variable w1(mt::from_vector(std::vector<double>{1, 2}, {2}, mt::kFloat32), "w1");
  mt::Variable w2(mt::from_vector(std::vector<double>{3, 4}, {2}, mt::kFloat32), "w2");
  const mt::Tensor g = mt::from_vector(std::vector<double>{0.5, -0.25}, {2}, mt::kFloat32);
  mo::Adam a({.learning_rate = 0.1});
  a.apply_gradients({g, mt::Tensor()}, {w1, w2});
  const mo::OptimizerState saved = a.state({w1, w2});
  REQUIRE(saved.tensors.count("w2/m") == 1);
  CHECK(saved.tensors.at("w2/m").to_vector<double>() == std::vector<double>{0, 0});

  mt::Variable r1(mt::from_vector(w1.to_vector<float>(), {2}), "w1");
  mt::Variable r2(mt::from_vector(w2.to_vector<float>(), {2}), "w2");
  mo::Adam b({.learning_rate = 0.1});
  b.load_state(saved, {r1, r2});
  a.apply_gradients({g, g}, {w1, w2});
  b.apply_gradients({g, g}, {r1, r2});
  CHECK(bytes_of(r1) == bytes_of(w1));
  CHECK(bytes_of(r2) == bytes_of(w2));
  CHECK(slot_bytes_of(b, {r1, r2}) == slot_bytes_of(a, {w1, w2}));

  // A state from before any step restarts the slots the optimizer had.
  b.load_state(mo::OptimizerState{}, {r1, r2});
  CHECK(b.iterations() == 0);
  CHECK(b.slots(r1).empty());
  CHECK(b.state({r1, r2}).tensors.empty());
}

TEST_CASE("hardening: a BOOL tensor holding a byte other than 0 or 1 is refused by name",
          "[hardening-training]") {
  TempDir dir;
  auto model = small_model(43);
  mo::SGD sgd({.momentum = 0.5});
  lso_step(*model, sgd, 4);
  const std::string weights = dir.file("weights.safetensors");
  const std::string ckpt = dir.file("ckpt.safetensors");
  mt::save_weights(*model, weights);
  mt::save_checkpoint(ckpt, *model, sgd, {.epoch = 1});
  const auto before = weight_bytes(*model);
  const auto slots = slot_bytes(sgd, *model);
  // A BOOL tensor whose second byte is 2, in place of a weight.
  auto bad_bool = [](const std::string& target) {
    return [target](mt::SafetensorsFile& f) {
      for (auto& [name, t] : f.tensors) {
        if (name != target) continue;
        t = mt::Tensor::empty({2}, mt::kBool);
        const std::uint8_t raw[2] = {1, 2};
        std::memcpy(t.data_ptr(), raw, sizeof raw);
      }
    };
  };
  const std::string bad_weights =
      rewritten(dir, weights, "bad_weights.safetensors", bad_bool("out/bias"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_weights(*model, bad_weights); }),
             Contains(bad_weights) && Contains("'out/bias'") && Contains("byte 2") &&
                 Contains("position 1") && Contains("0 or 1"));
  const std::string bad_ckpt =
      rewritten(dir, ckpt, "bad_ckpt.safetensors", bad_bool("optimizer/out/bias/momentum"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_checkpoint(bad_ckpt, *model, sgd); }),
             Contains(bad_ckpt) && Contains("'optimizer/out/bias/momentum'") &&
                 Contains("byte 2") && Contains("position 1"));
  CHECK(weight_bytes(*model) == before);
  CHECK(slot_bytes(sgd, *model) == slots);
  CHECK(sgd.iterations() == 1);
}

// --- Item 15: the wrong-shape error -------------------------------------------------------

TEST_CASE("hardening: a model called with the wrong shape names the shape it expects",
          "[hardening-training]") {
  auto inputs = ml::Input({28, 28}, {.name = "images"});
  auto x = ml::Flatten()(inputs);
  auto outputs = ml::Dense(10)(x);
  mt::Model model(inputs, outputs, {.name = "mnist"});
  const std::string msg = error_of<mt::ShapeError>([&] { model(mt::zeros({128, 784})); });
  CHECK_THAT(msg, Contains("mnist") && Contains("[None, 28, 28]") && Contains("[128, 784]"));
  CHECK_THAT(msg, !Contains("built for inputs of shape [128, 784]"));
  // The model still works on the right shape afterwards.
  CHECK(model(mt::zeros({2, 28, 28})).shape() == mt::Shape{2, 10});
  // Right rank, wrong extent.
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               model(mt::zeros({4, 28, 27}));
             }),
             Contains("[None, 28, 28]") && Contains("[4, 28, 27]"));
}

// --- Item 16: uint8 and integer data ------------------------------------------------------

TEST_CASE("hardening: fit, evaluate, predict and train_step take uint8 images and labels",
          "[hardening-training]") {
  const Data data = task_data(32, 6, 3, 51);
  // uint8 "images": values 0..255, the same values as float32.
  std::vector<std::uint8_t> pixels;
  mt::Generator gen(52);
  for (int i = 0; i < 32 * 6; ++i)
    pixels.push_back(static_cast<std::uint8_t>(gen.next_u64() % 256));
  const mt::Tensor x_u8 = mt::from_vector(pixels, {32, 6}, mt::kUInt8);
  const mt::Tensor x_f32 = mt::cast(x_u8, mt::kFloat32);
  const mt::Tensor y_u8 = mt::cast(data.y, mt::kUInt8);

  auto fitted = [&](const mt::Tensor& x, const mt::Tensor& y) {
    mt::Model model = classifier(6, 3, 53);
    model.compile({.loss = "sparse_categorical_crossentropy",
                   .optimizer = mo::SGD({.learning_rate = 0.01}),
                   .metrics = {"accuracy"}});
    model.fit(x, y, {.batch_size = 8, .epochs = 2, .seed = 54, .verbose = 0});
    return weight_bytes(model);
  };
  const auto reference = fitted(x_f32, data.y);
  CHECK(fitted(x_u8, data.y) == reference);
  CHECK(fitted(x_u8, y_u8) == reference);
  CHECK(fitted(x_f32, mt::cast(data.y, mt::kInt32)) == reference);

  mt::Model model = classifier(6, 3, 55);
  model.compile({.loss = "sparse_categorical_crossentropy", .metrics = {"accuracy"}});
  const mt::Logs a = model.evaluate(x_u8, y_u8), b = model.evaluate(x_f32, data.y);
  CHECK(a.at("loss") == b.at("loss"));
  CHECK(a.at("accuracy") == b.at("accuracy"));
  CHECK(bytes_of(model.predict(x_u8)) == bytes_of(model.predict(x_f32)));
  CHECK(bytes_of(model(x_u8)) == bytes_of(model(x_f32)));
  model.train_step(x_u8.slice(0, 0, 8), y_u8.slice(0, 0, 8));
  CHECK(model.integer_input_dtype() == mt::kFloat32);

  // A Sequential: float32 (Keras' default input dtype) for Flatten, Dense, ...
  auto sequential = [&](const mt::Tensor& x) {
    mt::manual_seed(56);
    mt::Sequential seq({ml::Flatten(), ml::Dense(3)});
    seq.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mo::SGD({.learning_rate = 0.01})});
    seq.fit(x, y_u8, {.batch_size = 8, .epochs = 1, .seed = 57, .verbose = 0});
    return weight_bytes(seq);
  };
  CHECK(sequential(x_u8) == sequential(x_f32));
  // ... and ids as they are for an Embedding first (uint8 ids widened to int64).
  auto embedded = [&](const mt::Tensor& ids) {
    mt::manual_seed(58);
    mt::Sequential seq({ml::Embedding(256, 4), ml::Flatten(), ml::Dense(3)});
    seq.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mo::SGD({.learning_rate = 0.1})});
    CHECK_FALSE(seq.integer_input_dtype().has_value());
    seq.fit(ids, y_u8, {.batch_size = 8, .epochs = 1, .seed = 59, .verbose = 0});
    return std::make_pair(weight_bytes(seq), bytes_of(seq.predict(ids)));
  };
  CHECK(embedded(x_u8) == embedded(mt::cast(x_u8, mt::kInt64)));
  // A functional model whose Input is int64 takes uint8 ids as int64.
  auto ids_in = ml::Input({6}, {.dtype = mt::kInt64});
  mt::manual_seed(60);
  mt::Model by_id(ids_in, ml::Dense(3)(ml::Flatten()(ml::Embedding(256, 2)(ids_in))));
  CHECK(by_id.integer_input_dtype() == mt::kInt64);
  CHECK(bytes_of(by_id(x_u8)) == bytes_of(by_id(mt::cast(x_u8, mt::kInt64))));
}
