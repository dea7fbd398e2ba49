// Variable: a named tensor that holds state (weights, optimizer slots). Trainable
// Variables are watched by every GradientTape automatically. Copies of a Variable refer
// to the same variable; assign() and friends update it in place and are never recorded.
#pragma once

#include <string>

#include "mixtape/core/tensor.h"

namespace mixtape {

class Variable : public Tensor {
 public:
  Variable() = default;
  // Copies `initial_value` into new storage owned by the variable.
  explicit Variable(const Tensor& initial_value, std::string name = "variable",
                    bool trainable = true);
  // Takes over `initial_value`'s memory when nothing else refers to it (a contiguous tensor
  // of its own storage, as an initializer returns): a weight is then allocated once, not
  // twice. Copies it otherwise, as the constructor above does.
  explicit Variable(Tensor&& initial_value, std::string name = "variable", bool trainable = true);

  const std::string& name() const;
  bool trainable() const;
  void set_trainable(bool trainable);
  // Whether ops read the variable in the autocast dtype inside an AutocastScope
  // (mixtape/autograd/autocast.h). Off for new variables; layers turn it on for their
  // floating weights.
  bool autocast() const;
  void set_autocast(bool autocast);

  // The variable as a plain tensor (same data, same identity).
  const Tensor& value() const { return *this; }

  // In-place updates; `value` must have the variable's shape (or broadcast to it) and is
  // cast to the variable's dtype. Not recorded on tapes.
  void assign(const Tensor& value);
  void assign_add(const Tensor& delta);
  void assign_sub(const Tensor& delta);

  // Moves the variable's data to `device` in place: every copy of the variable (and every
  // tensor that is this variable) then lives there. Not recorded.
  void move_to(Device device);
};

}  // namespace mixtape
