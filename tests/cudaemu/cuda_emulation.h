// Test support: the CUDA backend's own kernels run in a host emulation of a GPU
// (tests/cudaemu/cuda_emulation.cpp).
#pragma once

namespace mixtape::cuda_emu {

// Registers the emulated CUDA kernels for the CUDA device type: memory, elementwise,
// reduction, index, optimizer, pooling, attention, layer_norm, dropout, softmax_cross_entropy
// and the fused linear op's own kernels (backends/cuda's *.cu files; its products go to the
// matmul kernel registered before, without cuBLASLt's epilogues). The matmul, scaled_matmul
// and convolution kernels (cuBLASLt and cuDNN) have no emulation: what a simulated GPU
// registered for them stays.
void register_emulated_kernels();

}  // namespace mixtape::cuda_emu
