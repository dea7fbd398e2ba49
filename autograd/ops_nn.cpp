// Convolution and pooling, NHWC like Keras; filters HWIO.
#include <cmath>
#include <limits>

#include "autograd/op_util.h"
#include "mixtape/core/compute_mode.h"

namespace mixtape {

using detail::Grads;

std::int64_t window_output_extent(std::int64_t in, std::int64_t window, std::int64_t stride,
                                  Padding padding) {
  if (stride <= 0 || window <= 0)
    throw ValueError(fmt::format("window {} and stride {} must be positive", window, stride));
  // (ceil(in / stride) without in + stride - 1, which overflows for a stride near 2^63)
  if (padding == Padding::Same) return in / stride + (in % stride != 0 ? 1 : 0);
  if (in < window)
    throw ShapeError(fmt::format(
        "window {} is larger than the input extent {} with 'valid' padding", window, in));
  return (in - window) / stride + 1;
}

AxisPadding window_padding(std::int64_t in, std::int64_t window, std::int64_t stride,
                           Padding padding) {
  const std::int64_t out = window_output_extent(in, window, stride, padding);
  if (padding == Padding::Valid) return {};
  // The windows span (out - 1) stride + window elements; in - (out - 1) stride is in [1,
  // stride] (stride when in is 0), so neither term overflows.
  const std::int64_t total = std::max<std::int64_t>(window - (in - (out - 1) * stride), 0);
  if (total > std::numeric_limits<std::int64_t>::max() - in)
    throw ShapeError(fmt::format(
        "a window of {} with 'same' padding over an extent of {} pads it to more elements than "
        "an index holds",
        window, in));
  return {total / 2, total - total / 2};
}

Padding parse_padding(const std::string& name) {
  if (name == "valid" || name == "VALID") return Padding::Valid;
  if (name == "same" || name == "SAME") return Padding::Same;
  throw ValueError(fmt::format("unknown padding '{}'; valid: valid, same", name));
}

namespace {

struct Window {
  std::int64_t out = 0, pad_before = 0;
};

// Output extent and leading padding of one spatial axis (TensorFlow's rules: 'same'
// gives ceil(in / stride) and puts the odd padding element at the end).
Window window(const char* op, std::int64_t in, std::int64_t k, std::int64_t stride, Padding p,
              const std::vector<Tensor>& inputs) {
  if (stride <= 0 || k <= 0)
    throw ValueError(fmt::format("{}: window {} and stride {} must be positive", op, k, stride));
  Window w;
  if (p == Padding::Valid) {
    if (in < k)
      throw ShapeError(
          fmt::format("{}: window {} is larger than the input extent {} with 'valid' "
                      "padding; inputs: {}",
                      op, k, in, detail::describe(inputs)));
    w.out = window_output_extent(in, k, stride, p);
  } else {
    w.out = window_output_extent(in, k, stride, p);
    try {
      w.pad_before = window_padding(in, k, stride, p).before;
    } catch (const Error& e) {
      e.rethrow_with_prefix(fmt::format("{}: ", op));
    }
  }
  return w;
}

void check_nhwc(const char* op, const Tensor& x, const std::vector<Tensor>& inputs) {
  if (x.rank() != 4)
    throw ShapeError(
        fmt::format("{}: input must be NHWC (rank 4); got {}", op, detail::describe(inputs)));
  if (!x.dtype().is_floating())
    throw DTypeError(
        fmt::format("{}: needs a floating dtype; got {}", op, detail::describe(inputs)));
}

}  // namespace

namespace {

// The three convolution products, each a recorded op whose backward rule is made of the
// other two, so that gradients of any order work. With geometry g fixed, conv(x, w),
// input_grad(dy, w) and weight_grad(x, dy) are bilinear and adjoint to one another:
//   <conv(x, w), dy> = <x, input_grad(dy, w)> = <w, weight_grad(x, dy)>.
// The forward product may add a bias in the same kernel (Conv2D's bias): its gradient is
// dy summed over the batch and the pixels, as for the add it replaces.
Tensor conv_input_grad(const Tensor& dy, const Tensor& w, const kernels::Conv2dGeometry& g);
Tensor conv_weight_grad(const Tensor& x, const Tensor& dy, const kernels::Conv2dGeometry& g);

Tensor conv_forward(const Tensor& x, const Tensor& w, const kernels::Conv2dGeometry& g,
                    const Tensor& bias = Tensor()) {
  Tensor xc = contiguous(x), wc = contiguous(w);
  const Tensor bc = bias.defined() ? contiguous(bias) : Tensor();
  const auto kernel = detail::kernel_for<kernels::Conv2dFn>(OpId::conv2d, xc.dtype(), {xc, wc});
  Tensor out = Tensor::empty(Shape{g.n, g.oh, g.ow, g.cout}, xc.dtype(), xc.device());
  if (out.numel() > 0) kernel(xc, wc, bc, out, g);
  std::vector<Tensor> inputs{xc, wc};
  if (bc.defined()) inputs.push_back(bc);
  if (should_record(inputs))
    record_op(op_name(OpId::conv2d), inputs, out,
              [xc, wc, g, bc](const Tensor& dy, const std::vector<bool>& needs) {
                Grads grads{needs[0] ? conv_input_grad(dy, wc, g) : Tensor(),
                            needs[1] ? conv_weight_grad(xc, dy, g) : Tensor()};
                if (bc.defined()) grads.push_back(needs[2] ? sum_to(dy, bc.shape()) : Tensor());
                return grads;
              });
  return out;
}

Tensor conv_input_grad(const Tensor& dy, const Tensor& w, const kernels::Conv2dGeometry& g) {
  Tensor dyc = contiguous(dy), wc = contiguous(w);
  const auto kernel = detail::kernel_for<kernels::Conv2dBackwardInputFn>(
      OpId::conv2d_backward_input, dyc.dtype(), {dyc, wc});
  Tensor dx = Tensor::empty(Shape{g.n, g.h, g.w, g.c}, dyc.dtype(), dyc.device());
  if (dx.numel() > 0) kernel(dyc, wc, dx, g);
  if (should_record({dyc, wc}))
    record_op(op_name(OpId::conv2d_backward_input), {dyc, wc}, dx,
              [dyc, wc, g](const Tensor& v, const std::vector<bool>& needs) {
                return Grads{needs[0] ? conv_forward(v, wc, g) : Tensor(),
                             needs[1] ? conv_weight_grad(v, dyc, g) : Tensor()};
              });
  return dx;
}

Tensor conv_weight_grad(const Tensor& x, const Tensor& dy, const kernels::Conv2dGeometry& g) {
  Tensor xc = contiguous(x), dyc = contiguous(dy);
  const auto kernel = detail::kernel_for<kernels::Conv2dBackwardWeightFn>(
      OpId::conv2d_backward_weight, xc.dtype(), {xc, dyc});
  Tensor dw = Tensor::empty(Shape{g.kh, g.kw, g.c, g.cout}, xc.dtype(), xc.device());
  if (dw.numel() > 0) kernel(xc, dyc, dw, g);
  if (should_record({xc, dyc}))
    record_op(op_name(OpId::conv2d_backward_weight), {xc, dyc}, dw,
              [xc, dyc, g](const Tensor& v, const std::vector<bool>& needs) {
                return Grads{needs[0] ? conv_input_grad(dyc, v, g) : Tensor(),
                             needs[1] ? conv_forward(xc, v, g) : Tensor()};
              });
  return dw;
}

}  // namespace

Tensor conv2d(const Tensor& x_in, const Tensor& filters_in, std::array<std::int64_t, 2> strides,
              Padding padding) {
  return conv2d(x_in, filters_in, Tensor(), strides, padding);
}

Tensor conv2d(const Tensor& x_in, const Tensor& filters_in, const Tensor& bias_in,
              std::array<std::int64_t, 2> strides, Padding padding) {
  const bool has_bias = bias_in.defined();
  std::vector<Tensor> given{x_in, filters_in};
  if (has_bias) given.push_back(bias_in);
  detail::check_inputs("conv2d", given);
  const auto in = detail::op_inputs(OpId::conv2d, given);
  const Tensor &x = in[0], &filters = in[1];
  const Tensor bias = has_bias ? in[2] : Tensor();
  check_nhwc("conv2d", x, {x, filters});
  if (filters.rank() != 4 || filters.dim(2) != x.dim(3))
    throw ShapeError(
        fmt::format("conv2d: filters must be [kh, kw, {}, cout] for input channels {}; "
                    "got {}",
                    x.dim(3), x.dim(3), detail::describe({x, filters})));
  if (has_bias && (bias.rank() != 1 || bias.dim(0) != filters.dim(3)))
    throw ShapeError(fmt::format("conv2d: bias must be [{}] (the filters' output channels); got {}",
                                 filters.dim(3), detail::describe({x, filters, bias})));
  DType dt = promote_types(x.dtype(), filters.dtype());
  if (has_bias) dt = promote_types(dt, bias.dtype());
  detail::kernel_for<kernels::Conv2dFn>(OpId::conv2d, dt, {x, filters});  // fail early
  kernels::Conv2dGeometry g;
  g.n = x.dim(0), g.h = x.dim(1), g.w = x.dim(2), g.c = x.dim(3);
  g.kh = filters.dim(0), g.kw = filters.dim(1), g.cout = filters.dim(3);
  g.stride_h = strides[0], g.stride_w = strides[1];
  const Window wh = window("conv2d", g.h, g.kh, g.stride_h, padding, {x, filters});
  const Window ww = window("conv2d", g.w, g.kw, g.stride_w, padding, {x, filters});
  g.oh = wh.out, g.ow = ww.out, g.pad_top = wh.pad_before, g.pad_left = ww.pad_before;
  // Decided once here: the backward products reuse g, so they accumulate alike.
  g.low_precision_accumulation = gemm_accumulation_dtype(dt) == dt && dt.is_reduced_float();
  return conv_forward(cast(x, dt), cast(filters, dt), g, has_bias ? cast(bias, dt) : Tensor());
}

namespace {

kernels::Pool2dGeometry pool_geometry(const char* name, const Tensor& x,
                                      std::array<std::int64_t, 2> size,
                                      std::array<std::int64_t, 2> strides, Padding padding) {
  kernels::Pool2dGeometry g;
  g.n = x.dim(0), g.h = x.dim(1), g.w = x.dim(2), g.c = x.dim(3);
  g.kh = size[0], g.kw = size[1], g.stride_h = strides[0], g.stride_w = strides[1];
  const Window wh = window(name, g.h, g.kh, g.stride_h, padding, {x});
  const Window ww = window(name, g.w, g.kw, g.stride_w, padding, {x});
  g.oh = wh.out, g.ow = ww.out, g.pad_top = wh.pad_before, g.pad_left = ww.pad_before;
  return g;
}

Tensor avg_pool_forward(const Tensor& x, const kernels::Pool2dGeometry& g);

// The adjoint of average pooling (linear in dy); its own adjoint is average pooling.
Tensor avg_pool_backward(const Tensor& dy, const kernels::Pool2dGeometry& g) {
  Tensor dyc = contiguous(dy);
  const auto kernel =
      detail::kernel_for<kernels::Pool2dBackwardFn>(OpId::avg_pool2d_backward, dyc.dtype(), {dyc});
  Tensor dx = Tensor::empty(Shape{g.n, g.h, g.w, g.c}, dyc.dtype(), dyc.device());
  if (dx.numel() > 0) kernel(dx, dyc, dx, g);  // x's values are not read
  if (should_record({dyc}))
    record_op(
        op_name(OpId::avg_pool2d_backward), {dyc}, dx,
        [g](const Tensor& v, const std::vector<bool>&) { return Grads{avg_pool_forward(v, g)}; });
  return dx;
}

Tensor avg_pool_forward(const Tensor& x, const kernels::Pool2dGeometry& g) {
  Tensor xc = contiguous(x);
  const auto kernel = detail::kernel_for<kernels::Pool2dFn>(OpId::avg_pool2d, xc.dtype(), {xc});
  Tensor out = Tensor::empty(Shape{g.n, g.oh, g.ow, g.c}, xc.dtype(), xc.device());
  if (out.numel() > 0) kernel(xc, out, g);
  if (should_record({xc}))
    record_op(op_name(OpId::avg_pool2d), {xc}, out,
              [g](const Tensor& dy, const std::vector<bool>&) {
                return Grads{avg_pool_backward(dy, g)};
              });
  return out;
}

// For each output of max pooling, the value of `v` (x's shape) at the window's first
// maximum of `x`: the adjoint of max_pool2d_backward in its gradient argument. Composed
// of gathers so that it is differentiable in `v`; only second derivatives use it.
Tensor gather_window_max(const Tensor& x, const Tensor& v, const kernels::Pool2dGeometry& g) {
  const std::int64_t k = g.kh * g.kw, n_x = x.numel();
  const std::int64_t windows = g.n * g.oh * g.ow * g.c;
  std::vector<std::int64_t> idx(static_cast<std::size_t>(windows * k));
  std::size_t at = 0;
  for (std::int64_t b = 0; b < g.n; ++b)
    for (std::int64_t oy = 0; oy < g.oh; ++oy)
      for (std::int64_t ox = 0; ox < g.ow; ++ox)
        for (std::int64_t ch = 0; ch < g.c; ++ch)
          for (std::int64_t i = 0; i < g.kh; ++i)
            for (std::int64_t j = 0; j < g.kw; ++j) {
              const std::int64_t y = oy * g.stride_h - g.pad_top + i;
              const std::int64_t xx = ox * g.stride_w - g.pad_left + j;
              const bool inside = y >= 0 && y < g.h && xx >= 0 && xx < g.w;
              idx[at++] = inside ? ((b * g.h + y) * g.w + xx) * g.c + ch : n_x;  // n_x: padding
            }
  Tensor index = from_vector(idx, Shape{windows, k}, kInt64, x.device());
  Tensor x_ext =
      concat({reshape(detach(x), Shape{n_x}), full(Shape{1}, -HUGE_VAL, x.dtype(), x.device())}, 0);
  Tensor patches = reshape(gather(x_ext, reshape(index, Shape{windows * k}), 0), Shape{windows, k});
  Tensor winner = gather(index, unsqueeze(argmax(patches, 1), 1), 1);  // flat positions
  Tensor picked = gather(reshape(v, Shape{n_x}), reshape(winner, Shape{windows}), 0);
  return reshape(picked, Shape{g.n, g.oh, g.ow, g.c});
}

// Routes dy to each window's first maximum of x. Linear in dy; piecewise constant in x.
Tensor max_pool_backward(const Tensor& x, const Tensor& dy, const kernels::Pool2dGeometry& g) {
  Tensor dyc = contiguous(dy);
  const auto kernel =
      detail::kernel_for<kernels::Pool2dBackwardFn>(OpId::max_pool2d_backward, x.dtype(), {x, dyc});
  Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (dx.numel() > 0) kernel(x, dyc, dx, g);
  if (should_record({dyc}))
    record_op(op_name(OpId::max_pool2d_backward), {dyc}, dx,
              [x, g](const Tensor& v, const std::vector<bool>&) {
                return Grads{gather_window_max(x, v, g)};
              });
  return dx;
}

}  // namespace

Tensor max_pool2d(const Tensor& x_in, std::array<std::int64_t, 2> pool_size,
                  std::array<std::int64_t, 2> strides, Padding padding) {
  detail::check_inputs("max_pool2d", {x_in});
  const Tensor x = detail::op_inputs(OpId::max_pool2d, {x_in})[0];
  check_nhwc("max_pool2d", x, {x});
  const auto kernel = detail::kernel_for<kernels::Pool2dFn>(OpId::max_pool2d, x.dtype(), {x});
  const auto g = pool_geometry("max_pool2d", x, pool_size, strides, padding);
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(Shape{g.n, g.oh, g.ow, g.c}, x.dtype(), x.device());
  if (out.numel() > 0) kernel(xc, out, g);
  if (should_record({xc}))
    record_op(op_name(OpId::max_pool2d), {xc}, out,
              [xc, g](const Tensor& dy, const std::vector<bool>&) {
                return Grads{max_pool_backward(detach(xc), dy, g)};
              });
  return out;
}

Tensor avg_pool2d(const Tensor& x_in, std::array<std::int64_t, 2> pool_size,
                  std::array<std::int64_t, 2> strides, Padding padding) {
  detail::check_inputs("avg_pool2d", {x_in});
  const Tensor x = detail::op_inputs(OpId::avg_pool2d, {x_in})[0];
  check_nhwc("avg_pool2d", x, {x});
  detail::kernel_for<kernels::Pool2dFn>(OpId::avg_pool2d, x.dtype(), {x});  // fail early
  return avg_pool_forward(x, pool_geometry("avg_pool2d", x, pool_size, strides, padding));
}

}  // namespace mixtape
