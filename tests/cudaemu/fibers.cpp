// Test support: tests/cudaemu/fibers.h. On x86-64 a fiber switch saves the callee-saved
// registers on the old stack and loads the new one, a few instructions (the floating-point
// control words are left as they are: nothing that runs on a fiber changes them); elsewhere it
// is ucontext's swapcontext, which also saves the signal mask with a system call each time (the
// emulated attention kernels switch fibers at every warp exchange). A fiber takes a stack when
// it first runs and gives it back when it returns, so that the threads of a kernel without
// barriers run one after the other on one stack, warm in the cache.
#include "tests/cudaemu/fibers.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <utility>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

namespace mixtape::cuda_emu {
namespace {

constexpr std::size_t kStackBytes = std::size_t{1} << 20;  // virtual; touched in part

#if defined(__x86_64__)
// mixtape_fiber_switch(save, load): pushes rbp, rbx and r12-r15, stores the stack pointer in
// *save, takes `load` as the stack pointer and pops the same from it (System V: every other
// register is the caller's to save).
extern "C" void mixtape_fiber_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .globl mixtape_fiber_switch
  .hidden mixtape_fiber_switch
  .type mixtape_fiber_switch, @function
mixtape_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size mixtape_fiber_switch, .-mixtape_fiber_switch
)");

// A new fiber's first switch pops six zeroed registers and returns into `start` with the
// stack aligned as at a function's entry (a null return address above it).
void* initial_context(char* stack, std::size_t bytes, void (*start)()) {
  const auto top = reinterpret_cast<std::uintptr_t>(stack + bytes) & ~std::uintptr_t{15};
  auto* sp = reinterpret_cast<std::uint64_t*>(top - 64);
  std::memset(sp, 0, 64);
  sp[6] = reinterpret_cast<std::uint64_t>(start);
  return sp;
}
#endif

}  // namespace

struct Fibers::Fiber {
  char* stack = nullptr;  // while it runs or waits; from stacks_
#if defined(__x86_64__)
  void* context = nullptr;
#else
  ucontext_t context;
#endif
  Barrier* waiting_on = nullptr;
  std::uint64_t phase = 0;
  bool started = false;
  bool done = false;
  [[maybe_unused]] void* tsan = nullptr;
};

#if defined(__x86_64__)
#define MIXTAPE_FIBER_SWAP(save, load) mixtape_fiber_switch(&(save), (load))
#else
#define MIXTAPE_FIBER_SWAP(save, load) \
  swapcontext(static_cast<ucontext_t*>(save), static_cast<ucontext_t*>(load))
#endif

Fibers::Fibers(int count) {
  for (int i = 0; i < count; ++i) fibers_.push_back(std::make_unique<Fiber>());
  for (int i = 0; i < count; ++i) round_.push_back(static_cast<std::size_t>(i));
#if !defined(__x86_64__)
  scheduler_ = new ucontext_t{};
#endif
}

Fibers::~Fibers() {
#if !defined(__x86_64__)
  delete static_cast<ucontext_t*>(scheduler_);
#endif
}

// Fiber f's first context, on a stack from the pool.
void Fibers::start(Fiber& f) {
  if (free_stacks_.empty()) {
    stacks_.push_back(std::make_unique_for_overwrite<char[]>(kStackBytes));
    free_stacks_.push_back(stacks_.back().get());
  }
  f.stack = free_stacks_.back();
  free_stacks_.pop_back();
  f.started = true;
#if defined(__x86_64__)
  f.context = initial_context(f.stack, kStackBytes, &Fibers::entry);
#else
  getcontext(&f.context);
  f.context.uc_stack.ss_sp = f.stack;
  f.context.uc_stack.ss_size = kStackBytes;
  f.context.uc_link = nullptr;  // entry() switches back itself
  makecontext(&f.context, &Fibers::entry, 0);
#endif
#if defined(__SANITIZE_THREAD__)
  f.tsan = __tsan_create_fiber(0);
#endif
}

void Fibers::set_order(Order order, std::uint64_t seed) {
  order_ = order;
  shuffle_.seed(seed);
  for (std::size_t i = 0; i < round_.size(); ++i)
    round_[i] = order == Order::reverse ? round_.size() - 1 - i : i;
}

void Fibers::next_round() {
  if (order_ == Order::shuffled) std::shuffle(round_.begin(), round_.end(), shuffle_);
}

void Fibers::run(std::function<void(int)> body) {
  body_ = std::move(body);
  for (auto& f : fibers_) *f = Fiber{};
  std::size_t finished = 0;
  while (finished < fibers_.size()) {
    bool progress = false;
    next_round();
    for (const std::size_t i : round_) {
      Fiber& f = *fibers_[i];
      if (f.done || (f.waiting_on != nullptr && f.waiting_on->phase == f.phase)) continue;
      f.waiting_on = nullptr;
      if (!f.started) start(f);
      current_ = this;
      current_index_ = i;
      switch_to(f);
      progress = true;
      if (f.done) {  // its stack is not returned to
        ++finished;
        release(f);
      }
    }
    if (!progress) break;
  }
  for (auto& f : fibers_)  // the stacks of fibers left waiting (the error below)
    if (f->stack != nullptr) release(*f);
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  if (finished < fibers_.size())
    throw std::logic_error("emulated block: its threads wait at barriers that never complete");
}

// Fiber f's stack back to the pool. Its frames never returned: AddressSanitizer's marks of
// their redzones are cleared, or the next fiber on the stack would be reported for them.
void Fibers::release(Fiber& f) {
#if defined(__SANITIZE_ADDRESS__)
  __asan_unpoison_memory_region(f.stack, kStackBytes);
#endif
#if defined(__SANITIZE_THREAD__)
  __tsan_destroy_fiber(f.tsan);
#endif
  free_stacks_.push_back(std::exchange(f.stack, nullptr));
}

void Fibers::arrive_and_wait(Barrier& b) {
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.phase;  // the others run again; this one goes on
    return;
  }
  Fiber& f = *fibers_[current_index_];
  f.waiting_on = &b;
  f.phase = b.phase;
  suspend(f);
}

void Fibers::entry() {
  Fibers& self = *current_;
  const std::size_t i = current_index_;
#if defined(__SANITIZE_ADDRESS__)  // AddressSanitizer learns the scheduler's stack
  __sanitizer_finish_switch_fiber(nullptr, &self.scheduler_stack_, &self.scheduler_stack_size_);
#endif
  try {
    self.body_(static_cast<int>(i));
  } catch (...) {  // not across the fiber's first frame: run() rethrows it
    if (!self.error_) self.error_ = std::current_exception();
  }
  self.finish(*self.fibers_[i]);
}

// The scheduler's side: runs fiber f until it waits or returns.
void Fibers::switch_to(Fiber& f) {
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, f.stack, kStackBytes);
#endif
#if defined(__SANITIZE_THREAD__)
  scheduler_tsan_ = __tsan_get_current_fiber();
  __tsan_switch_to_fiber(f.tsan, 0);
#endif
#if defined(__x86_64__)
  MIXTAPE_FIBER_SWAP(scheduler_, f.context);
#else
  MIXTAPE_FIBER_SWAP(scheduler_, &f.context);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// A fiber's side: back to the scheduler until its barrier completes.
void Fibers::suspend(Fiber& f) {
#if defined(__SANITIZE_ADDRESS__)
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, scheduler_stack_, scheduler_stack_size_);
#endif
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(scheduler_tsan_, 0);
#endif
#if defined(__x86_64__)
  MIXTAPE_FIBER_SWAP(f.context, scheduler_);
#else
  MIXTAPE_FIBER_SWAP(&f.context, scheduler_);
#endif
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

// A fiber's side, for good: its stack is not returned to.
void Fibers::finish(Fiber& f) {
  f.done = true;
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(nullptr, scheduler_stack_, scheduler_stack_size_);
#endif
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(scheduler_tsan_, 0);
#endif
#if defined(__x86_64__)
  void* unused = nullptr;
  MIXTAPE_FIBER_SWAP(unused, scheduler_);
#else
  setcontext(static_cast<ucontext_t*>(scheduler_));
#endif
  __builtin_unreachable();
}

}  // namespace mixtape::cuda_emu
