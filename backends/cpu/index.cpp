// CPU index kernels: gather and its adjoint scatter_add, take (whole rows) and its adjoint
// index_add (see kernels.h for the [outer, n | k, inner] geometry).
//
// scatter_add and index_add add in the dtype: each addition to a float16/bfloat16 element
// is done in float32 and rounded back to the dtype; integer additions wrap. scatter_add
// splits its work over (outer, column block of inner): every column's targets lie in that
// column, so tasks never write the same element and the j order of additions is kept.
// index_add splits over (outer, column block, range of destination rows): a task walks all
// k source rows in order and adds those whose destination row lies in its range, so again
// every element has one writer and its additions keep the j order. take copies row
// segments with memcpy, split over (output row, column chunk).
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backends/cpu/cpu_util.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

constexpr int64_t kScatterCols = 64;  // columns of inner per scatter_add task
constexpr int64_t kCopyCols = 8192;   // elements of a row per take task

// T: an unsigned integer of the item size (gather only moves elements).
template <typename T>
void gather_kernel(const Tensor& x, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                   int64_t inner, const Tensor& out) {
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const auto* ip = static_cast<const int64_t*>(index.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const int64_t rows = outer * k;
  parallel_for(rows, rows * inner > kParallelGrain, [&](int64_t q) {
    const T* src = xp + q / k * n * inner;  // x[o, 0, 0]
    const int64_t* idx = ip + q * inner;
    T* dst = yp + q * inner;
    for (int64_t i = 0; i < inner; ++i) dst[i] = src[idx[i] * inner + i];
  });
}

// For 16-bit floats, scatter_add and index_add are their float32 kernel run on float32
// copies of src and out, each result rounded once: added in 16 bits, an element that
// receives several rows would be rounded after every add (the reduced-precision kernels
// compute and accumulate in float32, mixtape/core/kernels.h). The two share a signature.
template <typename T>
void accumulate_in_float32(kernels::ScatterAddFn* float32_kernel, const Tensor& src,
                           const Tensor& index, int64_t outer, int64_t n, int64_t k, int64_t inner,
                           const Tensor& out) {
  Tensor s = Tensor::empty(src.shape(), kFloat32, src.device());
  Tensor o = Tensor::empty(out.shape(), kFloat32, out.device());
  to_float(static_cast<const T*>(src.const_data_ptr()), s.data<float>(), src.numel());
  to_float(static_cast<const T*>(out.const_data_ptr()), o.data<float>(), out.numel());
  float32_kernel(s, index, outer, n, k, inner, o);
  from_float(o.data<float>(), static_cast<T*>(out.data_ptr()), out.numel());
}

template <typename T>
void scatter_add_kernel(const Tensor& src, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                        int64_t inner, const Tensor& out) {
  if constexpr (kReduced<T>)
    return accumulate_in_float32<T>(&scatter_add_kernel<float>, src, index, outer, n, k, inner,
                                    out);
  const T* sp = static_cast<const T*>(src.const_data_ptr());
  const auto* ip = static_cast<const int64_t*>(index.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const int64_t cols = std::min(kScatterCols, inner);
  const int64_t col_blocks = inner == 0 ? 0 : (inner + cols - 1) / cols;
  const int64_t tasks = outer * col_blocks;
  parallel_for(tasks, outer * k * inner > kParallelGrain, [&](int64_t t) {
    const int64_t o = t / col_blocks, c0 = t % col_blocks * cols;
    const int64_t c1 = std::min(inner, c0 + cols);
    T* dst = yp + o * n * inner;  // out[o, 0, 0]
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = (o * k + j) * inner;
      for (int64_t i = c0; i < c1; ++i) {
        T& d = dst[ip[row + i] * inner + i];
        d = wrap_add(d, sp[row + i]);
      }
    }
  });
}

// take: out[o, j, :] = x[o, index[j], :]. T: an unsigned integer of the item size (take
// only moves rows). Rows of one element are assigned directly; longer rows are copied with
// memcpy in chunks of at most kCopyCols elements, so that a few long rows still spread
// over the threads.
template <typename T>
void take_kernel(const Tensor& x, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                 int64_t inner, const Tensor& out) {
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const auto* ip = static_cast<const int64_t*>(index.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const int64_t rows = outer * k;
  if (rows == 0 || inner == 0) return;
  const bool par = rows * inner > kParallelGrain;
  if (inner == 1) {
    parallel_for(rows, par, [&](int64_t q) { yp[q] = xp[q / k * n + ip[q % k]]; });
    return;
  }
  const int64_t cols = std::min(kCopyCols, inner);
  const int64_t per_row = (inner + cols - 1) / cols;
  const int64_t units = rows * per_row;
  parallel_for(units, par, [&](int64_t u) {
    const int64_t q = u / per_row, c0 = u % per_row * cols;
    const int64_t len = std::min(cols, inner - c0);
    const T* src = xp + (q / k * n + ip[q % k]) * inner + c0;  // x[o, index[j], c0]
    std::memcpy(yp + q * inner + c0, src, static_cast<std::size_t>(len) * sizeof(T));
  });
}

// dst[i] += src[i] for i < len (integers wrap).
template <typename T>
void add_row(T* __restrict dst, const T* __restrict src, int64_t len) {
  for (int64_t i = 0; i < len; ++i) dst[i] = wrap_add(dst[i], src[i]);
}

// index_add: out[o, index[j], :] += src[o, j, :] in the order of j. Tasks are (o, column
// block of at most kBlock columns, part of the destination rows [0, n)); the rows are
// split into parts only when (outer, column block) tasks alone cannot occupy the threads
// (e.g. an embedding gradient: outer 1, inner the embedding width).
template <typename T>
void index_add_kernel(const Tensor& src, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                      int64_t inner, const Tensor& out) {
  if constexpr (kReduced<T>)
    return accumulate_in_float32<T>(&index_add_kernel<float>, src, index, outer, n, k, inner, out);
  if (outer == 0 || k == 0 || inner == 0) return;
  const T* sp = static_cast<const T*>(src.const_data_ptr());
  const auto* ip = static_cast<const int64_t*>(index.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const int64_t cols = std::min(kBlock, inner);
  const int64_t col_blocks = (inner + cols - 1) / cols;
  const int64_t base = outer * col_blocks;
  const bool par = outer * k * inner > kParallelGrain;
  const int64_t threads = par ? omp_get_max_threads() : 1;
  const int64_t parts = base >= threads ? 1 : std::min(n, (threads + base - 1) / base);
  const int64_t tasks = base * parts;
  parallel_for(tasks, par && tasks > 1, [&](int64_t t) {
    const int64_t p = t % parts, o = t / parts / col_blocks;
    const int64_t c0 = t / parts % col_blocks * cols, len = std::min(cols, inner - c0);
    const int64_t r0 = n * p / parts, r1 = n * (p + 1) / parts;
    T* dst = yp + o * n * inner + c0;      // out[o, 0, c0]
    const T* s = sp + o * k * inner + c0;  // src[o, 0, c0]
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = ip[j];
      if (r >= r0 && r < r1) add_row(dst + r * inner, s + j * inner, len);
    }
  });
}

}  // namespace

void register_index_kernels() {
  // gather and take move elements (one kernel per item size); the adjoints add (16-bit
  // floats through float32, accumulate_in_float32).
  register_op<OpId::gather>(DeviceType::CPU, []<DType::Code C>() {
    return &gather_kernel<bits_t<sizeof(element_t<C>)>>;
  });
  register_op<OpId::take>(
      DeviceType::CPU, []<DType::Code C>() { return &take_kernel<bits_t<sizeof(element_t<C>)>>; });
  MIXTAPE_CPU_KERNEL(scatter_add, scatter_add_kernel);
  MIXTAPE_CPU_KERNEL(index_add, index_add_kernel);
}

}  // namespace mixtape::cpu
