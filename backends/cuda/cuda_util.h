// Private to the CUDA backend: error checks that name the call, the file and the line, the
// one stream per device that every kernel and copy runs on, launch geometry, and the
// mapping of mixtape's element types to CUDA's. Included by the .cpp and the .cu files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "mixtape/core/element_type.h"

namespace mixtape::cuda_backend {

// Throws DeviceError "<what> failed at <file>:<line>: <error name>: <description>".
[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line);
inline void check_cuda(cudaError_t err, const char* what, const char* file, int line) {
  if (err != cudaSuccess) throw_cuda_error(err, what, file, line);
}

// Every CUDA runtime call goes through this: MIXTAPE_CUDA_CHECK(cudaMalloc(&p, n)).
#define MIXTAPE_CUDA_CHECK(call) \
  ::mixtape::cuda_backend::check_cuda((call), #call, __FILE__, __LINE__)
// After a kernel launch: the launch error (a bad configuration), without waiting.
#define MIXTAPE_CUDA_CHECK_LAUNCH(name) \
  ::mixtape::cuda_backend::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)

// The stream of device `index` (created on first use, non-blocking); all work of the
// backend on that device is queued on it, in order.
cudaStream_t stream(int index);
// The scope in which a kernel's host code queues work on device `index`, and the stream it
// queues it on (stream(index)). Made after checking that the calling thread does not capture a
// step on another device, where the work would run now and not be replayed (CaptureError
// naming the op; capture::detail::check_launch), and after waiting for another thread's
// capture on device `index` to end; until the scope ends, no other thread's capture starts
// there (the work would be recorded into its graph: backends/cuda/capture_table.h).
class LaunchScope {
 public:
  explicit LaunchScope(int index);
  ~LaunchScope();
  LaunchScope(const LaunchScope&) = delete;
  LaunchScope& operator=(const LaunchScope&) = delete;
  cudaStream_t stream() const { return stream_; }

 private:
  int index_;
  cudaStream_t stream_ = nullptr;
};

// Makes `index` the current device for the scope, and restores the previous one.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Scratch memory for library calls (cuDNN workspaces, ...): a block of at least `bytes` on
// device `index`, from the caching allocator; freed (back to the cache) with the handle.
class Workspace {
 public:
  Workspace(std::size_t bytes, int index);
  ~Workspace();
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  void* data() const { return ptr_; }
  std::size_t size() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  int index_ = 0;
};

// --- Launch geometry ----------------------------------------------------------------------

inline constexpr int kThreads = 256;
// Blocks for a grid-stride loop over n elements (at most 65535 * 8, the loop covers the rest).
inline unsigned blocks_for(std::int64_t n, int threads = kThreads) {
  const std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 1 ? 1 : (b > 65535 * 8 ? 65535 * 8 : b));
}

// --- Element types ------------------------------------------------------------------------

// The CUDA backend's type map: the device storage type of each dtype. The host map
// (mixtape/core/element_type.h) with CUDA's own 16-bit and 8-bit float types (half ->
// __half, bfloat16 -> __nv_bfloat16, float8_e4m3fn -> __nv_fp8_e4m3, float8_e5m2 ->
// __nv_fp8_e5m2: the same bits); bool is handled as its byte (0 or 1).
template <DType::Code C>
using dev_t = std::conditional_t<
    C == DType::Float16, __half,
    std::conditional_t<C == DType::BFloat16, __nv_bfloat16,
                       std::conditional_t<C == DType::Float8E4M3FN, __nv_fp8_e4m3,
                                          std::conditional_t<C == DType::Float8E5M2, __nv_fp8_e5m2,
                                                             element_t<C>>>>>;
// The device type of a host storage type (half -> __half, float -> float, ...).
template <typename T>
using cuda_t = dev_t<dtype_of<T>::value.code()>;

// Kernels take device pointers of the CUDA type.
template <typename T>
cuda_t<T>* device_ptr(void* p) {
  return static_cast<cuda_t<T>*>(p);
}
template <typename T>
const cuda_t<T>* device_ptr(const void* p) {
  return static_cast<const cuda_t<T>*>(p);
}

}  // namespace mixtape::cuda_backend
