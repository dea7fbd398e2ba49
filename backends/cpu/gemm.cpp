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

// float16 / bfloat16 operands multiplied in float32: A and B bulk-converted (once when their
// batch stride is 0) and multiplied into this thread's float32 scratch, the batch packed
// (m * n apart): one oneDNN call over the whole batch, or one sgemm per batch item without
// oneDNN. Returns the scratch.
template <typename T>
float* product_in_float32(const Plan& p, const T* a, const T* b) {
  thread_local Scratch<> scratch_a, scratch_b, scratch_c;
  const FloatOperands f = float_operands(p, a, b, scratch_a, scratch_b);
  Plan packed = p;
  packed.lda = p.cols_a();
  packed.ldb = p.cols_b();
  packed.ldc = p.n;
  packed.sa = p.sa == 0 ? 0 : f.size_a;
  packed.sb = p.sb == 0 ? 0 : f.size_b;
  packed.sc = p.batch > 1 ? p.m * p.n : 0;
  float* all = scratch_c.get(p.batch * p.m * p.n);
  if (onednn_matmul_f32(packed, f.a, f.b, all)) return all;
  for (std::int64_t bi = 0; bi < p.batch; ++bi)
    blas_gemm(p.ta, p.tb, p.m, p.n, p.k, f.a + (p.sa == 0 ? 0 : bi * f.size_a), p.cols_a(),
              f.b + (p.sb == 0 ? 0 : bi * f.size_b), p.cols_b(), 0.0f, all + bi * p.m * p.n, p.n);
  return all;
}

// float16 / bfloat16: the product in float32 (above), rounded back (nearest-even) in one
// conversion pass. low_precision_accumulation goes to gemm_acc16 instead.
template <typename T>
void gemm_reduced(const GemmArgs& g) {
  if (g.low_precision_accumulation) return gemm_acc16<T>(g);
  const auto operands = gemm_operands<T>(g);
  if (!operands) return;
  const auto& [p, a, b, c] = *operands;
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (onednn_matmul_bf16(p, a, b, c)) return;
  }
  const float* all = product_in_float32(p, a, b);
  for (std::int64_t bi = 0; bi < p.batch; ++bi) {
    const float* from = all + bi * p.m * p.n;
    T* out = c + bi * p.sc;
    if (p.ldc == p.n) {
      convert(from, out, p.m * p.n);
    } else {
      for (std::int64_t r = 0; r < p.m; ++r) convert(from + r * p.n, out + r * p.ldc, p.n);
    }
  }
}

}  // namespace

template <typename T>
compute_t<T>* linear_product(const Tensor& x, const Tensor& w, const Tensor& out) {
  GemmArgs g;
  g.a = x;
  g.b = w;
  g.out = out;
  g.m = x.dim(0);
  g.k = x.dim(1);
  g.n = w.dim(1);
  g.lda = g.k;
  g.ldb = g.n;
  g.ldc = g.n;
  if constexpr (kNative<T>) {
    gemm_native<T>(g);
    return static_cast<T*>(out.data_ptr());
  } else {
    const auto operands = gemm_operands<T>(g);  // m, n, k >= 1: always a product
    const auto& [p, a, b, c] = *operands;
    if constexpr (std::is_same_v<T, bfloat16>) {
      thread_local Scratch<> result;
      float* f = result.get(p.m * p.n);
      Plan packed = p;
      packed.ldc = p.n;
      if (onednn_matmul_bf16_to_f32(packed, a, b, f)) return f;
    }
    return product_in_float32(p, a, b);
  }
}
template float* linear_product<float>(const Tensor&, const Tensor&, const Tensor&);
template double* linear_product<double>(const Tensor&, const Tensor&, const Tensor&);
template float* linear_product<half>(const Tensor&, const Tensor&, const Tensor&);
template float* linear_product<bfloat16>(const Tensor&, const Tensor&, const Tensor&);

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
