// The API sweep of the training side (tests/api_sweep.h): losses and metrics on empty or
// class-less predictions, labels and embedding ids that are not class indices, fit's
// initial_epoch, the wrong-shape error of a model, and checkpoints with impossible state.
#include <fmt/format.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "api_sweep.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;
namespace fs = std::filesystem;
using sweep::expect;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Probabilities of 5 samples over 3 classes.
mt::Tensor probabilities() { return mt::full({5, 3}, 1.0 / 3.0); }

// Five float labels, the fourth one `bad`.
mt::Tensor labels_with(double bad) {
  return mt::from_vector(std::vector<double>{0, 1, 2, bad, 1}, {5});
}

using mixtape_test::TempDir;

}  // namespace

TEST_CASE("sweep: losses and metrics", "[sweep][training]") {
  const mt::Tensor no_features = mt::zeros({4, 0});
  sweep::run_sweep({
      expect<mt::ShapeError>("mse: samples with no values to average",
                             [&] { mt::losses::MeanSquaredError()(no_features, no_features); },
                             {"mean_squared_error", "[4, 0]", "no values"}),
      expect<mt::ShapeError>("binary crossentropy: samples with no values to average",
                             [&] { mt::losses::BinaryCrossentropy()(no_features, no_features); },
                             {"binary_crossentropy", "[4, 0]", "no values"}),
      expect<mt::ShapeError>(
          "categorical crossentropy: no class",
          [&] { mt::losses::CategoricalCrossentropy()(no_features, no_features); },
          {"categorical_crossentropy", "at least one class", "[4, 0]"}),
      expect<mt::ShapeError>("sparse crossentropy: no class",
                             [&] {
                               mt::losses::SparseCategoricalCrossentropy()(
                                   mt::zeros({4}, mt::kInt64), no_features);
                             },
                             {"sparse_categorical_crossentropy", "at least one class"}),
      expect<mt::ShapeError>("sparse accuracy: no class",
                             [&] {
                               mt::metrics::SparseCategoricalAccuracy().update_state(
                                   mt::zeros({4}, mt::kInt64), no_features);
                             },
                             {"sparse_categorical_accuracy", "at least one class"}),
      expect<mt::ShapeError>(
          "categorical accuracy: no class",
          [&] { mt::metrics::CategoricalAccuracy().update_state(no_features, no_features); },
          {"categorical_accuracy", "at least one class"}),
  });
}

TEST_CASE("sweep: labels and ids that are not class indices", "[sweep][training]") {
  const auto loss = mt::losses::SparseCategoricalCrossentropy();
  const mt::Tensor p = probabilities();
  auto label_row = [&](const std::string& name, double bad, const std::string& value) {
    return expect<mt::IndexError>(
        name, [&, bad] { loss(labels_with(bad), p); },
        {"sparse_categorical_crossentropy", "[0, 3)", "got " + value, "position 3"});
  };
  auto emb = ml::Embedding(10, 2, {.name = "tokens"});
  auto id_row = [&](const std::string& name, double bad, const std::string& value) {
    return expect<mt::IndexError>(
        name,
        [&, bad] {
          emb(mt::from_vector(std::vector<double>{1, bad, 2}, {3}));
        },
        {"tokens", "Embedding", "ids", "[0, 10)", "got " + value, "position 1"});
  };
  sweep::run_sweep({
      label_row("sparse crossentropy: a NaN label", kNaN, "nan"),
      label_row("sparse crossentropy: an infinite label", kInf, "inf"),
      label_row("sparse crossentropy: a label of -inf", -kInf, "-inf"),
      label_row("sparse crossentropy: a float label = the class count", 3.0, "3"),
      label_row("sparse crossentropy: a negative fractional label", -0.5, "-0.5"),
      label_row("sparse crossentropy: a label of 1e300", 1e300, "1e+300"),
      expect<mt::IndexError>(
          "sparse crossentropy: an integer label out of range",
          [&] {
            loss(mt::from_vector(std::vector<std::int64_t>{0, 1, 2, 7, 1}, {5}), p);
          },
          {"sparse_categorical_crossentropy", "[0, 3)", "index 7", "position 3"}),
      expect<mt::IndexError>(
          "sparse accuracy: a NaN label",
          [&] { mt::metrics::SparseCategoricalAccuracy().update_state(labels_with(kNaN), p); },
          {"sparse_categorical_accuracy", "[0, 3)", "got nan", "position 3"}),
      id_row("embedding: a NaN id", kNaN, "nan"),
      id_row("embedding: an infinite id", kInf, "inf"),
      id_row("embedding: a float id = input_dim", 10.0, "10"),
      id_row("embedding: a negative float id", -1.0, "-1"),
      expect<mt::IndexError>("embedding: an integer id out of range",
                             [&] {
                               emb(mt::from_vector(std::vector<std::int64_t>{1, 12, 2}, {3}));
                             },
                             {"tokens", "Embedding", "index 12", "[0, 10)", "position 1"}),
  });
}

TEST_CASE("sweep: fit, train_step and calls with bad input", "[sweep][training]") {
  auto inputs = ml::Input({28, 28}, {.name = "images"});
  mt::Model model(inputs, ml::Dense(3)(ml::Flatten()(inputs)), {.name = "mnist"});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = "sgd"});
  const mt::Tensor x = mt::zeros({4, 28, 28}), y = mt::zeros({4}, mt::kInt64);
  sweep::run_sweep({
      expect<mt::ValueError>(
          "fit: a negative initial_epoch",
          [&] { model.fit(x, y, {.epochs = 1, .verbose = 0, .initial_epoch = -2}); },
          {"fit", "initial_epoch", ">= 0", "-2"}),
      expect<mt::ShapeError>("model: called with flat images",
                             [&] {
                               model(mt::zeros({128, 784}));
                             },
                             {"mnist", "images", "[None, 28, 28]", "float32[128, 784]"}),
      expect<mt::ShapeError>("model: one extent wrong",
                             [&] {
                               model(mt::zeros({2, 28, 27}));
                             },
                             {"mnist", "axis 2", "[None, 28, 28]", "float32[2, 28, 27]"}),
      expect<mt::ShapeError>("train_step: 0 rows of the wrong shape",
                             [&] {
                               model.train_step(mt::zeros({0, 784}), mt::zeros({0}, mt::kInt64));
                             },
                             {"mnist", "[None, 28, 28]", "float32[0, 784]"}),
      expect<mt::ShapeError>(
          "dense: the wrong feature count names the expected shape",
          [] {
            auto dense = ml::Dense(2, {.name = "head"});
            dense(mt::zeros({2, 4}));
            dense(mt::zeros({2, 5}));
          },
          {"head", "[..., 4]", "built for inputs of shape [2, 4]", "float32[2, 5]"}),
  });
}

TEST_CASE("sweep: checkpoints with impossible state", "[sweep][training]") {
  TempDir dir;
  mt::manual_seed(71);
  mt::Sequential model({ml::Dense(3, {.name = "hidden"}), ml::Dense(2, {.name = "out"})});
  model(mt::zeros({1, 4}));
  mo::LossScaleOptimizer lso(mo::Adam(), mt::LossScale::dynamic({.initial_scale = 64}));
  {
    mt::GradientTape tape;
    const mt::Tensor loss = mt::losses::MeanSquaredError()(
        mt::ones({2, 2}), model(mt::ones({2, 4}), {.training = true}));
    auto grads = tape.gradient(lso.get_scaled_loss(loss), model.trainable_variables());
    lso.apply_gradients(lso.get_unscaled_gradients(grads), model.trainable_variables());
  }
  const std::string good = dir.file("good.safetensors");
  mt::save_checkpoint(good, model, lso, {.epoch = 1});

  // The good file with one change.
  int count = 0;
  auto edited = [&](const std::function<void(mt::SafetensorsFile&)>& edit) {
    mt::SafetensorsFile f = mt::load_safetensors(good);
    edit(f);
    const std::string path = dir.file(fmt::format("bad_{}.safetensors", count++));
    mt::save_safetensors(path, f.tensors, f.metadata);
    return path;
  };
  auto with_meta = [&](const std::string& key, const std::string& value) {
    return edited([=](mt::SafetensorsFile& f) { f.metadata[key] = value; });
  };
  auto without = [&](const std::string& prefix) {
    return edited([=](mt::SafetensorsFile& f) {
      std::erase_if(f.tensors, [&](const auto& t) { return t.first.starts_with(prefix); });
    });
  };
  auto row = [&](const std::string& name, const std::string& path, std::vector<std::string> words) {
    words.push_back(path);
    return expect<mt::ValueError>(
        name, [&, path] { mt::load_checkpoint(path, model, lso); }, std::move(words));
  };
  const std::string vhat = edited([&](mt::SafetensorsFile& f) {
    f.tensors.emplace_back("optimizer/out/bias/vhat", mt::zeros({2}));
  });
  const std::string bool_byte = edited([](mt::SafetensorsFile& f) {
    mt::Tensor flags = mt::Tensor::empty({3}, mt::kBool);
    const std::uint8_t raw[3] = {0, 1, 2};
    std::memcpy(flags.data_ptr(), raw, sizeof raw);
    f.tensors.emplace_back("model/out/flags", flags);
  });

  sweep::run_sweep({
      row("checkpoint: a negative epoch", with_meta("epoch", "-3"), {"\"epoch\"", "-3", ">= 0"}),
      row("checkpoint: negative iterations", with_meta("iterations", "-5"),
          {"\"iterations\"", "-5", ">= 0"}),
      row("checkpoint: a NaN good_steps", with_meta("optimizer.scalar.good_steps", "nan"),
          {"LossScaleOptimizer", "'good_steps'", "nan", "whole number"}),
      row("checkpoint: applied_steps of 1e300",
          with_meta("optimizer.scalar.applied_steps", "1e300"),
          {"'applied_steps'", "1e+300", "[0, 2^53]"}),
      row("checkpoint: negative skipped_steps", with_meta("optimizer.scalar.skipped_steps", "-1"),
          {"'skipped_steps'", "-1"}),
      row("checkpoint: a fractional good_steps", with_meta("optimizer.scalar.good_steps", "2.5"),
          {"'good_steps'", "2.5", "whole number"}),
      row("checkpoint: an infinite loss scale", with_meta("optimizer.scalar.loss_scale", "inf"),
          {"'loss_scale'", "inf", "finite and > 0"}),
      row("checkpoint: a zero loss scale", with_meta("optimizer.scalar.loss_scale", "0"),
          {"'loss_scale'", "finite and > 0"}),
      row("checkpoint: an unknown scalar", with_meta("optimizer.scalar.surprise", "1"),
          {"unknown scalar", "'surprise'"}),
      row("checkpoint: an unknown reserved key", with_meta("optimizer.extra", "1"),
          {"\"optimizer.extra\"", "reserved"}),
      row("checkpoint: a variable's slots missing after steps", without("optimizer/hidden/kernel/"),
          {"slot 'hidden/kernel/m'", "missing", "iterations is 1"}),
      row("checkpoint: one slot missing", without("optimizer/out/bias/v"),
          {"slot 'out/bias/v'", "missing"}),
      row("checkpoint: a slot the optimizer does not keep", vhat,
          {"'out/bias/vhat'", "not a slot", "m, v"}),
      row("checkpoint: a BOOL byte of 2", bool_byte,
          {"BOOL tensor 'model/out/flags'", "byte 2", "position 2", "0 or 1"}),
      expect<mt::ValueError>(
          "save_checkpoint: a negative epoch",
          [&] { mt::save_checkpoint(dir.file("never.safetensors"), model, lso, {.epoch = -1}); },
          {"save_checkpoint", "epoch is -1", ">= 0"}),
      expect<mt::ValueError>("load_state: negative iterations",
                             [&] {
                               mo::Adam adam;
                               adam.load_state({.iterations = -1}, model.trainable_variables());
                             },
                             {"Adam::load_state", "iterations is -1", ">= 0"}),
      expect<mt::ValueError>(
          "load_state: a scalar Adam does not keep",
          [&] {
            mo::Adam adam;
            adam.load_state({.scalars = {{"loss_scale", 2.0}}}, model.trainable_variables());
          },
          {"Adam::load_state", "unknown scalar 'loss_scale'"}),
  });
  CHECK_FALSE(fs::exists(dir.file("never.safetensors")));
}
