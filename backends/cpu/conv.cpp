// CPU convolution and pooling kernels (NHWC input, HWIO filter), for float32, float64,
// float16 and bfloat16.
//
// conv2d lowers to GEMM through im2col: the column matrix has one row per output pixel,
// [n*oh*ow, kh*kw*c] (zeros where the window hangs over the padding), and the filter is
// viewed as [kh*kw*c, cout]. Then
//   forward          out   = col x W
//   backward weight  dW    = col^T x dOut
//   backward input   dCol  = dOut x W^T, folded back onto the image (col2im)
// The output rows are processed in chunks so the column buffer stays small (and in
// cache). Windows with few taps (kh*kw*c <= kDirectMaxTaps, e.g. a first layer on 1-3
// channels) skip the GEMM: forward and backward weight are direct loops there.
// float16 and bfloat16 tensors are converted to float32 in bulk, computed in float32 and
// rounded back; float64 computes in float64 (dgemm). With
// Conv2dGeometry::low_precision_accumulation (MIXTAPE_FP16_USE_FP32_COMPUTE=0) the
// float16 / bfloat16 kernels instead emulate accumulation in the 16-bit type (the "acc16"
// section below).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "backends/cpu/cpu_backend.h"
#include "mixtape/core/half.h"

namespace mixtape::cpu {
namespace {

using kernels::Conv2dGeometry;
using kernels::Pool2dGeometry;

// A grow-only, 64-byte aligned scratch buffer (one per thread and use), so steady-state
// calls allocate nothing.
template <typename C>
struct Scratch {
  C* ptr = nullptr;
  std::size_t cap = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { release(); }
  void release() {
    if (ptr) ::operator delete(ptr, std::align_val_t(64));
    ptr = nullptr;
    cap = 0;
  }
  C* get(std::int64_t n) {
    const auto want = static_cast<std::size_t>(std::max<std::int64_t>(n, 1));
    if (want > cap) {
      release();
      ptr = static_cast<C*>(::operator new(want * sizeof(C), std::align_val_t(64)));
      cap = want;
    }
    return ptr;
  }
};

// Scratch slots of the calling thread: the column matrix (or the direct path's partial
// sums), up to three converted tensors of the reduced-precision wrappers (slots 1-3), and
// a float32 output chunk awaiting conversion.
template <typename C>
Scratch<C>& scratch(int slot) {
  thread_local Scratch<C> slots[5];
  return slots[slot];
}
constexpr int kColSlot = 0;
constexpr int kOutChunkSlot = 4;

// The column buffer holds at most this many bytes (but at least one output row): small
// enough to stay in cache between im2col and the GEMM that reads it.
constexpr std::int64_t kColBytes = std::int64_t{4} << 20;

inline int max_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// --- BLAS ----------------------------------------------------------------------------

// Row-major C = alpha op(A) op(B) + beta C.
inline void blas_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                      const float* a, std::int64_t lda, const float* b, std::int64_t ldb,
                      float beta, float* c, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}
inline void blas_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                      const double* a, std::int64_t lda, const double* b, std::int64_t ldb,
                      double beta, double* c, std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c,
              static_cast<blasint>(ldc));
}

// --- Bulk conversion for float16 / bfloat16 ------------------------------------------

// The library's bulk converters go parallel (OpenMP) on long spans; OpenMP workers spin
// after a region and then compete with OpenBLAS's threads for the cores, so spans are fed
// to them in short pieces, on the calling thread.
constexpr std::size_t kConvertPiece = std::size_t{1} << 13;

inline void convert_piece(const half* s, float* d, std::size_t n) {
  convert_half_to_float(s, d, n);
}
inline void convert_piece(const bfloat16* s, float* d, std::size_t n) {
  convert_bfloat16_to_float(s, d, n);
}
inline void convert_piece(const float* s, half* d, std::size_t n) {
  convert_float_to_half(s, d, n);
}
inline void convert_piece(const float* s, bfloat16* d, std::size_t n) {
  convert_float_to_bfloat16(s, d, n);
}

template <typename S, typename D>
void convert(const S* s, D* d, std::int64_t count) {
  const auto n = static_cast<std::size_t>(count);
  for (std::size_t i = 0; i < n; i += kConvertPiece)
    convert_piece(s + i, d + i, std::min(kConvertPiece, n - i));
}

// --- im2col / col2im -----------------------------------------------------------------
//
// Work is split into chunks of output rows: row r = i * oh + oy is output row oy of image
// i, holding ow output pixels. im2col / col2im run on the calling thread: an OpenMP region
// right before or after an OpenBLAS call leaves OpenMP workers spinning on the cores
// OpenBLAS's threads need, which costs more than the copy itself.

// The valid window taps [lo, hi) along one axis for output position o: taps t with
// 0 <= o*stride - pad + t < size.
struct TapRange {
  std::int64_t lo, hi;
};
inline TapRange tap_range(std::int64_t o, std::int64_t stride, std::int64_t pad, std::int64_t taps,
                          std::int64_t size) {
  const std::int64_t start = o * stride - pad;
  const std::int64_t lo = std::clamp<std::int64_t>(-start, 0, taps);
  const std::int64_t hi = std::clamp<std::int64_t>(size - start, lo, taps);
  return {lo, hi};
}

// col rows for output rows [r0, r1): the row of pixel (i, oy, ox) holds the window
// x[i, oy*sh - pt + ky, ox*sw - pl + kx, :] for all (ky, kx), zero off-image.
template <typename C>
void im2col(const C* x, std::int64_t r0, std::int64_t r1, const Conv2dGeometry& g, C* col) {
  const std::int64_t c = g.c, kw = g.kw, row_len = g.kh * g.kw * c;
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const C* img = x + i * g.h * g.w * c;
    const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
    C* dst_row = col + (r - r0) * g.ow * row_len;
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      C* dst = dst_row + ox * row_len;
      const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, kw, g.w);
      const std::int64_t ix0 = ox * g.stride_w - g.pad_left + tx.lo;
      const std::int64_t len = (tx.hi - tx.lo) * c;
      for (std::int64_t ky = 0; ky < g.kh; ++ky) {
        C* d = dst + ky * kw * c;
        if (ky < ty.lo || ky >= ty.hi) {
          std::fill(d, d + kw * c, C(0));
          continue;
        }
        const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
        const C* src = img + (iy * g.w + ix0) * c;
        std::fill(d, d + tx.lo * c, C(0));
        for (std::int64_t j = 0; j < len; ++j) d[tx.lo * c + j] = src[j];
        std::fill(d + tx.hi * c, d + kw * c, C(0));
      }
    }
  }
}

// The adjoint of im2col for output rows [r0, r1): adds each col entry onto the input
// pixel im2col copied it from (grad_x accumulates; padding taps are dropped).
template <typename C>
void col2im_add(const C* col, std::int64_t r0, std::int64_t r1, const Conv2dGeometry& g,
                C* grad_x) {
  const std::int64_t c = g.c, row_len = g.kh * g.kw * c;
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    C* img = grad_x + i * g.h * g.w * c;
    const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
    const C* src_row = col + (r - r0) * g.ow * row_len;
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      const C* src = src_row + ox * row_len;
      const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
      const std::int64_t ix0 = ox * g.stride_w - g.pad_left + tx.lo;
      const std::int64_t len = (tx.hi - tx.lo) * c;
      for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
        const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
        C* d = img + (iy * g.w + ix0) * c;
        const C* s = src + (ky * g.kw + tx.lo) * c;
        for (std::int64_t j = 0; j < len; ++j) d[j] += s[j];
      }
    }
  }
}

// A 1x1, stride-1, unpadded conv whose output covers the input: x is its own col matrix.
inline bool is_pointwise(const Conv2dGeometry& g) {
  return g.kh == 1 && g.kw == 1 && g.stride_h == 1 && g.stride_w == 1 && g.pad_top == 0 &&
         g.pad_left == 0 && g.oh == g.h && g.ow == g.w;
}

// Output rows per chunk so the column buffer stays under kColBytes.
template <typename C>
std::int64_t chunk_rows(const Conv2dGeometry& g) {
  const std::int64_t row_elems = std::max<std::int64_t>(g.ow * g.kh * g.kw * g.c, 1);
  const std::int64_t fit = kColBytes / static_cast<std::int64_t>(sizeof(C)) / row_elems;
  return std::clamp<std::int64_t>(fit, 1, std::max<std::int64_t>(g.n * g.oh, 1));
}

// --- Direct convolution for small windows --------------------------------------------
//
// With few taps per output (kh*kw*c small, e.g. a first layer on 1-3 channels) a GEMM
// spends its time packing, so these loops go straight from x to the output instead,
// vectorised over cout. They run on OpenMP threads (no BLAS call is involved) and come
// in an AVX2 build picked at run time.

constexpr std::int64_t kDirectMaxTaps = 48;  // kh*kw*c at or below which conv is direct
constexpr std::int64_t kOutBlock = 32;       // output channels kept in registers

#define MIXTAPE_ALWAYS_INLINE inline __attribute__((always_inline))

// 32-byte vectors (one AVX register; two SSE registers in the baseline build): V for
// values, U for unaligned, aliasing views of memory (loads and stores).
template <typename C>
struct VecTypes;
template <>
struct VecTypes<float> {
  typedef float V __attribute__((vector_size(32)));
  typedef float U __attribute__((vector_size(32), aligned(4), may_alias));
};
template <>
struct VecTypes<double> {
  typedef double V __attribute__((vector_size(32)));
  typedef double U __attribute__((vector_size(32), aligned(8), may_alias));
};
template <typename C>
using Vec = typename VecTypes<C>::V;
template <typename C>
using VecU = typename VecTypes<C>::U;
template <typename C>
constexpr std::int64_t kLanes = 32 / static_cast<std::int64_t>(sizeof(C));

template <typename C>
MIXTAPE_ALWAYS_INLINE const VecU<C>* vec_at(const C* p) {
  return reinterpret_cast<const VecU<C>*>(p);
}
template <typename C>
MIXTAPE_ALWAYS_INLINE VecU<C>* vec_at(C* p) {
  return reinterpret_cast<VecU<C>*>(p);
}

// Calls f(xs, tap) for each in-image tap (ky, kx) of output pixel (oy, ox): xs points at
// the c input channels, tap = ky * kw + kx.
template <typename C, typename F>
MIXTAPE_ALWAYS_INLINE void for_each_tap(const C* img, std::int64_t oy, std::int64_t ox,
                                        const Conv2dGeometry& g, F&& f) {
  const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
  const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
  for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
    const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
    const C* xrow = img + (iy * g.w + ox * g.stride_w - g.pad_left) * g.c;
    for (std::int64_t kx = tx.lo; kx < tx.hi; ++kx) f(xrow + kx * g.c, ky * g.kw + kx);
  }
}

// o[0:kOutBlock] = the output channels [co0, co0 + kOutBlock) of pixel (oy, ox), with the
// accumulators in registers.
template <typename C>
MIXTAPE_ALWAYS_INLINE void direct_pixel_block(const C* img, const C* w, C* o, std::int64_t co0,
                                              std::int64_t oy, std::int64_t ox,
                                              const Conv2dGeometry& g) {
  using V = Vec<C>;
  constexpr std::int64_t kVecs = kOutBlock / kLanes<C>;
  V acc[kVecs];
  for (auto& a : acc) a = V{};
  for_each_tap(img, oy, ox, g, [&](const C* xs, std::int64_t tap) {
    const C* wk = w + tap * g.c * g.cout + co0;
    for (std::int64_t ci = 0; ci < g.c; ++ci) {
      const V xv = V{} + xs[ci];
      const C* wr = wk + ci * g.cout;
      for (std::int64_t j = 0; j < kVecs; ++j) acc[j] += xv * vec_at(wr)[j];
    }
  });
  for (std::int64_t j = 0; j < kVecs; ++j) vec_at(o)[j] = acc[j];
}

// The last, narrower block of output channels [co0, cout).
template <typename C>
MIXTAPE_ALWAYS_INLINE void direct_pixel_tail(const C* img, const C* w, C* o, std::int64_t co0,
                                             std::int64_t oy, std::int64_t ox,
                                             const Conv2dGeometry& g) {
  const std::int64_t width = g.cout - co0;
  std::fill(o, o + width, C(0));
  for_each_tap(img, oy, ox, g, [&](const C* xs, std::int64_t tap) {
    const C* wk = w + tap * g.c * g.cout + co0;
    for (std::int64_t ci = 0; ci < g.c; ++ci) {
      const C xv = xs[ci];
      const C* wr = wk + ci * g.cout;
      for (std::int64_t j = 0; j < width; ++j) o[j] += xv * wr[j];
    }
  });
}

// Output rows [r0, r1); out points at row r0's output.
template <typename C>
MIXTAPE_ALWAYS_INLINE void direct_forward_rows_impl(const C* x, const C* w, C* out,
                                                    const Conv2dGeometry& g, std::int64_t r0,
                                                    std::int64_t r1) {
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const C* img = x + i * g.h * g.w * g.c;
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      C* o = out + ((r - r0) * g.ow + ox) * g.cout;
      std::int64_t co0 = 0;
      for (; co0 + kOutBlock <= g.cout; co0 += kOutBlock)
        direct_pixel_block(img, w, o + co0, co0, oy, ox, g);
      if (co0 < g.cout) direct_pixel_tail(img, w, o + co0, co0, oy, ox, g);
    }
  }
}

// acc[tap, co] += x * grad_out over output rows [r0, r1) (acc is kdim x cout); the output
// gradient of each pixel is held in registers a block of kOutBlock channels at a time.
template <typename C>
MIXTAPE_ALWAYS_INLINE void direct_weight_rows_impl(const C* x, const C* grad_out, C* acc,
                                                   const Conv2dGeometry& g, std::int64_t r0,
                                                   std::int64_t r1) {
  using V = Vec<C>;
  constexpr std::int64_t kVecs = kOutBlock / kLanes<C>;
  for (std::int64_t r = r0; r < r1; ++r) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const C* img = x + i * g.h * g.w * g.c;
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      const C* go = grad_out + (r * g.ow + ox) * g.cout;
      std::int64_t co0 = 0;
      for (; co0 + kOutBlock <= g.cout; co0 += kOutBlock) {
        V gv[kVecs];
        for (std::int64_t j = 0; j < kVecs; ++j) gv[j] = vec_at(go + co0)[j];
        for_each_tap(img, oy, ox, g, [&](const C* xs, std::int64_t tap) {
          C* ak = acc + tap * g.c * g.cout + co0;
          for (std::int64_t ci = 0; ci < g.c; ++ci) {
            const V xv = V{} + xs[ci];
            VecU<C>* ar = vec_at(ak + ci * g.cout);
            for (std::int64_t j = 0; j < kVecs; ++j) ar[j] += xv * gv[j];
          }
        });
      }
      if (co0 == g.cout) continue;
      const std::int64_t width = g.cout - co0;
      for_each_tap(img, oy, ox, g, [&](const C* xs, std::int64_t tap) {
        C* ak = acc + tap * g.c * g.cout + co0;
        for (std::int64_t ci = 0; ci < g.c; ++ci) {
          const C xv = xs[ci];
          C* ar = ak + ci * g.cout;
          for (std::int64_t j = 0; j < width; ++j) ar[j] += xv * go[co0 + j];
        }
      });
    }
  }
}

template <typename C>
void direct_forward_rows(const C* x, const C* w, C* out, const Conv2dGeometry& g, std::int64_t r0,
                         std::int64_t r1) {
  direct_forward_rows_impl(x, w, out, g, r0, r1);
}
template <typename C>
void direct_weight_rows(const C* x, const C* grad_out, C* acc, const Conv2dGeometry& g,
                        std::int64_t r0, std::int64_t r1) {
  direct_weight_rows_impl(x, grad_out, acc, g, r0, r1);
}

#if defined(__x86_64__) && defined(__GNUC__)
template <typename C>
__attribute__((target("avx2,fma"))) void direct_forward_rows_avx2(const C* x, const C* w, C* out,
                                                                  const Conv2dGeometry& g,
                                                                  std::int64_t r0,
                                                                  std::int64_t r1) {
  direct_forward_rows_impl(x, w, out, g, r0, r1);
}
template <typename C>
__attribute__((target("avx2,fma"))) void direct_weight_rows_avx2(const C* x, const C* grad_out,
                                                                 C* acc, const Conv2dGeometry& g,
                                                                 std::int64_t r0, std::int64_t r1) {
  direct_weight_rows_impl(x, grad_out, acc, g, r0, r1);
}
inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

template <typename C>
using ForwardRowsFn = void (*)(const C*, const C*, C*, const Conv2dGeometry&, std::int64_t,
                               std::int64_t);
template <typename C>
using WeightRowsFn = void (*)(const C*, const C*, C*, const Conv2dGeometry&, std::int64_t,
                              std::int64_t);

template <typename C>
ForwardRowsFn<C> forward_rows_fn() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_avx2()) return &direct_forward_rows_avx2<C>;
#endif
  return &direct_forward_rows<C>;
}
template <typename C>
WeightRowsFn<C> weight_rows_fn() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (has_avx2()) return &direct_weight_rows_avx2<C>;
#endif
  return &direct_weight_rows<C>;
}

inline bool use_direct(const Conv2dGeometry& g) { return g.kh * g.kw * g.c <= kDirectMaxTaps; }

// Thread t of nt takes output rows [lo, hi).
inline void split_rows(std::int64_t rows, int t, int nt, std::int64_t& lo, std::int64_t& hi) {
  lo = rows * t / nt;
  hi = rows * (t + 1) / nt;
}

inline int threads_for(std::int64_t work) { return work > kParallelGrain ? max_threads() : 1; }
inline int thread_num() {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}
inline int team_size() {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// O is the output's storage type: C, or float16 / bfloat16 for a float32 computation, in
// which case each thread converts its rows a few at a time while they are in cache.
template <typename C, typename O>
void direct_forward(const C* x, const C* w, O* out, const Conv2dGeometry& g) {
  const ForwardRowsFn<C> fn = forward_rows_fn<C>();
  const std::int64_t rows = g.n * g.oh, row_len = g.ow * g.cout;
  const int nt = threads_for(rows * g.ow * g.cout * g.kh * g.kw * g.c);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::int64_t lo, hi;
    split_rows(rows, thread_num(), team_size(), lo, hi);
    if constexpr (std::is_same_v<O, C>) {
      fn(x, w, out + lo * row_len, g, lo, hi);
    } else {
      thread_local Scratch<C> buf;
      // Rows per conversion: about 8192 elements, within L1/L2.
      const std::int64_t block =
          std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(row_len, 1));
      C* b = buf.get(block * row_len);
      for (std::int64_t r = lo; r < hi; r += block) {
        const std::int64_t re = std::min(hi, r + block);
        fn(x, w, b, g, r, re);
        convert(b, out + r * row_len, (re - r) * row_len);
      }
    }
  }
}

template <typename C>
void direct_backward_weight(const C* x, const C* grad_out, C* grad_w, const Conv2dGeometry& g) {
  const WeightRowsFn<C> fn = weight_rows_fn<C>();
  const std::int64_t rows = g.n * g.oh, w_n = g.kh * g.kw * g.c * g.cout;
  const int nt = threads_for(rows * g.ow * g.cout * g.kh * g.kw * g.c);
  // One partial sum per thread (the first is grad_w itself), added up at the end.
  C* partials = scratch<C>(kColSlot).get(std::max(nt - 1, 1) * w_n);
  int used = 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = thread_num(), tn = team_size();
#pragma omp single
    used = tn;
    C* acc = t == 0 ? grad_w : partials + (t - 1) * w_n;
    std::fill(acc, acc + w_n, C(0));
    std::int64_t lo, hi;
    split_rows(rows, t, tn, lo, hi);
    fn(x, grad_out, acc, g, lo, hi);
  }
  for (int t = 1; t < used; ++t) {
    const C* p = partials + (t - 1) * w_n;
    for (std::int64_t j = 0; j < w_n; ++j) grad_w[j] += p[j];
  }
}

// --- Convolution on compute-type buffers (float or double) ---------------------------

// O is the output's storage type (C, or a 16-bit type converted to chunk by chunk).
template <typename C, typename O>
void conv_forward(const C* x, const C* w, O* out, const Conv2dGeometry& g) {
  constexpr bool kSame = std::is_same_v<O, C>;
  const std::int64_t pixels = g.oh * g.ow, kdim = g.kh * g.kw * g.c;
  const std::int64_t out_n = g.n * pixels * g.cout;
  if (out_n == 0) return;
  if (kdim == 0) return std::fill(out, out + out_n, O(0.0f));
  if (use_direct(g)) return direct_forward(x, w, out, g);
  const bool pointwise = is_pointwise(g);
  if constexpr (kSame) {
    if (pointwise)
      return blas_gemm(false, false, g.n * pixels, g.cout, kdim, x, kdim, w, g.cout, C(0), out,
                       g.cout);
  }
  const std::int64_t rows = g.n * g.oh, chunk = chunk_rows<C>(g);
  C* col = pointwise ? nullptr : scratch<C>(kColSlot).get(chunk * g.ow * kdim);
  C* tmp = kSame ? nullptr : scratch<C>(kOutChunkSlot).get(chunk * g.ow * g.cout);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t r1 = std::min(rows, r0 + chunk);
    const C* a = x + r0 * g.ow * kdim;  // pointwise: x is the col matrix
    if (!pointwise) {
      im2col(x, r0, r1, g, col);
      a = col;
    }
    O* dst = out + r0 * g.ow * g.cout;
    if constexpr (kSame) {
      blas_gemm(false, false, (r1 - r0) * g.ow, g.cout, kdim, a, kdim, w, g.cout, C(0), dst,
                g.cout);
    } else {
      blas_gemm(false, false, (r1 - r0) * g.ow, g.cout, kdim, a, kdim, w, g.cout, C(0), tmp,
                g.cout);
      convert(tmp, dst, (r1 - r0) * g.ow * g.cout);
    }
  }
}

template <typename C>
void conv_backward_input(const C* grad_out, const C* w, C* grad_x, const Conv2dGeometry& g) {
  const std::int64_t pixels = g.oh * g.ow, kdim = g.kh * g.kw * g.c;
  const std::int64_t x_n = g.n * g.h * g.w * g.c;
  if (x_n == 0) return;
  if (is_pointwise(g) && g.cout > 0)
    return blas_gemm(false, true, g.n * pixels, kdim, g.cout, grad_out, g.cout, w, g.cout, C(0),
                     grad_x, kdim);
  std::fill(grad_x, grad_x + x_n, C(0));
  if (pixels == 0 || g.cout == 0) return;
  const std::int64_t rows = g.n * g.oh, chunk = chunk_rows<C>(g);
  C* col = scratch<C>(kColSlot).get(chunk * g.ow * kdim);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t r1 = std::min(rows, r0 + chunk);
    blas_gemm(false, true, (r1 - r0) * g.ow, kdim, g.cout, grad_out + r0 * g.ow * g.cout, g.cout, w,
              g.cout, C(0), col, kdim);
    col2im_add(col, r0, r1, g, grad_x);
  }
}

template <typename C>
void conv_backward_weight(const C* x, const C* grad_out, C* grad_w, const Conv2dGeometry& g) {
  const std::int64_t pixels = g.oh * g.ow, kdim = g.kh * g.kw * g.c;
  const std::int64_t w_n = kdim * g.cout;
  if (w_n == 0) return;
  if (g.n == 0 || pixels == 0) return std::fill(grad_w, grad_w + w_n, C(0));
  if (use_direct(g)) return direct_backward_weight(x, grad_out, grad_w, g);
  if (is_pointwise(g))
    return blas_gemm(true, false, kdim, g.cout, g.n * pixels, x, kdim, grad_out, g.cout, C(0),
                     grad_w, g.cout);
  const std::int64_t rows = g.n * g.oh, chunk = chunk_rows<C>(g);
  C* col = scratch<C>(kColSlot).get(chunk * g.ow * kdim);
  for (std::int64_t r0 = 0; r0 < rows; r0 += chunk) {
    const std::int64_t r1 = std::min(rows, r0 + chunk);
    im2col(x, r0, r1, g, col);
    blas_gemm(true, false, kdim, g.cout, (r1 - r0) * g.ow, col, kdim, grad_out + r0 * g.ow * g.cout,
              g.cout, r0 == 0 ? C(0) : C(1), grad_w, g.cout);
  }
}

// --- 16-bit accumulation (Conv2dGeometry::low_precision_accumulation) ----------------
//
// Emulates convolution kernels whose accumulators are T (float16 or bfloat16): each
// output element starts at 0 and takes its terms one at a time,
//   acc = round_T(acc + a * b)
// with the product and the sum in float32 (the product of two float16 values is exact in
// float32, and so is that of two bfloat16 values within float32's range) and round_T
// rounding to nearest even like mixtape::half / mixtape::bfloat16. Taps over the
// padding are skipped (with finite operands their zero products would leave acc as is).
// Inputs arrive as float32 (bulk-converted); accumulators are float32 buffers holding
// T-representable values, rounded after each step through the bulk converters
// (float32 -> T -> float32, using the output as the T buffer). A step updates a set of
// accumulators that each get one term, then rounds a span covering them (rounding a
// value that is already a T changes nothing). The order of the terms of each element:
//   forward          out[i, oy, ox, co]:   taps (ky, kx, ci) in row-major order
//                                          (the im2col / GEMM reduction order)
//   backward weight  dw[ky, kx, ci, co]:   output pixels (i, oy, ox) in row-major order
//   backward input   dx[i, iy, ix, ci]:    output rows oy ascending, then kx ascending,
//                                          then co ascending (ky and ox follow from
//                                          oy and kx)
// Each runs on OpenMP threads over rows whose accumulators no other thread touches:
// output rows (forward), input rows (backward input), and (tap, input-channel block)
// rows of dw (backward weight).

// acc[0:len] += a * b[0:len].
inline void axpy(float* __restrict acc, float a, const float* __restrict b, std::int64_t len) {
  for (std::int64_t j = 0; j < len; ++j) acc[j] += a * b[j];
}

// acc[0:len] = float(T(acc[0:len])), with tmp (len T's) as the T copy.
template <typename T>
inline void round_span(float* acc, T* tmp, std::int64_t len) {
  convert(acc, tmp, len);
  convert(tmp, acc, len);
}

// The output positions o in [lo, hi) at which tap t of the window lands inside the input:
// 0 <= o * stride - pad + t < size, with 0 <= o < outs. Empty when lo >= hi.
inline TapRange out_range(std::int64_t t, std::int64_t stride, std::int64_t pad, std::int64_t size,
                          std::int64_t outs) {
  const std::int64_t first = pad - t, last = size - 1 + pad - t;  // bounds of o * stride
  const std::int64_t lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const std::int64_t hi = last < 0 ? 0 : std::min(outs, last / stride + 1);
  return {lo, hi};
}

template <typename T>
void conv_forward_acc16(const float* x, const float* w, T* out, const Conv2dGeometry& g) {
  const std::int64_t c = g.c, cout = g.cout, rows = g.n * g.oh, row_len = g.ow * cout;
  if (rows * row_len == 0) return;
  const bool par = rows * row_len * g.kh * g.kw * c > kParallelGrain && rows > 1;
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t r = 0; r < rows; ++r) {
    thread_local Scratch<float> acc_buf;
    float* acc = acc_buf.get(row_len);
    std::fill(acc, acc + row_len, 0.0f);
    T* o = out + r * row_len;
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
    for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
      const float* xrow = x + ((i * g.h) + oy * g.stride_h - g.pad_top + ky) * g.w * c;
      for (std::int64_t kx = 0; kx < g.kw; ++kx) {
        const TapRange ox = out_range(kx, g.stride_w, g.pad_left, g.w, g.ow);
        if (ox.lo >= ox.hi) continue;
        for (std::int64_t ci = 0; ci < c; ++ci) {
          const float* wr = w + ((ky * g.kw + kx) * c + ci) * cout;
          for (std::int64_t q = ox.lo; q < ox.hi; ++q)
            axpy(acc + q * cout, xrow[(q * g.stride_w - g.pad_left + kx) * c + ci], wr, cout);
          round_span(acc + ox.lo * cout, o + ox.lo * cout, (ox.hi - ox.lo) * cout);
        }
      }
    }
    convert(acc, o, row_len);
  }
}

template <typename T>
void conv_backward_input_acc16(const float* grad_out, const float* w, T* grad_x,
                               const Conv2dGeometry& g) {
  const std::int64_t c = g.c, cout = g.cout, taps = g.kh * g.kw;
  const std::int64_t rows = g.n * g.h, row_len = g.w * c;
  if (rows * row_len == 0) return;
  // w as [kh, kw, cout, c]: one output channel's weights over the input channels in a row.
  float* wt = scratch<float>(kColSlot).get(taps * cout * c);
  for (std::int64_t tap = 0; tap < taps; ++tap)
    for (std::int64_t ci = 0; ci < c; ++ci)
      for (std::int64_t co = 0; co < cout; ++co)
        wt[(tap * cout + co) * c + ci] = w[(tap * c + ci) * cout + co];
  const bool par = g.n * g.oh * g.ow * taps * c * cout > kParallelGrain && rows > 1;
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t r = 0; r < rows; ++r) {
    thread_local Scratch<float> acc_buf;
    float* acc = acc_buf.get(row_len);
    std::fill(acc, acc + row_len, 0.0f);
    T* o = grad_x + r * row_len;
    const std::int64_t i = r / g.h, iy = r % g.h;
    // Output rows whose window covers input row iy: ky = iy + pad_top - oy * stride_h is
    // in [0, kh).
    const std::int64_t first = iy + g.pad_top - g.kh + 1;
    const std::int64_t oy_lo = first <= 0 ? 0 : (first + g.stride_h - 1) / g.stride_h;
    const std::int64_t oy_hi = std::min(g.oh, (iy + g.pad_top) / g.stride_h + 1);
    for (std::int64_t oy = oy_lo; oy < oy_hi; ++oy) {
      const std::int64_t ky = iy + g.pad_top - oy * g.stride_h;
      const float* gorow = grad_out + (i * g.oh + oy) * g.ow * cout;
      for (std::int64_t kx = 0; kx < g.kw; ++kx) {
        const TapRange ox = out_range(kx, g.stride_w, g.pad_left, g.w, g.ow);
        if (ox.lo >= ox.hi) continue;
        const std::int64_t ix_lo = ox.lo * g.stride_w - g.pad_left + kx;
        const std::int64_t ix_end = (ox.hi - 1) * g.stride_w - g.pad_left + kx + 1;
        for (std::int64_t co = 0; co < cout; ++co) {
          const float* wr = wt + ((ky * g.kw + kx) * cout + co) * c;
          for (std::int64_t q = ox.lo; q < ox.hi; ++q)
            axpy(acc + (q * g.stride_w - g.pad_left + kx) * c, gorow[q * cout + co], wr, c);
          round_span(acc + ix_lo * c, o + ix_lo * c, (ix_end - ix_lo) * c);
        }
      }
    }
    convert(acc, o, row_len);
  }
}

template <typename T>
void conv_backward_weight_acc16(const float* x, const float* grad_out, T* grad_w,
                                const Conv2dGeometry& g) {
  const std::int64_t c = g.c, cout = g.cout, taps = g.kh * g.kw;
  if (taps * c * cout == 0) return;
  const int nt = threads_for(g.n * g.oh * g.ow * taps * c * cout);
  // Tasks: (tap, block of cb input channels), about four per thread.
  const std::int64_t splits = std::clamp<std::int64_t>((4 * nt + taps - 1) / taps, 1, c);
  const std::int64_t cb = (c + splits - 1) / splits, blocks = (c + cb - 1) / cb;
  const std::int64_t tasks = taps * blocks;
#pragma omp parallel for schedule(dynamic) num_threads(nt) if (nt > 1 && tasks > 1)
  for (std::int64_t t = 0; t < tasks; ++t) {
    const std::int64_t tap = t / blocks, ci0 = (t % blocks) * cb, cn = std::min(cb, c - ci0);
    const std::int64_t ky = tap / g.kw, kx = tap % g.kw, len = cn * cout;
    thread_local Scratch<float> acc_buf;
    float* acc = acc_buf.get(len);
    std::fill(acc, acc + len, 0.0f);
    T* o = grad_w + (tap * c + ci0) * cout;
    const TapRange oy = out_range(ky, g.stride_h, g.pad_top, g.h, g.oh);
    const TapRange ox = out_range(kx, g.stride_w, g.pad_left, g.w, g.ow);
    for (std::int64_t i = 0; i < g.n; ++i)
      for (std::int64_t py = oy.lo; py < oy.hi; ++py) {
        const std::int64_t iy = py * g.stride_h - g.pad_top + ky;
        for (std::int64_t px = ox.lo; px < ox.hi; ++px) {
          const std::int64_t ix = px * g.stride_w - g.pad_left + kx;
          const float* xs = x + ((i * g.h + iy) * g.w + ix) * c + ci0;
          const float* go = grad_out + ((i * g.oh + py) * g.ow + px) * cout;
          for (std::int64_t cj = 0; cj < cn; ++cj) axpy(acc + cj * cout, xs[cj], go, cout);
          round_span(acc, o, len);
        }
      }
    convert(acc, o, len);
  }
}

// --- Pooling on compute-type buffers --------------------------------------------------

// The max-pool order: v beats best when larger, and a NaN beats any number (so NaN
// propagates); ties keep the earlier element.
template <typename C>
inline bool beats(C v, C best) {
  // Non-short-circuit operators: no branch, so loops over it vectorise.
  return (v > best) | ((v != v) & (best == best));
}

template <typename C>
void max_pool_forward(const C* x, C* out, const Pool2dGeometry& g) {
  const std::int64_t c = g.c, rows = g.n * g.oh;
  const bool par = rows * g.ow * c * g.kh * g.kw > kParallelGrain && rows > 1;
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const C* img = x + i * g.h * g.w * c;
    const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      C* d = out + (r * g.ow + ox) * c;
      const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
      if (ty.lo >= ty.hi || tx.lo >= tx.hi) {  // the window is all padding
        std::fill(d, d + c, C(0));
        continue;
      }
      bool first = true;
      for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
        const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
        for (std::int64_t kx = tx.lo; kx < tx.hi; ++kx) {
          const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
          const C* s = img + (iy * g.w + ix) * c;
          if (first) {
            std::copy(s, s + c, d);
            first = false;
            continue;
          }
          // Branch-free so that it vectorises: d = beats(s, d) ? s : d.
          for (std::int64_t ch = 0; ch < c; ++ch) {
            const C v = s[ch], best = d[ch];
            d[ch] = beats(v, best) ? v : best;
          }
        }
      }
    }
  }
}

// Recomputes each window's argmax (first maximum, row-major over ky, kx) and adds the
// output gradient there. Windows may overlap, so threads split images and channel
// blocks, never output rows of one image.
template <typename C>
void max_pool_backward(const C* x, const C* grad_out, C* grad_x, const Pool2dGeometry& g) {
  const std::int64_t c = g.c;
  std::fill(grad_x, grad_x + g.n * g.h * g.w * c, C(0));
  if (c == 0) return;
  const int threads = max_threads();
  std::int64_t cblock = c;
  if (g.n < 2 * threads) cblock = std::max<std::int64_t>(16, (c + 2 * threads - 1) / (2 * threads));
  const std::int64_t blocks = (c + cblock - 1) / cblock, tasks = g.n * blocks;
  const bool par = g.n * g.oh * g.ow * c * g.kh * g.kw > kParallelGrain && tasks > 1;
#pragma omp parallel if (par)
  {
    thread_local Scratch<C> best_val;
    thread_local Scratch<std::int64_t> best_pos;
    C* bv = best_val.get(cblock);
    std::int64_t* bp = best_pos.get(cblock);
#pragma omp for schedule(static)
    for (std::int64_t t = 0; t < tasks; ++t) {
      const std::int64_t i = t / blocks, c0 = (t % blocks) * cblock;
      const std::int64_t cn = std::min(cblock, c - c0);
      const C* img = x + i * g.h * g.w * c + c0;
      C* gimg = grad_x + i * g.h * g.w * c + c0;
      for (std::int64_t oy = 0; oy < g.oh; ++oy) {
        const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
        for (std::int64_t ox = 0; ox < g.ow; ++ox) {
          const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
          if (ty.lo >= ty.hi || tx.lo >= tx.hi) continue;
          bool first = true;
          for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
            const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
            for (std::int64_t kx = tx.lo; kx < tx.hi; ++kx) {
              const std::int64_t pos = (iy * g.w + ox * g.stride_w - g.pad_left + kx) * c;
              const C* s = img + pos;
              if (first) {
                for (std::int64_t ch = 0; ch < cn; ++ch) {
                  bv[ch] = s[ch];
                  bp[ch] = pos;
                }
                first = false;
                continue;
              }
              for (std::int64_t ch = 0; ch < cn; ++ch) {
                if (beats(s[ch], bv[ch])) {
                  bv[ch] = s[ch];
                  bp[ch] = pos;
                }
              }
            }
          }
          const C* go = grad_out + ((i * g.oh + oy) * g.ow + ox) * c + c0;
          for (std::int64_t ch = 0; ch < cn; ++ch) gimg[bp[ch] + ch] += go[ch];
        }
      }
    }
  }
}

// Average pooling divides by the number of in-image taps of each window.
template <typename C>
void avg_pool_forward(const C* x, C* out, const Pool2dGeometry& g) {
  const std::int64_t c = g.c, rows = g.n * g.oh;
  const bool par = rows * g.ow * c * g.kh * g.kw > kParallelGrain && rows > 1;
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const C* img = x + i * g.h * g.w * c;
    const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      C* d = out + (r * g.ow + ox) * c;
      const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
      std::fill(d, d + c, C(0));
      const std::int64_t count = (ty.hi - ty.lo) * (tx.hi - tx.lo);
      if (count == 0) continue;
      for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
        const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
        const C* s = img + (iy * g.w + ox * g.stride_w - g.pad_left) * c;
        for (std::int64_t kx = tx.lo; kx < tx.hi; ++kx)
          for (std::int64_t ch = 0; ch < c; ++ch) d[ch] += s[kx * c + ch];
      }
      const C inv = C(1) / static_cast<C>(count);
      for (std::int64_t ch = 0; ch < c; ++ch) d[ch] *= inv;
    }
  }
}

// Each input pixel gathers grad_out / count from the windows that cover it.
template <typename C>
void avg_pool_backward(const C* grad_out, C* grad_x, const Pool2dGeometry& g) {
  const std::int64_t c = g.c, rows = g.n * g.h;
  const bool par = rows * g.w * c * g.kh * g.kw > kParallelGrain && rows > 1;
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t i = r / g.h, iy = r % g.h;
    C* dst_row = grad_x + r * g.w * c;
    std::fill(dst_row, dst_row + g.w * c, C(0));
    for (std::int64_t ky = 0; ky < g.kh; ++ky) {
      const std::int64_t ty = iy + g.pad_top - ky;
      if (ty < 0 || ty % g.stride_h != 0) continue;
      const std::int64_t oy = ty / g.stride_h;
      if (oy >= g.oh) continue;
      const TapRange wy = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
      const C* src_row = grad_out + (i * g.oh + oy) * g.ow * c;
      for (std::int64_t ix = 0; ix < g.w; ++ix) {
        C* d = dst_row + ix * c;
        for (std::int64_t kx = 0; kx < g.kw; ++kx) {
          const std::int64_t tx = ix + g.pad_left - kx;
          if (tx < 0 || tx % g.stride_w != 0) continue;
          const std::int64_t ox = tx / g.stride_w;
          if (ox >= g.ow) continue;
          const TapRange wx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
          const C inv = C(1) / static_cast<C>((wy.hi - wy.lo) * (wx.hi - wx.lo));
          const C* s = src_row + ox * c;
          for (std::int64_t ch = 0; ch < c; ++ch) d[ch] += s[ch] * inv;
        }
      }
    }
  }
}

// --- Kernels keyed on the storage dtype -------------------------------------------------

// The compute type of a storage type: float64 stays, everything else computes in float32.
template <typename T>
using compute_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <typename T>
constexpr bool kNative = std::is_same_v<T, compute_t<T>>;

// Input `slot` of the calling thread as a compute-type buffer: the tensor itself for
// float32 / float64, a bulk-converted float32 copy for float16 / bfloat16.
template <typename T>
const compute_t<T>* input(const Tensor& t, int slot) {
  const T* p = static_cast<const T*>(t.data_ptr());
  if constexpr (kNative<T>) {
    return p;
  } else {
    float* f = scratch<float>(slot).get(t.numel());
    convert(p, f, t.numel());
    return f;
  }
}
// The output buffer to compute into (the tensor itself, or a float32 scratch), and the
// step that stores it back.
template <typename T>
compute_t<T>* output(const Tensor& t, int slot) {
  if constexpr (kNative<T>) {
    return static_cast<T*>(t.data_ptr());
  } else {
    return scratch<float>(slot).get(t.numel());
  }
}
template <typename T>
void store(const compute_t<T>* buf, const Tensor& t) {
  if constexpr (!kNative<T>) convert(buf, static_cast<T*>(t.data_ptr()), t.numel());
}

template <typename T>
void conv2d(const Tensor& x, const Tensor& w, const Tensor& out, const Conv2dGeometry& g) {
  if constexpr (!kNative<T>) {
    if (g.low_precision_accumulation)
      return conv_forward_acc16(input<T>(x, 1), input<T>(w, 2), static_cast<T*>(out.data_ptr()), g);
  }
  if (onednn_conv2d(x, w, out, g)) return;
  conv_forward(input<T>(x, 1), input<T>(w, 2), static_cast<T*>(out.data_ptr()), g);
}

template <typename T>
void conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                           const Conv2dGeometry& g) {
  if constexpr (!kNative<T>) {
    if (g.low_precision_accumulation)
      return conv_backward_input_acc16(input<T>(grad_out, 1), input<T>(w, 2),
                                       static_cast<T*>(grad_x.data_ptr()), g);
  }
  if (onednn_conv2d_backward_input(grad_out, w, grad_x, g)) return;
  auto* o = output<T>(grad_x, 3);
  conv_backward_input(input<T>(grad_out, 1), input<T>(w, 2), o, g);
  store<T>(o, grad_x);
}

template <typename T>
void conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                            const Conv2dGeometry& g) {
  if constexpr (!kNative<T>) {
    if (g.low_precision_accumulation)
      return conv_backward_weight_acc16(input<T>(x, 1), input<T>(grad_out, 2),
                                        static_cast<T*>(grad_w.data_ptr()), g);
  }
  if (onednn_conv2d_backward_weight(x, grad_out, grad_w, g)) return;
  auto* o = output<T>(grad_w, 3);
  conv_backward_weight(input<T>(x, 1), input<T>(grad_out, 2), o, g);
  store<T>(o, grad_w);
}

template <typename T>
void max_pool2d(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  if (onednn_max_pool2d(x, out, g)) return;
  auto* o = output<T>(out, 3);
  max_pool_forward(input<T>(x, 1), o, g);
  store<T>(o, out);
}

template <typename T>
void max_pool2d_backward(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                         const Pool2dGeometry& g) {
  if (onednn_max_pool2d_backward(x, grad_out, grad_x, g)) return;
  auto* o = output<T>(grad_x, 3);
  max_pool_backward(input<T>(x, 1), input<T>(grad_out, 2), o, g);
  store<T>(o, grad_x);
}

template <typename T>
void avg_pool2d(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  if (onednn_avg_pool2d(x, out, g)) return;
  auto* o = output<T>(out, 3);
  avg_pool_forward(input<T>(x, 1), o, g);
  store<T>(o, out);
}

template <typename T>
void avg_pool2d_backward(const Tensor& /*x*/, const Tensor& grad_out, const Tensor& grad_x,
                         const Pool2dGeometry& g) {
  if (onednn_avg_pool2d_backward(grad_out, grad_x, g)) return;
  auto* o = output<T>(grad_x, 3);
  avg_pool_backward(input<T>(grad_out, 2), o, g);
  store<T>(o, grad_x);
}

}  // namespace

void register_conv_kernels() {
  constexpr auto cpu = DeviceType::CPU;
  register_op<OpId::conv2d>(cpu, []<DType::Code C>() { return &conv2d<element_t<C>>; });
  register_op<OpId::conv2d_backward_input>(
      cpu, []<DType::Code C>() { return &conv2d_backward_input<element_t<C>>; });
  register_op<OpId::conv2d_backward_weight>(
      cpu, []<DType::Code C>() { return &conv2d_backward_weight<element_t<C>>; });
  register_op<OpId::max_pool2d>(cpu, []<DType::Code C>() { return &max_pool2d<element_t<C>>; });
  register_op<OpId::max_pool2d_backward>(
      cpu, []<DType::Code C>() { return &max_pool2d_backward<element_t<C>>; });
  register_op<OpId::avg_pool2d>(cpu, []<DType::Code C>() { return &avg_pool2d<element_t<C>>; });
  register_op<OpId::avg_pool2d_backward>(
      cpu, []<DType::Code C>() { return &avg_pool2d_backward<element_t<C>>; });
}

}  // namespace mixtape::cpu
