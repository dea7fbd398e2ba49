// Private to the CUDA backend's matmul and convolution files (gemm.cpp, conv.cpp): the
// launchers of their own CUDA kernels, implemented in gemm_acc16.cu and conv_kernels.cu.
// Every launcher takes device pointers on the current device (the caller holds a
// DeviceGuard), queues its work on `stream` and never synchronises.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mixtape::cuda_backend {

// The element types of these kernels (the .cu files stay free of the mixtape headers that
// pull in fmt).
enum class Elem { Float32, Float16, BFloat16, Float64 };

// How the sequential kernels below accumulate a dot product. Each output element starts at
// 0 and takes its terms one at a time in a fixed order:
//   Round16: acc = round_T(acc + a * b), the product and the sum in float32 (with no fused
//            multiply-add, like the CPU emulation) and round_T rounding to nearest even to
//            the operands' 16-bit type T (float16 / bfloat16) after every term: the
//            GemmArgs / Conv2dGeometry low_precision_accumulation contract, bit-exact with
//            the CPU backend's emulation.
//   Wide:    acc = fma(a, b, acc) in float32 (float32, float16, bfloat16 operands) or
//            float64 (float64 operands), rounded to the storage type once at the end: a
//            plain (slow but layout-agnostic) kernel for what the libraries cannot take.
enum class Accumulation { Round16, Wide };

// --- matmul (gemm_acc16.cu) -----------------------------------------------------------------

// The GemmArgs geometry in plain numbers: for each b < batch,
//   c[b*sc + i*ldc + j] = sum_p op(A)[i, p] * op(B)[p, j]   (0 <= i < m, 0 <= j < n)
// with A, B, C row-major (leading dimensions lda, ldb, ldc; batch strides sa, sb, sc, 0 for
// a matrix shared by the batch). Only the m x n elements of each C are written.
struct GemmShape {
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool ta = false, tb = false;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t sa = 0, sb = 0, sc = 0;
};

// A tiled kernel whose threads each own one element of C and run over k in order
// (p = 0, 1, ..., k-1), for float32 / float16 / bfloat16 / float64 (Round16: float16 and
// bfloat16 only). k == 0 writes zeros.
void gemm_sequential(Elem type, Accumulation acc, const GemmShape& s, const void* a, const void* b,
                     void* c, cudaStream_t stream);

// --- conv2d (conv_kernels.cu) -----------------------------------------------------------------

// The Conv2dGeometry in plain numbers (NHWC input, HWIO filter, NHWC output).
struct ConvShape {
  std::int64_t n = 0, h = 0, w = 0, c = 0;
  std::int64_t kh = 0, kw = 0, cout = 0;
  std::int64_t oh = 0, ow = 0;
  std::int64_t sh = 1, sw = 1;
  std::int64_t pad_top = 0, pad_left = 0;
};

// Direct convolution, one thread per output element, each element's terms in the order of
// the CPU backend's 16-bit emulation (backends/cpu/conv.cpp, "16-bit accumulation"); taps
// over the padding are skipped:
//   forward          out[i, oy, ox, co]:  taps (ky, kx, ci) in row-major order
//   backward weight  dw[ky, kx, ci, co]:  output pixels (i, oy, ox) in row-major order
//   backward input   dx[i, iy, ix, ci]:   oy ascending, then kx ascending, then co ascending
// Every element of the output is written (zeros where no term reaches it).
void conv_direct_forward(Elem type, Accumulation acc, const ConvShape& g, const void* x,
                         const void* w, void* out, cudaStream_t stream);
void conv_direct_backward_input(Elem type, Accumulation acc, const ConvShape& g,
                                const void* grad_out, const void* w, void* grad_x,
                                cudaStream_t stream);
void conv_direct_backward_weight(Elem type, Accumulation acc, const ConvShape& g, const void* x,
                                 const void* grad_out, void* grad_w, cudaStream_t stream);

// dst[j, i] = src[i, j] for a row-major rows x cols matrix of `elem_bytes`-sized elements
// (2, 4 or 8): the HWIO filter viewed as [kh*kw*cin, cout] <-> cuDNN's KRSC [cout, kh*kw*cin].
void transpose_matrix(const void* src, void* dst, std::int64_t rows, std::int64_t cols,
                      std::size_t elem_bytes, cudaStream_t stream);

// out[r, j] = out[r, j] + bias[j] for `rows` rows of `cols` elements, in the compute type
// (float32 for float16 / bfloat16), rounded back to the storage type: conv2d's bias.
void add_bias_rows(Elem type, void* out, const void* bias, std::int64_t rows, std::int64_t cols,
                   cudaStream_t stream);
// out[r, j] = acc[r, j] + bias[j], the float32 sum rounded once to `type` (float16 or
// bfloat16; bias and out of that type, acc float32): conv2d's bias on a float32 result.
void add_bias_rows_rounded(Elem type, const void* acc, const void* bias, void* out,
                           std::int64_t rows, std::int64_t cols, cudaStream_t stream);

// Zero padding of an NHWC tensor: src [n, h, w, c] -> dst [n, hp, wp, c] with
//   dst[i, y, x, ch] = src[i, y - top, x - left, ch] inside the image, 0 elsewhere
// (hp may be smaller than top + h: rows past hp are dropped).
void pad_nhwc(const void* src, void* dst, std::int64_t n, std::int64_t h, std::int64_t w,
              std::int64_t c, std::int64_t hp, std::int64_t wp, std::int64_t top, std::int64_t left,
              std::size_t elem_bytes, cudaStream_t stream);

// The adjoint of pad_nhwc: src [n, hp, wp, c] -> dst [n, h, w, c] with
//   dst[i, y, x, ch] = src[i, y + top, x + left, ch] when y + top < hp and x + left < wp,
//   0 otherwise.
void crop_nhwc(const void* src, void* dst, std::int64_t n, std::int64_t h, std::int64_t w,
               std::int64_t c, std::int64_t hp, std::int64_t wp, std::int64_t top,
               std::int64_t left, std::size_t elem_bytes, cudaStream_t stream);

// --- Device helpers of the .cu files ------------------------------------------------------

#if defined(__CUDACC__) || defined(MIXTAPE_CUDA_EMULATION)  // (tests/cudaemu)
// The accumulator of a storage type (CUDA types: __half, __nv_bfloat16, float, double).
template <typename T>
using accumulator_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// One term of a dot product: acc + a * b under `A` (see Accumulation). Round16 keeps the
// product and the sum separate roundings (__fmul_rn / __fadd_rn are never contracted into a
// fused multiply-add), as the CPU emulation computes them.
template <typename T, Accumulation A>
__device__ __forceinline__ accumulator_t<T> accumulate(accumulator_t<T> acc, accumulator_t<T> a,
                                                       accumulator_t<T> b) {
  if constexpr (A == Accumulation::Round16) {
    static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>,
                  "16-bit accumulation is for float16 / bfloat16");
    const float sum = __fadd_rn(acc, __fmul_rn(a, b));
    if constexpr (std::is_same_v<T, __half>)
      return __half2float(__float2half_rn(sum));
    else
      return __bfloat162float(__float2bfloat16_rn(sum));
  } else if constexpr (std::is_same_v<T, double>) {
    return fma(a, b, acc);
  } else {
    return fmaf(a, b, acc);
  }
}
#endif

}  // namespace mixtape::cuda_backend
