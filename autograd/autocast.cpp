// Autocast scopes and the read of autocast Variables.
#include "mixtape/autograd/autocast.h"

#include "mixtape/autograd/ops.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

namespace {
thread_local std::optional<DType> t_autocast;
}  // namespace

AutocastScope::AutocastScope(std::optional<DType> dtype) : previous_(t_autocast) {
  t_autocast = dtype;
}
AutocastScope::~AutocastScope() { t_autocast = previous_; }

std::optional<DType> autocast_dtype() { return t_autocast; }

Tensor autocast(const Tensor& t) {
  if (!t_autocast || !t.is_variable() || !t.impl_ptr()->variable->autocast) return t;
  if (!t.dtype().is_floating() || t.dtype() == *t_autocast) return t;
  return cast(t, *t_autocast);
}

}  // namespace mixtape
