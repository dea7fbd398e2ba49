// LossScaleOptimizer: scaling the loss, unscaling and checking the gradients in one pass,
// skipping non-finite steps and moving a dynamic scale; enable_auto_mixed_precision.
#include "mixtape/optim/loss_scale_optimizer.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <string>

#include "mixtape/autograd/amp.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/kernels.h"
#include "optim/optim_util.h"

namespace mixtape::optim {

namespace {
// The largest power of two float32 holds: a dynamic scale never grows beyond it.
const double kMaxLossScale = std::ldexp(1.0, 127);
// The largest count a checkpoint's double holds exactly: 2^53.
const double kMaxExactCount = std::ldexp(1.0, 53);
// A captured step's replays whose flags the host may leave unread when it queues the next: it
// waits for a replay's flag only when it queues the third replay after it, so that on a GPU the
// device has two replays queued while the host waits (Optimizer::LateCount).
constexpr std::size_t kUnreadReplays = 2;

// Why a step cannot be captured with this LossScaleOptimizer.
std::string not_capturable(const std::string& inner) {
  return fmt::format(
      "LossScaleOptimizer: a captured step keeps the loss scale on the device and skips an "
      "overflowing step there, which needs the gradients on one device (the scale's) and a "
      "wrapped optimizer whose updates honour the step's flag (SGD, RMSprop, Adam); it wraps {}",
      inner);
}

// `o` with a step decided on the device recorded (a copy starts from settled counts).
const LossScaleOptimizer& synced(const LossScaleOptimizer& o) {
  o.sync_step();
  return o;
}
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
  wrap(*inner_, *this);
}

LossScaleOptimizer::~LossScaleOptimizer() {
  if (inner_) unwrap(*inner_);
}

LossScaleOptimizer::LossScaleOptimizer(const LossScaleOptimizer& other)
    : Optimizer(synced(other)),
      inner_(other.inner_->clone()),
      config_(other.config_),
      options_(other.options_),
      scale_(other.scale_),
      good_steps_(other.good_steps_),
      applied_(other.applied_),
      skipped_(other.skipped_),
      consecutive_skips_(other.consecutive_skips_),
      last_skipped_(other.last_skipped_) {
  inner_->set_check_finite(false);
  wrap(*inner_, *this);
}

kernels::LossScaleRule LossScaleOptimizer::rule() const {
  return {config_.is_dynamic(), config_.multiplier(), config_.min_scale(), kMaxLossScale,
          config_.growth_interval()};
}

bool LossScaleOptimizer::scale_on_device(Device device) const {
  if (!inner_->supports_device_skip()) return false;
  // A captured step is always decided on the device (apply_captured).
  if (!capture::active()) {
    if (options_.decision == StepDecision::Host) return false;
    if (options_.decision == StepDecision::Auto && device.is_cpu()) return false;
  }
  // One copy, on the device of the first step that used it.
  return !on_device_.scale.defined() || on_device_.scale.device() == device;
}

const LossScaleOptimizer::DeviceScale& LossScaleOptimizer::device_scale(Device device) const {
  if (!on_device_.scale.defined()) {
    // Memory of its own (a hook writes it before a replay: capture::host_written), kept for
    // the optimizer's life, so that a captured step reads it where later writes go.
    on_device_ = {
        capture::host_written({}, kFloat64, device), capture::host_written({}, kFloat64, device),
        capture::host_written({}, kFloat64, device), capture::host_written({1}, kInt64, device)};
    on_device_current_ = false;
  }
  if (!capture::active()) {
    write_device_scale();
  } else {
    // Before each replay: an eager step's flag read, the replays' read up to the last
    // kUnreadReplays (the wrapped optimizer's rates cover the counts those leave open), and
    // the host's scale written if the device's is not current.
    capture::before_replay([this] {
      read_flags(kUnreadReplays);
      write_device_scale();
    });
  }
  return on_device_;
}

void LossScaleOptimizer::write_device_scale() const {
  if (on_device_current_) return;
  sync_step();
  const double values[3] = {scale_, 1.0 / scale_, static_cast<double>(good_steps_)};
  const Tensor* to[3] = {&on_device_.scale, &on_device_.inverse, &on_device_.good_steps};
  Backend& backend = backend_for(on_device_.scale.device().type());
  for (int i = 0; i < 3; ++i)
    backend.copy(to[i]->data_ptr(), to[i]->device(), &values[i], Device::cpu(), sizeof(double));
  // Every replay read (sync_step): the device's count of skipped replays is the host's.
  backend.copy(on_device_.skipped.data_ptr(), on_device_.skipped.device(), &replay_skips_read_,
               Device::cpu(), sizeof(std::int64_t));
  on_device_current_ = true;
}

void LossScaleOptimizer::move_device_scale(const Tensor& flag) {
  // The device's copy moves as record() will move the host's once it reads the flag. Eagerly
  // only a current copy moves (one behind, after a step decided on the host or a load_state,
  // is written afresh before its next use); a captured step's always does, as every replay
  // starts from a current copy (device_scale's hook).
  if (!config_.is_dynamic() || !on_device_.scale.defined() ||
      flag.device() != on_device_.scale.device() || (!capture::active() && !on_device_current_))
    return;
  find_kernel<kernels::LossScaleUpdateFn>(OpId::loss_scale_update, flag.device().type(), kFloat64)(
      flag, on_device_.scale, on_device_.inverse, on_device_.good_steps, rule());
}

Tensor LossScaleOptimizer::get_scaled_loss(const Tensor& loss) const {
  if (!loss.defined()) throw ValueError("LossScaleOptimizer::get_scaled_loss: undefined loss");
  if (scale_on_device(loss.device())) {
    // loss * scale in the loss's dtype, as the product with the scale as a number below, the
    // scale read on the device: no wait for the previous step's flag.
    return loss * cast(device_scale(loss.device()).scale, loss.dtype());
  }
  if (capture::active()) throw CaptureError(not_capturable(inner_->name()));
  sync_step();
  return loss * scale_;
}

Tensor LossScaleOptimizer::scale_loss(const Tensor& loss) const {
  return inner_->scale_loss(loss.defined() ? get_scaled_loss(loss) : loss);
}

std::vector<Tensor> LossScaleOptimizer::chain_gradients(GradientTape& tape, const Tensor& loss,
                                                        const std::vector<Variable>& variables,
                                                        const Backward& backward) {
  const Tensor scaled = loss.defined() ? get_scaled_loss(loss) : loss;
  return get_unscaled_gradients(inner_->chain_gradients(tape, scaled, variables, backward));
}

std::vector<Tensor> LossScaleOptimizer::get_unscaled_gradients(const std::vector<Tensor>& grads) {
  // The device of the gradients, when they are on one.
  std::optional<Device> device;
  bool one_device = true;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    one_device = one_device && (!device || g.device() == *device);
    device = g.device();
  }
  Checked checked;
  if (device && one_device && scale_on_device(*device)) {
    // Divided by the scale read on the device: no wait for the previous step's flag.
    checked = scale_and_flag(grads, 1.0, /*multiply=*/true, device_scale(*device).inverse);
  } else {
    if (capture::active()) throw CaptureError(not_capturable(inner_->name()));
    sync_step();
    checked = scale_and_flag(grads, 1.0 / scale_, /*multiply=*/true);
  }
  unscaled_ids_.clear();
  for (const auto& g : checked.out)
    if (g.defined()) unscaled_ids_.insert(g.id());
  unscaled_flags_ = std::move(checked.flags);
  return std::move(checked.out);
}

std::vector<Tensor> LossScaleOptimizer::flags_for(const std::vector<Tensor>& grads) const {
  // The gradients of the latest get_unscaled_gradients were checked in its pass.
  bool all_checked = !unscaled_ids_.empty();
  std::size_t defined = 0;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    ++defined;
    all_checked = all_checked && unscaled_ids_.count(g.id()) > 0;
  }
  if (all_checked && defined == unscaled_ids_.size()) return unscaled_flags_;
  return scale_and_flag(grads, 1.0, /*multiply=*/false).flags;
}

bool LossScaleOptimizer::decide_on_device(const std::vector<Tensor>& flags,
                                          const std::vector<Variable>& variables) const {
  if (options_.decision == StepDecision::Host || flags.size() != 1 ||
      !inner_->supports_device_skip())
    return false;
  const Device d = flags.front().device();
  if (options_.decision == StepDecision::Auto && d.is_cpu()) return false;
  // The kernels read the flag on the variables' device: all of them on the flag's.
  return std::all_of(variables.begin(), variables.end(),
                     [&](const Variable& v) { return !v.defined() || v.device() == d; });
}

void LossScaleOptimizer::apply_gradients(const std::vector<Tensor>& grads,
                                         const std::vector<Variable>& variables) {
  if (grads.size() != variables.size())
    throw ValueError(
        fmt::format("LossScaleOptimizer::apply_gradients: {} gradients for {} "
                    "variables",
                    grads.size(), variables.size()));
  check_not_bypassed();
  if (capture::active()) return apply_captured(grads, variables);
  // The previous step's flag, read now (not before this step's forward and backward pass
  // were queued): the wrapped optimizer's step count, and so its learning rate, needs it.
  sync_step();
  const std::vector<Tensor> flags = flags_for(grads);
  const WrapperCall call(*inner_);
  unscaled_ids_.clear();
  unscaled_flags_.clear();
  if (decide_on_device(flags, variables)) {
    // The update kernels skip on the flag, the scale on the device moves by it; the step is
    // counted now and taken back by sync_step if the flag turns out set.
    const Tensor& flag = flags.front();
    inner_->step(grads, variables, flag);
    move_device_scale(flag);
    pending_ = backend_for(flag.device().type())
                   .read_back(flag.const_data_ptr(), flag.device().index(), sizeof(float));
    return;
  }
  const bool nonfinite = any_set(flags);
  if (!nonfinite) inner_->apply_gradients(grads, variables);
  record(nonfinite);
  on_device_current_ = false;  // the host's scale moved alone
}

void LossScaleOptimizer::apply_captured(const std::vector<Tensor>& grads,
                                        const std::vector<Variable>& variables) {
  // Always decided on the device: the update kernels skip on the flag, the device counts the
  // skipped replays, and the host reads the flag behind the replay (kUnreadReplays replays
  // later, or at any accessor): the wrapped optimizer's replay takes its rates from a row that
  // this count picks (Optimizer::LateCount), so that no replay waits for the one before.
  const std::vector<Tensor> flags = flags_for(grads);
  if (flags.size() != 1 || !inner_->supports_device_skip() ||
      !scale_on_device(flags.front().device()))
    throw CaptureError(not_capturable(inner_->name()));
  const Tensor& flag = flags.front();
  const DeviceScale& on_device = device_scale(flag.device());  // (its hook reads the flags)
  const WrapperCall call(*inner_);
  unscaled_ids_.clear();
  unscaled_flags_.clear();
  const LateCount late{on_device.skipped, [this] { return replay_skips_read_; },
                       static_cast<int>(kUnreadReplays)};
  inner_->step(grads, variables, flag, &late);
  move_device_scale(flag);
  // Recorded after the updates, which read the count before this replay's: skipped += flag != 0.
  const Tensor set = cast(not_equal(flag, zeros({}, flag.dtype(), flag.device())), kInt64);
  find_kernel<kernels::CopyFn>(OpId::copy, flag.device().type(), kInt64)(
      add(on_device.skipped, set), on_device.skipped);
  capture::after_replay([this, flag] {
    replay_flags_.push_back(
        backend_for(flag.device().type())
            .read_back(flag.const_data_ptr(), flag.device().index(), sizeof(float)));
  });
}

void LossScaleOptimizer::sync_step() const { read_flags(0); }

void LossScaleOptimizer::read_flags(std::size_t unread) const {
  // The eager step's flag, then the replays' in their order.
  while (pending_ || replay_flags_.size() > unread) {
    std::unique_ptr<PendingRead> read;
    const bool replay = !pending_;
    if (!replay) {
      read = std::move(pending_);
    } else {
      read = std::move(replay_flags_.front());
      replay_flags_.pop_front();
    }
    float flag = 0.0f;
    read->wait(&flag);
    const bool nonfinite = flag != 0.0f;
    if (nonfinite) {
      inner_->uncount_step();
      if (replay) ++replay_skips_read_;
    }
    record(nonfinite);
  }
}

void LossScaleOptimizer::record(bool nonfinite) const {
  kernels::move_loss_scale(nonfinite, rule(), scale_, good_steps_);
  if (nonfinite) {
    ++skipped_;
    ++consecutive_skips_;
    last_skipped_ = true;
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
  ++applied_;
  consecutive_skips_ = 0;
  last_skipped_ = false;
}

double LossScaleOptimizer::loss_scale() const {
  sync_step();
  return scale_;
}
std::int64_t LossScaleOptimizer::applied_steps() const {
  sync_step();
  return applied_;
}
std::int64_t LossScaleOptimizer::skipped_steps() const {
  sync_step();
  return skipped_;
}
std::int64_t LossScaleOptimizer::good_steps() const {
  sync_step();
  return good_steps_;
}
bool LossScaleOptimizer::last_step_skipped() const {
  sync_step();
  return last_skipped_;
}
std::int64_t LossScaleOptimizer::iterations() const {
  sync_step();
  return inner_->iterations();
}
double LossScaleOptimizer::current_learning_rate() const {
  sync_step();
  return inner_->current_learning_rate();
}

OptimizerState LossScaleOptimizer::state(const std::vector<Variable>& variables) const {
  sync_step();
  OptimizerState s = inner_->state(variables);
  s.scalars["loss_scale"] = scale_;
  s.scalars["good_steps"] = static_cast<double>(good_steps_);
  s.scalars["applied_steps"] = static_cast<double>(applied_);
  s.scalars["skipped_steps"] = static_cast<double>(skipped_);
  return s;
}

void LossScaleOptimizer::load_state(const OptimizerState& state,
                                    const std::vector<Variable>& variables) {
  sync_step();
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
  on_device_current_ = false;  // written from these before the next step reads it
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
