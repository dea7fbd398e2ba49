// For backends: collectives that run on a device's own memory (NCCL for CUDA tensors).
// mixtape::distributed uses the one registered for a tensor's device type; without one it
// stages the tensor through the host and MPI. A backend registers its implementation from
// its initializer (as it registers its kernels), so distributed names no backend.
#pragma once

#include <cstddef>
#include <memory>

#include "mixtape/core/device.h"
#include "mixtape/core/dtype.h"
#include "mixtape/distributed/distributed.h"

namespace mixtape::distributed {

class DeviceCollectives {
 public:
  virtual ~DeviceCollectives() = default;
  virtual const char* name() const = 0;  // "NCCL"
  // Reduces `count` values of `dtype` at `data` (on `device`) in place across ranks.
  virtual void all_reduce(void* data, std::size_t count, DType dtype, ReduceOp op,
                          Device device) = 0;
  // Rank `root`'s `nbytes` at `data` to every rank.
  virtual void broadcast(void* data, std::size_t nbytes, int root, Device device) = 0;
  // Every rank's `nbytes` at `src` into `dst` (world_size() * nbytes), in rank order.
  virtual void all_gather(const void* src, void* dst, std::size_t nbytes, Device device) = 0;
};

// Installs the collectives of a device type (replacing an earlier one).
void register_device_collectives(DeviceType type, std::unique_ptr<DeviceCollectives> c);

// Rank `root`'s `nbytes` at `data` (host memory) to every rank, over MPI: for a device
// library's bootstrap (NCCL's unique id).
void broadcast_host_bytes(void* data, std::size_t nbytes, int root);

}  // namespace mixtape::distributed
