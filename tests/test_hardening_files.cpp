// Hardening of model files and safetensors reads (issue 40): files that are not regular
// files are refused before anything is read (a FIFO without a writer must not hang the
// load), architectures nested without bound are refused before they recurse, a BOOL byte
// above 1 is refused by the reader itself, and load_model keeps the type of an error. A
// weight is allocated once. The tests tagged [.memory_limit] run in a process of their own
// (CTest's hardening.memory_limit) under an address-space limit: what a file declares must
// not be allocated before it is checked, and what does not fit is an OutOfMemoryError.
#include <sys/resource.h>
#include <sys/stat.h>
#include <zlib.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
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

// A Sequential inside a Sequential, n deep.
std::string nested_sequentials(int n) {
  std::string deep;
  for (int i = 0; i < n; ++i)
    deep += R"({"class_name":"Sequential","config":{"name":"s)" + std::to_string(i) +
            R"(","trainable":true,"dtype":"float32"},"layers":[)";
  for (int i = 0; i < n; ++i) deep += "]}";
  return deep;
}

// A model whose Dense layer's name is an array nested n deep.
std::string nested_name(int n) {
  std::string name(static_cast<std::size_t>(n), '[');
  name += std::string(static_cast<std::size_t>(n), ']');
  return R"({"class_name":"Sequential","config":{"name":"m"},"layers":[{"class_name":"Dense","config":{"name":)" +
         name + R"(,"units":2}}]})";
}

// The file of a small model (a Dense of 4 units on 8 inputs: 36 weights) with its
// architecture edited to declare `units` units.
std::string file_declaring_units(const TempDir& dir, const std::string& units) {
  mt::Sequential model({ml::Dense(4, {.name = "d"})}, {.name = "m"});
  model.build_for({-1, 8});
  const std::string path = (dir.path() / "small.safetensors").string();
  model.save(path);
  const mt::SafetensorsFile file = mt::load_safetensors(path);
  std::string edited = file.metadata.at("architecture");
  const auto at = edited.find("\"units\":4");
  REQUIRE(at != std::string::npos);
  edited.replace(at, 9, "\"units\":" + units);
  std::map<std::string, std::string> metadata = file.metadata;
  metadata["architecture"] = edited;
  const std::string bad = (dir.path() / ("units_" + units + ".safetensors")).string();
  mt::save_safetensors(bad, file.tensors, metadata);
  return bad;
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
  // A Sequential inside a Sequential, 100,000 deep; a layer name nested as deep.
  const std::string deep = model_file(dir, "deep.st", nested_sequentials(100000));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(deep); }),
             Contains("nests deeper than 256 levels"));
  const std::string named = model_file(dir, "name.st", nested_name(100000));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(named); }),
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
  for (const std::string units : {"67108864", "4611686018427387904"}) {
    CAPTURE(units);
    const std::string bad = file_declaring_units(dir, units);
    CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(bad); }),
               Contains("add_weight 'kernel': float32[8, " + units + "] would take") &&
                   Contains("more than the weights of the file") &&
                   Contains("nothing was allocated"));
  }
  // 2^63 does not fit the config's integers: named as it is, not wrapped to -2^63.
  CHECK_THAT(error_of<mt::ValueError>(
                 [&] { mt::load_model(file_declaring_units(dir, "9223372036854775808")); }),
             Contains("'units' is 9223372036854775808, beyond the largest integer a config "
                      "holds (9223372036854775807)"));
  // The file as written loads.
  const std::string path = (dir.path() / "small.safetensors").string();
  CHECK(mt::load_model(path)->count_params() == 36);
}

TEST_CASE("hardening files: a variable takes over an initial value nothing else holds",
          "[hardening-files]") {
  // A tensor of its own storage, given away: the variable holds the same memory.
  mt::Tensor fresh = mt::Tensor::empty({3, 4}, mt::kFloat32);
  const void* memory = fresh.data_ptr();
  const mt::Variable taken(std::move(fresh), "taken");
  CHECK(taken.data_ptr() == memory);
  // Anything still seen elsewhere is copied: a tensor kept by the caller, a view, a variable.
  const mt::Tensor kept = mt::ones({3, 4});
  mt::Variable copied(mt::Tensor(kept), "copied");
  CHECK(copied.data_ptr() != kept.data_ptr());
  copied.assign(mt::zeros({3, 4}));
  CHECK(kept.data<float>()[0] == 1.0f);
  const mt::Tensor base = mt::ones({6, 4});
  mt::Tensor view = mt::Tensor::view_of(base, {3, 4}, {4, 1}, 4);
  const mt::Variable from_view(std::move(view), "from_view");
  CHECK(from_view.data_ptr() != base.data_ptr());
  mt::Variable other = copied;
  const mt::Variable from_variable(std::move(other), "from_variable");
  CHECK(from_variable.data_ptr() != copied.data_ptr());
  CHECK(from_variable.name() == "from_variable");
  CHECK(copied.name() == "copied");
}

TEST_CASE("hardening files: add_weight keeps the initializer's tensor", "[hardening-files]") {
  // An initializer that notes where its tensor lives: the weight is that memory, not a copy.
  const void* made = nullptr;
  const mt::init::Initializer noting("noting", [&](const mt::Shape& s, mt::DType dt, mt::Device) {
    mt::Tensor t = mt::Tensor::empty(s, dt);
    std::memset(t.data_ptr(), 0, t.nbytes());
    made = t.data_ptr();
    return t;
  });
  auto dense = ml::Dense(5, {.use_bias = false, .kernel_initializer = noting});
  dense->build(mt::Shape{-1, 7});
  REQUIRE(made != nullptr);
  CHECK(dense->kernel().data_ptr() == made);
}

namespace {

// The process's address space (VmSize) now, in bytes.
std::uint64_t address_space_now() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line))
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) * 1024;
  FAIL("no VmSize in /proc/self/status");
  return 0;
}

// Limits the process's address space to what it uses now plus `headroom` bytes (the soft
// limit only: the next test case sets its own). Sanitizers reserve terabytes of address
// space, so a sanitized build runs these checks without the limit.
void limit_address_space(std::uint64_t headroom) {
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("sanitized build: no address-space limit");
  (void)headroom;
#else
  // The BLAS's buffers and threads exist before the limit is set.
  (void)mt::matmul(mt::ones({64, 64}), mt::ones({64, 64}));
  rlimit limit{};
  REQUIRE(::getrlimit(RLIMIT_AS, &limit) == 0);
  limit.rlim_cur = address_space_now() + headroom;
  REQUIRE(::setrlimit(RLIMIT_AS, &limit) == 0);
#endif
}

constexpr std::uint64_t kMiB = 1 << 20;

}  // namespace

TEST_CASE("memory limit: a weight of 320 MiB is made with 512 MiB to spare", "[.memory_limit]") {
  limit_address_space(512 * kMiB);
  // Initial value, then a copy of it, would need 640 MiB.
  auto dense = ml::Dense(1 << 20, {.use_bias = false});
  dense->build(mt::Shape{-1, 80});
  const mt::Tensor row = dense->kernel().value().slice(0, 0, 1);
  CHECK(mt::max(mt::abs(row)).item<float>() > 0.0f);
}

TEST_CASE("memory limit: architectures that nest or declare too much fail before allocating",
          "[.memory_limit]") {
  TempDir dir;
  const std::string deep = model_file(dir, "deep.st", nested_sequentials(100000));
  const std::string named = model_file(dir, "name.st", nested_name(100000));
  const std::string units_2_26 = file_declaring_units(dir, "67108864");  // 2 GiB of kernel
  const std::string units_2_63 = file_declaring_units(dir, "9223372036854775808");
  limit_address_space(256 * kMiB);
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(deep); }),
             Contains("nests deeper than 256 levels"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(named); }),
             Contains("nests deeper than 256 levels"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(units_2_26); }),
             Contains("more than the weights of the file") && Contains("nothing was allocated"));
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::load_model(units_2_63); }),
             Contains("beyond the largest integer"));
}

TEST_CASE("memory limit: an honest IDX file larger than memory is an OutOfMemoryError",
          "[.memory_limit]") {
  TempDir dir;
  // 768 MiB of zero bytes behind a valid header, gzipped (under a megabyte).
  const std::string path = (dir.path() / "big-idx1-ubyte.gz").string();
  constexpr std::uint32_t kRows = 768, kCols = 1 << 20;
  {
    gzFile out = gzopen(path.c_str(), "wb1");
    REQUIRE(out != nullptr);
    const unsigned char header[] = {
        0, 0, 0x08, 2, 0, 0, kRows >> 8, kRows & 0xFF, 0, static_cast<unsigned char>(kCols >> 16),
        0, 0};
    REQUIRE(gzwrite(out, header, sizeof header) == static_cast<int>(sizeof header));
    const std::vector<unsigned char> zeros(kMiB, 0);
    for (std::uint32_t i = 0; i < kRows * (kCols / kMiB); ++i)
      REQUIRE(gzwrite(out, zeros.data(), static_cast<unsigned>(zeros.size())) ==
              static_cast<int>(zeros.size()));
    REQUIRE(gzclose(out) == Z_OK);
  }
  limit_address_space(512 * kMiB);
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  return;  // without the limit the file would load
#endif
  CHECK_THAT(error_of<mt::OutOfMemoryError>([&] { mt::datasets::read_idx(path); }),
             Contains("read_idx: " + path + ": out of memory holding its data") &&
                 Contains("of the 805306368 bytes promised read, shape [768, 1048576], uint8"));
}
