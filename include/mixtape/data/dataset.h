// A tf.data-like input pipeline: Dataset::from_tensors(x, y) with shuffle, batch, shard,
// map, prefetch and to(device), iterated with range-for; Model::fit trains on one.
//
//   auto ds = mt::data::Dataset::from_tensors(x, y).shuffle(10000).batch(128).prefetch();
//   for (int epoch = 0; epoch < 5; ++epoch)
//     for (auto& [xb, yb] : ds) { ... }   // each loop is a new epoch, reshuffled
//
// A model of several inputs or outputs reads tuples: from_tensors({xa, xb}, {ya, yb})
// yields elements whose .inputs and .labels hold one tensor each, in that order:
//
//   for (auto& e : ds) model.train_step(e.inputs, e.labels);
//
// A Dataset is a description with value semantics: every method returns a new Dataset
// and leaves its receiver unchanged, copies are cheap (the tensors are shared), and each
// iteration starts a fresh epoch. Elements are rows along axis 0 of the source tensors;
// after batch() they are batches of rows. Rows are gathered with mixtape::take (one call
// per tensor and batch; consecutive rows, a batch of unshuffled data, are a view of the
// source instead), and no pipeline step is recorded on a tape.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "mixtape/core/device.h"
#include "mixtape/core/tensor.h"

namespace mixtape::data {

// One element of a dataset: its inputs and labels (rows, or batches of rows), in the order
// given to from_tensors. A dataset of one input and one label tensor binds as a pair,
// `auto& [x, y] = element` (x() and y()); one of tuples is read through .inputs and .labels.
struct Element {
  std::vector<Tensor> inputs;
  std::vector<Tensor> labels;

  // After shard() of batches: the rows of the whole batch this element is a share of (0:
  // the element is not such a share). map() keeps it when its function leaves it 0.
  std::int64_t shard_of_rows = 0;

  Element() = default;
  Element(Tensor x, Tensor y);
  Element(std::pair<Tensor, Tensor> xy);  // NOLINT: a map() function may return a pair
  Element(std::vector<Tensor> inputs, std::vector<Tensor> labels);

  // The one input and the one label; ValueError naming the counts when an element holds
  // several (read .inputs / .labels then).
  Tensor& x();
  const Tensor& x() const;
  Tensor& y();
  const Tensor& y() const;

  // The rows (axis 0) of the first input.
  std::int64_t rows() const;
  // The fraction of its batch this element holds: rows() / shard_of_rows after shard(), 1
  // otherwise. A data-parallel step weighs this rank's gradient by it
  // (DistributedOptimizer::set_gradient_weight), so that a batch split unevenly across the
  // ranks averages as one process would.
  double share() const;

  // The pair protocol of `auto& [x, y]`.
  template <std::size_t I>
  Tensor& get() {
    static_assert(I < 2);
    if constexpr (I == 0)
      return x();
    else
      return y();
  }
  template <std::size_t I>
  const Tensor& get() const {
    static_assert(I < 2);
    if constexpr (I == 0)
      return x();
    else
      return y();
  }
};

// A map() function of a dataset of one input and one label: takes (x, y), returns the new
// element (an Element or a std::pair of tensors).
using MapFn = std::function<Element(const Tensor& x, const Tensor& y)>;
// A map() function of any dataset: takes the element, returns the new one (it may change
// the number of inputs or labels).
using ElementMapFn = std::function<Element(const Element& element)>;

// An input pipeline over the rows of two tensors (see the top of this header).
class Dataset {
 public:
  class Iterator;
  class Epoch;

  // Elements are the rows (axis 0) of x and y, which must agree on axis 0 (ShapeError
  // otherwise; both need rank >= 1).
  static Dataset from_tensors(const Tensor& x, const Tensor& y);
  // Tuples: elements are (inputs[i] for each input, labels[i] for each label). Every tensor
  // must have the same number of rows (ShapeError naming the one that differs); at least
  // one input, labels may be empty (a dataset for predict).
  static Dataset from_tensors(const std::vector<Tensor>& inputs, const std::vector<Tensor>& labels);

  // tf.data's shuffle: a buffer of buffer_size elements, each output drawn uniformly from
  // the buffer and replaced by the next input; buffer_size >= size() is a uniform
  // permutation, a small buffer only mixes nearby elements. Every epoch is reshuffled,
  // deterministically from (seed, epoch number). Without a seed, one is drawn from
  // mixtape::default_generator() here (so mixtape::manual_seed makes runs repeatable).
  Dataset shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed = std::nullopt) const;
  // A uniform random order of all elements, new each epoch, with no buffer to size: a
  // Fisher-Yates shuffle of the epoch's elements (of row indices when it comes before
  // batch() and map(), which costs 8 bytes a row) by a Generator seeded with
  // seed ^ (0x9e3779b97f4a7c15 * (epoch + 1)). It is what Model::fit does to tensors
  // (fit(x, y, {.seed = s}) and fit(from_tensors(x, y).shuffle_all(s).batch(b)) train alike).
  // Without a seed, one is drawn from mixtape::default_generator() here.
  Dataset shuffle_all(std::optional<std::uint64_t> seed = std::nullopt) const;
  // Groups consecutive elements into batches of batch_size along a new axis 0 (rows
  // are gathered with one take()); the last, smaller batch is dropped when
  // drop_remainder is true.
  Dataset batch(std::int64_t batch_size, bool drop_remainder = false) const;
  // Process `index` of `count`'s part of the data (data-parallel training: index = rank,
  // count = world size), contiguous and as even as it goes (part i of n items is
  // [n * i / count, n * (i + 1) / count)):
  //   - after batch(): of every batch, these rows (a share may be empty: a batch of 3 rows
  //     on 4 ranks). Elements carry shard_of_rows, the rows of the whole batch, and every
  //     process sees every step, so the ranks of a data-parallel fit stay in step;
  //   - before batch(): of the epoch's elements, this block (each process evaluates its
  //     block of the samples).
  // ValueError unless count >= 1 and 0 <= index < count.
  Dataset shard(std::int64_t index, std::int64_t count) const;
  // Applies fn to each element (to each batch when it follows batch()), in pipeline order.
  // MapFn needs elements of one input and one label (ValueError from the element that is
  // not); ElementMapFn takes any.
  Dataset map(MapFn fn) const;
  Dataset map(ElementMapFn fn) const;
  // Prepares up to buffer_size elements ahead on a background thread while the consumer
  // works. An exception in the pipeline is re-thrown to the consumer (after the elements
  // produced before it); destroying the iterator stops and joins the thread.
  Dataset prefetch(std::int64_t buffer_size = 1) const;
  // Copies each element to `device` (in the prefetch thread when a prefetch follows).
  Dataset to(Device device) const;

  // The number of elements one epoch yields (batches after batch(); a shard before batch()
  // counts this process's block).
  std::int64_t size() const;
  // The number of rows of the source tensors.
  std::int64_t num_rows() const;
  // How many inputs and labels each element of the source holds (map may change them).
  std::size_t num_inputs() const { return inputs_.size(); }
  std::size_t num_labels() const { return labels_.size(); }
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

  std::vector<Tensor> inputs_, labels_;
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

template <>
struct std::tuple_size<mixtape::data::Element> : std::integral_constant<std::size_t, 2> {};
template <std::size_t I>
struct std::tuple_element<I, mixtape::data::Element> {
  using type = mixtape::Tensor;
};
