// The FP8 path (mixed_float8) on a GPU against the CPU's emulation: quantize_float8 bit for bit
// (current and delayed scaling: the amax, the scale, the FP8 values, the rolled histories);
// float8_linear's forward (cuBLASLt's FP8 GEMM with fast accumulation, which the conformance
// sweep does not run) and backward (accurate accumulation) within the FP8 tensor cores'
// accumulation bounds, element by element, from the same FP8 values; a Dense model trained
// under mixed_float8 on the GPU.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using ctest_util::check_bits;
using ctest_util::kGpu;

namespace {

mt::Tensor f64(const mt::Tensor& t) { return mt::cast(t.to(mt::Device::cpu()), mt::kFloat64); }

// The sum of the products' magnitudes of each output element of scale_a * scale_b * a b_t^T
// (a [m, k], b_t [n, k], FP8, on the CPU): what an accumulation error is relative to.
std::vector<double> terms(const mt::Float8Quantized& a, const mt::Tensor& b_t_data,
                          const mt::Tensor& b_t_scale) {
  const double s = a.scale.item<float>() * static_cast<double>(b_t_scale.item<float>());
  return (mt::matmul(mt::abs(f64(a.data)), mt::transpose(mt::abs(f64(b_t_data)))) * s)
      .to_vector<double>();
}

// |got - want| <= accumulation * terms + rounding * |want| for every element (got on the GPU,
// want from the CPU's emulation; `rounding`: one unit of the output dtype's last place, as a
// fraction, since a small difference in the sum can move the rounding by one unit). Returns the
// largest |got - want| / terms seen, for the record.
double check_product(const mt::Tensor& got, const mt::Tensor& want,
                     const std::vector<double>& terms, double accumulation, double rounding,
                     const std::string& what) {
  INFO(what);
  REQUIRE(got.shape() == want.shape());
  REQUIRE(got.dtype() == want.dtype());
  const auto g = got.to_vector<double>(), w = want.to_vector<double>();
  REQUIRE(g.size() == terms.size());
  std::size_t bad = 0, first_bad = 0;
  double worst = 0.0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    const double e = std::abs(g[i] - w[i]);
    if (!(e <= accumulation * terms[i] + rounding * std::abs(w[i]))) {
      if (bad++ == 0) first_bad = i;
    }
    if (terms[i] > 0) worst = std::max(worst, e / terms[i]);
  }
  INFO(fmt::format("{} of {} elements beyond the bound; the first at {}: got {}, want {}, terms {}",
                   bad, g.size(), first_bad, g.empty() ? 0.0 : g[first_bad],
                   w.empty() ? 0.0 : w[first_bad], terms.empty() ? 0.0 : terms[first_bad]));
  CHECK(bad == 0);
  return worst;
}

void check_quantized(const mt::Float8Quantized& gpu, const mt::Float8Quantized& cpu,
                     const std::string& what) {
  CHECK(gpu.data.device() == kGpu);
  check_bits(gpu.data, cpu.data, what + ": FP8 values");
  check_bits(gpu.scale, cpu.scale, what + ": scale");
  check_bits(gpu.amax, cpu.amax, what + ": amax");
}

// FP8 tensor cores add products in an accumulator narrower than float32 (about 14 bits on
// Hopper; the conformance sweep's bound): 2^-13 of the terms with accurate accumulation
// (cuBLASLt promotes to float32 periodically); with fast accumulation it never promotes, so
// allow that narrow accumulator's error at each of the k / 32 steps of the instruction, twice
// over (DeepSeek-V3's report measured nearly 2% at k = 4096 on Hopper without promotion).
constexpr double kAccurate = 0x1p-13;
double fast_accumulation_bound(std::int64_t k) {
  return static_cast<double>((k + 31) / 32 + 1) * 0x1p-11;
}
// Whether this GPU has FP8 tensor cores (compute capability 8.9 or newer); says so when not.
bool fp8_gemms() {
  const mt::DeviceProperties p = mt::cuda::properties(0);
  const bool yes = p.compute_major > 8 || (p.compute_major == 8 && p.compute_minor >= 9);
  if (!yes) WARN("compute capability below 8.9: no FP8 GEMMs on this GPU, not checked");
  return yes;
}

// One unit in the last place of a value v, at most this fraction of |v|.
constexpr double kBFloat16Unit = 0x1p-7, kFloat32Unit = 0x1p-23;

struct Result {
  mt::Tensor y, dx, dw;
};

// y = float8_linear(x, w) and its gradients for dy, on x's device.
Result linear_step(const mt::Tensor& x, const mt::Variable& w, const mt::Tensor& dy,
                   const mt::Float8History* history = nullptr) {
  mt::GradientTape tape;
  tape.watch(x);
  const mt::Tensor y = mt::float8_linear(x, w, mt::kBFloat16, history);
  const std::vector<mt::Tensor> g = tape.gradient(y, std::vector<mt::Tensor>{x, w}, dy);
  return {y, g[0], g[1]};
}

}  // namespace

TEST_CASE("cuda float8: quantize_float8 and float8_linear against the CPU's emulation",
          "[cuda][float8]") {
  if (!fp8_gemms()) return;
  const std::int64_t m = 64, k = 96, n = 48;
  mt::manual_seed(11);
  const mt::Tensor x = mt::cast(mt::normal({m, k}), mt::kBFloat16);
  const mt::Tensor w0 = mt::normal({k, n}) * 0.2;
  const mt::Tensor dy = mt::cast(mt::normal({m, n}) * 1e-2, mt::kBFloat16);
  mt::Variable w_cpu(w0, "w"), w_gpu(w0.to(kGpu), "w");
  const Result cpu = linear_step(x, w_cpu, dy);
  const Result gpu = linear_step(x.to(kGpu), w_gpu, dy.to(kGpu));
  CHECK(gpu.y.device() == kGpu);

  // The FP8 operands: the same bits on both devices.
  const mt::Float8Quantized qx = mt::quantize_float8(x, mt::kFloat8E4M3FN);
  const mt::Float8Quantized qwt = mt::quantize_float8(mt::transpose(w0), mt::kFloat8E4M3FN);
  const mt::Float8Quantized qg = mt::quantize_float8(dy, mt::kFloat8E5M2);
  check_quantized(mt::quantize_float8(x.to(kGpu), mt::kFloat8E4M3FN), qx, "x");
  check_quantized(mt::quantize_float8(mt::transpose(w0.to(kGpu)), mt::kFloat8E4M3FN), qwt, "w^T");
  check_quantized(mt::quantize_float8(dy.to(kGpu), mt::kFloat8E5M2), qg, "dy");

  // The products from them: y with fast accumulation, the gradients without.
  const double fast = check_product(gpu.y, cpu.y, terms(qx, qwt.data, qwt.scale),
                                    fast_accumulation_bound(k), kBFloat16Unit, "y = x w");
  const mt::Tensor qw = mt::transpose(qwt.data).contiguous();  // [k, n]
  const double accurate_dx =
      check_product(gpu.dx, cpu.dx, terms(qg, qw, qwt.scale), kAccurate, kBFloat16Unit, "dx");
  const mt::Float8Quantized qxt{mt::transpose(qx.data).contiguous(), qx.scale, qx.amax};
  const double accurate_dw =
      check_product(gpu.dw, cpu.dw, terms(qxt, mt::transpose(qg.data).contiguous(), qg.scale),
                    kAccurate, kFloat32Unit, "dw");
  WARN(fmt::format(
      "FP8 GEMMs against the CPU's float32 sums, largest |error| / terms: forward (fast "
      "accumulation, k = {}) {:.3g} (bound {:.3g}); dx {:.3g}, dw {:.3g} (bound {:.3g})",
      k, fast, fast_accumulation_bound(k), accurate_dx, accurate_dw, kAccurate));
}

TEST_CASE("cuda float8: delayed scaling's histories roll on the GPU as on the CPU",
          "[cuda][float8]") {
  if (!fp8_gemms()) return;
  const std::int64_t m = 32, k = 64, n = 32;
  mt::manual_seed(12);
  const mt::Tensor w0 = mt::normal({k, n}) * 0.1;
  mt::Variable w_cpu(w0, "w"), w_gpu(w0.to(kGpu), "w");
  const mt::Float8History h_cpu{
      .input = mt::zeros({4}), .weight = mt::zeros({4}), .grad = mt::zeros({4})};
  const mt::Float8History h_gpu{.input = mt::zeros({4}, mt::kFloat32, kGpu),
                                .weight = mt::zeros({4}, mt::kFloat32, kGpu),
                                .grad = mt::zeros({4}, mt::kFloat32, kGpu)};
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    // Amaxes that change from step to step: the histories' largest is not this step's.
    const mt::Tensor x = mt::cast(mt::normal({m, k}) * (step == 1 ? 3.0 : 1.0), mt::kBFloat16);
    const mt::Tensor dy = mt::cast(mt::normal({m, n}) * 1e-2, mt::kBFloat16);
    const Result cpu = linear_step(x, w_cpu, dy, &h_cpu);
    const Result gpu = linear_step(x.to(kGpu), w_gpu, dy.to(kGpu), &h_gpu);
    check_bits(h_gpu.input, h_cpu.input, "input amax history");
    check_bits(h_gpu.weight, h_cpu.weight, "weight amax history");
    check_bits(h_gpu.grad, h_cpu.grad, "gradient amax history");
    // The outputs within 5% of their largest magnitude (a wrong scale or layout is far off;
    // the first test case bounds the products element by element).
    ctest_util::check_close(gpu.y, cpu.y, 0.05, "y");
    ctest_util::check_close(gpu.dx, cpu.dx, 0.05, "dx");
    ctest_util::check_close(gpu.dw, cpu.dw, 0.05, "dw");
  }
}

TEST_CASE("cuda float8: a Dense model trains under mixed_float8 on the GPU", "[cuda][float8]") {
  if (!fp8_gemms()) return;
  // Four separable blobs in 16 dimensions.
  mt::manual_seed(5);
  const std::int64_t count = 1024;
  const mt::Tensor centers = mt::normal({4, 16}) * 3.0;
  std::vector<std::int64_t> labels(static_cast<std::size_t>(count));
  for (std::int64_t i = 0; i < count; ++i) labels[static_cast<std::size_t>(i)] = i % 4;
  const mt::Tensor y = mt::from_vector(labels, {count});
  const mt::Tensor x = mt::take(centers, y, 0) + mt::normal({count, 16});

  mt::PolicyScope scope("mixed_float8");
  namespace ml = mt::layers;
  mt::Sequential model({ml::Dense(64, {.activation = "relu"}),
                        ml::Dense(64, {.activation = "relu"}), ml::Dense(4, {.dtype = "float32"})});
  model.build_for({-1, 16});
  model.to(kGpu);
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mt::optim::Adam({.learning_rate = 3e-3}),
                 .metrics = {"accuracy"}});
  const mt::History h = model.fit(x, y, {.batch_size = 64, .epochs = 4, .seed = 2, .verbose = 0});
  CHECK(model.trainable_variables()[0].device() == kGpu);
  CHECK(h.history.at("loss").back() < 0.5 * h.history.at("loss").front());
  CHECK(model.evaluate(x, y, {.batch_size = 256}).at("accuracy") > 0.95);
  const mt::DTypeTrace trace = mt::trace_dtypes(model, x.slice(0, 0, 16).to(kGpu));
  REQUIRE(trace.rows.size() == 3);
  CHECK(trace.rows[0].note == "float8 matmul (e4m3, gradients e5m2; bias, relu fused)");
  CHECK(trace.rows[1].note == "float8 matmul (e4m3, gradients e5m2; bias, relu fused)");
}

TEST_CASE("cuda float8: scaled_matmul refuses what FP8 GEMMs do not take, naming the shapes",
          "[cuda][float8]") {
  if (!fp8_gemms()) return;
  // cuBLASLt's FP8 kernels need every matrix's rows 16-byte aligned: k a multiple of 16 for
  // the FP8 operands, and here n * 2 bytes for the bfloat16 output. The CPU's emulation
  // computes any shape; the GPU raises a DeviceError that says what to change.
  mt::manual_seed(3);
  const auto fp8 = [](std::int64_t rows, std::int64_t cols) {
    return mt::quantize_float8(mt::normal({rows, cols}).to(kGpu), mt::kFloat8E4M3FN);
  };
  const std::int64_t m = 8;
  for (const auto& [n, k] : {std::pair<std::int64_t, std::int64_t>{16, 24}, {20, 32}}) {
    INFO(fmt::format("n {}, k {}", n, k));
    const mt::Float8Quantized a = fp8(m, k), b_t = fp8(n, k);
    try {
      (void)mt::scaled_matmul(a.data, b_t.data, a.scale, b_t.scale);
      FAIL("no error");
    } catch (const mt::DeviceError& e) {
      const std::string what = e.what();
      INFO(what);
      CHECK(what.find("scaled_matmul") != std::string::npos);
      CHECK(what.find(fmt::format("[{}, {}]", m, k)) != std::string::npos);
      CHECK(what.find(fmt::format("[{}, {}]", n, k)) != std::string::npos);
      CHECK(what.find("multiples of 16") != std::string::npos);
    }
  }
  // The same operands at k = 32 and n = 16: a product.
  const mt::Float8Quantized a = fp8(m, 32), b_t = fp8(16, 32);
  const mt::Tensor out = mt::scaled_matmul(a.data, b_t.data, a.scale, b_t.scale);
  CHECK(out.shape() == mt::Shape{m, 16});
}
