// The scaled FP8 matmul on the CPU (op scaled_matmul, mixtape/core/kernels.h), emulated: the
// operands are widened to float32 (exactly: every float8 value is a float32, and so is every
// product of two, 4 x 4 significant bits), multiplied by OpenBLAS's sgemm (float32 sums, as
// a GPU's FP8 tensor cores accumulate), scaled by scale_a * scale_b in float32 and rounded
// once to the output dtype, or first given the linear op's bias and activation (its epilogue,
// linear.cpp). It is the reference the GPU kernel is swept against, and lets
// every FP8 test run without a GPU.
#include <cstdint>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "backends/cpu/gemm_util.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// The float8 tensor t (either format, contiguous) widened into dst, exactly.
void widen(const Tensor& t, float* dst) {
  const int64_t n = t.numel();
  if (t.dtype() == kFloat8E4M3FN) {
    const auto* s = static_cast<const float8_e4m3fn*>(t.const_data_ptr());
    parallel_blocks(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(s[i]);
    });
  } else {
    const auto* s = static_cast<const float8_e5m2*>(t.const_data_ptr());
    parallel_blocks(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) dst[i] = static_cast<float>(s[i]);
    });
  }
}

void scaled_matmul_kernel(const kernels::ScaledMatmulArgs& g) {
  std::vector<float> a(static_cast<std::size_t>(g.m * g.k)), b(static_cast<std::size_t>(g.n * g.k));
  widen(g.a, a.data());
  widen(g.b_t, b.data());
  const float scale = *static_cast<const float*>(g.scale_a.const_data_ptr()) *
                      *static_cast<const float*>(g.scale_b.const_data_ptr());
  const bool direct = g.out.dtype() == kFloat32;
  std::vector<float> scratch(direct ? 0 : static_cast<std::size_t>(g.m * g.n));
  float* c = direct ? static_cast<float*>(g.out.data_ptr()) : scratch.data();
  blas_gemm(false, true, g.m, g.n, g.k, a.data(), g.k, b.data(), g.k, 0.0f, c, g.n);
  const int64_t total = g.m * g.n;
  const bool epilogue = g.has_epilogue();
  parallel_blocks(total, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) c[i] *= scale;
    if (epilogue) return;  // the linear op's, below
    if (g.out.dtype() == kBFloat16)
      from_float(c + lo, static_cast<bfloat16*>(g.out.data_ptr()) + lo, hi - lo);
    else if (g.out.dtype() == kFloat16)
      from_float(c + lo, static_cast<half*>(g.out.data_ptr()) + lo, hi - lo);
  });
  if (epilogue) linear_epilogue(c, g.m, g.n, g.bias, g.pre, g.out, g.activation);
}

}  // namespace

void register_float8_gemm_kernels() {
  register_op<OpId::scaled_matmul>(DeviceType::CPU,
                                   []<DType::Code>() { return &scaled_matmul_kernel; });
}

}  // namespace mixtape::cpu
