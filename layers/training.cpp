// Model training: compile, train_step, fit (on the Dataset pipeline), evaluate, predict.
// The callbacks (the progress output among them) are in layers/callbacks.cpp.
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/distributed/distributed.h"
#include "mixtape/layers/model.h"
#include "mixtape/optim/chain.h"
#include "mixtape/optim/distributed_optimizer.h"
#include "mixtape/optim/loss_scale_optimizer.h"

namespace mixtape {

namespace {

// This process's place in the job: its rank and the number of ranks (1 alone).
struct Place {
  int rank, world;
};
Place place() { return {distributed::rank(), distributed::world_size()}; }

std::string describe(const Tensor& t) { return fmt::format("{}{}", t.dtype(), t.shape()); }

// Rows [begin, end) of t along axis 0 (a view).
Tensor rows(const Tensor& t, std::int64_t begin, std::int64_t end) {
  return slice(t, 0, begin, end);
}

// Integer and boolean tensors (uint8, int32, bool) widened to int64, the dtype of labels and
// ids (values kept); floating ones as they are.
Tensor as_int64(const Tensor& y) {
  if (!y.defined() || y.dtype().is_floating() || y.dtype() == kInt64) return y;
  NoGradGuard no_grad;
  return cast(y, kInt64);
}

// Whether fit can gather batches of t (with take): floating, int32 and int64 data.
bool batchable(const Tensor& t) {
  return t.dtype().is_floating() || t.dtype() == kInt32 || t.dtype() == kInt64;
}

}  // namespace

// --- compile ------------------------------------------------------------------------------

std::vector<losses::Loss> LossSpec::resolve(const std::string& model,
                                            const std::vector<std::string>& output_names) const {
  const std::size_t n = output_names.size();
  const auto names = [&] {
    std::string out;
    for (const auto& o : output_names) out += (out.empty() ? "" : ", ") + o;
    return out;
  };
  if (single_) return std::vector<losses::Loss>(n, *single_);
  if (!is_map_) {
    if (list_.size() != n)
      throw ValueError(
          fmt::format("model '{}': compile got {} losses for {} output{} ({}); give "
                      "one per output, in their order, or one for all",
                      model, list_.size(), n, n == 1 ? "" : "s", names()));
    return list_;
  }
  for (const auto& [k, v] : map_)
    if (std::find(output_names.begin(), output_names.end(), k) == output_names.end())
      throw ValueError(
          fmt::format("model '{}': compile got a loss for '{}', which is not an "
                      "output; the outputs are {}",
                      model, k, names()));
  std::vector<losses::Loss> out;
  for (const auto& o : output_names) {
    auto it = map_.find(o);
    if (it == map_.end())
      throw ValueError(
          fmt::format("model '{}': compile got no loss for output '{}'; the outputs "
                      "are {}",
                      model, o, names()));
    out.push_back(it->second);
  }
  return out;
}

std::vector<std::string> Model::output_names() const {
  if (nodes_.empty()) return {name()};
  std::vector<std::string> out;
  for (const auto& o : outputs_) out.push_back(o.name());
  return out;
}

namespace {
std::vector<std::string> loss_names(const std::vector<losses::Loss>& ls) {
  std::vector<std::string> out;
  for (const auto& l : ls)
    out.push_back(l.options()
                      ? fmt::format("{}(from_logits={})", l.name(), l.options()->from_logits)
                      : l.name());
  return out;
}

// The optimizer chain and its options, for the ranks to compare.
std::string describe(const optim::Optimizer& o) {
  if (const optim::Optimizer* inner = o.pass_through())
    return fmt::format("{}({})", o.name(), describe(*inner));
  if (const optim::LossScaleOptimizer* lso = o.loss_scale_optimizer(); lso == &o)
    return fmt::format("{}({}, {})", o.name(), lso->loss_scale_config().str(),
                       describe(lso->inner_optimizer()));
  try {
    std::string config;
    for (const auto& [k, v] : o.get_config()) config += fmt::format(" {}={}", k, v);
    return fmt::format("{}({})", o.name(), config);
  } catch (const ValueError&) {  // a schedule: its name
    return fmt::format("{}(learning rate {})", o.name(), o.learning_rate().name());
  }
}
}  // namespace

void Model::compile(CompileOptions options) {
  if (!options.loss)
    throw ValueError(fmt::format("model '{}': compile needs a loss (.loss = ...)", name()));
  const std::vector<std::string> outs = output_names();
  std::vector<losses::Loss> ls = options.loss->resolve(name(), outs);
  std::vector<double> weights = options.loss_weights;
  if (weights.empty()) weights.assign(outs.size(), 1.0);
  if (weights.size() != outs.size())
    throw ValueError(fmt::format("model '{}': compile got {} loss_weights for {} output{}", name(),
                                 weights.size(), outs.size(), outs.size() == 1 ? "" : "s"));
  for (double w : weights)
    if (!std::isfinite(w))
      throw ValueError(
          fmt::format("model '{}': compile: loss_weights must be finite; got {}", name(), w));
  std::shared_ptr<optim::Optimizer> opt = options.optimizer.get();
  if (!opt) throw ValueError(fmt::format("model '{}': compile got an empty optimizer", name()));
  if (options.gradient_accumulation_steps < 1)
    throw ValueError(
        fmt::format("model '{}': compile: gradient_accumulation_steps must be >= 1; got {}", name(),
                    options.gradient_accumulation_steps));
  if (options.capture_step && options.gradient_accumulation_steps > 1)
    throw ValueError(fmt::format(
        "model '{}': compile: capture_step and gradient_accumulation_steps {} (a captured step "
        "cannot replay the count of micro-batches, kept on the host); leave one out",
        name(), options.gradient_accumulation_steps));
  std::vector<std::vector<std::shared_ptr<metrics::Metric>>> ms(outs.size());
  for (const auto& m : options.metrics) {
    if (m.metric() && outs.size() > 1)
      throw ValueError(fmt::format(
          "model '{}': compile: a Metric object cannot serve {} outputs; give metrics by name "
          "(\"accuracy\", ...) for a model of several outputs",
          name(), outs.size()));
    for (std::size_t i = 0; i < outs.size(); ++i) {
      if (m.metric()) {
        ms[i].push_back(m.metric());
      } else if (m.name() == "accuracy" || m.name() == "acc") {
        // The accuracy that matches the output's loss, as Keras chooses it.
        const std::string& l = ls[i].name();
        if (l == "sparse_categorical_crossentropy")
          ms[i].push_back(std::make_shared<metrics::SparseCategoricalAccuracy>("accuracy"));
        else if (l == "categorical_crossentropy")
          ms[i].push_back(std::make_shared<metrics::CategoricalAccuracy>("accuracy"));
        else if (l == "binary_crossentropy")
          ms[i].push_back(std::make_shared<metrics::BinaryAccuracy>("accuracy"));
        else
          ms[i].push_back(std::make_shared<metrics::Accuracy>("accuracy"));
      } else {
        ms[i].push_back(metrics::get(m.name()));
      }
    }
  }
  // The chain the policy and the job need (mixtape/optim/chain.h); nothing changes before
  // here: a bad option leaves the model as it was.
  opt = optim::training_chain(opt,
                              {.policy = dtype_policy(),
                               .gradient_accumulation_steps = options.gradient_accumulation_steps,
                               .owner = fmt::format("model '{}'", name())});
  if (opt->distributed_optimizer())  // the ranks agree on all of it, and on rank 0's weights
    optim::DistributedOptimizer::synchronize(
        fmt::format("model '{}': compile: the ranks compile differently (every rank must give "
                    "the same model, policy, losses and optimizer)",
                    name()),
        fmt::format("{}; policy {}; losses {}; loss weights {}; optimizer {}", weight_layout(),
                    dtype_policy().name(), fmt::join(loss_names(ls), ", "),
                    fmt::join(weights, ", "), describe(*opt)),
        this->weights());
  losses_ = std::move(ls);
  loss_weights_ = std::move(weights);
  optimizer_ = std::move(opt);
  metrics_ = std::move(ms);
  capture_step_ = options.capture_step;
  captured_.reset();  // a step captured for the previous compile() is not this one
  // What Model::save records of the metrics: their names (a Metric object has none to
  // make it again from).
  metric_names_.clear();
  for (const auto& m : options.metrics)
    metric_names_.push_back(m.metric() ? std::optional<std::string>() : m.name());
}

const losses::Loss& Model::loss() const {
  if (losses_.empty())
    throw ValueError(fmt::format("model '{}' is not compiled (call compile())", name()));
  return losses_.front();
}

// --- Data and losses ---------------------------------------------------------------------------

namespace {
std::string describe_all(const std::vector<Tensor>& ts) {
  std::string out;
  for (const auto& t : ts)
    out += (out.empty() ? "" : ", ") + (t.defined() ? describe(t) : "undefined");
  return out;
}
}  // namespace

void Model::conform_data(const std::string& who, std::vector<Tensor>& x,
                         std::vector<Tensor>& y) const {
  const std::vector<std::string> outs = output_names();
  if (x.size() != num_inputs())
    throw ValueError(fmt::format("{}: the model takes {} input{}; got {} input tensor{}", who,
                                 num_inputs(), num_inputs() == 1 ? "" : "s", x.size(),
                                 x.size() == 1 ? "" : "s"));
  if (y.size() != outs.size()) {
    std::string names;
    for (const auto& o : outs) names += (names.empty() ? "" : ", ") + o;
    throw ValueError(fmt::format("{}: the model has {} output{} ({}); got {} label tensor{}", who,
                                 outs.size(), outs.size() == 1 ? "" : "s", names, y.size(),
                                 y.size() == 1 ? "" : "s"));
  }
  bool ok = true;
  for (const auto* ts : {&x, &y})
    for (const Tensor& t : *ts)
      ok = ok && t.defined() && t.rank() > 0 && t.dim(0) == x.front().dim(0);
  if (!ok) {
    if (x.size() == 1 && y.size() == 1)
      throw ShapeError(fmt::format("{}: x {} and y {} need the same number of samples (axis 0)",
                                   who, x[0].defined() ? describe(x[0]) : "undefined",
                                   y[0].defined() ? describe(y[0]) : "undefined"));
    throw ShapeError(fmt::format(
        "{}: every input and label tensor needs the same number of samples (axis 0); got x {} "
        "and y {}",
        who, describe_all(x), describe_all(y)));
  }
  for (Tensor& t : y) t = as_int64(t);
}

std::vector<std::string> Model::metric_keys() const {
  const std::vector<std::string> outs = output_names();
  std::vector<std::string> keys{"loss"};
  const bool several = outs.size() > 1;
  if (several)
    for (const auto& o : outs) keys.push_back(o + "_loss");
  for (std::size_t i = 0; i < metrics_.size(); ++i)
    for (const auto& m : metrics_[i])
      keys.push_back(several ? outs[i] + "_" + m->name() : m->name());
  return keys;
}

Tensor Model::batch_loss(const std::vector<Tensor>& y, const std::vector<Tensor>& pred,
                         std::vector<Tensor>* per_output) {
  if (pred.size() != losses_.size())
    throw ValueError(fmt::format("model '{}': gave {} outputs for {} losses", name(), pred.size(),
                                 losses_.size()));
  Tensor total;
  for (std::size_t i = 0; i < losses_.size(); ++i) {
    Tensor l = losses_[i](y[i], pred[i]);
    if (per_output) per_output->push_back(l);
    if (loss_weights_[i] != 1.0) l = l * loss_weights_[i];
    total = total.defined() ? total + l : l;
  }
  return total;
}

namespace {
// The logs of a batch or an epoch: the total loss, each output's (several outputs), and the
// metrics.
Logs make_logs(double loss, const std::vector<double>& per_output,
               const std::vector<std::string>& outs,
               const std::vector<std::vector<std::shared_ptr<metrics::Metric>>>& ms) {
  // (per_output: each output's loss, for a model of several outputs.)
  Logs logs{{"loss", loss}};
  const bool several = outs.size() > 1;
  if (several)
    for (std::size_t i = 0; i < outs.size() && i < per_output.size(); ++i)
      logs[outs[i] + "_loss"] = per_output[i];
  for (std::size_t i = 0; i < ms.size(); ++i)
    for (const auto& m : ms[i]) logs[several ? outs[i] + "_" + m->name() : m->name()] = m->result();
  return logs;
}
// The values of the per-output losses (read once the step is done).
std::vector<double> values_of(const std::vector<Tensor>& losses) {
  std::vector<double> out;
  for (const Tensor& l : losses) out.push_back(l.item<double>());
  return out;
}
}  // namespace

// --- One step ---------------------------------------------------------------------------------

Logs Model::train_step(const Tensor& x, const Tensor& y) {
  return train_step(std::vector<Tensor>{x}, std::vector<Tensor>{y});
}

Logs Model::train_step(const std::vector<Tensor>& x, const std::vector<Tensor>& y) {
  const StepLosses step = run_train_step(x, y);
  return make_logs(step.loss.item<double>(), values_of(step.parts), output_names(), metrics_);
}

Model::StepLosses Model::run_train_step(const std::vector<Tensor>& x_in,
                                        const std::vector<Tensor>& y_in) {
  if (!compiled())
    throw ValueError(
        fmt::format("model '{}' is not compiled: call compile() before training", name()));
  std::vector<Tensor> x = x_in, y = y_in;
  conform_data(fmt::format("model '{}': train_step", name()), x, y);
  if (x.front().dim(0) == 0 && optimizer_->distributed_optimizer() && place().world > 1) {
    // This rank's share of the global batch is empty: it still joins the step's reduction,
    // adding nothing (no loss: undefined gradients), and steps with the others.
    const std::vector<Variable> vars = trainable_variables();
    GradientTape tape;
    optimizer_->apply_gradients(optimizer_->compute_gradients(tape, Tensor(), vars), vars);
    NoGradGuard no_grad;
    const std::vector<Tensor> pred = apply(x, CallContext{.training = false});
    StepLosses out;
    out.loss = batch_loss(y, pred, &out.parts);
    return out;
  }
  if (x.front().dim(0) == 0) {
    // An empty batch: nothing to learn from. The model (in inference mode, so that no
    // statistic moves) and the loss still run, to check the shapes; the loss of an empty
    // batch is 0 (Keras); no gradient, no optimizer step, no iteration counted.
    NoGradGuard no_grad;
    const std::vector<Tensor> pred = apply(x, CallContext{.training = false});
    StepLosses out;
    out.loss = batch_loss(y, pred, &out.parts);
    for (std::size_t i = 0; i < metrics_.size(); ++i)
      for (const auto& m : metrics_[i]) m->update_state(y[i], pred[i]);
    return out;
  }
  std::vector<Tensor> pred;
  const StepLosses out = capture_step_ ? captured_step_on(x, y, pred) : step_on(x, y, pred);
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < metrics_.size(); ++i)
    for (const auto& m : metrics_[i]) m->update_state(y[i], pred[i]);
  return out;
}

void Model::to(Device device) {
  captured_.reset();
  layers::Layer::to(device);
}

Model::StepLosses Model::step_on(const std::vector<Tensor>& x, const std::vector<Tensor>& y,
                                 std::vector<Tensor>& pred) {
  // The step: forward, loss, gradients through the optimizer chain (loss scaling and the
  // reduction across ranks, whichever it holds), update.
  const std::vector<Variable> vars = trainable_variables();
  StepLosses out;
  std::vector<Tensor> grads;
  {
    GradientTape tape;
    pred = apply(x, CallContext{.training = true});
    out.loss = batch_loss(y, pred, output_names().size() > 1 ? &out.parts : nullptr);
    grads = optimizer_->compute_gradients(tape, out.loss, vars);
  }
  optimizer_->apply_gradients(grads, vars);
  return out;
}

Model::StepLosses Model::captured_step_on(const std::vector<Tensor>& x,
                                          const std::vector<Tensor>& y, std::vector<Tensor>& pred) {
  std::string shapes;
  for (const auto* ts : {&x, &y})
    for (const Tensor& t : *ts)
      shapes += fmt::format("{}{}@{};", t.dtype().name(), t.shape(), t.device().str());
  if (captured_ && captured_->shapes != shapes) return step_on(x, y, pred);  // a partial batch
  if (captured_) {
    for (std::size_t i = 0; i < x.size(); ++i) captured_->x[i].assign(x[i]);
    for (std::size_t i = 0; i < y.size(); ++i) captured_->y[i].assign(y[i]);
    captured_->graph.replay();
    pred = captured_->pred;
    return captured_->losses;
  }
  // The first batch: its step runs (the warm-up), then the step is captured on the inputs'
  // device, reading the batch where the later ones are copied.
  auto c = std::make_unique<CapturedStep>();
  c->shapes = shapes;
  for (const Tensor& t : x) c->x.emplace_back(t, "captured_x", /*trainable=*/false);
  for (const Tensor& t : y) c->y.emplace_back(t, "captured_y", /*trainable=*/false);
  const std::vector<Tensor> xs(c->x.begin(), c->x.end()), ys(c->y.begin(), c->y.end());
  StepLosses first;
  c->graph = StepGraph::capture(x.front().device(), [&] {
    if (capture::active())
      c->losses = step_on(xs, ys, c->pred);
    else
      first = step_on(xs, ys, pred);
  });
  captured_ = std::move(c);
  return first;
}

std::string Model::weight_layout() const {
  const std::vector<Variable> ws = weights();
  std::string layout = fmt::format("{} weights:", ws.size());
  for (const Variable& w : ws) layout += fmt::format(" {}{}", w.dtype().name(), w.shape());
  return layout;
}

// --- fit --------------------------------------------------------------------------------------

std::optional<std::int64_t> Model::class_count(std::size_t output) const {
  std::optional<Shape> shape;
  if (!nodes_.empty())
    shape = outputs_.at(output).shape();
  else if (!layers_.empty())
    shape = layers_.back()->output_shape();
  if (!shape || shape->rank() < 2 || shape->dims().back() <= 0) return std::nullopt;
  return shape->dims().back();
}

void Model::check_labels(const std::string& who, const std::vector<Tensor>& y,
                         const char* data) const {
  for (std::size_t i = 0; i < y.size() && i < losses_.size(); ++i) {
    const std::optional<std::int64_t> classes = class_count(i);
    const Tensor& t = y[i];
    if (losses_[i].name() != "sparse_categorical_crossentropy" || !classes || t.rank() < 1 ||
        t.numel() != t.dim(0))
      continue;  // the loss checks what this cannot
    const std::vector<double> labels = cast(t, kFloat64).to_vector<double>();
    for (std::size_t s = 0; s < labels.size(); ++s) {
      const double v = std::trunc(labels[s]);  // floating labels are truncated, as Keras
      if (std::isfinite(v) && v >= 0.0 && v < static_cast<double>(*classes)) continue;
      throw IndexError(fmt::format(
          "{}: the label of sample {} of the {}{} is {}, outside [0, {}) (output '{}' has {} "
          "classes; its loss is sparse_categorical_crossentropy); nothing was trained",
          who, s, data, y.size() > 1 ? fmt::format(" (output {})", i) : std::string(), labels[s],
          *classes, output_names()[i], *classes));
    }
  }
}

History Model::fit(const Tensor& x, const Tensor& y, FitOptions o) {
  return fit(std::vector<Tensor>{x}, std::vector<Tensor>{y}, std::move(o));
}

void Model::validation_tensors(const std::string& who, const ValidationData& v,
                               std::vector<Tensor>& x_val, std::vector<Tensor>& y_val) const {
  x_val = v.xs.empty() && v.ys.empty() ? std::vector<Tensor>{v.x} : v.xs;
  y_val = v.xs.empty() && v.ys.empty() ? std::vector<Tensor>{v.y} : v.ys;
  bool ok = x_val.size() == num_inputs() && y_val.size() == output_names().size();
  for (const auto* ts : {&x_val, &y_val})
    for (const Tensor& t : *ts)
      ok = ok && t.defined() && t.rank() > 0 && x_val.front().defined() &&
           x_val.front().rank() > 0 && t.dim(0) == x_val.front().dim(0);
  if (!ok)
    throw ShapeError(fmt::format(
        "{}: validation_data needs x and y with the same number of "
        "samples, as many as the model has inputs ({}) and outputs "
        "({}); got x {} and y {}",
        who, num_inputs(), output_names().size(), describe_all(x_val), describe_all(y_val)));
  check_labels(who, y_val, "validation data");
}

Model::FitTensors Model::fit_tensors(const std::string& who, const std::vector<Tensor>& x_in,
                                     const std::vector<Tensor>& y_in, const FitOptions& o) const {
  if (!compiled()) throw ValueError(who + ": the model is not compiled (call compile() first)");
  for (const auto* ts : {&x_in, &y_in})
    for (const Tensor& t : *ts)
      if (!t.defined()) throw ValueError(who + ": x and y must be defined");
  FitTensors d{x_in, y_in, {}, {}};
  conform_data(who, d.x, d.y);
  // Integer data is cast once, here, at the boundary (as Keras casts a model's inputs):
  // uint8 images to the model's input dtype (float32 unless its Input says otherwise), the
  // ids of a model that takes them as they are (an Embedding first) from uint8 or bool to
  // int64, labels to int64.
  for (std::size_t i = 0; i < d.x.size(); ++i) {
    d.x[i] = conform_input(d.x[i], i);
    if (!batchable(d.x[i])) d.x[i] = as_int64(d.x[i]);
  }
  if (o.batch_size <= 0)
    throw ValueError(fmt::format("{}: batch_size must be positive; got {}", who, o.batch_size));
  if (o.epochs < 0) throw ValueError(fmt::format("{}: epochs must be >= 0; got {}", who, o.epochs));
  if (o.initial_epoch < 0)
    throw ValueError(fmt::format("{}: initial_epoch must be >= 0; got {}", who, o.initial_epoch));
  if (!(o.validation_split >= 0.0 && o.validation_split < 1.0))
    throw ValueError(
        fmt::format("{}: validation_split must be in [0, 1); got {}", who, o.validation_split));
  // The held-out validation samples: the last ones, before any shuffling (as Keras).
  const std::int64_t n = d.x.front().dim(0);
  std::int64_t n_train = n;
  if (o.validation_data) {
    validation_tensors(who, o.validation_data, d.x_val, d.y_val);
  } else if (o.validation_split > 0.0) {
    n_train = static_cast<std::int64_t>(static_cast<double>(n) * (1.0 - o.validation_split));
    if (n_train <= 0 || n_train >= n)
      throw ValueError(
          fmt::format("{}: validation_split {} of {} samples leaves no training or "
                      "no validation samples",
                      who, o.validation_split, n));
    for (const Tensor& t : d.x) d.x_val.push_back(rows(t, n_train, n));
    for (const Tensor& t : d.y) d.y_val.push_back(rows(t, n_train, n));
  }
  // Labels a sparse categorical loss cannot take, by their sample's index, before any step
  // (in a step, the loss could only name a place in a shuffled batch).
  check_labels(who, d.y, "data");
  for (auto* ts : {&d.x, &d.y})
    for (Tensor& t : *ts) t = rows(t, 0, n_train);
  if (n_train == 0) throw ValueError(who + ": no training samples");
  return d;
}

void Model::synchronize_ranks(const std::string& who, const std::string& run, std::uint64_t* seed) {
  const int world = place().world;
  if (world == 1) return;
  if (!optimizer_->distributed_optimizer())
    throw ValueError(fmt::format(
        "{}: {} ranks, but the model was compiled before distributed::init() (its optimizer "
        "does not average gradients across ranks); compile after init()",
        who, world));
  optim::DistributedOptimizer::synchronize(
      fmt::format("{}: the ranks were given different data or options (every rank must take "
                  "the same steps)",
                  who),
      run, {});
  optim::DistributedOptimizer::synchronize(
      fmt::format("{}: the ranks hold different models (every rank must build the same one)", who),
      weight_layout(), weights(), seed);
}

History Model::fit(const std::vector<Tensor>& x, const std::vector<Tensor>& y, FitOptions o) {
  const std::string who = fmt::format("model '{}': fit", name());
  const FitTensors d = fit_tensors(who, x, y, o);
  const auto [rank, world] = place();
  if (o.batch_size < world)
    throw ValueError(fmt::format(
        "{}: batch_size {} is smaller than the world size {}: every rank needs a share of "
        "each batch (batch_size is the global batch, split across the ranks)",
        who, o.batch_size, world));
  // Every rank starts from rank 0's weights and shuffles with rank 0's seed; each takes its
  // share of every global batch. Epoch e is the same whether or not the run resumed there.
  std::uint64_t seed = o.seed ? *o.seed : default_generator().next_u64();
  synchronize_ranks(who,
                    fmt::format("{} samples, batches of {}, epochs {} to {}, shuffle {}, {} "
                                "validation samples",
                                d.x.front().dim(0), o.batch_size, o.initial_epoch, o.epochs,
                                o.shuffle, d.x_val.empty() ? 0 : d.x_val.front().dim(0)),
                    &seed);
  data::Dataset train = data::Dataset::from_tensors(d.x, d.y);
  if (o.shuffle) train = train.shuffle_all(seed);
  train = train.batch(o.batch_size);
  if (world > 1) train = train.shard(rank, world);
  if (!d.x_val.empty()) o.validation_data = ValidationData(d.x_val, d.y_val);
  return train_on(who, train.to(device()), o);
}

History Model::fit(const data::Dataset& train, FitOptions o) {
  const std::string who = fmt::format("model '{}': fit", name());
  if (!compiled()) throw ValueError(who + ": the model is not compiled (call compile() first)");
  if (o.validation_split != 0.0)
    throw ValueError(fmt::format(
        "{}: validation_split ({}) needs tensors; hold samples out of the Dataset yourself and "
        "give them as validation_data",
        who, o.validation_split));
  if (o.epochs < 0) throw ValueError(fmt::format("{}: epochs must be >= 0; got {}", who, o.epochs));
  if (o.initial_epoch < 0)
    throw ValueError(fmt::format("{}: initial_epoch must be >= 0; got {}", who, o.initial_epoch));
  if (o.validation_data) {
    std::vector<Tensor> x_val, y_val;
    validation_tensors(who, o.validation_data, x_val, y_val);
  }
  synchronize_ranks(
      who,
      fmt::format("{} batches per epoch, epochs {} to {}", train.size(), o.initial_epoch, o.epochs),
      nullptr);
  return train_on(who, train.to(device()), o);
}

// fit's epochs: the callbacks around them (a ProgbarLogger first when verbose), validation,
// the loss scale's logs, the History.
History Model::train_on(const std::string& who, const data::Dataset& train, const FitOptions& o) {
  std::vector<std::shared_ptr<Callback>> callbacks = o.callbacks;
  if (o.verbose > 0 && place().rank == 0)
    callbacks.insert(callbacks.begin(), std::make_shared<ProgbarLogger>(o.verbose));
  const TrainParams params{o.epochs, train.size(), train.num_rows(), o.verbose, metric_keys()};
  for (auto& cb : callbacks) cb->set_params(params);
  std::vector<Tensor> x_val, y_val;
  if (o.validation_data) validation_tensors(who, o.validation_data, x_val, y_val);

  History history;
  stop_training_ = false;
  for (auto& cb : callbacks) cb->on_train_begin(*this);
  Logs logs;
  for (int epoch = o.initial_epoch; epoch < o.epochs && !stop_training_; ++epoch) {
    for (auto& cb : callbacks) cb->on_epoch_begin(*this, epoch);
    const optim::LossScaleOptimizer* lso = optimizer_->loss_scale_optimizer();
    const std::int64_t skipped_before = lso ? lso->skipped_steps() : 0;
    logs =
        train_epoch(who, train.epoch(static_cast<std::uint64_t>(epoch)), params.steps, callbacks);
    // The epoch's last finiteness checks, when read behind their steps (on a GPU): a NaN or
    // infinite gradient in its last step throws NumericError here, not in the next epoch.
    optimizer_->check_pending();
    if (!x_val.empty())
      for (const auto& [k, v] : evaluate(x_val, y_val, {.batch_size = o.batch_size}))
        logs["val_" + k] = v;
    if (lso) {
      logs["loss_scale"] = lso->loss_scale();
      logs["skipped_steps"] = static_cast<double>(lso->skipped_steps() - skipped_before);
    }
    history.epoch.push_back(epoch);
    for (const auto& [k, v] : logs) history.history[k].push_back(v);
    for (auto& cb : callbacks) cb->on_epoch_end(*this, epoch, logs);
  }
  for (auto& cb : callbacks) cb->on_train_end(*this, logs);
  return history;
}

namespace {

// The loss sums of an epoch (loss x rows, in float64), kept on the model's device and read
// only when logs are wanted: at the end of the epoch, and for a callback that reads batch
// logs. On a GPU a read is a host synchronisation.
struct EpochLosses {
  explicit EpochLosses(std::size_t outputs) : parts(outputs) {}
  void add(const Tensor& loss, const std::vector<Tensor>& losses_per_output, std::int64_t n) {
    NoGradGuard no_grad;
    const auto add_rows = [n](Tensor& total, const Tensor& mean) {
      Tensor v = cast(mean, kFloat64) * static_cast<double>(n);
      total = total.defined() ? total + v : v;
    };
    add_rows(total, loss);
    if (parts.size() > 1)
      for (std::size_t i = 0; i < parts.size(); ++i) add_rows(parts[i], losses_per_output[i]);
    rows += n;
  }
  double mean_of(const Tensor& sum) const {
    return sum.defined() ? sum.item<double>() / static_cast<double>(rows) : 0.0;
  }
  Tensor total;
  std::vector<Tensor> parts;
  std::int64_t rows = 0;
};

// ShapeError when a batch's tensors differ from the first batch's apart from axis 0.
void check_like_first(const std::string& who, std::int64_t step, const data::Element& batch,
                      std::vector<Tensor>& first) {
  const auto all = [](const data::Element& e) {
    std::vector<Tensor> out = e.inputs;
    out.insert(out.end(), e.labels.begin(), e.labels.end());
    return out;
  };
  if (first.empty()) {
    first = all(batch);
    return;
  }
  const std::vector<Tensor> now = all(batch);
  const auto tail = [](const Tensor& t) {
    return std::vector<std::int64_t>(t.shape().begin() + std::min<std::ptrdiff_t>(t.rank(), 1),
                                     t.shape().end());
  };
  for (std::size_t i = 0; i < now.size() || i < first.size(); ++i)
    if (i >= now.size() || i >= first.size() || now[i].dtype() != first[i].dtype() ||
        now[i].rank() != first[i].rank() || tail(now[i]) != tail(first[i]))
      throw ShapeError(fmt::format(
          "{}: batch {} of the Dataset holds {}, its first batch held {}: every batch needs the "
          "tensors, dtypes and shapes of the first apart from axis 0 (the rows)",
          who, step, describe_all(now), describe_all(first)));
}

}  // namespace

// One epoch of fit: a step per batch (each rank's gradient weighted by its share of the
// batch), the batch logs for the callbacks that want them, the epoch's logs over all ranks.
Logs Model::train_epoch(const std::string& who, const data::Dataset::Epoch& batches,
                        std::int64_t steps,
                        const std::vector<std::shared_ptr<Callback>>& callbacks) {
  for (auto& ms : metrics_)
    for (auto& m : ms) m->reset_state();
  const std::vector<std::string> outs = output_names();
  optim::DistributedOptimizer* dopt = optimizer_->distributed_optimizer();
  const auto logs_of = [&](const EpochLosses& sums) {
    std::vector<double> parts;
    for (const Tensor& p : sums.parts) parts.push_back(sums.mean_of(p));
    return make_logs(sums.mean_of(sums.total), parts, outs, metrics_);  // running means
  };
  EpochLosses sums(outs.size());
  std::vector<Tensor> first;
  std::int64_t step = 0;
  for (data::Element& batch : batches) {
    check_like_first(who, step, batch, first);
    if (dopt && batch.shard_of_rows > 0) dopt->set_gradient_weight(batch.share());
    const StepLosses losses = run_train_step(batch.inputs, batch.labels);
    sums.add(losses.loss, losses.parts, batch.rows());
    const bool wanted =
        step + 1 == steps || std::any_of(callbacks.begin(), callbacks.end(),
                                         [](const auto& cb) { return cb->wants_batch_logs(); });
    const Logs batch_logs = wanted ? logs_of(sums) : Logs{};  // never an older step's
    for (auto& cb : callbacks) cb->on_batch_end(*this, step, batch_logs);
    ++step;
  }
  return optim::average_over_ranks(logs_of(sums), sums.rows);
}

// --- evaluate, predict ------------------------------------------------------------------------

Logs Model::evaluate(const Tensor& x, const Tensor& y, EvaluateOptions o) {
  return evaluate(std::vector<Tensor>{x}, std::vector<Tensor>{y}, o);
}

Logs Model::evaluate(const std::vector<Tensor>& x_in, const std::vector<Tensor>& y_in,
                     EvaluateOptions o) {
  const std::string who = fmt::format("model '{}': evaluate", name());
  if (!compiled()) throw ValueError(who + ": the model is not compiled (call compile() first)");
  std::vector<Tensor> x = x_in, y = y_in;
  conform_data(who, x, y);
  if (o.batch_size <= 0)
    throw ValueError(fmt::format("{}: batch_size must be positive; got {}", who, o.batch_size));
  NoGradGuard no_grad;
  for (auto& ms : metrics_)
    for (auto& m : ms) m->reset_state();
  const std::vector<std::string> outs = output_names();
  // Data-parallel: each rank evaluates its block of the samples; the logs are averaged.
  const auto [rank, world] = place();
  data::Dataset batches = data::Dataset::from_tensors(x, y);
  if (world > 1) batches = batches.shard(rank, world);
  std::int64_t n = 0;
  double loss_sum = 0.0;
  std::vector<double> part_sums(outs.size(), 0.0);
  for (const data::Element& b : batches.batch(o.batch_size).to(device())) {
    const std::vector<Tensor> pred = apply(b.inputs, CallContext{.training = false});
    std::vector<Tensor> parts;
    const auto rows_in_batch = static_cast<double>(b.rows());
    loss_sum += batch_loss(b.labels, pred, &parts).item<double>() * rows_in_batch;
    for (std::size_t i = 0; i < parts.size(); ++i)
      part_sums[i] += parts[i].item<double>() * rows_in_batch;
    for (std::size_t i = 0; i < metrics_.size(); ++i)
      for (const auto& m : metrics_[i]) m->update_state(b.labels[i], pred[i]);
    n += b.rows();
  }
  const double denom = n > 0 ? static_cast<double>(n) : 1.0;
  std::vector<double> parts;
  for (double p : part_sums) parts.push_back(p / denom);
  Logs logs = optim::average_over_ranks(
      make_logs(n > 0 ? loss_sum / denom : 0.0, parts, outs, metrics_), n);
  if (o.verbose > 0 && rank == 0)
    fmt::print("{} samples - {}\n", x.front().dim(0), format_logs(logs, metric_keys()));
  return logs;
}

Tensor Model::predict(const Tensor& x, PredictOptions o) {
  if (!x.defined() || x.rank() == 0)
    throw ShapeError(fmt::format("model '{}': predict needs a batch of inputs (axis 0); got {}",
                                 name(), x.defined() ? describe(x) : "undefined"));
  std::vector<Tensor> out = predict(std::vector<Tensor>{x}, o);
  if (out.size() != 1)
    throw ValueError(
        fmt::format("model '{}': has {} outputs; predict on a vector of inputs "
                    "returns them all",
                    name(), out.size()));
  return out.front();
}

std::vector<Tensor> Model::predict(const std::vector<Tensor>& x, PredictOptions o) {
  const std::string who = fmt::format("model '{}': predict", name());
  if (x.size() != num_inputs())
    throw ValueError(fmt::format("{}: the model takes {} input{}; got {}", who, num_inputs(),
                                 num_inputs() == 1 ? "" : "s", x.size()));
  for (const Tensor& t : x)
    if (!t.defined() || t.rank() == 0 || t.dim(0) != x.front().dim(0))
      throw ShapeError(
          fmt::format("{}: needs batches of inputs with one number of samples (axis "
                      "0); got {}",
                      who, describe_all(x)));
  if (o.batch_size <= 0)
    throw ValueError(fmt::format("{}: batch_size must be positive; got {}", who, o.batch_size));
  NoGradGuard no_grad;
  const std::int64_t n = x.front().dim(0);
  std::vector<Tensor> out;
  std::vector<std::size_t> row_bytes;
  for (std::int64_t b0 = 0; b0 < n; b0 += o.batch_size) {
    const std::int64_t b1 = std::min(n, b0 + o.batch_size);
    std::vector<Tensor> xb;
    for (const Tensor& t : x) xb.push_back(rows(t, b0, b1).to(device()));
    const std::vector<Tensor> pred = apply(xb, CallContext{.training = false});
    if (out.empty()) {
      for (const Tensor& p : pred) {
        std::vector<std::int64_t> dims = p.shape().dims();
        dims[0] = n;
        out.push_back(Tensor::empty(Shape(dims), p.dtype()));
        row_bytes.push_back(
            static_cast<std::size_t>(p.numel() / std::max<std::int64_t>(p.dim(0), 1)) *
            p.dtype().itemsize());
      }
    }
    for (std::size_t k = 0; k < pred.size(); ++k) {
      const auto bytes = detail::host_bytes(pred[k]);
      std::memcpy(
          static_cast<char*>(out[k].data_ptr()) + static_cast<std::size_t>(b0) * row_bytes[k],
          bytes.data(), bytes.size());
    }
  }
  if (out.empty()) throw ValueError(fmt::format("{} on 0 samples", who));
  for (Tensor& t : out) t = t.to(device());
  return out;
}

}  // namespace mixtape
