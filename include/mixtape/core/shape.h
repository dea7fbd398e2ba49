// Shape: the extents of a tensor, plus helpers for strides and broadcasting.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixtape/core/dtype.h"

namespace mixtape {

class Shape {
 public:
  Shape() = default;
  // Extents must be >= 0; -1 is accepted as reshape's "infer this extent".
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(std::vector<std::int64_t> dims);

  std::size_t rank() const { return dims_.size(); }
  // The product of the extents; throws ShapeError when it overflows int64 (see
  // checked_numel for the rule).
  std::int64_t numel() const;
  std::int64_t operator[](std::size_t i) const { return dims_[i]; }
  std::int64_t& operator[](std::size_t i) { return dims_[i]; }
  // Dimension by axis, negative counting from the end; throws IndexError when out of range.
  std::int64_t dim(int axis) const;
  std::int64_t back() const;
  const std::vector<std::int64_t>& dims() const { return dims_; }
  auto begin() const { return dims_.begin(); }
  auto end() const { return dims_.end(); }

  friend bool operator==(const Shape& a, const Shape& b) { return a.dims_ == b.dims_; }

  std::string str() const;  // "[2, 3]"

 private:
  std::vector<std::int64_t> dims_;
};

using Strides = std::vector<std::int64_t>;

// --- Sizes ----------------------------------------------------------------------------
// The one place where mixtape computes how many elements a shape holds and how many bytes
// they take, with overflow checks. Every factory, view, reshape and file reader goes
// through these, so that a shape too large for int64 is refused instead of wrapping
// around (to 0, or to a small or negative number).
//
// A shape fits when its extents are >= 0 and the product of its nonzero extents fits in
// int64 (so its contiguous strides fit too, even when a zero extent makes it empty); its
// bytes fit when the element count times the item size fits in int64 (and so in size_t).

// The element count of `shape`, or nullopt when an extent is negative or it does not fit.
std::optional<std::int64_t> try_numel(const Shape& shape);
// The element count times `itemsize`, or nullopt when either does not fit.
std::optional<std::int64_t> try_nbytes(const Shape& shape, std::size_t itemsize);
// The same, throwing ShapeError when they do not fit; the one-line message begins with
// `op` and names the shape (and the dtype): "zeros: shape [2147483648, 2147483648] of
// float32 is too large: ... overflow int64". Readers of files pass an `op` that names the
// file.
std::int64_t checked_numel(const Shape& shape, std::string_view op);
std::int64_t checked_nbytes(const Shape& shape, DType dtype, std::string_view op);

// Row-major strides (in elements) for a shape.
Strides contiguous_strides(const Shape& shape);
// Normalises a possibly negative axis against a rank; throws IndexError naming `op`.
int normalize_axis(int axis, std::size_t rank, const char* op);
// The broadcast of two shapes (numpy rules); throws ShapeError naming `op` when they do not
// broadcast or when the result's element count overflows (checked_numel).
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::Shape> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::Shape& s, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(s.str(), ctx);
  }
};
