// Layer: naming, building, casting, weights, and symbolic calls.
#include "mixtape/layers/layer.h"

#include <cxxabi.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <typeinfo>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/compute_mode.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/layers/activations.h"
#include "mixtape/layers/trace_record.h"

namespace mixtape::layers {

namespace {

// "MaxPooling2D" -> "max_pooling2d", "Dense" -> "dense" (Keras' to_snake_case).
std::string snake_case(const std::string& name) {
  std::string step1;
  for (std::size_t i = 0; i < name.size(); ++i) {
    // An upper-case letter starting a word of lower-case letters or digits, not first.
    const bool word = i > 0 && std::isupper(static_cast<unsigned char>(name[i])) &&
                      i + 1 < name.size() &&
                      (std::islower(static_cast<unsigned char>(name[i + 1])) ||
                       std::isdigit(static_cast<unsigned char>(name[i + 1])));
    if (word) step1 += '_';
    step1 += name[i];
  }
  std::string out;
  for (std::size_t i = 0; i < step1.size(); ++i) {
    if (i > 0 && std::isupper(static_cast<unsigned char>(step1[i])) &&
        std::islower(static_cast<unsigned char>(step1[i - 1])))
      out += '_';
    out += static_cast<char>(std::tolower(static_cast<unsigned char>(step1[i])));
  }
  return out;
}

std::mutex g_names_mutex;
std::map<std::string, int>& name_counts() {
  static std::map<std::string, int> counts;
  return counts;
}

// "dense" the first time, then "dense_1", "dense_2", ...
std::string unique_name(const std::string& base) {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  int& n = name_counts()[base];
  const std::string name = n == 0 ? base : fmt::format("{}_{}", base, n);
  ++n;
  return name;
}

// A copy of `t` with storage of its own.
Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  if (c.numel() > 0) find_kernel<kernels::CopyFn>(OpId::copy, c.device().type(), c.dtype())(t, c);
  return c;
}

// The shape an InputSpec describes, with None where any extent goes: "[None, 28, 28]" for
// an exact rank, "[..., 784]" for required trailing extents; empty when it says nothing of
// the extents.
std::string spec_shape_text(const InputSpec& spec) {
  auto extent = [&](int axis, int rank) -> std::string {
    for (const auto& [a, e] : spec.axes)
      if (a == axis || (rank >= 0 && a + rank == axis)) return std::to_string(e);
    return "None";
  };
  std::vector<std::string> dims;
  if (spec.rank >= 0) {
    for (int i = 0; i < spec.rank; ++i) dims.push_back(extent(i, spec.rank));
    return fmt::format("[{}]", fmt::join(dims, ", "));
  }
  if (spec.axes.empty()) return {};
  int lowest = 0, highest = -1;
  for (const auto& [a, e] : spec.axes) {
    lowest = std::min(lowest, a);
    highest = std::max(highest, a);
  }
  if (lowest < 0 && highest >= 0) return {};  // both ends: no simple picture
  if (lowest < 0) {
    dims.emplace_back("...");
    for (int a = lowest; a < 0; ++a) dims.push_back(extent(a, -1));
  } else {
    for (int a = 0; a <= highest; ++a) dims.push_back(extent(a, -1));
    dims.emplace_back("...");
  }
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

bool starts_with(const char* what, const std::string& prefix) {
  return std::string_view(what).substr(0, prefix.size()) == prefix;
}

}  // namespace

void reset_default_names() {
  std::lock_guard<std::mutex> lock(g_names_mutex);
  name_counts().clear();
}

// --- Symbolic tensors -------------------------------------------------------------------

SymbolicTensor SymbolicTensor::output_of(std::shared_ptr<detail::SymbolicNode> node, int index) {
  SymbolicTensor t;
  if (node && (index < 0 || static_cast<std::size_t>(index) >= node->outputs.size()))
    throw IndexError(fmt::format("SymbolicTensor: layer '{}' has {} outputs; asked for output {}",
                                 node->layer->name(), node->outputs.size(), index));
  t.node_ = std::move(node);
  t.index_ = index;
  return t;
}

const Shape& SymbolicTensor::shape() const {
  if (!node_) throw ValueError("SymbolicTensor::shape: the symbolic tensor is undefined");
  return node_->outputs[static_cast<std::size_t>(index_)].shape;
}
DType SymbolicTensor::dtype() const {
  if (!node_) throw ValueError("SymbolicTensor::dtype: the symbolic tensor is undefined");
  return node_->outputs[static_cast<std::size_t>(index_)].dtype;
}
const std::shared_ptr<Layer>& SymbolicTensor::layer() const {
  if (!node_) throw ValueError("SymbolicTensor::layer: the symbolic tensor is undefined");
  return node_->layer;
}
std::string SymbolicTensor::name() const {
  if (!node_) return "<undefined>";
  return node_->outputs.size() == 1 ? node_->layer->name()
                                    : fmt::format("{}[{}]", node_->layer->name(), index_);
}

// --- Automatic tracking of sublayers ---------------------------------------------------
//
// Two per-thread stacks. The frames: one per construction by make_layer (collecting the
// layers made inside it) and one per build() (whose owner tracks what is made inside it at
// once, so that build() may call it right away). The calls: the layers whose operator() is
// running, innermost last, for the check that a layer called inside another's call() is
// tracked by it (or by a layer further out).

namespace detail {

struct Tracking {
  struct Frame {
    Layer* owner = nullptr;                                    // a build() frame
    std::vector<std::shared_ptr<Layer>>* collected = nullptr;  // a construction frame
  };
  static std::vector<Frame>& frames() {
    thread_local std::vector<Frame> stack;
    return stack;
  }
  static std::vector<const Layer*>& calls() {
    thread_local std::vector<const Layer*> stack;
    return stack;
  }
  static void track(Layer& owner, std::shared_ptr<Layer> layer) { owner.track(std::move(layer)); }
  // `layer` was just made: it goes to the innermost frame, if any.
  static void hand_to_enclosing(const std::shared_ptr<Layer>& layer) {
    if (frames().empty()) return;
    const Frame& f = frames().back();
    if (f.owner)
      track(*f.owner, layer);
    else
      f.collected->push_back(layer);
  }
  static bool tracks(const Layer& owner, const Layer* layer) {
    return owner.sublayer_set_.count(layer) > 0;
  }

  // The weights of `layer` and its sublayers with their paths, `prefix` being the path of
  // what holds it ("" at the root and for a model's layers).
  static void collect_paths(const Layer& layer, const std::string& prefix,
                            std::vector<WeightPath>& out, std::unordered_set<std::uint64_t>& seen) {
    if (!layer.scopes_sublayers()) {  // a model: its layers are named in its graph
      for (const auto& l : layer.sublayers_) collect_paths(*l, prefix, out, seen);
      return;
    }
    const std::string path =
        prefix.empty() ? layer.name() : fmt::format("{}/{}", prefix, layer.name());
    if (!prefix.empty() && !layer.weights_.empty() && !layer.name_given_ && !layer.name_scoped_)
      throw ValueError(fmt::format(
          "layer '{}' ({}) inside '{}' has a default name that is unique only in this process (it "
          "was built before a layer holding it tracked it), so another process would not find "
          "its weights by it: give it a name ({{.name = ...}}), or make it in the constructor or "
          "build() of the layer that holds it",
          layer.name(), layer.class_name(), prefix));
    for (const auto& w : layer.weights_)
      if (seen.insert(w.variable.id()).second)
        out.push_back(
            WeightPath{fmt::format("{}/{}", path, w.name), w.variable, &layer, !prefix.empty()});
    for (const auto& l : layer.sublayers_) collect_paths(*l, path, out, seen);
  }

  // The default name of `layer` unique among the sublayers of `owner`: the first free of
  // "dense", "dense_1", ...
  static std::string scoped_name(const Layer& owner, const Layer& layer) {
    const std::string base = snake_case(layer.class_name());
    std::unordered_set<std::string> taken;
    for (const auto& l : owner.sublayers_) taken.insert(l->name());
    std::string name = base;
    for (int n = 1; taken.count(name); ++n) name = fmt::format("{}_{}", base, n);
    return name;
  }
};

// Pops a frame or a call when it ends, also by an exception.
template <typename T>
struct PopGuard {
  std::vector<T>& stack;
  ~PopGuard() { stack.pop_back(); }
};

ConstructionFrame::ConstructionFrame() {
  Tracking::frames().push_back(Tracking::Frame{nullptr, &children_});
}

ConstructionFrame::~ConstructionFrame() {
  if (open_) Tracking::frames().pop_back();
}

void ConstructionFrame::made(const std::shared_ptr<Layer>& layer) {
  Tracking::frames().pop_back();
  open_ = false;
  for (auto& child : children_)
    if (child != layer) Tracking::track(*layer, std::move(child));
  children_.clear();
  Tracking::hand_to_enclosing(layer);
}

std::string unique_layer_name(const std::string& base) { return unique_name(base); }

bool has_unbuilt_sublayer(const Layer& layer) {
  for (const auto& l : layer.sublayers())
    if (!l->built() || has_unbuilt_sublayer(*l)) return true;
  return false;
}

std::string shape_with_none(const Shape& s) {
  std::vector<std::string> dims;
  for (auto d : s) dims.push_back(d < 0 ? std::string("None") : std::to_string(d));
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

void throw_null_layer() { throw ValueError("LayerPtr: called through an empty layer pointer"); }

std::vector<TensorSpec> build_for_specs(const std::shared_ptr<Layer>& layer,
                                        const std::vector<TensorSpec>& specs) {
  const std::string prefix = fmt::format("layer '{}' ({}): ", layer->name(), layer->class_name());
  std::optional<std::vector<TensorSpec>> out;
  try {
    out = layer->compute_output_spec(specs);
    if (out && out->empty()) throw ValueError("compute_output_spec() returned no outputs");
  } catch (const Error& e) {
    if (starts_with(e.what(), prefix)) throw;
    e.rethrow_with_prefix(prefix);
  }
  if (out) {
    // The shape rule said what comes out: the layer is built from the shapes (nothing runs),
    // unless its build() leaves sublayers unbuilt (they are built on a first call): then it
    // runs once below, so that the model has every weight from the start (a file of it holds
    // them, a loaded model takes them).
    layer->build_symbolic(specs);
    layer->output_shape_ = out->front().shape;
    if (!has_unbuilt_sublayer(*layer)) return *out;
  }
  // No shape rule: a concrete batch of one stands in for the batch axis.
  std::vector<Tensor> probes;
  bool batched = true;
  for (const auto& s : specs) {
    std::vector<std::int64_t> dims = s.shape.dims();
    if (dims.empty() || dims[0] >= 0) batched = false;
    if (!dims.empty() && dims[0] < 0) dims[0] = 1;
    probes.push_back(zeros(Shape(dims), s.dtype, layer->built() ? layer->device() : Device::cpu()));
  }
  std::vector<Tensor> ys;
  {
    NoGradGuard no_grad;
    mixtape::detail::DTypeTraceMute mute;
    ys = layer->apply(probes, CallContext{.training = false});
  }
  if (out) return *out;
  std::vector<TensorSpec> result;
  for (const auto& y : ys) {
    std::vector<std::int64_t> dims = y.shape().dims();
    if (batched && !dims.empty()) dims[0] = -1;
    result.push_back(TensorSpec{Shape(dims), y.dtype()});
  }
  return result;
}

std::vector<SymbolicTensor> call_symbolic(const std::shared_ptr<Layer>& layer,
                                          const std::vector<SymbolicTensor>& inputs) {
  if (inputs.empty())
    throw ValueError(fmt::format("layer '{}' ({}): called on no symbolic tensors", layer->name(),
                                 layer->class_name()));
  std::vector<TensorSpec> specs;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined())
      throw ValueError(
          inputs.size() == 1
              ? fmt::format("layer '{}' ({}): called on an undefined symbolic tensor",
                            layer->name(), layer->class_name())
              : fmt::format("layer '{}' ({}): input {} is an undefined symbolic tensor",
                            layer->name(), layer->class_name(), i));
    specs.push_back(TensorSpec{inputs[i].shape(), inputs[i].dtype()});
  }
  auto node = std::make_shared<SymbolicNode>();
  node->layer = layer;
  node->inputs = inputs;
  node->outputs = build_for_specs(layer, specs);
  std::vector<SymbolicTensor> result;
  for (std::size_t i = 0; i < node->outputs.size(); ++i)
    result.push_back(SymbolicTensor::output_of(node, static_cast<int>(i)));
  return result;
}

}  // namespace detail

// --- Layer ------------------------------------------------------------------------------

Layer::Layer(LayerOptions options) : Layer(std::move(options), std::string()) {}

Layer::Layer(LayerOptions options, std::string class_name)
    : name_(std::move(options.name)),
      name_given_(!name_.empty()),
      given_class_name_(std::move(class_name)),
      policy_(options.dtype ? *options.dtype : global_policy()),
      trainable_(options.trainable) {
  // Built-in layers know their class here; a user's layer is named on first use of
  // name(), when its dynamic type is known.
  if (name_.empty() && !given_class_name_.empty())
    name_ = unique_name(snake_case(given_class_name_));
}

Layer::~Layer() {
  for (const auto& l : sublayers_)
    if (l->owner_ == this) l->owner_ = nullptr;
}

const std::string& Layer::name() const {
  if (name_.empty()) name_ = unique_name(snake_case(class_name()));
  return name_;
}

std::string Layer::owned_name() const {
  return owner_ ? fmt::format("{}/{}", owner_->owned_name(), name()) : name();
}

std::string Layer::class_name() const {
  return given_class_name_.empty() ? detail::class_name_of(typeid(*this)) : given_class_name_;
}

DType Layer::computation_dtype() const {
  const DType c = compute_dtype();
  return c.is_reduced_float() ? kFloat32 : c;
}

Config Layer::get_config() const {
  Config c;
  c.set("name", name());
  c.set("trainable", trainable_);
  c.set("dtype", policy_.name());
  detail::add_builtin_config(*this, c);  // a built-in class's fields, from its table row
  return c;
}

void Layer::build(const Shape&) {}

void Layer::build_multi(const std::vector<Shape>& input_shapes) {
  if (input_shapes.size() == 1) build(input_shapes.front());
}

Tensor Layer::call(const Tensor&, const CallContext&) {
  throw ValueError(
      "call() is not implemented: a layer overrides call(x, ctx) (one input and one output) or "
      "call_multi(inputs, ctx)");
}

std::vector<Tensor> Layer::call_multi(const std::vector<Tensor>& inputs, const CallContext& ctx) {
  if (inputs.size() != 1)
    throw ValueError(fmt::format(
        "takes one input; got {} (a layer of several inputs overrides call_multi)", inputs.size()));
  return {call(inputs.front(), ctx)};
}

std::optional<Shape> Layer::compute_output_shape(const Shape&) const { return std::nullopt; }

std::optional<std::vector<TensorSpec>> Layer::compute_output_spec(
    const std::vector<TensorSpec>& inputs) const {
  if (inputs.size() != 1 || !inputs.front().dtype.is_floating() || !compute_dtype().is_floating())
    return std::nullopt;
  std::optional<Shape> shape = compute_output_shape(inputs.front().shape);
  if (!shape) return std::nullopt;
  return std::vector<TensorSpec>{TensorSpec{*shape, compute_dtype()}};
}

Tensor Layer::operator()(const Tensor& input, const CallContext& ctx) {
  if (!input.defined())
    throw ValueError(
        fmt::format("layer '{}' ({}): called on an undefined tensor", name(), class_name()));
  return (*this)(std::vector<Tensor>{input}, ctx);
}

Tensor Layer::operator()(const std::vector<Tensor>& inputs, const CallContext& ctx) {
  std::vector<Tensor> outputs = apply(inputs, ctx);
  if (outputs.size() != 1)
    throw ValueError(fmt::format(
        "layer '{}' ({}): has {} outputs; call apply() (or a model with a vector of inputs) to "
        "get them all",
        name(), class_name(), outputs.size()));
  return std::move(outputs.front());
}

std::vector<Tensor> Layer::apply(const std::vector<Tensor>& inputs, const CallContext& ctx) {
  if (inputs.empty())
    throw ValueError(fmt::format("layer '{}' ({}): called on no tensors", name(), class_name()));
  for (std::size_t i = 0; i < inputs.size(); ++i)
    if (!inputs[i].defined())
      throw ValueError(
          fmt::format("layer '{}' ({}): input {} is an undefined tensor", name(), class_name(), i));
  try {
    check_tracked_by_caller();
    auto& calls = detail::Tracking::calls();
    calls.push_back(this);
    const detail::PopGuard<const Layer*> pop_call{calls};
    std::vector<Tensor> xs = inputs;
    std::vector<Shape> shapes;
    std::vector<DType> dtypes;
    for (std::size_t i = 0; i < xs.size(); ++i) {
      Tensor& x = xs[i];
      if (autocast_inputs() && x.dtype().is_floating() && compute_dtype().is_floating() &&
          x.dtype() != compute_dtype()) {
        // One tensor given twice ({x, x}: self-attention) is cast once, and stays one tensor.
        std::size_t same = 0;
        while (same < i && inputs[same].id() != inputs[i].id()) ++same;
        x = same < i ? xs[same] : cast(x, compute_dtype());
      }
      shapes.push_back(x.shape());
      dtypes.push_back(x.dtype());
    }
    build_and_check(shapes, dtypes, xs.front().device());
    std::vector<Tensor> ys;
    {
      std::optional<DType> cast_to;
      if (compute_dtype().is_floating()) cast_to = compute_dtype();
      AutocastScope autocast_scope(cast_to);
      ys = call_multi(xs, ctx);
    }
    if (ys.empty()) throw ValueError("call_multi() returned no outputs");
    for (const Tensor& y : ys)
      if (!y.defined()) throw ValueError("call() returned an undefined tensor");
    std::vector<std::int64_t> dims = ys.front().shape().dims();
    if (!dims.empty() && inputs.front().rank() > 0) dims[0] = -1;
    output_shape_ = Shape(dims);
    if (sublayers_.empty() && mixtape::detail::dtype_trace_active()) {
      DTypeTraceRow row{name(),
                        class_name(),
                        policy_.name(),
                        inputs.front().dtype(),
                        xs.front().dtype(),
                        std::nullopt,
                        std::nullopt,
                        computation_dtype(),
                        ys.front().dtype(),
                        trace_note()};
      for (const auto& w : weights_) {
        if (!w.variable.dtype().is_floating()) continue;
        row.weight = w.variable.dtype();
        row.weight_read =
            w.variable.autocast() && compute_dtype().is_floating() ? compute_dtype() : *row.weight;
        break;
      }
      mixtape::detail::dtype_trace_record(row);
    }
    return ys;
  } catch (const Error& e) {
    // Errors of inner layers carry their own name; ours goes in front (a path).
    const std::string prefix = fmt::format("layer '{}' ({}): ", name(), class_name());
    if (starts_with(e.what(), prefix)) throw;
    e.rethrow_with_prefix(prefix);
  }
}

void Layer::build_and_check(const std::vector<Shape>& shapes, const std::vector<DType>& dtypes,
                            Device device) {
  if (built_) {
    check_inputs(shapes, dtypes);
    return;
  }
  if (!device_set_) device_ = device;
  device_set_ = true;
  const std::size_t sublayers_before = sublayers_.size();
  try {
    // Layers made inside build() become sublayers (detail::Tracking).
    auto& frames = detail::Tracking::frames();
    frames.push_back(detail::Tracking::Frame{this, nullptr});
    const detail::PopGuard<detail::Tracking::Frame> pop_frame{frames};
    build_multi(shapes);
    // A spec set before the build (an Input's) can refuse the first input: the layer
    // then stays unbuilt.
    check_inputs(shapes, dtypes);
    built_shapes_ = shapes;
  } catch (...) {
    weights_.clear();
    built_shapes_.clear();
    for (auto it = sublayers_.begin() + static_cast<std::ptrdiff_t>(sublayers_before);
         it != sublayers_.end(); ++it) {
      sublayer_set_.erase(it->get());
      if ((*it)->owner_ == this) (*it)->owner_ = nullptr;  // it may outlive this layer
    }
    sublayers_.erase(sublayers_.begin() + static_cast<std::ptrdiff_t>(sublayers_before),
                     sublayers_.end());
    throw;
  }
  built_ = true;
}

void Layer::build_symbolic(const std::vector<TensorSpec>& inputs) {
  std::vector<Shape> shapes;
  std::vector<DType> dtypes;
  for (const auto& s : inputs) {
    shapes.push_back(s.shape);
    // As a call would see it: floating inputs cast to the compute dtype.
    dtypes.push_back(autocast_inputs() && s.dtype.is_floating() && compute_dtype().is_floating()
                         ? compute_dtype()
                         : s.dtype);
  }
  try {
    build_and_check(shapes, dtypes, built_ ? device_ : Device::cpu());
  } catch (const Error& e) {
    const std::string prefix = fmt::format("layer '{}' ({}): ", name(), class_name());
    if (starts_with(e.what(), prefix)) throw;
    e.rethrow_with_prefix(prefix);
  }
}

SymbolicTensor Layer::operator()(const SymbolicTensor& x) {
  return (*this)(std::vector<SymbolicTensor>{x});
}

SymbolicTensor Layer::operator()(const std::vector<SymbolicTensor>& inputs) {
  std::vector<SymbolicTensor> outputs = apply(inputs);
  if (outputs.size() != 1)
    throw ValueError(fmt::format(
        "layer '{}' ({}): has {} outputs; call apply() (or a model with a vector of inputs) to "
        "get them all",
        name(), class_name(), outputs.size()));
  return outputs.front();
}

std::vector<SymbolicTensor> Layer::apply(const std::vector<SymbolicTensor>& inputs) {
  std::shared_ptr<Layer> self = weak_from_this().lock();
  if (!self)
    throw ValueError(fmt::format(
        "layer '{}' ({}): called on a symbolic tensor but not held by a std::shared_ptr; make it "
        "with make_layer<T>(...) or std::make_shared (a model: std::make_shared<Model>(...))",
        name(), class_name()));
  return detail::call_symbolic(self, inputs);
}

void Layer::check_inputs(const std::vector<Shape>& shapes, const std::vector<DType>& dtypes) const {
  if (!checks_input_count() && !built_shapes_.empty() && shapes.size() != built_shapes_.size())
    throw ValueError(fmt::format("expected {} input{} (as when it was built); got {}",
                                 built_shapes_.size(), built_shapes_.size() == 1 ? "" : "s",
                                 shapes.size()));
  if (shapes.size() == 1) check_input(shapes.front(), dtypes.front());
}

void Layer::check_input(const Shape& x, DType dtype) const {
  if (!input_spec_) return;
  const InputSpec& spec = *input_spec_;
  const auto rank = static_cast<int>(x.rank());
  // What is expected, "(shape [None, 28, 28])" or "(shape [..., 784]; built for inputs of
  // shape [2, 784])": the spec's shape, and the shape of the first input when there was one.
  const auto expected = [&] {
    const std::string shape = spec_shape_text(spec);
    std::vector<std::string> parts;
    if (!shape.empty()) parts.push_back("shape " + shape);
    if (built_shapes_.size() == 1)
      parts.push_back("built for inputs of shape " +
                      detail::shape_with_none(built_shapes_.front()));
    return parts.empty() ? std::string() : fmt::format(" ({})", fmt::join(parts, "; "));
  };
  const auto got = [&] { return fmt::format("{}{}", dtype, detail::shape_with_none(x)); };
  if (spec.rank >= 0 && rank != spec.rank)
    throw ShapeError(
        fmt::format("expected an input of rank {}{}; got {}", spec.rank, expected(), got()));
  if (spec.min_rank >= 0 && rank < spec.min_rank)
    throw ShapeError(
        fmt::format("expected an input of rank >= {}{}; got {}", spec.min_rank, expected(), got()));
  for (const auto& [axis, extent] : spec.axes) {
    const int a = axis < 0 ? axis + rank : axis;
    if (a < 0 || a >= rank || x[static_cast<std::size_t>(a)] != extent)
      throw ShapeError(fmt::format("expected axis {} of the input to be {}{}; got {}", axis, extent,
                                   expected(), got()));
  }
}

namespace detail {

namespace {
thread_local WeightBudget* t_budget = nullptr;
}  // namespace

WeightBudget::WeightBudget(std::uint64_t bytes, std::string source)
    : left_(bytes), source_(std::move(source)), outer_(t_budget) {
  t_budget = this;
}

WeightBudget::~WeightBudget() { t_budget = outer_; }

void WeightBudget::take(const Shape& shape, DType dtype, const std::string& what) {
  WeightBudget* b = t_budget;
  if (!b) return;
  // The bytes, saturating (a declared extent of 2^62 must not wrap around).
  long double bytes = static_cast<long double>(dtype.itemsize());
  for (const auto d : shape) bytes *= static_cast<long double>(std::max<std::int64_t>(d, 0));
  if (bytes > static_cast<long double>(b->left_))
    throw ValueError(fmt::format(
        "{} {}{} would take {:.0f} bytes, more than the weights of {} hold ({} bytes left): the "
        "architecture does not fit the weights (a damaged or edited file?); nothing was "
        "allocated",
        what, dtype, shape, static_cast<double>(bytes), b->source_, b->left_));
  b->left_ -= static_cast<std::uint64_t>(bytes);
}

}  // namespace detail

namespace {

// Whether `device` multiplies FP8 operands: the CPU (emulated) and CUDA devices of compute
// capability 8.9 or newer, asked once per device (a Dense call must not query the driver).
// An older GPU is told once per process.
bool float8_capable(Device device) {
  if (device.is_cpu()) return true;
  static std::mutex mutex;
  static std::map<std::pair<int, int>, bool> known;  // (device type, index) -> capable
  std::lock_guard<std::mutex> lock(mutex);
  const std::pair<int, int> key{static_cast<int>(device.type()), device.index()};
  if (const auto it = known.find(key); it != known.end()) return it->second;
  const DeviceProperties p = backend_for(device.type()).properties(device.index());
  const bool capable = p.compute_major > 8 || (p.compute_major == 8 && p.compute_minor >= 9);
  if (!capable) {
    static std::once_flag once;
    std::call_once(once, [&] {
      spdlog::warn(
          "Mixed precision compatibility check (mixed_float8): your GPU {} ({}, compute "
          "capability {}.{}) has no FP8 tensor cores (compute capability 8.9 or newer): its "
          "Dense and attention projections compute in bfloat16 instead. This message is "
          "logged once.",
          device.str(), p.name, p.compute_major, p.compute_minor);
    });
  }
  known[key] = capable;
  return capable;
}

}  // namespace

std::optional<Layer::Float8State> Layer::add_float8_state(const std::string& prefix) {
  const Float8Scaling& scaling = policy_.float8_scaling();
  if (!policy_.float8_matmuls() || scaling.kind != Float8Scaling::Kind::Delayed)
    return std::nullopt;
  const WeightOptions state{.trainable = false, .dtype = kFloat32, .autocast = false};
  const Shape shape{scaling.history};
  return Float8State{add_weight(prefix + "input_amax_history", shape, init::zeros(), state),
                     add_weight(prefix + "kernel_amax_history", shape, init::zeros(), state),
                     add_weight(prefix + "grad_amax_history", shape, init::zeros(), state)};
}

Tensor Layer::policy_matmul(const Tensor& x, const Tensor& w,
                            const std::optional<Float8State>& state, bool training) const {
  return policy_product(x, w, Tensor(), "linear", state, training, nullptr);
}

Tensor Layer::policy_product(const Tensor& x, const Tensor& w, const Tensor& bias,
                             const std::string& activation, const std::optional<Float8State>& state,
                             bool training, bool* fused) const {
  if (fused) *fused = false;
  if (!policy_.float8_matmuls()) return matmul(x, w);
  if (!float8_capable(x.device())) {
    matmul_note_ = "bfloat16 matmul (no FP8 on this GPU)";
    return matmul(x, w);
  }
  // FP8 GEMMs take dimensions that are multiples of 16 (k and n forward; m is the inner
  // dimension of the weight gradient's product): other shapes stay in bfloat16, on every
  // device, so that the CPU computes what a GPU would.
  const std::int64_t k = w.rank() == 2 ? w.dim(0) : 0, n = w.rank() == 2 ? w.dim(1) : 0;
  const std::int64_t m = k > 0 ? x.numel() / k : 0;
  if (k % 16 != 0 || n % 16 != 0 || m % 16 != 0 || m == 0) {
    matmul_note_ =
        fmt::format("bfloat16 matmul ([{}, {}] x [{}, {}]: FP8 needs multiples of 16)", m, k, k, n);
    return matmul(x, w);
  }
  // The bias and the activation in the FP8 product's epilogue, when given.
  const bool epilogue = fused && (bias.defined() || activation != "linear");
  if (fused) *fused = true;
  const bool act_fused = epilogue && activation != "linear";
  const std::string with =
      epilogue ? fmt::format("; {}{}{} fused", bias.defined() ? "bias" : "",
                             bias.defined() && act_fused ? ", " : "", act_fused ? activation : "")
               : "";
  // float8_linear takes the bias in float32 (a float32 variable as it is: its gradient stays
  // float32) and adds its value in the output's dtype to the float32 product.
  const Tensor b = epilogue ? bias : Tensor();
  const std::string act = epilogue ? activation : "linear";
  if (!state) {
    matmul_note_ = fmt::format("float8 matmul (e4m3, gradients e5m2{})", with);
    return float8_linear(x, w, compute_dtype(), nullptr, b, act);
  }
  const Float8Scaling& scaling = policy_.float8_scaling();
  matmul_note_ =
      fmt::format("float8 matmul (e4m3, gradients e5m2; delayed scaling, {} steps, margin {}{})",
                  scaling.history, scaling.margin, with);
  const Float8History history{.input = state->input,
                              .weight = state->weight,
                              .grad = state->grad,
                              .margin = scaling.margin,
                              .update = training};
  return float8_linear(x, w, compute_dtype(), &history, b, act);
}

Tensor Layer::policy_linear(const Tensor& x, const Tensor& w, const Tensor& bias,
                            const std::string& activation, const std::optional<Float8State>& state,
                            bool training) const {
  const DType cd = compute_dtype();
  if (is_linear_activation(activation) && (bias.defined() || activation != "linear") &&
      !policy_.float8_matmuls()) {
    if (!cd.is_reduced_float() || gemm_accumulation_dtype(cd) != cd) {
      // The note is the same at every call of a layer (its bias and activation do not change):
      // written once, not formatted per call.
      if (matmul_note_.rfind("fused linear", 0) != 0) {
        const bool act = activation != "linear";
        matmul_note_ = fmt::format("fused linear ({}{}{})", bias.defined() ? "bias" : "",
                                   bias.defined() && act ? ", " : "", act ? activation : "");
      }
      return linear(x, w, bias, activation);
    }
    matmul_note_ = "composed (16-bit accumulation: MIXTAPE_FP16_USE_FP32_COMPUTE=0)";
  }
  // Under mixed_float8 the FP8 product takes the bias and the activation linear() applies.
  bool fused = false;
  Tensor y = policy_product(x, w, bias, activation, state, training,
                            is_linear_activation(activation) ? &fused : nullptr);
  if (fused) return y;
  // A variable bias is read as the product's dtype by autocast; a bias made from one outside
  // autocast (a reshaped variable) is cast to it here.
  if (bias.defined())
    y = y + (bias.is_variable() || bias.dtype() == y.dtype() ? bias : cast(bias, y.dtype()));
  return activation == "linear" ? y : activations::get(activation)(y);
}

Variable Layer::add_weight(const std::string& name, const Shape& shape,
                           const init::Initializer& init, WeightOptions options) {
  const DType dtype = options.dtype ? *options.dtype : variable_dtype();
  detail::WeightBudget::take(shape, dtype, fmt::format("add_weight '{}':", name));
  Tensor value;
  try {
    value = init(shape, dtype, device_);
  } catch (const Error& e) {
    // "add_weight 'kernel': glorot_uniform: out of memory: ...": which weight failed.
    e.rethrow_with_prefix(fmt::format("add_weight '{}': ", name));
  }
  if (value.shape() != shape || value.dtype() != dtype)
    throw ValueError(fmt::format("add_weight '{}': initializer '{}' gave {}, expected {}{}", name,
                                 init.name(), fmt::format("{}{}", value.dtype(), value.shape()),
                                 dtype, shape));
  Variable v(std::move(value), fmt::format("{}/{}", owned_name(), name),
             options.trainable && trainable_);
  v.set_autocast(options.autocast && dtype.is_floating());
  weights_.push_back(Weight{v, options.trainable, name});
  return v;
}

void Layer::track(std::shared_ptr<Layer> layer) {
  if (!layer) throw ValueError(fmt::format("layer '{}': cannot track an empty layer", name()));
  if (layer.get() == this)
    throw ValueError(fmt::format("layer '{}' ({}): cannot track itself", name(), class_name()));
  if (sublayer_set_.count(layer.get())) return;
  // A layer that already holds this one (directly or further down) would make a cycle, and
  // weights() would never end.
  std::vector<const Layer*> pending{layer.get()};
  while (!pending.empty()) {
    const Layer* l = pending.back();
    pending.pop_back();
    for (const auto& sub : l->sublayers_) {
      if (sub.get() == this)
        throw ValueError(fmt::format(
            "layer '{}' ({}): cannot track layer '{}' ({}), which holds it already (a cycle)",
            name(), class_name(), layer->name(), layer->class_name()));
      pending.push_back(sub.get());
    }
  }
  if (scopes_sublayers() && !layer->owner_) {
    // The first owner names the layer's weights; a default name becomes unique within it
    // (not yet built: no weight carries the old name).
    if (!layer->name_given_ && !layer->built_) {
      layer->name_ = detail::Tracking::scoped_name(*this, *layer);
      layer->name_scoped_ = true;
    }
    layer->owner_ = this;
  }
  sublayer_set_.insert(layer.get());
  sublayers_.push_back(std::move(layer));
}

void Layer::check_tracked_by_caller() const {
  const auto& calls = detail::Tracking::calls();
  if (calls.empty()) return;
  for (const Layer* caller : calls)
    if (detail::Tracking::tracks(*caller, this)) return;
  const Layer& caller = *calls.back();
  throw ValueError(fmt::format(
      "called inside the call() of layer '{}' ({}), which does not track it: its weights would "
      "not be among '{}''s and would never train. Make it with make_layer or a layer factory "
      "(Dense(...), ...) in the constructor or build() of '{}' (tracked automatically), or call "
      "track() on it there",
      caller.name(), caller.class_name(), caller.name(), caller.name()));
}

void Layer::set_trainable(bool trainable) {
  trainable_ = trainable;
  apply_trainable();
  for (auto& l : sublayers_) l->set_trainable(trainable);
}

void Layer::apply_trainable() {
  for (auto& w : weights_) w.variable.set_trainable(w.declared_trainable && trainable_);
}

void Layer::to(Device device) {
  for (auto& w : weights_) w.variable.move_to(device);
  device_ = device;
  device_set_ = true;
  for (auto& l : sublayers_) l->to(device);
}

std::vector<Variable> Layer::weights() const {
  std::vector<Variable> out;
  std::unordered_set<std::uint64_t> seen;
  for (const auto& w : weights_)
    if (seen.insert(w.variable.id()).second) out.push_back(w.variable);
  for (const auto& l : sublayers_)
    for (const auto& v : l->weights())
      if (seen.insert(v.id()).second) out.push_back(v);
  return out;
}

std::vector<Variable> Layer::trainable_variables() const {
  std::vector<Variable> out;
  for (const auto& v : weights())
    if (v.trainable()) out.push_back(v);
  return out;
}

std::vector<Variable> Layer::non_trainable_variables() const {
  std::vector<Variable> out;
  for (const auto& v : weights())
    if (!v.trainable()) out.push_back(v);
  return out;
}

std::int64_t Layer::count_params() const {
  std::int64_t n = 0;
  for (const auto& v : weights()) n += v.numel();
  return n;
}

std::vector<Tensor> Layer::get_weights() const {
  std::vector<Tensor> out;
  for (const auto& v : weights()) out.push_back(clone(v));
  return out;
}

void Layer::set_weights(const std::vector<Tensor>& values) {
  const std::vector<Variable> ws = weights();
  if (values.size() != ws.size())
    throw ValueError(fmt::format("layer '{}' ({}): set_weights got {} tensors for {} weights",
                                 name(), class_name(), values.size(), ws.size()));
  for (std::size_t i = 0; i < ws.size(); ++i) {
    const Tensor& t = values[i];
    if (!t.defined())
      throw ValueError(fmt::format("layer '{}' ({}): set_weights: value {} for '{}' is undefined",
                                   name(), class_name(), i, ws[i].name()));
    if (t.shape() != ws[i].shape())
      throw ShapeError(
          fmt::format("layer '{}' ({}): set_weights: value {} for '{}' has shape {}, "
                      "expected {}",
                      name(), class_name(), i, ws[i].name(), t.shape(), ws[i].shape()));
    if (t.dtype() != ws[i].dtype())
      throw DTypeError(
          fmt::format("layer '{}' ({}): set_weights: value {} for '{}' is {}, "
                      "expected {}",
                      name(), class_name(), i, ws[i].name(), t.dtype(), ws[i].dtype()));
  }
  NoGradGuard no_grad;
  for (std::size_t i = 0; i < ws.size(); ++i) {
    Variable v = ws[i];
    v.assign(values[i].to(v.device()));
  }
}

std::vector<WeightPath> weight_paths(const Layer& root) {
  std::vector<WeightPath> out;
  std::unordered_set<std::uint64_t> seen;
  detail::Tracking::collect_paths(root, "", out, seen);
  std::unordered_map<std::string_view, const WeightPath*> by_path;
  for (const auto& w : out) {
    auto [it, fresh] = by_path.emplace(w.path, &w);
    if (!fresh)
      throw ValueError(fmt::format(
          "two weights have the path '{}': one of layer '{}' ({}), one of layer '{}' ({}); give "
          "the layers names of their own",
          w.path, it->second->layer->name(), it->second->layer->class_name(), w.layer->name(),
          w.layer->class_name()));
  }
  return out;
}

}  // namespace mixtape::layers
