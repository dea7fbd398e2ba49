// The registry of device backends.
#include "mixtape/core/backend.h"

#include <spdlog/spdlog.h>

#include <array>
#include <mutex>

#include "core/registry_init.h"
#include "mixtape/core/error.h"

namespace mixtape {
namespace {
std::array<std::unique_ptr<Backend>, kDeviceTypeCount>& backends() {
  static std::array<std::unique_ptr<Backend>, kDeviceTypeCount> table;
  return table;
}
std::once_flag g_init;
}  // namespace

namespace detail {
void ensure_backends() {
  std::call_once(g_init, [] {
    register_builtin_backends();
    for (int t = 0; t < kDeviceTypeCount; ++t)
      if (backends()[static_cast<std::size_t>(t)])
        check_kernel_coverage(static_cast<DeviceType>(t));
  });
}
}  // namespace detail

void register_backend(std::unique_ptr<Backend> backend) {
  const auto t = static_cast<std::size_t>(backend->type());
  spdlog::debug("mixtape: {} backend registered ({} device(s))", backend->name(),
                backend->device_count());
  backends()[t] = std::move(backend);
}

bool has_backend(DeviceType type) {
  detail::ensure_backends();
  return backends()[static_cast<std::size_t>(type)] != nullptr;
}

Backend& backend_for(DeviceType type) {
  detail::ensure_backends();
  auto& b = backends()[static_cast<std::size_t>(type)];
  if (!b)
    throw DeviceError(fmt::format("no {} backend: this build of mixtape has no support for it",
                                  type == DeviceType::CUDA ? "CUDA" : "CPU"));
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
