// The dtype trace: which dtypes each layer call really used (the cheat sheet of seed 000,
// for the user's own model).
//
//   mt::DTypeTrace t = mt::trace_dtypes(model, x);
//   fmt::print("{}", t.table());
//
// prints, per layer that ran, the input dtype (and what it was cast to), the weight
// storage dtype (and what it was read as), the computation dtype and the output dtype:
//
//   layer     type   policy         input               weight              computation  output
//   dense_1   Dense  mixed_float16  float32 => float16  float32 => float16  float32      float16
//
// A DTypeTraceScope collects the same rows for every layer call of the thread while it is
// alive (training steps included). With the environment variable MIXTAPE_TRACE_DTYPES=1,
// every layer call also logs its row (spdlog, info level); "0" or unset: no log. Another
// value throws ValueError at the first layer call (docs/environment.md).
//
// Threads: scopes are per thread (a scope collects the layer calls of its own thread).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mixtape/core/tensor.h"
#include "mixtape/layers/layer.h"

namespace mixtape {

// One layer call.
struct DTypeTraceRow {
  std::string layer;                 // the layer's name
  std::string type;                  // its class name
  std::string policy;                // its policy's name
  DType input;                       // the dtype it was given
  DType input_cast;                  // what the input was cast to (the same when not cast)
  std::optional<DType> weight;       // the storage dtype of its weights (none: no weights)
  std::optional<DType> weight_read;  // what call() read them as
  DType computation;                 // the dtype its arithmetic ran in
  DType output;                      // the output's dtype
  // What the layer says about how it computed (Layer::trace_note): MultiHeadAttention's
  // "attention: fused", or the composed path and why.
  std::string note = {};
};

class DTypeTrace {
 public:
  std::vector<DTypeTraceRow> rows;
  // An aligned text table, one line per row, "a => b" where a value was cast.
  std::string table() const;
};

// Collects a row for every leaf layer called on this thread while alive. Scopes nest; the
// innermost collects.
class DTypeTraceScope {
 public:
  DTypeTraceScope();
  ~DTypeTraceScope();
  DTypeTraceScope(const DTypeTraceScope&) = delete;
  DTypeTraceScope& operator=(const DTypeTraceScope&) = delete;
  const DTypeTrace& trace() const { return trace_; }

 private:
  DTypeTrace trace_;
  DTypeTrace* previous_;
};

// Runs `layer` (a model, usually) on `x` without recording gradients and returns the rows
// of the leaf layers that ran.
DTypeTrace trace_dtypes(layers::Layer& layer, const Tensor& x, const CallContext& ctx = {});
template <typename T>
DTypeTrace trace_dtypes(const layers::LayerPtr<T>& layer, const Tensor& x,
                        const CallContext& ctx = {}) {
  return trace_dtypes(static_cast<layers::Layer&>(*layer), x, ctx);
}

namespace detail {
// For Layer::operator(): true when a row should be made (a scope or the log is on).
bool dtype_trace_active();
void dtype_trace_record(const DTypeTraceRow& row);
// While alive, no rows are recorded (symbolic calls use it).
class DTypeTraceMute {
 public:
  DTypeTraceMute();
  ~DTypeTraceMute();
  DTypeTraceMute(const DTypeTraceMute&) = delete;
  DTypeTraceMute& operator=(const DTypeTraceMute&) = delete;

 private:
  bool previous_;
};
}  // namespace detail

}  // namespace mixtape
