// Tensor factories and the seeded generator.
#include <cmath>
#include <limits>
#include <mutex>
#include <random>

#include "core/raw.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

// The engine and the spare normal of Box-Muller, behind one recursive mutex (a thread
// holding Generator::lock() may draw through the public functions, which lock again).
struct Generator::State {
  std::recursive_mutex mutex;
  std::mt19937_64 engine;
  bool has_spare = false;
  double spare = 0.0;

  // The draws, for a caller that holds `mutex`.
  std::uint64_t u64() { return engine(); }
  // 53 random bits -> [0, 1), identical on every platform (std distributions are not).
  double uniform() { return static_cast<double>(u64() >> 11) * 0x1.0p-53; }
  double normal() {
    if (has_spare) {
      has_spare = false;
      return spare;
    }
    // Box-Muller; u1 in (0, 1] so the log is finite.
    const double u1 = 1.0 - uniform();
    const double u2 = uniform();
    const double r = std::sqrt(-2.0 * std::log(u1));
    const double theta = 2.0 * 3.14159265358979323846 * u2;
    spare = r * std::sin(theta);
    has_spare = true;
    return r * std::cos(theta);
  }
};

namespace detail {
// The factories hold the lock for a whole tensor and draw without locking per number.
struct GeneratorAccess {
  static Generator::State& state(Generator& g) {
    forbid_draw();
    return *g.state_;
  }
  // A draw while a step is captured would be repeated, the same, by every replay.
  static void forbid_draw() {
    capture::forbid(
        "a random draw from a Generator (a random factory or initializer; dropout and the "
        "augmentation layers draw through draw_seed and host_computed, which a capture "
        "replays)");
  }
};
}  // namespace detail

Generator::Generator(std::uint64_t seed) : state_(std::make_shared<State>()) { this->seed(seed); }

void Generator::seed(std::uint64_t seed) {
  std::lock_guard<std::recursive_mutex> hold(state_->mutex);
  state_->engine.seed(seed);
  state_->has_spare = false;
}

std::unique_lock<std::recursive_mutex> Generator::lock() const {
  return std::unique_lock<std::recursive_mutex>(state_->mutex);
}

std::uint64_t Generator::next_u64() {
  detail::GeneratorAccess::forbid_draw();
  std::lock_guard<std::recursive_mutex> hold(state_->mutex);
  return state_->u64();
}

double Generator::next_uniform() {
  detail::GeneratorAccess::forbid_draw();
  std::lock_guard<std::recursive_mutex> hold(state_->mutex);
  return state_->uniform();
}

double Generator::next_normal() {
  detail::GeneratorAccess::forbid_draw();
  std::lock_guard<std::recursive_mutex> hold(state_->mutex);
  return state_->normal();
}

Generator& default_generator() {
  static Generator gen;
  return gen;
}

void manual_seed(std::uint64_t seed) { default_generator().seed(seed); }

namespace {

Tensor filled(const Shape& shape, double value, DType dtype, Device device, const char* op) {
  Tensor t = detail::empty_raw(shape, dtype, device, op);
  detail::fill_raw(t, value);
  return t;
}

}  // namespace

Tensor full(const Shape& shape, double value, DType dtype, Device device) {
  return filled(shape, value, dtype, device, "full");
}
Tensor zeros(const Shape& shape, DType dtype, Device device) {
  return filled(shape, 0.0, dtype, device, "zeros");
}
Tensor ones(const Shape& shape, DType dtype, Device device) {
  return filled(shape, 1.0, dtype, device, "ones");
}
Tensor zeros_like(const Tensor& t) { return zeros(t.shape(), t.dtype(), t.device()); }
Tensor ones_like(const Tensor& t) { return ones(t.shape(), t.dtype(), t.device()); }
Tensor full_like(const Tensor& t, double value) {
  return full(t.shape(), value, t.dtype(), t.device());
}

namespace {

// The element count of arange's range, checked before anything is allocated: the values
// are made in a float64 host buffer, so count * 8 bytes must fit in int64 (and then the
// result's bytes fit too: no dtype is wider).
std::int64_t arange_count(double count, const std::string& range) {
  if (!(count > 0)) return 0;
  // 2^63 is exact as a double; anything at or above it does not fit in int64.
  constexpr double kLimit = 9223372036854775808.0;
  if (count < kLimit && try_nbytes(Shape{static_cast<std::int64_t>(count)}, sizeof(double)))
    return static_cast<std::int64_t>(count);
  throw ValueError(
      fmt::format("arange: the range {} has {} elements, more than a tensor can hold (its "
                  "size in bytes would overflow int64)",
                  range, count));
}

}  // namespace

Tensor arange(double start, double stop, double step, DType dtype, Device device) {
  if (step == 0.0 || !std::isfinite(start) || !std::isfinite(stop) || !std::isfinite(step))
    throw ValueError(fmt::format("arange: bad range start={} stop={} step={}", start, stop, step));
  const std::int64_t n = arange_count(std::ceil((stop - start) / step),
                                      fmt::format("[{}, {}) by step {}", start, stop, step));
  Tensor host = detail::empty_raw(Shape{n}, kFloat64, Device::cpu(), "arange");
  double* v = host.data<double>();
  for (std::int64_t i = 0; i < n; ++i) v[i] = start + static_cast<double>(i) * step;
  return detail::to_device_raw(detail::cast_raw(host, dtype), device);
}

Tensor arange(std::int64_t stop, DType dtype, Device device) {
  if (stop < 0) throw ValueError(fmt::format("arange: negative stop {}", stop));
  const std::int64_t n = stop;  // made in an int64 host buffer, as wide as any dtype
  if (!try_nbytes(Shape{n}, sizeof(std::int64_t)))
    throw ValueError(
        fmt::format("arange: the range [0, {}) has {} elements, more than a tensor can hold (its "
                    "size in bytes would overflow int64)",
                    stop, n));
  Tensor host = detail::empty_raw(Shape{n}, kInt64, Device::cpu(), "arange");
  std::int64_t* v = host.data<std::int64_t>();
  for (std::int64_t i = 0; i < n; ++i) v[i] = i;
  return detail::to_device_raw(detail::cast_raw(host, dtype), device);
}

namespace {

// A tensor of `shape` filled with draw(state) in row-major order: drawn into a float64
// (float64 and integer dtypes, the latter floored) or float32 host tensor while `gen` is
// held, so that the tensor is one consecutive run of its sequence, then cast to `dtype`
// and copied to `device`. The tensor asked for is size-checked before the host buffer is
// allocated.
template <typename Draw>
Tensor random_tensor(const Shape& shape, DType dtype, Device device, Generator& gen, const char* op,
                     Draw draw) {
  checked_nbytes(shape, dtype, op);
  const DType host_dtype = dtype.is_floating() && dtype != kFloat64 ? kFloat32 : kFloat64;
  Tensor host = detail::empty_raw(shape, host_dtype, Device::cpu(), op);
  const std::int64_t n = host.numel();
  {
    auto hold = gen.lock();
    auto& state = detail::GeneratorAccess::state(gen);
    if (host_dtype == kFloat32) {
      float* v = host.data<float>();
      for (std::int64_t i = 0; i < n; ++i) v[i] = static_cast<float>(draw(state));
    } else if (dtype.is_floating()) {
      double* v = host.data<double>();
      for (std::int64_t i = 0; i < n; ++i) v[i] = draw(state);
    } else {
      double* v = host.data<double>();
      for (std::int64_t i = 0; i < n; ++i) v[i] = std::floor(draw(state));
    }
  }
  return detail::to_device_raw(detail::cast_raw(host, dtype), device);
}

}  // namespace

Tensor uniform(const Shape& shape, double low, double high, DType dtype, Device device,
               Generator* gen) {
  if (!(high >= low)) throw ValueError(fmt::format("uniform: high {} < low {}", high, low));
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, dtype, device, g, "uniform",
                       [&](auto& s) { return low + (high - low) * s.uniform(); });
}

Tensor normal(const Shape& shape, double mean, double stddev, DType dtype, Device device,
              Generator* gen) {
  if (!(stddev >= 0)) throw ValueError(fmt::format("normal: negative stddev {}", stddev));
  Generator& g = gen ? *gen : default_generator();
  return random_tensor(shape, dtype, device, g, "normal",
                       [&](auto& s) { return mean + stddev * s.normal(); });
}

}  // namespace mixtape
