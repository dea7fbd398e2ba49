// Step capture: a training step recorded once and replayed, so that a small model's step costs
// one launch of host work instead of one per op (on a GPU a CUDA graph; on the CPU the list of
// kernel calls, which also lets every test of the mechanism run without a GPU).
//
//   mt::StepGraph graph = mt::StepGraph::capture(device, [&] { train_step(x, y); });
//   for (...) {
//     x.assign(next_inputs);   // the step reads x and y where they lie: copy each batch in
//     y.assign(next_labels);
//     graph.replay();          // one training step
//   }
//
// capture() runs the step once as usual (the warm-up: the optimizer's slots, the plans and
// caches are made then), then calls it again while recording: that call's kernels are recorded
// on the device, not run, and its host code runs once, now. So everything a step reads must be
// on the device where the replays find it:
//   - tensors the step reads, at the same addresses (the inputs: copy each batch into them);
//   - host values that change from step to step go to the device before each replay, by a
//     hook the step's code registers with capture::before_replay (the optimizers' learning
//     rate and step count do so, dropout's seeds (draw_seed, mixtape/core/random_seed.h) and
//     the augmentation layers' tables (host_computed, below));
//   - tensors the step makes are the replays' outputs: a handle kept from the capture (the loss)
//     holds the last replay's value (nothing before the first replay).
// What cannot be replayed throws CaptureError during the capture, with nothing run: a host read
// of a tensor of the captured device (item, to_vector, a copy to the host, a synchronisation),
// a random draw from a Generator outside draw_seed and host_computed (each replay would repeat
// it), a kernel on another device (another type, or another GPU), a DistributedOptimizer or
// GradientAccumulationOptimizer, a replay of another StepGraph. On a GPU, another thread's
// allocation, copy, synchronisation or kernel on the captured device waits until the capture
// ends. A LossScaleOptimizer reads each replay's overflow flag when it queues the third replay
// after it (docs/training.md). The graph refers to the tensors, the model and the optimizer of
// the step: destroy it before them, and before moving the model to another device.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "mixtape/core/device.h"
#include "mixtape/core/dtype.h"
#include "mixtape/core/shape.h"

namespace mixtape {

class Tensor;

// A backend's recording of the work queued on one device during a capture.
class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Queues the recorded work once more.
  virtual void replay() = 0;
};

namespace capture {

// The device the calling thread is capturing a step on, or nullopt.
std::optional<Device> device();
inline bool active() { return device().has_value(); }

// Throws CaptureError "<what>: ..." when the calling thread is capturing: for code whose host
// work a replay would not repeat (a random draw, a host-side decision).
void forbid(std::string_view what);
// The same when the calling thread is capturing on `device`: a read of a value of that device,
// which the capture has not computed.
void forbid_read(Device device, std::string_view what);

// While capturing: registers f to run on the host before each replay, in the order registered
// (a learning rate or a step count written to the device tensor the captured kernels read), and
// after_replay's functions after it is queued. Throws CaptureError when not capturing.
void before_replay(std::function<void()> f);
void after_replay(std::function<void()> f);

// An uninitialised tensor for values written from outside the recorded work (by a
// before_replay hook) and read by the captured kernels. While capturing, its memory is its own:
// a backend that reuses memory within a capture (the CUDA graphs' pool) does not give it memory
// that kernels recorded earlier in the step use, which every replay would run after the hook,
// over its values. Outside a capture: Tensor::empty.
Tensor host_written(const Shape& shape, DType dtype, Device device);

namespace detail {
// True while host_written allocates on the calling thread: read by a backend's allocator.
bool fresh_memory();
// The capture state of the calling thread (null when it captures nothing): for KernelRef.
struct State;
State* state();
// A kernel of `op_name` for a device of type `type` is called while this thread captures: true
// when the call was recorded (the backend's kernels are host calls: `call` is kept for the
// replays and not run now), false when it is to run now (a device that records its launches).
// Throws CaptureError for a kernel of another device type than the captured one.
bool record_kernel(const char* op_name, DeviceType type, std::function<void()>& call);
// Called by a backend that records its launches, before a kernel queues work on `device`: throws
// CaptureError (naming the kernel's op) when the calling thread captures a step on another
// device (of the same type: another GPU), where the work would run once, now, and not be
// replayed.
void check_launch(Device device);
// Records a host function (a check the replays must repeat) when this thread captures on a
// device whose kernels are host calls; otherwise runs it now.
void record_or_run(const std::function<void()>& f);
}  // namespace detail

}  // namespace capture

// A tensor the host computes afresh at each step, for `device` (a random augmentation's table of
// source pixels): outside a capture, make()'s tensor, copied to `device`; while the calling
// thread captures a step, a tensor of `shape` and `dtype` on `device` that a before_replay hook
// fills with make()'s values before each replay (make is not called during the capture; it
// runs at each replay, in the order such tensors were made, so a generator it draws from
// gives the numbers eager steps would have drawn). make returns a contiguous CPU tensor of
// `shape` and `dtype` (ShapeError otherwise, from the call or from the replay) and may refer
// to what the graph refers to (a layer, its generator).
Tensor host_computed(const Shape& shape, DType dtype, Device device, std::function<Tensor()> make);

// A captured training step (see above). Move-only; destroying it frees the memory the capture
// held (after the device has finished its replays).
class StepGraph {
 public:
  StepGraph() = default;
  ~StepGraph();
  StepGraph(StepGraph&&) noexcept;
  StepGraph& operator=(StepGraph&&) noexcept;
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  // Runs step() once, then captures a second call on `device` (above). An exception of either
  // call reaches the caller; a failed capture leaves nothing recorded. Throws DeviceError when
  // the device's backend cannot capture.
  static StepGraph capture(Device device, const std::function<void()>& step);

  // One step: runs the before_replay hooks, queues the recorded work, runs the after_replay
  // hooks. Throws Error when empty.
  void replay();
  bool empty() const { return work_ == nullptr; }
  Device device() const { return device_; }
  // Replays so far.
  std::int64_t replays() const { return replays_; }

 private:
  Device device_ = Device::cpu();
  std::unique_ptr<CapturedWork> work_;
  std::vector<std::function<void()>> before_, after_;
  std::int64_t replays_ = 0;
};

}  // namespace mixtape
