// Private to the CUDA backend's .cu files: device-side conversions between the storage
// types (__half, __nv_bfloat16, float, double, integers) and the compute type (float for
// float32 and the 16-bit floats, the type itself otherwise), and grid-stride loops.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace mixtape::cuda_backend {

// The type arithmetic runs in for a storage type.
template <typename T>
struct compute_type {
  using type = T;
};
template <>
struct compute_type<__half> {
  using type = float;
};
template <>
struct compute_type<__nv_bfloat16> {
  using type = float;
};
template <typename T>
using compute_of = typename compute_type<T>::type;

// Storage -> compute.
template <typename T>
__device__ __forceinline__ compute_of<T> load(T x) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(x);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(x);
  else
    return x;
}

// Compute -> storage, rounding to nearest even for the 16-bit floats.
template <typename T, typename C>
__device__ __forceinline__ T store(C x) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(static_cast<float>(x));
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(static_cast<float>(x));
  else
    return static_cast<T>(x);
}

// Arithmetic that nvcc never contracts into an FMA (a * b + c as one rounding): for kernels
// whose results must be the CPU's, rounding each operation on its own as x86-64 does.
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double sqrt_rn(double a) { return __dsqrt_rn(a); }

// for (i = first; i < n; i += stride) over the whole grid.
#define MIXTAPE_GRID_LOOP(i, n)                                                                    \
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

}  // namespace mixtape::cuda_backend
