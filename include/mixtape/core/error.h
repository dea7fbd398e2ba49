// Exceptions thrown by mixtape. Every error derives from mixtape::Error, and the
// message names the op, the shapes and the dtypes involved.
//
// An error can be thrown again with context in front of its message, keeping its type:
// `catch (const Error& e) { e.rethrow_with_prefix("layer 'dense': "); }` throws a ShapeError
// for a ShapeError (layers name themselves in the errors of their calls this way). Each
// type below declares MIXTAPE_ERROR_TYPE(Name) for that; an error type of your own derived
// from one of them does the same, or is re-thrown as its base.
#pragma once

#include <stdexcept>
#include <string>

namespace mixtape {

// The member an error type declares to be re-thrown as itself (see above).
#define MIXTAPE_ERROR_TYPE(Name)                                                                 \
 protected:                                                                                      \
  void throw_prefixed(const std::string& prefix) const override { throw Name(prefix + what()); } \
                                                                                                 \
 public:

// Base of every exception mixtape throws.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
  // Throws a copy of this error, of its own type, with `prefix` before the message.
  [[noreturn]] void rethrow_with_prefix(const std::string& prefix) const {
    throw_prefixed(prefix);
    throw Error(prefix + what());  // an override that returned
  }

 protected:
  virtual void throw_prefixed(const std::string& prefix) const { throw Error(prefix + what()); }
};

// Shapes that do not fit the op (mismatch, bad reshape, bad broadcast).
class ShapeError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(ShapeError)
};

// A dtype the op cannot take, or a mix of dtypes with no promotion rule.
class DTypeError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(DTypeError)
};

// An index or axis out of range.
class IndexError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(IndexError)
};

// A bad argument value (unknown name, negative size, ...).
class ValueError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(ValueError)
};

// A file that cannot be read, written or fetched, or whose content is malformed.
class IOError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(IOError)
};

// No kernel is registered for (op, device, dtype).
class KernelNotFoundError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(KernelNotFoundError)
};

// Misuse of a GradientTape (consumed tape, non-scalar target without a seed, ...).
class AutogradError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(AutogradError)
};

// Non-finite values where training cannot go on: a NaN or infinite gradient given to an
// optimizer, or a loss scale that kept skipping steps (the model diverged).
class NumericError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(NumericError)
};

// A device that is not available, or tensors on different devices.
class DeviceError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(DeviceError)
};

// Something a captured step (StepGraph, mixtape/core/capture.h) cannot do: a host read of a
// value the capture has not computed, a random draw or another host value that every replay
// would repeat, work on another device than the captured one. The message names what and
// where; the capture is abandoned and nothing of it was run.
class CaptureError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(CaptureError)
};

// An allocation that failed: the memory of a tensor (or of a host buffer holding tensor
// data) could not be had. The message names the op, the bytes asked for and the device,
// and the shape and dtype when there is one: "zeros: out of memory: cannot allocate
// 1125899906842624 bytes (1.0 PiB) on cpu for a float32 tensor of shape [...]". Nothing
// was changed; freeing tensors and trying again may succeed.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(OutOfMemoryError)
};

}  // namespace mixtape
