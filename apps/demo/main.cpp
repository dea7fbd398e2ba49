// mixtape-demo: a short tour of mixtape.
//
//   1. tensors of every floating dtype (float32, float16, bfloat16, float64);
//   2. the float16 range examples of the Keras mixed precision guide;
//   3. y = sum(tanh(x @ w) * 2) recorded on a GradientTape, its gradients checked against
//      a central-difference numeric gradient computed in float64.
//
// Exits 0 when every gradient matches, 1 otherwise.
#include <mixtape/mixtape.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <vector>

namespace mt = mixtape;

namespace {

constexpr std::int64_t kRows = 3;   // x: [kRows, kInner]
constexpr std::int64_t kInner = 4;  // w: [kInner, kCols]
constexpr std::int64_t kCols = 2;

// The function the demo differentiates.
mt::Tensor f(const mt::Tensor& x, const mt::Tensor& w) {
  return mt::sum(mt::tanh(mt::matmul(x, w)) * 2.0);
}

// f evaluated in float64 on host values.
double f64(const std::vector<double>& x, const std::vector<double>& w) {
  return f(mt::from_vector(x, {kRows, kInner}), mt::from_vector(w, {kInner, kCols})).item<double>();
}

// Central differences of f64 with respect to x (wrt_x) or w, in float64.
std::vector<double> numeric_gradient(const std::vector<double>& x, const std::vector<double>& w,
                                     bool wrt_x) {
  const double eps = 1e-6;
  std::vector<double> xs = x;
  std::vector<double> ws = w;
  std::vector<double>& v = wrt_x ? xs : ws;
  std::vector<double> grad(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double saved = v[i];
    v[i] = saved + eps;
    const double plus = f64(xs, ws);
    v[i] = saved - eps;
    const double minus = f64(xs, ws);
    v[i] = saved;
    grad[i] = (plus - minus) / (2 * eps);
  }
  return grad;
}

// max |a - b| / max(1, max |b|).
double scaled_error(const std::vector<double>& a, const std::vector<double>& b) {
  double err = 0.0;
  double scale = 1.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    err = std::max(err, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return err / scale;
}

void show_dtypes() {
  fmt::print("== Floating dtypes ==\n");
  for (mt::DType dtype : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
    mt::Tensor t = mt::full({2, 2}, 1.0 / 3.0, dtype);
    fmt::print("{:<9} itemsize {}  1/3 stored as {:.10f}\n", dtype, dtype.itemsize(),
               t.to_vector<double>()[0]);
  }
  fmt::print("aliases: 'fp16' -> {}, 'bf16' -> {}, 'double' -> {}\n", mt::DType("fp16"),
             mt::DType("bf16"), mt::DType("double"));
  fmt::print("promote_types(float16, bfloat16) = {}\n\n",
             mt::promote_types(mt::kFloat16, mt::kBFloat16));
}

// The guide's examples: float16 overflows past 65504 and underflows below ~6e-8.
bool show_float16_range() {
  fmt::print("== float16 range ==\n");
  bool ok = true;
  for (mt::DType dtype : {mt::kFloat16, mt::kBFloat16, mt::kFloat32}) {
    mt::Tensor big = mt::full({}, 256.0, dtype);
    mt::Tensor tiny = mt::full({}, 1e-5, dtype);
    const float big2 = (big * big).item<float>();
    const float tiny2 = (tiny * tiny).item<float>();
    fmt::print("{:<9} 256 * 256 = {:<8}  1e-5 * 1e-5 = {}\n", dtype, big2, tiny2);
    if (dtype == mt::kFloat16) ok = ok && std::isinf(big2) && tiny2 == 0.0f;
    if (dtype == mt::kFloat32) ok = ok && big2 == 65536.0f && tiny2 > 0.0f;
  }
  const float scalar = mt::half(256.0f) * mt::half(256.0f);
  fmt::print("mt::half scalars: half(256) * half(256) = {}\n\n", scalar);
  ok = ok && std::isinf(scalar);
  if (!ok) fmt::print("MISMATCH: the float16 range examples did not give inf and 0\n");
  return ok;
}

// Records f on a tape in `dtype` (x watched, w a Variable) and compares the gradients
// with the float64 numeric ones at the same (rounded) inputs.
bool check_gradients(mt::DType dtype, double tolerance, bool print_values) {
  mt::Generator gen(42);
  mt::Tensor x = mt::uniform({kRows, kInner}, -1.0, 1.0, dtype, mt::Device::cpu(), &gen);
  mt::Variable w(mt::normal({kInner, kCols}, 0.0, 0.5, dtype, mt::Device::cpu(), &gen), "w");

  mt::Tensor y;
  std::vector<mt::Tensor> grads;
  std::size_t recorded = 0;
  {
    mt::GradientTape tape;  // records while alive
    tape.watch(x);          // x is a plain tensor; the Variable w is watched automatically
    y = f(x, w);
    recorded = tape.size();
    grads = tape.gradient(y, std::vector<mt::Tensor>{x, w});
  }

  // Numeric gradients at the values the dtype actually holds.
  const std::vector<double> xv = x.to_vector<double>();
  const std::vector<double> wv = w.to_vector<double>();
  const double err_x = scaled_error(grads[0].to_vector<double>(), numeric_gradient(xv, wv, true));
  const double err_w = scaled_error(grads[1].to_vector<double>(), numeric_gradient(xv, wv, false));
  const double err = std::max(err_x, err_w);
  const bool ok = grads[0].dtype() == dtype && grads[1].dtype() == dtype && err <= tolerance;

  if (print_values) {
    fmt::print("y = {}\n", y.item<double>());
    fmt::print("dy/dx =\n{}\ndy/dw =\n{}\n", grads[0], grads[1]);
  }
  fmt::print("{:<9} tape ops {}  max error vs float64 numeric {:.3e} (tolerance {:.0e}) {}\n",
             dtype, recorded, err, tolerance, ok ? "ok" : "MISMATCH");
  return ok;
}

}  // namespace

int main() {
  try {
    show_dtypes();
    bool ok = show_float16_range();

    fmt::print("== GradientTape: y = sum(tanh(x @ w) * 2) ==\n");
    ok = check_gradients(mt::kFloat64, 1e-7, /*print_values=*/true) && ok;
    ok = check_gradients(mt::kFloat32, 1e-4, false) && ok;
    ok = check_gradients(mt::kFloat16, 1e-2, false) && ok;
    ok = check_gradients(mt::kBFloat16, 5e-2, false) && ok;

    fmt::print("\n{}\n", ok ? "mixtape-demo: all checks passed" : "mixtape-demo: FAILED");
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixtape-demo: error: %s\n", e.what());
    return 1;
  }
}
