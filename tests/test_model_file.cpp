// Whole-model files: Model::save writes the architecture with the weights; load_model makes
// the model again without the code that built it, with identical predictions (also in a new
// process: the [.model_file_*] pair run by CTest), custom layers through the registry, and
// clear errors for files that do not fit.
#include <catch2/catch.hpp>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "error_of.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using Catch::Matchers::Contains;
using Catch::Matchers::Equals;
using Catch::Matchers::StartsWith;
using mixtape_test::error_of;
using mixtape_test::TempDir;

namespace {

// A layer of a user's own, loadable from files: y = x * factor.
class ScaleBy : public ml::Layer {
 public:
  explicit ScaleBy(double factor, ml::LayerOptions options = {})
      : Layer(std::move(options)), factor_(factor) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x * factor_; }
  std::optional<mt::Shape> compute_output_shape(const mt::Shape& s) const override { return s; }
  ml::Config get_config() const override {
    ml::Config c = Layer::get_config();
    c.set("factor", factor_);
    return c;
  }
  static std::shared_ptr<ScaleBy> from_config(const ml::Config& c) {
    return ml::make_layer<ScaleBy>(c.get_double("factor"), c.layer_options());
  }

 private:
  double factor_;
};

// A layer of a user's own whose from_config refuses a config with an error of its own type.
class Picky : public ml::Layer {
 public:
  explicit Picky(std::int64_t width, ml::LayerOptions options = {})
      : Layer(std::move(options)), width_(width) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x; }
  std::optional<mt::Shape> compute_output_shape(const mt::Shape& s) const override { return s; }
  ml::Config get_config() const override {
    ml::Config c = Layer::get_config();
    c.set("width", width_);
    return c;
  }
  static std::shared_ptr<Picky> from_config(const ml::Config& c) {
    if (c.get_int("width") < 1) throw mt::ShapeError("width must be >= 1");
    return ml::make_layer<Picky>(c.get_int("width"), c.layer_options());
  }

 private:
  std::int64_t width_;
};

// A layer nobody registered.
class Unregistered : public ml::Layer {
 public:
  using Layer::Layer;
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x; }
};

}  // namespace

MIXTAPE_REGISTER_LAYER(ScaleBy);
MIXTAPE_REGISTER_LAYER(Picky);

namespace {

// A graph with most layer kinds: two inputs (one of ids), a shared layer, merges, a nested
// model, a Sequential, a frozen layer and two policies.
std::shared_ptr<mt::Model> rich_model() {
  mt::PolicyScope scope("mixed_bfloat16");
  auto image = ml::Input({8, 8, 2}, {.name = "image"});
  auto ids = ml::Input({3}, {.dtype = mt::kInt64, .name = "ids"});
  auto x = ml::Conv2D(4, 3, {.strides = 1, .padding = "same", .activation = "relu"})(image);
  x = ml::BatchNormalization({.momentum = 0.9})(x);
  auto shortcut = x;
  x = ml::Conv2D(4, {3, 1}, {.padding = "same", .use_bias = false})(x);
  x = ml::Add()({x, shortcut});
  x = ml::MaxPooling2D({.pool_size = 2})(x);
  x = ml::AveragePooling2D({.pool_size = {2, 1}, .strides = ml::Size2(1), .padding = "same"})(x);
  auto pooled = ml::GlobalAveragePooling2D()(x);  // [4]
  auto flat = ml::Flatten()(ml::Reshape({-1, 2})(x));
  auto emb = ml::Flatten()(ml::Embedding(10, 2)(ids));  // [6]
  auto shared = ml::Dense(4, {.activation = "tanh", .name = "shared"});
  auto a = shared(pooled);
  auto b = shared(ml::Dense(4, {.trainable = false})(emb));
  auto merged = ml::Concatenate()(
      {ml::Subtract()({a, b}), ml::Multiply()({a, b}), ml::Average()({a, b}), ml::Maximum()({a, b}),
       ml::Minimum()({a, b}), ml::Dot({1}, {.normalize = true})({a, b}), ml::Dense(3)(flat)});
  auto inner_in = ml::Input({24});
  auto inner = std::make_shared<mt::Model>(
      inner_in, ml::LayerNormalization()(ml::Dense(8, {.activation = "gelu"})(inner_in)),
      mt::ModelOptions{.name = "inner"});
  auto h = ml::LayerPtr<mt::Model>(inner)(merged);
  h = ml::Dropout(0.25, {.seed = 3})(h);
  auto seq = std::make_shared<mt::Sequential>(
      std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(5), ml::make_layer<ScaleBy>(0.5)},
      mt::ModelOptions{.name = "head_seq"});
  auto out1 = ml::Activation(
      "linear", {.dtype = "float32", .name = "logits"})(ml::LayerPtr<mt::Sequential>(seq)(h));
  auto out2 = ml::Activation("sigmoid", {.dtype = "float32", .name = "score"})(ml::Dense(1)(h));
  return std::make_shared<mt::Model>(std::vector<ml::SymbolicTensor>{image, ids},
                                     std::vector<ml::SymbolicTensor>{out1, out2},
                                     mt::ModelOptions{.name = "rich"});
}

std::vector<mt::Tensor> rich_inputs(std::uint64_t seed) {
  mt::Generator gen(seed);
  return {
      mt::normal({5, 8, 8, 2}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen),
      mt::cast(mt::uniform({5, 3}, 0.0, 10.0, mt::kFloat32, mt::Device::cpu(), &gen), mt::kInt64)};
}

bool same_bits(const mt::Tensor& a, const mt::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         mt::detail::host_bytes(a) == mt::detail::host_bytes(b);
}

}  // namespace

TEST_CASE("model files: save -> load_model gives the same model, bit for bit", "[model-file]") {
  TempDir dir;
  mt::manual_seed(31);
  auto model = rich_model();
  const std::vector<mt::Tensor> x = rich_inputs(7);
  const std::vector<mt::Tensor> before = model->predict(x);
  model->save(dir / "rich.safetensors");

  auto loaded = mt::load_model(dir / "rich.safetensors");
  REQUIRE(loaded->class_name() == "Functional");
  CHECK(loaded->name() == "rich");
  CHECK(loaded->count_params() == model->count_params());
  CHECK(loaded->trainable_variables().size() == model->trainable_variables().size());
  CHECK(loaded->to_json() == model->to_json());
  CHECK(loaded->summary_string() == model->summary_string());
  const std::vector<mt::Tensor> after = loaded->predict(x);
  REQUIRE(after.size() == 2);
  for (std::size_t i = 0; i < 2; ++i) CHECK(same_bits(before[i], after[i]));
  // Policies, frozen layers, the custom layer and the nested models came back as they were.
  CHECK(loaded->get_layer("shared")->dtype_policy().name() == "mixed_bfloat16");
  CHECK(loaded->get_layer("logits")->dtype_policy().name() == "float32");
  CHECK(loaded->get_layer("inner")->class_name() == "Functional");
  auto seq = std::dynamic_pointer_cast<mt::Sequential>(loaded->get_layer("head_seq"));
  REQUIRE(seq);
  CHECK(seq->layers().back()->class_name() == "ScaleBy");
  std::int64_t frozen = 0;
  for (const auto& l : loaded->layers()) frozen += l->trainable() ? 0 : 1;
  CHECK(frozen == 1);
}

TEST_CASE("model files: a compiled model keeps its optimizer state; a Sequential its build",
          "[model-file]") {
  TempDir dir;
  mt::manual_seed(32);
  mt::Sequential model({ml::Dense(8, {.activation = "relu"}), ml::Dense(3)}, {.name = "seq"});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mt::optim::Adam()});
  CHECK_THROWS_WITH(model.save(dir / "unbuilt.safetensors"), Contains("not built"));
  const mt::Tensor x = mt::normal({64, 4});
  const mt::Tensor y =
      mt::cast(mt::greater(x.slice(1, 0, 1).reshape({64}), mt::zeros({})), mt::kInt64);
  model.fit(x, y, {.batch_size = 16, .epochs = 2, .verbose = 0});
  model.save(dir / "seq.safetensors", {.epoch = 2});

  auto loaded = mt::load_model(dir / "seq.safetensors");
  CHECK(loaded->class_name() == "Sequential");
  CHECK(same_bits(loaded->predict(x), model.predict(x)));
  // The optimizer's state is in the file: compile, then restore it; one more step on both
  // models stays identical.
  loaded->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                   .optimizer = mt::optim::Adam()});
  const mt::TrainingCheckpoint info =
      mt::load_checkpoint(dir / "seq.safetensors", *loaded, *loaded->optimizer());
  CHECK(info.epoch == 2);
  CHECK(loaded->optimizer()->iterations() == model.optimizer()->iterations());
  model.train_step(x, y);
  loaded->train_step(x, y);
  CHECK(same_bits(loaded->predict(x), model.predict(x)));
}

TEST_CASE("model files: files that do not fit are refused, naming what differs", "[model-file]") {
  TempDir dir;
  mt::manual_seed(33);
  auto in = ml::Input({4}, {.name = "in"});
  mt::Model small(in, ml::Dense(3, {.name = "out"})(in), {.name = "small"});
  auto in2 = ml::Input({4}, {.name = "in"});
  mt::Model wide(in2, ml::Dense(5, {.name = "out"})(in2), {.name = "small"});

  // Weights of the wide model under the small model's architecture.
  std::vector<std::pair<std::string, mt::Tensor>> tensors;
  for (const auto& v : wide.weights()) tensors.emplace_back(v.name(), v.value());
  mt::save_safetensors(dir / "mismatch.safetensors", tensors,
                       {{"architecture", small.to_json()}, {"model_format", "mixtape-model-1"}});
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(dir / "mismatch.safetensors"); }),
             Contains("out/kernel") && Contains("[4, 5]") && Contains("[4, 3]"));

  // An unknown layer class names itself and what is registered.
  auto in3 = ml::Input({4});
  mt::Model odd(in3, ml::make_layer<Unregistered>({.name = "odd"})(in3));
  odd.save(dir / "odd.safetensors");
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(dir / "odd.safetensors"); }),
             Contains("Unregistered") && Contains("MIXTAPE_REGISTER_LAYER") &&
                 Contains("ScaleBy") && Contains("Dense"));
  // A layer that cannot be made from its config: the error keeps its type, and the layer is
  // named once.
  auto in4 = ml::Input({4});
  mt::Model picky(in4, ml::BatchNormalization({.name = "bn"})(ml::make_layer<Picky>(
                           std::int64_t{2}, ml::LayerOptions{.name = "picky"})(in4)));
  std::string bad = picky.to_json();
  bad.replace(bad.find("\"width\":2"), 9, "\"width\":0");
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::model_from_json(bad); }),
             Equals("layer 'picky' (Picky): cannot be made from its config: width must be >= 1"));
  bad = picky.to_json();
  bad.replace(bad.find("\"momentum\":0.99"), 15, "\"momentum\":2.0");
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::model_from_json(bad); }),
             StartsWith("layer 'bn' (BatchNormalization): momentum"));
  // A weights-only file, malformed JSON, a graph that reads what it never made.
  small.save_weights(dir / "weights.safetensors");
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(dir / "weights.safetensors"); }),
             Contains("no architecture") && Contains("load_weights"));
  CHECK_THROWS_AS(mt::model_from_json("{\"class_name\": "), mt::ValueError);
  std::string broken = small.to_json();
  broken.replace(broken.find("[\"in\",0,0]"), 10, "[\"zz\",0,0]");
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::model_from_json(broken); }), Contains("zz[0][0]"));
  CHECK_THROWS_AS(mt::load_model(dir / "missing.safetensors"), mt::IOError);
  // Registering a class name twice.
  CHECK_THROWS_AS(ml::register_layer("Dense", [](const ml::Config&) { return nullptr; }),
                  mt::ValueError);
}

// What a file's architecture or compile state holds in the wrong place is named by its place
// (a JSON pointer) and by what belongs there; and any change to them gives the model or a
// mixtape::Error, never another exception (the JSON library's among them).
TEST_CASE("model files: an architecture or compile state that cannot be read names the place",
          "[model-file]") {
  using nlohmann::json;
  TempDir dir;
  mt::manual_seed(35);
  auto in = ml::Input({6}, {.name = "in"});
  mt::Model model(in, ml::Dense(3, {.name = "out"})(ml::Dense(8, {.name = "hidden"})(in)),
                  {.name = "m"});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = "adam",
                 .metrics = {"accuracy"}});
  model.save(dir / "m.safetensors");
  const mt::SafetensorsFile file = mt::load_safetensors(dir / "m.safetensors");
  const json architecture = json::parse(file.metadata.at("architecture"));
  const json compile_state = json::parse(file.metadata.at("compile"));
  // `file` with its architecture and compile state replaced, loaded.
  const auto load = [&](const json& a, const json& c) {
    auto metadata = file.metadata;
    metadata["architecture"] = a.dump();
    metadata["compile"] = c.dump();
    mt::save_safetensors(dir / "changed.safetensors", file.tensors, metadata);
    return mt::load_model(dir / "changed.safetensors");
  };
  REQUIRE(load(architecture, compile_state)->compiled());

  json a = architecture;
  a["nodes"][1]["inputs"][0][1] = -1;  // a call number
  CHECK_THAT(error_of<mt::ValueError>([&] { load(a, compile_state); }),
             Contains("model_from_json: the architecture's /nodes/1/inputs/0/1 is -1; expected an "
                      "integer >= 0"));
  a = architecture;
  a["layers"][1].erase("class_name");
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::model_from_json(a.dump()); }),
             Equals("model_from_json: the architecture's /layers/1 has no \"class_name\""));
  a = architecture;
  a["layers"][2]["config"]["name"] = 7;
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::model_from_json(a.dump()); }),
             Equals("model_from_json: the architecture's /layers/2/config/name is 7; expected a "
                    "text"));
  json c = compile_state;
  c["losses"][0]["from_logits"] = "yes";
  CHECK_THAT(error_of<mt::ValueError>([&] { load(architecture, c); }),
             Contains("the compile state's /losses/0/from_logits is \"yes\"; expected true or "
                      "false"));
  c = compile_state;
  c["optimizer"]["config"] = json::array({1});
  CHECK_THAT(error_of<mt::ValueError>([&] { load(architecture, c); }),
             Contains("the compile state's /optimizer/config is [1]; expected an object of "
                      "numbers"));

  // Every value of either, replaced by one of other kinds and sizes, or removed (seeded).
  const std::vector<json> others = {-1,
                                    0,
                                    1,
                                    7,
                                    4294967296LL,
                                    9223372036854775807LL,
                                    -0.5,
                                    1e300,
                                    "",
                                    "x",
                                    "float16",
                                    true,
                                    nullptr,
                                    json::array(),
                                    json::object(),
                                    json::array({-1}),
                                    json::array({"a"})};
  std::mt19937_64 gen(2026);
  int loaded = 0, refused = 0;
  for (int i = 0; i < 300; ++i) {
    json changed[2] = {architecture, compile_state};
    json& doc = changed[i % 2];
    std::vector<json*> values{&doc};
    for (std::size_t k = 0; k < values.size(); ++k)
      if (values[k]->is_structured())
        for (auto& v : *values[k]) values.push_back(&v);
    json& target = *values[gen() % values.size()];
    const json before = target;
    if (target.is_object() && !target.empty() && gen() % 3 == 0)
      target.erase(target.begin());
    else
      target = others[gen() % others.size()];
    INFO("document " << i % 2 << ": " << before.dump().substr(0, 80) << " -> "
                     << target.dump().substr(0, 80));
    try {
      load(changed[0], changed[1]);
      ++loaded;
    } catch (const mt::Error& e) {
      CHECK_THAT(e.what(), !Contains("json.exception"));
      ++refused;
    }  // (anything else fails the case)
  }
  CHECK(loaded > 0);
  CHECK(refused > 100);
}

// The same round trip across two processes: the first writes the model, its inputs and its
// predictions; the second loads them and compares (tests/CMakeLists.txt runs them in order).
TEST_CASE("model files: write for the next process", "[.model_file_write]") {
  mt::manual_seed(34);
  auto model = rich_model();
  const std::vector<mt::Tensor> x = rich_inputs(9);
  const std::vector<mt::Tensor> y = model->predict(x);
  model->save("model_file_process.safetensors");
  mt::save_safetensors("model_file_process_io.safetensors",
                       {{"x0", x[0]}, {"x1", x[1]}, {"y0", y[0]}, {"y1", y[1]}});
}

TEST_CASE("model files: read in a new process", "[.model_file_read]") {
  auto model = mt::load_model("model_file_process.safetensors");
  const mt::SafetensorsFile io = mt::load_safetensors("model_file_process_io.safetensors");
  const std::vector<mt::Tensor> y = model->predict({io.at("x0"), io.at("x1")});
  CHECK(same_bits(y[0], io.at("y0")));
  CHECK(same_bits(y[1], io.at("y1")));
}
