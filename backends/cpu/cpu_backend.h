// Private to the CPU backend: the registration entry points of its kernel files, small
// helpers shared by them, and the oneDNN hooks of the conv2d / pooling kernels.
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

// --- oneDNN (conv_onednn.cpp) ----------------------------------------------------------
// conv.cpp's conv2d and pooling kernels call these hooks first. Each runs the call through
// oneDNN and returns true, or returns false having written nothing (oneDNN off or not
// built in, a dtype or case it does not take, or one measured faster on conv.cpp's path).

// The environment variable that switches oneDNN off at run time ("0"; "1" or unset: on).
inline constexpr const char* kCpuOneDnnEnv = "MIXTAPE_CPU_ONEDNN";
// Whether the library was built with oneDNN (MIXTAPE_WITH_ONEDNN).
bool onednn_available();
// Whether the hooks use oneDNN: built in, and MIXTAPE_CPU_ONEDNN (read once) not "0"
// unless set_onednn_enabled() said otherwise. Throws ValueError for another value.
bool onednn_enabled();
// Overrides MIXTAPE_CPU_ONEDNN for the whole process (tests and benchmarks compare paths).
void set_onednn_enabled(bool on);

bool onednn_conv2d(const Tensor& x, const Tensor& w, const Tensor& out,
                   const kernels::Conv2dGeometry& g);
bool onednn_conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                                  const kernels::Conv2dGeometry& g);
bool onednn_conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                                   const kernels::Conv2dGeometry& g);
bool onednn_max_pool2d(const Tensor& x, const Tensor& out, const kernels::Pool2dGeometry& g);
bool onednn_max_pool2d_backward(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                                const kernels::Pool2dGeometry& g);
bool onednn_avg_pool2d(const Tensor& x, const Tensor& out, const kernels::Pool2dGeometry& g);
bool onednn_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x,
                                const kernels::Pool2dGeometry& g);

}  // namespace mixtape::cpu
