// The registry of layer classes (mixtape/layers/config.h): the built-in ones from the layer
// table (layers/layer_table.cpp), the others as MIXTAPE_REGISTER_LAYER adds them.
#include <cxxabi.h>
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <string_view>

#include "layers/layer_table.h"
#include "mixtape/core/error.h"
#include "mixtape/layers/config.h"
#include "mixtape/layers/layer.h"

namespace mixtape::layers {

namespace {

std::mutex g_registry_mutex;

// Every layer class by name: the built-in ones (layers/layer_table.cpp) from the first use,
// and those registered since (MIXTAPE_REGISTER_LAYER).
std::map<std::string, LayerFactory>& registry() {
  static std::map<std::string, LayerFactory> r = [] {
    std::map<std::string, LayerFactory> m;
    for (const LayerClass& c : builtin_layers()) m.emplace(std::string(c.name), c.from_config);
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
    // The error keeps its type, and a message that names the layer already is left as it is.
    const std::string layer = fmt::format("layer '{}' ({}): ", name, class_name);
    if (std::string_view(e.what()).starts_with(layer)) throw;
    e.rethrow_with_prefix(layer + "cannot be made from its config: ");
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

void add_builtin_config(const Layer& layer, Config& config) {
  for (const LayerClass& c : builtin_layers())
    if (c.write_config(layer, config)) return;
}

std::string class_name_of(const std::type_info& type) {
  int status = 0;
  char* raw = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string full = status == 0 && raw ? raw : type.name();
  std::free(raw);
  const auto colon = full.rfind("::");
  return colon == std::string::npos ? full : full.substr(colon + 2);
}
}  // namespace detail

}  // namespace mixtape::layers
