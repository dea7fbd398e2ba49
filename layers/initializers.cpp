// Initializers: constants, Glorot / He variance scaling, uniform and normal.
#include "mixtape/layers/initializers.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "core/raw.h"
#include "mixtape/core/error.h"

namespace mixtape::init {

namespace {

struct Fans {
  double in = 1.0, out = 1.0;
};

// Keras' _compute_fans: [in, out] for matrices, receptive field times channels for
// convolution kernels [kh, kw, in, out].
Fans fans(const Shape& s) {
  if (s.rank() == 0) return {};
  if (s.rank() == 1) return {static_cast<double>(s[0]), static_cast<double>(s[0])};
  double receptive = 1.0;
  for (std::size_t i = 0; i + 2 < s.rank(); ++i) receptive *= static_cast<double>(s[i]);
  return {static_cast<double>(s[s.rank() - 2]) * receptive,
          static_cast<double>(s[s.rank() - 1]) * receptive};
}

// The generator a random initializer draws from: its own when seeded (restarted at every
// call, so that the same seed gives the same values), the default one otherwise, held for
// the whole tensor so that its values are one consecutive run of the generator's sequence
// even while other threads draw. The weight is allocated (on the host) before anything is
// drawn, so that one too large for memory is an OutOfMemoryError naming its own bytes,
// shape and dtype; the values are drawn in float64 a chunk at a time and cast into it (the
// same rounding as a cast of the whole float64 tensor, without a float64 copy of it).
template <typename Draw>
Tensor random_tensor(const std::string& name, const Shape& shape, DType dtype, Device device,
                     std::optional<std::uint64_t> seed, Draw draw) {
  Tensor out = detail::empty_raw(shape, dtype, Device::cpu(), name);
  constexpr std::int64_t kChunk = 1 << 16;
  const std::int64_t n = out.numel();
  Tensor chunk = detail::empty_raw(Shape{std::min(n, kChunk)}, kFloat64, Device::cpu(), name);
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  Generator own(seed.value_or(0));
  Generator& gen = seed ? own : default_generator();
  auto hold = gen.lock();
  for (std::int64_t begin = 0; begin < n; begin += kChunk) {
    const std::int64_t len = std::min(kChunk, n - begin);
    const Tensor part = len == chunk.numel() ? chunk : Tensor::view_of(chunk, {len}, {1}, 0);
    double* v = chunk.data<double>();
    for (std::int64_t i = 0; i < len; ++i) v[i] = draw(gen);
    const Tensor cast = detail::cast_raw(part, dtype);
    std::memcpy(dst, cast.const_data_ptr(), static_cast<std::size_t>(cast.nbytes()));
    dst += cast.nbytes();
  }
  return detail::to_device_raw(out, device);
}

// A standard normal sample redrawn until it lies within two standard deviations.
double truncated_normal(Generator& gen) {
  for (;;) {
    const double z = gen.next_normal();
    if (std::abs(z) <= 2.0) return z;
  }
}

// The standard deviation of N(0, 1) truncated to [-2, 2]: dividing by it makes the
// truncated distribution's variance the one asked for (as Keras' VarianceScaling does).
constexpr double kTruncatedStddev = 0.87962566103423978;

Initializer uniform_with(std::string name, double (*limit)(const Fans&),
                         std::optional<std::uint64_t> seed) {
  std::string label = name;
  return Initializer(std::move(name), [label, limit, seed](const Shape& s, DType dt, Device d) {
    const double l = limit(fans(s));
    return random_tensor(label, s, dt, d, seed,
                         [l](Generator& g) { return (2.0 * g.next_uniform() - 1.0) * l; });
  });
}

Initializer truncated_with(std::string name, double (*stddev)(const Fans&),
                           std::optional<std::uint64_t> seed) {
  std::string label = name;
  return Initializer(std::move(name), [label, stddev, seed](const Shape& s, DType dt, Device d) {
    const double sd = stddev(fans(s)) / kTruncatedStddev;
    return random_tensor(label, s, dt, d, seed,
                         [sd](Generator& g) { return truncated_normal(g) * sd; });
  });
}

// The named initializers, for get() (seedless versions).
struct Named {
  const char* name;
  Initializer (*make)();
};
const Named kNamed[] = {
    {"zeros", [] { return zeros(); }},
    {"ones", [] { return ones(); }},
    {"glorot_uniform", [] { return glorot_uniform(); }},
    {"glorot_normal", [] { return glorot_normal(); }},
    {"he_normal", [] { return he_normal(); }},
    {"he_uniform", [] { return he_uniform(); }},
    {"random_uniform", [] { return random_uniform(); }},
    {"random_normal", [] { return random_normal(); }},
};

}  // namespace

Initializer::Initializer(std::string name, Fn fn) : name_(std::move(name)), fn_(std::move(fn)) {
  if (!fn_) throw ValueError(fmt::format("initializer '{}' has no function", name_));
}

Initializer::Initializer(std::string_view name) : Initializer(get(name)) {}

Tensor Initializer::operator()(const Shape& shape, DType dtype, Device device) const {
  if (!dtype.is_floating())
    throw DTypeError(fmt::format("initializer '{}': needs a floating dtype; got {}", name_, dtype));
  return fn_(shape, dtype, device);
}

Initializer zeros() {
  return Initializer("zeros",
                     [](const Shape& s, DType dt, Device d) { return mixtape::zeros(s, dt, d); });
}

Initializer ones() {
  return Initializer("ones",
                     [](const Shape& s, DType dt, Device d) { return mixtape::ones(s, dt, d); });
}

Initializer constant(double value) {
  return Initializer(fmt::format("constant({})", value),
                     [value](const Shape& s, DType dt, Device d) { return full(s, value, dt, d); });
}

Initializer glorot_uniform(std::optional<std::uint64_t> seed) {
  return uniform_with(
      "glorot_uniform", [](const Fans& f) { return std::sqrt(6.0 / (f.in + f.out)); }, seed);
}

Initializer glorot_normal(std::optional<std::uint64_t> seed) {
  return truncated_with(
      "glorot_normal", [](const Fans& f) { return std::sqrt(2.0 / (f.in + f.out)); }, seed);
}

Initializer he_normal(std::optional<std::uint64_t> seed) {
  return truncated_with(
      "he_normal", [](const Fans& f) { return std::sqrt(2.0 / f.in); }, seed);
}

Initializer he_uniform(std::optional<std::uint64_t> seed) {
  return uniform_with(
      "he_uniform", [](const Fans& f) { return std::sqrt(6.0 / f.in); }, seed);
}

Initializer random_uniform(double low, double high, std::optional<std::uint64_t> seed) {
  if (!(low <= high))
    throw ValueError(fmt::format("random_uniform: low {} is above high {}", low, high));
  std::string label = fmt::format("random_uniform({}, {})", low, high);
  return Initializer(label, [label, low, high, seed](const Shape& s, DType dt, Device d) {
    return random_tensor(label, s, dt, d, seed, [low, high](Generator& g) {
      return low + (high - low) * g.next_uniform();
    });
  });
}

Initializer random_normal(double mean, double stddev, std::optional<std::uint64_t> seed) {
  if (!(stddev >= 0.0))
    throw ValueError(fmt::format("random_normal: stddev must be >= 0; got {}", stddev));
  std::string label = fmt::format("random_normal({}, {})", mean, stddev);
  return Initializer(label, [label, mean, stddev, seed](const Shape& s, DType dt, Device d) {
    return random_tensor(label, s, dt, d, seed,
                         [mean, stddev](Generator& g) { return mean + stddev * g.next_normal(); });
  });
}

Initializer get(std::string_view name) {
  for (const auto& n : kNamed)
    if (name == n.name) return n.make();
  throw ValueError(fmt::format("unknown initializer '{}'; valid names: {}", name, valid_names()));
}

std::string valid_names() {
  std::string out;
  for (const auto& n : kNamed) {
    if (!out.empty()) out += ", ";
    out += n.name;
  }
  return out;
}

}  // namespace mixtape::init
