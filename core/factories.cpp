// Tensor factories and the seeded generator.
#include <cmath>
#include <random>

#include "core/raw.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

struct Generator::State {
  std::mt19937_64 engine;
  bool has_spare = false;
  double spare = 0.0;
};

Generator::Generator(std::uint64_t seed) : state_(std::make_shared<State>()) { this->seed(seed); }

void Generator::seed(std::uint64_t seed) {
  state_->engine.seed(seed);
  state_->has_spare = false;
}

std::uint64_t Generator::next_u64() { return state_->engine(); }

double Generator::next_uniform() {
  // 53 random bits -> [0, 1), identical on every platform (std distributions are not).
  return static_cast<double>(next_u64() >> 11) * 0x1.0p-53;
}

double Generator::next_normal() {
  if (state_->has_spare) {
    state_->has_spare = false;
    return state_->spare;
  }
  // Box-Muller; u1 in (0, 1] so the log is finite.
  const double u1 = 1.0 - next_uniform();
  const double u2 = next_uniform();
  const double r = std::sqrt(-2.0 * std::log(u1));
  const double theta = 2.0 * 3.14159265358979323846 * u2;
  state_->spare = r * std::sin(theta);
  state_->has_spare = true;
  return r * std::cos(theta);
}

Generator& default_generator() {
  static Generator gen;
  return gen;
}

void manual_seed(std::uint64_t seed) { default_generator().seed(seed); }

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  Tensor t = Tensor::empty(shape, dtype, device);
  detail::fill_raw(t, value);
  return t;
}
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return full(shape, 0.0, dtype, device);
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return full(shape, 1.0, dtype, device);
}
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }
Tensor full_like(const Tensor& t, double value) {
  return full(t.shape(), value, t.dtype(), t.device());
}

Tensor arange(double start, double stop, double step, DType dtype, Device device) {
  if (step == 0.0 || !std::isfinite(start) || !std::isfinite(stop) || !std::isfinite(step))
    throw ValueError(fmt::format("arange: bad range start={} stop={} step={}", start, stop, step));
  const double span = std::ceil((stop - start) / step);
  const auto n = static_cast<std::int64_t>(span > 0 ? span : 0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i)
    v[static_cast<std::size_t>(i)] = start + static_cast<double>(i) * step;
  return detail::from_host(v.data(), v.size(), kFloat64, Shape{n}, dtype, device);
}

Tensor arange(std::int64_t stop, DType dtype, Device device) {
  if (stop < 0) throw ValueError(fmt::format("arange: negative stop {}", stop));
  std::vector<std::int64_t> v(static_cast<std::size_t>(stop));
  for (std::int64_t i = 0; i < stop; ++i) v[static_cast<std::size_t>(i)] = i;
  return detail::from_host(v.data(), v.size(), kInt64, Shape{stop}, dtype, device);
}

namespace {
// Fills a host buffer with `draw()` and moves it into a tensor of `dtype` on `device`.
template <typename Draw>
Tensor random_tensor(const Shape& shape, DType dtype, Device device, Draw draw) {
  const auto n = static_cast<std::size_t>(shape.numel());
  if (dtype == kFloat64) {
    std::vector<double> v(n);
    for (auto& x : v) x = draw();
    return detail::from_host(v.data(), n, kFloat64, shape, dtype, device);
  }
  if (dtype.is_floating()) {
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(draw());
    return detail::from_host(v.data(), n, kFloat32, shape, dtype, device);
  }
  std::vector<double> v(n);
  for (auto& x : v) x = std::floor(draw());
  return detail::from_host(v.data(), n, kFloat64, shape, dtype, device);
}
}  // namespace

Tensor uniform(const Shape& shape, double low, double high, DType dtype, Device device,
               Generator* gen) {
  if (!(high >= low)) throw ValueError(fmt::format("uniform: high {} < low {}", high, low));
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, dtype, device, [&] { return low + (high - low) * g.next_uniform(); });
}

Tensor normal(const Shape& shape, double mean, double stddev, DType dtype, Device device,
              Generator* gen) {
  if (!(stddev >= 0)) throw ValueError(fmt::format("normal: negative stddev {}", stddev));
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, dtype, device, [&] { return mean + stddev * g.next_normal(); });
}

}  // namespace mixtape
