// Activations by name.
#include "mixtape/layers/activations.h"

#include "mixtape/autograd/ops.h"
#include "mixtape/core/error.h"

namespace mixtape::activations {

namespace {

struct Named {
  const char* name;
  Tensor (*fn)(const Tensor&);
};
const Named kActivations[] = {
    {"linear", [](const Tensor& x) { return x; }},
    {"relu", [](const Tensor& x) { return relu(x); }},
    {"sigmoid", [](const Tensor& x) { return sigmoid(x); }},
    {"tanh", [](const Tensor& x) { return tanh(x); }},
    {"softmax", [](const Tensor& x) { return softmax(x, -1); }},
    {"log_softmax", [](const Tensor& x) { return log_softmax(x, -1); }},
    {"gelu", [](const Tensor& x) { return gelu(x); }},
    {"gelu_tanh", [](const Tensor& x) { return gelu_tanh(x); }},  // gelu(approximate=True)
};

}  // namespace

ActivationFn get(std::string_view name) {
  for (const auto& a : kActivations)
    if (name == a.name) return a.fn;
  throw ValueError(fmt::format("unknown activation '{}'; valid names: {}", name, valid_names()));
}

std::string valid_names() {
  std::string out;
  for (const auto& a : kActivations) {
    if (!out.empty()) out += ", ";
    out += a.name;
  }
  return out;
}

}  // namespace mixtape::activations
