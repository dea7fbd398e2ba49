// The kernel ABI: the signature of each op's kernel in the dispatch table, and the
// contract a backend kernel must meet. Ops (mixtape/autograd/ops.h) validate shapes
// and dtypes, allocate outputs and prepare inputs before calling a kernel, so kernels
// check nothing. A kernel is registered per dtype (the dtype named below as "keyed on");
// reduced-precision kernels (float16, bfloat16) load 16-bit values, compute and
// accumulate in float32 and store 16-bit results, except where a matmul / conv2d call
// sets low_precision_accumulation (the MIXTAPE_FP16_USE_FP32_COMPUTE switch,
// mixtape/core/compute_mode.h). A kernel reads its inputs through const_data_ptr() and
// writes its outputs through data_ptr(): only the writer's access advances a storage's
// version (mixtape/core/storage.h), which keeps a variable's autocast copy current.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/host_device.h"
#include "mixtape/core/tensor.h"

namespace mixtape::kernels {

// The "signature" of the op table's ops that have no kernel of their own (views,
// compositions); nothing is registered with it.
using NoKernel = void();

// copy: src (any strides) -> dst (contiguous), same shape and dtype. Keyed on the dtype.
using CopyFn = void(const Tensor& src, const Tensor& dst);
// fill: every element of out (contiguous) = value. Keyed on out's dtype.
using FillFn = void(const Tensor& out, double value);
// cast: x (contiguous) -> out (contiguous, same shape, any dtype). Keyed on x's dtype.
// Floating -> integer truncates toward zero; anything -> bool is (x != 0).
using CastFn = void(const Tensor& x, const Tensor& out);

// Unary elementwise (neg ... erf): x and out contiguous, same shape and dtype.
// gelu is the exact form x * Phi(x) (Keras' default, approximate=False).
using UnaryFn = void(const Tensor& x, const Tensor& out);

// Binary elementwise (add ... pow, eq ... ge): a and b have the dtype the kernel is keyed
// on and out's shape, possibly through broadcast views (stride 0 on broadcast axes);
// out is contiguous. Arithmetic outputs have the inputs' dtype, comparisons bool.
using BinaryFn = void(const Tensor& a, const Tensor& b, const Tensor& out);

// relu_backward (a BinaryFn): out = a > 0 ? b : 0, with a the relu's output and b the
// gradient of that output, in one pass.
// gelu_backward (a BinaryFn): out = b (Phi(a) + a phi(a)), the gradient through the exact
// gelu with a its input and b the gradient of its output, computed in (at least) float32
// and rounded once; a phi(a) counts as 0 where |a| >= 64 (so +-inf give b and 0).

// where: out = cond ? a : b. cond is bool; cond, a, b are views of out's shape (strides
// may be 0); out contiguous. Keyed on a's dtype.
using WhereFn = void(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out);

// Reductions (sum, mean, max, min, argmax) over the middle extent of x viewed as
// [outer, n, inner] (x contiguous); out is contiguous with outer*inner elements, in x's
// dtype (argmax: int64, the first index of the maximum). Accumulation is at least float32
// for float32 and the reduced floats (the CPU backend uses float64), float64 for
// float64. Keyed on x's dtype. n >= 1.
using ReduceFn = void(const Tensor& x, std::int64_t outer, std::int64_t n, std::int64_t inner,
                      const Tensor& out);

// softmax / log_softmax over the last axis; x and out contiguous, same shape and dtype;
// numerically stable (the row maximum is subtracted first).
using RowFn = void(const Tensor& x, const Tensor& out);

// masked_softmax over the last axis (attention weights): out = softmax(scale * x) over the
// positions where mask is true, 0 where it is false; a row with no true position is all 0.
// x and out contiguous, same shape and dtype; mask contiguous bool of x's shape, or
// undefined (nothing masked). Computed in float32 (float64 for float64), the row maximum
// subtracted first; masked values are never read (a NaN there changes nothing).
using MaskedSoftmaxFn = void(const Tensor& x, const Tensor& mask, double scale, const Tensor& out);
// attention, fused: for each of n heads (q [n, t, d], k [n, s, d], v [n, s, dv], of one
// dtype), out [n, t, dv] (that dtype) = P v with P = the softmax over each row of scale * q
// k^T, over the keys the row attends, and lse [n, t] (contiguous) the log-sum-exp of those
// scaled logits (float64 for float64, float32 otherwise; -inf, and an output row of 0, for a
// row that attends nothing). q, k, v and out (and the backward pass's dout, dq, dk and dv) are
// each [n, rows, width] contiguous or a view [n1, n2, rows, width] with n1 n2 = n, any strides
// on its first three axes and stride 1 along the last, head h being [h / n2, h % n2]
// (mixtape/core/head_rows.h): the heads of a [batch, positions, heads, width] projection are
// read and written where they lie. Outputs overlap nothing. Row i of head h attends key j when
// the mask keeps it (nonzero: attend) and, when causal, j <= i. The mask is undefined or a
// bool view [n1, n2, t, s] of the same kind (strides 0 where it is broadcast: a key-padding
// mask [batch, 1, 1, s] is read as it is, never made [n, t, s]). No [t, s] matrix needs to be
// made: the kernels work in tiles with an online softmax (FlashAttention-2).
// Dropout on the weights (dropout.rate in (0, 1)): out = (P o Z) v with Z_hij = 1 / (1 - rate)
// where dropout_keeps(seed, (h t + i) s + j, dropout_threshold(rate)) (mixtape/core/
// dropout_hash.h) and 0 elsewhere; lse stays P's. The backward pass finds Z again: dV =
// (P o Z)^T dout, dS = P o (Z o (dout v^T) - D), D as below (from the dropped out). The seed is
// `seed`, or when seed_at is defined the bits of its one int64 element (on the kernel's device,
// read when the kernel runs: a captured step's replays write a new seed there before each).
struct AttentionDropout {
  double rate = 0.0;  // 0: none
  std::uint64_t seed = 0;
  Tensor seed_at;
};
// dropout: out[i] = x[i] * Z_i for each element i (its row-major position), Z_i = 1 / (1 -
// rate) where dropout_keeps(seed, i, dropout_threshold(rate)) (mixtape/core/dropout_hash.h) and
// 0 elsewhere, rate in (0, 1): the product in the compute type (float32; float64 for float64)
// with Z in it, rounded once. x and out contiguous, same shape and dtype. The seed as
// AttentionDropout's: `seed`, or seed_at's element when it is defined. Z of [n, t, s] weights
// is the fused attention's Z (the same positions, the same hash), and the backward pass of the
// op is the same kernel on the gradient.
using DropoutFn = void(const Tensor& x, double rate, std::uint64_t seed, const Tensor& seed_at,
                       const Tensor& out);
using AttentionFn = void(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask,
                         bool causal, double scale, const AttentionDropout& dropout,
                         const Tensor& out, const Tensor& lse);
// attention_backward: from the forward's inputs, out and lse and the gradient of out
// (dout [n, t, dv]), writes dq, dk and dv (the inputs' shapes and dtype): P recomputed from
// the logits and lse, dP = dout v^T, dS = P (dP - D) with D_i = sum_c dout[i, c] out[i, c]
// (the out given), dq = scale dS k, dk = scale dS^T q, dv = P^T dout.
// softmax_cross_entropy: for each row i of logits [n, c] (contiguous, the op's dtype) and its
// class labels[i] (int64 [n], in [0, c): the op checks host labels; a kernel given one outside
// writes NaN for that row), lse[i] = log(sum_j exp(logits[i, j])) and loss[i] = lse[i] -
// logits[i, labels[i]], both [n] in the compute type (float32; float64 for float64). No
// probabilities are kept.
using SoftmaxCrossEntropyFn = void(const Tensor& logits, const Tensor& labels, const Tensor& loss,
                                   const Tensor& lse);
// softmax_cross_entropy_backward: dlogits [n, c] (the logits' dtype) = dloss[i] (softmax -
// one_hot(labels))[i, j], the softmax recomputed from lse; dloss [n] in the compute type.
using SoftmaxCrossEntropyBackwardFn = void(const Tensor& logits, const Tensor& labels,
                                           const Tensor& lse, const Tensor& dloss,
                                           const Tensor& dlogits);
// layer_norm over the last axis, one pass per row: x [rows, n] contiguous (the op's dtype),
// gamma and beta [n] in the compute type (float32; float64 for float64), either undefined
// (1 and 0); out [rows, n] (x's dtype) = (x - mean) * rstd * gamma + beta, rounded once, with
// each row's mean and rstd = 1 / sqrt(var + epsilon) (biased variance) in the compute type,
// written to mean and rstd [rows].
using LayerNormFn = void(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon,
                         const Tensor& out, const Tensor& mean, const Tensor& rstd);
// layer_norm_backward: from dy [rows, n] (x's dtype) and the forward's mean and rstd, dx
// (x's dtype) = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gamma and xhat = (x - mean)
// rstd, and, when defined, dgamma = sum over rows of dy xhat and dbeta = sum of dy ([n],
// the compute type), summed in an order that does not depend on the number of threads.
using LayerNormBackwardFn = void(const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                 const Tensor& rstd, const Tensor& dy, const Tensor& dx,
                                 const Tensor& dgamma, const Tensor& dbeta);
// batch_norm over the rows: x [rows, n] contiguous (the op's dtype), gamma and beta [n] in the
// compute type (float32; float64 for float64), either undefined (1 and 0); mean and var [n]
// (the compute type): written with each column's mean and biased variance over the rows
// (given false; rows >= 1), or read (given: the moving statistics of inference). out [rows, n]
// (x's dtype) = (x - mean) * rstd * gamma + beta, rounded once, with rstd = 1 / sqrt(var +
// epsilon) computed in float64 from var and rounded once. The sums in float64, in an order that
// does not depend on the number of threads.
using BatchNormFn = void(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon,
                         bool given, const Tensor& out, const Tensor& mean, const Tensor& var);
// batch_norm_backward: from dy [rows, n] (x's dtype) and the forward's mean and var (rstd
// found again as the forward finds it), dx (x's dtype) = gamma rstd (dy - mean(dy) - xhat
// mean(dy xhat)) with xhat = (x - mean) rstd and the means over the rows (given: the statistics
// were given, not the batch's, and dx = gamma rstd dy), and, when defined, dgamma = sum over the
// rows of dy xhat and dbeta = sum of dy ([n], the compute type).
using BatchNormBackwardFn = void(const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                 const Tensor& var, double epsilon, bool given, const Tensor& dy,
                                 const Tensor& dx, const Tensor& dgamma, const Tensor& dbeta);
using AttentionBackwardFn = void(const Tensor& q, const Tensor& k, const Tensor& v,
                                 const Tensor& mask, bool causal, double scale,
                                 const AttentionDropout& dropout, const Tensor& out,
                                 const Tensor& lse, const Tensor& dout, const Tensor& dq,
                                 const Tensor& dk, const Tensor& dv);

// gather: x viewed as [outer, n, inner] (contiguous); index (int64, contiguous) and out
// (contiguous, x's dtype) viewed as [outer, k, inner]:
//   out[o, j, i] = x[o, index[o, j, i], i].
// scatter_add: the adjoint; out viewed as [outer, n, inner] (contiguous, accumulated
// into, not cleared) and src as [outer, k, inner]:
//   out[o, index[o, j, i], i] += src[o, j, i].
// Indices are in range (the op checks). Keyed on x's / src's dtype.
using GatherFn = void(const Tensor& x, const Tensor& index, std::int64_t outer, std::int64_t n,
                      std::int64_t k, std::int64_t inner, const Tensor& out);
using ScatterAddFn = void(const Tensor& src, const Tensor& index, std::int64_t outer,
                          std::int64_t n, std::int64_t k, std::int64_t inner, const Tensor& out);

// matmul: for each batch index b, out[b] = op(a[b]) x op(b[b]) where op transposes when
// the flag says so. Matrices are row-major with leading dimensions lda/ldb/ldc; a batch
// stride of 0 reuses the same matrix. out is written (beta = 0). Keyed on the dtype of
// a, b and out (all equal).
struct GemmArgs {
  Tensor a, b, out;  // data_ptr() is the first matrix
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool trans_a = false, trans_b = false;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements between batch items
  // For float16 / bfloat16 kernels: accumulate in the operands' 16-bit type (the
  // accumulator is rounded to that type after every multiply-add) instead of float32.
  // Ignored for float32 / float64.
  bool low_precision_accumulation = false;
};
using GemmFn = void(const GemmArgs& args);

// The activation a linear op applies after its product and bias.
//   none       act(z) = z
//   relu       max(z, 0) (NaN and -0 stay), relu's functor
//   gelu       z Phi(z), the exact form (gelu's functor)
//   gelu_tanh  its tanh approximation (gelu_tanh's functor)
enum class LinearActivation : std::uint8_t { none, relu, gelu, gelu_tanh };
// f.template operator()<A>() with the activation as a template argument, for kernels that
// specialise on it.
template <typename F>
void with_linear_activation(LinearActivation a, F&& f) {
  switch (a) {
    case LinearActivation::none:
      return f.template operator()<LinearActivation::none>();
    case LinearActivation::relu:
      return f.template operator()<LinearActivation::relu>();
    case LinearActivation::gelu:
      return f.template operator()<LinearActivation::gelu>();
    case LinearActivation::gelu_tanh:
      return f.template operator()<LinearActivation::gelu_tanh>();
  }
}

// scaled_matmul: FP8 operands a [m, k] and b_t [n, k] (contiguous, k innermost in both: the
// second operand is given transposed, the layout Hopper's FP8 tensor-core GEMMs take), a of
// the kernel's float8 dtype, b_t of either (not both float8_e5m2); their dequantisation
// scales scale_a and scale_b (float32, one element each, on the device: a's value is
// a * scale_a). out [m, n] (float32, bfloat16 or float16) = (scale_a * scale_b) *
// sum_k a[i, k] b_t[j, k], each product exact, the sum accumulated in float32 (the order is
// the kernel's), rounded once to out's dtype. fast_accumulation lets a GPU kernel use the
// tensor cores' faster, less precise accumulation (Hopper's FP8 "fast accum"; gradients keep
// it off); the CPU kernel ignores it.
// Optionally the linear op's epilogue: with a bias ([n] in out's dtype, contiguous, as
// LinearArgs's) and / or an activation, out = act(product + bias), the scaled product and the
// sum in float32, rounded once to out's dtype (a GPU kernel may round the pre-activation to
// out's dtype before the activation, as LinearArgs allows); pre (undefined, or [m, n] in out's
// dtype) receives z = product + bias rounded to out's dtype, what linear_backward reads for
// gelu and gelu_tanh.
struct ScaledMatmulArgs {
  Tensor a, b_t, scale_a, scale_b, out;
  std::int64_t m = 0, n = 0, k = 0;
  bool fast_accumulation = false;
  Tensor bias{}, pre{};
  LinearActivation activation = LinearActivation::none;
  bool has_epilogue() const {
    return bias.defined() || pre.defined() || activation != LinearActivation::none;
  }
};
using ScaledMatmulFn = void(const ScaledMatmulArgs& args);

// quantize_float8: x (the kernel's dtype, contiguous, rows * cols elements) quantised to a
// float8 dtype with one float32 scale for the whole tensor, in three steps that read and
// write only the device:
//   amax      = max |float32(x)| (NaN when x holds one; 0 for an empty x);
//   reference = the largest element of `history` when that is > 0, else amax (current
//               scaling: no history, reference = amax);
//   factor    = float32(max_of(format) / 2^margin) / reference, or 1 when reference is not
//               > 0 (zero or NaN);
//   data      = float8(float32(x) * factor) (the product rounded to float32, then to the
//               format: nearest even, saturating), written to `data` (x's layout) and / or
//               `data_t` (its transpose [cols, rows]), whichever is defined;
//   scale     = 1 / factor (float32 division), amax as above (float32, one element each);
//   with `update`, history becomes [amax, history[0], ..., history[length - 2]] after its
//   largest element was read.
struct QuantizeFloat8Args {
  Tensor x;
  Tensor data, data_t;  // float8_e4m3fn or float8_e5m2 (the same), either may be undefined
  Tensor scale, amax;   // float32, one element each
  Tensor history;       // float32 [length], contiguous, or undefined (current scaling)
  std::int64_t rows = 0, cols = 0;
  int margin = 0;
  bool update = false;
};
using QuantizeFloat8Fn = void(const QuantizeFloat8Args& args);

// linear, fused: out [m, n] = act(x [m, k] w [k, n] + bias [n]), x, w and bias (undefined:
// none) contiguous, of the dtype the kernel is keyed on: a float16 / bfloat16 product takes its
// bias in that dtype, as a mixed policy's layer reads a float32 variable (autocast) and as
// cuBLASLt's epilogues take it. The product accumulates in the compute type (float32; float64
// for float64); the bias's value is added to that sum, the activation applied, and out rounded
// once (a GPU kernel may round the pre-activation to out's dtype before the activation:
// cuBLASLt's epilogues do). pre (undefined, or [m, n] in out's dtype) receives z = x w + bias,
// what the backward pass of gelu and gelu_tanh reads. m, n, k >= 1.
struct LinearArgs {
  Tensor x, w, bias, out, pre;
  LinearActivation activation = LinearActivation::none;
};
using LinearFn = void(const LinearArgs& args);
// linear_backward: from dy [m, n] (the output's gradient, x's dtype, contiguous) and the saved
// tensor (gelu, gelu_tanh: the forward's pre; relu: its out, whose sign is z's; none:
// undefined), dz [m, n] = dy act'(z) in x's dtype (computed in the compute type, rounded once;
// undefined for none, whose dz is dy), and, when defined, dbias [n] (the compute type) = the
// column sums of dz before rounding, summed in an order that does not depend on the number of
// threads. relu' is 1 where out > 0 and 0 elsewhere; gelu' is gelu_backward's.
struct LinearBackwardArgs {
  Tensor dy, saved, dz, dbias;
  LinearActivation activation = LinearActivation::none;
};
using LinearBackwardFn = void(const LinearBackwardArgs& args);

// 2-D convolution, NHWC input [n, h, w, c], HWIO filter [kh, kw, c, cout], output
// [n, oh, ow, cout], all contiguous. Padding is pad_top/pad_left zeros (the bottom/right
// padding is implied by the output size). Backward kernels overwrite their output.
struct Conv2dGeometry {
  std::int64_t n = 0, h = 0, w = 0, c = 0;
  std::int64_t kh = 0, kw = 0, cout = 0;
  std::int64_t oh = 0, ow = 0;
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t pad_top = 0, pad_left = 0;
  // For float16 / bfloat16 kernels (forward and both backward): accumulate in the
  // operands' 16-bit type (the accumulator is rounded to that type after every
  // multiply-add) instead of float32. Ignored for float32 / float64.
  bool low_precision_accumulation = false;
};
// The forward pass with an optional bias (bias: [cout] of out's dtype, or an undefined
// Tensor for none): out = conv(x, w) + bias, the bias added to the accumulator before the
// result is stored (float32 for float16 / bfloat16: rounded once, as oneDNN and cuDNN's
// fused forms do), or under low_precision_accumulation as the last term, rounded like the
// others.
using Conv2dFn = void(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                      const Conv2dGeometry& g);
using Conv2dBackwardInputFn = void(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                                   const Conv2dGeometry& g);
using Conv2dBackwardWeightFn = void(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                                    const Conv2dGeometry& g);

// Pooling over NHWC windows; out [n, oh, ow, c]. Padded positions are ignored: they never
// win a max and are not counted in an average. Backward kernels overwrite grad_x.
struct Pool2dGeometry {
  std::int64_t n = 0, h = 0, w = 0, c = 0;
  std::int64_t kh = 0, kw = 0;
  std::int64_t oh = 0, ow = 0;
  std::int64_t stride_h = 1, stride_w = 1;
  std::int64_t pad_top = 0, pad_left = 0;
};
using Pool2dFn = void(const Tensor& x, const Tensor& out, const Pool2dGeometry& g);
// max: the gradient goes to the first maximum of each window; avg ignores x's values.
using Pool2dBackwardFn = void(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                              const Pool2dGeometry& g);

// take: whole rows along one axis (numpy's take / index_select). x viewed as
// [outer, n, inner] (contiguous), index a contiguous int64 vector of k entries in [0, n),
// out [outer, k, inner] (contiguous, x's dtype): out[o, j, :] = x[o, index[j], :].
// index_add: the adjoint; out viewed as [outer, n, inner] (contiguous, accumulated into,
// not cleared), src as [outer, k, inner]: out[o, index[j], :] += src[o, j, :], in the
// order of j (repeated indices add up; the CUDA kernels add with atomics, in no fixed order:
// a row that several j reach may differ in its last bits from run to run). Keyed on x's /
// src's dtype.
using TakeFn = void(const Tensor& x, const Tensor& index, std::int64_t outer, std::int64_t n,
                    std::int64_t k, std::int64_t inner, const Tensor& out);
using IndexAddFn = void(const Tensor& src, const Tensor& index, std::int64_t outer, std::int64_t n,
                        std::int64_t k, std::int64_t inner, const Tensor& out);

// unscale_check: for each i, outs[i] = grads[i] * scale (when outs[i] is defined; the
// same shape and dtype, contiguous, may be grads[i] itself) in the same pass that looks
// for non-finite values in grads[i]; when one is found, found_nonfinite (a float32 scalar
// on the same device) is set to 1 (it is never cleared, so several calls accumulate).
// Every grads[i] is contiguous and has the dtype the kernel is keyed on. Loss scaling
// unscales all gradients with one call per dtype and reads the flag once.
// scale_on_device, when defined, is a float64 scalar on the gradients' device that the
// kernel reads there, when it runs, in place of `scale` (the same arithmetic, bit for bit):
// a loss scale kept on the device (loss_scale_update) is never read back by the host.
using UnscaleCheckFn = void(const std::vector<Tensor>& grads, const std::vector<Tensor>& outs,
                            double scale, const Tensor& scale_on_device,
                            const Tensor& found_nonfinite);

// The rule of a dynamic loss scale (mixtape/precision/loss_scale.h), written once for the
// LossScaleOptimizer's host copy and for loss_scale_update on every backend, so that the
// two move alike, bit for bit. After a step whose gradients were not finite: good_steps
// restarts and a dynamic scale is divided by the multiplier, not below min_scale. After a
// finite step, for a dynamic scale: one more good step, and at growth_interval of them the
// scale is multiplied, not beyond max_scale, and the count restarts. A fixed scale never
// moves. Count: the host's int64 or the device's float64 (exact to 2^53).
struct LossScaleRule {
  bool dynamic = true;
  double multiplier = 2.0, min_scale = 1.0, max_scale = 0.0;
  std::int64_t growth_interval = 2000;
};
template <typename Count>
MIXTAPE_HOST_DEVICE inline void move_loss_scale(bool nonfinite, const LossScaleRule& rule,
                                                double& scale, Count& good_steps) {
  if (nonfinite) {
    good_steps = 0;
    if (rule.dynamic) {
      const double lower = scale / rule.multiplier;
      scale = lower < rule.min_scale ? rule.min_scale : lower;
    }
    return;
  }
  if (!rule.dynamic) return;
  good_steps = good_steps + 1;
  if (good_steps >= static_cast<Count>(rule.growth_interval)) {
    const double higher = scale * rule.multiplier;
    scale = higher > rule.max_scale ? rule.max_scale : higher;
    good_steps = 0;
  }
}

// loss_scale_update: a loss scale kept on the device moved after a step decided there.
// found_nonfinite is the step's flag (unscale_check's, a float32 scalar); scale, inverse
// and good_steps are float64 scalars on its device, updated in place: move_loss_scale with
// nonfinite = (flag != 0), then inverse = 1 / scale. The LossScaleOptimizer queues it
// behind the step's updates, so the next step's get_scaled_loss and get_unscaled_gradients
// read their scale on the device instead of waiting for the host to read the flag. Keyed
// on float64 (the state's dtype).
using LossScaleUpdateFn = void(const Tensor& found_nonfinite, const Tensor& scale,
                               const Tensor& inverse, const Tensor& good_steps,
                               const LossScaleRule& rule);

// sum_squares: out (a float64 scalar on xs' device, added to, not cleared) += the sum over
// every xs[i] (contiguous, the dtype the kernel is keyed on) of its elements squared, each
// widened to float64 (exact: the square of a float32 value is exact in float64), the squares
// summed in float64 in an order fixed by the sizes alone (the same bits on every run, however
// many threads). One call per dtype gives global-norm clipping its norm in one pass over all
// gradients, with no host read.
using SumSquaresFn = void(const std::vector<Tensor>& xs, const Tensor& out);
// scale_list: for each i, outs[i] = xs[i] * factor (contiguous, the same shape and the dtype
// the kernel is keyed on; outs[i] may be xs[i]), factor a float64 scalar on their device, read
// there: rounded to the compute type (float32; float64 for float64), the product in it, rounded
// once to the dtype. Global-norm clipping's scaling of every gradient in one call per dtype.
using ScaleListFn = void(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs,
                         const Tensor& factor);

// cast_list: for each i, outs[i] = xs[i] widened exactly to outs' dtype (float32 or float64,
// one for the whole call, at least as wide as xs' dtype, the one the kernel is keyed on;
// contiguous, the same shapes). The tape's backward pass widens the gradients of every
// variable read through a 16-bit copy (autocast) with one call per dtype pair instead of a
// cast each.
using CastListFn = void(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs);

// Optimizer updates, in place, for a list of variables in one call (on a GPU, a launch per
// few dozen variables instead of one each): every OptimizerUpdate of a call has the same
// variable dtype (the one the kernel is keyed on), device, scalars (lr ... amsgrad, step),
// skip_if and rates; each is applied as described here. var and grad are contiguous, same shape
// and dtype (the dtype the kernel is keyed on); the slots are contiguous tensors of var's
// shape in the slot dtype: float64 for float64 variables, float32 for every other
// (float16 / bfloat16 variables keep float32 state). var, grad and the slots are distinct
// tensors whose memory does not overlap (the CPU kernels' loops assume it). The math runs in
// the slot dtype and the variable is rounded once when stored. step is the 1-based count of
// applied steps including this one.
//   sgd_update (Keras SGD): momentum == 0: var -= lr * g. Otherwise, slot1 the velocity:
//     v = momentum * v - lr * g; var += v, or with nesterov var += momentum * v - lr * g.
//   rmsprop_update (Keras RMSprop): slot1 = mean square, slot2 = momentum buffer (when
//     momentum > 0), slot3 = mean gradient (when centered):
//     ms = rho * ms + (1 - rho) g^2; [mg = rho * mg + (1 - rho) g; d = ms - mg^2 | d = ms]
//     step = lr * g / sqrt(d + epsilon) (Keras / TensorFlow put epsilon inside the root);
//     momentum: mom = momentum * mom + step,
//     var -= mom; otherwise var -= step. (rho is passed as beta2.)
//   adam_update (Keras Adam / AdamW): slot1 = m, slot2 = v, slot3 = max v (amsgrad):
//     var -= lr * weight_decay * var (AdamW; weight_decay 0 for Adam);
//     m += (g - m)(1 - beta1); v += (g^2 - v)(1 - beta2); [vmax = max(vmax, v)]
//     alpha = lr sqrt(1 - beta2^step) / (1 - beta1^step);
//     var -= alpha * m / (sqrt(v | vmax) + epsilon).
// skip_if, when defined, is a float32 scalar on the variable's device (unscale_check's
// flag): when it is non-zero the kernel changes nothing (no variable, no slot). The step is
// then decided on the device, without a host read of the flag before the update.
// copy, when defined (only for a float32 var): a contiguous float16 or bfloat16 tensor of
// var's shape on its device, distinct from the others, that receives var's values after
// the update (or as they stay, when skip_if skips it) rounded to nearest even as the cast
// kernel rounds: the copy autocast reads next (mixtape/autograd/autocast.h), written in
// the same pass instead of a cast of its own.
// grad_scale, when defined: a float64 scalar on the variable's device (global-norm clipping's
// factor): the update reads each gradient element g as g * grad_scale computed in the slot
// dtype (the factor rounded to it) and rounded to grad's dtype, what scale_list would have
// written (one pass over the gradients fewer). One call's updates share skip_if and grad_scale
// (a step's).
// rates, when defined: a float64 tensor of 2 on the variable's device holding
// step_rates(lr, step, beta1, beta2) below ({lr, alpha}); the kernel reads lr and alpha there,
// when it runs, instead of computing them from lr and step (lr * weight_decay from that lr):
// a captured step's updates (mixtape/core/capture.h), whose host writes them before each
// replay.
struct OptimizerUpdate {
  Tensor var, grad;
  Tensor slot1, slot2, slot3;  // undefined when the optimizer does not use them
  Tensor skip_if;
  Tensor copy;
  Tensor rates;
  Tensor grad_scale;
  double lr = 0.0;
  double beta1 = 0.0, beta2 = 0.0, epsilon = 0.0;
  double momentum = 0.0, weight_decay = 0.0;
  std::int64_t step = 1;
  bool nesterov = false, centered = false, amsgrad = false;
};
using OptimizerUpdateFn = void(std::span<const OptimizerUpdate> updates);

// The numbers of an update that change from step to step, in float64: lr, and Adam's
// alpha = lr sqrt(1 - beta2^step) / (1 - beta1^step) (the bias corrections folded in).
struct StepRates {
  double lr = 0.0, alpha = 0.0;
};
inline StepRates step_rates(double lr, std::int64_t step, double beta1, double beta2) {
  const auto s = static_cast<double>(step);
  return {lr, lr * std::sqrt(1.0 - std::pow(beta2, s)) / (1.0 - std::pow(beta1, s))};
}

}  // namespace mixtape::kernels
