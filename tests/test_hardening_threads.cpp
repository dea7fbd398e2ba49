// Hardening of the dtype policy under threads (issue 18, item 13): PolicyScope is a
// per-thread override of the process default that set_global_policy sets, so two threads
// building layers in their own scopes each get their own policy, and scopes interleaved
// across threads restore what they should. The two-thread training test at the end is the
// one the ThreadSanitizer build runs (docs/building.md, "ThreadSanitizer build"): tagged
// [threads], and run with OMP_NUM_THREADS=1 there.
#include <atomic>
#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <latch>
#include <string>
#include <thread>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;

namespace {

// Restores the process default policy at the end of a test.
struct DefaultPolicyGuard {
  mt::Policy saved = mt::global_policy();
  ~DefaultPolicyGuard() { mt::set_global_policy(saved); }
};

// Bitwise equality of two tensors (same dtype, shape and bytes).
bool same_bits(const mt::Tensor& a, const mt::Tensor& b) {
  if (a.dtype() != b.dtype() || a.shape() != b.shape()) return false;
  const mt::Tensor ac = mt::contiguous(a), bc = mt::contiguous(b);
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.nbytes()) == 0;
}

}  // namespace

// --- The policy: per-thread scopes over a process default --------------------------------

TEST_CASE("PolicyScope: two threads building many layers each get their own policy",
          "[threads][policy]") {
  DefaultPolicyGuard guard;
  constexpr int kLayers = 2000;
  std::latch entered(2);  // both scopes are open before either thread builds a layer
  std::atomic<int> wrong_a{0}, wrong_b{0};
  auto worker = [&](const char* policy, std::atomic<int>& wrong) {
    mt::PolicyScope scope(policy);
    entered.arrive_and_wait();
    for (int i = 0; i < kLayers; ++i) {
      auto dense = mt::layers::Dense(4);
      if (dense->dtype_policy().name() != policy) ++wrong;
    }
  };
  std::thread a(worker, "mixed_float16", std::ref(wrong_a));
  std::thread b(worker, "float32", std::ref(wrong_b));
  a.join();
  b.join();
  INFO("layers with the other thread's policy: " << wrong_a.load() << " (mixed_float16 thread), "
                                                 << wrong_b.load() << " (float32 thread)");
  CHECK(wrong_a == 0);
  CHECK(wrong_b == 0);
  CHECK(mt::global_policy() == guard.saved);
}

TEST_CASE("PolicyScope: scopes interleaved across threads restore correctly", "[threads][policy]") {
  DefaultPolicyGuard guard;
  mt::set_global_policy("float32");
  // Thread a opens its scope, then b; a closes first, then b (not nested in time).
  std::latch a_open(1), b_open(1), a_closed(1);
  std::string a_inside, a_after_b_opened, b_inside, b_after_a_closed, a_after_close;
  std::thread a([&] {
    {
      mt::PolicyScope scope("mixed_float16");
      a_inside = mt::global_policy().name();
      a_open.count_down();
      b_open.wait();
      a_after_b_opened = mt::layers::Dense(2)->dtype_policy().name();
    }
    a_after_close = mt::global_policy().name();
    a_closed.count_down();
  });
  std::thread b([&] {
    a_open.wait();
    {
      mt::PolicyScope scope("bfloat16");
      b_inside = mt::global_policy().name();
      b_open.count_down();
      a_closed.wait();
      b_after_a_closed = mt::layers::Dense(2)->dtype_policy().name();
    }
  });
  a.join();
  b.join();
  CHECK(a_inside == "mixed_float16");
  CHECK(a_after_b_opened == "mixed_float16");
  CHECK(b_inside == "bfloat16");
  CHECK(b_after_a_closed == "bfloat16");
  CHECK(a_after_close == "float32");
  // Repeated: the default is what it was before either scope.
  CHECK(mt::global_policy().name() == "float32");
  for (int run = 0; run < 20; ++run) {
    std::latch start(2);
    auto scoped = [&](const char* name) {
      start.arrive_and_wait();
      for (int i = 0; i < 50; ++i) mt::PolicyScope scope(name);
    };
    std::thread x(scoped, "mixed_float16"), y(scoped, "float64");
    x.join();
    y.join();
    INFO("run " << run);
    REQUIRE(mt::global_policy().name() == "float32");
  }
}

TEST_CASE("set_global_policy: the process default, seen by threads without a scope",
          "[threads][policy]") {
  DefaultPolicyGuard guard;
  mt::set_global_policy("float32");
  std::latch scoped(1), set(1);
  std::string in_scope, without_scope;
  std::thread a([&] {
    mt::PolicyScope scope("mixed_bfloat16");
    scoped.count_down();
    set.wait();
    in_scope = mt::layers::Dense(2)->dtype_policy().name();  // its scope wins
  });
  scoped.wait();
  mt::set_global_policy("mixed_float16");  // the process default, from this thread
  set.count_down();
  a.join();
  std::thread b([&] { without_scope = mt::layers::Dense(2)->dtype_policy().name(); });
  b.join();
  CHECK(in_scope == "mixed_bfloat16");
  CHECK(without_scope == "mixed_float16");
  CHECK(mt::global_policy().name() == "mixed_float16");

  // A thread started inside a scope does not inherit it: it starts at the process default.
  std::string child;
  {
    mt::PolicyScope scope("float64");
    std::thread c([&] { child = mt::global_policy().name(); });
    c.join();
    CHECK(mt::global_policy().name() == "float64");
  }
  CHECK(child == "mixed_float16");
}

TEST_CASE("set_global_policy inside a PolicyScope changes that scope until it ends",
          "[threads][policy]") {
  DefaultPolicyGuard guard;
  mt::set_global_policy("float32");
  {
    mt::PolicyScope outer("mixed_float16");
    {
      mt::PolicyScope inner("bfloat16");
      mt::set_global_policy("float64");
      CHECK(mt::global_policy().name() == "float64");
      CHECK(mt::layers::Dense(2)->dtype_policy().name() == "float64");
    }
    CHECK(mt::global_policy().name() == "mixed_float16");
  }
  CHECK(mt::global_policy().name() == "float32");
  // Without a scope it sets the process default, as before.
  mt::set_global_policy("mixed_bfloat16");
  CHECK(mt::global_policy().name() == "mixed_bfloat16");
}

// --- Two threads training at once (the ThreadSanitizer test) ----------------------------

namespace {

struct TrainResult {
  std::vector<std::string> policies;  // each layer's policy name
  std::vector<mt::Tensor> fit_weights, loop_weights;
  double fit_loss = 0.0;
};

// Two classes around +1 and -1 in 8 dimensions, from a generator of its own.
std::pair<mt::Tensor, mt::Tensor> make_data(std::int64_t n, std::uint64_t seed) {
  mt::Generator gen(seed);
  std::vector<double> xs;
  std::vector<std::int64_t> ys;
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t label = static_cast<std::int64_t>(gen.next_u64() % 2);
    ys.push_back(label);
    for (int d = 0; d < 8; ++d) xs.push_back((label ? 1.0 : -1.0) + 0.5 * gen.next_normal());
  }
  return {mt::from_vector(xs, {n, 8}), mt::from_vector(ys, {n})};
}

// Builds a small model under `policy` (a PolicyScope of this thread), trains it for a few
// steps of fit, then a few steps of a GradientTape loop. Every random draw has an explicit
// seed (initializers, data, fit's shuffling), so the run is repeatable on any thread.
TrainResult train(const char* policy, std::uint64_t seed) {
  mt::PolicyScope scope(policy);
  mt::Sequential model({
      mt::layers::Dense(
          16, {.activation = "relu", .kernel_initializer = mt::init::glorot_uniform(seed)}),
      mt::layers::Dense(2, {.kernel_initializer = mt::init::glorot_uniform(seed + 1)}),
      mt::layers::Activation("softmax", {.dtype = "float32"}),
  });
  TrainResult r;
  for (const auto& layer : model.layers()) r.policies.push_back(layer->dtype_policy().name());
  const auto [x, y] = make_data(128, seed + 2);
  model.compile({.loss = mt::losses::SparseCategoricalCrossentropy(),
                 .optimizer = mt::optim::SGD({.learning_rate = 0.1})});
  const mt::History h =
      model.fit(x, y, {.batch_size = 32, .epochs = 2, .seed = seed, .verbose = 0});
  r.fit_loss = h.last("loss");
  r.fit_weights = model.get_weights();

  mt::optim::SGD opt({.learning_rate = 0.05});
  auto loss_fn = mt::losses::SparseCategoricalCrossentropy();
  for (std::int64_t b = 0; b < 128; b += 32) {
    const mt::Tensor xb = x.slice(0, b, b + 32), yb = y.slice(0, b, b + 32);
    mt::GradientTape tape;
    const mt::Tensor loss = loss_fn(yb, model(xb, {.training = true}));
    const auto vars = model.trainable_variables();
    opt.apply_gradients(tape.gradient(loss, vars), vars);
  }
  r.loop_weights = model.get_weights();
  return r;
}

void check_same(const TrainResult& got, const TrainResult& alone, const char* policy) {
  INFO("policy " << policy);
  CHECK(got.policies == alone.policies);
  CHECK(got.fit_loss == alone.fit_loss);
  REQUIRE(got.fit_weights.size() == alone.fit_weights.size());
  REQUIRE(got.loop_weights.size() == alone.loop_weights.size());
  for (std::size_t i = 0; i < alone.fit_weights.size(); ++i) {
    INFO("weight " << i);
    CHECK(same_bits(got.fit_weights[i], alone.fit_weights[i]));
    CHECK(same_bits(got.loop_weights[i], alone.loop_weights[i]));
  }
}

}  // namespace

TEST_CASE("two threads train a mixed_float16 and a float32 model at the same time",
          "[threads][tsan]") {
  DefaultPolicyGuard guard;
  // Each run alone first, on this thread.
  const TrainResult mixed_alone = train("mixed_float16", 11);
  const TrainResult fp32_alone = train("float32", 23);
  REQUIRE(mixed_alone.policies ==
          std::vector<std::string>{"mixed_float16", "mixed_float16", "float32"});
  REQUIRE(fp32_alone.policies == std::vector<std::string>{"float32", "float32", "float32"});
  REQUIRE(mixed_alone.fit_weights[0].dtype() == mt::kFloat32);  // mixed: float32 variables

  // Then both at once, started together.
  TrainResult mixed, fp32;
  std::latch start(2);
  std::thread a([&] {
    start.arrive_and_wait();
    mixed = train("mixed_float16", 11);
  });
  std::thread b([&] {
    start.arrive_and_wait();
    fp32 = train("float32", 23);
  });
  a.join();
  b.join();
  check_same(mixed, mixed_alone, "mixed_float16");
  check_same(fp32, fp32_alone, "float32");
  CHECK(mt::global_policy() == guard.saved);
}
