// The core layers.
#include "mixtape/layers/core_layers.h"

#include "layers/class_indices.h"
#include "layers/config_util.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/compute_mode.h"

namespace mixtape::layers {

namespace {

// The shape of one sample: without the batch axis.
Shape sample_shape(const Shape& s) {
  return Shape(std::vector<std::int64_t>(s.begin() + 1, s.end()));
}

}  // namespace

// --- Input ------------------------------------------------------------------------------

InputLayer::InputLayer(const Shape& shape, InputOptions options)
    : Layer(LayerOptions{Policy(),
                         options.name.empty() ? detail::unique_layer_name("input") : options.name,
                         true},
            "InputLayer"),
      shape_(shape),
      dtype_(options.dtype) {
  for (auto d : shape_)
    if (d < 0)
      throw ValueError(
          fmt::format("Input '{}': extents must be >= 0; got {} (the batch axis is "
                      "implied, do not include it)",
                      name(), shape_));
  InputSpec spec;
  spec.rank = static_cast<int>(shape_.rank()) + 1;
  for (std::size_t i = 0; i < shape_.rank(); ++i)
    spec.axes.emplace_back(static_cast<int>(i) + 1, shape_[i]);
  set_input_spec(std::move(spec));
}

Tensor InputLayer::call(const Tensor& x, const CallContext&) { return x; }

Config InputLayer::get_config() const {
  Config c = Layer::get_config();
  c.set("shape", shape_.dims());
  c.set("input_dtype", std::string(dtype_.name()));
  return c;
}

std::optional<std::vector<TensorSpec>> InputLayer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  return inputs;  // checked against the declared shape when built
}

SymbolicTensor Input(const Shape& shape, InputOptions options) {
  auto layer = std::make_shared<InputLayer>(shape, options);
  auto node = std::make_shared<detail::SymbolicNode>();
  std::vector<std::int64_t> dims{-1};
  dims.insert(dims.end(), shape.begin(), shape.end());
  node->layer = layer;
  node->outputs.push_back(TensorSpec{Shape(dims), options.dtype});
  return SymbolicTensor::output_of(node, 0);
}

// --- Dense ------------------------------------------------------------------------------

DenseLayer::DenseLayer(std::int64_t units, DenseOptions options)
    : Layer(detail::common_options(options), "Dense"), units_(units), options_(std::move(options)) {
  (void)activations::get(options_.activation);  // an unknown name throws here, not at the call
  if (units_ <= 0)
    throw ValueError(
        fmt::format("layer '{}' (Dense): units must be positive; got {}", name(), units_));
}

void DenseLayer::build(const Shape& input_shape) {
  if (input_shape.rank() < 2)
    throw ShapeError(fmt::format(
        "expected an input of rank >= 2 ([batch, ..., features]); got shape {}", input_shape));
  const std::int64_t in = input_shape.back();
  kernel_ = add_weight("kernel", {in, units_}, options_.kernel_initializer);
  if (options_.use_bias) bias_ = add_weight("bias", {units_}, options_.bias_initializer);
  float8_ = add_float8_state();
  set_input_spec(InputSpec{.min_rank = 2, .axes = {{-1, in}}});
}

std::optional<Shape> DenseLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() < 2)
    throw ShapeError(fmt::format(
        "expected an input of rank >= 2 ([batch, ..., features]); got shape {}", input_shape));
  std::vector<std::int64_t> dims = input_shape.dims();
  dims.back() = units_;
  return Shape(dims);
}

Tensor DenseLayer::call(const Tensor& x, const CallContext& ctx) {
  return policy_linear(x, kernel_, options_.use_bias ? Tensor(bias_) : Tensor(),
                       options_.activation, float8_, ctx.training);
}

DType DenseLayer::computation_dtype() const { return gemm_accumulation_dtype(compute_dtype()); }

const Variable& DenseLayer::kernel() const {
  return detail::built_weight(*this, kernel_, "kernel");
}
const Variable& DenseLayer::bias() const {
  return detail::built_bias(*this, bias_, options_.use_bias);
}

LayerPtr<DenseLayer> Dense(std::int64_t units, DenseOptions options) {
  return make_layer<DenseLayer>(units, std::move(options));
}

// --- Activation -------------------------------------------------------------------------

ActivationLayer::ActivationLayer(const std::string& activation, LayerOptions options)
    : Layer(std::move(options), "Activation"),
      activation_name_(activation),
      activation_(activations::get(activation)) {}

Tensor ActivationLayer::call(const Tensor& x, const CallContext&) { return activation_(x); }

std::optional<Shape> ActivationLayer::compute_output_shape(const Shape& input_shape) const {
  return input_shape;
}

LayerPtr<ActivationLayer> Activation(const std::string& activation, LayerOptions options) {
  return make_layer<ActivationLayer>(activation, std::move(options));
}

// --- Flatten, Reshape ---------------------------------------------------------------------

FlattenLayer::FlattenLayer(LayerOptions options) : Layer(std::move(options), "Flatten") {
  set_input_spec(InputSpec{.min_rank = 1});
}

Tensor FlattenLayer::call(const Tensor& x, const CallContext&) {
  if (x.rank() == 1) return reshape(x, Shape{x.dim(0), 1});
  return flatten(x, 1);
}

std::optional<Shape> FlattenLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() < 1) throw ShapeError("expected an input of rank >= 1; got a scalar");
  return Shape{input_shape[0], checked_numel(sample_shape(input_shape), "Flatten")};
}

LayerPtr<FlattenLayer> Flatten(LayerOptions options) {
  return make_layer<FlattenLayer>(std::move(options));
}

ReshapeLayer::ReshapeLayer(const Shape& target_shape, LayerOptions options)
    : Layer(std::move(options), "Reshape"), target_(target_shape) {
  int inferred = 0;
  for (auto d : target_) {
    if (d == -1) ++inferred;
    if (d < -1 || inferred > 1)
      throw ValueError(
          fmt::format("layer '{}' (Reshape): bad target shape {} (extents >= 0, at "
                      "most one -1)",
                      name(), target_));
  }
  set_input_spec(InputSpec{.min_rank = 1});
}

Tensor ReshapeLayer::call(const Tensor& x, const CallContext&) {
  std::vector<std::int64_t> dims{x.dim(0)};
  dims.insert(dims.end(), target_.begin(), target_.end());
  return reshape(x, Shape(dims));
}

std::optional<Shape> ReshapeLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() < 1) throw ShapeError("expected an input of rank >= 1; got a scalar");
  const std::int64_t have = checked_numel(sample_shape(input_shape), "Reshape");
  std::vector<std::int64_t> dims{input_shape[0]}, known;
  std::size_t inferred = 0;
  for (auto d : target_) {
    if (d == -1) inferred = dims.size();
    known.push_back(d == -1 ? 1 : d);
    dims.push_back(d);
  }
  const std::int64_t want = checked_numel(Shape(known), "Reshape");
  if (inferred > 0) {
    if (want == 0 || have % want != 0)
      throw ShapeError(fmt::format("cannot reshape samples of shape {} ({} elements) to {}",
                                   sample_shape(input_shape), have, target_));
    dims[inferred] = have / want;
  } else if (want != have) {
    throw ShapeError(fmt::format("cannot reshape samples of shape {} ({} elements) to {} ({})",
                                 sample_shape(input_shape), have, target_, want));
  }
  return Shape(dims);
}

LayerPtr<ReshapeLayer> Reshape(const Shape& target_shape, LayerOptions options) {
  return make_layer<ReshapeLayer>(target_shape, std::move(options));
}

// --- Slice --------------------------------------------------------------------------------

SliceLayer::SliceLayer(int axis, std::int64_t start, SliceOptions options)
    : Layer(detail::common_options(options), "Slice"),
      axis_(axis),
      start_(start),
      options_(std::move(options)) {
  if (axis_ == 0)
    throw ValueError(fmt::format("layer '{}' (Slice): axis 0 is the batch axis", name()));
  if (axis_ < -64 || axis_ > 64)
    throw ValueError(fmt::format("layer '{}' (Slice): axis {} is out of range", name(), axis_));
  set_input_spec(InputSpec{.min_rank = axis_ > 0 ? axis_ + 1 : std::max(2, -axis_ + 1)});
}

std::tuple<int, std::int64_t, std::int64_t> SliceLayer::range(const Shape& shape) const {
  const auto rank = static_cast<int>(shape.rank());
  const int axis = axis_ < 0 ? axis_ + rank : axis_;
  if (axis <= 0 || axis >= rank)
    throw ShapeError(
        fmt::format("axis {} is not a non-batch axis of an input of rank {}", axis_, rank));
  const std::int64_t n = shape[static_cast<std::size_t>(axis)];
  const std::int64_t start = start_ < 0 ? start_ + n : start_;
  const std::int64_t given_stop = options_.stop.value_or(n);
  const std::int64_t stop = given_stop < 0 ? given_stop + n : given_stop;
  if (start < 0 || start >= n || stop <= start || stop > n)
    throw ShapeError(
        fmt::format("slice [{}:{}] of axis {} (of extent {}) selects nothing or "
                    "reaches past its ends",
                    start_, options_.stop ? fmt::format("{}", *options_.stop) : "", axis_, n));
  if (options_.squeeze && stop - start != 1)
    throw ShapeError(fmt::format("squeeze needs a slice 1 long; [{}:{}] of axis {} is {} long",
                                 start, stop, axis_, stop - start));
  return {axis, start, stop};
}

Tensor SliceLayer::call(const Tensor& x, const CallContext&) {
  const auto [axis, start, stop] = range(x.shape());
  Tensor y = slice(x, axis, start, stop);
  return options_.squeeze ? squeeze(y, axis) : y;
}

std::optional<Shape> SliceLayer::compute_output_shape(const Shape& input_shape) const {
  const auto [axis, start, stop] = range(input_shape);
  std::vector<std::int64_t> dims = input_shape.dims();
  if (options_.squeeze)
    dims.erase(dims.begin() + axis);
  else
    dims[static_cast<std::size_t>(axis)] = stop - start;
  return Shape(dims);
}

LayerPtr<SliceLayer> Slice(int axis, std::int64_t start, SliceOptions options) {
  return make_layer<SliceLayer>(axis, start, std::move(options));
}

// --- Dropout ------------------------------------------------------------------------------

DropoutLayer::DropoutLayer(double rate, DropoutOptions options)
    : Layer(detail::common_options(options), "Dropout"),
      rate_(rate),
      options_(options),
      generator_(options.seed ? *options.seed : default_generator().next_u64()) {
  if (!(rate >= 0.0 && rate < 1.0))
    throw ValueError(
        fmt::format("layer '{}' (Dropout): rate must be in [0, 1); got {}", name(), rate));
}

Tensor DropoutLayer::call(const Tensor& x, const CallContext& ctx) {
  if (!ctx.training || rate_ == 0.0 || !x.dtype().is_floating()) return x;
  // One op, its mask a function of a seed from the layer's generator and each element's
  // position (recomputed by the backward pass, never stored); draw_seed's seed, which a
  // captured step redraws at each replay.
  return dropout(x, rate_, draw_seed(generator_, x.device()));
}

std::optional<Shape> DropoutLayer::compute_output_shape(const Shape& input_shape) const {
  return input_shape;
}

LayerPtr<DropoutLayer> Dropout(double rate, DropoutOptions options) {
  return make_layer<DropoutLayer>(rate, std::move(options));
}

// --- Embedding ------------------------------------------------------------------------------

EmbeddingLayer::EmbeddingLayer(std::int64_t input_dim, std::int64_t output_dim,
                               EmbeddingOptions options)
    : Layer(detail::common_options(options), "Embedding"),
      input_dim_(input_dim),
      output_dim_(output_dim),
      options_(std::move(options)) {
  if (input_dim <= 0 || output_dim <= 0)
    throw ValueError(
        fmt::format("layer '{}' (Embedding): input_dim and output_dim must be "
                    "positive; got {} and {}",
                    name(), input_dim, output_dim));
}

void EmbeddingLayer::build(const Shape&) {
  embeddings_ =
      add_weight("embeddings", {input_dim_, output_dim_}, options_.embeddings_initializer);
}

Tensor EmbeddingLayer::call(const Tensor& ids_in, const CallContext&) {
  // Floating ids that are NaN, infinite or outside [0, input_dim) are refused here, naming
  // the first; integer ones are checked by take.
  const Tensor ids = detail::class_indices("", "ids", ids_in, input_dim_);
  return take(embeddings_, ids, 0);  // [..., output_dim]
}

std::optional<std::vector<TensorSpec>> EmbeddingLayer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  if (inputs.size() != 1) return std::nullopt;
  std::vector<std::int64_t> dims = inputs.front().shape.dims();
  dims.push_back(output_dim_);
  return std::vector<TensorSpec>{TensorSpec{Shape(dims), compute_dtype()}};
}

const Variable& EmbeddingLayer::embeddings() const {
  return detail::built_weight(*this, embeddings_, "embeddings");
}

LayerPtr<EmbeddingLayer> Embedding(std::int64_t input_dim, std::int64_t output_dim,
                                   EmbeddingOptions options) {
  return make_layer<EmbeddingLayer>(input_dim, output_dim, std::move(options));
}

}  // namespace mixtape::layers
