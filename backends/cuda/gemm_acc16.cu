// CUDA kernels: the sequential matmul (gemm_sequential in gemm_conv_kernels.h).
//
// Its main use is GemmArgs::low_precision_accumulation (MIXTAPE_FP16_USE_FP32_COMPUTE=0) on
// float16 and bfloat16: the accumulator is rounded to the 16-bit type after every
// multiply-add, in the order p = 0, 1, ..., k-1, as backends/cpu/gemm.cpp (gemm_acc16)
// emulates it, so the two backends agree bit for bit. No library has that contract: cuBLAS's
// CUBLAS_COMPUTE_16F accumulates float16 in an unspecified order and with tensor-core
// internal precision, and bfloat16 has no 16-bit-accumulating library path at all; so both
// 16-bit types take this kernel.
//
// The same kernel with float32 (float64 for float64) accumulation also runs what cuBLASLt
// refuses (gemm.cpp falls back to it when the heuristic finds no algorithm) and k == 0
// (zeros, respecting the leading-dimension gaps).
//
// Layout: 16 x 16 threads per block, each owning one element of C; the block stages 16 x 16
// tiles of op(A) and op(B) in shared memory (converted to the accumulator type), and every
// thread walks the tile's k in order. The grid strides over column blocks (x), row blocks (y)
// and batch items (z), so any size fits the grid limits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "backends/cuda/cuda_math.cuh"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/gemm_conv_kernels.h"
#include "backends/cuda/launch.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

constexpr int kTile = 16;

template <typename T, Accumulation A>
__global__ void __launch_bounds__(kTile* kTile)
    gemm_sequential_kernel(const T* __restrict__ a, const T* __restrict__ b, T* __restrict__ c,
                           GemmShape s) {
  using Acc = accumulator_t<T>;
  // as[r][q] = op(A)[row0 + r, k0 + q], bs[q][j] = op(B)[k0 + q, col0 + j]; the extra column
  // keeps the transposed stores free of bank conflicts.
  __shared__ Acc as[kTile][kTile + 1];
  shared_starts_undefined(as);
  __shared__ Acc bs[kTile][kTile + 1];
  shared_starts_undefined(bs);
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t row_blocks = (s.m + kTile - 1) / kTile, col_blocks = (s.n + kTile - 1) / kTile;
  // Every thread of the block runs the same loop trips (the bounds depend on blockIdx only),
  // so the barriers below are reached by all of them.
  for (int64_t bi = blockIdx.z; bi < s.batch; bi += gridDim.z) {
    const T* ab = a + bi * s.sa;
    const T* bb = b + bi * s.sb;
    T* cb = c + bi * s.sc;
    for (int64_t rb = blockIdx.y; rb < row_blocks; rb += gridDim.y) {
      for (int64_t cblk = blockIdx.x; cblk < col_blocks; cblk += gridDim.x) {
        const int64_t row0 = rb * kTile, col0 = cblk * kTile;
        Acc acc = Acc(0);
        for (int64_t k0 = 0; k0 < s.k; k0 += kTile) {
          {  // op(A) tile; threads along x read consecutive addresses of the stored matrix
            const int r = s.ta ? tx : ty, q = s.ta ? ty : tx;
            const int64_t row = row0 + r, p = k0 + q;
            Acc v = Acc(0);
            if (row < s.m && p < s.k) v = load(ab[s.ta ? p * s.lda + row : row * s.lda + p]);
            as[r][q] = v;
          }
          {  // op(B) tile
            const int q = s.tb ? tx : ty, j = s.tb ? ty : tx;
            const int64_t p = k0 + q, col = col0 + j;
            Acc v = Acc(0);
            if (p < s.k && col < s.n) v = load(bb[s.tb ? col * s.ldb + p : p * s.ldb + col]);
            bs[q][j] = v;
          }
          __syncthreads();
          const int kn = static_cast<int>(s.k - k0 < kTile ? s.k - k0 : kTile);
          for (int q = 0; q < kn; ++q) acc = accumulate<T, A>(acc, as[ty][q], bs[q][tx]);
          __syncthreads();
        }
        const int64_t i = row0 + ty, j = col0 + tx;
        if (i < s.m && j < s.n) cb[i * s.ldc + j] = store<T>(acc);
      }
    }
  }
}

template <typename T, Accumulation A>
void launch(const GemmShape& s, const void* a, const void* b, void* c, cudaStream_t stream) {
  if (s.batch <= 0 || s.m <= 0 || s.n <= 0) return;
  const int64_t row_blocks = (s.m + kTile - 1) / kTile, col_blocks = (s.n + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(col_blocks, int64_t{1} << 30)),
                  static_cast<unsigned>(std::min<int64_t>(row_blocks, 65535)),
                  static_cast<unsigned>(std::min<int64_t>(s.batch, 65535)));
  const dim3 block(kTile, kTile);
  MIXTAPE_CUDA_LAUNCH(grid, block, stream, gemm_sequential_kernel<T, A>)
  (static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(c), s);
  MIXTAPE_CUDA_CHECK_LAUNCH("gemm_sequential_kernel");
}

}  // namespace

void gemm_sequential(Elem type, Accumulation acc, const GemmShape& s, const void* a, const void* b,
                     void* c, cudaStream_t stream) {
  const bool round16 = acc == Accumulation::Round16;
  switch (type) {
    case Elem::Float16:
      return round16 ? launch<__half, Accumulation::Round16>(s, a, b, c, stream)
                     : launch<__half, Accumulation::Wide>(s, a, b, c, stream);
    case Elem::BFloat16:
      return round16 ? launch<__nv_bfloat16, Accumulation::Round16>(s, a, b, c, stream)
                     : launch<__nv_bfloat16, Accumulation::Wide>(s, a, b, c, stream);
    case Elem::Float32:  // 16-bit accumulation does not apply: accumulate in float32
      return launch<float, Accumulation::Wide>(s, a, b, c, stream);
    case Elem::Float64:
      return launch<double, Accumulation::Wide>(s, a, b, c, stream);
  }
}

}  // namespace mixtape::cuda_backend
