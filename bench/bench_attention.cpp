// The attention softmax of mixtape-charlm's shape: masked_softmax over [64, 4, 64, 64]
// scores (batch 64, 4 heads, 64 positions) with a causal [64, 64] mask, scale 1/sqrt(32),
// forward alone and forward + backward through a GradientTape, in float32 (the dtype the
// mixed policies keep the scores in) and bfloat16. docs/benchmarks.md quotes it.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace {

namespace mt = mixtape;

mt::Tensor causal_mask(std::int64_t t) {
  std::vector<bool> keep(static_cast<std::size_t>(t * t));
  for (std::int64_t i = 0; i < t; ++i)
    for (std::int64_t j = 0; j < t; ++j) keep[static_cast<std::size_t>(i * t + j)] = j <= i;
  return mt::from_vector(keep, mt::Shape{t, t}, mt::kBool);
}

// args: dtype (0 float32, 2 bfloat16), backward (0 forward only, 1 forward and backward).
void BM_MaskedSoftmax(benchmark::State& state) {
  const mt::DType dt = state.range(0) == 2 ? mt::kBFloat16 : mt::kFloat32;
  const bool backward = state.range(1) != 0;
  const mt::Shape shape{64, 4, 64, 64};
  const mt::Tensor x = mt::uniform(shape, -4.0, 4.0, dt);
  const mt::Tensor seed = mt::uniform(shape, -1.0, 1.0, dt);
  const mt::Tensor mask = causal_mask(64);
  const double scale = 0.17677669529663687;  // 1 / sqrt(32)
  for (auto _ : state) {
    if (backward) {
      mt::GradientTape tape;
      tape.watch(x);
      const mt::Tensor y = mt::masked_softmax(x, mask, scale);
      benchmark::DoNotOptimize(tape.gradient(y, x, seed).data_ptr());
    } else {
      benchmark::DoNotOptimize(mt::masked_softmax(x, mask, scale).data_ptr());
    }
  }
  state.SetItemsProcessed(state.iterations() * x.numel());
  state.SetLabel(std::string(dt.name()) + (backward ? " forward+backward" : " forward"));
}
BENCHMARK(BM_MaskedSoftmax)
    ->ArgsProduct({{0, 2}, {0, 1}})
    ->ArgNames({"dtype", "backward"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// Dropout on attention weights [64, 4, 64, 64] at rate 0.1: the dropout op (one kernel, its
// backward the same kernel on the gradient, no mask kept) against the composition the Dropout
// layer ran before it (a float32 uniform tensor from the generator, a comparison, a cast and
// two products). args: dtype (0 float32, 2 bfloat16), form (0 composed, 1 the op), backward.
void BM_Dropout(benchmark::State& state) {
  const mt::DType dt = state.range(0) == 2 ? mt::kBFloat16 : mt::kFloat32;
  const bool op = state.range(1) != 0, backward = state.range(2) != 0;
  const mt::Shape shape{64, 4, 64, 64};
  const double rate = 0.1;
  const mt::Tensor x = mt::uniform(shape, 0.0, 1.0, dt);
  const mt::Tensor seed = mt::uniform(shape, -1.0, 1.0, dt);
  mt::Generator gen(7);
  const auto drop = [&](const mt::Tensor& in) {
    if (op) return mt::dropout(in, rate, gen.next_u64());
    const mt::Tensor u = mt::uniform(shape, 0.0, 1.0, mt::kFloat32, in.device(), &gen);
    const mt::Tensor keep = mt::cast(mt::greater_equal(u, mt::full({}, rate)), in.dtype());
    return in * keep * (1.0 / (1.0 - rate));
  };
  for (auto _ : state) {
    if (backward) {
      mt::GradientTape tape;
      tape.watch(x);
      const mt::Tensor y = drop(x);
      benchmark::DoNotOptimize(tape.gradient(y, x, seed).data_ptr());
    } else {
      benchmark::DoNotOptimize(drop(x).data_ptr());
    }
  }
  state.SetItemsProcessed(state.iterations() * x.numel());
  state.SetLabel(std::string(dt.name()) + (op ? " op" : " composed") +
                 (backward ? " forward+backward" : " forward"));
}
BENCHMARK(BM_Dropout)
    ->ArgsProduct({{0, 2}, {0, 1}, {0, 1}})
    ->ArgNames({"dtype", "op", "backward"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
