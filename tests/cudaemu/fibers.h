// Test support: cooperative fibers on the calling thread, for the host emulation of a CUDA
// thread block (tests/cudaemu/cuda_emulation.cpp): each thread of the block a fiber that runs
// until it reaches a barrier, then hands over to the next. Not an OS
// thread per emulated thread: a barrier of 128 threads on a machine of two cores would cost a
// trip through the kernel's scheduler for each of them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <vector>

namespace mixtape::cuda_emu {

class Fibers {
 public:
  // A barrier of `expected` fibers; each phase ends when the last of them arrives.
  struct Barrier {
    int expected;
    int arrived = 0;
    std::uint64_t phase = 0;
  };

  // The order in which run() resumes the fibers that can go on, each time it goes round them:
  // by index, by index backwards, or a fresh random permutation each round. A GPU promises
  // no order between barriers; a kernel whose result depends on it has a race.
  enum class Order { forward, reverse, shuffled };

  explicit Fibers(int count);
  ~Fibers();
  Fibers(const Fibers&) = delete;
  Fibers& operator=(const Fibers&) = delete;

  // body(i) on fiber i for i in [0, count), until every fiber has returned; rethrows what a
  // fiber threw. Throws std::logic_error when the fibers wait on barriers that no fiber will
  // complete (a kernel whose threads disagree on their barriers would hang on the GPU).
  void run(std::function<void(int)> body);

  // The order of the next runs (forward until set); seed: the shuffled order's generator's.
  void set_order(Order order, std::uint64_t seed = 0);

  // Called on a fiber: waits until every fiber of b has arrived.
  void arrive_and_wait(Barrier& b);

  // Called on a fiber: its index in [0, count).
  static int current() { return static_cast<int>(current_index_); }

 private:
  struct Fiber;
  void start(Fiber& f);
  void release(Fiber& f);
  static void entry();
  void switch_to(Fiber& f);
  [[noreturn]] void finish(Fiber& f);
  void suspend(Fiber& f);

  void next_round();

  std::vector<std::unique_ptr<Fiber>> fibers_;
  std::vector<std::size_t> round_;  // the fibers' indices in this round's order
  Order order_ = Order::forward;
  std::mt19937_64 shuffle_;
  std::vector<std::unique_ptr<char[]>> stacks_;  // as many as ever ran at once
  std::vector<char*> free_stacks_;
  std::function<void(int)> body_;
  std::exception_ptr error_;
  void* scheduler_ = nullptr;  // the scheduler's saved context
  [[maybe_unused]] const void* scheduler_stack_ = nullptr;
  [[maybe_unused]] std::size_t scheduler_stack_size_ = 0;
  [[maybe_unused]] void* scheduler_tsan_ = nullptr;
  static inline thread_local Fibers* current_ = nullptr;
  static inline thread_local std::size_t current_index_ = 0;
};

}  // namespace mixtape::cuda_emu
