// The CUDA backend (library mixtape_cuda, target mixtape::cuda, built when nvcc is found):
// device memory, streams, cuBLASLt / cuDNN and mixtape's own kernels for every op of the
// op table. Including this header registers it with core (mixtape/core/backend.h) before
// the program's first tensor; mixtape/mixtape.h includes it when the program links
// mixtape::cuda (which defines MIXTAPE_CUDA_BACKEND). A program that does not link it
// links no CUDA library.
#pragma once

#include "mixtape/core/backend.h"

namespace mixtape::cuda {
// Registers the CUDA backend and its kernels (core runs it once, at first use). Without a
// GPU the backend reports 0 devices; its kernels are registered all the same.
void register_backend_and_kernels();
}  // namespace mixtape::cuda

namespace mixtape::detail {
// One per translation unit that includes this header; core runs the initializer once.
static const bool cuda_backend_announced =
    (add_backend_initializer(&cuda::register_backend_and_kernels), true);
}  // namespace mixtape::detail
