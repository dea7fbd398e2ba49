// Test support: cuBLASLt's API as backends/cuda/gemm.cpp calls it (tests/cudaemu/include/
// cublasLt.h), written out from the cuBLASLt documentation for the host emulation of a GPU, so
// that gemm.cpp itself (its descriptors, layouts, transposes, batches, epilogues, FP8 scales,
// plan cache and refusals) runs in CI. Device memory is host memory; the stream is ignored.
//
// What it does, as the documentation says the library does:
//   - descriptors hold their attributes; a value whose size is not the attribute's type's is
//     refused (CUBLAS_STATUS_INVALID_VALUE), as is a matrix whose leading dimension is less
//     than its rows, or layouts whose shapes or batch counts do not agree with the
//     transposes (op(A) m x k, op(B) k x n, C and D m x n, column-major);
//   - the heuristic answers for the type combinations cuBLASLt lists (16-bit operands with
//     16-bit or float32 C/D and float32 compute; float32, TF32 and float64; FP8 E4M3/E5M2
//     operands, not both E5M2, with 16-bit or float32 C/D) and refuses the rest
//     (CUBLAS_STATUS_NOT_SUPPORTED); FP8 needs the "TN" layout (A transposed, B not),
//     float32 compute and scale, and 16-byte alignment of every matrix, its leading
//     dimensions included; the aux output's leading dimension must be a multiple of 8 and
//     at least D's rows;
//   - cublasLtMatmul computes D = epilogue(alpha op(A) op(B) + beta C) (FP8: the product
//     times scale_A scale_B, each scale read from its device pointer, 1 when none is set),
//     each sum of products from exact products in float64 and rounded once to the compute
//     type (the library's order of summation and its roundings are its own), the bias (one
//     value per row of D, of D's type: a BIAS_DATA_TYPE other than D's is refused, as cuBLASLt's
//     documentation gives it for products that are not FP8, and as an H200 found no algorithm
//     for a float32 bias with a bfloat16 D) added in the compute type, aux the pre-activation
//     in D's type, GELU in its tanh form, one rounding to D's type; C is not read when beta is
//     0. It refuses (CUBLAS_STATUS_INVALID_VALUE) an algorithm it did not return, a workspace
//     smaller than the algorithm's, and operands less aligned than the preference promised
//     when the algorithm was chosen: a library kernel may assume that alignment, and a real
//     one would fault or misread.
// Epilogues are emulated for single matrices (a batch gets CUBLAS_STATUS_NOT_SUPPORTED), FP8
// with BIAS alone and a 16-bit D (its bias of D's type, added to the scaled product); the alpha and
// beta pointers are host pointers (the default mode).
#include <cublasLt.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "mixtape/core/float8.h"
#include "mixtape/core/half.h"

namespace {

constexpr std::uint64_t kAlgoTag = 0x4c74456d75ULL;           // marks the algorithms handed out
constexpr std::size_t kAlgoWorkspace = std::size_t{1} << 16;  // what each algorithm asks for

bool is_fp8(cudaDataType_t t) { return t == CUDA_R_8F_E4M3 || t == CUDA_R_8F_E5M2; }

std::size_t type_size(cudaDataType_t t) {
  switch (t) {
    case CUDA_R_64F:
      return 8;
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
    case CUDA_R_8F_E4M3:
    case CUDA_R_8F_E5M2:
      return 1;
  }
  return 0;
}

// Element i of a matrix of type t, exactly.
double load(const void* p, cudaDataType_t t, std::int64_t i) {
  switch (t) {
    case CUDA_R_64F:
      return static_cast<const double*>(p)[i];
    case CUDA_R_32F:
      return static_cast<const float*>(p)[i];
    case CUDA_R_16F:
      return mixtape::detail::half_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case CUDA_R_16BF:
      return mixtape::detail::bfloat16_bits_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case CUDA_R_8F_E4M3:
      return mixtape::detail::float8_bits_to_float(mixtape::Float8Format::e4m3fn,
                                                   static_cast<const std::uint8_t*>(p)[i]);
    case CUDA_R_8F_E5M2:
      return mixtape::detail::float8_bits_to_float(mixtape::Float8Format::e5m2,
                                                   static_cast<const std::uint8_t*>(p)[i]);
  }
  return NAN;
}

// v (already in the compute type) rounded to t into element i (FP8 outputs are not emulated).
void store(void* p, cudaDataType_t t, std::int64_t i, double v) {
  switch (t) {
    case CUDA_R_64F:
      static_cast<double*>(p)[i] = v;
      return;
    case CUDA_R_32F:
      static_cast<float*>(p)[i] = static_cast<float>(v);
      return;
    case CUDA_R_16F:
      static_cast<std::uint16_t*>(p)[i] =
          mixtape::detail::float_to_half_bits(static_cast<float>(v));
      return;
    case CUDA_R_16BF:
      static_cast<std::uint16_t*>(p)[i] =
          mixtape::detail::float_to_bfloat16_bits(static_cast<float>(v));
      return;
    default:
      return;
  }
}

// A float32 operand as TF32 reads it: 10 mantissa bits, rounded to nearest.
double tf32(double v) {
  const float f = static_cast<float>(v);
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7f800000u) == 0x7f800000u) return v;  // inf, NaN
  u = (u + 0x1000u) & ~0x1fffu;
  float r;
  std::memcpy(&r, &u, sizeof r);
  return r;
}

std::uint32_t pointer_alignment(const void* p, std::int64_t ld, std::int64_t stride,
                                std::int32_t batch, std::size_t item) {
  std::uint64_t v = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)) |
                    static_cast<std::uint64_t>(ld) * item;
  if (batch > 1) v |= static_cast<std::uint64_t>(stride) * item;
  if (v == 0) return 256;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(v & (~v + 1), 256));
}

template <typename T>
cublasStatus_t set(T& field, const void* value, std::size_t size) {
  if (value == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
  std::memcpy(&field, value, sizeof(T));
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

struct cublasLtContext {
  std::uint64_t tag = kAlgoTag;
};
struct cublasLtMatmulDescOpaque {
  cublasComputeType_t compute;
  cudaDataType_t scale;
  std::int32_t trans_a = CUBLAS_OP_N, trans_b = CUBLAS_OP_N;
  std::uint32_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  const void* bias = nullptr;
  std::int32_t bias_type = -1;  // D's type
  void* aux = nullptr;
  std::int64_t aux_ld = 0;
  const void* scale_a = nullptr;
  const void* scale_b = nullptr;
  std::int8_t fast_accum = 0;
};
struct cublasLtMatrixLayoutOpaque {
  cudaDataType_t type;
  std::uint64_t rows, cols;
  std::int64_t ld;
  std::int32_t batch = 1;
  std::int64_t stride = 0;
};
struct cublasLtMatmulPreferenceOpaque {
  std::uint64_t max_workspace = 0;
  std::uint32_t alignment[4] = {256, 256, 256, 256};  // A, B, C, D
  std::uint32_t reduction_mask = ~0u;
};

namespace {

// A problem the descriptors describe, checked.
struct Problem {
  std::int64_t m = 0, n = 0, k = 0;
  std::int32_t batch = 1;
  bool ta = false, tb = false;
  bool bias = false, gelu = false, aux = false;
  cudaDataType_t bias_type = CUDA_R_32F;
};

bool types_supported(const cublasLtMatmulDescOpaque& d, cudaDataType_t a, cudaDataType_t b,
                     cudaDataType_t c) {
  if (d.compute == CUBLAS_COMPUTE_64F)
    return d.scale == CUDA_R_64F && a == CUDA_R_64F && b == CUDA_R_64F && c == CUDA_R_64F;
  if (d.scale != CUDA_R_32F) return false;
  if (d.compute == CUBLAS_COMPUTE_32F_FAST_TF32)
    return a == CUDA_R_32F && b == CUDA_R_32F && c == CUDA_R_32F;
  if (d.compute != CUBLAS_COMPUTE_32F) return false;
  if (is_fp8(a) && is_fp8(b))
    return !(a == CUDA_R_8F_E5M2 && b == CUDA_R_8F_E5M2) &&
           (c == CUDA_R_16F || c == CUDA_R_16BF || c == CUDA_R_32F);
  if (a != b) return false;
  if (a == CUDA_R_32F) return c == CUDA_R_32F;
  if (a == CUDA_R_16F || a == CUDA_R_16BF) return c == a || c == CUDA_R_32F;
  return false;
}

cublasStatus_t describe(const cublasLtMatmulDescOpaque* desc, const cublasLtMatrixLayoutOpaque* a,
                        const cublasLtMatrixLayoutOpaque* b, const cublasLtMatrixLayoutOpaque* c,
                        const cublasLtMatrixLayoutOpaque* d, Problem& p) {
  if (!desc || !a || !b || !c || !d) return CUBLAS_STATUS_INVALID_VALUE;
  for (const auto* l : {a, b, c, d})
    if (l->ld < static_cast<std::int64_t>(std::max<std::uint64_t>(l->rows, 1)) || l->batch < 1)
      return CUBLAS_STATUS_INVALID_VALUE;
  p.ta = desc->trans_a == CUBLAS_OP_T;
  p.tb = desc->trans_b == CUBLAS_OP_T;
  const auto m = static_cast<std::int64_t>(p.ta ? a->cols : a->rows);
  const auto ka = static_cast<std::int64_t>(p.ta ? a->rows : a->cols);
  const auto kb = static_cast<std::int64_t>(p.tb ? b->cols : b->rows);
  const auto n = static_cast<std::int64_t>(p.tb ? b->rows : b->cols);
  if (ka != kb || static_cast<std::int64_t>(c->rows) != m ||
      static_cast<std::int64_t>(c->cols) != n || c->rows != d->rows || c->cols != d->cols)
    return CUBLAS_STATUS_INVALID_VALUE;
  if (a->batch != b->batch || a->batch != c->batch || a->batch != d->batch)
    return CUBLAS_STATUS_INVALID_VALUE;
  p.m = m, p.n = n, p.k = ka, p.batch = a->batch;
  if (!types_supported(*desc, a->type, b->type, c->type) || c->type != d->type)
    return CUBLAS_STATUS_NOT_SUPPORTED;

  switch (desc->epilogue) {
    case CUBLASLT_EPILOGUE_DEFAULT:
      break;
    case CUBLASLT_EPILOGUE_BIAS:
    case CUBLASLT_EPILOGUE_GELU:
    case CUBLASLT_EPILOGUE_GELU_BIAS:
    case CUBLASLT_EPILOGUE_GELU_AUX:
    case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
      if (p.batch > 1) return CUBLAS_STATUS_NOT_SUPPORTED;
      if (is_fp8(a->type) && (desc->epilogue != CUBLASLT_EPILOGUE_BIAS || d->type == CUDA_R_32F))
        return CUBLAS_STATUS_NOT_SUPPORTED;
      p.bias = (desc->epilogue & CUBLASLT_EPILOGUE_BIAS) == CUBLASLT_EPILOGUE_BIAS;
      p.gelu = desc->epilogue != CUBLASLT_EPILOGUE_BIAS;
      p.aux = (desc->epilogue & 128u) != 0;
      break;
    default:
      return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (p.bias) {
    p.bias_type = desc->bias_type < 0 ? d->type : static_cast<cudaDataType_t>(desc->bias_type);
    if (p.bias_type != d->type) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (p.aux && (desc->aux_ld < m || desc->aux_ld % 8 != 0)) return CUBLAS_STATUS_INVALID_VALUE;
  return CUBLAS_STATUS_SUCCESS;
}

// The alignment each operand needs for FP8 (tensor cores only).
constexpr std::uint32_t kFp8Alignment = 16;

}  // namespace

// --- Handles and descriptors -----------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle) {
  if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasLtContext();  // one per device, kept for the process (as gemm.cpp does)
  return CUBLAS_STATUS_SUCCESS;
}

const char* cublasLtGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
  }
  return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasLtGetStatusString(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "success (emulated cuBLASLt)";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "an argument the emulated cuBLASLt refuses";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "a problem the emulated cuBLASLt has no algorithm for";
    default:
      return "error (emulated cuBLASLt)";
  }
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale_type) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  *desc = new cublasLtMatmulDescOpaque{compute, scale_type};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
  delete desc;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attribute,
                                              const void* value, std::size_t size) {
  if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attribute) {
    case CUBLASLT_MATMUL_DESC_TRANSA:
      return set(desc->trans_a, value, size);
    case CUBLASLT_MATMUL_DESC_TRANSB:
      return set(desc->trans_b, value, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE:
      return set(desc->epilogue, value, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER:
      return set(desc->bias, value, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER:
      return set(desc->aux, value, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD:
      return set(desc->aux_ld, value, size);
    case CUBLASLT_MATMUL_DESC_FAST_ACCUM:
      return set(desc->fast_accum, value, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE:
      return set(desc->bias_type, value, size);
    case CUBLASLT_MATMUL_DESC_A_SCALE_POINTER:
      return set(desc->scale_a, value, size);
    case CUBLASLT_MATMUL_DESC_B_SCALE_POINTER:
      return set(desc->scale_b, value, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type,
                                          std::uint64_t rows, std::uint64_t cols, std::int64_t ld) {
  if (!layout || type_size(type) == 0) return CUBLAS_STATUS_INVALID_VALUE;
  *layout = new cublasLtMatrixLayoutOpaque{type, rows, cols, ld};
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
  delete layout;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                cublasLtMatrixLayoutAttribute_t attribute,
                                                const void* value, std::size_t size) {
  if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attribute) {
    case CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT:
      return set(layout->batch, value, size);
    case CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET:
      return set(layout->stride, value, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  *pref = new cublasLtMatmulPreferenceOpaque();
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
  delete pref;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attribute,
                                                    const void* value, std::size_t size) {
  if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
  switch (attribute) {
    case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK:
      return set(pref->reduction_mask, value, size);
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
      return set(pref->max_workspace, value, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES:
      return set(pref->alignment[0], value, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES:
      return set(pref->alignment[1], value, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES:
      return set(pref->alignment[2], value, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES:
      return set(pref->alignment[3], value, size);
  }
  return CUBLAS_STATUS_INVALID_VALUE;
}

// --- The heuristic ---------------------------------------------------------------------------

// One algorithm for every problem it supports (its data: a tag, the alignments it assumes, its
// workspace); none (CUBLAS_STATUS_NOT_SUPPORTED, 0 returned) for FP8 problems whose layout or
// alignment FP8's kernels do not take.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* returned) {
  if (!handle || !pref || requested < 1 || !results || !returned)
    return CUBLAS_STATUS_INVALID_VALUE;
  *returned = 0;
  Problem p;
  if (const cublasStatus_t s = describe(desc, a, b, c, d, p); s != CUBLAS_STATUS_SUCCESS) return s;
  for (std::uint32_t al : pref->alignment)
    if (al == 0 || (al & (al - 1)) != 0) return CUBLAS_STATUS_INVALID_VALUE;
  // MIXTAPE_EMULATED_CUBLASLT_NO_ALGORITHM=1: no algorithm for any problem, so that the
  // callers' paths for a refusal run (conformance.emulated_no_cublaslt).
  static const bool none = [] {
    const char* v = std::getenv("MIXTAPE_EMULATED_CUBLASLT_NO_ALGORITHM");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  if (none) return CUBLAS_STATUS_NOT_SUPPORTED;
  if (is_fp8(a->type)) {
    const bool tn = p.ta && !p.tb;
    bool aligned = true;
    for (std::uint32_t al : pref->alignment) aligned = aligned && al >= kFp8Alignment;
    for (const auto* l : {a, b, c})
      aligned =
          aligned && (static_cast<std::size_t>(l->ld) * type_size(l->type)) % kFp8Alignment == 0;
    if (!tn || !aligned) return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  cublasLtMatmulHeuristicResult_t& r = results[0];
  r = {};
  r.algo.data[0] = kAlgoTag;
  for (int i = 0; i < 4; ++i) r.algo.data[1 + i] = pref->alignment[i];
  r.workspaceSize =
      static_cast<std::size_t>(std::min<std::uint64_t>(pref->max_workspace, kAlgoWorkspace));
  r.algo.data[5] = r.workspaceSize;
  r.state = CUBLAS_STATUS_SUCCESS;
  r.wavesCount = 1.0f;
  *returned = 1;
  return CUBLAS_STATUS_SUCCESS;
}

// --- The product -----------------------------------------------------------------------------

cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* a, cublasLtMatrixLayout_t a_layout, const void* b,
                              cublasLtMatrixLayout_t b_layout, const void* beta, const void* c,
                              cublasLtMatrixLayout_t c_layout, void* d,
                              cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, std::size_t workspace_size, cudaStream_t) {
  if (!handle || !alpha || !beta || !a || !b || !d || !algo || algo->data[0] != kAlgoTag)
    return CUBLAS_STATUS_INVALID_VALUE;
  Problem p;
  if (const cublasStatus_t s = describe(desc, a_layout, b_layout, c_layout, d_layout, p);
      s != CUBLAS_STATUS_SUCCESS)
    return s;
  if (workspace_size < algo->data[5] || (algo->data[5] > 0 && workspace == nullptr))
    return CUBLAS_STATUS_INVALID_VALUE;
  const void* pointers[4] = {a, b, c, d};
  const cublasLtMatrixLayoutOpaque* layouts[4] = {a_layout, b_layout, c_layout, d_layout};
  for (int i = 0; i < 4; ++i)
    if (pointers[i] &&
        pointer_alignment(pointers[i], layouts[i]->ld, layouts[i]->stride, layouts[i]->batch,
                          type_size(layouts[i]->type)) < algo->data[1 + i])
      return CUBLAS_STATUS_INVALID_VALUE;
  if ((p.bias && !desc->bias) || (p.aux && !desc->aux)) return CUBLAS_STATUS_INVALID_VALUE;

  const bool wide = desc->compute == CUBLAS_COMPUTE_64F;
  const bool fp8 = is_fp8(a_layout->type);
  const bool round_tf32 = desc->compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  // Rounded to the compute type (float32 unless float64).
  const auto in_compute = [wide](double v) { return wide ? v : static_cast<float>(v); };
  const double al = wide ? *static_cast<const double*>(alpha) : *static_cast<const float*>(alpha);
  const double be = wide ? *static_cast<const double*>(beta) : *static_cast<const float*>(beta);
  double scale = al;
  if (fp8) {
    const double sa = desc->scale_a ? *static_cast<const float*>(desc->scale_a) : 1.0;
    const double sb = desc->scale_b ? *static_cast<const float*>(desc->scale_b) : 1.0;
    scale = in_compute(in_compute(al * sa) * sb);
  }
  if (be != 0 && !c) return CUBLAS_STATUS_INVALID_VALUE;

  const std::int64_t m = p.m, n = p.n, k = p.k;
  // op(A) as m rows of k and op(B) as n rows of k, so that each sum runs over two rows.
  std::vector<double> ra(static_cast<std::size_t>(m * k)), rb(static_cast<std::size_t>(n * k));
  for (std::int32_t batch = 0; batch < p.batch; ++batch) {
    const std::int64_t oa = batch * a_layout->stride, ob = batch * b_layout->stride;
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t q = 0; q < k; ++q) {
        const double v =
            load(a, a_layout->type, oa + (p.ta ? i * a_layout->ld + q : q * a_layout->ld + i));
        ra[static_cast<std::size_t>(i * k + q)] = round_tf32 ? tf32(v) : v;
      }
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t q = 0; q < k; ++q) {
        const double v =
            load(b, b_layout->type, ob + (p.tb ? q * b_layout->ld + j : j * b_layout->ld + q));
        rb[static_cast<std::size_t>(j * k + q)] = round_tf32 ? tf32(v) : v;
      }
    const std::int64_t oc = batch * c_layout->stride, od = batch * d_layout->stride;
    for (std::int64_t j = 0; j < n; ++j)
      for (std::int64_t i = 0; i < m; ++i) {
        double sum = 0;
        const double* x = &ra[static_cast<std::size_t>(i * k)];
        const double* y = &rb[static_cast<std::size_t>(j * k)];
        for (std::int64_t q = 0; q < k; ++q) sum += x[q] * y[q];
        double v = in_compute(scale * in_compute(sum));
        if (be != 0)
          v = in_compute(v + in_compute(be * load(c, c_layout->type, oc + j * c_layout->ld + i)));
        if (p.bias) v = in_compute(v + load(desc->bias, p.bias_type, i));
        if (p.aux) store(desc->aux, d_layout->type, j * desc->aux_ld + i, v);
        if (p.gelu)
          v = in_compute(0.5 * v *
                         (1.0 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v))));
        store(d, d_layout->type, od + j * d_layout->ld + i, v);
      }
  }
  return CUBLAS_STATUS_SUCCESS;
}
