// The core layers: Input, Dense, Activation, Flatten, Reshape, Slice, Dropout, Embedding.
//
// Each layer is a class (DenseLayer, ...) and a function of the Keras name that makes one
// and returns a LayerPtr (Dense(64, {.activation = "relu"})). Options structs end with the
// common fields dtype, name, trainable, in that order.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>

#include "mixtape/layers/activations.h"
#include "mixtape/layers/initializers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"

namespace mixtape::layers {

// --- Input ------------------------------------------------------------------------------

struct InputOptions {
  DType dtype = kFloat32;  // the dtype the model is fed
  std::string name = {};   // empty: "input", "input_1", ...
};

// The layer behind Input(): passes its input through, after checking it has the declared
// shape (any batch size).
class InputLayer : public Layer {
 public:
  InputLayer(const Shape& shape, InputOptions options = {});
  // Adds "shape" (without the batch axis) and "input_dtype".
  Config get_config() const override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const override;
  std::string class_name() const override { return "InputLayer"; }
  const Shape& input_shape() const { return shape_; }  // without the batch axis
  DType input_dtype() const { return dtype_; }
  std::optional<DType> integer_input_dtype() const override { return dtype_; }

 protected:
  bool autocast_inputs() const override { return false; }

 private:
  Shape shape_;
  DType dtype_;
};

// A symbolic input of shape [batch, shape...] for a functional model.
SymbolicTensor Input(const Shape& shape, InputOptions options = {});

// --- Dense ------------------------------------------------------------------------------

struct DenseOptions {
  std::string activation = "linear";
  bool use_bias = true;
  init::Initializer kernel_initializer = init::glorot_uniform();
  init::Initializer bias_initializer = init::zeros();
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(DenseOptions, activation, use_bias, kernel_initializer, bias_initializer);

// y = activation(x @ kernel + bias) over the last axis: [..., in] -> [..., units]. With an
// activation mt::linear applies (linear, relu, gelu, gelu_tanh) and a bias or an activation,
// one fused op computes it (the result rounded once; Layer::policy_linear says when the
// composed ops do). The dtype trace's note says which ran.
class DenseLayer : public Layer {
 public:
  explicit DenseLayer(std::int64_t units, DenseOptions options = {});
  const DenseOptions& options() const { return options_; }
  void build(const Shape& input_shape) override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  DType computation_dtype() const override;

  std::int64_t units() const { return units_; }
  // The weights (stored in the variable dtype); throw ValueError before the layer is built.
  const Variable& kernel() const;
  const Variable& bias() const;  // also when use_bias is false

 private:
  std::int64_t units_;
  DenseOptions options_;
  Variable kernel_, bias_;
  std::optional<Float8State> float8_;  // mixed_float8_delayed: the amax histories
};
LayerPtr<DenseLayer> Dense(std::int64_t units, DenseOptions options = {});

// --- Activation -------------------------------------------------------------------------

// An activation by name: linear, relu, sigmoid, tanh, softmax, log_softmax, gelu. With
// {.dtype = "float32"} it is how a mixed model ends in float32, as the guide advises.
class ActivationLayer : public Layer {
 public:
  explicit ActivationLayer(const std::string& activation, LayerOptions options = {});
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  const std::string& activation() const { return activation_name_; }

 private:
  std::string activation_name_;
  activations::ActivationFn activation_;
};
LayerPtr<ActivationLayer> Activation(const std::string& activation, LayerOptions options = {});

// --- Flatten, Reshape ---------------------------------------------------------------------

// [batch, a, b, ...] -> [batch, a * b * ...].
class FlattenLayer : public Layer {
 public:
  explicit FlattenLayer(LayerOptions options = {});
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
};
LayerPtr<FlattenLayer> Flatten(LayerOptions options = {});

// [batch, ...] -> [batch, target...]; one extent of the target may be -1.
class ReshapeLayer : public Layer {
 public:
  explicit ReshapeLayer(const Shape& target_shape, LayerOptions options = {});
  const Shape& target_shape() const { return target_; }
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;

 private:
  Shape target_;
};
LayerPtr<ReshapeLayer> Reshape(const Shape& target_shape, LayerOptions options = {});

// --- Slice --------------------------------------------------------------------------------

struct SliceOptions {
  std::optional<std::int64_t> stop = {};  // empty: to the end of the axis
  bool squeeze = false;  // drop the axis (the slice must be 1 long): x[:, -1] not x[:, -1:]
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(SliceOptions, stop, squeeze);

// x[start:stop] along `axis` of the input (not the batch axis 0; negative counts from the
// last axis), start and stop counting from the end of the axis when negative, as Python's
// slices (but out of range is a ShapeError, not clipped). Slice(1, -1, {.squeeze = true})
// takes the last time step of a sequence [n, T, d]: [n, d]. Differentiable; integer inputs
// pass as they are.
class SliceLayer : public Layer {
 public:
  SliceLayer(int axis, std::int64_t start, SliceOptions options = {});
  int axis() const { return axis_; }
  std::int64_t start() const { return start_; }
  const SliceOptions& options() const { return options_; }
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;

 private:
  // The axis and the [start, stop) range for an input of `shape`; ShapeError otherwise.
  std::tuple<int, std::int64_t, std::int64_t> range(const Shape& shape) const;
  int axis_;
  std::int64_t start_;
  SliceOptions options_;
};
LayerPtr<SliceLayer> Slice(int axis, std::int64_t start, SliceOptions options = {});

// --- Dropout ------------------------------------------------------------------------------

struct DropoutOptions {
  std::optional<std::uint64_t> seed = {};  // empty: drawn from the default generator
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(DropoutOptions, seed);

// While training, zeroes each element with probability `rate` and scales the rest by
// 1 / (1 - rate) (the op mixtape::dropout, its seed drawn from the layer's generator with
// draw_seed: a captured step draws a new mask at each replay); the identity otherwise.
class DropoutLayer : public Layer {
 public:
  explicit DropoutLayer(double rate, DropoutOptions options = {});
  const DropoutOptions& options() const { return options_; }
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  double rate() const { return rate_; }

 private:
  double rate_;
  DropoutOptions options_;
  Generator generator_;
};
LayerPtr<DropoutLayer> Dropout(double rate, DropoutOptions options = {});

// --- Embedding ------------------------------------------------------------------------------

struct EmbeddingOptions {
  init::Initializer embeddings_initializer = init::random_uniform(-0.05, 0.05);
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(EmbeddingOptions, embeddings_initializer);

// Integer ids [...] -> rows of a [input_dim, output_dim] table: [..., output_dim]. Floating
// ids are truncated toward zero (as Keras casts them); ids outside [0, input_dim), NaN and
// infinities throw IndexError naming the flat position and the value of the first.
class EmbeddingLayer : public Layer {
 public:
  EmbeddingLayer(std::int64_t input_dim, std::int64_t output_dim, EmbeddingOptions options = {});
  std::int64_t input_dim() const { return input_dim_; }
  std::int64_t output_dim() const { return output_dim_; }
  const EmbeddingOptions& options() const { return options_; }
  void build(const Shape& input_shape) override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  // [..., output_dim] in the compute dtype, for ids of any dtype.
  std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const override;
  const Variable& embeddings() const;
  // Integer ids reach it as they are, also as a model's first layer.
  std::optional<DType> integer_input_dtype() const override { return std::nullopt; }

 protected:
  bool autocast_inputs() const override { return false; }

 private:
  std::int64_t input_dim_, output_dim_;
  EmbeddingOptions options_;
  Variable embeddings_;
};
LayerPtr<EmbeddingLayer> Embedding(std::int64_t input_dim, std::int64_t output_dim,
                                   EmbeddingOptions options = {});

}  // namespace mixtape::layers
