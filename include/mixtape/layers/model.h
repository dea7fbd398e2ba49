// Models: a functional Model (Input -> layer calls -> output) and Sequential. Both are
// layers: callable on tensors, with weights, get_weights/set_weights, to(device), and a
// summary that shows each layer's dtype policy.
//
//   auto inputs = mt::layers::Input({784}, {.name = "digits"});
//   auto x = mt::layers::Dense(64, {.activation = "relu"})(inputs);
//   auto outputs = mt::layers::Dense(10)(x);
//   mt::Model model(inputs, outputs);
//   mt::Tensor y = model(batch);
//
//   mt::Sequential seq({mt::layers::Dense(64, {.activation = "relu"}), mt::layers::Dense(10)});
//
// Under a mixed policy the output should be float32 (the guide's advice): a model whose
// output is float16 or bfloat16 says so once in the log and in its summary.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "mixtape/layers/layer.h"

namespace mixtape {

struct ModelOptions {
  std::optional<Policy> dtype = {};
  std::string name = {};  // empty: "model", "model_1", ... ("sequential" for Sequential)
  bool trainable = true;
};

class Model : public layers::Layer {
 public:
  // A functional model from an Input() to a symbolic output.
  Model(const layers::SymbolicTensor& inputs, const layers::SymbolicTensor& outputs,
        ModelOptions options = {});

  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::string class_name() const override { return "Functional"; }

  // The layers, in the order they run (the InputLayer first for a functional model).
  const std::vector<std::shared_ptr<layers::Layer>>& layers() const { return layers_; }
  // The layer called `name`; throws ValueError listing the names when there is none.
  std::shared_ptr<layers::Layer> get_layer(std::string_view name) const;

  // Layer, output shape, parameter count and the policy, compute and variable dtypes of
  // each layer, then the parameter totals.
  std::string summary_string() const;
  void summary() const;  // prints summary_string() to stdout

  // Runs a batch of one through the model so that every layer is built (for a Sequential
  // model before its first call). `input_shape` may carry -1 on the batch axis.
  void build_for(const Shape& input_shape);

 protected:
  // For Sequential: a model whose call() is its own.
  Model(ModelOptions options, std::string class_name);
  bool autocast_inputs() const override { return false; }
  void add_layer(std::shared_ptr<layers::Layer> layer);
  // Says once (log) when the output is 16-bit under a mixed policy.
  void check_output_dtype(DType output);

  std::vector<std::shared_ptr<layers::Layer>> layers_;

 private:
  // The functional graph, in execution order: for node i, the index of its input node
  // (-1 for the Input).
  std::vector<std::shared_ptr<layers::detail::SymbolicNode>> nodes_;
  std::vector<int> node_inputs_;
  std::optional<DType> warned_output_;
  std::optional<std::string> output_note_;
};

class Sequential : public Model {
 public:
  explicit Sequential(std::vector<layers::LayerPtr<layers::Layer>> layers = {},
                      ModelOptions options = {});
  // Appends a layer.
  void add(layers::LayerPtr<layers::Layer> layer);
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::string class_name() const override { return "Sequential"; }
};

}  // namespace mixtape
