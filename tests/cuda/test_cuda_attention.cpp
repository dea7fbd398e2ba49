// The CUDA fused attention at the shapes the transformer trains at (the conformance sweep's cases
// are small): float16 and bfloat16 heads of width 64 over 1024 positions (GPT-2 small's), causal,
// and width 128, key padding and dropout, through the tiled tensor-core kernels where they apply
// (backends/cuda/attention_tiles.h) against the CPU backend's kernels, and the backward pass
// twice for the same bits (no atomics).
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "mixtape/core/kernels.h"

namespace {

namespace mt = mixtape;
namespace cu = ctest_util;
using std::int64_t;

struct Shape4 {
  int64_t n, t, s, d;
  bool causal;
  bool padded;  // a key-padding mask [n / 2, 2, t, s] (strides s, 0, 0, 1)
  double dropout;
};

// A tensor's values (exactly: every dtype here converts to float64 without rounding).
std::vector<double> values_of(const mt::Tensor& t) {
  return t.to(mt::Device::cpu()).to_vector<double>();
}

}  // namespace

TEST_CASE("cuda attention at training shapes against the CPU kernels", "[cuda][attention][large]") {
  const std::vector<Shape4> shapes{
      {24, 1024, 1024, 64, true, false, 0.0},  // GPT-2 small's heads, batch 2
      {12, 300, 300, 128, false, true, 0.0},
      {6, 256, 256, 64, true, false, 0.1},
      {4, 200, 333, 32, false, true, 0.2},
  };
  for (const mt::DType dt : {mt::kBFloat16, mt::kFloat16})
    for (const Shape4& sh : shapes) {
      const std::string what =
          fmt::format("{} n {} t {} s {} d {}{}{}{}", dt.name(), sh.n, sh.t, sh.s, sh.d,
                      sh.causal ? ", causal" : "", sh.padded ? ", key padding" : "",
                      sh.dropout > 0 ? ", dropout" : "");
      INFO(what);
      const mt::Tensor q = cu::random({sh.n, sh.t, sh.d}, dt, 1, -2.0, 2.0);
      const mt::Tensor k = cu::random({sh.n, sh.s, sh.d}, dt, 2, -2.0, 2.0);
      const mt::Tensor v = cu::random({sh.n, sh.s, sh.d}, dt, 3);
      const mt::Tensor dout = cu::random({sh.n, sh.t, sh.d}, dt, 4);
      mt::Tensor mask;
      if (sh.padded) {
        std::vector<std::uint8_t> rows(static_cast<std::size_t>(sh.n / 2 * sh.s));
        for (std::size_t i = 0; i < rows.size(); ++i)
          rows[i] = static_cast<int64_t>(i % static_cast<std::size_t>(sh.s)) <
                            sh.s - 11 * static_cast<int64_t>(i / static_cast<std::size_t>(sh.s))
                        ? 1
                        : 0;
        mask = mt::expand(mt::from_vector(rows, {sh.n / 2, 1, 1, sh.s}).to(mt::kBool),
                          {sh.n / 2, 2, sh.t, sh.s});
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(sh.d));
      const mt::kernels::AttentionDropout dropout{sh.dropout, 77, {}};

      const auto run = [&](mt::Device dev) {
        const auto forward =
            mt::find_kernel<mt::kernels::AttentionFn>(mt::OpId::attention, dev.type(), dt);
        const auto backward = mt::find_kernel<mt::kernels::AttentionBackwardFn>(
            mt::OpId::attention_backward, dev.type(), dt);
        const mt::Tensor qd = q.to(dev), kd = k.to(dev), vd = v.to(dev), gd = dout.to(dev);
        const mt::Tensor md = mask.defined() ? mask.to(dev) : mask;
        std::vector<mt::Tensor> r{mt::Tensor::empty({sh.n, sh.t, sh.d}, dt, dev),
                                  mt::Tensor::empty({sh.n, sh.t}, mt::kFloat32, dev),
                                  mt::Tensor::empty({sh.n, sh.t, sh.d}, dt, dev),
                                  mt::Tensor::empty({sh.n, sh.s, sh.d}, dt, dev),
                                  mt::Tensor::empty({sh.n, sh.s, sh.d}, dt, dev)};
        forward(qd, kd, vd, md, sh.causal, scale, dropout, r[0], r[1]);
        backward(qd, kd, vd, md, sh.causal, scale, dropout, r[0], r[1], gd, r[2], r[3], r[4]);
        return r;
      };
      const std::vector<mt::Tensor> want = run(mt::Device::cpu());
      const std::vector<mt::Tensor> got = run(cu::kGpu);
      const char* names[] = {"out", "lse", "dq", "dk", "dv"};
      for (std::size_t i = 0; i < want.size(); ++i)
        cu::check_close(got[i].to(mt::Device::cpu()), want[i],
                        cu::tolerance(i == 1 ? mt::kFloat32 : dt, /*gemm_like=*/true),
                        fmt::format("{}: {}", what, names[i]));
      // The same call again: the same bits (every sum has one owner and one order).
      const std::vector<mt::Tensor> again = run(cu::kGpu);
      for (std::size_t i = 0; i < got.size(); ++i) {
        INFO(names[i]);
        CHECK(values_of(again[i]) == values_of(got[i]));
      }
    }
}

TEST_CASE("cuda attention: a row whose logits are all -inf attends nothing, as on the CPU",
          "[cuda][attention]") {
  // Query row 0 starts with -inf and every key's first value is positive: each of its logits
  // is -inf. The CPU kernels, the plain kernels (float32) and the tiled ones (bfloat16, width
  // 64) give it out 0 and lse -inf (not NaN), and the other rows their usual values.
  for (const mt::DType dt : {mt::kFloat32, mt::kBFloat16}) {
    INFO(dt.name());
    const int64_t n = 2, t = 70, s = 70, d = 64;
    std::vector<double> qv = values_of(cu::random({n, t, d}, mt::kFloat32, 11, -2.0, 2.0));
    std::vector<double> kv = values_of(cu::random({n, s, d}, mt::kFloat32, 12, -2.0, 2.0));
    qv[0] = -INFINITY;
    for (int64_t j = 0; j < n * s; ++j) kv[static_cast<std::size_t>(j * d)] = 0.5;
    const mt::Tensor q = mt::from_vector(qv, {n, t, d}).to(dt);
    const mt::Tensor k = mt::from_vector(kv, {n, s, d}).to(dt);
    const mt::Tensor v = cu::random({n, s, d}, dt, 13);
    const auto run = [&](mt::Device dev) {
      const auto forward =
          mt::find_kernel<mt::kernels::AttentionFn>(mt::OpId::attention, dev.type(), dt);
      std::vector<mt::Tensor> r{mt::Tensor::empty({n, t, d}, dt, dev),
                                mt::Tensor::empty({n, t}, mt::kFloat32, dev)};
      forward(q.to(dev), k.to(dev), v.to(dev), mt::Tensor(), /*causal=*/false, 0.125,
              mt::kernels::AttentionDropout{}, r[0], r[1]);
      return std::vector<std::vector<double>>{values_of(r[0]), values_of(r[1])};
    };
    const auto want = run(mt::Device::cpu()), got = run(cu::kGpu);
    CHECK(want[1][0] == -INFINITY);
    CHECK(got[1][0] == -INFINITY);
    for (int64_t c = 0; c < d; ++c) {
      CHECK(want[0][static_cast<std::size_t>(c)] == 0.0);
      CHECK(got[0][static_cast<std::size_t>(c)] == 0.0);
    }
    // Every other row finite and as on the CPU (within the dtype's GEMM-like tolerance).
    const double tol = cu::tolerance(dt, /*gemm_like=*/true);
    for (std::size_t i = static_cast<std::size_t>(d); i < want[0].size(); ++i)
      REQUIRE(std::abs(got[0][i] - want[0][i]) <= tol * (1.0 + std::abs(want[0][i])));
  }
}
