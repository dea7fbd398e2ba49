// Private to the CUDA backend: the registration entry points of its kernel files.
#pragma once

#include "mixtape/core/kernels.h"

namespace mixtape::cuda_backend {

// Registers every CUDA kernel into the dispatch table (backends/cuda/register.cpp).
void register_all_kernels();
// NCCL's collectives for mixtape::distributed (builds with NCCL: backends/cuda/nccl.cpp).
void register_nccl_collectives();

// The CUDA kernel template fn<T, extra...> for op, T the device type of each dtype (dev_t of
// backends/cuda/cuda_util.h): MIXTAPE_CUDA_KERNEL(sum, reduce_host, SumR).
#define MIXTAPE_CUDA_KERNEL(op, ...)                                                       \
  MIXTAPE_REGISTER_KERNEL(::mixtape::DeviceType::CUDA, ::mixtape::cuda_backend::dev_t, op, \
                          __VA_ARGS__)

// One per kernel file.
void register_memory_kernels();         // copy, fill, cast (memory.cu)
void register_elementwise_kernels();    // unary, binary, comparisons, where (elementwise.cu)
void register_reduction_kernels();      // sum ... argmax, softmax, log_softmax (reduction.cu)
void register_index_kernels();          // gather, scatter_add, take, index_add (index.cu)
void register_optim_kernels();          // unscale_check, optimizer updates (optim.cu)
void register_gemm_kernels();           // matmul, scaled_matmul through cuBLASLt (gemm.cpp)
void register_conv_kernels();           // conv2d and its backward through cuDNN (conv.cpp)
void register_pool_kernels();           // max / average pooling (pool.cu)
void register_attention_kernels();      // attention and its backward pass, fused (attention.cu)
void register_layer_norm_kernels();     // layer_norm and its backward pass, fused (layer_norm.cu)
void register_batch_norm_kernels();     // batch_norm and its backward pass, fused (batch_norm.cu)
void register_dropout_kernels();        // dropout, a counter-based mask (dropout.cu)
void register_cross_entropy_kernels();  // softmax_cross_entropy and its backward (cross_entropy.cu)
void register_linear_kernels();         // linear and its backward pass, fused (linear.cu)
void register_float8_kernels();         // quantize_float8: amax, factor, conversion (float8.cu)

// --- The linear op's products (gemm.cpp, for linear.cu) -----------------------------------

// The cuBLASLt epilogues the linear op uses (GELU is cuBLASLt's tanh approximation).
// (gemm.cpp maps them to cuBLASLt's in this order.)
enum class LinearEpilogue { bias, gelu, gelu_bias, gelu_aux, gelu_aux_bias };
// The plain product of the linear op as a matmul: x [m, k] w [k, n] into d [m, n].
inline kernels::GemmArgs linear_gemm_args(const kernels::LinearArgs& a, const Tensor& d) {
  kernels::GemmArgs g;
  g.a = a.x;
  g.b = a.w;
  g.out = d;
  g.m = a.x.dim(0);
  g.k = a.x.dim(1);
  g.n = a.w.dim(1);
  g.lda = g.k;
  g.ldb = g.n;
  g.ldc = g.n;
  return g;
}
// a.x [m, k] times a.w [k, n] into d [m, n] (contiguous, x's dtype), as matmul computes it.
void linear_gemm(const kernels::LinearArgs& a, const Tensor& d);
// The same product of 16-bit x and w into float32 d [m, n] (contiguous): the sums not rounded
// to 16 bits, for a bias added before the one rounding (cuBLASLt's 16-bit product with float32
// output; where it has none, the operands widened to float32 and the float32 matmul).
void linear_gemm_float32(const kernels::LinearArgs& a, const Tensor& d);
// The same product with epilogue e on the way out (a.bias when e has one; the GELU epilogues'
// pre-activation into aux when aux is defined: gelu_aux, gelu_aux_bias): true; false, with
// nothing written, when cuBLASLt has no algorithm for it, the data is not aligned as its
// epilogues need, the dtype is float64 or MIXTAPE_CUDA_LT_EPILOGUES=0.
bool linear_gemm_epilogue(const kernels::LinearArgs& a, LinearEpilogue e, const Tensor& d,
                          const Tensor& aux);
// The linear op's epilogue kernel (linear.cu) on a float32 product [m, n] (contiguous; it may be
// out itself): out = act(product + bias) rounded once to out's dtype (float32, bfloat16 or
// float16), pre = product + bias rounded when defined, bias [n] in out's dtype or undefined. For
// scaled_matmul's epilogue (gemm.cpp).
void linear_epilogue(const Tensor& product, const Tensor& bias, const Tensor& pre,
                     const Tensor& out, kernels::LinearActivation activation);
// out = act(z) for z [m, n] of out's dtype (contiguous; it may be out itself): the rest of a
// product whose bias cuBLASLt's epilogue added (scaled_matmul's, gemm.cpp).
void linear_activation(const Tensor& z, const Tensor& out, kernels::LinearActivation activation);

}  // namespace mixtape::cuda_backend
