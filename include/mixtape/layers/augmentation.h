// Image augmentation layers, as Keras's RandomTranslation and RandomFlip: while training
// they move or mirror each image of a batch by its own random draw; in inference (predict,
// evaluate, a call without training) they pass the input through unchanged. Put them at
// the front of a model so the augmentation is part of it (saved with it, skipped when the
// model predicts):
//
//   auto x = mt::layers::Reshape({28, 28, 1})(inputs);
//   x = mt::layers::RandomTranslation(0.1, 0.1)(x);  // up to 10% of height and width
//
// Inputs are images [batch, height, width, channels] of any dtype the backend can gather.
// The output pixel at (i, j) is the input pixel at a position the draw names (a whole-pixel
// move or a mirror), gathered with one take() per batch: exact in every dtype, and the
// gradient flows back to the pixels that were read.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "mixtape/layers/config.h"
#include "mixtape/layers/layer.h"
#include "mixtape/layers/options.h"

namespace mixtape::layers {

// --- RandomTranslation --------------------------------------------------------------------

// How far RandomTranslation moves, as a fraction of the height (width): `f` draws from
// [-f, f], `{lower, upper}` from [lower, upper].
struct TranslationFactor {
  double lower = 0.0, upper = 0.0;
  TranslationFactor() = default;                        // no translation
  TranslationFactor(double f) : lower(-f), upper(f) {}  // NOLINT: a number is a factor
  TranslationFactor(double lower_, double upper_) : lower(lower_), upper(upper_) {}
  friend bool operator==(const TranslationFactor&, const TranslationFactor&) = default;
};

struct RandomTranslationOptions {
  // What the pixels moved in from outside the image are (Keras's fill modes):
  //   "reflect" (d c b a | a b c d | d c b a), "wrap" (a b c d | a b c d | a b c d),
  //   "nearest" (a a a a | a b c d | d d d d), "constant" (k k k k | a b c d | k k k k).
  std::string fill_mode = "reflect";
  double fill_value = 0.0;                 // k, for "constant"
  std::string interpolation = "nearest";   // the only one: moves by whole pixels
  std::optional<std::uint64_t> seed = {};  // empty: drawn from the default generator
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(RandomTranslationOptions, fill_mode, fill_value, interpolation, seed);

// Moves each image by a random number of rows and columns: the height factor's draw times
// the height, rounded to whole pixels, and the same for columns. Positive moves go down
// (right).
// Factors must lie in [-1, 1] with lower <= upper; ValueError otherwise, and for an unknown
// fill mode or an interpolation other than "nearest".
class RandomTranslationLayer : public Layer {
 public:
  RandomTranslationLayer(TranslationFactor height_factor, TranslationFactor width_factor,
                         RandomTranslationOptions options = {});
  const TranslationFactor& height() const { return height_; }
  const TranslationFactor& width() const { return width_; }
  const RandomTranslationOptions& options() const { return options_; }
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  TranslationFactor height_factor() const { return height_; }
  TranslationFactor width_factor() const { return width_; }

 private:
  TranslationFactor height_, width_;
  RandomTranslationOptions options_;
  Generator generator_;
};
LayerPtr<RandomTranslationLayer> RandomTranslation(TranslationFactor height_factor,
                                                   TranslationFactor width_factor,
                                                   RandomTranslationOptions options = {});

// --- RandomFlip ---------------------------------------------------------------------------

struct RandomFlipOptions {
  std::optional<std::uint64_t> seed = {};  // empty: drawn from the default generator
  MIXTAPE_LAYER_OPTIONS_TAIL;
};
MIXTAPE_OPTIONS(RandomFlipOptions, seed);

// Mirrors each image with probability 1/2 per direction: mode "horizontal" (left-right),
// "vertical" (top-bottom) or "horizontal_and_vertical" (each drawn on its own); ValueError
// for another mode.
class RandomFlipLayer : public Layer {
 public:
  explicit RandomFlipLayer(std::string mode = "horizontal_and_vertical",
                           RandomFlipOptions options = {});
  const RandomFlipOptions& options() const { return options_; }
  Tensor call(const Tensor& x, const CallContext& ctx) override;
  std::optional<Shape> compute_output_shape(const Shape& input_shape) const override;
  const std::string& mode() const { return mode_; }

 private:
  std::string mode_;
  RandomFlipOptions options_;
  Generator generator_;
};
LayerPtr<RandomFlipLayer> RandomFlip(std::string mode = "horizontal_and_vertical",
                                     RandomFlipOptions options = {});

}  // namespace mixtape::layers
