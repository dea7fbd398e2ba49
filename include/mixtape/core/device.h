// Device: where a tensor's storage lives (the CPU, or CUDA GPU n).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace mixtape {

enum class DeviceType : std::uint8_t { CPU = 0, CUDA = 1 };
inline constexpr int kDeviceTypeCount = 2;
// "cpu", "cuda": the name of a device type in device strings and messages.
const char* device_type_name(DeviceType type);

class Device {
 public:
  constexpr Device() = default;
  constexpr Device(DeviceType type, int index) : type_(type), index_(index) {}
  static constexpr Device cpu() { return Device(DeviceType::CPU, 0); }
  static constexpr Device cuda(int index = 0) { return Device(DeviceType::CUDA, index); }
  // Parses "cpu", "cuda", "cuda:1"; throws ValueError otherwise.
  static Device parse(const std::string& name);

  constexpr DeviceType type() const { return type_; }
  constexpr int index() const { return index_; }
  constexpr bool is_cpu() const { return type_ == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type_ == DeviceType::CUDA; }
  std::string str() const;  // "cpu", "cuda:0"

  friend constexpr bool operator==(Device a, Device b) {
    return a.type_ == b.type_ && a.index_ == b.index_;
  }

 private:
  DeviceType type_ = DeviceType::CPU;
  int index_ = 0;
};

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::Device> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::Device& d, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(d.str(), ctx);
  }
};
