// CPU elementwise kernels: unary math, binary arithmetic, comparisons and where.
//
// float16/bfloat16 are computed in float32, a block (kBlock elements) at a time: inputs
// are bulk-converted to float32 stack buffers, the float loop runs, and the result is
// bulk-converted back. Binary inputs arrive as broadcast views (stride 0 on broadcast
// axes): the geometry is coalesced, then walked as rows of the innermost dimension, each
// row in chunks of at most kBlock; inner strides of 0 or 1 get dedicated (vectorisable)
// loops, other strides are gathered into a buffer first.
//
// float32 exp, tanh and sigmoid use the branch-free exp_f32 (cpu_util.h) / tanh_f32 below
// (<= 1.6 ulp) so that their loops vectorise; float32 erf and gelu (erfc) call glibc's
// vector math library (libmvec: erff / erfcf four lanes at a time, where CMake finds it;
// activation_math.h, which the fused linear op's epilogues share);
// log, pow and all float64 math call the C library per element; sqrt / rsqrt vectorise as
// the library is built with -fno-math-errno.
//
// Integer semantics: add/sub/mul/neg/abs wrap modulo 2^bits (no UB on overflow); div
// truncates toward zero, and x / 0 is defined as 0 (no trap); INT_MIN / -1 wraps to
// INT_MIN. Float maximum/minimum propagate NaN (as numpy does).
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backends/cpu/activation_math.h"
#include "backends/cpu/cpu_util.h"
#include "core/strided_layout.h"

namespace mixtape::cpu {
namespace {

using std::int64_t;

// --- Strided iteration -----------------------------------------------------------------

// The common geometry of K operands (operand 0 is the contiguous output), merged
// (core/strided_layout.h).
template <int K>
using Layout = detail::StridedLayout<K>;
using detail::coalesce;

// Calls body(offsets, inner_strides, len) for each chunk (at most kBlock elements of one
// innermost row); offsets are the operands' element offsets of the chunk's first element.
// Threads take contiguous ranges of chunks and walk the outer index with a counter.
template <int K, typename Body>
void for_each_chunk(const Layout<K>& l, Body&& body) {
  const int r = static_cast<int>(l.shape.size());
  int64_t n = 1;
  for (int64_t e : l.shape) n *= e;
  if (n == 0) return;
  const int64_t inner = l.shape[r - 1];
  const int64_t per_row = (inner + kBlock - 1) / kBlock;
  const int64_t units = n / inner * per_row;
  const std::array<int64_t, K>& is = l.strides[r - 1];
  parallel_ranges(n, units, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> idx(static_cast<std::size_t>(r - 1));
    std::array<int64_t, K> base{};
    int64_t rem = u0 / per_row, chunk = u0 % per_row;
    for (int d = r - 2; d >= 0; --d) {
      idx[d] = rem % l.shape[d];
      rem /= l.shape[d];
      for (int k = 0; k < K; ++k) base[k] += idx[d] * l.strides[d][k];
    }
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t start = chunk * kBlock;
      std::array<int64_t, K> offs;
      for (int k = 0; k < K; ++k) offs[k] = base[k] + start * is[k];
      body(offs, is, std::min(kBlock, inner - start));
      if (++chunk == per_row) {  // next row: advance the outer counter
        chunk = 0;
        for (int d = r - 2; d >= 0; --d) {
          for (int k = 0; k < K; ++k) base[k] += l.strides[d][k];
          if (++idx[d] < l.shape[d]) break;
          for (int k = 0; k < K; ++k) base[k] -= l.shape[d] * l.strides[d][k];
          idx[d] = 0;
        }
      }
    }
  });
}

// --- float32 math that vectorises (see cpu_util.h) ---------------------------------

// tanh: |x| < 0.625: x + x^3 Q(x^2), Q a degree-5 Chebyshev interpolant of
// (tanh(x) - x) / x^3 (error < 1e-8 relative); otherwise (1 - e) / (1 + e) with
// e = exp(-2|x|) <= 0.29, which does not cancel. Measured: <= 1.57 ulp.
inline float tanh_f32(float x) {
  const float a = std::fabs(x);
  const float z = x * x;
  float q = 0.002292744815349579f;
  q = q * z - 0.008343945257365704f;
  q = q * z + 0.02176891826093197f;
  q = q * z - 0.053959257900714874f;
  q = q * z + 0.13333304226398468f;
  q = q * z - 0.3333333432674408f;
  const float small = std::copysign(x + x * z * q, x);  // copysign keeps -0
  const float e = exp_f32(-2.0f * a);
  const float big = std::copysign((1.0f - e) / (1.0f + e), x);
  return blend(a < 0.625f, small, big);  // NaN takes the big path
}

// --- Op functors -------------------------------------------------------------------------

// The functor of each unary and binary elementwise op of the op table: every op whose
// kernel is a UnaryFn / BinaryFn needs one (registration does not compile without it).
// Binary functors that return bool are comparisons: their kernels write bool outputs.
template <OpId op>
struct UnaryOp;
template <OpId op>
struct BinaryOp;

// Integer helpers: wrapping arithmetic through the unsigned type.
template <typename T>
T wrap_neg(T x) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(U(0) - static_cast<U>(x));
}

template <>
struct UnaryOp<OpId::neg> {
  template <typename T>
  T operator()(T x) const {
    if constexpr (std::is_integral_v<T>)
      return wrap_neg(x);
    else
      return -x;
  }
};
template <>
struct UnaryOp<OpId::abs> {
  template <typename T>
  T operator()(T x) const {
    if constexpr (std::is_integral_v<T>)
      return x < 0 ? wrap_neg(x) : x;
    else
      return std::fabs(x);
  }
};
// The unary ops whose functor is one expression of x.
#define MIXTAPE_UNARY_EXPR(op_name, expr) \
  template <>                             \
  struct UnaryOp<OpId::op_name> {         \
    template <typename T>                 \
    T operator()(T x) const {             \
      return expr;                        \
    }                                     \
  }
MIXTAPE_UNARY_EXPR(exp, exp_any(x));
MIXTAPE_UNARY_EXPR(log, std::log(x));
MIXTAPE_UNARY_EXPR(sqrt, std::sqrt(x));
MIXTAPE_UNARY_EXPR(rsqrt, T(1) / std::sqrt(x));
MIXTAPE_UNARY_EXPR(erf, erf_of(x));
#undef MIXTAPE_UNARY_EXPR
template <>
struct UnaryOp<OpId::tanh> {
  template <typename T>
  T operator()(T x) const {
    if constexpr (std::is_same_v<T, float>)
      return tanh_f32(x);
    else
      return std::tanh(x);
  }
};
// The activations (activation_math.h, shared with the fused linear op).
template <>
struct UnaryOp<OpId::sigmoid> {
  template <typename T>
  T operator()(T x) const {
    return sigmoid_of(x);
  }
};
template <>
struct UnaryOp<OpId::relu> {
  template <typename T>
  T operator()(T x) const {
    return relu_of(x);
  }
  // The same on float16 / bfloat16 bits (it only selects x or +0, so no float32 round trip
  // is needed): x < 0 exactly when the sign is set and the magnitude is in [1, inf].
  MIXTAPE_ALWAYS_INLINE static std::int16_t bits16(std::int16_t x, Bits16 k) {
    const auto m = static_cast<std::int16_t>(x & 0x7FFF);
    const bool negative = (x < 0) & (m > 0) & (m <= k.inf);
    return negative ? std::int16_t{0} : k.quieted(x);
  }
};
template <>
struct UnaryOp<OpId::gelu> {
  template <typename T>
  T operator()(T x) const {
    return gelu_of(x);
  }
};
template <>
struct UnaryOp<OpId::gelu_tanh> {
  template <typename T>
  T operator()(T x) const {
    return gelu_tanh_of(x);
  }
};

// The ops whose float loops call libmvec's SIMD functions: those loops carry
// `#pragma omp simd`, without which the compiler calls the scalar function per element.
template <typename Op>
constexpr bool kSimdCalls =
    std::is_same_v<Op, UnaryOp<OpId::gelu>> || std::is_same_v<Op, UnaryOp<OpId::erf>> ||
    std::is_same_v<Op, BinaryOp<OpId::gelu_backward>>;

// The gradient through relu: g where the relu's output y is positive, 0 elsewhere.
template <>
struct BinaryOp<OpId::relu_backward> {
  template <typename T>
  T operator()(T y, T g) const {
    return y > T(0) ? g : T(0);
  }
  // On float16 / bfloat16 bits: y > 0 exactly when y's bits, signed, are in [1, inf].
  MIXTAPE_ALWAYS_INLINE static std::int16_t bits16(std::int16_t y, std::int16_t g, Bits16 k) {
    return (y > 0) & (y <= k.inf) ? k.quieted(g) : std::int16_t{0};
  }
};

// The gradient through the exact gelu in one pass, rounded once to the output's type (the
// composition of a dozen ops it replaces rounded every step, in bfloat16 too).
template <>
struct BinaryOp<OpId::gelu_backward> {
  template <typename T>
  T operator()(T x, T g) const {
    return gelu_grad_of(x, g);
  }
};

// Whether an op has a bits16 form (above), which its float16 / bfloat16 kernels use instead
// of converting to float32 and back: those ops select an input or zero, so the result is
// the same bits, and the pass costs what a copy does.
template <typename Op>
constexpr bool kBits16 =
    std::is_same_v<Op, UnaryOp<OpId::relu>> || std::is_same_v<Op, BinaryOp<OpId::relu_backward>>;

// The bits16 loops, y = op(x) and o = op(x, y) over n patterns; also compiled for AVX2 and
// for AVX-512BW (measured: the baseline SSE2 loop ran relu at half float32's speed, its
// selects taking about 30 instructions per 8 lanes).
template <typename Op, typename T>
MIXTAPE_ALWAYS_INLINE void bits16_loop(const std::int16_t* x, std::int16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = Op::bits16(x[i], kBits16Of<T>);
}
template <typename Op, typename T>
MIXTAPE_ALWAYS_INLINE void bits16_loop(const std::int16_t* x, const std::int16_t* y,
                                       std::int16_t* o, int64_t n) {
  for (int64_t i = 0; i < n; ++i) o[i] = Op::bits16(x[i], y[i], kBits16Of<T>);
}
template <typename Op, typename T, typename... P>
void bits16_base(P... p) {
  bits16_loop<Op, T>(p...);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
template <typename Op, typename T, typename... P>
__attribute__((target("avx2"))) void bits16_avx2(P... p) {
  bits16_loop<Op, T>(p...);
}
template <typename Op, typename T, typename... P>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void bits16_avx512(P... p) {
  bits16_loop<Op, T>(p...);
}
#endif
// The best of the three for this CPU.
template <typename Op, typename T, typename... P>
auto bits16_fn() {
  void (*fn)(P...) = &bits16_base<Op, T, P...>;
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx512bw())
    fn = &bits16_avx512<Op, T, P...>;
  else if (__builtin_cpu_supports("avx2"))
    fn = &bits16_avx2<Op, T, P...>;
#endif
  return fn;
}

template <>
struct BinaryOp<OpId::add> {
  template <typename T>
  T operator()(T a, T b) const {
    return wrap_add(a, b);
  }
};
// sub and mul: integers wrap modulo 2^bits (through the unsigned type), as add's
// wrap_add does.
#define MIXTAPE_WRAPPING(op_name, sym)                                  \
  template <>                                                           \
  struct BinaryOp<OpId::op_name> {                                      \
    template <typename T>                                               \
    T operator()(T a, T b) const {                                      \
      if constexpr (std::is_integral_v<T>) {                            \
        using U = std::make_unsigned_t<T>;                              \
        return static_cast<T>(static_cast<U>(a) sym static_cast<U>(b)); \
      } else {                                                          \
        return a sym b;                                                 \
      }                                                                 \
    }                                                                   \
  }
MIXTAPE_WRAPPING(sub, -);
MIXTAPE_WRAPPING(mul, *);
#undef MIXTAPE_WRAPPING
// Integer division truncates; division by zero gives 0 rather than trapping.
template <>
struct BinaryOp<OpId::div> {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>) {
      if (b == 0) return 0;
      if (b == -1) return wrap_neg(a);  // INT_MIN / -1 would trap
      return a / b;
    } else {
      return a / b;
    }
  }
};
template <>
struct BinaryOp<OpId::maximum> {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>)
      return a > b ? a : b;
    else
      return ((a > b) | std::isnan(a)) ? a : b;  // NaN in either propagates
  }
};
template <>
struct BinaryOp<OpId::minimum> {
  template <typename T>
  T operator()(T a, T b) const {
    if constexpr (std::is_integral_v<T>)
      return a < b ? a : b;
    else
      return ((a < b) | std::isnan(a)) ? a : b;
  }
};
template <>
struct BinaryOp<OpId::pow> {
  template <typename T>
  T operator()(T a, T b) const {
    return std::pow(a, b);
  }
};

// The comparisons: bool results.
#define MIXTAPE_COMPARISON(op_name, sym) \
  template <>                            \
  struct BinaryOp<OpId::op_name> {       \
    template <typename T>                \
    bool operator()(T a, T b) const {    \
      return a sym b;                    \
    }                                    \
  }
MIXTAPE_COMPARISON(equal, ==);
MIXTAPE_COMPARISON(not_equal, !=);
MIXTAPE_COMPARISON(less, <);
MIXTAPE_COMPARISON(less_equal, <=);
MIXTAPE_COMPARISON(greater, >);
MIXTAPE_COMPARISON(greater_equal, >=);
#undef MIXTAPE_COMPARISON

// --- Unary -------------------------------------------------------------------------------

// out = op(in...) over float32 for the kSimdCalls ops (one input or two, contiguous): an omp
// simd loop, which calls libmvec's SSE variants (_ZGVbN4v_erfcf, four lanes) in the baseline
// build and its AVX2 ones (_ZGVdN8v_erfcf, eight lanes) in the AVX2 build, picked at run time.
template <typename Op, typename... In>
MIXTAPE_ALWAYS_INLINE void simd_call_loop_impl(float* out, int64_t n, const In*... in) {
  const Op op;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = op(in[i]...);
}
template <typename Op, typename... In>
void simd_call_loop(float* out, int64_t n, const In*... in) {
  simd_call_loop_impl<Op>(out, n, in...);
}
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
template <typename Op, typename... In>
__attribute__((target("avx2,fma"))) void simd_call_loop_avx2(float* out, int64_t n,
                                                             const In*... in) {
  simd_call_loop_impl<Op>(out, n, in...);
}
#endif
// The loop for inputs In... (float each) this CPU runs best.
template <typename Op, typename... In>
auto simd_call_loop_fn() {
  auto* fn = &simd_call_loop<Op, In...>;
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if (has_avx2_fma()) fn = &simd_call_loop_avx2<Op, In...>;
#endif
  return fn;
}

template <typename T, typename Op>
void unary_kernel(const Tensor& x, const Tensor& out) {
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const Op op;
  [[maybe_unused]] void (*simd_loop)(float*, int64_t, const float*) = nullptr;
  if constexpr (kSimdCalls<Op>) simd_loop = simd_call_loop_fn<Op, float>();
  parallel_blocks(x.numel(), [&](int64_t b, int64_t e) {
    const int64_t n = e - b;
    if constexpr (kReduced<T> && kBits16<Op>) {
      static const auto loop = bits16_fn<Op, T, const std::int16_t*, std::int16_t*, int64_t>();
      loop(reinterpret_cast<const std::int16_t*>(xp + b), reinterpret_cast<std::int16_t*>(yp + b),
           n);
    } else if constexpr (kReduced<T>) {
      float buf[kBlock];
      to_float(xp + b, buf, n);
      if constexpr (kSimdCalls<Op>) {
        simd_loop(buf, n, buf);
      } else {
        for (int64_t i = 0; i < n; ++i) buf[i] = op(buf[i]);
      }
      from_float(buf, yp + b, n);
    } else {
      const T* x0 = xp + b;
      T* y0 = yp + b;
      if constexpr (kSimdCalls<Op> && std::is_same_v<T, float>) {
        simd_loop(y0, n, x0);
      } else {
        for (int64_t i = 0; i < n; ++i) y0[i] = op(x0[i]);
      }
    }
  });
}

// --- Binary ------------------------------------------------------------------------------

// One chunk of a strided operand as a contiguous pointer (gathered into buf if needed).
template <typename T>
const T* gather(const T* p, int64_t stride, int64_t n, T* buf) {
  if (stride == 1) return p;
  if (stride == 0)
    std::fill_n(buf, n, *p);
  else
    for (int64_t i = 0; i < n; ++i) buf[i] = p[i * stride];
  return buf;
}

// out[i] = op(a[i * sa], b[i * sb]) with sa, sb in {0, 1}: one loop per case so that each
// vectorises.
template <typename Op, typename C, typename O>
void binary_loop(const Op& op, const C* a, int64_t sa, const C* b, int64_t sb, O* out, int64_t n) {
  if (sa != 0 && sb != 0) {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<O>(op(a[i], b[i]));
  } else if (sa != 0) {
    const C vb = *b;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<O>(op(a[i], vb));
  } else if (sb != 0) {
    const C va = *a;
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<O>(op(va, b[i]));
  } else {
    std::fill_n(out, n, static_cast<O>(op(*a, *b)));
  }
}

// One operand's chunk as compute-type values with stride 0 or 1: a pointer into the
// tensor when possible, otherwise gathered (and for 16-bit floats converted) into `buf`.
template <typename T>
const compute_t<T>* load(const T* p, int64_t stride, int64_t n, compute_t<T>* buf, int64_t& s) {
  if constexpr (kReduced<T>) {
    if (stride == 0) {
      to_float(p, buf, 1);
      s = 0;
    } else if (stride == 1) {
      to_float(p, buf, n);
      s = 1;
    } else {
      T raw[kBlock];
      for (int64_t i = 0; i < n; ++i) raw[i] = p[i * stride];
      to_float(raw, buf, n);
      s = 1;
    }
    return buf;
  } else {
    if (stride == 0 || stride == 1) {
      s = stride;
      return p;
    }
    for (int64_t i = 0; i < n; ++i) buf[i] = p[i * stride];
    s = 1;
    return buf;
  }
}

// T: the inputs' storage type; O: the output's (T, or uint8 for bool comparisons).
template <typename T, typename O, typename Op>
void binary_kernel(const Tensor& a, const Tensor& b, const Tensor& out) {
  using C = compute_t<T>;
  const T* ap = static_cast<const T*>(a.const_data_ptr());
  const T* bp = static_cast<const T*>(b.const_data_ptr());
  O* op_ = static_cast<O*>(out.data_ptr());
  const Op op;
  const auto l = coalesce<3>(out.shape(), {&out.strides(), &a.strides(), &b.strides()});
  if constexpr (kReduced<T> && kBits16<Op>) {
    using U = std::int16_t;
    static const auto loop = bits16_fn<Op, T, const U*, const U*, U*, int64_t>();
    for_each_chunk(
        l, [&](const std::array<int64_t, 3>& off, const std::array<int64_t, 3>& is, int64_t n) {
          U abuf[kBlock], bbuf[kBlock];
          const U* x = gather(reinterpret_cast<const U*>(ap + off[1]), is[1], n, abuf);
          const U* y = gather(reinterpret_cast<const U*>(bp + off[2]), is[2], n, bbuf);
          loop(x, y, reinterpret_cast<U*>(op_ + off[0]), n);
        });
    return;
  }
  // The ops that call libmvec go through an omp simd loop where both operands are float32
  // and contiguous (the common case: a gradient and the op's input).
  [[maybe_unused]] void (*simd_loop)(float*, int64_t, const float*, const float*) = nullptr;
  if constexpr (kSimdCalls<Op> && std::is_same_v<C, float>)
    simd_loop = simd_call_loop_fn<Op, float, float>();
  const auto run = [&](const C* x, int64_t sa, const C* y, int64_t sb, auto* o, int64_t n) {
    if constexpr (kSimdCalls<Op> && std::is_same_v<C, float> &&
                  std::is_same_v<std::remove_pointer_t<decltype(o)>, float>) {
      if (sa == 1 && sb == 1) return simd_loop(o, n, x, y);
    }
    binary_loop(op, x, sa, y, sb, o, n);
  };
  for_each_chunk(
      l, [&](const std::array<int64_t, 3>& off, const std::array<int64_t, 3>& is, int64_t n) {
        C abuf[kBlock], bbuf[kBlock];
        int64_t sa = 0, sb = 0;
        const C* x = load(ap + off[1], is[1], n, abuf, sa);
        const C* y = load(bp + off[2], is[2], n, bbuf, sb);
        if constexpr (kReduced<O>) {
          float obuf[kBlock];
          run(x, sa, y, sb, obuf, n);
          from_float(obuf, op_ + off[0], n);
        } else {
          run(x, sa, y, sb, op_ + off[0], n);
        }
      });
}

// --- where -------------------------------------------------------------------------------

// T: an unsigned integer of the item size (where moves bits, no arithmetic).
template <typename T>
void where_kernel(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const auto* cp = static_cast<const std::uint8_t*>(cond.const_data_ptr());
  const T* ap = static_cast<const T*>(a.const_data_ptr());
  const T* bp = static_cast<const T*>(b.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const auto l =
      coalesce<4>(out.shape(), {&out.strides(), &cond.strides(), &a.strides(), &b.strides()});
  for_each_chunk(
      l, [&](const std::array<int64_t, 4>& off, const std::array<int64_t, 4>& is, int64_t n) {
        std::uint8_t cbuf[kBlock];
        T abuf[kBlock], bbuf[kBlock];
        const std::uint8_t* c = gather(cp + off[1], is[1], n, cbuf);
        const T* x = gather(ap + off[2], is[2], n, abuf);
        const T* y = gather(bp + off[3], is[3], n, bbuf);
        T* o = yp + off[0];
        for (int64_t i = 0; i < n; ++i) o[i] = c[i] ? x[i] : y[i];
      });
}

// --- Registration ------------------------------------------------------------------------

// The output's storage type of binary op `op` on inputs of type T: T, or a byte for the
// comparisons (bool).
template <OpId op, typename T>
using binary_out_t = std::conditional_t<
    std::is_same_v<decltype(BinaryOp<op>{}(compute_t<T>{}, compute_t<T>{})), bool>, std::uint8_t,
    T>;

}  // namespace

void register_elementwise_kernels() {
  for_each_op([]<OpId op>() {
    if constexpr (op_info(op).kernel == "UnaryFn") {
      register_op<op>(DeviceType::CPU,
                      []<DType::Code C>() { return &unary_kernel<element_t<C>, UnaryOp<op>>; });
    } else if constexpr (op_info(op).kernel == "BinaryFn") {
      register_op<op>(DeviceType::CPU, []<DType::Code C>() {
        using T = element_t<C>;
        return &binary_kernel<T, binary_out_t<op, T>, BinaryOp<op>>;
      });
    }
  });
  // where moves bits: one kernel per item size.
  register_op<OpId::where>(
      DeviceType::CPU, []<DType::Code C>() { return &where_kernel<bits_t<sizeof(element_t<C>)>>; });
}

}  // namespace mixtape::cpu
