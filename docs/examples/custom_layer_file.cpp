// A layer of one's own, made of layers, in a whole-model file: get_config() and a static
// from_config() make it again, MIXTAPE_REGISTER_LAYER lets load_model find it, and its
// sublayers' weights are stored under its path ("block/dense/kernel"), so each block loads
// its own whatever order the blocks were made or called in. Without arguments it trains a
// model of two blocks, saves it with its inputs and predictions, and loads it back; given
// `--load`, it loads those files in a new process (the suite runs both) and checks that the
// predictions are the same bits.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <string>

namespace mt = mixtape;
namespace ml = mt::layers;

// relu(x + project(hidden(x))), as docs.example.residual_block's, loadable from files.
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

  // The constructor's arguments after the base's name, trainable and dtype.
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
MIXTAPE_REGISTER_LAYER(Block);  // under its C++ name, "Block", which class_name() returns

const char* kModel = "custom_layer_file.safetensors";
const char* kData = "custom_layer_file_io.safetensors";

bool same_bits(const mt::Tensor& a, const mt::Tensor& b) {
  return mt::detail::host_bytes(a) == mt::detail::host_bytes(b);
}

int load(const std::string& how) {
  // A block made before the load: the process's own default names move on.
  ml::make_layer<Block>(8)(mt::normal({1, 8}));
  std::shared_ptr<mt::Model> model = mt::load_model(kModel);
  const mt::SafetensorsFile data = mt::load_safetensors(kData);
  const bool same = same_bits(model->predict(data.at("x")), data.at("y"));
  std::printf("%s: %s loaded (compiled: %s); predictions %s\n", how.c_str(), kModel,
              model->compiled() ? "yes" : "no", same ? "the same bits" : "DIFFER");
  return same && model->compiled() ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--load") return load("a new process");

  mt::manual_seed(5);
  auto first = ml::make_layer<Block>(8);  // made first, called second
  auto second = ml::make_layer<Block>(8);
  auto in = ml::Input({8}, {.name = "features"});
  auto out = ml::Dense(3, {.name = "logits"})(first(second(in)));
  mt::Model model(in, out, {.name = "two_blocks"});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mt::optim::Adam({.learning_rate = 0.01}),
                 .metrics = {"accuracy"}});
  const mt::Tensor x = mt::normal({64, 8});
  const mt::Tensor y = mt::cast(mt::uniform({64}, 0.0, 3.0), mt::kInt64);
  model.fit(x, y, {.batch_size = 16, .epochs = 2, .verbose = 0});

  for (const auto& w : mt::layers::weight_paths(model))
    std::printf("%-24s %s\n", w.path.c_str(), w.variable.shape().str().c_str());
  model.save(kModel);
  mt::save_safetensors(kData, {{"x", x}, {"y", model.predict(x)}});
  return load("the same process");
}
