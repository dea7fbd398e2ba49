// The heads of the fused attention's operands as its kernels read and write them
// (mixtape/core/kernels.h's AttentionFn): a view [n1, n2, rows, width] of n = n1 n2 heads,
// any strides on the first three axes and stride 1 along the last, head h being [h / n2, h %
// n2]. So the heads of a projection [batch, positions, heads, width], viewed [batch, heads,
// positions, width], are read and written where they lie, with no transposing copy.
#pragma once

#include <cstdint>
#include <type_traits>

#include "mixtape/core/host_device.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

// Where row i of head h starts (in elements of T); a null base (an undefined tensor, as an
// absent mask) gives null rows.
template <typename T>
struct HeadRows {
  T* base = nullptr;
  std::int64_t n2 = 1;     // the heads of the second axis
  std::int64_t outer = 0;  // the strides of the two head axes
  std::int64_t inner = 0;
  std::int64_t stride = 0;  // from one row to the next
  MIXTAPE_HOST_DEVICE T* row(std::int64_t h, std::int64_t i) const {
    return base ? base + (h / n2) * outer + (h % n2) * inner + i * stride : nullptr;
  }

  // One head's rows: head(h).row(i) == row(h, i), the head's place (a division by n2) found
  // once. A kernel's loop over rows takes this: a 64-bit division per row costs more than
  // the row's arithmetic, and a compiler may not move it out of a conditional load.
  struct Head {
    T* base = nullptr;
    std::int64_t stride = 0;
    MIXTAPE_HOST_DEVICE T* row(std::int64_t i) const { return base ? base + i * stride : nullptr; }
  };
  MIXTAPE_HOST_DEVICE Head head(std::int64_t h) const {
    return {base ? base + (h / n2) * outer + (h % n2) * inner : nullptr, stride};
  }
};

// x as HeadRows: a view [n1, n2, rows, width] as above, or [n, rows, width] (n2 = n); undefined
// gives a null base. T is the caller's to match to x's dtype (const T: read only).
template <typename T>
HeadRows<T> head_rows(const Tensor& x) {
  HeadRows<T> r;
  if (!x.defined()) return r;
  if constexpr (std::is_const_v<T>)
    r.base = static_cast<T*>(x.const_data_ptr());
  else
    r.base = static_cast<T*>(x.data_ptr());
  const auto& st = x.strides();
  if (x.rank() == 4) {
    r.n2 = x.dim(1);
    r.outer = st[0];
    r.inner = st[1];
    r.stride = st[2];
  } else {
    r.n2 = x.dim(0);
    r.inner = st[0];
    r.stride = st[1];
  }
  return r;
}

// The number of heads n of such a view.
inline std::int64_t head_count(const Tensor& x) {
  return x.rank() == 4 ? x.dim(0) * x.dim(1) : x.dim(0);
}

}  // namespace mixtape
