// CUDA elementwise kernels: unary math, binary arithmetic, comparisons and where, for the
// dtypes the CPU backend registers (backends/cpu/elementwise.cpp) and with its semantics:
//  - float16/bfloat16 are loaded as float32, computed in float32 and rounded to nearest
//    even once when stored;
//  - integer add/sub/mul/neg/abs wrap modulo 2^bits (through the unsigned type); integer
//    division truncates, x / 0 is 0 and INT_MIN / -1 wraps to INT_MIN;
//  - float maximum/minimum propagate NaN (a NaN in either operand gives NaN);
//  - relu keeps NaN and -0; relu_backward is (y > 0 ? g : 0);
//  - comparisons write bool bytes (0 / 1); bool operands compare as their bytes.
// Math is the CUDA library's accurate functions (no fast-math intrinsics): results agree
// with the CPU within a few ulp, not bit for bit (exp, tanh, erf, pow, ...).
//
// Launches: contiguous operands take a grid-stride loop over 16-byte vectors (when every
// pointer is 16-byte aligned; a scalar tail follows) or over scalars; broadcast / strided
// operands take the strided geometry of elementwise_util.cuh (stride 0 on broadcast axes).
#include "backends/cuda/activation_math.cuh"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// -x modulo 2^bits.
template <typename T>
__device__ __forceinline__ T wrap_neg(T x) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(U(0) - static_cast<U>(x));
}

// --- Op functors (on the compute type C: float for 16-bit floats) --------------------------

// The functor of each unary and binary elementwise op of the op table: every op whose
// kernel is a UnaryFn / BinaryFn needs one (registration does not compile without it).
// Binary functors that return bool are comparisons: their kernels write bool bytes.
template <OpId op>
struct UnaryOp;
template <OpId op>
struct BinaryOp;

template <>
struct UnaryOp<OpId::neg> {
  template <typename C>
  __device__ C operator()(C x) const {
    if constexpr (std::is_integral_v<C>)
      return wrap_neg(x);
    else
      return -x;
  }
};
template <>
struct UnaryOp<OpId::abs> {
  template <typename C>
  __device__ C operator()(C x) const {
    if constexpr (std::is_integral_v<C>)
      return x < 0 ? wrap_neg(x) : x;
    else
      return d_fabs(x);
  }
};
// The unary ops whose functor is one expression of x.
#define MIXTAPE_UNARY_EXPR(op_name, expr) \
  template <>                             \
  struct UnaryOp<OpId::op_name> {         \
    template <typename C>                 \
    __device__ C operator()(C x) const {  \
      return expr;                        \
    }                                     \
  }
MIXTAPE_UNARY_EXPR(exp, d_exp(x));
MIXTAPE_UNARY_EXPR(log, d_log(x));
MIXTAPE_UNARY_EXPR(sqrt, d_sqrt(x));
MIXTAPE_UNARY_EXPR(rsqrt, C(1) / d_sqrt(x));
MIXTAPE_UNARY_EXPR(tanh, d_tanh(x));
MIXTAPE_UNARY_EXPR(erf, d_erf(x));
// The activations (activation_math.cuh, shared with the fused linear op).
MIXTAPE_UNARY_EXPR(relu, relu_of(x));
MIXTAPE_UNARY_EXPR(gelu, gelu_of(x));
MIXTAPE_UNARY_EXPR(sigmoid, sigmoid_of(x));
MIXTAPE_UNARY_EXPR(gelu_tanh, gelu_tanh_of(x));
#undef MIXTAPE_UNARY_EXPR

// add, sub and mul: integers wrap modulo 2^bits (through the unsigned type).
#define MIXTAPE_WRAPPING(op_name, sym)                                  \
  template <>                                                           \
  struct BinaryOp<OpId::op_name> {                                      \
    template <typename C>                                               \
    __device__ C operator()(C a, C b) const {                           \
      if constexpr (std::is_integral_v<C>) {                            \
        using U = std::make_unsigned_t<C>;                              \
        return static_cast<C>(static_cast<U>(a) sym static_cast<U>(b)); \
      } else {                                                          \
        return a sym b;                                                 \
      }                                                                 \
    }                                                                   \
  }
MIXTAPE_WRAPPING(add, +);
MIXTAPE_WRAPPING(sub, -);
MIXTAPE_WRAPPING(mul, *);
#undef MIXTAPE_WRAPPING
// Integer division truncates; x / 0 is 0; INT_MIN / -1 wraps.
template <>
struct BinaryOp<OpId::div> {
  template <typename C>
  __device__ C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>) {
      if (b == 0) return C(0);
      if (b == C(-1)) return wrap_neg(a);
      return a / b;
    } else {
      return a / b;
    }
  }
};
// NaN in either operand propagates (a NaN a is kept; a NaN b wins the comparison's else).
template <>
struct BinaryOp<OpId::maximum> {
  template <typename C>
  __device__ C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>)
      return a > b ? a : b;
    else
      return (a > b || a != a) ? a : b;
  }
};
template <>
struct BinaryOp<OpId::minimum> {
  template <typename C>
  __device__ C operator()(C a, C b) const {
    if constexpr (std::is_integral_v<C>)
      return a < b ? a : b;
    else
      return (a < b || a != a) ? a : b;
  }
};
template <>
struct BinaryOp<OpId::pow> {
  template <typename C>
  __device__ C operator()(C a, C b) const {
    return d_pow(a, b);
  }
};
// relu_backward: g where relu's output y is positive, 0 elsewhere.
template <>
struct BinaryOp<OpId::relu_backward> {
  template <typename C>
  __device__ C operator()(C y, C g) const {
    return y > C(0) ? g : C(0);
  }
};
// gelu_backward: g (Phi(x) + x phi(x)) in the compute type, rounded once.
template <>
struct BinaryOp<OpId::gelu_backward> {
  template <typename C>
  __device__ C operator()(C x, C g) const {
    return gelu_grad_of(x, g);
  }
};

// The comparisons: bool results, written as bool bytes.
#define MIXTAPE_COMPARISON(op_name, sym)         \
  template <>                                    \
  struct BinaryOp<OpId::op_name> {               \
    template <typename C>                        \
    __device__ bool operator()(C a, C b) const { \
      return a sym b;                            \
    }                                            \
  }
MIXTAPE_COMPARISON(equal, ==);
MIXTAPE_COMPARISON(not_equal, !=);
MIXTAPE_COMPARISON(less, <);
MIXTAPE_COMPARISON(less_equal, <=);
MIXTAPE_COMPARISON(greater, >);
MIXTAPE_COMPARISON(greater_equal, >=);
#undef MIXTAPE_COMPARISON

// --- Unary ---------------------------------------------------------------------------------

// y = op(x) over n contiguous elements; with `vec`, x and y are 16-byte aligned and are
// walked as 16-byte packs, then a scalar tail.
template <typename T, typename Op>
__global__ void unary_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, bool vec,
                             Op op) {
  if (vec) {
    constexpr int N = kVec<T>;
    using P = Pack<T, N>;
    const int64_t nv = n / N;
    const P* xv = reinterpret_cast<const P*>(x);
    P* yv = reinterpret_cast<P*>(y);
    MIXTAPE_GRID_LOOP(i, nv) {
      const P a = xv[i];
      P r;
#pragma unroll
      for (int k = 0; k < N; ++k) r.v[k] = store<T>(op(load(a.v[k])));
      yv[i] = r;
    }
    const int64_t t0 = nv * N;
    MIXTAPE_GRID_LOOP(j, n - t0) y[t0 + j] = store<T>(op(load(x[t0 + j])));
  } else {
    MIXTAPE_GRID_LOOP(i, n) y[i] = store<T>(op(load(x[i])));
  }
}

template <typename T, typename Op>
void unary_host(const Tensor& x, const Tensor& out) {
  const int64_t n = x.numel();
  if (n == 0) return;
  OnDevice on(out);
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  const bool vec = aligned16(xp) && aligned16(yp);
  const int64_t work = vec ? n / kVec<T> + kVec<T> : n;
  launch_1d({"unary kernel", work, on.s}, unary_kernel<T, Op>, xp, yp, n, vec, Op{});
}

// --- Binary --------------------------------------------------------------------------------

// out = op(a, b) over n contiguous elements (T the inputs' storage type, O the output's: T,
// or the bool byte); with `vec`, all three pointers are 16-byte aligned.
template <typename T, typename O, typename Op>
__global__ void binary_contig_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                     O* __restrict__ out, int64_t n, bool vec, Op op) {
  if (vec) {
    constexpr int N = kVec<T>;
    using P = Pack<T, N>;
    using PO = Pack<O, N>;
    const int64_t nv = n / N;
    const P* av = reinterpret_cast<const P*>(a);
    const P* bv = reinterpret_cast<const P*>(b);
    PO* ov = reinterpret_cast<PO*>(out);
    MIXTAPE_GRID_LOOP(i, nv) {
      const P x = av[i];
      const P y = bv[i];
      PO r;
#pragma unroll
      for (int k = 0; k < N; ++k) r.v[k] = store<O>(op(load(x.v[k]), load(y.v[k])));
      ov[i] = r;
    }
    const int64_t t0 = nv * N;
    MIXTAPE_GRID_LOOP(j, n - t0) out[t0 + j] = store<O>(op(load(a[t0 + j]), load(b[t0 + j])));
  } else {
    MIXTAPE_GRID_LOOP(i, n) out[i] = store<O>(op(load(a[i]), load(b[i])));
  }
}

// out[i] = op(a[off_a(i)], b[off_b(i)]) over n output elements of a strided geometry.
template <typename T, typename O, typename Op, typename I>
__global__ void binary_strided_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                      O* __restrict__ out, StridedGeom<2> g, int64_t n, Op op) {
  MIXTAPE_GRID_LOOP(i, n) {
    int64_t off[2];
    strided_offsets<I>(g, i, off);
    out[i] = store<O>(op(load(a[off[0]]), load(b[off[1]])));
  }
}

// out[r, c] = op(full[r, c], row[c]) (op(row[c], full[r, c]) with kRowFirst) over a
// contiguous R x C output: a Dense layer's bias add and the like. C is a multiple of the
// vector width and every pointer 16-byte aligned; i indexes vectors, cv = C / width. (The
// strided kernel does this at a quarter of the memory bandwidth: one 2- or 4-byte access
// per thread and an index division per element.)
template <typename T, typename O, typename Op, bool kRowFirst>
__global__ void binary_row_kernel(const T* __restrict__ full, const T* __restrict__ row,
                                  O* __restrict__ out, int64_t nv, int64_t cv, Op op) {
  constexpr int N = kVec<T>;
  using P = Pack<T, N>;
  using PO = Pack<O, N>;
  MIXTAPE_GRID_LOOP(i, nv) {
    const P x = reinterpret_cast<const P*>(full)[i];
    const P y = reinterpret_cast<const P*>(row)[i % cv];
    PO r;
#pragma unroll
    for (int k = 0; k < N; ++k)
      r.v[k] =
          store<O>(kRowFirst ? op(load(y.v[k]), load(x.v[k])) : op(load(x.v[k]), load(y.v[k])));
    reinterpret_cast<PO*>(out)[i] = r;
  }
}

template <typename T, typename O, typename Op>
void binary_host(const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  OnDevice on(out);
  const T* ap = static_cast<const T*>(a.const_data_ptr());
  const T* bp = static_cast<const T*>(b.const_data_ptr());
  O* op = static_cast<O*>(out.data_ptr());
  const Coalesced<2> l = coalesce<2>(out.shape(), {&a.strides(), &b.strides()});
  if (l.contiguous()) {
    const bool vec = aligned16(ap) && aligned16(bp) && aligned16(op);
    const int64_t work = vec ? n / kVec<T> + kVec<T> : n;
    launch_1d({"binary kernel", work, on.s}, binary_contig_kernel<T, O, Op>, ap, bp, op, n, vec,
              Op{});
    return;
  }
  if (l.shape.size() == 2 && l.shape[1] % kVec<T> == 0 && aligned16(ap) && aligned16(bp) &&
      aligned16(op)) {
    const int64_t c = l.shape[1];
    const auto& d0 = l.strides[0];  // the strides of a and b along the rows
    const auto& d1 = l.strides[1];  // and along the columns
    const bool a_full = d0[0] == c && d1[0] == 1, b_full = d0[1] == c && d1[1] == 1;
    const bool a_row = d0[0] == 0 && d1[0] == 1, b_row = d0[1] == 0 && d1[1] == 1;
    const int64_t nv = n / kVec<T>, cv = c / kVec<T>;
    if (a_full && b_row) {
      launch_1d({"binary kernel (row broadcast)", nv, on.s}, binary_row_kernel<T, O, Op, false>, ap,
                bp, op, nv, cv, Op{});
      return;
    }
    if (a_row && b_full) {
      launch_1d({"binary kernel (row broadcast)", nv, on.s}, binary_row_kernel<T, O, Op, true>, bp,
                ap, op, nv, cv, Op{});
      return;
    }
  }
  for_each_slice(l, [&](const StridedGeom<2>& g, const std::array<int64_t, 2>& off, int64_t out_off,
                        int64_t count) {
    launch_strided({"binary kernel (strided)", count, on.s},
                   binary_strided_kernel<T, O, Op, std::uint32_t>,
                   binary_strided_kernel<T, O, Op, std::uint64_t>, ap + off[0], bp + off[1],
                   op + out_off, g, count, Op{});
  });
}

// --- where ---------------------------------------------------------------------------------

// out[i] = cond ? a : b; T an unsigned integer of the item size (where only moves bits).
template <typename T, typename I>
__global__ void where_kernel(const std::uint8_t* __restrict__ c, const T* __restrict__ a,
                             const T* __restrict__ b, T* __restrict__ out, StridedGeom<3> g,
                             int64_t n) {
  MIXTAPE_GRID_LOOP(i, n) {
    int64_t off[3];
    strided_offsets<I>(g, i, off);
    out[i] = c[off[0]] != 0 ? a[off[1]] : b[off[2]];
  }
}

template <typename T>
void where_host(const Tensor& cond, const Tensor& a, const Tensor& b, const Tensor& out) {
  const int64_t n = out.numel();
  if (n == 0) return;
  OnDevice on(out);
  const auto* cp = static_cast<const std::uint8_t*>(cond.const_data_ptr());
  const T* ap = static_cast<const T*>(a.const_data_ptr());
  const T* bp = static_cast<const T*>(b.const_data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  const Coalesced<3> l = coalesce<3>(out.shape(), {&cond.strides(), &a.strides(), &b.strides()});
  for_each_slice(l, [&](const StridedGeom<3>& g, const std::array<int64_t, 3>& off, int64_t out_off,
                        int64_t count) {
    launch_strided({"where kernel", count, on.s}, where_kernel<T, std::uint32_t>,
                   where_kernel<T, std::uint64_t>, cp + off[0], ap + off[1], bp + off[2],
                   op + out_off, g, count);
  });
}

// --- Registration --------------------------------------------------------------------------

// The output's storage type of binary op `op` on inputs of storage type T: T, or the bool
// byte for the comparisons.
template <OpId op, typename T>
using binary_out_t = std::conditional_t<
    std::is_same_v<decltype(BinaryOp<op>{}(compute_of<T>{}, compute_of<T>{})), bool>, std::uint8_t,
    T>;

}  // namespace

void register_elementwise_kernels() {
  for_each_op([]<OpId op>() {
    if constexpr (op_info(op).kernel == "UnaryFn") {
      register_op<op>(DeviceType::CUDA,
                      []<DType::Code C>() { return &unary_host<dev_t<C>, UnaryOp<op>>; });
    } else if constexpr (op_info(op).kernel == "BinaryFn") {
      register_op<op>(DeviceType::CUDA, []<DType::Code C>() {
        using T = dev_t<C>;
        return &binary_host<T, binary_out_t<op, T>, BinaryOp<op>>;
      });
    }
  });
  // where moves bits: one kernel per item size.
  register_op<OpId::where>(DeviceType::CUDA,
                           []<DType::Code C>() { return &where_host<ubits_t<sizeof(dev_t<C>)>>; });
}

}  // namespace mixtape::cuda_backend
