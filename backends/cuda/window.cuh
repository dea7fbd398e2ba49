// Private to the CUDA backend's .cu files: the window geometry that the direct convolution
// and the pooling kernels share (which taps of a window land inside the input, which windows
// cover an input position, and the NHWC decomposition of an element index).
#pragma once

#include <cstdint>

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

}  // namespace mixtape::cuda_backend
