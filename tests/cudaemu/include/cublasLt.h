// Test support: the part of cuBLASLt's API that backends/cuda/gemm.cpp calls, for compiling
// gemm.cpp as host C++ and running it on the host emulation of a GPU
// (tests/cudaemu/cublaslt_emulation.cpp implements it). Found before any toolkit's header by
// the emulation's targets only (tests/CMakeLists.txt). Nothing here is NVIDIA's text: the
// names are the API's, the numbers of the enumerations are this file's own, and what each
// function and attribute does is written out in the implementation from the cuBLASLt
// documentation (the library's algorithms, their order of summation and speed are not).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

// --- Types shared with the CUDA runtime (library_types.h) ------------------------------------

enum cudaDataType_t {
  CUDA_R_16F = 2,
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16BF = 14,
  CUDA_R_8F_E4M3 = 28,
  CUDA_R_8F_E5M2 = 29,
};

// --- Status, operations, compute types --------------------------------------------------------

enum cublasStatus_t {
  CUBLAS_STATUS_SUCCESS = 0,
  CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_INVALID_VALUE = 7,
  CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_NOT_SUPPORTED = 15,
};

enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };

enum cublasComputeType_t {
  CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
  CUBLAS_COMPUTE_64F = 70,
};

// --- Handles and descriptors (opaque) --------------------------------------------------------

struct cublasLtContext;
struct cublasLtMatmulDescOpaque;
struct cublasLtMatrixLayoutOpaque;
struct cublasLtMatmulPreferenceOpaque;
using cublasLtHandle_t = cublasLtContext*;
using cublasLtMatmulDesc_t = cublasLtMatmulDescOpaque*;
using cublasLtMatrixLayout_t = cublasLtMatrixLayoutOpaque*;
using cublasLtMatmulPreference_t = cublasLtMatmulPreferenceOpaque*;

// An algorithm as the heuristic returns it: opaque data that cublasLtMatmul reads.
struct cublasLtMatmulAlgo_t {
  std::uint64_t data[8];
};

struct cublasLtMatmulHeuristicResult_t {
  cublasLtMatmulAlgo_t algo;
  std::size_t workspaceSize;
  cublasStatus_t state;
  float wavesCount;
  int reserved[4];
};

// --- Attributes ----------------------------------------------------------------------------
// Each attribute's value has one documented type (in brackets); a value of another size is
// refused with CUBLAS_STATUS_INVALID_VALUE.

enum cublasLtMatmulDescAttributes_t {
  CUBLASLT_MATMUL_DESC_TRANSA = 3,                 // [int32_t] cublasOperation_t of A
  CUBLASLT_MATMUL_DESC_TRANSB = 4,                 // [int32_t] of B
  CUBLASLT_MATMUL_DESC_EPILOGUE = 7,               // [uint32_t] cublasLtEpilogue_t
  CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,           // [void*] bias vector, one value per row of D
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 10,  // [void*] the aux output
  CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 11,       // [int64_t] its leading dimension
  CUBLASLT_MATMUL_DESC_FAST_ACCUM = 13,            // [int8_t] FP8's faster accumulation
  CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 14,        // [int32_t] cudaDataType_t of the bias
  CUBLASLT_MATMUL_DESC_A_SCALE_POINTER = 17,       // [void*] scale of A (compute type)
  CUBLASLT_MATMUL_DESC_B_SCALE_POINTER = 18,       // [void*] scale of B (compute type)
};

enum cublasLtEpilogue_t {
  CUBLASLT_EPILOGUE_DEFAULT = 1,
  CUBLASLT_EPILOGUE_BIAS = 4,
  CUBLASLT_EPILOGUE_GELU = 32,
  CUBLASLT_EPILOGUE_GELU_AUX = 32 | 128,
  CUBLASLT_EPILOGUE_GELU_BIAS = 32 | 4,
  CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
};

enum cublasLtMatrixLayoutAttribute_t {
  CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT = 5,           // [int32_t]
  CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,  // [int64_t] elements between matrices
};

enum cublasLtMatmulPreferenceAttributes_t {
  CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3,  // [uint32_t] cublasLtReductionScheme_t bits
  CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,    // [uint64_t]
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 9,  // [uint32_t] (default 256)
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 10,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 11,
  CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 12,
};

enum cublasLtReductionScheme_t {
  CUBLASLT_REDUCTION_SCHEME_NONE = 0,
  CUBLASLT_REDUCTION_SCHEME_INPLACE = 1,
  CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2,
  CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE = 4,
};

// --- Functions -----------------------------------------------------------------------------

cublasStatus_t cublasLtCreate(cublasLtHandle_t* handle);
const char* cublasLtGetStatusName(cublasStatus_t status);
const char* cublasLtGetStatusString(cublasStatus_t status);

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t* desc, cublasComputeType_t compute,
                                        cudaDataType_t scale_type);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc,
                                              cublasLtMatmulDescAttributes_t attribute,
                                              const void* value, std::size_t size);

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t* layout, cudaDataType_t type,
                                          std::uint64_t rows, std::uint64_t cols, std::int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t layout,
                                                cublasLtMatrixLayoutAttribute_t attribute,
                                                const void* value, std::size_t size);

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t* pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attribute,
                                                    const void* value, std::size_t size);

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                                              cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t d,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[],
                                              int* returned);

// D = epilogue(alpha op(A) op(B) + beta C) (FP8: alpha scale_A scale_B op(A) op(B)).
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void* alpha,
                              const void* a, cublasLtMatrixLayout_t a_layout, const void* b,
                              cublasLtMatrixLayout_t b_layout, const void* beta, const void* c,
                              cublasLtMatrixLayout_t c_layout, void* d,
                              cublasLtMatrixLayout_t d_layout, const cublasLtMatmulAlgo_t* algo,
                              void* workspace, std::size_t workspace_size, cudaStream_t stream);
