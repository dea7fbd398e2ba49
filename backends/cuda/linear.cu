// The fused linear op on CUDA (ops linear and linear_backward, kernels.h).
//
// Forward: the product on cuBLASLt with the bias and activation in its epilogue where cuBLASLt
// has one that computes mixtape's function (gemm.cpp's linear_gemm_epilogue): none + bias ->
// BIAS, gelu_tanh -> GELU(_AUX)(_BIAS) (cuBLASLt's GELU is the tanh form; the AUX variants also
// write the pre-activation). The exact gelu has no epilogue, and cuBLASLt's RELU is not
// mixtape's relu, which keeps NaN and -0 (a NaN from an overflow must reach the loss-scale
// check; docs/ops.md says the same of oneDNN's relu post-op): for both, the BIAS epilogue
// writes the pre-activation (or the plain product does) and one kernel applies the rest
// (bias when not added yet, pre, activation). float64, misaligned data, no algorithm and
// MIXTAPE_CUDA_LT_EPILOGUES=0 take that plain path too. A 16-bit pre-activation is then
// rounded before the activation reads it, which kernels.h allows; a bias that cuBLASLt does not
// add is added to the float32 product (cuBLASLt writes it as float32 then), so that z is
// rounded once. The bias comes in out's dtype (kernels.h), which is what cuBLASLt's BIAS
// epilogues take with a 16-bit D (they refuse a float32 bias there): a mixed policy's Dense
// adds its bias in the GEMM, as PyTorch's autocast does, with no pass of its own. float32
// takes no GELU epilogue: cuBLASLt does not say how closely its GELU
// follows the function, and a float32 result is held to the CPU's within a few units of the
// last place (the sweep runs both paths on a GPU: MIXTAPE_CUDA_LT_EPILOGUES=0 for the other).
//
// Backward: dz = dy act'(z) and the bias gradient's partial sums over fixed blocks of 32 rows
// in one kernel, then the blocks' sums added in order per column (the same on every run, for
// any grid).
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "backends/cuda/activation_math.cuh"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/warp.cuh"

namespace mixtape::cuda_backend {
namespace {

using kernels::LinearActivation;
using std::int64_t;

// Rows per block of the bias gradient's partial sums.
constexpr int64_t kRowsPerBlock = 32;

template <LinearActivation A, typename C>
__device__ __forceinline__ C activate(C z) {
  if constexpr (A == LinearActivation::relu)
    return relu_of(z);
  else if constexpr (A == LinearActivation::gelu)
    return gelu_of(z);
  else if constexpr (A == LinearActivation::gelu_tanh)
    return gelu_tanh_of(z);
  else
    return z;
}

template <LinearActivation A, typename C>
__device__ __forceinline__ C gradient(C s, C g) {
  if constexpr (A == LinearActivation::relu)
    return s > C(0) ? g : C(0);
  else if constexpr (A == LinearActivation::gelu)
    return gelu_grad_of(s, g);
  else if constexpr (A == LinearActivation::gelu_tanh)
    return gelu_tanh_grad_of(s, g);
  else
    return g;
}

// The epilogue and dz kernels take V consecutive columns a thread, in one access of V elements
// (Pack: 16 bytes of the wider type) when every row's start allows it: n a multiple of V and
// the matrices aligned to V elements; V = 1 otherwise. The same arithmetic, element by element,
// either way.
template <typename Wide, typename Narrow>
inline constexpr int kColumns = static_cast<int>(16 / std::max(sizeof(Wide), sizeof(Narrow)));

// Whether the [*, n] matrix at p (null: none) of elements of `item` bytes takes accesses of v.
bool packs(const void* p, std::size_t item, int64_t n, int v) {
  return p == nullptr ||
         (n % v == 0 &&
          reinterpret_cast<std::uintptr_t>(p) % (item * static_cast<std::size_t>(v)) == 0);
}

// The grid of a kernel over `rows` (rows, or blocks of rows: gridDim.y, at least one) and n
// columns, v a thread: the columns' threads in blocks of up to kThreads, a whole number of
// warps (rows of 768 bfloat16 values in packs of 8 take 96 threads, not 256).
struct RowGrid {
  dim3 grid;
  unsigned threads;
};
RowGrid row_grid(int64_t rows, int64_t n, int v) {
  const int64_t columns = std::max<int64_t>(1, (n + v - 1) / v);
  const int64_t threads = std::min<int64_t>(kThreads, (columns + kWarp - 1) / kWarp * kWarp);
  return {dim3(static_cast<unsigned>((columns + threads - 1) / threads),
               static_cast<unsigned>(std::clamp<int64_t>(rows, 1, 65535))),
          static_cast<unsigned>(threads)};
}

// From the product in buf ([m, n]; it may be pre or out itself, or a float32 buffer B of 16-bit
// T's product): z = buf + bias (T's, widened), pre = z when pre is given, out = act(z). Each
// element is read before it is written, by one thread: columns j .. j + V - 1, j = V (blockIdx.x
// * blockDim.x + threadIdx.x), of rows blockIdx.y, + gridDim.y, ... (a flat index needs each
// element's column, a 64-bit remainder: about 8% of the kernel's time at GPT-2 small's shapes on
// an H200).
template <typename T, LinearActivation A, typename B, int V>
__global__ void linear_epilogue_kernel(const B* buf, const T* __restrict__ bias, T* pre, T* out,
                                       int64_t m, int64_t n) {
  using C = compute_of<T>;
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (j >= n) return;
  C b[V];
#pragma unroll
  for (int u = 0; u < V; ++u) b[u] = bias ? static_cast<C>(load(bias[j + u])) : C(0);
  for (int64_t r = blockIdx.y; r < m; r += gridDim.y) {
    const int64_t i = r * n + j;
    const Pack<B, V> in = *reinterpret_cast<const Pack<B, V>*>(buf + i);
    Pack<T, V> zs, ys;
#pragma unroll
    for (int u = 0; u < V; ++u) {
      C z = load(in.v[u]);
      if (bias) z += b[u];
      zs.v[u] = store<T>(z);
      ys.v[u] = store<T>(activate<A>(z));
    }
    if (pre) *reinterpret_cast<Pack<T, V>*>(pre + i) = zs;
    *reinterpret_cast<Pack<T, V>*>(out + i) = ys;
  }
}

// linear_epilogue_kernel over [m, n], in packs of kColumns when the matrices take them.
template <typename T, LinearActivation A, typename B>
void launch_epilogue(const B* buf, const T* bias, T* pre, T* out, int64_t m, int64_t n,
                     cudaStream_t stream) {
  constexpr int V = kColumns<B, T>;
  const auto launch = [&]<int W>() {
    const RowGrid g = row_grid(m, n, W);
    MIXTAPE_CUDA_LAUNCH(g.grid, g.threads, stream, linear_epilogue_kernel<T, A, B, W>)
    (buf, bias, pre, out, m, n);
    check_cuda(cudaGetLastError(), "linear epilogue kernel", __FILE__, __LINE__);
  };
  if (packs(buf, sizeof(B), n, V) && packs(pre, sizeof(T), n, V) && packs(out, sizeof(T), n, V))
    launch.template operator()<V>();
  else
    launch.template operator()<1>();
}

// dz = dy act'(saved) for the rows of block blockIdx.y (and every gridDim.y-th after it),
// columns j .. j + V - 1 as linear_epilogue_kernel's, and the block's column sums into
// part[b, j + u] (each column's rows added in order).
//
// The rows are read kAhead at a time before any is used: a thread that loads a row only when
// it has added the one before keeps one load in flight, and a grid of m / kRowsPerBlock blocks
// of n / V threads (at n = 768: 256 blocks of 96) then reads at a tenth of the memory's rate
// (the bias-only column sums of a GPT-2-small step: 1.2 ms on an H200 where the reads take
// 0.2). The additions keep their order.
template <typename T, LinearActivation A, int V>
__global__ void linear_dz_kernel(const T* __restrict__ dy, const T* __restrict__ saved,
                                 T* __restrict__ dz, compute_of<T>* __restrict__ part, int64_t m,
                                 int64_t n) {
  using C = compute_of<T>;
  constexpr bool kSaved = A != LinearActivation::none;
  constexpr int kAhead = kSaved ? 4 : 8;  // (with saved: two loads a row, and fewer registers)
  static_assert(kRowsPerBlock % kAhead == 0, "whole batches of rows in a block");
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * V;
  if (j >= n) return;
  const int64_t blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  for (int64_t b = blockIdx.y; b < blocks; b += gridDim.y) {
    C sum[V];
#pragma unroll
    for (int u = 0; u < V; ++u) sum[u] = C(0);
    const int64_t end =
        b * kRowsPerBlock + kRowsPerBlock < m ? b * kRowsPerBlock + kRowsPerBlock : m;
    for (int64_t r0 = b * kRowsPerBlock; r0 < end; r0 += kAhead) {
      Pack<T, V> g[kAhead]{}, s[kAhead]{};
#pragma unroll
      for (int q = 0; q < kAhead; ++q) {
        if (r0 + q >= end) continue;
        const int64_t i = (r0 + q) * n + j;
        g[q] = *reinterpret_cast<const Pack<T, V>*>(dy + i);
        if constexpr (kSaved) s[q] = *reinterpret_cast<const Pack<T, V>*>(saved + i);
      }
#pragma unroll
      for (int q = 0; q < kAhead; ++q) {
        if (r0 + q >= end) continue;
        Pack<T, V> ds{};
#pragma unroll
        for (int u = 0; u < V; ++u) {
          C d = load(g[q].v[u]);
          if constexpr (kSaved) {
            d = gradient<A>(load(s[q].v[u]), d);
            ds.v[u] = store<T>(d);
          }
          sum[u] += d;
        }
        if constexpr (kSaved) *reinterpret_cast<Pack<T, V>*>(dz + (r0 + q) * n + j) = ds;
      }
    }
    if (part) {
#pragma unroll
      for (int u = 0; u < V; ++u) part[b * n + j + u] = sum[u];
    }
  }
}

// dbias[j] = the sum of part[b, j] over the blocks, in block order.
template <typename C>
__global__ void linear_dbias_kernel(const C* __restrict__ part, C* __restrict__ dbias,
                                    int64_t blocks, int64_t n) {
  MIXTAPE_GRID_LOOP(j, n) { dbias[j] = ordered_column_sum(part, blocks, n, j); }
}

// The product with the epilogue cuBLASLt applies for this activation, if it has one: true
// when out (and pre, when given) are written.
bool with_lt_epilogue(const kernels::LinearArgs& a) {
  const bool bias = a.bias.defined(), pre = a.pre.defined();
  switch (a.activation) {
    case LinearActivation::none:  // (the backward pass needs no pre for none)
      return bias && !pre && linear_gemm_epilogue(a, LinearEpilogue::bias, a.out, Tensor());
    case LinearActivation::gelu_tanh: {
      if (a.out.dtype() == kFloat32) return false;  // (see the top of the file)
      const LinearEpilogue e =
          pre ? (bias ? LinearEpilogue::gelu_aux_bias : LinearEpilogue::gelu_aux)
              : (bias ? LinearEpilogue::gelu_bias : LinearEpilogue::gelu);
      return linear_gemm_epilogue(a, e, a.out, a.pre);
    }
    case LinearActivation::relu:  // (below: cuBLASLt's relu is not mixtape's, see the top)
    case LinearActivation::gelu:
      return false;
  }
  return false;
}

template <typename T>
void linear_host(const kernels::LinearArgs& a) {
  using C = compute_of<T>;
  if (with_lt_epilogue(a)) return;
  const int64_t m = a.x.dim(0), n = a.w.dim(1);
  const bool pre = a.pre.defined();
  // The product into pre (or out), with the bias when cuBLASLt adds it; then the kernel.
  const Tensor& buf = pre ? a.pre : a.out;
  const bool biased =
      a.bias.defined() && linear_gemm_epilogue(a, LinearEpilogue::bias, buf, Tensor());
  if (a.activation == LinearActivation::none && biased && !pre) return;
  OnDevice on(a.out);
  const T* bias =
      !biased && a.bias.defined() ? static_cast<const T*>(a.bias.const_data_ptr()) : nullptr;
  T* pre_out = pre && !biased ? static_cast<T*>(a.pre.data_ptr()) : nullptr;
  if (bias && !std::is_same_v<T, C>) {
    // A 16-bit product and a bias to add: the product in float32, then z rounded once.
    const Tensor wide = Tensor::empty({m, n}, kFloat32, a.out.device());
    linear_gemm_float32(a, wide);
    kernels::with_linear_activation(a.activation, [&]<LinearActivation A>() {
      launch_epilogue<T, A>(static_cast<const float*>(wide.const_data_ptr()), bias, pre_out,
                            static_cast<T*>(a.out.data_ptr()), m, n, on.s);
    });
    return;
  }
  if (!biased) linear_gemm(a, buf);
  if (a.activation == LinearActivation::none && !bias && !pre) return;
  kernels::with_linear_activation(a.activation, [&]<LinearActivation A>() {
    launch_epilogue<T, A>(static_cast<const T*>(buf.const_data_ptr()), bias, pre_out,
                          static_cast<T*>(a.out.data_ptr()), m, n, on.s);
  });
}

template <typename T>
void linear_backward_host(const kernels::LinearBackwardArgs& a) {
  using C = compute_of<T>;
  const int64_t n = a.dy.shape().back(), m = a.dy.numel() / n;
  if (m == 0 || n == 0) return;
  const bool dbias = a.dbias.defined();
  if (a.activation == LinearActivation::none && !dbias) return;
  OnDevice on(a.dy);
  const int64_t blocks = (m + kRowsPerBlock - 1) / kRowsPerBlock;
  Workspace part(dbias ? static_cast<std::size_t>(blocks * n) * sizeof(C) : 0, on.index);
  const T* dy = static_cast<const T*>(a.dy.const_data_ptr());
  const T* saved = a.saved.defined() ? static_cast<const T*>(a.saved.const_data_ptr()) : nullptr;
  T* dz = a.dz.defined() ? static_cast<T*>(a.dz.data_ptr()) : nullptr;
  C* sums = dbias ? static_cast<C*>(part.data()) : nullptr;
  constexpr int V = kColumns<T, T>;
  const bool vector =
      packs(dy, sizeof(T), n, V) && packs(saved, sizeof(T), n, V) && packs(dz, sizeof(T), n, V);
  kernels::with_linear_activation(a.activation, [&]<LinearActivation A>() {
    const auto launch = [&]<int W>() {
      const RowGrid g = row_grid(blocks, n, W);
      MIXTAPE_CUDA_LAUNCH(g.grid, g.threads, on.s, linear_dz_kernel<T, A, W>)
      (dy, saved, dz, sums, m, n);
      check_cuda(cudaGetLastError(), "linear dz kernel", __FILE__, __LINE__);
    };
    if (vector)
      launch.template operator()<V>();
    else
      launch.template operator()<1>();
  });
  if (!dbias) return;
  launch_1d({"linear dbias kernel", n, on.s}, linear_dbias_kernel<C>,
            static_cast<const C*>(part.data()), static_cast<C*>(a.dbias.data_ptr()), blocks, n);
}

template <typename T>
void epilogue_from_float32(const Tensor& product, const Tensor& bias, const Tensor& pre,
                           const Tensor& out, LinearActivation activation) {
  const int64_t n = out.shape().back(), m = out.numel() / n;
  if (m == 0 || n == 0) return;
  OnDevice on(out);
  kernels::with_linear_activation(activation, [&]<LinearActivation A>() {
    launch_epilogue<T, A>(static_cast<const float*>(product.const_data_ptr()),
                          bias.defined() ? static_cast<const T*>(bias.const_data_ptr()) : nullptr,
                          pre.defined() ? static_cast<T*>(pre.data_ptr()) : nullptr,
                          static_cast<T*>(out.data_ptr()), m, n, on.s);
  });
}

template <typename T>
void activation_from(const Tensor& z, const Tensor& out, LinearActivation activation) {
  const int64_t n = out.shape().back(), m = out.numel() / n;
  if (m == 0 || n == 0) return;
  OnDevice on(out);
  kernels::with_linear_activation(activation, [&]<LinearActivation A>() {
    launch_epilogue<T, A>(static_cast<const T*>(z.const_data_ptr()), nullptr, nullptr,
                          static_cast<T*>(out.data_ptr()), m, n, on.s);
  });
}

}  // namespace

void linear_activation(const Tensor& z, const Tensor& out, LinearActivation activation) {
  if (out.dtype() == kBFloat16)
    activation_from<__nv_bfloat16>(z, out, activation);
  else if (out.dtype() == kFloat16)
    activation_from<__half>(z, out, activation);
  else
    activation_from<float>(z, out, activation);
}

void linear_epilogue(const Tensor& product, const Tensor& bias, const Tensor& pre,
                     const Tensor& out, LinearActivation activation) {
  if (out.dtype() == kBFloat16)
    epilogue_from_float32<__nv_bfloat16>(product, bias, pre, out, activation);
  else if (out.dtype() == kFloat16)
    epilogue_from_float32<__half>(product, bias, pre, out, activation);
  else
    epilogue_from_float32<float>(product, bias, pre, out, activation);
}

void register_linear_kernels() {
  MIXTAPE_CUDA_KERNEL(linear, linear_host);
  MIXTAPE_CUDA_KERNEL(linear_backward, linear_backward_host);
}

}  // namespace mixtape::cuda_backend
