// The CPU kernels' OpenMP thread count under load (cpu_backend.h, "Threads under load").
//
// Why by hand: the OpenMP runtime has no such policy. libgomp's OMP_DYNAMIC follows the
// 15-minute load average (which counts this process's own threads too), and its wait
// policy can only be set in the environment before the program starts. Measured on a 2-core
// machine with one other process spinning (docs/benchmarks.md, "Training under load"):
// two threads, one of them sharing its core, trained 2.7 to 5.5 times slower than on a
// quiet machine (every parallel region waits for the thread that is not running, and
// OpenMP's spinning threads take time from the other process); one thread, 1.4 to 1.9
// times slower, the cost of the core that is gone. OMP_WAIT_POLICY=PASSIVE helped under
// load but made quiet runs 1.3 to 1.7 times slower (a sleeping thread is woken for every
// parallel region).
//
// So the backend measures, about every quarter of a second, how much of the CPUs it may
// run on other processes keep busy (/proc/stat's busy time of those CPUs less this
// process's own CPU time), and runs its kernels on the cores left over: between one thread
// and the OpenMP default. OpenBLAS (its OpenMP build), oneDNN and mixtape's own kernels all
// take their team size from omp_get_max_threads() of the calling thread, so the new count
// is applied with omp_set_num_threads() by each thread that runs kernels, at its next CPU
// allocation (every op allocates its output).
#include <omp.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backends/cpu/cpu_backend.h"
#include "core/env.h"

namespace mixtape::cpu {

// --- The decision ----------------------------------------------------------------------

int adapt_thread_count(int current, int ceiling, double others) {
  ceiling = std::max(ceiling, 1);
  current = std::clamp(current, 1, ceiling);
  const double left = static_cast<double>(ceiling) - std::max(others, 0.0);
  // A core counts as left while at least kThreadKeepCore of it is free, and comes back
  // once kThreadRegainCore of it is: the band between keeps the measurement's noise around
  // a boundary from moving the count back and forth.
  const auto cores = [&](double share) {
    return std::clamp(static_cast<int>(std::floor(left + 1.0 - share)), 1, ceiling);
  };
  if (const int keep = cores(kThreadKeepCore); keep < current) return keep;
  if (const int regain = cores(kThreadRegainCore); regain > current) return regain;
  return current;
}

std::optional<double> parse_busy_seconds(std::string_view stat, const std::vector<int>& cpus,
                                         long ticks_per_second) {
  if (ticks_per_second <= 0 || cpus.empty()) return std::nullopt;
  double busy_ticks = 0;
  std::size_t found = 0;
  while (!stat.empty()) {
    const std::size_t eol = stat.find('\n');
    std::string_view line = stat.substr(0, eol);
    stat = eol == std::string_view::npos ? std::string_view{} : stat.substr(eol + 1);
    // "cpuN user nice system idle iowait irq softirq steal guest guest_nice" (the aggregate
    // line "cpu " has no number and is skipped).
    if (line.size() < 4 || line.substr(0, 3) != "cpu" || line[3] < '0' || line[3] > '9') continue;
    int cpu = -1;
    const char* p = line.data() + 3;
    const char* end = line.data() + line.size();
    auto [q, ec] = std::from_chars(p, end, cpu);
    if (ec != std::errc() || std::find(cpus.begin(), cpus.end(), cpu) == cpus.end()) continue;
    // user, nice, system, idle, iowait, irq, softirq, steal: busy = all but idle and iowait
    // (guest time is already inside user). Steal is time the hypervisor gave to others.
    unsigned long long f[8] = {};
    int n = 0;
    for (; n < 8; ++n) {
      while (q < end && *q == ' ') ++q;
      auto [r, e] = std::from_chars(q, end, f[n]);
      if (e != std::errc()) break;
      q = r;
    }
    if (n < 4) return std::nullopt;  // not the format this parser knows
    busy_ticks += static_cast<double>(f[0] + f[1] + f[2] + f[5] + f[6] + f[7]);
    ++found;
  }
  if (found != cpus.size()) return std::nullopt;
  return busy_ticks / static_cast<double>(ticks_per_second);
}

ThreadGovernor::ThreadGovernor(int ceiling, Sampler sampler)
    : ceiling_(std::max(ceiling, 1)), sampler_(std::move(sampler)), target_(ceiling_) {}

int ThreadGovernor::observe() {
  std::optional<LoadReading> now = sampler_ ? sampler_() : std::nullopt;
  if (!now) return target_.load(std::memory_order_relaxed);
  if (last_) {
    const double wall = now->wall_seconds - last_->wall_seconds;
    if (wall > 0) {
      const double busy = now->busy_seconds - last_->busy_seconds;
      const double own = now->own_seconds - last_->own_seconds;
      const double others = std::max(0.0, (busy - own) / wall);
      smoothed_ = have_smoothed_ ? 0.5 * smoothed_ + 0.5 * others : others;
      have_smoothed_ = true;
      const int before = target_.load(std::memory_order_relaxed);
      const int after = adapt_thread_count(before, ceiling_, smoothed_);
      if (after != before) {
        target_.store(after, std::memory_order_relaxed);
        spdlog::debug(
            "cpu: other processes keep {:.2f} of {} core(s) busy; the CPU kernels now "
            "run on {} thread(s) (were {})",
            smoothed_, ceiling_, after, before);
      }
    }
  }
  last_ = now;
  return target_.load(std::memory_order_relaxed);
}

// --- The process's governor ------------------------------------------------------------

namespace {

// The CPUs this process may run on (its affinity mask).
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  return cpus;
}

double seconds_of(clockid_t clock) {
  timespec ts{};
  clock_gettime(clock, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The reading of the running system: /proc/stat for the CPUs, the process's CPU clock.
ThreadGovernor::Sampler system_sampler(std::vector<int> cpus) {
  const long ticks = sysconf(_SC_CLK_TCK);
  return [cpus = std::move(cpus), ticks]() -> std::optional<LoadReading> {
    std::ifstream in("/proc/stat");
    if (!in) return std::nullopt;
    std::ostringstream text;
    text << in.rdbuf();
    const std::optional<double> busy = parse_busy_seconds(text.str(), cpus, ticks);
    if (!busy) return std::nullopt;
    return LoadReading{seconds_of(CLOCK_MONOTONIC), *busy, seconds_of(CLOCK_PROCESS_CPUTIME_ID)};
  };
}

// Makes the team size a parallel region started on this thread asks for the one it gets
// (cpu_backend.h says why): OpenMP's dynamic adjustment off (with a warning once per
// process), and the count asked for no larger than what OMP_THREAD_LIMIT or inactive
// regions (omp_set_max_active_levels; inside a region of the program's own, one level
// deep by default) allow. Checked at every allocation: a program may change these at any
// time, and they are cheap to read.
void match_team_size() {
  if (omp_get_dynamic()) {
    omp_set_dynamic(0);
    static std::once_flag warned;
    std::call_once(warned, [] {
      spdlog::warn(
          "cpu: OpenMP dynamic thread adjustment (OMP_DYNAMIC / omp_set_dynamic) is turned off "
          "for mixtape's CPU kernels: oneDNN needs every thread a parallel region asks for, "
          "and with fewer it returns wrong results or hangs. The kernels' thread count "
          "follows the load by itself (MIXTAPE_CPU_THREADS_ADAPT).");
    });
  }
  const int team = omp_get_active_level() >= omp_get_max_active_levels()
                       ? 1
                       : std::min(omp_get_max_threads(), omp_get_thread_limit());
  if (omp_get_max_threads() > team) omp_set_num_threads(team);
}

// What the process runs: the governor when it adapts, and how often it looks.
struct ProcessThreads {
  bool adapts = false;
  int ceiling = 1;
  int initial = 1;  // the OpenMP count every thread starts with (may exceed the CPUs)
  std::unique_ptr<ThreadGovernor> governor;
  std::mutex observing;  // one thread takes a reading at a time (try_lock: others go on)
  std::atomic<std::int64_t> next_reading_ns{0};

  // Reads MIXTAPE_CPU_THREADS_ADAPT (a bad value throws ValueError from the first CPU
  // allocation, and again from the next one).
  ProcessThreads() {
    const bool wanted = detail::env::kCpuThreadsAdapt.read();
    match_team_size();  // OMP_THREAD_LIMIT, OMP_MAX_ACTIVE_LEVELS=0 lower the ceiling
    initial = ceiling = omp_get_max_threads();
    const std::vector<int> cpus = allowed_cpus();
    if (!cpus.empty()) ceiling = std::min(ceiling, static_cast<int>(cpus.size()));
    // OMP_NUM_THREADS asks for a fixed count (and runs that repeat bit for bit): kept.
    ThreadGovernor::Sampler sampler = system_sampler(cpus);
    adapts =
        wanted && std::getenv("OMP_NUM_THREADS") == nullptr && ceiling > 1 && sampler().has_value();
    if (adapts) governor = std::make_unique<ThreadGovernor>(ceiling, std::move(sampler));
    spdlog::debug("cpu: {} OpenMP thread(s){}", ceiling,
                  adapts ? ", fewer while other processes keep cores busy" : "");
  }
};

ProcessThreads& process_threads() {
  static ProcessThreads p;
  return p;
}

std::atomic<int> forced_target{0};  // the tests' override (0: none)

std::int64_t monotonic_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

void apply_thread_count() {
  match_team_size();
  ProcessThreads& p = process_threads();
  const int forced = forced_target.load(std::memory_order_relaxed);
  if (!p.adapts && forced == 0) return;

  // A reading every kThreadReadingPeriodNs at most, looked at every 16th allocation.
  thread_local unsigned countdown = 0;
  if (p.adapts && countdown-- == 0) {
    countdown = 15;
    const std::int64_t now = monotonic_ns();
    if (now >= p.next_reading_ns.load(std::memory_order_relaxed)) {
      std::unique_lock<std::mutex> lock(p.observing, std::try_to_lock);
      if (lock.owns_lock()) {
        p.next_reading_ns.store(now + kThreadReadingPeriodNs, std::memory_order_relaxed);
        p.governor->observe();
      }
    }
  }

  // This thread's OpenMP count follows the target, unless the program set a count of its
  // own on this thread (omp_set_num_threads): then that count stays.
  thread_local int applied = -1;  // -1: this thread has not applied one yet
  thread_local bool program_owned = false;
  if (program_owned) return;
  const int target = forced != 0 ? forced : p.governor->target();
  if (target == applied) return;
  const int current = omp_get_max_threads();
  if (current != (applied == -1 ? p.initial : applied)) {
    program_owned = true;
    return;
  }
  omp_set_num_threads(target);
  applied = target;
}

int thread_count_target() {
  ProcessThreads& p = process_threads();
  if (const int forced = forced_target.load(std::memory_order_relaxed)) return forced;
  return p.adapts ? p.governor->target() : omp_get_max_threads();
}

bool threads_adapt() { return process_threads().adapts; }

void force_thread_count_for_testing(int threads) {
  forced_target.store(std::max(threads, 0), std::memory_order_relaxed);
}

}  // namespace mixtape::cpu
