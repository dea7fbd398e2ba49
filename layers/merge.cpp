// Merge layers: Add, Subtract, Multiply, Average, Maximum, Minimum, Concatenate, Dot.
#include "mixtape/layers/merge.h"

#include <fmt/ranges.h>

#include "layers/config_util.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/compute_mode.h"

namespace mixtape::layers {

namespace {

// "[None, 4] and [None, 5]" / "[None, 4], [None, 4] and [None, 5]".
std::string shapes_text(const std::vector<Shape>& shapes) {
  std::string out;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    if (i) out += i + 1 == shapes.size() ? " and " : ", ";
    out += detail::shape_with_none(shapes[i]);
  }
  return out;
}

std::vector<Shape> shapes_of(const std::vector<TensorSpec>& specs) {
  std::vector<Shape> out;
  for (const auto& s : specs) out.push_back(s.shape);
  return out;
}

// Every input in the compute dtype: floating ones are cast by Layer already; integer and
// boolean ones are cast here, so that inputs of mixed dtypes merge in one.
std::vector<Tensor> in_dtype(const std::vector<Tensor>& xs, DType dtype) {
  std::vector<Tensor> out;
  for (const Tensor& x : xs) out.push_back(x.dtype() == dtype ? x : cast(x, dtype));
  return out;
}

const char* kind_name(ElementwiseMergeLayer::Kind kind) {
  using K = ElementwiseMergeLayer::Kind;
  switch (kind) {
    case K::Add:
      return "Add";
    case K::Subtract:
      return "Subtract";
    case K::Multiply:
      return "Multiply";
    case K::Average:
      return "Average";
    case K::Maximum:
      return "Maximum";
    case K::Minimum:
      return "Minimum";
  }
  return "?";
}

}  // namespace

// --- Add, Subtract, Multiply, Average, Maximum, Minimum ----------------------------------

ElementwiseMergeLayer::ElementwiseMergeLayer(Kind kind, LayerOptions options)
    : Layer(std::move(options), kind_name(kind)), kind_(kind) {}

void ElementwiseMergeLayer::check_shapes(const std::vector<Shape>& shapes) const {
  if (kind_ == Kind::Subtract && shapes.size() != 2)
    throw ValueError(fmt::format("takes exactly 2 inputs; got {}", shapes.size()));
  if (shapes.size() < 2)
    throw ValueError(
        fmt::format("takes at least 2 inputs (call it on a vector: {}()({{a, b}})); "
                    "got {}",
                    class_name(), shapes.size()));
  for (const Shape& s : shapes)
    if (s != shapes.front())
      throw ShapeError(fmt::format("inputs must have one shape; got {}", shapes_text(shapes)));
}

void ElementwiseMergeLayer::build_multi(const std::vector<Shape>& input_shapes) {
  check_shapes(input_shapes);
}

std::optional<std::vector<TensorSpec>> ElementwiseMergeLayer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  check_shapes(shapes_of(inputs));
  return std::vector<TensorSpec>{TensorSpec{inputs.front().shape, compute_dtype()}};
}

std::vector<Tensor> ElementwiseMergeLayer::call_multi(const std::vector<Tensor>& inputs_in,
                                                      const CallContext&) {
  std::vector<Shape> shapes;
  for (const Tensor& x : inputs_in) shapes.push_back(x.shape());
  check_shapes(shapes);
  const std::vector<Tensor> xs = in_dtype(inputs_in, compute_dtype());
  Tensor y = xs.front();
  for (std::size_t i = 1; i < xs.size(); ++i) {
    switch (kind_) {
      case Kind::Add:
      case Kind::Average:
        y = y + xs[i];
        break;
      case Kind::Subtract:
        y = y - xs[i];
        break;
      case Kind::Multiply:
        y = y * xs[i];
        break;
      case Kind::Maximum:
        y = maximum(y, xs[i]);
        break;
      case Kind::Minimum:
        y = minimum(y, xs[i]);
        break;
    }
  }
  if (kind_ == Kind::Average) y = y * (1.0 / static_cast<double>(xs.size()));
  return {y};
}

namespace {
LayerPtr<ElementwiseMergeLayer> merge(ElementwiseMergeLayer::Kind kind, LayerOptions options) {
  return make_layer<ElementwiseMergeLayer>(kind, std::move(options));
}
using Kind = ElementwiseMergeLayer::Kind;
}  // namespace

LayerPtr<ElementwiseMergeLayer> Add(LayerOptions o) { return merge(Kind::Add, std::move(o)); }
LayerPtr<ElementwiseMergeLayer> Subtract(LayerOptions o) {
  return merge(Kind::Subtract, std::move(o));
}
LayerPtr<ElementwiseMergeLayer> Multiply(LayerOptions o) {
  return merge(Kind::Multiply, std::move(o));
}
LayerPtr<ElementwiseMergeLayer> Average(LayerOptions o) {
  return merge(Kind::Average, std::move(o));
}
LayerPtr<ElementwiseMergeLayer> Maximum(LayerOptions o) {
  return merge(Kind::Maximum, std::move(o));
}
LayerPtr<ElementwiseMergeLayer> Minimum(LayerOptions o) {
  return merge(Kind::Minimum, std::move(o));
}

// --- Concatenate ----------------------------------------------------------------------------

ConcatenateLayer::ConcatenateLayer(ConcatenateOptions options)
    : Layer(detail::common_options(options), "Concatenate"), options_(std::move(options)) {}

Shape ConcatenateLayer::output_shape_for(const std::vector<Shape>& shapes) const {
  if (shapes.size() < 2)
    throw ValueError(fmt::format(
        "takes at least 2 inputs (call it on a vector: Concatenate()({{a, b}})); got {}",
        shapes.size()));
  const std::size_t rank = shapes.front().rank();
  for (const Shape& s : shapes)
    if (s.rank() != rank || rank == 0)
      throw ShapeError(
          fmt::format("inputs must have one rank (>= 1); got {}", shapes_text(shapes)));
  const auto axis = static_cast<std::size_t>(normalize_axis(options_.axis, rank, "Concatenate"));
  std::vector<std::int64_t> dims = shapes.front().dims();
  dims[axis] = 0;
  for (const Shape& s : shapes) {
    for (std::size_t a = 0; a < rank; ++a)
      if (a != axis && s[a] != shapes.front()[a])
        throw ShapeError(fmt::format(
            "inputs must agree on every axis but the concatenation axis {}; got {} (axis {} "
            "differs)",
            options_.axis, shapes_text(shapes), a));
    dims[axis] = dims[axis] < 0 || s[axis] < 0 ? -1 : dims[axis] + s[axis];
  }
  return Shape(dims);
}

void ConcatenateLayer::build_multi(const std::vector<Shape>& input_shapes) {
  output_shape_for(input_shapes);
}

std::optional<std::vector<TensorSpec>> ConcatenateLayer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  return std::vector<TensorSpec>{TensorSpec{output_shape_for(shapes_of(inputs)), compute_dtype()}};
}

std::vector<Tensor> ConcatenateLayer::call_multi(const std::vector<Tensor>& inputs,
                                                 const CallContext&) {
  std::vector<Shape> shapes;
  for (const Tensor& x : inputs) shapes.push_back(x.shape());
  output_shape_for(shapes);
  return {concat(in_dtype(inputs, compute_dtype()), options_.axis)};
}

LayerPtr<ConcatenateLayer> Concatenate(ConcatenateOptions options) {
  return make_layer<ConcatenateLayer>(std::move(options));
}

// --- Dot --------------------------------------------------------------------------------------

DotLayer::DotLayer(std::vector<int> axes, DotOptions options)
    : Layer(detail::common_options(options), "Dot"),
      axes_(std::move(axes)),
      options_(std::move(options)) {
  if (axes_.empty() || axes_.size() > 2)
    throw ValueError(fmt::format(
        "layer '{}' (Dot): axes must be {{a}} (the same axis of both inputs) or {{a, b}}; got {} "
        "axes",
        name(), axes_.size()));
  for (int a : axes_)
    if (a == 0)
      throw ValueError(fmt::format(
          "layer '{}' (Dot): axis 0 is the batch axis and cannot be a dot axis", name()));
}

DType DotLayer::computation_dtype() const { return gemm_accumulation_dtype(compute_dtype()); }

std::pair<int, int> DotLayer::checked_axes(const std::vector<Shape>& shapes) const {
  if (shapes.size() != 2)
    throw ValueError(
        fmt::format("takes exactly 2 inputs (call it on a vector: Dot({{1}})({{a, "
                    "b}})); got {}",
                    shapes.size()));
  const Shape& a = shapes[0];
  const Shape& b = shapes[1];
  for (const Shape& s : shapes)
    if (s.rank() != 2 && s.rank() != 3)
      throw ShapeError(
          fmt::format("takes inputs of rank 2 or 3 ([batch, d] or [batch, p, q]); got "
                      "{}",
                      shapes_text(shapes)));
  const int ax = normalize_axis(axes_.front(), a.rank(), "Dot");
  const int bx = normalize_axis(axes_.back(), b.rank(), "Dot");
  if (ax == 0 || bx == 0)
    throw ValueError(fmt::format("axis 0 is the batch axis and cannot be a dot axis; axes {}",
                                 fmt::join(axes_, ", ")));
  if (a[0] >= 0 && b[0] >= 0 && a[0] != b[0])
    throw ShapeError(fmt::format("the inputs' batch sizes differ: {}", shapes_text(shapes)));
  if (a[static_cast<std::size_t>(ax)] != b[static_cast<std::size_t>(bx)])
    throw ShapeError(
        fmt::format("axis {} of the first input and axis {} of the second must be "
                    "equal; got {}",
                    ax, bx, shapes_text(shapes)));
  return {ax, bx};
}

void DotLayer::build_multi(const std::vector<Shape>& input_shapes) { checked_axes(input_shapes); }

std::optional<std::vector<TensorSpec>> DotLayer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  const std::vector<Shape> shapes = shapes_of(inputs);
  const auto [ax, bx] = checked_axes(shapes);
  std::vector<std::int64_t> dims;
  for (std::size_t i = 0; i < shapes[0].rank(); ++i)
    if (static_cast<int>(i) != ax) dims.push_back(shapes[0][i]);
  for (std::size_t i = 1; i < shapes[1].rank(); ++i)
    if (static_cast<int>(i) != bx) dims.push_back(shapes[1][i]);
  if (dims.size() == 1) dims.push_back(1);  // [n, d] . [n, d] -> [n, 1]
  return std::vector<TensorSpec>{TensorSpec{Shape(dims), compute_dtype()}};
}

std::vector<Tensor> DotLayer::call_multi(const std::vector<Tensor>& inputs, const CallContext&) {
  const auto [ax, bx] = checked_axes({inputs[0].shape(), inputs[1].shape()});
  std::vector<Tensor> xs = in_dtype(inputs, compute_dtype());
  if (options_.normalize) {
    // x / sqrt(max(sum(x^2), 1e-12)) along the dot axis, as Keras' l2_normalize; the sum
    // in float32 for 16-bit inputs.
    const int axes[2] = {ax, bx};
    for (std::size_t i = 0; i < 2; ++i) {
      const DType dt = xs[i].dtype();
      const Tensor wide = dt.is_reduced_float() ? cast(xs[i], kFloat32) : xs[i];
      const Tensor ss = sum(square(wide), {axes[i]}, true);
      const Tensor inv = rsqrt(maximum(ss, full({}, 1e-12, ss.dtype(), ss.device())));
      xs[i] = cast(wide * inv, dt);
    }
  }
  // As one batched product [n, m, d] @ [n, d, k]: the first input with its dot axis last,
  // the second with its dot axis first after the batch.
  Tensor a = xs[0].rank() == 2 ? unsqueeze(xs[0], 1) : (ax == 1 ? transpose(xs[0], 1, 2) : xs[0]);
  Tensor b = xs[1].rank() == 2 ? unsqueeze(xs[1], 2) : (bx == 2 ? transpose(xs[1], 1, 2) : xs[1]);
  Tensor y = matmul(a, b);  // [n, m, k]
  const std::int64_t n = y.dim(0);
  if (xs[0].rank() == 2 && xs[1].rank() == 2) return {reshape(y, Shape{n, 1})};
  if (xs[1].rank() == 2) return {squeeze(y, 2)};
  if (xs[0].rank() == 2) return {squeeze(y, 1)};
  return {y};
}

LayerPtr<DotLayer> Dot(std::vector<int> axes, DotOptions options) {
  return make_layer<DotLayer>(std::move(axes), std::move(options));
}

}  // namespace mixtape::layers
