// The host emulation's shared memory (tests/cudaemu): a GPU's __shared__ variables start each
// block with whatever the SM's previous block left, and the emulation, which keeps them as
// function statics, fills each with all bits set where backends/cuda/launch.cuh's
// shared_starts_undefined marks it, so that a kernel reading what its block did not write
// gets NaN instead of the previous block's (often right) values. And its count of ldmatrix's
// bank conflicts (a model of the hardware's rule): none in the attention tiles. Part of
// cuda.emulated only: these kernels are host C++ against the emulation's cuda_runtime.h.
#include <cuda_runtime.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/cuda/launch.cuh"
#include "mixtape/mixtape.h"

namespace {

using mixtape::cuda_backend::shared_starts_undefined;

constexpr unsigned kBlocks = 5, kThreads = 64;

// Each block's first thread records the bits its block's buf[0] holds before anyone writes
// it; then every thread writes its slot. `marked`: with shared_starts_undefined.
template <bool marked>
__global__ void first_reads(std::uint32_t* seen) {
  __shared__ float buf[kThreads];
  if constexpr (marked) shared_starts_undefined(buf);
  if (threadIdx.x == 0) {
    std::uint32_t bits;
    std::memcpy(&bits, &buf[0], sizeof bits);
    seen[blockIdx.x] = bits;
  }
  __syncthreads();
  buf[threadIdx.x] = static_cast<float>(blockIdx.x + 1);
  __syncthreads();
}

// A device function whose __shared__ variable is marked: called twice by a block, the second
// call sees what the first wrote (the block's shared memory lasts as long as the block).
__device__ int count_calls() {
  __shared__ int calls;
  shared_starts_undefined(calls);
  __syncthreads();
  const int before = calls;
  __syncthreads();
  if (threadIdx.x == 0) calls = before == -1 ? 1 : before + 1;
  __syncthreads();
  return calls;
}

__global__ void calls_twice(int* out) {
  count_calls();
  const int second = count_calls();
  if (threadIdx.x == 0) out[blockIdx.x] = second;
}

// One warp's ldmatrix .x4 over 32 rows of 16-bit elements `stride` apart, lane l naming row
// l: 72 (the attention tiles' 64 + 8 of padding: 144 bytes) puts a tile's 8 rows on distinct
// banks, 64 (128 bytes) all on the same four.
template <int stride>
__global__ void read_tiles(std::uint32_t* out) {
  __shared__ std::uint16_t rows[32 * stride];
  shared_starts_undefined(rows);
  std::uint32_t r[4];
  mixtape::cuda_emu::ldmatrix_x4(r, &rows[threadIdx.x * stride], false);
  out[threadIdx.x] = r[0];
}

template <int stride>
std::uint64_t conflicts_of_read_tiles() {
  std::vector<std::uint32_t> out(32);
  const std::uint64_t before = mixtape::cuda_emu::ldmatrix_bank_conflicts();
  MIXTAPE_CUDA_LAUNCH(dim3(1), dim3(32), nullptr, read_tiles<stride>)(out.data());
  return mixtape::cuda_emu::ldmatrix_bank_conflicts() - before;
}

template <bool marked>
std::vector<std::uint32_t> launch_first_reads() {
  std::vector<std::uint32_t> seen(kBlocks, 0);
  MIXTAPE_CUDA_LAUNCH(dim3(kBlocks), dim3(kThreads), nullptr, first_reads<marked>)(seen.data());
  return seen;
}

}  // namespace

TEST_CASE("emulated shared memory starts each block with all bits set where marked", "[cudaemu]") {
  // Twice: the second launch finds the statics as the first left them.
  for (int launch = 0; launch < 2; ++launch) {
    for (const std::uint32_t bits : launch_first_reads<true>()) CHECK(bits == 0xffffffffu);
  }
}

TEST_CASE("emulated shared memory without the mark keeps the previous block's values",
          "[cudaemu]") {
  // What the mark is for: unmarked, every block but the first of the first launch (which finds
  // the static's zeros) reads a value some earlier block wrote, a finite float.
  launch_first_reads<false>();
  for (const std::uint32_t bits : launch_first_reads<false>()) {
    float value;
    std::memcpy(&value, &bits, sizeof value);
    CHECK(value >= 1.0f);
    CHECK(value <= static_cast<float>(kBlocks));
  }
}

TEST_CASE("emulated shared memory lasts the block: a second call sees the first's writes",
          "[cudaemu]") {
  std::vector<int> out(kBlocks, 0);
  MIXTAPE_CUDA_LAUNCH(dim3(kBlocks), dim3(kThreads), nullptr, calls_twice)(out.data());
  for (const int calls : out) CHECK(calls == 2);
}

TEST_CASE("emulated ldmatrix counts bank conflicts: none in the attention tiles", "[cudaemu]") {
  namespace mt = mixtape;
  // The count: a tile's 8 rows 128 bytes apart share 4 banks, each serving 8 words (7 too many):
  // 28 a tile, 4 tiles; 144 bytes apart, none.
  CHECK(conflicts_of_read_tiles<64>() == 4 * 4 * 7);
  CHECK(conflicts_of_read_tiles<72>() == 0);
  // The tiled kernels (forward, dq, dk and dv; widths 64 and 128, the second with dk and dv in
  // kernels of their own), causal, in bfloat16.
  for (const std::int64_t d : {64, 128}) {
    CAPTURE(d);
    mt::manual_seed(7);
    const auto operand = [&] {
      return mt::cast(mt::normal({2, 70, d}), mt::kBFloat16).to(mt::Device::cuda(0));
    };
    const mt::Tensor q = operand(), k = operand(), v = operand();
    const std::uint64_t calls = mt::cuda_emu::ldmatrix_calls();
    const std::uint64_t conflicts = mt::cuda_emu::ldmatrix_bank_conflicts();
    mt::GradientTape tape;
    tape.watch(q);
    tape.watch(k);
    tape.watch(v);
    const mt::Tensor out = mt::fused_attention(q, k, v, mt::Tensor(), true, 0.125);
    const std::vector<mt::Tensor> grads =
        tape.gradient(mt::sum(mt::cast(out, mt::kFloat32)), {q, k, v});
    REQUIRE(grads.size() == 3);
    CHECK(mt::cuda_emu::ldmatrix_calls() > calls);  // the tiles ran
    CHECK(mt::cuda_emu::ldmatrix_bank_conflicts() == conflicts);
  }
}
