// CPU matmul kernels: float32 / float64 through OpenBLAS sgemm / dgemm; float16 and
// bfloat16 operands are converted in bulk to float32 scratch, multiplied with sgemm and
// rounded back (nearest-even) in bulk. With GemmArgs::low_precision_accumulation
// (MIXTAPE_FP16_USE_FP32_COMPUTE=0) float16 / bfloat16 products instead emulate a GEMM
// that accumulates in the 16-bit type (gemm_acc16 below). bfloat16 products run on
// oneDNN's native bf16 matmul where the CPU has AVX512-BF16 (onednn.cpp).
#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#include "backends/cpu/cpu_backend.h"
#include "mixtape/core/half.h"

namespace mixtape::cpu {
namespace {

using kernels::GemmArgs;

// A grow-only, 64-byte aligned buffer; one per thread and use, so steady-state calls
// allocate nothing.
template <typename E = float>
struct Scratch {
  E* ptr = nullptr;
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
  E* get(std::size_t n) {
    if (n > cap) {
      release();
      ptr = static_cast<E*>(::operator new(n * sizeof(E), std::align_val_t(64)));
      cap = n;
    }
    return ptr;
  }
};

// Bulk conversions between the 16-bit storage types and float32, on the calling thread.
// The library's bulk converters go parallel (OpenMP) on long spans; OpenMP workers spin
// after a region and then compete with OpenBLAS's own threads for the cores, which costs
// far more than the conversion itself, so spans are fed to them in short pieces.
constexpr std::size_t kConvertPiece = std::size_t{1} << 13;

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
  const auto n = static_cast<std::size_t>(count);
  for (std::size_t i = 0; i < n; i += kConvertPiece)
    convert_piece(s + i, d + i, std::min(kConvertPiece, n - i));
}

// One row-major BLAS gemm call: C = op(A) x op(B) (beta = 0).
inline void blas_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                      const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float* c,
                      std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0f, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0f, c,
              static_cast<blasint>(ldc));
}
inline void blas_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k,
                      const double* a, std::int64_t lda, const double* b, std::int64_t ldb,
                      double* c, std::int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), 1.0, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), 0.0, c,
              static_cast<blasint>(ldc));
}

// The geometry of one call after normalisation (see normalize()).
using Plan = GemmShape;

// Makes leading dimensions acceptable to BLAS (a one-row matrix may carry any ld) and
// folds a batch that shares B into one taller GEMM when A and C are evenly strided.
Plan normalize(const GemmArgs& g) {
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

// float32 / float64: straight to BLAS, one call per batch item.
template <typename T>
void gemm_native(const GemmArgs& g) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  const Plan p = normalize(g);
  const T* a = static_cast<const T*>(g.a.data_ptr());
  const T* b = static_cast<const T*>(g.b.data_ptr());
  T* c = static_cast<T*>(g.out.data_ptr());
  if (p.k <= 0) return zero_output(p, c);
  for (std::int64_t bi = 0; bi < p.batch; ++bi)
    blas_gemm(p.ta, p.tb, p.m, p.n, p.k, a + bi * p.sa, p.lda, b + bi * p.sb, p.ldb, c + bi * p.sc,
              p.ldc);
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

// --- 16-bit accumulation (GemmArgs::low_precision_accumulation) ---------------------
//
// Emulates a GEMM whose accumulator is a T (float16 or bfloat16): every output element is
//   acc = 0;  for kk = 0, 1, ..., k-1:  acc = round_T(acc + op(A)[i, kk] * op(B)[kk, j])
// with the product and the sum in float32 (the product of two float16 values is exact in
// float32, and so is that of two bfloat16 values within float32's range, so only the sum
// rounds there) and round_T rounding to nearest even like mixtape::half /
// mixtape::bfloat16. The order over kk is sequential and the same for every element,
// whatever the transposes, leading dimensions and batch strides.
//
// A and B are converted to float32 in bulk as in gemm_reduced, B as k x n rows (a
// transposed B is transposed after conversion). OpenMP threads take blocks of kAcc16Rows
// rows of C: for each kk, the block's float32 accumulators get
//   acc[r, 0:n] += A[i0 + r, kk] * B[kk, 0:n]
// and then the whole block is rounded to T through the bulk converters (float32 -> T ->
// float32). After the last kk the T copy is the result and goes to C.

constexpr std::int64_t kAcc16Rows = 4;  // rows of C sharing each pass over B's rows

// Transposes `count` compact rows x cols matrices at src into cols x rows ones at dst.
void transpose_into(const float* src, std::int64_t count, std::int64_t rows, std::int64_t cols,
                    float* dst) {
  constexpr std::int64_t kTile = 32;
  for (std::int64_t bi = 0; bi < count; ++bi) {
    const float* s = src + bi * rows * cols;
    float* d = dst + bi * rows * cols;
    for (std::int64_t r0 = 0; r0 < rows; r0 += kTile)
      for (std::int64_t c0 = 0; c0 < cols; c0 += kTile)
        for (std::int64_t r = r0; r < std::min(rows, r0 + kTile); ++r)
          for (std::int64_t cc = c0; cc < std::min(cols, c0 + kTile); ++cc)
            d[cc * rows + r] = s[r * cols + cc];
  }
}

// acc[0:len] += a * b[0:len].
inline void axpy(float* __restrict acc, float a, const float* __restrict b, std::int64_t len) {
  for (std::int64_t j = 0; j < len; ++j) acc[j] += a * b[j];
}

template <typename T>
void gemm_acc16(const GemmArgs& g) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  const Plan p = normalize(g);
  const T* a = static_cast<const T*>(g.a.data_ptr());
  const T* b = static_cast<const T*>(g.b.data_ptr());
  T* c = static_cast<T*>(g.out.data_ptr());
  if (p.k <= 0) return zero_output(p, c);

  thread_local Scratch<> scratch_a, scratch_b, scratch_bt;
  const std::int64_t m = p.m, n = p.n, k = p.k;
  const std::int64_t size_a = m * k, size_b = k * n;
  const std::int64_t count_a = p.sa == 0 ? 1 : p.batch, count_b = p.sb == 0 ? 1 : p.batch;
  float* fa = scratch_a.get(static_cast<std::size_t>(count_a * size_a));
  float* fb = scratch_b.get(static_cast<std::size_t>(count_b * size_b));
  pack_to_float(a, count_a, p.sa, p.rows_a(), p.cols_a(), p.lda, fa);
  pack_to_float(b, count_b, p.sb, p.rows_b(), p.cols_b(), p.ldb, fb);
  if (p.tb) {  // stored n x k: make it k x n
    float* t = scratch_bt.get(static_cast<std::size_t>(count_b * size_b));
    transpose_into(fb, count_b, n, k, t);
    fb = t;
  }

  const std::int64_t blocks = (m + kAcc16Rows - 1) / kAcc16Rows, tasks = p.batch * blocks;
  const bool par = p.batch * m * n * k > kParallelGrain && tasks > 1;
  const bool ta = p.ta;
#pragma omp parallel for schedule(static) if (par)
  for (std::int64_t t = 0; t < tasks; ++t) {
    thread_local Scratch<> acc_buf;
    thread_local Scratch<T> tmp_buf;
    const std::int64_t bi = t / blocks, i0 = (t % blocks) * kAcc16Rows;
    const std::int64_t rows = std::min(kAcc16Rows, m - i0), len = rows * n;
    float* acc = acc_buf.get(static_cast<std::size_t>(len));
    T* tmp = tmp_buf.get(static_cast<std::size_t>(len));
    std::fill(acc, acc + len, 0.0f);
    const float* ma = fa + (p.sa == 0 ? 0 : bi * size_a);
    const float* mb = fb + (p.sb == 0 ? 0 : bi * size_b);
    for (std::int64_t kk = 0; kk < k; ++kk) {
      const float* brow = mb + kk * n;
      for (std::int64_t r = 0; r < rows; ++r) {
        const float av = ta ? ma[kk * m + i0 + r] : ma[(i0 + r) * k + kk];
        axpy(acc + r * n, av, brow, n);
      }
      convert(acc, tmp, len);  // round to T ...
      convert(tmp, acc, len);  // ... and back
    }
    T* out = c + bi * p.sc + i0 * p.ldc;
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<void*>(out + r * p.ldc), tmp + r * n,
                  static_cast<std::size_t>(n) * sizeof(T));
  }
}

// float16 / bfloat16: bulk-convert A and B (once when their batch stride is 0), sgemm
// into a float32 scratch, bulk-convert the result back. low_precision_accumulation goes
// to gemm_acc16 instead.
template <typename T>
void gemm_reduced(const GemmArgs& g) {
  if (g.low_precision_accumulation) return gemm_acc16<T>(g);
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  const Plan p = normalize(g);
  const T* a = static_cast<const T*>(g.a.data_ptr());
  const T* b = static_cast<const T*>(g.b.data_ptr());
  T* c = static_cast<T*>(g.out.data_ptr());
  if (p.k <= 0) return zero_output(p, c);
  if constexpr (std::is_same_v<T, bfloat16>) {
    if (onednn_matmul_bf16(p, a, b, c)) return;
  }

  thread_local Scratch<> scratch_a, scratch_b, scratch_c;
  const std::int64_t size_a = p.rows_a() * p.cols_a(), size_b = p.rows_b() * p.cols_b();
  const std::int64_t count_a = p.sa == 0 ? 1 : p.batch, count_b = p.sb == 0 ? 1 : p.batch;
  float* fa = scratch_a.get(static_cast<std::size_t>(count_a * size_a));
  float* fb = scratch_b.get(static_cast<std::size_t>(count_b * size_b));
  float* fc = scratch_c.get(static_cast<std::size_t>(p.m * p.n));
  pack_to_float(a, count_a, p.sa, p.rows_a(), p.cols_a(), p.lda, fa);
  pack_to_float(b, count_b, p.sb, p.rows_b(), p.cols_b(), p.ldb, fb);

  for (std::int64_t bi = 0; bi < p.batch; ++bi) {
    const float* ma = fa + (p.sa == 0 ? 0 : bi * size_a);
    const float* mb = fb + (p.sb == 0 ? 0 : bi * size_b);
    blas_gemm(p.ta, p.tb, p.m, p.n, p.k, ma, p.cols_a(), mb, p.cols_b(), fc, p.n);
    T* out = c + bi * p.sc;
    if (p.ldc == p.n) {
      convert(fc, out, p.m * p.n);
    } else {
      for (std::int64_t r = 0; r < p.m; ++r) convert(fc + r * p.n, out + r * p.ldc, p.n);
    }
  }
}

}  // namespace

void register_gemm_kernels() {
  // float32 / float64 on BLAS; float16 / bfloat16 through gemm_reduced (float32 math).
  register_op<OpId::matmul>(DeviceType::CPU, []<DType::Code C>() {
    using T = element_t<C>;
    if constexpr (DType(C).is_reduced_float())
      return &gemm_reduced<T>;
    else
      return &gemm_native<T>;
  });
}

}  // namespace mixtape::cpu
