// The caching allocator (core/caching_allocator.h). Written here rather than taken from a
// library: it hands out the backends' own memory (cudaMalloc'd device memory included) under
// their stream and capture rules, which no general-purpose allocator knows.
#include "core/caching_allocator.h"

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <utility>

namespace mixtape::detail {
namespace {

std::size_t round_up(std::size_t n, std::size_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

}  // namespace

CachingAllocator::CachingAllocator(DeviceType type, Config config, System system)
    : type_(type), config_(config), system_(std::move(system)) {}

CachingAllocator::~CachingAllocator() {
  for (auto& [index, pool] : pools_) {
    for (Block* b : pool.free_large) delete b;
    for (auto& [ptr, b] : pool.used_large) delete b;
  }
}

std::size_t CachingAllocator::size_class(std::size_t n) const {
  if (n <= config_.small_limit) return round_up(n == 0 ? 1 : n, config_.quantum);
  return round_up(n, config_.granule);
}

void* CachingAllocator::obtain(int pool, Pool& p, std::size_t bytes) {
  void* ptr = system_.obtain(pool, bytes);
  if (ptr == nullptr) {
    trim(pool, p, 0);  // memory is short: give the kept memory back and retry
    ptr = system_.obtain(pool, bytes);
  }
  if (ptr != nullptr) {
    p.stats.reserved += bytes;
    count_reserved(Device(type_, pool), static_cast<std::int64_t>(bytes));
  }
  return ptr;
}

void* CachingAllocator::allocate(int pool, std::size_t n) {
  // (No system has half the address space to give; and no size rounds past the top.)
  if (n > std::numeric_limits<std::size_t>::max() / 2) return nullptr;
  const std::size_t cls = size_class(n);
  std::lock_guard<std::mutex> lock(mutex_);
  Pool& p = pools_[pool];
  if (cls > config_.small_limit) return allocate_large(pool, p, cls);
  if (auto it = p.small.find(cls); it != p.small.end() && !it->second.empty()) {
    void* ptr = it->second.back();
    it->second.pop_back();
    p.stats.kept -= cls;
    p.small_blocks.at(ptr).in_use = true;
    return ptr;
  }
  void* ptr = obtain(pool, p, cls);
  if (ptr != nullptr) p.small_blocks.insert_or_assign(ptr, SmallBlock{cls, true});
  return ptr;
}

// The best-fitting free block (the smallest that holds `size`, the lowest address among
// equals), split when what is left could serve another large request; a new segment when none
// fits.
void* CachingAllocator::allocate_large(int pool, Pool& p, std::size_t size) {
  Block probe{nullptr, size};
  Block* b = nullptr;
  if (auto it = p.free_large.lower_bound(&probe); it != p.free_large.end()) {
    b = *it;
    p.free_large.erase(it);
    p.stats.kept -= b->size;
  } else {
    const std::size_t bytes =
        size <= config_.segment / 2 ? config_.segment : round_up(size, config_.segment_round);
    void* base = obtain(pool, p, bytes);
    if (base == nullptr) return nullptr;
    b = new Block{static_cast<char*>(base), bytes};
    ++p.stats.segments;
  }
  if (b->size - size > config_.small_limit) {
    auto* rest = new Block{b->ptr + size, b->size - size, true, b, b->next};
    if (b->next) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    p.free_large.insert(rest);
    p.stats.kept += rest->size;
  }
  b->free = false;
  p.used_large.emplace(b->ptr, b);
  return b->ptr;
}

// A block given back that is not in use here (freed twice, never allocated here, or of
// another size): a backend's bug, never a user's. Going on would hand memory out twice or lose
// it, so the process ends.
[[noreturn]] void CachingAllocator::not_allocated_here(const void* ptr, std::size_t n) {
  std::fprintf(stderr,
               "mixtape: caching allocator: %p (%zu bytes) given back, but no block of that "
               "address and size is in use here (freed twice?)\n",
               ptr, n);
  std::abort();
}

void CachingAllocator::deallocate(int pool, void* ptr, std::size_t n) {
  if (ptr == nullptr) return;
  const std::size_t cls = size_class(n);
  std::lock_guard<std::mutex> lock(mutex_);
  Pool& p = pools_[pool];
  if (cls <= config_.small_limit) {
    // Checked, as the large blocks are: a small block kept twice would be handed out twice.
    const auto it = p.small_blocks.find(ptr);
    if (it == p.small_blocks.end() || !it->second.in_use || it->second.cls != cls)
      not_allocated_here(ptr, n);
    it->second.in_use = false;
    keep_small(pool, p, ptr, cls);
    return;
  }
  const auto it = p.used_large.find(ptr);
  if (it == p.used_large.end()) not_allocated_here(ptr, n);
  Block* b = it->second;
  p.used_large.erase(it);
  free_large(pool, p, b);
}

void CachingAllocator::adopt(int pool, void* ptr, std::size_t n) {
  const std::size_t cls = size_class(n);
  std::lock_guard<std::mutex> lock(mutex_);
  Pool& p = pools_[pool];
  p.stats.reserved += cls;
  if (cls <= config_.small_limit) {
    p.small_blocks.insert_or_assign(ptr, SmallBlock{cls, false});
    keep_small(pool, p, ptr, cls);
    return;
  }
  ++p.stats.segments;
  free_large(pool, p, new Block{static_cast<char*>(ptr), cls});
}

// Keeps a free small block (then, beyond the keep limit, gives free memory back).
void CachingAllocator::keep_small(int pool, Pool& p, void* ptr, std::size_t cls) {
  p.small[cls].push_back(ptr);
  p.stats.kept += cls;
  trim(pool, p, config_.keep_limit);
}

// Marks b free and merges it with its free neighbours; a segment left wholly free beyond the
// keep limit goes back to the system.
void CachingAllocator::free_large(int pool, Pool& p, Block* b) {
  b->free = true;
  p.stats.kept += b->size;
  // first takes in the block after it.
  const auto absorb_next = [](Block* first) {
    Block* second = first->next;
    first->size += second->size;
    first->next = second->next;
    if (second->next) second->next->prev = first;
    delete second;
  };
  if (Block* prev = b->prev; prev != nullptr && prev->free) {
    p.free_large.erase(prev);
    absorb_next(prev);
    b = prev;
  }
  if (Block* next = b->next; next != nullptr && next->free) {
    p.free_large.erase(next);
    absorb_next(b);
  }
  p.free_large.insert(b);
  trim(pool, p, config_.keep_limit);
}

// While more than `limit` bytes are free: gives back wholly free segments, the largest first,
// then kept small blocks (each one's counts before the system's give_back, which may throw).
void CachingAllocator::trim(int pool, Pool& p, std::size_t limit) {
  bool ready = false;  // before_release called
  const auto get_ready = [&] {
    if (!ready) system_.before_release(pool);
    ready = true;
  };
  for (auto it = p.free_large.end(); it != p.free_large.begin() && p.stats.kept > limit;) {
    Block* b = *--it;
    if (b->prev == nullptr && b->next == nullptr) {
      get_ready();
      it = p.free_large.erase(it);
      give_back_segment(pool, p, b);
    }
  }
  for (auto& [cls, blocks] : p.small) {
    while (!blocks.empty() && p.stats.kept > limit) {
      get_ready();
      void* ptr = blocks.back();
      blocks.pop_back();
      p.small_blocks.erase(ptr);
      p.stats.reserved -= cls;
      p.stats.kept -= cls;
      count_reserved(Device(type_, pool), -static_cast<std::int64_t>(cls));
      system_.give_back(pool, ptr);
    }
  }
}

// b: a wholly free segment, not in free_large. (The counts first: the system's give_back may
// throw, and leaves nothing here to give back twice.)
void CachingAllocator::give_back_segment(int pool, Pool& p, Block* b) {
  void* const base = b->ptr;
  const std::size_t size = b->size;
  delete b;
  p.stats.reserved -= size;
  p.stats.kept -= size;
  --p.stats.segments;
  count_reserved(Device(type_, pool), -static_cast<std::int64_t>(size));
  system_.give_back(pool, base);
}

void CachingAllocator::release(int pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  trim(pool, pools_[pool], 0);
}

CachingAllocator::Stats CachingAllocator::stats(int pool) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = pools_.find(pool);
  return it == pools_.end() ? Stats{} : it->second.stats;
}

}  // namespace mixtape::detail
