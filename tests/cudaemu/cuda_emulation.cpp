// Test support: the host emulation of a GPU that runs the CUDA backend's own kernels
// (backends/cuda/*.cu compiled as host C++ against tests/cudaemu/include/, which says what is
// and is not emulated): the launch of a grid, its threads' coordinates, barriers, warp
// exchanges and mma; the few host functions of the backend the kernel files call
// (backends/cuda/backend.cpp's streams, device guard, workspace, errors; gemm.cpp's products
// for the fused linear op, cuBLASLt's part written out, and its matmul's routing); and
// register_emulated_kernels, which registers those kernels for the CUDA device type over a
// simulated GPU's (tests/simcuda/sim_cuda_backend.cpp).
#include "tests/cudaemu/cuda_emulation.h"

#include <cuda_runtime.h>
#include <fmt/format.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/elem.h"
#include "backends/cuda/gemm_shape.h"
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

// The block being run: its threads' coordinates, its barrier, its warps.
struct Block {
  explicit Block(int threads)
      : met{threads},
        coordinates(static_cast<std::size_t>(threads)),
        exchanges(static_cast<std::size_t>(threads), 0) {
    for (int w = 0; w * kWarpLanes < threads; ++w)
      warps.emplace_back(std::min(kWarpLanes, threads - w * kWarpLanes));
  }
  Fibers* fibers = nullptr;
  Fibers::Barrier met;
  std::vector<Coordinates> coordinates;
  std::vector<std::uint64_t> exchanges;  // each thread's warp exchanges so far
  std::vector<Warp> warps;
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

// A cache of fibers by block size: their stacks are reserved once.
Fibers& fibers_for(int threads) {
  static std::map<int, std::unique_ptr<Fibers>> cache;
  auto& f = cache[threads];
  if (!f) f = std::make_unique<Fibers>(threads);
  return *f;
}

// backends/cuda/gemm.cpp's matmul with the matmul registered before (a simulated GPU's: the
// CPU's) in cuBLASLt's place: the products gemm.cpp gives gemm_acc16.cu's sequential kernel
// (16-bit accumulation, k == 0, dimensions past int32) run that kernel, emulated.
template <DType::Code C>
kernels::GemmFn* g_library_gemm = nullptr;

template <DType::Code C>
void emulated_gemm(const kernels::GemmArgs& g) {
  using namespace mixtape::cuda_backend;
  constexpr DType dt{C};
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  const GemmShape s = gemm_shape(g);
  if (const auto acc = sequential_accumulation(dt, g, s))
    return gemm_sequential(elem_of(dt), *acc, s, g.a.const_data_ptr(), g.b.const_data_ptr(),
                           g.out.data_ptr(), nullptr);
  g_library_gemm<C>(g);
}

void register_emulated_gemm() {
  register_op<OpId::matmul>(DeviceType::CUDA, []<DType::Code C>() {
    g_library_gemm<C> = find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CUDA, C).raw();
    return &emulated_gemm<C>;
  });
}

}  // namespace

const Coordinates& here() { return g_block->coordinates[static_cast<std::size_t>(thread_index())]; }

void sync_block() { g_block->fibers->arrive_and_wait(g_block->met); }

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
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        Block b(static_cast<int>(threads));
        b.fibers = &fibers;
        for (std::uint64_t t = 0; t < threads; ++t) {
          const auto tx = static_cast<unsigned>(t % block.x);
          const auto ty = static_cast<unsigned>(t / block.x % block.y);
          const auto tz = static_cast<unsigned>(t / (std::uint64_t{block.x} * block.y));
          b.coordinates[t] = {{tx, ty, tz}, {bx, by, bz}, block, grid};
        }
        g_block = &b;
        try {
          fibers.run([&](int) { thunk(closure); });
        } catch (...) {
          g_block = nullptr;
          throw;
        }
        g_block = nullptr;
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
  register_dropout_kernels();
  register_cross_entropy_kernels();
  register_linear_kernels();
  register_conv_kernels();
  register_emulated_gemm();
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
cudaStream_t launch_stream(int) { return nullptr; }

DeviceGuard::DeviceGuard(int index) : previous_(index) {}
DeviceGuard::~DeviceGuard() = default;

Workspace::Workspace(std::size_t bytes, int index) : bytes_(bytes), index_(index) {
  if (bytes == 0) return;
  ptr_ = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (ptr_ == nullptr) throw OutOfMemoryError("emulated workspace: out of host memory");
  std::memset(ptr_, 0xff, bytes);  // garbage, as fresh device memory may hold
}
Workspace::~Workspace() { std::free(ptr_); }

// --- backends/cuda/gemm.cpp's products for the fused linear op (linear.cu) -----------------
// The plain product through the matmul kernel registered for the device (a simulated GPU's:
// the CPU's). cuBLASLt's float32 product and its epilogues are written out from their
// documented meaning: each sum of products in float32 (rounded once here from a float64 sum;
// the library's order and roundings are its own), the bias added to it in float32, GELU (the
// tanh form) on that, one rounding to the output's dtype; aux the pre-activation in that dtype.

namespace {

// a.x [m, k] times a.w [k, n] (float32, float16 or bfloat16), each sum rounded to float32.
std::vector<float> float32_product(const kernels::LinearArgs& a) {
  const std::int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.w.dim(1);
  const DType dt = a.x.dtype();
  const auto value = [dt](const Tensor& t, std::int64_t i) -> double {
    if (dt == kFloat32) return static_cast<const float*>(t.const_data_ptr())[i];
    return cuda_emu::value_of(static_cast<const std::uint16_t*>(t.const_data_ptr())[i],
                              dt == kBFloat16);
  };
  // w transposed into doubles once, so that each sum runs over two contiguous rows.
  std::vector<double> wt(static_cast<std::size_t>(k * n)), xi(static_cast<std::size_t>(k));
  for (std::int64_t p = 0; p < k; ++p)
    for (std::int64_t j = 0; j < n; ++j) wt[j * k + p] = value(a.w, p * n + j);
  std::vector<float> z(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i) {
    for (std::int64_t p = 0; p < k; ++p) xi[p] = value(a.x, i * k + p);
    for (std::int64_t j = 0; j < n; ++j) {
      double sum = 0;
      for (std::int64_t p = 0; p < k; ++p) sum += xi[p] * wt[j * k + p];
      z[i * n + j] = static_cast<float>(sum);
    }
  }
  return z;
}

// v rounded to dtype (float32, float16, bfloat16) into element i of p.
void store_rounded(void* p, DType dtype, std::int64_t i, float v) {
  if (dtype == kFloat32)
    static_cast<float*>(p)[i] = v;
  else
    static_cast<std::uint16_t*>(p)[i] =
        dtype == kBFloat16 ? detail::float_to_bfloat16_bits(v) : detail::float_to_half_bits(v);
}

}  // namespace

void linear_gemm(const kernels::LinearArgs& a, const Tensor& d) {
  find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CUDA, a.x.dtype())(linear_gemm_args(a, d));
}

bool linear_gemm_float32(const kernels::LinearArgs& a, void* d) {
  const std::vector<float> z = float32_product(a);
  std::memcpy(d, z.data(), z.size() * sizeof(float));
  return true;
}

// As gemm.cpp decides (lt_epilogue_applies), and then always: every problem has an algorithm.
bool linear_gemm_epilogue(const kernels::LinearArgs& a, LinearEpilogue e, const Tensor& d,
                          const Tensor& aux) {
  if (!lt_epilogue_applies(a, aux)) return false;
  const bool bias = e == LinearEpilogue::bias || e == LinearEpilogue::gelu_bias ||
                    e == LinearEpilogue::gelu_aux_bias;
  const bool gelu = e != LinearEpilogue::bias;
  const bool writes_aux = e == LinearEpilogue::gelu_aux || e == LinearEpilogue::gelu_aux_bias;
  const float* b = bias ? static_cast<const float*>(a.bias.const_data_ptr()) : nullptr;
  const std::vector<float> z = float32_product(a);
  const std::int64_t n = a.w.dim(1);
  void* out = d.data_ptr();
  void* pre = writes_aux && aux.defined() ? aux.data_ptr() : nullptr;
  for (std::int64_t i = 0; i < static_cast<std::int64_t>(z.size()); ++i) {
    float v = b ? z[static_cast<std::size_t>(i)] + b[i % n] : z[static_cast<std::size_t>(i)];
    if (pre) store_rounded(pre, aux.dtype(), i, v);
    if (gelu) {
      const double x = v;
      v = static_cast<float>(0.5 * x *
                             (1.0 + std::tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))));
    }
    store_rounded(out, d.dtype(), i, v);
  }
  return true;
}

}  // namespace mixtape::cuda_backend
