// MultiHeadAttention and PositionEmbedding: the forward pass against a direct float64
// computation (masks, causal, a separate key, the scores), float64 gradient checks with
// masks, the mixed policies (float32 logits, float16 logits near 1e4), bad input, configs.
// (The per-layer float64 gradient check of every weight and the policy sweep run in
// tests/test_layers.cpp's layer_cases.)
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "gradcheck.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using mtest::Inputs;

namespace {

mt::Tensor random(const mt::Shape& shape, mt::DType dt, std::uint64_t seed, double lo = -1.0,
                  double hi = 1.0) {
  mt::Generator gen(seed);
  return mt::uniform(shape, lo, hi, dt, mt::Device::cpu(), &gen);
}

mt::Tensor bool_tensor(const std::vector<bool>& v, const mt::Shape& shape) {
  return mt::from_vector(v, shape, mt::kBool);
}

double max_abs_diff(const mt::Tensor& a, const mt::Tensor& b) {
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  REQUIRE(av.size() == bv.size());
  double m = 0.0;
  for (std::size_t i = 0; i < av.size(); ++i) m = std::max(m, std::abs(av[i] - bv[i]));
  return m;
}

struct Reference {
  std::vector<double> output;  // [B, T, F]
  std::vector<double> scores;  // [B, H, T, S]
};

// Multi-head attention in float64 loops, from the layer's weights (Keras' layout).
Reference attention_reference(const ml::MultiHeadAttentionLayer& layer, const mt::Tensor& query,
                              const mt::Tensor& value, const mt::Tensor& key,
                              const std::vector<bool>& mask, bool causal) {
  const auto w = layer.get_weights();
  const auto wq = w[0].to_vector<double>(), bq = w[1].to_vector<double>();
  const auto wk = w[2].to_vector<double>(), bk = w[3].to_vector<double>();
  const auto wv = w[4].to_vector<double>(), bv = w[5].to_vector<double>();
  const auto wo = w[6].to_vector<double>(), bo = w[7].to_vector<double>();
  const std::int64_t B = query.dim(0), T = query.dim(1), D = query.dim(2), S = value.dim(1);
  const std::int64_t Dv = value.dim(2), Dk = key.dim(2);
  const std::int64_t H = layer.num_heads(), kd = layer.key_dim(), vd = layer.value_dim();
  const std::int64_t F = static_cast<std::int64_t>(bo.size());
  const auto xq = query.to_vector<double>(), xv = value.to_vector<double>(),
             xk = key.to_vector<double>();
  // proj[b, l, h, e] = sum_d x[b, l, d] W[d, h, e] + bias[h, e]
  auto project = [&](const std::vector<double>& x, std::int64_t L, std::int64_t Din,
                     const std::vector<double>& W, const std::vector<double>& bias,
                     std::int64_t E) {
    std::vector<double> y(static_cast<std::size_t>(B * L * H * E));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t l = 0; l < L; ++l)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t e = 0; e < E; ++e) {
            double acc = bias[static_cast<std::size_t>(h * E + e)];
            for (std::int64_t d = 0; d < Din; ++d)
              acc += x[static_cast<std::size_t>((b * L + l) * Din + d)] *
                     W[static_cast<std::size_t>((d * H + h) * E + e)];
            y[static_cast<std::size_t>(((b * L + l) * H + h) * E + e)] = acc;
          }
    return y;
  };
  const auto q = project(xq, T, D, wq, bq, kd);
  const auto k = project(xk, S, Dk, wk, bk, kd);
  const auto v = project(xv, S, Dv, wv, bv, vd);
  Reference r;
  r.scores.assign(static_cast<std::size_t>(B * H * T * S), 0.0);
  std::vector<double> heads(static_cast<std::size_t>(B * T * H * vd), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(kd));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        std::vector<double> logit(static_cast<std::size_t>(S));
        std::vector<bool> keep(static_cast<std::size_t>(S));
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t s = 0; s < S; ++s) {
          double acc = 0;
          for (std::int64_t e = 0; e < kd; ++e)
            acc += q[static_cast<std::size_t>(((b * T + t) * H + h) * kd + e)] *
                   k[static_cast<std::size_t>(((b * S + s) * H + h) * kd + e)];
          logit[static_cast<std::size_t>(s)] = acc * scale;
          bool ok = mask.empty() || mask[static_cast<std::size_t>((b * T + t) * S + s)];
          if (causal && s > t) ok = false;
          keep[static_cast<std::size_t>(s)] = ok;
          if (ok) m = std::max(m, acc * scale);
        }
        double z = 0;
        for (std::int64_t s = 0; s < S; ++s)
          if (keep[static_cast<std::size_t>(s)])
            z += std::exp(logit[static_cast<std::size_t>(s)] - m);
        for (std::int64_t s = 0; s < S; ++s) {
          const double p = keep[static_cast<std::size_t>(s)]
                               ? std::exp(logit[static_cast<std::size_t>(s)] - m) / z
                               : 0.0;
          r.scores[static_cast<std::size_t>(((b * H + h) * T + t) * S + s)] = p;
          for (std::int64_t e = 0; e < vd; ++e)
            heads[static_cast<std::size_t>(((b * T + t) * H + h) * vd + e)] +=
                p * v[static_cast<std::size_t>(((b * S + s) * H + h) * vd + e)];
        }
      }
  r.output.assign(static_cast<std::size_t>(B * T * F), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t f = 0; f < F; ++f) {
        double acc = bo[static_cast<std::size_t>(f)];
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t e = 0; e < vd; ++e)
            acc += heads[static_cast<std::size_t>(((b * T + t) * H + h) * vd + e)] *
                   wo[static_cast<std::size_t>((h * vd + e) * F + f)];
        r.output[static_cast<std::size_t>((b * T + t) * F + f)] = acc;
      }
  return r;
}

// Random float64 weights (biases too: the initial zeros would hide their terms).
void randomize(ml::Layer& layer, std::uint64_t seed) {
  for (auto v : layer.trainable_variables())
    v.assign(random(v.shape(), v.dtype(), seed++, -0.7, 0.7));
}

std::vector<bool> padding_mask(std::int64_t B, std::int64_t T, std::int64_t S,
                               const std::vector<std::int64_t>& lengths) {
  std::vector<bool> m(static_cast<std::size_t>(B * T * S));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t s = 0; s < S; ++s)
        m[static_cast<std::size_t>((b * T + t) * S + s)] = s < lengths[static_cast<std::size_t>(b)];
  return m;
}

}  // namespace

TEST_CASE("MultiHeadAttention: forward against float64 loops (masks, causal, key, scores)",
          "[attention][layers]") {
  mt::PolicyScope scope("float64");
  const std::int64_t B = 2, T = 5, S = 7;
  const mt::Tensor query = random({B, T, 6}, mt::kFloat64, 1);
  const mt::Tensor value = random({B, S, 4}, mt::kFloat64, 2);
  const mt::Tensor key = random({B, S, 3}, mt::kFloat64, 3);
  auto mha = ml::MultiHeadAttention(3, 4, {.value_dim = 5, .output_shape = {2}});
  mha->attend(query, value, {}, key);
  randomize(*mha, 10);
  CHECK(mha->get_weights()[0].shape() == mt::Shape{6, 3, 4});  // [D, heads, key_dim]
  CHECK(mha->get_weights()[6].shape() == mt::Shape{3, 5, 2});  // [heads, value_dim, out]

  // Batch 0 sees 3 keys, batch 1 all but the last; one query row of batch 1 sees none.
  std::vector<bool> mask = padding_mask(B, T, S, {3, 6});
  for (std::int64_t s = 0; s < S; ++s) mask[static_cast<std::size_t>((1 * T + 2) * S + s)] = false;
  const mt::Tensor mask_t = bool_tensor(mask, {B, T, S});

  for (const bool causal : {false, true})
    for (const bool masked : {false, true}) {
      INFO("causal " << causal << ", masked " << masked);
      const auto r = mha->attend(query, value,
                                 {.attention_mask = masked ? mask_t : mt::Tensor(),
                                  .use_causal_mask = causal,
                                  .return_attention_scores = true},
                                 key);
      const Reference ref =
          attention_reference(*mha, query, value, key, masked ? mask : std::vector<bool>{}, causal);
      REQUIRE(r.output.shape() == mt::Shape{B, T, 2});
      REQUIRE(r.scores.shape() == mt::Shape{B, 3, T, S});
      CHECK(r.output.dtype() == mt::kFloat64);
      const auto out = r.output.to_vector<double>(), sc = r.scores.to_vector<double>();
      double e_out = 0, e_sc = 0;
      for (std::size_t i = 0; i < out.size(); ++i)
        e_out = std::max(e_out, std::abs(out[i] - ref.output[i]));
      for (std::size_t i = 0; i < sc.size(); ++i)
        e_sc = std::max(e_sc, std::abs(sc[i] - ref.scores[i]));
      CHECK(e_out < 1e-12);
      CHECK(e_sc < 1e-13);
    }
  // Without the options the layer call is the unmasked one; a [T, S] mask broadcasts.
  const auto plain = mha->attend(query, value, {}, key).output;
  CHECK(max_abs_diff(mha({query, value, key}), plain) == 0.0);
  const mt::Tensor causal_2d = bool_tensor(
      [&] {
        std::vector<bool> c(static_cast<std::size_t>(T * S));
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t s = 0; s < S; ++s) c[static_cast<std::size_t>(t * S + s)] = s <= t;
        return c;
      }(),
      {T, S});
  CHECK(max_abs_diff(mha->attend(query, value, {.attention_mask = causal_2d}, key).output,
                     mha->attend(query, value, {.use_causal_mask = true}, key).output) == 0.0);
  // The causal mask is kept between calls: a shorter query gets one of its own length.
  const mt::Tensor q3 = mt::contiguous(mt::slice(query, 1, 0, 3));
  const mt::Tensor causal_3 = mt::contiguous(mt::slice(causal_2d, 0, 0, 3));
  CHECK(max_abs_diff(mha->attend(q3, value, {.attention_mask = causal_3}, key).output,
                     mha->attend(q3, value, {.use_causal_mask = true}, key).output) == 0.0);
  const Reference ref3 = attention_reference(*mha, q3, value, key, {}, /*causal=*/true);
  const auto out3 =
      mha->attend(q3, value, {.use_causal_mask = true}, key).output.to_vector<double>();
  for (std::size_t i = 0; i < out3.size(); ++i) CHECK(std::abs(out3[i] - ref3.output[i]) < 1e-12);
}

TEST_CASE("gradcheck: MultiHeadAttention inputs (no mask, padding mask, causal)",
          "[attention][grad]") {
  mt::PolicyScope scope("float64");
  const std::int64_t B = 2, T = 4, S = 5;
  auto mha = ml::MultiHeadAttention(2, 3, {.value_dim = 2});
  const mt::Tensor query = random({B, T, 4}, mt::kFloat64, 4);
  const mt::Tensor value = random({B, S, 3}, mt::kFloat64, 5);
  const mt::Tensor key = random({B, S, 2}, mt::kFloat64, 6);
  mha->attend(query, value, {}, key);
  randomize(*mha, 20);
  const mt::Tensor mask = bool_tensor(padding_mask(B, T, S, {2, 5}), {B, T, S});
  CHECK_GRADCHECK("attention, no mask",
                  [&](const Inputs& v) { return mha->attend(v[0], v[1], {}, v[2]).output; },
                  {query, value, key});
  CHECK_GRADCHECK("attention, padding mask",
                  [&](const Inputs& v) {
                    return mha->attend(v[0], v[1], {.attention_mask = mask}, v[2]).output;
                  },
                  {query, value, key});
  CHECK_GRADCHECK(
      "attention, causal + padding, scores",
      [&](const Inputs& v) {
        const auto r = mha->attend(
            v[0], v[1],
            {.attention_mask = mask, .use_causal_mask = true, .return_attention_scores = true},
            v[2]);
        return mt::concat({mt::reshape(r.output, {-1}), mt::reshape(r.scores, {-1})}, 0);
      },
      {query, value, key});
  // Self-attention (the same tensor as query, value and key): the gradient adds up.
  auto self = ml::MultiHeadAttention(2, 2, {.use_causal_mask = true});
  self(query);
  randomize(*self, 30);
  CHECK_GRADCHECK("self-attention, causal", [&](const Inputs& v) { return self(v[0]); }, {query});
}

TEST_CASE("MultiHeadAttention: mixed policies keep the logits and softmax in float32",
          "[attention][policies]") {
  const std::int64_t B = 2, T = 6;
  std::vector<mt::Tensor> weights;
  mt::Tensor ref;
  const mt::Tensor x = random({B, T, 8}, mt::kFloat32, 7);
  {
    mt::PolicyScope scope("float32");
    auto mha = ml::MultiHeadAttention(2, 4, {.use_causal_mask = true});
    mha(x);
    // Weights that make logits of about 1e4: beyond float16's precision, not its range.
    for (auto v : mha->trainable_variables())
      v.assign(random(v.shape(), mt::kFloat32, 40, -1.0, 1.0) *
               (v.name().find("query/kernel") != std::string::npos ||
                        v.name().find("key/kernel") != std::string::npos
                    ? 30.0
                    : 1.0));
    weights = mha->get_weights();
    const auto r = mha->attend(x, x, {.return_attention_scores = true});
    ref = r.output;
    double max_logit_proxy = 0;  // the scores are one-hot-ish when logits are large
    for (double s : r.scores.to_vector<double>()) max_logit_proxy = std::max(max_logit_proxy, s);
    CHECK(max_logit_proxy > 0.99);
  }
  for (const char* policy : {"mixed_float16", "mixed_bfloat16"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    auto mha = ml::MultiHeadAttention(2, 4, {.use_causal_mask = true});
    mha(x);
    mha->set_weights(weights);
    CHECK(mha->scores_dtype() == mt::kFloat32);
    mt::GradientTape tape;
    tape.watch(x);
    const auto r = mha->attend(x, x, {.return_attention_scores = true});
    CHECK(r.output.dtype() == mha->compute_dtype());
    CHECK(r.scores.dtype() == mt::kFloat32);
    for (double v : r.output.to_vector<double>()) CHECK(std::isfinite(v));
    const auto grads =
        tape.gradient(mt::sum(r.output.to(mt::kFloat32)), mha->trainable_variables());
    for (const auto& g : grads)
      for (double v : g.to_vector<double>()) CHECK(std::isfinite(v));
    double scale = 1.0;
    for (double v : ref.to_vector<double>()) scale = std::max(scale, std::abs(v));
    CHECK(max_abs_diff(r.output.to(mt::kFloat32), ref) <=
          (std::string(policy) == "mixed_float16" ? 2e-2 : 1.5e-1) * scale);
  }
  // scores_dtype can be the compute dtype (Keras' behaviour).
  mt::PolicyScope scope("mixed_float16");
  auto keras_like = ml::MultiHeadAttention(2, 4, {.scores_dtype = mt::kFloat16});
  CHECK(keras_like->attend(x, x, {.return_attention_scores = true}).scores.dtype() == mt::kFloat16);
}

TEST_CASE("MultiHeadAttention: dropout on the weights only in training", "[attention]") {
  const mt::Tensor x = random({2, 5, 4}, mt::kFloat32, 8);
  auto mha = ml::MultiHeadAttention(2, 2, {.dropout = 0.5, .seed = 3});
  const mt::Tensor a = mha(x), b = mha(x);
  CHECK(max_abs_diff(a, b) == 0.0);
  const auto r = mha->attend(x, x, {.return_attention_scores = true, .training = true});
  CHECK(max_abs_diff(r.output, a) > 1e-4);
  // The scores returned are the softmax before the dropout: rows sum to 1.
  const auto s = r.scores.to_vector<double>();
  for (std::size_t row = 0; row < s.size(); row += 5) {
    double sum = 0;
    for (std::size_t j = 0; j < 5; ++j) sum += s[row + j];
    CHECK(sum == Approx(1.0).epsilon(1e-5));
  }
}

TEST_CASE("MultiHeadAttention and PositionEmbedding: bad input", "[attention][errors]") {
  const mt::Tensor x = random({2, 5, 4}, mt::kFloat32, 9);
  auto mha = ml::MultiHeadAttention(2, 3, {.name = "attn"});
  mha(x);
  const auto weights = mha->get_weights();
  // A mask of the wrong shape, or not bool.
  CHECK_THROWS_AS(mha->attend(x, x, {.attention_mask = mt::ones({2, 5, 4}, mt::kBool)}),
                  mt::ShapeError);
  CHECK_THROWS_WITH(
      mha->attend(x, x, {.attention_mask = mt::ones({2, 5, 4}, mt::kBool)}),
      Catch::Contains("layer 'attn' (MultiHeadAttention)") && Catch::Contains("[2, 5, 5]"));
  CHECK_THROWS_AS(mha->attend(x, x, {.attention_mask = mt::ones({2, 5, 5})}), mt::DTypeError);
  CHECK_THROWS_AS(mha->attend(x, x, {.attention_mask = mt::ones({3, 5, 5}, mt::kBool)}),
                  mt::ShapeError);
  // Inputs: rank, batch, key/value lengths.
  CHECK_THROWS_AS(mha(random({2, 4}, mt::kFloat32, 1)), mt::ShapeError);
  CHECK_THROWS_AS(mha({x, random({3, 5, 4}, mt::kFloat32, 1)}), mt::ShapeError);
  CHECK_THROWS_AS(mha({x, x, random({2, 6, 4}, mt::kFloat32, 1)}), mt::ShapeError);
  CHECK_THROWS_AS(mha({x, x, x, x, x}), mt::ValueError);
  // Nothing changed.
  const auto after = mha->get_weights();
  for (std::size_t i = 0; i < weights.size(); ++i) CHECK(max_abs_diff(weights[i], after[i]) == 0.0);
  // Bad arguments.
  CHECK_THROWS_AS(ml::MultiHeadAttention(0, 3), mt::ValueError);
  CHECK_THROWS_AS(ml::MultiHeadAttention(2, 3, {.dropout = 1.0}), mt::ValueError);
  CHECK_THROWS_AS(ml::MultiHeadAttention(2, 3, {.scores_dtype = mt::kInt32}), mt::DTypeError);

  // A context longer than the position table.
  auto pos = ml::PositionEmbedding(4, {.name = "pos"});
  CHECK_THROWS_WITH(pos(x), Catch::Contains("layer 'pos' (PositionEmbedding)") &&
                                Catch::Contains("5 positions long") &&
                                Catch::Contains("sequence_length 4"));
  CHECK_FALSE(pos->built());
  CHECK(pos(random({2, 4, 4}, mt::kFloat32, 2)).shape() == mt::Shape{2, 4, 4});
  CHECK_THROWS_AS(pos(x), mt::ShapeError);
  CHECK_THROWS_AS(ml::PositionEmbedding(0), mt::ValueError);
}

TEST_CASE("PositionEmbedding: the table's first rows, broadcast over the batch", "[attention]") {
  auto pos = ml::PositionEmbedding(8);
  const mt::Tensor x = random({3, 5, 2}, mt::kFloat32, 11);
  mt::GradientTape tape;
  const mt::Tensor y = pos(x);
  REQUIRE(y.shape() == mt::Shape{3, 5, 2});
  const auto table = pos->embeddings().to_vector<double>();
  const auto yv = y.to_vector<double>();
  for (std::size_t b = 0; b < 3; ++b)
    for (std::size_t i = 0; i < 10; ++i) CHECK(yv[b * 10 + i] == table[i]);
  // The gradient: the batch's sum in the first 5 rows, 0 below.
  const auto g =
      tape.gradient(mt::sum(y), std::vector<mt::Tensor>{pos->embeddings()})[0].to_vector<double>();
  for (std::size_t i = 0; i < 16; ++i) CHECK(g[i] == (i < 10 ? 3.0 : 0.0));
}

TEST_CASE("attention layers: a functional transformer block saved and loaded",
          "[attention][model_file]") {
  mixtape_test::TempDir dir;
  auto ids = ml::Input({6}, {.dtype = mt::kInt64});
  auto tok = ml::Embedding(11, 8)(ids);
  auto h = ml::Add()({tok, ml::PositionEmbedding(6)(tok)});
  auto n1 = ml::LayerNormalization()(h);
  h = ml::Add()({h, ml::MultiHeadAttention(2, 4, {.use_causal_mask = true})({n1, n1})});
  auto n2 = ml::LayerNormalization()(h);
  h = ml::Add()({h, ml::Dense(8)(ml::Dense(16, {.activation = "gelu"})(n2))});
  auto logits = ml::Dense(11)(ml::LayerNormalization()(h));
  auto model = std::make_shared<mt::Model>(ids, logits);
  const mt::Tensor x =
      mt::from_vector(std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 0, 9, 8, 7, 6, 5}, {2, 6});
  const mt::Tensor before = (*model)(x);
  CHECK(before.shape() == mt::Shape{2, 6, 11});
  // Causal: changing the last token changes only the last position's logits.
  const mt::Tensor x2 =
      mt::from_vector(std::vector<std::int64_t>{1, 2, 3, 4, 5, 10, 0, 9, 8, 7, 6, 5}, {2, 6});
  const auto a = before.to_vector<double>(), b = (*model)(x2).to_vector<double>();
  for (std::size_t i = 0; i < 5 * 11; ++i) CHECK(a[i] == b[i]);
  model->save(dir / "block.safetensors");
  auto loaded = mt::load_model(dir / "block.safetensors");
  CHECK(max_abs_diff((*loaded)(x), before) == 0.0);
}
