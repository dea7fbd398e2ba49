// LossScale: how the loss is scaled under mixed precision (the guide's "loss scaling").
//
// A LossScale is a description, not running state: fixed (always the same number) or
// dynamic (start high, halve on a step whose gradients overflow, double after a run of
// finite steps). A Policy carries one (mixed_float16: dynamic by default), and the
// LossScaleOptimizer keeps the running scale that starts from it.
//
//   mt::LossScale::dynamic()                       // 2^15, x2 every 2000 finite steps
//   mt::LossScale::dynamic({.initial_scale = 1024, .growth_interval = 100})
//   mt::LossScale::fixed(1024)
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <string>

namespace mixtape {

// The parameters of a dynamic loss scale (the Keras defaults).
struct DynamicLossScaleOptions {
  double initial_scale = 32768.0;       // 2^15
  std::int64_t growth_interval = 2000;  // finite steps in a row before the scale grows
  double multiplier = 2.0;              // growth factor; a skipped step divides by it
  double min_scale = 1.0;               // the scale never drops below this floor
};

class LossScale {
 public:
  // Dynamic: the default. Throws ValueError for a scale that is not positive and finite,
  // a growth interval < 1, a multiplier <= 1 or a floor above the initial scale.
  static LossScale dynamic(DynamicLossScaleOptions options = {});
  // Fixed: `scale` (positive and finite) for every step.
  static LossScale fixed(double scale);

  bool is_dynamic() const { return dynamic_; }
  double initial_scale() const { return options_.initial_scale; }
  std::int64_t growth_interval() const { return options_.growth_interval; }
  double multiplier() const { return options_.multiplier; }
  double min_scale() const { return options_.min_scale; }
  const DynamicLossScaleOptions& options() const { return options_; }

  // "DynamicLossScale(initial_scale=32768, growth_interval=2000, multiplier=2,
  // min_scale=1)" or "FixedLossScale(1024)".
  std::string str() const;

  friend bool operator==(const LossScale& a, const LossScale& b);

 private:
  LossScale(bool dynamic, DynamicLossScaleOptions options) : dynamic_(dynamic), options_(options) {}
  bool dynamic_ = true;
  DynamicLossScaleOptions options_;
};

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::LossScale> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::LossScale& s, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(s.str(), ctx);
  }
};
