// Private to core: the registration of backends at first use.
#pragma once

#include "mixtape/core/device.h"

namespace mixtape::detail {
// Runs the backend initializers added so far (add_backend_initializer, backend.h) that have
// not run yet, each once, then checks each backend they registered with
// check_kernel_coverage. Called before every backend or kernel look-up; cheap when nothing
// is pending. An initializer that throws stays pending and runs again at the next use.
void ensure_backends();
// Throws Error naming every (op, dtype) the op table requires that `device` has no kernel
// for (defined in dispatch.cpp).
void check_kernel_coverage(DeviceType device);
}  // namespace mixtape::detail
