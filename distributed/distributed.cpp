// mixtape::distributed on MPI: joining the job, the collectives on CPU tensors (and on other
// devices' tensors through the host or a registered DeviceCollectives), reductions of host
// numbers and buffers (DistributedOptimizer's CPU buckets).
#include "mixtape/distributed/distributed.h"

#include <fmt/format.h>
#include <mpi.h>
#include <omp.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>

#include "mixtape/core/backend.h"
#include "mixtape/core/half.h"
#include "mixtape/distributed/device_collectives.h"

namespace mixtape::distributed {

namespace {

struct State {
  bool initialized = false;
  bool mpi = false;  // MPI_Init was called (started by a launcher)
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  MPI_Comm comm = MPI_COMM_NULL;
  std::map<DeviceType, std::unique_ptr<DeviceCollectives>> device;
};

State& state() {
  static State s;
  return s;
}

// Whether a launcher started this process: Open MPI's mpirun, or a PMI/PMIx launcher (srun,
// MPICH's hydra).
bool launched_by_mpirun() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(var)) return true;
  return false;
}

// The world size the launcher announces (Open MPI), for the warning when init() is missing.
int launcher_world_size() {
  const char* v = std::getenv("OMPI_COMM_WORLD_SIZE");
  return v ? std::atoi(v) : 1;
}

void warn_if_not_initialized() {
  static std::once_flag once;
  if (state().initialized || launcher_world_size() <= 1) return;
  std::call_once(once, [] {
    spdlog::warn(
        "mixtape::distributed: started by mpirun with {} ranks but distributed::init() was not "
        "called: each rank runs alone (world size 1)",
        launcher_world_size());
  });
}

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  std::array<char, MPI_MAX_ERROR_STRING> text{};
  int len = 0;
  MPI_Error_string(rc, text.data(), &len);
  throw DistributedError(fmt::format("distributed::{}: MPI failed on rank {} of {}: {}", what,
                                     state().rank, state().size,
                                     std::string(text.data(), static_cast<std::size_t>(len))));
}

// MPI counts are ints: larger buffers go in pieces of at most INT_MAX elements.
constexpr std::size_t kMaxCount = static_cast<std::size_t>(std::numeric_limits<int>::max());

void allreduce_in_pieces(void* data, std::size_t count, MPI_Datatype type, std::size_t item,
                         MPI_Op op, const char* what) {
  auto* p = static_cast<char*>(data);
  for (std::size_t done = 0; done < count;) {
    const std::size_t n = std::min(kMaxCount, count - done);
    check_mpi(
        MPI_Allreduce(MPI_IN_PLACE, p + done * item, static_cast<int>(n), type, op, state().comm),
        what);
    done += n;
  }
}

void bcast_in_pieces(void* data, std::size_t nbytes, int root, const char* what) {
  auto* p = static_cast<char*>(data);
  for (std::size_t done = 0; done < nbytes;) {
    const std::size_t n = std::min(kMaxCount, nbytes - done);
    check_mpi(MPI_Bcast(p + done, static_cast<int>(n), MPI_BYTE, root, state().comm), what);
    done += n;
  }
}

void finalize_at_exit() {
  State& s = state();
  if (!s.mpi) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  if (s.comm != MPI_COMM_NULL) MPI_Comm_free(&s.comm);
  MPI_Finalize();
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
    case ReduceOp::Average:
      return MPI_SUM;
    case ReduceOp::Max:
      return MPI_MAX;
    case ReduceOp::Min:
      return MPI_MIN;
  }
  return MPI_SUM;
}

// The MPI type of the values reduced for `dtype` (float16 and bfloat16: float32).
MPI_Datatype reduce_type(DType dtype) {
  switch (dtype.code()) {
    case DType::Float64:
      return MPI_DOUBLE;
    case DType::Int32:
      return MPI_INT32_T;
    case DType::Int64:
      return MPI_INT64_T;
    default:
      return MPI_FLOAT;
  }
}

bool reducible(DType dtype, ReduceOp op) {
  if (dtype.is_floating()) return true;
  return (dtype == kInt32 || dtype == kInt64) && op != ReduceOp::Average;
}

// The shape and dtype of `t` must be the same on every rank: one small all-reduce of their
// values and their negations (MAX of both gives the largest and the smallest).
// A number for the name of a collective, the same in every process (FNV-1a, not std::hash).
std::int64_t call_id(const char* who) {
  std::uint64_t h = 1469598103934665603ULL;
  for (const char* p = who; *p; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ULL;
  return static_cast<std::int64_t>(h >> 1);
}

// Before the data of a host collective moves, the ranks compare which collective they are
// in and how many values they pass (one exchange of four numbers): ranks that disagree
// (another step count, batch size or model) throw together instead of pairing different
// calls and writing past a buffer.
void check_same_call(const char* who, std::size_t count, const char* unit) {
  std::int64_t v[4] = {call_id(who), static_cast<std::int64_t>(count), 0, 0};
  v[2] = -v[0];
  v[3] = -v[1];
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, v, 4, MPI_INT64_T, MPI_MAX, state().comm), who);
  if (v[0] != -v[2])
    throw DistributedError(fmt::format(
        "distributed::{}: the ranks are not in the same collective call (rank {} is here with {} "
        "{}; another rank is in another call): every rank must take the same steps (the same "
        "data size, batch size and model on every rank)",
        who, state().rank, count, unit));
  if (v[1] != -v[3])
    throw DistributedError(fmt::format(
        "distributed::{}: the ranks pass different numbers of {} (rank {} passes {}; the ranks "
        "pass from {} to {}): every rank must pass the same layout (the same model and options)",
        who, unit, state().rank, count, -v[3], v[1]));
}

void check_same_layout(const char* who, const Tensor& t) {
  std::vector<std::int64_t> v;
  v.push_back(call_id(who));
  v.push_back(static_cast<std::int64_t>(t.rank()));
  v.push_back(static_cast<std::int64_t>(t.dtype().code()));
  v.push_back(t.numel());
  for (std::size_t i = 0; i < 8; ++i) v.push_back(i < t.rank() ? t.dim(static_cast<int>(i)) : -1);
  std::vector<std::int64_t> both(v);
  for (auto x : v) both.push_back(-x);
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, both.data(), static_cast<int>(both.size()), MPI_INT64_T,
                          MPI_MAX, state().comm),
            who);
  const std::size_t n = v.size();
  if (both[0] != -both[n])
    throw DistributedError(fmt::format(
        "distributed::{}: the ranks are not in the same collective call (rank {} is here with "
        "{}{}; another rank is in another call): every rank must take the same steps",
        who, state().rank, t.dtype().name(), t.shape().str()));
  for (std::size_t i = 1; i < n; ++i)
    if (both[i] != -both[n + i])
      throw DistributedError(fmt::format(
          "distributed::{}: the ranks passed tensors of different shapes or dtypes (rank {} has "
          "{}{}); every rank must pass the same shape and dtype",
          who, state().rank, t.dtype().name(), t.shape().str()));
}

void require_tensor(const char* who, const Tensor& t) {
  if (!t.defined()) throw ValueError(fmt::format("distributed::{}: undefined tensor", who));
  if (!t.is_contiguous())
    throw ValueError(
        fmt::format("distributed::{}: needs a contiguous tensor (got a strided view {}{}); pass "
                    "t.contiguous()",
                    who, t.dtype().name(), t.shape().str()));
}

// Host copies of a tensor's bytes, and writing them back, for any device.
std::vector<std::uint8_t> read_bytes(const Tensor& t) { return detail::host_bytes(t); }

void write_bytes(const Tensor& t, const void* src) {
  if (t.device().type() == DeviceType::CPU) {
    std::memcpy(t.data_ptr(), src, t.nbytes());
    return;
  }
  backend_for(t.device().type()).copy(t.data_ptr(), t.device(), src, Device::cpu(), t.nbytes());
}

DeviceCollectives* device_collectives(Device d) {
  if (d.type() == DeviceType::CPU) return nullptr;
  auto it = state().device.find(d.type());
  return it == state().device.end() ? nullptr : it->second.get();
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Average:
      return "average";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
  }
  return "?";
}

void init() {
  State& s = state();
  if (s.initialized)
    throw DistributedError(
        "distributed::init: called a second time; call it once, at the start of main");
  if (launched_by_mpirun()) {
    int already = 0;
    MPI_Initialized(&already);
    if (!already) {
      int provided = 0;
      check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided), "init");
    }
    s.mpi = true;
    // A communicator of mixtape's own that returns errors (as exceptions) instead of
    // aborting the job.
    check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &s.comm), "init");
    MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN);
    check_mpi(MPI_Comm_rank(s.comm, &s.rank), "init");
    check_mpi(MPI_Comm_size(s.comm, &s.size), "init");
    MPI_Comm local = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(s.comm, MPI_COMM_TYPE_SHARED, s.rank, MPI_INFO_NULL, &local),
              "init");
    check_mpi(MPI_Comm_rank(local, &s.local_rank), "init");
    MPI_Comm_free(&local);
    std::atexit(finalize_at_exit);
    if (s.size > 1 && !std::getenv("OMP_NUM_THREADS")) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
        omp_set_num_threads(CPU_COUNT(&set));
        spdlog::debug("distributed: rank {} runs {} OpenMP thread(s), its cores", s.rank,
                      CPU_COUNT(&set));
      }
    }
    spdlog::debug("distributed: rank {} of {} (local rank {})", s.rank, s.size, s.local_rank);
  }
  s.initialized = true;
}

bool initialized() { return state().initialized; }

void abort(int code, const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  if (state().mpi && state().size > 1) MPI_Abort(state().comm, code);
  std::exit(code);
}

int rank() {
  warn_if_not_initialized();
  return state().rank;
}

int world_size() {
  warn_if_not_initialized();
  return state().size;
}

int local_rank() { return state().local_rank; }

std::pair<std::int64_t, std::int64_t> shard(std::int64_t count) {
  if (count < 0)
    throw ValueError(fmt::format("distributed::shard: count must be >= 0; got {}", count));
  const auto r = static_cast<std::int64_t>(rank()), n = static_cast<std::int64_t>(world_size());
  return {count * r / n, count * (r + 1) / n};
}

void barrier() {
  if (world_size() == 1) return;
  check_mpi(MPI_Barrier(state().comm), "barrier");
}

void all_reduce(Tensor& t, ReduceOp op) {
  require_tensor("all_reduce", t);
  if (!reducible(t.dtype(), op))
    throw DTypeError(fmt::format(
        "distributed::all_reduce: cannot {} a {} tensor (floating dtypes, and int32/int64 for "
        "sum, max and min)",
        to_string(op), t.dtype().name()));
  if (world_size() == 1) return;
  check_same_layout("all_reduce", t);
  const auto n = static_cast<std::size_t>(t.numel());
  if (n == 0) return;
  if (DeviceCollectives* dc = device_collectives(t.device())) {
    dc->all_reduce(t.data_ptr(), n, t.dtype(), op, t.device());
    return;
  }
  const bool widen = t.dtype() == kFloat16 || t.dtype() == kBFloat16;
  // A CPU tensor of an MPI type is reduced where it lies; others through a host copy.
  const bool in_place = t.device().type() == DeviceType::CPU && !widen;
  std::vector<std::uint8_t> bytes = in_place ? std::vector<std::uint8_t>() : read_bytes(t);
  std::vector<float> wide;
  void* buf = in_place ? t.data_ptr() : bytes.data();
  if (widen) {
    wide.resize(n);
    if (t.dtype() == kFloat16)
      convert_half_to_float(reinterpret_cast<const half*>(bytes.data()), wide.data(), n);
    else
      convert_bfloat16_to_float(reinterpret_cast<const bfloat16*>(bytes.data()), wide.data(), n);
    buf = wide.data();
  }
  allreduce_in_pieces(buf, n, reduce_type(t.dtype()), widen ? sizeof(float) : t.dtype().itemsize(),
                      mpi_op(op), "all_reduce");
  if (op == ReduceOp::Average) {
    const double inv = 1.0 / static_cast<double>(world_size());
    if (t.dtype() == kFloat64) {
      auto* p = reinterpret_cast<double*>(buf);
      for (std::size_t i = 0; i < n; ++i) p[i] *= inv;
    } else {
      auto* p = reinterpret_cast<float*>(buf);
      for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<float>(p[i] * inv);
    }
  }
  if (widen) {
    if (t.dtype() == kFloat16)
      convert_float_to_half(wide.data(), reinterpret_cast<half*>(bytes.data()), n);
    else
      convert_float_to_bfloat16(wide.data(), reinterpret_cast<bfloat16*>(bytes.data()), n);
  }
  if (!in_place) write_bytes(t, bytes.data());
}

void broadcast(Tensor& t, int root) {
  require_tensor("broadcast", t);
  if (root < 0 || root >= world_size())
    throw ValueError(fmt::format("distributed::broadcast: root {} is not a rank (world size {})",
                                 root, world_size()));
  if (world_size() == 1) return;
  check_same_layout("broadcast", t);
  if (t.nbytes() == 0) return;
  if (DeviceCollectives* dc = device_collectives(t.device())) {
    dc->broadcast(t.data_ptr(), t.nbytes(), root, t.device());
    return;
  }
  std::vector<std::uint8_t> bytes = read_bytes(t);
  bcast_in_pieces(bytes.data(), bytes.size(), root, "broadcast");
  if (rank() != root) write_bytes(t, bytes.data());
}

Tensor all_gather(const Tensor& t) {
  require_tensor("all_gather", t);
  const Tensor& in = t;
  // A scalar gathers to a vector.
  std::vector<std::int64_t> dims =
      in.rank() == 0 ? std::vector<std::int64_t>{1} : in.shape().dims();
  dims[0] *= world_size();
  Tensor out = Tensor::empty(Shape(dims), in.dtype(), in.device());
  if (world_size() == 1) {
    if (in.nbytes() > 0) write_bytes(out, read_bytes(in).data());
    return out;
  }
  check_same_layout("all_gather", in);
  if (in.nbytes() == 0) return out;
  if (DeviceCollectives* dc = device_collectives(in.device())) {
    dc->all_gather(in.const_data_ptr(), out.data_ptr(), in.nbytes(), in.device());
    return out;
  }
  if (in.nbytes() > kMaxCount)
    throw DistributedError(fmt::format(
        "distributed::all_gather: {}{} is {} bytes; MPI gathers at most {} bytes per rank",
        in.dtype().name(), in.shape().str(), in.nbytes(), kMaxCount));
  std::vector<std::uint8_t> mine = read_bytes(in), all(out.nbytes());
  check_mpi(MPI_Allgather(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, all.data(),
                          static_cast<int>(mine.size()), MPI_BYTE, state().comm),
            "all_gather");
  write_bytes(out, all.data());
  return out;
}

double all_reduce_value(double value, ReduceOp op) {
  return all_reduce_values({value}, op).front();
}

std::vector<double> all_reduce_values(std::vector<double> values, ReduceOp op) {
  if (world_size() == 1) return values;
  check_same_call("all_reduce_values", values.size(), "values");
  if (values.empty()) return values;
  check_mpi(MPI_Allreduce(MPI_IN_PLACE, values.data(), static_cast<int>(values.size()), MPI_DOUBLE,
                          mpi_op(op), state().comm),
            "all_reduce_values");
  if (op == ReduceOp::Average)
    for (double& v : values) v /= static_cast<double>(world_size());
  return values;
}

namespace {

// The first item ("batch 8") where two descriptions differ, items being separated by ", " or
// "; " outside brackets: the start of an error message that a long description would bury.
std::pair<std::string, std::string> first_difference(const std::string& a, const std::string& b) {
  auto items = [](const std::string& s) {
    std::vector<std::string> out(1);
    int depth = 0;  // inside brackets: "cosine_decay(0.001, 32, 0)" is one item
    for (std::size_t i = 0; i < s.size(); ++i) {
      if (s[i] == '(' || s[i] == '[') ++depth;
      if ((s[i] == ')' || s[i] == ']') && depth > 0) --depth;
      if (depth == 0 && (s[i] == ',' || s[i] == ';') && i + 1 < s.size() && s[i + 1] == ' ') {
        out.emplace_back();
        ++i;
      } else {
        out.back() += s[i];
      }
    }
    return out;
  };
  const std::vector<std::string> x = items(a), y = items(b);
  for (std::size_t i = 0; i < std::max(x.size(), y.size()); ++i) {
    const std::string u = i < x.size() ? x[i] : "(nothing)", v = i < y.size() ? y[i] : "(nothing)";
    if (u != v) return {u, v};
  }
  return {a, b};
}

}  // namespace

void check_same_on_all_ranks(const std::string& who, const std::string& description) {
  if (world_size() == 1) return;
  const int n = world_size();
  int len = static_cast<int>(description.size());
  std::vector<int> lens(static_cast<std::size_t>(n)), offsets(static_cast<std::size_t>(n));
  check_mpi(MPI_Allgather(&len, 1, MPI_INT, lens.data(), 1, MPI_INT, state().comm),
            "check_same_on_all_ranks");
  int total = 0;
  for (int r = 0; r < n; ++r) {
    offsets[static_cast<std::size_t>(r)] = total;
    total += lens[static_cast<std::size_t>(r)];
  }
  std::string all(static_cast<std::size_t>(total), '\0');
  check_mpi(MPI_Allgatherv(description.data(), len, MPI_CHAR, all.data(), lens.data(),
                           offsets.data(), MPI_CHAR, state().comm),
            "check_same_on_all_ranks");
  auto of = [&](int r) {
    return all.substr(static_cast<std::size_t>(offsets[static_cast<std::size_t>(r)]),
                      static_cast<std::size_t>(lens[static_cast<std::size_t>(r)]));
  };
  const std::string root = of(0);
  for (int r = 1; r < n; ++r)
    if (of(r) != root) {
      const auto [mine, theirs] = first_difference(root, of(r));
      throw DistributedError(
          fmt::format("{}: rank {} differs from rank 0, first at '{}' (rank 0) against '{}' "
                      "(rank {}): rank 0 has {}; rank {} has {}",
                      who, r, mine, theirs, r, root, r, of(r)));
    }
}

// --- Host buffers --------------------------------------------------------------------------

void sum_host_buffer(void* data, std::size_t count, DType dtype) {
  if (dtype != kFloat32 && dtype != kFloat64)
    throw DTypeError(fmt::format(
        "distributed::sum_host_buffer: sums float32 or float64 buffers; got {}", dtype.name()));
  if (world_size() == 1) return;
  check_same_call("all_reduce (bucket)", count,
                  dtype == kFloat32 ? "float32 values" : "float64 values");
  if (count > 0)
    allreduce_in_pieces(data, count, reduce_type(dtype), dtype.itemsize(), MPI_SUM,
                        "all_reduce (bucket)");
}

// --- For backends -----------------------------------------------------------------------------

void register_device_collectives(DeviceType type, std::unique_ptr<DeviceCollectives> c) {
  state().device[type] = std::move(c);
}

void broadcast_host_bytes(void* data, std::size_t nbytes, int root) {
  if (world_size() == 1) return;
  bcast_in_pieces(data, nbytes, root, "broadcast_host_bytes");
}

}  // namespace mixtape::distributed
