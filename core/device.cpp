// Device names, and the device types backends register.
#include "mixtape/core/device.h"

#include <array>
#include <mutex>

#include "mixtape/core/error.h"

namespace mixtape {
namespace {

struct TypeNames {
  std::mutex mutex;
  std::array<std::string, kDeviceTypeCount> names{"cpu", "cuda"};
};
TypeNames& type_names() {
  static TypeNames t;
  return t;
}

bool valid_type_name(std::string_view name) {
  if (name.empty() || name.size() > 16 || name[0] < 'a' || name[0] > 'z') return false;
  for (char c : name)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'))) return false;
  return true;
}

// The registered type of `name`, if any.
bool find_type(std::string_view name, DeviceType* type) {
  TypeNames& t = type_names();
  std::lock_guard<std::mutex> lock(t.mutex);
  for (int i = 0; i < kDeviceTypeCount; ++i) {
    if (!t.names[static_cast<std::size_t>(i)].empty() &&
        t.names[static_cast<std::size_t>(i)] == name) {
      *type = static_cast<DeviceType>(i);
      return true;
    }
  }
  return false;
}

std::string valid_device_names() {
  TypeNames& t = type_names();
  std::lock_guard<std::mutex> lock(t.mutex);
  std::string out = "cpu";
  for (int i = 1; i < kDeviceTypeCount; ++i) {
    const std::string& n = t.names[static_cast<std::size_t>(i)];
    if (!n.empty()) out += fmt::format(", {}, {}:N", n, n);
  }
  return out;
}

}  // namespace

std::string device_type_name(DeviceType type) {
  const auto i = static_cast<std::size_t>(type);
  if (i < static_cast<std::size_t>(kDeviceTypeCount)) {
    TypeNames& t = type_names();
    std::lock_guard<std::mutex> lock(t.mutex);
    if (!t.names[i].empty()) return t.names[i];
  }
  return fmt::format("device type {}", i);
}

DeviceType register_device_type(std::string_view name) {
  if (!valid_type_name(name) || name == "gpu")
    throw ValueError(fmt::format(
        "register_device_type: '{}' is not a device type name (lowercase letters and digits, "
        "starting with a letter, at most 16)",
        name));
  TypeNames& t = type_names();
  std::lock_guard<std::mutex> lock(t.mutex);
  for (int i = 0; i < kDeviceTypeCount; ++i)
    if (t.names[static_cast<std::size_t>(i)] == name) return static_cast<DeviceType>(i);
  for (int i = 0; i < kDeviceTypeCount; ++i) {
    if (t.names[static_cast<std::size_t>(i)].empty()) {
      t.names[static_cast<std::size_t>(i)] = std::string(name);
      return static_cast<DeviceType>(i);
    }
  }
  throw ValueError(fmt::format("register_device_type: '{}': all {} device types are taken", name,
                               kDeviceTypeCount));
}

Device Device::parse(const std::string& name) {
  if (name == "gpu") return cuda(0);
  const std::size_t colon = name.find(':');
  const std::string type_name = name.substr(0, colon);
  DeviceType type;
  if (find_type(type_name, &type)) {
    if (colon == std::string::npos) return Device(type, 0);
    const std::string idx = name.substr(colon + 1);
    if (type != DeviceType::CPU && !idx.empty() &&
        idx.find_first_not_of("0123456789") == std::string::npos && idx.size() < 6)
      return Device(type, std::stoi(idx));
  }
  throw ValueError(fmt::format("unknown device '{}'; valid: {}", name, valid_device_names()));
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : fmt::format("{}:{}", device_type_name(type_), index_);
}

}  // namespace mixtape
