// The CUDA index and training kernels against the CPU backend:
//  - gather / take bit for bit over geometries with repeated indices, k = 0, inner = 1,
//    rows that move as 16-byte units and rows that do not, > 2^20 elements;
//  - scatter_add / index_add: exactly on integer-valued data (every partial sum exact, so
//    the order of the atomic additions cannot matter), within tolerance on random floats;
//  - the public gather / take ops and their gradients through a GradientTape;
//  - unscale_check: outputs bit for bit (in place, separate, undefined), the flag clear for
//    finite gradients, set by one inf / NaN anywhere (more tensors than one launch takes),
//    never cleared;
//  - sgd / rmsprop / adam updates (every variant) for three steps against the CPU kernels;
//  - the optimizers' finiteness check decided on the device: a NaN step skipped, reported by
//    the next apply_gradients.
#include <fmt/format.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "kernel_cases.h"
#include "mixtape/core/kernels.h"

namespace {

namespace mt = mixtape;
namespace cu = ctest_util;
using mt::DType;
using mt::OpId;
using mt::Shape;
using mt::Tensor;
using std::int64_t;

const std::vector<DType> kIndexTypes = {mt::kFloat32, mt::kFloat16, mt::kBFloat16,
                                        mt::kFloat64, mt::kInt32,   mt::kInt64};

Tensor gpu(const Tensor& t) { return t.to(cu::kGpu); }

template <typename Fn>
Fn* gpu_kernel(OpId op, DType dt) {
  return mt::find_kernel<Fn>(op, mt::DeviceType::CUDA, dt).raw();
}
template <typename Fn>
Fn* cpu_kernel(OpId op, DType dt) {
  return mt::find_kernel<Fn>(op, mt::DeviceType::CPU, dt).raw();
}

// Random values (never all zero): floats in [lo, hi), integers in [lo, hi) floored (in
// [-1000, 1000) when the range is the default).
Tensor random_of(const Shape& shape, DType dt, std::uint64_t seed, double lo = -1.0,
                 double hi = 1.0) {
  if (dt.is_integral() && lo == -1.0 && hi == 1.0) lo = -1000.0, hi = 1000.0;
  for (std::uint64_t attempt = 0;; ++attempt) {
    mt::Generator gen(seed * 1000003 + attempt);
    Tensor t = mt::uniform(shape, lo, hi, dt, mt::Device::cpu(), &gen);
    if (t.numel() == 0) return t;
    const Tensor head = t.reshape({t.numel()}).slice(0, 0, std::min<int64_t>(t.numel(), 64));
    const auto v = head.to_vector<double>();
    if (std::any_of(v.begin(), v.end(), [](double x) { return x != 0.0; })) return t;
    REQUIRE(attempt < 50);
  }
}

// Small integers (-4 ... 4) stored in dt: exact in every dtype, and so are the sums of up to
// a few hundred of them (bfloat16 holds the integers up to 256 exactly).
Tensor small_ints(const Shape& shape, DType dt, std::uint64_t seed) {
  return random_of(shape, mt::kInt32, seed, -4.0, 5.0).to(dt);
}

// int64 indices in [0, n).
Tensor random_index(const Shape& shape, int64_t n, std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::uniform_int_distribution<int64_t> dist(0, n - 1);
  std::vector<int64_t> v(static_cast<std::size_t>(shape.numel()));
  for (auto& e : v) e = dist(gen);
  return mt::from_vector(v, shape, mt::kInt64);
}

using cu::check_bits;

struct Geo {
  int64_t outer, n, k, inner;
};
std::string geo_name(const Geo& g) {
  return fmt::format("outer {} n {} k {} inner {}", g.outer, g.n, g.k, g.inner);
}

}  // namespace

// --- gather / scatter_add ---------------------------------------------------------------------

TEST_CASE("cuda gather and scatter_add: every geometry and registered dtype", "[cuda]") {
  const std::vector<Geo> geos = {{1, 5, 3, 1},
                                 {2, 7, 4, 3},
                                 {3, 1, 2, 5},
                                 {1, 1000, 100000, 1},
                                 {4, 10, 0, 3},
                                 {2, 50, 60, 40},
                                 {1, 3, (1 << 20) + 1, 1},
                                 {5, 4, 3, 0}};
  std::uint64_t seed = 100;
  for (DType dt : kIndexTypes) {
    CHECK(mt::supports(OpId::gather, mt::DeviceType::CUDA, dt));
    CHECK(mt::supports(OpId::scatter_add, mt::DeviceType::CUDA, dt));
    for (const Geo& g : geos) {
      INFO(fmt::format("{} {}", dt.name(), geo_name(g)));
      Tensor x = small_ints({g.outer, g.n, g.inner}, dt, ++seed);
      Tensor index = random_index({g.outer, g.k, g.inner}, g.n, ++seed);
      Tensor xg = gpu(x), ig = gpu(index);
      // gather: bit for bit, poisoned output.
      Tensor want = Tensor::empty({g.outer, g.k, g.inner}, dt);
      if (want.numel() > 0)
        cpu_kernel<mt::kernels::GatherFn>(OpId::gather, dt)(x, index, g.outer, g.n, g.k, g.inner,
                                                            want);
      Tensor got = cu::poisoned({g.outer, g.k, g.inner}, dt);
      gpu_kernel<mt::kernels::GatherFn>(OpId::gather, dt)(xg, ig, g.outer, g.n, g.k, g.inner, got);
      check_bits(got, want, "gather");
      // scatter_add into a non-zero output (accumulated into, not cleared): integer-valued
      // data, so every partial sum is exact and the result cannot depend on the order (for
      // the 16-bit floats only while about 100 values at most land on one element).
      if (dt.is_reduced_float() && g.k > 100 * g.n) continue;
      Tensor src = small_ints({g.outer, g.k, g.inner}, dt, ++seed);
      Tensor out_cpu = small_ints({g.outer, g.n, g.inner}, dt, ++seed);
      Tensor out_gpu = gpu(out_cpu);
      if (src.numel() > 0)
        cpu_kernel<mt::kernels::ScatterAddFn>(OpId::scatter_add, dt)(src, index, g.outer, g.n, g.k,
                                                                     g.inner, out_cpu);
      gpu_kernel<mt::kernels::ScatterAddFn>(OpId::scatter_add, dt)(gpu(src), ig, g.outer, g.n, g.k,
                                                                   g.inner, out_gpu);
      check_bits(out_gpu, out_cpu, "scatter_add, integer-valued");
    }
    // Random floats: the order of additions differs from the CPU's; rounding only.
    if (dt.is_floating()) {
      const Geo g{2, 50, 60, 40};
      INFO(fmt::format("{} {} random values", dt.name(), geo_name(g)));
      Tensor index = random_index({g.outer, g.k, g.inner}, g.n, ++seed);
      Tensor src = random_of({g.outer, g.k, g.inner}, dt, ++seed);
      Tensor out_cpu = random_of({g.outer, g.n, g.inner}, dt, ++seed);
      Tensor out_gpu = gpu(out_cpu);
      cpu_kernel<mt::kernels::ScatterAddFn>(OpId::scatter_add, dt)(src, index, g.outer, g.n, g.k,
                                                                   g.inner, out_cpu);
      gpu_kernel<mt::kernels::ScatterAddFn>(OpId::scatter_add, dt)(gpu(src), gpu(index), g.outer,
                                                                   g.n, g.k, g.inner, out_gpu);
      cu::check_close(out_gpu, out_cpu, 4 * cu::tolerance(dt), "scatter_add, random values");
    }
  }
}

TEST_CASE("cuda gather: the public op and its gradient", "[cuda]") {
  std::uint64_t seed = 200;
  for (DType dt : kIndexTypes) {
    Tensor x = random_of({4, 6, 5}, dt, ++seed);
    for (int axis : {0, 1, 2, -1}) {
      INFO(fmt::format("{} axis {}", dt.name(), axis));
      const int a = axis < 0 ? axis + 3 : axis;
      std::vector<int64_t> ishape = {4, 6, 5};
      ishape[static_cast<std::size_t>(a)] = 7;
      Tensor idx = random_index(Shape(ishape), x.shape()[static_cast<std::size_t>(a)], ++seed);
      check_bits(mt::gather(gpu(x), gpu(idx), axis), mt::gather(x, idx, axis), "int64 indices");
      Tensor idx32 = idx.to(mt::kInt32);
      check_bits(mt::gather(gpu(x), gpu(idx32), axis), mt::gather(x, idx32, axis), "int32 indices");
    }
  }
  for (DType dt : {mt::kFloat32, mt::kFloat64}) {
    INFO(fmt::format("{} gradient", dt.name()));
    Tensor x = random_of({5, 8}, dt, ++seed);
    Tensor idx = random_index({5, 20}, 8, ++seed);
    Tensor c = random_of({5, 20}, dt, ++seed);
    auto grad_on = [&](mt::Device d) {
      Tensor xd = x.to(d);
      mt::GradientTape tape;
      tape.watch(xd);
      Tensor y = mt::sum(mt::gather(xd, idx.to(d), 1) * c.to(d));
      return tape.gradient(y, xd);
    };
    cu::check_close(grad_on(cu::kGpu), grad_on(mt::Device::cpu()), cu::tolerance(dt),
                    "d/dx of gather");
  }
}

TEST_CASE("cuda gather and take: an index out of range is reported by the next read", "[cuda]") {
  // Indices on the GPU are checked there and read back later (no host wait per op): the op
  // returns, the kernels read 0 for the bad index, and the next read of a device tensor
  // throws IndexError naming the op (or an indexing op, once the check's data has arrived).
  const Tensor x = gpu(random_of({4, 5}, mt::kFloat32, 77, 1.0, 2.0));
  const Tensor bad = gpu(mt::from_vector(std::vector<int64_t>{0, 5, 1, 2}, {4, 1}));
  Tensor out;
  CHECK_NOTHROW(out = mt::gather(x, bad, 1));
  CHECK_THROWS_WITH(out.to(mt::Device::cpu()),
                    Catch::Contains("gather: index 5 is out of range [0, 5)"));
  const auto v = out.to(mt::Device::cpu()).to_vector<double>();  // reported once
  CHECK(v[1] == 0.0);
  CHECK(v[0] >= 1.0);
  const Tensor rows = mt::take(x, gpu(mt::from_vector(std::vector<int64_t>{2, -1}, {2})), 0);
  CHECK_THROWS_WITH(mt::sum(rows).item<double>(),
                    Catch::Contains("take: index -1 is out of range [0, 4)"));
  const auto r = rows.to(mt::Device::cpu()).to_vector<double>();
  CHECK(r[5] == 0.0);  // the second row, index -1
  CHECK(r[0] >= 1.0);
  // take's indices may come from the host: checked there, at once, then copied over.
  const Tensor host_idx = mt::from_vector(std::vector<int64_t>{3, 0, 3}, {3});
  CHECK(mt::take(x, host_idx, 0).to(mt::Device::cpu()).to_vector<double>() ==
        mt::take(x.to(mt::Device::cpu()), host_idx, 0).to_vector<double>());
  CHECK_THROWS_WITH(mt::take(x, mt::from_vector(std::vector<int64_t>{4}, {1}), 0),
                    Catch::Contains("take: index 4 is out of range [0, 4) (at flat position 0"));
}

// --- take / index_add -------------------------------------------------------------------------

TEST_CASE("cuda take and index_add: every geometry and registered dtype", "[cuda]") {
  const std::vector<Geo> geos = {{1, 10, 4, 1}, {3, 7, 5, 8}, {2, 6, 3, 5},  {1, 5000, 1000, 64},
                                 {2, 5, 0, 3},  {1, 1, 3, 2}, {4, 9, 12, 1}, {1, 300, 20000, 64},
                                 {3, 4, 2, 0},  {2, 3, 5, 4}};
  std::uint64_t seed = 300;
  for (DType dt : kIndexTypes) {
    CHECK(mt::supports(OpId::take, mt::DeviceType::CUDA, dt));
    CHECK(mt::supports(OpId::index_add, mt::DeviceType::CUDA, dt));
    for (const Geo& g : geos) {
      INFO(fmt::format("{} {}", dt.name(), geo_name(g)));
      Tensor x = small_ints({g.outer, g.n, g.inner}, dt, ++seed);
      Tensor index = random_index({g.k}, g.n, ++seed);
      Tensor ig = gpu(index);
      Tensor want = Tensor::empty({g.outer, g.k, g.inner}, dt);
      if (want.numel() > 0)
        cpu_kernel<mt::kernels::TakeFn>(OpId::take, dt)(x, index, g.outer, g.n, g.k, g.inner, want);
      Tensor got = cu::poisoned({g.outer, g.k, g.inner}, dt);
      gpu_kernel<mt::kernels::TakeFn>(OpId::take, dt)(gpu(x), ig, g.outer, g.n, g.k, g.inner, got);
      check_bits(got, want, "take");
      // An unaligned x (offset 1 element): rows cannot move as 16-byte units.
      if (g.outer * g.n * g.inner > 0 && want.numel() > 0) {
        Tensor xb = gpu(small_ints({g.outer * g.n * g.inner + 1}, dt, ++seed));
        Tensor xv =
            Tensor::view_of(xb, {g.outer, g.n, g.inner}, mt::contiguous_strides(x.shape()), 1);
        Tensor xv_cpu = xv.to(mt::Device::cpu());
        cpu_kernel<mt::kernels::TakeFn>(OpId::take, dt)(xv_cpu, index, g.outer, g.n, g.k, g.inner,
                                                        want);
        Tensor got2 = cu::poisoned({g.outer, g.k, g.inner}, dt);
        gpu_kernel<mt::kernels::TakeFn>(OpId::take, dt)(xv, ig, g.outer, g.n, g.k, g.inner, got2);
        check_bits(got2, want, "take, unaligned x");
      }
      // index_add, integer-valued: exact whatever the order of the additions.
      Tensor src = small_ints({g.outer, g.k, g.inner}, dt, ++seed);
      Tensor out_cpu = small_ints({g.outer, g.n, g.inner}, dt, ++seed);
      Tensor out_gpu = gpu(out_cpu);
      if (src.numel() > 0)
        cpu_kernel<mt::kernels::IndexAddFn>(OpId::index_add, dt)(src, index, g.outer, g.n, g.k,
                                                                 g.inner, out_cpu);
      gpu_kernel<mt::kernels::IndexAddFn>(OpId::index_add, dt)(gpu(src), ig, g.outer, g.n, g.k,
                                                               g.inner, out_gpu);
      check_bits(out_gpu, out_cpu, "index_add, integer-valued");
    }
    if (dt.is_floating()) {
      const Geo g{3, 20, 30, 16};
      INFO(fmt::format("{} {} random values", dt.name(), geo_name(g)));
      Tensor index = random_index({g.k}, g.n, ++seed);
      Tensor src = random_of({g.outer, g.k, g.inner}, dt, ++seed);
      Tensor out_cpu = random_of({g.outer, g.n, g.inner}, dt, ++seed);
      Tensor out_gpu = gpu(out_cpu);
      cpu_kernel<mt::kernels::IndexAddFn>(OpId::index_add, dt)(src, index, g.outer, g.n, g.k,
                                                               g.inner, out_cpu);
      gpu_kernel<mt::kernels::IndexAddFn>(OpId::index_add, dt)(gpu(src), gpu(index), g.outer, g.n,
                                                               g.k, g.inner, out_gpu);
      cu::check_close(out_gpu, out_cpu, 4 * cu::tolerance(dt), "index_add, random values");
    }
  }
}

TEST_CASE("cuda take: the public op and its gradient", "[cuda]") {
  std::uint64_t seed = 400;
  for (DType dt : kIndexTypes) {
    Tensor x = random_of({4, 6, 5}, dt, ++seed);
    for (int axis : {0, 1, 2}) {
      INFO(fmt::format("{} axis {}", dt.name(), axis));
      const int64_t n = x.shape()[static_cast<std::size_t>(axis)];
      Tensor idx = random_index({2, 3}, n, ++seed);
      check_bits(mt::take(gpu(x), gpu(idx), axis), mt::take(x, idx, axis), "take, 2-D indices");
      Tensor idx32 = random_index({9}, n, ++seed).to(mt::kInt32);
      check_bits(mt::take(gpu(x), gpu(idx32), axis), mt::take(x, idx32, axis),
                 "take, int32 indices");
    }
  }
  for (DType dt : {mt::kFloat32, mt::kFloat64}) {
    INFO(fmt::format("{} gradient (an embedding)", dt.name()));
    Tensor table = random_of({50, 16}, dt, ++seed);
    Tensor ids = random_index({8, 30}, 50, ++seed);  // repeated ids add up
    Tensor c = random_of({8, 30, 16}, dt, ++seed);
    auto grad_on = [&](mt::Device d) {
      Tensor td = table.to(d);
      mt::GradientTape tape;
      tape.watch(td);
      Tensor y = mt::sum(mt::take(td, ids.to(d), 0) * c.to(d));
      return tape.gradient(y, td);
    };
    cu::check_close(grad_on(cu::kGpu), grad_on(mt::Device::cpu()), cu::tolerance(dt),
                    "d/dtable of take");
  }
}

// --- unscale_check ----------------------------------------------------------------------------

namespace {

enum class OutKind { kSeparate, kInPlace, kUndefined };

// A list of gradients on the CPU and its copy on the GPU, with their outputs.
struct UnscaleSet {
  std::vector<Tensor> grads_cpu, grads_gpu, outs_cpu, outs_gpu;
};

UnscaleSet make_set(DType dt, const std::vector<Shape>& shapes, const std::vector<OutKind>& kinds,
                    std::uint64_t seed) {
  UnscaleSet s;
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    Tensor g = random_of(shapes[i], dt, seed + i, -4.0, 4.0);
    s.grads_cpu.push_back(g);
    s.grads_gpu.push_back(gpu(g));
    if (i >= kinds.size()) continue;  // outs shorter than grads: undefined
    switch (kinds[i]) {
      case OutKind::kSeparate:
        s.outs_cpu.push_back(Tensor::empty(shapes[i], dt));
        s.outs_gpu.push_back(cu::poisoned(shapes[i], dt));
        break;
      case OutKind::kInPlace:
        s.outs_cpu.push_back(s.grads_cpu.back());
        s.outs_gpu.push_back(s.grads_gpu.back());
        break;
      case OutKind::kUndefined:
        s.outs_cpu.push_back(Tensor());
        s.outs_gpu.push_back(Tensor());
        break;
    }
  }
  return s;
}

// Sets element `at` of gradient i (on both sides) to v.
void poke(UnscaleSet& s, std::size_t i, int64_t at, double v) {
  Tensor& g = s.grads_cpu[i];
  mt::detail::write_from_double(
      static_cast<char*>(g.data_ptr()) + at * static_cast<int64_t>(g.dtype().itemsize()), g.dtype(),
      v);
  s.grads_gpu[i] = gpu(g);
  if (i < s.outs_gpu.size() && s.outs_cpu[i].defined() && s.outs_cpu[i].impl_ptr() == g.impl_ptr())
    s.outs_gpu[i] = s.grads_gpu[i];  // keep in-place outputs in place
}

// Runs unscale_check on both sides; compares outputs (and in-place gradients) bit for bit.
// scale_on_gpu: the GPU's kernel reads the scale from a float64 scalar on the GPU (a scale kept
// on the device), the number it is passed being another.
void run_and_compare(UnscaleSet& s, DType dt, double scale, const Tensor& flag_cpu,
                     const Tensor& flag_gpu, const std::string& what, bool scale_on_gpu = false) {
  INFO(what << (scale_on_gpu ? ", the scale read on the GPU" : ""));
  cpu_kernel<mt::kernels::UnscaleCheckFn>(OpId::unscale_check, dt)(s.grads_cpu, s.outs_cpu, scale,
                                                                   Tensor(), flag_cpu);
  const Tensor on_gpu = scale_on_gpu ? gpu(mt::full(Shape{}, scale, mt::kFloat64)) : Tensor();
  gpu_kernel<mt::kernels::UnscaleCheckFn>(OpId::unscale_check, dt)(
      s.grads_gpu, s.outs_gpu, scale_on_gpu ? 5.0 : scale, on_gpu, flag_gpu);
  for (std::size_t i = 0; i < s.outs_cpu.size(); ++i) {
    INFO("tensor " << i);
    CHECK(s.outs_cpu[i].defined() == s.outs_gpu[i].defined());
    if (s.outs_cpu[i].defined()) check_bits(s.outs_gpu[i], s.outs_cpu[i], "output");
  }
  for (std::size_t i = 0; i < s.grads_cpu.size(); ++i) {
    INFO("gradient " << i);
    check_bits(s.grads_gpu[i], s.grads_cpu[i], "gradient (in place or untouched)");
  }
}

}  // namespace

TEST_CASE("cuda unscale_check: outputs bit for bit and the non-finite flag", "[cuda]") {
  const std::vector<Shape> shapes = {{1000}, {0}, {37}, {3, 5}, {(1 << 20) + 3}, {1}};
  const std::vector<OutKind> kinds = {OutKind::kSeparate, OutKind::kUndefined, OutKind::kInPlace,
                                      OutKind::kSeparate, OutKind::kInPlace};  // 6th: undefined
  std::uint64_t seed = 500;
  for (DType dt : cu::kFloatTypes) {
    CHECK(mt::supports(OpId::unscale_check, mt::DeviceType::CUDA, dt));
    // 1/1024 is a float32 value, 1/3 is not, 65536 overflows 16-bit outputs.
    for (double scale : {1.0 / 1024.0, 1.0 / 3.0, 65536.0}) {
      INFO(fmt::format("{} scale {}", dt.name(), scale));
      Tensor flag_cpu = mt::zeros({}, mt::kFloat32);
      Tensor flag_gpu = mt::zeros({}, mt::kFloat32, cu::kGpu);
      UnscaleSet s = make_set(dt, shapes, kinds, seed += 10);
      run_and_compare(s, dt, scale, flag_cpu, flag_gpu, "finite gradients");
      CHECK(flag_cpu.item<float>() == 0.0f);
      CHECK(flag_gpu.item<float>() == 0.0f);
      UnscaleSet on_gpu = make_set(dt, shapes, kinds, seed += 10);
      run_and_compare(on_gpu, dt, scale, flag_cpu, flag_gpu, "finite gradients", true);
      CHECK(flag_gpu.item<float>() == 0.0f);
      // One non-finite value anywhere sets the flag.
      struct Poke {
        std::size_t tensor;
        int64_t at;
        double value;
      };
      for (const Poke& p :
           {Poke{0, 0, NAN}, Poke{3, 7, INFINITY}, Poke{4, (1 << 20) + 2, -INFINITY},
            Poke{5, 0, NAN}, Poke{2, 36, INFINITY}}) {
        INFO(fmt::format("{} at element {} of gradient {}", p.value, p.at, p.tensor));
        UnscaleSet t = make_set(dt, shapes, kinds, seed += 10);
        poke(t, p.tensor, p.at, p.value);
        Tensor fc = mt::zeros({}, mt::kFloat32), fg = mt::zeros({}, mt::kFloat32, cu::kGpu);
        run_and_compare(t, dt, scale, fc, fg, "one non-finite value");
        CHECK(fc.item<float>() == 1.0f);
        CHECK(fg.item<float>() == 1.0f);
        // Never cleared: a finite call afterwards leaves it set.
        UnscaleSet u = make_set(dt, shapes, kinds, seed += 10);
        run_and_compare(u, dt, scale, fc, fg, "finite call after a non-finite one");
        CHECK(fg.item<float>() == 1.0f);
      }
    }
    // An empty list does nothing; a list longer than one launch takes (300 tensors), with a
    // NaN in tensor 250 only.
    Tensor fg = mt::zeros({}, mt::kFloat32, cu::kGpu);
    gpu_kernel<mt::kernels::UnscaleCheckFn>(OpId::unscale_check, dt)({}, {}, 0.5, Tensor(), fg);
    CHECK(fg.item<float>() == 0.0f);
    std::vector<Shape> many(300, Shape{7});
    std::vector<OutKind> many_kinds;
    for (int i = 0; i < 300; ++i)
      many_kinds.push_back(i % 3 == 0 ? OutKind::kSeparate
                                      : (i % 3 == 1 ? OutKind::kInPlace : OutKind::kUndefined));
    UnscaleSet m = make_set(dt, many, many_kinds, seed += 10);
    Tensor fc = mt::zeros({}, mt::kFloat32);
    run_and_compare(m, dt, 0.25, fc, fg, "300 finite tensors");
    CHECK(fg.item<float>() == 0.0f);
    UnscaleSet m2 = make_set(dt, many, many_kinds, seed += 10);
    poke(m2, 250, 3, NAN);
    run_and_compare(m2, dt, 0.25, fc, fg, "300 tensors, NaN in tensor 250");
    CHECK(fc.item<float>() == 1.0f);
    CHECK(fg.item<float>() == 1.0f);
  }
}

// --- Optimizer updates --------------------------------------------------------------------

namespace {

using mtest::op_of;
using mtest::Opt;
using mtest::uses_slot;
using mtest::Variant;
using mtest::variants;

// The GPU and CPU kernels run the same operations in the same order and roundings, so
// they agree to the last bit where the CPU does not contract to FMAs; the comparison allows
// a little more (the dtype's tolerance, against the tensor's largest magnitude).
double optim_tolerance(DType dt) {
  if (dt == mt::kFloat64) return 1e-13;
  if (dt == mt::kFloat32) return 1e-6;
  return cu::tolerance(dt);
}

}  // namespace

namespace {

// Three steps of every variant and dtype on variables of each size, the GPU's kernel against
// the CPU's: a plain step, a step skipped on the device, a step with a clear flag.
void check_three_steps(const std::vector<int64_t>& sizes, std::uint64_t seed) {
  for (const Variant& v : variants()) {
    for (DType dt : cu::kFloatTypes) {
      CHECK(mt::supports(op_of(v.opt), mt::DeviceType::CUDA, dt));
      const DType slot_dt = dt == mt::kFloat64 ? mt::kFloat64 : mt::kFloat32;
      for (const int64_t numel : sizes) {
        Tensor var_cpu = random_of({numel}, dt, ++seed);
        Tensor var_gpu = gpu(var_cpu);
        Tensor slots_cpu[3], slots_gpu[3];
        for (int s = 1; s <= 3; ++s) {
          if (!uses_slot(v, s)) continue;
          slots_cpu[s - 1] = mt::zeros({numel}, slot_dt);
          slots_gpu[s - 1] = mt::zeros({numel}, slot_dt, cu::kGpu);
        }
        for (int64_t step = 1; step <= 3; ++step) {
          INFO(fmt::format("{} {} numel {} step {}", v.name, dt.name(), numel, step));
          Tensor grad = random_of({numel}, dt, ++seed);
          mt::kernels::OptimizerUpdate uc = v.p, ug = v.p;
          uc.var = var_cpu, ug.var = var_gpu;
          uc.grad = grad, ug.grad = gpu(grad);
          uc.slot1 = slots_cpu[0], ug.slot1 = slots_gpu[0];
          uc.slot2 = slots_cpu[1], ug.slot2 = slots_gpu[1];
          uc.slot3 = slots_cpu[2], ug.slot3 = slots_gpu[2];
          uc.step = ug.step = step;
          // Step 2 is skipped on the device (its flag set), step 3 has a flag that is clear.
          if (step >= 2) {
            uc.skip_if = mt::full({}, step == 2 ? 1.0 : 0.0, mt::kFloat32);
            ug.skip_if = gpu(uc.skip_if);
          }
          // float32 variables: the 16-bit copy written beside the update (kernels.h),
          // float16 at odd steps, bfloat16 at even ones (the skipped step's too).
          if (dt == mt::kFloat32) {
            const DType copy_dt = step % 2 == 1 ? mt::kFloat16 : mt::kBFloat16;
            uc.copy = Tensor::empty({numel}, copy_dt);
            ug.copy = Tensor::empty({numel}, copy_dt, cu::kGpu);
          }
          const Tensor var_before = var_gpu.to(mt::Device::cpu());
          cpu_kernel<mt::kernels::OptimizerUpdateFn>(op_of(v.opt), dt)(std::span(&uc, 1));
          gpu_kernel<mt::kernels::OptimizerUpdateFn>(op_of(v.opt), dt)(std::span(&ug, 1));
          if (step == 2) {  // nothing changed, bit for bit
            const Tensor after = var_gpu.to(mt::Device::cpu());
            CHECK(std::memcmp(after.data_ptr(), var_before.data_ptr(),
                              static_cast<std::size_t>(numel) * dt.itemsize()) == 0);
          }
          cu::check_close(var_gpu, var_cpu, optim_tolerance(dt), "variable");
          if (ug.copy.defined() && numel > 0) {  // each side's copy is its variable's cast
            const std::size_t bytes = static_cast<std::size_t>(numel) * 2;
            const Tensor got = ug.copy.to(mt::Device::cpu());
            const Tensor want = mt::cast(var_gpu, ug.copy.dtype()).to(mt::Device::cpu());
            CHECK(std::memcmp(got.data_ptr(), want.data_ptr(), bytes) == 0);
            const Tensor want_cpu = mt::cast(var_cpu, uc.copy.dtype());
            CHECK(std::memcmp(uc.copy.data_ptr(), want_cpu.data_ptr(), bytes) == 0);
          }
          for (int s = 0; s < 3; ++s)
            if (slots_cpu[s].defined())
              cu::check_close(slots_gpu[s], slots_cpu[s], optim_tolerance(slot_dt),
                              "slot" + std::to_string(s + 1));
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("cuda optimizer updates: three steps of every variant against the CPU", "[cuda]") {
  // (2^14 + 7: 9 pieces of optim.cu's list_walk, a block each, the last of 7 elements; the case
  // below takes 2^20 + 7.)
  check_three_steps({1000, (1 << 14) + 7, 1, 0}, 600);
}

// [large]: 16 s of the emulated suite's time at this size, for the paths the case above takes.
TEST_CASE("cuda optimizer updates: three steps on a variable of a million elements",
          "[cuda][large]") {
  check_three_steps({(1 << 20) + 7}, 700);
}

TEST_CASE("cuda optimizer updates: one call for 130 variables of mixed sizes against the CPU",
          "[cuda]") {
  // A step's variables of one dtype go to the GPU kernels in launches of a few dozen (the
  // pointer lists as kernel parameters), each sized by its largest tensor: 130 variables of
  // sizes from 0 to 70,001 in one call, 16-bit copies on every third float32 one, the rates
  // read from the device (a captured step's), a skipped step (its flag set) in the middle.
  const std::vector<int64_t> sizes = {0, 1, 7, 33, 1000, 4099, 70001, 31, 2};
  std::uint64_t seed = 900;
  for (const Variant& v : variants()) {
    for (DType dt : {mt::kFloat32, mt::kBFloat16}) {
      const DType slot_dt = mt::kFloat32;
      const int count = 130;
      std::vector<Tensor> var_cpu, var_gpu, slots_cpu, slots_gpu;
      for (int i = 0; i < count; ++i) {
        const int64_t numel = sizes[static_cast<std::size_t>(i) % sizes.size()];
        var_cpu.push_back(random_of({numel}, dt, ++seed));
        var_gpu.push_back(gpu(var_cpu.back()));
        for (int s = 1; s <= 3; ++s) {
          slots_cpu.push_back(uses_slot(v, s) ? mt::zeros({numel}, slot_dt) : Tensor());
          slots_gpu.push_back(uses_slot(v, s) ? mt::zeros({numel}, slot_dt, cu::kGpu) : Tensor());
        }
      }
      for (int64_t step = 1; step <= 3; ++step) {
        INFO(fmt::format("{} {} step {}", v.name, dt.name(), step));
        const auto r = mt::kernels::step_rates(v.p.lr, step, v.p.beta1, v.p.beta2);
        const Tensor rates_cpu = mt::from_vector(std::vector<double>{r.lr, r.alpha}, {2});
        const Tensor rates_gpu = gpu(rates_cpu);
        const Tensor skip_cpu = mt::full({}, step == 2 ? 1.0 : 0.0, mt::kFloat32);
        const Tensor skip_gpu = gpu(skip_cpu);
        std::vector<mt::kernels::OptimizerUpdate> uc(count, v.p), ug(count, v.p);
        std::vector<Tensor> before(count);
        for (int i = 0; i < count; ++i) {
          const auto k = static_cast<std::size_t>(i);
          const Tensor grad = random_of(var_cpu[k].shape(), dt, ++seed);
          uc[k].var = var_cpu[k], ug[k].var = var_gpu[k];
          uc[k].grad = grad, ug[k].grad = gpu(grad);
          uc[k].slot1 = slots_cpu[3 * k], ug[k].slot1 = slots_gpu[3 * k];
          uc[k].slot2 = slots_cpu[3 * k + 1], ug[k].slot2 = slots_gpu[3 * k + 1];
          uc[k].slot3 = slots_cpu[3 * k + 2], ug[k].slot3 = slots_gpu[3 * k + 2];
          uc[k].step = ug[k].step = step;
          uc[k].skip_if = skip_cpu, ug[k].skip_if = skip_gpu;
          uc[k].rates = rates_cpu, ug[k].rates = rates_gpu;
          if (dt == mt::kFloat32 && i % 3 == 0) {
            uc[k].copy = Tensor::empty(var_cpu[k].shape(), mt::kBFloat16);
            ug[k].copy = Tensor::empty(var_cpu[k].shape(), mt::kBFloat16, cu::kGpu);
          }
          before[k] = var_gpu[k].to(mt::Device::cpu());
        }
        cpu_kernel<mt::kernels::OptimizerUpdateFn>(op_of(v.opt), dt)(std::span(uc));
        gpu_kernel<mt::kernels::OptimizerUpdateFn>(op_of(v.opt), dt)(std::span(ug));
        for (int i = 0; i < count; ++i) {
          const auto k = static_cast<std::size_t>(i);
          INFO("variable " << i << " of " << var_cpu[k].numel());
          if (step == 2) {  // nothing changed, bit for bit
            const Tensor after = var_gpu[k].to(mt::Device::cpu());
            CHECK(std::memcmp(after.data_ptr(), before[k].data_ptr(),
                              static_cast<std::size_t>(after.numel()) * dt.itemsize()) == 0);
          }
          cu::check_close(var_gpu[k], var_cpu[k], optim_tolerance(dt), "variable");
          if (ug[k].copy.defined() && var_cpu[k].numel() > 0) {
            const Tensor got = ug[k].copy.to(mt::Device::cpu());
            const Tensor want = mt::cast(var_gpu[k], mt::kBFloat16).to(mt::Device::cpu());
            CHECK(std::memcmp(got.data_ptr(), want.data_ptr(),
                              static_cast<std::size_t>(got.numel()) * 2) == 0);
          }
          for (int s = 0; s < 3; ++s)
            if (slots_cpu[3 * k + static_cast<std::size_t>(s)].defined())
              cu::check_close(slots_gpu[3 * k + static_cast<std::size_t>(s)],
                              slots_cpu[3 * k + static_cast<std::size_t>(s)],
                              optim_tolerance(slot_dt), "slot" + std::to_string(s + 1));
        }
      }
    }
  }
}

TEST_CASE("cuda optimizer: the finiteness check decided on the device, reported one call later",
          "[cuda]") {
  // On a GPU (StepDecision::Auto) the updates skip a step with a NaN gradient and the next
  // apply_gradients throws, nothing changed by that step; the run then goes on as the same
  // steps decided on the host, bit for bit.
  namespace mo = mixtape::optim;
  const auto vec = [](std::vector<double> v, mt::Device d) {
    return mt::from_vector(v, {static_cast<int64_t>(v.size())}).to(d);
  };
  mo::Adam gpu_adam({.learning_rate = 0.1}), host_adam({.learning_rate = 0.1});
  host_adam.set_finite_check(mo::StepDecision::Host);
  mt::Variable w(vec({1, 2, 3}, cu::kGpu), "w"), hw(vec({1, 2, 3}, cu::kGpu), "w");
  gpu_adam.apply_gradients({vec({0.1, -0.2, 0.3}, cu::kGpu)}, {w});
  host_adam.apply_gradients({vec({0.1, -0.2, 0.3}, cu::kGpu)}, {hw});
  const auto before = w.to_vector<double>();
  gpu_adam.apply_gradients({vec({0.1, NAN, 0.3}, cu::kGpu)}, {w});  // no throw: read behind
  CHECK_THROWS_AS(host_adam.apply_gradients({vec({0.1, NAN, 0.3}, cu::kGpu)}, {hw}),
                  mt::NumericError);
  CHECK(w.to_vector<double>() == before);
  CHECK_THROWS_WITH(gpu_adam.apply_gradients({vec({0.5, 0.5, 0.5}, cu::kGpu)}, {w}),
                    Catch::Contains("at step 2") && Catch::Contains("not counted"));
  CHECK(gpu_adam.iterations() == 1);
  for (const double g : {0.25, -0.5}) {
    gpu_adam.apply_gradients({vec({g, g, g}, cu::kGpu)}, {w});
    host_adam.apply_gradients({vec({g, g, g}, cu::kGpu)}, {hw});
  }
  gpu_adam.check_pending();
  CHECK(gpu_adam.iterations() == host_adam.iterations());
  CHECK(w.to_vector<double>() == hw.to_vector<double>());
}

// The list kernels (backends/cuda/optim.cu) walk a launch's tensors as one sequence in pieces
// of 2048 elements, a block per piece, sum_squares on at most 1024 blocks a launch (so its
// blocks take several pieces each here): 150 tensors (two launches of up to 128) of sizes from
// 0 to 70,001, 2.3 M elements in all, pieces starting inside tensors and spanning several.
TEST_CASE("cuda list kernels: 150 tensors over many pieces against the CPU", "[cuda]") {
  const std::vector<int64_t> sizes = {0, 1, 2047, 2049, 70001, 5, 4096, 33000, 3};
  for (DType dt : {mt::kFloat32, mt::kBFloat16}) {
    INFO(dt.name());
    std::vector<Tensor> xs_cpu, xs_gpu, scaled_cpu, scaled_gpu, wide_cpu, wide_gpu;
    std::uint64_t seed = 1700;
    for (int i = 0; i < 150; ++i) {
      const int64_t n = sizes[static_cast<std::size_t>(i) % sizes.size()];
      xs_cpu.push_back(random_of({n}, dt, ++seed));
      xs_gpu.push_back(gpu(xs_cpu.back()));
      scaled_cpu.push_back(Tensor::empty({n}, dt));
      scaled_gpu.push_back(cu::poisoned({n}, dt));
      wide_cpu.push_back(Tensor::empty({n}, mt::kFloat32));
      wide_gpu.push_back(cu::poisoned({n}, mt::kFloat32));
    }
    // sum_squares adds in an order of its own: float64 sums of 2.3 M squares agree closely.
    Tensor sum_cpu = mt::zeros({}, mt::kFloat64), sum_gpu = mt::zeros({}, mt::kFloat64, cu::kGpu);
    cpu_kernel<mt::kernels::SumSquaresFn>(OpId::sum_squares, dt)(xs_cpu, sum_cpu);
    gpu_kernel<mt::kernels::SumSquaresFn>(OpId::sum_squares, dt)(xs_gpu, sum_gpu);
    CHECK(sum_gpu.item<double>() == Approx(sum_cpu.item<double>()).epsilon(1e-12));
    const Tensor factor_cpu = mt::full({}, 0.3, mt::kFloat64);
    cpu_kernel<mt::kernels::ScaleListFn>(OpId::scale_list, dt)(xs_cpu, scaled_cpu, factor_cpu);
    gpu_kernel<mt::kernels::ScaleListFn>(OpId::scale_list, dt)(xs_gpu, scaled_gpu, gpu(factor_cpu));
    if (dt != mt::kFloat32) {
      cpu_kernel<mt::kernels::CastListFn>(OpId::cast_list, dt)(xs_cpu, wide_cpu);
      gpu_kernel<mt::kernels::CastListFn>(OpId::cast_list, dt)(xs_gpu, wide_gpu);
    }
    for (std::size_t i = 0; i < xs_cpu.size(); ++i) {
      INFO("tensor " << i << " of " << xs_cpu[i].numel());
      cu::check_bits(scaled_gpu[i], scaled_cpu[i], "scale_list");
      if (dt != mt::kFloat32) cu::check_bits(wide_gpu[i], wide_cpu[i], "cast_list");
    }
  }
}
