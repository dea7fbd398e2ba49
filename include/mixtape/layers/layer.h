// Layer: the base of every layer and model, Keras style.
//
// A layer has a name (unique defaults: dense, dense_1, ...; a sublayer's default is unique
// within the layer that holds it), a dtype policy (the global policy when it is made, or its
// `dtype` option), a trainable flag and weights. It is
// built lazily on its first call, from the input's shape. Calling it:
//   1. casts a floating input to the compute dtype (integer inputs are never cast);
//   2. builds it on the first call (build() creates the weights with add_weight(), stored
//      in the variable dtype) and checks the input against what it was built for;
//   3. runs call() inside an AutocastScope, so the weights are read in the compute dtype
//      (float32 variables are read as float16 under mixed_float16);
// and the output has the compute dtype. Errors from inside a layer are re-thrown with the
// layer's name in front.
//
// Layers live behind shared pointers (LayerPtr) so that models can hold them:
//   auto dense = mt::layers::Dense(64, {.activation = "relu"});   // LayerPtr<DenseLayer>
//   mt::Tensor y = dense(x);                                       // called like a function
//   dense->kernel();                                               // members through ->
// A user's own layer derives from Layer and is made with make_layer<MyLayer>(...).
//
// A layer of several inputs (a merge layer: Add()({a, b})) or outputs overrides call_multi()
// instead of call(); apply() returns every output. On SymbolicTensors (Input() and what
// layers make of it) a call records a node of a graph for a functional Model
// (mixtape/layers/model.h), its output shape from compute_output_shape().
#pragma once

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mixtape/autograd/variable.h"
#include "mixtape/core/tensor.h"
#include "mixtape/layers/config.h"
#include "mixtape/layers/initializers.h"
#include "mixtape/precision/policy.h"

namespace mixtape {

// What a call knows besides its input.
struct CallContext {
  bool training = false;  // Dropout drops and BatchNormalization uses batch statistics
};

}  // namespace mixtape

namespace mixtape::layers {

class Layer;
namespace detail {
struct Tracking;
}

// The three fields every layer's options end with, written once: dtype (empty: the global
// policy at construction), name (empty: a unique default from the class name) and
// trainable. Each layer's options struct lists its own fields and ends with this line, so
// that one brace names them all, in declaration order: Dense(64, {.activation = "relu",
// .name = "head"}). (A LayerOptions member instead would turn that into {.activation =
// "relu", .layer = {.name = "head"}}, and a base class would rule out designated
// initializers altogether.)
#define MIXTAPE_LAYER_OPTIONS_TAIL             \
  std::optional<::mixtape::Policy> dtype = {}; \
  std::string name = {};                       \
  bool trainable = true

// The options every layer takes: those three alone.
struct LayerOptions {
  MIXTAPE_LAYER_OPTIONS_TAIL;
};

// What a built layer accepts; checked before every call.
struct InputSpec {
  int rank = -1;      // exact rank, or -1
  int min_rank = -1;  // minimum rank, or -1
  // Required extents: (axis, extent), negative axes counting from the end.
  std::vector<std::pair<int, std::int64_t>> axes = {};
};

// Options of add_weight().
struct WeightOptions {
  bool trainable = true;
  std::optional<DType> dtype = {};  // empty: the layer's variable dtype
  bool autocast = true;             // read in the compute dtype inside call()
};

// --- Symbolic tensors: the functional API ----------------------------------------------

// The shape and dtype of a tensor of a functional graph (-1 on the batch axis).
struct TensorSpec {
  Shape shape;
  DType dtype;
};

namespace detail {
struct SymbolicNode;
}

// A weight and its path: the name it has in files ("dense/kernel"; a sublayer's weight under
// its owner's path, "block_1/dense/kernel"). See weight_paths().
struct WeightPath {
  std::string path;
  Variable variable;
  const Layer* layer = nullptr;  // the layer that made it
  bool in_sublayer = false;      // made by a sublayer of a layer (not of a model)
};

// A placeholder for the tensors of a functional model: the output of Input() or one output
// of a layer called on other SymbolicTensors. Its shape has -1 on the batch axis.
class SymbolicTensor {
 public:
  SymbolicTensor() = default;
  // Output `index` of `node`.
  static SymbolicTensor output_of(std::shared_ptr<detail::SymbolicNode> node, int index);

  bool defined() const { return node_ != nullptr; }
  const Shape& shape() const;
  DType dtype() const;
  // The layer that produced it (an InputLayer for Input()).
  const std::shared_ptr<Layer>& layer() const;
  const std::shared_ptr<detail::SymbolicNode>& node() const { return node_; }
  // Which output of that layer's call it is (0 but for layers with several outputs).
  int index() const { return index_; }
  // The layer's name ("dense_1"), with the output's index for a layer of several outputs
  // ("split[1]"): how error messages name it.
  std::string name() const;

 private:
  std::shared_ptr<detail::SymbolicNode> node_;
  int index_ = 0;
};

namespace detail {
// One call of a layer in a functional graph: its inputs and the specs of its outputs.
struct SymbolicNode {
  std::shared_ptr<Layer> layer;
  std::vector<SymbolicTensor> inputs;  // empty for an Input()
  std::vector<TensorSpec> outputs;
};
// Calls `layer` on symbolic tensors: the output specs come from the layer's
// compute_output_spec() and the layer is built from the input shapes; a layer without a shape
// rule (compute_output_spec returns nothing) is built and run once on a batch of one instead
// (no tape, inference mode).
std::vector<SymbolicTensor> call_symbolic(const std::shared_ptr<Layer>& layer,
                                          const std::vector<SymbolicTensor>& inputs);
// The same on specs: builds `layer` for inputs of `inputs` and returns its output specs.
std::vector<TensorSpec> build_for_specs(const std::shared_ptr<Layer>& layer,
                                        const std::vector<TensorSpec>& inputs);
}  // namespace detail

// --- Layer ------------------------------------------------------------------------------

class Layer : public std::enable_shared_from_this<Layer> {
 public:
  explicit Layer(LayerOptions options = {});
  virtual ~Layer();
  Layer(const Layer&) = delete;
  Layer& operator=(const Layer&) = delete;

  // Casts, builds, checks and calls (see the top of this file): one input, one output.
  Tensor operator()(const Tensor& x, const CallContext& ctx = {});
  // Several inputs, one output: Add()({a, b}).
  Tensor operator()(const std::vector<Tensor>& inputs, const CallContext& ctx = {});
  // Any number of inputs; every output.
  std::vector<Tensor> apply(const std::vector<Tensor>& inputs, const CallContext& ctx = {});

  // The same on symbolic tensors (the functional API): the layer is built from their shapes
  // and the call is recorded as a node of a graph. The layer must be held by a shared_ptr
  // (layers made by make_layer and the factories are).
  SymbolicTensor operator()(const SymbolicTensor& x);
  SymbolicTensor operator()(const std::vector<SymbolicTensor>& inputs);
  std::vector<SymbolicTensor> apply(const std::vector<SymbolicTensor>& inputs);

  // Creates the weights for inputs of `input_shape` (batch axis included; -1 when the
  // layer is built from a symbolic tensor). Called once, before the first call().
  virtual void build(const Shape& input_shape);
  // The same for a layer of several inputs; by default build(input_shapes[0]) for one
  // input and nothing for several.
  virtual void build_multi(const std::vector<Shape>& input_shapes);
  // The computation, on an input already cast to the compute dtype. A layer of one input
  // and one output overrides this one.
  virtual Tensor call(const Tensor& x, const CallContext& ctx);
  // A layer of several inputs or outputs overrides this one instead; by default it calls
  // call() on the only input.
  virtual std::vector<Tensor> call_multi(const std::vector<Tensor>& inputs, const CallContext& ctx);

  // The output shape for an input of `input_shape` (batch axis -1 or any), without running
  // the layer; std::nullopt when the layer cannot say (the default), in which case a
  // symbolic call runs it once on a batch of one. Throws ShapeError for an input the layer
  // cannot take.
  virtual std::optional<Shape> compute_output_shape(const Shape& input_shape) const;
  // The specs of the outputs for inputs of `inputs`; by default, for one floating input,
  // compute_output_shape() in the compute dtype, and std::nullopt otherwise.
  virtual std::optional<std::vector<TensorSpec>> compute_output_spec(
      const std::vector<TensorSpec>& inputs) const;

  // The layer's name: the `name` option, or a default from the class name. A default is unique
  // within the layer that holds it ("dense", "dense_1" inside each block) when the layer is
  // tracked (see track()) before it is built; otherwise it is unique in the process.
  const std::string& name() const;
  // Whether the name was given (the `name` option, or a config), not made up.
  bool has_given_name() const { return name_given_; }
  // "Dense", "Conv2D", ...; by default the C++ class name.
  virtual std::string class_name() const;
  // The arguments that make this layer again (mixtape/layers/config.h): "name",
  // "trainable" and "dtype", and for a built-in class its positional arguments and options
  // (derived from its row in the layer table, layers/layer_table.cpp). A class of your own
  // overrides this, calling the base's, and adds its own.
  virtual Config get_config() const;

  const Policy& dtype_policy() const { return policy_; }
  DType compute_dtype() const { return policy_.compute_dtype(); }
  DType variable_dtype() const { return policy_.variable_dtype(); }
  // The dtype the layer's arithmetic runs in (the cheat sheet's "computation" column):
  // float32 for float16/bfloat16 elementwise math; layers built on matmul/conv2d report
  // the GEMM accumulation dtype (the MIXTAPE_FP16_USE_FP32_COMPUTE switch).
  virtual DType computation_dtype() const;
  // A note for this call's row of the dtype trace (mixtape/layers/trace.h): how the layer
  // computed, when it has a choice (MultiHeadAttention: the fused op or the composed one, and
  // why; under mixed_float8, whether the matrix products ran in FP8). By default the
  // latest policy_matmul's note (empty when the layer made none).
  virtual std::string trace_note() const { return matmul_note_; }

  bool trainable() const { return trainable_; }
  // Freezes or unfreezes every weight of the layer and its sublayers.
  void set_trainable(bool trainable);
  bool built() const { return built_; }
  Device device() const { return device_; }
  // Moves every weight (and those of the sublayers) to `device`.
  virtual void to(Device device);

  // Weights in creation order, this layer's first, then each sublayer's.
  std::vector<Variable> weights() const;
  std::vector<Variable> trainable_variables() const;
  std::vector<Variable> non_trainable_variables() const;
  std::int64_t count_params() const;
  // Copies of the weights, and setting them back (count, shapes and dtypes must match).
  std::vector<Tensor> get_weights() const;
  void set_weights(const std::vector<Tensor>& values);

  // The dtype a model casts integer and boolean inputs (uint8 images, say) to when this
  // layer is the first to receive them, as Keras casts a model's inputs to its Input's
  // dtype: float32 by default; an Input's declared dtype; none for an Embedding (its ids
  // are taken as they are); a model's first layer's. A layer of your own that takes
  // integers as they are returns std::nullopt.
  virtual std::optional<DType> integer_input_dtype() const { return kFloat32; }

  // The sublayers (a model's layers), in order.
  const std::vector<std::shared_ptr<Layer>>& sublayers() const { return sublayers_; }
  // The output shape of the latest call, with -1 on the batch axis (empty before); the
  // first output's for a layer of several outputs.
  const std::optional<Shape>& output_shape() const { return output_shape_; }

 protected:
  // x [..., k] times a weight w [k, n] as the layer's policy multiplies: under
  // mixed_float8 in FP8 (float8_linear, out in the compute dtype) on the CPU (emulated) and
  // on GPUs of compute capability 8.9 or newer, when the product's dimensions are multiples
  // of 16 (what FP8 GEMMs take; other shapes stay in bfloat16 everywhere); an older GPU
  // takes the bfloat16 matmul, with a warning once per process; otherwise matmul(x, w).
  // policy_linear (below) multiplies through it where it does not fuse; the dtype trace's note
  // says which path ran.
  //
  // Under delayed scaling (mixed_float8_delayed, Float8Scaling) the product takes `state`,
  // the amax histories add_float8_state made in build(); a training call (`training`) rolls
  // this step's amaxes into them, other calls only read them. Without a state it scales as
  // the current policy does.
  struct Float8State {
    Variable input, weight, grad;
  };
  Tensor policy_matmul(const Tensor& x, const Tensor& w,
                       const std::optional<Float8State>& state = std::nullopt,
                       bool training = false) const;
  // activation(x w + bias) as the layer's policy computes it (bias may be undefined;
  // activation is a name of mixtape/layers/activations.h): with an activation mt::linear
  // applies (linear, relu, gelu, gelu_tanh) and a bias or an activation, the fused op
  // (product, bias and activation, rounded once); under mixed_float8 the FP8 product with the
  // bias and that activation in its epilogue (float8_linear), where it runs in FP8; where
  // MIXTAPE_FP16_USE_FP32_COMPUTE=0 makes 16-bit products accumulate in 16 bits (which only
  // matmul emulates), for the other activations and for products that stay in bfloat16,
  // policy_matmul, then the bias and the activation as ops of their own. Dense and
  // MultiHeadAttention's projections compute through it; the dtype trace's note says when the fused
  // op ran or why it could not.
  Tensor policy_linear(const Tensor& x, const Tensor& w, const Tensor& bias,
                       const std::string& activation,
                       const std::optional<Float8State>& state = std::nullopt,
                       bool training = false) const;
  // policy_matmul's body. Given `fused` (bias and activation then linear()'s kinds), an FP8
  // product takes the bias and the activation in its epilogue and sets *fused; any other
  // product leaves *fused false and both to the caller.
  Tensor policy_product(const Tensor& x, const Tensor& w, const Tensor& bias,
                        const std::string& activation, const std::optional<Float8State>& state,
                        bool training, bool* fused) const;
  // Under delayed scaling: three non-trainable float32 weights of Float8Scaling::history
  // zeros, "<prefix>input_amax_history", "<prefix>kernel_amax_history" and
  // "<prefix>grad_amax_history" (read in float32, saved with the other weights); under any
  // other policy nothing (std::nullopt).
  std::optional<Float8State> add_float8_state(const std::string& prefix = "");

  // Creates a weight named "<layer>/<name>" in the variable dtype (or options.dtype),
  // initialised by `init`, on the layer's device; a sublayer's weight is named under its
  // owner's name too ("block/dense/kernel").
  Variable add_weight(const std::string& name, const Shape& shape, const init::Initializer& init,
                      WeightOptions options = {});
  void set_input_spec(InputSpec spec) { input_spec_ = std::move(spec); }
  // Adds a sublayer whose weights become part of this layer's. Layers made with
  // make_layer (or a built-in factory such as Dense()) while this layer is being made by
  // make_layer, or inside its build(), are tracked automatically; track() is for the others
  // (a layer made elsewhere and passed in, a std::make_shared one). A layer called inside
  // another's call() must be tracked by it or by a layer calling it: otherwise the call
  // throws ValueError (its weights would silently never train).
  // The first layer to track a layer owns it: the layer's weights are named under the
  // owner's name, and a default name, when the layer is not built yet, becomes unique within
  // the owner ("dense", "dense_1"), whatever else the process has made.
  void track(std::shared_ptr<Layer> layer);
  // Whether this layer's sublayers take their paths (and default names) under its name; a
  // model's layers are named in its graph instead (Model returns false).
  virtual bool scopes_sublayers() const { return true; }
  // Whether floating inputs are cast to the compute dtype before call() (models: no).
  virtual bool autocast_inputs() const { return true; }
  // Whether call_multi() checks the number of inputs itself (a functional model, naming its
  // inputs); otherwise a call with another number than at build is refused here.
  virtual bool checks_input_count() const { return false; }
  // Only the layers of mixtape set these.
  Layer(LayerOptions options, std::string class_name);

 private:
  struct Weight {
    Variable variable;
    bool declared_trainable;
    std::string name;  // as given to add_weight ("kernel")
  };
  // The layer's name with those of its owners in front ("block/dense").
  std::string owned_name() const;
  void check_input(const Shape& shape, DType dtype) const;
  void check_inputs(const std::vector<Shape>& shapes, const std::vector<DType>& dtypes) const;
  // Builds (once) for inputs of `shapes` on `device`, then checks them.
  void build_and_check(const std::vector<Shape>& shapes, const std::vector<DType>& dtypes,
                       Device device);
  // For a symbolic call with a shape rule: builds from the specs (nothing runs).
  void build_symbolic(const std::vector<TensorSpec>& inputs);
  friend std::vector<TensorSpec> detail::build_for_specs(const std::shared_ptr<Layer>&,
                                                         const std::vector<TensorSpec>&);
  void check_tracked_by_caller() const;
  void apply_trainable();
  friend struct detail::Tracking;

  mutable std::string name_;
  bool name_given_ = false;
  bool name_scoped_ = false;      // a default made unique within owner_
  const Layer* owner_ = nullptr;  // the first layer to track this one (models are none)
  std::string given_class_name_;
  Policy policy_;
  mutable std::string matmul_note_;  // how the latest policy_matmul computed (trace_note)
  bool trainable_ = true;
  bool built_ = false;
  Device device_;
  bool device_set_ = false;
  std::vector<Weight> weights_;
  std::vector<std::shared_ptr<Layer>> sublayers_;
  std::unordered_set<const Layer*> sublayer_set_;  // the same, for lookups in O(1)
  std::optional<InputSpec> input_spec_;
  std::vector<Shape> built_shapes_;  // the input shapes at build
  std::optional<Shape> output_shape_;
};

// A shared pointer to a layer that can be called like the layer itself, on tensors and on
// symbolic tensors. Converts to LayerPtr<Base> for any base class.
template <typename T>
class LayerPtr : public std::shared_ptr<T> {
 public:
  LayerPtr() = default;
  LayerPtr(std::shared_ptr<T> p) : std::shared_ptr<T>(std::move(p)) {}  // NOLINT
  template <typename U>
  requires std::derived_from<U, T> LayerPtr(LayerPtr<U> other)
      : std::shared_ptr<T>(std::move(other)) {}  // NOLINT

  // The layer's own operator(), so that a model's (which returns a vector for a vector of
  // inputs) is the one called through a LayerPtr<Model>.
  auto operator()(const Tensor& x, const CallContext& ctx = {}) const {
    return (*checked())(x, ctx);
  }
  auto operator()(const std::vector<Tensor>& inputs, const CallContext& ctx = {}) const {
    return (*checked())(inputs, ctx);
  }
  auto operator()(const SymbolicTensor& x) const { return (*checked())(x); }
  auto operator()(const std::vector<SymbolicTensor>& inputs) const { return (*checked())(inputs); }

 private:
  T* checked() const;
};

namespace detail {
// Automatic tracking of sublayers: one frame lives across each construction by
// make_layer. The layers made inside it (by make_layer, in the constructor) are handed to
// made(), which makes the new layer track them and hands it, in turn, to the enclosing frame:
// the layer under construction or in build() on this thread, if any.
class ConstructionFrame {
 public:
  ConstructionFrame();
  ~ConstructionFrame();  // also when the constructor threw: nothing is tracked then
  ConstructionFrame(const ConstructionFrame&) = delete;
  ConstructionFrame& operator=(const ConstructionFrame&) = delete;
  void made(const std::shared_ptr<Layer>& layer);

 private:
  std::vector<std::shared_ptr<Layer>> children_;
  bool open_ = true;
};
}  // namespace detail

// Makes a layer of a user's class: make_layer<Scale>(), make_layer<Scale>({.name = "s"})
// (for a class constructible from LayerOptions), or make_layer<Scale>(args...) with the
// arguments of any of its constructors. Layers made with make_layer inside the constructor
// become the new layer's sublayers (see Layer::track).
template <typename T, typename... Args>
LayerPtr<T> make_layer(Args&&... args) {
  detail::ConstructionFrame frame;
  auto layer = std::make_shared<T>(std::forward<Args>(args)...);
  frame.made(layer);
  return LayerPtr<T>(std::move(layer));
}
// The braced form, make_layer<T>({.name = ..., .dtype = ...}): a braced list has no type to
// deduce Args from, so this overload names it.
template <typename T>
requires std::constructible_from<T, LayerOptions> LayerPtr<T> make_layer(LayerOptions options) {
  detail::ConstructionFrame frame;
  auto layer = std::make_shared<T>(std::move(options));
  frame.made(layer);
  return LayerPtr<T>(std::move(layer));
}

namespace detail {
[[noreturn]] void throw_null_layer();
// "[None, 28, 28]" for a shape with -1 on the batch axis, "[2, 28, 28]" for a concrete one.
std::string shape_with_none(const Shape& shape);
// "base" the first time, then "base_1", "base_2", ... (the default layer names).
std::string unique_layer_name(const std::string& base);
// Whether a sublayer of `layer`, or one further down, is not built yet.
bool has_unbuilt_sublayer(const Layer& layer);
}  // namespace detail
template <typename T>
T* LayerPtr<T>::checked() const {
  if (!*this) detail::throw_null_layer();
  return this->get();
}

namespace detail {
// While one lives on a thread, the weights that layers create there may take at most `bytes`
// in all: add_weight throws ValueError, before it allocates, for a weight beyond that. A load
// of a model file sets it to what the file holds, so that an architecture that declares
// more (a Dense of 2^26 units in an 8 KB file) fails before it allocates gigabytes.
class WeightBudget {
 public:
  explicit WeightBudget(std::uint64_t bytes, std::string source);
  ~WeightBudget();
  WeightBudget(const WeightBudget&) = delete;
  WeightBudget& operator=(const WeightBudget&) = delete;
  // Takes a weight of `shape` and `dtype` from the budget, or throws naming `what`.
  static void take(const Shape& shape, DType dtype, const std::string& what);

 private:
  std::uint64_t left_;
  std::string source_;
  WeightBudget* outer_;
};
}  // namespace detail

// Resets the counters behind default layer names (the next Dense is "dense" again).
void reset_default_names();

// Every weight of `root` with its path, in the order of root.weights(): a layer's weights are
// "<layer>/<weight>", a sublayer's are under its owner's path ("block_1/dense/kernel"), and a
// model adds nothing to its layers' paths (their names are unique in its graph). These are the
// names of weights in files (save_weights, Model::save, checkpoints): they do not depend on
// the order in which layers were made or called. Throws ValueError when two weights would
// have one path (naming both layers), or when a layer with weights inside a layer has a default
// name that is unique only in the process (built before its owner tracked it): another process
// would not give it the same name.
std::vector<WeightPath> weight_paths(const Layer& root);

}  // namespace mixtape::layers
