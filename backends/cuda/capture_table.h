// The CUDA backend's captures (CUDA graphs of captured steps) as bookkeeping with no CUDA in
// it: which device captures, for which thread; which threads are queueing work on a device
// (so that none of it is recorded into another thread's graph); which blocks each graph's pool
// owns, and where a freed block goes. backend.cpp keeps one CaptureTable and gives it the
// device's calls; tests/test_capture_table.cpp checks the rules on the CPU.
//
// The rules. While a device captures, every block that the capturing thread allocates there
// comes from the capture's pool: the graph's kernels read and write those addresses at every
// replay, so no allocation outside the capture may get them while the graph lives. A pool's
// block freed while its graph lives goes back to the pool (a later allocation of the same
// capture may take it: its kernels come after in the graph's order, as on the stream). A block
// that is not the capture's own, freed while the device captures, is retained by the capture
// (the graph may read it) and goes where it belongs when the graph is gone: to its own pool if
// that pool's graph still lives, else to the caching allocator. A tensor that a before_replay
// hook writes (capture::host_written) gets a new block, never a freed one: the hook's copy runs
// before the graph, so a block that the graph's earlier kernels use would be overwritten before
// its later kernels read it. Host -> device copies made during a capture read from pinned
// buffers of the pool's own (the replays copy them again, the same bytes).
//
// Only the capturing thread works on a device while it captures, since the device has one
// stream and a stream records whatever any thread queues on it. Another thread's kernel
// launch, copy, read or synchronisation there waits for the capture to end (a Dataset's
// prefetch thread copying the next batch up while fit captures its first step), as does its
// allocation there; and a capture starts only once no other thread is in the middle of
// queueing work on the device (enter ... leave), new such work waiting for it meanwhile.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixtape::cuda_backend {

// The size of a capture pool's block for a tensor of n bytes: 512-byte multiples up to 1 MiB,
// then eight classes per power of two. A pool's blocks are not split: coarse classes let a
// captured step's tensors of near sizes share blocks.
std::size_t pool_class(std::size_t n);

// The blocks of one capture and of the graph made from it.
struct CapturePool {
  int device = 0;
  std::thread::id owner;  // the capturing thread
  bool graph_alive = true;
  std::unordered_map<std::size_t, std::vector<void*>> free;  // by pool_class
  // Blocks that are not this pool's, freed while it captured (its graph may read them).
  std::vector<std::pair<void*, std::size_t>> retained;  // (block, its tensor's bytes)
  std::vector<void*> pinned;  // host buffers of the copies its graph replays
};

class CaptureTable {
 public:
  // The device's calls, made with the table's lock held (so none may call back into it).
  struct System {
    std::function<void*(int device, std::size_t bytes)> obtain;  // new memory (throws if none)
    // A block of the caching allocator for a tensor of n bytes, or null when out of memory.
    std::function<void*(int device, std::size_t n)> allocate;
    // A block the caching allocator handed out, for a tensor of n bytes, back to it.
    std::function<void(int device, void* p, std::size_t n)> deallocate;
    // A block of a dead graph's pool, of `bytes` (its class), to the caching allocator.
    std::function<void(int device, void* p, std::size_t bytes)> adopt;
    std::function<void(void* p)> free_host;  // a pinned host buffer
  };

  explicit CaptureTable(System system) : system_(std::move(system)) {}
  CaptureTable(const CaptureTable&) = delete;
  CaptureTable& operator=(const CaptureTable&) = delete;

  // A block for a tensor of n bytes on device d: from the pool of the calling thread's capture
  // when it captures on d (a block the capture freed, or a new one, always new when `fresh`),
  // else from the caching allocator once no other thread captures on d. Null when the cache
  // has no memory; what obtain throws passes through.
  void* allocate(int d, std::size_t n, bool fresh);
  // A freed block of a tensor of n bytes on device d, wherever it came from (the rules above).
  void deallocate(void* p, std::size_t n, int d);

  // The calling thread queues work on device d until the matching leave(d): waits while another
  // thread captures there or is about to; a capture waits for it. Calls nest (per thread and
  // device). True when the calling thread is the one capturing on d.
  bool enter(int d);
  void leave(int d);

  // Starts a capture of device d by the calling thread, once no other thread is between enter
  // and leave there. False when d already captures or is about to (nothing changed then).
  bool begin(int d);
  // Ends device d's capture: its pool (for the graph made from it), or null when none ran.
  std::shared_ptr<CapturePool> end(int d);
  // The pool's graph is gone, or its capture failed: its free blocks go to the caching
  // allocator, the blocks it retained where deallocate would send them now, its host buffers
  // back to the system. The pool's blocks still in use go to the cache when freed.
  void release(CapturePool& pool);
  // Keeps a host buffer for the graph of the calling thread's capture on d (which must run).
  void keep_pinned(int d, void* p);

 private:
  struct Device {
    std::shared_ptr<CapturePool> capture;  // or null
    std::thread::id starting;              // a thread waiting in begin(), or none
    int queueing = 0;                      // enter()s not yet left, every thread's
  };
  Device& device(int d);
  // Whether device d captures or is about to, for a thread other than the calling one.
  bool others(const Device& dev) const;
  void* pool_block(CapturePool& pool, std::size_t n, bool fresh);
  void give_back(void* p, std::size_t n, int d);

  System system_;
  std::mutex mutex_;
  std::condition_variable changed_;  // a capture ended or started, or a device's queueing fell
  std::vector<Device> devices_;
  std::unordered_map<void*, std::shared_ptr<CapturePool>> pool_of_;  // pool blocks, not the cache's
};

}  // namespace mixtape::cuda_backend
