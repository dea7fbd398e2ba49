// Data-parallel training with a custom loop: the loop of one process plus one line (the
// DistributedOptimizer around the LossScaleOptimizer), each rank on its share of every
// global batch; the step is compute_gradients and apply_gradients, as on one process. Runs as it is
// (world size 1) or under `mpirun -np 2`; checks that the loss fell and that every rank ends with
// the same weights.
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

  mt::optim::LossScaleOptimizer scaled(mt::optim::Adam({.learning_rate = 3e-3}));
  mt::optim::DistributedOptimizer optimizer(scaled);  // the one line more
  auto loss_object = mt::losses::MeanSquaredError();
  const std::int64_t batch = 128;  // the global batch
  double first = 0, last = 0;
  for (int epoch = 0; epoch < 20; ++epoch) {
    double epoch_loss = 0;
    for (std::int64_t b0 = 0; b0 < x.dim(0); b0 += batch) {
      const auto [r0, r1] = md::shard(batch);  // this rank's rows of the batch
      const auto vars = model.trainable_variables();
      mt::GradientTape tape;
      auto predictions = model(x.slice(0, b0 + r0, b0 + r1), {.training = true});
      auto loss = loss_object(y.slice(0, b0 + r0, b0 + r1), predictions);
      // Scaled, each bucket averaged over the ranks as the backward pass has it, unscaled.
      optimizer.apply_gradients(optimizer.compute_gradients(tape, loss, vars), vars);
      epoch_loss += md::all_reduce_value(loss.item<double>(), md::ReduceOp::Average);
    }
    (epoch == 0 ? first : last) = epoch_loss / static_cast<double>(x.dim(0) / batch);
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
               md::world_size(), first, last, optimizer.loss_scale_optimizer()->loss_scale(), same);
  return last < 0.5 * first && same ? 0 : 1;
}
