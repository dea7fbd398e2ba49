// Shape, strides and broadcasting.
#include "mixtape/core/shape.h"

#include <algorithm>

#include "mixtape/core/error.h"

namespace mixtape {

// -1 is accepted as reshape's "infer this extent"; tensors never have it (Tensor::empty
// checks).
Shape::Shape(std::initializer_list<std::int64_t> dims) : dims_(dims) {
  for (auto d : dims_)
    if (d < -1) throw ShapeError(fmt::format("Shape: negative extent in {}", str()));
}

Shape::Shape(std::vector<std::int64_t> dims) : dims_(std::move(dims)) {
  for (auto d : dims_)
    if (d < -1) throw ShapeError(fmt::format("Shape: negative extent in {}", str()));
}

std::int64_t Shape::numel() const {
  std::int64_t n = 1;
  for (auto d : dims_) n *= d;
  return n;
}

std::int64_t Shape::dim(int axis) const {
  return dims_[static_cast<std::size_t>(normalize_axis(axis, rank(), "Shape::dim"))];
}

std::int64_t Shape::back() const {
  if (dims_.empty()) throw IndexError("Shape::back: the shape [] has no axes");
  return dims_.back();
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims_, ", ")); }

Strides contiguous_strides(const Shape& shape) {
  Strides s(shape.rank());
  std::int64_t acc = 1;
  for (std::size_t i = shape.rank(); i-- > 0;) {
    s[i] = acc;
    acc *= std::max<std::int64_t>(shape[i], 1);
  }
  return s;
}

int normalize_axis(int axis, std::size_t rank, const char* op) {
  const int r = static_cast<int>(rank);
  if (axis < -r || axis >= r)
    throw IndexError(
        fmt::format("{}: axis {} is out of range for a tensor of rank {}", op, axis, r));
  return axis < 0 ? axis + r : axis;
}

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const std::size_t r = std::max(a.rank(), b.rank());
  std::vector<std::int64_t> out(r);
  for (std::size_t i = 0; i < r; ++i) {
    const std::int64_t da = i < r - a.rank() ? 1 : a[i - (r - a.rank())];
    const std::int64_t db = i < r - b.rank() ? 1 : b[i - (r - b.rank())];
    if (da != db && da != 1 && db != 1)
      throw ShapeError(
          fmt::format("{}: shapes {} and {} cannot be broadcast together", op, a.str(), b.str()));
    out[i] = da == 1 ? db : da;
  }
  return Shape(std::move(out));
}

}  // namespace mixtape
