// Private to the CPU backend: the activations' math and their gradients, on float, double
// (and float32 values of the 16-bit floats), shared by the elementwise kernels
// (elementwise.cpp: relu, sigmoid, gelu, gelu_tanh, relu_backward, gelu_backward) and the
// fused linear op's epilogues (linear.cpp), so that both compute the same values bit for bit.
//
// float32 erf and erfc call glibc's vector math library (libmvec: erff / erfcf four lanes at a
// time, where CMake finds it) inside `#pragma omp simd` loops; the scalar functions otherwise.
#pragma once

#include <cmath>

#include "backends/cpu/cpu_util.h"

#ifdef MIXTAPE_WITH_LIBMVEC
// glibc (2.35 and later) ships SIMD variants of erff and erfcf in libmvec (_ZGVbN4v_erff,
// ...; as accurate as the scalar functions on the gelu range, measured). Declared as
// SIMD functions here, a `#pragma omp simd` loop over them calls those variants; math.h
// declares them so only under -ffast-math, which the library does not use.
extern "C" {
#pragma omp declare simd notinbranch
float erff(float) noexcept;
#pragma omp declare simd notinbranch
float erfcf(float) noexcept;
}
#endif

namespace mixtape::cpu {

// erf / erfc of float through erff / erfcf (the SIMD ones above in `omp simd` loops).
MIXTAPE_ALWAYS_INLINE float erf_of(float x) { return ::erff(x); }
MIXTAPE_ALWAYS_INLINE float erfc_of(float x) { return ::erfcf(x); }
MIXTAPE_ALWAYS_INLINE double erf_of(double x) { return std::erf(x); }
MIXTAPE_ALWAYS_INLINE double erfc_of(double x) { return std::erfc(x); }

// 1 / (1 + e^-x) through e = e^-|x| <= 1, so nothing overflows for large |x|.
template <typename T>
MIXTAPE_ALWAYS_INLINE T sigmoid_of(T x) {
  const T e = exp_any(-std::fabs(x));
  const T s = T(1) / (T(1) + e);
  return blend(x >= T(0), s, e * s);
}

// max(x, 0); NaN stays NaN, -0 stays -0.
template <typename T>
MIXTAPE_ALWAYS_INLINE T relu_of(T x) {
  return x < T(0) ? T(0) : x;
}

// Exact gelu, x * Phi(x) = 0.5 x erfc(-x / sqrt2): erfc keeps the negative tail accurate
// where 1 + erf(x / sqrt2) would cancel.
template <typename T>
MIXTAPE_ALWAYS_INLINE T gelu_of(T x) {
  return T(0.5) * x * erfc_of(-x * T(0.70710678118654752440));
}

// gelu's tanh form 0.5 x (1 + tanh(u)) as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3):
// the same function, without 1 + tanh(u)'s cancellation in the negative tail; vectorises
// (sigmoid's exp is the vectorising one).
template <typename T>
MIXTAPE_ALWAYS_INLINE T gelu_tanh_of(T x) {
  const T u = T(0.79788456080286535588) * (x + T(0.044715) * x * x * x);
  return x * sigmoid_of(T(2) * u);
}

// x clamped to [-64, 64] by bit selects (no branch, no fmin / fmax call: either keeps a loop
// from vectorising); a NaN x stays NaN.
template <typename T>
MIXTAPE_ALWAYS_INLINE T clamp64(T x) {
  return blend(x > T(64), T(64), blend(x < T(-64), T(-64), x));
}

// The gradient through the exact gelu in one pass: g (Phi(x) + x phi(x)), Phi(x) =
// 0.5 erfc(-x / sqrt2), phi(x) = exp(-x^2 / 2) / sqrt(2 pi). x phi(x) is taken as 0 where
// |x| >= 64 (phi is 0 there, and inf * 0 would be NaN): the gradient tends to g at +inf and
// to 0 at -inf; a NaN x gives NaN.
template <typename T>
MIXTAPE_ALWAYS_INLINE T gelu_grad_of(T x, T g) {
  const T cdf = T(0.5) * erfc_of(-x * T(0.70710678118654752440));
  const T xc = clamp64(x);
  const T xpdf = xc * exp_any(T(-0.5) * xc * xc) * T(0.39894228040143267794);
  return g * (cdf + xpdf);
}

// The gradient through gelu_tanh: d/dx x s(2u) = s + x s (1 - s) 2u', with s = sigmoid(2u) and
// u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2) (what autograd's composed rule computes, in one
// pass). x is clamped to [-64, 64] first: s is already exactly 1 or 0 there, so nothing
// changes but +-inf, which give g and 0 rather than NaN.
template <typename T>
MIXTAPE_ALWAYS_INLINE T gelu_tanh_grad_of(T x, T g) {
  constexpr T kC = T(0.79788456080286535588), kA = T(0.044715);
  const T xc = clamp64(x);
  const T s = sigmoid_of(T(2) * kC * (xc + kA * xc * xc * xc));
  return g * (s + xc * s * (T(1) - s) * (T(2) * kC) * (T(1) + T(3) * kA * xc * xc));
}

}  // namespace mixtape::cpu
