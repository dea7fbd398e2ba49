// DType names, sizes and promotion.
#include "mixtape/core/dtype.h"

#include <array>
#include <utility>

#include "mixtape/core/error.h"

namespace mixtape {
namespace {

struct DTypeInfo {
  std::string_view name;
  std::size_t itemsize;
};

constexpr std::array<DTypeInfo, DType::kCount> kInfo{{
    {"float32", 4},
    {"float16", 2},
    {"bfloat16", 2},
    {"float64", 8},
    {"int32", 4},
    {"int64", 8},
    {"uint8", 1},
    {"bool", 1},
    {"float8_e4m3fn", 1},
    {"float8_e5m2", 1},
}};

constexpr std::array<std::pair<std::string_view, DType::Code>, 14> kAliases{{
    {"fp32", DType::Float32},
    {"float", DType::Float32},
    {"fp16", DType::Float16},
    {"half", DType::Float16},
    {"bf16", DType::BFloat16},
    {"fp64", DType::Float64},
    {"double", DType::Float64},
    {"int", DType::Int32},
    {"long", DType::Int64},
    {"byte", DType::UInt8},
    {"fp8_e4m3", DType::Float8E4M3FN},
    {"e4m3", DType::Float8E4M3FN},
    {"fp8_e5m2", DType::Float8E5M2},
    {"e5m2", DType::Float8E5M2},
}};

constexpr std::array<DType, DType::kCount> kAll{kFloat32,      kFloat16,   kBFloat16, kFloat64,
                                                kInt32,        kInt64,     kUInt8,    kBool,
                                                kFloat8E4M3FN, kFloat8E5M2};

// Rank of a floating dtype by width; float16 and bfloat16 share a rank (neither holds
// the other).
int float_rank(DType d) {
  switch (d.code()) {
    case DType::Float16:
    case DType::BFloat16:
      return 1;
    case DType::Float32:
      return 2;
    case DType::Float64:
      return 3;
    default:
      return 0;
  }
}

int int_rank(DType d) {
  switch (d.code()) {
    case DType::Bool:
      return 0;
    case DType::UInt8:
      return 1;
    case DType::Int32:
      return 2;
    case DType::Int64:
      return 3;
    default:
      return -1;
  }
}

}  // namespace

DType::DType(std::string_view name) {
  for (int i = 0; i < kCount; ++i) {
    if (kInfo[i].name == name) {
      code_ = static_cast<Code>(i);
      return;
    }
  }
  for (const auto& [alias, code] : kAliases) {
    if (alias == name) {
      code_ = code;
      return;
    }
  }
  throw ValueError(
      fmt::format("unknown dtype '{}'; valid names are: {} (aliases: fp32, float, "
                  "fp16, half, bf16, fp64, double, int, long, byte, fp8_e4m3, e4m3, fp8_e5m2, "
                  "e5m2)",
                  name, valid_names()));
}

std::string_view DType::name() const { return kInfo[index()].name; }
std::size_t DType::itemsize() const { return kInfo[index()].itemsize; }
const DType* DType::all() { return kAll.data(); }

std::string DType::valid_names() {
  std::string out;
  for (const auto& info : kInfo) {
    if (!out.empty()) out += ", ";
    out += info.name;
  }
  return out;
}

DType promote_types(DType a, DType b) {
  if (a == b) return a;
  if (a.is_float8() || b.is_float8())
    throw DTypeError(fmt::format(
        "no promotion between {} and {}: a float8 dtype promotes with itself only; cast it "
        "(to float32, or to the other operand's dtype) first",
        a.name(), b.name()));
  if (a.is_floating() && b.is_floating()) {
    const int ra = float_rank(a), rb = float_rank(b);
    if (ra == rb) return kFloat32;  // float16 with bfloat16
    return ra > rb ? a : b;
  }
  if (a.is_floating()) return a;
  if (b.is_floating()) return b;
  // Integers and bool: the wider; uint8 with a signed type gives the signed one.
  return int_rank(a) > int_rank(b) ? a : b;
}

std::string DTypeSet::str() const {
  std::string out;
  for (DType d : kAll) {
    if (!contains(d)) continue;
    if (!out.empty()) out += ", ";
    out += d.name();
  }
  return out.empty() ? "none" : out;
}

}  // namespace mixtape
