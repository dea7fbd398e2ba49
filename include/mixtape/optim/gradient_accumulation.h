// GradientAccumulationOptimizer: one optimizer step from the gradients of several
// micro-batches (a batch too large for memory, taken in parts), wrapped around any optimizer
// chain. compile({.gradient_accumulation_steps = N}) puts it around the model's optimizer;
// a custom loop uses it as any optimizer:
//
//   mt::optim::GradientAccumulationOptimizer opt(mt::optim::LossScaleOptimizer(mt::optim::Adam()),
//   4); for (each micro-batch) {
//     mt::GradientTape tape;
//     const mt::Tensor loss = loss_object(y, model(x, {.training = true}));
//     opt.apply_gradients(opt.compute_gradients(tape, loss, vars), vars);  // steps every 4th
//   }
//
// compute_gradients goes through the wrapped chain (a LossScaleOptimizer unscales each
// micro-batch's gradients; a DistributedOptimizer sums them across ranks). apply_gradients
// adds them up and, on every N-th call, hands their mean to the wrapped optimizer, which
// then checks them for overflow once (a LossScaleOptimizer skips the whole step when any
// micro-batch overflowed: an infinity stays one in the sum), clips once and steps once.
// With micro-batches of one size the step is the step of one batch of all their samples
// (a mean loss over the batch), to float32 rounding.
//
// The wrapped optimizer's step count (iterations(), and so its learning-rate schedule)
// counts steps, not micro-batches; a skipped step is not counted, as without accumulation.
// Micro-batches added since the last step are not part of a checkpoint (state() is the
// wrapped optimizer's): save between steps (pending() == 0). A micro-batch left over at the
// end of an epoch of fit goes into the next epoch's first step.
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <vector>

#include "mixtape/optim/optimizer.h"

namespace mixtape::optim {

class GradientAccumulationOptimizer : public Optimizer {
 public:
  // Throws ValueError for steps < 1 and an empty optimizer.
  GradientAccumulationOptimizer(std::shared_ptr<Optimizer> inner, std::int64_t steps);
  template <typename O>
  requires(std::derived_from<O, Optimizer> && !std::same_as<O, GradientAccumulationOptimizer>)
      GradientAccumulationOptimizer(const O& inner, std::int64_t steps)
      : GradientAccumulationOptimizer(inner.clone(), steps) {}
  GradientAccumulationOptimizer(const GradientAccumulationOptimizer& other);
  ~GradientAccumulationOptimizer() override;

  // Adds the gradients of one micro-batch (undefined ones add nothing); on the steps()-th,
  // the wrapped optimizer steps with their mean. The variables must be the same, in the same
  // order, in every micro-batch of a step (ValueError otherwise, changing nothing).
  void apply_gradients(const std::vector<Tensor>& grads,
                       const std::vector<Variable>& variables) override;

  // Micro-batches per step, and those added since the last step.
  std::int64_t steps() const { return steps_; }
  std::int64_t pending() const { return count_; }

  Optimizer& inner_optimizer() { return *inner_; }
  const Optimizer& inner_optimizer() const { return *inner_; }
  std::int64_t iterations() const override { return inner_->iterations(); }
  double current_learning_rate() const override { return inner_->current_learning_rate(); }
  std::string name() const override { return "GradientAccumulationOptimizer"; }
  std::shared_ptr<Optimizer> clone() const override {
    return std::make_shared<GradientAccumulationOptimizer>(*this);
  }
  Tensor scale_loss(const Tensor& loss) const override { return inner_->scale_loss(loss); }
  LossScaleOptimizer* loss_scale_optimizer() const override {
    return inner_->loss_scale_optimizer();
  }
  DistributedOptimizer* distributed_optimizer() const override {
    return inner_->distributed_optimizer();
  }
  Optimizer* pass_through() const override { return inner_.get(); }
  OptimizerState state(const std::vector<Variable>& variables) const override {
    return inner_->state(variables);
  }
  void load_state(const OptimizerState& state, const std::vector<Variable>& variables) override;

 protected:
  std::vector<std::string> slot_names() const override { return {}; }
  void update(const Variable&, const Tensor&, const std::vector<Variable>&, double,
              std::int64_t) override {}
  std::vector<Tensor> chain_gradients(GradientTape& tape, const Tensor& loss,
                                      const std::vector<Variable>& variables,
                                      const Backward& backward) override {
    return inner_->chain_gradients(tape, loss, variables, backward);
  }

 private:
  std::shared_ptr<Optimizer> inner_;
  std::int64_t steps_;
  std::int64_t count_ = 0;
  std::vector<Tensor> sums_;              // per variable; undefined: no gradient yet
  std::vector<std::uint64_t> variables_;  // the ids of the variables being accumulated
};

}  // namespace mixtape::optim
