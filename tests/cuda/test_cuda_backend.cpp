// The CUDA backend itself: device properties, the caching allocator, copies in every
// direction (large ones through the pinned staging buffer in pieces), tensors moved to the
// GPU and back, layers and optimizers on the GPU, and clear errors for bad devices.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using ctest_util::kGpu;

TEST_CASE("cuda backend: devices and properties", "[cuda]") {
  REQUIRE(mt::cuda::available());
  CHECK(mt::cuda::device_count() >= 1);
  const mt::DeviceProperties p = mt::cuda::properties(0);
  CHECK(!p.name.empty());
  CHECK(p.compute_major >= 7);  // the project targets sm_80 / sm_90
  CHECK(p.total_memory > 0);
  CHECK(p.multiprocessors > 0);
  CHECK_THROWS_AS(mt::cuda::properties(mt::cuda::device_count()), mt::DeviceError);
  CHECK_THROWS_AS(mt::zeros({2}, mt::kFloat32, mt::Device::cuda(64)), mt::DeviceError);
  mt::cuda::synchronize(0);
  // A profiler range around some work (no profiler attached: nothing else happens).
  mt::cuda::profiler_start(0);
  const mt::Tensor x = mt::ones({4}, mt::kFloat32, mt::Device::cuda(0)) * 2.0;
  mt::cuda::profiler_stop(0);
  CHECK(x.to(mt::Device::cpu()).to_vector<float>() == std::vector<float>{2, 2, 2, 2});
  CHECK_THROWS_AS(mt::cuda::profiler_start(mt::cuda::device_count()), mt::DeviceError);
}

TEST_CASE("cuda backend: copies host to device and back, every dtype", "[cuda]") {
  for (mt::DType dt : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64, mt::kInt32,
                       mt::kInt64, mt::kUInt8, mt::kBool}) {
    INFO(std::string(dt.name()));
    std::vector<double> v(1000);
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>((i * 37) % 101);
    if (dt == mt::kBool)
      for (auto& x : v) x = x > 50 ? 1 : 0;
    const mt::Tensor host = mt::from_vector(v, {10, 100}, dt);
    const mt::Tensor gpu = host.to(kGpu);
    CHECK(gpu.device() == kGpu);
    CHECK(gpu.dtype() == dt);
    ctest_util::check_equal(gpu.to(mt::Device::cpu()), host, "round trip");
    // Device to device (a copy on the same GPU), and a non-contiguous view copied.
    ctest_util::check_equal(gpu.contiguous(), host, "contiguous");
    ctest_util::check_equal(gpu.transpose(0, 1).contiguous().to(mt::Device::cpu()),
                            host.transpose(0, 1).contiguous(), "transposed view");
  }
}

TEST_CASE("cuda backend: large copies go through the staging buffer in pieces", "[cuda]") {
  // 96 MiB of float32: three pieces of the 32 MiB staging buffer.
  const std::int64_t n = std::int64_t{24} << 20;
  const mt::Tensor host = mt::arange(0.0, static_cast<double>(n), 1.0, mt::kFloat32);
  const mt::Tensor back = host.to(kGpu).to(mt::Device::cpu());
  const float* a = host.data<float>();
  const float* b = back.data<float>();
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) bad += a[i] != b[i];
  CHECK(bad == 0);
}

TEST_CASE("cuda backend: the allocator reuses freed blocks", "[cuda][hardware]") {
  const void* first = nullptr;
  {
    const mt::Tensor t = mt::zeros({1 << 20}, mt::kFloat32, kGpu);
    first = t.data_ptr();
  }
  const mt::Tensor again = mt::zeros({1 << 20}, mt::kFloat32, kGpu);
  CHECK(again.data_ptr() == first);  // the same size class comes back from the cache
  CHECK(again.to(mt::Device::cpu()).to_vector<double>() == std::vector<double>(1 << 20, 0.0));
}

TEST_CASE("cuda backend: item, factories and printing of GPU tensors", "[cuda]") {
  const mt::Tensor x = mt::full({2, 3}, 2.5, mt::kFloat16, kGpu);
  CHECK(x.device() == kGpu);
  CHECK(mt::sum(x).item<double>() == 15.0);
  CHECK(mt::ones({3}, mt::kFloat32, kGpu).to_vector<double>() == std::vector<double>(3, 1.0));
  CHECK(fmt::format("{}", x).find("2.5") != std::string::npos);
}

TEST_CASE("cuda backend: a model trains on the GPU like on the CPU", "[cuda]") {
  // The same model, the same data and the same initial weights on both devices.
  for (const char* policy : {"float32", "mixed_float16", "mixed_bfloat16"}) {
    INFO(policy);
    mt::PolicyScope scope(policy);
    auto make = [] {
      return mt::Sequential({mt::layers::Dense(32, {.activation = "relu"}), mt::layers::Dense(4),
                             mt::layers::Activation("softmax", {.dtype = "float32"})});
    };
    mt::Sequential cpu = make(), gpu = make();
    const mt::Tensor x = ctest_util::random({256, 8}, mt::kFloat32, 1);
    std::vector<std::int64_t> labels(256);
    const auto xv = x.to_vector<double>();
    for (std::size_t i = 0; i < labels.size(); ++i) labels[i] = xv[i * 8] > 0 ? 1 : 0;
    const mt::Tensor y = mt::from_vector(labels, {256});
    cpu(x);
    gpu(x);
    gpu.set_weights(cpu.get_weights());
    gpu.to(kGpu);
    for (auto* m : {&cpu, &gpu})
      m->compile({.loss = "sparse_categorical_crossentropy",
                  .optimizer = mt::optim::Adam({.learning_rate = 1e-2}),
                  .metrics = {"accuracy"}});
    const auto hc = cpu.fit(x, y, {.batch_size = 64, .epochs = 3, .shuffle = false, .verbose = 0});
    const auto hg = gpu.fit(x, y, {.batch_size = 64, .epochs = 3, .shuffle = false, .verbose = 0});
    CHECK(hg.last("loss") == Approx(hc.last("loss")).epsilon(0.05));
    CHECK(gpu.trainable_variables()[0].device() == kGpu);
    const auto wc = cpu.get_weights(), wg = gpu.get_weights();
    for (std::size_t i = 0; i < wc.size(); ++i)
      ctest_util::check_close(wg[i].to(mt::Device::cpu()), wc[i],
                              std::string(policy) == "float32" ? 1e-3 : 5e-2, "weights");
  }
}

TEST_CASE("cuda backend: a loss scale optimizer decides its steps on the device", "[cuda]") {
  // The same script of finite and overflowing gradients on the CPU (the flag read before
  // each update) and on the GPU (StepDecision::Auto: decided on the device, read a step
  // later, the scale moved on the device): the same scaled losses, weights, slots, scale and
  // counts.
  auto make = [](mt::optim::StepDecision decision) {
    return mt::optim::LossScaleOptimizer(
        mt::optim::Adam({.learning_rate = mt::optim::schedules::cosine_decay(0.1, 12)}),
        mt::LossScale::dynamic({.initial_scale = 64, .growth_interval = 3}),
        {.decision = decision});
  };
  mt::optim::LossScaleOptimizer on_cpu = make(mt::optim::StepDecision::Host);
  mt::optim::LossScaleOptimizer on_gpu = make(mt::optim::StepDecision::Auto);
  const mt::Tensor w0 = ctest_util::random({300}, mt::kFloat32, 7);
  mt::Variable wc(w0.to(mt::Device::cpu()), "w"), wg(w0.to(kGpu), "w");
  const double inf = INFINITY;
  const std::vector<double> poison = {inf, 0, inf, 0, 0, 0, -inf, 0, 0, NAN, 0, 0};
  for (std::size_t s = 0; s < poison.size(); ++s) {
    INFO("step " << s);
    mt::Tensor g = ctest_util::random({300}, mt::kFloat32, 100 + s);
    if (poison[s] != 0) {
      auto v = g.to_vector<double>();
      v[17] = poison[s];
      g = mt::from_vector(v, {300}, mt::kFloat32, mt::Device::cpu());
    }
    // The loss scaled by the GPU's copy of the scale (moved there by the last step's flag,
    // which the host has not read) as by the CPU's.
    const mt::Tensor loss = ctest_util::random({}, mt::kFloat32, 900 + s);
    const mt::Tensor loss_cpu = on_cpu.get_scaled_loss(loss);
    const mt::Tensor loss_gpu = on_gpu.get_scaled_loss(loss.to(kGpu)).to(mt::Device::cpu());
    CHECK(loss_gpu.item<float>() == loss_cpu.item<float>());
    const double scale = on_cpu.loss_scale();
    const mt::Tensor scaled = g * scale;
    on_cpu.apply_gradients(on_cpu.get_unscaled_gradients({scaled}), {wc});
    // The GPU's step: no accessor between the calls, so its decision stays on the device
    // until the next step's apply_gradients.
    on_gpu.apply_gradients(on_gpu.get_unscaled_gradients({scaled.to(kGpu)}), {wg});
  }
  CHECK(on_gpu.loss_scale() == on_cpu.loss_scale());
  CHECK(on_gpu.skipped_steps() == on_cpu.skipped_steps());
  CHECK(on_gpu.applied_steps() == on_cpu.applied_steps());
  CHECK(on_gpu.iterations() == on_cpu.iterations());
  CHECK(on_gpu.good_steps() == on_cpu.good_steps());
  CHECK(on_cpu.skipped_steps() == 4);
  ctest_util::check_close(wg.to(mt::Device::cpu()), wc, 1e-6, "weights");
  const auto sc = on_cpu.inner_optimizer().slots(wc), sg = on_gpu.inner_optimizer().slots(wg);
  REQUIRE(sc.size() == sg.size());
  for (std::size_t i = 0; i < sc.size(); ++i)
    ctest_util::check_close(sg[i].to(mt::Device::cpu()), sc[i], 1e-6, "slot");
}

TEST_CASE("cuda backend: the kernel census counts the host's blocking reads of GPU values",
          "[cuda]") {
  const mt::Device gpu = mt::Device::cuda(0);
  const mt::Tensor x = mt::ones({4}, mt::kFloat32, gpu) * 3.0;
  const mt::Tensor on_host = mt::ones({4}, mt::kFloat32);
  mt::KernelCensus census;
  CHECK(census.host_reads() == 0);
  (void)mt::sum(x);                  // queued: no read
  (void)on_host.to_vector<float>();  // not a device value
  (void)x.to(gpu);                   // same device: no read
  (void)on_host.to(gpu);             // a copy to the device: no read
  auto pending = mt::backend_for(mt::DeviceType::CUDA).read_back(x.const_data_ptr(), 0, 4);
  float first = 0;
  pending->wait(&first);  // started earlier: not a blocking read here
  CHECK(first == 3.0f);
  CHECK(census.host_reads() == 0);
  CHECK(mt::sum(x).item<double>() == 12.0);
  CHECK(x.to(mt::Device::cpu()).to_vector<float>().size() == 4);
  mt::cuda::synchronize(0);
  CHECK(census.host_reads() == 3);
  CHECK(census.host_reads("copy to the host (to, item, to_vector)") == 2);
  CHECK(census.host_reads("cuda::synchronize") == 1);
  const std::string table = census.table();
  CHECK(table.find(fmt::format("{:<32} {:>8}\n", "host reads of device values", 3)) !=
        std::string::npos);
  CHECK(table.find("cuda::synchronize") != std::string::npos);
}
