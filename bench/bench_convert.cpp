// Bulk fp16 / bf16 <-> fp32 conversion throughput. The GB/s counter counts bytes read plus
// bytes written (6 per element) per second of wall time (the conversions use OpenMP).
#include <benchmark/benchmark.h>

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "mixtape/core/half.h"

namespace {

using mixtape::bfloat16;
using mixtape::half;

// Values in [-8, 8): typical activations, all finite in both 16-bit formats.
std::vector<float> random_floats(std::size_t n) {
  std::mt19937 rng(42);
  std::uniform_real_distribution<float> dist(-8.0f, 8.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

void set_counters(benchmark::State& state, std::size_t n) {
  const double bytes = static_cast<double>(n) * (sizeof(float) + sizeof(std::uint16_t));
  state.SetBytesProcessed(static_cast<std::int64_t>(bytes) * state.iterations());
  state.counters["GB/s"] = benchmark::Counter(bytes * static_cast<double>(state.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
  state.counters["has_f16c"] = mixtape::has_f16c() ? 1.0 : 0.0;
}

void BM_FloatToHalf(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::vector<float> src = random_floats(n);
  std::vector<half> dst(n);
  for (auto _ : state) {
    mixtape::convert_float_to_half(src.data(), dst.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

void BM_HalfToFloat(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::vector<float> f = random_floats(n);
  std::vector<half> src(n);
  mixtape::convert_float_to_half(f.data(), src.data(), n);
  std::vector<float> dst(n);
  for (auto _ : state) {
    mixtape::convert_half_to_float(src.data(), dst.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

void BM_FloatToBFloat16(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::vector<float> src = random_floats(n);
  std::vector<bfloat16> dst(n);
  for (auto _ : state) {
    mixtape::convert_float_to_bfloat16(src.data(), dst.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

void BM_BFloat16ToFloat(benchmark::State& state) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::vector<float> f = random_floats(n);
  std::vector<bfloat16> src(n);
  mixtape::convert_float_to_bfloat16(f.data(), src.data(), n);
  std::vector<float> dst(n);
  for (auto _ : state) {
    mixtape::convert_bfloat16_to_float(src.data(), dst.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, n);
}

// 1M elements (~6 MB touched, around last-level cache size) and 16M (~96 MB, memory bound).
BENCHMARK(BM_FloatToHalf)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_HalfToFloat)->Arg(1 << 20)->Arg(1 << 24)->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_FloatToBFloat16)
    ->Arg(1 << 20)
    ->Arg(1 << 24)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_BFloat16ToFloat)
    ->Arg(1 << 20)
    ->Arg(1 << 24)
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

}  // namespace
