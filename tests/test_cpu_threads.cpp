// The CPU kernels' thread count under load (backends/cpu/threads.cpp): the decision, the
// /proc/stat parser, the governor on scripted readings, a thread following the target at
// its next CPU allocation, and (hidden, [.threads_load], its own CTest entry run alone) the
// real governor against a process that spins on one of this process's CPUs.
#include <omp.h>
#include <sched.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "kernel_cases.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace cpu = mixtape::cpu;

TEST_CASE("adapt_thread_count: the cores left, with a band against noise", "[cpu_threads]") {
  // Quiet: the whole ceiling.
  CHECK(cpu::adapt_thread_count(2, 2, 0.0) == 2);
  CHECK(cpu::adapt_thread_count(2, 2, 0.3) == 2);
  CHECK(cpu::adapt_thread_count(2, 2, 0.35) == 2);
  // One core taken (half to two thirds of it while this process still runs two threads).
  CHECK(cpu::adapt_thread_count(2, 2, 0.45) == 1);
  CHECK(cpu::adapt_thread_count(2, 2, 0.67) == 1);
  CHECK(cpu::adapt_thread_count(2, 2, 1.0) == 1);
  // Inside the band nothing moves back up.
  CHECK(cpu::adapt_thread_count(1, 2, 0.5) == 1);
  CHECK(cpu::adapt_thread_count(1, 2, 0.15) == 1);
  // The other process gone: back up.
  CHECK(cpu::adapt_thread_count(1, 2, 0.05) == 2);
  CHECK(cpu::adapt_thread_count(1, 2, 0.0) == 2);
  // Never below one thread, never above the ceiling.
  CHECK(cpu::adapt_thread_count(1, 2, 5.0) == 1);
  CHECK(cpu::adapt_thread_count(2, 2, 2.0) == 1);
  CHECK(cpu::adapt_thread_count(5, 4, 0.0) == 4);
  CHECK(cpu::adapt_thread_count(0, 4, 0.0) == 4);
  CHECK(cpu::adapt_thread_count(3, 1, 0.0) == 1);
  // Several cores: each counted while 60% free, regained when 90% free.
  CHECK(cpu::adapt_thread_count(8, 8, 3.2) == 5);
  CHECK(cpu::adapt_thread_count(8, 8, 3.5) == 4);
  CHECK(cpu::adapt_thread_count(5, 8, 3.0) == 5);
  CHECK(cpu::adapt_thread_count(5, 8, 2.5) == 5);
  CHECK(cpu::adapt_thread_count(5, 8, 2.05) == 6);
  CHECK(cpu::adapt_thread_count(5, 8, 0.05) == 8);
  CHECK(cpu::adapt_thread_count(2, 2, -1.0) == 2);  // a negative load counts as none
}

TEST_CASE("parse_busy_seconds: the busy ticks of the chosen CPUs", "[cpu_threads]") {
  const char* stat =
      "cpu  1000 0 500 9000 20 0 0 0 0 0\n"
      "cpu0 100 10 50 4000 7 3 2 5 40 0\n"
      "cpu1 900 0 450 5000 13 0 0 0 0 0\n"
      "cpu12 1 1 1 1 1 1 1 1 0 0\n"
      "intr 12345 1 2 3\n"
      "ctxt 99\n";
  // cpu0: user 100 + nice 10 + system 50 + irq 3 + softirq 2 + steal 5 (idle, iowait and
  // guest, which is inside user, left out) = 170 ticks.
  CHECK(cpu::parse_busy_seconds(stat, {0}, 100) == Approx(1.70));
  CHECK(cpu::parse_busy_seconds(stat, {1}, 100) == Approx(13.50));
  CHECK(cpu::parse_busy_seconds(stat, {0, 1}, 100) == Approx(15.20));
  CHECK(cpu::parse_busy_seconds(stat, {12}, 100) == Approx(0.06));
  CHECK(cpu::parse_busy_seconds(stat, {1}, 250) == Approx(5.40));
  // A CPU without its line, no CPUs, no clock rate: nothing.
  CHECK_FALSE(cpu::parse_busy_seconds(stat, {2}, 100).has_value());
  CHECK_FALSE(cpu::parse_busy_seconds(stat, {0, 2}, 100).has_value());
  CHECK_FALSE(cpu::parse_busy_seconds(stat, {}, 100).has_value());
  CHECK_FALSE(cpu::parse_busy_seconds(stat, {0}, 0).has_value());
  // A line of another format (too few fields).
  CHECK_FALSE(cpu::parse_busy_seconds("cpu0 1 2\n", {0}, 100).has_value());
  CHECK_FALSE(cpu::parse_busy_seconds("", {0}, 100).has_value());
  // The real file has a line for every CPU this process may run on.
  std::vector<int> mine;
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) mine.push_back(c);
  FILE* f = std::fopen("/proc/stat", "r");
  if (f) {
    std::string text(1 << 16, '\0');
    text.resize(std::fread(text.data(), 1, text.size(), f));
    std::fclose(f);
    const std::optional<double> busy = cpu::parse_busy_seconds(text, mine, sysconf(_SC_CLK_TCK));
    REQUIRE(busy.has_value());
    CHECK(*busy > 0);
  }
}

namespace {

// A sampler that replays a script of readings: each step adds `wall` seconds, of which the
// other processes use `others` cores and this process `own` cores.
struct Script {
  struct Step {
    double wall, others, own;
  };
  std::deque<Step> steps;
  cpu::LoadReading at{100.0, 5000.0, 3.0};

  cpu::ThreadGovernor::Sampler sampler() {
    return [this]() -> std::optional<cpu::LoadReading> {
      if (steps.empty()) return std::nullopt;
      const Step s = steps.front();
      steps.pop_front();
      at.wall_seconds += s.wall;
      at.busy_seconds += s.wall * (s.others + s.own);
      at.own_seconds += s.wall * s.own;
      return at;
    };
  }
};

}  // namespace

TEST_CASE("ThreadGovernor: follows the other processes' load, not its own", "[cpu_threads]") {
  Script script;
  cpu::ThreadGovernor g(2, script.sampler());
  CHECK(g.ceiling() == 2);
  CHECK(g.target() == 2);
  // The first reading only sets the origin.
  script.steps = {{0.25, 1.0, 1.0}};
  CHECK(g.observe() == 2);
  // This process busy on both cores, nothing else: stays at 2.
  script.steps = {{0.25, 0.02, 2.0}, {0.25, 0.05, 1.9}, {0.25, 0.0, 2.0}};
  for (int i = 0; i < 3; ++i) CHECK(g.observe() == 2);
  // A short burst (another process for part of one reading) is smoothed away.
  script.steps = {{0.25, 0.6, 1.4}};
  CHECK(g.observe() == 2);
  script.steps = {{0.25, 0.0, 2.0}, {0.25, 0.0, 2.0}, {0.25, 0.0, 2.0}};
  for (int i = 0; i < 3; ++i) CHECK(g.observe() == 2);
  // A process spinning on one core: it gets 2/3 of a core against two threads, then one.
  script.steps = {{0.25, 0.67, 1.33}, {0.25, 0.67, 1.33}};
  CHECK(g.observe() == 2);
  CHECK(g.observe() == 1);
  script.steps = {{0.25, 1.0, 1.0}, {0.25, 1.0, 1.0}, {0.25, 1.0, 1.0}};
  for (int i = 0; i < 3; ++i) CHECK(g.observe() == 1);
  // It stops: back to two threads once the smoothed load is under a tenth of a core (the
  // fourth reading: about 0.47, 0.23, 0.12, 0.06 of a core).
  script.steps = {{0.25, 0.0, 1.0}, {0.25, 0.0, 1.0}, {0.25, 0.0, 1.0}, {0.25, 0.0, 1.0}};
  for (int i = 0; i < 3; ++i) CHECK(g.observe() == 1);
  CHECK(g.observe() == 2);
  // No reading (the file went away): the target stays.
  CHECK(script.steps.empty());
  CHECK(g.observe() == 2);
  // A clock that did not move changes nothing.
  script.steps = {{0.0, 0.0, 0.0}};
  CHECK(g.observe() == 2);
}

TEST_CASE("ThreadGovernor: eight cores, three taken", "[cpu_threads]") {
  Script script;
  cpu::ThreadGovernor g(8, script.sampler());
  script.steps = {{0.25, 0, 8}, {0.25, 3, 5}, {0.25, 3, 5}, {0.25, 3, 5}};
  for (int i = 0; i < 4; ++i) g.observe();
  CHECK(g.target() == 5);
  cpu::ThreadGovernor one(1, script.sampler());
  script.steps = {{0.25, 0, 1}, {0.25, 0, 1}};
  one.observe();
  CHECK(one.observe() == 1);
}

TEST_CASE("CPU threads: a thread takes the target at its next CPU allocation", "[cpu_threads]") {
  const int before = omp_get_max_threads();
  // Restores the count of this thread (and the tests' override) however the test ends.
  struct Restore {
    int count;
    ~Restore() {
      cpu::force_thread_count_for_testing(count);
      (void)mt::ones({1});
      cpu::force_thread_count_for_testing(0);
    }
  } restore{before};

  cpu::force_thread_count_for_testing(1);
  (void)mt::ones({4});
  CHECK(omp_get_max_threads() == 1);
  CHECK(cpu::thread_count_target() == 1);
  // A kernel's parallel region then runs on one thread.
  int team = 0;
#pragma omp parallel
  {
#pragma omp single
    team = omp_get_num_threads();
  }
  CHECK(team == 1);
  // The kernels give the same results on the new count.
  const mt::Tensor a = mtest::random({64, 96}, mt::kFloat32);
  const mt::Tensor b = mtest::random({96, 32}, mt::kFloat32);
  const mt::Tensor one_thread = mt::matmul(a, b);
  cpu::force_thread_count_for_testing(before);
  const mt::Tensor all_threads = mt::matmul(a, b);
  CHECK(omp_get_max_threads() == before);
  double worst = 0;
  for (std::int64_t i = 0; i < one_thread.numel(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(one_thread.data<float>()[i]) -
                                     all_threads.data<float>()[i]));
  CHECK(worst <= 1e-5);

  // A thread whose count the program set itself keeps it.
  int kept = 0, followed = 0;
  std::thread([&] {
    omp_set_num_threads(before + 3);
    cpu::force_thread_count_for_testing(1);
    (void)mt::ones({4});
    kept = omp_get_max_threads();
  }).join();
  CHECK(kept == before + 3);
  // A new thread that did not set one follows.
  std::thread([&] {
    (void)mt::ones({4});
    followed = omp_get_max_threads();
  }).join();
  CHECK(followed == 1);
}

// A parallel region may get fewer threads than omp_get_max_threads() says: with OpenMP's
// dynamic adjustment on (OMP_DYNAMIC=true or omp_set_dynamic; libgomp then follows the
// load average), under OMP_THREAD_LIMIT, or where regions are inactive
// (omp_set_max_active_levels). oneDNN, which splits its work for the count it asks for,
// then left part of a batched float32 matmul uncomputed and hung in a convolution. The CPU
// backend makes the count asked for the count a region gets before a kernel runs.
namespace {

// A batched float32 matmul (oneDNN's) and a convolution, against values known exactly.
void check_ones_and_conv() {
  const mt::Tensor y = mt::matmul(mt::ones({3, 1, 4096}), mt::ones({3, 4096, 2}));
  CHECK(y.to_vector<double>() == std::vector<double>(6, 4096.0));
  // All-ones 3x3x3 filters over all-ones input, valid padding: every output is 27.
  const mt::Tensor c = mt::conv2d(mt::ones({8, 12, 12, 3}), mt::ones({3, 3, 3, 16}));
  CHECK(c.to_vector<double>() == std::vector<double>(8 * 10 * 10 * 16, 27.0));
}

}  // namespace

TEST_CASE("CPU threads: OpenMP's dynamic adjustment is off before a kernel runs", "[cpu_threads]") {
  struct Restore {
    ~Restore() { omp_set_dynamic(0); }
  } restore;
  omp_set_dynamic(1);
  REQUIRE(omp_get_dynamic() != 0);
  check_ones_and_conv();
  CHECK(omp_get_dynamic() == 0);
  // On another thread too (a new thread starts from the program's setting).
  int dynamic_after = -1;
  std::thread([&] {
    omp_set_dynamic(1);
    check_ones_and_conv();
    dynamic_after = omp_get_dynamic();
  }).join();
  CHECK(dynamic_after == 0);
}

TEST_CASE("CPU threads: kernels where parallel regions are inactive", "[cpu_threads]") {
  // No parallel region at all (max active levels 0), on a thread of its own so that the
  // one count it gets does not stay on the main thread.
  std::thread([] {
    omp_set_max_active_levels(0);
    check_ones_and_conv();
    CHECK(omp_get_max_threads() == 1);
  }).join();
  // Called from inside a parallel region of the program's own (nested regions inactive, by
  // default): each thread's kernels run on one thread and agree.
  // Softmax and layer_norm, small (run without a team of their own outside any region) and
  // large (a team of their own), reach parallel_region (backends/cpu/cpu_util.h): inside the
  // program's region each thread must compute every row of its own call, not share its loop
  // with the program's team.
  const mt::Tensor small = mt::normal({4, 8}), large = mt::normal({512, 256});
  const mt::Tensor gamma = mt::normal({8}), beta = mt::normal({8});
  const std::vector<float> small_softmax = mt::softmax(small).to_vector<float>(),
                           large_softmax = mt::softmax(large).to_vector<float>(),
                           small_norm = mt::layer_norm(small, gamma, beta, 1e-5).to_vector<float>();
  const int before = omp_get_max_active_levels();
  omp_set_max_active_levels(1);
  std::vector<int> ok(2, 0), rows_ok(2, 0);
#pragma omp parallel num_threads(2)
  {
    const mt::Tensor y = mt::matmul(mt::ones({3, 1, 4096}), mt::ones({3, 4096, 2}));
    ok[omp_get_thread_num()] = y.to_vector<double>() == std::vector<double>(6, 4096.0);
    rows_ok[omp_get_thread_num()] =
        mt::softmax(small).to_vector<float>() == small_softmax &&
        mt::softmax(large).to_vector<float>() == large_softmax &&
        mt::layer_norm(small, gamma, beta, 1e-5).to_vector<float>() == small_norm;
  }
  omp_set_max_active_levels(before);
  CHECK(ok == std::vector<int>(2, 1));
  CHECK(rows_ok == std::vector<int>(2, 1));
}

// Run by CTest with OMP_THREAD_LIMIT=1 (cpu_threads.omp_thread_limit): teams of one thread
// whatever omp_get_max_threads() said.
TEST_CASE("CPU threads: kernels under OMP_THREAD_LIMIT", "[.omp_thread_limit]") {
  REQUIRE(omp_get_thread_limit() == 1);
  check_ones_and_conv();
  CHECK(omp_get_max_threads() == 1);
}

// The real governor (run alone by CTest, OMP_NUM_THREADS unset): a child process spins on
// one of this process's CPUs; the count drops by one within a few seconds of readings, and
// comes back when the child is gone.
TEST_CASE("CPU threads: one fewer while another process spins", "[.threads_load]") {
  if (cpu::thread_count_target() < 2) {
    WARN("this process may run on one CPU only: there is no thread to give up");
    return;
  }
  REQUIRE(cpu::threads_adapt());
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof(set), &set) == 0);
  int last_cpu = -1;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) last_cpu = c;
  const int ceiling = cpu::thread_count_target();
  REQUIRE(ceiling >= 2);

  // Allocations (the governor's clock) at a slow pace for up to `limit`, until pred holds.
  auto wait_for = [](auto pred, std::chrono::seconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    while (std::chrono::steady_clock::now() < end) {
      for (int i = 0; i < 16; ++i) (void)mt::ones({8});
      if (pred()) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return pred();
  };
  REQUIRE(
      wait_for([&] { return cpu::thread_count_target() == ceiling; }, std::chrono::seconds(20)));

  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(last_cpu, &one);
    sched_setaffinity(0, sizeof(one), &one);
    volatile unsigned long spins = 0;
    for (;;) spins = spins + 1;
  }
  const bool dropped =
      wait_for([&] { return cpu::thread_count_target() == ceiling - 1; }, std::chrono::seconds(10));
  const int under_load = omp_get_max_threads();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  CHECK(dropped);
  CHECK(under_load == ceiling - 1);
  CHECK(wait_for([&] { return cpu::thread_count_target() == ceiling; }, std::chrono::seconds(20)));
  CHECK(omp_get_max_threads() == ceiling);
}
