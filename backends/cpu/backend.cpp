// The CPU backend: 64-byte aligned host memory, memcpy copies, and kernel registration.
#include "mixtape/core/backend.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_map>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/caching_allocator.h"
#include "core/env.h"
#include "mixtape/core/error.h"

namespace mixtape::cpu {
namespace {

// The caching allocator (core/caching_allocator.h): size classes of 64-byte multiples up to
// 64 KiB, larger blocks carved from segments (20 MiB, or a larger request's own rounded to 2
// MiB); at most MIXTAPE_CPU_CACHE_MB megabytes kept free (0 to 1048576, default 1024: beyond
// it wholly free segments, the largest first, then small blocks go back to the system, whatever
// was freed last), read when the
// backend is registered, at the first tensor (a bad value throws ValueError there, and
// registration is tried again on the next use). Aligned for 512-bit vector loads.
constexpr std::size_t kAlignment = 64;

detail::CachingAllocator::Config cpu_allocator_config() {
  detail::CachingAllocator::Config c;
  c.quantum = kAlignment;
  c.small_limit = std::size_t{64} << 10;
  c.keep_limit = static_cast<std::size_t>(detail::env::kCpuCacheMb.read()) << 20;
  return c;
}

detail::CachingAllocator::System cpu_system() {
  return {.obtain = [](int, std::size_t bytes) { return std::aligned_alloc(kAlignment, bytes); },
          .give_back = [](int, void* p) { std::free(p); }};
}

class CpuBackend final : public Backend {
 public:
  DeviceType type() const override { return DeviceType::CPU; }
  std::string name() const override { return "CPU"; }
  int device_count() const override { return 1; }

  void* allocate(std::size_t nbytes, int /*device_index*/) override {
    // Every op allocates its output on the thread that runs its kernel: the point where
    // that thread's OpenMP count follows the load (threads.cpp).
    apply_thread_count();
    // Aligned for 512-bit vector loads; a size of 0 still gets a unique pointer.
    void* p = cache_.allocate(0, nbytes);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* ptr, std::size_t nbytes, int /*device_index*/) override {
    cache_.deallocate(0, ptr, nbytes);
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device,
            std::size_t nbytes) override {
    if (!dst_device.is_cpu() || !src_device.is_cpu())
      throw DeviceError(
          fmt::format("CPU backend cannot copy from {} to {}", src_device.str(), dst_device.str()));
    if (nbytes) std::memmove(dst, src, nbytes);
  }
  void synchronize(int /*device_index*/) override {}
  // A captured step's kernels are recorded by core (mixtape/core/capture.h).
  bool kernels_are_host_calls() const override { return true; }
  DeviceProperties properties(int /*device_index*/) const override {
    return DeviceProperties{.name = "CPU"};
  }

 private:
  // Its memory goes back to the system when the backend is destroyed (at exit).
  struct Cache : detail::CachingAllocator {
    Cache() : CachingAllocator(DeviceType::CPU, cpu_allocator_config(), cpu_system()) {}
    ~Cache() { release(0); }
  } cache_;
};

}  // namespace

void register_backend_and_kernels() {
  register_backend(std::make_unique<CpuBackend>());
  register_memory_kernels();
  register_elementwise_kernels();
  register_reduction_kernels();
  register_index_kernels();
  register_gemm_kernels();
  register_linear_kernels();
  register_conv_kernels();
  register_pool_kernels();
  register_optim_kernels();
  register_attention_kernels();
  register_layer_norm_kernels();
  register_batch_norm_kernels();
  register_dropout_kernels();
  register_cross_entropy_kernels();
  register_float8_gemm_kernels();
  register_quantize_kernels();
}

}  // namespace mixtape::cpu
