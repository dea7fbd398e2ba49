// CUDA matmul kernels (kernels::GemmFn) for float32, float16, bfloat16 and float64.
//
// The products go to cuBLASLt (cublasLtMatmul), one call per batch of up to 65535 matrices
// (strided batch, with stride 0 for an operand the batch shares):
//   float32   CUBLAS_COMPUTE_32F, or CUBLAS_COMPUTE_32F_FAST_TF32 while
//             mixtape::cuda::allow_tf32() is true (read per call; off by default)
//   float16   CUDA_R_16F operands, CUBLAS_COMPUTE_32F (tensor cores, float32 accumulation)
//   bfloat16  CUDA_R_16BF operands, CUBLAS_COMPUTE_32F (likewise)
//   float64   CUBLAS_COMPUTE_64F
// GemmArgs is row-major and cuBLASLt column-major: a row-major m x n matrix with leading
// dimension ld is the column-major n x m matrix with the same ld, so the call computes
// C^T = op(B)^T op(A)^T, i.e. cuBLASLt's A is our B (transposed when trans_b) and its B is our
// A (transposed when trans_a), with m and n swapped. Leading dimensions, batch strides and
// the m x n part of each C are exactly GemmArgs' (the leading-dimension gaps of C are never
// written: beta = 0 and D = C).
//
// Per device: one cuBLASLt handle (created on first use), and a cache of plans by problem
// (dtype, compute type, shape, transposes, leading dimensions, batch and strides, and the
// alignment of the three pointers): the matmul and layout descriptors plus the algorithm the
// heuristic chose (cublasLtMatmulAlgoGetHeuristic, first result) and its workspace size.
// The workspace (at most 32 MiB) comes from the caching allocator for each call.
//
// Not through cuBLASLt (sequential_accumulation below):
//   - float16 / bfloat16 with low_precision_accumulation (MIXTAPE_FP16_USE_FP32_COMPUTE=0):
//     the sequential kernel of gemm_acc16.cu, which rounds the accumulator to the 16-bit type
//     after every multiply-add exactly as the CPU emulation does (no library does that);
//   - k == 0 (zeros) and problems the heuristic finds no algorithm for (logged once per
//     problem) or with a dimension past int32: the same kernel with float32 / float64
//     accumulation.
//
// Fusion: the linear op's product (linear.cu) may run with a cuBLASLt epilogue
// (linear_gemm_epilogue below): CUBLASLT_MATMUL_DESC_EPILOGUE BIAS or GELU(_AUX)(_BIAS), the
// epilogue part of the plan key, the bias (D's type) broadcast along
// cuBLASLt's rows, which are our columns (n) after the swap: exactly a Dense layer's
// per-output-feature bias; the GELU epilogues' aux output (the pre-activation) has D's layout.
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_util.h"
#include "backends/cuda/elem.h"
#include "backends/cuda/gemm_conv_kernels.h"
#include "backends/cuda/plan_cache.h"
#include "core/env.h"
#include "mixtape/core/cuda.h"
#include "mixtape/core/error.h"
#include "mixtape/core/register_kernels.h"

namespace mixtape::cuda_backend {
namespace {

using kernels::GemmArgs;
using std::int64_t;

// --- Errors ------------------------------------------------------------------------------

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* what, const char* file,
                                     int line) {
  throw DeviceError(fmt::format("{} failed at {}:{}: {}: {}", what, file, line,
                                cublasLtGetStatusName(status), cublasLtGetStatusString(status)));
}
inline void check_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) throw_cublas_error(status, what, file, line);
}

// Every cuBLAS / cuBLASLt call goes through this: MIXTAPE_CUBLAS_CHECK(cublasLtCreate(&h)).
#define MIXTAPE_CUBLAS_CHECK(call) check_cublas((call), #call, __FILE__, __LINE__)

// --- Constants -------------------------------------------------------------------------------

constexpr std::size_t kMaxWorkspace = std::size_t{32} << 20;  // cuBLAS's recommendation (Hopper)
constexpr int64_t kMaxBatchPerCall = 65535;

// --- Geometry ------------------------------------------------------------------------------

// cuBLASLt's dimensions and leading dimensions are int32.
constexpr int64_t kLtDimMax = std::numeric_limits<std::int32_t>::max();

// GemmArgs after the CPU backend's normalisation: a matrix with one stored row may carry any
// leading dimension (raised to its row length, as cuBLASLt wants ld >= rows of its
// column-major view), and a batch that shares B, with A and C evenly strided, is one taller
// product. A batch of one has no strides.
GemmShape gemm_shape(const kernels::GemmArgs& g) {
  GemmShape s;
  s.batch = g.batch, s.m = g.m, s.n = g.n, s.k = g.k;
  s.ta = g.trans_a, s.tb = g.trans_b;
  s.lda = g.lda, s.ldb = g.ldb, s.ldc = g.ldc;
  s.sa = g.stride_a, s.sb = g.stride_b, s.sc = g.stride_c;
  const int64_t rows_a = s.ta ? s.k : s.m, cols_a = s.ta ? s.m : s.k;
  const int64_t rows_b = s.tb ? s.n : s.k, cols_b = s.tb ? s.k : s.n;
  if (rows_a <= 1) s.lda = std::max(s.lda, cols_a);
  if (rows_b <= 1) s.ldb = std::max(s.ldb, cols_b);
  if (s.m <= 1) s.ldc = std::max(s.ldc, s.n);
  s.lda = std::max<int64_t>(s.lda, 1);
  s.ldb = std::max<int64_t>(s.ldb, 1);
  s.ldc = std::max<int64_t>(s.ldc, 1);
  if (s.batch > 1 && !s.ta && s.sb == 0 && s.sa == s.m * s.lda && s.sc == s.m * s.ldc &&
      s.batch * s.m <= kLtDimMax) {
    s.m *= s.batch;
    s.batch = 1;
  }
  if (s.batch == 1) s.sa = s.sb = s.sc = 0;
  return s;
}

// The accumulation of the sequential kernel when a product of dtype dt goes to it rather than
// to cuBLASLt: Round16 for float16 / bfloat16 under low_precision_accumulation (no library
// rounds the accumulator to 16 bits after every term); Wide for k == 0 and for a dimension or
// leading dimension past int32 (cuBLASLt's limit). nullopt: cuBLASLt's.
std::optional<Accumulation> sequential_accumulation(DType dt, const kernels::GemmArgs& g,
                                                    const GemmShape& s) {
  if (dt.is_reduced_float() && g.low_precision_accumulation) return Accumulation::Round16;
  if (s.k <= 0 || s.m > kLtDimMax || s.n > kLtDimMax || s.k > kLtDimMax || s.lda > kLtDimMax ||
      s.ldb > kLtDimMax || s.ldc > kLtDimMax)
    return Accumulation::Wide;
  return std::nullopt;
}

// Whether cuBLASLt's epilogues are switched on (MIXTAPE_CUDA_LT_EPILOGUES), and whether a
// vector it reads or writes in an epilogue (a bias, aux) is aligned as it needs: 16 bytes.
bool lt_epilogues_enabled() {
  static const bool enabled = detail::env::kCudaLtEpilogues.read();
  return enabled;
}
bool epilogue_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Whether the linear op's product may go to cuBLASLt with an epilogue (linear_gemm_epilogue,
// cuda_backend.h): the epilogues switched on, not float64, the dimensions within int32, and the
// data as cuBLASLt reads and writes it in vectors: the bias and aux (when defined) aligned,
// aux's leading dimension a multiple of 8 elements.
bool lt_epilogue_applies(const kernels::LinearArgs& a, const Tensor& aux) {
  const int64_t m = a.x.dim(0), k = a.x.dim(1), n = a.w.dim(1);
  if (!lt_epilogues_enabled() || a.x.dtype() == kFloat64 || m > kLtDimMax || n > kLtDimMax ||
      k > kLtDimMax)
    return false;
  if (a.bias.defined() && !epilogue_aligned(a.bias.const_data_ptr())) return false;
  if (aux.defined() && (!epilogue_aligned(aux.const_data_ptr()) || n % 8 != 0)) return false;
  return true;
}

// The alignment (a power of two up to 256 bytes) that the pointer, the leading dimension
// and, in a batch, the batch stride all share: what cuBLASLt may assume of the operand.
std::uint32_t alignment(const void* p, int64_t ld, int64_t stride, int64_t batch,
                        std::size_t item) {
  std::uint64_t v = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p)) |
                    static_cast<std::uint64_t>(ld) * item;
  if (batch > 1) v |= static_cast<std::uint64_t>(stride) * item;
  if (v == 0) return 256;
  return static_cast<std::uint32_t>(std::min<std::uint64_t>(v & (~v + 1), 256));
}

// --- cuBLASLt handles and plans ------------------------------------------------------------

cublasLtHandle_t lt_handle(int device) {
  static std::mutex mutex;
  static auto* handles = new std::vector<cublasLtHandle_t>();  // never destroyed
  std::lock_guard<std::mutex> lock(mutex);
  if (handles->size() <= static_cast<std::size_t>(device))
    handles->resize(static_cast<std::size_t>(device) + 1, nullptr);
  cublasLtHandle_t& h = (*handles)[static_cast<std::size_t>(device)];
  if (!h) {
    DeviceGuard guard(device);
    MIXTAPE_CUBLAS_CHECK(cublasLtCreate(&h));
  }
  return h;
}

struct LtTypes {
  cudaDataType_t data;  // of the operands, and of C and D unless `out` says otherwise
  cublasComputeType_t compute;
  cudaDataType_t scale;
  cudaDataType_t out = data;  // of C and D
};

LtTypes lt_types(DType dt, bool tf32) {
  switch (dt.code()) {
    case DType::Float16:
      return {CUDA_R_16F, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case DType::BFloat16:
      return {CUDA_R_16BF, CUBLAS_COMPUTE_32F, CUDA_R_32F};
    case DType::Float64:
      return {CUDA_R_64F, CUBLAS_COMPUTE_64F, CUDA_R_64F};
    default:
      return {CUDA_R_32F, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F, CUDA_R_32F};
  }
}

// One problem's descriptors and algorithm. cuBLASLt's A is our B and its B our A (see the
// top of the file); C and D share one layout.
struct LtPlan {
  Owned<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> op;
  Owned<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> a, b, c;
  cublasLtMatmulAlgo_t algo{};
  std::size_t workspace = 0;
  bool supported = false;  // false: no algorithm; the sequential kernel runs the problem
  std::string why;         // when not supported: cuBLASLt's status, or "no algorithm"
};

// A column-major rows x cols layout with leading dimension ld, strided over the batch.
void set_layout(cublasLtMatrixLayout_t* layout, cudaDataType_t type, int64_t rows, int64_t cols,
                int64_t ld, int64_t batch, int64_t stride) {
  MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(layout, type, static_cast<std::uint64_t>(rows),
                                                  static_cast<std::uint64_t>(cols), ld));
  if (batch > 1) {
    const std::int32_t count = static_cast<std::int32_t>(batch);
    const int64_t offset = stride;
    MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
    MIXTAPE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
        *layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &offset, sizeof(offset)));
  }
}

// A matmul preference, destroyed with it: at most kMaxWorkspace bytes of workspace, operands
// of the given alignments (our a, b and c: cuBLASLt's B, A, and C and D), and split-K partial
// sums added in the compute type (float32 for 16-bit and FP8 operands), never in place in the
// output or in the output type: each result is rounded once, as kernels.h promises and the
// CPU does, whichever algorithm the heuristic picks.
struct Preference {
  cublasLtMatmulPreference_t p = nullptr;
  Preference(std::uint32_t align_a, std::uint32_t align_b, std::uint32_t align_c) {
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&p));
    const std::uint64_t max_workspace = kMaxWorkspace;
    set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, max_workspace);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_b);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_a);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c);
    set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c);
    const std::uint32_t reduction =
        CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
    set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, reduction);
  }
  ~Preference() { cublasLtMatmulPreferenceDestroy(p); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, const T& value) {
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attribute, &value, sizeof(value)));
  }
};

// Asks the heuristic for the plan's first algorithm (C and D share the plan's c layout):
// supported, or not with the reason in plan.why; another failure throws, unless `optional`
// (an epilogue plan, which the caller can do without, or an FP8 plan, whose caller explains
// the refusal: any refusal is then "not supported").
void choose_algorithm(cublasLtHandle_t handle, LtPlan& plan, const Preference& pref,
                      bool optional = false) {
  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(
      handle, plan.op, plan.a, plan.b, plan.c, plan.c, pref.p, 1, &result, &returned);
  if (status == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan.algo = result.algo;
    plan.workspace = result.workspaceSize;
    plan.supported = true;
  } else if (status == CUBLAS_STATUS_SUCCESS || status == CUBLAS_STATUS_NOT_SUPPORTED || optional) {
    plan.why = status != CUBLAS_STATUS_SUCCESS ? cublasLtGetStatusName(status)
               : returned > 0                  ? cublasLtGetStatusName(result.state)
                                               : "no algorithm";
  } else {
    throw_cublas_error(status, "cublasLtMatmulAlgoGetHeuristic", __FILE__, __LINE__);
  }
}

// A linear op's epilogue (linear_gemm_epilogue): the cuBLASLt epilogue, whether it reads a
// bias (of D's type: the linear op's kernels take it so, kernels.h; float64 takes none), and the
// leading dimension of its aux output (0: none).
struct EpilogueSpec {
  cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_DEFAULT;
  bool bias = false;
  int64_t aux_ld = 0;
  // The first call's pointers, set before the heuristic runs (each call sets its own again).
  const void* bias_ptr = nullptr;
  void* aux_ptr = nullptr;
};

// Builds the descriptors of problem s (batch <= kMaxBatchPerCall) and asks the heuristic for
// an algorithm that works with the given alignments; with an epilogue, for one that has it
// (none found: the caller computes the epilogue itself, so no warning).
std::unique_ptr<LtPlan> make_plan(cublasLtHandle_t handle, DType dt, const LtTypes& types,
                                  const GemmShape& s, std::uint32_t align_a, std::uint32_t align_b,
                                  std::uint32_t align_c, const EpilogueSpec* epilogue = nullptr) {
  auto plan = std::make_unique<LtPlan>();
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescCreate(plan->op.out(), types.compute, types.scale));
  const std::int32_t op_a = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's A: our B
  const std::int32_t op_b = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLASLt's B: our A
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
  // Our row-major B (k x n, or n x k when transposed) is column-major n x k (k x n); our A
  // (m x k, or k x m) is column-major k x m (m x k); our C (m x n) is column-major n x m.
  set_layout(plan->a.out(), types.data, s.tb ? s.k : s.n, s.tb ? s.n : s.k, s.ldb, s.batch, s.sb);
  set_layout(plan->b.out(), types.data, s.ta ? s.m : s.k, s.ta ? s.k : s.m, s.lda, s.batch, s.sa);
  set_layout(plan->c.out(), types.out, s.n, s.m, s.ldc, s.batch, s.sc);
  if (epilogue) {
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue->epilogue, sizeof(epilogue->epilogue)));
    if (epilogue->bias) {
      const cudaDataType_t bias_type = types.out;
      MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
          plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    }
    if (epilogue->aux_ld > 0)
      MIXTAPE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD,
                                         &epilogue->aux_ld, sizeof(epilogue->aux_ld)));
    if (epilogue->bias_ptr)
      MIXTAPE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                         &epilogue->bias_ptr, sizeof(epilogue->bias_ptr)));
    if (epilogue->aux_ptr)
      MIXTAPE_CUBLAS_CHECK(
          cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER,
                                         &epilogue->aux_ptr, sizeof(epilogue->aux_ptr)));
  }

  // An epilogue plan and a 16-bit product written in float32 (linear's bias path) are
  // optional: their callers do without them, so any refusal is "not supported".
  choose_algorithm(handle, *plan, Preference(align_a, align_b, align_c),
                   epilogue != nullptr || types.out != types.data);
  if (!plan->supported && epilogue)
    // Once per problem (plans are cached): why the linear op computes this epilogue itself.
    spdlog::info(
        "mixtape: cuBLASLt has no {} matmul with epilogue {} (m {}, n {}, k {}, bias {}, aux "
        "ld {}): {}; the linear op applies it with its own kernel",
        dt.name(), static_cast<int>(epilogue->epilogue), s.m, s.n, s.k,
        epilogue->bias ? "float32" : "none", epilogue->aux_ld, plan->why);
  if (!plan->supported && !epilogue && types.out == types.data)
    spdlog::warn(
        "mixtape: cuBLASLt has no algorithm for a {} matmul (batch {}, m {}, n {}, k {}, "
        "trans {}{}, ld {}/{}/{}, strides {}/{}/{}, alignment {}/{}/{}): {}; using the "
        "sequential CUDA kernel",
        dt.name(), s.batch, s.m, s.n, s.k, s.ta ? 'T' : 'N', s.tb ? 'T' : 'N', s.lda, s.ldb, s.ldc,
        s.sa, s.sb, s.sc, align_a, align_b, align_c, plan->why);
  return plan;
}

// The plan of problem s on `device`, made on first use. Plans are never destroyed, so the
// reference stays valid.
const LtPlan& plan_for(int device, cublasLtHandle_t handle, DType dt, bool tf32, const GemmShape& s,
                       std::uint32_t align_a, std::uint32_t align_b, std::uint32_t align_c,
                       bool float32_out = false) {
  static std::mutex mutex;
  static auto* plans = new PlanCache<LtPlan>();  // never destroyed
  LtTypes types = lt_types(dt, tf32);
  if (float32_out) types.out = CUDA_R_32F;
  PlanKey key;
  key.v = {device,
           dt.index(),
           static_cast<int64_t>(types.compute),
           s.batch,
           s.m,
           s.n,
           s.k,
           s.ta,
           s.tb,
           s.lda,
           s.ldb,
           s.ldc,
           s.sa,
           s.sb,
           s.sc,
           align_a,
           align_b,
           align_c,
           static_cast<int64_t>(types.out)};
  std::lock_guard<std::mutex> lock(mutex);
  return find_or_make(*plans, key,
                      [&] { return make_plan(handle, dt, types, s, align_a, align_b, align_c); });
}

// --- The kernel ------------------------------------------------------------------------------

template <DType::Code kCode>
void gemm(const GemmArgs& g) {
  constexpr DType dt{kCode};
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return;
  const int device = g.out.device().index();
  DeviceGuard guard(device);
  const LaunchScope launch(device);
  const cudaStream_t st = launch.stream();
  const GemmShape s = gemm_shape(g);
  const void* a = g.a.const_data_ptr();
  const void* b = g.b.const_data_ptr();
  void* c = g.out.data_ptr();

  if (const auto acc = sequential_accumulation(dt, g, s))
    return gemm_sequential(elem_of(dt), *acc, s, a, b, c, st);

  const bool tf32 = dt == kFloat32 && cuda::allow_tf32();
  const cublasLtHandle_t handle = lt_handle(device);
  const std::size_t item = dt.itemsize();
  const double one_d = 1.0, zero_d = 0.0;
  const float one_f = 1.0f, zero_f = 0.0f;
  const void* alpha = dt == kFloat64 ? static_cast<const void*>(&one_d) : &one_f;
  const void* beta = dt == kFloat64 ? static_cast<const void*>(&zero_d) : &zero_f;

  for (int64_t b0 = 0; b0 < s.batch; b0 += kMaxBatchPerCall) {
    GemmShape part = s;
    part.batch = std::min(kMaxBatchPerCall, s.batch - b0);
    if (part.batch == 1) part.sa = part.sb = part.sc = 0;
    const void* pa = static_cast<const char*>(a) + b0 * s.sa * static_cast<int64_t>(item);
    const void* pb = static_cast<const char*>(b) + b0 * s.sb * static_cast<int64_t>(item);
    void* pc = static_cast<char*>(c) + b0 * s.sc * static_cast<int64_t>(item);
    const std::uint32_t align_a = alignment(pa, part.lda, part.sa, part.batch, item);
    const std::uint32_t align_b = alignment(pb, part.ldb, part.sb, part.batch, item);
    const std::uint32_t align_c = alignment(pc, part.ldc, part.sc, part.batch, item);
    const LtPlan& plan = plan_for(device, handle, dt, tf32, part, align_a, align_b, align_c);
    if (!plan.supported) {
      gemm_sequential(elem_of(dt), Accumulation::Wide, part, pa, pb, pc, st);
      continue;
    }
    Workspace workspace(plan.workspace, device);
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmul(handle, plan.op, alpha, pb, plan.a, pa, plan.b, beta, pc,
                                        plan.c, pc, plan.c, &plan.algo, workspace.data(),
                                        plan.workspace, st));
  }
}

// --- The scaled FP8 matmul (op scaled_matmul) -------------------------------------------------
// cuBLASLt's FP8 GEMM (sm_89 and newer): the layout it requires is "TN", cuBLASLt's A
// transposed and its B not: in row-major terms our b_t [n, k] is its A (column-major k x n,
// op T) and our a [m, k] its B (column-major k x m, op N), both with k innermost; D is our out
// [m, n] (column-major n x m). The operands' scales are device pointers (A_SCALE_POINTER is
// b_t's, B_SCALE_POINTER a's), so no host value is read.

cudaDataType_t float8_type(DType dt) {
  return dt == kFloat8E4M3FN ? CUDA_R_8F_E4M3 : CUDA_R_8F_E5M2;
}
cudaDataType_t out_type(DType dt) {
  return dt == kFloat32 ? CUDA_R_32F : dt == kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
}

// The operands' scales (device pointers) on the plan's descriptor: cuBLASLt's A is b_t.
void set_scale_pointers(LtPlan& plan, const kernels::ScaledMatmulArgs& g) {
  const void* scale_a = g.scale_b.const_data_ptr();
  const void* scale_b = g.scale_a.const_data_ptr();
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                      &scale_a, sizeof(scale_a)));
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                      &scale_b, sizeof(scale_b)));
}

// The plan of g's product; with g.bias defined, with cuBLASLt's BIAS epilogue adding it (of
// D's 16-bit type).
std::unique_ptr<LtPlan> make_fp8_plan(cublasLtHandle_t handle, const kernels::ScaledMatmulArgs& g,
                                      std::uint32_t align_a, std::uint32_t align_b,
                                      std::uint32_t align_c) {
  auto plan = std::make_unique<LtPlan>();
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescCreate(plan->op.out(), CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const std::int32_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  MIXTAPE_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const std::int8_t fast = g.fast_accumulation ? 1 : 0;
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_FAST_ACCUM,
                                                      &fast, sizeof(fast)));
  set_layout(plan->a.out(), float8_type(g.b_t.dtype()), g.k, g.n, g.k, 1, 0);
  set_layout(plan->b.out(), float8_type(g.a.dtype()), g.k, g.m, g.k, 1, 0);
  set_layout(plan->c.out(), out_type(g.out.dtype()), g.n, g.m, g.n, 1, 0);
  if (g.bias.defined()) {
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bias_type = out_type(g.out.dtype());
    const void* bias = g.bias.const_data_ptr();
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                        &epilogue, sizeof(epilogue)));
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                        &bias, sizeof(bias)));
  }
  // The scale pointers are set at each call, and the first call's here before the heuristic
  // runs: cuBLASLt does not promise that an algorithm it chose without them honours them
  // (XLA met one that did not). The heuristic also needs the types, the layouts, the options
  // and the operands' alignment (cuBLASLt's A is b_t, its B a).
  set_scale_pointers(*plan, g);
  // Any refusal (INVALID_VALUE for dims that are not multiples of 16 as well as NOT_SUPPORTED)
  // becomes scaled_matmul's DeviceError naming the shapes, with the status as the reason.
  choose_algorithm(handle, *plan, Preference(align_a, align_b, align_c), /*optional=*/true);
  return plan;
}

// Plans by problem, made on first use and never destroyed; the descriptor's scale pointers
// are set at each call under the same lock (a plan is used by one call at a time).
std::mutex g_fp8_mutex;

// The scaled product into g.out, with cuBLASLt's BIAS epilogue adding g.bias when it is defined
// (g's activation and pre are not this function's): false, nothing written, when cuBLASLt has
// no algorithm for the biased product (the caller then adds the bias itself); a product
// without a bias that it cannot make is a DeviceError.
bool scaled_product(const kernels::ScaledMatmulArgs& g) {
  const int device = g.out.device().index();
  DeviceGuard guard(device);
  const LaunchScope launch(device);
  const cudaStream_t st = launch.stream();
  const cublasLtHandle_t handle = lt_handle(device);
  static auto* plans = new PlanCache<LtPlan>();  // never destroyed
  const std::uint32_t align_a = alignment(g.a.const_data_ptr(), g.k, 0, 1, 1);
  const std::uint32_t align_b = alignment(g.b_t.const_data_ptr(), g.k, 0, 1, 1);
  const std::uint32_t align_c = alignment(g.out.data_ptr(), g.n, 0, 1, g.out.dtype().itemsize());
  const void* bias = g.bias.defined() ? g.bias.const_data_ptr() : nullptr;
  PlanKey key;
  // (The heuristic reads the bias pointer's alignment: part of the problem.)
  key.v = {device,
           g.a.dtype().index(),
           g.b_t.dtype().index(),
           g.out.dtype().index(),
           g.m,
           g.n,
           g.k,
           g.fast_accumulation,
           align_a,
           align_b,
           align_c,
           bias != nullptr,
           bias ? alignment(bias, 0, 0, 1, 1) : 0};
  std::lock_guard<std::mutex> lock(g_fp8_mutex);
  LtPlan& plan = find_or_make(*plans, key, [&] {
    auto made = make_fp8_plan(handle, g, align_a, align_b, align_c);
    if (!made->supported && bias)
      // Once per problem (plans are cached): why the epilogue kernel adds this bias.
      spdlog::info(
          "mixtape: scaled_matmul: no cuBLASLt FP8 algorithm with the BIAS epilogue for {}[{}, "
          "{}] x {}[{}, {}] -> {} ({}); the bias goes to the epilogue kernel",
          g.a.dtype(), g.m, g.k, g.b_t.dtype(), g.n, g.k, g.out.dtype(), made->why);
    return made;
  });
  if (!plan.supported && bias) return false;
  if (!plan.supported)
    throw DeviceError(fmt::format(
        "scaled_matmul: cuBLASLt has no FP8 GEMM for {}[{}, {}] x {}[{}, {}] -> {} on cuda:{} "
        "({}): FP8 GEMMs need compute capability 8.9 or newer and k and n multiples of 16",
        g.a.dtype(), g.m, g.k, g.b_t.dtype(), g.n, g.k, g.out.dtype(), device, plan.why));
  set_scale_pointers(plan, g);
  if (bias)
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                        &bias, sizeof(bias)));
  const float one = 1.0f, zero = 0.0f;
  Workspace workspace(plan.workspace, device);
  void* out = g.out.data_ptr();
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmul(handle, plan.op, &one, g.b_t.const_data_ptr(), plan.a,
                                      g.a.const_data_ptr(), plan.b, &zero, out, plan.c, out, plan.c,
                                      &plan.algo, workspace.data(), plan.workspace, st));
  return true;
}

// With the linear op's epilogue. A 16-bit output's bias goes into cuBLASLt's BIAS epilogue,
// which writes z (rounded to out's dtype) into pre, or out, and the activation (linear.cu)
// reads it there, as the linear op's biased products do (one pass fewer over [m, n] in float32
// each way). Otherwise, or when cuBLASLt has no such algorithm: the product in float32 (out
// itself when out is float32), then the linear op's epilogue kernel (linear.cu) adds the bias
// and applies the activation, z rounded once.
void scaled_matmul(const kernels::ScaledMatmulArgs& g) {
  if (!g.has_epilogue()) {
    scaled_product(g);
    return;
  }
  if (g.bias.defined() && g.out.dtype() != kFloat32 && lt_epilogues_enabled() &&
      epilogue_aligned(g.bias.const_data_ptr())) {
    kernels::ScaledMatmulArgs biased = g;
    biased.out = g.pre.defined() ? g.pre : g.out;
    biased.pre = Tensor();
    biased.activation = kernels::LinearActivation::none;
    if (scaled_product(biased)) {
      if (g.pre.defined() || g.activation != kernels::LinearActivation::none)
        linear_activation(biased.out, g.out, g.activation);
      return;
    }
  }
  kernels::ScaledMatmulArgs product = g;
  product.bias = product.pre = Tensor();
  product.activation = kernels::LinearActivation::none;
  if (g.out.dtype() != kFloat32)
    product.out = Tensor::empty(Shape{g.m, g.n}, kFloat32, g.out.device());
  scaled_product(product);
  linear_epilogue(product.out, g.bias, g.pre, g.out, g.activation);
}

// cuBLASLt's epilogue of each LinearEpilogue, in the enum's order (cuda_backend.h).
constexpr cublasLtEpilogue_t kLtEpilogue[] = {
    CUBLASLT_EPILOGUE_BIAS, CUBLASLT_EPILOGUE_GELU, CUBLASLT_EPILOGUE_GELU_BIAS,
    CUBLASLT_EPILOGUE_GELU_AUX, CUBLASLT_EPILOGUE_GELU_AUX_BIAS};

// Plans of the linear products with an epilogue; the bias and aux pointers are set on the
// descriptor at each call under this lock (a plan is used by one call at a time).
std::mutex g_linear_mutex;

}  // namespace

void linear_gemm(const kernels::LinearArgs& a, const Tensor& d) {
  find_kernel<kernels::GemmFn>(OpId::matmul, DeviceType::CUDA, a.x.dtype())(linear_gemm_args(a, d));
}

void linear_gemm_float32(const kernels::LinearArgs& a, const Tensor& d) {
  const DType dt = a.x.dtype();
  const int device = a.out.device().index();
  DeviceGuard guard(device);
  const GemmShape s = gemm_shape(linear_gemm_args(a, d));
  if (s.m <= kLtDimMax && s.n <= kLtDimMax && s.k <= kLtDimMax) {
    const cublasLtHandle_t handle = lt_handle(device);
    const std::size_t item = dt.itemsize();
    const std::uint32_t align_a = alignment(a.x.const_data_ptr(), s.lda, 0, 1, item);
    const std::uint32_t align_b = alignment(a.w.const_data_ptr(), s.ldb, 0, 1, item);
    const std::uint32_t align_c = alignment(d.data_ptr(), s.ldc, 0, 1, sizeof(float));
    const LtPlan& plan = plan_for(device, handle, dt, false, s, align_a, align_b, align_c, true);
    if (plan.supported) {
      const float one = 1.0f, zero = 0.0f;
      Workspace workspace(plan.workspace, device);
      void* out = d.data_ptr();
      MIXTAPE_CUBLAS_CHECK(cublasLtMatmul(handle, plan.op, &one, a.w.const_data_ptr(), plan.a,
                                          a.x.const_data_ptr(), plan.b, &zero, out, plan.c, out,
                                          plan.c, &plan.algo, workspace.data(), plan.workspace,
                                          LaunchScope(device).stream()));
      return;
    }
  }
  // No cuBLASLt product for it: the operands widened to float32 and the float32 matmul. Each
  // product of two 16-bit values is exact in float32 (and in TF32), so these are the same sums
  // of the same products, accumulated in float32.
  static std::once_flag logged;
  std::call_once(logged, [&] {
    spdlog::info(
        "mixtape: linear: no cuBLASLt {} product with float32 output for [{}, {}] x [{}, {}]: "
        "its operands are widened to float32 for the product (same sums, more memory "
        "traffic); logged once",
        dt.name(), s.m, s.k, s.k, s.n);
  });
  const auto widened = [](const Tensor& t) {
    Tensor w = Tensor::empty(t.shape(), kFloat32, t.device());
    find_kernel<kernels::CastFn>(OpId::cast, DeviceType::CUDA, t.dtype())(t, w);
    return w;
  };
  kernels::LinearArgs wide = a;
  wide.x = widened(a.x);
  wide.w = widened(a.w);
  gemm<DType::Float32>(linear_gemm_args(wide, d));
}

bool linear_gemm_epilogue(const kernels::LinearArgs& a, LinearEpilogue e, const Tensor& d,
                          const Tensor& aux) {
  if (!lt_epilogue_applies(a, aux)) return false;
  const DType dt = a.x.dtype();
  const int64_t n = a.w.dim(1);
  const void* bias = a.bias.defined() ? a.bias.const_data_ptr() : nullptr;
  void* aux_ptr = aux.defined() ? aux.data_ptr() : nullptr;
  const std::uint32_t align_bias = bias ? alignment(bias, 0, 0, 1, 1) : 0;
  const std::uint32_t align_aux = aux_ptr ? alignment(aux_ptr, 0, 0, 1, 1) : 0;
  const int device = d.device().index();
  DeviceGuard guard(device);
  const LaunchScope launch(device);
  const cudaStream_t st = launch.stream();
  const cublasLtHandle_t handle = lt_handle(device);
  const GemmShape s = gemm_shape(linear_gemm_args(a, d));
  const bool tf32 = dt == kFloat32 && cuda::allow_tf32();
  const LtTypes types = lt_types(dt, tf32);
  const std::size_t item = dt.itemsize();
  const std::uint32_t align_a = alignment(a.x.const_data_ptr(), s.lda, 0, 1, item);
  const std::uint32_t align_b = alignment(a.w.const_data_ptr(), s.ldb, 0, 1, item);
  const std::uint32_t align_c = alignment(d.data_ptr(), s.ldc, 0, 1, item);
  const EpilogueSpec spec{kLtEpilogue[static_cast<int>(e)], bias != nullptr, aux_ptr ? n : 0, bias,
                          aux_ptr};
  static auto* plans = new PlanCache<LtPlan>();  // never destroyed
  PlanKey key;
  // (The heuristic reads the bias and aux pointers' alignment: part of the problem.)
  key.v = {device,
           dt.index(),
           static_cast<int64_t>(types.compute),
           s.m,
           s.n,
           s.k,
           align_a,
           align_b,
           align_c,
           static_cast<int64_t>(spec.epilogue),
           spec.bias,
           spec.aux_ld,
           align_bias,
           align_aux};
  std::lock_guard<std::mutex> lock(g_linear_mutex);
  LtPlan& plan = find_or_make(*plans, key, [&] {
    return make_plan(handle, dt, types, s, align_a, align_b, align_c, &spec);
  });
  if (!plan.supported) return false;
  if (bias)
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                        &bias, sizeof(bias)));
  if (aux_ptr)
    MIXTAPE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(
        plan.op, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr, sizeof(aux_ptr)));
  const float one = 1.0f, zero = 0.0f;
  Workspace workspace(plan.workspace, device);
  void* out = d.data_ptr();
  MIXTAPE_CUBLAS_CHECK(cublasLtMatmul(handle, plan.op, &one, a.w.const_data_ptr(), plan.a,
                                      a.x.const_data_ptr(), plan.b, &zero, out, plan.c, out, plan.c,
                                      &plan.algo, workspace.data(), plan.workspace, st));
  return true;
}

void register_gemm_kernels() {
  register_op<OpId::matmul>(DeviceType::CUDA, []<DType::Code C>() { return &gemm<C>; });
  register_op<OpId::scaled_matmul>(DeviceType::CUDA, []<DType::Code>() { return &scaled_matmul; });
}

}  // namespace mixtape::cuda_backend
