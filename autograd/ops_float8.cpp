// scaled_matmul (the op of the same name) and quantize_float8 (made of other ops): the FP8
// building blocks of mixtape/autograd/ops.h.
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "autograd/op_util.h"
#include "mixtape/core/float8.h"

namespace mixtape {

namespace {

// scaled_matmul's checks and call, with or without reading host scales (float8_linear's own
// scales are not read: a non-finite amax must give NaN, on a CPU as on a GPU, which the loss
// then shows, not an error inside a layer).
Tensor scaled_matmul_impl(const Tensor& a_in, const Tensor& b_in, const Tensor& scale_a,
                          const Tensor& scale_b, ScaledMatmulOptions o, bool check_host_scales) {
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
  // A scale on the host is read: zero, negative, infinite or NaN is refused (a device scale
  // is not read back: its product follows IEEE arithmetic, docs/dtypes.md).
  // (Before each replay's kernels read it when a step is captured, mixtape/core/capture.h.)
  for (const Tensor* s : {&scale_a, &scale_b})
    if (check_host_scales && s->device().is_cpu())
      capture::detail::record_or_run([scale = *s, name = std::string(name),
                                      which = s == &scale_a ? "scale_a" : "scale_b"] {
        const float v = *static_cast<const float*>(scale.const_data_ptr());
        if (!(v > 0.0f) || !std::isfinite(v))
          throw ValueError(fmt::format(
              "{}: {} is {}; a dequantisation scale must be positive and finite", name, which, v));
      });
  if (o.out_dtype != kFloat32 && o.out_dtype != kBFloat16 && o.out_dtype != kFloat16)
    throw DTypeError(fmt::format("{}: out_dtype must be float32, bfloat16 or float16; got {}", name,
                                 o.out_dtype));
  const auto kernel =
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

}  // namespace

Tensor scaled_matmul(const Tensor& a, const Tensor& b_t, const Tensor& scale_a,
                     const Tensor& scale_b, ScaledMatmulOptions options) {
  return scaled_matmul_impl(a, b_t, scale_a, scale_b, options, /*check_host_scales=*/true);
}

namespace {

// quantize_float8's two forms: the factor into the format's range is max_of(dtype) /
// reference / 2^margin, 1 for a zero reference; the reference is this step's amax, or with
// a history its largest amax (this step's while it is all zero), the step's amax then rolled
// in when `update`.
Float8Quantized quantize(const Tensor& x, DType dtype, const Tensor* history, int margin,
                         bool update) {
  const char* name = "quantize_float8";
  detail::check_inputs(name, history ? std::vector<Tensor>{x, *history} : std::vector<Tensor>{x});
  if (!dtype.is_float8())
    throw DTypeError(
        fmt::format("{}: the target must be float8_e4m3fn or float8_e5m2; got {}", name, dtype));
  if (!x.dtype().is_floating())
    throw DTypeError(fmt::format("{}: x must be floating; got {}", name, detail::describe({x})));
  if (history && (history->dtype() != kFloat32 || history->rank() != 1 || history->numel() < 1 ||
                  history->device() != x.device() || !history->is_contiguous()))
    throw ValueError(fmt::format(
        "{}: the amax history must be a contiguous float32 vector of at least one element on x's "
        "device; got {}",
        name, detail::describe({x, *history})));
  if (margin < 0 || margin > 64)
    throw ValueError(fmt::format("{}: the margin must be in [0, 64]; got {}", name, margin));
  NoGradGuard no_grad;
  const double max = dtype == kFloat8E4M3FN ? float8_e4m3fn::max() : float8_e5m2::max();
  const Tensor wide = cast(x, kFloat32);
  const Tensor amax =
      reshape(x.numel() > 0 ? mixtape::max(abs(wide)) : zeros({}, kFloat32, x.device()), Shape{1});
  const Tensor zero = zeros_like(amax);
  Tensor reference = amax;
  if (history) {
    const Tensor recorded = reshape(mixtape::max(*history), Shape{1});
    reference = where(greater(recorded, zero), recorded, amax);
  }
  const Tensor factor =
      where(greater(reference, zero), full_like(amax, std::ldexp(max, -margin)) / reference,
            ones_like(amax));
  Float8Quantized q{cast(wide * factor, dtype), 1.0 / factor, amax};
  if (history && update) {
    // Newest first: [amax, history[0], ..., history[length - 2]], written over the history.
    const std::int64_t length = history->numel();
    const Tensor rolled =
        detail::contiguous_raw(concat({amax, history->slice(0, 0, length - 1)}, 0));
    find_kernel<kernels::CopyFn>(OpId::copy, history->device().type(), kFloat32)(rolled, *history);
  }
  return q;
}

}  // namespace

Float8Quantized quantize_float8(const Tensor& x, DType dtype) {
  return quantize(x, dtype, nullptr, 0, false);
}

Float8Quantized quantize_float8(const Tensor& x, DType dtype, const Tensor& history, int margin,
                                bool update) {
  return quantize(x, dtype, &history, margin, update);
}

namespace {

// An FP8 tensor's transpose, contiguous (a copy of bytes: the scale stays).
Tensor transposed(const Tensor& t) { return detail::contiguous_raw(transpose(t)); }

bool linear_dtype(DType d) { return d == kFloat32 || d == kBFloat16 || d == kFloat16; }

}  // namespace

Tensor float8_linear(const Tensor& x, const Tensor& w, DType out_dtype,
                     const Float8History* delayed) {
  const char* name = "float8_linear";
  detail::check_inputs(name, {x, w});
  if (x.rank() < 1 || w.rank() != 2 || x.dim(-1) != w.dim(0))
    throw ShapeError(fmt::format("{}: x [..., k] and w [k, n] must share k; got {}", name,
                                 detail::describe({x, w})));
  if (!linear_dtype(x.dtype()) || !linear_dtype(w.dtype()) || !linear_dtype(out_dtype))
    throw DTypeError(
        fmt::format("{}: x, w and the output must be float32, bfloat16 or float16; got {} -> {}",
                    name, detail::describe({x, w}), out_dtype));
  const std::int64_t k = w.dim(0), n = w.dim(1), m = x.numel() / std::max<std::int64_t>(k, 1);
  std::vector<std::int64_t> out_dims = x.shape().dims();
  out_dims.back() = n;
  Float8Quantized qx, qwt;
  Tensor y;
  {
    NoGradGuard no_grad;
    if (delayed) {
      qx = quantize_float8(reshape(x, Shape{m, k}), kFloat8E4M3FN, delayed->input, delayed->margin,
                           delayed->update);
      qwt = quantize_float8(transpose(w), kFloat8E4M3FN, delayed->weight, delayed->margin,
                            delayed->update);
    } else {
      qx = quantize_float8(reshape(x, Shape{m, k}), kFloat8E4M3FN);
      qwt = quantize_float8(transpose(w), kFloat8E4M3FN);  // [n, k]
    }
    y = reshape(scaled_matmul_impl(qx.data, qwt.data, qx.scale, qwt.scale,
                                   {.out_dtype = out_dtype, .fast_accumulation = true}, false),
                Shape(out_dims));
  }
  if (should_record({x, w}))
    record_op(
        name, {x, w}, y,
        [x, w, qx, qwt, m, n, k,
         history = delayed ? std::optional<Float8History>(*delayed) : std::nullopt](
            const Tensor& g, const std::vector<bool>& needs) {
          if (should_record({x, w, g})) {
            // A tape records this backward pass: differentiable ops (no FP8).
            const Tensor g2 = reshape(g, Shape{m, n});
            const Tensor wc = cast(w, g.dtype());
            return detail::Grads{
                needs[0] ? cast(reshape(matmul(g2, transpose(wc)), x.shape()), x.dtype())
                         : Tensor(),
                needs[1] ? cast(matmul(transpose(reshape(cast(x, g.dtype()), Shape{m, k})), g2),
                                w.dtype())
                         : Tensor()};
          }
          NoGradGuard no_grad;
          const Tensor g2 = reshape(g, Shape{m, n});
          const Float8Quantized qg = history ? quantize_float8(g2, kFloat8E5M2, history->grad,
                                                               history->margin, history->update)
                                             : quantize_float8(g2, kFloat8E5M2);
          Tensor dx, dw;
          if (needs[0])  // [m, n] x [k, n]^T
            dx = reshape(scaled_matmul_impl(qg.data, transposed(qwt.data), qg.scale, qwt.scale,
                                            {.out_dtype = x.dtype()}, false),
                         x.shape());
          if (needs[1])  // [k, m] x [n, m]^T
            dw = scaled_matmul_impl(transposed(qx.data), transposed(qg.data), qx.scale, qg.scale,
                                    {.out_dtype = w.dtype()}, false);
          return detail::Grads{dx, dw};
        });
  return y;
}

}  // namespace mixtape
