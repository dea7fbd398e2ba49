// scaled_matmul (the op of the same name) and quantize_float8 (made of other ops): the FP8
// building blocks of mixtape/autograd/ops.h.
#include <fmt/format.h>

#include "autograd/op_util.h"
#include "mixtape/core/float8.h"

namespace mixtape {

Tensor scaled_matmul(const Tensor& a_in, const Tensor& b_in, const Tensor& scale_a,
                     const Tensor& scale_b, ScaledMatmulOptions o) {
  const char* name = op_name(OpId::scaled_matmul);
  detail::check_inputs(name, {a_in, b_in, scale_a, scale_b});
  const auto all = [&] { return detail::describe({a_in, b_in, scale_a, scale_b}); };
  if (!a_in.dtype().is_float8() || !b_in.dtype().is_float8())
    throw DTypeError(fmt::format(
        "{}: the operands must be float8_e4m3fn or float8_e5m2 (quantize_float8 makes them); "
        "got {}",
        name, all()));
  if (a_in.dtype() == kFloat8E5M2 && b_in.dtype() == kFloat8E5M2)
    throw DTypeError(fmt::format(
        "{}: two float8_e5m2 operands are not supported (FP8 tensor cores take e4m3 x e4m3, "
        "e4m3 x e5m2 and e5m2 x e4m3); got {}",
        name, all()));
  if (a_in.rank() != 2 || b_in.rank() != 2 || a_in.dim(1) != b_in.dim(1))
    throw ShapeError(fmt::format(
        "{}: a [m, k] and b_t [n, k] (the second operand transposed) must share k; got {}", name,
        all()));
  for (const Tensor* s : {&scale_a, &scale_b})
    if (s->dtype() != kFloat32 || s->numel() != 1)
      throw ValueError(fmt::format(
          "{}: scale_a and scale_b must be float32 tensors of one element; got {}", name, all()));
  if (o.out_dtype != kFloat32 && o.out_dtype != kBFloat16 && o.out_dtype != kFloat16)
    throw DTypeError(fmt::format("{}: out_dtype must be float32, bfloat16 or float16; got {}", name,
                                 o.out_dtype));
  auto* kernel =
      detail::kernel_for<kernels::ScaledMatmulFn>(OpId::scaled_matmul, a_in.dtype(), {a_in, b_in});
  const std::int64_t m = a_in.dim(0), n = b_in.dim(0), k = a_in.dim(1);
  Tensor out = Tensor::empty(Shape{m, n}, o.out_dtype, a_in.device());
  if (m == 0 || n == 0) return out;
  if (k == 0) {
    detail::fill_raw(out, 0.0);
    return out;
  }
  kernel({.a = detail::contiguous_raw(a_in),
          .b_t = detail::contiguous_raw(b_in),
          .scale_a = detail::contiguous_raw(scale_a),
          .scale_b = detail::contiguous_raw(scale_b),
          .out = out,
          .m = m,
          .n = n,
          .k = k,
          .fast_accumulation = o.fast_accumulation});
  return out;
}

Float8Quantized quantize_float8(const Tensor& x, DType dtype) {
  const char* name = "quantize_float8";
  detail::check_inputs(name, {x});
  if (!dtype.is_float8())
    throw DTypeError(
        fmt::format("{}: the target must be float8_e4m3fn or float8_e5m2; got {}", name, dtype));
  if (!x.dtype().is_floating())
    throw DTypeError(fmt::format("{}: x must be floating; got {}", name, detail::describe({x})));
  NoGradGuard no_grad;
  const double max = dtype == kFloat8E4M3FN ? float8_e4m3fn::max() : float8_e5m2::max();
  const Tensor wide = cast(x, kFloat32);
  const Tensor amax =
      reshape(x.numel() > 0 ? mixtape::max(abs(wide)) : zeros({}, kFloat32, x.device()), Shape{1});
  // The factor into the format's range: max / amax, 1 for an all-zero tensor.
  const Tensor positive = greater(amax, zeros_like(amax));
  const Tensor factor = where(positive, full_like(amax, max) / amax, ones_like(amax));
  return {cast(wide * factor, dtype), 1.0 / factor, amax};
}

}  // namespace mixtape
