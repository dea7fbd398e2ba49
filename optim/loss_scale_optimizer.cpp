// LossScaleOptimizer: scaling the loss, unscaling and checking the gradients in one pass,
// skipping non-finite steps and moving a dynamic scale; enable_auto_mixed_precision.
#include "mixtape/optim/loss_scale_optimizer.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "mixtape/autograd/amp.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "optim/optim_util.h"

namespace mixtape::optim {

namespace {
// The largest power of two float32 holds: a dynamic scale never grows beyond it.
const double kMaxLossScale = std::ldexp(1.0, 127);
// The largest count a checkpoint's double holds exactly: 2^53.
const double kMaxExactCount = std::ldexp(1.0, 53);
}  // namespace

LossScaleOptimizer::LossScaleOptimizer(std::shared_ptr<Optimizer> inner, LossScale loss_scale,
                                       LossScaleOptimizerOptions options)
    : Optimizer(0.0, Clipping{}),
      inner_(std::move(inner)),
      config_(loss_scale),
      options_(options),
      scale_(loss_scale.initial_scale()) {
  if (!inner_) throw ValueError("LossScaleOptimizer: the wrapped optimizer is empty");
  if (dynamic_cast<LossScaleOptimizer*>(inner_.get()))
    throw ValueError("LossScaleOptimizer: cannot wrap another LossScaleOptimizer");
  if (options_.max_consecutive_skips < 0)
    throw ValueError(fmt::format("LossScaleOptimizer: max_consecutive_skips must be >= 0; got {}",
                                 options_.max_consecutive_skips));
  // The gradients it hands over are checked already.
  inner_->set_check_finite(false);
}

LossScaleOptimizer::LossScaleOptimizer(const LossScaleOptimizer& other)
    : Optimizer(other),
      inner_(other.inner_->clone()),
      config_(other.config_),
      options_(other.options_),
      scale_(other.scale_),
      good_steps_(other.good_steps_),
      applied_(other.applied_),
      skipped_(other.skipped_),
      consecutive_skips_(other.consecutive_skips_),
      last_skipped_(other.last_skipped_) {}

Tensor LossScaleOptimizer::get_scaled_loss(const Tensor& loss) const {
  if (!loss.defined()) throw ValueError("LossScaleOptimizer::get_scaled_loss: undefined loss");
  return loss * scale_;
}

std::vector<Tensor> LossScaleOptimizer::get_unscaled_gradients(const std::vector<Tensor>& grads) {
  auto [out, nonfinite] = scale_and_check(grads, 1.0 / scale_, /*multiply=*/true);
  unscaled_ids_.clear();
  for (const auto& g : out)
    if (g.defined()) unscaled_ids_.insert(g.id());
  unscaled_nonfinite_ = nonfinite;
  return out;
}

bool LossScaleOptimizer::any_nonfinite(const std::vector<Tensor>& grads) const {
  // The gradients of the latest get_unscaled_gradients were checked in its pass.
  bool all_checked = !unscaled_ids_.empty();
  std::size_t defined = 0;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    ++defined;
    all_checked = all_checked && unscaled_ids_.count(g.id()) > 0;
  }
  if (all_checked && defined == unscaled_ids_.size()) return unscaled_nonfinite_;
  return scale_and_check(grads, 1.0, /*multiply=*/false).second;
}

void LossScaleOptimizer::apply_gradients(const std::vector<Tensor>& grads,
                                         const std::vector<Variable>& variables) {
  if (grads.size() != variables.size())
    throw ValueError(
        fmt::format("LossScaleOptimizer::apply_gradients: {} gradients for {} "
                    "variables",
                    grads.size(), variables.size()));
  const bool nonfinite = any_nonfinite(grads);
  unscaled_ids_.clear();
  if (nonfinite) {
    ++skipped_;
    ++consecutive_skips_;
    last_skipped_ = true;
    good_steps_ = 0;
    if (config_.is_dynamic()) scale_ = std::max(scale_ / config_.multiplier(), config_.min_scale());
    spdlog::debug("LossScaleOptimizer: non-finite gradients, step skipped; loss scale now {}",
                  scale_);
    if (options_.max_consecutive_skips > 0 && consecutive_skips_ >= options_.max_consecutive_skips)
      throw NumericError(fmt::format(
          "LossScaleOptimizer: the last {} steps all had NaN or infinite gradients (loss scale "
          "{}, {}); the model has diverged: check the learning rate, the inputs, and ops that "
          "overflow in 16 bits",
          consecutive_skips_, scale_,
          config_.is_dynamic() && scale_ <= config_.min_scale() ? "at its floor" : config_.str()));
    return;
  }
  inner_->apply_gradients(grads, variables);
  ++applied_;
  consecutive_skips_ = 0;
  last_skipped_ = false;
  if (config_.is_dynamic()) {
    ++good_steps_;
    if (good_steps_ >= config_.growth_interval()) {
      scale_ = std::min(scale_ * config_.multiplier(), kMaxLossScale);
      good_steps_ = 0;
    }
  }
}

OptimizerState LossScaleOptimizer::state(const std::vector<Variable>& variables) const {
  OptimizerState s = inner_->state(variables);
  s.scalars["loss_scale"] = scale_;
  s.scalars["good_steps"] = static_cast<double>(good_steps_);
  s.scalars["applied_steps"] = static_cast<double>(applied_);
  s.scalars["skipped_steps"] = static_cast<double>(skipped_);
  return s;
}

void LossScaleOptimizer::load_state(const OptimizerState& state,
                                    const std::vector<Variable>& variables) {
  // Every number is checked before anything changes (and before any cast: a NaN or 1e300
  // has no int64 value).
  constexpr const char* kWho = "LossScaleOptimizer::load_state";
  static constexpr std::array<const char*, 4> kKeys = {"loss_scale", "good_steps", "applied_steps",
                                                       "skipped_steps"};
  for (const auto& [key, value] : state.scalars)
    if (std::find_if(kKeys.begin(), kKeys.end(), [&](const char* k) { return key == k; }) ==
        kKeys.end())
      throw ValueError(
          fmt::format("{}: unknown scalar '{}' (it keeps {})", kWho, key, fmt::join(kKeys, ", ")));
  auto scalar = [&](const char* key) {
    auto it = state.scalars.find(key);
    if (it == state.scalars.end()) throw ValueError(fmt::format("{}: '{}' is missing", kWho, key));
    return it->second;
  };
  const double scale = scalar("loss_scale");
  if (!(scale > 0.0) || !std::isfinite(scale))
    throw ValueError(fmt::format("{}: 'loss_scale' is {}; it must be finite and > 0", kWho, scale));
  // A count: a whole number that double holds exactly (so it converts to int64 exactly).
  auto count = [&](const char* key) {
    const double v = scalar(key);
    if (!(v >= 0.0 && v <= kMaxExactCount && v == std::floor(v)))
      throw ValueError(
          fmt::format("{}: '{}' is {}; it must be a whole number in [0, 2^53]", kWho, key, v));
    return static_cast<std::int64_t>(v);
  };
  const std::int64_t good = count("good_steps"), applied = count("applied_steps"),
                     skipped = count("skipped_steps");
  // The wrapped optimizer checks (and then loads) its part: the step count and the slots.
  inner_->load_state(OptimizerState{state.iterations, state.tensors, {}}, variables);
  scale_ = scale;
  good_steps_ = good;
  applied_ = applied;
  skipped_ = skipped;
  consecutive_skips_ = 0;
}

LossScaleOptimizer enable_auto_mixed_precision(const Optimizer& optimizer,
                                               AutoMixedPrecisionOptions options) {
  if (dynamic_cast<const LossScaleOptimizer*>(&optimizer))
    throw ValueError(
        "enable_auto_mixed_precision: the optimizer is already a LossScaleOptimizer; pass the "
        "optimizer it wraps");
  set_auto_mixed_precision(true, options.dtype);
  LossScale scale = options.loss_scale.value_or(options.dtype == kFloat16 ? LossScale::dynamic()
                                                                          : LossScale::fixed(1.0));
  spdlog::info(
      "automatic mixed precision on: matmul and conv2d run in {} while training, "
      "loss scale {}",
      options.dtype, scale.str());
  return LossScaleOptimizer(optimizer.clone(), scale);
}

void disable_auto_mixed_precision() { set_auto_mixed_precision(false); }

}  // namespace mixtape::optim
