// One optimizer update kernel over the MNIST MLP's 669,706 float32 weights held in one
// tensor (the mlp's six variables together): Adam, RMSprop and SGD with momentum, as the
// optimizer calls them each step (slots allocated once, the same gradient every time).
#include <benchmark/benchmark.h>

#include <cstdint>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"

namespace {

namespace mt = mixtape;

// args: optimizer (0 Adam, 1 RMSprop, 2 SGD with momentum 0.9).
void BM_OptimizerUpdate(benchmark::State& state) {
  constexpr std::int64_t kWeights = 669706;
  const std::int64_t which = state.range(0);
  mt::kernels::OptimizerUpdate u;
  u.var = mt::uniform({kWeights}, -0.1, 0.1);
  u.grad = mt::uniform({kWeights}, -1e-3, 1e-3);
  u.slot1 = mt::zeros({kWeights});
  u.slot2 = mt::zeros({kWeights});
  u.lr = 1e-3, u.beta1 = 0.9, u.beta2 = 0.999, u.epsilon = 1e-7;
  const mt::OpId op = which == 0   ? mt::OpId::adam_update
                      : which == 1 ? mt::OpId::rmsprop_update
                                   : mt::OpId::sgd_update;
  if (which == 1) u.beta2 = 0.9, u.momentum = 0.0;
  if (which == 2) u.momentum = 0.9;
  auto* fn = mt::find_kernel<mt::kernels::OptimizerUpdateFn>(op, mt::DeviceType::CPU, mt::kFloat32);
  for (auto _ : state) {
    fn(u);
    ++u.step;
    benchmark::ClobberMemory();
  }
  state.SetLabel(which == 0 ? "adam" : which == 1 ? "rmsprop" : "sgd momentum");
  state.counters["weights/s"] =
      benchmark::Counter(static_cast<double>(kWeights) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_OptimizerUpdate)
    ->DenseRange(0, 2)
    ->ArgNames({"optimizer"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
