// linear: the op linear (a Dense layer's product, bias and activation in one op) and its
// backward rule (op linear_backward for dz and the bias gradient, then two matmuls).
#include <fmt/format.h>

#include <optional>
#include <string_view>

#include "autograd/op_util.h"

namespace mixtape {

namespace {

using kernels::LinearActivation;

struct NamedActivation {
  std::string_view name;
  LinearActivation activation;
};
constexpr NamedActivation kActivations[] = {{"linear", LinearActivation::none},
                                            {"relu", LinearActivation::relu},
                                            {"gelu", LinearActivation::gelu},
                                            {"gelu_tanh", LinearActivation::gelu_tanh}};

// What the backward pass needs of the forward one.
struct LinearSaved {
  Tensor x, w, bias;  // the recorded inputs: x [..., k], w [k, n], bias in the compute type
  Tensor x2;          // x as a contiguous [m, k]
  Tensor kept;        // linear_backward's saved tensor: pre (gelu, gelu_tanh), out (relu)
  LinearActivation activation;
};

// The gradients of (x, w[, bias]) from g (the output's, [..., n]).
detail::Grads linear_grads(const LinearSaved& s, const Tensor& g_in,
                           const std::vector<bool>& needs) {
  const std::int64_t m = s.x2.dim(0), n = s.w.dim(1);
  const DType dt = s.x2.dtype();
  const Tensor g = reshape(cast(g_in, dt), Shape{m, n});
  Tensor x2 = s.x2, dz, dbias;
  if (should_record(std::vector<Tensor>{s.x, s.w, g})) {
    x2 = reshape(s.x, Shape{m, s.w.dim(0)});
    Tensor z = matmul(x2, s.w);
    if (s.bias.defined()) z = z + cast(s.bias, dt);
    dz = detail::differentiable_activation_grad(s.activation, z, g);
    if (s.bias.defined()) dbias = sum(cast(dz, s.bias.dtype()), {0});
  } else if (s.activation == LinearActivation::none && !s.bias.defined()) {
    dz = g;  // nothing for linear_backward to compute: dz is the output's gradient
  } else {
    const auto backward =
        detail::kernel_for<kernels::LinearBackwardFn>(OpId::linear_backward, dt, {g});
    kernels::LinearBackwardArgs args;
    args.dy = detail::contiguous_raw(g);
    args.saved = s.kept;
    args.activation = s.activation;
    if (s.activation != LinearActivation::none)
      args.dz = Tensor::empty(Shape{m, n}, dt, g.device());
    if (s.bias.defined()) args.dbias = Tensor::empty(Shape{n}, s.bias.dtype(), g.device());
    backward(args);
    dz = args.dz.defined() ? args.dz : args.dy;
    dbias = args.dbias;
  }
  detail::Grads out{needs[0] ? reshape(matmul(dz, transpose(s.w)), s.x.shape()) : Tensor(),
                    needs[1] ? matmul(transpose(x2), dz) : Tensor()};
  if (s.bias.defined()) out.push_back(dbias);
  return out;
}

}  // namespace

namespace detail {

std::optional<LinearActivation> linear_activation_of(std::string_view name) {
  for (const auto& a : kActivations)
    if (a.name == name) return a.activation;
  return std::nullopt;
}

// The activation applied as the composed ops apply it (the empty product's path).
Tensor apply_linear_activation(LinearActivation a, const Tensor& z) {
  switch (a) {
    case LinearActivation::relu:
      return relu(z);
    case LinearActivation::gelu:
      return gelu(z);
    case LinearActivation::gelu_tanh:
      return gelu_tanh(z);
    case LinearActivation::none:
      break;
  }
  return z;
}

// g act'(z) written with differentiable ops: the backward pass when a tape records it (second
// derivatives). The formulas are the unary rules' (autograd/ops_elementwise.cpp).
Tensor differentiable_activation_grad(LinearActivation a, const Tensor& z, const Tensor& g) {
  switch (a) {
    case LinearActivation::relu:
      return g * cast(greater(z, detail::scalar_like(0.0, z)), g.dtype());
    case LinearActivation::gelu: {
      constexpr double kInvSqrt2 = 0.70710678118654752440, kInvSqrt2Pi = 0.39894228040143267794;
      const Tensor cdf = (erf(z * kInvSqrt2) + 1.0) * 0.5;
      return g * (cdf + z * exp(z * z * (-0.5)) * kInvSqrt2Pi);
    }
    case LinearActivation::gelu_tanh: {
      constexpr double kC = 0.79788456080286535588, kA = 0.044715;
      const Tensor z2 = z * z;
      const Tensor s = sigmoid(2.0 * kC * (z + kA * z2 * z));
      return g * (s + z * s * (1.0 - s) * (2.0 * kC) * (1.0 + 3.0 * kA * z2));
    }
    case LinearActivation::none:
      break;
  }
  return g;
}

LinearActivation checked_linear_activation(const char* op, std::string_view name) {
  const auto activation = linear_activation_of(name);
  if (!activation)
    throw ValueError(fmt::format(
        "{}: unknown activation '{}'; it applies linear, relu, gelu or gelu_tanh", op, name));
  return *activation;
}

Tensor checked_linear_bias(const char* op, const Tensor& x, const Tensor& bias, std::int64_t n,
                           DType ct) {
  if (!bias.defined()) return bias;
  check_inputs(op, {x, bias});
  if (bias.rank() != 1 || bias.dim(0) != n || !bias.dtype().is_floating())
    throw ShapeError(fmt::format("{}: bias must be floating [{}] (w's last extent); got {}", op, n,
                                 describe({bias})));
  return bias.dtype() == ct ? bias : cast(bias, ct);  // differentiable
}

Tensor kernel_bias(const Tensor& given, const Tensor& bias, DType out) {
  if (!bias.defined()) return bias;
  NoGradGuard no_grad;  // (nothing recorded, autocast's read included)
  if (given.defined() && given.dtype() == out) return contiguous_raw(given);
  // A layer's float32 bias variable under its policy's autocast: the 16-bit copy autocast keeps
  // of it (mixtape/autograd/autocast.h), which the optimizers write beside their update, so
  // that a training step casts nothing here.
  if (given.defined() && autocast_dtype() == out) {
    const Tensor copy = autocast(given);
    if (copy.dtype() == out) return contiguous_raw(copy);
  }
  return contiguous_raw(bias.dtype() == out ? bias : cast(bias, out));
}

}  // namespace detail

bool is_linear_activation(std::string_view name) {
  return detail::linear_activation_of(name).has_value();
}

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& bias_in,
              std::string_view activation_name) {
  const char* name = op_name(OpId::linear);
  const LinearActivation activation = detail::checked_linear_activation(name, activation_name);
  detail::check_inputs(name, {x_in, w_in});
  const auto in = detail::op_inputs(OpId::linear, {x_in, w_in});
  if (in[0].rank() < 1 || in[1].rank() != 2 || in[1].dim(0) != in[0].dim(-1))
    throw ShapeError(fmt::format("{}: needs x [..., k] and w [k, n]; got x {}, w {}", name,
                                 detail::describe({in[0]}), detail::describe({in[1]})));
  if (!in[0].dtype().is_floating() || !in[1].dtype().is_floating())
    throw DTypeError(fmt::format("{}: needs floating x and w; got x {}, w {}", name,
                                 detail::describe({in[0]}), detail::describe({in[1]})));
  const DType dt = promote_types(in[0].dtype(), in[1].dtype());
  const DType ct = dt == kFloat64 ? kFloat64 : kFloat32;
  const Tensor x = cast(in[0], dt), w = cast(in[1], dt);
  const std::int64_t k = w.dim(0), n = w.dim(1), m = k == 0 ? 0 : x.numel() / k;
  const Tensor bias = detail::checked_linear_bias(name, x, bias_in, n, ct);
  // No product to fuse (an empty sum or an empty result): the composed ops.
  if (m == 0 || n == 0 || k == 0) {
    Tensor z = matmul(x, w);
    return detail::apply_linear_activation(activation, bias.defined() ? z + cast(bias, dt) : z);
  }

  const auto kernel = detail::kernel_for<kernels::LinearFn>(OpId::linear, dt, {x, w});
  std::vector<std::int64_t> out_dims(x.shape().begin(), x.shape().end() - 1);
  out_dims.push_back(n);
  std::vector<Tensor> inputs{x, w};
  if (bias.defined()) inputs.push_back(bias);
  const bool record = should_record(inputs);
  kernels::LinearArgs args;
  {
    NoGradGuard no_grad;  // views for the kernel: nothing to record
    args.x = detail::contiguous_raw(reshape(x, Shape{m, k}));
    args.w = detail::contiguous_raw(w);
  }
  args.bias = detail::kernel_bias(bias_in, bias, dt);
  args.out = Tensor::empty(Shape{m, n}, dt, x.device());
  const bool needs_pre =
      activation == LinearActivation::gelu || activation == LinearActivation::gelu_tanh;
  if (record && needs_pre) args.pre = Tensor::empty(Shape{m, n}, dt, x.device());
  args.activation = activation;
  kernel(args);
  Tensor out;
  {
    NoGradGuard no_grad;
    out = reshape(args.out, Shape(out_dims));
  }
  if (record) {
    LinearSaved saved{x, w, bias, args.x, Tensor(), activation};
    if (needs_pre) saved.kept = args.pre;
    if (activation == LinearActivation::relu) saved.kept = args.out;
    record_op(name, inputs, out, [saved](const Tensor& g, const std::vector<bool>& needs) {
      return linear_grads(saved, g, needs);
    });
  }
  return out;
}

}  // namespace mixtape
