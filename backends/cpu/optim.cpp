// CPU training kernels: unscale_check (multiply gradients by the loss-scale inverse and
// look for non-finite values in the same pass), loss_scale_update (the scale kept on the
// device), global-norm clipping's sum_squares and scale_list, the tape's cast_list, and the
// in-place optimizer updates sgd_update, rmsprop_update and adam_update (see kernels.h for
// their exact semantics).
//
// Every kernel walks its tensors in blocks of kBlock elements with parallel_blocks (one
// thread up to kParallelGrain elements). float32 and float64 blocks are updated in place
// by simple loops over __restrict pointers that vectorise (sqrt vectorises as the library
// is built with -fno-math-errno; max through ?: becomes a vector max). float16 / bfloat16
// variables and gradients are bulk-converted to float32 stack buffers a block at a time,
// updated by the same float32 loops (their slots are float32 tensors), and the variable is
// converted back once, so it is rounded once per step.
//
// unscale_check rounds the product grad * scale once to the gradient's dtype, as if it
// were computed in float64: float32 gradients multiply in float32 when the scale is a
// float32 value (the float32 product is then the correctly rounded exact product) and in
// float64 otherwise; 16-bit gradients multiply in float64 (exact for a float32 scale) and
// reach their dtype through a float32 rounded to odd, which makes the final rounding
// exact-once. Non-finite values are found by OR-ing the bits of x - x (zero exactly when x
// is finite), a reduction that vectorises.
#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "backends/cpu/cpu_util.h"

namespace mixtape::cpu {
namespace {

using kernels::OptimizerUpdate;
using std::int64_t;

// --- unscale_check -----------------------------------------------------------------------

// An unsigned integer as wide as the float C.
template <typename C>
using ubits_t = std::conditional_t<sizeof(C) == 4, std::uint32_t, std::uint64_t>;

// The bits of x - x: 0 when x is finite, a NaN's (non-zero) bits for inf and NaN.
template <typename C>
ubits_t<C> nonfinite_bits(C x) {
  return std::bit_cast<ubits_t<C>>(x - x);
}

// double -> float rounded to odd: exact values stay, inexact ones are truncated toward
// zero and get their last mantissa bit set, so that a later rounding to float16 /
// bfloat16 rounds as if from the double. r = d - float(d) is exact; d is inexact when r
// is neither zero nor NaN (NaN: d is inf or NaN, which stay), and rounded away from zero
// when r and d differ in sign (an overflow to inf truncates to FLT_MAX, which still rounds
// to inf in 16 bits). Integer arithmetic only (no 64-bit compares, which SSE2 lacks), so
// that loops over it vectorise.
inline float round_to_odd_simd(double d) {
  const float f = static_cast<float>(d);
  const auto rb = std::bit_cast<std::uint64_t>(d - static_cast<double>(f));
  const std::uint64_t a = rb & 0x7FFFFFFFFFFFFFFFull;                           // |r|
  const std::uint64_t inexact = ((0 - a) & (a - 0x7FF0000000000001ull)) >> 63;  // 0 < |r| <= inf
  const std::uint64_t away = ((rb ^ std::bit_cast<std::uint64_t>(d)) >> 63) & inexact;
  const std::uint64_t fb = std::bit_cast<std::uint32_t>(f);
  return std::bit_cast<float>(static_cast<std::uint32_t>((fb - away) | inexact));
}

// True when x[0, n) holds an inf or NaN.
template <typename C>
bool check_block(const C* x, int64_t n) {
  ubits_t<C> acc = 0;
  for (int64_t i = 0; i < n; ++i) acc |= nonfinite_bits(x[i]);
  return acc != 0;
}

// y[i] = x[i] * s, with the product computed in M (C or double) and rounded to C; true
// when x holds an inf or NaN. x and y do not overlap.
template <typename C, typename M>
bool scale_block(const C* __restrict x, C* __restrict y, int64_t n, M s) {
  ubits_t<C> acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= nonfinite_bits(x[i]);
    y[i] = static_cast<C>(static_cast<M>(x[i]) * s);
  }
  return acc != 0;
}

// p[i] *= s in place (the product in M, rounded to C); true when p held an inf or NaN.
template <typename C, typename M>
bool scale_block_inplace(C* __restrict p, int64_t n, M s) {
  ubits_t<C> acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= nonfinite_bits(p[i]);
    p[i] = static_cast<C>(static_cast<M>(p[i]) * s);
  }
  return acc != 0;
}

// buf[i] *= s in float64, rounded to odd to float32 (the 16-bit gradients' path); true
// when buf held an inf or NaN.
bool scale_block_to_odd(float* __restrict buf, int64_t n, double s) {
  std::uint32_t acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    acc |= nonfinite_bits(buf[i]);
    buf[i] = round_to_odd_simd(static_cast<double>(buf[i]) * s);
  }
  return acc != 0;
}

// One gradient: out = grad * scale when out is non-null (it may be grad itself), and
// whether grad holds a non-finite value. M: the multiplication type of float32 / float64
// gradients.
template <typename T, typename M>
bool unscale_one(const T* x, T* y, int64_t numel, double scale) {
  std::atomic<bool> found{false};
  parallel_blocks(numel, [&](int64_t b, int64_t e) {
    const int64_t n = e - b;
    bool f;
    if constexpr (kReduced<T>) {
      float buf[kBlock];
      to_float(x + b, buf, n);
      if (y == nullptr) {
        f = check_block(buf, n);
      } else {
        f = scale_block_to_odd(buf, n, scale);
        from_float(buf, y + b, n);
      }
    } else if (y == nullptr) {
      f = check_block(x + b, n);
    } else if (y == x) {
      f = scale_block_inplace(y + b, n, static_cast<M>(scale));
    } else {
      f = scale_block(x + b, y + b, n, static_cast<M>(scale));
    }
    if (f) found.store(true, std::memory_order_relaxed);
  });
  return found.load(std::memory_order_relaxed);
}

// unscale_check: every grads[i] scaled into outs[i] (when outs has a defined i-th tensor),
// and found_nonfinite set to 1 when any gradient holds an inf or NaN (never cleared).
template <typename T>
void unscale_check_kernel(const std::vector<Tensor>& grads, const std::vector<Tensor>& outs,
                          double scale, const Tensor& scale_on_device,
                          const Tensor& found_nonfinite) {
  if (scale_on_device.defined())
    scale = *static_cast<const double*>(scale_on_device.const_data_ptr());
  [[maybe_unused]] const bool float_scale = static_cast<double>(static_cast<float>(scale)) == scale;
  bool found = false;
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const T* x = static_cast<const T*>(grads[i].const_data_ptr());
    T* y = i < outs.size() && outs[i].defined() ? static_cast<T*>(outs[i].data_ptr()) : nullptr;
    const int64_t numel = grads[i].numel();
    bool f;
    if constexpr (std::is_same_v<T, float>)
      f = float_scale ? unscale_one<T, float>(x, y, numel, scale)
                      : unscale_one<T, double>(x, y, numel, scale);
    else
      f = unscale_one<T, double>(x, y, numel, scale);
    found = found || f;
  }
  if (found) *static_cast<float*>(found_nonfinite.data_ptr()) = 1.0f;
}

// --- loss_scale_update ---------------------------------------------------------------------

// The scale kept on the device moved by the flag of the step (kernels.h's move_loss_scale).
template <typename T>
void loss_scale_update_kernel(const Tensor& found_nonfinite, const Tensor& scale,
                              const Tensor& inverse, const Tensor& good_steps,
                              const kernels::LossScaleRule& rule) {
  static_assert(std::is_same_v<T, double>, "the loss scale is kept in float64");
  const bool nonfinite = *static_cast<const float*>(found_nonfinite.const_data_ptr()) != 0.0f;
  double& s = *static_cast<double*>(scale.data_ptr());
  double& good = *static_cast<double*>(good_steps.data_ptr());
  kernels::move_loss_scale(nonfinite, rule, s, good);
  *static_cast<double*>(inverse.data_ptr()) = 1.0 / s;
}

// --- sum_squares and scale_list (global-norm clipping) -----------------------------------

// x[i] widened: float32 values as they are (float64 for float64).
template <typename T>
inline compute_t<T> widened(T x) {
  return static_cast<compute_t<T>>(x);
}

// The squares of every tensor summed in float64 a block of kBlock elements at a time (the
// blocks in parallel), the blocks' sums then added in order: the order depends on the sizes
// alone, not on the threads.
template <typename T>
void sum_squares_kernel(const std::vector<Tensor>& xs, const Tensor& out) {
  double total = 0.0;
  std::vector<double> parts;
  for (const Tensor& x_t : xs) {
    const T* x = static_cast<const T*>(x_t.const_data_ptr());
    const int64_t n = x_t.numel();
    parts.assign(static_cast<std::size_t>((n + kBlock - 1) / kBlock), 0.0);
    parallel_blocks(n, [&](int64_t b, int64_t e) {
      // kLanes running sums (element i into sum i % kLanes), added in order at the end: the
      // lanes vectorise without reassociating anything.
      constexpr int kLanes = 8;
      double lanes[kLanes] = {};
      int64_t i = b;
      for (; i + kLanes <= e; i += kLanes)
        for (int k = 0; k < kLanes; ++k) {
          const auto v = static_cast<double>(widened(x[i + k]));
          lanes[k] += v * v;
        }
      for (int k = 0; i < e; ++i, ++k) {
        const auto v = static_cast<double>(widened(x[i]));
        lanes[k] += v * v;
      }
      double sum = 0.0;
      for (const double l : lanes) sum += l;
      parts[static_cast<std::size_t>(b / kBlock)] = sum;
    });
    for (const double p : parts) total += p;
  }
  *static_cast<double*>(out.data_ptr()) += total;
}

// outs[i] = xs[i] * factor, in the compute type, rounded once to T.
template <typename T>
void scale_list_kernel(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs,
                       const Tensor& factor_t) {
  using C = compute_t<T>;
  const auto factor = static_cast<C>(*static_cast<const double*>(factor_t.const_data_ptr()));
  for (std::size_t t = 0; t < xs.size(); ++t) {
    const T* x = static_cast<const T*>(xs[t].const_data_ptr());
    T* y = static_cast<T*>(outs[t].data_ptr());
    parallel_blocks(xs[t].numel(), [&](int64_t b, int64_t e) {
      C buf[kBlock];
      for (int64_t i = b; i < e; ++i) buf[i - b] = widened(x[i]) * factor;
      from_compute(buf, y + b, e - b);
    });
  }
}

// --- cast_list (the tape's widening of gradients) ------------------------------------------

// xs[i] widened exactly into outs[i] (float32 or float64, the same for the whole call).
template <typename T>
void cast_list_kernel(const std::vector<Tensor>& xs, const std::vector<Tensor>& outs) {
  if (xs.empty()) return;
  const bool to_double = outs.front().dtype() == kFloat64;
  for (std::size_t t = 0; t < xs.size(); ++t) {
    const T* x = static_cast<const T*>(xs[t].const_data_ptr());
    void* y = outs[t].data_ptr();
    parallel_blocks(xs[t].numel(), [&](int64_t b, int64_t e) {
      if (to_double) {
        double* d = static_cast<double*>(y);
        for (int64_t i = b; i < e; ++i) d[i] = static_cast<double>(widened(x[i]));
      } else if constexpr (!std::is_same_v<T, double>) {
        float* f = static_cast<float*>(y);
        if constexpr (kReduced<T>)
          to_float(x + b, f + b, e - b);
        else
          std::copy(x + b, x + e, f + b);
      }
    });
  }
}

// --- Optimizer updates -------------------------------------------------------------------

// The slot type of a variable of type T (float64 for float64, float32 otherwise).
template <typename T>
using slot_t = compute_t<T>;

// The address of a slot tensor's first element, or null when the slot is undefined.
template <typename S>
S* slot_ptr(const Tensor& t) {
  return t.defined() ? static_cast<S*>(t.data_ptr()) : nullptr;
}

// The float32 values x[0, n) rounded into elements [b, b + n) of u.copy (kernels.h), when
// it is defined: the same conversions as the cast kernel's.
inline void write_copy(const OptimizerUpdate& u, void* copy, const float* x, int64_t b, int64_t n) {
  if (copy == nullptr) return;
  if (u.copy.dtype() == kBFloat16)
    from_float(x, static_cast<bfloat16*>(copy) + b, n);
  else
    from_float(x, static_cast<half*>(copy) + b, n);
}

// Runs block(v, g, b, n) for each block [b, b + n) of the variable, in parallel for large
// variables. v and g are the block's variable and gradient in the slot type: the tensors
// themselves, or float32 stack copies of 16-bit ones (the variable's copy is converted
// back after the block, its one rounding per step). A float32 variable's block goes to
// u.copy right after its update, while it is in cache. With u.grad_scale, g is the gradient
// times the factor as scale_list computes it (kernels.h), in a stack copy.
// Nothing changes when u.skip_if is set (kernels.h); u.copy then receives the variable.
template <typename T, typename Block>
void for_each_var_block(const OptimizerUpdate& u, Block&& block) {
  using S = compute_t<T>;
  const bool skip =
      u.skip_if.defined() && *static_cast<const float*>(u.skip_if.const_data_ptr()) != 0.0f;
  const bool scaled = u.grad_scale.defined();
  const S factor =
      scaled ? static_cast<S>(*static_cast<const double*>(u.grad_scale.const_data_ptr())) : S(1);
  void* copy = u.copy.defined() ? u.copy.data_ptr() : nullptr;
  if constexpr (!std::is_same_v<T, float>)
    if (copy != nullptr)
      throw DTypeError(
          fmt::format("optimizer update: a 16-bit copy is written for float32 "
                      "variables only; the variable is {}",
                      u.var.dtype().name()));
  if (skip && copy == nullptr) return;
  T* var = static_cast<T*>(u.var.data_ptr());
  const T* grad = static_cast<const T*>(u.grad.const_data_ptr());
  parallel_blocks(u.var.numel(), [&](int64_t b, int64_t e) {
    const int64_t n = e - b;
    if constexpr (kReduced<T>) {
      float vbuf[kBlock], gbuf[kBlock];
      to_float(var + b, vbuf, n);
      to_float(grad + b, gbuf, n);
      if (scaled) {  // scale_list's product, rounded to T
        T rounded[kBlock];
        for (int64_t i = 0; i < n; ++i) gbuf[i] *= factor;
        from_float(gbuf, rounded, n);
        to_float(rounded, gbuf, n);
      }
      block(vbuf, gbuf, b, n);
      from_float(vbuf, var + b, n);
    } else {
      const S* g = grad + b;
      S gbuf[kBlock];
      if (scaled && !skip) {
        for (int64_t i = 0; i < n; ++i) gbuf[i] = g[i] * factor;
        g = gbuf;
      }
      if (!skip) block(var + b, g, b, n);
      if constexpr (std::is_same_v<T, float>) write_copy(u, copy, var + b, b, n);
    }
  });
}

// SGD without momentum: var -= lr * g.
template <typename S>
void sgd_block(S* __restrict v, const S* __restrict g, int64_t n, S lr) {
  for (int64_t i = 0; i < n; ++i) v[i] -= lr * g[i];
}

// SGD with momentum: vel = momentum * vel - lr * g; var += vel, or with Nesterov
// var += momentum * vel - lr * g.
template <bool kNesterov, typename S>
void sgd_momentum_block(S* __restrict v, const S* __restrict g, S* __restrict vel, int64_t n, S lr,
                        S momentum) {
  for (int64_t i = 0; i < n; ++i) {
    const S nv = momentum * vel[i] - lr * g[i];
    vel[i] = nv;
    if constexpr (kNesterov)
      v[i] += momentum * nv - lr * g[i];
    else
      v[i] += nv;
  }
}

// An update's lr and alpha: from its rates tensor when it has one (a captured step's, written
// before each replay), otherwise computed from lr and step (kernels.h).
kernels::StepRates rates_of(const OptimizerUpdate& u) {
  if (u.rates.defined()) {
    const double* r = u.rates.const_data<double>();
    return {r[0], r[1]};
  }
  return kernels::step_rates(u.lr, u.step, u.beta1, u.beta2);
}

// sgd_update (Keras SGD): slot1 is the velocity when momentum != 0.
template <typename T>
void sgd_one(const OptimizerUpdate& u) {
  using S = slot_t<T>;
  const S lr = static_cast<S>(rates_of(u).lr), momentum = static_cast<S>(u.momentum);
  S* vel = slot_ptr<S>(u.slot1);
  for_each_var_block<T>(u, [&](S* v, const S* g, int64_t b, int64_t n) {
    if (u.momentum == 0.0)
      sgd_block(v, g, n, lr);
    else if (u.nesterov)
      sgd_momentum_block<true>(v, g, vel + b, n, lr, momentum);
    else
      sgd_momentum_block<false>(v, g, vel + b, n, lr, momentum);
  });
}

// The float32 RMSprop and Adam blocks (below) compiled again for AVX2: their square roots and
// divisions bound them, and AVX2 does eight at a time where the baseline build does four
// (BM_OptimizerUpdate: Adam and RMSprop 1.9x faster). Without FMA on purpose: every
// operation rounds as in the baseline loop, so the updated weights do not depend on the CPU.
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
template <typename Block, typename... A>
__attribute__((target("avx2"))) void run_avx2(A... a) {
  Block::run(a...);
}
#endif

// Block::run (RmspropBlock, AdamBlock below) on the AVX2 build where the CPU has it (float32), else
// the baseline one.
template <typename Block, typename S, typename... A>
void run_best(S* var, A... rest) {
#ifdef MIXTAPE_HAVE_AVX2_VARIANTS
  if constexpr (std::is_same_v<S, float>) {
    if (has_avx2_fma()) return run_avx2<Block>(var, rest...);
  }
#endif
  Block::run(var, rest...);
}

// f.operator()<a, b>(): two run-time flags as compile-time ones.
template <typename F>
void with_flags(bool a, bool b, F&& f) {
  if (a && b)
    f.template operator()<true, true>();
  else if (a)
    f.template operator()<true, false>();
  else if (b)
    f.template operator()<false, true>();
  else
    f.template operator()<false, false>();
}

// RMSprop: ms = rho ms + (1 - rho) g^2; centered: mg = rho mg + (1 - rho) g and
// d = ms - mg^2 (clamped at 0: it is never negative but for rounding), otherwise d = ms;
// step = lr g / sqrt(d + eps) (epsilon inside the root, as Keras / TensorFlow); momentum: mom =
// momentum mom + step, var -= mom; otherwise var -= step. mg / mom are null when unused.
template <bool kCentered, bool kMomentum>
struct RmspropBlock {
  template <typename S>
  MIXTAPE_ALWAYS_INLINE static void run(S* __restrict v, const S* __restrict g, S* __restrict ms,
                                        S* __restrict mom, S* __restrict mg, int64_t n, S lr, S rho,
                                        S one_minus_rho, S eps, S momentum) {
    for (int64_t i = 0; i < n; ++i) {
      const S gi = g[i];
      const S msi = rho * ms[i] + one_minus_rho * (gi * gi);
      ms[i] = msi;
      S d = msi;
      if constexpr (kCentered) {
        const S mgi = rho * mg[i] + one_minus_rho * gi;
        mg[i] = mgi;
        const S c = msi - mgi * mgi;
        d = c < S(0) ? S(0) : c;
      }
      const S step = lr * gi / std::sqrt(d + eps);
      if constexpr (kMomentum) {
        const S mi = momentum * mom[i] + step;
        mom[i] = mi;
        v[i] -= mi;
      } else {
        v[i] -= step;
      }
    }
  }
};

// rmsprop_update (Keras RMSprop): slot1 the mean square, slot2 the momentum buffer
// (momentum > 0), slot3 the mean gradient (centered); rho arrives as beta2.
template <typename T>
void rmsprop_one(const OptimizerUpdate& u) {
  using S = slot_t<T>;
  const S lr = static_cast<S>(rates_of(u).lr), rho = static_cast<S>(u.beta2);
  const S one_minus_rho = static_cast<S>(1.0 - u.beta2), eps = static_cast<S>(u.epsilon);
  const S momentum = static_cast<S>(u.momentum);
  S* ms = slot_ptr<S>(u.slot1);
  S* mom = slot_ptr<S>(u.slot2);
  S* mg = slot_ptr<S>(u.slot3);
  const bool use_momentum = u.momentum > 0.0;
  for_each_var_block<T>(u, [&](S* v, const S* g, int64_t b, int64_t n) {
    S* m1 = ms + b;
    S* m2 = use_momentum ? mom + b : nullptr;
    S* m3 = u.centered ? mg + b : nullptr;
    with_flags(u.centered, use_momentum, [&]<bool kCentered, bool kMomentum>() {
      run_best<RmspropBlock<kCentered, kMomentum>>(v, g, m1, m2, m3, n, lr, rho, one_minus_rho, eps,
                                                   momentum);
    });
  });
}

// Adam / AdamW: var -= lr_wd * var (kDecay); m += (g - m)(1 - beta1);
// v += (g^2 - v)(1 - beta2); amsgrad: vmax = max(vmax, v); var -= alpha m / (sqrt(v |
// vmax) + eps). vmax is null when unused.
template <bool kAmsgrad, bool kDecay>
struct AdamBlock {
  template <typename S>
  MIXTAPE_ALWAYS_INLINE static void run(S* __restrict var, const S* __restrict g, S* __restrict m,
                                        S* __restrict v, S* __restrict vmax, int64_t n, S alpha,
                                        S one_minus_beta1, S one_minus_beta2, S eps, S lr_wd) {
    for (int64_t i = 0; i < n; ++i) {
      S x = var[i];
      if constexpr (kDecay) x -= lr_wd * x;
      const S gi = g[i];
      const S mi = m[i] + (gi - m[i]) * one_minus_beta1;
      m[i] = mi;
      const S vi = v[i] + (gi * gi - v[i]) * one_minus_beta2;
      v[i] = vi;
      S d = vi;
      if constexpr (kAmsgrad) {
        const S mx = vmax[i] < vi ? vi : vmax[i];
        vmax[i] = mx;
        d = mx;
      }
      var[i] = x - alpha * mi / (std::sqrt(d) + eps);
    }
  }
};

// adam_update (Keras Adam / AdamW): slot1 = m, slot2 = v, slot3 = max v (amsgrad). The
// bias corrections fold into alpha = lr sqrt(1 - beta2^step) / (1 - beta1^step), computed
// in float64 and used in the slot type.
template <typename T>
void adam_one(const OptimizerUpdate& u) {
  using S = slot_t<T>;
  const kernels::StepRates r = rates_of(u);
  const S alpha = static_cast<S>(r.alpha);
  const S omb1 = static_cast<S>(1.0 - u.beta1), omb2 = static_cast<S>(1.0 - u.beta2);
  const S eps = static_cast<S>(u.epsilon), lr_wd = static_cast<S>(r.lr * u.weight_decay);
  S* m = slot_ptr<S>(u.slot1);
  S* v = slot_ptr<S>(u.slot2);
  S* vmax = slot_ptr<S>(u.slot3);
  const bool decay = u.weight_decay != 0.0;
  for_each_var_block<T>(u, [&](S* x, const S* g, int64_t b, int64_t n) {
    S* vm = u.amsgrad ? vmax + b : nullptr;
    with_flags(u.amsgrad, decay, [&]<bool kAmsgrad, bool kDecay>() {
      run_best<AdamBlock<kAmsgrad, kDecay>>(x, g, m + b, v + b, vm, n, alpha, omb1, omb2, eps,
                                            lr_wd);
    });
  });
}

// The kernels: each update of the call in turn (they share every scalar, kernels.h).
template <typename T>
void sgd_kernel(std::span<const OptimizerUpdate> updates) {
  for (const OptimizerUpdate& u : updates) sgd_one<T>(u);
}
template <typename T>
void rmsprop_kernel(std::span<const OptimizerUpdate> updates) {
  for (const OptimizerUpdate& u : updates) rmsprop_one<T>(u);
}
template <typename T>
void adam_kernel(std::span<const OptimizerUpdate> updates) {
  for (const OptimizerUpdate& u : updates) adam_one<T>(u);
}

}  // namespace

void register_optim_kernels() {
  MIXTAPE_CPU_KERNEL(unscale_check, unscale_check_kernel);
  MIXTAPE_CPU_KERNEL(loss_scale_update, loss_scale_update_kernel);
  MIXTAPE_CPU_KERNEL(sum_squares, sum_squares_kernel);
  MIXTAPE_CPU_KERNEL(scale_list, scale_list_kernel);
  MIXTAPE_CPU_KERNEL(cast_list, cast_list_kernel);
  MIXTAPE_CPU_KERNEL(sgd_update, sgd_kernel);
  MIXTAPE_CPU_KERNEL(rmsprop_update, rmsprop_kernel);
  MIXTAPE_CPU_KERNEL(adam_update, adam_kernel);
}

}  // namespace mixtape::cpu
