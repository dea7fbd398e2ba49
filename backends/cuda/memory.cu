// CUDA memory kernels: copy (strided -> contiguous), fill and cast, for all 10 dtypes.
//
// The conversion rules are the CPU backend's (backends/cpu/memory.cpp), bit for bit:
//  - to float16/bfloat16: correctly rounded (nearest, ties to even) from any source; wider
//    sources (float64, int32, int64) go through a float32 rounded to odd first;
//  - floating -> integer truncates toward zero and saturates; NaN becomes 0;
//  - integer -> narrower integer wraps; anything -> bool is (x != 0) (NaN is true);
//  - from and to float8 through a float32 (convert_float8 in elementwise_util.cuh).
// copy and fill only move bits (an unsigned integer of the item size); a contiguous copy is
// a cudaMemcpyAsync, a fill whose bytes are all equal (zeros, bool, uint8, -1) a
// cudaMemsetAsync, other fills store 16-byte vectors when the pointer allows it.
#include <cmath>
#include <cstring>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// --- copy ------------------------------------------------------------------------------

// dst[i] = src[offset of output index i], over `n` output elements.
template <typename T, typename I>
__global__ void copy_strided_kernel(const T* __restrict__ src, T* __restrict__ dst,
                                    StridedGeom<1> g, int64_t n) {
  MIXTAPE_GRID_LOOP(i, n) {
    int64_t off[1];
    strided_offsets<I>(g, i, off);
    dst[i] = src[off[0]];
  }
}

// copy: any strided src -> contiguous dst. T: an unsigned integer of the item size.
template <typename T>
void copy_host(const Tensor& src, const Tensor& dst) {
  const int64_t n = dst.numel();
  if (n == 0) return;
  OnDevice on(dst);
  const T* s = static_cast<const T*>(src.const_data_ptr());
  T* d = static_cast<T*>(dst.data_ptr());
  const Coalesced<1> l = coalesce<1>(src.shape(), {&src.strides()});
  if (l.contiguous()) {
    MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(d, s, static_cast<std::size_t>(n) * sizeof(T),
                                       cudaMemcpyDeviceToDevice, on.s));
    return;
  }
  for_each_slice(l, [&](const StridedGeom<1>& g, const std::array<int64_t, 1>& off, int64_t out_off,
                        int64_t count) {
    launch_strided({"copy kernel", count, on.s}, copy_strided_kernel<T, std::uint32_t>,
                   copy_strided_kernel<T, std::uint64_t>, s + off[0], d + out_off, g, count);
  });
}

// --- fill ------------------------------------------------------------------------------

// double -> float rounded to odd, on the host (core's, mixtape/core/half.h).
float host_round_to_odd(double v) { return detail::round_to_odd_float(v); }

// `value` as an element of dtype C, exactly as the CPU backend's fill converts it: the 16- and
// 8-bit floats through float32 rounded to odd, integers truncated and saturated, bool true
// for anything but zero (NaN included).
template <DType::Code C>
element_t<C> fill_value(double value) {
  using T = element_t<C>;
  if constexpr (C == DType::Bool)
    return T(value != 0.0);
  else if constexpr (std::is_integral_v<T>)
    return saturating_trunc<T>(value);
  else if constexpr (std::is_floating_point_v<T>)
    return static_cast<T>(value);
  else
    return T(host_round_to_odd(value));  // half, bfloat16, float8
}

// The bits of fill_value in dtype dt, in the low bytes.
std::uint64_t fill_bits(double value, DType dt) {
  std::uint64_t bits = 0;
  visit_code(dt.code(), [&]<DType::Code C>() {
    const element_t<C> v = fill_value<C>(value);
    std::memcpy(&bits, &v, sizeof v);
  });
  return bits;
}

// p[0, n) = v; with `vec`, p is 16-byte aligned and `pattern` holds v repeated over 16 bytes.
template <typename T>
__global__ void fill_kernel(T* __restrict__ p, int64_t n, T v, uint4 pattern, bool vec) {
  if (vec) {
    constexpr int N = kVec<T>;
    const int64_t nv = n / N;
    uint4* pv = reinterpret_cast<uint4*>(p);
    MIXTAPE_GRID_LOOP(i, nv) pv[i] = pattern;
    const int64_t t0 = nv * N;
    MIXTAPE_GRID_LOOP(j, n - t0) p[t0 + j] = v;
  } else {
    MIXTAPE_GRID_LOOP(i, n) p[i] = v;
  }
}

// T: an unsigned integer of the item size.
template <typename T>
void fill_host(const Tensor& out, double value) {
  const int64_t n = out.numel();
  if (n == 0) return;
  OnDevice on(out);
  const std::uint64_t bits = fill_bits(value, out.dtype());
  unsigned char bytes[sizeof(T)];
  const T v = static_cast<T>(bits);
  std::memcpy(bytes, &v, sizeof(T));
  bool same = true;
  for (std::size_t b = 1; b < sizeof(T); ++b) same = same && bytes[b] == bytes[0];
  T* p = static_cast<T*>(out.data_ptr());
  if (same) {
    MIXTAPE_CUDA_CHECK(cudaMemsetAsync(p, bytes[0], static_cast<std::size_t>(n) * sizeof(T), on.s));
    return;
  }
  uint4 pattern;
  unsigned char rep[16];
  for (std::size_t b = 0; b < 16; ++b) rep[b] = bytes[b % sizeof(T)];
  std::memcpy(&pattern, rep, sizeof pattern);
  const bool vec = aligned16(p);
  const int64_t work = vec ? n / kVec<T> + kVec<T> : n;
  launch_1d({"fill kernel", work, on.s}, fill_kernel<T>, p, n, v, pattern, vec);
}

// --- cast ------------------------------------------------------------------------------

template <DType::Code S, DType::Code D>
__global__ void cast_kernel(const dev_t<S>* __restrict__ x, dev_t<D>* __restrict__ y, int64_t n) {
  if constexpr (kFloat8<dev_t<S>> || kFloat8<dev_t<D>>) {
    MIXTAPE_GRID_LOOP(i, n) y[i] = convert_float8<dev_t<S>, dev_t<D>, D == DType::Bool>(x[i]);
  } else {
    MIXTAPE_GRID_LOOP(i, n) y[i] = convert_elem<dev_t<S>, dev_t<D>, D == DType::Bool>(x[i]);
  }
}

template <DType::Code S, DType::Code D>
void cast_to(const Tensor& x, const Tensor& out, cudaStream_t s) {
  const int64_t n = x.numel();
  const auto* xp = static_cast<const dev_t<S>*>(x.const_data_ptr());
  auto* yp = static_cast<dev_t<D>*>(out.data_ptr());
  if constexpr (S == D) {
    MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(yp, xp, static_cast<std::size_t>(n) * sizeof(dev_t<S>),
                                       cudaMemcpyDeviceToDevice, s));
  } else {
    launch_1d({"cast kernel", n, s}, cast_kernel<S, D>, xp, yp, n);
  }
}

template <DType::Code S>
void cast_host(const Tensor& x, const Tensor& out) {
  if (x.numel() == 0) return;
  OnDevice on(x);
  visit_code(out.dtype().code(), [&]<DType::Code D>() { cast_to<S, D>(x, out, on.s); });
}

}  // namespace

void register_memory_kernels() {
  // copy and fill move bits: one kernel per item size.
  register_op<OpId::copy>(DeviceType::CUDA,
                          []<DType::Code C>() { return &copy_host<ubits_t<sizeof(dev_t<C>)>>; });
  register_op<OpId::fill>(DeviceType::CUDA,
                          []<DType::Code C>() { return &fill_host<ubits_t<sizeof(dev_t<C>)>>; });
  register_op<OpId::cast>(DeviceType::CUDA, []<DType::Code C>() { return &cast_host<C>; });
}

}  // namespace mixtape::cuda_backend
