// Optimizers: SGD, RMSprop, Adam, AdamW (Keras' update rules and defaults), learning
// rate schedules, gradient clipping, and state that can be saved and restored.
//
//   mt::optim::Adam opt({.learning_rate = 1e-3});
//   opt.apply_gradients(grads, model.trainable_variables());
//
// State (slots) lives in float32 for float32, float16 and bfloat16 variables (float64 for
// float64 ones) and is created on a variable's first step. A step whose gradients hold a
// NaN or an infinity throws NumericError and changes nothing (no variable, slot or
// iteration count); on a GPU that is known only after the step, so the next apply_gradients
// throws (set_finite_check); LossScaleOptimizer (loss_scale_optimizer.h) skips such steps
// instead.
// Clipping (clipnorm, global_clipnorm or clipvalue; at most one) applies to the gradients
// as given, which under loss scaling are the unscaled ones.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "mixtape/autograd/tape.h"
#include "mixtape/autograd/variable.h"
#include "mixtape/core/tensor.h"

namespace mixtape::kernels {
struct OptimizerUpdate;
}  // namespace mixtape::kernels

namespace mixtape::optim {

class LossScaleOptimizer;
class DistributedOptimizer;

// A learning rate: a number, or a schedule of the step (the count of applied steps
// before the current one, Keras' `iterations`).
class LearningRate {
 public:
  LearningRate(double value);  // NOLINT(google-explicit-constructor)
  LearningRate(std::string name, std::function<double(std::int64_t step)> schedule);
  double operator()(std::int64_t step) const;
  const std::string& name() const { return name_; }  // "0.001" or the schedule's name
  // The number, for a learning rate that is one (empty for a schedule).
  const std::optional<double>& constant() const { return constant_; }

 private:
  std::string name_;
  std::optional<double> constant_;
  std::function<double(std::int64_t)> schedule_;
};

namespace schedules {
// initial * rate^(step / decay_steps) (the exponent floored when staircase).
LearningRate exponential_decay(double initial, std::int64_t decay_steps, double decay_rate,
                               bool staircase = false);
// values[i] while step <= boundaries[i] (values has one more entry than boundaries).
LearningRate piecewise_constant(std::vector<std::int64_t> boundaries, std::vector<double> values);
// initial * ((1 - alpha) * (1 + cos(pi * min(step, decay_steps) / decay_steps)) / 2 + alpha)
LearningRate cosine_decay(double initial, std::int64_t decay_steps, double alpha = 0.0);
}  // namespace schedules

// Clipping of the gradients before a step (Keras' optimizer arguments); at most one.
struct Clipping {
  std::optional<double> clipnorm = {};         // each gradient to this L2 norm
  std::optional<double> global_clipnorm = {};  // all gradients together to this L2 norm
  std::optional<double> clipvalue = {};        // each element to [-clipvalue, clipvalue]
};

// What an optimizer saves: its step count, its slot tensors named "<variable>/<slot>",
// and named numbers (a loss scale optimizer's scale and counters).
struct OptimizerState {
  std::int64_t iterations = 0;
  std::map<std::string, Tensor> tensors = {};
  std::map<std::string, double> scalars = {};
};

// Where a step's skip decision is made (a LossScaleOptimizer's on overflow, an optimizer's on
// its finiteness check).
enum class StepDecision {
  Auto,    // on the device when the variables live on a GPU, on the host otherwise
  Device,  // on the device wherever the variables are (the CPU too: a read one call later)
  Host,    // the flag read before every update (one host synchronisation per step on a GPU)
};

class Optimizer {
 public:
  virtual ~Optimizer();

  // One step: grads[i] updates variables[i]. Counts must match; an undefined gradient
  // (a variable the loss does not depend on) leaves its variable alone and is logged
  // once per variable; a gradient of another shape or device throws, one of another
  // floating dtype is cast. Throws NumericError, changing nothing, when a gradient is
  // not finite (check_finite).
  virtual void apply_gradients(const std::vector<Tensor>& grads,
                               const std::vector<Variable>& variables);

  // --- The step through the chain of optimizers (Keras 3's train_step) -------------------
  //
  //   mt::GradientTape tape;
  //   const mt::Tensor loss = loss_fn(y, model(x, {.training = true}));
  //   const auto grads = opt.compute_gradients(tape, loss, vars);
  //   opt.apply_gradients(grads, vars);
  //
  // The same four lines under any policy and on any number of processes: each wrapper does
  // its part, in whatever order they are nested. A LossScaleOptimizer scales the loss before
  // the backward pass and unscales the gradients after it (apply_gradients then checks them
  // and skips a step that overflowed); a DistributedOptimizer sums each bucket of gradients
  // across processes as soon as the backward pass has it, and its apply_gradients takes them
  // as they are. An undefined `loss` says this process has no samples this step (its share of
  // a global batch is empty): the gradients are undefined, and still join the reductions of
  // the other processes.
  std::vector<Tensor> compute_gradients(GradientTape& tape, const Tensor& loss,
                                        const std::vector<Variable>& variables);
  // The loss the backward pass starts from: `loss`, scaled by a LossScaleOptimizer of the
  // chain.
  virtual Tensor scale_loss(const Tensor& loss) const { return loss; }
  // The LossScaleOptimizer of the chain (this one or one it wraps), or nullptr: its scale and
  // counts are what a trainer logs.
  virtual LossScaleOptimizer* loss_scale_optimizer() const { return nullptr; }
  // The DistributedOptimizer of the chain, or nullptr.
  virtual DistributedOptimizer* distributed_optimizer() const { return nullptr; }
  // For a wrapper that keeps no state of its own (a DistributedOptimizer, a
  // GradientAccumulationOptimizer), the optimizer it wraps, whose state a checkpoint holds;
  // nullptr for the others.
  virtual Optimizer* pass_through() const { return nullptr; }

  // Applied steps so far.
  virtual std::int64_t iterations() const { return iterations_; }
  // The learning rate of the next step.
  virtual double current_learning_rate() const { return learning_rate_(iterations()); }
  const LearningRate& learning_rate() const { return learning_rate_; }
  void set_learning_rate(LearningRate lr) { learning_rate_ = std::move(lr); }
  const Clipping& clipping() const { return clipping_; }
  // Whether apply_gradients checks for non-finite gradients (on by default).
  void set_check_finite(bool on) { check_finite_ = on; }
  // Where that check is decided. Host: its flag is read before any update, and a non-finite
  // gradient throws NumericError from this apply_gradients with nothing changed (one host
  // synchronisation per step on a GPU). Device: the updates skip on the device, and the host
  // reads the flag behind the step without waiting for it; the next apply_gradients (which
  // then applies nothing either) or check_pending throws that NumericError, naming the step,
  // which changed no variable and is not counted (until then iterations() counts it; state()
  // and a copy read the check first). Auto (the default): Device when the gradients and
  // variables are on one GPU, Host otherwise. Optimizers whose updates do not honour a skip
  // flag (supports_device_skip) decide on the host. Set on a wrapper without state of its own
  // (a DistributedOptimizer, a GradientAccumulationOptimizer), it reaches the one it wraps.
  void set_finite_check(StepDecision decision);
  // Reads the finiteness flags not read yet (a Device decision's, a captured step's replays'),
  // waiting for the device, and throws NumericError for the first that was set; a wrapper
  // reads its own and the wrapped optimizer's. A trainer calls it after its last step.
  virtual void check_pending();

  // "SGD", "RMSprop", "Adam", "AdamW", "LossScaleOptimizer".
  virtual std::string name() const = 0;
  // The options that make this optimizer again with optim::from_config(name(), ...):
  // "learning_rate", the clipping that is set ("clipnorm", "global_clipnorm" or "clipvalue")
  // and the optimizer's own options (flags as 0 or 1). Throws ValueError for a learning rate
  // schedule (it has no number) and for optimizers that do not say (a LossScaleOptimizer:
  // its wrapped optimizer's config and loss_scale_config() describe it).
  virtual std::map<std::string, double> get_config() const;
  // A copy with its own state (slots are copied, not shared).
  virtual std::shared_ptr<Optimizer> clone() const = 0;

  // The slots of `var` (empty before its first step).
  std::vector<Variable> slots(const Variable& var) const;
  // The state for `variables` (their slots, by the variables' names). Once iterations > 0
  // every variable has its slots in it: one not stepped yet (no gradient so far) gets the
  // zeros its first step would start from.
  virtual OptimizerState state(const std::vector<Variable>& variables) const;
  // Restores a state saved for variables of the same names, shapes and slot dtypes. Checks
  // everything before it changes anything, and throws ValueError naming the first problem:
  // iterations < 0, a scalar it does not keep, a slot that is missing (a variable without
  // any of its slots is accepted only when iterations is 0; its slots then restart), of
  // another shape or dtype, or a tensor that is no slot of these variables.
  virtual void load_state(const OptimizerState& state, const std::vector<Variable>& variables);

 protected:
  Optimizer(LearningRate lr, Clipping clipping);
  Optimizer(const Optimizer& other);
  Optimizer& operator=(const Optimizer&) = delete;

  // A backward pass: the gradients of a target (undefined ones for an undefined target).
  using Backward = std::function<std::vector<Tensor>(GradientTape&, const Tensor&,
                                                     const std::vector<Variable>&)>;
  // compute_gradients with `backward` as the backward pass: `backward(tape, loss, vars)` here.
  // A wrapper transforms the loss on the way in and the gradients on the way out around its
  // wrapped optimizer's chain_gradients, and may give it another backward pass.
  virtual std::vector<Tensor> chain_gradients(GradientTape& tape, const Tensor& loss,
                                              const std::vector<Variable>& variables,
                                              const Backward& backward);

  // The names of the slots a variable needs ("m", "v", ...), in order.
  virtual std::vector<std::string> slot_names() const = 0;
  // Updates `var` in place from `grad` (var's shape and dtype, contiguous, clipped).
  virtual void update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
                      double lr, std::int64_t step) = 0;
  // Whether update() hands skip_flag() to its kernels (kernels::OptimizerUpdate::skip_if),
  // so that a LossScaleOptimizer around it may decide a step on the device (SGD, RMSprop and
  // Adam do; an optimizer of one's own says so once its update honours the flag).
  virtual bool supports_device_skip() const { return false; }
  // During a step decided on the device: the flag (a float32 scalar on the variables'
  // device) whose non-zero value makes the update change nothing; undefined otherwise.
  const Tensor& skip_flag() const { return skip_if_; }
  // Whether update() hands gradient_scale() to its kernels (kernels::OptimizerUpdate::
  // grad_scale): global_clipnorm's factor is then applied in the update's own pass instead of a
  // pass of its own over the gradients (SGD, RMSprop and Adam do; update() is otherwise given
  // the clipped gradients).
  virtual bool fuses_gradient_scale() const { return false; }
  // During a step of such an optimizer with global_clipnorm: the factor (a float64 scalar on
  // the variables' device) its update reads each gradient times; undefined otherwise.
  const Tensor& gradient_scale() const { return grad_scale_; }

  // For the wrappers (LossScaleOptimizer, DistributedOptimizer,
  // GradientAccumulationOptimizer): wrap() in their constructors registers them around
  // `inner`, unwrap() in their destructors releases it, and a WrapperCall marks a step they
  // make of it. A step of a wrapped optimizer that no wrapper makes (the optimizer used on
  // its own while a wrapper holds it: given to one model inside a wrapper, to another as it
  // is) throws ValueError: it would bypass the loss scale, the finiteness check (a
  // LossScaleOptimizer turns the wrapped one's off) and the reduction across ranks.
  static void wrap(Optimizer& inner, const Optimizer& wrapper);
  static void unwrap(Optimizer& inner) { --inner.wrappers_; }
  class WrapperCall {
   public:
    explicit WrapperCall(Optimizer& inner) : inner_(inner) { ++inner_.calls_from_wrapper_; }
    ~WrapperCall() { --inner_.calls_from_wrapper_; }
    WrapperCall(const WrapperCall&) = delete;
    WrapperCall& operator=(const WrapperCall&) = delete;

   private:
    Optimizer& inner_;
  };
  // The ValueError above, at the start of every step.
  void check_not_bypassed() const;

 private:
  friend class LossScaleOptimizer;
  friend class DistributedOptimizer;
  friend class GradientAccumulationOptimizer;
  // A captured step whose replays' flags a wrapper reads late (a LossScaleOptimizer's): each
  // replay is counted on the host when it is queued and taken back (uncount_step) when its
  // flag is read set, so that up to `max_unread` replays counted may have been skipped. How
  // many, the device knows: `skipped` (an int64 [1] tensor there, the replays skipped so far,
  // kept by the wrapper) less `skipped_read()` (those of them the host has read). The replay's
  // count, and so its learning rate and Adam's bias correction, is settled there
  // (capture_updates).
  struct LateCount {
    Tensor skipped;
    std::function<std::int64_t()> skipped_read;
    int max_unread = 0;
  };
  // apply_gradients with update() given skip_flag() = skip_if (undefined: an ordinary step).
  // The step is counted; the caller takes the count back (uncount_step) when it later reads
  // a set flag. `late`: under a captured step, its replays' flags read late (above).
  void step(const std::vector<Tensor>& grads, const std::vector<Variable>& variables,
            const Tensor& skip_if, const LateCount* late = nullptr);
  void uncount_step() { --iterations_; }
  // Under a captured step (mixtape/core/capture.h): the finiteness check on the device, its
  // flag for the updates (returned), a non-finite replay reported by the next one. `squares`:
  // the gradients' sum of squares when global_clipnorm made it (optim_util's nonfinite_flags).
  Tensor capture_finiteness_check(const std::vector<Tensor>& grads, const Tensor& skip_if,
                                  const Tensor& squares);
  // Under a captured step: the updates read lr and alpha from a device tensor that the host
  // writes before each replay (with `late`, the row of a table of the counts still possible
  // that the replay picks: late_rates), each replay counts a step, and the 16-bit copies the
  // updates write stay the ones autocast reads.
  void capture_updates(std::vector<kernels::OptimizerUpdate>& updates, const LateCount* late);
  Tensor late_rates(const LateCount& late, double beta1, double beta2, Device device);
  // Whether this step's finiteness check is decided on the device (set_finite_check).
  bool finite_check_on_device(const std::vector<Tensor>& grads,
                              const std::vector<Variable>& variables) const;
  // The flags read back behind their steps: read_pending(true) reads them all (waiting),
  // read_pending(false) those already back; either throws NumericError for the first set.
  struct PendingChecks;
  void read_pending(bool wait) const;

  std::vector<Tensor> prepare(const std::vector<Tensor>& grads,
                              const std::vector<Variable>& variables);
  const std::vector<Variable>& slots_for(const Variable& var);

  LearningRate learning_rate_;
  Clipping clipping_;
  mutable std::int64_t iterations_ = 0;  // (read_pending takes back a skipped step)
  bool check_finite_ = true;
  StepDecision finite_check_ = StepDecision::Auto;
  std::shared_ptr<PendingChecks> pending_;  // never null
  Tensor skip_if_;
  Tensor grad_scale_;
  int wrappers_ = 0;            // wrappers alive around this one (wrap, unwrap)
  std::string wrapper_name_;    // the last one's name()
  int calls_from_wrapper_ = 0;  // steps a wrapper is making now (WrapperCall)
  std::unordered_map<std::uint64_t, std::vector<Variable>> slots_;
  std::unordered_map<std::uint64_t, bool> warned_missing_;
};

// --- The optimizers --------------------------------------------------------------------------

struct SGDOptions {
  LearningRate learning_rate = 0.01;
  double momentum = 0.0;
  bool nesterov = false;
  Clipping clipping = {};
};

// v = momentum * v - lr * g; var += v (or var += momentum * v - lr * g with nesterov);
// plain var -= lr * g without momentum.
class SGD : public Optimizer {
 public:
  explicit SGD(SGDOptions options = {});
  std::string name() const override { return "SGD"; }
  std::shared_ptr<Optimizer> clone() const override { return std::make_shared<SGD>(*this); }
  std::map<std::string, double> get_config() const override;
  SGD(const SGD&) = default;

 protected:
  std::vector<std::string> slot_names() const override;
  void update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
              double lr, std::int64_t step) override;
  bool supports_device_skip() const override { return true; }
  bool fuses_gradient_scale() const override { return true; }

 private:
  SGDOptions options_;
};

struct RMSpropOptions {
  LearningRate learning_rate = 1e-3;
  double rho = 0.9;
  double momentum = 0.0;
  double epsilon = 1e-7;
  bool centered = false;
  Clipping clipping = {};
};

// ms = rho ms + (1 - rho) g^2; var -= lr g / sqrt(ms + epsilon) (centered: ms - mg^2;
// momentum: through a momentum buffer). Keras' defaults.
class RMSprop : public Optimizer {
 public:
  explicit RMSprop(RMSpropOptions options = {});
  std::string name() const override { return "RMSprop"; }
  std::shared_ptr<Optimizer> clone() const override { return std::make_shared<RMSprop>(*this); }
  std::map<std::string, double> get_config() const override;
  RMSprop(const RMSprop&) = default;

 protected:
  std::vector<std::string> slot_names() const override;
  void update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
              double lr, std::int64_t step) override;
  bool supports_device_skip() const override { return true; }
  bool fuses_gradient_scale() const override { return true; }

 private:
  RMSpropOptions options_;
};

struct AdamOptions {
  LearningRate learning_rate = 1e-3;
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  double epsilon = 1e-7;
  bool amsgrad = false;
  Clipping clipping = {};
};

// Keras' Adam: m, v moving averages; var -= lr sqrt(1 - b2^t) / (1 - b1^t) m / (sqrt(v) +
// epsilon).
class Adam : public Optimizer {
 public:
  explicit Adam(AdamOptions options = {});
  std::string name() const override { return "Adam"; }
  std::shared_ptr<Optimizer> clone() const override { return std::make_shared<Adam>(*this); }
  std::map<std::string, double> get_config() const override;
  Adam(const Adam&) = default;

 protected:
  std::vector<std::string> slot_names() const override;
  void update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
              double lr, std::int64_t step) override;
  bool supports_device_skip() const override { return true; }
  bool fuses_gradient_scale() const override { return true; }
  Adam(AdamOptions options, double weight_decay);

 private:
  AdamOptions options_;
  double weight_decay_ = 0.0;
};

struct AdamWOptions {
  LearningRate learning_rate = 1e-3;
  double weight_decay = 0.004;
  double beta_1 = 0.9;
  double beta_2 = 0.999;
  double epsilon = 1e-7;
  bool amsgrad = false;
  Clipping clipping = {};
};

// Adam with decoupled weight decay: var -= lr * weight_decay * var before the Adam step.
class AdamW : public Adam {
 public:
  explicit AdamW(AdamWOptions options = {});
  std::string name() const override { return "AdamW"; }
  std::shared_ptr<Optimizer> clone() const override { return std::make_shared<AdamW>(*this); }
  AdamW(const AdamW&) = default;
};

// An optimizer by name ("sgd", "rmsprop", "adam", "adamw") with its defaults; throws
// ValueError listing the names otherwise.
std::shared_ptr<Optimizer> get(std::string_view name);
// The optimizer of class `name` ("SGD", "RMSprop", "Adam", "AdamW") with the options of
// `config` (Optimizer::get_config; others keep their defaults); ValueError for another class
// or a key the class does not take.
std::shared_ptr<Optimizer> from_config(const std::string& name,
                                       const std::map<std::string, double>& config);

}  // namespace mixtape::optim
