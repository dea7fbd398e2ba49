// The table of built-in layer classes (layers/layer_table.h), and the get_config /
// from_config every row derives.
#include "layers/layer_table.h"

#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "mixtape/layers/builtin_layers.h"
#include "mixtape/layers/options.h"

namespace mixtape::layers {

namespace option_codec {

// RandomTranslation's factors: each as two numbers, "<key>_lower" and "<key>_upper".
void put(Config& c, const std::string& k, const TranslationFactor& v) {
  c.set(k + "_lower", v.lower);
  c.set(k + "_upper", v.upper);
}
void get(const Config& c, const std::string& k, TranslationFactor& v) {
  v = TranslationFactor(c.get_double(k + "_lower"), c.get_double(k + "_upper"));
}

}  // namespace option_codec

namespace {

// A positional argument of a layer's factory: the key it is saved under, and the layer's
// accessor that gives it back.
template <typename Get>
struct Arg {
  const char* key;
  Get get;
};
template <typename Get>
Arg<Get> arg(const char* key, Get get) {
  return {key, get};
}

// A positional argument read back from a config, as the factory takes it.
template <typename T>
T read_arg(const Config& c, const std::string& key) {
  T v{};
  option_codec::get(c, key, v);
  return v;
}

// The options a factory takes last: an options struct with its described fields, or the
// plain LayerOptions of a class that has no options of its own.
template <typename Options>
Options read_layer_options(const Config& c) {
  if constexpr (std::is_same_v<Options, LayerOptions>)
    return c.layer_options();
  else
    return read_options<Options>(c);
}

template <typename Options, typename L>
void write_layer_options(Config& c, const L& layer) {
  if constexpr (!std::is_same_v<Options, LayerOptions>) write_options(c, layer.options());
}

// The row of a class made by `factory` (positional arguments, then the options), with the
// accessors of those positional arguments in order.
template <typename L, typename... P, typename... Get>
LayerClass row(std::string_view name, LayerPtr<L> (*factory)(P...), Arg<Get>... args) {
  static_assert(sizeof...(P) == sizeof...(Get) + 1,
                "a layer factory takes its positional arguments, then its options");
  using Params = std::tuple<std::decay_t<P>...>;
  using Options = std::tuple_element_t<sizeof...(Get), Params>;
  LayerClass out{name, {}, {}};
  out.from_config = [factory, args...](const Config& c) -> std::shared_ptr<Layer> {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      const std::tuple<Arg<Get>...> keys{args...};
      return factory(read_arg<std::tuple_element_t<I, Params>>(c, std::get<I>(keys).key)...,
                     read_layer_options<Options>(c));
    }
    (std::index_sequence_for<Get...>{});
  };
  out.write_config = [args...](const Layer& layer, Config& c) {
    const auto* l = dynamic_cast<const L*>(&layer);
    if (!l) return false;
    (option_codec::put(c, args.key, (l->*args.get)()), ...);
    write_layer_options<Options>(c, *l);
    return true;
  };
  return out;
}

}  // namespace

const std::vector<LayerClass>& builtin_layers() {
  static const std::vector<LayerClass> table = {
      row("Dense", &Dense, arg("units", &DenseLayer::units)),
      row("Activation", &Activation, arg("activation", &ActivationLayer::activation)),
      row("Flatten", &Flatten),
      row("Reshape", &Reshape, arg("target_shape", &ReshapeLayer::target_shape)),
      row("Slice", &Slice, arg("axis", &SliceLayer::axis), arg("start", &SliceLayer::start)),
      row("Dropout", &Dropout, arg("rate", &DropoutLayer::rate)),
      row("Embedding", &Embedding, arg("input_dim", &EmbeddingLayer::input_dim),
          arg("output_dim", &EmbeddingLayer::output_dim)),
      row("Conv2D", &Conv2D, arg("filters", &Conv2DLayer::filters),
          arg("kernel_size", &Conv2DLayer::kernel_size)),
      row("MaxPooling2D", &MaxPooling2D),
      row("AveragePooling2D", &AveragePooling2D),
      row("GlobalAveragePooling2D", &GlobalAveragePooling2D),
      row("BatchNormalization", &BatchNormalization),
      row("LayerNormalization", &LayerNormalization),
      row("Add", &Add),
      row("Subtract", &Subtract),
      row("Multiply", &Multiply),
      row("Average", &Average),
      row("Maximum", &Maximum),
      row("Minimum", &Minimum),
      row("Concatenate", &Concatenate),
      row("Dot", &Dot, arg("axes", &DotLayer::axes)),
      row("MultiHeadAttention", &MultiHeadAttention,
          arg("num_heads", &MultiHeadAttentionLayer::num_heads),
          arg("key_dim", &MultiHeadAttentionLayer::key_dim)),
      row("PositionEmbedding", &PositionEmbedding,
          arg("sequence_length", &PositionEmbeddingLayer::sequence_length)),
      row("RandomTranslation", &RandomTranslation, arg("height", &RandomTranslationLayer::height),
          arg("width", &RandomTranslationLayer::width)),
      row("RandomFlip", &RandomFlip, arg("mode", &RandomFlipLayer::mode)),
  };
  return table;
}

}  // namespace mixtape::layers
