// Shape: the extents of a tensor, plus helpers for strides and broadcasting.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

namespace mixtape {

class Shape {
 public:
  Shape() = default;
  // Extents must be >= 0; -1 is accepted as reshape's "infer this extent".
  Shape(std::initializer_list<std::int64_t> dims);
  explicit Shape(std::vector<std::int64_t> dims);

  std::size_t rank() const { return dims_.size(); }
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

// Row-major strides (in elements) for a shape.
Strides contiguous_strides(const Shape& shape);
// Normalises a possibly negative axis against a rank; throws IndexError naming `op`.
int normalize_axis(int axis, std::size_t rank, const char* op);
// The broadcast of two shapes (numpy rules); throws ShapeError naming `op`.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::Shape> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::Shape& s, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(s.str(), ctx);
  }
};
