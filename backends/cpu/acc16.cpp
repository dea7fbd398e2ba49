// The 16-bit accumulation emulation of the CPU backend (MIXTAPE_FP16_USE_FP32_COMPUTE=0:
// GemmArgs::low_precision_accumulation and Conv2dGeometry::low_precision_accumulation):
// float16 / bfloat16 matmul and conv2d kernels that behave as if their accumulators were
// of the 16-bit type, for GEMM and the three conv2d passes alike. Both take their terms
// one at a time into float32 accumulators, acc += a * b (axpy), and round the
// accumulators to the 16-bit type after every step (round_span).
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "backends/cpu/gemm_util.h"

namespace mixtape::cpu {
namespace {

// acc[0:len] += a * b[0:len].
inline void axpy(float* __restrict acc, float a, const float* __restrict b, std::int64_t len) {
  for (std::int64_t j = 0; j < len; ++j) acc[j] += a * b[j];
}

// acc[0:len] = float(T(acc[0:len])), with tmp (len T's) as the T copy.
template <typename T>
inline void round_span(float* acc, T* tmp, std::int64_t len) {
  convert(acc, tmp, len);
  convert(tmp, acc, len);
}

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

}  // namespace

// --- matmul (GemmArgs::low_precision_accumulation) ----------------------------------
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

template <typename T>
void gemm_acc16(const GemmArgs& g) {
  const auto operands = gemm_operands<T>(g);
  if (!operands) return;
  const auto& [p, a, b, c] = *operands;

  thread_local Scratch<> scratch_a, scratch_b, scratch_bt;
  const std::int64_t m = p.m, n = p.n, k = p.k;
  const FloatOperands f = float_operands(p, a, b, scratch_a, scratch_b);
  const std::int64_t size_a = f.size_a, size_b = f.size_b;  // m * k, k * n
  const float* fa = f.a;
  const float* fb = f.b;
  if (p.tb) {  // stored n x k: make it k x n
    float* t = scratch_bt.get(f.count_b * size_b);
    transpose_into(f.b, f.count_b, n, k, t);
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
    float* acc = acc_buf.get(len);
    T* tmp = tmp_buf.get(len);
    std::fill(acc, acc + len, 0.0f);
    const float* ma = fa + (p.sa == 0 ? 0 : bi * size_a);
    const float* mb = fb + (p.sb == 0 ? 0 : bi * size_b);
    for (std::int64_t kk = 0; kk < k; ++kk) {
      const float* brow = mb + kk * n;
      for (std::int64_t r = 0; r < rows; ++r) {
        const float av = ta ? ma[kk * m + i0 + r] : ma[(i0 + r) * k + kk];
        axpy(acc + r * n, av, brow, n);
      }
      round_span(acc, tmp, len);
    }
    T* out = c + bi * p.sc + i0 * p.ldc;
    for (std::int64_t r = 0; r < rows; ++r)
      std::memcpy(static_cast<void*>(out + r * p.ldc), tmp + r * n,
                  static_cast<std::size_t>(n) * sizeof(T));
  }
}

// --- conv2d (Conv2dGeometry::low_precision_accumulation) ---------------------------
//
// Emulates convolution kernels whose accumulators are T (float16 or bfloat16): each
// output element starts at 0 and takes its terms one at a time,
//   acc = round_T(acc + a * b)
// with the product and the sum in float32 (the product of two float16 values is exact in
// float32, and so is that of two bfloat16 values within float32's range) and round_T
// rounding to nearest even like mixtape::half / mixtape::bfloat16. Taps over the
// padding are skipped (with finite operands their zero products would leave acc as is).
// Inputs arrive as float32 (bulk-converted); accumulators are float32 buffers holding
// T-representable values, rounded after each step through the bulk converters
// (float32 -> T -> float32, using the output as the T buffer). A step updates a set of
// accumulators that each get one term, then rounds a span covering them (rounding a
// value that is already a T changes nothing). The order of the terms of each element:
//   forward          out[i, oy, ox, co]:   taps (ky, kx, ci) in row-major order
//                                          (the im2col / GEMM reduction order)
//   backward weight  dw[ky, kx, ci, co]:   output pixels (i, oy, ox) in row-major order
//   backward input   dx[i, iy, ix, ci]:    output rows oy ascending, then kx ascending,
//                                          then co ascending (ky and ox follow from
//                                          oy and kx)
// Each runs on OpenMP threads over rows whose accumulators no other thread touches:
// output rows (forward), input rows (backward input), and (tap, input-channel block)
// rows of dw (backward weight).

// body(r, acc, o) for each of `rows` rows of row_len outputs (in parallel when `work` is
// large): acc is a float32 accumulator row of the thread's, zeroed, and o the row of `out`;
// then acc is stored into o.
template <typename T, typename Body>
void for_each_acc_row(T* out, std::int64_t rows, std::int64_t row_len, std::int64_t work,
                      Body&& body) {
  parallel_rows(rows, work, [&](std::int64_t r) {
    thread_local Scratch<float> acc_buf;
    float* acc = acc_buf.get(row_len);
    std::fill(acc, acc + row_len, 0.0f);
    T* o = out + r * row_len;
    body(r, acc, o);
    convert(acc, o, row_len);
  });
}

template <typename T>
void conv_forward_acc16(const float* x, const float* w, const float* bias, T* out,
                        const Conv2dGeometry& g) {
  const std::int64_t c = g.c, cout = g.cout, rows = g.n * g.oh, row_len = g.ow * cout;
  if (rows * row_len == 0) return;
  const std::int64_t work = rows * row_len * g.kh * g.kw * c;
  for_each_acc_row(out, rows, row_len, work, [&](std::int64_t r, float* acc, T* o) {
    const std::int64_t i = r / g.oh, oy = r % g.oh;
    const TapRange ty = tap_range(oy, g.stride_h, g.pad_top, g.kh, g.h);
    for (std::int64_t ky = ty.lo; ky < ty.hi; ++ky) {
      const float* xrow = x + ((i * g.h) + oy * g.stride_h - g.pad_top + ky) * g.w * c;
      for (std::int64_t kx = 0; kx < g.kw; ++kx) {
        const TapRange ox = out_range(kx, g.stride_w, g.pad_left, g.w, g.ow);
        if (ox.lo >= ox.hi) continue;
        for (std::int64_t ci = 0; ci < c; ++ci) {
          const float* wr = w + ((ky * g.kw + kx) * c + ci) * cout;
          for (std::int64_t q = ox.lo; q < ox.hi; ++q)
            axpy(acc + q * cout, xrow[(q * g.stride_w - g.pad_left + kx) * c + ci], wr, cout);
          round_span(acc + ox.lo * cout, o + ox.lo * cout, (ox.hi - ox.lo) * cout);
        }
      }
    }
    if (bias)  // the last term of each sum, rounded like the others
      for (std::int64_t q = 0; q < g.ow; ++q) axpy(acc + q * cout, 1.0f, bias, cout);
  });
}

template <typename T>
void conv_backward_input_acc16(const float* grad_out, const float* w, T* grad_x,
                               const Conv2dGeometry& g) {
  const std::int64_t c = g.c, cout = g.cout, taps = g.kh * g.kw;
  const std::int64_t rows = g.n * g.h, row_len = g.w * c;
  if (rows * row_len == 0) return;
  // w as [kh, kw, cout, c]: one output channel's weights over the input channels in a row.
  float* wt = scratch<float>(kColSlot).get(taps * cout * c);
  for (std::int64_t tap = 0; tap < taps; ++tap)
    for (std::int64_t ci = 0; ci < c; ++ci)
      for (std::int64_t co = 0; co < cout; ++co)
        wt[(tap * cout + co) * c + ci] = w[(tap * c + ci) * cout + co];
  const std::int64_t work = g.n * g.oh * g.ow * taps * c * cout;
  for_each_acc_row(grad_x, rows, row_len, work, [&](std::int64_t r, float* acc, T* o) {
    const std::int64_t i = r / g.h, iy = r % g.h;
    // Output rows whose window covers input row iy: ky = iy + pad_top - oy * stride_h is
    // in [0, kh).
    const std::int64_t first = iy + g.pad_top - g.kh + 1;
    const std::int64_t oy_lo = first <= 0 ? 0 : (first + g.stride_h - 1) / g.stride_h;
    const std::int64_t oy_hi = std::min(g.oh, (iy + g.pad_top) / g.stride_h + 1);
    for (std::int64_t oy = oy_lo; oy < oy_hi; ++oy) {
      const std::int64_t ky = iy + g.pad_top - oy * g.stride_h;
      const float* gorow = grad_out + (i * g.oh + oy) * g.ow * cout;
      for (std::int64_t kx = 0; kx < g.kw; ++kx) {
        const TapRange ox = out_range(kx, g.stride_w, g.pad_left, g.w, g.ow);
        if (ox.lo >= ox.hi) continue;
        const std::int64_t ix_lo = ox.lo * g.stride_w - g.pad_left + kx;
        const std::int64_t ix_end = (ox.hi - 1) * g.stride_w - g.pad_left + kx + 1;
        for (std::int64_t co = 0; co < cout; ++co) {
          const float* wr = wt + ((ky * g.kw + kx) * cout + co) * c;
          for (std::int64_t q = ox.lo; q < ox.hi; ++q)
            axpy(acc + (q * g.stride_w - g.pad_left + kx) * c, gorow[q * cout + co], wr, c);
          round_span(acc + ix_lo * c, o + ix_lo * c, (ix_end - ix_lo) * c);
        }
      }
    }
  });
}

template <typename T>
void conv_backward_weight_acc16(const float* x, const float* grad_out, T* grad_w,
                                const Conv2dGeometry& g) {
  const std::int64_t c = g.c, cout = g.cout, taps = g.kh * g.kw;
  if (taps * c * cout == 0) return;
  const int nt = threads_for(g.n * g.oh * g.ow * taps * c * cout);
  // Tasks: (tap, block of cb input channels), about four per thread.
  const std::int64_t splits = std::clamp<std::int64_t>((4 * nt + taps - 1) / taps, 1, c);
  const std::int64_t cb = (c + splits - 1) / splits, blocks = (c + cb - 1) / cb;
  const std::int64_t tasks = taps * blocks;
#pragma omp parallel for schedule(dynamic) num_threads(nt) if (nt > 1 && tasks > 1)
  for (std::int64_t t = 0; t < tasks; ++t) {
    const std::int64_t tap = t / blocks, ci0 = (t % blocks) * cb, cn = std::min(cb, c - ci0);
    const std::int64_t ky = tap / g.kw, kx = tap % g.kw, len = cn * cout;
    thread_local Scratch<float> acc_buf;
    float* acc = acc_buf.get(len);
    std::fill(acc, acc + len, 0.0f);
    T* o = grad_w + (tap * c + ci0) * cout;
    const TapRange oy = out_range(ky, g.stride_h, g.pad_top, g.h, g.oh);
    const TapRange ox = out_range(kx, g.stride_w, g.pad_left, g.w, g.ow);
    for (std::int64_t i = 0; i < g.n; ++i)
      for (std::int64_t py = oy.lo; py < oy.hi; ++py) {
        const std::int64_t iy = py * g.stride_h - g.pad_top + ky;
        for (std::int64_t px = ox.lo; px < ox.hi; ++px) {
          const std::int64_t ix = px * g.stride_w - g.pad_left + kx;
          const float* xs = x + ((i * g.h + iy) * g.w + ix) * c + ci0;
          const float* go = grad_out + ((i * g.oh + py) * g.ow + px) * cout;
          for (std::int64_t cj = 0; cj < cn; ++cj) axpy(acc + cj * cout, xs[cj], go, cout);
          round_span(acc, o, len);
        }
      }
    convert(acc, o, len);
  }
}

template void gemm_acc16<half>(const GemmArgs&);
template void gemm_acc16<bfloat16>(const GemmArgs&);
template void conv_forward_acc16<half>(const float*, const float*, const float*, half*,
                                       const Conv2dGeometry&);
template void conv_forward_acc16<bfloat16>(const float*, const float*, const float*, bfloat16*,
                                           const Conv2dGeometry&);
template void conv_backward_input_acc16<half>(const float*, const float*, half*,
                                              const Conv2dGeometry&);
template void conv_backward_input_acc16<bfloat16>(const float*, const float*, bfloat16*,
                                                  const Conv2dGeometry&);
template void conv_backward_weight_acc16<half>(const float*, const float*, half*,
                                               const Conv2dGeometry&);
template void conv_backward_weight_acc16<bfloat16>(const float*, const float*, bfloat16*,
                                                   const Conv2dGeometry&);

}  // namespace mixtape::cpu
