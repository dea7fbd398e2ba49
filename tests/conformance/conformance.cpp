// The sweep's context: random inputs on the device under test with float64 copies for the
// reference, and the comparisons (tests/conformance/conformance.h).
#include "tests/conformance/conformance.h"

#include <fmt/format.h>

#include <cmath>
#include <limits>

#include "mixtape/autograd/ops.h"

namespace mixtape::conformance {

Tolerance tolerance(DType dtype) {
  switch (dtype.code()) {
    case DType::Float64:
      return {1e-12, 1e-13, 1e-13};
    case DType::Float32:
      return {4e-6, 1e-6, 2e-7};  // rtol: 32 units in the last place of float32 (2^-23)
    case DType::Float16:
      return {2e-3, 1e-4, 2e-7};  // 2 units in the last place of float16 (2^-10)
    case DType::BFloat16:
      return {1.6e-2, 1e-4, 2e-7};  // 2 units in the last place of bfloat16 (2^-7)
    default:
      return {0.0, 0.0, 0.0};  // integers and bool: exact
  }
}

Context::Context(OpId op, DType dtype, Device device, std::uint64_t seed)
    : op_(op),
      dtype_(dtype),
      device_(device),
      rng_(seed ^ (static_cast<std::uint64_t>(op) << 32) ^
           (static_cast<std::uint64_t>(dtype.index()) << 48)) {}

double Context::uniform(double lo, double hi) {
  if (!dtype_.is_floating())
    return static_cast<double>(integer(static_cast<std::int64_t>(std::ceil(lo)),
                                       static_cast<std::int64_t>(std::floor(hi))));
  return std::uniform_real_distribution<double>(lo, hi)(rng_);
}

std::int64_t Context::integer(std::int64_t lo, std::int64_t hi) {
  return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_);
}

Context::Pair Context::make_as(const Shape& shape, const std::function<double()>& draw, DType dtype,
                               DType ref_dtype) {
  std::vector<double> values(static_cast<std::size_t>(shape.numel()));
  for (auto& v : values) v = draw();
  Tensor tested = from_vector<double>(values, shape, dtype, device_);
  // The reference holds what the dtype stored (float16 rounds, bool is 0 or 1).
  Tensor ref = from_vector<double>(tested.to_vector<double>(), shape, ref_dtype, Device::cpu());
  return {tested, ref};
}

Context::Pair Context::make(const Shape& shape, const std::function<double()>& draw) {
  return make_as(shape, draw, dtype_, kFloat64);
}

Context::Pair Context::make(const Shape& shape, const std::function<double()>& draw, DType dtype) {
  return make_as(shape, draw, dtype, dtype.is_floating() ? kFloat64 : dtype);
}

Context::Pair Context::uniform(const Shape& shape, double lo, double hi) {
  return make(shape, [&] { return uniform(lo, hi); });
}

Context::Pair Context::view(const Pair& base, const Shape& shape, const Strides& strides,
                            std::int64_t offset) {
  return {Tensor::view_of(base.tested, shape, strides, offset),
          Tensor::view_of(base.ref, shape, strides, offset)};
}

Context::Pair Context::broadcast(const Pair& t, const Shape& shape) {
  const Shape& from = t.tested.shape();
  const std::size_t lead = shape.rank() - from.rank();
  std::vector<std::int64_t> strides(shape.rank(), 0);
  for (std::size_t i = 0; i < from.rank(); ++i)
    strides[lead + i] = from.dim(static_cast<int>(i)) == 1 ? 0 : t.tested.strides()[i];
  return view(t, shape, Strides(strides), t.tested.offset());
}

Context::Pair Context::indices(const Shape& shape, std::int64_t lo, std::int64_t hi) {
  std::vector<std::int64_t> values(static_cast<std::size_t>(shape.numel()));
  for (auto& v : values) v = integer(lo, hi);
  return {from_vector<std::int64_t>(values, shape, kInt64, device_),
          from_vector<std::int64_t>(values, shape, kInt64, Device::cpu())};
}

Context::Pair Context::output_as(const Shape& shape, DType dtype, DType ref_dtype) {
  // NaN in floating outputs, so that an element the kernel does not write shows up.
  const double poison = dtype.is_floating() ? std::numeric_limits<double>::quiet_NaN() : 0.0;
  return {full(shape, poison, dtype, device_), full(shape, 0.0, ref_dtype, Device::cpu())};
}

Context::Pair Context::output(const Shape& shape) { return output_as(shape, dtype_, kFloat64); }

Context::Pair Context::output(const Shape& shape, DType dtype) {
  return output_as(shape, dtype, dtype.is_floating() ? kFloat64 : dtype);
}

namespace {

std::string show(double v) { return fmt::format("{:.9g}", v); }

// The reference rounded to `dtype` (through the CPU's correctly rounding cast), read back.
std::vector<double> rounded(const Tensor& ref, DType dtype, bool integer_division) {
  Tensor r = ref;
  if (integer_division) {
    std::vector<double> v = r.to_vector<double>();
    for (auto& x : v) x = std::trunc(x);
    r = from_vector<double>(v, r.shape(), kFloat64);
  }
  if (r.dtype() != dtype) r = cast(r, dtype);
  return r.to_vector<double>();
}

bool same(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

}  // namespace

void Context::fail(const std::string& what, const std::string& detail) {
  failures_.push_back(
      fmt::format("{} {} on {}: {}: {}", op_name(op_), dtype_.name(), device_.str(), what, detail));
}

Context::Mismatch Context::mismatch(const Tensor& got, const Tensor& ref, Scale scale,
                                    bool integer_division, bool exact) const {
  const std::vector<double> g = got.to_vector<double>();
  const std::vector<double> r = rounded(ref, got.dtype(), integer_division);
  const Tolerance tol = exact ? Tolerance{0.0, 0.0, 0.0} : tolerance(got.dtype());
  Mismatch m;
  m.elements = g.size();
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (same(g[i], r[i])) continue;
    const double err = std::fabs(g[i] - r[i]);
    const double want = std::fabs(r[i]);
    const double allowed = tol.atol + tol.rtol * want + tol.acc * (scale.abs + scale.rel * want);
    if (std::isfinite(r[i]) && err <= allowed) continue;  // NaN and inf must match exactly
    if (m.bad++ == 0) m.first = i, m.got = g[i], m.want = r[i];
    if (!(err <= m.worst)) m.worst = err;
  }
  return m;
}

void Context::compare(const std::string& what, const Tensor& got, const Tensor& ref, Scale scale,
                      bool integer_division, bool exact) {
  ++cases_;
  if (got.shape() != ref.shape()) {
    fail(what,
         fmt::format("shape {} against the reference's {}", got.shape().str(), ref.shape().str()));
    return;
  }
  const Mismatch m = mismatch(got, ref, scale, integer_division, exact);
  if (m.bad)
    fail(what, fmt::format("{} of {} elements differ (first at {}: got {}, want {}; largest "
                           "error {}{})",
                           m.bad, m.elements, m.first, show(m.got), show(m.want), show(m.worst),
                           exact ? "; must be exact" : ""));
}

bool Context::is_close(const Tensor& got, const Tensor& ref, Scale scale) const {
  return got.shape() == ref.shape() && mismatch(got, ref, scale, false, false).bad == 0;
}

void Context::expect_close(const std::string& what, const Tensor& got, const Tensor& ref,
                           Scale scale, bool integer_division) {
  compare(what, got, ref, scale, integer_division, /*exact=*/false);
}

void Context::expect_equal(const std::string& what, const Tensor& got, const Tensor& ref) {
  compare(what, got, ref, {}, false, /*exact=*/true);
}

}  // namespace mixtape::conformance
