// The image augmentation layers: each draw becomes a table of source pixels, and one take()
// gathers the batch (the constant fill through an extra row appended to the pixels). The table
// is drawn on the host; in a captured step before each replay (host_computed).
#include "mixtape/layers/augmentation.h"

#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <vector>

#include "layers/config_util.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/capture.h"

namespace mixtape::layers {

namespace {

// [batch, height, width, channels], or a ShapeError naming the layer.
void check_images(const Layer& layer, const Shape& shape) {
  if (shape.rank() != 4)
    throw ShapeError(
        fmt::format("layer '{}' ({}): expects images [batch, height, width, channels]; got {}",
                    layer.name(), layer.class_name(), shape.str()));
}

// The output pixel p of every image (flattened [batch * height * width]) is the input
// pixel source[p] (int64 on x's device, flattened the same way); with `use_fill`, source may
// name pixel batch * height * width: a row of `fill_value`.
Tensor gather_pixels(const Tensor& x, const Tensor& source, bool use_fill, double fill_value) {
  const std::int64_t n = x.dim(0), h = x.dim(1), w = x.dim(2), c = x.dim(3);
  Tensor pixels = reshape(x, {n * h * w, c});
  if (use_fill) pixels = concat({pixels, full({1, c}, fill_value, x.dtype(), x.device())}, 0);
  return reshape(take(pixels, source, 0), x.shape());
}

// The table of source pixels of a call on `x` that make() draws on the host, as an int64
// tensor on x's device: computed now, or, while a step is captured, before each replay
// (host_computed, mixtape/core/capture.h: each replay draws new moves, the ones eager steps
// would have drawn).
Tensor source_table(const Tensor& x, const std::function<std::vector<std::int64_t>()>& make) {
  const std::int64_t pixels = x.dim(0) * x.dim(1) * x.dim(2);
  return host_computed(Shape{pixels}, kInt64, x.device(),
                       [make, pixels] { return from_vector(make(), Shape{pixels}); });
}

// Where position i (of an axis of `size`) reads from when it lies outside [0, size), for
// Keras's fill modes; -1 for the constant fill.
enum class FillMode { Reflect, Wrap, Nearest, Constant };

FillMode parse_fill_mode(const Layer& layer, const std::string& name) {
  if (name == "reflect") return FillMode::Reflect;
  if (name == "wrap") return FillMode::Wrap;
  if (name == "nearest") return FillMode::Nearest;
  if (name == "constant") return FillMode::Constant;
  throw ValueError(fmt::format(
      "layer '{}' (RandomTranslation): fill_mode must be reflect, wrap, nearest or constant; "
      "got '{}'",
      layer.name(), name));
}

std::int64_t fill_index(std::int64_t i, std::int64_t size, FillMode mode) {
  if (i >= 0 && i < size) return i;
  switch (mode) {
    case FillMode::Reflect: {
      const std::int64_t period = 2 * size;
      const std::int64_t m = ((i % period) + period) % period;
      return m < size ? m : period - 1 - m;
    }
    case FillMode::Wrap:
      return ((i % size) + size) % size;
    case FillMode::Nearest:
      return i < 0 ? 0 : size - 1;
    case FillMode::Constant:
      return -1;
  }
  return -1;
}

void check_factor(const Layer& layer, const char* which, TranslationFactor f) {
  if (!(f.lower >= -1.0 && f.upper <= 1.0 && f.lower <= f.upper))
    throw ValueError(fmt::format(
        "layer '{}' (RandomTranslation): {}_factor must be a range (lower, upper) within [-1, "
        "1] with lower <= upper; got ({}, {})",
        layer.name(), which, f.lower, f.upper));
}

std::uint64_t seed_or_draw(const std::optional<std::uint64_t>& seed) {
  return seed ? *seed : default_generator().next_u64();
}

}  // namespace

// --- RandomTranslation --------------------------------------------------------------------

RandomTranslationLayer::RandomTranslationLayer(TranslationFactor height_factor,
                                               TranslationFactor width_factor,
                                               RandomTranslationOptions options)
    : Layer(detail::common_options(options), "RandomTranslation"),
      height_(height_factor),
      width_(width_factor),
      options_(std::move(options)),
      generator_(seed_or_draw(options_.seed)) {
  check_factor(*this, "height", height_);
  check_factor(*this, "width", width_);
  parse_fill_mode(*this, options_.fill_mode);
  if (options_.interpolation != "nearest")
    throw ValueError(fmt::format(
        "layer '{}' (RandomTranslation): interpolation '{}' is not supported; images move by "
        "whole pixels (\"nearest\")",
        name(), options_.interpolation));
}

Tensor RandomTranslationLayer::call(const Tensor& x, const CallContext& ctx) {
  check_images(*this, x.shape());
  if (!ctx.training || x.numel() == 0) return x;
  const std::int64_t n = x.dim(0), h = x.dim(1), w = x.dim(2);
  const FillMode mode = parse_fill_mode(*this, options_.fill_mode);
  // Whether a pixel of the table takes the fill: known after an eager call's draw; a captured
  // step's replays may need it whenever the mode is constant (the fill row appended then
  // changes no value).
  bool any_fill = capture::active() && mode == FillMode::Constant;
  bool* const found_fill = capture::active() ? nullptr : &any_fill;  // the eager call's
  const Tensor source = source_table(x, [this, n, h, w, mode, found_fill] {
    std::vector<std::int64_t> source(static_cast<std::size_t>(n * h * w));
    auto lock = generator_.lock();
    for (std::int64_t b = 0; b < n; ++b) {
      const auto draw = [&](TranslationFactor f, std::int64_t size) {
        return std::llround((f.lower + (f.upper - f.lower) * generator_.next_uniform()) *
                            static_cast<double>(size));
      };
      const std::int64_t dy = draw(height_, h), dx = draw(width_, w);
      for (std::int64_t i = 0; i < h; ++i) {
        const std::int64_t si = fill_index(i - dy, h, mode);
        for (std::int64_t j = 0; j < w; ++j) {
          const std::int64_t sj = fill_index(j - dx, w, mode);
          std::int64_t& s = source[static_cast<std::size_t>((b * h + i) * w + j)];
          if (si < 0 || sj < 0) {
            s = n * h * w;  // the fill row
            if (found_fill) *found_fill = true;
          } else {
            s = (b * h + si) * w + sj;
          }
        }
      }
    }
    return source;
  });
  return gather_pixels(x, source, any_fill, options_.fill_value);
}

std::optional<Shape> RandomTranslationLayer::compute_output_shape(const Shape& input_shape) const {
  check_images(*this, input_shape);
  return input_shape;
}

LayerPtr<RandomTranslationLayer> RandomTranslation(TranslationFactor height_factor,
                                                   TranslationFactor width_factor,
                                                   RandomTranslationOptions options) {
  return make_layer<RandomTranslationLayer>(height_factor, width_factor, std::move(options));
}

// --- RandomFlip ---------------------------------------------------------------------------

RandomFlipLayer::RandomFlipLayer(std::string mode, RandomFlipOptions options)
    : Layer(detail::common_options(options), "RandomFlip"),
      mode_(std::move(mode)),
      options_(std::move(options)),
      generator_(seed_or_draw(options_.seed)) {
  if (mode_ != "horizontal" && mode_ != "vertical" && mode_ != "horizontal_and_vertical")
    throw ValueError(
        fmt::format("layer '{}' (RandomFlip): mode must be horizontal, vertical or "
                    "horizontal_and_vertical; got '{}'",
                    name(), mode_));
}

Tensor RandomFlipLayer::call(const Tensor& x, const CallContext& ctx) {
  check_images(*this, x.shape());
  if (!ctx.training || x.numel() == 0) return x;
  const std::int64_t n = x.dim(0), h = x.dim(1), w = x.dim(2);
  const bool horizontal = mode_ != "vertical", vertical = mode_ != "horizontal";
  const Tensor source = source_table(x, [this, n, h, w, horizontal, vertical] {
    std::vector<std::int64_t> source(static_cast<std::size_t>(n * h * w));
    auto lock = generator_.lock();
    for (std::int64_t b = 0; b < n; ++b) {
      const bool flip_w = horizontal && generator_.next_uniform() < 0.5;
      const bool flip_h = vertical && generator_.next_uniform() < 0.5;
      for (std::int64_t i = 0; i < h; ++i)
        for (std::int64_t j = 0; j < w; ++j)
          source[static_cast<std::size_t>((b * h + i) * w + j)] =
              (b * h + (flip_h ? h - 1 - i : i)) * w + (flip_w ? w - 1 - j : j);
    }
    return source;
  });
  return gather_pixels(x, source, false, 0.0);
}

std::optional<Shape> RandomFlipLayer::compute_output_shape(const Shape& input_shape) const {
  check_images(*this, input_shape);
  return input_shape;
}

LayerPtr<RandomFlipLayer> RandomFlip(std::string mode, RandomFlipOptions options) {
  return make_layer<RandomFlipLayer>(std::move(mode), std::move(options));
}

}  // namespace mixtape::layers
