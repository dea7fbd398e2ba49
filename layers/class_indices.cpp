// Class indices from floating tensors: one pass on the host, the first bad value named.
#include "layers/class_indices.h"

#include <cmath>
#include <vector>

#include "mixtape/autograd/ops.h"
#include "mixtape/core/error.h"

namespace mixtape::layers::detail {

Tensor class_indices(std::string_view who, std::string_view what, const Tensor& indices,
                     std::int64_t n) {
  if (!indices.dtype().is_floating()) return cast(indices, kInt64);
  const std::vector<double> values = indices.to_vector<double>();
  std::vector<std::int64_t> out(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    // Also false for NaN.
    if (!(v >= 0.0 && v < static_cast<double>(n)))
      throw IndexError(fmt::format("{}{}{} must lie in [0, {}); got {} at flat position {} ({}{})",
                                   who, who.empty() ? "" : ": ", what, n, v, i, indices.dtype(),
                                   indices.shape()));
    out[i] = static_cast<std::int64_t>(v);  // truncates toward zero
  }
  return from_vector(out, indices.shape(), kInt64, indices.device());
}

}  // namespace mixtape::layers::detail
