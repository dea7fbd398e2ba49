// A model with a layer of one's own, exported to ONNX: the layer's exporter writes its nodes.
#include <mixtape/mixtape.h>

#include <cstdio>
#include <filesystem>

namespace mt = mixtape;
namespace ml = mixtape::layers;

// y = x * factor, a layer of one's own (docs/extending.md, "A layer of your own").
class Scale : public ml::Layer {
 public:
  explicit Scale(double factor, ml::LayerOptions options = {})
      : Layer(std::move(options)), factor_(factor) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x * factor_; }
  std::optional<mt::Shape> compute_output_shape(const mt::Shape& s) const override { return s; }
  double factor() const { return factor_; }

 private:
  double factor_;
};

int main() {
  // Its ONNX form: one Mul by a constant, in the dtype the layer computes in. The inputs
  // come already cast to it, as a call casts them.
  mt::register_onnx_exporter("Scale", [](mt::OnnxGraph& g, const mt::OnnxLayerCall& call) {
    const double factor = dynamic_cast<const Scale&>(call.layer).factor();
    const mt::OnnxValue f = g.constant(mt::full({}, factor, call.compute_dtype), "factor");
    return std::vector<mt::OnnxValue>{g.op("Mul", {call.inputs[0], f}, call.compute_dtype)};
  });

  mt::set_global_policy("mixed_bfloat16");
  auto x = ml::Input({784}, {.name = "images"});
  auto h = ml::Dense(64, {.activation = "relu"})(x);
  h = ml::make_layer<Scale>(0.5, ml::LayerOptions{.name = "half"})(h);
  auto y = ml::Dense(10, {.dtype = "float32", .name = "logits"})(h);
  mt::Model model(x, y);

  mt::export_onnx(model, "classifier.onnx");                       // bfloat16 inside
  mt::export_onnx(model, "classifier32.onnx", {.float32 = true});  // float32 throughout
  for (const char* file : {"classifier.onnx", "classifier32.onnx"})
    std::printf("%s: %ju bytes\n", file,
                static_cast<std::uintmax_t>(std::filesystem::file_size(file)));
  return std::filesystem::file_size("classifier.onnx") > 784 * 64 * 4 ? 0 : 1;
}
