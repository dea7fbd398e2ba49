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
#include "core/env.h"
#include "mixtape/core/error.h"

namespace mixtape::cpu {
namespace {

// A caching allocator: freed blocks are kept, by size class, for the next allocation of
// that class, so that a training loop that allocates the same tensors every step stops
// paying for fresh pages (page faults and zeroing by the kernel) after its first step.
// Size classes: multiples of 64 bytes up to 64 KiB, then eight classes per power of two
// (at most 12.5% waste). At most limit_ bytes are kept (MIXTAPE_CPU_CACHE_MB megabytes,
// 0 to 1048576, default 1024); beyond it freed blocks go back to the system.
class BlockCache {
 public:
  // Reads MIXTAPE_CPU_CACHE_MB (when the backend is registered, at the first tensor): a bad
  // value throws ValueError there, and registration is tried again on the next use.
  BlockCache() : limit_(static_cast<std::size_t>(detail::env::kCpuCacheMb.read()) << 20) {}
  ~BlockCache() { release_all(); }
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  static std::size_t size_class(std::size_t n) {
    if (n <= (std::size_t{64} << 10)) return std::max<std::size_t>((n + 63) / 64 * 64, 64);
    std::size_t p = std::size_t{1} << (63 - __builtin_clzll(n));  // the power of two <= n
    const std::size_t step = p / 8;
    return (n + step - 1) / step * step;
  }

  void* take(std::size_t cls) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(cls);
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    kept_ -= cls;
    return p;
  }

  // Keeps the block when there is room; false: the caller frees it.
  bool give(void* p, std::size_t cls) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (kept_ + cls > limit_) return false;
    free_[cls].push_back(p);
    kept_ += cls;
    return true;
  }

  void release_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [cls, blocks] : free_)
      for (void* p : blocks) std::free(p);
    free_.clear();
    kept_ = 0;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<std::size_t, std::vector<void*>> free_;
  std::size_t kept_ = 0;
  std::size_t limit_;
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
    const std::size_t cls = BlockCache::size_class(nbytes);
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
    if (!cache_.give(ptr, BlockCache::size_class(nbytes))) std::free(ptr);
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device,
            std::size_t nbytes) override {
    if (!dst_device.is_cpu() || !src_device.is_cpu())
      throw DeviceError(
          fmt::format("CPU backend cannot copy from {} to {}", src_device.str(), dst_device.str()));
    if (nbytes) std::memmove(dst, src, nbytes);
  }
  void synchronize(int /*device_index*/) override {}
  DeviceProperties properties(int /*device_index*/) const override {
    return DeviceProperties{.name = "CPU"};
  }

 private:
  static constexpr std::size_t kAlignment = 64;
  BlockCache cache_;
};

}  // namespace

void register_backend_and_kernels() {
  register_backend(std::make_unique<CpuBackend>());
  register_memory_kernels();
  register_elementwise_kernels();
  register_reduction_kernels();
  register_index_kernels();
  register_gemm_kernels();
  register_conv_kernels();
  register_pool_kernels();
  register_optim_kernels();
  register_attention_kernels();
  register_layer_norm_kernels();
  register_cross_entropy_kernels();
  register_float8_gemm_kernels();
}

}  // namespace mixtape::cpu
