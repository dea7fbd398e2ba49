// The CPU backend: 64-byte aligned host memory, memcpy copies, and kernel registration.
#include "mixtape/core/backend.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "backends/cpu/cpu_backend.h"
#include "mixtape/core/error.h"

namespace mixtape::cpu {
namespace {

class CpuBackend final : public Backend {
 public:
  DeviceType type() const override { return DeviceType::CPU; }
  std::string name() const override { return "CPU"; }
  int device_count() const override { return 1; }

  void* allocate(std::size_t nbytes, int /*device_index*/) override {
    // Aligned for 512-bit vector loads; a size of 0 still gets a unique pointer.
    const std::size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
    void* p = std::aligned_alloc(kAlignment, rounded == 0 ? kAlignment : rounded);
    if (!p) throw std::bad_alloc();
    return p;
  }
  void deallocate(void* ptr, std::size_t /*nbytes*/, int /*device_index*/) override {
    std::free(ptr);
  }
  void copy(void* dst, Device dst_device, const void* src, Device src_device,
            std::size_t nbytes) override {
    if (!dst_device.is_cpu() || !src_device.is_cpu())
      throw DeviceError(
          fmt::format("CPU backend cannot copy from {} to {}", src_device.str(), dst_device.str()));
    if (nbytes) std::memmove(dst, src, nbytes);
  }
  void synchronize(int /*device_index*/) override {}

 private:
  static constexpr std::size_t kAlignment = 64;
};

}  // namespace

void register_backend_and_kernels() {
  register_backend(std::make_unique<CpuBackend>());
  register_memory_kernels();
  register_elementwise_kernels();
  register_reduction_kernels();
  register_index_kernels();
  register_gemm_kernels();
  register_conv_kernels();
  register_optim_kernels();
}

}  // namespace mixtape::cpu
