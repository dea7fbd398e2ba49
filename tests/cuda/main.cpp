// The CUDA test executable (CTest: cuda.suite). Without a usable GPU it prints why
// and exits 77, which CTest reports as skipped; with one it runs every CUDA test case.
// cuda.emulated links the same cases with the backend's kernels run by a host emulation
// (tests/cudaemu) and leaves out the ones tagged [hardware] (the real memory and streams) and
// [large] (grids, or work, too large to emulate in the suite's time).
#include <cstdio>

#include "mixtape/mixtape.h"
#include "tests/catch/run_session.h"

int main(int argc, char** argv) {
  if (!mixtape::has_backend(mixtape::DeviceType::CUDA)) {
    std::printf("mixtape was built without the CUDA backend: skipping the CUDA tests\n");
    return 77;
  }
  if (!mixtape::cuda::available()) {
    std::printf("no CUDA device (or no driver) on this machine: skipping the CUDA tests\n");
    return 77;
  }
  const auto p = mixtape::cuda::properties(0);
  std::printf("CUDA tests on %s (compute capability %d.%d, %zu MiB)\n", p.name.c_str(),
              p.compute_major, p.compute_minor, p.total_memory >> 20);
  return mixtape_tests::run_session(argc, argv);
}
