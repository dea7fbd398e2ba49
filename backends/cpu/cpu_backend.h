// Private to the CPU backend: the registration entry points of its kernel files, and
// small helpers shared by them.
#pragma once

#include <cstdint>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"

namespace mixtape::cpu {

// Registers the CPU backend (allocator, copies) and all CPU kernels.
void register_backend_and_kernels();

// One per kernel file.
void register_memory_kernels();       // copy, fill, cast
void register_elementwise_kernels();  // unary, binary, comparisons, where
void register_reduction_kernels();    // sum, mean, max, min, argmax, softmax, log_softmax
void register_index_kernels();        // gather, scatter_add, take, index_add
void register_gemm_kernels();         // matmul
void register_conv_kernels();         // conv2d (+ backward), pooling (+ backward)
void register_optim_kernels();        // unscale_check, sgd/rmsprop/adam updates

// Below this many elements a kernel runs on one thread.
inline constexpr std::int64_t kParallelGrain = 32768;

}  // namespace mixtape::cpu
