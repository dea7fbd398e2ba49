// Test support: what the CUDA backend's kernel files (backends/cuda/*.cu) take from the CUDA
// runtime and the device compiler, for compiling them as host C++ and running their kernels in
// a host emulation of the GPU (tests/cudaemu/cuda_emulation.cpp). Found before the toolkit's
// own header by the emulation's targets only (tests/CMakeLists.txt), so it builds where no CUDA
// toolkit is installed. Nothing here is NVIDIA's text: the names and meanings are the CUDA
// programming guide's; each intrinsic is written out from its documented rounding.
//
// The emulation: a launch runs the grid block after block on the calling thread, each block's
// threads as fibers that run until a barrier (__syncthreads, or a warp's exchange:
// __shfl_xor_sync, mma) and then hand over, blocks and threads in the order
// MIXTAPE_EMULATED_SCHEDULE asks (by index unless it says otherwise); `__shared__` variables are
// function statics (one block lives at a time), filled with all bits set at each block's start
// (backends/cuda/launch.cuh's shared_starts_undefined); atomics are plain read-modify-writes (one
// fiber runs at a time); cp.async's copies land when their thread waits for them (as late as a
// GPU may land them). Memory is host memory. It checks a kernel's indexing, its barriers and
// exchanges and its arithmetic as the host does it; not the hardware's instructions (their
// rounding, FMA contraction, approximate functions), its memory model, nor any speed.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// --- Vector and launch types ---------------------------------------------------------------

struct uint3 {
  unsigned x, y, z;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};

struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4
};

inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "no error" : "invalid argument (emulated)";
}
// Launches in the emulation report failures by throwing; nothing is left pending.
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
// Device memory is host memory, and every queued operation runs at once.
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t n, cudaMemcpyKind,
                                   cudaStream_t = nullptr) {
  if (n) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* p, int value, std::size_t n, cudaStream_t = nullptr) {
  if (n) std::memset(p, value, n);
  return cudaSuccess;
}

// --- The device compiler's annotations ---------------------------------------------------

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

// --- The emulated thread -------------------------------------------------------------------

namespace mixtape::cuda_emu {

// Where the running emulated thread is: what threadIdx, blockIdx, blockDim and gridDim read.
struct Coordinates {
  uint3 thread;
  uint3 block;
  dim3 block_dim;
  dim3 grid_dim;
};
const Coordinates& here();

void sync_block();                                       // __syncthreads
std::uint64_t exchange(std::uint64_t v, int lane_mask);  // one warp's values, XOR-paired
// d += A B for the warp's m16n8k16 fragments (mma.sync ... row.col.f32.{bf16,f16}.f32).
void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                  bool bf16);
// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: the warp's four 8 x 8 tiles of 16-bit
// elements, lane l naming row l % 8 of tile l / 8 (row: 8 elements); r[i] is the lane's pair of
// tile i.
void ldmatrix_x4(std::uint32_t (&r)[4], const void* row, bool trans);
// The shared-memory bank conflicts of the ldmatrix calls so far: each 8 x 8 tile's eight
// 16-byte rows are one access to the 32 four-byte banks, and every four-byte word beyond the
// first that a bank serves in it counts one (0: every tile read in one pass, as the attention
// tiles' padded rows are laid out for). A model of the hardware's rule, not a measurement.
std::uint64_t ldmatrix_bank_conflicts();
std::uint64_t ldmatrix_calls();  // the warp-wide ldmatrix calls so far

// cp.async.cg.shared.global of 16 bytes and its groups (commit_group, wait_group), per thread:
// the source is read when the copy is queued, and the copy lands in shared memory only when its
// thread waits for its group, so that a kernel reading a tile before waiting for it reads what
// was there before (at the block's start, all bits set). Copies queued since the last commit
// are in no group: wait_group does not wait for them, and those a thread leaves unwaited never
// land.
void async_copy16(void* dst, const void* src);
void async_commit();
void async_wait(int groups_in_flight);  // every committed group but the newest N lands

// Fills the bytes of a __shared__ variable with all bits set, the first time a thread of the
// running block reaches it (later calls in the block leave it alone).
void shared_starts_undefined(void* var, std::size_t bytes);

// Runs kernel(args...) on every thread of grid x block; rethrows what a thread threw, or a
// logic_error when the threads wait at barriers that never complete.
void run_grid(dim3 grid, dim3 block, void (*thunk)(const void*), const void* closure);

// The host side of kernel<<<grid, block, 0, stream>>>(args...): launch(grid, block,
// kernel)(args...). The arguments convert to the kernel's parameter types at the call.
template <typename... Params>
auto launch(dim3 grid, dim3 block, void (*kernel)(Params...)) {
  return [grid, block, kernel](std::type_identity_t<Params>... args) {
    const auto call = [&] { kernel(args...); };
    using Call = decltype(call);
    run_grid(
        grid, block, [](const void* c) { (*static_cast<const Call*>(c))(); }, &call);
  };
}

}  // namespace mixtape::cuda_emu

#define threadIdx (::mixtape::cuda_emu::here().thread)
#define blockIdx (::mixtape::cuda_emu::here().block)
#define blockDim (::mixtape::cuda_emu::here().block_dim)
#define gridDim (::mixtape::cuda_emu::here().grid_dim)

inline void __syncthreads() { ::mixtape::cuda_emu::sync_block(); }

// Full warps only (the backend's kernels use a full mask and width 32).
template <typename T>
T __shfl_xor_sync(unsigned, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  bits = ::mixtape::cuda_emu::exchange(bits, lane_mask);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// One emulated thread runs at a time, and never in the middle of these.
template <typename T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}

template <typename T>
T __ldg(const T* p) {
  return *p;
}

// --- Rounding intrinsics ---------------------------------------------------------------------
// The host computes in the default mode, round to nearest even, and these files are compiled
// without contraction (-ffp-contract=off): each _rn operation is the plain one.

inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }

// double -> float toward zero: the nearest float, stepped toward zero when it lies beyond d
// (beyond the float range: the largest finite float; infinities and NaN stay).
inline float __double2float_rz(double d) {
  float f = static_cast<float>(d);
  if (std::isfinite(d) && std::fabs(static_cast<double>(f)) > std::fabs(d))
    f = std::nextafter(f, 0.0f);
  return f;
}

// int64 -> float toward zero (long double holds every int64 exactly).
inline float __ll2float_rz(long long v) {
  float f = static_cast<float>(v);
  if (std::fabs(static_cast<long double>(f)) > std::fabs(static_cast<long double>(v)))
    f = std::nextafter(f, 0.0f);
  return f;
}

// float -> int64 truncated, saturated at the range, NaN -> 0 (cvt.rzi.s64.f32).
inline long long __float2ll_rz(float f) {
  if (f != f) return 0;
  if (f >= 9223372036854775808.0f) return std::numeric_limits<long long>::max();
  if (f < -9223372036854775808.0f) return std::numeric_limits<long long>::min();
  return static_cast<long long>(f);
}
