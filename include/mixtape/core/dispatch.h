// Op dispatch: a table of kernels per (op, device type, dtype) that backends register
// into. Ops look their kernel up here; a missing entry is a KernelNotFoundError naming
// the op, the device and the dtype, and listing the dtypes that do have a kernel.
//
// The ops, their kernel signatures and the dtypes each backend must cover are the op
// table's (mixtape/core/op_table.h). Registration checks a kernel's signature against the
// table; once the backends have registered, every (op, dtype) the table requires must
// have a kernel on each of them, or the first use of mixtape throws an Error naming what
// is missing. Backends register through mixtape/core/register_kernels.h.
#pragma once

#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>

#include "mixtape/core/device.h"
#include "mixtape/core/dtype.h"
#include "mixtape/core/op_table.h"

namespace mixtape {

enum class OpId : std::uint16_t {
#define MIXTAPE_OP_ENUM(name, ...) name,
  MIXTAPE_OP_TABLE(MIXTAPE_OP_ENUM)
#undef MIXTAPE_OP_ENUM
      kCount
};
inline constexpr int kOpCount = static_cast<int>(OpId::kCount);

// What the op table says of an op.
struct OpInfo {
  const char* name;
  std::string_view kernel;  // the name of its kernel signature: "UnaryFn", ..., "NoKernel"
  bool has_kernel;          // false for views and compositions (NoKernel)
  DTypeSet dtypes;          // the dtypes every backend must have a kernel for
  bool differentiable;      // records a backward rule
};

namespace detail {
inline constexpr OpInfo kOpInfos[] = {
#define MIXTAPE_OP_INFO(name, kernel, dtypes, amp, grad) \
  {#name, #kernel, std::string_view(#kernel) != "NoKernel", dtype_sets::dtypes, grad},
    MIXTAPE_OP_TABLE(MIXTAPE_OP_INFO)
#undef MIXTAPE_OP_INFO
};
static_assert(std::size(kOpInfos) == kOpCount);
}  // namespace detail

constexpr const OpInfo& op_info(OpId op) { return detail::kOpInfos[static_cast<std::size_t>(op)]; }
constexpr const char* op_name(OpId op) { return op_info(op).name; }
// The op of a name of the table; nullopt when there is none.
std::optional<OpId> op_by_name(std::string_view name);

namespace detail {
using AnyKernel = void (*)();
void register_kernel(OpId op, DeviceType device, DType dtype, AnyKernel fn,
                     const std::type_info& signature);
AnyKernel lookup_kernel(OpId op, DeviceType device, DType dtype,
                        const std::type_info& signature);  // throws when absent
}  // namespace detail

// True when a kernel for (op, device type, dtype) is registered.
bool supports(OpId op, DeviceType device, DType dtype);

// Registers `fn` (a function pointer of the op's kernel signature).
template <typename Fn>
void register_kernel(OpId op, DeviceType device, DType dtype, Fn* fn) {
  detail::register_kernel(op, device, dtype, reinterpret_cast<detail::AnyKernel>(fn), typeid(Fn*));
}

// The kernel for (op, device type, dtype) with signature Fn; throws KernelNotFoundError.
template <typename Fn>
Fn* find_kernel(OpId op, DeviceType device, DType dtype) {
  return reinterpret_cast<Fn*>(detail::lookup_kernel(op, device, dtype, typeid(Fn*)));
}

// A printable table of what is registered (op x dtype, per device type), for the ops that
// have kernels.
std::string kernel_table();

namespace detail {
void count_dispatch(OpId op);  // KernelCensus's count of a lookup
}  // namespace detail

// Counts, while it lives, the kernels the calling thread dispatches, per op (each lookup of
// a kernel in the table; an op looks its kernel up once per call, and on a GPU each is at
// least one launch): a host-side profile of what a training step runs, independent of the
// device and of timing. Scopes nest; the innermost counts. Other threads are not counted.
class KernelCensus {
 public:
  KernelCensus();
  ~KernelCensus();
  KernelCensus(const KernelCensus&) = delete;
  KernelCensus& operator=(const KernelCensus&) = delete;

  std::int64_t count(OpId op) const { return counts_[static_cast<std::size_t>(op)]; }
  std::int64_t total() const;
  // One line per op dispatched, the most frequent first ("adam_update 3"), and the total.
  std::string table() const;

 private:
  friend void detail::count_dispatch(OpId op);
  std::int64_t counts_[kOpCount] = {};
  KernelCensus* outer_;
};

}  // namespace mixtape
