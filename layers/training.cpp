// Model training: compile, train_step, fit (with its progress output), evaluate, predict,
// and the EarlyStopping callback.
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <tuple>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/layers/model.h"
#include "mixtape/optim/loss_scale_optimizer.h"

namespace mixtape {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string describe(const Tensor& t) { return fmt::format("{}{}", t.dtype(), t.shape()); }

// "loss: 0.1234 - accuracy: 0.9876", in the order of `keys`.
std::string format_logs(const Logs& logs, const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    auto it = logs.find(k);
    if (it == logs.end()) continue;
    if (!out.empty()) out += " - ";
    if (k == "loss_scale" || k == "skipped_steps")
      out += fmt::format("{}: {:g}", k, it->second);
    else
      out += fmt::format("{}: {:.4f}", k, it->second);
  }
  return out;
}

std::string duration_text(double s) {
  if (s < 60) return fmt::format("{:.1f}s", s);
  return fmt::format("{}m{:02d}s", static_cast<int>(s) / 60, static_cast<int>(s) % 60);
}

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

void Model::compile(CompileOptions options) {
  if (!options.loss)
    throw ValueError(fmt::format("model '{}': compile needs a loss (.loss = ...)", name()));
  std::shared_ptr<optim::Optimizer> opt = options.optimizer.get();
  if (!opt) throw ValueError(fmt::format("model '{}': compile got an empty optimizer", name()));
  const auto& scale = dtype_policy().loss_scale();
  if (scale && !dynamic_cast<optim::LossScaleOptimizer*>(opt.get())) {
    opt = std::make_shared<optim::LossScaleOptimizer>(opt, *scale);
    spdlog::info(
        "model '{}': policy {} has a loss scale; the optimizer is wrapped in a "
        "LossScaleOptimizer ({})",
        name(), dtype_policy().name(), scale->str());
  }
  std::vector<std::shared_ptr<metrics::Metric>> ms;
  for (const auto& m : options.metrics) {
    if (m.metric()) {
      ms.push_back(m.metric());
      continue;
    }
    if (m.name() == "accuracy" || m.name() == "acc") {
      // The accuracy that matches the loss, as Keras chooses it.
      const std::string& l = options.loss->name();
      if (l == "sparse_categorical_crossentropy")
        ms.push_back(std::make_shared<metrics::SparseCategoricalAccuracy>("accuracy"));
      else if (l == "categorical_crossentropy")
        ms.push_back(std::make_shared<metrics::CategoricalAccuracy>("accuracy"));
      else if (l == "binary_crossentropy")
        ms.push_back(std::make_shared<metrics::BinaryAccuracy>("accuracy"));
      else
        ms.push_back(std::make_shared<metrics::Accuracy>("accuracy"));
    } else {
      ms.push_back(metrics::get(m.name()));
    }
  }
  loss_ = options.loss;
  optimizer_ = std::move(opt);
  metrics_ = std::move(ms);
}

const losses::Loss& Model::loss() const {
  if (!loss_) throw ValueError(fmt::format("model '{}' is not compiled (call compile())", name()));
  return *loss_;
}

// --- One step ---------------------------------------------------------------------------------

Logs Model::train_step(const Tensor& x, const Tensor& y_in) {
  if (!compiled())
    throw ValueError(
        fmt::format("model '{}' is not compiled: call compile() before training", name()));
  const Tensor y = as_int64(y_in);
  if (x.defined() && x.rank() > 0 && x.dim(0) == 0) {
    // An empty batch: nothing to learn from. The model (in inference mode, so that no
    // statistic moves) and the loss still run, to check the shapes; the loss of an empty
    // batch is 0 (Keras); no gradient, no optimizer step, no iteration counted.
    NoGradGuard no_grad;
    const Tensor pred = (*this)(x, CallContext{.training = false});
    Logs logs{{"loss", (*loss_)(y, pred).item<double>()}};
    for (const auto& m : metrics_) {
      m->update_state(y, pred);
      logs[m->name()] = m->result();
    }
    return logs;
  }
  auto* lso = dynamic_cast<optim::LossScaleOptimizer*>(optimizer_.get());
  const std::vector<Variable> vars = trainable_variables();
  Tensor loss, pred;
  std::vector<Tensor> grads;
  {
    GradientTape tape;
    pred = (*this)(x, CallContext{.training = true});
    loss = (*loss_)(y, pred);
    grads = tape.gradient(lso ? lso->get_scaled_loss(loss) : loss, vars);
  }
  if (lso) grads = lso->get_unscaled_gradients(grads);
  optimizer_->apply_gradients(grads, vars);
  NoGradGuard no_grad;
  Logs logs{{"loss", loss.item<double>()}};
  for (const auto& m : metrics_) {
    m->update_state(y, pred);
    logs[m->name()] = m->result();
  }
  return logs;
}

// --- fit --------------------------------------------------------------------------------------

History Model::fit(const Tensor& x_in, const Tensor& y_in, FitOptions o) {
  const std::string who = fmt::format("model '{}': fit", name());
  if (!compiled()) throw ValueError(who + ": the model is not compiled (call compile() first)");
  if (!x_in.defined() || !y_in.defined()) throw ValueError(who + ": x and y must be defined");
  // Integer data is cast once, here, at the boundary (as Keras casts a model's inputs):
  // uint8 images to the model's input dtype (float32 unless its Input says otherwise), the
  // ids of a model that takes them as they are (an Embedding first) from uint8 or bool to
  // int64, labels to int64.
  Tensor x = conform_input(x_in);
  if (!batchable(x)) x = as_int64(x);
  const Tensor y = as_int64(y_in);
  if (x.rank() == 0 || y.rank() == 0 || x.dim(0) != y.dim(0))
    throw ShapeError(fmt::format("{}: x {} and y {} need the same number of samples (axis 0)", who,
                                 describe(x), describe(y)));
  if (o.batch_size <= 0)
    throw ValueError(fmt::format("{}: batch_size must be positive; got {}", who, o.batch_size));
  if (o.epochs < 0) throw ValueError(fmt::format("{}: epochs must be >= 0; got {}", who, o.epochs));
  if (o.initial_epoch < 0)
    throw ValueError(fmt::format("{}: initial_epoch must be >= 0; got {}", who, o.initial_epoch));
  if (!(o.validation_split >= 0.0 && o.validation_split < 1.0))
    throw ValueError(
        fmt::format("{}: validation_split must be in [0, 1); got {}", who, o.validation_split));

  // The held-out validation samples: the last ones, before any shuffling (as Keras).
  const std::int64_t n = x.dim(0);
  std::int64_t n_train = n;
  Tensor x_val, y_val;
  if (o.validation_data) {
    x_val = o.validation_data.x;
    y_val = o.validation_data.y;
    if (!x_val.defined() || !y_val.defined() || x_val.rank() == 0 || y_val.rank() == 0 ||
        x_val.dim(0) != y_val.dim(0))
      throw ShapeError(
          fmt::format("{}: validation_data needs x and y with the same number of "
                      "samples",
                      who));
  } else if (o.validation_split > 0.0) {
    n_train = static_cast<std::int64_t>(static_cast<double>(n) * (1.0 - o.validation_split));
    if (n_train <= 0 || n_train >= n)
      throw ValueError(
          fmt::format("{}: validation_split {} of {} samples leaves no training or "
                      "no validation samples",
                      who, o.validation_split, n));
    x_val = rows(x, n_train, n);
    y_val = rows(y, n_train, n);
  }
  const Tensor x_train = rows(x, 0, n_train), y_train = rows(y, 0, n_train);
  if (n_train == 0) throw ValueError(who + ": no training samples");

  auto* lso = dynamic_cast<optim::LossScaleOptimizer*>(optimizer_.get());
  // Each epoch shuffles with a generator of its own, seeded from the base seed and the
  // epoch number: resuming at epoch k (initial_epoch) replays the same order.
  const std::uint64_t base_seed = o.seed ? *o.seed : default_generator().next_u64();
  const std::int64_t steps = (n_train + o.batch_size - 1) / o.batch_size;
  const bool tty = o.verbose == 1 && isatty(fileno(stdout));
  std::vector<std::string> keys{"loss"};
  for (const auto& m : metrics_) keys.push_back(m->name());

  History history;
  stop_training_ = false;
  for (auto& cb : o.callbacks) cb->on_train_begin(*this);
  Logs logs;
  std::vector<std::int64_t> order(static_cast<std::size_t>(n_train));
  for (int epoch = o.initial_epoch; epoch < o.epochs && !stop_training_; ++epoch) {
    for (auto& cb : o.callbacks) cb->on_epoch_begin(*this, epoch);
    for (auto& m : metrics_) m->reset_state();
    std::iota(order.begin(), order.end(), std::int64_t{0});
    Generator gen(base_seed ^ (0x9e3779b97f4a7c15ULL * static_cast<std::uint64_t>(epoch + 1)));
    if (o.shuffle)
      for (std::size_t i = order.size(); i > 1; --i)
        std::swap(order[i - 1], order[gen.next_u64() % i]);
    const std::int64_t skipped_before = lso ? lso->skipped_steps() : 0;
    if (o.verbose > 0) fmt::print("Epoch {}/{}\n", epoch + 1, o.epochs);

    const auto start = Clock::now();
    auto last_print = start;
    double loss_sum = 0.0;
    std::int64_t seen = 0;
    Logs batch_logs;
    for (std::int64_t step = 0; step < steps; ++step) {
      const std::int64_t b0 = step * o.batch_size, b1 = std::min(n_train, b0 + o.batch_size);
      Tensor xb, yb;
      if (o.shuffle) {
        const Tensor idx = from_vector(
            std::vector<std::int64_t>(order.begin() + b0, order.begin() + b1), Shape{b1 - b0});
        NoGradGuard no_grad;
        xb = take(x_train, idx, 0);
        yb = take(y_train, idx, 0);
      } else {
        xb = rows(x_train, b0, b1);
        yb = rows(y_train, b0, b1);
      }
      xb = xb.to(device());
      yb = yb.to(device());
      batch_logs = train_step(xb, yb);
      loss_sum += batch_logs["loss"] * static_cast<double>(b1 - b0);
      seen += b1 - b0;
      batch_logs["loss"] = loss_sum / static_cast<double>(seen);  // the epoch's running mean
      for (auto& cb : o.callbacks) cb->on_batch_end(*this, step, batch_logs);
      if (tty && (step + 1 == steps ||
                  std::chrono::duration<double>(Clock::now() - last_print).count() >= 0.1)) {
        last_print = Clock::now();
        constexpr int kWidth = 30;
        const int done = static_cast<int>(kWidth * (step + 1) / steps);
        std::string bar(static_cast<std::size_t>(done), '=');
        if (done < kWidth)
          bar += '>' + std::string(static_cast<std::size_t>(kWidth - done - 1), '.');
        const double elapsed = seconds_since(start);
        const double eta =
            elapsed / static_cast<double>(step + 1) * static_cast<double>(steps - step - 1);
        fmt::print("\r{}/{} [{}] - ETA: {} - {}   ", step + 1, steps, bar, duration_text(eta),
                   format_logs(batch_logs, keys));
        std::fflush(stdout);
      }
    }
    const double epoch_s = seconds_since(start);

    logs = Logs{{"loss", loss_sum / static_cast<double>(std::max<std::int64_t>(seen, 1))}};
    for (const auto& m : metrics_) logs[m->name()] = m->result();
    std::vector<std::string> line_keys = keys;
    if (x_val.defined()) {
      const Logs v = evaluate(x_val, y_val, EvaluateOptions{.batch_size = o.batch_size});
      for (const auto& [k, val] : v) logs["val_" + k] = val;
      for (const auto& k : keys) line_keys.push_back("val_" + k);
    }
    if (lso) {
      logs["loss_scale"] = lso->loss_scale();
      logs["skipped_steps"] = static_cast<double>(lso->skipped_steps() - skipped_before);
      line_keys.push_back("loss_scale");
      line_keys.push_back("skipped_steps");
    }
    history.epoch.push_back(epoch);
    for (const auto& [k, v] : logs) history.history[k].push_back(v);
    if (o.verbose > 0) {
      const double us = epoch_s / static_cast<double>(n_train) * 1e6;
      fmt::print("{}{}/{} - {} - {:.0f}us/sample - {}\n", tty ? "\r" : "", steps, steps,
                 duration_text(epoch_s), us, format_logs(logs, line_keys));
      std::fflush(stdout);
    }
    for (auto& cb : o.callbacks) cb->on_epoch_end(*this, epoch, logs);
  }
  for (auto& cb : o.callbacks) cb->on_train_end(*this, logs);
  return history;
}

// --- evaluate, predict ------------------------------------------------------------------------

Logs Model::evaluate(const Tensor& x, const Tensor& y, EvaluateOptions o) {
  const std::string who = fmt::format("model '{}': evaluate", name());
  if (!compiled()) throw ValueError(who + ": the model is not compiled (call compile() first)");
  if (!x.defined() || !y.defined() || x.rank() == 0 || y.rank() == 0 || x.dim(0) != y.dim(0))
    throw ShapeError(fmt::format("{}: x {} and y {} need the same number of samples (axis 0)", who,
                                 x.defined() ? describe(x) : "undefined",
                                 y.defined() ? describe(y) : "undefined"));
  if (o.batch_size <= 0)
    throw ValueError(fmt::format("{}: batch_size must be positive; got {}", who, o.batch_size));
  NoGradGuard no_grad;
  for (auto& m : metrics_) m->reset_state();
  const std::int64_t n = x.dim(0);
  double loss_sum = 0.0;
  for (std::int64_t b0 = 0; b0 < n; b0 += o.batch_size) {
    const std::int64_t b1 = std::min(n, b0 + o.batch_size);
    const Tensor xb = rows(x, b0, b1).to(device());
    const Tensor yb = as_int64(rows(y, b0, b1)).to(device());
    const Tensor pred = (*this)(xb, CallContext{.training = false});
    loss_sum += (*loss_)(yb, pred).item<double>() * static_cast<double>(b1 - b0);
    for (auto& m : metrics_) m->update_state(yb, pred);
  }
  Logs logs{{"loss", n > 0 ? loss_sum / static_cast<double>(n) : 0.0}};
  for (const auto& m : metrics_) logs[m->name()] = m->result();
  if (o.verbose > 0) {
    std::vector<std::string> keys{"loss"};
    for (const auto& m : metrics_) keys.push_back(m->name());
    fmt::print("{} samples - {}\n", n, format_logs(logs, keys));
  }
  return logs;
}

Tensor Model::predict(const Tensor& x, PredictOptions o) {
  if (!x.defined() || x.rank() == 0)
    throw ShapeError(fmt::format("model '{}': predict needs a batch of inputs (axis 0); got {}",
                                 name(), x.defined() ? describe(x) : "undefined"));
  if (o.batch_size <= 0)
    throw ValueError(fmt::format("model '{}': predict: batch_size must be positive; got {}", name(),
                                 o.batch_size));
  NoGradGuard no_grad;
  const std::int64_t n = x.dim(0);
  Tensor out;
  std::size_t row_bytes = 0;
  for (std::int64_t b0 = 0; b0 < n; b0 += o.batch_size) {
    const std::int64_t b1 = std::min(n, b0 + o.batch_size);
    const Tensor pred = (*this)(rows(x, b0, b1).to(device()), CallContext{.training = false});
    if (!out.defined()) {
      std::vector<std::int64_t> dims = pred.shape().dims();
      dims[0] = n;
      out = Tensor::empty(Shape(dims), pred.dtype());
      row_bytes = static_cast<std::size_t>(pred.numel() / std::max<std::int64_t>(pred.dim(0), 1)) *
                  pred.dtype().itemsize();
    }
    const auto bytes = detail::host_bytes(pred);
    std::memcpy(static_cast<char*>(out.data_ptr()) + static_cast<std::size_t>(b0) * row_bytes,
                bytes.data(), bytes.size());
  }
  if (!out.defined()) throw ValueError(fmt::format("model '{}': predict on 0 samples", name()));
  return out.to(device());
}

// --- History, EarlyStopping ----------------------------------------------------------------------

double History::last(const std::string& key) const {
  auto it = history.find(key);
  if (it == history.end() || it->second.empty()) {
    std::string keys;
    for (const auto& [k, v] : history) keys += (keys.empty() ? "" : ", ") + k;
    throw ValueError(fmt::format("History: no value '{}'; logged: {}", key, keys));
  }
  return it->second.back();
}

EarlyStopping::EarlyStopping(Options options) : options_(std::move(options)) {
  if (options_.patience < 0)
    throw ValueError(
        fmt::format("EarlyStopping: patience must be >= 0; got {}", options_.patience));
}

void EarlyStopping::on_train_begin(Model&) {
  seen_ = false;
  wait_ = 0;
  stopped_epoch_ = -1;
}

void EarlyStopping::on_epoch_end(Model& model, int epoch, const Logs& logs) {
  auto it = logs.find(options_.monitor);
  if (it == logs.end()) {
    spdlog::warn("EarlyStopping: '{}' is not logged; nothing to monitor", options_.monitor);
    return;
  }
  const double v = it->second;
  const bool better = !seen_ || (options_.maximize ? v > best_ + options_.min_delta
                                                   : v < best_ - options_.min_delta);
  if (better) {
    best_ = v;
    seen_ = true;
    wait_ = 0;
    return;
  }
  if (++wait_ > options_.patience) {
    stopped_epoch_ = epoch;
    model.stop_training();
  }
}

}  // namespace mixtape
