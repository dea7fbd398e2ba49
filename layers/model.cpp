// Functional models, Sequential, and the model summary.
#include "mixtape/layers/model.h"

#include <spdlog/spdlog.h>

#include <algorithm>
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
    : Model(std::vector<layers::SymbolicTensor>{inputs},
            std::vector<layers::SymbolicTensor>{outputs}, std::move(options)) {}

Model::Model(const std::vector<layers::SymbolicTensor>& inputs,
             const std::vector<layers::SymbolicTensor>& outputs, ModelOptions options)
    : Model(std::move(options), "Functional") {
  inputs_ = inputs;
  outputs_ = outputs;
  make_graph();
  for (const auto& o : outputs_) check_output_dtype(o.dtype());
}

// Checks the graph between inputs_ and outputs_ and orders it: the inputs first, then every
// node after all the nodes it reads (a depth-first walk back from the outputs, in order).
void Model::make_graph() {
  if (inputs_.empty()) throw ValueError(fmt::format("model '{}': no inputs given", name()));
  if (outputs_.empty()) throw ValueError(fmt::format("model '{}': no outputs given", name()));
  std::map<const SymbolicNode*, std::size_t> index;  // node -> position in nodes_
  for (std::size_t i = 0; i < inputs_.size(); ++i) {
    const auto& in = inputs_[i];
    if (!in.defined())
      throw ValueError(fmt::format("model '{}': input {} is undefined", name(), i));
    if (!in.node()->inputs.empty() || !std::dynamic_pointer_cast<layers::InputLayer>(in.layer()))
      throw ValueError(
          fmt::format("model '{}': the inputs must come from Input(); input {} is the output of "
                      "layer '{}' ({})",
                      name(), i, in.layer()->name(), in.layer()->class_name()));
    if (index.count(in.node().get()))
      throw ValueError(
          fmt::format("model '{}': input '{}' is given twice", name(), in.layer()->name()));
    index[in.node().get()] = nodes_.size();
    nodes_.push_back(in.node());
  }
  for (std::size_t i = 0; i < outputs_.size(); ++i)
    if (!outputs_[i].defined())
      throw ValueError(fmt::format("model '{}': output {} is undefined", name(), i));

  // Depth-first, without recursion (a deep network would overflow the stack).
  enum class State { Open, Done };
  std::map<const SymbolicNode*, State> state;
  for (const auto& in : inputs_) state[in.node().get()] = State::Done;
  for (const auto& out : outputs_) {
    struct Item {
      std::shared_ptr<SymbolicNode> node;
      std::size_t next = 0;  // the next of its inputs to visit
    };
    std::vector<Item> stack;
    auto enter = [&](const std::shared_ptr<SymbolicNode>& n) {
      const auto it = state.find(n.get());
      if (it != state.end()) {
        if (it->second == State::Done) return;
        throw ValueError(fmt::format("model '{}': the graph has a cycle through layer '{}' ({})",
                                     name(), n->layer->name(), n->layer->class_name()));
      }
      if (n->inputs.empty())
        throw ValueError(fmt::format(
            "model '{}': output '{}' is computed from input '{}', which is not among the model's "
            "inputs ({})",
            name(), out.name(), n->layer->name(), [&] {
              std::string names;
              for (const auto& in : inputs_) names += (names.empty() ? "" : ", ") + in.name();
              return names;
            }()));
      state[n.get()] = State::Open;
      stack.push_back(Item{n});
    };
    enter(out.node());
    while (!stack.empty()) {
      Item& top = stack.back();
      if (top.next < top.node->inputs.size()) {
        const std::shared_ptr<SymbolicNode> next = top.node->inputs[top.next++].node();
        enter(next);
        continue;
      }
      state[top.node.get()] = State::Done;
      index[top.node.get()] = nodes_.size();
      nodes_.push_back(top.node);
      stack.pop_back();
    }
  }
  for (const auto& in : inputs_) {
    bool used = false;
    for (const auto& n : nodes_)
      for (const auto& x : n->inputs) used = used || x.node() == in.node();
    for (const auto& o : outputs_) used = used || o.node() == in.node();
    if (!used)
      throw ValueError(fmt::format("model '{}': input '{}' is not used by any output", name(),
                                   in.layer()->name()));
  }

  node_inputs_.resize(nodes_.size());
  uses_.resize(nodes_.size());
  for (std::size_t i = 0; i < nodes_.size(); ++i) uses_[i].assign(nodes_[i]->outputs.size(), 0);
  for (std::size_t i = 0; i < nodes_.size(); ++i)
    for (const auto& x : nodes_[i]->inputs) {
      const std::size_t from = index.at(x.node().get());
      const auto k = static_cast<std::size_t>(x.index());
      node_inputs_[i].emplace_back(from, k);
      ++uses_[from][k];
    }
  for (const auto& o : outputs_) {
    const std::size_t from = index.at(o.node().get());
    const auto k = static_cast<std::size_t>(o.index());
    output_slots_.emplace_back(from, k);
    ++uses_[from][k];
  }
  // Added last: a name clash leaves nothing tracked that a caller could see half-made.
  for (const auto& n : nodes_) add_layer(n->layer);
}

bool Model::has_layer(const Layer& layer) const {
  auto it = layer_by_name_.find(layer.name());
  return it != layer_by_name_.end() && it->second == &layer;
}

void Model::add_layer(std::shared_ptr<Layer> layer) {
  if (!layer) throw ValueError(fmt::format("model '{}': cannot add an empty layer", name()));
  // Names in a hash map: a model of many layers is made in linear time (a file of 200,000
  // layers loads in seconds, not hours).
  auto [it, fresh] = layer_by_name_.emplace(layer->name(), layer.get());
  if (!fresh) {
    if (it->second == layer.get()) return;  // shared: added already
    throw ValueError(
        fmt::format("model '{}': two different layers are named '{}'; layer names "
                    "in a model must be unique",
                    name(), layer->name()));
  }
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

Tensor Model::conform_input(const Tensor& x, std::size_t index) const {
  if (!x.defined() || x.dtype().is_floating()) return x;
  std::optional<DType> dtype = integer_input_dtype();
  if (index < inputs_.size())
    dtype = static_cast<const layers::InputLayer*>(nodes_[index]->layer.get())->input_dtype();
  if (!dtype || *dtype == x.dtype()) return x;
  NoGradGuard no_grad;
  return cast(x, *dtype);
}

std::vector<Tensor> Model::operator()(const std::vector<Tensor>& inputs, const CallContext& ctx) {
  return apply(inputs, ctx);
}

std::vector<layers::SymbolicTensor> Model::operator()(
    const std::vector<layers::SymbolicTensor>& inputs) {
  return apply(inputs);
}

Tensor Model::call(const Tensor& x, const CallContext& ctx) {
  if (nodes_.empty())
    throw ValueError("a model made with Model(options, class_name) overrides call()");
  std::vector<Tensor> ys = call_multi({x}, ctx);
  if (ys.size() != 1)
    throw ValueError(
        fmt::format("has {} outputs; call it with a vector of inputs to get them all", ys.size()));
  return std::move(ys.front());
}

namespace {
std::string names_of(const std::vector<layers::SymbolicTensor>& ts) {
  std::string out;
  for (const auto& t : ts) out += (out.empty() ? "" : ", ") + t.name();
  return out;
}
}  // namespace

std::vector<Tensor> Model::call_multi(const std::vector<Tensor>& inputs, const CallContext& ctx) {
  if (nodes_.empty()) return Layer::call_multi(inputs, ctx);  // Sequential: its call()
  if (inputs.size() != inputs_.size())
    throw ValueError(fmt::format("expected {} input{} ({}); got {}", inputs_.size(),
                                 inputs_.size() == 1 ? "" : "s", names_of(inputs_), inputs.size()));
  std::vector<std::vector<Tensor>> values(nodes_.size());
  std::vector<std::vector<int>> left = uses_;
  for (std::size_t i = 0; i < nodes_.size(); ++i) {
    std::vector<Tensor> xs;
    if (i < inputs_.size()) {
      // Integer and boolean inputs become the Input's dtype, as in Keras.
      xs.push_back(conform_input(inputs[i], i));
    } else {
      for (const auto& [from, k] : node_inputs_[i]) xs.push_back(values[from][k]);
    }
    values[i] = nodes_[i]->layer->apply(xs, ctx);
    if (values[i].size() != nodes_[i]->outputs.size())
      throw ValueError(
          fmt::format("layer '{}' ({}) gave {} outputs; it gave {} when the model was "
                      "made",
                      nodes_[i]->layer->name(), nodes_[i]->layer->class_name(), values[i].size(),
                      nodes_[i]->outputs.size()));
    // Values nothing later reads are dropped as soon as possible.
    for (const auto& [from, k] : node_inputs_[i])
      if (--left[from][k] == 0) values[from][k] = Tensor();
  }
  std::vector<Tensor> outputs;
  for (const auto& [from, k] : output_slots_) outputs.push_back(values[from][k]);
  for (const auto& y : outputs) check_output_dtype(y.dtype());
  return outputs;
}

std::optional<std::vector<layers::TensorSpec>> Model::compute_output_spec(
    const std::vector<layers::TensorSpec>& inputs) const {
  if (nodes_.empty()) {
    // Sequential: each layer's rule in turn (none when one of them has none).
    if (inputs.size() != 1 || layers_.empty()) return std::nullopt;
    std::vector<layers::TensorSpec> specs = inputs;
    for (const auto& l : layers_) {
      auto next = l->compute_output_spec(specs);
      if (!next) return std::nullopt;
      specs = std::move(*next);
    }
    return specs;
  }
  if (inputs.size() != inputs_.size())
    throw ValueError(fmt::format("expected {} input{} ({}); got {}", inputs_.size(),
                                 inputs_.size() == 1 ? "" : "s", names_of(inputs_), inputs.size()));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const Shape& want = inputs_[i].shape();
    const Shape& got = inputs[i].shape;
    bool ok = want.rank() == got.rank();
    for (std::size_t a = 1; ok && a < want.rank(); ++a) ok = want[a] == got[a];
    if (!ok)
      throw ShapeError(fmt::format("input {} ('{}') must have shape {}; got {}", i,
                                   inputs_[i].name(), shape_text(want), shape_text(got)));
  }
  std::vector<layers::TensorSpec> out;
  for (const auto& o : outputs_) out.push_back(layers::TensorSpec{o.shape(), o.dtype()});
  return out;
}

void Model::build(const Shape& input_shape) {
  if (!nodes_.empty()) return;  // a functional model is built when made
  {
    std::vector<std::int64_t> dims = input_shape.dims();
    if (!dims.empty()) dims[0] = -1;
    build_input_shape_ = Shape(dims);
  }
  std::vector<layers::TensorSpec> specs{
      layers::TensorSpec{input_shape, integer_input_dtype().value_or(kFloat32)}};
  if (specs.front().shape.rank() > 0 && specs.front().shape[0] >= 0) {
    std::vector<std::int64_t> dims = input_shape.dims();
    dims[0] = -1;
    specs.front().shape = Shape(dims);
  }
  for (const auto& l : layers_) specs = layers::detail::build_for_specs(l, specs);
}

void Model::build_for(const Shape& input_shape) {
  std::vector<std::int64_t> dims = input_shape.dims();
  if (!dims.empty()) dims[0] = -1;
  if (nodes_.empty()) {
    if (layers_.empty()) throw ValueError(fmt::format("model '{}' has no layers", name()));
    build(Shape(dims));
    return;
  }
  try {
    compute_output_spec({layers::TensorSpec{Shape(dims), inputs_.front().dtype()}});
  } catch (const Error& e) {
    e.rethrow_with_prefix(fmt::format("model '{}': ", name()));
  }
}

void Model::save_weights(const std::string& path) const { mixtape::save_weights(*this, path); }
void Model::load_weights(const std::string& path) { mixtape::load_weights(*this, path); }

// --- Summary ------------------------------------------------------------------------------

std::string Model::summary_string() const {
  // A functional model has Keras's "Connected to" column: for each call of the layer, the
  // tensors it read, as layer[call][output] (the call counted among that layer's calls in
  // this model).
  const bool functional = !nodes_.empty();
  std::map<const SymbolicNode*, std::size_t> call_number;
  std::map<const Layer*, std::vector<const SymbolicNode*>> calls_of;
  for (const auto& n : nodes_) {
    auto& calls = calls_of[n->layer.get()];
    call_number[n.get()] = calls.size();
    calls.push_back(n.get());
  }
  struct Row {
    std::vector<std::string> cells;
  };
  std::vector<Row> rows;
  for (const auto& l : layers_) {
    std::string shape = shape_text(l->output_shape());
    std::string connected;
    std::string input_dtype = "-";
    if (functional) {
      std::set<std::string> shapes;
      std::vector<std::string> reads;
      for (const SymbolicNode* n : calls_of[l.get()]) {
        std::vector<std::string> outs;
        for (const auto& o : n->outputs) outs.push_back(shape_text(o.shape));
        std::string joined = outs.front();
        for (std::size_t k = 1; k < outs.size(); ++k) joined += ", " + outs[k];
        shapes.insert(joined);
        for (const auto& x : n->inputs)
          reads.push_back(fmt::format("{}[{}][{}]", x.layer()->name(),
                                      call_number.at(x.node().get()), x.index()));
        if (n->inputs.empty()) input_dtype = std::string(n->outputs.front().dtype.name());
      }
      if (shapes.size() == 1) shape = *shapes.begin();
      if (shapes.size() > 1) shape = "multiple";
      for (std::size_t k = 0; k < reads.size(); ++k) connected += (k ? ", " : "") + reads[k];
      if (connected.empty()) connected = "-";
    }
    const bool has_vars = !l->weights().empty();
    const Policy& p = l->dtype_policy();
    const bool is_input = std::dynamic_pointer_cast<layers::InputLayer>(l) != nullptr;
    Row row{{fmt::format("{} ({})", l->name(), l->class_name()), shape, grouped(l->count_params()),
             is_input ? "-" : p.name(),
             is_input ? input_dtype : std::string(p.compute_dtype().name()),
             has_vars ? std::string(p.variable_dtype().name()) : "-"}};
    if (functional) row.cells.push_back(connected);
    rows.push_back(std::move(row));
  }
  std::vector<std::string> header = {"Layer (type)", "Output Shape", "Param #",
                                     "Policy",       "Compute",      "Variables"};
  if (functional) header.emplace_back("Connected to");
  std::vector<std::size_t> width(header.size());
  for (std::size_t c = 0; c < width.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows)
    for (std::size_t c = 0; c < width.size(); ++c) width[c] = std::max(width[c], r.cells[c].size());
  std::size_t total_width = 0;
  for (auto w : width) total_width += w + 3;
  auto line = [&](const std::vector<std::string>& cs) {
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
  if (layer && has_layer(*layer))
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
