// The CUDA backend's capture bookkeeping (backends/cuda/capture_table.h), on the CPU over a
// system that records what it is asked: where a captured step's blocks come from and where a
// freed block goes (its pool, the capture that may read it, the cache), blocks crossing from
// one graph to another, and the threads: a capture starts only once no other thread is queueing
// work on its device, and holds the others' work and allocations until it ends.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdint>
#include <thread>
#include <utility>
#include <vector>

#include "backends/cuda/capture_table.h"

using mixtape::cuda_backend::CapturePool;
using mixtape::cuda_backend::CaptureTable;
using mixtape::cuda_backend::pool_class;

namespace {

// Addresses that are never dereferenced: new device memory from 0x10000000 up, the cache's
// blocks from 0x90000000 up.
struct Recorder {
  std::uintptr_t next_new = 0x10000000, next_cached = 0x90000000;
  std::vector<std::pair<void*, std::size_t>> obtained, from_cache, to_cache, adopted;
  std::vector<void*> freed_host;

  CaptureTable::System system() {
    return {.obtain =
                [this](int, std::size_t bytes) {
                  void* p = reinterpret_cast<void*>(next_new);
                  next_new += 0x100000;
                  obtained.emplace_back(p, bytes);
                  return p;
                },
            .allocate =
                [this](int, std::size_t n) {
                  void* p = reinterpret_cast<void*>(next_cached);
                  next_cached += 0x100000;
                  from_cache.emplace_back(p, n);
                  return p;
                },
            .deallocate = [this](int, void* p, std::size_t n) { to_cache.emplace_back(p, n); },
            .adopt = [this](int, void* p, std::size_t bytes) { adopted.emplace_back(p, bytes); },
            .free_host = [this](void* p) { freed_host.push_back(p); }};
  }
};

using Calls = std::vector<std::pair<void*, std::size_t>>;

// Waits up to 10 s for `flag` (a thread's progress that must come).
bool eventually(const std::atomic<bool>& flag) {
  for (int i = 0; i < 10000 && !flag.load(); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return flag.load();
}

// Gives another thread time to do what it must not (a wait that must hold).
void hold_on() { std::this_thread::sleep_for(std::chrono::milliseconds(100)); }

}  // namespace

TEST_CASE("capture table: a capture's blocks come from its pool and return to it",
          "[capture_table]") {
  Recorder rec;
  CaptureTable table(rec.system());
  REQUIRE(table.begin(0));
  CHECK_FALSE(table.begin(0));  // one capture a device
  void* a = table.allocate(0, 1000, false);
  CHECK(rec.obtained == Calls{{a, 1024}});  // new memory of the pool's size class
  table.deallocate(a, 1000, 0);
  CHECK(table.allocate(0, 900, false) == a);  // the same class again: the freed block
  table.deallocate(a, 900, 0);
  void* fresh = table.allocate(0, 1000, true);  // a hook writes it before each replay: new
  CHECK(fresh != a);
  CHECK(table.allocate(0, 3 << 20, false) != nullptr);  // (a class of its own)
  CHECK(rec.from_cache.empty());
  CHECK(rec.to_cache.empty());

  const std::shared_ptr<CapturePool> pool = table.end(0);
  REQUIRE(pool);
  CHECK_FALSE(table.end(0));
  void* cached = table.allocate(0, 1000, false);  // no capture: from the cache
  CHECK(rec.from_cache == Calls{{cached, 1000}});
  table.deallocate(cached, 1000, 0);
  CHECK(rec.to_cache == Calls{{cached, 1000}});
  // The graph lives: its block freed now goes back to its pool, the cache gets it with the
  // pool's free blocks when the graph is gone.
  table.deallocate(fresh, 1000, 0);
  CHECK(rec.adopted.empty());
  table.release(*pool);
  CHECK(rec.adopted == Calls{{a, 1024}, {fresh, 1024}});
  CHECK(pool->free.empty());
}

TEST_CASE("capture table: a block of the cache freed during a capture waits for its graph",
          "[capture_table]") {
  Recorder rec;
  CaptureTable table(rec.system());
  void* x = table.allocate(0, 5000, false);  // before the capture: the cache's
  REQUIRE(table.begin(0));
  table.deallocate(x, 5000, 0);  // the captured step read it last
  CHECK(rec.to_cache.empty());
  const auto pool = table.end(0);
  CHECK(rec.to_cache.empty());  // the graph still reads it at each replay
  table.release(*pool);
  CHECK(rec.to_cache == Calls{{x, 5000}});
  CHECK(rec.adopted.empty());
}

TEST_CASE("capture table: another graph's block freed during a capture stays with the capture",
          "[capture_table]") {
  Recorder rec;
  CaptureTable table(rec.system());
  REQUIRE(table.begin(0));
  void* y = table.allocate(0, 4096, false);  // the first graph's output, kept by the user
  const auto first = table.end(0);

  SECTION("the first graph gone before the second capture") {
    table.release(*first);
    CHECK(rec.adopted.empty());  // y is in use
    REQUIRE(table.begin(0));
    table.deallocate(y, 4096, 0);  // the second captured step read y last
    // Not to the cache: an allocation there would get y while the second graph reads it.
    CHECK(rec.adopted.empty());
    const auto second = table.end(0);
    CHECK(table.allocate(0, 4096, false) != y);
    CHECK(rec.adopted.empty());
    table.release(*second);
    CHECK(rec.adopted == Calls{{y, pool_class(4096)}});
  }
  SECTION("the first graph alive until after the second") {
    REQUIRE(table.begin(0));
    table.deallocate(y, 4096, 0);
    const auto second = table.end(0);
    CHECK(first->free[pool_class(4096)].empty());  // nor to its pool: the second graph reads it
    table.release(*second);
    CHECK(rec.adopted.empty());
    CHECK(first->free[pool_class(4096)] == std::vector<void*>{y});  // the first graph's again
    table.release(*first);
    CHECK(rec.adopted == Calls{{y, pool_class(4096)}});
  }
  SECTION("the second graph gone first, the first still alive") {
    REQUIRE(table.begin(0));
    void* z = table.allocate(0, 4096, false);
    table.deallocate(y, 4096, 0);
    const auto second = table.end(0);
    table.deallocate(z, 4096, 0);  // the second graph's block, freed after its capture
    CHECK(second->free[pool_class(4096)] == std::vector<void*>{z});
    table.release(*second);
    CHECK(rec.adopted == Calls{{z, pool_class(4096)}});
    table.release(*first);
    CHECK(rec.adopted == Calls{{z, pool_class(4096)}, {y, pool_class(4096)}});
  }
}

TEST_CASE("capture table: the pinned buffers of a graph's copies go with it", "[capture_table]") {
  Recorder rec;
  CaptureTable table(rec.system());
  int host = 0;
  REQUIRE(table.begin(1));
  table.keep_pinned(1, &host);
  const auto pool = table.end(1);
  CHECK(rec.freed_host.empty());
  table.release(*pool);
  CHECK(rec.freed_host == std::vector<void*>{&host});
}

TEST_CASE("capture table: a capture waits for other threads' queued work, and holds new work",
          "[capture_table]") {
  Recorder rec;
  CaptureTable table(rec.system());
  // (Catch2's assertions are the main thread's: the threads record, the main thread checks.)
  std::atomic<bool> entered{false}, leave{false}, began{false};
  bool worker_captures = true, worker_allocated = false, capture_started = false;
  std::thread worker([&] {  // a prefetch thread copying a batch up
    worker_captures = table.enter(0);
    entered = true;
    while (!leave.load()) std::this_thread::yield();
    // Between enter and leave it may still allocate (a workspace), while the capture waits.
    worker_allocated = table.allocate(0, 100, false) != nullptr;
    table.leave(0);
  });
  REQUIRE(eventually(entered));
  std::thread capturer([&] {
    capture_started = table.begin(0);
    began = true;
  });
  hold_on();
  CHECK_FALSE(began.load());  // the worker is still queueing on device 0
  // (A capture begun too early is ended here, or the worker's allocation would wait for it.)
  const bool ended_early = began.load() && table.end(0) != nullptr;
  CHECK(table.enter(1) == false);  // another device is not held
  table.leave(1);
  leave = true;
  worker.join();
  capturer.join();
  CHECK_FALSE(worker_captures);
  CHECK(worker_allocated);
  CHECK(capture_started);

  if (!ended_early) table.release(*table.end(0));

  // While the main thread captures on device 0, another thread's work and allocations there
  // wait for the end of the capture. (Not `capturer`'s capture: a new thread may get the id of
  // one that has ended.)
  REQUIRE(table.begin(0));
  std::atomic<bool> queued{false}, allocated{false};
  std::thread late_worker([&] {
    const bool captures = table.enter(0);
    queued = true;
    table.leave(0);
    allocated = !captures && table.allocate(0, 100, false) != nullptr;
  });
  hold_on();
  CHECK_FALSE(queued.load());
  const auto pool = table.end(0);
  REQUIRE(pool);
  late_worker.join();
  CHECK(queued.load());
  CHECK(allocated.load());
  CHECK(rec.obtained.empty());  // both allocations were the cache's
  CHECK(rec.from_cache.size() == 2);
  table.release(*pool);
}

TEST_CASE("capture table: the capturing thread's own work does not wait", "[capture_table]") {
  Recorder rec;
  CaptureTable table(rec.system());
  CHECK_FALSE(table.enter(0));  // (a capture started inside a scope of the thread's own)
  REQUIRE(table.begin(0));
  CHECK(table.enter(0));  // nested, and the thread's own capture
  CHECK(table.allocate(0, 64, false) != nullptr);
  table.leave(0);
  table.leave(0);
  CHECK(table.enter(0));
  table.leave(0);
  // A second capture of the device, from another thread, is refused rather than waited for.
  bool refused = false;
  std::thread other([&] { refused = !table.begin(0); });
  other.join();
  CHECK(refused);
  table.release(*table.end(0));
  CHECK(rec.obtained.size() == 1);
  CHECK(rec.adopted.empty());  // the block is still in use
}

TEST_CASE("capture table: a thread inside its own scope starts a capture once the others leave",
          "[capture_table]") {
  struct State {  // on the heap: left behind with the capturer if it never starts
    Recorder rec;
    CaptureTable table{rec.system()};
    std::atomic<bool> entered{false}, go{false}, began{false};
  };
  auto* st = new State;
  std::thread worker([st] {
    st->table.enter(0);
    st->entered = true;
    while (!st->go.load()) std::this_thread::yield();
    st->table.leave(0);
  });
  REQUIRE(eventually(st->entered));
  std::thread capturer([st] {  // begins inside a scope of its own on the device
    st->table.enter(0);
    st->table.begin(0);
    st->began = true;
    st->table.leave(0);
  });
  hold_on();
  CHECK_FALSE(st->began.load());
  st->go = true;
  worker.join();
  const bool started = eventually(st->began);
  CHECK(started);
  if (!started) {  // (the capturer waits for ever)
    capturer.detach();
    return;
  }
  capturer.join();
  st->table.release(*st->table.end(0));
  delete st;
}
