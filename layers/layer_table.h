// The built-in layer classes, as op_table.h is for ops: each class's name in model files and
// the factory that makes it from its config. The registry (layers/registry.cpp) starts from
// it; a static library drops registrations in object files nothing refers to, so the
// built-in classes are listed here rather than registered next to each class. Adding a
// built-in layer: its header and .cpp, a row in layers/layer_table.cpp, an ONNX exporter
// (onnx_export/layers.cpp; onnx.layers fails without one).
#pragma once

#include <string_view>
#include <utility>
#include <vector>

#include "mixtape/layers/config.h"

namespace mixtape::layers {

const std::vector<std::pair<std::string_view, LayerFactory>>& builtin_layers();

}  // namespace mixtape::layers
