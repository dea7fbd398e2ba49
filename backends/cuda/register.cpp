// Registers the CUDA backend's kernels, family by family.
#include "backends/cuda/cuda_backend.h"

namespace mixtape::cuda_backend {

void register_all_kernels() {
  register_memory_kernels();
  register_elementwise_kernels();
  register_reduction_kernels();
  register_index_kernels();
  register_optim_kernels();
  register_gemm_kernels();
  register_conv_kernels();
  register_pool_kernels();
  register_attention_kernels();
  register_layer_norm_kernels();
  register_batch_norm_kernels();
  register_dropout_kernels();
  register_linear_kernels();
  register_cross_entropy_kernels();
  register_float8_kernels();
}

}  // namespace mixtape::cuda_backend
