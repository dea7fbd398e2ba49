// The optimizer base (validation, finiteness check, clipping, slots, state), the learning
// rate schedules, and SGD / RMSprop / Adam / AdamW on the backends' update kernels.
#include "mixtape/optim/optimizer.h"

#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <numbers>
#include <numeric>
#include <set>
#include <span>
#include <tuple>
#include <type_traits>

#include "mixtape/autograd/autocast.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/backend.h"
#include "mixtape/core/capture.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"
#include "optim/optim_util.h"

namespace mixtape::optim {

// --- Learning rates -------------------------------------------------------------------------

LearningRate::LearningRate(double value)
    : name_(fmt::format("{}", value)),
      constant_(value),
      schedule_([value](std::int64_t) { return value; }) {
  if (!std::isfinite(value) || value < 0.0)
    throw ValueError(fmt::format("learning rate must be finite and >= 0; got {}", value));
}

LearningRate::LearningRate(std::string name, std::function<double(std::int64_t)> schedule)
    : name_(std::move(name)), schedule_(std::move(schedule)) {
  if (!schedule_) throw ValueError(fmt::format("learning rate schedule '{}' is empty", name_));
}

double LearningRate::operator()(std::int64_t step) const {
  const double lr = schedule_(step);
  if (!std::isfinite(lr) || lr < 0.0)
    throw ValueError(
        fmt::format("learning rate schedule '{}' gave {} at step {}; it must be "
                    "finite and >= 0",
                    name_, lr, step));
  return lr;
}

namespace schedules {

LearningRate exponential_decay(double initial, std::int64_t decay_steps, double decay_rate,
                               bool staircase) {
  if (decay_steps <= 0)
    throw ValueError(
        fmt::format("exponential_decay: decay_steps must be positive; got {}", decay_steps));
  return LearningRate(fmt::format("exponential_decay({}, {}, {}{})", initial, decay_steps,
                                  decay_rate, staircase ? ", staircase" : ""),
                      [=](std::int64_t step) {
                        double p = static_cast<double>(step) / static_cast<double>(decay_steps);
                        if (staircase) p = std::floor(p);
                        return initial * std::pow(decay_rate, p);
                      });
}

LearningRate piecewise_constant(std::vector<std::int64_t> boundaries, std::vector<double> values) {
  if (values.size() != boundaries.size() + 1)
    throw ValueError(
        fmt::format("piecewise_constant: {} values for {} boundaries (need one more "
                    "value than boundaries)",
                    values.size(), boundaries.size()));
  if (!std::is_sorted(boundaries.begin(), boundaries.end()))
    throw ValueError("piecewise_constant: boundaries must be increasing");
  return LearningRate(fmt::format("piecewise_constant({} pieces)", values.size()),
                      [boundaries, values](std::int64_t step) {
                        std::size_t i = 0;
                        while (i < boundaries.size() && step > boundaries[i]) ++i;
                        return values[i];
                      });
}

LearningRate cosine_decay(double initial, std::int64_t decay_steps, double alpha) {
  if (decay_steps <= 0)
    throw ValueError(
        fmt::format("cosine_decay: decay_steps must be positive; got {}", decay_steps));
  return LearningRate(
      fmt::format("cosine_decay({}, {}, {})", initial, decay_steps, alpha), [=](std::int64_t step) {
        const double t =
            static_cast<double>(std::min(step, decay_steps)) / static_cast<double>(decay_steps);
        const double cosine = 0.5 * (1.0 + std::cos(std::numbers::pi * t));
        return initial * ((1.0 - alpha) * cosine + alpha);
      });
}

}  // namespace schedules

// --- Optimizer ------------------------------------------------------------------------------

// The finiteness flags read back behind their steps (set_finite_check's Device decision, a
// captured step's replays), oldest first. `uncount`: the step was counted when it was queued
// and is taken back if its flag is set (an eager step; a replay stays counted).
struct Optimizer::PendingChecks {
  struct Entry {
    std::int64_t step;
    std::unique_ptr<PendingRead> read;
    bool uncount;
  };
  std::deque<Entry> entries;
};

Optimizer::Optimizer(LearningRate lr, Clipping clipping)
    : learning_rate_(std::move(lr)),
      clipping_(clipping),
      pending_(std::make_shared<PendingChecks>()) {
  const int given = static_cast<int>(clipping_.clipnorm.has_value()) +
                    static_cast<int>(clipping_.global_clipnorm.has_value()) +
                    static_cast<int>(clipping_.clipvalue.has_value());
  if (given > 1)
    throw ValueError("optimizer: set at most one of clipnorm, global_clipnorm and clipvalue");
  for (const auto& v : {clipping_.clipnorm, clipping_.global_clipnorm, clipping_.clipvalue})
    if (v && !(*v > 0.0 && std::isfinite(*v)))
      throw ValueError(fmt::format("optimizer: clipping thresholds must be positive; got {}", *v));
}

Optimizer::Optimizer(const Optimizer& other)
    : learning_rate_(other.learning_rate_),
      clipping_(other.clipping_),
      // (other's checks read first: the copy's count holds no step taken back later)
      iterations_((other.read_pending(/*wait=*/true), other.iterations_)),
      // A copy of a wrapped optimizer stands alone: it checks its gradients again (a
      // LossScaleOptimizer turned the original's check off; its own copy turns it off again).
      check_finite_(other.wrappers_ > 0 || other.check_finite_),
      finite_check_(other.finite_check_),
      pending_(std::make_shared<PendingChecks>()) {
  for (const auto& [id, slots] : other.slots_) {
    std::vector<Variable> copies;
    for (const auto& s : slots) copies.emplace_back(s, s.name(), false);
    slots_.emplace(id, std::move(copies));
  }
}

Optimizer::~Optimizer() = default;

std::vector<Tensor> Optimizer::prepare(const std::vector<Tensor>& grads,
                                       const std::vector<Variable>& variables) {
  if (grads.size() != variables.size())
    throw ValueError(fmt::format("{}::apply_gradients: {} gradients for {} variables", name(),
                                 grads.size(), variables.size()));
  std::vector<Tensor> out(grads.size());
  for (std::size_t i = 0; i < grads.size(); ++i) {
    const Variable& v = variables[i];
    if (!v.defined())
      throw ValueError(fmt::format("{}::apply_gradients: variable {} is undefined", name(), i));
    if (!v.dtype().is_floating())
      throw DTypeError(fmt::format("{}::apply_gradients: variable '{}' is {}, not floating", name(),
                                   v.name(), v.dtype()));
    const Tensor& g = grads[i];
    if (!g.defined()) {
      if (!warned_missing_[v.id()]) {
        warned_missing_[v.id()] = true;
        spdlog::warn(
            "{}: no gradient for variable '{}' (the loss does not depend on it); it is "
            "left unchanged",
            name(), v.name());
      }
      continue;
    }
    if (g.shape() != v.shape())
      throw ShapeError(
          fmt::format("{}::apply_gradients: the gradient for '{}' has shape {}, the "
                      "variable {}",
                      name(), v.name(), g.shape(), v.shape()));
    if (g.device() != v.device())
      throw DeviceError(
          fmt::format("{}::apply_gradients: the gradient for '{}' is on {}, the "
                      "variable on {}",
                      name(), v.name(), g.device(), v.device()));
    if (!g.dtype().is_floating())
      throw DTypeError(fmt::format("{}::apply_gradients: the gradient for '{}' is {}, not floating",
                                   name(), v.name(), g.dtype()));
    out[i] = contiguous(cast(g, v.dtype()));
  }
  return out;
}

const std::vector<Variable>& Optimizer::slots_for(const Variable& var) {
  auto it = slots_.find(var.id());
  if (it != slots_.end()) return it->second;
  std::vector<Variable> made;
  for (const auto& s : slot_names())
    made.emplace_back(zeros(var.shape(), slot_dtype(var.dtype()), var.device()),
                      fmt::format("{}/{}", var.name(), s), /*trainable=*/false);
  return slots_.emplace(var.id(), std::move(made)).first->second;
}

std::vector<Variable> Optimizer::slots(const Variable& var) const {
  auto it = slots_.find(var.id());
  return it == slots_.end() ? std::vector<Variable>{} : it->second;
}

void Optimizer::apply_gradients(const std::vector<Tensor>& grads,
                                const std::vector<Variable>& variables) {
  step(grads, variables, Tensor());
}

void Optimizer::wrap(Optimizer& inner, const Optimizer& wrapper) {
  ++inner.wrappers_;
  inner.wrapper_name_ = wrapper.name();
}

void Optimizer::check_not_bypassed() const {
  if (wrappers_ == 0 || calls_from_wrapper_ > 0) return;
  throw ValueError(fmt::format(
      "{}: this optimizer is wrapped by a {} (made around it, or by compile() under a policy "
      "with a loss scale or on several ranks), which makes its steps; a step of its own would "
      "bypass the wrapper (its loss scaling, its finiteness check, its reduction across ranks). "
      "Step through the wrapper (model.optimizer() of the model it was compiled into), or give "
      "this model or loop an optimizer of its own (a new {}, or clone())",
      name(), wrapper_name_, name()));
}

namespace {
// The updates of one step, sent to the kernels together: while a step is under way (an
// UpdateBatch of this thread exists), run() queues each built-in optimizer's update, and the
// batch hands every run of updates with the same op, device and dtype to the kernel in one
// call (on a GPU, a launch per few dozen variables instead of one per variable). Outside a
// step run() updates at once.
class UpdateBatch {
 public:
  UpdateBatch() : previous_(current_) { current_ = this; }
  ~UpdateBatch() { current_ = previous_; }
  UpdateBatch(const UpdateBatch&) = delete;
  UpdateBatch& operator=(const UpdateBatch&) = delete;
  static UpdateBatch* current() { return current_; }

  void add(OpId op, kernels::OptimizerUpdate u) {
    ops_.push_back(op);
    updates_.push_back(std::move(u));
  }
  std::vector<kernels::OptimizerUpdate>& updates() { return updates_; }
  // Runs the queued updates, every group of the same op, device and dtype in one call
  // whatever the order they came in (the updates are independent of one another; a model
  // whose variables alternate dtypes still costs a call per dtype), and keeps the 16-bit
  // copies they wrote.
  void flush() {
    const auto key = [this](std::size_t i) {
      const Device d = updates_[i].var.device();
      return std::tuple(ops_[i], static_cast<int>(d.type()), d.index(),
                        updates_[i].var.dtype().index());
    };
    std::vector<std::size_t> order(updates_.size());
    std::iota(order.begin(), order.end(), std::size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](std::size_t a, std::size_t b) { return key(a) < key(b); });
    std::vector<kernels::OptimizerUpdate> group;
    for (std::size_t i = 0; i < order.size();) {
      std::size_t j = i;
      group.clear();
      for (; j < order.size() && key(order[j]) == key(order[i]); ++j)
        group.push_back(updates_[order[j]]);
      const kernels::OptimizerUpdate& first = group.front();
      find_kernel<kernels::OptimizerUpdateFn>(ops_[order[i]], first.var.device().type(),
                                              first.var.dtype())(group);
      i = j;
    }
    for (const auto& u : updates_)
      if (u.copy.defined()) keep_autocast_copy(u.var, u.copy);
    ops_.clear();
    updates_.clear();
  }

 private:
  static thread_local UpdateBatch* current_;
  UpdateBatch* previous_;
  std::vector<OpId> ops_;
  std::vector<kernels::OptimizerUpdate> updates_;
};
thread_local UpdateBatch* UpdateBatch::current_ = nullptr;

}  // namespace

void Optimizer::step(const std::vector<Tensor>& grads, const std::vector<Variable>& variables,
                     const Tensor& skip_if, const LateCount* late) {
  check_not_bypassed();
  NoGradGuard no_grad;
  std::vector<Tensor> g = prepare(grads, variables);
  // An earlier step's check (this call then applies nothing either).
  if (!capture::active()) read_pending(/*wait=*/true);
  // global_clipnorm's factor goes to the update kernels when they take it (no pass of its own
  // over the gradients); its sum of squares, made first, also decides a check on the device.
  Tensor grad_scale, squares;
  const bool factor_first = fuses_gradient_scale() && clipping_.global_clipnorm.has_value();
  if (factor_first) grad_scale = global_clip_factor(g, *clipping_.global_clipnorm, &squares);
  Tensor skip = skip_if;
  std::unique_ptr<PendingRead> deferred;  // queued once the step is counted
  if (check_finite_ && capture::active()) {
    skip = capture_finiteness_check(g, skip_if, squares);
  } else if (check_finite_ && !skip_if.defined() && finite_check_on_device(g, variables)) {
    // The updates skip on the flag; the host reads it behind the step (read_pending).
    const std::vector<Tensor> flags = nonfinite_flags(g, squares);
    if (!flags.empty()) {
      skip = flags.front();
      deferred = backend_for(skip.device().type())
                     .read_back(skip.const_data_ptr(), skip.device().index(), sizeof(float));
    }
  } else if (check_finite_ && any_set(nonfinite_flags(g, squares))) {
    if (const auto bad = first_nonfinite(g)) {  // (the culprit, for the message)
      throw NumericError(fmt::format(
          "{}: the gradient for '{}' holds NaN or infinite values at step {}; no variable was "
          "changed (under float16 use loss scaling: a LossScaleOptimizer skips such steps)",
          name(), variables[*bad].name(), iterations_ + 1));
    }
  }
  if (!factor_first) clip(g, clipping_);
  const double lr = learning_rate_(iterations_);
  const std::int64_t step = iterations_ + 1;
  struct Flags {  // skip_if_ and grad_scale_ for this step's updates only, also when one throws
    Tensor& skip;
    Tensor& scale;
    ~Flags() { skip = scale = Tensor(); }
  } step_flags{skip_if_, grad_scale_};
  skip_if_ = skip;
  grad_scale_ = grad_scale;
  UpdateBatch batch;
  for (std::size_t i = 0; i < g.size(); ++i)
    if (g[i].defined()) update(variables[i], g[i], slots_for(variables[i]), lr, step);
  if (capture::active()) {
    capture_updates(batch.updates(), late);
    batch.flush();
    return;  // the replays count the steps
  }
  batch.flush();
  ++iterations_;
  if (deferred) pending_->entries.push_back({iterations_, std::move(deferred), /*uncount=*/true});
}

Tensor Optimizer::capture_finiteness_check(const std::vector<Tensor>& grads, const Tensor& skip_if,
                                           const Tensor& squares) {
  if (!supports_device_skip() || skip_if.defined())
    throw CaptureError(fmt::format(
        "{}: its check for non-finite gradients reads them on the host, which a captured step "
        "cannot do; set_check_finite(false) to capture it",
        name()));
  const std::vector<Tensor> flags = nonfinite_flags(grads, squares);
  if (flags.empty()) return Tensor();  // no gradient this step
  const Tensor flag = flags.front();
  // The flag of each replay, read back behind it; those back are checked before the next
  // replay, the rest by the next eager step or check_pending.
  capture::after_replay([this, flag] {
    pending_->entries.push_back(
        {iterations_ + 1,
         backend_for(flag.device().type())
             .read_back(flag.const_data_ptr(), flag.device().index(), sizeof(float)),
         /*uncount=*/false});
  });
  capture::before_replay([this] { read_pending(/*wait=*/false); });  // (eager steps' waited for)
  return flag;
}

bool Optimizer::finite_check_on_device(const std::vector<Tensor>& grads,
                                       const std::vector<Variable>& variables) const {
  if (finite_check_ == StepDecision::Host || !supports_device_skip()) return false;
  std::optional<Device> device;
  for (const auto& g : grads) {
    if (!g.defined()) continue;
    if (device && g.device() != *device) return false;  // one flag per device: not one decision
    device = g.device();
  }
  if (!device || (finite_check_ == StepDecision::Auto && device->is_cpu())) return false;
  // The kernels read the flag on the variables' device: all of them on the gradients'.
  return std::all_of(variables.begin(), variables.end(),
                     [&](const Variable& v) { return !v.defined() || v.device() == *device; });
}

void Optimizer::read_pending(bool wait) const {
  std::optional<PendingChecks::Entry> bad;
  auto& entries = pending_->entries;
  // An eager step's flag is always waited for: a replay must not count a step taken back.
  while (!entries.empty() && (wait || entries.front().uncount || entries.front().read->ready())) {
    PendingChecks::Entry e = std::move(entries.front());
    entries.pop_front();
    float set = 0.0f;
    e.read->wait(&set);
    if (set == 0.0f) continue;
    if (e.uncount) --iterations_;
    if (!bad) bad = std::move(e);
  }
  if (!bad) return;
  if (bad->uncount)
    throw NumericError(fmt::format(
        "{}: a gradient held NaN or infinite values at step {} (read after that step: the check "
        "is decided on the device, set_finite_check); that step changed no variable and is not "
        "counted, and this call applied nothing (under float16 use loss scaling: a "
        "LossScaleOptimizer skips such steps)",
        name(), bad->step));
  throw NumericError(fmt::format(
      "{}: a gradient of the captured step held NaN or infinite values at step {}; that "
      "replay changed no variable (the step is counted)",
      name(), bad->step));
}

void Optimizer::check_pending() {
  if (Optimizer* inner = pass_through()) inner->check_pending();
  read_pending(/*wait=*/true);
}

void Optimizer::set_finite_check(StepDecision decision) {
  finite_check_ = decision;
  if (Optimizer* inner = pass_through()) inner->set_finite_check(decision);
}

void Optimizer::capture_updates(std::vector<kernels::OptimizerUpdate>& updates,
                                const LateCount* late) {
  if (updates.empty()) return;
  // The 16-bit copies the captured updates write (into the copies the captured forward pass
  // read): kept as the variables' copies after each replay, and brought up to date before one
  // when something else changed a variable meanwhile (an assign between replays).
  std::vector<std::pair<Tensor, Tensor>> copies;
  for (const auto& u : updates)
    if (u.copy.defined()) copies.emplace_back(u.var, u.copy);
  if (!copies.empty()) {
    capture::before_replay([copies] {
      for (const auto& [var, copy] : copies) refresh_autocast_copy(var, copy);
    });
    capture::after_replay([copies] {
      for (const auto& [var, copy] : copies) keep_autocast_copy(var, copy);
    });
  }
  const kernels::OptimizerUpdate& first = updates.front();
  const double beta1 = first.beta1, beta2 = first.beta2;
  const Device device = first.var.device();
  Tensor rates;
  if (late) {
    rates = late_rates(*late, beta1, beta2, device);
  } else {
    rates = capture::host_written({2}, kFloat64, device);
    capture::before_replay([this, rates, beta1, beta2, device] {
      const kernels::StepRates r =
          kernels::step_rates(learning_rate_(iterations_), iterations_ + 1, beta1, beta2);
      const double host[2] = {r.lr, r.alpha};
      backend_for(device.type()).copy(rates.data_ptr(), device, host, Device::cpu(), sizeof(host));
    });
  }
  for (auto& u : updates) u.rates = rates;
  capture::after_replay([this] { ++iterations_; });
}

Tensor Optimizer::late_rates(const LateCount& late, double beta1, double beta2, Device device) {
  // Before each replay the host writes the rates of every count the replay may have: row r
  // for iterations_ - r, r = 0 .. max_unread (iterations_ counts the replays not read yet;
  // r of them were skipped), and the skipped replays it has read. The replay takes row
  // (skipped on the device - skipped read): so the host queues it without waiting for the
  // flags of the replays before it. A row for a count below 0 is never taken (r is at most
  // the replays not read, which iterations_ counts): it holds count 0's rates.
  const std::int64_t rows = late.max_unread + 1;
  const Tensor table = capture::host_written({rows, 2}, kFloat64, device);
  const Tensor skipped_read = capture::host_written({1}, kInt64, device);
  capture::before_replay(
      [this, table, skipped_read, rows, beta1, beta2, device, read = late.skipped_read] {
        std::vector<double> host(static_cast<std::size_t>(2 * rows));
        for (std::int64_t r = 0; r < rows; ++r) {
          const std::int64_t count = std::max<std::int64_t>(iterations_ - r, 0);
          const kernels::StepRates s =
              kernels::step_rates(learning_rate_(count), count + 1, beta1, beta2);
          host[static_cast<std::size_t>(2 * r)] = s.lr;
          host[static_cast<std::size_t>(2 * r + 1)] = s.alpha;
        }
        const std::int64_t skipped = read();
        Backend& backend = backend_for(device.type());
        backend.copy(table.data_ptr(), device, host.data(), Device::cpu(),
                     host.size() * sizeof(double));
        backend.copy(skipped_read.data_ptr(), device, &skipped, Device::cpu(), sizeof(skipped));
      });
  // Recorded: the row of this replay's count (a CPU replay checks that it is in the table).
  return reshape(take(table, sub(late.skipped, skipped_read), 0), {2});
}

OptimizerState Optimizer::state(const std::vector<Variable>& variables) const {
  read_pending(/*wait=*/true);  // the step count without a step taken back later
  OptimizerState s;
  s.iterations = iterations_;
  const std::vector<std::string> names = slot_names();
  for (const auto& v : variables) {
    const std::vector<Variable> existing = slots(v);
    for (const auto& slot : existing) s.tensors.emplace(slot.name(), copy_of(slot));
    // A variable not stepped yet (it had no gradient so far) after steps of the others: the
    // zeros its first step would start from, so that a state with iterations > 0 holds the
    // slots of every variable (load_state insists).
    if (existing.empty() && iterations_ > 0)
      for (const auto& name : names)
        s.tensors.emplace(fmt::format("{}/{}", v.name(), name),
                          zeros(v.shape(), slot_dtype(v.dtype()), v.device()));
  }
  return s;
}

void Optimizer::load_state(const OptimizerState& state, const std::vector<Variable>& variables) {
  // Validate everything first, so that a bad state changes nothing.
  const std::string who = fmt::format("{}::load_state", name());
  if (state.iterations < 0)
    throw ValueError(fmt::format("{}: iterations is {}; it must be >= 0", who, state.iterations));
  if (!state.scalars.empty())
    throw ValueError(fmt::format("{}: unknown scalar '{}' ({} keeps none)", who,
                                 state.scalars.begin()->first, name()));
  const std::vector<std::string> names = slot_names();
  std::set<std::string> expected;  // every "<variable>/<slot>" of `variables`
  std::vector<std::pair<Variable, std::vector<Tensor>>> plan;
  std::vector<Variable> restart;  // variables with no slots in the state (iterations 0)
  for (const auto& v : variables) {
    std::vector<Tensor> values;
    bool any = false;
    for (const auto& s : names) {
      const std::string key = fmt::format("{}/{}", v.name(), s);
      expected.insert(key);
      auto it = state.tensors.find(key);
      any = any || it != state.tensors.end();
      values.push_back(it == state.tensors.end() ? Tensor() : it->second);
    }
    if (!any) {
      // Not stepped yet: only possible before the first step (state() saves the slots of
      // every variable once iterations > 0); otherwise its state would silently restart.
      if (state.iterations > 0 && !names.empty())
        throw ValueError(fmt::format(
            "{}: slot '{}/{}' is missing although iterations is {} (> 0: every variable has its "
            "slots)",
            who, v.name(), names.front(), state.iterations));
      restart.push_back(v);
      continue;
    }
    for (std::size_t k = 0; k < names.size(); ++k) {
      const std::string slot = fmt::format("{}/{}", v.name(), names[k]);
      if (!values[k].defined())
        throw ValueError(fmt::format("{}: slot '{}' is missing", who, slot));
      if (values[k].shape() != v.shape() || values[k].dtype() != slot_dtype(v.dtype()))
        throw ValueError(fmt::format("{}: slot '{}' is {}{}, expected {}{}", who, slot,
                                     values[k].dtype(), values[k].shape(), slot_dtype(v.dtype()),
                                     v.shape()));
    }
    plan.emplace_back(v, std::move(values));
  }
  for (const auto& [key, t] : state.tensors)
    if (!expected.count(key))
      throw ValueError(fmt::format(
          "{}: '{}' is not a slot of the variables given ({} keeps {})", who, key, name(),
          names.empty() ? std::string("no slots") : fmt::format("{}", fmt::join(names, ", "))));
  // Now change: slots made (or restarted) and assigned, then the step count.
  NoGradGuard no_grad;
  for (auto& [v, values] : plan) {
    const auto& slots = slots_for(v);
    for (std::size_t k = 0; k < slots.size(); ++k) {
      Variable slot = slots[k];
      slot.assign(values[k].to(slot.device()));
    }
  }
  for (const auto& v : restart) slots_.erase(v.id());
  iterations_ = state.iterations;
  pending_->entries.clear();  // checks of steps before the state: not this count's to take back
}

// --- The optimizers -------------------------------------------------------------------------

namespace {
kernels::OptimizerUpdate update_args(const Variable& var, const Tensor& grad,
                                     const std::vector<Variable>& slots, double lr,
                                     std::int64_t step) {
  kernels::OptimizerUpdate u;
  u.var = var;
  u.grad = grad;
  if (!slots.empty()) u.slot1 = slots[0];
  if (slots.size() > 1) u.slot2 = slots[1];
  if (slots.size() > 2) u.slot3 = slots[2];
  u.lr = lr;
  u.step = step;
  // The 16-bit copy the variable is read as under autocast, written beside the update so
  // that the next forward pass needs no cast of the weights (autocast.h; only a float32
  // variable keeps one).
  if (const auto dtype = autocast_copy_dtype(var)) {
    // A captured step writes it where its forward pass read the copy (mixtape/core/capture.h):
    // each replay then reads what the one before wrote.
    const Tensor kept = capture::active() ? kept_autocast_copy(var) : Tensor();
    u.copy = kept.defined() ? kept : Tensor::empty(var.shape(), *dtype, var.device());
  }
  return u;
}

void run(OpId op, kernels::OptimizerUpdate u) {
  if (UpdateBatch* batch = UpdateBatch::current()) return batch->add(op, std::move(u));
  find_kernel<kernels::OptimizerUpdateFn>(
      op, u.var.device().type(), u.var.dtype())(std::span<const kernels::OptimizerUpdate>(&u, 1));
  if (u.copy.defined()) keep_autocast_copy(u.var, u.copy);
}
}  // namespace

SGD::SGD(SGDOptions options)
    : Optimizer(options.learning_rate, options.clipping), options_(options) {
  if (!(options_.momentum >= 0.0 && options_.momentum < 1.0))
    throw ValueError(fmt::format("SGD: momentum must be in [0, 1); got {}", options_.momentum));
}

std::vector<std::string> SGD::slot_names() const {
  if (options_.momentum > 0.0) return {"momentum"};
  return {};
}

void SGD::update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
                 double lr, std::int64_t step) {
  auto u = update_args(var, grad, slots, lr, step);
  u.skip_if = skip_flag();
  u.grad_scale = gradient_scale();
  u.momentum = options_.momentum;
  u.nesterov = options_.nesterov;
  run(OpId::sgd_update, u);
}

RMSprop::RMSprop(RMSpropOptions options)
    : Optimizer(options.learning_rate, options.clipping), options_(options) {
  if (!(options_.rho >= 0.0 && options_.rho < 1.0))
    throw ValueError(fmt::format("RMSprop: rho must be in [0, 1); got {}", options_.rho));
  if (!(options_.momentum >= 0.0 && options_.momentum < 1.0))
    throw ValueError(fmt::format("RMSprop: momentum must be in [0, 1); got {}", options_.momentum));
  if (!(options_.epsilon > 0.0))
    throw ValueError(fmt::format("RMSprop: epsilon must be positive; got {}", options_.epsilon));
}

std::vector<std::string> RMSprop::slot_names() const {
  // The kernel's order: slot1 mean square, slot2 momentum, slot3 mean gradient.
  std::vector<std::string> names{"rms"};
  if (options_.momentum > 0.0 || options_.centered) names.emplace_back("momentum");
  if (options_.centered) names.emplace_back("mg");
  return names;
}

void RMSprop::update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
                     double lr, std::int64_t step) {
  auto u = update_args(var, grad, slots, lr, step);
  u.skip_if = skip_flag();
  u.grad_scale = gradient_scale();
  u.beta2 = options_.rho;
  u.momentum = options_.momentum;
  u.epsilon = options_.epsilon;
  u.centered = options_.centered;
  run(OpId::rmsprop_update, u);
}

Adam::Adam(AdamOptions options) : Adam(options, 0.0) {}

Adam::Adam(AdamOptions options, double weight_decay)
    : Optimizer(options.learning_rate, options.clipping),
      options_(options),
      weight_decay_(weight_decay) {
  if (!(options_.beta_1 >= 0.0 && options_.beta_1 < 1.0) ||
      !(options_.beta_2 >= 0.0 && options_.beta_2 < 1.0))
    throw ValueError(fmt::format("{}: beta_1 and beta_2 must be in [0, 1); got {} and {}",
                                 weight_decay > 0 ? "AdamW" : "Adam", options_.beta_1,
                                 options_.beta_2));
  if (!(options_.epsilon > 0.0))
    throw ValueError(fmt::format("Adam: epsilon must be positive; got {}", options_.epsilon));
  if (!(weight_decay >= 0.0))
    throw ValueError(fmt::format("AdamW: weight_decay must be >= 0; got {}", weight_decay));
}

std::vector<std::string> Adam::slot_names() const {
  if (options_.amsgrad) return {"m", "v", "vhat"};
  return {"m", "v"};
}

void Adam::update(const Variable& var, const Tensor& grad, const std::vector<Variable>& slots,
                  double lr, std::int64_t step) {
  auto u = update_args(var, grad, slots, lr, step);
  u.skip_if = skip_flag();
  u.grad_scale = gradient_scale();
  u.beta1 = options_.beta_1;
  u.beta2 = options_.beta_2;
  u.epsilon = options_.epsilon;
  u.amsgrad = options_.amsgrad;
  u.weight_decay = weight_decay_;
  run(OpId::adam_update, u);
}

AdamW::AdamW(AdamWOptions o)
    : Adam(AdamOptions{o.learning_rate, o.beta_1, o.beta_2, o.epsilon, o.amsgrad, o.clipping},
           o.weight_decay) {}

std::vector<Tensor> Optimizer::compute_gradients(GradientTape& tape, const Tensor& loss,
                                                 const std::vector<Variable>& variables) {
  return chain_gradients(
      tape, loss, variables,
      [](GradientTape& t, const Tensor& target, const std::vector<Variable>& vars) {
        return target.defined() ? t.gradient(target, vars) : std::vector<Tensor>(vars.size());
      });
}

std::vector<Tensor> Optimizer::chain_gradients(GradientTape& tape, const Tensor& loss,
                                               const std::vector<Variable>& variables,
                                               const Backward& backward) {
  return backward(tape, loss, variables);
}

std::map<std::string, double> Optimizer::get_config() const {
  if (!learning_rate_.constant())
    throw ValueError(fmt::format("{}: the learning rate is the schedule '{}', which has no config",
                                 name(), learning_rate_.name()));
  std::map<std::string, double> c{{"learning_rate", *learning_rate_.constant()}};
  if (clipping_.clipnorm) c["clipnorm"] = *clipping_.clipnorm;
  if (clipping_.global_clipnorm) c["global_clipnorm"] = *clipping_.global_clipnorm;
  if (clipping_.clipvalue) c["clipvalue"] = *clipping_.clipvalue;
  return c;
}

std::map<std::string, double> SGD::get_config() const {
  std::map<std::string, double> c = Optimizer::get_config();
  c["momentum"] = options_.momentum;
  c["nesterov"] = options_.nesterov ? 1.0 : 0.0;
  return c;
}

std::map<std::string, double> RMSprop::get_config() const {
  std::map<std::string, double> c = Optimizer::get_config();
  c["rho"] = options_.rho;
  c["momentum"] = options_.momentum;
  c["epsilon"] = options_.epsilon;
  c["centered"] = options_.centered ? 1.0 : 0.0;
  return c;
}

std::map<std::string, double> Adam::get_config() const {
  std::map<std::string, double> c = Optimizer::get_config();
  c["beta_1"] = options_.beta_1;
  c["beta_2"] = options_.beta_2;
  c["epsilon"] = options_.epsilon;
  c["amsgrad"] = options_.amsgrad ? 1.0 : 0.0;
  if (name() == "AdamW") c["weight_decay"] = weight_decay_;
  return c;
}

std::shared_ptr<Optimizer> from_config(const std::string& name,
                                       const std::map<std::string, double>& config) {
  std::map<std::string, double> left = config;
  // Takes config[key] into `into` (a number or a flag) when present.
  auto take = [&](const char* key, auto& into) {
    auto it = left.find(key);
    if (it == left.end()) return;
    if constexpr (std::is_same_v<std::decay_t<decltype(into)>, bool>) {
      if (it->second != 0.0 && it->second != 1.0)
        throw ValueError(
            fmt::format("optimizer {}: '{}' is a flag (0 or 1); got {}", name, key, it->second));
      into = it->second == 1.0;
    } else {
      into = it->second;
    }
    left.erase(it);
  };
  auto common = [&](auto& o) {
    double lr = 0.0;
    if (left.count("learning_rate")) {
      take("learning_rate", lr);
      o.learning_rate = lr;
    }
    for (const char* key : {"clipnorm", "global_clipnorm", "clipvalue"}) {
      auto it = left.find(key);
      if (it == left.end()) continue;
      (std::string_view(key) == "clipnorm"          ? o.clipping.clipnorm
       : std::string_view(key) == "global_clipnorm" ? o.clipping.global_clipnorm
                                                    : o.clipping.clipvalue) = it->second;
      left.erase(it);
    }
  };
  auto done = [&](std::shared_ptr<Optimizer> o) {
    if (!left.empty())
      throw ValueError(fmt::format("optimizer {}: unknown option '{}' in its config", name,
                                   left.begin()->first));
    return o;
  };
  if (name == "SGD") {
    SGDOptions o;
    common(o);
    take("momentum", o.momentum);
    take("nesterov", o.nesterov);
    return done(std::make_shared<SGD>(o));
  }
  if (name == "RMSprop") {
    RMSpropOptions o;
    common(o);
    take("rho", o.rho);
    take("momentum", o.momentum);
    take("epsilon", o.epsilon);
    take("centered", o.centered);
    return done(std::make_shared<RMSprop>(o));
  }
  if (name == "Adam" || name == "AdamW") {
    AdamWOptions o;
    common(o);
    take("beta_1", o.beta_1);
    take("beta_2", o.beta_2);
    take("epsilon", o.epsilon);
    take("amsgrad", o.amsgrad);
    if (name == "AdamW") {
      take("weight_decay", o.weight_decay);
      return done(std::make_shared<AdamW>(o));
    }
    return done(std::make_shared<Adam>(
        AdamOptions{o.learning_rate, o.beta_1, o.beta_2, o.epsilon, o.amsgrad, o.clipping}));
  }
  throw ValueError(fmt::format(
      "unknown optimizer class '{}' in a config; known: SGD, RMSprop, Adam, AdamW", name));
}

std::shared_ptr<Optimizer> get(std::string_view name) {
  if (name == "sgd" || name == "SGD") return std::make_shared<SGD>();
  if (name == "rmsprop" || name == "RMSprop") return std::make_shared<RMSprop>();
  if (name == "adam" || name == "Adam") return std::make_shared<Adam>();
  if (name == "adamw" || name == "AdamW") return std::make_shared<AdamW>();
  throw ValueError(
      fmt::format("unknown optimizer '{}'; valid names: sgd, rmsprop, adam, adamw", name));
}

}  // namespace mixtape::optim
