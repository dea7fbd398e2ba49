// Private helpers shared by the differentiable ops (autograd/ops_*.cpp).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/raw.h"
#include "mixtape/autograd/amp.h"
#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/kernels.h"

namespace mixtape::detail {

using Grads = std::vector<Tensor>;

// The tensors an op computes with: each input autocast (autocast.h), then rewritten by
// automatic mixed precision when it applies (amp.h: by the category of `op` in
// amp_lists()); the op is recorded in an active OpTraceScope. Every differentiable op whose
// AMP category in the op table is not "hidden" calls it first.
std::vector<Tensor> op_inputs(OpId op, std::vector<Tensor> inputs);
inline std::vector<Tensor> op_inputs(OpId op, std::initializer_list<Tensor> inputs) {
  return op_inputs(op, std::vector<Tensor>(inputs));
}

// True when a GradientTape of this thread is recording (defined in tape.cpp).
bool any_tape_recording();

// "float16[2, 3]" per tensor, for error messages.
std::string describe(const std::vector<Tensor>& ts);

// Throws a clear error unless every tensor is defined and on the same device.
void check_inputs(const char* op, const std::vector<Tensor>& ts);

// Throws a clear error unless the seed's tensor, when it has one, is one int64 element on x's
// device (mixtape/core/random_seed.h).
void check_seed(const char* op, const Tensor& x, const RandomSeed& seed);

// The kernel of `op` for the inputs' device and `dtype`, with the inputs described in
// the error when there is none.
template <typename Fn>
KernelRef<Fn> kernel_for(OpId op, DType dtype, const std::vector<Tensor>& inputs) {
  try {
    return find_kernel<Fn>(op, inputs.front().device().type(), dtype);
  } catch (const KernelNotFoundError& e) {
    throw KernelNotFoundError(fmt::format("{}; inputs: {}", e.what(), describe(inputs)));
  }
}

// The normalisation ops' (layer_norm, batch_norm) shared parts. x as the op computes with it
// (op_inputs), after the checks: defined, rank >= 1, floating, epsilon finite and >= 0. A
// per-column input p (gamma,
// beta, given statistics): undefined stays undefined; otherwise floating [n] (x's last extent;
// ShapeError naming the op, `what` and the shapes), returned in the compute type ct (a
// differentiable cast: a gradient goes back to p).
Tensor normalization_input(OpId op, const Tensor& x, double epsilon);
Tensor per_column_input(const char* op, const char* what, const Tensor& p, const Tensor& x,
                        std::int64_t n, DType ct);
// The gradients of (x, gamma, beta) for the inputs a normalisation op recorded: x, then gamma
// and beta when defined.
Grads normalization_grads(const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);

// Records y = cast(x, y.dtype()) on the active tapes (when both are floating) with `y`
// already computed, and returns it: cast() and the autocast read of a variable's kept copy.
Tensor record_cast(const Tensor& x, Tensor y);

// A view of `t` broadcast to `shape` (stride 0 on broadcast axes); no checks.
Tensor broadcast_view(const Tensor& t, const Shape& shape);
// A 0-d tensor holding `value` in `like`'s dtype and device.
Tensor scalar_like(double value, const Tensor& like);
// Sorted, unique, normalised axes (all axes when `axes` is empty).
std::vector<int> normalize_axes(const std::vector<int>& axes, std::size_t rank, const char* op);
// The shape with the given axes set to 1 (keepdims form) or removed.
Shape reduced_shape(const Shape& s, const std::vector<int>& axes, bool keepdims);

// The linear op's activations (autograd/ops_linear.cpp), shared with float8_linear: the enum
// of a name is_linear_activation() accepts (nullopt for any other), the activation as the
// composed ops apply it, and g act'(z) written with differentiable ops (a backward pass that a
// tape records).
std::optional<kernels::LinearActivation> linear_activation_of(std::string_view name);
// The same for an op's argument: a ValueError naming op and the activation for any other name.
kernels::LinearActivation checked_linear_activation(const char* op, std::string_view name);
// An op's bias argument for a product of n columns (x: the product's input, for the device
// check): undefined when bias is, else bias in dtype ct (a differentiable cast when it is not);
// a ShapeError naming op unless bias is a floating [n] on x's device.
Tensor checked_linear_bias(const char* op, const Tensor& x, const Tensor& bias, std::int64_t n,
                           DType ct);
// The bias as a product kernel with the linear op's epilogue takes it (kernels.h's LinearArgs):
// contiguous, in the output's dtype `out` (a float16 / bfloat16 output's bias rounded to it, as
// autocast reads a mixed policy's float32 variable), nothing recorded: the op records the bias
// it was given, whose gradient is the column sums in the compute type (the rounding's
// derivative taken as 1, as a cast's is). `given` (the caller's bias, undefined or of any
// floating dtype) is used as it is when it already has that dtype, and an autocast variable
// read under a scope of that dtype through the copy autocast keeps; undefined when bias is.
Tensor kernel_bias(const Tensor& given, const Tensor& bias, DType out);
Tensor apply_linear_activation(kernels::LinearActivation a, const Tensor& z);
Tensor differentiable_activation_grad(kernels::LinearActivation a, const Tensor& z,
                                      const Tensor& g);

}  // namespace mixtape::detail
