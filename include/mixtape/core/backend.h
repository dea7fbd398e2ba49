// Backend: what a device type provides to core (memory, copies, synchronisation).
// Kernels are registered separately, per (op, dtype), in the dispatch table
// (mixtape/core/dispatch.h).
//
// Core names no backend: each backend library announces itself with
// add_backend_initializer, from its header (mixtape/backends/cpu.h, mixtape/backends/cuda.h):
// a program that includes the header (mixtape/mixtape.h includes the CPU one, and the CUDA
// one when the program links mixtape::cuda) has the backend registered, with its kernels,
// before its first tensor. A program that registers none gets a DeviceError saying so.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "mixtape/core/capture.h"
#include "mixtape/core/device.h"

namespace mixtape {

// What a backend knows about one of its devices.
struct DeviceProperties {
  std::string name;       // "CPU", "NVIDIA H100 80GB HBM3", ...
  int compute_major = 0;  // CUDA compute capability (0 for the CPU)
  int compute_minor = 0;
  std::size_t total_memory = 0;  // bytes (0 when unknown)
  int multiprocessors = 0;       // CUDA streaming multiprocessors (0 for the CPU)
};

// A small read from a device, queued behind the work queued before it (Backend::read_back).
class PendingRead {
 public:
  virtual ~PendingRead() = default;
  // Waits until the read is done (the work queued before it, not what was queued after)
  // and copies its bytes to dst.
  virtual void wait(void* dst) = 0;
  // Whether wait() would return at once.
  virtual bool ready() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual DeviceType type() const = 0;
  virtual std::string name() const = 0;
  // Devices of this type present at run time (0 when none; the CPU has 1).
  virtual int device_count() const = 0;

  virtual void* allocate(std::size_t nbytes, int device_index) = 0;
  virtual void deallocate(void* ptr, std::size_t nbytes, int device_index) = 0;
  // Copies nbytes. `dst_device`/`src_device` name the two sides; one side may be the host
  // (Device::cpu()) for a backend other than the CPU one.
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device,
                    std::size_t nbytes) = 0;
  // Waits until the work queued on the device is done.
  virtual void synchronize(int device_index) = 0;
  // Starts reading nbytes (at most kMaxReadBack) from the device once the work queued so far
  // is done, without waiting for it: a flag the host needs later, while the device goes on
  // with what is queued after. The default reads at once (copy()).
  static constexpr std::size_t kMaxReadBack = 64;
  virtual std::unique_ptr<PendingRead> read_back(const void* src, int device_index,
                                                 std::size_t nbytes);
  // The device's name and capabilities.
  virtual DeviceProperties properties(int device_index) const = 0;
  // Starts (on) or ends the range that an attached profiler records when told to record only
  // such ranges (CUDA: cudaProfilerStart / cudaProfilerStop). The default: nothing to mark.
  virtual void profiler_range(int /*device_index*/, bool /*on*/) {}

  // Step capture (mixtape/core/capture.h). A backend whose kernels are plain host calls (the
  // CPU) says so, and core records the kernel calls of a capture itself. Another records what
  // its kernels queue on the device between begin_capture and end_capture (CUDA's stream
  // capture into a graph), in memory of its own that no allocation outside the recording gets
  // while the recording lives; abort_capture drops a capture that failed. The defaults: no
  // capture (DeviceError).
  virtual bool kernels_are_host_calls() const { return false; }
  virtual void begin_capture(int device_index);
  virtual std::unique_ptr<CapturedWork> end_capture(int device_index);
  virtual void abort_capture(int device_index);
};

// Installs a backend (replacing one of the same type).
void register_backend(std::unique_ptr<Backend> backend);
// Adds a function that registers a backend and its kernels (register_backend,
// register_kernel); core runs it once, before the first backend or kernel look-up after it
// was added, then checks that the backend has every kernel the op table requires (an Error
// naming what is missing). The same function added twice runs once.
void add_backend_initializer(void (*initialize)());
// The backend of a device type; throws DeviceError when it is not built in.
Backend& backend_for(DeviceType type);
bool has_backend(DeviceType type);
// Throws DeviceError unless `device` exists at run time.
void check_device(Device device);

}  // namespace mixtape
