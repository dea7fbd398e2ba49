// Convolution and pooling layers.
#include "mixtape/layers/conv_layers.h"

#include "layers/config_util.h"
#include "mixtape/core/compute_mode.h"

namespace mixtape::layers {

namespace {

void check_size(const Layer& layer, const char* what, Size2 s) {
  if (s.h <= 0 || s.w <= 0)
    throw ValueError(fmt::format("layer '{}' ({}): {} must be positive; got ({}, {})", layer.name(),
                                 layer.class_name(), what, s.h, s.w));
}

}  // namespace

// --- Conv2D -------------------------------------------------------------------------------

Conv2DLayer::Conv2DLayer(std::int64_t filters, Size2 kernel_size, Conv2DOptions options)
    : Layer(detail::common_options(options), "Conv2D"),
      filters_(filters),
      kernel_size_(kernel_size),
      options_(std::move(options)),
      padding_(parse_padding(options_.padding)),
      activation_(activations::get(options_.activation)) {
  if (filters_ <= 0)
    throw ValueError(
        fmt::format("layer '{}' (Conv2D): filters must be positive; got {}", name(), filters_));
  check_size(*this, "kernel_size", kernel_size_);
  check_size(*this, "strides", options_.strides);
}

void Conv2DLayer::build(const Shape& input_shape) {
  if (input_shape.rank() != 4)
    throw ShapeError(fmt::format("expected an NHWC input of rank 4; got shape {}", input_shape));
  const std::int64_t c = input_shape[3];
  kernel_ = add_weight("kernel", {kernel_size_.h, kernel_size_.w, c, filters_},
                       options_.kernel_initializer);
  if (options_.use_bias) bias_ = add_weight("bias", {filters_}, options_.bias_initializer);
  set_input_spec(InputSpec{.rank = 4, .axes = {{-1, c}}});
}

std::optional<Shape> Conv2DLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() != 4)
    throw ShapeError(fmt::format("expected an NHWC input of rank 4; got shape {}", input_shape));
  return Shape{input_shape[0],
               window_output_extent(input_shape[1], kernel_size_.h, options_.strides.h, padding_),
               window_output_extent(input_shape[2], kernel_size_.w, options_.strides.w, padding_),
               filters_};
}

Tensor Conv2DLayer::call(const Tensor& x, const CallContext&) {
  // The bias goes into the convolution's kernel (one pass over the output, not two).
  Tensor y = options_.use_bias ? conv2d(x, kernel_, bias_, options_.strides.array(), padding_)
                               : conv2d(x, kernel_, options_.strides.array(), padding_);
  return activation_(y);
}

DType Conv2DLayer::computation_dtype() const { return gemm_accumulation_dtype(compute_dtype()); }

const Variable& Conv2DLayer::kernel() const {
  return detail::built_weight(*this, kernel_, "kernel");
}

const Variable& Conv2DLayer::bias() const {
  return detail::built_bias(*this, bias_, options_.use_bias);
}

LayerPtr<Conv2DLayer> Conv2D(std::int64_t filters, Size2 kernel_size, Conv2DOptions options) {
  return make_layer<Conv2DLayer>(filters, kernel_size, std::move(options));
}

// --- Pooling -------------------------------------------------------------------------------

Pooling2DLayer::Pooling2DLayer(Kind kind, PoolingOptions options)
    : Layer(detail::common_options(options),
            kind == Kind::Max ? "MaxPooling2D" : "AveragePooling2D"),
      kind_(kind),
      options_(std::move(options)),
      padding_(parse_padding(options_.padding)) {
  check_size(*this, "pool_size", options_.pool_size);
  if (options_.strides) check_size(*this, "strides", *options_.strides);
  set_input_spec(InputSpec{.rank = 4});
}

Tensor Pooling2DLayer::call(const Tensor& x, const CallContext&) {
  const Size2 strides = options_.strides.value_or(options_.pool_size);
  if (kind_ == Kind::Max)
    return max_pool2d(x, options_.pool_size.array(), strides.array(), padding_);
  return avg_pool2d(x, options_.pool_size.array(), strides.array(), padding_);
}

std::optional<Shape> Pooling2DLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() != 4)
    throw ShapeError(fmt::format("expected an NHWC input of rank 4; got shape {}", input_shape));
  const Size2 strides = options_.strides.value_or(options_.pool_size);
  return Shape{input_shape[0],
               window_output_extent(input_shape[1], options_.pool_size.h, strides.h, padding_),
               window_output_extent(input_shape[2], options_.pool_size.w, strides.w, padding_),
               input_shape[3]};
}

LayerPtr<Pooling2DLayer> MaxPooling2D(PoolingOptions options) {
  return make_layer<Pooling2DLayer>(Pooling2DLayer::Kind::Max, std::move(options));
}

LayerPtr<Pooling2DLayer> AveragePooling2D(PoolingOptions options) {
  return make_layer<Pooling2DLayer>(Pooling2DLayer::Kind::Average, std::move(options));
}

GlobalAveragePooling2DLayer::GlobalAveragePooling2DLayer(LayerOptions options)
    : Layer(std::move(options), "GlobalAveragePooling2D") {
  set_input_spec(InputSpec{.rank = 4});
}

Tensor GlobalAveragePooling2DLayer::call(const Tensor& x, const CallContext&) {
  return mean(x, {1, 2});
}

std::optional<Shape> GlobalAveragePooling2DLayer::compute_output_shape(
    const Shape& input_shape) const {
  if (input_shape.rank() != 4)
    throw ShapeError(fmt::format("expected an NHWC input of rank 4; got shape {}", input_shape));
  return Shape{input_shape[0], input_shape[3]};
}

LayerPtr<GlobalAveragePooling2DLayer> GlobalAveragePooling2D(LayerOptions options) {
  return make_layer<GlobalAveragePooling2DLayer>(std::move(options));
}

}  // namespace mixtape::layers
