// CUDA reduction kernels (sum, mean, max, min, argmax over the middle extent of
// [outer, n, inner]) and row kernels (softmax, log_softmax over the last axis), for the
// dtypes the CPU backend registers (backends/cpu/reduction.cpp).
//
// Accumulation: float32 for float32, float16 and bfloat16 (the kernel contract's minimum;
// the CPU uses float64, so sums agree within float32 rounding of a tree of partial sums),
// float64 for float64, and 64-bit wrapping integers for int32 / int64 sums (exact, any
// order). The result is rounded to the dtype once, at the end (mean divides in float64).
//
// NaN: max and min propagate NaN; argmax returns the index of the first NaN when there is
// one, otherwise the first index of the maximum (partial results from threads that walk
// interleaved indices are merged by value, ties broken by the smaller index, so the result
// does not depend on the order of merging). All as the CPU backend.
//
// Work split: with inner == 1, a group of G threads (a warp for short rows, the whole
// 256-thread block otherwise) reduces each row; with inner > 1, a block reduces 32
// adjacent columns (coalesced loads along inner) with 8 threads along n. When that gives
// too few groups / blocks to fill the GPU, n is also split: the first pass writes partial
// accumulators [outer, splits, inner] to a workspace and a second kernel merges them in
// order. Partials inside a block are combined through shared memory (a halving tree).
#include <cmath>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"

namespace mixtape::cuda_backend {
namespace {

using std::int64_t;

// Units of work (groups, blocks) below which n is split as well.
constexpr int64_t kTargetUnits = 512;
// The longest rows (inner == 1) reduced by one warp rather than a whole block.
constexpr int64_t kWarpRow = 1024;

template <typename C>
__device__ __forceinline__ bool is_nan(C v) {
  if constexpr (std::is_floating_point_v<C>)
    return v != v;
  else
    return false;
}

template <typename C>
__device__ __forceinline__ C lowest() {
  if constexpr (std::is_floating_point_v<C>)
    return -static_cast<C>(INFINITY);
  else
    return IntRange<C>::kMin;
}

template <typename C>
__device__ __forceinline__ C highest() {
  if constexpr (std::is_floating_point_v<C>)
    return static_cast<C>(INFINITY);
  else
    return IntRange<C>::kMax;
}

// --- Reducers on the compute type C: A (the accumulator), init, add (element at index j),
// merge (any two partials), result (what is stored, converted to the output type).

template <typename C>
struct SumR {
  using A = std::conditional_t<std::is_integral_v<C>, unsigned long long, C>;
  __device__ static A init() { return A(0); }
  __device__ static void add(A& a, C v, int64_t) { a += static_cast<A>(v); }
  __device__ static void merge(A& a, const A& b) { a += b; }
  __device__ static A result(const A& a, int64_t) { return a; }
};

template <typename C>
struct MeanR : SumR<C> {
  using A = typename SumR<C>::A;
  __device__ static double result(const A& a, int64_t n) {
    return static_cast<double>(a) / static_cast<double>(n);
  }
};

template <typename C>
struct MaxR {
  using A = C;
  __device__ static A init() { return lowest<C>(); }
  __device__ static void add(A& a, C v, int64_t) { a = (v > a || is_nan(v)) ? v : a; }
  __device__ static void merge(A& a, const A& b) { add(a, b, 0); }
  __device__ static A result(const A& a, int64_t) { return a; }
};

template <typename C>
struct MinR {
  using A = C;
  __device__ static A init() { return highest<C>(); }
  __device__ static void add(A& a, C v, int64_t) { a = (v < a || is_nan(v)) ? v : a; }
  __device__ static void merge(A& a, const A& b) { add(a, b, 0); }
  __device__ static A result(const A& a, int64_t) { return a; }
};

// (value, index) of the first maximum, or of the first NaN when there is one; i = -1 while
// empty.
template <typename C>
struct ArgmaxAcc {
  C v;
  long long i;
};

template <typename C>
struct ArgmaxR {
  using A = ArgmaxAcc<C>;
  __device__ static A init() { return A{C(0), -1}; }
  // Whether b replaces a: b is a NaN and a not, or b is larger, or they tie (equal, or both
  // NaN) and b comes first.
  __device__ static void merge(A& a, const A& b) {
    if (b.i < 0) return;
    if (a.i < 0) {
      a = b;
      return;
    }
    const bool an = is_nan(a.v), bn = is_nan(b.v);
    bool take;
    if (an || bn)
      take = bn && (!an || b.i < a.i);
    else
      take = b.v > a.v || (b.v == a.v && b.i < a.i);
    if (take) a = b;
  }
  __device__ static void add(A& a, C v, int64_t j) { merge(a, A{v, static_cast<long long>(j)}); }
  __device__ static std::int64_t result(const A& a, int64_t) { return a.i; }
};

// --- Pass 1: partials (or results) --------------------------------------------------------

// f(u, lane) for the units u of this thread's group of G threads (G divides kThreads): the
// block's kThreads / G groups take consecutive units, the blocks striding over [0, units).
// The loop bound depends on the block only, so every thread reaches each barrier in f (u may
// be >= units: such a thread still joins its group's reductions).
template <int G, typename F>
__device__ __forceinline__ void for_each_group_unit(int64_t units, F f) {
  constexpr int kGroups = kThreads / G;
  const int lane = static_cast<int>(threadIdx.x) % G;
  const int grp = static_cast<int>(threadIdx.x) / G;
  for (int64_t u0 = static_cast<int64_t>(blockIdx.x) * kGroups; u0 < units;
       u0 += static_cast<int64_t>(gridDim.x) * kGroups)
    f(u0 + grp, lane);
}

// inner == 1: unit u = (row, split) is reduced by a group of G threads (G divides kThreads).
// Writes partial[u] when partial is non-null, else out[u] (then splits == 1 and u == row).
template <typename T, typename R, typename O, int G>
__global__ void reduce_rows_kernel(const T* __restrict__ x, int64_t rows, int64_t n, int64_t splits,
                                   int64_t per_split, typename R::A* partial, O* __restrict__ out) {
  using A = typename R::A;
  __shared__ A buf[kThreads];
  shared_starts_undefined(buf);
  const int64_t units = rows * splits;
  for_each_group_unit<G>(units, [&](int64_t u, int lane) {
    A a = R::init();
    if (u < units) {
      const int64_t row = u / splits, s = u % splits;
      const int64_t j0 = s * per_split;
      const int64_t j1 = j0 + per_split < n ? j0 + per_split : n;
      const T* p = x + row * n;
      for (int64_t j = j0 + lane; j < j1; j += G) R::add(a, load(p[j]), j);
    }
    buf[threadIdx.x] = a;
    __syncthreads();
    for (int st = G / 2; st > 0; st >>= 1) {
      if (lane < st) R::merge(buf[threadIdx.x], buf[threadIdx.x + st]);
      __syncthreads();
    }
    if (lane == 0 && u < units) {
      if (partial != nullptr)
        partial[u] = buf[threadIdx.x];
      else
        out[u] = store<O>(R::result(buf[threadIdx.x], n));
    }
    __syncthreads();  // buf is reused by the next unit
  });
}

constexpr int kColTile = 32;                   // columns per block (one per lane)
constexpr int kColRows = kThreads / kColTile;  // threads along n per column

// inner > 1: unit u = (o, tile of 32 columns, split) is reduced by one block: lane tx takes
// column tile * 32 + tx, and the kColRows threads of a column interleave along n. Writes
// partial[(o * splits + s) * inner + i] when partial is non-null, else out[o * inner + i].
template <typename T, typename R, typename O>
__global__ void reduce_cols_kernel(const T* __restrict__ x, int64_t outer, int64_t n, int64_t inner,
                                   int64_t splits, int64_t per_split, typename R::A* partial,
                                   O* __restrict__ out) {
  using A = typename R::A;
  __shared__ A buf[kThreads];
  shared_starts_undefined(buf);
  const int tx = static_cast<int>(threadIdx.x) % kColTile;
  const int ty = static_cast<int>(threadIdx.x) / kColTile;
  const int64_t tiles = (inner + kColTile - 1) / kColTile;
  const int64_t units = outer * tiles * splits;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    const int64_t s = u % splits, t = u / splits;
    const int64_t o = t / tiles, i = (t % tiles) * kColTile + tx;
    const int64_t j0 = s * per_split;
    const int64_t j1 = j0 + per_split < n ? j0 + per_split : n;
    A a = R::init();
    if (i < inner) {
      const T* p = x + o * n * inner + i;
      for (int64_t j = j0 + ty; j < j1; j += kColRows) R::add(a, load(p[j * inner]), j);
    }
    buf[threadIdx.x] = a;
    __syncthreads();
    for (int st = kColRows / 2; st > 0; st >>= 1) {
      if (ty < st) R::merge(buf[threadIdx.x], buf[threadIdx.x + st * kColTile]);
      __syncthreads();
    }
    if (ty == 0 && i < inner) {
      if (partial != nullptr)
        partial[(o * splits + s) * inner + i] = buf[tx];
      else
        out[o * inner + i] = store<O>(R::result(buf[tx], n));
    }
    __syncthreads();
  }
}

// --- Pass 2: merge the splits in order ------------------------------------------------------

template <typename R, typename O>
__global__ void reduce_merge_kernel(const typename R::A* __restrict__ partial, int64_t outer,
                                    int64_t splits, int64_t inner, int64_t n, O* __restrict__ out) {
  using A = typename R::A;
  MIXTAPE_GRID_LOOP(q, outer * inner) {
    const int64_t o = q / inner, i = q % inner;
    const A* p = partial + o * splits * inner + i;
    A a = p[0];
    for (int64_t s = 1; s < splits; ++s) R::merge(a, p[s * inner]);
    out[q] = store<O>(R::result(a, n));
  }
}

// Splits of n for `units` units of work, each split at least `min_len` long.
int64_t choose_splits(int64_t units, int64_t n, int64_t min_len) {
  if (units >= kTargetUnits) return 1;
  const int64_t want = (kTargetUnits + units - 1) / units;
  const int64_t most = (n + min_len - 1) / min_len;
  const int64_t s = want < most ? want : most;
  return s < 1 ? 1 : s;
}

// T: x's device storage type; RT: the reducer (on the compute type); O: out's storage type.
template <typename T, template <typename> class RT, typename O = T>
void reduce_host(const Tensor& x, int64_t outer, int64_t n, int64_t inner, const Tensor& out) {
  using R = RT<compute_of<T>>;
  using A = typename R::A;
  if (outer * inner == 0 || n <= 0) return;
  OnDevice on(out);
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  O* yp = static_cast<O*>(out.data_ptr());

  // inner == 1: a warp per row up to kWarpRow elements (at most 32 per thread), else a block
  // per row; n is split only in pieces of at least 4096 (16 per thread of a block).
  int64_t splits = 1;
  if (inner == 1) {
    splits = choose_splits(outer, n, 4096);
  } else {
    const int64_t tiles = (inner + kColTile - 1) / kColTile;
    splits = choose_splits(outer * tiles, n, 256);
  }
  int64_t per_split = (n + splits - 1) / splits;
  splits = (n + per_split - 1) / per_split;

  std::unique_ptr<Workspace> ws;
  A* partial = nullptr;
  if (splits > 1) {
    ws = std::make_unique<Workspace>(static_cast<std::size_t>(outer * splits * inner) * sizeof(A),
                                     on.index);
    partial = static_cast<A*>(ws->data());
  }

  if (inner == 1) {
    const int64_t units = outer * splits;
    if (n <= kWarpRow) {
      launch_1d({"reduction kernel", units * 32, on.s}, reduce_rows_kernel<T, R, O, 32>, xp, outer,
                n, splits, per_split, partial, yp);
    } else {
      launch_1d({"reduction kernel", units * kThreads, on.s}, reduce_rows_kernel<T, R, O, kThreads>,
                xp, outer, n, splits, per_split, partial, yp);
    }
  } else {
    const int64_t units = outer * ((inner + kColTile - 1) / kColTile) * splits;
    launch_1d({"reduction kernel", units * kThreads, on.s}, reduce_cols_kernel<T, R, O>, xp, outer,
              n, inner, splits, per_split, partial, yp);
  }
  if (splits > 1) {
    launch_1d({"reduction merge kernel", outer * inner, on.s}, reduce_merge_kernel<R, O>, partial,
              outer, splits, inner, n, yp);
  }
  // The workspace goes back to the cache here; the cache hands blocks out in stream order,
  // so the kernels above finish reading it before a later user writes it.
}

// --- softmax / log_softmax ----------------------------------------------------------------

// Reduces v over the G threads of each group (lane = threadIdx.x % G) and returns the result
// to all of them. Every thread of the block must call it.
template <int G, typename C, typename Op>
__device__ __forceinline__ C group_reduce(C v, C* buf, Op op) {
  const int lane = static_cast<int>(threadIdx.x) % G;
  buf[threadIdx.x] = v;
  __syncthreads();
  for (int st = G / 2; st > 0; st >>= 1) {
    if (lane < st) buf[threadIdx.x] = op(buf[threadIdx.x], buf[threadIdx.x + st]);
    __syncthreads();
  }
  const C r = buf[threadIdx.x - lane];
  __syncthreads();
  return r;
}

struct MaxNan {
  template <typename C>
  __device__ C operator()(C a, C v) const {
    return (v > a || v != v) ? v : a;
  }
};
struct Plus {
  template <typename C>
  __device__ C operator()(C a, C b) const {
    return a + b;
  }
};

// One group of G threads per row: m = max (NaN propagates), s = sum exp(x - m), then
// y = exp(x - m) * (1 / s), or (x - m) - log(s). A row holding NaN, or only -inf, gives NaN.
template <typename T, bool kLog, int G>
__global__ void softmax_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows,
                               int64_t cols) {
  using C = compute_of<T>;
  __shared__ C buf[kThreads];
  shared_starts_undefined(buf);
  for_each_group_unit<G>(rows, [&](int64_t r, int lane) {
    const bool active = r < rows;
    const T* xr = x + (active ? r : 0) * cols;
    T* yr = y + (active ? r : 0) * cols;
    C m = -static_cast<C>(INFINITY);
    if (active)
      for (int64_t j = lane; j < cols; j += G) m = MaxNan{}(m, load(xr[j]));
    m = group_reduce<G>(m, buf, MaxNan{});
    C s = C(0);
    if (active)
      for (int64_t j = lane; j < cols; j += G) s += d_exp(load(xr[j]) - m);
    s = group_reduce<G>(s, buf, Plus{});
    if (active) {
      if constexpr (kLog) {
        const C ls = d_log(s);
        for (int64_t j = lane; j < cols; j += G) yr[j] = store<T>((load(xr[j]) - m) - ls);
      } else {
        const C inv = C(1) / s;
        for (int64_t j = lane; j < cols; j += G) yr[j] = store<T>(d_exp(load(xr[j]) - m) * inv);
      }
    }
  });
}

template <typename T, bool kLog>
void softmax_host(const Tensor& x, const Tensor& out) {
  const int64_t numel = x.numel();
  if (numel == 0) return;
  OnDevice on(out);
  const int64_t cols = x.rank() == 0 ? 1 : x.shape().back();
  const int64_t rows = numel / cols;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  T* yp = static_cast<T*>(out.data_ptr());
  if (cols <= 256)
    launch_1d({"softmax kernel", rows * 32, on.s}, softmax_kernel<T, kLog, 32>, xp, yp, rows, cols);
  else
    launch_1d({"softmax kernel", rows * kThreads, on.s}, softmax_kernel<T, kLog, kThreads>, xp, yp,
              rows, cols);
}

// masked_softmax: one group of G threads per row, as softmax_kernel, over the positions
// whose mask byte is set (mask null: all), of scale * x. s = 0 only when no position is
// set (the maximum's term is 1 otherwise): the row is then 0.
template <typename T, int G>
__global__ void masked_softmax_kernel(const T* __restrict__ x,
                                      const std::uint8_t* __restrict__ mask, compute_of<T> scale,
                                      T* __restrict__ y, int64_t rows, int64_t cols) {
  using C = compute_of<T>;
  __shared__ C buf[kThreads];
  shared_starts_undefined(buf);
  for_each_group_unit<G>(rows, [&](int64_t r, int lane) {
    const bool active = r < rows;
    const T* xr = x + (active ? r : 0) * cols;
    const std::uint8_t* mr = mask ? mask + (active ? r : 0) * cols : nullptr;
    T* yr = y + (active ? r : 0) * cols;
    C m = -static_cast<C>(INFINITY);
    if (active)
      for (int64_t j = lane; j < cols; j += G)
        if (!mr || mr[j]) m = MaxNan{}(m, load(xr[j]) * scale);
    m = group_reduce<G>(m, buf, MaxNan{});
    C s = C(0);
    if (active)
      for (int64_t j = lane; j < cols; j += G)
        if (!mr || mr[j]) s += d_exp(load(xr[j]) * scale - m);
    s = group_reduce<G>(s, buf, Plus{});
    if (active) {
      const C inv = s == C(0) ? C(0) : C(1) / s;
      for (int64_t j = lane; j < cols; j += G)
        yr[j] = store<T>((!mr || mr[j]) && s != C(0) ? d_exp(load(xr[j]) * scale - m) * inv : C(0));
    }
  });
}

template <typename T>
void masked_softmax_host(const Tensor& x, const Tensor& mask, double scale, const Tensor& out) {
  const int64_t numel = x.numel();
  if (numel == 0) return;
  OnDevice on(out);
  const int64_t cols = x.shape().back();
  const int64_t rows = numel / cols;
  const T* xp = static_cast<const T*>(x.const_data_ptr());
  const auto* mp =
      mask.defined() ? static_cast<const std::uint8_t*>(mask.const_data_ptr()) : nullptr;
  T* yp = static_cast<T*>(out.data_ptr());
  const auto sc = static_cast<compute_of<T>>(scale);
  if (cols <= 256)
    launch_1d({"masked_softmax kernel", rows * 32, on.s}, masked_softmax_kernel<T, 32>, xp, mp, sc,
              yp, rows, cols);
  else
    launch_1d({"masked_softmax kernel", rows * kThreads, on.s}, masked_softmax_kernel<T, kThreads>,
              xp, mp, sc, yp, rows, cols);
}

}  // namespace

void register_reduction_kernels() {
  MIXTAPE_CUDA_KERNEL(sum, reduce_host, SumR);
  MIXTAPE_CUDA_KERNEL(mean, reduce_host, MeanR);
  MIXTAPE_CUDA_KERNEL(max, reduce_host, MaxR);
  MIXTAPE_CUDA_KERNEL(min, reduce_host, MinR);
  MIXTAPE_CUDA_KERNEL(argmax, reduce_host, ArgmaxR, std::int64_t);
  MIXTAPE_CUDA_KERNEL(softmax, softmax_host, false);
  MIXTAPE_CUDA_KERNEL(log_softmax, softmax_host, true);
  MIXTAPE_CUDA_KERNEL(masked_softmax, masked_softmax_host);
}

}  // namespace mixtape::cuda_backend
