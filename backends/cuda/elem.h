// The element type of the GEMM and convolution kernels (backends/cuda/gemm_conv_kernels.h) for
// a dtype: what backends/cuda/gemm.cpp and conv.cpp pass them.
#pragma once

#include "backends/cuda/gemm_conv_kernels.h"
#include "mixtape/core/dtype.h"

namespace mixtape::cuda_backend {

// float16, bfloat16, float64 as themselves; anything else (float32) as Float32.
inline Elem elem_of(DType dt) {
  switch (dt.code()) {
    case DType::Float16:
      return Elem::Float16;
    case DType::BFloat16:
      return Elem::BFloat16;
    case DType::Float64:
      return Elem::Float64;
    default:
      return Elem::Float32;
  }
}

}  // namespace mixtape::cuda_backend
