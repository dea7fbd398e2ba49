// Device: where a tensor's storage lives (the CPU, CUDA GPU n, or device n of a type a
// backend registered).
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>
#include <string_view>

namespace mixtape {

// A kind of device. CPU and CUDA are known by name to everyone (Device::cpu(), cuda());
// a backend for another kind registers its type (register_device_type), and the dispatch
// table and the backend registry have a slot for it like for these two.
enum class DeviceType : std::uint8_t { CPU = 0, CUDA = 1 };
// The most device types one process can have (the built-in two and registered ones).
inline constexpr int kDeviceTypeCount = 8;
// "cpu", "cuda", or the name a registered type was given; "device type N" for a number no
// type has.
std::string device_type_name(DeviceType type);
// The device type named `name`, registered now unless it already is (a name is lowercase
// letters and digits, starting with a letter: "xpu"). Throws ValueError for a bad name or
// when all kDeviceTypeCount types are taken.
DeviceType register_device_type(std::string_view name);

class Device {
 public:
  constexpr Device() = default;
  constexpr Device(DeviceType type, int index) : type_(type), index_(index) {}
  static constexpr Device cpu() { return Device(DeviceType::CPU, 0); }
  static constexpr Device cuda(int index = 0) { return Device(DeviceType::CUDA, index); }
  // Parses "cpu", "cuda", "cuda:1" (and "NAME", "NAME:N" for a registered device type);
  // throws ValueError otherwise.
  static Device parse(const std::string& name);

  constexpr DeviceType type() const { return type_; }
  constexpr int index() const { return index_; }
  constexpr bool is_cpu() const { return type_ == DeviceType::CPU; }
  constexpr bool is_cuda() const { return type_ == DeviceType::CUDA; }
  std::string str() const;  // "cpu", "cuda:0", "xpu:1"

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
