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
//
// A layer reads the global policy when it is constructed; changing the global policy later
// does not touch existing layers. A layer's `dtype` option (a name or a Policy) overrides
// the global policy for that layer. docs/mixed_precision.md has the whole story.
#pragma once

#include <fmt/format.h>

#include <optional>
#include <string>
#include <string_view>

#include "mixtape/core/dtype.h"
#include "mixtape/precision/loss_scale.h"

namespace mixtape {

class Policy {
 public:
  // The float32 policy.
  Policy();
  // A policy by name, with its default loss scale (dynamic for mixed_float16, none
  // otherwise). An unknown name throws ValueError listing the valid names.
  Policy(std::string_view name);                                       // NOLINT
  Policy(const char* name) : Policy(std::string_view(name)) {}         // NOLINT
  Policy(const std::string& name) : Policy(std::string_view(name)) {}  // NOLINT
  // With an explicit loss scale: a number is a fixed scale (as in the guide:
  // Policy("mixed_float16", 1024)).
  Policy(std::string_view name, double loss_scale);
  Policy(std::string_view name, LossScale loss_scale);

  const std::string& name() const { return name_; }
  DType compute_dtype() const { return compute_; }
  DType variable_dtype() const { return variable_; }
  // The loss scale Model.fit applies (std::nullopt: none).
  const std::optional<LossScale>& loss_scale() const { return loss_scale_; }
  // mixed_float16 / mixed_bfloat16: variables kept wider than the computation.
  bool is_mixed() const { return compute_ != variable_; }

  // <Policy "mixed_float16", loss_scale=DynamicLossScale(...)>
  std::string str() const;
  // "float32, float64, float16, bfloat16, mixed_float16, mixed_bfloat16"
  static std::string valid_names();

  friend bool operator==(const Policy& a, const Policy& b);

 private:
  std::string name_;
  DType compute_, variable_;
  std::optional<LossScale> loss_scale_;
};

// The policy layers take when none is given (float32 until set).
Policy global_policy();
void set_global_policy(const Policy& policy);

// Sets the global policy while alive and restores the previous one.
class PolicyScope {
 public:
  explicit PolicyScope(const Policy& policy);
  ~PolicyScope();
  PolicyScope(const PolicyScope&) = delete;
  PolicyScope& operator=(const PolicyScope&) = delete;

 private:
  Policy previous_;
};

}  // namespace mixtape

template <>
struct fmt::formatter<mixtape::Policy> : fmt::formatter<std::string_view> {
  template <typename Ctx>
  auto format(const mixtape::Policy& p, Ctx& ctx) const {
    return fmt::formatter<std::string_view>::format(p.str(), ctx);
  }
};
