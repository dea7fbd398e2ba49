// A program that links mixtape::core alone (tests/CMakeLists.txt, layering.core_alone):
// core builds and links without autograd, the layers above and every backend. With no
// backend registered the first tensor is a clear DeviceError; the program then registers
// a host-memory backend and one kernel of its own, and uses tensors and the dispatch table
// through them; then a device type of its own ("xpu") with a backend and a kernel, as a
// backend for another kind of device would. Exits 0 when everything holds.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/core/backend.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

namespace mt = mixtape;

namespace {

int failures = 0;
void check(bool ok, const char* what) {
  if (!ok) {
    std::printf("FAILED: %s\n", what);
    ++failures;
  }
}

class HostBackend final : public mt::Backend {
 public:
  explicit HostBackend(mt::DeviceType type = mt::DeviceType::CPU) : type_(type) {}
  mt::DeviceType type() const override { return type_; }
  std::string name() const override { return "host"; }
  int device_count() const override { return 1; }
  void* allocate(std::size_t nbytes, int) override { return std::malloc(nbytes ? nbytes : 1); }
  void deallocate(void* ptr, std::size_t, int) override { std::free(ptr); }
  void copy(void* dst, mt::Device, const void* src, mt::Device, std::size_t nbytes) override {
    std::memmove(dst, src, nbytes);
  }
  void synchronize(int) override {}
  mt::DeviceProperties properties(int) const override { return {.name = "host"}; }

 private:
  mt::DeviceType type_;
};

void negate(const mt::Tensor& x, const mt::Tensor& out) {
  const auto* xp = static_cast<const float*>(x.data_ptr());
  auto* yp = static_cast<float*>(out.data_ptr());
  for (std::int64_t i = 0; i < x.numel(); ++i) yp[i] = -xp[i];
}

}  // namespace

int main() {
  try {
    (void)mt::Tensor::empty({2}, mt::kFloat32);
    check(false, "a tensor without any backend");
  } catch (const mt::DeviceError& e) {
    check(std::string(e.what()).find("no cpu backend") != std::string::npos,
          "the error says there is no cpu backend");
  }

  mt::register_backend(std::make_unique<HostBackend>());
  mt::Tensor x = mt::Tensor::empty({3}, mt::kFloat32);
  float* p = x.data<float>();
  p[0] = 1.5f, p[1] = -2.0f, p[2] = 0.25f;
  check(x.to_vector<double>() == std::vector<double>{1.5, -2.0, 0.25}, "values read back");
  check(mt::DType("bf16") == mt::kBFloat16, "dtype names");
  check(mt::op_by_name("matmul") == mt::OpId::matmul, "the op table");
  check(!mt::supports(mt::OpId::matmul, mt::DeviceType::CPU, mt::kFloat32),
        "no kernels but those registered");

  mt::register_kernel<mt::kernels::UnaryFn>(mt::OpId::neg, mt::DeviceType::CPU, mt::kFloat32,
                                            &negate);
  mt::Tensor y = mt::Tensor::empty({3}, mt::kFloat32);
  mt::find_kernel<mt::kernels::UnaryFn>(mt::OpId::neg, mt::DeviceType::CPU, mt::kFloat32)(x, y);
  check(y.to_vector<double>() == std::vector<double>{-1.5, 2.0, -0.25},
        "a kernel through dispatch");

  // A device type of this program's own: named, parsed, dispatched like the built-in ones.
  try {
    (void)mt::Device::parse("xpu:1");
    check(false, "an unknown device type parses");
  } catch (const mt::ValueError& e) {
    check(std::string(e.what()).find("valid: cpu, cuda, cuda:N") != std::string::npos,
          "the error lists the device names");
  }
  const mt::DeviceType xpu = mt::register_device_type("xpu");
  check(xpu != mt::DeviceType::CPU && xpu != mt::DeviceType::CUDA, "a type of its own");
  check(mt::register_device_type("xpu") == xpu, "registered once");
  check(mt::Device::parse("xpu:1") == mt::Device(xpu, 1), "parsed by name");
  check(mt::Device(xpu, 1).str() == "xpu:1", "printed by name");
  mt::register_backend(std::make_unique<HostBackend>(xpu));
  mt::Tensor on_xpu = mt::Tensor::empty({3}, mt::kFloat32, mt::Device(xpu, 0));
  std::memcpy(on_xpu.data_ptr(), x.data_ptr(), 3 * sizeof(float));
  mt::register_kernel<mt::kernels::UnaryFn>(mt::OpId::neg, xpu, mt::kFloat32, &negate);
  mt::Tensor y2 = mt::Tensor::empty({3}, mt::kFloat32, mt::Device(xpu, 0));
  mt::find_kernel<mt::kernels::UnaryFn>(mt::OpId::neg, xpu, mt::kFloat32)(on_xpu, y2);
  check(y2.to_vector<double>() == std::vector<double>{-1.5, 2.0, -0.25}, "a kernel on xpu");
  check(mt::kernel_table().find("xpu:") != std::string::npos, "xpu in the kernel table");
  try {
    (void)mt::register_device_type("X-1");
    check(false, "a bad device type name");
  } catch (const mt::ValueError&) {
  }

  std::printf("%s\n", failures ? "core alone: FAILED" : "core alone: ok");
  return failures ? 1 : 0;
}
