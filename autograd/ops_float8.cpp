// scaled_matmul and quantize_float8 (the ops of the same names) and float8_linear (made of
// them): the FP8 building blocks of mixtape/autograd/ops.h.
#include <fmt/format.h>

#include <cmath>
#include <optional>

#include "autograd/op_util.h"
#include "mixtape/core/float8.h"

namespace mixtape {

namespace {

// float8_linear's epilogue of a forward product (kernels.h, ScaledMatmulArgs): the bias
// ([n] in the output's dtype, detail::kernel_bias, or undefined), the activation, and pre, which
// the call fills when keep_pre.
struct Epilogue {
  Tensor bias;
  kernels::LinearActivation activation = kernels::LinearActivation::none;
  bool keep_pre = false;
  Tensor pre{};
};

// scaled_matmul's checks and call, with or without reading host scales (float8_linear's own
// scales are not read: a non-finite amax must give NaN, on a CPU as on a GPU, which the loss
// then shows, not an error inside a layer), and with float8_linear's epilogue when given one
// (k > 0 then).
Tensor scaled_matmul_impl(const Tensor& a_in, const Tensor& b_in, const Tensor& scale_a,
                          const Tensor& scale_b, ScaledMatmulOptions o, bool check_host_scales,
                          Epilogue* epilogue = nullptr) {
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
  kernels::ScaledMatmulArgs args{.a = detail::contiguous_raw(a_in),
                                 .b_t = detail::contiguous_raw(b_in),
                                 .scale_a = detail::contiguous_raw(scale_a),
                                 .scale_b = detail::contiguous_raw(scale_b),
                                 .out = out,
                                 .m = m,
                                 .n = n,
                                 .k = k,
                                 .fast_accumulation = o.fast_accumulation};
  if (epilogue) {
    args.bias = epilogue->bias;
    args.activation = epilogue->activation;
    if (epilogue->keep_pre)
      epilogue->pre = args.pre = Tensor::empty(Shape{m, n}, o.out_dtype, out.device());
  }
  kernel(args);
  return out;
}

}  // namespace

Tensor scaled_matmul(const Tensor& a, const Tensor& b_t, const Tensor& scale_a,
                     const Tensor& scale_b, ScaledMatmulOptions options) {
  return scaled_matmul_impl(a, b_t, scale_a, scale_b, options, /*check_host_scales=*/true);
}

namespace {

// quantize_float8 in either form (history null: current scaling), through the op of that name
// (three passes on the device: the amax, the factor, the conversion). `layout` says which of
// x's FP8 layouts to write: x's own (data), its transpose (data_t, x of rank 2), or both;
// float8_linear's backward pass takes the transposes, written in the same pass.
struct Quantized {
  Tensor data, data_t, scale, amax;
};
enum class Layout : std::uint8_t { own, transposed, both };

Quantized quantize(const Tensor& x, DType dtype, const Tensor* history, int margin, bool update,
                   Layout layout = Layout::own) {
  const char* name = op_name(OpId::quantize_float8);
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
  const bool own = layout != Layout::transposed, transposed = layout != Layout::own;
  if (transposed && x.rank() != 2)
    throw ShapeError(
        fmt::format("{}: a transposed layout needs a matrix; got {}", name, detail::describe({x})));
  const auto kernel =
      detail::kernel_for<kernels::QuantizeFloat8Fn>(OpId::quantize_float8, x.dtype(), {x});
  // Rows of the last axis (the kernel's tiles), all of x.
  const std::int64_t cols = x.rank() == 0 ? 1 : x.dim(-1);
  std::int64_t rows = 1;
  for (std::size_t i = 0; i + 1 < x.rank(); ++i) rows *= x.dim(static_cast<int>(i));
  Quantized q;
  if (own) q.data = Tensor::empty(x.shape(), dtype, x.device());
  if (transposed) q.data_t = Tensor::empty(Shape{cols, rows}, dtype, x.device());
  q.scale = Tensor::empty(Shape{1}, kFloat32, x.device());
  q.amax = Tensor::empty(Shape{1}, kFloat32, x.device());
  kernel({.x = detail::contiguous_raw(x),
          .data = q.data,
          .data_t = q.data_t,
          .scale = q.scale,
          .amax = q.amax,
          .history = history ? *history : Tensor(),
          .rows = rows,
          .cols = cols,
          .margin = margin,
          .update = update});
  return q;
}

Float8Quantized public_form(Quantized q) { return {q.data, q.scale, q.amax}; }

}  // namespace

Float8Quantized quantize_float8(const Tensor& x, DType dtype) {
  return public_form(quantize(x, dtype, nullptr, 0, false));
}

Float8Quantized quantize_float8(const Tensor& x, DType dtype, const Tensor& history, int margin,
                                bool update) {
  return public_form(quantize(x, dtype, &history, margin, update));
}

namespace {

bool linear_dtype(DType d) { return d == kFloat32 || d == kBFloat16 || d == kFloat16; }

}  // namespace

Tensor float8_linear(const Tensor& x, const Tensor& w, DType out_dtype,
                     const Float8History* delayed, const Tensor& bias_in,
                     std::string_view activation_name) {
  using kernels::LinearActivation;
  const char* name = "float8_linear";
  detail::check_inputs(name, {x, w});
  if (x.rank() < 1 || w.rank() != 2 || x.dim(-1) != w.dim(0))
    throw ShapeError(fmt::format("{}: x [..., k] and w [k, n] must share k; got {}", name,
                                 detail::describe({x, w})));
  if (!linear_dtype(x.dtype()) || !linear_dtype(w.dtype()) || !linear_dtype(out_dtype))
    throw DTypeError(
        fmt::format("{}: x, w and the output must be float32, bfloat16 or float16; got {} -> {}",
                    name, detail::describe({x, w}), out_dtype));
  const LinearActivation activation = detail::checked_linear_activation(name, activation_name);
  const std::int64_t k = w.dim(0), n = w.dim(1), m = x.numel() / std::max<std::int64_t>(k, 1);
  const Tensor bias = detail::checked_linear_bias(name, x, bias_in, n, kFloat32);
  // No product to fuse with (an empty one): the product, then the bias and the activation as
  // ops of their own.
  if ((bias.defined() || activation != LinearActivation::none) && (m == 0 || n == 0 || k == 0)) {
    const Tensor y = float8_linear(x, w, out_dtype, delayed);
    return detail::apply_linear_activation(activation,
                                           bias.defined() ? y + cast(bias, out_dtype) : y);
  }
  std::vector<std::int64_t> out_dims = x.shape().dims();
  out_dims.back() = n;
  // The forward product takes x [m, k] and w transposed [n, k]; a backward pass takes x
  // transposed [k, m] (for dw) and w [k, n] (for dx): when the tape records this op, the
  // quantisations write those layouts in the same pass, and the backward pass keeps only them.
  std::vector<Tensor> inputs{x, w};
  if (bias.defined()) inputs.push_back(bias);
  const bool recorded = should_record(inputs);
  const Tensor* no_history = nullptr;
  const int margin = delayed ? delayed->margin : 0;
  const bool update = delayed && delayed->update;
  // The backward pass of gelu and gelu_tanh reads the pre-activation, relu's its output.
  Epilogue epilogue{.bias = detail::kernel_bias(bias_in, bias, out_dtype),
                    .activation = activation,
                    .keep_pre = recorded && (activation == LinearActivation::gelu ||
                                             activation == LinearActivation::gelu_tanh)};
  Quantized qx, qw;
  Tensor y2;
  {
    NoGradGuard no_grad;
    qx = quantize(reshape(x, Shape{m, k}), kFloat8E4M3FN, delayed ? &delayed->input : no_history,
                  margin, update, recorded ? Layout::both : Layout::own);
    qw = quantize(w, kFloat8E4M3FN, delayed ? &delayed->weight : no_history, margin, update,
                  recorded ? Layout::both : Layout::transposed);
    y2 = scaled_matmul_impl(qx.data, qw.data_t, qx.scale, qw.scale,
                            {.out_dtype = out_dtype, .fast_accumulation = true}, false, &epilogue);
  }
  Tensor y;
  {
    NoGradGuard no_grad;
    y = reshape(y2, Shape(out_dims));
  }
  if (!recorded) return y;
  const Tensor kept = activation == LinearActivation::relu ? y2 : epilogue.pre;
  record_op(
      name, inputs, y,
      [x, w, bias, activation, kept, out_dtype, x_t = qx.data_t, x_scale = qx.scale, w8 = qw.data,
       w_scale = qw.scale, m, n, k,
       history = delayed ? std::optional<Float8History>(*delayed) : std::nullopt](
          const Tensor& g, const std::vector<bool>& needs) {
        const Tensor g2 = reshape(g, Shape{m, n});
        if (should_record({x, w, g})) {
          // A tape records this backward pass: differentiable ops (no FP8).
          const Tensor wc = cast(w, g.dtype());
          const Tensor x2 = reshape(cast(x, g.dtype()), Shape{m, k});
          Tensor dz = g2, dbias;
          if (bias.defined() || activation != LinearActivation::none) {
            const Tensor z =
                bias.defined() ? matmul(x2, wc) + cast(bias, g.dtype()) : matmul(x2, wc);
            dz = detail::differentiable_activation_grad(activation, z, g2);
          }
          if (bias.defined()) dbias = sum(cast(dz, kFloat32), {0});
          detail::Grads grads{
              needs[0] ? cast(reshape(matmul(dz, transpose(wc)), x.shape()), x.dtype()) : Tensor(),
              needs[1] ? cast(matmul(transpose(x2), dz), w.dtype()) : Tensor()};
          if (bias.defined()) grads.push_back(dbias);
          return grads;
        }
        NoGradGuard no_grad;
        // dz = dy act'(z) and the bias gradient in linear_backward's one pass (none without a
        // bias: dz is dy), then dz quantised: dz [m, n] for dx, its transpose [n, m] for dw.
        Tensor dz = detail::contiguous_raw(g2), dbias;
        if (bias.defined() || activation != LinearActivation::none) {
          // linear_backward takes dy in the dtype of the saved pre-activation (the output's).
          if (dz.dtype() != out_dtype) dz = cast(dz, out_dtype);
          kernels::LinearBackwardArgs args;
          args.dy = dz, args.saved = kept, args.activation = activation;
          if (activation != LinearActivation::none)
            args.dz = Tensor::empty(Shape{m, n}, out_dtype, g.device());
          if (bias.defined()) args.dbias = Tensor::empty(Shape{n}, kFloat32, g.device());
          detail::kernel_for<kernels::LinearBackwardFn>(OpId::linear_backward, out_dtype,
                                                        {g})(args);
          if (args.dz.defined()) dz = args.dz;
          dbias = args.dbias;
        }
        detail::Grads grads(2);
        if (!needs[0] && !needs[1]) {  // the bias's gradient alone
          if (bias.defined()) grads.push_back(dbias);
          return grads;
        }
        const Layout layout = needs[0] && needs[1] ? Layout::both
                              : needs[0]           ? Layout::own
                                                   : Layout::transposed;
        const Quantized qg =
            quantize(dz, kFloat8E5M2, history ? &history->grad : nullptr,
                     history ? history->margin : 0, history && history->update, layout);
        if (needs[0])  // [m, n] x [k, n]^T
          grads[0] = reshape(
              scaled_matmul_impl(qg.data, w8, qg.scale, w_scale, {.out_dtype = x.dtype()}, false),
              x.shape());
        if (needs[1])  // [k, m] x [n, m]^T
          grads[1] = scaled_matmul_impl(x_t, qg.data_t, x_scale, qg.scale, {.out_dtype = w.dtype()},
                                        false);
        if (bias.defined()) grads.push_back(dbias);
        return grads;
      });
  return y;
}

}  // namespace mixtape
