// The backends' caching allocator (core/caching_allocator.h) over a test system that records
// what it hands out and gets back: small blocks kept by size class, large blocks split from
// segments and merged again when freed, memory given back only where nothing is in use, the
// keep limit, adopted blocks, running out of memory; a random workload that checks that no two
// blocks in use overlap and that everything goes back; a block given back twice, or of another
// size, ends the process; and memory_stats' reserved bytes.
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/caching_allocator.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using Allocator = mt::detail::CachingAllocator;

namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
// A device index no other test's tensors use: the reserved bytes counted on it are this file's.
constexpr int kPool = 60;

// What the system gave and got back; `budget`: the bytes it can give in all.
struct TestSystem {
  std::map<void*, std::size_t> live;  // obtained, not given back
  std::size_t obtained = 0, given_back = 0, releases = 0;
  std::size_t budget = std::size_t{1} << 40;

  Allocator::System system() {
    return {.obtain = [this](int pool, std::size_t bytes) -> void* {
              CHECK(pool == kPool);
              std::size_t held = 0;
              for (const auto& [p, n] : live) held += n;
              if (held + bytes > budget) return nullptr;
              void* p = std::aligned_alloc(64, bytes);
              live.emplace(p, bytes);
              ++obtained;
              return p;
            },
            .give_back =
                [this](int, void* p) {
                  REQUIRE(live.count(p) == 1);  // only what it gave, and only once
                  live.erase(p);
                  std::free(p);
                  ++given_back;
                },
            .before_release = [this](int) { ++releases; }};
  }
  ~TestSystem() {
    for (const auto& [p, n] : live) std::free(p);
  }
};

Allocator::Config test_config(std::size_t keep_limit = std::size_t(-1)) {
  Allocator::Config c;
  c.quantum = 512;
  c.small_limit = kMiB;
  c.granule = 512;
  c.segment = 20 * kMiB;
  c.segment_round = 2 * kMiB;
  c.keep_limit = keep_limit;
  return c;
}

}  // namespace

TEST_CASE("caching allocator: small blocks are kept by size class and reused", "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CUDA, test_config(), sys.system());
  CHECK(a.size_class(0) == 512);
  CHECK(a.size_class(513) == 1024);
  CHECK(a.size_class(kMiB) == kMiB);
  CHECK(a.size_class(kMiB + 1) == kMiB + 512);

  void* p = a.allocate(kPool, 1000);
  CHECK(sys.obtained == 1);
  a.deallocate(kPool, p, 1000);
  CHECK(a.allocate(kPool, 700) == p);  // the same class (1024)
  void* q = a.allocate(kPool, 2000);   // another class: fresh
  CHECK(q != p);
  CHECK(sys.obtained == 2);
  CHECK(a.stats(kPool).reserved == 1024 + 2048);
  a.deallocate(kPool, p, 700);
  a.deallocate(kPool, q, 2000);
  CHECK(a.stats(kPool).kept == 1024 + 2048);
  a.release(kPool);
  CHECK(sys.given_back == 2);
  CHECK(a.stats(kPool).reserved == 0);
}

TEST_CASE("caching allocator: freed large blocks serve requests of other sizes", "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CUDA, test_config(), sys.system());
  // One 64 MiB tensor (a segment of its own), freed; then four of 12 MiB and five of 3 MiB:
  // carved from its memory, nothing new from the system (size classes would need 9 blocks).
  void* big = a.allocate(kPool, 64 * kMiB);
  CHECK(sys.obtained == 1);
  CHECK(a.stats(kPool).reserved == 64 * kMiB);
  a.deallocate(kPool, big, 64 * kMiB);
  std::vector<std::pair<void*, std::size_t>> parts;
  for (int i = 0; i < 4; ++i) parts.emplace_back(a.allocate(kPool, 12 * kMiB), 12 * kMiB);
  for (int i = 0; i < 5; ++i) parts.emplace_back(a.allocate(kPool, 3 * kMiB), 3 * kMiB);
  CHECK(sys.obtained == 1);
  CHECK(parts.front().first == big);
  // Inside the segment, none overlapping.
  auto sorted = parts;
  std::sort(sorted.begin(), sorted.end());
  for (std::size_t i = 0; i + 1 < sorted.size(); ++i)
    CHECK(static_cast<char*>(sorted[i].first) + sorted[i].second <= sorted[i + 1].first);
  CHECK(static_cast<char*>(sorted.back().first) + sorted.back().second <=
        static_cast<char*>(big) + 64 * kMiB);
  // 64 - 48 - 15 = 1 MiB was left: too small for a large request, it went with the last block.
  CHECK(a.stats(kPool).kept == 0);
  // The next 3 MiB does not fit what is left: a new (shared, 20 MiB) segment.
  void* more = a.allocate(kPool, 3 * kMiB);
  CHECK(sys.obtained == 2);
  CHECK(a.stats(kPool).segments == 2);
  CHECK(a.stats(kPool).reserved == 84 * kMiB);
  // Freed in a scattered order, the pieces merge back into one free 64 MiB block, which serves
  // 64 MiB again without the system.
  std::shuffle(parts.begin(), parts.end(), std::mt19937(3));
  for (const auto& [p, n] : parts) a.deallocate(kPool, p, n);
  CHECK(a.stats(kPool).kept == 64 * kMiB + 17 * kMiB);
  void* again = a.allocate(kPool, 64 * kMiB);
  CHECK(again == big);
  CHECK(sys.obtained == 2);
  // release() gives back only segments with nothing in use: here neither.
  a.release(kPool);
  CHECK(sys.given_back == 0);
  a.deallocate(kPool, again, 64 * kMiB);
  a.release(kPool);
  CHECK(sys.given_back == 1);  // the 64 MiB one, by its base
  CHECK(sys.live.count(big) == 0);
  a.deallocate(kPool, more, 3 * kMiB);
  a.release(kPool);
  CHECK(sys.given_back == 2);
  CHECK(a.stats(kPool).reserved == 0);
  CHECK(a.stats(kPool).segments == 0);
}

TEST_CASE("caching allocator: a remainder too small to serve a large request is not split off",
          "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CUDA, test_config(), sys.system());
  void* p = a.allocate(kPool, 12 * kMiB);  // its own segment (over half of 20 MiB): 12 MiB
  a.deallocate(kPool, p, 12 * kMiB);
  void* q = a.allocate(kPool, 11 * kMiB + 512);  // 0.5 MiB would be left: taken whole
  CHECK(q == p);
  CHECK(a.stats(kPool).kept == 0);
  a.deallocate(kPool, q, 11 * kMiB + 512);
  CHECK(a.stats(kPool).kept == 12 * kMiB);
  a.release(kPool);
}

TEST_CASE("caching allocator: the keep limit gives back what is free beyond it", "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CPU, test_config(0), sys.system());
  void* small = a.allocate(kPool, 4096);
  void* large = a.allocate(kPool, 30 * kMiB);
  void* shared1 = a.allocate(kPool, 4 * kMiB);
  void* shared2 = a.allocate(kPool, 4 * kMiB);  // the same 20 MiB segment
  CHECK(sys.obtained == 3);
  a.deallocate(kPool, small, 4096);
  a.deallocate(kPool, large, 30 * kMiB);
  CHECK(sys.given_back == 2);
  a.deallocate(kPool, shared1, 4 * kMiB);  // its segment still in use
  CHECK(sys.given_back == 2);
  a.deallocate(kPool, shared2, 4 * kMiB);
  CHECK(sys.given_back == 3);
  CHECK(sys.releases == 3);  // before each
  CHECK(a.stats(kPool).reserved == 0);
}

TEST_CASE("caching allocator: the keep limit holds whichever block was freed last", "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CPU, test_config(20 * kMiB), sys.system());
  void* p = a.allocate(kPool, 8 * kMiB);
  void* q = a.allocate(kPool, 12 * kMiB);  // the rest of p's 20 MiB segment
  void* w = a.allocate(kPool, 16 * kMiB);  // a segment of its own
  std::vector<void*> small;
  for (int i = 0; i < 8; ++i) small.push_back(a.allocate(kPool, 64 * 1024));
  CHECK(sys.obtained == 10);
  a.deallocate(kPool, w, 16 * kMiB);  // 16 MiB free: kept
  CHECK(sys.given_back == 0);
  for (void* s : small) a.deallocate(kPool, s, 64 * 1024);  // 16.5 MiB free: kept
  CHECK(sys.given_back == 0);
  // 24.5 MiB free: p's block cannot go back (q is in use in its segment), w's segment can.
  a.deallocate(kPool, p, 8 * kMiB);
  CHECK(sys.given_back == 1);
  CHECK(sys.live.count(w) == 0);
  CHECK(a.stats(kPool).kept == 8 * kMiB + 8 * 64 * 1024);
  // Then 20.5 MiB free, 20 of them p and q's whole segment: the largest goes back first.
  a.deallocate(kPool, q, 12 * kMiB);
  CHECK(sys.live.count(p) == 0);
  CHECK(a.stats(kPool).kept == 8 * 64 * 1024);
  CHECK(a.stats(kPool).reserved == a.stats(kPool).kept);
}

TEST_CASE("caching allocator: adopted blocks are handed out as its own", "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CUDA, test_config(), sys.system());
  // Blocks the backend got itself (a CUDA graph's pool), through the same system.
  Allocator::System own = sys.system();
  void* large = own.obtain(kPool, 8 * kMiB);
  void* small = own.obtain(kPool, 2048);
  a.adopt(kPool, large, 8 * kMiB);
  a.adopt(kPool, small, 2000);  // a block of its size class, 2048
  CHECK(a.stats(kPool).reserved == 8 * kMiB + 2048);
  CHECK(a.stats(kPool).kept == 8 * kMiB + 2048);
  CHECK(a.allocate(kPool, 2048) == small);
  void* part = a.allocate(kPool, 3 * kMiB);  // split from the adopted block
  CHECK(part == large);
  CHECK(sys.obtained == 2);
  a.deallocate(kPool, part, 3 * kMiB);
  a.deallocate(kPool, small, 2048);
  a.release(kPool);
  CHECK(sys.live.empty());
  CHECK(a.stats(kPool).reserved == 0);
}

TEST_CASE("caching allocator: out of memory, it gives its kept memory back and tries again",
          "[allocator]") {
  TestSystem sys;
  sys.budget = 40 * kMiB;
  Allocator a(mt::DeviceType::CUDA, test_config(), sys.system());
  void* first = a.allocate(kPool, 30 * kMiB);
  a.deallocate(kPool, first, 30 * kMiB);
  // 36 MiB fits neither the kept 30 MiB block nor beside it: it is given back, and the retry
  // gets the memory.
  void* second = a.allocate(kPool, 36 * kMiB);
  REQUIRE(second != nullptr);
  CHECK(sys.given_back == 1);
  CHECK(a.allocate(kPool, 8 * kMiB) == nullptr);  // 36 + 20 > 40: none left, nothing kept
  CHECK(a.stats(kPool).reserved == 36 * kMiB);
  a.deallocate(kPool, second, 36 * kMiB);
  a.release(kPool);
}

TEST_CASE("caching allocator: a random workload never overlaps blocks and gives all back",
          "[allocator]") {
  TestSystem sys;
  Allocator a(mt::DeviceType::CUDA, test_config(), sys.system());
  std::mt19937_64 rng(2026);
  struct Live {
    unsigned char* p;
    std::size_t n;
    unsigned char tag;
  };
  std::vector<Live> live;
  std::size_t in_use = 0, peak_in_use = 0, peak_reserved = 0;
  for (int step = 0; step < 4000; ++step) {
    const bool grow = live.empty() || (live.size() < 60 && rng() % 100 < 55);
    if (grow) {
      // Sizes from bytes to tens of MiB, log-uniform.
      const double lg = std::uniform_real_distribution<double>(4.0, 25.5)(rng);
      const auto n = static_cast<std::size_t>(std::exp2(lg));
      auto* p = static_cast<unsigned char*>(a.allocate(kPool, n));
      REQUIRE(p != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(p) % 64 == 0);
      const auto tag = static_cast<unsigned char>(step);
      // Its first and last bytes and a few between carry its tag: another block written over
      // them shows when it is freed.
      for (std::size_t k = 0; k < 8; ++k) p[k * (n - 1) / 7] = tag;
      live.push_back({p, n, tag});
      in_use += a.size_class(n);
    } else {
      const std::size_t i = rng() % live.size();
      const Live b = live[i];
      for (std::size_t k = 0; k < 8; ++k) REQUIRE(b.p[k * (b.n - 1) / 7] == b.tag);
      a.deallocate(kPool, b.p, b.n);
      in_use -= a.size_class(b.n);
      live[i] = live.back();
      live.pop_back();
    }
    peak_in_use = std::max(peak_in_use, in_use);
    peak_reserved = std::max(peak_reserved, a.stats(kPool).reserved);
    // Every block in use lies inside memory the system gave.
    if (step % 100 == 0) {
      for (const Live& b : live) {
        auto seg = sys.live.upper_bound(b.p);
        REQUIRE(seg != sys.live.begin());
        --seg;
        CHECK(b.p + a.size_class(b.n) <= static_cast<unsigned char*>(seg->first) + seg->second);
      }
    }
  }
  for (const Live& b : live) a.deallocate(kPool, b.p, b.n);
  a.release(kPool);
  CHECK(sys.live.empty());
  CHECK(a.stats(kPool).reserved == 0);
  // What splitting buys on this workload (not a bound the allocator promises: printed).
  INFO("peak in use " << peak_in_use << ", peak reserved " << peak_reserved);
  CHECK(peak_reserved >= peak_in_use);
}

namespace {

// Runs `misuse` on a fresh allocator in a child process; what the child wrote to stderr, and
// whether it ended by SIGABRT. (The child uses no Catch2 assertions, starts no threads and
// writes nothing to stdout.)
struct Ending {
  bool aborted = false;
  std::string message;
};
Ending run_in_child(const std::function<void(Allocator&)>& misuse) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The test runner's own SIGABRT handler (inherited) would report a failure of its own.
    ::signal(SIGABRT, SIG_DFL);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    Allocator a(mt::DeviceType::CUDA, test_config(),
                {.obtain = [](int, std::size_t bytes) { return std::aligned_alloc(64, bytes); },
                 .give_back = [](int, void* p) { std::free(p); }});
    misuse(a);
    ::_exit(0);  // not reached when the allocator aborts
  }
  ::close(fds[1]);
  Ending e;
  char buf[512];
  for (ssize_t got; (got = ::read(fds[0], buf, sizeof buf)) > 0;)
    e.message.append(buf, static_cast<std::size_t>(got));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  e.aborted = WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT;
  return e;
}

}  // namespace

// A small block kept twice would be handed out to two tensors at once (silently: each writes
// over the other); a large one would be merged into its neighbours twice. Each misuse is a
// backend's bug, and ends the process with a message rather than corrupting memory.
TEST_CASE("caching allocator: a block given back twice, or as another size, ends the process",
          "[allocator]") {
  const std::vector<std::pair<const char*, std::function<void(Allocator&)>>> misuses{
      {"a small block freed twice",
       [](Allocator& a) {
         void* p = a.allocate(kPool, 4096);
         a.deallocate(kPool, p, 4096);
         a.deallocate(kPool, p, 4096);
       }},
      {"a small block freed twice, another in use of its class",
       [](Allocator& a) {
         void* p = a.allocate(kPool, 4096);
         void* q = a.allocate(kPool, 4096);
         a.deallocate(kPool, p, 4096);
         a.deallocate(kPool, p, 4096);
         a.deallocate(kPool, q, 4096);
       }},
      {"a small block freed as another size class",
       [](Allocator& a) {
         void* p = a.allocate(kPool, 4096);
         a.deallocate(kPool, p, 8192);
       }},
      {"a large block freed twice",
       [](Allocator& a) {
         void* p = a.allocate(kPool, 4 * kMiB);
         a.deallocate(kPool, p, 4 * kMiB);
         a.deallocate(kPool, p, 4 * kMiB);
       }},
      {"memory it never gave",
       [](Allocator& a) {
         static char elsewhere[64];
         a.deallocate(kPool, elsewhere, sizeof elsewhere);
       }},
  };
  for (const auto& [what, misuse] : misuses) {
    INFO(what);
    const Ending e = run_in_child(misuse);
    INFO("the child's stderr: " << e.message);
    CHECK(e.aborted);
    CHECK(e.message.find("no block of that address and size is in use here") != std::string::npos);
  }
  // The same calls, each block given back once, end normally.
  const Ending fine = run_in_child([](Allocator& a) {
    void* p = a.allocate(kPool, 4096);
    void* q = a.allocate(kPool, 4 * kMiB);
    a.deallocate(kPool, p, 4000);  // any n of the same size class
    a.deallocate(kPool, q, 4 * kMiB);
    void* again = a.allocate(kPool, 4096);
    a.deallocate(kPool, again, 4096);
  });
  CHECK_FALSE(fine.aborted);
  CHECK(fine.message.empty());
}

TEST_CASE("memory_stats: the CPU's caching allocator reports what it reserves", "[allocator]") {
  const mt::Device cpu = mt::Device::cpu();
  mt::reset_peak_memory(cpu);
  const mt::MemoryStats before = mt::memory_stats(cpu);
  CHECK(before.reserved >= before.in_use);
  CHECK(before.peak_reserved == before.reserved);
  // More than the allocator keeps free (at most what it reserves beyond the tensors): served
  // by new memory from the system.
  const std::uint64_t kept_at_most = before.reserved - before.in_use;
  const std::int64_t floats = static_cast<std::int64_t>((kept_at_most + 48 * kMiB) / 4);
  const std::uint64_t bytes = static_cast<std::uint64_t>(floats) * 4;
  {
    const auto t = mt::Tensor::empty({floats}, mt::kFloat32, cpu);
    const mt::MemoryStats during = mt::memory_stats(cpu);
    CHECK(during.in_use == before.in_use + bytes);
    CHECK(during.reserved >= before.reserved + bytes);
    CHECK(during.peak_reserved == during.reserved);
  }
  const mt::MemoryStats after = mt::memory_stats(cpu);
  CHECK(after.in_use == before.in_use);
  CHECK(after.reserved >= after.in_use);  // kept for reuse (up to MIXTAPE_CPU_CACHE_MB)
  CHECK(after.peak_reserved >= before.reserved + bytes);
  // A device past the table reads 0.
  CHECK(mt::memory_stats(mt::Device::cuda(mt::kMemoryStatsDevices)).reserved == 0);
}
