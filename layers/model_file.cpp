// Whole-model files: the architecture as JSON (Model::to_json, model_from_json), Model::save
// and load_model.
#include <spdlog/spdlog.h>

#include <limits>
#include <map>
#include <nlohmann/json.hpp>

#include "mixtape/io/safetensors.h"
#include "mixtape/layers/checkpoint.h"
#include "mixtape/layers/core_layers.h"
#include "mixtape/layers/model.h"
#include "mixtape/optim/distributed_optimizer.h"
#include "mixtape/optim/gradient_accumulation.h"
#include "mixtape/optim/loss_scale_optimizer.h"

namespace mixtape {

namespace {

using layers::Config;
using layers::ConfigValue;
using layers::SymbolicTensor;
using nlohmann::json;

// The format of Model::save files (in __metadata__ "model_format").
constexpr const char* kModelFormat = "mixtape-model-1";
// The deepest nesting of JSON values an architecture may have (docs/checkpoints.md).
constexpr int kMaxArchitectureDepth = 256;

json to_json(const Config& c) {
  json j = json::object();
  for (const auto& [k, v] : c.values()) std::visit([&, &k = k](const auto& x) { j[k] = x; }, v);
  return j;
}

// A JSON integer as the int64 a Config holds: nlohmann keeps 2^63 and above as unsigned,
// which would wrap to a negative number.
std::int64_t config_int(const json& v, const std::string& where, const std::string& key) {
  if (v.is_number_unsigned() &&
      v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    throw ValueError(fmt::format("{}: '{}' is {}, beyond the largest integer a config holds ({})",
                                 where, key, v.get<std::uint64_t>(),
                                 std::numeric_limits<std::int64_t>::max()));
  return v.get<std::int64_t>();
}

Config config_from(const json& j, const std::string& where) {
  if (!j.is_object()) throw ValueError(fmt::format("{}: the config is not a JSON object", where));
  Config c;
  for (const auto& [k, v] : j.items()) {
    if (v.is_boolean()) {
      c.set(k, v.get<bool>());
    } else if (v.is_number_integer()) {
      c.set(k, config_int(v, where, k));
    } else if (v.is_number_float()) {
      c.set(k, v.get<double>());
    } else if (v.is_string()) {
      c.set(k, v.get<std::string>());
    } else if (v.is_array()) {
      std::vector<std::int64_t> ints;
      for (const auto& e : v) {
        if (!e.is_number_integer())
          throw ValueError(fmt::format("{}: '{}' must be a list of integers", where, k));
        ints.push_back(config_int(e, where, k));
      }
      c.set(k, std::move(ints));
    } else {
      throw ValueError(
          fmt::format("{}: '{}' has a value of an unknown kind ({})", where, k, v.type_name()));
    }
  }
  return c;
}

json tensor_ref(const SymbolicTensor& t,
                const std::map<const layers::detail::SymbolicNode*, std::size_t>& call_number) {
  return json::array({t.layer()->name(), call_number.at(t.node().get()), t.index()});
}

json layer_to_json(const layers::Layer& l) {
  if (const auto* m = dynamic_cast<const Model*>(&l)) return json::parse(m->to_json());
  // A file records class_name(); a class registered under another name would not load.
  const std::string registered = layers::detail::registered_name_of(typeid(l));
  if (!registered.empty() && registered != l.class_name())
    throw ValueError(fmt::format(
        "layer '{}' ({}): its class is registered as '{}' (MIXTAPE_REGISTER_LAYER registers the "
        "C++ name) but its class_name(), the name a model file records, is '{}': load_model "
        "would not find it. Register it with MIXTAPE_REGISTER_LAYER_AS({}, \"{}\")",
        l.name(), l.class_name(), registered, l.class_name(),
        layers::detail::class_name_of(typeid(l)), l.class_name()));
  json j;
  j["class_name"] = l.class_name();
  j["config"] = to_json(l.get_config());
  return j;
}

// Bounded nesting: a file is untrusted input, and making the model (and printing names)
// recurses as deep as the JSON does. One pass over the text, before it is parsed (a parse
// callback would cost nlohmann's parser a pass over each array per element).
void check_depth(const std::string& text) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxArchitectureDepth)
        throw ValueError(fmt::format(
            "model_from_json: the architecture nests deeper than {} levels (a model file holds "
            "models nested a few levels deep at most)",
            kMaxArchitectureDepth));
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

std::string text_of(const json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); }

std::shared_ptr<layers::Layer> layer_from_json(const json& j);

std::shared_ptr<Model> functional_from_json(const json& j) {
  const Config config = config_from(j.at("config"), "model");
  const std::string model_name = config.has("name") ? config.get_string("name") : "model";
  const std::string where = fmt::format("model '{}'", model_name);
  std::map<std::string, json> entries;
  for (const auto& e : j.at("layers")) {
    const std::string name = text_of(e.at("config").at("name"));
    if (!entries.emplace(name, e).second)
      throw ValueError(fmt::format("{}: two layers are named '{}'", where, name));
  }
  std::map<std::string, std::shared_ptr<layers::Layer>> made;
  std::map<std::string, std::vector<std::vector<SymbolicTensor>>> calls;
  auto resolve = [&](const json& ref) {
    if (!ref.is_array() || ref.size() != 3)
      throw ValueError(fmt::format("{}: a tensor reference must be [layer, call, output]; got {}",
                                   where, ref.dump()));
    const std::string name = text_of(ref[0]);
    const auto call = ref[1].get<std::size_t>();
    const auto out = ref[2].get<std::size_t>();
    auto it = calls.find(name);
    if (it == calls.end() || call >= it->second.size() || out >= it->second[call].size())
      throw ValueError(fmt::format("{}: the graph reads {}[{}][{}], which is not made before it",
                                   where, name, call, out));
    return it->second[call][out];
  };
  for (const auto& node : j.at("nodes")) {
    const std::string name = text_of(node.at("layer"));
    auto e = entries.find(name);
    if (e == entries.end())
      throw ValueError(
          fmt::format("{}: the graph calls layer '{}', which it does not list", where, name));
    const std::string cls = text_of(e->second.at("class_name"));
    if (cls == "InputLayer") {
      const Config c = config_from(e->second.at("config"), fmt::format("Input '{}'", name));
      calls[name].push_back({layers::Input(
          Shape(c.get_ints("shape")),
          layers::InputOptions{.dtype = DType(c.get_string("input_dtype")), .name = name})});
      continue;
    }
    auto& layer = made[name];
    if (!layer) layer = layer_from_json(e->second);
    std::vector<SymbolicTensor> inputs;
    for (const auto& ref : node.at("inputs")) inputs.push_back(resolve(ref));
    calls[name].push_back(layer->apply(inputs));
  }
  std::vector<SymbolicTensor> inputs, outputs;
  for (const auto& ref : j.at("inputs")) inputs.push_back(resolve(ref));
  for (const auto& ref : j.at("outputs")) outputs.push_back(resolve(ref));
  const layers::LayerOptions o = config.layer_options();
  return std::make_shared<Model>(
      inputs, outputs, ModelOptions{.dtype = o.dtype, .name = o.name, .trainable = o.trainable});
}

std::shared_ptr<Model> sequential_from_json(const json& j) {
  const Config config = config_from(j.at("config"), "model");
  std::vector<layers::LayerPtr<layers::Layer>> ls;
  for (const auto& e : j.at("layers")) ls.emplace_back(layer_from_json(e));
  const layers::LayerOptions o = config.layer_options();
  auto model = std::make_shared<Sequential>(
      std::move(ls), ModelOptions{.dtype = o.dtype, .name = o.name, .trainable = o.trainable});
  if (j.contains("build_input_shape"))
    model->build_for(Shape(j.at("build_input_shape").get<std::vector<std::int64_t>>()));
  return model;
}

std::shared_ptr<layers::Layer> layer_from_json(const json& j) {
  const std::string cls = text_of(j.at("class_name"));
  if (cls == "Functional") return functional_from_json(j);
  if (cls == "Sequential") return sequential_from_json(j);
  const json& cj = j.at("config");
  const std::string name = cj.contains("name") ? text_of(cj.at("name")) : std::string("?");
  return layers::layer_from_config(cls, config_from(cj, fmt::format("layer '{}' ({})", name, cls)));
}

constexpr const char* kReductions[] = {"sum_over_batch_size", "sum", "none"};

json loss_to_json(const losses::Loss& loss) {
  const losses::LossOptions& o = *loss.options();
  return json{{"name", loss.name()},
              {"from_logits", o.from_logits},
              {"reduction", kReductions[static_cast<int>(o.reduction)]}};
}

losses::Loss loss_from_json(const json& j) {
  losses::LossOptions o;
  o.from_logits = j.at("from_logits").get<bool>();
  const std::string reduction = j.at("reduction").get<std::string>();
  bool known = false;
  for (int i = 0; i < 3; ++i)
    if (reduction == kReductions[i]) {
      o.reduction = static_cast<losses::Reduction>(i);
      known = true;
    }
  if (!known) throw ValueError(fmt::format("unknown loss reduction '{}'", reduction));
  return losses::from_config(j.at("name").get<std::string>(), o);
}

// compile()'s options from Model::compile_config()'s JSON.
CompileOptions compile_options_from(const json& j) {
  std::vector<losses::Loss> ls;
  for (const auto& l : j.at("losses")) ls.push_back(loss_from_json(l));
  std::vector<MetricRef> metrics;
  for (const auto& m : j.at("metrics")) metrics.emplace_back(m.get<std::string>());
  const json& o = j.at("optimizer");
  std::shared_ptr<optim::Optimizer> opt = optim::from_config(
      o.at("class_name").get<std::string>(), o.at("config").get<std::map<std::string, double>>());
  if (const json& s = j.at("loss_scale"); !s.is_null()) {
    const LossScale scale =
        s.at("dynamic").get<bool>()
            ? LossScale::dynamic({.initial_scale = s.at("initial_scale").get<double>(),
                                  .growth_interval = s.at("growth_interval").get<std::int64_t>(),
                                  .multiplier = s.at("multiplier").get<double>(),
                                  .min_scale = s.at("min_scale").get<double>()})
            : LossScale::fixed(s.at("initial_scale").get<double>());
    opt = std::make_shared<optim::LossScaleOptimizer>(opt, scale);
  }
  return CompileOptions{
      .loss = LossSpec(std::move(ls)),
      .optimizer = opt,
      .metrics = std::move(metrics),
      .loss_weights = j.at("loss_weights").get<std::vector<double>>(),
      .gradient_accumulation_steps = j.value("gradient_accumulation_steps", std::int64_t{1})};
}

}  // namespace

std::string Model::compile_config(std::string& why) const {
  json j;
  j["losses"] = json::array();
  for (const auto& l : losses_) {
    if (!l.options()) {
      why = fmt::format("the loss '{}' is a function of one's own", l.name());
      return {};
    }
    j["losses"].push_back(loss_to_json(l));
  }
  j["loss_weights"] = loss_weights_;
  j["metrics"] = json::array();
  for (const auto& m : metric_names_) {
    if (!m) {
      why = "a metric is a Metric object";
      return {};
    }
    j["metrics"].push_back(*m);
  }
  // The optimizer as given: inside a DistributedOptimizer (compile() adds it again where
  // there are several ranks), around it a LossScaleOptimizer.
  const optim::Optimizer* opt = optimizer_.get();
  j["gradient_accumulation_steps"] = 1;
  if (const auto* acc = dynamic_cast<const optim::GradientAccumulationOptimizer*>(opt)) {
    j["gradient_accumulation_steps"] = acc->steps();
    opt = &acc->inner_optimizer();
  }
  if (const optim::DistributedOptimizer* d = opt->distributed_optimizer(); d == opt)
    opt = &d->inner_optimizer();
  j["loss_scale"] = nullptr;
  if (const optim::LossScaleOptimizer* lso = opt->loss_scale_optimizer(); lso == opt) {
    const LossScale& s = lso->loss_scale_config();
    j["loss_scale"] = json{{"dynamic", s.is_dynamic()},
                           {"initial_scale", s.initial_scale()},
                           {"growth_interval", s.growth_interval()},
                           {"multiplier", s.multiplier()},
                           {"min_scale", s.min_scale()}};
    opt = &lso->inner_optimizer();
  }
  try {
    j["optimizer"] = json{{"class_name", opt->name()}, {"config", opt->get_config()}};
  } catch (const ValueError& e) {
    why = e.what();
    return {};
  }
  return j.dump();
}

std::string Model::to_json() const {
  json j;
  j["class_name"] = class_name();
  j["config"] = mixtape::to_json(Layer::get_config());
  j["layers"] = json::array();
  for (const auto& l : layers_) j["layers"].push_back(layer_to_json(*l));
  if (nodes_.empty()) {
    if (build_input_shape_) j["build_input_shape"] = build_input_shape_->dims();
    return j.dump();
  }
  std::map<const layers::detail::SymbolicNode*, std::size_t> call_number;
  std::map<const layers::Layer*, std::size_t> calls_of;
  j["nodes"] = json::array();
  for (const auto& n : nodes_) {
    call_number[n.get()] = calls_of[n->layer.get()]++;
    json node;
    node["layer"] = n->layer->name();
    node["inputs"] = json::array();
    for (const auto& x : n->inputs) node["inputs"].push_back(tensor_ref(x, call_number));
    j["nodes"].push_back(node);
  }
  j["inputs"] = json::array();
  for (const auto& x : inputs_) j["inputs"].push_back(tensor_ref(x, call_number));
  j["outputs"] = json::array();
  for (const auto& x : outputs_) j["outputs"].push_back(tensor_ref(x, call_number));
  return j.dump();
}

std::shared_ptr<Model> model_from_json(const std::string& text) {
  json j;
  try {
    check_depth(text);
    j = json::parse(text);
  } catch (const json::exception& e) {
    throw ValueError(fmt::format("model_from_json: malformed JSON: {}", e.what()));
  }
  try {
    std::shared_ptr<layers::Layer> layer = layer_from_json(j);
    auto model = std::dynamic_pointer_cast<Model>(layer);
    if (!model)
      throw ValueError(fmt::format("the architecture is a layer of class '{}', not a model",
                                   layer->class_name()));
    return model;
  } catch (const json::exception& e) {
    throw ValueError(
        fmt::format("model_from_json: the architecture is not of the expected "
                    "shape: {}",
                    e.what()));
  }
}

void Model::save(const std::string& path, const TrainingCheckpoint& info) const {
  if (nodes_.empty() && !build_input_shape_)
    throw ValueError(
        fmt::format("model '{}': save: the model is not built; call it once or "
                    "build_for(input_shape) first",
                    name()));
  TrainingCheckpoint with = info;
  for (const char* key : {"architecture", "model_format", "compile"})
    if (with.metadata.count(key))
      throw ValueError(
          fmt::format("model '{}': save '{}': metadata key \"{}\" is reserved", name(), path, key));
  with.metadata["architecture"] = to_json();
  with.metadata["model_format"] = kModelFormat;
  if (compiled()) {
    std::string why;
    if (std::string c = compile_config(why); !c.empty())
      with.metadata["compile"] = std::move(c);
    else if (!said_compile_unrecorded_)  // once per model: a trainer saves often
      spdlog::info(
          "model '{}': saved with its optimizer state but without its compile state ({}): "
          "load_model will return it uncompiled (compile it, then load_checkpoint)",
          name(), why);
    said_compile_unrecorded_ = said_compile_unrecorded_ || with.metadata.count("compile") == 0;
    save_checkpoint(path, *this, *optimizer_, with);
  } else {
    mixtape::save_weights(*this, path, with.metadata);
  }
}

std::shared_ptr<Model> load_model(const std::string& path, const WeightLoadOptions& options) {
  const SafetensorsFile file = load_safetensors(path);
  auto it = file.metadata.find("architecture");
  if (it == file.metadata.end())
    throw ValueError(fmt::format(
        "load_model '{}': the file has no architecture (save_weights or save_checkpoint wrote "
        "it): make the model in code and call load_weights, or save it with model.save",
        path));
  std::shared_ptr<Model> model;
  try {
    // The model may create no more weight data than the file holds (checked before each
    // weight is allocated).
    std::uint64_t held = 0;
    for (const auto& [name, t] : file.tensors)
      if (!name.starts_with("optimizer/")) held += static_cast<std::uint64_t>(t.nbytes());
    layers::detail::WeightBudget budget(held, fmt::format("the file '{}'", path));
    model = model_from_json(it->second);
    // Saved compiled: compiled again as it was, and its optimizer's state restored with the
    // weights (load_checkpoint checks both before it changes either).
    if (auto c = file.metadata.find("compile"); c != file.metadata.end()) {
      try {
        model->compile(compile_options_from(json::parse(c->second)));
      } catch (const json::exception& e) {
        throw ValueError(
            fmt::format("the compile state is not of the expected shape: {}", e.what()));
      }
    }
  } catch (const Error& e) {
    e.rethrow_with_prefix(fmt::format("load_model '{}': ", path));  // keeps the error's type
  }
  if (model->compiled())
    load_checkpoint(path, *model, *model->optimizer(), options);
  else
    mixtape::load_weights(*model, path, options);
  return model;
}

}  // namespace mixtape
