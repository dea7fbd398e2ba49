// The "float16 ops use float32 compute" switch, after TensorFlow's
// TF_FP16_CONV_USE_FP32_COMPUTE (see the Keras / TensorFlow mixed-precision dtype cheat
// sheet). With the switch on (the default, "1"), float16 and bfloat16 matmul and conv2d
// accumulate their products in float32 and round once at the end; with it off ("0") they
// accumulate in the operands' own 16-bit type, rounding the running sum after every
// multiply-add, as 16-bit tensor-core / GPU kernels without fp32 accumulation do.
//
// Read by matmul and conv2d through gemm_accumulation_dtype() when they run forward; their
// backward products use the forward's decision. The switch applies to both
// 16-bit float types (float16 and bfloat16); float32 and float64 always accumulate in
// their own type. Reductions (sum, mean, ...) are not affected: they accumulate in float32.
//
// The environment variable MIXTAPE_FP16_USE_FP32_COMPUTE sets the initial value: unset or
// "1" for on, "0" for off; anything else is a ValueError on first use.
// set_fp16_use_fp32_compute() and Fp16UseFp32ComputeScope override it for the whole
// process (not per thread).
#pragma once

#include "mixtape/core/dtype.h"

namespace mixtape {

// The environment variable read on first use.
inline constexpr const char* kFp16UseFp32ComputeEnv = "MIXTAPE_FP16_USE_FP32_COMPUTE";

// Whether float16 / bfloat16 matmul and conv2d accumulate in float32 (true, the default)
// or in their 16-bit type (false). The first call reads MIXTAPE_FP16_USE_FP32_COMPUTE
// (once, thread-safe) unless set_fp16_use_fp32_compute() was called before; an invalid
// value throws ValueError naming the variable, the value and the valid values.
bool fp16_use_fp32_compute();

// Overrides the switch for the whole process (an atomic store; the environment is not
// read afterwards).
void set_fp16_use_fp32_compute(bool on);

// Sets the switch for the lifetime of the guard and restores the previous value after.
// Process-wide like set_fp16_use_fp32_compute(): scopes on different threads interleave.
class Fp16UseFp32ComputeScope {
 public:
  explicit Fp16UseFp32ComputeScope(bool on);
  ~Fp16UseFp32ComputeScope();
  Fp16UseFp32ComputeScope(const Fp16UseFp32ComputeScope&) = delete;
  Fp16UseFp32ComputeScope& operator=(const Fp16UseFp32ComputeScope&) = delete;

 private:
  bool previous_;
};

// The dtype a matmul / conv2d on `operands` accumulates in: float16 and bfloat16 give
// float32 while the switch is on and themselves while it is off; float32 and float64 give
// themselves; any other dtype is returned unchanged.
DType gemm_accumulation_dtype(DType operands);

namespace detail {
// The switch's value for an environment value (nullptr: unset): nullptr or "1" -> true,
// "0" -> false; anything else throws ValueError naming the variable, the value and the
// valid values. What fp16_use_fp32_compute() applies to the environment on first use.
bool parse_fp16_use_fp32_compute(const char* value);
}  // namespace detail

}  // namespace mixtape
