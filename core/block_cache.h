// Freed memory blocks kept by (pool, size class) for the next allocation of that class: the
// caching allocators of the CPU backend (one pool) and the CUDA backend (a pool per device).
// A training loop that allocates the same tensors every step then stops paying for fresh
// memory after its first step. Private to the library: core and the backends.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace mixtape::detail {

class BlockCache {
 public:
  // Size classes: multiples of `quantum` up to `linear_limit` bytes, then eight classes per
  // power of two (at most 12.5% waste). At most `limit` bytes are kept in all; give()
  // refuses a block beyond it.
  BlockCache(std::size_t quantum, std::size_t linear_limit,
             std::size_t limit = std::numeric_limits<std::size_t>::max())
      : quantum_(quantum), linear_limit_(linear_limit), limit_(limit) {}
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // The size class of an allocation of n bytes (at least one quantum, also for n = 0).
  std::size_t size_class(std::size_t n) const {
    if (n <= linear_limit_) return std::max((n + quantum_ - 1) / quantum_ * quantum_, quantum_);
    const std::size_t p = std::size_t{1} << (63 - __builtin_clzll(n));  // the power of 2 <= n
    const std::size_t step = p / 8;
    return (n + step - 1) / step * step;
  }

  // A kept block of class `cls` from `pool`, or nullptr.
  void* take(int pool, std::size_t cls) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = free_.find(key(pool, cls));
    if (it == free_.end() || it->second.empty()) return nullptr;
    void* p = it->second.back();
    it->second.pop_back();
    kept_ -= cls;
    return p;
  }

  // Keeps the block when there is room; false: the caller frees it.
  bool give(int pool, std::size_t cls, void* p) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (kept_ + cls > limit_) return false;
    free_[key(pool, cls)].push_back(p);
    kept_ += cls;
    return true;
  }

  // Hands every kept block of `pool` to free_block(p) and forgets it. before() runs first,
  // under the cache's lock, so that no block comes or goes meanwhile (the CUDA backend waits
  // for the device's stream there: a block given back is free once the stream is idle).
  template <typename Before, typename FreeBlock>
  void release(int pool, Before&& before, FreeBlock&& free_block) {
    std::lock_guard<std::mutex> lock(mutex_);
    before();
    for (auto& [k, blocks] : free_) {
      if (static_cast<int>(k >> 56) != pool) continue;
      for (void* p : blocks) {
        free_block(p);
        kept_ -= static_cast<std::size_t>(k & ((std::uint64_t{1} << 56) - 1));
      }
      blocks.clear();
    }
  }

 private:
  static std::uint64_t key(int pool, std::size_t cls) {
    return (static_cast<std::uint64_t>(pool) << 56) | static_cast<std::uint64_t>(cls);
  }
  std::mutex mutex_;
  std::unordered_map<std::uint64_t, std::vector<void*>> free_;
  std::size_t quantum_, linear_limit_, limit_;
  std::size_t kept_ = 0;
};

}  // namespace mixtape::detail
