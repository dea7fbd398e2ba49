// Checkpoints: a model's weights, or a whole training state (weights, optimizer state,
// epoch), in one safetensors file (mixtape/core/safetensors.h), written atomically.
//
//   mt::save_weights(model, "model.safetensors");            // tensors "dense/kernel", ...
//   mt::load_weights(other_model, "model.safetensors");      // same architecture and names
//
//   mt::save_checkpoint("ckpt.safetensors", model, opt, {.epoch = 3});
//   mt::TrainingCheckpoint info = mt::load_checkpoint("ckpt.safetensors", model, opt);
//   // ... fit(..., {.initial_epoch = info.epoch}) resumes where training stopped
//
// Loading validates before it changes anything: every weight of the model must be in the
// file with the same shape and dtype (and the file may hold no other weights), and a
// checkpoint's optimizer kind, slots and numbers must fit; otherwise ValueError names the
// file and the first tensor or key that does not fit, and the model and optimizer are left
// as they were. A file that cannot be read or is corrupt throws IOError.
// docs/checkpoints.md describes the files.
#pragma once

#include <map>
#include <string>

#include "mixtape/layers/layer.h"
#include "mixtape/optim/optimizer.h"

namespace mixtape {

// The metadata "format" of a training checkpoint.
inline constexpr const char* kCheckpointFormat = "mixtape-checkpoint-1";

// Writes every weight of `model` (trainable or not, in model.weights() order) under its
// variable name ("dense_1/kernel"), with `metadata` as the file's __metadata__. Throws
// ValueError when two weights share a name (and what save_safetensors throws).
void save_weights(const layers::Layer& model, const std::string& path,
                  const std::map<std::string, std::string>& metadata = {});

// Sets every weight of `model` from the tensor of the same name in `path`. The model must
// be built (called once) and the file must hold exactly its weights, with the same shapes
// and dtypes; nothing is assigned unless all of them fit. A training checkpoint
// (save_checkpoint) is accepted too: its weights are read from under "model/".
void load_weights(layers::Layer& model, const std::string& path);

// What a training checkpoint records besides the model and the optimizer.
struct TrainingCheckpoint {
  int epoch = 0;                                     // e.g. the number of epochs done
  std::map<std::string, std::string> metadata = {};  // the caller's own keys and values
};

// Writes one safetensors file holding the weights of `model` under "model/<variable
// name>", the optimizer's state for model.trainable_variables() under "optimizer/<variable
// name>/<slot>", and in __metadata__: "format" (kCheckpointFormat), "epoch", "optimizer"
// (optimizer.name()), "optimizer.inner" (the wrapped optimizer's name, for a
// LossScaleOptimizer), "iterations", each of the state's scalars as
// "optimizer.scalar.<name>" (shortest text that reads back to the same double), and
// info.metadata. Throws ValueError when info.metadata uses one of those keys ("format",
// "epoch", "optimizer", "iterations" or one starting with "optimizer.").
void save_checkpoint(const std::string& path, const layers::Layer& model,
                     const optim::Optimizer& optimizer, const TrainingCheckpoint& info);

// Restores a save_checkpoint file into `model` and `optimizer` (of the same kinds, built
// the same way) and returns its epoch and the caller's metadata. Checks the format, the
// optimizer's kind, the weights (as load_weights does), that every slot belongs to a
// trainable variable, and the optimizer's state (optimizer.load_state, which checks before
// it changes anything) before the weights are assigned.
TrainingCheckpoint load_checkpoint(const std::string& path, layers::Layer& model,
                                   optim::Optimizer& optimizer);

}  // namespace mixtape
