// Variable: named state updated in place.
#include "mixtape/autograd/variable.h"

#include "core/raw.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/backend.h"

namespace mixtape {

namespace {

Tensor copy_of(const Tensor& t) {
  Tensor copy = Tensor::empty(t.shape(), t.dtype(), t.device());
  if (copy.numel() > 0)
    find_kernel<kernels::CopyFn>(OpId::copy, copy.device().type(), copy.dtype())(t, copy);
  return copy;
}

// Whether `t` is the only reference to all of its storage: then a variable may take the
// memory instead of copying it (no other tensor can see the variable change).
bool sole_owner(const Tensor& t) {
  const TensorImpl& impl = *t.impl_ptr();
  return t.impl_ptr().use_count() == 1 && !impl.variable && impl.storage &&
         impl.storage.use_count() == 1 && impl.offset == 0 && t.is_contiguous() &&
         impl.storage->nbytes() == t.nbytes();
}

}  // namespace

Variable::Variable(const Tensor& initial_value, std::string name, bool trainable)
    : Variable(initial_value.defined() ? copy_of(initial_value) : Tensor(), std::move(name),
               trainable) {}

Variable::Variable(Tensor&& initial_value, std::string name, bool trainable) {
  if (!initial_value.defined())
    throw ValueError(fmt::format("Variable '{}': undefined initial value", name));
  Tensor owned = sole_owner(initial_value) ? std::move(initial_value) : copy_of(initial_value);
  // A new identity: a tape that saw the initial value does not see the variable.
  impl_ = Tensor::view_of(owned, owned.shape(), owned.strides(), 0).impl_ptr();
  auto info = std::make_shared<VariableInfo>();
  info->name = std::move(name);
  info->trainable = trainable;
  impl_->variable = std::move(info);
}

const std::string& Variable::name() const { return impl().variable->name; }
bool Variable::trainable() const { return impl().variable->trainable; }
void Variable::set_trainable(bool trainable) { impl().variable->trainable = trainable; }
bool Variable::autocast() const { return impl().variable->autocast; }
void Variable::set_autocast(bool autocast) { impl().variable->autocast = autocast; }

void Variable::assign(const Tensor& value) {
  if (!value.defined())
    throw ValueError(fmt::format("Variable '{}': assign of an undefined tensor", name()));
  if (value.device() != device())
    throw DeviceError(fmt::format("Variable '{}' on {}: assign from a tensor on {}", name(),
                                  device().str(), value.device().str()));
  Tensor v = detail::cast_raw(value, dtype());
  if (v.shape() != shape()) {
    broadcast_shapes(v.shape(), shape(), "Variable::assign");  // throws when incompatible
    if (broadcast_shapes(v.shape(), shape(), "Variable::assign") != shape())
      throw ShapeError(
          fmt::format("Variable::assign: value of shape {} does not fit variable '{}' "
                      "of shape {}",
                      value.shape().str(), name(), shape().str()));
    NoGradGuard no_grad;
    v = detail::contiguous_raw(mixtape::expand(v, shape()));
  }
  if (v.impl_ptr() == impl_) return;
  if (numel() > 0) find_kernel<kernels::CopyFn>(OpId::copy, device().type(), dtype())(v, *this);
}

void Variable::assign_add(const Tensor& delta) {
  NoGradGuard no_grad;
  assign(add(value(), cast(delta, dtype())));
}

void Variable::assign_sub(const Tensor& delta) {
  NoGradGuard no_grad;
  assign(sub(value(), cast(delta, dtype())));
}

void Variable::move_to(Device device) {
  if (device == this->device()) return;
  check_device(device);
  Tensor moved = detail::to_device_raw(detail::contiguous_raw(*this), device);
  impl_->storage = moved.storage();
  impl_->offset = moved.offset();
  impl_->strides = moved.strides();
}

}  // namespace mixtape
