// Weight paths in files: a sublayer's weights are stored under its owner's path
// ("block_1/dense/kernel"), so that custom layers load into the right layer whatever order
// the layers were made or called in (also in a new process: the [.paths_*] pair run by CTest);
// collisions and ambiguous files are refused naming both sides; files written before the
// paths were scoped (tests/fixtures/model_format_1, made by the main of that time) load where
// their names say which weight is which, and convert through renames where they do not.
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "error_of.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using Catch::Matchers::Contains;
using mixtape_test::error_of;
using mixtape_test::TempDir;

namespace {

// relu(x + project(hidden(x))): two Dense sublayers with default names, as the fixtures'.
class Block : public ml::Layer {
 public:
  explicit Block(std::int64_t units, ml::LayerOptions options = {})
      : Layer(std::move(options)),
        units_(units),
        hidden_(ml::Dense(units, {.activation = "relu"})),
        project_(ml::Dense(units)) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return mt::relu(x + project_(hidden_(x, ctx), ctx));
  }
  ml::Config get_config() const override {
    ml::Config c = Layer::get_config();
    c.set("units", units_);
    return c;
  }
  static std::shared_ptr<Block> from_config(const ml::Config& c) {
    return ml::make_layer<Block>(c.get_int("units"), c.layer_options());
  }

 private:
  std::int64_t units_;
  ml::LayerPtr<ml::DenseLayer> hidden_, project_;
};

// The same with a shape rule, which builds the block without running it (its sublayers are
// then built by one call when the model is made).
class ShapedBlock : public Block {
 public:
  using Block::Block;
  std::optional<mt::Shape> compute_output_shape(const mt::Shape& s) const override { return s; }
  static std::shared_ptr<ShapedBlock> from_config(const ml::Config& c) {
    return ml::make_layer<ShapedBlock>(c.get_int("units"), c.layer_options());
  }
};

// A custom layer of custom layers: two blocks, then a tower of Dense layers made in a loop
// and one Dense applied to both halves of the input (a sublayer called twice).
class Stack : public ml::Layer {
 public:
  explicit Stack(std::int64_t units, std::int64_t depth, ml::LayerOptions options = {})
      : Layer(std::move(options)), units_(units), depth_(depth) {
    first_ = ml::make_layer<Block>(units);
    second_ = ml::make_layer<Block>(units);
    for (std::int64_t i = 0; i < depth; ++i) tower_.push_back(ml::Dense(units));
    twice_ = ml::Dense(units / 2);
  }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    mt::Tensor h = second_(first_(x, ctx), ctx);
    for (auto& d : tower_) h = d(h, ctx);
    const std::int64_t half = units_ / 2;
    return mt::concat(
        {twice_(mt::slice(h, 1, 0, half), ctx), twice_(mt::slice(h, 1, half, units_), ctx)}, 1);
  }
  ml::Config get_config() const override {
    ml::Config c = Layer::get_config();
    c.set("units", units_);
    c.set("depth", depth_);
    return c;
  }
  static std::shared_ptr<Stack> from_config(const ml::Config& c) {
    return ml::make_layer<Stack>(c.get_int("units"), c.get_int("depth"), c.layer_options());
  }

 private:
  std::int64_t units_, depth_;
  ml::LayerPtr<Block> first_, second_;
  std::vector<ml::LayerPtr<ml::DenseLayer>> tower_;
  ml::LayerPtr<ml::DenseLayer> twice_;
};

// Two sublayers given one name.
class Twins : public ml::Layer {
 public:
  explicit Twins(ml::LayerOptions options = {})
      : Layer(std::move(options)),
        a_(ml::Dense(4, {.name = "proj"})),
        b_(ml::Dense(4, {.name = "proj"})) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return b_(a_(x, ctx), ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> a_, b_;
};

// Holds a layer made (and built) elsewhere, tracked afterwards.
class Holder : public ml::Layer {
 public:
  explicit Holder(ml::LayerPtr<ml::DenseLayer> inner, ml::LayerOptions options = {})
      : Layer(std::move(options)), inner_(std::move(inner)) {
    track(inner_);
  }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return inner_(x, ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> inner_;
};

// A class whose class_name() is not its C++ name, registered under that name, and one
// registered under its C++ name although its class_name() says otherwise.
class Renamed : public ml::Layer {
 public:
  using Layer::Layer;
  std::string class_name() const override { return "MyRenamed"; }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x * 2.0; }
  static std::shared_ptr<Renamed> from_config(const ml::Config& c) {
    return ml::make_layer<Renamed>(c.layer_options());
  }
};
class Misregistered : public ml::Layer {
 public:
  using Layer::Layer;
  std::string class_name() const override { return "Misnamed"; }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x; }
  static std::shared_ptr<Misregistered> from_config(const ml::Config& c) {
    return ml::make_layer<Misregistered>(c.layer_options());
  }
};

}  // namespace

MIXTAPE_REGISTER_LAYER(Block);
MIXTAPE_REGISTER_LAYER(ShapedBlock);
MIXTAPE_REGISTER_LAYER(Stack);
MIXTAPE_REGISTER_LAYER_AS(Renamed, "MyRenamed");
MIXTAPE_REGISTER_LAYER(Misregistered);

namespace {

bool same_bits(const mt::Tensor& a, const mt::Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         mt::detail::host_bytes(a) == mt::detail::host_bytes(b);
}

std::vector<std::string> paths(const ml::Layer& model) {
  std::vector<std::string> out;
  for (const auto& w : ml::weight_paths(model)) out.push_back(w.path);
  return out;
}

// Issue 41's reproduction: two blocks of one shape, made in one order and called in the
// other, so that the order a file's loader makes them in is not the order they were made in.
std::shared_ptr<mt::Model> swapped_blocks() {
  auto b1 = ml::make_layer<Block>(8);
  auto b2 = ml::make_layer<Block>(8);
  auto in = ml::Input({8}, {.name = "features"});
  auto out = ml::Dense(2, {.name = "logits"})(b1(b2(in)));
  return std::make_shared<mt::Model>(in, out, mt::ModelOptions{.name = "blocks"});
}

// A custom layer inside a custom layer inside a functional model used as a layer of another.
std::shared_ptr<mt::Model> nested_model() {
  auto inner_in = ml::Input({8});
  auto inner = std::make_shared<mt::Model>(
      inner_in, ml::Dense(6, {.name = "inner_out"})(ml::make_layer<Stack>(8, 3)(inner_in)),
      mt::ModelOptions{.name = "inner"});
  auto in = ml::Input({8}, {.name = "x"});
  auto h = ml::make_layer<ShapedBlock>(8)(in);
  auto y = ml::Dense(3, {.name = "head"})(ml::LayerPtr<mt::Model>(inner)(h));
  return std::make_shared<mt::Model>(in, y, mt::ModelOptions{.name = "outer"});
}

// One named Dense shared by two custom layers (tracked by both; the first owns it).
std::shared_ptr<mt::Model> shared_model() {
  auto shared = ml::Dense(8, {.activation = "tanh", .name = "shared"});
  auto first = ml::make_layer<Holder>(shared);
  auto second = ml::make_layer<Holder>(shared);
  auto in = ml::Input({8}, {.name = "x"});
  auto out = ml::Dense(2, {.name = "out"})(second(first(in)));
  return std::make_shared<mt::Model>(in, out, mt::ModelOptions{.name = "shared_model"});
}

// The largest |a - b| / (1 + |b|).
double max_rel_diff(const mt::Tensor& a, const mt::Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  const auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  double worst = 0.0;
  for (std::size_t i = 0; i < va.size(); ++i)
    worst = std::max(worst, std::abs(va[i] - vb[i]) / (1.0 + std::abs(vb[i])));
  return worst;
}

// Predictions recorded in a fixture by another build (or CPU: the kernels pick their vector
// width at run time) agree to float32 rounding, not to the bit; a weight in the wrong layer
// is off by far more (1.05 for the blocks file).
constexpr double kFixtureTolerance = 1e-5;

std::filesystem::path fixture(const std::string& name) {
  return std::filesystem::path(MIXTAPE_TEST_FIXTURES_DIR) / "model_format_1" / name;
}

}  // namespace

TEST_CASE("weight paths: a sublayer's weights are named under its owner", "[model-file]") {
  ml::reset_default_names();
  auto model = swapped_blocks();
  // b2 is called first, so it is named first ("block"); each block's Dense layers are
  // "dense" and "dense_1" within it, whatever other Dense layers the process made.
  CHECK(paths(*model) == std::vector<std::string>{"block/dense/kernel", "block/dense/bias",
                                                  "block/dense_1/kernel", "block/dense_1/bias",
                                                  "block_1/dense/kernel", "block_1/dense/bias",
                                                  "block_1/dense_1/kernel", "block_1/dense_1/bias",
                                                  "logits/kernel", "logits/bias"});
  // The variables carry the same names, and the paths follow weights()' order.
  const std::vector<mt::Variable> weights = model->weights();
  const std::vector<ml::WeightPath> wp = ml::weight_paths(*model);
  REQUIRE(wp.size() == weights.size());
  for (std::size_t i = 0; i < wp.size(); ++i) {
    CHECK(wp[i].variable.id() == weights[i].id());
    CHECK(wp[i].variable.name() == wp[i].path);
    CHECK(wp[i].in_sublayer == (wp[i].path.rfind("logits", 0) != 0));
  }
  // Top-level defaults stay unique in the process.
  auto d1 = ml::Dense(2);
  auto d2 = ml::Dense(2);
  CHECK(d1->name() != d2->name());
  CHECK_FALSE(d1->has_given_name());
  CHECK(ml::Dense(2, {.name = "given"})->has_given_name());
}

TEST_CASE("weight paths: swapped blocks load into the right layer, bit for bit", "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "blocks.safetensors").string();
  mt::manual_seed(7);
  auto model = swapped_blocks();
  const mt::Tensor x = mt::normal({5, 8});
  const mt::Tensor y = model->predict(x);
  model->save(file);
  // Blocks made in the opposite order before the load: the process's counters move on.
  auto noise = ml::make_layer<Block>(8);
  noise(x);
  auto loaded = mt::load_model(file);
  CHECK(same_bits(loaded->predict(x), y));
  CHECK(paths(*loaded) == paths(*model));
}

TEST_CASE("weight paths: nested custom layers, loops, a sublayer called twice, a shape rule",
          "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "nested.safetensors").string();
  mt::manual_seed(8);
  auto model = nested_model();
  // The shape rule's block was run once when the model was made, so its sublayers exist.
  CHECK(model->count_params() == model->get_layer("shaped_block")->count_params() +
                                     model->get_layer("inner")->count_params() +
                                     model->get_layer("head")->count_params());
  const std::vector<std::string> p = paths(*model);
  for (const char* expected :
       {"shaped_block/dense/kernel", "shaped_block/dense_1/bias", "stack/block/dense/kernel",
        "stack/block_1/dense_1/kernel", "stack/dense/kernel", "stack/dense_2/bias",
        "stack/dense_3/kernel", "inner_out/kernel", "head/bias"})
    CHECK(std::find(p.begin(), p.end(), expected) != p.end());
  CHECK(p.size() == 2 * 2 + 2 * 2 * 2 + 2 * 3 + 2 + 2 + 2);  // shaped block, blocks, tower, ...
  // Training changes every weight; the file keeps the trained values.
  model->compile({.loss = mt::losses::MeanSquaredError(), .optimizer = mt::optim::Adam()});
  const mt::Tensor x = mt::normal({6, 8});
  model->fit(x, mt::normal({6, 3}), {.batch_size = 3, .epochs = 1, .verbose = 0});
  const mt::Tensor y = model->predict(x);
  model->save(file);
  auto loaded = mt::load_model(file);
  CHECK(same_bits(loaded->predict(x), y));
  CHECK(paths(*loaded) == p);
  // The optimizer's slots went to the same places: one more step on both is identical.
  loaded->compile({.loss = mt::losses::MeanSquaredError(), .optimizer = mt::optim::Adam()});
  mt::load_checkpoint(file, *loaded, *loaded->optimizer());
  const mt::Tensor target = mt::normal({6, 3});
  model->train_step(x, target);
  loaded->train_step(x, target);
  CHECK(same_bits(loaded->predict(x), model->predict(x)));
}

TEST_CASE("weight paths: a sublayer shared by two layers is stored once, under its owner",
          "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "shared.safetensors").string();
  ml::reset_default_names();
  mt::manual_seed(10);
  auto model = shared_model();
  CHECK(paths(*model) == std::vector<std::string>{"holder/shared/kernel", "holder/shared/bias",
                                                  "out/kernel", "out/bias"});
  const mt::Tensor x = mt::normal({3, 8});
  const mt::Tensor y = model->predict(x);
  mt::save_weights(*model, file);
  // The same code in the same order (as a new process would run it), after other layers.
  ml::reset_default_names();
  ml::Dense(3)(x);
  auto again = shared_model();
  mt::load_weights(*again, file);
  CHECK(same_bits(again->predict(x), y));
}

TEST_CASE("weight paths: collisions and ambiguous files are refused, naming both", "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "m.safetensors").string();
  {
    // Two sublayers of one name.
    auto in = ml::Input({4});
    mt::Model model(in, ml::make_layer<Twins>()(in));
    const std::string e = error_of<mt::ValueError>([&] { model.save(file); });
    CHECK_THAT(e, Contains("two weights have the path 'twins/proj/kernel'"));
    CHECK_THAT(e, Contains("layer 'proj' (Dense)"));
    CHECK_FALSE(std::filesystem::exists(file));
  }
  {
    // A Dense built before its owner tracked it keeps a name unique only in this process.
    auto inner = ml::Dense(4);
    inner(mt::normal({1, 4}));
    auto in = ml::Input({4});
    mt::Model model(in, ml::make_layer<Holder>(inner)(in));
    const std::string e = error_of<mt::ValueError>([&] { model.save(file); });
    CHECK_THAT(e, Contains("(Dense) inside 'holder") &&
                      Contains("has a default name that is unique only in this process"));
    CHECK_FALSE(std::filesystem::exists(file));
  }
  // Renames that would feed one weight twice, or two weights from one tensor.
  mt::manual_seed(9);
  ml::reset_default_names();
  auto model = swapped_blocks();
  model->save(file);
  ml::reset_default_names();
  auto fresh = swapped_blocks();
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::load_weights(*fresh, file,
                                {.renames = {{"block/dense/kernel", "logits/kernel"},
                                             {"block/dense_1/kernel", "logits/kernel"}}});
             }),
             Contains("both 'block/dense/kernel' and 'block/dense_1/kernel' are renamed to "
                      "'logits/kernel'"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::load_weights(*fresh, file,
                                {.renames = {{"block/dense/kernel", "block_1/dense/kernel"}}});
             }),
             Contains("would feed two weights, 'block/dense/kernel' and 'block_1/dense/kernel'"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::load_weights(*fresh, file, {.renames = {{"nope/kernel", "logits/kernel"}}});
             }),
             Contains("renames: 'nope/kernel' is not a tensor of the file"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::load_weights(*fresh, file, {.renames = {{"logits/kernel", "nope/kernel"}}});
             }),
             Contains("'nope/kernel' is not the path of a weight of the model"));
}

TEST_CASE("weight paths: registration by class_name()", "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "r.safetensors").string();
  auto in = ml::Input({3});
  auto renamed = ml::make_layer<Renamed>();
  CHECK(renamed->name() == "my_renamed");
  auto model = std::make_shared<mt::Model>(in, ml::Dense(2)(renamed(in)));
  model->save(file);
  const mt::Tensor x = mt::normal({2, 3});
  CHECK(same_bits(mt::load_model(file)->predict(x), model->predict(x)));

  auto in2 = ml::Input({3});
  mt::Model bad(in2, ml::make_layer<Misregistered>()(in2));
  const std::string e = error_of<mt::ValueError>([&] { bad.save(file); });
  CHECK_THAT(e, Contains("registered as 'Misregistered'"));
  CHECK_THAT(e, Contains("MIXTAPE_REGISTER_LAYER_AS(Misregistered, \"Misnamed\")"));
  // The file of the first model is still there, whole.
  CHECK(mt::load_model(file)->count_params() == model->count_params());
  CHECK_THAT(error_of<mt::ValueError>([&] { ml::layer_from_config("NoSuchClass", ml::Config()); }),
             Contains("MIXTAPE_REGISTER_LAYER_AS(T, \"NoSuchClass\")"));
}

TEST_CASE(
    "model files: every built-in layer, as written before configs were derived from the "
    "options' field lists",
    "[model-file]") {
  // tests/fixtures/model_format_2/make_fixtures.cpp, run against main at 627c051.
  const std::filesystem::path dir =
      std::filesystem::path(MIXTAPE_TEST_FIXTURES_DIR) / "model_format_2";
  const std::string file = (dir / "every_layer.safetensors").string();
  auto model = mt::load_model(file);
  const mt::SafetensorsFile io =
      mt::load_safetensors((dir / "every_layer_io.safetensors").string());
  const std::vector<mt::Tensor> y = (*model)({io.at("images"), io.at("ids"), io.at("feats")});
  CHECK(max_rel_diff(y.front(), io.at("y")) < kFixtureTolerance);
  const mt::SafetensorsFile weights = mt::load_safetensors(file);
  for (const auto& w : ml::weight_paths(*model)) {
    CAPTURE(w.path);
    CHECK(same_bits(w.variable, weights.at("model/" + w.path)));
  }
  // Every layer's config comes back as that main wrote it: the same architecture, key for key.
  std::ifstream in(dir / "every_layer.json");
  const std::string json{std::istreambuf_iterator<char>(in), {}};
  REQUIRE(!json.empty());
  CHECK(model->to_json() == json);
}

TEST_CASE("weight paths: files of the earlier format", "[model-file]") {
  // Built-in layers only: the names were paths already; the optimizer's state comes back.
  auto builtin = mt::load_model(fixture("builtin.safetensors").string());
  const mt::SafetensorsFile io = mt::load_safetensors(fixture("builtin_io.safetensors").string());
  CHECK(max_rel_diff(builtin->predict(io.at("x")), io.at("y")) < kFixtureTolerance);
  // The weights themselves are the file's, bit for bit.
  const mt::SafetensorsFile builtin_file =
      mt::load_safetensors(fixture("builtin.safetensors").string());
  for (const auto& w : ml::weight_paths(*builtin))
    CHECK(same_bits(w.variable, builtin_file.at("model/" + w.path)));
  builtin->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                    .optimizer = mt::optim::Adam({.learning_rate = 0.01})});
  mt::load_checkpoint(fixture("builtin.safetensors").string(), *builtin, *builtin->optimizer());
  CHECK(builtin->optimizer()->iterations() == 2);

  // The reproduction, written by the earlier main: its names do not say which block is which.
  const std::string blocks = fixture("blocks.safetensors").string();
  const std::string e = error_of<mt::ValueError>([&] { mt::load_model(blocks); });
  CHECK_THAT(e, Contains("was written before weight paths were scoped by their owner"));
  CHECK_THAT(e, Contains("8 weights of sublayers cannot be matched safely"));
  CHECK_THAT(e, Contains("'block/dense/kernel' float32[8, 8]"));
  CHECK_THAT(e, Contains("'dense_2/kernel' float32[8, 8]"));
  CHECK_THAT(e, Contains("WeightLoadOptions::renames"));
  // Converted: the program that wrote it made b1 ("block_1", called second) first, so b1's
  // Dense layers were dense and dense_1, b2's ("block") dense_2 and dense_3.
  mt::WeightLoadOptions renames;
  for (const char* w : {"kernel", "bias"}) {
    const std::string s = w;
    renames.renames["dense_2/" + s] = "block/dense/" + s;
    renames.renames["dense_3/" + s] = "block/dense_1/" + s;
    renames.renames["dense/" + s] = "block_1/dense/" + s;
    renames.renames["dense_1/" + s] = "block_1/dense_1/" + s;
  }
  auto converted = mt::load_model(blocks, renames);
  const mt::SafetensorsFile bio = mt::load_safetensors(fixture("blocks_io.safetensors").string());
  CHECK(max_rel_diff(converted->predict(bio.at("x")), bio.at("y")) < kFixtureTolerance);
  // Saved again, the file is of today's format and loads without renames.
  TempDir dir;
  const std::string file = (dir.path() / "converted.safetensors").string();
  converted->save(file);
  CHECK(mt::load_safetensors(file).metadata.at("weight_keys") == mt::kWeightKeys);
  CHECK(same_bits(mt::load_model(file)->predict(bio.at("x")), converted->predict(bio.at("x"))));
}

// The reproduction across two processes: the first writes the model, its inputs and its
// predictions; the second makes other blocks first and then loads (tests/CMakeLists.txt runs
// them in order).
TEST_CASE("weight paths: write for the next process", "[.paths_write]") {
  mt::manual_seed(41);
  auto model = swapped_blocks();
  auto nested = nested_model();
  const mt::Tensor x = mt::normal({5, 8});
  ml::reset_default_names();
  auto shared = shared_model();
  mt::save_safetensors("paths_process_io.safetensors", {{"x", x},
                                                        {"blocks", model->predict(x)},
                                                        {"nested", nested->predict(x)},
                                                        {"shared", shared->predict(x)}});
  model->save("paths_process_blocks.safetensors");
  nested->save("paths_process_nested.safetensors");
  mt::save_weights(*shared, "paths_process_shared.safetensors");
}

TEST_CASE("weight paths: read in a new process", "[.paths_read]") {
  auto other = ml::make_layer<Block>(8);  // takes the names the writer's first blocks had
  other(mt::normal({1, 8}));
  const mt::SafetensorsFile io = mt::load_safetensors("paths_process_io.safetensors");
  auto nested = mt::load_model("paths_process_nested.safetensors");
  auto blocks = mt::load_model("paths_process_blocks.safetensors");
  CHECK(same_bits(blocks->predict(io.at("x")), io.at("blocks")));
  CHECK(same_bits(nested->predict(io.at("x")), io.at("nested")));
  // A shared sublayer cannot come from configs (each layer would make its own): the model
  // is made by the same code, and its weights loaded.
  ml::reset_default_names();
  auto shared = shared_model();
  mt::load_weights(*shared, "paths_process_shared.safetensors");
  CHECK(same_bits(shared->predict(io.at("x")), io.at("shared")));
}

namespace {

// Two classes from 6 features, and a model for them.
std::shared_ptr<mt::Model> classifier() {
  auto in = ml::Input({6}, {.name = "features"});
  auto h = ml::make_layer<Block>(6)(ml::Dense(6, {.activation = "relu"})(in));
  auto out = ml::Activation("linear", {.dtype = "float32"})(ml::Dense(2)(h));
  return std::make_shared<mt::Model>(in, out, mt::ModelOptions{.name = "classifier"});
}

std::vector<std::vector<std::uint8_t>> weight_bits(const mt::Model& m) {
  std::vector<std::vector<std::uint8_t>> out;
  for (const auto& v : m.weights()) out.push_back(mt::detail::host_bytes(v));
  return out;
}

}  // namespace

TEST_CASE("load_model: a model saved compiled comes back compiled, state and all", "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "compiled.safetensors").string();
  const char* policy = GENERATE("float32", "mixed_float16");
  CAPTURE(policy);
  mt::PolicyScope scope(policy);
  mt::manual_seed(12);
  auto model = classifier();
  model->compile(
      {.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
       .optimizer = mt::optim::Adam(
           {.learning_rate = 0.02, .beta_1 = 0.8, .amsgrad = true, .clipping = {.clipnorm = 1.5}}),
       .metrics = {"accuracy"}});
  const mt::Tensor x = mt::normal({12, 6});
  const mt::Tensor y = mt::cast(mt::uniform({12}, 0.0, 2.0), mt::kInt64);
  model->fit(x, y, {.batch_size = 4, .epochs = 1, .verbose = 0});
  model->save(file);

  auto loaded = mt::load_model(file);
  REQUIRE(loaded->compiled());
  CHECK(loaded->optimizer()->name() == model->optimizer()->name());
  CHECK(loaded->optimizer()->iterations() == 3);
  CHECK(loaded->loss().name() == "sparse_categorical_crossentropy");
  if (std::string(policy) == "mixed_float16") {
    const auto& a = dynamic_cast<const mt::optim::LossScaleOptimizer&>(*model->optimizer());
    const auto& b = dynamic_cast<const mt::optim::LossScaleOptimizer&>(*loaded->optimizer());
    CHECK(b.loss_scale() == a.loss_scale());
    CHECK(b.loss_scale_config() == a.loss_scale_config());
    CHECK(b.inner_optimizer().get_config() == a.inner_optimizer().get_config());
  } else {
    CHECK(loaded->optimizer()->get_config() == model->optimizer()->get_config());
  }
  // The same next steps, and the same evaluation (loss and the metric).
  CHECK(loaded->evaluate(x, y) == model->evaluate(x, y));
  for (auto* m : {model.get(), loaded.get()}) {
    mt::manual_seed(14);  // the same shuffle
    m->fit(x, y, {.batch_size = 4, .epochs = 1, .verbose = 0});
  }
  CHECK(weight_bits(*loaded) == weight_bits(*model));
}

TEST_CASE("load_model: a compile state it cannot record leaves the model uncompiled",
          "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "custom_loss.safetensors").string();
  mt::manual_seed(13);
  auto model = classifier();
  const mt::losses::Loss own("own", [](const mt::Tensor& t, const mt::Tensor& p) {
    return mt::mean(mt::square(p), {1}) + mt::cast(t, mt::kFloat32) * 0.0;
  });
  model->compile({.loss = own, .optimizer = "sgd"});
  const mt::Tensor x = mt::normal({4, 6});
  model->train_step(x, mt::cast(mt::uniform({4}, 0.0, 2.0), mt::kInt64));
  model->save(file);
  auto loaded = mt::load_model(file);
  CHECK_FALSE(loaded->compiled());
  CHECK(same_bits(loaded->predict(x), model->predict(x)));
  // Compiled by hand, the optimizer's state loads as before.
  loaded->compile({.loss = own, .optimizer = "sgd"});
  mt::load_checkpoint(file, *loaded, *loaded->optimizer());
  CHECK(loaded->optimizer()->iterations() == 1);
}

TEST_CASE("optimizers: get_config and from_config make the same optimizer", "[model-file]") {
  const std::vector<std::shared_ptr<mt::optim::Optimizer>> opts = {
      std::make_shared<mt::optim::SGD>(
          mt::optim::SGDOptions{.learning_rate = 0.3, .momentum = 0.5, .nesterov = true}),
      std::make_shared<mt::optim::RMSprop>(mt::optim::RMSpropOptions{
          .rho = 0.8, .centered = true, .clipping = {.global_clipnorm = 2.0}}),
      std::make_shared<mt::optim::Adam>(
          mt::optim::AdamOptions{.beta_2 = 0.99, .clipping = {.clipvalue = 0.25}}),
      std::make_shared<mt::optim::AdamW>(mt::optim::AdamWOptions{.weight_decay = 0.1})};
  for (const auto& o : opts) {
    CAPTURE(o->name());
    const auto again = mt::optim::from_config(o->name(), o->get_config());
    CHECK(again->name() == o->name());
    CHECK(again->get_config() == o->get_config());
  }
  CHECK_THAT(error_of<mt::ValueError>([] {
               mt::optim::from_config("SGD", {{"rho", 0.5}});
             }),
             Contains("unknown option 'rho'"));
  CHECK_THAT(error_of<mt::ValueError>([] {
               mt::optim::from_config("SGD", {{"nesterov", 0.5}});
             }),
             Contains("'nesterov' is a flag"));
  CHECK_THAT(error_of<mt::ValueError>([] { mt::optim::from_config("Adagrad", {}); }),
             Contains("unknown optimizer class 'Adagrad'"));
  mt::optim::SGD scheduled(
      {.learning_rate = mt::optim::schedules::exponential_decay(0.1, 10, 0.5)});
  CHECK_THAT(error_of<mt::ValueError>([&] { scheduled.get_config(); }), Contains("schedule"));
}

TEST_CASE("load_model: gradient accumulation comes back with the compile state", "[model-file]") {
  TempDir dir;
  const std::string file = (dir.path() / "accumulating.safetensors").string();
  mt::manual_seed(15);
  auto model = classifier();
  model->compile({.loss = "mse", .optimizer = "sgd", .gradient_accumulation_steps = 2});
  const mt::Tensor x = mt::normal({4, 6}), y = mt::normal({4, 2});
  model->train_step(x, y);
  model->train_step(x, y);
  model->save(file);
  auto loaded = mt::load_model(file);
  REQUIRE(loaded->compiled());
  const auto* acc =
      dynamic_cast<const mt::optim::GradientAccumulationOptimizer*>(loaded->optimizer().get());
  REQUIRE(acc != nullptr);
  CHECK(acc->steps() == 2);
  CHECK(acc->iterations() == 1);
  for (auto* m : {model.get(), loaded.get()}) {
    m->train_step(x, y);
    m->train_step(x, y);
  }
  CHECK(weight_bits(*loaded) == weight_bits(*model));
}

namespace {
// Every field type mixtape/layers/options.h knows.
struct AllKinds {
  bool flag = false;
  int axis = -1;
  std::int64_t units = 3;
  double rate = 0.5;
  std::string mode = "a";
  mt::Shape shape = {};
  ml::Size2 window = 1;
  mt::DType dtype_of_scores = mt::kFloat32;
  mt::init::Initializer init = mt::init::zeros();
  std::optional<ml::Size2> strides = {};
  std::optional<std::int64_t> stop = {};
  std::optional<std::uint64_t> seed = {};
  std::optional<mt::DType> maybe_dtype = {};
  std::vector<int> axes = {};
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(AllKinds, flag, axis, units, rate, mode, shape, window, dtype_of_scores, init,
                strides, stop, seed, maybe_dtype, axes);
}  // namespace

TEST_CASE("layer options described once: every field type to a config and back", "[model-file]") {
  AllKinds a{.flag = true,
             .axis = 2,
             .units = 1LL << 40,
             .rate = 0.125,
             .mode = "same",
             .shape = {2, 3},
             .window = {3, 2},
             .dtype_of_scores = mt::kBFloat16,
             .init = mt::init::he_normal(),
             .strides = ml::Size2(2),
             .stop = -1,
             .seed = std::uint64_t{1} << 63,
             .maybe_dtype = mt::kFloat16,
             .axes = {-1, 2},
             .dtype = mt::Policy("mixed_float16"),
             .name = "n",
             .trainable = false};
  ml::Config c;
  c.set("name", a.name);
  c.set("trainable", a.trainable);
  c.set("dtype", a.dtype->name());
  ml::write_options(c, a);
  CHECK(c.get_ints("window") == std::vector<std::int64_t>{3, 2});
  CHECK(c.get_string("init") == "he_normal");
  CHECK(c.get_string("maybe_dtype") == "float16");
  const AllKinds b = ml::read_options<AllKinds>(c);
  CHECK(b.flag);
  CHECK(b.axis == 2);
  CHECK(b.units == (1LL << 40));
  CHECK(b.rate == 0.125);
  CHECK(b.mode == "same");
  CHECK(b.shape == mt::Shape{2, 3});
  CHECK((b.window.h == 3 && b.window.w == 2));
  CHECK(b.dtype_of_scores == mt::kBFloat16);
  CHECK(b.init.name() == "he_normal");
  CHECK((b.strides && b.strides->h == 2 && b.strides->w == 2));
  CHECK(b.stop == -1);
  CHECK(b.seed == std::uint64_t{1} << 63);
  CHECK(b.maybe_dtype == mt::kFloat16);
  CHECK(b.axes == std::vector<int>{-1, 2});
  CHECK(b.dtype == mt::Policy("mixed_float16"));
  CHECK(b.name == "n");
  CHECK_FALSE(b.trainable);

  // Empty optionals stay out of the config, and come back empty.
  ml::Config d;
  ml::write_options(d, AllKinds{});
  CHECK_FALSE(d.has("strides"));
  CHECK_FALSE(d.has("seed"));
  const AllKinds e = ml::read_options<AllKinds>(d);
  CHECK_FALSE(e.strides);
  CHECK_FALSE(e.maybe_dtype);
  // A missing plain field, a value of another kind, an int out of range: ValueError naming it.
  ml::Config missing = d;
  ml::Config copy;
  for (const auto& [key, value] : missing.values())
    if (key != "units") std::visit([&](const auto& v) { copy.set(key, v); }, value);
  CHECK_THAT(error_of<mt::ValueError>([&] { ml::read_options<AllKinds>(copy); }),
             Contains("units"));
  d.set("axis", std::int64_t{1} << 40);
  CHECK_THAT(error_of<mt::ValueError>([&] { ml::read_options<AllKinds>(d); }),
             Contains("'axis' is 1099511627776, outside the range of an int"));
  d.set("axis", std::int64_t{2});
  d.set("axes", std::vector<std::int64_t>{1, -(std::int64_t{1} << 33)});
  CHECK_THAT(error_of<mt::ValueError>([&] { ml::read_options<AllKinds>(d); }),
             Contains("'axes' holds -8589934592, outside the range of an int"));
}
