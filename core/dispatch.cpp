// The kernel table: (op, device type, dtype) -> kernel.
#include "mixtape/core/dispatch.h"

#include <algorithm>
#include <array>
#include <typeindex>
#include <vector>

#include "core/registry_init.h"
#include "mixtape/core/error.h"
#include "mixtape/core/kernels.h"

namespace mixtape {
namespace {

// The calling thread's innermost KernelCensus, if any.
thread_local KernelCensus* t_census = nullptr;

constexpr std::size_t kOps = static_cast<std::size_t>(OpId::kCount);

// The kernel signature of each op, as the table declares it.
const std::array<const std::type_info*, kOps> kSignatures{
#define MIXTAPE_OP_SIGNATURE(name, kernel, ...) &typeid(kernels::kernel*),
    MIXTAPE_OP_TABLE(MIXTAPE_OP_SIGNATURE)
#undef MIXTAPE_OP_SIGNATURE
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

std::optional<OpId> op_by_name(std::string_view name) {
  for (std::size_t i = 0; i < kOps; ++i)
    if (name == detail::kOpInfos[i].name) return static_cast<OpId>(i);
  return std::nullopt;
}

namespace detail {

void register_kernel(OpId op, DeviceType device, DType dtype, AnyKernel fn,
                     const std::type_info& signature) {
  if (!op_info(op).has_kernel)
    throw Error(
        fmt::format("{}: the op table gives it no kernel (a view or a composition of "
                    "other ops); {} registered one for {}",
                    op_name(op), device_type_name(device), dtype.name()));
  if (std::type_index(signature) != std::type_index(*kSignatures[static_cast<std::size_t>(op)]))
    throw Error(
        fmt::format("{}: the kernel {} registered for {} does not have the op table's "
                    "signature",
                    op_name(op), device_type_name(device), dtype.name()));
  auto& e = table()[static_cast<std::size_t>(op)][static_cast<std::size_t>(device)][dtype.index()];
  e.fn = fn;
  e.signature = &signature;
}

AnyKernel lookup_kernel(OpId op, DeviceType device, DType dtype, const std::type_info& signature) {
  ensure_backends();
  count_dispatch(op);
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

void check_kernel_coverage(DeviceType device) {
  std::string missing;
  for (std::size_t i = 0; i < kOps; ++i) {
    const OpInfo& info = kOpInfos[i];
    for (int d = 0; d < DType::kCount; ++d) {
      const DType dtype = DType::all()[d];
      if (!info.dtypes.contains(dtype) || table()[i][static_cast<std::size_t>(device)][d].fn)
        continue;
      missing += fmt::format("{}{} for {}", missing.empty() ? "" : "; ", info.name, dtype.name());
    }
  }
  if (!missing.empty())
    throw Error(
        fmt::format("the {} backend lacks kernels the op table (mixtape/core/op_table.h) "
                    "requires: {}",
                    device_type_name(device), missing));
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
    // Device types with no kernel at all (no backend, or one that registered none) are left
    // out, but the CPU and CUDA ones.
    bool any = d <= static_cast<int>(DeviceType::CUDA);
    for (std::size_t op = 0; op < kOps && !any; ++op)
      for (const Entry& e : table()[op][static_cast<std::size_t>(d)]) any = any || e.fn;
    if (!any) continue;
    out += fmt::format("{}:\n", device_type_name(dev));
    for (std::size_t op = 0; op < kOps; ++op) {
      if (!detail::kOpInfos[op].has_kernel) continue;
      out += fmt::format("  {:<24} {}\n", detail::kOpInfos[op].name,
                         registered_dtypes(static_cast<OpId>(op), dev));
    }
  }
  return out;
}

// --- KernelCensus ---------------------------------------------------------------------------

void detail::count_dispatch(OpId op) {
  if (t_census) ++t_census->counts_[static_cast<std::size_t>(op)];
}

void detail::count_host_read(Device device, std::string_view what) {
  if (!t_census || device.is_cpu()) return;
  auto& reads = t_census->reads_;
  const auto it =
      std::find_if(reads.begin(), reads.end(), [&](const auto& r) { return r.first == what; });
  if (it != reads.end())
    ++it->second;
  else
    reads.emplace_back(std::string(what), 1);
}

KernelCensus::KernelCensus() : outer_(t_census) { t_census = this; }

KernelCensus::~KernelCensus() { t_census = outer_; }

std::int64_t KernelCensus::total() const {
  std::int64_t sum = 0;
  for (const std::int64_t c : counts_) sum += c;
  return sum;
}

std::int64_t KernelCensus::host_reads() const {
  std::int64_t sum = 0;
  for (const auto& r : reads_) sum += r.second;
  return sum;
}

std::int64_t KernelCensus::host_reads(std::string_view what) const {
  for (const auto& r : reads_)
    if (r.first == what) return r.second;
  return 0;
}

std::string KernelCensus::table() const {
  std::vector<std::size_t> ops;
  for (std::size_t i = 0; i < kOps; ++i)
    if (counts_[i] > 0) ops.push_back(i);
  std::stable_sort(ops.begin(), ops.end(),
                   [this](std::size_t a, std::size_t b) { return counts_[a] > counts_[b]; });
  std::string out;
  for (const std::size_t i : ops)
    out += fmt::format("{:<32} {:>8}\n", detail::kOpInfos[i].name, counts_[i]);
  out += fmt::format("{:<32} {:>8}\n", "total", total());
  out += fmt::format("{:<32} {:>8}\n", "host reads of device values", host_reads());
  for (const auto& [what, n] : reads_) out += fmt::format("  {:<30} {:>8}\n", what, n);
  return out;
}

}  // namespace mixtape
