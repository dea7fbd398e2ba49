// Data-parallel training with a custom loop: the loop of one process, unchanged. The
// optimizer chain (training_chain: a LossScaleOptimizer under mixed_float16, a
// DistributedOptimizer around it on several ranks) does the job's part of the step, and the
// Dataset gives each rank its share of every global batch (shard). Runs as it is (world size
// 1) or under `mpirun -np 2`; checks that the loss fell and that every rank ends with the
// same weights.
#include <fmt/format.h>
#include <mixtape/mixtape.h>

namespace mt = mixtape;
namespace md = mixtape::distributed;

int main() {
  md::init();
  mt::set_global_policy("mixed_float16");
  mt::manual_seed(1);  // the same data and initial weights on every rank

  auto inputs = mt::layers::Input({16});
  auto h = mt::layers::Dense(64, {.activation = "relu"})(inputs);
  auto outputs = mt::layers::Dense(1, {.dtype = "float32"})(h);
  mt::Model model(inputs, outputs);
  const mt::Tensor x = mt::normal({1024, 16});
  const mt::Tensor y = mt::sum(x * x, {1}, /*keepdims=*/true) / 16.0;

  auto optimizer = mt::optim::training_chain(
      std::make_shared<mt::optim::Adam>(mt::optim::AdamOptions{.learning_rate = 3e-3}));
  auto loss_object = mt::losses::MeanSquaredError();
  // Global batches of 128, this rank's rows of each.
  const auto batches =
      mt::data::Dataset::from_tensors(x, y).batch(128).shard(md::rank(), md::world_size());
  const auto vars = model.trainable_variables();
  double first = 0, last = 0;
  for (int epoch = 0; epoch < 20; ++epoch) {
    double epoch_loss = 0;
    for (const auto& batch : batches) {
      const auto& [xb, yb] = batch;
      mt::GradientTape tape;
      auto loss = loss_object(yb, model(xb, {.training = true}));
      // Scaled, each bucket averaged over the ranks as the backward pass has it, unscaled.
      optimizer->apply_gradients(optimizer->compute_gradients(tape, loss, vars), vars);
      epoch_loss += md::all_reduce_value(loss.item<double>() * batch.share());
    }
    (epoch == 0 ? first : last) = epoch_loss / static_cast<double>(batches.size());
  }
  // Every rank holds the same weights: their sums agree to the bit.
  bool same = true;
  for (const auto& w : model.trainable_variables()) {
    const double s = mt::sum(w).item<double>();
    same = same &&
           md::all_reduce_value(s, md::ReduceOp::Max) == md::all_reduce_value(s, md::ReduceOp::Min);
  }
  if (md::is_root())
    fmt::print("{} rank(s): loss {:.4f} -> {:.4f}, loss scale {}, same weights: {}\n",
               md::world_size(), first, last, optimizer->loss_scale_optimizer()->loss_scale(),
               same);
  return last < 0.5 * first && same ? 0 : 1;
}
