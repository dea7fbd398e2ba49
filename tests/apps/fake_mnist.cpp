// Writes a small MNIST-shaped dataset (the four IDX files, gzip'd) into a directory, for
// the mixtape-mnist smoke test on machines without MNIST: 28x28 uint8 images where class k
// is a bright 6x6 square at a position of its own plus noise, so a model can learn it.
//   fake_mnist DIR [TRAIN_COUNT [TEST_COUNT]]
#include <mixtape/mixtape.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace mt = mixtape;

namespace {

void write_split(const std::string& dir, const std::string& prefix, std::int64_t n,
                 mt::Generator& gen) {
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
  if (argc < 2) {
    std::fprintf(stderr, "usage: fake_mnist DIR [TRAIN_COUNT [TEST_COUNT]]\n");
    return 2;
  }
  const std::int64_t train = argc > 2 ? std::atoll(argv[2]) : 2000;
  const std::int64_t test = argc > 3 ? std::atoll(argv[3]) : 500;
  try {
    mt::Generator gen(7);
    write_split(argv[1], "train", train, gen);
    write_split(argv[1], "test", test, gen);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fake_mnist: %s\n", e.what());
    return 1;
  }
  return 0;
}
