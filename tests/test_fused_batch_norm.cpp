// batch_norm (ops batch_norm and batch_norm_backward) against the composed computation
// (mean, square, rsqrt, ...) in float64 and every float dtype, its gradients (kernel and
// differentiable form), bad input, and BatchNormalization on it.
#include <omp.h>

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

// The composed form over every axis but the last, in x's dtype.
mt::Tensor composed(const mt::Tensor& x, const mt::Tensor& gamma, const mt::Tensor& beta,
                    double eps) {
  const std::int64_t n = x.dim(-1);
  const mt::Tensor x2 = mt::reshape(x, mt::Shape{-1, n});
  const mt::Tensor c = x2 - mt::mean(x2, {0}, true);
  mt::Tensor y = c * mt::rsqrt(mt::mean(mt::square(c), {0}, true) + eps);
  if (gamma.defined()) y = y * gamma;
  if (beta.defined()) y = y + beta;
  return mt::reshape(y, x.shape());
}

}  // namespace

TEST_CASE("batch_norm equals the composed computation in float64, gradients too",
          "[batch_norm][fused]") {
  for (const mt::Shape& shape :
       {mt::Shape{7, 3}, mt::Shape{1, 4}, mt::Shape{5}, mt::Shape{2, 4, 5, 6}, mt::Shape{70, 2}}) {
    INFO("shape " << shape.str());
    const std::int64_t n = shape.dims().back();
    const mt::Tensor x = random_normal(shape, 1, mt::kFloat64, 2.0) + 3.0,
                     gamma = random_normal({n}, 2), beta = random_normal({n}, 3),
                     g = random_normal(shape, 4);
    for (const bool affine : {false, true}) {
      INFO("affine " << affine);
      const mt::Tensor gm = affine ? gamma : mt::Tensor(), bt = affine ? beta : mt::Tensor();
      const mt::BatchNormResult r = mt::batch_norm(x, gm, bt, 1e-3);
      CHECK(max_abs_diff(r.out, composed(x, gm, bt, 1e-3)) < 1e-12);
      const mt::Tensor x2 = mt::reshape(x, mt::Shape{-1, n});
      CHECK(max_abs_diff(r.mean, mt::mean(x2, {0})) < 1e-13);
      CHECK(max_abs_diff(r.variance, mt::mean(mt::square(x2 - mt::mean(x2, {0})), {0})) < 1e-13);
      const auto grads = [&](bool fused) {
        mt::Variable xv(x, "x"), gv(gamma, "gamma"), bv(beta, "beta");
        mt::GradientTape tape;
        const mt::Tensor ga = affine ? mt::Tensor(gv) : mt::Tensor(),
                         ba = affine ? mt::Tensor(bv) : mt::Tensor();
        const mt::Tensor y =
            fused ? mt::batch_norm(xv, ga, ba, 1e-3).out : composed(xv, ga, ba, 1e-3);
        return tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{xv, gv, bv});
      };
      const auto f = grads(true), c = grads(false);
      CHECK(max_abs_diff(f[0], c[0]) < 1e-11);
      if (affine) {
        CHECK(max_abs_diff(f[1], c[1]) < 1e-11);
        CHECK(max_abs_diff(f[2], c[2]) < 1e-11);
      }
    }
  }
}

TEST_CASE("batch_norm with given statistics: the composed computation, gradients too",
          "[batch_norm][fused]") {
  for (const mt::Shape& shape : {mt::Shape{7, 3}, mt::Shape{2, 4, 5, 3}, mt::Shape{0, 3}}) {
    INFO("shape " << shape.str());
    const mt::Tensor x = random_normal(shape, 5, mt::kFloat64, 2.0), gamma = random_normal({3}, 6),
                     beta = random_normal({3}, 7), mean = random_normal({3}, 8, mt::kFloat32, 2.0),
                     var = mt::square(random_normal({3}, 9, mt::kFloat32)) + 0.5,
                     g = random_normal(shape, 10);
    const auto composed_given = [&](const mt::Tensor& xx, const mt::Tensor& gm,
                                    const mt::Tensor& bt) {
      return (xx - mt::cast(mean, mt::kFloat64)) * mt::rsqrt(mt::cast(var, mt::kFloat64) + 1e-3) *
                 gm +
             bt;
    };
    CHECK(max_abs_diff(mt::batch_norm(x, gamma, beta, mean, var, 1e-3),
                       composed_given(x, gamma, beta)) < 1e-12);
    const auto grads = [&](bool fused) {
      mt::Variable xv(x, "x"), gv(gamma, "gamma"), bv(beta, "beta");
      mt::GradientTape tape;
      const mt::Tensor y =
          fused ? mt::batch_norm(xv, gv, bv, mean, var, 1e-3) : composed_given(xv, gv, bv);
      return tape.gradient(mt::sum(y * g), std::vector<mt::Variable>{xv, gv, bv});
    };
    const auto f = grads(true), c = grads(false);
    for (std::size_t i = 0; i < 3; ++i) CHECK(max_abs_diff(f[i], c[i]) < 1e-11);
  }
  CHECK_GRADCHECK(
      "batch_norm, given statistics",
      [](const mtest::Inputs& in) {
        return mt::batch_norm(in[0], in[1], in[2], mt::full({3}, 0.5), mt::full({3}, 2.0), 1e-3);
      },
      {random_normal({4, 3}, 11), random_normal({3}, 12), random_normal({3}, 13)},
      mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
}

TEST_CASE("batch_norm in float32, float16 and bfloat16: the float64 result, rounded once",
          "[batch_norm][fused]") {
  for (const mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
    INFO(dt.name());
    // Columns whose mean (5) is large next to their spread (0.5), over 4,000 rows.
    const mt::Tensor x = mt::cast(random_normal({8, 25, 20, 6}, 11, mt::kFloat64, 5.0, 0.5), dt);
    const mt::Tensor gamma = random_normal({6}, 12, mt::kFloat32),
                     beta = random_normal({6}, 13, mt::kFloat32);
    const mt::BatchNormResult r = mt::batch_norm(x, gamma, beta, 1e-3);
    CHECK(r.out.dtype() == dt);
    CHECK(r.mean.dtype() == mt::kFloat32);
    const mt::Tensor xd = mt::cast(x, mt::kFloat64);
    const mt::Tensor ref =
        composed(xd, mt::cast(gamma, mt::kFloat64), mt::cast(beta, mt::kFloat64), 1e-3);
    // |y| up to about 4 sigma times |gamma| plus |beta|: a unit in the last place of 16.
    const double ulp = dt == mt::kFloat32 ? 1.2e-7 : dt == mt::kFloat16 ? 9.8e-4 : 7.8e-3;
    CHECK(max_abs_diff(r.out, ref) < 16 * ulp + 1e-5);
    const mt::Tensor x2 = mt::reshape(xd, mt::Shape{-1, 6});
    CHECK(max_abs_diff(r.mean, mt::mean(x2, {0})) < 1e-6);
    CHECK(max_abs_diff(r.variance, mt::mean(mt::square(x2 - mt::mean(x2, {0})), {0})) < 1e-7);
  }
}

TEST_CASE("batch_norm: the same bits on one thread and on several", "[batch_norm][fused]") {
  const mt::Tensor x = random_normal({300, 17, 9}, 15, mt::kFloat32, 1.0),
                   gamma = random_normal({9}, 16), beta = random_normal({9}, 17),
                   g = random_normal({300, 17, 9}, 18);
  const auto run = [&] {
    mt::Variable xv(x, "x"), gv(gamma, "gamma");
    mt::GradientTape tape;
    const mt::BatchNormResult r = mt::batch_norm(xv, gv, beta, 1e-3);
    const auto grads = tape.gradient(mt::sum(r.out * g), std::vector<mt::Variable>{xv, gv});
    std::vector<float> all = r.out.to_vector<float>();
    for (const mt::Tensor& t : {r.mean, r.variance, grads[0], grads[1]}) {
      const std::vector<float> v = t.to_vector<float>();
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  const int before = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> one = run();
  omp_set_num_threads(std::max(before, 2) + 1);
  const std::vector<float> several = run();
  omp_set_num_threads(before);
  CHECK(one == several);
}

TEST_CASE("batch_norm: float64 gradients against numeric differences, second derivatives",
          "[batch_norm][fused][grad]") {
  const mt::Tensor x = random_normal({5, 3}, 21, mt::kFloat64, 1.0), gamma = random_normal({3}, 22),
                   beta = random_normal({3}, 23), g = random_normal({5, 3}, 24);
  CHECK_GRADCHECK(
      "batch_norm",
      [](const mtest::Inputs& in) { return mt::batch_norm(in[0], in[1], in[2], 1e-3).out; },
      {x, gamma, beta}, mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
  // Second derivatives: the recorded backward pass is made of differentiable ops.
  const auto second = [&](bool fused) {
    mt::Variable a(x, "x"), b(gamma, "gamma"), c(beta, "beta");
    mt::GradientTape outer;
    std::vector<mt::Tensor> first;
    {
      mt::GradientTape inner;
      const mt::Tensor y = fused ? mt::batch_norm(a, b, c, 1e-3).out : composed(a, b, c, 1e-3);
      first = inner.gradient(mt::sum(y * g), std::vector<mt::Variable>{a, b, c});
    }
    return outer.gradient(mt::sum(first[0] * first[0]) + mt::sum(first[1] * first[1]),
                          std::vector<mt::Variable>{a, b, c});
  };
  const auto f = second(true), r = second(false);
  for (std::size_t i = 0; i < 2; ++i) CHECK(max_abs_diff(f[i], r[i]) < 1e-10);
}

TEST_CASE("batch_norm: bad input names the op, shapes and values", "[batch_norm][fused]") {
  using mixtape_test::error_of;
  const mt::Tensor x = random_normal({2, 4}, 31, mt::kFloat32);
  CHECK_THAT(
      error_of<mt::ShapeError>([&] { mt::batch_norm(x, mt::ones({3}), mt::Tensor(), 1e-5); }),
      Catch::Contains("batch_norm: gamma must be floating [4]") && Catch::Contains("float32[3]"));
  CHECK_THAT(error_of<mt::ShapeError>(
                 [&] { mt::batch_norm(x, mt::Tensor(), mt::ones({4}, mt::kInt32), 1e-5); }),
             Catch::Contains("beta must be floating"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::batch_norm(x, mt::Tensor(), mt::Tensor(), -1.0); }),
             Catch::Contains("epsilon must be finite and >= 0; got -1"));
  CHECK_THAT(
      error_of<mt::ValueError>([&] {
        mt::batch_norm(mt::ones({0, 4}), mt::Tensor(), mt::Tensor(), 1e-5);
      }),
      Catch::Contains("batch_norm: an empty batch has no statistics") && Catch::Contains("[0, 4]"));
  CHECK_THAT(error_of<mt::ShapeError>(
                 [&] { mt::batch_norm(mt::ones({}), mt::Tensor(), mt::Tensor(), 1e-5); }),
             Catch::Contains("rank >= 1"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               mt::batch_norm(x, mt::Tensor(), mt::Tensor(), mt::zeros({4}), mt::ones({5}), 1e-5);
             }),
             Catch::Contains("batch_norm: variance must be floating [4]"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::batch_norm(x, mt::Tensor(), mt::Tensor(), mt::zeros({4}), mt::Tensor(), 1e-5);
             }),
             Catch::Contains("batch_norm: the given statistics need both a mean and a variance"));
  CHECK_THROWS_AS(mt::batch_norm(mt::ones({2, 3}, mt::kInt32), mt::Tensor(), mt::Tensor(), 1e-5),
                  mt::Error);
}

TEST_CASE("BatchNormalization trains on the fused op, as its composed form did",
          "[batch_norm][fused][layers]") {
  for (const char* policy : {"float32", "mixed_bfloat16", "mixed_float16", "float64"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    // Channels last runs the fused op; channels first (axis 1) the composed form: the same
    // layer on the transposed input must agree with it, moving statistics included.
    auto last = ml::BatchNormalization({.momentum = 0.9, .epsilon = 1e-3});
    auto first = ml::BatchNormalization({.axis = 1, .momentum = 0.9, .epsilon = 1e-3});
    const mt::Tensor x = random_normal({6, 5, 4, 3}, 41, mt::kFloat32, 1.5) + 2.0;
    const mt::Tensor xt = mt::contiguous(mt::permute(x, {0, 3, 1, 2}));
    const mt::Tensor g = random_normal({6, 5, 4, 3}, 42, mt::kFloat32);
    (void)last(x), (void)first(xt);  // built: gamma 1, beta 0
    for (ml::BatchNormalizationLayer* bn : {last.get(), first.get()}) {
      const mt::DType pd = bn->gamma().dtype();
      bn->set_weights({random_normal({3}, 43, pd, 1.0, 0.5), random_normal({3}, 44, pd),
                       bn->moving_mean(), bn->moving_variance()});
    }
    mt::Variable xv(x, "x"), xtv(xt, "xt");
    mt::GradientTape tape;
    const mt::Tensor y = last(xv, {.training = true});
    const mt::Tensor yt = first(xtv, {.training = true});
    CHECK(y.dtype() == last->compute_dtype());
    const bool sixteen = std::string(policy).starts_with("mixed");
    const double tol = std::string(policy) == "mixed_bfloat16" ? 3e-2 : sixteen ? 4e-3 : 1e-5;
    CHECK(max_abs_diff(y, mt::permute(yt, {0, 2, 3, 1})) <= tol);
    for (int i = 0; i < 2; ++i) {
      const mt::Variable& a = i == 0 ? last->moving_mean() : last->moving_variance();
      const mt::Variable& b = i == 0 ? first->moving_mean() : first->moving_variance();
      CHECK(max_abs_diff(a, b) <= (sixteen ? 1e-5 : 1e-7));
    }
    const mt::Tensor loss = mt::sum(mt::cast(y, mt::kFloat32) * g) +
                            mt::sum(mt::cast(yt, mt::kFloat32) * mt::permute(g, {0, 3, 1, 2}));
    const auto grads =
        tape.gradient(loss, std::vector<mt::Variable>{xv, xtv, last->gamma(), first->gamma(),
                                                      last->beta(), first->beta()});
    CHECK(max_abs_diff(grads[0], mt::permute(grads[1], {0, 2, 3, 1})) <= 20 * tol);
    CHECK(max_abs_diff(grads[2], grads[3]) <= 200 * tol);
    CHECK(max_abs_diff(grads[4], grads[5]) <= 200 * tol);
  }
}

TEST_CASE("BatchNormalization infers and trains frozen on the fused op, as its composed form did",
          "[batch_norm][fused][layers]") {
  for (const char* policy : {"float32", "mixed_bfloat16"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    auto last = ml::BatchNormalization();
    auto first = ml::BatchNormalization({.axis = 1});
    const mt::Tensor x = random_normal({6, 5, 4, 3}, 51, mt::kFloat32, 1.5);
    const mt::Tensor xt = mt::contiguous(mt::permute(x, {0, 3, 1, 2}));
    (void)last(x), (void)first(xt);
    for (ml::BatchNormalizationLayer* bn : {last.get(), first.get()}) {
      const mt::DType pd = bn->gamma().dtype();
      bn->set_weights({random_normal({3}, 52, pd, 1.0, 0.5), random_normal({3}, 53, pd),
                       random_normal({3}, 54, pd, 1.5), random_normal({3}, 55, pd, 1.0, 0.1)});
    }
    const double tol = std::string(policy) == "float32" ? 1e-5 : 3e-2;
    // Inference: the moving statistics, unchanged; an empty batch too.
    const mt::Tensor y = last(x), yt = first(xt);
    CHECK(max_abs_diff(y, mt::permute(yt, {0, 2, 3, 1})) <= tol);
    CHECK(last(mt::zeros({0, 5, 4, 3})).shape() == mt::Shape{0, 5, 4, 3});
    // Frozen in training: the moving statistics, the gradient through x.
    last->set_trainable(false);
    first->set_trainable(false);
    const auto before = last->moving_mean().to_vector<double>();
    mt::Variable xv(x, "x"), xtv(xt, "xt");
    mt::GradientTape tape;
    const mt::Tensor z = last(xv, {.training = true}), zt = first(xtv, {.training = true});
    const mt::Tensor g = random_normal({6, 5, 4, 3}, 56, mt::kFloat32);
    const auto grads =
        tape.gradient(mt::sum(mt::cast(z, mt::kFloat32) * g) +
                          mt::sum(mt::cast(zt, mt::kFloat32) * mt::permute(g, {0, 3, 1, 2})),
                      std::vector<mt::Variable>{xv, xtv});
    CHECK(last->moving_mean().to_vector<double>() == before);
    CHECK(max_abs_diff(z, mt::permute(zt, {0, 2, 3, 1})) <= tol);
    CHECK(max_abs_diff(grads[0], mt::permute(grads[1], {0, 2, 3, 1})) <= 10 * tol);
  }
}
