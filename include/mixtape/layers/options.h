// A layer's options described once: the options struct, and one list of its fields next to
// it. get_config and from_config (mixtape/layers/config.h) read the list instead of naming
// each field again, so a new option is one member and one word in the list.
//
//   struct ScaleOptions {
//     double factor = 1.0;
//     std::optional<std::uint64_t> seed = {};
//     MIXTAPE_LAYER_OPTIONS_TAIL;  // dtype, name, trainable: every layer's options end so
//   };
//   MIXTAPE_OPTIONS(ScaleOptions, factor, seed);
//
//   Config get_config() const override {
//     Config c = Layer::get_config();     // name, trainable, dtype
//     mt::layers::write_options(c, options_);
//     return c;
//   }
//   static LayerPtr<Scale> from_config(const Config& c) {
//     return make_layer<Scale>(mt::layers::read_options<ScaleOptions>(c));
//   }
//
// Each field is saved under its own name. Field types: bool, int, std::int64_t, double,
// std::string, Shape, std::vector<int>, Size2 (two integers), DType (its name),
// init::Initializer (its name), and std::optional of these or of std::uint64_t (left out of the
// config when empty). Reading back: a missing or mistyped key of a plain field throws ValueError
// naming it (the Config getters' errors); an optional field that is missing stays empty; an
// initializer that is missing or has no name init::get knows keeps the default (the weights of a
// file are loaded over it anyway).
#pragma once

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/core/dtype.h"
#include "mixtape/core/shape.h"
#include "mixtape/layers/config.h"
#include "mixtape/layers/initializers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/size2.h"

namespace mixtape::layers {

namespace detail {
// The initializer named at `key`, or `fallback` when there is none or the name is not one
// init::get knows.
init::Initializer initializer_from(const Config& c, const std::string& key,
                                   init::Initializer fallback);
// A Size2 stored as two integers.
Size2 size2_from(const Config& c, const std::string& key);
}  // namespace detail

namespace option_codec {

// One field's value into a config.
inline void put(Config& c, const std::string& k, bool v) { c.set(k, v); }
inline void put(Config& c, const std::string& k, int v) { c.set(k, v); }
inline void put(Config& c, const std::string& k, std::int64_t v) { c.set(k, v); }
inline void put(Config& c, const std::string& k, std::uint64_t v) {
  c.set(k, static_cast<std::int64_t>(v));
}
inline void put(Config& c, const std::string& k, double v) { c.set(k, v); }
inline void put(Config& c, const std::string& k, const std::string& v) { c.set(k, v); }
inline void put(Config& c, const std::string& k, const Shape& v) { c.set(k, v.dims()); }
inline void put(Config& c, const std::string& k, const std::vector<int>& v) {
  c.set(k, std::vector<std::int64_t>(v.begin(), v.end()));
}
inline void put(Config& c, const std::string& k, const Size2& v) {
  c.set(k, std::vector<std::int64_t>{v.h, v.w});
}
inline void put(Config& c, const std::string& k, DType v) { c.set(k, std::string(v.name())); }
inline void put(Config& c, const std::string& k, const init::Initializer& v) { c.set(k, v.name()); }
template <typename T>
void put(Config& c, const std::string& k, const std::optional<T>& v) {
  if (v) put(c, k, *v);
}

// And back into the field.
inline void get(const Config& c, const std::string& k, bool& v) { v = c.get_bool(k); }
void get(const Config& c, const std::string& k, int& v);  // ValueError outside int's range
inline void get(const Config& c, const std::string& k, std::int64_t& v) { v = c.get_int(k); }
inline void get(const Config& c, const std::string& k, std::uint64_t& v) {
  v = static_cast<std::uint64_t>(c.get_int(k));
}
inline void get(const Config& c, const std::string& k, double& v) { v = c.get_double(k); }
inline void get(const Config& c, const std::string& k, std::string& v) { v = c.get_string(k); }
inline void get(const Config& c, const std::string& k, Shape& v) { v = Shape(c.get_ints(k)); }
void get(const Config& c, const std::string& k, std::vector<int>& v);  // ValueError outside int
inline void get(const Config& c, const std::string& k, Size2& v) { v = detail::size2_from(c, k); }
inline void get(const Config& c, const std::string& k, DType& v) { v = DType(c.get_string(k)); }
inline void get(const Config& c, const std::string& k, init::Initializer& v) {
  v = detail::initializer_from(c, k, v);
}
template <typename T>
void get(const Config& c, const std::string& k, std::optional<T>& v) {
  if (!c.has(k)) {
    v.reset();
    return;
  }
  T value{};
  get(c, k, value);
  v = std::move(value);
}

}  // namespace option_codec

// Writes the described fields of `options` into `c` (MIXTAPE_OPTIONS' list).
template <typename Options>
void write_options(Config& c, const Options& options) {
  visit_options(options,
                [&](const char* key, const auto& value) { option_codec::put(c, key, value); });
}

// An options struct with its described fields, and the dtype, name and trainable every
// layer's options end with, read from `c`.
template <typename Options>
Options read_options(const Config& c) {
  Options options;
  visit_options(options, [&](const char* key, auto& value) { option_codec::get(c, key, value); });
  if constexpr (requires { options.trainable; }) {
    const LayerOptions common = c.layer_options();
    options.dtype = common.dtype;
    options.name = common.name;
    options.trainable = common.trainable;
  }
  return options;
}

}  // namespace mixtape::layers

// f(field) for each field (up to 16).
#define MIXTAPE_OPTIONS_EACH_1_(f, x) f(x)
#define MIXTAPE_OPTIONS_EACH_2_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_1_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_3_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_2_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_4_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_3_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_5_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_4_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_6_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_5_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_7_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_6_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_8_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_7_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_9_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_8_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_10_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_9_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_11_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_10_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_12_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_11_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_13_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_12_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_14_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_13_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_15_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_14_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_EACH_16_(f, x, ...) f(x) MIXTAPE_OPTIONS_EACH_15_(f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_PICK_(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, \
                              _16, name, ...)                                                   \
  name
#define MIXTAPE_OPTIONS_EACH_(f, ...)                                                              \
  MIXTAPE_OPTIONS_PICK_(__VA_ARGS__, MIXTAPE_OPTIONS_EACH_16_, MIXTAPE_OPTIONS_EACH_15_,           \
                        MIXTAPE_OPTIONS_EACH_14_, MIXTAPE_OPTIONS_EACH_13_,                        \
                        MIXTAPE_OPTIONS_EACH_12_, MIXTAPE_OPTIONS_EACH_11_,                        \
                        MIXTAPE_OPTIONS_EACH_10_, MIXTAPE_OPTIONS_EACH_9_,                         \
                        MIXTAPE_OPTIONS_EACH_8_, MIXTAPE_OPTIONS_EACH_7_, MIXTAPE_OPTIONS_EACH_6_, \
                        MIXTAPE_OPTIONS_EACH_5_, MIXTAPE_OPTIONS_EACH_4_, MIXTAPE_OPTIONS_EACH_3_, \
                        MIXTAPE_OPTIONS_EACH_2_, MIXTAPE_OPTIONS_EACH_1_)                          \
  (f, __VA_ARGS__)
#define MIXTAPE_OPTIONS_FIELD_(field) visit(#field, options.field);

// The described fields of an options struct, in the struct's namespace right after it: the
// config keys, in this order (see the top of this file). An options struct without fields of
// its own (only dtype, name, trainable) needs no list.
#define MIXTAPE_OPTIONS(Type, ...)                             \
  template <typename Visit>                                    \
  void visit_options(Type& options, Visit&& visit) {           \
    MIXTAPE_OPTIONS_EACH_(MIXTAPE_OPTIONS_FIELD_, __VA_ARGS__) \
  }                                                            \
  template <typename Visit>                                    \
  void visit_options(const Type& options, Visit&& visit) {     \
    MIXTAPE_OPTIONS_EACH_(MIXTAPE_OPTIONS_FIELD_, __VA_ARGS__) \
  }                                                            \
  static_assert(true, "MIXTAPE_OPTIONS ends with a semicolon")
