// concat of P float32 parts into one [256, 1024] tensor, along axis 0 (each part [256 / P,
// 1024]) and along axis 1 (each part [256, 1024 / P]): the output is the same size for every
// P, so a concat that copies each part once takes about the same time for 2 parts and for
// 32 (docs/benchmarks.md, "concat").
#include <benchmark/benchmark.h>

#include <cstdint>
#include <vector>

#include "mixtape/mixtape.h"

namespace {

namespace mt = mixtape;

// args: parts, axis.
void BM_Concat(benchmark::State& state) {
  const std::int64_t parts = state.range(0);
  const int axis = static_cast<int>(state.range(1));
  std::vector<mt::Tensor> xs;
  for (std::int64_t i = 0; i < parts; ++i)
    xs.push_back(axis == 0 ? mt::uniform({256 / parts, 1024}) : mt::uniform({256, 1024 / parts}));
  for (auto _ : state) {
    mt::Tensor y = mt::concat(xs, axis);
    benchmark::DoNotOptimize(y.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * 256 * 1024 * 4);
}
BENCHMARK(BM_Concat)->ArgsProduct({{2, 8, 32}, {0, 1}})->Unit(benchmark::kMicrosecond);

}  // namespace
