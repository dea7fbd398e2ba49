// Tensor: an n-dimensional view (shape, strides, offset) of a Storage, tagged with a
// DType and living on a Device.
//
// Tensors have value semantics with shared data: copying a Tensor is cheap and the copy
// refers to the same tensor (same storage, same identity for GradientTape). View ops
// (reshape, permute, slice, expand) make new tensors that share the storage.
// The differentiable methods (to, reshape, permute, ...) are thin sugar over the ops in
// mixtape/autograd/ops.h (through TensorOps, below) and are recorded on active
// GradientTapes.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "mixtape/core/device.h"
#include "mixtape/core/dtype.h"
#include "mixtape/core/element_type.h"
#include "mixtape/core/error.h"
#include "mixtape/core/half.h"
#include "mixtape/core/shape.h"
#include "mixtape/core/storage.h"

namespace mixtape {

struct TensorImpl;

// Named, trainable state attached to a tensor that is a Variable.
struct VariableInfo {
  std::string name;
  bool trainable = true;
  bool autocast = false;  // read in the autocast dtype inside an AutocastScope (autocast.h)

  // The variable rounded to a 16-bit autocast dtype, kept between reads so that a read
  // under autocast costs no cast while the variable is unchanged (mixtape/autograd/
  // autocast.h): the copy, the storage it was made from, and that storage's version()
  // just after. Guarded by `mutex`.
  struct AutocastCopy {
    std::shared_ptr<TensorImpl> copy;
    std::weak_ptr<Storage> source;
    std::uint64_t version = 0;
  };
  AutocastCopy autocast_copy;
  std::mutex mutex;
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  std::int64_t offset = 0;  // in elements
  Shape shape;
  Strides strides;  // in elements
  DType dtype;
  std::uint64_t id = 0;                    // unique per TensorImpl, for tapes
  std::shared_ptr<VariableInfo> variable;  // set for Variables only
};

// The differentiable ops behind Tensor's methods to(), reshape(), permute(), ... They are
// the autograd layer's (mixtape/autograd/ops.h defines TensorOps<> with them, so that the
// methods record on tapes), and core depends on nothing above it: calling one of the methods
// without that header is a compile error naming TensorOps.
template <typename = void>
struct TensorOps;

class Tensor {
 public:
  Tensor() = default;  // an undefined tensor (e.g. the gradient of an unconnected source)
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // A new, uninitialised contiguous tensor. Throws ShapeError for a negative extent or a
  // shape whose size overflows (checked_nbytes in shape.h), and OutOfMemoryError when the
  // memory cannot be had.
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu());
  // A view of `base`'s storage (not of `base` itself: `offset` counts from the start of
  // the storage, as Tensor::offset() does) with the given geometry, in elements of
  // base's dtype; no copy. Every element the view can reach must lie inside the storage.
  // Throws ShapeError when the strides are not one per axis, an extent is negative, a
  // stride is negative (views never reverse) or the shape's size overflows, and
  // IndexError when the offset is negative or an element the view reaches (the furthest
  // one is offset + sum((extent - 1) * stride)) lies outside the storage; an empty view
  // may sit anywhere from 0 to the end of the storage.
  static Tensor view_of(const Tensor& base, Shape shape, Strides strides, std::int64_t offset);

  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  const Strides& strides() const { return impl().strides; }
  std::int64_t offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  std::size_t rank() const { return impl().shape.rank(); }
  std::int64_t numel() const { return impl().shape.numel(); }
  std::int64_t dim(int axis) const { return impl().shape.dim(axis); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype().itemsize(); }
  bool is_contiguous() const;
  std::uint64_t id() const { return impl().id; }
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // Address of the first element (storage base + offset), to write: a writer's access,
  // counted by the storage's version() (mixtape/core/storage.h) whether or not it writes.
  void* data_ptr() const;
  // Address of the first element, to read: not counted as a write. Kernels read their
  // inputs through this and write their outputs through data_ptr().
  const void* const_data_ptr() const;
  // Typed addresses of the first element, to write (data) and to read (const_data); both
  // throw DTypeError when T does not match.
  template <typename T>
  T* data() const {
    check_element<T>("Tensor::data");
    return static_cast<T*>(data_ptr());
  }
  template <typename T>
  const T* const_data() const {
    check_element<T>("Tensor::const_data");
    return static_cast<const T*>(const_data_ptr());
  }

  // The single element of a one-element tensor, converted to T (copied to the host).
  template <typename T>
  T item() const;
  // All elements in row-major order, converted to T (copied to the host).
  template <typename T>
  std::vector<T> to_vector() const;

  // --- Differentiable sugar over the ops of mixtape/autograd/ops.h ---------------------
  // Recorded on tapes like the ops themselves. They are the autograd layer's: see TensorOps
  // above (the template parameter is only that hook; leave it out).
  template <typename Ops = TensorOps<>>
  Tensor to(DType dtype) const {  // cast; a no-op returning *this when equal
    return Ops::cast(*this, dtype);
  }
  template <typename Ops = TensorOps<>>
  Tensor to(Device device) const {  // copy to another device; *this when equal
    return Ops::to_device(*this, device);
  }
  template <typename Ops = TensorOps<>>
  Tensor contiguous() const {  // *this when already contiguous
    return Ops::contiguous(*this);
  }
  template <typename Ops = TensorOps<>>
  Tensor reshape(const Shape& shape) const {  // one extent may be -1
    return Ops::reshape(*this, shape);
  }
  template <typename Ops = TensorOps<>>
  Tensor permute(const std::vector<int>& axes) const {
    return Ops::permute(*this, axes);
  }
  template <typename Ops = TensorOps<>>
  Tensor transpose(int axis0 = -2, int axis1 = -1) const {
    return Ops::transpose(*this, axis0, axis1);
  }
  template <typename Ops = TensorOps<>>
  Tensor slice(int axis, std::int64_t start, std::int64_t stop, std::int64_t step = 1) const {
    return Ops::slice(*this, axis, start, stop, step);
  }
  template <typename Ops = TensorOps<>>
  Tensor expand(const Shape& shape) const {  // broadcast view
    return Ops::expand(*this, shape);
  }
  template <typename Ops = TensorOps<>>
  Tensor detach() const {  // same data, never recorded
    return Ops::detach(*this);
  }

  // Variables: named trainable tensors (see mixtape/autograd/variable.h).
  bool is_variable() const { return defined() && impl().variable != nullptr; }

 protected:
  TensorImpl& impl() const;
  std::shared_ptr<TensorImpl> impl_;

 private:
  template <typename T>
  void check_element(const char* what) const {
    if (dtype_of<std::remove_const_t<T>>::value != dtype())
      throw DTypeError(fmt::format("{}: requested {} but the tensor is {}", what,
                                   dtype_of<std::remove_const_t<T>>::value.name(), dtype().name()));
  }
};

// Element conversion helper used by item/to_vector and factories.
namespace detail {
double read_as_double(const void* p, DType dtype);
void write_from_double(void* p, DType dtype, double v);
// Copies a tensor to a contiguous host buffer of the same dtype.
std::vector<std::uint8_t> host_bytes(const Tensor& t);
// Throws OutOfMemoryError "<op>: out of memory: cannot allocate N bytes (...) on <device>"
// (for host buffers that hold tensor data and fail to allocate).
[[noreturn]] void throw_out_of_memory(std::string_view op, std::uint64_t nbytes, Device device);
}  // namespace detail

template <typename T>
T Tensor::item() const {
  if (numel() != 1)
    throw ShapeError(fmt::format("Tensor::item: tensor of shape {} has {} elements, expected 1",
                                 shape().str(), numel()));
  auto bytes = detail::host_bytes(*this);
  return static_cast<T>(detail::read_as_double(bytes.data(), dtype()));
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  auto bytes = detail::host_bytes(*this);
  std::vector<T> out;
  try {
    out.resize(static_cast<std::size_t>(numel()));
  } catch (const std::bad_alloc&) {
    detail::throw_out_of_memory("Tensor::to_vector",
                                static_cast<std::uint64_t>(numel()) * sizeof(T), Device::cpu());
  }
  const std::size_t item = dtype().itemsize();
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<T>(detail::read_as_double(bytes.data() + i * item, dtype()));
  return out;
}

// --- Factories --------------------------------------------------------------------

namespace detail {
struct GeneratorAccess;
}  // namespace detail

// Seeded random number generator (64-bit Mersenne Twister); the same seed gives the
// same numbers on every platform. Copies share one state.
//
// Threads: a Generator is locked, not per-thread. Every draw takes its mutex, so threads
// may share one (the default generator is shared by every thread of the process) and no
// number is lost or drawn twice: together they draw exactly the generator's sequence.
// Which thread gets which numbers then depends on timing. A random factory holds the lock
// while it fills its tensor, so each tensor is one consecutive run of the sequence, the
// same run a single thread would have drawn in that order. For results that do not
// depend on how threads interleave, give each thread its own Generator (seeded from your
// seed and the thread's index) or pass seeds explicitly.
class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0x6d697874617065ULL);
  void seed(std::uint64_t seed);  // restarts the sequence
  std::uint64_t next_u64();
  double next_uniform();  // [0, 1)
  double next_normal();   // standard normal
  // Holds the generator for the calling thread until the returned lock is released: the
  // draws this thread makes meanwhile are consecutive numbers of the sequence (other
  // threads' draws wait). The lock is recursive, so draws through this Generator (or a
  // copy) may be made while holding it.
  std::unique_lock<std::recursive_mutex> lock() const;

 private:
  friend struct detail::GeneratorAccess;  // the factories draw a whole tensor under one lock
  struct State;
  std::shared_ptr<State> state_;
};
// The generator that factories and layers use when none is passed: one per process,
// shared by all threads and locked (see Generator).
Generator& default_generator();
// Reseeds the default generator (for every thread: there is one).
void manual_seed(std::uint64_t seed);

// Every factory refuses a shape with a negative extent or whose size overflows int64
// (ShapeError naming the factory and the shape, see checked_nbytes in shape.h) before it
// allocates anything, and throws OutOfMemoryError (naming the factory, the bytes, the
// device, the dtype and the shape) when the memory cannot be had.
Tensor zeros(const Shape& shape, DType dtype = kFloat32, Device device = Device::cpu());
Tensor ones(const Shape& shape, DType dtype = kFloat32, Device device = Device::cpu());
Tensor full(const Shape& shape, double value, DType dtype = kFloat32,
            Device device = Device::cpu());
Tensor zeros_like(const Tensor& t);
Tensor ones_like(const Tensor& t);
Tensor full_like(const Tensor& t, double value);
// [start, stop) by step, as a 1-D tensor. Throws ValueError for a zero or non-finite
// step or bound, and for a range of more elements than a tensor can hold (counted before
// anything is allocated: arange(0, 1e30) is refused at once).
Tensor arange(double start, double stop, double step = 1.0, DType dtype = kFloat32,
              Device device = Device::cpu());
Tensor arange(std::int64_t stop, DType dtype = kInt64, Device device = Device::cpu());
// Copies host values into a new tensor of the given shape (numel must match; ShapeError).
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape,
                   DType dtype = dtype_of<T>::value, Device device = Device::cpu());
Tensor uniform(const Shape& shape, double low = 0.0, double high = 1.0, DType dtype = kFloat32,
               Device device = Device::cpu(), Generator* gen = nullptr);
Tensor normal(const Shape& shape, double mean = 0.0, double stddev = 1.0, DType dtype = kFloat32,
              Device device = Device::cpu(), Generator* gen = nullptr);

namespace detail {
// Copies `count` host elements of `src_dtype` into a new tensor, cast to `dtype`.
Tensor from_host(const void* data, std::size_t count, DType src_dtype, const Shape& shape,
                 DType dtype, Device device);
}  // namespace detail
template <typename T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape, DType dtype, Device device) {
  if constexpr (std::is_same_v<T, bool>) {
    std::vector<std::uint8_t> bytes;
    try {
      bytes.assign(values.begin(), values.end());
    } catch (const std::bad_alloc&) {
      detail::throw_out_of_memory("from_vector", values.size(), Device::cpu());
    }
    return detail::from_host(bytes.data(), bytes.size(), kBool, shape, dtype, device);
  } else {
    return detail::from_host(values.data(), values.size(), dtype_of<T>::value, shape, dtype,
                             device);
  }
}

// Multi-line, numpy-like text of a tensor (large tensors are summarised with "...").
std::string to_string(const Tensor& t);

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::Tensor> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::Tensor& t, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(mixtape::to_string(t), ctx);
  }
};
