// CPU memory kernels: copy (strided -> contiguous), fill and cast.
//
// Conversion rules shared by fill and cast:
//  - to float16/bfloat16: correctly rounded (nearest, ties to even) from any source.
//    float32 sources go through the bulk converters of half.h; wider sources (float64,
//    int32, int64) are first rounded to float32 "to odd" (truncate, then set the last bit
//    when inexact), which makes the second rounding to 16 bits exact-once.
//  - floating -> integer truncates toward zero and saturates at the integer's range;
//    NaN becomes 0 (C++ leaves both undefined).
//  - integer -> narrower integer wraps modulo 2^bits (C++20 conversion rules).
//  - anything -> bool is (x != 0) (NaN is true); bool is stored as one byte, 0 or 1.
//  - to float8 (e4m3fn, e5m2): correctly rounded and saturating (mixtape/core/float8.h),
//    through float32 as the 16-bit formats are (float64 and integers rounded to odd
//    first: 24 bits hold the 3 or 2 mantissa bits plus the two a correct second rounding
//    needs). From float8: exact to every floating dtype, then as from float32.
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "backends/cpu/cpu_util.h"
#include "core/strided_layout.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// The storage type of each dtype (the host type map); bool is handled as its byte.
template <DType::Code C>
using elem_t = element_t<C>;

constexpr bool is_reduced(DType::Code c) { return c == DType::Float16 || c == DType::BFloat16; }
constexpr bool is_float8(DType::Code c) {
  return c == DType::Float8E4M3FN || c == DType::Float8E5M2;
}
constexpr bool is_float(DType::Code c) {
  return c == DType::Float32 || c == DType::Float64 || is_reduced(c);
}

// --- Scalar conversions ------------------------------------------------------------

// double -> float rounded to odd (core's, mixtape/core/half.h).
float round_to_odd(double v) { return detail::round_to_odd_float(v); }

// int64 -> float rounded to odd, through a double rounded to odd (53 > 24 + 1 bits,
// so the two odd roundings compose).
float round_to_odd(int64_t v) {
  constexpr int64_t kExact = int64_t{1} << 53;
  if (v > -kExact && v < kExact) return round_to_odd(static_cast<double>(v));
  const bool neg = v < 0;
  const std::uint64_t mag = neg ? 0 - static_cast<std::uint64_t>(v) : static_cast<std::uint64_t>(v);
  const int shift = std::bit_width(mag) - 53;
  std::uint64_t mant = mag >> shift;
  if (mag & ((std::uint64_t{1} << shift) - 1)) mant |= 1;  // sticky
  const double d = std::ldexp(static_cast<double>(mant), shift);
  return round_to_odd(neg ? -d : d);
}

// A source value as a float32 that rounds correctly to float16/bfloat16.
template <DType::Code S>
float to_float_for_reduced(elem_t<S> v) {
  if constexpr (S == DType::Float64)
    return round_to_odd(v);
  else if constexpr (S == DType::Int32)
    return round_to_odd(static_cast<double>(v));
  else if constexpr (S == DType::Int64)
    return round_to_odd(v);
  else
    return static_cast<float>(v);  // float32 (as is), uint8 and bool (exact)
}

// Floating -> integer: truncation toward zero, saturated, NaN -> 0.
template <typename I, typename F>
I saturating_trunc(F v) {
  const double d = static_cast<double>(v);
  if (std::isnan(d)) return 0;
  constexpr double kHi = static_cast<double>(std::numeric_limits<I>::max()) + 1.0;  // 2^digits
  constexpr double kLo = static_cast<double>(std::numeric_limits<I>::min()) - 1.0;
  if (d >= kHi) return std::numeric_limits<I>::max();
  if (d <= kLo) return std::numeric_limits<I>::min();
  return static_cast<I>(d);
}

// One element from a non-reduced source dtype S to a non-reduced destination dtype D.
template <DType::Code S, DType::Code D>
elem_t<D> convert(elem_t<S> v) {
  using Out = elem_t<D>;
  if constexpr (D == DType::Bool) {
    return static_cast<Out>(v != elem_t<S>(0) ? 1 : 0);
  } else if constexpr (is_float(D)) {
    return static_cast<Out>(v);  // float64 -> float32 rounds to nearest; ints round too
  } else if constexpr (is_float(S)) {
    return saturating_trunc<Out>(v);
  } else {
    return static_cast<Out>(v);  // integer -> integer wraps
  }
}

// --- copy ------------------------------------------------------------------------------

// Parallel memcpy of n elements.
template <typename T>
void copy_flat(const T* src, T* dst, int64_t n) {
  constexpr int64_t kChunk = 1 << 16;
  const int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(chunks, n > kParallelGrain, [&](int64_t c) {
    const int64_t b = c * kChunk;
    std::memcpy(dst + b, src + b, static_cast<std::size_t>(std::min(kChunk, n - b)) * sizeof(T));
  });
}

// Batches of 2-D transposes: dst[b, r, c] = src[b, r * 1 + c * sc]. Each 64 x 64 tile is
// read with contiguous runs along r into a local buffer, then written with contiguous runs
// along c, so that every cache line is touched once per tile (large power-of-two strides
// would otherwise alias in the cache). `batch_offset(b)` gives the source offset of batch b.
template <typename T, typename BatchOffset>
void copy_transposed(const T* src, T* dst, int64_t batches, int64_t rows, int64_t cols, int64_t sc,
                     BatchOffset batch_offset) {
  constexpr int64_t kTile = 64;
  const int64_t row_tiles = (rows + kTile - 1) / kTile;
  const int64_t units = batches * row_tiles;
  parallel_for(units, batches * rows * cols > kParallelGrain, [&](int64_t u) {
    const int64_t b = u / row_tiles;
    const int64_t r0 = (u % row_tiles) * kTile, nr = std::min(kTile, rows - r0);
    const T* s = src + batch_offset(b) + r0;
    T* d = dst + (b * rows + r0) * cols;
    T tile[kTile][kTile];  // [c][r]
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t nc = std::min(kTile, cols - c0);
      for (int64_t c = 0; c < nc; ++c) {
        const T* sp = s + (c0 + c) * sc;
        for (int64_t r = 0; r < nr; ++r) tile[c][r] = sp[r];
      }
      for (int64_t r = 0; r < nr; ++r) {
        T* dp = d + r * cols + c0;
        for (int64_t c = 0; c < nc; ++c) dp[c] = tile[c][r];
      }
    }
  });
}

// copy: any strided src -> contiguous dst. T is an unsigned integer of the item size.
template <typename T>
void copy_kernel(const Tensor& src, const Tensor& dst) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  const T* s = static_cast<const T*>(src.const_data_ptr());
  T* d = static_cast<T*>(dst.data_ptr());
  // The source's geometry, merged (core/strided_layout.h); its strides are l.strides[d][0].
  const auto l = detail::coalesce<1>(src.shape(), {&src.strides()});
  const int r = static_cast<int>(l.shape.size());
  if (r == 1 && l.strides[0][0] == 1) return copy_flat(s, d, n);

  // Source offset of row `row` over the outer dims [0, dims).
  auto outer_offset = [&l](int64_t row, int dims) {
    int64_t off = 0;
    for (int k = dims - 1; k >= 0; --k) {
      off += (row % l.shape[k]) * l.strides[k][0];
      row /= l.shape[k];
    }
    return off;
  };

  // A transpose-like innermost pair (the second-innermost dim is the contiguous one).
  if (r >= 2 && l.strides[r - 2][0] == 1 && l.strides[r - 1][0] != 0 && l.shape[r - 1] >= 8) {
    const int64_t rows = l.shape[r - 2], cols = l.shape[r - 1];
    return copy_transposed(s, d, n / (rows * cols), rows, cols, l.strides[r - 1][0],
                           [&](int64_t b) { return outer_offset(b, r - 2); });
  }

  // General: rows of the innermost dim; each thread walks its rows with a counter.
  const int64_t inner = l.shape[r - 1], is = l.strides[r - 1][0];
  const int64_t rows = n / inner;
  parallel_ranges(n, rows, [&](int64_t row0, int64_t row1) {
    std::vector<int64_t> idx(static_cast<std::size_t>(r - 1));
    int64_t rem = row0;
    for (int k = r - 2; k >= 0; --k) {
      idx[k] = rem % l.shape[k];
      rem /= l.shape[k];
    }
    int64_t off = outer_offset(row0, r - 1);
    for (int64_t row = row0; row < row1; ++row) {
      T* out = d + row * inner;
      const T* in = s + off;
      if (is == 1) {
        std::memcpy(out, in, static_cast<std::size_t>(inner) * sizeof(T));
      } else if (is == 0) {
        std::fill_n(out, inner, *in);
      } else {
        for (int64_t i = 0; i < inner; ++i) out[i] = in[i * is];
      }
      for (int k = r - 2; k >= 0; --k) {  // advance the outer counter
        off += l.strides[k][0];
        if (++idx[k] < l.shape[k]) break;
        off -= l.shape[k] * l.strides[k][0];
        idx[k] = 0;
      }
    }
  });
}

// --- fill ------------------------------------------------------------------------------

template <DType::Code D>
elem_t<D> from_double(double v) {
  if constexpr (is_reduced(D) || is_float8(D))
    return elem_t<D>(round_to_odd(v));
  else
    return convert<DType::Float64, D>(v);
}

template <DType::Code D>
void fill_kernel(const Tensor& out, double value) {
  using T = elem_t<D>;
  const T v = from_double<D>(value);
  T* p = static_cast<T*>(out.data_ptr());
  parallel_blocks(out.numel(), [&](int64_t b, int64_t e) { std::fill(p + b, p + e, v); });
}

// --- cast ------------------------------------------------------------------------------

// n values of dtype S as float32: float8 and 16-bit exactly (the 16-bit ones in bulk), wider
// sources rounded to odd so that a further rounding to 16 or 8 bits is correct.
template <DType::Code S>
void load_float(const elem_t<S>* x, float* y, int64_t n) {
  if constexpr (is_reduced(S))
    to_float(x, y, n);
  else if constexpr (is_float8(S))
    for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(x[i]);
  else
    for (int64_t i = 0; i < n; ++i) y[i] = to_float_for_reduced<S>(x[i]);
}

// n float32 values as dtype D (rounded to nearest even; the 16-bit ones in bulk).
template <DType::Code D>
void store_float(const float* x, elem_t<D>* y, int64_t n) {
  if constexpr (is_reduced(D))
    from_float(x, y, n);
  else if constexpr (is_float8(D))
    for (int64_t i = 0; i < n; ++i) y[i] = elem_t<D>(x[i]);
  else
    for (int64_t i = 0; i < n; ++i) y[i] = convert<DType::Float32, D>(x[i]);
}

// One block [0, n) of x (dtype S) -> y (dtype D), n <= kBlock. A float8 or 16-bit type on
// either side goes through float32 (load_float, store_float), directly when the other side
// is float32.
template <DType::Code S, DType::Code D>
void cast_block(const elem_t<S>* x, elem_t<D>* y, int64_t n) {
  constexpr bool kThroughFloat32 = is_reduced(S) || is_reduced(D) || is_float8(S) || is_float8(D);
  if constexpr (S == D) {
    std::memcpy(y, x, static_cast<std::size_t>(n) * sizeof(elem_t<S>));
  } else if constexpr (kThroughFloat32 && D == DType::Float32) {
    load_float<S>(x, y, n);
  } else if constexpr (kThroughFloat32 && S == DType::Float32) {
    store_float<D>(x, y, n);
  } else if constexpr (kThroughFloat32) {
    float buf[kBlock];
    load_float<S>(x, buf, n);
    store_float<D>(buf, y, n);
  } else {
    for (int64_t i = 0; i < n; ++i) y[i] = convert<S, D>(x[i]);
  }
}

template <DType::Code S, DType::Code D>
void cast_to(const Tensor& x, const Tensor& out) {
  const auto* xp = static_cast<const elem_t<S>*>(x.const_data_ptr());
  auto* yp = static_cast<elem_t<D>*>(out.data_ptr());
  parallel_blocks(x.numel(),
                  [&](int64_t b, int64_t e) { cast_block<S, D>(xp + b, yp + b, e - b); });
}

template <DType::Code S>
void cast_kernel(const Tensor& x, const Tensor& out) {
  visit_code(out.dtype().code(), [&]<DType::Code D>() { cast_to<S, D>(x, out); });
}

}  // namespace

void register_memory_kernels() {
  register_op<OpId::copy>(DeviceType::CPU, []<DType::Code C>() {
    return &copy_kernel<bits_t<sizeof(elem_t<C>)>>;  // copies move bits
  });
  register_op<OpId::fill>(DeviceType::CPU, []<DType::Code C>() { return &fill_kernel<C>; });
  register_op<OpId::cast>(DeviceType::CPU, []<DType::Code C>() { return &cast_kernel<C>; });
}

}  // namespace mixtape::cpu
