// Training three ways on a synthetic task: Model.fit under mixed_float16 (loss scaling
// is automatic; on tensors and on a Dataset), a custom loop with a LossScaleOptimizer
// (compute_gradients, then apply_gradients), and a float32 model under automatic mixed
// precision.
#include <mixtape/mixtape.h>

namespace mt = mixtape;

// Two classes: points around (+1, +1, ...) and (-1, -1, ...) in 16 dimensions.
std::pair<mt::Tensor, mt::Tensor> make_data(std::int64_t n, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<double> xs;
  std::vector<std::int64_t> ys;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t label = static_cast<std::int64_t>(gen.next_u64() % 2);
    ys.push_back(label);
    for (int d = 0; d < 16; ++d) xs.push_back((label ? 1.0 : -1.0) + 0.7 * gen.next_normal());
  }
  return {mt::from_vector(xs, {n, 16}), mt::from_vector(ys, {n})};
}

mt::Model make_model() {
  auto inputs = mt::layers::Input({16});
  auto x = mt::layers::Dense(64, {.activation = "relu"})(inputs);
  x = mt::layers::Dense(2)(x);
  auto outputs = mt::layers::Activation("softmax", {.dtype = "float32"})(x);
  return mt::Model(inputs, outputs);
}

int main() {
  const auto [x_train, y_train] = make_data(4096, 1);
  const auto [x_test, y_test] = make_data(1024, 2);

  // --- Model.fit: under mixed_float16 compile() wraps the optimizer for loss scaling ------
  mt::set_global_policy("mixed_float16");
  mt::Model model = make_model();
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy(),
                 .optimizer = mt::optim::RMSprop(),
                 .metrics = {"accuracy"}});
  const auto initial_weights = model.get_weights();
  mt::History history =
      model.fit(x_train, y_train, {.batch_size = 256, .epochs = 3, .validation_split = 0.2});
  mt::Logs scores = model.evaluate(x_test, y_test);
  fmt::print("Test loss: {:.4f}\nTest accuracy: {:.4f}\n", scores["loss"], scores["accuracy"]);
  const double fit_accuracy = scores["accuracy"];

  // --- Model.fit on a Dataset: the main form (fit(x, y) builds this pipeline) ------------
  model.set_weights(initial_weights);
  const auto train_ds = mt::data::Dataset::from_tensors(x_train, y_train).shuffle_all(7).batch(256);
  model.fit(train_ds, {.epochs = 2, .validation_data = {x_test, y_test}, .verbose = 2});

  // --- A custom training loop -------------------------------------------------------------
  model.set_weights(initial_weights);
  mt::optim::LossScaleOptimizer optimizer(mt::optim::RMSprop(), mt::LossScale::dynamic());
  auto loss_object = mt::losses::SparseCategoricalCrossentropy();
  const auto vars = model.trainable_variables();
  for (int epoch = 0; epoch < 3; ++epoch) {
    mt::metrics::Mean epoch_loss;
    for (const auto& [xb, yb] : mt::data::Dataset::from_tensors(x_train, y_train).batch(256)) {
      mt::GradientTape tape;
      auto loss = loss_object(yb, model(xb, {.training = true}));
      // The loss scaled, the gradients unscaled: the optimizer chain does it.
      auto grads = optimizer.compute_gradients(tape, loss, vars);
      optimizer.apply_gradients(grads, vars);  // skips on inf/nan
      epoch_loss(loss);
    }
    mt::metrics::SparseCategoricalAccuracy test_accuracy("test_accuracy");
    test_accuracy.update_state(y_test, model(x_test));
    fmt::print("Epoch {}: loss={:.4f}, test accuracy={:.4f}, loss scale {}\n", epoch,
               epoch_loss.result(), test_accuracy.result(), optimizer.loss_scale());
  }

  // --- Automatic mixed precision: a float32 model, matmuls in float16 while training --------
  mt::set_global_policy("float32");
  mt::Model fp32_model = make_model();
  auto amp_optimizer =
      mt::optim::enable_auto_mixed_precision(mt::optim::SGD({.learning_rate = 0.1}));
  fp32_model.compile({.loss = "sparse_categorical_crossentropy",
                      .optimizer = amp_optimizer,
                      .metrics = {"accuracy"}});
  fp32_model.fit(x_train, y_train, {.batch_size = 256, .epochs = 2, .verbose = 2});
  const double amp_accuracy = fp32_model.evaluate(x_test, y_test)["accuracy"];
  mt::optim::disable_auto_mixed_precision();
  fmt::print("AMP test accuracy: {:.4f}\n", amp_accuracy);

  return fit_accuracy > 0.95 && amp_accuracy > 0.95 ? 0 : 1;
}
