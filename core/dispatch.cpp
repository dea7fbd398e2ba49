// The kernel table: (op, device type, dtype) -> kernel.
#include "mixtape/core/dispatch.h"

#include <array>
#include <typeindex>

#include "core/registry_init.h"
#include "mixtape/core/error.h"

namespace mixtape {
namespace {

constexpr std::size_t kOps = static_cast<std::size_t>(OpId::kCount);

constexpr std::array<const char*, kOps> kOpNames{
#define MIXTAPE_OP_NAME(name) #name,
    MIXTAPE_FOR_EACH_OP(MIXTAPE_OP_NAME)
#undef MIXTAPE_OP_NAME
};

struct Entry {
  detail::AnyKernel fn = nullptr;
  const std::type_info* signature = nullptr;
};

using Table = std::array<std::array<std::array<Entry, DType::kCount>, kDeviceTypeCount>, kOps>;

Table& table() {
  static Table t{};
  return t;
}

const char* device_type_name(DeviceType d) { return d == DeviceType::CPU ? "cpu" : "cuda"; }

std::string registered_dtypes(OpId op, DeviceType device) {
  std::string out;
  for (int i = 0; i < DType::kCount; ++i) {
    if (table()[static_cast<std::size_t>(op)][static_cast<std::size_t>(device)][i].fn) {
      if (!out.empty()) out += ", ";
      out += DType::all()[i].name();
    }
  }
  return out.empty() ? "none" : out;
}

}  // namespace

const char* op_name(OpId op) { return kOpNames[static_cast<std::size_t>(op)]; }

namespace detail {

void register_kernel(OpId op, DeviceType device, DType dtype, AnyKernel fn,
                     const std::type_info& signature) {
  auto& e = table()[static_cast<std::size_t>(op)][static_cast<std::size_t>(device)][dtype.index()];
  e.fn = fn;
  e.signature = &signature;
}

AnyKernel lookup_kernel(OpId op, DeviceType device, DType dtype, const std::type_info& signature) {
  ensure_backends();
  const auto& e =
      table()[static_cast<std::size_t>(op)][static_cast<std::size_t>(device)][dtype.index()];
  if (!e.fn)
    throw KernelNotFoundError(fmt::format(
        "{}: no kernel for dtype {} on device {} (registered dtypes there: {})", op_name(op),
        dtype.name(), device_type_name(device), registered_dtypes(op, device)));
  if (std::type_index(*e.signature) != std::type_index(signature))
    throw Error(fmt::format("{}: kernel for {} on {} was registered with another signature",
                            op_name(op), dtype.name(), device_type_name(device)));
  return e.fn;
}

}  // namespace detail

bool supports(OpId op, DeviceType device, DType dtype) {
  detail::ensure_backends();
  return table()[static_cast<std::size_t>(op)][static_cast<std::size_t>(device)][dtype.index()]
             .fn != nullptr;
}

std::string kernel_table() {
  detail::ensure_backends();
  std::string out;
  for (int d = 0; d < kDeviceTypeCount; ++d) {
    const auto dev = static_cast<DeviceType>(d);
    out += fmt::format("{}:\n", device_type_name(dev));
    for (std::size_t op = 0; op < kOps; ++op)
      out +=
          fmt::format("  {:<24} {}\n", kOpNames[op], registered_dtypes(static_cast<OpId>(op), dev));
  }
  return out;
}

}  // namespace mixtape
