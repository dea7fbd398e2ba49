// CPU matmul kernels: float32 on oneDNN's matmul (onednn.cpp; a batch in one call; a single
// product only on CPUs with AVX-512), float64 and the rest of float32 through OpenBLAS
// dgemm / sgemm; float16 and bfloat16 operands are converted in bulk to float32 scratch,
// multiplied (the same way) and rounded back (nearest-even) in bulk. With
// GemmArgs::low_precision_accumulation (MIXTAPE_FP16_USE_FP32_COMPUTE=0) float16 / bfloat16
// products instead emulate a GEMM that accumulates in the 16-bit type (gemm_acc16, acc16.cpp).
// bfloat16 products run on oneDNN's native bf16 matmul where the CPU has AVX512-BF16 (onednn.cpp).
#include <cstdint>
#include <type_traits>

#include "backends/cpu/gemm_util.h"

namespace mixtape::cpu {
namespace {

// float32 / float64: float32 goes to oneDNN's matmul, a batch in one call (OpenBLAS 0.3.21
// has no batched GEMM), a single product where oneDNN has AVX-512 kernels (1.1x to 1.6x
// faster than OpenBLAS's sgemm there: BM_CpuMatmulF32Path, docs/benchmarks.md). float64
// (which oneDNN does not multiply), float32 without oneDNN, and a single float32 product
// without AVX-512 loop over the batch items with one BLAS call each.
template <typename T>
void gemm_native(const GemmArgs& g) {
  const auto operands = gemm_operands<T>(g);
  if (!operands) return;
  const auto& [p, a, b, c] = *operands;
  if constexpr (std::is_same_v<T, float>) {
    if (onednn_matmul_f32(p, a, b, c)) return;
  }
  for (std::int64_t bi = 0; bi < p.batch; ++bi)
    blas_gemm(p.ta, p.tb, p.m, p.n, p.k, a + bi * p.sa, p.lda, b + bi * p.sb, p.ldb, T(0),
              c + bi * p.sc, p.ldc);
}

// float16 / bfloat16: bulk-convert A and B (once when their batch stride is 0), sgemm
// into a float32 scratch, bulk-convert the result back. low_precision_accumulation goes
// to gemm_acc16 instead.
template <typename T>
void gemm_reduced(const GemmArgs& g) {
  if (g.low_precision_accumulation) return gemm_acc16<T>(g);
  const auto operands = gemm_operands<T>(g);
  if (!operands) return;
  const auto& [p, a, b, c] = *operands;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (onednn_matmul_bf16(p, a, b, c)) return;
  }

  thread_local Scratch<> scratch_a, scratch_b, scratch_c;
  const FloatOperands f = float_operands(p, a, b, scratch_a, scratch_b);
  const float *fa = f.a, *fb = f.b;
  const std::int64_t size_a = f.size_a, size_b = f.size_b;

  // One oneDNN float32 call over the packed copies (the whole batch), then one conversion
  // pass; without oneDNN, one sgemm per batch item below.
  {
    Plan packed = p;
    packed.lda = p.cols_a();
    packed.ldb = p.cols_b();
    packed.ldc = p.n;
    packed.sa = p.sa == 0 ? 0 : size_a;
    packed.sb = p.sb == 0 ? 0 : size_b;
    packed.sc = p.batch > 1 ? p.m * p.n : 0;
    float* all = scratch_c.get(p.batch * p.m * p.n);
    if (onednn_matmul_f32(packed, fa, fb, all)) {
      for (std::int64_t bi = 0; bi < p.batch; ++bi) {
        const float* from = all + bi * p.m * p.n;
        T* out = c + bi * p.sc;
        if (p.ldc == p.n) {
          convert(from, out, p.m * p.n);
        } else {
          for (std::int64_t r = 0; r < p.m; ++r) convert(from + r * p.n, out + r * p.ldc, p.n);
        }
      }
      return;
    }
  }
  float* fc = scratch_c.get(p.m * p.n);

  for (std::int64_t bi = 0; bi < p.batch; ++bi) {
    const float* ma = fa + (p.sa == 0 ? 0 : bi * size_a);
    const float* mb = fb + (p.sb == 0 ? 0 : bi * size_b);
    blas_gemm(p.ta, p.tb, p.m, p.n, p.k, ma, p.cols_a(), mb, p.cols_b(), 0.0f, fc, p.n);
    T* out = c + bi * p.sc;
    if (p.ldc == p.n) {
      convert(fc, out, p.m * p.n);
    } else {
      for (std::int64_t r = 0; r < p.m; ++r) convert(fc + r * p.n, out + r * p.ldc, p.n);
    }
  }
}

}  // namespace

void register_gemm_kernels() {
  // float32 / float64 on BLAS; float16 / bfloat16 through gemm_reduced (float32 math).
  register_op<OpId::matmul>(DeviceType::CPU, []<DType::Code C>() {
    using T = element_t<C>;
    if constexpr (DType(C).is_reduced_float())
      return &gemm_reduced<T>;
    else
      return &gemm_native<T>;
  });
}

}  // namespace mixtape::cpu
