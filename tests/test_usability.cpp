// What a new user writes first, spelled the natural way (issue: "compile errors that point
// away from the mistake"), the defaults the docs state, and the ModelCheckpoint callback.
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <filesystem>
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

class Scale : public ml::Layer {
 public:
  using Layer::Layer;
  void build(const mt::Shape& input_shape) override {
    alpha_ = add_weight("alpha", {input_shape.back()}, mt::init::ones());
  }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x * alpha_; }

 private:
  mt::Variable alpha_;
};

using mixtape_test::TempDir;

struct Data {
  mt::Tensor x, y;
};
// Two classes on either side of a random hyperplane, in 6 dimensions.
Data separable(std::int64_t n, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<float> xs;
  std::vector<std::int64_t> ys;
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (int d = 0; d < 6; ++d) {
      const double v = gen.next_normal();
      xs.push_back(static_cast<float>(v));
      s += v * (d % 2 == 0 ? 1.0 : -0.5);
    }
    ys.push_back(s > 0 ? 1 : 0);
  }
  return {mt::from_vector(xs, {n, 6}), mt::from_vector(ys, {n})};
}

std::unique_ptr<mt::Sequential> small_model() {
  auto model = std::make_unique<mt::Sequential>(
      std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(16, {.activation = "relu"}), ml::Dense(2)});
  model->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                  .optimizer = mo::Adam({.learning_rate = 1e-2}),
                  .metrics = {"accuracy"}});
  return model;
}

}  // namespace

TEST_CASE("usability: the natural spellings compile and work", "[usability]") {
  mt::manual_seed(11);
  const Data train = separable(256, 1), val = separable(64, 2);
  // .validation_data = {x, y}, as in Keras (and std::make_pair still).
  auto owned = small_model();
  mt::Sequential& model = *owned;
  const mt::History h =
      model.fit(train.x, train.y,
                {.batch_size = 32, .epochs = 2, .validation_data = {val.x, val.y}, .verbose = 0});
  CHECK(h.history.count("val_loss") == 1);
  CHECK(h.history.at("val_loss").size() == 2);
  const mt::History h2 =
      model.fit(train.x, train.y,
                {.epochs = 1, .validation_data = std::make_pair(val.x, val.y), .verbose = 0});
  CHECK(h2.history.count("val_accuracy") == 1);
  // Without validation data, no val_ keys; half of it is refused.
  CHECK(model.fit(train.x, train.y, {.epochs = 1, .verbose = 0}).history.count("val_loss") == 0);
  CHECK_THROWS_AS(model.fit(train.x, train.y, {.validation_data = {val.x, mt::Tensor()}}),
                  mt::ShapeError);

  // make_layer<T>({...}) with designated initializers.
  auto named = ml::make_layer<Scale>({.name = "my_scale", .trainable = false});
  CHECK(named->name() == "my_scale");
  CHECK_FALSE(named->trainable());
  auto plain = ml::make_layer<Scale>();
  CHECK(plain->name() != "my_scale");
  const ml::LayerOptions options{.name = "from_lvalue"};
  CHECK(ml::make_layer<Scale>(options)->name() == "from_lvalue");

  // .dtype = a dtype, where a policy name works: the single-dtype policy.
  auto d32 = ml::Dense(4, {.dtype = mt::kFloat32});
  CHECK(d32->dtype_policy().name() == "float32");
  auto dbf = ml::Dense(4, {.dtype = mt::kBFloat16});
  CHECK(dbf->compute_dtype() == mt::kBFloat16);
  CHECK(dbf->variable_dtype() == mt::kBFloat16);
  CHECK(ml::make_layer<Scale>({.dtype = mt::kFloat64})->dtype_policy() == mt::Policy("float64"));
  CHECK_THROWS_WITH(ml::Dense(4, {.dtype = mt::kInt32}),
                    Contains("int32") && Contains("mixed_float16"));
  CHECK(mt::Policy(mt::kFloat16) == mt::Policy("float16"));
}

TEST_CASE("usability: default model names are those the docs give", "[usability]") {
  ml::reset_default_names();
  mt::Sequential a({ml::Dense(2)});
  mt::Sequential b({ml::Dense(2)});
  CHECK(a.name() == "sequential");
  CHECK(b.name() == "sequential_1");
  auto in = ml::Input({3});
  mt::Model f(in, ml::Dense(1)(in));
  CHECK(f.name() == "model");
}

TEST_CASE("ModelCheckpoint: every epoch, best only, weights only, and resuming",
          "[usability][checkpoint]") {
  TempDir dir;
  mt::manual_seed(5);
  const Data train = separable(256, 3), val = separable(64, 4);

  // Every epoch, one file per epoch (numbered from 1, as Keras).
  {
    ml::reset_default_names();  // the same weight names in the model restored below
    auto owned = small_model();
    mt::Sequential& model = *owned;
    auto every = std::make_shared<mt::ModelCheckpoint>(
        mt::ModelCheckpoint::Options{.filepath = (dir / "e{epoch:02d}.safetensors").string()});
    model.fit(train.x, train.y,
              {.batch_size = 32, .epochs = 3, .verbose = 0, .callbacks = {every}});
    CHECK(dir.entries() ==
          std::vector<std::string>{"e01.safetensors", "e02.safetensors", "e03.safetensors"});
    CHECK(every->last_saved() == (dir / "e03.safetensors").string());
    // The last one restores the model and optimizer, and its epoch resumes fit.
    ml::reset_default_names();
    auto other_owned = small_model();
    mt::Sequential& other = *other_owned;
    other(train.x);
    const mt::TrainingCheckpoint info =
        mt::load_checkpoint((dir / "e03.safetensors").string(), other, *other.optimizer());
    CHECK(info.epoch == 3);
    CHECK(other.optimizer()->iterations() == model.optimizer()->iterations());
    const auto w = model.weights(), w2 = other.weights();
    REQUIRE(w.size() == w2.size());
    for (std::size_t i = 0; i < w.size(); ++i)
      CHECK(w[i].value().to_vector<float>() == w2[i].value().to_vector<float>());
  }

  // Best only, by a maximised metric: a file only when val_accuracy improved.
  {
    auto owned = small_model();
    mt::Sequential& model = *owned;
    const std::string path = (dir / "best.safetensors").string();
    auto best = std::make_shared<mt::ModelCheckpoint>(mt::ModelCheckpoint::Options{
        .filepath = path, .monitor = "val_accuracy", .save_best_only = true});
    const mt::History h = model.fit(train.x, train.y,
                                    {.batch_size = 32,
                                     .epochs = 4,
                                     .validation_data = {val.x, val.y},
                                     .verbose = 0,
                                     .callbacks = {best}});
    const auto& acc = h.history.at("val_accuracy");
    CHECK(best->best() == *std::max_element(acc.begin(), acc.end()));
    CHECK(best->last_saved() == path);
    CHECK(fs::exists(path));
    // A monitor fit does not log is an error that names it, not a silent no-save.
    auto missing = std::make_shared<mt::ModelCheckpoint>(mt::ModelCheckpoint::Options{
        .filepath = (dir / "never.safetensors").string(), .save_best_only = true});
    CHECK_THROWS_WITH(
        model.fit(train.x, train.y, {.epochs = 1, .verbose = 0, .callbacks = {missing}}),
        Contains("'val_loss'") && Contains("accuracy"));
    CHECK_FALSE(fs::exists(dir / "never.safetensors"));
  }

  // Weights only: a file load_weights reads.
  {
    ml::reset_default_names();
    auto owned = small_model();
    mt::Sequential& model = *owned;
    auto weights = std::make_shared<mt::ModelCheckpoint>(mt::ModelCheckpoint::Options{
        .filepath = (dir / "w.safetensors").string(), .save_weights_only = true});
    model.fit(train.x, train.y, {.epochs = 1, .verbose = 0, .callbacks = {weights}});
    ml::reset_default_names();
    auto other_owned = small_model();
    mt::Sequential& other = *other_owned;
    other(train.x);
    mt::load_weights(other, (dir / "w.safetensors").string());
    CHECK(other.weights()[0].value().to_vector<float>() ==
          model.weights()[0].value().to_vector<float>());
  }

  // Paths are checked when the callback is made.
  CHECK_THROWS_AS(mt::ModelCheckpoint({.filepath = ""}), mt::ValueError);
  CHECK_THROWS_WITH(mt::ModelCheckpoint({.filepath = "ckpt-{loss}.safetensors"}),
                    Contains("ckpt-{loss}.safetensors") && Contains("{epoch}"));
}

TEST_CASE("DTypeTraceScope: the rows of a training step, as docs/mixed_precision.md shows",
          "[usability]") {
  const Data d = separable(32, 5);
  mt::PolicyScope policy("mixed_float16");
  auto model = small_model();
  model->build_for({-1, 6});
  mt::DTypeTrace seen;
  {
    mt::DTypeTraceScope scope;
    model->train_step(d.x, d.y);
    seen = scope.trace();
  }
  // Two Dense layers ran (forward only: the backward makes no layer call).
  REQUIRE(seen.rows.size() == 2);
  for (const mt::DTypeTraceRow& row : seen.rows) {
    CHECK(row.type == "Dense");
    CHECK(row.policy == "mixed_float16");
    CHECK(row.weight == mt::kFloat32);
    CHECK(row.weight_read == mt::kFloat16);
    CHECK(row.output == mt::kFloat16);
  }
  CHECK(seen.rows[0].input == mt::kFloat32);
  CHECK(seen.rows[0].input_cast == mt::kFloat16);
  CHECK_THAT(seen.table(), Contains("float32 => float16"));
  // The scope is gone: nothing more is collected.
  model->train_step(d.x, d.y);
  CHECK(seen.rows.size() == 2);
}
