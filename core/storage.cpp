// Storage: allocation through the device's backend.
#include "mixtape/core/storage.h"

#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <new>

#include "core/caching_allocator.h"
#include "core/raw.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/error.h"

namespace mixtape {
namespace {

// memory_stats' counts, by device type and index.
struct Held {
  std::atomic<std::uint64_t> in_use{0};
  std::atomic<std::uint64_t> peak{0};
  std::atomic<std::uint64_t> reserved{0};
  std::atomic<std::uint64_t> peak_reserved{0};
};
Held g_held[kDeviceTypeCount][kMemoryStatsDevices];

Held* held_on(Device device) {
  const auto type = static_cast<std::size_t>(device.type());
  if (type >= kDeviceTypeCount || device.index() < 0 || device.index() >= kMemoryStatsDevices)
    return nullptr;
  return &g_held[type][device.index()];
}

void raise_peak(std::atomic<std::uint64_t>& peak_of, std::uint64_t now) {
  std::uint64_t peak = peak_of.load(std::memory_order_relaxed);
  while (now > peak && !peak_of.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

}  // namespace

Storage::Storage(std::size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  check_device(device);
  try {
    data_ = backend_for(device.type()).allocate(nbytes, device.index());
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError("Storage: " + detail::out_of_memory_message(nbytes, device));
  }
  if (Held* h = held_on(device))
    raise_peak(h->peak, h->in_use.fetch_add(nbytes, std::memory_order_relaxed) + nbytes);
}

Storage::~Storage() {
  if (data_) backend_for(device_.type()).deallocate(data_, nbytes_, device_.index());
  if (Held* h = held_on(device_)) h->in_use.fetch_sub(nbytes_, std::memory_order_relaxed);
}

MemoryStats memory_stats(Device device) {
  const Held* h = held_on(device);
  if (h == nullptr) return {};
  return {h->in_use.load(std::memory_order_relaxed), h->peak.load(std::memory_order_relaxed),
          h->reserved.load(std::memory_order_relaxed),
          h->peak_reserved.load(std::memory_order_relaxed)};
}

void reset_peak_memory(Device device) {
  if (Held* h = held_on(device)) {
    h->peak.store(h->in_use.load(std::memory_order_relaxed));
    h->peak_reserved.store(h->reserved.load(std::memory_order_relaxed));
    // An allocation between a load and its store above raised nothing: raise again.
    raise_peak(h->peak, h->in_use.load(std::memory_order_relaxed));
    raise_peak(h->peak_reserved, h->reserved.load(std::memory_order_relaxed));
  }
}

namespace detail {

void count_reserved(Device device, std::int64_t bytes) {
  Held* h = held_on(device);
  if (h == nullptr) return;
  const auto b = static_cast<std::uint64_t>(bytes);  // (a negative count wraps: a subtraction)
  raise_peak(h->peak_reserved, h->reserved.fetch_add(b, std::memory_order_relaxed) + b);
}

std::string out_of_memory_message(std::uint64_t nbytes, Device device) {
  constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  std::string size = fmt::format("{} bytes", nbytes);
  if (nbytes >= 1024) {
    double v = static_cast<double>(nbytes) / 1024.0;
    std::size_t u = 0;
    while (v >= 1024.0 && u + 1 < std::size(kUnits)) {
      v /= 1024.0;
      ++u;
    }
    size += fmt::format(" ({:.1f} {})", v, kUnits[u]);
  }
  return fmt::format("out of memory: cannot allocate {} on {}", size, device.str());
}

void throw_out_of_memory(std::string_view op, std::uint64_t nbytes, Device device) {
  throw OutOfMemoryError(fmt::format("{}: {}", op, out_of_memory_message(nbytes, device)));
}

}  // namespace detail
}  // namespace mixtape
