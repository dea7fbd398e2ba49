// Private to the CUDA backend's .cu files: the activations' math and their gradients on the
// compute type (float for the 16-bit floats), shared by the elementwise kernels
// (elementwise.cu) and the fused linear op's kernels (linear.cu), in the CPU backend's forms
// (backends/cpu/activation_math.h).
#pragma once

#include "backends/cuda/elementwise_util.cuh"

namespace mixtape::cuda_backend {

// 1 / (1 + e^-x) through e = e^-|x| <= 1 (nothing overflows); NaN stays NaN.
template <typename C>
__device__ __forceinline__ C sigmoid_of(C x) {
  const C e = d_exp(-d_fabs(x));
  const C s = C(1) / (C(1) + e);
  return x >= C(0) ? s : e * s;
}

// max(x, 0); NaN and -0 stay.
template <typename C>
__device__ __forceinline__ C relu_of(C x) {
  return x < C(0) ? C(0) : x;
}

// Exact gelu: 0.5 x erfc(-x / sqrt2).
template <typename C>
__device__ __forceinline__ C gelu_of(C x) {
  return C(0.5) * x * d_erfc(-x * C(0.70710678118654752440));
}

// gelu's tanh form as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3) (the CPU's form).
template <typename C>
__device__ __forceinline__ C gelu_tanh_of(C x) {
  const C u = C(0.79788456080286535588) * (x + C(0.044715) * x * x * x);
  return x * sigmoid_of(C(2) * u);
}

// g (Phi(x) + x phi(x)), x phi(x) taken as 0 where |x| >= 64 (the CPU's form).
template <typename C>
__device__ __forceinline__ C gelu_grad_of(C x, C g) {
  const C cdf = C(0.5) * d_erfc(-x * C(0.70710678118654752440));
  const C pdf = d_exp(C(-0.5) * x * x) * C(0.39894228040143267794);
  const C xpdf = d_fabs(x) < C(64) ? x * pdf : C(0);
  return g * (cdf + xpdf);
}

// g (s + x s (1 - s) 2u'), s = sigmoid(2u), x clamped to [-64, 64] (the CPU's form).
template <typename C>
__device__ __forceinline__ C gelu_tanh_grad_of(C x, C g) {
  constexpr C kC = C(0.79788456080286535588), kA = C(0.044715);
  const C xc = x > C(64) ? C(64) : (x < C(-64) ? C(-64) : x);
  const C s = sigmoid_of(C(2) * kC * (xc + kA * xc * xc * xc));
  return g * (s + xc * s * (C(1) - s) * (C(2) * kC) * (C(1) + C(3) * kA * xc * xc));
}

}  // namespace mixtape::cuda_backend
