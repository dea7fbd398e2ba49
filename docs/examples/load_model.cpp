// A whole-model file read without the code that built the model: given a file written by
// Model::save or `mixtape-mnist --save`, load_model makes the model from the architecture in
// the file and loads its weights. Without an argument it writes such a file first (a small
// residual network) and checks that the loaded model predicts exactly what the saved one did.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <filesystem>
#include <string>

namespace mt = mixtape;
namespace ml = mt::layers;

int main(int argc, char** argv) {
  std::string path = argc > 1 ? argv[1] : "";
  mt::Tensor expected;
  const mt::Tensor images = mt::uniform({4, 28, 28});
  if (path.empty()) {
    path = (std::filesystem::temp_directory_path() / "mixtape-load-model-example.safetensors");
    auto in = ml::Input({28, 28}, {.name = "images"});
    auto x = ml::Reshape({28, 28, 1})(in);
    x = ml::Conv2D(8, 3, {.padding = "same", .activation = "relu"})(x);
    auto h = ml::BatchNormalization()(ml::Conv2D(8, 3, {.padding = "same"})(x));
    x = ml::Activation("relu")(ml::Add()({x, h}));
    auto out = ml::Dense(10)(ml::GlobalAveragePooling2D()(x));
    mt::Model model(in, out, {.name = "tiny_resnet"});
    model.save(path);
    expected = model.predict(images);
  }

  std::shared_ptr<mt::Model> model = mt::load_model(path);
  model->summary();
  const mt::Tensor predictions = model->predict(images);
  std::printf("%s: %lld parameters; predictions of shape [%lld, %lld]\n", path.c_str(),
              static_cast<long long>(model->count_params()),
              static_cast<long long>(predictions.dim(0)),
              static_cast<long long>(predictions.dim(1)));
  if (expected.defined()) {
    std::filesystem::remove(path);
    return mt::detail::host_bytes(expected) == mt::detail::host_bytes(predictions) ? 0 : 1;
  }
  return predictions.shape() == mt::Shape{4, 10} ? 0 : 1;
}
