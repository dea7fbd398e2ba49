// Functional models, Sequential, and the model summary.
#include "mixtape/layers/model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <set>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/layers/checkpoint.h"
#include "mixtape/layers/core_layers.h"
#include "mixtape/layers/trace.h"

namespace mixtape {

using layers::Layer;
using layers::detail::SymbolicNode;

namespace {

// "(None, 28, 28, 1)" for a shape with -1 on the batch axis.
std::string shape_text(const std::optional<Shape>& s) {
  if (!s) return "?";
  std::string out = "(";
  for (std::size_t i = 0; i < s->rank(); ++i) {
    if (i) out += ", ";
    out += (*s)[i] < 0 ? std::string("None") : std::to_string((*s)[i]);
  }
  return out + (s->rank() == 1 ? ",)" : ")");
}

// 1234567 -> "1,234,567"
std::string grouped(std::int64_t n) {
  std::string digits = std::to_string(n), out;
  for (std::size_t i = 0; i < digits.size(); ++i) {
    if (i && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

}  // namespace

// --- Construction ----------------------------------------------------------------------

namespace {
// The name of a model: the one given, else "sequential", "sequential_1", ... for a
// Sequential and "model", "model_1", ... otherwise.
std::string model_name(const ModelOptions& options, const std::string& class_name) {
  if (!options.name.empty()) return options.name;
  return layers::detail::unique_layer_name(class_name == "Sequential" ? "sequential" : "model");
}
}  // namespace

// class_name is copied, not moved, into Layer: the arguments of one call are evaluated in
// no set order, and a move could empty it before model_name() reads it (every Sequential
// was named "model" that way).
Model::Model(ModelOptions options, const std::string& class_name)
    : Layer(layers::LayerOptions{options.dtype, model_name(options, class_name), options.trainable},
            class_name) {}

Model::Model(const layers::SymbolicTensor& inputs, const layers::SymbolicTensor& outputs,
             ModelOptions options)
    : Model(std::move(options), "Functional") {
  if (!inputs.defined() || !outputs.defined())
    throw ValueError(fmt::format("model '{}': inputs and outputs must be defined", name()));
  if (inputs.node()->input != nullptr ||
      !std::dynamic_pointer_cast<layers::InputLayer>(inputs.layer()))
    throw ValueError(
        fmt::format("model '{}': the inputs must come from Input(); got the output of "
                    "layer '{}'",
                    name(), inputs.layer()->name()));
  // Walk back from the output to the input: every layer takes one input, so the graph
  // between them is a chain.
  std::vector<std::shared_ptr<SymbolicNode>> chain;
  for (auto n = outputs.node(); n; n = n->input) {
    chain.push_back(n);
    if (n == inputs.node()) break;
  }
  if (chain.back() != inputs.node())
    throw ValueError(fmt::format(
        "model '{}': the output (from layer '{}') is not computed from the given input '{}'",
        name(), outputs.layer()->name(), inputs.layer()->name()));
  std::reverse(chain.begin(), chain.end());
  nodes_ = chain;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    node_inputs_.push_back(static_cast<int>(i) - 1);
    add_layer(nodes_[i]->layer);
  }
  check_output_dtype(outputs.dtype());
}

void Model::add_layer(std::shared_ptr<Layer> layer) {
  if (!layer) throw ValueError(fmt::format("model '{}': cannot add an empty layer", name()));
  if (std::find(layers_.begin(), layers_.end(), layer) != layers_.end()) return;  // shared
  for (const auto& l : layers_)
    if (l->name() == layer->name())
      throw ValueError(
          fmt::format("model '{}': two different layers are named '{}'; layer names "
                      "in a model must be unique",
                      name(), layer->name()));
  layers_.push_back(layer);
  track(std::move(layer));
}

void Model::check_output_dtype(DType output) {
  if (!output.is_reduced_float()) return;
  bool mixed = dtype_policy().is_mixed();
  for (const auto& l : layers_) mixed = mixed || l->dtype_policy().is_mixed();
  if (!mixed || warned_output_ == output) return;
  warned_output_ = output;
  output_note_ = fmt::format(
      "the output is {}; under mixed precision a model's output should be float32 (end it with "
      "Activation(\"linear\" or \"softmax\", {{.dtype = \"float32\"}}))",
      output);
  spdlog::warn("model '{}': {}", name(), *output_note_);
}

std::shared_ptr<Layer> Model::get_layer(std::string_view layer_name) const {
  std::string names;
  for (const auto& l : layers_) {
    if (l->name() == layer_name) return l;
    names += (names.empty() ? "" : ", ") + l->name();
  }
  throw ValueError(
      fmt::format("model '{}': no layer named '{}'; layers: {}", name(), layer_name, names));
}

// --- Running -----------------------------------------------------------------------------

std::optional<DType> Model::integer_input_dtype() const {
  if (layers_.empty()) return std::nullopt;
  return layers_.front()->integer_input_dtype();
}

Tensor Model::conform_input(const Tensor& x) const {
  if (!x.defined() || x.dtype().is_floating()) return x;
  const std::optional<DType> dtype = integer_input_dtype();
  if (!dtype || *dtype == x.dtype()) return x;
  NoGradGuard no_grad;
  return cast(x, *dtype);
}

Tensor Model::call(const Tensor& x_in, const CallContext& ctx) {
  const Tensor x = conform_input(x_in);
  std::vector<Tensor> values(nodes_.size());
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    const int in = node_inputs_[i];
    values[i] = (*nodes_[i]->layer)(in < 0 ? x : values[static_cast<std::size_t>(in)], ctx);
    // Values nothing later reads are dropped as soon as possible (a chain: the previous).
    if (in >= 0) values[static_cast<std::size_t>(in)] = Tensor();
  }
  return values.back();
}

void Model::build_for(const Shape& input_shape) {
  std::vector<std::int64_t> dims = input_shape.dims();
  if (!dims.empty() && dims[0] < 0) dims[0] = 1;
  DType dtype = kFloat32;
  if (!nodes_.empty()) dtype = nodes_.front()->dtype;
  NoGradGuard no_grad;
  mixtape::detail::DTypeTraceMute mute;
  (*this)(zeros(Shape(dims), dtype, device()), CallContext{.training = false});
}

void Model::save_weights(const std::string& path) const { mixtape::save_weights(*this, path); }
void Model::load_weights(const std::string& path) { mixtape::load_weights(*this, path); }

// --- Summary ------------------------------------------------------------------------------

std::string Model::summary_string() const {
  struct Row {
    std::array<std::string, 6> cells;
  };
  std::vector<Row> rows;
  for (std::size_t i = 0; i < layers_.size(); ++i) {
    const auto& l = layers_[i];
    std::optional<Shape> shape = l->output_shape();
    for (const auto& n : nodes_)
      if (n->layer == l) shape = n->shape;
    const bool has_vars = !l->weights().empty();
    const Policy& p = l->dtype_policy();
    const bool is_input = std::dynamic_pointer_cast<layers::InputLayer>(l) != nullptr;
    rows.push_back(Row{{fmt::format("{} ({})", l->name(), l->class_name()), shape_text(shape),
                        grouped(l->count_params()), is_input ? "-" : p.name(),
                        is_input ? std::string(shape ? nodes_.front()->dtype.name() : "-")
                                 : std::string(p.compute_dtype().name()),
                        has_vars ? std::string(p.variable_dtype().name()) : "-"}});
  }
  const std::array<std::string, 6> header = {"Layer (type)", "Output Shape", "Param #",
                                             "Policy",       "Compute",      "Variables"};
  std::array<std::size_t, 6> width{};
  for (std::size_t c = 0; c < width.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows)
    for (std::size_t c = 0; c < width.size(); ++c) width[c] = std::max(width[c], r.cells[c].size());
  std::size_t total_width = 0;
  for (auto w : width) total_width += w + 3;
  auto line = [&](const std::array<std::string, 6>& cs) {
    std::string out;
    for (std::size_t c = 0; c < cs.size(); ++c)
      out += c + 1 < cs.size() ? fmt::format("{:<{}}   ", cs[c], width[c]) : cs[c];
    return out + "\n";
  };
  std::int64_t total = 0, trainable = 0;
  for (const auto& v : weights()) {
    total += v.numel();
    if (v.trainable()) trainable += v.numel();
  }
  std::string out =
      fmt::format("Model: \"{}\" ({}, policy {})\n", name(), class_name(), dtype_policy().name());
  out += std::string(total_width, '_') + "\n" + line(header) + std::string(total_width, '=') + "\n";
  for (const auto& r : rows) out += line(r.cells);
  out += std::string(total_width, '=') + "\n";
  out += fmt::format("Total params: {}\nTrainable params: {}\nNon-trainable params: {}\n",
                     grouped(total), grouped(trainable), grouped(total - trainable));
  if (output_note_) out += fmt::format("Note: {}\n", *output_note_);
  out += std::string(total_width, '_') + "\n";
  return out;
}

void Model::summary() const { std::fputs(summary_string().c_str(), stdout); }

// --- Sequential -----------------------------------------------------------------------------

Sequential::Sequential(std::vector<layers::LayerPtr<Layer>> layers, ModelOptions options)
    : Model(std::move(options), "Sequential") {
  for (auto& l : layers) add(std::move(l));
}

void Sequential::add(layers::LayerPtr<Layer> layer) {
  if (layer && std::find(layers_.begin(), layers_.end(), layer) != layers_.end())
    throw ValueError(
        fmt::format("model '{}': layer '{}' is already in the model", name(), layer->name()));
  add_layer(std::move(layer));
}

Tensor Sequential::call(const Tensor& x, const CallContext& ctx) {
  if (layers_.empty()) throw ValueError("the model has no layers (add some with add())");
  Tensor y = conform_input(x);
  for (const auto& l : layers_) y = (*l)(y, ctx);
  check_output_dtype(y.dtype());
  return y;
}

}  // namespace mixtape
