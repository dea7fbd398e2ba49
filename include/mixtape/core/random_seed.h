// The seed of a counter-based random op (dropout and fused_attention's dropout: which elements
// survive is a function of the seed and each element's position, mixtape/core/dropout_hash.h).
// A seed is a number, or a tensor on the op's device holding one: the form a captured training
// step needs (mixtape/core/capture.h), whose replays must each draw a new mask without running
// the step's host code again.
//
//   mt::Tensor y = mt::dropout(x, 0.1, generator.next_u64());  // a number
//   mt::Tensor y = mt::dropout(x, 0.1, mt::draw_seed(generator, x.device()));  // capturable
#pragma once

#include <cstdint>

#include "mixtape/core/device.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

struct RandomSeed {
  RandomSeed(std::uint64_t value = 0) : value(value) {}  // NOLINT: a number is a seed
  std::uint64_t value;
  // When defined: an int64 tensor of one element on the op's device whose bits are the seed;
  // the kernels read it there, when they run, in place of `value`.
  Tensor on_device;
};

// A new seed from gen for an op on `device`. Outside a capture: gen's next number. While the
// calling thread captures a step: an int64 tensor on `device` that a before_replay hook fills
// with gen's next number before each replay, so that each replay draws a new mask, and the
// numbers a run of eager steps would have drawn (the hooks run in the order the seeds were
// drawn). The hook holds a copy of gen (copies share one state): the graph keeps it alive.
RandomSeed draw_seed(Generator& gen, Device device);

}  // namespace mixtape
