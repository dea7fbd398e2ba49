// The API sweep, environment variables (issue 18, item 8): every MIXTAPE_* variable the
// library reads refuses a bad value with a ValueError naming the variable, the value and
// the accepted values (docs/environment.md).
//
// The readers keep what they read (once per process), so a bad value in this process's
// environment would stay in force for every later test. Two kinds of tests therefore:
//   - the sweep: the parsers the readers use (core/env.h, one per kind of value), with the
//     readers' own variable descriptions, and the readers that read afresh on every call
//     (AmpLists::apply_environment, detail::parse_fp16_use_fp32_compute);
//   - hidden test cases ([.env_...]) that tests/CMakeLists.txt runs in a process of their
//     own with a bad value set (env.* in CTest): the first use of the variable (a tensor,
//     a layer call, a matmul, a convolution, set_auto_mixed_precision) throws ValueError,
//     and the next use throws it again.
#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "api_sweep.h"
#include "backends/cpu/cpu_backend.h"
#include "core/env.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace env = mt::detail::env;
using sweep::expect;

namespace {

// Sets a variable for the lifetime of the guard, then restores it.
class EnvGuard {
 public:
  EnvGuard(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~EnvGuard() {
    if (had_)
      ::setenv(name_.c_str(), old_.c_str(), 1);
    else
      ::unsetenv(name_.c_str());
  }
  EnvGuard(const EnvGuard&) = delete;
  EnvGuard& operator=(const EnvGuard&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

// AmpLists::apply_environment with `name` set to `value`.
void amp_env(const char* name, const char* value) {
  EnvGuard g(name, value);
  mt::AmpLists lists = mt::AmpLists::defaults();
  lists.apply_environment();
}

const std::vector<std::string_view> kFruit = {"apple", "pear"};

}  // namespace

TEST_CASE("sweep: environment variables", "[sweep][env]") {
  using mt::ValueError;
  sweep::run_sweep({
      // --- MIXTAPE_TRACE_DTYPES: "0" or "1" -------------------------------------------
      expect<ValueError>("MIXTAPE_TRACE_DTYPES=banana", [] { env::kTraceDtypes.parse("banana"); },
                         {"MIXTAPE_TRACE_DTYPES", "'banana'", "\"0\"", "\"1\"", "default"}),
      expect<ValueError>("MIXTAPE_TRACE_DTYPES=''", [] { env::kTraceDtypes.parse(""); },
                         {"MIXTAPE_TRACE_DTYPES", "''", "\"0\"", "\"1\""}),
      expect<ValueError>("MIXTAPE_TRACE_DTYPES=true", [] { env::kTraceDtypes.parse("true"); },
                         {"MIXTAPE_TRACE_DTYPES", "'true'", "\"0\"", "\"1\""}),
      expect<ValueError>("MIXTAPE_TRACE_DTYPES=' 1'", [] { env::kTraceDtypes.parse(" 1"); },
                         {"MIXTAPE_TRACE_DTYPES", "' 1'"}),
      // --- MIXTAPE_CPU_CACHE_MB: 0 .. 1048576 --------------------------------------------
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=-1", [] { env::kCpuCacheMb.parse("-1"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'-1'", "from 0 to 1048576", "1024"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=banana", [] { env::kCpuCacheMb.parse("banana"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'banana'", "from 0 to 1048576"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=''", [] { env::kCpuCacheMb.parse(""); },
                         {"MIXTAPE_CPU_CACHE_MB", "''", "from 0 to 1048576"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=512MB", [] { env::kCpuCacheMb.parse("512MB"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'512MB'", "from 0 to 1048576"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=1.5", [] { env::kCpuCacheMb.parse("1.5"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'1.5'"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=+5", [] { env::kCpuCacheMb.parse("+5"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'+5'"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB=' 5'", [] { env::kCpuCacheMb.parse(" 5"); },
                         {"MIXTAPE_CPU_CACHE_MB", "' 5'"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB above the maximum",
                         [] { env::kCpuCacheMb.parse("1048577"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'1048577'", "from 0 to 1048576"}),
      expect<ValueError>("MIXTAPE_CPU_CACHE_MB beyond uint64",
                         [] { env::kCpuCacheMb.parse("99999999999999999999999"); },
                         {"MIXTAPE_CPU_CACHE_MB", "'99999999999999999999999'"}),
      // --- MIXTAPE_CPU_ONEDNN: "0" or "1" ----------------------------------------------
      expect<ValueError>("MIXTAPE_CPU_ONEDNN=off", [] { env::kCpuOneDnn.parse("off"); },
                         {"MIXTAPE_CPU_ONEDNN", "'off'", "\"0\"", "\"1\"", "oneDNN"}),
      expect<ValueError>("MIXTAPE_CPU_ONEDNN=''", [] { env::kCpuOneDnn.parse(""); },
                         {"MIXTAPE_CPU_ONEDNN", "''", "\"0\"", "\"1\""}),
      // --- MIXTAPE_CPU_THREADS_ADAPT: "0" or "1" ---------------------------------------
      expect<ValueError>("MIXTAPE_CPU_THREADS_ADAPT=yes",
                         [] { env::kCpuThreadsAdapt.parse("yes"); },
                         {"MIXTAPE_CPU_THREADS_ADAPT", "'yes'", "\"0\"", "\"1\"", "threads"}),
      expect<ValueError>("MIXTAPE_CPU_THREADS_ADAPT=' 1'",
                         [] { env::kCpuThreadsAdapt.parse(" 1"); },
                         {"MIXTAPE_CPU_THREADS_ADAPT", "' 1'"}),
      // --- MIXTAPE_FP16_USE_FP32_COMPUTE: "0" or "1" (the model the others follow) ------
      expect<ValueError>("MIXTAPE_FP16_USE_FP32_COMPUTE=yes",
                         [] { mt::detail::parse_fp16_use_fp32_compute("yes"); },
                         {"MIXTAPE_FP16_USE_FP32_COMPUTE", "'yes'", "\"0\"", "\"1\"", "float32"}),
      // --- MIXTAPE_AMP_<LIST>_<ADD|REMOVE>: op names the rewrite knows -------------------
      expect<ValueError>("MIXTAPE_AMP_ALLOWLIST_ADD=to_device (no op consults that name)",
                         [] { amp_env("MIXTAPE_AMP_ALLOWLIST_ADD", "to_device"); },
                         {"MIXTAPE_AMP_ALLOWLIST_ADD", "'to_device'", "matmul", "conv2d"}),
      expect<ValueError>("MIXTAPE_AMP_DENYLIST_ADD=conv3d",
                         [] { amp_env("MIXTAPE_AMP_DENYLIST_ADD", "softmax, conv3d"); },
                         {"MIXTAPE_AMP_DENYLIST_ADD", "'conv3d'", "matmul"}),
      expect<ValueError>("MIXTAPE_AMP_INFERLIST_REMOVE=Tanh (names are case-sensitive)",
                         [] { amp_env("MIXTAPE_AMP_INFERLIST_REMOVE", "Tanh"); },
                         {"MIXTAPE_AMP_INFERLIST_REMOVE", "'Tanh'", "tanh"}),
      expect<ValueError>("MIXTAPE_AMP_CLEARLIST_ADD with an empty name",
                         [] { amp_env("MIXTAPE_AMP_CLEARLIST_ADD", "relu,,abs"); },
                         {"MIXTAPE_AMP_CLEARLIST_ADD", "'relu,,abs'", "empty", "relu"}),
      expect<ValueError>("MIXTAPE_AMP_ALLOWLIST_REMOVE=to_device",
                         [] { amp_env("MIXTAPE_AMP_ALLOWLIST_REMOVE", "to_device"); },
                         {"MIXTAPE_AMP_ALLOWLIST_REMOVE", "'to_device'"}),
      expect<ValueError>("AmpLists::set(\"to_device\")",
                         [] {
                           mt::AmpLists l = mt::AmpLists::defaults();
                           l.set("to_device", mt::AmpCategory::Allow);
                         },
                         {"AmpLists::set", "'to_device'", "matmul"}),
      // --- The list parser itself -------------------------------------------------------
      expect<ValueError>("a name list with a trailing comma",
                         [] {
                           env::NameListVar{"MIXTAPE_TEST_LIST", "fruit"}.parse("apple,", kFruit);
                         },
                         {"MIXTAPE_TEST_LIST", "'apple,'", "empty fruit name", "apple, pear"}),
  });
}

TEST_CASE("environment parsers: the accepted values", "[env]") {
  CHECK(env::kTraceDtypes.parse(nullptr) == false);
  CHECK(env::kTraceDtypes.parse("0") == false);
  CHECK(env::kTraceDtypes.parse("1") == true);
  CHECK(env::kCpuOneDnn.parse(nullptr) == true);
  CHECK(env::kCpuOneDnn.parse("0") == false);
  CHECK(env::kCpuThreadsAdapt.parse(nullptr) == true);
  CHECK(env::kCpuThreadsAdapt.parse("0") == false);
  CHECK(env::kCpuThreadsAdapt.parse("1") == true);
  CHECK(env::kFp16UseFp32Compute.parse(nullptr) == true);
  CHECK(env::kCudaLtEpilogues.parse(nullptr) == true);
  CHECK(env::kCudaLtEpilogues.parse("0") == false);
  CHECK_THROWS_AS(env::kCudaLtEpilogues.parse("off"), mt::ValueError);
  CHECK(env::kCudaAttentionWideKeys.parse(nullptr) == false);
  CHECK(env::kCudaAttentionWideKeys.parse("1") == true);
  CHECK_THROWS_AS(env::kCudaAttentionWideKeys.parse("128"), mt::ValueError);
  CHECK(env::kCpuCacheMb.parse(nullptr) == 1024);
  CHECK(env::kCpuCacheMb.parse("0") == 0);
  CHECK(env::kCpuCacheMb.parse("64") == 64);
  CHECK(env::kCpuCacheMb.parse("1048576") == 1048576);
  const env::NameListVar list{"MIXTAPE_TEST_LIST", "fruit"};
  CHECK(list.parse(nullptr, kFruit).empty());
  CHECK(list.parse("", kFruit).empty());
  CHECK(list.parse(" pear ,apple", kFruit) == std::vector<std::string>{"pear", "apple"});
}

TEST_CASE("a bad MIXTAPE_AMP_* value leaves the lists unchanged", "[env][amp]") {
  // ALLOWLIST is applied first and CLEARLIST last: a bad name in the last variable must not
  // leave the first one applied.
  EnvGuard good("MIXTAPE_AMP_ALLOWLIST_ADD", "gelu");
  EnvGuard bad("MIXTAPE_AMP_CLEARLIST_ADD", "relu, to_device");
  mt::AmpLists lists = mt::AmpLists::defaults();
  const std::string before = lists.str();
  CHECK_THROWS_AS(lists.apply_environment(), mt::ValueError);
  CHECK(lists.str() == before);
  CHECK(lists.category("gelu") == mt::AmpCategory::Infer);
}

TEST_CASE("the op names of the AMP lists are the ops that pass through the rewrite", "[env][amp]") {
  // Each name the MIXTAPE_AMP_* variables accept must be one an op asks the lists about:
  // run every op once and collect the names the rewrite saw.
  std::vector<std::string> seen;
  {
    mt::OpTraceScope trace;
    const mt::Tensor a = mt::uniform({2, 3}, 0.5, 1.0), b = mt::uniform({2, 3}, 0.5, 1.0);
    const mt::Tensor m = mt::uniform({3, 2}, 0.5, 1.0);
    const mt::Tensor img = mt::uniform({1, 4, 4, 2}, 0.5, 1.0);
    const mt::Tensor filt = mt::uniform({3, 3, 2, 2}, -1.0, 1.0);
    const mt::Tensor idx = mt::from_vector(std::vector<std::int64_t>{0, 1}, {2});
    const mt::Tensor gidx = mt::from_vector(std::vector<std::int64_t>{0, 1, 0, 1, 0, 1}, {2, 3});
    (void)mt::matmul(a, m);
    (void)mt::conv2d(img, filt);
    (void)mt::add(a, b), (void)mt::sub(a, b), (void)mt::mul(a, b), (void)mt::div(a, b);
    (void)mt::maximum(a, b), (void)mt::minimum(a, b), (void)mt::pow(a, b);
    // Every unary op of the op table (neg, abs, exp, ..., its public function each).
#define MIXTAPE_TEST_CALL_UNARY(name, ...) (void)mt::name(a);
    MIXTAPE_UNARY_OP_TABLE(MIXTAPE_TEST_CALL_UNARY)
#undef MIXTAPE_TEST_CALL_UNARY
    (void)mt::equal(a, b), (void)mt::not_equal(a, b), (void)mt::less(a, b);
    (void)mt::less_equal(a, b), (void)mt::greater(a, b), (void)mt::greater_equal(a, b);
    (void)mt::where(mt::less(a, b), a, b);
    (void)mt::sum(a), (void)mt::mean(a), (void)mt::max(a), (void)mt::min(a);
    (void)mt::argmax(a), (void)mt::softmax(a), (void)mt::log_softmax(a);
    (void)mt::masked_softmax(a, mt::less(a, b), 0.5);
    (void)mt::dropout(a, 0.5, 3);
    (void)mt::fused_attention(a, b, b, mt::Tensor(), true, 0.5);
    (void)mt::layer_norm(a, mt::Tensor(), mt::Tensor(), 1e-5);
    (void)mt::batch_norm(a, mt::Tensor(), mt::Tensor(), 1e-5);
    (void)mt::linear(a, m, mt::Tensor(), "relu");
    (void)mt::softmax_cross_entropy(a, mt::from_vector(std::vector<std::int64_t>{0, 2}, {2}));
    (void)mt::gather(a, gidx, 1), (void)mt::take(a, idx, 1);
    (void)mt::reshape(a, {3, 2}), (void)mt::permute(a, {1, 0}), (void)mt::slice(a, 1, 0, 2);
    (void)mt::expand(mt::reshape(a, {1, 2, 3}), {2, 2, 3}), (void)mt::concat({a, b}, 0);
    (void)mt::contiguous(mt::permute(a, {1, 0}));
    (void)mt::max_pool2d(img, {2, 2}, {2, 2}), (void)mt::avg_pool2d(img, {2, 2}, {2, 2});
    for (const auto& row : trace.rows()) seen.push_back(row.op);
  }
  for (std::string_view name : mt::amp_op_names()) {
    INFO("op name " << name);
    CHECK(std::find(seen.begin(), seen.end(), name) != seen.end());
  }
}

// --- In a process of their own (tests/CMakeLists.txt sets the bad value) -------------------

namespace {

// The value the test's process was started with.
std::string bad_value(const char* name) {
  const char* v = std::getenv(name);
  REQUIRE(v != nullptr);  // run through CTest (env.*), which sets it
  return v;
}

// `fn` throws ValueError naming the variable and its value, twice (not only the first time).
template <typename Fn>
void throws_twice(const char* name, Fn fn) {
  const std::string value = bad_value(name);
  for (int attempt = 0; attempt < 2; ++attempt) {
    INFO("attempt " << attempt);
    try {
      fn();
      FAIL_CHECK("no exception: " << name << "='" << value << "' was accepted");
    } catch (const mt::ValueError& e) {
      const std::string msg = e.what();
      INFO(msg);
      CHECK(msg.find(name) != std::string::npos);
      CHECK(msg.find("'" + value + "'") != std::string::npos);
      CHECK(msg.find("valid") != std::string::npos);
    }
  }
}

}  // namespace

TEST_CASE("a bad MIXTAPE_CPU_CACHE_MB: the first tensor throws ValueError", "[.env_cpu_cache_mb]") {
  throws_twice("MIXTAPE_CPU_CACHE_MB", [] { (void)mt::zeros({2, 2}); });
}

TEST_CASE("a bad MIXTAPE_TRACE_DTYPES: the first layer call throws ValueError",
          "[.env_trace_dtypes]") {
  const mt::Tensor x = mt::ones({2, 3});
  auto dense = mt::layers::Dense(4, {.kernel_initializer = mt::init::glorot_uniform(1)});
  throws_twice("MIXTAPE_TRACE_DTYPES", [&] { (void)dense(x); });
}

TEST_CASE("a bad MIXTAPE_FP16_USE_FP32_COMPUTE: the first float16 matmul throws ValueError",
          "[.env_fp16_use_fp32_compute]") {
  const mt::Tensor a = mt::ones({2, 2}, "float16");
  throws_twice("MIXTAPE_FP16_USE_FP32_COMPUTE", [&] { (void)mt::matmul(a, a); });
}

TEST_CASE("a bad MIXTAPE_CPU_ONEDNN: the first convolution throws ValueError",
          "[.env_cpu_onednn]") {
  if (!mt::cpu::onednn_available()) {
    WARN("built without oneDNN: MIXTAPE_CPU_ONEDNN is not read");
    return;
  }
  const mt::Tensor x = mt::ones({1, 4, 4, 2}), w = mt::ones({3, 3, 2, 2});
  throws_twice("MIXTAPE_CPU_ONEDNN", [&] { (void)mt::conv2d(x, w); });
}

TEST_CASE("a bad MIXTAPE_CPU_THREADS_ADAPT: the first tensor throws ValueError",
          "[.env_cpu_threads_adapt]") {
  throws_twice("MIXTAPE_CPU_THREADS_ADAPT", [] { (void)mt::zeros({2, 2}); });
}

TEST_CASE("a bad MIXTAPE_AMP_ALLOWLIST_ADD: enabling the rewrite throws ValueError",
          "[.env_amp_lists]") {
  throws_twice("MIXTAPE_AMP_ALLOWLIST_ADD", [] { mt::set_auto_mixed_precision(true); });
  CHECK_FALSE(mt::auto_mixed_precision_enabled());
}
