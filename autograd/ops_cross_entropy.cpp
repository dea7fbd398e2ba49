// softmax_cross_entropy: the op softmax_cross_entropy and its backward rule (op
// softmax_cross_entropy_backward).
#include <fmt/format.h>

#include <cmath>

#include "autograd/op_util.h"

namespace mixtape {

Tensor softmax_cross_entropy(const Tensor& logits_in, const Tensor& labels_in) {
  const char* name = op_name(OpId::softmax_cross_entropy);
  detail::check_inputs(name, {logits_in, labels_in});
  const Tensor logits = detail::op_inputs(OpId::softmax_cross_entropy, {logits_in})[0];
  if (logits.rank() < 1 || logits.dim(-1) == 0)
    throw ShapeError(
        fmt::format("{}: logits need a class axis (the last) of at least one class; "
                    "got {}",
                    name, detail::describe({logits})));
  if (!logits.dtype().is_floating())
    throw DTypeError(
        fmt::format("{}: logits must be floating; got {}", name, detail::describe({logits})));
  const Shape& ls = logits.shape();
  const Shape expected(std::vector<std::int64_t>(ls.begin(), ls.end() - 1));
  if (labels_in.shape() != expected)
    throw ShapeError(fmt::format("{}: labels {} do not match logits {} (expected labels {})", name,
                                 detail::describe({labels_in}), detail::describe({logits}),
                                 expected));
  if (labels_in.dtype() != kInt64)
    throw DTypeError(fmt::format("{}: labels must be int64 class indices; got {}", name,
                                 detail::describe({labels_in})));
  const std::int64_t c = logits.dim(-1), n = labels_in.numel();
  const Tensor labels = detail::contiguous_raw(reshape(labels_in, Shape{n}));
  if (labels.device().is_cpu() && n > 0) {
    // Before each replay's kernels read them when a step is captured (mixtape/core/capture.h).
    capture::detail::record_or_run([labels, name, c, n] {
      const auto* p = static_cast<const std::int64_t*>(labels.const_data_ptr());
      for (std::int64_t i = 0; i < n; ++i)
        if (p[i] < 0 || p[i] >= c)
          throw IndexError(
              fmt::format("{}: labels must lie in [0, {}) for {} classes; got {} at "
                          "flat position {}",
                          name, c, c, p[i], i));
    });
  }
  const DType ct = logits.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const auto kernel = detail::kernel_for<kernels::SoftmaxCrossEntropyFn>(
      OpId::softmax_cross_entropy, logits.dtype(), {logits});
  Tensor x;
  {
    NoGradGuard no_grad;
    x = detail::contiguous_raw(reshape(logits, Shape{n, c}));
  }
  Tensor loss = Tensor::empty(Shape{n}, ct, logits.device());
  Tensor lse = Tensor::empty(Shape{n}, ct, logits.device());
  if (n > 0) kernel(x, labels, loss, lse);
  Tensor y;
  {
    NoGradGuard no_grad;
    y = reshape(loss, expected);
  }
  if (should_record({logits}))
    record_op(
        name, {logits}, y,
        [logits, x, labels, lse, c, n](const Tensor& g, const std::vector<bool>&) {
          const Tensor gn = reshape(cast(g, lse.dtype()), Shape{n, 1});
          if (should_record({logits, g})) {
            // A tape records this backward pass (second derivatives): differentiable ops.
            const Tensor p = softmax(cast(reshape(logits, Shape{n, c}), lse.dtype()), -1);
            return detail::Grads{reshape(
                cast((p - one_hot(labels, c, lse.dtype())) * gn, logits.dtype()), logits.shape())};
          }
          const auto backward = detail::kernel_for<kernels::SoftmaxCrossEntropyBackwardFn>(
              OpId::softmax_cross_entropy_backward, x.dtype(), {x});
          Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
          if (n > 0) backward(x, labels, lse, detail::contiguous_raw(reshape(gn, Shape{n})), dx);
          return detail::Grads{reshape(dx, logits.shape())};
        });
  return y;
}

}  // namespace mixtape
