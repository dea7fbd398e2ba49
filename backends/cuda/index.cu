// CUDA index kernels: gather and its adjoint scatter_add, take (whole rows) and its adjoint
// index_add (see kernels.h for the [outer, n | k, inner] geometry), for the dtypes the CPU
// backend registers: float32, float16, bfloat16, float64, int32, int64.
//
// gather and take only move elements (an unsigned integer of the item size; take moves
// 16-byte units when the rows and pointers allow it), one thread per output element.
// scatter_add and index_add run one thread per source element and add with atomicAdd:
// float32 / float64 natively, float16 and bfloat16 into a float32 copy of the output that is
// rounded once at the end (as the CPU backend does: 16-bit atomics would round after every
// addition, off by up to 0.06 in bfloat16 where many rows meet), int32 / int64 as wrapping
// two's-complement additions (32-bit int and 64-bit unsigned atomics). The order of the
// additions into one element is not the CPU's (j order): integer results are identical,
// floating results may differ by rounding. An index out of [0, n) reads 0 and adds nothing:
// the range is checked on the device and reported later (checked_indices, ops_index.cpp),
// so the kernels must stay inside the tensors until then.
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// *p += v in the dtype, atomically.
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(std::int32_t* p, std::int32_t v) {
  atomicAdd(reinterpret_cast<int*>(p), static_cast<int>(v));
}
__device__ __forceinline__ void atomic_add(std::int64_t* p, std::int64_t v) {
  static_assert(sizeof(std::int64_t) == sizeof(unsigned long long));
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

// out[o, j, i] = x[o, index[o, j, i], i]; q = (o * k + j) * inner + i.
template <typename T>
__global__ void gather_kernel(const T* __restrict__ x, const int64_t* __restrict__ index,
                              T* __restrict__ out, int64_t total, int64_t n, int64_t k,
                              int64_t inner) {
  MIXTAPE_GRID_LOOP(q, total) {
    const int64_t i = q % inner, o = q / inner / k, j = index[q];
    out[q] = j >= 0 && j < n ? x[(o * n + j) * inner + i] : T{};  // range: checked_indices
  }
}

// out[o, index[o, j, i], i] += src[o, j, i]; out in the compute type of T.
template <typename T>
__global__ void scatter_add_kernel(const T* __restrict__ src, const int64_t* __restrict__ index,
                                   compute_of<T>* out, int64_t total, int64_t n, int64_t k,
                                   int64_t inner) {
  MIXTAPE_GRID_LOOP(q, total) {
    const int64_t i = q % inner, o = q / inner / k, j = index[q];
    if (j >= 0 && j < n) atomic_add(out + (o * n + j) * inner + i, load(src[q]));
  }
}

// out[o, j, i] = x[o, index[j], i].
template <typename T>
__global__ void take_kernel(const T* __restrict__ x, const int64_t* __restrict__ index,
                            T* __restrict__ out, int64_t total, int64_t n, int64_t k,
                            int64_t inner) {
  MIXTAPE_GRID_LOOP(q, total) {
    const int64_t i = q % inner, r = q / inner;
    const int64_t j = r % k, o = r / k, m = index[j];
    out[q] = m >= 0 && m < n ? x[(o * n + m) * inner + i] : T{};
  }
}

// out[o, index[j], i] += src[o, j, i]; out in the compute type of T.
template <typename T>
__global__ void index_add_kernel(const T* __restrict__ src, const int64_t* __restrict__ index,
                                 compute_of<T>* out, int64_t total, int64_t n, int64_t k,
                                 int64_t inner) {
  MIXTAPE_GRID_LOOP(q, total) {
    const int64_t i = q % inner, r = q / inner;
    const int64_t j = r % k, o = r / k, m = index[j];
    if (m >= 0 && m < n) atomic_add(out + (o * n + m) * inner + i, load(src[q]));
  }
}

// to[q] = from[q] converted (storage <-> compute type).
template <typename From, typename To>
__global__ void convert_kernel(const From* __restrict__ from, To* __restrict__ to, int64_t total) {
  MIXTAPE_GRID_LOOP(q, total) {
    if constexpr (std::is_same_v<To, compute_of<From>>)
      to[q] = load(from[q]);
    else
      to[q] = store<To>(from[q]);
  }
}

// Runs add(acc) with acc: the output in its compute type. For the 16-bit floats a float32
// copy of out in a workspace, rounded back into out once all additions are done.
template <typename T, typename Add>
void with_accumulator(const Tensor& out, cudaStream_t s, Add add) {
  using Acc = compute_of<T>;
  T* o = static_cast<T*>(out.data_ptr());
  if constexpr (std::is_same_v<Acc, T>) {
    add(o);
  } else {
    const int64_t m = out.numel();
    if (m == 0) return;
    Workspace ws(static_cast<std::size_t>(m) * sizeof(Acc), out.device().index());
    Acc* acc = static_cast<Acc*>(ws.data());
    launch_1d({"accumulator widening kernel", m, s}, convert_kernel<T, Acc>, o, acc, m);
    add(acc);
    launch_1d({"accumulator rounding kernel", m, s}, convert_kernel<Acc, T>, acc, o, m);
  }
}

// T: an unsigned integer of the item size.
template <typename T>
void gather_host(const Tensor& x, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                 int64_t inner, const Tensor& out) {
  const int64_t total = outer * k * inner;
  if (total == 0) return;
  OnDevice on(out);
  launch_1d({"gather kernel", total, on.s}, gather_kernel<T>,
            static_cast<const T*>(x.const_data_ptr()),
            static_cast<const int64_t*>(index.const_data_ptr()), static_cast<T*>(out.data_ptr()),
            total, n, k, inner);
}

// scatter_add and index_add: `kernel` (one thread per source element) adds src into out's
// accumulator. T: the device storage type.
template <typename T, typename Kernel>
void add_host(const char* name, Kernel kernel, const Tensor& src, const Tensor& index,
              int64_t outer, int64_t n, int64_t k, int64_t inner, const Tensor& out) {
  const int64_t total = outer * k * inner;
  if (total == 0) return;
  OnDevice on(out);
  with_accumulator<T>(out, on.s, [&](compute_of<T>* acc) {
    launch_1d({name, total, on.s}, kernel, static_cast<const T*>(src.const_data_ptr()),
              static_cast<const int64_t*>(index.const_data_ptr()), acc, total, n, k, inner);
  });
}

template <typename T>
void scatter_add_host(const Tensor& src, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                      int64_t inner, const Tensor& out) {
  add_host<T>("scatter_add kernel", scatter_add_kernel<T>, src, index, outer, n, k, inner, out);
}

// T: an unsigned integer of the item size. Rows of a multiple of 16 bytes between 16-byte
// aligned pointers move as uint4 units.
template <typename T>
void take_host(const Tensor& x, const Tensor& index, int64_t outer, int64_t n, int64_t k,
               int64_t inner, const Tensor& out) {
  const int64_t total = outer * k * inner;
  if (total == 0) return;
  OnDevice on(out);
  const void* xp = x.const_data_ptr();
  void* yp = out.data_ptr();
  const auto* ip = static_cast<const int64_t*>(index.const_data_ptr());
  const int64_t row_bytes = inner * static_cast<int64_t>(sizeof(T));
  if (row_bytes % 16 == 0 && aligned16(xp) && aligned16(yp)) {
    const int64_t units = row_bytes / 16;
    const int64_t vtotal = outer * k * units;
    launch_1d({"take kernel", vtotal, on.s}, take_kernel<uint4>, static_cast<const uint4*>(xp), ip,
              static_cast<uint4*>(yp), vtotal, n, k, units);
  } else {
    launch_1d({"take kernel", total, on.s}, take_kernel<T>, static_cast<const T*>(xp), ip,
              static_cast<T*>(yp), total, n, k, inner);
  }
}

template <typename T>
void index_add_host(const Tensor& src, const Tensor& index, int64_t outer, int64_t n, int64_t k,
                    int64_t inner, const Tensor& out) {
  add_host<T>("index_add kernel", index_add_kernel<T>, src, index, outer, n, k, inner, out);
}

}  // namespace

void register_index_kernels() {
  constexpr auto cuda = DeviceType::CUDA;
  // gather and take move elements (one kernel per item size); the adjoints add.
  register_op<OpId::gather>(
      cuda, []<DType::Code C>() { return &gather_host<ubits_t<sizeof(dev_t<C>)>>; });
  MIXTAPE_CUDA_KERNEL(scatter_add, scatter_add_host);
  register_op<OpId::take>(cuda,
                          []<DType::Code C>() { return &take_host<ubits_t<sizeof(dev_t<C>)>>; });
  MIXTAPE_CUDA_KERNEL(index_add, index_add_host);
}

}  // namespace mixtape::cuda_backend
