// DistributedOptimizer: data-parallel training. Wraps any optimizer (a LossScaleOptimizer
// too) and averages the gradients across the ranks of the job (mixtape/distributed/
// distributed.h) before the wrapped optimizer steps, so that every rank applies the same
// update to the same weights.
//
//   mt::distributed::init();
//   mt::optim::DistributedOptimizer opt(mt::optim::Adam());   // the one line more
//   ... the training loop as on one process ...
//   opt.apply_gradients(grads, model.trainable_variables());   // averaged, then Adam
//
// Gradients travel in buckets of about bucket_bytes (float32 on the gradients' device;
// float16 and bfloat16 gradients widened, float64 ones in float64 buckets), the last
// variables' first. gradient() reduces each bucket as soon as the tape has finished its
// gradients, while the backward pass has the rest to compute (Model::fit uses it): on a GPU
// the NCCL call is queued behind the kernels that made the bucket, on the CPU the sum runs
// then (MPI's blocking all-reduce: see distributed::sum_host_buffer).
//
// With a LossScaleOptimizer inside, the scaled gradients are averaged before they are
// unscaled and checked, so an overflow on one rank is an overflow on every rank: all skip
// the step and change the scale the same way (the scales never diverge).
//
// The average is a weighted sum: each rank's gradient times its weight, 1 / world_size()
// by default. set_gradient_weight changes this rank's weight for the next reduction (fit
// gives each rank its share of the global batch, so a last batch split unevenly still
// averages exactly as one process would).
#pragma once

#include <concepts>
#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "mixtape/autograd/tape.h"
#include "mixtape/optim/loss_scale_optimizer.h"
#include "mixtape/optim/optimizer.h"

namespace mixtape::optim {

struct DistributedOptimizerOptions {
  // The bytes of reduced values per bucket; 0: 4 MiB for CPU gradients (MPI's all-reduce
  // ran at 8.4-8.7 GB/s on 1-4 MiB here and at 1.8-3.6 GB/s on 16-64 MiB,
  // docs/distributed.md) and 25 MiB for GPU ones (Horovod's and PyTorch DDP's default).
  std::size_t bucket_bytes = 0;
};

class DistributedOptimizer : public Optimizer {
 public:
  explicit DistributedOptimizer(std::shared_ptr<Optimizer> inner,
                                DistributedOptimizerOptions options = {});
  // Wraps a copy of an optimizer given by value: DistributedOptimizer(Adam()).
  template <typename O>
  requires(std::derived_from<O, Optimizer> &&
           !std::same_as<
               O, DistributedOptimizer>) explicit DistributedOptimizer(const O& inner,
                                                                       DistributedOptimizerOptions
                                                                           options = {})
      : DistributedOptimizer(inner.clone(), options) {}
  DistributedOptimizer(const DistributedOptimizer& other);
  ~DistributedOptimizer() override;

  // Averages the gradients across ranks (unless they come from gradient() or
  // get_unscaled_gradients, which averaged them already), then the wrapped optimizer steps.
  void apply_gradients(const std::vector<Tensor>& grads,
                       const std::vector<Variable>& variables) override;
  // The weighted sum across ranks of each gradient (what apply_gradients then takes as it
  // is). With the variables, a gradient may be undefined (it adds nothing; it stays
  // undefined where no rank has one); without them every gradient must be defined.
  std::vector<Tensor> all_reduce_gradients(const std::vector<Tensor>& grads,
                                           const std::vector<Variable>& variables = {});
  // tape.gradient(target, variables), averaged across ranks, each bucket's sum started as
  // soon as the tape has its gradients.
  std::vector<Tensor> gradient(GradientTape& tape, const Tensor& target,
                               const std::vector<Variable>& variables);

  // A wrapped LossScaleOptimizer's (ValueError when there is none): get_unscaled_gradients
  // averages first (when not done yet), then unscales and checks.
  Tensor get_scaled_loss(const Tensor& loss) const;
  std::vector<Tensor> get_unscaled_gradients(const std::vector<Tensor>& grads);
  // The wrapped LossScaleOptimizer (at any depth), or nullptr; this one.
  LossScaleOptimizer* loss_scale_optimizer() const override {
    return inner_->loss_scale_optimizer();
  }
  DistributedOptimizer* distributed_optimizer() const override {
    return const_cast<DistributedOptimizer*>(this);
  }
  Tensor scale_loss(const Tensor& loss) const override { return inner_->scale_loss(loss); }
  Optimizer* pass_through() const override { return inner_.get(); }

  // This rank's weight in the next reduction (default 1 / world_size()); reset after it.
  void set_gradient_weight(double weight);
  // Makes the ranks agree before training: every rank must hold the same `description` (what
  // must agree: the model's layout, the policy, the optimizer and its options, ...), or every
  // rank throws DistributedError naming `who` and the first rank that differs from rank 0;
  // then rank 0's `variables` and `seed` (when given) go to every rank: rank 0's initial
  // weights and seed win. Called by compile() and fit(); a custom loop may call it once.
  static void synchronize(const std::string& who, const std::string& description,
                          const std::vector<Variable>& variables, std::uint64_t* seed = nullptr);

  Optimizer& inner_optimizer() { return *inner_; }
  const Optimizer& inner_optimizer() const { return *inner_; }
  const DistributedOptimizerOptions& options() const { return options_; }
  // Buckets in the latest reduction, and their sizes in bytes.
  const std::vector<std::size_t>& last_bucket_bytes() const { return last_buckets_; }
  // Which gradient goes to which bucket (defined in the source file).
  struct Plan;

  std::int64_t iterations() const override { return inner_->iterations(); }
  double current_learning_rate() const override { return inner_->current_learning_rate(); }
  std::string name() const override { return "DistributedOptimizer"; }
  std::shared_ptr<Optimizer> clone() const override {
    return std::make_shared<DistributedOptimizer>(*this);
  }
  // The wrapped optimizer's state (the same on every rank).
  OptimizerState state(const std::vector<Variable>& variables) const override {
    return inner_->state(variables);
  }
  void load_state(const OptimizerState& state, const std::vector<Variable>& variables) override {
    inner_->load_state(state, variables);
  }

 protected:
  std::vector<std::string> slot_names() const override { return {}; }
  void update(const Variable&, const Tensor&, const std::vector<Variable>&, double,
              std::int64_t) override {}
  // The wrapped optimizer's chain with gradient() as its backward pass (each bucket summed
  // across processes as soon as it is done; an undefined target: undefined gradients, still
  // reduced); apply_gradients then takes what it returns as it is.
  std::vector<Tensor> chain_gradients(GradientTape& tape, const Tensor& loss,
                                      const std::vector<Variable>& variables,
                                      const Backward& backward) override;

 private:
  Plan plan(const std::vector<Tensor>& like) const;
  // The weighted sum across ranks, in buckets planned from `like` (shapes and dtypes).
  std::vector<Tensor> reduce(const std::vector<Tensor>& grads, const std::vector<Tensor>& like,
                             double weight);
  double take_weight();
  std::shared_ptr<Optimizer> inner_;
  DistributedOptimizerOptions options_;
  double weight_ = -1.0;  // < 0: 1 / world_size()
  std::vector<std::size_t> last_buckets_;
  // The gradients gradient() / get_unscaled_gradients returned, averaged already.
  std::unordered_set<std::uint64_t> reduced_ids_;
  // compute_gradients reduced the gradients of the step to come: the next apply_gradients
  // takes them as they are, also after an outer wrapper made new tensors of them (a
  // LossScaleOptimizer around this one unscales them).
  bool chain_reduced_ = false;
};

// Logs (name -> value, such as Model::fit's) averaged over the ranks, each rank's values
// weighted by the rows they come from (a rank without rows adds nothing): the numbers one
// process would log over all rows. Every rank calls it at the same point, with the same
// keys; one process gets its logs as they are.
std::map<std::string, double> average_over_ranks(const std::map<std::string, double>& logs,
                                                 std::int64_t rows);

}  // namespace mixtape::optim
