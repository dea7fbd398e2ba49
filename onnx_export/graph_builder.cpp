// The graph export_onnx writes into (onnx_export/graph_builder.h).
#include "onnx_export/graph_builder.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <onnx/defs/data_type_utils.h>
#include <onnx/defs/schema.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/error.h"

namespace mixtape::onnx_detail {

int onnx_type(DType dtype, const std::string& what) {
  using T = ::onnx::TensorProto;
  switch (dtype.code()) {
    case DType::Float32:
      return T::FLOAT;
    case DType::Float16:
      return T::FLOAT16;
    case DType::BFloat16:
      return T::BFLOAT16;
    case DType::Float64:
      return T::DOUBLE;
    case DType::Int32:
      return T::INT32;
    case DType::Int64:
      return T::INT64;
    case DType::UInt8:
      return T::UINT8;
    case DType::Bool:
      return T::BOOL;
    case DType::Float8E4M3FN:
    case DType::Float8E5M2:
      break;
  }
  throw ValueError(
      fmt::format("{} is {}, which ONNX's opset {} cannot hold (its float8 types "
                  "came with opset 19)",
                  what, dtype.name(), kOpset));
}

namespace {

// "tensor(float16)": how ONNX's schemas name a tensor type (ONNX's own name of the element
// type; empty for a dtype opset 17 cannot hold).
std::string schema_type(DType dtype) {
  if (dtype.is_float8()) return "";
  return "tensor(" + ::onnx::Utils::DataTypeUtils::ToDataTypeString(onnx_type(dtype, "")) + ")";
}

const ::onnx::OpSchema& schema_of(const std::string& op_type) {
  const ::onnx::OpSchema* s = ::onnx::OpSchemaRegistry::Schema(op_type, kOpset, "");
  if (s == nullptr)
    throw ValueError(fmt::format("ONNX has no operator '{}' at opset {}", op_type, kOpset));
  return *s;
}

// Whether input `i` of `schema` may be of `dtype` (the last formal input stands for the
// variadic rest).
bool accepts(const ::onnx::OpSchema& schema, std::size_t i, DType dtype) {
  const auto& formal = schema.inputs();
  if (formal.empty()) return true;
  const auto& param = formal[std::min(i, formal.size() - 1)];
  const std::string want = schema_type(dtype);
  for (const auto& c : schema.typeConstraintParams())
    if (c.type_param_str == param.GetTypeStr())
      return std::find(c.allowed_type_strs.begin(), c.allowed_type_strs.end(), want) !=
             c.allowed_type_strs.end();
  return param.GetTypeStr() == want;  // a fixed type
}

void set_attribute(::onnx::AttributeProto& a, const OnnxAttribute& attr) {
  using A = ::onnx::AttributeProto;
  a.set_name(attr.name());
  std::visit(
      [&](const auto& v) {
        using V = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<V, std::int64_t>) {
          a.set_type(A::INT);
          a.set_i(v);
        } else if constexpr (std::is_same_v<V, float>) {
          a.set_type(A::FLOAT);
          a.set_f(v);
        } else if constexpr (std::is_same_v<V, std::string>) {
          a.set_type(A::STRING);
          a.set_s(v);
        } else if constexpr (std::is_same_v<V, std::vector<std::int64_t>>) {
          a.set_type(A::INTS);
          for (std::int64_t x : v) a.add_ints(x);
        } else {
          a.set_type(A::FLOATS);
          for (float x : v) a.add_floats(x);
        }
      },
      attr.value());
}

void set_type(::onnx::ValueInfoProto& info, DType dtype, const Shape& shape) {
  auto* t = info.mutable_type()->mutable_tensor_type();
  t->set_elem_type(onnx_type(dtype, fmt::format("graph value '{}'", info.name())));
  auto* s = t->mutable_shape();
  for (std::size_t a = 0; a < shape.rank(); ++a) {
    auto* d = s->add_dim();
    if (shape[a] < 0)
      d->set_dim_param(a == 0 ? "batch" : fmt::format("{}_dim{}", info.name(), a));
    else
      d->set_dim_value(shape[a]);
  }
}

}  // namespace

GraphBuilder::GraphBuilder(::onnx::GraphProto& graph, bool float32,
                           std::map<std::uint64_t, std::string> weight_paths)
    : graph_(graph), float32_(float32), weight_paths_(std::move(weight_paths)) {}

std::string GraphBuilder::fresh(const std::string& hint) {
  const std::string base = scope_.empty() ? hint : scope_ + "/" + hint;
  auto [it, inserted] = used_.try_emplace(base, 1);
  if (inserted) return base;
  for (;;) {
    std::string name = fmt::format("{}_{}", base, it->second++);
    if (used_.try_emplace(name, 1).second) return name;
  }
}

DType GraphBuilder::exported(DType dtype) const {
  return float32_ && dtype.is_reduced_float() ? kFloat32 : dtype;
}

std::vector<OnnxValue> GraphBuilder::op_multi(const std::string& op_type,
                                              const std::vector<OnnxValue>& inputs,
                                              const std::vector<DType>& dtypes,
                                              const std::vector<OnnxAttribute>& attributes) {
  const ::onnx::OpSchema& schema = schema_of(op_type);
  // Opset 17 leaves bfloat16 out of Conv and the pools (and float16 out of a few ops): the
  // op then runs on float32 copies of its 16-bit operands, and its outputs are rounded back,
  // which is what mixtape's kernels compute (float32 arithmetic on 16-bit data).
  bool widen = false;
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (!inputs[i].name.empty() && inputs[i].dtype.is_reduced_float() &&
        !accepts(schema, i, inputs[i].dtype))
      widen = true;
  std::vector<OnnxValue> in = inputs;
  std::vector<DType> out_dtypes = dtypes;
  if (widen) {
    for (auto& v : in)
      if (!v.name.empty() && v.dtype.is_reduced_float()) v = cast(v, kFloat32);
    for (auto& d : out_dtypes)
      if (d.is_reduced_float()) d = kFloat32;
  }
  ::onnx::NodeProto* node = graph_.add_node();
  node->set_op_type(op_type);
  node->set_name(fresh(op_type));
  for (const auto& v : in) node->add_input(v.name);
  std::vector<OnnxValue> outs;
  for (std::size_t k = 0; k < out_dtypes.size(); ++k) {
    const std::string name =
        fresh(out_dtypes.size() == 1 ? op_type + "_out" : fmt::format("{}_out{}", op_type, k));
    node->add_output(name);
    outs.push_back(OnnxValue{name, out_dtypes[k]});
  }
  for (const auto& attr : attributes) set_attribute(*node->add_attribute(), attr);
  if (widen)
    for (std::size_t k = 0; k < outs.size(); ++k) outs[k] = cast(outs[k], dtypes[k]);
  return outs;
}

OnnxValue GraphBuilder::op(const std::string& op_type, const std::vector<OnnxValue>& inputs,
                           DType dtype, const std::vector<OnnxAttribute>& attributes) {
  return op_multi(op_type, inputs, {dtype}, attributes).front();
}

OnnxValue GraphBuilder::cast(const OnnxValue& x, DType dtype) {
  if (x.dtype == dtype) return x;
  return op("Cast", {x}, dtype, {{"to", onnx_type(dtype, "a cast's target")}});
}

OnnxValue GraphBuilder::initializer(const Tensor& value, const std::string& name) {
  ::onnx::TensorProto* t = graph_.add_initializer();
  t->set_name(name);
  t->set_data_type(onnx_type(value.dtype(), fmt::format("initializer '{}'", name)));
  for (std::int64_t d : value.shape()) t->add_dims(d);
  // Row-major bytes, little-endian as ONNX's raw_data is (the host is: mixtape's files
  // assume it too, io/safetensors.cpp).
  const Tensor host = value.to(Device::cpu()).contiguous();
  if (host.numel() > 0)
    t->set_raw_data(static_cast<const char*>(host.const_data_ptr()), host.nbytes());
  return OnnxValue{name, value.dtype()};
}

OnnxValue GraphBuilder::constant(const Tensor& value, const std::string& hint) {
  return initializer(value, fresh(hint));
}

OnnxValue GraphBuilder::ints(const std::vector<std::int64_t>& values, const std::string& hint) {
  return constant(from_vector(values, Shape{static_cast<std::int64_t>(values.size())}), hint);
}

OnnxValue GraphBuilder::weight(const layers::Layer& layer, const std::string& name, DType dtype,
                               const std::optional<Shape>& shape,
                               const std::vector<int>& permutation) {
  const std::string suffix = "/" + name;
  const Variable* found = nullptr;
  const std::vector<Variable> weights = layer.weights();
  for (const Variable& v : weights) {
    const std::string& n = v.name();
    if (n.size() >= suffix.size() &&
        n.compare(n.size() - suffix.size(), suffix.size(), suffix) == 0) {
      found = &v;
      break;
    }
  }
  if (found == nullptr)
    throw ValueError(fmt::format("layer '{}' has no weight '{}'", layer.name(), name));
  auto p = weight_paths_.find(found->id());
  std::string path = p != weight_paths_.end() ? p->second : found->name();
  NoGradGuard no_grad;
  Tensor value = *found;
  // Under OnnxExportOptions::float32 the file holds no 16-bit tensor at all.
  if (float32_ && value.dtype().is_reduced_float()) value = value.to(kFloat32);
  std::string layout;
  if (!permutation.empty()) {
    value = permute(value, permutation);
    layout += fmt::format("[{}]", fmt::join(permutation, ","));
  }
  if (shape && *shape != value.shape()) {
    value = reshape(value.contiguous(), *shape);
    layout += fmt::format("[{}]", fmt::join(shape->dims(), "x"));
  }
  const std::string key = path + layout;
  auto it = weights_.find(key);
  if (it == weights_.end()) {
    const std::string name_in_file = used_.try_emplace(key, 1).second ? key : fresh(key);
    it = weights_.emplace(key, initializer(value, name_in_file)).first;
  }
  return cast(it->second, exported(dtype));
}

OnnxValue GraphBuilder::add_input(const std::string& name, DType dtype, const Shape& shape) {
  used_.try_emplace(name, 1);
  ::onnx::ValueInfoProto* info = graph_.add_input();
  info->set_name(name);
  set_type(*info, dtype, shape);
  return OnnxValue{name, dtype};
}

void GraphBuilder::add_output(const std::string& name, const OnnxValue& value, const Shape& shape) {
  OnnxValue out = value;
  if (value.name != name) {
    ::onnx::NodeProto* node = graph_.add_node();
    node->set_op_type("Identity");
    node->set_name(fresh("Identity"));
    node->add_input(value.name);
    node->add_output(name);
    out.name = name;
  }
  used_.try_emplace(name, 1);
  ::onnx::ValueInfoProto* info = graph_.add_output();
  info->set_name(name);
  set_type(*info, out.dtype, shape);
}

void GraphBuilder::prune() {
  std::set<std::string> needed;
  for (const auto& o : graph_.output()) needed.insert(o.name());
  std::vector<bool> keep(static_cast<std::size_t>(graph_.node_size()), false);
  for (int i = graph_.node_size() - 1; i >= 0; --i) {
    const auto& node = graph_.node(i);
    bool used = false;
    for (const auto& o : node.output()) used = used || needed.count(o) > 0;
    if (!used) continue;
    keep[static_cast<std::size_t>(i)] = true;
    for (const auto& in : node.input())
      if (!in.empty()) needed.insert(in);
  }
  google::protobuf::RepeatedPtrField<::onnx::NodeProto> nodes;
  for (int i = 0; i < graph_.node_size(); ++i)
    if (keep[static_cast<std::size_t>(i)]) *nodes.Add() = graph_.node(i);
  graph_.mutable_node()->Swap(&nodes);
  google::protobuf::RepeatedPtrField<::onnx::TensorProto> inits;
  for (auto& t : *graph_.mutable_initializer())
    if (needed.count(t.name()) > 0) inits.Add()->Swap(&t);
  graph_.mutable_initializer()->Swap(&inits);
}

}  // namespace mixtape::onnx_detail
