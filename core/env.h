// Private to mixtape: the MIXTAPE_* environment variables the library reads, and one
// parser per kind of value (a 0/1 switch, a bounded non-negative integer, a list of names).
// Every reader of a variable goes through these, so that every bad value is refused the
// same way: a ValueError naming the variable, the value and the accepted values, thrown
// when the variable is first read (docs/environment.md lists every variable, when it is
// read, and what it accepts). Nothing here reads the environment at static-initialisation
// time: a reader calls read() from a function on first use, so the error reaches the
// caller as an exception.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace mixtape::detail::env {

// A switch: exactly "0" or "1" (no spaces, no "true"/"on"; an empty value is refused too).
struct BoolVar {
  const char* name;
  bool unset;       // the value when the variable is not set
  const char* off;  // what "0" does, for the error message
  const char* on;   // what "1" does

  // The switch for `value` (nullptr: the variable is not set).
  bool parse(const char* value) const;
  // parse() of the variable's current value.
  bool read() const;
};

// A non-negative decimal integer in [0, max] (digits only: no sign, no spaces, no unit).
struct UIntVar {
  const char* name;
  std::uint64_t unset;  // the value when the variable is not set
  std::uint64_t max;
  const char* meaning;  // what the number is, for the error message

  std::uint64_t parse(const char* value) const;
  std::uint64_t read() const;
};

// A comma-separated list of names out of a fixed set (spaces around a name are ignored;
// an empty value is the empty list; an empty name between commas is refused). The valid
// names are given to parse(): they belong to the reader.
struct NameListVar {
  const char* name;
  const char* what;  // what a name names ("op"), for the error message

  std::vector<std::string> parse(const char* value, std::span<const std::string_view> valid) const;
  std::vector<std::string> read(std::span<const std::string_view> valid) const;
};

// --- The variables (docs/environment.md is their table) ----------------------------------

// core/compute_mode.cpp: float16/bfloat16 matmul and conv2d accumulate in float32 (1).
inline constexpr BoolVar kFp16UseFp32Compute{
    "MIXTAPE_FP16_USE_FP32_COMPUTE", true,
    "float16/bfloat16 matmul and conv2d accumulate in their 16-bit type",
    "they accumulate in float32"};

// layers/trace.cpp: log every leaf layer call's dtypes (spdlog, info level).
inline constexpr BoolVar kTraceDtypes{"MIXTAPE_TRACE_DTYPES", false, "no dtype log",
                                      "log every layer call's dtypes"};

// backends/cpu/onednn.cpp: CPU convolutions and pooling on oneDNN where it is faster.
inline constexpr BoolVar kCpuOneDnn{"MIXTAPE_CPU_ONEDNN", true,
                                    "CPU convolutions and pooling without oneDNN",
                                    "with oneDNN where it is faster"};

// backends/cpu/threads.cpp: fewer OpenMP threads while other processes keep cores busy.
inline constexpr BoolVar kCpuThreadsAdapt{
    "MIXTAPE_CPU_THREADS_ADAPT", true, "the CPU kernels always run on the OpenMP default count",
    "fewer threads while other processes keep cores busy, unless OMP_NUM_THREADS is set"};

// backends/cuda/gemm.cpp: the fused linear op's bias and activation in cuBLASLt's epilogues.
inline constexpr BoolVar kCudaLtEpilogues{
    "MIXTAPE_CUDA_LT_EPILOGUES", true,
    "the fused linear op applies its bias and activation in a kernel of its own on CUDA",
    "in cuBLASLt's epilogues (bias, gelu_tanh) where cuBLASLt has an algorithm for them"};

// backends/cuda/attention.cu: the fused attention on tensor cores (float16 and bfloat16, head
// dims 32, 64, 96 and 128).
inline constexpr BoolVar kCudaMmaAttention{
    "MIXTAPE_CUDA_MMA_ATTENTION", true,
    "the fused attention runs its plain kernels (a warp per row, no tensor cores) on CUDA",
    "it runs the tiled tensor-core kernels where they apply (float16 and bfloat16 heads of "
    "width 32, 64, 96 and 128)"};

// backends/cuda/attention.cu: the tiled forward kernel of 16-bit heads up to 64 wide walking
// the keys 128 at a time instead of 64 (twice the products between two barriers, twice the
// logits' registers: 2 blocks a multiprocessor instead of 3); which is faster is measured on a
// GPU (scripts/gpu_check.sh's gpt step runs both).
inline constexpr BoolVar kCudaAttentionWideKeys{
    "MIXTAPE_CUDA_ATTENTION_WIDE_KEYS", false,
    "the tiled forward attention kernel walks the keys 64 at a time",
    "it walks them 128 at a time (float16 and bfloat16 heads up to 64 wide)"};

// backends/cpu/backend.cpp: the megabytes of freed blocks the CPU allocator keeps.
inline constexpr UIntVar kCpuCacheMb{"MIXTAPE_CPU_CACHE_MB", 1024, std::uint64_t{1} << 20,
                                     "megabytes of freed CPU memory kept for reuse"};

// autograd/amp.cpp: MIXTAPE_AMP_<list>_<action>, list ALLOWLIST, INFERLIST, DENYLIST or
// CLEARLIST, action ADD or REMOVE: op names.
inline constexpr std::string_view kAmpListVariablePrefix = "MIXTAPE_AMP_";

}  // namespace mixtape::detail::env
