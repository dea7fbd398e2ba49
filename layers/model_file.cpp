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

// Whether a JSON integer fits an int64: nlohmann keeps 2^63 and above as unsigned, which
// would wrap to a negative number.
bool fits_int64(const json& v) {
  return v.is_number_integer() &&
         !(v.is_number_unsigned() &&
           v.get<std::uint64_t>() >
               static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
}

// A JSON integer as the int64 a Config holds.
std::int64_t config_int(const json& v, const std::string& where, const std::string& key) {
  if (!fits_int64(v))
    throw ValueError(fmt::format("{}: '{}' is {}, beyond the largest integer a config holds ({})",
                                 where, key, v.get<std::uint64_t>(),
                                 std::numeric_limits<std::int64_t>::max()));
  return v.get<std::int64_t>();
}

// A value of a document read from a file (the architecture, the compile state) with its place
// in it, a JSON pointer such as /layers/3/config: what is missing or of the wrong kind is
// named by its place and by what belongs there, in the terms of the layer configs' errors
// ("a text", "an integer"), not the JSON library's ("cannot use at() with number").
class Doc {
 public:
  // `document`: what the value is ("the architecture"); `prefix`: what starts each message.
  Doc(const json& j, std::string document, std::string prefix = "")
      : j_(&j), document_(std::move(document)), prefix_(std::move(prefix)) {}

  const json& value() const { return *j_; }

  // The member `key` of this object: an error when this is not an object or has no such key.
  Doc operator[](const std::string& key) const {
    if (!j_->is_object()) fail("an object with \"" + key + "\"");
    const auto it = j_->find(key);
    if (it == j_->end()) throw ValueError(fmt::format("{}{} has no \"{}\"", prefix_, where(), key));
    return Doc(*it, *this, "/" + key);
  }
  bool has(const std::string& key) const { return j_->is_object() && j_->contains(key); }

  // The elements of this array.
  std::vector<Doc> elements() const {
    if (!j_->is_array()) fail("a list");
    std::vector<Doc> out;
    out.reserve(j_->size());
    for (std::size_t i = 0; i < j_->size(); ++i)
      out.push_back(Doc((*j_)[i], *this, fmt::format("/{}", i)));
    return out;
  }

  std::string text() const {
    if (!j_->is_string()) fail("a text");
    return j_->get<std::string>();
  }
  bool flag() const {
    if (!j_->is_boolean()) fail("true or false");
    return j_->get<bool>();
  }
  double number() const {
    if (!j_->is_number()) fail("a number");
    return j_->get<double>();
  }
  std::int64_t integer() const {
    if (!fits_int64(*j_)) fail("an integer");
    return j_->get<std::int64_t>();
  }
  // An integer >= 0: a count or a position.
  std::size_t index() const {
    if (!j_->is_number_integer() || (!j_->is_number_unsigned() && j_->get<std::int64_t>() < 0))
      fail("an integer >= 0");
    return j_->get<std::size_t>();
  }
  std::vector<std::int64_t> integers() const {
    std::vector<std::int64_t> out;
    for (const Doc& e : elements()) out.push_back(e.integer());
    return out;
  }
  std::vector<double> numbers() const {
    std::vector<double> out;
    for (const Doc& e : elements()) out.push_back(e.number());
    return out;
  }

  // The place, for messages: "the architecture's /layers/3" ("the architecture" at the top).
  std::string where() const {
    return place_.empty() ? document_ : fmt::format("{}'s {}", document_, place_);
  }

  [[noreturn]] void fail(const std::string& expected) const {
    std::string got = j_->dump();
    if (got.size() > 60) got = got.substr(0, 57) + "...";
    throw ValueError(fmt::format("{}{} is {}; expected {}", prefix_, where(), got, expected));
  }

 private:
  // A value inside `parent`, at `step` ("/key" or "/index") from it.
  Doc(const json& j, const Doc& parent, const std::string& step)
      : j_(&j),
        document_(parent.document_),
        prefix_(parent.prefix_),
        place_(parent.place_ + step) {}

  const json* j_;
  std::string document_;
  std::string prefix_;
  std::string place_;  // a JSON pointer; empty at the top
};

Config config_from(const Doc& d, const std::string& where) {
  const json& j = d.value();
  if (!j.is_object())
    throw ValueError(fmt::format("{}: the config ({}) is not a JSON object", where, d.where()));
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

std::shared_ptr<layers::Layer> layer_from_json(const Doc& j);

std::shared_ptr<Model> functional_from_json(const Doc& j) {
  const Config config = config_from(j["config"], "model");
  const std::string model_name = config.has("name") ? config.get_string("name") : "model";
  const std::string where = fmt::format("model '{}'", model_name);
  std::map<std::string, Doc> entries;
  for (const Doc& e : j["layers"].elements()) {
    const std::string name = e["config"]["name"].text();
    if (!entries.emplace(name, e).second)
      throw ValueError(fmt::format("{}: two layers are named '{}'", where, name));
  }
  std::map<std::string, std::shared_ptr<layers::Layer>> made;
  std::map<std::string, std::vector<std::vector<SymbolicTensor>>> calls;
  auto resolve = [&](const Doc& ref) {
    const std::vector<Doc> parts = ref.elements();
    if (parts.size() != 3) ref.fail("a tensor reference [layer, call, output]");
    const std::string name = parts[0].text();
    const std::size_t call = parts[1].index(), out = parts[2].index();
    auto it = calls.find(name);
    if (it == calls.end() || call >= it->second.size() || out >= it->second[call].size())
      throw ValueError(fmt::format("{}: the graph reads {}[{}][{}], which is not made before it",
                                   where, name, call, out));
    return it->second[call][out];
  };
  for (const Doc& node : j["nodes"].elements()) {
    const std::string name = node["layer"].text();
    auto e = entries.find(name);
    if (e == entries.end())
      throw ValueError(
          fmt::format("{}: the graph calls layer '{}', which it does not list", where, name));
    if (e->second["class_name"].text() == "InputLayer") {
      const Config c = config_from(e->second["config"], fmt::format("Input '{}'", name));
      calls[name].push_back({layers::Input(
          Shape(c.get_ints("shape")),
          layers::InputOptions{.dtype = DType(c.get_string("input_dtype")), .name = name})});
      continue;
    }
    auto& layer = made[name];
    if (!layer) layer = layer_from_json(e->second);
    std::vector<SymbolicTensor> inputs;
    for (const Doc& ref : node["inputs"].elements()) inputs.push_back(resolve(ref));
    calls[name].push_back(layer->apply(inputs));
  }
  std::vector<SymbolicTensor> inputs, outputs;
  for (const Doc& ref : j["inputs"].elements()) inputs.push_back(resolve(ref));
  for (const Doc& ref : j["outputs"].elements()) outputs.push_back(resolve(ref));
  const layers::LayerOptions o = config.layer_options();
  return std::make_shared<Model>(
      inputs, outputs, ModelOptions{.dtype = o.dtype, .name = o.name, .trainable = o.trainable});
}

std::shared_ptr<Model> sequential_from_json(const Doc& j) {
  const Config config = config_from(j["config"], "model");
  std::vector<layers::LayerPtr<layers::Layer>> ls;
  for (const Doc& e : j["layers"].elements()) ls.emplace_back(layer_from_json(e));
  const layers::LayerOptions o = config.layer_options();
  auto model = std::make_shared<Sequential>(
      std::move(ls), ModelOptions{.dtype = o.dtype, .name = o.name, .trainable = o.trainable});
  if (j.has("build_input_shape")) model->build_for(Shape(j["build_input_shape"].integers()));
  return model;
}

std::shared_ptr<layers::Layer> layer_from_json(const Doc& j) {
  const std::string cls = j["class_name"].text();
  if (cls == "Functional") return functional_from_json(j);
  if (cls == "Sequential") return sequential_from_json(j);
  const Doc config = j["config"];
  const std::string name = config.has("name") ? config["name"].text() : std::string("?");
  return layers::layer_from_config(cls,
                                   config_from(config, fmt::format("layer '{}' ({})", name, cls)));
}

constexpr const char* kReductions[] = {"sum_over_batch_size", "sum", "none"};

json loss_to_json(const losses::Loss& loss) {
  const losses::LossOptions& o = *loss.options();
  return json{{"name", loss.name()},
              {"from_logits", o.from_logits},
              {"reduction", kReductions[static_cast<int>(o.reduction)]}};
}

losses::Loss loss_from_json(const Doc& j) {
  losses::LossOptions o;
  o.from_logits = j["from_logits"].flag();
  const Doc reduction = j["reduction"];
  const std::string r = reduction.text();
  bool known = false;
  for (int i = 0; i < 3; ++i)
    if (r == kReductions[i]) {
      o.reduction = static_cast<losses::Reduction>(i);
      known = true;
    }
  if (!known) reduction.fail("a loss reduction: sum_over_batch_size, sum or none");
  return losses::from_config(j["name"].text(), o);
}

// The optimizer's config: numbers by name.
std::map<std::string, double> numbers_by_name(const Doc& d) {
  if (!d.value().is_object()) d.fail("an object of numbers");
  std::map<std::string, double> out;
  for (const auto& [key, v] : d.value().items()) out[key] = d[key].number();
  return out;
}

// compile()'s options from Model::compile_config()'s JSON.
CompileOptions compile_options_from(const Doc& j) {
  std::vector<losses::Loss> ls;
  for (const Doc& l : j["losses"].elements()) ls.push_back(loss_from_json(l));
  std::vector<MetricRef> metrics;
  for (const Doc& m : j["metrics"].elements()) metrics.emplace_back(m.text());
  const Doc o = j["optimizer"];
  std::shared_ptr<optim::Optimizer> opt =
      optim::from_config(o["class_name"].text(), numbers_by_name(o["config"]));
  if (const Doc s = j["loss_scale"]; !s.value().is_null()) {
    const LossScale scale =
        s["dynamic"].flag() ? LossScale::dynamic({.initial_scale = s["initial_scale"].number(),
                                                  .growth_interval = s["growth_interval"].integer(),
                                                  .multiplier = s["multiplier"].number(),
                                                  .min_scale = s["min_scale"].number()})
                            : LossScale::fixed(s["initial_scale"].number());
    opt = std::make_shared<optim::LossScaleOptimizer>(opt, scale);
  }
  return CompileOptions{
      .loss = LossSpec(std::move(ls)),
      .optimizer = opt,
      .metrics = std::move(metrics),
      .loss_weights = j["loss_weights"].numbers(),
      .gradient_accumulation_steps =
          j.has("gradient_accumulation_steps") ? j["gradient_accumulation_steps"].integer() : 1};
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
  // (Every value is read through Doc, which checks its kind first: no JSON library error
  // comes out of here.)
  std::shared_ptr<layers::Layer> layer =
      layer_from_json(Doc(j, "the architecture", "model_from_json: "));
  auto model = std::dynamic_pointer_cast<Model>(layer);
  if (!model)
    throw ValueError(
        fmt::format("model_from_json: the architecture is a layer of class '{}', not a model",
                    layer->class_name()));
  return model;
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
      json state;
      try {
        state = json::parse(c->second);
      } catch (const json::exception& e) {
        throw ValueError(fmt::format("the compile state is malformed JSON: {}", e.what()));
      }
      model->compile(compile_options_from(Doc(state, "the compile state")));
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
