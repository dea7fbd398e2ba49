// Private to optim/: the slot dtype, the non-finite check and gradient clipping shared by
// the optimizers and the loss scale optimizer.
#pragma once

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "mixtape/core/tensor.h"
#include "mixtape/optim/optimizer.h"

namespace mixtape::optim {

// float64 variables keep float64 state; every other floating dtype keeps float32.
inline DType slot_dtype(DType var) { return var == kFloat64 ? kFloat64 : kFloat32; }

// A copy of `t` with storage of its own (a snapshot that later updates do not touch).
Tensor copy_of(const Tensor& t);

// grads[i] * scale for the defined gradients (undefined ones stay undefined), and whether
// any defined gradient holds a NaN or an infinity: one unscale_check call per dtype, one
// flag read. With `multiply` false nothing is written and only the flag is computed.
std::pair<std::vector<Tensor>, bool> scale_and_check(const std::vector<Tensor>& grads, double scale,
                                                     bool multiply);

// The same pass without the read: the results and the flags (a float32 scalar per device
// that holds gradients, non-zero where one is not finite), to be read later (any_set) or
// handed to the update kernels (kernels::OptimizerUpdate::skip_if).
struct Checked {
  std::vector<Tensor> out;
  std::vector<Tensor> flags;
};
// scale_on_device, when defined (a float64 scalar on the gradients' device, all of them
// there), is read by the kernels in place of `scale`: no host read of a scale kept there.
Checked scale_and_flag(const std::vector<Tensor>& grads, double scale, bool multiply,
                       const Tensor& scale_on_device = Tensor());
// Whether any flag is set (one read per flag).
bool any_set(const std::vector<Tensor>& flags);

// The index of the first gradient holding a NaN or an infinity, if any (one pass when all
// are finite).
std::optional<std::size_t> first_nonfinite(const std::vector<Tensor>& grads);

// grads[i] * factor (a float64 scalar on their device, read there) for the defined gradients,
// all on one device (undefined ones stay undefined): one scale_list call per dtype
// (kernels.h), new tensors.
std::vector<Tensor> scaled_by(const std::vector<Tensor>& grads, const Tensor& factor);

// Clips the defined gradients in place as `clipping` says (no-op when nothing is set).
void clip(std::vector<Tensor>& grads, const Clipping& clipping);

// global_clipnorm's factor clipnorm / max(norm, clipnorm) for the defined gradients (all on one
// device; made contiguous), norm their L2 norm summed in float64 (kernels.h's sum_squares, one
// call per dtype), kept on the device: a float64 scalar there, undefined when no gradient is
// defined. `squares`, when given, receives the sum of the squares (the norm's square).
Tensor global_clip_factor(std::vector<Tensor>& grads, double clipnorm, Tensor* squares = nullptr);

// scale_and_flag(grads, 1, false).flags, read from `squares` when it is defined and no gradient
// is float64: the float64 sum of the gradients' squares (global_clip_factor's) is finite exactly
// when every gradient is (the square of a finite float32 value, summed over fewer than 2^63
// elements, stays below 1e97; a float64 square can overflow), so one element is checked instead
// of every gradient.
std::vector<Tensor> nonfinite_flags(const std::vector<Tensor>& grads, const Tensor& squares);

// global_clipnorm: every defined gradient (all on one device) times global_clip_factor; one
// sum_squares and one scale_list call per dtype, whatever the number of gradients. The
// gradients are replaced, not written to.
void clip_by_global_norm(std::vector<Tensor>& grads, double clipnorm);

}  // namespace mixtape::optim
