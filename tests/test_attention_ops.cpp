// The ops attention is built from: masked_softmax (forward against a direct float64
// computation, masks of every broadcast shape, float16 logits, bad input).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;

namespace {

// softmax(scale * x) over the last axis of x ([rows, cols] row-major), over the positions
// where keep is set; 0 elsewhere and in rows with none set. In float64.
std::vector<double> reference(const std::vector<double>& x, const std::vector<bool>& keep,
                              std::int64_t cols, double scale) {
  std::vector<double> y(x.size(), 0.0);
  for (std::size_t r0 = 0; r0 < x.size(); r0 += static_cast<std::size_t>(cols)) {
    double m = -std::numeric_limits<double>::infinity();
    bool any = false;
    for (std::size_t j = r0; j < r0 + static_cast<std::size_t>(cols); ++j)
      if (keep[j]) m = std::max(m, scale * x[j]), any = true;
    if (!any) continue;
    double s = 0;
    for (std::size_t j = r0; j < r0 + static_cast<std::size_t>(cols); ++j)
      if (keep[j]) s += std::exp(scale * x[j] - m);
    for (std::size_t j = r0; j < r0 + static_cast<std::size_t>(cols); ++j)
      if (keep[j]) y[j] = std::exp(scale * x[j] - m) / s;
  }
  return y;
}

mt::Tensor bool_tensor(const std::vector<bool>& v, const mt::Shape& shape) {
  std::vector<std::uint8_t> bytes(v.begin(), v.end());
  return mt::from_vector(bytes, shape).to(mt::kBool);
}

}  // namespace

TEST_CASE("masked_softmax against float64, every float dtype, broadcast masks", "[attention]") {
  std::mt19937_64 rng(77);
  std::uniform_real_distribution<double> u(-4.0, 4.0);
  const mt::Shape shape{2, 3, 4, 37};  // [batch, heads, queries, keys]
  const std::int64_t n = shape.numel(), cols = 37;
  std::vector<double> xv(static_cast<std::size_t>(n));
  for (double& v : xv) v = u(rng);
  // Masks of shapes that broadcast to x: [batch, 1, 1, keys] padding, [queries, keys]
  // causal-like, the full shape, and none.
  struct Case {
    const char* name;
    mt::Shape mask_shape;
  };
  for (const Case& c : {Case{"padding", {2, 1, 1, 37}}, Case{"causal", {4, 37}},
                        Case{"full", {2, 3, 4, 37}}, Case{"none", {}}}) {
    const bool masked = c.mask_shape.rank() > 0;
    std::vector<bool> mask_values(static_cast<std::size_t>(masked ? c.mask_shape.numel() : 0));
    for (std::size_t i = 0; i < mask_values.size(); ++i) mask_values[i] = rng() % 3 != 0;
    if (std::string(c.name) == "causal")
      for (std::int64_t q = 0; q < 4; ++q)
        for (std::int64_t k = 0; k < cols; ++k)
          mask_values[static_cast<std::size_t>(q * cols + k)] = k <= q * 9;
    if (std::string(c.name) == "full")  // one wholly masked row
      for (std::int64_t k = 0; k < cols; ++k) mask_values[static_cast<std::size_t>(k)] = false;
    // The mask as seen at every position of x.
    std::vector<bool> keep(static_cast<std::size_t>(n), true);
    if (masked) {
      const mt::Tensor expanded =
          bool_tensor(mask_values, c.mask_shape).expand(shape).to(mt::kFloat64);
      const std::vector<double> e = expanded.contiguous().to_vector<double>();
      for (std::size_t i = 0; i < keep.size(); ++i) keep[i] = e[i] != 0.0;
    }
    const double scale = 0.35;
    for (mt::DType dt : {mt::kFloat64, mt::kFloat32, mt::kFloat16, mt::kBFloat16}) {
      SECTION(std::string(c.name) + " " + std::string(dt.name())) {
        const mt::Tensor x = mt::from_vector(xv, shape).to(dt);
        // The reference sees the values the dtype stored.
        const std::vector<double> stored = x.to(mt::kFloat64).to_vector<double>();
        const std::vector<double> ref = reference(stored, keep, cols, scale);
        const mt::Tensor mask = masked ? bool_tensor(mask_values, c.mask_shape) : mt::Tensor();
        const mt::Tensor y = mt::masked_softmax(x, mask, scale);
        REQUIRE(y.dtype() == dt);
        REQUIRE(y.shape() == shape);
        const std::vector<double> got = y.to(mt::kFloat64).to_vector<double>();
        // One rounding to the dtype after float32 (float64) arithmetic.
        const double tol = dt == mt::kFloat64   ? 1e-14
                           : dt == mt::kFloat32 ? 2e-6
                           : dt == mt::kFloat16 ? 1e-3
                                                : 8e-3;
        for (std::size_t i = 0; i < got.size(); ++i) {
          INFO("element " << i);
          if (!keep[i]) REQUIRE(got[i] == 0.0);
          REQUIRE(std::fabs(got[i] - ref[i]) <= tol * std::max(ref[i], 1e-3));
        }
      }
    }
  }
}

TEST_CASE("masked_softmax: masked values are never read, empty rows are 0", "[attention]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const mt::Tensor x = mt::from_vector(std::vector<double>{1.0, nan, 3.0, nan, nan, nan}, {2, 3});
  const mt::Tensor mask = bool_tensor({true, false, true, false, false, false}, {2, 3});
  for (mt::DType dt : {mt::kFloat32, mt::kFloat16}) {
    const std::vector<double> y =
        mt::masked_softmax(x.to(dt), mask).to(mt::kFloat64).to_vector<double>();
    const double e = std::exp(-2.0);
    CHECK(y[0] == Approx(e / (1 + e)).epsilon(1e-3));
    CHECK(y[1] == 0.0);
    CHECK(y[2] == Approx(1 / (1 + e)).epsilon(1e-3));
    CHECK(y[3] == 0.0);
    CHECK(y[4] == 0.0);
    CHECK(y[5] == 0.0);
  }
  // An unmasked NaN makes its row NaN, as softmax does.
  const std::vector<double> y = mt::masked_softmax(x, mt::Tensor()).to_vector<double>();
  CHECK(std::isnan(y[0]));
}

TEST_CASE("masked_softmax: NaN and infinities in rows longer than a vector", "[attention]") {
  // Rows of 70 (the vector loops and their tails), every other position masked. Row 0: NaN
  // at every masked position, finite values elsewhere. Row 1: one unmasked NaN. Row 2: the
  // unmasked values all -inf. Row 3: one unmasked +inf. Rows 1 to 3 are NaN where unmasked
  // (as softmax of such a row is); every masked position is 0.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::int64_t cols = 70;
  std::vector<double> xv(static_cast<std::size_t>(4 * cols));
  std::vector<bool> keep(static_cast<std::size_t>(4 * cols));
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t j = 0; j < cols; ++j) {
      const auto i = static_cast<std::size_t>(r * cols + j);
      keep[i] = j % 2 == 0;
      xv[i] = keep[i] ? (r == 2 ? -inf : 0.1 * static_cast<double>(j % 9)) : nan;
    }
  xv[static_cast<std::size_t>(1 * cols + 10)] = nan;
  xv[static_cast<std::size_t>(3 * cols + 20)] = inf;
  const std::vector<double> ref =
      reference(std::vector<double>(xv.begin(), xv.begin() + cols),
                std::vector<bool>(keep.begin(), keep.begin() + cols), cols, 1.0);
  for (mt::DType dt : {mt::kFloat64, mt::kFloat32, mt::kBFloat16}) {
    INFO(dt.name());
    const std::vector<double> y =
        mt::masked_softmax(mt::from_vector(xv, {4, cols}).to(dt), bool_tensor(keep, {4, cols}))
            .to(mt::kFloat64)
            .to_vector<double>();
    for (std::int64_t r = 0; r < 4; ++r)
      for (std::int64_t j = 0; j < cols; ++j) {
        INFO("row " << r << " column " << j);
        const auto i = static_cast<std::size_t>(r * cols + j);
        if (!keep[i])
          REQUIRE(y[i] == 0.0);
        else if (r > 0)
          REQUIRE(std::isnan(y[i]));
        else
          REQUIRE(y[i] == Approx(ref[static_cast<std::size_t>(j)]).epsilon(1e-2));
      }
  }
}

TEST_CASE("masked_softmax: float16 logits up to 1e4 give no NaN or overflow", "[attention]") {
  // Attention logits of a float16 model: large, close together, computed in float32 inside.
  const std::vector<double> xv{10000.0, 9990.0, -10000.0, 9999.0, 0.0, 65504.0, 65000.0, -65504.0};
  const mt::Tensor x = mt::from_vector(xv, {2, 4}).to(mt::kFloat16);
  const std::vector<double> y =
      mt::masked_softmax(x, mt::Tensor(), 1.0).to(mt::kFloat64).to_vector<double>();
  for (double v : y) CHECK(std::isfinite(v));
  std::vector<bool> all(8, true);
  const std::vector<double> ref = reference(x.to(mt::kFloat64).to_vector<double>(), all, 4, 1.0);
  for (std::size_t i = 0; i < y.size(); ++i) CHECK(std::fabs(y[i] - ref[i]) <= 1e-3);
  // The plain composition in float16 overflows: exp(1e4 - 0) is inf, the scale product too.
  const mt::Tensor scaled = x * 8.0;
  CHECK_FALSE(std::isfinite(scaled.to(mt::kFloat64).to_vector<double>()[0]));
  const std::vector<double> y8 =
      mt::masked_softmax(x, mt::Tensor(), 8.0).to(mt::kFloat64).to_vector<double>();
  for (double v : y8) CHECK(std::isfinite(v));
}

TEST_CASE("masked_softmax: bad input names the op, shapes and dtypes", "[attention]") {
  const mt::Tensor x = mt::ones({2, 3, 4});
  const mt::Tensor not_bool = mt::ones({4});
  CHECK_THROWS_AS(mt::masked_softmax(x, not_bool), mt::DTypeError);
  CHECK_THROWS_WITH(mt::masked_softmax(x, not_bool),
                    Catch::Contains("masked_softmax") && Catch::Contains("must be bool"));
  const mt::Tensor five = bool_tensor(std::vector<bool>(5, true), {5});
  CHECK_THROWS_AS(mt::masked_softmax(x, five), mt::ShapeError);
  CHECK_THROWS_WITH(mt::masked_softmax(x, five), Catch::Contains("masked_softmax"));
  const mt::Tensor too_many = bool_tensor(std::vector<bool>(48, true), {2, 2, 3, 4});
  CHECK_THROWS_AS(mt::masked_softmax(x, too_many), mt::ShapeError);
  CHECK_THROWS_WITH(mt::masked_softmax(x, too_many), Catch::Contains("does not broadcast"));
  CHECK_THROWS_AS(mt::masked_softmax(x, mt::Tensor(), std::numeric_limits<double>::infinity()),
                  mt::ValueError);
  CHECK_THROWS_AS(mt::masked_softmax(mt::ones({})), mt::ShapeError);
  CHECK_THROWS_AS(mt::masked_softmax(mt::ones({2, 3}, mt::kInt32)), mt::Error);
}

TEST_CASE("masked_softmax runs in float32 under automatic mixed precision", "[attention]") {
  // Its default AMP list is deny: float16 inputs are cast up, the result is float32.
  CHECK(mt::AmpLists::defaults().category("masked_softmax") == mt::AmpCategory::Deny);
  const bool was_on = mt::auto_mixed_precision_enabled();
  const mt::DType was_dtype = mt::auto_mixed_precision_dtype();
  mt::set_auto_mixed_precision(true, mt::kFloat16);
  mt::DType got;
  {
    mt::AutoMixedPrecisionScope amp;
    got = mt::masked_softmax(mt::ones({2, 4}, mt::kFloat16)).dtype();
  }
  mt::set_auto_mixed_precision(was_on, was_dtype);
  CHECK(got == mt::kFloat32);
}
