// Exceptions thrown by mixtape. Every error derives from mixtape::Error, and the
// message names the op, the shapes and the dtypes involved.
#pragma once

#include <stdexcept>
#include <string>

namespace mixtape {

// Base of every exception mixtape throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Shapes that do not fit the op (mismatch, bad reshape, bad broadcast).
class ShapeError : public Error {
 public:
  using Error::Error;
};

// A dtype the op cannot take, or a mix of dtypes with no promotion rule.
class DTypeError : public Error {
 public:
  using Error::Error;
};

// An index or axis out of range.
class IndexError : public Error {
 public:
  using Error::Error;
};

// A bad argument value (unknown name, negative size, ...).
class ValueError : public Error {
 public:
  using Error::Error;
};

// A file that cannot be read, written or fetched, or whose content is malformed.
class IOError : public Error {
 public:
  using Error::Error;
};

// No kernel is registered for (op, device, dtype).
class KernelNotFoundError : public Error {
 public:
  using Error::Error;
};

// Misuse of a GradientTape (consumed tape, non-scalar target without a seed, ...).
class AutogradError : public Error {
 public:
  using Error::Error;
};

// Non-finite values where training cannot go on: a NaN or infinite gradient given to an
// optimizer, or a loss scale that kept skipping steps (the model diverged).
class NumericError : public Error {
 public:
  using Error::Error;
};

// A device that is not available, or tensors on different devices.
class DeviceError : public Error {
 public:
  using Error::Error;
};

// An allocation that failed: the memory of a tensor (or of a host buffer holding tensor
// data) could not be had. The message names the op, the bytes asked for and the device,
// and the shape and dtype when there is one: "zeros: out of memory: cannot allocate
// 1125899906842624 bytes (1.0 PiB) on cpu for a float32 tensor of shape [...]". Nothing
// was changed; freeing tensors and trying again may succeed.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

}  // namespace mixtape
