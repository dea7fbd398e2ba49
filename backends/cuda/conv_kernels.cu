// CUDA kernels of conv2d that cuDNN does not provide (gemm_conv_kernels.h): the direct
// convolutions (16-bit accumulation, float64, and whatever cuDNN refuses), and the layout
// moves around the cuDNN calls (filter transposes, explicit zero padding and its crop).
//
// The direct kernels give each thread one output element, which sums its terms in the order
// the CPU backend's 16-bit emulation documents (backends/cpu/conv.cpp), so that with
// Accumulation::Round16 the two backends agree bit for bit. They are simple rather than fast:
// the backward-weight kernel has one thread per filter element walking every output pixel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_math.cuh"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/gemm_conv_kernels.h"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/window.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// The output positions o in [0, outs) at which tap t lands inside the input (the CPU
// backend's out_range).
__device__ __forceinline__ Range out_range(int64_t t, int64_t stride, int64_t pad, int64_t size,
                                           int64_t outs) {
  const int64_t first = pad - t, last = size - 1 + pad - t;  // bounds of o * stride
  const int64_t lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const int64_t hi = last < 0 ? 0 : (last / stride + 1 < outs ? last / stride + 1 : outs);
  return {lo, hi};
}

// out[i, oy, ox, co] over the taps (ky, kx, ci) in row-major order.
template <typename T, Accumulation A>
__global__ void conv_forward_kernel(const T* __restrict__ x, const T* __restrict__ w,
                                    T* __restrict__ out, ConvShape g) {
  using Acc = accumulator_t<T>;
  for_each_position(g.n, g.oh, g.ow, g.cout, [&](int64_t idx, Pos o) {
    const int64_t i = o.i, oy = o.y, ox = o.x, co = o.ch;
    const Range ry = tap_range(oy, g.sh, g.pad_top, g.kh, g.h);
    const Range rx = tap_range(ox, g.sw, g.pad_left, g.kw, g.w);
    const int64_t y0 = oy * g.sh - g.pad_top, x0 = ox * g.sw - g.pad_left;
    Acc acc = Acc(0);
    for (int64_t ky = ry.lo; ky < ry.hi; ++ky) {
      for (int64_t kx = rx.lo; kx < rx.hi; ++kx) {
        const T* xs = x + ((i * g.h + y0 + ky) * g.w + x0 + kx) * g.c;
        const T* ws = w + (ky * g.kw + kx) * g.c * g.cout + co;
        for (int64_t ci = 0; ci < g.c; ++ci)
          acc = accumulate<T, A>(acc, load(xs[ci]), load(ws[ci * g.cout]));
      }
    }
    out[idx] = store<T>(acc);
  });
}

// dx[i, iy, ix, ci] over oy ascending, then kx ascending, then co ascending.
template <typename T, Accumulation A>
__global__ void conv_backward_input_kernel(const T* __restrict__ grad_out, const T* __restrict__ w,
                                           T* __restrict__ grad_x, ConvShape g) {
  using Acc = accumulator_t<T>;
  for_each_position(g.n, g.h, g.w, g.c, [&](int64_t idx, Pos p) {
    const int64_t i = p.i, iy = p.y, ix = p.x, ci = p.ch;
    // Output rows whose window covers input row iy: ky = iy + pad_top - oy * stride_h in
    // [0, kh).
    const Range wy = covering(iy, g.sh, g.pad_top, g.kh, g.oh);
    Acc acc = Acc(0);
    for (int64_t oy = wy.lo; oy < wy.hi; ++oy) {
      const int64_t ky = iy + g.pad_top - oy * g.sh;
      for (int64_t kx = 0; kx < g.kw; ++kx) {
        const int64_t tx = ix + g.pad_left - kx;
        if (tx < 0 || tx % g.sw != 0) continue;
        const int64_t ox = tx / g.sw;
        if (ox >= g.ow) continue;
        const T* go = grad_out + ((i * g.oh + oy) * g.ow + ox) * g.cout;
        const T* wr = w + ((ky * g.kw + kx) * g.c + ci) * g.cout;
        for (int64_t co = 0; co < g.cout; ++co)
          acc = accumulate<T, A>(acc, load(go[co]), load(wr[co]));
      }
    }
    grad_x[idx] = store<T>(acc);
  });
}

// dw[ky, kx, ci, co] over the output pixels (i, oy, ox) in row-major order.
template <typename T, Accumulation A>
__global__ void conv_backward_weight_kernel(const T* __restrict__ x, const T* __restrict__ grad_out,
                                            T* __restrict__ grad_w, ConvShape g) {
  using Acc = accumulator_t<T>;
  const int64_t total = g.kh * g.kw * g.c * g.cout;
  MIXTAPE_GRID_LOOP(idx, total) {
    int64_t t = idx;
    const int64_t co = t % g.cout;
    t /= g.cout;
    const int64_t ci = t % g.c;
    t /= g.c;
    const int64_t kx = t % g.kw, ky = t / g.kw;
    const Range ry = out_range(ky, g.sh, g.pad_top, g.h, g.oh);
    const Range rx = out_range(kx, g.sw, g.pad_left, g.w, g.ow);
    Acc acc = Acc(0);
    for (int64_t i = 0; i < g.n; ++i) {
      for (int64_t py = ry.lo; py < ry.hi; ++py) {
        const int64_t iy = py * g.sh - g.pad_top + ky;
        for (int64_t px = rx.lo; px < rx.hi; ++px) {
          const int64_t ix = px * g.sw - g.pad_left + kx;
          acc = accumulate<T, A>(acc, load(x[((i * g.h + iy) * g.w + ix) * g.c + ci]),
                                 load(grad_out[((i * g.oh + py) * g.ow + px) * g.cout + co]));
        }
      }
    }
    grad_w[idx] = store<T>(acc);
  }
}

enum class Which { Forward, BackwardInput, BackwardWeight };

template <typename T, Accumulation A>
void launch(Which which, const ConvShape& g, const void* in0, const void* in1, void* out,
            cudaStream_t stream) {
  const auto* p0 = static_cast<const T*>(in0);
  const auto* p1 = static_cast<const T*>(in1);
  auto* po = static_cast<T*>(out);
  switch (which) {
    case Which::Forward: {
      const int64_t total = g.n * g.oh * g.ow * g.cout;
      if (total <= 0) return;
      launch_1d({"conv_forward_kernel", total, stream}, conv_forward_kernel<T, A>, p0, p1, po, g);
      return;
    }
    case Which::BackwardInput: {
      const int64_t total = g.n * g.h * g.w * g.c;
      if (total <= 0) return;
      launch_1d({"conv_backward_input_kernel", total, stream}, conv_backward_input_kernel<T, A>, p0,
                p1, po, g);
      return;
    }
    case Which::BackwardWeight: {
      const int64_t total = g.kh * g.kw * g.c * g.cout;
      if (total <= 0) return;
      launch_1d({"conv_backward_weight_kernel", total, stream}, conv_backward_weight_kernel<T, A>,
                p0, p1, po, g);
      return;
    }
  }
}

void dispatch(Which which, Elem type, Accumulation acc, const ConvShape& g, const void* in0,
              const void* in1, void* out, cudaStream_t stream) {
  const bool round16 = acc == Accumulation::Round16;
  switch (type) {
    case Elem::Float16:
      return round16 ? launch<__half, Accumulation::Round16>(which, g, in0, in1, out, stream)
                     : launch<__half, Accumulation::Wide>(which, g, in0, in1, out, stream);
    case Elem::BFloat16:
      return round16 ? launch<__nv_bfloat16, Accumulation::Round16>(which, g, in0, in1, out, stream)
                     : launch<__nv_bfloat16, Accumulation::Wide>(which, g, in0, in1, out, stream);
    case Elem::Float32:  // 16-bit accumulation does not apply: accumulate in float32
      return launch<float, Accumulation::Wide>(which, g, in0, in1, out, stream);
    case Elem::Float64:
      return launch<double, Accumulation::Wide>(which, g, in0, in1, out, stream);
  }
}

// --- Layout moves (bits only) ------------------------------------------------------------

constexpr int kTransposeTile = 32, kTransposeRows = 8;

// dst[j, i] = src[i, j] through a shared-memory tile, so that reads and writes are both
// coalesced. The grid strides over tiles.
template <typename E>
__global__ void transpose_kernel(const E* __restrict__ src, E* __restrict__ dst, int64_t rows,
                                 int64_t cols) {
  __shared__ E tile[kTransposeTile][kTransposeTile + 1];
  shared_starts_undefined(tile);
  const int64_t tiles_r = (rows + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles_c = (cols + kTransposeTile - 1) / kTransposeTile;
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  for (int64_t tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
    for (int64_t tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
      const int64_t r0 = tr * kTransposeTile, c0 = tc * kTransposeTile;
      for (int j = ty; j < kTransposeTile; j += kTransposeRows) {
        const int64_t r = r0 + j, col = c0 + tx;
        if (r < rows && col < cols) tile[j][tx] = src[r * cols + col];
      }
      __syncthreads();
      for (int j = ty; j < kTransposeTile; j += kTransposeRows) {
        const int64_t col = c0 + j, r = r0 + tx;
        if (col < cols && r < rows) dst[col * rows + r] = tile[tx][j];
      }
      __syncthreads();
    }
  }
}

template <typename E>
void launch_transpose(const void* src, void* dst, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t tiles_r = (rows + kTransposeTile - 1) / kTransposeTile;
  const int64_t tiles_c = (cols + kTransposeTile - 1) / kTransposeTile;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(tiles_c, int64_t{1} << 30)),
                  static_cast<unsigned>(std::min<int64_t>(tiles_r, 65535)));
  const dim3 block(kTransposeTile, kTransposeRows);
  MIXTAPE_CUDA_LAUNCH(grid, block, stream, transpose_kernel<E>)
  (static_cast<const E*>(src), static_cast<E*>(dst), rows, cols);
  MIXTAPE_CUDA_CHECK_LAUNCH("transpose_kernel");
}

// dst [n, dh, dw, c] at (y, x) = src [n, sh, sw, c] at (y + oy, x + ox), zero where that
// falls outside src: a zero padding (offsets <= 0, dst the larger) or its crop (offsets >= 0).
template <typename E>
__global__ void shifted_copy_kernel(const E* __restrict__ src, E* __restrict__ dst, int64_t n,
                                    int64_t c, int64_t sh, int64_t sw, int64_t dh, int64_t dw,
                                    int64_t oy, int64_t ox) {
  for_each_position(n, dh, dw, c, [&](int64_t idx, Pos p) {
    const int64_t sy = p.y + oy, sx = p.x + ox;
    dst[idx] = (sy >= 0 && sy < sh && sx >= 0 && sx < sw)
                   ? src[((p.i * sh + sy) * sw + sx) * c + p.ch]
                   : E(0);
  });
}

// The padding of src [n, h, w, c] into dst [n, hp, wp, c] at (top, left), or (crop) its
// inverse.
template <typename E>
void launch_pad(bool crop, const void* src, void* dst, int64_t n, int64_t h, int64_t w, int64_t c,
                int64_t hp, int64_t wp, int64_t top, int64_t left, cudaStream_t stream) {
  const int64_t total = crop ? n * h * w * c : n * hp * wp * c;
  if (total <= 0) return;
  const auto* s = static_cast<const E*>(src);
  auto* d = static_cast<E*>(dst);
  if (crop) {
    launch_1d({"shifted_copy_kernel (crop)", total, stream}, shifted_copy_kernel<E>, s, d, n, c, hp,
              wp, h, w, top, left);
  } else {
    launch_1d({"shifted_copy_kernel (pad)", total, stream}, shifted_copy_kernel<E>, s, d, n, c, h,
              w, hp, wp, -top, -left);
  }
}

void pad_or_crop(bool crop, const void* src, void* dst, int64_t n, int64_t h, int64_t w, int64_t c,
                 int64_t hp, int64_t wp, int64_t top, int64_t left, std::size_t elem_bytes,
                 cudaStream_t stream) {
  switch (elem_bytes) {
    case 2:
      return launch_pad<std::uint16_t>(crop, src, dst, n, h, w, c, hp, wp, top, left, stream);
    case 4:
      return launch_pad<std::uint32_t>(crop, src, dst, n, h, w, c, hp, wp, top, left, stream);
    default:
      return launch_pad<std::uint64_t>(crop, src, dst, n, h, w, c, hp, wp, top, left, stream);
  }
}

template <typename T>
__global__ void add_bias_kernel(T* __restrict__ out, const T* __restrict__ bias, int64_t total,
                                int64_t cols) {
  MIXTAPE_GRID_LOOP(idx, total) { out[idx] = store<T>(load(out[idx]) + load(bias[idx % cols])); }
}

template <typename T>
void launch_add_bias(void* out, const void* bias, int64_t rows, int64_t cols, cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total <= 0) return;
  launch_1d({"add_bias_kernel", total, stream}, add_bias_kernel<T>, static_cast<T*>(out),
            static_cast<const T*>(bias), total, cols);
}

template <typename T>
__global__ void add_bias_rounded_kernel(const float* __restrict__ acc, const T* __restrict__ bias,
                                        T* __restrict__ out, int64_t total, int64_t cols) {
  MIXTAPE_GRID_LOOP(idx, total) { out[idx] = store<T>(acc[idx] + load(bias[idx % cols])); }
}

template <typename T>
void launch_add_bias_rounded(const void* acc, const void* bias, void* out, int64_t rows,
                             int64_t cols, cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total <= 0) return;
  launch_1d({"add_bias_rounded_kernel", total, stream}, add_bias_rounded_kernel<T>,
            static_cast<const float*>(acc), static_cast<const T*>(bias), static_cast<T*>(out),
            total, cols);
}

}  // namespace

void add_bias_rows_rounded(Elem type, const void* acc, const void* bias, void* out, int64_t rows,
                           int64_t cols, cudaStream_t stream) {
  if (type == Elem::BFloat16)
    return launch_add_bias_rounded<__nv_bfloat16>(acc, bias, out, rows, cols, stream);
  return launch_add_bias_rounded<__half>(acc, bias, out, rows, cols, stream);
}

void add_bias_rows(Elem type, void* out, const void* bias, int64_t rows, int64_t cols,
                   cudaStream_t stream) {
  switch (type) {
    case Elem::Float16:
      return launch_add_bias<__half>(out, bias, rows, cols, stream);
    case Elem::BFloat16:
      return launch_add_bias<__nv_bfloat16>(out, bias, rows, cols, stream);
    case Elem::Float64:
      return launch_add_bias<double>(out, bias, rows, cols, stream);
    default:
      return launch_add_bias<float>(out, bias, rows, cols, stream);
  }
}

void conv_direct_forward(Elem type, Accumulation acc, const ConvShape& g, const void* x,
                         const void* w, void* out, cudaStream_t stream) {
  dispatch(Which::Forward, type, acc, g, x, w, out, stream);
}

void conv_direct_backward_input(Elem type, Accumulation acc, const ConvShape& g,
                                const void* grad_out, const void* w, void* grad_x,
                                cudaStream_t stream) {
  dispatch(Which::BackwardInput, type, acc, g, grad_out, w, grad_x, stream);
}

void conv_direct_backward_weight(Elem type, Accumulation acc, const ConvShape& g, const void* x,
                                 const void* grad_out, void* grad_w, cudaStream_t stream) {
  dispatch(Which::BackwardWeight, type, acc, g, x, grad_out, grad_w, stream);
}

void transpose_matrix(const void* src, void* dst, int64_t rows, int64_t cols,
                      std::size_t elem_bytes, cudaStream_t stream) {
  if (rows <= 0 || cols <= 0) return;
  switch (elem_bytes) {
    case 2:
      return launch_transpose<std::uint16_t>(src, dst, rows, cols, stream);
    case 4:
      return launch_transpose<std::uint32_t>(src, dst, rows, cols, stream);
    default:
      return launch_transpose<std::uint64_t>(src, dst, rows, cols, stream);
  }
}

void pad_nhwc(const void* src, void* dst, int64_t n, int64_t h, int64_t w, int64_t c, int64_t hp,
              int64_t wp, int64_t top, int64_t left, std::size_t elem_bytes, cudaStream_t stream) {
  pad_or_crop(false, src, dst, n, h, w, c, hp, wp, top, left, elem_bytes, stream);
}

void crop_nhwc(const void* src, void* dst, int64_t n, int64_t h, int64_t w, int64_t c, int64_t hp,
               int64_t wp, int64_t top, int64_t left, std::size_t elem_bytes, cudaStream_t stream) {
  pad_or_crop(true, src, dst, n, h, w, c, hp, wp, top, left, elem_bytes, stream);
}

}  // namespace mixtape::cuda_backend
