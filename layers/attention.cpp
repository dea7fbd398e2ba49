// MultiHeadAttention and PositionEmbedding (mixtape/layers/attention.h).
#include "mixtape/layers/attention.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <utility>

#include "layers/config_util.h"
#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/compute_mode.h"

namespace mixtape::layers {

namespace {

// The options of the attend() call running on this thread, for call_multi (a layer's call
// goes through Layer::apply, which has no room for them).
struct PendingCall {
  const MultiHeadAttentionLayer* layer = nullptr;
  const AttentionCallOptions* options = nullptr;
};
thread_local PendingCall t_pending;

// [T, S] bool: query position i may see key position j when j <= i (Keras' causal mask).
Tensor make_causal_mask(std::int64_t t, std::int64_t s, Device device) {
  std::vector<bool> keep(static_cast<std::size_t>(t * s));
  for (std::int64_t i = 0; i < t; ++i)
    for (std::int64_t j = 0; j < s; ++j) keep[static_cast<std::size_t>(i * s + j)] = j <= i;
  Tensor m = from_vector(keep, Shape{t, s}, kBool);
  return device == Device::cpu() ? m : to_device(m, device);
}

std::int64_t product(const Shape& s) {
  std::int64_t n = 1;
  for (auto d : s) n *= d;
  return n;
}

}  // namespace

// --- MultiHeadAttention ----------------------------------------------------------------------

// The inputs of one call, by role (indices into the call's inputs; -1: absent).
struct MultiHeadAttentionLayer::Inputs {
  int query = 0, value = 1, key = 1, mask = -1;
  std::int64_t batch = 0, t = 0, s = 0;
};

MultiHeadAttentionLayer::MultiHeadAttentionLayer(std::int64_t num_heads, std::int64_t key_dim,
                                                 MultiHeadAttentionOptions options)
    : Layer(detail::common_options(options), "MultiHeadAttention"),
      num_heads_(num_heads),
      key_dim_(key_dim),
      value_dim_(options.value_dim > 0 ? options.value_dim : key_dim),
      options_(std::move(options)),
      generator_(options_.seed.value_or(0x61747465ULL)) {
  if (num_heads_ <= 0 || key_dim_ <= 0 || options_.value_dim < 0)
    throw ValueError(fmt::format(
        "layer '{}' (MultiHeadAttention): num_heads and key_dim must be positive and value_dim "
        ">= 0; got num_heads {}, key_dim {}, value_dim {}",
        name(), num_heads_, key_dim_, options_.value_dim));
  options_.value_dim = value_dim_;  // resolved, as options() and the config give it
  if (!(options_.dropout >= 0.0 && options_.dropout < 1.0))
    throw ValueError(
        fmt::format("layer '{}' (MultiHeadAttention): dropout must be in [0, 1); got {}", name(),
                    options_.dropout));
  for (auto d : options_.output_shape)
    if (d <= 0)
      throw ValueError(fmt::format(
          "layer '{}' (MultiHeadAttention): output_shape extents must be positive; got {}", name(),
          options_.output_shape));
  if (options_.scores_dtype && !options_.scores_dtype->is_floating())
    throw DTypeError(fmt::format(
        "layer '{}' (MultiHeadAttention): scores_dtype must be a floating dtype; got {}", name(),
        *options_.scores_dtype));
}

DType MultiHeadAttentionLayer::scores_dtype() const {
  if (options_.scores_dtype) return *options_.scores_dtype;
  return compute_dtype().is_reduced_float() ? kFloat32 : compute_dtype();
}

DType MultiHeadAttentionLayer::computation_dtype() const {
  return gemm_accumulation_dtype(compute_dtype());
}

MultiHeadAttentionLayer::Inputs MultiHeadAttentionLayer::split(
    const std::vector<Shape>& shapes, const std::vector<DType>& dtypes) const {
  Inputs in;
  std::size_t n = shapes.size();
  const auto text = [&] {
    std::vector<std::string> parts;
    for (std::size_t i = 0; i < shapes.size(); ++i)
      parts.push_back(fmt::format("{}{}", dtypes[i], detail::shape_with_none(shapes[i])));
    return fmt::format("{}", fmt::join(parts, ", "));
  };
  if (n == 4) {
    in.mask = 3;
    n = 3;
    if (dtypes[3] != kBool)
      throw DTypeError(fmt::format(
          "the attention mask (input 4, after query, value and key) must be bool; got {}", text()));
  }
  if (n < 1 || n > 3)
    throw ValueError(fmt::format(
        "takes the inputs query, value, optionally key, then optionally a bool attention mask "
        "(after the key: pass value again as the key); got {} inputs: {}",
        shapes.size(), text()));
  if (n == 1) in.value = in.key = 0;  // self-attention
  if (n == 3) in.key = 2;
  for (int i : {in.query, in.value, in.key}) {
    const Shape& s = shapes[static_cast<std::size_t>(i)];
    if (s.rank() != 3)
      throw ShapeError(
          fmt::format("query, value and key must be [batch, length, features]; got {}", text()));
    if (!dtypes[static_cast<std::size_t>(i)].is_floating())
      throw DTypeError(
          fmt::format("query, value and key must be floating tensors; got {}", text()));
  }
  const Shape& q = shapes[static_cast<std::size_t>(in.query)];
  const Shape& v = shapes[static_cast<std::size_t>(in.value)];
  const Shape& k = shapes[static_cast<std::size_t>(in.key)];
  const bool batches_known = q[0] >= 0 && v[0] >= 0 && k[0] >= 0;
  if (batches_known && (q[0] != v[0] || q[0] != k[0]))
    throw ShapeError(fmt::format("query, value and key batch sizes differ: {}", text()));
  if (k[1] != v[1])
    throw ShapeError(
        fmt::format("key and value must have the same length (axis 1); got {}", text()));
  in.batch = q[0];
  in.t = q[1];
  in.s = v[1];
  if (in.mask >= 0) {
    // [B, T, S], or fewer leading axes that broadcast to it.
    const Shape& m = shapes[static_cast<std::size_t>(in.mask)];
    const std::vector<std::int64_t> want{in.batch, in.t, in.s};
    bool ok = m.rank() >= 2 && m.rank() <= 3;
    for (std::size_t i = 0; ok && i < m.rank(); ++i) {
      const std::int64_t got = m[m.rank() - 1 - i], need = want[2 - i];
      ok = got == need || (i == 2 && (got == 1 || need < 0 || got < 0));
    }
    if (!ok)
      throw ShapeError(fmt::format(
          "the attention mask must be bool [batch, query length, key length] = [{}, {}, {}] "
          "(or [{}, {}] / [1, {}, {}]); got {}",
          in.batch < 0 ? std::string("None") : std::to_string(in.batch), in.t, in.s, in.t, in.s,
          in.t, in.s, text()));
  }
  return in;
}

void MultiHeadAttentionLayer::build_multi(const std::vector<Shape>& shapes) {
  std::vector<DType> dtypes(shapes.size(), compute_dtype());
  if (shapes.size() == 4) dtypes.back() = kBool;  // the mask (split() checks the real dtype)
  const Inputs in = split(shapes, dtypes);
  const std::int64_t dq = shapes[static_cast<std::size_t>(in.query)].back();
  const std::int64_t dv = shapes[static_cast<std::size_t>(in.value)].back();
  const std::int64_t dk = shapes[static_cast<std::size_t>(in.key)].back();
  output_features_ = options_.output_shape.rank() > 0 ? options_.output_shape : Shape{dq};
  const auto& ki = options_.kernel_initializer;
  const auto& bi = options_.bias_initializer;
  query_kernel_ = add_weight("query/kernel", {dq, num_heads_, key_dim_}, ki);
  if (options_.use_bias) query_bias_ = add_weight("query/bias", {num_heads_, key_dim_}, bi);
  key_kernel_ = add_weight("key/kernel", {dk, num_heads_, key_dim_}, ki);
  if (options_.use_bias) key_bias_ = add_weight("key/bias", {num_heads_, key_dim_}, bi);
  value_kernel_ = add_weight("value/kernel", {dv, num_heads_, value_dim_}, ki);
  if (options_.use_bias) value_bias_ = add_weight("value/bias", {num_heads_, value_dim_}, bi);
  std::vector<std::int64_t> out_dims{num_heads_, value_dim_};
  for (auto d : output_features_) out_dims.push_back(d);
  output_kernel_ = add_weight("attention_output/kernel", Shape(out_dims), ki);
  if (options_.use_bias) output_bias_ = add_weight("attention_output/bias", output_features_, bi);
  query_float8_ = add_float8_state("query/");
  key_float8_ = add_float8_state("key/");
  value_float8_ = add_float8_state("value/");
  output_float8_ = add_float8_state("attention_output/");
}

std::optional<std::vector<TensorSpec>> MultiHeadAttentionLayer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  std::vector<Shape> shapes;
  std::vector<DType> dtypes;
  for (const auto& s : inputs) {
    shapes.push_back(s.shape);
    dtypes.push_back(s.dtype);
  }
  const Inputs in = split(shapes, dtypes);
  std::vector<std::int64_t> dims{in.batch, in.t};
  const Shape features = options_.output_shape.rank() > 0
                             ? options_.output_shape
                             : Shape{shapes[static_cast<std::size_t>(in.query)].back()};
  for (auto d : features) dims.push_back(d);
  return std::vector<TensorSpec>{TensorSpec{Shape(dims), compute_dtype()}};
}

// A bias variable as policy_linear takes it, [n] (undefined: none), in its own dtype: the
// fused linear op adds its value in the product's dtype before its single rounding and gives
// the float32 bias a float32 gradient, as Dense's (read through its 16-bit copy, the gradient
// would be rounded to 16 bits on the way back). The composed path casts it to the product's
// dtype. (A [heads, dim] bias reshaped is no longer the variable: the fused op casts it each
// call instead of reading the 16-bit copy autocast keeps of a variable, detail::kernel_bias.)
namespace {
Tensor flat_bias(const Variable& bias, const Shape& flat) {
  if (!bias.defined()) return Tensor();
  AutocastScope whole(std::nullopt);
  return reshape(bias, flat);
}
}  // namespace

// x [B, L, D] through a [D, heads, dim] kernel: [B, heads, L, dim].
Tensor MultiHeadAttentionLayer::project(const Tensor& x, const Variable& kernel,
                                        const Variable& bias, std::int64_t dim,
                                        const std::optional<Float8State>& float8,
                                        bool training) const {
  const std::int64_t b = x.dim(0), l = x.dim(1), d = x.dim(2);
  const Tensor y =  // [B, L, heads*dim]
      policy_linear(x, reshape(kernel, Shape{d, num_heads_ * dim}),
                    flat_bias(bias, {num_heads_ * dim}), "linear", float8, training);
  return permute(reshape(y, Shape{b, l, num_heads_, dim}), {0, 2, 1, 3});
}

// x [B, L, D] through the query, key and value kernels side by side: [B, L, heads * (2 key_dim +
// value_dim)], q's columns, then k's, then v's (fused_attention_packed's qkv). One product (and
// one FP8 quantisation of x, under mixed_float8) in place of three; the kernels and the biases
// are joined at each call (copies of the weights, small next to the product), and the joined
// kernel's gradient goes back to the three as views.
Tensor MultiHeadAttentionLayer::project_packed(const Tensor& x, bool training) const {
  const std::int64_t d = x.dim(2), qk = num_heads_ * key_dim_, vw = num_heads_ * value_dim_;
  const Tensor w = concat({reshape(query_kernel_, Shape{d, qk}), reshape(key_kernel_, Shape{d, qk}),
                           reshape(value_kernel_, Shape{d, vw})},
                          1);
  Tensor b;
  if (query_bias_.defined()) {
    AutocastScope whole(std::nullopt);  // (in the variables' dtype, as flat_bias)
    b = concat(
        {flat_bias(query_bias_, {qk}), flat_bias(key_bias_, {qk}), flat_bias(value_bias_, {vw})},
        0);
  }
  return policy_linear(x, w, b, "linear", std::nullopt, training);
}

std::vector<Tensor> MultiHeadAttentionLayer::call_multi(const std::vector<Tensor>& inputs,
                                                        const CallContext& ctx) {
  std::vector<Shape> shapes;
  std::vector<DType> dtypes;
  for (const Tensor& x : inputs) {
    shapes.push_back(x.shape());
    dtypes.push_back(x.dtype());
  }
  const Inputs in = split(shapes, dtypes);
  const AttentionCallOptions defaults;
  const AttentionCallOptions& call =
      t_pending.layer == this && t_pending.options ? *t_pending.options : defaults;
  const bool causal = call.use_causal_mask.value_or(options_.use_causal_mask);
  const bool training = ctx.training || call.training;

  const Tensor& query = inputs[static_cast<std::size_t>(in.query)];
  const Tensor& value = inputs[static_cast<std::size_t>(in.value)];
  const Tensor& key = inputs[static_cast<std::size_t>(in.key)];
  const Device device = query.device();

  const double scale = 1.0 / std::sqrt(static_cast<double>(key_dim_));

  Tensor mask;
  if (in.mask >= 0) {
    mask = inputs[static_cast<std::size_t>(in.mask)];
    if (mask.rank() == 3) mask = unsqueeze(mask, 1);  // [B, 1, T, S] against [B, H, T, S]
  }
  // The fused op unless the call needs the weights themselves (returned) or logits in a
  // dtype other than the kernel's. Dropout on the weights runs inside it: its mask a function
  // of a seed drawn from the layer's generator (mixtape/core/dropout_hash.h; draw_seed's, which
  // a captured step redraws at each replay). The composed path's dropout op drops the same
  // weights for the same seed.
  // (The projections come out in the compute dtype.)
  const DType sd = scores_dtype();
  const char* composed_because = call.return_attention_scores ? "the scores are returned"
                                 : sd != (compute_dtype() == kFloat64 ? kFloat64 : kFloat32)
                                     ? "scores_dtype is not the fused kernel's"
                                     : nullptr;
  Tensor heads;  // [B, H, T, vd]
  Tensor scores;
  const bool drop = training && options_.dropout > 0.0;
  const double rate = drop ? options_.dropout : 0.0;
  if (!composed_because && !query_float8_ && query.id() == key.id() && key.id() == value.id()) {
    // Self-attention: q, k and v from one product.
    const Tensor qkv = project_packed(query, training);
    heads = fused_attention_packed(qkv, {num_heads_, key_dim_, value_dim_}, mask, causal, scale,
                                   rate, drop ? draw_seed(generator_, device) : RandomSeed());
    path_ = drop ? "attention: fused (q, k and v in one product; dropout on the weights)"
                 : "attention: fused (q, k and v in one product)";
  } else {
    // [B, H, T, kd], [B, H, S, kd], [B, H, S, vd]
    const Tensor q = project(query, query_kernel_, query_bias_, key_dim_, query_float8_, training);
    const Tensor k = project(key, key_kernel_, key_bias_, key_dim_, key_float8_, training);
    const Tensor v =
        project(value, value_kernel_, value_bias_, value_dim_, value_float8_, training);
    if (!composed_because) {
      heads = fused_attention(q, k, v, mask, causal, scale, rate,
                              drop ? draw_seed(generator_, device) : RandomSeed());
      path_ = drop ? "attention: fused (dropout on the weights)" : "attention: fused";
    } else {
      path_ = fmt::format("attention: composed ({})", composed_because);
      scores = composed_scores(q, k, mask, causal, in.t, in.s, device);
      Tensor weights = scores.dtype() == v.dtype() ? scores : cast(scores, v.dtype());
      if (drop)
        weights = mixtape::dropout(weights, options_.dropout, draw_seed(generator_, device));
      heads = matmul(weights, v);
    }
  }
  const Tensor merged =
      reshape(permute(heads, {0, 2, 1, 3}), Shape{query.dim(0), in.t, num_heads_ * value_dim_});
  const std::int64_t features = product(output_features_);
  Tensor out =
      policy_linear(merged, reshape(output_kernel_, Shape{num_heads_ * value_dim_, features}),
                    flat_bias(output_bias_, {features}), "linear", output_float8_, training);
  std::vector<std::int64_t> dims{query.dim(0), in.t};
  for (auto d : output_features_) dims.push_back(d);
  out = reshape(out, Shape(dims));
  if (call.return_attention_scores) return {out, scores};
  return {out};
}

// The composed path's weights: the logits in scores_dtype (float32 under the mixed
// policies: q and k widened first, so the product is accumulated and kept in float32;
// widening is exact), masked (the mask AND, when causal, the causal mask) and softmaxed.
Tensor MultiHeadAttentionLayer::composed_scores(const Tensor& q, const Tensor& k, Tensor mask,
                                                bool causal, std::int64_t t, std::int64_t s,
                                                Device device) {
  const DType sd = scores_dtype();
  const Tensor qs = q.dtype() == sd ? q : cast(q, sd);
  const Tensor ks = k.dtype() == sd ? k : cast(k, sd);
  const Tensor logits = matmul(qs, transpose(ks, -1, -2));  // [B, H, T, S]
  if (causal) {
    // Made once per (T, S, device) and kept: no host work or host-to-device copy per step.
    if (!causal_mask_.defined() || causal_mask_.dim(0) != t || causal_mask_.dim(1) != s ||
        causal_mask_.device() != device)
      causal_mask_ = make_causal_mask(t, s, device);
    const Tensor c = causal_mask_;
    mask = mask.defined() ? where(c, mask, c) : c;  // mask AND causal
  }
  return masked_softmax(logits, mask, 1.0 / std::sqrt(static_cast<double>(key_dim_)));
}

AttentionResult MultiHeadAttentionLayer::attend(const Tensor& query, const Tensor& value,
                                                const AttentionCallOptions& options,
                                                const Tensor& key) {
  std::vector<Tensor> inputs{query, value};
  if (key.defined()) inputs.push_back(key);
  if (options.attention_mask.defined()) {
    if (options.attention_mask.dtype() != kBool)
      throw DTypeError(fmt::format(
          "layer '{}' (MultiHeadAttention): the attention mask must be bool (true: attend); "
          "got {}{}",
          name(), options.attention_mask.dtype(), options.attention_mask.shape()));
    if (!key.defined()) inputs.push_back(value);  // the key slot, so the mask is the 4th
    inputs.push_back(options.attention_mask);
  }
  const PendingCall previous = t_pending;
  t_pending = PendingCall{this, &options};
  struct Restore {
    PendingCall previous;
    ~Restore() { t_pending = previous; }
  } restore{previous};
  CallContext ctx;
  ctx.training = options.training;
  std::vector<Tensor> ys = apply(inputs, ctx);
  AttentionResult r;
  r.output = ys.front();
  if (ys.size() > 1) r.scores = ys[1];
  return r;
}

LayerPtr<MultiHeadAttentionLayer> MultiHeadAttention(std::int64_t num_heads, std::int64_t key_dim,
                                                     MultiHeadAttentionOptions options) {
  return make_layer<MultiHeadAttentionLayer>(num_heads, key_dim, std::move(options));
}

// --- PositionEmbedding -------------------------------------------------------------------------

PositionEmbeddingLayer::PositionEmbeddingLayer(std::int64_t sequence_length,
                                               PositionEmbeddingOptions options)
    : Layer(detail::common_options(options), "PositionEmbedding"),
      sequence_length_(sequence_length),
      options_(std::move(options)) {
  if (sequence_length_ <= 0)
    throw ValueError(
        fmt::format("layer '{}' (PositionEmbedding): sequence_length must be positive; got {}",
                    name(), sequence_length_));
}

void PositionEmbeddingLayer::check_length(const Shape& s) const {
  if (s.rank() < 3)
    throw ShapeError(
        fmt::format("expected an input of rank >= 3 ([batch, length, features]); got shape {}",
                    detail::shape_with_none(s)));
  if (s[1] > sequence_length_)
    throw ShapeError(fmt::format(
        "the input is {} positions long, more than the position table's sequence_length {} "
        "(input shape {})",
        s[1], sequence_length_, detail::shape_with_none(s)));
}

void PositionEmbeddingLayer::build(const Shape& input_shape) {
  check_length(input_shape);
  embeddings_ =
      add_weight("embeddings", {sequence_length_, input_shape.back()}, options_.initializer);
  set_input_spec(InputSpec{.min_rank = 3, .axes = {{-1, input_shape.back()}}});
}

Tensor PositionEmbeddingLayer::call(const Tensor& x, const CallContext&) {
  check_length(x.shape());
  const Tensor rows = slice(embeddings_, 0, 0, x.dim(1));  // [T, D]
  return expand(rows, x.shape());
}

std::optional<Shape> PositionEmbeddingLayer::compute_output_shape(const Shape& input_shape) const {
  check_length(input_shape);
  return input_shape;
}

const Variable& PositionEmbeddingLayer::embeddings() const {
  return detail::built_weight(*this, embeddings_, "embeddings");
}

LayerPtr<PositionEmbeddingLayer> PositionEmbedding(std::int64_t sequence_length,
                                                   PositionEmbeddingOptions options) {
  return make_layer<PositionEmbeddingLayer>(sequence_length, std::move(options));
}

}  // namespace mixtape::layers
