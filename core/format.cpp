// Printing tensors (numpy-like, summarised when large).
#include <cmath>
#include <cstring>
#include <string>

#include "mixtape/core/tensor.h"

namespace mixtape {
namespace {

constexpr std::int64_t kSummariseAbove = 1000;  // elements
constexpr std::int64_t kEdgeItems = 3;

std::string format_element(const std::uint8_t* p, DType dtype) {
  const double v = detail::read_as_double(p, dtype);
  if (dtype == kBool) return v != 0 ? "true" : "false";
  if (!dtype.is_floating()) {
    if (dtype == kInt64) {
      std::int64_t i;
      std::memcpy(&i, p, sizeof i);
      return fmt::format("{}", i);
    }
    return fmt::format("{}", static_cast<std::int64_t>(v));
  }
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return fmt::format("{:.6g}", v);
}

void format_rec(std::string& out, const std::vector<std::uint8_t>& bytes, const Shape& shape,
                const Strides& strides, std::size_t axis, std::int64_t offset, DType dtype,
                bool summarise, std::size_t indent) {
  if (axis == shape.rank()) {
    out +=
        format_element(bytes.data() + offset * static_cast<std::int64_t>(dtype.itemsize()), dtype);
    return;
  }
  out += '[';
  const std::int64_t n = shape[axis];
  for (std::int64_t i = 0; i < n; ++i) {
    if (summarise && n > 2 * kEdgeItems && i == kEdgeItems) {
      out += "...";
      i = n - kEdgeItems - 1;
      out += axis + 1 == shape.rank() ? ", " : ",\n" + std::string(indent + 1, ' ');
      continue;
    }
    format_rec(out, bytes, shape, strides, axis + 1, offset + i * strides[axis], dtype, summarise,
               indent + 1);
    if (i + 1 < n) {
      if (axis + 1 == shape.rank()) {
        out += ", ";
      } else {
        out += ',';
        out += std::string(shape.rank() - axis - 1, '\n');
        out += std::string(indent + 1, ' ');
      }
    }
  }
  out += ']';
}

}  // namespace

std::string to_string(const Tensor& t) {
  if (!t.defined()) return "tensor(undefined)";
  const auto bytes = detail::host_bytes(t);
  std::string out = "tensor(";
  format_rec(out, bytes, t.shape(), contiguous_strides(t.shape()), 0, 0, t.dtype(),
             t.numel() > kSummariseAbove, 7);
  out += fmt::format(", dtype={}, shape={}", t.dtype().name(), t.shape().str());
  if (!t.device().is_cpu()) out += fmt::format(", device={}", t.device().str());
  out += ')';
  return out;
}

}  // namespace mixtape
