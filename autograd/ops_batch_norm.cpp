// batch_norm: the op batch_norm and its backward rule (op batch_norm_backward).
#include <fmt/format.h>

#include <cmath>

#include "autograd/op_util.h"

namespace mixtape {

namespace {
// The backward pass as differentiable ops, for a tape that records it (second derivatives):
// x and g viewed as [rows, n]; the batch's statistics found again, or the given ones (which
// take no gradient).
detail::Grads composed_batch_norm_backward(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                                           const Tensor& g, double epsilon,
                                           const Tensor& given_mean, const Tensor& given_var) {
  const std::int64_t n = x.dim(-1);
  const DType ct = given_mean.dtype();
  const Tensor xs = reshape(cast(x, ct), Shape{-1, n}), gs = reshape(cast(g, ct), Shape{-1, n});
  const bool given = given_var.defined();
  const Tensor c = xs - (given ? given_mean : mean(xs, {0}, true));
  const Tensor r = rsqrt((given ? given_var : mean(square(c), {0}, true)) + epsilon);
  const Tensor xhat = c * r;
  const Tensor gg = gamma.defined() ? gs * gamma : gs;
  const Tensor dx =
      given ? r * gg : r * (gg - mean(gg, {0}, true) - xhat * mean(gg * xhat, {0}, true));
  return detail::normalization_grads(cast(reshape(dx, x.shape()), x.dtype()),
                                     gamma.defined() ? sum(gs * xhat, {0}) : Tensor(),
                                     beta.defined() ? sum(gs, {0}) : Tensor());
}

// Both forms: the batch's statistics (mean_in undefined: computed, returned) or given ones.
BatchNormResult batch_norm_impl(const Tensor& x_in, const Tensor& gamma_in, const Tensor& beta_in,
                                const Tensor& mean_in, const Tensor& var_in, double epsilon) {
  const char* name = op_name(OpId::batch_norm);
  const bool given = mean_in.defined();
  const Tensor x = detail::normalization_input(OpId::batch_norm, x_in, epsilon);
  const std::int64_t n = x.dim(-1);
  if (x.numel() == 0 && !given)
    throw ValueError(fmt::format(
        "{}: an empty batch has no statistics (at least one row and one column); got {}", name,
        detail::describe({x})));
  const DType ct = x.dtype() == kFloat64 ? kFloat64 : kFloat32;
  // The per-column inputs in the compute type (a differentiable cast for gamma and beta: their
  // gradients go back; the statistics are read as values).
  const auto per_column = [&](const Tensor& p, const char* what) {
    return detail::per_column_input(name, what, p, x, n, ct);
  };
  const Tensor gamma = per_column(gamma_in, "gamma"), beta = per_column(beta_in, "beta");
  BatchNormResult r{Tensor::empty(x.shape(), x.dtype(), x.device()), Tensor(), Tensor()};
  if (given) {
    NoGradGuard no_grad;
    r.mean = detail::contiguous_raw(per_column(detach(mean_in), "mean"));
    r.variance = detail::contiguous_raw(per_column(detach(var_in), "variance"));
  } else {
    r.mean = Tensor::empty(Shape{n}, ct, x.device());
    r.variance = Tensor::empty(Shape{n}, ct, x.device());
  }
  const auto kernel = detail::kernel_for<kernels::BatchNormFn>(OpId::batch_norm, x.dtype(), {x});
  const Tensor xc = detail::contiguous_raw(x);
  const Tensor gk = gamma.defined() ? detail::contiguous_raw(gamma) : Tensor();
  const Tensor bk = beta.defined() ? detail::contiguous_raw(beta) : Tensor();
  if (x.numel() > 0) kernel(xc, gk, bk, epsilon, given, r.out, r.mean, r.variance);
  std::vector<Tensor> inputs{x};
  if (gamma.defined()) inputs.push_back(gamma);
  if (beta.defined()) inputs.push_back(beta);
  if (should_record(inputs))
    record_op(name, inputs, r.out,
              [x, xc, gamma, gk, beta, mean = r.mean, var = r.variance, n, epsilon, given](
                  const Tensor& g, const std::vector<bool>&) {
                if (should_record(std::vector<Tensor>{x, g}))
                  return composed_batch_norm_backward(x, gamma, beta, g, epsilon, mean,
                                                      given ? var : Tensor());
                const auto backward = detail::kernel_for<kernels::BatchNormBackwardFn>(
                    OpId::batch_norm_backward, x.dtype(), {x});
                Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
                Tensor dgamma =
                    gamma.defined() ? Tensor::empty(Shape{n}, mean.dtype(), x.device()) : Tensor();
                Tensor dbeta =
                    beta.defined() ? Tensor::empty(Shape{n}, mean.dtype(), x.device()) : Tensor();
                if (x.numel() > 0) {
                  backward(xc, gk, mean, var, epsilon, given,
                           detail::contiguous_raw(cast(g, x.dtype())), dx, dgamma, dbeta);
                } else {  // an empty batch with given statistics: sums of nothing
                  for (Tensor* t : {&dgamma, &dbeta})
                    if (t->defined()) detail::fill_raw(*t, 0.0);
                }
                return detail::normalization_grads(dx, dgamma, dbeta);
              });
  return r;
}
}  // namespace

BatchNormResult batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                           double epsilon) {
  return batch_norm_impl(x, gamma, beta, Tensor(), Tensor(), epsilon);
}

Tensor batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                  const Tensor& variance, double epsilon) {
  if (!mean.defined() || !variance.defined())
    throw ValueError(fmt::format("{}: the given statistics need both a mean and a variance; got {}",
                                 op_name(OpId::batch_norm), detail::describe({mean, variance})));
  return batch_norm_impl(x, gamma, beta, mean, variance, epsilon).out;
}

}  // namespace mixtape
