// Initializers: how a layer's weights start (mt::init::glorot_uniform(), "he_normal", ...).
//
// An Initializer makes a tensor of a given shape and dtype. Random initializers draw from
// the default generator (mt::manual_seed makes them repeatable) unless given a seed of
// their own, in which case every call gives the same values. Fans are computed as Keras
// does: a [in, out] kernel has fan_in = in and fan_out = out; a convolution kernel
// [kh, kw, in, out] multiplies both by kh * kw.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "mixtape/core/tensor.h"

namespace mixtape::init {

class Initializer {
 public:
  using Fn = std::function<Tensor(const Shape& shape, DType dtype, Device device)>;

  Initializer(std::string name, Fn fn);
  // By name ("glorot_uniform", "he_normal", "zeros", ...); throws ValueError listing the
  // valid names.
  Initializer(std::string_view name);                                            // NOLINT
  Initializer(const char* name) : Initializer(std::string_view(name)) {}         // NOLINT
  Initializer(const std::string& name) : Initializer(std::string_view(name)) {}  // NOLINT

  Tensor operator()(const Shape& shape, DType dtype = kFloat32,
                    Device device = Device::cpu()) const;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  Fn fn_;
};

Initializer zeros();
Initializer ones();
Initializer constant(double value);
// U(-limit, limit) with limit = sqrt(6 / (fan_in + fan_out)): Dense and Conv2D kernels.
Initializer glorot_uniform(std::optional<std::uint64_t> seed = std::nullopt);
// Truncated normal (within 2 standard deviations) with stddev sqrt(2 / (fan_in + fan_out)).
Initializer glorot_normal(std::optional<std::uint64_t> seed = std::nullopt);
// Truncated normal with stddev sqrt(2 / fan_in): for ReLU networks.
Initializer he_normal(std::optional<std::uint64_t> seed = std::nullopt);
// U(-limit, limit) with limit = sqrt(6 / fan_in).
Initializer he_uniform(std::optional<std::uint64_t> seed = std::nullopt);
Initializer random_uniform(double low = -0.05, double high = 0.05,
                           std::optional<std::uint64_t> seed = std::nullopt);
Initializer random_normal(double mean = 0.0, double stddev = 0.05,
                          std::optional<std::uint64_t> seed = std::nullopt);

// The initializer called `name`; the valid names are listed by valid_names().
Initializer get(std::string_view name);
std::string valid_names();

}  // namespace mixtape::init
