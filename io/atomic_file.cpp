// Atomic file writes (include/mixtape/io/atomic_file.h): a temporary file beside the
// target, written through a buffer, fsync'ed, renamed over the target; stale temporaries of
// dead processes cleaned up. POSIX.
#include "mixtape/io/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <filesystem>
#include <limits>
#include <system_error>
#include <vector>

#include "io/fd.h"
#include "mixtape/core/error.h"

namespace mixtape::detail {
namespace {

std::string system_reason(int err) { return std::generic_category().message(err); }

// Writes to a file descriptor through a buffer; large blocks go straight through.
class Writer : public FileSink {
 public:
  Writer(int fd, const std::string& path, std::string_view format)
      : fd_(fd), path_(path), format_(format) {
    buf_.reserve(kBuffer);
  }

  void write(const void* data, std::size_t n) override {
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
        throw IOError(fmt::format("{}: cannot write '{}': {}", format_, path_, system_reason(err)));
      }
      p += put;
      n -= static_cast<std::size_t>(put);
    }
  }

  int fd_;
  const std::string& path_;
  std::string_view format_;
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

// Best effort: removes the temporaries that earlier saves of `path` left behind when their
// process died (killed or crashed mid-save): files named `<name of path>.tmp-<pid>` in
// path's directory whose process is gone. A temporary stays when its process exists (it
// may be saving right now), when it is our own, and when another process holds its lock
// (a save on another machine sharing the directory: the PID means nothing here). Errors
// are ignored: the save itself does not depend on this.
void remove_stale_temporaries(const std::string& path, std::string_view format) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  const std::string prefix = target.filename().string() + ".tmp-";
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) return;
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string_view digits = std::string_view(name).substr(prefix.size());
    long pid = 0;
    const auto [end, err] = std::from_chars(digits.data(), digits.data() + digits.size(), pid);
    if (err != std::errc() || end != digits.data() + digits.size() || pid <= 0 ||
        pid > std::numeric_limits<pid_t>::max() || digits.front() == '0')
      continue;
    if (static_cast<pid_t>(pid) == ::getpid()) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;  // alive
    Fd fd(::open(it->path().c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (fd.get() < 0) continue;
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) continue;  // in use
    if (::unlink(it->path().c_str()) == 0)
      spdlog::info("{}: removed '{}', left by process {} that died while writing '{}'", format,
                   it->path().string(), pid, path);
  }
}

// Best effort: makes a rename in `dir` durable (some file systems cannot fsync a directory).
void sync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_file_atomically(const std::string& path, std::string_view format,
                           const std::function<void(FileSink&)>& fill) {
  remove_stale_temporaries(path, format);
  TempFile tmp(fmt::format("{}.tmp-{}", path, static_cast<long>(::getpid())));
  Fd fd(::open(tmp.path().c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (fd.get() < 0) {
    const int err = errno;
    throw IOError(fmt::format("{}: cannot write '{}': cannot create '{}': {}", format, path,
                              tmp.path(), system_reason(err)));
  }
  // Held while writing (released when the process dies), so that the cleanup of another
  // process never removes a temporary that is being written.
  (void)::flock(fd.get(), LOCK_EX | LOCK_NB);
  Writer out(fd.get(), tmp.path(), format);
  fill(out);
  out.flush();
  if (::fsync(fd.get()) != 0) {
    const int err = errno;
    throw IOError(fmt::format("{}: cannot write '{}': fsync of '{}' failed: {}", format, path,
                              tmp.path(), system_reason(err)));
  }
  if (const int err = fd.close())
    throw IOError(fmt::format("{}: cannot write '{}': closing '{}' failed: {}", format, path,
                              tmp.path(), system_reason(err)));
  if (::rename(tmp.path().c_str(), path.c_str()) != 0) {
    const int err = errno;
    throw IOError(fmt::format("{}: cannot write '{}': renaming '{}' over it failed: {}", format,
                              path, tmp.path(), system_reason(err)));
  }
  tmp.commit();
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  sync_directory(dir.empty() ? std::string(".") : dir.string());
}

}  // namespace mixtape::detail
