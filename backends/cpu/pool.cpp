// CPU pooling kernels (NHWC): max and average pooling, forward and backward, for float32,
// float64, float16 and bfloat16. Padded positions are ignored: they never win a max and
// are not counted in an average. float16 and bfloat16 run on float32 copies (rounded
// once); float32 and bfloat16 go to oneDNN first when it takes them (onednn.cpp).
#include <algorithm>
#include <cstdint>

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

void register_pool_kernels() {
  constexpr auto cpu = DeviceType::CPU;
  register_op<OpId::max_pool2d>(cpu, []<DType::Code C>() { return &max_pool2d<element_t<C>>; });
  register_op<OpId::max_pool2d_backward>(
      cpu, []<DType::Code C>() { return &max_pool2d_backward<element_t<C>>; });
  register_op<OpId::avg_pool2d>(cpu, []<DType::Code C>() { return &avg_pool2d<element_t<C>>; });
  register_op<OpId::avg_pool2d_backward>(
      cpu, []<DType::Code C>() { return &avg_pool2d_backward<element_t<C>>; });
}

}  // namespace mixtape::cpu
