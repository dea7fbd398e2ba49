// Private to core: one-time registration of the built-in backends.
#pragma once

#include "mixtape/core/device.h"

namespace mixtape::detail {
// Defined in backends/builtin.cpp; registers the CPU (and CUDA) backend and kernels.
void register_builtin_backends();
// Runs register_builtin_backends() once per process, before any look-up, then checks
// each registered backend with check_kernel_coverage.
void ensure_backends();
// Throws Error naming every (op, dtype) the op table requires that `device` has no kernel
// for (defined in dispatch.cpp).
void check_kernel_coverage(DeviceType device);
}  // namespace mixtape::detail
