// Private to the CUDA backend's matmul (gemm.cpp): a GemmArgs in the plain numbers of its
// kernels, which products skip cuBLASLt for gemm_acc16.cu's sequential kernel, and which linear
// products may take a cuBLASLt epilogue. A header of its own so that the host emulation of the
// backend's kernels (tests/cudaemu) routes the products as gemm.cpp does.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>

#include "backends/cuda/gemm_conv_kernels.h"
#include "core/env.h"
#include "mixtape/core/dtype.h"
#include "mixtape/core/kernels.h"

namespace mixtape::cuda_backend {

// cuBLASLt's dimensions and leading dimensions are int32.
inline constexpr std::int64_t kLtDimMax = std::numeric_limits<std::int32_t>::max();

// GemmArgs after the CPU backend's normalisation: a matrix with one stored row may carry any
// leading dimension (raised to its row length, as cuBLASLt wants ld >= rows of its
// column-major view), and a batch that shares B, with A and C evenly strided, is one taller
// product. A batch of one has no strides.
inline GemmShape gemm_shape(const kernels::GemmArgs& g) {
  GemmShape s;
  s.batch = g.batch, s.m = g.m, s.n = g.n, s.k = g.k;
  s.ta = g.trans_a, s.tb = g.trans_b;
  s.lda = g.lda, s.ldb = g.ldb, s.ldc = g.ldc;
  s.sa = g.stride_a, s.sb = g.stride_b, s.sc = g.stride_c;
  const std::int64_t rows_a = s.ta ? s.k : s.m, cols_a = s.ta ? s.m : s.k;
  const std::int64_t rows_b = s.tb ? s.n : s.k, cols_b = s.tb ? s.k : s.n;
  if (rows_a <= 1) s.lda = std::max(s.lda, cols_a);
  if (rows_b <= 1) s.ldb = std::max(s.ldb, cols_b);
  if (s.m <= 1) s.ldc = std::max(s.ldc, s.n);
  s.lda = std::max<std::int64_t>(s.lda, 1);
  s.ldb = std::max<std::int64_t>(s.ldb, 1);
  s.ldc = std::max<std::int64_t>(s.ldc, 1);
  if (s.batch > 1 && !s.ta && s.sb == 0 && s.sa == s.m * s.lda && s.sc == s.m * s.ldc &&
      s.batch * s.m <= kLtDimMax) {
    s.m *= s.batch;
    s.batch = 1;
  }
  if (s.batch == 1) s.sa = s.sb = s.sc = 0;
  return s;
}

// The accumulation of the sequential kernel when a product of dtype dt goes to it rather than
// to cuBLASLt: Round16 for float16 / bfloat16 under low_precision_accumulation (no library
// rounds the accumulator to 16 bits after every term); Wide for k == 0 and for a dimension or
// leading dimension past int32 (cuBLASLt's limit). nullopt: cuBLASLt's.
inline std::optional<Accumulation> sequential_accumulation(DType dt, const kernels::GemmArgs& g,
                                                           const GemmShape& s) {
  if (dt.is_reduced_float() && g.low_precision_accumulation) return Accumulation::Round16;
  if (s.k <= 0 || s.m > kLtDimMax || s.n > kLtDimMax || s.k > kLtDimMax || s.lda > kLtDimMax ||
      s.ldb > kLtDimMax || s.ldc > kLtDimMax)
    return Accumulation::Wide;
  return std::nullopt;
}

// Whether the linear op's product may go to cuBLASLt with an epilogue (linear_gemm_epilogue,
// cuda_backend.h): the epilogues switched on (MIXTAPE_CUDA_LT_EPILOGUES), not float64, the
// dimensions within int32, and the data as cuBLASLt reads and writes it in vectors: the bias
// and aux (when defined) 16-byte aligned, aux's leading dimension a multiple of 8 elements.
inline bool lt_epilogue_applies(const kernels::LinearArgs& a, const Tensor& aux) {
  static const bool enabled = detail::env::kCudaLtEpilogues.read();
  const std::int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.w.dim(1);
  if (!enabled || a.x.dtype() == kFloat64 || m > kLtDimMax || n > kLtDimMax || k > kLtDimMax)
    return false;
  const auto aligned16 = [](const void* p) {
    return reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
  };
  if (a.bias.defined() && !aligned16(a.bias.const_data_ptr())) return false;
  if (aux.defined() && (!aligned16(aux.const_data_ptr()) || n % 8 != 0)) return false;
  return true;
}

}  // namespace mixtape::cuda_backend
