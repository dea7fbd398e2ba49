// MIXTAPE_HOST_DEVICE: marks an inline function of a public header that the CUDA backend's
// kernels call too (__host__ __device__ under nvcc, nothing otherwise).
#pragma once

#if defined(__CUDACC__)
#define MIXTAPE_HOST_DEVICE __host__ __device__
#else
#define MIXTAPE_HOST_DEVICE
#endif
