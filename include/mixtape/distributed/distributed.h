// mixtape::distributed: the processes of a data-parallel job and the collectives between
// them, on MPI (Open MPI) for CPU tensors and on NCCL for CUDA tensors when the CUDA build
// has it.
//
//   int main(int argc, char** argv) {
//     mt::distributed::init();                   // world size 1 unless started by mpirun
//     ...
//     mt::distributed::all_reduce(t, mt::distributed::ReduceOp::Average);
//   }
//
//   mpirun -np 4 ./my_program                    // four ranks
//
// A program that calls init() runs unchanged without mpirun: world_size() is 1, every
// collective returns its input, no MPI call is made. Every collective is called by every
// rank, in the same order, with tensors of the same shape and dtype (MPI's rule); a
// mismatch the collective can see (shape, dtype) throws DistributedError on every rank.
// float16 and bfloat16 tensors are reduced through float32 (each rank's values widened,
// summed in float32, rounded once). Collectives are blocking and called from one thread.
//
// Faults: an MPI error throws DistributedError (the communicator returns errors instead
// of aborting). A rank that dies makes mpirun end the others (Open MPI's default); a rank
// that throws out of main ends the job the same way. docs/distributed.md has the details.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/core/error.h"
#include "mixtape/core/tensor.h"

namespace mixtape {

// A collective that failed or was called wrongly (mismatched shapes or dtypes across
// ranks, init() twice, an MPI error).
class DistributedError : public Error {
 public:
  using Error::Error;
  MIXTAPE_ERROR_TYPE(DistributedError)
};

namespace distributed {

enum class ReduceOp { Sum, Average, Max, Min };
const char* to_string(ReduceOp op);

// Joins the job: MPI_Init when the process was started by mpirun (Open MPI's or another
// launcher's environment variables), nothing otherwise (world size 1). Throws
// DistributedError when called a second time. MPI is finalised at exit. With more than
// one rank and OMP_NUM_THREADS unset, each rank's OpenMP threads (mixtape's kernels,
// OpenBLAS, oneDNN) are set to the cores it is bound to (mpirun binds each rank to a
// core by default), so that ranks do not run more threads than cores.
void init();
// Whether init() was called.
bool initialized();
// Ends the whole job with exit status `code` after printing `message` on stderr (MPI_Abort):
// what a rank that failed must do when the others may be waiting for it in a collective
// (returning from main would leave them waiting, and MPI_Finalize with them). Without
// mpirun it prints and exits.
[[noreturn]] void abort(int code, const std::string& message);
// This process's rank in [0, world_size()), 0 before init().
int rank();
// The number of ranks; 1 before init() and when not started by mpirun.
int world_size();
// This process's rank among the ranks on its machine (the GPU a rank should use).
int local_rank();
// Whether this is rank 0 (the one that prints and writes files).
inline bool is_root() { return rank() == 0; }
// Waits until every rank has called it.
void barrier();
// This rank's part [first, second) of `count` items split as evenly as possible over the
// ranks, in rank order (rank r: [count r / N, count (r + 1) / N)): its share of a batch.
std::pair<std::int64_t, std::int64_t> shard(std::int64_t count);

// Reduces `t` in place across ranks: every rank ends with the same values. Floating
// dtypes (Average too) and int32/int64 (Sum, Max, Min).
void all_reduce(Tensor& t, ReduceOp op = ReduceOp::Sum);
// Copies rank `root`'s `t` into every other rank's `t` (same shape and dtype), in place.
void broadcast(Tensor& t, int root = 0);
// Every rank's `t` concatenated along axis 0, in rank order (a new tensor on t's device);
// shapes must match.
Tensor all_gather(const Tensor& t);

// Numbers on the host: reduced across ranks (for metrics and flags).
double all_reduce_value(double value, ReduceOp op = ReduceOp::Sum);
std::vector<double> all_reduce_values(std::vector<double> values, ReduceOp op = ReduceOp::Sum);

// Throws DistributedError on every rank when `description` is not the same string on all
// of them ("model 'mlp': 3 weights float32[784,128] ..."), naming the first rank that
// differs from rank 0 and what it has. `who` starts the message.
void check_same_on_all_ranks(const std::string& who, const std::string& description);

// Sums `count` float32 or float64 values at `data` (host memory) across ranks, in place:
// a CPU bucket of DistributedOptimizer. MPI's blocking all-reduce: Open MPI's non-blocking
// one took about twice as long for 1-64 MiB here and moves only while the rank is inside an
// MPI call, so on a CPU it would hide nothing behind the backward pass (docs/distributed.md).
void sum_host_buffer(void* data, std::size_t count, DType dtype);

}  // namespace distributed
}  // namespace mixtape
