// The API sweep of core (tests/api_sweep.h): shapes whose size overflows, views outside
// their storage, and allocations that fail, each with the error type and the words its
// message must hold. The allocations ask for 2^50 bytes and more, which no machine grants
// (they fail at once; nothing is touched).
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "api_sweep.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using sweep::expect;

namespace {

constexpr std::int64_t p2(int e) { return std::int64_t{1} << e; }

// A safetensors file whose one tensor has shape [0, 2^40, 2^40] (no data, but strides
// that overflow); the path, in a directory removed with the object.
struct OverflowingFile {
  std::filesystem::path dir = std::filesystem::temp_directory_path() /
                              fmt::format("mixtape-sweep-core-{}", static_cast<long>(::getpid()));
  std::string path = (dir / "big.safetensors").string();
  OverflowingFile() {
    std::filesystem::create_directories(dir);
    std::string header =
        R"({"x":{"dtype":"F32","shape":[0,1099511627776,1099511627776],"data_offsets":[0,0]}})";
    header.append((8 - header.size() % 8) % 8, ' ');
    std::ofstream out(path, std::ios::binary);
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xFF));
    out << header;
  }
  ~OverflowingFile() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
};

}  // namespace

TEST_CASE("sweep: core shapes whose size overflows", "[sweep][core]") {
  const OverflowingFile file;
  sweep::run_sweep({
      // The issue's cases.
      expect<mt::ShapeError>("zeros({2^31, 2^31}): was SIGFPE",
                             [] {
                               mt::zeros({p2(31), p2(31)});
                             },
                             {"zeros", "[2147483648, 2147483648]", "overflow"}),
      expect<mt::ShapeError>("zeros({2^40, 2^30}): was a tensor that segfaults when read",
                             [] {
                               mt::zeros({p2(40), p2(30)});
                             },
                             {"zeros", "[1099511627776, 1073741824]", "overflow", "int64"}),
      expect<mt::ShapeError>("uniform({2^33, 2^31}): had numel() == 0",
                             [] {
                               mt::uniform({p2(33), p2(31)});
                             },
                             {"uniform", "[8589934592, 2147483648]", "overflow"}),
      expect<mt::ShapeError>("from_vector({}, {2^62, 4}): segfaulted on read",
                             [] {
                               mt::from_vector(std::vector<float>{}, {p2(62), 4});
                             },
                             {"from_vector", "[4611686018427387904, 4]", "overflow"}),
      expect<mt::ShapeError>("zeros({0}).reshape({2^32, 2^32}): segfaulted on read",
                             [] {
                               mt::zeros({0}).reshape({p2(32), p2(32)});
                             },
                             {"reshape", "[4294967296, 4294967296]", "overflow"}),
      // More factories, and byte sizes that overflow while the count fits.
      expect<mt::ShapeError>("normal: element count overflows",
                             [] {
                               mt::normal({p2(33), p2(31)});
                             },
                             {"normal", "[8589934592, 2147483648]", "overflow"}),
      expect<mt::ShapeError>("ones: float32 bytes overflow", [] { mt::ones({p2(62)}); },
                             {"ones", "[4611686018427387904]", "float32", "bytes", "overflow"}),
      expect<mt::ShapeError>("full: int64 bytes overflow",
                             [] { mt::full({p2(61)}, 1.0, mt::kInt64); },
                             {"full", "[2305843009213693952]", "int64", "bytes", "overflow"}),
      expect<mt::ShapeError>("uniform: float64 bytes overflow",
                             [] { mt::uniform({p2(61)}, 0.0, 1.0, mt::kFloat64); },
                             {"uniform", "float64", "bytes", "overflow"}),
      expect<mt::ShapeError>("Tensor::empty: element count overflows",
                             [] {
                               mt::Tensor::empty({p2(32), p2(32)}, mt::kUInt8);
                             },
                             {"Tensor::empty", "[4294967296, 4294967296]", "overflow"}),
      expect<mt::ShapeError>("zeros: empty, but strides overflow",
                             [] {
                               mt::zeros({0, p2(40), p2(40)});
                             },
                             {"zeros", "[0, 1099511627776, 1099511627776]", "overflow"}),
      expect<mt::ShapeError>("zeros: negative extent",
                             [] {
                               mt::zeros({2, -1});
                             },
                             {"zeros", "negative extent", "[2, -1]"}),
      expect<mt::ShapeError>("Shape: extent below -1",
                             [] {
                               mt::Shape({3, -2});
                             },
                             {"Shape", "negative extent", "[3, -2]"}),
      expect<mt::ShapeError>("Shape::numel: overflows",
                             [] {
                               (void)mt::Shape({p2(32), p2(32)}).numel();
                             },
                             {"Shape::numel", "[4294967296, 4294967296]", "overflow"}),
      expect<mt::ShapeError>("checked_numel names the caller's op",
                             [] {
                               mt::checked_numel({p2(40), p2(40)}, "read_idx 'x.idx'");
                             },
                             {"read_idx 'x.idx'", "[1099511627776, 1099511627776]", "overflow"}),
      expect<mt::ShapeError>("checked_nbytes names the dtype",
                             [] { mt::checked_nbytes({p2(62)}, mt::kFloat64, "op"); },
                             {"op", "[4611686018427387904]", "float64", "bytes", "overflow"}),
      // Views, reshapes and broadcasts.
      expect<mt::ShapeError>("reshape: the known extents overflow before -1 is inferred",
                             [] {
                               mt::zeros({4}).reshape({p2(62), 4, -1});
                             },
                             {"reshape", "[4611686018427387904, 4, -1]", "overflow"}),
      expect<mt::ShapeError>("expand: element count overflows",
                             [] {
                               mt::zeros({1}).expand({p2(40), p2(30)});
                             },
                             {"expand", "[1099511627776, 1073741824]", "overflow"}),
      expect<mt::ShapeError>("expand: float32 bytes overflow",
                             [] { mt::zeros({1}).expand({p2(62)}); },
                             {"expand", "[4611686018427387904]", "float32", "overflow"}),
      expect<mt::ShapeError>("expand: negative extent",
                             [] {
                               mt::zeros({1}).expand({-1, 3});
                             },
                             {"expand", "negative extent", "[-1, 3]"}),
      expect<mt::ShapeError>("broadcast_shapes: the result overflows",
                             [] {
                               mt::broadcast_shapes({p2(40), 1}, {1, p2(30)}, "myop");
                             },
                             {"myop", "[1099511627776, 1073741824]", "overflow"}),
      expect<mt::ShapeError>(
          "add: two broadcast views whose sum overflows in bytes",
          [] {
            mt::add(mt::zeros({1, 1}).expand({p2(31), 1}), mt::zeros({1, 1}).expand({1, p2(31)}));
          },
          {"[2147483648, 2147483648]", "float32", "overflow"}),
      expect<mt::ShapeError>("matmul: a broadcast batch whose size overflows",
                             [] {
                               mt::matmul(mt::zeros({1, 1, 1}).expand({p2(40), 1, 1}),
                                          mt::zeros({1, 1, 1, 1}).expand({p2(30), 1, 1, 1}));
                             },
                             {"matmul", "[1073741824, 1099511627776]", "overflow"}),
      // arange counts before it allocates.
      expect<mt::ValueError>("arange(0, 1e30): was std::length_error",
                             [] { mt::arange(0.0, 1e30); },
                             {"arange", "[0, 1e+30) by step 1", "1e+30 elements", "overflow"}),
      expect<mt::ValueError>("arange: a tiny step", [] { mt::arange(0.0, 1.0, 1e-300); },
                             {"arange", "by step 1e-300", "more than a tensor can hold"}),
      expect<mt::ValueError>("arange: an integer stop too large for int64 bytes",
                             [] { mt::arange(p2(62)); },
                             {"arange", "4611686018427387904 elements", "overflow"}),
      // Files.
      expect<mt::IOError>("load_safetensors: a shape whose strides overflow",
                          [&] { mt::load_safetensors(file.path); },
                          {"big.safetensors", "[0, 1099511627776, 1099511627776]", "overflow"}),
  });
}

TEST_CASE("sweep: core views outside their storage", "[sweep][core]") {
  const mt::Tensor base = mt::arange(std::int64_t{4});
  sweep::run_sweep({
      // The issue's cases.
      expect<mt::IndexError>("view_of: 100 elements over 4",
                             [&] { mt::Tensor::view_of(base, {100}, {1}, 0); },
                             {"Tensor::view_of", "[100]", "reaches element 99", "4 elements"}),
      expect<mt::IndexError>("view_of: a negative offset",
                             [&] { mt::Tensor::view_of(base, {2}, {1}, -1); },
                             {"Tensor::view_of", "offset -1", "negative"}),
      // Their neighbours.
      expect<mt::IndexError>("view_of: one element past the end",
                             [&] { mt::Tensor::view_of(base, {2}, {1}, 3); },
                             {"Tensor::view_of", "reaches element 4", "4 elements of int64"}),
      expect<mt::IndexError>("view_of: strides that reach past the end",
                             [&] {
                               mt::Tensor::view_of(base, {2, 2}, {2, 2}, 0);
                             },
                             {"Tensor::view_of", "strides [2, 2]", "reaches element 4"}),
      expect<mt::IndexError>("view_of: an empty view after the end",
                             [&] { mt::Tensor::view_of(base, {0}, {1}, 5); },
                             {"Tensor::view_of", "offset 5", "after the end"}),
      expect<mt::IndexError>("view_of: a reach that overflows int64",
                             [&] {
                               mt::Tensor::view_of(base, {3, 3}, {p2(62), p2(62)}, 0);
                             },
                             {"Tensor::view_of", "2^63", "4 elements"}),
      expect<mt::ShapeError>("view_of: fewer strides than axes",
                             [&] {
                               mt::Tensor::view_of(base, {2, 2}, {1}, 0);
                             },
                             {"Tensor::view_of", "1 strides for 2 axes"}),
      expect<mt::ShapeError>("view_of: a negative stride",
                             [&] { mt::Tensor::view_of(base, {2}, {-1}, 3); },
                             {"Tensor::view_of", "strides [-1]", "negative strides"}),
      expect<mt::ShapeError>("view_of: a negative extent",
                             [&] { mt::Tensor::view_of(base, {-1}, {1}, 0); },
                             {"Tensor::view_of", "negative extent", "[-1]"}),
      expect<mt::ShapeError>("view_of: a broadcast whose element count overflows",
                             [&] {
                               mt::Tensor::view_of(base, {p2(32), p2(32)}, {0, 0}, 0);
                             },
                             {"Tensor::view_of", "[4294967296, 4294967296]", "overflow"}),
  });
}

TEST_CASE("sweep: core allocations that fail", "[sweep][core]") {
  sweep::run_sweep({
      expect<mt::OutOfMemoryError>("Tensor::empty: 2^50 bytes",
                                   [] { mt::Tensor::empty({p2(48)}, mt::kFloat32); },
                                   {"Tensor::empty", "out of memory", "1125899906842624 bytes",
                                    "1.0 PiB", "on cpu", "float32", "[281474976710656]"}),
      expect<mt::OutOfMemoryError>("zeros: 2^50 bytes", [] { mt::zeros({p2(47)}, mt::kFloat64); },
                                   {"zeros", "out of memory", "1125899906842624 bytes", "cpu"}),
      expect<mt::OutOfMemoryError>(
          "full: 2^50 bytes",
          [] {
            mt::full({p2(25), p2(25)}, 2.0);
          },
          {"full", "out of memory", "4503599627370496 bytes", "cpu", "[33554432, 33554432]"}),
      expect<mt::OutOfMemoryError>("uniform: its host buffer", [] { mt::uniform({p2(48)}); },
                                   {"uniform", "out of memory", "cpu"}),
      expect<mt::OutOfMemoryError>("normal: float16, its float32 host buffer",
                                   [] { mt::normal({p2(48)}, 0.0, 1.0, mt::kFloat16); },
                                   {"normal", "out of memory", "1125899906842624 bytes", "cpu"}),
      expect<mt::OutOfMemoryError>("arange(2^48)", [] { mt::arange(p2(48)); },
                                   {"arange", "out of memory", "2251799813685248 bytes", "cpu"}),
      expect<mt::OutOfMemoryError>("arange(0, 1e15)",
                                   [] { mt::arange(0.0, 1e15, 1.0, mt::kFloat64); },
                                   {"arange", "out of memory", "8000000000000000 bytes", "cpu"}),
      expect<mt::OutOfMemoryError>("Storage: 2^50 bytes",
                                   [] { mt::Storage s(std::size_t{1} << 50, mt::Device::cpu()); },
                                   {"Storage", "out of memory", "1125899906842624 bytes", "cpu"}),
      expect<mt::OutOfMemoryError>("contiguous copy of a broadcast view",
                                   [] { mt::zeros({1}).expand({p2(48)}).contiguous(); },
                                   {"out of memory", "1125899906842624 bytes", "cpu"}),
      expect<mt::OutOfMemoryError>("to_vector of a broadcast view",
                                   [] { mt::zeros({1}).expand({p2(48)}).to_vector<float>(); },
                                   {"out of memory", "cpu"}),
  });
}

TEST_CASE("sweep: a layer whose weights cannot be allocated", "[sweep][core]") {
  // The issue's Dense(2^40): built on 784 features its kernel is [784, 2^40] float32,
  // 3.5e15 bytes. The error names the layer and the bytes, and the layer stays unbuilt.
  auto dense = mixtape::layers::Dense(p2(40), {.name = "huge"});
  sweep::run_sweep({
      expect<mt::OutOfMemoryError>("Dense(2^40) built on 784 features",
                                   [&] {
                                     dense(mt::zeros({2, 784}));
                                   },
                                   {"huge", "Dense", "'kernel'", "glorot_uniform", "out of memory",
                                    "3448068464705536 bytes", "cpu", "[784, 1099511627776]"}),
  });
  CHECK_FALSE(dense->built());
  CHECK(dense->weights().empty());
}
