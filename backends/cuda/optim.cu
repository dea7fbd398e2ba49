// CUDA training kernels: unscale_check, loss_scale_update, global-norm clipping's
// sum_squares and scale_list, the tape's cast_list, and the in-place optimizer updates
// sgd_update, rmsprop_update and adam_update, for float32, float16, bfloat16 and float64
// variables (slots float32, float64 for float64), with the CPU backend's exact arithmetic
// (backends/cpu/optim.cpp; sum_squares adds in an order of its own, fixed by the sizes):
//  - the update math runs in the slot type, operation by operation as the CPU writes it,
//    with the round-to-nearest intrinsics (__fmul_rn, __dadd_rn, ...) so that nvcc does not
//    contract a * b + c into an FMA: the results are the CPU's, bit for bit, where the CPU
//    does not contract either (x86-64). The variable is rounded once when stored.
//  - unscale_check rounds grad * scale once to the gradient's dtype as if computed in
//    float64: float32 gradients multiply in float32 when the scale is a float32 value and
//    in float64 otherwise; 16-bit gradients multiply in float64 and reach their dtype
//    through a float32 rounded to odd. A gradient element x is non-finite when x - x != 0.
//    The whole list is handled by one launch per kUnscaleChunk tensors (the pointers and
//    sizes travel as a kernel parameter); found_nonfinite is set to 1 on the device by any
//    thread that saw a non-finite value (never cleared, never read back).
//  - a float32 variable's 16-bit copy (OptimizerUpdate::copy) is written by the update's
//    own thread right after the element, rounded as the cast kernel rounds.
//  - the variables of a call (a step's, of one dtype) go in launches of up to kUpdateChunk.
#include <algorithm>
#include <cmath>
#include <span>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/elementwise_util.cuh"
#include "backends/cuda/launch.cuh"
#include "backends/cuda/warp.cuh"

namespace mixtape::cuda_backend {
namespace {

using kernels::OptimizerUpdate;
using std::int64_t;

// --- unscale_check -------------------------------------------------------------------------

constexpr int kUnscaleChunk = 128;  // tensors per launch (3 KiB of kernel parameters)

struct UnscaleList {
  const void* in[kUnscaleChunk];
  void* out[kUnscaleChunk];          // null: only check
  int64_t start[kUnscaleChunk + 1];  // list_walk's offsets: tensor t is [start[t], start[t + 1])
  int count;
};

// The walk of every list kernel: the tensors of a launch as one sequence (list.start[t], the
// first index of tensor t; list.start[count], the total) in pieces of kWalkPiece elements, a
// block's at a time (the grid's blocks taking the pieces in turn), each thread handling element
// i of tensor t at its kWalkPerThread places in the piece: first fetch(t, i) for all of them,
// then use(t, i, loaded) for each in turn. The piece's first tensor is found by a binary search
// the whole block makes alike; from there a thread's tensor only moves forward. Every element
// is independent work for the whole grid: the launches' grids are list_blocks(total).
//
// Why the loads come first: a kernel that stores element i before it loads element i + 1 keeps
// one element's loads in flight a thread (nvcc may not move a load above a store through
// another pointer: they might alias), about 8 KiB a multiprocessor, where a GPU's memory needs
// several times that to run at its rate. Loaded first, a thread's kWalkPerThread elements are in
// flight together. (The elements are distinct places, each handled by one thread: the order of
// the loads and the stores of different elements changes no result.)
//
// Measured on an H200, for the gradients of a GPT-2-small body (148 tensors, 86 M elements):
// a grid sized by the largest tensor, each thread walking every tensor in turn, waited on one
// load per thread and tensor (scale_list 1.0 ms, 6 times the memory's time); a grid of every
// element, each thread searching its tensor from the first, was slower still (unscale_check
// 0.68 ms against 0.14, cast_list 0.95 ms). The pieces, and the loads first, are not yet
// measured there.
constexpr int kWalkPerThread = 8;
constexpr int64_t kWalkPiece = int64_t{kThreads} * kWalkPerThread;

template <class List, class Fetch, class Use>
__device__ __forceinline__ void list_walk(const List& list, Fetch&& fetch, Use&& use) {
  using Loaded = decltype(fetch(0, int64_t{0}));
  const int64_t total = list.start[list.count];
  for (int64_t piece = static_cast<int64_t>(blockIdx.x) * kWalkPiece; piece < total;
       piece += static_cast<int64_t>(gridDim.x) * kWalkPiece) {
    int lo = 0, hi = list.count - 1;  // the last tensor starting at or before the piece
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (list.start[mid] <= piece)
        lo = mid;
      else
        hi = mid - 1;
    }
    int t = lo;
    int tensor[kWalkPerThread];
    int64_t index[kWalkPerThread] = {};
    Loaded loaded[kWalkPerThread];
#pragma unroll
    for (int k = 0; k < kWalkPerThread; ++k) {
      const int64_t i = piece + static_cast<int64_t>(k) * kThreads + threadIdx.x;
      tensor[k] = -1;
      if (i >= total) continue;
      while (i >= list.start[t + 1]) ++t;
      tensor[k] = t;
      index[k] = i - list.start[t];
      loaded[k] = fetch(t, index[k]);
    }
#pragma unroll
    for (int k = 0; k < kWalkPerThread; ++k)
      if (tensor[k] >= 0) use(tensor[k], index[k], loaded[k]);
  }
}

// The threads of a list kernel's launch over `total` elements (launch_1d's count): a piece a
// block (up to blocks_for's cap; the walk covers the rest).
int64_t list_threads(int64_t total) { return (total + kWalkPerThread - 1) / kWalkPerThread; }

// The non-empty xs[i] and their outs[i] (null where outs has none) in chunks of
// kUnscaleChunk, each handed to launch(chunk, its element count): the list kernels' launches,
// a grid of the chunk's elements walked by list_walk.
template <typename Launch>
void for_each_chunk(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs,
                    Launch&& launch) {
  UnscaleList list{};
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const int64_t n = xs[i].numel();
    if (n == 0) continue;
    list.in[list.count] = xs[i].const_data_ptr();
    list.out[list.count] = i < outs.size() && outs[i].defined() ? outs[i].data_ptr() : nullptr;
    list.start[list.count + 1] = list.start[list.count] + n;
    ++list.count;
    if (list.count == kUnscaleChunk) {
      launch(list, list.start[list.count]);
      list = UnscaleList{};
    }
  }
  if (list.count > 0) launch(list, list.start[list.count]);
}

// T: the gradients' device type. kFloatScale: float32 gradients multiply in float32.
// scale_on_device, when not null, holds the scale (then kFloatScale is decided here, from it,
// as the host decides it from `scale`).
template <typename T, bool kFloatScale>
__global__ void unscale_check_kernel(UnscaleList list, double scale, const double* scale_on_device,
                                     float* flag) {
  if (scale_on_device != nullptr) scale = *scale_on_device;
  [[maybe_unused]] const bool float_scale =
      scale_on_device != nullptr ? static_cast<double>(static_cast<float>(scale)) == scale
                                 : kFloatScale;
  bool found = false;
  const auto element = [&](int t, int64_t i) {  // float (float32 and 16-bit) or double
    return load(static_cast<const T*>(list.in[t])[i]);
  };
  list_walk(list, element, [&](int t, int64_t i, const auto v) {
    T* y = static_cast<T*>(list.out[t]);
    if (!(v - v == decltype(v)(0))) found = true;
    if (y != nullptr) {
      if constexpr (std::is_same_v<T, double>)
        y[i] = __dmul_rn(v, scale);
      else if constexpr (std::is_same_v<T, float>)
        y[i] = float_scale ? __fmul_rn(v, static_cast<float>(scale))
                           : static_cast<float>(__dmul_rn(static_cast<double>(v), scale));
      else
        y[i] = store<T>(round_to_odd(__dmul_rn(static_cast<double>(v), scale)));
    }
  });
  if (found) *flag = 1.0f;
}

template <typename T>
void unscale_check_host(const std::vector<Tensor>& grads, const std::vector<Tensor>& outs,
                        double scale, const Tensor& scale_on_device,
                        const Tensor& found_nonfinite) {
  if (grads.empty()) return;
  OnDevice on(found_nonfinite);
  auto* flag = static_cast<float*>(found_nonfinite.data_ptr());
  const auto* on_device = scale_on_device.defined()
                              ? static_cast<const double*>(scale_on_device.const_data_ptr())
                              : nullptr;
  const bool float_scale = static_cast<double>(static_cast<float>(scale)) == scale;
  for_each_chunk(grads, outs, [&](const UnscaleList& list, int64_t total) {
    const Launch1d grid("unscale_check kernel", list_threads(total), on.s);
    if (float_scale)
      launch_1d(grid, unscale_check_kernel<T, true>, list, scale, on_device, flag);
    else
      launch_1d(grid, unscale_check_kernel<T, false>, list, scale, on_device, flag);
  });
}

// --- loss_scale_update ---------------------------------------------------------------------
// One thread moves the scale kept on the device by the step's flag, with kernels.h's
// move_loss_scale (the rule the LossScaleOptimizer's host copy follows; its double division
// and product are IEEE's, nothing to contract) and writes 1 / scale beside it.

__global__ void loss_scale_update_kernel(const float* flag, double* scale, double* inverse,
                                         double* good_steps, kernels::LossScaleRule rule) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double s = *scale;
  double good = *good_steps;
  kernels::move_loss_scale(*flag != 0.0f, rule, s, good);
  *scale = s;
  *good_steps = good;
  *inverse = __ddiv_rn(1.0, s);
}

template <typename T>
void loss_scale_update_host(const Tensor& found_nonfinite, const Tensor& scale,
                            const Tensor& inverse, const Tensor& good_steps,
                            const kernels::LossScaleRule& rule) {
  static_assert(std::is_same_v<T, double>, "the loss scale is kept in float64");
  OnDevice on(scale);
  launch_1d(Launch1d("loss_scale_update kernel", 1, on.s), loss_scale_update_kernel,
            static_cast<const float*>(found_nonfinite.const_data_ptr()),
            static_cast<double*>(scale.data_ptr()), static_cast<double*>(inverse.data_ptr()),
            static_cast<double*>(good_steps.data_ptr()), rule);
}

// --- sum_squares and scale_list (global-norm clipping) -------------------------------------
// The tensors of a call go in chunks of kUnscaleChunk, pointers and sizes as a kernel
// parameter. sum_squares: a grid of up to kSquareBlocks blocks per chunk (fewer for a small
// chunk), every thread summing its share of list_walk's elements' squares in float64, each
// block's sum (a tree over its threads) written to a partial; one block then adds the partials
// in order to out. The grids and the orders depend on the sizes alone: the same bits on every
// run. (kSquareBlocks: about the blocks an H100 holds at once, 8 of 256 threads per
// multiprocessor. With 256 blocks, 0.27 ms a launch for a GPT-2-small body's gradients on an
// H200; with 1024 and each thread's tensor carried along a grid-stride walk, under 0.02.)

constexpr int kSquareBlocks = 1024;

struct SquareList {
  const void* in[kUnscaleChunk];
  int64_t start[kUnscaleChunk + 1];  // as UnscaleList's
  int count;
};

// The sum of v over the block's kThreads threads, in a fixed tree order; thread 0 gets it.
__device__ double block_sum(double v) {
  __shared__ double lanes[kThreads / kWarp];
  shared_starts_undefined(lanes);
  v = warp_sum(v);
  if (threadIdx.x % kWarp == 0) lanes[threadIdx.x / kWarp] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / kWarp; ++w) total += lanes[w];
  return total;
}

template <typename T>
__global__ void sum_squares_kernel(SquareList list, double* partials) {
  double sum = 0.0;
  list_walk(
      list,
      [&](int t, int64_t i) {
        return static_cast<double>(load(static_cast<const T*>(list.in[t])[i]));
      },
      [&](int, int64_t, double v) { sum = __dadd_rn(sum, __dmul_rn(v, v)); });
  const double block = block_sum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = block;
}

// *out += partials[0] + partials[1] + ... (count of them), one block.
__global__ void add_partials_kernel(const double* partials, int64_t count, double* out) {
  double sum = 0.0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) sum = __dadd_rn(sum, partials[i]);
  const double total = block_sum(sum);
  if (threadIdx.x == 0) *out = __dadd_rn(*out, total);
}

template <typename T>
void sum_squares_host(const std::vector<Tensor>& xs, const Tensor& out) {
  std::vector<SquareList> chunks(1);
  for (const Tensor& x : xs) {
    if (x.numel() == 0) continue;
    if (chunks.back().count == kUnscaleChunk) chunks.emplace_back();
    SquareList& c = chunks.back();
    c.in[c.count] = x.const_data_ptr();
    c.start[c.count + 1] = c.start[c.count] + x.numel();
    ++c.count;
  }
  if (chunks.front().count == 0) return;
  OnDevice on(out);
  std::vector<unsigned> grids;  // each chunk's blocks, each writing a partial
  int64_t blocks = 0;
  for (const SquareList& c : chunks) {
    grids.push_back(std::min<unsigned>(kSquareBlocks, blocks_for(list_threads(c.start[c.count]))));
    blocks += grids.back();
  }
  Workspace partials(static_cast<std::size_t>(blocks) * sizeof(double), on.index);
  auto* p = static_cast<double*>(partials.data());
  for (std::size_t c = 0, offset = 0; c < chunks.size(); offset += grids[c], ++c) {
    MIXTAPE_CUDA_LAUNCH(grids[c], kThreads, on.s, sum_squares_kernel<T>)(chunks[c], p + offset);
    MIXTAPE_CUDA_CHECK_LAUNCH("sum_squares kernel");
  }
  MIXTAPE_CUDA_LAUNCH(1, kThreads, on.s, add_partials_kernel)
  (p, blocks, static_cast<double*>(out.data_ptr()));
  MIXTAPE_CUDA_CHECK_LAUNCH("sum_squares total kernel");
}

// outs[i] = xs[i] * factor in the compute type (the factor rounded to it), rounded once to T.
template <typename T>
__global__ void scale_list_kernel(UnscaleList list, const double* factor_p) {
  using C = compute_of<T>;
  const auto factor = static_cast<C>(*factor_p);
  list_walk(
      list,
      [&](int t, int64_t i) { return static_cast<C>(load(static_cast<const T*>(list.in[t])[i])); },
      [&](int t, int64_t i, C x) {
        static_cast<T*>(list.out[t])[i] = store<T>(mul_rn(x, factor));
      });
}

template <typename T>
void scale_list_host(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs,
                     const Tensor& factor) {
  if (xs.empty()) return;
  OnDevice on(factor);
  const auto* f = static_cast<const double*>(factor.const_data_ptr());
  for_each_chunk(xs, outs, [&](const UnscaleList& list, int64_t total) {
    launch_1d({"scale_list kernel", list_threads(total), on.s}, scale_list_kernel<T>, list, f);
  });
}

// --- cast_list (the tape's widening of gradients) --------------------------------------------

// xs[i] widened exactly into outs[i] of type O (float or double), a chunk a launch.
template <typename T, typename O>
__global__ void cast_list_kernel(UnscaleList list) {
  list_walk(
      list,
      [&](int t, int64_t i) { return static_cast<O>(load(static_cast<const T*>(list.in[t])[i])); },
      [&](int t, int64_t i, O x) { static_cast<O*>(list.out[t])[i] = x; });
}

template <typename T>
void cast_list_host(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs) {
  if (xs.empty()) return;
  OnDevice on(outs.front());
  const bool to_double = outs.front().dtype() == kFloat64;
  for_each_chunk(xs, outs, [&](const UnscaleList& list, int64_t total) {
    const Launch1d grid("cast_list kernel", list_threads(total), on.s);
    if (to_double)
      launch_1d(grid, cast_list_kernel<T, double>, list);
    else if constexpr (!std::is_same_v<T, double>)
      launch_1d(grid, cast_list_kernel<T, float>, list);
  });
}

// --- Optimizer updates ----------------------------------------------------------------------
// A call updates a list of variables (kernels.h): one launch per kUpdateChunk of them, the
// pointers and sizes travelling as a kernel parameter (as unscale_check's), a grid of the
// chunk's elements walked by list_walk.

template <typename T>
using slot_of = compute_of<T>;  // float64 for float64, float32 otherwise

constexpr int kUpdateChunk = 48;  // variables per launch (2.7 KiB of kernel parameters)

// One element of a variable in the slot type: its value, its gradient and its slots (those the
// optimizer uses: the list's null slots are neither loaded nor stored), loaded before the step
// and stored after it (list_walk).
template <typename S>
struct Element {
  S v, g, s1, s2, s3;
};

// The variables of one launch: var, grad, the three slots (null when the optimizer does not
// use them) and the 16-bit copy (null, or float16 / bfloat16: copy_bf16).
struct UpdateList {
  void* var[kUpdateChunk];
  const void* grad[kUpdateChunk];
  void* slot1[kUpdateChunk];
  void* slot2[kUpdateChunk];
  void* slot3[kUpdateChunk];
  void* copy[kUpdateChunk];
  int64_t start[kUpdateChunk + 1];  // as UnscaleList's
  bool copy_bf16[kUpdateChunk];
  int count;
};

// The device flag of a step decided on the device, or null (kernels.h, skip_if).
const float* skip_ptr(const OptimizerUpdate& u) {
  return u.skip_if.defined() ? static_cast<const float*>(u.skip_if.const_data_ptr()) : nullptr;
}

void* ptr_or_null(const Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

// The device's {lr, alpha} of a captured step (kernels.h, rates), or null.
const double* rates_ptr(const OptimizerUpdate& u) {
  return u.rates.defined() ? static_cast<const double*>(u.rates.const_data_ptr()) : nullptr;
}

// Checks that a 16-bit copy is asked for a float32 variable only (kernels.h).
template <typename T>
void check_copy(const OptimizerUpdate& u) {
  if constexpr (!std::is_same_v<T, float>) {
    if (u.copy.defined())
      throw DTypeError(
          fmt::format("optimizer update: a 16-bit copy is written for float32 "
                      "variables only; the variable is {}",
                      u.var.dtype().name()));
  }
}

// Element i of the copy: x rounded as the cast kernel rounds.
__device__ __forceinline__ void write_copy(void* copy, bool bf16, int64_t i, float x) {
  if (copy == nullptr) return;
  if (bf16)
    static_cast<__nv_bfloat16*>(copy)[i] = store<__nv_bfloat16>(x);
  else
    static_cast<__half*>(copy)[i] = store<__half>(x);
}
__device__ __forceinline__ void write_copy(void*, bool, int64_t, double) {}

// Whether a step skipped on the device (skip_if) leaves the kernel nothing to do.
__device__ __forceinline__ bool skipped(const float* skip) {
  return skip != nullptr && *skip != 0.0f;
}

// The loop of every update kernel, over each variable of the list: v = step(element) in the
// slot type (the step moves the element's slots too), written back to var[i], the slots and
// the copy. A step skipped on the device leaves var as it is and writes only the copy. With
// rates (a captured step's), the step's lr and alpha are read there; with grad_scale, g is the
// gradient times it as scale_list computes it (kernels.h).
template <typename T, typename Step>
__global__ void update_kernel(const float* __restrict__ skip, const double* __restrict__ rates,
                              const double* __restrict__ grad_scale, UpdateList list, Step step) {
  using S = slot_of<T>;
  const bool skip_step = skipped(skip);  // a step skipped on the device
  if (rates != nullptr) step.use_rates(rates[0], rates[1]);
  const S factor = grad_scale != nullptr ? static_cast<S>(*grad_scale) : S(1);
  const auto slot = [&](void* const(&slots)[kUpdateChunk], int t) {
    return static_cast<S*>(slots[t]);
  };
  const auto element = [&](int t, int64_t i) {
    Element<S> e{};
    if (skip_step && list.copy[t] == nullptr) return e;
    e.v = load(static_cast<const T*>(list.var[t])[i]);
    if (skip_step) return e;
    e.g = load(static_cast<const T*>(list.grad[t])[i]);
    if (const S* s1 = slot(list.slot1, t)) e.s1 = s1[i];
    if (const S* s2 = slot(list.slot2, t)) e.s2 = s2[i];
    if (const S* s3 = slot(list.slot3, t)) e.s3 = s3[i];
    return e;
  };
  list_walk(list, element, [&](int t, int64_t i, Element<S> e) {
    void* copy = list.copy[t];
    if (skip_step && copy == nullptr) return;
    if (!skip_step) {
      if (grad_scale != nullptr) e.g = load(store<T>(mul_rn(e.g, factor)));
      e.v = step(e);
      static_cast<T*>(list.var[t])[i] = store<T>(e.v);
      if (S* s1 = slot(list.slot1, t)) s1[i] = e.s1;
      if (S* s2 = slot(list.slot2, t)) s2[i] = e.s2;
      if (S* s3 = slot(list.slot3, t)) s3[i] = e.s3;
    }
    write_copy(copy, list.copy_bf16[t], i, e.v);
  });
}

// Launches update_kernel over the variables of `updates` (one device, one dtype, one set of
// scalars), kUpdateChunk at a time, with the step make() returns for the first update.
template <typename T, typename Make>
void launch_updates(const char* name, std::span<const OptimizerUpdate> updates, Make make) {
  if (updates.empty()) return;
  using Step = decltype(make(updates.front()));
  const Step step = make(updates.front());
  OnDevice on(updates.front().var);
  const float* skip = skip_ptr(updates.front());
  const double* rates = rates_ptr(updates.front());
  const double* grad_scale =
      updates.front().grad_scale.defined()
          ? static_cast<const double*>(updates.front().grad_scale.const_data_ptr())
          : nullptr;
  UpdateList list{};
  auto launch = [&]() {
    if (list.count > 0)
      launch_1d({name, list_threads(list.start[list.count]), on.s}, update_kernel<T, Step>, skip,
                rates, grad_scale, list, step);
    list = UpdateList{};
  };
  for (const OptimizerUpdate& u : updates) {
    check_copy<T>(u);
    const int64_t n = u.var.numel();
    if (n == 0) continue;
    const int c = list.count;
    list.var[c] = u.var.data_ptr();
    list.grad[c] = u.grad.const_data_ptr();
    list.slot1[c] = step.uses(1) ? ptr_or_null(u.slot1) : nullptr;
    list.slot2[c] = step.uses(2) ? ptr_or_null(u.slot2) : nullptr;
    list.slot3[c] = step.uses(3) ? ptr_or_null(u.slot3) : nullptr;
    list.copy[c] = ptr_or_null(u.copy);
    list.copy_bf16[c] = u.copy.defined() && u.copy.dtype() == kBFloat16;
    list.start[c + 1] = list.start[c] + n;
    ++list.count;
    if (list.count == kUpdateChunk) launch();
  }
  launch();
}

// sgd: mode 0: var -= lr g; 1: vel = momentum vel - lr g, var += vel; 2 (Nesterov): the same
// velocity, var += momentum vel - lr g. slot1 is the velocity.
template <typename S>
struct SgdStep {
  S lr, momentum;
  int mode;
  // Whether the step reads and writes slot n (1: the velocity).
  bool uses(int n) const { return n == 1 && mode != 0; }
  __device__ void use_rates(double r_lr, double /*alpha*/) { lr = static_cast<S>(r_lr); }
  __device__ S operator()(Element<S>& e) const {
    if (mode == 0) return sub_rn(e.v, mul_rn(lr, e.g));
    const S nv = sub_rn(mul_rn(momentum, e.s1), mul_rn(lr, e.g));
    e.s1 = nv;
    if (mode == 2) return add_rn(e.v, sub_rn(mul_rn(momentum, nv), mul_rn(lr, e.g)));
    return add_rn(e.v, nv);
  }
};

template <typename T>
void sgd_host(std::span<const OptimizerUpdate> updates) {
  using S = slot_of<T>;
  launch_updates<T>("sgd_update kernel", updates, [](const OptimizerUpdate& u) {
    const int mode = u.momentum == 0.0 ? 0 : (u.nesterov ? 2 : 1);
    return SgdStep<S>{static_cast<S>(u.lr), static_cast<S>(u.momentum), mode};
  });
}

// rmsprop: slot1 ms = rho ms + (1 - rho) g^2; centered: slot3 mg = rho mg + (1 - rho) g,
// d = max(ms - mg^2, 0), else d = ms; step = lr g / sqrt(d + eps); momentum: slot2 mom =
// momentum mom + step, var -= mom; otherwise var -= step.
template <typename S>
struct RmspropStep {
  S lr, rho, one_minus_rho, eps, momentum;
  bool centered, use_momentum;
  bool uses(int n) const { return n == 1 || (n == 2 && use_momentum) || (n == 3 && centered); }
  __device__ void use_rates(double r_lr, double /*alpha*/) { lr = static_cast<S>(r_lr); }
  __device__ S operator()(Element<S>& e) const {
    const S g = e.g;
    const S msi = add_rn(mul_rn(rho, e.s1), mul_rn(one_minus_rho, mul_rn(g, g)));
    e.s1 = msi;
    S d = msi;
    if (centered) {
      const S mgi = add_rn(mul_rn(rho, e.s3), mul_rn(one_minus_rho, g));
      e.s3 = mgi;
      const S c = sub_rn(msi, mul_rn(mgi, mgi));
      d = c < S(0) ? S(0) : c;
    }
    const S step = div_rn(mul_rn(lr, g), sqrt_rn(add_rn(d, eps)));
    if (!use_momentum) return sub_rn(e.v, step);
    const S mi = add_rn(mul_rn(momentum, e.s2), step);
    e.s2 = mi;
    return sub_rn(e.v, mi);
  }
};

template <typename T>
void rmsprop_host(std::span<const OptimizerUpdate> updates) {
  using S = slot_of<T>;
  launch_updates<T>("rmsprop_update kernel", updates, [](const OptimizerUpdate& u) {
    return RmspropStep<S>{
        static_cast<S>(u.lr),      static_cast<S>(u.beta2),    static_cast<S>(1.0 - u.beta2),
        static_cast<S>(u.epsilon), static_cast<S>(u.momentum), u.centered,
        u.momentum > 0.0};
  });
}

// adam: var -= lr_wd var (AdamW); slot1 m += (g - m)(1 - beta1); slot2 v += (g^2 - v)(1 -
// beta2); amsgrad: slot3 vmax = max(vmax, v); var -= alpha m / (sqrt(v | vmax) + eps).
template <typename S>
struct AdamStep {
  S alpha, one_minus_beta1, one_minus_beta2, eps, lr_wd;
  bool amsgrad, decay;
  double weight_decay;
  bool uses(int n) const { return n == 1 || n == 2 || (n == 3 && amsgrad); }
  // lr * weight_decay in float64 as the host computes it, then rounded to S.
  __device__ void use_rates(double r_lr, double r_alpha) {
    alpha = static_cast<S>(r_alpha);
    lr_wd = static_cast<S>(r_lr * weight_decay);
  }
  __device__ S operator()(Element<S>& e) const {
    const S g = e.g;
    S x = e.v;
    if (decay) x = sub_rn(x, mul_rn(lr_wd, x));
    const S mi = add_rn(e.s1, mul_rn(sub_rn(g, e.s1), one_minus_beta1));
    e.s1 = mi;
    const S vi = add_rn(e.s2, mul_rn(sub_rn(mul_rn(g, g), e.s2), one_minus_beta2));
    e.s2 = vi;
    S d = vi;
    if (amsgrad) {
      const S mx = e.s3 < vi ? vi : e.s3;
      e.s3 = mx;
      d = mx;
    }
    return sub_rn(x, div_rn(mul_rn(alpha, mi), add_rn(sqrt_rn(d), eps)));
  }
};

template <typename T>
void adam_host(std::span<const OptimizerUpdate> updates) {
  using S = slot_of<T>;
  launch_updates<T>("adam_update kernel", updates, [](const OptimizerUpdate& u) {
    const double alpha = kernels::step_rates(u.lr, u.step, u.beta1, u.beta2).alpha;
    return AdamStep<S>{static_cast<S>(alpha),
                       static_cast<S>(1.0 - u.beta1),
                       static_cast<S>(1.0 - u.beta2),
                       static_cast<S>(u.epsilon),
                       static_cast<S>(u.lr * u.weight_decay),
                       u.amsgrad,
                       u.weight_decay != 0.0,
                       u.weight_decay};
  });
}

}  // namespace

void register_optim_kernels() {
  MIXTAPE_CUDA_KERNEL(unscale_check, unscale_check_host);
  MIXTAPE_CUDA_KERNEL(loss_scale_update, loss_scale_update_host);
  MIXTAPE_CUDA_KERNEL(sum_squares, sum_squares_host);
  MIXTAPE_CUDA_KERNEL(scale_list, scale_list_host);
  MIXTAPE_CUDA_KERNEL(cast_list, cast_list_host);
  MIXTAPE_CUDA_KERNEL(sgd_update, sgd_host);
  MIXTAPE_CUDA_KERNEL(rmsprop_update, rmsprop_host);
  MIXTAPE_CUDA_KERNEL(adam_update, adam_host);
}

}  // namespace mixtape::cuda_backend
