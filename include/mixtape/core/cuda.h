// mixtape::cuda: what a program asks about NVIDIA GPUs, whether or not this build has the
// CUDA backend (without it, or without a GPU, available() is false and device_count() 0).
//
//   mt::Device device = mt::cuda::available() ? mt::Device::cuda(0) : mt::Device::cpu();
#pragma once

#include "mixtape/core/backend.h"

namespace mixtape::cuda {

// True when the CUDA backend is built in and at least one GPU is usable.
bool available();
// The number of usable GPUs (0 without the backend or a driver).
int device_count();
// The name, compute capability and memory of GPU `index`; throws DeviceError when there is
// no such GPU.
DeviceProperties properties(int index = 0);
// Waits until everything queued on GPU `index` is done.
void synchronize(int index = 0);
// Marks the work queued on GPU `index` between profiler_start and profiler_stop for a
// profiler told to record only that (cudaProfilerStart / cudaProfilerStop: Nsight Compute's
// `--profile-from-start off`, Nsight Systems' `--capture-range=cudaProfilerApi`). Without a
// profiler attached it does nothing; no wait for the device either way.
void profiler_start(int index = 0);
void profiler_stop(int index = 0);

// Whether float32 matmuls may run on TF32 tensor cores (10-bit mantissa products, float32
// accumulation). Off by default: float32 means float32. The CUDA backend reads it per call.
void set_allow_tf32(bool allow);
bool allow_tf32();

}  // namespace mixtape::cuda
