// The optimizer chain of a training step: an optimizer wrapped in what the dtype policy and
// the job need. Model::compile builds it; a custom loop may build the same:
//
//   auto opt = mt::optim::training_chain(std::make_shared<mt::optim::Adam>());
//   ... tape, forward, loss, opt->apply_gradients(opt->compute_gradients(tape, loss, vars), vars)
//
// From the inside out:
//   - a LossScaleOptimizer when the policy has a loss scale (mixed_float16) and the chain
//     holds none (one given is kept, with its own scale);
//   - a DistributedOptimizer outside it when the job has several processes, or when one was
//     given (its options kept; it moves outside), so that gradients are averaged across the
//     ranks before the loss scale optimizer checks them;
//   - a GradientAccumulationOptimizer outermost when gradient_accumulation_steps > 1, so that
//     it sees every micro-batch.
// The caller never needs to know which of them the chain holds: Optimizer::compute_gradients
// and apply_gradients go through all of it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "mixtape/optim/optimizer.h"
#include "mixtape/precision/policy.h"

namespace mixtape::optim {

struct TrainingChainOptions {
  // The policy whose loss scale applies (compile: the model's); default the global policy.
  std::optional<Policy> policy = std::nullopt;
  std::int64_t gradient_accumulation_steps = 1;  // >= 1 (ValueError otherwise)
  // Who asks, for the one log line (on rank 0) that says what was wrapped: "model 'mlp'".
  std::string owner = {};
};

// The chain for `optimizer` under the policy and the job (see above). The optimizer
// given is not changed (a DistributedOptimizer given is replaced by a copy of what it wraps).
// ValueError for an empty optimizer or accumulation steps < 1, naming the value.
std::shared_ptr<Optimizer> training_chain(std::shared_ptr<Optimizer> optimizer,
                                          const TrainingChainOptions& options = {});

}  // namespace mixtape::optim
