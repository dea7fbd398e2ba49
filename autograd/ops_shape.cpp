// Dtype, device and shape ops (views where possible), and the Tensor method sugar.
#include <algorithm>
#include <numeric>

#include "autograd/op_util.h"
#include "mixtape/core/backend.h"

namespace mixtape {

using detail::Grads;

Tensor detail::record_cast(const Tensor& x, Tensor y) {
  if (x.dtype().is_floating() && y.dtype().is_floating() && should_record({x}))
    record_op(op_name(OpId::cast), {x}, y,
              [from = x.dtype()](const Tensor& g, const std::vector<bool>&) {
                return Grads{cast(g, from)};  // the gradient goes back in the source dtype
              });
  return y;
}

Tensor cast(const Tensor& x, DType dtype) {
  detail::check_inputs("cast", {x});
  if (x.dtype() == dtype) return x;
  return detail::record_cast(x, detail::cast_raw(x, dtype));
}

Tensor to_device(const Tensor& x, Device device) {
  detail::check_inputs("to_device", {x});
  if (x.device() == device) return x;
  check_device(device);
  Tensor y = detail::to_device_raw(x, device);
  if (should_record({x}))
    record_op(op_name(OpId::to_device), {x}, y,
              [from = x.device()](const Tensor& g, const std::vector<bool>&) {
                return Grads{to_device(g, from)};
              });
  return y;
}

Tensor contiguous(const Tensor& x_in) {
  detail::check_inputs("contiguous", {x_in});
  const Tensor x = detail::op_inputs(OpId::contiguous, {x_in})[0];
  if (x.is_contiguous()) return x;
  Tensor y = detail::contiguous_raw(x);
  if (should_record({x}))
    record_op(op_name(OpId::contiguous), {x}, y,
              [](const Tensor& g, const std::vector<bool>&) { return Grads{g}; });
  return y;
}

Tensor detach(const Tensor& x) {
  detail::check_inputs("detach", {x});
  return Tensor::view_of(x, x.shape(), x.strides(), x.offset());
}

Tensor reshape(const Tensor& x_in, const Shape& shape_in) {
  detail::check_inputs("reshape", {x_in});
  const Tensor x = detail::op_inputs(OpId::reshape, {x_in})[0];
  std::vector<std::int64_t> dims = shape_in.dims();
  int infer = -1;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] != -1) continue;
    if (infer >= 0)
      throw ShapeError(fmt::format("reshape: more than one -1 in {}", shape_in.str()));
    infer = static_cast<int>(i);
  }
  if (infer >= 0) {
    // The product of the other extents, overflow-checked (the -1 counted as 1).
    std::vector<std::int64_t> others = dims;
    others[static_cast<std::size_t>(infer)] = 1;
    const auto known = try_numel(Shape(others));
    if (!known)
      throw ShapeError(fmt::format(
          "reshape: shape {} is too large: its element count overflows int64", shape_in.str()));
    if (*known == 0 || x.numel() % *known != 0)
      throw ShapeError(
          fmt::format("reshape: cannot reshape a tensor of shape {} ({} elements) to {}",
                      x.shape().str(), x.numel(), shape_in.str()));
    dims[static_cast<std::size_t>(infer)] = x.numel() / *known;
  }
  Shape shape(dims);
  const std::int64_t numel = checked_numel(shape, "reshape");
  if (numel != x.numel())
    throw ShapeError(fmt::format(
        "reshape: cannot reshape a tensor of shape {} ({} elements) to {} ({} elements)",
        x.shape().str(), x.numel(), shape.str(), numel));
  if (shape == x.shape()) return x;
  Tensor base = detail::contiguous_raw(x);
  Tensor y = Tensor::view_of(base, shape, contiguous_strides(shape), base.offset());
  if (should_record({x}))
    record_op(op_name(OpId::reshape), {x}, y,
              [from = x.shape()](const Tensor& g, const std::vector<bool>&) {
                return Grads{reshape(g, from)};
              });
  return y;
}

Tensor permute(const Tensor& x_in, const std::vector<int>& axes) {
  detail::check_inputs("permute", {x_in});
  const Tensor x = detail::op_inputs(OpId::permute, {x_in})[0];
  if (axes.size() != x.rank())
    throw ShapeError(fmt::format("permute: {} axes given for a tensor of shape {}", axes.size(),
                                 x.shape().str()));
  std::vector<int> perm;
  for (int a : axes) perm.push_back(normalize_axis(a, x.rank(), "permute"));
  std::vector<int> sorted = perm;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i < sorted.size(); ++i)
    if (sorted[i] != static_cast<int>(i))
      throw ValueError(
          fmt::format("permute: [{}] is not a permutation of the axes of a tensor of shape {}",
                      fmt::join(axes, ", "), x.shape().str()));
  std::vector<std::int64_t> dims(perm.size());
  Strides strides(perm.size());
  std::vector<int> inverse(perm.size());
  for (std::size_t i = 0; i < perm.size(); ++i) {
    const auto p = static_cast<std::size_t>(perm[i]);
    dims[i] = x.shape()[p];
    strides[i] = x.strides()[p];
    inverse[p] = static_cast<int>(i);
  }
  Tensor y = Tensor::view_of(x, Shape(dims), strides, x.offset());
  if (should_record({x}))
    record_op(op_name(OpId::permute), {x}, y, [inverse](const Tensor& g, const std::vector<bool>&) {
      return Grads{permute(g, inverse)};
    });
  return y;
}

Tensor transpose(const Tensor& x, int axis0, int axis1) {
  detail::check_inputs("transpose", {x});
  const int a = normalize_axis(axis0, x.rank(), "transpose");
  const int b = normalize_axis(axis1, x.rank(), "transpose");
  std::vector<int> perm(x.rank());
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[static_cast<std::size_t>(a)], perm[static_cast<std::size_t>(b)]);
  return permute(x, perm);
}

namespace {
// The adjoint of slice: a zero tensor of `shape` with `g` added at the sliced positions
// (through scatter_add along the axis, so it works for every backend with the kernel).
Tensor slice_backward(const Tensor& g, const Shape& shape, int axis, std::int64_t start,
                      std::int64_t step) {
  const auto a = static_cast<std::size_t>(axis);
  std::int64_t outer = 1, inner = 1;
  for (std::size_t i = 0; i < a; ++i) outer *= shape[i];
  for (std::size_t i = a + 1; i < shape.rank(); ++i) inner *= shape[i];
  const std::int64_t n = shape[a], k = g.shape()[a];
  std::vector<std::int64_t> idx(static_cast<std::size_t>(outer * k * inner));
  for (std::int64_t o = 0; o < outer; ++o)
    for (std::int64_t j = 0; j < k; ++j)
      for (std::int64_t i = 0; i < inner; ++i)
        idx[static_cast<std::size_t>((o * k + j) * inner + i)] = start + j * step;
  Tensor index = from_vector(idx, g.shape(), kInt64, g.device());
  Tensor out = zeros(shape, g.dtype(), g.device());
  Tensor src = detail::contiguous_raw(g);
  if (src.numel() > 0)
    detail::kernel_for<kernels::ScatterAddFn>(OpId::scatter_add, g.dtype(), {g})(src, index, outer,
                                                                                 n, k, inner, out);
  if (should_record({g}))
    record_op(op_name(OpId::slice_backward), {g}, out,
              [axis, start, step, k](const Tensor& gg, const std::vector<bool>&) {
                return Grads{slice(gg, axis, start, start + k * step, step)};
              });
  return out;
}
}  // namespace

Tensor slice(const Tensor& x_in, int axis, std::int64_t start, std::int64_t stop,
             std::int64_t step) {
  detail::check_inputs("slice", {x_in});
  const Tensor x = detail::op_inputs(OpId::slice, {x_in})[0];
  if (x.rank() == 0) throw ShapeError("slice: cannot slice a 0-d tensor");
  const int a = normalize_axis(axis, x.rank(), "slice");
  if (step <= 0) throw ValueError(fmt::format("slice: step must be positive, got {}", step));
  const std::int64_t n = x.shape()[static_cast<std::size_t>(a)];
  auto clamp = [n](std::int64_t v) {
    if (v < 0) v += n;
    return std::clamp<std::int64_t>(v, 0, n);
  };
  const std::int64_t b = clamp(start), e = std::max(clamp(stop), clamp(start));
  // ceil((e - b) / step), without overflow for a huge step.
  const std::int64_t len = e > b ? (e - b - 1) / step + 1 : 0;
  std::vector<std::int64_t> dims = x.shape().dims();
  Strides strides = x.strides();
  dims[static_cast<std::size_t>(a)] = len;
  const std::int64_t offset = x.offset() + (len > 0 ? b * strides[static_cast<std::size_t>(a)] : 0);
  // The stride of an axis of one element (or none) is never used; leaving it avoids an
  // overflow of stride * step for a huge step. Otherwise (len - 1) * step < n, so it fits.
  if (len > 1) strides[static_cast<std::size_t>(a)] *= step;
  Tensor y = Tensor::view_of(x, Shape(dims), strides, offset);
  if (should_record({x}))
    record_op(op_name(OpId::slice), {x}, y,
              [shape = x.shape(), a, b, step](const Tensor& g, const std::vector<bool>&) {
                return Grads{slice_backward(g, shape, a, b, step)};
              });
  return y;
}

Tensor expand(const Tensor& x_in, const Shape& shape) {
  detail::check_inputs("expand", {x_in});
  const Tensor x = detail::op_inputs(OpId::expand, {x_in})[0];
  if (x.shape() == shape) return x;
  checked_nbytes(shape, x.dtype(), "expand");
  if (shape.rank() < x.rank() || broadcast_shapes(x.shape(), shape, "expand") != shape)
    throw ShapeError(fmt::format("expand: a tensor of shape {} cannot be broadcast to {}",
                                 x.shape().str(), shape.str()));
  Tensor y = detail::broadcast_view(x, shape);
  if (should_record({x}))
    record_op(op_name(OpId::expand), {x}, y,
              [from = x.shape()](const Tensor& g, const std::vector<bool>&) {
                return Grads{sum_to(g, from)};
              });
  return y;
}

Tensor squeeze(const Tensor& x, int axis) {
  detail::check_inputs("squeeze", {x});
  const int a = normalize_axis(axis, x.rank(), "squeeze");
  if (x.shape()[static_cast<std::size_t>(a)] != 1)
    throw ShapeError(fmt::format("squeeze: axis {} of shape {} has extent {}, not 1", axis,
                                 x.shape().str(), x.shape()[static_cast<std::size_t>(a)]));
  std::vector<std::int64_t> dims = x.shape().dims();
  dims.erase(dims.begin() + a);
  return reshape(x, Shape(dims));
}

Tensor unsqueeze(const Tensor& x, int axis) {
  detail::check_inputs("unsqueeze", {x});
  const int a = normalize_axis(axis, x.rank() + 1, "unsqueeze");
  std::vector<std::int64_t> dims = x.shape().dims();
  dims.insert(dims.begin() + a, 1);
  return reshape(x, Shape(dims));
}

Tensor flatten(const Tensor& x, int start_axis) {
  detail::check_inputs("flatten", {x});
  if (x.rank() == 0) return reshape(x, Shape{1});
  const int a = normalize_axis(start_axis, x.rank(), "flatten");
  std::vector<std::int64_t> dims(x.shape().begin(), x.shape().begin() + a);
  std::int64_t rest = 1;
  for (std::size_t i = static_cast<std::size_t>(a); i < x.rank(); ++i) rest *= x.shape()[i];
  dims.push_back(rest);
  return reshape(x, Shape(dims));
}

Tensor concat(const std::vector<Tensor>& xs_in, int axis) {
  if (xs_in.empty()) throw ValueError("concat: no tensors given");
  detail::check_inputs("concat", xs_in);
  const std::vector<Tensor> xs = detail::op_inputs(OpId::concat, xs_in);
  const Tensor& first = xs.front();
  if (first.rank() == 0) throw ShapeError("concat: cannot concatenate 0-d tensors");
  const int a = normalize_axis(axis, first.rank(), "concat");
  DType dt = first.dtype();
  for (const auto& t : xs) dt = promote_types(dt, t.dtype());
  std::int64_t total = 0;
  for (const auto& t : xs) {
    bool ok = t.rank() == first.rank();
    for (std::size_t i = 0; ok && i < t.rank(); ++i)
      ok = static_cast<int>(i) == a || t.shape()[i] == first.shape()[i];
    if (!ok)
      throw ShapeError(fmt::format("concat: shapes do not match except on axis {}: {}", axis,
                                   detail::describe(xs)));
    total += t.shape()[static_cast<std::size_t>(a)];
  }
  std::vector<Tensor> parts;
  for (const auto& t : xs) parts.push_back(cast(t, dt));  // recorded when promoting
  // Each part is copied once, into a block of the output along its first axis (a block of a
  // contiguous tensor along axis 0 is contiguous, what the copy kernel writes): the parts
  // go there as they are for axis 0, moved to the front (a view) for another axis, and the
  // output is moved back (one more copy). O(output), whatever the number of parts.
  const auto rank = static_cast<int>(first.rank());
  std::vector<int> to_front{a};
  for (int i = 0; i < rank; ++i)
    if (i != a) to_front.push_back(i);
  std::vector<std::int64_t> front_dims;
  for (int i : to_front) front_dims.push_back(first.shape()[static_cast<std::size_t>(i)]);
  front_dims[0] = total;
  std::vector<std::int64_t> starts;
  Tensor out;
  {
    NoGradGuard no_grad;
    Tensor front = Tensor::empty(Shape(front_dims), dt, first.device());
    const auto copy = find_kernel<kernels::CopyFn>(OpId::copy, first.device().type(), dt);
    std::int64_t at = 0;
    for (const auto& t : parts) {
      starts.push_back(at);
      const std::int64_t k = t.shape()[static_cast<std::size_t>(a)];
      if (t.numel() > 0) copy(a == 0 ? t : permute(t, to_front), slice(front, 0, at, at + k));
      at += k;
    }
    if (a == 0) {
      out = front;
    } else {
      std::vector<int> back(static_cast<std::size_t>(rank));
      for (int i = 0; i < rank; ++i)
        back[static_cast<std::size_t>(to_front[static_cast<std::size_t>(i)])] = i;
      out = permute(front, back).contiguous();
    }
  }
  if (should_record(parts))
    record_op(op_name(OpId::concat), parts, out,
              [parts, starts, a](const Tensor& g, const std::vector<bool>& needs) {
                Grads grads(parts.size());
                for (std::size_t i = 0; i < parts.size(); ++i)
                  if (needs[i])
                    grads[i] = slice(g, a, starts[i],
                                     starts[i] + parts[i].shape()[static_cast<std::size_t>(a)]);
                return grads;
              });
  return out;
}

}  // namespace mixtape
