// Private to the CUDA backend's .cu files: kernels that give each row (or other item) a warp of
// 32 lanes. The loop over the items and the sums and maxima over a warp's lanes.
#pragma once

#include <cstdint>

namespace mixtape::cuda_backend {

inline constexpr int kWarp = 32;

// v summed over the warp's lanes, by a butterfly: every lane gets the sum.
template <typename C>
__device__ __forceinline__ C warp_sum(C v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// The maximum of v over the warp's lanes (fmax: a NaN loses to any number); every lane gets it.
template <typename C>
__device__ __forceinline__ C warp_max(C v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// f(item, lane) for each item in [0, count), a warp per item: the grid's warps stride over the
// items, every lane of a warp with the same item, `lane` its place in the warp. Launched with
// count * kWarp threads (or fewer: the loop covers the rest).
template <typename F>
__device__ __forceinline__ void for_each_warp_item(std::int64_t count, F&& f) {
  const std::int64_t thread = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * blockDim.x / kWarp;
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  for (std::int64_t item = thread / kWarp; item < count; item += warps) f(item, lane);
}

}  // namespace mixtape::cuda_backend
