// GradientAccumulationOptimizer (mixtape/optim/gradient_accumulation.h).
#include "mixtape/optim/gradient_accumulation.h"

#include <fmt/format.h>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/capture.h"

namespace mixtape::optim {

GradientAccumulationOptimizer::GradientAccumulationOptimizer(std::shared_ptr<Optimizer> inner,
                                                             std::int64_t steps)
    : Optimizer(0.0, Clipping{}), inner_(std::move(inner)), steps_(steps) {
  if (!inner_) throw ValueError("GradientAccumulationOptimizer: the wrapped optimizer is empty");
  if (steps_ < 1)
    throw ValueError(fmt::format(
        "GradientAccumulationOptimizer: gradient_accumulation_steps must be >= 1; got {}", steps_));
  wrap(*inner_, *this);
}

GradientAccumulationOptimizer::~GradientAccumulationOptimizer() {
  if (inner_) unwrap(*inner_);
}

GradientAccumulationOptimizer::GradientAccumulationOptimizer(
    const GradientAccumulationOptimizer& other)
    : Optimizer(other),
      inner_(other.inner_->clone()),
      steps_(other.steps_),
      count_(other.count_),
      sums_(other.sums_),  // never changed in place: sharing them is a copy
      variables_(other.variables_) {
  wrap(*inner_, *this);
}

void GradientAccumulationOptimizer::apply_gradients(const std::vector<Tensor>& grads,
                                                    const std::vector<Variable>& variables) {
  capture::forbid("GradientAccumulationOptimizer: its count of micro-batches is kept on the host");
  if (grads.size() != variables.size())
    throw ValueError(
        fmt::format("GradientAccumulationOptimizer::apply_gradients: {} gradients for {} variables",
                    grads.size(), variables.size()));
  check_not_bypassed();
  std::vector<std::uint64_t> ids;
  for (const Variable& v : variables) ids.push_back(v.id());
  if (count_ > 0 && ids != variables_)
    throw ValueError(fmt::format(
        "GradientAccumulationOptimizer::apply_gradients: micro-batch {} of {} gives other "
        "variables than the first of this step ({} against {}); every micro-batch of a step "
        "must update the same variables, in the same order",
        count_ + 1, steps_, variables.size(), variables_.size()));
  NoGradGuard no_grad;
  if (count_ == 0) {
    variables_ = std::move(ids);
    sums_.assign(grads.size(), Tensor());
  }
  for (std::size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) continue;
    sums_[i] = sums_[i].defined() ? sums_[i] + grads[i] : grads[i];
  }
  if (++count_ < steps_) return;
  // The mean of the micro-batches' gradients: the gradient of the mean loss over all their
  // samples (micro-batches of one size).
  std::vector<Tensor> mean(sums_.size());
  for (std::size_t i = 0; i < sums_.size(); ++i)
    if (sums_[i].defined())
      mean[i] = steps_ == 1 ? sums_[i] : sums_[i] / static_cast<double>(steps_);
  count_ = 0;
  sums_.clear();
  variables_.clear();
  const WrapperCall call(*inner_);
  inner_->apply_gradients(mean, variables);
}

void GradientAccumulationOptimizer::load_state(const OptimizerState& state,
                                               const std::vector<Variable>& variables) {
  inner_->load_state(state, variables);
  count_ = 0;  // a restored state starts a step afresh
  sums_.clear();
  variables_.clear();
}

}  // namespace mixtape::optim
