// Hardening of model files and safetensors reads (issue 40): files that are not regular
// files are refused before anything is read (a FIFO without a writer must not hang the
// load), architectures nested without bound are refused before they recurse, a BOOL byte
// above 1 is refused by the reader itself, and load_model keeps the type of an error.
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>

#include "error_of.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using Catch::Matchers::Contains;
using mixtape_test::error_of;
using mixtape_test::TempDir;

namespace {

// f()'s error message, or a failed test (and the end of the process) when it does not end
// within `seconds`: a read that waits for a writer forever must fail the test, not hang it.
template <typename F>
std::string error_within(int seconds, F f) {
  struct Shared {
    std::mutex m;
    std::condition_variable cv;
    bool done = false;
    std::string message;
  };
  auto shared = std::make_shared<Shared>();
  std::thread([shared, f] {
    std::string message = "(no error)";
    try {
      f();
    } catch (const std::exception& e) {
      message = e.what();
    }
    std::lock_guard<std::mutex> lock(shared->m);
    shared->message = message;
    shared->done = true;
    shared->cv.notify_one();
  }).detach();
  std::unique_lock<std::mutex> lock(shared->m);
  if (!shared->cv.wait_for(lock, std::chrono::seconds(seconds), [&] { return shared->done; })) {
    FAIL_CHECK("still waiting after " << seconds << " s: the read hangs");
    std::_Exit(1);  // the blocked thread cannot be joined
  }
  return shared->message;
}

// A file of Model::save's format holding `architecture` (and no weights).
std::string model_file(const TempDir& dir, const std::string& name,
                       const std::string& architecture) {
  const std::string path = (dir.path() / name).string();
  mt::save_safetensors(path, {},
                       {{"architecture", architecture}, {"model_format", "mixtape-model-1"}});
  return path;
}

}  // namespace

TEST_CASE("hardening files: a FIFO, a directory, a device are refused before any read",
          "[hardening-files]") {
  TempDir dir;
  const std::string fifo = (dir.path() / "pipe.safetensors").string();
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  CHECK_THAT(error_within(20, [&] { mt::load_safetensors(fifo); }),
             Contains(fifo) && Contains("a FIFO (named pipe), not a regular file"));
  CHECK_THAT(error_within(20, [&] { mt::load_model(fifo); }), Contains("a FIFO"));
  auto model = std::make_shared<mt::Sequential>(std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(2)},
                                                mt::ModelOptions{});
  model->build_for({-1, 3});
  CHECK_THAT(error_within(20, [&] { mt::load_weights(*model, fifo); }), Contains("a FIFO"));
  CHECK_THAT(error_of<mt::IOError>([&] { mt::load_safetensors(dir.path().string()); }),
             Contains("a directory, not a regular file"));
  CHECK_THAT(error_of<mt::IOError>([&] { mt::load_safetensors("/dev/null"); }),
             Contains("a character device"));
}

TEST_CASE("hardening files: architectures nested without bound are refused, not recursed",
          "[hardening-files]") {
  TempDir dir;
  // A Sequential inside a Sequential, 100,000 deep.
  std::string deep;
  const int n = 100000;
  for (int i = 0; i < n; ++i)
    deep += R"({"class_name":"Sequential","config":{"name":"s)" + std::to_string(i) +
            R"(","trainable":true,"dtype":"float32"},"layers":[)";
  for (int i = 0; i < n; ++i) deep += "]}";
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(model_file(dir, "deep.st", deep)); }),
             Contains("nests deeper than 256 levels"));
  // A layer name that is an array nested 100,000 deep.
  std::string name(n, '[');
  name += std::string(n, ']');
  const std::string named =
      R"({"class_name":"Sequential","config":{"name":"m"},"layers":[{"class_name":"Dense","config":{"name":)" +
      name + R"(,"units":2}}]})";
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(model_file(dir, "name.st", named)); }),
             Contains("nests deeper than 256 levels"));
  // A few levels of nesting still load.
  auto inner = std::make_shared<mt::Sequential>(std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(2)},
                                                mt::ModelOptions{.name = "inner"});
  mt::Sequential outer({ml::LayerPtr<mt::Sequential>(inner)}, {.name = "outer"});
  outer.build_for({-1, 3});
  const std::string ok = (dir.path() / "ok.safetensors").string();
  outer.save(ok);
  CHECK(mt::load_model(ok)->count_params() == outer.count_params());
}

TEST_CASE("hardening files: load_safetensors refuses a BOOL byte above 1 by name",
          "[hardening-files]") {
  TempDir dir;
  const std::string path = (dir.path() / "flags.safetensors").string();
  mt::Tensor flags = mt::Tensor::empty({3}, mt::kBool);
  const std::uint8_t raw[3] = {0, 1, 2};
  std::memcpy(flags.data_ptr(), raw, sizeof raw);
  mt::save_safetensors(path, {{"flags", flags}});
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_safetensors(path); }),
             Contains(path) && Contains("BOOL tensor 'flags' holds the byte 2 at flat position 2"));
}

TEST_CASE("hardening files: load_model keeps the type of an error", "[hardening-files]") {
  TempDir dir;
  // A Reshape that cannot take its input: a ShapeError, named by the file.
  const std::string arch =
      R"({"class_name":"Sequential","config":{"name":"m","trainable":true,"dtype":"float32"},)"
      R"("layers":[{"class_name":"Reshape","config":{"name":"r","trainable":true,"dtype":"float32",)"
      R"("target_shape":[5]}}],"build_input_shape":[-1,4]})";
  const std::string path = model_file(dir, "shape.st", arch);
  CHECK_THAT(error_of<mt::ShapeError>([&] { mt::load_model(path); }),
             Contains("load_model '" + path + "'") && Contains("cannot reshape"));
}

TEST_CASE("hardening files: an architecture that declares more than the file holds fails first",
          "[hardening-files]") {
  TempDir dir;
  // A small model's file, its Dense declared with 2^26 (then 2^62) units: the load must not
  // allocate the 2 GB (or wrap around) before it finds out.
  mt::Sequential model({ml::Dense(4, {.name = "d"})}, {.name = "m"});
  model.build_for({-1, 8});
  const std::string path = (dir.path() / "small.safetensors").string();
  model.save(path);
  const mt::SafetensorsFile file = mt::load_safetensors(path);
  std::string arch = file.metadata.at("architecture");
  for (const std::string units : {"67108864", "4611686018427387904"}) {
    CAPTURE(units);
    std::string edited = arch;
    const auto at = edited.find("\"units\":4");
    REQUIRE(at != std::string::npos);
    edited.replace(at, 9, "\"units\":" + units);
    std::vector<std::pair<std::string, mt::Tensor>> tensors = file.tensors;
    std::map<std::string, std::string> metadata = file.metadata;
    metadata["architecture"] = edited;
    const std::string bad = (dir.path() / "declares_more.safetensors").string();
    mt::save_safetensors(bad, tensors, metadata);
    CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(bad); }),
               Contains("add_weight 'kernel': float32[8, " + units + "] would take") &&
                   Contains("more than the weights of the file") &&
                   Contains("nothing was allocated"));
  }
  // The file as written loads.
  CHECK(mt::load_model(path)->count_params() == 36);
}
