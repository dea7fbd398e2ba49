// The fused linear op on the CPU (ops linear and linear_backward): a Dense layer's product,
// bias and activation in one op, and its backward pass's elementwise part in one pass.
//
// Forward: the product as matmul computes it (gemm.cpp's linear_product: oneDNN or OpenBLAS;
// float16 / bfloat16 through float32 copies, the result left in float32), then one epilogue
// per row while the row is in cache: + bias, the pre-activation stored when the backward pass
// needs it, the activation, and the single rounding to out's dtype. The composed ops this
// replaces (matmul, add, the activation) each made a pass over the [m, n] output and each
// rounded a 16-bit result; under float32 the values are the same as theirs (the same product,
// the same functions; relu and none to the bit, gelu and gelu_tanh to about the last bit, as
// the loops' vector forms and FMA contractions may differ).
//
// Backward: dz = dy act'(z) and the bias gradient (its column sums) in one pass over fixed
// blocks of rows, so that the sums' order does not depend on the number of threads. The two
// products (dx = dz w^T, dw = x^T dz) are matmul's, called by the op.
//
// Written by hand: oneDNN's matmul takes a bias and eltwise post-ops (relu, gelu_erf,
// gelu_tanh), but it cannot also write the pre-activation the backward pass of gelu reads,
// has no float16 or float64 matmul on most CPUs, and its gelu_erf is not these functors'
// (activation_math.h), which the composed path and the CUDA backend share; the epilogue is
// one pass over rows the GEMM has just written.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends/cpu/activation_math.h"
#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "backends/cpu/gemm_util.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using kernels::LinearActivation;
using kernels::LinearArgs;
using kernels::LinearBackwardArgs;
using std::int64_t;

// Rows per block of the bias gradient's partial sums: fixed, so the sums' order does not
// depend on the number of threads.
constexpr int64_t kBiasRowsPerBlock = 32;

// y[j] = act(z[j]) over a row (y may be z); `omp simd` so that gelu's erfc takes libmvec's
// vector form, as the elementwise kernels' loops do.
template <LinearActivation A, typename C>
MIXTAPE_ALWAYS_INLINE void activate_row_impl(const C* z, C* y, int64_t n) {
  if constexpr (A == LinearActivation::relu) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = relu_of(z[j]);
  } else if constexpr (A == LinearActivation::gelu) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = gelu_of(z[j]);
  } else if constexpr (A == LinearActivation::gelu_tanh) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) y[j] = gelu_tanh_of(z[j]);
  } else if (y != z) {
    std::copy(z, z + n, y);
  }
}

// d[j] = g[j] act'(s[j]) over a row, s the saved tensor's row (relu: the output).
template <LinearActivation A, typename C>
MIXTAPE_ALWAYS_INLINE void gradient_row_impl(const C* s, const C* g, C* d, int64_t n) {
  if constexpr (A == LinearActivation::relu) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) d[j] = s[j] > C(0) ? g[j] : C(0);
  } else if constexpr (A == LinearActivation::gelu) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) d[j] = gelu_grad_of(s[j], g[j]);
  } else if constexpr (A == LinearActivation::gelu_tanh) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) d[j] = gelu_tanh_grad_of(s[j], g[j]);
  }
}

// Each row loop compiled for the baseline and, for float, for AVX2 + FMA (libmvec's eight-lane
// erfcf), picked at run time as the elementwise kernels pick theirs. FMA contraction may change
// gelu's and gelu_tanh's last bit; relu only selects.
template <LinearActivation A, typename C>
void activate_row_base(const C* z, C* y, int64_t n) {
  activate_row_impl<A>(z, y, n);
}
template <LinearActivation A, typename C>
void gradient_row_base(const C* s, const C* g, C* d, int64_t n) {
  gradient_row_impl<A>(s, g, d, n);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
template <LinearActivation A, typename C>
__attribute__((target("avx2,fma"))) void activate_row_avx2(const C* z, C* y, int64_t n) {
  activate_row_impl<A>(z, y, n);
}
template <LinearActivation A, typename C>
__attribute__((target("avx2,fma"))) void gradient_row_avx2(const C* s, const C* g, C* d,
                                                           int64_t n) {
  gradient_row_impl<A>(s, g, d, n);
}
#endif
template <typename C>
struct RowLoops {
  void (*activate)(const C*, C*, int64_t);
  void (*gradient)(const C*, const C*, C*, int64_t);
};
template <LinearActivation A, typename C>
RowLoops<C> row_loops() {
  RowLoops<C> loops{&activate_row_base<A, C>, &gradient_row_base<A, C>};
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (std::is_same_v<C, float> && has_avx2_fma())
    loops = {&activate_row_avx2<A, C>, &gradient_row_avx2<A, C>};
#endif
  return loops;
}

// The 16-bit backward pass of gelu and gelu_tanh: act'(x) of every float16 / bfloat16 value x,
// indexed by x's bits, so that a row's gradient is a table read and a product instead of an
// erfc / exp per element (the row loop of a 2048 x 512 MLP was a tenth of the charlm's
// mixed_bfloat16 step). Each entry is gradient_row's own value for that x with g = 1, and
// the row loop computes g * (its factor) last, so g * entry is the value it computes (where
// it takes its vector form: its scalar tail, n % 8 elements, may call the scalar erfcf).
// 65536 floats per (activation, dtype), built at first use.
template <LinearActivation A, typename T>
const float* gradient_table() {
  static const std::vector<float> table = [] {
    constexpr std::size_t kCount = std::size_t{1} << 16;
    std::vector<T> xs(kCount);
    for (std::size_t i = 0; i < kCount; ++i)
      xs[i] = std::bit_cast<T>(static_cast<std::uint16_t>(i));
    std::vector<float> x(kCount), ones(kCount, 1.0f), factor(kCount);
    to_float(xs.data(), x.data(), static_cast<int64_t>(kCount));
    row_loops<A, float>().gradient(x.data(), ones.data(), factor.data(),
                                   static_cast<int64_t>(kCount));
    return factor;
  }();
  return table.data();
}

// d[j] = g[j] table[bits of s[j]] over a row.
MIXTAPE_ALWAYS_INLINE void table_row_impl(const float* table, const std::uint16_t* s,
                                          const float* g, float* d, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) d[j] = g[j] * table[s[j]];
}
void table_row_base(const float* table, const std::uint16_t* s, const float* g, float* d,
                    int64_t n) {
  table_row_impl(table, s, g, d, n);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
__attribute__((target("avx2,fma"))) void table_row_avx2(const float* table, const std::uint16_t* s,
                                                        const float* g, float* d, int64_t n) {
  table_row_impl(table, s, g, d, n);
}
#endif
using TableRowFn = void (*)(const float*, const std::uint16_t*, const float*, float*, int64_t);
TableRowFn table_row() {
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) return &table_row_avx2;
#endif
  return &table_row_base;
}

// From the product acc [m, n] in the compute type (out's own storage for float32 / float64, a
// scratch for the 16-bit floats): + bias (out's dtype, kernels.h; widened once), pre, the
// activation and the rounding, a row at a time.
template <typename T>
void epilogue(compute_t<T>* acc, int64_t m, int64_t n, const Tensor& bias_t, const Tensor& pre_t,
              const Tensor& out_t, LinearActivation activation) {
  using C = compute_t<T>;
  std::vector<C> wide_bias;
  const C* bias = bias_t.defined()
                      ? as_compute(static_cast<const T*>(bias_t.const_data_ptr()), n, wide_bias)
                      : nullptr;
  T* out = static_cast<T*>(out_t.data_ptr());
  T* pre = pre_t.defined() ? static_cast<T*>(pre_t.data_ptr()) : nullptr;
  kernels::with_linear_activation(activation, [&]<LinearActivation A>() {
    const auto activate_row = row_loops<A, C>().activate;
    parallel_rows(m, m * n, [&](int64_t r) {
      C* z = acc + r * n;  // float32 / float64: out's row itself
      // float32 / float64 with pre: z + bias straight into pre, the activation from there.
      C* zb = z;
      if constexpr (kNative<T>) {
        if (pre) zb = pre + r * n;
      }
      if (bias) {
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) zb[j] = z[j] + bias[j];
      } else if (zb != z) {
        std::copy(z, z + n, zb);
      }
      if constexpr (kReduced<T>) {
        if (pre) from_compute(z, pre + r * n, n);
      }
      activate_row(zb, z, n);
      if constexpr (kReduced<T>) from_compute(z, out + r * n, n);
    });
  });
}

template <typename T>
void linear_kernel(const LinearArgs& args) {
  // The product in the compute type: out itself (float32 / float64) or a float32 scratch.
  compute_t<T>* acc = linear_product<T>(args.x, args.w, args.out);
  epilogue<T>(acc, args.x.dim(0), args.w.dim(1), args.bias, args.pre, args.out, args.activation);
}

template <typename T>
void linear_backward_kernel(const LinearBackwardArgs& args) {
  using C = compute_t<T>;
  const int64_t n = args.dy.shape().back(), m = args.dy.numel() / n;
  const T* dy = static_cast<const T*>(args.dy.const_data_ptr());
  const T* saved =
      args.saved.defined() ? static_cast<const T*>(args.saved.const_data_ptr()) : nullptr;
  T* dz = args.dz.defined() ? static_cast<T*>(args.dz.data_ptr()) : nullptr;
  C* dbias = args.dbias.defined() ? static_cast<C*>(args.dbias.data_ptr()) : nullptr;
  const int64_t blocks = (m + kBiasRowsPerBlock - 1) / kBiasRowsPerBlock;
  // Per block of rows: the column sums of its dz rows, added up block by block below.
  std::vector<C> part(dbias ? static_cast<std::size_t>(blocks * n) : 0, C(0));
  kernels::with_linear_activation(args.activation, [&]<LinearActivation A>() {
    const auto gradient_row = row_loops<A, C>().gradient;
    // 16-bit gelu / gelu_tanh: act' read from the table by the saved value's bits.
    constexpr bool kTable =
        kReduced<T> && (A == LinearActivation::gelu || A == LinearActivation::gelu_tanh);
    const float* table = nullptr;
    TableRowFn by_table = nullptr;
    if constexpr (kTable) table = gradient_table<A, T>(), by_table = table_row();
    parallel_region(m * n > kParallelGrain, [&] {
      std::vector<C> gin, sin,
          res(kReduced<T> && A != LinearActivation::none ? static_cast<std::size_t>(n) : 0);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; ++b) {
        C* p = dbias ? part.data() + b * n : nullptr;
        for (int64_t r = b * kBiasRowsPerBlock; r < std::min(m, (b + 1) * kBiasRowsPerBlock); ++r) {
          const C* g = as_compute(dy + r * n, n, gin);
          const C* d = g;
          if constexpr (A != LinearActivation::none) {
            // float32 / float64: straight into dz's row.
            C* out = kNative<T> ? reinterpret_cast<C*>(dz + r * n) : res.data();
            if constexpr (kTable)
              by_table(table, reinterpret_cast<const std::uint16_t*>(saved + r * n), g, out, n);
            else
              gradient_row(as_compute(saved + r * n, n, sin), g, out, n);
            if constexpr (kReduced<T>) from_compute(res.data(), dz + r * n, n);
            d = out;
          }
          if (p) {
#pragma omp simd
            for (int64_t j = 0; j < n; ++j) p[j] += d[j];
          }
        }
      }
    });
  });
  if (!dbias) return;
  std::fill(dbias, dbias + n, C(0));
  for (int64_t b = 0; b < blocks; ++b) {
    const C* p = part.data() + b * n;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) dbias[j] += p[j];
  }
}

}  // namespace

void linear_epilogue(float* acc, int64_t m, int64_t n, const Tensor& bias, const Tensor& pre,
                     const Tensor& out, LinearActivation activation) {
  if (out.dtype() == kBFloat16)
    epilogue<bfloat16>(acc, m, n, bias, pre, out, activation);
  else if (out.dtype() == kFloat16)
    epilogue<half>(acc, m, n, bias, pre, out, activation);
  else
    epilogue<float>(acc, m, n, bias, pre, out, activation);
}

void register_linear_kernels() {
  MIXTAPE_CPU_KERNEL(linear, linear_kernel);
  MIXTAPE_CPU_KERNEL(linear_backward, linear_backward_kernel);
}

}  // namespace mixtape::cpu
