// The ONNX forms of the built-in layers: each exporter writes what the layer's call computes
// at inference (layers/*.cpp), in the same dtypes. Images are NHWC in mixtape and NCHW in
// ONNX's Conv and pools: those layers transpose in and out, and remember each value's NCHW
// twin so that consecutive ones transpose once.
#include "onnx_export/layers.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "mixtape/autograd/ops.h"
#include "mixtape/core/error.h"
#include "mixtape/layers/attention.h"
#include "mixtape/layers/config.h"
#include "onnx_export/graph_builder.h"

namespace mixtape::onnx_detail {
namespace {

using layers::Config;
using Values = std::vector<OnnxValue>;

OnnxValue scalar(OnnxGraph& g, double value, DType dtype, const std::string& hint) {
  return g.constant(full({}, value, dtype), hint);
}

int normalized_axis(std::int64_t axis, std::size_t rank) {
  return static_cast<int>(axis < 0 ? axis + static_cast<std::int64_t>(rank) : axis);
}

// --- Activations ------------------------------------------------------------------------

// Whether `name` acts on each element alone (so it commutes with a transpose).
bool elementwise_activation(const std::string& name) {
  return name != "softmax" && name != "log_softmax";
}

// The activation called `name` on x, in x's dtype; gelu's arithmetic in float32 for 16-bit
// x, as mixtape's kernel computes it.
OnnxValue activation(OnnxGraph& g, const OnnxValue& x, const std::string& name) {
  const DType dt = x.dtype;
  if (name == "linear") return x;
  if (name == "relu") return g.op("Relu", {x}, dt);
  if (name == "sigmoid") return g.op("Sigmoid", {x}, dt);
  if (name == "tanh") return g.op("Tanh", {x}, dt);
  if (name == "softmax") return g.op("Softmax", {x}, dt, {{"axis", -1}});
  if (name == "log_softmax") return g.op("LogSoftmax", {x}, dt, {{"axis", -1}});
  const DType wide = dt.is_reduced_float() ? kFloat32 : dt;
  const OnnxValue w = g.cast(x, wide);
  const OnnxValue half_x = g.op("Mul", {w, scalar(g, 0.5, wide, "half")}, wide);
  if (name == "gelu") {  // x/2 (1 + erf(x / sqrt 2)) (opset 17 has no Gelu)
    const OnnxValue e =
        g.op("Erf", {g.op("Mul", {w, scalar(g, M_SQRT1_2, wide, "sqrt1_2")}, wide)}, wide);
    return g.cast(g.op("Mul", {half_x, g.op("Add", {e, scalar(g, 1.0, wide, "one")}, wide)}, wide),
                  dt);
  }
  if (name == "gelu_tanh") {  // x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    const OnnxValue cube = g.op("Mul", {g.op("Mul", {w, w}, wide), w}, wide);
    const OnnxValue inner =
        g.op("Add", {w, g.op("Mul", {cube, scalar(g, 0.044715, wide, "gelu_c")}, wide)}, wide);
    const OnnxValue t = g.op(
        "Tanh", {g.op("Mul", {inner, scalar(g, std::sqrt(2.0 / M_PI), wide, "sqrt2_pi")}, wide)},
        wide);
    return g.cast(g.op("Mul", {half_x, g.op("Add", {t, scalar(g, 1.0, wide, "one")}, wide)}, wide),
                  dt);
  }
  throw ValueError(fmt::format("activation '{}' has no ONNX form", name));
}

// --- NHWC <-> NCHW ----------------------------------------------------------------------

OnnxValue to_nchw(OnnxGraph& g, const OnnxValue& x) {
  auto* b = dynamic_cast<GraphBuilder*>(&g);
  if (b != nullptr)
    if (auto it = b->nchw_of.find(x.name); it != b->nchw_of.end()) return it->second;
  return g.op("Transpose", {x}, x.dtype, {{"perm", std::vector<std::int64_t>{0, 3, 1, 2}}});
}

OnnxValue from_nchw(OnnxGraph& g, const OnnxValue& y) {
  const OnnxValue t =
      g.op("Transpose", {y}, y.dtype, {{"perm", std::vector<std::int64_t>{0, 2, 3, 1}}});
  if (auto* b = dynamic_cast<GraphBuilder*>(&g)) b->nchw_of[t.name] = y;
  return t;
}

// ONNX's pads [top, left, bottom, right] for a window over an NHWC input of `shape`: none
// for "valid"; for "same" TensorFlow's rule (the output ceil(in / stride), the odd pixel of
// padding at the end).
std::vector<std::int64_t> pads(const Shape& shape, const std::vector<std::int64_t>& window,
                               const std::vector<std::int64_t>& strides,
                               const std::string& padding) {
  std::vector<std::int64_t> p(4, 0);
  if (padding != "same") return p;
  for (std::size_t a = 0; a < 2; ++a) {
    const AxisPadding ap = window_padding(shape[a + 1], window[a], strides[a], Padding::Same);
    p[a] = ap.before;
    p[a + 2] = ap.after;
  }
  return p;
}

// --- Core layers ------------------------------------------------------------------------

Values dense(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  const DType cd = c.compute_dtype;
  OnnxValue y = g.op("MatMul", {c.inputs[0], g.weight(c.layer, "kernel", cd)}, cd);
  if (cfg.get_bool("use_bias")) y = g.op("Add", {y, g.weight(c.layer, "bias", cd)}, cd);
  return {activation(g, y, cfg.get_string("activation"))};
}

Values activation_layer(OnnxGraph& g, const OnnxLayerCall& c) {
  return {activation(g, c.inputs[0], c.layer.get_config().get_string("activation"))};
}

Values identity(OnnxGraph&, const OnnxLayerCall& c) { return {c.inputs[0]}; }

Values flatten(OnnxGraph& g, const OnnxLayerCall& c) {
  return {g.op("Flatten", {c.inputs[0]}, c.compute_dtype, {{"axis", 1}})};
}

Values reshape_layer(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  std::vector<std::int64_t> shape{0};  // 0: the batch, as it comes
  for (std::int64_t d : cfg.get_ints("target_shape")) shape.push_back(d);
  return {g.op("Reshape", {c.inputs[0], g.ints(shape, "shape")}, c.compute_dtype)};
}

Values slice_layer(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  const int axis = normalized_axis(cfg.get_int("axis"), c.input_specs[0].shape.rank());
  const std::int64_t stop =
      cfg.has("stop") ? cfg.get_int("stop") : std::numeric_limits<std::int64_t>::max();
  OnnxValue y = g.op("Slice",
                     {c.inputs[0], g.ints({cfg.get_int("start")}, "starts"), g.ints({stop}, "ends"),
                      g.ints({axis}, "axes")},
                     c.compute_dtype);
  if (cfg.get_bool("squeeze")) y = g.op("Squeeze", {y, g.ints({axis}, "axes")}, c.compute_dtype);
  return {y};
}

Values embedding(OnnxGraph& g, const OnnxLayerCall& c) {
  OnnxValue ids = c.raw_inputs[0];
  if (ids.dtype != kInt64 && ids.dtype != kInt32) ids = g.cast(ids, kInt64);
  const OnnxValue table = g.weight(c.layer, "embeddings", g.exported(c.layer.variable_dtype()));
  return {g.cast(g.op("Gather", {table, ids}, table.dtype, {{"axis", 0}}), c.compute_dtype)};
}

Values position_embedding(OnnxGraph& g, const OnnxLayerCall& c) {
  const Shape& in = c.input_specs[0].shape;
  const std::int64_t t = in[in.rank() - 2];
  const OnnxValue table = g.weight(c.layer, "embeddings", g.exported(c.layer.variable_dtype()));
  const OnnxValue rows =
      g.op("Slice", {table, g.ints({0}, "starts"), g.ints({t}, "ends"), g.ints({0}, "axes")},
           table.dtype);
  const OnnxValue shape = g.op("Shape", {c.raw_inputs[0]}, kInt64);
  return {g.op("Expand", {g.cast(rows, c.compute_dtype), shape}, c.compute_dtype)};
}

// --- Convolution and pooling ------------------------------------------------------------

Values conv2d(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  const DType cd = c.compute_dtype;
  const std::vector<std::int64_t> k = cfg.get_ints("kernel_size"), s = cfg.get_ints("strides");
  Values in{to_nchw(g, c.inputs[0]), g.weight(c.layer, "kernel", cd, std::nullopt, {3, 2, 0, 1})};
  if (cfg.get_bool("use_bias")) in.push_back(g.weight(c.layer, "bias", cd));
  OnnxValue y = g.op("Conv", in, cd,
                     {{"kernel_shape", k},
                      {"strides", s},
                      {"pads", pads(c.input_specs[0].shape, k, s, cfg.get_string("padding"))},
                      {"dilations", std::vector<std::int64_t>{1, 1}},
                      {"group", 1}});
  const std::string act = cfg.get_string("activation");
  if (elementwise_activation(act)) return {from_nchw(g, activation(g, y, act))};
  return {activation(g, from_nchw(g, y), act)};
}

OnnxExporter pooling(const char* op) {
  return [op](OnnxGraph& g, const OnnxLayerCall& c) -> Values {
    const Config cfg = c.layer.get_config();
    const std::vector<std::int64_t> k = cfg.get_ints("pool_size");
    const std::vector<std::int64_t> s = cfg.has("strides") ? cfg.get_ints("strides") : k;
    std::vector<OnnxAttribute> attrs{
        {"kernel_shape", k},
        {"strides", s},
        {"pads", pads(c.input_specs[0].shape, k, s, cfg.get_string("padding"))}};
    // TensorFlow's "same" average leaves the padding out of the count (ONNX's default too).
    if (std::string(op) == "AveragePool") attrs.emplace_back("count_include_pad", 0);
    return {from_nchw(g, g.op(op, {to_nchw(g, c.inputs[0])}, c.compute_dtype, attrs))};
  };
}

Values global_average_pooling(OnnxGraph& g, const OnnxLayerCall& c) {
  const OnnxValue pooled = g.op("GlobalAveragePool", {to_nchw(g, c.inputs[0])}, c.compute_dtype);
  return {g.op("Flatten", {pooled}, c.compute_dtype, {{"axis", 1}})};  // [n, c, 1, 1] -> [n, c]
}

// --- Normalization ----------------------------------------------------------------------

// The dtype normalization layers compute in: their variables' (float32 under the mixed
// policies: a 16-bit input is normalised in float32, and the result rounded).
DType normalization_dtype(OnnxGraph& g, const layers::Layer& layer) {
  const DType v = layer.variable_dtype();
  return g.exported(v.is_reduced_float() ? kFloat32 : v);
}

// A weight, or a constant `fill` of `n` elements when the layer was made without it.
OnnxValue weight_or(OnnxGraph& g, const layers::Layer& layer, bool has, const std::string& name,
                    DType dtype, std::int64_t n, double fill) {
  return has ? g.weight(layer, name, dtype) : g.constant(full({n}, fill, dtype), name);
}

Values batch_normalization(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  const DType pd = normalization_dtype(g, c.layer);
  const Shape& shape = c.input_specs[0].shape;
  const std::size_t rank = shape.rank();
  const int axis = normalized_axis(cfg.get_int("axis"), rank);
  const std::int64_t n = shape[static_cast<std::size_t>(axis)];
  // ONNX normalises axis 1: NHWC images go through their NCHW twin, other layouts through a
  // transpose that brings the axis there.
  const bool image = rank == 4 && axis == 3;
  std::vector<std::int64_t> perm;
  if (!image && axis > 1) {
    perm = {0, axis};
    for (int a = 1; a < static_cast<int>(rank); ++a)
      if (a != axis) perm.push_back(a);
  }
  OnnxValue x = c.inputs[0];
  if (image) x = to_nchw(g, x);
  if (!perm.empty()) x = g.op("Transpose", {x}, x.dtype, {{"perm", perm}});
  OnnxValue y =
      g.op("BatchNormalization",
           {g.cast(x, pd), weight_or(g, c.layer, cfg.get_bool("scale"), "gamma", pd, n, 1.0),
            weight_or(g, c.layer, cfg.get_bool("center"), "beta", pd, n, 0.0),
            g.weight(c.layer, "moving_mean", pd), g.weight(c.layer, "moving_variance", pd)},
           pd, {{"epsilon", cfg.get_double("epsilon")}});
  y = g.cast(y, c.compute_dtype);
  if (image) return {from_nchw(g, y)};
  if (!perm.empty()) {
    std::vector<std::int64_t> inverse(perm.size());
    for (std::size_t i = 0; i < perm.size(); ++i)
      inverse[static_cast<std::size_t>(perm[i])] = static_cast<std::int64_t>(i);
    y = g.op("Transpose", {y}, y.dtype, {{"perm", inverse}});
  }
  return {y};
}

Values layer_normalization(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  const DType pd = normalization_dtype(g, c.layer);
  const std::int64_t n = c.input_specs[0].shape.back();
  Values in{g.cast(c.inputs[0], pd),
            weight_or(g, c.layer, cfg.get_bool("scale"), "gamma", pd, n, 1.0)};
  if (cfg.get_bool("center")) in.push_back(g.weight(c.layer, "beta", pd));
  const OnnxValue y =
      g.op("LayerNormalization", in, pd,
           {{"axis", -1}, {"epsilon", cfg.get_double("epsilon")}, {"stash_type", 1}});
  return {g.cast(y, c.compute_dtype)};
}

// --- Merging ----------------------------------------------------------------------------

// The inputs in the compute dtype (merge layers cast integer and boolean inputs too).
Values merged_inputs(OnnxGraph& g, const OnnxLayerCall& c) {
  Values xs;
  for (const OnnxValue& x : c.raw_inputs) xs.push_back(g.cast(x, c.compute_dtype));
  return xs;
}

// Add, Subtract, ...: a chain of binary ops over the inputs in order, as the layer computes.
OnnxExporter elementwise_merge(const char* op, bool average) {
  return [op, average](OnnxGraph& g, const OnnxLayerCall& c) -> Values {
    const Values xs = merged_inputs(g, c);
    OnnxValue y = xs.front();
    for (std::size_t i = 1; i < xs.size(); ++i) y = g.op(op, {y, xs[i]}, c.compute_dtype);
    if (average)
      y = g.op(
          "Mul",
          {y, scalar(g, 1.0 / static_cast<double>(xs.size()), c.compute_dtype, "inverse_count")},
          c.compute_dtype);
    return {y};
  };
}

Values concatenate(OnnxGraph& g, const OnnxLayerCall& c) {
  return {g.op("Concat", merged_inputs(g, c), c.compute_dtype,
               {{"axis", c.layer.get_config().get_int("axis")}})};
}

// Dot: x / sqrt(max(sum(x^2), 1e-12)) along the axis when normalising (the sum in float32
// for 16-bit inputs), then one batched product, as layers/merge.cpp computes it.
Values dot(OnnxGraph& g, const OnnxLayerCall& c) {
  const Config cfg = c.layer.get_config();
  const DType cd = c.compute_dtype;
  Values xs = merged_inputs(g, c);
  const std::vector<std::int64_t> axes = cfg.get_ints("axes");
  const std::size_t ra = c.input_specs[0].shape.rank(), rb = c.input_specs[1].shape.rank();
  if (ra < 2 || ra > 3 || rb < 2 || rb > 3)
    throw ValueError("its ONNX form takes inputs of rank 2 or 3");
  const int ax = normalized_axis(axes.front(), ra), bx = normalized_axis(axes.back(), rb);
  if (cfg.get_bool("normalize")) {
    const int axis[2] = {ax, bx};
    for (std::size_t i = 0; i < 2; ++i) {
      const DType wide = cd.is_reduced_float() ? kFloat32 : cd;
      const OnnxValue w = g.cast(xs[i], wide);
      const OnnxValue ss = g.op("ReduceSumSquare", {w}, wide,
                                {{"axes", std::vector<std::int64_t>{axis[i]}}, {"keepdims", 1}});
      const OnnxValue norm =
          g.op("Sqrt", {g.op("Max", {ss, scalar(g, 1e-12, wide, "epsilon")}, wide)}, wide);
      xs[i] = g.cast(g.op("Mul", {w, g.op("Reciprocal", {norm}, wide)}, wide), cd);
    }
  }
  const std::vector<std::int64_t> swap{0, 2, 1};
  OnnxValue a = ra == 2   ? g.op("Unsqueeze", {xs[0], g.ints({1}, "axes")}, cd)
                : ax == 1 ? g.op("Transpose", {xs[0]}, cd, {{"perm", swap}})
                          : xs[0];
  OnnxValue b = rb == 2   ? g.op("Unsqueeze", {xs[1], g.ints({2}, "axes")}, cd)
                : bx == 2 ? g.op("Transpose", {xs[1]}, cd, {{"perm", swap}})
                          : xs[1];
  const OnnxValue y = g.op("MatMul", {a, b}, cd);  // [n, m, k]
  if (ra == 2 && rb == 2) return {g.op("Reshape", {y, g.ints({0, 1}, "shape")}, cd)};
  if (rb == 2) return {g.op("Squeeze", {y, g.ints({2}, "axes")}, cd)};
  if (ra == 2) return {g.op("Squeeze", {y, g.ints({1}, "axes")}, cd)};
  return {y};
}

// --- Attention ----------------------------------------------------------------------------

// MultiHeadAttention as its fused path computes at inference: the projections in the compute
// dtype, the logits, the masked softmax and the weighted sum of the values in the scores
// dtype (float32 under the mixed policies), the heads' result rounded to the compute dtype
// before the output projection. Positions a mask input hides get weight 0 (a query row with
// none left gets zeros, as in mixtape).
Values multi_head_attention(OnnxGraph& g, const OnnxLayerCall& c) {
  const auto& mha = dynamic_cast<const layers::MultiHeadAttentionLayer&>(c.layer);
  const Config cfg = c.layer.get_config();
  const DType cd = c.compute_dtype, sd = g.exported(mha.scores_dtype());
  const std::int64_t h = mha.num_heads(), kd = mha.key_dim(), vd = mha.value_dim();
  const bool bias = cfg.get_bool("use_bias");
  const std::size_t n = c.inputs.size();
  const OnnxValue& query = c.inputs[0];
  const OnnxValue& value = n > 1 ? c.inputs[1] : c.inputs[0];
  const OnnxValue& key = n > 2 ? c.inputs[2] : value;
  const Shape& q_shape = c.input_specs[0].shape;
  const Shape& v_shape = c.input_specs[n > 1 ? 1 : 0].shape;
  const std::int64_t t = q_shape[1], s = v_shape[1];

  // x [b, t, d] -> [b, heads, t, dim] (or [b, heads, dim, t] for the keys).
  auto project = [&](const OnnxValue& x, const std::string& name, std::int64_t d, std::int64_t dim,
                     std::vector<std::int64_t> perm) {
    OnnxValue y =
        g.op("MatMul", {x, g.weight(c.layer, name + "/kernel", cd, Shape{d, h * dim})}, cd);
    if (bias) y = g.op("Add", {y, g.weight(c.layer, name + "/bias", cd, Shape{h * dim})}, cd);
    y = g.op("Reshape", {y, g.ints({0, 0, h, dim}, "shape")}, cd);
    return g.op("Transpose", {y}, cd, {{"perm", std::move(perm)}});
  };
  const OnnxValue q = project(query, "query", q_shape.back(), kd, {0, 2, 1, 3});
  const OnnxValue k = project(key, "key", c.input_specs[n > 2 ? 2 : (n > 1 ? 1 : 0)].shape.back(),
                              kd, {0, 2, 3, 1});
  const OnnxValue v = project(value, "value", v_shape.back(), vd, {0, 2, 1, 3});

  OnnxValue logits = g.op("MatMul", {g.cast(q, sd), g.cast(k, sd)}, sd);
  logits =
      g.op("Mul", {logits, scalar(g, 1.0 / std::sqrt(static_cast<double>(kd)), sd, "scale")}, sd);
  std::optional<OnnxValue> mask;
  if (n > 3) {  // bool [b, t, s] (or broadcastable): per head
    mask = c.input_specs[3].shape.rank() == 3
               ? g.op("Unsqueeze", {c.inputs[3], g.ints({1}, "axes")}, kBool)
               : c.inputs[3];
  }
  if (cfg.get_bool("use_causal_mask")) {
    std::vector<bool> lower(static_cast<std::size_t>(t * s));
    for (std::int64_t i = 0; i < t; ++i)
      for (std::int64_t j = 0; j < s; ++j) lower[static_cast<std::size_t>(i * s + j)] = j <= i;
    const OnnxValue causal = g.constant(from_vector(lower, Shape{t, s}), "causal_mask");
    mask = mask ? g.op("And", {*mask, causal}, kBool) : causal;
  }
  if (mask)
    logits = g.op(
        "Where",
        {*mask, logits, scalar(g, -std::numeric_limits<double>::infinity(), sd, "minus_infinity")},
        sd);
  OnnxValue weights = g.op("Softmax", {logits}, sd, {{"axis", -1}});
  if (n > 3) weights = g.op("Where", {*mask, weights, scalar(g, 0.0, sd, "zero")}, sd);
  OnnxValue heads = g.cast(g.op("MatMul", {weights, g.cast(v, sd)}, sd), cd);  // [b, h, t, vd]
  heads = g.op("Transpose", {heads}, cd, {{"perm", std::vector<std::int64_t>{0, 2, 1, 3}}});
  heads = g.op("Reshape", {heads, g.ints({0, 0, h * vd}, "shape")}, cd);

  const Shape out_features = c.output_specs[0].shape;
  std::vector<std::int64_t> features(out_features.dims().begin() + 2, out_features.dims().end());
  const std::int64_t p =
      std::accumulate(features.begin(), features.end(), std::int64_t{1}, std::multiplies<>());
  OnnxValue y = g.op(
      "MatMul", {heads, g.weight(c.layer, "attention_output/kernel", cd, Shape{h * vd, p})}, cd);
  if (bias) y = g.op("Add", {y, g.weight(c.layer, "attention_output/bias", cd, Shape{p})}, cd);
  if (features.size() != 1) {
    std::vector<std::int64_t> shape{0, 0};
    shape.insert(shape.end(), features.begin(), features.end());
    y = g.op("Reshape", {y, g.ints(shape, "shape")}, cd);
  }
  return {y};
}

}  // namespace

std::map<std::string, OnnxExporter> builtin_exporters() {
  return {
      {"InputLayer", identity},
      {"Dense", dense},
      {"Activation", activation_layer},
      {"Flatten", flatten},
      {"Reshape", reshape_layer},
      {"Slice", slice_layer},
      // Inference: no dropout, no augmentation.
      {"Dropout", identity},
      {"RandomFlip", identity},
      {"RandomTranslation", identity},
      {"Embedding", embedding},
      {"Conv2D", conv2d},
      {"MaxPooling2D", pooling("MaxPool")},
      {"AveragePooling2D", pooling("AveragePool")},
      {"GlobalAveragePooling2D", global_average_pooling},
      {"BatchNormalization", batch_normalization},
      {"LayerNormalization", layer_normalization},
      {"Add", elementwise_merge("Add", false)},
      {"Subtract", elementwise_merge("Sub", false)},
      {"Multiply", elementwise_merge("Mul", false)},
      {"Average", elementwise_merge("Add", true)},
      {"Maximum", elementwise_merge("Max", false)},
      {"Minimum", elementwise_merge("Min", false)},
      {"Concatenate", concatenate},
      {"Dot", dot},
      {"MultiHeadAttention", multi_head_attention},
      {"PositionEmbedding", position_embedding},
  };
}

}  // namespace mixtape::onnx_detail
