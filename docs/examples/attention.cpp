// A pre-LayerNorm transformer block in the functional API, then one attention call with a
// padding mask that returns the attention weights.
#include <fmt/format.h>
#include <mixtape/mixtape.h>

#include <vector>

namespace mt = mixtape;
namespace ml = mixtape::layers;

int main() {
  mt::set_global_policy("mixed_bfloat16");
  const std::int64_t context = 16, width = 32, vocab = 50;

  auto ids = ml::Input({context}, {.dtype = mt::kInt64});
  auto tokens = ml::Embedding(vocab, width)(ids);
  auto h = ml::Add()({tokens, ml::PositionEmbedding(context)(tokens)});
  auto a = ml::LayerNormalization()(h);
  a = ml::MultiHeadAttention(4, width / 4, {.use_causal_mask = true})({a, a});
  h = ml::Add()({h, a});
  auto m = ml::Dense(4 * width, {.activation = "gelu"})(ml::LayerNormalization()(h));
  h = ml::Add()({h, ml::Dense(width)(m)});
  auto logits = ml::Dense(vocab, {.dtype = "float32"})(ml::LayerNormalization()(h));
  mt::Model model(ids, logits);

  std::vector<std::int64_t> batch(2 * context);
  for (std::size_t i = 0; i < batch.size(); ++i) batch[i] = static_cast<std::int64_t>(i % vocab);
  const mt::Tensor out = model(mt::from_vector(batch, {2, context}));
  fmt::print("logits {} {}\n", out.shape(), out.dtype());  // [2, 16, 50] float32

  // Cross-attention of 3 queries over 5 keys; the second sequence has 2 keys of padding.
  auto mha = ml::MultiHeadAttention(2, 8);
  const mt::Tensor q = mt::normal({2, 3, 16}), kv = mt::normal({2, 5, 16});
  std::vector<bool> keep(2 * 3 * 5, true);
  for (int t = 0; t < 3; ++t) keep[15 + t * 5 + 3] = keep[15 + t * 5 + 4] = false;
  const auto r = mha->attend(q, kv,
                             {.attention_mask = mt::from_vector(keep, {2, 3, 5}, mt::kBool),
                              .return_attention_scores = true});
  fmt::print("output {} {}, scores {} {}\n", r.output.shape(), r.output.dtype(), r.scores.shape(),
             r.scores.dtype());  // bfloat16 output, float32 scores
  // The padded keys get no weight.
  const auto s = r.scores.to_vector<double>();
  return s[2 * 3 * 5 + 3] == 0.0 && s[2 * 3 * 5 + 4] == 0.0 ? 0 : 1;
}
