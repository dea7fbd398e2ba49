// Private to the CPU backend: what its GEMM-based and window kernels share (gemm.cpp,
// conv.cpp, pool.cpp, acc16.cpp): per-thread scratch buffers, bulk float16 / bfloat16
// conversion in pieces, the BLAS calls, the taps of a window inside the image, the
// wrappers that run a float16 / bfloat16 kernel on float32 copies, a GEMM call's
// normalised geometry, and the entry points of the 16-bit accumulation emulation
// (acc16.cpp).
#pragma once

#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <optional>
#include <type_traits>

#include "backends/cpu/cpu_util.h"

namespace mixtape::cpu {

using kernels::Conv2dGeometry;
using kernels::GemmArgs;
using kernels::Pool2dGeometry;

// --- Scratch ----------------------------------------------------------------------------

// A grow-only, 64-byte aligned scratch buffer (one per thread and use), so steady-state
// calls allocate nothing.
template <typename C = float>
struct Scratch {
  C* ptr = nullptr;
  std::size_t cap = 0;
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { release(); }
  void release() {
    if (ptr) ::operator delete(ptr, std::align_val_t(64));
    ptr = nullptr;
    cap = 0;
  }
  C* get(std::int64_t n) {
    const auto want = static_cast<std::size_t>(std::max<std::int64_t>(n, 1));
    if (want > cap) {
      release();
      ptr = static_cast<C*>(::operator new(want * sizeof(C), std::align_val_t(64)));
      cap = want;
    }
    return ptr;
  }
};

// Scratch slots of the calling thread: the column matrix (or the direct path's partial
// sums), up to three converted tensors of the reduced-precision wrappers (slots 1-3), and
// a float32 output chunk awaiting conversion.
template <typename C>
Scratch<C>& scratch(int slot) {
  thread_local Scratch<C> slots[5];
  return slots[slot];
}
constexpr int kColSlot = 0;
constexpr int kOutChunkSlot = 4;

inline int max_threads() { return omp_get_max_threads(); }
// The threads for `work` multiply-adds: one below kParallelGrain.
inline int threads_for(std::int64_t work) { return work > kParallelGrain ? max_threads() : 1; }

// --- BLAS ----------------------------------------------------------------------------

// Row-major C = op(A) op(B) + beta C, T float or double.
template <typename T>
void blas_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const T* a,
               std::int64_t lda, const T* b, std::int64_t ldb, std::type_identity_t<T> beta, T* c,
               std::int64_t ldc) {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>);
  const auto op = [](bool t) { return t ? CblasTrans : CblasNoTrans; };
  const auto i = [](std::int64_t v) { return static_cast<blasint>(v); };
  if constexpr (std::is_same_v<T, float>)
    cblas_sgemm(CblasRowMajor, op(ta), op(tb), i(m), i(n), i(k), 1.0f, a, i(lda), b, i(ldb), beta,
                c, i(ldc));
  else
    cblas_dgemm(CblasRowMajor, op(ta), op(tb), i(m), i(n), i(k), 1.0, a, i(lda), b, i(ldb), beta, c,
                i(ldc));
}

// --- Bulk conversion for float16 / bfloat16 ------------------------------------------

// The library's bulk converters (core/half.cpp) go parallel (OpenMP) on spans above 64K
// elements. Spans used to be fed to them in pieces of 8K, on the calling thread, for fear of
// spinning OpenMP workers competing with OpenBLAS's threads; OpenBLAS is the OpenMP build
// (one pool), and whole spans measured faster: mlp mixed_float16 at 2 threads 29 -> 26
// us/sample (4 alternated pairs), no change with oneDNN limited to AVX2 (sgemm path).

inline void convert_piece(const half* s, float* d, std::size_t n) {
  convert_half_to_float(s, d, n);
}
inline void convert_piece(const bfloat16* s, float* d, std::size_t n) {
  convert_bfloat16_to_float(s, d, n);
}
inline void convert_piece(const float* s, half* d, std::size_t n) {
  convert_float_to_half(s, d, n);
}
inline void convert_piece(const float* s, bfloat16* d, std::size_t n) {
  convert_float_to_bfloat16(s, d, n);
}

template <typename S, typename D>
void convert(const S* s, D* d, std::int64_t count) {
  convert_piece(s, d, static_cast<std::size_t>(count));  // parallel when long
}

// --- Windows ---------------------------------------------------------------------------

// The valid window taps [lo, hi) along one axis for output position o: taps t with
// 0 <= o*stride - pad + t < size.
struct TapRange {
  std::int64_t lo, hi;
};
inline TapRange tap_range(std::int64_t o, std::int64_t stride, std::int64_t pad, std::int64_t taps,
                          std::int64_t size) {
  const std::int64_t start = o * stride - pad;
  const std::int64_t lo = std::clamp<std::int64_t>(-start, 0, taps);
  const std::int64_t hi = std::clamp<std::int64_t>(size - start, lo, taps);
  return {lo, hi};
}

// The output positions o in [lo, hi) at which tap t of the window lands inside the input:
// 0 <= o * stride - pad + t < size, with 0 <= o < outs. Empty when lo >= hi.
inline TapRange out_range(std::int64_t t, std::int64_t stride, std::int64_t pad, std::int64_t size,
                          std::int64_t outs) {
  const std::int64_t first = pad - t, last = size - 1 + pad - t;  // bounds of o * stride
  const std::int64_t lo = first <= 0 ? 0 : (first + stride - 1) / stride;
  const std::int64_t hi = last < 0 ? 0 : std::min(outs, last / stride + 1);
  return {lo, hi};
}

// f(o, taps) for each output position o in [0, outs) whose window covers input position p
// along one axis, in the order of the tap p is of it (ascending, so o descending); taps is
// the window's tap_range.
template <typename F>
void for_each_cover(std::int64_t p, std::int64_t stride, std::int64_t pad, std::int64_t taps,
                    std::int64_t size, std::int64_t outs, F&& f) {
  for (std::int64_t k = 0; k < taps; ++k) {
    const std::int64_t t = p + pad - k;  // o * stride when tap k of window o is p
    if (t < 0 || t % stride != 0 || t / stride >= outs) continue;
    f(t / stride, tap_range(t / stride, stride, pad, taps, size));
  }
}

// --- Kernels keyed on the storage dtype -------------------------------------------------

// Whether T computes as itself (float32, float64) rather than through float32 copies
// (float16, bfloat16; compute_t is cpu_util.h's).
template <typename T>
constexpr bool kNative = std::is_same_v<T, compute_t<T>>;

// Input `slot` of the calling thread as a compute-type buffer: the tensor itself for
// float32 / float64, a bulk-converted float32 copy for float16 / bfloat16.
template <typename T>
const compute_t<T>* input(const Tensor& t, int slot) {
  const T* p = static_cast<const T*>(t.const_data_ptr());
  if constexpr (kNative<T>) {
    return p;
  } else {
    float* f = scratch<float>(slot).get(t.numel());
    convert(p, f, t.numel());
    return f;
  }
}
// The output buffer to compute into (the tensor itself, or a float32 scratch), and the
// step that stores it back.
template <typename T>
compute_t<T>* output(const Tensor& t, int slot) {
  if constexpr (kNative<T>) {
    return static_cast<T*>(t.data_ptr());
  } else {
    return scratch<float>(slot).get(t.numel());
  }
}
template <typename T>
void store(const compute_t<T>* buf, const Tensor& t) {
  if constexpr (!kNative<T>) convert(buf, static_cast<T*>(t.data_ptr()), t.numel());
}

// --- A GEMM call's geometry ------------------------------------------------------------

// The geometry of one call after normalisation (see normalize()).
using Plan = GemmShape;

// Makes leading dimensions acceptable to BLAS (a one-row matrix may carry any ld) and
// folds a batch that shares B into one taller GEMM when A and C are evenly strided.
inline Plan normalize(const GemmArgs& g) {
  Plan p{g.batch, g.m,   g.n,   g.k,        g.trans_a,  g.trans_b,
         g.lda,   g.ldb, g.ldc, g.stride_a, g.stride_b, g.stride_c};
  if (p.rows_a() <= 1) p.lda = std::max(p.lda, p.cols_a());
  if (p.rows_b() <= 1) p.ldb = std::max(p.ldb, p.cols_b());
  if (p.m <= 1) p.ldc = std::max(p.ldc, p.n);
  p.lda = std::max<std::int64_t>(p.lda, 1);
  p.ldb = std::max<std::int64_t>(p.ldb, 1);
  p.ldc = std::max<std::int64_t>(p.ldc, 1);
  if (p.batch > 1 && !p.ta && p.sb == 0 && p.sa == p.m * p.lda && p.sc == p.m * p.ldc &&
      p.batch * p.m <= (std::int64_t{1} << 30)) {
    p.m *= p.batch;
    p.batch = 1;
  }
  if (p.batch == 1) p.sa = p.sb = p.sc = 0;
  return p;
}

// out = 0 for every batch item (k == 0: the empty sum).
template <typename T>
void zero_output(const Plan& p, T* c) {
  for (std::int64_t bi = 0; bi < p.batch; ++bi)
    for (std::int64_t r = 0; r < p.m; ++r)
      std::memset(static_cast<void*>(c + bi * p.sc + r * p.ldc), 0,
                  static_cast<std::size_t>(p.n) * sizeof(T));
}

// Converts `count` matrices of rows x cols (leading dimension ld, batch stride stride) to
// compact float32 matrices at dst (rows*cols apart).
template <typename T>
void pack_to_float(const T* src, std::int64_t count, std::int64_t stride, std::int64_t rows,
                   std::int64_t cols, std::int64_t ld, float* dst) {
  const std::int64_t size = rows * cols;
  if (ld == cols && (count == 1 || stride == size)) return convert(src, dst, count * size);
  for (std::int64_t bi = 0; bi < count; ++bi) {
    const T* s = src + bi * stride;
    float* d = dst + bi * size;
    if (ld == cols) {
      convert(s, d, size);
    } else {
      for (std::int64_t r = 0; r < rows; ++r) convert(s + r * ld, d + r * cols, cols);
    }
  }
}

// The operands of a product of T elements: the normalized plan and the data pointers.
template <typename T>
struct GemmOperands {
  Plan p;
  const T* a;
  const T* b;
  T* c;
};

// g's operands, or nothing when no product is left to compute: an empty output, or k == 0
// (the output is then zeroed here).
template <typename T>
std::optional<GemmOperands<T>> gemm_operands(const GemmArgs& g) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return std::nullopt;
  GemmOperands<T> o{normalize(g), static_cast<const T*>(g.a.const_data_ptr()),
                    static_cast<const T*>(g.b.const_data_ptr()), static_cast<T*>(g.out.data_ptr())};
  if (o.p.k <= 0) {
    zero_output(o.p, o.c);
    return std::nullopt;
  }
  return o;
}

// A and B as compact float32 copies in scratch_a / scratch_b: one matrix when the batch
// stride is 0, else one per batch item (count_a / count_b matrices, size_a / size_b apart).
struct FloatOperands {
  float* a;
  float* b;
  std::int64_t size_a, size_b, count_a, count_b;
};
template <typename T>
FloatOperands float_operands(const Plan& p, const T* a, const T* b, Scratch<>& scratch_a,
                             Scratch<>& scratch_b) {
  FloatOperands f{};
  f.size_a = p.rows_a() * p.cols_a();
  f.size_b = p.rows_b() * p.cols_b();
  f.count_a = p.sa == 0 ? 1 : p.batch;
  f.count_b = p.sb == 0 ? 1 : p.batch;
  f.a = scratch_a.get(f.count_a * f.size_a);
  f.b = scratch_b.get(f.count_b * f.size_b);
  pack_to_float(a, f.count_a, p.sa, p.rows_a(), p.cols_a(), p.lda, f.a);
  pack_to_float(b, f.count_b, p.sb, p.rows_b(), p.cols_b(), p.ldb, f.b);
  return f;
}

// --- The fused linear op's product (gemm.cpp) --------------------------------------------

// x [m, k] times w [k, n] (row-major, contiguous, m, n, k >= 1) in the compute type, for
// linear.cpp's epilogues: for float32 / float64 written into `out` ([m, n], contiguous) by
// matmul's own path, and returned; for float16 / bfloat16 multiplied as matmul does in
// float32 (on CPUs with AVX512-BF16, bfloat16 on oneDNN's native bf16 matmul with a float32
// result), left unrounded in this thread's float32 scratch (m x n, returned; valid until the
// thread's next 16-bit product).
template <typename T>
compute_t<T>* linear_product(const Tensor& x, const Tensor& w, const Tensor& out);

// --- 16-bit accumulation (acc16.cpp) ---------------------------------------------------
// GemmArgs::low_precision_accumulation and Conv2dGeometry::low_precision_accumulation: the
// float16 / bfloat16 kernels emulate an accumulator of the 16-bit type (acc16.cpp says
// how). T is half or bfloat16; the conv kernels take float32 copies of their inputs.

template <typename T>
void gemm_acc16(const GemmArgs& g);
template <typename T>
void conv_forward_acc16(const float* x, const float* w, const float* bias, T* out,
                        const Conv2dGeometry& g);
template <typename T>
void conv_backward_input_acc16(const float* grad_out, const float* w, T* grad_x,
                               const Conv2dGeometry& g);
template <typename T>
void conv_backward_weight_acc16(const float* x, const float* grad_out, T* grad_w,
                                const Conv2dGeometry& g);

}  // namespace mixtape::cpu
