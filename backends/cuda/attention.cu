// Fused attention on CUDA (ops attention and attention_backward).
//
// float16 and bfloat16 heads whose q, k and v share a width run the tiled tensor-core kernels of
// backends/cuda/attention_tiles.h (FlashAttention-2's loops on mma.sync), both passes, for widths
// 32, 64, 96 and 128. MIXTAPE_CUDA_MMA_ATTENTION=0 turns them off.
//
// float32 heads of widths up to 64, multiples of 4, run the tiled kernels of
// backends/cuda/attention_float32.cuh (the same loops on the float32 units).
//
// Everything else (float64, other widths) runs the plain form: one warp per row, a
// query row for the forward pass and for dq, a key row for dk and dv. The warp walks the keys
// (queries) the row attends one at a time, each dot product split over the lanes and summed
// with shuffles, so no [t, s] matrix is made and every row's softmax is exact (float32 for the
// 16-bit dtypes, float64 for float64) with no tile bookkeeping. Each lane keeps its columns of
// the row's output in registers (kCols of them; wider rows take several passes). It does not
// use tensor cores (docs/cuda.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <type_traits>

#include "backends/cuda/attention_float32.cuh"
#include "backends/cuda/attention_tiles.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/warp.cuh"
#include "core/env.h"
#include "mixtape/core/dropout_hash.h"
#include "mixtape/core/head_rows.h"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

constexpr int kCols = 8;  // output columns per lane in one pass: rows up to 256 wide
constexpr int64_t kPass = int64_t{kWarp} * kCols;

// The dot product of a and b (n elements), summed over the warp: every lane gets it.
template <typename T, typename U>
__device__ __forceinline__ compute_of<T> warp_dot(const T* a, const U* b, int64_t n, int lane) {
  using C = compute_of<T>;
  C part = C(0);
  for (int64_t c = lane; c < n; c += kWarp) part += load(a[c]) * static_cast<C>(load(b[c]));
  return warp_sum(part);
}

// The heads and the mask as kernels.h gives them (mixtape/core/head_rows.h): views [n1, n2,
// rows, width] with stride 1 along width, head h being [h / n2, h % n2].
template <typename T>
using In = HeadRows<const T>;
template <typename T>
using Out = HeadRows<T>;
using MaskRows = HeadRows<const std::uint8_t>;

// Dropout on the weights (kernels.h): Z of element (h, i, j), 1 / (1 - rate) or 0.
struct Dropout {
  bool on = false;
  std::uint64_t seed = 0;
  const std::int64_t* seed_at = nullptr;  // when set, the seed's place on the device
  std::uint32_t threshold = 0;
  double inv_keep = 1.0;
  template <typename C>
  __device__ __forceinline__ C factor(int64_t h, int64_t i, int64_t j, int64_t t, int64_t s) const {
    if (!on) return C(1);
    const auto index = static_cast<std::uint64_t>((h * t + i) * s + j);
    const std::uint64_t key = seed_at ? static_cast<std::uint64_t>(*seed_at) : seed;
    return dropout_keeps(key, index, threshold) ? static_cast<C>(inv_keep) : C(0);
  }
};
Dropout dropout_of(const kernels::AttentionDropout& d) {
  Dropout r;
  r.on = d.rate > 0.0;
  r.seed = d.seed;
  if (d.seed_at.defined()) r.seed_at = static_cast<const std::int64_t*>(d.seed_at.const_data_ptr());
  r.threshold = dropout_threshold(d.rate);
  r.inv_keep = 1.0 / (1.0 - d.rate);
  return r;
}

__device__ __forceinline__ bool keeps(const std::uint8_t* mask_row, bool causal, int64_t i,
                                      int64_t j) {
  return (!mask_row || mask_row[j] != 0) && (!causal || j <= i);
}

// out[c] = sum over the j < jend that keeps() keeps of weight(j) * rows.row(j)[c], for c
// in [0, width), the lanes of a warp taking the columns c0 + lane + u kWarp, kPass columns a
// pass (weight may hold warp_dots: every lane calls it, again each pass). With `any` false
// nothing is added: out is 0.
template <typename T, typename Weight>
__device__ __forceinline__ void warp_weighted_sum(bool any, const std::uint8_t* mask_row,
                                                  bool causal, int64_t i, int64_t jend,
                                                  Weight weight, const typename In<T>::Head& rows,
                                                  int64_t width, T* out, int lane) {
  using C = compute_of<T>;
  for (int64_t c0 = 0; c0 < width; c0 += kPass) {
    C acc[kCols];
    for (int u = 0; u < kCols; ++u) acc[u] = C(0);
    if (any)
      for (int64_t j = 0; j < jend; ++j) {
        if (!keeps(mask_row, causal, i, j)) continue;
        const C w = weight(j);
        const T* row = rows.row(j);
        for (int u = 0; u < kCols; ++u) {
          const int64_t c = c0 + lane + int64_t{u} * kWarp;
          if (c < width) acc[u] += w * load(row[c]);
        }
      }
    for (int u = 0; u < kCols; ++u) {
      const int64_t c = c0 + lane + int64_t{u} * kWarp;
      if (c < width) out[c] = store<T>(acc[u]);
    }
  }
}

template <typename T>
__global__ void attention_forward_kernel(In<T> q, In<T> k, In<T> v, MaskRows mask, bool causal,
                                         compute_of<T> scale, Dropout dropout, Out<T> out,
                                         compute_of<T>* __restrict__ lse, int64_t n, int64_t t,
                                         int64_t s, int64_t d, int64_t dv) {
  using C = compute_of<T>;
  const C neg_inf = -static_cast<C>(INFINITY);
  for_each_warp_item(n * t, [&](int64_t row, int lane) {
    const int64_t h = row / t, i = row % t;
    const auto kh = k.head(h);
    const T* qr = q.row(h, i);
    const std::uint8_t* mr = mask.row(h, i);
    const int64_t kend = causal ? (i + 1 < s ? i + 1 : s) : s;
    // The row's maximum and sum, online.
    C m = neg_inf, l = C(0);
    for (int64_t j = 0; j < kend; ++j) {
      if (!keeps(mr, causal, i, j)) continue;
      const C x = warp_dot(qr, kh.row(j), d, lane) * scale;
      if (x > m) {
        l = (m == neg_inf ? C(0) : l * d_exp(m - x)) + C(1);
        m = x;
      } else if (m != neg_inf) {
        l += d_exp(x - m);  // NaN stays NaN
      }  // (else x is -inf or NaN before any attended number: no weight, as the CPU's block max)
    }
    if (lane == 0) lse[row] = l == C(0) ? neg_inf : m + d_log(l);
    const C inv = l == C(0) ? C(0) : C(1) / l;
    const auto p = [&](int64_t j) {
      return d_exp(warp_dot(qr, kh.row(j), d, lane) * scale - m) * inv *
             dropout.factor<C>(h, i, j, t, s);
    };
    warp_weighted_sum(l != C(0), mr, causal, i, kend, p, v.head(h), dv, out.row(h, i), lane);
  });
}

// D_i = sum_c dout[i, c] out[i, c], per query row.
template <typename T>
__global__ void attention_rowdot_kernel(In<T> dout, In<T> out, compute_of<T>* __restrict__ rowdot,
                                        int64_t rows, int64_t t, int64_t dv) {
  for_each_warp_item(rows, [&](int64_t row, int lane) {
    const int64_t h = row / t, i = row % t;
    const auto x = warp_dot(dout.row(h, i), out.row(h, i), dv, lane);
    if (lane == 0) rowdot[row] = x;
  });
}

// dq_i = scale sum_j P_ij (dP_ij - D_i) k_j, a warp per query row.
template <typename T>
__global__ void attention_dq_kernel(In<T> q, In<T> k, In<T> v, MaskRows mask, bool causal,
                                    compute_of<T> scale, Dropout dropout,
                                    const compute_of<T>* __restrict__ lse,
                                    const compute_of<T>* __restrict__ rowdot, In<T> dout, Out<T> dq,
                                    int64_t n, int64_t t, int64_t s, int64_t d, int64_t dv) {
  using C = compute_of<T>;
  const C neg_inf = -static_cast<C>(INFINITY);
  for_each_warp_item(n * t, [&](int64_t row, int lane) {
    const int64_t h = row / t, i = row % t;
    const auto kh = k.head(h), vh = v.head(h);
    const T* qr = q.row(h, i);
    const T* gr = dout.row(h, i);
    const std::uint8_t* mr = mask.row(h, i);
    const int64_t kend = causal ? (i + 1 < s ? i + 1 : s) : s;
    const C li = lse[row], di = rowdot[row];
    const auto ds = [&](int64_t j) {
      const C p = d_exp(warp_dot(qr, kh.row(j), d, lane) * scale - li);
      return p * (warp_dot(gr, vh.row(j), dv, lane) * dropout.factor<C>(h, i, j, t, s) - di) *
             scale;
    };
    warp_weighted_sum(li != neg_inf, mr, causal, i, kend, ds, kh, d, dq.row(h, i), lane);
  });
}

// dk_j = scale sum_i P_ij (dP_ij - D_i) q_i and dv_j = sum_i P_ij dout_i, a warp per key row.
template <typename T>
__global__ void attention_dkdv_kernel(In<T> q, In<T> k, In<T> v, MaskRows mask, bool causal,
                                      compute_of<T> scale, Dropout dropout,
                                      const compute_of<T>* __restrict__ lse,
                                      const compute_of<T>* __restrict__ rowdot, In<T> dout,
                                      Out<T> dk, Out<T> dvo, int64_t n, int64_t t, int64_t s,
                                      int64_t d, int64_t dv) {
  using C = compute_of<T>;
  const C neg_inf = -static_cast<C>(INFINITY);
  for_each_warp_item(n * s, [&](int64_t key, int lane) {
    const int64_t h = key / s, j = key % s;
    const auto qh = q.head(h), gh = dout.head(h);
    const auto mh = mask.head(h);
    const T* kr = k.row(h, j);
    const T* vr = v.row(h, j);
    T* dkr = dk.row(h, j);
    T* dvr = dvo.row(h, j);
    const int64_t wide = d > dv ? d : dv;
    for (int64_t c0 = 0; c0 < wide; c0 += kPass) {
      C dk_acc[kCols], dv_acc[kCols];
      for (int u = 0; u < kCols; ++u) dk_acc[u] = dv_acc[u] = C(0);
      for (int64_t i = causal ? j : 0; i < t; ++i) {
        const int64_t row = h * t + i;
        const std::uint8_t* mr = mh.row(i);
        const C li = lse[row];
        if (li == neg_inf || !keeps(mr, causal, i, j)) continue;
        const T* qr = qh.row(i);
        const T* gr = gh.row(i);
        const C p = d_exp(warp_dot(qr, kr, d, lane) * scale - li);
        const C z = dropout.factor<C>(h, i, j, t, s);
        const C ds = p * (warp_dot(gr, vr, dv, lane) * z - rowdot[row]) * scale;
        for (int u = 0; u < kCols; ++u) {
          const int64_t c = c0 + lane + int64_t{u} * kWarp;
          if (c < d) dk_acc[u] += ds * load(qr[c]);
          if (c < dv) dv_acc[u] += p * z * load(gr[c]);
        }
      }
      for (int u = 0; u < kCols; ++u) {
        const int64_t c = c0 + lane + int64_t{u} * kWarp;
        if (c < d) dkr[c] = store<T>(dk_acc[u]);
        if (c < dv) dvr[c] = store<T>(dv_acc[u]);
      }
    }
  });
}

// --- The tiled tensor-core kernels (attention_tiles.h) on the hardware -------------------

// The executor of attention_tiles' loops: this thread's block coordinates, the block's
// barrier, the warp's shuffles, mma.sync m16n8k16 with float32 sums, and the 16-bit roundings
// (bfloat16 when BF16, float16 otherwise).
template <bool BF16>
struct MmaCtx {
  // Row blocks in reverse launch order: under a causal mask the later query blocks have the
  // most keys to walk, and are started first (FlashAttention's order) so that the grid does
  // not end on them.
  bool reversed = false;
  __device__ int thread() const { return static_cast<int>(threadIdx.x); }
  __device__ int64_t head() const { return blockIdx.x; }
  __device__ int64_t block() const { return reversed ? gridDim.y - 1 - blockIdx.y : blockIdx.y; }
  __device__ void sync() const { __syncthreads(); }
  __device__ float shfl_xor(float v, int lane_mask) const {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
  }
  __device__ void mma(float (&d)[4], const std::uint32_t (&a)[4],
                      const std::uint32_t (&b)[2]) const {
#if defined(MIXTAPE_CUDA_EMULATION)  // tests/cudaemu: the instruction written out on the host
    ::mixtape::cuda_emu::mma_m16n8k16(d, a, b, BF16);
#else
    if constexpr (BF16)
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
          "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
      asm volatile(
          "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
          "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
          : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
          : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
  }
  // ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16 (attention_tiles.h's Ctx).
  __device__ void ldsm(std::uint32_t (&r)[4], const std::uint16_t* row) const {
#if defined(MIXTAPE_CUDA_EMULATION)
    ::mixtape::cuda_emu::ldmatrix_x4(r, row, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#endif
  }
  __device__ void ldsm_t(std::uint32_t (&r)[4], const std::uint16_t* row) const {
#if defined(MIXTAPE_CUDA_EMULATION)
    ::mixtape::cuda_emu::ldmatrix_x4(r, row, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#endif
  }
  // cp.async.cg.shared.global, 16 bytes (zeros stored plainly when src is null), and its
  // groups (attention_tiles.h's Ctx). The emulation lands a copy when its thread waits for its
  // group (tests/cudaemu), so that a tile read before its wait reads stale bytes there.
  __device__ void copy16(std::uint16_t* dst, const std::uint16_t* src) const {
#if defined(MIXTAPE_CUDA_EMULATION)
    if (src == nullptr)
      std::memset(dst, 0, 16);
    else
      ::mixtape::cuda_emu::async_copy16(dst, src);
#else
    if (src == nullptr) {
      *reinterpret_cast<uint4*>(dst) = uint4{};
      return;
    }
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_address(dst)), "l"(src)
                 : "memory");
#endif
  }
  __device__ void commit() const {
#if defined(MIXTAPE_CUDA_EMULATION)
    ::mixtape::cuda_emu::async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
  }
  template <int N>
  __device__ void wait() const {
#if defined(MIXTAPE_CUDA_EMULATION)
    ::mixtape::cuda_emu::async_wait(N);
#else
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
  }
  // lo and hi rounded to the 16-bit type (to nearest even), in one register (lo in the low
  // half): one conversion instruction for the pair on a GPU.
  __device__ std::uint32_t bits2(float lo, float hi) const {
#if defined(MIXTAPE_CUDA_EMULATION)
    const auto bits = [](float v) -> std::uint32_t {
      if constexpr (BF16)
        return __bfloat16_as_ushort(__float2bfloat16_rn(v));
      else
        return __half_as_ushort(__float2half_rn(v));
    };
    return bits(lo) | (bits(hi) << 16);
#else
    std::uint32_t r;
    if constexpr (BF16) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
      std::memcpy(&r, &v, sizeof r);
    } else {
      const __half2 v = __floats2half2_rn(lo, hi);
      std::memcpy(&r, &v, sizeof r);
    }
    return r;
#endif
  }
  // The two 16-bit values of such a register, exactly, as floats.
  __device__ void unpack(std::uint32_t r, float& lo, float& hi) const {
    if constexpr (BF16) {
      lo = __uint_as_float(r << 16);
      hi = __uint_as_float(r & 0xffff0000u);
    } else {
#if defined(MIXTAPE_CUDA_EMULATION)
      lo = ::mixtape::detail::half_bits_to_float(static_cast<std::uint16_t>(r & 0xffffu));
      hi = ::mixtape::detail::half_bits_to_float(static_cast<std::uint16_t>(r >> 16));
#else
      __half2 pair;
      std::memcpy(&pair, &r, sizeof pair);
      const float2 f = __half22float2(pair);
      lo = f.x;
      hi = f.y;
#endif
    }
  }
  __device__ float exp2(float x) const { return exp2f(x); }
  __device__ float log2(float x) const { return log2f(x); }

 private:
#if !defined(MIXTAPE_CUDA_EMULATION)
  static __device__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
  }
#endif
};

// (Dk and Dv: the key gradients one at a time, for heads wider than 64.)
enum class TilePass { Forward, Dq, DkDv, Dk, Dv };

// Blocks a multiprocessor holds at once: 3 for the forward pass of heads up to 64 wide walking
// the keys 64 at a time (at most 168 registers a thread; 2 blocks otherwise), 2 for the others (128
// keys at a time, wider heads' forward pass, the backward passes with their two products' operands
// and accumulators: about 250 registers).
template <TilePass Pass, int D, int KT>
constexpr int kTileBlocksPerSm =
    Pass == TilePass::Forward&& D <= 64 && KT == attention_tiles::kTile ? 3 : 2;

// KT and kDropout: the keys the forward pass walks at a time, and whether it drops weights
// (attention_tiles::forward).
template <TilePass Pass, int D, bool BF16, int KT = attention_tiles::kTile, bool kDropout = false>
__global__ void __launch_bounds__(attention_tiles::kThreads, (kTileBlocksPerSm<Pass, D, KT>))
    attention_tile_kernel(attention_tiles::Params p) {
  __shared__ attention_tiles::Shared<D, KT> shared;
  shared_starts_undefined(shared);
  // (dk and dv: the first key blocks have the most queries; the launch order is right.)
  constexpr bool kByKeys = Pass == TilePass::DkDv || Pass == TilePass::Dk || Pass == TilePass::Dv;
  MmaCtx<BF16> ctx{.reversed = !kByKeys};
  attention_tiles::read_seed(p);
  if constexpr (Pass == TilePass::Forward)
    attention_tiles::forward<D, KT, kDropout>(ctx, shared, p);
  else if constexpr (Pass == TilePass::Dq)
    attention_tiles::backward_dq<D>(ctx, shared, p);
  else if constexpr (Pass == TilePass::DkDv)
    attention_tiles::backward_dkdv<D>(ctx, shared, p);
  else if constexpr (Pass == TilePass::Dk)
    attention_tiles::backward_dkdv<D, attention_tiles::KeyGrads::dk>(ctx, shared, p);
  else
    attention_tiles::backward_dkdv<D, attention_tiles::KeyGrads::dv>(ctx, shared, p);
}

// Whether every row of x (undefined: true) starts 16-byte aligned, `per16` elements to 16 bytes:
// the first, and the strides of the axes before the last multiples of per16.
bool rows_aligned16(const Tensor& x, int64_t per16) {
  if (!x.defined()) return true;
  for (std::size_t a = 0; a + 1 < x.rank(); ++a)
    if (x.strides()[a] % per16 != 0) return false;
  return reinterpret_cast<std::uintptr_t>(x.const_data_ptr()) % 16 == 0;
}

// The tiled kernels' operands (the outputs and D set by the caller) for the forward pass, or
// for the backward pass when dout is defined; nullopt when they do not apply: not a 16-bit
// dtype, head dims they do not take, MIXTAPE_CUDA_MMA_ATTENTION=0, a grid too large, or
// operands not 16-byte aligned.
template <typename T>
std::optional<attention_tiles::Params> tile_params(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& mask, bool causal,
                                                   double scale,
                                                   const kernels::AttentionDropout& dropout,
                                                   const Tensor& dout) {
  if constexpr (!kHalfLike<T>) {
    return std::nullopt;
  } else {
    static const bool enabled = detail::env::kCudaMmaAttention.read();
    const int64_t d = q.dim(-1), dv = v.dim(-1), longest = std::max(q.dim(-2), k.dim(-2));
    const bool dims = attention_tiles::supports(d, dv);
    // The tiles are read 16 bytes at a time: every row's start 16-byte aligned.
    const auto aligned = [](const Tensor& x) { return rows_aligned16(x, 8); };
    if (!enabled || !dims || head_count(q) > 0x7fffffff ||
        (longest + attention_tiles::kTile - 1) / attention_tiles::kTile > 65535 || !aligned(q) ||
        !aligned(k) || !aligned(v) || !aligned(dout))
      return std::nullopt;
    return attention_tiles::params_of<std::uint16_t>(q, k, v, mask, causal, scale, dropout);
  }
}

// One tiled kernel over `rows` rows of every head (queries for Forward and Dq, keys for DkDv),
// heads of width d (a width attention_tiles::supports takes).
template <TilePass Pass, typename T>
void launch_tiles(const attention_tiles::Params& p, int64_t d, int64_t rows, cudaStream_t stream) {
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  const dim3 grid(
      static_cast<unsigned>(p.n),
      static_cast<unsigned>((rows + attention_tiles::kTile - 1) / attention_tiles::kTile));
  const auto launch = [&](auto kernel) {
    MIXTAPE_CUDA_LAUNCH(grid, attention_tiles::kThreads, stream, kernel)(p);
    MIXTAPE_CUDA_CHECK_LAUNCH("attention tile kernel");
  };
  if constexpr (Pass == TilePass::Forward) {
    // (An experiment's switch: which key tile is faster is for a GPU to say.)
    static const bool wide = detail::env::kCudaAttentionWideKeys.read();
    constexpr int kKeys = attention_tiles::kTile, kWide = 2 * kKeys;
    const auto forward = [&]<bool kDropout>() {
      if (wide && d == 32) return launch(attention_tile_kernel<Pass, 32, kBf16, kWide, kDropout>);
      if (wide && d == 64) return launch(attention_tile_kernel<Pass, 64, kBf16, kWide, kDropout>);
      if (d == 32) return launch(attention_tile_kernel<Pass, 32, kBf16, kKeys, kDropout>);
      if (d == 64) return launch(attention_tile_kernel<Pass, 64, kBf16, kKeys, kDropout>);
      if (d == 96) return launch(attention_tile_kernel<Pass, 96, kBf16, kKeys, kDropout>);
      if (d == 128) return launch(attention_tile_kernel<Pass, 128, kBf16, kKeys, kDropout>);
      throw DeviceError(fmt::format("attention: no tensor-core kernel for head dim {}", d));
    };
    if (p.dropout) return forward.template operator()<true>();
    return forward.template operator()<false>();
  }
  // (dk and dv together up to width 64, one at a time beyond: attention_backward_host.)
  if constexpr (Pass != TilePass::Dk && Pass != TilePass::Dv) {
    if (d == 32) return launch(attention_tile_kernel<Pass, 32, kBf16>);
    if (d == 64) return launch(attention_tile_kernel<Pass, 64, kBf16>);
  }
  if constexpr (Pass != TilePass::DkDv) {
    if (d == 96) return launch(attention_tile_kernel<Pass, 96, kBf16>);
    if (d == 128) return launch(attention_tile_kernel<Pass, 128, kBf16>);
  }
  // (tile_params admits only the widths above: reaching here is a bug, not a fallback.)
  throw DeviceError(fmt::format("attention: no tensor-core kernel for head dim {} (pass {})", d,
                                static_cast<int>(Pass)));
}

// --- The tiled float32 kernels (attention_float32.cuh) ---------------------------------------

// Their operands (the outputs, lse and D set by the caller) for the forward pass, or for the
// backward pass when dout is defined; nullopt when they do not apply: not float32, head dims
// they do not take, a grid too large, or rows not 16-byte aligned.
template <typename T>
std::optional<attention_float32::Params> float32_params(const Tensor& q, const Tensor& k,
                                                        const Tensor& v, const Tensor& mask,
                                                        bool causal, double scale,
                                                        const kernels::AttentionDropout& dropout,
                                                        std::initializer_list<Tensor> written) {
  if constexpr (!std::is_same_v<T, float>) {
    return std::nullopt;
  } else {
    namespace f32 = attention_float32;
    // The tiles are read and written 16 bytes at a time: every row's start 16-byte aligned.
    const auto aligned = [](const Tensor& x) { return rows_aligned16(x, 4); };
    const int64_t longest = std::max(q.dim(-2), k.dim(-2));
    bool ok = f32::supports(q.dim(-1), v.dim(-1)) && head_count(q) <= 0x7fffffff &&
              (longest + f32::kTileCols - 1) / f32::kTileCols <= 65535 && aligned(q) &&
              aligned(k) && aligned(v);
    for (const Tensor& w : written) ok = ok && aligned(w);
    if (!ok) return std::nullopt;
    return attention_tiles::params_of<float>(q, k, v, mask, causal, scale, dropout);
  }
}

// One of them (made for widths 32 and 64) over `rows` rows of every head, a block of Threads
// threads taking rows_of(Threads) of them.
template <int Threads>
void launch_float32(void (*kernel32)(attention_float32::Params),
                    void (*kernel64)(attention_float32::Params), const attention_float32::Params& p,
                    int64_t d, int64_t rows, cudaStream_t stream) {
  constexpr int kRows = attention_float32::rows_of(Threads);
  const dim3 grid(static_cast<unsigned>(p.n), static_cast<unsigned>((rows + kRows - 1) / kRows));
  void (*kernel)(attention_float32::Params) =
      attention_float32::kernel_width(d) == 32 ? kernel32 : kernel64;
  MIXTAPE_CUDA_LAUNCH(grid, Threads, stream, kernel)(p);
  MIXTAPE_CUDA_CHECK_LAUNCH("attention float32 tile kernel");
}

template <typename T>
void attention_host(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                    bool causal, double scale, const kernels::AttentionDropout& dropout,
                    const Tensor& out, const Tensor& lse) {
  const int64_t n = head_count(q), t = q.dim(-2), s = k.dim(-2), d = q.dim(-1), dv = v.dim(-1);
  if (n * t == 0) return;
  using C = compute_of<T>;
  OnDevice on(out);
  if (auto p = tile_params<T>(q, k, v, mask, causal, scale, dropout, Tensor())) {
    p->out = head_rows<std::uint16_t>(out);
    p->lse = static_cast<float*>(lse.data_ptr());
    return launch_tiles<TilePass::Forward, T>(*p, d, t, on.s);
  }
  if (auto p = float32_params<T>(q, k, v, mask, causal, scale, dropout, {out})) {
    namespace f32 = attention_float32;
    p->out = head_rows<float>(out);
    p->lse = static_cast<float*>(lse.data_ptr());
    return launch_float32<f32::kForwardThreads>(f32::forward_kernel<32>, f32::forward_kernel<64>,
                                                *p, d, t, on.s);
  }
  launch_1d({"attention kernel", n * t * kWarp, on.s}, attention_forward_kernel<T>,
            head_rows<const T>(q), head_rows<const T>(k), head_rows<const T>(v),
            head_rows<const std::uint8_t>(mask), causal, static_cast<C>(scale), dropout_of(dropout),
            head_rows<T>(out), static_cast<C*>(lse.data_ptr()), n, t, s, d, dv);
}

template <typename T>
void attention_backward_host(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                             bool causal, double scale, const kernels::AttentionDropout& dropout,
                             const Tensor& out, const Tensor& lse, const Tensor& dout,
                             const Tensor& dq, const Tensor& dk, const Tensor& dv_out) {
  const int64_t n = head_count(q), t = q.dim(-2), s = k.dim(-2), d = q.dim(-1), dv = v.dim(-1);
  using C = compute_of<T>;
  OnDevice on(dq);
  // D per query row; the cache hands the block out again in stream order.
  Workspace rowdot(static_cast<std::size_t>(n * t > 0 ? n * t : 1) * sizeof(C), on.index);
  const auto qp = head_rows<const T>(q), kp = head_rows<const T>(k), vp = head_rows<const T>(v);
  const auto mp = head_rows<const std::uint8_t>(mask);
  const auto* lp = static_cast<const C*>(lse.const_data_ptr());
  auto* rp = static_cast<C*>(rowdot.data());
  const auto gp = head_rows<const T>(dout);
  const auto sc = static_cast<C>(scale);
  if (n * t > 0)
    launch_1d({"attention rowdot kernel", n * t * kWarp, on.s}, attention_rowdot_kernel<T>, gp,
              head_rows<const T>(out), rp, n * t, t, dv);
  if (auto p = tile_params<T>(q, k, v, mask, causal, scale, dropout, dout)) {
    p->lse = const_cast<float*>(static_cast<const float*>(lse.const_data_ptr()));  // read only
    p->dout = head_rows<const std::uint16_t>(dout);
    p->rowdot = static_cast<const float*>(rowdot.data());
    p->dq = head_rows<std::uint16_t>(dq);
    p->dk = head_rows<std::uint16_t>(dk);
    p->dv = head_rows<std::uint16_t>(dv_out);
    if (n * t > 0) launch_tiles<TilePass::Dq, T>(*p, d, t, on.s);
    if (n * s > 0 && d <= 64) launch_tiles<TilePass::DkDv, T>(*p, d, s, on.s);
    if (n * s > 0 && d > 64) {  // (each walks the queries: dk's operands and dv's overflow one)
      launch_tiles<TilePass::Dk, T>(*p, d, s, on.s);
      launch_tiles<TilePass::Dv, T>(*p, d, s, on.s);
    }
    return;
  }
  if (auto p = float32_params<T>(q, k, v, mask, causal, scale, dropout, {dout, dq, dk, dv_out})) {
    namespace f32 = attention_float32;
    p->lse = const_cast<float*>(static_cast<const float*>(lse.const_data_ptr()));  // read only
    p->dout = head_rows<const float>(dout);
    p->rowdot = static_cast<const float*>(rowdot.data());
    p->dq = head_rows<float>(dq);
    p->dk = head_rows<float>(dk);
    p->dv = head_rows<float>(dv_out);
    if (n * t > 0)
      launch_float32<f32::kBackwardThreads>(f32::dq_kernel<32>, f32::dq_kernel<64>, *p, d, t, on.s);
    if (n * s > 0)
      launch_float32<f32::kBackwardThreads>(f32::dkdv_kernel<32>, f32::dkdv_kernel<64>, *p, d, s,
                                            on.s);
    return;
  }
  if (n * t > 0) {
    launch_1d({"attention dq kernel", n * t * kWarp, on.s}, attention_dq_kernel<T>, qp, kp, vp, mp,
              causal, sc, dropout_of(dropout), lp, rp, gp, head_rows<T>(dq), n, t, s, d, dv);
  }
  if (n * s > 0) {
    launch_1d({"attention dk/dv kernel", n * s * kWarp, on.s}, attention_dkdv_kernel<T>, qp, kp, vp,
              mp, causal, sc, dropout_of(dropout), lp, rp, gp, head_rows<T>(dk),
              head_rows<T>(dv_out), n, t, s, d, dv);
  }
}

}  // namespace

void register_attention_kernels() {
  MIXTAPE_CUDA_KERNEL(attention, attention_host);
  MIXTAPE_CUDA_KERNEL(attention_backward, attention_backward_host);
}

}  // namespace mixtape::cuda_backend
