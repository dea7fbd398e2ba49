// RandomTranslation and RandomFlip against per-pixel references.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using Catch::Matchers::Contains;
using mixtape_test::error_of;

namespace {

constexpr mt::CallContext kTraining{.training = true};

mt::Tensor images(const mt::Shape& shape, std::uint64_t seed, mt::DType dtype = mt::kFloat32) {
  mt::Generator gen(seed);
  return mt::normal(shape, 0.0, 1.0, dtype, mt::Device::cpu(), &gen);
}

std::vector<double> values(const mt::Tensor& t) { return t.to(mt::kFloat64).to_vector<double>(); }

// The pixel (b, i, j, c) of `x` [n, h, w, c] read at (i - dy, j - dx), for each fill mode.
double translated(const std::vector<double>& x, const mt::Shape& s, std::int64_t b, std::int64_t i,
                  std::int64_t j, std::int64_t c, std::int64_t dy, std::int64_t dx,
                  const std::string& mode, double fill) {
  const std::int64_t h = s[1], w = s[2], ch = s[3];
  auto fix = [&](std::int64_t k, std::int64_t n) -> std::int64_t {
    if (k >= 0 && k < n) return k;
    if (mode == "constant") return -1;
    if (mode == "nearest") return k < 0 ? 0 : n - 1;
    if (mode == "wrap") return ((k % n) + n) % n;
    // reflect: mirror about the edges, the edge pixel repeated, until inside.
    while (k < 0 || k >= n) k = k < 0 ? -k - 1 : 2 * n - 1 - k;
    return k;
  };
  const std::int64_t si = fix(i - dy, h), sj = fix(j - dx, w);
  if (si < 0 || sj < 0) return fill;
  return x[static_cast<std::size_t>(((b * h + si) * w + sj) * ch + c)];
}

}  // namespace

TEST_CASE("augmentation: RandomTranslation moves by whole pixels, each fill mode",
          "[augmentation]") {
  const mt::Shape shape{2, 5, 7, 3};
  const mt::Tensor x = images(shape, 1);
  const auto xv = values(x);
  // A range of one value fixes the move: 0.4 * 5 = 2 rows down, -3/7 * 7 = 3 columns left;
  // 1.0 moves a whole image away, where only the fill (or its mirror) is left.
  for (const auto& [fy, fx, dy, dx] :
       std::vector<std::tuple<double, double, std::int64_t, std::int64_t>>{
           {0.4, -3.0 / 7.0, 2, -3}, {-0.2, 0.0, -1, 0}, {1.0, 1.0, 5, 7}}) {
    for (const std::string mode : {"reflect", "wrap", "nearest", "constant"}) {
      INFO(mode << " dy " << dy << " dx " << dx);
      auto layer =
          ml::RandomTranslation({fy, fy}, {fx, fx}, {.fill_mode = mode, .fill_value = 0.5});
      const auto out = values(layer(x, kTraining));
      REQUIRE(out.size() == xv.size());
      std::size_t k = 0;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t i = 0; i < 5; ++i)
          for (std::int64_t j = 0; j < 7; ++j)
            for (std::int64_t c = 0; c < 3; ++c)
              CHECK(out[k++] == translated(xv, shape, b, i, j, c, dy, dx, mode, 0.5));
    }
  }
}

TEST_CASE("augmentation: RandomTranslation draws a move per image, repeatably, only in training",
          "[augmentation]") {
  // One bright pixel per image at (4, 4) of 9x9: where it lands is the image's move.
  const std::int64_t n = 200;
  std::vector<float> pix(static_cast<std::size_t>(n * 81), 0.0f);
  for (std::int64_t b = 0; b < n; ++b) pix[static_cast<std::size_t>(b * 81 + 4 * 9 + 4)] = 1.0f;
  const mt::Tensor x = mt::from_vector(pix, {n, 9, 9, 1});
  auto moves = [&](const mt::Tensor& out) {
    std::vector<std::pair<std::int64_t, std::int64_t>> m;
    const auto v = values(out);
    for (std::int64_t b = 0; b < n; ++b)
      for (std::int64_t p = 0; p < 81; ++p)
        if (v[static_cast<std::size_t>(b * 81 + p)] == 1.0) m.emplace_back(p / 9 - 4, p % 9 - 4);
    return m;
  };
  auto layer = ml::RandomTranslation(0.25, {0.0, 0.25}, {.fill_mode = "constant", .seed = 9});
  const auto m = moves(layer(x, kTraining));
  REQUIRE(m.size() == static_cast<std::size_t>(n));  // the pixel stays inside: |move| <= 2
  std::set<std::pair<std::int64_t, std::int64_t>> kinds(m.begin(), m.end());
  for (const auto& [dy, dx] : m) {
    CHECK(std::abs(dy) <= 2);  // round(0.25 * 9)
    CHECK(dx >= 0);
    CHECK(dx <= 2);
  }
  CHECK(kinds.size() >= 12);  // 5 rows x 3 columns of moves, nearly all drawn
  // The next batch draws again; a layer of the same seed repeats the sequence.
  CHECK(moves(layer(x, kTraining)) != m);
  auto twin = ml::RandomTranslation(0.25, {0.0, 0.25}, {.fill_mode = "constant", .seed = 9});
  CHECK(moves(twin(x, kTraining)) == m);
  // Inference passes the input through: called without training, and in predict.
  CHECK(values(layer(x)) == values(x));
  auto in = ml::Input({9, 9, 1});
  mt::Model model(in, layer(in));
  CHECK(values(model.predict(x)) == values(x));
}

TEST_CASE("augmentation: gradients reach the pixels that were read (float64)",
          "[augmentation][grad]") {
  const mt::Tensor x = images({2, 4, 5, 2}, 3, mt::kFloat64);
  mt::PolicyScope scope("float64");
  for (const std::string mode : {"reflect", "constant"}) {
    INFO(mode);
    auto move = ml::RandomTranslation({0.25, 0.25}, {-0.4, -0.4}, {.fill_mode = mode});
    CHECK_GRADCHECK("RandomTranslation",
                    [&](const mtest::Inputs& v) { return move(v[0], kTraining); }, {x});
  }
  // The flips drawn change from call to call: each evaluation makes a layer of one seed, so
  // all of them draw the same flips.
  CHECK_GRADCHECK("RandomFlip",
                  [&](const mtest::Inputs& v) {
                    auto fixed = ml::RandomFlip("horizontal_and_vertical", {.seed = 4});
                    return fixed(v[0], kTraining);
                  },
                  {x});
}

TEST_CASE("augmentation: RandomFlip mirrors whole images per draw", "[augmentation]") {
  const std::int64_t n = 64;
  const mt::Shape shape{n, 3, 4, 2};
  const mt::Tensor x = images(shape, 5);
  const auto xv = values(x);
  auto kind_of = [&](const std::vector<double>& out, std::int64_t b) {
    // 0 unchanged, 1 left-right, 2 top-bottom, 3 both; -1 none of them.
    for (int kind = 0; kind < 4; ++kind) {
      bool same = true;
      for (std::int64_t i = 0; i < 3 && same; ++i)
        for (std::int64_t j = 0; j < 4 && same; ++j)
          for (std::int64_t c = 0; c < 2 && same; ++c) {
            const std::int64_t si = kind & 2 ? 2 - i : i, sj = kind & 1 ? 3 - j : j;
            same = out[static_cast<std::size_t>(((b * 3 + i) * 4 + j) * 2 + c)] ==
                   xv[static_cast<std::size_t>(((b * 3 + si) * 4 + sj) * 2 + c)];
          }
      if (same) return kind;
    }
    return -1;
  };
  for (const auto& [mode, allowed] : std::vector<std::pair<std::string, std::set<int>>>{
           {"horizontal", {0, 1}},
           {"vertical", {0, 2}},
           {"horizontal_and_vertical", {0, 1, 2, 3}}}) {
    INFO(mode);
    auto flip = ml::RandomFlip(mode, {.seed = 11});
    const auto out = values(flip(x, kTraining));
    std::set<int> seen;
    for (std::int64_t b = 0; b < n; ++b) seen.insert(kind_of(out, b));
    CHECK(seen == allowed);  // each allowed kind drawn in 64 images, and nothing else
    CHECK(values(flip(x)) == xv);
  }
}

TEST_CASE("augmentation: bfloat16 pixels move exactly under mixed_bfloat16", "[augmentation]") {
  mt::PolicyScope scope("mixed_bfloat16");
  const mt::Tensor x = images({3, 6, 6, 1}, 7);
  auto flip = ml::RandomFlip("horizontal", {.seed = 2});
  const mt::Tensor out = flip(x, kTraining);
  CHECK(out.dtype() == mt::kBFloat16);
  // Every output value is one of the input's values rounded to bfloat16 (a gather, no sums).
  const auto in16 = values(mt::cast(x, mt::kBFloat16));
  const std::multiset<double> a(in16.begin(), in16.end());
  const auto ov = values(out);
  const std::multiset<double> b(ov.begin(), ov.end());
  CHECK(a == b);
}

TEST_CASE("augmentation: bad arguments and inputs name the layer", "[augmentation]") {
  CHECK_THAT(
      error_of<mt::ValueError>([] { ml::RandomTranslation(0.1, 0.1, {.fill_mode = "mirror"}); }),
      Contains("RandomTranslation") && Contains("mirror"));
  CHECK_THAT(error_of<mt::ValueError>(
                 [] { ml::RandomTranslation(0.1, 0.1, {.interpolation = "bilinear"}); }),
             Contains("bilinear"));
  CHECK_THAT(error_of<mt::ValueError>([] {
               ml::RandomTranslation({0.3, 0.1}, {0.0, 0.0});
             }),
             Contains("height_factor") && Contains("(0.3, 0.1)"));
  CHECK_THROWS_AS(ml::RandomTranslation(0.0, 1.5), mt::ValueError);
  CHECK_THAT(error_of<mt::ValueError>([] { ml::RandomFlip("diagonal"); }),
             Contains("RandomFlip") && Contains("diagonal"));
  auto move = ml::RandomTranslation(0.1, 0.1, {.name = "shift"});
  CHECK_THAT(
      error_of<mt::ShapeError>([&] {
        move(images({2, 5, 5}, 1), kTraining);
      }),
      Contains("'shift'") && Contains("[2, 5, 5]") && Contains("[batch, height, width, channels]"));
  auto in = ml::Input({28, 28});
  CHECK_THROWS_AS(ml::RandomFlip()(in), mt::ShapeError);  // found when the graph is built
}

TEST_CASE("augmentation: the layers' configs make the same layers", "[augmentation][model-file]") {
  auto in = ml::Input({8, 8, 2});
  auto x = ml::RandomTranslation(
      {-0.25, 0.5}, 0.125,
      {.fill_mode = "wrap", .fill_value = 2.0, .seed = 21, .name = "move"})(in);
  x = ml::RandomFlip("vertical", {.seed = 22, .name = "flip"})(x);
  mt::Model model(in, ml::GlobalAveragePooling2D()(x));
  const auto copy = mt::model_from_json(model.to_json());
  auto* move = dynamic_cast<ml::RandomTranslationLayer*>(copy->get_layer("move").get());
  REQUIRE(move != nullptr);
  CHECK(move->height_factor() == ml::TranslationFactor{-0.25, 0.5});
  CHECK(move->width_factor() == ml::TranslationFactor{0.125});
  CHECK(move->get_config().get_string("fill_mode") == "wrap");
  auto* flip = dynamic_cast<ml::RandomFlipLayer*>(copy->get_layer("flip").get());
  REQUIRE(flip != nullptr);
  CHECK(flip->mode() == "vertical");
  // Seeded: the copy draws the same moves as the original.
  const mt::Tensor imgs = images({4, 8, 8, 2}, 23);
  CHECK(values(model(imgs, kTraining)) == values((*copy)(imgs, kTraining)));
}
