// Policies: the table of named policies, the process default and the per-thread scopes.
#include "mixtape/precision/policy.h"

#include <spdlog/spdlog.h>

#include <array>
#include <cstdio>
#include <mutex>
#include <optional>

#include "mixtape/core/cuda.h"
#include "mixtape/core/error.h"

namespace mixtape {

namespace {

// The policy table (the data behind Policy(name)).
struct PolicyRow {
  std::string_view name;
  DType compute, variable;
  bool dynamic_loss_scale;  // the default loss scale: dynamic, or none
  bool float8_matmuls;      // Dense and attention projections multiply in FP8
};
constexpr std::array<PolicyRow, 8> kPolicies = {{
    {"float32", kFloat32, kFloat32, false, false},
    {"float64", kFloat64, kFloat64, false, false},
    {"float16", kFloat16, kFloat16, false, false},
    {"bfloat16", kBFloat16, kBFloat16, false, false},
    {"mixed_float16", kFloat16, kFloat32, true, false},
    {"mixed_bfloat16", kBFloat16, kFloat32, false, false},
    {"mixed_float8", kBFloat16, kFloat32, false, true},
    {"mixed_float8_delayed", kBFloat16, kFloat32, false, true},  // Float8Scaling::Delayed
}};

constexpr std::string_view kDelayed = "mixed_float8_delayed";

// The name of mixed_float8 with `scaling` (Policy(name) reads it back).
std::string float8_name(const Float8Scaling& scaling) {
  if (scaling.kind == Float8Scaling::Kind::Current) return "mixed_float8";
  if (scaling == Float8Scaling{.kind = Float8Scaling::Kind::Delayed}) return std::string(kDelayed);
  return fmt::format("{}(history={}, margin={})", kDelayed, scaling.history, scaling.margin);
}

void check_scaling(const Float8Scaling& s, std::string_view what) {
  if (s.history < 1 || s.history > (std::int64_t{1} << 20))
    throw ValueError(
        fmt::format("{}: the amax history must be 1 to 1048576 steps; got {}", what, s.history));
  if (s.margin < 0 || s.margin > 64)
    throw ValueError(fmt::format("{}: the margin must be 0 to 64; got {}", what, s.margin));
}

// "mixed_float8_delayed(history=16, margin=1)": the scaling it names; std::nullopt for a name
// of another form.
std::optional<Float8Scaling> parse_delayed(std::string_view name) {
  if (name.substr(0, kDelayed.size()) != kDelayed || name.size() == kDelayed.size() ||
      name[kDelayed.size()] != '(')
    return std::nullopt;
  const std::string text(name);
  long long history = 0;
  int margin = 0, used = 0;
  if (std::sscanf(text.c_str() + kDelayed.size(), "(history=%lld, margin=%d)%n", &history, &margin,
                  &used) != 2 ||
      kDelayed.size() + static_cast<std::size_t>(used) != text.size())
    throw ValueError(
        fmt::format("dtype policy '{}': expected mixed_float8_delayed(history=N, margin=M)", name));
  Float8Scaling s{.kind = Float8Scaling::Kind::Delayed, .history = history, .margin = margin};
  check_scaling(s, fmt::format("dtype policy '{}'", name));
  return s;
}

const PolicyRow& find_row(std::string_view name) {
  for (const auto& row : kPolicies)
    if (row.name == name) return row;
  throw ValueError(
      fmt::format("unknown dtype policy '{}'; valid names: {}", name, Policy::valid_names()));
}

// The process default (set_global_policy outside any PolicyScope), under g_mutex.
std::mutex g_mutex;
Policy& process_default() {
  static Policy policy;
  return policy;
}

// The policy of this thread's innermost PolicyScope (std::nullopt: no scope is open).
thread_local std::optional<Policy> t_scope_policy;

}  // namespace

Policy::Policy() : Policy(std::string_view("float32")) {}

Policy::Policy(std::string_view name) {
  const std::optional<Float8Scaling> delayed = parse_delayed(name);
  const PolicyRow& row = find_row(delayed ? kDelayed : name);
  compute_ = row.compute;
  variable_ = row.variable;
  float8_matmuls_ = row.float8_matmuls;
  if (delayed)
    float8_scaling_ = *delayed;
  else if (row.name == kDelayed)
    float8_scaling_.kind = Float8Scaling::Kind::Delayed;
  name_ = row.float8_matmuls ? float8_name(float8_scaling_) : std::string(row.name);
  if (row.dynamic_loss_scale) loss_scale_ = LossScale::dynamic();
}

Policy::Policy(std::string_view name, Float8Scaling scaling) : Policy(name) {
  if (!float8_matmuls_)
    throw ValueError(
        fmt::format("dtype policy '{}': a Float8Scaling goes with mixed_float8 only", name));
  check_scaling(scaling, fmt::format("dtype policy '{}'", name));
  float8_scaling_ = scaling;
  name_ = float8_name(scaling);
}

Policy::Policy(DType dtype) : Policy(dtype.name()) {}

Policy::Policy(std::string_view name, double loss_scale)
    : Policy(name, LossScale::fixed(loss_scale)) {}

Policy::Policy(std::string_view name, LossScale loss_scale) : Policy(name) {
  loss_scale_ = loss_scale;
}

std::string Policy::str() const {
  if (!loss_scale_) return fmt::format("<Policy \"{}\">", name_);
  return fmt::format("<Policy \"{}\", loss_scale={}>", name_, loss_scale_->str());
}

std::string Policy::valid_names() {
  std::string out;
  for (const auto& row : kPolicies) {
    if (!out.empty()) out += ", ";
    out += row.name;
  }
  return out;
}

bool operator==(const Policy& a, const Policy& b) {
  return a.name_ == b.name_ && a.loss_scale_ == b.loss_scale_;  // the name holds the scaling
}

Policy global_policy() {
  if (t_scope_policy) return *t_scope_policy;
  std::lock_guard<std::mutex> lock(g_mutex);
  return process_default();
}

namespace {
// Seed 002: mixed_float16 on a GPU without tensor cores (compute capability < 7.0) runs, but
// slowly. Said once per process, the first time a float16 policy is set.
void check_float16_hardware(const Policy& policy) {
  static std::once_flag once;
  if (policy.compute_dtype() != kFloat16 || !cuda::available()) return;
  std::call_once(once, [] {
    for (int i = 0; i < cuda::device_count(); ++i) {
      const DeviceProperties p = cuda::properties(i);
      if (p.compute_major >= 7) continue;
      spdlog::warn(
          "Mixed precision compatibility check (mixed_float16): your GPU cuda:{} ({}, "
          "compute capability {}.{}) may run slowly with float16 computations because "
          "it does not have compute capability of at least 7.0 (tensor cores). See "
          "https://developer.nvidia.com/cuda-gpus. This message is logged once.",
          i, p.name, p.compute_major, p.compute_minor);
    }
  });
}
}  // namespace

void set_global_policy(const Policy& policy) {
  check_float16_hardware(policy);
  if (t_scope_policy) {
    // Inside a scope of this thread: the scope's policy, until the scope ends (what a
    // process-wide scope did on one thread).
    t_scope_policy = policy;
    return;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  process_default() = policy;
}

PolicyScope::PolicyScope(const Policy& policy) : previous_(t_scope_policy) {
  check_float16_hardware(policy);
  t_scope_policy = policy;
}
PolicyScope::~PolicyScope() { t_scope_policy = std::move(previous_); }

}  // namespace mixtape
