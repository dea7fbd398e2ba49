// The fused unscale + non-finite check, and gradient clipping.
#include "optim/optim_util.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"

namespace mixtape::optim {

Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  if (c.numel() > 0) find_kernel<kernels::CopyFn>(OpId::copy, c.device().type(), c.dtype())(t, c);
  return c;
}

Checked scale_and_flag(const std::vector<Tensor>& grads, double scale, bool multiply,
                       const Tensor& scale_on_device) {
  NoGradGuard no_grad;
  Checked result;
  result.out.resize(grads.size());
  // One kernel call per (device, dtype) group; one flag per device.
  struct Group {
    std::vector<Tensor> in, out;
  };
  std::map<std::pair<int, int>, Group> groups;
  std::map<int, Tensor> flags;
  std::map<int, Device> devices;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    const Tensor g = contiguous(grads[i]);
    const Device d = g.device();
    const int dkey = static_cast<int>(d.type()) * 1024 + d.index();
    devices.emplace(dkey, d);
    Group& grp = groups[{dkey, g.dtype().index()}];
    grp.in.push_back(g);
    if (multiply) {
      result.out[i] = Tensor::empty(g.shape(), g.dtype(), d);
      grp.out.push_back(result.out[i]);
    } else {
      grp.out.emplace_back();
    }
  }
  for (auto& [key, grp] : groups) {
    const Device d = devices.at(key.first);
    auto [it, inserted] = flags.try_emplace(key.first);
    if (inserted) it->second = zeros({}, kFloat32, d);
    const DType dt(static_cast<DType::Code>(key.second));
    if (scale_on_device.defined() && scale_on_device.device() != d)
      throw DeviceError(fmt::format("unscale_check: the gradients are on {}, the scale on {}", d,
                                    scale_on_device.device()));
    find_kernel<kernels::UnscaleCheckFn>(OpId::unscale_check, d.type(), dt)(
        grp.in, grp.out, scale, scale_on_device, it->second);
  }
  for (auto& [key, flag] : flags) result.flags.push_back(std::move(flag));
  return result;
}

bool any_set(const std::vector<Tensor>& flags) {
  bool set = false;
  for (const auto& flag : flags) set = set || flag.item<float>() != 0.0f;
  return set;
}

std::pair<std::vector<Tensor>, bool> scale_and_check(const std::vector<Tensor>& grads, double scale,
                                                     bool multiply) {
  Checked c = scale_and_flag(grads, scale, multiply);
  return {std::move(c.out), any_set(c.flags)};
}

std::optional<std::size_t> first_nonfinite(const std::vector<Tensor>& grads) {
  if (!scale_and_check(grads, 1.0, false).second) return std::nullopt;
  for (std::size_t i = 0; i < grads.size(); ++i)  // the error path: find the culprit
    if (grads[i].defined() && scale_and_check({grads[i]}, 1.0, false).second) return i;
  return std::nullopt;
}

void clip(std::vector<Tensor>& grads, const Clipping& c) {
  if (!c.clipnorm && !c.global_clipnorm && !c.clipvalue) return;
  NoGradGuard no_grad;
  // Norms are computed in float32 (float64 for float64 gradients).
  auto squared_norm = [](const Tensor& g) {
    return sum(square(cast(g, g.dtype() == kFloat64 ? kFloat64 : kFloat32)));
  };
  if (c.clipvalue) {
    for (auto& g : grads) {
      if (!g.defined()) continue;
      g = minimum(maximum(g, full({}, -*c.clipvalue, g.dtype(), g.device())),
                  full({}, *c.clipvalue, g.dtype(), g.device()));
    }
  } else if (c.clipnorm) {
    for (auto& g : grads) {
      if (!g.defined()) continue;
      const Tensor norm = sqrt(squared_norm(g));
      // factor = clipnorm / max(norm, clipnorm): 1 below the threshold.
      const Tensor factor = full({}, *c.clipnorm, norm.dtype(), g.device()) /
                            maximum(norm, full({}, *c.clipnorm, norm.dtype(), g.device()));
      g = cast(cast(g, factor.dtype()) * factor, g.dtype());
    }
  } else {
    clip_by_global_norm(grads, *c.global_clipnorm);
  }
}

std::vector<Tensor> scaled_by(const std::vector<Tensor>& grads, const Tensor& factor) {
  NoGradGuard no_grad;
  std::map<int, std::vector<std::size_t>> by_dtype;  // in their order: one call per dtype
  for (std::size_t i = 0; i < grads.size(); ++i)
    if (grads[i].defined()) by_dtype[grads[i].dtype().index()].push_back(i);
  std::vector<Tensor> out(grads.size());
  for (const auto& [code, at] : by_dtype) {
    std::vector<Tensor> xs, outs;
    for (const std::size_t i : at) {
      xs.push_back(contiguous(grads[i]));
      outs.push_back(Tensor::empty(xs.back().shape(), xs.back().dtype(), xs.back().device()));
    }
    find_kernel<kernels::ScaleListFn>(OpId::scale_list, factor.device().type(),
                                      DType(static_cast<DType::Code>(code)))(xs, outs, factor);
    for (std::size_t k = 0; k < at.size(); ++k) out[at[k]] = outs[k];
  }
  return out;
}

void clip_by_global_norm(std::vector<Tensor>& grads, double clipnorm) {
  const Tensor factor = global_clip_factor(grads, clipnorm);
  if (factor.defined()) grads = scaled_by(grads, factor);
}

std::vector<Tensor> nonfinite_flags(const std::vector<Tensor>& grads, const Tensor& squares) {
  const bool exact =
      squares.defined() && std::none_of(grads.begin(), grads.end(), [](const Tensor& g) {
        return g.defined() && g.dtype() == kFloat64;
      });
  return scale_and_flag(exact ? std::vector<Tensor>{squares} : grads, 1.0, false).flags;
}

Tensor global_clip_factor(std::vector<Tensor>& grads, double clipnorm, Tensor* squares) {
  NoGradGuard no_grad;
  // The gradients by dtype, in their order (one kernel call per dtype); all on one device.
  std::map<int, std::vector<std::size_t>> by_dtype;
  std::optional<Device> device;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    if (device && grads[i].device() != *device)
      throw DeviceError(fmt::format(
          "global_clipnorm: the gradients are on more than one device ({} and {}); the global "
          "norm needs them on one",
          *device, grads[i].device()));
    device = grads[i].device();
    by_dtype[grads[i].dtype().index()].push_back(i);
  }
  if (!device) return Tensor();
  for (auto& g : grads)
    if (g.defined()) g = contiguous(g);
  const auto list = [&](const std::vector<std::size_t>& at) {
    std::vector<Tensor> xs;
    for (const std::size_t i : at) xs.push_back(grads[i]);
    return xs;
  };
  // The norm on the device (no host read): the squares of every gradient summed in float64.
  const Tensor total = zeros({}, kFloat64, *device);
  for (const auto& [code, at] : by_dtype)
    find_kernel<kernels::SumSquaresFn>(OpId::sum_squares, device->type(),
                                       DType(static_cast<DType::Code>(code)))(list(at), total);
  if (squares != nullptr) *squares = total;
  // factor = clipnorm / max(norm, clipnorm): 1 below the threshold.
  const Tensor limit = full({}, clipnorm, kFloat64, *device);
  return limit / maximum(sqrt(total), limit);
}

}  // namespace mixtape::optim
