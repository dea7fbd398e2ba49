// A Dense layer's training step (forward and backward under a tape) on the fused linear op
// (fused:1) and on the composed matmul, bias add and activation (fused:0) run just before it,
// at mixtape-charlm's shapes (2048 tokens of width 128). Compare each fused:1 row with the
// fused:0 row above it.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/autograd/variable.h"
#include "mixtape/core/tensor.h"

namespace {

using namespace mixtape;

const char* activation_name(std::int64_t i) {
  switch (i) {
    case 1:
      return "relu";
    case 2:
      return "gelu";
    case 3:
      return "gelu_tanh";
    default:
      return "linear";
  }
}

// args: m, k, n, activation (0 linear, 1 relu, 2 gelu, 3 gelu_tanh), dtype (0 float32,
// 2 bfloat16: the operands; the bias float32 as a mixed policy keeps it), fused.
void BM_DenseStep(benchmark::State& state) {
  const std::int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  const std::string act = activation_name(state.range(3));
  const DType dt = state.range(4) == 2 ? kBFloat16 : kFloat32;
  const bool fused = state.range(5) != 0;
  Variable x(uniform({m, k}, -1.0, 1.0, dt), "x"), w(uniform({k, n}, -0.1, 0.1, dt), "w"),
      b(uniform({n}, -1.0, 1.0, kFloat32), "b");
  const Tensor g = uniform({m, n}, -1.0, 1.0, dt);
  const std::vector<Variable> vars{x, w, b};
  auto step = [&] {
    GradientTape tape;
    Tensor y;
    if (fused) {
      y = linear(x, w, b, act);
    } else {
      y = matmul(x, w) + cast(b, dt);
      if (act == "relu") y = relu(y);
      if (act == "gelu") y = gelu(y);
      if (act == "gelu_tanh") y = gelu_tanh(y);
    }
    return tape.gradient(sum(cast(y * g, kFloat32)), vars);
  };
  (void)step();  // warm-up: primitives, scratch buffers
  for (auto _ : state) benchmark::DoNotOptimize(step());
}

void DenseStepArgs(benchmark::internal::Benchmark* bm) {
  // mixtape-charlm's MLP (128 -> 512 gelu, 512 -> 128) and its attention projection (128 ->
  // 384), then a ReLU layer of the MNIST MLP at batch 128.
  const std::int64_t shapes[][4] = {
      {2048, 128, 512, 2}, {2048, 512, 128, 0}, {2048, 128, 384, 0}, {128, 784, 512, 1}};
  for (const auto& s : shapes)
    for (const std::int64_t dt : {0, 2})
      for (std::int64_t fused = 0; fused < 2; ++fused)
        bm->Args({s[0], s[1], s[2], s[3], dt, fused});
}
BENCHMARK(BM_DenseStep)
    ->Apply(DenseStepArgs)
    ->ArgNames({"M", "K", "N", "act", "dtype", "fused"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
