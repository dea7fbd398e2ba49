// Dropout on CUDA (op dropout): a thread per element, its factor 1 / (1 - rate) or 0 from the
// counter-based hash of mixtape/core/dropout_hash.h (the mask is never stored: the backward
// pass runs this kernel on the gradient). Written by hand: cuDNN's dropout keeps a state
// buffer and a reserve space with the mask, which this op's contract (the fused attention's
// mask again, from a seed that may lie on the device) does not fit. Written without a GPU at
// hand; the conformance sweep checks it against the formula.
#include <cstdint>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "mixtape/core/dropout_hash.h"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// x * Z, not a select: a NaN or an infinity dropped still gives NaN (a loss scale's overflow
// check sees it). seed_at, when not null, holds the seed (a captured step's, written before
// each replay).
template <typename T>
__global__ void dropout_kernel(const T* __restrict__ x, T* __restrict__ out, int64_t n,
                               std::uint64_t seed, const std::int64_t* __restrict__ seed_at,
                               std::uint32_t threshold, compute_of<T> keep) {
  using C = compute_of<T>;
  const std::uint64_t s = seed_at ? static_cast<std::uint64_t>(*seed_at) : seed;
  MIXTAPE_GRID_LOOP(i, n) {
    const C z = dropout_keeps(s, static_cast<std::uint64_t>(i), threshold) ? keep : C(0);
    out[i] = store<T>(load(x[i]) * z);
  }
}

template <typename T>
void dropout_host(const Tensor& x, double rate, std::uint64_t seed, const Tensor& seed_at,
                  const Tensor& out) {
  using C = compute_of<T>;
  const int64_t n = x.numel();
  if (n == 0) return;
  OnDevice on(out);
  launch_1d(
      {"dropout kernel", n, on.s}, dropout_kernel<T>, static_cast<const T*>(x.const_data_ptr()),
      static_cast<T*>(out.data_ptr()), n, seed,
      seed_at.defined() ? static_cast<const std::int64_t*>(seed_at.const_data_ptr()) : nullptr,
      dropout_threshold(rate), static_cast<C>(1.0 / (1.0 - rate)));
}

}  // namespace

void register_dropout_kernels() { MIXTAPE_CUDA_KERNEL(dropout, dropout_host); }

}  // namespace mixtape::cuda_backend
