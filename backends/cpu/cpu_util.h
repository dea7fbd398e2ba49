// Private to the CPU backend: helpers shared by its kernel files (elementwise, memory,
// reduction, index). Everything here is inline or a template.
#pragma once

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "mixtape/core/half.h"

namespace mixtape::cpu {

// --- Instruction sets ---------------------------------------------------------------------

// The build targets baseline x86-64 (SSE2) so that it runs on any x86-64; a hot loop comes
// also compiled for AVX2 + FMA (__attribute__((target("avx2,fma"))) on a wrapper around an
// always-inlined body), picked at run time with has_avx2_fma().
#define MIXTAPE_ALWAYS_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) && defined(__GNUC__)
#define MIXTAPE_HAVE_AVX2_VARIANTS 1
inline bool has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
// AVX-512 with byte and word instructions (and their 128/256-bit forms): 16-bit integer
// loops compare into mask registers, 32 lanes at a time.
inline bool has_avx512bw() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return yes;
}
#endif

// --- Element types -----------------------------------------------------------------------

// Elements per block of the blockwise kernels; also the size of their float32 stack
// buffers (16-bit floats are converted to float32 a block at a time).
inline constexpr std::int64_t kBlock = 1024;

// Whether T is a 16-bit float (float16 / bfloat16), whose math runs in float32.
template <typename T>
inline constexpr bool kReduced = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

// The type the math runs in: float32 for 16-bit floats, T otherwise.
template <typename T>
using compute_t = std::conditional_t<kReduced<T>, float, T>;

// An unsigned integer of N bytes (N = 1, 2, 4 or 8), for kernels that only move elements.
template <std::size_t N>
using bits_t = std::conditional_t<
    N == 1, std::uint8_t,
    std::conditional_t<N == 2, std::uint16_t,
                       std::conditional_t<N == 4, std::uint32_t, std::uint64_t>>>;

// For the kernels that work on float16 / bfloat16 bits directly (relu, relu_backward, max
// pooling): the bits of +inf (magnitudes above are NaNs) and the quiet bit of a NaN. A NaN
// that goes through float32 and back comes out quiet, so those kernels set that bit on the
// NaNs they pass. They compare as signed 16-bit integers (magnitudes are below 0x8000),
// which SSE2 and AVX2 have instructions for (unsigned 16-bit compares they have not).
struct Bits16 {
  std::int16_t inf, quiet;
  bool is_nan(std::int16_t x) const { return static_cast<std::int16_t>(x & 0x7FFF) > inf; }
  std::int16_t quieted(std::int16_t x) const {
    return is_nan(x) ? static_cast<std::int16_t>(x | quiet) : x;
  }
};
template <typename T>
constexpr Bits16 kBits16Of =
    std::is_same_v<T, half> ? Bits16{0x7C00, 0x0200} : Bits16{0x7F80, 0x0040};

// --- Bulk float16 / bfloat16 <-> float32 conversion (n elements, the half.h converters) --

inline void to_float(const half* s, float* d, std::int64_t n) {
  convert_half_to_float(s, d, static_cast<std::size_t>(n));
}
inline void to_float(const bfloat16* s, float* d, std::int64_t n) {
  convert_bfloat16_to_float(s, d, static_cast<std::size_t>(n));
}
inline void from_float(const float* s, half* d, std::int64_t n) {
  convert_float_to_half(s, d, static_cast<std::size_t>(n));
}
inline void from_float(const float* s, bfloat16* d, std::int64_t n) {
  convert_float_to_bfloat16(s, d, static_cast<std::size_t>(n));
}

// n elements of T at src in the compute type: src itself when T is its own compute type,
// else widened into buf (resized to n). For kernels that read rows or blocks in float32.
template <typename T>
const compute_t<T>* as_compute(const T* src, std::int64_t n, std::vector<compute_t<T>>& buf) {
  if constexpr (kReduced<T>) {
    buf.resize(static_cast<std::size_t>(n));
    to_float(src, buf.data(), n);
    return buf.data();
  } else {
    return src;
  }
}
// n compute-type values written to T (rounded once for the 16-bit floats).
template <typename T>
void from_compute(const compute_t<T>* src, T* dst, std::int64_t n) {
  if constexpr (kReduced<T>)
    from_float(src, dst, n);
  else
    std::copy(src, src + n, dst);
}

// The seed of a counter-based random kernel (kernels.h): `seed`, or the bits of the int64
// element of `at` when it is defined (read now: a captured step's replays write it first).
inline std::uint64_t seed_of(std::uint64_t seed, const Tensor& at) {
  return at.defined()
             ? static_cast<std::uint64_t>(*static_cast<const std::int64_t*>(at.const_data_ptr()))
             : seed;
}

// --- Parallel loops ----------------------------------------------------------------------
// A loop too small for threads runs on the calling thread outside any OpenMP region: an
// `omp parallel if (false)` still makes libgomp start and end a team of one, which ends with
// a futex wake, a system call per region (measured: a few per kernel call, most of a small
// model's step on a virtual machine, where system calls are slow).

// body(i) for each i in [0, count): in parallel (static schedule) when `parallel`.
template <typename Body>
void parallel_for(std::int64_t count, bool parallel, Body&& body) {
  if (!parallel) {
    for (std::int64_t i = 0; i < count; ++i) body(i);
    return;
  }
#pragma omp parallel for schedule(static)
  for (std::int64_t i = 0; i < count; ++i) body(i);
}

// Runs body(begin, end) over [0, n) in blocks of kBlock, in parallel for large n.
template <typename Body>
void parallel_blocks(std::int64_t n, Body&& body) {
  parallel_for((n + kBlock - 1) / kBlock, n > kParallelGrain, [&](std::int64_t blk) {
    const std::int64_t begin = blk * kBlock;
    body(begin, std::min(n, begin + kBlock));
  });
}

// body(r) for each row r in [0, rows), in parallel (static schedule) when the loop's work
// (the elements it touches) is more than kParallelGrain and there is more than one row.
template <typename Body>
void parallel_rows(std::int64_t rows, std::int64_t work, Body&& body) {
  parallel_for(rows, work > kParallelGrain && rows > 1, body);
}

// region() on a team of threads when `parallel`; otherwise on the calling thread, outside
// any region when it is in none (a worksharing construct inside region() then binds to the
// implicit team of that one thread), or in a region of one nested in the caller's.
template <typename Region>
void parallel_region(bool parallel, Region&& region) {
  if (!parallel && omp_get_level() == 0) {
    region();
    return;
  }
#pragma omp parallel if (parallel)
  region();
}

// The per-thread buffers of a loop over rows: `in` for as_compute, and out(n), room for a
// row of n results before from_compute stores it. Both grow on first use, once per thread.
template <typename C>
struct RowBuffers {
  std::vector<C> in, results;
  C* out(std::int64_t n) {
    results.resize(static_cast<std::size_t>(n));
    return results.data();
  }
};

// body(r, buffers) for each row r in [0, rows) of n elements, each thread with RowBuffers
// of its own; in parallel when the rows hold more than kParallelGrain elements.
template <typename C, typename Body>
void for_each_row(std::int64_t rows, std::int64_t n, Body&& body) {
  if (rows * n <= kParallelGrain) {
    RowBuffers<C> buffers;
    for (std::int64_t r = 0; r < rows; ++r) body(r, buffers);
    return;
  }
#pragma omp parallel
  {
    RowBuffers<C> buffers;
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) body(r, buffers);
  }
}

// Splits [0, units) into one contiguous, near-equal range per thread of a parallel region
// (one thread when the n elements behind them are at most kParallelGrain) and calls
// body(begin, end) on each thread whose range is not empty.
template <typename Body>
void parallel_ranges(std::int64_t n, std::int64_t units, Body&& body) {
  const int nt = n > kParallelGrain ? omp_get_max_threads() : 1;
  if (nt == 1) {
    if (units > 0) body(std::int64_t{0}, units);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    const std::int64_t t = omp_get_thread_num(), tn = omp_get_num_threads();
    const std::int64_t u0 = units * t / tn, u1 = units * (t + 1) / tn;
    if (u0 < u1) body(u0, u1);
  }
}

// --- Arithmetic ----------------------------------------------------------------------------

// a + b; for integers wrapping modulo 2^bits through the unsigned type (no UB on overflow).
template <typename T>
T wrap_add(T a, T b) {
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
  } else {
    return a + b;
  }
}

// --- float32 math that vectorises -------------------------------------------------------
// Written so that GCC vectorises loops over it without -ffast-math: no calls, no branches,
// and no float operation whose result feeds only one arm of a ?: (GCC sinks it into a
// branch, which blocks if-conversion); such selects are bit blends instead. float64 uses
// the C library.

// c ? a : b through bit masks (both a and b are computed).
template <typename T>
MIXTAPE_ALWAYS_INLINE T blend(bool c, T a, T b) {
  using U = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
  const U m = U(0) - static_cast<U>(c);
  return std::bit_cast<T>((std::bit_cast<U>(a) & m) | (std::bit_cast<U>(b) & ~m));
}

// exp(x) = 2^k exp(r): k = round(x / ln2), read from the bits of x / ln2 + 1.5 * 2^23 (no
// float -> int conversion, so no undefined behaviour for any x); r = x - k ln2 with ln2
// split in two so that k * hi is exact; exp(r) by its degree-7 Taylor polynomial (|r| <=
// ln2 / 2: truncation < 1e-8 relative); 2^k applied in two halves so that subnormal
// results round once. Measured over a sweep of all floats: <= 1.22 ulp. Overflows to inf
// above ~88.72, underflows to 0 below ~-103.97; NaN stays NaN.
MIXTAPE_ALWAYS_INLINE float exp_f32(float x) {
  const float t = x * 1.44269504088896341f;
  const std::int32_t k =
      static_cast<std::int32_t>(std::bit_cast<std::uint32_t>(t + 12582912.0f)) - 0x4B400000;
  const float kf = static_cast<float>(k);
  const float r = (x - kf * 0.693359375f) - kf * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const std::int32_t k1 = k >> 1, k2 = k - k1;  // each in [-75, 75] where it matters
  const float s1 = std::bit_cast<float>(static_cast<std::uint32_t>(k1 + 127) << 23);
  const float s2 = std::bit_cast<float>(static_cast<std::uint32_t>(k2 + 127) << 23);
  const float y = p * s1 * s2;  // garbage beyond the range, replaced below
  const float inf = std::numeric_limits<float>::infinity();
  return blend(std::isnan(x), x, blend(x > 89.0f, inf, blend(x < -104.0f, 0.0f, y)));
}

// exp in T: exp_f32 for float32 (vectorises), the C library otherwise.
template <typename T>
MIXTAPE_ALWAYS_INLINE T exp_any(T x) {
  if constexpr (std::is_same_v<T, float>)
    return exp_f32(x);
  else
    return std::exp(x);
}

}  // namespace mixtape::cpu
