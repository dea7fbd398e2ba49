// half / bfloat16 conversions: portable bit-exact scalar code, plus bulk routines that use
// F16C and AVX2 on x86-64 when the CPU has them (picked at run time) and OpenMP for big arrays.
//
// NaN policy (shared by every path so that bulk and scalar results are bit-identical, and
// matching what the F16C instructions do): the sign is kept, the result is a quiet NaN, and
// the top payload bits that fit are preserved.
#include "mixtape/core/half.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace mixtape {

namespace detail {

float round_to_odd_float(double v) {
  float f = static_cast<float>(v);
  if (std::isnan(v) || static_cast<double>(f) == v) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(v)) f = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
}

namespace {

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

}  // namespace

std::uint16_t float_to_half_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const auto sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;

  if (a >= 0x7F800000u) {
    if (a == 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // +-inf
    // NaN: quiet bit set, top 9 payload bits kept.
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  }
  // 65520 (halfway between 65504 and 2^16) and above round to inf.
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);

  if (a >= 0x38800000u) {
    // Normal half (>= 2^-14): rebias the exponent (127 -> 15), then round away 13 bits.
    // A carry out of the mantissa correctly bumps the exponent.
    std::uint32_t v = a - 0x38000000u;
    v += 0x0FFFu + ((v >> 13) & 1u);
    return static_cast<std::uint16_t>(sign | (v >> 13));
  }

  // Subnormal half or zero. At or below 2^-25 (half the smallest subnormal) rounds to 0.
  if (a <= 0x33000000u) return sign;
  // Here a is a normal float in (2^-25, 2^-14); result = round(m * 2^(e - 150) / 2^-24).
  const std::uint32_t e = a >> 23;                      // 102 .. 112
  const std::uint32_t m = (a & 0x7FFFFFu) | 0x800000u;  // implicit leading one
  const std::uint32_t shift = 126u - e;                 // 14 .. 24
  std::uint32_t q = m >> shift;
  const std::uint32_t rem = m & ((1u << shift) - 1u);
  const std::uint32_t halfway = 1u << (shift - 1u);
  if (rem > halfway || (rem == halfway && (q & 1u))) ++q;  // may carry into 0x0400 (normal)
  return static_cast<std::uint16_t>(sign | q);
}

float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t e = (h >> 10) & 0x1Fu;
  std::uint32_t m = h & 0x3FFu;

  if (e == 0x1Fu) {
    if (m == 0) return bits_float(sign | 0x7F800000u);  // +-inf
    return bits_float(sign | 0x7FC00000u | (m << 13));  // quiet NaN, payload kept
  }
  if (e == 0) {
    if (m == 0) return bits_float(sign);  // +-0
    // Subnormal: shift the leading one up to bit 10 and lower the exponent to match.
    const auto s = static_cast<std::uint32_t>(std::countl_zero(static_cast<std::uint16_t>(m))) - 5u;
    m = (m << s) & 0x3FFu;
    return bits_float(sign | ((113u - s) << 23) | (m << 13));
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

std::uint16_t float_to_bfloat16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    // NaN: keep the top bits, force the quiet bit so that truncation cannot give inf.
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  // Round to nearest even on the low 16 bits; overflow carries into inf naturally.
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace detail

namespace {

// Scalar kernels: used for tails and on CPUs without the vector extensions.
void half_to_float_scalar(const half* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = detail::half_bits_to_float(src[i].bits);
}
void float_to_half_scalar(const float* src, half* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i].bits = detail::float_to_half_bits(src[i]);
}
void bf16_to_float_scalar(const bfloat16* src, float* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = detail::bfloat16_bits_to_float(src[i].bits);
}
void float_to_bf16_scalar(const float* src, bfloat16* dst, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) dst[i].bits = detail::float_to_bfloat16_bits(src[i]);
}

#if defined(__x86_64__)

// half and bfloat16 are plain 16-bit wrappers, so arrays of them can be loaded as integers.
static_assert(sizeof(half) == 2 && sizeof(bfloat16) == 2);

// The vector kernels below start on a 64-byte boundary (aligned(64)): their short loops run
// at a speed that otherwise depends on where the linker happens to place them. Measured: a
// change elsewhere in the library moved float_to_bf16_avx512 and made bfloat16 masked softmax
// (bench/bench_attention.cpp) 6% slower with the same instructions; aligned, the two builds
// ran alike.

bool cpu_has_avx2_f16c() {
  __builtin_cpu_init();
  // F16C is CPUID leaf 1, ECX bit 29; read directly because not every compiler's
  // __builtin_cpu_supports knows "f16c". The avx2 check also covers OS support for YMM state.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  return f16c && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool use_vector() {
  static const bool ok = cpu_has_avx2_f16c();
  return ok;
}

__attribute__((target("avx2,f16c,fma"), aligned(64))) void half_to_float_avx2(const half* src,
                                                                              float* dst,
                                                                              std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 8));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(a));
    _mm256_storeu_ps(dst + i + 8, _mm256_cvtph_ps(b));
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(a));
  }
  half_to_float_scalar(src + i, dst + i, n - i);
}

__attribute__((target("avx2,f16c,fma"), aligned(64))) void float_to_half_avx2(const float* src,
                                                                              half* dst,
                                                                              std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    const __m128i b = _mm256_cvtps_ph(_mm256_loadu_ps(src + i + 8), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i + 8), b);
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i a = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), a);
  }
  float_to_half_scalar(src + i, dst + i, n - i);
}

__attribute__((target("avx2,f16c,fma"), aligned(64))) void bf16_to_float_avx2(const bfloat16* src,
                                                                              float* dst,
                                                                              std::size_t n) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), w);
  }
  bf16_to_float_scalar(src + i, dst + i, n - i);
}

// Eight float32 -> eight bf16 values in the low 16 bits of each 32-bit lane; same rules as
// detail::float_to_bfloat16_bits.
__attribute__((target("avx2,f16c,fma"))) inline __m256i bf16_round8(__m256i u) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7FFF);
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i inf = _mm256_set1_epi32(0x7F800000);
  const __m256i quiet = _mm256_set1_epi32(0x0040);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(bias, lsb)), 16);
  const __m256i nan_val = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
  // |u| > inf as signed ints (both sides non-negative) picks out NaNs.
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
  return _mm256_blendv_epi8(rounded, nan_val, is_nan);
}

__attribute__((target("avx2,f16c,fma"), aligned(64))) void float_to_bf16_avx2(const float* src,
                                                                              bfloat16* dst,
                                                                              std::size_t n) {
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = bf16_round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    const __m256i b =
        bf16_round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8)));
    // Lanes hold values <= 0xFFFF, so unsigned-saturating packs are exact; packing works per
    // 128-bit half, so reorder the 64-bit quarters back into sequence afterwards.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), packed);
  }
  float_to_bf16_scalar(src + i, dst + i, n - i);
}

// The CPU's own float32 -> bfloat16 instruction (AVX512-BF16's vcvtneps2bf16), sixteen at a
// time. It rounds to nearest even and quiets NaNs as detail::float_to_bfloat16_bits does,
// but flushes subnormal inputs to zero (and the rule here keeps them: bfloat16 has
// float32's exponent range): lanes whose exponent field is zero are rounded with the
// integer rule instead. Written by hand because no library converts with mixtape's rules.
bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

bool use_avx512_bf16() {
  static const bool ok = cpu_has_avx512_bf16();
  return ok;
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"), aligned(64))) void
float_to_bf16_avx512(const float* src, bfloat16* dst, std::size_t n) {
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __m512i bias = _mm512_set1_epi32(0x7FFF);
  const __m512i one = _mm512_set1_epi32(1);
  std::size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    __m256i r = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
    const __m512i u = _mm512_castps_si512(x);
    // Zeros and subnormals: (u + 0x7FFF + lsb) >> 16 (no NaN among them). The masked
    // forms with every lane set: the plain ones start from an undefined register, which
    // GCC 12 reports as maybe-uninitialized.
    if (const __mmask16 tiny = _mm512_testn_epi32_mask(u, exponent)) {
      const __mmask16 all = 0xFFFF;
      const __m512i lsb = _mm512_and_si512(_mm512_maskz_srli_epi32(all, u, 16), one);
      const __m512i rounded =
          _mm512_maskz_srli_epi32(all, _mm512_add_epi32(u, _mm512_add_epi32(bias, lsb)), 16);
      r = _mm256_mask_blend_epi16(tiny, r, _mm512_maskz_cvtepi32_epi16(all, rounded));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), r);
  }
  float_to_bf16_scalar(src + i, dst + i, n - i);
}

#endif  // __x86_64__

// Arrays above this many elements are split over the OpenMP threads.
constexpr std::size_t kParallelMin = std::size_t{1} << 16;
// Per-task block size (a multiple of 16 so that only the last block has a scalar tail).
constexpr std::size_t kBlock = std::size_t{1} << 14;

// Runs kernel(src + b, dst + b, len) over blocks of [0, n), in parallel for large n.
template <typename Src, typename Dst, typename Kernel>
void run_blocked(const Src* src, Dst* dst, std::size_t n, Kernel kernel) {
  if (n <= kParallelMin) {
    kernel(src, dst, n);
    return;
  }
  const auto blocks = static_cast<std::ptrdiff_t>((n + kBlock - 1) / kBlock);
  // At least kParallelMin elements per thread: these loops are memory bound, and extra
  // threads on a medium array cost more in start-up and barriers than they save.
  int threads = 1;
#if defined(_OPENMP)
  const auto wanted = static_cast<int>(std::min<std::size_t>(n / kParallelMin, 1024));
  threads = std::max(1, std::min(omp_get_max_threads(), wanted));
#endif
  (void)threads;  // unused when built without OpenMP
#pragma omp parallel for schedule(static) num_threads(threads) if (n > kParallelMin)
  for (std::ptrdiff_t b = 0; b < blocks; ++b) {
    const std::size_t begin = static_cast<std::size_t>(b) * kBlock;
    const std::size_t len = n - begin < kBlock ? n - begin : kBlock;
    kernel(src + begin, dst + begin, len);
  }
}

}  // namespace

void convert_half_to_float(const half* src, float* dst, std::size_t n) {
#if defined(__x86_64__)
  if (use_vector()) return run_blocked(src, dst, n, half_to_float_avx2);
#endif
  run_blocked(src, dst, n, half_to_float_scalar);
}

void convert_float_to_half(const float* src, half* dst, std::size_t n) {
#if defined(__x86_64__)
  if (use_vector()) return run_blocked(src, dst, n, float_to_half_avx2);
#endif
  run_blocked(src, dst, n, float_to_half_scalar);
}

void convert_bfloat16_to_float(const bfloat16* src, float* dst, std::size_t n) {
#if defined(__x86_64__)
  if (use_vector()) return run_blocked(src, dst, n, bf16_to_float_avx2);
#endif
  run_blocked(src, dst, n, bf16_to_float_scalar);
}

void convert_float_to_bfloat16(const float* src, bfloat16* dst, std::size_t n) {
#if defined(__x86_64__)
  if (use_avx512_bf16()) return run_blocked(src, dst, n, float_to_bf16_avx512);
  if (use_vector()) return run_blocked(src, dst, n, float_to_bf16_avx2);
#endif
  run_blocked(src, dst, n, float_to_bf16_scalar);
}

bool has_f16c() {
#if defined(__x86_64__)
  return use_vector();
#else
  return false;
#endif
}

}  // namespace mixtape
