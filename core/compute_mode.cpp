// The float16 / bfloat16 matmul and conv2d accumulation switch
// (MIXTAPE_FP16_USE_FP32_COMPUTE).
#include "mixtape/core/compute_mode.h"

#include <atomic>
#include <string_view>

#include "core/env.h"

namespace mixtape {
namespace {

// The switch: -1 until it is decided (by the environment on first use, or by a call to
// set_fp16_use_fp32_compute()), then 0 (off) or 1 (on).
std::atomic<int> g_switch{-1};

// The environment's value, read once: a function-local static is initialised by exactly
// one thread. When parsing throws, the static stays uninitialised and the next call reads
// (and throws) again.
static_assert(std::string_view(detail::env::kFp16UseFp32Compute.name) == kFp16UseFp32ComputeEnv);
bool from_environment() {
  static const bool value = detail::env::kFp16UseFp32Compute.read();
  return value;
}

}  // namespace

namespace detail {
bool parse_fp16_use_fp32_compute(const char* value) {
  return env::kFp16UseFp32Compute.parse(value);
}
}  // namespace detail

bool fp16_use_fp32_compute() {
  int s = g_switch.load(std::memory_order_acquire);
  if (s < 0) {
    int expected = -1;
    // A concurrent set_fp16_use_fp32_compute() wins over the environment.
    g_switch.compare_exchange_strong(expected, from_environment() ? 1 : 0,
                                     std::memory_order_acq_rel);
    s = g_switch.load(std::memory_order_acquire);
  }
  return s == 1;
}

void set_fp16_use_fp32_compute(bool on) { g_switch.store(on ? 1 : 0, std::memory_order_release); }

Fp16UseFp32ComputeScope::Fp16UseFp32ComputeScope(bool on) : previous_(fp16_use_fp32_compute()) {
  set_fp16_use_fp32_compute(on);
}

Fp16UseFp32ComputeScope::~Fp16UseFp32ComputeScope() { set_fp16_use_fp32_compute(previous_); }

DType gemm_accumulation_dtype(DType operands) {
  if (operands.is_reduced_float()) return fp16_use_fp32_compute() ? kFloat32 : operands;
  return operands;  // float32, float64 accumulate in themselves; others pass through
}

}  // namespace mixtape
