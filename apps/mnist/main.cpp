// mixtape-mnist: trains a classifier on MNIST (or Fashion-MNIST) with mixtape, the way the
// Keras mixed precision guide does: a dtype policy, Model.fit (or the guide's custom
// GradientTape loop with a LossScaleOptimizer), per-epoch metrics, the test accuracy, and
// optionally checkpoints, a metrics file and an SVG of the learning curves.
//
// Run with no options it fetches MNIST if needed, picks the GPU when there is one, and
// trains the 784-512-512-10 MLP. `mixtape-mnist --help` lists the options.
#include <mixtape/mixtape.h>
#include <spdlog/cfg/env.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/cli.h"
#include "common/device.h"
#include "common/files.h"
#include "common/ranks.h"
#include "plot.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;

namespace {

using apps::integer;
using apps::no_value;
using apps::one_of;
using apps::pick_device;
using apps::policy_name;
using apps::real;
using apps::validator;

struct Options {
  std::string model = "mlp";
  std::string policy = "float32";
  std::string device = "auto";
  int epochs = 0;                   // 0: 5, or 15 for the resnet on Fashion-MNIST (default_epochs)
  std::int64_t batch_size = 0;      // 0: 128, or 8192 for the guide model
  double learning_rate = 0.0;       // 0: 0.001 (0.002 for the cnn and the resnet)
  std::string schedule = "cosine";  // or constant
  std::string augment = "auto";     // auto, none, shift, flip, shift+flip
  std::uint64_t seed = 0;
  std::string data_dir;
  std::string dataset = "mnist";
  bool custom_loop = false;
  std::string save, resume, metrics_out, plot, export_onnx;
  double validation_split = 0.0;  // 0: validate on the test set
  std::int64_t limit = 0;         // use only the first N training images
  std::int64_t units = 0;         // guide model width (0: 4096 on a GPU, 64 on a CPU)
  int verbose = 1;
  bool trace_dtypes = false;
  bool capture_step = false;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// --- The command line (CLI11) ---------------------------------------------------------------
// Each option's value is checked by one of the validators below; CLI11 refuses it with
// "--flag: <message>", and main() prints that as one line with a pointer to --help (exit
// status 2).

CLI::Validator svg_path() {
  return validator([](const std::string& v) -> std::string {
    if (ends_with(v, ".svg")) return {};
    return fmt::format("writes an SVG image; give a path ending in .svg (got '{}')", v);
  });
}

// The options, their help text and their checks. The help text is CLI11's, made from the
// descriptions below.
void add_options(CLI::App& app, Options& o) {
  app.get_formatter()->column_width(24);
  app.set_help_flag("-h,--help", "this text");
  app.footer(
      "An option given more than once takes its last value. --name=value works as well as\n"
      "--name value.");
  // Like the hand-written parser this replaces: a repeated option is no error, the last
  // value wins (every value is still checked).
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Unknown options and positional arguments are collected, then refused by
  // refuse_extras() with a hint at the closest known option.
  app.allow_extras();

  app.add_option("--model", o.model,
                 "mlp (784-512-512-10, default), cnn (Conv32-pool-Conv64-pool-Dense128-\n"
                 "Dense10), resnet (a small ResNet: conv stem, three residual blocks of\n"
                 "16, 32 and 64 channels with BatchNormalization, global average pooling)\n"
                 "or guide (the mixed precision guide's two Dense(units) layers)")
      ->type_name("NAME")
      ->check(one_of("model", {"mlp", "cnn", "resnet", "guide"}));
  app.add_option("--policy", o.policy,
                 "dtype policy: float32 (default), mixed_float16, mixed_bfloat16,\n"
                 "mixed_float8, float16, bfloat16, float64")
      ->type_name("NAME")
      ->check(policy_name());
  app.add_option("--device", o.device,
                 "auto (default: cuda when a GPU is present), cpu, cuda (under mpirun: the\n"
                 "GPU of the rank's place on its machine), cuda:N")
      ->type_name("NAME");
  app.add_option("--epochs", o.epochs,
                 "epochs to train (default 5; 15 for the resnet on Fashion-MNIST)")
      ->type_name("N")
      ->transform(integer(0));
  app.add_option("--batch-size", o.batch_size, "default 128 (8192 for --model guide)")
      ->type_name("N")
      ->transform(integer(1, std::numeric_limits<std::int64_t>::max()));
  app.add_option("--learning-rate", o.learning_rate,
                 "default 0.001, 0.002 for the cnn (Adam for mlp and cnn, RMSprop\n"
                 "for guide)")
      ->type_name("X")
      ->transform(real(1e-9, 10.0));
  app.add_option("--schedule", o.schedule, "cosine (default: decays to 0 over the run) or constant")
      ->type_name("NAME")
      ->check(one_of("schedule", {"cosine", "constant"}));
  app.add_option("--augment", o.augment,
                 "training images moved and mirrored at random (inference sees them\n"
                 "as they are): none, shift (by up to 2 pixels), flip (mirrored\n"
                 "left-right), shift+flip, auto (default: shift for the resnet on\n"
                 "MNIST, flip for it on Fashion-MNIST; none for the other models)")
      ->type_name("NAME")
      ->check(one_of("augment", {"auto", "none", "shift", "flip", "shift+flip"}));
  app.add_option("--seed", o.seed, "weights, shuffling (default 0)")
      ->type_name("N")
      ->transform(integer(0, std::numeric_limits<std::int64_t>::max()));
  app.add_option("--data-dir", o.data_dir,
                 "directory with the four IDX files (raw or .gz); default\n"
                 "$MIXTAPE_DATA_DIR, then the cache, then a download")
      ->type_name("DIR");
  app.add_option("--dataset", o.dataset, "mnist (default) or fashion (Fashion-MNIST)")
      ->type_name("NAME")
      ->check(one_of("dataset", {"mnist", "fashion"}));
  app.add_flag("--custom-loop", o.custom_loop,
               "the guide's GradientTape + LossScaleOptimizer loop instead of fit")
      ->check(no_value());
  app.add_option("--save", o.save, "write a checkpoint (safetensors) after every epoch")
      ->type_name("PATH");
  app.add_option("--resume", o.resume, "continue from a checkpoint written by --save")
      ->type_name("PATH");
  app.add_option("--export-onnx", o.export_onnx,
                 "write the trained model to this file as ONNX (opset 17), after the test");
  app.add_option("--metrics-out", o.metrics_out,
                 "per-epoch metrics: CSV, or JSON lines when PATH ends in .jsonl/.json")
      ->type_name("PATH");
  app.add_option("--plot", o.plot,
                 "an SVG image of the loss and accuracy curves (training, validation)")
      ->type_name("PATH")
      ->check(svg_path());
  app.add_option("--validation-split", o.validation_split,
                 "hold out this fraction of the training images for validation\n"
                 "(default: validate on the test set)")
      ->type_name("X")
      ->transform(real(0.0, 0.9));
  app.add_option("--limit", o.limit, "train on the first N training images only")
      ->type_name("N")
      ->transform(integer(1, std::numeric_limits<std::int64_t>::max()));
  app.add_option("--units", o.units,
                 "width of the guide model (default 4096 on a GPU, 64 on a CPU)")
      ->type_name("N")
      ->transform(integer(1, std::numeric_limits<std::int64_t>::max()));
  app.add_flag("--trace-dtypes", o.trace_dtypes,
               "print which dtypes each layer used (the cheat sheet of the model)")
      ->check(no_value());
  app.add_flag("--capture-step", o.capture_step,
               "fit captures the training step at the first batch and replays it (a CUDA graph "
               "on a GPU; compile's capture_step; augmentation draws new moves each replay); not "
               "with --custom-loop")
      ->check(no_value());
  app.add_option("--verbose", o.verbose, "0 quiet, 1 progress bar (default), 2 one line per epoch")
      ->type_name("N")
      ->transform(integer(0));
}

// The edit distance of a and b, a transposition of two neighbours counting as one edit.
std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<std::size_t>> d(a.size() + 1, std::vector<std::size_t>(b.size() + 1));
  for (std::size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (std::size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i)
    for (std::size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min(
          {d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[a.size()][b.size()];
}

// "; did you mean --epochs?" for an argument close to an option CLI11 knows, "" when none is.
// An option (`--epoch`, `-epochs`, `--epoch=3`) is close to the known options it abbreviates,
// or else to those within the smallest edit distance, at most 2; a positional argument only
// to an option of its exact name (`epochs`: the dashes forgotten).
std::string did_you_mean(const CLI::App& app, std::string arg, bool positional) {
  arg = arg.substr(0, arg.find('='));
  arg.erase(0, arg.find_first_not_of('-'));
  if (arg.empty()) return {};
  std::vector<std::string> names;  // the long names, in the order of --help
  for (const CLI::Option* option : app.get_options())
    for (const std::string& name : option->get_lnames()) names.push_back(name);

  std::vector<std::string> close;
  if (positional) {
    if (std::find(names.begin(), names.end(), arg) != names.end()) close.push_back(arg);
  } else {
    for (const std::string& name : names)
      if (name.starts_with(arg)) close.push_back(name);
    if (close.empty()) {
      std::size_t best = std::min<std::size_t>(2, arg.size() - 1);
      for (const std::string& name : names) best = std::min(best, edit_distance(arg, name));
      for (const std::string& name : names)
        if (edit_distance(arg, name) <= best) close.push_back(name);
    }
  }
  if (close.empty() || close.size() > 3) return {};
  std::string hint = "; did you mean --" + close[0];
  for (std::size_t i = 1; i < close.size(); ++i)
    hint += (i + 1 == close.size() ? " or --" : ", --") + close[i];
  return hint + "?";
}

// Refuses what CLI11 left over (app.allow_extras()): an unknown option, or a positional
// argument (the trainer takes none; everything after `--` is one).
// What --augment means for the model: none, shift, flip or shift+flip ("auto": shift for the
// resnet, flip for it on Fashion-MNIST, none otherwise).
std::string augmentation_kind(const Options& o) {
  if (o.augment != "auto") return o.augment;
  return o.model != "resnet" ? "none" : o.dataset == "fashion" ? "flip" : "shift";
}

// --capture-step with what it cannot capture: a CLI error naming both.
void check_capture(const Options& o) {
  if (!o.capture_step) return;
  if (o.custom_loop)
    throw CLI::ValidationError("--capture-step",
                               "it captures fit's step, and --custom-loop trains without fit "
                               "(leave one out)");
}

void refuse_extras(const CLI::App& app) {
  bool options_ended = false;
  for (const std::string& arg : app.remaining()) {
    if (arg == "--" && !options_ended) {
      options_ended = true;
      continue;
    }
    // "-1" is no option: CLI11 reads a dash before a digit as a negative number.
    const bool option =
        !options_ended && arg.size() > 1 && arg[0] == '-' && !(arg[1] >= '0' && arg[1] <= '9');
    throw CLI::ExtrasError(
        option ? fmt::format("unknown option '{}'{}", arg, did_you_mean(app, arg, false))
               : fmt::format("unexpected argument '{}': mixtape-mnist takes options only{}", arg,
                             did_you_mean(app, arg, true)),
        CLI::ExitCodes::ExtrasError);
  }
}

// --- Checks before anything is loaded or trained ------------------------------------------------
// A run that fails should fail in its first second, not after an epoch (or the whole run): the
// outputs are checked before the data is loaded, the data when it is loaded (the loaders
// check the IDX headers, the image and label counts and that every label is 0..9), and the
// options that depend on the data before the model is built.

// Checks that `path`, the value of `flag`, is a file that can be read.
void check_readable(const std::string& flag, const std::string& path) {
  namespace fs = std::filesystem;
  auto refuse = [&](const std::string& why) {
    throw mt::IOError(fmt::format("{}: cannot read '{}': {}", flag, path, why));
  };
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found) refuse("no such file");
  if (ec) refuse(ec.message());
  if (!fs::is_regular_file(st)) refuse("it is not a regular file");
  if (::access(path.c_str(), R_OK) != 0) refuse(std::strerror(errno));
}

// The epochs a run takes when --epochs is not given: 5, and 15 for the resnet on
// Fashion-MNIST, which needs them to pass 92.5% (docs/mnist.md: 0.9279 and 0.9258 for
// seeds 0 and 1 under mixed_bfloat16, against 0.9182 after 5).
int default_epochs(const Options& o) {
  return o.model == "resnet" && o.dataset == "fashion" ? 15 : 5;
}

// A small ResNet for 28x28 images, a functional model: a 3x3 conv stem (16 channels), three
// residual blocks (16 channels; 32 and 64 with stride 2, their shortcuts a strided 1x1 conv),
// each conv followed by BatchNormalization, then global average pooling and the logits.
std::unique_ptr<mt::Model> build_resnet(const std::vector<ml::LayerPtr<ml::Layer>>& augmentation) {
  auto conv_bn = [](ml::SymbolicTensor x, std::int64_t filters, std::int64_t stride,
                    std::int64_t kernel) {
    x = ml::Conv2D(filters, kernel, {.strides = stride, .padding = "same", .use_bias = false})(x);
    return ml::BatchNormalization()(x);
  };
  auto block = [&](const ml::SymbolicTensor& x, std::int64_t filters, std::int64_t stride) {
    ml::SymbolicTensor shortcut = x;
    if (stride != 1 || x.shape()[3] != filters) shortcut = conv_bn(x, filters, stride, 1);
    auto h = ml::Activation("relu")(conv_bn(x, filters, stride, 3));
    h = conv_bn(h, filters, 1, 3);
    return ml::Activation("relu")(ml::Add()({h, shortcut}));
  };
  auto inputs = ml::Input({28, 28}, {.name = "images"});
  auto x = ml::Reshape({28, 28, 1})(inputs);
  for (const auto& layer : augmentation) x = layer(x);
  x = ml::Activation("relu")(conv_bn(x, 16, 1, 3));
  x = block(x, 16, 1);  // 28x28
  x = block(x, 32, 2);  // 14x14
  x = block(x, 64, 2);  // 7x7
  x = ml::GlobalAveragePooling2D()(x);
  x = ml::Dense(10, {.name = "logits"})(x);
  auto outputs = ml::Activation("linear", {.dtype = "float32", .name = "predictions"})(x);
  return std::make_unique<mt::Model>(inputs, outputs, mt::ModelOptions{.name = "resnet"});
}

// The augmentation layers --augment asks for, applied to [batch, 28, 28, 1] images. Moves of
// up to 2 pixels (0.075 of 28 rounds to at most 2) with a black fill, as the digits and
// clothes sit on black; mirrors left-right only where a mirrored image is still of its
// class (clothes, not digits).
std::vector<ml::LayerPtr<ml::Layer>> augmentation_layers(const Options& o) {
  const std::string kind = augmentation_kind(o);
  std::vector<ml::LayerPtr<ml::Layer>> layers;
  if (kind == "none") return layers;
  if (kind != "flip")
    layers.push_back(ml::RandomTranslation(0.075, 0.075, {.fill_mode = "constant"}));
  if (kind != "shift") layers.push_back(ml::RandomFlip("horizontal"));
  return layers;
}

// The four models. Each ends in a float32 layer, as the guide advises under mixed
// precision: logits through a float32 linear activation (mlp, cnn, resnet: the loss takes
// logits), or the guide's float32 softmax.
std::unique_ptr<mt::Model> build_model(const Options& o, std::int64_t units) {
  const std::vector<ml::LayerPtr<ml::Layer>> augmentation = augmentation_layers(o);
  if (o.model == "resnet") return build_resnet(augmentation);
  std::vector<ml::LayerPtr<ml::Layer>> layers;
  if (!augmentation.empty()) {
    layers.push_back(ml::Reshape({28, 28, 1}));
    layers.insert(layers.end(), augmentation.begin(), augmentation.end());
  }
  if (o.model == "mlp") {
    layers.insert(layers.end(),
                  {ml::Flatten(), ml::Dense(512, {.activation = "relu"}),
                   ml::Dense(512, {.activation = "relu"}), ml::Dense(10, {.name = "logits"}),
                   ml::Activation("linear", {.dtype = "float32", .name = "predictions"})});
  } else if (o.model == "cnn") {
    if (augmentation.empty()) layers.push_back(ml::Reshape({28, 28, 1}));
    layers.insert(layers.end(),
                  {ml::Conv2D(32, 3, {.activation = "relu"}), ml::MaxPooling2D(),
                   ml::Conv2D(64, 3, {.activation = "relu"}), ml::MaxPooling2D(), ml::Flatten(),
                   ml::Dense(128, {.activation = "relu"}), ml::Dense(10, {.name = "logits"}),
                   ml::Activation("linear", {.dtype = "float32", .name = "predictions"})});
  } else {
    layers.insert(layers.end(),
                  {ml::Flatten(), ml::Dense(units, {.activation = "relu", .name = "dense_1"}),
                   ml::Dense(units, {.activation = "relu", .name = "dense_2"}),
                   ml::Dense(10, {.name = "dense_logits"}),
                   ml::Activation("softmax", {.dtype = "float32", .name = "predictions"})});
  }
  return std::make_unique<mt::Sequential>(std::move(layers), mt::ModelOptions{.name = o.model});
}

// Per-epoch metrics to a CSV or JSON-lines file, flushed after every epoch.
class MetricsWriter {
 public:
  explicit MetricsWriter(const std::string& path)
      : path_(path), json_(ends_with(path, ".jsonl") || ends_with(path, ".json")) {
    out_.open(path, std::ios::out | std::ios::trunc);
    if (!out_)
      throw mt::ValueError(
          fmt::format("cannot write the metrics file '{}': {}", path, std::strerror(errno)));
  }
  void write(int epoch, const mt::Logs& logs, double train_seconds, double us_per_sample) {
    static const std::vector<std::string> kKeys = {"loss",         "accuracy",   "val_loss",
                                                   "val_accuracy", "loss_scale", "skipped_steps"};
    if (json_) {
      std::string line = fmt::format("{{\"epoch\": {}", epoch + 1);
      for (const auto& k : kKeys)
        if (logs.count(k)) line += fmt::format(", \"{}\": {}", k, logs.at(k));
      line += fmt::format(", \"seconds\": {:.4f}, \"us_per_sample\": {:.3f}}}\n", train_seconds,
                          us_per_sample);
      out_ << line;
    } else {
      if (!header_written_) {
        out_ << "epoch";
        for (const auto& k : kKeys) out_ << ',' << k;
        out_ << ",seconds,us_per_sample\n";
        header_written_ = true;
      }
      out_ << epoch + 1;
      for (const auto& k : kKeys) {
        out_ << ',';
        if (logs.count(k)) out_ << fmt::format("{}", logs.at(k));
      }
      out_ << fmt::format(",{:.4f},{:.3f}\n", train_seconds, us_per_sample);
    }
    out_.flush();
    if (!out_) throw mt::ValueError(fmt::format("writing the metrics file '{}' failed", path_));
  }

 private:
  std::string path_;
  bool json_;
  bool header_written_ = false;
  std::ofstream out_;
};

// What happens at the end of every epoch, for fit and the custom loop alike: the metrics
// file, the checkpoint, the curves.
struct EpochSink {
  const Options& options;
  std::map<std::string, std::string> metadata;
  std::optional<MetricsWriter> metrics;
  mnist_app::Curves curves;

  void end_epoch(mt::Model& model, int epoch, const mt::Logs& logs, double train_seconds,
                 std::int64_t samples) {
    // Data-parallel: every rank has the same model and logs; rank 0 alone writes files.
    if (!mt::distributed::is_root()) return;
    const double us = train_seconds / static_cast<double>(std::max<std::int64_t>(samples, 1)) * 1e6;
    if (metrics) metrics->write(epoch, logs, train_seconds, us);
    if (!options.save.empty())
      // The whole model (architecture, weights, optimizer state): --resume reads it into a
      // model made from the options, and mt::load_model reads it without them.
      model.save(options.save, mt::TrainingCheckpoint{.epoch = epoch + 1, .metadata = metadata});
    curves.epochs.push_back(epoch + 1);
    for (const auto& [k, v] : logs) curves.series[k].push_back(v);
  }
};

// fit's side of EpochSink: times the training part of each epoch.
class SinkCallback : public mt::Callback {
 public:
  SinkCallback(EpochSink& sink, std::int64_t samples) : sink_(sink), samples_(samples) {}
  void on_epoch_begin(mt::Model&, int) override { start_ = last_ = Clock::now(); }
  // The time of the last batch's end (fit reads that batch's logs, so a GPU has finished the
  // epoch by then); the batch logs themselves are not needed.
  void on_batch_end(mt::Model&, std::int64_t, const mt::Logs&) override { last_ = Clock::now(); }
  bool wants_batch_logs() const override { return false; }
  void on_epoch_end(mt::Model& model, int epoch, const mt::Logs& logs) override {
    sink_.end_epoch(model, epoch, logs, std::chrono::duration<double>(last_ - start_).count(),
                    samples_);
  }

 private:
  using Clock = std::chrono::steady_clock;
  EpochSink& sink_;
  std::int64_t samples_;
  Clock::time_point start_, last_;
};

// The guide's custom training loop, with the same per-epoch output as fit. The step is the
// same whatever the policy and the number of processes: the optimizer chain compile() made
// (a LossScaleOptimizer under mixed_float16, a DistributedOptimizer outside it under mpirun)
// scales, reduces, unscales and checks inside compute_gradients and apply_gradients.
void custom_loop(mt::Model& model, const Options& o, const mt::Tensor& x, const mt::Tensor& y,
                 const mt::Tensor& x_val, const mt::Tensor& y_val, std::int64_t batch_size,
                 int start_epoch, EpochSink& sink) {
  const std::shared_ptr<mt::optim::Optimizer>& optimizer = model.optimizer();
  mt::optim::DistributedOptimizer* dopt = optimizer->distributed_optimizer();
  const mt::optim::LossScaleOptimizer* lso = optimizer->loss_scale_optimizer();
  const mt::losses::Loss& loss_object = model.loss();
  const std::vector<mt::Variable> vars = model.trainable_variables();
  for (int epoch = start_epoch; epoch < o.epochs; ++epoch) {
    // A shuffle seeded by (seed, epoch): a resumed run replays the same batches. Each rank
    // takes its share of every batch (all of it on one process).
    auto train_ds = mt::data::Dataset::from_tensors(x, y)
                        .shuffle(x.dim(0), o.seed * 1000003ULL + static_cast<std::uint64_t>(epoch))
                        .batch(batch_size)
                        .shard(mt::distributed::rank(), mt::distributed::world_size());
    // On a GPU the next batch is gathered and copied while the current step runs; on the
    // CPU a second thread would only compete with the step's own OpenMP threads.
    if (model.device().is_cuda()) train_ds = train_ds.to(model.device()).prefetch(2);
    mt::metrics::Mean epoch_loss("loss");
    mt::metrics::SparseCategoricalAccuracy train_accuracy("accuracy");
    const std::int64_t skipped_before = lso ? lso->skipped_steps() : 0;
    const auto start = std::chrono::steady_clock::now();
    std::int64_t rows = 0;
    for (const auto& batch : train_ds) {
      if (dopt) dopt->set_gradient_weight(batch.share());  // an uneven split weighs by rows
      mt::GradientTape tape;
      const mt::Tensor predictions = model(batch.x(), {.training = true});
      const mt::Tensor loss = loss_object(batch.y(), predictions);
      optimizer->apply_gradients(optimizer->compute_gradients(tape, loss, vars), vars);
      epoch_loss.update_state(loss, mt::full({}, static_cast<double>(batch.rows())));
      train_accuracy.update_state(batch.y(), predictions.detach());
      rows += batch.rows();
    }
    optimizer->check_pending();  // the last steps' finiteness checks, read behind them on a GPU
    // result() reads the totals back from the model's device: on a GPU that waits for the
    // epoch's last step, so the time is taken after it. Every rank's means, weighted by its
    // samples.
    mt::Logs logs = mt::optim::average_over_ranks(
        {{"loss", epoch_loss.result()}, {"accuracy", train_accuracy.result()}}, rows);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    for (const auto& [k, v] : model.evaluate(x_val, y_val, {.batch_size = 1000}))
      logs["val_" + k] = v;
    if (lso) {
      logs["loss_scale"] = lso->loss_scale();
      logs["skipped_steps"] = static_cast<double>(lso->skipped_steps() - skipped_before);
    }
    if (o.verbose > 0) {
      fmt::print("Epoch {}/{} - {:.1f}s - {:.0f}us/sample - {}\n", epoch + 1, o.epochs, seconds,
                 seconds / static_cast<double>(x.dim(0)) * 1e6,
                 mt::format_logs(logs, {"loss", "accuracy", "val_loss", "val_accuracy",
                                        "loss_scale", "skipped_steps"}));
      std::fflush(stdout);
    }
    sink.end_epoch(model, epoch, logs, seconds, x.dim(0));
  }
}

// The files the options name, checked before the data is loaded (a download, maybe) and
// anything is trained. The metrics file itself is created only when training starts: a run
// that fails before leaves no (empty, or emptied) metrics file behind.
void check_files(const Options& o) {
  if (!o.save.empty()) apps::check_writable("--save", o.save, /*in_place=*/false);
  if (!o.plot.empty()) apps::check_writable("--plot", o.plot, /*in_place=*/false);
  if (!o.metrics_out.empty())
    apps::check_writable("--metrics-out", o.metrics_out, /*in_place=*/true);
  if (!o.export_onnx.empty())
    apps::check_writable("--export-onnx", o.export_onnx, /*in_place=*/false);
  if (!o.resume.empty()) check_readable("--resume", o.resume);
}

// The images as training uses them: uint8 images scaled to float32 in [0, 1] on the host,
// int64 labels; the first --limit training images, the validation images (held out, or the
// test set), and the test set.
struct Data {
  mt::Tensor x, y, x_val, y_val, x_test, y_test;
};

Data load_data(const Options& o) {
  mt::datasets::LoadOptions load;
  if (!o.data_dir.empty()) {
    // An explicit directory must exist: falling back to the cache or a download would
    // hide the mistake.
    std::error_code ec;
    if (!std::filesystem::is_directory(o.data_dir, ec))
      throw mt::IOError(fmt::format(
          "the data directory '{}' {}; point --data-dir at a directory with the four MNIST "
          "IDX files, or leave it out to use the cache or a download",
          o.data_dir,
          std::filesystem::exists(o.data_dir, ec) ? "is not a directory" : "does not exist"));
    load.data_dir = o.data_dir;
  }
  load.verbose = o.verbose > 0;
  // Rank 0 reads (or downloads into the cache) first; the others then read the cache.
  const auto read = [&] {
    return o.dataset == "fashion" ? mt::datasets::fashion_mnist::load(load)
                                  : mt::datasets::mnist::load(load);
  };
  std::optional<mt::datasets::Mnist> loaded;
  if (mt::distributed::is_root()) loaded = read();
  mt::distributed::barrier();
  if (!loaded) loaded = read();
  Data d{loaded->train.x, loaded->train.y, loaded->test.x,
         loaded->test.y,  loaded->test.x,  loaded->test.y};
  if (o.limit > 0 && o.limit < d.x.dim(0)) {
    d.x = d.x.slice(0, 0, o.limit);
    d.y = d.y.slice(0, 0, o.limit);
  }
  if (o.validation_split > 0.0) {
    const auto n_train =
        static_cast<std::int64_t>(static_cast<double>(d.x.dim(0)) * (1.0 - o.validation_split));
    if (n_train < 1)
      throw mt::ValueError(
          fmt::format("--validation-split {} of {} training image{} leaves none to train on; use a "
                      "smaller split or more images (--limit)",
                      o.validation_split, d.x.dim(0), d.x.dim(0) == 1 ? "" : "s"));
    d.x_val = d.x.slice(0, n_train, d.x.dim(0));
    d.y_val = d.y.slice(0, n_train, d.y.dim(0));
    d.x = d.x.slice(0, 0, n_train);
    d.y = d.y.slice(0, 0, n_train);
  }
  return d;
}

// compile() with the options' optimizer and learning rate: constant, or a cosine decay to 0
// over all the run's steps.
void compile_model(mt::Model& model, const Options& o, std::int64_t samples,
                   std::int64_t batch_size) {
  const std::int64_t steps = (samples + batch_size - 1) / batch_size * std::max(o.epochs, 1);
  const double base_lr = o.learning_rate > 0
                             ? o.learning_rate
                             : (o.model == "cnn" || o.model == "resnet" ? 2e-3 : 1e-3);
  const mt::optim::LearningRate lr = o.schedule == "cosine"
                                         ? mt::optim::schedules::cosine_decay(base_lr, steps)
                                         : mt::optim::LearningRate(base_lr);
  model.compile(
      {.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = o.model != "guide"}),
       .optimizer = o.model == "guide" ? mt::OptimizerRef(mt::optim::RMSprop({.learning_rate = lr}))
                                       : mt::OptimizerRef(mt::optim::Adam({.learning_rate = lr})),
       .metrics = {"accuracy"},
       .capture_step = o.capture_step});
}

// --resume: the checkpoint's weights and optimizer state, after checking that it was
// written with these options; the epoch to go on from.
int resume(mt::Model& model, const Options& o, const std::map<std::string, std::string>& meta) {
  const mt::TrainingCheckpoint ckpt = mt::load_checkpoint(o.resume, model, *model.optimizer());
  for (const char* key : {"model", "policy", "dataset"}) {
    auto it = ckpt.metadata.find(key);
    if (it != ckpt.metadata.end() && it->second != meta.at(key))
      throw mt::ValueError(
          fmt::format("checkpoint '{}' was written with --{} {}; resume with the "
                      "same options (this run has --{} {})",
                      o.resume, key, it->second, key, meta.at(key)));
  }
  auto planned = ckpt.metadata.find("epochs");
  if (o.schedule != "constant" && planned != ckpt.metadata.end() &&
      planned->second != std::to_string(o.epochs))
    spdlog::warn(
        "checkpoint '{}' was written by a run of --epochs {}; the {} learning-rate "
        "schedule spans --epochs, so this run of --epochs {} follows another curve",
        o.resume, planned->second, o.schedule, o.epochs);
  if (o.verbose > 0)
    fmt::print("Resumed from '{}' after epoch {} (optimizer step {})\n", o.resume, ckpt.epoch,
               model.optimizer()->iterations());
  return ckpt.epoch;
}

// What every rank must agree on to take the same steps (the seed need not: rank 0's wins),
// for distributed::check_same_on_all_ranks.
std::string run_description(const Options& o, const Data& data, std::int64_t batch_size,
                            std::int64_t units) {
  return fmt::format(
      "model {}, units {}, policy {}, dataset {}, {} training images, {} validation images, "
      "batch {}, epochs {}, learning rate {}, schedule {}, augment {}, {}, resume '{}'",
      o.model, units, o.policy, o.dataset, data.x.dim(0), data.x_val.dim(0), batch_size, o.epochs,
      o.learning_rate, o.schedule, o.augment, o.custom_loop ? "custom loop" : "fit", o.resume);
}

int run(Options o) {
  // Data-parallel under mpirun (world size 1 otherwise): every rank runs this program on
  // its share of each batch; rank 0 alone prints and writes files.
  mt::distributed::init();
  if (!mt::distributed::is_root()) o.verbose = 0;
  o.seed = apps::rank0_seed(o.seed);  // the weights and every shuffle: rank 0's
  mt::manual_seed(o.seed);
  mt::set_global_policy(o.policy);
  const mt::Device device = pick_device(o.device);
  const std::int64_t units = o.units ? o.units : (device.is_cuda() ? 4096 : 64);
  const std::int64_t batch_size = o.batch_size ? o.batch_size : (o.model == "guide" ? 8192 : 128);
  if (batch_size < mt::distributed::world_size())
    throw mt::ValueError(fmt::format(
        "--batch-size {} is smaller than the {} ranks: the batch is the global one, split "
        "across the ranks",
        batch_size, mt::distributed::world_size()));
  check_files(o);
  Data data = load_data(o);
  mt::distributed::check_same_on_all_ranks("the ranks were given different data or options",
                                           run_description(o, data, batch_size, units));

  std::unique_ptr<mt::Model> model = build_model(o, units);
  model->build_for({-1, 28, 28});
  model->to(device);
  // On a GPU the images live there for the whole run (188 MB of float32 for MNIST): fit
  // and the custom loop then gather each batch on the device instead of copying it from
  // the host every step, which cost the guide model more than its GEMMs did on an H200.
  if (device.is_cuda())
    for (mt::Tensor* t : {&data.x, &data.y, &data.x_val, &data.y_val}) *t = t->to(device);
  compile_model(*model, o, data.x.dim(0), batch_size);
  EpochSink sink{o, {}, std::nullopt, {}};
  sink.metadata = {{"model", o.model},       {"policy", o.policy},
                   {"dataset", o.dataset},   {"seed", std::to_string(o.seed)},
                   {"schedule", o.schedule}, {"epochs", std::to_string(o.epochs)}};
  if (o.verbose > 0) {
    fmt::print(
        "mixtape-mnist: model {}, policy {}, device {}, {} training images, {} validation "
        "images ({}{}), batch {}, {}\n",
        o.model, o.policy, device, data.x.dim(0), data.x_val.dim(0), o.dataset,
        o.validation_split > 0.0 ? ", held out from training" : " test set", batch_size,
        o.custom_loop ? "custom GradientTape loop" : "Model.fit");
    model->summary();
  }
  if (o.trace_dtypes) {
    const mt::DTypeTrace trace = mt::trace_dtypes(*model, data.x.slice(0, 0, 8).to(device));
    fmt::print("Which dtypes each layer used (input, weights, computation, output):\n{}",
               trace.table());
  }
  const int start_epoch = o.resume.empty() ? 0 : resume(*model, o, sink.metadata);

  // --- Training ------------------------------------------------------------------------------
  if (!o.metrics_out.empty()) sink.metrics.emplace(o.metrics_out);
  if (o.custom_loop) {
    custom_loop(*model, o, data.x, data.y, data.x_val, data.y_val, batch_size, start_epoch, sink);
  } else {
    model->fit(data.x, data.y,
               {.batch_size = batch_size,
                .epochs = o.epochs,
                .validation_data = std::make_pair(data.x_val, data.y_val),
                .seed = o.seed,
                .verbose = o.verbose,
                .callbacks = {std::make_shared<SinkCallback>(sink, data.x.dim(0))},
                .initial_epoch = start_epoch});
  }

  // --- Test accuracy -------------------------------------------------------------------------
  const mt::Logs scores = model->evaluate(data.x_test, data.y_test, {.batch_size = 1000});
  if (!mt::distributed::is_root()) return 0;
  fmt::print("Test loss: {:.4f}\nTest accuracy: {:.4f}\n", scores.at("loss"),
             scores.at("accuracy"));
  if (!o.export_onnx.empty()) {
    mt::export_onnx(*model, o.export_onnx);
    if (o.verbose > 0) fmt::print("ONNX model (opset 17) written to {}\n", o.export_onnx);
  }
  if (!o.plot.empty()) {
    mnist_app::write_curves_svg(
        o.plot, sink.curves,
        fmt::format("mixtape-mnist: {} on {}, {}", o.model, o.dataset, o.policy));
    if (o.verbose > 0) fmt::print("Learning curves written to {}\n", o.plot);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  spdlog::cfg::load_env_levels();  // SPDLOG_LEVEL=debug: the library's debug log too
  Options options;
  CLI::App app("Trains a classifier on MNIST with mixtape and reports the test accuracy.",
               "mixtape-mnist");
  try {
    add_options(app, options);
    app.parse(argc, argv);
    refuse_extras(app);
    if (app.count("--epochs") == 0) options.epochs = default_epochs(options);
    check_capture(options);
  } catch (const CLI::Success& e) {  // --help: the help text on stdout, exit status 0
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // a bad command line: one line, exit status 2
    std::fprintf(stderr, "mixtape-mnist: %s (see --help)\n", e.what());
    return 2;
  }
  try {
    return run(options);
  } catch (const std::exception& e) {
    // Under mpirun the other ranks may be waiting for this one: end them all.
    if (mt::distributed::world_size() > 1)
      mt::distributed::abort(
          1, fmt::format("mixtape-mnist: error on rank {}: {}", mt::distributed::rank(), e.what()));
    std::fprintf(stderr, "mixtape-mnist: error: %s\n", e.what());
    return 1;
  }
}
