// GradientTape: recording and the reverse walk.
#include "mixtape/autograd/tape.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "autograd/op_util.h"
#include "core/raw.h"
#include "mixtape/autograd/ops.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/kernels.h"

namespace mixtape {

namespace {

// One recorded op: its inputs' identities and metadata, its output, its backward rule.
struct Node {
  const char* name;
  std::vector<std::uint64_t> input_ids;
  std::vector<Shape> input_shapes;
  std::vector<DType> input_dtypes;
  std::uint64_t output_id;
  BackwardFn backward;
};

// The widening casts of sources' gradients, deferred and made together: a variable read
// through a 16-bit copy (autocast) gets its gradient from a cast node's backward, a widening
// cast each (on a GPU, a launch per variable and step); these are instead collected and
// widened with one cast_list call per (device, dtype pair) when the walk ends. A source with a
// deferred cast keeps every contribution to its gradient in order, added in that order once
// widened: the bits of the cast-by-cast walk (widening is exact).
class WideningCasts {
 public:
  // Whether the gradient g of a cast node's output, for a source of dtype `to`, widens.
  static bool widens(const Tensor& g, DType to) {
    const DType from = g.dtype();
    return (to == kFloat32 && (from == kFloat16 || from == kBFloat16)) ||
           (to == kFloat64 && from.is_floating() && from != kFloat64);
  }
  bool holds(std::uint64_t id) const { return parts_.count(id) > 0; }
  // g, to be widened to `to`, for source id; what grads holds for it so far goes first.
  void defer(std::uint64_t id, const Tensor& g, DType to,
             std::unordered_map<std::uint64_t, Tensor>& grads) {
    auto [it, first] = parts_.try_emplace(id);
    if (first) {
      order_.push_back(id);
      if (auto held = grads.find(id); held != grads.end()) {
        it->second.push_back({held->second, std::nullopt});
        grads.erase(held);
      }
    }
    it->second.push_back({detail::contiguous_raw(g), to});
  }
  // A later contribution (already in the source's dtype) to a source with a deferred cast.
  void then(std::uint64_t id, const Tensor& g) { parts_.at(id).push_back({g, std::nullopt}); }
  // Widens every deferred gradient (a cast_list call per device and dtype pair) and puts each
  // source's sum, in the order of its contributions, into grads.
  void finish(std::unordered_map<std::uint64_t, Tensor>& grads) {
    std::map<std::tuple<int, int, int, int>, std::vector<Part*>> groups;
    for (auto& [id, parts] : parts_)
      for (Part& p : parts)
        if (p.to) {
          const Device d = p.g.device();
          groups[{static_cast<int>(d.type()), d.index(), p.g.dtype().index(), p.to->index()}]
              .push_back(&p);
        }
    for (auto& [key, members] : groups) {
      std::vector<Tensor> xs, outs;
      for (Part* p : members) {
        xs.push_back(p->g);
        outs.push_back(Tensor::empty(p->g.shape(), *p->to, p->g.device()));
      }
      const Tensor& first = xs.front();
      find_kernel<kernels::CastListFn>(OpId::cast_list, first.device().type(), first.dtype())(xs,
                                                                                              outs);
      for (std::size_t i = 0; i < members.size(); ++i) {
        members[i]->g = outs[i];
        members[i]->to.reset();
      }
    }
    for (const std::uint64_t id : order_) {
      const std::vector<Part>& parts = parts_.at(id);
      Tensor sum = parts.front().g;
      for (std::size_t i = 1; i < parts.size(); ++i) sum = mixtape::add(sum, parts[i].g);
      grads[id] = sum;
    }
  }

 private:
  struct Part {
    Tensor g;
    std::optional<DType> to;  // set: still to be widened to it
  };
  std::unordered_map<std::uint64_t, std::vector<Part>> parts_;
  std::vector<std::uint64_t> order_;  // the sources, in the order of their first deferral
};

}  // namespace

struct GradientTape::Impl {
  GradientTapeOptions options;
  std::vector<Node> nodes;
  std::unordered_set<std::uint64_t> watched;
  bool consumed = false;
  bool paused = false;  // while its own gradient() runs

  bool active() const { return !consumed && !paused; }
  bool watches(const Tensor& t) const {
    if (!t.defined()) return false;
    if (watched.count(t.id())) return true;
    if (options.watch_accessed_variables && t.is_variable())
      return t.impl_ptr()->variable->trainable;
    return false;
  }
};

namespace {

thread_local std::vector<GradientTape::Impl*> t_tapes;  // innermost last
thread_local bool t_no_grad = false;

// Pauses a tape for the duration of a scope.
class PauseTape {
 public:
  explicit PauseTape(GradientTape::Impl& t) : t_(t), previous_(t.paused) { t_.paused = true; }
  ~PauseTape() { t_.paused = previous_; }
  PauseTape(const PauseTape&) = delete;
  PauseTape& operator=(const PauseTape&) = delete;

 private:
  GradientTape::Impl& t_;
  bool previous_;
};

}  // namespace

GradientTape::GradientTape() : GradientTape(GradientTapeOptions{}) {}

GradientTape::GradientTape(GradientTapeOptions options) : impl_(std::make_shared<Impl>()) {
  impl_->options = options;
  t_tapes.push_back(impl_.get());
}

GradientTape::~GradientTape() {
  auto it = std::find(t_tapes.begin(), t_tapes.end(), impl_.get());
  if (it != t_tapes.end()) t_tapes.erase(it);
}

void GradientTape::watch(const Tensor& t) {
  if (!t.defined()) throw AutogradError("GradientTape::watch: the tensor is undefined");
  impl_->watched.insert(t.id());
}

void GradientTape::watch(const std::vector<Tensor>& ts) {
  for (const auto& t : ts) watch(t);
}

bool GradientTape::persistent() const { return impl_->options.persistent; }
std::size_t GradientTape::size() const { return impl_->nodes.size(); }

void GradientTape::reset() {
  impl_->nodes.clear();
  impl_->watched.clear();
  impl_->consumed = false;
}

std::vector<Tensor> GradientTape::gradient(const Tensor& target,
                                           const std::vector<Variable>& sources,
                                           const Tensor& output_gradient) {
  return gradient(target, std::vector<Tensor>(sources.begin(), sources.end()), output_gradient);
}

Tensor GradientTape::gradient(const Tensor& target, const Tensor& source,
                              const Tensor& output_gradient) {
  return gradient(target, std::vector<Tensor>{source}, output_gradient).front();
}

std::vector<Tensor> GradientTape::gradient(const Tensor& target,
                                           const std::vector<Variable>& sources,
                                           const GradientReadyFn& on_ready) {
  return walk(target, std::vector<Tensor>(sources.begin(), sources.end()), Tensor(), &on_ready);
}

std::vector<Tensor> GradientTape::gradient(const Tensor& target, const std::vector<Tensor>& sources,
                                           const Tensor& output_gradient) {
  return walk(target, sources, output_gradient, nullptr);
}

namespace {

// The gradient the walk starts from: output_gradient in the target's dtype, or ones for a
// scalar target.
Tensor seed_gradient(const Tensor& target, const Tensor& output_gradient) {
  if (output_gradient.defined()) {
    if (output_gradient.shape() != target.shape())
      throw ShapeError(fmt::format(
          "GradientTape::gradient: output_gradient has shape {} but the target has shape {}",
          output_gradient.shape().str(), target.shape().str()));
    return cast(output_gradient, target.dtype());
  }
  if (target.numel() != 1)
    throw AutogradError(fmt::format(
        "GradientTape::gradient: the target has shape {} ({} elements, dtype {}); the gradient "
        "of a non-scalar target needs an output_gradient (seed) of that shape",
        target.shape().str(), target.numel(), target.dtype().name()));
  return ones_like(target);
}

// Which tensors depend on a source (`reachable`) and which nodes read one (`relevant`): only
// those nodes need their backward rule run.
struct Reach {
  std::unordered_set<std::uint64_t> reachable;
  std::vector<bool> relevant;
};

Reach find_reach(const std::vector<Node>& nodes, const std::vector<Tensor>& sources) {
  Reach r;
  for (const auto& s : sources) r.reachable.insert(s.id());
  r.relevant.assign(nodes.size(), false);
  for (std::size_t n = 0; n < nodes.size(); ++n)
    for (auto id : nodes[n].input_ids)
      if (r.reachable.count(id)) {
        r.relevant[n] = true;
        r.reachable.insert(nodes[n].output_id);
        break;
      }
  return r;
}

// Calls on_ready for each source as soon as its gradient is final: after the node of its last
// use (the lowest relevant node that reads it, the last to add to its gradient), and at the end
// for the sources no relevant node reads.
class ReadyReports {
 public:
  ReadyReports(const GradientTape::GradientReadyFn& on_ready, const std::vector<Node>& nodes,
               const std::vector<bool>& relevant, const std::vector<Tensor>& sources,
               const std::unordered_set<std::uint64_t>& source_ids)
      : on_ready_(on_ready), sources_(sources), reported_(sources.size(), false) {
    std::unordered_map<std::uint64_t, std::size_t> last_use;
    for (std::size_t n = nodes.size(); n-- > 0;) {
      if (!relevant[n]) continue;
      for (auto id : nodes[n].input_ids)
        if (source_ids.count(id)) last_use[id] = n;
    }
    for (std::size_t i = 0; i < sources.size(); ++i) {
      auto it = last_use.find(sources[i].id());
      if (it != last_use.end()) final_after_[it->second].push_back(i);
    }
  }
  // After node n's gradients are added.
  void after(std::size_t n, const std::unordered_map<std::uint64_t, Tensor>& grads) {
    auto fin = final_after_.find(n);
    if (fin != final_after_.end())
      for (std::size_t i : fin->second) report(i, grads);
  }
  // At the end of the walk: the sources not reported yet.
  void rest(const std::unordered_map<std::uint64_t, Tensor>& grads) {
    for (std::size_t i = 0; i < sources_.size(); ++i)
      if (!reported_[i]) report(i, grads);
  }

 private:
  void report(std::size_t i, const std::unordered_map<std::uint64_t, Tensor>& grads) {
    auto g = grads.find(sources_[i].id());
    reported_[i] = true;
    on_ready_(i, g == grads.end() ? Tensor() : g->second);
  }
  const GradientTape::GradientReadyFn& on_ready_;
  const std::vector<Tensor>& sources_;
  std::vector<bool> reported_;
  std::unordered_map<std::size_t, std::vector<std::size_t>> final_after_;
};

// Checks the gradients a node's backward rule gave, casts each to its input's dtype, and adds
// each to what `grads` holds for the input (or hands it to the deferred widening casts).
void add_input_gradients(const Node& node, std::vector<Tensor> in_grads,
                         const std::vector<bool>& needs, std::optional<WideningCasts>& casts,
                         std::unordered_map<std::uint64_t, Tensor>& grads) {
  if (in_grads.size() != node.input_ids.size())
    throw AutogradError(fmt::format("{}: the backward rule returned {} gradients for {} inputs",
                                    node.name, in_grads.size(), node.input_ids.size()));
  for (std::size_t i = 0; i < in_grads.size(); ++i) {
    Tensor g = in_grads[i];
    if (!needs[i] || !g.defined()) continue;
    if (g.shape() != node.input_shapes[i])
      throw AutogradError(
          fmt::format("{}: the backward rule gave input {} a gradient of shape {}, expected {}",
                      node.name, i, g.shape().str(), node.input_shapes[i].str()));
    if (g.dtype() != node.input_dtypes[i]) g = cast(g, node.input_dtypes[i]);
    if (casts && casts->holds(node.input_ids[i])) {
      casts->then(node.input_ids[i], g);
      continue;
    }
    auto [slot, inserted] = grads.try_emplace(node.input_ids[i], g);
    if (!inserted) slot->second = add(slot->second, g);
  }
}

}  // namespace

// The reverse walk: from the target's seed, each relevant node's backward rule in reverse
// order of recording, each input's gradient added to what it has; the sources' gradients last.
std::vector<Tensor> GradientTape::walk(const Tensor& target, const std::vector<Tensor>& sources,
                                       const Tensor& output_gradient,
                                       const GradientReadyFn* on_ready) {
  Impl& tape = *impl_;
  if (tape.consumed)
    throw AutogradError(
        "GradientTape::gradient: this non-persistent tape was already used by a gradient() call; "
        "make it with GradientTapeOptions{.persistent = true} to call gradient() more than once");
  if (!target.defined()) throw AutogradError("GradientTape::gradient: the target is undefined");
  for (std::size_t i = 0; i < sources.size(); ++i)
    if (!sources[i].defined())
      throw AutogradError(fmt::format("GradientTape::gradient: source {} is undefined", i));

  const Tensor seed = seed_gradient(target, output_gradient);
  const Reach reach = find_reach(tape.nodes, sources);
  std::unordered_set<std::uint64_t> source_ids;
  for (const auto& s : sources) source_ids.insert(s.id());
  std::optional<ReadyReports> reports;
  if (on_ready) reports.emplace(*on_ready, tape.nodes, reach.relevant, sources, source_ids);

  std::unordered_map<std::uint64_t, Tensor> grads;
  grads.emplace(target.id(), seed);
  {
    PauseTape pause(tape);
    // The widening casts of the sources' gradients wait for the end of the walk (one kernel
    // call for all of them), unless a source is reported as soon as it is final (on_ready)
    // or another tape records this walk (the casts must then be recorded ops). Only sources
    // that no node produces: nothing in the walk reads their gradient.
    std::optional<WideningCasts> casts;
    std::unordered_set<std::uint64_t> produced;
    if (!on_ready && !detail::any_tape_recording()) {
      casts.emplace();
      for (std::size_t n = 0; n < tape.nodes.size(); ++n)
        if (reach.relevant[n]) produced.insert(tape.nodes[n].output_id);
    }
    // A non-persistent tape is spent from here on, whatever happens: the walk releases each
    // node's rule, and so the tensors it saved, once past it (as PyTorch frees a graph's
    // buffers), instead of all of them at the end. The last layers' activations are gone
    // while the first layers' gradients are made: a training step's peak no longer holds
    // every saved tensor and every gradient at once.
    const bool release = !tape.options.persistent;
    if (release) tape.consumed = true;
    for (std::size_t n = tape.nodes.size(); n-- > 0;) {
      Node& node = tape.nodes[n];
      const BackwardFn passed = release ? std::exchange(node.backward, nullptr) : nullptr;
      const BackwardFn& backward = release ? passed : node.backward;
      if (!reach.relevant[n]) continue;
      auto it = grads.find(node.output_id);
      if (it == grads.end()) continue;
      const Tensor grad_out = it->second;
      if (!source_ids.count(node.output_id)) grads.erase(it);  // no later use

      std::vector<bool> needs(node.input_ids.size());
      for (std::size_t i = 0; i < needs.size(); ++i)
        needs[i] =
            reach.reachable.count(node.input_ids[i]) > 0 && node.input_dtypes[i].is_floating();
      if (casts && std::string_view(node.name) == op_name(OpId::cast) && needs.size() == 1 &&
          needs[0] && source_ids.count(node.input_ids[0]) && !produced.count(node.input_ids[0]) &&
          WideningCasts::widens(grad_out, node.input_dtypes[0])) {
        casts->defer(node.input_ids[0], grad_out, node.input_dtypes[0], grads);
        continue;
      }
      add_input_gradients(node, backward(grad_out, needs), needs, casts, grads);
      if (reports) reports->after(n, grads);
    }
    if (casts) casts->finish(grads);
  }
  if (reports) reports->rest(grads);

  std::vector<Tensor> result;
  result.reserve(sources.size());
  for (const auto& s : sources) {
    auto it = grads.find(s.id());
    result.push_back(it == grads.end() ? Tensor() : it->second);
  }
  if (!tape.options.persistent) {
    tape.consumed = true;
    tape.nodes.clear();
    tape.watched.clear();
  }
  return result;
}

NoGradGuard::NoGradGuard() : previous_(t_no_grad) { t_no_grad = true; }
NoGradGuard::~NoGradGuard() { t_no_grad = previous_; }

namespace detail {
bool any_tape_recording() {
  if (t_no_grad) return false;
  for (auto* tape : t_tapes)
    if (tape->active()) return true;
  return false;
}
}  // namespace detail

bool should_record(const std::vector<Tensor>& inputs) {
  if (t_no_grad) return false;
  for (auto* tape : t_tapes) {
    if (!tape->active()) continue;
    for (const auto& in : inputs)
      if (tape->watches(in)) return true;
  }
  return false;
}

void record_op(const char* name, const std::vector<Tensor>& inputs, const Tensor& output,
               BackwardFn backward) {
  if (t_no_grad) return;
  for (auto* tape : t_tapes) {
    if (!tape->active()) continue;
    bool watched = false;
    for (const auto& in : inputs) watched = watched || tape->watches(in);
    if (!watched) continue;
    Node node{name, {}, {}, {}, output.id(), backward};
    node.input_ids.reserve(inputs.size());
    for (const auto& in : inputs) {
      node.input_ids.push_back(in.defined() ? in.id() : 0);
      node.input_shapes.push_back(in.defined() ? in.shape() : Shape{});
      node.input_dtypes.push_back(in.defined() ? in.dtype() : kBool);
    }
    tape->nodes.push_back(std::move(node));
    tape->watched.insert(output.id());
  }
}

}  // namespace mixtape
