// Merge layers: layers of several inputs, for graphs of layers (residual connections, two
// branches joined, two towers compared).
//
//   auto y = mt::layers::Add()({x, shortcut});                       // x + shortcut
//   auto z = mt::layers::Concatenate({.axis = -1})({a, b});         // [..., na + nb]
//   auto s = mt::layers::Dot({1}, {.normalize = true})({u, v});     // cosine similarity
//
// Every floating input is cast to the layer's compute dtype first (under mixed_float16 all
// of them become float16), and integer or boolean inputs too, so inputs of mixed dtypes
// merge in the dtype the policy says. Errors name the layer and the shapes of every input.
#pragma once

#include <string>
#include <vector>

#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"

namespace mixtape::layers {

// Element-wise merges of two or more inputs of one shape (Subtract: exactly two). The
// shapes must be equal (no broadcasting: a shape that differs is almost always a mistake in
// a graph; put a Reshape in front to make it deliberate).
//   Add: the sum; Subtract: first - second; Multiply: the product; Average: the mean;
//   Maximum / Minimum: element-wise (the gradient goes to the first of equal inputs).
class ElementwiseMergeLayer : public Layer {
 public:
  enum class Kind { Add, Subtract, Multiply, Average, Maximum, Minimum };
  ElementwiseMergeLayer(Kind kind, LayerOptions options = {});
  void build_multi(const std::vector<Shape>& input_shapes) override;
  std::vector<Tensor> call_multi(const std::vector<Tensor>& inputs,
                                 const CallContext& ctx) override;
  std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const override;
  Kind kind() const { return kind_; }

 private:
  void check_shapes(const std::vector<Shape>& shapes) const;
  Kind kind_;
};
LayerPtr<ElementwiseMergeLayer> Add(LayerOptions options = {});
LayerPtr<ElementwiseMergeLayer> Subtract(LayerOptions options = {});
LayerPtr<ElementwiseMergeLayer> Multiply(LayerOptions options = {});
LayerPtr<ElementwiseMergeLayer> Average(LayerOptions options = {});
LayerPtr<ElementwiseMergeLayer> Maximum(LayerOptions options = {});
LayerPtr<ElementwiseMergeLayer> Minimum(LayerOptions options = {});

struct ConcatenateOptions {
  int axis = -1;  // the axis to join along; the others must agree
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(ConcatenateOptions, axis);

// Joins two or more inputs of one rank along `axis`; every other extent must be equal.
class ConcatenateLayer : public Layer {
 public:
  explicit ConcatenateLayer(ConcatenateOptions options = {});
  const ConcatenateOptions& options() const { return options_; }
  void build_multi(const std::vector<Shape>& input_shapes) override;
  std::vector<Tensor> call_multi(const std::vector<Tensor>& inputs,
                                 const CallContext& ctx) override;
  std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const override;
  int axis() const { return options_.axis; }

 private:
  Shape output_shape_for(const std::vector<Shape>& shapes) const;
  ConcatenateOptions options_;
};
LayerPtr<ConcatenateLayer> Concatenate(ConcatenateOptions options = {});

struct DotOptions {
  // L2-normalise each input along its dot axis first (the result is then the cosine
  // similarity).
  bool normalize = false;
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(DotOptions, normalize);

// Per sample, the dot product of two inputs along one axis of each, as Keras' Dot (batch_dot):
// `axes` is {a} for the same axis of both or {a, b}; axis 0 (the batch) cannot be one.
// Inputs of rank 2 or 3: [n, d] . [n, d] -> [n, 1]; [n, p, d] . [n, d, q] (axes {2, 1}) ->
// [n, p, q]; in general the first input's shape without its axis, then the second's without
// the batch and its axis. One batched matrix product.
class DotLayer : public Layer {
 public:
  DotLayer(std::vector<int> axes, DotOptions options = {});
  const DotOptions& options() const { return options_; }
  void build_multi(const std::vector<Shape>& input_shapes) override;
  std::vector<Tensor> call_multi(const std::vector<Tensor>& inputs,
                                 const CallContext& ctx) override;
  std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const override;
  const std::vector<int>& axes() const { return axes_; }
  DType computation_dtype() const override;

 private:
  // The axes of the two inputs, made non-negative, after checking the shapes.
  std::pair<int, int> checked_axes(const std::vector<Shape>& shapes) const;
  std::vector<int> axes_;
  DotOptions options_;
};
LayerPtr<DotLayer> Dot(std::vector<int> axes, DotOptions options = {});

}  // namespace mixtape::layers
