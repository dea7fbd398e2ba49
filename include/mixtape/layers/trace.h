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

#include "mixtape/core/tensor.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/trace_record.h"

namespace mixtape {

// Runs `layer` (a model, usually) on `x` without recording gradients and returns the rows
// of the leaf layers that ran.
DTypeTrace trace_dtypes(layers::Layer& layer, const Tensor& x, const CallContext& ctx = {});
template <typename T>
DTypeTrace trace_dtypes(const layers::LayerPtr<T>& layer, const Tensor& x,
                        const CallContext& ctx = {}) {
  return trace_dtypes(static_cast<layers::Layer&>(*layer), x, ctx);
}

}  // namespace mixtape
