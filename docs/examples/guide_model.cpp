// The Keras mixed precision guide's model, in C++: the policy, the model, the dtypes the
// guide prints, and the dtype trace of the model (the cheat sheet for this model).
#include <mixtape/mixtape.h>

namespace mt = mixtape;

int main() {
  // --- Setting the dtype policy ------------------------------------------------------
  mt::set_global_policy("mixed_float16");
  const mt::Policy policy = mt::global_policy();
  fmt::print("Compute dtype: {}\n", policy.compute_dtype());    // float16
  fmt::print("Variable dtype: {}\n", policy.variable_dtype());  // float32

  // --- Building the model ------------------------------------------------------------
  const int num_units = 64;  // the guide uses 4096 on a GPU
  auto inputs = mt::layers::Input({784}, {.name = "digits"});
  auto dense1 = mt::layers::Dense(num_units, {.activation = "relu", .name = "dense_1"});
  auto x = dense1(inputs);
  auto dense2 = mt::layers::Dense(num_units, {.activation = "relu", .name = "dense_2"});
  x = dense2(x);
  fmt::print("x.dtype: {}\n", x.dtype());                             // float16
  fmt::print("dense1.kernel.dtype: {}\n", dense1->kernel().dtype());  // float32

  // INCORRECT: softmax and model output will be float16, when it should be float32.
  auto incorrect = mt::layers::Dense(10, {.activation = "softmax"})(x);
  fmt::print("Outputs dtype: {}\n", incorrect.dtype());  // float16

  // CORRECT: softmax and model output are float32.
  x = mt::layers::Dense(10, {.name = "dense_logits"})(x);
  auto outputs = mt::layers::Activation("softmax", {.dtype = "float32", .name = "predictions"})(x);
  fmt::print("Outputs dtype: {}\n", outputs.dtype());  // float32

  mt::Model model(inputs, outputs);
  model.summary();

  // --- What ran in which dtype -----------------------------------------------------------
  const mt::Tensor batch = mt::uniform({8, 784}, 0.0, 1.0);
  const mt::DTypeTrace trace = mt::trace_dtypes(model, batch);
  fmt::print("{}", trace.table());

  // --- float16's range, as in the guide ------------------------------------------------
  const mt::Tensor big = mt::full({}, 256.0, "float16");
  const mt::Tensor tiny = mt::full({}, 1e-5, "float16");
  fmt::print("256^2 in float16: {}\n", (big * big).item<float>());     // inf (overflow)
  fmt::print("1e-5^2 in float16: {}\n", (tiny * tiny).item<float>());  // 0 (underflow)

  // --- Loss scales: dynamic by default, fixed when given a number ---------------------------
  fmt::print("Loss scale: {}\n", policy.loss_scale()->str());
  const mt::Policy fixed("mixed_float16", /*loss_scale=*/1024.0);
  fmt::print("Fixed: {}\n", fixed.loss_scale()->str());

  const bool ok = x.dtype() == mt::kFloat16 && dense1->kernel().dtype() == mt::kFloat32 &&
                  outputs.dtype() == mt::kFloat32 && incorrect.dtype() == mt::kFloat16 &&
                  model(batch).dtype() == mt::kFloat32;
  return ok ? 0 : 1;
}
