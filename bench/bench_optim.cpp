// One optimizer update kernel over the MNIST MLP's 669,706 float32 weights held in one
// tensor (the mlp's six variables together): Adam, RMSprop and SGD with momentum, as the
// optimizer calls them each step (slots allocated once, the same gradient every time);
// with the bfloat16 copy a mixed policy reads next written in the update's pass
// (OptimizerUpdate::copy), or by a cast of its own after it (what a step did before).
#include <benchmark/benchmark.h>
#include <fmt/format.h>

#include <cstdint>
#include <span>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"

namespace {

namespace mt = mixtape;

// args: optimizer (0 Adam, 1 RMSprop, 2 SGD with momentum 0.9); copy (0 none, 1 a bfloat16
// copy written by the update, 2 the update then a cast to bfloat16).
void BM_OptimizerUpdate(benchmark::State& state) {
  constexpr std::int64_t kWeights = 669706;
  const std::int64_t which = state.range(0), copy = state.range(1);
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
  const auto fn =
      mt::find_kernel<mt::kernels::OptimizerUpdateFn>(op, mt::DeviceType::CPU, mt::kFloat32);
  const auto cast =
      mt::find_kernel<mt::kernels::CastFn>(mt::OpId::cast, mt::DeviceType::CPU, mt::kFloat32);
  const mt::Tensor bf16 = mt::Tensor::empty({kWeights}, mt::kBFloat16);
  if (copy == 1) u.copy = bf16;
  for (auto _ : state) {
    fn(std::span(&u, 1));
    if (copy == 2) cast(u.var, bf16);
    ++u.step;
    benchmark::ClobberMemory();
  }
  state.SetLabel(fmt::format("{}{}",
                             which == 0   ? "adam"
                             : which == 1 ? "rmsprop"
                                          : "sgd momentum",
                             copy == 1   ? ", bfloat16 copy in the update"
                             : copy == 2 ? ", then a cast to bfloat16"
                                         : ""));
  state.counters["weights/s"] =
      benchmark::Counter(static_cast<double>(kWeights) * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
BENCHMARK(BM_OptimizerUpdate)
    ->ArgsProduct({{0, 1, 2}, {0, 1, 2}})
    ->ArgNames({"optimizer", "copy"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
