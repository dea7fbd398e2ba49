// CPU matmul and conv2d kernel throughput (GFLOP/s), called through the dispatch table.
// Compare the float16 / bfloat16 matmul rows against float32 at the same size.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

namespace {

using namespace mixtape;

DType dtype_from_index(std::int64_t i) {
  switch (i) {
    case 1:
      return kFloat16;
    case 2:
      return kBFloat16;
    case 3:
      return kFloat64;
    default:
      return kFloat32;
  }
}

// args: m, k, n, dtype index (0 float32, 1 float16, 2 bfloat16).
void BM_CpuMatmul(benchmark::State& state) {
  const std::int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  const DType dt = dtype_from_index(state.range(3));
  kernels::GemmArgs g;
  g.a = uniform({m, k}, -1.0, 1.0, dt);
  g.b = uniform({k, n}, -1.0, 1.0, dt);
  g.out = Tensor::empty({m, n}, dt);
  g.m = m, g.n = n, g.k = k;
  g.lda = k, g.ldb = n, g.ldc = n;
  auto* fn = find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt);
  fn(g);  // warm-up: scratch buffers, BLAS threads
  for (auto _ : state) {
    fn(g);
    benchmark::DoNotOptimize(g.out.data_ptr());
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(dt.name()));
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * k * n) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}

// The dtypes of one size run back to back, so their ratio sees the same machine state.
void MatmulArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t size : {0, 1, 2}) {
    const std::int64_t mkn[3][3] = {{128, 784, 512}, {128, 512, 512}, {2048, 2048, 2048}};
    for (std::int64_t dt = 0; dt < 3; ++dt) b->Args({mkn[size][0], mkn[size][1], mkn[size][2], dt});
  }
}
BENCHMARK(BM_CpuMatmul)
    ->Apply(MatmulArgs)
    ->ArgNames({"M", "K", "N", "dtype"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// The MNIST-like conv layers: batch 128, 3x3 filter, same padding, stride 1.
kernels::Conv2dGeometry mnist_layer(std::int64_t hw, std::int64_t c, std::int64_t cout) {
  kernels::Conv2dGeometry g;
  g.n = 128;
  g.h = g.w = hw;
  g.c = c;
  g.cout = cout;
  g.kh = g.kw = 3;
  g.oh = g.h, g.ow = g.w;
  g.pad_top = g.pad_left = 1;
  return g;
}

// GFLOP/s for `passes` convolution-sized GEMMs per iteration.
void set_conv_flops(benchmark::State& state, const kernels::Conv2dGeometry& g, DType dt,
                    double passes) {
  const double flops =
      passes * 2.0 * static_cast<double>(g.n * g.oh * g.ow * g.cout * g.kh * g.kw * g.c);
  state.SetLabel(std::string(dt.name()));
  state.counters["GFLOP/s"] = benchmark::Counter(
      flops * static_cast<double>(state.iterations()) * 1e-9, benchmark::Counter::kIsRate);
}

// args: h (= w), c, cout, dtype index.
void BM_CpuConv2dForward(benchmark::State& state) {
  const kernels::Conv2dGeometry g = mnist_layer(state.range(0), state.range(1), state.range(2));
  const DType dt = dtype_from_index(state.range(3));
  const Tensor x = uniform({g.n, g.h, g.w, g.c}, -1.0, 1.0, dt);
  const Tensor w = uniform({g.kh, g.kw, g.c, g.cout}, -1.0, 1.0, dt);
  const Tensor out = Tensor::empty({g.n, g.oh, g.ow, g.cout}, dt);
  auto* fn = find_kernel<kernels::Conv2dFn>(OpId::conv2d, DeviceType::CPU, dt);
  fn(x, w, out, g);  // warm-up
  for (auto _ : state) {
    fn(x, w, out, g);
    benchmark::DoNotOptimize(out.data_ptr());
    benchmark::ClobberMemory();
  }
  set_conv_flops(state, g, dt, 1.0);
}

// Backward input then backward weight (one training step's conv gradients).
void BM_CpuConv2dBackward(benchmark::State& state) {
  const kernels::Conv2dGeometry g = mnist_layer(state.range(0), state.range(1), state.range(2));
  const DType dt = dtype_from_index(state.range(3));
  const Tensor x = uniform({g.n, g.h, g.w, g.c}, -1.0, 1.0, dt);
  const Tensor w = uniform({g.kh, g.kw, g.c, g.cout}, -1.0, 1.0, dt);
  const Tensor gout = uniform({g.n, g.oh, g.ow, g.cout}, -1.0, 1.0, dt);
  const Tensor gx = Tensor::empty({g.n, g.h, g.w, g.c}, dt);
  const Tensor gw = Tensor::empty({g.kh, g.kw, g.c, g.cout}, dt);
  auto* bwd_x =
      find_kernel<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, DeviceType::CPU, dt);
  auto* bwd_w = find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight,
                                                             DeviceType::CPU, dt);
  bwd_x(gout, w, gx, g);  // warm-up
  bwd_w(x, gout, gw, g);
  for (auto _ : state) {
    bwd_x(gout, w, gx, g);
    bwd_w(x, gout, gw, g);
    benchmark::DoNotOptimize(gw.data_ptr());
    benchmark::ClobberMemory();
  }
  set_conv_flops(state, g, dt, 2.0);
}

void ConvArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t dt = 0; dt < 2; ++dt) b->Args({28, 1, 32, dt});
  for (std::int64_t dt = 0; dt < 2; ++dt) b->Args({14, 32, 64, dt});
}
BENCHMARK(BM_CpuConv2dForward)
    ->Apply(ConvArgs)
    ->ArgNames({"HW", "C", "Cout", "dtype"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);
BENCHMARK(BM_CpuConv2dBackward)
    ->Apply(ConvArgs)
    ->ArgNames({"HW", "C", "Cout", "dtype"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
