// The host type map: the C++ type that holds one element of each dtype in host memory
// (element_t), and the dtype of a C++ type (dtype_of). The CPU backend keys its kernels on
// these types; other backends have their own map (the CUDA backend's in
// backends/cuda/elementwise_util.cuh) and nothing else.
#pragma once

#include <cstdint>

#include "mixtape/core/dtype.h"
#include "mixtape/core/float8.h"
#include "mixtape/core/half.h"

namespace mixtape {

// element_t<DType::Float16> is half, ...; bool is held in one byte (std::uint8_t, 0 or 1).
template <DType::Code C>
struct element_type;
template <DType::Code C>
using element_t = typename element_type<C>::type;

// dtype_of<half>::value is kFloat16, ...; dtype_of<bool> is kBool.
template <typename T>
struct dtype_of;

#define MIXTAPE_ELEMENT_TYPE(code, T)           \
  template <>                                   \
  struct element_type<DType::code> {            \
    using type = T;                             \
  };                                            \
  template <>                                   \
  struct dtype_of<T> {                          \
    static constexpr DType value = DType::code; \
  };
MIXTAPE_ELEMENT_TYPE(Float32, float)
MIXTAPE_ELEMENT_TYPE(Float16, half)
MIXTAPE_ELEMENT_TYPE(BFloat16, bfloat16)
MIXTAPE_ELEMENT_TYPE(Float64, double)
MIXTAPE_ELEMENT_TYPE(Int32, std::int32_t)
MIXTAPE_ELEMENT_TYPE(Int64, std::int64_t)
MIXTAPE_ELEMENT_TYPE(UInt8, std::uint8_t)
MIXTAPE_ELEMENT_TYPE(Float8E4M3FN, float8_e4m3fn)
MIXTAPE_ELEMENT_TYPE(Float8E5M2, float8_e5m2)
#undef MIXTAPE_ELEMENT_TYPE
template <>
struct element_type<DType::Bool> {
  using type = std::uint8_t;
};
template <>
struct dtype_of<bool> {
  static constexpr DType value = kBool;
};

}  // namespace mixtape
