// Private to the CUDA backend (and to the test that runs it on the host): the tiled
// tensor-core kernels of the fused attention (kernels.h's AttentionFn and
// AttentionBackwardFn), FlashAttention-2's loops for float16 and bfloat16, both passes for
// head dims 32, 64, 96 and 128.
//
// Forward: a block of 4 warps takes 64 query rows of one head, each warp 16 of them; the block
// walks the keys 64 at a time. The warp's Q rows stay in registers as mma A fragments; each key
// tile of K and V goes to shared memory. The warp computes its 16 x 64 logits with mma.sync
// m16n8k16 (16-bit inputs, float32 sums), masks and scales them, and moves its online softmax
// on: the row maximum (float32, over the 4 lanes that share a row), the rescaling of the
// running sum and of the output accumulators, then P V with the weights as A fragments that
// never leave registers (the accumulator layout of two adjacent 8-column tiles is the A layout
// of one 16-column step). No T x S matrix is made; lse is saved for the backward pass. The B
// fragments come from shared memory by ldmatrix (.trans for V, read down its columns), and the
// tiles arrive by asynchronous copies: the next K tile is queued as soon as the warps are done
// with the current one, while they go on with the softmax and P V, and the next V tile once P V
// is done, so that the loads of one tile overlap the arithmetic of the other.
//
// Backward, in two kernels so that every sum has one owner and a fixed order (no atomics: the
// same bits on every run): dq by query blocks (the forward's loop again: S and P from lse, dP =
// dO V^T, dS = P o (Z o dP - D), dq += dS K), and dk, dv by key blocks, each warp 16 keys whose
// K and V rows stay in registers while the block walks the queries 64 at a time (S^T = K Q^T,
// dv += (P o Z)^T dO, dP^T = V dO^T, dk += dS^T Q). D, the rows' dot products of dout and out,
// comes from attention.cu's row kernel. Heads wider than 64 take dk and dv in two kernels, each
// walking the queries (KeyGrads): the operands and accumulators of both would not fit a
// thread's registers (at width 128 ptxas kept 832 bytes a thread in local memory; dk alone 140,
// 4 since product_across takes its k steps outermost there; dv alone none).
//
// Precision: a float32 value that enters a product as an A operand (the weights, dS) goes in
// as two 16-bit parts, its rounding and the rounding of the rest, in two mma: it keeps about
// 16 bits more than one rounding would (FlashAttention rounds it once, about a unit of the
// 16-bit type in the result), so that every result is the float32 computation rounded once, as
// the CPU backend's. In float16 that holds within its range: below about 2^-3 the rest is a
// subnormal number and below 2^-14 the rounding too, so such a value is off by up to 2^-25
// (FlashAttention's single rounding: the same bound there); a dS of 65520 or more is infinite
// and its gradients non-finite (a loss-scale skip). Loss scaling, which float16 training uses,
// keeps the gradients' dS well inside that range; bfloat16 has float32's range. Dropout uses the
// hash of mixtape/core/dropout_hash.h, the mask the strided bool view of kernels.h.
//
// Why by hand: cuBLASLt has no fused attention, cuDNN's needs the frontend headers (not used
// here), and the softmax must sit between the products.
//
// The loops are written once against an executor `Ctx`: the CUDA kernels (attention.cu) give
// them the hardware (threadIdx, __syncthreads, __shfl_xor_sync, the mma.sync instruction, the
// rounding intrinsics); tests/test_attention_tiles.cpp gives them a thread block emulated on
// the host (a thread per lane, barriers, the mma fragment layout of the PTX manual written
// out), so that the tiling, the fragment bookkeeping, the masks and the softmax are checked by
// the suite on machines without a GPU. Ctx provides:
//   int thread();  std::int64_t head();  std::int64_t block();   (the block's coordinates)
//   void sync();                                  (a barrier of the block)
//   float shfl_xor(float v, int lane_mask);       (the value of lane ^ lane_mask, in the warp)
//   void mma(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]);
//                                                 (d += A B, m16n8k16, the warp together)
//   void ldsm(uint32_t (&r)[4], const uint16_t* row);
//   void ldsm_t(uint32_t (&r)[4], const uint16_t* row);
//                                                 (ldmatrix .x4, and .trans: four 8 x 8 tiles
//                                                 of shared memory, lane l naming row l % 8 of
//                                                 tile l / 8; r[i] the lane's pair of tile i)
//   void copy16(uint16_t* dst, const uint16_t* src);  (16 bytes global -> shared, queued
//                                                 (cp.async); zeros when src is null)
//   void commit();  template <int N> void wait();  (the copies queued since the last commit
//                                                 as a group; wait until at most N groups of
//                                                 this thread are in flight)
//   std::uint32_t bits2(float lo, float hi);      (both rounded to the 16-bit type, as one
//                                                 register: lo in the low half)
//   void unpack(std::uint32_t r, float& lo, float& hi);  (such a register's two values)
//   float exp2(float x);  float log2(float x);
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "mixtape/core/dropout_hash.h"
#include "mixtape/core/head_rows.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

#if defined(__CUDACC__)
#define MIXTAPE_TILE_FN __device__ __forceinline__
// The fragment loops fully unrolled, so that every fragment index is a constant and the
// accumulators stay in registers (a loop left rolled indexes them at run time: local memory).
#define MIXTAPE_UNROLL _Pragma("unroll")
#else
#define MIXTAPE_TILE_FN inline
#define MIXTAPE_UNROLL
#endif

namespace mixtape::attention_tiles {

using std::int64_t;
using std::uint16_t;
using std::uint32_t;

inline constexpr int kWarpLanes = 32;
inline constexpr int kWarps = 4;
inline constexpr int kThreads = kWarps * kWarpLanes;
inline constexpr int kWarpRows = 16;              // rows per warp (mma's m)
inline constexpr int kTile = kWarps * kWarpRows;  // rows per block, and per tile walked
inline constexpr int kPad = 8;  // 16-bit elements after each shared row (fewer bank conflicts)
inline constexpr float kNegInf = -INFINITY;
inline constexpr float kLog2e = 1.4426950408889634f;

// Whether the tiled kernels take heads of these dims (q, k: d; v: dv).
constexpr bool supports(int64_t d, int64_t dv) {
  return d == dv && (d == 32 || d == 64 || d == 96 || d == 128);
}

// Heads as kernels.h gives them (mixtape/core/head_rows.h): the 16-bit operands as the bits of
// their elements, and the mask.
using Rows = HeadRows<const uint16_t>;
using OutRows = HeadRows<uint16_t>;
using MaskRows = HeadRows<const std::uint8_t>;
// One head's rows (HeadRows::head: the kernels find each head's place once, not per row).
using Head = Rows::Head;
using OutHead = OutRows::Head;

// One call's operands: q, dout, out and dq [n, t, d]; k, v, dk and dv [n, s, d]; lse and
// rowdot [n, t] float32 (contiguous). E: how the kernels read the elements (these kernels: the
// 16-bit values' bits; attention_float32.cuh's: float).
template <typename E>
struct ParamsOf {
  HeadRows<const E> q, k, v;
  HeadRows<E> out;
  float* lse = nullptr;
  HeadRows<const E> dout;
  const float* rowdot = nullptr;
  HeadRows<E> dq, dk, dv;
  MaskRows mask;
  bool causal = false;
  float scale = 0;       // the logits' scale
  float scale_log2 = 0;  // the same times log2(e): the softmax runs in base 2
  bool dropout = false;
  std::uint64_t seed = 0;
  const std::int64_t* seed_at = nullptr;  // when set, the seed's place (kernels.h)
  std::uint32_t threshold = 0;
  float inv_keep = 1;
  int64_t n = 0, t = 0, s = 0;
  int width = 0;  // d (the float32 kernels take heads narrower than the width they are made for)
};
using Params = ParamsOf<uint16_t>;

// The host's side: a call's operands and options (the outputs, lse, dout and D set by the
// caller).
template <typename E>
ParamsOf<E> params_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                      bool causal, double scale, const kernels::AttentionDropout& dropout) {
  ParamsOf<E> p;
  p.q = head_rows<const E>(q);
  p.k = head_rows<const E>(k);
  p.v = head_rows<const E>(v);
  p.mask = head_rows<const std::uint8_t>(mask);
  p.causal = causal;
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale * 1.4426950408889634);  // log2(e)
  p.dropout = dropout.rate > 0.0;
  p.seed = dropout.seed;
  if (dropout.seed_at.defined())
    p.seed_at = static_cast<const std::int64_t*>(dropout.seed_at.const_data_ptr());
  p.threshold = dropout_threshold(dropout.rate);
  p.inv_keep = static_cast<float>(1.0 / (1.0 - dropout.rate));
  p.n = head_count(q);
  p.t = q.dim(-2);
  p.s = k.dim(-2);
  p.width = static_cast<int>(q.dim(-1));
  return p;
}

// A block's shared memory: two tiles of KT rows (K and V, KT keys; Q and dout for dk, dv, 64
// queries) and, for dk and dv, the query rows' lse and D.
template <int D, int KT = kTile>
struct Shared {
  // (product_across reads two 16-wide k steps or two 8-wide column tiles, product_down two
  // 8-wide column tiles, at once.)
  static_assert(D % 32 == 0, "head dims of whole pairs of 16-wide steps");
  static_assert(KT % kTile == 0, "tiles of whole blocks of rows");
  alignas(16) uint16_t a[KT][D + kPad];
  alignas(16) uint16_t b[KT][D + kPad];
  float lse[kTile];
  float dot[kTile];
};

// --- Pieces ------------------------------------------------------------------------------

// The larger of a and b, ignoring a NaN on one side (NaN when both are): the running maximum
// starts at -inf and so never becomes NaN; a row of NaN logits gives NaN through its sums.
// fmaxf's rule, one instruction on a GPU (max.f32) where the comparisons took four per logit.
// (Of +0 and -0 it may return either: a maximum of zero gives the same weights, exp2(x - m),
// and the same lse either way.)
MIXTAPE_TILE_FN float nan_max(float a, float b) { return fmaxf(a, b); }

// Whether query row i attends key j (i < t; mask_row: the mask's row i of the head, or null).
template <typename E>
MIXTAPE_TILE_FN bool attends(const ParamsOf<E>& p, const std::uint8_t* mask_row, int64_t i,
                             int64_t j) {
  return j < p.s && (!p.causal || j <= i) && (!mask_row || mask_row[j] != 0);
}

// Dropout's factor Z of weight (h, i, j): 1 / (1 - rate) or 0; 1 without dropout (kDropout:
// p.dropout, known to the forward pass's loop over the weights when it is made, a loop of each
// kind, so that one without dropout has neither a test nor a product per weight; the backward
// passes' loops, with more live values, keep one loop, fewer registers).
template <bool kDropout, typename E>
MIXTAPE_TILE_FN float keep_factor(const ParamsOf<E>& p, int64_t h, int64_t i, int64_t j) {
  if constexpr (kDropout) {
    const auto index = static_cast<std::uint64_t>((h * p.t + i) * p.s + j);
    const std::uint64_t seed = p.seed_at ? static_cast<std::uint64_t>(*p.seed_at) : p.seed;
    return dropout_keeps(seed, index, p.threshold) ? p.inv_keep : 0.0f;
  } else {
    return 1.0f;
  }
}
// The same, p.dropout read where the factor is (the backward pass's loops).
template <typename E>
MIXTAPE_TILE_FN float keep_factor(const ParamsOf<E>& p, int64_t h, int64_t i, int64_t j) {
  return p.dropout ? keep_factor<true>(p, h, i, j) : 1.0f;
}

// A seed in device memory (a captured step's) read once by a kernel's thread, not per weight.
template <typename E>
MIXTAPE_TILE_FN void read_seed(ParamsOf<E>& p) {
  if (p.seed_at) {
    p.seed = static_cast<std::uint64_t>(*p.seed_at);
    p.seed_at = nullptr;
  }
}

// Rows row0 .. row0 + 15 of a head ([rows, D]) as the A fragments of its kSteps 16-column
// steps (rows past the end are 0). Lane (g, c) holds rows g and g + 8 at columns 2c, 2c + 1
// and 2c + 8, 2c + 9 of each step.
template <int D>
MIXTAPE_TILE_FN void load_a(uint32_t (&a)[D / 16][4], const Head& m, int64_t row0, int64_t rows,
                            int g, int c) {
  const uint16_t* lo = row0 + g < rows ? m.row(row0 + g) : nullptr;
  const uint16_t* hi = row0 + g + 8 < rows ? m.row(row0 + g + 8) : nullptr;
  // Columns col, col + 1 of a row as one register, one 4-byte load (col even, the row 16-byte
  // aligned: tile_params; two 2-byte loads each before).
  const auto pair_at = [&](int r, int col) -> uint32_t {
    const uint16_t* row = r == 0 ? lo : hi;
    if (!row) return 0;
#if defined(__CUDACC__)
    return *reinterpret_cast<const uint32_t*>(row + col);
#else
    uint32_t pair;  // (the same 4 bytes as the GPU's load: the host checks their order)
    std::memcpy(&pair, row + col, sizeof pair);
    return pair;
#endif
  };
  MIXTAPE_UNROLL
  for (int kk = 0; kk < D / 16; ++kk) {
    const int col = kk * 16 + 2 * c;
    a[kk][0] = pair_at(0, col);
    a[kk][1] = pair_at(1, col);
    a[kk][2] = pair_at(0, col + 8);
    a[kk][3] = pair_at(1, col + 8);
  }
}

// Queues the copy of rows row0 .. row0 + R - 1 of a head ([rows, D], 16-byte aligned) into a
// shared tile (0 past the end), by the whole block, 16 bytes a thread at a time, and commits
// it as a group: a reader waits for the group (ctx.wait) and then for the block (ctx.sync).
template <int D, int R, class Ctx>
MIXTAPE_TILE_FN void load_tile(Ctx& ctx, uint16_t (&tile)[R][D + kPad], const Head& m, int64_t row0,
                               int64_t rows) {
  constexpr int kChunks = D / 8;  // per row
  for (int e = ctx.thread(); e < R * kChunks; e += kThreads) {
    const int r = e / kChunks, col = (e % kChunks) * 8;
    ctx.copy16(&tile[r][col], row0 + r < rows ? m.row(row0 + r) + col : nullptr);
  }
  ctx.commit();
}

// The A fragments of a 16-wide step made of the float32 accumulators of two adjacent 8-column
// tiles (lo: the first), each value as two 16-bit parts: big (its rounding) and small (the
// rounding of the rest; exact in float32).
template <class Ctx>
MIXTAPE_TILE_FN void split_a(Ctx& ctx, const float (&lo)[4], const float (&hi)[4],
                             uint32_t (&big)[4], uint32_t (&small)[4]) {
  MIXTAPE_UNROLL
  for (int r = 0; r < 4; ++r) {
    const float* w = (r < 2 ? lo : hi) + 2 * (r % 2);
    big[r] = ctx.bits2(w[0], w[1]);
    float b0, b1;
    ctx.unpack(big[r], b0, b1);
    small[r] = ctx.bits2(w[0] - b0, w[1] - b1);
  }
}

// acc[j] += A B over an R-wide k (R / 16 steps) for the D / 8 output tiles: A the float32
// accumulators a[R / 8][4] (split as above), B[k][n] = tile[k][n]. The B fragments of two output
// tiles by one ldmatrix .trans: the 8 x 8 tiles (rows k0, columns 8j), (k0 + 8, 8j), (k0,
// 8j + 8), (k0 + 8, 8j + 8) give B's registers 0 and 1 for column tiles j and j + 1.
template <int D, int R, class Ctx>
MIXTAPE_TILE_FN void product_down(Ctx& ctx, float (&acc)[D / 8][4], const float (&a)[R / 8][4],
                                  const uint16_t (&tile)[R][D + kPad], int g, int c) {
  const int lane = 4 * g + c, m = lane / 8;  // the 8 x 8 tile whose row lane % 8 it names
  MIXTAPE_UNROLL
  for (int kk = 0; kk < R / 16; ++kk) {
    uint32_t big[4], small[4];
    split_a(ctx, a[2 * kk], a[2 * kk + 1], big, small);
    MIXTAPE_UNROLL
    for (int j = 0; j < D / 8; j += 2) {
      uint32_t r[4];
      ctx.ldsm_t(r, &tile[kk * 16 + (m % 2) * 8 + lane % 8][(j + m / 2) * 8]);
      const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
      ctx.mma(acc[j], big, b0);
      ctx.mma(acc[j], small, b0);
      ctx.mma(acc[j + 1], big, b1);
      ctx.mma(acc[j + 1], small, b1);
    }
  }
}

// x[nt] = A B^T for the R / 8 column tiles of an R-row shared tile: A the registers a (16 rows x
// D), B[k][n] = tile[n][k]; each x[nt] sums its k steps in order, either way:
//  - kStepsOuter false: tile by tile, the B fragments of two k steps by one ldmatrix (the 8 x 8
//    tiles (rows 8 nt, columns 16 kk), (8 nt, 16 kk + 8), (8 nt, 16 kk + 16), (8 nt, 16 kk + 24));
//  - kStepsOuter true: step by step, the B fragments of two column tiles by one ldmatrix ((8 nt,
//    16 kk), (8 nt, 16 kk + 8), (8 nt + 8, 16 kk), (8 nt + 8, 16 kk + 8)).
// The same products in the same order for each tile, so the same bits; what differs is ptxas's
// register allocation (sm_90): the backward kernels take the second (width 128: dk's local
// memory 140 -> 4 bytes a thread, dq's 28 -> 0), the forward kernel the first (at width 64 the
// second raised its local memory from 20 to 32 bytes at its 168 registers).
template <int D, bool kStepsOuter, int R, class Ctx>
MIXTAPE_TILE_FN void product_across(Ctx& ctx, float (&x)[R / 8][4], const uint32_t (&a)[D / 16][4],
                                    const uint16_t (&tile)[R][D + kPad], int g, int c) {
  const int lane = 4 * g + c, m = lane / 8;
  if constexpr (kStepsOuter) {
    MIXTAPE_UNROLL
    for (int nt = 0; nt < R / 8; ++nt) MIXTAPE_UNROLL
    for (int e = 0; e < 4; ++e) x[nt][e] = 0.0f;
    MIXTAPE_UNROLL
    for (int kk = 0; kk < D / 16; ++kk) {
      MIXTAPE_UNROLL
      for (int nt = 0; nt < R / 8; nt += 2) {
        uint32_t r[4];
        ctx.ldsm(r, &tile[(nt + m / 2) * 8 + lane % 8][kk * 16 + (m % 2) * 8]);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        ctx.mma(x[nt], a[kk], b0);
        ctx.mma(x[nt + 1], a[kk], b1);
      }
    }
  } else {
    static_assert(D % 32 == 0, "pairs of 16-wide k steps");
    MIXTAPE_UNROLL
    for (int nt = 0; nt < R / 8; ++nt) {
      MIXTAPE_UNROLL
      for (int e = 0; e < 4; ++e) x[nt][e] = 0.0f;
      MIXTAPE_UNROLL
      for (int kk = 0; kk < D / 16; kk += 2) {
        uint32_t r[4];
        ctx.ldsm(r, &tile[nt * 8 + lane % 8][(kk + m / 2) * 16 + (m % 2) * 8]);
        const uint32_t b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        ctx.mma(x[nt], a[kk], b0);
        ctx.mma(x[nt], a[kk + 1], b1);
      }
    }
  }
}

// Stores 16 accumulated rows (row0 + g, row0 + g + 8) of a head times `factor`, rounded,
// where < rows (each lane's two neighbouring elements as one 4-byte store).
template <int D, class Ctx>
MIXTAPE_TILE_FN void store_rows(Ctx& ctx, const OutHead& m, const float (&acc)[D / 8][4],
                                float factor, int64_t row0, int64_t rows, int g, int c) {
  MIXTAPE_UNROLL
  for (int r = 0; r < 2; ++r) {
    const int64_t i = row0 + g + 8 * r;
    if (i >= rows) continue;
    uint16_t* row = m.row(i);
    MIXTAPE_UNROLL
    for (int j = 0; j < D / 8; ++j) {
      const uint32_t pair = ctx.bits2(acc[j][2 * r] * factor, acc[j][2 * r + 1] * factor);
      uint16_t* at = row + j * 8 + 2 * c;  // 4-byte aligned: an even column of an aligned row
#if defined(__CUDACC__)
      *reinterpret_cast<uint32_t*>(at) = pair;  // (a memcpy here nvcc makes four byte stores)
#else
      std::memcpy(at, &pair, sizeof pair);
#endif
    }
  }
}

// The position of accumulator element e of column tile nt: row offset (0 or 8) and column.
MIXTAPE_TILE_FN int elem_row(int g, int e) { return g + 8 * (e / 2); }
MIXTAPE_TILE_FN int elem_col(int nt, int c, int e) { return nt * 8 + 2 * c + e % 2; }

// Whether the 16 query rows from row0 attend every key of the `keys` from key0 (no mask, every
// key there, none after a causal row): their logits need no mask test.
MIXTAPE_TILE_FN bool whole_tile(const Params& p, int64_t row0, int64_t key0, int keys = kTile) {
  return p.mask.base == nullptr && key0 + keys <= p.s && (!p.causal || key0 + keys - 1 <= row0);
}

// The end of the keys a block of query rows row0 .. row0 + 63 attends.
MIXTAPE_TILE_FN int64_t key_end(const Params& p, int64_t row0) {
  if (!p.causal) return p.s;
  const int64_t last = (row0 + kTile < p.t ? row0 + kTile : p.t) - 1;
  return last + 1 < p.s ? last + 1 : p.s;
}

// --- Forward ---------------------------------------------------------------------------

// out and lse of the query rows of block (head(), block()) (kernels.h's AttentionFn), walking
// the keys KT at a time (64, or 128: twice the products between two barriers and twice the
// independent logit tiles a warp has in flight, for twice the logits' registers). kDropout:
// p.dropout, known when the kernel is made (the loop over the weights of the other kind is not
// in it: with both, ptxas for sm_90 kept 20 bytes a thread in local memory at width 64, 76 at
// 128 keys; without dropout's, none at any width; with dropout's alone, 40 and 112).
template <int D, int KT = kTile, bool kDropout = false, class Ctx>
MIXTAPE_TILE_FN void forward(Ctx& ctx, Shared<D, KT>& sh, const Params& p) {
  constexpr int kCols = KT / 8;  // 8-key column tiles of the logits
  const int tid = ctx.thread(), warp = tid / kWarpLanes, lane = tid % kWarpLanes;
  const int g = lane / 4, c = lane % 4;  // the fragment's row group and column pair
  const int64_t h = ctx.head(), row0 = ctx.block() * kTile, warp_row0 = row0 + warp * kWarpRows;
  const Head k_head = p.k.head(h), v_head = p.v.head(h);
  const int64_t rows[2] = {warp_row0 + g, warp_row0 + g + 8};
  const MaskRows::Head mask = p.mask.head(h);
  const std::uint8_t* mask_rows[2] = {rows[0] < p.t ? mask.row(rows[0]) : nullptr,
                                      rows[1] < p.t ? mask.row(rows[1]) : nullptr};
  uint32_t qa[D / 16][4];
  load_a<D>(qa, p.q.head(h), warp_row0, p.t, g, c);

  float o[D / 8][4] = {};
  float m[2] = {kNegInf, kNegInf};  // running maxima (base-2 logits), per row
  float l[2] = {0.0f, 0.0f};        // this lane's part of the running sums
  const int64_t end = key_end(p, row0);
  // The copies in flight at the top of each turn: K's tile, then V's (load_tile's groups).
  load_tile<D>(ctx, sh.a, k_head, 0, p.s);
  load_tile<D>(ctx, sh.b, v_head, 0, p.s);
  for (int64_t key0 = 0; key0 < end; key0 += KT) {
    const bool more = key0 + KT < end;
    ctx.template wait<1>();  // K's tile is here (V's may not be)
    ctx.sync();

    // The logits of the warp's 16 rows and the tile's 64 keys, scaled (base 2), -inf where the
    // row does not attend the key.
    float x[kCols][4];
    product_across<D, false>(ctx, x, qa, sh.a, g, c);
    ctx.template wait<0>();  // V's tile is here
    ctx.sync();              // and every warp is done with K's: the next one may come
    if (more)
      load_tile<D>(ctx, sh.a, k_head, key0 + KT, p.s);
    else
      ctx.commit();  // an empty group, so that the waits count as in every turn
    float tile_max[2] = {kNegInf, kNegInf};
    // (A tile the warp's rows attend whole skips the mask tests: a loop of its own, for
    // fewer registers.)
    const auto mask_scale = [&](auto whole) {
      MIXTAPE_UNROLL
      for (int nt = 0; nt < kCols; ++nt) MIXTAPE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        bool in = true;
        if constexpr (!decltype(whole)::value)
          in = attends(p, mask_rows[r], rows[r], key0 + elem_col(nt, c, e));
        x[nt][e] = in ? x[nt][e] * p.scale_log2 : kNegInf;
        tile_max[r] = nan_max(tile_max[r], x[nt][e]);
      }
    };
    if (whole_tile(p, warp_row0, key0, KT))
      mask_scale(std::true_type{});
    else
      mask_scale(std::false_type{});
    float alpha[2];
    MIXTAPE_UNROLL
    for (int r = 0; r < 2; ++r) {
      tile_max[r] = nan_max(tile_max[r], ctx.shfl_xor(tile_max[r], 1));
      tile_max[r] = nan_max(tile_max[r], ctx.shfl_xor(tile_max[r], 2));
      const float m_new = nan_max(m[r], tile_max[r]);
      // Nothing attended yet: the row's sums and outputs are still 0, nothing to rescale.
      alpha[r] = m_new == kNegInf ? 1.0f : ctx.exp2(m[r] - m_new);
      m[r] = m_new;
      l[r] *= alpha[r];
    }
    MIXTAPE_UNROLL
    for (int j = 0; j < D / 8; ++j) MIXTAPE_UNROLL
    for (int e = 0; e < 4; ++e) o[j][e] *= alpha[e / 2];
    // The weights (undropped into l), then o += (P o Z) V.
    const auto weigh = [&](auto dropout) {
      MIXTAPE_UNROLL
      for (int nt = 0; nt < kCols; ++nt) MIXTAPE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const float w = m[r] == kNegInf ? 0.0f : ctx.exp2(x[nt][e] - m[r]);
        l[r] += w;
        x[nt][e] =
            w * keep_factor<decltype(dropout)::value>(p, h, rows[r], key0 + elem_col(nt, c, e));
      }
    };
    weigh(std::bool_constant<kDropout>{});
    product_down<D>(ctx, o, x, sh.b, g, c);
    ctx.sync();  // every warp is done with V's tile
    if (more)
      load_tile<D>(ctx, sh.b, v_head, key0 + KT, p.s);
    else
      ctx.commit();
  }
  ctx.template wait<0>();  // (nothing is in flight at the end: the last groups are empty)

  // The sums over the row's 4 lanes; out = o / l, lse = (m + log2 l) ln 2 (0 and -inf for a
  // row that attends nothing).
  float inv[2];
  MIXTAPE_UNROLL
  for (int r = 0; r < 2; ++r) {
    l[r] += ctx.shfl_xor(l[r], 1);
    l[r] += ctx.shfl_xor(l[r], 2);
    inv[r] = l[r] == 0.0f ? 0.0f : 1.0f / l[r];
    if (c == 0 && rows[r] < p.t)
      p.lse[h * p.t + rows[r]] = l[r] == 0.0f ? kNegInf : (m[r] + ctx.log2(l[r])) / kLog2e;
  }
  MIXTAPE_UNROLL
  for (int j = 0; j < D / 8; ++j) MIXTAPE_UNROLL
  for (int e = 0; e < 4; ++e) o[j][e] *= inv[e / 2];
  store_rows<D>(ctx, p.out.head(h), o, 1.0f, warp_row0, p.t, g, c);
}

// --- Backward ----------------------------------------------------------------------------

// dq of the query rows of block (head(), block()): the forward's walk over the keys, with P
// from lse: dq = scale sum over the keys of dS K, dS = P o (Z o (dout V^T) - D).
template <int D, class Ctx>
MIXTAPE_TILE_FN void backward_dq(Ctx& ctx, Shared<D>& sh, const Params& p) {
  constexpr int kCols = kTile / 8;
  const int tid = ctx.thread(), warp = tid / kWarpLanes, lane = tid % kWarpLanes;
  const int g = lane / 4, c = lane % 4;
  const int64_t h = ctx.head(), row0 = ctx.block() * kTile, warp_row0 = row0 + warp * kWarpRows;
  const Head k_head = p.k.head(h), v_head = p.v.head(h);
  const int64_t rows[2] = {warp_row0 + g, warp_row0 + g + 8};
  const MaskRows::Head mask = p.mask.head(h);
  const std::uint8_t* mask_rows[2] = {nullptr, nullptr};
  float lse2[2] = {kNegInf, kNegInf}, dot[2] = {0.0f, 0.0f};
  MIXTAPE_UNROLL
  for (int r = 0; r < 2; ++r)
    if (rows[r] < p.t) {
      mask_rows[r] = mask.row(rows[r]);
      lse2[r] = p.lse[h * p.t + rows[r]] * kLog2e;
      dot[r] = p.rowdot[h * p.t + rows[r]];
    }
  uint32_t qa[D / 16][4], ga[D / 16][4];
  load_a<D>(qa, p.q.head(h), warp_row0, p.t, g, c);
  load_a<D>(ga, p.dout.head(h), warp_row0, p.t, g, c);

  float dq[D / 8][4] = {};
  const int64_t end = key_end(p, row0);
  // The copies in flight at the top of each turn: V's tile, then K's.
  load_tile<D>(ctx, sh.b, v_head, 0, p.s);
  load_tile<D>(ctx, sh.a, k_head, 0, p.s);
  for (int64_t key0 = 0; key0 < end; key0 += kTile) {
    const bool more = key0 + kTile < end;
    ctx.template wait<1>();  // V's tile is here
    ctx.sync();
    float x[kCols][4], dp[kCols][4];
    product_across<D, true>(ctx, dp, ga, sh.b, g, c);  // dP = dout V^T
    ctx.template wait<0>();                            // K's tile is here
    ctx.sync();                                        // and every warp is done with V's
    if (more)
      load_tile<D>(ctx, sh.b, v_head, key0 + kTile, p.s);
    else
      ctx.commit();  // an empty group, so that the waits count as in every turn
    product_across<D, true>(ctx, x, qa, sh.a, g, c);  // S
    // dS; a tile the warp's rows attend whole skips the mask tests (lse2: -inf past t).
    const auto grads = [&](auto whole) {
      MIXTAPE_UNROLL
      for (int nt = 0; nt < kCols; ++nt) MIXTAPE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const int64_t j = key0 + elem_col(nt, c, e);
        bool in = lse2[r] != kNegInf;
        if constexpr (!decltype(whole)::value) in = in && attends(p, mask_rows[r], rows[r], j);
        const float prob = in ? ctx.exp2(x[nt][e] * p.scale_log2 - lse2[r]) : 0.0f;
        x[nt][e] = in ? prob * (keep_factor(p, h, rows[r], j) * dp[nt][e] - dot[r]) : 0.0f;
      }
    };
    if (whole_tile(p, warp_row0, key0))
      grads(std::true_type{});
    else
      grads(std::false_type{});
    product_down<D>(ctx, dq, x, sh.a, g, c);  // dS K
    ctx.sync();                               // every warp is done with K's tile
    if (more)
      load_tile<D>(ctx, sh.a, k_head, key0 + kTile, p.s);
    else
      ctx.commit();
  }
  ctx.template wait<0>();  // (nothing is in flight at the end: the last groups are empty)
  store_rows<D>(ctx, p.dq.head(h), dq, p.scale, warp_row0, p.t, g, c);
}

// Which key gradients a backward_dkdv kernel computes: both (heads up to 64 wide), or one of
// them (wider heads: the operands and accumulators of both overflow a thread's registers, so
// two kernels walk the queries, each recomputing S^T and P^T).
enum class KeyGrads { both, dk, dv };

// dk and dv of the keys of block (head(), block()): each warp's 16 keys stay in registers
// while the block walks the query rows 64 at a time: S^T = K Q^T, P^T from lse, dv += (P o
// Z)^T dout, dP^T = V dout^T, dS^T = P^T o (Z o dP^T - D), dk += scale dS^T Q (G: both, or
// dk alone, or dv alone).
template <int D, KeyGrads G = KeyGrads::both, class Ctx>
MIXTAPE_TILE_FN void backward_dkdv(Ctx& ctx, Shared<D>& sh, const Params& p) {
  constexpr bool kDk = G != KeyGrads::dv, kDv = G != KeyGrads::dk;
  constexpr int kCols = kTile / 8;  // 8-query column tiles
  const int tid = ctx.thread(), warp = tid / kWarpLanes, lane = tid % kWarpLanes;
  const int g = lane / 4, c = lane % 4;
  const int64_t h = ctx.head(), key0 = ctx.block() * kTile, warp_key0 = key0 + warp * kWarpRows;
  const Head q_head = p.q.head(h), dout_head = p.dout.head(h);
  uint32_t ka[D / 16][4], va[D / 16][4];
  load_a<D>(ka, p.k.head(h), warp_key0, p.s, g, c);
  if constexpr (kDk) load_a<D>(va, p.v.head(h), warp_key0, p.s, g, c);

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  const std::uint8_t* mask_head = p.mask.head(h).row(0);  // the head's mask rows, or null
  // The query rows' lse (base 2) and D from row0 into shared memory (plain stores: a barrier
  // shows them to the block).
  const auto load_rows = [&](int64_t row0) {
    for (int r = tid; r < kTile; r += kThreads) {
      const bool in = row0 + r < p.t;
      sh.lse[r] = in ? p.lse[h * p.t + row0 + r] * kLog2e : kNegInf;
      sh.dot[r] = in ? p.rowdot[h * p.t + row0 + r] : 0.0f;
    }
  };
  // Causal: the queries before the block's first key attend none of its keys.
  const int64_t first = p.causal ? key0 : 0;
  // The copies in flight at the top of each turn: dout's tile, then Q's (with the rows' lse
  // and D, stored plainly).
  load_tile<D>(ctx, sh.b, dout_head, first, p.t);
  load_tile<D>(ctx, sh.a, q_head, first, p.t);
  load_rows(first);
  for (int64_t row0 = first; row0 < p.t; row0 += kTile) {
    const bool more = row0 + kTile < p.t;
    ctx.template wait<1>();  // dout's tile is here
    ctx.sync();
    float x[kCols][4], dp[kCols][4];
    if constexpr (kDk) product_across<D, true>(ctx, dp, va, sh.b, g, c);  // dP^T = V dout^T
    ctx.template wait<0>();                                               // Q's tile is here
    ctx.sync();
    product_across<D, true>(ctx, x, ka, sh.a, g, c);  // S^T
    // P^T, dS^T and (P o Z)^T; a tile whose query rows all attend every key of the warp
    // (sh.lse: -inf past t) skips the mask tests (a loop of its own: fewer registers).
    const auto weights = [&](auto whole) {
      MIXTAPE_UNROLL
      for (int nt = 0; nt < kCols; ++nt) MIXTAPE_UNROLL
      for (int e = 0; e < 4; ++e) {
        const int64_t j = warp_key0 + elem_row(g, e), q = elem_col(nt, c, e), i = row0 + q;
        bool in = sh.lse[q] != kNegInf;
        if constexpr (!decltype(whole)::value)
          in = in && i < p.t &&
               attends(p, mask_head ? mask_head + i * p.mask.stride : nullptr, i, j);
        const float prob = in ? ctx.exp2(x[nt][e] * p.scale_log2 - sh.lse[q]) : 0.0f;  // P^T
        const float z = in ? keep_factor(p, h, i, j) : 0.0f;
        if constexpr (kDk) dp[nt][e] = in ? prob * (z * dp[nt][e] - sh.dot[q]) : 0.0f;  // dS^T
        x[nt][e] = prob * z;                                                            // (P o Z)^T
      }
    };
    if (p.mask.base == nullptr && warp_key0 + kWarpRows <= p.s &&
        (!p.causal || warp_key0 + kWarpRows - 1 <= row0))
      weights(std::true_type{});
    else
      weights(std::false_type{});
    if constexpr (kDv) product_down<D>(ctx, dv, x, sh.b, g, c);
    ctx.sync();  // every warp is done with dout's tile (and the rows' lse and D)
    if (more)
      load_tile<D>(ctx, sh.b, dout_head, row0 + kTile, p.t);
    else
      ctx.commit();  // an empty group, so that the waits count as in every turn
    if constexpr (kDk) product_down<D>(ctx, dk, dp, sh.a, g, c);
    ctx.sync();  // every warp is done with Q's tile
    if (more) {
      load_tile<D>(ctx, sh.a, q_head, row0 + kTile, p.t);
      load_rows(row0 + kTile);
    } else {
      ctx.commit();
    }
  }
  ctx.template wait<0>();  // (nothing is in flight at the end: the last groups are empty)
  if constexpr (kDk) store_rows<D>(ctx, p.dk.head(h), dk, p.scale, warp_key0, p.s, g, c);
  if constexpr (kDv) store_rows<D>(ctx, p.dv.head(h), dv, 1.0f, warp_key0, p.s, g, c);
}

}  // namespace mixtape::attention_tiles
