// mixtape-allreduce-bench: the all-reduce bandwidth between the ranks of an MPI job, for the
// cost model of docs/distributed.md. Run it under mpirun:
//
//   mpirun -np 2 build/bench/mixtape-allreduce-bench
//
// For each size, the median time of repeated float32 sums (each after a barrier) through
// the paths of mixtape: the sum of a host buffer (a bucket on the CPU, MPI's blocking
// all-reduce) and distributed::all_reduce of a tensor; and, for the choice between them,
// MPI's non-blocking all-reduce started and waited for at once (MPI_Iallreduce). The
// bus bandwidth is what each rank moved: 2 (N - 1) / N of the bytes, over the time (NCCL's
// definition, so that numbers compare across world sizes). Not Google Benchmark: every rank
// must run the same number of repetitions, which its adaptive loop does not promise.
#include <fmt/format.h>
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace md = mixtape::distributed;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename F>
double time_median(int reps, F&& f) {
  std::vector<double> times;
  for (int r = 0; r < reps + 2; ++r) {
    md::barrier();
    const auto t0 = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r >= 2) times.push_back(s);  // two warm-up rounds
  }
  // The slowest rank's time of each size: every rank must have its result.
  return md::all_reduce_value(median(times), md::ReduceOp::Max);
}

}  // namespace

int main() {
  md::init();
  const int n = md::world_size();
  const double factor = n > 1 ? 2.0 * (n - 1) / n : 0.0;
  if (md::is_root())
    fmt::print(
        "all-reduce (float32 sum), {} ranks; medians of repeated runs\n"
        "| bytes | host buffer us | bus GB/s | tensor us | bus GB/s |\n|---|---|---|---|---|\n",
        n);
  for (std::int64_t bytes :
       {std::int64_t{4} << 10, std::int64_t{64} << 10, std::int64_t{1} << 20, std::int64_t{4} << 20,
        std::int64_t{16} << 20, std::int64_t{64} << 20}) {
    const std::int64_t count = bytes / 4;
    const int reps = bytes <= (1 << 20) ? 200 : bytes <= (16 << 20) ? 40 : 10;
    std::vector<float> buffer(static_cast<std::size_t>(count), 1.0f);
    const double t_host =
        time_median(reps, [&] { md::sum_host_buffer(buffer.data(), buffer.size(), mt::kFloat32); });
    mt::Tensor t = mt::ones({count});
    const double t_tensor = time_median(reps, [&] { md::all_reduce(t); });
    const double t_nonblocking = time_median(reps, [&] {
      MPI_Request request;
      MPI_Iallreduce(MPI_IN_PLACE, buffer.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM,
                     MPI_COMM_WORLD, &request);
      MPI_Wait(&request, MPI_STATUS_IGNORE);
    });
    if (md::is_root())
      fmt::print("| {} | {:.1f} | {:.2f} | {:.1f} | {:.2f} | {:.1f} |\n", bytes, t_host * 1e6,
                 factor * static_cast<double>(bytes) / t_host / 1e9, t_tensor * 1e6,
                 factor * static_cast<double>(bytes) / t_tensor / 1e9, t_nonblocking * 1e6);
  }
  return 0;
}
