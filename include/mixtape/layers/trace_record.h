// The rows of the dtype trace and where they go: what Layer::operator() records for each
// leaf layer call (layers/layer.cpp), apart from trace_dtypes (mixtape/layers/trace.h), which
// runs a model to collect them. See trace.h for the whole story.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mixtape/core/dtype.h"

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
