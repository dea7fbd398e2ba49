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
#include "core/block_cache.h"
#include "core/env.h"
#include "mixtape/core/error.h"

namespace mixtape::cpu {
namespace {

// The caching allocator (core/block_cache.h): size classes of 64-byte multiples up to 64
// KiB, then eight per power of two; at most MIXTAPE_CPU_CACHE_MB megabytes kept (0 to
// 1048576, default 1024), read when the backend is registered, at the first tensor (a bad
// value throws ValueError there, and registration is tried again on the next use). Beyond it
// freed blocks go back to the system.
class CpuCache {
 public:
  CpuCache()
      : blocks_(64, std::size_t{64} << 10,
                static_cast<std::size_t>(detail::env::kCpuCacheMb.read()) << 20) {}
  ~CpuCache() { release_all(); }
  CpuCache(const CpuCache&) = delete;
  CpuCache& operator=(const CpuCache&) = delete;
  std::size_t size_class(std::size_t n) const { return blocks_.size_class(n); }
  void* take(std::size_t cls) { return blocks_.take(0, cls); }
  bool give(void* p, std::size_t cls) { return blocks_.give(0, cls, p); }
  void release_all() {
    blocks_.release(0, [] {}, [](void* p) { std::free(p); });
  }

 private:
  detail::BlockCache blocks_;
};

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
    const std::size_t cls = cache_.size_class(nbytes);
    if (void* p = cache_.take(cls)) return p;
    void* p = std::aligned_alloc(kAlignment, cls);
    if (!p) {
      cache_.release_all();  // memory is short: give the cached blocks back and retry
      p = std::aligned_alloc(kAlignment, cls);
    }
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* ptr, std::size_t nbytes, int /*device_index*/) override {
    if (!ptr) return;
    if (!cache_.give(ptr, cache_.size_class(nbytes))) std::free(ptr);
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
  static constexpr std::size_t kAlignment = 64;
  CpuCache cache_;
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
  register_dropout_kernels();
  register_cross_entropy_kernels();
  register_float8_gemm_kernels();
}

}  // namespace mixtape::cpu
