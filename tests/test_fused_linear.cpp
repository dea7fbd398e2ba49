// linear (ops linear and linear_backward): against the composed computation (matmul, add, the
// activation) in float64 and float32, rounded once in float16 / bfloat16, its gradients (kernel
// and differentiable form), bad input, and Dense on it.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"
#include "tensor_check.h"

namespace mt = mixtape;
using mixtape_test::max_abs_diff;
using mixtape_test::random_normal;
namespace ml = mixtape::layers;

namespace {

const std::vector<std::string> kActivations{"linear", "relu", "gelu", "gelu_tanh"};

mt::Tensor activate(const std::string& name, const mt::Tensor& z) {
  if (name == "relu") return mt::relu(z);
  if (name == "gelu") return mt::gelu(z);
  if (name == "gelu_tanh") return mt::gelu_tanh(z);
  return z;
}

// The composed form, in x's dtype.
mt::Tensor composed(const mt::Tensor& x, const mt::Tensor& w, const mt::Tensor& bias,
                    const std::string& activation) {
  mt::Tensor z = mt::matmul(x, w);
  if (bias.defined()) z = z + mt::cast(bias, z.dtype());
  return activate(activation, z);
}

// A unit in the last place of v in dtype dt (its binade's spacing).
double ulp(double v, mt::DType dt) {
  const int mantissa = dt == mt::kBFloat16 ? 7 : dt == mt::kFloat16 ? 10 : 23;
  const double a = std::max(std::abs(v), dt == mt::kFloat16 ? 6.1e-5 : 1.2e-38);
  return std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - mantissa);
}

}  // namespace

TEST_CASE("linear equals the composed computation in float64, gradients too", "[linear][fused]") {
  for (const auto& [xs, n] :
       {std::pair{mt::Shape{5, 3}, std::int64_t{4}}, std::pair{mt::Shape{2, 3, 7}, std::int64_t{6}},
        std::pair{mt::Shape{70, 9}, std::int64_t{33}}}) {
    const std::int64_t k = xs.dims().back();
    const mt::Tensor x = random_normal(xs, 1, mt::kFloat64, 0.0, 1.5), w = random_normal({k, n}, 2),
                     bias = random_normal({n}, 3);
    std::vector<std::int64_t> gd = xs.dims();
    gd.back() = n;
    const mt::Tensor g = random_normal(mt::Shape(gd), 4);
    for (const std::string& act : kActivations)
      for (const bool with_bias : {false, true}) {
        INFO("x " << xs.str() << ", " << act << (with_bias ? " + bias" : ""));
        const mt::Tensor b = with_bias ? bias : mt::Tensor();
        const mt::Tensor y = mt::linear(x, w, b, act);
        CHECK(y.shape() == mt::Shape(gd));
        CHECK(max_abs_diff(y, composed(x, w, b, act)) < 1e-12);
        const auto grads = [&](bool fused) {
          mt::Variable xv(x, "x"), wv(w, "w"), bv(bias, "bias");
          mt::GradientTape tape;
          const mt::Tensor bt = with_bias ? mt::Tensor(bv) : mt::Tensor();
          const mt::Tensor out = fused ? mt::linear(xv, wv, bt, act) : composed(xv, wv, bt, act);
          return tape.gradient(mt::sum(out * g), std::vector<mt::Variable>{xv, wv, bv});
        };
        const auto f = grads(true), r = grads(false);
        CHECK(max_abs_diff(f[0], r[0]) < 1e-11);
        CHECK(max_abs_diff(f[1], r[1]) < 1e-11);
        if (with_bias) CHECK(max_abs_diff(f[2], r[2]) < 1e-11);
      }
  }
}

TEST_CASE("linear in float32: the composed values (relu and none to the bit)", "[linear][fused]") {
  const mt::Tensor x = random_normal({64, 48}, 5, mt::kFloat32, 0.0, 2.0),
                   w = random_normal({48, 96}, 6, mt::kFloat32, 0.0, 0.2),
                   bias = random_normal({96}, 7, mt::kFloat32);
  for (const std::string& act : kActivations) {
    INFO(act);
    const mt::Tensor y = mt::linear(x, w, bias, act), r = composed(x, w, bias, act);
    CHECK(y.dtype() == mt::kFloat32);
    if (act == "linear" || act == "relu")
      CHECK(max_abs_diff(y, r) == 0.0);
    else  // the same functions; vector forms and FMA contractions may differ in the last bit
      CHECK(max_abs_diff(y, r) < 1e-5);
  }
}

TEST_CASE("linear in float16 and bfloat16: the float64 result, rounded once", "[linear][fused]") {
  for (const mt::DType dt : {mt::kFloat16, mt::kBFloat16}) {
    for (const std::string& act : kActivations) {
      INFO(dt.name() << ", " << act);
      const mt::Tensor x = mt::cast(random_normal({40, 200}, 11, mt::kFloat64), dt);
      const mt::Tensor w = mt::cast(random_normal({200, 24}, 12, mt::kFloat64, 0.0, 0.1), dt);
      const mt::Tensor bias = random_normal({24}, 13, mt::kFloat32);
      const mt::Tensor y = mt::linear(x, w, bias, act);
      CHECK(y.dtype() == dt);
      // (The bias enters as its value in the output's dtype: kernels.h's LinearArgs.)
      const auto ref = composed(mt::cast(x, mt::kFloat64), mt::cast(w, mt::kFloat64),
                                mt::cast(mt::cast(bias, dt), mt::kFloat64), act)
                           .to_vector<double>();
      const auto got = mt::cast(y, mt::kFloat64).to_vector<double>();
      const auto three =
          mt::cast(composed(x, w, mt::cast(bias, dt), act), mt::kFloat64).to_vector<double>();
      // Each result within half a unit in the last place of the exact value (plus float32's
      // accumulation error); the composed ops, rounding three times, are further off.
      double fused_err = 0, composed_err = 0;
      for (std::size_t i = 0; i < ref.size(); ++i) {
        CHECK(std::abs(got[i] - ref[i]) <= 0.5 * ulp(ref[i], dt) + 1e-5);
        fused_err += std::abs(got[i] - ref[i]);
        composed_err += std::abs(three[i] - ref[i]);
      }
      CHECK(fused_err < composed_err);
    }
  }
}

TEST_CASE(
    "linear in float16 and bfloat16: the bias rounded to the output's dtype, then added to the "
    "float32 product, one rounding; its gradient in float32",
    "[linear][fused]") {
  // Products and their sums exact in float32 (small integers times powers of two), biases of
  // 24 significant bits: the result is round(x w + round(bias)) to the bit, and a kernel that
  // added the float32 bias (round(x w + bias)) or rounded twice would differ.
  mt::manual_seed(31);
  std::mt19937 gen(31);
  const auto integers = [&gen](const mt::Shape& shape, double scale) {
    std::uniform_int_distribution<int> draw(-8, 8);
    std::vector<double> v(static_cast<std::size_t>(shape.numel()));
    for (double& e : v) e = draw(gen) * scale;
    return mt::from_vector(v, shape);
  };
  for (const mt::DType dt : {mt::kFloat16, mt::kBFloat16}) {
    INFO(dt.name());
    const mt::Tensor x64 = integers({64, 4}, 1.0), w64 = integers({4, 96}, 0.0625);
    const mt::Tensor bias = mt::uniform({96}, -4.0, 4.0, mt::kFloat32);
    mt::Variable bv(bias, "bias");
    mt::GradientTape tape;
    const mt::Tensor y = mt::linear(mt::cast(x64, dt), mt::cast(w64, dt), mt::Tensor(bv));
    const mt::Tensor product = mt::matmul(x64, w64);  // exact
    const auto want =
        mt::cast(product + mt::cast(mt::cast(bias, dt), mt::kFloat64), dt).to_vector<double>();
    const auto wide = mt::cast(product + mt::cast(bias, mt::kFloat64), dt).to_vector<double>();
    const auto got = mt::cast(y, mt::kFloat64).to_vector<double>();
    CHECK(got == want);
    std::size_t differ = 0;  // the elements where the two rules differ: the test tells them apart
    for (std::size_t i = 0; i < want.size(); ++i) differ += want[i] != wide[i] ? 1 : 0;
    CHECK(differ > want.size() / 20);
    // The bias's gradient: the column sums of dy, in float32 (not rounded to dt).
    const mt::Tensor dy = mt::cast(mt::uniform({64, 96}, -1.0, 1.0, mt::kFloat64), dt);
    const mt::Tensor g = tape.gradient(y, std::vector<mt::Tensor>{mt::Tensor(bv)}, dy)[0];
    CHECK(g.dtype() == mt::kFloat32);
    CHECK(max_abs_diff(g, mt::sum(mt::cast(dy, mt::kFloat64), {0})) < 1e-4);
  }
}

TEST_CASE(
    "linear_backward in float16 and bfloat16 through gelu and gelu_tanh: every 16-bit "
    "pre-activation, against float64 and against gelu's own backward kernel",
    "[linear][fused]") {
  // The 16-bit kernel reads act'(saved) from a table of every 16-bit value (linear.cpp): a
  // [256, 256] saved tensor holding each bit pattern once checks every entry.
  constexpr double kSqrt2 = 1.41421356237309504880, kInvSqrt2Pi = 0.39894228040143267794;
  const auto derivative = [](const std::string& act, double x) {
    if (std::isinf(x)) return x > 0 ? 1.0 : 0.0;
    if (act == "gelu")
      return 0.5 * std::erfc(-x / kSqrt2) + x * std::exp(-0.5 * x * x) * kInvSqrt2Pi;
    constexpr double kC = 0.79788456080286535588, kA = 0.044715;
    const double t = std::tanh(kC * (x + kA * x * x * x));
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kC * (1 + 3 * kA * x * x);
  };
  for (const mt::DType dt : {mt::kFloat16, mt::kBFloat16}) {
    std::vector<std::uint16_t> bits(1 << 16);
    for (std::size_t i = 0; i < bits.size(); ++i) bits[i] = static_cast<std::uint16_t>(i);
    mt::Tensor saved = mt::Tensor::empty({256, 256}, dt);
    std::memcpy(saved.data_ptr(), bits.data(), bits.size() * sizeof(std::uint16_t));
    const mt::Tensor dy = mt::cast(random_normal({256, 256}, 41, mt::kFloat64, 0.0, 2.0), dt);
    const auto x = mt::cast(saved, mt::kFloat64).to_vector<double>();
    const auto g = mt::cast(dy, mt::kFloat64).to_vector<double>();
    for (const std::string& act : {std::string("gelu"), std::string("gelu_tanh")}) {
      INFO(dt.name() << ", " << act);
      mt::kernels::LinearBackwardArgs args;
      args.dy = dy, args.saved = saved;
      args.dz = mt::Tensor::empty({256, 256}, dt);
      args.dbias = mt::Tensor::empty({256}, mt::kFloat32);
      args.activation = act == "gelu" ? mt::kernels::LinearActivation::gelu
                                      : mt::kernels::LinearActivation::gelu_tanh;
      mt::find_kernel<mt::kernels::LinearBackwardFn>(mt::OpId::linear_backward, mt::DeviceType::CPU,
                                                     dt)(args);
      const auto got = mt::cast(args.dz, mt::kFloat64).to_vector<double>();
      std::vector<double> sums(256, 0.0), magnitudes(256, 0.0);
      std::vector<bool> nan_column(256, false);
      std::size_t bad = 0, nans = 0;
      for (std::size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(x[i])) {
          nans += std::isnan(got[i]) ? 1 : 0;
          nan_column[i % 256] = true;
          continue;
        }
        const double want = g[i] * derivative(act, x[i]);
        sums[i % 256] += want;
        magnitudes[i % 256] += std::abs(want);
        // Half a unit in the last place of the 16-bit result, plus float32's error in the
        // factor (terms of magnitude up to about 1.1 in the sum).
        // (float16's subnormal spacing is 2^-24.)
        const double unit = std::max(ulp(want, dt), dt == mt::kFloat16 ? 0x1p-24 : 0.0);
        if (!(std::abs(got[i] - want) <= 0.5 * unit + 1e-6 * std::abs(g[i]))) ++bad;
      }
      CHECK(bad == 0);
      CHECK(nans == (dt == mt::kFloat16 ? 2046u : 254u));  // every NaN pattern gives NaN
      // The bias gradient: the column sums of dz before its rounding (float32 products and
      // sums); NaN in the columns that hold a NaN.
      const auto dbias = args.dbias.to_vector<float>();
      std::size_t off = 0;
      for (std::size_t j = 0; j < 256; ++j)
        off += nan_column[j] ? !std::isnan(dbias[j])
                             : !(std::abs(dbias[j] - sums[j]) <= 1e-5 * magnitudes[j] + 1e-30);
      CHECK(off == 0);
      if (act != "gelu") continue;
      // gelu's own backward kernel (the composed path: the gradient of mt::gelu) computes the
      // same function per element: the same bits.
      mt::Variable xv(saved, "x");
      mt::GradientTape tape;
      const mt::Tensor y = mt::gelu(mt::Tensor(xv));
      const mt::Tensor own = tape.gradient(y, std::vector<mt::Tensor>{mt::Tensor(xv)}, dy)[0];
      const auto a = mt::cast(own, mt::kFloat64).to_vector<double>();
      std::size_t differ = 0;
      for (std::size_t i = 0; i < a.size(); ++i)
        differ += (a[i] == got[i] || (std::isnan(a[i]) && std::isnan(got[i]))) ? 0 : 1;
      CHECK(differ == 0);
    }
  }
}

TEST_CASE("linear: float64 gradients against numeric differences, second derivatives",
          "[linear][fused][grad]") {
  const mt::Tensor x = random_normal({4, 2, 3}, 21, mt::kFloat64, 0.0, 1.5),
                   w = random_normal({3, 5}, 22), bias = random_normal({5}, 23),
                   g = random_normal({4, 2, 5}, 24);
  for (const std::string& act : kActivations) {
    INFO(act);
    CHECK_GRADCHECK(
        "linear " + act,
        [act](const mtest::Inputs& in) { return mt::linear(in[0], in[1], in[2], act); },
        {x, w, bias}, mtest::GradCheckOptions{.atol = 1e-7, .rtol = 1e-6});
    // Second derivatives: the recorded backward pass is made of differentiable ops.
    const auto second = [&](bool fused) {
      mt::Variable a(x, "x"), b(w, "w"), c(bias, "bias");
      mt::GradientTape outer;
      std::vector<mt::Tensor> first;
      {
        mt::GradientTape inner;
        const mt::Tensor y = fused ? mt::linear(a, b, c, act) : composed(a, b, c, act);
        first = inner.gradient(mt::sum(y * g), std::vector<mt::Variable>{a, b, c});
      }
      return outer.gradient(mt::sum(first[0] * first[0]) + mt::sum(first[1] * first[1]) +
                                mt::sum(first[2] * first[2]),
                            std::vector<mt::Variable>{a, b, c});
    };
    const auto f = second(true), r = second(false);
    for (std::size_t i = 0; i < 3; ++i) {
      if (!r[i].defined()) continue;  // linear's second derivative in w, bias: none
      REQUIRE(f[i].defined());
      CHECK(max_abs_diff(f[i], r[i]) < 1e-10);
    }
  }
}

TEST_CASE("linear: empty products and bad input", "[linear][fused]") {
  using mixtape_test::error_of;
  // k = 0: the empty sum plus the bias; m = 0: an empty result.
  const mt::Tensor bias = mt::from_vector<float>({-1.0f, 2.0f}, {2});
  const mt::Tensor y0 = mt::linear(mt::ones({3, 0}), mt::ones({0, 2}), bias, "relu");
  CHECK(y0.to_vector<float>() == std::vector<float>{0, 2, 0, 2, 0, 2});
  CHECK(mt::linear(mt::ones({0, 4}), mt::ones({4, 2}), bias).shape() == mt::Shape{0, 2});

  const mt::Tensor x = random_normal({2, 4}, 31, mt::kFloat32), w = mt::ones({4, 3});
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::linear(x, w, mt::Tensor(), "sigmoid"); }),
             Catch::Contains("linear: unknown activation 'sigmoid'") &&
                 Catch::Contains("linear, relu, gelu or gelu_tanh"));
  CHECK_THAT(
      error_of<mt::ShapeError>([&] {
        mt::linear(x, mt::ones({3, 3}));
      }),
      Catch::Contains("linear: needs x [..., k] and w [k, n]") && Catch::Contains("float32[3, 3]"));
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::linear(x, mt::ones({4})); }),
             Catch::Contains("w [k, n]"));
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::linear(x, w, mt::ones({4})); }),
             Catch::Contains("bias must be floating [3]") && Catch::Contains("float32[4]"));
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::linear(x, w, mt::ones({3}, mt::kInt32)); }),
             Catch::Contains("bias must be floating [3]"));
  CHECK_THAT(error_of<mt::DTypeError>([&] {
               mt::linear(mt::ones({2, 4}, mt::kInt32), mt::ones({4, 3}, mt::kInt32));
             }),
             Catch::Contains("linear: needs floating x and w"));
}

TEST_CASE("Dense runs on the fused op where it can, and says so in the dtype trace",
          "[linear][fused][layers]") {
  const mt::Tensor x = random_normal({8, 12}, 41, mt::kFloat32);
  SECTION("float32: the composed values, the trace's note") {
    mt::manual_seed(4);
    mt::Sequential model({ml::Dense(16, {.activation = "relu"}), ml::Dense(4, {.use_bias = false}),
                          ml::Dense(4, {.activation = "sigmoid"}),
                          ml::Dense(3, {.activation = "gelu", .use_bias = false})});
    const mt::Tensor y = model(x);
    auto* d0 = dynamic_cast<ml::DenseLayer*>(model.layers()[0].get());
    REQUIRE(d0);
    CHECK(max_abs_diff(model.layers()[0]->operator()(x),
                       composed(x, mt::Tensor(d0->kernel()), mt::Tensor(d0->bias()), "relu")) ==
          0.0);
    const mt::DTypeTrace trace = mt::trace_dtypes(model, x);
    REQUIRE(trace.rows.size() == 4);
    CHECK(trace.rows[0].note == "fused linear (bias, relu)");
    CHECK(trace.rows[1].note.empty());  // a plain product: matmul
    CHECK(trace.rows[2].note.empty());  // sigmoid: composed
    CHECK(trace.rows[3].note == "fused linear (gelu)");
    CHECK(y.shape() == mt::Shape{8, 3});
  }
  SECTION("16-bit products accumulating in 16 bits: composed") {
    mt::PolicyScope scope("mixed_bfloat16");
    mt::Fp16UseFp32ComputeScope acc16(false);
    mt::Sequential model({ml::Dense(16, {.activation = "relu"})});
    const mt::DTypeTrace trace = mt::trace_dtypes(model, x);
    CHECK(trace.rows[0].note == "composed (16-bit accumulation: MIXTAPE_FP16_USE_FP32_COMPUTE=0)");
  }
  SECTION("float64: gradients of the weights as the composed layer's") {
    mt::PolicyScope scope("float64");
    mt::manual_seed(5);
    auto dense = ml::Dense(6, {.activation = "gelu_tanh"});
    const mt::Tensor x64 = mt::cast(x, mt::kFloat64);
    dense(x64);
    mt::GradientTape tape;
    const mt::Tensor loss = mt::sum(mt::square(dense(x64)));
    const auto grads = tape.gradient(loss, dense->trainable_variables());
    mt::Variable k(mt::Tensor(dense->kernel()), "k"), b(mt::Tensor(dense->bias()), "b");
    mt::GradientTape tape2;
    const mt::Tensor loss2 = mt::sum(mt::square(composed(x64, k, b, "gelu_tanh")));
    const auto ref = tape2.gradient(loss2, std::vector<mt::Variable>{k, b});
    CHECK(max_abs_diff(grads[0], ref[0]) < 1e-11);
    CHECK(max_abs_diff(grads[1], ref[1]) < 1e-11);
  }
  SECTION("mixed_bfloat16: the bias is read in bfloat16 (autocast), the output is bfloat16") {
    mt::PolicyScope scope("mixed_bfloat16");
    mt::manual_seed(6);
    auto dense = ml::Dense(5, {.activation = "gelu"});
    const mt::Tensor y = dense(x);
    CHECK(y.dtype() == mt::kBFloat16);
    const mt::Tensor ref =
        composed(mt::cast(mt::cast(x, mt::kBFloat16), mt::kFloat64),
                 mt::cast(mt::cast(dense->kernel(), mt::kBFloat16), mt::kFloat64),
                 mt::cast(mt::cast(dense->bias(), mt::kBFloat16), mt::kFloat64), "gelu");
    const auto got = mt::cast(y, mt::kFloat64).to_vector<double>();
    const auto want = ref.to_vector<double>();
    for (std::size_t i = 0; i < got.size(); ++i)
      CHECK(std::abs(got[i] - want[i]) <= 0.5 * ulp(want[i], mt::kBFloat16) + 1e-6);
  }
}

TEST_CASE(
    "Dense under a mixed policy reads its bias's 16-bit value from the copy autocast keeps: no "
    "cast a training step, the gradient float32",
    "[linear][fused]") {
  mt::PolicyScope scope("mixed_bfloat16");
  mt::manual_seed(8);
  auto dense = ml::Dense(24, {.activation = "gelu"});
  const mt::Tensor x = random_normal({16, 12}, 9, mt::kFloat32);
  mixtape::optim::SGD sgd({.learning_rate = 0.05});
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    mt::GradientTape tape;
    mt::Tensor y;
    std::int64_t casts = 0;
    {
      mt::KernelCensus census;
      y = dense(x);
      casts = census.count(mt::OpId::cast);
    }
    // The input's cast to bfloat16 alone once the optimizer has written the kernel's and the
    // bias's copies (the first call makes them).
    if (step > 0) CHECK(casts == 1);
    // The bias enters as its bfloat16 value.
    const mt::Tensor ref =
        composed(mt::cast(mt::cast(x, mt::kBFloat16), mt::kFloat64),
                 mt::cast(mt::cast(dense->kernel(), mt::kBFloat16), mt::kFloat64),
                 mt::cast(mt::cast(dense->bias(), mt::kBFloat16), mt::kFloat64), "gelu");
    const auto got = mt::cast(y, mt::kFloat64).to_vector<double>();
    const auto want = ref.to_vector<double>();
    for (std::size_t i = 0; i < got.size(); ++i)
      CHECK(std::abs(got[i] - want[i]) <= 0.5 * ulp(want[i], mt::kBFloat16) + 1e-6);
    const auto grads =
        tape.gradient(mt::sum(mt::square(mt::cast(y, mt::kFloat32))), dense->trainable_variables());
    REQUIRE(grads.size() == 2);
    // Not rounded to bfloat16 on the way back: some element is not a bfloat16 value.
    REQUIRE(grads[1].dtype() == mt::kFloat32);
    CHECK(max_abs_diff(grads[1], mt::cast(mt::cast(grads[1], mt::kBFloat16), mt::kFloat32)) > 0.0);
    sgd.apply_gradients(grads, dense->trainable_variables());
  }
}
