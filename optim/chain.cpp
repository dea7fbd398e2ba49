// training_chain: the wrappers a training step needs, in the one order that works (the
// header says why each goes where it goes).
#include "mixtape/optim/chain.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <optional>

#include "mixtape/core/error.h"
#include "mixtape/distributed/distributed.h"
#include "mixtape/optim/distributed_optimizer.h"
#include "mixtape/optim/gradient_accumulation.h"
#include "mixtape/optim/loss_scale_optimizer.h"
#include "mixtape/precision/policy.h"

namespace mixtape::optim {

std::shared_ptr<Optimizer> training_chain(std::shared_ptr<Optimizer> opt,
                                          const TrainingChainOptions& options) {
  const std::string who = options.owner.empty() ? "training_chain" : options.owner;
  if (!opt) throw ValueError(fmt::format("{}: the optimizer is empty", who));
  if (options.gradient_accumulation_steps < 1)
    throw ValueError(fmt::format("{}: gradient_accumulation_steps must be >= 1; got {}", who,
                                 options.gradient_accumulation_steps));
  std::optional<DistributedOptimizerOptions> distributed_options;
  if (DistributedOptimizer* d = opt->distributed_optimizer(); d == opt.get()) {
    distributed_options = d->options();
    opt = d->inner_optimizer().clone();
  } else if (distributed::world_size() > 1) {
    distributed_options = DistributedOptimizerOptions{};
  }
  const bool root = distributed::rank() == 0;  // every rank wraps; one says so
  const Policy policy = options.policy ? *options.policy : global_policy();
  if (const auto& scale = policy.loss_scale(); scale && !opt->loss_scale_optimizer()) {
    opt = std::make_shared<LossScaleOptimizer>(opt, *scale);
    if (root)
      spdlog::info(
          "{}: policy {} has a loss scale; the optimizer is wrapped in a "
          "LossScaleOptimizer ({})",
          who, policy.name(), scale->str());
  }
  if (distributed_options) {
    opt = std::make_shared<DistributedOptimizer>(opt, *distributed_options);
    if (distributed::world_size() > 1 && root)
      spdlog::info("{}: {} ranks; gradients averaged across them (DistributedOptimizer)", who,
                   distributed::world_size());
  }
  if (options.gradient_accumulation_steps > 1)
    opt = std::make_shared<GradientAccumulationOptimizer>(opt, options.gradient_accumulation_steps);
  return opt;
}

}  // namespace mixtape::optim
