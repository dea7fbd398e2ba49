// Private helpers shared by the differentiable ops (autograd/ops_*.cpp).
#pragma once

#include <string>
#include <vector>

#include "core/raw.h"
#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/kernels.h"

namespace mixtape::detail {

using Grads = std::vector<Tensor>;

// "float16[2, 3]" per tensor, for error messages.
std::string describe(const std::vector<Tensor>& ts);

// Throws a clear error unless every tensor is defined and on the same device.
void check_inputs(const char* op, const std::vector<Tensor>& ts);

// The kernel of `op` for the inputs' device and `dtype`, with the inputs described in
// the error when there is none.
template <typename Fn>
Fn* kernel_for(OpId op, DType dtype, const std::vector<Tensor>& inputs) {
  try {
    return find_kernel<Fn>(op, inputs.front().device().type(), dtype);
  } catch (const KernelNotFoundError& e) {
    throw KernelNotFoundError(fmt::format("{}; inputs: {}", e.what(), describe(inputs)));
  }
}

// A view of `t` broadcast to `shape` (stride 0 on broadcast axes); no checks.
Tensor broadcast_view(const Tensor& t, const Shape& shape);
// A 0-d tensor holding `value` in `like`'s dtype and device.
Tensor scalar_like(double value, const Tensor& like);
// Sorted, unique, normalised axes (all axes when `axes` is empty).
std::vector<int> normalize_axes(const std::vector<int>& axes, std::size_t rank, const char* op);
// The shape with the given axes set to 1 (keepdims form) or removed.
Shape reduced_shape(const Shape& s, const std::vector<int>& axes, bool keepdims);

}  // namespace mixtape::detail
