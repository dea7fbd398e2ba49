// The CUDA backend's capture bookkeeping (backends/cuda/capture_table.h).
#include "backends/cuda/capture_table.h"

#include <algorithm>

namespace mixtape::cuda_backend {
namespace {

// The calling thread's enter()s not yet left, by table and device.
std::vector<int>& depths(const CaptureTable* table) {
  thread_local std::unordered_map<const CaptureTable*, std::vector<int>> by_table;
  // (Every kernel launch asks twice, nearly always of the backend's one table: its entry kept.
  // An unordered_map's elements stay where they are when it grows.)
  thread_local const CaptureTable* last = nullptr;
  thread_local std::vector<int>* last_depths = nullptr;
  if (table != last) {
    last_depths = &by_table[table];
    last = table;
  }
  return *last_depths;
}

int& depth(const CaptureTable* table, int d) {
  auto& v = depths(table);
  if (v.size() <= static_cast<std::size_t>(d)) v.resize(static_cast<std::size_t>(d) + 1, 0);
  return v[static_cast<std::size_t>(d)];
}

}  // namespace

std::size_t pool_class(std::size_t n) {
  constexpr std::size_t kQuantum = 512, kLinear = std::size_t{1} << 20;
  if (n <= kLinear) return std::max((n + kQuantum - 1) / kQuantum * kQuantum, kQuantum);
  const std::size_t step = (std::size_t{1} << (63 - __builtin_clzll(n))) / 8;
  return (n + step - 1) / step * step;
}

CaptureTable::Device& CaptureTable::device(int d) {
  if (devices_.size() <= static_cast<std::size_t>(d))
    devices_.resize(static_cast<std::size_t>(d) + 1);
  return devices_[static_cast<std::size_t>(d)];
}

bool CaptureTable::others(const Device& dev) const {
  const auto me = std::this_thread::get_id();
  return (dev.capture && dev.capture->owner != me) ||
         (dev.starting != std::thread::id{} && dev.starting != me);
}

void* CaptureTable::allocate(int d, std::size_t n, bool fresh) {
  std::unique_lock<std::mutex> lock(mutex_);
  // Only a running capture is waited for here: a thread between enter and leave may allocate
  // (a workspace) while a capture waits for it to leave.
  changed_.wait(lock, [&] {
    const Device& dev = device(d);
    return !dev.capture || dev.capture->owner == std::this_thread::get_id();
  });
  if (CapturePool* pool = device(d).capture.get()) return pool_block(*pool, n, fresh);
  // Under the lock, so that no capture starts on d while the cache, short of memory, waits for
  // the device's stream to give blocks back.
  return system_.allocate(d, n);
}

void* CaptureTable::pool_block(CapturePool& pool, std::size_t n, bool fresh) {
  const std::size_t cls = pool_class(n);
  auto& free = pool.free[cls];
  if (!free.empty() && !fresh) {
    void* p = free.back();
    free.pop_back();
    return p;
  }
  void* p = system_.obtain(pool.device, cls);
  pool_of_.emplace(p, device(pool.device).capture);
  return p;
}

void CaptureTable::deallocate(void* p, std::size_t n, int d) {
  if (p == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  CapturePool* capturing = device(d).capture.get();
  if (capturing) {
    const auto it = pool_of_.find(p);
    if (it == pool_of_.end() || it->second.get() != capturing) {
      capturing->retained.emplace_back(p, n);  // the graph may read it
      return;
    }
  }
  give_back(p, n, d);
}

// A freed block that no capture can read: to its pool while the pool's graph lives, else to
// the cache (a dead graph's pool block adopted by it).
void CaptureTable::give_back(void* p, std::size_t n, int d) {
  if (const auto it = pool_of_.find(p); it != pool_of_.end()) {
    if (it->second->graph_alive) {
      it->second->free[pool_class(n)].push_back(p);
      return;
    }
    pool_of_.erase(it);
    system_.adopt(d, p, pool_class(n));
    return;
  }
  system_.deallocate(d, p, n);
}

bool CaptureTable::enter(int d) {
  int& mine = depth(this, d);
  std::unique_lock<std::mutex> lock(mutex_);
  if (mine == 0) changed_.wait(lock, [&] { return !others(device(d)); });
  ++mine;
  Device& dev = device(d);
  ++dev.queueing;
  return dev.capture && dev.capture->owner == std::this_thread::get_id();
}

void CaptureTable::leave(int d) {
  int& mine = depth(this, d);
  std::lock_guard<std::mutex> lock(mutex_);
  --mine;
  Device& dev = device(d);
  --dev.queueing;
  // (Only a capture waiting to start waits for the queueing to fall.)
  if (dev.starting != std::thread::id{}) changed_.notify_all();
}

bool CaptureTable::begin(int d) {
  const int mine = depth(this, d);
  std::unique_lock<std::mutex> lock(mutex_);
  Device& dev = device(d);
  if (dev.capture || dev.starting != std::thread::id{}) return false;
  const auto me = std::this_thread::get_id();
  dev.starting = me;
  changed_.wait(lock, [&] { return device(d).queueing == mine; });
  Device& now = device(d);  // (devices_ may have grown meanwhile)
  now.starting = std::thread::id{};
  now.capture = std::make_shared<CapturePool>();
  now.capture->device = d;
  now.capture->owner = me;
  changed_.notify_all();
  return true;
}

std::shared_ptr<CapturePool> CaptureTable::end(int d) {
  std::shared_ptr<CapturePool> pool;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    pool = std::move(device(d).capture);
  }
  changed_.notify_all();
  return pool;
}

void CaptureTable::release(CapturePool& pool) {
  std::lock_guard<std::mutex> lock(mutex_);
  pool.graph_alive = false;
  for (auto& [cls, blocks] : pool.free)
    for (void* p : blocks) {
      pool_of_.erase(p);
      system_.adopt(pool.device, p, cls);
    }
  pool.free.clear();
  // Where they belong now: another graph's pool block to that pool while its graph lives.
  for (auto [p, n] : pool.retained) give_back(p, n, pool.device);
  pool.retained.clear();
  for (void* p : pool.pinned) system_.free_host(p);
  pool.pinned.clear();
}

void CaptureTable::keep_pinned(int d, void* p) {
  std::lock_guard<std::mutex> lock(mutex_);
  device(d).capture->pinned.push_back(p);
}

}  // namespace mixtape::cuda_backend
