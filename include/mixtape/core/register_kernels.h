// For backends: registering kernels from the op table (mixtape/core/op_table.h).
//
// A backend supplies kernel templates and its own type map (the C++ type that holds each
// dtype on its device); the loops over ops and dtypes come from the table:
//
//   // every dtype the table requires of matmul, each with the kernel gemm<T>:
//   register_op<OpId::matmul>(DeviceType::CPU, []<DType::Code C>() {
//     return &gemm<element_t<C>>;
//   });
//   // the same, written with the shorthand below:
//   MIXTAPE_REGISTER_KERNEL(DeviceType::CPU, element_t, matmul, gemm);
//   // every op whose kernel is a UnaryFn (neg, abs, exp, ...), each through the functor
//   // UnaryOp<op> the backend defines for it; an op without one does not compile:
//   for_each_op([]<OpId op>() {
//     if constexpr (op_info(op).kernel == "UnaryFn")
//       register_op<op>(DeviceType::CPU, []<DType::Code C>() {
//         return &unary_kernel<element_t<C>, UnaryOp<op>>;
//       });
//   });
//
// A kernel that does not compile for a dtype the table requires is a build error; an op
// no registration covers is an error at start-up (mixtape/core/dispatch.h).
#pragma once

#include <cstddef>
#include <utility>

#include "mixtape/core/dispatch.h"
#include "mixtape/core/element_type.h"
#include "mixtape/core/kernels.h"

namespace mixtape {

// The kernel signature the table gives op (kernels::UnaryFn, ..., kernels::NoKernel).
template <OpId op>
struct OpKernel;
#define MIXTAPE_OP_KERNEL(name, kernel, ...) \
  template <>                                \
  struct OpKernel<OpId::name> {              \
    using type = kernels::kernel;            \
  };
MIXTAPE_OP_TABLE(MIXTAPE_OP_KERNEL)
#undef MIXTAPE_OP_KERNEL
template <OpId op>
using op_kernel_t = typename OpKernel<op>::type;

// Calls f.template operator()<op>() for every op of the table, in the table's order (the
// kernel names tell apart ops of one C++ signature: copy, cast, the unary ops and the row
// ops all take (x, out)).
template <typename F>
void for_each_op(F&& f) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (f.template operator()<static_cast<OpId>(I)>(), ...);
  }
  (std::make_index_sequence<kOpCount>{});
}

// Calls f.template operator()<code>() for the dtype code known only at run time (cast's
// output dtype): f is instantiated for every dtype, one call runs; none for an unknown code.
template <typename F>
void visit_code(DType::Code code, F&& f) {
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (void)((code == static_cast<DType::Code>(I) &&
            (f.template operator()<static_cast<DType::Code>(I)>(), true)) ||
           ...);
  }
  (std::make_index_sequence<DType::kCount>{});
}

// Registers on `device`, for every dtype the table requires of op, the kernel
// make.template operator()<code>() returns (a pointer to a function of op's signature).
template <OpId op, typename Make>
void register_op(DeviceType device, Make&& make) {
  using Fn = op_kernel_t<op>;
  static_assert(op_info(op).has_kernel, "the op table gives this op no kernel");
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    auto one = [&]<DType::Code C>() {
      if constexpr (op_info(op).dtypes.contains(DType(C))) {
        Fn* fn = make.template operator()<C>();
        register_kernel<Fn>(op, device, DType(C), fn);
      }
    };
    (one.template operator()<static_cast<DType::Code>(I)>(), ...);
  }
  (std::make_index_sequence<DType::kCount>{});
}

}  // namespace mixtape

// Registers on `device` the kernel template fn for op: fn<Map<C>, extra...> for every dtype
// code C the table requires of op, Map being the backend's type map (element_t on the CPU,
// the CUDA backend's dev_t). The register_op call that most kernels need, in one line.
#define MIXTAPE_REGISTER_KERNEL(device, Map, op, fn, ...) \
  ::mixtape::register_op<::mixtape::OpId::op>(            \
      device, []<::mixtape::DType::Code C>() { return &fn<Map<C> __VA_OPT__(, ) __VA_ARGS__>; })
