// Helpers of the tests that compare a fused op with its composed form: seeded random
// tensors and the largest elementwise difference.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdint>
#include <vector>

#include "mixtape/mixtape.h"

namespace mixtape_test {

// Normal values (mean, stddev) of `shape` in `dtype` on the CPU, from a generator seeded with
// `seed`: the same tensor for the same arguments.
inline mixtape::Tensor random_normal(const mixtape::Shape& shape, std::uint64_t seed,
                                     mixtape::DType dtype = mixtape::kFloat64, double mean = 0.0,
                                     double stddev = 1.0) {
  mixtape::Generator gen(seed);
  return mixtape::normal(shape, mean, stddev, dtype, mixtape::Device::cpu(), &gen);
}

// The largest |a - b| over the elements, compared in float64 (the sizes must agree).
inline double max_abs_diff(const mixtape::Tensor& a, const mixtape::Tensor& b) {
  const auto x = mixtape::cast(a, mixtape::kFloat64).to_vector<double>();
  const auto y = mixtape::cast(b, mixtape::kFloat64).to_vector<double>();
  REQUIRE(x.size() == y.size());
  double m = 0;
  for (std::size_t i = 0; i < x.size(); ++i) m = std::max(m, std::abs(x[i] - y[i]));
  return m;
}

}  // namespace mixtape_test
