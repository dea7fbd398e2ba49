// A tf.data-like input pipeline: Dataset::from_tensors(x, y) with shuffle, batch, map,
// prefetch and to(device), iterated with range-for.
//
//   auto ds = mt::data::Dataset::from_tensors(x, y).shuffle(10000).batch(128).prefetch();
//   for (int epoch = 0; epoch < 5; ++epoch)
//     for (auto& [xb, yb] : ds) { ... }   // each loop is a new epoch, reshuffled
//
// A Dataset is a description with value semantics: every method returns a new Dataset
// and leaves its receiver unchanged, copies are cheap (the tensors are shared), and each
// iteration starts a fresh epoch. Elements are (x, y) pairs of rows along axis 0 of the
// source tensors; after batch() they are batches of rows. Rows are gathered with
// mixtape::take (one call per batch), and no pipeline step is recorded on a tape.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/core/device.h"
#include "mixtape/core/tensor.h"

namespace mixtape::data {

// One element of a dataset: inputs and labels (rows, or batches of rows).
using Element = std::pair<Tensor, Tensor>;
// A map() function: takes an element's (x, y), returns the new (x, y).
using MapFn = std::function<Element(const Tensor& x, const Tensor& y)>;

// An input pipeline over the rows of two tensors (see the top of this header).
class Dataset {
 public:
  class Iterator;
  class Epoch;

  // Elements are the rows (axis 0) of x and y, which must agree on axis 0 (ShapeError
  // otherwise; both need rank >= 1).
  static Dataset from_tensors(const Tensor& x, const Tensor& y);

  // tf.data's shuffle: a buffer of buffer_size elements, each output drawn uniformly from
  // the buffer and replaced by the next input; buffer_size >= size() is a uniform
  // permutation, a small buffer only mixes nearby elements. Every epoch is reshuffled,
  // deterministically from (seed, epoch number). Without a seed, one is drawn from
  // mixtape::default_generator() here (so mixtape::manual_seed makes runs repeatable).
  Dataset shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed = std::nullopt) const;
  // Groups consecutive elements into batches of batch_size along a new axis 0 (rows
  // are gathered with one take()); the last, smaller batch is dropped when
  // drop_remainder is true.
  Dataset batch(std::int64_t batch_size, bool drop_remainder = false) const;
  // Applies fn to each element (to each batch when it follows batch()), in pipeline order.
  Dataset map(MapFn fn) const;
  // Prepares up to buffer_size elements ahead on a background thread while the consumer
  // works. An exception in the pipeline is re-thrown to the consumer (after the elements
  // produced before it); destroying the iterator stops and joins the thread.
  Dataset prefetch(std::int64_t buffer_size = 1) const;
  // Copies each element to `device` (in the prefetch thread when a prefetch follows).
  Dataset to(Device device) const;

  // The number of elements one epoch yields (batches after batch()).
  std::int64_t size() const;
  // The number of rows of the source tensors.
  std::int64_t num_rows() const;
  // "from_tensors(x float32 [60000, 784], y int64 [60000]).shuffle(10000).batch(128)".
  std::string str() const;

  // Starts the next epoch (the first begin() is epoch 0, the next 1, ...).
  Iterator begin() const;
  Iterator end() const;
  // A range over one given epoch, which does not count as a started epoch.
  Epoch epoch(std::uint64_t index) const;
  // How many epochs begin() has started on this Dataset (copies count on their own).
  std::uint64_t epochs_started() const { return next_epoch_.value.load(); }

  struct Stage;  // one pipeline step (defined in dataset.cpp)

 private:
  struct Counter {
    std::atomic<std::uint64_t> value{0};
    Counter() = default;
    Counter(const Counter& other) : value(other.value.load()) {}
    Counter& operator=(const Counter& other) {
      value.store(other.value.load());
      return *this;
    }
  };

  Dataset with(std::shared_ptr<const Stage> stage) const;
  Iterator start(std::uint64_t epoch) const;

  Tensor x_, y_;
  std::vector<std::shared_ptr<const Stage>> stages_;
  mutable Counter next_epoch_;
};

// An input iterator over the elements of one epoch. Copies share the position. The
// pipeline (and its prefetch thread) lives until the last copy is destroyed.
class Dataset::Iterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = Element;
  using difference_type = std::ptrdiff_t;
  using pointer = Element*;
  using reference = Element&;

  Iterator() = default;  // the end
  Element& operator*() const;
  Element* operator->() const { return &**this; }
  Iterator& operator++();
  void operator++(int) { ++*this; }
  friend bool operator==(const Iterator& a, const Iterator& b) { return a.state_ == b.state_; }

  struct State;

 private:
  friend class Dataset;
  explicit Iterator(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::shared_ptr<State> state_;
};

// The elements of one given epoch of a Dataset (Dataset::epoch()).
class Dataset::Epoch {
 public:
  Iterator begin() const { return dataset_.start(index_); }
  Iterator end() const { return Iterator(); }

 private:
  friend class Dataset;
  Epoch(Dataset dataset, std::uint64_t index) : dataset_(std::move(dataset)), index_(index) {}
  Dataset dataset_;
  std::uint64_t index_;
};

}  // namespace mixtape::data
