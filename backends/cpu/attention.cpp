// Fused attention on the CPU (ops attention and attention_backward): FlashAttention-2's
// tiling, so that no [t, s] matrix of a head is ever made. Written by hand because no
// library mixtape uses has it: oneDNN 2.6 (Debian 12) has no attention primitive and
// OpenBLAS only the GEMMs, which the tiles use.
//
// Forward, per block of kBr query rows of a head: the logits of one block of kBc keys at a
// time (a GEMM), an online softmax (the running maximum and sum of each row, rescaling what
// was accumulated when the maximum grows), the weighted values added (a GEMM). The
// log-sum-exp of each row is kept for the backward pass. Backward, per head, FlashAttention-2's
// order: for each block of keys, every query block that sees it recomputes its weights from
// the log-sum-exp, and dV, dK (that key block's) and dQ (accumulated over key blocks) follow
// from GEMMs. The math runs in float32 (float64 for float64); 16-bit inputs are widened a
// head at a time, and results rounded once. The heads are read and written where they lie
// (the strided views of kernels.h): float32 and float64 rows go to the GEMMs with their stride.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/cpu_util.h"
#include "backends/cpu/gemm_util.h"
#include "mixtape/core/dropout_hash.h"
#include "mixtape/core/head_rows.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

constexpr int64_t kBr = 64;  // query rows per tile
constexpr int64_t kBc = 64;  // keys per tile

// The extents of a call: n heads of t queries and s keys, head dims d (q, k) and dv (v).
struct Extents {
  int64_t n, t, s, d, dv;
};

Extents extents_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  return {head_count(q), q.dim(-2), k.dim(-2), q.dim(-1), v.dim(-1)};
}

// The mask bytes of head h, row i, from key j0 on; null without a mask.
inline const std::uint8_t* mask_at(const HeadRows<const std::uint8_t>& mask, int64_t h, int64_t i,
                                   int64_t j0) {
  return mask.base ? mask.row(h, i) + j0 : nullptr;
}

// Rows [i0, i0 + rows) of head h (`cols` wide) in the compute type, and the distance between
// them: read where they lie for float32 and float64 (the GEMMs take the rows' stride), widened
// into buf otherwise.
template <typename T>
struct ComputeRows {
  const compute_t<T>* data;
  int64_t ld;
};
template <typename T>
ComputeRows<T> rows_as_compute(const HeadRows<const T>& x, int64_t h, int64_t i0, int64_t rows,
                               int64_t cols, std::vector<compute_t<T>>& buf) {
  if constexpr (std::is_same_v<T, bfloat16>) {
    // bfloat16 widens by a shift, inline: a call per row of the bulk converter costs more
    // than the row (the rows of a projection's head lie apart).
    buf.resize(static_cast<std::size_t>(rows * cols));
    constexpr int64_t kAhead = 8;  // rows fetched ahead: the rows lie apart, out of the
                                   // hardware prefetcher's reach
    for (int64_t r = 0; r < rows; ++r) {
      const bfloat16* src = x.row(h, i0 + r);
      if (r + kAhead < rows) {
        const auto* next = reinterpret_cast<const char*>(x.row(h, i0 + r + kAhead));
        for (int64_t b = 0; b < cols * 2; b += 64) __builtin_prefetch(next + b);
      }
      float* dst = buf.data() + r * cols;
      for (int64_t c = 0; c < cols; ++c)
        dst[c] = std::bit_cast<float>(static_cast<std::uint32_t>(src[c].bits) << 16);
    }
    return {buf.data(), cols};
  } else if constexpr (kReduced<T>) {
    buf.resize(static_cast<std::size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) to_float(x.row(h, i0 + r), buf.data() + r * cols, cols);
    return {buf.data(), cols};
  } else {
    return {x.row(h, i0), x.stride};
  }
}

// rows x cols compute-type values (row r at src + r * cols) into rows [i0, i0 + rows) of head h.
template <typename T>
void rows_from_compute(const compute_t<T>* src, const HeadRows<T>& x, int64_t h, int64_t i0,
                       int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) from_compute(src + r * cols, x.row(h, i0 + r), cols);
}

// Dropout on the weights (kernels.h): the factor Z of each element, 1 / (1 - rate) where
// dropout_keeps() keeps it, 0 elsewhere.
struct Dropout {
  bool on = false;
  std::uint64_t seed = 0;
  std::uint32_t threshold = 0;
  double inv_keep = 1.0;
  explicit Dropout(const kernels::AttentionDropout& d)
      : on(d.rate > 0.0),
        seed(seed_of(d.seed, d.seed_at)),
        threshold(dropout_threshold(d.rate)),
        inv_keep(1.0 / (1.0 - d.rate)) {}
  // z[c] = Z of keys j0 + c (c < bc) of row i of head h, in a call of t queries and s keys.
  template <typename C>
  void factors(int64_t h, int64_t i, int64_t j0, int64_t bc, int64_t t, int64_t s, C* z) const {
    const auto base = static_cast<std::uint64_t>((h * t + i) * s + j0);
    const auto keep = static_cast<C>(inv_keep);
    for (int64_t c = 0; c < bc; ++c)
      z[c] = dropout_keeps(seed, base + static_cast<std::uint64_t>(c), threshold) ? keep : C(0);
  }
};

// The row loops of a tile, written as masked_softmax's are (omp simd loops of bit blends and
// exp_any, so that they vectorise; an AVX2 build of each is picked at run time). A row holds
// bc logits of keys j0.. ; `limit` keys of them may be attended (causal: those <= i), `m` the
// mask bytes of those keys or null.

// Forward: the logits scaled (-inf where not attended), the row's new maximum over them and
// `old`, then the weights exp(x - max) in place; returns the new maximum and adds the
// weights' sum to *sum (after *sum was rescaled by the caller). A row with nothing attended
// so far (maximum -inf) becomes 0.
template <typename C>
MIXTAPE_ALWAYS_INLINE C forward_row_impl(C* row, const std::uint8_t* m, int64_t limit, int64_t bc,
                                         C scale, C old, C* sum) {
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  C mx = old;
  if (m) {
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < bc; ++c) {
      const C v = blend(c < limit && m[c] != 0, row[c] * scale, kNegInf);
      row[c] = v;
      mx = v > mx ? v : mx;
    }
  } else {
#pragma omp simd reduction(max : mx)
    for (int64_t c = 0; c < bc; ++c) {
      const C v = blend(c < limit, row[c] * scale, kNegInf);
      row[c] = v;
      mx = v > mx ? v : mx;
    }
  }
  if (mx == kNegInf) {
    std::fill(row, row + bc, C(0));
    return mx;
  }
  C s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < bc; ++c) {
    row[c] = exp_any(row[c] - mx);  // exp(-inf) = 0 where not attended; NaN stays NaN
    s += row[c];
  }
  *sum += s;
  return mx;
}

// Backward: P = exp(scale x - lse) where attended, 0 elsewhere, in place.
template <typename C>
MIXTAPE_ALWAYS_INLINE void weights_row_impl(C* row, const std::uint8_t* m, int64_t limit,
                                            int64_t bc, C scale, C lse) {
  if (m) {
#pragma omp simd
    for (int64_t c = 0; c < bc; ++c)
      row[c] = blend(c < limit && m[c] != 0, exp_any(row[c] * scale - lse), C(0));
  } else {
#pragma omp simd
    for (int64_t c = 0; c < bc; ++c) row[c] = blend(c < limit, exp_any(row[c] * scale - lse), C(0));
  }
}

template <typename C>
C forward_row(C* row, const std::uint8_t* m, int64_t limit, int64_t bc, C scale, C old, C* sum) {
  return forward_row_impl(row, m, limit, bc, scale, old, sum);
}
template <typename C>
void weights_row(C* row, const std::uint8_t* m, int64_t limit, int64_t bc, C scale, C lse) {
  weights_row_impl(row, m, limit, bc, scale, lse);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
template <typename C>
__attribute__((target("avx2,fma"))) C forward_row_avx2(C* row, const std::uint8_t* m, int64_t limit,
                                                       int64_t bc, C scale, C old, C* sum) {
  return forward_row_impl(row, m, limit, bc, scale, old, sum);
}
template <typename C>
__attribute__((target("avx2,fma"))) void weights_row_avx2(C* row, const std::uint8_t* m,
                                                          int64_t limit, int64_t bc, C scale,
                                                          C lse) {
  weights_row_impl(row, m, limit, bc, scale, lse);
}
#endif

// The keys of a tile [j0, j0 + bc) that row i may attend, as a count from j0 (causal: j <= i).
inline int64_t limit_of(bool causal, int64_t i, int64_t j0, int64_t bc) {
  return causal ? std::clamp<int64_t>(i - j0 + 1, 0, bc) : bc;
}

// The keys a block of rows [i0, i1) may attend: [0, s), or [0, min(s, i1)) when causal.
inline int64_t key_end(bool causal, int64_t i1, int64_t s) { return causal ? std::min(s, i1) : s; }

template <typename T>
void attention_kernel(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t, const Tensor& mask_t,
                      bool causal, double scale_d, const kernels::AttentionDropout& dropout_args,
                      const Tensor& out_t, const Tensor& lse_t) {
  using C = compute_t<T>;
  const Extents e = extents_of(q_t, k_t, v_t);
  if (e.n * e.t == 0) return;
  const auto q = head_rows<const T>(q_t), k = head_rows<const T>(k_t), v = head_rows<const T>(v_t);
  const auto mask = head_rows<const std::uint8_t>(mask_t);
  const Dropout dropout(dropout_args);
  const auto out = head_rows<T>(out_t);
  C* lse = static_cast<C*>(lse_t.data_ptr());
  const C scale = static_cast<C>(scale_d);
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  const int64_t blocks = (e.t + kBr - 1) / kBr;
  const int64_t tasks = e.n * blocks;
  const int64_t work = e.n * e.t * e.s * (e.d + e.dv);
  auto* row_fn = &forward_row<C>;
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) row_fn = &forward_row_avx2<C>;
#endif
  parallel_region(tasks > 1 && work > kParallelGrain, [&] {
    std::vector<C> qb, kb, vb, scores(static_cast<std::size_t>(kBr * kBc)),
        acc(static_cast<std::size_t>(kBr * e.dv)), m(kBr), l(kBr), z(dropout.on ? kBc : 0);
    // The keys and values of the head this thread widened last: the tasks go head by head,
    // so a thread's next block is mostly of the same head, and K and V are widened once.
    int64_t widened = -1;
    ComputeRows<T> kc{}, vc{};
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t h = task / blocks, i0 = (task % blocks) * kBr, i1 = std::min(e.t, i0 + kBr);
      const int64_t br = i1 - i0, kend = key_end(causal, i1, e.s);
      const auto qc = rows_as_compute(q, h, i0, br, e.d, qb);
      if (h != widened) {
        kc = rows_as_compute(k, h, 0, e.s, e.d, kb);
        vc = rows_as_compute(v, h, 0, e.s, e.dv, vb);
        widened = h;
      }
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), C(0));
      std::fill(acc.begin(), acc.begin() + br * e.dv, C(0));
      for (int64_t j0 = 0; j0 < kend; j0 += kBc) {
        const int64_t bc = std::min(kend, j0 + kBc) - j0;
        blas_gemm(false, true, br, bc, e.d, qc.data, qc.ld, kc.data + j0 * kc.ld, kc.ld, C(0),
                  scores.data(), kBc);
        for (int64_t r = 0; r < br; ++r) {
          const int64_t i = i0 + r;
          const std::uint8_t* mr = mask_at(mask, h, i, j0);
          const auto ru = static_cast<std::size_t>(r);
          const C old = m[ru];
          C sum = 0;
          const C mx = row_fn(scores.data() + r * kBc, mr, limit_of(causal, i, j0, bc), bc, scale,
                              old, &sum);
          if (mx == kNegInf) continue;  // nothing attended yet: no weight in this block either
          // The weights so far were relative to the old maximum: rescaled to the new one.
          const C alpha = old == kNegInf ? C(0) : std::exp(old - mx);
          l[ru] = l[ru] * alpha + sum;
          m[ru] = mx;
          if (alpha != C(1)) {
            C* a = acc.data() + r * e.dv;
#pragma omp simd
            for (int64_t c = 0; c < e.dv; ++c) a[c] *= alpha;
          }
          // Dropout: the weights that go into the values dropped or scaled; the sum above
          // (the softmax's denominator) is the undropped one's.
          if (dropout.on) {
            dropout.factors(h, i, j0, bc, e.t, e.s, z.data());
            C* row = scores.data() + r * kBc;
#pragma omp simd
            for (int64_t c = 0; c < bc; ++c) row[c] *= z[static_cast<std::size_t>(c)];
          }
        }
        blas_gemm(false, false, br, e.dv, bc, scores.data(), kBc, vc.data + j0 * vc.ld, vc.ld, C(1),
                  acc.data(), e.dv);
      }
      for (int64_t r = 0; r < br; ++r) {
        const C lr = l[static_cast<std::size_t>(r)];
        C* a = acc.data() + r * e.dv;
        // A row that attends nothing is 0 (as masked_softmax's), its log-sum-exp -inf.
        const C inv = lr > C(0) || std::isnan(lr) ? C(1) / lr : C(0);
        for (int64_t c = 0; c < e.dv; ++c) a[c] = lr == C(0) ? C(0) : a[c] * inv;
        lse[h * e.t + i0 + r] =
            lr == C(0) ? kNegInf : m[static_cast<std::size_t>(r)] + std::log(lr);
      }
      rows_from_compute(acc.data(), out, h, i0, br, e.dv);
    }
  });
}

// D_i = sum_c dout[i, c] out[i, c] for the t rows of a head (dout in g, out in o, dv columns
// each): sum_j P_ij dP_ij, the softmax's correction.
template <typename T>
void softmax_correction(const ComputeRows<T>& g, const ComputeRows<T>& o, int64_t t, int64_t dv,
                        compute_t<T>* rowdot) {
  for (int64_t i = 0; i < t; ++i) {
    compute_t<T> s = 0;
    for (int64_t c = 0; c < dv; ++c) s += g.data[i * g.ld + c] * o.data[i * o.ld + c];
    rowdot[i] = s;
  }
}

// dS = P (dP - D) scale over a tile of br rows of bc keys (rows kBc apart), in p; d holds D
// of the tile's rows.
template <typename C>
void score_grads(C* p, const C* dp, const C* d, int64_t br, int64_t bc, C scale) {
  for (int64_t r = 0; r < br; ++r) {
    const C di = d[r];
    C* row = p + r * kBc;
    const C* drow = dp + r * kBc;
#pragma omp simd
    for (int64_t c = 0; c < bc; ++c) row[c] = row[c] * (drow[c] - di) * scale;
  }
}

template <typename T>
void attention_backward_kernel(const Tensor& q_t, const Tensor& k_t, const Tensor& v_t,
                               const Tensor& mask_t, bool causal, double scale_d,
                               const kernels::AttentionDropout& dropout_args, const Tensor& out_t,
                               const Tensor& lse_t, const Tensor& dout_t, const Tensor& dq_t,
                               const Tensor& dk_t, const Tensor& dv_t) {
  using C = compute_t<T>;
  const Extents e = extents_of(q_t, k_t, v_t);
  const auto q = head_rows<const T>(q_t), k = head_rows<const T>(k_t), v = head_rows<const T>(v_t);
  const auto mask = head_rows<const std::uint8_t>(mask_t);
  const Dropout dropout(dropout_args);
  const auto out = head_rows<const T>(out_t), dout = head_rows<const T>(dout_t);
  const C* lse = static_cast<const C*>(lse_t.const_data_ptr());
  const auto dq = head_rows<T>(dq_t), dk = head_rows<T>(dk_t), dv = head_rows<T>(dv_t);
  const C scale = static_cast<C>(scale_d);
  constexpr C kNegInf = -std::numeric_limits<C>::infinity();
  const int64_t work = e.n * e.t * e.s * (e.d + e.dv);
  auto* row_fn = &weights_row<C>;
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) row_fn = &weights_row_avx2<C>;
#endif
  parallel_region(e.n > 1 && work > kParallelGrain, [&] {
    std::vector<C> qb, kb, vb, ob, gb, dqa, dka, dva, rowdot(static_cast<std::size_t>(e.t));
    std::vector<C> p(static_cast<std::size_t>(kBr * kBc)), dp(static_cast<std::size_t>(kBr * kBc));
    // Dropout: the tile's factors Z and the dropped weights P o Z.
    std::vector<C> z(dropout.on ? kBr * kBc : 0), pz(dropout.on ? kBr * kBc : 0);
#pragma omp for schedule(dynamic)
    for (int64_t h = 0; h < e.n; ++h) {
      const auto qc = rows_as_compute(q, h, 0, e.t, e.d, qb);
      const auto kc = rows_as_compute(k, h, 0, e.s, e.d, kb);
      const auto vc = rows_as_compute(v, h, 0, e.s, e.dv, vb);
      const auto oc = rows_as_compute(out, h, 0, e.t, e.dv, ob);
      const auto gc = rows_as_compute(dout, h, 0, e.t, e.dv, gb);
      const C* lh = lse + h * e.t;
      softmax_correction(gc, oc, e.t, e.dv, rowdot.data());
      dqa.assign(static_cast<std::size_t>(e.t * e.d), C(0));
      dka.assign(static_cast<std::size_t>(e.s * e.d), C(0));
      dva.assign(static_cast<std::size_t>(e.s * e.dv), C(0));
      for (int64_t j0 = 0; j0 < e.s; j0 += kBc) {
        const int64_t bc = std::min(e.s, j0 + kBc) - j0;
        // Causal: rows before j0 see none of these keys.
        for (int64_t i0 = causal ? (j0 / kBr) * kBr : 0; i0 < e.t; i0 += kBr) {
          const int64_t br = std::min(e.t, i0 + kBr) - i0;
          // P = the forward's weights of this tile, from the logits and the log-sum-exp.
          blas_gemm(false, true, br, bc, e.d, qc.data + i0 * qc.ld, qc.ld, kc.data + j0 * kc.ld,
                    kc.ld, C(0), p.data(), kBc);
          for (int64_t r = 0; r < br; ++r) {
            const int64_t i = i0 + r;
            const std::uint8_t* mr = mask_at(mask, h, i, j0);
            // A row that attends nothing (lse -inf) has no weights.
            row_fn(p.data() + r * kBc, mr, lh[i] == kNegInf ? 0 : limit_of(causal, i, j0, bc), bc,
                   scale, lh[i]);
          }
          // Dropout: the weights that reached the values, P o Z.
          const C* pv = p.data();
          if (dropout.on) {
            for (int64_t r = 0; r < br; ++r) {
              C* zr = z.data() + r * kBc;
              dropout.factors(h, i0 + r, j0, bc, e.t, e.s, zr);
              const C* prow = p.data() + r * kBc;
              C* pzr = pz.data() + r * kBc;
#pragma omp simd
              for (int64_t c = 0; c < bc; ++c) pzr[c] = prow[c] * zr[c];
            }
            pv = pz.data();
          }
          // dV_j += (P o Z)^T dout; dP = dout V_j^T (times Z: the gradient of P).
          blas_gemm(true, false, bc, e.dv, br, pv, kBc, gc.data + i0 * gc.ld, gc.ld, C(1),
                    dva.data() + j0 * e.dv, e.dv);
          blas_gemm(false, true, br, bc, e.dv, gc.data + i0 * gc.ld, gc.ld, vc.data + j0 * vc.ld,
                    vc.ld, C(0), dp.data(), kBc);
          if (dropout.on)
            for (int64_t r = 0; r < br; ++r) {
              C* dr = dp.data() + r * kBc;
              const C* zr = z.data() + r * kBc;
#pragma omp simd
              for (int64_t c = 0; c < bc; ++c) dr[c] *= zr[c];
            }
          // dS = P (dP - D) scale, in p.
          score_grads(p.data(), dp.data(), rowdot.data() + i0, br, bc, scale);
          // dQ_i += dS K_j; dK_j += dS^T Q_i.
          blas_gemm(false, false, br, e.d, bc, p.data(), kBc, kc.data + j0 * kc.ld, kc.ld, C(1),
                    dqa.data() + i0 * e.d, e.d);
          blas_gemm(true, false, bc, e.d, br, p.data(), kBc, qc.data + i0 * qc.ld, qc.ld, C(1),
                    dka.data() + j0 * e.d, e.d);
        }
      }
      rows_from_compute(dqa.data(), dq, h, 0, e.t, e.d);
      rows_from_compute(dka.data(), dk, h, 0, e.s, e.d);
      rows_from_compute(dva.data(), dv, h, 0, e.s, e.dv);
    }
  });
}

}  // namespace

void register_attention_kernels() {
  MIXTAPE_CPU_KERNEL(attention, attention_kernel);
  MIXTAPE_CPU_KERNEL(attention_backward, attention_backward_kernel);
}

}  // namespace mixtape::cpu
