// What the bundled apps share about running on several ranks (under mpirun).
#pragma once

#include <mixtape/mixtape.h>

#include <cstdint>
#include <vector>

namespace apps {

// Rank 0's seed on every rank (the weights, the data order, the windows drawn): ranks
// started with different --seed still train one model on one data order.
inline std::uint64_t rank0_seed(std::uint64_t seed) {
  namespace mt = mixtape;
  if (mt::distributed::world_size() == 1) return seed;
  mt::Tensor t = mt::from_vector(std::vector<std::int64_t>{static_cast<std::int64_t>(seed)}, {1});
  mt::distributed::broadcast(t, 0);
  return static_cast<std::uint64_t>(t.item<std::int64_t>());
}

}  // namespace apps
