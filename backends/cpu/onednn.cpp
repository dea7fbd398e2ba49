// oneDNN convolutions, pooling and bfloat16 matmul for the CPU backend (built when CMake
// found oneDNN: MIXTAPE_WITH_ONEDNN; MIXTAPE_ONEDNN=AUTO/ON/OFF).
//
// conv.cpp's float32 / bfloat16 conv2d (forward, backward input, backward weight) and
// pooling kernels call the onednn_* hooks first; a hook returns false, having written
// nothing, when the call stays on the im2col + OpenBLAS / direct paths:
//   - oneDNN is off at run time (MIXTAPE_CPU_ONEDNN=0, or set_onednn_enabled(false));
//   - the dtype is float16 or float64, or a conv asks for low_precision_accumulation
//     (the 16-bit accumulation emulation stays in conv.cpp);
//   - a dimension is 0, or the geometry is not one oneDNN can express (a window entirely
//     in the padding), or oneDNN has only a reference implementation for it;
//   - the existing kernel measured faster for that case (see prefer_existing below);
//   - bfloat16 pooling backward with overlapping windows (stride < window): mixtape sums an
//     input's contributions in float32 and rounds once; oneDNN was measured several bf16
//     ulps off there;
//   - max pooling's backward pass sees a NaN or -inf in its input: oneDNN's max skips NaNs
//     (mixtape's propagates them) and starts from -FLT_MAX (a window of -inf would give
//     -FLT_MAX). Ties go to the first maximum of the window in row-major order in both.
//     (Max pooling's forward pass is always pool.cpp's, as is its backward pass where
//     windows do not overlap: see pool.cpp.)
//
// gemm.cpp's bfloat16 matmul calls onednn_matmul_bf16 first: on CPUs with AVX512-BF16 (or
// AMX) oneDNN's matmul multiplies the bfloat16 operands natively, accumulates in float32
// and rounds each result once, the semantics of gemm.cpp's convert + sgemm + round path
// at up to twice its speed. Elsewhere (no native bf16) and for 16-bit accumulation the
// call stays on gemm.cpp.
//
// Layouts: activations are NHWC (oneDNN tag nhwc, logical dims {n, c, h, w}), filters HWIO
// [kh, kw, cin, cout] (tag hwio, logical {cout, cin, kh, kw}). The primitives take the
// activations in place (no copy) and their weights in the blocked layout oneDNN picks
// ("any"), reordered from / to HWIO on every call (the filter changes every step; the
// reorder is a few microseconds). Padding: TensorFlow's pad_top / pad_left, with the
// bottom / right padding implied by the output size (never below 0: a "valid" window
// that does not reach the last rows just leaves them out).
//
// bfloat16: oneDNN's bf16 kernels (f32 accumulation, one rounding) where the CPU has
// AVX512-BF16 (or AMX). Without it oneDNN emulates bf16 arithmetic (avx512_core: several
// times slower than its float32 kernels) or has no bf16 convolution at all (AVX2), so
// there bfloat16 tensors are converted to float32 in bulk, run through the float32
// primitive and rounded back, as conv.cpp does around sgemm.
//
// Primitives are created once per (kind, dtype, geometry) and kept in a small LRU cache
// (thread-safe). Scratchpads and reorder buffers are thread-local and grow-only, so steady
// state calls allocate nothing large. oneDNN here is Debian's OpenMP build: it runs on the
// same libgomp thread pool as OpenBLAS (libopenblas-openmp) and mixtape's own kernels.
#include <fmt/format.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "backends/cpu/cpu_backend.h"
#include "core/env.h"
#include "mixtape/core/error.h"

#ifdef MIXTAPE_WITH_ONEDNN
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstring>
#include <limits>
#include <list>
#include <memory>
#include <mutex>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mixtape/core/half.h"
#endif

namespace mixtape::cpu {
namespace {

// The run-time switch: -1 until decided (by the environment on first use, or by
// set_onednn_enabled()), then 0 (off) or 1 (on).
std::atomic<int> g_onednn{-1};

// MIXTAPE_CPU_ONEDNN, read once: unset or "1" on, "0" off; anything else throws (and is
// read again, and throws again, on the next call).
static_assert(std::string_view(detail::env::kCpuOneDnn.name) == kCpuOneDnnEnv);
bool onednn_from_environment() {
  static const bool value = detail::env::kCpuOneDnn.read();
  return value;
}

}  // namespace

// Whether this build contains the oneDNN paths.
bool onednn_available() {
#ifdef MIXTAPE_WITH_ONEDNN
  return true;
#else
  return false;
#endif
}

// The switch, read from the environment on the first call; false in builds without oneDNN.
bool onednn_enabled() {
  if (!onednn_available()) return false;
  int s = g_onednn.load(std::memory_order_acquire);
  if (s < 0) {
    int expected = -1;
    // A concurrent set_onednn_enabled() wins over the environment.
    g_onednn.compare_exchange_strong(expected, onednn_from_environment() ? 1 : 0,
                                     std::memory_order_acq_rel);
    s = g_onednn.load(std::memory_order_acquire);
  }
  return s == 1;
}

// Overrides the switch for the whole process (no effect on what a build without oneDNN
// does).
void set_onednn_enabled(bool on) { g_onednn.store(on ? 1 : 0, std::memory_order_release); }

#ifndef MIXTAPE_WITH_ONEDNN

// Without oneDNN every call stays on conv.cpp's kernels.
bool onednn_conv2d(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                   const kernels::Conv2dGeometry&) {
  return false;
}
bool onednn_conv2d_backward_input(const Tensor&, const Tensor&, const Tensor&,
                                  const kernels::Conv2dGeometry&) {
  return false;
}
bool onednn_conv2d_backward_weight(const Tensor&, const Tensor&, const Tensor&,
                                   const kernels::Conv2dGeometry&) {
  return false;
}
bool onednn_max_pool2d_backward(const Tensor&, const Tensor&, const Tensor&,
                                const kernels::Pool2dGeometry&) {
  return false;
}
bool onednn_avg_pool2d(const Tensor&, const Tensor&, const kernels::Pool2dGeometry&) {
  return false;
}
bool onednn_avg_pool2d_backward(const Tensor&, const Tensor&, const kernels::Pool2dGeometry&) {
  return false;
}
bool onednn_matmul_bf16(const GemmShape&, const void*, const void*, void*) { return false; }
bool onednn_matmul_f32(const GemmShape&, const float*, const float*, float*) { return false; }
bool onednn_matmul_bf16_to_f32(const GemmShape&, const void*, const void*, float*) { return false; }
bool onednn_native_bf16() { return false; }

#else

namespace {

#define MIXTAPE_ONEDNN_ALWAYS_INLINE inline __attribute__((always_inline))

namespace dn = dnnl;
using Dims = dn::memory::dims;
using Md = dn::memory::desc;
using Tag = dn::memory::format_tag;
using DnType = dn::memory::data_type;
using kernels::Conv2dGeometry;
using kernels::Pool2dGeometry;

// --- Engine, stream, thread-local buffers ----------------------------------------------

// The CPU engine, created on first use.
dn::engine& engine() {
  static dn::engine e(dn::engine::kind::cpu, 0);
  return e;
}

// The calling thread's stream (CPU streams execute synchronously on the caller's thread,
// whose OpenMP team runs the primitive).
dn::stream& stream() {
  thread_local dn::stream s(engine());
  return s;
}

// A grow-only, 64-byte aligned buffer.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }
  // At least n bytes (and never null).
  void* get(std::size_t n) {
    n = std::max<std::size_t>(n, 64);
    if (n > cap_) {
      release();
      ptr_ = ::operator new(n, std::align_val_t(64));
      cap_ = n;
    }
    return ptr_;
  }

 private:
  void release() {
    if (ptr_) ::operator delete(ptr_, std::align_val_t(64));
    ptr_ = nullptr;
    cap_ = 0;
  }
  void* ptr_ = nullptr;
  std::size_t cap_ = 0;
};

// Buffer slots of the calling thread.
enum Slot : int {
  kScratchpad = 0,
  kInner0 = 1,  // kInner0 + i: argument i in the primitive's layout (up to 4 arguments)
  kWide0 = 5,   // kWide0 + i: argument i converted to float32 (float16; bfloat16 without
                // AVX512-BF16)
  kWorkspace = 9,
  kPoolDst = 10,
  kSlots = 11,
};
void* buffer(int slot, std::size_t bytes) {
  thread_local Buffer slots[kSlots];
  return slots[slot].get(bytes);
}

// --- Plans: cached primitives ----------------------------------------------------------

enum class Kind : std::uint8_t {
  conv_forward,
  conv_backward_input,
  conv_backward_weight,
  max_pool_backward,
  avg_pool,
  avg_pool_backward,
  matmul,
};

// A plan's cache key: what it computes, the data type, every geometry field, whether a
// convolution adds a bias, and the OpenMP thread count it was made for (PrimitiveCache::get
// fills it in): oneDNN divides a primitive's work for the thread count of its creation (its
// own primitive cache keys on that count too), so a count that changes under load
// (threads.cpp) needs primitives of its own.
struct Key {
  Kind kind;
  DnType type;
  std::array<std::int64_t, 13> dims;
  bool bias = false;
  int threads = 0;
  bool operator==(const Key& o) const {
    return kind == o.kind && type == o.type && dims == o.dims && bias == o.bias &&
           threads == o.threads;
  }
};

// FNV-1a over the key's fields.
struct KeyHash {
  std::size_t operator()(const Key& k) const {
    std::uint64_t h = 1469598103934665603ull;
    auto mix = [&h](std::uint64_t v) {
      h ^= v;
      h *= 1099511628211ull;
    };
    mix(static_cast<std::uint64_t>(k.kind));
    mix(static_cast<std::uint64_t>(k.type));
    for (std::int64_t d : k.dims) mix(static_cast<std::uint64_t>(d));
    mix(static_cast<std::uint64_t>(k.bias));
    mix(static_cast<std::uint64_t>(k.threads));
    return static_cast<std::size_t>(h);
  }
};

// One tensor argument of a primitive: the layout of mixtape's buffer (user) and the one the
// primitive was created with (inner). When they differ, `convert` reorders user -> inner
// before the primitive (inputs) or inner -> user after it (outputs), through a thread-local
// buffer.
struct Arg {
  int id = 0;  // DNNL_ARG_*
  Md user, inner;
  bool output = false;
  bool reordered = false;
  dn::reorder convert;
};

// A primitive ready to run, with its arguments in the order of the hook's tensors (inputs,
// then the output).
struct PrimitivePlan {
  dn::primitive prim;
  std::vector<Arg> args;
  Md scratchpad;
  // max_pool_backward: the forward (training) primitive that recomputes the workspace
  // (the position of each window's maximum) from x; its dst goes to a scratch buffer.
  dn::primitive forward;
  Md forward_scratchpad, workspace, forward_dst;
};

// An LRU cache of plans (nullptr: oneDNN declined that case).
class PrimitiveCache {
 public:
  // The plan for key at the calling thread's OpenMP count, made by make() on a miss (under
  // the lock: concurrent first calls of one geometry make it once).
  template <typename Make>
  std::shared_ptr<const PrimitivePlan> get(Key key, Make&& make) {
    key.threads = omp_get_max_threads();
    std::lock_guard<std::mutex> lock(mutex_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second);
      return it->second->second;
    }
    std::shared_ptr<const PrimitivePlan> plan = make();
    lru_.emplace_front(key, plan);
    index_[key] = lru_.begin();
    if (lru_.size() > kCapacity) {
      index_.erase(lru_.back().first);
      lru_.pop_back();
    }
    return plan;
  }

 private:
  static constexpr std::size_t kCapacity = 128;
  std::mutex mutex_;
  std::list<std::pair<Key, std::shared_ptr<const PrimitivePlan> > > lru_;
  std::unordered_map<
      Key, std::list<std::pair<Key, std::shared_ptr<const PrimitivePlan> > >::iterator, KeyHash>
      index_;
};

PrimitiveCache& cache() {
  static PrimitiveCache c;
  return c;
}

// Fills in an argument from the user layout and the primitive's.
Arg make_arg(int id, const Md& user, const Md& inner, bool output) {
  Arg a;
  a.id = id;
  a.user = user;
  a.inner = inner;
  a.output = output;
  a.reordered = user != inner;
  if (a.reordered)
    a.convert = output ? dn::reorder(dn::reorder::primitive_desc(engine(), inner, engine(), user))
                       : dn::reorder(dn::reorder::primitive_desc(engine(), user, engine(), inner));
  return a;
}

// True when oneDNN chose a reference (unoptimised) implementation: the existing kernels
// are faster than those.
bool is_reference(const char* impl) { return std::string_view(impl).starts_with("ref"); }

// Runs p.prim on the tensors' buffers (ptrs in the order of p.args), reordering where
// the layouts differ.
void execute(const PrimitivePlan& p, const std::array<void*, 4>& ptrs) {
  dn::engine& eng = engine();
  dn::stream& s = stream();
  std::unordered_map<int, dn::memory> args;
  std::array<dn::memory, 4> user_mem, inner_mem;
  for (std::size_t i = 0; i < p.args.size(); ++i) {
    const Arg& a = p.args[i];
    user_mem[i] = dn::memory(a.user, eng, ptrs[i]);
    if (!a.reordered) {
      args.emplace(a.id, user_mem[i]);
      continue;
    }
    inner_mem[i] =
        dn::memory(a.inner, eng, buffer(kInner0 + static_cast<int>(i), a.inner.get_size()));
    if (!a.output) a.convert.execute(s, user_mem[i], inner_mem[i]);
    args.emplace(a.id, inner_mem[i]);
  }
  if (const std::size_t n = p.scratchpad.get_size(); n > 0)
    args.emplace(DNNL_ARG_SCRATCHPAD, dn::memory(p.scratchpad, eng, buffer(kScratchpad, n)));
  p.prim.execute(s, args);
  for (std::size_t i = 0; i < p.args.size(); ++i)
    if (p.args[i].reordered && p.args[i].output)
      p.args[i].convert.execute(s, inner_mem[i], user_mem[i]);
  s.wait();
}

// --- When the existing kernels stay ------------------------------------------------------

// bfloat16 arithmetic in hardware (AVX512-BF16 or AMX); elsewhere oneDNN's bf16
// convolutions are emulated (slow) or absent.
bool native_bf16() {
  static const bool yes = [] {
    const dn::cpu_isa isa = dn::get_effective_cpu_isa();
    return isa == dn::cpu_isa::avx512_core_bf16 || isa == dn::cpu_isa::avx512_core_amx;
  }();
  return yes;
}

// Whether oneDNN runs AVX-512 kernels here. Its float32 matmul measured faster than
// OpenBLAS's sgemm on every product of BM_CpuMatmulF32Path with them (1.1x to 1.6x), but
// with AVX2 alone (DNNL_MAX_CPU_ISA=AVX2, OPENBLAS_CORETYPE=Haswell) up to 1.5x slower on
// some of the MLP's (128 x 784 x 512, the weight gradient 128 x 2048 x 512): there a single
// float32 product stays on OpenBLAS (docs/benchmarks.md).
bool avx512() {
  static const bool yes = [] {
    const dn::cpu_isa isa = dn::get_effective_cpu_isa();
    return isa == dn::cpu_isa::avx512_core || isa == dn::cpu_isa::avx512_core_vnni ||
           isa == dn::cpu_isa::avx512_core_bf16 || isa == dn::cpu_isa::avx512_core_amx;
  }();
  return yes;
}

// The conv2d cases measured faster on conv.cpp's kernels (bench/bench_cpu_matmul.cpp,
// BM_CpuConv2dPath; docs/benchmarks.md): the float32 input gradient of a layer with at
// most 4 input channels. oneDNN's data-gradient kernels pad the input channels to a
// block of 16, so they cost as much at c = 1 as at c = 16 (about 4.4 ms at batch 128,
// 28x28, 32 -> 1 channels, against 2.8 ms for GEMM + col2im). Its bfloat16 kernels win
// there too (2.0 ms against 4.9 with the bulk conversions). Everything else measured
// faster on oneDNN, the direct loops of small first layers included (28x28, 1 -> 32:
// forward 0.45 against 0.95 ms, weight gradient 0.29 against 1.47 ms).
bool prefer_existing(Kind kind, DnType type, const Conv2dGeometry& g) {
  return kind == Kind::conv_backward_input && type == DnType::f32 && g.c <= 4;
}

// --- Convolution plans -----------------------------------------------------------------

// The bottom (right) padding implied by the output size: the least that yields `out`
// windows, at least 0. Returns false when no padding >= 0 gives `out` windows.
bool implied_pad(std::int64_t in, std::int64_t k, std::int64_t stride, std::int64_t pad_before,
                 std::int64_t out, std::int64_t& pad_after) {
  pad_after = std::max<std::int64_t>((out - 1) * stride + k - in - pad_before, 0);
  const std::int64_t span = in + pad_before + pad_after - k;
  return span >= 0 && span / stride + 1 == out;
}

Key conv_key(Kind kind, DnType type, const Conv2dGeometry& g, bool bias) {
  return Key{kind,
             type,
             {g.n, g.h, g.w, g.c, g.kh, g.kw, g.cout, g.oh, g.ow, g.stride_h, g.stride_w, g.pad_top,
              g.pad_left},
             bias};
}

// The convolution primitive of `kind` for g in `type` (nullptr when oneDNN cannot do it
// well). Arguments: forward (x, w[, bias] -> out; the bias, of `type`, added to the float32
// accumulator), backward input (grad_out, w -> grad_x), backward weight (x, grad_out ->
// grad_w).
std::shared_ptr<const PrimitivePlan> make_conv_plan(Kind kind, DnType type, const Conv2dGeometry& g,
                                                    bool bias) {
  std::int64_t pad_bottom = 0, pad_right = 0;
  if (!implied_pad(g.h, g.kh, g.stride_h, g.pad_top, g.oh, pad_bottom) ||
      !implied_pad(g.w, g.kw, g.stride_w, g.pad_left, g.ow, pad_right))
    return nullptr;
  const Dims src{g.n, g.c, g.h, g.w}, wei{g.cout, g.c, g.kh, g.kw}, dst{g.n, g.cout, g.oh, g.ow};
  const Dims strides{g.stride_h, g.stride_w}, pad_l{g.pad_top, g.pad_left},
      pad_r{pad_bottom, pad_right};
  const Md src_user(src, type, Tag::nhwc), wei_user(wei, type, Tag::hwio),
      dst_user(dst, type, Tag::nhwc);
  const Md wei_any(wei, type, Tag::any);
  const Md bias_user(Dims{g.cout}, type, Tag::x);
  dn::primitive_attr attr;
  attr.set_scratchpad_mode(dn::scratchpad_mode::user);
  const auto alg = dn::algorithm::convolution_direct;
  const bool with_bias = bias && kind == Kind::conv_forward;
  try {
    const dn::convolution_forward::primitive_desc fwd(
        with_bias
            ? dn::convolution_forward::desc(dn::prop_kind::forward_training, alg, src_user, wei_any,
                                            bias_user, dst_user, strides, pad_l, pad_r)
            : dn::convolution_forward::desc(dn::prop_kind::forward_training, alg, src_user, wei_any,
                                            dst_user, strides, pad_l, pad_r),
        attr, engine());
    auto plan = std::make_shared<PrimitivePlan>();
    if (kind == Kind::conv_forward) {
      if (is_reference(fwd.impl_info_str())) return nullptr;
      plan->prim = dn::convolution_forward(fwd);
      plan->scratchpad = fwd.scratchpad_desc();
      plan->args = {make_arg(DNNL_ARG_SRC, src_user, fwd.src_desc(), false),
                    make_arg(DNNL_ARG_WEIGHTS, wei_user, fwd.weights_desc(), false)};
      if (with_bias)
        plan->args.push_back(make_arg(DNNL_ARG_BIAS, bias_user, fwd.bias_desc(), false));
      plan->args.push_back(make_arg(DNNL_ARG_DST, dst_user, fwd.dst_desc(), true));
    } else if (kind == Kind::conv_backward_input) {
      const dn::convolution_backward_data::primitive_desc bwd(
          dn::convolution_backward_data::desc(alg, src_user, wei_any, dst_user, strides, pad_l,
                                              pad_r),
          attr, engine(), fwd);
      if (is_reference(bwd.impl_info_str())) return nullptr;
      plan->prim = dn::convolution_backward_data(bwd);
      plan->scratchpad = bwd.scratchpad_desc();
      plan->args = {make_arg(DNNL_ARG_DIFF_DST, dst_user, bwd.diff_dst_desc(), false),
                    make_arg(DNNL_ARG_WEIGHTS, wei_user, bwd.weights_desc(), false),
                    make_arg(DNNL_ARG_DIFF_SRC, src_user, bwd.diff_src_desc(), true)};
    } else {
      const dn::convolution_backward_weights::primitive_desc bwd(
          dn::convolution_backward_weights::desc(alg, src_user, wei_any, dst_user, strides, pad_l,
                                                 pad_r),
          attr, engine(), fwd);
      if (is_reference(bwd.impl_info_str())) return nullptr;
      plan->prim = dn::convolution_backward_weights(bwd);
      plan->scratchpad = bwd.scratchpad_desc();
      plan->args = {make_arg(DNNL_ARG_SRC, src_user, bwd.src_desc(), false),
                    make_arg(DNNL_ARG_DIFF_DST, dst_user, bwd.diff_dst_desc(), false),
                    make_arg(DNNL_ARG_DIFF_WEIGHTS, wei_user, bwd.diff_weights_desc(), true)};
    }
    return plan;
  } catch (const dn::error&) {
    return nullptr;  // no implementation for this case: conv.cpp's kernels take it
  }
}

// Runs a convolution of `kind` on (in0, in1[, bias] -> out; bias undefined for none, and
// only for the forward pass); false when it stays on conv.cpp.
bool run_conv(Kind kind, const Tensor& in0, const Tensor& in1, const Tensor& bias,
              const Tensor& out, const Conv2dGeometry& g) {
  const DType dt = out.dtype();
  if (dt != kFloat32 && dt != kBFloat16 && dt != kFloat16) return false;
  if (g.low_precision_accumulation && dt != kFloat32) return false;
  if (g.n <= 0 || g.h <= 0 || g.w <= 0 || g.c <= 0 || g.kh <= 0 || g.kw <= 0 || g.cout <= 0 ||
      g.oh <= 0 || g.ow <= 0 || g.stride_h <= 0 || g.stride_w <= 0 || g.pad_top < 0 ||
      g.pad_left < 0)
    return false;
  if (!onednn_enabled()) return false;
  // float16 tensors, and bfloat16 ones on CPUs without AVX512-BF16, go through float32
  // primitives, converted in bulk around the call (float32 accumulation and one rounding,
  // as conv.cpp's float16 path, whose im2col + sgemm measured about 2x slower).
  const bool widen = dt == kFloat16 || (dt == kBFloat16 && !native_bf16());
  const DnType type = dt == kFloat32 || widen ? DnType::f32 : DnType::bf16;
  if (prefer_existing(kind, type, g)) return false;
  const bool with_bias = bias.defined();
  const Key key = conv_key(kind, type, g, with_bias);
  const std::shared_ptr<const PrimitivePlan> plan =
      cache().get(key, [&] { return make_conv_plan(kind, type, g, with_bias); });
  if (!plan) return false;
  // The tensors in the order of the plan's arguments: inputs, then the output.
  std::array<const Tensor*, 4> tensors{&in0, &in1, &out, nullptr};
  if (with_bias) tensors = {&in0, &in1, &bias, &out};
  const std::size_t n_args = with_bias ? 4 : 3;
  std::array<void*, 4> ptrs{};
  for (std::size_t i = 0; i < n_args; ++i) ptrs[i] = tensors[i]->data_ptr();
  if (!widen) {
    execute(*plan, ptrs);
    return true;
  }
  for (std::size_t i = 0; i + 1 < n_args; ++i) {
    const Tensor& t = *tensors[i];
    const auto n = static_cast<std::size_t>(t.numel());
    auto* f = static_cast<float*>(buffer(kWide0 + static_cast<int>(i), n * sizeof(float)));
    if (dt == kFloat16)
      convert_half_to_float(static_cast<const half*>(t.const_data_ptr()), f, n);
    else
      convert_bfloat16_to_float(static_cast<const bfloat16*>(t.const_data_ptr()), f, n);
    ptrs[i] = f;
  }
  const auto n_out = static_cast<std::size_t>(out.numel());
  auto* f_out =
      static_cast<float*>(buffer(kWide0 + static_cast<int>(n_args - 1), n_out * sizeof(float)));
  ptrs[n_args - 1] = f_out;
  execute(*plan, ptrs);
  if (dt == kFloat16)
    convert_float_to_half(f_out, static_cast<half*>(out.data_ptr()), n_out);
  else
    convert_float_to_bfloat16(f_out, static_cast<bfloat16*>(out.data_ptr()), n_out);
  return true;
}

// --- Pooling plans ---------------------------------------------------------------------

Key pool_key(Kind kind, DnType type, const Pool2dGeometry& g) {
  return Key{kind,
             type,
             {g.n, g.h, g.w, g.c, g.kh, g.kw, g.oh, g.ow, g.stride_h, g.stride_w, g.pad_top,
              g.pad_left, 0}};
}

// The pooling primitive(s) of `kind` for g (nullptr when oneDNN cannot match mixtape's
// semantics or has only a reference implementation). Arguments: avg forward (x -> out),
// max backward (x, grad_out -> grad_x), avg backward (grad_out -> grad_x).
std::shared_ptr<const PrimitivePlan> make_pool_plan(Kind kind, DnType type,
                                                    const Pool2dGeometry& g) {
  std::int64_t pad_bottom = 0, pad_right = 0;
  if (!implied_pad(g.h, g.kh, g.stride_h, g.pad_top, g.oh, pad_bottom) ||
      !implied_pad(g.w, g.kw, g.stride_w, g.pad_left, g.ow, pad_right))
    return nullptr;
  // Every window must hold an input element (mixtape writes 0 for an all-padding window).
  if (g.pad_top >= g.kh || g.pad_left >= g.kw || pad_bottom >= g.kh || pad_right >= g.kw)
    return nullptr;
  const Dims src{g.n, g.c, g.h, g.w}, dst{g.n, g.c, g.oh, g.ow};
  const Dims strides{g.stride_h, g.stride_w}, kernel{g.kh, g.kw}, pad_l{g.pad_top, g.pad_left},
      pad_r{pad_bottom, pad_right};
  const Md src_md(src, type, Tag::nhwc), dst_md(dst, type, Tag::nhwc);
  const bool is_max = kind == Kind::max_pool_backward;
  const auto alg = is_max ? dn::algorithm::pooling_max : dn::algorithm::pooling_avg_exclude_padding;
  const bool backward = kind == Kind::max_pool_backward || kind == Kind::avg_pool_backward;
  dn::primitive_attr attr;
  attr.set_scratchpad_mode(dn::scratchpad_mode::user);
  try {
    const dn::pooling_forward::primitive_desc fwd(
        dn::pooling_forward::desc(
            backward ? dn::prop_kind::forward_training : dn::prop_kind::forward_inference, alg,
            src_md, dst_md, strides, kernel, pad_l, pad_r),
        attr, engine());
    if (is_reference(fwd.impl_info_str())) return nullptr;
    auto plan = std::make_shared<PrimitivePlan>();
    if (!backward) {
      plan->prim = dn::pooling_forward(fwd);
      plan->scratchpad = fwd.scratchpad_desc();
      plan->args = {make_arg(DNNL_ARG_SRC, src_md, src_md, false),
                    make_arg(DNNL_ARG_DST, dst_md, dst_md, true)};
      return plan;
    }
    const dn::pooling_backward::primitive_desc bwd(
        dn::pooling_backward::desc(alg, src_md, dst_md, strides, kernel, pad_l, pad_r), attr,
        engine(), fwd);
    if (is_reference(bwd.impl_info_str())) return nullptr;
    plan->prim = dn::pooling_backward(bwd);
    plan->scratchpad = bwd.scratchpad_desc();
    plan->args = {make_arg(DNNL_ARG_DIFF_DST, dst_md, dst_md, false),
                  make_arg(DNNL_ARG_DIFF_SRC, src_md, src_md, true)};
    if (is_max) {
      plan->forward = dn::pooling_forward(fwd);
      plan->forward_scratchpad = fwd.scratchpad_desc();
      plan->workspace = fwd.workspace_desc();
      plan->forward_dst = dst_md;
    }
    return plan;
  } catch (const dn::error&) {
    return nullptr;
  }
}

// Whether n values hold a NaN or -inf (where oneDNN's max pooling differs from mixtape's):
// !(v > -inf) is true exactly for those, one compare per element. The scan reads x once
// more than the pooling; it runs on the OpenMP team, in an AVX2 build where the CPU has it.
template <typename T>
MIXTAPE_ONEDNN_ALWAYS_INLINE bool scan_impl(const T* p, std::int64_t n) {
  int bad = 0;
#pragma omp parallel for simd reduction(| : bad) schedule(static) if (n > 4 * kParallelGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      bad |= static_cast<int>(!(p[i] > -std::numeric_limits<float>::infinity()));
    } else {  // bfloat16 bits: NaN (exponent all ones, mantissa not 0), or -inf
      const std::uint16_t v = p[i];
      bad |= static_cast<int>(((v & 0x7fff) > 0x7f80) | (v == 0xff80));
    }
  }
  return bad != 0;
}
template <typename T>
bool scan_baseline(const T* p, std::int64_t n) {
  return scan_impl(p, n);
}
#if defined(__x86_64__) && defined(__GNUC__)
template <typename T>
__attribute__((target("avx2"))) bool scan_avx2(const T* p, std::int64_t n) {
  return scan_impl(p, n);
}
#endif
template <typename T>
bool has_nan_or_minus_inf(const T* p, std::int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2) return scan_avx2(p, n);
#endif
  return scan_baseline(p, n);
}

// The plan for a pooling call, or nullptr when it stays on conv.cpp.
// float16 goes through float32 primitives (widened below).
std::shared_ptr<const PrimitivePlan> pool_plan(Kind kind, const Tensor& t,
                                               const Pool2dGeometry& g) {
  const DType dt = t.dtype();
  if (dt != kFloat32 && dt != kBFloat16 && dt != kFloat16) return nullptr;
  if (g.n <= 0 || g.h <= 0 || g.w <= 0 || g.c <= 0 || g.kh <= 0 || g.kw <= 0 || g.oh <= 0 ||
      g.ow <= 0 || g.stride_h <= 0 || g.stride_w <= 0 || g.pad_top < 0 || g.pad_left < 0)
    return nullptr;
  if (!onednn_enabled()) return nullptr;
  const DnType type = dt == kBFloat16 ? DnType::bf16 : DnType::f32;
  // Overlapping windows add several contributions into one input gradient. mixtape sums
  // them in float32 and rounds once; oneDNN's bf16 pooling backward measured errors of
  // several bf16 ulps there (3x3 / 1), as if it rounded after each contribution.
  const bool backward = kind == Kind::max_pool_backward || kind == Kind::avg_pool_backward;
  if (backward && type == DnType::bf16 && (g.stride_h < g.kh || g.stride_w < g.kw)) return nullptr;
  return cache().get(pool_key(kind, type, g), [&] { return make_pool_plan(kind, type, g); });
}

// Whether x holds a value where oneDNN's max differs from mixtape's (x: float32 or
// bfloat16 data).
bool max_pool_unsafe(const void* x, DType dt, std::int64_t n) {
  if (dt == kBFloat16) return has_nan_or_minus_inf(static_cast<const std::uint16_t*>(x), n);
  return has_nan_or_minus_inf(static_cast<const float*>(x), n);
}

// A pooling argument as the primitive sees it: the tensor's data, or for float16 a float32
// copy in buffer slot kWide0 + i (inputs converted here, outputs by `store`).
// (The pooling hooks have one output, their last argument.)
class PoolData {
 public:
  explicit PoolData(std::initializer_list<const Tensor*> ts)
      : wide_((*ts.begin())->dtype() == kFloat16), count_(ts.size()) {
    dtype = wide_ ? kFloat32 : (*ts.begin())->dtype();
    std::size_t i = 0;
    for (const Tensor* t : ts) {
      tensors_[i] = t;
      ptrs[i] = t->data_ptr();
      if (wide_) {
        const auto n = static_cast<std::size_t>(t->numel());
        auto* f = static_cast<float*>(buffer(kWide0 + static_cast<int>(i), n * sizeof(float)));
        if (i + 1 < count_)
          convert_half_to_float(static_cast<const half*>(t->const_data_ptr()), f, n);
        ptrs[i] = f;
      }
      ++i;
    }
  }
  // Converts the output back to float16 (after the primitive ran).
  void store() const {
    if (!wide_) return;
    const Tensor& out = *tensors_[count_ - 1];
    convert_float_to_half(static_cast<const float*>(ptrs[count_ - 1]),
                          static_cast<half*>(out.data_ptr()),
                          static_cast<std::size_t>(out.numel()));
  }

  DType dtype;  // the primitive's: float32 for float16 tensors
  std::array<void*, 3> ptrs{};

 private:
  bool wide_;
  std::size_t count_;
  std::array<const Tensor*, 3> tensors_{};
};

// --- Matmul plans ----------------------------------------------------------------------

// dst_f32: a float32 result of bfloat16 operands (the fused linear op's, rounded after its
// epilogue).
Key gemm_key(const GemmShape& g, DnType type, bool dst_f32 = false) {
  return Key{Kind::matmul,
             type,
             {g.batch, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.sa, g.sb, g.sc,
              (g.ta ? 1 : 0) | (g.tb ? 2 : 0), dst_f32 ? 1 : 0, 0}};
}

// The memory descriptor of a row-major [batch, rows, cols] operand stored with leading
// dimension ld (transposed: stored [cols, rows]) and batch stride bs (0: shared, which
// oneDNN takes as a batch dimension of 1 broadcast over the other operand's batch).
Md matrix_md(DnType type, std::int64_t batch, std::int64_t rows, std::int64_t cols, bool transposed,
             std::int64_t ld, std::int64_t bs) {
  const bool shared = bs == 0;
  const std::int64_t span = (transposed ? cols : rows) * ld;  // one matrix, in elements
  const Dims dims{shared ? 1 : batch, rows, cols};
  const Dims strides{shared ? span : bs, transposed ? 1 : ld, transposed ? ld : 1};
  return Md(dims, type, strides);
}

// The matmul primitive of `type` operands for g, its result in `dst` (nullptr when oneDNN has
// only a reference implementation for these layouts, or cannot take them).
std::shared_ptr<const PrimitivePlan> make_gemm_plan(const GemmShape& g, DnType type, DnType dst) {
  // Both operands shared by a batch > 1: every item is the same product; gemm.cpp's loop
  // takes that rare case.
  if (g.batch > 1 && g.sa == 0 && g.sb == 0) return nullptr;
  const std::int64_t sa = g.batch > 1 ? g.sa : 0, sb = g.batch > 1 ? g.sb : 0;
  const Md a = matrix_md(type, g.batch, g.m, g.k, g.ta, g.lda, sa);
  const Md b = matrix_md(type, g.batch, g.k, g.n, g.tb, g.ldb, sb);
  const Md c(Dims{g.batch, g.m, g.n}, dst, Dims{g.batch > 1 ? g.sc : g.m * g.ldc, g.ldc, 1});
  dn::primitive_attr attr;
  attr.set_scratchpad_mode(dn::scratchpad_mode::user);
  try {
    const dn::matmul::primitive_desc pd(dn::matmul::desc(a, b, c), attr, engine());
    if (is_reference(pd.impl_info_str())) return nullptr;
    auto plan = std::make_shared<PrimitivePlan>();
    plan->prim = dn::matmul(pd);
    plan->scratchpad = pd.scratchpad_desc();
    plan->args = {make_arg(DNNL_ARG_SRC, a, a, false), make_arg(DNNL_ARG_WEIGHTS, b, b, false),
                  make_arg(DNNL_ARG_DST, c, c, true)};
    return plan;
  } catch (const dn::error&) {
    return nullptr;
  }
}

}  // namespace

// --- The hooks (cpu_backend.h) -----------------------------------------------------------

bool onednn_native_bf16() { return native_bf16(); }

bool onednn_matmul_bf16(const GemmShape& g, const void* a, const void* b, void* c) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0 || g.k <= 0) return false;
  if (!onednn_enabled() || !native_bf16()) return false;
  const std::shared_ptr<const PrimitivePlan> plan = cache().get(
      gemm_key(g, DnType::bf16), [&] { return make_gemm_plan(g, DnType::bf16, DnType::bf16); });
  if (!plan) return false;
  execute(*plan, {const_cast<void*>(a), const_cast<void*>(b), c});
  return true;
}

bool onednn_matmul_bf16_to_f32(const GemmShape& g, const void* a, const void* b, float* c) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0 || g.k <= 0) return false;
  if (!onednn_enabled() || !native_bf16()) return false;
  const std::shared_ptr<const PrimitivePlan> plan =
      cache().get(gemm_key(g, DnType::bf16, true),
                  [&] { return make_gemm_plan(g, DnType::bf16, DnType::f32); });
  if (!plan) return false;
  execute(*plan, {const_cast<void*>(a), const_cast<void*>(b), c});
  return true;
}

bool onednn_matmul_f32(const GemmShape& g, const float* a, const float* b, float* c) {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0 || g.k <= 0) return false;
  if (!onednn_enabled() || (g.batch == 1 && !avx512())) return false;
  const std::shared_ptr<const PrimitivePlan> plan = cache().get(
      gemm_key(g, DnType::f32), [&] { return make_gemm_plan(g, DnType::f32, DnType::f32); });
  if (!plan) return false;
  execute(*plan, {const_cast<float*>(a), const_cast<float*>(b), c});
  return true;
}

bool onednn_conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                   const Conv2dGeometry& g) {
  return run_conv(Kind::conv_forward, x, w, bias, out, g);
}

bool onednn_conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                                  const Conv2dGeometry& g) {
  return run_conv(Kind::conv_backward_input, grad_out, w, Tensor(), grad_x, g);
}

bool onednn_conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                                   const Conv2dGeometry& g) {
  return run_conv(Kind::conv_backward_weight, x, grad_out, Tensor(), grad_w, g);
}

bool onednn_max_pool2d_backward(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                                const Pool2dGeometry& g) {
  const auto plan = pool_plan(Kind::max_pool_backward, x, g);
  if (!plan) return false;
  const PoolData d({&x, &grad_out, &grad_x});
  if (max_pool_unsafe(d.ptrs[0], d.dtype, x.numel())) return false;
  // The forward pass again, for the workspace (each window's argmax), then the scatter.
  dn::engine& eng = engine();
  dn::stream& s = stream();
  const std::size_t ws_bytes = plan->workspace.get_size();
  const std::size_t dst_bytes = plan->forward_dst.get_size();
  const std::size_t scratch_bytes =
      std::max(plan->forward_scratchpad.get_size(), plan->scratchpad.get_size());
  void* scratch = buffer(kScratchpad, scratch_bytes);
  dn::memory ws(plan->workspace, eng, buffer(kWorkspace, ws_bytes));
  std::unordered_map<int, dn::memory> fwd_args{
      {DNNL_ARG_SRC, dn::memory(plan->args[1].user, eng, d.ptrs[0])},
      {DNNL_ARG_DST, dn::memory(plan->forward_dst, eng, buffer(kPoolDst, dst_bytes))},
      {DNNL_ARG_WORKSPACE, ws}};
  if (plan->forward_scratchpad.get_size() > 0)
    fwd_args.emplace(DNNL_ARG_SCRATCHPAD, dn::memory(plan->forward_scratchpad, eng, scratch));
  plan->forward.execute(s, fwd_args);
  std::unordered_map<int, dn::memory> bwd_args{
      {DNNL_ARG_DIFF_DST, dn::memory(plan->args[0].user, eng, d.ptrs[1])},
      {DNNL_ARG_DIFF_SRC, dn::memory(plan->args[1].user, eng, d.ptrs[2])},
      {DNNL_ARG_WORKSPACE, ws}};
  if (plan->scratchpad.get_size() > 0)
    bwd_args.emplace(DNNL_ARG_SCRATCHPAD, dn::memory(plan->scratchpad, eng, scratch));
  plan->prim.execute(s, bwd_args);
  s.wait();
  d.store();
  return true;
}

bool onednn_avg_pool2d(const Tensor& x, const Tensor& out, const Pool2dGeometry& g) {
  const auto plan = pool_plan(Kind::avg_pool, x, g);
  if (!plan) return false;
  const PoolData d({&x, &out});
  execute(*plan, {d.ptrs[0], d.ptrs[1], nullptr});
  d.store();
  return true;
}

bool onednn_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x,
                                const Pool2dGeometry& g) {
  const auto plan = pool_plan(Kind::avg_pool_backward, grad_out, g);
  if (!plan) return false;
  const PoolData d({&grad_out, &grad_x});
  execute(*plan, {d.ptrs[0], d.ptrs[1], nullptr});
  d.store();
  return true;
}

#endif  // MIXTAPE_WITH_ONEDNN

}  // namespace mixtape::cpu
