// Storage: one allocation on one device, shared by every tensor view of it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
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

  // The address of the allocation, to read: reading counts for nothing.
  const void* data() const { return data_; }
  // The address of the allocation, to write (or to read and write): every call counts as a
  // possible write and advances version(). Writers, and only writers, come through here.
  void* mutable_data() const {
    version_.fetch_add(1, std::memory_order_relaxed);
    return data_;
  }
  // How many times mutable_data() has been called: a copy derived from the data (a
  // Variable's autocast copy, mixtape/autograd/autocast.h) is current while this stays what
  // it was just after the copy was made.
  std::uint64_t version() const { return version_.load(std::memory_order_relaxed); }
  std::size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }

 private:
  void* data_ = nullptr;
  mutable std::atomic<std::uint64_t> version_{0};
  std::size_t nbytes_ = 0;
  Device device_;
};

// The bytes the storages of one device hold now, and the most they held at once since the
// process started or since reset_peak_memory(device) (as PyTorch's memory_allocated and
// max_memory_allocated); and the bytes the backend's caching allocator holds from the
// system for them, in use or kept for reuse, now and at most (memory_reserved and
// max_memory_reserved; a CUDA graph's pool included). What a backend allocates for itself (a
// library's workspace) is the device's to report (nvidia-smi). A backend without a caching
// allocator (a test's) reserves nothing. Devices with an index of kMemoryStatsDevices or more
// read 0.
struct MemoryStats {
  std::uint64_t in_use = 0;
  std::uint64_t peak = 0;
  std::uint64_t reserved = 0;
  std::uint64_t peak_reserved = 0;
};
inline constexpr int kMemoryStatsDevices = 64;
MemoryStats memory_stats(Device device);
// Starts both peaks again from what is held and reserved now.
void reset_peak_memory(Device device);

}  // namespace mixtape
