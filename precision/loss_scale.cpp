// LossScale: validation and printing.
#include "mixtape/precision/loss_scale.h"

#include <cmath>

#include "mixtape/core/error.h"

namespace mixtape {

namespace {
void check_scale(const char* what, double scale) {
  if (!std::isfinite(scale) || scale <= 0.0)
    throw ValueError(fmt::format("LossScale: {} must be positive and finite; got {}", what, scale));
}
}  // namespace

LossScale LossScale::dynamic(DynamicLossScaleOptions options) {
  check_scale("the initial scale", options.initial_scale);
  check_scale("the minimum scale", options.min_scale);
  if (options.growth_interval < 1)
    throw ValueError(fmt::format("LossScale: the growth interval must be >= 1; got {}",
                                 options.growth_interval));
  if (!std::isfinite(options.multiplier) || options.multiplier <= 1.0)
    throw ValueError(fmt::format("LossScale: the multiplier must be finite and > 1; got {}",
                                 options.multiplier));
  if (options.min_scale > options.initial_scale)
    throw ValueError(fmt::format("LossScale: the minimum scale {} is above the initial scale {}",
                                 options.min_scale, options.initial_scale));
  return LossScale(true, options);
}

LossScale LossScale::fixed(double scale) {
  check_scale("a fixed scale", scale);
  DynamicLossScaleOptions o;
  o.initial_scale = scale;
  o.min_scale = scale;
  return LossScale(false, o);
}

std::string LossScale::str() const {
  if (!dynamic_) return fmt::format("FixedLossScale({})", options_.initial_scale);
  return fmt::format(
      "DynamicLossScale(initial_scale={}, growth_interval={}, multiplier={}, min_scale={})",
      options_.initial_scale, options_.growth_interval, options_.multiplier, options_.min_scale);
}

bool operator==(const LossScale& a, const LossScale& b) {
  return a.dynamic_ == b.dynamic_ && a.options_.initial_scale == b.options_.initial_scale &&
         a.options_.growth_interval == b.options_.growth_interval &&
         a.options_.multiplier == b.options_.multiplier &&
         a.options_.min_scale == b.options_.min_scale;
}

}  // namespace mixtape
