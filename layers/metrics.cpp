// Metrics: device-side comparisons and float64 totals, read back by result().
#include "mixtape/layers/metrics.h"

#include "layers/class_indices.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/error.h"

namespace mixtape::metrics {

namespace {

std::string describe(const Tensor& t) { return fmt::format("{}{}", t.dtype(), t.shape()); }

void check_defined(const std::string& metric, const Tensor& y_true, const Tensor& y_pred) {
  if (!y_true.defined() || !y_pred.defined())
    throw ValueError(fmt::format("metric '{}': y_true and y_pred must be defined", metric));
}

// A class axis (the last) with at least one class: argmax needs one.
void check_classes(const std::string& metric, const Tensor& y_pred) {
  if (y_pred.rank() < 1 || y_pred.dim(-1) == 0)
    throw ShapeError(
        fmt::format("metric '{}': y_pred needs a class axis with at least one class; got {}",
                    metric, describe(y_pred)));
}

// Integer labels of shape `shape` from [shape] or [shape..., 1], for `classes` classes:
// floating labels must be class indices (NaN, infinities and values outside [0, classes)
// throw IndexError naming the first); integer ones outside the range count as misses.
Tensor labels_like(const std::string& metric, const Tensor& y_true, const Shape& shape,
                   std::int64_t classes) {
  Tensor labels = y_true;
  if (labels.shape() != shape && labels.rank() == shape.rank() + 1 && labels.dim(-1) == 1)
    labels = squeeze(labels, -1);
  if (labels.shape() != shape)
    throw ShapeError(
        fmt::format("metric '{}': labels {} do not match predictions of batch shape {}", metric,
                    describe(y_true), shape));
  return layers::detail::class_indices(fmt::format("metric '{}'", metric), "labels", labels,
                                       classes);
}

}  // namespace

void Metric::update_state(const Tensor&, const Tensor&, const Tensor&) {
  throw ValueError(fmt::format("metric '{}' is not updated from (y_true, y_pred)", name_));
}

namespace {
// sum += value, on value's device (the running sum moves there the first time it differs).
void add_to(Tensor& sum, const Tensor& value) {
  if (!sum.defined())
    sum = value;
  else
    sum = add(sum.device() == value.device() ? sum : sum.to(value.device()), value);
}
}  // namespace

void Metric::accumulate(const Tensor& values, const Tensor& weights) {
  NoGradGuard no_grad;
  Tensor v = cast(values, kFloat64);
  if (!weights.defined()) {
    add_to(total_, sum(v));
    count_ += static_cast<double>(v.numel());
    return;
  }
  if (weights.numel() != v.numel())
    throw ShapeError(fmt::format("metric '{}': sample_weight {} does not match values {}", name_,
                                 describe(weights), describe(values)));
  Tensor w = reshape(cast(weights, kFloat64), v.shape()).to(v.device());
  add_to(total_, sum(v * w));
  add_to(weights_, sum(w));
}

double Metric::result() const {
  const double count = count_ + (weights_.defined() ? weights_.item<double>() : 0.0);
  return count > 0 ? (total_.defined() ? total_.item<double>() : 0.0) / count : 0.0;
}

void Metric::reset_state() {
  total_ = Tensor();
  weights_ = Tensor();
  count_ = 0.0;
}

void Mean::update_state(const Tensor& values, const Tensor& sample_weight) {
  if (!values.defined()) throw ValueError(fmt::format("metric '{}': undefined values", name()));
  accumulate(values, sample_weight);
}

double Mean::operator()(const Tensor& values, const Tensor& sample_weight) {
  update_state(values, sample_weight);
  return result();
}

void Accuracy::update_state(const Tensor& y_true, const Tensor& y_pred,
                            const Tensor& sample_weight) {
  check_defined(name(), y_true, y_pred);
  NoGradGuard no_grad;
  if (y_true.shape() != y_pred.shape())
    throw ShapeError(fmt::format("metric '{}': y_true {} and y_pred {} must have the same shape",
                                 name(), describe(y_true), describe(y_pred)));
  accumulate(equal(y_true, y_pred), sample_weight);
}

void SparseCategoricalAccuracy::update_state(const Tensor& y_true, const Tensor& y_pred,
                                             const Tensor& sample_weight) {
  check_defined(name(), y_true, y_pred);
  check_classes(name(), y_pred);
  NoGradGuard no_grad;
  Tensor predicted = argmax(y_pred, -1);
  accumulate(equal(predicted, labels_like(name(), y_true, predicted.shape(), y_pred.dim(-1))),
             sample_weight);
}

void CategoricalAccuracy::update_state(const Tensor& y_true, const Tensor& y_pred,
                                       const Tensor& sample_weight) {
  check_defined(name(), y_true, y_pred);
  if (y_true.shape() != y_pred.shape() || y_pred.rank() < 1)
    throw ShapeError(fmt::format("metric '{}': y_true {} and y_pred {} must have the same shape",
                                 name(), describe(y_true), describe(y_pred)));
  check_classes(name(), y_pred);
  NoGradGuard no_grad;
  accumulate(equal(argmax(y_pred, -1), argmax(y_true, -1)), sample_weight);
}

void BinaryAccuracy::update_state(const Tensor& y_true, const Tensor& y_pred,
                                  const Tensor& sample_weight) {
  check_defined(name(), y_true, y_pred);
  if (y_true.shape() != y_pred.shape())
    throw ShapeError(fmt::format("metric '{}': y_true {} and y_pred {} must have the same shape",
                                 name(), describe(y_true), describe(y_pred)));
  NoGradGuard no_grad;
  Tensor predicted =
      greater(cast(y_pred, kFloat32), full({}, threshold_, kFloat32, y_pred.device()));
  Tensor truth = greater(cast(y_true, kFloat32), full({}, 0.5, kFloat32, y_true.device()));
  accumulate(equal(predicted, truth), sample_weight);
}

std::shared_ptr<Metric> get(std::string_view name) {
  if (name == "accuracy") return std::make_shared<Accuracy>();
  if (name == "sparse_categorical_accuracy") return std::make_shared<SparseCategoricalAccuracy>();
  if (name == "categorical_accuracy") return std::make_shared<CategoricalAccuracy>();
  if (name == "binary_accuracy") return std::make_shared<BinaryAccuracy>();
  throw ValueError(
      fmt::format("unknown metric '{}'; valid names: accuracy, "
                  "sparse_categorical_accuracy, categorical_accuracy, binary_accuracy",
                  name));
}

}  // namespace mixtape::metrics
