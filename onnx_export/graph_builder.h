// The OnnxGraph that export_onnx writes into: ONNX's protobuf GraphProto (Debian's
// libonnx-dev), unique value names under the current layer's scope, initializers from
// mixtape tensors, and the widening of 16-bit operands for ops that opset 17 does not define
// for them (read from ONNX's own operator schemas). Private to the onnx library.
#pragma once

#include <onnx/onnx_pb.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/onnx/export.h"

namespace mixtape::onnx_detail {

inline constexpr int kOpset = 17;

// The TensorProto element type of `dtype`; ValueError for the dtypes opset 17 cannot hold.
int onnx_type(DType dtype, const std::string& what);

class GraphBuilder final : public OnnxGraph {
 public:
  // Weights are named by `weight_paths` (tensor id -> weight path).
  GraphBuilder(::onnx::GraphProto& graph, bool float32,
               std::map<std::uint64_t, std::string> weight_paths);

  OnnxValue op(const std::string& op_type, const std::vector<OnnxValue>& inputs, DType dtype,
               const std::vector<OnnxAttribute>& attributes = {}) override;
  std::vector<OnnxValue> op_multi(const std::string& op_type, const std::vector<OnnxValue>& inputs,
                                  const std::vector<DType>& dtypes,
                                  const std::vector<OnnxAttribute>& attributes = {}) override;
  OnnxValue cast(const OnnxValue& x, DType dtype) override;
  OnnxValue constant(const Tensor& value, const std::string& hint) override;
  OnnxValue ints(const std::vector<std::int64_t>& values, const std::string& hint) override;
  OnnxValue weight(const layers::Layer& layer, const std::string& name, DType dtype,
                   const std::optional<Shape>& shape = std::nullopt,
                   const std::vector<int>& permutation = {}) override;
  DType exported(DType dtype) const override;

  // New names are made under `scope` ("block/dense/MatMul").
  void set_scope(std::string scope) { scope_ = std::move(scope); }
  // A name no value or node has yet, from `hint` under the scope.
  std::string fresh(const std::string& hint);
  // Adds a graph output called `name` holding `value` (an Identity node when the value has
  // another name), of `shape` with -1 as the symbolic batch dimension.
  void add_output(const std::string& name, const OnnxValue& value, const Shape& shape);
  // Adds a graph input.
  OnnxValue add_input(const std::string& name, DType dtype, const Shape& shape);
  // Drops the nodes and initializers no output depends on (casts an exporter made and did
  // not use, say).
  void prune();

  // The NHWC <-> NCHW twins of values (so that a Conv2D after a Conv2D transposes once).
  std::map<std::string, OnnxValue> nchw_of;

 private:
  OnnxValue initializer(const Tensor& value, const std::string& name);
  ::onnx::GraphProto& graph_;
  bool float32_;
  std::map<std::uint64_t, std::string> weight_paths_;
  std::map<std::string, OnnxValue> weights_;  // path and layout -> initializer
  std::map<std::string, int> used_;           // names taken, with the next suffix to try
  std::string scope_;
};

}  // namespace mixtape::onnx_detail
