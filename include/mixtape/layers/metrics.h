// Metrics: running values over many batches (Keras metrics).
//
//   mt::metrics::Mean epoch_loss;                     epoch_loss(loss);
//   mt::metrics::SparseCategoricalAccuracy acc;       acc.update_state(labels, probabilities);
//   fmt::print("{} {}", epoch_loss.result(), acc.result());
//
// Totals are float64 tensors on the device of the values (a GPU's totals stay there: an update
// reads nothing back, result() does, once); reset_state() starts over. An empty batch changes
// nothing (the result stays 0 before anything is seen).
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "mixtape/core/tensor.h"

namespace mixtape::metrics {

class Metric {
 public:
  explicit Metric(std::string name) : name_(std::move(name)) {}
  virtual ~Metric() = default;
  const std::string& name() const { return name_; }
  // The weighted mean of everything seen since the last reset (0 before anything).
  double result() const;
  void reset_state();
  // For a metric computed from labels and predictions (all but Mean).
  virtual void update_state(const Tensor& y_true, const Tensor& y_pred,
                            const Tensor& sample_weight = Tensor());

 protected:
  // Adds sum(values * weights) and sum(weights) (weights of one when undefined).
  void accumulate(const Tensor& values, const Tensor& weights);

 private:
  std::string name_;
  // sum(values * weights) and sum(weights), float64 scalars on the values' device (undefined
  // before the first update); count_: the unweighted updates' values, counted on the host.
  Tensor total_, weights_;
  double count_ = 0.0;
};

// The mean of the values given (a loss per batch, say).
class Mean : public Metric {
 public:
  explicit Mean(std::string name = "mean") : Metric(std::move(name)) {}
  void update_state(const Tensor& values, const Tensor& sample_weight = Tensor());
  // update_state, then result().
  double operator()(const Tensor& values, const Tensor& sample_weight = Tensor());
};

// How often y_pred equals y_true exactly.
class Accuracy : public Metric {
 public:
  explicit Accuracy(std::string name = "accuracy") : Metric(std::move(name)) {}
  void update_state(const Tensor& y_true, const Tensor& y_pred,
                    const Tensor& sample_weight = Tensor()) override;
};

// How often argmax(y_pred) equals the integer label y_true ([batch] or [batch, 1]). Integer
// labels outside [0, C) count as misses (Keras); floating labels must be class indices (a NaN,
// an infinity or a value outside [0, C) throws IndexError naming its position).
class SparseCategoricalAccuracy : public Metric {
 public:
  explicit SparseCategoricalAccuracy(std::string name = "sparse_categorical_accuracy")
      : Metric(std::move(name)) {}
  void update_state(const Tensor& y_true, const Tensor& y_pred,
                    const Tensor& sample_weight = Tensor()) override;
};

// How often argmax(y_pred) equals argmax(y_true) (one-hot labels).
class CategoricalAccuracy : public Metric {
 public:
  explicit CategoricalAccuracy(std::string name = "categorical_accuracy")
      : Metric(std::move(name)) {}
  void update_state(const Tensor& y_true, const Tensor& y_pred,
                    const Tensor& sample_weight = Tensor()) override;
};

// How often (y_pred > threshold) equals y_true (labels in {0, 1}).
class BinaryAccuracy : public Metric {
 public:
  explicit BinaryAccuracy(std::string name = "binary_accuracy", double threshold = 0.5)
      : Metric(std::move(name)), threshold_(threshold) {}
  void update_state(const Tensor& y_true, const Tensor& y_pred,
                    const Tensor& sample_weight = Tensor()) override;

 private:
  double threshold_;
};

// A metric by name: "accuracy", "sparse_categorical_accuracy", "categorical_accuracy",
// "binary_accuracy"; throws ValueError listing them otherwise.
std::shared_ptr<Metric> get(std::string_view name);

}  // namespace mixtape::metrics
