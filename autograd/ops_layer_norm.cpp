// layer_norm: the op layer_norm and its backward rule (op layer_norm_backward).
#include <fmt/format.h>

#include <cmath>

#include "autograd/op_util.h"

namespace mixtape {

Tensor layer_norm(const Tensor& x_in, const Tensor& gamma_in, const Tensor& beta_in,
                  double epsilon) {
  const char* name = op_name(OpId::layer_norm);
  const Tensor x = detail::normalization_input(OpId::layer_norm, x_in, epsilon);
  const std::int64_t n = x.dim(-1), rows = n == 0 ? 0 : x.numel() / n;
  const DType ct = x.dtype() == kFloat64 ? kFloat64 : kFloat32;
  // gamma and beta in the compute type (a differentiable cast: their gradients go back).
  const Tensor gamma = detail::per_column_input(name, "gamma", gamma_in, x, n, ct);
  const Tensor beta = detail::per_column_input(name, "beta", beta_in, x, n, ct);
  const auto kernel = detail::kernel_for<kernels::LayerNormFn>(OpId::layer_norm, x.dtype(), {x});
  const Tensor xc = detail::contiguous_raw(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  Tensor mean = Tensor::empty(Shape{rows}, ct, x.device());
  Tensor rstd = Tensor::empty(Shape{rows}, ct, x.device());
  const Tensor gk = gamma.defined() ? detail::contiguous_raw(gamma) : Tensor();
  const Tensor bk = beta.defined() ? detail::contiguous_raw(beta) : Tensor();
  if (out.numel() > 0) kernel(xc, gk, bk, epsilon, out, mean, rstd);
  std::vector<Tensor> inputs{x};
  if (gamma.defined()) inputs.push_back(gamma);
  if (beta.defined()) inputs.push_back(beta);
  if (should_record(inputs))
    record_op(name, inputs, out,
              [x, xc, gamma, gk, beta, mean, rstd, n, epsilon](const Tensor& g,
                                                               const std::vector<bool>&) {
                if (should_record(std::vector<Tensor>{x, g})) {
                  // A tape records this backward pass (second derivatives): the same
                  // gradients from differentiable ops.
                  const DType ct = mean.dtype();
                  const Tensor xs = cast(x, ct), gs = cast(g, ct);
                  const Tensor c = xs - mixtape::mean(xs, {-1}, true);
                  const Tensor r = rsqrt(mixtape::mean(square(c), {-1}, true) + epsilon);
                  const Tensor xhat = c * r;
                  const Tensor gg = gamma.defined() ? gs * gamma : gs;
                  const Tensor dx = r * (gg - mixtape::mean(gg, {-1}, true) -
                                         xhat * mixtape::mean(gg * xhat, {-1}, true));
                  return detail::normalization_grads(
                      cast(dx, x.dtype()),
                      gamma.defined() ? sum(reshape(gs * xhat, Shape{-1, n}), {0}) : Tensor(),
                      beta.defined() ? sum(reshape(gs, Shape{-1, n}), {0}) : Tensor());
                }
                const auto backward = detail::kernel_for<kernels::LayerNormBackwardFn>(
                    OpId::layer_norm_backward, x.dtype(), {x});
                Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
                Tensor dgamma =
                    gamma.defined() ? Tensor::empty(Shape{n}, mean.dtype(), x.device()) : Tensor();
                Tensor dbeta =
                    beta.defined() ? Tensor::empty(Shape{n}, mean.dtype(), x.device()) : Tensor();
                if (dx.numel() > 0) {
                  backward(xc, gk, mean, rstd, detail::contiguous_raw(cast(g, x.dtype())), dx,
                           dgamma, dbeta);
                } else {
                  for (Tensor* t : {&dgamma, &dbeta})
                    if (t->defined() && t->numel() > 0) detail::fill_raw(*t, 0.0);
                }
                return detail::normalization_grads(dx, dgamma, dbeta);
              });
  return out;
}

}  // namespace mixtape
