// Helpers of the layers' constructors, weight accessors and get_config / from_config
// (layers/config.cpp).
#pragma once

#include <string>

#include "mixtape/layers/config.h"
#include "mixtape/layers/initializers.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/size2.h"

namespace mixtape::layers::detail {

// The initializer named at `key`, or `fallback` when there is none or the name is not one
// init::get knows.
init::Initializer initializer_from(const Config& c, const std::string& key,
                                   init::Initializer fallback);
// The fields every layer's options struct ends with (dtype, name, trainable), for Layer's
// constructor.
template <typename Options>
LayerOptions common_options(const Options& o) {
  return LayerOptions{o.dtype, o.name, o.trainable};
}
// Sets the fields every layer's options struct ends with (dtype, name, trainable) from
// the config's common values.
template <typename Options>
void set_common_options(Options& options, const Config& c) {
  const LayerOptions common = c.layer_options();
  options.dtype = common.dtype;
  options.name = common.name;
  options.trainable = common.trainable;
}
// A Size2 stored as two integers.
Size2 size2_from(const Config& c, const std::string& key);
// `v`, or ValueError naming the layer and `what` when the layer is not built yet (the
// accessors of built layers' weights: DenseLayer::kernel(), ...).
const Variable& built_weight(const Layer& layer, const Variable& v, const char* what);

}  // namespace mixtape::layers::detail
