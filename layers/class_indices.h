// Private to layers/: class indices (sparse labels, embedding ids) from tensors of any dtype.
#pragma once

#include <cstdint>
#include <string_view>

#include "mixtape/core/tensor.h"

namespace mixtape::layers::detail {

// `indices` as int64 indices into `n` entries (classes, embedding rows). Integer and bool
// tensors are cast (their range is checked by the gather or take that uses them). Floating
// ones are read once on the host: a NaN, an infinity or a value outside [0, n) throws
// IndexError "<who>: <what> must lie in [0, n); got <value> at flat position <i> (<dtype and
// shape>)" (no "<who>: " when who is empty), naming the first bad one; the others are truncated
// toward zero, as Keras casts them.
Tensor class_indices(std::string_view who, std::string_view what, const Tensor& indices,
                     std::int64_t n);

}  // namespace mixtape::layers::detail
