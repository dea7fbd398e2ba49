// Autocast scopes and the read of autocast Variables.
#include "mixtape/autograd/autocast.h"

#include <fmt/format.h>

#include <mutex>

#include "autograd/op_util.h"
#include "core/raw.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/error.h"
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

namespace {

// Which reads keep a copy: float32 variables read in a 16-bit dtype (the mixed policies'
// weights), the copies the optimizers' update kernels can write beside the update.
bool keeps_copy(DType from, DType to) {
  return from == kFloat32 && (to == kFloat16 || to == kBFloat16);
}

// Whether `c` is `v` rounded to `to` as v is now: made from v's storage, and nothing has
// written to that storage since (Storage::version counts every writer's access).
bool current(const VariableInfo::AutocastCopy& c, const Tensor& v, DType to) {
  return c.copy && c.copy->dtype == to && c.copy->shape == v.shape() &&
         c.source.lock() == v.storage() && v.storage()->version() == c.version;
}

}  // namespace

Tensor autocast(const Tensor& t) {
  if (!t_autocast || !t.is_variable() || !t.impl_ptr()->variable->autocast) return t;
  if (!t.dtype().is_floating() || t.dtype() == *t_autocast) return t;
  const DType to = *t_autocast;
  if (!keeps_copy(t.dtype(), to) || !t.is_contiguous()) return cast(t, to);
  detail::check_inputs("cast", {t});
  VariableInfo& info = *t.impl_ptr()->variable;
  Tensor copy;
  {
    std::lock_guard<std::mutex> lock(info.mutex);
    VariableInfo::AutocastCopy& kept = info.autocast_copy;
    if (current(kept, t, to)) {
      copy = Tensor(kept.copy);
    } else {
      copy = detail::cast_raw(t, to);
      // (The cast reads the variable through the read accessor: the version stays.)
      kept = {copy.impl_ptr(), t.storage(), t.storage()->version()};
    }
  }
  // Each read gets a tensor of its own (tapes tell tensors apart by identity) on the kept
  // data, recorded as the cast it stands for: the gradient goes back to the variable.
  return detail::record_cast(t, Tensor::view_of(copy, copy.shape(), copy.strides(), copy.offset()));
}

std::optional<DType> autocast_copy_dtype(const Tensor& variable) {
  if (!variable.is_variable()) return std::nullopt;
  VariableInfo& info = *variable.impl_ptr()->variable;
  if (!info.autocast) return std::nullopt;
  std::lock_guard<std::mutex> lock(info.mutex);
  if (!info.autocast_copy.copy) return std::nullopt;
  return info.autocast_copy.copy->dtype;
}

Tensor kept_autocast_copy(const Tensor& variable) {
  if (!variable.is_variable()) return Tensor();
  VariableInfo& info = *variable.impl_ptr()->variable;
  std::lock_guard<std::mutex> lock(info.mutex);
  if (!info.autocast_copy.copy) return Tensor();
  return Tensor(info.autocast_copy.copy);
}

void refresh_autocast_copy(const Tensor& variable, const Tensor& copy) {
  if (variable.is_variable() && copy.defined()) {
    VariableInfo& info = *variable.impl_ptr()->variable;
    std::lock_guard<std::mutex> lock(info.mutex);
    if (info.autocast_copy.copy == copy.impl_ptr() &&
        current(info.autocast_copy, variable, copy.dtype()))
      return;
  }
  if (copy.defined() && copy.shape() == variable.shape() && copy.is_contiguous() &&
      variable.is_contiguous() && copy.numel() > 0)
    find_kernel<kernels::CastFn>(OpId::cast, variable.device().type(), variable.dtype())(variable,
                                                                                         copy);
  keep_autocast_copy(variable, copy);  // throws when they do not fit
}

void keep_autocast_copy(const Tensor& variable, const Tensor& copy) {
  if (!variable.is_variable() || !copy.defined() || !keeps_copy(variable.dtype(), copy.dtype()) ||
      copy.shape() != variable.shape() || copy.device() != variable.device() ||
      !variable.is_contiguous())
    throw ValueError(
        fmt::format("keep_autocast_copy: a {}{} copy on {} does not fit {} (a contiguous float32 "
                    "variable and a float16 / bfloat16 copy of its shape on its device)",
                    copy.defined() ? copy.dtype().name() : "undefined",
                    copy.defined() ? fmt::format("{}", copy.shape()) : "",
                    copy.defined() ? copy.device().str() : "-",
                    variable.is_variable()
                        ? fmt::format("variable '{}' ({}{})", variable.impl_ptr()->variable->name,
                                      variable.dtype().name(), variable.shape())
                        : "a tensor that is not a variable"));
  VariableInfo& info = *variable.impl_ptr()->variable;
  std::lock_guard<std::mutex> lock(info.mutex);
  info.autocast_copy = {copy.impl_ptr(), variable.storage(), variable.storage()->version()};
}

}  // namespace mixtape
