// The built-in layer classes, as op_table.h is for ops: one row per class, giving its name in
// model files, the factory that makes it, and its positional arguments (a key and the
// accessor that reads each back). A class's get_config and from_config are derived from its
// row and its options struct's field list (MIXTAPE_OPTIONS, mixtape/layers/options.h): no
// built-in class writes either by hand. The registry (layers/registry.cpp) starts from the
// table; a static library drops registrations in object files nothing refers to, so the
// built-in classes are listed here rather than registered next to each class.
//
// Adding a built-in layer: its header (listed in mixtape/layers/builtin_layers.h) and .cpp
// (the options struct with its MIXTAPE_OPTIONS list, and accessors for the positional
// arguments), a row in layers/layer_table.cpp, and an ONNX exporter (onnx_export/layers.cpp;
// onnx.layers fails without one).
#pragma once

#include <functional>
#include <string_view>
#include <vector>

#include "mixtape/layers/config.h"

namespace mixtape::layers {

struct LayerClass {
  std::string_view name;  // the class name in model files (class_name())
  LayerFactory from_config;
  // Writes the class's config beyond Layer's own fields (name, trainable, dtype) when
  // `layer` is of the row's C++ class (or derives from it); false when it is not.
  std::function<bool(const Layer& layer, Config& config)> write_config;
};

const std::vector<LayerClass>& builtin_layers();

}  // namespace mixtape::layers
