// The differentiable ops. Each op validates its inputs (errors name the op, the shapes
// and the dtypes), dispatches to the kernel registered for (device, dtype), and records
// its backward rule on active GradientTapes; forward and backward live side by side in
// autograd/ops_*.cpp.
//
// Binary ops broadcast (numpy rules) and promote dtypes with promote_types(); a double
// scalar operand takes the tensor's dtype (it does not widen float16 to float32).
// Non-differentiable ops (comparisons, argmax, one_hot) are never recorded.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "mixtape/core/op_table.h"
#include "mixtape/core/random_seed.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

// --- Elementwise arithmetic ----------------------------------------------------------
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);  // gradient to a where a >= b
Tensor minimum(const Tensor& a, const Tensor& b);  // gradient to a where a <= b
Tensor pow(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, double exponent);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double b);
Tensor operator-(const Tensor& a, double b);
Tensor operator*(const Tensor& a, double b);
Tensor operator/(const Tensor& a, double b);
Tensor operator+(double a, const Tensor& b);
Tensor operator-(double a, const Tensor& b);
Tensor operator*(double a, const Tensor& b);
Tensor operator/(double a, const Tensor& b);
Tensor operator-(const Tensor& a);

// --- Unary math ------------------------------------------------------------------------
// One function per unary elementwise op of the op table (mixtape/core/op_table.h says what
// each computes): neg, abs, exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu (exact),
// gelu_tanh (the tanh approximation), erf.
#define MIXTAPE_DECLARE_UNARY_OP(name, ...) Tensor name(const Tensor& x);
MIXTAPE_UNARY_OP_TABLE(MIXTAPE_DECLARE_UNARY_OP)
#undef MIXTAPE_DECLARE_UNARY_OP
Tensor square(const Tensor& x);  // x * x

// --- Comparisons and selection (bool results; not differentiable) ---------------------
Tensor equal(const Tensor& a, const Tensor& b);
Tensor not_equal(const Tensor& a, const Tensor& b);
Tensor less(const Tensor& a, const Tensor& b);
Tensor less_equal(const Tensor& a, const Tensor& b);
Tensor greater(const Tensor& a, const Tensor& b);
Tensor greater_equal(const Tensor& a, const Tensor& b);
// cond ? a : b, broadcasting all three; differentiable in a and b.
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);

// --- Reductions (float32 accumulation for float16/bfloat16) ---------------------------
// `axes` empty means all axes. Negative axes count from the end.
Tensor sum(const Tensor& x, const std::vector<int>& axes = {}, bool keepdims = false);
Tensor mean(const Tensor& x, const std::vector<int>& axes = {}, bool keepdims = false);
Tensor max(const Tensor& x, const std::vector<int>& axes = {}, bool keepdims = false);
Tensor min(const Tensor& x, const std::vector<int>& axes = {}, bool keepdims = false);
Tensor argmax(const Tensor& x, int axis = -1, bool keepdims = false);  // int64
// Sums `x` down to `shape` (the adjoint of broadcasting `shape` to x's shape).
Tensor sum_to(const Tensor& x, const Shape& shape);

// --- Rows -------------------------------------------------------------------------------
Tensor softmax(const Tensor& x, int axis = -1);
Tensor log_softmax(const Tensor& x, int axis = -1);
// Attention weights in one kernel: softmax(scale * x) over the last axis, taken over the
// positions where `mask` is true and 0 where it is false (a row with none true is all 0).
// mask: bool, broadcastable to x's shape (e.g. [batch, 1, queries, keys] against
// [batch, heads, queries, keys]), on x's device; undefined: nothing masked. Computed in
// float32 (float64 for float64) whatever x's dtype; the result has x's dtype. Automatic
// mixed precision keeps it in float32 (its default list: deny). Differentiable in x.
Tensor masked_softmax(const Tensor& x, const Tensor& mask = Tensor(), double scale = 1.0);
// Attention in one fused op (op attention; FlashAttention-2's tiling): softmax(scale q k^T)
// v over the last two axes, the softmax of each query row over the keys it attends, without
// making the [t, s] matrix of weights (memory O(t) per head; the backward pass recomputes
// the weights tile by tile from each row's saved log-sum-exp). q [..., t, d], k [..., s, d],
// v [..., s, dv]: the same leading axes and dtype. mask: bool, broadcastable to [..., t, s]
// (true: attend), or undefined; causal: query i also attends only keys j <= i. A row that
// attends nothing is 0. The math runs in float32 (float64 for float64); the result has q's
// dtype. Differentiable in q, k and v. The same values as masked_softmax(matmul(q, k^T),
// mask, scale) then matmul with v, to rounding. The mask is read where it lies (a
// key-padding mask [batch, 1, 1, s] is never made [..., t, s]).
// dropout in [0, 1): the weights that reach v are dropped with that probability and the
// others scaled by 1 / (1 - dropout), the decision for each weight a function of `seed` and
// its position (mixtape/core/dropout_hash.h: the same on every backend and in the backward
// pass, which finds the mask again without storing it); the softmax's log-sum-exp is the
// undropped weights'. The mask is mixtape::dropout's on the weights [..., t, s]. The seed: a
// number, or draw_seed's (mixtape/core/random_seed.h) in a step that is to be captured.
// ValueError for a rate outside [0, 1).
Tensor fused_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& mask = Tensor(), bool causal = false, double scale = 1.0,
                       double dropout = 0.0, const RandomSeed& seed = {});
// The heads of a packed projection (fused_attention_packed): how many, and the widths of a
// query's (and a key's) head and of a value's.
struct PackedHeads {
  std::int64_t heads = 0, key_dim = 0, value_dim = 0;
};
// fused_attention of the q, k and v that one projection makes for self-attention (the three
// projections' kernels side by side: one product instead of three), packed in one tensor:
// qkv [..., t, heads * (2 key_dim + value_dim)], along its last axis q's heads, then k's, then
// v's, each part [heads, dim] with the heads outer. The same op, kernels and result as
// fused_attention(q, k, v, ...) with q [..., heads, t, key_dim], k and v viewed out of qkv
// that way; the result [..., heads, t, value_dim]. Its gradient is one tensor shaped as qkv,
// the backward kernel writing the three parts in place (three views of qkv would each bring
// back a zero tensor of qkv's shape, summed). ShapeError when qkv's last axis is not that
// wide or a count is not positive; otherwise as fused_attention.
Tensor fused_attention_packed(const Tensor& qkv, const PackedHeads& packed,
                              const Tensor& mask = Tensor(), bool causal = false,
                              double scale = 1.0, double dropout = 0.0,
                              const RandomSeed& seed = {});
// Dropout in one op (op dropout): each element of x dropped (0) with probability `rate` and
// the others scaled by 1 / (1 - rate), whether element i (its row-major position) survives a
// function of the seed and i alone (mixtape/core/dropout_hash.h): the same on every backend,
// and found again by the backward pass, which stores no mask. On weights [..., t, s] it drops
// what fused_attention drops with the same seed. The seed: a number, or draw_seed's
// (mixtape/core/random_seed.h), which a captured step redraws at each replay. x floating
// (DTypeError otherwise); rate in [0, 1) (ValueError otherwise; 0 returns x). Differentiable:
// the gradient is the incoming one times the same factors.
Tensor dropout(const Tensor& x, double rate, const RandomSeed& seed);
// The softmax cross-entropy of each row of logits [..., c] against its class index (labels
// [...], int64, in [0, c): IndexError naming the first outside when the labels are on the
// host; a device's kernel gives NaN for such a row) in one op (op softmax_cross_entropy):
// log(sum exp(logits)) - logits[label], computed in float32 (float64 for float64 logits)
// and returned in that dtype, shape [...]. The gradient (softmax - one_hot) times the
// incoming one is one op too, the softmax recomputed from the saved log-sum-exp: no
// probabilities are kept. Differentiable in logits.
Tensor softmax_cross_entropy(const Tensor& logits, const Tensor& labels);
// Layer normalisation over the last axis in one op (op layer_norm; its backward pass one op
// too): (x - mean) / sqrt(var + epsilon) * gamma + beta, the statistics of each row (biased
// variance) in float32 (float64 for float64), the result rounded once to x's dtype. gamma
// and beta: [last extent], any floating dtype (read in float32 / float64), either undefined
// (1 and 0). Differentiable in x, gamma and beta.
Tensor layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, double epsilon);
// Batch normalisation with the batch's statistics in one op (op batch_norm; its backward pass
// one op too, batch_norm_backward): each column of x [..., n] (every axis but the last is the
// batch) normalised by its mean and biased variance over the batch, (x - mean) / sqrt(var +
// epsilon) * gamma + beta, the statistics in float32 (float64 for float64; sums in float64),
// the result rounded once to x's dtype. gamma and beta: [n], any floating dtype (read in the
// compute type), either undefined (1 and 0). Returns the result and the statistics ([n], the
// compute type, not differentiable: what BatchNormalization folds into its moving averages).
// Differentiable in x, gamma and beta, the gradient through the statistics included. x must
// hold at least one row (ValueError otherwise: an empty batch has no statistics).
struct BatchNormResult {
  Tensor out, mean, variance;
};
BatchNormResult batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta,
                           double epsilon);
// The same op with given statistics (inference: a layer's moving mean and variance): mean and
// variance [n], any floating dtype, read in the compute type as values (no gradient flows to
// them); x may be empty. Differentiable in x, gamma and beta.
Tensor batch_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, const Tensor& mean,
                  const Tensor& variance, double epsilon);
// A Dense layer's computation in one op (op linear; its backward pass's elementwise part one
// op too, linear_backward): activation(x w + bias), x [..., k], w [k, n] (promoted to one
// floating dtype, the result's), bias [n] (any floating dtype, its gradient computed in
// float32 / float64; undefined: none), activation a name is_linear_activation() accepts. The
// product accumulates in float32 (float64 for float64), the bias's value in the result's dtype
// (a float16 / bfloat16 result's bias rounded to it first, as autocast reads a mixed policy's
// variable) and the activation are applied to that value and the result is rounded once: under
// float16 / bfloat16 closer to the exact value than the composed
// matmul(x, w) + bias then the activation, which round three times; under float32 the same
// values (relu and none to the bit; gelu and gelu_tanh to about the last bit: the CPU's vector
// loops may contract into FMAs differently). It accumulates in float32 even where
// MIXTAPE_FP16_USE_FP32_COMPUTE=0 makes matmul accumulate in the 16-bit type (Dense then
// composes). Differentiable in x, w and bias.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias = Tensor(),
              std::string_view activation = "linear");
// The activations linear() applies: linear (none), relu, gelu (exact), gelu_tanh.
bool is_linear_activation(std::string_view name);

// --- Dtype, device, shape ----------------------------------------------------------------
// The gradient of a cast is cast back to the source dtype.
Tensor cast(const Tensor& x, DType dtype);
Tensor to_device(const Tensor& x, Device device);
Tensor contiguous(const Tensor& x);
Tensor detach(const Tensor& x);
Tensor reshape(const Tensor& x, const Shape& shape);  // one extent may be -1
Tensor permute(const Tensor& x, const std::vector<int>& axes);
Tensor transpose(const Tensor& x, int axis0 = -2, int axis1 = -1);
Tensor slice(const Tensor& x, int axis, std::int64_t start, std::int64_t stop,
             std::int64_t step = 1);
Tensor expand(const Tensor& x, const Shape& shape);  // broadcast_to
Tensor squeeze(const Tensor& x, int axis);
Tensor unsqueeze(const Tensor& x, int axis);
Tensor flatten(const Tensor& x, int start_axis = 1);  // [n, a, b] -> [n, a*b]
Tensor concat(const std::vector<Tensor>& xs, int axis);

// --- Linear algebra ------------------------------------------------------------------------
// [..., m, k] x [..., k, n] -> [..., m, n], batch dimensions broadcast. Transposed views
// are passed to the GEMM as transpose flags (no copy).
Tensor matmul(const Tensor& a, const Tensor& b);

// --- FP8 -----------------------------------------------------------------------------------
// The matrix product of FP8 operands with per-tensor scales (mixtape/core/kernels.h,
// ScaledMatmulArgs): a [m, k] and b_t [n, k] (the second operand transposed: k innermost in
// both, as FP8 tensor cores take them), float8 dtypes (not both float8_e5m2), their
// dequantisation scales (float32, one element each, on their device): out [m, n] in
// out_dtype (float32, bfloat16 or float16) = scale_a * scale_b * a b_t^T, the products exact,
// the sums in float32. Not differentiable: FP8 training builds its backward pass from
// scaled_matmul calls of its own.
struct ScaledMatmulOptions {
  DType out_dtype = kBFloat16;
  bool fast_accumulation = false;  // the GPU's faster FP8 accumulation (forward passes only)
};
Tensor scaled_matmul(const Tensor& a, const Tensor& b_t, const Tensor& scale_a,
                     const Tensor& scale_b, ScaledMatmulOptions options = {});

// x quantised to a float8 dtype with one scale for the whole tensor ("current" scaling, as
// torchao's tensorwise scaling): amax = max |x| (float32), data = cast(x * (max_of(dtype) /
// amax), dtype) (saturating), scale = amax / max_of(dtype), the factor that turns data back
// into x's values (scaled_matmul's scale_a / scale_b). Computed on x's device, no host wait;
// an all-zero x gets scale 1. Not differentiable.
struct Float8Quantized {
  Tensor data;   // x's shape, `dtype`
  Tensor scale;  // float32, one element: dequantisation factor
  Tensor amax;   // float32, one element: max |x|
};
Float8Quantized quantize_float8(const Tensor& x, DType dtype);

// Delayed scaling (Transformer Engine's): x quantised with the scale its amax history gives,
// history float32 [length] on x's device, newest first. The factor into the format's range is
// max_of(dtype) / (the history's largest amax) / 2^margin (this step's own amax while the
// history is all zero, before its first step); an element beyond the history's amax
// saturates to the format's largest finite value. With `update`, this step's amax then enters
// the history (in place: the oldest drops out). On x's device, no host wait. Not
// differentiable.
Float8Quantized quantize_float8(const Tensor& x, DType dtype, const Tensor& history, int margin,
                                bool update);

// The delayed-scaling state of one float8_linear: the amax histories of x, w and the output
// gradient (float32 [length] each, on x's device; a layer keeps them as non-trainable
// weights, so checkpoints hold them), the margin, and whether this call's amaxes enter the
// histories (training steps: x's and w's in the forward pass, the gradient's in the
// backward pass).
struct Float8History {
  Tensor input, weight, grad;
  int margin = 0;
  bool update = true;
};

// x [..., k] times w [k, n] in FP8, as mixed_float8's Dense computes: x and w quantised to
// float8_e4m3fn with current scaling (or delayed scaling, given `delayed`: see
// Float8History), scaled_matmul (fast accumulation), out_dtype out
// [..., n]. Differentiable in x and w: the output gradient is quantised to float8_e5m2 and
// dx = dy w^T and dw = x^T dy are scaled_matmul calls too (e5m2 x e4m3 and e4m3 x e5m2,
// accurate accumulation), in x's and w's dtypes, from FP8 transposed copies of the forward's
// operands (no second quantisation). x and w: float32, bfloat16 or float16 (w is usually a
// float32 variable: it is quantised from its float32 values). A tape that records the
// backward pass (second derivatives) gets it from ordinary matmuls in out_dtype.
// With a bias [n] (differentiable, its gradient float32) and / or an activation that linear()
// applies (relu, gelu, gelu_tanh), out = act(x w + bias) as linear() computes it: the bias's
// value in out_dtype added to the float32 product and the activation applied before the one
// rounding to out_dtype, and the backward pass's dz = dy act'(z) and bias gradient in
// linear_backward's one pass before dz is quantised.
Tensor float8_linear(const Tensor& x, const Tensor& w, DType out_dtype = kBFloat16,
                     const Float8History* delayed = nullptr, const Tensor& bias = Tensor(),
                     std::string_view activation = "linear");

// --- Indexing ------------------------------------------------------------------------------
// Out-of-range indices throw IndexError: at once for indices on the CPU; for indices on
// a GPU the range is checked there and the error comes from the next read of a device
// tensor (or a later indexing op), the host not waiting for the indices to exist.
//
// Along `axis`: out[..., j, ...] = x[..., index[..., j, ...], ...] (take_along_axis);
// index is int32/int64 with x's rank, on x's device; differentiable in x.
Tensor gather(const Tensor& x, const Tensor& index, int axis);
// Whole slices along `axis` (numpy's take, index_select): the output has shape
// x.shape[:axis] + indices.shape + x.shape[axis + 1:], and takes the slice indices[i...]
// of x at each position. indices is int32/int64, on x's device or on the CPU (checked
// there, then copied to x's device: a batch of rows picked on the host). Differentiable in
// x (the gradient adds up where an index repeats).
Tensor take(const Tensor& x, const Tensor& indices, int axis = 0);
// Labels (integer tensor) -> one-hot vectors in a new last axis of size depth.
Tensor one_hot(const Tensor& labels, std::int64_t depth, DType dtype = kFloat32);

// --- Convolution and pooling (NHWC like Keras; filters HWIO [kh, kw, cin, cout]) -----------
enum class Padding { Valid, Same };
Padding parse_padding(const std::string& name);  // "valid" / "same"
// The output extent of a window of `window` sliding by `stride` over `in` (TensorFlow's rules:
// 'valid' gives (in - window) / stride + 1, 'same' ceil(in / stride)); ShapeError when a
// 'valid' window is larger than the input.
std::int64_t window_output_extent(std::int64_t in, std::int64_t window, std::int64_t stride,
                                  Padding padding);
// The elements that `padding` adds before and after the `in` elements of an axis for this
// window and stride: none for 'valid'; for 'same' what the window_output_extent windows need,
// the odd one at the end (TensorFlow's rule). ShapeError when the padded extent would not fit
// an int64 (a window of about 2^63).
struct AxisPadding {
  std::int64_t before = 0, after = 0;
};
AxisPadding window_padding(std::int64_t in, std::int64_t window, std::int64_t stride,
                           Padding padding);

Tensor conv2d(const Tensor& x, const Tensor& filters, std::array<std::int64_t, 2> strides = {1, 1},
              Padding padding = Padding::Valid);
// conv2d(x, filters) + bias (bias [cout]) in one kernel: the bias is added to the
// convolution's accumulator, so a float16 / bfloat16 result is rounded once instead of twice
// (and the output is written once). Conv2D calls this when it has a bias.
Tensor conv2d(const Tensor& x, const Tensor& filters, const Tensor& bias,
              std::array<std::int64_t, 2> strides = {1, 1}, Padding padding = Padding::Valid);
Tensor max_pool2d(const Tensor& x, std::array<std::int64_t, 2> pool_size,
                  std::array<std::int64_t, 2> strides, Padding padding = Padding::Valid);
Tensor avg_pool2d(const Tensor& x, std::array<std::int64_t, 2> pool_size,
                  std::array<std::int64_t, 2> strides, Padding padding = Padding::Valid);

// --- Tensor's methods ------------------------------------------------------------------------
// x.to(dtype), x.reshape(shape), ...: the ops above (mixtape/core/tensor.h, TensorOps).
template <>
struct TensorOps<void> {
  static Tensor cast(const Tensor& x, DType dtype) { return mixtape::cast(x, dtype); }
  static Tensor to_device(const Tensor& x, Device device) { return mixtape::to_device(x, device); }
  static Tensor contiguous(const Tensor& x) { return mixtape::contiguous(x); }
  static Tensor reshape(const Tensor& x, const Shape& shape) { return mixtape::reshape(x, shape); }
  static Tensor permute(const Tensor& x, const std::vector<int>& axes) {
    return mixtape::permute(x, axes);
  }
  static Tensor transpose(const Tensor& x, int axis0, int axis1) {
    return mixtape::transpose(x, axis0, axis1);
  }
  static Tensor slice(const Tensor& x, int axis, std::int64_t start, std::int64_t stop,
                      std::int64_t step) {
    return mixtape::slice(x, axis, start, stop, step);
  }
  static Tensor expand(const Tensor& x, const Shape& shape) { return mixtape::expand(x, shape); }
  static Tensor detach(const Tensor& x) { return mixtape::detach(x); }
};

}  // namespace mixtape
