// NCCL for CUDA tensors in mixtape::distributed (compiled when the CUDA build finds NCCL):
// all-reduce, broadcast and all-gather on the device memory itself, queued on the device's
// stream like every other op of the backend. One communicator per device, made on first use
// from a unique id that rank 0 draws and MPI broadcasts (NCCL's usual bootstrap); each rank
// is expected to use one GPU (Device::cuda(distributed::local_rank()), docs/distributed.md).
#include <fmt/format.h>
#include <nccl.h>

#include <map>
#include <memory>

#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_util.h"
#include "mixtape/distributed/device_collectives.h"

namespace mixtape::cuda_backend {

namespace {

void check_nccl(ncclResult_t rc, const char* what) {
  if (rc == ncclSuccess) return;
  throw DistributedError(fmt::format("distributed::{} (NCCL) failed on rank {}: {}", what,
                                     distributed::rank(), ncclGetErrorString(rc)));
}

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype.code()) {
    case DType::Float32:
      return ncclFloat32;
    case DType::Float64:
      return ncclFloat64;
    case DType::Float16:
      return ncclFloat16;
    case DType::BFloat16:
      return ncclBfloat16;
    case DType::Int32:
      return ncclInt32;
    case DType::Int64:
      return ncclInt64;
    default:
      throw DTypeError(fmt::format("distributed: NCCL cannot reduce {} tensors", dtype.name()));
  }
}

ncclRedOp_t nccl_op(distributed::ReduceOp op) {
  switch (op) {
    case distributed::ReduceOp::Sum:
      return ncclSum;
    case distributed::ReduceOp::Average:
      return ncclAvg;
    case distributed::ReduceOp::Max:
      return ncclMax;
    case distributed::ReduceOp::Min:
      return ncclMin;
  }
  return ncclSum;
}

class NcclCollectives : public distributed::DeviceCollectives {
 public:
  ~NcclCollectives() override {
    for (auto& [index, comm] : comms_) ncclCommDestroy(comm);
  }
  const char* name() const override { return "NCCL"; }

  // Each collective is queued inside a LaunchScope, as a kernel is (backends/cuda/cuda_util.h):
  // refused while the thread captures on another device, and never recorded into another
  // thread's capture. The communicator is made first, outside it (its first use waits for the
  // other ranks).
  void all_reduce(void* data, std::size_t count, DType dtype, distributed::ReduceOp op,
                  Device device) override {
    DeviceGuard guard(device.index());
    const ncclComm_t c = comm(device);
    const LaunchScope launch(device.index());
    check_nccl(ncclAllReduce(data, data, count, nccl_type(dtype), nccl_op(op), c, launch.stream()),
               "all_reduce");
  }
  void broadcast(void* data, std::size_t nbytes, int root, Device device) override {
    DeviceGuard guard(device.index());
    const ncclComm_t c = comm(device);
    const LaunchScope launch(device.index());
    check_nccl(ncclBroadcast(data, data, nbytes, ncclUint8, root, c, launch.stream()), "broadcast");
  }
  void all_gather(const void* src, void* dst, std::size_t nbytes, Device device) override {
    DeviceGuard guard(device.index());
    const ncclComm_t c = comm(device);
    const LaunchScope launch(device.index());
    check_nccl(ncclAllGather(src, dst, nbytes, ncclUint8, c, launch.stream()), "all_gather");
  }

 private:
  ncclComm_t comm(Device device) {
    auto it = comms_.find(device.index());
    if (it != comms_.end()) return it->second;
    ncclUniqueId id{};
    if (distributed::rank() == 0) check_nccl(ncclGetUniqueId(&id), "init");
    distributed::broadcast_host_bytes(&id, sizeof(id), 0);
    ncclComm_t c = nullptr;
    check_nccl(ncclCommInitRank(&c, distributed::world_size(), id, distributed::rank()), "init");
    comms_.emplace(device.index(), c);
    return c;
  }
  std::map<int, ncclComm_t> comms_;
};

}  // namespace

void register_nccl_collectives() {
  distributed::register_device_collectives(DeviceType::CUDA, std::make_unique<NcclCollectives>());
}

}  // namespace mixtape::cuda_backend
