// softmax_cross_entropy (ops softmax_cross_entropy and its backward) against the composed
// computation (log_softmax, then the picked entry) in float64 and every float dtype, its
// gradients (kernel and differentiable form), bad input, and the loss that uses it.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/mixtape.h"
#include "tensor_check.h"

namespace mt = mixtape;
using mixtape_test::max_abs_diff;
using mixtape_test::random_normal;

namespace {

// Logits spread wide enough (sd 3) that the maximum matters.
mt::Tensor logits_of(const mt::Shape& shape, std::uint64_t seed, mt::DType dtype = mt::kFloat64) {
  return random_normal(shape, seed, dtype, 0.0, 3.0);
}

mt::Tensor labels_of(std::int64_t n, std::int64_t classes, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < n; ++i)
    v.push_back(static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(classes)));
  return mt::from_vector(v, {n});
}

// -log_softmax(x)[label] per row, composed.
mt::Tensor composed(const mt::Tensor& x, const mt::Tensor& labels) {
  const std::int64_t n = labels.numel();
  return mt::reshape(-mt::gather(mt::log_softmax(x, -1), mt::reshape(labels, {n, 1}), 1), {n});
}

}  // namespace

TEST_CASE("softmax_cross_entropy equals the composed loss in float64, gradients too",
          "[cross_entropy][fused]") {
  for (const std::int64_t classes : {1, 7, 300}) {
    INFO(classes << " classes");
    const mt::Tensor x = logits_of({9, classes}, 1), labels = labels_of(9, classes, 2),
                     g = logits_of({9}, 3);
    CHECK(max_abs_diff(mt::softmax_cross_entropy(x, labels), composed(x, labels)) < 1e-12);
    const auto grad = [&](bool fused) {
      mt::Variable xv(x, "x");
      mt::GradientTape tape;
      const mt::Tensor l = fused ? mt::softmax_cross_entropy(xv, labels) : composed(xv, labels);
      return tape.gradient(mt::sum(l * g), std::vector<mt::Variable>{xv})[0];
    };
    CHECK(max_abs_diff(grad(true), grad(false)) < 1e-12);
  }
  // Leading axes: [2, 3, c] logits, [2, 3] labels.
  const mt::Tensor x = logits_of({2, 3, 5}, 4), labels = mt::reshape(labels_of(6, 5, 5), {2, 3});
  const mt::Tensor y = mt::softmax_cross_entropy(x, labels);
  CHECK(y.shape() == mt::Shape{2, 3});
  CHECK(max_abs_diff(mt::reshape(y, {6}),
                     composed(mt::reshape(x, {6, 5}), mt::reshape(labels, {6}))) < 1e-12);
}

TEST_CASE("softmax_cross_entropy in float32, float16 and bfloat16: float32 math, float32 loss",
          "[cross_entropy][fused]") {
  for (const mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
    INFO(dt.name());
    const mt::Tensor x = mt::cast(logits_of({16, 1000}, 11), dt), labels = labels_of(16, 1000, 12);
    const mt::Tensor loss = mt::softmax_cross_entropy(x, labels);
    CHECK(loss.dtype() == mt::kFloat32);
    CHECK(max_abs_diff(loss, composed(mt::cast(x, mt::kFloat64), labels)) < 1e-4);
    mt::Variable xv(x, "x");
    mt::GradientTape tape;
    const mt::Tensor d = tape.gradient(mt::sum(mt::softmax_cross_entropy(xv, labels)),
                                       std::vector<mt::Variable>{xv})[0];
    CHECK(d.dtype() == dt);
    mt::Variable xr(mt::cast(x, mt::kFloat64), "xr");
    mt::GradientTape ref_tape;
    const mt::Tensor r =
        ref_tape.gradient(mt::sum(composed(xr, labels)), std::vector<mt::Variable>{xr})[0];
    const double ulp = dt == mt::kFloat32 ? 1.2e-7 : dt == mt::kFloat16 ? 9.8e-4 : 7.8e-3;
    CHECK(max_abs_diff(d, r) < 4 * ulp + 1e-6);
  }
}

TEST_CASE("softmax_cross_entropy: numeric gradients and second derivatives in float64",
          "[cross_entropy][fused][grad]") {
  const mt::Tensor x = logits_of({4, 6}, 21), labels = labels_of(4, 6, 22), g = logits_of({4}, 23);
  CHECK_GRADCHECK(
      "softmax_cross_entropy",
      [&](const mtest::Inputs& in) { return mt::softmax_cross_entropy(in[0], labels); }, {x},
      mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
  const auto second = [&](bool fused) {
    mt::Variable a(x, "x");
    mt::GradientTape outer;
    mt::Tensor first;
    {
      mt::GradientTape inner;
      const mt::Tensor l = fused ? mt::softmax_cross_entropy(a, labels) : composed(a, labels);
      first = inner.gradient(mt::sum(l * g), std::vector<mt::Variable>{a})[0];
    }
    return outer.gradient(mt::sum(first * first), std::vector<mt::Variable>{a})[0];
  };
  CHECK(max_abs_diff(second(true), second(false)) < 1e-12);
}

TEST_CASE("softmax_cross_entropy: bad input, and the loss's message for a bad label",
          "[cross_entropy][fused]") {
  using mixtape_test::error_of;
  const mt::Tensor x = logits_of({3, 4}, 31, mt::kFloat32);
  CHECK_THAT(
      error_of<mt::IndexError>([&] {
        mt::softmax_cross_entropy(x, mt::from_vector(std::vector<std::int64_t>{0, 4, 1}, {3}));
      }),
      Catch::Contains("labels must lie in [0, 4) for 4 classes; got 4 at flat position 1"));
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::softmax_cross_entropy(x, labels_of(4, 4, 1)); }),
             Catch::Contains("labels int64[4] do not match logits float32[3, 4]"));
  CHECK_THAT(
      error_of<mt::DTypeError>([&] {
        mt::softmax_cross_entropy(x, mt::from_vector(std::vector<std::int32_t>{0, 1, 2}, {3}));
      }),
      Catch::Contains("labels must be int64"));
  CHECK_THROWS_AS(mt::softmax_cross_entropy(mt::zeros({3, 0}), labels_of(3, 1, 1)), mt::ShapeError);
  // Through the loss: its name and the classes, as before the fused op.
  const auto loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  CHECK_THAT(error_of<mt::IndexError>([&] {
               loss(mt::from_vector(std::vector<std::int64_t>{0, 7, 1}, {3}), x);
             }),
             Catch::Contains("sparse_categorical_crossentropy: labels must lie in [0, 4)"));
}
