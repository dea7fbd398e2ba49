// Step capture (mixtape/core/capture.h): the thread's capture state, the recording of host
// kernel calls, StepGraph.
#include "mixtape/core/capture.h"

#include <fmt/format.h>

#include <utility>

#include "core/raw.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/error.h"
#include "mixtape/core/random_seed.h"

namespace mixtape {
namespace capture {
namespace detail {

struct State {
  Device device;
  Backend* backend;
  bool host_calls;                           // the backend's kernels are host calls: kept here
  std::vector<std::function<void()>> calls;  // those calls, in order
  std::vector<std::function<void()>> before, after;
  const char* kernel = nullptr;  // the op of the kernel called last (for check_launch)
};

namespace {
thread_local State* t_state = nullptr;
thread_local bool t_fresh_memory = false;  // host_written is allocating
}  // namespace

State* state() { return t_state; }
bool fresh_memory() { return t_fresh_memory; }

bool record_kernel(const char* op_name, DeviceType type, std::function<void()>& call) {
  State* s = t_state;
  if (type != s->device.type())
    throw CaptureError(fmt::format(
        "{}: a {} kernel while capturing a step on {}: its work would not be replayed (a captured "
        "step runs on one device; move the tensors there)",
        op_name, device_type_name(type), s->device.str()));
  s->kernel = op_name;
  if (!s->host_calls) return false;
  s->calls.push_back(std::move(call));
  return true;
}

void check_launch(Device device) {
  const State* s = t_state;
  if (s == nullptr || device == s->device) return;
  throw CaptureError(fmt::format(
      "{}: work queued on {} while capturing a step on {}: it would run once, now, and not be "
      "replayed (a captured step runs on one device; move the tensors there)",
      s->kernel != nullptr ? s->kernel : "a kernel", device.str(), s->device.str()));
}

void record_or_run(const std::function<void()>& f) {
  State* s = t_state;
  if (s && s->host_calls)
    s->calls.push_back(f);
  else
    f();
}

}  // namespace detail

std::optional<Device> device() {
  if (detail::t_state) return detail::t_state->device;
  return std::nullopt;
}

void forbid(std::string_view what) {
  if (const detail::State* s = detail::t_state)
    throw CaptureError(
        fmt::format("{}, while capturing a step on {}: the replays would not repeat "
                    "it (mixtape/core/capture.h says what a captured step can do)",
                    what, s->device.str()));
}

void forbid_read(Device device, std::string_view what) {
  if (const detail::State* s = detail::t_state; s && s->device == device)
    throw CaptureError(fmt::format(
        "{}: a read of a value on {} while capturing a step there: the capture has not computed "
        "it (nothing runs until a replay); read the step's outputs after StepGraph::replay()",
        what, device.str()));
}

namespace {
detail::State& capturing(const char* who) {
  if (!detail::t_state)
    throw CaptureError(fmt::format("capture::{}: no step is being captured on this thread", who));
  return *detail::t_state;
}
}  // namespace

void before_replay(std::function<void()> f) {
  capturing("before_replay").before.push_back(std::move(f));
}
void after_replay(std::function<void()> f) {
  capturing("after_replay").after.push_back(std::move(f));
}

Tensor host_written(const Shape& shape, DType dtype, Device device) {
  struct Fresh {
    Fresh() { detail::t_fresh_memory = true; }
    ~Fresh() { detail::t_fresh_memory = false; }
  } fresh;
  return Tensor::empty(shape, dtype, device);
}

}  // namespace capture

Tensor host_computed(const Shape& shape, DType dtype, Device device, std::function<Tensor()> make) {
  const auto checked = [shape, dtype](const Tensor& t) {
    if (!t.defined() || !t.device().is_cpu() || t.shape() != shape || t.dtype() != dtype ||
        !t.is_contiguous())
      throw ShapeError(fmt::format(
          "host_computed: the host's tensor must be a contiguous CPU tensor {}{}; got {}",
          dtype.name(), shape.str(),
          t.defined()
              ? fmt::format("{}{} on {}", t.dtype().name(), t.shape().str(), t.device().str())
              : std::string("an undefined tensor")));
    return t;
  };
  if (!capture::active()) return detail::to_device_raw(checked(make()), device);
  Tensor at = capture::host_written(shape, dtype, device);
  // Each replay's values, computed on the host outside the capture and written where the
  // captured kernels read them.
  capture::before_replay([make = std::move(make), checked, at]() mutable {
    const Tensor t = checked(make());
    backend_for(at.device().type())
        .copy(at.data_ptr(), at.device(), t.const_data_ptr(), Device::cpu(), t.nbytes());
  });
  return at;
}

RandomSeed draw_seed(Generator& gen, Device device) {
  if (!capture::active()) return RandomSeed(gen.next_u64());
  // Each replay's seed drawn on the host before it (outside the capture, where a draw is
  // allowed), its bits as an int64.
  RandomSeed seed;
  seed.on_device = host_computed(Shape{1}, kInt64, device, [gen]() mutable {
    return from_vector(std::vector<std::int64_t>{static_cast<std::int64_t>(gen.next_u64())},
                       Shape{1});
  });
  return seed;
}

namespace {
// The recording of a backend whose kernels are host calls: the calls, in order.
class HostCalls final : public CapturedWork {
 public:
  explicit HostCalls(std::vector<std::function<void()>> calls) : calls_(std::move(calls)) {}
  void replay() override {
    for (const auto& c : calls_) c();
  }

 private:
  std::vector<std::function<void()>> calls_;
};
}  // namespace

StepGraph::~StepGraph() = default;
StepGraph::StepGraph(StepGraph&&) noexcept = default;
StepGraph& StepGraph::operator=(StepGraph&&) noexcept = default;

StepGraph StepGraph::capture(Device device, const std::function<void()>& step) {
  if (capture::detail::t_state)
    throw CaptureError(
        fmt::format("StepGraph::capture on {}: this thread is capturing a step on {} "
                    "already (captures do not nest)",
                    device.str(), capture::detail::t_state->device.str()));
  check_device(device);
  Backend& backend = backend_for(device.type());
  step();  // the warm-up
  capture::detail::State state{device, &backend, backend.kernels_are_host_calls(), {}, {}, {}};
  if (!state.host_calls) backend.begin_capture(device.index());
  capture::detail::t_state = &state;
  try {
    step();
  } catch (...) {
    capture::detail::t_state = nullptr;
    if (!state.host_calls) backend.abort_capture(device.index());
    throw;
  }
  capture::detail::t_state = nullptr;
  StepGraph g;
  g.device_ = device;
  g.work_ = state.host_calls ? std::make_unique<HostCalls>(std::move(state.calls))
                             : backend.end_capture(device.index());
  g.before_ = std::move(state.before);
  g.after_ = std::move(state.after);
  return g;
}

void StepGraph::replay() {
  if (!work_) throw Error("StepGraph::replay: nothing captured (an empty StepGraph)");
  // Inside another capture its hooks would run once, now, and its work would not be recorded
  // (on the CPU) or be recorded with the hooks' values of now (a CUDA graph).
  capture::forbid("StepGraph::replay (a captured step replayed inside another capture)");
  for (const auto& f : before_) f();
  work_->replay();
  ++replays_;
  for (const auto& f : after_) f();
}

}  // namespace mixtape
