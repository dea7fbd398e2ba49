// quantize_float8 on the CPU (mixtape/core/kernels.h, QuantizeFloat8Args): one pass for the
// amax, one for the scaled conversion (into x's layout, its transpose, or both), the factor
// and the history between them. It is the reference the CUDA kernels are swept against; the
// arithmetic is the kernel contract's, step for step: float32(x) * factor rounded to float32,
// then to the format (nearest even, saturating).
#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "mixtape/core/float8.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// The element as float32: exact from the 16-bit floats, rounded to nearest from float64.
template <typename T>
float widen(T v) {
  return static_cast<float>(v);
}

// max |float32(x[i])| over [begin, end), as the bits of a non-negative float: their order as
// unsigned integers is the values' order, and every NaN (sign cleared) lies above infinity,
// so a NaN anywhere gives NaN.
template <typename T>
std::uint32_t amax_bits(const T* x, int64_t begin, int64_t end) {
  std::uint32_t m = 0;
  for (int64_t i = begin; i < end; ++i)
    m = std::max(m, std::bit_cast<std::uint32_t>(std::fabs(widen(x[i]))));
  return m;
}

// The largest element of the history; NaN when it holds one.
float history_max(const float* h, int64_t length) {
  float m = h[0];
  for (int64_t i = 1; i < length && !std::isnan(m); ++i)
    if (h[i] > m || std::isnan(h[i])) m = h[i];
  return m;
}

template <typename T>
void quantize_float8_kernel(const kernels::QuantizeFloat8Args& a) {
  const int64_t n = a.rows * a.cols;
  const T* x = static_cast<const T*>(a.x.const_data_ptr());

  // amax, a partial per block of kBlock elements, then their largest.
  std::vector<std::uint32_t> partials(static_cast<std::size_t>((n + kBlock - 1) / kBlock));
  parallel_blocks(n, [&](int64_t b, int64_t e) {
    partials[static_cast<std::size_t>(b / kBlock)] = amax_bits(x, b, e);
  });
  std::uint32_t bits = 0;
  for (const std::uint32_t p : partials) bits = std::max(bits, p);
  const float amax = std::bit_cast<float>(bits);

  // The factor into the format's range.
  const Float8Format format = (a.data.defined() ? a.data : a.data_t).dtype() == kFloat8E4M3FN
                                  ? Float8Format::e4m3fn
                                  : Float8Format::e5m2;
  const float top = static_cast<float>(std::ldexp(
      format == Float8Format::e4m3fn ? float8_e4m3fn::max() : float8_e5m2::max(), -a.margin));
  float reference = amax;
  auto* history = a.history.defined() ? static_cast<float*>(a.history.data_ptr()) : nullptr;
  const int64_t length = history ? a.history.numel() : 0;
  if (history) {
    const float recorded = history_max(history, length);
    if (recorded > 0.0f) reference = recorded;
  }
  const float factor = reference > 0.0f ? top / reference : 1.0f;

  // The conversion: row blocks in parallel, 64 x 64 tiles so that the transposed writes
  // stay in cache.
  constexpr int64_t kTile = 64;
  auto* data = a.data.defined() ? static_cast<std::uint8_t*>(a.data.data_ptr()) : nullptr;
  auto* data_t = a.data_t.defined() ? static_cast<std::uint8_t*>(a.data_t.data_ptr()) : nullptr;
  const int64_t row_blocks = (a.rows + kTile - 1) / kTile;
  parallel_rows(row_blocks, n, [&](int64_t rb) {
    const int64_t r0 = rb * kTile, r1 = std::min(a.rows, r0 + kTile);
    for (int64_t c0 = 0; c0 < a.cols; c0 += kTile) {
      const int64_t c1 = std::min(a.cols, c0 + kTile);
      const int64_t width = c1 - c0, height = r1 - r0;
      // The tile scaled, then converted in one call (a vectorised loop), then written.
      float scaled[kTile * kTile];
      std::uint8_t q[kTile * kTile];
      for (int64_t r = 0; r < height; ++r)
        for (int64_t c = 0; c < width; ++c)
          scaled[r * width + c] = widen(x[(r0 + r) * a.cols + c0 + c]) * factor;
      detail::floats_to_float8_bits(format, scaled, q, height * width, Saturation::finite);
      if (data)
        for (int64_t r = 0; r < height; ++r)
          std::memcpy(data + (r0 + r) * a.cols + c0, q + r * width,
                      static_cast<std::size_t>(width));
      if (data_t)
        for (int64_t c = 0; c < width; ++c)
          for (int64_t r = 0; r < height; ++r)
            data_t[(c0 + c) * a.rows + r0 + r] = q[r * width + c];
    }
  });

  *static_cast<float*>(a.scale.data_ptr()) = 1.0f / factor;
  *static_cast<float*>(a.amax.data_ptr()) = amax;
  if (history && a.update) {
    std::copy_backward(history, history + length - 1, history + length);
    history[0] = amax;
  }
}

}  // namespace

void register_quantize_kernels() {
  MIXTAPE_REGISTER_KERNEL(DeviceType::CPU, element_t, quantize_float8, quantize_float8_kernel);
}

}  // namespace mixtape::cpu
