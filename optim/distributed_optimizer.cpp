// DistributedOptimizer: gradients averaged across ranks in buckets, each reduced as soon as
// the tape has its gradients (gradient()) or all after the backward pass (apply_gradients,
// all_reduce_gradients).
#include "mixtape/optim/distributed_optimizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <utility>

#include "mixtape/autograd/ops.h"
#include "mixtape/core/backend.h"
#include "mixtape/distributed/distributed.h"

namespace mixtape::optim {

// Which gradient goes to which bucket: buckets of one reduce dtype (float32, or float64 for
// float64 variables), filled from the last variable to the first (the order in which the
// backward pass finishes them), at most bucket_bytes each (a larger variable alone).
struct DistributedOptimizer::Plan {
  struct Entry {
    std::size_t index;    // into the gradients
    std::int64_t offset;  // into the bucket
    std::int64_t count;
  };
  struct Bucket {
    DType dtype;
    std::vector<Entry> entries;
    std::int64_t values = 0;
  };
  std::vector<Bucket> buckets;
  std::vector<std::size_t> bucket_of;  // per gradient
};

namespace {

// The default bucket sizes (DistributedOptimizerOptions::bucket_bytes == 0).
constexpr std::size_t kCpuBucketBytes = std::size_t{4} << 20;
constexpr std::size_t kDeviceBucketBytes = std::size_t{25} << 20;

DType reduce_dtype(DType d) { return d == kFloat64 ? kFloat64 : kFloat32; }

// Whether every defined gradient is in `ids` (and at least one is).
bool all_in(const std::vector<Tensor>& grads, const std::unordered_set<std::uint64_t>& ids) {
  bool any = false;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    if (!ids.count(g.id())) return false;
    any = true;
  }
  return any;
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(std::shared_ptr<Optimizer> inner,
                                           DistributedOptimizerOptions options)
    : Optimizer(0.0, Clipping{}), inner_(std::move(inner)), options_(options) {
  if (!inner_) throw ValueError("DistributedOptimizer: the wrapped optimizer is empty");
  if (dynamic_cast<DistributedOptimizer*>(inner_.get()))
    throw ValueError("DistributedOptimizer: cannot wrap another DistributedOptimizer");
  wrap(*inner_, *this);
}

DistributedOptimizer::DistributedOptimizer(const DistributedOptimizer& other)
    : Optimizer(other),
      inner_(other.inner_->clone()),
      options_(other.options_),
      weight_(other.weight_) {
  wrap(*inner_, *this);
}

DistributedOptimizer::~DistributedOptimizer() {
  if (inner_) unwrap(*inner_);
}

void DistributedOptimizer::synchronize(const std::string& who, const std::string& description,
                                       const std::vector<Variable>& variables,
                                       std::uint64_t* seed) {
  if (distributed::world_size() == 1) return;
  distributed::check_same_on_all_ranks(who, description);
  for (const Variable& v : variables) {
    Tensor t = v;
    distributed::broadcast(t, 0);
  }
  if (seed) {
    Tensor s = from_vector(std::vector<std::int64_t>{static_cast<std::int64_t>(*seed)}, Shape{1});
    distributed::broadcast(s, 0);
    *seed = static_cast<std::uint64_t>(s.item<std::int64_t>());
  }
}

std::map<std::string, double> average_over_ranks(const std::map<std::string, double>& logs,
                                                 std::int64_t rows) {
  if (distributed::world_size() == 1) return logs;
  std::vector<double> v;
  for (const auto& [key, value] : logs)
    v.push_back(rows > 0 ? value * static_cast<double>(rows) : 0.0);
  v.push_back(static_cast<double>(rows));
  v = distributed::all_reduce_values(std::move(v));
  const double total = v.back();
  std::map<std::string, double> out;
  std::size_t i = 0;
  for (const auto& [key, value] : logs) out[key] = total > 0 ? v[i++] / total : (++i, 0.0);
  return out;
}

void DistributedOptimizer::set_gradient_weight(double weight) {
  if (!(weight >= 0.0) || !std::isfinite(weight))
    throw ValueError(fmt::format(
        "DistributedOptimizer::set_gradient_weight: the weight must be finite and >= 0; got {}",
        weight));
  weight_ = weight;
}

double DistributedOptimizer::take_weight() {
  const double w = weight_ >= 0.0 ? weight_ : 1.0 / distributed::world_size();
  weight_ = -1.0;
  return w;
}

DistributedOptimizer::Plan DistributedOptimizer::plan(const std::vector<Tensor>& like) const {
  Plan p;
  p.bucket_of.assign(like.size(), 0);
  // The open bucket of each reduce dtype (index into p.buckets), -1 when none.
  std::ptrdiff_t open[2] = {-1, -1};
  for (std::size_t k = like.size(); k-- > 0;) {
    const DType rd = reduce_dtype(like[k].dtype());
    std::ptrdiff_t& b = open[rd == kFloat64 ? 1 : 0];
    const std::int64_t count = like[k].numel();
    const auto bytes = static_cast<std::size_t>(count) * rd.itemsize();
    const std::size_t limit = options_.bucket_bytes > 0                    ? options_.bucket_bytes
                              : like[k].device().type() == DeviceType::CPU ? kCpuBucketBytes
                                                                           : kDeviceBucketBytes;
    if (b >= 0) {
      const auto& cur = p.buckets[static_cast<std::size_t>(b)];
      if (static_cast<std::size_t>(cur.values) * rd.itemsize() + bytes > limit) b = -1;
    }
    if (b < 0) {
      p.buckets.push_back({rd, {}, 0});
      b = static_cast<std::ptrdiff_t>(p.buckets.size() - 1);
    }
    auto& bucket = p.buckets[static_cast<std::size_t>(b)];
    bucket.entries.push_back({k, bucket.values, count});
    bucket.values += count;
    p.bucket_of[k] = static_cast<std::size_t>(b);
  }
  return p;
}

namespace {

// The bucket's values (each gradient times this rank's weight, zeros for an undefined one),
// copied into one buffer on the gradients' device.
Tensor pack(const DistributedOptimizer::Plan::Bucket& bucket, const std::vector<Tensor>& grads,
            const std::vector<Tensor>& like, double weight) {
  NoGradGuard no_grad;
  const Device device = like[bucket.entries.front().index].device();
  const std::size_t item = bucket.dtype.itemsize();
  Tensor out = Tensor::empty(Shape{bucket.values}, bucket.dtype, device);
  auto* base = static_cast<char*>(out.data_ptr());
  Backend& backend = backend_for(device.type());
  for (const auto& e : bucket.entries) {
    const Tensor& g = grads[e.index];
    Tensor src;
    if (g.defined()) {
      src = cast(g, bucket.dtype);
      if (weight != 1.0) src = src * weight;
      src = src.contiguous();
    } else {
      src = zeros(Shape{e.count}, bucket.dtype, device);
    }
    backend.copy(base + static_cast<std::size_t>(e.offset) * item, device, src.const_data_ptr(),
                 device, static_cast<std::size_t>(e.count) * item);
  }
  return out;
}

// Sums a packed bucket across ranks in place: on the CPU over MPI on its memory, elsewhere
// through distributed::all_reduce (NCCL, or the host).
Tensor reduce_bucket(Tensor buffer) {
  if (buffer.device().type() == DeviceType::CPU)
    distributed::sum_host_buffer(buffer.data_ptr(), static_cast<std::size_t>(buffer.numel()),
                                 buffer.dtype());
  else
    distributed::all_reduce(buffer, distributed::ReduceOp::Sum);
  return buffer;
}

void unpack(const DistributedOptimizer::Plan::Bucket& bucket, const Tensor& buffer,
            const std::vector<Tensor>& like, std::vector<Tensor>& out) {
  NoGradGuard no_grad;
  for (const auto& e : bucket.entries) {
    const Tensor& v = like[e.index];
    out[e.index] =
        cast(reshape(slice(buffer, 0, e.offset, e.offset + e.count), v.shape()), v.dtype())
            .contiguous();
  }
}

// A gradient that no rank has stays undefined: which gradients each rank has is summed on
// the host, in one small all-reduce per step (reading flags back from a GPU's buckets would
// be a host synchronisation per bucket).
void undefine_where_no_rank_has(const std::vector<Tensor>& grads, std::vector<Tensor>& out) {
  std::vector<double> have;
  for (const auto& g : grads) have.push_back(g.defined() ? 1.0 : 0.0);
  have = distributed::all_reduce_values(std::move(have));
  for (std::size_t i = 0; i < out.size(); ++i)
    if (have[i] == 0.0) out[i] = Tensor();
}

}  // namespace

std::vector<Tensor> DistributedOptimizer::reduce(const std::vector<Tensor>& grads,
                                                 const std::vector<Tensor>& like, double weight) {
  if (distributed::world_size() == 1) {
    if (weight == 1.0) return grads;
    NoGradGuard no_grad;
    std::vector<Tensor> out;
    for (const auto& g : grads) out.push_back(g.defined() ? g * weight : g);
    return out;
  }
  const Plan p = plan(like);
  last_buckets_.clear();
  std::vector<Tensor> out(grads.size());
  for (const auto& b : p.buckets) {
    unpack(b, reduce_bucket(pack(b, grads, like, weight)), like, out);
    last_buckets_.push_back(static_cast<std::size_t>(b.values) * b.dtype.itemsize());
  }
  undefine_where_no_rank_has(grads, out);
  return out;
}

std::vector<Tensor> DistributedOptimizer::all_reduce_gradients(
    const std::vector<Tensor>& grads, const std::vector<Variable>& variables) {
  // Every rank needs the same plan, made from shapes and dtypes: the variables', or the
  // gradients' when the variables are not given (then every gradient must be defined).
  std::vector<Tensor> like(variables.begin(), variables.end());
  if (variables.empty()) {
    for (const auto& g : grads) {
      if (!g.defined())
        throw ValueError(
            "DistributedOptimizer::all_reduce_gradients: an undefined gradient; pass the "
            "variables too (all_reduce_gradients(grads, variables)) so that its place in the "
            "buckets is known");
      like.push_back(g);
    }
  } else if (variables.size() != grads.size()) {
    throw ValueError(
        fmt::format("DistributedOptimizer::all_reduce_gradients: {} gradients for {} variables",
                    grads.size(), variables.size()));
  }
  std::vector<Tensor> out = reduce(grads, like, take_weight());
  reduced_ids_.clear();
  for (const auto& g : out)
    if (g.defined()) reduced_ids_.insert(g.id());
  return out;
}

namespace {
std::vector<Tensor> as_tensors(const std::vector<Variable>& vars) {
  return std::vector<Tensor>(vars.begin(), vars.end());
}
}  // namespace

std::vector<Tensor> DistributedOptimizer::gradient(GradientTape& tape, const Tensor& target,
                                                   const std::vector<Variable>& variables) {
  const std::vector<Tensor> like = as_tensors(variables);
  const double weight = take_weight();
  const Plan p = plan(like);
  // The weight multiplies the target (the tape records the product): the gradients come out
  // weighted, with no pass over them.
  const Tensor weighted = weight == 1.0 ? target : target * weight;
  std::vector<Tensor> grads(like.size());
  std::vector<std::int64_t> missing(p.buckets.size());
  for (std::size_t b = 0; b < p.buckets.size(); ++b)
    missing[b] = static_cast<std::int64_t>(p.buckets[b].entries.size());
  std::vector<Tensor> out(like.size());
  last_buckets_.clear();
  // Buckets are reduced in their order on every rank (MPI needs the same order everywhere):
  // a bucket complete before an earlier one waits for it.
  std::size_t next = 0;
  auto reduce_ready = [&] {
    for (; next < p.buckets.size() && missing[next] == 0; ++next) {
      const auto& b = p.buckets[next];
      unpack(b, reduce_bucket(pack(b, grads, like, 1.0)), like, out);
      last_buckets_.push_back(static_cast<std::size_t>(b.values) * b.dtype.itemsize());
    }
  };
  tape.gradient(weighted, variables, [&](std::size_t i, const Tensor& g) {
    grads[i] = g;
    --missing[p.bucket_of[i]];
    reduce_ready();
  });
  reduce_ready();
  undefine_where_no_rank_has(grads, out);
  reduced_ids_.clear();
  for (const auto& g : out)
    if (g.defined()) reduced_ids_.insert(g.id());
  return out;
}

std::vector<Tensor> DistributedOptimizer::chain_gradients(GradientTape& tape, const Tensor& loss,
                                                          const std::vector<Variable>& variables,
                                                          const Backward&) {
  capture::forbid("DistributedOptimizer: the reductions across processes");
  const Backward reducing = [this](GradientTape& t, const Tensor& target,
                                   const std::vector<Variable>& vars) {
    return target.defined() ? gradient(t, target, vars)
                            : all_reduce_gradients(std::vector<Tensor>(vars.size()), vars);
  };
  std::vector<Tensor> out = inner_->chain_gradients(tape, loss, variables, reducing);
  reduced_ids_.clear();
  for (const auto& g : out)
    if (g.defined()) reduced_ids_.insert(g.id());
  chain_reduced_ = true;
  return out;
}

Tensor DistributedOptimizer::get_scaled_loss(const Tensor& loss) const {
  LossScaleOptimizer* lso = loss_scale_optimizer();
  if (!lso)
    throw ValueError(
        fmt::format("DistributedOptimizer::get_scaled_loss: the wrapped optimizer is {}, not a "
                    "LossScaleOptimizer",
                    inner_->name()));
  return lso->get_scaled_loss(loss);
}

std::vector<Tensor> DistributedOptimizer::get_unscaled_gradients(const std::vector<Tensor>& grads) {
  LossScaleOptimizer* lso = loss_scale_optimizer();
  if (!lso)
    throw ValueError(fmt::format(
        "DistributedOptimizer::get_unscaled_gradients: the wrapped optimizer is {}, not a "
        "LossScaleOptimizer",
        inner_->name()));
  const std::vector<Tensor> reduced =
      all_in(grads, reduced_ids_) ? grads : all_reduce_gradients(grads);
  std::vector<Tensor> out = lso->get_unscaled_gradients(reduced);
  reduced_ids_.clear();
  for (const auto& g : out)
    if (g.defined()) reduced_ids_.insert(g.id());
  return out;
}

void DistributedOptimizer::apply_gradients(const std::vector<Tensor>& grads,
                                           const std::vector<Variable>& variables) {
  capture::forbid("DistributedOptimizer: the reductions across processes");
  if (grads.size() != variables.size())
    throw ValueError(
        fmt::format("DistributedOptimizer::apply_gradients: {} gradients for {} "
                    "variables",
                    grads.size(), variables.size()));
  check_not_bypassed();
  std::vector<Tensor> reduced;
  if (std::exchange(chain_reduced_, false) || all_in(grads, reduced_ids_)) {
    reduced = grads;
  } else {
    // The plan comes from the variables, so an undefined gradient has its place too.
    reduced = reduce(grads, as_tensors(variables), take_weight());
  }
  reduced_ids_.clear();
  const WrapperCall call(*inner_);
  inner_->apply_gradients(reduced, variables);
}

}  // namespace mixtape::optim
