// fused_attention (ops attention and attention_backward) against the composed computation
// (matmul, masked_softmax, matmul) in float64 and every float dtype, its bad input, and
// MultiHeadAttention's choice between the fused and the composed path.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/core/dropout_hash.h"
#include "mixtape/mixtape.h"
#include "tensor_check.h"

namespace mt = mixtape;
using mixtape_test::max_abs_diff;
using mixtape_test::random_normal;
namespace ml = mixtape::layers;

namespace {

// A bool tensor from a rule over its flat index.
template <typename F>
mt::Tensor mask_of(const mt::Shape& shape, F keep) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) bytes[static_cast<std::size_t>(i)] = keep(i) ? 1 : 0;
  return mt::from_vector(bytes, shape).to(mt::kBool);
}

// The composed form: masked_softmax of the scaled logits (the mask AND, when causal, j <= i),
// then the weighted values.
mt::Tensor composed(const mt::Tensor& q, const mt::Tensor& k, const mt::Tensor& v, mt::Tensor mask,
                    bool causal, double scale) {
  if (causal) {
    const std::int64_t t = q.dim(-2), s = k.dim(-2);
    const mt::Tensor c = mask_of({t, s}, [s](std::int64_t i) { return i % s <= i / s; });
    mask = mask.defined() ? mt::where(c, mask, c) : c;
  }
  const mt::Tensor p = mt::masked_softmax(mt::matmul(q, mt::transpose(k, -1, -2)), mask, scale);
  return mt::matmul(p, v);
}

struct Case {
  const char* what;
  mt::Shape q, k, v;
  bool causal;
  // 0 none, 1 padding [B, 1, 1, S], 2 full [B, H, T, S] with an empty row, 3 per batch [B, 1,
  // T, S] (MultiHeadAttention's), 4 over three leading axes that do not fold into two
  // [2, 1, 2, T, S] (the kernels get a copy), 5 per query [B, 1, T, 1] (broadcast along the
  // keys: a copy too).
  int mask;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> c{
      {"no mask", {2, 3, 5, 4}, {2, 3, 7, 4}, {2, 3, 7, 6}, false, 0},
      {"causal, crossing 64-row tiles", {1, 2, 70, 8}, {1, 2, 70, 8}, {1, 2, 70, 8}, true, 0},
      {"causal, more keys than queries", {2, 1, 5, 3}, {2, 1, 9, 3}, {2, 1, 9, 2}, true, 0},
      {"padding mask", {2, 2, 6, 4}, {2, 2, 130, 4}, {2, 2, 130, 5}, false, 1},
      {"full mask with an empty row, causal", {2, 2, 9, 4}, {2, 2, 9, 4}, {2, 2, 9, 4}, true, 2},
      {"rank 3", {3, 4, 8}, {3, 6, 8}, {3, 6, 8}, false, 0},
      {"per-batch mask, causal", {2, 3, 70, 4}, {2, 3, 70, 4}, {2, 3, 70, 4}, true, 3},
      {"mask over three leading axes", {2, 3, 2, 5, 4}, {2, 3, 2, 7, 4}, {2, 3, 2, 7, 3}, false, 4},
      {"per-query mask", {2, 2, 6, 4}, {2, 2, 8, 4}, {2, 2, 8, 4}, false, 5},
  };
  return c;
}

mt::Tensor case_mask(const Case& c) {
  if (c.mask == 0) return mt::Tensor();
  const std::int64_t b = c.q.dims().front(), s = c.k.dims()[c.k.rank() - 2];
  const std::int64_t tq = c.q.dims()[c.q.rank() - 2];
  if (c.mask == 1)  // batch 1's last three keys padded
    return mask_of({b, 1, 1, s}, [s](std::int64_t i) { return i < s || i % s < s - 3; });
  if (c.mask == 3)
    return mask_of({b, 1, tq, s}, [](std::int64_t i) { return (i * 5 + 1) % 3 != 0; });
  if (c.mask == 4)
    return mask_of({2, 1, 2, tq, s}, [](std::int64_t i) { return (i * 3 + 2) % 4 != 0; });
  if (c.mask == 5)  // query row 2 of batch 0 attends nothing
    return mask_of({b, 1, tq, 1}, [](std::int64_t i) { return i != 2; });
  std::vector<std::int64_t> dims = c.q.dims();
  dims.back() = s;
  const std::int64_t t = c.q.dims()[c.q.rank() - 2];
  return mask_of(mt::Shape(dims), [t, s](std::int64_t i) {
    return (i / s) % t != 4 && (i * 7 + 3) % 5 != 0;  // row 4 of every head attends nothing
  });
}

}  // namespace

TEST_CASE("fused_attention equals the composed computation in float64", "[attention][fused]") {
  for (const Case& c : cases()) {
    INFO(c.what);
    const mt::Tensor q = random_normal(c.q, 1), k = random_normal(c.k, 2),
                     v = random_normal(c.v, 3);
    const mt::Tensor mask = case_mask(c);
    const double scale = 0.6;
    const mt::Tensor fused = mt::fused_attention(q, k, v, mask, c.causal, scale);
    const mt::Tensor ref = composed(q, k, v, mask, c.causal, scale);
    CHECK(fused.shape() == ref.shape());
    CHECK(fused.dtype() == mt::kFloat64);
    CHECK(max_abs_diff(fused, ref) < 1e-12);

    // The gradients of q, k and v, against the composed path's.
    const mt::Tensor g = random_normal(ref.shape(), 4);
    const auto grads = [&](bool use_fused) {
      mt::Variable qv(q, "q"), kv(k, "k"), vv(v, "v");
      mt::GradientTape tape;
      const mt::Tensor y = use_fused ? mt::fused_attention(qv, kv, vv, mask, c.causal, scale)
                                     : composed(qv, kv, vv, mask, c.causal, scale);
      return tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{qv, kv, vv});
    };
    const auto f = grads(true), r = grads(false);
    for (std::size_t i = 0; i < 3; ++i) CHECK(max_abs_diff(f[i], r[i]) < 1e-11);
  }
}

TEST_CASE("fused_attention in float32, float16 and bfloat16: the float64 result, rounded",
          "[attention][fused]") {
  for (const mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
    INFO(dt.name());
    for (const Case& c : cases()) {
      INFO(c.what);
      // Values the dtype holds exactly, so that both sides see the same inputs.
      const mt::Tensor q = mt::cast(random_normal(c.q, 11), dt),
                       k = mt::cast(random_normal(c.k, 12), dt),
                       v = mt::cast(random_normal(c.v, 13), dt);
      const mt::Tensor mask = case_mask(c);
      const mt::Tensor fused = mt::fused_attention(q, k, v, mask, c.causal, 0.5);
      CHECK(fused.dtype() == dt);
      const mt::Tensor ref = composed(mt::cast(q, mt::kFloat64), mt::cast(k, mt::kFloat64),
                                      mt::cast(v, mt::kFloat64), mask, c.causal, 0.5);
      // Outputs are weighted means of values of magnitude up to about 4: a few units in the
      // last place of the dtype, plus float32 accumulation.
      const double ulp = dt == mt::kFloat32 ? 1.2e-7 : dt == mt::kFloat16 ? 9.8e-4 : 7.8e-3;
      CHECK(max_abs_diff(fused, ref) < 16 * ulp);
    }
  }
}

TEST_CASE("fused_attention: float64 gradient checks against numeric differences",
          "[attention][fused][grad]") {
  const mt::Tensor q = random_normal({2, 2, 5, 3}, 21), k = random_normal({2, 2, 6, 3}, 22),
                   v = random_normal({2, 2, 6, 4}, 23);
  const mt::Tensor padding =
      mask_of({2, 1, 1, 6}, [](std::int64_t i) { return i < 6 || i % 6 < 4; });
  for (const bool causal : {false, true})
    for (const bool masked : {false, true}) {
      INFO("causal " << causal << ", masked " << masked);
      const mt::Tensor mask = masked ? padding : mt::Tensor();
      CHECK_GRADCHECK(
          "fused_attention",
          [&](const mtest::Inputs& in) {
            return mt::fused_attention(in[0], in[1], in[2], mask, causal, 0.8);
          },
          {q, k, v}, mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
    }
}

TEST_CASE("fused_attention: bad input names the op, the shapes and the dtypes",
          "[attention][fused]") {
  const mt::Tensor q = random_normal({2, 4, 3}, 1, mt::kFloat32),
                   k = random_normal({2, 5, 3}, 2, mt::kFloat32),
                   v = random_normal({2, 5, 6}, 3, mt::kFloat32);
  using mixtape_test::error_of;
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::fused_attention(q, random_normal({2, 5, 4}, 4), v);
             }),
             Catch::Contains("attention: q and k need the same last axis") &&
                 Catch::Contains("float32[2, 4, 3]"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::fused_attention(q, k, random_normal({2, 6, 6}, 5, mt::kFloat32));
             }),
             Catch::Contains("k and v need the same number of positions"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::fused_attention(q, random_normal({3, 5, 3}, 6, mt::kFloat32), v);
             }),
             Catch::Contains("the same leading axes"));
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::fused_attention(random_normal({3}, 7), k, v); }),
             Catch::Contains("rank >= 2"));
  CHECK_THAT(
      error_of<mt::DTypeError>([&] { mt::fused_attention(q, k, mt::cast(v, mt::kFloat16)); }),
      Catch::Contains("one dtype"));
  CHECK_THAT(error_of<mt::DTypeError>([&] {
               mt::fused_attention(q, k, v, mt::ones({4, 5}));
             }),
             Catch::Contains("the mask must be bool"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::fused_attention(q, k, v, mask_of({4, 4}, [](std::int64_t) { return true; }));
             }),
             Catch::Contains("attention: shapes [4, 4] and [2, 4, 5] cannot be broadcast"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::fused_attention(q, k, v, mt::Tensor(), false,
                                   std::numeric_limits<double>::infinity());
             }),
             Catch::Contains("scale must be finite"));
  // No keys: every row attends nothing.
  const mt::Tensor none = mt::fused_attention(q, random_normal({2, 0, 3}, 8, mt::kFloat32),
                                              random_normal({2, 0, 6}, 9, mt::kFloat32));
  CHECK(none.shape() == mt::Shape{2, 4, 6});
  CHECK(max_abs_diff(none, mt::zeros({2, 4, 6})) == 0.0);
}

TEST_CASE("MultiHeadAttention takes the fused path when it can, with the same results",
          "[attention][fused][layers]") {
  for (const char* policy : {"float32", "mixed_bfloat16", "float64"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    mt::manual_seed(5);
    auto mha = ml::MultiHeadAttention(2, 4, {.use_causal_mask = true});
    const mt::Tensor x = random_normal({3, 7, 8}, 31, mt::kFloat32);
    mt::DTypeTraceScope trace;
    const mt::Tensor fused = mha->attend(x, x, {}).output;
    // return_attention_scores needs the weights: the composed path.
    const ml::AttentionResult composed = mha->attend(x, x, {.return_attention_scores = true});
    REQUIRE(trace.trace().rows.size() == 2);
    // The projections (with their biases) run on the fused linear op.
    // Self-attention: q, k and v from one product (fused_attention_packed).
    CHECK(trace.trace().rows[0].note ==
          "attention: fused (q, k and v in one product); projections: fused linear (bias)");
    CHECK(trace.trace().rows[1].note ==
          "attention: composed (the scores are returned); projections: fused linear (bias)");
    CHECK_THAT(trace.trace().table(),
               Catch::Contains("note") && Catch::Contains("attention: fused"));
    const double tol = std::string(policy) == "mixed_bfloat16" ? 2e-2
                       : std::string(policy) == "float64"      ? 1e-12
                                                               : 1e-5;
    CHECK(max_abs_diff(fused, composed.output) < tol);
  }
  SECTION("dropout in training: inside the fused op; in inference: none") {
    auto mha = ml::MultiHeadAttention(2, 4, {.dropout = 0.5});
    const mt::Tensor x = random_normal({2, 5, 8}, 32, mt::kFloat32);
    mt::DTypeTraceScope trace;
    (void)mha->attend(x, x, {.training = true});
    (void)mha->attend(x, x, {});
    REQUIRE(trace.trace().rows.size() == 2);
    CHECK_THAT(trace.trace().rows[0].note,
               Catch::StartsWith("attention: fused (q, k and v in one product; dropout on the "
                                 "weights);"));
    CHECK_THAT(trace.trace().rows[1].note,
               Catch::StartsWith("attention: fused (q, k and v in one product);"));
  }
  SECTION("cross-attention: three products") {
    auto mha = ml::MultiHeadAttention(2, 4);
    const mt::Tensor x = random_normal({2, 5, 8}, 33, mt::kFloat32),
                     y = random_normal({2, 6, 8}, 34, mt::kFloat32);
    mt::DTypeTraceScope trace;
    (void)mha->attend(x, y, {});
    (void)mha->attend(x, x, {}, x * 1.0);  // (the same values, another tensor)
    REQUIRE(trace.trace().rows.size() == 2);
    for (const auto& row : trace.trace().rows)
      CHECK_THAT(row.note, Catch::StartsWith("attention: fused;"));
  }
  SECTION("one product or three: the same results and gradients") {
    // The output and the weights' gradients are the same sums either way (on this machine's
    // CPU, to the bit; a GEMM may order a wider product's sums otherwise, hence a tolerance of
    // a rounding). The input's gradient is one product's sum rounded once, where three products
    // were each rounded to the compute dtype and added: closer to the exact sum.
    for (const char* policy : {"float32", "mixed_bfloat16"}) {
      INFO(policy);
      mt::PolicyScope scope(policy);
      mt::manual_seed(7);
      auto mha = ml::MultiHeadAttention(4, 8, {.use_causal_mask = true});
      const mt::Tensor x0 = random_normal({3, 9, 32}, 35, mt::kFloat32),
                       g = random_normal({3, 9, 32}, 36, mt::kFloat32);
      const auto run = [&](bool one) {
        mt::Variable x(x0, "x");
        mt::GradientTape tape;
        const mt::Tensor y =
            mt::cast(mha->attend(x, x, {}, one ? mt::Tensor() : x * 1.0).output, mt::kFloat32);
        std::vector<mt::Variable> wrt = mha->trainable_variables();
        wrt.push_back(x);
        auto grads = tape.gradient(mt::sum(y * g), wrt);
        grads.insert(grads.begin(), y);
        return grads;
      };
      const auto one = run(true), three = run(false);
      REQUIRE(one.size() == 10);
      const double tol = std::string(policy) == "float32" ? 1e-5 : 2e-2;
      for (std::size_t i = 0; i < one.size(); ++i) {
        INFO("output, then the gradients of the weights and of x: " << i);
        CHECK(max_abs_diff(one[i], three[i]) <=
              tol * (1.0 + max_abs_diff(three[i], three[i] * 0.0)));
      }
    }
  }
}

TEST_CASE("fused_attention_packed: fused_attention of q, k and v viewed out of one tensor",
          "[attention][fused][packed]") {
  // qkv [batch, positions, heads * (2 key_dim + value_dim)]: the result and the gradient are
  // those of fused_attention on q, k and v sliced out of it (the same kernels on the same
  // heads: to the bit), the gradient one tensor where the slices' come back as three summed.
  const std::int64_t heads = 3, kd = 4, vd = 5, width = heads * (2 * kd + vd);
  const auto part = [&](const mt::Tensor& qkv, std::int64_t start, std::int64_t dim) {
    const mt::Tensor s = mt::slice(qkv, -1, start, start + heads * dim);
    return mt::permute(mt::reshape(s, {qkv.dim(0), qkv.dim(1), heads, dim}), {0, 2, 1, 3});
  };
  const mt::Tensor padding =
      mask_of({2, 1, 1, 70}, [](std::int64_t i) { return i < 70 || i % 70 < 60; });
  for (const mt::DType dt : {mt::kFloat32, mt::kBFloat16, mt::kFloat64})
    for (const double rate : {0.0, 0.25}) {
      INFO(dt.name() << ", dropout " << rate);
      const mt::Tensor x = mt::cast(random_normal({2, 70, width}, 71), dt),
                       g = mt::cast(random_normal({2, heads, 70, vd}, 72), dt);
      const auto run = [&](bool packed) {
        mt::Variable qkv(x, "qkv");
        mt::GradientTape tape;
        const mt::Tensor y =
            packed
                ? mt::fused_attention_packed(qkv, {heads, kd, vd}, padding, true, 0.6, rate, 9)
                : mt::fused_attention(part(qkv, 0, kd), part(qkv, heads * kd, kd),
                                      part(qkv, 2 * heads * kd, vd), padding, true, 0.6, rate, 9);
        const auto grads = tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{qkv});
        return std::vector<mt::Tensor>{y, grads[0]};
      };
      const auto packed = run(true), sliced = run(false);
      CHECK(packed[0].shape() == mt::Shape{2, heads, 70, vd});
      CHECK(packed[1].shape() == x.shape());
      CHECK(packed[1].dtype() == dt);
      CHECK(max_abs_diff(packed[0], sliced[0]) == 0.0);
      CHECK(max_abs_diff(packed[1], sliced[1]) == 0.0);
    }
  SECTION("float64 gradient checks; second derivatives") {
    const mt::Tensor x = random_normal({2, 5, 2 * (2 * 3 + 2)}, 73);
    for (const bool causal : {false, true})
      CHECK_GRADCHECK(
          "fused_attention_packed",
          [&](const mtest::Inputs& in) {
            return mt::fused_attention_packed(in[0], {2, 3, 2}, mt::Tensor(), causal, 0.8);
          },
          {x}, mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
    const mt::Tensor g = random_normal({2, 2, 5, 2}, 74);
    const auto second = [&](bool packed) {
      mt::Variable qkv(x, "qkv");
      mt::GradientTape outer;
      std::vector<mt::Tensor> first;
      {
        mt::GradientTape inner;
        const auto sliced = [&](std::int64_t start, std::int64_t dim) {
          const mt::Tensor s = mt::slice(qkv, -1, start, start + 2 * dim);
          return mt::permute(mt::reshape(s, {2, 5, 2, dim}), {0, 2, 1, 3});
        };
        const mt::Tensor y =
            packed ? mt::fused_attention_packed(qkv, {2, 3, 2}, mt::Tensor(), true, 0.7)
                   : mt::fused_attention(sliced(0, 3), sliced(6, 3), sliced(12, 2), mt::Tensor(),
                                         true, 0.7);
        first = inner.gradient(mt::sum(y * g), std::vector<mt::Variable>{qkv});
      }
      return outer.gradient(mt::sum(first[0] * first[0]), std::vector<mt::Variable>{qkv});
    };
    const auto f = second(true), r = second(false);
    REQUIRE(f[0].defined());
    CHECK(max_abs_diff(f[0], r[0]) < 1e-11);
  }
  SECTION("bad input") {
    const mt::Tensor x = random_normal({2, 5, 13}, 75);
    CHECK_THAT(mixtape_test::error_of<mt::ShapeError>([&] {
                 mt::fused_attention_packed(x, {2, 3, 2});
               }),
               Catch::Contains("attention: packed q, k and v") &&
                   Catch::Contains("[..., positions, 16]") && Catch::Contains("2 heads"));
    CHECK_THAT(mixtape_test::error_of<mt::ShapeError>([&] {
                 mt::fused_attention_packed(x, {0, 3, 2});
               }),
               Catch::Contains("0 heads"));
    CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] {
                 mt::fused_attention_packed(x, {1, 4, 5}, mt::Tensor(), false, 1.0, 1.5);
               }),
               Catch::Contains("the dropout rate must be in [0, 1)"));
  }
}

TEST_CASE("fused_attention: dropout on the weights, its mask a function of the seed",
          "[attention][fused][dropout]") {
  const mt::Tensor q = random_normal({2, 3, 70, 8}, 51), k = random_normal({2, 3, 70, 8}, 52),
                   v = random_normal({2, 3, 70, 5}, 53), g = random_normal({2, 3, 70, 5}, 54);
  const double rate = 0.3, scale = 0.4;
  const std::uint64_t seed = 77;
  // The composed form with the same factors Z (mixtape/core/dropout_hash.h): 1 / (1 - rate)
  // where the hash keeps the weight of (head, query, key), 0 elsewhere.
  std::vector<double> z(static_cast<std::size_t>(6 * 70 * 70));
  const std::uint32_t threshold = mt::dropout_threshold(rate);
  std::size_t kept = 0;
  for (std::size_t i = 0; i < z.size(); ++i) {
    const bool keep = mt::dropout_keeps(seed, i, threshold);
    kept += keep ? 1 : 0;
    z[i] = keep ? 1.0 / (1.0 - rate) : 0.0;
  }
  CHECK(std::abs(static_cast<double>(kept) / static_cast<double>(z.size()) - 0.7) < 0.02);
  const mt::Tensor zt = mt::from_vector(z, {2, 3, 70, 70});
  const auto composed_dropped = [&](const mt::Tensor& qq, const mt::Tensor& kk,
                                    const mt::Tensor& vv) {
    const mt::Tensor c = mask_of({70, 70}, [](std::int64_t i) { return i % 70 <= i / 70; });
    const mt::Tensor p =
        mt::masked_softmax(mt::matmul(qq, mt::transpose(kk, -1, -2)), c, scale) * zt;
    return mt::matmul(p, vv);
  };
  const mt::Tensor fused = mt::fused_attention(q, k, v, mt::Tensor(), true, scale, rate, seed);
  CHECK(max_abs_diff(fused, composed_dropped(q, k, v)) < 1e-12);
  // The same seed, the same result; another seed, another mask.
  CHECK(max_abs_diff(mt::fused_attention(q, k, v, mt::Tensor(), true, scale, rate, seed), fused) ==
        0.0);
  CHECK(max_abs_diff(mt::fused_attention(q, k, v, mt::Tensor(), true, scale, rate, seed + 1),
                     fused) > 1e-3);
  // The gradients find the forward's mask again.
  const auto grads = [&](bool use_fused) {
    mt::Variable qv(q, "q"), kv(k, "k"), vv(v, "v");
    mt::GradientTape tape;
    const mt::Tensor y =
        use_fused ? mt::fused_attention(qv, kv, vv, mt::Tensor(), true, scale, rate, seed)
                  : composed_dropped(qv, kv, vv);
    return tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{qv, kv, vv});
  };
  const auto f = grads(true), r = grads(false);
  for (std::size_t i = 0; i < 3; ++i) CHECK(max_abs_diff(f[i], r[i]) < 1e-11);
  // Second derivatives: the recorded backward pass makes Z whole and composes.
  const auto second = [&](bool use_fused) {
    mt::Variable qv(q, "q"), kv(k, "k"), vv(v, "v");
    mt::GradientTape outer;
    std::vector<mt::Tensor> first;
    {
      mt::GradientTape inner;
      const mt::Tensor y =
          use_fused ? mt::fused_attention(qv, kv, vv, mt::Tensor(), true, scale, rate, seed)
                    : composed_dropped(qv, kv, vv);
      first = inner.gradient(mt::sum(y * g), std::vector<mt::Variable>{qv, kv, vv});
    }
    return outer.gradient(mt::sum(first[0] * first[0]) + mt::sum(first[2] * first[2]),
                          std::vector<mt::Variable>{qv, kv, vv});
  };
  const auto f2 = second(true), r2 = second(false);
  for (std::size_t i = 0; i < 3; ++i) CHECK(max_abs_diff(f2[i], r2[i]) < 1e-10);
  CHECK_GRADCHECK(
      "fused_attention with dropout",
      [&](const mtest::Inputs& in) {
        return mt::fused_attention(in[0], in[1], in[2], mt::Tensor(), false, 0.5, 0.5, 3);
      },
      {random_normal({2, 5, 3}, 55), random_normal({2, 6, 3}, 56), random_normal({2, 6, 2}, 57)},
      mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
  CHECK_THAT(mixtape_test::error_of<mt::ValueError>(
                 [&] { mt::fused_attention(q, k, v, mt::Tensor(), false, 1.0, 1.0, 0); }),
             Catch::Contains("the dropout rate must be in [0, 1); got 1"));
}

TEST_CASE("fused_attention: second derivatives through a recorded backward pass",
          "[attention][fused][grad]") {
  // Under a second tape the backward pass is made of differentiable ops: the gradient of a
  // gradient equals the composed path's.
  const mt::Tensor q = random_normal({2, 4, 3}, 41), k = random_normal({2, 5, 3}, 42),
                   v = random_normal({2, 5, 2}, 43), g = random_normal({2, 4, 2}, 44);
  const auto second = [&](bool use_fused) {
    mt::Variable qv(q, "q"), kv(k, "k"), vv(v, "v");
    mt::GradientTape outer;
    std::vector<mt::Tensor> first;
    {
      mt::GradientTape inner;
      const mt::Tensor y = use_fused ? mt::fused_attention(qv, kv, vv, mt::Tensor(), true, 0.7)
                                     : composed(qv, kv, vv, mt::Tensor(), true, 0.7);
      first = inner.gradient(mt::sum(y * g), std::vector<mt::Variable>{qv, kv, vv});
    }
    const mt::Tensor penalty = mt::sum(first[0] * first[0]) + mt::sum(first[1]) * mt::sum(first[2]);
    return outer.gradient(penalty, std::vector<mt::Variable>{qv, kv, vv});
  };
  const auto f = second(true), r = second(false);
  for (std::size_t i = 0; i < 3; ++i) {
    REQUIRE(f[i].defined());
    CHECK(max_abs_diff(f[i], r[i]) < 1e-11);
  }
}

TEST_CASE("fused_attention reads a projection's heads where they lie and writes in their layout",
          "[attention][fused]") {
  // q, k and v as MultiHeadAttention makes them: [batch, positions, heads, width] viewed
  // [batch, heads, positions, width]. The kernels read them there (no copy), out comes back
  // laid out as q (merging the heads again is a view), each gradient as its input; the
  // values are those of the same heads made contiguous first, to the bit.
  for (const mt::DType dt : {mt::kFloat32, mt::kBFloat16, mt::kFloat64}) {
    INFO(dt.name());
    const mt::Tensor xq = mt::cast(random_normal({2, 7, 3, 4}, 51), dt),
                     xk = mt::cast(random_normal({2, 9, 3, 4}, 52), dt),
                     xv = mt::cast(random_normal({2, 9, 3, 5}, 53), dt),
                     g = mt::cast(random_normal({2, 3, 7, 5}, 54), dt);
    const mt::Tensor padding =
        mask_of({2, 1, 1, 9}, [](std::int64_t i) { return i < 9 || i % 9 < 6; });
    const auto run = [&](bool in_place) {
      mt::Variable q(xq, "q"), k(xk, "k"), v(xv, "v");
      mt::GradientTape tape;
      const auto heads = [&](const mt::Tensor& x) {
        const mt::Tensor h = mt::permute(x, {0, 2, 1, 3});
        return in_place ? h : mt::contiguous(h);
      };
      const mt::Tensor y = mt::fused_attention(heads(q), heads(k), heads(v), padding, true, 0.6);
      auto grads = tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{q, k, v});
      grads.insert(grads.begin(), y);
      return grads;
    };
    const auto placed = run(true), copied = run(false);
    CHECK(mt::permute(placed[0], {0, 2, 1, 3}).is_contiguous());
    for (std::size_t i = 1; i < 4; ++i) CHECK(placed[i].is_contiguous());
    for (std::size_t i = 0; i < 4; ++i) CHECK(max_abs_diff(placed[i], copied[i]) == 0.0);
  }
}

TEST_CASE(
    "MultiHeadAttention under a mixed policy hands its float32 biases to the fused op, as Dense "
    "does",
    "[attention][layers]") {
  // The fused linear op takes a float32 bias, adds its bfloat16 value (kernels.h; not recorded)
  // and gives it a float32 gradient; MultiHeadAttention hands its four biases over as float32:
  // gradients not rounded to bfloat16 on the way back. In the forward pass the output's bias
  // ([features], a variable as it is) is read through the copy autocast keeps, the query's,
  // key's and value's ([heads, dim], reshaped: no longer the variable), joined for the one
  // product of self-attention, are cast once.
  mt::PolicyScope scope("mixed_bfloat16");
  const mt::Tensor x = random_normal({2, 5, 16}, 61, mt::kFloat32);
  const mt::Tensor seed = random_normal({2, 5, 16}, 62, mt::kFloat32);
  const auto forward_casts = [&](bool use_bias) {
    mt::manual_seed(6);
    auto mha = ml::MultiHeadAttention(2, 8, {.use_bias = use_bias, .use_causal_mask = true});
    (void)mha->attend(x, x, {});  // built, the weights' copies made
    std::vector<mt::Variable> biases;
    for (const auto& v : mha->trainable_variables())
      if (v.name().find("bias") != std::string::npos) biases.push_back(v);
    mt::GradientTape tape;
    std::int64_t casts = 0;
    mt::Tensor y;
    {
      mt::KernelCensus census;
      y = mha->attend(x, x, {}).output;
      casts = census.count(mt::OpId::cast);
    }
    const auto grads = tape.gradient(mt::sum(mt::cast(y, mt::kFloat32) * seed), biases);
    CHECK(grads.size() == (use_bias ? 4u : 0u));
    for (std::size_t i = 0; i < grads.size(); ++i) {
      INFO(biases[i].name());
      REQUIRE(grads[i].dtype() == mt::kFloat32);
      // Not rounded to bfloat16 on the way: some element is not a bfloat16 value. (The key
      // bias moves every logit of a row alike, which the softmax ignores: its gradient is 0 up
      // to rounding, and is left out.)
      if (biases[i].name().find("key/") == std::string::npos)
        CHECK(max_abs_diff(grads[i], mt::cast(mt::cast(grads[i], mt::kBFloat16), mt::kFloat32)) >
              0.0);
    }
    return casts;
  };
  CHECK(forward_casts(true) == forward_casts(false) + 1);
}
