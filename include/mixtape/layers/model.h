// Models: a functional Model (Input -> layer calls -> output) and Sequential. Both are
// layers: callable on tensors, with weights, get_weights/set_weights, to(device), and a
// summary that shows each layer's dtype policy.
//
//   auto inputs = mt::layers::Input({784}, {.name = "digits"});
//   auto x = mt::layers::Dense(64, {.activation = "relu"})(inputs);
//   auto outputs = mt::layers::Dense(10)(x);
//   mt::Model model(inputs, outputs);
//   mt::Tensor y = model(batch);
//
//   mt::Sequential seq({mt::layers::Dense(64, {.activation = "relu"}), mt::layers::Dense(10)});
//
// Under a mixed policy the output should be float32 (the guide's advice): a model whose
// output is float16 or bfloat16 says so once in the log and in its summary.
#pragma once

#include <chrono>
#include <concepts>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mixtape/core/capture.h"
#include "mixtape/data/dataset.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/losses.h"
#include "mixtape/layers/metrics.h"
#include "mixtape/optim/optimizer.h"

namespace mixtape {

class Model;

// What a training checkpoint records besides the model and the optimizer.
struct TrainingCheckpoint {
  int epoch = 0;                                     // e.g. the number of epochs done
  std::map<std::string, std::string> metadata = {};  // the caller's own keys and values
};

// How a load matches the tensors of a file to the weights of a model. By default each weight
// is read from the tensor named by its path (layers::weight_paths()).
struct WeightLoadOptions {
  // File tensor name -> weight path: the weight at the path is read from that tensor instead.
  // For files whose names differ from the model's paths, such as files of mixtape before
  // weight paths were scoped by their owner, whose names for sublayers' weights
  // ("dense_2/kernel") were unique only in the process that wrote them (docs/checkpoints.md,
  // "Files of earlier versions"). Each tensor feeds at most one weight.
  std::map<std::string, std::string> renames = {};
};

// A model made from to_json()'s text (layers of registered classes, mixtape/layers/config.h);
// ValueError naming what it cannot read: malformed JSON, an unknown layer class (with the
// registered ones), a graph that names a layer or a call it does not have.
std::shared_ptr<Model> model_from_json(const std::string& json);
// The model of a file written by Model::save (or mixtape-mnist --save): made from its
// architecture, its weights loaded (every weight checked against the file first, as
// load_weights does). ValueError for a file without an architecture (save_weights wrote it:
// make the model in code and call load_weights) or one that does not fit it; IOError for a
// file that cannot be read; an error of a layer of the architecture keeps its type. A model
// saved compiled comes back compiled as it was, its optimizer's state restored (when the file
// records its compile state: docs/checkpoints.md); otherwise the optimizer state of a
// checkpoint is restored by load_checkpoint(path, model, optimizer) after compile().
std::shared_ptr<Model> load_model(const std::string& path, const WeightLoadOptions& options = {});

// --- Training configuration ----------------------------------------------------------------

// An optimizer for compile(): by value (RMSprop(...)) or by name ("rmsprop"), each
// compile() makes a copy of its own, so one CompileOptions compiles several models with
// an optimizer (and its state) each; shared (a std::shared_ptr), every model compiled with
// it uses that very object.
class OptimizerRef {
 public:
  template <typename O>
  requires std::derived_from<O, optim::Optimizer> OptimizerRef(const O& optimizer)
      : ptr_(optimizer.clone()) {}  // NOLINT
  template <typename O>
  requires std::derived_from<O, optim::Optimizer> OptimizerRef(std::shared_ptr<O> optimizer)
      : ptr_(std::move(optimizer)), shared_(true) {}                 // NOLINT
  OptimizerRef(const char* name) : ptr_(optim::get(name)) {}         // NOLINT
  OptimizerRef(const std::string& name) : ptr_(optim::get(name)) {}  // NOLINT
  // The optimizer one compile() uses: a new copy, or the shared object (null when an empty
  // shared_ptr was given).
  std::shared_ptr<optim::Optimizer> get() const { return shared_ || !ptr_ ? ptr_ : ptr_->clone(); }
  bool shared() const { return shared_; }

 private:
  std::shared_ptr<optim::Optimizer> ptr_;
  bool shared_ = false;
};

// A metric for compile(): a name ("accuracy", ...) or a Metric object.
class MetricRef {
 public:
  MetricRef(const char* name) : name_(name) {}                                        // NOLINT
  MetricRef(std::string name) : name_(std::move(name)) {}                             // NOLINT
  MetricRef(std::shared_ptr<metrics::Metric> metric) : metric_(std::move(metric)) {}  // NOLINT
  const std::string& name() const { return name_; }
  const std::shared_ptr<metrics::Metric>& metric() const { return metric_; }

 private:
  std::string name_;
  std::shared_ptr<metrics::Metric> metric_;
};

// Losses by the name of the output (its layer's name), for compile().
using LossMap = std::map<std::string, losses::Loss>;

// The loss of compile(): one loss (for every output of the model), one per output in their
// order ({loss_a, loss_b}), or by output name (mt::LossMap{{"which", ...}, {"total", ...}}).
class LossSpec {
 public:
  LossSpec(losses::Loss loss) : single_(std::move(loss)) {}                         // NOLINT
  LossSpec(const char* name) : single_(losses::Loss(name)) {}                       // NOLINT
  LossSpec(std::vector<losses::Loss> per_output) : list_(std::move(per_output)) {}  // NOLINT
  LossSpec(LossMap by_name) : map_(std::move(by_name)), is_map_(true) {}            // NOLINT
  // One loss per output: output_names gives their number and names. Throws ValueError for a
  // list of another length, or a map that misses an output or names one that does not exist.
  std::vector<losses::Loss> resolve(const std::string& model,
                                    const std::vector<std::string>& output_names) const;

 private:
  std::optional<losses::Loss> single_;
  std::vector<losses::Loss> list_;
  LossMap map_;
  bool is_map_ = false;
};

struct CompileOptions {
  std::optional<LossSpec> loss = {};  // required
  OptimizerRef optimizer = "rmsprop";
  // Computed for every output (as "<output>_accuracy" when there are several).
  std::vector<MetricRef> metrics = {};
  // The weight of each output's loss in the total (default 1 each), in the order of the
  // outputs.
  std::vector<double> loss_weights = {};
  // Micro-batches per optimizer step (mixtape/optim/gradient_accumulation.h): each train_step
  // (each batch of fit) adds its gradients, every N-th steps with their mean. 1: none.
  std::int64_t gradient_accumulation_steps = 1;
  // fit and train_step capture the training step at the first batch and replay it for every
  // batch of the same shapes (mt::StepGraph, mixtape/core/capture.h: one CUDA graph launch a
  // step on a GPU); a batch of other shapes (the last, partial one) steps as usual. What a
  // captured step cannot do (a host read, several ranks, gradient accumulation) throws
  // CaptureError at the first batch. The results are those of the uncaptured steps.
  bool capture_step = false;
};

// Values by name: "loss", "accuracy", "val_loss", ...
using Logs = std::map<std::string, double>;

// "loss: 0.1234 - accuracy: 0.9876": the values of `keys` that `logs` holds, in that order,
// as fit prints them (loss_scale and skipped_steps as numbers, the others to 4 decimals).
std::string format_logs(const Logs& logs, const std::vector<std::string>& keys);

// What fit tells its callbacks before training starts (Keras' callback params).
struct TrainParams {
  int epochs = 0;                             // FitOptions::epochs (the last epoch is epochs - 1)
  std::int64_t steps = 0;                     // batches per epoch
  std::int64_t samples = 0;                   // training samples per epoch, all ranks' together
  int verbose = 0;                            // FitOptions::verbose
  std::vector<std::string> metric_keys = {};  // "loss", each output's loss, the metrics
};

// Hooks into fit(). Set model.stop_training() from one to end training after the epoch.
class Callback {
 public:
  virtual ~Callback() = default;
  virtual void set_params(const TrainParams&) {}
  virtual void on_train_begin(Model&) {}
  virtual void on_epoch_begin(Model&, int /*epoch*/) {}
  virtual void on_batch_end(Model&, std::int64_t /*batch*/, const Logs& /*logs*/) {}
  // Whether the next on_batch_end reads its logs (asked after each batch's step). The
  // batch's loss and metrics live on the model's device; reading them is a host
  // synchronisation per step on a GPU, which fit skips when no callback wants them:
  // on_batch_end then gets empty logs, except at the epoch's last batch (read, so the device
  // has finished the epoch's work).
  virtual bool wants_batch_logs() const { return true; }
  virtual void on_epoch_end(Model&, int /*epoch*/, const Logs& /*logs*/) {}
  virtual void on_train_end(Model&, const Logs& /*logs*/) {}
};

// fit's progress output, as Keras' ProgbarLogger: "Epoch 2/5", then with verbose 1 on a
// terminal a progress bar redrawn at most every 0.1 s (the running loss and metrics, the
// ETA), and a line per epoch: steps, time, us/sample, the epoch's logs (validation, loss
// scale and skipped steps included). fit adds one, before the callbacks given, when
// verbose > 0 (on rank 0 alone in a data-parallel job).
class ProgbarLogger : public Callback {
 public:
  explicit ProgbarLogger(int verbose = 1) : verbose_(verbose) {}
  void set_params(const TrainParams& params) override;
  void on_epoch_begin(Model&, int epoch) override;
  bool wants_batch_logs() const override;
  void on_batch_end(Model&, std::int64_t batch, const Logs& logs) override;
  void on_epoch_end(Model&, int epoch, const Logs& logs) override;

 private:
  using Clock = std::chrono::steady_clock;
  int verbose_;
  bool bar_ = false;  // verbose 1 on a terminal
  TrainParams params_;
  Clock::time_point start_, last_print_, end_;
};

// Stops training when `monitor` has not improved by min_delta for `patience` epochs.
class EarlyStopping : public Callback {
 public:
  struct Options {
    std::string monitor = "val_loss";
    std::int64_t patience = 0;
    double min_delta = 0.0;
    bool maximize = false;  // true for accuracies
  };
  explicit EarlyStopping(Options options);
  void on_train_begin(Model&) override;
  bool wants_batch_logs() const override { return false; }
  void on_epoch_end(Model& model, int epoch, const Logs& logs) override;
  int stopped_epoch() const { return stopped_epoch_; }

 private:
  Options options_;
  double best_ = 0.0;
  std::int64_t wait_ = 0;
  int stopped_epoch_ = -1;
  bool seen_ = false;
};

// Validation inputs and labels for fit(), written as Keras users write them:
// `.validation_data = {x_val, y_val}` (std::make_pair(x_val, y_val) works too). Empty, the
// default, means none.
// For a model of several inputs or outputs: `.validation_data = {{xa, xb}, {ya, yb}}`.
struct ValidationData {
  ValidationData() = default;
  ValidationData(Tensor x_val, Tensor y_val) : x(std::move(x_val)), y(std::move(y_val)) {}
  ValidationData(std::pair<Tensor, Tensor> xy)  // NOLINT: converts like the pair it was
      : x(std::move(xy.first)), y(std::move(xy.second)) {}
  ValidationData(std::vector<Tensor> x_val, std::vector<Tensor> y_val)
      : xs(std::move(x_val)), ys(std::move(y_val)) {}
  // True when validation data is given.
  explicit operator bool() const {
    return x.defined() || y.defined() || !xs.empty() || !ys.empty();
  }

  Tensor x = {};
  Tensor y = {};
  std::vector<Tensor> xs = {};  // several inputs and outputs (x and y undefined)
  std::vector<Tensor> ys = {};
};

// fit's options. batch_size, validation_split, shuffle and seed are those of the tensor
// forms (fit of a Dataset: its own batches and order; batch_size then serves validation).
struct FitOptions {
  std::int64_t batch_size = 32;
  int epochs = 1;
  // The last fraction of the samples (before shuffling) held out for validation.
  double validation_split = 0.0;
  // Or explicit validation inputs and labels.
  ValidationData validation_data = {};
  bool shuffle = true;  // the training samples, each epoch
  // For shuffling: epoch e shuffles with a generator seeded from (seed, e), so a run
  // resumed at initial_epoch sees the same batches. Default: drawn from the default
  // generator.
  std::optional<std::uint64_t> seed = {};
  int verbose = 1;  // 0 silent; 1 a progress bar on a terminal, else a line per epoch; 2 lines
  std::vector<std::shared_ptr<Callback>> callbacks = {};
  // Start counting epochs here (resuming): epochs initial_epoch .. epochs - 1 run (none when
  // initial_epoch >= epochs). Must be >= 0.
  int initial_epoch = 0;
};

// What fit() returns: per epoch, every logged value.
struct History {
  std::vector<int> epoch;
  std::map<std::string, std::vector<double>> history;
  // The value of `key` after the last epoch; throws ValueError when it was not logged.
  double last(const std::string& key) const;
};

struct EvaluateOptions {
  std::int64_t batch_size = 32;
  int verbose = 0;  // 1: one line with the results
};

struct PredictOptions {
  std::int64_t batch_size = 32;
};

struct ModelOptions {
  std::optional<Policy> dtype = {};
  std::string name = {};  // empty: "model", "model_1", ... ("sequential" for Sequential)
  bool trainable = true;
};

class Model : public layers::Layer {
 public:
  // A functional model from an Input() to a symbolic output.
  Model(const layers::SymbolicTensor& inputs, const layers::SymbolicTensor& outputs,
        ModelOptions options = {});
  // A functional model of several inputs (each from Input()) and outputs: a graph of layer
  // calls. It is checked here: every output must be computed from the given inputs, and
  // every input used; the layers then run in one topological order, computed here.
  Model(const std::vector<layers::SymbolicTensor>& inputs,
        const std::vector<layers::SymbolicTensor>& outputs, ModelOptions options = {});

  // One input, one output: model(x) as for any layer. Several inputs or outputs: a vector
  // of tensors in, the vector of outputs out (in the order given at construction).
  using Layer::operator();
  std::vector<Tensor> operator()(const std::vector<Tensor>& inputs, const CallContext& ctx = {});
  // The model called on symbolic tensors (a model used as a layer of another): every output.
  std::vector<layers::SymbolicTensor> operator()(const std::vector<layers::SymbolicTensor>& inputs);

  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::vector<Tensor> call_multi(const std::vector<Tensor>& inputs,
                                 const CallContext& ctx) override;
  std::optional<std::vector<layers::TensorSpec>> compute_output_spec(
      const std::vector<layers::TensorSpec>& inputs) const override;
  std::string class_name() const override { return "Functional"; }

  // A functional model's inputs and outputs, as given at construction.
  const std::vector<layers::SymbolicTensor>& inputs() const { return inputs_; }
  const std::vector<layers::SymbolicTensor>& outputs() const { return outputs_; }

  // The layers, in the order they run (the InputLayers first for a functional model).
  const std::vector<std::shared_ptr<layers::Layer>>& layers() const { return layers_; }
  // The layer called `name`; throws ValueError listing the names when there is none.
  std::shared_ptr<layers::Layer> get_layer(std::string_view name) const;

  // Layer, output shape, parameter count and the policy, compute and variable dtypes of
  // each layer, then the parameter totals.
  std::string summary_string() const;
  void summary() const;  // prints summary_string() to stdout

  // The dtype integer and boolean inputs are cast to when they reach the model, in a call,
  // fit, evaluate, predict and train_step (as Keras casts a model's inputs to its Input's
  // dtype): that of its first layer (a functional model's Input dtype; float32 for a
  // Sequential that starts with Dense, Conv2D, Flatten, ...; none when it starts with an
  // Embedding, which takes its ids as they are). Floating inputs are never cast here (each
  // layer casts them to its compute dtype).
  std::optional<DType> integer_input_dtype() const override;

  // Builds every layer for inputs of `input_shape` (for a Sequential model before its first
  // call) from the shapes alone: a layer without a shape rule (compute_output_shape) is run
  // once on a batch of one. `input_shape` may carry -1 on the batch axis. For a functional
  // model (built when made) it checks that the model takes that shape.
  void build_for(const Shape& input_shape);
  // Sequential: builds the layers in turn from the input shape (as build_for).
  void build(const Shape& input_shape) override;
  // Sequential: the input shape it was built for (-1 on the batch axis); empty before it is
  // built, and for a functional model (whose inputs() say it).
  const std::optional<Shape>& build_input_shape() const { return build_input_shape_; }

  // Writes the weights to a safetensors file (weight paths as tensor names), and reads
  // them back into a model of the same architecture (mixtape/layers/checkpoint.h).
  void save_weights(const std::string& path) const;
  void load_weights(const std::string& path);

  // The architecture as JSON: each layer's class and config (Layer::get_config), the graph
  // (a functional model's calls in execution order, its inputs and outputs) and nested
  // models; model_from_json() makes the model again (untrained). docs/checkpoints.md.
  std::string to_json() const;
  // The whole model in one safetensors file: the architecture (to_json()) in __metadata__
  // "architecture", the weights and, when compiled, the optimizer's state with the loss
  // scale's (a training checkpoint, mixtape/layers/checkpoint.h, with `info`'s epoch and
  // metadata). mt::load_model() reads it without the code that built the model. Throws
  // ValueError for a Sequential model that is not built yet.
  void save(const std::string& path, const TrainingCheckpoint& info = {}) const;

  // --- Training (Keras' compile / fit / evaluate / predict) ---------------------------------

  // Sets the loss, the optimizer and the metrics. Under a policy with a loss scale
  // (mixed_float16) the optimizer is wrapped in a LossScaleOptimizer, as Keras does. The
  // metric "accuracy" becomes the accuracy that fits the loss (sparse categorical,
  // categorical, binary or exact).
  void compile(CompileOptions options);
  bool compiled() const { return optimizer_ != nullptr; }
  // Moves the weights (Layer::to); a captured step (CompileOptions::capture_step) is dropped
  // first, and captured again at the next batch.
  void to(Device device) override;
  // The optimizer training uses (a LossScaleOptimizer under mixed_float16).
  const std::shared_ptr<optim::Optimizer>& optimizer() const { return optimizer_; }
  // The loss (of the first output), and of each output.
  const losses::Loss& loss() const;
  const std::vector<losses::Loss>& losses() const { return losses_; }
  // The names of the outputs (their layers' names), as logs and LossMap name them.
  std::vector<std::string> output_names() const;

  // Data of any dtype goes in, as in Keras: integer and boolean inputs (uint8 images) are
  // cast to integer_input_dtype() (fit casts x once, at its start: a copy in that dtype),
  // integer and boolean labels are widened to int64.

  // A model of several inputs or outputs takes a vector of inputs (in the order of its
  // Inputs) and one of labels (in the order of its outputs): fit({xa, xb}, {ya, yb}); the
  // logs then hold "loss" (the weighted sum), "<output>_loss" and "<output>_<metric>".

  // Trains on the batches of a Dataset (mixtape/data/dataset.h), each epoch e its
  // train.epoch(e): the main form, which the tensor forms build on. Every element is one
  // batch (inputs and labels as the model takes them); every batch must have the shapes and
  // dtypes of the first apart from axis 0 (ShapeError naming the batch otherwise). A
  // ProgbarLogger prints per epoch (verbose) the loss, the metrics, the validation ones
  // (validation_data), the time, us/sample, and under loss scaling the scale and the skipped
  // steps. batch_size serves validation alone; shuffle and seed belong to the Dataset;
  // validation_split needs tensors (ValueError). Data-parallel (several ranks): every rank
  // passes the same pipeline with .shard(rank, world) after its batch(); each steps on its
  // share, weighted by Element::share(). Throws ValueError for epochs or initial_epoch < 0.
  History fit(const data::Dataset& train, FitOptions options = {});
  // Trains on (x, y) in batches along axis 0: fit of
  // from_tensors(x, y).shuffle_all(seed).batch(batch_size) (no shuffle_all without
  // options.shuffle; .shard(rank, world) under several ranks: each takes its share of every
  // global batch), after holding out validation_split. Throws ValueError for no training
  // samples, a batch_size <= 0 (or below the number of ranks), epochs or initial_epoch < 0.
  History fit(const Tensor& x, const Tensor& y, FitOptions options = {});
  History fit(const std::vector<Tensor>& x, const std::vector<Tensor>& y, FitOptions options = {});
  // One training step on a batch: the loss and metric values of the batch. An empty batch
  // (0 rows) takes no step: the model (in inference mode) and the loss run to check the
  // shapes, the loss is 0 and nothing changes (no weight, statistic, slot or iteration).
  Logs train_step(const Tensor& x, const Tensor& y);
  Logs train_step(const std::vector<Tensor>& x, const std::vector<Tensor>& y);
  // The mean loss and metrics over (x, y), in batches, in inference mode (0 for 0 rows).
  Logs evaluate(const Tensor& x, const Tensor& y, EvaluateOptions options = {});
  Logs evaluate(const std::vector<Tensor>& x, const std::vector<Tensor>& y,
                EvaluateOptions options = {});
  // The outputs for x, in batches, in inference mode.
  Tensor predict(const Tensor& x, PredictOptions options = {});
  std::vector<Tensor> predict(const std::vector<Tensor>& x, PredictOptions options = {});
  // Asks fit() to stop after the current epoch (for callbacks).
  void stop_training() { stop_training_ = true; }

 protected:
  // For Sequential: a model whose call() is its own.
  Model(ModelOptions options, const std::string& class_name);
  bool autocast_inputs() const override { return false; }
  bool checks_input_count() const override { return !nodes_.empty(); }
  // The layers of a model are named in its graph: a model adds nothing to their paths.
  bool scopes_sublayers() const override { return false; }
  void add_layer(std::shared_ptr<layers::Layer> layer);
  // Whether `layer` is one of layers_.
  bool has_layer(const layers::Layer& layer) const;
  // x, given as input `index`, cast to the dtype of that Input (integer_input_dtype() for
  // the first) when it is an integer or boolean tensor.
  Tensor conform_input(const Tensor& x, std::size_t index = 0) const;
  // Says once (log) when the output is 16-bit under a mixed policy.
  void check_output_dtype(DType output);

  std::vector<std::shared_ptr<layers::Layer>> layers_;

 private:
  std::unordered_map<std::string, const layers::Layer*> layer_by_name_;  // the layers_, by name
  // The functional graph. nodes_ in execution order (the inputs' first, in the order given);
  // for node i, node_inputs_[i] holds (node, output) of each of its inputs; uses_[i][k] how
  // many inputs read output k of node i (a value is dropped after its last reader), outputs
  // of the model counting once more.
  void make_graph();
  std::vector<layers::SymbolicTensor> inputs_, outputs_;
  std::vector<std::shared_ptr<layers::detail::SymbolicNode>> nodes_;
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> node_inputs_;
  std::vector<std::vector<int>> uses_;
  std::vector<std::pair<std::size_t, std::size_t>> output_slots_;
  std::optional<Shape> build_input_shape_;  // Sequential: the input shape it was built for
  std::optional<DType> warned_output_;
  std::optional<std::string> output_note_;

  // The number of inputs and outputs a call takes and gives.
  std::size_t num_inputs() const { return nodes_.empty() ? 1 : inputs_.size(); }
  std::size_t num_outputs() const { return nodes_.empty() ? 1 : outputs_.size(); }
  // Checks x and y for fit/evaluate/train_step (`who` names the caller) and casts them as
  // they come in (integer inputs, int64 labels).
  void conform_data(const std::string& who, std::vector<Tensor>& x, std::vector<Tensor>& y) const;
  // train_step without reading anything back: the batch's loss and each output's (several
  // outputs) stay on the device; the metrics are updated.
  struct StepLosses {
    Tensor loss;
    std::vector<Tensor> parts;
  };
  StepLosses run_train_step(const std::vector<Tensor>& x, const std::vector<Tensor>& y);
  // The step itself (forward, loss, gradients, update) on conformed data: its losses, and its
  // predictions into `pred` (the metrics' input).
  StepLosses step_on(const std::vector<Tensor>& x, const std::vector<Tensor>& y,
                     std::vector<Tensor>& pred);
  // step_on through the captured step (CompileOptions::capture_step): captured at the first
  // batch, replayed for the batches of its shapes, stepped as usual for the others.
  StepLosses captured_step_on(const std::vector<Tensor>& x, const std::vector<Tensor>& y,
                              std::vector<Tensor>& pred);
  // fit's parts: its checks of tensors and validation data; the ranks' agreement (rank 0's
  // weights, and its shuffling seed when given); the epochs; one epoch's batches.
  struct FitTensors {
    std::vector<Tensor> x, y, x_val, y_val;
  };
  FitTensors fit_tensors(const std::string& who, const std::vector<Tensor>& x,
                         const std::vector<Tensor>& y, const FitOptions& o) const;
  void validation_tensors(const std::string& who, const ValidationData& v, std::vector<Tensor>& x,
                          std::vector<Tensor>& y) const;
  void synchronize_ranks(const std::string& who, const std::string& run, std::uint64_t* seed);
  History train_on(const std::string& who, const data::Dataset& train, const FitOptions& o);
  Logs train_epoch(const std::string& who, const data::Dataset::Epoch& batches, std::int64_t steps,
                   const std::vector<std::shared_ptr<Callback>>& callbacks);
  // The weighted loss of a batch; each output's (unweighted) loss into `per_output`.
  Tensor batch_loss(const std::vector<Tensor>& y, const std::vector<Tensor>& pred,
                    std::vector<Tensor>* per_output);
  std::vector<std::string> metric_keys() const;
  // "3 weights: float32[4, 8] ...": what the ranks of a data-parallel job compare.
  std::string weight_layout() const;
  // The number of classes of output `output` (its last extent), when the model knows it.
  std::optional<std::int64_t> class_count(std::size_t output) const;
  // IndexError naming the sample when a label of a sparse categorical loss is outside its
  // output's classes (or not finite).
  void check_labels(const std::string& who, const std::vector<Tensor>& y, const char* data) const;

  // compile(): per output, its loss, its weight and its metrics.
  std::vector<losses::Loss> losses_;
  std::vector<double> loss_weights_;
  std::shared_ptr<optim::Optimizer> optimizer_;
  std::vector<std::vector<std::shared_ptr<metrics::Metric>>> metrics_;
  std::vector<std::optional<std::string>> metric_names_;  // as given (empty: a Metric object)
  bool stop_training_ = false;
  // CompileOptions::capture_step: the captured step, its inputs (where each batch is copied),
  // outputs and the shapes it takes ("" before the first batch).
  struct CapturedStep {
    std::string shapes;
    std::vector<Variable> x, y;
    std::vector<Tensor> pred;
    StepLosses losses;
    StepGraph graph;
  };
  bool capture_step_ = false;
  std::unique_ptr<CapturedStep> captured_;
  // compile()'s arguments as JSON for a model file, or empty with `why` set when they cannot
  // be recorded (a loss or metric of one's own, a learning rate schedule).
  std::string compile_config(std::string& why) const;
  mutable bool said_compile_unrecorded_ = false;
};

class Sequential : public Model {
 public:
  explicit Sequential(std::vector<layers::LayerPtr<layers::Layer>> layers = {},
                      ModelOptions options = {});
  // Appends a layer.
  void add(layers::LayerPtr<layers::Layer> layer);
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::string class_name() const override { return "Sequential"; }
};

}  // namespace mixtape
