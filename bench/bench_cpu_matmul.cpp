// CPU matmul, conv2d and pooling kernel throughput (GFLOP/s), called through the dispatch
// table. Compare the float16 / bfloat16 matmul rows against float32 at the same size, and
// the oneDNN rows (onednn:1) against the backend's own kernels (onednn:0) run just before.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <string>

#include "backends/cpu/cpu_backend.h"
#include "mixtape/autograd/ops.h"
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
  const auto fn = find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt);
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

// A batch of small products, as attention makes them: args batch, m, k, n, dtype index,
// path (0: the kernel on the whole batch, one oneDNN call for float32; 1: one kernel call
// per batch item, what the kernel did before). The two paths of a shape run back to back.
void BM_CpuBatchedMatmul(benchmark::State& state) {
  const std::int64_t batch = state.range(0), m = state.range(1), k = state.range(2),
                     n = state.range(3);
  const DType dt = dtype_from_index(state.range(4));
  const bool per_item = state.range(5) == 1;
  const Tensor a = uniform({batch, m, k}, -1.0, 1.0, dt), b = uniform({batch, k, n}, -1.0, 1.0, dt);
  const Tensor out = Tensor::empty({batch, m, n}, dt);
  const auto fn = find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt);
  auto run = [&] {
    kernels::GemmArgs g;
    g.m = m, g.n = n, g.k = k, g.lda = k, g.ldb = n, g.ldc = n;
    if (!per_item) {
      g.a = a, g.b = b, g.out = out;
      g.batch = batch, g.stride_a = m * k, g.stride_b = k * n, g.stride_c = m * n;
      fn(g);
      return;
    }
    for (std::int64_t i = 0; i < batch; ++i) {
      g.a = a.slice(0, i, i + 1), g.b = b.slice(0, i, i + 1), g.out = out.slice(0, i, i + 1);
      fn(g);
    }
  };
  run();
  for (auto _ : state) {
    run();
    benchmark::DoNotOptimize(out.data_ptr());
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(dt.name()) + (per_item ? " per item" : " batched"));
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(batch * m * k * n) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}
// The charlm's attention products at its defaults (batch 32 x 4 heads, 64 positions, 32
// per head): scores [64 x 32] x [32 x 64], weights times values [64 x 64] x [64 x 32]; each
// dtype's two paths back to back.
void BatchedArgs(benchmark::internal::Benchmark* b) {
  const std::int64_t mkn[2][3] = {{64, 32, 64}, {64, 64, 32}};
  for (const auto& s : mkn)
    for (std::int64_t dt = 0; dt < 2; ++dt)
      for (std::int64_t path = 0; path < 2; ++path) b->Args({128, s[0], s[1], s[2], dt, path});
}
BENCHMARK(BM_CpuBatchedMatmul)->Apply(BatchedArgs)->Unit(benchmark::kMicrosecond);

// The dtypes of one size run back to back, so their ratio sees the same machine state. The
// last four are mixtape-charlm's products at its defaults (2048 tokens of width 128: query /
// key / value, the attention's output projection, the MLP's up and down projections), whose
// bfloat16 times give its step's GEMM floor (docs/charlm.md).
void MatmulArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t size : {0, 1, 2, 3, 4, 5, 6}) {
    const std::int64_t mkn[7][3] = {{128, 784, 512},  {128, 512, 512},  {2048, 2048, 2048},
                                    {2048, 128, 384}, {2048, 128, 128}, {2048, 128, 512},
                                    {2048, 512, 128}};
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
  const auto fn = find_kernel<kernels::Conv2dFn>(OpId::conv2d, DeviceType::CPU, dt);
  fn(x, w, Tensor(), out, g);  // warm-up
  for (auto _ : state) {
    fn(x, w, Tensor(), out, g);
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
  const auto bwd_x =
      find_kernel<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, DeviceType::CPU, dt);
  const auto bwd_w = find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight,
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
  for (std::int64_t dt = 0; dt < 3; ++dt) b->Args({28, 1, 32, dt});
  for (std::int64_t dt = 0; dt < 3; ++dt) b->Args({14, 32, 64, dt});
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

// --- oneDNN against conv.cpp's kernels -------------------------------------------------

// The MNIST CNN's layers at batch 128 (3x3 filters, valid padding, as apps/mnist builds
// them): 0: conv1 28x28, 1 -> 32; 1: conv2 13x13, 32 -> 64. 2 and 3 are the same-padded
// layers of BM_CpuConv2dForward (28x28, 1 -> 32; 14x14, 32 -> 64).
kernels::Conv2dGeometry cnn_layer(std::int64_t layer) {
  if (layer >= 2)
    return mnist_layer(layer == 2 ? 28 : 14, layer == 2 ? 1 : 32, layer == 2 ? 32 : 64);
  kernels::Conv2dGeometry g =
      mnist_layer(layer == 0 ? 28 : 13, layer == 0 ? 1 : 32, layer == 0 ? 32 : 64);
  g.oh = g.h - 2, g.ow = g.w - 2;
  g.pad_top = g.pad_left = 0;
  return g;
}

// args: layer (cnn_layer), pass (0 forward, 1 backward input, 2 backward weight), dtype
// index, onednn (0: conv.cpp's kernels, 1: oneDNN where the backend uses it).
void BM_CpuConv2dPath(benchmark::State& state) {
  const kernels::Conv2dGeometry g = cnn_layer(state.range(0));
  const std::int64_t pass = state.range(1);
  const DType dt = dtype_from_index(state.range(2));
  const cpu::OneDnnScope scope(state.range(3) != 0);
  const Tensor x = uniform({g.n, g.h, g.w, g.c}, -1.0, 1.0, dt);
  const Tensor w = uniform({g.kh, g.kw, g.c, g.cout}, -1.0, 1.0, dt);
  const Tensor y = uniform({g.n, g.oh, g.ow, g.cout}, -1.0, 1.0, dt);
  const Tensor gx = Tensor::empty({g.n, g.h, g.w, g.c}, dt);
  const Tensor gw = Tensor::empty({g.kh, g.kw, g.c, g.cout}, dt);
  const auto cpu = DeviceType::CPU;
  auto run = [&] {
    if (pass == 0)
      find_kernel<kernels::Conv2dFn>(OpId::conv2d, cpu, dt)(x, w, Tensor(), y, g);
    else if (pass == 1)
      find_kernel<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, cpu, dt)(y, w, gx,
                                                                                        g);
    else
      find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight, cpu, dt)(x, y, gw,
                                                                                          g);
  };
  run();  // warm-up: primitive creation, scratch buffers
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  set_conv_flops(state, g, dt, 1.0);
}

void ConvPathArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t layer = 0; layer < 4; ++layer)
    for (std::int64_t pass = 0; pass < 3; ++pass)
      for (std::int64_t dt : {0, 2})
        for (std::int64_t on = 0; on < 2; ++on) b->Args({layer, pass, dt, on});
}
BENCHMARK(BM_CpuConv2dPath)
    ->Apply(ConvPathArgs)
    ->ArgNames({"layer", "pass", "dtype", "onednn"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// One matmul kernel call of dtype dt on oneDNN off (onednn:0) and on (onednn:1). args: m,
// k, n, trans_a (A stored [k, m]: the weight gradient of a Dense layer), onednn.
void matmul_path(benchmark::State& state, DType dt) {
  const std::int64_t m = state.range(0), k = state.range(1), n = state.range(2);
  const bool ta = state.range(3) != 0;
  const cpu::OneDnnScope scope(state.range(4) != 0);
  kernels::GemmArgs g;
  g.a = ta ? uniform({k, m}, -1.0, 1.0, dt) : uniform({m, k}, -1.0, 1.0, dt);
  g.b = uniform({k, n}, -1.0, 1.0, dt);
  g.out = Tensor::empty({m, n}, dt);
  g.m = m, g.n = n, g.k = k, g.trans_a = ta;
  g.lda = ta ? m : k, g.ldb = n, g.ldc = n;
  const auto fn = find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt);
  fn(g);  // warm-up: primitive creation, scratch buffers
  for (auto _ : state) {
    fn(g);
    benchmark::ClobberMemory();
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      2.0 * static_cast<double>(m * k * n) * static_cast<double>(state.iterations()) * 1e-9,
      benchmark::Counter::kIsRate);
}

// bfloat16 matmul on gemm.cpp's bulk conversion + sgemm path (onednn:0) and on oneDNN's
// native bf16 matmul (onednn:1; the same path again on CPUs without AVX512-BF16).
void BM_CpuMatmulBf16Path(benchmark::State& state) { matmul_path(state, kBFloat16); }
// float32 matmul on OpenBLAS's sgemm (onednn:0) and on oneDNN's matmul (onednn:1).
void BM_CpuMatmulF32Path(benchmark::State& state) { matmul_path(state, kFloat32); }

void MatmulPathArgs(benchmark::internal::Benchmark* b) {
  // The MLP's products at batch 128 (forward, input gradient, weight gradient), then a
  // large square one, then mixtape-charlm's (2048 tokens of width 128: the query / key /
  // value projection, the MLP's two products, the MLP's first weight gradient).
  const std::int64_t shapes[][4] = {{128, 784, 512, 0},  {128, 512, 784, 0},  {784, 128, 512, 1},
                                    {128, 512, 512, 0},  {512, 128, 512, 1},  {2048, 2048, 2048, 0},
                                    {2048, 128, 384, 0}, {2048, 128, 512, 0}, {2048, 512, 128, 0},
                                    {128, 2048, 512, 1}};
  for (const auto& s : shapes)
    for (std::int64_t on = 0; on < 2; ++on) b->Args({s[0], s[1], s[2], s[3], on});
}
BENCHMARK(BM_CpuMatmulBf16Path)
    ->Apply(MatmulPathArgs)
    ->ArgNames({"M", "K", "N", "ta", "onednn"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);
BENCHMARK(BM_CpuMatmulF32Path)
    ->Apply(MatmulPathArgs)
    ->ArgNames({"M", "K", "N", "ta", "onednn"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

// The MNIST CNN's pooling layers at batch 128 (2x2, stride 2, valid). args: layer (0: after
// conv1, 26x26x32; 1: after conv2, 11x11x64), op (0 max, 1 max backward, 2 avg, 3 avg
// backward), dtype index, onednn.
void BM_CpuPool2dPath(benchmark::State& state) {
  kernels::Pool2dGeometry g;
  g.n = 128;
  g.h = g.w = state.range(0) == 0 ? 26 : 11;
  g.c = state.range(0) == 0 ? 32 : 64;
  g.kh = g.kw = g.stride_h = g.stride_w = 2;
  g.oh = g.ow = g.h / 2;
  const std::int64_t op = state.range(1);
  const DType dt = dtype_from_index(state.range(2));
  const cpu::OneDnnScope scope(state.range(3) != 0);
  const Tensor x = uniform({g.n, g.h, g.w, g.c}, -1.0, 1.0, dt);
  const Tensor y = uniform({g.n, g.oh, g.ow, g.c}, -1.0, 1.0, dt);
  const Tensor gx = Tensor::empty({g.n, g.h, g.w, g.c}, dt);
  const auto cpu = DeviceType::CPU;
  const OpId id = op == 0   ? OpId::max_pool2d
                  : op == 1 ? OpId::max_pool2d_backward
                  : op == 2 ? OpId::avg_pool2d
                            : OpId::avg_pool2d_backward;
  auto run = [&] {
    if (op % 2 == 0)
      find_kernel<kernels::Pool2dFn>(id, cpu, dt)(x, y, g);
    else
      find_kernel<kernels::Pool2dBackwardFn>(id, cpu, dt)(x, y, gx, g);
  };
  run();
  for (auto _ : state) {
    run();
    benchmark::ClobberMemory();
  }
  state.SetLabel(std::string(dt.name()));
}

void PoolPathArgs(benchmark::internal::Benchmark* b) {
  for (std::int64_t layer = 0; layer < 2; ++layer)
    for (std::int64_t op = 0; op < 4; ++op)
      for (std::int64_t dt : {0, 2, 1})
        for (std::int64_t on = 0; on < 2; ++on) b->Args({layer, op, dt, on});
}
BENCHMARK(BM_CpuPool2dPath)
    ->Apply(PoolPathArgs)
    ->ArgNames({"layer", "op", "dtype", "onednn"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->Repetitions(5)
    ->ReportAggregatesOnly(true);

}  // namespace
