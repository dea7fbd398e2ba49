// CUDA matmul, conv2d and pooling kernels (backends/cuda/gemm.cpp, conv.cpp, pool.cu)
// against the CPU backend's, called through the dispatch table on the same inputs: every
// GemmCase and conv / pool geometry of tests/test_cpu_gemm_conv.cpp for every dtype, with
// NaN-poisoned outputs whose leading-dimension gaps must stay untouched; the 16-bit
// accumulation switch (bit-exact with the CPU emulation); TF32 off by default; ties and NaN
// in pooling; and gradients through the public ops (GradientTape) on the GPU against the
// CPU.
#include <algorithm>
#include <array>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "kernel_cases.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"

namespace {

namespace mt = mixtape;
using ctest_util::kFloatTypes;
using ctest_util::kGpu;
using mt::DType;
using mt::kBFloat16;
using mt::kFloat16;
using mt::kFloat32;
using mt::kFloat64;
using mt::Tensor;
using mt::kernels::Conv2dGeometry;
using mt::kernels::GemmArgs;
using mt::kernels::Pool2dGeometry;
using mtest::conv_geometry;
using mtest::GemmCase;

constexpr auto kCpu = mt::DeviceType::CPU;
constexpr auto kCuda = mt::DeviceType::CUDA;

std::string name(DType dt) { return std::string(dt.name()); }

// Sets mixtape::cuda::allow_tf32 for the scope and restores it after.
class Tf32Scope {
 public:
  explicit Tf32Scope(bool on) : previous_(mt::cuda::allow_tf32()) { mt::cuda::set_allow_tf32(on); }
  ~Tf32Scope() { mt::cuda::set_allow_tf32(previous_); }
  Tf32Scope(const Tf32Scope&) = delete;
  Tf32Scope& operator=(const Tf32Scope&) = delete;

 private:
  bool previous_;
};

// max |got - want| <= tol * max |want| over finite references, NaN exactly where the
// reference has NaN (tol < 0: exact equality, NaN == NaN).
void compare(const std::vector<double>& got, const std::vector<double>& want, double tol,
             const std::string& what) {
  INFO(what);
  REQUIRE(got.size() == want.size());
  double scale = 1e-30, worst = 0.0;
  std::size_t worst_at = 0, nan_mismatch = 0, unequal = 0;
  for (double w : want)
    if (std::isfinite(w)) scale = std::max(scale, std::abs(w));
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) != std::isnan(want[i]) || std::isinf(got[i]) != std::isinf(want[i])) {
      ++nan_mismatch;
      continue;
    }
    if (!std::isfinite(want[i])) {
      if (!std::isnan(want[i]) && got[i] != want[i]) ++unequal;  // infinities of other signs
      continue;
    }
    const double e = std::abs(got[i] - want[i]);
    if (e > 0) ++unequal;
    if (e > worst) worst = e, worst_at = i;
  }
  INFO(fmt::format(
      "{} elements: max error {:.3g} at {} (got {}, want {}), scale {:.3g}, "
      "tolerance {}, NaN/inf mismatches {}, unequal {}",
      got.size(), worst, worst_at, got.empty() ? 0.0 : got[worst_at],
      want.empty() ? 0.0 : want[worst_at], scale,
      tol < 0 ? std::string("exact") : fmt::format("{:.3g}", tol * scale), nan_mismatch, unequal));
  CHECK(nan_mismatch == 0);
  if (tol < 0)
    CHECK(unequal == 0);
  else
    CHECK(worst <= tol * scale);
}

// --- matmul ----------------------------------------------------------------------------------

// The GPU twin of CPU GemmArgs: the same operands, a NaN-poisoned output.
GemmArgs on_gpu(const GemmArgs& g) {
  GemmArgs d = g;
  d.a = g.a.to(kGpu);
  d.b = g.b.to(kGpu);
  d.out = ctest_util::poisoned(g.out.shape(), g.out.dtype());
  return d;
}

// Compares the m x n part of every C (the gaps of the leading dimension must still be NaN on
// the GPU). tol < 0: exact.
void check_gemm_outputs(const GemmArgs& cpu, const GemmArgs& gpu, double tol,
                        const std::string& what) {
  const auto want = cpu.out.to_vector<double>(), got = gpu.out.to_vector<double>();
  std::vector<double> g, w;
  std::size_t gap_written = 0;
  for (std::int64_t bi = 0; bi < cpu.batch; ++bi)
    for (std::int64_t i = 0; i < cpu.m; ++i)
      for (std::int64_t j = 0; j < cpu.ldc; ++j) {
        const auto at = static_cast<std::size_t>(bi * cpu.stride_c + i * cpu.ldc + j);
        if (j >= cpu.n) {
          if (!std::isnan(got[at])) ++gap_written;
          continue;
        }
        g.push_back(got[at]);
        w.push_back(want[at]);
      }
  INFO(what);
  CHECK(gap_written == 0);
  compare(g, w, tol, what);
}

std::string describe(const GemmCase& cs, DType dt) {
  return fmt::format("matmul {} batch {} m {} n {} k {} ta {} tb {} pads {},{},{} share {},{}",
                     name(dt), cs.batch, cs.m, cs.n, cs.k, cs.ta, cs.tb, cs.pad_a, cs.pad_b,
                     cs.pad_c, cs.share_a, cs.share_b);
}

// Runs one case on both backends. low: the 16-bit accumulation (then the results must be
// bit-identical).
void run_gemm_case(const GemmCase& cs, DType dt, bool low = false) {
  GemmArgs cpu = mtest::gemm_args(cs, dt);
  cpu.low_precision_accumulation = low;
  GemmArgs gpu = on_gpu(cpu);
  mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCpu, dt)(cpu);
  mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCuda, dt)(gpu);
  const bool exact = low && dt.is_reduced_float();
  check_gemm_outputs(cpu, gpu, exact ? -1.0 : ctest_util::tolerance(dt, true),
                     describe(cs, dt) + (exact ? " (16-bit accumulation)" : ""));
}

const std::vector<std::vector<std::int64_t>> kGemmSizes = {
    {1, 1, 1}, {3, 17, 5}, {17, 3, 65}, {65, 17, 3}, {1, 65, 17}, {17, 1, 3}, {64, 65, 33}};

// The leading-dimension and batch-stride cases of the CPU tests (and the CPU 16-bit
// accumulation tests' fully padded one), for transposes t.
std::vector<GemmCase> layout_cases(bool ta, bool tb) {
  return {
      {3, 17, 5, 65, ta, tb, 3, 1, 2, false, false},  // padded ld
      {4, 5, 17, 3, ta, tb, 0, 0, 0, true, false},    // shared A
      {4, 17, 3, 5, ta, tb, 0, 0, 0, false, true},    // shared B (folded into one GEMM)
      {3, 17, 3, 5, ta, tb, 2, 0, 1, false, true},    // shared B, padded
      {2, 3, 5, 17, ta, tb, 0, 0, 0, true, true},     // both shared
      {5, 1, 1, 17, ta, tb, 0, 0, 0, false, false},   // batched dots
      {2, 6, 9, 40, ta, tb, 5, 3, 4, false, false},   // all padded
  };
}

// --- conv2d ----------------------------------------------------------------------------------

std::string describe(const Conv2dGeometry& g, DType dt) {
  return fmt::format(
      "conv {} n {} h {} w {} c {} k {}x{} cout {} stride {}x{} pad {},{} out {}x{}{}", name(dt),
      g.n, g.h, g.w, g.c, g.kh, g.kw, g.cout, g.stride_h, g.stride_w, g.pad_top, g.pad_left, g.oh,
      g.ow, g.low_precision_accumulation ? " (16-bit accumulation)" : "");
}

// A geometry with explicit padding (the output extent decides the bottom / right padding).
Conv2dGeometry explicit_geometry(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                                 std::int64_t kh, std::int64_t kw, std::int64_t cout,
                                 std::int64_t sh, std::int64_t sw, std::int64_t pad_top,
                                 std::int64_t pad_left, std::int64_t oh, std::int64_t ow) {
  Conv2dGeometry g;
  g.n = n, g.h = h, g.w = w, g.c = c, g.kh = kh, g.kw = kw, g.cout = cout;
  g.stride_h = sh, g.stride_w = sw, g.pad_top = pad_top, g.pad_left = pad_left;
  g.oh = oh, g.ow = ow;
  return g;
}

// The geometries of tests/test_cpu_gemm_conv.cpp and test_compute_mode.cpp, plus
// asymmetric padding that cuDNN cannot express (TensorFlow 'same' with the odd element at
// the bottom / right, and inputs whose last rows no window reaches).
std::vector<Conv2dGeometry> conv_geometries() {
  return {
      conv_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, true),            // same, stride 1
      conv_geometry(2, 7, 6, 6, 3, 3, 4, 1, 1, true),            // same, more channels
      conv_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, false),           // valid
      conv_geometry(2, 7, 6, 7, 3, 3, 3, 1, 1, false),           // valid, more channels
      conv_geometry(1, 9, 8, 1, 3, 2, 3, 2, 2, true),            // c = 1, kh != kw, stride 2, same
      conv_geometry(2, 13, 11, 1, 8, 7, 3, 2, 2, true),          // c = 1, big window, stride 2
      conv_geometry(2, 9, 10, 2, 2, 3, 3, 2, 1, false),          // mixed strides, valid
      conv_geometry(2, 9, 10, 9, 2, 3, 3, 2, 1, false),          // mixed strides, more channels
      conv_geometry(3, 5, 5, 4, 1, 1, 3, 1, 1, false),           // pointwise
      conv_geometry(3, 5, 5, 50, 1, 1, 3, 1, 1, false),          // pointwise, 50 channels
      conv_geometry(2, 6, 7, 3, 1, 1, 2, 2, 2, false),           // 1x1 stride 2
      conv_geometry(2, 6, 7, 49, 1, 1, 2, 2, 2, false),          // 1x1 stride 2, 49 channels
      conv_geometry(1, 4, 4, 1, 5, 5, 3, 1, 1, true),            // kernel larger than the image
      conv_geometry(1, 4, 4, 2, 5, 5, 3, 1, 1, true),            // the same, 2 channels
      conv_geometry(2, 9, 9, 3, 3, 3, 2, 3, 3, true),            // stride = window (no overlap)
      conv_geometry(4, 16, 16, 8, 3, 3, 5, 1, 1, true),          // larger
      conv_geometry(4, 16, 16, 3, 3, 3, 40, 1, 1, true),         // cout > 32
      conv_geometry(2, 12, 12, 16, 5, 5, 24, 2, 2, true),        // 400 taps, stride 2
      conv_geometry(2, 4, 5, 3, 2, 2, 4, 1, 1, true),            // same, even window: pad 0 / 1
      conv_geometry(2, 6, 8, 4, 3, 3, 5, 2, 2, true),            // same, stride 2: pad 0 / 1
      conv_geometry(1, 5, 7, 2, 4, 4, 3, 1, 1, true),            // same, pad 1 / 2
      explicit_geometry(2, 7, 8, 3, 3, 3, 4, 2, 2, 1, 1, 3, 3),  // last rows unreached
      explicit_geometry(1, 6, 6, 2, 3, 2, 3, 1, 1, 2, 0, 5, 5),  // pad 2 top, -1 bottom
      conv_geometry(2, 28, 28, 1, 3, 3, 32, 1, 1, false),        // the MNIST CNN's first layer
      conv_geometry(2, 13, 13, 32, 3, 3, 64, 1, 1, false),       // and its second
      conv_geometry(2, 15, 17, 24, 3, 3, 40, 2, 2, true),        // stride 2, same, odd sizes
      conv_geometry(3, 9, 7, 17, 5, 3, 33, 2, 3, false),         // odd channels, mixed strides
      conv_geometry(2, 11, 13, 16, 3, 3, 16, 3, 3, true),        // stride 3, same
      conv_geometry(2, 10, 9, 20, 3, 3, 24, 2, 2, false),        // valid, stride 2: a row unread
      conv_geometry(2, 12, 10, 48, 7, 7, 20, 2, 2, true),        // 7x7 stride 2 (a stem)
      conv_geometry(2, 8, 8, 64, 1, 1, 128, 1, 1, false),        // pointwise, 64 -> 128
      conv_geometry(1, 5, 6, 65, 3, 3, 31, 1, 1, true),          // channel counts off the blocks
  };
}

// Runs the three conv kernels on both backends; the GPU ones twice (the first call of a
// geometry picks cuDNN's algorithm, the second reuses it), each into a fresh poisoned output.
void run_conv_case(const Conv2dGeometry& g, DType dt, std::uint64_t seed) {
  const std::string what = describe(g, dt);
  INFO(what);
  const Tensor x = ctest_util::random({g.n, g.h, g.w, g.c}, dt, seed);
  const Tensor w = ctest_util::random({g.kh, g.kw, g.c, g.cout}, dt, seed + 1);
  const Tensor gout = ctest_util::random({g.n, g.oh, g.ow, g.cout}, dt, seed + 2);
  const Tensor out = mtest::empty_poisoned({g.n, g.oh, g.ow, g.cout}, dt);
  const Tensor gx = mtest::empty_poisoned({g.n, g.h, g.w, g.c}, dt);
  const Tensor gw = mtest::empty_poisoned({g.kh, g.kw, g.c, g.cout}, dt);
  mt::find_kernel<mt::kernels::Conv2dFn>(mt::OpId::conv2d, kCpu, dt)(x, w, mt::Tensor(), out, g);
  mt::find_kernel<mt::kernels::Conv2dBackwardInputFn>(mt::OpId::conv2d_backward_input, kCpu, dt)(
      gout, w, gx, g);
  mt::find_kernel<mt::kernels::Conv2dBackwardWeightFn>(mt::OpId::conv2d_backward_weight, kCpu, dt)(
      x, gout, gw, g);

  const Tensor xd = x.to(kGpu), wd = w.to(kGpu), goutd = gout.to(kGpu);
  const bool exact = g.low_precision_accumulation && dt.is_reduced_float();
  const double tol = exact ? -1.0 : ctest_util::tolerance(dt, true);
  for (int call = 0; call < 2; ++call) {
    INFO("call " << call);
    const Tensor outd = ctest_util::poisoned(out.shape(), dt);
    const Tensor gxd = ctest_util::poisoned(gx.shape(), dt);
    const Tensor gwd = ctest_util::poisoned(gw.shape(), dt);
    mt::find_kernel<mt::kernels::Conv2dFn>(mt::OpId::conv2d, kCuda, dt)(xd, wd, mt::Tensor(), outd,
                                                                        g);
    mt::find_kernel<mt::kernels::Conv2dBackwardInputFn>(mt::OpId::conv2d_backward_input, kCuda, dt)(
        goutd, wd, gxd, g);
    mt::find_kernel<mt::kernels::Conv2dBackwardWeightFn>(mt::OpId::conv2d_backward_weight, kCuda,
                                                         dt)(xd, goutd, gwd, g);
    compare(outd.to_vector<double>(), out.to_vector<double>(), tol, "conv2d " + what);
    compare(gxd.to_vector<double>(), gx.to_vector<double>(), tol, "conv2d_backward_input " + what);
    compare(gwd.to_vector<double>(), gw.to_vector<double>(), tol, "conv2d_backward_weight " + what);
  }
}

// --- pooling ---------------------------------------------------------------------------------

Pool2dGeometry pool_geometry(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                             std::int64_t kh, std::int64_t kw, std::int64_t sh, std::int64_t sw,
                             bool same) {
  const Conv2dGeometry cg = conv_geometry(n, h, w, c, kh, kw, 1, sh, sw, same);
  Pool2dGeometry g;
  g.n = n, g.h = h, g.w = w, g.c = c, g.kh = kh, g.kw = kw, g.oh = cg.oh, g.ow = cg.ow;
  g.stride_h = sh, g.stride_w = sw, g.pad_top = cg.pad_top, g.pad_left = cg.pad_left;
  return g;
}

std::string describe(const Pool2dGeometry& g, DType dt) {
  return fmt::format("pool {} n {} h {} w {} c {} k {}x{} stride {}x{} pad {},{} out {}x{}",
                     name(dt), g.n, g.h, g.w, g.c, g.kh, g.kw, g.stride_h, g.stride_w, g.pad_top,
                     g.pad_left, g.oh, g.ow);
}

// All four pooling kernels on both backends, on input x (CPU).
void run_pool_case(const Pool2dGeometry& g, DType dt, const Tensor& x, std::uint64_t seed) {
  const std::string what = describe(g, dt);
  INFO(what);
  const Tensor gout = ctest_util::random({g.n, g.oh, g.ow, g.c}, dt, seed);
  const Tensor xd = x.to(kGpu), goutd = gout.to(kGpu);
  const mt::Shape out_shape{g.n, g.oh, g.ow, g.c}, in_shape{g.n, g.h, g.w, g.c};
  struct Result {
    Tensor max_out, avg_out, max_grad, avg_grad;
  };
  const auto run = [&](mt::DeviceType device, const Tensor& xin, const Tensor& go) {
    const bool gpu = device == kCuda;
    const auto fresh = [&](const mt::Shape& s) {
      return gpu ? ctest_util::poisoned(s, dt) : mtest::empty_poisoned(s, dt);
    };
    Result r{fresh(out_shape), fresh(out_shape), fresh(in_shape), fresh(in_shape)};
    mt::find_kernel<mt::kernels::Pool2dFn>(mt::OpId::max_pool2d, device, dt)(xin, r.max_out, g);
    mt::find_kernel<mt::kernels::Pool2dFn>(mt::OpId::avg_pool2d, device, dt)(xin, r.avg_out, g);
    mt::find_kernel<mt::kernels::Pool2dBackwardFn>(mt::OpId::max_pool2d_backward, device, dt)(
        xin, go, r.max_grad, g);
    mt::find_kernel<mt::kernels::Pool2dBackwardFn>(mt::OpId::avg_pool2d_backward, device, dt)(
        xin, go, r.avg_grad, g);
    return r;
  };
  const Result cpu = run(kCpu, x, gout), gpu = run(kCuda, xd, goutd);
  const double tol = ctest_util::tolerance(dt);
  // A max is one of the inputs (or 0 for a window of padding only): exact.
  compare(gpu.max_out.to_vector<double>(), cpu.max_out.to_vector<double>(), -1.0,
          "max_pool2d " + what);
  compare(gpu.max_grad.to_vector<double>(), cpu.max_grad.to_vector<double>(), tol,
          "max_pool2d_backward " + what);
  compare(gpu.avg_out.to_vector<double>(), cpu.avg_out.to_vector<double>(), tol,
          "avg_pool2d " + what);
  compare(gpu.avg_grad.to_vector<double>(), cpu.avg_grad.to_vector<double>(), tol,
          "avg_pool2d_backward " + what);
}

std::vector<Pool2dGeometry> pool_geometries() {
  std::vector<Pool2dGeometry> gs = {
      pool_geometry(2, 6, 6, 3, 2, 2, 2, 2, false),     // 2x2 / 2, valid
      pool_geometry(2, 7, 7, 3, 2, 2, 2, 2, true),      // odd size, same (pads bottom/right)
      pool_geometry(2, 7, 8, 5, 3, 3, 2, 2, true),      // 3x3 / 2, same
      pool_geometry(1, 6, 5, 1, 3, 3, 1, 1, true),      // 3x3 / 1, same (overlapping)
      pool_geometry(2, 8, 9, 2, 2, 3, 1, 2, false),     // kh != kw, mixed strides
      pool_geometry(4, 16, 16, 40, 3, 3, 1, 1, true),   // larger
      pool_geometry(1, 4, 4, 2, 5, 5, 1, 1, true),      // window larger than the image
      pool_geometry(8, 26, 26, 32, 2, 2, 2, 2, false),  // the MNIST CNN's pools
      pool_geometry(8, 11, 11, 64, 2, 2, 2, 2, false),  // (odd size: last row dropped)
  };
  // Windows of padding only (not produced by 'same' / 'valid', allowed by the contract):
  // 1x1 windows at stride 2 shifted up / left by one.
  Pool2dGeometry pad_only;
  pad_only.n = 1, pad_only.h = 3, pad_only.w = 3, pad_only.c = 2, pad_only.kh = 1, pad_only.kw = 1;
  pad_only.oh = 2, pad_only.ow = 2, pad_only.stride_h = 2, pad_only.stride_w = 2;
  pad_only.pad_top = 1, pad_only.pad_left = 1;
  gs.push_back(pad_only);
  return gs;
}

// x with NaN at every index i where i % period == phase.
Tensor with_nans(const Tensor& x, std::int64_t period, std::int64_t phase) {
  auto v = x.to_vector<double>();
  for (std::size_t i = 0; i < v.size(); ++i)
    if (static_cast<std::int64_t>(i) % period == phase) v[i] = std::nan("");
  return mt::from_vector(v, x.shape(), x.dtype());
}

}  // namespace

// --- matmul ------------------------------------------------------------------------------------

TEST_CASE("cuda matmul matches the CPU for every transpose and dtype", "[cuda][gemm]") {
  for (DType dt : kFloatTypes)
    for (const auto& s : kGemmSizes)
      for (int t = 0; t < 4; ++t)
        run_gemm_case({1, s[0], s[1], s[2], (t & 1) != 0, (t & 2) != 0, 0, 0, 0, false, false}, dt);
}

TEST_CASE("cuda matmul honours leading dimensions and batch strides (stride 0 shares)",
          "[cuda][gemm]") {
  for (DType dt : kFloatTypes)
    for (int t = 0; t < 4; ++t)
      for (const GemmCase& cs : layout_cases((t & 1) != 0, (t & 2) != 0)) run_gemm_case(cs, dt);
}

TEST_CASE("cuda matmul with k == 0 writes zeros and leaves the gaps", "[cuda][gemm]") {
  for (DType dt : kFloatTypes) {
    for (bool low : {false, true}) {
      INFO(name(dt) << " low_precision_accumulation " << low);
      GemmArgs g;
      g.batch = 2, g.m = 3, g.n = 4, g.k = 0;
      g.lda = 1, g.ldb = 4, g.ldc = 5, g.stride_a = 0, g.stride_b = 0, g.stride_c = 15;
      g.a = ctest_util::random({1}, dt, 11).to(kGpu);
      g.b = ctest_util::random({1}, dt, 12).to(kGpu);
      g.out = ctest_util::poisoned({30}, dt);
      g.low_precision_accumulation = low;
      mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCuda, dt)(g);
      const auto v = g.out.to_vector<double>();
      std::size_t bad = 0;
      for (std::size_t i = 0; i < v.size(); ++i) {
        const bool gap = i % 5 == 4;
        if (gap ? !std::isnan(v[i]) : v[i] != 0.0) ++bad;
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("cuda matmul of larger products (tensor cores)", "[cuda][gemm]") {
  for (DType dt : kFloatTypes) {
    run_gemm_case({1, 130, 257, 200, false, true, 0, 0, 0, false, false}, dt);
    run_gemm_case({1, 512, 384, 256, false, false, 0, 0, 0, false, false}, dt);
    run_gemm_case({3, 128, 64, 96, true, false, 0, 0, 0, false, false}, dt);
    run_gemm_case({4, 64, 128, 80, false, true, 0, 8, 0, true, false}, dt);
  }
}

TEST_CASE("cuda matmul of batches past 65535 matrices (several calls)", "[cuda][gemm]") {
  for (DType dt : {kFloat32, kFloat16}) {
    run_gemm_case({70000, 2, 3, 4, false, false, 0, 0, 0, false, false}, dt);
    run_gemm_case({70000, 2, 3, 4, true, true, 1, 0, 1, false, true}, dt);
  }
}

TEST_CASE("cuda matmul with operands and output at odd element offsets", "[cuda][gemm]") {
  // Views one element into their storage: pointers aligned to one element only.
  for (DType dt : kFloatTypes)
    for (int t = 0; t < 4; ++t) {
      const GemmCase cs{2, 17, 9, 33, (t & 1) != 0, (t & 2) != 0, 1, 3, 2, false, false};
      GemmArgs cpu = mtest::gemm_args(cs, dt);
      const auto shifted = [&](const Tensor& t_cpu, bool gpu, bool poison) {
        const std::int64_t n = t_cpu.numel();
        Tensor base =
            poison ? (gpu ? ctest_util::poisoned({n + 1}, dt) : mtest::empty_poisoned({n + 1}, dt))
                   : mt::concat({ctest_util::random({1}, dt, 5), t_cpu}, 0);
        if (gpu && !poison) base = base.to(kGpu);
        return base.slice(0, 1, n + 1);
      };
      GemmArgs gpu = cpu;
      gpu.a = shifted(cpu.a, true, false);
      gpu.b = shifted(cpu.b, true, false);
      gpu.out = shifted(cpu.out, true, true);
      cpu.out = shifted(cpu.out, false, true);
      mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCpu, dt)(cpu);
      mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCuda, dt)(gpu);
      check_gemm_outputs(cpu, gpu, ctest_util::tolerance(dt, true),
                         describe(cs, dt) + " at offset 1");
    }
}

TEST_CASE("cuda 16-bit accumulating matmul is bit-exact with the CPU emulation",
          "[cuda][gemm][compute_mode]") {
  for (DType dt : {kFloat16, kBFloat16}) {
    for (const auto& s : kGemmSizes)
      for (int t = 0; t < 4; ++t)
        run_gemm_case({1, s[0], s[1], s[2], (t & 1) != 0, (t & 2) != 0, 0, 0, 0, false, false}, dt,
                      true);
    for (int t = 0; t < 4; ++t)
      for (const GemmCase& cs : layout_cases((t & 1) != 0, (t & 2) != 0))
        run_gemm_case(cs, dt, true);
    run_gemm_case({1, 130, 257, 200, false, true, 0, 0, 0, false, false}, dt, true);
    run_gemm_case({2, 70, 33, 129, true, false, 1, 0, 3, false, false}, dt, true);
  }
  // float32 / float64 ignore the flag.
  run_gemm_case({2, 17, 5, 65, false, true, 1, 2, 3, false, false}, kFloat32, true);
  run_gemm_case({2, 17, 5, 65, true, false, 1, 2, 3, false, false}, kFloat64, true);
}

TEST_CASE("cuda matmul sums 4096 ones to 4096, or 2048 (fp16) / 256 (bf16) accumulating in 16 bits",
          "[cuda][gemm][compute_mode]") {
  struct Want {
    DType dt;
    double on, off;
  };
  for (const Want& c : {Want{kFloat16, 4096, 2048}, Want{kBFloat16, 4096, 256},
                        Want{kFloat32, 4096, 4096}, Want{kFloat64, 4096, 4096}}) {
    INFO("dtype " << name(c.dt));
    const Tensor a = mt::ones({1, 4096}, c.dt, kGpu), b = mt::ones({4096, 1}, c.dt, kGpu);
    {
      mt::Fp16UseFp32ComputeScope scope(true);
      CHECK(mt::matmul(a, b).item<double>() == c.on);
    }
    {
      mt::Fp16UseFp32ComputeScope scope(false);
      CHECK(mt::matmul(a, b).item<double>() == c.off);
      const Tensor batched =
          mt::matmul(mt::ones({3, 1, 4096}, c.dt, kGpu), mt::ones({3, 4096, 2}, c.dt, kGpu));
      CHECK(batched.to_vector<double>() == std::vector<double>(6, c.off));
      CHECK(mt::matmul(mt::transpose(b), b).item<double>() == c.off);
    }
  }
}

TEST_CASE("cuda float32 matmul and conv2d do not use TF32 unless allowed", "[cuda][gemm][conv]") {
  // 1 + 2^-12 has 13 significant bits: float32 sums 1024 of them exactly (1024.25), TF32
  // (10-bit mantissa) rounds each to 1.
  const double v = 1.0 + std::ldexp(1.0, -12);
  const Tensor a = mt::full({1, 1024}, v, kFloat32, kGpu);
  const Tensor b = mt::ones({1024, 1}, kFloat32, kGpu);
  const Tensor x = mt::full({1, 1, 1, 1024}, v, kFloat32, kGpu);
  const Tensor w = mt::ones({1, 1, 1024, 1}, kFloat32, kGpu);
  {
    Tf32Scope off(false);
    CHECK_FALSE(mt::cuda::allow_tf32());
    CHECK(mt::matmul(a, b).item<double>() == 1024.25);
    CHECK(std::abs(mt::conv2d(x, w).item<double>() - 1024.25) < 0.01);
    // A random product within float32's tolerance of the CPU.
    run_gemm_case({1, 130, 257, 200, false, false, 0, 0, 0, false, false}, kFloat32);
    run_conv_case(conv_geometry(2, 12, 12, 16, 3, 3, 24, 1, 1, true), kFloat32, 71);
  }
  {
    Tf32Scope on(true);
    CHECK(mt::cuda::allow_tf32());
    // TF32 may drop the 2^-12 parts (1024): close to the float32 answer either way.
    const double r = mt::matmul(a, b).item<double>();
    CHECK(std::abs(r - 1024.25) <= 0.25 + 1e-9);
    const double rc = mt::conv2d(x, w).item<double>();
    CHECK(std::abs(rc - 1024.25) <= 0.25 + 1e-3);
    // A random product within TF32's tolerance (about 1e-3 relative).
    GemmArgs cpu =
        mtest::gemm_args({1, 130, 257, 200, false, false, 0, 0, 0, false, false}, kFloat32);
    GemmArgs gpu = on_gpu(cpu);
    mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCpu, kFloat32)(cpu);
    mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, kCuda, kFloat32)(gpu);
    check_gemm_outputs(cpu, gpu, 1e-2, "float32 matmul with TF32 allowed");
  }
}

// --- conv2d ------------------------------------------------------------------------------------

TEST_CASE("cuda conv2d forward and backward match the CPU for every geometry and dtype",
          "[cuda][conv]") {
  std::uint64_t seed = 100;
  for (DType dt : kFloatTypes)
    for (const Conv2dGeometry& g : conv_geometries()) run_conv_case(g, dt, seed += 3);
}

TEST_CASE("cuda conv2d on larger inputs", "[cuda][conv][large]") {
  run_conv_case(conv_geometry(3, 100, 100, 16, 3, 3, 2, 1, 1, true), kFloat32, 7);
  run_conv_case(conv_geometry(3, 100, 100, 16, 3, 3, 2, 1, 1, true), kBFloat16, 8);
  run_conv_case(conv_geometry(8, 32, 32, 64, 3, 3, 64, 1, 1, true), kFloat16, 9);
  run_conv_case(conv_geometry(8, 32, 32, 64, 3, 3, 64, 2, 2, true), kFloat32, 10);
  run_conv_case(conv_geometry(2, 30, 30, 16, 3, 3, 8, 2, 2, true), kFloat64, 11);
}

TEST_CASE("cuda 16-bit accumulating conv2d is bit-exact with the CPU emulation",
          "[cuda][conv][compute_mode]") {
  std::uint64_t seed = 500;
  for (DType dt : {kFloat16, kBFloat16})
    for (Conv2dGeometry g : conv_geometries()) {
      g.low_precision_accumulation = true;
      run_conv_case(g, dt, seed += 3);
    }
  // float32 / float64 ignore the flag.
  Conv2dGeometry g = conv_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, true);
  g.low_precision_accumulation = true;
  run_conv_case(g, kFloat32, 600);
  run_conv_case(g, kFloat64, 601);
}

TEST_CASE("cuda conv2d sums 4096 ones to 4096, or 2048 (fp16) / 256 (bf16) accumulating in 16 bits",
          "[cuda][conv][compute_mode]") {
  for (DType dt : {kFloat16, kBFloat16}) {
    INFO("dtype " << name(dt));
    const double capped = dt == kFloat16 ? 2048 : 256;
    const Tensor x1 = mt::ones({1, 2, 2, 4096}, dt, kGpu), w1 = mt::ones({1, 1, 4096, 3}, dt, kGpu);
    const Tensor x2 = mt::ones({1, 64, 64, 1}, dt, kGpu), w2 = mt::ones({64, 64, 1, 1}, dt, kGpu);
    {
      mt::Fp16UseFp32ComputeScope scope(true);
      CHECK(mt::conv2d(x1, w1).to_vector<double>() == std::vector<double>(12, 4096));
      CHECK(mt::conv2d(x2, w2).item<double>() == 4096);
    }
    {
      mt::Fp16UseFp32ComputeScope scope(false);
      CHECK(mt::conv2d(x1, w1).to_vector<double>() == std::vector<double>(12, capped));
      CHECK(mt::conv2d(x2, w2).item<double>() == capped);
      const auto same = mt::conv2d(x2, w2, {1, 1}, mt::Padding::Same).to_vector<double>();
      CHECK(same[32 * 64 + 32] == capped);
      CHECK(same[0] == (dt == kFloat16 ? 33 * 33 : 256));
    }
  }
}

// --- pooling -----------------------------------------------------------------------------------

TEST_CASE("cuda pooling forward and backward match the CPU", "[cuda][pool]") {
  std::uint64_t seed = 900;
  for (DType dt : kFloatTypes)
    for (const Pool2dGeometry& g : pool_geometries()) {
      seed += 2;
      run_pool_case(g, dt, ctest_util::random({g.n, g.h, g.w, g.c}, dt, seed), seed + 1);
    }
}

TEST_CASE("cuda max pool routes ties to the first maximum and propagates NaN", "[cuda][pool]") {
  std::uint64_t seed = 1300;
  for (DType dt : kFloatTypes) {
    for (const Pool2dGeometry& g : {pool_geometry(2, 5, 5, 3, 3, 3, 1, 1, true),
                                    pool_geometry(2, 7, 8, 5, 3, 3, 2, 2, true)}) {
      const mt::Shape shape{g.n, g.h, g.w, g.c};
      run_pool_case(g, dt, mt::full(shape, 0.5, dt), seed += 2);
      // Few distinct values: many ties between a window's candidates.
      auto coarse = ctest_util::random(shape, kFloat64, seed += 2, 0.0, 3.0).to_vector<double>();
      for (double& v : coarse) v = std::floor(v);
      const Tensor tied = mt::from_vector(coarse, shape, dt);
      run_pool_case(g, dt, tied, seed += 2);
      // NaN inputs: a NaN wins its windows (the first NaN takes the gradient).
      run_pool_case(g, dt, with_nans(tied, 7, 3), seed += 2);
      const Tensor noisy = ctest_util::random(shape, dt, seed += 2);
      run_pool_case(g, dt, with_nans(noisy, 5, 0), seed += 2);
    }
  }
}

TEST_CASE("cuda max pool propagates NaN and keeps -inf", "[cuda][pool]") {
  // 2x2 windows, stride 2, one channel: window 0 holds a NaN after a larger number, window
  // 1 two NaNs (the gradient goes to the first), window 2 only -inf, window 3 plain numbers
  // with a tie (the first 7 wins).
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> xs = {5.0,  nan,  nan, nan, 1.0,  2.0,  3.0, 0.5,
                                  -inf, -inf, 4.0, 7.0, -inf, -inf, 6.0, 7.0};
  const Pool2dGeometry g = pool_geometry(1, 4, 4, 1, 2, 2, 2, 2, false);
  for (DType dt : kFloatTypes) {
    INFO("dtype " << name(dt));
    const Tensor x = mt::from_vector(xs, mt::Shape{1, 4, 4, 1}, dt, kGpu);
    const Tensor gout =
        mt::from_vector(std::vector<double>{1.0, 2.0, 3.0, 4.0}, mt::Shape{1, 2, 2, 1}, dt, kGpu);
    const Tensor out = ctest_util::poisoned({1, 2, 2, 1}, dt);
    const Tensor gx = ctest_util::poisoned({1, 4, 4, 1}, dt);
    mt::find_kernel<mt::kernels::Pool2dFn>(mt::OpId::max_pool2d, kCuda, dt)(x, out, g);
    mt::find_kernel<mt::kernels::Pool2dBackwardFn>(mt::OpId::max_pool2d_backward, kCuda, dt)(
        x, gout, gx, g);
    const auto o = out.to_vector<double>(), d = gx.to_vector<double>();
    CHECK(std::isnan(o[0]));  // windows: [5, nan; 1, 2], [nan, nan; 3, 0.5]
    CHECK(std::isnan(o[1]));
    CHECK(o[2] == -inf);  // [-inf, -inf; -inf, -inf]
    CHECK(o[3] == 7.0);   // [4, 7; 6, 7]
    CHECK(d == std::vector<double>{0, 1, 2, 0, 0, 0, 0, 0, 3, 0, 0, 4, 0, 0, 0, 0});
  }
}

// --- Gradients through the public ops ------------------------------------------------------------

TEST_CASE("cuda gradients of conv2d, pooling and matmul match the CPU's", "[cuda][autograd]") {
  for (DType dt : {kFloat32, kFloat64, kFloat16, kBFloat16}) {
    INFO("dtype " << name(dt));
    const double tol = ctest_util::tolerance(dt, true);
    // Runs f on CPU copies and on GPU copies of the inputs; compares the output and the
    // gradients of <output, seed> with respect to every input.
    const auto check = [&](const std::string& what, const std::vector<Tensor>& inputs,
                           const auto& f, std::uint64_t seed) {
      INFO(what);
      std::vector<std::vector<double>> results[2];
      for (int d = 0; d < 2; ++d) {
        const mt::Device device = d == 0 ? mt::Device::cpu() : kGpu;
        std::vector<Tensor> xs;
        for (const Tensor& t : inputs) xs.push_back(t.to(device));
        mt::GradientTape tape;
        tape.watch(xs);
        const Tensor y = f(xs);
        const Tensor s = ctest_util::random(y.shape(), dt, seed).to(device);
        const auto grads = tape.gradient(y, xs, s);
        results[d].push_back(y.to_vector<double>());
        for (const Tensor& gr : grads) results[d].push_back(gr.to_vector<double>());
      }
      REQUIRE(results[0].size() == results[1].size());
      for (std::size_t i = 0; i < results[0].size(); ++i)
        compare(results[1][i], results[0][i], tol,
                what + (i == 0 ? " output" : " gradient " + std::to_string(i - 1)));
    };

    const Tensor x = ctest_util::random({2, 9, 8, 3}, dt, 21);
    const Tensor w = ctest_util::random({3, 3, 3, 4}, dt, 22);
    check(
        "conv2d same stride 2x1", {x, w},
        [](const std::vector<Tensor>& v) {
          return mt::conv2d(v[0], v[1], {2, 1}, mt::Padding::Same);
        },
        23);
    check(
        "conv2d valid", {x, w}, [](const std::vector<Tensor>& v) { return mt::conv2d(v[0], v[1]); },
        24);
    check(
        "max_pool2d 3x3 / 2 same", {x},
        [](const std::vector<Tensor>& v) {
          return mt::max_pool2d(v[0], {3, 3}, {2, 2}, mt::Padding::Same);
        },
        25);
    check(
        "avg_pool2d 2x3 / 1x2 same", {x},
        [](const std::vector<Tensor>& v) {
          return mt::avg_pool2d(v[0], {2, 3}, {1, 2}, mt::Padding::Same);
        },
        26);
    const Tensor a = ctest_util::random({3, 5, 7}, dt, 27);
    const Tensor b = ctest_util::random({7, 4}, dt, 28);
    check(
        "matmul with a broadcast operand", {a, b},
        [](const std::vector<Tensor>& v) { return mt::matmul(v[0], v[1]); }, 29);
    check(
        "matmul of a transposed view", {a, b},
        [](const std::vector<Tensor>& v) {
          return mt::matmul(mt::transpose(v[1]), mt::transpose(v[0], 1, 2));
        },
        30);
  }
}
