// Test support: the CUDA backend's own kernels run in a host emulation of a GPU
// (tests/cudaemu/cuda_emulation.cpp).
#pragma once

namespace mixtape::cuda_emu {

// Registers the emulated CUDA kernels for the CUDA device type: memory, elementwise,
// reduction, index, optimizer, pooling, attention, layer_norm, dropout, softmax_cross_entropy,
// the fused linear op's own kernels (backends/cuda's *.cu files; its products go to the
// matmul kernel, or to cuBLASLt's float32 product and epilogues written out from their
// documented meaning), convolution as backends/cuda/conv.cpp runs it
// without cuDNN (conv_kernels.cu's direct kernels), and matmul as gemm.cpp routes it, with the
// matmul registered before (a simulated GPU's) in cuBLASLt's place and gemm_acc16.cu's
// sequential kernel where gemm.cpp takes it. scaled_matmul (cuBLASLt's FP8 GEMM) has no
// emulation: what a simulated GPU registered for it stays.
void register_emulated_kernels();

}  // namespace mixtape::cuda_emu
