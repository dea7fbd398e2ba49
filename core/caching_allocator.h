// The caching allocator of the CPU backend (one pool) and the CUDA backend (a pool per device):
// memory a backend got from its system (aligned_alloc, cudaMalloc) is kept when freed and
// handed out again, so that a training loop that allocates the same tensors every step stops
// paying for fresh memory after its first step, and memory freed by one phase of a step serves
// the next phase's tensors even when their sizes differ. Private to the library: core and the
// backends.
//
// Small requests (up to Config::small_limit) get a block of their size class each, kept by
// class. Large ones are carved from segments: a free block that fits best is split, a freed
// block merges with free neighbours of its segment, and a request no free block fits gets a
// new segment (shared by requests up to half a segment, its own above that), as PyTorch's
// CUDA caching allocator does. Without splitting, the activations and gradients a GPT step
// frees before its optimizer step could not hold the optimizer's tensors of other sizes: the
// memory reserved at the training's peak was 1.37x what its tensors held (CPU,
// mixed_bfloat16, 4 x 768, context 1024, batch 4), against 1.13x with it (docs/autograd.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "mixtape/core/device.h"

namespace mixtape::detail {

// Counts `bytes` more (negative: fewer) reserved on `device`: memory a backend's allocator
// holds from its system, in use or kept (memory_stats' reserved; core/storage.cpp).
void count_reserved(Device device, std::int64_t bytes);

class CachingAllocator {
 public:
  struct Config {
    std::size_t quantum = 512;                         // small sizes: multiples of it
    std::size_t small_limit = std::size_t{1} << 20;    // requests up to it are small
    std::size_t granule = 512;                         // large sizes: multiples of it (and offsets)
    std::size_t segment = std::size_t{20} << 20;       // shared by requests up to half of it
    std::size_t segment_round = std::size_t{2} << 20;  // larger requests' own segments
    std::size_t keep_limit = std::numeric_limits<std::size_t>::max();  // free bytes kept
  };
  // How the backend gets memory from its system and gives it back. obtain returns nullptr when
  // there is none; before_release runs before free memory goes back (the CUDA backend waits
  // for the device's stream there: a block given back is free once the stream is idle).
  struct System {
    std::function<void*(int pool, std::size_t bytes)> obtain;
    std::function<void(int pool, void* p)> give_back;
    std::function<void(int pool)> before_release = [](int) {};
  };

  // Memory is counted as reserved on Device(type, pool).
  CachingAllocator(DeviceType type, Config config, System system);
  ~CachingAllocator();  // gives nothing back: release() first where that matters
  CachingAllocator(const CachingAllocator&) = delete;
  CachingAllocator& operator=(const CachingAllocator&) = delete;

  // The bytes an allocation of n takes (small: its size class; large: n rounded to the
  // granule; at least one quantum, also for n = 0).
  std::size_t size_class(std::size_t n) const;

  // A block of at least n bytes from `pool`, aligned as the system's memory is (to the granule
  // at most); nullptr when the system has no more, even after release(pool).
  void* allocate(int pool, std::size_t n);
  // Takes back a block allocate(pool, n) returned, with the n it was asked for (anything else,
  // a block given back twice included, aborts: a backend's bug).
  void deallocate(int pool, void* p, std::size_t n);
  // Keeps a block of size_class(n) bytes that the backend obtained from its system itself (a
  // CUDA graph's pool): free, and given back or handed out as the allocator's own from now on.
  // Its bytes count as reserved on the device already (the backend counted them).
  void adopt(int pool, void* p, std::size_t n);
  // Gives back to the system every kept small block and every segment with nothing in use.
  void release(int pool);

  struct Stats {
    std::size_t reserved = 0;  // obtained (or adopted) and not given back
    std::size_t kept = 0;      // of which free
    std::size_t segments = 0;  // large segments
  };
  Stats stats(int pool) const;

 private:
  struct Block {
    char* ptr;
    std::size_t size;
    bool free = true;
    Block* prev = nullptr;  // the neighbours in its segment (the first block's ptr is the
    Block* next = nullptr;  // segment's base)
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->ptr < b->ptr;
    }
  };
  struct SmallBlock {
    std::size_t cls;
    bool in_use;
  };
  struct Pool {
    std::unordered_map<std::size_t, std::vector<void*>> small;  // kept, by size class
    // Every small block obtained and not given back (in use or kept): its size class, and
    // whether it is in use. Entries live as long as the blocks, so that handing a kept block
    // out and taking it back allocate nothing.
    std::unordered_map<const void*, SmallBlock> small_blocks;
    std::set<Block*, BySize> free_large;                 // free, by size then address
    std::unordered_map<const void*, Block*> used_large;  // in use, by address
    Stats stats;
  };

  void* obtain(int pool, Pool& p, std::size_t bytes);  // releasing once when out of memory
  void* allocate_large(int pool, Pool& p, std::size_t size);
  void free_large(int pool, Pool& p, Block* b);
  void keep_small(int pool, Pool& p, void* ptr, std::size_t cls);
  void give_back_segment(int pool, Pool& p, Block* b);
  void trim(int pool, Pool& p, std::size_t limit);  // free bytes down to limit, if it can
  [[noreturn]] static void not_allocated_here(const void* ptr, std::size_t n);

  DeviceType type_;
  Config config_;
  System system_;
  mutable std::mutex mutex_;
  std::unordered_map<int, Pool> pools_;
};

}  // namespace mixtape::detail
