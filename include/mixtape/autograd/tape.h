// GradientTape: records differentiable ops while alive and computes gradients by
// walking the record backwards (iteratively, no recursion depth limit).
//
//   mt::GradientTape tape;                 // starts recording
//   auto y = mt::sum(x * w);               // w is a Variable: watched automatically
//   auto grads = tape.gradient(y, {w});    // one gradient per source
//
// A tape records an op when one of the op's inputs is watched by it: a trainable
// Variable, a tensor passed to watch(), or the output of an op it recorded. Several
// tapes may be alive at once (nested tapes); each records on its own, and an outer tape
// records the ops an inner tape's gradient() runs, so gradients of gradients work.
// Tapes belong to the thread that made them.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/autograd/variable.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

struct GradientTapeOptions {
  // A persistent tape allows several gradient() calls; otherwise the first consumes it.
  bool persistent = false;
  // Watch trainable Variables automatically (TF's watch_accessed_variables).
  bool watch_accessed_variables = true;
};

class GradientTape {
 public:
  GradientTape();
  explicit GradientTape(GradientTapeOptions options);
  ~GradientTape();
  GradientTape(const GradientTape&) = delete;
  GradientTape& operator=(const GradientTape&) = delete;

  // Records ops that use `t` (a tensor that is not a trainable Variable).
  void watch(const Tensor& t);
  void watch(const std::vector<Tensor>& ts);

  // d(target)/d(source) for each source; an undefined Tensor where the source is not
  // connected to the target. A non-scalar target needs `output_gradient` (the seed, of
  // the target's shape). Throws AutogradError when a non-persistent tape is reused. A
  // non-persistent tape releases each op's backward rule (and the tensors it saved) as soon
  // as the walk is past it, and is spent even when the call throws.
  std::vector<Tensor> gradient(const Tensor& target, const std::vector<Tensor>& sources,
                               const Tensor& output_gradient = Tensor());
  std::vector<Tensor> gradient(const Tensor& target, const std::vector<Variable>& sources,
                               const Tensor& output_gradient = Tensor());
  Tensor gradient(const Tensor& target, const Tensor& source,
                  const Tensor& output_gradient = Tensor());
  // Called with a source's index and its gradient as soon as the walk has passed the
  // source's last use (the gradient is final), while the walk goes on: what lets a
  // data-parallel step start reducing the last layers' gradients during the backward pass
  // of the first ones. Sources not connected to the target are reported, undefined, at
  // the end; every source is reported once.
  using GradientReadyFn = std::function<void(std::size_t source, const Tensor& gradient)>;
  std::vector<Tensor> gradient(const Tensor& target, const std::vector<Variable>& sources,
                               const GradientReadyFn& on_ready);

  bool persistent() const;
  // Number of ops recorded so far.
  std::size_t size() const;
  // Forgets everything recorded (and watched) so far; the tape goes on recording.
  void reset();

  struct Impl;

 private:
  std::vector<Tensor> walk(const Tensor& target, const std::vector<Tensor>& sources,
                           const Tensor& output_gradient, const GradientReadyFn* on_ready);
  std::shared_ptr<Impl> impl_;
};

// While alive, no tape of this thread records anything (like torch.no_grad or
// tape.stop_recording()).
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// --- Recording a differentiable op (for op authors; see docs/extending.md) ----------

// The backward rule of a single-output op: given the gradient of the output and which
// inputs need a gradient, returns one gradient per input (undefined where not needed or
// not differentiable). Gradients have the shape and dtype of their input. The rule
// composes differentiable ops, so it can itself be recorded by an outer tape.
using BackwardFn = std::function<std::vector<Tensor>(const Tensor& grad_output,
                                                     const std::vector<bool>& needs_grad)>;

// True when some active tape of this thread would record an op with these inputs.
bool should_record(const std::vector<Tensor>& inputs);
// Records the op `name` on every active tape that watches one of `inputs`. Call it
// after the forward computation; capture in `backward` only what the rule needs.
void record_op(const char* name, const std::vector<Tensor>& inputs, const Tensor& output,
               BackwardFn backward);

}  // namespace mixtape
