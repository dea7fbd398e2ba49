// Activations by name, for Dense(..., {.activation = "relu"}) and the Activation layer.
//
// linear (identity), relu, sigmoid, tanh, softmax, log_softmax (both over the last axis),
// gelu (exact). Each is a composition of differentiable ops.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "mixtape/core/tensor.h"

namespace mixtape::activations {

using ActivationFn = std::function<Tensor(const Tensor&)>;

// The activation called `name`; an unknown name throws ValueError listing valid_names().
ActivationFn get(std::string_view name);
std::string valid_names();

}  // namespace mixtape::activations
