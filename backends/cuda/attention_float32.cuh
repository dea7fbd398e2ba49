// Private to the CUDA backend (included by attention.cu): the fused attention's tiled kernels
// for float32 heads of any width up to 64 that is a multiple of 4 (q, k and v alike; the
// kernels are made for widths D of 32 and 64, and a narrower head's columns past its width read
// as zeros and are not written), FlashAttention-2's loops on the float32 units (float32 has no
// tensor-core product that keeps its precision).
//
// Why: the plain kernels (a warp per row, each logit a dot product summed over the warp by
// shuffles, computed twice) made a float32 charlm step on an H200 five times PyTorch's
// (docs/charlm.md, "On a GPU"). Here a block holds a tile of rows of q (and dout) and walks
// the keys 32 at a time in shared memory; each thread computes a 4 x 4 part of the tile's
// logits with 16 multiply-adds per two 16-byte shared loads, the rows' online softmax takes
// three shuffles over the 8 threads of a row, and the weights go through shared memory into
// the thread's 4 rows x D / 8 columns of the output. No [t, s] matrix is made; lse is saved
// for the backward pass, which runs as the tensor-core kernels' does: dq by query blocks, dk
// and dv by key blocks, each sum with one owner in a fixed order (no atomics).
//
// The thread at (ty, tx) of a block (tx = thread % 8) owns tile rows ty + g a and tile columns
// tx + 8 b (a, b < 4; g: the block's row groups), which makes every 16-byte shared read of a
// warp touch distinct banks (rows of D + 4 floats: 8 consecutive rows start 4 banks apart), and
// output columns 4 tx + 32 u, read from the value tiles 16 bytes at a time. The arithmetic is
// float32 throughout (the softmax in base 2, exp2 of the scaled logit less the row's maximum,
// as the tensor-core kernels), so the results are the float32 computation in another order of
// addition than the CPU's, within the sweep's float32 tolerance.
#pragma once

#include <cmath>
#include <cstdint>

#include "backends/cuda/attention_tiles.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "mixtape/core/head_rows.h"

namespace mixtape::cuda_backend::attention_float32 {

using std::int64_t;

inline constexpr int kMicro = 4;                        // a thread's rows and columns of a tile
inline constexpr int kColThreads = 8;                   // threads across a tile's columns
inline constexpr int kTileCols = kColThreads * kMicro;  // 32 keys (queries for dk, dv) a tile
inline constexpr int kForwardThreads = 128;             // forward: 64 query rows a block
inline constexpr int kBackwardThreads = 64;             // dq: 32 query rows; dk, dv: 32 keys
inline constexpr int kWeightStride = kTileCols + 8;     // a weight tile's row, in floats
using attention_tiles::kLog2e;
using attention_tiles::kNegInf;

// Rows of a tile of a head's rows or weights for a block of `threads` threads.
constexpr int rows_of(int threads) { return threads / kColThreads * kMicro; }

// Whether these kernels take heads of these widths (q, k: d; v: dv), and the kernels' width D
// for a head of width d.
constexpr bool supports(int64_t d, int64_t dv) { return d == dv && d % 4 == 0 && d > 0 && d <= 64; }
constexpr int kernel_width(int64_t d) { return d <= 32 ? 32 : 64; }

using Vec = Pack<float, 4>;

// One call's operands (attention_tiles.h's, read as float), and the pieces the tiled
// kernels share: whether a row attends a key, dropout's factor, the seed's place.
using Params = attention_tiles::ParamsOf<float>;
using attention_tiles::attends;
using attention_tiles::keep_factor;
using attention_tiles::read_seed;

// The last key a block of query rows row0 .. row0 + rows - 1 attends, plus one.
__device__ __forceinline__ int64_t key_end(const Params& p, int64_t row0, int rows) {
  if (!p.causal) return p.s;
  const int64_t last = (row0 + rows < p.t ? row0 + rows : p.t) - 1;
  return last + 1 < p.s ? last + 1 : p.s;
}

// Rows row0 .. row0 + R - 1 of a head ([rows, width]) into a shared tile (zeros past the last
// row and past the width), by the block's `Threads` threads, 16 bytes a thread at a time.
template <int D, int R, int Threads>
__device__ __forceinline__ void load_tile(float (&tile)[R][D + 4],
                                          const HeadRows<const float>::Head& m, int64_t row0,
                                          int64_t rows, int width) {
  constexpr int kChunks = D / 4;
  for (int e = static_cast<int>(threadIdx.x); e < R * kChunks; e += Threads) {
    const int r = e / kChunks, c = (e % kChunks) * 4;
    Vec v{};
    if (row0 + r < rows && c < width) v = *reinterpret_cast<const Vec*>(m.row(row0 + r) + c);
    *reinterpret_cast<Vec*>(&tile[r][c]) = v;
  }
}

// x[a][b] = the dot product of rows a0 + a step_a of A and b0 + b step_b of B (D wide), k in
// order.
template <int D, int RA, int RB>
__device__ __forceinline__ void dot_tile(float (&x)[kMicro][kMicro], const float (&A)[RA][D + 4],
                                         int a0, int step_a, const float (&B)[RB][D + 4], int b0,
                                         int step_b) {
#pragma unroll
  for (int a = 0; a < kMicro; ++a)
#pragma unroll
    for (int b = 0; b < kMicro; ++b) x[a][b] = 0.0f;
#pragma unroll
  for (int k = 0; k < D; k += 4) {
    Vec va[kMicro], vb[kMicro];
#pragma unroll
    for (int a = 0; a < kMicro; ++a) va[a] = *reinterpret_cast<const Vec*>(&A[a0 + a * step_a][k]);
#pragma unroll
    for (int b = 0; b < kMicro; ++b) vb[b] = *reinterpret_cast<const Vec*>(&B[b0 + b * step_b][k]);
#pragma unroll
    for (int e = 0; e < 4; ++e)
#pragma unroll
      for (int a = 0; a < kMicro; ++a)
#pragma unroll
        for (int b = 0; b < kMicro; ++b) x[a][b] += va[a].v[e] * vb[b].v[e];
  }
}

// acc[a][4 u + e] += the sum over the tile's 32 columns j of W[a0 + a step_a][j] M[j][4 tx +
// 32 u + e], j in order: a thread's rows of (weights) x (rows of a head).
template <int D, int RW>
__device__ __forceinline__ void weigh_tile(float (&acc)[kMicro][D / 8],
                                           const float (&W)[RW][kWeightStride], int a0, int step_a,
                                           const float (&M)[kTileCols][D + 4], int tx) {
#pragma unroll
  for (int j = 0; j < kTileCols; j += 4) {
    Vec w[kMicro];
#pragma unroll
    for (int a = 0; a < kMicro; ++a) w[a] = *reinterpret_cast<const Vec*>(&W[a0 + a * step_a][j]);
#pragma unroll
    for (int jj = 0; jj < 4; ++jj)
#pragma unroll
      for (int u = 0; u < D / 32; ++u) {
        const Vec m = *reinterpret_cast<const Vec*>(&M[j + jj][4 * tx + 32 * u]);
#pragma unroll
        for (int a = 0; a < kMicro; ++a)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[a][4 * u + e] += w[a].v[jj] * m.v[e];
      }
  }
}

// Row `row` of a head's output, a thread's columns 4 tx + 32 u (16 bytes each) below the
// width, times factor.
template <int D>
__device__ __forceinline__ void store_row(const HeadRows<float>::Head& m, int64_t row,
                                          const float (&acc)[D / 8], float factor, int tx,
                                          int width) {
  float* out = m.row(row);
#pragma unroll
  for (int u = 0; u < D / 32; ++u) {
    if (4 * tx + 32 * u >= width) continue;
    Vec v;
#pragma unroll
    for (int e = 0; e < 4; ++e) v.v[e] = acc[4 * u + e] * factor;
    *reinterpret_cast<Vec*>(out + 4 * tx + 32 * u) = v;
  }
}

// The sum of v over the 8 threads of a tile row (consecutive lanes), and below the maximum.
__device__ __forceinline__ float row_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v + __shfl_xor_sync(0xffffffffu, v, 4);
}
// (fmaxf ignores a NaN on one side: the running maximum never becomes NaN, and a row of NaN
// logits gives NaN through its sums, as the tensor-core kernels.)
__device__ __forceinline__ float row_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 4));
}

// --- Forward: out and lse of 64 query rows of head blockIdx.x -----------------------------

template <int D>
__global__ void __launch_bounds__(kForwardThreads) forward_kernel(Params p) {
  constexpr int kRows = rows_of(kForwardThreads), kGroups = kRows / kMicro;
  struct Shared {
    alignas(16) float q[kRows][D + 4];
    alignas(16) float k[kTileCols][D + 4];
    alignas(16) float v[kTileCols][D + 4];
    alignas(16) float w[kRows][kWeightStride];
  };
  __shared__ Shared sh;
  shared_starts_undefined(sh);
  read_seed(p);
  const int tx = static_cast<int>(threadIdx.x) % kColThreads;
  const int ty = static_cast<int>(threadIdx.x) / kColThreads;
  const int64_t h = blockIdx.x;
  // Blocks in reverse launch order: under a causal mask the later rows walk the most keys.
  const int64_t row0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRows;
  const auto k_head = p.k.head(h), v_head = p.v.head(h);
  const auto mask = p.mask.head(h);
  int64_t rows[kMicro];
  const std::uint8_t* mask_rows[kMicro];
#pragma unroll
  for (int a = 0; a < kMicro; ++a) {
    rows[a] = row0 + ty + kGroups * a;
    mask_rows[a] = rows[a] < p.t ? mask.row(rows[a]) : nullptr;
  }
  load_tile<D, kRows, kForwardThreads>(sh.q, p.q.head(h), row0, p.t, p.width);

  float o[kMicro][D / 8] = {};
  float m[kMicro], l[kMicro];  // running maxima (base-2 logits) and this thread's part of sums
#pragma unroll
  for (int a = 0; a < kMicro; ++a) m[a] = kNegInf, l[a] = 0.0f;
  const int64_t end = key_end(p, row0, kRows);
  for (int64_t key0 = 0; key0 < end; key0 += kTileCols) {
    __syncthreads();  // every thread is done with the last tiles
    load_tile<D, kTileCols, kForwardThreads>(sh.k, k_head, key0, p.s, p.width);
    load_tile<D, kTileCols, kForwardThreads>(sh.v, v_head, key0, p.s, p.width);
    __syncthreads();
    float x[kMicro][kMicro];
    dot_tile<D>(x, sh.q, ty, kGroups, sh.k, tx, kColThreads);
#pragma unroll
    for (int a = 0; a < kMicro; ++a) {
      float tile_max = kNegInf;
#pragma unroll
      for (int b = 0; b < kMicro; ++b) {
        const bool in = attends(p, mask_rows[a], rows[a], key0 + tx + kColThreads * b);
        x[a][b] = in ? x[a][b] * p.scale_log2 : kNegInf;
        tile_max = fmaxf(tile_max, x[a][b]);
      }
      const float m_new = fmaxf(m[a], row_max(tile_max));
      // Nothing attended yet: the row's sums and outputs are still 0, nothing to rescale.
      const float alpha = m_new == kNegInf ? 1.0f : exp2f(m[a] - m_new);
      m[a] = m_new;
      l[a] *= alpha;
#pragma unroll
      for (int c = 0; c < D / 8; ++c) o[a][c] *= alpha;
#pragma unroll
      for (int b = 0; b < kMicro; ++b) {
        const float w = m[a] == kNegInf ? 0.0f : exp2f(x[a][b] - m[a]);
        l[a] += w;  // (the sums are of the undropped weights)
        sh.w[ty + kGroups * a][tx + kColThreads * b] =
            w * keep_factor(p, h, rows[a], key0 + tx + kColThreads * b);
      }
    }
    __syncthreads();  // the tile's weights are in place
    weigh_tile<D>(o, sh.w, ty, kGroups, sh.v, tx);
  }

  // out = o / l, lse = (m + log2 l) ln 2 (0 and -inf for a row that attends nothing).
  const auto out = p.out.head(h);
#pragma unroll
  for (int a = 0; a < kMicro; ++a) {
    const float sum = row_sum(l[a]);
    if (rows[a] >= p.t) continue;
    if (tx == 0) p.lse[h * p.t + rows[a]] = sum == 0.0f ? kNegInf : (m[a] + log2f(sum)) / kLog2e;
    store_row<D>(out, rows[a], o[a], sum == 0.0f ? 0.0f : 1.0f / sum, tx, p.width);
  }
}

// --- Backward ----------------------------------------------------------------------------

// dq of 32 query rows of head blockIdx.x: the forward's walk over the keys, P from lse:
// dq = scale sum over the keys of dS K, dS = P o (Z o (dout V^T) - D).
template <int D>
__global__ void __launch_bounds__(kBackwardThreads) dq_kernel(Params p) {
  constexpr int kRows = rows_of(kBackwardThreads), kGroups = kRows / kMicro;
  struct Shared {
    alignas(16) float q[kRows][D + 4];
    alignas(16) float g[kRows][D + 4];  // dout
    alignas(16) float k[kTileCols][D + 4];
    alignas(16) float v[kTileCols][D + 4];
    alignas(16) float w[kRows][kWeightStride];  // dS
  };
  __shared__ Shared sh;
  shared_starts_undefined(sh);
  read_seed(p);
  const int tx = static_cast<int>(threadIdx.x) % kColThreads;
  const int ty = static_cast<int>(threadIdx.x) / kColThreads;
  const int64_t h = blockIdx.x;
  const int64_t row0 = static_cast<int64_t>(gridDim.y - 1 - blockIdx.y) * kRows;
  const auto k_head = p.k.head(h), v_head = p.v.head(h);
  const auto mask = p.mask.head(h);
  int64_t rows[kMicro];
  const std::uint8_t* mask_rows[kMicro];
  float lse2[kMicro], dot[kMicro];
#pragma unroll
  for (int a = 0; a < kMicro; ++a) {
    rows[a] = row0 + ty + kGroups * a;
    const bool in = rows[a] < p.t;
    mask_rows[a] = in ? mask.row(rows[a]) : nullptr;
    lse2[a] = in ? p.lse[h * p.t + rows[a]] * kLog2e : kNegInf;
    dot[a] = in ? p.rowdot[h * p.t + rows[a]] : 0.0f;
  }
  load_tile<D, kRows, kBackwardThreads>(sh.q, p.q.head(h), row0, p.t, p.width);
  load_tile<D, kRows, kBackwardThreads>(sh.g, p.dout.head(h), row0, p.t, p.width);

  float dq[kMicro][D / 8] = {};
  const int64_t end = key_end(p, row0, kRows);
  for (int64_t key0 = 0; key0 < end; key0 += kTileCols) {
    __syncthreads();
    load_tile<D, kTileCols, kBackwardThreads>(sh.k, k_head, key0, p.s, p.width);
    load_tile<D, kTileCols, kBackwardThreads>(sh.v, v_head, key0, p.s, p.width);
    __syncthreads();
    float x[kMicro][kMicro], dp[kMicro][kMicro];
    dot_tile<D>(x, sh.q, ty, kGroups, sh.k, tx, kColThreads);   // S
    dot_tile<D>(dp, sh.g, ty, kGroups, sh.v, tx, kColThreads);  // dP = dout V^T
#pragma unroll
    for (int a = 0; a < kMicro; ++a)
#pragma unroll
      for (int b = 0; b < kMicro; ++b) {
        const int64_t j = key0 + tx + kColThreads * b;
        const bool in = lse2[a] != kNegInf && attends(p, mask_rows[a], rows[a], j);
        const float prob = in ? exp2f(x[a][b] * p.scale_log2 - lse2[a]) : 0.0f;
        sh.w[ty + kGroups * a][tx + kColThreads * b] =
            in ? prob * (keep_factor(p, h, rows[a], j) * dp[a][b] - dot[a]) : 0.0f;
      }
    __syncthreads();
    weigh_tile<D>(dq, sh.w, ty, kGroups, sh.k, tx);  // dS K
  }
  const auto out = p.dq.head(h);
#pragma unroll
  for (int a = 0; a < kMicro; ++a)
    if (rows[a] < p.t) store_row<D>(out, rows[a], dq[a], p.scale, tx, p.width);
}

// dk and dv of 32 keys of head blockIdx.x, the block walking the query rows 32 at a time:
// S^T = K Q^T, P^T from lse, dv += (P o Z)^T dout, dP^T = V dout^T, dS^T = P^T o (Z o dP^T -
// D), dk += scale dS^T Q.
template <int D>
__global__ void __launch_bounds__(kBackwardThreads) dkdv_kernel(Params p) {
  constexpr int kKeys = rows_of(kBackwardThreads), kGroups = kKeys / kMicro;
  struct Shared {
    alignas(16) float k[kKeys][D + 4];
    alignas(16) float v[kKeys][D + 4];
    alignas(16) float q[kTileCols][D + 4];
    alignas(16) float g[kTileCols][D + 4];       // dout
    alignas(16) float pz[kKeys][kWeightStride];  // (P o Z)^T
    alignas(16) float ds[kKeys][kWeightStride];  // dS^T
    float lse[kTileCols];                        // the query rows' lse (base 2) and D
    float dot[kTileCols];
  };
  __shared__ Shared sh;
  shared_starts_undefined(sh);
  read_seed(p);
  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid % kColThreads, ty = tid / kColThreads;
  const int64_t h = blockIdx.x;
  // (The first key blocks have the most queries under a causal mask: the launch order is right.)
  const int64_t key0 = static_cast<int64_t>(blockIdx.y) * kKeys;
  const auto q_head = p.q.head(h), g_head = p.dout.head(h);
  const auto mask = p.mask.head(h);
  int64_t keys[kMicro];
#pragma unroll
  for (int a = 0; a < kMicro; ++a) keys[a] = key0 + ty + kGroups * a;
  load_tile<D, kKeys, kBackwardThreads>(sh.k, p.k.head(h), key0, p.s, p.width);
  load_tile<D, kKeys, kBackwardThreads>(sh.v, p.v.head(h), key0, p.s, p.width);

  float dk[kMicro][D / 8] = {}, dv[kMicro][D / 8] = {};
  // Causal: the queries before the block's first key attend none of its keys.
  for (int64_t row0 = p.causal ? key0 : 0; row0 < p.t; row0 += kTileCols) {
    __syncthreads();
    load_tile<D, kTileCols, kBackwardThreads>(sh.q, q_head, row0, p.t, p.width);
    load_tile<D, kTileCols, kBackwardThreads>(sh.g, g_head, row0, p.t, p.width);
    for (int r = tid; r < kTileCols; r += kBackwardThreads) {
      const bool in = row0 + r < p.t;
      sh.lse[r] = in ? p.lse[h * p.t + row0 + r] * kLog2e : kNegInf;
      sh.dot[r] = in ? p.rowdot[h * p.t + row0 + r] : 0.0f;
    }
    __syncthreads();
    float x[kMicro][kMicro], dp[kMicro][kMicro];
    dot_tile<D>(x, sh.k, ty, kGroups, sh.q, tx, kColThreads);   // S^T
    dot_tile<D>(dp, sh.v, ty, kGroups, sh.g, tx, kColThreads);  // dP^T = V dout^T
#pragma unroll
    for (int b = 0; b < kMicro; ++b) {
      const int c = tx + kColThreads * b;  // the query row's place in the tile
      const int64_t i = row0 + c;
      const std::uint8_t* mask_row = i < p.t ? mask.row(i) : nullptr;
#pragma unroll
      for (int a = 0; a < kMicro; ++a) {
        const bool in = i < p.t && sh.lse[c] != kNegInf && attends(p, mask_row, i, keys[a]);
        const float prob = in ? exp2f(x[a][b] * p.scale_log2 - sh.lse[c]) : 0.0f;  // P^T
        const float z = in ? keep_factor(p, h, i, keys[a]) : 0.0f;
        sh.ds[ty + kGroups * a][c] = in ? prob * (z * dp[a][b] - sh.dot[c]) : 0.0f;
        sh.pz[ty + kGroups * a][c] = prob * z;
      }
    }
    __syncthreads();
    weigh_tile<D>(dv, sh.pz, ty, kGroups, sh.g, tx);
    weigh_tile<D>(dk, sh.ds, ty, kGroups, sh.q, tx);
  }
  const auto dk_head = p.dk.head(h), dv_head = p.dv.head(h);
#pragma unroll
  for (int a = 0; a < kMicro; ++a)
    if (keys[a] < p.s) {
      store_row<D>(dk_head, keys[a], dk[a], p.scale, tx, p.width);
      store_row<D>(dv_head, keys[a], dv[a], 1.0f, tx, p.width);
    }
}

}  // namespace mixtape::cuda_backend::attention_float32
