// dropout: the op dropout and its backward rule (the same op on the gradient: the mask is a
// function of the seed and the position, so nothing is stored).
#include <fmt/format.h>

#include "autograd/op_util.h"

namespace mixtape {

void detail::check_seed(const char* name, const Tensor& x, const RandomSeed& seed) {
  const Tensor& at = seed.on_device;
  if (!at.defined()) return;
  if (at.dtype() != kInt64 || at.numel() != 1)
    throw DTypeError(fmt::format("{}: a seed tensor holds one int64 element; got {}", name,
                                 detail::describe({at})));
  if (at.device() != x.device())
    throw DeviceError(
        fmt::format("{}: the seed is on {} and the input on {}; a seed tensor "
                    "lies on the op's device (draw_seed(generator, device))",
                    name, at.device().str(), x.device().str()));
}

Tensor dropout(const Tensor& x_in, double rate, const RandomSeed& seed) {
  const char* name = op_name(OpId::dropout);
  if (!(rate >= 0.0 && rate < 1.0))
    throw ValueError(fmt::format("{}: the rate must be in [0, 1); got {}", name, rate));
  detail::check_inputs(name, {x_in});
  const Tensor x = detail::op_inputs(OpId::dropout, {x_in})[0];
  if (!x.dtype().is_floating())
    throw DTypeError(
        fmt::format("{}: needs a floating tensor; got {}", name, detail::describe({x})));
  detail::check_seed(name, x, seed);
  if (rate == 0.0) return x;
  const auto kernel = detail::kernel_for<kernels::DropoutFn>(OpId::dropout, x.dtype(), {x});
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernel(detail::contiguous_raw(x), rate, seed.value, seed.on_device, out);
  if (should_record({x}))
    record_op(name, {x}, out,
              [rate, seed, dtype = x.dtype()](const Tensor& g, const std::vector<bool>&) {
                // Linear in x: the gradient through the same factors (recorded when a tape records
                // this backward pass).
                return detail::Grads{dropout(cast(g, dtype), rate, seed)};
              });
  return out;
}

}  // namespace mixtape
