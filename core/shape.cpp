// Shape, strides and broadcasting.
#include "mixtape/core/shape.h"

#include <algorithm>
#include <limits>

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

namespace {

// The product of `dims`, or nullopt when the product of the nonzero ones overflows int64
// (negative extents multiply in as they are: reshape's -1 placeholder).
std::optional<std::int64_t> product(const std::vector<std::int64_t>& dims) {
  std::int64_t p = 1;
  bool empty = false;
  for (const std::int64_t d : dims) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (__builtin_mul_overflow(p, d, &p)) return std::nullopt;
  }
  return empty ? 0 : p;
}

bool has_negative(const Shape& shape) {
  return std::any_of(shape.begin(), shape.end(), [](std::int64_t d) { return d < 0; });
}

}  // namespace

std::int64_t Shape::numel() const {
  const auto n = product(dims_);
  if (!n)
    throw ShapeError(fmt::format(
        "Shape::numel: shape {} is too large: its element count overflows int64", str()));
  return *n;
}

std::int64_t Shape::dim(int axis) const {
  return dims_[static_cast<std::size_t>(normalize_axis(axis, rank(), "Shape::dim"))];
}

std::int64_t Shape::back() const {
  if (dims_.empty()) throw IndexError("Shape::back: the shape [] has no axes");
  return dims_.back();
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims_, ", ")); }

std::optional<std::int64_t> try_numel(const Shape& shape) {
  if (has_negative(shape)) return std::nullopt;
  return product(shape.dims());
}

std::optional<std::int64_t> try_nbytes(const Shape& shape, std::size_t itemsize) {
  const auto n = try_numel(shape);
  std::int64_t bytes = 0;
  if (!n || itemsize > static_cast<std::size_t>(std::numeric_limits<std::int64_t>::max()) ||
      __builtin_mul_overflow(*n, static_cast<std::int64_t>(itemsize), &bytes))
    return std::nullopt;
  return bytes;
}

std::int64_t checked_numel(const Shape& shape, std::string_view op) {
  if (has_negative(shape))
    throw ShapeError(fmt::format("{}: negative extent in shape {}", op, shape.str()));
  const auto n = try_numel(shape);
  if (!n)
    throw ShapeError(fmt::format("{}: shape {} is too large: its element count overflows int64", op,
                                 shape.str()));
  return *n;
}

std::int64_t checked_nbytes(const Shape& shape, DType dtype, std::string_view op) {
  const std::int64_t n = checked_numel(shape, op);
  const auto bytes = try_nbytes(shape, dtype.itemsize());
  if (!bytes)
    throw ShapeError(
        fmt::format("{}: shape {} of {} is too large: its size in bytes ({} elements of {} bytes) "
                    "overflows int64",
                    op, shape.str(), dtype.name(), n, dtype.itemsize()));
  return *bytes;
}

Strides contiguous_strides(const Shape& shape) {
  Strides s(shape.rank());
  std::int64_t acc = 1;
  for (std::size_t i = shape.rank(); i-- > 0;) {
    s[i] = acc;
    if (__builtin_mul_overflow(acc, std::max<std::int64_t>(shape[i], 1), &acc) && i > 0)
      throw ShapeError(fmt::format(
          "contiguous_strides: shape {} is too large: its strides overflow int64", shape.str()));
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
  Shape result(std::move(out));
  checked_numel(result, op);
  return result;
}

}  // namespace mixtape
