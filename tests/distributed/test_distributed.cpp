// The data-parallel tests: CTest runs this program under `mpirun -np 2` (label distributed)
// and alone (world size 1). Every rank runs every test case, in the same order: each
// collective is called by all of them. The references need no communication: every rank
// computes one process's result on the whole batch itself, from the same seeded data.
#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <thread>

#include "mixtape/mixtape.h"
#include "tests/catch/run_session.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
namespace mo = mixtape::optim;
namespace md = mixtape::distributed;

namespace {

int world() { return md::world_size(); }
int me() { return md::rank(); }

// Rank r's rows [begin, end) of `rows` (as fit splits a global batch).
std::pair<std::int64_t, std::int64_t> share(std::int64_t rows) {
  return {rows * me() / world(), rows * (me() + 1) / world()};
}

// The largest |a - b| / (1 + |b|) over two tensors.
double max_rel_diff(const mt::Tensor& a, const mt::Tensor& b) {
  const auto va = a.to_vector<double>(), vb = b.to_vector<double>();
  REQUIRE(va.size() == vb.size());
  double worst = 0.0;
  for (std::size_t i = 0; i < va.size(); ++i)
    worst = std::max(worst, std::abs(va[i] - vb[i]) / (1.0 + std::abs(vb[i])));
  return worst;
}

// Whether every rank passed the same value.
bool same_on_all_ranks(double v) {
  return md::all_reduce_value(v, md::ReduceOp::Max) == md::all_reduce_value(v, md::ReduceOp::Min);
}

std::unique_ptr<mt::Model> small_model(std::uint64_t seed, mt::DType dtype) {
  mt::manual_seed(seed);
  mt::PolicyScope policy(mt::Policy(std::string(dtype.name())));
  std::unique_ptr<mt::Model> model = std::make_unique<mt::Sequential>(
      std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(16, {.activation = "tanh"}),
                                           ml::Dense(8, {.activation = "tanh"}), ml::Dense(3)});
  (*model)(mt::zeros({1, 5}, dtype));  // build
  return model;
}

}  // namespace

TEST_CASE("distributed: all_reduce, broadcast and all_gather on every floating dtype",
          "[distributed]") {
  const int n = world();
  for (mt::DType dt : {mt::kFloat32, mt::kFloat64, mt::kFloat16, mt::kBFloat16}) {
    CAPTURE(dt.name());
    mt::manual_seed(7);
    const mt::Tensor base = mt::uniform({4, 5}, 0.5, 2.0, dt);  // the same on every rank
    const double tol = dt == mt::kFloat16 ? 2e-3 : dt == mt::kBFloat16 ? 1.6e-2 : 1e-6;
    mt::Tensor t = base * static_cast<double>(me() + 1);
    md::all_reduce(t, md::ReduceOp::Sum);
    CHECK(max_rel_diff(t, base * (n * (n + 1) / 2.0)) < tol);
    t = base * static_cast<double>(me() + 1);
    md::all_reduce(t, md::ReduceOp::Average);
    CHECK(max_rel_diff(t, base * ((n + 1) / 2.0)) < tol);
    t = base * static_cast<double>(me() + 1);
    md::all_reduce(t, md::ReduceOp::Max);
    CHECK(max_rel_diff(t, base * static_cast<double>(n)) < tol);
    t = base * static_cast<double>(me() + 1);
    md::all_reduce(t, md::ReduceOp::Min);
    CHECK(max_rel_diff(t, base) < tol);

    mt::Tensor b = base * static_cast<double>(me() + 1);
    md::broadcast(b, n - 1);
    CHECK(max_rel_diff(b, base * static_cast<double>(n)) == 0.0);

    const mt::Tensor gathered = md::all_gather(mt::full({2, 3}, me() + 1.0, dt));
    REQUIRE(gathered.shape() == mt::Shape{2 * n, 3});
    const auto g = gathered.to_vector<double>();
    for (int r = 0; r < n; ++r)
      for (int k = 0; k < 6; ++k) CHECK(g[static_cast<std::size_t>(r * 6 + k)] == r + 1.0);
  }
  mt::Tensor counts = mt::from_vector<std::int64_t>({me() + 1, 10}, {2});
  md::all_reduce(counts);
  CHECK(counts.to_vector<std::int64_t>() == std::vector<std::int64_t>{n * (n + 1) / 2, 10 * n});
  CHECK(md::all_reduce_values({1.0, me() + 0.0}) ==
        std::vector<double>{static_cast<double>(n), n * (n - 1) / 2.0});

  mt::Tensor flags = mt::zeros({3}, mt::kBool);
  CHECK_THROWS_AS(md::all_reduce(flags), mt::DTypeError);
  CHECK_THROWS_AS(md::all_reduce(counts, md::ReduceOp::Average), mt::DTypeError);
  mt::Tensor x = mt::zeros({3});
  CHECK_THROWS_AS(md::broadcast(x, n), mt::ValueError);
  mt::Tensor strided = mt::zeros({4, 4}).transpose();
  CHECK_THROWS_AS(md::all_reduce(strided), mt::ValueError);
}

TEST_CASE("distributed: mismatches across ranks are errors on every rank", "[distributed]") {
  CHECK_THROWS_AS(md::init(), mt::DistributedError);  // a second time
  if (world() == 1) return;
  mt::Tensor t = mt::zeros({3 + me()});
  const std::string message = [&] {
    try {
      md::all_reduce(t);
    } catch (const mt::DistributedError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  }();
  CHECK_THAT(message, Catch::Contains("different shapes or dtypes"));
  mt::Tensor d = mt::zeros({3}, me() == 0 ? mt::kFloat32 : mt::kFloat64);
  CHECK_THROWS_AS(md::broadcast(d), mt::DistributedError);
  try {
    md::check_same_on_all_ranks("model 'm'", me() == 0 ? "2 weights" : "3 weights");
    FAIL("no error");
  } catch (const mt::DistributedError& e) {
    CHECK_THAT(e.what(), Catch::Contains("rank 1 differs from rank 0") &&
                             Catch::Contains("first at '2 weights' (rank 0) against '3 weights' "
                                             "(rank 1)") &&
                             Catch::Contains("rank 0 has 2 weights") &&
                             Catch::Contains("rank 1 has 3 weights"));
  }
  // The communicator still works after the errors.
  mt::Tensor ok = mt::ones({2});
  md::all_reduce(ok);
  CHECK(ok.to_vector<double>() == std::vector<double>{2.0 * world() / 2, 2.0 * world() / 2});
}

// Several steps of Adam: every rank on its share of each global batch through a
// DistributedOptimizer, against one process on the whole batch (computed on every rank).
TEST_CASE("distributed: N ranks on shares of the batch step like one process on all of it",
          "[distributed]") {
  for (mt::DType dt : {mt::kFloat64, mt::kFloat32}) {
    for (bool loss_scaled : {false, true}) {
      for (bool overlap : {false, true}) {
        CAPTURE(dt.name(), loss_scaled, overlap);
        auto dist_model = small_model(11, dt), ref_model = small_model(11, dt);
        std::shared_ptr<mo::Optimizer> inner =
            std::make_shared<mo::Adam>(mo::AdamOptions{.learning_rate = 1e-2});
        if (loss_scaled)
          inner = std::make_shared<mo::LossScaleOptimizer>(inner, mt::LossScale::dynamic());
        // Small buckets: several per step, started as the backward pass finishes them.
        mo::DistributedOptimizer dist(inner, {.bucket_bytes = 200});
        mo::Adam ref({.learning_rate = 1e-2});
        const auto mse = mt::losses::MeanSquaredError();
        mt::manual_seed(99);
        for (int step = 0; step < 5; ++step) {
          const std::int64_t rows = 7 + step;  // uneven shares
          const mt::Tensor x = mt::uniform({rows, 5}, -1.0, 1.0, dt);
          const mt::Tensor y = mt::uniform({rows, 3}, -1.0, 1.0, dt);
          {  // the reference: one process, the whole batch
            mt::GradientTape tape;
            const mt::Tensor loss = mse(y, (*ref_model)(x, {.training = true}));
            ref.apply_gradients(tape.gradient(loss, ref_model->trainable_variables()),
                                ref_model->trainable_variables());
          }
          const auto [r0, r1] = share(rows);
          const mt::Tensor xs = x.slice(0, r0, r1), ys = y.slice(0, r0, r1);
          dist.set_gradient_weight(static_cast<double>(r1 - r0) / static_cast<double>(rows));
          mt::GradientTape tape;
          mt::Tensor loss = mse(ys, (*dist_model)(xs, {.training = true}));
          if (loss_scaled) loss = dist.get_scaled_loss(loss);
          const auto vars = dist_model->trainable_variables();
          std::vector<mt::Tensor> grads =
              overlap ? dist.gradient(tape, loss, vars) : tape.gradient(loss, vars);
          if (loss_scaled) grads = dist.get_unscaled_gradients(grads);
          dist.apply_gradients(grads, vars);
          if (world() > 1) CHECK(dist.last_bucket_bytes().size() > 1);
        }
        const auto dw = dist_model->weights(), rw = ref_model->weights();
        const double tol = dt == mt::kFloat64 ? 1e-12 : 1e-5;
        for (std::size_t i = 0; i < dw.size(); ++i) {
          CAPTURE(dw[i].name());
          CHECK(max_rel_diff(dw[i], rw[i]) < tol);
          CHECK(same_on_all_ranks(mt::sum(dw[i]).item<double>()));
        }
        CHECK(dist.iterations() == 5);
      }
    }
  }
}

TEST_CASE("distributed: compute_gradients steps like one process, in either nesting",
          "[distributed]") {
  // The chain does the loss scaling and the reduction whatever order the wrappers are in:
  // the caller's step is the same four lines.
  for (int nesting = 0; nesting < 3; ++nesting) {
    CAPTURE(nesting);  // 0: Dist(Adam); 1: Dist(LSO(Adam)); 2: LSO(Dist(Adam))
    auto dist_model = small_model(13, mt::kFloat32), ref_model = small_model(13, mt::kFloat32);
    const auto adam = std::make_shared<mo::Adam>(mo::AdamOptions{.learning_rate = 1e-2});
    std::shared_ptr<mo::Optimizer> chain;
    if (nesting == 0) chain = std::make_shared<mo::DistributedOptimizer>(adam);
    if (nesting == 1)
      chain = std::make_shared<mo::DistributedOptimizer>(
          std::make_shared<mo::LossScaleOptimizer>(adam, mt::LossScale::fixed(1024)));
    if (nesting == 2)
      chain = std::make_shared<mo::LossScaleOptimizer>(
          std::make_shared<mo::DistributedOptimizer>(
              adam, mo::DistributedOptimizerOptions{.bucket_bytes = 200}),
          mt::LossScale::fixed(1024));
    REQUIRE(chain->distributed_optimizer() != nullptr);
    CHECK((chain->loss_scale_optimizer() != nullptr) == (nesting > 0));
    mo::Adam ref({.learning_rate = 1e-2});
    const auto mse = mt::losses::MeanSquaredError();
    mt::manual_seed(98);
    for (int step = 0; step < 4; ++step) {
      const std::int64_t rows = step == 0 ? 1 : 6 + step;  // step 0: rank 0's share is empty
      const mt::Tensor x = mt::uniform({rows, 5}, -1.0, 1.0);
      const mt::Tensor y = mt::uniform({rows, 3}, -1.0, 1.0);
      {
        mt::GradientTape tape;
        const mt::Tensor loss = mse(y, (*ref_model)(x, {.training = true}));
        ref.apply_gradients(tape.gradient(loss, ref_model->trainable_variables()),
                            ref_model->trainable_variables());
      }
      const auto [r0, r1] = share(rows);
      chain->distributed_optimizer()->set_gradient_weight(static_cast<double>(r1 - r0) /
                                                          static_cast<double>(rows));
      const auto vars = dist_model->trainable_variables();
      mt::GradientTape tape;
      mt::Tensor loss;  // undefined: no samples here this step
      if (r1 > r0)
        loss = mse(y.slice(0, r0, r1), (*dist_model)(x.slice(0, r0, r1), {.training = true}));
      chain->apply_gradients(chain->compute_gradients(tape, loss, vars), vars);
    }
    const auto dw = dist_model->weights(), rw = ref_model->weights();
    for (std::size_t i = 0; i < dw.size(); ++i) {
      CAPTURE(dw[i].name());
      CHECK(max_rel_diff(dw[i], rw[i]) < 1e-5);
      CHECK(same_on_all_ranks(mt::sum(dw[i]).item<double>()));
    }
    CHECK(chain->iterations() == 4);
  }
}

TEST_CASE("distributed: ranks that disagree throw together instead of corrupting memory",
          "[distributed]") {
  if (world() == 1) return;  // needs ranks that can disagree
  // Host values of different counts.
  std::vector<double> values(me() == 0 ? 3 : 5, 1.0);
  CHECK_THROWS_WITH(md::all_reduce_values(values),
                    Catch::Contains("all_reduce_values: the ranks pass different numbers of "
                                    "values") &&
                        Catch::Contains("from 3 to 5"));
  // Different calls at the same time (one rank's epoch ended, the other's did not).
  std::vector<float> bucket(16, 1.0f);
  const auto mismatched = [&] {
    if (me() == 0)
      md::all_reduce_values({1.0, 2.0, 3.0});
    else
      md::sum_host_buffer(bucket.data(), bucket.size(), mt::kFloat32);
  };
  CHECK_THROWS_WITH(mismatched(), Catch::Contains("the ranks are not in the same collective call"));
  // Different models through a DistributedOptimizer: its buckets differ. (Every rank makes
  // the same default-named layers, so that the default names of later tests agree.)
  std::unique_ptr<mt::Model> model = small_model(3, mt::kFloat32);
  if (me() != 0) {
    auto other = std::make_unique<mt::Sequential>(
        std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(4, {.name = "other"})},
        mt::ModelOptions{.name = "other_model"});
    (*other)(mt::zeros({1, 5}));
    model = std::move(other);
  }
  mo::DistributedOptimizer dist(mo::SGD({.learning_rate = 0.1}));
  const auto vars = model->trainable_variables();
  const auto before = vars.front().to_vector<float>();
  mt::GradientTape tape;
  const mt::Tensor loss = mt::mean(mt::square((*model)(mt::ones({2, 5}))));
  CHECK_THROWS_WITH(dist.apply_gradients(dist.compute_gradients(tape, loss, vars), vars),
                    Catch::Contains("the ranks pass different numbers of float32 values"));
  CHECK(vars.front().to_vector<float>() == before);  // nothing changed
  // The ranks still talk: a collective that agrees works afterwards.
  CHECK(md::all_reduce_value(1.0) == world());
}

TEST_CASE("distributed: compile makes the ranks agree: rank 0's weights, the same options",
          "[distributed]") {
  // Different seeds: rank 0's initial weights win.
  auto model = small_model(100 + static_cast<std::uint64_t>(me()), mt::kFloat32);
  model->compile(
      {.loss = mt::losses::MeanSquaredError(), .optimizer = mo::Adam({.learning_rate = 1e-3})});
  for (const auto& w : model->weights()) CHECK(same_on_all_ranks(mt::sum(w).item<double>()));
  if (world() == 1) return;
  // A learning rate, a policy that differ: every rank throws, naming compile.
  auto other = small_model(7, mt::kFloat32);
  const auto before = other->weights().front().to_vector<float>();
  CHECK_THROWS_WITH(
      other->compile({.loss = mt::losses::MeanSquaredError(),
                      .optimizer = mo::Adam({.learning_rate = me() == 0 ? 1e-3 : 2e-3})}),
      Catch::Contains("compile: the ranks compile differently") &&
          Catch::Contains("rank 1 differs from rank 0"));
  CHECK_FALSE(other->compiled());
  CHECK(other->weights().front().to_vector<float>() == before);
  {
    mt::PolicyScope policy(me() == 0 ? "float32" : "mixed_float16");
    mt::Sequential m({ml::Dense(3)});
    m(mt::zeros({1, 5}));
    CHECK_THROWS_WITH(m.compile({.loss = mt::losses::MeanSquaredError(), .optimizer = "sgd"}),
                      Catch::Contains("the ranks compile differently") &&
                          Catch::Contains("policy float32") &&
                          Catch::Contains("policy mixed_float16"));
  }
}

TEST_CASE("distributed: fit on ranks given different data or options stops every rank",
          "[distributed]") {
  if (world() == 1) return;
  auto model = small_model(3, mt::kFloat32);
  model->compile({.loss = mt::losses::MeanSquaredError(), .optimizer = "sgd"});
  const auto before = model->weights().front().to_vector<float>();
  mt::manual_seed(21);
  const mt::Tensor x = mt::normal({64, 5}), y = mt::normal({64, 3});
  // Another global batch size on rank 1: both ranks throw before the first step, naming it.
  CHECK_THROWS_WITH(
      model->fit({x}, {y}, {.batch_size = me() == 0 ? 16 : 8, .epochs = 1, .verbose = 0}),
      Catch::Contains("the ranks were given different data or options") &&
          Catch::Contains("first at 'batches of 16' (rank 0) against 'batches of 8' (rank 1)"));
  // Another number of samples; another number of epochs through a Dataset.
  const mt::Tensor x_rank = me() == 0 ? x : x.slice(0, 0, 48),
                   y_rank = me() == 0 ? y : y.slice(0, 0, 48);
  CHECK_THROWS_WITH(
      model->fit({x_rank}, {y_rank}, {.batch_size = 16, .verbose = 0}),
      Catch::Contains("first at '64 samples' (rank 0) against '48 samples' (rank 1)"));
  const auto data = mt::data::Dataset::from_tensors(x, y).batch(16).shard(me(), world());
  CHECK_THROWS_WITH(model->fit(data, {.epochs = me() == 0 ? 2 : 3, .verbose = 0}),
                    Catch::Contains("first at 'epochs 0 to 2' (rank 0) against 'epochs 0 to 3'"));
  CHECK(model->weights().front().to_vector<float>() == before);  // nothing trained
  // The same on every rank: it trains.
  model->fit(data, {.epochs = 1, .verbose = 0});
  CHECK(model->weights().front().to_vector<float>() != before);
}

TEST_CASE("distributed: an overflow on one rank makes every rank skip and halve its scale",
          "[distributed]") {
  auto model = small_model(5, mt::kFloat32);
  mo::DistributedOptimizer dist(mo::LossScaleOptimizer(mo::SGD(), mt::LossScale::dynamic()));
  mo::LossScaleOptimizer& lso = *dist.loss_scale_optimizer();
  const double scale = lso.loss_scale();
  const auto vars = model->trainable_variables();
  const auto before = vars.front().to_vector<float>();
  std::vector<mt::Tensor> grads;
  for (const auto& v : vars) grads.push_back(mt::ones_like(v));
  if (me() == world() - 1)  // the last rank alone overflows
    grads[1] = mt::full_like(grads[1], std::numeric_limits<double>::infinity());
  dist.apply_gradients(dist.get_unscaled_gradients(grads), vars);
  CHECK(lso.skipped_steps() == 1);
  CHECK(lso.loss_scale() == scale / 2);
  CHECK(vars.front().to_vector<float>() == before);
  CHECK(same_on_all_ranks(lso.loss_scale()));
  // The next, finite step applies on every rank.
  grads.assign(vars.size(), mt::Tensor());
  for (std::size_t i = 0; i < vars.size(); ++i) grads[i] = mt::ones_like(vars[i]);
  dist.apply_gradients(dist.get_unscaled_gradients(grads), vars);
  CHECK(lso.applied_steps() == 1);
  CHECK(vars.front().to_vector<float>() != before);
}

TEST_CASE("distributed: a gradient no rank has stays undefined; one some ranks have is summed",
          "[distributed]") {
  mt::Variable a(mt::ones({3}), "a"), b(mt::ones({2}), "b"), c(mt::ones({4}), "c");
  mo::DistributedOptimizer dist(mo::SGD({.learning_rate = 1.0}));
  // a: every rank has a gradient; b: none; c: the last rank alone.
  std::vector<mt::Tensor> grads{mt::full({3}, 1.0), mt::Tensor(),
                                me() == world() - 1 ? mt::full({4}, 2.0) : mt::Tensor()};
  dist.set_gradient_weight(1.0);  // sums
  const std::vector<mt::Tensor> out = dist.all_reduce_gradients(grads, {a, b, c});
  REQUIRE(out[0].defined());
  CHECK(out[0].to_vector<double>() == std::vector<double>(3, world()));
  CHECK_FALSE(out[1].defined());
  REQUIRE(out[2].defined());
  CHECK(out[2].to_vector<double>() == std::vector<double>(4, 2.0));
  dist.apply_gradients(out, {a, b, c});  // reduced already: SGD steps on the sums
  CHECK(a.to_vector<double>() == std::vector<double>(3, 1.0 - world()));
  CHECK(b.to_vector<double>() == std::vector<double>(2, 1.0));  // no gradient: unchanged
  CHECK(c.to_vector<double>() == std::vector<double>(4, -1.0));
}

TEST_CASE("distributed: fit on N ranks trains like one process; rank 0 writes the checkpoint",
          "[distributed]") {
  mt::PolicyScope policy(mt::Policy("float64"));
  auto model = small_model(3, mt::kFloat64), ref_model = small_model(3, mt::kFloat64);
  model->compile({.loss = "mse", .optimizer = mo::Adam({.learning_rate = 1e-2})});
  if (world() > 1) CHECK(model->optimizer()->name() == "DistributedOptimizer");
  mt::manual_seed(21);
  // 19 samples in batches of 6: the last batch has 1 row, so on 2 ranks rank 0's share of
  // it is empty (it still joins the step's reduction).
  const std::int64_t n = 19;
  const mt::Tensor x = mt::uniform({n, 5}, -1.0, 1.0, mt::kFloat64);
  const mt::Tensor y = mt::uniform({n, 3}, -1.0, 1.0, mt::kFloat64);
  // Rank 1 starts from other weights: fit broadcasts rank 0's.
  if (me() == 1)
    model->trainable_variables().front().assign(
        mt::zeros_like(model->trainable_variables().front()));
  const std::filesystem::path dir = std::filesystem::current_path() / "fit-checkpoint";
  if (me() == 0) std::filesystem::create_directories(dir);
  md::barrier();
  auto checkpoint = std::make_shared<mt::ModelCheckpoint>(
      mt::ModelCheckpoint::Options{.filepath = (dir / "epoch{epoch}.safetensors").string()});
  const mt::History h = model->fit(
      x, y,
      {.batch_size = 6, .epochs = 2, .shuffle = false, .verbose = 0, .callbacks = {checkpoint}});

  mo::Adam ref({.learning_rate = 1e-2});
  const auto mse = mt::losses::MeanSquaredError();
  double ref_loss_sum = 0.0;
  for (int epoch = 0; epoch < 2; ++epoch) {
    ref_loss_sum = 0.0;
    for (std::int64_t b0 = 0; b0 < n; b0 += 6) {
      const std::int64_t b1 = std::min<std::int64_t>(n, b0 + 6);
      mt::GradientTape tape;
      const mt::Tensor loss =
          mse(y.slice(0, b0, b1), (*ref_model)(x.slice(0, b0, b1), {.training = true}));
      ref_loss_sum += loss.item<double>() * static_cast<double>(b1 - b0);
      ref.apply_gradients(tape.gradient(loss, ref_model->trainable_variables()),
                          ref_model->trainable_variables());
    }
  }
  const auto w = model->weights(), rw = ref_model->weights();
  for (std::size_t i = 0; i < w.size(); ++i) CHECK(max_rel_diff(w[i], rw[i]) < 1e-12);
  // The logged loss is the mean over every rank's rows: one process's number.
  CHECK(h.last("loss") == Approx(ref_loss_sum / static_cast<double>(n)).epsilon(1e-12));

  md::barrier();  // rank 0 has written both files
  const mt::SafetensorsFile file = mt::load_safetensors((dir / "epoch2.safetensors").string());
  for (const auto& weight : w)
    CHECK(max_rel_diff(file.at("model/" + weight.name()), weight) == 0.0);
  md::barrier();
  if (me() == 0) std::filesystem::remove_all(dir);

  if (world() > 1) {
    // A global batch smaller than the world cannot be shared.
    CHECK_THROWS_AS(model->fit(x, y, {.batch_size = world() - 1, .verbose = 0}), mt::ValueError);
    // Ranks holding different models are caught before the first step: by compile, which
    // compares them (and fit again, for a model compiled before the ranks differed).
    auto other = me() == 0 ? small_model(3, mt::kFloat64)
                           : std::unique_ptr<mt::Model>(std::make_unique<mt::Sequential>(
                                 std::vector<ml::LayerPtr<ml::Layer>>{ml::Dense(3)}));
    (*other)(mt::zeros({1, 5}, mt::kFloat64));
    try {
      other->compile({.loss = "mse", .optimizer = "adam"});
      other->fit(x, y, {.batch_size = 6, .verbose = 0});
      FAIL("no error");
    } catch (const mt::DistributedError& e) {
      CHECK_THAT(e.what(), Catch::Contains("the ranks compile differently") &&
                               Catch::Contains("rank 0 has 6 weights") &&
                               Catch::Contains("rank 1 has 2 weights"));
    }
  }
}

// Hidden: run by distributed.killed_rank (tests/distributed/killed_rank.cmake). The last rank
// dies by SIGKILL in the middle of training; the others are in a collective.
TEST_CASE("distributed: a rank killed mid-training", "[.kill]") {
  auto model = small_model(1, mt::kFloat32);
  mo::DistributedOptimizer dist(mo::SGD{});
  const auto vars = model->trainable_variables();
  for (int step = 0; step < 600; ++step) {
    if (step == 5 && me() == world() - 1) std::raise(SIGKILL);
    std::vector<mt::Tensor> grads;
    for (const auto& v : vars) grads.push_back(mt::ones_like(v));
    dist.apply_gradients(grads, vars);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

int main(int argc, char** argv) {
  mixtape::distributed::init();
  // Every rank runs (and reports) the same cases; the exit status is 1 on every rank when
  // a case failed on any of them.
  const int failed = mixtape_tests::run_session(argc, argv);
  const double worst = md::all_reduce_value(failed, md::ReduceOp::Max);
  return worst > 0 ? 1 : 0;
}
