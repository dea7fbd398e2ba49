// Policy: the dtypes a layer computes in and stores its variables in (Keras' dtype
// policy), plus the global policy that new layers take.
//
//   name             compute    variables   loss scale (default)
//   float32          float32    float32     none
//   float64          float64    float64     none
//   float16          float16    float16     none
//   bfloat16         bfloat16   bfloat16    none
//   mixed_float16    float16    float32     dynamic
//   mixed_bfloat16   bfloat16   float32     none
//   mixed_float8     bfloat16   float32     none       Dense and attention projections:
//                                                      FP8 matmuls (mixtape/layers/layer.h),
//                                                      current scaling
//   mixed_float8_delayed                               the same with delayed scaling
//                                                      (Float8Scaling below)
//
// A layer reads the global policy when it is constructed; changing the global policy later
// does not touch existing layers. A layer's `dtype` option (a name or a Policy) overrides
// the global policy for that layer. docs/mixed_precision.md has the whole story.
//
// Threads: the global policy is a process default (set_global_policy, synchronised)
// under per-thread overrides (PolicyScope). A thread reads its innermost PolicyScope's
// policy, else the process default; a scope on one thread never changes what another
// thread sees, and a new thread starts with no scope (the process default), whatever
// scope the thread that started it is in.
#pragma once

#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "mixtape/core/dtype.h"
#include "mixtape/precision/loss_scale.h"

namespace mixtape {

// How mixed_float8 scales each tensor into FP8's range, one scale per tensor.
//   Current: this step's amax (max |x|), computed on the device (torchao's tensorwise
//     scaling; the default).
//   Delayed: the largest amax of the tensor's last `history` steps, divided by 2^margin
//     (Transformer Engine's delayed scaling: an amax beyond the history's saturates). The
//     histories are layer weights (non-trainable: "kernel_amax_history", ...), so checkpoints
//     and model files hold them; training steps roll their amaxes in, inference reads them.
struct Float8Scaling {
  enum class Kind { Current, Delayed };
  Kind kind = Kind::Current;
  std::int64_t history = 1024;  // delayed: steps remembered (Transformer Engine's default)
  int margin = 0;               // delayed: headroom, a factor 2^margin
  friend bool operator==(const Float8Scaling&, const Float8Scaling&) = default;
};

class Policy {
 public:
  // The float32 policy.
  Policy();
  // A policy by name, with its default loss scale (dynamic for mixed_float16, none
  // otherwise). An unknown name throws ValueError listing the valid names.
  Policy(std::string_view name);                                       // NOLINT
  Policy(const char* name) : Policy(std::string_view(name)) {}         // NOLINT
  Policy(const std::string& name) : Policy(std::string_view(name)) {}  // NOLINT
  // The single-dtype policy of a floating dtype (mt::kFloat32 -> "float32"), so that
  // `.dtype = mt::kFloat32` works where `.dtype = "float32"` does; any other dtype throws
  // ValueError listing the policy names.
  Policy(DType dtype);  // NOLINT
  // With an explicit loss scale: a number is a fixed scale (as in the guide:
  // Policy("mixed_float16", 1024)).
  Policy(std::string_view name, double loss_scale);
  Policy(std::string_view name, LossScale loss_scale);
  // mixed_float8 with the given scaling: Policy("mixed_float8", {.kind =
  // mt::Float8Scaling::Kind::Delayed, .history = 16, .margin = 1}). Its name records the
  // scaling ("mixed_float8_delayed" for the defaults, "mixed_float8_delayed(history=16,
  // margin=1)" otherwise), which Policy(name) reads back, so model files keep it. Throws
  // ValueError for another policy name, a history outside [1, 2^20] or a margin outside
  // [0, 64].
  Policy(std::string_view name, Float8Scaling scaling);

  const std::string& name() const { return name_; }
  DType compute_dtype() const { return compute_; }
  DType variable_dtype() const { return variable_; }
  // The loss scale Model.fit applies (std::nullopt: none).
  const std::optional<LossScale>& loss_scale() const { return loss_scale_; }
  // mixed_float16 / mixed_bfloat16 / mixed_float8: variables kept wider than the computation.
  bool is_mixed() const { return compute_ != variable_; }
  // mixed_float8: the matrix products of Dense layers and of MultiHeadAttention's projections
  // run in FP8 (float8_linear: e4m3 inputs and weights, e5m2 gradients, current scaling);
  // everything else as mixed_bfloat16.
  bool float8_matmuls() const { return float8_matmuls_; }
  // mixed_float8's scaling (Current for the other policies, where it means nothing).
  const Float8Scaling& float8_scaling() const { return float8_scaling_; }

  // <Policy "mixed_float16", loss_scale=DynamicLossScale(...)>
  std::string str() const;
  // "float32, float64, float16, bfloat16, mixed_float16, mixed_bfloat16, mixed_float8,
  // mixed_float8_delayed"
  static std::string valid_names();

  friend bool operator==(const Policy& a, const Policy& b);

 private:
  std::string name_;
  DType compute_, variable_;
  bool float8_matmuls_ = false;
  Float8Scaling float8_scaling_;
  std::optional<LossScale> loss_scale_;
};

// The policy a layer constructed on this thread takes when none is given: the policy of
// the thread's innermost PolicyScope, else the process default (float32 until set).
Policy global_policy();
// Sets the process default, which every thread without a PolicyScope reads (thread-safe).
// Called inside a PolicyScope of this thread it sets that scope's policy instead, until
// the scope ends (so code that sets the policy inside a scope behaves as on one thread).
void set_global_policy(const Policy& policy);

// Sets the global policy of the current thread only while alive, and restores the
// thread's previous one (an outer scope's, or the process default) when it ends. Other
// threads are not affected. Destroy it on the thread that made it (it is a stack object).
class PolicyScope {
 public:
  explicit PolicyScope(const Policy& policy);
  ~PolicyScope();
  PolicyScope(const PolicyScope&) = delete;
  PolicyScope& operator=(const PolicyScope&) = delete;

 private:
  std::optional<Policy> previous_;  // the thread's scope policy before (nullopt: none)
};

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::Policy> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::Policy& p, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(p.str(), ctx);
  }
};
