// The training step as one piece: fit built on the Dataset pipeline (the tensor form trains
// on the batches it documents, bit for bit; fit(Dataset) is the same training), shard and
// shuffle_all, the progress output as a callback, the optimizer chain compile builds, and
// a wrapped optimizer that refuses a step bypassing its wrapper.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "error_of.h"
#include "mixtape/mixtape.h"
#include "temp_dir.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;

namespace {

// Random inputs (rows x dims) and labels in [0, classes).
struct Data {
  mt::Tensor x, y;
};
Data sample_data(std::int64_t rows, std::int64_t dims, std::int64_t classes, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<float> xs;
  std::vector<std::int64_t> ys;
  for (std::int64_t i = 0; i < rows; ++i) {
    ys.push_back(static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(classes)));
    for (std::int64_t d = 0; d < dims; ++d) xs.push_back(static_cast<float>(gen.next_normal()));
  }
  return {mt::from_vector(xs, {rows, dims}), mt::from_vector(ys, {rows})};
}

// The same model (seeded weights) every call, compiled with Adam.
std::unique_ptr<mt::Model> compiled_model(std::int64_t dims, std::int64_t classes) {
  mt::manual_seed(21);
  auto inputs = ml::Input({dims});
  auto h = ml::Dense(16, {.activation = "relu"})(inputs);
  auto outputs = ml::Dense(classes, {.dtype = "float32"})(h);
  auto model = std::make_unique<mt::Model>(inputs, outputs);
  model->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                  .optimizer = mo::Adam({.learning_rate = 0.01}),
                  .metrics = {"accuracy"}});
  return model;
}

std::vector<std::vector<float>> weights_of(const mt::Model& model) {
  std::vector<std::vector<float>> out;
  for (const mt::Variable& w : model.weights())
    out.push_back(mt::cast(w.value(), mt::kFloat32).to_vector<float>());
  return out;
}

// Whatever `fn` prints on stdout.
template <typename Fn>
std::string stdout_of(Fn&& fn) {
  mixtape_test::TempDir dir;
  const std::string path = (dir.path() / "stdout.txt").string();
  std::fflush(stdout);
  const int saved = ::dup(1);
  REQUIRE(saved >= 0);
  REQUIRE(std::freopen(path.c_str(), "w", stdout) != nullptr);
  try {
    fn();
  } catch (...) {
    std::fflush(stdout);
    ::dup2(saved, 1);
    ::close(saved);
    throw;
  }
  std::fflush(stdout);
  ::dup2(saved, 1);
  ::close(saved);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The first value of the first input of every element of one epoch.
std::vector<float> firsts(const mt::data::Dataset& ds, std::uint64_t epoch) {
  std::vector<float> out;
  for (const auto& e : ds.epoch(epoch)) out.push_back(e.inputs[0].to_vector<float>().front());
  return out;
}

}  // namespace

TEST_CASE("fit on tensors trains on the batches it documents, bit for bit",
          "[training][fit][dataset]") {
  // fit(x, y, {.seed = s}) shuffles epoch e with Generator(s ^ (0x9e3779b97f4a7c15 * (e + 1)))
  // (Fisher-Yates, each draw reduced modulo its range), batches in that order, one step
  // each, and logs the row-weighted mean loss: written out here with train_step.
  const Data d = sample_data(203, 6, 3, 1);
  const std::uint64_t seed = 9;
  const std::int64_t batch = 32;
  for (const char* policy : {"float32", "mixed_float16"}) {
    INFO("policy " << policy);
    mt::PolicyScope scope(policy);
    auto fitted_model = compiled_model(6, 3);
    mt::Model& fitted = *fitted_model;
    const mt::History h =
        fitted.fit(d.x, d.y, {.batch_size = batch, .epochs = 3, .seed = seed, .verbose = 0});

    auto looped_model = compiled_model(6, 3);
    mt::Model& looped = *looped_model;
    std::vector<double> losses;
    for (std::uint64_t epoch = 0; epoch < 3; ++epoch) {
      std::vector<std::int64_t> order(203);
      std::iota(order.begin(), order.end(), 0);
      mt::Generator gen(seed ^ (0x9e3779b97f4a7c15ULL * (epoch + 1)));
      for (std::size_t i = order.size(); i > 1; --i)
        std::swap(order[i - 1], order[gen.next_u64() % i]);
      double sum = 0.0;
      for (std::int64_t b0 = 0; b0 < 203; b0 += batch) {
        const std::int64_t b1 = std::min<std::int64_t>(203, b0 + batch);
        const mt::Tensor idx = mt::from_vector(
            std::vector<std::int64_t>(order.begin() + b0, order.begin() + b1), {b1 - b0});
        const mt::Logs logs = looped.train_step(mt::take(d.x, idx, 0), mt::take(d.y, idx, 0));
        sum += logs.at("loss") * static_cast<double>(b1 - b0);
      }
      losses.push_back(sum / 203.0);
    }
    CHECK(h.history.at("loss") == losses);
    CHECK(weights_of(fitted) == weights_of(looped));
  }
}

TEST_CASE("fit(Dataset) is the main form: the tensor form is fit of its pipeline",
          "[training][fit][dataset]") {
  const Data d = sample_data(150, 5, 4, 2), val = sample_data(40, 5, 4, 3);
  auto pa = compiled_model(5, 4), pb = compiled_model(5, 4);
  mt::Model &a = *pa, &b = *pb;
  const mt::History ha = a.fit(d.x, d.y,
                               {.batch_size = 16,
                                .epochs = 3,
                                .validation_data = {val.x, val.y},
                                .seed = 4,
                                .verbose = 0,
                                .initial_epoch = 1});
  const auto ds = mt::data::Dataset::from_tensors(d.x, d.y).shuffle_all(4).batch(16);
  const mt::History hb = b.fit(ds, {.batch_size = 16,
                                    .epochs = 3,
                                    .validation_data = {val.x, val.y},
                                    .verbose = 0,
                                    .initial_epoch = 1});
  CHECK(ha.epoch == std::vector<int>{1, 2});
  CHECK(hb.epoch == ha.epoch);
  CHECK(hb.history == ha.history);
  CHECK(weights_of(a) == weights_of(b));

  SECTION("unshuffled: batches in order, the same as fit with shuffle off") {
    auto pc = compiled_model(5, 4), pe = compiled_model(5, 4);
    mt::Model &c = *pc, &e = *pe;
    const mt::History hc =
        c.fit(d.x, d.y, {.batch_size = 20, .epochs = 2, .shuffle = false, .verbose = 0});
    const mt::History he =
        e.fit(mt::data::Dataset::from_tensors(d.x, d.y).batch(20), {.epochs = 2, .verbose = 0});
    CHECK(hc.history == he.history);
    CHECK(weights_of(c) == weights_of(e));
  }
}

TEST_CASE("fit(Dataset): bad input is a clear error before or at the batch that is wrong",
          "[training][fit][dataset]") {
  const Data d = sample_data(40, 5, 3, 4);
  auto owned = compiled_model(5, 3);
  mt::Model& model = *owned;
  const auto ds = mt::data::Dataset::from_tensors(d.x, d.y).batch(10);

  // A batch whose features differ from the first batch's: the batch is named, nothing of it
  // is trained.
  auto count = std::make_shared<int>(0);
  const auto changing = ds.map(mt::data::ElementMapFn([count](const mt::data::Element& e) {
    if ((*count)++ != 2) return e;
    return mt::data::Element(mt::slice(e.x(), 1, 0, 4), e.y());
  }));
  const std::string shape_error = mixtape_test::error_of<mt::ShapeError>(
      [&] { model.fit(changing, {.epochs = 1, .verbose = 0}); });
  CHECK_THAT(shape_error, Catch::Contains("batch 2 of the Dataset"));
  CHECK_THAT(shape_error, Catch::Contains("float32[10, 4]"));
  CHECK_THAT(shape_error, Catch::Contains("float32[10, 5]"));

  CHECK_THAT(mixtape_test::error_of<mt::ValueError>(
                 [&] { model.fit(ds, {.validation_split = 0.2, .verbose = 0}); }),
             Catch::Contains("validation_split (0.2) needs tensors"));
  CHECK_THAT(
      mixtape_test::error_of<mt::ValueError>([&] { model.fit(ds, {.epochs = -1, .verbose = 0}); }),
      Catch::Contains("epochs must be >= 0; got -1"));
  auto input = ml::Input({5});
  mt::Model uncompiled(input, ml::Dense(3)(input));
  CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] { uncompiled.fit(ds, {.verbose = 0}); }),
             Catch::Contains("not compiled"));
}

TEST_CASE("Dataset::shard: each process's contiguous part of every batch, or of the epoch",
          "[dataset]") {
  std::vector<float> xs(10);
  std::iota(xs.begin(), xs.end(), 0.0f);
  const mt::Tensor x = mt::from_vector(xs, {10}), y = mt::from_vector(xs, {10});
  const auto rows_of = [](const mt::data::Element& e) { return e.inputs[0].to_vector<float>(); };

  SECTION("after batch(): a share of every batch; an uneven split and an empty share") {
    // Batches [0..3], [4..7], [8, 9]; 3 processes: a batch of 4 splits 1 + 1 + 2, one of 2
    // splits 0 + 1 + 1.
    const std::vector<std::vector<std::vector<float>>> want = {
        {{0}, {4}, {}}, {{1}, {5}, {8}}, {{2, 3}, {6, 7}, {9}}};
    for (std::int64_t p = 0; p < 3; ++p) {
      INFO("process " << p);
      for (const bool after_map : {false, true}) {
        auto ds = mt::data::Dataset::from_tensors(x, y);
        if (after_map)
          ds = ds.map(
              [](const mt::Tensor& a, const mt::Tensor& b) { return mt::data::Element(a, b); });
        ds = ds.batch(4).shard(p, 3);
        CHECK(ds.size() == 3);
        std::vector<std::vector<float>> got;
        std::vector<std::int64_t> whole;
        for (const auto& e : ds) {
          got.push_back(rows_of(e));
          whole.push_back(e.shard_of_rows);
          CHECK(e.share() == static_cast<double>(e.rows()) / static_cast<double>(e.shard_of_rows));
        }
        CHECK(got == want[static_cast<std::size_t>(p)]);
        CHECK(whole == std::vector<std::int64_t>{4, 4, 2});
      }
    }
  }
  SECTION("before batch(): a block of the epoch's elements") {
    // 10 elements on 3 processes: [0, 3), [3, 6), [6, 10).
    const auto ds = mt::data::Dataset::from_tensors(x, y).shard(1, 3).batch(2);
    CHECK(ds.size() == 2);
    std::vector<std::vector<float>> got;
    for (const auto& e : ds) {
      got.push_back(rows_of(e));
      CHECK(e.shard_of_rows == 0);
      CHECK(e.share() == 1.0);
    }
    CHECK(got == std::vector<std::vector<float>>{{3, 4}, {5}});
    CHECK(mt::data::Dataset::from_tensors(x, y).shard(2, 3).size() == 4);
    CHECK(mt::data::Dataset::from_tensors(x, y).shard(0, 3).str() ==
          "from_tensors(x float32 [10], y float32 [10]).shard(0, 3)");
  }
  SECTION("bad index or count: ValueError naming both") {
    const auto ds = mt::data::Dataset::from_tensors(x, y);
    CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] { ds.shard(3, 3); }),
               Catch::Contains("shard(3, 3)") && Catch::Contains("[0, count)"));
    CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] { ds.shard(-1, 2); }),
               Catch::Contains("shard(-1, 2)"));
    CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] { ds.shard(0, 0); }),
               Catch::Contains("count must be >= 1") && Catch::Contains("shard(0, 0)"));
  }
}

TEST_CASE("Dataset::shuffle_all: a new uniform order each epoch, repeatable by (seed, epoch)",
          "[dataset]") {
  std::vector<float> xs(50);
  std::iota(xs.begin(), xs.end(), 0.0f);
  const mt::Tensor x = mt::from_vector(xs, {50});
  const auto ds = mt::data::Dataset::from_tensors(x, x).shuffle_all(17);
  const std::vector<float> e0 = firsts(ds, 0), e1 = firsts(ds, 1);
  std::vector<float> sorted = e0;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == xs);  // a permutation
  CHECK(e0 != xs);
  CHECK(e0 != e1);
  CHECK(firsts(ds, 0) == e0);  // repeatable
  CHECK(firsts(mt::data::Dataset::from_tensors(x, x).shuffle_all(18), 0) != e0);
  // Of elements (after map), the same order as of row indices.
  const auto mapped =
      mt::data::Dataset::from_tensors(x, x)
          .map([](const mt::Tensor& a, const mt::Tensor& b) { return mt::data::Element(a, b); })
          .shuffle_all(17);
  CHECK(firsts(mapped, 1) == e1);
  // Batches of it: the rows in that order.
  std::vector<float> batched;
  for (const auto& e : ds.batch(8).epoch(1))
    for (float v : e.inputs[0].to_vector<float>()) batched.push_back(v);
  CHECK(batched == e1);
}

TEST_CASE("ProgbarLogger: fit's progress output, as a callback", "[training][fit]") {
  auto owned = compiled_model(4, 2);
  mt::Model& model = *owned;
  SECTION("the epoch lines") {
    mt::ProgbarLogger bar(2);
    const std::string out = stdout_of([&] {
      bar.set_params({.epochs = 3,
                      .steps = 2,
                      .samples = 100,
                      .verbose = 2,
                      .metric_keys = {"loss", "accuracy"}});
      bar.on_epoch_begin(model, 1);
      CHECK_FALSE(bar.wants_batch_logs());  // no bar to draw
      bar.on_batch_end(model, 0, {});
      bar.on_batch_end(model, 1, {{"loss", 0.5}, {"accuracy", 0.25}});
      bar.on_epoch_end(model, 1,
                       {{"loss", 0.5},
                        {"accuracy", 0.25},
                        {"val_loss", 0.75},
                        {"val_accuracy", 0.125},
                        {"loss_scale", 1024.0},
                        {"skipped_steps", 1.0}});
    });
    CHECK_THAT(out, Catch::StartsWith("Epoch 2/3\n2/2 - 0.0s - "));
    CHECK_THAT(out,
               Catch::EndsWith("us/sample - loss: 0.5000 - accuracy: 0.2500 - val_loss: 0.7500 - "
                               "val_accuracy: 0.1250 - loss_scale: 1024 - skipped_steps: 1\n"));
  }
  SECTION("fit adds one when verbose, first among the callbacks; none when silent") {
    const Data d = sample_data(30, 4, 2, 5);
    struct Marker : mt::Callback {
      void on_epoch_begin(mt::Model&, int epoch) override { std::printf("marker %d\n", epoch); }
    };
    const std::string printed = stdout_of([&] {
      model.fit(d.x, d.y,
                {.batch_size = 10,
                 .epochs = 2,
                 .seed = 1,
                 .verbose = 2,
                 .callbacks = {std::make_shared<Marker>()}});
    });
    CHECK_THAT(printed, Catch::StartsWith("Epoch 1/2\nmarker 0\n3/3 - "));
    CHECK_THAT(printed, Catch::Contains("\nEpoch 2/2\nmarker 1\n3/3 - "));
    CHECK_THAT(printed, Catch::Contains("us/sample - loss: "));
    const std::string silent =
        stdout_of([&] { model.fit(d.x, d.y, {.batch_size = 10, .epochs = 1, .verbose = 0}); });
    CHECK(silent.empty());
  }
  CHECK(mt::format_logs({{"loss", 0.123456}, {"loss_scale", 32768.0}, {"other", 1.0}},
                        {"loss_scale", "loss", "absent"}) == "loss_scale: 32768 - loss: 0.1235");
}

TEST_CASE("training_chain: the wrappers the policy and the job need, in their order",
          "[training][optim]") {
  auto adam = std::make_shared<mo::Adam>();
  SECTION("float32 on one process: the optimizer itself") {
    mt::PolicyScope scope("float32");
    CHECK(mo::training_chain(adam) == adam);
  }
  SECTION("mixed_float16: a LossScaleOptimizer around it; one given is kept") {
    mt::PolicyScope scope("mixed_float16");
    const auto chain = mo::training_chain(adam);
    REQUIRE(chain->loss_scale_optimizer() == chain.get());
    CHECK(&chain->loss_scale_optimizer()->inner_optimizer() == adam.get());
    auto own = std::make_shared<mo::LossScaleOptimizer>(std::make_shared<mo::SGD>(),
                                                        mt::LossScale::fixed(128));
    CHECK(mo::training_chain(own) == own);
    // The policy given wins over the global one.
    CHECK(mo::training_chain(std::make_shared<mo::SGD>(), {.policy = mt::Policy("float32")})
              ->loss_scale_optimizer() == nullptr);
  }
  SECTION("accumulation outermost, around the loss scale optimizer") {
    mt::PolicyScope scope("mixed_float16");
    const auto chain = mo::training_chain(adam, {.gradient_accumulation_steps = 3});
    CHECK(chain->name() == "GradientAccumulationOptimizer");
    REQUIRE(chain->loss_scale_optimizer() != nullptr);
    CHECK(&chain->loss_scale_optimizer()->inner_optimizer() == adam.get());
  }
  SECTION("bad input") {
    CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] {
                 mo::training_chain(adam, {.gradient_accumulation_steps = 0, .owner = "model 'm'"});
               }),
               Catch::Contains("model 'm': gradient_accumulation_steps must be >= 1; got 0"));
    CHECK_THAT(mixtape_test::error_of<mt::ValueError>([&] { mo::training_chain(nullptr); }),
               Catch::Contains("the optimizer is empty"));
  }
}

TEST_CASE("a wrapped optimizer refuses a step that would bypass its wrapper", "[training][optim]") {
  const Data d = sample_data(20, 4, 2, 6);
  auto adam = std::make_shared<mo::Adam>(mo::AdamOptions{.learning_rate = 0.01});
  std::unique_ptr<mt::Model> a;
  {
    mt::PolicyScope scope("mixed_float16");
    a = compiled_model(4, 2);
    a->compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
                .optimizer = adam});  // the model's chain: a LossScaleOptimizer around adam
  }
  auto owned_b = compiled_model(4, 2);
  mt::Model& b = *owned_b;
  b.compile({.loss = mt::losses::SparseCategoricalCrossentropy({.from_logits = true}),
             .optimizer = adam});  // the same object, on its own (float32)
  const auto before = weights_of(b);
  const std::string error = mixtape_test::error_of<mt::ValueError>(
      [&] { b.fit(d.x, d.y, {.batch_size = 10, .epochs = 1, .verbose = 0}); });
  CHECK_THAT(error, Catch::Contains("Adam: this optimizer is wrapped by a LossScaleOptimizer"));
  CHECK_THAT(error, Catch::Contains("clone()"));
  CHECK(weights_of(b) == before);  // nothing stepped
  CHECK(adam->iterations() == 0);

  // Through its wrapper it steps; a copy stands alone, and checks its gradients again.
  a->fit(d.x, d.y, {.batch_size = 10, .epochs = 1, .verbose = 0});
  const std::int64_t stepped = adam->iterations();
  CHECK(stepped >= 1);  // 2 batches (a step the loss scale skips is not counted)
  const std::shared_ptr<mo::Optimizer> copy = adam->clone();
  mt::Variable v(mt::from_vector(std::vector<float>{1.0f}, {1}), "v");
  const mt::Tensor nan = mt::from_vector(std::vector<float>{std::nanf("")}, {1});
  CHECK_THROWS_AS(copy->apply_gradients({nan}, {v}), mt::NumericError);
  // With the wrapper gone, the optimizer is its own again.
  a.reset();
  b.fit(d.x, d.y, {.batch_size = 10, .epochs = 1, .verbose = 0});
  CHECK(adam->iterations() == stepped + 2);
}
