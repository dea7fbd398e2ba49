// The CUDA backend's tiled tensor-core attention (backends/cuda/attention_tiles.h) run on the
// host: a thread block emulated with a fiber per lane, barriers for __syncthreads and the
// warp's exchanges, and mma.sync m16n8k16 written out from the fragment layout of the PTX
// manual ("Matrix Fragments for mma.m16n8k16 with floating point type"). The GPU runs the same
// loop; here its tiling, fragment bookkeeping, masks, dropout and online softmax are checked
// against the CPU backend's attention kernel, on machines without a GPU. What this cannot
// check (the hardware's own mma and rounding instructions) the conformance sweep checks on a
// GPU (mixtape-ops --backend cuda --op attention).
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "backends/cuda/attention_tiles.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"
#include "tests/cudaemu/fibers.h"

namespace mt = mixtape;
namespace at = mixtape::attention_tiles;

namespace {

using std::int64_t;

using mixtape::cuda_emu::Fibers;

// What the lanes of one warp exchange: a float for shfl_xor, the fragments for mma. Two
// buffers, used in turn: a lane that has read exchange k's writes exchange k + 1's while the
// others may still read k's, and cannot reach k + 2 (the same buffer as k) before they have
// all arrived at k + 1, so an exchange needs one barrier, not two.
struct WarpExchange {
  Fibers::Barrier met{at::kWarpLanes};
  struct Buffer {
    float value[at::kWarpLanes] = {};
    std::uint32_t a[at::kWarpLanes][4] = {};
    std::uint32_t b[at::kWarpLanes][2] = {};
  } buffers[2];
};

struct EmulatedBlock {
  Fibers* fibers;
  Fibers::Barrier met{at::kThreads};
  WarpExchange warps[at::kWarps];
};

// The executor attention_tiles::forward runs on, for one thread of an emulated block.
template <bool BF16>
struct HostCtx {
  EmulatedBlock* emulated;
  int tid;
  int64_t head_index, block_index;
  std::uint64_t exchanges = 0;  // this lane's warp exchanges so far

  int thread() const { return tid; }
  int64_t head() const { return head_index; }
  int64_t block() const { return block_index; }
  void sync() { emulated->fibers->arrive_and_wait(emulated->met); }
  WarpExchange& warp() { return emulated->warps[tid / at::kWarpLanes]; }
  int lane() const { return tid % at::kWarpLanes; }

  // The buffer of this lane's next warp exchange (WarpExchange).
  WarpExchange::Buffer& next_buffer() { return warp().buffers[exchanges++ % 2]; }

  float shfl_xor(float v, int lane_mask) {
    WarpExchange::Buffer& x = next_buffer();
    x.value[lane()] = v;
    emulated->fibers->arrive_and_wait(warp().met);
    return x.value[lane() ^ lane_mask];
  }

  static float value_of(std::uint32_t reg, int half) {
    const auto b = static_cast<std::uint16_t>(reg >> (16 * half));
    return BF16 ? mt::detail::bfloat16_bits_to_float(b) : mt::detail::half_bits_to_float(b);
  }

  // d += A B for the warp's 16 x 16 A and 16 x 8 B. Lane L = 4 group + c holds A's rows group
  // and group + 8 at columns 2c, 2c + 1 (registers 0 and 1) and 2c + 8, 2c + 9 (registers 2
  // and 3); B's column group at rows 2c, 2c + 1 (register 0) and 2c + 8, 2c + 9 (register 1);
  // D's rows group and group + 8 at columns 2c, 2c + 1. The first of a pair is the low half.
  void mma(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
    WarpExchange::Buffer& w = next_buffer();
    std::memcpy(w.a[lane()], a, sizeof a);
    std::memcpy(w.b[lane()], b, sizeof b);
    emulated->fibers->arrive_and_wait(warp().met);
    const auto a_at = [&](int row, int k) {
      return value_of(w.a[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)],
                      k % 2);
    };
    const auto b_at = [&](int k, int col) {
      return value_of(w.b[col * 4 + (k % 8) / 2][k >= 8 ? 1 : 0], k % 2);
    };
    const int g = lane() / 4, c = lane() % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + 8 * (e / 2), col = 2 * c + e % 2;
      double sum = 0;  // 16-bit products are exact; the sum rounded once
      for (int k = 0; k < 16; ++k) sum += double(a_at(row, k)) * double(b_at(k, col));
      d[e] += static_cast<float>(sum);
    }
  }

  std::uint16_t bits(float v) const {
    return BF16 ? mt::detail::float_to_bfloat16_bits(v) : mt::detail::float_to_half_bits(v);
  }
  float round(float v) const {
    return BF16 ? mt::detail::bfloat16_bits_to_float(bits(v))
                : mt::detail::half_bits_to_float(bits(v));
  }
  float exp2(float x) const { return std::exp2(x); }
  float log2(float x) const { return std::log2(x); }
};

enum class Pass { Forward, Dq, DkDv };

// A kernel's grid (a block per head and 64 rows: queries, or keys for DkDv) run block after
// block, each block's 128 threads as fibers.
template <Pass P, int D, bool BF16>
void run_grid(const at::Params& p) {
  const int64_t rows = P == Pass::DkDv ? p.s : p.t;
  Fibers fibers(at::kThreads);
  for (int64_t h = 0; h < p.n; ++h)
    for (int64_t blk = 0; blk * at::kTile < rows; ++blk) {
      auto block = std::make_unique<EmulatedBlock>();
      block->fibers = &fibers;
      auto shared = std::make_unique<at::Shared<D>>();
      fibers.run([&](int tid) {
        HostCtx<BF16> ctx{block.get(), tid, h, blk};
        if constexpr (P == Pass::Forward)
          at::forward<D>(ctx, *shared, p);
        else if constexpr (P == Pass::Dq)
          at::backward_dq<D>(ctx, *shared, p);
        else
          at::backward_dkdv<D>(ctx, *shared, p);
      });
    }
}

template <Pass P, bool BF16>
void run_emulated(const at::Params& p, int64_t d) {
  switch (d) {
    case 32:
      return run_grid<P, 32, BF16>(p);
    case 64:
      return run_grid<P, 64, BF16>(p);
    case 96:
      if constexpr (P == Pass::Forward) return run_grid<P, 96, BF16>(p);
      break;
    default:
      if constexpr (P == Pass::Forward) return run_grid<P, 128, BF16>(p);
      break;
  }
  FAIL("no tiled kernel for width " << d);
}

template <Pass P>
void run_emulated(const at::Params& p, int64_t d, mt::DType dtype) {
  if (dtype == mt::kBFloat16)
    run_emulated<P, true>(p, d);
  else
    run_emulated<P, false>(p, d);
}

// The number of elements of got that lie more than a unit in the last place of the 16-bit
// type from want, beyond 2e-5: where a result cancels to nearly 0 (a row that attends one
// key has dS = P (dP - D) = 0 but for rounding), both sides hold float32 rounding noise of sums
// of up to 130 terms of size up to about 4, added in different orders.
std::size_t off_by_more_than_an_ulp(const mt::Tensor& got, const mt::Tensor& want) {
  const double ulp = got.dtype() == mt::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  const auto g = got.to(mt::kFloat64).to_vector<double>();
  const auto w = want.to(mt::kFloat64).to_vector<double>();
  std::size_t off = 0;
  for (std::size_t i = 0; i < w.size(); ++i)
    if (!(std::abs(w[i] - g[i]) <= ulp * std::abs(w[i]) + 2e-5)) ++off;
  return off;
}

struct Case {
  const char* what;
  int64_t n, t, s, d;
  bool causal;
  int mask;  // 0 none; 1 per row [n, 1, t, s] with a row that attends nothing; 2 key padding
  double dropout;
  // The tiles take q, k, v, dout and write out, dq, dk, dv as views [2, n / 2, rows, d] of
  // [2, rows, n / 2, d] (the heads of a projection, where they lie: kernels.h).
  bool in_place = false;
  // Query row 0 of head 0 starts with -inf and every key's first value is 0.5: all its logits
  // are -inf, and the row attends nothing (out 0, lse -inf; forward only: its dk would be
  // 0 x -inf on both sides).
  bool infinite_row = false;
};

// x [n, rows, d] as the kernels see a projection's heads: a view [2, n / 2, rows, d] of
// [2, rows, n / 2, d] holding x's values; or x itself.
mt::Tensor as_projection(const mt::Tensor& x, bool in_place) {
  if (!in_place) return x;
  const int64_t n = x.dim(0), rows = x.dim(1), d = x.dim(2);
  const mt::Tensor laid =
      mt::contiguous(mt::permute(mt::reshape(x, {2, n / 2, rows, d}), {0, 2, 1, 3}));
  return mt::permute(laid, {0, 2, 1, 3});
}

}  // namespace

TEST_CASE("tiled tensor-core attention, emulated on the host, matches the CPU kernels",
          "[attention][cuda_tiles]") {
  const std::vector<Case> cases{
      {"causal, two row blocks and key tiles", 2, 70, 70, 64, true, 0, 0.0},
      {"masked, an empty row, 3 key tiles", 1, 33, 130, 32, false, 1, 0.0},
      {"key padding, causal, dropout", 4, 65, 65, 64, true, 2, 0.3},
      {"causal with more keys than queries", 1, 5, 9, 64, true, 0, 0.0},
      {"more queries than keys, dropout", 1, 80, 20, 32, false, 0, 0.5},
      {"width 128, causal (forward only)", 1, 65, 65, 128, true, 0, 0.0},
      {"width 96, one position (forward only)", 1, 1, 1, 96, false, 0, 0.0},
      {"heads in place, key padding, causal, dropout", 4, 70, 70, 64, true, 2, 0.2, true},
      {"heads in place, width 32, masked", 2, 65, 80, 32, false, 1, 0.0, true},
      {"a row whose logits are all -inf (forward only)", 2, 70, 70, 64, false, 0, 0.0, false, true},
  };
  for (const mt::DType dtype : {mt::kBFloat16, mt::kFloat16})
    for (const Case& c : cases) {
      INFO(c.what << " in " << dtype.name());
      mt::manual_seed(static_cast<std::uint64_t>(c.t * 131 + c.d));
      const auto make = [&](int64_t rows) {
        return mt::uniform({c.n, rows, c.d}, -2.0, 2.0).to(dtype);
      };
      mt::Tensor q = make(c.t), k = make(c.s);
      const mt::Tensor v = make(c.s), dout = make(c.t);
      if (c.infinite_row) {
        auto qv = q.to(mt::kFloat64).to_vector<double>();
        auto kv = k.to(mt::kFloat64).to_vector<double>();
        qv[0] = -INFINITY;
        for (std::size_t j = 0; j < kv.size(); j += static_cast<std::size_t>(c.d)) kv[j] = 0.5;
        q = mt::from_vector(qv, q.shape()).to(dtype);
        k = mt::from_vector(kv, k.shape()).to(dtype);
      }
      mt::Tensor mask;
      if (c.mask == 1) {
        // Row 0 of each head attends nothing; the rest half the keys at random.
        std::mt19937_64 rng(7);
        std::vector<std::uint8_t> bytes(static_cast<std::size_t>(c.n * c.t * c.s));
        for (std::size_t i = 0; i < bytes.size(); ++i)
          bytes[i] = static_cast<int64_t>(i) % (c.t * c.s) >= c.s && rng() % 2 == 0 ? 1 : 0;
        mask = mt::from_vector(bytes, {c.n, 1, c.t, c.s}).to(mt::kBool);
      } else if (c.mask == 2) {
        // Two groups of two heads; group g keeps its first s - 7 g keys (read through strides
        // (s, 0, 0, 1), as kernels.h allows).
        std::vector<std::uint8_t> rows(static_cast<std::size_t>(2 * c.s));
        for (int64_t g = 0; g < 2; ++g)
          for (int64_t j = 0; j < c.s; ++j)
            rows[static_cast<std::size_t>(g * c.s + j)] = j < c.s - 7 * g ? 1 : 0;
        mask = mt::expand(mt::from_vector(rows, {2, 1, 1, c.s}).to(mt::kBool), {2, 2, c.t, c.s});
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
      const mt::kernels::AttentionDropout dropout{c.dropout, 0xabcdefu, {}};
      const auto empty = [&](int64_t rows, mt::DType dt) {
        return mt::Tensor::empty({c.n, rows, c.d}, dt, mt::Device::cpu());
      };
      // The tiles' operands and outputs (as_projection's views in the in-place cases).
      const mt::Tensor tq = as_projection(q, c.in_place), tk = as_projection(k, c.in_place),
                       tv = as_projection(v, c.in_place), tdout = as_projection(dout, c.in_place);
      const auto tiles_out = [&](int64_t rows) {
        return as_projection(empty(rows, dtype), c.in_place);
      };

      // The CPU kernels: the forward pass, then the backward pass from its out and lse.
      const auto cpu_forward = mt::find_kernel<mt::kernels::AttentionFn>(
          mt::OpId::attention, mt::DeviceType::CPU, dtype);
      const mt::Tensor want = empty(c.t, dtype);
      const mt::Tensor lse = mt::Tensor::empty({c.n, c.t}, mt::kFloat32, mt::Device::cpu());
      cpu_forward(q, k, v, mask, c.causal, scale, dropout, want, lse);

      // The operands as attention.cu hands them to the kernels; in the in-place cases the seed
      // read from memory, as a captured step gives it (kernels.h: seed_at).
      mt::kernels::AttentionDropout tiles_dropout = dropout;
      if (c.in_place) {
        tiles_dropout.seed = 0;
        tiles_dropout.seed_at = mt::from_vector(std::vector<std::int64_t>{0xabcdef}, {1});
      }
      at::Params p = at::params_of(tq, tk, tv, mask, c.causal, scale, tiles_dropout);

      // Forward. Both compute out in float32 and round it once (the weights enter P V in two
      // 16-bit parts here): at most a unit in the last place apart, where the float32 values
      // lie on two sides of a rounding boundary.
      const mt::Tensor got = tiles_out(c.t);
      const mt::Tensor got_lse = mt::Tensor::empty({c.n, c.t}, mt::kFloat32, mt::Device::cpu());
      p.out = mt::head_rows<std::uint16_t>(got);
      p.lse = static_cast<float*>(got_lse.data_ptr());
      run_emulated<Pass::Forward>(p, c.d, dtype);
      CHECK(off_by_more_than_an_ulp(got, want) == 0);
      const auto wl = lse.to_vector<float>(), gl = got_lse.to_vector<float>();
      std::size_t lse_off = 0;
      for (std::size_t i = 0; i < wl.size(); ++i)
        if (std::isinf(wl[i]) ? gl[i] != wl[i]  // a row that attends nothing
                              : !(std::abs(wl[i] - gl[i]) <= 1e-5 * (1.0 + std::abs(wl[i]))))
          ++lse_off;
      CHECK(lse_off == 0);
      if (c.infinite_row) {
        CHECK(std::isinf(wl[0]));
        const mt::Tensor row = mt::slice(mt::slice(got, 0, 0, 1), 1, 0, 1);
        CHECK(row.to(mt::kFloat64).to_vector<double>() == std::vector<double>(c.d, 0.0));
        continue;
      }
      if (!at::supports_backward(c.d, c.d)) continue;

      // Backward, from the CPU's out and lse (both sides read the same).
      const auto cpu_backward = mt::find_kernel<mt::kernels::AttentionBackwardFn>(
          mt::OpId::attention_backward, mt::DeviceType::CPU, dtype);
      const mt::Tensor dq = empty(c.t, dtype), dk = empty(c.s, dtype), dv = empty(c.s, dtype);
      cpu_backward(q, k, v, mask, c.causal, scale, dropout, want, lse, dout, dq, dk, dv);
      // D, the rows' dot products of dout and out (attention.cu's row kernel), in float32.
      const auto g64 = dout.to(mt::kFloat64).to_vector<double>();
      const auto o64 = want.to(mt::kFloat64).to_vector<double>();
      std::vector<float> rowdot(static_cast<std::size_t>(c.n * c.t));
      for (std::size_t r = 0; r < rowdot.size(); ++r) {
        double sum = 0;
        for (int64_t e = 0; e < c.d; ++e)
          sum += g64[r * static_cast<std::size_t>(c.d) + static_cast<std::size_t>(e)] *
                 o64[r * static_cast<std::size_t>(c.d) + static_cast<std::size_t>(e)];
        rowdot[r] = static_cast<float>(sum);
      }
      const mt::Tensor gq = tiles_out(c.t), gk = tiles_out(c.s), gv = tiles_out(c.s);
      p.out = {};
      p.lse = static_cast<float*>(lse.data_ptr());
      p.dout = mt::head_rows<const std::uint16_t>(tdout);
      p.rowdot = rowdot.data();
      p.dq = mt::head_rows<std::uint16_t>(gq);
      p.dk = mt::head_rows<std::uint16_t>(gk);
      p.dv = mt::head_rows<std::uint16_t>(gv);
      run_emulated<Pass::Dq>(p, c.d, dtype);
      run_emulated<Pass::DkDv>(p, c.d, dtype);
      CHECK(off_by_more_than_an_ulp(gq, dq) == 0);
      CHECK(off_by_more_than_an_ulp(gk, dk) == 0);
      CHECK(off_by_more_than_an_ulp(gv, dv) == 0);
    }
}
