// A simulated GPU for tests on machines without one: a backend registered for the CUDA device
// type whose memory is host memory and whose kernels are the CPU backend's, registered again
// for that device type. A program linked with it instead of mixtape::cuda (the apps' builds of
// tests/CMakeLists.txt, apps.simcuda) runs every GPU branch of itself and of the library (the
// device-side loss scale and its late reads, checks kept on the device, the datasets' device
// copies and prefetch, FP8 on compute capability 9.0, step capture) with kernels that compute
// what the CPU computes: so a CPU tensor mixed into a GPU computation is an error there, and
// --device cuda must print what --device cpu prints. Linked with the host emulation of the
// CUDA backend's kernels (tests/cudaemu, MIXTAPE_SIM_EMULATED_KERNELS) its kernels are, where
// they are emulated, the real backend's own (gemm.cpp's cuBLASLt calls on an emulated
// cuBLASLt). What it cannot show: the real backend's streams, memory, CUDA graphs, cuDNN, the
// libraries' own arithmetic, or a host wait.
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "mixtape/backends/cpu.h"   // the CPU backend's initializer first: its kernels are copied
#include "mixtape/backends/cuda.h"  // announces register_backend_and_kernels, defined here
#include "mixtape/core/backend.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/error.h"
#include "mixtape/core/kernels.h"
#if defined(MIXTAPE_SIM_EMULATED_KERNELS)
#include "tests/cudaemu/cuda_emulation.h"
#endif

namespace mixtape {
namespace {

class SimulatedCudaBackend final : public Backend {
 public:
  DeviceType type() const override { return DeviceType::CUDA; }
  std::string name() const override { return "simulated cuda"; }
  int device_count() const override { return 1; }
  // Fresh memory holds garbage (all bits set: NaN in every floating dtype), as a GPU's may:
  // a kernel that reads what nothing wrote shows.
  // Under AddressSanitizer a block is exactly the size asked for, so that a kernel that reads
  // or writes past a tensor's end is reported (the emulated CUDA kernels: tests/cudaemu).
  void* allocate(std::size_t nbytes, int) override {
#if defined(__SANITIZE_ADDRESS__)
    const std::size_t rounded = nbytes == 0 ? 1 : nbytes;
#else
    const std::size_t rounded = (nbytes + 63) / 64 * 64 + 64;
#endif
    void* p = ::operator new (rounded, std::align_val_t{64}, std::nothrow);
    if (p == nullptr) throw OutOfMemoryError("simulated cuda: out of host memory");
    std::memset(p, 0xff, rounded);
    return p;
  }
  void deallocate(void* ptr, std::size_t, int) override {
    ::operator delete (ptr, std::align_val_t{64});
  }
  // While the calling thread captures a step, a GPU copies nothing: the copy is a node of the
  // graph that each replay runs, from a snapshot of host memory taken now (the CUDA backend's
  // pinned buffer) or from device memory as it is then. So here, recorded and not run: a
  // tensor the capture copies to the device holds nothing until a replay.
  void copy(void* dst, Device, const void* src, Device src_device, std::size_t nbytes) override {
    if (capture::detail::state() != nullptr) {
      if (src_device.is_cpu()) {
        const auto* from = static_cast<const std::byte*>(src);
        auto bytes = std::make_shared<const std::vector<std::byte>>(from, from + nbytes);
        capture::detail::record_or_run(
            [dst, bytes] { std::memmove(dst, bytes->data(), bytes->size()); });
      } else {
        capture::detail::record_or_run([dst, src, nbytes] { std::memmove(dst, src, nbytes); });
      }
      return;
    }
    std::memmove(dst, src, nbytes);
  }
  void synchronize(int) override {}
  // An H100's, so that the apps' peak tables and FP8 (compute capability 8.9 or newer) apply.
  DeviceProperties properties(int) const override {
    return {.name = "NVIDIA H100 80GB HBM3 (simulated)",
            .compute_major = 9,
            .compute_minor = 0,
            .total_memory = std::size_t{80} << 30,
            .multiprocessors = 132};
  }
  // Its kernels are the CPU's, host calls: a captured step records them as the CPU's are.
  bool kernels_are_host_calls() const override { return true; }
};

// The CPU's kernels of `op`, every dtype, registered for the CUDA device type.
template <typename Fn>
void copy_cpu_kernels(OpId op) {
  if constexpr (!std::is_same_v<Fn, kernels::NoKernel>) {
    for (int i = 0; i < DType::kCount; ++i) {
      const DType dt = DType::all()[i];
      if (!supports(op, DeviceType::CPU, dt)) continue;
      detail::register_kernel(op, DeviceType::CUDA, dt,
                              detail::lookup_kernel(op, DeviceType::CPU, dt, typeid(Fn*)),
                              typeid(Fn*));
    }
  }
}

}  // namespace

namespace cuda {
void register_backend_and_kernels() {
  register_backend(std::make_unique<SimulatedCudaBackend>());
#define MIXTAPE_SIM_COPY(name, kernel, dtypes, amp, grad) \
  copy_cpu_kernels<kernels::kernel>(OpId::name);
  MIXTAPE_OP_TABLE(MIXTAPE_SIM_COPY)
#undef MIXTAPE_SIM_COPY
#if defined(MIXTAPE_SIM_EMULATED_KERNELS)
  // The CUDA backend's own kernels, run by a host emulation of the GPU, where they have one.
  cuda_emu::register_emulated_kernels();
#endif
}
}  // namespace cuda

}  // namespace mixtape
