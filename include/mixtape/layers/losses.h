// Losses: SparseCategoricalCrossentropy, CategoricalCrossentropy, BinaryCrossentropy,
// MeanSquaredError.
//
// A Loss is called as loss(y_true, y_pred) and returns a scalar: the mean of the
// per-sample losses over the batch (Reduction::SumOverBatchSize, Keras' default), their
// sum, or the per-sample losses themselves (Reduction::None). Over an empty batch (0
// samples) the mean and the sum are 0, as in Keras, never NaN; a prediction whose last axis
// is empty (no class, or nothing to average per sample) throws ShapeError. Losses always
// compute in float32 (float64 stays float64): a float16 or bfloat16 prediction is cast up
// first, as the mixed precision guide requires of a model's output.
//
//   auto loss_object = mt::losses::SparseCategoricalCrossentropy();
//   mt::Tensor loss = loss_object(labels, probabilities);
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "mixtape/core/tensor.h"

namespace mixtape::losses {

enum class Reduction { SumOverBatchSize, Sum, None };

struct LossOptions {
  bool from_logits = false;  // y_pred are logits (crossentropies only)
  Reduction reduction = Reduction::SumOverBatchSize;
};

class Loss {
 public:
  // per_sample(y_true, y_pred) returns one loss per sample (shape [batch]), in float32.
  using Fn = std::function<Tensor(const Tensor& y_true, const Tensor& y_pred)>;
  Loss(std::string name, Fn per_sample, Reduction reduction = Reduction::SumOverBatchSize);
  // By name: "sparse_categorical_crossentropy", "categorical_crossentropy",
  // "binary_crossentropy", "mean_squared_error" (or "mse"); throws ValueError otherwise.
  Loss(std::string_view name);                                     // NOLINT
  Loss(const char* name) : Loss(std::string_view(name)) {}         // NOLINT
  Loss(const std::string& name) : Loss(std::string_view(name)) {}  // NOLINT

  // The reduced loss; sample_weight (shape [batch]) weights each sample when given.
  Tensor operator()(const Tensor& y_true, const Tensor& y_pred,
                    const Tensor& sample_weight = Tensor()) const;
  const std::string& name() const { return name_; }
  Reduction reduction() const { return reduction_; }
  // The options a loss of mixtape's own was made with (from_config(name(), *options()) makes
  // it again); empty for a loss made from a function of one's own.
  const std::optional<LossOptions>& options() const { return options_; }

 private:
  friend Loss built_in(const LossOptions& options, Loss loss);
  std::string name_;
  Fn per_sample_;
  Reduction reduction_;
  std::optional<LossOptions> options_;
};

// `loss` marked as mixtape's own, made with `options`.
Loss built_in(const LossOptions& options, Loss loss);
// The loss of mixtape's own called `name` ("sparse_categorical_crossentropy", ...) with
// `options`; ValueError for another name.
Loss from_config(const std::string& name, LossOptions options);

// Integer labels [batch] (or [batch, 1]) against class probabilities (or logits) [batch, C].
// Labels outside [0, C) throw IndexError naming the flat position and the value of the
// first; floating labels are truncated toward zero (as Keras casts them), and a NaN or an
// infinity among them throws the same way.
Loss SparseCategoricalCrossentropy(LossOptions options = {});
// One-hot (or soft) labels [batch, C] against probabilities (or logits) [batch, C].
Loss CategoricalCrossentropy(LossOptions options = {});
// Labels in {0, 1} (or [0, 1]) against probabilities (or logits), same shape [batch, ...].
Loss BinaryCrossentropy(LossOptions options = {});
// mean((y_true - y_pred)^2) over the last axis, per sample.
Loss MeanSquaredError(LossOptions options = {});

std::string valid_names();

}  // namespace mixtape::losses
