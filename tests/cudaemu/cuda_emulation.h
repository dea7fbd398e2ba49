// Test support: the CUDA backend's own kernels run in a host emulation of a GPU
// (tests/cudaemu/cuda_emulation.cpp).
#pragma once

namespace mixtape::cuda_emu {

// Registers the emulated CUDA kernels for the CUDA device type: memory, elementwise,
// reduction, index, optimizer, pooling, attention, layer_norm, batch_norm, dropout,
// softmax_cross_entropy, the fused linear op (backends/cuda's *.cu files), convolution as backends/cuda/conv.cpp
// runs it without cuDNN (conv_kernels.cu's direct kernels), and matmul, scaled_matmul and the
// linear op's products as backends/cuda/gemm.cpp runs them: on the emulated cuBLASLt
// (tests/cudaemu/cublaslt_emulation.cpp), and gemm_acc16.cu's sequential kernel where gemm.cpp
// takes it.
void register_emulated_kernels();

}  // namespace mixtape::cuda_emu
