// mixtape::cuda: questions about GPUs answered through the backend registry, so they work
// in builds without the CUDA backend too.
#include "mixtape/core/cuda.h"

#include <atomic>

#include "mixtape/core/capture.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/error.h"

namespace mixtape::cuda {

namespace {
std::atomic<bool> g_allow_tf32{false};
}  // namespace

int device_count() {
  return has_backend(DeviceType::CUDA) ? backend_for(DeviceType::CUDA).device_count() : 0;
}

bool available() { return device_count() > 0; }

DeviceProperties properties(int index) {
  check_device(Device::cuda(index));
  return backend_for(DeviceType::CUDA).properties(index);
}

void synchronize(int index) {
  check_device(Device::cuda(index));
  capture::forbid_read(Device::cuda(index), "cuda::synchronize");
  detail::count_host_read(Device::cuda(index), "cuda::synchronize");
  backend_for(DeviceType::CUDA).synchronize(index);
}

void profiler_start(int index) {
  check_device(Device::cuda(index));
  backend_for(DeviceType::CUDA).profiler_range(index, true);
}

void profiler_stop(int index) {
  check_device(Device::cuda(index));
  backend_for(DeviceType::CUDA).profiler_range(index, false);
}

void set_allow_tf32(bool allow) { g_allow_tf32 = allow; }
bool allow_tf32() { return g_allow_tf32; }

}  // namespace mixtape::cuda
