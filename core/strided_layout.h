// The merged geometry of strided operands over one shape: what the backends' elementwise and
// copy kernels walk (backends/cpu/elementwise.cpp, backends/cpu/memory.cpp and
// backends/cuda/elementwise_util.cuh). Private to the library: core and the backends.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "mixtape/core/shape.h"

namespace mixtape::detail {

// Extents and, per dimension, each of the K operands' stride (in elements).
template <int K>
struct StridedLayout {
  std::vector<std::int64_t> shape;
  std::vector<std::array<std::int64_t, K>> strides;
  // True when every operand is contiguous over the shape (one dimension, stride 1).
  bool contiguous() const {
    if (shape.size() != 1) return false;
    for (std::size_t k = 0; k < K; ++k)
      if (strides[0][k] != 1) return false;
    return true;
  }
};

// The geometry of K operands of `shape` with strides `st`: size-1 dimensions dropped, and
// neighbours merged where every operand allows it (outer d and inner d + 1 merge when
// stride[d] == stride[d + 1] * shape[d + 1] for each operand). A single element (or a rank-0
// shape) is one dimension of extent 1 and stride 1.
template <int K>
StridedLayout<K> coalesce(const Shape& shape, const std::array<const Strides*, K>& st) {
  StridedLayout<K> l;
  for (std::size_t d = 0; d < shape.rank(); ++d) {
    if (shape[d] == 1) continue;
    std::array<std::int64_t, K> s{};
    for (std::size_t k = 0; k < K; ++k) s[k] = (*st[k])[d];
    bool merge = !l.shape.empty();
    for (std::size_t k = 0; k < K && merge; ++k) merge = l.strides.back()[k] == s[k] * shape[d];
    if (merge) {
      l.shape.back() *= shape[d];
      l.strides.back() = s;
    } else {
      l.shape.push_back(shape[d]);
      l.strides.push_back(s);
    }
  }
  if (l.shape.empty()) {
    l.shape.push_back(1);
    std::array<std::int64_t, K> one;
    one.fill(1);
    l.strides.push_back(one);
  }
  return l;
}

}  // namespace mixtape::detail
