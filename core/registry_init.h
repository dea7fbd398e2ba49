// Private to core: one-time registration of the built-in backends.
#pragma once

namespace mixtape::detail {
// Defined in backends/builtin.cpp; registers the CPU (and CUDA) backend and kernels.
void register_builtin_backends();
// Runs register_builtin_backends() once per process, before any look-up.
void ensure_backends();
}  // namespace mixtape::detail
