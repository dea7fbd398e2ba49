// LossScaleOptimizer: loss scaling for float16 training, wrapped around any optimizer (the
// guide's custom training loop).
//
//   mt::optim::LossScaleOptimizer opt(mt::optim::RMSprop(), mt::LossScale::dynamic());
//   mt::GradientTape tape;
//   mt::Tensor loss = loss_object(y, model(x, {.training = true}));
//   auto scaled_grads = tape.gradient(opt.get_scaled_loss(loss), model.trainable_variables());
//   opt.apply_gradients(opt.get_unscaled_gradients(scaled_grads), model.trainable_variables());
//
// get_unscaled_gradients divides every gradient by the scale and looks for NaN and
// infinities in the same pass (one kernel call per dtype, one flag read per step).
// apply_gradients then skips a step whose gradients are not finite: nothing changes (no
// variable, slot or iteration count) and a dynamic scale is divided by its multiplier (not
// below its floor, min_scale, 1 by default) and its count of good steps restarts. A finite
// step goes to the wrapped optimizer; after growth_interval finite steps in a row a
// dynamic scale is multiplied by its multiplier (never beyond 2^127, the largest power of
// two float32 holds). A fixed scale never changes.
//
// When max_consecutive_skips steps in a row are skipped (the scale sits at its floor and
// the gradients still overflow: the model diverged), apply_gradients throws NumericError
// instead of skipping silently forever.
//
// On a GPU the decision is made on the device (StepDecision::Auto): the flag of the
// finiteness check goes to the update kernels, which change nothing when it is set, and to
// a copy of the scale kept on the device, which moves by it (loss_scale_update, kernels.h);
// the host reads the flag one step later, without waiting for the device (a copy queued
// behind the check). get_scaled_loss and get_unscaled_gradients read the device's scale, so
// the host first waits in the next apply_gradients, for the step before, with this step's
// forward and backward pass queued (the wrapped optimizer's step count and learning rate
// need to know whether that step counted). The counts, the host's scale and the iteration
// count are brought up to date by apply_gradients, any accessor, state, or sync_step(). They
// end up as with a read per step, bit for bit; only a NumericError for
// max_consecutive_skips comes from that next call.
//
// In a captured step (mixtape/core/capture.h) the host reads a replay's flag only when it queues
// the third replay after it, so that the device always has replays queued: the device counts
// the skipped replays, and the wrapped optimizer's replay takes its rates from the row of the
// counts still possible that this count picks (Optimizer::LateCount). A NumericError for
// max_consecutive_skips then comes up to three replays late.
#pragma once

#include <concepts>
#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_set>

#include "mixtape/core/backend.h"
#include "mixtape/optim/optimizer.h"
#include "mixtape/precision/loss_scale.h"

namespace mixtape::kernels {
struct LossScaleRule;
}

namespace mixtape::optim {

struct LossScaleOptimizerOptions {
  // Steps skipped in a row before apply_gradients throws NumericError (0: never).
  std::int64_t max_consecutive_skips = 100;
  StepDecision decision = StepDecision::Auto;
};

class LossScaleOptimizer : public Optimizer {
 public:
  LossScaleOptimizer(std::shared_ptr<Optimizer> inner, LossScale loss_scale = LossScale::dynamic(),
                     LossScaleOptimizerOptions options = {});
  // Wraps a copy of an optimizer given by value: LossScaleOptimizer(RMSprop(), ...).
  template <typename O>
  requires(std::derived_from<O, Optimizer> && !std::same_as<O, LossScaleOptimizer>)
      LossScaleOptimizer(const O& inner, LossScale loss_scale = LossScale::dynamic(),
                         LossScaleOptimizerOptions options = {})
      : LossScaleOptimizer(inner.clone(), loss_scale, options) {}
  LossScaleOptimizer(const LossScaleOptimizer& other);
  ~LossScaleOptimizer() override;

  // loss * scale, in the loss's dtype.
  Tensor get_scaled_loss(const Tensor& loss) const;
  // Each gradient / scale (undefined ones stay undefined), checked for non-finite values.
  std::vector<Tensor> get_unscaled_gradients(const std::vector<Tensor>& grads);
  // Skips the step (and adjusts the scale) when the gradients are not finite; otherwise
  // the wrapped optimizer steps. The gradients are the unscaled ones.
  void apply_gradients(const std::vector<Tensor>& grads,
                       const std::vector<Variable>& variables) override;

  // The current scale.
  double loss_scale() const;
  const LossScale& loss_scale_config() const { return config_; }
  std::int64_t applied_steps() const;
  std::int64_t skipped_steps() const;
  // Finite steps since the scale last changed (dynamic scales).
  std::int64_t good_steps() const;
  // Whether the latest apply_gradients was skipped.
  bool last_step_skipped() const;
  // Reads the outcome of a step decided on the device and not read yet, if any, and updates
  // the counts and the scale (the calls above do this first; it waits for the device only
  // up to that step's check). Throws NumericError when that step was the
  // max_consecutive_skips-th skipped in a row.
  void sync_step() const;
  // sync_step, then the wrapped optimizer's (Optimizer::check_pending).
  void check_pending() override {
    inner_->check_pending();
    sync_step();
  }

  // The chain (Optimizer::compute_gradients): the loss scaled, the wrapped optimizer's
  // scaling inside; this one, and a DistributedOptimizer it wraps, if any.
  Tensor scale_loss(const Tensor& loss) const override;
  LossScaleOptimizer* loss_scale_optimizer() const override {
    return const_cast<LossScaleOptimizer*>(this);
  }
  DistributedOptimizer* distributed_optimizer() const override {
    return inner_->distributed_optimizer();
  }

  // The wrapped optimizer (its iteration count is up to date after sync_step()).
  Optimizer& inner_optimizer() { return *inner_; }
  const Optimizer& inner_optimizer() const { return *inner_; }
  std::int64_t iterations() const override;
  double current_learning_rate() const override;
  std::string name() const override { return "LossScaleOptimizer"; }
  std::shared_ptr<Optimizer> clone() const override {
    return std::make_shared<LossScaleOptimizer>(*this);
  }
  // The wrapped optimizer's state plus loss_scale, good_steps, applied_steps and
  // skipped_steps. load_state checks them before anything changes (ValueError naming the
  // number: the scale finite and > 0, each count a whole number in [0, 2^53], no other
  // scalar), then the wrapped optimizer's part (Optimizer::load_state).
  OptimizerState state(const std::vector<Variable>& variables) const override;
  void load_state(const OptimizerState& state, const std::vector<Variable>& variables) override;

 protected:
  std::vector<std::string> slot_names() const override { return {}; }
  void update(const Variable&, const Tensor&, const std::vector<Variable>&, double,
              std::int64_t) override {}
  // The wrapped optimizer's gradients of the scaled loss, unscaled (get_scaled_loss, then
  // get_unscaled_gradients).
  std::vector<Tensor> chain_gradients(GradientTape& tape, const Tensor& loss,
                                      const std::vector<Variable>& variables,
                                      const Backward& backward) override;

 private:
  // The non-finite flags of `grads` (one per device; the pass of get_unscaled_gradients
  // when they are its results).
  std::vector<Tensor> flags_for(const std::vector<Tensor>& grads) const;
  // Whether a step with these flags is decided on the device.
  bool decide_on_device(const std::vector<Tensor>& flags,
                        const std::vector<Variable>& variables) const;
  // The counts and the scale after a step that was skipped (nonfinite) or applied.
  void record(bool nonfinite) const;
  // apply_gradients in a captured step: decided on the device, the flag read after each replay.
  void apply_captured(const std::vector<Tensor>& grads, const std::vector<Variable>& variables);

  // The scale kept on the device: float64 scalars there, read by get_scaled_loss's product
  // and get_unscaled_gradients' kernel (the inverse), moved behind each step decided on the
  // device by loss_scale_update (the good steps too, for the rule); and the captured step's
  // replays skipped so far (int64 [1]; Optimizer::LateCount).
  struct DeviceScale {
    Tensor scale, inverse, good_steps, skipped;
  };
  // config_'s rule (kernels.h): the one record() and loss_scale_update follow.
  kernels::LossScaleRule rule() const;
  // Whether a step on `device` reads its scale there: the step is decided there (or
  // captured) and the wrapped optimizer's updates honour the flag.
  bool scale_on_device(Device device) const;
  // The device's scale, made on `device` at the first use and written from the host's when
  // it is not current (outside a capture now; in a captured step before each replay).
  const DeviceScale& device_scale(Device device) const;
  void write_device_scale() const;
  // Queues loss_scale_update by `flag` when the device's scale is current.
  void move_device_scale(const Tensor& flag);
  // Reads the eager step's flag, if not read yet, then the replays' oldest first until at
  // most `unread` are left (waiting for the device as far as that), and records each.
  void read_flags(std::size_t unread) const;

  std::shared_ptr<Optimizer> inner_;
  LossScale config_;
  LossScaleOptimizerOptions options_;
  // Mutable: a step decided on the device is recorded by the next call that reads them
  // (sync_step), const ones included.
  mutable double scale_;
  mutable std::int64_t good_steps_ = 0, applied_ = 0, skipped_ = 0, consecutive_skips_ = 0;
  mutable bool last_skipped_ = false;
  // The flag of the step decided on the device and not read yet.
  mutable std::unique_ptr<PendingRead> pending_;
  // The flags of the captured step's replays not read yet, oldest first, and how many of those
  // read were set (the host's side of DeviceScale::skipped).
  mutable std::deque<std::unique_ptr<PendingRead>> replay_flags_;
  mutable std::int64_t replay_skips_read_ = 0;
  // The scale on the device, and whether it is the scale after every step queued so far
  // (false after a step decided on the host or a load_state: written afresh before its use).
  mutable DeviceScale on_device_;
  mutable bool on_device_current_ = false;
  // The result of the latest get_unscaled_gradients, for the apply_gradients that follows.
  std::unordered_set<std::uint64_t> unscaled_ids_;
  std::vector<Tensor> unscaled_flags_;
};

// --- Automatic mixed precision ---------------------------------------------------------------

struct AutoMixedPrecisionOptions {
  DType dtype = kFloat16;                    // or bfloat16 (then the loss scale is fixed at 1)
  std::optional<LossScale> loss_scale = {};  // default: dynamic for float16
};

// Turns on the automatic mixed precision rewrite (mixtape/autograd/amp.h) and returns
// `optimizer` wrapped in a LossScaleOptimizer (TensorFlow's
// enable_mixed_precision_graph_rewrite). A float32 model then runs its matmuls and
// convolutions in float16 while it trains, without any layer change.
LossScaleOptimizer enable_auto_mixed_precision(const Optimizer& optimizer,
                                               AutoMixedPrecisionOptions options = {});
// Turns the rewrite off again.
void disable_auto_mixed_precision();

}  // namespace mixtape::optim
