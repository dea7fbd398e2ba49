// A program outside the mixtape tree: it sees only the installed (or add_subdirectory'd)
// public headers and links mixtape::mixtape. It checks that
//   - tensors of every floating dtype can be made and read back;
//   - a GradientTape records y = sum(sigmoid(x @ w) * 3) + sum(x * x), with w a Variable
//     and x a watched tensor, and its gradients match a float64 numeric gradient.
// Exits 0 when everything matches, 1 otherwise.
#include <mixtape/mixtape.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

namespace mt = mixtape;

namespace {

const mt::Shape kXShape{2, 3};
const mt::Shape kWShape{3, 2};

mt::Tensor f(const mt::Tensor& x, const mt::Tensor& w) {
  return mt::sum(mt::sigmoid(mt::matmul(x, w)) * 3.0) + mt::sum(x * x);
}

double f64(const std::vector<double>& x, const std::vector<double>& w) {
  return f(mt::from_vector(x, kXShape), mt::from_vector(w, kWShape)).item<double>();
}

// Central differences in float64 with respect to x (wrt_x) or w.
std::vector<double> numeric_gradient(std::vector<double> x, std::vector<double> w, bool wrt_x) {
  const double eps = 1e-6;
  std::vector<double>& v = wrt_x ? x : w;
  std::vector<double> grad(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double saved = v[i];
    v[i] = saved + eps;
    const double plus = f64(x, w);
    v[i] = saved - eps;
    const double minus = f64(x, w);
    v[i] = saved;
    grad[i] = (plus - minus) / (2 * eps);
  }
  return grad;
}

double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return INFINITY;
  double err = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) err = std::max(err, std::abs(a[i] - b[i]));
  return err;
}

bool check_dtypes() {
  bool ok = true;
  const std::vector<double> expected = {0, 1, 2, 3, 4, 5};  // exact in every float dtype
  for (mt::DType dtype : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
    mt::Tensor t = mt::arange(0.0, 6.0, 1.0, dtype).reshape({2, 3});
    const bool good =
        t.dtype() == dtype && t.shape() == mt::Shape{2, 3} && t.to_vector<double>() == expected;
    fmt::print("{:<9} {} {}\n", dtype, t.shape(), good ? "ok" : "MISMATCH");
    ok = ok && good;
  }
  return ok;
}

bool check_gradients(mt::DType dtype, double tolerance) {
  mt::Generator gen(7);
  mt::Tensor x = mt::uniform(kXShape, -1.0, 1.0, dtype, mt::Device::cpu(), &gen);
  mt::Variable w(mt::normal(kWShape, 0.0, 1.0, dtype, mt::Device::cpu(), &gen), "w");

  std::vector<mt::Tensor> grads;
  {
    mt::GradientTape tape;
    tape.watch(x);
    mt::Tensor y = f(x, w);
    grads = tape.gradient(y, std::vector<mt::Tensor>{x, w});
  }
  const std::vector<double> xv = x.to_vector<double>();
  const std::vector<double> wv = w.to_vector<double>();
  const double err =
      std::max(max_abs_diff(grads[0].to_vector<double>(), numeric_gradient(xv, wv, true)),
               max_abs_diff(grads[1].to_vector<double>(), numeric_gradient(xv, wv, false)));
  const bool ok = err <= tolerance;
  fmt::print("{} gradients:\ndy/dx =\n{}\ndy/dw =\n{}\n", dtype, grads[0], grads[1]);
  fmt::print("{:<9} max error vs float64 numeric gradient {:.3e} (tolerance {:.0e}) {}\n", dtype,
             err, tolerance, ok ? "ok" : "MISMATCH");
  return ok;
}

}  // namespace

int main() {
  try {
    bool ok = check_dtypes();
    ok = check_gradients(mt::kFloat64, 1e-7) && ok;
    ok = check_gradients(mt::kFloat32, 1e-4) && ok;
    fmt::print("{}\n", ok ? "mixtape-consumer: ok" : "mixtape-consumer: FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixtape-consumer: error: %s\n", e.what());
    return 1;
  }
}
