// Checkpoints: a model's weights, or a whole training state (weights, optimizer state,
// epoch), in one safetensors file (mixtape/io/safetensors.h), written atomically.
//
//   mt::save_weights(model, "model.safetensors");            // tensors "dense/kernel", ...
//   mt::load_weights(other_model, "model.safetensors");      // same architecture and paths
//
// A weight is stored under its path (layers::weight_paths(): "dense/kernel", a sublayer's
// "block_1/dense/kernel"), which does not depend on the order in which layers were made or
// called; files say so with __metadata__ "weight_keys" = kWeightKeys. Files without it (of
// mixtape before paths were scoped) are read by the same names where those were paths
// already (every weight of a layer that is not a sublayer of another layer); a weight of
// such a sublayer is only read through WeightLoadOptions::renames, as the file does not say
// which layer its name belonged to.
//
//   mt::save_checkpoint("ckpt.safetensors", model, opt, {.epoch = 3});
//   mt::TrainingCheckpoint info = mt::load_checkpoint("ckpt.safetensors", model, opt);
//   // ... fit(..., {.initial_epoch = info.epoch}) resumes where training stopped
//
// Loading validates before it changes anything: every weight of the model must be in the
// file with the same shape and dtype (and the file may hold no other weights), a BOOL
// tensor holds only bytes 0 and 1, and a checkpoint's optimizer kind, slots and numbers
// must fit and be possible (epoch and iterations >= 0, every variable's slots present once
// iterations > 0, loss-scale counters whole and in range); otherwise ValueError names the
// file and the first tensor or key that does not fit, and the model and optimizer are left
// as they were. A file that cannot be read or is corrupt throws IOError.
// docs/checkpoints.md describes the files.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "mixtape/layers/layer.h"
#include "mixtape/layers/model.h"
#include "mixtape/optim/optimizer.h"

namespace mixtape {

// The metadata "format" of a training checkpoint.
inline constexpr const char* kCheckpointFormat = "mixtape-checkpoint-1";
// The metadata "weight_keys" of files whose tensors are named by weight paths.
inline constexpr const char* kWeightKeys = "paths-1";

// Writes every weight of `model` (trainable or not, in model.weights() order) under its
// path ("dense_1/kernel", "block/dense/kernel"), with `metadata` as the file's __metadata__
// (and "weight_keys"). Throws ValueError when two weights would share a path, or metadata
// holds "weight_keys" (and what save_safetensors throws).
void save_weights(const layers::Layer& model, const std::string& path,
                  const std::map<std::string, std::string>& metadata = {});

// Sets every weight of `model` from the tensor of its path in `path` (or the tensor that
// options.renames names for it). The model must be built (called once) and the file must
// hold exactly its weights, with the same shapes and dtypes, each tensor for one weight;
// nothing is assigned unless all of them fit. A training checkpoint (save_checkpoint) is
// accepted too: its weights are read from under "model/".
void load_weights(layers::Layer& model, const std::string& path,
                  const WeightLoadOptions& options = {});

// TrainingCheckpoint (what a checkpoint records besides the model and the optimizer) is in
// mixtape/layers/model.h.

// Writes one safetensors file holding the weights of `model` under "model/<weight path>",
// the optimizer's state for model.trainable_variables() under "optimizer/<weight
// path>/<slot>", and in __metadata__: "weight_keys", "format" (kCheckpointFormat), "epoch",
// "optimizer" (optimizer.name()), "optimizer.inner" (the wrapped optimizer's name, for a
// LossScaleOptimizer), "iterations", each of the state's scalars as
// "optimizer.scalar.<name>" (shortest text that reads back to the same double), and
// info.metadata. Throws ValueError, writing nothing, when info.epoch < 0 or info.metadata
// uses one of those keys ("weight_keys", "format", "epoch", "optimizer", "iterations" or one
// starting with "optimizer.").
void save_checkpoint(const std::string& path, const layers::Layer& model,
                     const optim::Optimizer& optimizer, const TrainingCheckpoint& info);

// Restores a save_checkpoint file into `model` and `optimizer` (of the same kinds, built
// the same way) and returns its epoch and the caller's metadata. Checks the format, the
// optimizer's kind, the epoch and iteration count (>= 0), that no other key of mixtape's
// own is there, the weights (as load_weights does), that every slot belongs to a trainable
// variable, and the optimizer's state (optimizer.load_state, which checks before it changes
// anything) before the weights are assigned.
TrainingCheckpoint load_checkpoint(const std::string& path, layers::Layer& model,
                                   optim::Optimizer& optimizer,
                                   const WeightLoadOptions& options = {});

// A fit() callback that saves the model at the end of epochs, as Keras' ModelCheckpoint:
//
//   auto ckpt = std::make_shared<mt::ModelCheckpoint>(mt::ModelCheckpoint::Options{
//       .filepath = "ckpt-{epoch:02d}.safetensors", .monitor = "val_accuracy",
//       .save_best_only = true});
//   model.fit(x, y, {.epochs = 10, .validation_split = 0.1, .callbacks = {ckpt}});
//
// By default the whole model (Model::save: a training checkpoint with the architecture, so
// load_model reads it too; weights, optimizer state, and as its epoch the number of epochs
// done, so that load_checkpoint's epoch is fit's initial_epoch to resume); with
// save_weights_only, the weights alone (save_weights). `{epoch}` in the
// path (with any format spec, e.g. `{epoch:03d}`) is the number of the epoch just done,
// counting from 1 as Keras does; other braces are refused. Every file is written
// atomically.
class ModelCheckpoint : public Callback {
 public:
  struct Options {
    std::string filepath = {};
    std::string monitor = "val_loss";  // the logged value save_best_only compares
    bool save_best_only = false;       // save only when `monitor` improved
    bool save_weights_only = false;    // save_weights instead of Model::save
    // true: larger is better; false: smaller; empty: larger for names containing "acc"
    // (accuracies), smaller otherwise (Keras' mode "auto").
    std::optional<bool> maximize = {};
  };
  // Throws ValueError for an empty filepath, or braces other than {epoch...} in it.
  explicit ModelCheckpoint(Options options);
  void on_train_begin(Model& model) override;
  bool wants_batch_logs() const override { return false; }
  // Saves (when due). With save_best_only, a monitor that is not logged throws ValueError
  // naming it and the logged names; a NaN value is never an improvement.
  void on_epoch_end(Model& model, int epoch, const Logs& logs) override;

  // The path of the last file written ("" before the first).
  const std::string& last_saved() const { return last_saved_; }
  // The best monitored value so far (save_best_only), if any.
  std::optional<double> best() const { return best_; }

 private:
  std::string path_for(int epoch) const;

  Options options_;
  bool maximize_ = false;
  std::optional<double> best_ = {};
  std::string last_saved_ = {};
};

}  // namespace mixtape
