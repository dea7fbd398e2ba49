// Private to the library: non-recording tensor operations that core itself needs
// (factories, printing, item) and that the differentiable ops reuse for their forward.
#pragma once

#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

namespace mixtape::detail {

// A contiguous copy (or `t` itself when already contiguous).
Tensor contiguous_raw(const Tensor& t);
// `t` cast to `dtype` (or `t` itself when equal); the result is contiguous.
Tensor cast_raw(const Tensor& t, DType dtype);
// `t` copied to `device` (or `t` itself when equal); the result is contiguous.
Tensor to_device_raw(const Tensor& t, Device device);
// Fills a contiguous tensor.
void fill_raw(const Tensor& t, double value);

}  // namespace mixtape::detail
