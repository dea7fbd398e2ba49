// DType: the element type tag every Tensor carries.
//
// Canonical names: float32, float16, bfloat16, float64, int32, int64, uint8, bool,
// float8_e4m3fn, float8_e5m2. Accepted aliases when parsing: fp32/float, fp16/half, bf16,
// fp64/double, int, long, byte, fp8_e4m3/e4m3, fp8_e5m2/e5m2. Names print in canonical form.
// The two float8 dtypes (mixtape/core/float8.h) store, copy and cast only: they are neither
// floating (no op computes in them) nor integral. An unknown name throws ValueError listing the
// valid names.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace mixtape {

class DType {
 public:
  // Codes are stable and index the dispatch table.
  enum Code : std::uint8_t {
    Float32 = 0,
    Float16,
    BFloat16,
    Float64,
    Int32,
    Int64,
    UInt8,
    Bool,
    Float8E4M3FN,
    Float8E5M2
  };
  static constexpr int kCount = 10;

  constexpr DType() : code_(Float32) {}
  constexpr DType(Code code) : code_(code) {}  // NOLINT(google-explicit-constructor)
  // Parses a name ("float16", "fp16", "half", ...); throws ValueError when unknown.
  DType(std::string_view name);                               // NOLINT(google-explicit-constructor)
  DType(const char* name) : DType(std::string_view(name)) {}  // NOLINT
  DType(const std::string& name) : DType(std::string_view(name)) {}  // NOLINT

  constexpr Code code() const { return code_; }
  constexpr int index() const { return static_cast<int>(code_); }
  std::string_view name() const;
  std::size_t itemsize() const;
  constexpr bool is_floating() const {
    return code_ == Float32 || code_ == Float16 || code_ == BFloat16 || code_ == Float64;
  }
  // float16 and bfloat16: stored in 16 bits, computed in float32 by the kernels.
  constexpr bool is_reduced_float() const { return code_ == Float16 || code_ == BFloat16; }
  // float8_e4m3fn and float8_e5m2: stored in 8 bits; cast to a wider dtype to compute.
  constexpr bool is_float8() const { return code_ == Float8E4M3FN || code_ == Float8E5M2; }
  constexpr bool is_integral() const { return !is_floating() && !is_float8() && code_ != Bool; }

  friend constexpr bool operator==(DType a, DType b) { return a.code_ == b.code_; }

  // All dtypes, in code order.
  static const DType* all();
  // "float32, float16, ..." for error messages and docs.
  static std::string valid_names();

 private:
  Code code_;
};

inline constexpr DType kFloat32{DType::Float32};
inline constexpr DType kFloat16{DType::Float16};
inline constexpr DType kBFloat16{DType::BFloat16};
inline constexpr DType kFloat64{DType::Float64};
inline constexpr DType kInt32{DType::Int32};
inline constexpr DType kInt64{DType::Int64};
inline constexpr DType kUInt8{DType::UInt8};
inline constexpr DType kBool{DType::Bool};
inline constexpr DType kFloat8E4M3FN{DType::Float8E4M3FN};
inline constexpr DType kFloat8E5M2{DType::Float8E5M2};

// A set of dtypes (a bit per code), usable in constant expressions: the dtypes an op's
// kernels must cover (mixtape/core/op_table.h).
class DTypeSet {
 public:
  constexpr DTypeSet() = default;
  constexpr DTypeSet(std::initializer_list<DType> dtypes) {
    for (DType d : dtypes) bits_ |= bit(d);
  }
  constexpr bool contains(DType d) const { return (bits_ & bit(d)) != 0; }
  constexpr bool empty() const { return bits_ == 0; }
  friend constexpr bool operator==(DTypeSet a, DTypeSet b) { return a.bits_ == b.bits_; }
  // "float32, float16" in code order; "none" when empty.
  std::string str() const;

 private:
  static constexpr std::uint16_t bit(DType d) {
    return static_cast<std::uint16_t>(1u << d.index());
  }
  std::uint16_t bits_ = 0;
};

// The dtype sets the op table names.
namespace dtype_sets {
inline constexpr DTypeSet None{};
inline constexpr DTypeSet Floating{kFloat32, kFloat16, kBFloat16, kFloat64};
inline constexpr DTypeSet Numeric{kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kInt64};
inline constexpr DTypeSet All{kFloat32, kFloat16, kBFloat16, kFloat64,
                              kInt32,   kInt64,   kUInt8,    kBool};
// float64 alone: state the device keeps in float64 (the loss scale).
inline constexpr DTypeSet Float64{kFloat64};
// The float8 dtypes: the scaled FP8 matmul.
inline constexpr DTypeSet Float8{kFloat8E4M3FN, kFloat8E5M2};
// All and the float8 dtypes: the ops that only move and convert values (copy, fill, cast).
inline constexpr DTypeSet Storage{kFloat32, kFloat16, kBFloat16, kFloat64,      kInt32,
                                  kInt64,   kUInt8,   kBool,     kFloat8E4M3FN, kFloat8E5M2};
}  // namespace dtype_sets

// Promotion for binary ops. Equal dtypes stay; two floating dtypes promote to the
// wider one, and float16 with bfloat16 (neither holds the other) gives float32; an
// integer or bool with a floating dtype gives the floating dtype; two integer dtypes
// give the wider one. Anything else (bool with bool stays bool) is as listed in
// docs/dtypes.md. A float8 dtype promotes with itself only: with any other dtype it is a
// DTypeError (cast it first; FP8 values are scaled, and the scale is the caller's).
DType promote_types(DType a, DType b);

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::DType> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(mixtape::DType d, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(d.name(), ctx);
  }
};
