// safetensors files: the writer (header JSON in the safetensors library's layout, written
// atomically by io/atomic_file.cpp) and the reader (the header parsed by
// nlohmann-json's SAX parser and held to the format's shape, then checks of every tensor's
// dtype, shape and offsets before any data is read). See include/mixtape/io/safetensors.h
// and docs/checkpoints.md.
#include "mixtape/io/safetensors.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "io/fd.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/error.h"
#include "mixtape/io/atomic_file.h"

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
    {kFloat8E5M2, "F8_E5M2", 3},
    {kFloat8E4M3FN, "F8_E4M3", 4},
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

bool is_json_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Reads a header with nlohmann-json's SAX parser and holds it to the format's shape: one
// object whose values are tensor entries ({"dtype": string, "shape": [integers],
// "data_offsets": [integer, integer]}) or, under "__metadata__", an object of strings.
//
// SAX rather than a DOM because a DOM would take what the format refuses: it keeps the last
// of two equal keys and takes any value anywhere. This handler checks each event against
// what may come next and refuses everything else: numbers that are negative, fractional,
// exponential, too large or with a leading zero, true/false/null, other nesting, unknown
// or repeated keys, anything but whitespace before or after the object. nlohmann tokenises and
// parses the JSON (escapes, surrogate pairs, control characters, the syntax); what stays ours is
// the UTF-8 check up front, the byte positions (SAX events carry none: the handler follows the
// tokens through the header text), the wording of each refusal (nlohmann's errors are mapped onto
// it) and, after the parse, check_layout's checks of the tensors.
class HeaderHandler final : public nlohmann::json_sax<nlohmann::json> {
 public:
  HeaderHandler(std::string_view text, const std::string& path) : s_(text), path_(path) {}

  Header parse() {
    if (auto bad = invalid_utf8(s_)) fail_at(*bad, "the header is not valid UTF-8");
    // Only whitespace before the '{' (nlohmann would also skip a byte order mark).
    start_ = skip_ws(0);
    if (start_ == s_.size() || s_[start_] != '{') unexpected();
    // strict: one JSON value and nothing after it (end_object checks that too); comments
    // are not JSON.
    if (!nlohmann::json::sax_parse(s_.begin(), s_.end(), this, nlohmann::json::input_format_t::json,
                                   /*strict=*/true, /*ignore_comments=*/false) ||
        expect_ != Expect::kDone)
      fail_at(end_, "the header ended early");  // not reached: the handler throws first
    return std::move(header_);
  }

  // Values the format has no place for (number_integer: nlohmann's negative numbers).
  bool null() override { return refuse(); }
  bool boolean(bool) override { return refuse(); }
  bool number_integer(number_integer_t) override { return refuse(); }
  bool binary(binary_t&) override { return refuse(); }

  bool number_unsigned(number_unsigned_t v) override {
    at_token();
    std::size_t digits = 1;
    for (auto x = v; x >= 10; x /= 10) ++digits;
    ends(digits, ',');
    if (expect_ != Expect::kNumber) unexpected();
    numbers_.push_back(v);
    return true;
  }

  // nlohmann's numbers with a fraction or an exponent, and its integers too large for 64
  // bits (`raw` is the number as written).
  bool number_float(number_float_t, const string_t& raw) override {
    at_token();
    if (expect_ != Expect::kNumber || raw.starts_with('-')) unexpected();
    not_an_integer(raw);
  }

  bool string(string_t& value) override {
    at_token();
    ends(string_length(), ',');
    if (expect_ == Expect::kMetadataValue) {
      if (!header_.metadata.emplace(key_, std::move(value)).second)
        fail_at(key_pos_, fmt::format("metadata key {} appears twice", quote_name(key_)));
      expect_ = Expect::kMetadataKey;
    } else if (expect_ == Expect::kDtype) {
      const auto dtype = dtype_of_code(value);
      if (!dtype)
        corrupt(path_,
                fmt::format("{} has the unknown dtype {} (mixtape reads F64, F32, F16, BF16, "
                            "F8_E4M3, F8_E5M2, I64, I32, U8 and BOOL) at byte {} of the header",
                            who_, quote_name(value), start_));
      tensor_.dtype = *dtype;
      once();
      expect_ = Expect::kTensorKey;
    } else {
      unexpected();
    }
    return true;
  }

  bool start_object(std::size_t) override {
    at_token();
    ends(1, 0);
    if (expect_ == Expect::kHeader)
      expect_ = Expect::kName;
    else if (expect_ == Expect::kEntry)
      expect_ = metadata_ ? Expect::kMetadataKey : Expect::kTensorKey;
    else
      unexpected();
    return true;
  }

  bool key(string_t& k) override {
    at_token();
    key_pos_ = start_;
    ends(string_length(), ':');
    switch (expect_) {
      case Expect::kName:
        if (!names_.insert(k).second)
          fail_at(key_pos_, k == "__metadata__"
                                ? std::string("\"__metadata__\" appears twice")
                                : fmt::format("tensor name {} appears twice", quote_name(k)));
        metadata_ = k == "__metadata__";
        tensor_ = TensorEntry{};
        tensor_.name = k;
        who_ = fmt::format("tensor {}", quote_name(k));
        have_dtype_ = have_shape_ = have_offsets_ = false;
        expect_ = Expect::kEntry;
        break;
      case Expect::kMetadataKey:
        expect_ = Expect::kMetadataValue;
        break;
      case Expect::kTensorKey:
        if (k == "dtype") {
          have_ = &have_dtype_;
          expect_ = Expect::kDtype;
        } else if (k == "shape" || k == "data_offsets") {
          shape_ = k == "shape";
          have_ = shape_ ? &have_shape_ : &have_offsets_;
          expect_ = Expect::kArray;
        } else {
          expect_ = Expect::kUnknownKey;
        }
        break;
      default:
        unexpected();
    }
    key_ = std::move(k);
    return true;
  }

  bool end_object() override {
    at_token();
    ends(1, ',');
    switch (expect_) {
      case Expect::kName: {
        // Checked here rather than left to the strict parse: nlohmann's lexer takes a NUL
        // byte for the end of its input, so "{}\0x" would pass.
        const std::size_t rest = skip_ws(end_);
        if (rest != s_.size())
          fail_at(rest,
                  "unexpected characters after the header object (only space padding may "
                  "follow it)");
        expect_ = Expect::kDone;
        break;
      }
      case Expect::kMetadataKey:
        expect_ = Expect::kName;
        break;
      case Expect::kTensorKey:
        if (!have_dtype_ || !have_shape_ || !have_offsets_)
          fail_at(end_, fmt::format("{} lacks {}", who_,
                                    !have_dtype_   ? "\"dtype\""
                                    : !have_shape_ ? "\"shape\""
                                                   : "\"data_offsets\""));
        header_.tensors.push_back(std::move(tensor_));
        expect_ = Expect::kName;
        break;
      default:
        unexpected();
    }
    return true;
  }

  bool start_array(std::size_t) override {
    at_token();
    ends(1, 0);
    if (expect_ != Expect::kArray) unexpected();
    array_pos_ = start_;
    numbers_.clear();
    expect_ = Expect::kNumber;
    return true;
  }

  bool end_array() override {
    at_token();
    ends(1, ',');
    if (expect_ != Expect::kNumber) unexpected();  // not reached: only shapes and offsets nest
    if (shape_) {
      for (std::uint64_t d : numbers_) {
        if (d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          fail_at(key_pos_, fmt::format("an extent of the shape of {} is too large", who_));
        tensor_.shape.push_back(static_cast<std::int64_t>(d));
      }
    } else {
      if (numbers_.size() != 2)
        fail_at(array_pos_, fmt::format("the data_offsets of {} must be [begin, end]; it has {} "
                                        "numbers",
                                        who_, numbers_.size()));
      tensor_.begin = numbers_[0];
      tensor_.end = numbers_[1];
    }
    once();
    expect_ = Expect::kTensorKey;
    return true;
  }

  // A token that does not fit where it is, or one that nlohmann's lexer refused. `position`
  // counts the bytes the lexer read (reading the end of the header counts as one).
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::json::exception& ex) override {
    if (!at_token()) {  // the ':' after a key, or the ',' after a value, is missing
      // nlohmann reads "02" as the numbers 0 and 2.
      if (expect_ == Expect::kNumber && start_ == end_ && start_ < s_.size() &&
          is_digit(s_[start_]) && s_[start_ - 1] == '0')
        fail_at(start_ - 1, fmt::format("{} has a leading zero", element()));
      fail_at(start_, fmt::format("expected {}, found {}",
                                  separator_ == ':'            ? "':'"
                                  : expect_ == Expect::kNumber ? "',' or ']'"
                                                               : "',' or '}'",
                                  found(start_)));
    }
    const char c = start_ < s_.size() ? s_[start_] : '\0';
    if (c == '"' && wants_string()) string_error(position, ex.what());
    // "2.", "1e", "1e999", or a number too large for a double.
    if (expect_ == Expect::kNumber && is_digit(c)) not_an_integer(s_.substr(start_));
    unexpected();
  }

 private:
  // What the next event must be.
  enum class Expect {
    kHeader,         // the header's '{'
    kName,           // a tensor name, "__metadata__", or the header's '}'
    kEntry,          // a tensor's object, or "__metadata__"'s
    kMetadataKey,    // a metadata key or the '}' of "__metadata__"
    kMetadataValue,  // a metadata value (a string)
    kTensorKey,      // "dtype", "shape", "data_offsets" or the tensor's '}'
    kDtype,          // a dtype code (a string)
    kUnknownKey,     // nothing: a key of a tensor that is none of those three, refused
                     // once its ':' is there (a missing ':' is reported first)
    kArray,          // the '[' of a shape or of data_offsets
    kNumber,         // an element of the array, or its ']'
    kDone,           // nothing: the header's '}' was the end
  };

  [[noreturn]] void fail_at(std::size_t pos, std::string_view problem) const {
    corrupt(path_, fmt::format("malformed header JSON at byte {} of the header: {}", pos, problem));
  }

  std::string found(std::size_t pos) const {
    if (pos >= s_.size()) return "the end of the header";
    const auto c = static_cast<unsigned char>(s_[pos]);
    if (c >= 0x20 && c < 0x7F) return fmt::format("'{}'", s_[pos]);
    return fmt::format("byte 0x{:02x}", c);
  }

  std::string element() const {
    return fmt::format("an element of the {} of {}", shape_ ? "shape" : "data_offsets", who_);
  }

  std::string expectation() const {
    switch (expect_) {
      case Expect::kHeader:
        return "'{' (the header must be a JSON object)";
      case Expect::kName:
        return "a tensor name (a string)";
      case Expect::kEntry:
        return metadata_ ? "an object of strings for \"__metadata__\""
                         : fmt::format("an object for {}", who_);
      case Expect::kMetadataKey:
        return "a metadata key (a string)";
      case Expect::kMetadataValue:
        return fmt::format("the value of metadata key {} (a string)", quote_name(key_));
      case Expect::kTensorKey:
        return fmt::format("a key of {} (a string)", who_);
      case Expect::kDtype:
        return fmt::format("the dtype of {} (a string)", who_);
      case Expect::kArray:
        return fmt::format("the {} of {} (an array of non-negative integers)",
                           shape_ ? "shape" : "data_offsets", who_);
      case Expect::kNumber:
        return fmt::format("{} (a non-negative integer)", element());
      case Expect::kUnknownKey:
      case Expect::kDone:
        break;
    }
    return "the end of the header";
  }

  bool wants_string() const {
    return expect_ == Expect::kName || expect_ == Expect::kMetadataKey ||
           expect_ == Expect::kTensorKey || expect_ == Expect::kMetadataValue ||
           expect_ == Expect::kDtype;
  }

  // The token at start_ is not what may come next.
  [[noreturn]] void unexpected() const {
    if (expect_ == Expect::kUnknownKey)
      fail_at(key_pos_, fmt::format("{} has the unknown key {} (expected dtype, shape and "
                                    "data_offsets)",
                                    who_, quote_name(key_)));
    fail_at(start_, fmt::format("expected {}, found {}", expectation(), found(start_)));
  }
  [[noreturn]] bool refuse() {
    at_token();
    unexpected();
  }

  // A tensor's key given twice: checked once its value is read, as before.
  void once() {
    if (*have_) fail_at(key_pos_, fmt::format("{} has the key {} twice", who_, quote_name(key_)));
    *have_ = true;
  }

  // A number that is not a 64-bit integer (`number` starts with its digits): too large, or
  // with a fraction or an exponent.
  [[noreturn]] void not_an_integer(std::string_view number) const {
    const std::string_view digits = number.substr(0, number.find_first_not_of("0123456789"));
    std::uint64_t v = 0;
    const bool fits =
        std::from_chars(digits.data(), digits.data() + digits.size(), v).ec == std::errc();
    fail_at(start_, fmt::format("{} {}", element(),
                                fits ? "must be an integer" : "does not fit in 64 bits"));
  }

  // A string nlohmann's lexer refused. Its messages (fixed text) name the problem, and
  // `position`, just past the byte where the lexer stopped, places it.
  [[noreturn]] void string_error(std::size_t position, std::string_view what) const {
    const auto says = [&](std::string_view m) { return what.find(m) != std::string_view::npos; };
    const auto byte_is = [&](std::size_t back, char c) {
      return position >= back && position - back < s_.size() && s_[position - back] == c;
    };
    if (position > s_.size()) {  // it read the end of the header
      if (says("4 hex digits")) fail_at(s_.size(), "unterminated \\u escape");
      if (says("missing closing quote") || says("after backslash"))
        fail_at(s_.size(), "unterminated string");
    }
    if (says("forbidden character after backslash") && byte_is(2, '\\')) {
      const auto e = static_cast<unsigned char>(s_[position - 1]);
      fail_at(position - 2, e >= 0x20 && e < 0x7F
                                ? fmt::format("unknown escape '\\{}'", static_cast<char>(e))
                                : fmt::format("unknown escape: '\\' followed by byte 0x{:02x}", e));
    }
    if (says("4 hex digits") && position <= s_.size())
      fail_at(position - 1, "a \\u escape needs four hex digits");
    if (says("must follow U+D800..U+DBFF") && byte_is(6, '\\'))
      fail_at(position - 6, "a \\u escape holds a lone low surrogate");
    // Stopped after the high surrogate's \uXXXX and one byte, a backslash and one byte, or
    // a second \uXXXX.
    if (says("must be followed by U+DC00..U+DFFF"))
      for (std::size_t back : {7, 8, 12})
        if (byte_is(back, '\\') && byte_is(back - 1, 'u'))
          fail_at(position - back, "a \\u escape holds a high surrogate without its low half");
    if (says("control character") && position >= 1 && position <= s_.size() &&
        static_cast<unsigned char>(s_[position - 1]) < 0x20)
      fail_at(position - 1, fmt::format("control character 0x{:02x} in a string (it must be "
                                        "escaped)",
                                        static_cast<unsigned char>(s_[position - 1])));
    // Not reached with nlohmann 3.11's messages; say what nlohmann says, without its
    // "[json.exception.parse_error.101] parse error at line 1, column 9: ".
    if (const auto cut = what.find("] "); cut != std::string_view::npos)
      what.remove_prefix(cut + 2);
    if (what.starts_with("parse error"))
      if (const auto cut = what.find(": "); cut != std::string_view::npos)
        what.remove_prefix(cut + 2);
    fail_at(start_, what);
  }

  // Token positions. Between two events the header holds only whitespace and the ':' or
  // ',' that the syntax puts there, so each event's token starts after those, past where
  // the last event's token ended.
  std::size_t skip_ws(std::size_t p) const {
    while (p < s_.size() && is_json_space(s_[p])) ++p;
    return p;
  }
  // Moves start_ to the current event's token; false when the ':' or ',' due after the
  // last token is not there (only at a parse error, or before a '}' or ']').
  bool at_token() {
    std::size_t p = skip_ws(end_);
    const bool separated = separator_ == 0 || (p < s_.size() && s_[p] == separator_);
    if (separator_ != 0 && separated) p = skip_ws(p + 1);
    start_ = p;
    return separated;
  }
  // The current token is `length` bytes long and `separator` may follow it.
  void ends(std::size_t length, char separator) {
    end_ = start_ + length;
    separator_ = separator;
  }
  // The length of the string token at start_ (nlohmann has read it: it is well formed).
  std::size_t string_length() const {
    std::size_t i = start_ + 1;
    while (i < s_.size() && s_[i] != '"') i += s_[i] == '\\' ? 2 : 1;
    return i + 1 - start_;
  }

  std::string_view s_;
  const std::string& path_;
  std::size_t start_ = 0, end_ = 0;  // the current token
  char separator_ = 0;               // what may follow it: ':', ',' or nothing
  Expect expect_ = Expect::kHeader;

  Header header_;
  std::set<std::string> names_;  // tensor names and "__metadata__"
  bool metadata_ = false;        // the current name is "__metadata__"
  std::string key_;              // the current key
  std::size_t key_pos_ = 0;
  TensorEntry tensor_;
  std::string who_;  // "tensor 'name'"
  bool have_dtype_ = false, have_shape_ = false, have_offsets_ = false;
  bool* have_ = nullptr;  // the flag of the current key
  bool shape_ = false;    // the current array is the shape (else data_offsets)
  std::size_t array_pos_ = 0;
  std::vector<std::uint64_t> numbers_;
};

std::string offsets_str(const TensorEntry& t) {
  return fmt::format("data_offsets [{}, {}]", t.begin, t.end);
}

// Checks each tensor's offsets against its dtype and shape, then that the tensors tile
// [0, data_size) without overlaps or holes. Returns the tensors in data order.
std::vector<const TensorEntry*> check_layout(const std::string& path, Header& h,
                                             std::uint64_t data_size) {
  for (auto& t : h.tensors) {
    // core's overflow-checked size (the shape's extents are >= 0: the parser refuses others).
    const auto nbytes = try_nbytes(Shape(t.shape), t.dtype.itemsize());
    if (!nbytes)
      corrupt(path, fmt::format("tensor {} of dtype {} has shape {}, whose size overflows int64",
                                quote_name(t.name), code_of(t.dtype).code, Shape(t.shape).str()));
    const auto n = static_cast<std::uint64_t>(*nbytes);
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

  detail::write_file_atomically(path, "safetensors", [&](detail::FileSink& out) {
    out.write(length.data(), length.size());
    out.write(header.data(), header.size());
    for (std::size_t i : order) {
      const Tensor& t = tensors[i].second;
      if (t.numel() == 0) continue;
      NoGradGuard no_grad;
      const Tensor host = t.to(Device::cpu()).contiguous();  // row-major, on the host
      if constexpr (kBigEndian) {
        std::vector<std::uint8_t> bytes(host.nbytes());
        std::memcpy(bytes.data(), host.const_data_ptr(), bytes.size());
        swap_elements(bytes.data(), bytes.size(), t.dtype().itemsize());
        out.write(bytes.data(), bytes.size());
      } else {
        out.write(host.const_data_ptr(), host.nbytes());
      }
    }
  });
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

// What a path that is not a regular file is, for messages.
static const char* kind_of(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

SafetensorsFile load_safetensors(const std::string& path) {
  // O_NONBLOCK: opening a FIFO without a writer would wait for one forever; it is refused
  // below like any file that is not a regular one (reads of a regular file never block).
  detail::Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
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
    throw IOError(fmt::format("safetensors: cannot read '{}': it is {}, not a regular file", path,
                              kind_of(st.st_mode)));
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

  Header header = HeaderHandler(text, path).parse();
  const std::uint64_t data_start = 8 + n;
  const auto order = check_layout(path, header, file_size - data_start);

  SafetensorsFile file;
  file.metadata = std::move(header.metadata);
  file.tensors.reserve(order.size());
  for (const TensorEntry* e : order) {
    Tensor t;
    try {
      t = Tensor::empty(Shape(e->shape), e->dtype);
    } catch (const OutOfMemoryError& oom) {
      oom.rethrow_with_prefix(
          fmt::format("load_safetensors '{}': tensor {}: ", path, quote_name(e->name)));
    }
    if (e->nbytes > 0) {
      auto* p = static_cast<std::uint8_t*>(t.data_ptr());
      read_or_throw(p, static_cast<std::size_t>(e->nbytes), data_start + e->begin);
      if constexpr (kBigEndian)
        swap_elements(p, static_cast<std::size_t>(e->nbytes), e->dtype.itemsize());
      // A BOOL byte is 0 or 1 (the format's and every reader's bool); another is no value.
      if (e->dtype == kBool)
        for (std::uint64_t i = 0; i < e->nbytes; ++i)
          if (p[i] > 1)
            throw ValueError(fmt::format(
                "safetensors file '{}': BOOL tensor {} holds the byte {} at flat position {} (a "
                "BOOL byte is 0 or 1)",
                path, quote_name(e->name), static_cast<int>(p[i]), i));
    }
    file.tensors.emplace_back(e->name, std::move(t));
  }
  return file;
}

}  // namespace mixtape
