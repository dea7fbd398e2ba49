// A program that links mixtape::cpu and (below it) mixtape::core, nothing else
// (tests/CMakeLists.txt, layering.cpu_alone): including mixtape/backends/cpu.h registers
// the CPU backend with core, with every kernel the op table requires, and kernels run
// through the dispatch table without autograd. Exits 0 when everything holds.
#include <cstdio>
#include <vector>

#include "mixtape/backends/cpu.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

namespace mt = mixtape;

int main() {
  int failures = 0;
  auto check = [&](bool ok, const char* what) {
    if (!ok) std::printf("FAILED: %s\n", what), ++failures;
  };
  check(mt::has_backend(mt::DeviceType::CPU), "the CPU backend is registered");
  for (int i = 0; i < mt::kOpCount; ++i) {
    const auto op = static_cast<mt::OpId>(i);
    for (int d = 0; d < mt::DType::kCount; ++d) {
      const mt::DType dt = mt::DType::all()[d];
      if (mt::op_info(op).dtypes.contains(dt) && !mt::supports(op, mt::DeviceType::CPU, dt))
        std::printf("FAILED: %s has no %s kernel\n", mt::op_name(op), dt.name().data()), ++failures;
    }
  }
  // [2 x 3] x [3 x 2] through the matmul kernel.
  mt::kernels::GemmArgs g;
  g.a = mt::from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3});
  g.b = mt::from_vector<float>({1, 0, 0, 1, 1, 1}, {3, 2});
  g.out = mt::Tensor::empty({2, 2}, mt::kFloat32);
  g.m = 2, g.n = 2, g.k = 3, g.lda = 3, g.ldb = 2, g.ldc = 2;
  mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, mt::DeviceType::CPU, mt::kFloat32)(g);
  check(g.out.to_vector<double>() == std::vector<double>{4, 5, 10, 11}, "matmul");
  std::printf("%s\n", failures ? "cpu alone: FAILED" : "cpu alone: ok");
  return failures ? 1 : 0;
}
