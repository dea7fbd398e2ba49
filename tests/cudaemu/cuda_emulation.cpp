// Test support: the host emulation of a GPU that runs the CUDA backend's own kernels
// (backends/cuda/*.cu compiled as host C++ against tests/cudaemu/include/, which says what is
// and is not emulated): the launch of a grid, its threads' coordinates, barriers, warp
// exchanges and mma; the few host functions of the backend the kernel files call
// (backends/cuda/backend.cpp's streams, device guard, workspace, errors); and
// register_emulated_kernels, which registers those kernels for the CUDA device type over a
// simulated GPU's (tests/simcuda/sim_cuda_backend.cpp). cuBLASLt, which gemm.cpp calls, is
// emulated in tests/cudaemu/cublaslt_emulation.cpp.
#include "tests/cudaemu/cuda_emulation.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_util.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/error.h"
#include "mixtape/core/half.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/register_kernels.h"
#include "tests/cudaemu/fibers.h"

namespace mixtape::cuda_emu {
namespace {

constexpr int kWarpLanes = 32;
constexpr unsigned kMaxBlockThreads = 1024;

// What the lanes of one warp exchange: a value for __shfl_xor_sync, the fragments for mma.
// Two buffers, used in turn: a lane that has read exchange k's writes exchange k + 1's while
// the others may still read k's, and cannot reach k + 2 (the same buffer as k) before they
// have all arrived at k + 1, so an exchange needs one barrier, not two.
struct Warp {
  explicit Warp(int lanes) : met{lanes}, lanes(lanes) {}
  Fibers::Barrier met;
  int lanes;
  struct Buffer {
    std::uint64_t value[kWarpLanes] = {};
    std::uint32_t a[kWarpLanes][4] = {};
    std::uint32_t b[kWarpLanes][2] = {};
  } buffers[2];
};

// One thread's cp.async copies not yet landed: their bytes, in the order queued, and where each
// committed group ends in that list (the rest are not committed yet).
struct AsyncCopies {
  struct Copy {
    void* dst;
    unsigned char bytes[16];
  };
  std::vector<Copy> queued;
  std::vector<std::size_t> group_ends;
  void clear() {
    queued.clear();
    group_ends.clear();
  }
};

// The block being run: its threads' coordinates, its barrier, its warps. A launch makes one
// and moves it from block to block (begin): a block that completes leaves its barriers with no
// thread arrived, and the warps' buffers need no clearing (an exchange reads what its lanes
// wrote in it).
struct Block {
  Block(dim3 block, dim3 grid)
      : met{static_cast<int>(block.x * block.y * block.z)},
        coordinates(static_cast<std::size_t>(met.expected)),
        exchanges(static_cast<std::size_t>(met.expected), 0),
        copies(static_cast<std::size_t>(met.expected)) {
    const int threads = met.expected;
    for (int w = 0; w * kWarpLanes < threads; ++w)
      warps.emplace_back(std::min(kWarpLanes, threads - w * kWarpLanes));
    unsigned tx = 0, ty = 0, tz = 0;  // thread t's index, counted up (x fastest)
    for (Coordinates& c : coordinates) {
      c = {{tx, ty, tz}, {0, 0, 0}, block, grid};
      if (++tx == block.x) {
        tx = 0;
        if (++ty == block.y) ty = 0, ++tz;
      }
    }
  }
  // Block (x, y, z) of the grid next.
  void begin(unsigned x, unsigned y, unsigned z) {
    for (Coordinates& c : coordinates) c.block = {x, y, z};
    std::fill(exchanges.begin(), exchanges.end(), 0);
    for (AsyncCopies& c : copies) c.clear();  // (the last block's unwaited copies never land)
    shared_filled.clear();
  }
  Fibers* fibers = nullptr;
  Fibers::Barrier met;
  std::vector<Coordinates> coordinates;
  std::vector<std::uint64_t> exchanges;  // each thread's warp exchanges so far
  std::vector<Warp> warps;
  std::vector<AsyncCopies> copies;         // each thread's
  std::vector<const void*> shared_filled;  // the __shared__ variables it has filled with garbage
};

Block* g_block = nullptr;  // the block running now (one at a time: g_launch)
std::mutex g_launch;

int thread_index() { return Fibers::current(); }

// The buffer of this thread's next warp exchange, and its lane.
Warp::Buffer& next_buffer(Warp*& warp, int& lane) {
  const int t = thread_index();
  warp = &g_block->warps[static_cast<std::size_t>(t / kWarpLanes)];
  lane = t % kWarpLanes;
  if (warp->lanes != kWarpLanes)
    throw std::logic_error(
        fmt::format("emulated warp exchange in a partial warp of {} threads (block of {})",
                    warp->lanes, g_block->coordinates.size()));
  return warp->buffers[g_block->exchanges[static_cast<std::size_t>(t)]++ % 2];
}

// Every float16 bit pattern's value (the emulated mma and products convert each operand many
// times).
const std::vector<float> g_half_values = [] {
  std::vector<float> t(std::size_t{1} << 16);
  for (std::size_t i = 0; i < t.size(); ++i)
    t[i] = detail::half_bits_to_float(static_cast<std::uint16_t>(i));
  return t;
}();

float value_of(std::uint16_t bits, bool bf16) {
  return bf16 ? detail::bfloat16_bits_to_float(bits) : g_half_values[bits];
}

float value_of(std::uint32_t reg, int half, bool bf16) {
  return value_of(static_cast<std::uint16_t>(reg >> (16 * half)), bf16);
}

// The order in which the emulation runs a grid's blocks and, between barriers, a block's
// threads: MIXTAPE_EMULATED_SCHEDULE=forward (the default: by index), reverse, or
// shuffled[:SEED] (a random order, a fresh one at each round of the threads; seed 1 unless
// given). The hardware promises no order: a kernel that reads shared or global memory another
// thread writes without a barrier between gives a result that depends on it, and the
// conformance sweep run in each order (tests/CMakeLists.txt) sees it.
struct Schedule {
  Fibers::Order order = Fibers::Order::forward;
  std::uint64_t seed = 1;
};

Schedule parse_schedule(const char* text) {
  const std::string value = text ? text : "";
  Schedule s;
  if (value.empty() || value == "forward") return s;
  if (value == "reverse") {
    s.order = Fibers::Order::reverse;
    return s;
  }
  s.order = Fibers::Order::shuffled;
  if (value == "shuffled") return s;
  constexpr std::string_view kSeeded = "shuffled:";
  if (value.starts_with(kSeeded)) {
    const char* end = value.data() + value.size();
    const auto [at, error] = std::from_chars(value.data() + kSeeded.size(), end, s.seed);
    if (error == std::errc{} && at == end) return s;
  }
  throw Error(
      fmt::format("MIXTAPE_EMULATED_SCHEDULE={}: expected forward, reverse, shuffled "
                  "or shuffled:SEED (SEED a decimal number)",
                  value));
}

const Schedule& schedule() {
  static const Schedule s = parse_schedule(std::getenv("MIXTAPE_EMULATED_SCHEDULE"));
  return s;
}

// A cache of fibers by block size: their stacks are reserved once.
Fibers& fibers_for(int threads) {
  static std::map<int, std::unique_ptr<Fibers>> cache;
  auto& f = cache[threads];
  if (!f) {
    f = std::make_unique<Fibers>(threads);
    f->set_order(schedule().order, schedule().seed + static_cast<std::uint64_t>(threads));
  }
  return *f;
}

// The grid's blocks (as x + grid.x (y + grid.y z)) in the schedule's order.
std::vector<std::uint64_t> block_order(std::uint64_t blocks) {
  static std::mt19937_64 shuffle(schedule().seed);
  std::vector<std::uint64_t> order(blocks);
  for (std::uint64_t i = 0; i < blocks; ++i)
    order[i] = schedule().order == Fibers::Order::reverse ? blocks - 1 - i : i;
  if (schedule().order == Fibers::Order::shuffled)
    std::shuffle(order.begin(), order.end(), shuffle);
  return order;
}

}  // namespace

const Coordinates& here() { return g_block->coordinates[static_cast<std::size_t>(thread_index())]; }

void sync_block() { g_block->fibers->arrive_and_wait(g_block->met); }

// A GPU's shared memory holds what the SM's previous block left; the statics that stand for it
// here would hold this grid's previous block's values, or the last launch's.
void shared_starts_undefined(void* var, std::size_t bytes) {
  auto& filled = g_block->shared_filled;
  if (std::find(filled.begin(), filled.end(), var) != filled.end()) return;
  std::memset(var, 0xff, bytes);
  filled.push_back(var);
}

void async_copy16(void* dst, const void* src) {
  AsyncCopies::Copy c{dst, {}};
  std::memcpy(c.bytes, src, sizeof c.bytes);
  g_block->copies[static_cast<std::size_t>(thread_index())].queued.push_back(c);
}

void async_commit() {
  AsyncCopies& mine = g_block->copies[static_cast<std::size_t>(thread_index())];
  mine.group_ends.push_back(mine.queued.size());
}

void async_wait(int groups_in_flight) {
  AsyncCopies& mine = g_block->copies[static_cast<std::size_t>(thread_index())];
  const auto keep = static_cast<std::size_t>(std::max(groups_in_flight, 0));
  if (mine.group_ends.size() <= keep) return;
  const std::size_t landed_groups = mine.group_ends.size() - keep;
  const std::size_t landed = mine.group_ends[landed_groups - 1];
  for (std::size_t i = 0; i < landed; ++i)
    std::memcpy(mine.queued[i].dst, mine.queued[i].bytes, sizeof mine.queued[i].bytes);
  mine.queued.erase(mine.queued.begin(), mine.queued.begin() + static_cast<std::ptrdiff_t>(landed));
  mine.group_ends.erase(mine.group_ends.begin(),
                        mine.group_ends.begin() + static_cast<std::ptrdiff_t>(landed_groups));
  for (std::size_t& end : mine.group_ends) end -= landed;
}

std::uint64_t exchange(std::uint64_t v, int lane_mask) {
  Warp* warp = nullptr;
  int lane = 0;
  Warp::Buffer& x = next_buffer(warp, lane);
  x.value[lane] = v;
  g_block->fibers->arrive_and_wait(warp->met);
  return x.value[(lane ^ lane_mask) % kWarpLanes];
}

// Lane L = 4 g + c holds A's rows g and g + 8 at columns 2c, 2c + 1 (registers 0 and 1) and
// 2c + 8, 2c + 9 (registers 2 and 3); B's column g at rows 2c, 2c + 1 (register 0) and 2c + 8,
// 2c + 9 (register 1); D's rows g and g + 8 at columns 2c, 2c + 1; the first of a pair is the
// low half (the PTX manual's "Matrix Fragments for mma.m16n8k16 with floating point type").
// The 16-bit products are exact; the sum of 16 of them and d is rounded once here (the
// hardware's order and rounding of the sum are its own).
void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                  bool bf16) {
  Warp* warp = nullptr;
  int lane = 0;
  Warp::Buffer& w = next_buffer(warp, lane);
  std::memcpy(w.a[lane], a, sizeof a);
  std::memcpy(w.b[lane], b, sizeof b);
  g_block->fibers->arrive_and_wait(warp->met);
  const auto a_at = [&](int row, int k) {
    return value_of(w.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2,
                    bf16);
  };
  const auto b_at = [&](int k, int col) {
    return value_of(w.b[col * 4 + (k % 8) / 2][k >= 8 ? 1 : 0], k % 2, bf16);
  };
  const int g = lane / 4, c = lane % 4;
  double rows[2][16], cols[2][16];  // A's rows g and g + 8, B's columns 2c and 2c + 1
  for (int k = 0; k < 16; ++k) {
    rows[0][k] = a_at(g, k), rows[1][k] = a_at(g + 8, k);
    cols[0][k] = b_at(k, 2 * c), cols[1][k] = b_at(k, 2 * c + 1);
  }
  for (int e = 0; e < 4; ++e) {  // D's row g + 8 (e / 2), column 2c + e % 2
    double sum = d[e];
    for (int k = 0; k < 16; ++k) sum += rows[e / 2][k] * cols[e % 2][k];
    d[e] = static_cast<float>(sum);
  }
}

namespace {

std::atomic<std::uint64_t> g_ldmatrix_conflicts{0}, g_ldmatrix_calls{0};

// The bank conflicts of one 8 x 8 tile's rows (addresses of 16 bytes each): the distinct words
// each bank serves, beyond one.
std::uint64_t tile_conflicts(const std::uint64_t (&rows)[8]) {
  std::uint64_t words[32][8];
  int count[32] = {};
  for (const std::uint64_t address : rows)
    for (std::uint64_t w = 0; w < 4; ++w) {
      const std::uint64_t word = address / 4 + w;
      const auto bank = static_cast<std::size_t>(word % 32);
      if (std::find(words[bank], words[bank] + count[bank], word) == words[bank] + count[bank])
        words[bank][count[bank]++] = word;
    }
  std::uint64_t extra = 0;
  for (const int c : count) extra += c > 1 ? static_cast<std::uint64_t>(c - 1) : 0;
  return extra;
}

}  // namespace

// Lane l gets, of tile i (whose row k lane 8 i + k named), row l / 4 at columns 2 (l % 4) and
// 2 (l % 4) + 1, the first in the low half; transposed, column l / 4 at rows 2 (l % 4) and
// 2 (l % 4) + 1 (the PTX manual's "Warp-level matrix load instruction: ldmatrix").
void ldmatrix_x4(std::uint32_t (&r)[4], const void* row, bool trans) {
  Warp* warp = nullptr;
  int lane = 0;
  Warp::Buffer& x = next_buffer(warp, lane);
  x.value[lane] = reinterpret_cast<std::uintptr_t>(row);
  g_block->fibers->arrive_and_wait(warp->met);
  if (lane == 0) ++g_ldmatrix_calls;
  if (lane == 0)
    for (int i = 0; i < 4; ++i) {
      std::uint64_t rows[8];
      for (int k = 0; k < 8; ++k) rows[k] = x.value[8 * i + k];
      g_ldmatrix_conflicts += tile_conflicts(rows);
    }
  const auto row_of = [&](int source) {
    return reinterpret_cast<const std::uint16_t*>(static_cast<std::uintptr_t>(x.value[source]));
  };
  for (int i = 0; i < 4; ++i) {
    std::uint16_t lo = 0, hi = 0;
    if (trans) {
      lo = row_of(8 * i + 2 * (lane % 4))[lane / 4];
      hi = row_of(8 * i + 2 * (lane % 4) + 1)[lane / 4];
    } else {
      lo = row_of(8 * i + lane / 4)[2 * (lane % 4)];
      hi = row_of(8 * i + lane / 4)[2 * (lane % 4) + 1];
    }
    r[i] = static_cast<std::uint32_t>(lo) | (static_cast<std::uint32_t>(hi) << 16);
  }
}

std::uint64_t ldmatrix_bank_conflicts() { return g_ldmatrix_conflicts.load(); }
std::uint64_t ldmatrix_calls() { return g_ldmatrix_calls.load(); }

void run_grid(dim3 grid, dim3 block, void (*thunk)(const void*), const void* closure) {
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > kMaxBlockThreads ||
      grid.y > 65535 || grid.z > 65535 || block.z > 64)
    throw Error(
        fmt::format("emulated launch: invalid configuration (grid {} x {} x {}, block {} "
                    "x {} x {}), which a GPU refuses",
                    grid.x, grid.y, grid.z, block.x, block.y, block.z));
  std::lock_guard lock(g_launch);
  Fibers& fibers = fibers_for(static_cast<int>(threads));
  const std::uint64_t blocks = std::uint64_t{grid.x} * grid.y * grid.z;
  Block b(block, grid);
  b.fibers = &fibers;
  const auto run_block = [&](std::uint64_t index) {
    b.begin(static_cast<unsigned>(index % grid.x), static_cast<unsigned>(index / grid.x % grid.y),
            static_cast<unsigned>(index / (std::uint64_t{grid.x} * grid.y)));
    g_block = &b;
    try {
      fibers.run([&](int) { thunk(closure); });
    } catch (...) {
      g_block = nullptr;
      throw;
    }
    g_block = nullptr;
  };
  if (schedule().order == Fibers::Order::forward) {
    for (std::uint64_t i = 0; i < blocks; ++i) run_block(i);
  } else {
    for (const std::uint64_t i : block_order(blocks)) run_block(i);
  }
}

void register_emulated_kernels() {
  using namespace mixtape::cuda_backend;
  register_memory_kernels();
  register_elementwise_kernels();
  register_reduction_kernels();
  register_index_kernels();
  register_optim_kernels();
  register_pool_kernels();
  register_attention_kernels();
  register_layer_norm_kernels();
  register_batch_norm_kernels();
  register_dropout_kernels();
  register_cross_entropy_kernels();
  register_linear_kernels();
  register_float8_kernels();
  register_conv_kernels();
  register_gemm_kernels();
}

}  // namespace mixtape::cuda_emu

// --- backends/cuda/backend.cpp's functions that the kernel files call ---------------------

namespace mixtape::cuda_backend {

void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw Error(fmt::format("CUDA error (emulated) in {} at {}:{}: {}", what, file, line,
                          cudaGetErrorString(err)));
}

// One queue: every operation runs when it is issued.
cudaStream_t stream(int) { return nullptr; }
LaunchScope::LaunchScope(int index) : index_(index) {}
LaunchScope::~LaunchScope() = default;

DeviceGuard::DeviceGuard(int index) : previous_(index) {}
DeviceGuard::~DeviceGuard() = default;

Workspace::Workspace(std::size_t bytes, int index) : bytes_(bytes), index_(index) {
  if (bytes == 0) return;
  ptr_ = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (ptr_ == nullptr) throw OutOfMemoryError("emulated workspace: out of host memory");
  std::memset(ptr_, 0xff, bytes);  // garbage, as fresh device memory may hold
}
Workspace::~Workspace() { std::free(ptr_); }

}  // namespace mixtape::cuda_backend
