// CUDA conv2d kernels (kernels::Conv2dFn, Conv2dBackwardInputFn, Conv2dBackwardWeightFn),
// through cuDNN 9's convolution API (cudnnConvolutionForward / BackwardData /
// BackwardFilter, in libcudnn_cnn, reached through libcudnn's loader) when the library is
// built with cuDNN (MIXTAPE_WITH_CUDNN), on the direct kernels of conv_kernels.cu otherwise.
// The three passes are one routine (conv_pass): the same preamble, layout, plan, call and
// fallback, with the pass's own buffers.
//
// Layouts. Activations are NHWC, which cuDNN takes as is (CUDNN_TENSOR_NHWC descriptors).
// Filters are HWIO [kh, kw, cin, cout]; cuDNN's NHWC filter layout is KRSC [cout, kh, kw,
// cin], the transpose of the HWIO filter viewed as a [kh*kw*cin, cout] matrix. So the
// filter is transposed into a workspace before forward and backward-data, and the weight
// gradient is computed as KRSC into a workspace and transposed back (conv_kernels.cu).
//
// Padding. Conv2dGeometry gives pad_top / pad_left; the bottom / right padding is whatever
// the output size implies, and may differ from the top / left one (TensorFlow's 'same' puts
// the odd element at the bottom / right) or be negative (input rows no window reaches).
// cuDNN's legacy API only takes one symmetric padding per axis, with the output extent
// floor((in + 2 pad - k) / stride) + 1. Output position o's window starts at
// o * stride - pad in both conventions, so when that formula with pad = pad_top (pad_left)
// gives exactly oh (ow), cuDNN with symmetric padding computes exactly our convolution (its
// extra bottom padding only adds zeros, or windows we do not ask for do not exist). That is
// the common case (symmetric 'same', every 'valid'). Otherwise the input is zero-padded
// explicitly into a workspace of extent ((oh - 1) * stride_h + kh) x ((ow - 1) * stride_w +
// kw), the exact extent the windows cover, and cuDNN runs unpadded on it: forward and
// backward-weight read the padded input; backward-data writes the padded input's gradient,
// which is cropped back (the adjoint of the padding; input positions no window reaches get
// 0). The cost is one copy of the input (or of its gradient) per call, for asymmetric
// geometries only.
//
// Precision. float32 runs with CUDNN_FMA_MATH (no TF32) unless mixtape::cuda::allow_tf32(),
// then CUDNN_DEFAULT_MATH; float16 and bfloat16 with float32 compute (PSEUDO_HALF /
// PSEUDO_BFLOAT16 configurations) and CUDNN_TENSOR_OP_MATH. Not through cuDNN:
//   - float16 / bfloat16 with low_precision_accumulation (MIXTAPE_FP16_USE_FP32_COMPUTE=0):
//     the direct kernels of conv_kernels.cu, rounding the accumulator to the 16-bit type
//     after every multiply-add in the CPU emulation's order (bit-exact with the CPU; cuDNN's
//     TRUE_HALF configuration makes no such promise, and bfloat16 has no 16-bit one);
//   - float64: the same direct kernels with float64 accumulation (exact order, no
//     library-dependent algorithms; slow, meant for checks rather than training);
//   - what cuDNN refuses (a NOT_SUPPORTED status, or no algorithm found; logged once per
//     geometry) or does not fit its int32 extents: the direct kernels with float32
//     accumulation.
//
// Algorithms. Per device: one cuDNN handle on the device's stream (created on first use,
// used by one thread at a time under a mutex) and a cache of plans by direction, dtype,
// geometry, math mode and pointer alignment: the descriptors and the algorithm that
// cudnnFind*AlgorithmEx measured fastest on the first call (a host-blocking benchmark, once
// per plan), with its math type and workspace size. Workspaces come from the caching
// allocator for each call.
//
// The passes, as kernels::Conv2d*Fn take their tensors (a, b -> out):
//   Forward         x,  w  -> y
//   BackwardData    dy, w  -> dx
//   BackwardFilter  x,  dy -> dw
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#ifdef MIXTAPE_WITH_CUDNN
#include <cudnn.h>
#endif

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/elem.h"
#include "backends/cuda/gemm_conv_kernels.h"
#include "backends/cuda/plan_cache.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/cuda.h"
#include "mixtape/core/error.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cuda_backend {
namespace {

using kernels::Conv2dGeometry;
using std::int64_t;

// --- The passes ------------------------------------------------------------------------------

enum class Direction { Forward = 0, BackwardData = 1, BackwardFilter = 2 };

constexpr int64_t kInt32Max = std::numeric_limits<std::int32_t>::max();

ConvShape shape_of(const Conv2dGeometry& g) {
  ConvShape s;
  s.n = g.n, s.h = g.h, s.w = g.w, s.c = g.c;
  s.kh = g.kh, s.kw = g.kw, s.cout = g.cout;
  s.oh = g.oh, s.ow = g.ow;
  s.sh = g.stride_h, s.sw = g.stride_w;
  s.pad_top = g.pad_top, s.pad_left = g.pad_left;
  return s;
}

void zero_fill(const Tensor& t, cudaStream_t st) {
  MIXTAPE_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), st));
}

// --- How cuDNN sees the geometry (see "Padding" at the top) --------------------------------

struct CudnnLayout {
  bool padded = false;           // the input is zero-padded explicitly into a workspace
  int64_t hin = 0, win = 0;      // the input extent cuDNN sees
  int64_t pad_h = 0, pad_w = 0;  // cuDNN's (symmetric) padding
};

// Whether cuDNN's symmetric padding `pad` gives exactly `out` output positions.
bool symmetric_fits(int64_t in, int64_t k, int64_t stride, int64_t pad, int64_t out) {
  const int64_t span = in + 2 * pad - k;
  return span >= 0 && span / stride + 1 == out;
}

CudnnLayout cudnn_layout(const Conv2dGeometry& g) {
  CudnnLayout l;
  if (symmetric_fits(g.h, g.kh, g.stride_h, g.pad_top, g.oh) &&
      symmetric_fits(g.w, g.kw, g.stride_w, g.pad_left, g.ow)) {
    l.hin = g.h, l.win = g.w, l.pad_h = g.pad_top, l.pad_w = g.pad_left;
  } else {
    l.padded = true;
    l.hin = (g.oh - 1) * g.stride_h + g.kh;
    l.win = (g.ow - 1) * g.stride_w + g.kw;
  }
  return l;
}

// Whether every extent and tensor size fits cuDNN's int32 arguments.
bool fits_cudnn(const Conv2dGeometry& g, const CudnnLayout& l) {
  const int64_t dims[] = {g.n,  g.c,  l.hin,      l.win,      g.kh,    g.kw,   g.cout,
                          g.oh, g.ow, g.stride_h, g.stride_w, l.pad_h, l.pad_w};
  for (int64_t d : dims)
    if (d > kInt32Max) return false;
  // Element counts, computed in double against overflow.
  const double x = double(g.n) * double(l.hin) * double(l.win) * double(g.c);
  const double y = double(g.n) * double(g.oh) * double(g.ow) * double(g.cout);
  const double w = double(g.kh) * double(g.kw) * double(g.c) * double(g.cout);
  return x <= double(kInt32Max) && y <= double(kInt32Max) && w <= double(kInt32Max);
}

// How a call runs when cuDNN does not: the 16-bit emulation, float64, or a problem cuDNN
// cannot take.
bool direct_only(DType dt, const Conv2dGeometry& g, Accumulation* acc) {
  if (dt.is_reduced_float() && g.low_precision_accumulation) {
    *acc = Accumulation::Round16;
    return true;
  }
  *acc = Accumulation::Wide;
  return dt == kFloat64 || !fits_cudnn(g, cudnn_layout(g));
}

// The direct kernel of a pass.
void run_direct(Direction dir, DType dt, Accumulation acc, const ConvShape& s, const void* a,
                const void* b, void* out, cudaStream_t st) {
  switch (dir) {
    case Direction::Forward:
      return conv_direct_forward(elem_of(dt), acc, s, a, b, out, st);
    case Direction::BackwardData:
      return conv_direct_backward_input(elem_of(dt), acc, s, a, b, out, st);
    case Direction::BackwardFilter:
      return conv_direct_backward_weight(elem_of(dt), acc, s, a, b, out, st);
  }
}

#ifdef MIXTAPE_WITH_CUDNN

const char* direction_name(Direction d) {
  switch (d) {
    case Direction::Forward:
      return "conv2d";
    case Direction::BackwardData:
      return "conv2d_backward_input";
    case Direction::BackwardFilter:
      return "conv2d_backward_weight";
  }
  return "conv2d";
}

std::string describe(const Conv2dGeometry& g) {
  return fmt::format("n {} h {} w {} c {} window {}x{} cout {} stride {}x{} pad {},{} out {}x{}",
                     g.n, g.h, g.w, g.c, g.kh, g.kw, g.cout, g.stride_h, g.stride_w, g.pad_top,
                     g.pad_left, g.oh, g.ow);
}

// --- Errors ------------------------------------------------------------------------------

std::string cudnn_message(cudnnStatus_t status) {
  char detail[1024] = {};
  cudnnGetLastErrorString(detail, sizeof(detail));
  if (detail[0] == '\0') return cudnnGetErrorString(status);
  return fmt::format("{} ({})", cudnnGetErrorString(status), detail);
}

[[noreturn]] void throw_cudnn_error(cudnnStatus_t status, const char* what, const char* file,
                                    int line) {
  throw DeviceError(fmt::format("{} failed at {}:{}: {}", what, file, line, cudnn_message(status)));
}
inline void check_cudnn(cudnnStatus_t status, const char* what, const char* file, int line) {
  if (status != CUDNN_STATUS_SUCCESS) throw_cudnn_error(status, what, file, line);
}

// Every cuDNN call goes through this: MIXTAPE_CUDNN_CHECK(cudnnCreate(&handle)).
#define MIXTAPE_CUDNN_CHECK(call) check_cudnn((call), #call, __FILE__, __LINE__)

// A status by which cuDNN declines a problem (rather than failing at it).
bool is_refusal(cudnnStatus_t status) {
  return CUDNN_STATUS_CATEGORY(status) == CUDNN_STATUS_NOT_SUPPORTED;
}

// Workspace offered to cudnnFind*AlgorithmEx (and so the most a chosen algorithm may use).
constexpr std::size_t kMaxConvWorkspace = std::size_t{256} << 20;

cudnnDataType_t cudnn_type(DType dt) {
  if (dt == kFloat16) return CUDNN_DATA_HALF;
  if (dt == kBFloat16) return CUDNN_DATA_BFLOAT16;
  return CUDNN_DATA_FLOAT;
}

// --- Handles and plans -------------------------------------------------------------------------

// One direction of one geometry: the descriptors and the algorithm.
struct ConvPlan {
  // false: cuDNN refused (at the Find, or later at an execution); the direct kernels run it.
  // Mutable: an execution that is refused turns it off (under the context's mutex).
  mutable bool use_cudnn = false;
  // x: the input as cuDNN sees it; y: the output; w: the filter (KRSC).
  Owned<cudnnTensorDescriptor_t, cudnnDestroyTensorDescriptor> x, y;
  Owned<cudnnFilterDescriptor_t, cudnnDestroyFilterDescriptor> w;
  Owned<cudnnConvolutionDescriptor_t, cudnnDestroyConvolutionDescriptor> conv;
  int algo = 0;  // a cudnnConvolution{Fwd,BwdData,BwdFilter}Algo_t
  std::size_t workspace = 0;
};

struct CudnnContext {
  std::mutex mutex;  // a cuDNN handle serves one thread at a time; also guards `plans`
  cudnnHandle_t handle = nullptr;
  PlanCache<ConvPlan> plans;
};

// The context of `device`, its handle created on first use (on the device's stream).
// Contexts are never destroyed (kernels may run during static destruction).
CudnnContext& cudnn_context(int device) {
  static std::mutex mutex;
  static auto* contexts = new std::vector<std::unique_ptr<CudnnContext>>();
  std::lock_guard<std::mutex> lock(mutex);
  if (contexts->size() <= static_cast<std::size_t>(device))
    contexts->resize(static_cast<std::size_t>(device) + 1);
  auto& ctx = (*contexts)[static_cast<std::size_t>(device)];
  if (!ctx) ctx = std::make_unique<CudnnContext>();
  if (!ctx->handle) {
    DeviceGuard guard(device);
    cudnnHandle_t handle = nullptr;
    MIXTAPE_CUDNN_CHECK(cudnnCreate(&handle));
    const cudnnStatus_t status = cudnnSetStream(handle, stream(device));
    if (status != CUDNN_STATUS_SUCCESS) {
      cudnnDestroy(handle);
      throw_cudnn_error(status, "cudnnSetStream(handle, stream(device))", __FILE__, __LINE__);
    }
    ctx->handle = handle;
  }
  return *ctx;
}

// The buffers of one call, in the order of the direction's cuDNN function:
//   Forward         in0 = x,  in1 = w (KRSC), out = y
//   BackwardData    in0 = w,  in1 = dy,       out = dx
//   BackwardFilter  in0 = x,  in1 = dy,       out = dw (KRSC)
struct Buffers {
  const void* in0;
  const void* in1;
  void* out;
};

// --- One cuDNN pass description per direction ------------------------------------------------

// cuDNN's scaling factors (alpha, beta) of an execution: out = 1 * conv(in0, in1) + 0 * out.
constexpr float kOne = 1.0f, kZero = 0.0f;

// The cuDNN functions of a direction. Each takes the plan's descriptors in the order of that
// direction's functions (the descriptors of in0, in1, out in Buffers), named here by the
// member pointers d0, d1, d2:
//   Forward         x, w, y  (cudnn*ConvolutionForward*)
//   BackwardData    w, y, x  (cudnn*ConvolutionBackwardData*)
//   BackwardFilter  x, y, w  (cudnn*ConvolutionBackwardFilter*)
// Perf is the direction's Find result, max_count the number of results its Find may return,
// find its cudnnFind*AlgorithmEx (the candidate algorithms run on `buf`), workspace_size the
// workspace of an algorithm, execute the pass itself (kExecute names it).
template <typename PerfT, typename AlgoT, auto kMaxCount, auto kFind, auto kWorkspace, auto kRun,
          auto d0, auto d1, auto d2>
struct CudnnPassOf {
  using Perf = PerfT;
  using Algo = AlgoT;
  static int max_count(const CudnnContext& ctx) {
    int count = 0;
    MIXTAPE_CUDNN_CHECK(kMaxCount(ctx.handle, &count));
    return count;
  }
  static cudnnStatus_t find(const CudnnContext& ctx, const ConvPlan& plan, const Buffers& buf,
                            int count, int* returned, Perf* perf, void* scratch,
                            std::size_t limit) {
    return kFind(ctx.handle, plan.*d0, buf.in0, plan.*d1, buf.in1, plan.conv, plan.*d2, buf.out,
                 count, returned, perf, scratch, limit);
  }
  static cudnnStatus_t workspace_size(const CudnnContext& ctx, const ConvPlan& plan, int algo,
                                      std::size_t* bytes) {
    return kWorkspace(ctx.handle, plan.*d0, plan.*d1, plan.conv, plan.*d2, static_cast<Algo>(algo),
                      bytes);
  }
  static cudnnStatus_t execute(const CudnnContext& ctx, const ConvPlan& plan, const Buffers& buf,
                               void* workspace) {
    return kRun(ctx.handle, &kOne, plan.*d0, buf.in0, plan.*d1, buf.in1, plan.conv,
                static_cast<Algo>(plan.algo), workspace, plan.workspace, &kZero, plan.*d2, buf.out);
  }
};

template <Direction>
struct CudnnPass;

// The pass of Direction::dir: cuDNN names its functions cudnn*Convolution<dir>* and their
// types cudnnConvolution<abbrev>Algo*_t; d0, d1, d2 are the plan's descriptors in the order
// those functions take them.
#define MIXTAPE_CUDNN_PASS(dir, abbrev, d0, d1, d2)                                                \
  template <>                                                                                      \
  struct CudnnPass<Direction::dir>                                                                 \
      : CudnnPassOf<cudnnConvolution##abbrev##AlgoPerf_t, cudnnConvolution##abbrev##Algo_t,        \
                    cudnnGetConvolution##dir##AlgorithmMaxCount,                                   \
                    cudnnFindConvolution##dir##AlgorithmEx,                                        \
                    cudnnGetConvolution##dir##WorkspaceSize, cudnnConvolution##dir, &ConvPlan::d0, \
                    &ConvPlan::d1, &ConvPlan::d2> {                                                \
    static constexpr const char* kExecute = "cudnnConvolution" #dir;                               \
  }
MIXTAPE_CUDNN_PASS(Forward, Fwd, x, w, y);
MIXTAPE_CUDNN_PASS(BackwardData, BwdData, w, y, x);
MIXTAPE_CUDNN_PASS(BackwardFilter, BwdFilter, x, y, w);
#undef MIXTAPE_CUDNN_PASS

// f(CudnnPass<dir>{}): the one place a Direction picks its cuDNN functions.
template <typename F>
decltype(auto) with_pass(Direction dir, F&& f) {
  if (dir == Direction::Forward) return f(CudnnPass<Direction::Forward>{});
  if (dir == Direction::BackwardData) return f(CudnnPass<Direction::BackwardData>{});
  return f(CudnnPass<Direction::BackwardFilter>{});
}

// --- Making a plan ---------------------------------------------------------------------------

// The first (fastest) usable result of a Find: succeeded, within the workspace offered, of
// an allowed math type, and deterministic where one is (non-deterministic algorithms, such
// as backward-filter ones that add partial sums atomically into a 16-bit output, may round
// more than once and differ from run to run; they are taken only when nothing else runs).
// CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION (down-conversion to float16) is never used. float32
// without TF32 (`strict`) takes only results found with CUDNN_FMA_MATH: a result measured
// under another math type may exist only as a TF32 kernel, which an FMA_MATH descriptor
// then refuses at execution. The other configurations run with the result's math type.
template <typename Perf>
const Perf* pick(const std::vector<Perf>& perf, int returned, std::size_t limit, bool strict) {
  for (const bool deterministic_only : {true, false}) {
    for (int i = 0; i < returned; ++i) {
      const Perf& p = perf[static_cast<std::size_t>(i)];
      if (p.status != CUDNN_STATUS_SUCCESS || p.memory > limit) continue;
      if (p.mathType == CUDNN_TENSOR_OP_MATH_ALLOW_CONVERSION) continue;
      if (strict && p.mathType != CUDNN_FMA_MATH) continue;
      if (deterministic_only && p.determinism != CUDNN_DETERMINISTIC) continue;
      return &p;
    }
  }
  return nullptr;
}

// A plan with its descriptors (x, y, w and the convolution, with the math type the Find is
// asked for), and no algorithm yet.
std::unique_ptr<ConvPlan> describe_plan(Direction dir, DType dt, cudnnMathType_t requested,
                                        const Conv2dGeometry& g, const CudnnLayout& l) {
  auto plan = std::make_unique<ConvPlan>();
  const cudnnDataType_t type = cudnn_type(dt);
  const auto i32 = [](int64_t v) { return static_cast<int>(v); };
  MIXTAPE_CUDNN_CHECK(cudnnCreateTensorDescriptor(plan->x.out()));
  MIXTAPE_CUDNN_CHECK(cudnnCreateTensorDescriptor(plan->y.out()));
  MIXTAPE_CUDNN_CHECK(cudnnCreateFilterDescriptor(plan->w.out()));
  MIXTAPE_CUDNN_CHECK(cudnnCreateConvolutionDescriptor(plan->conv.out()));
  // Dimensions are given as (n, c, h, w) whatever the memory format.
  MIXTAPE_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->x, CUDNN_TENSOR_NHWC, type, i32(g.n),
                                                 i32(g.c), i32(l.hin), i32(l.win)));
  MIXTAPE_CUDNN_CHECK(cudnnSetTensor4dDescriptor(plan->y, CUDNN_TENSOR_NHWC, type, i32(g.n),
                                                 i32(g.cout), i32(g.oh), i32(g.ow)));
  MIXTAPE_CUDNN_CHECK(cudnnSetFilter4dDescriptor(plan->w, type, CUDNN_TENSOR_NHWC, i32(g.cout),
                                                 i32(g.c), i32(g.kh), i32(g.kw)));
  MIXTAPE_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(plan->conv, i32(l.pad_h), i32(l.pad_w),
                                                      i32(g.stride_h), i32(g.stride_w), 1, 1,
                                                      CUDNN_CROSS_CORRELATION, CUDNN_DATA_FLOAT));
  MIXTAPE_CUDNN_CHECK(cudnnSetConvolutionMathType(plan->conv, requested));

  // cuDNN's output extent must be ours (the layout is built so); a mismatch is a bug here.
  int dn = 0, dc = 0, dh = 0, dw = 0;
  MIXTAPE_CUDNN_CHECK(
      cudnnGetConvolution2dForwardOutputDim(plan->conv, plan->x, plan->w, &dn, &dc, &dh, &dw));
  if (dn != g.n || dc != g.cout || dh != g.oh || dw != g.ow)
    throw DeviceError(fmt::format(
        "{}: cuDNN's output extent {}x{}x{}x{} differs from the geometry's ({}; cuDNN input "
        "{}x{}, padding {},{})",
        direction_name(dir), dn, dh, dw, dc, describe(g), l.hin, l.win, l.pad_h, l.pad_w));
  return plan;
}

// The Find's scratch comes straight from cudaMalloc and goes back to the device after the
// Find (cudaFree waits for it): through the caching allocator, a block this large would
// stay cached in a size class little else uses.
struct FindScratch {
  void* p = nullptr;
  std::size_t limit = 0;  // the workspace offered to the Find

  FindScratch() = default;
  FindScratch(const FindScratch&) = delete;
  FindScratch& operator=(const FindScratch&) = delete;
  ~FindScratch() {
    if (p) cudaFree(p);
  }
};

// Allocates the Find's scratch: kMaxConvWorkspace, or a quarter of the free memory when that
// is less, or none when the allocation fails.
void reserve(FindScratch* scratch) {
  std::size_t limit = 0;
  {
    std::size_t free_bytes = 0, total_bytes = 0;
    MIXTAPE_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    limit = std::min(kMaxConvWorkspace, free_bytes / 4);
  }
  if (limit > 0) {
    const cudaError_t err = cudaMalloc(&scratch->p, limit);
    if (err == cudaErrorMemoryAllocation) {  // the Find runs with no workspace
      cudaGetLastError();                    // (clears only this allocation failure)
      scratch->p = nullptr;
      limit = 0;
    } else {
      MIXTAPE_CUDA_CHECK(err);
    }
  }
  scratch->limit = limit;
}

// What a Find chose: its status, and (found) the algorithm, the math type it runs with and
// the workspace the Find measured for it.
struct FindResult {
  cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
  bool found = false;
  int algo = 0;
  cudnnMathType_t math = CUDNN_DEFAULT_MATH;
  std::size_t memory = 0;
};

// Runs the Find of `Pass` on `buf` and picks its result (see pick). A status other than a
// refusal throws.
template <typename Pass>
FindResult find_algorithm(Pass, const CudnnContext& ctx, const ConvPlan& plan, const Buffers& buf,
                          const FindScratch& scratch, bool strict, cudnnMathType_t requested) {
  FindResult r;
  r.math = requested;
  const int count = std::max(Pass::max_count(ctx), 1);
  std::vector<typename Pass::Perf> perf(static_cast<std::size_t>(count));
  int returned = 0;
  r.status = Pass::find(ctx, plan, buf, count, &returned, perf.data(), scratch.p, scratch.limit);
  if (r.status == CUDNN_STATUS_SUCCESS) {
    if (const auto* p = pick(perf, returned, scratch.limit, strict)) {
      r.found = true;
      r.algo = static_cast<int>(p->algo);
      r.math = strict ? CUDNN_FMA_MATH : p->mathType;
      r.memory = p->memory;
    }
  }
  if (r.status != CUDNN_STATUS_SUCCESS && !is_refusal(r.status))
    throw_cudnn_error(r.status, "cudnnFindConvolution*AlgorithmEx", __FILE__, __LINE__);
  return r;
}

// The chosen algorithm's workspace with the math type it will run with; on success the plan
// takes the algorithm and turns to cuDNN. Returns the query's status (a refusal leaves the
// plan off cuDNN; another failure throws).
cudnnStatus_t take_algorithm(const CudnnContext& ctx, Direction dir, const FindResult& choice,
                             ConvPlan* plan) {
  const cudnnMathType_t math = choice.math;
  MIXTAPE_CUDNN_CHECK(cudnnSetConvolutionMathType(plan->conv, math));
  std::size_t bytes = 0;
  const cudnnStatus_t status = with_pass(
      dir, [&](auto pass) { return pass.workspace_size(ctx, *plan, choice.algo, &bytes); });
  if (status == CUDNN_STATUS_SUCCESS) {
    plan->algo = choice.algo;
    plan->workspace = std::max(choice.memory, bytes);
    plan->use_cudnn = true;
  } else if (!is_refusal(status)) {
    throw_cudnn_error(status, "cudnnGetConvolution*WorkspaceSize", __FILE__, __LINE__);
  }
  return status;
}

// Builds the plan of one direction and geometry: descriptors, then the Find (which runs the
// candidate algorithms on `buf`, writing its output buffer), then the chosen algorithm's math
// type and workspace. A refusal leaves use_cudnn false (and says so in the log).
std::unique_ptr<ConvPlan> make_plan(CudnnContext& ctx, Direction dir, DType dt, bool tf32,
                                    const Conv2dGeometry& g, const CudnnLayout& l,
                                    const Buffers& buf) {
  const bool strict = dt == kFloat32 && !tf32;
  const cudnnMathType_t requested =
      dt == kFloat32 ? (tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH) : CUDNN_TENSOR_OP_MATH;
  std::unique_ptr<ConvPlan> plan = describe_plan(dir, dt, requested, g, l);
  FindScratch scratch;
  reserve(&scratch);
  const FindResult choice = with_pass(dir, [&](auto pass) {
    return find_algorithm(pass, ctx, *plan, buf, scratch, strict, requested);
  });
  cudnnStatus_t status = choice.status;
  if (choice.found) status = take_algorithm(ctx, dir, choice, plan.get());
  if (!plan->use_cudnn)
    spdlog::warn(
        "mixtape: cuDNN has no usable algorithm for {} ({}, {}{}): {}; using the direct CUDA "
        "kernels",
        direction_name(dir), dt.name(), describe(g), l.padded ? ", explicitly padded" : "",
        status == CUDNN_STATUS_SUCCESS ? std::string("no algorithm succeeded in the Find")
                                       : cudnn_message(status));
  return plan;
}

bool aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// The plan of (direction, dtype, geometry) on ctx's device, made on first use (ctx.mutex
// held). Plans are never destroyed, so the reference stays valid.
const ConvPlan& plan_for(CudnnContext& ctx, int device, Direction dir, DType dt,
                         const Conv2dGeometry& g, const CudnnLayout& l, const Buffers& buf,
                         bool exact_tf32) {
  const bool tf32 = dt == kFloat32 && (exact_tf32 || cuda::allow_tf32());
  const bool aligned = aligned16(buf.in0) && aligned16(buf.in1) && aligned16(buf.out);
  PlanKey key;
  key.v = {static_cast<int64_t>(dir),
           dt.index(),
           tf32,
           aligned,
           g.n,
           g.h,
           g.w,
           g.c,
           g.kh,
           g.kw,
           g.cout,
           g.oh,
           g.ow,
           g.stride_h,
           g.stride_w,
           g.pad_top,
           g.pad_left,
           device,
           0};
  return find_or_make(ctx.plans, key, [&] {
    // cuDNN's Find runs and times kernels and allocates: not in a captured step (whose warm-up,
    // the same step run eagerly, makes the plans of its shapes).
    capture::forbid(fmt::format("conv2d {}: cuDNN's algorithm search for a new {} geometry",
                                direction_name(dir), dt.name()));
    return make_plan(ctx, dir, dt, tf32, g, l, buf);
  });
}

// Whether a cuDNN execution of `plan` was refused (an algorithm Find measured can still be
// declined for the execution's configuration): the plan turns to the direct kernels for good,
// with a warning, and the caller runs them. Any other failure throws.
bool refused(cudnnStatus_t status, const ConvPlan& plan, const char* call, Direction dir, DType dt,
             const Conv2dGeometry& g, const char* file, int line) {
  if (status == CUDNN_STATUS_SUCCESS) return false;
  if (!is_refusal(status)) throw_cudnn_error(status, call, file, line);
  plan.use_cudnn = false;
  spdlog::warn("mixtape: cuDNN refused {} for {} ({}, {}): {}; using the direct CUDA kernels", call,
               direction_name(dir), dt.name(), describe(g), cudnn_message(status));
  return true;
}

// Runs a pass on cuDNN; false when it did not (cuDNN has no usable algorithm for it, or
// refused the execution): the caller runs the direct kernels.
bool cudnn_pass(Direction dir, DType dt, const Tensor& a, const Tensor& b, const Tensor& out,
                const Conv2dGeometry& g, int device, cudaStream_t st, bool exact_tf32) {
  const std::size_t item = dt.itemsize();
  const CudnnLayout l = cudnn_layout(g);
  CudnnContext& ctx = cudnn_context(device);
  std::lock_guard<std::mutex> lock(ctx.mutex);
  const int64_t kdim = g.kh * g.kw * g.c;
  // The filter in cuDNN's KRSC layout: transposed from HWIO for forward and backward-data
  // (whose b is w), computed there by backward-filter and transposed back after.
  Workspace krsc(static_cast<std::size_t>(kdim * g.cout) * item, device);
  if (dir != Direction::BackwardFilter)
    transpose_matrix(b.const_data_ptr(), krsc.data(), kdim, g.cout, item, st);
  // The image as cuDNN sees it: explicitly padded when the layout says so. Forward and
  // backward-filter read it (their a is x); backward-data writes its gradient there, cropped
  // after.
  Workspace padded(l.padded ? static_cast<std::size_t>(g.n * l.hin * l.win * g.c) * item : 0,
                   device);
  if (l.padded && dir != Direction::BackwardData)
    pad_nhwc(a.const_data_ptr(), padded.data(), g.n, g.h, g.w, g.c, l.hin, l.win, g.pad_top,
             g.pad_left, item, st);
  // (x is read through const_data_ptr: data_ptr() counts a write, which would drop a kept
  // autocast copy of a variable x.)
  void* image = l.padded                         ? padded.data()
                : dir == Direction::BackwardData ? out.data_ptr()
                                                 : const_cast<void*>(a.const_data_ptr());
  Buffers buf{};
  switch (dir) {
    case Direction::Forward:
      buf = {image, krsc.data(), out.data_ptr()};
      break;
    case Direction::BackwardData:
      buf = {krsc.data(), a.const_data_ptr(), image};
      break;
    case Direction::BackwardFilter:
      buf = {image, b.const_data_ptr(), krsc.data()};
      break;
  }
  const ConvPlan& plan = plan_for(ctx, device, dir, dt, g, l, buf, exact_tf32);
  if (!plan.use_cudnn) return false;
  Workspace workspace(plan.workspace, device);
  const char* call = with_pass(dir, [](auto pass) { return pass.kExecute; });
  const cudnnStatus_t status =
      with_pass(dir, [&](auto pass) { return pass.execute(ctx, plan, buf, workspace.data()); });
  if (refused(status, plan, call, dir, dt, g, __FILE__, __LINE__)) return false;
  if (dir == Direction::BackwardData && l.padded)
    crop_nhwc(padded.data(), out.data_ptr(), g.n, g.h, g.w, g.c, l.hin, l.win, g.pad_top,
              g.pad_left, item, st);
  if (dir == Direction::BackwardFilter)  // KRSC [cout, kh*kw*cin] -> HWIO [kh*kw*cin, cout]
    transpose_matrix(krsc.data(), out.data_ptr(), g.cout, kdim, item, st);
  return true;
}

#endif  // MIXTAPE_WITH_CUDNN

// --- The kernels -------------------------------------------------------------------------------

// One pass: empty tensors, then the direct kernels where cuDNN does not go (16-bit
// accumulation, float64, extents beyond int32), cuDNN, and the direct kernels again where
// cuDNN declines. exact_tf32: float32 operands that hold float16 / bfloat16 values (TF32
// represents those exactly, so TF32 math is allowed whatever allow_tf32() says).
void conv_pass(Direction dir, const Tensor& a, const Tensor& b, const Tensor& out,
               const Conv2dGeometry& g, [[maybe_unused]] bool exact_tf32 = false) {
  const DType dt = out.dtype();
  if (out.numel() == 0) return;
  const int device = out.device().index();
  DeviceGuard guard(device);
  const LaunchScope launch(device);
  const cudaStream_t st = launch.stream();
  if (a.numel() == 0 || b.numel() == 0) return zero_fill(out, st);
  const ConvShape s = shape_of(g);
  Accumulation acc;
  if (direct_only(dt, g, &acc))
    return run_direct(dir, dt, acc, s, a.const_data_ptr(), b.const_data_ptr(), out.data_ptr(), st);
#ifdef MIXTAPE_WITH_CUDNN
  if (cudnn_pass(dir, dt, a, b, out, g, device, st, exact_tf32)) return;
#endif
  run_direct(dir, dt, Accumulation::Wide, s, a.const_data_ptr(), b.const_data_ptr(), out.data_ptr(),
             st);
}

Tensor as_float32(const Tensor& t) {
  Tensor out = Tensor::empty(t.shape(), kFloat32, t.device());
  find_kernel<kernels::CastFn>(OpId::cast, DeviceType::CUDA, t.dtype())(t, out);
  return out;
}

// The forward pass. The bias is added to the float32 accumulator and the sum rounded once
// (kernels.h), which neither cuDNN's plain forward (it stores a rounded 16-bit result) nor
// a bias added to that result gives: rounding twice loses the absolute precision of the
// convolution where the bias cancels most of it (the conformance sweep's first run on a GPU
// found such elements 14 float16 units apart). So a float16 / bfloat16 convolution with a
// bias runs on float32 copies of x and w, with TF32 math allowed (exact on these values:
// the same products and float32 sums as the 16-bit tensor-core configuration), into a
// float32 result that one kernel adds the bias to and rounds. The cost is the two casts and
// TF32's half rate against float16's. Under low_precision_accumulation the bias is the last
// term, rounded like the others: a pass on the stored result is exactly that.
void conv2d_forward(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                    const Conv2dGeometry& g) {
  const DType dt = out.dtype();
  const bool round_once =
      bias.defined() && dt.is_reduced_float() && !g.low_precision_accumulation && out.numel() > 0;
  if (round_once) {
    const int device = out.device().index();
    DeviceGuard guard(device);
    Tensor acc = Tensor::empty(out.shape(), kFloat32, out.device());
    conv_pass(Direction::Forward, as_float32(x), as_float32(w), acc, g, /*exact_tf32=*/true);
    add_bias_rows_rounded(elem_of(dt), acc.const_data_ptr(), bias.const_data_ptr(), out.data_ptr(),
                          out.numel() / g.cout, g.cout, LaunchScope(device).stream());
    return;
  }
  conv_pass(Direction::Forward, x, w, out, g);
  if (!bias.defined() || out.numel() == 0) return;
  // float32 / float64 (the sum rounded once: the result was not rounded before), or the
  // 16-bit accumulation's last term.
  const int device = out.device().index();
  DeviceGuard guard(device);
  add_bias_rows(elem_of(out.dtype()), out.data_ptr(), bias.const_data_ptr(), out.numel() / g.cout,
                g.cout, LaunchScope(device).stream());
}
void conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                           const Conv2dGeometry& g) {
  conv_pass(Direction::BackwardData, grad_out, w, grad_x, g);
}
void conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                            const Conv2dGeometry& g) {
  conv_pass(Direction::BackwardFilter, x, grad_out, grad_w, g);
}

}  // namespace

void register_conv_kernels() {
  // One kernel per pass for every floating dtype (it reads the dtype off its tensors).
  constexpr auto cuda = DeviceType::CUDA;
  register_op<OpId::conv2d>(cuda, []<DType::Code>() { return &conv2d_forward; });
  register_op<OpId::conv2d_backward_input>(cuda,
                                           []<DType::Code>() { return &conv2d_backward_input; });
  register_op<OpId::conv2d_backward_weight>(cuda,
                                            []<DType::Code>() { return &conv2d_backward_weight; });
}

}  // namespace mixtape::cuda_backend
