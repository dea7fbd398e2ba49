// Convolution and pooling layers, NHWC like Keras: Conv2D, MaxPooling2D,
// AveragePooling2D, GlobalAveragePooling2D.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "mixtape/autograd/ops.h"
#include "mixtape/layers/activations.h"
#include "mixtape/layers/initializers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"
#include "mixtape/layers/size2.h"

namespace mixtape::layers {

struct Conv2DOptions {
  Size2 strides = 1;
  std::string padding = "valid";  // or "same" (TensorFlow's rule: ceil(in / stride))
  std::string activation = "linear";
  bool use_bias = true;
  init::Initializer kernel_initializer = init::glorot_uniform();
  init::Initializer bias_initializer = init::zeros();
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(Conv2DOptions, strides, padding, activation, use_bias, kernel_initializer,
                bias_initializer);

// [n, h, w, c] -> [n, oh, ow, filters] with a [kh, kw, c, filters] kernel.
class Conv2DLayer : public Layer {
 public:
  Conv2DLayer(std::int64_t filters, Size2 kernel_size, Conv2DOptions options = {});
  std::int64_t filters() const { return filters_; }
  const Size2& kernel_size() const { return kernel_size_; }
  const Conv2DOptions& options() const { return options_; }
  void build(const Shape& input_shape) override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  DType computation_dtype() const override;
  const Variable& kernel() const;
  const Variable& bias() const;

 private:
  std::int64_t filters_;
  Size2 kernel_size_;
  Conv2DOptions options_;
  Padding padding_;
  activations::ActivationFn activation_;
  Variable kernel_, bias_;
};
LayerPtr<Conv2DLayer> Conv2D(std::int64_t filters, Size2 kernel_size, Conv2DOptions options = {});

struct PoolingOptions {
  Size2 pool_size = 2;
  std::optional<Size2> strides = {};  // empty: pool_size
  std::string padding = "valid";      // or "same"
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(PoolingOptions, pool_size, strides, padding);

// Max or average over windows of [n, h, w, c] (padded positions are ignored).
class Pooling2DLayer : public Layer {
 public:
  enum class Kind { Max, Average };
  Pooling2DLayer(Kind kind, PoolingOptions options = {});
  const PoolingOptions& options() const { return options_; }
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;

 private:
  Kind kind_;
  PoolingOptions options_;
  Padding padding_;
};
LayerPtr<Pooling2DLayer> MaxPooling2D(PoolingOptions options = {});
LayerPtr<Pooling2DLayer> AveragePooling2D(PoolingOptions options = {});

// [n, h, w, c] -> [n, c], the mean over h and w (accumulated in float32).
class GlobalAveragePooling2DLayer : public Layer {
 public:
  explicit GlobalAveragePooling2DLayer(LayerOptions options = {});
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
};
LayerPtr<GlobalAveragePooling2DLayer> GlobalAveragePooling2D(LayerOptions options = {});

}  // namespace mixtape::layers
