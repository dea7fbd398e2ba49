// safetensors files: the writer (header JSON in the safetensors library's layout, atomic
// write through a temporary file, fsync and rename) and the reader (a strict JSON reader
// for the header's subset of JSON, then checks of every tensor's dtype, shape and offsets
// before any data is read). See include/mixtape/core/safetensors.h and
// docs/checkpoints.md.
#include "mixtape/core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "core/raw.h"

namespace mixtape {
namespace {

// The safetensors library refuses headers larger than this.
constexpr std::uint64_t kMaxHeaderSize = 100'000'000;

// --- dtypes -------------------------------------------------------------------------------

struct DTypeCode {
  DType dtype;
  std::string_view code;
  // The position of the code in the safetensors library's Dtype enum, which is ordered by
  // alignment; its writer sorts tensors by decreasing rank.
  int rank;
};

constexpr std::array<DTypeCode, DType::kCount> kCodes{{
    {kBool, "BOOL", 0},
    {kUInt8, "U8", 1},
    {kFloat16, "F16", 7},
    {kBFloat16, "BF16", 8},
    {kInt32, "I32", 9},
    {kFloat32, "F32", 11},
    {kFloat64, "F64", 12},
    {kInt64, "I64", 13},
}};

const DTypeCode& code_of(DType dtype) {
  for (const auto& c : kCodes)
    if (c.dtype == dtype) return c;
  throw DTypeError(fmt::format("safetensors: dtype {} has no safetensors code", dtype));
}

std::optional<DType> dtype_of_code(std::string_view code) {
  for (const auto& c : kCodes)
    if (c.code == code) return c.dtype;
  return std::nullopt;
}

// --- UTF-8 and JSON strings -------------------------------------------------------------

// The length of the UTF-8 sequence starting at s[i], or 0 when it is not valid UTF-8
// (overlong forms, surrogates and code points beyond U+10FFFF are invalid).
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  std::size_t len;
  std::uint32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
    cp = b0 & 0x1Fu;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    cp = b0 & 0x0Fu;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    cp = b0 & 0x07u;
  } else {
    return 0;
  }
  if (i + len > s.size()) return 0;
  for (std::size_t k = 1; k < len; ++k) {
    const unsigned char b = byte(i + k);
    if ((b & 0xC0u) != 0x80u) return 0;
    cp = (cp << 6) | (b & 0x3Fu);
  }
  if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
      (cp >= 0xD800 && cp <= 0xDFFF))
    return 0;
  return len;
}

// The byte offset of the first invalid UTF-8 sequence in `s`, if any.
std::optional<std::size_t> invalid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const std::size_t n = utf8_sequence(s, i);
    if (n == 0) return i;
    i += n;
  }
  return std::nullopt;
}

// Appends `s` as a JSON string the way serde_json (the safetensors library's JSON writer)
// does: '"' and '\\' escaped, \b \t \n \f \r for those control characters, \u00xx (lower
// case hex) for the other ones below 0x20, everything else (UTF-8 included) as is.
void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += kHex[c >> 4];
          out += kHex[c & 0xF];
        } else {
          out += ch;
        }
    }
  }
  out += '"';
}

// "'name'" for messages: the name with the JSON escapes, so that control characters and
// quotes stay readable on one line.
std::string quote_name(std::string_view s) {
  std::string json;
  append_json_string(json, s);
  return fmt::format("'{}'", std::string_view(json).substr(1, json.size() - 2));
}

std::string system_reason(int err) { return std::generic_category().message(err); }

// --- The header reader ------------------------------------------------------------------

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;
  std::uint64_t nbytes = 0;  // from dtype and shape
};

struct Header {
  std::vector<TensorEntry> tensors;  // in header order
  std::map<std::string, std::string> metadata;
};

[[noreturn]] void corrupt(const std::string& path, std::string_view problem) {
  throw IOError(fmt::format("safetensors file '{}' is corrupt: {}", path, problem));
}

// A strict reader for the subset of JSON a safetensors header is made of: one object whose
// values are tensor entries ({"dtype": string, "shape": [integers], "data_offsets":
// [integer, integer]}) or, under "__metadata__", an object of strings. Anything else
// (numbers that are negative, fractional or exponential, true/false/null, other nesting,
// unknown or duplicate keys, trailing characters other than whitespace) is refused.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  Header parse() {
    if (auto bad = invalid_utf8(s_)) fail_at(*bad, "the header is not valid UTF-8");
    Header h;
    std::set<std::string> seen;
    skip_ws();
    expect('{', "'{' (the header must be a JSON object)");
    skip_ws();
    if (!consume('}')) {
      for (;;) {
        skip_ws();
        const std::size_t key_pos = pos_;
        std::string key = parse_string("a tensor name");
        if (!seen.insert(key).second)
          fail_at(key_pos, key == "__metadata__"
                               ? std::string("\"__metadata__\" appears twice")
                               : fmt::format("tensor name {} appears twice", quote_name(key)));
        skip_ws();
        expect(':', "':'");
        skip_ws();
        if (key == "__metadata__")
          h.metadata = parse_metadata();
        else
          h.tensors.push_back(parse_tensor(std::move(key)));
        skip_ws();
        if (consume('}')) break;
        expect(',', "',' or '}'");
      }
    }
    skip_ws();
    if (pos_ != s_.size())
      fail_at(pos_,
              "unexpected characters after the header object (only space padding may "
              "follow it)");
    return h;
  }

 private:
  [[noreturn]] void fail_at(std::size_t pos, std::string_view problem) const {
    corrupt(path_, fmt::format("malformed header JSON at byte {} of the header: {}", pos, problem));
  }
  [[noreturn]] void fail(std::string_view problem) const { fail_at(pos_, problem); }

  void skip_ws() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r'))
      ++pos_;
  }
  bool consume(char c) {
    if (pos_ < s_.size() && s_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  std::string found() const {
    if (pos_ >= s_.size()) return "the end of the header";
    const auto c = static_cast<unsigned char>(s_[pos_]);
    if (c >= 0x20 && c < 0x7F) return fmt::format("'{}'", s_[pos_]);
    return fmt::format("byte 0x{:02x}", c);
  }
  void expect(char c, std::string_view what) {
    if (!consume(c)) fail(fmt::format("expected {}, found {}", what, found()));
  }

  unsigned hex_digit() {
    if (pos_ >= s_.size()) fail("unterminated \\u escape");
    const char c = s_[pos_++];
    if (c >= '0' && c <= '9') return static_cast<unsigned>(c - '0');
    if (c >= 'a' && c <= 'f') return static_cast<unsigned>(c - 'a' + 10);
    if (c >= 'A' && c <= 'F') return static_cast<unsigned>(c - 'A' + 10);
    fail_at(pos_ - 1, "a \\u escape needs four hex digits");
  }
  std::uint32_t hex4() {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v = (v << 4) | hex_digit();
    return v;
  }
  static void append_utf8(std::string& out, std::uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }

  std::string parse_string(std::string_view what) {
    if (!consume('"')) fail(fmt::format("expected {} (a string), found {}", what, found()));
    std::string out;
    for (;;) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (static_cast<unsigned char>(c) < 0x20)
        fail(fmt::format("control character 0x{:02x} in a string (it must be escaped)",
                         static_cast<unsigned>(static_cast<unsigned char>(c))));
      if (c != '\\') {
        out += c;
        ++pos_;
        continue;
      }
      const std::size_t escape_pos = pos_;
      ++pos_;
      if (pos_ >= s_.size()) fail("unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"':
          out += '"';
          break;
        case '\\':
          out += '\\';
          break;
        case '/':
          out += '/';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          std::uint32_t cp = hex4();
          if (cp >= 0xDC00 && cp <= 0xDFFF)
            fail_at(escape_pos, "a \\u escape holds a lone low surrogate");
          if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (!(pos_ + 1 < s_.size() && s_[pos_] == '\\' && s_[pos_ + 1] == 'u'))
              fail_at(escape_pos, "a \\u escape holds a high surrogate without its low half");
            pos_ += 2;
            const std::uint32_t low = hex4();
            if (low < 0xDC00 || low > 0xDFFF)
              fail_at(escape_pos, "a \\u escape holds a high surrogate without its low half");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, cp);
          break;
        }
        default:
          fail_at(escape_pos, fmt::format("unknown escape '\\{}'", e));
      }
    }
  }

  std::uint64_t parse_uint(std::string_view what) {
    const std::size_t start = pos_;
    if (pos_ >= s_.size() || s_[pos_] < '0' || s_[pos_] > '9')
      fail(fmt::format("expected {} (a non-negative integer), found {}", what, found()));
    std::uint64_t v = 0;
    while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') {
      const auto d = static_cast<std::uint64_t>(s_[pos_] - '0');
      if (v > (std::numeric_limits<std::uint64_t>::max() - d) / 10)
        fail_at(start, fmt::format("{} does not fit in 64 bits", what));
      v = v * 10 + d;
      ++pos_;
    }
    if (pos_ - start > 1 && s_[start] == '0')
      fail_at(start, fmt::format("{} has a leading zero", what));
    if (pos_ < s_.size() && (s_[pos_] == '.' || s_[pos_] == 'e' || s_[pos_] == 'E'))
      fail_at(start, fmt::format("{} must be an integer", what));
    return v;
  }

  std::vector<std::uint64_t> parse_uint_array(std::string_view what) {
    if (!consume('['))
      fail(fmt::format("expected {} (an array of non-negative integers), found {}", what, found()));
    std::vector<std::uint64_t> out;
    skip_ws();
    if (consume(']')) return out;
    for (;;) {
      skip_ws();
      out.push_back(parse_uint(fmt::format("an element of {}", what)));
      skip_ws();
      if (consume(']')) return out;
      expect(',', "',' or ']'");
    }
  }

  std::map<std::string, std::string> parse_metadata() {
    if (!consume('{'))
      fail(fmt::format("expected an object of strings for \"__metadata__\", found {}", found()));
    std::map<std::string, std::string> out;
    skip_ws();
    if (consume('}')) return out;
    for (;;) {
      skip_ws();
      const std::size_t key_pos = pos_;
      std::string key = parse_string("a metadata key");
      skip_ws();
      expect(':', "':'");
      skip_ws();
      std::string value =
          parse_string(fmt::format("the value of metadata key {}", quote_name(key)));
      if (!out.emplace(key, std::move(value)).second)
        fail_at(key_pos, fmt::format("metadata key {} appears twice", quote_name(key)));
      skip_ws();
      if (consume('}')) return out;
      expect(',', "',' or '}'");
    }
  }

  TensorEntry parse_tensor(std::string name) {
    const std::string who = fmt::format("tensor {}", quote_name(name));
    if (!consume('{')) fail(fmt::format("expected an object for {}, found {}", who, found()));
    TensorEntry t;
    t.name = std::move(name);
    bool have_dtype = false, have_shape = false, have_offsets = false;
    skip_ws();
    if (!consume('}')) {
      for (;;) {
        skip_ws();
        const std::size_t key_pos = pos_;
        const std::string key = parse_string(fmt::format("a key of {}", who));
        skip_ws();
        expect(':', "':'");
        skip_ws();
        bool* have = nullptr;
        if (key == "dtype") {
          have = &have_dtype;
          const std::size_t value_pos = pos_;
          const std::string code = parse_string(fmt::format("the dtype of {}", who));
          const auto dtype = dtype_of_code(code);
          if (!dtype)
            corrupt(path_, fmt::format("{} has the unknown dtype {} (mixtape reads F64, F32, F16, "
                                       "BF16, I64, I32, U8 and BOOL) at byte {} of the header",
                                       who, quote_name(code), value_pos));
          t.dtype = *dtype;
        } else if (key == "shape") {
          have = &have_shape;
          for (std::uint64_t d : parse_uint_array(fmt::format("the shape of {}", who))) {
            if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
              fail_at(key_pos, fmt::format("an extent of the shape of {} is too large", who));
            t.shape.push_back(static_cast<std::int64_t>(d));
          }
        } else if (key == "data_offsets") {
          have = &have_offsets;
          const std::size_t value_pos = pos_;
          const auto offsets = parse_uint_array(fmt::format("the data_offsets of {}", who));
          if (offsets.size() != 2)
            fail_at(value_pos, fmt::format("the data_offsets of {} must be [begin, end]; it "
                                           "has {} numbers",
                                           who, offsets.size()));
          t.begin = offsets[0];
          t.end = offsets[1];
        } else {
          fail_at(key_pos, fmt::format("{} has the unknown key {} (expected dtype, shape and "
                                       "data_offsets)",
                                       who, quote_name(key)));
        }
        if (*have) fail_at(key_pos, fmt::format("{} has the key {} twice", who, quote_name(key)));
        *have = true;
        skip_ws();
        if (consume('}')) break;
        expect(',', "',' or '}'");
      }
    }
    if (!have_dtype || !have_shape || !have_offsets)
      fail(fmt::format("{} lacks {}", who,
                       !have_dtype   ? "\"dtype\""
                       : !have_shape ? "\"shape\""
                                     : "\"data_offsets\""));
    return t;
  }

  std::string_view s_;
  const std::string& path_;
  std::size_t pos_ = 0;
};

std::string offsets_str(const TensorEntry& t) {
  return fmt::format("data_offsets [{}, {}]", t.begin, t.end);
}

// Checks each tensor's offsets against its dtype and shape, then that the tensors tile
// [0, data_size) without overlaps or holes. Returns the tensors in data order.
std::vector<const TensorEntry*> check_layout(const std::string& path, Header& h,
                                             std::uint64_t data_size) {
  for (auto& t : h.tensors) {
    std::uint64_t n = t.dtype.itemsize();
    for (std::int64_t d : t.shape) {
      const auto ud = static_cast<std::uint64_t>(d);
      if (ud != 0 && n > std::numeric_limits<std::uint64_t>::max() / ud)
        corrupt(path, fmt::format("tensor {} has shape {} whose size in bytes overflows 64 bits",
                                  quote_name(t.name), Shape(t.shape).str()));
      n *= ud;
    }
    if (n > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      corrupt(path, fmt::format("tensor {} has shape {}, too large", quote_name(t.name),
                                Shape(t.shape).str()));
    t.nbytes = n;
    if (t.end < t.begin)
      corrupt(path, fmt::format("tensor {} has {}, which end before they begin", quote_name(t.name),
                                offsets_str(t)));
    if (t.end - t.begin != n)
      corrupt(path, fmt::format("tensor {} of dtype {} and shape {} needs {} bytes but its {} "
                                "span {} bytes",
                                quote_name(t.name), code_of(t.dtype).code, Shape(t.shape).str(), n,
                                offsets_str(t), t.end - t.begin));
  }
  std::vector<const TensorEntry*> order;
  for (const auto& t : h.tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  std::uint64_t expected = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry* t : order) {
    if (t->begin < expected)
      corrupt(path, fmt::format("tensors {} ({}) and {} ({}) overlap", quote_name(previous->name),
                                offsets_str(*previous), quote_name(t->name), offsets_str(*t)));
    if (t->begin > expected)
      corrupt(path, previous
                        ? fmt::format("a hole of {} bytes between tensors {} ({}) and {} ({}); "
                                      "the tensors must be back to back",
                                      t->begin - expected, quote_name(previous->name),
                                      offsets_str(*previous), quote_name(t->name), offsets_str(*t))
                        : fmt::format("a hole of {} bytes before the first tensor {} ({}); the "
                                      "data must start at offset 0",
                                      t->begin, quote_name(t->name), offsets_str(*t)));
    expected = t->end;
    previous = t;
  }
  if (expected > data_size)
    corrupt(path, fmt::format("the data is truncated: the tensors need {} bytes after the header "
                              "but the file holds {}",
                              expected, data_size));
  if (expected < data_size)
    corrupt(path, fmt::format("{} bytes follow the end of the last tensor's data (the tensors "
                              "need {} bytes after the header, the file holds {})",
                              data_size - expected, expected, data_size));
  return order;
}

// Reverses the bytes of each element (for big-endian hosts; the format is little-endian).
void swap_elements(std::uint8_t* data, std::size_t nbytes, std::size_t itemsize) {
  if (itemsize < 2) return;
  for (std::size_t i = 0; i + itemsize <= nbytes; i += itemsize)
    std::reverse(data + i, data + i + itemsize);
}
constexpr bool kBigEndian = std::endian::native == std::endian::big;

// --- File I/O -----------------------------------------------------------------------------

// An open file descriptor, closed on destruction.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now; returns 0 or the errno of a failed close.
  int close() {
    const int fd = fd_;
    fd_ = -1;
    return ::close(fd) == 0 ? 0 : errno;
  }

 private:
  int fd_;
};

// Reads exactly `n` bytes at `offset`; returns 0, -1 at an early end of file, or an errno.
int read_at(int fd, void* buf, std::size_t n, std::uint64_t offset) {
  auto* p = static_cast<char*>(buf);
  while (n > 0) {
    const std::size_t chunk = std::min<std::size_t>(n, std::size_t{1} << 30);
    const ssize_t got = ::pread(fd, p, chunk, static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return -1;
    p += got;
    n -= static_cast<std::size_t>(got);
    offset += static_cast<std::uint64_t>(got);
  }
  return 0;
}

// Writes to a file descriptor through a buffer; large blocks go straight through.
class Writer {
 public:
  Writer(int fd, const std::string& path) : fd_(fd), path_(path) { buf_.reserve(kBuffer); }

  void write(const void* data, std::size_t n) {
    if (buf_.size() + n <= kBuffer) {
      const auto* p = static_cast<const char*>(data);
      buf_.insert(buf_.end(), p, p + n);
      return;
    }
    flush();
    if (n <= kBuffer / 2) {
      const auto* p = static_cast<const char*>(data);
      buf_.insert(buf_.end(), p, p + n);
    } else {
      write_all(data, n);
    }
  }
  void flush() {
    write_all(buf_.data(), buf_.size());
    buf_.clear();
  }

 private:
  static constexpr std::size_t kBuffer = std::size_t{1} << 20;

  void write_all(const void* data, std::size_t n) {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const std::size_t chunk = std::min<std::size_t>(n, std::size_t{1} << 30);
      const ssize_t put = ::write(fd_, p, chunk);
      if (put < 0) {
        if (errno == EINTR) continue;
        const int err = errno;
        throw IOError(fmt::format("safetensors: cannot write '{}': {}", path_, system_reason(err)));
      }
      p += put;
      n -= static_cast<std::size_t>(put);
    }
  }

  int fd_;
  const std::string& path_;
  std::vector<char> buf_;
};

// The temporary file of an atomic save: removed unless committed.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {}
  ~TempFile() {
    if (!committed_) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  void commit() { committed_ = true; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  bool committed_ = false;
};

// Best effort: makes a rename in `dir` durable (some file systems cannot fsync a directory).
void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

// --- Saving ---------------------------------------------------------------------------------

void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  // Everything that can be refused is checked before the temporary file exists.
  std::set<std::string_view> names;
  for (const auto& [name, t] : tensors) {
    if (!t.defined())
      throw ValueError(
          fmt::format("save_safetensors '{}': tensor {} is undefined", path, quote_name(name)));
    if (name == "__metadata__")
      throw ValueError(fmt::format(
          "save_safetensors '{}': \"__metadata__\" is reserved and cannot name a tensor", path));
    if (auto bad = invalid_utf8(name))
      throw ValueError(
          fmt::format("save_safetensors '{}': tensor name {} is not valid UTF-8 (at byte {})", path,
                      quote_name(name), *bad));
    if (!names.insert(name).second)
      throw ValueError(fmt::format("save_safetensors '{}': tensor name {} is given twice", path,
                                   quote_name(name)));
  }
  for (const auto& [key, value] : metadata) {
    if (auto bad = invalid_utf8(key))
      throw ValueError(
          fmt::format("save_safetensors '{}': metadata key {} is not valid UTF-8 (at byte {})",
                      path, quote_name(key), *bad));
    if (auto bad = invalid_utf8(value))
      throw ValueError(fmt::format(
          "save_safetensors '{}': the value of metadata key {} is not valid UTF-8 (at byte {})",
          path, quote_name(key), *bad));
  }

  // The safetensors library's order: decreasing alignment, then name.
  std::vector<std::size_t> order(tensors.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const int ra = code_of(tensors[a].second.dtype()).rank;
    const int rb = code_of(tensors[b].second.dtype()).rank;
    if (ra != rb) return ra > rb;
    return tensors[a].first < tensors[b].first;
  });

  // The header: compact JSON, "__metadata__" first, then the tensors in data order, each
  // with its keys in the order dtype, shape, data_offsets; padded with spaces to a multiple
  // of 8 bytes so that the data starts 8-byte aligned.
  std::string header = "{";
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [key, value] : metadata) {
      if (!first) header += ',';
      first = false;
      append_json_string(header, key);
      header += ':';
      append_json_string(header, value);
    }
    header += '}';
  }
  std::uint64_t offset = 0;
  for (std::size_t i : order) {
    const auto& [name, t] = tensors[i];
    if (header.size() > 1) header += ',';
    append_json_string(header, name);
    std::string shape;
    for (std::int64_t d : t.shape()) shape += fmt::format("{}{}", shape.empty() ? "" : ",", d);
    header += fmt::format(R"(:{{"dtype":"{}","shape":[{}],"data_offsets":[{},{}]}})",
                          code_of(t.dtype()).code, shape, offset, offset + t.nbytes());
    offset += t.nbytes();
  }
  header += '}';
  header.append((8 - header.size() % 8) % 8, ' ');

  std::array<std::uint8_t, 8> length{};
  for (int i = 0; i < 8; ++i)
    length[static_cast<std::size_t>(i)] =
        static_cast<std::uint8_t>(static_cast<std::uint64_t>(header.size()) >> (8 * i));

  TempFile tmp(fmt::format("{}.tmp-{}", path, static_cast<long>(::getpid())));
  Fd fd(::open(tmp.path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (fd.get() < 0) {
    const int err = errno;
    throw IOError(fmt::format("safetensors: cannot write '{}': cannot create '{}': {}", path,
                              tmp.path(), system_reason(err)));
  }
  Writer out(fd.get(), tmp.path());
  out.write(length.data(), length.size());
  out.write(header.data(), header.size());
  for (std::size_t i : order) {
    const Tensor& t = tensors[i].second;
    if (t.numel() == 0) continue;
    const Tensor host = detail::to_device_raw(t, Device::cpu());  // contiguous, on the host
    if constexpr (kBigEndian) {
      std::vector<std::uint8_t> bytes(host.nbytes());
      std::memcpy(bytes.data(), host.data_ptr(), bytes.size());
      swap_elements(bytes.data(), bytes.size(), t.dtype().itemsize());
      out.write(bytes.data(), bytes.size());
    } else {
      out.write(host.data_ptr(), host.nbytes());
    }
  }
  out.flush();
  if (::fsync(fd.get()) != 0) {
    const int err = errno;
    throw IOError(fmt::format("safetensors: cannot write '{}': fsync of '{}' failed: {}", path,
                              tmp.path(), system_reason(err)));
  }
  if (const int err = fd.close())
    throw IOError(fmt::format("safetensors: cannot write '{}': closing '{}' failed: {}", path,
                              tmp.path(), system_reason(err)));
  if (::rename(tmp.path().c_str(), path.c_str()) != 0) {
    const int err = errno;
    throw IOError(fmt::format("safetensors: cannot write '{}': renaming '{}' over it failed: {}",
                              path, tmp.path(), system_reason(err)));
  }
  tmp.commit();
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  sync_directory(dir.empty() ? std::string(".") : dir.string());
}

// --- Loading --------------------------------------------------------------------------------

const Tensor& SafetensorsFile::at(const std::string& name) const {
  for (const auto& [n, t] : tensors)
    if (n == name) return t;
  throw ValueError(fmt::format("safetensors: no tensor {} among the {} in the file",
                               quote_name(name), tensors.size()));
}

bool SafetensorsFile::contains(const std::string& name) const {
  return std::any_of(tensors.begin(), tensors.end(),
                     [&](const auto& entry) { return entry.first == name; });
}

SafetensorsFile load_safetensors(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    const int err = errno;
    throw IOError(fmt::format("safetensors: cannot read '{}': {}", path, system_reason(err)));
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    const int err = errno;
    throw IOError(fmt::format("safetensors: cannot read '{}': {}", path, system_reason(err)));
  }
  if (!S_ISREG(st.st_mode))
    throw IOError(fmt::format("safetensors: cannot read '{}': {}", path,
                              S_ISDIR(st.st_mode) ? system_reason(EISDIR) : "not a regular file"));
  const auto file_size = static_cast<std::uint64_t>(st.st_size);
  const auto read_or_throw = [&](void* buf, std::size_t n, std::uint64_t offset) {
    const int r = read_at(fd.get(), buf, n, offset);
    if (r == -1)
      corrupt(path, fmt::format("the file ended while reading {} bytes at offset {} (did it "
                                "change while being read?)",
                                n, offset));
    if (r != 0)
      throw IOError(fmt::format("safetensors: cannot read '{}': {}", path, system_reason(r)));
  };

  if (file_size < 8)
    corrupt(path, fmt::format("the file is {} bytes long, too short for the 8-byte header length",
                              file_size));
  std::array<std::uint8_t, 8> length{};
  read_or_throw(length.data(), length.size(), 0);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | length[static_cast<std::size_t>(i)];
  if (n > file_size - 8)
    corrupt(path, fmt::format("the header length {} runs past the end of the file ({} bytes, so "
                              "at most {} bytes of header)",
                              n, file_size, file_size - 8));
  if (n > kMaxHeaderSize)
    corrupt(path, fmt::format("the header length {} is above the format's limit of {} bytes", n,
                              kMaxHeaderSize));
  std::string text(static_cast<std::size_t>(n), '\0');
  read_or_throw(text.data(), text.size(), 8);

  Header header = HeaderParser(text, path).parse();
  const std::uint64_t data_start = 8 + n;
  const auto order = check_layout(path, header, file_size - data_start);

  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  file.tensors.reserve(order.size());
  for (const TensorEntry* e : order) {
    Tensor t = Tensor::empty(Shape(e->shape), e->dtype, Device::cpu());
    if (e->nbytes > 0) {
      auto* p = static_cast<std::uint8_t*>(t.data_ptr());
      read_or_throw(p, static_cast<std::size_t>(e->nbytes), data_start + e->begin);
      if constexpr (kBigEndian)
        swap_elements(p, static_cast<std::size_t>(e->nbytes), e->dtype.itemsize());
    }
    file.tensors.emplace_back(e->name, std::move(t));
  }
  return file;
}

}  // namespace mixtape
