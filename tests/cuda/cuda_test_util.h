// Shared by the CUDA tests: random inputs (never all zero), NaN-poisoned outputs, and the
// comparison of a CUDA result with the CPU backend's, with per-dtype tolerances or bit for
// bit.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace ctest_util {

namespace mt = mixtape;

inline const mt::Device kGpu = mt::Device::cuda(0);
inline const std::vector<mt::DType> kFloatTypes = {mt::kFloat32, mt::kFloat16, mt::kBFloat16,
                                                   mt::kFloat64};

// Relative error allowed, against the largest magnitude of the reference: elementwise
// ops and reductions (two roundings at most in 16 bits), and GEMM-like ops (the issue's
// bounds: fp32 1e-5, bf16 1e-2, fp16 2e-3).
inline double tolerance(mt::DType dt, bool gemm_like = false) {
  if (dt == mt::kFloat64) return 1e-12;
  if (dt == mt::kFloat32) return gemm_like ? 1e-5 : 2e-6;
  if (dt == mt::kFloat16) return gemm_like ? 2e-3 : 2e-3;
  return 1e-2;  // bfloat16
}

// Uniform in [lo, hi) on the CPU (never all zero), seeded.
inline mt::Tensor random(const mt::Shape& shape, mt::DType dt, std::uint64_t seed, double lo = -1.0,
                         double hi = 1.0) {
  mt::Generator gen(seed);
  mt::Tensor t = mt::uniform(shape, lo, hi, dt, mt::Device::cpu(), &gen);
  const auto v = t.to_vector<double>();
  REQUIRE((v.empty() || std::any_of(v.begin(), v.end(), [](double x) { return x != 0.0; })));
  return t;
}

// A GPU tensor filled with NaN (floating) or a sentinel (integers), so that elements a
// kernel fails to write show up.
inline mt::Tensor poisoned(const mt::Shape& shape, mt::DType dt) {
  const double value = dt.is_floating() ? NAN : -123456.0;
  return mt::full(shape, value, dt, kGpu);
}

// Checks that `got` (any device) matches `want` (any device): same shape and dtype, no
// NaN where the reference has none, and max |got - want| <= tol * max(|want|, 1e-30).
inline void check_close(const mt::Tensor& got, const mt::Tensor& want, double tol,
                        const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  double scale = 1e-30, worst = 0.0;
  std::size_t worst_at = 0, nan_mismatch = 0;
  for (double x : w)
    if (std::isfinite(x)) scale = std::max(scale, std::abs(x));
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (std::isnan(g[i]) != std::isnan(w[i]) || std::isinf(g[i]) != std::isinf(w[i])) {
      ++nan_mismatch;
      continue;
    }
    if (!std::isfinite(w[i])) continue;
    const double e = std::abs(g[i] - w[i]);
    if (e > worst) worst = e, worst_at = i;
  }
  INFO(
      fmt::format("{} elements: max error {:.3g} at {} (got {}, want {}), scale {:.3g}, "
                  "tolerance {:.3g}, NaN/inf mismatches {}",
                  g.size(), worst, worst_at, g.empty() ? 0.0 : g[worst_at],
                  w.empty() ? 0.0 : w[worst_at], scale, tol * scale, nan_mismatch));
  CHECK(nan_mismatch == 0);
  CHECK(worst <= tol * scale);
}

// Exact equality (integers, bool, and ops that only move elements).
inline void check_equal(const mt::Tensor& got, const mt::Tensor& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  std::size_t bad = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    if (!(g[i] == w[i] || (std::isnan(g[i]) && std::isnan(w[i])))) ++bad;
  CHECK(bad == 0);
}

// got and want (any devices) hold the same bits, element by element; a NaN matches any NaN
// (payloads differ between the CPU's and CUDA's conversions).
inline void check_bits(const mt::Tensor& got, const mt::Tensor& want, const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const mt::DType dt = got.dtype();
  const auto g = mt::detail::host_bytes(got), w = mt::detail::host_bytes(want);
  REQUIRE(g.size() == w.size());
  const std::size_t item = dt.itemsize();
  const auto value_at = [&](const std::vector<std::uint8_t>& bytes, std::size_t i) {
    return mt::detail::read_as_double(bytes.data() + i * item, dt);
  };
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i * item < g.size(); ++i) {
    if (std::memcmp(g.data() + i * item, w.data() + i * item, item) == 0) continue;
    if (dt.is_floating() && std::isnan(value_at(g, i)) && std::isnan(value_at(w, i))) continue;
    if (bad++ == 0) first = i;
  }
  INFO(fmt::format("{} of {} elements differ; first at {}: got {}, want {}", bad, g.size() / item,
                   first, bad ? value_at(g, first) : 0.0, bad ? value_at(w, first) : 0.0));
  CHECK(bad == 0);
}

}  // namespace ctest_util
