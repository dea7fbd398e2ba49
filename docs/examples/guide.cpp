// The Keras mixed precision guide, all of it, in C++ (the user code of the project's API
// sketch): the policy, the model, Model.fit with automatic loss scaling, evaluation, the
// float16 range, loss scales, the custom training loop with a LossScaleOptimizer,
// automatic mixed precision, and saving the weights.
//
// It trains on MNIST, found as mt::datasets::mnist::load() finds it ($MIXTAPE_DATA_DIR, the
// cache, a download). Exit status 77 (a skipped test) when MNIST cannot be had.
#include <mixtape/mixtape.h>

#include <cstdio>

namespace mt = mixtape;

int main() {
  // --- Setting the dtype policy -------------------------------------------------
  mt::set_global_policy("mixed_float16");
  const mt::Policy policy = mt::global_policy();
  fmt::print("Compute dtype: {}\nVariable dtype: {}\n", policy.compute_dtype(),
             policy.variable_dtype());  // float16 / float32

  // --- Device: GPU when present, CPU otherwise --------------------------------------
  const bool gpu = mt::has_backend(mt::DeviceType::CUDA) &&
                   mt::backend_for(mt::DeviceType::CUDA).device_count() > 0;
  const mt::Device device = gpu ? mt::Device::cuda(0) : mt::Device::cpu();
  const int units = device.is_cuda() ? 4096 : 64;

  // --- Building the model -------------------------------------------------------
  auto inputs = mt::layers::Input({784}, {.name = "digits"});
  auto dense1 = mt::layers::Dense(units, {.activation = "relu", .name = "dense_1"});
  auto x = dense1(inputs);
  x = mt::layers::Dense(units, {.activation = "relu", .name = "dense_2"})(x);
  fmt::print("x.dtype: {}\n", x.dtype());                             // float16
  fmt::print("dense1.kernel.dtype: {}\n", dense1->kernel().dtype());  // float32
  x = mt::layers::Dense(10, {.name = "dense_logits"})(x);
  auto outputs = mt::layers::Activation("softmax", {.dtype = "float32", .name = "predictions"})(x);
  fmt::print("Outputs dtype: {}\n", outputs.dtype());  // float32

  mt::Model model(inputs, outputs);  // functional model; mt::Sequential also exists
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy(),
                 .optimizer = mt::optim::RMSprop(),
                 .metrics = {"accuracy"}});
  model.summary();  // layer, output shape, params, and policy / compute / variable dtypes
  model.to(device);

  mt::datasets::Mnist mnist;
  try {
    mnist = mt::datasets::mnist::load({.flatten = true});  // float32 in [0, 1], int64 labels
  } catch (const mt::IOError& e) {
    std::fprintf(stderr, "MNIST is not available here, skipping: %s\n", e.what());
    return 77;
  }
  auto initial_weights = model.get_weights();

  // --- Training with fit: loss scaling is automatic under mixed_float16 --------------
  auto history = model.fit(mnist.train.x, mnist.train.y,
                           {.batch_size = 8192, .epochs = 5, .validation_split = 0.2});
  auto scores = model.evaluate(mnist.test.x, mnist.test.y);
  fmt::print("Test loss: {}\nTest accuracy: {}\n", scores["loss"], scores["accuracy"]);
  const double fit_accuracy = scores["accuracy"];

  // --- float16's range, as in the guide --------------------------------------------
  auto big = mt::full({}, 256.0, "float16");
  fmt::print("256^2 in float16: {}\n", (big * big).item<float>());  // inf
  auto tiny = mt::full({}, 1e-5, "float16");
  fmt::print("(1e-5)^2 in float16: {}\n", (tiny * tiny).item<float>());  // 0

  // --- Loss scale: dynamic by default, fixed on request -----------------------------
  fmt::print("Loss scale: {}\n", policy.loss_scale()->str());
  auto fixed = mt::Policy("mixed_float16", /*loss_scale=*/1024.0);
  fmt::print("Fixed loss scale: {}\n", fixed.loss_scale()->str());

  // --- A custom training loop with LossScaleOptimizer ----------------------------
  model.set_weights(initial_weights);
  mt::optim::LossScaleOptimizer optimizer(mt::optim::RMSprop(), mt::LossScale::dynamic());
  auto loss_object = mt::losses::SparseCategoricalCrossentropy();
  auto train_ds =
      mt::data::Dataset::from_tensors(mnist.train.x, mnist.train.y).shuffle(10000).batch(8192);
  for (int epoch = 0; epoch < 5; ++epoch) {
    mt::metrics::Mean epoch_loss;
    for (auto& [xb, yb] : train_ds) {
      mt::GradientTape tape;  // records while alive
      auto predictions = model(xb, {.training = true});
      auto loss = loss_object(yb, predictions);
      auto scaled_loss = optimizer.get_scaled_loss(loss);
      auto scaled_grads = tape.gradient(scaled_loss, model.trainable_variables());
      auto grads = optimizer.get_unscaled_gradients(scaled_grads);
      optimizer.apply_gradients(grads, model.trainable_variables());  // skips on inf/nan
      epoch_loss(loss);
    }
    mt::metrics::SparseCategoricalAccuracy test_accuracy("test_accuracy");
    test_accuracy.update_state(mnist.test.y, model.predict(mnist.test.x, {.batch_size = 8192}));
    fmt::print("Epoch {}: loss={}, test accuracy={}, loss scale {}\n", epoch, epoch_loss.result(),
               test_accuracy.result(), optimizer.loss_scale());
  }

  // --- Automatic mixed precision as a rewrite (seed 003) ---------------------------
  auto amp_opt = mt::optim::enable_auto_mixed_precision(mt::optim::SGD());
  fmt::print("AMP: {} wrapping {}, lists:\n{}", amp_opt.name(), amp_opt.inner_optimizer().name(),
             mt::amp_lists().str());
  mt::optim::disable_auto_mixed_precision();

  // --- Save, load, continue --------------------------------------------------------
  model.save_weights("mnist.safetensors");
  model.load_weights("mnist.safetensors");
  std::remove("mnist.safetensors");

  return fit_accuracy > 0.8 ? 0 : 1;  // 30 steps of batch 8192: about 0.86 with 64 units
}
