// The MIXTAPE_FP16_USE_FP32_COMPUTE switch (mixtape/core/compute_mode.h): its API, what
// it does to float16 / bfloat16 matmul and conv2d (and their gradients), and the CPU
// kernels that emulate 16-bit accumulation, checked bit-exactly against naive loops that
// accumulate through the mixtape::half / mixtape::bfloat16 scalar types.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "kernel_cases.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"

using namespace mixtape;
using kernels::Conv2dGeometry;
using kernels::GemmArgs;
using mtest::gemm_args;
using mtest::GemmCase;
using mtest::random;

namespace {

// --- 16-bit reference arithmetic ---------------------------------------------------------

// One accumulation step as the switch-off kernels define it: the product and the sum in
// float32, then the sum rounded to S (nearest even) by S's constructor.
template <typename S>
S step(S acc, float a, float b) {
  const float product = a * b;
  return S(static_cast<float>(acc) + product);
}

template <typename S>
std::vector<float> as_floats(const Tensor& t) {
  const S* p = t.data<S>();
  std::vector<float> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

// Counts elements of `got` whose bits differ from `want` (the element indices `at`),
// reporting the first.
template <typename S>
void check_bits(const Tensor& got, const std::vector<std::int64_t>& at, const std::vector<S>& want,
                const std::string& what) {
  REQUIRE(at.size() == want.size());
  const S* g = got.data<S>();
  std::size_t bad = 0, first = 0;
  for (std::size_t j = 0; j < at.size(); ++j) {
    if (g[at[j]].bits != want[j].bits) {
      if (bad == 0) first = j;
      ++bad;
    }
  }
  INFO(what << " (" << std::string(dtype_of<S>::value.name()) << "): " << bad << " of " << at.size()
            << " elements differ"
            << (bad ? "; first at element " + std::to_string(at[first]) + ": got " +
                          std::to_string(static_cast<float>(g[at[first]])) + ", want " +
                          std::to_string(static_cast<float>(want[first]))
                    : std::string()));
  CHECK(bad == 0);
}

// All indices of a contiguous tensor.
std::vector<std::int64_t> all_indices(const Tensor& t) {
  std::vector<std::int64_t> at(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < at.size(); ++i) at[i] = static_cast<std::int64_t>(i);
  return at;
}

// --- matmul ------------------------------------------------------------------------------

// Runs the matmul kernel with low_precision_accumulation on random operands laid out as
// the case says, and checks every output element against a sequential k loop rounded
// to S after each term; the leading-dimension gaps of C must stay untouched.
template <typename S>
void run_gemm_acc16_case(const GemmCase& cs, double lo = -1.0, double hi = 1.0) {
  constexpr DType dt = dtype_of<S>::value;
  GemmArgs g = gemm_args(cs, dt, lo, hi);
  g.low_precision_accumulation = true;

  find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, dt)(g);

  const auto a = as_floats<S>(g.a), b = as_floats<S>(g.b);
  std::vector<std::int64_t> at;
  std::vector<S> want;
  std::size_t pad_written = 0;
  const S* c = g.out.data<S>();
  for (std::int64_t bi = 0; bi < cs.batch; ++bi)
    for (std::int64_t i = 0; i < cs.m; ++i)
      for (std::int64_t j = 0; j < g.ldc; ++j) {
        const std::int64_t ic = bi * g.stride_c + i * g.ldc + j;
        if (j >= cs.n) {
          if (!std::isnan(static_cast<float>(c[ic]))) ++pad_written;
          continue;
        }
        S acc(0.0f);
        for (std::int64_t p = 0; p < cs.k; ++p) {
          const std::int64_t ia = bi * g.stride_a + (cs.ta ? p * g.lda + i : i * g.lda + p);
          const std::int64_t ib = bi * g.stride_b + (cs.tb ? j * g.ldb + p : p * g.ldb + j);
          acc = step(acc, a[static_cast<std::size_t>(ia)], b[static_cast<std::size_t>(ib)]);
        }
        at.push_back(ic);
        want.push_back(acc);
      }
  INFO("batch " << cs.batch << " m " << cs.m << " n " << cs.n << " k " << cs.k << " ta " << cs.ta
                << " tb " << cs.tb << " pads " << cs.pad_a << "," << cs.pad_b << "," << cs.pad_c
                << " share_a " << cs.share_a << " share_b " << cs.share_b);
  CHECK(pad_written == 0);
  check_bits<S>(g.out, at, want, "matmul (16-bit accumulation)");
}

// A naive 16-bit-accumulating matmul of 2-D tensors (row-major, contiguous), for the
// gradient checks: out[i, j] accumulates a[i, p] * b[p, j] for p = 0, 1, ... in S.
template <typename S>
std::vector<S> matmul16(const std::vector<float>& a, const std::vector<float>& b, std::int64_t m,
                        std::int64_t k, std::int64_t n) {
  std::vector<S> out(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      S acc(0.0f);
      for (std::int64_t p = 0; p < k; ++p)
        acc = step(acc, a[static_cast<std::size_t>(i * k + p)],
                   b[static_cast<std::size_t>(p * n + j)]);
      out[static_cast<std::size_t>(i * n + j)] = acc;
    }
  return out;
}

// rows x cols -> cols x rows.
std::vector<float> transposed(const std::vector<float>& v, std::int64_t rows, std::int64_t cols) {
  std::vector<float> t(v.size());
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c)
      t[static_cast<std::size_t>(c * rows + r)] = v[static_cast<std::size_t>(r * cols + c)];
  return t;
}

// --- conv2d ------------------------------------------------------------------------------

Conv2dGeometry acc16_geometry(std::int64_t n, std::int64_t h, std::int64_t w, std::int64_t c,
                              std::int64_t kh, std::int64_t kw, std::int64_t cout, std::int64_t sh,
                              std::int64_t sw, bool same) {
  Conv2dGeometry g = mtest::conv_geometry(n, h, w, c, kh, kw, cout, sh, sw, same);
  g.low_precision_accumulation = true;
  return g;
}

template <typename S>
struct Conv16Refs {
  std::vector<S> out, grad_x, grad_w;
};

// The three conv products accumulated in S, each element's terms in the order the CPU
// kernels document (backends/cpu/conv.cpp, "16-bit accumulation"); taps over the
// padding contribute nothing and are skipped:
//   out[i, oy, ox, co]  over (ky, kx, ci) row-major;
//   dw[ky, kx, ci, co]  over output pixels (i, oy, ox) row-major;
//   dx[i, iy, ix, ci]   over oy ascending, then kx ascending, then co ascending.
template <typename S>
Conv16Refs<S> conv16_reference(const std::vector<float>& x, const std::vector<float>& w,
                               const std::vector<float>& gout, const Conv2dGeometry& g) {
  auto xi = [&](std::int64_t i, std::int64_t iy, std::int64_t ix, std::int64_t ci) {
    return static_cast<std::size_t>(((i * g.h + iy) * g.w + ix) * g.c + ci);
  };
  auto wi = [&](std::int64_t ky, std::int64_t kx, std::int64_t ci, std::int64_t co) {
    return static_cast<std::size_t>(((ky * g.kw + kx) * g.c + ci) * g.cout + co);
  };
  auto oi = [&](std::int64_t i, std::int64_t oy, std::int64_t ox, std::int64_t co) {
    return static_cast<std::size_t>(((i * g.oh + oy) * g.ow + ox) * g.cout + co);
  };
  Conv16Refs<S> r;
  r.out.resize(static_cast<std::size_t>(g.n * g.oh * g.ow * g.cout));
  r.grad_x.resize(x.size());
  r.grad_w.resize(w.size());
  for (std::int64_t i = 0; i < g.n; ++i)
    for (std::int64_t oy = 0; oy < g.oh; ++oy)
      for (std::int64_t ox = 0; ox < g.ow; ++ox)
        for (std::int64_t co = 0; co < g.cout; ++co) {
          S acc(0.0f);
          for (std::int64_t ky = 0; ky < g.kh; ++ky)
            for (std::int64_t kx = 0; kx < g.kw; ++kx) {
              const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
              const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
              if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
              for (std::int64_t ci = 0; ci < g.c; ++ci)
                acc = step(acc, x[xi(i, iy, ix, ci)], w[wi(ky, kx, ci, co)]);
            }
          r.out[oi(i, oy, ox, co)] = acc;
        }
  for (std::int64_t ky = 0; ky < g.kh; ++ky)
    for (std::int64_t kx = 0; kx < g.kw; ++kx)
      for (std::int64_t ci = 0; ci < g.c; ++ci)
        for (std::int64_t co = 0; co < g.cout; ++co) {
          S acc(0.0f);
          for (std::int64_t i = 0; i < g.n; ++i)
            for (std::int64_t oy = 0; oy < g.oh; ++oy)
              for (std::int64_t ox = 0; ox < g.ow; ++ox) {
                const std::int64_t iy = oy * g.stride_h - g.pad_top + ky;
                const std::int64_t ix = ox * g.stride_w - g.pad_left + kx;
                if (iy < 0 || iy >= g.h || ix < 0 || ix >= g.w) continue;
                acc = step(acc, x[xi(i, iy, ix, ci)], gout[oi(i, oy, ox, co)]);
              }
          r.grad_w[wi(ky, kx, ci, co)] = acc;
        }
  for (std::int64_t i = 0; i < g.n; ++i)
    for (std::int64_t iy = 0; iy < g.h; ++iy)
      for (std::int64_t ix = 0; ix < g.w; ++ix)
        for (std::int64_t ci = 0; ci < g.c; ++ci) {
          S acc(0.0f);
          for (std::int64_t oy = 0; oy < g.oh; ++oy) {
            const std::int64_t ky = iy + g.pad_top - oy * g.stride_h;
            if (ky < 0 || ky >= g.kh) continue;
            for (std::int64_t kx = 0; kx < g.kw; ++kx) {
              const std::int64_t t = ix + g.pad_left - kx;
              if (t < 0 || t % g.stride_w != 0 || t / g.stride_w >= g.ow) continue;
              const std::int64_t ox = t / g.stride_w;
              for (std::int64_t co = 0; co < g.cout; ++co)
                acc = step(acc, gout[oi(i, oy, ox, co)], w[wi(ky, kx, ci, co)]);
            }
          }
          r.grad_x[xi(i, iy, ix, ci)] = acc;
        }
  return r;
}

template <typename S>
void run_conv_acc16_case(const Conv2dGeometry& g) {
  constexpr DType dt = dtype_of<S>::value;
  INFO("conv n " << g.n << " h " << g.h << " w " << g.w << " c " << g.c << " k " << g.kh << "x"
                 << g.kw << " cout " << g.cout << " stride " << g.stride_h << "x" << g.stride_w
                 << " pad " << g.pad_top << "," << g.pad_left << " out " << g.oh << "x" << g.ow);
  const Tensor x = random({g.n, g.h, g.w, g.c}, dt);
  const Tensor w = random({g.kh, g.kw, g.c, g.cout}, dt);
  const Tensor gout = random({g.n, g.oh, g.ow, g.cout}, dt);
  const Tensor out = mtest::empty_poisoned({g.n, g.oh, g.ow, g.cout}, dtype_of<S>::value);
  const Tensor gx = mtest::empty_poisoned({g.n, g.h, g.w, g.c}, dtype_of<S>::value);
  const Tensor gw = mtest::empty_poisoned({g.kh, g.kw, g.c, g.cout}, dtype_of<S>::value);
  const auto cpu = DeviceType::CPU;
  find_kernel<kernels::Conv2dFn>(OpId::conv2d, cpu, dt)(x, w, Tensor(), out, g);
  find_kernel<kernels::Conv2dBackwardInputFn>(OpId::conv2d_backward_input, cpu, dt)(gout, w, gx, g);
  find_kernel<kernels::Conv2dBackwardWeightFn>(OpId::conv2d_backward_weight, cpu, dt)(x, gout, gw,
                                                                                      g);
  const auto ref = conv16_reference<S>(as_floats<S>(x), as_floats<S>(w), as_floats<S>(gout), g);
  check_bits<S>(out, all_indices(out), ref.out, "conv2d (16-bit accumulation)");
  check_bits<S>(gx, all_indices(gx), ref.grad_x, "conv2d_backward_input (16-bit accumulation)");
  check_bits<S>(gw, all_indices(gw), ref.grad_w, "conv2d_backward_weight (16-bit accumulation)");
}

// The geometries of tests/test_cpu_gemm_conv.cpp (same / valid, strides, c = 1, windows
// larger than the image, pointwise) plus threaded sizes.
std::vector<Conv2dGeometry> conv_geometries() {
  return {
      acc16_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, true),      // same, stride 1
      acc16_geometry(2, 7, 6, 6, 3, 3, 4, 1, 1, true),      // same, more channels
      acc16_geometry(2, 7, 6, 3, 3, 3, 4, 1, 1, false),     // valid
      acc16_geometry(2, 7, 6, 7, 3, 3, 3, 1, 1, false),     // valid, more channels
      acc16_geometry(1, 9, 8, 1, 3, 2, 3, 2, 2, true),      // c = 1, kh != kw, stride 2, same
      acc16_geometry(2, 13, 11, 1, 8, 7, 3, 2, 2, true),    // c = 1, big window, stride 2
      acc16_geometry(2, 9, 10, 2, 2, 3, 3, 2, 1, false),    // mixed strides, valid
      acc16_geometry(2, 9, 10, 9, 2, 3, 3, 2, 1, false),    // mixed strides, more channels
      acc16_geometry(3, 5, 5, 50, 1, 1, 3, 1, 1, false),    // pointwise
      acc16_geometry(2, 6, 7, 49, 1, 1, 2, 2, 2, false),    // 1x1 stride 2
      acc16_geometry(1, 4, 4, 2, 5, 5, 3, 1, 1, true),      // kernel larger than the image
      acc16_geometry(2, 9, 9, 3, 3, 3, 2, 3, 3, true),      // stride = window (no overlap)
      acc16_geometry(4, 16, 16, 8, 3, 3, 5, 1, 1, true),    // threaded
      acc16_geometry(4, 16, 16, 3, 3, 3, 40, 1, 1, true),   // threaded, cout > 32
      acc16_geometry(2, 12, 12, 16, 5, 5, 24, 2, 2, true),  // threaded, 400 taps, stride 2
  };
}

}  // namespace

// --- The switch --------------------------------------------------------------------------

TEST_CASE("fp16_use_fp32_compute: set, scope guard and environment value", "[compute_mode]") {
  // Nothing has overridden the switch yet (other tests restore it): it is the environment's.
  const bool initial = fp16_use_fp32_compute();
  CHECK(initial == detail::parse_fp16_use_fp32_compute(std::getenv(kFp16UseFp32ComputeEnv)));

  set_fp16_use_fp32_compute(false);
  CHECK_FALSE(fp16_use_fp32_compute());
  set_fp16_use_fp32_compute(true);
  CHECK(fp16_use_fp32_compute());

  {
    Fp16UseFp32ComputeScope off(false);
    CHECK_FALSE(fp16_use_fp32_compute());
    {
      Fp16UseFp32ComputeScope on(true);
      CHECK(fp16_use_fp32_compute());
    }
    CHECK_FALSE(fp16_use_fp32_compute());
  }
  CHECK(fp16_use_fp32_compute());
  set_fp16_use_fp32_compute(initial);
  CHECK(fp16_use_fp32_compute() == initial);

  static_assert(!std::is_copy_constructible_v<Fp16UseFp32ComputeScope>);
  static_assert(!std::is_copy_assignable_v<Fp16UseFp32ComputeScope>);
}

TEST_CASE("MIXTAPE_FP16_USE_FP32_COMPUTE values: unset or 1 on, 0 off, others rejected",
          "[compute_mode]") {
  CHECK(detail::parse_fp16_use_fp32_compute(nullptr));
  CHECK(detail::parse_fp16_use_fp32_compute("1"));
  CHECK_FALSE(detail::parse_fp16_use_fp32_compute("0"));
  for (const char* bad : {"", "2", "true", "false", "on", " 1", "0 ", "01", "yes"}) {
    INFO("value '" << bad << "'");
    CHECK_THROWS_AS(detail::parse_fp16_use_fp32_compute(bad), ValueError);
    try {
      detail::parse_fp16_use_fp32_compute(bad);
    } catch (const ValueError& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find("MIXTAPE_FP16_USE_FP32_COMPUTE") != std::string::npos);
      CHECK(msg.find("'" + std::string(bad) + "'") != std::string::npos);
      CHECK(msg.find("\"0\"") != std::string::npos);
      CHECK(msg.find("\"1\"") != std::string::npos);
    }
  }
}

TEST_CASE("gemm_accumulation_dtype for every dtype, switch on and off", "[compute_mode]") {
  for (bool on : {true, false}) {
    Fp16UseFp32ComputeScope scope(on);
    INFO("switch " << on);
    for (int i = 0; i < DType::kCount; ++i) {
      const DType dt = DType::all()[i];
      INFO("dtype " << std::string(dt.name()));
      DType want = dt;
      if (dt == kFloat16 || dt == kBFloat16) want = on ? kFloat32 : dt;
      CHECK(gemm_accumulation_dtype(dt) == want);
    }
  }
  CHECK(gemm_accumulation_dtype(kFloat32) == kFloat32);
  CHECK(gemm_accumulation_dtype(kFloat64) == kFloat64);
  CHECK(gemm_accumulation_dtype(kInt32) == kInt32);
  CHECK(gemm_accumulation_dtype(kBool) == kBool);
}

// --- Summing ones: 16-bit accumulation stops where +1 rounds away -------------------------

TEST_CASE("matmul sums 4096 ones to 4096 with fp32 compute, 2048 (fp16) / 256 (bf16) without",
          "[compute_mode][gemm]") {
  struct Want {
    DType dt;
    double on, off;
  };
  for (const Want& c : {Want{kFloat16, 4096, 2048}, Want{kBFloat16, 4096, 256},
                        Want{kFloat32, 4096, 4096}, Want{kFloat64, 4096, 4096}}) {
    INFO("dtype " << std::string(c.dt.name()));
    const Tensor a = ones({1, 4096}, c.dt), b = ones({4096, 1}, c.dt);
    {
      Fp16UseFp32ComputeScope scope(true);
      CHECK(matmul(a, b).item<double>() == c.on);
    }
    {
      Fp16UseFp32ComputeScope scope(false);
      CHECK(matmul(a, b).item<double>() == c.off);
      // Batched, and through a transposed view (a trans_a GEMM).
      const Tensor batched = matmul(ones({3, 1, 4096}, c.dt), ones({3, 4096, 2}, c.dt));
      CHECK(batched.to_vector<double>() == std::vector<double>(6, c.off));
      CHECK(matmul(transpose(b), b).item<double>() == c.off);
    }
  }
}

TEST_CASE("conv2d sums 4096 ones to 4096 with fp32 compute, 2048 (fp16) / 256 (bf16) without",
          "[compute_mode][conv]") {
  for (DType dt : {kFloat16, kBFloat16}) {
    INFO("dtype " << std::string(dt.name()));
    const double capped = dt == kFloat16 ? 2048 : 256;
    // A 1x1 conv over 4096 channels, and a 64x64 window over a 64x64 one-channel image.
    const Tensor x1 = ones({1, 2, 2, 4096}, dt), w1 = ones({1, 1, 4096, 3}, dt);
    const Tensor x2 = ones({1, 64, 64, 1}, dt), w2 = ones({64, 64, 1, 1}, dt);
    {
      Fp16UseFp32ComputeScope scope(true);
      CHECK(conv2d(x1, w1).to_vector<double>() == std::vector<double>(12, 4096));
      CHECK(conv2d(x2, w2).item<double>() == 4096);
    }
    {
      Fp16UseFp32ComputeScope scope(false);
      CHECK(conv2d(x1, w1).to_vector<double>() == std::vector<double>(12, capped));
      CHECK(conv2d(x2, w2).item<double>() == capped);
      // 'same' padding: the centre output sees the whole image, the corner a quarter.
      const auto same = conv2d(x2, w2, {1, 1}, Padding::Same).to_vector<double>();
      CHECK(same[32 * 64 + 32] == capped);
      CHECK(same[0] == (dt == kFloat16 ? 33 * 33 : 256));  // 1089 ones: exact in float16
    }
  }
}

TEST_CASE("conv2d decides the accumulation at forward time and its gradients follow",
          "[compute_mode][conv][autograd]") {
  // 1x1 convs over ones, differentiated with a seed of ones: the weight gradient of a
  // 64x64 one-channel image sums 4096 pixels, the input gradient of a conv to 4096
  // output channels sums 4096 channels.
  for (DType dt : {kFloat16, kBFloat16}) {
    INFO("dtype " << std::string(dt.name()));
    const double capped = dt == kFloat16 ? 2048 : 256;
    for (bool on : {true, false}) {
      INFO("switch " << on << " at forward time, the opposite at backward time");
      const Tensor xa = ones({1, 64, 64, 1}, dt), wa = ones({1, 1, 1, 2}, dt);
      const Tensor xb = ones({1, 1, 1, 1}, dt), wb = ones({1, 1, 1, 4096}, dt);
      GradientTape tape_a, tape_b;
      tape_a.watch(std::vector<Tensor>{xa, wa});
      tape_b.watch(std::vector<Tensor>{xb, wb});
      Tensor ya, yb;
      {
        Fp16UseFp32ComputeScope scope(on);
        ya = conv2d(xa, wa);
        yb = conv2d(xb, wb);
      }
      Fp16UseFp32ComputeScope flipped(!on);
      const double want = on ? 4096 : capped;
      const auto ga = tape_a.gradient(ya, std::vector<Tensor>{xa, wa}, ones_like(ya));
      CHECK(ga[0].to_vector<double>() == std::vector<double>(64 * 64, 2));  // 2 channels
      CHECK(ga[1].to_vector<double>() == std::vector<double>(2, want));
      const auto gb = tape_b.gradient(yb, std::vector<Tensor>{xb, wb}, ones_like(yb));
      CHECK(gb[0].item<double>() == want);
      CHECK(gb[1].to_vector<double>() == std::vector<double>(4096, 1));
    }
  }
}

TEST_CASE("matmul decides the accumulation at forward time and its gradients follow",
          "[compute_mode][gemm][autograd]") {
  // [1 x 4096] x [4096 x 1] of ones with a seed of ones: each backward product is an outer
  // product (k = 1), so check instead a = [4096 x 1] ones, b = [1 x 1]: da = g b^T (k = 1)
  // and db = a^T g sums 4096 ones.
  for (DType dt : {kFloat16, kBFloat16}) {
    INFO("dtype " << std::string(dt.name()));
    const double capped = dt == kFloat16 ? 2048 : 256;
    for (bool on : {true, false}) {
      INFO("switch " << on << " at forward time, the opposite at backward time");
      const Tensor a = ones({4096, 1}, dt), b = ones({1, 1}, dt);
      GradientTape tape;
      tape.watch(std::vector<Tensor>{a, b});
      Tensor y;
      {
        Fp16UseFp32ComputeScope scope(on);
        y = matmul(a, b);
      }
      Fp16UseFp32ComputeScope flipped(!on);
      const auto g = tape.gradient(y, std::vector<Tensor>{a, b}, ones_like(y));
      CHECK(g[0].to_vector<double>() == std::vector<double>(4096, 1));
      CHECK(g[1].item<double>() == (on ? 4096 : capped));
    }
  }
}

// --- The emulated kernels against naive 16-bit loops -------------------------------------

TEMPLATE_TEST_CASE("16-bit accumulating matmul kernel matches a sequential 16-bit loop",
                   "[compute_mode][gemm]", half, bfloat16) {
  const std::vector<std::vector<std::int64_t>> sizes = {{1, 1, 1},    {3, 17, 5},  {17, 3, 65},
                                                        {65, 17, 3},  {1, 65, 17}, {17, 1, 3},
                                                        {64, 65, 33}, {5, 7, 300}};
  for (const auto& s : sizes)
    for (int t = 0; t < 4; ++t)
      run_gemm_acc16_case<TestType>(
          {1, s[0], s[1], s[2], (t & 1) != 0, (t & 2) != 0, 0, 0, 0, false, false});
}

TEMPLATE_TEST_CASE(
    "16-bit accumulating matmul kernel honours leading dimensions and batch "
    "strides",
    "[compute_mode][gemm]", half, bfloat16) {
  for (int t = 0; t < 4; ++t) {
    const bool ta = (t & 1) != 0, tb = (t & 2) != 0;
    run_gemm_acc16_case<TestType>({3, 17, 5, 65, ta, tb, 3, 1, 2, false, false});  // padded ld
    run_gemm_acc16_case<TestType>({4, 5, 17, 3, ta, tb, 0, 0, 0, true, false});    // shared A
    run_gemm_acc16_case<TestType>({4, 17, 3, 5, ta, tb, 0, 0, 0, false, true});    // shared B
    run_gemm_acc16_case<TestType>({3, 17, 3, 5, ta, tb, 2, 0, 1, false, true});    // + padded
    run_gemm_acc16_case<TestType>({2, 3, 5, 17, ta, tb, 0, 0, 0, true, true});     // both shared
    run_gemm_acc16_case<TestType>({5, 1, 1, 17, ta, tb, 0, 0, 0, false, false});   // dots
    run_gemm_acc16_case<TestType>({2, 6, 9, 40, ta, tb, 5, 3, 4, false, false});   // all padded
  }
}

TEMPLATE_TEST_CASE(
    "16-bit accumulating matmul kernel on a threaded size differs from fp32 "
    "accumulation",
    "[compute_mode][gemm]", half, bfloat16) {
  run_gemm_acc16_case<TestType>({1, 130, 257, 200, false, true, 0, 0, 0, false, false});
  run_gemm_acc16_case<TestType>({2, 70, 33, 129, true, false, 1, 0, 3, false, false});
  // Positive terms: the running sums grow past where 16-bit rounding is coarse, so the two
  // modes must disagree somewhere.
  constexpr DType dt = dtype_of<TestType>::value;
  const Tensor a = random({64, 512}, dt, 0.0, 1.0), b = random({512, 48}, dt, 0.0, 1.0);
  Tensor on, off;
  {
    Fp16UseFp32ComputeScope scope(true);
    on = matmul(a, b);
  }
  {
    Fp16UseFp32ComputeScope scope(false);
    off = matmul(a, b);
  }
  const auto von = on.to_vector<double>(), voff = off.to_vector<double>();
  std::size_t differ = 0;
  for (std::size_t i = 0; i < von.size(); ++i) differ += von[i] != voff[i];
  CHECK(differ > von.size() / 4);
  const auto want = matmul16<TestType>(as_floats<TestType>(a), as_floats<TestType>(b), 64, 512, 48);
  check_bits<TestType>(off, all_indices(off), want, "matmul op (switch off)");
}

TEMPLATE_TEST_CASE("16-bit accumulating conv2d kernels match sequential 16-bit loops",
                   "[compute_mode][conv]", half, bfloat16) {
  for (const auto& g : conv_geometries()) run_conv_acc16_case<TestType>(g);
}

// --- Gradients ---------------------------------------------------------------------------

TEMPLATE_TEST_CASE("a matmul's backward products accumulate in 16 bits with the switch off",
                   "[compute_mode][gemm][autograd]", half, bfloat16) {
  constexpr DType dt = dtype_of<TestType>::value;
  const std::int64_t m = 48, k = 96, n = 64;
  const Tensor a = random({m, k}, dt), b = random({k, n}, dt), dy = random({m, n}, dt);
  const auto av = as_floats<TestType>(a), bv = as_floats<TestType>(b);
  const auto dyv = as_floats<TestType>(dy);
  std::vector<Tensor> grads_off, grads_on;
  {
    Fp16UseFp32ComputeScope scope(false);
    GradientTape tape;
    tape.watch(std::vector<Tensor>{a, b});
    const Tensor y = matmul(a, b);
    check_bits<TestType>(y, all_indices(y), matmul16<TestType>(av, bv, m, k, n), "forward");
    grads_off = tape.gradient(y, std::vector<Tensor>{a, b}, dy);
  }
  // da = dy x b^T sums over n, db = a^T x dy over m, each in 16 bits.
  const auto want_da = matmul16<TestType>(dyv, transposed(bv, k, n), m, n, k);
  const auto want_db = matmul16<TestType>(transposed(av, m, k), dyv, k, m, n);
  check_bits<TestType>(grads_off[0], all_indices(grads_off[0]), want_da, "da (switch off)");
  check_bits<TestType>(grads_off[1], all_indices(grads_off[1]), want_db, "db (switch off)");
  {
    Fp16UseFp32ComputeScope scope(true);
    GradientTape tape;
    tape.watch(std::vector<Tensor>{a, b});
    grads_on = tape.gradient(matmul(a, b), std::vector<Tensor>{a, b}, dy);
  }
  // With fp32 accumulation the gradients round once: they differ from the 16-bit ones.
  for (int i = 0; i < 2; ++i) {
    const auto von = grads_on[i].to_vector<double>(), voff = grads_off[i].to_vector<double>();
    std::size_t differ = 0;
    for (std::size_t j = 0; j < von.size(); ++j) differ += von[j] != voff[j];
    INFO("gradient " << i);
    CHECK(differ > 0);
  }
}
