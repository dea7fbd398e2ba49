// CPU matmul, conv2d and pooling kernels, called straight through the dispatch table and
// checked against naive double-precision loops. The conv2d and pooling cases run twice when
// the library has oneDNN: on its kernels and on conv.cpp's own (set_onednn_enabled).
#include <algorithm>
#include <bit>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "kernel_cases.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

using namespace mixtape;
using kernels::Conv2dGeometry;
using kernels::GemmArgs;
using kernels::Pool2dGeometry;
using mtest::conv_geometry;
using mtest::empty_poisoned;
using mtest::gemm_args;
using mtest::GemmCase;
using mtest::random;

namespace {

const std::vector<DType> kFloatTypes = {kFloat32, kFloat16, kBFloat16, kFloat64};

// Runs body() on each CPU conv / pooling path: conv.cpp's kernels, then oneDNN when built in.
template <typename F>
void for_each_path(F body) {
  for (bool on : {false, true}) {
    if (on && !cpu::onednn_available()) continue;
    const cpu::OneDnnScope scope(on);
    INFO("oneDNN " << (on ? "on" : "off"));
    body();
  }
}

// Error allowed relative to the largest magnitude of the reference.
double tolerance(DType dt) {
  if (dt == kFloat64) return 1e-12;
  if (dt == kFloat32) return 1e-5;
  if (dt == kFloat16) return 2e-3;
  return 1e-2;  // bfloat16
}

std::vector<double> values(const Tensor& t) { return t.to_vector<double>(); }

// Checks |actual - expected| <= tol * max|expected| everywhere (NaN fails).
void check_close(const std::vector<double>& actual, const std::vector<double>& expected, DType dt,
                 const std::string& what) {
  REQUIRE(actual.size() == expected.size());
  double scale = 0.0;
  for (double e : expected) scale = std::max(scale, std::abs(e));
  scale = std::max(scale, 1e-30);
  double worst = 0.0;
  std::size_t worst_at = 0, nans = 0;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    if (std::isnan(actual[i])) {
      ++nans;
      continue;
    }
    const double err = std::abs(actual[i] - expected[i]);
    if (err > worst) {
      worst = err;
      worst_at = i;
    }
  }
  INFO(what << " dtype " << std::string(dt.name()) << ": max error " << worst << " at " << worst_at
            << " (scale " << scale << "), NaNs " << nans);
  CHECK(nans == 0);
  CHECK(worst <= tolerance(dt) * scale);
}

// --- matmul ----------------------------------------------------------------------------

void run_gemm_case(const GemmCase& cs, DType dt) {
  const GemmArgs g = gemm_args(cs, dt);

  find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt)(g);

  const auto a = values(g.a), b = values(g.b), c = values(g.out);
  std::vector<double> got, want;
  std::size_t pad_written = 0;
  for (std::int64_t bi = 0; bi < cs.batch; ++bi) {
    for (std::int64_t i = 0; i < cs.m; ++i) {
      for (std::int64_t j = 0; j < g.ldc; ++j) {
        const double cv = c[static_cast<std::size_t>(bi * g.stride_c + i * g.ldc + j)];
        if (j >= cs.n) {  // the leading-dimension gap must stay untouched
          if (!std::isnan(cv)) ++pad_written;
          continue;
        }
        double acc = 0.0;
        for (std::int64_t p = 0; p < cs.k; ++p) {
          const std::int64_t ia = bi * g.stride_a + (cs.ta ? p * g.lda + i : i * g.lda + p);
          const std::int64_t ib = bi * g.stride_b + (cs.tb ? j * g.ldb + p : p * g.ldb + j);
          acc += a[static_cast<std::size_t>(ia)] * b[static_cast<std::size_t>(ib)];
        }
        got.push_back(cv);
        want.push_back(acc);
      }
    }
  }
  INFO("batch " << cs.batch << " m " << cs.m << " n " << cs.n << " k " << cs.k << " ta " << cs.ta
                << " tb " << cs.tb << " share_a " << cs.share_a << " share_b " << cs.share_b);
  CHECK(pad_written == 0);
  check_close(got, want, dt, "matmul");
}

// --- conv2d ----------------------------------------------------------------------------

// Calls f(i, oy, ox, ky, kx, iy, ix) for every in-image tap of every output pixel.
template <typename F>
void for_each_tap(const Conv2dGeometry& g, F f) {
  for (std::int64_t i = 0; i < g.n; ++i)
    for (std::int64_t oy = 0; oy < g.oh; ++oy)
      for (std::int64_t ox = 0; ox < g.ow; ++ox)
        for (std::int64_t ky = 0; ky < g.kh; ++ky)
          for (std::int64_t kx = 0; kx < g.kw; ++kx) {
            const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
            const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
            if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
            f(i, oy, ox, ky, kx, iy, ix);
          }
}

struct ConvRefs {
  std::vector<double> out, grad_x, grad_w;
};

ConvRefs conv_reference(const std::vector<double>& x, const std::vector<double>& w,
                        const std::vector<double>& gout, const Conv2dGeometry& g) {
  ConvRefs r;
  r.out.assign(static_cast<std::size_t>(g.n * g.oh * g.ow * g.cout), 0.0);
  r.grad_x.assign(x.size(), 0.0);
  r.grad_w.assign(w.size(), 0.0);
  for_each_tap(g, [&](auto i, auto oy, auto ox, auto ky, auto kx, auto iy, auto ix) {
    for (std::int64_t ci = 0; ci < g.c; ++ci) {
      const auto xi = static_cast<std::size_t>(((i * g.h + iy) * g.w + ix) * g.c + ci);
      for (std::int64_t co = 0; co < g.cout; ++co) {
        const auto wi = static_cast<std::size_t>(((ky * g.kw + kx) * g.c + ci) * g.cout + co);
        const auto oi = static_cast<std::size_t>(((i * g.oh + oy) * g.ow + ox) * g.cout + co);
        r.out[oi] += x[xi] * w[wi];
        r.grad_x[xi] += gout[oi] * w[wi];
        r.grad_w[wi] += x[xi] * gout[oi];
      }
    }
  });
  return r;
}

double dot(const std::vector<double>& a, const std::vector<double>& b, double* abs_sum) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    s += a[i] * b[i];
    *abs_sum += std::abs(a[i] * b[i]);
  }
  return s;
}

void run_conv_case(const Conv2dGeometry& g, DType dt, bool check_naive = true) {
  INFO("conv n " << g.n << " h " << g.h << " w " << g.w << " c " << g.c << " k " << g.kh << "x"
                 << g.kw << " cout " << g.cout << " stride " << g.stride_h << "x" << g.stride_w
                 << " pad " << g.pad_top << "," << g.pad_left << " out " << g.oh << "x" << g.ow);
  const Tensor x = random({g.n, g.h, g.w, g.c}, dt);
  const Tensor w = random({g.kh, g.kw, g.c, g.cout}, dt);
  const Tensor gout = random({g.n, g.oh, g.ow, g.cout}, dt);
  const Tensor out = empty_poisoned({g.n, g.oh, g.ow, g.cout}, dt);
  const Tensor gx = empty_poisoned({g.n, g.h, g.w, g.c}, dt);
  const Tensor gw = empty_poisoned({g.kh, g.kw, g.c, g.cout}, dt);
  const auto cpu = DeviceType::CPU;
  find_kernel<kernels::Conv2dFn>(OpId::conv2d, cpu, dt)(x, w, Tensor(), out, g);
  find_kernel<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, cpu, dt)(gout, w, gx, g);
  find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight, cpu, dt)(x, gout, gw,
                                                                                      g);
  const auto xv = values(x), wv = values(w), gv = values(gout);
  const auto ov = values(out), gxv = values(gx), gwv = values(gw);

  // Adjoint identity: <conv(x, w), g> == <x, dx(g, w)> == <w, dw(x, g)>.
  double scale = 0.0;
  const double lhs = dot(ov, gv, &scale);
  const double via_x = dot(xv, gxv, &scale);
  const double via_w = dot(wv, gwv, &scale);
  const double tol = tolerance(dt) * std::max(scale, 1e-30);
  CHECK(std::abs(lhs - via_x) <= tol);
  CHECK(std::abs(lhs - via_w) <= tol);

  if (!check_naive) return;
  const ConvRefs ref = conv_reference(xv, wv, gv, g);
  check_close(ov, ref.out, dt, "conv2d");
  check_close(gxv, ref.grad_x, dt, "conv2d_backward_input");
  check_close(gwv, ref.grad_w, dt, "conv2d_backward_weight");

  // With a bias, added to the accumulator: a 16-bit result is rounded once, so it lies
  // within half an ulp of the exact value (plus float32's summation error, 1e-5 of the
  // largest output); rounding the convolution first and adding the bias after would be up
  // to a whole ulp off.
  const Tensor bias = random({g.cout}, dt);
  const Tensor out_b = empty_poisoned({g.n, g.oh, g.ow, g.cout}, dt);
  find_kernel<kernels::Conv2dFn>(OpId::conv2d, cpu, dt)(x, w, bias, out_b, g);
  const auto bv = values(bias), obv = values(out_b);
  std::vector<double> want(ref.out.size());
  double largest = 0.0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    want[i] = ref.out[i] + bv[i % static_cast<std::size_t>(g.cout)];
    largest = std::max(largest, std::abs(want[i]));
  }
  check_close(obv, want, dt, "conv2d with a bias");
  if (dt == kFloat16 || dt == kBFloat16) {
    const int bits = dt == kFloat16 ? 10 : 7;
    const double smallest = dt == kFloat16 ? std::ldexp(1.0, -24) : 0.0;
    std::size_t bad = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const double ulp = want[i] == 0.0
                             ? smallest
                             : std::max(std::ldexp(1.0, std::ilogb(want[i]) - bits), smallest);
      if (!(std::abs(obv[i] - want[i]) <= 0.5 * ulp + 1e-5 * largest)) ++bad;
    }
    CHECK(bad == 0);
  }
}

// --- pooling ---------------------------------------------------------------------------

Pool2dGeometry pool_geometry(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                             std::int64_t kh, std::int64_t kw, std::int64_t sh, std::int64_t sw,
                             bool same) {
  const Conv2dGeometry cg = conv_geometry(n, h, w, c, kh, kw, 1, sh, sw, same);
  Pool2dGeometry g;
  g.n = n, g.h = h, g.w = w, g.c = c, g.kh = kh, g.kw = kw, g.oh = cg.oh, g.ow = cg.ow;
  g.stride_h = sh, g.stride_w = sw, g.pad_top = cg.pad_top, g.pad_left = cg.pad_left;
  return g;
}

struct PoolRefs {
  std::vector<double> max_out, max_grad, avg_out, avg_grad;
};

PoolRefs pool_reference(const std::vector<double>& x, const std::vector<double>& gout,
                        const Pool2dGeometry& g) {
  PoolRefs r;
  r.max_out.assign(gout.size(), 0.0);
  r.avg_out.assign(gout.size(), 0.0);
  r.max_grad.assign(x.size(), 0.0);
  r.avg_grad.assign(x.size(), 0.0);
  auto xi = [&](std::int64_t i, std::int64_t iy, std::int64_t ix, std::int64_t ch) {
    return static_cast<std::size_t>(((i * g.h + iy) * g.w + ix) * g.c + ch);
  };
  for (std::int64_t i = 0; i < g.n; ++i)
    for (std::int64_t oy = 0; oy < g.oh; ++oy)
      for (std::int64_t ox = 0; ox < g.ow; ++ox)
        for (std::int64_t ch = 0; ch < g.c; ++ch) {
          const auto oi = static_cast<std::size_t>(((i * g.oh + oy) * g.ow + ox) * g.c + ch);
          double best = 0.0, sum = 0.0;
          std::size_t best_at = 0;
          std::int64_t count = 0;
          for (std::int64_t ky = 0; ky < g.kh; ++ky)
            for (std::int64_t kx = 0; kx < g.kw; ++kx) {
              const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
              const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
              if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
              const double v = x[xi(i, iy, ix, ch)];
              if (count == 0 || v > best) {
                best = v;
                best_at = xi(i, iy, ix, ch);
              }
              sum += v;
              ++count;
            }
          if (count == 0) continue;  // all padding: not produced by these geometries
          r.max_out[oi] = best;
          r.max_grad[best_at] += gout[oi];
          r.avg_out[oi] = sum / static_cast<double>(count);
          for (std::int64_t ky = 0; ky < g.kh; ++ky)
            for (std::int64_t kx = 0; kx < g.kw; ++kx) {
              const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
              const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
              if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
              r.avg_grad[xi(i, iy, ix, ch)] += gout[oi] / static_cast<double>(count);
            }
        }
  return r;
}

void run_pool_case(const Pool2dGeometry& g, DType dt, const Tensor& x) {
  INFO("pool n " << g.n << " h " << g.h << " w " << g.w << " c " << g.c << " k " << g.kh << "x"
                 << g.kw << " stride " << g.stride_h << "x" << g.stride_w << " pad " << g.pad_top
                 << "," << g.pad_left << " out " << g.oh << "x" << g.ow);
  const Tensor gout = random({g.n, g.oh, g.ow, g.c}, dt);
  const Tensor max_out = empty_poisoned({g.n, g.oh, g.ow, g.c}, dt);
  const Tensor avg_out = empty_poisoned({g.n, g.oh, g.ow, g.c}, dt);
  const Tensor max_grad = empty_poisoned({g.n, g.h, g.w, g.c}, dt);
  const Tensor avg_grad = empty_poisoned({g.n, g.h, g.w, g.c}, dt);
  const auto cpu = DeviceType::CPU;
  find_kernel<kernels::Pool2dFn>(OpId::max_pool2d, cpu, dt)(x, max_out, g);
  find_kernel<kernels::Pool2dFn>(OpId::avg_pool2d, cpu, dt)(x, avg_out, g);
  find_kernel<kernels::Pool2dBackwardFn>(OpId::max_pool2d_backward, cpu, dt)(x, gout, max_grad, g);
  find_kernel<kernels::Pool2dBackwardFn>(OpId::avg_pool2d_backward, cpu, dt)(x, gout, avg_grad, g);
  const PoolRefs ref = pool_reference(values(x), values(gout), g);
  const auto mo = values(max_out);
  CHECK(mo == ref.max_out);  // a max is one of the inputs: exact
  check_close(mo, ref.max_out, dt, "max_pool2d");
  check_close(values(max_grad), ref.max_grad, dt, "max_pool2d_backward");
  check_close(values(avg_out), ref.avg_out, dt, "avg_pool2d");
  check_close(values(avg_grad), ref.avg_grad, dt, "avg_pool2d_backward");
}

}  // namespace

TEST_CASE("cpu matmul matches a naive loop for every transpose and dtype", "[gemm]") {
  const std::vector<std::vector<std::int64_t>> sizes = {
      {1, 1, 1}, {3, 17, 5}, {17, 3, 65}, {65, 17, 3}, {1, 65, 17}, {17, 1, 3}, {64, 65, 33}};
  for_each_path([&] {
    for (DType dt : kFloatTypes)
      for (const auto& s : sizes)
        for (int t = 0; t < 4; ++t)
          run_gemm_case({1, s[0], s[1], s[2], (t & 1) != 0, (t & 2) != 0, 0, 0, 0, false, false},
                        dt);
  });
}

TEST_CASE("cpu matmul honours leading dimensions and batch strides", "[gemm]") {
  for_each_path([] {
    for (DType dt : kFloatTypes)
      for (int t = 0; t < 4; ++t) {
        const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
        run_gemm_case({3, 17, 5, 65, ta, tb, 3, 1, 2, false, false}, dt);  // padded ld
        run_gemm_case({4, 5, 17, 3, ta, tb, 0, 0, 0, true, false}, dt);    // shared A
        run_gemm_case({4, 17, 3, 5, ta, tb, 0, 0, 0, false, true}, dt);    // shared B
        run_gemm_case({3, 17, 3, 5, ta, tb, 2, 0, 1, false, true}, dt);    // shared B, padded
        run_gemm_case({2, 3, 5, 17, ta, tb, 0, 0, 0, true, true}, dt);     // both shared
        run_gemm_case({5, 1, 1, 17, ta, tb, 0, 0, 0, false, false}, dt);   // batched dots
      }
  });
}

TEST_CASE("cpu matmul with k == 0 writes zeros", "[gemm]") {
  for_each_path([] {
    for (DType dt : kFloatTypes) {
      GemmArgs g;
      g.batch = 2, g.m = 3, g.n = 4, g.k = 0;
      g.lda = 1, g.ldb = 4, g.ldc = 4, g.stride_a = 0, g.stride_b = 0, g.stride_c = 12;
      g.a = random({1}, dt);
      g.b = random({1}, dt);
      g.out = empty_poisoned({24}, dt);
      find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt)(g);
      CHECK(values(g.out) == std::vector<double>(24, 0.0));
    }
  });
}

TEST_CASE("cpu matmul of a larger product (threaded BLAS)", "[gemm]") {
  for_each_path([] {
    for (DType dt : {kFloat32, kFloat16, kBFloat16})
      for (int t = 0; t < 4; ++t)
        run_gemm_case({1, 130, 257, 200, (t & 1) != 0, (t & 2) != 0, 0, 0, 0, false, false}, dt);
    // The MLP's weight gradient: A transposed, batch 128 in k.
    run_gemm_case({1, 784, 512, 128, true, false, 0, 0, 0, false, false}, kBFloat16);
  });
}

TEST_CASE("cpu conv2d forward and backward match naive loops", "[conv]") {
  // Windows of up to 48 taps (kh*kw*c) take the direct path, larger ones im2col + GEMM.
  const std::vector<Conv2dGeometry> geoms = {
      conv_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, true),     // same, stride 1 (direct)
      conv_geometry(2, 7, 6, 6, 3, 3, 4, 1, 1, true),     // same, stride 1 (GEMM)
      conv_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, false),    // valid (direct)
      conv_geometry(2, 7, 6, 7, 3, 3, 3, 1, 1, false),    // valid (GEMM)
      conv_geometry(1, 9, 8, 1, 3, 2, 3, 2, 2, true),     // c = 1, kh != kw, stride 2, same
      conv_geometry(2, 13, 11, 1, 8, 7, 3, 2, 2, true),   // c = 1, kh != kw, stride 2 (GEMM)
      conv_geometry(2, 9, 10, 2, 2, 3, 3, 2, 1, false),   // mixed strides, valid (direct)
      conv_geometry(2, 9, 10, 9, 2, 3, 3, 2, 1, false),   // mixed strides, valid (GEMM)
      conv_geometry(3, 5, 5, 4, 1, 1, 3, 1, 1, false),    // pointwise (direct)
      conv_geometry(3, 5, 5, 50, 1, 1, 3, 1, 1, false),   // pointwise (GEMM, no im2col)
      conv_geometry(2, 6, 7, 3, 1, 1, 2, 2, 2, false),    // 1x1 stride 2 (direct)
      conv_geometry(2, 6, 7, 49, 1, 1, 2, 2, 2, false),   // 1x1 stride 2 (GEMM)
      conv_geometry(1, 4, 4, 1, 5, 5, 3, 1, 1, true),     // kernel larger than the image
      conv_geometry(1, 4, 4, 2, 5, 5, 3, 1, 1, true),     // the same through GEMM
      conv_geometry(4, 16, 16, 8, 3, 3, 5, 1, 1, true),   // threaded / large (GEMM)
      conv_geometry(4, 16, 16, 3, 3, 3, 40, 1, 1, true),  // threaded, cout > 32 (direct)
  };
  for_each_path([&] {
    for (DType dt : kFloatTypes)
      for (const auto& g : geoms) run_conv_case(g, dt);
  });
}

TEST_CASE("cpu conv2d with more channels, strides and odd sizes", "[conv]") {
  const std::vector<Conv2dGeometry> geoms = {
      conv_geometry(2, 28, 28, 1, 3, 3, 32, 1, 1, false),   // the MNIST CNN's first layer
      conv_geometry(2, 13, 13, 32, 3, 3, 64, 1, 1, false),  // and its second
      conv_geometry(2, 15, 17, 24, 3, 3, 40, 2, 2, true),   // stride 2, same, odd sizes
      conv_geometry(3, 9, 7, 17, 5, 3, 33, 2, 3, false),    // odd channels, mixed strides
      conv_geometry(2, 11, 13, 16, 3, 3, 16, 3, 3, true),   // stride 3, same
      conv_geometry(2, 10, 9, 20, 3, 3, 24, 2, 2, false),   // valid, stride 2: a row unread
      conv_geometry(2, 12, 10, 48, 7, 7, 20, 2, 2, true),   // 7x7 stride 2 (a stem)
      conv_geometry(2, 8, 8, 64, 1, 1, 128, 1, 1, false),   // pointwise, 64 -> 128
      conv_geometry(1, 5, 6, 65, 3, 3, 31, 1, 1, true),     // channel counts off the blocks
  };
  for_each_path([&] {
    for (DType dt : kFloatTypes)
      for (const auto& g : geoms) run_conv_case(g, dt);
  });
}

TEST_CASE("cpu conv2d processes large inputs in chunks of output rows", "[conv]") {
  // An output row's column entries are ~58 KB (float32), so the 4 MB column buffer takes
  // ~70 rows at a time: chunks end mid-image and the weight gradient accumulates.
  for_each_path([] {
    run_conv_case(conv_geometry(3, 100, 100, 16, 3, 3, 2, 1, 1, true), kFloat32);
    run_conv_case(conv_geometry(3, 100, 100, 16, 3, 3, 2, 1, 1, true), kBFloat16);
    run_conv_case(conv_geometry(2, 150, 150, 16, 3, 3, 2, 2, 2, true), kFloat64);
  });
}

TEST_CASE("cpu pooling forward and backward match naive loops", "[pool]") {
  const std::vector<Pool2dGeometry> geoms = {
      pool_geometry(2, 6, 6, 3, 2, 2, 2, 2, false),     // 2x2 / 2, valid
      pool_geometry(2, 7, 7, 3, 2, 2, 2, 2, true),      // odd size, same (pads bottom/right)
      pool_geometry(2, 7, 8, 5, 3, 3, 2, 2, true),      // 3x3 / 2, same
      pool_geometry(1, 6, 5, 1, 3, 3, 1, 1, true),      // 3x3 / 1, same (overlapping)
      pool_geometry(2, 8, 9, 2, 2, 3, 1, 2, false),     // kh != kw, mixed strides
      pool_geometry(4, 16, 16, 40, 3, 3, 1, 1, true),   // threaded
      pool_geometry(8, 26, 26, 32, 2, 2, 2, 2, false),  // the MNIST CNN's pools
      pool_geometry(8, 11, 11, 64, 2, 2, 2, 2, false),  // (odd size: last row dropped)
  };
  for_each_path([&] {
    for (DType dt : kFloatTypes)
      for (const auto& g : geoms) run_pool_case(g, dt, random({g.n, g.h, g.w, g.c}, dt));
  });
}

TEST_CASE("cpu bfloat16 conv2d and matmul on oneDNN round like the float32 path",
          "[conv][onednn]") {
  // Both paths accumulate in float32 and round each result once, so they differ only by
  // float32's summation order: at most one bfloat16 ulp per element, plus float32's error
  // on results that cancel to near 0 (1e-5 of the largest output). Rounding after partial
  // sums would show as several ulps on ordinary elements. Long reductions: the weight
  // gradient sums over n*oh*ow.
  if (!cpu::onednn_available()) return;
  const std::vector<Conv2dGeometry> geoms = {
      conv_geometry(16, 13, 13, 32, 3, 3, 64, 1, 1, false),  // the MNIST CNN's second layer
      conv_geometry(16, 28, 28, 1, 3, 3, 32, 1, 1, false),   // and its first
      conv_geometry(8, 15, 17, 24, 3, 3, 40, 2, 2, true),
  };
  auto compare = [](const Tensor& on, const Tensor& off, const char* what) {
    const auto a = values(on), b = values(off);
    double largest = 0.0;
    for (double v : b) largest = std::max(largest, std::abs(v));
    std::size_t bad = 0, first_bad = 0;
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double mag = std::max(std::abs(a[i]), std::abs(b[i]));
      const double ulp = mag > 0 ? std::ldexp(1.0, std::ilogb(mag) - 7) : 0.0;
      if (!(std::abs(a[i] - b[i]) <= ulp + 1e-5 * largest)) {
        if (bad++ == 0) first_bad = i;
      }
    }
    INFO(what << ": " << bad << " elements apart by more than one bfloat16 ulp; first at "
              << first_bad << ": " << a[first_bad] << " against " << b[first_bad]);
    CHECK(bad == 0);
  };
  const auto cpu = DeviceType::CPU;
  for (const auto& g : geoms) {
    const Tensor x = random({g.n, g.h, g.w, g.c}, kBFloat16);
    const Tensor w = random({g.kh, g.kw, g.c, g.cout}, kBFloat16);
    const Tensor gout = random({g.n, g.oh, g.ow, g.cout}, kBFloat16);
    std::vector<Tensor> outs[2];
    for (int on = 0; on < 2; ++on) {
      const cpu::OneDnnScope scope(on != 0);
      const Tensor out = empty_poisoned({g.n, g.oh, g.ow, g.cout}, kBFloat16);
      const Tensor gx = empty_poisoned({g.n, g.h, g.w, g.c}, kBFloat16);
      const Tensor gw = empty_poisoned({g.kh, g.kw, g.c, g.cout}, kBFloat16);
      find_kernel<kernels::Conv2dFn>(OpId::conv2d, cpu, kBFloat16)(x, w, Tensor(), out, g);
      find_kernel<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, cpu, kBFloat16)(
          gout, w, gx, g);
      find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight, cpu, kBFloat16)(
          x, gout, gw, g);
      outs[on] = {out, gx, gw};
    }
    INFO("conv n " << g.n << " h " << g.h << " c " << g.c << " cout " << g.cout);
    compare(outs[1][0], outs[0][0], "conv2d");
    compare(outs[1][1], outs[0][1], "conv2d_backward_input");
    compare(outs[1][2], outs[0][2], "conv2d_backward_weight");
  }
  // matmul: a long k (the MLP's weight gradient at batch 1024) and a square product.
  for (const GemmCase& cs : {GemmCase{1, 784, 512, 1024, true, false, 0, 0, 0, false, false},
                             GemmCase{1, 300, 200, 2048, false, true, 0, 0, 0, false, false}}) {
    const GemmArgs on = gemm_args(cs, kBFloat16), off = gemm_args(cs, kBFloat16);
    GemmArgs off_same = off;
    off_same.a = on.a, off_same.b = on.b;
    {
      const cpu::OneDnnScope scope(true);
      find_kernel<kernels::GemmFn>(OpId::matmul, cpu, kBFloat16)(on);
    }
    {
      const cpu::OneDnnScope scope(false);
      find_kernel<kernels::GemmFn>(OpId::matmul, cpu, kBFloat16)(off_same);
    }
    compare(on.out, off_same.out, "matmul");
  }
}

TEST_CASE("cpu bfloat16 pooling gradients sum in float32 and round once", "[pool]") {
  // Overlapping windows send several contributions to one input; each bfloat16 gradient
  // must be the float32 sum rounded once: within half a bfloat16 ulp of the exact sum (plus
  // float32's own error). Rounding after every contribution misses that by several ulps.
  const std::vector<Pool2dGeometry> geoms = {
      pool_geometry(4, 16, 16, 40, 3, 3, 1, 1, true),   // 3x3 / 1: up to 9 windows per input
      pool_geometry(2, 15, 13, 24, 3, 3, 2, 2, true),   // 3x3 / 2: up to 4
      pool_geometry(2, 12, 12, 32, 2, 2, 2, 2, false),  // no overlap
  };
  for_each_path([&] {
    for (const auto& g : geoms) {
      INFO("pool k " << g.kh << "x" << g.kw << " stride " << g.stride_h << "x" << g.stride_w);
      const Tensor x = random({g.n, g.h, g.w, g.c}, kBFloat16);
      const Tensor gout = random({g.n, g.oh, g.ow, g.c}, kBFloat16);
      const PoolRefs ref = pool_reference(values(x), values(gout), g);
      const auto cpu = DeviceType::CPU;
      for (const bool is_max : {true, false}) {
        INFO((is_max ? "max_pool2d_backward" : "avg_pool2d_backward"));
        const Tensor grad = empty_poisoned({g.n, g.h, g.w, g.c}, kBFloat16);
        find_kernel<kernels::Pool2dBackwardFn>(
            is_max ? OpId::max_pool2d_backward : OpId::avg_pool2d_backward, cpu, kBFloat16)(
            x, gout, grad, g);
        const auto got = values(grad);
        const auto& want = is_max ? ref.max_grad : ref.avg_grad;
        std::size_t bad = 0, first_bad = 0;
        for (std::size_t i = 0; i < got.size(); ++i) {
          const double mag = std::abs(want[i]);
          const double ulp = mag > 0 ? std::ldexp(1.0, std::ilogb(mag) - 7) : 0.0;
          if (!(std::abs(got[i] - want[i]) <= 0.5 * ulp * (1.0 + 1e-3) + 1e-6)) {
            if (bad++ == 0) first_bad = i;
          }
        }
        INFO("first at " << first_bad << ": got " << got[first_bad] << ", exact "
                         << want[first_bad]);
        CHECK(bad == 0);
      }
    }
  });
}

TEST_CASE("cpu max pool routes ties to the first maximum of the window", "[pool]") {
  for_each_path([] {
    for (DType dt : kFloatTypes) {
      const Pool2dGeometry g = pool_geometry(2, 5, 5, 3, 3, 3, 1, 1, true);
      run_pool_case(g, dt, full({g.n, g.h, g.w, g.c}, 0.5, dt));
      // Few distinct values: many ties between windows' candidates.
      Tensor coarse = random({g.n, g.h, g.w, g.c}, kFloat64, 0.0, 3.0);
      for (std::int64_t i = 0; i < coarse.numel(); ++i)
        coarse.data<double>()[i] = std::floor(coarse.data<double>()[i]);
      const auto cv = values(coarse);
      run_pool_case(g, dt, from_vector(cv, coarse.shape(), dt));
    }
  });
}

// Max pooling on random bit patterns (NaNs signalling and quiet, infinities, signed zeros,
// subnormals), bit for bit against the float32 definition: each window's output is its
// first maximum (a NaN beats any number) as a round trip through float32 gives it (NaNs
// come back quiet); where windows do not overlap, the input gradient is 0 + the window's
// gradient at that maximum and +0 everywhere else (also where no window reaches).
// The elements of t as H (a 16-bit float, or F32Bits below), whatever its dtype says.
template <typename H>
H* raw(const Tensor& t) {
  return static_cast<H*>(t.data_ptr());
}

template <typename H>
void check_max_pool_bits(DType dt) {
  struct Case {
    Pool2dGeometry g;
    bool overlap;
  };
  const std::vector<Case> cases = {
      {pool_geometry(2, 26, 26, 32, 2, 2, 2, 2, false), false},  // the MNIST CNN's first pool
      {pool_geometry(2, 11, 11, 19, 2, 2, 2, 2, false), false},  // odd sizes and channels
      {pool_geometry(1, 10, 11, 5, 2, 2, 3, 3, false), false},   // gaps between windows
      {pool_geometry(2, 7, 8, 16, 3, 3, 3, 3, true), false},     // windows cut by the padding
      {pool_geometry(1, 6, 5, 64, 3, 3, 1, 1, true), true},      // overlapping: forward only
  };
  using Bits = decltype(H{}.bits);
  std::mt19937_64 rng(2026);
  for (const Case& cs : cases) {
    const Pool2dGeometry& g = cs.g;
    INFO("pool h " << g.h << " w " << g.w << " c " << g.c << " k " << g.kh << " stride "
                   << g.stride_h);
    Tensor x = Tensor::empty({g.n, g.h, g.w, g.c}, dt),
           gout = Tensor::empty({g.n, g.oh, g.ow, g.c}, dt);
    for (std::int64_t i = 0; i < x.numel(); ++i)
      raw<H>(x)[i] = H::from_bits(static_cast<Bits>(rng()));
    for (std::int64_t i = 0; i < gout.numel(); ++i)
      raw<H>(gout)[i] = H::from_bits(static_cast<Bits>(rng()));
    // The reference: for each output element, the flat index of its window's winner.
    std::vector<std::int64_t> winner(static_cast<std::size_t>(gout.numel()), -1);
    for (std::int64_t i = 0; i < g.n; ++i)
      for (std::int64_t oy = 0; oy < g.oh; ++oy)
        for (std::int64_t ox = 0; ox < g.ow; ++ox)
          for (std::int64_t ch = 0; ch < g.c; ++ch) {
            std::int64_t best = -1;
            for (std::int64_t ky = 0; ky < g.kh; ++ky)
              for (std::int64_t kx = 0; kx < g.kw; ++kx) {
                const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
                const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
                if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                const std::int64_t at = ((i * g.h + iy) * g.w + ix) * g.c + ch;
                const float v = raw<H>(x)[at];
                const float b = best < 0 ? 0.0f : static_cast<float>(raw<H>(x)[best]);
                if (best < 0 || v > b || (std::isnan(v) && !std::isnan(b))) best = at;
              }
            winner[static_cast<std::size_t>(((i * g.oh + oy) * g.ow + ox) * g.c + ch)] = best;
          }
    for_each_path([&] {
      const auto cpu = DeviceType::CPU;
      const Tensor out = empty_poisoned({g.n, g.oh, g.ow, g.c}, dt);
      find_kernel<kernels::Pool2dFn>(OpId::max_pool2d, cpu, dt)(x, out, g);
      std::int64_t bad_out = 0, bad_grad = 0;
      std::vector<Bits> want_grad(static_cast<std::size_t>(x.numel()), H(0.0f).bits);
      for (std::size_t o = 0; o < winner.size(); ++o) {
        const H w = raw<H>(x)[winner[o]];
        if (raw<H>(out)[o].bits != H(static_cast<float>(w)).bits) ++bad_out;
        want_grad[static_cast<std::size_t>(winner[o])] =
            H(0.0f + static_cast<float>(raw<H>(gout)[o])).bits;
      }
      CHECK(bad_out == 0);
      if (cs.overlap) return;
      const Tensor gx = empty_poisoned({g.n, g.h, g.w, g.c}, dt);
      find_kernel<kernels::Pool2dBackwardFn>(OpId::max_pool2d_backward, cpu, dt)(x, gout, gx, g);
      for (std::int64_t i = 0; i < gx.numel(); ++i)
        if (raw<H>(gx)[i].bits != want_grad[static_cast<std::size_t>(i)]) ++bad_grad;
      CHECK(bad_grad == 0);
    });
  }
}

// float32 through the same reference: its bits pass unchanged (no round trip).
struct F32Bits {
  std::uint32_t bits = 0;
  F32Bits() = default;
  F32Bits(float f) : bits(std::bit_cast<std::uint32_t>(f)) {}  // NOLINT
  static F32Bits from_bits(std::uint32_t b) {
    F32Bits f;
    f.bits = b;
    return f;
  }
  operator float() const { return std::bit_cast<float>(bits); }  // NOLINT
};

TEST_CASE("cpu max pool on float16 / bfloat16 / float32 bit patterns, bit for bit", "[pool]") {
  check_max_pool_bits<half>(kFloat16);
  check_max_pool_bits<bfloat16>(kBFloat16);
  check_max_pool_bits<F32Bits>(kFloat32);
}

TEST_CASE("cpu max pool propagates NaN and keeps -inf on every path", "[pool]") {
  // 2x2 windows, stride 2, one channel: window 0 holds a NaN after a larger number, window
  // 1 two NaNs (the gradient goes to the first), window 2 only -inf, window 3 plain numbers.
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> xs = {5.0,  nan,  nan, nan, 1.0,  2.0,  3.0, 0.5,
                                  -inf, -inf, 4.0, 7.0, -inf, -inf, 6.0, 7.0};
  const Pool2dGeometry g = pool_geometry(1, 4, 4, 1, 2, 2, 2, 2, false);
  for_each_path([&] {
    for (DType dt : {kFloat32, kBFloat16, kFloat16, kFloat64}) {
      INFO("dtype " << std::string(dt.name()));
      const Tensor x = from_vector(xs, Shape{1, 4, 4, 1}, dt);
      const Tensor out = empty_poisoned({1, 2, 2, 1}, dt);
      const Tensor gout =
          from_vector(std::vector<double>{1.0, 2.0, 3.0, 4.0}, Shape{1, 2, 2, 1}, dt);
      const Tensor gx = empty_poisoned({1, 4, 4, 1}, dt);
      const auto cpu = DeviceType::CPU;
      find_kernel<kernels::Pool2dFn>(OpId::max_pool2d, cpu, dt)(x, out, g);
      find_kernel<kernels::Pool2dBackwardFn>(OpId::max_pool2d_backward, cpu, dt)(x, gout, gx, g);
      const auto o = values(out), d = values(gx);
      CHECK(std::isnan(o[0]));  // windows: [5, nan; 1, 2], [nan, nan; 3, 0.5]
      CHECK(std::isnan(o[1]));
      CHECK(o[2] == -inf);  // [-inf, -inf; -inf, -inf]
      CHECK(o[3] == 7.0);   // [4, 7; 6, 7]: the first 7
      CHECK(d == std::vector<double>{0, 1, 2, 0, 0, 0, 0, 0, 3, 0, 0, 4, 0, 0, 0, 0});
    }
  });
}

TEST_CASE(
    "cpu oneDNN hooks take float32 / bfloat16 / float16 conv and pooling, bfloat16 matmul, and "
    "nothing else",
    "[conv][onednn]") {
  if (!cpu::onednn_available()) {
    CHECK_FALSE(cpu::onednn_enabled());
    return;
  }
  const Conv2dGeometry g = conv_geometry(2, 13, 13, 32, 3, 3, 64, 1, 1, false);
  const Pool2dGeometry pg = pool_geometry(2, 26, 26, 32, 2, 2, 2, 2, false);
  for (DType dt : kFloatTypes) {
    INFO("dtype " << std::string(dt.name()));
    const Tensor x = random({g.n, g.h, g.w, g.c}, dt), w = random({g.kh, g.kw, g.c, g.cout}, dt);
    const Tensor y = random({g.n, g.oh, g.ow, g.cout}, dt);
    const Tensor gx = empty_poisoned({g.n, g.h, g.w, g.c}, dt);
    const Tensor gw = empty_poisoned({g.kh, g.kw, g.c, g.cout}, dt);
    const Tensor px = random({pg.n, pg.h, pg.w, pg.c}, dt);
    const Tensor py = random({pg.n, pg.oh, pg.ow, pg.c}, dt);
    const Tensor pgx = empty_poisoned({pg.n, pg.h, pg.w, pg.c}, dt);
    const bool takes = dt == kFloat32 || dt == kBFloat16;
    // float16 through float32 primitives (converted around them)
    const bool conv_takes = takes || dt == kFloat16;
    {
      const cpu::OneDnnScope on(true);
      CHECK(cpu::onednn_conv2d(x, w, Tensor(), y, g) == conv_takes);
      CHECK(cpu::onednn_conv2d(x, w, random({g.cout}, dt), y, g) == conv_takes);  // with a bias
      CHECK(cpu::onednn_conv2d_backward_input(y, w, gx, g) == conv_takes);
      CHECK(cpu::onednn_conv2d_backward_weight(x, y, gw, g) == conv_takes);
      // bfloat16 pooling: oneDNN has it for AVX-512 CPUs only (elsewhere a reference
      // implementation, which the hooks decline), so it is not checked here.
      if (dt != kBFloat16) {
        CHECK(cpu::onednn_max_pool2d_backward(px, py, pgx, pg) == conv_takes);
        CHECK(cpu::onednn_avg_pool2d(px, py, pg) == conv_takes);
        CHECK(cpu::onednn_avg_pool2d_backward(py, pgx, pg) == conv_takes);
      }
      Conv2dGeometry acc16 = g;  // the 16-bit accumulation emulation stays on conv.cpp
      acc16.low_precision_accumulation = true;
      CHECK(cpu::onednn_conv2d(x, w, Tensor(), y, acc16) == (dt == kFloat32));
    }
    if (dt == kFloat32) {  // measured faster on conv.cpp: the input gradient of c <= 4
      const cpu::OneDnnScope on(true);
      const Conv2dGeometry g1 = conv_geometry(2, 13, 13, 1, 3, 3, 32, 1, 1, false);
      const Tensor y1 = random({g1.n, g1.oh, g1.ow, g1.cout}, dt);
      const Tensor w1 = random({g1.kh, g1.kw, g1.c, g1.cout}, dt);
      const Tensor gx1 = empty_poisoned({g1.n, g1.h, g1.w, g1.c}, dt);
      CHECK_FALSE(cpu::onednn_conv2d_backward_input(y1, w1, gx1, g1));
    }
    {  // matmul: bfloat16 only, and only where the CPU multiplies it natively
      const cpu::OneDnnScope on(true);
      cpu::GemmShape mg;
      mg.m = 17, mg.n = 33, mg.k = 65, mg.lda = 65, mg.ldb = 33, mg.ldc = 33;
      const Tensor a = random({17, 65}, dt), b = random({65, 33}, dt);
      const Tensor c = empty_poisoned({17, 33}, dt);
      if (dt == kBFloat16)
        CHECK(cpu::onednn_matmul_bf16(mg, a.data_ptr(), b.data_ptr(), c.data_ptr()) ==
              cpu::onednn_native_bf16());
      const cpu::OneDnnScope off(false);
      CHECK_FALSE(cpu::onednn_matmul_bf16(mg, a.data_ptr(), b.data_ptr(), c.data_ptr()));
    }
    const cpu::OneDnnScope off(false);
    CHECK_FALSE(cpu::onednn_conv2d(x, w, Tensor(), y, g));
    CHECK_FALSE(cpu::onednn_conv2d_backward_input(y, w, gx, g));
    CHECK_FALSE(cpu::onednn_conv2d_backward_weight(x, y, gw, g));
    CHECK_FALSE(cpu::onednn_max_pool2d_backward(px, py, pgx, pg));
    CHECK_FALSE(cpu::onednn_avg_pool2d_backward(py, pgx, pg));
  }
}

TEST_CASE("cpu conv2d from several threads at once gives the single-threaded results", "[conv]") {
  // Threads share the kernels' cached primitives (oneDNN) and have their own scratch.
  const std::vector<Conv2dGeometry> geoms = {
      conv_geometry(4, 13, 13, 32, 3, 3, 64, 1, 1, false),
      conv_geometry(4, 15, 17, 24, 3, 3, 40, 2, 2, true),
      conv_geometry(4, 28, 28, 1, 3, 3, 32, 1, 1, false),
  };
  for_each_path([&] {
    for (DType dt : {kFloat32, kBFloat16}) {
      INFO("dtype " << std::string(dt.name()));
      const auto cpu = DeviceType::CPU;
      const auto fwd = find_kernel<kernels::Conv2dFn>(OpId::conv2d, cpu, dt);
      const auto bwd_w =
          find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight, cpu, dt);
      std::vector<Tensor> xs, ws, ys;
      std::vector<std::vector<double>> want_out, want_gw;
      for (const auto& g : geoms) {
        xs.push_back(random({g.n, g.h, g.w, g.c}, dt));
        ws.push_back(random({g.kh, g.kw, g.c, g.cout}, dt));
        ys.push_back(random({g.n, g.oh, g.ow, g.cout}, dt));
        const Tensor out = Tensor::empty({g.n, g.oh, g.ow, g.cout}, dt);
        const Tensor gw = Tensor::empty({g.kh, g.kw, g.c, g.cout}, dt);
        fwd(xs.back(), ws.back(), Tensor(), out, g);
        bwd_w(xs.back(), ys.back(), gw, g);
        want_out.push_back(values(out));
        want_gw.push_back(values(gw));
      }
      // Results per (thread, round, geometry), checked on this thread (Catch2's assertions
      // are not thread-safe).
      constexpr int kThreads = 4, kRounds = 3;
      const std::size_t per_thread = kRounds * geoms.size();
      std::vector<std::vector<double>> got_out(kThreads * per_thread), got_gw(got_out.size());
      std::vector<std::thread> threads;
      for (int t = 0; t < kThreads; ++t)
        threads.emplace_back([&, t] {
          for (int r = 0; r < kRounds; ++r)
            for (std::size_t i = 0; i < geoms.size(); ++i) {
              const std::size_t k = (i + static_cast<std::size_t>(t)) % geoms.size();
              const Conv2dGeometry& g = geoms[k];
              const Tensor out = Tensor::empty({g.n, g.oh, g.ow, g.cout}, dt);
              const Tensor gw = Tensor::empty({g.kh, g.kw, g.c, g.cout}, dt);
              fwd(xs[k], ws[k], Tensor(), out, g);
              bwd_w(xs[k], ys[k], gw, g);
              const std::size_t at = static_cast<std::size_t>(t) * per_thread +
                                     static_cast<std::size_t>(r) * geoms.size() + k;
              got_out[at] = values(out);
              got_gw[at] = values(gw);
            }
        });
      for (auto& th : threads) th.join();
      for (std::size_t at = 0; at < got_out.size(); ++at) {
        check_close(got_out[at], want_out[at % geoms.size()], dt, "conv2d (threads)");
        check_close(got_gw[at], want_gw[at % geoms.size()], dt, "conv2d_backward_weight (threads)");
      }
    }
  });
}
