// The CUDA backend: device discovery, one stream per device, a caching allocator (no
// cudaMalloc / cudaFree per op), copies through pinned host buffers, and the registration
// of the CUDA kernels. Without a driver or a GPU it registers with zero devices, so that
// the library still loads and every CUDA tensor creation fails with a clear DeviceError.
#include "mixtape/core/backend.h"

#include <cuda_profiler_api.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "backends/cuda/capture_table.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_util.h"
#include "core/caching_allocator.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/error.h"

namespace mixtape {
namespace cuda_backend {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* what, const char* file, int line) {
  throw DeviceError(fmt::format("{} failed at {}:{}: {}: {}", what, file, line,
                                cudaGetErrorName(err), cudaGetErrorString(err)));
}

namespace {

int g_device_count = -1;  // set once by the backend's constructor

std::mutex g_streams_mutex;
std::vector<cudaStream_t>& streams() {
  // Never destroyed: kernels may still be queued while other statics are destroyed at exit.
  static auto* s = new std::vector<cudaStream_t>();
  return *s;
}

// The devices' caching allocator (core/caching_allocator.h), a pool per device: 512-byte size
// classes up to 1 MiB, larger blocks carved from segments (20 MiB, or a larger request's own
// rounded to 2 MiB); nothing given back until memory runs short. Blocks are only reused on the
// device's own stream, in stream order, so a block freed while a kernel still reads it is safe
// to hand out again: the next user's kernels queue behind that kernel.
detail::CachingAllocator& cache() {
  static auto* c = new detail::CachingAllocator(  // never destroyed: frees may come at exit
      DeviceType::CUDA, detail::CachingAllocator::Config{},
      {.obtain = [](int device, std::size_t bytes) -> void* {
         DeviceGuard guard(device);
         void* p = nullptr;
         const cudaError_t err = cudaMalloc(&p, bytes);
         if (err == cudaErrorMemoryAllocation) {
           cudaGetLastError();  // clear only our own error; the caller reports it
           return nullptr;
         }
         MIXTAPE_CUDA_CHECK(err);
         return p;
       },
       .give_back =
           [](int device, void* p) {
             DeviceGuard guard(device);
             MIXTAPE_CUDA_CHECK(cudaFree(p));
           },
       .before_release =
           [](int device) {
             DeviceGuard guard(device);
             MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream(device)));
           }});
  return *c;
}

// --- Step capture (mixtape/core/capture.h): CUDA graphs ----------------------------------------
//
// The rules, and the bookkeeping of captures, pools and the threads queueing work on a device:
// backends/cuda/capture_table.h. Here: the device's calls it makes.
CaptureTable& captures() {
  static auto* t = new CaptureTable(
      {// never destroyed: frees may come at exit
       .obtain =
           [](int device, std::size_t bytes) {
             DeviceGuard guard(device);
             void* p = nullptr;
             const cudaError_t err = cudaMalloc(&p, bytes);
             if (err != cudaSuccess) {
               cudaGetLastError();
               throw DeviceError(
                   fmt::format("out of memory on cuda:{} while capturing a step: could not "
                               "allocate {} bytes: {}",
                               device, bytes, cudaGetErrorString(err)));
             }
             detail::count_reserved(Device(DeviceType::CUDA, device),
                                    static_cast<std::int64_t>(bytes));
             return p;
           },
       .allocate = [](int device, std::size_t n) { return cache().allocate(device, n); },
       .deallocate = [](int device, void* p, std::size_t n) { cache().deallocate(device, p, n); },
       .adopt = [](int device, void* p, std::size_t bytes) { cache().adopt(device, p, bytes); },
       .free_host = [](void* p) { cudaFreeHost(p); }});
  return *t;
}

// The calling thread queues work on device d for the scope (CaptureTable::enter).
class Queueing {
 public:
  explicit Queueing(int d) : d_(d), own_capture_(captures().enter(d)) {}
  ~Queueing() { captures().leave(d_); }
  Queueing(const Queueing&) = delete;
  Queueing& operator=(const Queueing&) = delete;
  bool own_capture() const { return own_capture_; }  // the calling thread captures on d

 private:
  int d_;
  bool own_capture_;
};

class CudaGraph final : public CapturedWork {
 public:
  CudaGraph(int device, cudaGraph_t graph, cudaGraphExec_t exec, std::shared_ptr<CapturePool> pool)
      : device_(device), graph_(graph), exec_(exec), pool_(std::move(pool)) {}
  CudaGraph(const CudaGraph&) = delete;
  CudaGraph& operator=(const CudaGraph&) = delete;
  ~CudaGraph() override {
    // Never throws (unchecked calls: after a failed kernel the device's errors are sticky); the
    // stream exists (the capture ran on it).
    int previous = device_;
    cudaGetDevice(&previous);
    cudaSetDevice(device_);
    try {
      cudaStreamSynchronize(stream(device_));  // the replays are done with the pool
    } catch (...) {
    }
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
    cudaSetDevice(previous);
    captures().release(*pool_);
  }
  void replay() override {
    DeviceGuard guard(device_);
    MIXTAPE_CUDA_CHECK(cudaGraphLaunch(exec_, stream(device_)));
  }

 private:
  int device_;
  cudaGraph_t graph_;
  cudaGraphExec_t exec_;
  std::shared_ptr<CapturePool> pool_;
};

// Pinned host buffers per device for copies between pageable host memory and the device
// (guarded by a mutex). Device -> host copies go through `down` and wait for the device.
// Host -> device copies go through a ring of buffers, each with an event recorded after its
// copy: a copy waits only for the copy that last used its buffer (kRing copies ago), not for
// the device, so a training step's batch indices go up without draining the stream, and a
// large copy overlaps its memcpy into one buffer with the transfer of the previous one.
struct PinnedBuffer {
  void* ptr = nullptr;
  std::size_t size = 0;
  cudaEvent_t done = nullptr;  // recorded after the last copy out of this buffer
  // At least n bytes (the contents are not kept when it grows).
  void* get(std::size_t n) {
    if (n > size) {
      if (ptr) MIXTAPE_CUDA_CHECK(cudaFreeHost(ptr));
      ptr = nullptr;
      size = 0;
      MIXTAPE_CUDA_CHECK(cudaMallocHost(&ptr, n));
      size = n;
    }
    return ptr;
  }
};
struct Staging {
  static constexpr std::size_t kRing = 4;
  // Copies of at most kSmall bytes (a captured step's seeds, rates and scales, several a
  // replay) go through a ring of their own, long enough that a copy never waits for one of
  // the replay before: with the big ring, the fifth copy of a replay waited for the first
  // copy of the one before, and so for that replay's graph to start.
  static constexpr std::size_t kSmall = 256, kSmallRing = 256;
  std::mutex mutex;
  PinnedBuffer down;
  PinnedBuffer up[kRing];
  std::size_t next_up = 0;
  PinnedBuffer small[kSmallRing];
  std::size_t next_small = 0;
};
Staging& staging(int device) {
  static std::mutex m;
  static std::vector<std::unique_ptr<Staging>> all;
  std::lock_guard<std::mutex> lock(m);
  if (all.size() <= static_cast<std::size_t>(device))
    all.resize(static_cast<std::size_t>(device) + 1);
  auto& s = all[static_cast<std::size_t>(device)];
  if (!s) s = std::make_unique<Staging>();
  return *s;
}

// Backend::read_back: a few pinned bytes and an event per read, from a free list per device
// (never freed: kernels may run during static destruction). The copy and the event are
// queued on the device's stream; wait() waits for that event only.
struct ReadSlot {
  unsigned char* pinned = nullptr;
  cudaEvent_t done = nullptr;
};
std::mutex g_read_slots_mutex;
std::vector<std::vector<ReadSlot>> g_free_read_slots;  // by device

class CudaPendingRead final : public PendingRead {
 public:
  CudaPendingRead(const void* src, int device, std::size_t nbytes)
      : device_(device), size_(nbytes) {
    {
      std::lock_guard<std::mutex> lock(g_read_slots_mutex);
      if (g_free_read_slots.size() <= static_cast<std::size_t>(device))
        g_free_read_slots.resize(static_cast<std::size_t>(device) + 1);
      auto& free = g_free_read_slots[static_cast<std::size_t>(device)];
      if (!free.empty()) {
        slot_ = free.back();
        free.pop_back();
      }
    }
    DeviceGuard guard(device);
    if (!slot_.pinned) {
      void* p = nullptr;
      MIXTAPE_CUDA_CHECK(cudaMallocHost(&p, Backend::kMaxReadBack));
      slot_.pinned = static_cast<unsigned char*>(p);
      MIXTAPE_CUDA_CHECK(cudaEventCreateWithFlags(&slot_.done, cudaEventDisableTiming));
    }
    MIXTAPE_CUDA_CHECK(
        cudaMemcpyAsync(slot_.pinned, src, nbytes, cudaMemcpyDeviceToHost, stream(device)));
    MIXTAPE_CUDA_CHECK(cudaEventRecord(slot_.done, stream(device)));
  }
  CudaPendingRead(const CudaPendingRead&) = delete;
  CudaPendingRead& operator=(const CudaPendingRead&) = delete;
  ~CudaPendingRead() override {
    if (!slot_.pinned) return;
    cudaEventSynchronize(slot_.done);  // a read nobody waited for: its copy may be in flight
    std::lock_guard<std::mutex> lock(g_read_slots_mutex);
    g_free_read_slots[static_cast<std::size_t>(device_)].push_back(slot_);
  }
  void wait(void* dst) override {
    MIXTAPE_CUDA_CHECK(cudaEventSynchronize(slot_.done));
    std::memcpy(dst, slot_.pinned, size_);
  }
  bool ready() override {
    const cudaError_t status = cudaEventQuery(slot_.done);
    if (status == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: clear it, or the next launch check would see it
      return false;
    }
    MIXTAPE_CUDA_CHECK(status);
    return true;
  }

 private:
  ReadSlot slot_;
  int device_;
  std::size_t size_;
};

// Copies of more than this many bytes between pageable host memory and a device go in
// pieces through the staging buffers.
constexpr std::size_t kStagingPiece = std::size_t{32} << 20;

// f(staging, offset, bytes) for each piece of an nbytes copy between the host and device d,
// in order, on d and with d's staging buffers locked.
template <typename F>
void for_each_piece(int d, std::size_t nbytes, F&& f) {
  DeviceGuard guard(d);
  Staging& st = staging(d);
  std::lock_guard<std::mutex> lock(st.mutex);
  for (std::size_t off = 0; off < nbytes; off += kStagingPiece)
    f(st, off, std::min(kStagingPiece, nbytes - off));
}

class CudaBackend final : public Backend {
 public:
  CudaBackend() {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the sticky error of a missing driver
      spdlog::debug("mixtape: CUDA backend built in, but no usable GPU: {}",
                    cudaGetErrorString(err));
      n = 0;
    }
    g_device_count = n;
  }

  DeviceType type() const override { return DeviceType::CUDA; }
  std::string name() const override { return "CUDA"; }
  int device_count() const override { return g_device_count; }

  void* allocate(std::size_t nbytes, int device_index) override {
    check_index(device_index);
    if (void* p = captures().allocate(device_index, nbytes, capture::detail::fresh_memory()))
      return p;
    std::size_t free_bytes = 0, total = 0;
    {
      DeviceGuard guard(device_index);
      cudaMemGetInfo(&free_bytes, &total);
    }
    throw DeviceError(fmt::format(
        "out of memory on cuda:{}: could not allocate {} bytes ({} of {} MiB free, {} MiB "
        "reserved by mixtape)",
        device_index, nbytes, free_bytes >> 20, total >> 20,
        cache().stats(device_index).reserved >> 20));
  }

  void deallocate(void* ptr, std::size_t nbytes, int device_index) override {
    captures().deallocate(ptr, nbytes, device_index);
  }

  void begin_capture(int device_index) override {
    check_index(device_index);
    // The stream first (what can throw before the capture table changes).
    DeviceGuard guard(device_index);
    const cudaStream_t st = stream(device_index);
    if (!captures().begin(device_index))
      throw CaptureError(fmt::format(
          "StepGraph::capture on cuda:{}: another thread is capturing a step there", device_index));
    // Relaxed: the allocator may call cudaMalloc for the pool while the stream captures.
    const cudaError_t err = cudaStreamBeginCapture(st, cudaStreamCaptureModeRelaxed);
    if (err != cudaSuccess) {
      if (const auto pool = captures().end(device_index)) captures().release(*pool);
      MIXTAPE_CUDA_CHECK(err);
    }
  }

  std::unique_ptr<CapturedWork> end_capture(int device_index) override {
    cudaGraph_t graph = nullptr;
    cudaError_t err = cudaStreamEndCapture(stream(device_index), &graph);
    const std::shared_ptr<CapturePool> pool = captures().end(device_index);
    DeviceGuard guard(device_index);
    cudaGraphExec_t exec = nullptr;
    if (err == cudaSuccess) err = cudaGraphInstantiate(&exec, graph, 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      if (graph) cudaGraphDestroy(graph);
      captures().release(*pool);
      throw CaptureError(fmt::format(
          "StepGraph::capture on cuda:{}: the captured step could not be made a CUDA graph: {}",
          device_index, cudaGetErrorString(err)));
    }
    return std::make_unique<CudaGraph>(device_index, graph, exec, pool);
  }

  void abort_capture(int device_index) override {
    cudaGraph_t graph = nullptr;
    cudaStreamEndCapture(stream(device_index), &graph);
    cudaGetLastError();  // a capture invalidated by the failure: not an error of the next call
    if (graph) cudaGraphDestroy(graph);
    if (const auto pool = captures().end(device_index)) captures().release(*pool);
  }

  void copy(void* dst, Device dst_device, const void* src, Device src_device,
            std::size_t nbytes) override {
    if (nbytes == 0) return;
    // (Not while another thread captures on a device of the copy: capture_table.h.)
    std::optional<Queueing> on_dst, on_src;
    if (dst_device.is_cuda()) on_dst.emplace(dst_device.index());
    if (src_device.is_cuda() && src_device != dst_device) on_src.emplace(src_device.index());
    if (dst_device.is_cuda() && src_device.is_cuda()) {
      DeviceGuard guard(dst_device.index());
      if (dst_device != src_device) {
        capture::forbid_read(src_device, "a copy to another GPU");
        capture::forbid_read(dst_device, "a copy from another GPU");
      }
      if (dst_device == src_device) {
        MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDeviceToDevice,
                                           stream(dst_device.index())));
      } else {
        // Queue behind the source's pending work, then copy between the devices and wait
        // for it: the source's block may go back to the caching allocator as soon as this
        // returns, and work queued on the source device's stream is not ordered after a copy
        // on the destination's.
        MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream(src_device.index())));
        MIXTAPE_CUDA_CHECK(cudaMemcpyPeerAsync(dst, dst_device.index(), src, src_device.index(),
                                               nbytes, stream(dst_device.index())));
        MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream(dst_device.index())));
      }
      return;
    }
    if (on_dst && on_dst->own_capture()) {
      capture_copy(dst, dst_device.index(), src, nbytes);
      return;
    }
    if (dst_device.is_cuda()) {  // host -> device, through the ring of pinned buffers
      const int d = dst_device.index();
      for_each_piece(d, nbytes, [&](Staging& st, std::size_t off, std::size_t n) {
        const bool small = n <= Staging::kSmall;
        PinnedBuffer& buf = small ? st.small[st.next_small] : st.up[st.next_up];
        if (small)
          st.next_small = (st.next_small + 1) % Staging::kSmallRing;
        else
          st.next_up = (st.next_up + 1) % Staging::kRing;
        if (buf.done) {
          MIXTAPE_CUDA_CHECK(cudaEventSynchronize(buf.done));  // its last copy has finished
        } else {
          MIXTAPE_CUDA_CHECK(cudaEventCreateWithFlags(&buf.done, cudaEventDisableTiming));
        }
        void* pinned = buf.get(small ? Staging::kSmall : n);
        std::memcpy(pinned, static_cast<const char*>(src) + off, n);
        MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, pinned, n,
                                           cudaMemcpyHostToDevice, stream(d)));
        MIXTAPE_CUDA_CHECK(cudaEventRecord(buf.done, stream(d)));
      });
      return;
    }
    if (src_device.is_cuda()) {  // device -> host: waits for the device's pending work
      const int d = src_device.index();
      capture::forbid_read(src_device, "a copy to the host");
      for_each_piece(d, nbytes, [&](Staging& st, std::size_t off, std::size_t n) {
        void* pinned = st.down.get(std::min(nbytes, kStagingPiece));
        MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(pinned, static_cast<const char*>(src) + off, n,
                                           cudaMemcpyDeviceToHost, stream(d)));
        MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream(d)));
        std::memcpy(static_cast<char*>(dst) + off, pinned, n);
      });
      return;
    }
    throw DeviceError(
        fmt::format("CUDA backend: cannot copy from {} to {}", src_device.str(), dst_device.str()));
  }

  std::unique_ptr<PendingRead> read_back(const void* src, int device_index,
                                         std::size_t nbytes) override {
    check_index(device_index);
    capture::forbid_read(Device::cuda(device_index), "read_back");
    const Queueing queueing(device_index);
    if (nbytes > kMaxReadBack) return Backend::read_back(src, device_index, nbytes);  // throws
    return std::make_unique<CudaPendingRead>(src, device_index, nbytes);
  }

  void synchronize(int device_index) override {
    check_index(device_index);
    capture::forbid_read(Device::cuda(device_index), "a synchronisation");
    const Queueing queueing(device_index);
    DeviceGuard guard(device_index);
    MIXTAPE_CUDA_CHECK(cudaStreamSynchronize(stream(device_index)));
  }

  void profiler_range(int device_index, bool on) override {
    check_index(device_index);
    DeviceGuard guard(device_index);
    MIXTAPE_CUDA_CHECK(on ? cudaProfilerStart() : cudaProfilerStop());
  }

  DeviceProperties properties(int device_index) const override {
    check_index(device_index);
    cudaDeviceProp p{};
    MIXTAPE_CUDA_CHECK(cudaGetDeviceProperties(&p, device_index));
    return DeviceProperties{.name = p.name,
                            .compute_major = p.major,
                            .compute_minor = p.minor,
                            .total_memory = p.totalGlobalMem,
                            .multiprocessors = p.multiProcessorCount};
  }

 private:
  // A host -> device copy while the calling thread captures on device d: from a pinned buffer
  // of the capture's own, which every replay copies again.
  static void capture_copy(void* dst, int d, const void* src, std::size_t nbytes) {
    DeviceGuard guard(d);
    void* pinned = nullptr;
    MIXTAPE_CUDA_CHECK(cudaMallocHost(&pinned, nbytes));
    captures().keep_pinned(d, pinned);
    std::memcpy(pinned, src, nbytes);
    MIXTAPE_CUDA_CHECK(cudaMemcpyAsync(dst, pinned, nbytes, cudaMemcpyHostToDevice, stream(d)));
  }

  static void check_index(int index) {
    if (index < 0 || index >= g_device_count)
      throw DeviceError(fmt::format("cuda:{} is not available ({} CUDA device{} present)", index,
                                    g_device_count, g_device_count == 1 ? "" : "s"));
  }
};

}  // namespace

cudaStream_t stream(int index) {
  std::lock_guard<std::mutex> lock(g_streams_mutex);
  auto& s = streams();
  if (s.size() <= static_cast<std::size_t>(index))
    s.resize(static_cast<std::size_t>(index) + 1, nullptr);
  auto& st = s[static_cast<std::size_t>(index)];
  if (!st) {
    DeviceGuard guard(index);
    MIXTAPE_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  }
  return st;
}

LaunchScope::LaunchScope(int index) : index_(index) {
  capture::detail::check_launch(Device::cuda(index));
  captures().enter(index);
  try {
    stream_ = cuda_backend::stream(index);
  } catch (...) {
    captures().leave(index);
    throw;
  }
}

LaunchScope::~LaunchScope() { captures().leave(index_); }

DeviceGuard::DeviceGuard(int index) {
  MIXTAPE_CUDA_CHECK(cudaGetDevice(&previous_));
  if (previous_ != index) {
    MIXTAPE_CUDA_CHECK(cudaSetDevice(index));
    changed_ = true;
  }
}

DeviceGuard::~DeviceGuard() {
  if (changed_) cudaSetDevice(previous_);
}

Workspace::Workspace(std::size_t bytes, int index) : bytes_(bytes), index_(index) {
  if (bytes_ > 0) ptr_ = backend_for(DeviceType::CUDA).allocate(bytes_, index_);
}

Workspace::~Workspace() {
  if (ptr_) backend_for(DeviceType::CUDA).deallocate(ptr_, bytes_, index_);
}

}  // namespace cuda_backend

namespace cuda {
// Called once by core (the initializer include/mixtape/backends/cuda.h announces) before the
// first backend or kernel look-up.
void register_backend_and_kernels() {
  register_backend(std::make_unique<cuda_backend::CudaBackend>());
  // The kernels register without a GPU too (registering touches no device): supports()
  // then tells what this build can run on a GPU.
  cuda_backend::register_all_kernels();
#if MIXTAPE_WITH_NCCL
  // CUDA tensors' collectives in mixtape::distributed (backends/cuda/nccl.cpp).
  cuda_backend::register_nccl_collectives();
#endif
}
}  // namespace cuda

}  // namespace mixtape
