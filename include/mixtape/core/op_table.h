// The op table: every op of mixtape, declared once. Everything else that knows an op is
// generated from this list:
//   - OpId, op names and the dispatch table's rows (mixtape/core/dispatch.h);
//   - the kernels every backend must register (mixtape/core/register_kernels.h loops over
//     the table's dtypes; a backend supplies kernel templates and its own type map), and
//     the start-up check that refuses a backend missing one, naming the op and the dtype;
//   - the names the automatic mixed precision rewrite knows and their default lists
//     (mixtape/autograd/amp.h), and the names ops record on the tape;
//   - the public function of each unary elementwise op (mixtape/autograd/ops.h);
//   - the conformance sweep over every backend and its coverage table (tests/conformance).
//
// Columns:
//   name    OpId::name, the op's name in errors, on the tape and in the AMP lists;
//   kernel  its kernel signature in mixtape::kernels (mixtape/core/kernels.h says what each
//           computes), or NoKernel for ops made of views or of other ops;
//   dtypes  the dtypes every backend must have a kernel for: Floating (float32, float16,
//           bfloat16, float64), Numeric (Floating, int32, int64), All (Numeric, uint8,
//           bool), Storage (All, float8_e4m3fn, float8_e5m2: copy, fill and cast), Float8
//           (float8_e4m3fn, float8_e5m2: scaled_matmul), Float64 (float64 alone: the loss
//           scale kept on the device), None;
//   amp     the op's default category for automatic mixed precision (allow, infer, deny,
//           clear; mixtape/autograd/amp.h), or hidden: the rewrite never sees the op (it
//           runs inside another op, or is not a model op);
//   grad    differentiable: the op records a backward rule on the tape.
//
// Adding an op: a row here, its differentiable function in autograd/ (forward and backward
// together), and one kernel per backend (a unary elementwise op: one functor in
// backends/cpu/elementwise.cpp and one in backends/cuda/elementwise.cu). docs/extending.md
// walks through it.
#pragma once

// The unary elementwise ops (kernel UnaryFn): each is also a public function
// Tensor name(const Tensor& x) of mixtape/autograd/ops.h, declared from this list.
//   gelu is the exact form x * Phi(x) (Keras' default, approximate=False); gelu_tanh its tanh
//   approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Keras' approximate=True,
//   PyTorch's approximate='tanh').
// clang-format off
#define MIXTAPE_UNARY_OP_TABLE(X)                                                               \
  X(neg,                      UnaryFn,                 Numeric,  clear,  true)                  \
  X(abs,                      UnaryFn,                 Numeric,  clear,  true)                  \
  X(exp,                      UnaryFn,                 Floating, deny,   true)                  \
  X(log,                      UnaryFn,                 Floating, infer,  true)                  \
  X(sqrt,                     UnaryFn,                 Floating, infer,  true)                  \
  X(rsqrt,                    UnaryFn,                 Floating, infer,  true)                  \
  X(tanh,                     UnaryFn,                 Floating, infer,  true)                  \
  X(sigmoid,                  UnaryFn,                 Floating, infer,  true)                  \
  X(relu,                     UnaryFn,                 Floating, clear,  true)                  \
  X(gelu,                     UnaryFn,                 Floating, infer,  true)                  \
  X(gelu_tanh,                UnaryFn,                 Floating, infer,  true)                  \
  X(erf,                      UnaryFn,                 Floating, infer,  true)
// clang-format on

// clang-format off
#define MIXTAPE_OP_TABLE(X)                                                                     \
  /*  name                    kernel                   dtypes    amp     grad  */               \
  /* memory */                                                                                  \
  X(copy,                     CopyFn,                  Storage,  hidden, false)                 \
  X(fill,                     FillFn,                  Storage,  hidden, false)                 \
  X(cast,                     CastFn,                  Storage,  hidden, true)                  \
  X(to_device,                NoKernel,                None,     hidden, true)                  \
  MIXTAPE_UNARY_OP_TABLE(X)                                                                    \
  /* binary arithmetic (broadcasting) */                                                        \
  X(add,                      BinaryFn,                Numeric,  infer,  true)                  \
  X(sub,                      BinaryFn,                Numeric,  infer,  true)                  \
  X(mul,                      BinaryFn,                Numeric,  infer,  true)                  \
  X(div,                      BinaryFn,                Numeric,  infer,  true)                  \
  X(maximum,                  BinaryFn,                Numeric,  clear,  true)                  \
  X(minimum,                  BinaryFn,                Numeric,  clear,  true)                  \
  X(pow,                      BinaryFn,                Floating, deny,   true)                  \
  X(relu_backward,            BinaryFn,                Floating, hidden, true)                  \
  X(gelu_backward,            BinaryFn,                Floating, hidden, true)                  \
  /* comparisons (bool output; not differentiable) */                                          \
  X(equal,                    BinaryFn,                All,      clear,  false)                 \
  X(not_equal,                BinaryFn,                All,      clear,  false)                 \
  X(less,                     BinaryFn,                All,      clear,  false)                 \
  X(less_equal,               BinaryFn,                All,      clear,  false)                 \
  X(greater,                  BinaryFn,                All,      clear,  false)                 \
  X(greater_equal,            BinaryFn,                All,      clear,  false)                 \
  /* selection and indexing */                                                                  \
  X(where,                    WhereFn,                 All,      clear,  true)                  \
  X(gather,                   GatherFn,                Numeric,  clear,  true)                  \
  X(scatter_add,              ScatterAddFn,            Numeric,  hidden, true)                  \
  X(take,                     TakeFn,                  Numeric,  clear,  true)                  \
  X(index_add,                IndexAddFn,              Numeric,  hidden, true)                  \
  /* reductions */                                                                              \
  X(sum,                      ReduceFn,                Numeric,  deny,   true)                  \
  X(mean,                     ReduceFn,                Floating, deny,   true)                  \
  X(max,                      ReduceFn,                Numeric,  clear,  true)                  \
  X(min,                      ReduceFn,                Numeric,  clear,  true)                  \
  X(argmax,                   ReduceFn,                Numeric,  clear,  false)                 \
  /* rows of the last axis */                                                                   \
  X(softmax,                  RowFn,                   Floating, infer,  true)                  \
  X(log_softmax,              RowFn,                   Floating, infer,  true)                  \
  X(masked_softmax,           MaskedSoftmaxFn,         Floating, deny,   true)                  \
  /* dropout from a seed (counter-based: the mask recomputed, never stored) */                  \
  X(dropout,                  DropoutFn,               Floating, clear,  true)                  \
  /* fused attention (softmax(scale q k^T) v without the [t, s] matrix) */                     \
  X(attention,                AttentionFn,             Floating, allow,  true)                  \
  X(attention_backward,       AttentionBackwardFn,     Floating, hidden, false)                 \
  /* fused layer normalisation over the last axis */                                           \
  X(layer_norm,               LayerNormFn,             Floating, deny,   true)                  \
  X(layer_norm_backward,      LayerNormBackwardFn,     Floating, hidden, false)                 \
  /* fused batch normalisation over every axis but the last, with the batch's statistics */    \
  X(batch_norm,               BatchNormFn,             Floating, deny,   true)                  \
  X(batch_norm_backward,      BatchNormBackwardFn,     Floating, hidden, false)                 \
  /* fused softmax cross-entropy from logits and class indices */                               \
  X(softmax_cross_entropy,    SoftmaxCrossEntropyFn,   Floating, deny,   true)                  \
  X(softmax_cross_entropy_backward, SoftmaxCrossEntropyBackwardFn, Floating, hidden, false)     \
  /* linear algebra */                                                                          \
  X(matmul,                   GemmFn,                  Floating, allow,  true)                  \
  X(scaled_matmul,            ScaledMatmulFn,          Float8,   hidden, false)                 \
  X(quantize_float8,          QuantizeFloat8Fn,        Floating, hidden, false)                 \
  /* fused linear (a Dense layer: product, bias and activation in one op) */                    \
  X(linear,                   LinearFn,                Floating, allow,  true)                  \
  X(linear_backward,          LinearBackwardFn,        Floating, hidden, false)                 \
  /* convolution and pooling (NHWC) */                                                          \
  X(conv2d,                   Conv2dFn,                Floating, allow,  true)                  \
  X(conv2d_backward_input,    Conv2dBackwardInputFn,   Floating, hidden, true)                  \
  X(conv2d_backward_weight,   Conv2dBackwardWeightFn,  Floating, hidden, true)                  \
  X(max_pool2d,               Pool2dFn,                Floating, clear,  true)                  \
  X(max_pool2d_backward,      Pool2dBackwardFn,        Floating, hidden, true)                  \
  X(avg_pool2d,               Pool2dFn,                Floating, infer,  true)                  \
  X(avg_pool2d_backward,      Pool2dBackwardFn,        Floating, hidden, true)                  \
  /* views and compositions (no kernel of their own) */                                         \
  X(contiguous,               NoKernel,                None,     clear,  true)                  \
  X(reshape,                  NoKernel,                None,     clear,  true)                  \
  X(permute,                  NoKernel,                None,     clear,  true)                  \
  X(slice,                    NoKernel,                None,     clear,  true)                  \
  X(slice_backward,           NoKernel,                None,     hidden, true)                  \
  X(expand,                   NoKernel,                None,     clear,  true)                  \
  X(concat,                   NoKernel,                None,     clear,  true)                  \
  /* training (gradient widening, the loss-scale check, clipping, the optimizers' updates) */   \
  X(unscale_check,            UnscaleCheckFn,          Floating, hidden, false)                 \
  X(loss_scale_update,        LossScaleUpdateFn,       Float64,  hidden, false)                 \
  X(sum_squares,              SumSquaresFn,            Floating, hidden, false)                 \
  X(scale_list,               ScaleListFn,             Floating, hidden, false)                 \
  X(cast_list,                CastListFn,              Floating, hidden, false)                 \
  X(sgd_update,               OptimizerUpdateFn,       Floating, hidden, false)                 \
  X(rmsprop_update,           OptimizerUpdateFn,       Floating, hidden, false)                 \
  X(adam_update,              OptimizerUpdateFn,       Floating, hidden, false)
// clang-format on
