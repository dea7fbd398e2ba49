// Private to the CUDA backend's .cu files: the window geometry that the direct convolution
// and the pooling kernels share (which taps of a window land inside the input, which windows
// cover an input position, and the NHWC decomposition of an element index).
#pragma once

#include <cstdint>

#include "backends/cuda/cuda_math.cuh"

namespace mixtape::cuda_backend {

struct Range {
  std::int64_t lo, hi;  // [lo, hi), empty when lo >= hi
};

__device__ __forceinline__ std::int64_t clamp64(std::int64_t v, std::int64_t lo, std::int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// The taps t of the window at output position o that land inside the input:
// 0 <= o * stride - pad + t < size (the CPU backend's tap_range).
__device__ __forceinline__ Range tap_range(std::int64_t o, std::int64_t stride, std::int64_t pad,
                                           std::int64_t taps, std::int64_t size) {
  const std::int64_t start = o * stride - pad;
  const std::int64_t lo = clamp64(-start, 0, taps);
  return {lo, clamp64(size - start, lo, taps)};
}

// The output positions whose window covers input position p: o * stride - pad <= p and
// p <= o * stride - pad + taps - 1, with 0 <= o < outs.
__device__ __forceinline__ Range covering(std::int64_t p, std::int64_t stride, std::int64_t pad,
                                          std::int64_t taps, std::int64_t outs) {
  const std::int64_t first = p + pad - taps + 1;
  const std::int64_t lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const std::int64_t last = (p + pad) / stride + 1;  // p + pad >= 0
  return {lo, last < outs ? last : outs};
}

// f(o, taps) for each output position o in [0, outs) whose window covers input position p
// along one axis, in the order of the tap p is of it (ascending, so o descending); taps is
// the window's tap_range (the CPU backend's for_each_cover).
template <typename F>
__device__ __forceinline__ void for_each_cover(std::int64_t p, std::int64_t stride,
                                               std::int64_t pad, std::int64_t taps,
                                               std::int64_t size, std::int64_t outs, F&& f) {
  for (std::int64_t k = 0; k < taps; ++k) {
    const std::int64_t t = p + pad - k;  // o * stride when tap k of window o is p
    if (t < 0 || t % stride != 0 || t / stride >= outs) continue;
    f(t / stride, tap_range(t / stride, stride, pad, taps, size));
  }
}

// Decomposes an NHWC element index: (i, y, x, ch) of an [n, hh, ww, c] tensor.
struct Pos {
  std::int64_t i, y, x, ch;
};
__device__ __forceinline__ Pos position(std::int64_t idx, std::int64_t hh, std::int64_t ww,
                                        std::int64_t c) {
  Pos p;
  p.ch = idx % c;
  idx /= c;
  p.x = idx % ww;
  idx /= ww;
  p.y = idx % hh;
  p.i = idx / hh;
  return p;
}

// f(idx, p) for each element idx of an [n, hh, ww, c] NHWC tensor, p its position: the
// grid-stride loop of a kernel with one thread per element.
template <typename F>
__device__ __forceinline__ void for_each_position(std::int64_t n, std::int64_t hh, std::int64_t ww,
                                                  std::int64_t c, F&& f) {
  const std::int64_t total = n * hh * ww * c;
  MIXTAPE_GRID_LOOP(idx, total) f(idx, position(idx, hh, ww, c));
}

}  // namespace mixtape::cuda_backend
