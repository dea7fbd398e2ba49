// A user-defined layer: build() creates a weight with add_weight(), call() composes
// existing differentiable ops, and no backward code is needed. Under mixed_float16 the
// weight is stored in float32 and read in float16 inside call().
#include <mixtape/mixtape.h>

#include <cmath>
#include <cstdio>

namespace mt = mixtape;

// y = x * alpha, one learned scale per feature.
class Scale : public mt::layers::Layer {
 public:
  using Layer::Layer;

  void build(const mt::Shape& input_shape) override {
    alpha_ = add_weight("alpha", {input_shape.back()}, mt::init::ones());
  }

  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x * alpha_; }

  const mt::Variable& alpha() const { return alpha_; }

 private:
  mt::Variable alpha_;
};

int main() {
  mt::set_global_policy("mixed_float16");
  auto scale = mt::layers::make_layer<Scale>();
  mt::Sequential model({mt::layers::Dense(8, {.activation = "relu"}), scale,
                        mt::layers::Activation("linear", {.dtype = "float32"})});

  const mt::Tensor x = mt::uniform({16, 4}, -1.0, 1.0);
  const mt::Tensor y = model(x);
  std::printf("%s: alpha %s, output of the layer %s, model output %s\n", scale->name().c_str(),
              std::string(scale->alpha().dtype().name()).c_str(),
              std::string(scale->compute_dtype().name()).c_str(),
              std::string(y.dtype().name()).c_str());

  // Gradients reach alpha in its storage dtype (float32) with no backward code written.
  mt::GradientTape tape;
  const mt::Tensor loss = mt::mean(mt::square(model(x)));
  const mt::Tensor grad = tape.gradient(loss, scale->alpha());
  std::printf("d loss / d alpha: %s%s\n", std::string(grad.dtype().name()).c_str(),
              grad.shape().str().c_str());

  // The same layer in float64, against a central difference.
  mt::set_global_policy("float64");
  auto s64 = mt::layers::make_layer<Scale>();
  const mt::Tensor x64 = mt::uniform({3, 5}, -1.0, 1.0, mt::kFloat64);
  s64(x64);
  mt::Variable alpha = s64->alpha();
  alpha.assign(mt::uniform({5}, 0.5, 1.5, mt::kFloat64));
  mt::GradientTape tape64;
  const mt::Tensor g = tape64.gradient(mt::sum(mt::square(s64(x64))), alpha);
  double worst = 0.0;
  const std::vector<double> a = alpha.to_vector<double>();
  for (std::size_t i = 0; i < a.size(); ++i) {
    auto f = [&](double d) {
      std::vector<double> p = a;
      p[i] += d;
      alpha.assign(mt::from_vector(p, {5}, mt::kFloat64));
      return mt::sum(mt::square(s64(x64))).item<double>();
    };
    const double numeric = (f(1e-6) - f(-1e-6)) / 2e-6;
    worst = std::max(worst, std::abs(numeric - g.to_vector<double>()[i]));
  }
  alpha.assign(mt::from_vector(a, {5}, mt::kFloat64));
  std::printf("largest difference from the numeric gradient: %.3g\n", worst);

  const bool ok = scale->alpha().dtype() == mt::kFloat32 && grad.dtype() == mt::kFloat32 &&
                  y.dtype() == mt::kFloat32 && worst < 1e-6;
  return ok ? 0 : 1;
}
