// BatchNormalization and LayerNormalization, with float32 statistics.
#include "mixtape/layers/normalization.h"

#include "layers/config_util.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"

namespace mixtape::layers {

namespace {

// float32 for the 16-bit policies, the variable dtype (float32 / float64) otherwise.
DType stats_dtype(DType variable) { return variable.is_reduced_float() ? kFloat32 : variable; }

// `p` ([c]) reshaped to broadcast against a rank-`rank` input along `axis`.
Tensor along(const Tensor& p, std::size_t rank, int axis) {
  std::vector<std::int64_t> dims(rank, 1);
  dims[static_cast<std::size_t>(axis)] = p.numel();
  return reshape(p, Shape(dims));
}

void check_epsilon(const Layer& layer, double epsilon) {
  if (!(epsilon > 0.0))
    throw ValueError(fmt::format("layer '{}' ({}): epsilon must be positive; got {}", layer.name(),
                                 layer.class_name(), epsilon));
}

}  // namespace

// --- BatchNormalization ----------------------------------------------------------------------

BatchNormalizationLayer::BatchNormalizationLayer(BatchNormalizationOptions options)
    : Layer(detail::common_options(options), "BatchNormalization"), options_(std::move(options)) {
  check_epsilon(*this, options_.epsilon);
  if (!(options_.momentum >= 0.0 && options_.momentum <= 1.0))
    throw ValueError(
        fmt::format("layer '{}' (BatchNormalization): momentum must be in [0, 1]; got {}", name(),
                    options_.momentum));
}

DType BatchNormalizationLayer::param_dtype() const { return stats_dtype(variable_dtype()); }

void BatchNormalizationLayer::build(const Shape& input_shape) {
  const auto rank = static_cast<int>(input_shape.rank());
  if (rank < 1) throw ShapeError("expected an input of rank >= 1; got a scalar");
  axis_ = normalize_axis(options_.axis, input_shape.rank(), "BatchNormalization");
  const std::int64_t c = input_shape[static_cast<std::size_t>(axis_)];
  const WeightOptions trainable{.trainable = true, .dtype = param_dtype(), .autocast = false};
  const WeightOptions state{.trainable = false, .dtype = param_dtype(), .autocast = false};
  if (options_.scale) gamma_ = add_weight("gamma", {c}, options_.gamma_initializer, trainable);
  if (options_.center) beta_ = add_weight("beta", {c}, options_.beta_initializer, trainable);
  moving_mean_ = add_weight("moving_mean", {c}, options_.moving_mean_initializer, state);
  moving_variance_ =
      add_weight("moving_variance", {c}, options_.moving_variance_initializer, state);
  set_input_spec(InputSpec{.rank = rank, .axes = {{axis_, c}}});
}

Tensor BatchNormalizationLayer::call(const Tensor& x, const CallContext& ctx) {
  const DType dt = param_dtype();
  const std::size_t rank = x.rank();
  const double m = options_.momentum;
  // An empty batch has no statistics (its mean would be 0/0): the moving ones are used and
  // left as they are.
  const bool batch_statistics = ctx.training && trainable() && x.numel() > 0;
  if (axis_ == static_cast<int>(rank) - 1) {
    // Channels last (Keras' default): one fused op (mixtape::batch_norm), the statistics and
    // the affine map in param_dtype() (float32; float64 for float64 variables), 16-bit inputs
    // read in float32 inside the op and the result rounded once to the compute dtype.
    const Tensor xs =
        x.dtype() == dt || (x.dtype().is_reduced_float() && dt == kFloat32) ? x : cast(x, dt);
    const Tensor gamma = options_.scale ? Tensor(gamma_) : Tensor();
    const Tensor beta = options_.center ? Tensor(beta_) : Tensor();
    if (!batch_statistics)
      return cast(batch_norm(xs, gamma, beta, moving_mean_, moving_variance_, options_.epsilon),
                  compute_dtype());
    const BatchNormResult r = batch_norm(xs, gamma, beta, options_.epsilon);
    NoGradGuard no_grad;
    moving_mean_.assign(moving_mean_ * m + r.mean * (1.0 - m));
    moving_variance_.assign(moving_variance_ * m + r.variance * (1.0 - m));
    return cast(r.out, compute_dtype());
  }
  Tensor xs = cast(x, dt);
  Tensor mu, var;
  if (batch_statistics) {
    std::vector<int> axes;
    for (int i = 0; i < static_cast<int>(rank); ++i)
      if (i != axis_) axes.push_back(i);
    mu = mean(xs, axes, true);
    // As TensorFlow's moments: no gradient through the mean here. Its exact contribution is
    // zero (d var / d mu = -2 mean(x - mu) = 0), so leaving it out spares a full-size
    // reduction of the backward pass and changes the gradient only by rounding.
    var = mean(square(xs - detach(mu)), axes, true);
    NoGradGuard no_grad;
    const Shape c{moving_mean_.numel()};
    moving_mean_.assign(moving_mean_ * m + reshape(mu, c) * (1.0 - m));
    moving_variance_.assign(moving_variance_ * m + reshape(var, c) * (1.0 - m));
  } else {
    mu = along(moving_mean_, rank, axis_);
    var = along(moving_variance_, rank, axis_);
  }
  // TensorFlow's batch_normalization: y = x * s + (beta - mu * s) with s = gamma /
  // sqrt(var + eps), so that the per-channel work happens on [C] tensors and x meets two
  // full-size ops (and their two backward passes) instead of four.
  Tensor s = rsqrt(var + options_.epsilon);
  if (options_.scale) s = s * along(gamma_, rank, axis_);
  const Tensor shift = options_.center ? along(beta_, rank, axis_) - mu * s : neg(mu * s);
  return cast(xs * s + shift, compute_dtype());
}

LayerPtr<BatchNormalizationLayer> BatchNormalization(BatchNormalizationOptions options) {
  return make_layer<BatchNormalizationLayer>(std::move(options));
}

// --- LayerNormalization ------------------------------------------------------------------

LayerNormalizationLayer::LayerNormalizationLayer(LayerNormalizationOptions options)
    : Layer(detail::common_options(options), "LayerNormalization"), options_(std::move(options)) {
  check_epsilon(*this, options_.epsilon);
}

std::optional<Shape> BatchNormalizationLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() < 1) throw ShapeError("expected an input of rank >= 1; got a scalar");
  return input_shape;
}

std::optional<Shape> LayerNormalizationLayer::compute_output_shape(const Shape& input_shape) const {
  if (input_shape.rank() < 1) throw ShapeError("expected an input of rank >= 1; got a scalar");
  return input_shape;
}

DType LayerNormalizationLayer::param_dtype() const { return stats_dtype(variable_dtype()); }

void LayerNormalizationLayer::build(const Shape& input_shape) {
  if (input_shape.rank() < 1) throw ShapeError("expected an input of rank >= 1; got a scalar");
  const std::int64_t c = input_shape.back();
  const WeightOptions opts{.trainable = true, .dtype = param_dtype(), .autocast = false};
  if (options_.scale) gamma_ = add_weight("gamma", {c}, options_.gamma_initializer, opts);
  if (options_.center) beta_ = add_weight("beta", {c}, options_.beta_initializer, opts);
  set_input_spec(InputSpec{.min_rank = 1, .axes = {{-1, c}}});
}

// One fused op (mixtape::layer_norm): the statistics and the affine map in param_dtype()
// (float32; float64 for float64 variables), the result rounded once to the compute dtype.
Tensor LayerNormalizationLayer::call(const Tensor& x, const CallContext&) {
  const Tensor xs =
      x.dtype() == param_dtype() || (x.dtype().is_reduced_float() && param_dtype() == kFloat32)
          ? x  // 16-bit inputs are read in float32 inside the op
          : cast(x, param_dtype());
  return cast(layer_norm(xs, options_.scale ? Tensor(gamma_) : Tensor(),
                         options_.center ? Tensor(beta_) : Tensor(), options_.epsilon),
              compute_dtype());
}

LayerPtr<LayerNormalizationLayer> LayerNormalization(LayerNormalizationOptions options) {
  return make_layer<LayerNormalizationLayer>(std::move(options));
}

}  // namespace mixtape::layers
