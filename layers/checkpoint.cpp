// Model weights and training checkpoints on top of safetensors files: what goes in the file,
// and the validation that runs before a load changes the model or the optimizer.
#include "mixtape/layers/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/distributed/distributed.h"
#include "mixtape/io/safetensors.h"
#include "mixtape/optim/distributed_optimizer.h"
#include "mixtape/optim/loss_scale_optimizer.h"

namespace mixtape {
namespace {

constexpr std::string_view kModelPrefix = "model/";
constexpr std::string_view kOptimizerPrefix = "optimizer/";
constexpr std::string_view kScalarPrefix = "optimizer.scalar.";

bool starts_with(std::string_view s, std::string_view prefix) { return s.starts_with(prefix); }

constexpr const char* kWeightKeysKey = "weight_keys";

// Keys of a checkpoint's __metadata__ that save_checkpoint writes itself.
bool reserved_key(std::string_view key) {
  return key == kWeightKeysKey || key == "format" || key == "epoch" || key == "optimizer" ||
         key == "iterations" || starts_with(key, "optimizer.");
}

// The weights of `model` with their paths (layers::weight_paths), its errors naming the file.
std::vector<layers::WeightPath> paths_of(const layers::Layer& model, const std::string& path,
                                         std::string_view who) {
  try {
    return layers::weight_paths(model);
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("{} '{}': the model '{}': {}", who, path, model.name(), e.what()));
  }
}

// Variable name -> path for the weights of a checkpoint: an optimizer keys its slots by the
// variables' names, the file by their paths. Refuses two weights with one name.
std::unordered_map<std::string, std::string> path_by_name(
    const std::vector<layers::WeightPath>& weights, const layers::Layer& model,
    const std::string& path, std::string_view who) {
  std::unordered_map<std::string, std::string> out;
  for (const auto& w : weights)
    if (!out.emplace(w.variable.name(), w.path).second)
      throw ValueError(fmt::format("{} '{}': the model '{}' has two weights named '{}'", who, path,
                                   model.name(), w.variable.name()));
  return out;
}

// What a load assigns: each weight with its value from the file.
using Plan = std::vector<std::pair<Variable, Tensor>>;

std::string described(std::string_view name, const Tensor& t) {
  return fmt::format("'{}' {}{}", name, t.dtype(), t.shape());
}

// A file without "weight_keys" names the weights of sublayers by names that were unique
// only in the process that wrote it: refuses to guess, and says how to convert the file.
[[noreturn]] void throw_unscoped(const std::string& path,
                                 const std::vector<const layers::WeightPath*>& unmatched,
                                 const std::unordered_map<std::string_view, const Tensor*>& left) {
  std::vector<std::string> weights, tensors;
  for (const auto* w : unmatched) weights.push_back(described(w->path, w->variable));
  for (const auto& [name, t] : left) tensors.push_back(described(name, *t));
  std::sort(tensors.begin(), tensors.end());
  throw ValueError(fmt::format(
      "checkpoint '{}' was written before weight paths were scoped by their owner (its "
      "__metadata__ has no \"weight_keys\"): it names the weights of sublayers by names that "
      "were unique only in the process that wrote it, which do not say which layer each belongs "
      "to, so {} weight{} of sublayers cannot be matched safely: {}. Say which tensor is which "
      "with WeightLoadOptions::renames (load_model(path, {{.renames = {{{{\"<tensor>\", "
      "\"<path>\"}}, ...}}}}); the file's unmatched tensors: {}), then save the model to write "
      "a file of today's format",
      path, unmatched.size(), unmatched.size() == 1 ? "" : "s", fmt::join(weights, ", "),
      tensors.empty() ? std::string("none") : fmt::format("{}", fmt::join(tensors, ", "))));
}

// Checks that the tensors of `file` under `prefix` are exactly `weights` (those of `model`), with
// their shapes and dtypes, each tensor for one weight; returns the assignments to make.
Plan check_weights(const layers::Layer& model, const std::vector<layers::WeightPath>& weights,
                   const SafetensorsFile& file, std::string_view prefix, const std::string& path,
                   const WeightLoadOptions& options) {
  const auto keys = file.metadata.find(kWeightKeysKey);
  if (keys != file.metadata.end() && keys->second != kWeightKeys)
    throw ValueError(fmt::format(
        "checkpoint '{}': __metadata__ \"{}\" is \"{}\"; this mixtape reads \"{}\" (a file "
        "of a newer version?)",
        path, kWeightKeysKey, keys->second, kWeightKeys));
  const bool unscoped = keys == file.metadata.end();
  std::unordered_map<std::string_view, const Tensor*> in_file;
  for (const auto& [name, t] : file.tensors)
    if (starts_with(name, prefix))
      in_file.emplace(std::string_view(name).substr(prefix.size()), &t);
  if (weights.empty() && !in_file.empty())
    throw ValueError(fmt::format(
        "checkpoint '{}': the model '{}' has no weights yet but the file holds {}; build the "
        "model (call it on an input) before loading weights into it",
        path, model.name(), in_file.size()));

  // renames: path -> the tensor that feeds it.
  std::unordered_map<std::string_view, std::string_view> source;
  for (const auto& [from, to] : options.renames) {
    if (!in_file.count(from))
      throw ValueError(
          fmt::format("checkpoint '{}': renames: '{}' is not a tensor of the file", path, from));
    const bool known = std::any_of(weights.begin(), weights.end(),
                                   [&, &to = to](const auto& w) { return w.path == to; });
    if (!known)
      throw ValueError(fmt::format(
          "checkpoint '{}': renames: '{}' is not the path of a weight of the model '{}'", path, to,
          model.name()));
    auto [it, fresh] = source.emplace(to, from);
    if (!fresh)
      throw ValueError(
          fmt::format("checkpoint '{}': renames: both '{}' and '{}' are renamed to '{}'", path,
                      it->second, from, to));
  }

  Plan plan;
  plan.reserve(weights.size());
  std::vector<const layers::WeightPath*> unmatched;
  std::unordered_map<std::string_view, std::string_view> fed;  // tensor -> the weight it feeds
  for (const auto& w : weights) {
    std::string_view name = w.path;
    if (auto r = source.find(w.path); r != source.end()) {
      name = r->second;
    } else if (unscoped && w.in_sublayer) {
      unmatched.push_back(&w);
      continue;
    }
    auto it = in_file.find(name);
    if (it == in_file.end()) {
      if (fed.count(name))
        throw ValueError(fmt::format(
            "checkpoint '{}': tensor '{}{}' would feed two weights, '{}' and '{}' (renames "
            "one to the other's path?)",
            path, prefix, name, fed.at(name), w.path));
      throw ValueError(fmt::format(
          "checkpoint '{}': tensor '{}{}' (the weight '{}' of the model) is missing from the file",
          path, prefix, name, w.path));
    }
    const Tensor& t = *it->second;
    if (t.shape() != w.variable.shape())
      throw ValueError(
          fmt::format("checkpoint '{}': tensor '{}{}' has shape {} in the file but {} in the model",
                      path, prefix, name, t.shape(), w.variable.shape()));
    if (t.dtype() != w.variable.dtype())
      throw ValueError(
          fmt::format("checkpoint '{}': tensor '{}{}' has dtype {} in the file but {} in the model",
                      path, prefix, name, t.dtype(), w.variable.dtype()));
    plan.emplace_back(w.variable, t);
    fed.emplace(name, w.path);
    in_file.erase(it);
  }
  if (!unmatched.empty()) throw_unscoped(path, unmatched, in_file);
  if (!in_file.empty()) {
    // The first one in file order, for a stable message.
    for (const auto& [name, t] : file.tensors)
      if (starts_with(name, prefix) && in_file.count(std::string_view(name).substr(prefix.size())))
        throw ValueError(fmt::format(
            "checkpoint '{}': tensor '{}' in the file is not a weight of the model '{}' (a file "
            "of another model?)",
            path, name, model.name()));
  }
  return plan;
}

void assign(const Plan& plan) {
  NoGradGuard no_grad;
  for (const auto& [variable, value] : plan) {
    Variable v = variable;
    v.assign(value.to(v.device()));
  }
}

const std::string& metadata_value(const SafetensorsFile& file, const std::string& key,
                                  const std::string& path) {
  auto it = file.metadata.find(key);
  if (it == file.metadata.end())
    throw ValueError(
        fmt::format("checkpoint '{}': the file's __metadata__ has no \"{}\"", path, key));
  return it->second;
}

template <typename T>
T parse_number(const std::string& text, const std::string& key, const std::string& path) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc() || p != end || text.empty())
    throw ValueError(fmt::format("checkpoint '{}': __metadata__ \"{}\" is \"{}\", not {}", path,
                                 key, text,
                                 std::is_floating_point_v<T> ? "a number" : "an integer"));
  return value;
}

// A number of the metadata that must not be negative (the epoch, the step count).
template <typename T>
T parse_count(const SafetensorsFile& file, const std::string& key, const std::string& path) {
  const T value = parse_number<T>(metadata_value(file, key, path), key, path);
  if (value < 0)
    throw ValueError(fmt::format("checkpoint '{}': __metadata__ \"{}\" is {}; it must be >= 0",
                                 path, key, value));
  return value;
}

// What a checkpoint holds the state of: a DistributedOptimizer only carries gradients
// between ranks and a GradientAccumulationOptimizer adds them up between steps, so their
// file is the wrapped optimizer's (read back with or without them).
optim::Optimizer& saved_optimizer(const optim::Optimizer& optimizer) {
  auto* o = const_cast<optim::Optimizer*>(&optimizer);
  while (optim::Optimizer* inner = o->pass_through()) o = inner;
  return *o;
}

// The name of the optimizer a LossScaleOptimizer wraps (empty for other optimizers).
std::string inner_name(const optim::Optimizer& optimizer) {
  if (const optim::LossScaleOptimizer* lso = optimizer.loss_scale_optimizer(); lso == &optimizer)
    return lso->inner_optimizer().name();
  return {};
}

}  // namespace

void save_weights(const layers::Layer& model, const std::string& path,
                  const std::map<std::string, std::string>& metadata) {
  if (metadata.count(kWeightKeysKey))
    throw ValueError(
        fmt::format("save_weights '{}': metadata key \"{}\" is reserved (save_weights writes it)",
                    path, kWeightKeysKey));
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const auto& w : paths_of(model, path, "save_weights"))
    tensors.emplace_back(w.path, w.variable);
  std::map<std::string, std::string> with = metadata;
  with[kWeightKeysKey] = kWeightKeys;
  save_safetensors(path, tensors, with);
}

void load_weights(layers::Layer& model, const std::string& path, const WeightLoadOptions& options) {
  const SafetensorsFile file = load_safetensors(path);  // refuses a BOOL byte above 1
  auto format = file.metadata.find("format");
  const bool checkpoint = format != file.metadata.end() && format->second == kCheckpointFormat;
  assign(check_weights(model, paths_of(model, path, "checkpoint"), file,
                       checkpoint ? kModelPrefix : std::string_view(), path, options));
}

void save_checkpoint(const std::string& path, const layers::Layer& model,
                     const optim::Optimizer& given, const TrainingCheckpoint& info) {
  const optim::Optimizer& optimizer = saved_optimizer(given);
  if (info.epoch < 0)
    throw ValueError(
        fmt::format("save_checkpoint '{}': epoch is {}; it must be >= 0", path, info.epoch));
  for (const auto& [key, value] : info.metadata)
    if (reserved_key(key))
      throw ValueError(fmt::format(
          "save_checkpoint '{}': metadata key \"{}\" is reserved (save_checkpoint writes "
          "\"weight_keys\", \"format\", \"epoch\", \"optimizer\", \"iterations\" and "
          "\"optimizer.*\")",
          path, key));
  const std::vector<layers::WeightPath> weights = paths_of(model, path, "save_checkpoint");
  const auto path_of = path_by_name(weights, model, path, "save_checkpoint");
  const optim::OptimizerState state = optimizer.state(model.trainable_variables());

  std::vector<std::pair<std::string, Tensor>> tensors;
  tensors.reserve(weights.size() + state.tensors.size());
  for (const auto& w : weights)
    tensors.emplace_back(fmt::format("{}{}", kModelPrefix, w.path), w.variable);
  // A slot "<variable name>/<slot>" is stored as "<weight path>/<slot>".
  for (const auto& [name, t] : state.tensors) {
    const auto slash = name.rfind('/');
    const auto owner =
        slash == std::string::npos ? path_of.end() : path_of.find(name.substr(0, slash));
    if (owner == path_of.end())
      throw ValueError(fmt::format(
          "save_checkpoint '{}': optimizer slot '{}' belongs to no weight of the model '{}'", path,
          name, model.name()));
    tensors.emplace_back(fmt::format("{}{}{}", kOptimizerPrefix, owner->second, name.substr(slash)),
                         t);
  }

  std::map<std::string, std::string> metadata = info.metadata;
  metadata[kWeightKeysKey] = kWeightKeys;
  metadata["format"] = kCheckpointFormat;
  metadata["epoch"] = fmt::format("{}", info.epoch);
  metadata["optimizer"] = optimizer.name();
  if (const std::string inner = inner_name(optimizer); !inner.empty())
    metadata["optimizer.inner"] = inner;
  metadata["iterations"] = fmt::format("{}", state.iterations);
  // fmt's "{}" prints a double in the shortest form that reads back to the same value.
  for (const auto& [name, value] : state.scalars)
    metadata[fmt::format("{}{}", kScalarPrefix, name)] = fmt::format("{}", value);
  save_safetensors(path, tensors, metadata);
}

TrainingCheckpoint load_checkpoint(const std::string& path, layers::Layer& model,
                                   optim::Optimizer& given, const WeightLoadOptions& options) {
  optim::Optimizer& optimizer = saved_optimizer(given);
  const SafetensorsFile file = load_safetensors(path);  // refuses a BOOL byte above 1

  // The metadata: format, optimizer kind, numbers.
  auto format = file.metadata.find("format");
  if (format == file.metadata.end() || format->second != kCheckpointFormat)
    throw ValueError(fmt::format(
        "checkpoint '{}' is not a training checkpoint: its __metadata__ \"format\" is {} instead "
        "of \"{}\" (a file of save_weights? read it with load_weights)",
        path, format == file.metadata.end() ? "missing" : fmt::format("\"{}\"", format->second),
        kCheckpointFormat));
  TrainingCheckpoint info;
  info.epoch = parse_count<int>(file, "epoch", path);
  const std::string& kind = metadata_value(file, "optimizer", path);
  if (kind != optimizer.name())
    throw ValueError(fmt::format(
        "checkpoint '{}' holds the state of optimizer {}, but the optimizer given is {}", path,
        kind, optimizer.name()));
  auto inner_it = file.metadata.find("optimizer.inner");
  const std::string file_inner = inner_it == file.metadata.end() ? "" : inner_it->second;
  if (const std::string inner = inner_name(optimizer); inner != file_inner)
    throw ValueError(fmt::format(
        "checkpoint '{}' holds the state of a {} wrapping {}, but the optimizer given wraps {}",
        path, kind, file_inner.empty() ? "nothing" : file_inner,
        inner.empty() ? "nothing" : inner));
  optim::OptimizerState state;
  state.iterations = parse_count<std::int64_t>(file, "iterations", path);
  for (const auto& [key, value] : file.metadata) {
    if (starts_with(key, kScalarPrefix))
      state.scalars[key.substr(kScalarPrefix.size())] = parse_number<double>(value, key, path);
    else if (!reserved_key(key))
      info.metadata.emplace(key, value);
    else if (key != kWeightKeysKey && key != "format" && key != "epoch" && key != "optimizer" &&
             key != "iterations" && key != "optimizer.inner")
      throw ValueError(fmt::format(
          "checkpoint '{}': __metadata__ key \"{}\" is reserved for mixtape but unknown to it",
          path, key));
  }

  // The tensors: the model's weights, and slots of its trainable variables (by path in the
  // file, by variable name in the optimizer's state).
  const std::vector<layers::WeightPath> weights = paths_of(model, path, "checkpoint");
  const Plan plan = check_weights(model, weights, file, kModelPrefix, path, options);
  path_by_name(weights, model, path, "checkpoint");           // names are unique
  std::map<std::string, std::string, std::less<>> trainable;  // slot owner in the file -> name
  for (const auto& w : weights)
    if (w.variable.trainable()) trainable.emplace(w.path, w.variable.name());
  for (const auto& [from, to] : options.renames)
    if (auto it = trainable.find(to); it != trainable.end()) {
      const std::string name = it->second;
      trainable.erase(it);
      trainable.emplace(from, name);
    }
  const std::vector<Variable> variables = model.trainable_variables();
  for (const auto& [name, t] : file.tensors) {
    if (starts_with(name, kModelPrefix)) continue;
    if (!starts_with(name, kOptimizerPrefix))
      throw ValueError(fmt::format(
          "checkpoint '{}': tensor '{}' is neither a weight (\"model/...\") nor an optimizer slot "
          "(\"optimizer/...\")",
          path, name));
    const std::string key = name.substr(kOptimizerPrefix.size());
    const auto slash = key.rfind('/');
    const auto owner = slash == std::string::npos || slash + 1 == key.size()
                           ? trainable.end()
                           : trainable.find(std::string_view(key).substr(0, slash));
    if (owner == trainable.end())
      throw ValueError(fmt::format(
          "checkpoint '{}': optimizer slot '{}' belongs to no trainable variable of the model '{}'",
          path, name, model.name()));
    state.tensors.emplace(owner->second + key.substr(slash), t);
  }

  // The optimizer checks its state before it changes; then the weights are set.
  try {
    optimizer.load_state(state, variables);
  } catch (const ValueError& e) {
    throw ValueError(fmt::format("checkpoint '{}': {}", path, e.what()));
  }
  assign(plan);
  return info;
}

// --- ModelCheckpoint --------------------------------------------------------------------------

ModelCheckpoint::ModelCheckpoint(Options options) : options_(std::move(options)) {
  if (options_.filepath.empty()) throw ValueError("ModelCheckpoint: filepath is empty");
  maximize_ = options_.maximize.value_or(options_.monitor.find("acc") != std::string::npos);
  path_for(0);  // refuses a filepath whose braces are not {epoch...} now, not after an epoch
}

std::string ModelCheckpoint::path_for(int epoch) const {
  try {
    return fmt::format(fmt::runtime(options_.filepath), fmt::arg("epoch", epoch + 1));
  } catch (const fmt::format_error& e) {
    throw ValueError(fmt::format(
        "ModelCheckpoint: filepath '{}' is not a path with an optional {{epoch}} field ({})",
        options_.filepath, e.what()));
  }
}

void ModelCheckpoint::on_train_begin(Model&) { best_.reset(); }

void ModelCheckpoint::on_epoch_end(Model& model, int epoch, const Logs& logs) {
  if (options_.save_best_only) {
    const auto it = logs.find(options_.monitor);
    if (it == logs.end()) {
      std::string logged;
      for (const auto& [key, value] : logs) logged += (logged.empty() ? "" : ", ") + key;
      throw ValueError(fmt::format(
          "ModelCheckpoint: save_best_only monitors '{}', which fit does not log (it logs: "
          "{}; val_ values need validation data)",
          options_.monitor, logged));
    }
    const double v = it->second;
    const bool better = !std::isnan(v) && (!best_ || (maximize_ ? v > *best_ : v < *best_));
    if (!better) return;
    best_ = v;
  }
  const std::string path = path_for(epoch);
  // In a data-parallel job every rank holds the same model: rank 0 alone writes the file
  // (the others never write half of it beside it).
  if (distributed::rank() != 0) {
    last_saved_ = path;
    return;
  }
  if (options_.save_weights_only) {
    save_weights(model, path);
  } else {
    if (!model.optimizer())
      throw ValueError(fmt::format(
          "ModelCheckpoint: model '{}' has no optimizer (compile it, or set save_weights_only)",
          model.name()));
    // A training checkpoint with the architecture: load_model reads it too.
    model.save(path, {.epoch = epoch + 1});
  }
  last_saved_ = path;
}

}  // namespace mixtape
