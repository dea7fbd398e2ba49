// An FP8 matrix product with per-tensor scales: "current" scaling of both operands, then
// scaled_matmul, against the float32 product.
#include <fmt/format.h>
#include <mixtape/mixtape.h>

#include <cmath>

namespace mt = mixtape;

int main() {
  mt::manual_seed(1);
  const mt::Tensor x = mt::normal({32, 256});        // [m, k]: activations
  const mt::Tensor w = mt::normal({64, 256}) * 0.1;  // [n, k]: weights, output-major
  // amax = max |x|, data = cast(x * (448 / amax), float8_e4m3fn), scale = amax / 448:
  // computed on x's device, no host wait.
  const mt::Float8Quantized qx = mt::quantize_float8(x, mt::kFloat8E4M3FN);
  const mt::Float8Quantized qw = mt::quantize_float8(w, mt::kFloat8E4M3FN);
  // y [m, n] = scale_x * scale_w * (x8 w8^T): exact products, float32 sums, one rounding.
  const mt::Tensor y =
      mt::scaled_matmul(qx.data, qw.data, qx.scale, qw.scale, {.out_dtype = mt::kBFloat16});
  const mt::Tensor exact = mt::matmul(x, mt::transpose(w));
  const double error =
      mt::sqrt(mt::mean(mt::square(mt::cast(y, mt::kFloat32) - exact))).item<double>() /
      mt::sqrt(mt::mean(mt::square(exact))).item<double>();
  fmt::print("y {} {}; relative RMS error against float32 {:.4f}\n", y.shape(), y.dtype(), error);
  return error < 0.05 ? 0 : 1;  // e4m3 keeps 3 mantissa bits: a few percent
}
