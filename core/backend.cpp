// The registry of device backends, and the initializers backend libraries announce.
#include "mixtape/core/backend.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <vector>

#include "core/registry_init.h"
#include "mixtape/core/error.h"

namespace mixtape {
namespace {

std::array<std::unique_ptr<Backend>, kDeviceTypeCount>& backends() {
  static std::array<std::unique_ptr<Backend>, kDeviceTypeCount> table;
  return table;
}

struct Initializers {
  std::mutex mutex;
  std::vector<void (*)()> pending, done;
  std::atomic<bool> any_pending{false};
};
Initializers& initializers() {
  static Initializers i;
  return i;
}

// While an initializer runs on this thread: the device types it registers (so that they
// are checked), and a guard against look-ups it makes re-entering ensure_backends.
thread_local std::vector<DeviceType>* t_registered = nullptr;

}  // namespace

void add_backend_initializer(void (*initialize)()) {
  Initializers& in = initializers();
  std::lock_guard<std::mutex> lock(in.mutex);
  if (std::find(in.done.begin(), in.done.end(), initialize) != in.done.end() ||
      std::find(in.pending.begin(), in.pending.end(), initialize) != in.pending.end())
    return;
  in.pending.push_back(initialize);
  in.any_pending.store(true, std::memory_order_release);
}

namespace detail {
void ensure_backends() {
  Initializers& in = initializers();
  if (!in.any_pending.load(std::memory_order_acquire) || t_registered) return;
  std::lock_guard<std::mutex> lock(in.mutex);
  while (!in.pending.empty()) {
    std::vector<DeviceType> registered;
    t_registered = &registered;
    try {
      in.pending.front()();
      for (DeviceType t : registered) check_kernel_coverage(t);
    } catch (...) {
      t_registered = nullptr;  // stays pending: tried again at the next use
      throw;
    }
    t_registered = nullptr;
    in.done.push_back(in.pending.front());
    in.pending.erase(in.pending.begin());
  }
  in.any_pending.store(false, std::memory_order_release);
}
}  // namespace detail

namespace {
// Backend::read_back's default: the bytes read at once.
class ReadNow final : public PendingRead {
 public:
  ReadNow(Backend& backend, const void* src, int device_index, std::size_t nbytes) : size_(nbytes) {
    backend.copy(bytes_.data(), Device::cpu(), src, Device(backend.type(), device_index), nbytes);
  }
  void wait(void* dst) override { std::memcpy(dst, bytes_.data(), size_); }
  bool ready() override { return true; }

 private:
  std::array<unsigned char, Backend::kMaxReadBack> bytes_{};
  std::size_t size_;
};
}  // namespace

std::unique_ptr<PendingRead> Backend::read_back(const void* src, int device_index,
                                                std::size_t nbytes) {
  capture::forbid_read(Device(type(), device_index), "read_back");
  if (nbytes > kMaxReadBack)
    throw ValueError(fmt::format("{} backend: read_back of {} bytes (at most {})", name(), nbytes,
                                 kMaxReadBack));
  return std::make_unique<ReadNow>(*this, src, device_index, nbytes);
}

void Backend::begin_capture(int device_index) {
  throw DeviceError(fmt::format("StepGraph::capture on {}: the {} backend cannot capture a step",
                                Device(type(), device_index).str(), name()));
}

std::unique_ptr<CapturedWork> Backend::end_capture(int device_index) {
  throw DeviceError(fmt::format("StepGraph::capture on {}: the {} backend cannot capture a step",
                                Device(type(), device_index).str(), name()));
}

void Backend::abort_capture(int /*device_index*/) {}

void register_backend(std::unique_ptr<Backend> backend) {
  const DeviceType type = backend->type();
  spdlog::debug("mixtape: {} backend registered ({} device(s))", backend->name(),
                backend->device_count());
  backends()[static_cast<std::size_t>(type)] = std::move(backend);
  if (t_registered) t_registered->push_back(type);
}

bool has_backend(DeviceType type) {
  detail::ensure_backends();
  return backends()[static_cast<std::size_t>(type)] != nullptr;
}

Backend& backend_for(DeviceType type) {
  detail::ensure_backends();
  auto& b = backends()[static_cast<std::size_t>(type)];
  if (!b)
    throw DeviceError(fmt::format(
        "no {} backend: this program registers none (a backend registers when its header is "
        "included: mixtape/mixtape.h includes the CPU backend's, and the CUDA backend's when "
        "the program links mixtape::cuda)",
        device_type_name(type)));
  return *b;
}

void check_device(Device device) {
  Backend& b = backend_for(device.type());
  const int n = b.device_count();
  if (device.index() < 0 || device.index() >= n)
    throw DeviceError(fmt::format("device {} is not available ({} {} device{} present)",
                                  device.str(), n, b.name(), n == 1 ? "" : "s"));
}

}  // namespace mixtape
