// Losses, computed in float32 (float64 for float64 predictions).
#include "mixtape/layers/losses.h"

#include "layers/class_indices.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/error.h"

namespace mixtape::losses {

namespace {

// Keras' epsilon: probabilities are clipped to [kEpsilon, 1 - kEpsilon] before a log.
constexpr double kEpsilon = 1e-7;

DType loss_dtype(const Tensor& y_pred) { return y_pred.dtype() == kFloat64 ? kFloat64 : kFloat32; }

std::string describe(const Tensor& t) { return fmt::format("{}{}", t.dtype(), t.shape()); }

void check_defined(const char* loss, const Tensor& y_true, const Tensor& y_pred) {
  if (!y_true.defined() || !y_pred.defined())
    throw ValueError(fmt::format("{}: y_true and y_pred must be defined", loss));
  if (!y_pred.dtype().is_floating())
    throw DTypeError(
        fmt::format("{}: predictions must be floating; got y_pred {}", loss, describe(y_pred)));
}

void check_same_shape(const char* loss, const Tensor& y_true, const Tensor& y_pred) {
  if (y_true.shape() != y_pred.shape())
    throw ShapeError(fmt::format("{}: y_true {} and y_pred {} must have the same shape", loss,
                                 describe(y_true), describe(y_pred)));
}

Tensor clip(const Tensor& p) {
  return minimum(maximum(p, full({}, kEpsilon, p.dtype(), p.device())),
                 full({}, 1.0 - kEpsilon, p.dtype(), p.device()));
}

// Probabilities normalised to sum to one over the last axis, clipped, then logged.
Tensor log_probabilities(const Tensor& p) { return log(clip(p / sum(p, {-1}, true))); }

// A class axis (the last) with at least one class.
void check_classes(const char* loss, const Tensor& y_pred) {
  if (y_pred.rank() < 1)
    throw ShapeError(fmt::format("{}: y_pred needs a class axis; got {}", loss, describe(y_pred)));
  if (y_pred.dim(-1) == 0)
    throw ShapeError(fmt::format("{}: y_pred needs at least one class on its last axis; got {}",
                                 loss, describe(y_pred)));
}

// Mean over the last axis, unless there is only the batch axis. An empty last axis
// (samples with nothing to average: 0/0) is refused.
Tensor per_sample_mean(const char* loss, const Tensor& elementwise, const Tensor& y_pred) {
  if (elementwise.rank() <= 1) return elementwise;
  if (elementwise.dim(-1) == 0)
    throw ShapeError(
        fmt::format("{}: y_pred {} has no values on its last axis to average per sample", loss,
                    describe(y_pred)));
  return mean(elementwise, {-1});
}

Tensor sparse_crossentropy(const Tensor& y_true, const Tensor& y_pred, bool from_logits) {
  constexpr const char* kName = "sparse_categorical_crossentropy";
  check_defined(kName, y_true, y_pred);
  check_classes(kName, y_pred);
  Tensor labels = y_true;
  if (labels.rank() == y_pred.rank() && labels.rank() > 0 && labels.dim(-1) == 1)
    labels = squeeze(labels, -1);
  const Shape& ps = y_pred.shape();
  const Shape expected(std::vector<std::int64_t>(ps.begin(), ps.end() - 1));
  if (labels.shape() != expected)
    throw ShapeError(
        fmt::format("{}: labels {} do not match predictions {} (expected labels of "
                    "shape {} or {} with a trailing 1)",
                    kName, describe(y_true), describe(y_pred), expected, expected));
  const std::int64_t classes = y_pred.dim(-1);
  // Floating labels: NaN, infinities and values outside [0, classes) are refused here,
  // naming the first; integer ones are checked by gather below.
  labels = layers::detail::class_indices(kName, "labels", labels, classes);
  const std::int64_t n = labels.numel();
  try {
    if (from_logits)  // one fused op: the loss, and in the backward pass its gradient
      return reshape(
          softmax_cross_entropy(reshape(y_pred, Shape{n, classes}), reshape(labels, Shape{n})),
          expected);
    const Tensor p = reshape(cast(y_pred, loss_dtype(y_pred)), Shape{n, classes});
    return reshape(-gather(log_probabilities(p), reshape(labels, Shape{n, 1}), 1), expected);
  } catch (const IndexError& e) {
    throw IndexError(fmt::format("{}: labels must lie in [0, {}) for {} classes ({})", kName,
                                 classes, classes, e.what()));
  }
}

Tensor categorical_crossentropy(const Tensor& y_true, const Tensor& y_pred, bool from_logits) {
  constexpr const char* kName = "categorical_crossentropy";
  check_defined(kName, y_true, y_pred);
  check_same_shape(kName, y_true, y_pred);
  check_classes(kName, y_pred);
  const DType dt = loss_dtype(y_pred);
  Tensor p = cast(y_pred, dt);
  Tensor logp = from_logits ? log_softmax(p, -1) : log_probabilities(p);
  return -sum(cast(y_true, dt) * logp, {-1});
}

Tensor binary_crossentropy(const Tensor& y_true, const Tensor& y_pred, bool from_logits) {
  constexpr const char* kName = "binary_crossentropy";
  check_defined(kName, y_true, y_pred);
  check_same_shape(kName, y_true, y_pred);
  const DType dt = loss_dtype(y_pred);
  Tensor x = cast(y_pred, dt), y = cast(y_true, dt);
  Tensor elementwise;
  if (from_logits) {
    // max(x, 0) - x y + log(1 + exp(-|x|)): never overflows.
    elementwise = relu(x) - x * y + log(1.0 + exp(-abs(x)));
  } else {
    Tensor p = clip(x);
    elementwise = -(y * log(p) + (1.0 - y) * log(1.0 - p));
  }
  return per_sample_mean(kName, elementwise, y_pred);
}

Tensor mean_squared_error(const Tensor& y_true, const Tensor& y_pred) {
  constexpr const char* kName = "mean_squared_error";
  check_defined(kName, y_true, y_pred);
  check_same_shape(kName, y_true, y_pred);
  const DType dt = loss_dtype(y_pred);
  return per_sample_mean(kName, square(cast(y_true, dt) - cast(y_pred, dt)), y_pred);
}

}  // namespace

Loss::Loss(std::string name, Fn per_sample, Reduction reduction)
    : name_(std::move(name)), per_sample_(std::move(per_sample)), reduction_(reduction) {
  if (!per_sample_) throw ValueError(fmt::format("loss '{}' has no function", name_));
}

Loss::Loss(std::string_view name) : Loss(MeanSquaredError()) {
  if (name == "sparse_categorical_crossentropy") {
    *this = SparseCategoricalCrossentropy();
  } else if (name == "categorical_crossentropy") {
    *this = CategoricalCrossentropy();
  } else if (name == "binary_crossentropy") {
    *this = BinaryCrossentropy();
  } else if (name != "mean_squared_error" && name != "mse") {
    throw ValueError(fmt::format("unknown loss '{}'; valid names: {}", name, valid_names()));
  }
}

Tensor Loss::operator()(const Tensor& y_true, const Tensor& y_pred,
                        const Tensor& sample_weight) const {
  Tensor losses = per_sample_(y_true, y_pred);
  if (sample_weight.defined()) {
    if (sample_weight.numel() != losses.numel())
      throw ShapeError(fmt::format("{}: sample_weight {} does not match {} per-sample losses",
                                   name_, describe(sample_weight), losses.numel()));
    losses = losses * reshape(cast(sample_weight, losses.dtype()), losses.shape());
  }
  switch (reduction_) {
    case Reduction::None:
      return losses;
    case Reduction::Sum:
      return sum(losses);
    case Reduction::SumOverBatchSize:
      break;
  }
  // The sum over the number of losses, and 0 for an empty batch (Keras divides with
  // divide_no_nan): never 0/0.
  if (losses.numel() == 0) return sum(losses);
  return mean(losses);
}

// A loss of mixtape's own, which remembers its options (Loss::options()).
Loss built_in(const LossOptions& options, Loss loss) {
  loss.options_ = options;
  return loss;
}

// A cross-entropy: fn(target, prediction, from_logits) with the options' from_logits.
template <typename Fn>
Loss crossentropy(const char* name, Fn fn, const LossOptions& o) {
  return built_in(o, Loss(
                         name,
                         [fn, logits = o.from_logits](const Tensor& t, const Tensor& p) {
                           return fn(t, p, logits);
                         },
                         o.reduction));
}

Loss SparseCategoricalCrossentropy(LossOptions o) {
  return crossentropy("sparse_categorical_crossentropy", &sparse_crossentropy, o);
}

Loss CategoricalCrossentropy(LossOptions o) {
  return crossentropy("categorical_crossentropy", &categorical_crossentropy, o);
}

Loss BinaryCrossentropy(LossOptions o) {
  return crossentropy("binary_crossentropy", &binary_crossentropy, o);
}

Loss MeanSquaredError(LossOptions o) {
  return built_in(o, Loss("mean_squared_error", &mean_squared_error, o.reduction));
}

Loss from_config(const std::string& name, LossOptions options) {
  if (name == "sparse_categorical_crossentropy") return SparseCategoricalCrossentropy(options);
  if (name == "categorical_crossentropy") return CategoricalCrossentropy(options);
  if (name == "binary_crossentropy") return BinaryCrossentropy(options);
  if (name == "mean_squared_error") return MeanSquaredError(options);
  throw ValueError(fmt::format("unknown loss '{}'; valid names: {}", name, valid_names()));
}

std::string valid_names() {
  return "sparse_categorical_crossentropy, categorical_crossentropy, binary_crossentropy, "
         "mean_squared_error (mse)";
}

}  // namespace mixtape::losses
