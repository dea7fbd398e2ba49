// IDX files: a streaming reader of raw or gzip-compressed files (zlib) that opens regular
// files only, the IDX header and size validation (the data read is bounded by what the
// header promises, the promise by what the file can hold and by the caller's check),
// conversion of the big-endian elements to a tensor, and the writer.
#include "mixtape/datasets/idx.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <system_error>

#include "datasets/file_kind.h"
#include "mixtape/core/error.h"

namespace mixtape::datasets {

namespace fs = std::filesystem;

namespace {

constexpr std::size_t kChunk = 1 << 16;
// The data of read_idx is read in pieces of this size (a multiple of every item size), so
// that memory grows with the bytes actually read, never with the header's promise alone.
constexpr std::size_t kDataPiece = std::size_t{16} << 20;
// Deflate expands at most 1032 to 1 (a match of 258 bytes coded in 2 bits; zlib's FAQ): a
// gzip file of n bytes inflates to at most 1032 n bytes, whatever its header says.
constexpr std::uint64_t kMaxDeflateRatio = 1032;

[[noreturn]] void fail(const std::string& op, const fs::path& path, const std::string& what) {
  throw IOError(fmt::format("{}: {}: {}", op, path.string(), what));
}

// The data of an IDX file does not fit in memory: an OutOfMemoryError naming the file and
// how far the read got (rather than std::bad_alloc from a vector deep inside).
[[noreturn]] void fail_out_of_memory(const fs::path& path, std::uint64_t have,
                                     std::uint64_t promised, const Shape& shape, DType dtype,
                                     const std::string& detail) {
  throw OutOfMemoryError(fmt::format(
      "read_idx: {}: out of memory holding its data ({} of the {} bytes promised read, shape {}, "
      "{}){}{}",
      path.string(), have, promised, shape.str(), dtype, detail.empty() ? "" : ": ", detail));
}

// Refuses `path`, which is not a regular file: "is a FIFO (named pipe) (through a symbolic
// link to /x/fifo), not a regular file".
[[noreturn]] void refuse_non_regular(const fs::path& path, mode_t mode) {
  std::string via;
  std::error_code ec;
  if (fs::is_symlink(path, ec)) {
    const fs::path target = fs::read_symlink(path, ec);
    if (!ec) via = fmt::format(" (through a symbolic link to {})", target.string());
  }
  fail("read", path, fmt::format("is {}{}, not a regular file", file_kind(mode), via));
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

// The decompressed bytes of a file, read in order: inflated when the file starts with
// the gzip magic bytes, passed through otherwise. Only a regular file (or a symbolic link to
// one) is opened: a FIFO, a directory or a device is refused before it could block a reader
// or feed it without end.
class ByteStream {
 public:
  explicit ByteStream(const fs::path& path) : path_(path), in_(kChunk) {
    // stat() first, so that a device or FIFO is not even opened; then open without blocking
    // (a FIFO that appeared meanwhile) and fstat() what was opened, so that no race between
    // the two lets one through.
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      fail("read", path, fmt::format("cannot open: {}", std::strerror(errno)));
    if (!S_ISREG(st.st_mode)) refuse_non_regular(path, st.st_mode);
    const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
    if (fd < 0) fail("read", path, fmt::format("cannot open: {}", std::strerror(errno)));
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      const int err = errno;
      ::close(fd);
      if (!S_ISREG(st.st_mode)) refuse_non_regular(path, st.st_mode);
      fail("read", path, fmt::format("cannot open: {}", std::strerror(err)));
    }
    // O_NONBLOCK means nothing to a regular file's reads; cleared all the same.
    if (const int flags = ::fcntl(fd, F_GETFL); flags >= 0)
      ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    file_.reset(::fdopen(fd, "rb"));
    if (!file_) {
      const int err = errno;
      ::close(fd);
      fail("read", path, fmt::format("cannot open: {}", std::strerror(err)));
    }
    file_size_ = static_cast<std::uint64_t>(st.st_size);
    refill();
    gzip_ = avail_ >= 2 && in_[0] == 0x1f && in_[1] == 0x8b;
    if (gzip_) {
      std::memset(&z_, 0, sizeof(z_));
      if (inflateInit2(&z_, 15 + 16) != Z_OK) fail("read", path, "zlib inflateInit2 failed");
      z_open_ = true;
    }
  }
  ~ByteStream() {
    if (z_open_) inflateEnd(&z_);
  }
  ByteStream(const ByteStream&) = delete;
  ByteStream& operator=(const ByteStream&) = delete;

  bool gzip() const { return gzip_; }
  // The size of the file (compressed, for a gzip file) when it was opened.
  std::uint64_t file_size() const { return file_size_; }

  // Reads up to n bytes into dst; fewer only at the end of the data.
  std::size_t read(std::uint8_t* dst, std::size_t n) {
    return gzip_ ? read_gzip(dst, n) : read_raw(dst, n);
  }

 private:
  // Reads more of the file into in_ (when pos_ has consumed it all); false at its end.
  bool refill() {
    if (pos_ < avail_) return true;
    if (eof_) return false;
    pos_ = 0;
    avail_ = std::fread(in_.data(), 1, in_.size(), file_.get());
    if (avail_ < in_.size()) {
      if (std::ferror(file_.get())) fail("read", path_, "read error");
      eof_ = true;
    }
    return avail_ > 0;
  }

  std::size_t read_raw(std::uint8_t* dst, std::size_t n) {
    std::size_t got = 0;
    while (got < n && refill()) {
      const std::size_t k = std::min(n - got, avail_ - pos_);
      std::memcpy(dst + got, in_.data() + pos_, k);
      pos_ += k;
      got += k;
    }
    return got;
  }

  std::size_t read_gzip(std::uint8_t* dst, std::size_t n) {
    std::size_t got = 0;
    while (got < n) {
      if (member_ended_) {
        // After a gzip member: the end of the file, another member, or garbage.
        if (!refill()) break;
        if (in_[pos_] != 0x1f) fail("read", path_, "trailing bytes after the gzip stream");
        if (pos_ + 1 >= avail_ && !eof_) {
          // The second magic byte lies in the next chunk: move the first one to the front.
          in_[0] = in_[pos_];
          const std::size_t more = std::fread(in_.data() + 1, 1, in_.size() - 1, file_.get());
          if (more < in_.size() - 1) {
            if (std::ferror(file_.get())) fail("read", path_, "read error");
            eof_ = true;
          }
          pos_ = 0;
          avail_ = 1 + more;
        }
        if (pos_ + 1 >= avail_ || in_[pos_ + 1] != 0x8b)
          fail("read", path_, "trailing bytes after the gzip stream");
        if (inflateReset(&z_) != Z_OK) fail("read", path_, "zlib inflateReset failed");
        member_ended_ = false;
      }
      refill();  // zlib may still hold output when the input is used up
      z_.next_in = in_.data() + pos_;
      z_.avail_in = static_cast<uInt>(avail_ - pos_);
      z_.next_out = dst + got;
      z_.avail_out = static_cast<uInt>(std::min<std::size_t>(n - got, 1u << 30));
      const int ret = inflate(&z_, Z_NO_FLUSH);
      pos_ = static_cast<std::size_t>(z_.next_in - in_.data());
      got = static_cast<std::size_t>(z_.next_out - dst);
      if (ret == Z_STREAM_END) {
        member_ended_ = true;
      } else if (ret == Z_DATA_ERROR || ret == Z_NEED_DICT) {
        fail("read", path_,
             fmt::format("corrupt gzip stream (zlib: {})", z_.msg ? z_.msg : "data error"));
      } else if (ret == Z_MEM_ERROR) {
        fail("read", path_, "out of memory while inflating the gzip stream");
      } else if (ret == Z_BUF_ERROR) {
        // No progress was possible: the input ran out before the end of the stream.
        if (eof_ && pos_ >= avail_)
          fail("read", path_, "truncated gzip stream (it ends before its end marker)");
      } else if (ret != Z_OK) {
        fail("read", path_, fmt::format("zlib inflate failed (code {})", ret));
      }
    }
    return got;
  }

  fs::path path_;
  File file_;
  std::uint64_t file_size_ = 0;
  std::vector<std::uint8_t> in_;
  std::size_t pos_ = 0, avail_ = 0;
  bool eof_ = false;
  bool gzip_ = false;
  bool z_open_ = false;
  bool member_ended_ = false;
  z_stream z_{};
};

std::uint32_t be32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

void put_be32(std::vector<std::uint8_t>& out, std::uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<std::uint8_t>(v >> s));
}

// Item size in the file and the dtype it is read as, per IDX type code; 0 when unknown.
std::size_t idx_item_size(std::uint8_t code) {
  switch (code) {
    case 0x08:
    case 0x09:
      return 1;
    case 0x0B:
      return 2;
    case 0x0C:
    case 0x0D:
      return 4;
    case 0x0E:
      return 8;
    default:
      return 0;
  }
}

DType idx_dtype(std::uint8_t code) {
  switch (code) {
    case 0x08:
      return kUInt8;
    case 0x0D:
      return kFloat32;
    case 0x0E:
      return kFloat64;
    default:
      return kInt32;
  }
}

// Reverses the byte order of each `item`-byte element in place.
void swap_bytes(std::uint8_t* p, std::size_t count, std::size_t item) {
  if (item == 1) return;
  for (std::size_t i = 0; i < count; ++i, p += item)
    for (std::size_t a = 0, b = item - 1; a < b; ++a, --b) std::swap(p[a], p[b]);
}

// Writes bytes to `path` through a temporary file beside it and a rename.
void write_atomically(const fs::path& path, const std::vector<std::uint8_t>& bytes) {
  static std::atomic<unsigned> counter{0};
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  const fs::path tmp = dir / fmt::format(".{}.tmp-{}-{}", path.filename().string(),
                                         static_cast<long>(::getpid()), counter++);
  {
    File f(std::fopen(tmp.c_str(), "wb"));
    if (!f)
      fail("write_idx", path,
           fmt::format("cannot create {}: {}", tmp.string(), std::strerror(errno)));
    const bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f.get()) == bytes.size() &&
                    std::fflush(f.get()) == 0;
    if (!ok) {
      const std::string why = std::strerror(errno);
      f.reset();
      std::error_code ec;
      fs::remove(tmp, ec);
      fail("write_idx", path, fmt::format("write error: {}", why));
    }
    if (std::fclose(f.release()) != 0) {
      std::error_code ec;
      fs::remove(tmp, ec);
      fail("write_idx", path, "write error on close");
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    std::error_code ec2;
    fs::remove(tmp, ec2);
    fail("write_idx", path, fmt::format("cannot rename the temporary file: {}", ec.message()));
  }
}

std::vector<std::uint8_t> gzip_bytes(const std::vector<std::uint8_t>& raw, const fs::path& path) {
  z_stream z{};
  if (deflateInit2(&z, 6, Z_DEFLATED, 15 + 16, 8, Z_DEFAULT_STRATEGY) != Z_OK)
    fail("write_idx", path, "zlib deflateInit2 failed");
  std::vector<std::uint8_t> out(deflateBound(&z, static_cast<uLong>(raw.size())) + 64);
  z.next_in = const_cast<Bytef*>(raw.data());
  z.avail_in = static_cast<uInt>(raw.size());
  z.next_out = out.data();
  z.avail_out = static_cast<uInt>(out.size());
  const int ret = deflate(&z, Z_FINISH);
  const std::size_t size = z.total_out;
  deflateEnd(&z);
  if (ret != Z_STREAM_END) fail("write_idx", path, fmt::format("zlib deflate failed ({})", ret));
  out.resize(size);
  return out;
}

}  // namespace

void read_decompressed(const fs::path& path,
                       const std::function<void(const std::uint8_t*, std::size_t)>& sink) {
  ByteStream in(path);
  std::vector<std::uint8_t> buf(kChunk);
  for (;;) {
    const std::size_t n = in.read(buf.data(), buf.size());
    if (n > 0) sink(buf.data(), n);
    if (n < buf.size()) break;
  }
}

std::vector<std::uint8_t> read_decompressed(const fs::path& path) {
  std::vector<std::uint8_t> out;
  read_decompressed(path,
                    [&](const std::uint8_t* p, std::size_t n) { out.insert(out.end(), p, p + n); });
  return out;
}

namespace {

// The header of an IDX file: magic number, element type, rank, extents, and the bytes of data
// they promise (multiplied with overflow checks).
IdxHeader read_header(ByteStream& in, const fs::path& path) {
  std::uint8_t magic[4];
  const std::size_t got = in.read(magic, 4);
  if (got < 4)
    fail("read_idx", path,
         fmt::format("too short for an IDX header ({} bytes{})", got,
                     in.gzip() ? " after gunzip" : ""));
  const std::uint32_t magic_number = be32(magic);
  if (magic[0] != 0 || magic[1] != 0)
    fail("read_idx", path,
         fmt::format("bad magic number 0x{:08x}: an IDX file starts with two zero bytes, a type "
                     "code and a rank",
                     magic_number));
  const std::uint8_t code = magic[2];
  const std::size_t item = idx_item_size(code);
  if (item == 0)
    fail("read_idx", path,
         fmt::format("unknown element type code 0x{:02x} (magic 0x{:08x}; IDX types are 0x08 "
                     "ubyte, 0x09 byte, 0x0B short, 0x0C int, 0x0D float, 0x0E double)",
                     code, magic_number));
  const int rank = magic[3];
  if (rank < 1 || rank > 4)
    fail("read_idx", path,
         fmt::format("rank {} is not supported (magic 0x{:08x}; expected 1 to 4 dimensions)", rank,
                     magic_number));
  std::uint8_t dim_bytes[16];
  const std::size_t dims_got = in.read(dim_bytes, static_cast<std::size_t>(4 * rank));
  if (dims_got < static_cast<std::size_t>(4 * rank))
    fail("read_idx", path,
         fmt::format("truncated header: rank {} needs {} bytes of extents, file has {}", rank,
                     4 * rank, dims_got));
  std::vector<std::int64_t> dims;
  std::uint64_t promised = item;
  bool overflow = false;
  for (int i = 0; i < rank; ++i) {
    dims.push_back(be32(dim_bytes + 4 * i));
    overflow |=
        __builtin_mul_overflow(promised, static_cast<std::uint64_t>(dims.back()), &promised);
  }
  const Shape shape(dims);
  if (overflow || promised > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
    fail("read_idx", path,
         fmt::format("header promises an impossible size (shape {})", shape.str()));
  return IdxHeader{.type = static_cast<IdxType>(code),
                   .dtype = idx_dtype(code),
                   .shape = shape,
                   .data_bytes = promised};
}

// What the file can hold bounds the header's promise before anything is read: a raw file's
// data is its size less the header; a gzip file inflates to at most 1032 times its size.
void check_promise(const ByteStream& in, const fs::path& path, const IdxHeader& h) {
  const std::uint64_t promised = h.data_bytes;
  const std::uint64_t header_bytes = 4 + 4 * static_cast<std::uint64_t>(h.shape.rank());
  if (!in.gzip()) {
    const std::uint64_t available =
        in.file_size() > header_bytes ? in.file_size() - header_bytes : 0;
    if (available < promised)
      fail("read_idx", path,
           fmt::format("truncated: header promises {} bytes of data (shape {}), file has {}",
                       promised, h.shape.str(), available));
    if (available > promised)
      fail(
          "read_idx", path,
          fmt::format("{} trailing bytes: header promises {} bytes of data (shape {}), file has {}",
                      available - promised, promised, h.shape.str(), available));
  } else if (in.file_size() < std::numeric_limits<std::uint64_t>::max() / kMaxDeflateRatio &&
             promised > in.file_size() * kMaxDeflateRatio) {
    fail("read_idx", path,
         fmt::format("header promises {} bytes of data (shape {}), more than the {}-byte gzip "
                     "file can inflate to (deflate expands at most {} to 1)",
                     promised, h.shape.str(), in.file_size(), kMaxDeflateRatio));
  }
}

// Reads exactly the promised bytes, in pieces allocated as the data arrives (memory grows with
// the bytes read; `have` counts them), then one more byte to find trailing data: nothing past
// it is read or inflated.
std::vector<std::vector<std::uint8_t>> read_data(ByteStream& in, const fs::path& path,
                                                 const IdxHeader& h, std::uint64_t& have) {
  const std::uint64_t promised = h.data_bytes;
  std::vector<std::vector<std::uint8_t>> pieces;
  while (have < promised) {
    const auto want =
        static_cast<std::size_t>(std::min<std::uint64_t>(promised - have, kDataPiece));
    std::vector<std::uint8_t> piece(want);
    const std::size_t n = in.read(piece.data(), want);
    piece.resize(n);
    have += n;
    pieces.push_back(std::move(piece));
    if (n < want) break;
  }
  if (have < promised)
    fail("read_idx", path,
         fmt::format("truncated: header promises {} bytes of data (shape {}), file has {}",
                     promised, h.shape.str(), have));
  std::uint8_t extra = 0;
  if (in.read(&extra, 1) > 0)
    fail("read_idx", path,
         fmt::format("trailing bytes: header promises {} bytes of data (shape {}), the {} holds "
                     "more",
                     promised, h.shape.str(), in.gzip() ? "decompressed file" : "file"));
  return pieces;
}

// The big-endian elements of the pieces as a tensor, converted piece by piece (each holds
// whole elements: kDataPiece is a multiple of every item size), each piece freed once
// converted.
Tensor convert(std::vector<std::vector<std::uint8_t>>& pieces, const IdxHeader& h) {
  const auto code = static_cast<std::uint8_t>(h.type);
  const std::size_t item = idx_item_size(code);
  Tensor out = Tensor::empty(h.shape, h.dtype);
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  std::size_t first = 0;  // the index of the piece's first element
  for (std::vector<std::uint8_t>& piece : pieces) {
    const std::size_t count = piece.size() / item;
    const std::uint8_t* data = piece.data();
    if (code == 0x09) {
      auto* o = out.data<std::int32_t>() + first;
      for (std::size_t i = 0; i < count; ++i) o[i] = static_cast<std::int8_t>(data[i]);
    } else if (code == 0x0B) {
      auto* o = out.data<std::int32_t>() + first;
      for (std::size_t i = 0; i < count; ++i)
        o[i] = static_cast<std::int16_t>(
            static_cast<std::uint16_t>((data[2 * i] << 8) | data[2 * i + 1]));
    } else if (count > 0) {
      std::memcpy(dst + first * item, data, count * item);
      swap_bytes(dst + first * item, count, item);
    }
    first += count;
    std::vector<std::uint8_t>().swap(piece);
  }
  return out;
}

}  // namespace

Tensor read_idx(const fs::path& path, const IdxHeaderCheck& check) {
  ByteStream in(path);
  const IdxHeader header = read_header(in, path);
  if (check) check(header);  // the caller's check sees the header before any data is read
  check_promise(in, path, header);
  std::uint64_t have = 0;
  try {
    std::vector<std::vector<std::uint8_t>> pieces = read_data(in, path, header, have);
    return convert(pieces, header);
  } catch (const std::bad_alloc&) {
    fail_out_of_memory(path, have, header.data_bytes, header.shape, header.dtype, "");
  } catch (const OutOfMemoryError& e) {
    fail_out_of_memory(path, have, header.data_bytes, header.shape, header.dtype, e.what());
  }
}

void write_idx(const fs::path& path, const Tensor& tensor, bool gzip) {
  if (!tensor.defined()) throw ValueError("write_idx: the tensor is undefined");
  std::uint8_t code = 0;
  if (tensor.dtype() == kUInt8)
    code = 0x08;
  else if (tensor.dtype() == kInt32)
    code = 0x0C;
  else if (tensor.dtype() == kFloat32)
    code = 0x0D;
  else if (tensor.dtype() == kFloat64)
    code = 0x0E;
  else
    throw DTypeError(
        fmt::format("write_idx: {}: IDX holds uint8, int32, float32 or float64 tensors, not {}",
                    path.string(), tensor.dtype().name()));
  const std::size_t rank = tensor.rank();
  if (rank < 1 || rank > 4)
    throw ShapeError(
        fmt::format("write_idx: {}: rank {} (shape {}); IDX files here hold 1 to 4 "
                    "dimensions",
                    path.string(), rank, tensor.shape().str()));
  for (auto d : tensor.shape())
    if (d > std::numeric_limits<std::uint32_t>::max())
      throw ShapeError(fmt::format("write_idx: {}: extent {} of shape {} does not fit in 32 bits",
                                   path.string(), d, tensor.shape().str()));

  std::vector<std::uint8_t> bytes = {0, 0, code, static_cast<std::uint8_t>(rank)};
  for (auto d : tensor.shape()) put_be32(bytes, static_cast<std::uint32_t>(d));
  std::vector<std::uint8_t> data = detail::host_bytes(tensor);
  const std::size_t item = tensor.dtype().itemsize();
  swap_bytes(data.data(), data.size() / item, item);
  bytes.insert(bytes.end(), data.begin(), data.end());
  write_atomically(path, gzip ? gzip_bytes(bytes, path) : bytes);
}

}  // namespace mixtape::datasets
