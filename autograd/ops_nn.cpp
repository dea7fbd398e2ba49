// Convolution and pooling, NHWC like Keras; filters HWIO.
#include "autograd/op_util.h"

namespace mixtape {

using detail::Grads;

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
      throw ShapeError(fmt::format("{}: window {} is larger than the input extent {} with 'valid' "
                                   "padding; inputs: {}", op, k, in, detail::describe(inputs)));
    w.out = (in - k) / stride + 1;
  } else {
    w.out = (in + stride - 1) / stride;
    const std::int64_t total = std::max<std::int64_t>((w.out - 1) * stride + k - in, 0);
    w.pad_before = total / 2;
  }
  return w;
}

void check_nhwc(const char* op, const Tensor& x, const std::vector<Tensor>& inputs) {
  if (x.rank() != 4)
    throw ShapeError(fmt::format("{}: input must be NHWC (rank 4); got {}", op, detail::describe(inputs)));
  if (!x.dtype().is_floating())
    throw DTypeError(fmt::format("{}: needs a floating dtype; got {}", op, detail::describe(inputs)));
}

}  // namespace

Tensor conv2d(const Tensor& x, const Tensor& filters, std::array<std::int64_t, 2> strides,
              Padding padding) {
  detail::check_inputs("conv2d", {x, filters});
  check_nhwc("conv2d", x, {x, filters});
  if (filters.rank() != 4 || filters.dim(2) != x.dim(3))
    throw ShapeError(fmt::format("conv2d: filters must be [kh, kw, {}, cout] for input channels {}; "
                                 "got {}", x.dim(3), x.dim(3), detail::describe({x, filters})));
  const DType dt = promote_types(x.dtype(), filters.dtype());
  auto* kernel = detail::kernel_for<kernels::Conv2dFn>(OpId::conv2d, dt, {x, filters});
  kernels::Conv2dGeometry g;
  g.n = x.dim(0), g.h = x.dim(1), g.w = x.dim(2), g.c = x.dim(3);
  g.kh = filters.dim(0), g.kw = filters.dim(1), g.cout = filters.dim(3);
  g.stride_h = strides[0], g.stride_w = strides[1];
  const Window wh = window("conv2d", g.h, g.kh, g.stride_h, padding, {x, filters});
  const Window ww = window("conv2d", g.w, g.kw, g.stride_w, padding, {x, filters});
  g.oh = wh.out, g.ow = ww.out, g.pad_top = wh.pad_before, g.pad_left = ww.pad_before;

  Tensor xc = contiguous(cast(x, dt)), wc = contiguous(cast(filters, dt));
  Tensor out = Tensor::empty(Shape{g.n, g.oh, g.ow, g.cout}, dt, x.device());
  if (out.numel() > 0) kernel(xc, wc, out, g);
  if (should_record({xc, wc}))
    record_op("conv2d", {xc, wc}, out, [xc, wc, g](const Tensor& grad, const std::vector<bool>& needs) {
      // Second derivatives through conv2d are not recorded (the rules call kernels).
      Tensor gc = detail::contiguous_raw(grad);
      Tensor gx, gw;
      if (needs[0]) {
        gx = Tensor::empty(xc.shape(), xc.dtype(), xc.device());
        if (gx.numel() > 0)
          detail::kernel_for<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, xc.dtype(),
                                                             {gc, wc})(gc, wc, gx, g);
      }
      if (needs[1]) {
        gw = Tensor::empty(wc.shape(), wc.dtype(), wc.device());
        if (gw.numel() > 0)
          detail::kernel_for<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight,
                                                              wc.dtype(), {xc, gc})(xc, gc, gw, g);
      }
      return Grads{gx, gw};
    });
  return out;
}

namespace {
Tensor pool(OpId op, OpId backward_op, const Tensor& x, std::array<std::int64_t, 2> size,
            std::array<std::int64_t, 2> strides, Padding padding) {
  const char* name = op_name(op);
  detail::check_inputs(name, {x});
  check_nhwc(name, x, {x});
  auto* kernel = detail::kernel_for<kernels::Pool2dFn>(op, x.dtype(), {x});
  kernels::Pool2dGeometry g;
  g.n = x.dim(0), g.h = x.dim(1), g.w = x.dim(2), g.c = x.dim(3);
  g.kh = size[0], g.kw = size[1], g.stride_h = strides[0], g.stride_w = strides[1];
  const Window wh = window(name, g.h, g.kh, g.stride_h, padding, {x});
  const Window ww = window(name, g.w, g.kw, g.stride_w, padding, {x});
  g.oh = wh.out, g.ow = ww.out, g.pad_top = wh.pad_before, g.pad_left = ww.pad_before;
  Tensor xc = contiguous(x);
  Tensor out = Tensor::empty(Shape{g.n, g.oh, g.ow, g.c}, x.dtype(), x.device());
  if (out.numel() > 0) kernel(xc, out, g);
  if (should_record({xc}))
    record_op(name, {xc}, out, [xc, g, backward_op](const Tensor& grad, const std::vector<bool>&) {
      Tensor gc = detail::contiguous_raw(grad);
      Tensor gx = Tensor::empty(xc.shape(), xc.dtype(), xc.device());
      if (gx.numel() > 0)
        detail::kernel_for<kernels::Pool2dBackwardFn>(backward_op, xc.dtype(), {xc, gc})(xc, gc, gx, g);
      return Grads{gx};
    });
  return out;
}
}  // namespace

Tensor max_pool2d(const Tensor& x, std::array<std::int64_t, 2> pool_size,
                  std::array<std::int64_t, 2> strides, Padding padding) {
  return pool(OpId::max_pool2d, OpId::max_pool2d_backward, x, pool_size, strides, padding);
}

Tensor avg_pool2d(const Tensor& x, std::array<std::int64_t, 2> pool_size,
                  std::array<std::int64_t, 2> strides, Padding padding) {
  return pool(OpId::avg_pool2d, OpId::avg_pool2d_backward, x, pool_size, strides, padding);
}

}  // namespace mixtape
