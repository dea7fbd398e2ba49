// The CPU backend (library mixtape_cpu, part of mixtape::mixtape): host memory, OpenBLAS /
// oneDNN / OpenMP kernels for every op of the op table. Including this header registers it
// with core (mixtape/core/backend.h) before the program's first tensor; mixtape/mixtape.h
// includes it.
#pragma once

#include "mixtape/core/backend.h"

namespace mixtape::cpu {
// Registers the CPU backend and its kernels (core runs it once, at first use).
void register_backend_and_kernels();
}  // namespace mixtape::cpu

namespace mixtape::detail {
// One per translation unit that includes this header; core runs the initializer once.
static const bool cpu_backend_announced =
    (add_backend_initializer(&cpu::register_backend_and_kernels), true);
}  // namespace mixtape::detail
