// CPU matmul kernels: float32 / float64 through OpenBLAS sgemm / dgemm; float16 and
// bfloat16 operands are converted in bulk to float32 scratch, multiplied with sgemm and
// rounded back (nearest-even) in bulk.
#include <cblas.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>

#include "backends/cpu/cpu_backend.h"
#include "mixtape/core/half.h"

namespace mixtape::cpu {
namespace {

using kernels::GemmArgs;

// A grow-only, 64-byte aligned buffer; one per thread and use, so steady-state calls
// allocate nothing.
struct Scratch {
  float* ptr = nullptr;
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
  float* get(std::size_t n) {
    if (n > cap) {
      release();
      ptr = static_cast<float*>(::operator new(n * sizeof(float), std::align_val_t(64)));
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
struct Plan {
  std::int64_t batch, m, n, k;
  bool ta, tb;
  std::int64_t lda, ldb, ldc;
  std::int64_t sa, sb, sc;
  // Rows and columns of each stored operand (before op()).
  std::int64_t rows_a() const { return ta ? k : m; }
  std::int64_t cols_a() const { return ta ? m : k; }
  std::int64_t rows_b() const { return tb ? n : k; }
  std::int64_t cols_b() const { return tb ? k : n; }
};

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

// float16 / bfloat16: bulk-convert A and B (once when their batch stride is 0), sgemm
// into a float32 scratch, bulk-convert the result back.
template <typename T>
void gemm_reduced(const GemmArgs& g) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  const Plan p = normalize(g);
  const T* a = static_cast<const T*>(g.a.data_ptr());
  const T* b = static_cast<const T*>(g.b.data_ptr());
  T* c = static_cast<T*>(g.out.data_ptr());
  if (p.k <= 0) return zero_output(p, c);

  thread_local Scratch scratch_a, scratch_b, scratch_c;
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
  register_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, kFloat32, &gemm_native<float>);
  register_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, kFloat64, &gemm_native<double>);
  register_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, kFloat16, &gemm_reduced<half>);
  register_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CPU, kBFloat16,
                                   &gemm_reduced<bfloat16>);
}

}  // namespace mixtape::cpu
