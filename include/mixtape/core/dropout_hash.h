// Counter-based dropout decisions: whether element `index` of a tensor survives dropout is a
// function of a seed and the index alone, the same on every backend and in every pass, so
// that a fused kernel's backward pass finds the forward's mask again without storing it
// (the fused attention's dropout on its weights, mixtape/core/kernels.h). SplitMix64's
// finaliser of seed + (index + 1) * the golden ratio; an element survives when the top 32
// bits are at least rate * 2^32.
#pragma once

#include <cstdint>

#include "mixtape/core/host_device.h"

namespace mixtape {

// The threshold of a dropout rate in [0, 1): rate * 2^32, rounded down.
inline std::uint32_t dropout_threshold(double rate) {
  const double t = rate * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<std::uint32_t>(t);
}

// Whether element `index` survives under `seed` at the rate whose threshold is `threshold`.
MIXTAPE_HOST_DEVICE inline bool dropout_keeps(std::uint64_t seed, std::uint64_t index,
                                              std::uint32_t threshold) {
  std::uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<std::uint32_t>(z >> 32) >= threshold;
}

}  // namespace mixtape
