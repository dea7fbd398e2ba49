// Registers the backends built into this library with core's dispatch table.
#include "backends/cpu/cpu_backend.h"

namespace mixtape {
#ifdef MIXTAPE_WITH_CUDA
namespace cuda {
void register_backend_and_kernels();
}
#endif

namespace detail {
// Called once by core before the first backend or kernel look-up.
void register_builtin_backends() {
  cpu::register_backend_and_kernels();
#ifdef MIXTAPE_WITH_CUDA
  cuda::register_backend_and_kernels();
#endif
}
}  // namespace detail
}  // namespace mixtape
