// layer_norm (ops layer_norm and layer_norm_backward) against the composed computation
// (mean, square, rsqrt, ...) in float64 and every float dtype, its gradients (kernel and
// differentiable form), bad input, and LayerNormalization on it.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/mixtape.h"
#include "tensor_check.h"

namespace mt = mixtape;
using mixtape_test::max_abs_diff;
using mixtape_test::random_normal;
namespace ml = mixtape::layers;

namespace {

// The composed form, in x's dtype.
mt::Tensor composed(const mt::Tensor& x, const mt::Tensor& gamma, const mt::Tensor& beta,
                    double eps) {
  const mt::Tensor c = x - mt::mean(x, {-1}, true);
  mt::Tensor y = c * mt::rsqrt(mt::mean(mt::square(c), {-1}, true) + eps);
  if (gamma.defined()) y = y * gamma;
  if (beta.defined()) y = y + beta;
  return y;
}

}  // namespace

TEST_CASE("layer_norm equals the composed computation in float64, gradients too",
          "[layer_norm][fused]") {
  for (const mt::Shape& shape : {mt::Shape{5}, mt::Shape{3, 7}, mt::Shape{2, 4, 33}}) {
    INFO("shape " << shape.str());
    const std::int64_t n = shape.dims().back();
    const mt::Tensor x = random_normal(shape, 1, mt::kFloat64, 2.0), gamma = random_normal({n}, 2),
                     beta = random_normal({n}, 3), g = random_normal(shape, 4);
    for (const bool affine : {false, true}) {
      INFO("affine " << affine);
      const mt::Tensor gm = affine ? gamma : mt::Tensor(), bt = affine ? beta : mt::Tensor();
      CHECK(max_abs_diff(mt::layer_norm(x, gm, bt, 1e-5), composed(x, gm, bt, 1e-5)) < 1e-12);
      const auto grads = [&](bool fused) {
        mt::Variable xv(x, "x"), gv(gamma, "gamma"), bv(beta, "beta");
        mt::GradientTape tape;
        const mt::Tensor y = fused ? mt::layer_norm(xv, affine ? mt::Tensor(gv) : mt::Tensor(),
                                                    affine ? mt::Tensor(bv) : mt::Tensor(), 1e-5)
                                   : composed(xv, affine ? mt::Tensor(gv) : mt::Tensor(),
                                              affine ? mt::Tensor(bv) : mt::Tensor(), 1e-5);
        return tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{xv, gv, bv});
      };
      const auto f = grads(true), r = grads(false);
      CHECK(max_abs_diff(f[0], r[0]) < 1e-11);
      if (affine) {
        CHECK(max_abs_diff(f[1], r[1]) < 1e-11);
        CHECK(max_abs_diff(f[2], r[2]) < 1e-11);
      }
    }
  }
}

TEST_CASE("layer_norm in float32, float16 and bfloat16: the float64 result, rounded once",
          "[layer_norm][fused]") {
  for (const mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
    INFO(dt.name());
    const mt::Tensor x = mt::cast(random_normal({6, 300}, 11, mt::kFloat64, 3.0), dt);
    const mt::Tensor gamma = random_normal({300}, 12, mt::kFloat32),
                     beta = random_normal({300}, 13, mt::kFloat32);
    const mt::Tensor y = mt::layer_norm(x, gamma, beta, 1e-5);
    CHECK(y.dtype() == dt);
    const mt::Tensor ref = composed(mt::cast(x, mt::kFloat64), mt::cast(gamma, mt::kFloat64),
                                    mt::cast(beta, mt::kFloat64), 1e-5);
    // |y| up to about 4 sigma times |gamma| plus |beta|: a unit in the last place of 16.
    const double ulp = dt == mt::kFloat32 ? 1.2e-7 : dt == mt::kFloat16 ? 9.8e-4 : 7.8e-3;
    CHECK(max_abs_diff(y, ref) < 16 * ulp + 1e-5);
  }
}

TEST_CASE("layer_norm: float64 gradients against numeric differences, second derivatives",
          "[layer_norm][fused][grad]") {
  const mt::Tensor x = random_normal({3, 6}, 21, mt::kFloat64, 1.0), gamma = random_normal({6}, 22),
                   beta = random_normal({6}, 23), g = random_normal({3, 6}, 24);
  CHECK_GRADCHECK(
      "layer_norm",
      [](const mtest::Inputs& in) { return mt::layer_norm(in[0], in[1], in[2], 1e-3); },
      {x, gamma, beta}, mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
  // Second derivatives: the recorded backward pass is made of differentiable ops.
  const auto second = [&](bool fused) {
    mt::Variable a(x, "x"), b(gamma, "gamma"), c(beta, "beta");
    mt::GradientTape outer;
    std::vector<mt::Tensor> first;
    {
      mt::GradientTape inner;
      const mt::Tensor y = fused ? mt::layer_norm(a, b, c, 1e-3) : composed(a, b, c, 1e-3);
      first = inner.gradient(mt::sum(y * g), std::vector<mt::Variable>{a, b, c});
    }
    return outer.gradient(mt::sum(first[0] * first[0]) + mt::sum(first[1] * first[1]),
                          std::vector<mt::Variable>{a, b, c});
  };
  const auto f = second(true), r = second(false);
  for (std::size_t i = 0; i < 2; ++i) CHECK(max_abs_diff(f[i], r[i]) < 1e-10);
}

TEST_CASE("layer_norm: bad input names the op, shapes and values", "[layer_norm][fused]") {
  using mixtape_test::error_of;
  const mt::Tensor x = random_normal({2, 4}, 31, mt::kFloat32);
  CHECK_THAT(
      error_of<mt::ShapeError>([&] { mt::layer_norm(x, mt::ones({3}), mt::Tensor(), 1e-5); }),
      Catch::Contains("layer_norm: gamma must be floating [4]") && Catch::Contains("float32[3]"));
  CHECK_THAT(error_of<mt::ShapeError>(
                 [&] { mt::layer_norm(x, mt::Tensor(), mt::ones({4}, mt::kInt32), 1e-5); }),
             Catch::Contains("beta must be floating"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::layer_norm(x, mt::Tensor(), mt::Tensor(), -1.0); }),
             Catch::Contains("epsilon must be finite and >= 0; got -1"));
  CHECK_THAT(error_of<mt::ShapeError>(
                 [&] { mt::layer_norm(mt::ones({}), mt::Tensor(), mt::Tensor(), 1e-5); }),
             Catch::Contains("rank >= 1"));
  CHECK_THROWS_AS(mt::layer_norm(mt::ones({2, 3}, mt::kInt32), mt::Tensor(), mt::Tensor(), 1e-5),
                  mt::Error);
}

TEST_CASE("LayerNormalization runs on the fused op, as its composed form did",
          "[layer_norm][fused][layers]") {
  for (const char* policy : {"float32", "mixed_float16", "float64"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    mt::manual_seed(3);
    auto ln = ml::LayerNormalization({.epsilon = 1e-5});
    const mt::Tensor x = random_normal({4, 5, 16}, 41, mt::kFloat32, 1.5);
    const mt::Tensor y = ln(x);
    CHECK(y.dtype() == ln->compute_dtype());
    const mt::DType pd = std::string(policy) == "float64" ? mt::kFloat64 : mt::kFloat32;
    const mt::Tensor ref = mt::cast(composed(mt::cast(mt::cast(x, ln->compute_dtype()), pd),
                                             mt::Tensor(ln->gamma()), mt::Tensor(ln->beta()), 1e-5),
                                    ln->compute_dtype());
    CHECK(max_abs_diff(y, ref) <= (std::string(policy) == "mixed_float16" ? 2e-3 : 1e-6));
  }
}
