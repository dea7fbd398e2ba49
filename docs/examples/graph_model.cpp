// A model as a graph: two inputs, one encoder shared by both, a residual block joined by
// Add, and two outputs (a class and a number), trained with a GradientTape loop on the sum
// of the two losses.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <vector>

namespace mt = mixtape;
namespace ml = mt::layers;

int main() {
  mt::manual_seed(5);
  // Two vectors a and b; "which": is sum(a) > sum(b)? "total": sum(a) + sum(b).
  const std::int64_t n = 1024;
  const mt::Tensor a = mt::normal({n, 8}), b = mt::normal({n, 8});
  const mt::Tensor sa = mt::sum(a, {1}, true), sb = mt::sum(b, {1}, true);
  const mt::Tensor which = mt::cast(mt::greater(sa, sb).reshape({n}), mt::kInt64);
  const mt::Tensor total = sa + sb;

  auto in_a = ml::Input({8}, {.name = "a"});
  auto in_b = ml::Input({8}, {.name = "b"});
  auto encoder = ml::Dense(32, {.activation = "relu", .name = "encoder"});  // shared
  auto joined = ml::Concatenate({.name = "joined"})({encoder(in_a), encoder(in_b)});
  // A residual block: joined + Dense(Dense(joined)).
  auto h = ml::Dense(64, {.activation = "relu", .name = "block_in"})(joined);
  h = ml::Dense(64, {.name = "block_out"})(h);
  auto features = ml::Add({.name = "residual"})({joined, h});
  auto which_logits = ml::Dense(2, {.name = "which"})(features);
  auto total_out = ml::Dense(1, {.name = "total"})(ml::Concatenate()({features, in_a, in_b}));
  mt::Model model({in_a, in_b}, {which_logits, total_out}, {.name = "two_heads"});
  model.summary();  // with the "Connected to" column

  auto classify = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  auto regress = mt::losses::MeanSquaredError();
  mt::optim::Adam optimizer({.learning_rate = 3e-3});
  for (int step = 0; step < 300; ++step) {
    const std::int64_t start = (step * 64) % n;
    const std::vector<mt::Tensor> batch = {a.slice(0, start, start + 64),
                                           b.slice(0, start, start + 64)};
    mt::GradientTape tape;
    const std::vector<mt::Tensor> out = model(batch, {.training = true});  // two outputs
    const mt::Tensor loss = classify(which.slice(0, start, start + 64), out[0]) +
                            regress(total.slice(0, start, start + 64), out[1]);
    optimizer.apply_gradients(tape.gradient(loss, model.trainable_variables()),
                              model.trainable_variables());
  }

  const std::vector<mt::Tensor> out = model({a, b});
  const double accuracy =
      mt::mean(mt::cast(mt::equal(mt::argmax(out[0], 1), which), mt::kFloat32)).item<double>();
  const double mse = regress(total, out[1]).item<double>();
  std::printf("which: accuracy %.3f; total: mean squared error %.4f (variance of total: 16)\n",
              accuracy, mse);
  return accuracy > 0.9 && mse < 0.5 ? 0 : 1;
}
