// The scaled FP8 matmul on the CPU (op scaled_matmul, mixtape/core/kernels.h), emulated: the
// operands are widened exactly (every float8 value is a bfloat16 and a float32: at most 3
// significant bits after the leading one, exponents within both ranges), multiplied with
// float32 sums (as a GPU's FP8 tensor cores accumulate; every product of two FP8 values is
// exact in float32, 4 x 4 significant bits), scaled by scale_a * scale_b in float32 and
// rounded once to the output dtype, or first given the linear op's bias and activation (its
// epilogue, linear.cpp). The product: oneDNN's bfloat16 matmul with float32 results where the
// CPU multiplies bfloat16 natively (AVX512-BF16, AMX: twice float32's rate, half its bytes),
// OpenBLAS's sgemm on float32 copies elsewhere; the same exact products, summed in float32 in
// each library's order. It is the reference the GPU kernel is swept against, and lets every
// FP8 test run without a GPU.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "backends/cpu/gemm_util.h"
#include "mixtape/core/float8.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// The 256 values of each format (index 0: e4m3fn, 1: e5m2) as bfloat16 bits, from core's
// float32 tables (mixtape/core/float8.h): exact, the low 16 bits of a float8 value's float32
// being zero (a NaN keeps a mantissa bit: NaN in bfloat16 too).
struct Bfloat16Values {
  std::uint16_t bits[2][256];
};

const Bfloat16Values& bfloat16_values() {
  static const Bfloat16Values v = [] {
    Bfloat16Values t{};
    for (int f = 0; f < 2; ++f) {
      const float* values =
          detail::float8_values(f == 0 ? Float8Format::e4m3fn : Float8Format::e5m2);
      for (int b = 0; b < 256; ++b) {
        std::uint32_t u = 0;
        std::memcpy(&u, &values[b], sizeof u);
        t.bits[f][b] = static_cast<std::uint16_t>((u >> 16) | (std::isnan(values[b]) ? 0x40u : 0u));
      }
    }
    return t;
  }();
  return v;
}

// The float8 tensor t (either format, contiguous) widened into dst (float or the bits of
// bfloat16), exactly, by table lookups (the scalar conversion is a call per element).
template <typename W>
void widen(const Tensor& t, W* dst) {
  const bool e4m3 = t.dtype() == kFloat8E4M3FN;
  const W* table;
  if constexpr (std::is_same_v<W, float>)
    table = detail::float8_values(e4m3 ? Float8Format::e4m3fn : Float8Format::e5m2);
  else
    table = bfloat16_values().bits[e4m3 ? 0 : 1];
  const auto* s = static_cast<const std::uint8_t*>(t.const_data_ptr());
  parallel_blocks(t.numel(), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = table[s[i]];
  });
}

// c [m, n] = a [m, k] b_t [n, k]^T in float32 (oneDNN's bfloat16 matmul where it runs
// natively, sgemm otherwise).
void product(const kernels::ScaledMatmulArgs& g, float* c) {
  if (onednn_native_bf16()) {
    thread_local Scratch<std::uint16_t> a16, b16;
    std::uint16_t* a = a16.get(g.m * g.k);
    std::uint16_t* b = b16.get(g.n * g.k);
    widen(g.a, a);
    widen(g.b_t, b);
    GemmShape shape;
    shape.m = g.m;
    shape.n = g.n;
    shape.k = g.k;
    shape.tb = true;  // b_t is [n, k]
    shape.lda = g.k;
    shape.ldb = g.k;
    shape.ldc = g.n;
    if (onednn_matmul_bf16_to_f32(shape, a, b, c)) return;
  }
  thread_local Scratch<> a32, b32;
  float* a = a32.get(g.m * g.k);
  float* b = b32.get(g.n * g.k);
  widen(g.a, a);
  widen(g.b_t, b);
  blas_gemm(false, true, g.m, g.n, g.k, a, g.k, b, g.k, 0.0f, c, g.n);
}

void scaled_matmul_kernel(const kernels::ScaledMatmulArgs& g) {
  const float scale = *static_cast<const float*>(g.scale_a.const_data_ptr()) *
                      *static_cast<const float*>(g.scale_b.const_data_ptr());
  const bool direct = g.out.dtype() == kFloat32;
  thread_local Scratch<> scratch;
  float* c = direct ? static_cast<float*>(g.out.data_ptr()) : scratch.get(g.m * g.n);
  product(g, c);
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
