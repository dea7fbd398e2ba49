#include "datasets/tarball.h"

#include <archive.h>
#include <archive_entry.h>
#include <fmt/format.h>
#include <zlib.h>

#include <limits>
#include <memory>

#include "mixtape/core/error.h"

namespace mixtape::datasets {

namespace {

struct ReadDeleter {
  void operator()(archive* a) const { archive_read_free(a); }
};

std::string reason(archive* a, const char* fallback) {
  const char* s = archive_error_string(a);
  return s != nullptr && *s != '\0' ? std::string(s) : std::string(fallback);
}

IOError unreadable(const std::string& problem) {
  return IOError(fmt::format("not a readable tar archive: {}", problem));
}

bool is_gzip(std::string_view bytes) {
  return bytes.size() >= 2 && static_cast<unsigned char>(bytes[0]) == 0x1f &&
         static_cast<unsigned char>(bytes[1]) == 0x8b;
}

// Inflates one gzip stream (zlib checks its CRC-32 and length) with nothing after it.
std::string gunzip(std::string_view bytes, std::size_t max_bytes) {
  if (bytes.size() > std::numeric_limits<uInt>::max())
    throw unreadable(fmt::format("{} bytes are more than zlib takes at once", bytes.size()));
  z_stream z{};
  if (inflateInit2(&z, 15 + 16) != Z_OK) throw unreadable("zlib inflateInit2 failed");
  struct End {
    z_stream* z;
    ~End() { inflateEnd(z); }
  } end{&z};
  z.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(bytes.data()));
  z.avail_in = static_cast<uInt>(bytes.size());
  std::string out;
  char buf[1 << 16];
  for (;;) {
    z.next_out = reinterpret_cast<Bytef*>(buf);
    z.avail_out = sizeof(buf);
    const int ret = inflate(&z, Z_NO_FLUSH);
    const std::size_t produced = sizeof(buf) - z.avail_out;
    if (out.size() + produced > max_bytes)
      throw unreadable(fmt::format("it inflates to more than the {} bytes allowed", max_bytes));
    out.append(buf, produced);
    if (ret == Z_STREAM_END) break;
    if (ret == Z_OK) continue;
    // The whole input was given: no progress means it ended before the stream did.
    if (ret == Z_BUF_ERROR)
      throw unreadable("truncated gzip stream (it ends before its end marker)");
    throw unreadable(
        fmt::format("corrupt gzip stream (zlib: {})", z.msg != nullptr ? z.msg : "invalid data"));
  }
  if (z.avail_in != 0) throw unreadable(fmt::format("{} bytes follow the gzip stream", z.avail_in));
  return out;
}

}  // namespace

std::vector<TarMember> read_tar(std::string_view bytes,
                                const std::function<bool(const std::string&)>& want,
                                std::size_t max_tar_bytes) {
  std::string inflated;
  if (is_gzip(bytes)) {
    inflated = gunzip(bytes, max_tar_bytes);
    bytes = inflated;
  } else if (bytes.size() > max_tar_bytes) {
    throw unreadable(fmt::format("it holds more than the {} bytes allowed", max_tar_bytes));
  }
  std::unique_ptr<archive, ReadDeleter> owner(archive_read_new());
  archive* a = owner.get();
  if (a == nullptr) throw IOError("libarchive: out of memory");
  const auto fail = unreadable;
  if (archive_read_support_format_tar(a) != ARCHIVE_OK)
    throw fail(reason(a, "libarchive lacks tar support"));
  if (archive_read_open_memory(a, bytes.data(), bytes.size()) != ARCHIVE_OK)
    throw fail(reason(a, "cannot open it"));

  std::vector<TarMember> members;
  for (;;) {
    archive_entry* entry = nullptr;
    const int rc = archive_read_next_header(a, &entry);
    if (rc == ARCHIVE_EOF) break;
    if (rc != ARCHIVE_OK && rc != ARCHIVE_WARN) throw fail(reason(a, "bad member header"));
    TarMember m;
    const char* path = archive_entry_pathname(entry);
    m.path = path != nullptr ? path : "";
    while (m.path.starts_with("./")) m.path.erase(0, 2);
    m.regular = archive_entry_filetype(entry) == AE_IFREG;
    // Every member's data is read, so that a tar cut short inside a member is noticed.
    const bool keep = m.regular && want(m.path);
    char buf[1 << 16];
    for (;;) {
      const la_ssize_t n = archive_read_data(a, buf, sizeof(buf));
      if (n == 0) break;
      if (n < 0) throw fail(fmt::format("member {}: {}", m.path, reason(a, "cannot read it")));
      if (keep) m.data.append(buf, static_cast<std::size_t>(n));
    }
    if (keep && archive_entry_size_is_set(entry) &&
        m.data.size() != static_cast<std::size_t>(archive_entry_size(entry)))
      throw fail(fmt::format("member {} is truncated ({} of {} bytes)", m.path, m.data.size(),
                             archive_entry_size(entry)));
    members.push_back(std::move(m));
  }
  return members;
}

}  // namespace mixtape::datasets
