// Storage: allocation through the device's backend.
#include "mixtape/core/storage.h"

#include <fmt/format.h>

#include <new>

#include "core/raw.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/error.h"

namespace mixtape {

Storage::Storage(std::size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  check_device(device);
  try {
    data_ = backend_for(device.type()).allocate(nbytes, device.index());
  } catch (const std::bad_alloc&) {
    throw OutOfMemoryError("Storage: " + detail::out_of_memory_message(nbytes, device));
  }
}

Storage::~Storage() {
  if (data_) backend_for(device_.type()).deallocate(data_, nbytes_, device_.index());
}

namespace detail {

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
