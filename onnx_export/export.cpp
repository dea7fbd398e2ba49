// export_onnx (include/mixtape/onnx/export.h): the model's graph walked in execution order,
// each layer call written by its class's exporter (onnx_export/layers.cpp for the built-in ones),
// the result checked by ONNX's checker and strict shape inference, then written atomically.
#include "mixtape/onnx/export.h"

#include <fmt/format.h>
#include <onnx/checker.h>
#include <onnx/shape_inference/implementation.h>

#include <climits>
#include <map>
#include <mutex>
#include <set>

#include "mixtape/io/atomic_file.h"
#include "mixtape/layers/model.h"
#include "onnx_export/graph_builder.h"
#include "onnx_export/layers.h"

#ifndef MIXTAPE_VERSION_STRING
#define MIXTAPE_VERSION_STRING "unknown"
#endif

namespace mixtape {

namespace {

struct Registry {
  std::mutex mutex;
  std::map<std::string, OnnxExporter> exporters = onnx_detail::builtin_exporters();
};

Registry& registry() {
  static Registry r;
  return r;
}

std::optional<OnnxExporter> exporter_of(const std::string& class_name) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  auto it = r.exporters.find(class_name);
  if (it == r.exporters.end()) return std::nullopt;
  return it->second;
}

}  // namespace

void register_onnx_exporter(const std::string& class_name, OnnxExporter exporter) {
  if (class_name.empty() || !exporter)
    throw ValueError("register_onnx_exporter: needs a class name and an exporter");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.exporters[class_name] = std::move(exporter);
}

bool has_onnx_exporter(const std::string& class_name) {
  return exporter_of(class_name).has_value();
}

namespace onnx_detail {
namespace {

using layers::Layer;
using layers::SymbolicTensor;
using layers::TensorSpec;
using Node = layers::detail::SymbolicNode;

// Writes the calls of a model (and of the models inside it) into a GraphBuilder.
class Walker {
 public:
  explicit Walker(GraphBuilder& graph) : g_(graph) {}

  // The outputs of `model` for `inputs` (of `specs`), its layers' names under `scope`.
  std::vector<OnnxValue> model(const Model& m, const std::vector<OnnxValue>& inputs,
                               const std::vector<TensorSpec>& specs, const std::string& scope) {
    if (m.inputs().empty()) return {sequential(m, inputs.front(), specs.front(), scope)};
    std::map<std::pair<const Node*, int>, OnnxValue> values;
    for (std::size_t i = 0; i < m.inputs().size(); ++i)
      values[{m.inputs()[i].node().get(), m.inputs()[i].index()}] = inputs.at(i);
    std::vector<OnnxValue> outs;
    for (const SymbolicTensor& o : m.outputs()) outs.push_back(value_of(o, values, scope));
    out_specs_.clear();
    for (const SymbolicTensor& o : m.outputs())
      out_specs_.push_back(TensorSpec{o.shape(), o.dtype()});
    return outs;
  }

  // The output specs of the model walked last (the outermost one, once the walk is done).
  const std::vector<TensorSpec>& output_specs() const { return out_specs_; }

 private:
  OnnxValue value_of(const SymbolicTensor& t,
                     std::map<std::pair<const Node*, int>, OnnxValue>& values,
                     const std::string& scope) {
    auto key = std::make_pair(t.node().get(), t.index());
    if (auto it = values.find(key); it != values.end()) return it->second;
    const Node& node = *t.node();
    std::vector<OnnxValue> in;
    std::vector<TensorSpec> in_specs;
    for (const SymbolicTensor& x : node.inputs) {
      in.push_back(value_of(x, values, scope));
      in_specs.push_back(TensorSpec{x.shape(), x.dtype()});
    }
    const std::vector<OnnxValue> outs = call(*node.layer, in, in_specs, node.outputs, scope);
    for (std::size_t k = 0; k < outs.size(); ++k)
      values[{t.node().get(), static_cast<int>(k)}] = outs[k];
    return values.at(key);
  }

  OnnxValue sequential(const Model& m, OnnxValue x, TensorSpec spec, const std::string& scope) {
    for (const auto& layer : m.layers()) {
      std::vector<TensorSpec> out;
      if (auto s = layer->compute_output_spec({spec})) {
        out = *s;
      } else if (layer->output_shape()) {
        out = {TensorSpec{*layer->output_shape(), layer->compute_dtype()}};
      } else {
        throw ValueError(fmt::format("layer '{}' cannot say its output shape", layer->name()));
      }
      x = call(*layer, {x}, {spec}, out, scope).front();
      spec = out.front();
    }
    out_specs_ = {spec};
    return x;
  }

  std::vector<OnnxValue> call(const Layer& layer, const std::vector<OnnxValue>& inputs,
                              const std::vector<TensorSpec>& in_specs,
                              const std::vector<TensorSpec>& out_specs, const std::string& scope) {
    const std::string path = scope.empty() ? layer.name() : scope + "/" + layer.name();
    if (const auto* inner = dynamic_cast<const Model*>(&layer))
      return model(*inner, inputs, in_specs, path);
    const std::string cls = layer.class_name();
    const std::optional<OnnxExporter> exporter = exporter_of(cls);
    if (!exporter)
      throw ValueError(
          fmt::format("layer '{}' (class {}) has no ONNX form: give its class an exporter with "
                      "mt::register_onnx_exporter (docs/extending.md)",
                      path, cls));
    g_.set_scope(path);
    OnnxLayerCall c{layer, {}, inputs, in_specs, out_specs, g_.exported(layer.compute_dtype())};
    for (const OnnxValue& x : inputs)
      c.inputs.push_back(x.dtype.is_floating() ? g_.cast(x, c.compute_dtype) : x);
    std::vector<OnnxValue> outs;
    try {
      outs = (*exporter)(g_, c);
    } catch (const Error& e) {
      throw ValueError(fmt::format("layer '{}' ({}): {}", path, cls, e.what()));
    }
    if (outs.size() != out_specs.size())
      throw ValueError(
          fmt::format("layer '{}' ({}): its exporter gave {} outputs; the layer has {}", path, cls,
                      outs.size(), out_specs.size()));
    for (std::size_t k = 0; k < outs.size(); ++k) {
      const DType want = g_.exported(out_specs[k].dtype);
      if (outs[k].dtype != want)
        throw ValueError(
            fmt::format("layer '{}' ({}): its exporter gave output {} in {}; the layer returns {}",
                        path, cls, k, outs[k].dtype.name(), want.name()));
    }
    g_.set_scope("");
    return outs;
  }

  GraphBuilder& g_;
  std::vector<TensorSpec> out_specs_;
};

// A name fit for a graph input or output: "split[1]" -> "split_1".
std::string value_name(std::string name) {
  for (char& ch : name)
    if (ch == '[' || ch == ']') ch = '_';
  while (!name.empty() && name.back() == '_') name.pop_back();
  return name;
}

// The model as an ONNX ModelProto, checked.
::onnx::ModelProto build(const Model& model, const OnnxExportOptions& options) {
  ::onnx::ModelProto proto;
  proto.set_ir_version(8);  // what opset 17 goes with
  proto.set_producer_name("mixtape");
  proto.set_producer_version(MIXTAPE_VERSION_STRING);
  auto* opset = proto.add_opset_import();
  opset->set_domain("");
  opset->set_version(kOpset);
  for (const auto& [key, value] : options.metadata) {
    auto* entry = proto.add_metadata_props();
    entry->set_key(key);
    entry->set_value(value);
  }
  ::onnx::GraphProto& graph = *proto.mutable_graph();
  graph.set_name(options.graph_name.empty() ? model.name() : options.graph_name);

  std::map<std::uint64_t, std::string> paths;
  for (const auto& w : layers::weight_paths(model)) paths[w.variable.id()] = w.path;
  GraphBuilder g(graph, options.float32, std::move(paths));
  Walker walker(g);

  std::vector<OnnxValue> inputs;
  std::vector<TensorSpec> specs;
  if (!model.inputs().empty()) {
    for (const SymbolicTensor& in : model.inputs()) {
      specs.push_back(TensorSpec{in.shape(), in.dtype()});
      inputs.push_back(g.add_input(value_name(in.name()), g.exported(in.dtype()), in.shape()));
    }
  } else {
    if (!model.build_input_shape())
      throw ValueError(fmt::format(
          "model '{}' is not built: call it once, or build_for(input_shape), before exporting",
          model.name()));
    const DType dt = model.integer_input_dtype().value_or(kInt64);
    specs.push_back(TensorSpec{*model.build_input_shape(), dt});
    inputs.push_back(g.add_input("input", g.exported(dt), *model.build_input_shape()));
  }
  const std::vector<OnnxValue> outs = walker.model(model, inputs, specs, "");
  const std::vector<TensorSpec> out_specs = walker.output_specs();
  std::vector<std::string> names;
  if (!model.outputs().empty()) {
    for (const SymbolicTensor& o : model.outputs()) names.push_back(value_name(o.name()));
  } else {
    names.push_back(value_name(model.layers().back()->name()));
  }
  std::set<std::string> taken;
  for (const auto& in : inputs) taken.insert(in.name);
  for (std::size_t k = 0; k < outs.size(); ++k) {
    std::string name = names.at(k);
    if (!taken.insert(name).second) name = g.fresh(name + "_output");
    g.add_output(name, outs[k], out_specs.at(k).shape);
  }
  g.prune();

  // ONNX's own checks: the checker (operators, attributes, types of initializers) and shape
  // inference in strict mode with type checks (every node's inputs fit its schema).
  try {
    ::onnx::checker::check_model(proto);
    ::onnx::ShapeInferenceOptions strict{true, 1, true};
    ::onnx::ModelProto inferred = proto;
    ::onnx::shape_inference::InferShapes(inferred, ::onnx::OpSchemaRegistry::Instance(), strict);
  } catch (const std::exception& e) {
    throw ValueError(fmt::format("the ONNX graph of model '{}' fails ONNX's checks: {}",
                                 model.name(), e.what()));
  }
  return proto;
}

}  // namespace
}  // namespace onnx_detail

void export_onnx(const Model& model, const std::string& path, const OnnxExportOptions& options) {
  ::onnx::ModelProto proto;
  try {
    proto = onnx_detail::build(model, options);
  } catch (const Error& e) {
    throw ValueError(fmt::format("export_onnx '{}': {}", path, e.what()));
  }
  const std::size_t size = proto.ByteSizeLong();
  if (size > static_cast<std::size_t>(INT_MAX))
    throw ValueError(fmt::format(
        "export_onnx '{}': the model takes {} bytes, over the 2 GiB a protobuf message (one ONNX "
        "file without external data) can hold",
        path, size));
  std::string bytes;
  if (!proto.SerializeToString(&bytes))
    throw IOError(fmt::format("export_onnx '{}': protobuf could not serialise the model", path));
  proto.Clear();
  detail::write_file_atomically(
      path, "export_onnx", [&](detail::FileSink& out) { out.write(bytes.data(), bytes.size()); });
}

}  // namespace mixtape
