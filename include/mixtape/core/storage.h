// Storage: one allocation on one device, shared by every tensor view of it.
#pragma once

#include <cstddef>
#include <memory>

#include "mixtape/core/device.h"

namespace mixtape {

class Storage {
 public:
  // Allocates nbytes on `device` through its backend's allocator.
  Storage(std::size_t nbytes, Device device);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  std::size_t nbytes_ = 0;
  Device device_;
};

}  // namespace mixtape
