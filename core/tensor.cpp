// Tensor storage and geometry, host access, and the non-differentiable helpers that
// core needs (contiguous copies, casts, device copies, fills).
#include "mixtape/core/tensor.h"

#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <string>
#include <string_view>
#include <vector>

#include "core/raw.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/float8.h"

namespace mixtape {
namespace {
std::atomic<std::uint64_t> g_next_id{1};

std::shared_ptr<TensorImpl> new_impl(std::shared_ptr<Storage> storage, std::int64_t offset,
                                     Shape shape, Strides strides, DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->offset = offset;
  impl->shape = std::move(shape);
  impl->strides = std::move(strides);
  impl->dtype = dtype;
  impl->id = g_next_id.fetch_add(1, std::memory_order_relaxed);
  return impl;
}

// The checks of Tensor::view_of: see its comment in tensor.h.
void check_view(const Tensor& base, const Shape& shape, const Strides& strides,
                std::int64_t offset) {
  constexpr std::string_view op = "Tensor::view_of";
  // Formatted only for a message (views are made on every view op).
  const auto geometry = [&] {
    return fmt::format("shape {} with strides [{}] at offset {}", shape.str(),
                       fmt::join(strides, ", "), offset);
  };
  if (strides.size() != shape.rank())
    throw ShapeError(fmt::format("{}: a view of {}: {} strides for {} axes", op, geometry(),
                                 strides.size(), shape.rank()));
  const std::int64_t numel = checked_numel(shape, op);
  checked_nbytes(shape, base.dtype(), op);
  for (const std::int64_t s : strides)
    if (s < 0)
      throw ShapeError(
          fmt::format("{}: a view of {}: negative strides are not supported", op, geometry()));
  const auto capacity =
      static_cast<std::int64_t>(base.storage()->nbytes() / base.dtype().itemsize());
  const auto storage = [&] {
    return fmt::format("a storage of {} elements of {}", capacity, base.dtype());
  };
  if (offset < 0)
    throw IndexError(fmt::format("{}: a view of {}: the offset is negative", op, geometry()));
  if (numel == 0) {
    if (offset > capacity)
      throw IndexError(
          fmt::format("{}: a view of {} starts after the end of {}", op, geometry(), storage()));
    return;
  }
  // The furthest element the view reaches (the strides are >= 0).
  std::int64_t last = offset;
  for (std::size_t i = 0; i < shape.rank(); ++i) {
    std::int64_t step = 0;
    if (__builtin_mul_overflow(shape[i] - 1, strides[i], &step) ||
        __builtin_add_overflow(last, step, &last))
      throw IndexError(fmt::format("{}: a view of {} reaches past element 2^63 - 1, outside {}", op,
                                   geometry(), storage()));
  }
  if (last >= capacity)
    throw IndexError(fmt::format("{}: a view of {} reaches element {}, outside {}", op, geometry(),
                                 last, storage()));
}

}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  return detail::empty_raw(shape, dtype, device, "Tensor::empty");
}

Tensor Tensor::view_of(const Tensor& base, Shape shape, Strides strides, std::int64_t offset) {
  check_view(base, shape, strides, offset);
  return Tensor(
      new_impl(base.storage(), offset, std::move(shape), std::move(strides), base.dtype()));
}

TensorImpl& Tensor::impl() const {
  if (!impl_)
    throw Error(
        "use of an undefined Tensor (for example the gradient of a source "
        "that is not connected to the target)");
  return *impl_;
}

bool Tensor::is_contiguous() const {
  const auto& s = shape();
  const auto& st = strides();
  std::int64_t expected = 1;
  for (std::size_t i = s.rank(); i-- > 0;) {
    if (s[i] == 1) continue;
    if (st[i] != expected) return false;
    expected *= s[i];
  }
  return true;
}

void* Tensor::data_ptr() const {
  return static_cast<char*>(storage()->mutable_data()) +
         offset() * static_cast<std::int64_t>(dtype().itemsize());
}

const void* Tensor::const_data_ptr() const {
  return static_cast<const char*>(storage()->data()) +
         offset() * static_cast<std::int64_t>(dtype().itemsize());
}

namespace detail {

Tensor empty_raw(const Shape& shape, DType dtype, Device device, std::string_view op) {
  const std::int64_t nbytes = checked_nbytes(shape, dtype, op);
  std::shared_ptr<Storage> storage;
  try {
    storage = std::make_shared<Storage>(static_cast<std::size_t>(nbytes), device);
  } catch (const OutOfMemoryError&) {
    throw OutOfMemoryError(fmt::format(
        "{}: {} for a {} tensor of shape {}", op,
        out_of_memory_message(static_cast<std::uint64_t>(nbytes), device), dtype, shape.str()));
  }
  return Tensor(new_impl(std::move(storage), 0, shape, contiguous_strides(shape), dtype));
}

Tensor contiguous_raw(const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = Tensor::empty(t.shape(), t.dtype(), t.device());
  if (t.numel() > 0) find_kernel<kernels::CopyFn>(OpId::copy, t.device().type(), t.dtype())(t, out);
  return out;
}

Tensor cast_raw(const Tensor& t, DType dtype) {
  if (t.dtype() == dtype) return contiguous_raw(t);
  Tensor src = contiguous_raw(t);
  Tensor out = Tensor::empty(t.shape(), dtype, t.device());
  if (t.numel() > 0)
    find_kernel<kernels::CastFn>(OpId::cast, t.device().type(), t.dtype())(src, out);
  return out;
}

Tensor to_device_raw(const Tensor& t, Device device) {
  if (t.device() == device) return contiguous_raw(t);
  if (device.is_cpu()) {
    capture::forbid_read(t.device(), fmt::format("to({})", device.str()));
    detail::count_host_read(t.device(), "copy to the host (to, item, to_vector)");
  }
  Tensor src = contiguous_raw(t);
  Tensor out = Tensor::empty(t.shape(), t.dtype(), device);
  // The non-CPU side's backend knows how to copy to and from the host.
  const Device other = device.is_cpu() ? t.device() : device;
  if (!t.device().is_cpu() && !device.is_cpu() && t.device().type() != device.type())
    throw DeviceError(
        fmt::format("to({}): no direct copy from {}", device.str(), t.device().str()));
  backend_for(other.type())
      .copy(out.data_ptr(), device, src.const_data_ptr(), t.device(), t.nbytes());
  if (device.is_cpu()) run_deferred_checks();  // the device got here: their reads are done
  return out;
}

namespace {
struct DeferredCheck {
  std::function<bool()> ready;
  std::function<void()> check;
};
struct DeferredChecks {
  std::mutex mutex;
  std::vector<DeferredCheck> checks;
};
DeferredChecks& deferred_checks() {
  static auto* d = new DeferredChecks();  // never destroyed (checks may run at exit)
  return *d;
}
thread_local bool t_running_checks = false;
}  // namespace

void defer_check(std::function<bool()> ready, std::function<void()> check) {
  DeferredChecks& d = deferred_checks();
  std::lock_guard<std::mutex> lock(d.mutex);
  d.checks.push_back({std::move(ready), std::move(check)});
}

void run_deferred_checks(bool only_ready) {
  if (t_running_checks) return;
  std::vector<DeferredCheck> checks;
  {
    DeferredChecks& d = deferred_checks();
    std::lock_guard<std::mutex> lock(d.mutex);
    if (d.checks.empty()) return;
    if (only_ready) {  // the ready ones, in order; the rest stay queued
      std::vector<DeferredCheck> later;
      for (auto& c : d.checks) (c.ready() ? checks : later).push_back(std::move(c));
      d.checks.swap(later);
    } else {
      checks.swap(d.checks);
    }
  }
  t_running_checks = true;
  std::exception_ptr first;
  for (auto& c : checks) {
    try {
      c.check();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  t_running_checks = false;
  if (first) std::rethrow_exception(first);
}

void fill_raw(const Tensor& t, double value) {
  if (t.numel() > 0)
    find_kernel<kernels::FillFn>(OpId::fill, t.device().type(), t.dtype())(t, value);
}

double read_as_double(const void* p, DType dtype) {
  switch (dtype.code()) {
    case DType::Float32:
      return *static_cast<const float*>(p);
    case DType::Float16:
      return static_cast<float>(*static_cast<const half*>(p));
    case DType::BFloat16:
      return static_cast<float>(*static_cast<const bfloat16*>(p));
    case DType::Float64:
      return *static_cast<const double*>(p);
    case DType::Int32:
      return *static_cast<const std::int32_t*>(p);
    case DType::Int64:
      return static_cast<double>(*static_cast<const std::int64_t*>(p));
    case DType::UInt8:
      return *static_cast<const std::uint8_t*>(p);
    case DType::Bool:
      return *static_cast<const std::uint8_t*>(p) != 0 ? 1.0 : 0.0;
    case DType::Float8E4M3FN:
      return static_cast<float>(*static_cast<const float8_e4m3fn*>(p));
    case DType::Float8E5M2:
      return static_cast<float>(*static_cast<const float8_e5m2*>(p));
  }
  return 0.0;
}

void write_from_double(void* p, DType dtype, double v) {
  switch (dtype.code()) {
    case DType::Float32:
      *static_cast<float*>(p) = static_cast<float>(v);
      break;
    case DType::Float16:
      *static_cast<half*>(p) = half(static_cast<float>(v));
      break;
    case DType::BFloat16:
      *static_cast<bfloat16*>(p) = bfloat16(static_cast<float>(v));
      break;
    case DType::Float64:
      *static_cast<double*>(p) = v;
      break;
    case DType::Int32:
      *static_cast<std::int32_t*>(p) = static_cast<std::int32_t>(v);
      break;
    case DType::Int64:
      *static_cast<std::int64_t*>(p) = static_cast<std::int64_t>(v);
      break;
    case DType::UInt8:
      *static_cast<std::uint8_t*>(p) = static_cast<std::uint8_t>(v);
      break;
    case DType::Bool:
      *static_cast<std::uint8_t*>(p) = v != 0.0 ? 1 : 0;
      break;
    case DType::Float8E4M3FN:
      *static_cast<float8_e4m3fn*>(p) = float8_e4m3fn(round_to_odd_float(v));
      break;
    case DType::Float8E5M2:
      *static_cast<float8_e5m2*>(p) = float8_e5m2(round_to_odd_float(v));
      break;
  }
}

std::vector<std::uint8_t> host_bytes(const Tensor& t) {
  capture::forbid_read(t.device(), "Tensor::item / to_vector");
  Tensor c = to_device_raw(t, Device::cpu());
  std::vector<std::uint8_t> out;
  try {
    out.resize(c.nbytes());
  } catch (const std::bad_alloc&) {
    throw_out_of_memory("host_bytes", c.nbytes(), Device::cpu());
  }
  if (!out.empty()) std::memcpy(out.data(), c.const_data_ptr(), out.size());
  return out;
}

Tensor from_host(const void* data, std::size_t count, DType src_dtype, const Shape& shape,
                 DType dtype, Device device) {
  const std::int64_t numel = checked_numel(shape, "from_vector");
  if (count != static_cast<std::uint64_t>(numel))
    throw ShapeError(
        fmt::format("from_vector: {} values cannot fill a tensor of shape {} ({} elements)", count,
                    shape.str(), numel));
  checked_nbytes(shape, dtype, "from_vector");
  Tensor host = empty_raw(shape, src_dtype, Device::cpu(), "from_vector");
  if (count) std::memcpy(host.data_ptr(), data, count * src_dtype.itemsize());
  return to_device_raw(cast_raw(host, dtype), device);
}

}  // namespace detail
}  // namespace mixtape
