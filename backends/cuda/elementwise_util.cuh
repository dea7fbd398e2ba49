// Private to the CUDA backend's memory / elementwise / reduction / index / optim kernels:
// the device element type of each dtype, exact conversions between element types (the CPU
// backend's rules, bit for bit), strided geometry of up to 8 dimensions passed to kernels
// by value, and 16-byte vector packs for the contiguous fast paths.
//
// Strided geometry: like the CPU backend, the operands' common shape drops its size-1
// dimensions and merges neighbours wherever every operand allows it; the output is always
// contiguous, so each input contributes one stride per remaining dimension. A kernel
// decomposes a linear output index into the input offsets (32-bit divisions when the
// element count fits in 32 bits, 64-bit otherwise). More than 8 dimensions left after
// merging are handled on the host, one launch per index of the leading dimensions.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backends/cuda/cuda_math.cuh"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/launch.cuh"
#include "core/strided_layout.h"
#include "mixtape/core/register_kernels.h"
#include "mixtape/core/tensor.h"

namespace mixtape::cuda_backend {

// --- Element types ------------------------------------------------------------------------

// An unsigned integer of N bytes (N = 1, 2, 4 or 8), for kernels that only move elements.
template <std::size_t N>
using ubits_t = std::conditional_t<
    N == 1, std::uint8_t,
    std::conditional_t<N == 2, std::uint16_t,
                       std::conditional_t<N == 4, std::uint32_t, std::uint64_t>>>;

// True for the 16-bit floats (computed in float32).
template <typename T>
inline constexpr bool kHalfLike = std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>;

// --- Exact conversions (the CPU backend's rules, backends/cpu/memory.cpp) -------------------

// The range of the integer types as doubles: [lo, hi] are the values that truncate into the
// type; hi = 2^digits, lo = min - 1 (exclusive bounds, as the CPU's saturating_trunc).
template <typename I>
struct IntRange;
template <>
struct IntRange<std::int32_t> {
  static constexpr double kHi = 2147483648.0;
  static constexpr double kLo = -2147483649.0;
  static constexpr std::int32_t kMax = 2147483647;
  static constexpr std::int32_t kMin = -2147483647 - 1;
};
template <>
struct IntRange<std::int64_t> {
  static constexpr double kHi = 9223372036854775808.0;
  static constexpr double kLo = -9223372036854775808.0;  // min - 1 rounds to min in double
  static constexpr std::int64_t kMax = 9223372036854775807LL;
  static constexpr std::int64_t kMin = -9223372036854775807LL - 1;
};
template <>
struct IntRange<std::uint8_t> {
  static constexpr double kHi = 256.0;
  static constexpr double kLo = -1.0;
  static constexpr std::uint8_t kMax = 255;
  static constexpr std::uint8_t kMin = 0;
};

// Floating -> integer: truncation toward zero, saturated at the type's range, NaN -> 0.
template <typename I>
__host__ __device__ inline I saturating_trunc(double d) {
  if (d != d) return I(0);
  if (d >= IntRange<I>::kHi) return IntRange<I>::kMax;
  if (d <= IntRange<I>::kLo) return IntRange<I>::kMin;
  // d lies in (kLo, kHi): its truncation fits in I (and in int64 on the way).
  return static_cast<I>(static_cast<long long>(d));
}

// double -> float rounded to odd: exact values stay, inexact ones are truncated toward zero
// and get their last mantissa bit set (then a rounding to 16 bits is correct-once). inf
// stays inf, NaN stays NaN, finite values beyond the float range truncate to +-FLT_MAX.
__device__ __forceinline__ float round_to_odd(double d) {
  float f = __double2float_rz(d);
  if (!(d != d) && static_cast<double>(f) != d) f = __uint_as_float(__float_as_uint(f) | 1u);
  return f;
}

// int64 -> float rounded to odd (truncate, then set the last bit when inexact). f is
// integer-valued whenever it is inexact (|f| >= 2^24), and |f| <= |v| <= 2^63, so the
// truncating conversion back is exact and in range.
__device__ __forceinline__ float round_to_odd_i64(long long v) {
  float f = __ll2float_rz(v);
  if (__float2ll_rz(f) != v) f = __uint_as_float(__float_as_uint(f) | 1u);
  return f;
}

// A source value (not a float8) as the float32 whose rounding to 16 or 8 bits is the correct
// rounding of the value: exact from the 16-bit floats, float32, uint8 and bool; rounded to
// odd from float64 and the wider integers.
template <typename S>
__device__ __forceinline__ float float_for_narrowing(S v) {
  if constexpr (kHalfLike<S>)
    return load(v);  // exact
  else if constexpr (std::is_same_v<S, float>)
    return v;
  else if constexpr (std::is_same_v<S, double>)
    return round_to_odd(v);
  else if constexpr (std::is_same_v<S, std::int32_t>)
    return round_to_odd(static_cast<double>(v));  // int32 -> double is exact
  else if constexpr (std::is_same_v<S, std::int64_t>)
    return round_to_odd_i64(static_cast<long long>(v));
  else
    return static_cast<float>(v);  // uint8 / bool: exact
}

// A value of source type S (a device storage type) converted to destination type D exactly
// as the CPU backend's cast does: to bool (x != 0); to 16-bit floats correctly rounded
// (nearest even, wider sources through a float rounded to odd); floating -> integer by
// saturating_trunc; integer -> integer wraps; everything else a C++ conversion (nearest).
// DB: whether D is the bool byte.
template <typename S, typename D, bool DB>
__device__ __forceinline__ D convert_elem(S v) {
  if constexpr (DB) {
    if constexpr (kHalfLike<S>)
      return static_cast<D>(load(v) != 0.0f ? 1 : 0);
    else
      return static_cast<D>(v != S(0) ? 1 : 0);
  } else if constexpr (std::is_same_v<D, __half> || std::is_same_v<D, __nv_bfloat16>) {
    return store<D>(float_for_narrowing(v));
  } else if constexpr (std::is_same_v<D, float> || std::is_same_v<D, double>) {
    if constexpr (kHalfLike<S>)
      return static_cast<D>(load(v));
    else
      return static_cast<D>(v);  // nearest (float64 -> float32, large integers)
  } else if constexpr (kHalfLike<S>) {
    return saturating_trunc<D>(static_cast<double>(load(v)));
  } else if constexpr (std::is_same_v<S, float> || std::is_same_v<S, double>) {
    return saturating_trunc<D>(static_cast<double>(v));
  } else {
    return static_cast<D>(v);  // integer -> integer wraps (two's complement)
  }
}

// True for the 8-bit floats (storage only: they are cast, never computed in).
template <typename T>
inline constexpr bool kFloat8 =
    std::is_same_v<T, __nv_fp8_e4m3> || std::is_same_v<T, __nv_fp8_e5m2>;

// A float8 value as float32 (exact).
template <typename T>
__device__ __forceinline__ float float8_to_float(T v) {
  constexpr __nv_fp8_interpretation_t kind =
      std::is_same_v<T, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.__x, kind)));
}

// A cast from or to a float8 type, as the CPU backend's (backends/cpu/memory.cpp): through a
// float32 (exact from float8 and the 16-bit floats, rounded to odd from wider sources), then
// to float8 rounded to nearest even and saturated (cvt.rn.satfinite on sm_89 and newer).
// DB: whether D is the bool byte.
template <typename S, typename D, bool DB>
__device__ __forceinline__ D convert_float8(S v) {
  float f;
  if constexpr (kFloat8<S>)
    f = float8_to_float(v);
  else
    f = float_for_narrowing(v);
  if constexpr (kFloat8<D>) {
    constexpr __nv_fp8_interpretation_t kind =
        std::is_same_v<D, __nv_fp8_e4m3> ? __NV_E4M3 : __NV_E5M2;
    D out;
    out.__x = __nv_cvt_float_to_fp8(f, __NV_SATFINITE, kind);
    return out;
  } else {
    return convert_elem<float, D, DB>(f);
  }
}

// --- Device math, overloaded on float / double --------------------------------------------

__device__ __forceinline__ float d_fabs(float x) { return fabsf(x); }
__device__ __forceinline__ double d_fabs(double x) { return fabs(x); }
__device__ __forceinline__ float d_exp(float x) { return expf(x); }
__device__ __forceinline__ double d_exp(double x) { return exp(x); }
__device__ __forceinline__ float d_log(float x) { return logf(x); }
__device__ __forceinline__ double d_log(double x) { return log(x); }
__device__ __forceinline__ float d_sqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double d_sqrt(double x) { return sqrt(x); }
__device__ __forceinline__ float d_tanh(float x) { return tanhf(x); }
__device__ __forceinline__ double d_tanh(double x) { return tanh(x); }
__device__ __forceinline__ float d_erf(float x) { return erff(x); }
__device__ __forceinline__ double d_erf(double x) { return erf(x); }
__device__ __forceinline__ float d_erfc(float x) { return erfcf(x); }
__device__ __forceinline__ double d_erfc(double x) { return erfc(x); }
__device__ __forceinline__ float d_pow(float x, float y) { return powf(x, y); }
__device__ __forceinline__ double d_pow(double x, double y) { return pow(x, y); }

// --- Strided geometry ---------------------------------------------------------------------

inline constexpr int kMaxDims = 8;

// The geometry of K strided inputs read in the row-major order of a contiguous output.
template <int K>
struct StridedGeom {
  int rank = 1;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t stride[K][kMaxDims] = {};
};

// The element offsets (into each input) of linear output index i. I: the index type of the
// divisions (std::uint32_t when the launch's element count fits, std::uint64_t otherwise).
template <typename I, int K>
__device__ __forceinline__ void strided_offsets(const StridedGeom<K>& g, std::int64_t i,
                                                std::int64_t (&off)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) off[k] = 0;
  I rem = static_cast<I>(i);
#pragma unroll
  for (int d = kMaxDims - 1; d >= 1; --d) {
    if (d < g.rank) {
      const I extent = static_cast<I>(g.shape[d]);
      const I q = rem / extent;
      const auto idx = static_cast<std::int64_t>(rem - q * extent);
      rem = q;
#pragma unroll
      for (int k = 0; k < K; ++k) off[k] += idx * g.stride[k][d];
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) off[k] += static_cast<std::int64_t>(rem) * g.stride[k][0];
}

// The sum of part[b n + j] over b = 0 .. blocks - 1, added in that order (the bits of the plain
// loop): the column sums of per-block partials (the bias and LayerNorm parameter gradients),
// a thread per column. The loads go out kBatch at a time before their sums: there are few
// columns (768 threads for a width of 768), and a loop waiting on each load in turn ran at a
// tenth of the memory's rate.
template <typename C>
__device__ __forceinline__ C ordered_column_sum(const C* __restrict__ part, std::int64_t blocks,
                                                std::int64_t n, std::int64_t j) {
  constexpr int kBatch = 16;
  C s = C(0);
  std::int64_t b = 0;
  for (; b + kBatch <= blocks; b += kBatch) {
    C v[kBatch];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) v[k] = part[(b + k) * n + j];
#pragma unroll
    for (int k = 0; k < kBatch; ++k) s += v[k];
  }
  for (; b < blocks; ++b) s += part[b * n + j];
  return s;
}

// The host-side merged geometry of K inputs over an output shape (core/strided_layout.h).
template <int K>
using Coalesced = detail::StridedLayout<K>;
using detail::coalesce;

// Calls fn(geom, input_offsets, output_offset, count) for slices of at most kMaxDims
// dimensions covering the whole geometry (one slice unless more than kMaxDims dimensions
// remain after merging; then one per index of the leading dimensions). Offsets in elements.
template <int K, typename Fn>
void for_each_slice(const Coalesced<K>& l, Fn&& fn) {
  const int r = static_cast<int>(l.shape.size());
  const int lead = r > kMaxDims ? r - kMaxDims : 0;
  StridedGeom<K> g;
  g.rank = r - lead;
  std::int64_t count = 1;
  for (int d = 0; d < g.rank; ++d) {
    const auto src = static_cast<std::size_t>(lead + d);
    g.shape[d] = l.shape[src];
    count *= l.shape[src];
    for (int k = 0; k < K; ++k) g.stride[k][d] = l.strides[src][static_cast<std::size_t>(k)];
  }
  std::int64_t slices = 1;
  for (int d = 0; d < lead; ++d) slices *= l.shape[static_cast<std::size_t>(d)];
  for (std::int64_t s = 0; s < slices; ++s) {
    std::array<std::int64_t, K> off{};
    std::int64_t rem = s;
    for (int d = lead - 1; d >= 0; --d) {
      const auto dd = static_cast<std::size_t>(d);
      const std::int64_t idx = rem % l.shape[dd];
      rem /= l.shape[dd];
      for (int k = 0; k < K; ++k)
        off[static_cast<std::size_t>(k)] += idx * l.strides[dd][static_cast<std::size_t>(k)];
    }
    fn(g, off, s * count, count);
  }
}

// Whether a launch over `count` elements may decompose indices in 32 bits.
inline bool fits_u32(std::int64_t count) { return count <= 0xFFFFFFFFLL; }

// One strided kernel launched over launch.n elements: its instantiation on 32-bit indices
// (kernel32) where they fit, else the one on 64-bit indices (kernel64).
template <typename... P32, typename... P64, typename... Args>
void launch_strided(const Launch1d& launch, void (*kernel32)(P32...), void (*kernel64)(P64...),
                    const Args&... args) {
  if (fits_u32(launch.n))
    launch_1d(launch, kernel32, args...);
  else
    launch_1d(launch, kernel64, args...);
}

// --- Vector packs ----------------------------------------------------------------------------

// N elements of T in one aligned 16-byte (or smaller) access.
template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// Elements of T per 16-byte vector.
template <typename T>
inline constexpr int kVec = static_cast<int>(16 / sizeof(T));

inline bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// --- Launch helpers ---------------------------------------------------------------------------

// The device of a tensor made current for the scope, and its stream, in a LaunchScope.
struct OnDevice {
  explicit OnDevice(const Tensor& t)
      : index(t.device().index()), guard(index), launch(index), s(launch.stream()) {}
  int index;
  DeviceGuard guard;
  LaunchScope launch;
  cudaStream_t s;
};

}  // namespace mixtape::cuda_backend
