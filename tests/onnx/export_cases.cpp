// Writes ONNX export cases for tests/onnx/check_exports.py: per case NAME, the exported
// NAME.onnx, random inputs NAME.in<i>.npy, mixtape's predictions for them NAME.out<k>.npy
// (float32) and NAME.json (the file names, the tolerance of the model's compute dtype,
// whether OpenCV's DNN module should run it).
//
//   mixtape-onnx-cases layers DIR
//       models made here that use every built-in layer, under float32, mixed_float16 and
//       mixed_bfloat16, and a mixed model exported with OnnxExportOptions::float32;
//   mixtape-onnx-cases model FILE NAME DIR [--opencv]
//       the model of a whole-model file (Model::save, the apps' --save); DIR/NAME.onnx is
//       the app's own export (--export-onnx), which this compares against the loaded model.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace fs = std::filesystem;

namespace {

// A NumPy .npy file (format 1.0) of a float32, float16 or int64 tensor, or of a bool one.
void write_npy(const fs::path& path, const mt::Tensor& tensor) {
  mt::Tensor t = tensor.to(mt::Device::cpu()).contiguous();
  std::string descr;
  switch (t.dtype().code()) {
    case mt::DType::Float32:
      descr = "<f4";
      break;
    case mt::DType::Float16:
      descr = "<f2";
      break;
    case mt::DType::Int64:
      descr = "<i8";
      break;
    case mt::DType::Bool:
      descr = "|b1";
      break;
    default:
      t = t.to(mt::kFloat32);
      descr = "<f4";
  }
  std::string shape;
  for (std::int64_t d : t.shape()) shape += fmt::format("{}, ", d);
  if (t.rank() > 1) shape.resize(shape.size() - 2);
  std::string header =
      fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}", descr, shape);
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  out.write("\x93NUMPY\x01\x00", 8);
  const char len[2] = {static_cast<char>(header.size() & 0xff),
                       static_cast<char>(header.size() >> 8)};
  out.write(len, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!out) throw mt::IOError(fmt::format("cannot write '{}'", path.string()));
}

// The tolerance of a model computing in `dtype`: float32 rounding (sums in another order),
// or a few units in the last place of the 16-bit format through the model.
std::pair<double, double> tolerance(mt::DType dtype) {
  if (dtype == mt::kFloat16) return {1e-2, 1e-2};
  if (dtype == mt::kBFloat16) return {5e-2, 5e-2};
  return {1e-4, 1e-4};
}

// Random inputs for the model's input specs: floats in [-1, 1), ids below `vocab`, masks
// true with probability 3/4 (some rows entirely false).
mt::Tensor random_input(const ml::TensorSpec& spec, std::int64_t batch, std::int64_t vocab,
                        mt::Generator& gen) {
  std::vector<std::int64_t> dims = spec.shape.dims();
  dims[0] = batch;
  const mt::Shape shape(dims);
  if (spec.dtype.is_floating())
    return mt::uniform(shape, -1.0, 1.0, spec.dtype, mt::Device::cpu(), &gen);
  const mt::Tensor u = mt::uniform(shape, 0.0, 1.0, mt::kFloat64, mt::Device::cpu(), &gen);
  const auto* p = u.data<double>();
  if (spec.dtype == mt::kBool) {
    std::vector<bool> mask(static_cast<std::size_t>(u.numel()));
    for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = p[i] < 0.75;
    return mt::from_vector(mask, shape);
  }
  std::vector<std::int64_t> ids(static_cast<std::size_t>(u.numel()));
  for (std::size_t i = 0; i < ids.size(); ++i)
    ids[i] = static_cast<std::int64_t>(p[i] * static_cast<double>(vocab));
  return mt::from_vector(ids, shape).to(spec.dtype);
}

// Exports `model` to DIR/NAME.onnx (unless it is there already: an app's export), predicts
// on random inputs and writes the case files.
void write_case(mt::Model& model, const std::string& name, const fs::path& dir,
                std::vector<ml::TensorSpec> inputs, mt::DType compute, bool opencv,
                const mt::OnnxExportOptions& options = {}, std::int64_t vocab = 8,
                bool export_here = true) {
  if (export_here) mt::export_onnx(model, (dir / (name + ".onnx")).string(), options);
  mt::Generator gen(1234);
  std::vector<mt::Tensor> x;
  for (const auto& spec : inputs) x.push_back(random_input(spec, 5, vocab, gen));
  std::vector<mt::Tensor> y;
  {
    mt::NoGradGuard no_grad;
    y = x.size() == 1 && model.outputs().size() <= 1 ? std::vector<mt::Tensor>{model(x.front())}
                                                     : model(x);
  }
  std::string ins, outs;
  for (std::size_t i = 0; i < x.size(); ++i) {
    const std::string file = fmt::format("{}.in{}.npy", name, i);
    write_npy(dir / file, x[i]);
    ins += fmt::format("{}\"{}\"", i ? ", " : "", file);
  }
  for (std::size_t k = 0; k < y.size(); ++k) {
    const std::string file = fmt::format("{}.out{}.npy", name, k);
    write_npy(dir / file, y[k].to(mt::kFloat32));
    outs += fmt::format("{}\"{}\"", k ? ", " : "", file);
  }
  const auto [rtol, atol] = tolerance(compute);
  std::ofstream(dir / (name + ".json"))
      << fmt::format(R"({{"inputs": [{}], "outputs": [{}], "rtol": {}, "atol": {}, "opencv": {}}})",
                     ins, outs, rtol, atol, opencv ? "true" : "false")
      << '\n';
  fmt::print("{}: {} input(s), {} output(s), compute dtype {}\n", name, x.size(), y.size(),
             compute.name());
}

// Every weight drawn at random (variances positive), so that no layer's export hides behind
// zeros and ones.
void randomize(mt::Model& model, std::uint64_t seed) {
  mt::Generator gen(seed);
  for (const auto& w : ml::weight_paths(model)) {
    const bool variance = w.path.find("moving_variance") != std::string::npos;
    mt::Tensor v = variance ? mt::uniform(w.variable.shape(), 0.5, 1.5, w.variable.dtype(),
                                          mt::Device::cpu(), &gen)
                            : mt::uniform(w.variable.shape(), -0.5, 0.5, w.variable.dtype(),
                                          mt::Device::cpu(), &gen);
    mt::Variable(w.variable).assign(v);
  }
}

std::vector<ml::TensorSpec> specs_of(const mt::Model& model) {
  std::vector<ml::TensorSpec> s;
  for (const auto& in : model.inputs()) s.push_back({in.shape(), in.dtype()});
  return s;
}

// Dense, the activations, Dropout; two outputs.
std::shared_ptr<mt::Model> dense_model() {
  auto x = ml::Input({12}, {.name = "features"});
  auto h = ml::Dense(16, {.activation = "relu"})(x);
  h = ml::Dense(16, {.activation = "gelu"})(h);
  h = ml::Dense(16, {.activation = "gelu_tanh", .use_bias = false})(h);
  h = ml::Activation("sigmoid")(h);
  h = ml::Dropout(0.3)(h);
  h = ml::Dense(8, {.activation = "tanh"})(h);
  auto probabilities = ml::Activation("softmax", {.dtype = "float32", .name = "probabilities"})(h);
  auto log_probabilities =
      ml::Dense(4, {.activation = "log_softmax", .dtype = "float32", .name = "log_probs"})(h);
  return std::make_shared<mt::Model>(
      std::vector<ml::SymbolicTensor>{x},
      std::vector<ml::SymbolicTensor>{probabilities, log_probabilities});
}

// The merge layers, Dot of rank 2 and 3, Concatenate, Slice, Reshape.
std::shared_ptr<mt::Model> merge_model() {
  auto a = ml::Input({6}, {.name = "a"});
  auto b = ml::Input({6}, {.name = "b"});
  auto c = ml::Input({6}, {.name = "c"});
  std::vector<ml::SymbolicTensor> parts{ml::Add()({a, b}),
                                        ml::Subtract()({a, b}),
                                        ml::Multiply()({a, b, c}),
                                        ml::Average()({a, b, c}),
                                        ml::Maximum()({a, b}),
                                        ml::Minimum()({a, b, c}),
                                        ml::Dot({1}, {.normalize = true})({a, b}),
                                        ml::Dot({1})({b, c})};
  auto joined = ml::Concatenate()(parts);  // [n, 38]
  auto m = ml::Reshape({2, 3})(a);
  auto n = ml::Reshape({3, 2})(b);
  auto mn = ml::Flatten()(ml::Dot({2, 1})({m, n}));          // [n, 2, 2] -> [n, 4]
  auto nm = ml::Flatten()(ml::Dot({1, 2})({m, n}));          // [n, 3, 3] -> [n, 9]
  auto last = ml::Slice(1, -2, {})(ml::Reshape({3, 2})(c));  // [n, 2, 2]
  auto row = ml::Slice(1, 1, {.stop = 2, .squeeze = true})(ml::Reshape({3, 2})(c));  // [n, 2]
  auto all = ml::Concatenate({.axis = -1})({joined, mn, nm, ml::Flatten()(last), row});
  auto out = ml::Dense(5, {.dtype = "float32", .name = "merged"})(all);
  return std::make_shared<mt::Model>(std::vector<ml::SymbolicTensor>{a, b, c},
                                     std::vector<ml::SymbolicTensor>{out});
}

// The augmentations, Conv2D (valid and same, strides, an activation over the channels), the pools,
// BatchNormalization on the channels and on another axis, global average pooling.
std::shared_ptr<mt::Model> image_model() {
  auto x = ml::Input({11, 10, 3}, {.name = "images"});
  // The augmentations: identities at inference.
  auto a = ml::RandomTranslation(0.1, 0.1)(ml::RandomFlip("horizontal")(x));
  auto h = ml::Conv2D(6, 3, {.strides = 2, .padding = "same", .activation = "relu"})(a);
  h = ml::BatchNormalization()(h);
  h = ml::Conv2D(5, {2, 3}, {.padding = "valid", .use_bias = false})(h);
  h = ml::BatchNormalization({.axis = 1, .center = false})(h);
  h = ml::AveragePooling2D({.pool_size = 3, .strides = 2, .padding = "same"})(h);
  auto branch = ml::Conv2D(4, 1, {.activation = "softmax"})(h);
  auto pooled = ml::GlobalAveragePooling2D()(branch);
  auto maxed = ml::Flatten()(ml::MaxPooling2D({.padding = "same"})(h));
  auto joined = ml::Concatenate()(std::vector<ml::SymbolicTensor>{pooled, maxed});
  auto out = ml::Dense(3, {.dtype = "float32", .name = "logits"})(ml::BatchNormalization()(joined));
  return std::make_shared<mt::Model>(x, out, mt::ModelOptions{.name = "images"});
}

// Embedding, PositionEmbedding, LayerNormalization, MultiHeadAttention (causal; with a mask
// input; value_dim and output_shape of their own).
std::shared_ptr<mt::Model> sequence_model() {
  auto ids = ml::Input({7}, {.dtype = mt::kInt64, .name = "ids"});
  auto mask = ml::Input({7, 7}, {.dtype = mt::kBool, .name = "mask"});
  auto tokens = ml::Embedding(20, 16)(ids);
  auto h = ml::Add()({tokens, ml::PositionEmbedding(9)(tokens)});
  auto a = ml::LayerNormalization()(h);
  a = ml::MultiHeadAttention(2, 8, {.use_causal_mask = true})({a, a});
  h = ml::Add()({h, a});
  auto b = ml::LayerNormalization({.center = false, .scale = false})(h);
  b = ml::MultiHeadAttention(
      4, 3, {.value_dim = 5, .use_bias = false, .output_shape = {2, 8}})({b, h, b, mask});
  auto flat = ml::Reshape({7, 16})(b);
  auto last = ml::Slice(1, -1, {.squeeze = true})(flat);
  auto out = ml::Dense(20, {.dtype = "float32", .name = "next"})(last);
  return std::make_shared<mt::Model>(std::vector<ml::SymbolicTensor>{ids, mask},
                                     std::vector<ml::SymbolicTensor>{out});
}

// A Sequential inside a functional model, and a Sequential exported alone.
std::shared_ptr<mt::Model> nested_model() {
  auto inner = mt::layers::make_layer<mt::Sequential>(
      std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(8, {.activation = "relu"}), ml::Dense(4)},
      mt::ModelOptions{.name = "inner"});
  auto x = ml::Input({5}, {.name = "x"});
  auto h = inner(x);
  auto out = ml::Dense(3, {.dtype = "float32", .name = "out"})(h);
  return std::make_shared<mt::Model>(x, out);
}

// Every layer class this program knows (the built-in ones: it registers none of its own) has an
// ONNX exporter: a new built-in layer without one fails here.
void check_coverage() {
  std::string missing;
  for (const std::string& cls : ml::registered_layers())
    if (!mt::has_onnx_exporter(cls)) missing += (missing.empty() ? "" : ", ") + cls;
  if (!missing.empty())
    throw mt::ValueError("built-in layer classes without an ONNX exporter: " + missing);
  fmt::print("all {} built-in layer classes have an ONNX exporter\n",
             ml::registered_layers().size());
}

void layer_cases(const fs::path& dir) {
  check_coverage();
  struct Made {
    std::string name;
    std::shared_ptr<mt::Model> (*make)();
  };
  const std::vector<Made> models{{"dense", dense_model},
                                 {"merge", merge_model},
                                 {"image", image_model},
                                 {"sequence", sequence_model},
                                 {"nested", nested_model}};
  for (const char* policy : {"float32", "mixed_float16", "mixed_bfloat16"}) {
    mt::PolicyScope scope{mt::Policy(policy)};
    const mt::DType compute = mt::Policy(policy).compute_dtype();
    for (const auto& m : models) {
      std::shared_ptr<mt::Model> model = m.make();
      randomize(*model, 7);
      write_case(*model, fmt::format("{}_{}", m.name, policy), dir, specs_of(*model), compute,
                 false, {}, 20);
      if (std::string(policy) == "mixed_bfloat16" && m.name == "image")
        write_case(*model, "image_mixed_bfloat16_as_float32", dir, specs_of(*model), compute, false,
                   {.float32 = true});
    }
  }
  // The control: an export whose model then changes by a little (one bias, by 0.01) before
  // predicting. check_exports.py must fail it (run_layer_cases.cmake checks that it does),
  // or the comparisons above could not fail either.
  {
    const fs::path control = dir / "control";
    fs::create_directories(control);
    std::shared_ptr<mt::Model> model = dense_model();
    randomize(*model, 7);
    mt::export_onnx(*model, (control / "dense_changed.onnx").string());
    const mt::Variable bias = model->layers().at(1)->weights().at(1);  // the first Dense's
    mt::Variable(bias).assign(bias + 0.01);
    write_case(*model, "dense_changed", control, specs_of(*model), mt::kFloat32, false, {}, 20,
               /*export_here=*/false);
  }
  // A Sequential, built by a call.
  mt::Sequential seq({ml::Flatten(), ml::Dense(6, {.activation = "relu"}), ml::Dense(2)});
  seq.build_for(mt::Shape{-1, 3, 4});
  randomize(seq, 3);
  write_case(seq, "sequential_float32", dir, {{mt::Shape{-1, 3, 4}, mt::kFloat32}}, mt::kFloat32,
             true);
}

// The model of a whole-model file, against the app's export of it at DIR/NAME.onnx.
void model_case(const std::string& file, const std::string& name, const fs::path& dir,
                bool opencv) {
  std::shared_ptr<mt::Model> model = mt::load_model(file);
  std::vector<ml::TensorSpec> inputs = specs_of(*model);
  if (inputs.empty()) inputs = {{*model->build_input_shape(), mt::kFloat32}};
  std::int64_t vocab = 8;
  for (const auto& layer : model->layers())
    if (layer->class_name() == "Embedding") vocab = layer->get_config().get_int("input_dim");
  mt::DType compute = mt::kFloat32;
  for (const auto& layer : model->layers())
    if (layer->compute_dtype().is_reduced_float()) compute = layer->compute_dtype();
  if (!fs::exists(dir / (name + ".onnx")))
    throw mt::ValueError(
        fmt::format("{} is missing: export it first", (dir / (name + ".onnx")).string()));
  write_case(*model, name, dir, inputs, compute, opencv, {}, vocab, /*export_here=*/false);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::vector<std::string> args(argv + 1, argv + argc);
    if (args.size() == 2 && args[0] == "layers") {
      fs::create_directories(args[1]);
      layer_cases(args[1]);
      return 0;
    }
    if ((args.size() == 4 || args.size() == 5) && args[0] == "model") {
      model_case(args[1], args[2], args[3], args.size() == 5 && args[4] == "--opencv");
      return 0;
    }
    std::fprintf(stderr,
                 "usage: mixtape-onnx-cases layers DIR\n"
                 "       mixtape-onnx-cases model FILE NAME DIR [--opencv]\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mixtape-onnx-cases: %s\n", e.what());
    return 1;
  }
}
