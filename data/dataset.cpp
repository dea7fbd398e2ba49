// The Dataset pipeline: each iteration builds a chain of streams from the stages. Until
// the first batch() the chain carries row indices (shuffling indices is cheap); batch()
// gathers the rows of a batch with one take() (only this process's share of them when a
// shard() follows); map, prefetch and to work on elements.
#include "mixtape/data/dataset.h"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>
#include <variant>

#include "mixtape/autograd/ops.h"
#include "mixtape/autograd/tape.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/error.h"

namespace mixtape::data {

struct Dataset::Stage {
  struct Shuffle {
    std::int64_t buffer_size;
    std::uint64_t seed;
  };
  struct ShuffleAll {
    std::uint64_t seed;
  };
  struct Batch {
    std::int64_t size;
    bool drop_remainder;
  };
  struct Shard {
    std::int64_t index, count;
  };
  struct Map {
    ElementMapFn fn;
  };
  struct Prefetch {
    std::int64_t buffer_size;
  };
  struct To {
    Device device;
  };
  std::variant<Shuffle, ShuffleAll, Batch, Shard, Map, Prefetch, To> op;
};

namespace {

using Stage = Dataset::Stage;

// A source of items, pulled one at a time; nullopt at the end of the epoch.
template <typename T>
class Stream {
 public:
  virtual ~Stream() = default;
  virtual std::optional<T> next() = 0;
};
using RowStream = Stream<std::int64_t>;
using ElementStream = Stream<Element>;

std::uint64_t splitmix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// The row indices 0 .. n-1 in order.
class RangeStream final : public RowStream {
 public:
  explicit RangeStream(std::int64_t n) : n_(n) {}
  std::optional<std::int64_t> next() override {
    if (i_ >= n_) return std::nullopt;
    return i_++;
  }

 private:
  std::int64_t n_, i_ = 0;
};

// tf.data's shuffle buffer.
template <typename T>
class ShuffleStream final : public Stream<T> {
 public:
  ShuffleStream(std::unique_ptr<Stream<T>> up, std::int64_t buffer_size, std::uint64_t seed)
      : up_(std::move(up)), capacity_(static_cast<std::size_t>(buffer_size)), gen_(seed) {}

  std::optional<T> next() override {
    if (!filled_) {
      buffer_.reserve(std::min<std::size_t>(capacity_, std::size_t{1} << 16));
      while (buffer_.size() < capacity_) {
        auto item = up_->next();
        if (!item) break;
        buffer_.push_back(std::move(*item));
      }
      filled_ = true;
    }
    if (buffer_.empty()) return std::nullopt;
    const std::size_t j = uniform(buffer_.size());
    T out = std::move(buffer_[j]);
    if (auto item = up_->next()) {
      buffer_[j] = std::move(*item);
    } else {
      if (j + 1 != buffer_.size()) buffer_[j] = std::move(buffer_.back());
      buffer_.pop_back();
    }
    return out;
  }

 private:
  // Uniform in [0, n), without modulo bias.
  std::size_t uniform(std::size_t n) {
    const std::uint64_t m = n;
    const std::uint64_t limit =
        std::numeric_limits<std::uint64_t>::max() - std::numeric_limits<std::uint64_t>::max() % m;
    std::uint64_t r;
    do r = gen_.next_u64();
    while (r >= limit);
    return static_cast<std::size_t>(r % m);
  }

  std::unique_ptr<Stream<T>> up_;
  std::size_t capacity_;
  Generator gen_;
  std::vector<T> buffer_;
  bool filled_ = false;
};

// shuffle_all(): every element of the epoch, in the order of a Fisher-Yates shuffle (the
// draw of each position reduced modulo its range, as Model::fit always drew them).
template <typename T>
class ShuffleAllStream final : public Stream<T> {
 public:
  ShuffleAllStream(std::unique_ptr<Stream<T>> up, std::uint64_t seed)
      : up_(std::move(up)), gen_(seed) {}

  std::optional<T> next() override {
    if (!filled_) {
      while (auto item = up_->next()) items_.push_back(std::move(*item));
      for (std::size_t i = items_.size(); i > 1; --i)
        std::swap(items_[i - 1], items_[gen_.next_u64() % i]);
      filled_ = true;
    }
    if (next_ >= items_.size()) return std::nullopt;
    return std::move(items_[next_++]);
  }

 private:
  std::unique_ptr<Stream<T>> up_;
  Generator gen_;
  std::vector<T> items_;
  std::size_t next_ = 0;
  bool filled_ = false;
};

// Part `index` of `count` of n items: [n * index / count, n * (index + 1) / count).
std::pair<std::int64_t, std::int64_t> part_of(std::int64_t n, std::int64_t index,
                                              std::int64_t count) {
  return {n * index / count, n * (index + 1) / count};
}

// shard() before batch(): the items [first, last) of the epoch's sequence.
template <typename T>
class BlockStream final : public Stream<T> {
 public:
  BlockStream(std::unique_ptr<Stream<T>> up, std::int64_t first, std::int64_t last)
      : up_(std::move(up)), first_(first), last_(last) {}

  std::optional<T> next() override {
    for (; at_ < first_; ++at_)
      if (!up_->next()) return std::nullopt;
    if (at_ >= last_) return std::nullopt;
    ++at_;
    return up_->next();
  }

 private:
  std::unique_ptr<Stream<T>> up_;
  std::int64_t first_, last_, at_ = 0;
};

// Rows of `x` at `indices`, as a tensor of shape index_shape + x.shape[1:]: a view of
// them when they are consecutive, else take()
// where the backend has a take kernel for the dtype, else a copy of the rows on the host
// (uint8 and bool on the CPU).
Tensor gather_rows(const Tensor& x, const std::vector<std::int64_t>& indices,
                   const Shape& index_shape) {
  // Consecutive rows (a batch of data in its order): a view of them.
  const bool consecutive =
      index_shape.rank() == 1 && !indices.empty() && indices.front() >= 0 &&
      indices.back() < x.dim(0) &&
      std::adjacent_find(indices.begin(), indices.end(), [](std::int64_t a, std::int64_t b) {
        return b != a + 1;
      }) == indices.end();
  if (consecutive) return slice(x, 0, indices.front(), indices.back() + 1);
  if (supports(OpId::take, x.device().type(), x.dtype()) || !x.device().is_cpu())
    return take(x, from_vector(indices, index_shape, kInt64), 0);  // checked on the host
  std::vector<std::int64_t> dims(index_shape.begin(), index_shape.end());
  dims.insert(dims.end(), x.shape().begin() + 1, x.shape().end());
  Tensor out = Tensor::empty(Shape(dims), x.dtype(), x.device());
  const std::size_t row_bytes =
      x.dim(0) == 0 ? 0 : static_cast<std::size_t>(x.numel() / x.dim(0)) * x.dtype().itemsize();
  const auto* src = static_cast<const std::uint8_t*>(x.const_data_ptr());  // x is contiguous
  auto* dst = static_cast<std::uint8_t*>(out.data_ptr());
  for (std::size_t i = 0; i < indices.size(); ++i) {
    if (indices[i] < 0 || indices[i] >= x.dim(0))
      throw IndexError(
          fmt::format("Dataset: row {} out of range for {} rows", indices[i], x.dim(0)));
    std::memcpy(dst + i * row_bytes, src + static_cast<std::size_t>(indices[i]) * row_bytes,
                row_bytes);
  }
  return out;
}

// Rows to elements: one row each (rank-0 index), or batches of rows; of a batch followed
// by shard(), only this process's share of the rows is gathered.
class GatherStream final : public ElementStream {
 public:
  GatherStream(std::unique_ptr<RowStream> up, std::vector<Tensor> inputs,
               std::vector<Tensor> labels, std::int64_t batch, bool drop_remainder, bool unbatched,
               std::optional<Stage::Shard> shard = std::nullopt)
      : up_(std::move(up)),
        inputs_(std::move(inputs)),
        labels_(std::move(labels)),
        batch_(unbatched ? 1 : batch),
        drop_(drop_remainder),
        unbatched_(unbatched),
        shard_(shard) {}

  std::optional<Element> next() override {
    std::vector<std::int64_t> rows;
    rows.reserve(static_cast<std::size_t>(batch_));
    while (static_cast<std::int64_t>(rows.size()) < batch_) {
      auto r = up_->next();
      if (!r) break;
      rows.push_back(*r);
    }
    if (rows.empty() || (drop_ && static_cast<std::int64_t>(rows.size()) < batch_))
      return std::nullopt;
    Element e;
    if (shard_) {
      const auto whole = static_cast<std::int64_t>(rows.size());
      const auto [first, last] = part_of(whole, shard_->index, shard_->count);
      rows = std::vector<std::int64_t>(rows.begin() + first, rows.begin() + last);
      e.shard_of_rows = whole;
    }
    NoGradGuard no_grad;
    const Shape shape = unbatched_ ? Shape{} : Shape{static_cast<std::int64_t>(rows.size())};
    for (const Tensor& t : inputs_) e.inputs.push_back(gather_rows(t, rows, shape));
    for (const Tensor& t : labels_) e.labels.push_back(gather_rows(t, rows, shape));
    return e;
  }

 private:
  std::unique_ptr<RowStream> up_;
  std::vector<Tensor> inputs_, labels_;
  std::int64_t batch_;
  bool drop_, unbatched_;
  std::optional<Stage::Shard> shard_;
};

// shard() of batches made earlier (after map, or of stacked elements): this process's rows
// of every batch, as views.
class ShardBatchStream final : public ElementStream {
 public:
  ShardBatchStream(std::unique_ptr<ElementStream> up, Stage::Shard shard)
      : up_(std::move(up)), shard_(shard) {}

  std::optional<Element> next() override {
    auto e = up_->next();
    if (!e) return std::nullopt;
    const std::int64_t whole = e->rows();
    const auto [first, last] = part_of(whole, shard_.index, shard_.count);
    NoGradGuard no_grad;
    for (auto* part : {&e->inputs, &e->labels})
      for (Tensor& t : *part) {
        if (t.rank() < 1 || t.dim(0) != whole)
          throw ShapeError(fmt::format(
              "Dataset::shard: every tensor of a batch needs its {} rows (axis 0); got {} {}",
              whole, t.dtype().name(), t.shape().str()));
        t = slice(t, 0, first, last);
      }
    e->shard_of_rows = whole;
    return e;
  }

 private:
  std::unique_ptr<ElementStream> up_;
  Stage::Shard shard_;
};

// batch() of elements (after map or an earlier batch): stacks them along a new axis 0.
class StackStream final : public ElementStream {
 public:
  StackStream(std::unique_ptr<ElementStream> up, std::int64_t batch, bool drop_remainder)
      : up_(std::move(up)), batch_(batch), drop_(drop_remainder) {}

  std::optional<Element> next() override {
    std::vector<Element> elements;
    while (static_cast<std::int64_t>(elements.size()) < batch_) {
      auto e = up_->next();
      if (!e) break;
      if (!elements.empty() && (e->inputs.size() != elements[0].inputs.size() ||
                                e->labels.size() != elements[0].labels.size()))
        throw ValueError(fmt::format(
            "Dataset::batch: elements of one batch must hold as many tensors; element {} has "
            "{} inputs and {} labels, the first {} and {}",
            elements.size(), e->inputs.size(), e->labels.size(), elements[0].inputs.size(),
            elements[0].labels.size()));
      elements.push_back(std::move(*e));
    }
    if (elements.empty() || (drop_ && static_cast<std::int64_t>(elements.size()) < batch_))
      return std::nullopt;
    NoGradGuard no_grad;
    // Stacks position k of every element along a new axis 0.
    auto stack = [&](std::vector<Tensor> Element::*part, std::size_t k) {
      std::vector<Tensor> rows;
      rows.reserve(elements.size());
      for (const Element& e : elements) rows.push_back(unsqueeze((e.*part)[k], 0));
      return concat(rows, 0);
    };
    Element out;
    for (std::size_t k = 0; k < elements[0].inputs.size(); ++k)
      out.inputs.push_back(stack(&Element::inputs, k));
    for (std::size_t k = 0; k < elements[0].labels.size(); ++k)
      out.labels.push_back(stack(&Element::labels, k));
    return out;
  }

 private:
  std::unique_ptr<ElementStream> up_;
  std::int64_t batch_;
  bool drop_;
};

class MapStream final : public ElementStream {
 public:
  MapStream(std::unique_ptr<ElementStream> up, ElementMapFn fn)
      : up_(std::move(up)), fn_(std::move(fn)) {}
  std::optional<Element> next() override {
    auto e = up_->next();
    if (!e) return std::nullopt;
    NoGradGuard no_grad;
    Element out = fn_(*e);
    if (out.shard_of_rows == 0) out.shard_of_rows = e->shard_of_rows;
    return out;
  }

 private:
  std::unique_ptr<ElementStream> up_;
  ElementMapFn fn_;
};

class ToStream final : public ElementStream {
 public:
  ToStream(std::unique_ptr<ElementStream> up, Device device)
      : up_(std::move(up)), device_(device) {}
  std::optional<Element> next() override {
    auto e = up_->next();
    if (!e) return std::nullopt;
    NoGradGuard no_grad;
    for (Tensor& t : e->inputs) t = t.to(device_);
    for (Tensor& t : e->labels) t = t.to(device_);
    return e;
  }

 private:
  std::unique_ptr<ElementStream> up_;
  Device device_;
};

// Pulls from upstream on a background thread, up to `capacity` elements ahead.
class PrefetchStream final : public ElementStream {
 public:
  PrefetchStream(std::unique_ptr<ElementStream> up, std::int64_t capacity)
      : up_(std::move(up)), capacity_(static_cast<std::size_t>(capacity)) {
    thread_ = std::thread([this] { produce(); });
  }
  ~PrefetchStream() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  PrefetchStream(const PrefetchStream&) = delete;
  PrefetchStream& operator=(const PrefetchStream&) = delete;

  std::optional<Element> next() override {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [&] { return !queue_.empty() || done_; });
    if (!queue_.empty()) {
      Element e = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      cv_.notify_all();
      return e;
    }
    if (error_) {
      std::exception_ptr error = std::exchange(error_, nullptr);
      std::rethrow_exception(error);
    }
    return std::nullopt;
  }

 private:
  void produce() {
    try {
      NoGradGuard no_grad;
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(mutex_);
          cv_.wait(lock, [&] { return stop_ || queue_.size() < capacity_; });
          if (stop_) return;
        }
        std::optional<Element> e = up_->next();
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (e)
            queue_.push_back(std::move(*e));
          else
            done_ = true;
        }
        cv_.notify_all();
        if (!e) return;
      }
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        error_ = std::current_exception();
        done_ = true;
      }
      cv_.notify_all();
    }
  }

  std::unique_ptr<ElementStream> up_;
  std::size_t capacity_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Element> queue_;
  bool stop_ = false, done_ = false;
  std::exception_ptr error_;
  std::thread thread_;  // last: started after everything it uses is constructed
};

template <class... Fs>
struct Overloaded : Fs... {
  using Fs::operator()...;
};
template <class... Fs>
Overloaded(Fs...) -> Overloaded<Fs...>;

}  // namespace

struct Dataset::Iterator::State {
  std::unique_ptr<ElementStream> stream;
  Element current;
};

Element& Dataset::Iterator::operator*() const {
  if (!state_) throw IndexError("Dataset::Iterator: dereferencing the end of the dataset");
  return state_->current;
}

Dataset::Iterator& Dataset::Iterator::operator++() {
  if (!state_) throw IndexError("Dataset::Iterator: incrementing past the end of the dataset");
  std::optional<Element> e;
  try {
    e = state_->stream->next();
  } catch (...) {
    state_.reset();  // an iterator whose pipeline failed is at its end
    throw;
  }
  if (e)
    state_->current = std::move(*e);
  else
    state_.reset();  // the end; destroys the pipeline (and joins a prefetch thread)
  return *this;
}

Element::Element(Tensor x, Tensor y) : inputs{std::move(x)}, labels{std::move(y)} {}

Element::Element(std::pair<Tensor, Tensor> xy)
    : inputs{std::move(xy.first)}, labels{std::move(xy.second)} {}

Element::Element(std::vector<Tensor> inputs_, std::vector<Tensor> labels_)
    : inputs(std::move(inputs_)), labels(std::move(labels_)) {}

namespace {

std::size_t check_single(const Element& e) {
  if (e.inputs.size() != 1 || e.labels.size() != 1)
    throw ValueError(fmt::format(
        "Dataset element: x() and y() need one input and one label; this element holds {} "
        "inputs and {} labels (read .inputs and .labels)",
        e.inputs.size(), e.labels.size()));
  return 0;
}

}  // namespace

std::int64_t Element::rows() const {
  if (inputs.empty() || !inputs[0].defined() || inputs[0].rank() < 1)
    throw ValueError("Dataset element: rows() needs a first input with an axis 0");
  return inputs[0].dim(0);
}

double Element::share() const {
  if (shard_of_rows <= 0) return 1.0;
  return static_cast<double>(rows()) / static_cast<double>(shard_of_rows);
}

Tensor& Element::x() { return inputs[check_single(*this)]; }
const Tensor& Element::x() const { return inputs[check_single(*this)]; }
Tensor& Element::y() { return labels[check_single(*this)]; }
const Tensor& Element::y() const { return labels[check_single(*this)]; }

Dataset Dataset::from_tensors(const Tensor& x, const Tensor& y) {
  if (!x.defined() || !y.defined())
    throw ValueError(
        "Dataset::from_tensors: x and y must be defined tensors (a dataset without labels is "
        "from_tensors(std::vector<Tensor>{x}, {}))");
  if (x.rank() < 1 || y.rank() < 1 || x.dim(0) != y.dim(0))
    throw ShapeError(fmt::format(
        "Dataset::from_tensors: x and y must have the same number of rows (axis 0); got x {} "
        "{} and y {} {}",
        x.dtype().name(), x.shape().str(), y.dtype().name(), y.shape().str()));
  return from_tensors(std::vector<Tensor>{x}, std::vector<Tensor>{y});
}

Dataset Dataset::from_tensors(const std::vector<Tensor>& inputs,
                              const std::vector<Tensor>& labels) {
  if (inputs.empty())
    throw ValueError("Dataset::from_tensors: at least one input tensor is needed");
  auto name = [&](std::size_t i) {
    return i < inputs.size() ? fmt::format("inputs[{}]", i)
                             : fmt::format("labels[{}]", i - inputs.size());
  };
  auto at = [&](std::size_t i) -> const Tensor& {
    return i < inputs.size() ? inputs[i] : labels[i - inputs.size()];
  };
  const std::size_t n = inputs.size() + labels.size();
  for (std::size_t i = 0; i < n; ++i) {
    const Tensor& t = at(i);
    if (!t.defined())
      throw ValueError(fmt::format("Dataset::from_tensors: {} is not a defined tensor", name(i)));
    if (t.rank() < 1 || t.dim(0) != at(0).dim(0))
      throw ShapeError(fmt::format(
          "Dataset::from_tensors: every tensor must have the same number of rows (axis 0); {} "
          "is {} {} and {} is {} {}",
          name(i), t.dtype().name(), t.shape().str(), name(0), at(0).dtype().name(),
          at(0).shape().str()));
  }
  NoGradGuard no_grad;
  Dataset ds;
  for (const Tensor& t : inputs) ds.inputs_.push_back(t.detach().contiguous());
  for (const Tensor& t : labels) ds.labels_.push_back(t.detach().contiguous());
  return ds;
}

Dataset Dataset::with(std::shared_ptr<const Stage> stage) const {
  Dataset out = *this;
  out.next_epoch_.value.store(0);
  out.stages_.push_back(std::move(stage));
  return out;
}

Dataset Dataset::shuffle(std::int64_t buffer_size, std::optional<std::uint64_t> seed) const {
  if (buffer_size < 1)
    throw ValueError(
        fmt::format("Dataset::shuffle: buffer_size must be >= 1, got {}", buffer_size));
  const std::uint64_t s = seed ? *seed : default_generator().next_u64();
  return with(std::make_shared<const Stage>(Stage{Stage::Shuffle{buffer_size, s}}));
}

Dataset Dataset::shuffle_all(std::optional<std::uint64_t> seed) const {
  const std::uint64_t s = seed ? *seed : default_generator().next_u64();
  return with(std::make_shared<const Stage>(Stage{Stage::ShuffleAll{s}}));
}

Dataset Dataset::shard(std::int64_t index, std::int64_t count) const {
  if (count < 1)
    throw ValueError(
        fmt::format("Dataset::shard: count must be >= 1 (the number of processes); "
                    "got shard({}, {})",
                    index, count));
  if (index < 0 || index >= count)
    throw ValueError(fmt::format(
        "Dataset::shard: index must be in [0, count) (this process's rank among count); got "
        "shard({}, {})",
        index, count));
  return with(std::make_shared<const Stage>(Stage{Stage::Shard{index, count}}));
}

Dataset Dataset::batch(std::int64_t batch_size, bool drop_remainder) const {
  if (batch_size < 1)
    throw ValueError(fmt::format("Dataset::batch: batch_size must be >= 1, got {}", batch_size));
  return with(std::make_shared<const Stage>(Stage{Stage::Batch{batch_size, drop_remainder}}));
}

Dataset Dataset::map(MapFn fn) const {
  if (!fn) throw ValueError("Dataset::map: the function is empty");
  return map(ElementMapFn([fn = std::move(fn)](const Element& e) { return fn(e.x(), e.y()); }));
}

Dataset Dataset::map(ElementMapFn fn) const {
  if (!fn) throw ValueError("Dataset::map: the function is empty");
  return with(std::make_shared<const Stage>(Stage{Stage::Map{std::move(fn)}}));
}

Dataset Dataset::prefetch(std::int64_t buffer_size) const {
  if (buffer_size < 1)
    throw ValueError(
        fmt::format("Dataset::prefetch: buffer_size must be >= 1, got {}", buffer_size));
  return with(std::make_shared<const Stage>(Stage{Stage::Prefetch{buffer_size}}));
}

Dataset Dataset::to(Device device) const {
  return with(std::make_shared<const Stage>(Stage{Stage::To{device}}));
}

std::int64_t Dataset::num_rows() const { return inputs_.empty() ? 0 : inputs_[0].dim(0); }

std::int64_t Dataset::size() const {
  std::int64_t n = num_rows();
  bool batched = false;
  for (const auto& stage : stages_) {
    if (const auto* b = std::get_if<Stage::Batch>(&stage->op)) {
      n = b->drop_remainder ? n / b->size : (n + b->size - 1) / b->size;
      batched = true;
    } else if (const auto* p = std::get_if<Stage::Shard>(&stage->op); p && !batched) {
      const auto [first, last] = part_of(n, p->index, p->count);
      n = last - first;
    }
  }
  return n;
}

std::string Dataset::str() const {
  if (inputs_.empty()) return "Dataset()";
  auto describe = [](const std::vector<Tensor>& ts) {
    std::string out;
    for (const Tensor& t : ts)
      out += fmt::format("{}{} {}", out.empty() ? "" : ", ", t.dtype().name(), t.shape().str());
    return out;
  };
  std::string out =
      inputs_.size() == 1 && labels_.size() == 1
          ? fmt::format("from_tensors(x {}, y {})", describe(inputs_), describe(labels_))
          : fmt::format("from_tensors({{{}}}, {{{}}})", describe(inputs_), describe(labels_));
  for (const auto& stage : stages_)
    out += std::visit(
        Overloaded{
            [](const Stage::Shuffle& s) { return fmt::format(".shuffle({})", s.buffer_size); },
            [](const Stage::ShuffleAll&) { return std::string(".shuffle_all()"); },
            [](const Stage::Shard& p) { return fmt::format(".shard({}, {})", p.index, p.count); },
            [](const Stage::Batch& b) {
              return b.drop_remainder ? fmt::format(".batch({}, drop_remainder)", b.size)
                                      : fmt::format(".batch({})", b.size);
            },
            [](const Stage::Map&) { return std::string(".map(fn)"); },
            [](const Stage::Prefetch& p) { return fmt::format(".prefetch({})", p.buffer_size); },
            [](const Stage::To& t) { return fmt::format(".to({})", t.device.str()); }},
        stage->op);
  return out;
}

Dataset::Iterator Dataset::start(std::uint64_t epoch) const {
  if (inputs_.empty()) return Iterator();
  std::unique_ptr<RowStream> rows = std::make_unique<RangeStream>(num_rows());
  std::unique_ptr<ElementStream> elements;
  auto materialize = [&] {
    if (!elements)
      elements = std::make_unique<GatherStream>(std::move(rows), inputs_, labels_, 1, false, true);
  };
  // Items in the epoch before the first batch(), which a shard() there splits.
  std::int64_t count = num_rows();
  bool batched = false;
  for (std::size_t k = 0; k < stages_.size(); ++k) {
    const Stage::Shard* shard_next =
        k + 1 < stages_.size() ? std::get_if<Stage::Shard>(&stages_[k + 1]->op) : nullptr;
    std::visit(
        Overloaded{
            [&](const Stage::Shuffle& s) {
              // Each (seed, epoch) pair gives its own order.
              const std::uint64_t seed = splitmix64(s.seed ^ splitmix64(epoch + 1));
              if (elements)
                elements = std::make_unique<ShuffleStream<Element>>(std::move(elements),
                                                                    s.buffer_size, seed);
              else
                rows = std::make_unique<ShuffleStream<std::int64_t>>(std::move(rows), s.buffer_size,
                                                                     seed);
            },
            [&](const Stage::ShuffleAll& s) {
              const std::uint64_t seed = s.seed ^ (0x9e3779b97f4a7c15ULL * (epoch + 1));
              if (elements)
                elements = std::make_unique<ShuffleAllStream<Element>>(std::move(elements), seed);
              else
                rows = std::make_unique<ShuffleAllStream<std::int64_t>>(std::move(rows), seed);
            },
            [&](const Stage::Batch& b) {
              batched = true;
              if (elements) {
                elements =
                    std::make_unique<StackStream>(std::move(elements), b.size, b.drop_remainder);
                return;
              }
              // A shard() right after gathers only this process's rows (and is done here).
              std::optional<Stage::Shard> shard;
              if (shard_next) shard = *shard_next, ++k;
              elements = std::make_unique<GatherStream>(std::move(rows), inputs_, labels_, b.size,
                                                        b.drop_remainder, false, shard);
            },
            [&](const Stage::Shard& p) {
              if (batched) {
                elements = std::make_unique<ShardBatchStream>(std::move(elements), p);
                return;
              }
              const auto [first, last] = part_of(count, p.index, p.count);
              count = last - first;
              if (elements)
                elements = std::make_unique<BlockStream<Element>>(std::move(elements), first, last);
              else
                rows = std::make_unique<BlockStream<std::int64_t>>(std::move(rows), first, last);
            },
            [&](const Stage::Map& m) {
              materialize();
              elements = std::make_unique<MapStream>(std::move(elements), m.fn);
            },
            [&](const Stage::Prefetch& p) {
              materialize();
              elements = std::make_unique<PrefetchStream>(std::move(elements), p.buffer_size);
            },
            [&](const Stage::To& t) {
              materialize();
              elements = std::make_unique<ToStream>(std::move(elements), t.device);
            }},
        stages_[k]->op);
  }
  materialize();
  auto state = std::make_shared<Iterator::State>();
  state->stream = std::move(elements);
  Iterator it(std::move(state));
  ++it;  // the first element (or the end)
  return it;
}

Dataset::Iterator Dataset::begin() const { return start(next_epoch_.value.fetch_add(1)); }

Dataset::Iterator Dataset::end() const { return Iterator(); }

Dataset::Epoch Dataset::epoch(std::uint64_t index) const { return Epoch(*this, index); }

}  // namespace mixtape::data
