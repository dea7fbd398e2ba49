// CPU index kernels: gather and its adjoint scatter_add (see kernels.h for the
// [outer, n | k, inner] geometry).
//
// scatter_add adds in the dtype: each addition to a float16/bfloat16 element is done in
// float32 and rounded back to the dtype; integer additions wrap. Work is split over
// (outer, column block of inner): every column's targets lie in that column, so tasks
// never write the same element and the j order of additions is kept.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "backends/cpu/cpu_util.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

constexpr int64_t kCols = 64;  // columns of inner per scatter_add task

// T: an unsigned integer of the item size (gather only moves elements).
template <typename T>
void gather_kernel(const Tensor& x, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                   int64_t inner, const Tensor& out) {
  const T* xp = static_cast<const T*>(x.data_ptr());
  const auto* ip = static_cast<const int64_t*>(index.data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const int64_t rows = outer * k;
#pragma omp parallel for schedule(static) if (rows * inner > kParallelGrain)
  for (int64_t q = 0; q < rows; ++q) {
    const T* src = xp + q / k * n * inner;  // x[o, 0, 0]
    const int64_t* idx = ip + q * inner;
    T* dst = yp + q * inner;
    for (int64_t i = 0; i < inner; ++i) dst[i] = src[idx[i] * inner + i];
  }
}

// a + b in the dtype (wrapping for integers, through float32 for 16-bit floats).
template <typename T>
T add(T a, T b) {
  if constexpr (kReduced<T>)
    return T(static_cast<float>(a) + static_cast<float>(b));
  else
    return wrap_add(a, b);
}

template <typename T>
void scatter_add_kernel(const Tensor& src, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                        int64_t inner, const Tensor& out) {
  const T* sp = static_cast<const T*>(src.data_ptr());
  const auto* ip = static_cast<const int64_t*>(index.data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const int64_t cols = std::min(kCols, inner);
  const int64_t col_blocks = inner == 0 ? 0 : (inner + cols - 1) / cols;
  const int64_t tasks = outer * col_blocks;
#pragma omp parallel for schedule(static) if (outer * k * inner > kParallelGrain)
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t o = t / col_blocks, c0 = t % col_blocks * cols;
    const int64_t c1 = std::min(inner, c0 + cols);
    T* dst = yp + o * n * inner;  // out[o, 0, 0]
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = (o * k + j) * inner;
      for (int64_t i = c0; i < c1; ++i) {
        T& d = dst[ip[row + i] * inner + i];
        d = add(d, sp[row + i]);
      }
    }
  }
}

template <typename T>
void reg(DType dtype) {
  using Bits = bits_t<sizeof(T)>;
  static_assert(sizeof(Bits) == sizeof(T));
  register_kernel<kernels::GatherFn>(OpId::gather, DeviceType::CPU, dtype, &gather_kernel<Bits>);
  register_kernel<kernels::ScatterAddFn>(OpId::scatter_add, DeviceType::CPU, dtype,
                                         &scatter_add_kernel<T>);
}

}  // namespace

void register_index_kernels() {
  reg<float>(kFloat32);
  reg<half>(kFloat16);
  reg<bfloat16>(kBFloat16);
  reg<double>(kFloat64);
  reg<std::int32_t>(kInt32);
  reg<std::int64_t>(kInt64);
}

}  // namespace mixtape::cpu
