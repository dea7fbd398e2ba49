// safetensors files and checkpoints: bit-exact round trips of every dtype, files compared
// byte for byte with layouts written out by hand from the format's description (and read
// in the layout the safetensors library writes), every corruption the reader refuses, the
// atomic write, and model weights and training checkpoints (Adam, and a LossScaleOptimizer
// around RMSprop) that resume bit-identically.
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace mo = mixtape::optim;
namespace fs = std::filesystem;

namespace {

using mixtape_test::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(out.good());
}

// The 8-byte little-endian length.
std::string u64le(std::uint64_t n) {
  std::string out;
  for (int i = 0; i < 8; ++i) out += static_cast<char>((n >> (8 * i)) & 0xFF);
  return out;
}

// A file: the length of `header` (padded with spaces to a multiple of 8 when `pad`), the
// header, then `data`.
std::string file_bytes(std::string header, const std::string& data, bool pad = true) {
  if (pad) header.append((8 - header.size() % 8) % 8, ' ');
  return u64le(header.size()) + header + data;
}

std::string le_f32(float v) {
  std::uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return u64le(bits).substr(0, 4);
}

std::vector<std::uint8_t> bytes_of(const mt::Tensor& t) { return mt::detail::host_bytes(t); }

// A tensor of random bytes (0 or 1 for bool), never all zero.
mt::Tensor random_tensor(const mt::Shape& shape, mt::DType dtype, mt::Generator& gen) {
  mt::Tensor t = mt::Tensor::empty(shape, dtype);
  auto* p = static_cast<std::uint8_t*>(t.data_ptr());
  const std::size_t n = t.nbytes();
  for (std::size_t i = 0; i < n; ++i)
    p[i] = static_cast<std::uint8_t>(dtype == mt::kBool ? gen.next_u64() & 1 : gen.next_u64());
  if (n > 0) p[0] = 1;  // never all zero
  return t;
}

void check_same(const mt::Tensor& got, const mt::Tensor& want) {
  REQUIRE(got.defined());
  CHECK(got.dtype() == want.dtype());
  CHECK(got.shape() == want.shape());
  CHECK(bytes_of(got) == bytes_of(want));
}

// The message of the IOError that loading `bytes` as a file throws.
std::string corrupt_message(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.file("corrupt.safetensors");
  write_file(path, bytes);
  try {
    mt::load_safetensors(path);
  } catch (const mt::IOError& e) {
    const std::string what = e.what();
    CHECK(what.find(path) != std::string::npos);
    CHECK(what.find('\n') == std::string::npos);
    return what;
  }
  FAIL("load_safetensors accepted a corrupt file");
  return {};
}

std::string hex(const std::string& bytes) {
  std::string out;
  for (unsigned char c : bytes) out += fmt::format("{:02x} ", c);
  return out;
}

}  // namespace

// --- safetensors files ----------------------------------------------------------------------

TEST_CASE("safetensors: every dtype round-trips bit-exactly, aligned and sorted", "[safetensors]") {
  TempDir dir;
  mt::Generator gen(7);
  std::vector<std::pair<std::string, mt::Tensor>> tensors;
  for (int i = 0; i < mt::DType::kCount; ++i) {
    const mt::DType dt = mt::DType::all()[i];
    // Odd sizes, so that only the sorting keeps every tensor aligned.
    tensors.emplace_back(fmt::format("t_{}", dt.name()), random_tensor({3, 5}, dt, gen));
    tensors.emplace_back(fmt::format("u_{}", dt.name()), random_tensor({7}, dt, gen));
  }
  const std::string path = dir.file("all.safetensors");
  mt::save_safetensors(path, tensors);
  const mt::SafetensorsFile f = mt::load_safetensors(path);
  REQUIRE(f.tensors.size() == tensors.size());
  CHECK(f.metadata.empty());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    REQUIRE(f.contains(name));
    check_same(f.at(name), t);
    CHECK(f.at(name).device() == mt::Device::cpu());
  }
  // The safetensors library's order: decreasing alignment, then name.
  std::vector<std::string> order;
  for (const auto& [name, t] : f.tensors) order.push_back(name);
  CHECK(order == std::vector<std::string>{
                     "t_int64",         "u_int64",         "t_float64",     "u_float64",
                     "t_float32",       "u_float32",       "t_int32",       "u_int32",
                     "t_bfloat16",      "u_bfloat16",      "t_float16",     "u_float16",
                     "t_float8_e4m3fn", "u_float8_e4m3fn", "t_float8_e5m2", "u_float8_e5m2",
                     "t_uint8",         "u_uint8",         "t_bool",        "u_bool"});
  // The data of every tensor starts at a multiple of its element size in the file.
  const std::string bytes = read_file(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  CHECK(n % 8 == 0);
  std::uint64_t offset = 8 + n;
  for (const auto& [name, t] : f.tensors) {
    CHECK(offset % t.dtype().itemsize() == 0);
    offset += t.nbytes();
  }
  CHECK(offset == bytes.size());
  CHECK_FALSE(f.contains("nope"));
  CHECK_THROWS_AS(f.at("nope"), mt::ValueError);
}

TEST_CASE("safetensors: empty tensors and 0-d scalars", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("empty.safetensors");
  const std::vector<std::pair<std::string, mt::Tensor>> tensors = {
      {"scalar", mt::full({}, 2.5, mt::kFloat64)},   {"none", mt::zeros({0}, mt::kFloat32)},
      {"none_3d", mt::zeros({3, 0, 2}, mt::kInt64)}, {"one", mt::full({1}, 7, mt::kInt32)},
      {"flag", mt::full({}, 1, mt::kBool)},
  };
  mt::save_safetensors(path, tensors);
  const auto f = mt::load_safetensors(path);
  REQUIRE(f.tensors.size() == tensors.size());
  for (const auto& [name, t] : tensors) {
    INFO(name);
    check_same(f.at(name), t);
  }
  CHECK(f.at("scalar").rank() == 0);
  CHECK(f.at("scalar").item<double>() == 2.5);
  CHECK(f.at("none_3d").shape() == mt::Shape({3, 0, 2}));

  // No tensors and no metadata: "{}" and six spaces.
  mt::save_safetensors(path, {});
  CHECK(read_file(path) == u64le(8) + "{}      ");
  const auto empty = mt::load_safetensors(path);
  CHECK(empty.tensors.empty());
  CHECK(empty.metadata.empty());
}

TEST_CASE("safetensors: metadata round-trips, escapes included", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("meta.safetensors");
  const std::map<std::string, std::string> metadata = {
      {"format", "pt"},
      {"quote\"back\\slash/", "line\nbreak\ttab\x01\x1f"},
      {"unicode", "caf\xc3\xa9 \xf0\x9f\x98\x80"},
      {"empty", ""},
  };
  mt::save_safetensors(path, {{"w", mt::ones({2}, mt::kFloat32)}}, metadata);
  const auto f = mt::load_safetensors(path);
  CHECK(f.metadata == metadata);
  // Escaped the way the safetensors library (serde_json) escapes.
  const std::string bytes = read_file(path);
  CHECK(bytes.find(R"("quote\"back\\slash/":"line\nbreak\ttab\u0001\u001f")") != std::string::npos);
  CHECK(bytes.find("\"unicode\":\"caf\xc3\xa9 \xf0\x9f\x98\x80\"") != std::string::npos);
  // Without metadata the header has no "__metadata__".
  mt::save_safetensors(path, {{"w", mt::ones({2}, mt::kFloat32)}});
  CHECK(read_file(path).find("__metadata__") == std::string::npos);
}

TEST_CASE("safetensors: non-contiguous tensors are written in row-major order", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("views.safetensors");
  const mt::Tensor base = mt::arange(0.0, 12.0, 1.0, mt::kFloat32).reshape({3, 4});
  const mt::Tensor transposed = base.transpose();     // [4, 3]
  const mt::Tensor strided = base.slice(1, 0, 4, 2);  // [3, 2]
  const mt::Tensor expanded = mt::arange(3).expand({2, 3});
  REQUIRE_FALSE(transposed.is_contiguous());
  REQUIRE_FALSE(strided.is_contiguous());
  mt::save_safetensors(path, {{"t", transposed}, {"s", strided}, {"e", expanded}});
  const auto f = mt::load_safetensors(path);
  CHECK(f.at("t").to_vector<float>() == std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11});
  CHECK(f.at("s").to_vector<float>() == std::vector<float>{0, 2, 4, 6, 8, 10});
  CHECK(f.at("e").to_vector<std::int64_t>() == std::vector<std::int64_t>{0, 1, 2, 0, 1, 2});
  check_same(f.at("t"), transposed.contiguous());
}

TEST_CASE("safetensors: a tiny file matches the format byte for byte", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("tiny.safetensors");
  // Saved in the order b, a: written a (F32 sorts before I32), then b.
  mt::save_safetensors(
      path,
      {{"b", mt::from_vector<std::int32_t>({7, -1}, {2})}, {"a", mt::full({}, 1.5, mt::kFloat32)}},
      {{"k", "v"}});
  // 132 bytes of JSON + 4 spaces = 136 = 0x88.
  const std::string json = R"({"__metadata__":{"k":"v"},)"
                           R"("a":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
                           R"("b":{"dtype":"I32","shape":[2],"data_offsets":[4,12]}})";
  REQUIRE(json.size() == 132);
  const std::string expected = std::string("\x88\0\0\0\0\0\0\0", 8) + json + "    " +
                               std::string("\x00\x00\xc0\x3f", 4) +  // 1.5f
                               std::string("\x07\x00\x00\x00", 4) +  // 7
                               std::string("\xff\xff\xff\xff", 4);   // -1
  const std::string got = read_file(path);
  INFO("got      " << hex(got) << "\nexpected " << hex(expected));
  CHECK(got == expected);

  // A header of exactly 64 bytes takes no padding: 1x2x3 float32 values 0..5.
  mt::save_safetensors(path, {{"attn.0", mt::arange(0.0, 6.0, 1.0).reshape({1, 2, 3})}});
  const std::string json64 = R"({"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}})";
  REQUIRE(json64.size() == 64);
  std::string expected64 = std::string("\x40\0\0\0\0\0\0\0", 8) + json64;
  for (float v : {0.f, 1.f, 2.f, 3.f, 4.f, 5.f}) expected64 += le_f32(v);
  CHECK(read_file(path) == expected64);
}

TEST_CASE("safetensors: files in the safetensors library's layout are read", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("python.safetensors");
  // What safetensors.numpy.save_file({"a": np.array([1, 2], np.float32)}) writes: compact
  // JSON, two spaces of padding (54 -> 56 bytes), then the data.
  const std::string json = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  REQUIRE(json.size() == 54);
  write_file(path, std::string("\x38\0\0\0\0\0\0\0", 8) + json + "  " + le_f32(1) + le_f32(2));
  auto f = mt::load_safetensors(path);
  REQUIRE(f.tensors.size() == 1);
  CHECK(f.at("a").dtype() == mt::kFloat32);
  CHECK(f.at("a").shape() == mt::Shape({2}));
  CHECK(f.at("a").to_vector<float>() == std::vector<float>{1, 2});

  // Metadata, a header whose keys are not in data order, whitespace between tokens, and
  // the escapes of JSON (\u escapes, a surrogate pair, \/).
  const std::string json2 =
      "{ \"z\" : {\"dtype\": \"I64\", \"shape\": [1], \"data_offsets\": [0, 8]},\n"
      "  \"__metadata__\": {\"format\": \"pt\", \"n\\u00e9\\/x\": \"\\ud83d\\ude00\"},\n"
      "  \"b\": {\"data_offsets\": [8, 10], \"shape\": [], \"dtype\": \"BF16\"}\t}";
  write_file(path, file_bytes(json2, u64le(42) + std::string("\x80\x3f", 2)));
  f = mt::load_safetensors(path);
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].first == "z");  // data order
  CHECK(f.at("z").item<std::int64_t>() == 42);
  CHECK(f.at("b").dtype() == mt::kBFloat16);
  CHECK(f.at("b").item<float>() == 1.0f);
  CHECK(f.metadata ==
        std::map<std::string, std::string>{{"format", "pt"}, {"n\xc3\xa9/x", "\xf0\x9f\x98\x80"}});
}

TEST_CASE("safetensors: corrupt files are refused with the file and the problem", "[safetensors]") {
  TempDir dir;
  const std::string a8 = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\x01');
  // The well-formed file these corruptions start from.
  write_file(dir.file("ok.safetensors"), file_bytes(a8, data8));
  CHECK_NOTHROW(mt::load_safetensors(dir.file("ok.safetensors")));

  auto has = [&](const std::string& bytes, const std::string& what) {
    const std::string message = corrupt_message(dir, bytes);
    INFO(message);
    CHECK(message.find(what) != std::string::npos);
  };
  // The header length.
  has("", "too short for the 8-byte header length");
  has(std::string("\x08\0\0", 3), "too short for the 8-byte header length");
  has(u64le(1000) + "{}      ", "header length 1000 runs past the end of the file");
  has(u64le(std::numeric_limits<std::uint64_t>::max()) + "{}      ", "runs past the end");
  has(u64le(0), "expected '{'");
  // Malformed JSON.
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", data8),
      "malformed header JSON");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},})", data8),
      "malformed header JSON");
  has(file_bytes(R"([1, 2])", ""), "expected '{' (the header must be a JSON object)");
  has(file_bytes(R"({"a":1})", ""), "expected an object for tensor 'a'");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", data8),
      "must be an integer");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8),
      "non-negative integer");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[02],"data_offsets":[0,8]}})", data8),
      "leading zero");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}})",
                 data8),
      "does not fit in 64 bits");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":true,"data_offsets":[0,8]}})", data8),
      "expected the shape of tensor 'a'");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":{}}})", data8),
      "unknown key 'x'");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2]}})", ""), "lacks \"data_offsets\"");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,9]}})", data8),
      "must be [begin, end]");
  has(file_bytes(R"({"__metadata__":{"k":1}})", ""), "the value of metadata key 'k' (a string)");
  has(file_bytes(R"({"__metadata__":{"k":{"nested":"x"}}})", ""), "(a string)");
  has(file_bytes(R"({"__metadata__":"x"})", ""), "an object of strings");
  has(file_bytes(R"({"a\q":{}})", ""), "unknown escape");
  has(file_bytes(R"({"\udc00":{}})", ""), "lone low surrogate");
  has(file_bytes(R"({"\ud800x":{}})", ""), "without its low half");
  has(file_bytes(R"({"\u12G4":{}})", ""), "four hex digits");
  has(file_bytes("{\"a\tb\":{}}", ""), "control character 0x09");
  has(file_bytes("{\"\xff\":{}}", ""), "not valid UTF-8");
  has(file_bytes(R"({} {})", ""), "unexpected characters after the header object");
  has(file_bytes(a8 + "x", data8), "unexpected characters");
  // Unknown dtypes.
  has(file_bytes(R"({"a":{"dtype":"I8","shape":[2],"data_offsets":[0,2]}})", "\x01\x02"),
      "tensor 'a' has the unknown dtype 'I8'");
  has(file_bytes(R"({"a":{"dtype":"float32","shape":[2],"data_offsets":[0,8]}})", data8),
      "unknown dtype 'float32'");
  // Offsets that do not fit the shape.
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,12]}})",
                 std::string(12, '\x01')),
      "tensor 'a' of dtype F32 and shape [2] needs 8 bytes but its data_offsets [0, 12] span 12");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[],"data_offsets":[8,4]}})", data8),
      "which end before they begin");
  // Overlaps and holes.
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 std::string(12, '\x01')),
      "tensors 'a' (data_offsets [0, 8]) and 'b' (data_offsets [4, 12]) overlap");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                 data8),
      "overlap");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})",
                 std::string(20, '\x01')),
      "a hole of 4 bytes between tensors 'a' (data_offsets [0, 8]) and 'b'");
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                 std::string(12, '\x01')),
      "a hole of 4 bytes before the first tensor 'a'");
  // The data section.
  has(file_bytes(a8, std::string(4, '\x01')),
      "the data is truncated: the tensors need 8 bytes after the header but the file holds 4");
  has(file_bytes(a8, std::string(12, '\x01')), "4 bytes follow the end of the last tensor");
  // Names given twice.
  has(file_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                 R"("a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                 std::string(16, '\x01')),
      "tensor name 'a' appears twice");
  has(file_bytes(R"({"__metadata__":{},"__metadata__":{}})", ""), "\"__metadata__\" appears twice");
  has(file_bytes(R"({"__metadata__":{"k":"1","k":"2"}})", ""), "metadata key 'k' appears twice");
  has(file_bytes(R"({"a":{"dtype":"F32","dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data8),
      "has the key 'dtype' twice");

  // Unreadable paths: IOError naming the path and the reason.
  const std::string missing = dir.file("missing.safetensors");
  try {
    mt::load_safetensors(missing);
    FAIL("no error for a missing file");
  } catch (const mt::IOError& e) {
    CHECK(std::string(e.what()).find(missing) != std::string::npos);
    CHECK(std::string(e.what()).find("No such file or directory") != std::string::npos);
  }
  fs::create_directory(dir.file("a_directory"));
  CHECK_THROWS_AS(mt::load_safetensors(dir.file("a_directory")), mt::IOError);
}

TEST_CASE("safetensors: saving is atomic and refuses what it cannot encode", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("model.safetensors");
  const mt::Tensor w = mt::arange(0.0, 4.0, 1.0);
  mt::save_safetensors(path, {{"w", w}});
  const std::string good = read_file(path);
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});  // no temporary left

  // A failed save leaves the file that was there untouched and no temporary file.
  auto check_untouched = [&] {
    CHECK(read_file(path) == good);
    CHECK(dir.entries() == std::vector<std::string>{"model.safetensors"});
  };
  CHECK_THROWS_AS(mt::save_safetensors(path, {{"bad\xff", w}}), mt::ValueError);
  check_untouched();
  CHECK_THROWS_AS(mt::save_safetensors(path, {{"w", w}}, {{"k", "\xc3("}}), mt::ValueError);
  check_untouched();
  CHECK_THROWS_AS(mt::save_safetensors(path, {{"w", w}, {"w", w}}), mt::ValueError);
  check_untouched();
  CHECK_THROWS_AS(mt::save_safetensors(path, {{"__metadata__", w}}), mt::ValueError);
  check_untouched();
  CHECK_THROWS_AS(mt::save_safetensors(path, {{"u", mt::Tensor()}}), mt::ValueError);
  check_untouched();

  // A directory that does not exist: IOError naming the path and the reason.
  const std::string nowhere = dir.file("no/such/dir/model.safetensors");
  try {
    mt::save_safetensors(nowhere, {{"w", w}});
    FAIL("no error for a missing directory");
  } catch (const mt::IOError& e) {
    CHECK(std::string(e.what()).find(nowhere) != std::string::npos);
    CHECK(std::string(e.what()).find("No such file or directory") != std::string::npos);
  }
  check_untouched();

  // A save whose final rename fails (the path is a directory) removes its temporary file
  // and leaves the directory as it was.
  const std::string taken = dir.file("taken");
  fs::create_directory(taken);
  write_file(dir.file("taken/inside"), "x");
  CHECK_THROWS_AS(mt::save_safetensors(taken, {{"w", w}}), mt::IOError);
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors", "taken"});
  CHECK(read_file(dir.file("taken/inside")) == "x");

  // A successful save replaces the file whole.
  mt::save_safetensors(path, {{"v", mt::ones({3}, mt::kInt32)}});
  CHECK(dir.entries() == std::vector<std::string>{"model.safetensors", "taken"});
  const auto f = mt::load_safetensors(path);
  CHECK_FALSE(f.contains("w"));
  CHECK(f.at("v").to_vector<int>() == std::vector<int>{1, 1, 1});
}

// --- Checkpoints -----------------------------------------------------------------------------

namespace {

// A small MLP with fixed layer names, built on an input of 3 features; `seed` sets its
// initial weights.
std::unique_ptr<mt::Sequential> make_model(std::uint64_t seed, std::int64_t hidden = 4,
                                           const std::string& out_name = "out",
                                           mt::DType out_dtype = mt::kFloat32) {
  mt::manual_seed(seed);
  auto model =
      std::make_unique<mt::Sequential>(std::vector<mt::layers::LayerPtr<mt::layers::Layer>>{
          mt::layers::Dense(hidden, {.activation = "relu", .name = "hidden"}),
          mt::layers::Dense(
              2, {.dtype = mt::Policy(std::string(out_dtype.name())), .name = out_name})});
  (*model)(mt::zeros({1, 3}));
  return model;
}

std::vector<std::vector<std::uint8_t>> weight_bytes(const mt::layers::Layer& model) {
  std::vector<std::vector<std::uint8_t>> out;
  for (const auto& w : model.weights()) out.push_back(bytes_of(w));
  return out;
}

struct Batch {
  mt::Tensor x, y;
};

Batch make_batch() {
  mt::Generator gen(11);
  return {mt::normal({8, 3}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen),
          mt::normal({8, 2}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen)};
}

std::vector<mt::Tensor> gradients(mt::Sequential& model, const Batch& b) {
  mt::GradientTape tape;
  const mt::Tensor loss = mt::losses::MeanSquaredError()(b.y, model(b.x, {.training = true}));
  return tape.gradient(loss, model.trainable_variables());
}

void step(mt::Sequential& model, mo::Optimizer& opt, const Batch& b) {
  opt.apply_gradients(gradients(model, b), model.trainable_variables());
}

void lso_step(mt::Sequential& model, mo::LossScaleOptimizer& opt, const Batch& b) {
  mt::GradientTape tape;
  const mt::Tensor loss = mt::losses::MeanSquaredError()(b.y, model(b.x, {.training = true}));
  auto grads = tape.gradient(opt.get_scaled_loss(loss), model.trainable_variables());
  opt.apply_gradients(opt.get_unscaled_gradients(grads), model.trainable_variables());
}

// The optimizer's state as bytes, slot by slot.
std::map<std::string, std::vector<std::uint8_t>> slot_bytes(const mo::Optimizer& opt,
                                                            const mt::layers::Layer& model) {
  std::map<std::string, std::vector<std::uint8_t>> out;
  for (const auto& [name, t] : opt.state(model.trainable_variables()).tensors)
    out[name] = bytes_of(t);
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const mt::ValueError& e) {
    return e.what();
  }
  return "(no ValueError)";
}

}  // namespace

TEST_CASE("safetensors: save_weights and load_weights restore a model exactly", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("weights.safetensors");
  const Batch b = make_batch();
  auto a = make_model(1);
  auto fresh = make_model(2);
  REQUIRE(bytes_of((*a)(b.x)) != bytes_of((*fresh)(b.x)));
  mt::save_weights(*a, path, {{"note", "mlp"}});

  const auto f = mt::load_safetensors(path);
  std::vector<std::string> names;
  for (const auto& [name, t] : f.tensors) names.push_back(name);
  std::sort(names.begin(), names.end());
  CHECK(names ==
        std::vector<std::string>{"hidden/bias", "hidden/kernel", "out/bias", "out/kernel"});
  // The caller's metadata, and that the tensors are named by weight paths.
  CHECK(f.metadata ==
        std::map<std::string, std::string>{{"note", "mlp"}, {"weight_keys", mt::kWeightKeys}});

  mt::load_weights(*fresh, path);
  CHECK(weight_bytes(*fresh) == weight_bytes(*a));
  CHECK(bytes_of((*fresh)(b.x)) == bytes_of((*a)(b.x)));

  // Models of another architecture are refused, naming the tensor, and keep their weights.
  auto wider = make_model(3, 5);
  auto before = weight_bytes(*wider);
  CHECK(error_of([&] { mt::load_weights(*wider, path); }) ==
        fmt::format("checkpoint '{}': tensor 'hidden/kernel' has shape [3, 4] in the file but "
                    "[3, 5] in the model",
                    path));
  CHECK(weight_bytes(*wider) == before);

  auto renamed = make_model(3, 4, "head");
  before = weight_bytes(*renamed);
  CHECK(error_of([&] {
          mt::load_weights(*renamed, path);
        }).find("tensor 'head/kernel' (the weight 'head/kernel' of the model) is missing") !=
        std::string::npos);
  CHECK(weight_bytes(*renamed) == before);

  auto float64 = make_model(3, 4, "out", mt::kFloat64);
  before = weight_bytes(*float64);
  CHECK(error_of([&] {
          mt::load_weights(*float64, path);
        }).find("tensor 'out/kernel' has dtype float32 in the file but float64 in the model") !=
        std::string::npos);
  CHECK(weight_bytes(*float64) == before);

  // A file with weights the model lacks.
  std::vector<std::pair<std::string, mt::Tensor>> extra;
  for (const auto& w : a->weights()) extra.emplace_back(w.name(), w);
  extra.emplace_back("other/kernel", a->weights()[0]);
  mt::save_safetensors(dir.file("extra.safetensors"), extra);
  auto other = make_model(4);
  before = weight_bytes(*other);
  CHECK(error_of([&] {
          mt::load_weights(*other, dir.file("extra.safetensors"));
        }).find("tensor 'other/kernel' in the file is not a weight of the model") !=
        std::string::npos);
  CHECK(weight_bytes(*other) == before);

  // A model that is not built yet has no weights to load into.
  mt::Sequential unbuilt({mt::layers::Dense(4, {.name = "hidden"})});
  CHECK(error_of([&] { mt::load_weights(unbuilt, path); }).find("has no weights yet") !=
        std::string::npos);
  // A corrupt or missing file is an IOError.
  CHECK_THROWS_AS(mt::load_weights(*fresh, dir.file("missing.safetensors")), mt::IOError);
}

TEST_CASE("safetensors: a checkpoint with Adam resumes bit-identically", "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  const Batch b = make_batch();
  auto a = make_model(1);
  mo::Adam opt_a({.learning_rate = 0.01});
  for (int i = 0; i < 3; ++i) step(*a, opt_a, b);
  mt::save_checkpoint(path, *a, opt_a, {.epoch = 3, .metadata = {{"run", "adam test"}}});
  const auto saved_weights = weight_bytes(*a);
  const auto saved_slots = slot_bytes(opt_a, *a);
  REQUIRE(saved_slots.size() == 8);  // m and v of four variables

  // The file's layout.
  const auto f = mt::load_safetensors(path);
  CHECK(f.contains("model/hidden/kernel"));
  CHECK(f.contains("optimizer/hidden/kernel/m"));
  CHECK(f.contains("optimizer/out/bias/v"));
  CHECK(f.metadata.at("format") == "mixtape-checkpoint-1");
  CHECK(f.metadata.at("epoch") == "3");
  CHECK(f.metadata.at("optimizer") == "Adam");
  CHECK(f.metadata.at("iterations") == "3");
  CHECK(f.metadata.at("run") == "adam test");

  step(*a, opt_a, b);  // the step without a save and load

  auto resumed = make_model(2);
  mo::Adam opt_r({.learning_rate = 0.01});
  const mt::TrainingCheckpoint info = mt::load_checkpoint(path, *resumed, opt_r);
  CHECK(info.epoch == 3);
  CHECK(info.metadata == std::map<std::string, std::string>{{"run", "adam test"}});
  CHECK(weight_bytes(*resumed) == saved_weights);
  CHECK(slot_bytes(opt_r, *resumed) == saved_slots);
  CHECK(opt_r.iterations() == 3);

  step(*resumed, opt_r, b);
  CHECK(weight_bytes(*resumed) == weight_bytes(*a));
  CHECK(slot_bytes(opt_r, *resumed) == slot_bytes(opt_a, *a));
  CHECK(opt_r.iterations() == opt_a.iterations());

  // load_weights reads the model part of a checkpoint.
  auto weights_only = make_model(5);
  mt::load_weights(*weights_only, path);
  CHECK(weight_bytes(*weights_only) == saved_weights);
}

TEST_CASE("safetensors: a checkpoint with a LossScaleOptimizer around RMSprop resumes exactly",
          "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  const Batch b = make_batch();
  const auto scale = mt::LossScale::dynamic({.initial_scale = 1000.0, .growth_interval = 3});
  auto a = make_model(1);
  mo::LossScaleOptimizer opt_a(mo::RMSprop({.learning_rate = 0.01, .momentum = 0.5}), scale);
  lso_step(*a, opt_a, b);
  lso_step(*a, opt_a, b);
  // A skipped step: infinite gradients.
  std::vector<mt::Tensor> inf;
  for (const auto& v : a->trainable_variables())
    inf.push_back(mt::full_like(v, std::numeric_limits<double>::infinity()));
  opt_a.apply_gradients(inf, a->trainable_variables());
  REQUIRE(opt_a.last_step_skipped());
  lso_step(*a, opt_a, b);
  lso_step(*a, opt_a, b);
  REQUIRE(opt_a.loss_scale() == 500.0);
  REQUIRE(opt_a.good_steps() == 2);
  REQUIRE(opt_a.applied_steps() == 4);
  REQUIRE(opt_a.skipped_steps() == 1);
  mt::save_checkpoint(path, *a, opt_a, {.epoch = 7});
  const auto saved_weights = weight_bytes(*a);
  const auto saved_slots = slot_bytes(opt_a, *a);

  const auto f = mt::load_safetensors(path);
  CHECK(f.metadata.at("optimizer") == "LossScaleOptimizer");
  CHECK(f.metadata.at("optimizer.inner") == "RMSprop");
  CHECK(f.metadata.at("optimizer.scalar.loss_scale") == "500");
  CHECK(f.metadata.at("optimizer.scalar.skipped_steps") == "1");

  // Two more steps: the second one grows the scale (growth_interval 3).
  lso_step(*a, opt_a, b);
  lso_step(*a, opt_a, b);
  CHECK(opt_a.loss_scale() == 1000.0);

  auto resumed = make_model(2);
  mo::LossScaleOptimizer opt_r(mo::RMSprop({.learning_rate = 0.01, .momentum = 0.5}), scale);
  const auto info = mt::load_checkpoint(path, *resumed, opt_r);
  CHECK(info.epoch == 7);
  CHECK(info.metadata.empty());
  CHECK(weight_bytes(*resumed) == saved_weights);
  CHECK(slot_bytes(opt_r, *resumed) == saved_slots);
  CHECK(opt_r.loss_scale() == 500.0);
  CHECK(opt_r.good_steps() == 2);
  CHECK(opt_r.applied_steps() == 4);
  CHECK(opt_r.skipped_steps() == 1);
  CHECK(opt_r.iterations() == 4);

  lso_step(*resumed, opt_r, b);
  lso_step(*resumed, opt_r, b);
  CHECK(weight_bytes(*resumed) == weight_bytes(*a));
  CHECK(slot_bytes(opt_r, *resumed) == slot_bytes(opt_a, *a));
  CHECK(opt_r.loss_scale() == opt_a.loss_scale());
  CHECK(opt_r.good_steps() == opt_a.good_steps());
  CHECK(opt_r.iterations() == opt_a.iterations());

  // The scale round-trips exactly even when it is not a short decimal.
  mo::LossScaleOptimizer odd(mo::RMSprop(), mt::LossScale::fixed(1.0 / 3.0));
  lso_step(*a, odd, b);
  mt::save_checkpoint(dir.file("odd.safetensors"), *a, odd, {});
  mo::LossScaleOptimizer odd_r(mo::RMSprop(), mt::LossScale::fixed(2.0));
  mt::load_checkpoint(dir.file("odd.safetensors"), *resumed, odd_r);
  CHECK(odd_r.loss_scale() == 1.0 / 3.0);
}

TEST_CASE("safetensors: load_checkpoint refuses what does not fit and changes nothing",
          "[safetensors]") {
  TempDir dir;
  const std::string path = dir.file("ckpt.safetensors");
  const Batch b = make_batch();
  auto a = make_model(1);
  mo::Adam adam;
  step(*a, adam, b);
  mt::save_checkpoint(path, *a, adam, {.epoch = 1});

  auto target = make_model(2);
  mo::Adam target_opt;
  step(*target, target_opt, b);
  const auto weights = weight_bytes(*target);
  const auto slots = slot_bytes(target_opt, *target);
  auto unchanged = [&] {
    CHECK(weight_bytes(*target) == weights);
    CHECK(slot_bytes(target_opt, *target) == slots);
    CHECK(target_opt.iterations() == 1);
  };

  // Another kind of optimizer.
  mo::RMSprop rmsprop;
  CHECK(error_of([&] { mt::load_checkpoint(path, *target, rmsprop); }) ==
        fmt::format("checkpoint '{}' holds the state of optimizer Adam, but the optimizer given "
                    "is RMSprop",
                    path));
  CHECK(weight_bytes(*target) == weights);
  mo::LossScaleOptimizer lso_rms(mo::RMSprop{});
  mo::LossScaleOptimizer lso_adam(mo::Adam{});
  step(*a, lso_rms, b);
  mt::save_checkpoint(dir.file("lso.safetensors"), *a, lso_rms, {});
  CHECK(error_of([&] {
          mt::load_checkpoint(dir.file("lso.safetensors"), *target, lso_adam);
        }).find("wrapping RMSprop, but the optimizer given wraps Adam") != std::string::npos);
  unchanged();

  // Another architecture: the first tensor that does not fit is named.
  auto wider = make_model(3, 5);
  const auto wider_weights = weight_bytes(*wider);
  mo::Adam wider_opt;
  CHECK(error_of([&] { mt::load_checkpoint(path, *wider, wider_opt); }) ==
        fmt::format("checkpoint '{}': tensor 'model/hidden/kernel' has shape [3, 4] in the file "
                    "but [3, 5] in the model",
                    path));
  CHECK(weight_bytes(*wider) == wider_weights);
  CHECK(wider_opt.iterations() == 0);

  // A slot that does not fit: the optimizer refuses it before anything changes.
  mt::SafetensorsFile f = mt::load_safetensors(path);
  for (auto& [name, t] : f.tensors)
    if (name == "optimizer/hidden/kernel/m") t = mt::zeros({4, 3});
  mt::save_safetensors(dir.file("bad_slot.safetensors"), f.tensors, f.metadata);
  const std::string slot_error =
      error_of([&] { mt::load_checkpoint(dir.file("bad_slot.safetensors"), *target, target_opt); });
  CHECK(slot_error.find(dir.file("bad_slot.safetensors")) != std::string::npos);
  CHECK(slot_error.find("slot 'hidden/kernel/m'") != std::string::npos);
  unchanged();

  // A slot of a variable the model does not have, and a stray tensor.
  f = mt::load_safetensors(path);
  f.tensors.emplace_back("optimizer/ghost/kernel/m", mt::zeros({2}));
  mt::save_safetensors(dir.file("ghost.safetensors"), f.tensors, f.metadata);
  CHECK(error_of([&] {
          mt::load_checkpoint(dir.file("ghost.safetensors"), *target, target_opt);
        }).find("optimizer slot 'optimizer/ghost/kernel/m' belongs to no trainable variable") !=
        std::string::npos);
  f.tensors.back().first = "stray";
  mt::save_safetensors(dir.file("stray.safetensors"), f.tensors, f.metadata);
  CHECK(error_of([&] {
          mt::load_checkpoint(dir.file("stray.safetensors"), *target, target_opt);
        }).find("tensor 'stray' is neither a weight") != std::string::npos);
  unchanged();

  // Metadata that does not parse.
  f = mt::load_safetensors(path);
  f.metadata["iterations"] = "3.5";
  mt::save_safetensors(dir.file("bad_meta.safetensors"), f.tensors, f.metadata);
  CHECK(error_of([&] {
          mt::load_checkpoint(dir.file("bad_meta.safetensors"), *target, target_opt);
        }).find("__metadata__ \"iterations\" is \"3.5\", not an integer") != std::string::npos);
  unchanged();

  // A weights file is not a checkpoint.
  mt::save_weights(*a, dir.file("weights.safetensors"));
  CHECK(error_of([&] {
          mt::load_checkpoint(dir.file("weights.safetensors"), *target, target_opt);
        }).find("is not a training checkpoint") != std::string::npos);
  unchanged();

  // The caller's metadata cannot take the checkpoint's own keys.
  CHECK_THROWS_AS(mt::save_checkpoint(dir.file("x.safetensors"), *a, adam,
                                      {.epoch = 1, .metadata = {{"epoch", "2"}}}),
                  mt::ValueError);
  CHECK_THROWS_AS(mt::save_checkpoint(dir.file("x.safetensors"), *a, adam,
                                      {.metadata = {{"optimizer.scalar.x", "2"}}}),
                  mt::ValueError);
  CHECK_FALSE(fs::exists(dir.file("x.safetensors")));
}
