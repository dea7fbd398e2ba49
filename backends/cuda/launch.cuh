// Private to the CUDA backend's .cu files: the host side of a grid-stride loop
// (MIXTAPE_GRID_LOOP): a kernel launched over n work items on a stream, and the launch
// checked.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <source_location>
#include <type_traits>

#include "backends/cuda/cuda_util.h"

// kernel<<<grid, block, 0, stream>>>(args...), written
// MIXTAPE_CUDA_LAUNCH(grid, block, stream, kernel)(args...): every launch of the backend goes
// through it, so that the kernels' host emulation (tests/cudaemu, which compiles these files as
// host C++ with MIXTAPE_CUDA_EMULATION) can run them.
#if defined(MIXTAPE_CUDA_EMULATION)
#define MIXTAPE_CUDA_LAUNCH(grid, block, stream, ...) \
  (static_cast<void>(stream), ::mixtape::cuda_emu::launch(grid, block, __VA_ARGS__))
#else
#define MIXTAPE_CUDA_LAUNCH(grid, block, stream, ...) __VA_ARGS__<<<grid, block, 0, stream>>>
#endif

namespace mixtape::cuda_backend {

// shared_starts_undefined(var), right after a __shared__ variable's declaration, before any
// thread uses it: a block's shared memory starts with whatever the SM's previous block left.
// On a GPU it does nothing. The host emulation (tests/cudaemu) keeps __shared__ variables as
// function statics, which would hold the previous block's values (often the right ones), so
// there it fills the variable with all bits set (NaN in every floating dtype, -1 in every
// integer) when the block's first thread reaches it: a kernel that reads what its block did not
// write shows in the emulated sweep. Every __shared__ declaration of the backend is followed by
// one (CTest cudaemu.shared_declarations).
template <typename T>
__device__ __forceinline__ void shared_starts_undefined([[maybe_unused]] T& var) {
#if defined(MIXTAPE_CUDA_EMULATION)
  ::mixtape::cuda_emu::shared_starts_undefined(&var, sizeof var);
#endif
}

// A 1-D launch: the name a launch error is reported under, the work items of the kernel's
// grid-stride loop and the stream; `where` is the place of the launch in the source (the
// file and line the error names, as MIXTAPE_CUDA_CHECK_LAUNCH's).
struct Launch1d {
  Launch1d(const char* name, std::int64_t n, cudaStream_t stream,
           std::source_location where = std::source_location::current())
      : name(name), n(n), stream(stream), where(where) {}
  const char* name;
  std::int64_t n;
  cudaStream_t stream;
  std::source_location where;
};

// kernel<<<blocks_for(n), kThreads, 0, stream>>>(args...), then the launch error (a bad
// configuration) checked, without waiting. The arguments convert to the kernel's parameter
// types at the call, as they do in a <<<>>> launch.
template <typename... Params>
void launch_1d(const Launch1d& launch, void (*kernel)(Params...),
               std::type_identity_t<Params>... args) {
  MIXTAPE_CUDA_LAUNCH(blocks_for(launch.n), kThreads, launch.stream, kernel)(args...);
  check_cuda(cudaGetLastError(), launch.name, launch.where.file_name(),
             static_cast<int>(launch.where.line()));
}

}  // namespace mixtape::cuda_backend
