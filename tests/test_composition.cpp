// Layers made of layers: sublayers made in a constructor or in build() are tracked without
// a call to track(); an untracked layer called inside call() is an error naming track();
// a failed build leaves no sublayer behind; compile gives each model its own optimizer
// unless one is shared on purpose.
#include <catch2/catch.hpp>
#include <memory>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;
using Catch::Matchers::Contains;

namespace {

// Sublayers made in the member initializers (as docs/extending.md shows).
class Block : public ml::Layer {
 public:
  explicit Block(std::int64_t units, ml::LayerOptions options = {})
      : Layer(std::move(options)),
        first_(ml::Dense(units, {.activation = "tanh"})),
        second_(ml::Dense(units)) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return x + second_(first_(x, ctx), ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> first_, second_;
};

// Sublayers made in build(), from the input's shape, and called there too.
class LazyBlock : public ml::Layer {
 public:
  using Layer::Layer;
  void build(const mt::Shape& input_shape) override {
    inner_ = ml::Dense(input_shape.back());
    inner_(mt::zeros({1, input_shape.back()}));  // called in build(): tracked already
  }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return x + inner_(x, ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> inner_;
};

// A sublayer made without make_layer: not tracked.
class Untracked : public ml::Layer {
 public:
  explicit Untracked(bool track_it, ml::LayerOptions options = {})
      : Layer(std::move(options)), inner_(std::make_shared<ml::DenseLayer>(3, ml::DenseOptions{})) {
    if (track_it) track(inner_);
  }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return inner_(x, ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> inner_;
};

// Calls a layer it was given (shared with another block), without tracking it.
class UsesShared : public ml::Layer {
 public:
  UsesShared(ml::LayerPtr<ml::DenseLayer> shared, ml::LayerOptions options = {})
      : Layer(std::move(options)), shared_(std::move(shared)) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return shared_(x, ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> shared_;
};

// Makes a sublayer in build(), then fails.
class FailingBuild : public ml::Layer {
 public:
  using Layer::Layer;
  bool fail = true;
  void build(const mt::Shape& input_shape) override {
    inner_ = ml::Dense(input_shape.back());
    if (fail) throw mt::ValueError("refused");
  }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext& ctx) override {
    return inner_(x, ctx);
  }

 private:
  ml::LayerPtr<ml::DenseLayer> inner_;
};

// A layer that exposes track() (it is protected).
class Holder : public ml::Layer {
 public:
  using Layer::Layer;
  void hold(std::shared_ptr<ml::Layer> l) { track(std::move(l)); }
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override { return x; }
};

std::vector<std::vector<float>> values(const std::vector<mt::Variable>& vars) {
  std::vector<std::vector<float>> out;
  for (const auto& v : vars) out.push_back(v.to_vector<float>());
  return out;
}

}  // namespace

TEST_CASE("composition: sublayers made in a constructor are tracked and trained", "[composition]") {
  mt::manual_seed(11);
  auto block = ml::make_layer<Block>(6);
  REQUIRE(block->sublayers().size() == 2);
  const mt::Tensor x = mt::normal({96, 6});
  const mt::Tensor y = mt::cast(mt::greater(mt::sum(x, {1}), mt::zeros({})), mt::kInt64);
  mt::Sequential model({block, ml::Dense(2)});
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                 .optimizer = mo::Adam({.learning_rate = 0.01})});
  model.build_for({-1, 6});
  // The block's two Dense layers and the head: a kernel and a bias each.
  CHECK(block->weights().size() == 4);
  CHECK(block->count_params() == 2 * (6 * 6 + 6));
  const auto vars = model.trainable_variables();
  REQUIRE(vars.size() == 6);
  const auto before = values(vars);
  model.fit(x, y, {.batch_size = 32, .epochs = 2, .verbose = 0});
  const auto after = values(vars);
  for (std::size_t i = 0; i < vars.size(); ++i) {
    INFO(vars[i].name());
    CHECK(after[i] != before[i]);
  }
  // set_trainable reaches the sublayers.
  block->set_trainable(false);
  CHECK(model.trainable_variables().size() == 2);
}

TEST_CASE("composition: sublayers made in build() are tracked, even when build() calls them",
          "[composition]") {
  auto lazy = ml::make_layer<LazyBlock>();
  CHECK(lazy->sublayers().empty());
  const mt::Tensor y = lazy(mt::ones({2, 5}));
  CHECK(y.shape() == mt::Shape({2, 5}));
  REQUIRE(lazy->sublayers().size() == 1);
  CHECK(lazy->weights().size() == 2);
}

TEST_CASE("composition: an untracked layer called inside call() is an error naming track()",
          "[composition]") {
  auto bad = ml::make_layer<Untracked>(false, ml::LayerOptions{.name = "outer"});
  try {
    bad(mt::ones({2, 4}));
    FAIL("no error");
  } catch (const mt::ValueError& e) {
    const std::string msg = e.what();
    CHECK_THAT(msg, Contains("layer 'outer'") && Contains("(Dense)") &&
                        Contains("called inside the call() of layer 'outer' (Untracked)") &&
                        Contains("track()") && Contains("never train"));
  }
  // The same layer, tracked explicitly: fine, and its weights are the outer layer's.
  auto good = ml::make_layer<Untracked>(true);
  CHECK(good(mt::ones({2, 4})).shape() == mt::Shape({2, 3}));
  CHECK(good->weights().size() == 2);
}

TEST_CASE("composition: a layer tracked by a layer further out may be called inside call()",
          "[composition]") {
  // One Dense shared by two blocks, tracked by the model that holds all three: its weights
  // are counted once.
  auto shared = ml::Dense(4, {.name = "shared"});
  auto a = ml::make_layer<UsesShared>(shared);
  auto b = ml::make_layer<UsesShared>(shared);
  mt::Sequential model({shared, a, b});
  CHECK(model(mt::ones({2, 4})).shape() == mt::Shape({2, 4}));
  CHECK(model.weights().size() == 2);
  // Alone, a block that does not track what it calls is refused.
  auto alone = ml::make_layer<UsesShared>(ml::Dense(4), ml::LayerOptions{.name = "alone"});
  CHECK_THROWS_WITH(alone(mt::ones({2, 4})), Contains("does not track it"));
}

TEST_CASE("composition: a failed build leaves no sublayer behind", "[composition]") {
  auto layer = ml::make_layer<FailingBuild>();
  CHECK_THROWS_WITH(layer(mt::ones({2, 3})), Contains("refused"));
  CHECK_FALSE(layer->built());
  CHECK(layer->sublayers().empty());
  CHECK(layer->weights().empty());
  layer->fail = false;
  CHECK(layer(mt::ones({2, 3})).shape() == mt::Shape({2, 3}));
  CHECK(layer->sublayers().size() == 1);
}

TEST_CASE("composition: a layer made outside any layer belongs to none", "[composition]") {
  auto holder = ml::make_layer<Holder>();
  auto free_layer = ml::Dense(2);
  CHECK(holder->sublayers().empty());
  // track() refuses itself and cycles.
  CHECK_THROWS_WITH(holder->hold(holder), Contains("cannot track itself"));
  auto inner = ml::make_layer<Holder>();
  holder->hold(inner);
  CHECK_THROWS_WITH(inner->hold(holder), Contains("a cycle"));
  CHECK(inner->sublayers().empty());
}

TEST_CASE("compile: one CompileOptions gives each model its own optimizer", "[composition]") {
  auto make = [] {
    return std::make_unique<mt::Sequential>(std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(2)});
  };
  const mt::CompileOptions options{.loss = mt::losses::MeanSquaredError(),
                                   .optimizer = mo::Adam({.learning_rate = 0.1})};
  auto m1 = make(), m2 = make();
  m1->compile(options);
  m2->compile(options);
  CHECK(m1->optimizer() != m2->optimizer());
  const mt::Tensor x = mt::ones({4, 3}), y = mt::zeros({4, 2});
  m1->train_step(x, y);
  CHECK(m1->optimizer()->iterations() == 1);
  CHECK(m2->optimizer()->iterations() == 0);
  // By name, likewise.
  const mt::CompileOptions by_name{.loss = mt::losses::MeanSquaredError(), .optimizer = "sgd"};
  auto m3 = make(), m4 = make();
  m3->compile(by_name);
  m4->compile(by_name);
  CHECK(m3->optimizer() != m4->optimizer());
  // Shared on purpose: the same object.
  auto adam = std::make_shared<mo::Adam>(mo::AdamOptions{.learning_rate = 0.1});
  const mt::CompileOptions shared{.loss = mt::losses::MeanSquaredError(), .optimizer = adam};
  auto m5 = make(), m6 = make();
  m5->compile(shared);
  m6->compile(shared);
  CHECK(m5->optimizer() == adam);
  CHECK(m6->optimizer() == adam);
}
