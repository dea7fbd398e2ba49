// CUDA kernels: max / average pooling over NHWC windows and their backward, for float32,
// float16, bfloat16 and float64 (kernels::Pool2dFn / Pool2dBackwardFn).
//
// Own kernels rather than cuDNN's pooling, whose tie, NaN and padding rules differ; these
// follow the CPU backend (backends/cpu/conv.cpp) exactly, and in the same order of
// operations, so the two agree bit for bit:
//   - padded positions never win a max and are not counted in an average; a window that is
//     all padding gives 0;
//   - a max takes the first maximum in row-major (ky, kx) order, and a NaN beats any number
//     (so NaN propagates, the first NaN winning);
//   - the max backward sends each window's gradient to that first maximum;
//   - the average multiplies the window's sum by 1 / count (count = in-image taps).
// The 16-bit types compute in float32 and round once at the end, float64 in float64.
//
// Both backward kernels are gathers, one thread per input element, adding the windows that
// cover it in the CPU's order: no atomics (windows overlap), deterministic results. The
// max backward recomputes the argmax of each covering window (kh * kw work per window).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_math.cuh"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/window.cuh"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cuda_backend {
namespace {

using kernels::Pool2dGeometry;
using std::int64_t;

// The max-pool order: v beats best when larger, and a NaN beats any number.
template <typename C>
__device__ __forceinline__ bool beats(C v, C best) {
  return v > best || (v != v && best == best);
}

// f(iy, ix, v) over the in-image taps (ky in ry, kx in rx: row-major) of the window at output
// position (oy, ox); v is the element of `img` (one image, offset to its channel) at (iy, ix).
template <typename T, typename F>
__device__ __forceinline__ void for_each_tap(const T* img, int64_t oy, int64_t ox, Range ry,
                                             Range rx, const Pool2dGeometry& g, F f) {
  for (int64_t ky = ry.lo; ky < ry.hi; ++ky) {
    const int64_t iy = oy * g.stride_h - g.pad_top + ky;
    for (int64_t kx = rx.lo; kx < rx.hi; ++kx) {
      const int64_t ix = ox * g.stride_w - g.pad_left + kx;
      f(iy, ix, load(img[(iy * g.w + ix) * g.c]));
    }
  }
}

// f(idx, o, ry, rx, img) for each output element idx of x's pooling, o its position, ry and
// rx the in-image taps of its window, img x's image of o offset to o's channel.
template <typename T, typename F>
__device__ __forceinline__ void for_each_window(const T* x, const Pool2dGeometry& g, F&& f) {
  for_each_position(g.n, g.oh, g.ow, g.c, [&](int64_t idx, Pos o) {
    const Range ry = tap_range(o.y, g.stride_h, g.pad_top, g.kh, g.h);
    const Range rx = tap_range(o.x, g.stride_w, g.pad_left, g.kw, g.w);
    f(idx, o, ry, rx, x + o.i * g.h * g.w * g.c + o.ch);
  });
}

template <typename T>
__global__ void max_pool_kernel(const T* __restrict__ x, T* __restrict__ out, Pool2dGeometry g) {
  using C = compute_of<T>;
  for_each_window(x, g, [&](int64_t idx, Pos o, Range ry, Range rx, const T* img) {
    C best = C(0);  // a window of padding only gives 0
    bool first = true;
    for_each_tap(img, o.y, o.x, ry, rx, g, [&](int64_t, int64_t, C v) {
      if (first || beats(v, best)) best = v;
      first = false;
    });
    out[idx] = store<T>(best);
  });
}

// Each input element adds the gradients of the windows (row-major over (oy, ox)) whose first
// maximum it is.
template <typename T>
__global__ void max_pool_backward_kernel(const T* __restrict__ x, const T* __restrict__ grad_out,
                                         T* __restrict__ grad_x, Pool2dGeometry g) {
  using C = compute_of<T>;
  for_each_position(g.n, g.h, g.w, g.c, [&](int64_t idx, Pos p) {
    const Range wy = covering(p.y, g.stride_h, g.pad_top, g.kh, g.oh);
    const Range wx = covering(p.x, g.stride_w, g.pad_left, g.kw, g.ow);
    const T* img = x + p.i * g.h * g.w * g.c + p.ch;
    C acc = C(0);
    for (int64_t oy = wy.lo; oy < wy.hi; ++oy) {
      const Range ry = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
      for (int64_t ox = wx.lo; ox < wx.hi; ++ox) {
        const Range rx = tap_range(ox, g.stride_w, g.pad_left, g.kw, g.w);
        // The window's first maximum (it covers p, so it has at least one in-image tap).
        C best = C(0);
        int64_t best_y = -1, best_x = -1;
        for_each_tap(img, oy, ox, ry, rx, g, [&](int64_t iy, int64_t ix, C v) {
          if (best_y < 0 || beats(v, best)) {
            best = v;
            best_y = iy;
            best_x = ix;
          }
        });
        if (best_y == p.y && best_x == p.x)
          acc = acc + load(grad_out[((p.i * g.oh + oy) * g.ow + ox) * g.c + p.ch]);
      }
    }
    grad_x[idx] = store<T>(acc);
  });
}

// out = (sum of the in-image taps, row-major) * (1 / count).
template <typename T>
__global__ void avg_pool_kernel(const T* __restrict__ x, T* __restrict__ out, Pool2dGeometry g) {
  using C = compute_of<T>;
  for_each_window(x, g, [&](int64_t idx, Pos o, Range ry, Range rx, const T* img) {
    C sum = C(0);
    for_each_tap(img, o.y, o.x, ry, rx, g, [&](int64_t, int64_t, C v) { sum = sum + v; });
    const int64_t count = (ry.hi - ry.lo) * (rx.hi - rx.lo);
    // Separate roundings of the reciprocal and the product (no fused operations), as the CPU
    // computes them.
    C value = C(0);
    if (count > 0) {
      if constexpr (std::is_same_v<C, double>)
        value = __dmul_rn(sum, __ddiv_rn(1.0, static_cast<double>(count)));
      else
        value = __fmul_rn(sum, __fdiv_rn(1.0f, static_cast<float>(count)));
    }
    out[idx] = store<T>(value);
  });
}

// Each input element adds grad_out * (1 / count) of the windows covering it, over ky
// ascending, then kx ascending (the CPU's order: output positions descending).
template <typename T>
__global__ void avg_pool_backward_kernel(const T* __restrict__ grad_out, T* __restrict__ grad_x,
                                         Pool2dGeometry g) {
  using C = compute_of<T>;
  for_each_position(g.n, g.h, g.w, g.c, [&](int64_t idx, Pos p) {
    C acc = C(0);
    for_each_cover(p.y, g.stride_h, g.pad_top, g.kh, g.h, g.oh, [&](int64_t oy, Range ry) {
      for_each_cover(p.x, g.stride_w, g.pad_left, g.kw, g.w, g.ow, [&](int64_t ox, Range rx) {
        const int64_t count = (ry.hi - ry.lo) * (rx.hi - rx.lo);  // >= 1: the window covers p
        const C go = load(grad_out[((p.i * g.oh + oy) * g.ow + ox) * g.c + p.ch]);
        if constexpr (std::is_same_v<C, double>)
          acc = __dadd_rn(acc, __dmul_rn(go, __ddiv_rn(1.0, static_cast<double>(count))));
        else
          acc = __fadd_rn(acc, __fmul_rn(go, __fdiv_rn(1.0f, static_cast<float>(count))));
      });
    });
    grad_x[idx] = store<T>(acc);
  });
}

// --- Kernels keyed on the storage dtype -------------------------------------------------

// Launches `kernel` with one thread per element of `out`, on out's device: the pointers of
// the inputs `in`, in order, then out's, then the geometry.
template <typename S, typename... Params, typename... In>
void launch_pool(const char* name, void (*kernel)(Params...), const Tensor& out,
                 const Pool2dGeometry& g, const In&... in) {
  const int64_t total = out.numel();
  if (total == 0) return;
  OnDevice on(out);
  launch_1d({name, total, on.s}, kernel, static_cast<const S*>(in.const_data_ptr())...,
            static_cast<S*>(out.data_ptr()), g);
}

template <typename S>
void max_pool2d(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  launch_pool<S>("max_pool_kernel", max_pool_kernel<S>, out, g, x);
}

template <typename S>
void max_pool2d_backward(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                         const Pool2dGeometry& g) {
  launch_pool<S>("max_pool_backward_kernel", max_pool_backward_kernel<S>, grad_x, g, x, grad_out);
}

template <typename S>
void avg_pool2d(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  launch_pool<S>("avg_pool_kernel", avg_pool_kernel<S>, out, g, x);
}

template <typename S>
void avg_pool2d_backward(const Tensor& /*x*/, const Tensor& grad_out, const Tensor& grad_x,
                         const Pool2dGeometry& g) {
  launch_pool<S>("avg_pool_backward_kernel", avg_pool_backward_kernel<S>, grad_x, g, grad_out);
}

}  // namespace

void register_pool_kernels() {
  MIXTAPE_CUDA_KERNEL(max_pool2d, max_pool2d);
  MIXTAPE_CUDA_KERNEL(max_pool2d_backward, max_pool2d_backward);
  MIXTAPE_CUDA_KERNEL(avg_pool2d, avg_pool2d);
  MIXTAPE_CUDA_KERNEL(avg_pool2d_backward, avg_pool2d_backward);
}

}  // namespace mixtape::cuda_backend
