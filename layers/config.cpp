// Layer configs (mixtape/layers/config.h) and the codecs of described options
// (mixtape/layers/options.h). The registry of layer classes is layers/registry.cpp.
#include "mixtape/layers/config.h"

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "layers/config_util.h"
#include "mixtape/layers/layer.h"

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

namespace detail {

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

const Variable& built_bias(const Layer& layer, const Variable& b, bool use_bias) {
  if (!use_bias)
    throw ValueError(fmt::format("layer '{}' ({}): has no bias (use_bias is false)", layer.name(),
                                 layer.class_name()));
  return built_weight(layer, b, "bias");
}

}  // namespace detail

namespace option_codec {

void get(const Config& c, const std::string& k, int& v) {
  const std::int64_t i = c.get_int(k);
  if (i < std::numeric_limits<int>::min() || i > std::numeric_limits<int>::max())
    throw ValueError(fmt::format("config: '{}' is {}, outside the range of an int", k, i));
  v = static_cast<int>(i);
}

void get(const Config& c, const std::string& k, std::vector<int>& v) {
  std::vector<int> out;
  for (const std::int64_t i : c.get_ints(k)) {
    if (i < std::numeric_limits<int>::min() || i > std::numeric_limits<int>::max())
      throw ValueError(fmt::format("config: '{}' holds {}, outside the range of an int", k, i));
    out.push_back(static_cast<int>(i));
  }
  v = std::move(out);
}

}  // namespace option_codec

}  // namespace mixtape::layers
