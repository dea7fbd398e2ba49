// Private to the CPU backend: the registration entry points of its kernel files, small
// helpers shared by them, and the oneDNN hooks of the conv2d / pooling kernels.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <optional>
#include <string_view>
#include <vector>

#include "mixtape/core/register_kernels.h"

namespace mixtape::cpu {

// Registers the CPU backend (allocator, copies) and all CPU kernels.
void register_backend_and_kernels();

// The CPU kernel template fn<T, extra...> for op, T the element type of each dtype:
// MIXTAPE_CPU_KERNEL(max_pool2d, max_pool2d), MIXTAPE_CPU_KERNEL(sum, reduce_kernel, SumR).
#define MIXTAPE_CPU_KERNEL(op, ...) \
  MIXTAPE_REGISTER_KERNEL(::mixtape::DeviceType::CPU, ::mixtape::element_t, op, __VA_ARGS__)

// One per kernel file.
void register_memory_kernels();         // copy, fill, cast
void register_elementwise_kernels();    // unary, binary, comparisons, where
void register_reduction_kernels();      // sum, mean, max, min, argmax, softmax, log_softmax
void register_index_kernels();          // gather, scatter_add, take, index_add
void register_gemm_kernels();           // matmul
void register_linear_kernels();         // linear and its backward pass (fused)
void register_conv_kernels();           // conv2d and its backward passes
void register_pool_kernels();           // max / average pooling and their backward passes
void register_optim_kernels();          // unscale_check, sgd/rmsprop/adam updates
void register_attention_kernels();      // attention and its backward pass (fused)
void register_layer_norm_kernels();     // layer_norm and its backward pass (fused)
void register_batch_norm_kernels();     // batch_norm and its backward pass (fused)
void register_dropout_kernels();        // dropout (a counter-based mask, not stored)
void register_cross_entropy_kernels();  // softmax_cross_entropy and its backward pass (fused)
void register_float8_gemm_kernels();    // scaled_matmul (FP8 operands, emulated in float32)
void register_quantize_kernels();       // quantize_float8 (amax, factor, conversion to FP8)

// The fused linear op's epilogue (linear.cpp) on a float32 product acc [m, n], contiguous (out's
// own storage when out is float32): + bias ([n] in out's dtype, or undefined), the pre-activation into
// pre (when defined), the activation and one rounding to out's dtype (float32, bfloat16 or
// float16), as the linear op computes them. scaled_matmul's epilogue (float8_gemm.cpp).
void linear_epilogue(float* acc, std::int64_t m, std::int64_t n, const Tensor& bias,
                     const Tensor& pre, const Tensor& out, kernels::LinearActivation activation);

// Below this many elements a kernel runs on one thread.
inline constexpr std::int64_t kParallelGrain = 32768;

// --- Threads under load (threads.cpp) ----------------------------------------------------
// While other processes keep some of the CPUs this process may run on busy, the kernels
// run on the cores left over (at least one thread, at most the OpenMP default), and on
// all of them again when the others stop: OpenMP teams that wait for a thread sharing its
// core with another program trained 2.7 to 5.5 times slower than on a quiet machine, one
// thread less 1.4 to 1.9 times (docs/benchmarks.md, "Training under load"). On unless
// MIXTAPE_CPU_THREADS_ADAPT=0, OMP_NUM_THREADS is set (a fixed count, and results that
// repeat bit for bit: sums split over threads change with the count), the process may run
// on one CPU only, or /proc/stat cannot be read. A thread on which the program called
// omp_set_num_threads() keeps its own count.
//
// On every thread that runs CPU kernels, the count a parallel region asks for is made the
// count it gets: OpenMP's dynamic adjustment (OMP_DYNAMIC=true, omp_set_dynamic) is turned
// off, with a warning the first time, and the count is lowered to what OMP_THREAD_LIMIT
// allows, or to one where regions are inactive (omp_set_max_active_levels(0), or inside a
// parallel region of the program's own). oneDNN splits its work for the count it asks for:
// with fewer threads part of a result was never computed (a batched float32 matmul gave
// garbage rows, the trainer's first gradient was NaN) or a convolution waited without end
// for the missing threads. The adaptive count above is what adjusts to the load instead.

// One reading of the machine: a monotonic clock, the busy time (seconds) of the CPUs this
// process may run on since boot, and this process's own CPU time.
struct LoadReading {
  double wall_seconds = 0, busy_seconds = 0, own_seconds = 0;
};
// A core stays in use while at least this share of it is free of other processes' work,
// and is used again once this larger share is (the band keeps noise from flipping counts).
inline constexpr double kThreadKeepCore = 0.6;
inline constexpr double kThreadRegainCore = 0.9;
// The governor takes a reading at most this often.
inline constexpr std::int64_t kThreadReadingPeriodNs = 250'000'000;

// The thread count for `others` cores kept busy by other processes (smoothed), from
// `current`: down to the cores at least kThreadKeepCore free, up to those at least
// kThreadRegainCore free; within [1, ceiling].
int adapt_thread_count(int current, int ceiling, double others);
// The busy seconds (user, nice, system, irq, softirq, steal) of `cpus` in the text of
// /proc/stat; nullopt when a CPU's line is missing or not in the known format.
std::optional<double> parse_busy_seconds(std::string_view stat, const std::vector<int>& cpus,
                                         long ticks_per_second);

// Turns readings into a thread count: the busy time of the CPUs less the process's own is
// the other processes' load, smoothed over two readings (half-life one reading).
class ThreadGovernor {
 public:
  using Sampler = std::function<std::optional<LoadReading>()>;
  ThreadGovernor(int ceiling, Sampler sampler);
  // Takes a reading and returns the (new) target. Not thread-safe: one caller at a time.
  int observe();
  int target() const { return target_.load(std::memory_order_relaxed); }
  int ceiling() const { return ceiling_; }

 private:
  int ceiling_;
  Sampler sampler_;
  std::atomic<int> target_;
  std::optional<LoadReading> last_;
  double smoothed_ = 0;
  bool have_smoothed_ = false;
};

// Called by the CPU allocator on the allocating thread: takes a reading when one is due and
// brings this thread's OpenMP count to the target. Reads MIXTAPE_CPU_THREADS_ADAPT on the
// first call (ValueError for a bad value).
void apply_thread_count();
// The count the kernels are to run on now (the OpenMP default when the count does not adapt).
int thread_count_target();
// Whether the count adapts to the load in this process.
bool threads_adapt();
// Tests: every thread brings its OpenMP count to `threads` at its next CPU allocation, until
// called with 0 (after which a count that does not adapt stays where it was left).
void force_thread_count_for_testing(int threads);

// --- oneDNN (onednn.cpp) ---------------------------------------------------------------
// conv.cpp's conv2d and pooling kernels and gemm.cpp's bfloat16 matmul call these hooks
// first. Each runs the call through oneDNN and returns true, or returns false having
// written nothing (oneDNN off or not built in, a dtype or case it does not take, or one
// measured faster on the backend's own path).

// The environment variable that switches oneDNN off at run time ("0"; "1" or unset: on).
inline constexpr const char* kCpuOneDnnEnv = "MIXTAPE_CPU_ONEDNN";
// Whether the library was built with oneDNN (MIXTAPE_WITH_ONEDNN).
bool onednn_available();
// Whether the hooks use oneDNN: built in, and MIXTAPE_CPU_ONEDNN (read once) not "0"
// unless set_onednn_enabled() said otherwise. Throws ValueError for another value.
bool onednn_enabled();
// Overrides MIXTAPE_CPU_ONEDNN for the whole process (tests and benchmarks compare paths).
void set_onednn_enabled(bool on);
// Sets the oneDNN switch until the end of the scope, then restores it (tests and
// benchmarks run one case on both paths).
class OneDnnScope {
 public:
  explicit OneDnnScope(bool on) : previous_(onednn_enabled()) { set_onednn_enabled(on); }
  ~OneDnnScope() { set_onednn_enabled(previous_); }
  OneDnnScope(const OneDnnScope&) = delete;
  OneDnnScope& operator=(const OneDnnScope&) = delete;

 private:
  bool previous_;
};
// Whether oneDNN runs bfloat16 natively on this CPU (AVX512-BF16 or AMX): its bf16
// kernels are used only then. False in builds without oneDNN.
bool onednn_native_bf16();

// conv2d's forward pass; bias (undefined for none) is added in the primitive.
bool onednn_conv2d(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& out,
                   const kernels::Conv2dGeometry& g);
bool onednn_conv2d_backward_input(const Tensor& grad_out, const Tensor& w, const Tensor& grad_x,
                                  const kernels::Conv2dGeometry& g);
bool onednn_conv2d_backward_weight(const Tensor& x, const Tensor& grad_out, const Tensor& grad_w,
                                   const kernels::Conv2dGeometry& g);
bool onednn_max_pool2d_backward(const Tensor& x, const Tensor& grad_out, const Tensor& grad_x,
                                const kernels::Pool2dGeometry& g);
bool onednn_avg_pool2d(const Tensor& x, const Tensor& out, const kernels::Pool2dGeometry& g);
bool onednn_avg_pool2d_backward(const Tensor& grad_out, const Tensor& grad_x,
                                const kernels::Pool2dGeometry& g);

// One row-major matmul after gemm.cpp's normalisation (normalize()): C[i] = op(A[i]) x
// op(B[i]) for i < batch, leading dimensions lda / ldb / ldc, batch strides sa / sb / sc (0:
// the matrix is shared by every batch item, and always 0 when batch is 1).
struct GemmShape {
  std::int64_t batch = 1, m = 0, n = 0, k = 0;
  bool ta = false, tb = false;
  std::int64_t lda = 0, ldb = 0, ldc = 0;
  std::int64_t sa = 0, sb = 0, sc = 0;
  // Rows and columns of each stored operand (before op()).
  std::int64_t rows_a() const { return ta ? k : m; }
  std::int64_t cols_a() const { return ta ? m : k; }
  std::int64_t rows_b() const { return tb ? n : k; }
  std::int64_t cols_b() const { return tb ? k : n; }
};
// bfloat16 operands and result on oneDNN's native bf16 matmul (float32 accumulation, one
// rounding of each result, as gemm.cpp's bulk conversion + sgemm path): only on CPUs with
// AVX512-BF16 or AMX, where it multiplies bfloat16 at twice float32's rate. Elsewhere, and
// for layouts oneDNN only has a reference implementation of, false. m, n, k > 0.
bool onednn_matmul_bf16(const GemmShape& g, const void* a, const void* b, void* c);
// The same product left in float32 (c: float32 with g's leading dimensions), unrounded: the
// fused linear op's, which rounds after its epilogue.
bool onednn_matmul_bf16_to_f32(const GemmShape& g, const void* a, const void* b, float* c);
// float32 products on oneDNN's matmul: a batch in one call instead of a loop of sgemm
// calls (OpenBLAS has no batched GEMM; the attention products are many small matrices), and
// single products where oneDNN has AVX-512 kernels (faster than sgemm there). False (the
// caller goes to OpenBLAS) when oneDNN is off or absent, for a single product without
// AVX-512, or for layouts it only has a reference implementation of. m, n, k > 0.
bool onednn_matmul_f32(const GemmShape& g, const float* a, const float* b, float* c);

}  // namespace mixtape::cpu
