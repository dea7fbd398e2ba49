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
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "mixtape/core/capture.h"
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

namespace detail {
// How a captured kernel call keeps an argument for its replays (capture.h): by value; a span
// as a vector of its elements (what it viewed may be gone by then).
template <typename A>
struct Kept {
  using type = std::decay_t<A>;
  static const type& keep(const type& v) { return v; }
  static const type& pass(const type& v) { return v; }
};
template <typename U>
struct Kept<std::span<const U>> {
  using type = std::vector<U>;
  static type keep(std::span<const U> s) { return type(s.begin(), s.end()); }
  static std::span<const U> pass(const type& v) { return std::span<const U>(v); }
};
}  // namespace detail

template <typename Fn>
class KernelRef;

// A kernel found in the table, called as the function it is. While the calling thread captures
// a step (mixtape/core/capture.h) a call of a kernel of the CPU backend is recorded with its
// arguments (tensors by handle) instead of run; a GPU kernel runs, and its device records the
// launch.
template <typename... Args>
class KernelRef<void(Args...)> {
 public:
  using Fn = void(Args...);
  KernelRef(Fn* fn, OpId op, DeviceType type) : fn_(fn), op_(op), type_(type) {}
  void operator()(Args... args) const {
    if (capture::detail::state() != nullptr) [[unlikely]] {
      std::function<void()> call = [fn = fn_,
                                    kept = std::tuple<typename detail::Kept<Args>::type...>(
                                        detail::Kept<Args>::keep(args)...)] {
        std::apply([fn](const auto&... a) { fn(detail::Kept<Args>::pass(a)...); }, kept);
      };
      if (capture::detail::record_kernel(op_name(op_), type_, call)) return;
    }
    fn_(std::forward<Args>(args)...);
  }
  // The function itself (its calls are never recorded).
  Fn* raw() const { return fn_; }

 private:
  Fn* fn_;
  OpId op_;
  DeviceType type_;
};

// The kernel for (op, device type, dtype) with signature Fn; throws KernelNotFoundError.
template <typename Fn>
KernelRef<Fn> find_kernel(OpId op, DeviceType device, DType dtype) {
  return KernelRef<Fn>(reinterpret_cast<Fn*>(detail::lookup_kernel(op, device, dtype, typeid(Fn*))),
                       op, device);
}

// A printable table of what is registered (op x dtype, per device type), for the ops that
// have kernels.
std::string kernel_table();

namespace detail {
void count_dispatch(OpId op);  // KernelCensus's count of a lookup
// KernelCensus's count of a blocking read of a value on `device` (not the CPU): a copy to the
// host, item / to_vector, a synchronisation. `what` names it in the census's table.
void count_host_read(Device device, std::string_view what);
}  // namespace detail

// Counts, while it lives, the kernels the calling thread dispatches, per op (each lookup of
// a kernel in the table; an op looks its kernel up once per call, and on a GPU each is at
// least one launch): a host-side profile of what a training step runs, independent of the
// device and of timing. Scopes nest; the innermost counts. Other threads are not counted.
// It also counts the host's blocking reads of values on a device other than the CPU (each a
// wait for that device's queue: a copy to the host, item, to_vector, cuda::synchronize), by
// what read; a read started now and finished later (Backend::read_back) is not one.
class KernelCensus {
 public:
  KernelCensus();
  ~KernelCensus();
  KernelCensus(const KernelCensus&) = delete;
  KernelCensus& operator=(const KernelCensus&) = delete;

  std::int64_t count(OpId op) const { return counts_[static_cast<std::size_t>(op)]; }
  std::int64_t total() const;
  // The blocking reads of device values, and of them those named `what`.
  std::int64_t host_reads() const;
  std::int64_t host_reads(std::string_view what) const;
  // One line per op dispatched, the most frequent first ("adam_update 3"), and the total;
  // then the host reads of device values ("host reads of device values 0", and a line per
  // kind when there are any).
  std::string table() const;

 private:
  friend void detail::count_dispatch(OpId op);
  friend void detail::count_host_read(Device device, std::string_view what);
  std::int64_t counts_[kOpCount] = {};
  std::vector<std::pair<std::string, std::int64_t>> reads_;  // by what, in first-read order
  KernelCensus* outer_;
};

}  // namespace mixtape
