// The API sweep of the datasets (tests/api_sweep.h): bad IDX files (headers, sizes, gzip
// streams, gzip bombs, files that are not regular files), tensors IDX cannot hold, and the
// MNIST / Fashion-MNIST loaders' bad data dirs, caches, labels, shapes and options. Every row
// builds its few-byte files in a temporary directory and runs in milliseconds; nothing is
// downloaded (download = false).
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "api_sweep.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace md = mixtape::datasets;
namespace fs = std::filesystem;
using sweep::expect;
using sweep::multiline;

namespace {

using Bytes = std::vector<std::uint8_t>;

using SweepDir = mixtape_test::TempDir;

void write_bytes(const fs::path& path, const Bytes& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

// An IDX file: magic (0, 0, type, rank), big-endian extents, then `data` as given.
Bytes idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims, const Bytes& data = {}) {
  Bytes out = {0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims)
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(d >> s));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// `head` then `zeros` zero bytes, gzip-compressed with zlib (a small file that inflates to
// much more).
Bytes gzip_with_zeros(const Bytes& head, std::size_t zeros) {
  Bytes raw = head;
  raw.resize(head.size() + zeros, 0);
  uLongf size = compressBound(static_cast<uLong>(raw.size())) + 64;
  Bytes out(size);
  z_stream z{};
  REQUIRE(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  z.next_in = raw.data();
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  REQUIRE(deflate(&z, Z_FINISH) == Z_STREAM_END);
  out.resize(z.total_out);
  deflateEnd(&z);
  return out;
}

mt::Tensor u8(const std::vector<std::uint8_t>& v, const mt::Shape& shape) {
  return mt::from_vector(v, shape, mt::kUInt8);
}

// The four MNIST files in `dir` (raw): 5 training and 3 test images, labels 0..4 and 0..2.
void write_mnist(const fs::path& dir) {
  fs::create_directories(dir);
  const auto& names = md::file_names();
  md::write_idx(dir / names[0], u8(std::vector<std::uint8_t>(5 * 784, 7), {5, 28, 28}));
  md::write_idx(dir / names[1], u8({0, 1, 2, 3, 4}, {5}));
  md::write_idx(dir / names[2], u8(std::vector<std::uint8_t>(3 * 784, 9), {3, 28, 28}));
  md::write_idx(dir / names[3], u8({0, 1, 2}, {3}));
}

}  // namespace

TEST_CASE("sweep: datasets (IDX files, MNIST and Fashion-MNIST loaders)", "[sweep][datasets]") {
  SweepDir dir;
  const fs::path cache = dir / "cache";
  auto opts = [&](const fs::path& data) {
    return md::LoadOptions{
        .data_dir = data.string(), .cache_dir = cache.string(), .download = false};
  };
  // A data dir holding the four files, `name` replaced by what `make` puts there.
  auto data_dir_with = [&](const std::string& tag, const std::string& name, auto make) {
    const fs::path d = dir / tag;
    write_mnist(d);
    fs::remove(d / name);
    make(d / name);
    return d;
  };
  const std::string images = "train-images-idx3-ubyte", labels = "train-labels-idx1-ubyte";
  const fs::path p = dir / "f";  // a file name for one row at a time
  auto file = [&](const std::string& name, const Bytes& bytes) {
    write_bytes(dir / name, bytes);
    return dir / name;
  };

  sweep::run_sweep({
      // --- read_idx / read_decompressed: what the file is ----------------------------------
      expect<mt::IOError>(
          "read_idx: a missing file", [&] { md::read_idx(dir / "nope"); },
          {"read", (dir / "nope").string(), "cannot open: No such file or directory"}),
      expect<mt::IOError>("read_idx: a directory",
                          [&] {
                            fs::create_directories(dir / "a-dir");
                            md::read_idx(dir / "a-dir");
                          },
                          {(dir / "a-dir").string(), "is a directory, not a regular file"}),
      expect<mt::IOError>("read_idx: a symbolic link to /dev/zero",
                          [&] {
                            fs::create_symlink("/dev/zero", dir / "zero");
                            md::read_idx(dir / "zero");
                          },
                          {(dir / "zero").string(), "is a character device",
                           "through a symbolic link to /dev/zero", "not a regular file"}),
      expect<mt::IOError>("read_decompressed: a symbolic link to /dev/zero (would never end)",
                          [&] { md::read_decompressed(dir / "zero"); },
                          {(dir / "zero").string(), "is a character device"}),
      expect<mt::IOError>("read_decompressed: a directory",
                          [&] { md::read_decompressed(dir / "a-dir"); },
                          {(dir / "a-dir").string(), "is a directory"}),
      expect<mt::IOError>("read_idx: a dangling symbolic link",
                          [&] {
                            fs::create_symlink(dir / "nowhere", dir / "dangling");
                            md::read_idx(dir / "dangling");
                          },
                          {(dir / "dangling").string(), "cannot open"}),
      // --- read_idx: the header -------------------------------------------------------------
      expect<mt::IOError>("read_idx: too short for a header",
                          [&] {
                            md::read_idx(file("short", {0, 0, 8}));
                          },
                          {(dir / "short").string(), "too short for an IDX header (3 bytes)"}),
      expect<mt::IOError>("read_idx: bad magic number",
                          [&] {
                            md::read_idx(file("magic", {1, 0, 8, 1, 0, 0, 0, 1, 9}));
                          },
                          {"read_idx", (dir / "magic").string(), "bad magic number 0x01000801"}),
      expect<mt::IOError>("read_idx: unknown element type",
                          [&] { md::read_idx(file("type", idx_bytes(0x07, {1}, {1}))); },
                          {"unknown element type code 0x07", "0x08 ubyte"}),
      expect<mt::IOError>("read_idx: rank 0",
                          [&] { md::read_idx(file("rank0", idx_bytes(0x08, {}))); },
                          {"rank 0 is not supported", "expected 1 to 4 dimensions"}),
      expect<mt::IOError>("read_idx: rank 5",
                          [&] {
                            md::read_idx(file("rank5", idx_bytes(0x08, {1, 1, 1, 1, 1}, {1})));
                          },
                          {"rank 5 is not supported"}),
      expect<mt::IOError>("read_idx: truncated header",
                          [&] {
                            md::read_idx(file("header", {0, 0, 8, 3, 0, 0, 0, 2, 0, 0}));
                          },
                          {"truncated header: rank 3 needs 12 bytes of extents, file has 6"}),
      expect<mt::IOError>(
          "read_idx: a size that overflows",
          [&] {
            md::read_idx(file("huge", idx_bytes(0x0E, {0xffffffffu, 0xffffffffu, 0xffffffffu})));
          },
          {(dir / "huge").string(), "impossible size", "[4294967295, 4294967295, 4294967295]"}),
      // --- read_idx: the data ---------------------------------------------------------------
      expect<mt::IOError>(
          "read_idx: truncated data (raw: refused from the file size)",
          [&] {
            md::read_idx(file("trunc", idx_bytes(0x08, {60000, 28, 28}, {1, 2})));
          },
          {"truncated: header promises 47040000 bytes of data (shape [60000, 28, 28]), file has "
           "2"}),
      expect<mt::IOError>(
          "read_idx: trailing bytes (raw: counted from the file size)",
          [&] {
            md::read_idx(file("trail", idx_bytes(0x08, {2}, {1, 2, 3})));
          },
          {"1 trailing bytes: header promises 2 bytes of data (shape [2]), file has 3"}),
      expect<mt::IOError>(
          "read_idx: gzip bomb promising more than the file can inflate to",
          [&] {
            md::read_idx(
                file("bomb.gz", gzip_with_zeros(idx_bytes(0x08, {0xffffffffu, 28, 28}), 1 << 20)));
          },
          {(dir / "bomb.gz").string(),
           "header promises 3367254359280 bytes of data (shape [4294967295, 28, 28]), more than "
           "the",
           "-byte gzip file can inflate to (deflate expands at most 1032 to 1)"}),
      expect<mt::IOError>(
          "read_idx: gzip data past the promise (stops at the first extra byte)",
          [&] {
            md::read_idx(
                file("longer.gz",
                     gzip_with_zeros(idx_bytes(0x08, {2, 3}, {1, 2, 3, 4, 5, 6}), 1 << 20)));
          },
          {(dir / "longer.gz").string(),
           "trailing bytes: header promises 6 bytes of data (shape [2, 3]), the decompressed file "
           "holds more"}),
      expect<mt::IOError>(
          "read_idx: gzip data short of the promise",
          [&] {
            md::read_idx(file("short.gz", gzip_with_zeros(idx_bytes(0x08, {2, 3}, {1, 2}), 0)));
          },
          {"truncated: header promises 6 bytes of data (shape [2, 3]), file has 2"}),
      expect<mt::IOError>(
          "read_idx: corrupt gzip stream",
          [&] {
            md::read_idx(file("corrupt.gz", {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3, 0xff, 0xff}));
          },
          {(dir / "corrupt.gz").string(), "corrupt gzip stream"}),
      expect<mt::IOError>("read_idx: truncated gzip stream",
                          [&] {
                            Bytes gz = gzip_with_zeros(idx_bytes(0x08, {4096}), 4096);
                            gz.resize(gz.size() - 4);
                            md::read_idx(file("cut.gz", gz));
                          },
                          {"truncated gzip stream (it ends before its end marker)"}),
      expect<mt::IOError>("read_idx: garbage after the gzip stream",
                          [&] {
                            Bytes gz = gzip_with_zeros(idx_bytes(0x08, {16}), 16);
                            gz.push_back('x');
                            md::read_idx(file("garbage.gz", gz));
                          },
                          {"trailing bytes after the gzip stream"}),
      expect<mt::IOError>("read_idx: the caller's header check refuses before the data is read",
                          [&] {
                            md::read_idx(file("checked", idx_bytes(0x08, {60000, 28, 28})),
                                         [&](const md::IdxHeader& h) {
                                           if (h.data_bytes > 1000)
                                             throw mt::IOError(fmt::format(
                                                 "{}: {} bytes is too much",
                                                 (dir / "checked").string(), h.data_bytes));
                                         });
                          },
                          {(dir / "checked").string(), "47040000 bytes is too much"}),
      // --- write_idx ------------------------------------------------------------------------
      expect<mt::ValueError>("write_idx: an undefined tensor",
                             [&] { md::write_idx(p, mt::Tensor()); }, {"write_idx", "undefined"}),
      expect<mt::DTypeError>(
          "write_idx: bool", [&] { md::write_idx(p, mt::zeros({2}, mt::kBool)); },
          {"write_idx", p.string(), "uint8, int32, float32 or float64", "not bool"}),
      expect<mt::ShapeError>("write_idx: rank 0",
                             [&] { md::write_idx(p, mt::zeros({}, mt::kUInt8)); },
                             {"write_idx", "rank 0", "1 to 4 dimensions"}),
      expect<mt::ShapeError>("write_idx: rank 5",
                             [&] {
                               md::write_idx(p, mt::zeros({1, 1, 1, 1, 1}, mt::kUInt8));
                             },
                             {"rank 5", "[1, 1, 1, 1, 1]"}),
      expect<mt::IOError>("write_idx: a missing directory",
                          [&] { md::write_idx(dir / "no-dir" / "x", mt::zeros({2}, mt::kUInt8)); },
                          {"write_idx", (dir / "no-dir" / "x").string(), "cannot create"}),
      // --- MNIST: data dir entries that are not regular files (never a fallback) ---------------
      expect<mt::IOError>(
          "mnist: a data dir file that is a directory",
          [&] {
            const fs::path d = data_dir_with("dd-dir", images,
                                             [](const fs::path& e) { fs::create_directories(e); });
            md::mnist::load(opts(d));
          },
          {"MNIST: " + (dir / "dd-dir" / images).string(), "is a directory, not a regular file",
           "never replaced by the cache or a download"}),
      expect<mt::IOError>(
          "mnist: a data dir file that is a FIFO (not opened)",
          [&] {
            const fs::path d = data_dir_with("dd-fifo", labels, [](const fs::path& e) {
              REQUIRE(::mkfifo(e.c_str(), 0600) == 0);
            });
            md::mnist::load(opts(d));
          },
          {(dir / "dd-fifo" / labels).string(), "is a FIFO (named pipe), not a regular file"}),
      expect<mt::IOError>("mnist: a data dir file that is a dangling symbolic link",
                          [&] {
                            const fs::path d = data_dir_with(
                                "dd-dangling", images,
                                [&](const fs::path& e) { fs::create_symlink(dir / "gone", e); });
                            md::mnist::load(opts(d));
                          },
                          {(dir / "dd-dangling" / images).string(),
                           "is a dangling symbolic link (to " + (dir / "gone").string() + ")"}),
      expect<mt::IOError>("mnist: a data dir file that links to /dev/zero",
                          [&] {
                            const fs::path d = data_dir_with(
                                "dd-zero", images,
                                [](const fs::path& e) { fs::create_symlink("/dev/zero", e); });
                            md::mnist::load(opts(d));
                          },
                          {(dir / "dd-zero" / images).string(), "is a character device",
                           "through a symbolic link to /dev/zero"}),
      expect<mt::IOError>("mnist: the dataset subdirectory as a dangling symbolic link",
                          [&] {
                            write_mnist(dir / "dd-sub");
                            fs::create_symlink(dir / "unmounted", dir / "dd-sub" / "mnist");
                            md::mnist::load(opts(dir / "dd-sub"));
                          },
                          {(dir / "dd-sub" / "mnist").string(), "dangling symbolic link",
                           "not a readable directory", "subdirectory for MNIST"}),
      expect<mt::IOError>("mnist: a cache entry that is a FIFO",
                          [&] {
                            write_mnist(dir / "cc" / "mnist");
                            fs::remove(dir / "cc" / "mnist" / labels);
                            REQUIRE(::mkfifo((dir / "cc" / "mnist" / labels).c_str(), 0600) == 0);
                            md::mnist::load({.data_dir = (dir / "none").string(),
                                             .cache_dir = (dir / "cc").string(),
                                             .download = false});
                          },
                          {(dir / "cc" / "mnist" / labels).string(), "is a FIFO (named pipe)",
                           "(in the cache", "remove it"}),
      // --- MNIST: the files' content ----------------------------------------------------------
      expect<mt::IOError>("mnist: a label outside 0..9",
                          [&] {
                            write_mnist(dir / "lab");
                            md::write_idx(dir / "lab" / labels, u8({0, 1, 2, 10, 4}, {5}));
                            md::mnist::load(opts(dir / "lab"));
                          },
                          {"MNIST: " + (dir / "lab" / labels).string(),
                           "label 10 at index 3 is not a class (0 to 9)"}),
      expect<mt::IOError>("mnist: a negative int32 label",
                          [&] {
                            write_mnist(dir / "neg");
                            md::write_idx(
                                dir / "neg" / labels,
                                mt::from_vector(std::vector<std::int32_t>{0, -3, 1, 1, 1}, {5}));
                            md::mnist::load(opts(dir / "neg"));
                          },
                          {"label -3 at index 1"}),
      expect<mt::IOError>(
          "fashion_mnist: a label outside 0..9",
          [&] {
            write_mnist(dir / "flab");
            md::write_idx(dir / "flab" / "t10k-labels-idx1-ubyte", u8({0, 99, 2}, {3}));
            md::fashion_mnist::load({.data_dir = (dir / "flab").string(),
                                     .cache_dir = cache.string(),
                                     .download = false,
                                     .sources = {md::Source::directory((dir / "none").string())}});
          },
          {"Fashion-MNIST: ", "t10k-labels-idx1-ubyte: label 99 at index 1"}),
      expect<mt::IOError>("mnist: float labels",
                          [&] {
                            write_mnist(dir / "flt");
                            md::write_idx(dir / "flt" / labels, mt::zeros({5}, mt::kFloat32));
                            md::mnist::load(opts(dir / "flt"));
                          },
                          {"expected uint8 labels of shape [N], got float32 [5]"}),
      expect<mt::IOError>("mnist: images of another shape (from the header)",
                          [&] {
                            write_mnist(dir / "shp");
                            write_bytes(dir / "shp" / images, idx_bytes(0x08, {5, 28, 27}));
                            md::mnist::load(opts(dir / "shp"));
                          },
                          {(dir / "shp" / images).string(),
                           "expected uint8 images of shape [N, 28, 28], got uint8 [5, 28, 27]"}),
      expect<mt::IOError>("mnist: more images than labels (from the header)",
                          [&] {
                            write_mnist(dir / "cnt");
                            write_bytes(dir / "cnt" / images, idx_bytes(0x08, {60000, 28, 28}));
                            md::mnist::load(opts(dir / "cnt"));
                          },
                          {(dir / "cnt" / images).string() + " holds 60000 images but",
                           (dir / "cnt" / labels).string() + " holds 5 labels"}),
      expect<mt::IOError>("mnist: a label file promising more than max_examples",
                          [&] {
                            write_mnist(dir / "max");
                            write_bytes(dir / "max" / labels, idx_bytes(0x08, {13600000}));
                            md::mnist::load(opts(dir / "max"));
                          },
                          {(dir / "max" / labels).string(),
                           "holds 13600000 labels, more than LoadOptions::max_examples (1000000)"}),
      expect<mt::ValueError>("mnist: max_examples below 1",
                             [&] {
                               md::LoadOptions o = opts(dir / "lab");
                               o.max_examples = 0;
                               md::mnist::load(o);
                             },
                             {"MNIST", "LoadOptions::max_examples must be at least 1; got 0"}),
      multiline(expect<mt::IOError>(
          "mnist: nothing anywhere (every place listed)",
          [&] { md::mnist::load(opts(dir / "no-data")); },
          {"MNIST: cannot find train-images-idx3-ubyte",
           "Looked in:", "data dir " + (dir / "no-data").string() + ": no such directory",
           "skipped (LoadOptions::download is false)", "Set MIXTAPE_DATA_DIR"})),
  });
}
