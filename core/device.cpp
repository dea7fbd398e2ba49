// Device names.
#include "mixtape/core/device.h"

#include "mixtape/core/error.h"

namespace mixtape {

Device Device::parse(const std::string& name) {
  if (name == "cpu") return cpu();
  if (name == "cuda" || name == "gpu") return cuda(0);
  if (name.rfind("cuda:", 0) == 0) {
    const std::string idx = name.substr(5);
    if (!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos && idx.size() < 6)
      return cuda(std::stoi(idx));
  }
  throw ValueError(fmt::format("unknown device '{}'; valid: cpu, cuda, cuda:N", name));
}

const char* device_type_name(DeviceType type) { return type == DeviceType::CPU ? "cpu" : "cuda"; }

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : fmt::format("{}:{}", device_type_name(type_), index_);
}

}  // namespace mixtape
