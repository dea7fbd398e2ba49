// Layer configs and the registry of layer classes (mixtape/layers/config.h).
#include "mixtape/layers/config.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <mutex>

#include "layers/config_util.h"
#include "mixtape/layers/attention.h"
#include "mixtape/layers/augmentation.h"
#include "mixtape/layers/conv_layers.h"
#include "mixtape/layers/core_layers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/merge.h"
#include "mixtape/layers/normalization.h"

namespace mixtape::layers {

namespace {

const char* kind_of(const ConfigValue& v) {
  switch (v.index()) {
    case 0:
      return "a flag";
    case 1:
      return "an integer";
    case 2:
      return "a number";
    case 3:
      return "a text";
    default:
      return "a list of integers";
  }
}

template <typename T>
const T& get_as(const std::map<std::string, ConfigValue>& values, const std::string& key,
                const char* want) {
  auto it = values.find(key);
  if (it == values.end())
    throw ValueError(fmt::format("config: no value '{}' (expected {})", key, want));
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  throw ValueError(fmt::format("config: '{}' is {}; expected {}", key, kind_of(it->second), want));
}

}  // namespace

bool Config::get_bool(const std::string& key) const { return get_as<bool>(values_, key, "a flag"); }
std::int64_t Config::get_int(const std::string& key) const {
  return get_as<std::int64_t>(values_, key, "an integer");
}
double Config::get_double(const std::string& key) const {
  auto it = values_.find(key);
  if (it != values_.end())
    if (const auto* i = std::get_if<std::int64_t>(&it->second)) return static_cast<double>(*i);
  return get_as<double>(values_, key, "a number");
}
const std::string& Config::get_string(const std::string& key) const {
  return get_as<std::string>(values_, key, "a text");
}
const std::vector<std::int64_t>& Config::get_ints(const std::string& key) const {
  return get_as<std::vector<std::int64_t>>(values_, key, "a list of integers");
}

LayerOptions Config::layer_options() const {
  LayerOptions o;
  if (has("dtype")) o.dtype = Policy(get_string("dtype"));
  if (has("name")) o.name = get_string("name");
  if (has("trainable")) o.trainable = get_bool("trainable");
  return o;
}

// --- The registry -------------------------------------------------------------------------

namespace {

std::mutex g_registry_mutex;

// The built-in layers, registered on first use (a static library drops registrations in
// object files nothing refers to, so they are listed here rather than next to each class).
std::map<std::string, LayerFactory>& registry() {
  static std::map<std::string, LayerFactory> r = [] {
    std::map<std::string, LayerFactory> m;
    m["Dense"] = &DenseLayer::from_config;
    m["Activation"] = &ActivationLayer::from_config;
    m["Flatten"] = &FlattenLayer::from_config;
    m["Reshape"] = &ReshapeLayer::from_config;
    m["Slice"] = &SliceLayer::from_config;
    m["Dropout"] = &DropoutLayer::from_config;
    m["Embedding"] = &EmbeddingLayer::from_config;
    m["Conv2D"] = &Conv2DLayer::from_config;
    m["MaxPooling2D"] = [](const Config& c) {
      return Pooling2DLayer::from_config(Pooling2DLayer::Kind::Max, c);
    };
    m["AveragePooling2D"] = [](const Config& c) {
      return Pooling2DLayer::from_config(Pooling2DLayer::Kind::Average, c);
    };
    m["GlobalAveragePooling2D"] = &GlobalAveragePooling2DLayer::from_config;
    m["BatchNormalization"] = &BatchNormalizationLayer::from_config;
    m["LayerNormalization"] = &LayerNormalizationLayer::from_config;
    using K = ElementwiseMergeLayer::Kind;
    for (const auto& [name, kind] :
         std::vector<std::pair<const char*, K>>{{"Add", K::Add},
                                                {"Subtract", K::Subtract},
                                                {"Multiply", K::Multiply},
                                                {"Average", K::Average},
                                                {"Maximum", K::Maximum},
                                                {"Minimum", K::Minimum}})
      m[name] = [kind = kind](const Config& c) {
        return ElementwiseMergeLayer::from_config(kind, c);
      };
    m["Concatenate"] = &ConcatenateLayer::from_config;
    m["Dot"] = &DotLayer::from_config;
    m["MultiHeadAttention"] = &MultiHeadAttentionLayer::from_config;
    m["PositionEmbedding"] = &PositionEmbeddingLayer::from_config;
    m["RandomTranslation"] = &RandomTranslationLayer::from_config;
    m["RandomFlip"] = &RandomFlipLayer::from_config;
    return m;
  }();
  return r;
}

// C++ type name -> the class name it was registered under (MIXTAPE_REGISTER_LAYER(_AS)).
std::map<std::string, std::string>& registered_types() {
  static std::map<std::string, std::string> r;
  return r;
}

std::string registered_list() {
  std::string out;
  for (const auto& [k, v] : registry()) out += (out.empty() ? "" : ", ") + k;
  return out;
}

}  // namespace

void register_layer(const std::string& class_name, LayerFactory factory) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (class_name.empty() || !factory)
    throw ValueError("register_layer: needs a class name and a factory");
  if (!registry().emplace(class_name, std::move(factory)).second)
    throw ValueError(
        fmt::format("register_layer: a layer class '{}' is registered already", class_name));
}

std::shared_ptr<Layer> layer_from_config(const std::string& class_name, const Config& config) {
  LayerFactory factory;
  {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    auto it = registry().find(class_name);
    if (it == registry().end())
      throw ValueError(fmt::format(
          "unknown layer class '{}': register the class whose class_name() is '{}' with "
          "MIXTAPE_REGISTER_LAYER(T) (under T's C++ name) or MIXTAPE_REGISTER_LAYER_AS(T, "
          "\"{}\") (under another name), and give it get_config and a static from_config; "
          "registered: {}",
          class_name, class_name, class_name, registered_list()));
    factory = it->second;
  }
  const std::string name = config.has("name") ? config.get_string("name") : std::string("?");
  try {
    std::shared_ptr<Layer> layer = factory(config);
    if (!layer) throw ValueError("from_config returned no layer");
    if (layer->class_name() != class_name)
      throw ValueError(fmt::format("from_config made a layer of class '{}'", layer->class_name()));
    return layer;
  } catch (const Error& e) {
    throw ValueError(fmt::format("layer '{}' ({}): cannot be made from its config: {}", name,
                                 class_name, e.what()));
  }
}

std::vector<std::string> registered_layers() {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  std::vector<std::string> out;
  for (const auto& [k, v] : registry()) out.push_back(k);
  return out;
}

namespace detail {

void note_registered_type(const std::type_info& type, const std::string& class_name) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  registered_types()[type.name()] = class_name;
}

std::string registered_name_of(const std::type_info& type) {
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  auto it = registered_types().find(type.name());
  return it == registered_types().end() ? std::string() : it->second;
}

std::string class_name_of(const std::type_info& type) {
  int status = 0;
  char* raw = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string full = status == 0 && raw ? raw : type.name();
  std::free(raw);
  const auto colon = full.rfind("::");
  return colon == std::string::npos ? full : full.substr(colon + 2);
}

init::Initializer initializer_from(const Config& c, const std::string& key,
                                   init::Initializer fallback) {
  if (!c.has(key)) return fallback;
  try {
    return init::get(c.get_string(key));
  } catch (const ValueError&) {
    // A parameterised initializer ("constant(0.1)") has no name to look up; the weights of a
    // model file are loaded over it anyway.
    return fallback;
  }
}

Size2 size2_from(const Config& c, const std::string& key) {
  const auto& v = c.get_ints(key);
  if (v.size() != 2)
    throw ValueError(fmt::format("config: '{}' must hold 2 integers; got {}", key, v.size()));
  return Size2(v[0], v[1]);
}

const Variable& built_weight(const Layer& layer, const Variable& v, const char* what) {
  if (!v.defined())
    throw ValueError(
        fmt::format("layer '{}' ({}): {} does not exist before the layer is built "
                    "(call the layer on an input first)",
                    layer.name(), layer.class_name(), what));
  return v;
}

}  // namespace detail

namespace option_codec {

void get(const Config& c, const std::string& k, int& v) {
  const std::int64_t i = c.get_int(k);
  if (i < std::numeric_limits<int>::min() || i > std::numeric_limits<int>::max())
    throw ValueError(fmt::format("config: '{}' is {}, outside the range of an int", k, i));
  v = static_cast<int>(i);
}

}  // namespace option_codec

}  // namespace mixtape::layers
