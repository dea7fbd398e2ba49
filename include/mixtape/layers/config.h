// Layer configurations and the registry of layer classes: what a model file records of each
// layer, and how load_model (mixtape/layers/model.h) makes the layer again without the code
// that built the model (Keras' get_config / from_config).
//
// A layer's config holds the arguments of its constructor: Dense's units, activation, ...,
// and the three every layer has, "name", "trainable" and "dtype" (the policy's name). A layer
// of your own that should load from files overrides get_config() (calling the base's) and
// has a static from_config, and registers its class once, at namespace scope:
//
//   class Scale : public mt::layers::Layer {
//    public:
//     Scale(double factor, mt::layers::LayerOptions options = {});
//     mt::layers::Config get_config() const override {
//       mt::layers::Config c = Layer::get_config();
//       c.set("factor", factor_);
//       return c;
//     }
//     static std::shared_ptr<Scale> from_config(const mt::layers::Config& c) {
//       return mt::layers::make_layer<Scale>(c.get_double("factor"), c.layer_options());
//     }
//     ...
//   };
//   MIXTAPE_REGISTER_LAYER(Scale);
//
// The macro registers the class under its C++ name ("Scale"), which is what class_name()
// returns unless the class overrides it; a class that does registers under that name with
// MIXTAPE_REGISTER_LAYER_AS(Scale, "MyScale"). Model::save refuses a layer whose C++ type
// is registered under another name than its class_name() (load_model would not find it).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <typeinfo>
#include <variant>
#include <vector>

namespace mixtape::layers {

class Layer;
struct LayerOptions;

// A value of a config: a flag, an integer, a number, a text, or a list of integers.
using ConfigValue =
    std::variant<bool, std::int64_t, double, std::string, std::vector<std::int64_t>>;

// A layer's config: named values. The getters throw ValueError naming the key when it is
// missing or holds another kind of value (a file written by another version, or edited).
class Config {
 public:
  void set(const std::string& key, bool value) { values_[key] = value; }
  void set(const std::string& key, int value) { values_[key] = std::int64_t{value}; }
  void set(const std::string& key, std::int64_t value) { values_[key] = value; }
  void set(const std::string& key, double value) { values_[key] = value; }
  void set(const std::string& key, const char* value) { values_[key] = std::string(value); }
  void set(const std::string& key, std::string value) { values_[key] = std::move(value); }
  void set(const std::string& key, std::vector<std::int64_t> value) {
    values_[key] = std::move(value);
  }

  bool has(const std::string& key) const { return values_.count(key) > 0; }
  bool get_bool(const std::string& key) const;
  std::int64_t get_int(const std::string& key) const;
  double get_double(const std::string& key) const;  // an integer value is taken too
  const std::string& get_string(const std::string& key) const;
  const std::vector<std::int64_t>& get_ints(const std::string& key) const;
  // The common options: name, trainable and dtype (each when present).
  LayerOptions layer_options() const;

  const std::map<std::string, ConfigValue>& values() const { return values_; }

 private:
  std::map<std::string, ConfigValue> values_;
};

// Makes a layer of one class from its config.
using LayerFactory = std::function<std::shared_ptr<Layer>(const Config&)>;

// Registers `factory` for layers whose class_name() is `class_name`. The built-in layers
// are registered already; registering a name twice throws ValueError.
void register_layer(const std::string& class_name, LayerFactory factory);
// The layer of class `class_name` made from `config`; ValueError naming the class and
// listing the registered ones when there is no such class. An error of the class's
// from_config keeps its type, its message prefixed with the layer's name and class (unless it
// names them already).
std::shared_ptr<Layer> layer_from_config(const std::string& class_name, const Config& config);
// The registered class names, sorted.
std::vector<std::string> registered_layers();

namespace detail {
// The default class_name() of T: its C++ name without namespaces.
std::string class_name_of(const std::type_info& type);
// Notes that layers of C++ type `type` are registered as `class_name`.
void note_registered_type(const std::type_info& type, const std::string& class_name);
// The name layers of C++ type `type` were registered under with MIXTAPE_REGISTER_LAYER(_AS);
// empty when they were not.
std::string registered_name_of(const std::type_info& type);
// The fields of `layer`'s built-in class (its positional arguments and options, derived from
// the class's row in the layer table, layers/layer_table.cpp) added to `config`; nothing for
// a class of your own. Layer::get_config calls it.
void add_builtin_config(const Layer& layer, Config& config);
template <typename T>
bool register_class(const std::string& class_name = class_name_of(typeid(T))) {
  register_layer(class_name,
                 [](const Config& c) -> std::shared_ptr<Layer> { return T::from_config(c); });
  note_registered_type(typeid(T), class_name);
  return true;
}
}  // namespace detail

}  // namespace mixtape::layers

#define MIXTAPE_REGISTER_LAYER_CONCAT_(a, b) a##b
#define MIXTAPE_REGISTER_LAYER_NAME_(line) \
  MIXTAPE_REGISTER_LAYER_CONCAT_(mixtape_registered_layer_, line)
// Registers a layer class T (with a static T::from_config(const Config&)) under its C++
// name without namespaces (the default class_name()), at namespace scope in one .cpp file of
// the program.
#define MIXTAPE_REGISTER_LAYER(T)                                             \
  [[maybe_unused]] static const bool MIXTAPE_REGISTER_LAYER_NAME_(__LINE__) = \
      ::mixtape::layers::detail::register_class<T>()
// The same under `class_name`: for a class whose class_name() returns that name.
#define MIXTAPE_REGISTER_LAYER_AS(T, class_name)                              \
  [[maybe_unused]] static const bool MIXTAPE_REGISTER_LAYER_NAME_(__LINE__) = \
      ::mixtape::layers::detail::register_class<T>(class_name)
