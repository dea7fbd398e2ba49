// Automatic mixed precision: the op lists (data), the rewrite applied at each op's entry,
// and the op trace. The entry point for ops is detail::op_inputs (autograd/op_util.h),
// which also applies autocast (autograd/autocast.h).
#include "mixtape/autograd/amp.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <mutex>
#include <optional>

#include "autograd/op_util.h"
#include "core/env.h"
#include "mixtape/core/error.h"

namespace mixtape {

namespace {

// The op table's AMP column (mixtape/core/op_table.h): each op's default category, or none
// for the ops the rewrite never sees (hidden).
constexpr std::optional<AmpCategory> kAmp_allow{AmpCategory::Allow};
constexpr std::optional<AmpCategory> kAmp_infer{AmpCategory::Infer};
constexpr std::optional<AmpCategory> kAmp_deny{AmpCategory::Deny};
constexpr std::optional<AmpCategory> kAmp_clear{AmpCategory::Clear};
constexpr std::optional<AmpCategory> kAmp_hidden{};

struct DefaultEntry {
  std::string_view op;
  std::optional<AmpCategory> category;
};
constexpr DefaultEntry kTable[] = {
#define MIXTAPE_AMP_DEFAULT(name, kernel, dtypes, amp, grad) {#name, kAmp_##amp},
    MIXTAPE_OP_TABLE(MIXTAPE_AMP_DEFAULT)
#undef MIXTAPE_AMP_DEFAULT
};

// Every op name the rewrite knows: the ops of the table that are not hidden, each of which
// calls detail::op_inputs (a test runs each op and checks that the rewrite sees every name).
constexpr std::size_t kKnownOps = [] {
  std::size_t n = 0;
  for (const auto& e : kTable) n += e.category ? 1 : 0;
  return n;
}();
constexpr std::array<std::string_view, kKnownOps> kOpNames = [] {
  std::array<std::string_view, kKnownOps> names{};
  std::size_t i = 0;
  for (const auto& e : kTable)
    if (e.category) names[i++] = e.op;
  return names;
}();

constexpr std::array<AmpCategory, 4> kCategories = {AmpCategory::Allow, AmpCategory::Infer,
                                                    AmpCategory::Deny, AmpCategory::Clear};
constexpr std::array<std::string_view, 4> kEnvLists = {"ALLOWLIST", "INFERLIST", "DENYLIST",
                                                       "CLEARLIST"};

std::string valid_op_names() {
  std::string out;
  for (auto n : kOpNames) {
    if (!out.empty()) out += ", ";
    out += n;
  }
  return out;
}

bool known_op(std::string_view op) {
  return std::find(kOpNames.begin(), kOpNames.end(), op) != kOpNames.end();
}

std::atomic<bool> g_enabled{false};
std::atomic<int> g_low{DType::Float16};
thread_local bool t_scope = false;
thread_local OpTraceScope* t_op_trace = nullptr;
thread_local std::vector<OpTraceRow>* t_op_rows = nullptr;

}  // namespace

std::string_view amp_category_name(AmpCategory c) {
  switch (c) {
    case AmpCategory::Allow:
      return "allow";
    case AmpCategory::Infer:
      return "infer";
    case AmpCategory::Deny:
      return "deny";
    case AmpCategory::Clear:
      break;
  }
  return "clear";
}

std::span<const std::string_view> amp_op_names() { return kOpNames; }

// --- AmpLists ---------------------------------------------------------------------------

AmpLists AmpLists::defaults() {
  AmpLists l;
  for (const auto& e : kTable)
    if (e.category) l.category_.emplace(std::string(e.op), *e.category);
  return l;
}

AmpCategory AmpLists::category(std::string_view op) const {
  auto it = category_.find(op);
  return it == category_.end() ? AmpCategory::Clear : it->second;
}

bool AmpLists::listed(std::string_view op) const { return category_.find(op) != category_.end(); }

void AmpLists::set(std::string_view op, AmpCategory c) {
  if (!known_op(op))
    throw ValueError(fmt::format("AmpLists::set: unknown op '{}'; the ops the rewrite knows: {}",
                                 op, valid_op_names()));
  category_[std::string(op)] = c;
}

void AmpLists::remove(std::string_view op) {
  auto it = category_.find(op);
  if (it != category_.end()) category_.erase(it);
}

std::vector<std::string> AmpLists::ops(AmpCategory c) const {
  std::vector<std::string> out;
  for (const auto& [op, cat] : category_)
    if (cat == c) out.push_back(op);
  return out;
}

void AmpLists::apply_environment() {
  // Applied to a copy: a bad value in any of the variables leaves the lists unchanged.
  AmpLists next = *this;
  for (std::size_t i = 0; i < kCategories.size(); ++i) {
    for (const char* action : {"ADD", "REMOVE"}) {
      const std::string var =
          fmt::format("{}{}_{}", detail::env::kAmpListVariablePrefix, kEnvLists[i], action);
      for (const auto& op : detail::env::NameListVar{var.c_str(), "op"}.read(kOpNames)) {
        if (std::string_view(action) == "ADD") {
          next.set(op, kCategories[i]);
        } else if (next.category(op) == kCategories[i] && next.listed(op)) {
          next.remove(op);
        }
      }
    }
  }
  *this = std::move(next);
}

std::string AmpLists::str() const {
  std::string out;
  for (auto c : kCategories) {
    const auto names = ops(c);
    out += fmt::format("{}: {}\n", amp_category_name(c), fmt::join(names, ", "));
  }
  return out;
}

AmpLists& amp_lists() {
  static AmpLists lists = [] {
    AmpLists l = AmpLists::defaults();
    l.apply_environment();
    return l;
  }();
  return lists;
}

void set_auto_mixed_precision(bool enabled, DType low) {
  if (enabled && !low.is_reduced_float())
    throw ValueError(fmt::format(
        "set_auto_mixed_precision: the low-precision dtype must be float16 or bfloat16; got {}",
        low));
  if (enabled) amp_lists();  // read the environment now, where errors are expected
  g_low = low.index();
  g_enabled = enabled;
}

bool auto_mixed_precision_enabled() { return g_enabled; }
DType auto_mixed_precision_dtype() { return DType(static_cast<DType::Code>(g_low.load())); }

AutoMixedPrecisionScope::AutoMixedPrecisionScope() : previous_(t_scope) { t_scope = true; }
AutoMixedPrecisionScope::~AutoMixedPrecisionScope() { t_scope = previous_; }

// --- The op trace -------------------------------------------------------------------------

OpTraceScope::OpTraceScope() : previous_(t_op_trace) {
  t_op_trace = this;
  t_op_rows = &rows_;
}
OpTraceScope::~OpTraceScope() {
  t_op_trace = previous_;
  t_op_rows = previous_ ? &previous_->rows_ : nullptr;
}

std::string OpTraceScope::table() const {
  std::size_t width = 2;
  for (const auto& r : rows_) width = std::max(width, r.op.size());
  std::string out;
  for (const auto& r : rows_) {
    std::vector<std::string> names;
    for (auto d : r.inputs) names.emplace_back(d.name());
    out += fmt::format("{:<{}}  {} -> {}\n", r.op, width, fmt::join(names, ", "), r.computation);
  }
  return out;
}

// --- The rewrite at op entry ----------------------------------------------------------------

namespace detail {

std::vector<Tensor> op_inputs(OpId id, std::vector<Tensor> ins) {
  const char* op = op_name(id);
  for (auto& t : ins) t = autocast(t);

  if (g_enabled && (t_scope || any_tape_recording())) {
    const DType low = auto_mixed_precision_dtype();
    auto is_float = [](const Tensor& t) { return t.defined() && t.dtype().is_floating(); };
    auto cast_all = [&](DType from, DType to) {
      for (auto& t : ins)
        if (is_float(t) && t.dtype() == from) t = cast(t, to);
    };
    switch (amp_lists().category(op)) {
      case AmpCategory::Allow:
        cast_all(kFloat32, low);
        break;
      case AmpCategory::Deny:
        cast_all(low, kFloat32);
        break;
      case AmpCategory::Infer: {
        // Low precision when every floating activation (not a Variable) is; the
        // Variables and constants follow.
        bool any_low = false, any_wide = false;
        for (const auto& t : ins) {
          if (!is_float(t) || t.is_variable()) continue;
          if (t.dtype() == low) any_low = true;
          if (t.dtype() == kFloat32) any_wide = true;
        }
        if (any_low && !any_wide)
          cast_all(kFloat32, low);
        else if (any_low)
          cast_all(low, kFloat32);
        break;
      }
      case AmpCategory::Clear:
        break;
    }
  }

  if (t_op_rows) {
    OpTraceRow row{op, {}, kBool};
    bool first = true;
    for (const auto& t : ins) {
      if (!t.defined() || !t.dtype().is_floating()) continue;
      row.inputs.push_back(t.dtype());
      row.computation = first ? t.dtype() : promote_types(row.computation, t.dtype());
      first = false;
    }
    if (first && ins.size() > 0 && ins.front().defined()) row.computation = ins.front().dtype();
    t_op_rows->push_back(std::move(row));
  }
  return ins;
}

}  // namespace detail

}  // namespace mixtape
