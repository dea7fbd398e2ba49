// Automatic mixed precision as a rewrite of ops (TensorFlow's
// enable_mixed_precision_graph_rewrite, seed 003 of the specification), and the op trace.
//
// Every op has a category, kept as data in AmpLists:
//   allow  always run in the low-precision dtype (matmul, conv2d): float32 inputs are
//          cast down;
//   infer  run in the low-precision dtype when their inputs are (add, mul, sigmoid,
//          softmax, ...): low precision when every floating input that is not a Variable
//          is already low precision (Variables follow), float32 otherwise;
//   deny   always run in float32 (exp, pow, sum, mean): low-precision inputs are cast up;
//   clear  follow their inputs, no cast (relu, max_pool2d, reshape, transpose, argmax ...).
// Ops in no list are left alone, like clear ones.
//
// The rewrite is off until enabled (optim's enable_auto_mixed_precision(optimizer) turns
// it on and wraps the optimizer for loss scaling). Once on, it applies to the ops run while
// a GradientTape of the thread is recording (the training step: what a graph rewrite of
// the training graph would change), and to every op inside an AutoMixedPrecisionScope.
// Evaluation outside tapes runs as written.
//
// The lists are printable and editable: amp_lists().set("gelu", AmpCategory::Allow), or,
// at start-up, the environment variables MIXTAPE_AMP_ALLOWLIST_ADD, ..._REMOVE and the
// same for INFERLIST, DENYLIST and CLEARLIST (comma-separated op names out of
// amp_op_names(); read when the lists are first used, by set_auto_mixed_precision(true)
// or amp_lists(); docs/environment.md).
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mixtape/core/dtype.h"

namespace mixtape {

enum class AmpCategory { Allow, Infer, Deny, Clear };
std::string_view amp_category_name(AmpCategory c);  // "allow", "infer", "deny", "clear"

class AmpLists {
 public:
  // The built-in lists.
  static AmpLists defaults();

  // The category of an op (Clear for ops in no list).
  AmpCategory category(std::string_view op) const;
  bool listed(std::string_view op) const;
  // Puts `op` in `c` (out of any other list); remove() takes it out of every list.
  void set(std::string_view op, AmpCategory c);
  void remove(std::string_view op);
  // The ops of a category, sorted.
  std::vector<std::string> ops(AmpCategory c) const;
  // Applies MIXTAPE_AMP_<LIST>_ADD / _REMOVE from the environment (comma-separated names of
  // amp_op_names()). An unknown or empty op name throws ValueError naming the variable, the
  // value and the valid names, and leaves the lists unchanged.
  void apply_environment();
  // "allow: attention, conv2d, linear, matmul\ninfer: ...\n..."
  std::string str() const;

 private:
  std::map<std::string, AmpCategory, std::less<>> category_;
};

// The op names the rewrite knows: every op that passes through it (matmul, conv2d, add,
// ...). AmpLists::set and the MIXTAPE_AMP_* variables accept these names only.
std::span<const std::string_view> amp_op_names();

// The process-wide lists the rewrite uses (the defaults with the environment applied on
// first use). Edit them before training starts.
AmpLists& amp_lists();

// Turns the rewrite on (low: float16 or bfloat16) or off, for the whole process.
void set_auto_mixed_precision(bool enabled, DType low = kFloat16);
bool auto_mixed_precision_enabled();
DType auto_mixed_precision_dtype();

// While alive, the ops of this thread are rewritten (if the rewrite is on) even without
// a recording tape.
class AutoMixedPrecisionScope {
 public:
  AutoMixedPrecisionScope();
  ~AutoMixedPrecisionScope();
  AutoMixedPrecisionScope(const AutoMixedPrecisionScope&) = delete;
  AutoMixedPrecisionScope& operator=(const AutoMixedPrecisionScope&) = delete;

 private:
  bool previous_;
};

// --- The op trace: which dtype each op ran in -------------------------------------------

struct OpTraceRow {
  std::string op;
  std::vector<DType> inputs;  // the floating inputs as the op received them (after casts)
  DType computation;          // the dtype the op ran in
};

// Collects a row for every op of this thread while alive (innermost scope collects).
class OpTraceScope {
 public:
  OpTraceScope();
  ~OpTraceScope();
  OpTraceScope(const OpTraceScope&) = delete;
  OpTraceScope& operator=(const OpTraceScope&) = delete;
  const std::vector<OpTraceRow>& rows() const { return rows_; }
  // "matmul      float16, float16 -> float16", one line per op.
  std::string table() const;

 private:
  std::vector<OpTraceRow> rows_;
  OpTraceScope* previous_;
};

}  // namespace mixtape
