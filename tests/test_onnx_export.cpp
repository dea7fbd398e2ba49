// export_onnx's refusals and its file handling (mixtape/onnx/export.h). What the exported
// graphs compute is checked against independent runtimes by the CTest onnx.layers and
// onnx.apps (tests/onnx/).
#include <signal.h>
#include <sys/resource.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "error_of.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using mixtape_test::error_of;
using mixtape_test::TempDir;

namespace {

// A layer of a user's own: y = x * factor.
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

std::shared_ptr<mt::Model> model_with(const ml::LayerPtr<ml::Layer>& middle) {
  auto x = ml::Input({4}, {.name = "x"});
  auto y = ml::Dense(3, {.name = "out"})(middle(ml::Dense(4)(x)));
  return std::make_shared<mt::Model>(x, y);
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

TEST_CASE("export_onnx writes a file a protobuf reader can take, named after the model", "[onnx]") {
  TempDir dir("mixtape-onnx");
  ml::reset_default_names();  // "dense/kernel" below, whichever cases ran before in this process
  auto model = model_with(ml::Activation("relu"));
  mt::export_onnx(*model, dir.file("m.onnx"));
  const std::string bytes = read_all(dir.file("m.onnx"));
  REQUIRE(bytes.size() > 4 * 4 * 4);                           // the kernels are in it
  CHECK(bytes.find("mixtape") != std::string::npos);           // producer_name
  CHECK(bytes.find("dense/kernel") != std::string::npos);      // an initializer's name
  CHECK(dir.entries() == std::vector<std::string>{"m.onnx"});  // no temporary left
}

TEST_CASE("export_onnx refuses a Sequential that is not built", "[onnx]") {
  TempDir dir("mixtape-onnx");
  mt::Sequential seq({ml::Dense(2)}, {.name = "unbuilt"});
  const std::string msg =
      error_of<mt::ValueError>([&] { mt::export_onnx(seq, dir.file("s.onnx")); });
  CHECK_THAT(msg, Catch::Contains("model 'unbuilt' is not built"));
  CHECK_THAT(msg, Catch::Contains("build_for"));
  CHECK(dir.entries().empty());
}

TEST_CASE("export_onnx names a layer without an ONNX form; an exporter of one's own works",
          "[onnx]") {
  TempDir dir("mixtape-onnx");
  auto model = model_with(ml::make_layer<Scale>(2.5, ml::LayerOptions{.name = "scale"}));
  // A file already at the path stays as it was when the export fails.
  std::ofstream(dir.file("m.onnx")) << "earlier";
  if (!mt::has_onnx_exporter("Scale")) {
    const std::string msg =
        error_of<mt::ValueError>([&] { mt::export_onnx(*model, dir.file("m.onnx")); });
    CHECK_THAT(msg, Catch::Contains("layer 'scale' (class Scale) has no ONNX form"));
    CHECK_THAT(msg, Catch::Contains("register_onnx_exporter"));
    CHECK(read_all(dir.file("m.onnx")) == "earlier");
    CHECK(dir.entries() == std::vector<std::string>{"m.onnx"});
  }

  // An exporter that gives the wrong dtype is caught before anything is written.
  mt::register_onnx_exporter("Scale", [](mt::OnnxGraph& g, const mt::OnnxLayerCall& c) {
    return std::vector<mt::OnnxValue>{g.cast(c.inputs[0], mt::kFloat64)};
  });
  const std::string msg =
      error_of<mt::ValueError>([&] { mt::export_onnx(*model, dir.file("m.onnx")); });
  CHECK_THAT(msg,
             Catch::Contains("its exporter gave output 0 in float64; the layer returns float32"));
  CHECK(read_all(dir.file("m.onnx")) == "earlier");

  // So is one that uses an op ONNX does not have, or feeds it what its schema refuses.
  mt::register_onnx_exporter("Scale", [](mt::OnnxGraph& g, const mt::OnnxLayerCall& c) {
    return std::vector<mt::OnnxValue>{g.op("Scale", {c.inputs[0]}, c.compute_dtype)};
  });
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::export_onnx(*model, dir.file("m.onnx")); }),
             Catch::Contains("ONNX has no operator 'Scale' at opset 17"));
  mt::register_onnx_exporter("Scale", [](mt::OnnxGraph& g, const mt::OnnxLayerCall& c) {
    return std::vector<mt::OnnxValue>{
        g.op("Mul", {c.inputs[0], g.ints({2}, "two")}, c.compute_dtype)};
  });
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::export_onnx(*model, dir.file("m.onnx")); }),
             Catch::Contains("fails ONNX's checks"));
  CHECK(read_all(dir.file("m.onnx")) == "earlier");

  // A right one: the file is replaced.
  mt::register_onnx_exporter("Scale", [](mt::OnnxGraph& g, const mt::OnnxLayerCall& c) {
    const double factor = dynamic_cast<const Scale&>(c.layer).factor();
    const mt::OnnxValue f = g.constant(mt::full({}, factor, c.compute_dtype), "factor");
    return std::vector<mt::OnnxValue>{g.op("Mul", {c.inputs[0], f}, c.compute_dtype)};
  });
  CHECK(mt::has_onnx_exporter("Scale"));
  mt::export_onnx(*model, dir.file("m.onnx"));
  CHECK(read_all(dir.file("m.onnx")).find("scale/factor") != std::string::npos);
}

TEST_CASE("export_onnx into a missing directory or onto a full disk: IOError, no file", "[onnx]") {
  TempDir dir("mixtape-onnx");
  auto model = model_with(ml::Dropout(0.5));
  const std::string missing = dir.file("no/such/dir/m.onnx");
  const std::string msg = error_of<mt::IOError>([&] { mt::export_onnx(*model, missing); });
  CHECK_THAT(msg, Catch::Contains("export_onnx: cannot write '" + missing + "'"));
  CHECK_THAT(msg, Catch::Contains("No such file or directory"));
  CHECK(dir.entries().empty());

  // A full disk, as a file size limit makes it: the write fails part way.
  std::ofstream(dir.file("m.onnx")) << "earlier";
  struct rlimit old {};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  struct rlimit small = old;
  small.rlim_cur = 64;
  auto* previous = ::signal(SIGXFSZ, SIG_IGN);
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  std::string full;
  try {
    mt::export_onnx(*model, dir.file("m.onnx"));
  } catch (const mt::IOError& e) {
    full = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, previous);
  CHECK_THAT(full, Catch::Contains("export_onnx: cannot write"));
  CHECK_THAT(full, Catch::Contains("File too large"));
  CHECK(read_all(dir.file("m.onnx")) == "earlier");
  CHECK(dir.entries() == std::vector<std::string>{"m.onnx"});
}

TEST_CASE("export_onnx under a mixed policy: casts where the layers cast; float32 on request",
          "[onnx]") {
  TempDir dir("mixtape-onnx");
  mt::PolicyScope scope{mt::Policy("mixed_float16")};
  auto x = ml::Input({4}, {.name = "x"});
  auto y = ml::Activation("linear", {.dtype = "float32", .name = "y"})(ml::Dense(3)(x));
  mt::Model model(x, y);
  mt::export_onnx(model, dir.file("mixed.onnx"));
  mt::export_onnx(model, dir.file("f32.onnx"), {.float32 = true});
  const std::string mixed = read_all(dir.file("mixed.onnx"));
  const std::string f32 = read_all(dir.file("f32.onnx"));
  // Cast nodes (to float16 and back) in the first, none in the second.
  CHECK(mixed.find("Cast") != std::string::npos);
  CHECK(f32.find("Cast") == std::string::npos);

  // float16 variables too become float32 initializers: still no Cast.
  mt::PolicyScope half{mt::Policy("float16")};
  auto x16 = ml::Input({4}, {.name = "x"});
  mt::Model model16(x16, ml::Dense(3)(x16));
  mt::export_onnx(model16, dir.file("f16as32.onnx"), {.float32 = true});
  CHECK(read_all(dir.file("f16as32.onnx")).find("Cast") == std::string::npos);
  CHECK(std::filesystem::file_size(dir.file("f16as32.onnx")) > (4 * 3 + 3) * 4);
}
