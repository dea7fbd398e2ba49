// Size2: a pair of extents (height, width) for the layers that slide a window over an image
// (Conv2D and the pooling layers) and for their configs.
#pragma once

#include <array>
#include <cstdint>

namespace mixtape::layers {

// A pair of extents (height, width); one number means both: {3, 3}, {2, 1} or 3.
struct Size2 {
  std::int64_t h = 1, w = 1;
  Size2() = default;
  Size2(std::int64_t s) : h(s), w(s) {}  // NOLINT(google-explicit-constructor)
  Size2(std::int64_t height, std::int64_t width) : h(height), w(width) {}
  std::array<std::int64_t, 2> array() const { return {h, w}; }
};

}  // namespace mixtape::layers
