// Op dispatch: a table of kernels per (op, device type, dtype) that backends register
// into. Ops look their kernel up here; a missing entry is a KernelNotFoundError naming
// the op, the device and the dtype, and listing the dtypes that do have a kernel.
//
// Every op id has one kernel signature (mixtape/core/kernels.h says which), and the
// table checks it when registering and when looking up.
#pragma once

#include <cstdint>
#include <string>
#include <typeinfo>

#include "mixtape/core/device.h"
#include "mixtape/core/dtype.h"

namespace mixtape {

// clang-format off
#define MIXTAPE_FOR_EACH_OP(X)                                                        \
  /* memory */ X(copy) X(fill) X(cast)                                                \
  /* unary */ X(neg) X(abs) X(exp) X(log) X(sqrt) X(rsqrt) X(tanh) X(sigmoid) X(relu)  \
  X(gelu) X(erf)                                                                      \
  /* binary arithmetic */ X(add) X(sub) X(mul) X(div) X(maximum) X(minimum) X(pow)    \
  X(relu_backward)                                                                    \
  /* comparisons (bool output) */ X(eq) X(ne) X(lt) X(le) X(gt) X(ge)                 \
  /* selection */ X(where) X(gather) X(scatter_add)                                   \
  /* reductions */ X(sum) X(mean) X(max) X(min) X(argmax)                             \
  /* rows */ X(softmax) X(log_softmax)                                                \
  /* linear algebra */ X(matmul)                                                      \
  /* convolution and pooling (NHWC) */ X(conv2d) X(conv2d_backward_input)             \
  X(conv2d_backward_weight) X(max_pool2d) X(max_pool2d_backward) X(avg_pool2d)        \
  X(avg_pool2d_backward)                                                              \
  /* rows of an axis */ X(take) X(index_add)                                          \
  /* training */ X(unscale_check) X(sgd_update) X(rmsprop_update) X(adam_update)
// clang-format on

enum class OpId : std::uint16_t {
#define MIXTAPE_OP_ENUM(name) name,
  MIXTAPE_FOR_EACH_OP(MIXTAPE_OP_ENUM)
#undef MIXTAPE_OP_ENUM
      kCount
};

const char* op_name(OpId op);

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

// A printable table of what is registered (op x dtype, per device type).
std::string kernel_table();

}  // namespace mixtape
