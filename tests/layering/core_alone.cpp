// A program that links mixtape::core alone (tests/CMakeLists.txt, layering.core_alone):
// core builds and links without autograd, the layers above and every backend. With no
// backend registered the first tensor is a clear DeviceError; the program then registers
// a host-memory backend and one kernel of its own, and uses tensors and the dispatch table
// through them. Exits 0 when everything holds.
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
  mt::DeviceType type() const override { return mt::DeviceType::CPU; }
  std::string name() const override { return "host"; }
  int device_count() const override { return 1; }
  void* allocate(std::size_t nbytes, int) override { return std::malloc(nbytes ? nbytes : 1); }
  void deallocate(void* ptr, std::size_t, int) override { std::free(ptr); }
  void copy(void* dst, mt::Device, const void* src, mt::Device, std::size_t nbytes) override {
    std::memmove(dst, src, nbytes);
  }
  void synchronize(int) override {}
  mt::DeviceProperties properties(int) const override { return {.name = "host"}; }
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

  std::printf("%s\n", failures ? "core alone: FAILED" : "core alone: ok");
  return failures ? 1 : 0;
}
