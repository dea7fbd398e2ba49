// quantize_float8 on CUDA (mixtape/core/kernels.h, QuantizeFloat8Args): three launches, all
// on the device, no host wait:
//   1. amax partials: up to kAmaxBlocks blocks, each the largest |float32(x)| of its share;
//   2. the factor: one block takes the partials' largest (the amax), the history's largest,
//      the factor and the scale, then rolls the history when asked;
//   3. the conversion: float32(x) * factor rounded to float32, then to the format (cvt with
//      saturation), into x's layout, its transpose, or both from one read of x (tiles through
//      shared memory for the transpose: 64 x 64 with 16-byte accesses for the operands of FP8
//      products, 32 x 32 element by element for other shapes).
// Written by hand: cuBLASLt takes FP8 operands and scales but makes neither the amax nor the
// FP8 copies, and no CUDA library writes a scaled, saturated FP8 transpose.
// The maxima compare the bits of non-negative floats as unsigned integers: their order is the
// values', every NaN (sign cleared) lies above infinity, and the result does not depend on the
// order of the comparisons: the CPU kernel's bits (backends/cpu/float8_quantize.cpp).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/warp.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// About the blocks an H100 holds at once (8 of 256 threads per multiprocessor, 132 of them).
constexpr int kAmaxBlocks = 1024;
constexpr int kTile = 32;  // the transposing conversion's tiles: kTile x kTile elements

// The element as float32: exact from the 16-bit floats, rounded to nearest from float64.
template <typename T>
__device__ __forceinline__ float as_float(T v) {
  return static_cast<float>(load(v));
}

// The largest of v over the block's kThreads threads; every thread gets it.
__device__ unsigned block_max_bits(unsigned v) {
  __shared__ unsigned lanes[kThreads / kWarp];
  shared_starts_undefined(lanes);
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const unsigned o = __shfl_xor_sync(0xffffffffu, v, off);
    v = o > v ? o : v;
  }
  if (threadIdx.x % kWarp == 0) lanes[threadIdx.x / kWarp] = v;
  __syncthreads();
  unsigned m = 0;
  for (int w = 0; w < kThreads / kWarp; ++w) m = lanes[w] > m ? lanes[w] : m;
  __syncthreads();  // lanes may be written again by the next call
  return m;
}

__device__ __forceinline__ unsigned abs_bits(float v) { return __float_as_uint(fabsf(v)); }

// With `vec`, x is 16-byte aligned and is read as 16-byte packs, then a scalar tail (as the
// elementwise kernels' fast paths).
template <typename T>
__global__ void amax_partials_kernel(const T* __restrict__ x, int64_t n, bool vec,
                                     unsigned* __restrict__ partials) {
  unsigned m = 0;
  int64_t done = 0;
  if (vec) {
    constexpr int N = kVec<T>;
    const auto* xv = reinterpret_cast<const Pack<T, N>*>(x);
    MIXTAPE_GRID_LOOP(i, n / N) {
      const Pack<T, N> p = xv[i];
#pragma unroll
      for (int k = 0; k < N; ++k) {
        const unsigned b = abs_bits(as_float(p.v[k]));
        m = b > m ? b : m;
      }
    }
    done = n / N * N;
  }
  MIXTAPE_GRID_LOOP(j, n - done) {
    const unsigned b = abs_bits(as_float(x[done + j]));
    m = b > m ? b : m;
  }
  m = block_max_bits(m);
  if (threadIdx.x == 0) partials[blockIdx.x] = m;
}

// One block: amax = the partials' largest; reference = the history's largest when it is > 0
// (no NaN in the history), else amax; factor = top / reference (1 when reference is not > 0),
// scale = 1 / factor; then, with `update`, history = [amax, history[0 .. length - 2]].
__global__ void factor_kernel(const unsigned* __restrict__ partials, int count, float* history,
                              int64_t length, float top, bool update, float* __restrict__ factor,
                              float* __restrict__ scale, float* __restrict__ amax) {
  unsigned bits = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += kThreads)
    bits = partials[i] > bits ? partials[i] : bits;
  const float a = __uint_as_float(block_max_bits(bits));
  float reference = a;
  if (history) {
    // The history's largest as the bits of a float with its sign folded so that unsigned order
    // is the values' (negative values reversed below the positive ones); a NaN anywhere is
    // flagged apart.
    unsigned best = 0, nan = 0;
    for (int64_t i = threadIdx.x; i < length; i += kThreads) {
      const float h = history[i];
      const unsigned u = __float_as_uint(h);
      if (h != h) nan = 1;
      const unsigned key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
      best = key > best ? key : best;
    }
    nan = block_max_bits(nan);
    best = block_max_bits(best);
    const float recorded = __uint_as_float((best & 0x80000000u) ? (best & 0x7fffffffu) : ~best);
    if (!nan && recorded > 0.0f) reference = recorded;
  }
  const float f = reference > 0.0f ? __fdiv_rn(top, reference) : 1.0f;
  if (threadIdx.x == 0) {
    *factor = f;
    *scale = __fdiv_rn(1.0f, f);
    *amax = a;
  }
  if (!history || !update) return;
  // The roll, kThreads elements at a time from the end: in each round every thread reads its
  // source (one below its destination) before any thread writes, and a barrier separates the
  // rounds (a round's lowest source is the next round's highest destination).
  for (int64_t end = length; end > 1; end -= kThreads) {
    const int64_t i = end - 1 - threadIdx.x;
    float v = 0.0f;
    if (i >= 1) v = history[i - 1];
    __syncthreads();
    if (i >= 1) history[i] = v;
    __syncthreads();
  }
  if (threadIdx.x == 0) history[0] = a;
}

template <__nv_fp8_interpretation_t kKind>
__device__ __forceinline__ std::uint8_t to_float8(float v) {
  return __nv_cvt_float_to_fp8(v, __NV_SATFINITE, kKind);
}

// data[i] = float8(float32(x[i]) * factor), x's layout; with `vec`, x and data 16-byte
// aligned, a pack of x (16 bytes) at a time, then a scalar tail.
template <typename T, __nv_fp8_interpretation_t kKind>
__global__ void convert_kernel(const T* __restrict__ x, int64_t n, bool vec,
                               const float* __restrict__ factor, std::uint8_t* __restrict__ data) {
  const float f = *factor;
  int64_t done = 0;
  if (vec) {
    constexpr int N = kVec<T>;
    const auto* xv = reinterpret_cast<const Pack<T, N>*>(x);
    auto* dv = reinterpret_cast<Pack<std::uint8_t, N>*>(data);
    MIXTAPE_GRID_LOOP(i, n / N) {
      const Pack<T, N> p = xv[i];
      Pack<std::uint8_t, N> q;
#pragma unroll
      for (int k = 0; k < N; ++k) q.v[k] = to_float8<kKind>(__fmul_rn(as_float(p.v[k]), f));
      dv[i] = q;
    }
    done = n / N * N;
  }
  MIXTAPE_GRID_LOOP(j, n - done) {
    data[done + j] = to_float8<kKind>(__fmul_rn(as_float(x[done + j]), f));
  }
}

// The same for x [rows, cols] a tile at a time: a warp reads a row of kTile elements, the tile
// goes through shared memory, and a warp writes a row of kTile bytes of the transpose
// data_t [cols, rows]; data (x's layout, null when not wanted) from the same read.
template <typename T, __nv_fp8_interpretation_t kKind>
__global__ void convert_transpose_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                         const float* __restrict__ factor,
                                         std::uint8_t* __restrict__ data,
                                         std::uint8_t* __restrict__ data_t) {
  __shared__ std::uint8_t tile[kTile][kTile + 1];
  shared_starts_undefined(tile);
  const float f = *factor;
  const int lane = static_cast<int>(threadIdx.x) % kTile;
  const int warp = static_cast<int>(threadIdx.x) / kTile;
  constexpr int kWarps = kThreads / kTile;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTile;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = rt * kTile;
    for (int r = warp; r < kTile; r += kWarps) {
      const int64_t row = r0 + r, col = c0 + lane;
      if (row < rows && col < cols) {
        const std::uint8_t q = to_float8<kKind>(__fmul_rn(as_float(x[row * cols + col]), f));
        if (data) data[row * cols + col] = q;
        tile[r][lane] = q;
      }
    }
    __syncthreads();
    for (int c = warp; c < kTile; c += kWarps) {
      const int64_t col = c0 + c, row = r0 + lane;
      if (row < rows && col < cols) data_t[col * rows + row] = tile[lane][c];
    }
    __syncthreads();
  }
}

// The same for the operands of FP8 products: rows and cols multiples of 16 (cuBLASLt's FP8
// GEMM takes dims in 16s), x, data and data_t 16-byte aligned; 64 x 64 tiles, every global
// access 16 bytes. A thread reads 16 elements of a row (one 16-byte pack of x, or two, or
// four), writes their 16 FP8 bytes to data and to the tile in shared memory; after the barrier
// it gathers one column's bytes of 16 rows from the tile and writes them as 16 bytes of data_t's
// row. convert_transpose_kernel reads 2 bytes and writes 1 a lane (2 KB a block in flight): too
// few reads in flight to keep the memory busy; here a block has 8 KB of 16-bit x in flight.
// The bytes are the same (the same conversion of the same values).
constexpr int kWideTile = 64;
constexpr int kWideChunk = 16;  // elements of a row a thread converts, rows of a column it writes

template <typename T, __nv_fp8_interpretation_t kKind>
__global__ void convert_transpose_wide_kernel(const T* __restrict__ x, int64_t rows, int64_t cols,
                                              const float* __restrict__ factor,
                                              std::uint8_t* __restrict__ data,
                                              std::uint8_t* __restrict__ data_t) {
  using Bytes = Pack<std::uint8_t, kWideChunk>;
  constexpr int kChunks = kWideTile / kWideChunk;  // per tile row
  static_assert(kThreads == kWideTile * kChunks, "a thread per 16 elements of a tile");
  // Row r's 64 bytes as 4 chunks (a warp's reads in the second half: one row, 8 words).
  __shared__ Bytes tile[kWideTile][kChunks];
  shared_starts_undefined(tile);
  const float f = *factor;
  const int t = static_cast<int>(threadIdx.x);
  const int r = t / kChunks, q = t % kChunks;        // reading: row r, chunk q
  const int cl = t % kWideTile, wq = t / kWideTile;  // writing: column cl, rows 16 wq ..
  const int64_t row_tiles = (rows + kWideTile - 1) / kWideTile;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kWideTile;
  for (int64_t rt = blockIdx.y; rt < row_tiles; rt += gridDim.y) {
    const int64_t r0 = rt * kWideTile;
    const int64_t row = r0 + r, col = c0 + kWideChunk * q;
    if (row < rows && col < cols) {  // (cols a multiple of 16: the chunk is whole)
      constexpr int N = kVec<T>;
      const auto* src = reinterpret_cast<const Pack<T, N>*>(x + row * cols + col);
      Pack<T, N> in[kWideChunk / N];
#pragma unroll
      for (int k = 0; k < kWideChunk / N; ++k) in[k] = src[k];  // (all loads before any use)
      Bytes out;
#pragma unroll
      for (int k = 0; k < kWideChunk / N; ++k)
#pragma unroll
        for (int e = 0; e < N; ++e)
          out.v[k * N + e] = to_float8<kKind>(__fmul_rn(as_float(in[k].v[e]), f));
      if (data) *reinterpret_cast<Bytes*>(data + row * cols + col) = out;
      tile[r][q] = out;
    }
    __syncthreads();
    const int64_t tcol = c0 + cl, trow = r0 + kWideChunk * wq;
    if (tcol < cols && trow < rows) {  // (rows a multiple of 16: the 16 rows are all there)
      Bytes out;
#pragma unroll
      for (int k = 0; k < kWideChunk; ++k)
        out.v[k] = tile[kWideChunk * wq + k][cl / kWideChunk].v[cl % kWideChunk];
      *reinterpret_cast<Bytes*>(data_t + tcol * rows + trow) = out;
    }
    __syncthreads();  // the tile is read before the next turn writes it
  }
}

template <typename T, __nv_fp8_interpretation_t kKind>
void convert(const kernels::QuantizeFloat8Args& a, const float* factor, cudaStream_t s) {
  const auto* x = static_cast<const T*>(a.x.const_data_ptr());
  auto* data = a.data.defined() ? static_cast<std::uint8_t*>(a.data.data_ptr()) : nullptr;
  const int64_t n = a.rows * a.cols;
  if (!a.data_t.defined()) {
    const bool vec = aligned16(x) && aligned16(data);
    launch_1d({"quantize_float8 conversion kernel", vec ? n / kVec<T> + kVec<T> : n, s},
              convert_kernel<T, kKind>, x, n, vec, factor, data);
    return;
  }
  auto* data_t = static_cast<std::uint8_t*>(a.data_t.data_ptr());
  const bool wide = a.rows % kWideChunk == 0 && a.cols % kWideChunk == 0 && aligned16(x) &&
                    aligned16(data) && aligned16(data_t);
  const int tile = wide ? kWideTile : kTile;
  const int64_t row_tiles = (a.rows + tile - 1) / tile;
  const dim3 grid(static_cast<unsigned>((a.cols + tile - 1) / tile),
                  static_cast<unsigned>(row_tiles < 65535 ? row_tiles : 65535));
  if (wide) {
    MIXTAPE_CUDA_LAUNCH(grid, kThreads, s, convert_transpose_wide_kernel<T, kKind>)
    (x, a.rows, a.cols, factor, data, data_t);
  } else {
    MIXTAPE_CUDA_LAUNCH(grid, kThreads, s, convert_transpose_kernel<T, kKind>)
    (x, a.rows, a.cols, factor, data, data_t);
  }
  check_cuda(cudaGetLastError(), "quantize_float8 transposing conversion kernel", __FILE__,
             __LINE__);
}

template <typename T>
void quantize_float8_host(const kernels::QuantizeFloat8Args& a) {
  const int64_t n = a.rows * a.cols;
  OnDevice on(a.scale);
  const bool e4m3 = (a.data.defined() ? a.data : a.data_t).dtype() == kFloat8E4M3FN;
  const unsigned blocks =
      n == 0 ? 0u : std::min<unsigned>(kAmaxBlocks, blocks_for(n / kVec<T> + kVec<T>));
  // The partials, then the factor.
  Workspace work((blocks + 1) * sizeof(unsigned), on.index);
  auto* partials = static_cast<unsigned*>(work.data());
  auto* factor = reinterpret_cast<float*>(partials + blocks);
  const auto* x = static_cast<const T*>(a.x.const_data_ptr());
  if (blocks > 0) {
    MIXTAPE_CUDA_LAUNCH(blocks, kThreads, on.s, amax_partials_kernel<T>)
    (x, n, aligned16(x), partials);
    check_cuda(cudaGetLastError(), "quantize_float8 amax kernel", __FILE__, __LINE__);
  }
  const float top = static_cast<float>(std::ldexp(e4m3 ? 448.0 : 57344.0, -a.margin));
  float* history = a.history.defined() ? static_cast<float*>(a.history.data_ptr()) : nullptr;
  MIXTAPE_CUDA_LAUNCH(1, kThreads, on.s, factor_kernel)
  (partials, static_cast<int>(blocks), history, history ? a.history.numel() : 0, top, a.update,
   factor, static_cast<float*>(a.scale.data_ptr()), static_cast<float*>(a.amax.data_ptr()));
  check_cuda(cudaGetLastError(), "quantize_float8 factor kernel", __FILE__, __LINE__);
  if (n == 0) return;
  if (e4m3)
    convert<T, __NV_E4M3>(a, factor, on.s);
  else
    convert<T, __NV_E5M2>(a, factor, on.s);
}

}  // namespace

void register_float8_kernels() { MIXTAPE_CUDA_KERNEL(quantize_float8, quantize_float8_host); }

}  // namespace mixtape::cuda_backend
