// Storage: allocation through the device's backend.
#include "mixtape/core/storage.h"

#include "mixtape/core/backend.h"

namespace mixtape {

Storage::Storage(std::size_t nbytes, Device device) : nbytes_(nbytes), device_(device) {
  check_device(device);
  data_ = backend_for(device.type()).allocate(nbytes, device.index());
}

Storage::~Storage() {
  if (data_) backend_for(device_.type()).deallocate(data_, nbytes_, device_.index());
}

}  // namespace mixtape
