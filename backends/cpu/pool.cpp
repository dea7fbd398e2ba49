// CPU pooling kernels (NHWC): max and average pooling, forward and backward, for float32,
// float64, float16 and bfloat16. Padded positions are ignored: they never win a max and
// are not counted in an average. Max pooling's forward pass, and its backward pass where
// windows do not overlap, run on the stored elements (below: no float32 copies). The
// others run float16 and bfloat16 on float32 copies (rounded once), and go to oneDNN first
// when it takes them (onednn.cpp).
#include <algorithm>
#include <cstdint>
#include <limits>

#include "backends/cpu/gemm_util.h"

namespace mixtape::cpu {
namespace {

// The max-pool order: v beats best when larger, and a NaN beats any number (so NaN
// propagates); ties keep the earlier element.
template <typename C>
inline bool beats(C v, C best) {
  // Non-short-circuit operators: no branch, so loops over it vectorise.
  return (v > best) | ((v != v) & (best == best));
}

// The taps a pass's windows hold over `rows` rows of `cols` windows of c channels: the work by
// which it decides to run on threads, saturating at the int64 maximum (a 2^40 x 2^40 window is
// a valid one, and its taps times the windows would overflow).
std::int64_t window_work(std::int64_t rows, std::int64_t cols, std::int64_t c,
                         const Pool2dGeometry& g) {
  return try_numel(Shape{rows, cols, c, g.kh, g.kw})
      .value_or(std::numeric_limits<std::int64_t>::max());
}

// Recomputes each window's argmax (first maximum, row-major over ky, kx) and adds the
// output gradient there. Windows may overlap, so threads split images and channel
// blocks, never output rows of one image. (Windows that do not overlap: the loops on the
// stored elements below.)
template <typename C>
void max_pool_backward(const C* x, const C* grad_out, C* grad_x, const Pool2dGeometry& g) {
  const std::int64_t c = g.c;
  std::fill(grad_x, grad_x + g.n * g.h * g.w * c, C(0));
  if (c == 0) return;
  const int threads = max_threads();
  std::int64_t cblock = c;
  if (g.n < 2 * threads) cblock = std::max<std::int64_t>(16, (c + 2 * threads - 1) / (2 * threads));
  const std::int64_t blocks = (c + cblock - 1) / cblock, tasks = g.n * blocks;
  const bool par = window_work(g.n * g.oh, g.ow, c, g) > kParallelGrain && tasks > 1;
  parallel_region(par, [&] {
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
  });
}

// --- Max pooling on the stored elements ------------------------------------------------
//
// Max pooling only selects elements, so these loops run on the tensors as stored: float32
// and float64 compare as themselves, float16 and bfloat16 as their bits (MaxOrder below),
// with no float32 copies. They vectorise across the channels (NHWC) and come also compiled
// for AVX2 and AVX-512BW. The backward pass here is for windows that do not overlap (stride
// >= window along both axes): each input then gets the gradient of at most one window,
// a copy or a zero. Overlapping windows sum several gradients and take oneDNN or the loops
// above.
//
// Written here rather than taken from oneDNN: oneDNN's max skips NaNs and starts from
// -FLT_MAX, so its results differ where a window holds a NaN or only -inf, and calling it
// needed a scan of the input for those first (and a rerun of its forward pass in the
// backward, for the argmax workspace); float16 it has only on AVX512-FP16 CPUs. Measured on
// the MNIST cnn's pools (docs/benchmarks.md): as fast as oneDNN with its scan or faster,
// every dtype.

// How max pooling compares and passes on elements stored as T.
template <typename T>
struct MaxOrder {  // float32, float64
  using S = T;     // what the loops load and store
  using Index = std::conditional_t<sizeof(T) == 4, std::int32_t, std::int64_t>;  // a tap
  // beats() above: a NaN beats any number, a number beats a smaller one.
  MIXTAPE_ALWAYS_INLINE static bool beats(S v, S best) { return cpu::beats(v, best); }
  MIXTAPE_ALWAYS_INLINE static S result(S v) { return v; }
  // The gradient a winner gets: what adding it to a zeroed gradient gives (-0 becomes +0).
  MIXTAPE_ALWAYS_INLINE static S grad(S g) { return S(0) + g; }
};
template <typename T>
requires kReduced<T>
struct MaxOrder<T> {  // float16, bfloat16: their bits as signed 16-bit integers
  using S = std::int16_t;
  using Index = std::int16_t;
  static constexpr Bits16 k = kBits16Of<T>;
  // Sign and magnitude to an integer that orders as the value does (+0 and -0 both 0).
  MIXTAPE_ALWAYS_INLINE static std::int16_t key(S v) {
    const auto m = static_cast<std::int16_t>(v & 0x7FFF);
    return v < 0 ? static_cast<std::int16_t>(-m) : m;
  }
  MIXTAPE_ALWAYS_INLINE static bool beats(S v, S best) {
    return (k.is_nan(v) | (key(v) > key(best))) & !k.is_nan(best);
  }
  // What the float32 loops gave: NaNs come back quiet, -0 + gradient is +0.
  MIXTAPE_ALWAYS_INLINE static S result(S v) { return k.quieted(v); }
  MIXTAPE_ALWAYS_INLINE static S grad(S g) {
    return g == static_cast<S>(0x8000) ? S(0) : k.quieted(g);
  }
};

// What the loops below load and store for T, and their tap index.
template <typename T>
using Stored = typename MaxOrder<T>::S;
template <typename T>
using Tap = typename MaxOrder<T>::Index;

// Output row r (image r / oh, output row r % oh) of the forward pass. kC: the channel count
// when known at compile time (0: g.c).
template <typename T, std::int64_t kC>
MIXTAPE_ALWAYS_INLINE void max_forward_row(const Stored<T>* x, Stored<T>* out,
                                           const Pool2dGeometry& g, std::int64_t r) {
  using O = MaxOrder<T>;
  using S = typename O::S;
  const std::int64_t c = kC ? kC : g.c, i = r / g.oh, oy = r % g.oh;
  const S* img = x + i * g.h * g.w * c;
  const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
  for (std::int64_t ox = 0; ox < g.ow; ++ox) {
    S* d = out + (r * g.ow + ox) * c;
    const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
    if (ty.lo >= ty.hi || tx.lo >= tx.hi) {  // the window is all padding
      std::fill(d, d + c, S(0));
      continue;
    }
    const S* base = img + ((oy * g.stride_h - g.pad_top) * g.w + ox * g.stride_w - g.pad_left) * c;
    const S* first = base + (ty.lo * g.w + tx.lo) * c;
#pragma omp simd
    for (std::int64_t ch = 0; ch < c; ++ch) d[ch] = first[ch];
    for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky)
      for (std::int64_t kx = ky == ty.lo ? tx.lo + 1 : tx.lo; kx < tx.hi; ++kx) {
        const S* s = base + (ky * g.w + kx) * c;
#pragma omp simd
        for (std::int64_t ch = 0; ch < c; ++ch) d[ch] = O::beats(s[ch], d[ch]) ? s[ch] : d[ch];
      }
    if constexpr (kReduced<T>) {
#pragma omp simd
      for (std::int64_t ch = 0; ch < c; ++ch) d[ch] = O::result(d[ch]);
    }
  }
}

// Output row r of the backward pass for windows that do not overlap: each window's
// gradient at its argmax and zeros at its other taps, and zeros in the input rows and
// columns this output row owns that no window covers (its rows: from its window's first
// row to the next one's, the last taking the rest). best / arg: c elements of scratch.
template <typename T, std::int64_t kC>
MIXTAPE_ALWAYS_INLINE void max_backward_row(const Stored<T>* x, const Stored<T>* grad_out,
                                            Stored<T>* grad_x, const Pool2dGeometry& g,
                                            std::int64_t r, Stored<T>* best, Tap<T>* arg) {
  using O = MaxOrder<T>;
  using S = typename O::S;
  using Index = typename O::Index;
  // A known channel count: the window's running maximum and argmax on the stack.
  alignas(64) S best_here[kC ? kC : 1];
  alignas(64) Index arg_here[kC ? kC : 1];
  if constexpr (kC != 0) {
    best = best_here;
    arg = arg_here;
  }
  const std::int64_t c = kC ? kC : g.c, i = r / g.oh, oy = r % g.oh;
  const S* img = x + i * g.h * g.w * c;
  S* gimg = grad_x + i * g.h * g.w * c;
  const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
  const auto row_start = [&](std::int64_t o) {
    return std::clamp<std::int64_t>(o * g.stride_h - g.pad_top, 0, g.h);
  };
  const std::int64_t y0 = oy == 0 ? 0 : row_start(oy),
                     y1 = oy == g.oh - 1 ? g.h : row_start(oy + 1);
  const std::int64_t wy0 = oy * g.stride_h - g.pad_top + ty.lo, wy1 = wy0 + (ty.hi - ty.lo);
  for (std::int64_t iy = y0; iy < y1; ++iy) {
    S* row = gimg + iy * g.w * c;
    if (iy < wy0 || iy >= wy1) {  // a row no window of this output row covers
      std::fill(row, row + g.w * c, S(0));
      continue;
    }
    std::int64_t done = 0;  // the columns before it are written or covered
    for (std::int64_t ox = 0; ox < g.ow; ++ox) {
      const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
      if (tx.lo >= tx.hi) continue;
      const std::int64_t start = ox * g.stride_w - g.pad_left + tx.lo;
      std::fill(row + done * c, row + start * c, S(0));
      done = start + (tx.hi - tx.lo);
    }
    std::fill(row + done * c, row + g.w * c, S(0));
  }
  if (ty.lo >= ty.hi) return;
  for (std::int64_t ox = 0; ox < g.ow; ++ox) {
    const TapRange tx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
    if (tx.lo >= tx.hi) continue;
    const std::int64_t offset =
        ((oy * g.stride_h - g.pad_top) * g.w + ox * g.stride_w - g.pad_left) * c;
    const S* base = img + offset;
    S* gbase = gimg + offset;
    const S* go = grad_out + (r * g.ow + ox) * c;
    const S* first = base + (ty.lo * g.w + tx.lo) * c;
#pragma omp simd
    for (std::int64_t ch = 0; ch < c; ++ch) {
      best[ch] = first[ch];
      arg[ch] = 0;
    }
    Index t = 0;  // the window's taps in row-major order
    for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky)
      for (std::int64_t kx = tx.lo; kx < tx.hi; ++kx, ++t) {
        if (t == 0) continue;
        const S* s = base + (ky * g.w + kx) * c;
#pragma omp simd
        for (std::int64_t ch = 0; ch < c; ++ch) {
          const S v = s[ch], b = best[ch];
          const Index a = arg[ch];
          const bool take = O::beats(v, b);
          best[ch] = take ? v : b;
          arg[ch] = take ? t : a;
        }
      }
    t = 0;
    for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky)
      for (std::int64_t kx = tx.lo; kx < tx.hi; ++kx, ++t) {
        S* d = gbase + (ky * g.w + kx) * c;
#pragma omp simd
        for (std::int64_t ch = 0; ch < c; ++ch) d[ch] = arg[ch] == t ? O::grad(go[ch]) : S(0);
      }
  }
}

// The rows above for the baseline, AVX2 and AVX-512BW, and the pick for this CPU. The
// common channel counts get loops of a known length (16, 32 or 64 channels are one to a
// few vectors: the loop set-up for a runtime count cost more than the work).
#define MIXTAPE_MAX_POOL_ROWS(suffix, attributes)                                       \
  template <typename T>                                                                 \
  attributes void max_forward_##suffix(const Stored<T>* x, Stored<T>* out,              \
                                       const Pool2dGeometry& g, std::int64_t r) {       \
    switch (g.c) {                                                                      \
      case 16:                                                                          \
        return max_forward_row<T, 16>(x, out, g, r);                                    \
      case 32:                                                                          \
        return max_forward_row<T, 32>(x, out, g, r);                                    \
      case 64:                                                                          \
        return max_forward_row<T, 64>(x, out, g, r);                                    \
      default:                                                                          \
        return max_forward_row<T, 0>(x, out, g, r);                                     \
    }                                                                                   \
  }                                                                                     \
  template <typename T>                                                                 \
  attributes void max_backward_##suffix(const Stored<T>* x, const Stored<T>* grad_out,  \
                                        Stored<T>* grad_x, const Pool2dGeometry& g,     \
                                        std::int64_t r, Stored<T>* best, Tap<T>* arg) { \
    switch (g.c) {                                                                      \
      case 16:                                                                          \
        return max_backward_row<T, 16>(x, grad_out, grad_x, g, r, best, arg);           \
      case 32:                                                                          \
        return max_backward_row<T, 32>(x, grad_out, grad_x, g, r, best, arg);           \
      case 64:                                                                          \
        return max_backward_row<T, 64>(x, grad_out, grad_x, g, r, best, arg);           \
      default:                                                                          \
        return max_backward_row<T, 0>(x, grad_out, grad_x, g, r, best, arg);            \
    }                                                                                   \
  }
MIXTAPE_MAX_POOL_ROWS(base, )
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
MIXTAPE_MAX_POOL_ROWS(avx2, __attribute__((target("avx2"))))
MIXTAPE_MAX_POOL_ROWS(avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
#endif
#undef MIXTAPE_MAX_POOL_ROWS
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
#define MIXTAPE_PICK_ISA(fn)                          \
  (has_avx512bw()                   ? &fn##_avx512<T> \
   : __builtin_cpu_supports("avx2") ? &fn##_avx2<T>   \
                                    : &fn##_base<T>)
#else
#define MIXTAPE_PICK_ISA(fn) (&fn##_base<T>)
#endif

template <typename T>
void max_pool_forward_stored(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  using S = typename MaxOrder<T>::S;
  static const auto row = MIXTAPE_PICK_ISA(max_forward);
  const auto* px = static_cast<const S*>(x.const_data_ptr());
  auto* po = static_cast<S*>(out.data_ptr());
  const std::int64_t rows = g.n * g.oh;
  parallel_rows(rows, window_work(rows, g.ow, g.c, g), [&](std::int64_t r) { row(px, po, g, r); });
}

// Whether max_pool_backward_stored takes g: windows that do not overlap, few enough taps
// for a 16-bit tap index (kh * kw <= 32767, without forming a product that may overflow).
bool separate_windows(const Pool2dGeometry& g) {
  return g.stride_h >= g.kh && g.stride_w >= g.kw && g.kh <= 32767 && g.kw <= 32767 / g.kh;
}

template <typename T>
void max_pool_backward_stored(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                              const Pool2dGeometry& g) {
  using S = typename MaxOrder<T>::S;
  using Index = typename MaxOrder<T>::Index;
  static const auto row = MIXTAPE_PICK_ISA(max_backward);
  const auto* px = static_cast<const S*>(x.const_data_ptr());
  const auto* pg = static_cast<const S*>(grad_out.const_data_ptr());
  auto* pgx = static_cast<S*>(grad_x.data_ptr());
  const std::int64_t rows = g.n * g.oh;
  if (rows == 0 || g.ow == 0) {  // no window: every gradient is 0
    std::fill(pgx, pgx + grad_x.numel(), S(0));
    return;
  }
  const bool par = g.n * g.h * g.w * g.c > kParallelGrain && rows > 1;
  parallel_region(par, [&] {
    thread_local Scratch<S> best_scratch;
    thread_local Scratch<Index> arg_scratch;
    S* best = best_scratch.get(g.c);
    Index* arg = arg_scratch.get(g.c);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) row(px, pg, pgx, g, r, best, arg);
  });
}
#undef MIXTAPE_PICK_ISA

// Average pooling divides by the number of in-image taps of each window.
template <typename C>
void avg_pool_forward(const C* x, C* out, const Pool2dGeometry& g) {
  const std::int64_t c = g.c, rows = g.n * g.oh;
  parallel_rows(rows, window_work(rows, g.ow, c, g), [&](std::int64_t r) {
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
  });
}

// Each input pixel gathers grad_out / count from the windows that cover it.
template <typename C>
void avg_pool_backward(const C* grad_out, C* grad_x, const Pool2dGeometry& g) {
  const std::int64_t c = g.c, rows = g.n * g.h;
  parallel_rows(rows, window_work(rows, g.w, c, g), [&](std::int64_t r) {
    const std::int64_t i = r / g.h, iy = r % g.h;
    C* dst_row = grad_x + r * g.w * c;
    std::fill(dst_row, dst_row + g.w * c, C(0));
    for_each_cover(iy, g.stride_h, g.pad_top, g.kh, g.h, g.oh, [&](std::int64_t oy, TapRange wy) {
      const C* src_row = grad_out + (i * g.oh + oy) * g.ow * c;
      for (std::int64_t ix = 0; ix < g.w; ++ix) {
        C* d = dst_row + ix * c;
        for_each_cover(ix, g.stride_w, g.pad_left, g.kw, g.w, g.ow,
                       [&](std::int64_t ox, TapRange wx) {
                         const C inv = C(1) / static_cast<C>((wy.hi - wy.lo) * (wx.hi - wx.lo));
                         const C* s = src_row + ox * c;
                         for (std::int64_t ch = 0; ch < c; ++ch) d[ch] += s[ch] * inv;
                       });
      }
    });
  });
}

// --- Kernels keyed on the storage dtype -------------------------------------------------

template <typename T>
void max_pool2d(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  max_pool_forward_stored<T>(x, out, g);
}

// Windows that do not overlap: the loops on the stored elements (see above). Overlapping
// windows sum several gradients per input: oneDNN where it takes them, else the float32
// loops above.
template <typename T>
void max_pool2d_backward(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                         const Pool2dGeometry& g) {
  if (separate_windows(g)) return max_pool_backward_stored<T>(x, grad_out, grad_x, g);
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

void register_pool_kernels() {
  MIXTAPE_CPU_KERNEL(max_pool2d, max_pool2d);
  MIXTAPE_CPU_KERNEL(max_pool2d_backward, max_pool2d_backward);
  MIXTAPE_CPU_KERNEL(avg_pool2d, avg_pool2d);
  MIXTAPE_CPU_KERNEL(avg_pool2d_backward, avg_pool2d_backward);
}

}  // namespace mixtape::cpu
