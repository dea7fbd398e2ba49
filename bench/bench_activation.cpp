// The cost of an activation written as a composition of ops against a primitive one:
// forward and backward of y = f(x) through a GradientTape over a [256, 512] batch, for relu,
// gelu and gelu_tanh (primitive ops: one kernel forward, a few ops backward) and for the tanh
// approximation of GELU written from nine ops (each one a pass over the tensor and a new
// tensor, forward, and its backward rule more of them). docs/extending.md quotes the ratio.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "mixtape/mixtape.h"

namespace {

namespace mt = mixtape;

// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))): nine ops.
mt::Tensor gelu_tanh_composite(const mt::Tensor& x) {
  const mt::Tensor cube = x * x * x;
  const mt::Tensor inner = (x + cube * 0.044715) * 0.7978845608028654;
  return x * (mt::tanh(inner) + 1.0) * 0.5;
}

mt::DType dtype_from_index(std::int64_t i) {
  switch (i) {
    case 1:
      return mt::kFloat16;
    case 2:
      return mt::kBFloat16;
    default:
      return mt::kFloat32;
  }
}

// args: activation (0 relu, 1 gelu, 2 the nine-op composite, 3 the gelu_tanh op), dtype index (0
// float32, 1 float16, 2 bfloat16), backward (0 forward only, 1 forward and backward).
void BM_Activation(benchmark::State& state) {
  const std::int64_t which = state.range(0);
  const mt::DType dt = dtype_from_index(state.range(1));
  const bool backward = state.range(2) != 0;
  const mt::Tensor x = mt::uniform({256, 512}, -3.0, 3.0, dt);
  const mt::Tensor seed = mt::uniform({256, 512}, -1.0, 1.0, dt);
  auto f = [&](const mt::Tensor& v) {
    switch (which) {
      case 0:
        return mt::relu(v);
      case 1:
        return mt::gelu(v);
      case 2:
        return gelu_tanh_composite(v);
      default:
        return mt::gelu_tanh(v);
    }
  };
  for (auto _ : state) {
    if (backward) {
      mt::GradientTape tape;
      tape.watch(x);
      const mt::Tensor y = f(x);
      benchmark::DoNotOptimize(tape.gradient(y, x, seed).data_ptr());
    } else {
      benchmark::DoNotOptimize(f(x).data_ptr());
    }
  }
  state.SetItemsProcessed(state.iterations() * x.numel());
  const char* names[] = {"relu", "gelu", "gelu_tanh_9_ops", "gelu_tanh"};
  state.SetLabel(std::string(names[which]) + " " + std::string(dt.name()));
}

void ActivationArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t backward = 0; backward < 2; ++backward)
    for (std::int64_t dt : {0, 2, 1})
      for (std::int64_t which = 0; which < 4; ++which) b->Args({which, dt, backward});
}
BENCHMARK(BM_Activation)
    ->Apply(ActivationArgs)
    ->ArgNames({"act", "dtype", "backward"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
