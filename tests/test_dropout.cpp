// dropout (op dropout) against its definition (mixtape/core/dropout_hash.h) in every float
// dtype, its gradient, its seed by value and on the device, bad input; the fused attention's
// dropout as the dropout op on the weights; MultiHeadAttention's two paths dropping the same
// weights; the Dropout layer on it.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/core/dropout_hash.h"
#include "mixtape/mixtape.h"
#include "tensor_check.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using mixtape_test::error_of;
using mixtape_test::max_abs_diff;
using mixtape_test::random_normal;

namespace {

// A seed as an int64 tensor of one element on the CPU.
mt::RandomSeed seed_tensor(std::uint64_t value) {
  mt::RandomSeed s;
  s.on_device = mt::from_vector(std::vector<std::int64_t>{static_cast<std::int64_t>(value)}, {1});
  return s;
}

}  // namespace

TEST_CASE("dropout keeps what the hash keeps, scaled once, in every float dtype", "[dropout]") {
  const double rate = 0.3;
  const std::uint64_t seed = 0x1234abcdULL;
  const std::uint32_t threshold = mt::dropout_threshold(rate);
  const mt::Tensor x64 = random_normal({40, 250}, 5, mt::kFloat64, 1.0);  // never 0
  for (const mt::DType dtype : {mt::kFloat64, mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
    INFO(dtype.name());
    const mt::Tensor x = x64.to(dtype);
    const mt::Tensor y = mt::dropout(x, rate, seed);
    REQUIRE(y.dtype() == dtype);
    REQUIRE(y.shape() == x.shape());
    const auto xv = x.to(mt::kFloat64).to_vector<double>(),
               yv = y.to(mt::kFloat64).to_vector<double>();
    // The factor in the compute type (float32 for the 16-bit floats and float32), the product
    // rounded once to the dtype.
    const double keep = dtype == mt::kFloat64 ? 1.0 / (1.0 - rate)
                                              : static_cast<double>(static_cast<float>(1.0 / 0.7));
    std::vector<double> want(xv.size());
    std::size_t dropped = 0;
    for (std::size_t i = 0; i < xv.size(); ++i) {
      const bool kept = mt::dropout_keeps(seed, i, threshold);
      dropped += kept ? 0 : 1;
      want[i] = kept ? xv[i] * keep : 0.0;
    }
    const auto rounded = mt::from_vector(want, x.shape()).to(dtype).to_vector<double>();
    std::size_t off = 0;
    for (std::size_t i = 0; i < yv.size(); ++i) off += yv[i] == rounded[i] ? 0 : 1;
    CHECK(off == 0);
    // About the rate: 10000 elements, 3000 expected.
    CHECK(dropped > 2850);
    CHECK(dropped < 3150);
    // The same seed as a tensor: the same bits; another seed: another mask.
    CHECK(max_abs_diff(mt::dropout(x, rate, seed_tensor(seed)), y) == 0.0);
    CHECK(max_abs_diff(mt::dropout(x, rate, seed + 1), y) > 0.1);
  }
  // Rate 0 is x; a dropped NaN or infinity is NaN (x * 0), a kept one stays.
  const mt::Tensor x = random_normal({3, 4}, 6, mt::kFloat32);
  CHECK(max_abs_diff(mt::dropout(x, 0.0, seed), x) == 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  const mt::Tensor specials = mt::from_vector(std::vector<double>(64, inf), {64}).to(mt::kFloat32);
  const auto sv = mt::dropout(specials, 0.5, seed).to_vector<double>();
  for (std::size_t i = 0; i < sv.size(); ++i)
    CHECK((mt::dropout_keeps(seed, i, mt::dropout_threshold(0.5)) ? sv[i] == inf
                                                                  : std::isnan(sv[i])));
}

TEST_CASE("dropout's gradient is the same factors, checked in float64", "[dropout][gradcheck]") {
  const mt::Tensor x = random_normal({6, 9}, 7);
  for (const double rate : {0.2, 0.75}) {
    INFO("rate " << rate);
    CHECK_GRADCHECK("dropout",
                    [rate](const mtest::Inputs& v) { return mt::dropout(v[0], rate, 99); }, {x});
    CHECK_GRADGRADCHECK(
        "dropout",
        [rate](const mtest::Inputs& v) { return mt::square(mt::dropout(v[0], rate, 99)); }, {x});
    // Through a strided view (the op reads it contiguous; positions are the view's).
    const mt::Tensor t = mt::transpose(x, 0, 1);
    CHECK(max_abs_diff(mt::dropout(t, rate, 5), mt::dropout(mt::contiguous(t), rate, 5)) == 0.0);
  }
}

TEST_CASE("dropout: bad input names the op and the value", "[dropout][errors]") {
  const mt::Tensor x = random_normal({2, 3}, 8, mt::kFloat32);
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::dropout(x, 1.0, 1); }),
             Catch::Contains("dropout") && Catch::Contains("[0, 1)") && Catch::Contains("1"));
  CHECK_THROWS_AS(mt::dropout(x, -0.1, 1), mt::ValueError);
  CHECK_THROWS_AS(mt::dropout(x, std::nan(""), 1), mt::ValueError);
  CHECK_THAT(error_of<mt::DTypeError>([&] { mt::dropout(x.to(mt::kInt32), 0.5, 1); }),
             Catch::Contains("dropout") && Catch::Contains("int32"));
  mt::RandomSeed bad;
  bad.on_device = mt::zeros({1}, mt::kFloat32);
  CHECK_THAT(error_of<mt::DTypeError>([&] { mt::dropout(x, 0.5, bad); }),
             Catch::Contains("one int64 element") && Catch::Contains("float32"));
  bad.on_device = mt::zeros({2}, mt::kInt64);
  CHECK_THROWS_AS(mt::dropout(x, 0.5, bad), mt::DTypeError);
  CHECK_THROWS_AS(mt::fused_attention(x, x, x, {}, false, 1.0, 0.5, bad), mt::DTypeError);
}

TEST_CASE("fused attention drops what the dropout op drops on the weights",
          "[dropout][attention]") {
  // float64, causal, 2 x 3 heads of 7 positions: the fused op against masked_softmax, then the
  // dropout op with the same seed, then the product with v; the gradients too.
  const mt::Tensor q = random_normal({2, 3, 7, 4}, 10), k = random_normal({2, 3, 7, 4}, 11),
                   v = random_normal({2, 3, 7, 5}, 12);
  const double scale = 0.5, rate = 0.4;
  for (const bool on_device : {false, true}) {
    INFO((on_device ? "seed tensor" : "seed value"));
    const mt::RandomSeed seed = on_device ? seed_tensor(77) : mt::RandomSeed(77);
    const auto composed = [&](const mtest::Inputs& in) {
      std::vector<std::uint8_t> lower(49);
      for (int i = 0; i < 7; ++i)
        for (int j = 0; j < 7; ++j) lower[static_cast<std::size_t>(i * 7 + j)] = j <= i;
      const mt::Tensor causal = mt::from_vector(lower, {7, 7}).to(mt::kBool);
      const mt::Tensor w =
          mt::masked_softmax(mt::matmul(in[0], mt::transpose(in[1], -1, -2)), causal, scale);
      return mt::matmul(mt::dropout(w, rate, seed), in[2]);
    };
    const auto fused = [&](const mtest::Inputs& in) {
      return mt::fused_attention(in[0], in[1], in[2], {}, true, scale, rate, seed);
    };
    CHECK(max_abs_diff(fused({q, k, v}), composed({q, k, v})) < 1e-12);
    CHECK(max_abs_diff(fused({q, k, v}), mt::fused_attention(q, k, v, {}, true, scale)) > 1e-3);
    CHECK_GRADCHECK("attention with dropout", fused, {q, k, v});
    CHECK_GRADGRADCHECK("attention with dropout", fused, {q, k, v});
  }
}

TEST_CASE("MultiHeadAttention's fused and composed paths drop the same weights",
          "[dropout][attention]") {
  const mt::Tensor x = random_normal({2, 6, 8}, 13, mt::kFloat32);
  auto fused = ml::MultiHeadAttention(2, 4, {.dropout = 0.3, .seed = 21});
  auto composed = ml::MultiHeadAttention(2, 4, {.dropout = 0.3, .seed = 21});
  fused(x);
  composed(x);
  composed->set_weights(fused->get_weights());
  // The fused op (float32 scores, no scores returned); returning the scores takes the composed
  // path, whose generator draws the same seed.
  const mt::Tensor a = fused->attend(x, x, {.training = true}).output;
  const mt::Tensor b =
      composed->attend(x, x, {.return_attention_scores = true, .training = true}).output;
  CHECK(max_abs_diff(a, b) < 1e-5);
  CHECK(max_abs_diff(a, fused(x)) > 1e-3);  // not the inference output
}

TEST_CASE("Dropout is one op, seeded by its layer", "[dropout][layers]") {
  const mt::Tensor x = random_normal({64, 32}, 14, mt::kFloat32);
  auto drop = ml::Dropout(0.25, {.seed = 42});
  mt::KernelCensus census;
  const mt::Tensor y = drop(x, {.training = true});
  CHECK(census.total() == 1);
  // The seed is the layer generator's first number.
  mt::Generator gen(42);
  CHECK(max_abs_diff(y, mt::dropout(x, 0.25, gen.next_u64())) == 0.0);
}
