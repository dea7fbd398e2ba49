// A user-defined primitive op: the forward computation and the backward rule in one
// place. record_op() stores the rule on every tape that watches an input; the rule
// composes differentiable ops, so gradients of gradients work too.
#include <mixtape/mixtape.h>

#include <cmath>
#include <cstdio>

namespace mt = mixtape;

// softplus(x) = log(1 + exp(x)), computed stably as max(x, 0) + log(1 + exp(-|x|)).
// Its derivative is sigmoid(x).
mt::Tensor softplus(const mt::Tensor& x) {
  mt::Tensor y;
  {
    mt::NoGradGuard no_grad;  // the forward's own ops are not recorded
    y = mt::relu(x) + mt::log(1.0 + mt::exp(-mt::abs(x)));
  }
  if (mt::should_record({x}))
    mt::record_op("softplus", {x}, y, [x](const mt::Tensor& grad, const std::vector<bool>&) {
      return std::vector<mt::Tensor>{grad * mt::sigmoid(x)};
    });
  return y;
}

int main() {
  const mt::Tensor x = mt::uniform({6}, -4.0, 4.0, mt::kFloat64);

  // First and second derivatives through nested tapes.
  mt::GradientTape outer;
  outer.watch(x);
  mt::Tensor dy;
  {
    mt::GradientTape inner;
    inner.watch(x);
    dy = inner.gradient(mt::sum(softplus(x)), x);  // sigmoid(x)
  }
  const mt::Tensor d2y = outer.gradient(mt::sum(dy), x);  // sigmoid(x) (1 - sigmoid(x))

  double worst = 0.0;
  const std::vector<double> xs = x.to_vector<double>();
  const std::vector<double> g1 = dy.to_vector<double>(), g2 = d2y.to_vector<double>();
  for (std::size_t i = 0; i < xs.size(); ++i) {
    // Central differences of softplus itself, in float64.
    auto f = [](double v) { return std::log1p(std::exp(v)); };
    const double h = 1e-5;
    const double numeric1 = (f(xs[i] + h) - f(xs[i] - h)) / (2 * h);
    const double numeric2 = (f(xs[i] + h) - 2 * f(xs[i]) + f(xs[i] - h)) / (h * h);
    worst = std::max({worst, std::abs(g1[i] - numeric1), std::abs(g2[i] - numeric2) / 100});
  }
  std::printf("softplus: largest difference from numeric first/second derivatives: %.3g\n", worst);
  return worst < 1e-6 ? 0 : 1;
}
