// Indexing: gather along an axis (take_along_axis) and one_hot.
#include <memory>
#include <string>

#include "autograd/op_util.h"
#include "mixtape/core/backend.h"

namespace mixtape {

using detail::Grads;

namespace {

// Checks that every index lies in [0, n); returns the indices as contiguous int64. Indices
// on the host are checked at once. Indices on a device are checked there: their minimum and
// maximum are read back later (core/raw.h, defer_check), so that an indexing op does not
// stop the host until the device has computed them (a training step's labels, every step).
// An index out of range then throws IndexError from the next indexing op or the next read
// of a device tensor, and the kernels meanwhile read 0 for it and add nothing for it (the
// CUDA backend's index kernels).
Tensor checked_indices(const char* op, const Tensor& index, std::int64_t n, const Tensor& x) {
  if (!index.dtype().is_integral())
    throw DTypeError(fmt::format("{}: indices must be int32 or int64; got {}", op,
                                 detail::describe({x, index})));
  Tensor idx = detail::cast_raw(index, kInt64);
  if (!idx.device().is_cpu()) {
    // A captured step's indices are not checked on a GPU: the replays make no host reads
    // (mixtape/core/capture.h).
    if (capture::active()) return idx;
    detail::run_deferred_checks(/*only_ready=*/true);  // the earlier ops' that have arrived
    if (idx.numel() == 0) return idx;
    NoGradGuard no_grad;
    const Tensor lo = min(idx), hi = max(idx);
    Backend& backend = backend_for(idx.device().type());
    const int dev = idx.device().index();
    std::shared_ptr<PendingRead> read_lo =
        backend.read_back(lo.const_data_ptr(), dev, sizeof(std::int64_t));
    std::shared_ptr<PendingRead> read_hi =
        backend.read_back(hi.const_data_ptr(), dev, sizeof(std::int64_t));
    detail::defer_check(
        [read_lo, read_hi] { return read_lo->ready() && read_hi->ready(); },
        [read_lo, read_hi, n, op = std::string(op), what = detail::describe({x, index})] {
          std::int64_t low = 0, high = 0;
          read_lo->wait(&low);
          read_hi->wait(&high);
          if (low < 0 || high >= n)
            throw IndexError(fmt::format(
                "{}: index {} is out of range [0, {}) ({}; checked on the device and reported at "
                "the next indexing op or read)",
                op, low < 0 ? low : high, n, what));
        });
    return idx;
  }
  // Checked before each replay's kernels read them when a step is captured on the CPU.
  capture::detail::record_or_run(
      [idx, n, op = std::string(op), what = detail::describe({x, index})] {
        const auto* p = idx.const_data<std::int64_t>();
        for (std::int64_t i = 0; i < idx.numel(); ++i)
          if (p[i] < 0 || p[i] >= n)
            throw IndexError(
                fmt::format("{}: index {} is out of range [0, {}) (at flat position {}; {})", op,
                            p[i], n, i, what));
      });
  return x.device().is_cpu() ? idx : detail::to_device_raw(idx, x.device());
}

struct AxisSplit {
  std::int64_t outer = 1, n = 1, k = 1, inner = 1;
};

AxisSplit split(const Shape& x, const Shape& index, std::size_t axis) {
  AxisSplit s;
  for (std::size_t i = 0; i < axis; ++i) s.outer *= x[i];
  for (std::size_t i = axis + 1; i < x.rank(); ++i) s.inner *= x[i];
  s.n = x[axis];
  s.k = index[axis];
  return s;
}

// The adjoint of gather: zeros of `shape` with g added at the gathered positions.
Tensor gather_backward(const Tensor& g, const Tensor& idx, const Shape& shape, int axis) {
  const AxisSplit s = split(shape, idx.shape(), static_cast<std::size_t>(axis));
  Tensor out = zeros(shape, g.dtype(), g.device());
  if (g.numel() > 0)
    detail::kernel_for<kernels::ScatterAddFn>(OpId::scatter_add, g.dtype(), {g, idx})(
        detail::contiguous_raw(g), idx, s.outer, s.n, s.k, s.inner, out);
  if (should_record({g}))
    record_op(op_name(OpId::scatter_add), {g}, out,
              [idx, axis](const Tensor& gg, const std::vector<bool>&) {
                return Grads{gather(gg, idx, axis)};
              });
  return out;
}

}  // namespace

Tensor gather(const Tensor& x_in, const Tensor& index, int axis) {
  detail::check_inputs("gather", {x_in, index});
  const Tensor x = detail::op_inputs(OpId::gather, {x_in})[0];
  if (x.rank() == 0 || index.rank() != x.rank())
    throw ShapeError(fmt::format("gather: indices need the rank of x (>= 1); got {}",
                                 detail::describe({x, index})));
  const int a = normalize_axis(axis, x.rank(), "gather");
  for (std::size_t i = 0; i < x.rank(); ++i)
    if (static_cast<int>(i) != a && index.shape()[i] != x.shape()[i])
      throw ShapeError(fmt::format("gather: index shape {} must match x shape {} except on axis {}",
                                   index.shape().str(), x.shape().str(), axis));
  const auto kernel = detail::kernel_for<kernels::GatherFn>(OpId::gather, x.dtype(), {x, index});
  Tensor idx = checked_indices("gather", index, x.shape()[static_cast<std::size_t>(a)], x);
  const AxisSplit s = split(x.shape(), index.shape(), static_cast<std::size_t>(a));
  Tensor out = Tensor::empty(index.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernel(detail::contiguous_raw(x), idx, s.outer, s.n, s.k, s.inner, out);
  if (should_record({x}))
    record_op(op_name(OpId::gather), {x}, out,
              [idx, shape = x.shape(), a](const Tensor& g, const std::vector<bool>&) {
                return Grads{gather_backward(g, idx, shape, a)};
              });
  return out;
}

namespace {

// The adjoint of take: zeros of x's shape with the slices of g added at their indices.
Tensor take_backward(const Tensor& g, const Tensor& idx, const Shape& shape, int axis) {
  const auto a = static_cast<std::size_t>(axis);
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < a; ++i) outer *= shape[i];
  for (std::size_t i = a + 1; i < shape.rank(); ++i) inner *= shape[i];
  Tensor out = zeros(shape, g.dtype(), g.device());
  if (g.numel() > 0)
    detail::kernel_for<kernels::IndexAddFn>(OpId::index_add, g.dtype(), {g, idx})(
        detail::contiguous_raw(g), idx, outer, shape[a], idx.numel(), inner, out);
  if (should_record({g}))
    record_op(op_name(OpId::index_add), {g}, out,
              [idx, axis, gshape = g.shape()](const Tensor& gg, const std::vector<bool>&) {
                return Grads{reshape(take(gg, idx, axis), gshape)};
              });
  return out;
}

}  // namespace

Tensor take(const Tensor& x_in, const Tensor& indices, int axis) {
  // Indices may also come from the host (checked there, then copied to x's device).
  detail::check_inputs("take", indices.defined() && indices.device().is_cpu()
                                   ? std::vector<Tensor>{x_in}
                                   : std::vector<Tensor>{x_in, indices});
  const Tensor x = detail::op_inputs(OpId::take, {x_in})[0];
  if (x.rank() == 0)
    throw ShapeError(
        fmt::format("take: needs a tensor of rank >= 1; got {}", detail::describe({x, indices})));
  const int a = normalize_axis(axis, x.rank(), "take");
  const auto kernel = detail::kernel_for<kernels::TakeFn>(OpId::take, x.dtype(), {x, indices});
  const auto au = static_cast<std::size_t>(a);
  const std::int64_t n = x.shape()[au];
  Tensor idx = detail::contiguous_raw(reshape(
      checked_indices("take", detail::contiguous_raw(indices), n, x), Shape{indices.numel()}));
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < au; ++i) outer *= x.shape()[i];
  for (std::size_t i = au + 1; i < x.rank(); ++i) inner *= x.shape()[i];
  std::vector<std::int64_t> dims(x.shape().begin(), x.shape().begin() + a);
  dims.insert(dims.end(), indices.shape().begin(), indices.shape().end());
  dims.insert(dims.end(), x.shape().begin() + a + 1, x.shape().end());
  Tensor out = Tensor::empty(Shape(dims), x.dtype(), x.device());
  if (out.numel() > 0) kernel(detail::contiguous_raw(x), idx, outer, n, idx.numel(), inner, out);
  if (should_record({x}))
    record_op(op_name(OpId::take), {x}, out,
              [idx, shape = x.shape(), a](const Tensor& g, const std::vector<bool>&) {
                return Grads{take_backward(g, idx, shape, a)};
              });
  return out;
}

Tensor one_hot(const Tensor& labels, std::int64_t depth, DType dtype) {
  detail::check_inputs("one_hot", {labels});
  if (depth <= 0) throw ValueError(fmt::format("one_hot: depth must be positive, got {}", depth));
  Tensor idx = checked_indices("one_hot", labels, depth, labels);
  NoGradGuard no_grad;
  Tensor hot = equal(unsqueeze(idx, -1), arange(depth, kInt64, labels.device()));
  return cast(hot, dtype);
}

}  // namespace mixtape
