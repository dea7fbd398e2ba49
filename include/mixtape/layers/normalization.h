// Normalization layers: BatchNormalization and LayerNormalization.
//
// Both compute their statistics in float32 (float64 under the float64 policy) and keep
// their parameters there too, whatever the policy: a float16 input is cast up, normalised,
// and the result cast back to the compute dtype. Their weights are not autocast.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mixtape/layers/initializers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"

namespace mixtape::layers {

struct BatchNormalizationOptions {
  int axis = -1;  // the feature axis (channels last)
  double momentum = 0.99;
  double epsilon = 1e-3;
  bool center = true;  // beta
  bool scale = true;   // gamma
  init::Initializer beta_initializer = init::zeros();
  init::Initializer gamma_initializer = init::ones();
  init::Initializer moving_mean_initializer = init::zeros();
  init::Initializer moving_variance_initializer = init::ones();
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(BatchNormalizationOptions, axis, momentum, epsilon, center, scale, beta_initializer,
                gamma_initializer, moving_mean_initializer, moving_variance_initializer);

// Training (a trainable layer called with {.training = true}): normalises with the batch's
// mean and (biased) variance over every axis but `axis`, and moves the moving averages
// towards them: moving = moving * momentum + batch * (1 - momentum). Otherwise (inference,
// a frozen layer, or an empty batch, which has no statistics) it normalises with the moving
// averages and leaves them as they are.
class BatchNormalizationLayer : public Layer {
 public:
  explicit BatchNormalizationLayer(BatchNormalizationOptions options = {});
  const BatchNormalizationOptions& options() const { return options_; }
  void build(const Shape& input_shape) override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  DType computation_dtype() const override { return param_dtype(); }

  const Variable& gamma() const { return gamma_; }
  const Variable& beta() const { return beta_; }
  const Variable& moving_mean() const { return moving_mean_; }
  const Variable& moving_variance() const { return moving_variance_; }

 private:
  DType param_dtype() const;
  BatchNormalizationOptions options_;
  int axis_ = -1;  // normalised against the input rank at build
  Variable gamma_, beta_, moving_mean_, moving_variance_;
};
LayerPtr<BatchNormalizationLayer> BatchNormalization(BatchNormalizationOptions options = {});

struct LayerNormalizationOptions {
  double epsilon = 1e-3;
  bool center = true;
  bool scale = true;
  init::Initializer beta_initializer = init::zeros();
  init::Initializer gamma_initializer = init::ones();
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(LayerNormalizationOptions, epsilon, center, scale, beta_initializer,
                gamma_initializer);

// Normalises each sample over its last axis: (x - mean) / sqrt(var + epsilon) * gamma + beta.
class LayerNormalizationLayer : public Layer {
 public:
  explicit LayerNormalizationLayer(LayerNormalizationOptions options = {});
  const LayerNormalizationOptions& options() const { return options_; }
  void build(const Shape& input_shape) override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  DType computation_dtype() const override { return param_dtype(); }

  const Variable& gamma() const { return gamma_; }
  const Variable& beta() const { return beta_; }

 private:
  DType param_dtype() const;
  LayerNormalizationOptions options_;
  Variable gamma_, beta_;
};
LayerPtr<LayerNormalizationLayer> LayerNormalization(LayerNormalizationOptions options = {});

}  // namespace mixtape::layers
