// Helpers shared by the differentiable ops.
#include "autograd/op_util.h"

#include <algorithm>
#include <cmath>

namespace mixtape::detail {

std::string describe(const std::vector<Tensor>& ts) {
  std::string out;
  for (const auto& t : ts) {
    if (!out.empty()) out += ", ";
    out += t.defined() ? fmt::format("{}{}", t.dtype().name(), t.shape().str()) : "undefined";
    if (t.defined() && !t.device().is_cpu()) out += fmt::format("@{}", t.device().str());
  }
  return out;
}

Tensor normalization_input(OpId op, const Tensor& x_in, double epsilon) {
  const char* name = op_name(op);
  check_inputs(name, {x_in});
  const Tensor x = op_inputs(op, {x_in})[0];
  if (x.rank() == 0)
    throw ShapeError(fmt::format("{}: needs a tensor of rank >= 1; got {}", name, describe({x})));
  if (!x.dtype().is_floating())
    throw DTypeError(fmt::format("{}: needs a floating tensor; got {}", name, describe({x})));
  if (!(epsilon >= 0.0) || !std::isfinite(epsilon))
    throw ValueError(fmt::format("{}: epsilon must be finite and >= 0; got {}", name, epsilon));
  return x;
}

Tensor per_column_input(const char* op, const char* what, const Tensor& p, const Tensor& x,
                        std::int64_t n, DType ct) {
  if (!p.defined()) return Tensor();
  check_inputs(op, {x, p});
  if (p.rank() != 1 || p.dim(0) != n || !p.dtype().is_floating())
    throw ShapeError(fmt::format("{}: {} must be floating [{}] (x's last extent); got {} for x {}",
                                 op, what, n, describe({p}), describe({x})));
  return p.dtype() == ct ? p : cast(p, ct);
}

Grads normalization_grads(const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta) {
  Grads out{dx};
  if (dgamma.defined()) out.push_back(dgamma);
  if (dbeta.defined()) out.push_back(dbeta);
  return out;
}

void check_inputs(const char* op, const std::vector<Tensor>& ts) {
  for (std::size_t i = 0; i < ts.size(); ++i)
    if (!ts[i].defined())
      throw ValueError(fmt::format("{}: input {} is an undefined tensor", op, i));
  for (const auto& t : ts)
    if (t.device() != ts.front().device())
      throw DeviceError(fmt::format("{}: inputs are on different devices: {}", op, describe(ts)));
}

Tensor broadcast_view(const Tensor& t, const Shape& shape) {
  if (t.shape() == shape) return t;
  const std::size_t r = shape.rank(), tr = t.rank();
  Strides strides(r, 0);
  for (std::size_t i = 0; i < tr; ++i) {
    const std::size_t o = r - tr + i;
    strides[o] = t.shape()[i] == 1 && shape[o] != 1 ? 0 : t.strides()[i];
  }
  return Tensor::view_of(t, shape, std::move(strides), t.offset());
}

Tensor scalar_like(double value, const Tensor& like) {
  return full(Shape{}, value, like.dtype(), like.device());
}

std::vector<int> normalize_axes(const std::vector<int>& axes, std::size_t rank, const char* op) {
  std::vector<int> out;
  if (axes.empty()) {
    for (std::size_t i = 0; i < rank; ++i) out.push_back(static_cast<int>(i));
    return out;
  }
  for (int a : axes) out.push_back(normalize_axis(a, rank, op));
  std::sort(out.begin(), out.end());
  if (std::adjacent_find(out.begin(), out.end()) != out.end())
    throw ValueError(fmt::format("{}: repeated axis in [{}]", op, fmt::join(axes, ", ")));
  return out;
}

Shape reduced_shape(const Shape& s, const std::vector<int>& axes, bool keepdims) {
  std::vector<std::int64_t> dims;
  for (std::size_t i = 0; i < s.rank(); ++i) {
    const bool reduced = std::find(axes.begin(), axes.end(), static_cast<int>(i)) != axes.end();
    if (!reduced)
      dims.push_back(s[i]);
    else if (keepdims)
      dims.push_back(1);
  }
  return Shape(std::move(dims));
}

}  // namespace mixtape::detail
