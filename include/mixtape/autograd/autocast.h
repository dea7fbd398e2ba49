// Autocast: reading a layer's float32 weights in the layer's compute dtype.
//
// Under a mixed policy a layer stores its weights in float32 but computes in float16 or
// bfloat16 (Keras' AutoCastVariable). While an AutocastScope is alive, every op of the
// thread that reads an *autocast* Variable (Variable::set_autocast(true); layers'
// add_weight marks their floating weights so) reads it cast to the scope's dtype. The
// cast is an ordinary recorded op, so the gradient goes back to the variable in its own
// dtype (float32). Plain tensors and Variables without the flag are never touched, and an
// explicit cast() of a variable is left alone. Layers open the scope around call().
//
// A float32 variable read in float16 or bfloat16 keeps the rounded copy it was read as,
// until its data is touched again (any access through Storage::data() counts: kernels,
// assign(), collectives, a write through data_ptr()), so that reading it again costs no
// cast. The optimizers' update kernels write the next copy in the same pass as the update
// (keep_autocast_copy below), so in a training step the weights are not cast at all. The
// cost: a 16-bit copy of each such variable stays alive between steps (half the variable's
// memory).
#pragma once

#include <optional>

#include "mixtape/core/dtype.h"

namespace mixtape {

class Tensor;

// Sets the autocast dtype of this thread while alive (std::nullopt: no autocast), and
// restores the previous one. Scopes nest; the innermost wins.
class AutocastScope {
 public:
  explicit AutocastScope(std::optional<DType> dtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  std::optional<DType> previous_;
};

// The autocast dtype of this thread (std::nullopt outside any scope).
std::optional<DType> autocast_dtype();

// What an op reads for `t`: `t` cast to the autocast dtype when `t` is a floating autocast
// Variable of another dtype inside a scope, `t` itself otherwise.
Tensor autocast(const Tensor& t);

// The dtype of the copy `variable` keeps for reads under autocast (above), current or not;
// std::nullopt when it keeps none (never read so, or not an autocast variable). The
// optimizers ask, to write the next copy beside their update.
std::optional<DType> autocast_copy_dtype(const Tensor& variable);

// The copy `variable` keeps (current or not), or an undefined tensor when it keeps none: a
// captured step's update writes the next copy into it (mixtape/core/capture.h).
Tensor kept_autocast_copy(const Tensor& variable);

// Keeps `copy` as the copy of `variable` autocast reads (as keep_autocast_copy below), first
// casting the variable's values into it unless it is that copy already and current: before a
// captured step's replay, whose forward pass reads `copy`.
void refresh_autocast_copy(const Tensor& variable, const Tensor& copy);

// Keeps `copy` as the copy autocast reads for `variable`: it must hold the variable's
// values as they are now, rounded to copy's dtype (float16 or bfloat16; the variable
// float32, contiguous, on copy's device). Throws ValueError when they do not fit.
void keep_autocast_copy(const Tensor& variable, const Tensor& copy);

}  // namespace mixtape
