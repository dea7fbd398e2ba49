// Layer: naming, building, casting, weights, and symbolic calls.
#include "mixtape/layers/layer.h"

#include <cxxabi.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <exception>
#include <map>
#include <mutex>
#include <typeinfo>
#include <unordered_set>
#include <vector>

#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "mixtape/layers/trace.h"

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

std::string demangled_class_name(const std::type_info& type) {
  int status = 0;
  char* raw = abi::__cxa_demangle(type.name(), nullptr, nullptr, &status);
  std::string full = status == 0 && raw ? raw : type.name();
  std::free(raw);
  const auto colon = full.rfind("::");
  return colon == std::string::npos ? full : full.substr(colon + 2);
}

// A copy of `t` with storage of its own.
Tensor clone(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), t.device());
  if (c.numel() > 0) find_kernel<kernels::CopyFn>(OpId::copy, c.device().type(), c.dtype())(t, c);
  return c;
}

std::string describe(const Tensor& t) { return fmt::format("{}{}", t.dtype(), t.shape()); }

// Re-throws the exception in flight with `prefix` in front of its message, keeping its
// type (every mixtape error type has the same constructor).
[[noreturn]] void rethrow_with_prefix(const std::string& prefix) {
  try {
    throw;
  } catch (const ShapeError& e) {
    throw ShapeError(prefix + e.what());
  } catch (const DTypeError& e) {
    throw DTypeError(prefix + e.what());
  } catch (const IndexError& e) {
    throw IndexError(prefix + e.what());
  } catch (const ValueError& e) {
    throw ValueError(prefix + e.what());
  } catch (const KernelNotFoundError& e) {
    throw KernelNotFoundError(prefix + e.what());
  } catch (const AutogradError& e) {
    throw AutogradError(prefix + e.what());
  } catch (const DeviceError& e) {
    throw DeviceError(prefix + e.what());
  } catch (const NumericError& e) {
    throw NumericError(prefix + e.what());
  } catch (const IOError& e) {
    throw IOError(prefix + e.what());
  } catch (const OutOfMemoryError& e) {
    throw OutOfMemoryError(prefix + e.what());
  } catch (const Error& e) {
    throw Error(prefix + e.what());
  }
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

const Shape& SymbolicTensor::shape() const {
  if (!node_) throw ValueError("SymbolicTensor::shape: the symbolic tensor is undefined");
  return node_->shape;
}
DType SymbolicTensor::dtype() const {
  if (!node_) throw ValueError("SymbolicTensor::dtype: the symbolic tensor is undefined");
  return node_->dtype;
}
const std::shared_ptr<Layer>& SymbolicTensor::layer() const {
  if (!node_) throw ValueError("SymbolicTensor::layer: the symbolic tensor is undefined");
  return node_->layer;
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
    for (const auto& l : owner.sublayers_)
      if (l.get() == layer) return true;
    return false;
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

void throw_null_layer() { throw ValueError("LayerPtr: called through an empty layer pointer"); }

SymbolicTensor call_symbolic(const std::shared_ptr<Layer>& layer, const SymbolicTensor& x) {
  if (!x.defined())
    throw ValueError(fmt::format("layer '{}' ({}): called on an undefined symbolic tensor",
                                 layer->name(), layer->class_name()));
  // A concrete batch of one stands in for the batch axis.
  std::vector<std::int64_t> dims = x.shape().dims();
  const bool batched = !dims.empty() && dims[0] == -1;
  if (batched) dims[0] = 1;
  Tensor probe = zeros(Shape(dims), x.dtype(), layer->built() ? layer->device() : Device::cpu());
  Tensor y;
  {
    NoGradGuard no_grad;
    mixtape::detail::DTypeTraceMute mute;
    y = (*layer)(probe, CallContext{.training = false});
  }
  std::vector<std::int64_t> out = y.shape().dims();
  if (batched && !out.empty()) out[0] = -1;
  auto node = std::make_shared<SymbolicNode>();
  node->layer = layer;
  node->input = x.node();
  node->shape = Shape(out);
  node->dtype = y.dtype();
  return SymbolicTensor(node);
}

}  // namespace detail

// --- Layer ------------------------------------------------------------------------------

Layer::Layer(LayerOptions options) : Layer(std::move(options), std::string()) {}

Layer::Layer(LayerOptions options, std::string class_name)
    : name_(std::move(options.name)),
      given_class_name_(std::move(class_name)),
      policy_(options.dtype ? *options.dtype : global_policy()),
      trainable_(options.trainable) {
  // Built-in layers know their class here; a user's layer is named on first use of
  // name(), when its dynamic type is known.
  if (name_.empty() && !given_class_name_.empty())
    name_ = unique_name(snake_case(given_class_name_));
}

Layer::~Layer() = default;

const std::string& Layer::name() const {
  if (name_.empty()) name_ = unique_name(snake_case(class_name()));
  return name_;
}

std::string Layer::class_name() const {
  return given_class_name_.empty() ? demangled_class_name(typeid(*this)) : given_class_name_;
}

DType Layer::computation_dtype() const {
  const DType c = compute_dtype();
  return c.is_reduced_float() ? kFloat32 : c;
}

void Layer::build(const Shape&) {}

Tensor Layer::operator()(const Tensor& input, const CallContext& ctx) {
  if (!input.defined())
    throw ValueError(
        fmt::format("layer '{}' ({}): called on an undefined tensor", name(), class_name()));
  try {
    check_tracked_by_caller();
    auto& calls = detail::Tracking::calls();
    calls.push_back(this);
    const detail::PopGuard<const Layer*> pop_call{calls};
    Tensor x = input;
    if (autocast_inputs() && x.dtype().is_floating() && compute_dtype().is_floating() &&
        x.dtype() != compute_dtype())
      x = cast(x, compute_dtype());
    if (!built_) {
      if (!device_set_) device_ = x.device();
      device_set_ = true;
      const std::size_t sublayers_before = sublayers_.size();
      try {
        // Layers made inside build() become sublayers (detail::Tracking).
        auto& frames = detail::Tracking::frames();
        frames.push_back(detail::Tracking::Frame{this, nullptr});
        const detail::PopGuard<detail::Tracking::Frame> pop_frame{frames};
        build(x.shape());
        // A spec set before the build (an Input's) can refuse the first input: the layer
        // then stays unbuilt.
        check_input(x);
      } catch (...) {
        weights_.clear();
        sublayers_.erase(sublayers_.begin() + static_cast<std::ptrdiff_t>(sublayers_before),
                         sublayers_.end());
        throw;
      }
      built_ = true;
      built_shape_ = x.shape();
    } else {
      check_input(x);
    }
    Tensor y;
    {
      std::optional<DType> cast_to;
      if (compute_dtype().is_floating()) cast_to = compute_dtype();
      AutocastScope autocast_scope(cast_to);
      y = call(x, ctx);
    }
    if (!y.defined()) throw ValueError("call() returned an undefined tensor");
    std::vector<std::int64_t> dims = y.shape().dims();
    if (!dims.empty() && input.rank() > 0) dims[0] = -1;
    output_shape_ = Shape(dims);
    if (sublayers_.empty() && mixtape::detail::dtype_trace_active()) {
      DTypeTraceRow row{name(),       class_name(), policy_.name(),      input.dtype(), x.dtype(),
                        std::nullopt, std::nullopt, computation_dtype(), y.dtype()};
      for (const auto& w : weights_) {
        if (!w.variable.dtype().is_floating()) continue;
        row.weight = w.variable.dtype();
        row.weight_read =
            w.variable.autocast() && compute_dtype().is_floating() ? compute_dtype() : *row.weight;
        break;
      }
      mixtape::detail::dtype_trace_record(row);
    }
    return y;
  } catch (const Error& e) {
    // Errors of inner layers carry their own name; ours goes in front (a path).
    const std::string prefix = fmt::format("layer '{}' ({}): ", name(), class_name());
    if (starts_with(e.what(), prefix)) throw;
    rethrow_with_prefix(prefix);
  }
}

void Layer::check_input(const Tensor& x) const {
  if (!input_spec_) return;
  const InputSpec& spec = *input_spec_;
  const auto rank = static_cast<int>(x.rank());
  // What is expected, "(shape [None, 28, 28])" or "(shape [..., 784]; built for inputs of
  // shape [2, 784])": the spec's shape, and the shape of the first input when there was one.
  const auto expected = [&] {
    const std::string shape = spec_shape_text(spec);
    std::vector<std::string> parts;
    if (!shape.empty()) parts.push_back("shape " + shape);
    if (built_shape_) parts.push_back("built for inputs of shape " + built_shape_->str());
    return parts.empty() ? std::string() : fmt::format(" ({})", fmt::join(parts, "; "));
  };
  if (spec.rank >= 0 && rank != spec.rank)
    throw ShapeError(
        fmt::format("expected an input of rank {}{}; got {}", spec.rank, expected(), describe(x)));
  if (spec.min_rank >= 0 && rank < spec.min_rank)
    throw ShapeError(fmt::format("expected an input of rank >= {}{}; got {}", spec.min_rank,
                                 expected(), describe(x)));
  for (const auto& [axis, extent] : spec.axes) {
    const int a = axis < 0 ? axis + rank : axis;
    if (a < 0 || a >= rank || x.shape()[static_cast<std::size_t>(a)] != extent)
      throw ShapeError(fmt::format("expected axis {} of the input to be {}{}; got {}", axis, extent,
                                   expected(), describe(x)));
  }
}

Variable Layer::add_weight(const std::string& name, const Shape& shape,
                           const init::Initializer& init, WeightOptions options) {
  const DType dtype = options.dtype ? *options.dtype : variable_dtype();
  Tensor value;
  try {
    value = init(shape, dtype, device_);
  } catch (const Error&) {
    // "add_weight 'kernel': glorot_uniform: out of memory: ...": which weight failed.
    rethrow_with_prefix(fmt::format("add_weight '{}': ", name));
  }
  if (value.shape() != shape || value.dtype() != dtype)
    throw ValueError(fmt::format("add_weight '{}': initializer '{}' gave {}, expected {}{}", name,
                                 init.name(), describe(value), dtype, shape));
  Variable v(value, fmt::format("{}/{}", this->name(), name), options.trainable && trainable_);
  v.set_autocast(options.autocast && dtype.is_floating());
  weights_.push_back(Weight{v, options.trainable});
  return v;
}

void Layer::track(std::shared_ptr<Layer> layer) {
  if (!layer) throw ValueError(fmt::format("layer '{}': cannot track an empty layer", name()));
  if (layer.get() == this)
    throw ValueError(fmt::format("layer '{}' ({}): cannot track itself", name(), class_name()));
  for (const auto& l : sublayers_)
    if (l == layer) return;
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

}  // namespace mixtape::layers
