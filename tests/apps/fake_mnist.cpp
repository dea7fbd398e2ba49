// Writes a small MNIST-shaped dataset (the four IDX files, gzip'd) into a directory (created
// when missing), for the mixtape-mnist smoke test on machines without MNIST: 28x28 uint8
// images where class k is a bright 6x6 square at a position of its own plus noise, so a
// model can learn it.
//   fake_mnist DIR [TRAIN_COUNT [TEST_COUNT [BAD_AT [BAD_LABEL]]]]
// With BAD_AT, the training label at that index is BAD_LABEL (default 10) instead: a label
// file that MNIST's loaders must refuse (its labels are the classes 0 to 9).
#include <mixtape/mixtape.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace mt = mixtape;

namespace {

// A base-10 integer in [lo, hi], the whole argument; nullopt otherwise.
std::optional<std::int64_t> parse_int(const char* s, std::int64_t lo, std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(s, &end, 10);
  if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi) return std::nullopt;
  return v;
}

// The bad label to write: `label` at index `at` of the training labels.
struct BadLabel {
  std::int64_t at = -1;
  std::uint8_t label = 10;
};

void write_split(const std::string& dir, const std::string& prefix, std::int64_t n,
                 mt::Generator& gen, const BadLabel& bad = {}) {
  std::vector<std::uint8_t> images(static_cast<std::size_t>(n * 28 * 28));
  std::vector<std::uint8_t> labels(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<int>(gen.next_u64() % 10);
    labels[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(k);
    const int top = 2 + (k / 5) * 12 + static_cast<int>(gen.next_u64() % 4);
    const int left = 2 + (k % 5) * 5;
    for (int r = 0; r < 28; ++r)
      for (int c = 0; c < 28; ++c) {
        const bool on = r >= top && r < top + 6 && c >= left && c < left + 6;
        const auto noise = static_cast<int>(gen.next_u64() % 40);
        images[static_cast<std::size_t>((i * 28 + r) * 28 + c)] =
            static_cast<std::uint8_t>(on ? 215 + noise : noise);
      }
  }
  if (bad.at >= 0) labels[static_cast<std::size_t>(bad.at)] = bad.label;
  const std::string images_name =
      prefix == "train" ? "train-images-idx3-ubyte" : "t10k-images-idx3-ubyte";
  const std::string labels_name =
      prefix == "train" ? "train-labels-idx1-ubyte" : "t10k-labels-idx1-ubyte";
  mt::datasets::write_idx(dir + "/" + images_name + ".gz",
                          mt::from_vector(images, {n, 28, 28}, mt::kUInt8), /*gzip=*/true);
  mt::datasets::write_idx(dir + "/" + labels_name + ".gz", mt::from_vector(labels, {n}, mt::kUInt8),
                          /*gzip=*/true);
}

}  // namespace

int main(int argc, char** argv) {
  constexpr const char* kUsage =
      "usage: fake_mnist DIR [TRAIN_COUNT [TEST_COUNT [BAD_AT [BAD_LABEL]]]]\n";
  if (argc < 2 || argc > 6) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const auto train = argc > 2 ? parse_int(argv[2], 1, 10000000) : std::optional<std::int64_t>(2000);
  const auto test = argc > 3 ? parse_int(argv[3], 1, 10000000) : std::optional<std::int64_t>(500);
  BadLabel bad;
  std::optional<std::int64_t> at = -1, label = 10;
  if (train && argc > 4) at = parse_int(argv[4], 0, *train - 1);
  if (argc > 5) label = parse_int(argv[5], 0, 255);
  if (!train || !test || !at || !label) {
    std::fprintf(stderr, "fake_mnist: bad count, index or label\n%s", kUsage);
    return 2;
  }
  bad.at = *at;
  bad.label = static_cast<std::uint8_t>(*label);
  try {
    std::filesystem::create_directories(argv[1]);
    mt::Generator gen(7);
    write_split(argv[1], "train", *train, gen, bad);
    write_split(argv[1], "test", *test, gen);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fake_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
