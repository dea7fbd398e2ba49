// Helpers of the layers' constructors and weight accessors (layers/config.cpp); their configs
// come from mixtape/layers/options.h.
#pragma once

#include <string>

#include "mixtape/layers/config.h"
#include "mixtape/layers/initializers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"
#include "mixtape/layers/size2.h"

namespace mixtape::layers::detail {

// The fields every layer's options struct ends with (dtype, name, trainable), for Layer's
// constructor.
template <typename Options>
LayerOptions common_options(const Options& o) {
  return LayerOptions{o.dtype, o.name, o.trainable};
}
// `v`, or ValueError naming the layer and `what` when the layer is not built yet (the
// accessors of built layers' weights: DenseLayer::kernel(), ...).
const Variable& built_weight(const Layer& layer, const Variable& v, const char* what);
// The bias `b` of a built layer, or ValueError naming the layer when it has none
// (use_bias false) or is not built yet.
const Variable& built_bias(const Layer& layer, const Variable& b, bool use_bias);

}  // namespace mixtape::layers::detail
