// Export of trained models to ONNX (opset 17), for ONNX Runtime, TensorRT, OpenCV's DNN
// module and the other runtimes that read it.
//
//   mt::export_onnx(model, "mnist.onnx");                      // as the model computes
//   mt::export_onnx(model, "mnist32.onnx", {.float32 = true});  // everything in float32
//
// What the file holds (docs/checkpoints.md, "ONNX export"): the model's graph in inference
// form (Dropout and the random augmentations are identities, BatchNormalization uses its
// moving statistics), one graph input per model input with a symbolic batch dimension
// "batch", one output per model output named after its layer, and the weights as
// initializers named by their weight paths ("dense/kernel"). Under a mixed policy each layer
// computes in its compute dtype, as in mixtape: float32 variables are cast to float16 or
// bfloat16 where the layer reads them so, the float32 islands (LayerNormalization and
// BatchNormalization statistics, attention logits and softmax, a float32 output layer) stay
// float32. An op that opset 17 does not define for bfloat16 (Conv, MaxPool, AveragePool)
// runs on its bfloat16 operands widened to float32 and rounds its result to bfloat16, which
// is what mixtape's kernels compute. Under mixed_float8 the matrix products are exported as
// bfloat16 products (opset 17 has no float8 types).
//
// Every built-in layer exports. A layer of one's own exports when it has an exporter
// (register_onnx_exporter below; docs/extending.md); otherwise export_onnx throws ValueError
// naming it. The file is checked with ONNX's checker and strict shape inference before it is
// written, and written atomically (a temporary file renamed over the path): a failed export
// leaves no file, and any file that was at the path stays as it was.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "mixtape/core/dtype.h"
#include "mixtape/core/tensor.h"
#include "mixtape/layers/layer.h"

namespace mixtape {

class Model;

struct OnnxExportOptions {
  // Every floating tensor in float32 (float64 stays float64): the mixed policies' 16-bit
  // compute dtypes and the 16-bit variables become float32, for runtimes without float16 or
  // bfloat16 kernels. Off: each layer in its compute dtype, as the model computes.
  bool float32 = false;
  // The graph's name in the file; empty: the model's name.
  std::string graph_name = {};
  // Keys and values for the file's metadata_props (what a runtime shows as the model's
  // custom metadata: a tokenizer's vocabulary, a version).
  std::map<std::string, std::string> metadata = {};
};

// Writes `model` (a functional Model or a built Sequential) to `path` as an ONNX model of
// opset 17. Throws ValueError for a Sequential that is not built (call it once, or
// build_for), a layer without an ONNX form (naming it and its class), and a weight of a
// dtype ONNX's opset 17 cannot hold (float8); IOError naming the path when the file cannot
// be written (no such directory, a full disk). See the top of this file.
void export_onnx(const Model& model, const std::string& path,
                 const OnnxExportOptions& options = {});

// --- Exporting a layer of one's own -----------------------------------------------------------

// A tensor of the graph being written: its name and element type (the shape is ONNX's to
// infer).
struct OnnxValue {
  std::string name;
  DType dtype;
};

// A node attribute: an integer, a float, a text, a list of integers or of floats.
class OnnxAttribute {
 public:
  using Value =
      std::variant<std::int64_t, float, std::string, std::vector<std::int64_t>, std::vector<float>>;
  template <std::integral I>
  OnnxAttribute(std::string name, I v)  // NOLINT: {"axis", 1}
      : name_(std::move(name)), value_(static_cast<std::int64_t>(v)) {}
  template <std::floating_point F>
  OnnxAttribute(std::string name, F v)  // NOLINT: {"epsilon", 1e-5}
      : name_(std::move(name)), value_(static_cast<float>(v)) {}
  OnnxAttribute(std::string name, const char* v) : name_(std::move(name)), value_(std::string(v)) {}
  OnnxAttribute(std::string name, std::string v) : name_(std::move(name)), value_(std::move(v)) {}
  OnnxAttribute(std::string name, std::vector<std::int64_t> v)
      : name_(std::move(name)), value_(std::move(v)) {}
  OnnxAttribute(std::string name, std::vector<float> v)
      : name_(std::move(name)), value_(std::move(v)) {}
  const std::string& name() const { return name_; }
  const Value& value() const { return value_; }

 private:
  std::string name_;
  Value value_;
};

// One call of a layer, as an exporter sees it.
struct OnnxLayerCall {
  const layers::Layer& layer;
  // The inputs, floating ones cast to compute_dtype (as a call casts them).
  std::vector<OnnxValue> inputs;
  // The inputs as they reach the layer (an Embedding's ids, a layer that casts otherwise).
  std::vector<OnnxValue> raw_inputs;
  // Their shapes and dtypes in mixtape (-1 on the batch axis), and those of the outputs.
  std::vector<layers::TensorSpec> input_specs;
  std::vector<layers::TensorSpec> output_specs;
  // The dtype the layer computes in, in this export (float32 under OnnxExportOptions::float32).
  DType compute_dtype;
};

// The graph an exporter adds its nodes to. Names of new tensors are made unique under the
// layer's name.
class OnnxGraph {
 public:
  virtual ~OnnxGraph() = default;
  // A node of the default (ai.onnx) domain at opset 17 with one output of `dtype`. An op that
  // opset 17 does not define for a 16-bit float input type is given its floating inputs
  // widened to float32, and its output is rounded back to `dtype`.
  virtual OnnxValue op(const std::string& op_type, const std::vector<OnnxValue>& inputs,
                       DType dtype, const std::vector<OnnxAttribute>& attributes = {}) = 0;
  // The same with several outputs, of `dtypes`.
  virtual std::vector<OnnxValue> op_multi(const std::string& op_type,
                                          const std::vector<OnnxValue>& inputs,
                                          const std::vector<DType>& dtypes,
                                          const std::vector<OnnxAttribute>& attributes = {}) = 0;
  // `x` in `dtype` (a Cast node; x itself when it has that dtype already).
  virtual OnnxValue cast(const OnnxValue& x, DType dtype) = 0;
  // A constant tensor (an initializer) holding `value`, named after `hint`.
  virtual OnnxValue constant(const Tensor& value, const std::string& hint) = 0;
  // A 1-D int64 constant (shapes, axes, starts).
  virtual OnnxValue ints(const std::vector<std::int64_t>& values, const std::string& hint) = 0;
  // The weight of `layer` that add_weight named `name` ("kernel"), as an initializer named
  // by its weight path, read in `dtype` (a Cast node when the variable's dtype differs, as a
  // layer's autocast reads it). Keras' layouts meet ONNX's: `permutation`, when given,
  // permutes the axes (mt::permute's order: a Conv2D kernel [kh, kw, in, out] becomes ONNX's
  // [out, in, kh, kw] with {3, 2, 0, 1}), then `shape`, when given, re-shapes it (the same
  // elements in row-major order: a [d, heads, key_dim] kernel as [d, heads * key_dim]); the
  // initializer's name then says so ("conv2d/kernel[3,2,0,1]"). Throws ValueError when the
  // layer has no such weight.
  virtual OnnxValue weight(const layers::Layer& layer, const std::string& name, DType dtype,
                           const std::optional<Shape>& shape = std::nullopt,
                           const std::vector<int>& permutation = {}) = 0;
  // The dtype floating tensors of `dtype` have in this export (float32 under
  // OnnxExportOptions::float32, else `dtype` itself).
  virtual DType exported(DType dtype) const = 0;
};

// Writes one call of a layer: adds its nodes and returns its outputs, in the dtypes of
// call.output_specs (as exported()).
using OnnxExporter =
    std::function<std::vector<OnnxValue>(OnnxGraph& graph, const OnnxLayerCall& call)>;

// Registers the exporter of layers whose class_name() is `class_name`, replacing any earlier
// one (the built-in layers' exporters too). Thread-safe.
void register_onnx_exporter(const std::string& class_name, OnnxExporter exporter);
// Whether layers of class `class_name` can be exported.
bool has_onnx_exporter(const std::string& class_name);

}  // namespace mixtape
