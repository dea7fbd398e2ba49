// Private to the library: non-recording tensor operations that core itself needs
// (factories, printing, item) and that the differentiable ops reuse for their forward.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

namespace mixtape::detail {

// Tensor::empty whose errors begin with `op`: a shape whose size overflows (ShapeError,
// checked_nbytes) or an allocation that fails (OutOfMemoryError naming the bytes, the
// device, the dtype and the shape).
Tensor empty_raw(const Shape& shape, DType dtype, Device device, std::string_view op);
// "out of memory: cannot allocate N bytes (X GiB) on DEVICE", the words of every
// OutOfMemoryError.
std::string out_of_memory_message(std::uint64_t nbytes, Device device);

// A contiguous copy (or `t` itself when already contiguous).
Tensor contiguous_raw(const Tensor& t);
// `t` cast to `dtype` (or `t` itself when equal); the result is contiguous.
Tensor cast_raw(const Tensor& t, DType dtype);
// `t` copied to `device` (or `t` itself when equal); the result is contiguous. A copy from a
// device to the host runs the deferred checks after it (below).
Tensor to_device_raw(const Tensor& t, Device device);
// Fills a contiguous tensor.
void fill_raw(const Tensor& t, double value);

// Checks of device results that the host collects later instead of waiting for them (the
// range of a GPU tensor of indices: reading it at once would stop the host until the device
// got there, every step). `check` runs, and throws what it finds, at the next copy from a
// device to the host (all checks), or at the next run_deferred_checks(true) once `ready`
// says its data has arrived (an indexing op calls it first, without waiting). Checks run in
// the order they were deferred; run_deferred_checks runs them and then rethrows the first
// error.
void defer_check(std::function<bool()> ready, std::function<void()> check);
void run_deferred_checks(bool only_ready = false);

}  // namespace mixtape::detail
