// Reductions and row-wise ops (softmax, log_softmax).
#include <cmath>
#include <limits>

#include "autograd/op_util.h"

namespace mixtape {

using detail::Grads;

namespace {

// Runs a ReduceFn over `axes` (sorted, normalised), one block of adjacent axes at a
// time, last block first. The result has the keepdims shape.
Tensor reduce_raw(OpId op, const Tensor& x, const std::vector<int>& axes, DType out_dtype) {
  const auto kernel = detail::kernel_for<kernels::ReduceFn>(op, x.dtype(), {x});
  Tensor cur = detail::contiguous_raw(x);
  std::size_t hi = axes.size();
  while (hi > 0) {
    std::size_t lo = hi - 1;
    while (lo > 0 && axes[lo - 1] == axes[lo] - 1) --lo;
    const int first = axes[lo], last = axes[hi - 1];
    const Shape& s = cur.shape();
    std::int64_t outer = 1, n = 1, inner = 1;
    for (int i = 0; i < first; ++i) outer *= s[static_cast<std::size_t>(i)];
    for (int i = first; i <= last; ++i) n *= s[static_cast<std::size_t>(i)];
    for (std::size_t i = static_cast<std::size_t>(last) + 1; i < s.rank(); ++i) inner *= s[i];
    std::vector<std::int64_t> dims = s.dims();
    for (int i = first; i <= last; ++i) dims[static_cast<std::size_t>(i)] = 1;
    Tensor out = Tensor::empty(Shape(dims), out_dtype, x.device());
    if (out.numel() > 0) {
      if (n == 0) {
        if (op != OpId::sum && op != OpId::mean)
          throw ValueError(fmt::format("{}: reduction over an empty axis of a tensor of shape {}",
                                       op_name(op), x.shape().str()));
        detail::fill_raw(out, op == OpId::sum ? 0.0 : std::numeric_limits<double>::quiet_NaN());
      } else {
        kernel(cur, outer, n, inner, out);
      }
    }
    cur = out;
    hi = lo;
  }
  return cur;
}

Tensor reduce(OpId op, const Tensor& x, const std::vector<int>& axes_in, bool keepdims,
              std::vector<int>* axes_out = nullptr) {
  detail::check_inputs(op_name(op), {x});
  const auto axes = detail::normalize_axes(axes_in, x.rank(), op_name(op));
  Tensor kept = reduce_raw(op, x, axes, x.dtype());
  if (axes_out) *axes_out = axes;
  if (keepdims) return kept;
  return Tensor::view_of(kept, detail::reduced_shape(x.shape(), axes, false),
                         contiguous_strides(detail::reduced_shape(x.shape(), axes, false)),
                         kept.offset());
}

// max/min: the gradient is shared equally among the elements equal to the extremum.
Tensor extremum(OpId op, const Tensor& x_in, const std::vector<int>& axes_in, bool keepdims) {
  const Tensor x = detail::op_inputs(op, {x_in})[0];
  std::vector<int> axes;
  Tensor y = reduce(op, x, axes_in, keepdims, &axes);
  if (should_record({x}))
    record_op(op_name(op), {x}, y,
              [x, y, axes, keepdims](const Tensor& g, const std::vector<bool>&) {
                const Shape kept = detail::reduced_shape(x.shape(), axes, true);
                Tensor yk = reshape(y, kept);
                Tensor mask = cast(equal(x, yk), x.dtype());
                Tensor count = sum(mask, axes, true);
                return Grads{mask * (reshape(g, kept) / count)};
              });
  return y;
}

}  // namespace

Tensor sum(const Tensor& x_in, const std::vector<int>& axes_in, bool keepdims) {
  const Tensor x = detail::op_inputs(OpId::sum, {x_in})[0];
  std::vector<int> axes;
  Tensor y = reduce(OpId::sum, x, axes_in, keepdims, &axes);
  if (should_record({x}))
    record_op(op_name(OpId::sum), {x}, y,
              [shape = x.shape(), axes](const Tensor& g, const std::vector<bool>&) {
                return Grads{expand(reshape(g, detail::reduced_shape(shape, axes, true)), shape)};
              });
  return y;
}

Tensor mean(const Tensor& x_in, const std::vector<int>& axes_in, bool keepdims) {
  const Tensor x = detail::op_inputs(OpId::mean, {x_in})[0];
  std::vector<int> axes;
  Tensor y = reduce(OpId::mean, x, axes_in, keepdims, &axes);
  if (should_record({x}))
    record_op(
        op_name(OpId::mean), {x}, y,
        [shape = x.shape(), axes](const Tensor& g, const std::vector<bool>&) {
          std::int64_t n = 1;
          for (int a : axes) n *= shape[static_cast<std::size_t>(a)];
          Tensor scaled = g / static_cast<double>(n);
          return Grads{expand(reshape(scaled, detail::reduced_shape(shape, axes, true)), shape)};
        });
  return y;
}

Tensor max(const Tensor& x, const std::vector<int>& axes, bool keepdims) {
  return extremum(OpId::max, x, axes, keepdims);
}

Tensor min(const Tensor& x, const std::vector<int>& axes, bool keepdims) {
  return extremum(OpId::min, x, axes, keepdims);
}

Tensor argmax(const Tensor& x_in, int axis, bool keepdims) {
  detail::check_inputs("argmax", {x_in});
  const Tensor x = detail::op_inputs(OpId::argmax, {x_in})[0];
  const int a = normalize_axis(axis, x.rank(), "argmax");
  if (x.shape()[static_cast<std::size_t>(a)] == 0)
    throw ValueError(fmt::format("argmax: axis {} of shape {} is empty", axis, x.shape().str()));
  Tensor kept = reduce_raw(OpId::argmax, x, {a}, kInt64);
  if (keepdims) return kept;
  const Shape s = detail::reduced_shape(x.shape(), {a}, false);
  return Tensor::view_of(kept, s, contiguous_strides(s), kept.offset());
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const std::size_t r = x.rank(), tr = shape.rank();
  if (tr > r)
    throw ShapeError(
        fmt::format("sum_to: cannot sum a tensor of shape {} to the larger rank shape {}",
                    x.shape().str(), shape.str()));
  std::vector<int> axes;
  for (std::size_t i = 0; i < r; ++i) {
    if (i < r - tr) {
      axes.push_back(static_cast<int>(i));
      continue;
    }
    const std::int64_t want = shape[i - (r - tr)];
    if (want == x.shape()[i]) continue;
    if (want != 1)
      throw ShapeError(
          fmt::format("sum_to: shape {} does not broadcast to {}", shape.str(), x.shape().str()));
    axes.push_back(static_cast<int>(i));
  }
  if (axes.empty()) return reshape(x, shape);
  return reshape(sum(x, axes, true), shape);
}

// --- softmax / log_softmax -------------------------------------------------------------

namespace {
// Runs a RowFn over `axis` (moved last and back when it is not last).
Tensor rows_forward(OpId op, const Tensor& x, int axis) {
  detail::check_inputs(op_name(op), {x});
  if (x.rank() == 0)
    throw ShapeError(
        fmt::format("{}: needs a tensor of rank >= 1; got {}", op_name(op), detail::describe({x})));
  const int a = normalize_axis(axis, x.rank(), op_name(op));
  const auto kernel = detail::kernel_for<kernels::RowFn>(op, x.dtype(), {x});
  const int last = static_cast<int>(x.rank()) - 1;
  std::vector<int> perm;
  for (int i = 0; i <= last; ++i) perm.push_back(i);
  std::swap(perm[static_cast<std::size_t>(a)], perm[static_cast<std::size_t>(last)]);
  Tensor xin;
  {
    NoGradGuard no_grad;
    xin = detail::contiguous_raw(a == last ? x : permute(x, perm));
  }
  Tensor out = Tensor::empty(xin.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernel(xin, out);
  if (a == last) return out;
  NoGradGuard no_grad;
  return detail::contiguous_raw(permute(out, perm));
}
}  // namespace

Tensor softmax(const Tensor& x_in, int axis) {
  const Tensor x = detail::op_inputs(OpId::softmax, {x_in})[0];
  Tensor y = rows_forward(OpId::softmax, x, axis);
  if (should_record({x}))
    record_op(op_name(OpId::softmax), {x}, y, [y, axis](const Tensor& g, const std::vector<bool>&) {
      return Grads{y * (g - sum(g * y, {axis}, true))};
    });
  return y;
}

Tensor masked_softmax(const Tensor& x_in, const Tensor& mask_in, double scale) {
  const char* name = op_name(OpId::masked_softmax);
  const Tensor x = detail::op_inputs(OpId::masked_softmax, {x_in})[0];
  detail::check_inputs(
      name, mask_in.defined() ? std::vector<Tensor>{x, mask_in} : std::vector<Tensor>{x});
  if (x.rank() == 0)
    throw ShapeError(
        fmt::format("{}: needs a tensor of rank >= 1; got {}", name, detail::describe({x})));
  if (!std::isfinite(scale))
    throw ValueError(fmt::format("{}: scale must be finite; got {}", name, scale));
  Tensor mask;
  if (mask_in.defined()) {
    if (mask_in.dtype() != kBool)
      throw DTypeError(fmt::format("{}: the mask must be bool; got {} (for x {})", name,
                                   detail::describe({mask_in}), detail::describe({x})));
    if (mask_in.rank() > x.rank() ||
        broadcast_shapes(mask_in.shape(), x.shape(), name) != x.shape())
      throw ShapeError(fmt::format("{}: a mask of shape {} does not broadcast to x's shape {}",
                                   name, mask_in.shape(), x.shape()));
    mask = detail::contiguous_raw(detail::broadcast_view(mask_in, x.shape()));
  }
  const auto kernel =
      detail::kernel_for<kernels::MaskedSoftmaxFn>(OpId::masked_softmax, x.dtype(), {x});
  Tensor xin = detail::contiguous_raw(x);
  Tensor y = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (y.numel() > 0) kernel(xin, mask, scale, y);
  if (should_record({x}))
    record_op(name, {x}, y, [y, scale](const Tensor& g, const std::vector<bool>&) {
      // d/dx of softmax(s x): s y (g - sum(g y)); masked positions have y = 0.
      return Grads{(y * (g - sum(g * y, {-1}, true))) * scale};
    });
  return y;
}

Tensor log_softmax(const Tensor& x_in, int axis) {
  const Tensor x = detail::op_inputs(OpId::log_softmax, {x_in})[0];
  Tensor y = rows_forward(OpId::log_softmax, x, axis);
  if (should_record({x}))
    record_op(op_name(OpId::log_softmax), {x}, y,
              [y, axis](const Tensor& g, const std::vector<bool>&) {
                return Grads{g - exp(y) * sum(g, {axis}, true)};
              });
  return y;
}

}  // namespace mixtape
