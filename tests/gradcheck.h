// A numeric gradient checker for the test suite.
//
// gradcheck(name, f, inputs) compares, for every element of every (float64) input, the
// analytic gradient of  L = sum(f(inputs) * R)  computed with a GradientTape against the
// central difference (L(x + eps) - L(x - eps)) / (2 eps). R is a fixed random float64
// tensor of f's output shape, so every element of a non-scalar output takes part.
//
// The inputs are copied into fresh contiguous float64 tensors first (the numeric pass
// perturbs them in place), so callers may pass views or shared tensors. Build views
// inside `f` to check ops on non-contiguous operands.
//
//   CHECK_GRADCHECK("matmul", [](const Inputs& v) { return mt::matmul(v[0], v[1]); },
//                   {a, b});
//
// gradgradcheck(name, f, inputs) does the same for the first derivative (computed with a
// nested tape), checking that backward rules are themselves differentiable.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/mixtape.h"

namespace mtest {

namespace mt = mixtape;

using Inputs = std::vector<mt::Tensor>;
using GradFn = std::function<mt::Tensor(const Inputs&)>;

struct GradCheckOptions {
  double eps = 1e-6;   // central-difference step
  double atol = 1e-5;  // an element passes when |analytic - numeric| <= atol + rtol * scale
  double rtol = 1e-4;  // scale = max(|analytic|, |numeric|)
  std::uint64_t seed = 0x5eed;  // for R
};

struct InputReport {
  bool defined = false;   // the tape returned a gradient for this input
  bool shape_ok = false;  // ... of the input's shape
  bool dtype_ok = false;  // ... and dtype (float64)
  double max_abs_err = 0.0;
  double max_rel_err = 0.0;  // |a - n| / max(|a|, |n|, 1e-12)
  std::int64_t worst = -1;   // flat index of the element with the worst error ratio
  double analytic_at_worst = 0.0;
  double numeric_at_worst = 0.0;
  bool ok = false;
};

struct GradCheckResult {
  bool ok = false;
  std::vector<InputReport> inputs;
  std::string exception;  // what() of an exception thrown by f or the tape, if any
  std::string report;     // human-readable summary, one line per failing input
};

// "[i, j, k]" for a flat row-major index into `shape`.
inline std::string multi_index(const mt::Shape& shape, std::int64_t flat) {
  std::vector<std::int64_t> idx(shape.rank(), 0);
  for (std::size_t d = shape.rank(); d-- > 0;) {
    const std::int64_t n = shape[d];
    idx[d] = n > 0 ? flat % n : 0;
    flat = n > 0 ? flat / n : 0;
  }
  std::string s = "[";
  for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

// A fresh contiguous float64 copy of `t` with its own storage.
inline mt::Tensor clone_f64(const mt::Tensor& t) {
  return mt::from_vector(t.to_vector<double>(), t.shape(), mt::kFloat64);
}

inline GradCheckResult gradcheck(const std::string& name, const GradFn& f, const Inputs& inputs,
                                 const GradCheckOptions& opt = {}) {
  GradCheckResult res;
  res.inputs.resize(inputs.size());
  std::vector<mt::Tensor> xs;
  std::vector<mt::Tensor> grads;
  std::vector<double> r;
  try {
    for (const auto& t : inputs) xs.push_back(clone_f64(t));

    // Analytic gradient of sum(f(x) * R).
    mt::Tensor y;
    {
      mt::GradientTape tape;
      tape.watch(xs);
      y = f(xs);
      mt::Generator gen(opt.seed);
      mt::Tensor rt = mt::normal(y.shape(), 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &gen);
      r = rt.to_vector<double>();
      mt::Tensor target = mt::sum(mt::mul(y, rt));
      grads = tape.gradient(target, xs);
    }
    if (y.dtype() != mt::kFloat64)
      res.report += fmt::format("  note: f's output is {}, not float64\n", y.dtype().name());

    // L(x) evaluated without recording, accumulated on the host in float64.
    // (No tape watches the copies here, so nothing is recorded; no NoGradGuard either, so
    // that gradgradcheck's inner tapes keep working.)
    auto loss = [&]() {
      const std::vector<double> out = f(xs).to_vector<double>();
      if (out.size() != r.size())
        throw mt::ShapeError(
            fmt::format("gradcheck: output size changed from {} to {}", r.size(), out.size()));
      double acc = 0.0;
      for (std::size_t k = 0; k < out.size(); ++k) acc += out[k] * r[k];
      return acc;
    };

    res.ok = true;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      InputReport& rep = res.inputs[i];
      const mt::Tensor& g = grads.at(i);
      rep.defined = g.defined();
      rep.shape_ok = !g.defined() || g.shape() == xs[i].shape();
      rep.dtype_ok = !g.defined() || g.dtype() == mt::kFloat64;
      std::vector<double> analytic;
      if (g.defined() && rep.shape_ok)
        analytic = g.to_vector<double>();
      else
        analytic.assign(static_cast<std::size_t>(xs[i].numel()), 0.0);

      double* p = xs[i].data<double>();
      double worst_ratio = -1.0;
      double max_numeric = 0.0;
      bool elements_ok = true;
      for (std::int64_t j = 0; j < xs[i].numel(); ++j) {
        const double saved = p[j];
        p[j] = saved + opt.eps;
        const double lp = loss();
        p[j] = saved - opt.eps;
        const double lm = loss();
        p[j] = saved;
        const double numeric = (lp - lm) / (2.0 * opt.eps);
        const double a = analytic[static_cast<std::size_t>(j)];
        const double err = std::abs(a - numeric);
        const double scale = std::max(std::abs(a), std::abs(numeric));
        const double tol = opt.atol + opt.rtol * scale;
        const double ratio = std::isnan(err) ? std::numeric_limits<double>::infinity() : err / tol;
        max_numeric = std::max(max_numeric, std::abs(numeric));
        rep.max_abs_err = std::max(rep.max_abs_err, std::isnan(err) ? INFINITY : err);
        rep.max_rel_err = std::max(rep.max_rel_err, err / std::max(scale, 1e-12));
        if (ratio > worst_ratio) {
          worst_ratio = ratio;
          rep.worst = j;
          rep.analytic_at_worst = a;
          rep.numeric_at_worst = numeric;
        }
        if (!(err <= tol)) elements_ok = false;
      }
      // An undefined gradient is fine only where the function does not depend on the input.
      const bool defined_ok = rep.defined || max_numeric <= opt.atol;
      rep.ok = defined_ok && rep.shape_ok && rep.dtype_ok && elements_ok;
      if (!rep.ok) {
        res.ok = false;
        res.report += fmt::format("  {}: input {} (shape {}):", name, i, xs[i].shape().str());
        if (!defined_ok) res.report += " gradient is undefined;";
        if (!rep.shape_ok) res.report += fmt::format(" gradient shape {};", g.shape().str());
        if (!rep.dtype_ok) res.report += fmt::format(" gradient dtype {};", g.dtype().name());
        if (!elements_ok && rep.worst >= 0)
          res.report += fmt::format(
              " worst element {} analytic {:.10g} numeric {:.10g} (max abs err {:.3g}, max rel "
              "err {:.3g})",
              multi_index(xs[i].shape(), rep.worst), rep.analytic_at_worst, rep.numeric_at_worst,
              rep.max_abs_err, rep.max_rel_err);
        res.report += "\n";
      }
    }
  } catch (const std::exception& e) {
    res.ok = false;
    res.exception = e.what();
    res.report += fmt::format("  {}: threw: {}\n", name, e.what());
  }
  if (res.ok)
    res.report = fmt::format("  {}: ok\n", name) + res.report;
  else
    res.report = fmt::format("gradcheck failed for {}\n", name) + res.report;
  return res;
}

// Second order: checks the gradient of  x -> d/dx sum(f(x) * R2)  (all inputs' gradients,
// flattened and concatenated), computed with an inner GradientTape while gradcheck's
// tape records it. This checks that the backward rules are themselves differentiable.
inline GradCheckResult gradgradcheck(const std::string& name, const GradFn& f, const Inputs& inputs,
                                     const GradCheckOptions& opt = {}) {
  const std::uint64_t seed2 = opt.seed ^ 0x9e3779b97f4a7c15ULL;
  GradFn first_derivative = [f, seed2](const Inputs& xs) {
    std::vector<mt::Tensor> grads;
    {
      mt::GradientTape inner;
      inner.watch(xs);
      const mt::Tensor y = f(xs);
      mt::Generator gen(seed2);
      const mt::Tensor r = mt::normal(y.shape(), 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &gen);
      grads = inner.gradient(mt::sum(mt::mul(y, r)), xs);
    }
    std::vector<mt::Tensor> flat;
    for (std::size_t i = 0; i < xs.size(); ++i)
      flat.push_back(grads[i].defined() ? mt::reshape(grads[i], {xs[i].numel()})
                                        : mt::zeros({xs[i].numel()}, mt::kFloat64));
    return flat.size() == 1 ? flat[0] : mt::concat(flat, 0);
  };
  return gradcheck(name + " (2nd order)", first_derivative, inputs, opt);
}

// --- Input helpers (float64, seeded) ----------------------------------------------------

// Uniform in [lo, hi).
inline mt::Tensor rand64(const mt::Shape& shape, double lo, double hi, std::uint64_t seed) {
  mt::Generator gen(seed);
  return mt::uniform(shape, lo, hi, mt::kFloat64, mt::Device::cpu(), &gen);
}

// Standard normal.
inline mt::Tensor randn64(const mt::Shape& shape, std::uint64_t seed) {
  mt::Generator gen(seed);
  return mt::normal(shape, 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &gen);
}

// |x| in [lo, hi) with a random sign: away from the kink of abs / relu.
inline mt::Tensor away_from_zero(const mt::Shape& shape, double lo, double hi, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<double> v(static_cast<std::size_t>(shape.numel()));
  for (auto& x : v) {
    const double mag = lo + (hi - lo) * gen.next_uniform();
    x = gen.next_uniform() < 0.5 ? -mag : mag;
  }
  return mt::from_vector(v, shape, mt::kFloat64);
}

// Pairwise distinct values (gaps >= 0.05), shuffled: no ties for max / min / pooling.
inline mt::Tensor distinct64(const mt::Shape& shape, std::uint64_t seed) {
  mt::Generator gen(seed);
  const auto n = static_cast<std::size_t>(shape.numel());
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] =
        (static_cast<double>(i) - static_cast<double>(n) / 2.0) * 0.1 + 0.03 * gen.next_uniform();
  for (std::size_t i = n; i > 1; --i) std::swap(v[i - 1], v[gen.next_u64() % i]);
  return mt::from_vector(v, shape, mt::kFloat64);
}

// Values on a grid k * 0.2 + offset (+-0.03): two such tensors with offsets 0 and 0.1
// never come closer than 0.04, so maximum / minimum have no ties.
inline mt::Tensor grid64(const mt::Shape& shape, double offset, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<double> v(static_cast<std::size_t>(shape.numel()));
  for (auto& x : v) {
    const auto k = static_cast<double>(static_cast<std::int64_t>(gen.next_u64() % 11) - 5);
    x = k * 0.2 + offset + 0.06 * (gen.next_uniform() - 0.5);
  }
  return mt::from_vector(v, shape, mt::kFloat64);
}

}  // namespace mtest

// Run gradcheck / gradgradcheck and record one Catch check; on failure the message names
// the op, the input, the worst element and both gradients.
#define CHECK_GRADGRADCHECK(name, ...)                                                           \
  do {                                                                                           \
    const ::mtest::GradCheckResult mtest_gc_result_ = ::mtest::gradgradcheck(name, __VA_ARGS__); \
    INFO(mtest_gc_result_.report);                                                               \
    CHECK(mtest_gc_result_.ok);                                                                  \
  } while (0)
#define CHECK_GRADCHECK(name, ...)                                                           \
  do {                                                                                       \
    const ::mtest::GradCheckResult mtest_gc_result_ = ::mtest::gradcheck(name, __VA_ARGS__); \
    INFO(mtest_gc_result_.report);                                                           \
    CHECK(mtest_gc_result_.ok);                                                              \
  } while (0)
