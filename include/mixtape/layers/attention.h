// Attention layers: MultiHeadAttention (Keras' arguments) and PositionEmbedding (a learned
// table of positions, as KerasHub's layer of that name).
//
//   auto mha = mt::layers::MultiHeadAttention(4, 32, {.use_causal_mask = true});
//   mt::Tensor y = mha({x, x});                                  // self-attention [B, T, D]
//   auto r = mha->attend(q, v, {.attention_mask = mask, .return_attention_scores = true});
//   // r.output [B, T, D], r.scores [B, heads, T, S]
//
//   auto pos = mt::layers::PositionEmbedding(256);               // up to 256 positions
//   mt::Tensor h = tokens + pos(tokens);                         // [B, T, D] + [B, T, D]
//
// Mixed precision: the projections run in the layer's compute dtype; the attention
// logits (query . key) and their masked softmax run in `scores_dtype`, float32 by default
// whenever the compute dtype is float16 or bfloat16 (a logit of 1e4 is exact in float32 and
// would be rounded to a multiple of 8 in float16, 64 in bfloat16), and the softmax weights
// are cast back to the compute dtype for the product with the values. Under the automatic
// mixed precision rewrite the softmax (op masked_softmax) is on the deny list: float32.
//
// The fused path: a call computes softmax(q k^T / sqrt(key_dim)) v with one op,
// mixtape::fused_attention (no [T, S] matrix: memory O(T) per head; logits, softmax and the
// weighted sum in float32, float64 under float64; dropout on the weights inside it), whenever
// it can: the scores are not returned and scores_dtype is the kernel's (float32; float64 for
// float64). Otherwise it composes matmul, masked_softmax, dropout and matmul as above. In
// self-attention (query, value and key one tensor) on the fused path, q, k and v come from one
// product with the three kernels side by side (fused_attention_packed), unless the policy keeps
// FP8 amax histories per projection (mixed_float8_delayed). The dtype trace's note says which
// ("attention: fused", "attention: fused (q, k and v in one product)", or "attention: composed
// (why)").
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"

namespace mixtape::layers {

// --- MultiHeadAttention ------------------------------------------------------------------

struct MultiHeadAttentionOptions {
  std::int64_t value_dim = 0;  // per head; 0: key_dim
  double dropout = 0.0;        // dropout rate on the attention weights (training calls only)
  bool use_bias = true;
  // The features of the output after the batch and sequence axes; empty: the query's.
  Shape output_shape = {};
  // Whether calls that do not say (a functional graph, operator()) mask the future: query
  // position i sees key positions j <= i. (Keras takes this per call only; here it is also
  // a default so that a functional model records it.)
  bool use_causal_mask = false;
  // The dtype of the attention logits and their softmax; empty: float32 when the compute
  // dtype is float16 or bfloat16, else the compute dtype.
  std::optional<DType> scores_dtype = {};
  init::Initializer kernel_initializer = init::glorot_uniform();
  init::Initializer bias_initializer = init::zeros();
  std::optional<std::uint64_t> seed = {};  // the dropout's generator
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(MultiHeadAttentionOptions, value_dim, dropout, use_bias, output_shape,
                use_causal_mask, scores_dtype, kernel_initializer, bias_initializer, seed);

// What one attend() call may add to the inputs.
struct AttentionCallOptions {
  // bool [B, T, S] (or broadcastable to it: [T, S], [1, T, S]): true where query position t
  // may attend to key position s. Undefined: every position.
  Tensor attention_mask = {};
  // Masks the future (ANDed with attention_mask); empty: the layer's use_causal_mask.
  std::optional<bool> use_causal_mask = {};
  bool return_attention_scores = false;
  bool training = false;  // the dropout on the attention weights
};

struct AttentionResult {
  Tensor output;  // [B, T, *output_shape] in the compute dtype
  Tensor scores;  // [B, heads, T, S] softmax weights (before dropout) in scores_dtype, on request
};

// Multi-head scaled dot-product attention (Vaswani et al.), Keras' MultiHeadAttention:
//   q = query W_q + b_q, k = key W_k + b_k, v = value W_v + b_v     (per head)
//   weights = softmax(q k^T / sqrt(key_dim)) over the keys allowed by the masks
//   output = concat_heads(weights v) W_o + b_o
// Inputs are [batch, T, features] (query) and [batch, S, features] (value, key); key
// defaults to value. Weights keep Keras' shapes: query/key kernels [D, heads, key_dim],
// value kernel [D, heads, value_dim], output kernel [heads, value_dim, *output_shape].
// A query row whose every key is masked gets weights 0 (its output is the output bias).
// Called as a layer on {query, value}, {query, value, key} or {query, value, key, mask}
// (the bool attention mask fourth; pass value again as the key), on one tensor x as
// self-attention (query = value = key = x), or through attend().
class MultiHeadAttentionLayer : public Layer {
 public:
  MultiHeadAttentionLayer(std::int64_t num_heads, std::int64_t key_dim,
                          MultiHeadAttentionOptions options = {});
  // The options, value_dim resolved (0 given: key_dim).
  const MultiHeadAttentionOptions& options() const { return options_; }

  // One call with Keras' call options; key undefined: value.
  AttentionResult attend(const Tensor& query, const Tensor& value,
                         const AttentionCallOptions& options = {}, const Tensor& key = {});

  void build_multi(const std::vector<Shape>& input_shapes) override;
  std::vector<Tensor> call_multi(const std::vector<Tensor>& inputs,
                                 const CallContext& ctx) override;
  std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const override;
  DType computation_dtype() const override;

  std::int64_t num_heads() const { return num_heads_; }
  std::int64_t key_dim() const { return key_dim_; }
  std::int64_t value_dim() const { return value_dim_; }
  // The dtype of the logits and the softmax (see MultiHeadAttentionOptions::scores_dtype).
  DType scores_dtype() const;

 protected:
  std::string trace_note() const override {
    const std::string projections = Layer::trace_note();
    return projections.empty() ? path_ : path_ + "; projections: " + projections;
  }
  bool checks_input_count() const override { return true; }

 private:
  struct Inputs;
  Inputs split(const std::vector<Shape>& shapes, const std::vector<DType>& dtypes) const;
  Tensor project(const Tensor& x, const Variable& kernel, const Variable& bias, std::int64_t dim,
                 const std::optional<Float8State>& float8, bool training) const;
  Tensor project_packed(const Tensor& x, bool training) const;
  Tensor composed_scores(const Tensor& q, const Tensor& k, Tensor mask, bool causal, std::int64_t t,
                         std::int64_t s, Device device);

  std::int64_t num_heads_, key_dim_, value_dim_;
  MultiHeadAttentionOptions options_;
  Generator generator_;
  Variable query_kernel_, query_bias_, key_kernel_, key_bias_, value_kernel_, value_bias_,
      output_kernel_, output_bias_;
  // mixed_float8_delayed: the amax histories of the four projections.
  std::optional<Float8State> query_float8_, key_float8_, value_float8_, output_float8_;
  Shape output_features_;  // output_shape, or the query's features once built
  Tensor causal_mask_;     // the latest causal mask [T, S], on the device it was used on
  std::string path_;       // how the latest call computed (trace_note)
};
LayerPtr<MultiHeadAttentionLayer> MultiHeadAttention(std::int64_t num_heads, std::int64_t key_dim,
                                                     MultiHeadAttentionOptions options = {});

// --- PositionEmbedding ---------------------------------------------------------------------

struct PositionEmbeddingOptions {
  init::Initializer initializer = init::glorot_uniform();
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(PositionEmbeddingOptions, initializer);

// A learned embedding of positions: for an input [batch, T, D] it returns the first T rows
// of its [sequence_length, D] table, broadcast to [batch, T, D] (add it to the token
// embeddings). Only the input's shape is read. An input longer than sequence_length throws
// ShapeError. (The same as an Embedding over the ids 0..T-1, without making the ids.)
class PositionEmbeddingLayer : public Layer {
 public:
  explicit PositionEmbeddingLayer(std::int64_t sequence_length,
                                  PositionEmbeddingOptions options = {});
  const PositionEmbeddingOptions& options() const { return options_; }
  void build(const Shape& input_shape) override;
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  std::int64_t sequence_length() const { return sequence_length_; }
  const Variable& embeddings() const;

 private:
  void check_length(const Shape& input_shape) const;
  std::int64_t sequence_length_;
  PositionEmbeddingOptions options_;
  Variable embeddings_;
};
LayerPtr<PositionEmbeddingLayer> PositionEmbedding(std::int64_t sequence_length,
                                                   PositionEmbeddingOptions options = {});

}  // namespace mixtape::layers
