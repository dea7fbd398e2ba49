// The CUDA fused attention against the CPU backend's kernels: at the shapes the transformer
// trains at (the conformance sweep's cases are small): 16-bit and float32 heads of width 64
// over 1024 positions (GPT-2 small's), causal, and width 128, key padding and dropout, through
// the tiled kernels where they apply (backends/cuda/attention_tiles.h, attention_float32.cuh), and
// the backward pass twice for the same bits (no atomics); a row that attends nothing; and small
// shapes of the tiled kernels within a unit in the last place of the CPU's (16-bit), within
// a few units of float32's (the float32 tiles).
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
  for (const mt::DType dt : {mt::kBFloat16, mt::kFloat16, mt::kFloat32})
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
  // is -inf. The CPU kernels and the tiled ones (float32 and bfloat16, width 64) give it out 0
  // and lse -inf (not NaN), and the other rows their usual values.
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

namespace {

// x [n, rows, d] as attention's kernels see a projection's heads, where they lie (kernels.h): a
// view [2, n / 2, rows, d] of [2, rows, n / 2, d] holding x's values; or x itself.
mt::Tensor as_projection(const mt::Tensor& x, bool in_place) {
  if (!in_place) return x;
  const int64_t n = x.dim(0), rows = x.dim(1), d = x.dim(2);
  const mt::Tensor laid =
      mt::contiguous(mt::permute(mt::reshape(x, {2, n / 2, rows, d}), {0, 2, 1, 3}));
  return mt::permute(laid, {0, 2, 1, 3});
}

// The elements of got more than a unit in the last place of the 16-bit type from want, beyond
// 2e-5: where a result cancels to nearly 0 (a row that attends one key has dS = P (dP - D) = 0
// but for rounding), both sides hold float32 rounding noise of sums of up to 130 terms of size
// up to about 4, added in different orders.
std::size_t off_by_more_than_an_ulp(const mt::Tensor& got, const mt::Tensor& want) {
  const double ulp = want.dtype() == mt::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  const auto g = values_of(got), w = values_of(want);
  std::size_t off = 0;
  for (std::size_t i = 0; i < w.size(); ++i)
    if (!(std::abs(w[i] - g[i]) <= ulp * std::abs(w[i]) + 2e-5)) ++off;
  return off;
}

struct TileCase {
  const char* what;
  int64_t n, t, s, d;
  bool causal;
  int mask;  // 0 none; 1 per row [n, 1, t, s] with a row that attends nothing; 2 key padding
  double dropout;
  // q, k, v, dout, out, dq, dk, dv as views of projections (as_projection), and the dropout
  // seed read from device memory, as a captured step gives it (kernels.h: seed_at).
  bool in_place = false;
};

// The small shapes of the tiled kernels: row blocks and key tiles crossed, masks, a row that
// attends nothing, dropout, widths 16 to 128, heads read and written where they lie.
const std::vector<TileCase> kTileCases{
    {"causal, two row blocks and key tiles", 2, 70, 70, 64, true, 0, 0.0},
    {"masked, an empty row, 3 key tiles", 1, 33, 130, 32, false, 1, 0.0},
    {"key padding, causal, dropout", 4, 65, 65, 64, true, 2, 0.3},
    {"causal with more keys than queries", 1, 5, 9, 64, true, 0, 0.0},
    {"more queries than keys, dropout", 1, 80, 20, 32, false, 0, 0.5},
    {"width 128, causal", 1, 65, 65, 128, true, 0, 0.0},
    {"width 96, one position", 1, 1, 1, 96, false, 0, 0.0},
    {"width 96, masked, an empty row, more keys than queries", 1, 40, 100, 96, false, 1, 0.0},
    {"heads in place, key padding, causal, dropout", 4, 70, 70, 64, true, 2, 0.2, true},
    {"heads in place, width 32, masked", 2, 65, 80, 32, false, 1, 0.0, true},
    {"width 16, causal, dropout", 2, 40, 40, 16, true, 0, 0.2},
    {"width 48, key padding, more keys than queries", 4, 50, 70, 48, false, 2, 0.0},
    {"width 80, masked, an empty row, causal", 1, 70, 70, 80, true, 1, 0.0},
    {"heads in place, width 128, key padding, causal, dropout", 4, 70, 70, 128, true, 2, 0.2, true},
};

// One case in dtype dt on the GPU against the CPU kernels: out, lse, dq, dk and dv,
// off_count(got, want) counting the elements out of bounds. `seed` draws the operands.
template <typename OffCount>
void check_tile_case(mt::DType dt, const TileCase& c, std::uint64_t& seed, OffCount off_count) {
  INFO(c.what << " in " << dt.name());
  const mt::Tensor q = cu::random({c.n, c.t, c.d}, dt, ++seed, -2.0, 2.0);
  const mt::Tensor k = cu::random({c.n, c.s, c.d}, dt, ++seed, -2.0, 2.0);
  const mt::Tensor v = cu::random({c.n, c.s, c.d}, dt, ++seed, -2.0, 2.0);
  const mt::Tensor dout = cu::random({c.n, c.t, c.d}, dt, ++seed, -2.0, 2.0);
  mt::Tensor mask;
  if (c.mask == 1) {
    // Row 0 of each head attends nothing; the rest half the keys at random.
    const auto coin = values_of(cu::random({c.n * c.t * c.s}, mt::kFloat32, ++seed));
    std::vector<std::uint8_t> bytes(coin.size());
    for (std::size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = static_cast<int64_t>(i) % (c.t * c.s) >= c.s && coin[i] > 0 ? 1 : 0;
    mask = mt::from_vector(bytes, {c.n, 1, c.t, c.s}).to(mt::kBool);
  } else if (c.mask == 2) {
    // Two groups of two heads; group g keeps its first s - 7 g keys (read through strides
    // (s, 0, 0, 1)).
    std::vector<std::uint8_t> rows(static_cast<std::size_t>(2 * c.s));
    for (int64_t g = 0; g < 2; ++g)
      for (int64_t j = 0; j < c.s; ++j)
        rows[static_cast<std::size_t>(g * c.s + j)] = j < c.s - 7 * g ? 1 : 0;
    mask = mt::expand(mt::from_vector(rows, {2, 1, 1, c.s}).to(mt::kBool), {2, 2, c.t, c.s});
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const mt::kernels::AttentionDropout dropout{c.dropout, 0xabcdefu, {}};
  mt::kernels::AttentionDropout gpu_dropout = dropout;
  if (c.in_place) {
    gpu_dropout.seed = 0;
    gpu_dropout.seed_at = mt::from_vector(std::vector<std::int64_t>{0xabcdef}, {1}).to(cu::kGpu);
  }
  const auto empty = [&](int64_t rows, mt::Device dev) {
    return mt::Tensor::empty({c.n, rows, c.d}, dt, dev);
  };
  const auto on_gpu = [&](const mt::Tensor& x) {
    return as_projection(x.to(cu::kGpu), c.in_place);
  };
  const auto gpu_out = [&](int64_t rows) {
    return as_projection(empty(rows, cu::kGpu), c.in_place);
  };
  const auto kernels_on = [&](mt::DeviceType type) {
    return std::pair{
        mt::find_kernel<mt::kernels::AttentionFn>(mt::OpId::attention, type, dt),
        mt::find_kernel<mt::kernels::AttentionBackwardFn>(mt::OpId::attention_backward, type, dt)};
  };
  const auto cpu = kernels_on(mt::DeviceType::CPU), gpu = kernels_on(mt::DeviceType::CUDA);
  const mt::Tensor gq = on_gpu(q), gk = on_gpu(k), gv = on_gpu(v);
  const mt::Tensor gmask = mask.defined() ? mask.to(cu::kGpu) : mask;

  // Forward.
  const mt::Tensor want = empty(c.t, mt::Device::cpu());
  const mt::Tensor lse = mt::Tensor::empty({c.n, c.t}, mt::kFloat32, mt::Device::cpu());
  cpu.first(q, k, v, mask, c.causal, scale, dropout, want, lse);
  const mt::Tensor got = gpu_out(c.t);
  const mt::Tensor got_lse = mt::Tensor::empty({c.n, c.t}, mt::kFloat32, cu::kGpu);
  gpu.first(gq, gk, gv, gmask, c.causal, scale, gpu_dropout, got, got_lse);
  CHECK(off_count(got, want) == 0);
  const auto wl = values_of(lse), gl = values_of(got_lse);
  std::size_t lse_off = 0;
  for (std::size_t i = 0; i < wl.size(); ++i)
    if (std::isinf(wl[i]) ? gl[i] != wl[i]  // a row that attends nothing
                          : !(std::abs(wl[i] - gl[i]) <= 1e-5 * (1.0 + std::abs(wl[i]))))
      ++lse_off;
  CHECK(lse_off == 0);

  // Backward, from the CPU's out and lse (both sides read the same).
  const mt::Tensor dq = empty(c.t, mt::Device::cpu()), dk = empty(c.s, mt::Device::cpu()),
                   dv = empty(c.s, mt::Device::cpu());
  cpu.second(q, k, v, mask, c.causal, scale, dropout, want, lse, dout, dq, dk, dv);
  const mt::Tensor gdq = gpu_out(c.t), gdk = gpu_out(c.s), gdv = gpu_out(c.s);
  gpu.second(gq, gk, gv, gmask, c.causal, scale, gpu_dropout, on_gpu(want), lse.to(cu::kGpu),
             on_gpu(dout), gdq, gdk, gdv);
  CHECK(off_count(gdq, dq) == 0);
  CHECK(off_count(gdk, dk) == 0);
  CHECK(off_count(gdv, dv) == 0);
}

}  // namespace

// The 16-bit kernels at small shapes against the CPU's, closer than the sweep's bound: both
// compute in float32 and round once, so at most a unit in the last place apart, where the
// float32 values lie on two sides of a rounding boundary. Widths 32, 64, 96 and 128 take the
// tiled tensor-core kernels (backends/cuda/attention_tiles.h): their row and key tiles, fragment
// bookkeeping, masks, dropout and online softmax, and the launch code that picks them; widths
// 16, 48 and 80 the plain kernels, held to the same bound.
TEST_CASE("cuda attention within a unit in the last place of the CPU kernels",
          "[cuda][attention][cuda_tiles]") {
  std::uint64_t seed = 40;
  for (const mt::DType dt : {mt::kBFloat16, mt::kFloat16})
    for (const TileCase& c : kTileCases) check_tile_case(dt, c, seed, off_by_more_than_an_ulp);
}

// float32 heads up to 64 wide take the tiled float32 kernels (backends/cuda/attention_float32.cuh,
// made for widths 32 and 64, narrower heads padded; 96 and 128 the plain ones): float32 sums of up
// to 130 terms in another order than the CPU's GEMMs. Each element within 2^-17 of the largest of
// its tensor, or of 1 where that is smaller (the operands' scale: a gradient that cancels to 0, as
// dq and dk of a row that attends one key, is rounding noise on both sides): 64 units in the
// last place of the largest; on the host emulation the largest difference was 2^-20.5 of it.
// Far tighter than the sweep's bound, which grows with the terms of a sum: a kernel off by
// 10^-4 fails it.
TEST_CASE("cuda attention float32 close to the CPU kernels", "[cuda][attention][cuda_tiles]") {
  const auto off = [](const mt::Tensor& got, const mt::Tensor& want) {
    const auto g = values_of(got), w = values_of(want);
    double largest = 1.0;  // (the operands' scale: see above)
    for (const double x : w) largest = std::max(largest, std::abs(x));
    std::size_t n = 0;
    for (std::size_t i = 0; i < w.size(); ++i)
      if (!(std::abs(w[i] - g[i]) <= 0x1p-17 * largest)) ++n;
    return n;
  };
  std::uint64_t seed = 140;
  for (const TileCase& c : kTileCases) check_tile_case(mt::kFloat32, c, seed, off);
}

TEST_CASE(
    "cuda fused_attention_packed: q, k and v read from one tensor, dq, dk, dv written into "
    "one, as on the CPU",
    "[cuda][attention][packed]") {
  // Self-attention's packed projection [batch, positions, heads * 3 width]: the kernels read
  // the heads in place (rows of 3 heads * width elements) and write the gradient's three parts
  // in place; the tiled kernels for 16-bit heads of width 64, the float32 ones for width 32.
  struct Case {
    mt::DType dt;
    int64_t heads, width;
    double dropout;
  };
  for (const Case& c : {Case{mt::kBFloat16, 2, 64, 0.0}, Case{mt::kFloat16, 2, 64, 0.2},
                        Case{mt::kFloat32, 3, 32, 0.1}}) {
    INFO(c.dt.name() << ", " << c.heads << " heads of " << c.width << ", dropout " << c.dropout);
    const int64_t t = 70, w = 3 * c.heads * c.width;
    const mt::Tensor x = cu::random({2, t, w}, c.dt, 11, -2.0, 2.0);
    const mt::Tensor g = cu::random({2, c.heads, t, c.width}, c.dt, 12);
    const auto run = [&](mt::Device dev) {
      mt::Variable qkv(x.to(dev), "qkv");
      mt::GradientTape tape;
      const mt::Tensor y = mt::fused_attention_packed(qkv, {c.heads, c.width, c.width},
                                                      mt::Tensor(), true, 0.125, c.dropout, 5);
      const auto grads = tape.gradient(mt::sum(mt::cast(y * g.to(dev), mt::kFloat32)),
                                       std::vector<mt::Variable>{qkv});
      return std::vector<mt::Tensor>{y.to(mt::Device::cpu()), grads[0].to(mt::Device::cpu())};
    };
    const auto want = run(mt::Device::cpu()), got = run(cu::kGpu);
    cu::check_close(got[0], want[0], cu::tolerance(c.dt, /*gemm_like=*/true), "out");
    cu::check_close(got[1], want[1], cu::tolerance(c.dt, /*gemm_like=*/true), "dqkv");
  }
}
