// A training step captured once and replayed (mt::StepGraph; a CUDA graph on a GPU), checked
// against the same steps run as usual; then fit with compile's capture_step.
#include <mixtape/mixtape.h>

namespace mt = mixtape;

int main() {
  const mt::Device device = mt::cuda::available() ? mt::Device::cuda(0) : mt::Device::cpu();
  mt::set_global_policy("mixed_bfloat16");
  // Eight batches of a 4-class problem in 16 dimensions.
  mt::Generator gen(3);
  std::vector<mt::Tensor> xs, ys;
  for (int b = 0; b < 8; ++b) {
    std::vector<double> x;
    std::vector<std::int64_t> y;
    for (int i = 0; i < 64; ++i) {
      y.push_back(static_cast<std::int64_t>(gen.next_u64() % 4));
      for (int d = 0; d < 16; ++d)
        x.push_back(0.4 * static_cast<double>(y.back()) + gen.next_normal());
    }
    xs.push_back(mt::from_vector(x, {64, 16}).to(device));
    ys.push_back(mt::from_vector(y, {64}).to(device));
  }
  const auto make_model = [&] {
    mt::manual_seed(1);
    auto inputs = mt::layers::Input({16});
    auto h = mt::layers::Dense(64, {.activation = "relu"})(inputs);
    auto logits = mt::layers::Dense(4, {.dtype = "float32"})(h);
    auto model = std::make_unique<mt::Model>(inputs, logits);
    model->to(device);
    return model;
  };
  const auto loss_fn = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  const auto train_step = [&](mt::Model& model, mt::optim::Optimizer& opt, const mt::Tensor& x,
                              const mt::Tensor& y) {
    const auto vars = model.trainable_variables();
    mt::GradientTape tape;
    const mt::Tensor loss = loss_fn(y, model(x, {.training = true}));
    opt.apply_gradients(opt.compute_gradients(tape, loss, vars), vars);
    return loss;
  };

  // As usual: a step per batch.
  auto reference = make_model();
  mt::optim::AdamW reference_opt({.learning_rate = 0.01});
  mt::Tensor reference_loss;
  for (std::size_t b = 0; b < xs.size(); ++b)
    reference_loss = train_step(*reference, reference_opt, xs[b], ys[b]);

  // Captured: the first batch steps and captures, the others are copied in and replayed.
  auto model = make_model();
  mt::optim::AdamW opt({.learning_rate = 0.01});
  mt::Variable x(xs[0], "x", /*trainable=*/false), y(ys[0], "y", /*trainable=*/false);
  mt::Tensor loss;
  mt::StepGraph graph =
      mt::StepGraph::capture(device, [&] { loss = train_step(*model, opt, x, y); });
  for (std::size_t b = 1; b < xs.size(); ++b) {
    x.assign(xs[b]);
    y.assign(ys[b]);
    graph.replay();
  }
  fmt::print("on {}: loss after {} steps {:.6f}, as usual {:.6f}\n", device.str(), opt.iterations(),
             loss.item<double>(), reference_loss.item<double>());
  const auto w = model->get_weights(), w_ref = reference->get_weights();
  for (std::size_t i = 0; i < w.size(); ++i)
    if (w[i].to_vector<double>() != w_ref[i].to_vector<double>()) return 1;

  // fit with the step captured at the first batch.
  auto fitted = make_model();
  fitted->compile({.loss = loss_fn,
                   .optimizer = mt::optim::Adam({.learning_rate = 0.01}),
                   .metrics = {"accuracy"},
                   .capture_step = true});
  const mt::History h = fitted->fit(mt::concat(xs, 0), mt::concat(ys, 0),
                                    {.batch_size = 64, .epochs = 3, .verbose = 0});
  fmt::print("fit with capture_step: accuracy {:.4f}\n", h.last("accuracy"));
  return h.last("accuracy") > 0.5 ? 0 : 1;
}
