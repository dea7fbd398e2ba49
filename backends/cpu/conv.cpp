// CPU convolution kernels (NHWC input, HWIO filter), for float32, float64, float16 and
// bfloat16.
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
// rounded back; float64 computes in float64 (dgemm). float32 and bfloat16 go to oneDNN
// first when it takes them (onednn.cpp). With Conv2dGeometry::low_precision_accumulation
// (MIXTAPE_FP16_USE_FP32_COMPUTE=0) the float16 / bfloat16 kernels instead emulate
// accumulation in the 16-bit type (acc16.cpp). Pooling is pool.cpp's.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends/cpu/gemm_util.h"

namespace mixtape::cpu {
namespace {

// The column buffer holds at most this many bytes (but at least one output row): small
// enough to stay in cache between im2col and the GEMM that reads it.
constexpr std::int64_t kColBytes = std::int64_t{4} << 20;

// --- im2col / col2im -----------------------------------------------------------------
//
// Work is split into chunks of output rows: row r = i * oh + oy is output row oy of image
// i, holding ow output pixels. im2col / col2im run on the calling thread: an OpenMP region
// right before or after an OpenBLAS call leaves OpenMP workers spinning on the cores
// OpenBLAS's threads need, which costs more than the copy itself.

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

#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
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
#endif

template <typename C>
using ForwardRowsFn = void (*)(const C*, const C*, C*, const Conv2dGeometry&, std::int64_t,
                               std::int64_t);
template <typename C>
using WeightRowsFn = void (*)(const C*, const C*, C*, const Conv2dGeometry&, std::int64_t,
                              std::int64_t);

template <typename C>
ForwardRowsFn<C> forward_rows_fn() {
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) return &direct_forward_rows_avx2<C>;
#endif
  return &direct_forward_rows<C>;
}
template <typename C>
WeightRowsFn<C> weight_rows_fn() {
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) return &direct_weight_rows_avx2<C>;
#endif
  return &direct_weight_rows<C>;
}

inline bool use_direct(const Conv2dGeometry& g) { return g.kh * g.kw * g.c <= kDirectMaxTaps; }

// Thread t of nt takes output rows [lo, hi).
inline void split_rows(std::int64_t rows, int t, int nt, std::int64_t& lo, std::int64_t& hi) {
  lo = rows * t / nt;
  hi = rows * (t + 1) / nt;
}

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

// p[r * cout + j] += bias[j] for `pixels` rows of cout values (nothing when bias is null):
// the forward pass's bias, added to the compute-type result before it is stored.
template <typename C>
void add_bias(C* p, const C* bias, std::int64_t pixels, std::int64_t cout) {
  if (!bias) return;
  for (std::int64_t r = 0; r < pixels; ++r) {
    C* q = p + r * cout;
#pragma omp simd
    for (std::int64_t j = 0; j < cout; ++j) q[j] += bias[j];
  }
}

// O is the output's storage type: C, or float16 / bfloat16 for a float32 computation, in
// which case each thread converts its rows a few at a time while they are in cache.
template <typename C, typename O>
void direct_forward(const C* x, const C* w, const C* bias, O* out, const Conv2dGeometry& g) {
  const ForwardRowsFn<C> fn = forward_rows_fn<C>();
  const std::int64_t rows = g.n * g.oh, row_len = g.ow * g.cout;
  const int nt = threads_for(rows * g.ow * g.cout * g.kh * g.kw * g.c);
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    std::int64_t lo, hi;
    split_rows(rows, thread_num(), team_size(), lo, hi);
    if constexpr (std::is_same_v<O, C>) {
      fn(x, w, out + lo * row_len, g, lo, hi);
      add_bias(out + lo * row_len, bias, (hi - lo) * g.ow, g.cout);
    } else {
      thread_local Scratch<C> buf;
      // Rows per conversion: about 8192 elements, within L1/L2.
      const std::int64_t block =
          std::max<std::int64_t>(1, 8192 / std::max<std::int64_t>(row_len, 1));
      C* b = buf.get(block * row_len);
      for (std::int64_t r = lo; r < hi; r += block) {
        const std::int64_t re = std::min(hi, r + block);
        fn(x, w, b, g, r, re);
        add_bias(b, bias, (re - r) * g.ow, g.cout);
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
void conv_forward(const C* x, const C* w, const C* bias, O* out, const Conv2dGeometry& g) {
  constexpr bool kSame = std::is_same_v<O, C>;
  const std::int64_t pixels = g.oh * g.ow, kdim = g.kh * g.kw * g.c;
  const std::int64_t out_n = g.n * pixels * g.cout;
  if (out_n == 0) return;
  if (kdim == 0) {  // no terms: the bias alone
    std::vector<O> row(static_cast<std::size_t>(g.cout), O(0.0f));
    if constexpr (kSame) {
      if (bias) std::copy(bias, bias + g.cout, row.begin());
    } else {
      if (bias) convert(bias, row.data(), g.cout);
    }
    for (std::int64_t p = 0; p < g.n * pixels; ++p)
      std::copy(row.begin(), row.end(), out + p * g.cout);
    return;
  }
  if (use_direct(g)) return direct_forward(x, w, bias, out, g);
  const bool pointwise = is_pointwise(g);
  if constexpr (kSame) {
    if (pointwise) {
      blas_gemm(false, false, g.n * pixels, g.cout, kdim, x, kdim, w, g.cout, C(0), out, g.cout);
      return add_bias(out, bias, g.n * pixels, g.cout);
    }
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
      add_bias(dst, bias, (r1 - r0) * g.ow, g.cout);
    } else {
      blas_gemm(false, false, (r1 - r0) * g.ow, g.cout, kdim, a, kdim, w, g.cout, C(0), tmp,
                g.cout);
      add_bias(tmp, bias, (r1 - r0) * g.ow, g.cout);
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

// --- Kernels keyed on the storage dtype -------------------------------------------------

template <typename T>
void conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
            const Conv2dGeometry& g) {
  if constexpr (!kNative<T>) {
    if (g.low_precision_accumulation)
      return conv_forward_acc16(input<T>(x, 1), input<T>(w, 2),
                                bias.defined() ? input<T>(bias, 3) : nullptr,
                                static_cast<T*>(out.data_ptr()), g);
  }
  if (onednn_conv2d(x, w, bias, out, g)) return;
  conv_forward(input<T>(x, 1), input<T>(w, 2), bias.defined() ? input<T>(bias, 3) : nullptr,
               static_cast<T*>(out.data_ptr()), g);
}

// A backward pass of conv2d on T, from its inputs a and b into out: the 16-bit accumulation
// emulation acc16 where the geometry asks for it (float16, bfloat16), else oneDNN where it
// takes the pass, else the loops (on the compute type: float32 copies for the 16-bit types).
template <typename T, typename Acc16, typename Onednn, typename Loops>
void conv2d_backward(const Tensor& a, const Tensor& b, const Tensor& out, const Conv2dGeometry& g,
                     Acc16 acc16, Onednn onednn, Loops loops) {
  if constexpr (!kNative<T>) {
    if (g.low_precision_accumulation)
      return acc16(input<T>(a, 1), input<T>(b, 2), static_cast<T*>(out.data_ptr()), g);
  }
  if (onednn(a, b, out, g)) return;
  auto* o = output<T>(out, 3);
  loops(input<T>(a, 1), input<T>(b, 2), o, g);
  store<T>(o, out);
}

template <typename T>
void conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                           const Conv2dGeometry& g) {
  conv2d_backward<T>(
      grad_out, w, grad_x, g, [](auto... p) { conv_backward_input_acc16<T>(p...); },
      &onednn_conv2d_backward_input, [](auto... p) { conv_backward_input(p...); });
}

template <typename T>
void conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                            const Conv2dGeometry& g) {
  conv2d_backward<T>(
      x, grad_out, grad_w, g, [](auto... p) { conv_backward_weight_acc16<T>(p...); },
      &onednn_conv2d_backward_weight, [](auto... p) { conv_backward_weight(p...); });
}

}  // namespace

void register_conv_kernels() {
  MIXTAPE_CPU_KERNEL(conv2d, conv2d);
  MIXTAPE_CPU_KERNEL(conv2d_backward_input, conv2d_backward_input);
  MIXTAPE_CPU_KERNEL(conv2d_backward_weight, conv2d_backward_weight);
}

}  // namespace mixtape::cpu
