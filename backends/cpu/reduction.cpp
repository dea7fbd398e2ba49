// CPU reduction kernels (sum, mean, max, min, argmax over the middle extent of
// [outer, n, inner]) and row kernels (softmax, log_softmax over the last axis).
//
// Accumulation: sums of float32, float16 and bfloat16 accumulate in float64 (16-bit
// inputs are bulk-converted to float32 first), which is at least as accurate as the
// float32 the kernel contract asks for and keeps a 1e7-element float32 sum exact to
// float32 rounding; float64 sums accumulate in float64 and integer sums in 64 bits
// (wrapping). The result is rounded to the dtype once, at the end.
//
// NaN: max and min propagate NaN (any NaN in the reduced extent gives NaN), and argmax
// returns the index of the first NaN when there is one; otherwise argmax returns the
// first index of the maximum.
//
// Work split: with inner == 1 each output reduces a contiguous row, in chunks of kChunk
// (partials combined in order); with inner > 1 the rows x[o, j, :] are accumulated into
// a per-column buffer of kCols columns (vectorised across columns), and when that gives
// too few tasks for the threads the n extent is split into blocks as well.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "backends/cpu/cpu_util.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// kBlock (cpu_util.h): conversion buffer size (elements).
constexpr int64_t kChunk = 16384;  // row elements per task when inner == 1
constexpr int64_t kCols = 1024;    // columns per task when inner > 1

template <typename C>
bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>)
    return std::isnan(v);  // vectorises, v != v not
  else
    return false;
}

// --- Reducers: Acc (the accumulator), init, add (one element at index j), merge (a
// later partial into an earlier one), result. kLanes independent accumulators are used
// along contiguous rows so that the loop vectorises.

template <typename C>
struct SumR {
  using Acc = std::conditional_t<std::is_integral_v<C>, std::uint64_t, double>;
  static constexpr int kLanes = 8;
  static Acc init() { return Acc(0); }
  static void add(Acc& a, C v, int64_t) { a += static_cast<Acc>(v); }
  static void merge(Acc& a, const Acc& b) { a += b; }
  static Acc result(const Acc& a, int64_t) { return a; }
};

template <typename C>
struct MeanR : SumR<C> {
  static double result(double a, int64_t n) { return a / static_cast<double>(n); }
};

// max (kMax) or min; a NaN wins and stays.
template <typename C, bool kMax>
struct ExtremumR {
  using Acc = C;
  static constexpr int kLanes = 8;
  static Acc init() {
    if constexpr (std::is_floating_point_v<C>)
      return kMax ? -std::numeric_limits<C>::infinity() : std::numeric_limits<C>::infinity();
    else
      return kMax ? std::numeric_limits<C>::lowest() : std::numeric_limits<C>::max();
  }
  static void add(Acc& a, C v, int64_t) { a = ((kMax ? v > a : v < a) | is_nan(v)) ? v : a; }
  static void merge(Acc& a, const Acc& b) { add(a, b, 0); }
  static Acc result(const Acc& a, int64_t) { return a; }
};
template <typename C>
using MaxR = ExtremumR<C, true>;
template <typename C>
using MinR = ExtremumR<C, false>;

// (value, index) of the first maximum (or first NaN); index -1 while empty.
template <typename C>
struct ArgmaxR {
  struct Acc {
    C v;
    int64_t i;
  };
  static constexpr int kLanes = 1;  // sequential: keeps "first" simple
  static Acc init() { return {C(0), -1}; }
  static bool better(C v, const Acc& a) {
    return a.i < 0 || v > a.v || (is_nan(v) && !is_nan(a.v));
  }
  static void add(Acc& a, C v, int64_t j) {
    if (better(v, a)) a = {v, j};
  }
  static void merge(Acc& a, const Acc& b) {
    if (b.i >= 0 && better(b.v, a)) a = b;
  }
  static int64_t result(const Acc& a, int64_t) { return a.i; }
};

// Reduces x[0, len) (compute type) whose first element has index j0.
template <typename R, typename C>
typename R::Acc span(const C* x, int64_t len, int64_t j0) {
  constexpr int L = R::kLanes;
  typename R::Acc lane[L];
  for (int k = 0; k < L; ++k) lane[k] = R::init();
  int64_t i = 0;
  for (; i + L <= len; i += L)
    for (int k = 0; k < L; ++k) R::add(lane[k], x[i + k], j0 + i + k);
  typename R::Acc a = lane[0];
  for (int k = 1; k < L; ++k) R::merge(a, lane[k]);
  for (; i < len; ++i) R::add(a, x[i], j0 + i);
  return a;
}

// As span, for storage type T (16-bit floats are converted a block at a time).
template <typename R, typename T>
typename R::Acc row_span(const T* x, int64_t len, int64_t j0) {
  if constexpr (kReduced<T>) {
    typename R::Acc a = R::init();
    float buf[kBlock];
    for (int64_t b = 0; b < len; b += kBlock) {
      const int64_t m = std::min(kBlock, len - b);
      to_float(x + b, buf, m);
      R::merge(a, span<R>(buf, m, j0 + b));
    }
    return a;
  } else {
    return span<R>(x, len, j0);
  }
}

// One task of reduce_kernel: rows [j0, j1) of the columns [c0, c0 + nc) (nc <= kCols) of a
// slab of rows `inner` wide, reduced into dst[0 .. nc).
template <typename T, typename R>
void reduce_tile(const T* slab, int64_t inner, int64_t j0, int64_t j1, int64_t c0, int64_t nc,
                 typename R::Acc* dst) {
  typename R::Acc acc[kCols];
  for (int64_t c = 0; c < nc; ++c) acc[c] = R::init();
  if constexpr (kReduced<T>) {
    // Whole rows (nc == inner) lie next to each other: convert up to a buffer of them at
    // once (a bias gradient's rows are 32 or 64 wide; one conversion call per row cost
    // three times the float32 reduction). Same additions, same order.
    const int64_t rows_per_buf = nc == inner ? std::max<int64_t>(1, kCols / inner) : 1;
    float buf[kCols];
    for (int64_t j = j0; j < j1; j += rows_per_buf) {
      const int64_t jr = std::min(j1, j + rows_per_buf);
      if (nc == inner) {
        to_float(slab + j * inner, buf, (jr - j) * inner);
      } else {
        to_float(slab + j * inner + c0, buf, nc);
      }
      for (int64_t r = j; r < jr; ++r) {
        const float* b = buf + (r - j) * nc;
        for (int64_t c = 0; c < nc; ++c) R::add(acc[c], b[c], r);
      }
    }
  } else {
    for (int64_t j = j0; j < j1; ++j) {
      const T* row = slab + j * inner + c0;
      for (int64_t c = 0; c < nc; ++c) R::add(acc[c], row[c], j);
    }
  }
  std::copy(acc, acc + nc, dst);
}

// T: x's storage type; R: the reducer (on the compute type); O: out's storage type.
template <typename T, template <typename> class RT, typename O = T>
void reduce_kernel(const Tensor& x, int64_t outer, int64_t n, int64_t inner, const Tensor& out) {
  using C = compute_t<T>;
  using R = RT<C>;
  using Acc = typename R::Acc;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  O* yp = static_cast<O*>(out.data_ptr());
  const int64_t total = outer * n * inner;
  if (outer * inner == 0) return;
  const int nt = total > kParallelGrain ? omp_get_max_threads() : 1;

  // Tasks: (o, column block, row block).
  int64_t col_blocks = 1, cols = 1, row_blocks = 1;
  if (inner == 1) {
    row_blocks = (n + kChunk - 1) / kChunk;
  } else {
    cols = std::min(kCols, inner);
    col_blocks = (inner + cols - 1) / cols;
    const int64_t tiles = outer * col_blocks;
    if (nt > 1 && tiles < 2 * nt) row_blocks = std::min(n, (2 * nt + tiles - 1) / tiles);
  }
  const int64_t rows_per = (n + row_blocks - 1) / row_blocks;
  row_blocks = (n + rows_per - 1) / rows_per;

  // Partials, [outer, row_blocks, inner].
  std::vector<Acc> part(static_cast<std::size_t>(outer * row_blocks * inner));
  const int64_t tasks = outer * col_blocks * row_blocks;
  parallel_for(tasks, nt > 1, [&](int64_t t) {
    const int64_t rb = t % row_blocks, cb = t / row_blocks % col_blocks;
    const int64_t o = t / row_blocks / col_blocks;
    const int64_t j0 = rb * rows_per, j1 = std::min(n, j0 + rows_per);
    Acc* dst = part.data() + (o * row_blocks + rb) * inner;
    if (inner == 1) {
      dst[0] = row_span<R>(xp + o * n + j0, j1 - j0, j0);
      return;
    }
    const int64_t c0 = cb * cols;
    reduce_tile<T, R>(xp + o * n * inner, inner, j0, j1, c0, std::min(cols, inner - c0), dst + c0);
  });

  // Combine the row blocks in order and store, a block of outputs at a time.
  const int64_t m = outer * inner;
  const int64_t blocks = (m + kBlock - 1) / kBlock;
  parallel_for(blocks, nt > 1 && m * row_blocks > kParallelGrain, [&](int64_t blk) {
    const int64_t q0 = blk * kBlock, q1 = std::min(m, q0 + kBlock);
    float fbuf[kBlock];
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t o = q / inner, i = q % inner;
      const Acc* p = part.data() + o * row_blocks * inner + i;
      Acc a = p[0];
      for (int64_t rb = 1; rb < row_blocks; ++rb) R::merge(a, p[rb * inner]);
      if constexpr (kReduced<O>)
        fbuf[q - q0] = static_cast<float>(R::result(a, n));
      else
        yp[q] = static_cast<O>(R::result(a, n));
    }
    if constexpr (kReduced<O>) from_float(fbuf, yp + q0, q1 - q0);
  });
}

// --- softmax / log_softmax ------------------------------------------------------------

// exp_any (cpu_util.h): float32 through the vectorising exp_f32.

// One row in compute type C (y may alias x): m = max, e = exp(x - m) a block at a time
// into a stack buffer, summed in float64 lanes; then y = e / sum, or (x - m) - log(sum)
// (x - m first: exact near the maximum, where the result is smallest). A row holding NaN,
// or only -inf, gives NaN.
template <typename C, bool kLog>
void softmax_row(const C* x, C* y, int64_t n) {
  const C m = span<MaxR<C>>(x, n, 0);
  double sum = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t len = std::min(kBlock, n - b);
    C e[kBlock];
    for (int64_t j = 0; j < len; ++j) e[j] = exp_any(x[b + j] - m);
    sum += span<SumR<C>>(e, len, 0);
    if constexpr (!kLog) std::copy(e, e + len, y + b);
  }
  if constexpr (kLog) {
    const C ls = static_cast<C>(std::log(sum));
    for (int64_t i = 0; i < n; ++i) y[i] = (x[i] - m) - ls;
  } else {
    const C inv = static_cast<C>(1.0 / sum);
    for (int64_t i = 0; i < n; ++i) y[i] *= inv;
  }
}

template <typename T, bool kLog>
void softmax_kernel(const Tensor& x, const Tensor& out) {
  const int64_t numel = x.numel();
  if (numel == 0) return;
  const int64_t cols = x.rank() == 0 ? 1 : x.shape().back();
  const int64_t rows = numel / cols;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  parallel_region(numel > kParallelGrain, [&] {
    std::vector<float> buf(kReduced<T> ? static_cast<std::size_t>(cols) : 0);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      if constexpr (kReduced<T>) {
        to_float(xp + r * cols, buf.data(), cols);
        softmax_row<float, kLog>(buf.data(), buf.data(), cols);
        from_float(buf.data(), yp + r * cols, cols);
      } else {
        softmax_row<T, kLog>(xp + r * cols, yp + r * cols, cols);
      }
    }
  });
}

// masked_softmax: one row of n in compute type C, m (0/1 bytes) the mask or null. The
// softmax of the unmasked values times `scale`; 0 at the masked positions and everywhere in
// a row with none. Each pass is an omp simd loop of selects, not skips, so that it
// vectorises (exp_f32 included; the selects are cpu_util.h's bit blends): a masked value is loaded
// but never used (a NaN there stays out); it enters the maximum as -inf and the sum as exp(-inf) =
// 0. A NaN among the unmasked values makes the sum, so the row, NaN, as softmax does; so do
// unmasked values that are all -inf (exp(-inf - -inf)) and a +inf (exp(inf - inf)).
template <typename C>
MIXTAPE_ALWAYS_INLINE void masked_softmax_row_impl(const C* x, const std::uint8_t* m, C scale,
                                                   C* buf, C* y, int64_t n) {
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  C mx = kNegInf;
  if (m) {
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) {
      const C v = blend(m[j] != 0, x[j] * scale, kNegInf);
      buf[j] = v;
      mx = v > mx ? v : mx;
    }
    if (mx == kNegInf && std::none_of(m, m + n, [](std::uint8_t b) { return b != 0; })) {
      std::fill(y, y + n, C(0));  // wholly masked
      return;
    }
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t j = 0; j < n; ++j) {
      const C v = x[j] * scale;
      buf[j] = v;
      mx = v > mx ? v : mx;
    }
  }
  double sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    buf[j] = exp_any(buf[j] - mx);
    sum += static_cast<double>(buf[j]);
  }
  const C inv = static_cast<C>(1.0 / sum);
  if (m) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = blend(m[j] != 0, buf[j] * inv, C(0));
  } else {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = buf[j] * inv;
  }
}

template <typename C>
void masked_softmax_row(const C* x, const std::uint8_t* m, C scale, C* buf, C* y, int64_t n) {
  masked_softmax_row_impl(x, m, scale, buf, y, n);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
// The AVX2 build: 8 lanes instead of 4 (1.7x the SSE2 build's float32 forward on [64, 4, 64,
// 64] causal scores, bench/bench_attention.cpp; docs/benchmarks.md).
template <typename C>
__attribute__((target("avx2,fma"))) void masked_softmax_row_avx2(const C* x, const std::uint8_t* m,
                                                                 C scale, C* buf, C* y, int64_t n) {
  masked_softmax_row_impl(x, m, scale, buf, y, n);
}
#endif

template <typename T>
void masked_softmax_kernel(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) {
  const int64_t numel = x.numel();
  if (numel == 0) return;
  const int64_t cols = x.shape().back();
  const int64_t rows = numel / cols;
  using C = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const auto* mp =
      mask.defined() ? static_cast<const std::uint8_t*>(mask.const_data_ptr()) : nullptr;
  T* yp = static_cast<T*>(out.data_ptr());
  auto* row = &masked_softmax_row<C>;
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) row = &masked_softmax_row_avx2<C>;
#endif
  parallel_region(numel > kParallelGrain, [&] {
    std::vector<C> in(kReduced<T> ? static_cast<std::size_t>(cols) : 0);
    std::vector<C> buf(static_cast<std::size_t>(cols)), res(static_cast<std::size_t>(cols));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const std::uint8_t* mr = mp ? mp + r * cols : nullptr;
      if constexpr (kReduced<T>) {
        to_float(xp + r * cols, in.data(), cols);
        row(in.data(), mr, static_cast<C>(scale), buf.data(), res.data(), cols);
        from_float(res.data(), yp + r * cols, cols);
      } else {
        row(xp + r * cols, mr, static_cast<C>(scale), buf.data(), yp + r * cols, cols);
      }
    }
  });
}

}  // namespace

void register_reduction_kernels() {
  MIXTAPE_CPU_KERNEL(sum, reduce_kernel, SumR);
  MIXTAPE_CPU_KERNEL(mean, reduce_kernel, MeanR);
  MIXTAPE_CPU_KERNEL(max, reduce_kernel, MaxR);
  MIXTAPE_CPU_KERNEL(min, reduce_kernel, MinR);
  MIXTAPE_CPU_KERNEL(argmax, reduce_kernel, ArgmaxR, std::int64_t);
  MIXTAPE_CPU_KERNEL(softmax, softmax_kernel, false);
  MIXTAPE_CPU_KERNEL(log_softmax, softmax_kernel, true);
  MIXTAPE_CPU_KERNEL(masked_softmax, masked_softmax_kernel);
}

}  // namespace mixtape::cpu
