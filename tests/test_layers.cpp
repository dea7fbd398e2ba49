// Layers and models: the guide's model, building, names, weights, errors, each layer's
// behaviour, and gradient checks of every layer in float64.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;

namespace {

mt::Tensor random(const mt::Shape& shape, mt::DType dt, std::uint64_t seed, double lo = -1.0,
                  double hi = 1.0) {
  mt::Generator gen(seed);
  return mt::uniform(shape, lo, hi, dt, mt::Device::cpu(), &gen);
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const mt::Error& e) {
    return e.what();
  }
  return "(no exception)";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

double max_abs_diff(const mt::Tensor& a, const mt::Tensor& b) {
  const auto av = a.to_vector<double>(), bv = b.to_vector<double>();
  REQUIRE(av.size() == bv.size());
  double m = 0.0;
  for (std::size_t i = 0; i < av.size(); ++i) m = std::max(m, std::abs(av[i] - bv[i]));
  return m;
}

}  // namespace

// --- The guide's model ------------------------------------------------------------------

TEST_CASE("layers: the guide's model under mixed_float16", "[layers][guide]") {
  mt::PolicyScope scope("mixed_float16");
  const mt::Policy policy = mt::global_policy();
  CHECK(fmt::format("Compute dtype: {}", policy.compute_dtype()) == "Compute dtype: float16");
  CHECK(fmt::format("Variable dtype: {}", policy.variable_dtype()) == "Variable dtype: float32");

  auto inputs = ml::Input({784}, {.name = "digits"});
  auto dense1 = ml::Dense(64, {.activation = "relu", .name = "dense_1"});
  auto x = dense1(inputs);
  auto dense2 = ml::Dense(64, {.activation = "relu", .name = "dense_2"});
  x = dense2(x);
  CHECK(fmt::format("x.dtype: {}", x.dtype()) == "x.dtype: float16");
  CHECK(fmt::format("dense1.kernel.dtype: {}", dense1->kernel().dtype()) ==
        "dense1.kernel.dtype: float32");

  // INCORRECT: softmax and model output will be float16.
  auto wrong = ml::Dense(10, {.activation = "softmax", .name = "predictions"})(x);
  CHECK(wrong.dtype() == mt::kFloat16);

  // CORRECT: softmax and model output are float32.
  x = ml::Dense(10, {.name = "dense_logits"})(x);
  auto outputs = ml::Activation("softmax", {.dtype = "float32", .name = "predictions"})(x);
  CHECK(fmt::format("Outputs dtype: {}", outputs.dtype()) == "Outputs dtype: float32");
  outputs = ml::Activation("linear", {.dtype = "float32"})(outputs);  // a no-op cast
  CHECK(outputs.dtype() == mt::kFloat32);

  mt::Model model(inputs, outputs);
  CHECK(model.layers().size() == 6);
  CHECK(model.trainable_variables().size() == 6);
  for (const auto& v : model.trainable_variables()) CHECK(v.dtype() == mt::kFloat32);
  const std::string summary = model.summary_string();
  fmt::print("{}", summary);
  CHECK(contains(summary, "digits (InputLayer)"));
  CHECK(contains(summary, "dense_1 (Dense)"));
  CHECK(contains(summary, "(None, 64)"));
  CHECK(contains(summary, "mixed_float16"));
  CHECK(contains(summary, "Total params: 55,050"));
  CHECK_FALSE(contains(summary, "Note:"));

  const mt::Tensor batch = random({32, 784}, mt::kFloat32, 7, 0.0, 1.0);
  const mt::Tensor probs = model(batch);
  CHECK(probs.dtype() == mt::kFloat32);
  CHECK(probs.shape() == mt::Shape{32, 10});
  const auto row_sums = mt::sum(probs, {1}).to_vector<double>();
  for (double s : row_sums) CHECK(s == Approx(1.0).epsilon(1e-5));

  // The trace shows the cheat sheet for this model.
  const mt::DTypeTrace trace = mt::trace_dtypes(model, batch);
  fmt::print("{}", trace.table());
  REQUIRE(trace.rows.size() == 6);
  CHECK(trace.rows[1].layer == "dense_1");
  CHECK(trace.rows[1].input == mt::kFloat32);
  CHECK(trace.rows[1].input_cast == mt::kFloat16);
  CHECK(*trace.rows[1].weight == mt::kFloat32);
  CHECK(*trace.rows[1].weight_read == mt::kFloat16);
  CHECK(trace.rows[1].output == mt::kFloat16);
  CHECK(trace.rows[4].layer == "predictions");
  CHECK(trace.rows[4].input_cast == mt::kFloat32);
  CHECK(trace.rows[4].output == mt::kFloat32);
  CHECK(contains(trace.table(), "float32 => float16"));
}

TEST_CASE("layers: a mixed model with a float16 output says so", "[layers][guide]") {
  mt::PolicyScope scope("mixed_float16");
  auto inputs = ml::Input({8});
  auto outputs = ml::Dense(3, {.activation = "softmax"})(inputs);
  mt::Model model(inputs, outputs);
  CHECK(contains(model.summary_string(), "Note: the output is float16"));
  // It still runs and trains.
  mt::GradientTape tape;
  const mt::Tensor loss = mt::mean(model(random({4, 8}, mt::kFloat32, 1)));
  const auto grads = tape.gradient(loss, model.trainable_variables());
  for (const auto& g : grads) CHECK(g.dtype() == mt::kFloat32);
}

// --- Names, building, weights -----------------------------------------------------------------

TEST_CASE("layers: default names are unique per class", "[layers]") {
  ml::reset_default_names();
  auto a = ml::Dense(2);
  auto b = ml::Dense(2);
  auto c = ml::Conv2D(2, 3);
  auto d = ml::MaxPooling2D();
  auto e = ml::BatchNormalization();
  auto f = ml::GlobalAveragePooling2D();
  CHECK(a->name() == "dense");
  CHECK(b->name() == "dense_1");
  CHECK(c->name() == "conv2d");
  CHECK(d->name() == "max_pooling2d");
  CHECK(e->name() == "batch_normalization");
  CHECK(f->name() == "global_average_pooling2d");
  auto named = ml::Dense(2, {.name = "mine"});
  CHECK(named->name() == "mine");
  CHECK(a->class_name() == "Dense");
}

TEST_CASE("layers: built lazily on the first call, from the input's shape", "[layers]") {
  auto dense = ml::Dense(5);
  CHECK_FALSE(dense->built());
  CHECK(dense->weights().empty());
  CHECK_THROWS_AS(dense->kernel(), mt::ValueError);
  const mt::Tensor y = dense(random({3, 7}, mt::kFloat32, 2));
  CHECK(dense->built());
  CHECK(y.shape() == mt::Shape{3, 5});
  CHECK(dense->kernel().shape() == mt::Shape{7, 5});
  CHECK(dense->bias().shape() == mt::Shape{5});
  CHECK(dense->count_params() == 40);
  CHECK(dense->kernel().name() == dense->name() + "/kernel");
  // Higher-rank inputs apply to the last axis.
  CHECK(dense(random({2, 3, 7}, mt::kFloat32, 3)).shape() == mt::Shape{2, 3, 5});
}

TEST_CASE("layers: a built layer rejects inputs of the wrong rank or features", "[layers]") {
  auto dense = ml::Dense(4, {.name = "classifier"});
  dense(random({2, 784}, mt::kFloat32, 1));
  const std::string m = message_of([&] { dense(random({2, 100}, mt::kFloat32, 1)); });
  CHECK(contains(m, "classifier"));
  CHECK(contains(m, "784"));
  CHECK(contains(m, "float32[2, 100]"));
  CHECK_THROWS_AS(dense(random({2, 100}, mt::kFloat32, 1)), mt::ShapeError);
  CHECK_THROWS_AS(dense(random({784}, mt::kFloat32, 1)), mt::ShapeError);

  auto conv = ml::Conv2D(4, 3, {.name = "conv"});
  conv(random({1, 8, 8, 3}, mt::kFloat32, 1));
  const std::string mc = message_of([&] { conv(random({1, 8, 8, 2}, mt::kFloat32, 1)); });
  CHECK(contains(mc, "conv"));
  CHECK_THROWS_AS(conv(random({8, 8, 3}, mt::kFloat32, 1)), mt::ShapeError);
}

TEST_CASE("layers: unknown activation, initializer, padding names throw", "[layers]") {
  const std::string a = message_of([] { ml::Dense(2, {.activation = "swishy"}); });
  CHECK(contains(a, "swishy"));
  CHECK(contains(a, "relu"));
  CHECK_THROWS_AS(ml::Activation("nope"), mt::ValueError);
  const std::string i = message_of([] { ml::Dense(2, {.kernel_initializer = "glorot_magic"}); });
  CHECK(contains(i, "glorot_magic"));
  CHECK(contains(i, "he_normal"));
  CHECK_THROWS_AS(ml::Conv2D(2, 3, {.padding = "full"}), mt::ValueError);
  CHECK_THROWS_AS(ml::Dense(0), mt::ValueError);
  CHECK_THROWS_AS(ml::Dropout(1.0), mt::ValueError);
}

TEST_CASE("layers: get_weights copies, set_weights restores and checks", "[layers]") {
  mt::Sequential model(
      {ml::Dense(6, {.activation = "tanh", .name = "h"}), ml::Dense(2, {.name = "out"})},
      {.name = "net"});
  const mt::Tensor x = random({4, 3}, mt::kFloat32, 5);
  const mt::Tensor before = model(x);
  const auto saved = model.get_weights();
  REQUIRE(saved.size() == 4);
  // Perturb, then restore.
  for (auto& v : model.trainable_variables()) v.assign_add(mt::full({}, 0.5));
  CHECK(max_abs_diff(model(x), before) > 1e-3);
  model.set_weights(saved);
  CHECK(max_abs_diff(model(x), before) == 0.0);

  const std::string count = message_of([&] { model.set_weights({saved[0]}); });
  CHECK(contains(count, "net"));
  CHECK(contains(count, "1 tensors for 4 weights"));
  auto wrong_shape = saved;
  wrong_shape[1] = mt::zeros({5});
  const std::string shape = message_of([&] { model.set_weights(wrong_shape); });
  CHECK(contains(shape, "h/bias"));
  CHECK_THROWS_AS(model.set_weights(wrong_shape), mt::ShapeError);
  auto wrong_dtype = saved;
  wrong_dtype[2] = saved[2].to(mt::kFloat16);
  CHECK_THROWS_AS(model.set_weights(wrong_dtype), mt::DTypeError);
  CHECK(contains(message_of([&] { model.set_weights(wrong_dtype); }), "out/kernel"));
}

TEST_CASE("layers: trainable flags", "[layers]") {
  mt::Sequential model({ml::Dense(3), ml::BatchNormalization(), ml::Dense(2)});
  model(random({4, 5}, mt::kFloat32, 1));
  CHECK(model.weights().size() == 8);
  CHECK(model.trainable_variables().size() == 6);  // BN moving statistics are not trainable
  CHECK(model.non_trainable_variables().size() == 2);
  model.layers()[0]->set_trainable(false);
  CHECK(model.trainable_variables().size() == 4);
  mt::GradientTape tape;
  const auto grads =
      tape.gradient(mt::sum(model(random({4, 5}, mt::kFloat32, 2))), model.weights());
  CHECK_FALSE(grads[0].defined());  // frozen: not watched
  model.layers()[0]->set_trainable(true);
  CHECK(model.trainable_variables().size() == 6);
}

// --- Functional and Sequential models -----------------------------------------------------------

TEST_CASE("models: functional errors", "[layers][model]") {
  auto a = ml::Input({4});
  auto b = ml::Input({4});
  auto out = ml::Dense(2)(a);
  CHECK_THROWS_AS(mt::Model(b, out), mt::ValueError);    // not computed from b
  CHECK_THROWS_AS(mt::Model(out, out), mt::ValueError);  // inputs must be an Input()
  auto x = ml::Dense(2, {.name = "same"})(a);
  auto y = ml::Dense(2, {.name = "same"})(x);
  CHECK(contains(message_of([&] { mt::Model m(a, y); }), "named 'same'"));
  mt::Model ok(a, out);
  CHECK_THROWS_AS(ok(random({3, 5}, mt::kFloat32, 1)), mt::ShapeError);
  CHECK(contains(message_of([&] { ok(random({3, 5}, mt::kFloat32, 1)); }), "input"));
  CHECK(ok.get_layer(ok.layers()[1]->name()) == ok.layers()[1]);
  CHECK_THROWS_AS(ok.get_layer("nope"), mt::ValueError);
}

TEST_CASE("models: Sequential builds on the first call and summarises", "[layers][model]") {
  mt::Sequential model({ml::Reshape({28, 28, 1}), ml::Conv2D(4, 3, {.padding = "same"}),
                        ml::MaxPooling2D(), ml::Flatten(), ml::Dense(10)});
  CHECK(contains(model.summary_string(), "?"));  // not built yet
  model.build_for({-1, 784});
  const std::string s = model.summary_string();
  CHECK(contains(s, "(None, 28, 28, 4)"));
  CHECK(contains(s, "(None, 14, 14, 4)"));
  CHECK(contains(s, "(None, 784)"));
  CHECK(contains(s, "(None, 10)"));
  CHECK(contains(s, "Total params: 7,890"));  // 3*3*1*4 + 4 + 784*10 + 10
  CHECK(model(random({2, 784}, mt::kFloat32, 1)).shape() == mt::Shape{2, 10});
  model.to(mt::Device::cpu());
  CHECK(model.layers()[1]->device() == mt::Device::cpu());
}

TEST_CASE("models: a model is a layer (nesting) and shares its layers' weights", "[model]") {
  auto inner_in = ml::Input({3});
  auto inner_out = ml::Dense(4, {.activation = "relu"})(inner_in);
  auto inner = ml::make_layer<mt::Model>(inner_in, inner_out);
  mt::Sequential outer({inner, ml::Dense(1)});
  const mt::Tensor y = outer(random({5, 3}, mt::kFloat32, 3));
  CHECK(y.shape() == mt::Shape{5, 1});
  CHECK(outer.trainable_variables().size() == 4);
}

// --- Layer behaviour -----------------------------------------------------------------------

TEST_CASE("layers: Dropout is seeded and only drops while training", "[layers]") {
  auto drop = ml::Dropout(0.25, {.seed = 42});
  const mt::Tensor x = random({100, 100}, mt::kFloat32, 9, 0.5, 1.5);
  CHECK(max_abs_diff(drop(x), x) == 0.0);  // inference: identity
  const mt::Tensor y = drop(x, {.training = true});
  const auto xv = x.to_vector<double>(), yv = y.to_vector<double>();
  std::size_t dropped = 0;
  for (std::size_t i = 0; i < xv.size(); ++i) {
    if (yv[i] == 0.0) {
      ++dropped;
    } else {
      CHECK(yv[i] == Approx(xv[i] / 0.75).epsilon(1e-6));
    }
  }
  CHECK(dropped > 2300);
  CHECK(dropped < 2700);
  // The same seed gives the same mask.
  auto again = ml::Dropout(0.25, {.seed = 42});
  CHECK(max_abs_diff(again(x, {.training = true}), y) == 0.0);
  // The gradient is the mask times the scale.
  mt::GradientTape tape;
  tape.watch(x);
  auto third = ml::Dropout(0.25, {.seed = 42});
  const mt::Tensor z = third(x, {.training = true});
  const auto g = tape.gradient(mt::sum(z), x).to_vector<double>();
  for (std::size_t i = 0; i < g.size(); ++i)
    CHECK(g[i] == Approx(yv[i] == 0.0 ? 0.0 : 1.0 / 0.75).epsilon(1e-6));
}

TEST_CASE("layers: BatchNormalization statistics and moving averages", "[layers]") {
  mt::PolicyScope scope("mixed_float16");
  auto bn = ml::BatchNormalization({.momentum = 0.9, .epsilon = 1e-3});
  const mt::Tensor x = random({64, 3}, mt::kFloat32, 11, 1.0, 3.0);
  const mt::Tensor y = bn(x, {.training = true});
  CHECK(y.dtype() == mt::kFloat16);
  CHECK(bn->gamma().dtype() == mt::kFloat32);
  CHECK(bn->moving_mean().dtype() == mt::kFloat32);
  CHECK(bn->computation_dtype() == mt::kFloat32);
  // Training output: zero mean, unit variance per channel (within float16 rounding).
  const auto ym = mt::mean(y.to(mt::kFloat32), {0}).to_vector<double>();
  for (double m : ym) CHECK(std::abs(m) < 2e-3);
  // moving_mean = 0.9 * 0 + 0.1 * batch mean (of the float16-cast input).
  const auto bm = mt::mean(x.to(mt::kFloat16).to(mt::kFloat32), {0}).to_vector<double>();
  const auto mm = bn->moving_mean().to_vector<double>();
  for (std::size_t c = 0; c < 3; ++c) CHECK(mm[c] == Approx(0.1 * bm[c]).epsilon(1e-5));
  // Inference uses the moving statistics and changes nothing.
  const mt::Tensor inf = bn(x);
  CHECK(max_abs_diff(bn->moving_mean(), mt::from_vector(mm, {3})) == 0.0);
  const auto xv = x.to(mt::kFloat16).to_vector<double>();
  const auto mv = bn->moving_variance().to_vector<double>();
  const auto iv = inf.to_vector<double>();
  for (std::size_t i = 0; i < 6; ++i) {
    const std::size_t c = i % 3;
    CHECK(iv[i] == Approx((xv[i] - mm[c]) / std::sqrt(mv[c] + 1e-3)).epsilon(2e-3));
  }
}

TEST_CASE("layers: LayerNormalization normalises each sample in float32", "[layers]") {
  mt::PolicyScope scope("mixed_bfloat16");
  auto ln = ml::LayerNormalization();
  const mt::Tensor x = random({5, 16}, mt::kFloat32, 12, -3.0, 5.0);
  const mt::Tensor y = ln(x);
  CHECK(y.dtype() == mt::kBFloat16);
  CHECK(ln->gamma().dtype() == mt::kFloat32);
  const mt::Tensor yf = y.to(mt::kFloat32);
  for (double m : mt::mean(yf, {1}).to_vector<double>()) CHECK(std::abs(m) < 2e-2);
  for (double v : mt::mean(mt::square(yf), {1}).to_vector<double>())
    CHECK(v == Approx(1.0).epsilon(3e-2));
}

TEST_CASE("layers: Embedding looks rows up", "[layers]") {
  auto emb = ml::Embedding(5, 3, {.embeddings_initializer = mt::init::random_normal(0, 1, 3)});
  const mt::Tensor ids = mt::from_vector<std::int32_t>({4, 0, 2, 2}, {2, 2});
  const mt::Tensor y = emb(ids);
  CHECK(y.shape() == mt::Shape{2, 2, 3});
  const auto table = emb->embeddings().to_vector<double>();
  const auto yv = y.to_vector<double>();
  const int expect[] = {4, 0, 2, 2};
  for (int i = 0; i < 4; ++i)
    for (int d = 0; d < 3; ++d) CHECK(yv[i * 3 + d] == table[expect[i] * 3 + d]);
  CHECK_THROWS_AS(emb(mt::from_vector<std::int64_t>({5}, {1})), mt::IndexError);
  CHECK(contains(message_of([&] { emb(mt::from_vector<std::int64_t>({5}, {1})); }), emb->name()));
}

TEST_CASE("layers: Slice takes part of an axis, the last time step say", "[layers]") {
  const mt::Tensor x = mt::normal({3, 5, 4});  // float32, the compute dtype: exact copies
  const auto xv = x.to_vector<double>();
  // The last step, axis dropped: [n, d].
  auto last = ml::Slice(1, -1, {.squeeze = true});
  const mt::Tensor y = last(x);
  REQUIRE(y.shape() == mt::Shape{3, 4});
  const auto yv = y.to_vector<double>();
  for (int n = 0; n < 3; ++n)
    for (int d = 0; d < 4; ++d) CHECK(yv[n * 4 + d] == xv[n * 20 + 4 * 4 + d]);
  // A range, negative stop, on the last axis.
  auto mid = ml::Slice(-1, 1, {.stop = -1});
  const mt::Tensor z = mid(x);
  REQUIRE(z.shape() == mt::Shape{3, 5, 2});
  CHECK(z.to_vector<double>()[0] == xv[1]);
  CHECK(z.to_vector<double>()[1] == xv[2]);
  // In a functional model, with its shape rule, and in a file.
  auto in = ml::Input({5, 4});
  auto sliced = ml::Slice(1, -1, {.squeeze = true})(in);
  CHECK(sliced.shape() == mt::Shape{-1, 4});
  const ml::Config c = last->get_config();
  auto again = ml::layer_from_config("Slice", c);
  CHECK(again->operator()(x).to_vector<double>() == yv);
  // The gradient reaches the selected step only.
  mt::GradientTape tape;
  tape.watch(x);
  const auto g = tape.gradient(mt::sum(last(x)), x).to_vector<double>();
  for (int n = 0; n < 3; ++n)
    for (int t = 0; t < 5; ++t) CHECK(g[n * 20 + t * 4] == (t == 4 ? 1.0 : 0.0));
  // What it refuses.
  CHECK_THROWS_AS(ml::Slice(0, 0), mt::ValueError);
  CHECK_THROWS_AS(ml::Slice(1, 5)(x), mt::ShapeError);
  CHECK_THROWS_AS(ml::Slice(1, -6)(x), mt::ShapeError);
  CHECK_THROWS_AS(ml::Slice(1, 2, {.stop = 2})(x), mt::ShapeError);
  CHECK_THROWS_AS(ml::Slice(1, 1, {.stop = 3, .squeeze = true})(x), mt::ShapeError);
  CHECK_THROWS_AS(ml::Slice(3, 0)(x), mt::ShapeError);
  CHECK(contains(message_of([&] { ml::Slice(1, 7, {.name = "tail"})(x); }),
                 "slice [7:] of axis 1 (of extent 5)"));
}

TEST_CASE("layers: Conv2D, pooling and global pooling shapes", "[layers]") {
  const mt::Tensor x = random({2, 9, 9, 3}, mt::kFloat32, 13);
  CHECK(ml::Conv2D(4, 3)(x).shape() == mt::Shape{2, 7, 7, 4});
  CHECK(ml::Conv2D(4, 3, {.padding = "same"})(x).shape() == mt::Shape{2, 9, 9, 4});
  CHECK(ml::Conv2D(4, {3, 1}, {.strides = 2, .padding = "same"})(x).shape() ==
        mt::Shape{2, 5, 5, 4});
  CHECK(ml::MaxPooling2D()(x).shape() == mt::Shape{2, 4, 4, 3});
  CHECK(ml::AveragePooling2D({.pool_size = 3, .strides = 1})(x).shape() == mt::Shape{2, 7, 7, 3});
  CHECK(ml::MaxPooling2D({.padding = "same"})(x).shape() == mt::Shape{2, 5, 5, 3});
  const mt::Tensor g = ml::GlobalAveragePooling2D()(x);
  CHECK(g.shape() == mt::Shape{2, 3});
  CHECK(max_abs_diff(g, mt::mean(x, {1, 2})) < 1e-6);
  CHECK(ml::Flatten()(x).shape() == mt::Shape{2, 243});
  CHECK(ml::Reshape({81, -1})(x).shape() == mt::Shape{2, 81, 3});
}

TEST_CASE("layers: initializers follow Keras' fans and seeds", "[layers]") {
  const mt::Tensor k = mt::init::glorot_uniform(1)({300, 100});
  const double limit = std::sqrt(6.0 / 400.0);
  double sq = 0.0;
  for (double v : k.to_vector<double>()) {
    CHECK(std::abs(v) <= limit);
    sq += v * v;
  }
  CHECK(sq / 30000.0 == Approx(limit * limit / 3.0).epsilon(0.05));
  // Seeded initializers repeat; he_normal's variance is 2 / fan_in (conv fans).
  CHECK(max_abs_diff(mt::init::he_normal(5)({3, 3, 8, 16}),
                     mt::init::he_normal(5)({3, 3, 8, 16})) == 0.0);
  const auto h = mt::init::he_normal(6)({3, 3, 64, 64}).to_vector<double>();
  double var = 0.0;
  for (double v : h) var += v * v;
  CHECK(var / static_cast<double>(h.size()) == Approx(2.0 / (9.0 * 64.0)).epsilon(0.05));
  CHECK(mt::init::get("ones")({2}).to_vector<double>() == std::vector<double>{1.0, 1.0});
  CHECK(mt::init::constant(3.5)({1}).item<double>() == 3.5);
}

// --- Every layer under every policy ----------------------------------------------------------

namespace {

struct LayerCase {
  std::string name;
  std::function<ml::LayerPtr<ml::Layer>()> make;
  mt::Shape input;
  bool integer_input = false;
  bool reads_shape_only = false;  // the output does not depend on the input's values
  // Whether the input is differentiated (floating and read).
  bool input_is_source() const { return !integer_input && !reads_shape_only; }
};

std::vector<LayerCase> layer_cases() {
  return {
      {"Dense", [] { return ml::Dense(4, {.activation = "tanh"}); }, {3, 5}},
      {"Activation(gelu)", [] { return ml::Activation("gelu"); }, {3, 5}},
      {"Activation(gelu_tanh)", [] { return ml::Activation("gelu_tanh"); }, {3, 5}},
      {"Activation(softmax)", [] { return ml::Activation("softmax"); }, {3, 5}},
      {"Activation(log_softmax)", [] { return ml::Activation("log_softmax"); }, {3, 5}},
      {"Activation(sigmoid)", [] { return ml::Activation("sigmoid"); }, {3, 5}},
      {"Flatten", [] { return ml::Flatten(); }, {2, 3, 2}},
      {"Reshape",
       [] {
         return ml::Reshape({2, 3});
       },
       {2, 6}},
      {"Conv2D",
       [] { return ml::Conv2D(3, 3, {.padding = "same", .activation = "relu"}); },
       {2, 5, 5, 2}},
      {"Conv2D(strided)",
       [] {
         return ml::Conv2D(2, {2, 3}, {.strides = {2, 1}});
       },
       {1, 6, 5, 3}},
      {"MaxPooling2D", [] { return ml::MaxPooling2D(); }, {2, 4, 4, 3}},
      {"AveragePooling2D",
       [] { return ml::AveragePooling2D({.pool_size = 3, .strides = 2, .padding = "same"}); },
       {1, 5, 5, 2}},
      {"GlobalAveragePooling2D", [] { return ml::GlobalAveragePooling2D(); }, {2, 3, 3, 4}},
      {"BatchNormalization", [] { return ml::BatchNormalization(); }, {6, 4}},
      {"BatchNormalization(NHWC)", [] { return ml::BatchNormalization(); }, {2, 3, 3, 2}},
      {"LayerNormalization", [] { return ml::LayerNormalization(); }, {3, 6}},
      {"Embedding", [] { return ml::Embedding(7, 3); }, {2, 4}, true},
      {"PositionEmbedding", [] { return ml::PositionEmbedding(6); }, {2, 4, 3}, false, true},
      {"MultiHeadAttention(self)",
       [] { return ml::MultiHeadAttention(2, 3, {.value_dim = 2}); },
       {2, 4, 5}},
      {"MultiHeadAttention(causal)",
       [] { return ml::MultiHeadAttention(3, 2, {.output_shape = {4}, .use_causal_mask = true}); },
       {2, 5, 3}},
  };
}

mt::Tensor layer_input(const LayerCase& c, mt::DType dt, std::uint64_t seed) {
  if (c.integer_input) {
    mt::Generator gen(seed);
    std::vector<std::int64_t> ids(static_cast<std::size_t>(c.input.numel()));
    for (auto& id : ids) id = static_cast<std::int64_t>(gen.next_u64() % 7);
    return mt::from_vector(ids, c.input);
  }
  // Pairwise distinct values so that max pooling has no ties.
  mt::Generator gen(seed);
  const auto n = static_cast<std::size_t>(c.input.numel());
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] =
        (static_cast<double>(i) - static_cast<double>(n) / 2.0) * 0.07 + 0.02 * gen.next_uniform();
  for (std::size_t i = n; i > 1; --i) std::swap(v[i - 1], v[gen.next_u64() % i]);
  return mt::from_vector(v, c.input, dt);
}

// d/d(x, weights) of sum(layer(x) * R), analytic (tape) against central differences.
void check_layer_gradients(const LayerCase& c, bool training) {
  mt::PolicyScope scope("float64");
  auto layer = c.make();
  mt::Tensor x = layer_input(c, mt::kFloat64, 21);
  layer(x);  // build
  // Random weights (not the initial zeros / ones) so that every term matters.
  std::uint64_t seed = 100;
  for (auto v : layer->trainable_variables())
    v.assign(random(v.shape(), mt::kFloat64, seed++, -0.8, 0.8) +
             1.0 * (v.name().find("gamma") != std::string::npos));
  const mt::CallContext ctx{.training = training};
  const mt::Tensor r = random(layer(x, ctx).shape(), mt::kFloat64, 99);
  auto loss = [&](const mt::Tensor& input) {
    return mt::sum(layer(input, ctx) * r).item<double>();
  };

  std::vector<mt::Tensor> sources;
  if (c.input_is_source()) sources.push_back(x);
  for (const auto& v : layer->trainable_variables()) sources.push_back(v);
  std::vector<mt::Tensor> grads;
  {
    mt::GradientTape tape;
    if (c.input_is_source()) tape.watch(x);
    grads = tape.gradient(mt::sum(layer(x, ctx) * r), sources);
  }
  const double eps = 1e-6;
  for (std::size_t s = 0; s < sources.size(); ++s) {
    INFO(c.name << ": source " << s << " of shape " << sources[s].shape().str());
    REQUIRE(grads[s].defined());
    CHECK(grads[s].dtype() == mt::kFloat64);
    const auto analytic = grads[s].to_vector<double>();
    std::vector<double> values = sources[s].to_vector<double>();
    const bool is_input = c.input_is_source() && s == 0;
    for (std::size_t i = 0; i < values.size(); ++i) {
      auto eval = [&](double delta) {
        std::vector<double> p = values;
        p[i] += delta;
        const mt::Tensor t = mt::from_vector(p, sources[s].shape(), mt::kFloat64);
        if (is_input) return loss(t);
        mt::Variable v = layer->trainable_variables()[s - (c.input_is_source() ? 1 : 0)];
        v.assign(t);
        const double l = loss(x);
        v.assign(mt::from_vector(values, sources[s].shape(), mt::kFloat64));
        return l;
      };
      const double numeric = (eval(eps) - eval(-eps)) / (2 * eps);
      INFO("element " << i << " analytic " << analytic[i] << " numeric " << numeric);
      CHECK(std::abs(analytic[i] - numeric) <= 1e-5 + 1e-4 * std::abs(numeric));
    }
  }
}

}  // namespace

TEST_CASE("layers: gradient checks of every layer in float64", "[layers][gradcheck]") {
  for (const auto& c : layer_cases()) check_layer_gradients(c, /*training=*/false);
  // BatchNormalization with batch statistics: the gradient flows through them.
  for (const auto& c : layer_cases())
    if (c.name.rfind("BatchNormalization", 0) == 0) check_layer_gradients(c, /*training=*/true);
}

TEST_CASE("layers: every layer runs under float32, mixed_float16 and mixed_bfloat16",
          "[layers][policies]") {
  for (const auto& c : layer_cases()) {
    // float32 reference with the same weights.
    mt::Tensor ref;
    std::vector<mt::Tensor> weights;
    {
      mt::PolicyScope scope("float32");
      auto layer = c.make();
      ref = layer(layer_input(c, mt::kFloat32, 31), {.training = true});
      weights = layer->get_weights();
    }
    for (const char* policy : {"float32", "mixed_float16", "mixed_bfloat16"}) {
      INFO(c.name << " under " << policy);
      mt::PolicyScope scope(policy);
      auto layer = c.make();
      const mt::Tensor x = layer_input(c, mt::kFloat32, 31);
      layer(x);
      layer->set_weights(weights);  // float32 variables under every policy here
      mt::GradientTape tape;
      if (c.input_is_source()) tape.watch(x);
      const mt::Tensor y = layer(x, {.training = true});
      CHECK(y.dtype() == mt::Policy(policy).compute_dtype());
      const double tol = std::string(policy) == "float32"         ? 1e-6
                         : std::string(policy) == "mixed_float16" ? 2e-2
                                                                  : 1.5e-1;
      double scale = 1.0;
      for (double v : ref.to_vector<double>()) scale = std::max(scale, std::abs(v));
      CHECK(max_abs_diff(y.to(mt::kFloat32), ref) <= tol * scale);
      std::vector<mt::Tensor> sources;
      if (c.input_is_source()) sources.push_back(x);
      for (const auto& v : layer->trainable_variables()) sources.push_back(v);
      const auto grads = tape.gradient(mt::sum(y.to(mt::kFloat32)), sources);
      for (std::size_t s = 0; s < grads.size(); ++s) {
        REQUIRE(grads[s].defined());
        CHECK(grads[s].dtype() == mt::kFloat32);  // the sources are float32
        for (double g : grads[s].to_vector<double>()) CHECK(std::isfinite(g));
      }
    }
  }
}
