// Models as graphs: merge layers, several inputs and outputs, shared layers, models used as
// layers, the checks made when a model is built, shape inference without a forward pass,
// gradients through fan-out (float64, against central differences) and the summary.
#include <catch2/catch.hpp>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "error_of.h"
#include "gradcheck.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
namespace ml = mixtape::layers;
using Catch::Matchers::Contains;
using mixtape_test::error_of;

namespace {

std::vector<double> values(const mt::Tensor& t) { return t.to(mt::kFloat64).to_vector<double>(); }

mt::Tensor randn(const mt::Shape& shape, mt::DType dtype = mt::kFloat32) {
  return mt::normal(shape, 0.0, 1.0, dtype);
}

// Counts its calls; says its output shape only when asked to.
class Counting : public ml::Layer {
 public:
  Counting(bool shape_rule, int* calls) : shape_rule_(shape_rule), calls_(calls) {}
  mt::Tensor call(const mt::Tensor& x, const mt::CallContext&) override {
    ++*calls_;
    return x * 2.0;
  }
  std::optional<mt::Shape> compute_output_shape(const mt::Shape& s) const override {
    if (!shape_rule_) return std::nullopt;
    return s;
  }

 private:
  bool shape_rule_;
  int* calls_;
};

// Two outputs: the input and its negation.
class Split : public ml::Layer {
 public:
  using Layer::Layer;
  std::vector<mt::Tensor> call_multi(const std::vector<mt::Tensor>& xs,
                                     const mt::CallContext&) override {
    return {xs[0], -xs[0]};
  }
  std::optional<std::vector<ml::TensorSpec>> compute_output_spec(
      const std::vector<ml::TensorSpec>& in) const override {
    return std::vector<ml::TensorSpec>{{in[0].shape, compute_dtype()},
                                       {in[0].shape, compute_dtype()}};
  }
};

}  // namespace

TEST_CASE("graph: the element-wise merge layers against their definitions", "[graph]") {
  mt::manual_seed(11);
  const mt::Tensor a = randn({3, 4}), b = randn({3, 4}), c = randn({3, 4});
  const auto va = values(a), vb = values(b), vc = values(c);
  struct Case {
    ml::LayerPtr<ml::ElementwiseMergeLayer> layer;
    double (*f)(double, double, double);
    bool three;
  };
  const std::vector<Case> cases = {
      {ml::Add(), [](double x, double y, double z) { return x + y + z; }, true},
      {ml::Subtract(), [](double x, double y, double) { return x - y; }, false},
      {ml::Multiply(), [](double x, double y, double z) { return x * y * z; }, true},
      {ml::Average(), [](double x, double y, double z) { return (x + y + z) / 3.0; }, true},
      {ml::Maximum(),
       [](double x, double y, double z) {
         return std::max({x, y, z});
       },
       true},
      {ml::Minimum(),
       [](double x, double y, double z) {
         return std::min({x, y, z});
       },
       true},
  };
  for (const auto& k : cases) {
    INFO(k.layer->class_name());
    const mt::Tensor y = k.three ? k.layer({a, b, c}) : k.layer({a, b});
    REQUIRE(y.shape() == mt::Shape{3, 4});
    const auto vy = values(y);
    for (std::size_t i = 0; i < vy.size(); ++i)
      CHECK(vy[i] == Approx(k.f(va[i], vb[i], vc[i])).epsilon(1e-6).margin(1e-6));
  }
}

TEST_CASE("graph: Concatenate and Dot against their definitions", "[graph]") {
  mt::manual_seed(12);
  const mt::Tensor a = randn({2, 3}), b = randn({2, 5});
  const mt::Tensor y = ml::Concatenate()({a, b});
  REQUIRE(y.shape() == mt::Shape{2, 8});
  const auto va = values(a), vb = values(b), vy = values(y);
  for (int r = 0; r < 2; ++r) {
    for (int j = 0; j < 3; ++j) CHECK(vy[r * 8 + j] == va[r * 3 + j]);
    for (int j = 0; j < 5; ++j) CHECK(vy[r * 8 + 3 + j] == vb[r * 5 + j]);
  }
  CHECK(ml::Concatenate({.axis = 0})({a, a}).shape() == mt::Shape{4, 3});

  // [n, d] . [n, d] -> [n, 1], plain and normalised (the cosine).
  const mt::Tensor u = randn({4, 6}), v = randn({4, 6});
  const auto vu = values(u), vv = values(v);
  const auto dot = values(ml::Dot({1})({u, v}));
  const auto cosine = values(ml::Dot({1}, {.normalize = true})({u, v}));
  REQUIRE(dot.size() == 4);
  for (int r = 0; r < 4; ++r) {
    double d = 0, nu = 0, nv = 0;
    for (int j = 0; j < 6; ++j) {
      d += vu[r * 6 + j] * vv[r * 6 + j];
      nu += vu[r * 6 + j] * vu[r * 6 + j];
      nv += vv[r * 6 + j] * vv[r * 6 + j];
    }
    CHECK(dot[r] == Approx(d).epsilon(1e-5));
    CHECK(cosine[r] == Approx(d / std::sqrt(nu * nv)).epsilon(1e-5));
  }
  // [n, p, d] . [n, q, d] with axes {2, 2} -> [n, p, q]; [n, d, p] . [n, d] (axes {1, 1}) -> [n,
  // p].
  const mt::Tensor x3 = randn({2, 3, 4}), y3 = randn({2, 5, 4});
  const mt::Tensor z = ml::Dot({2, 2})({x3, y3});
  REQUIRE(z.shape() == mt::Shape{2, 3, 5});
  const auto vx = values(x3), vy3 = values(y3), vz = values(z);
  for (int n = 0; n < 2; ++n)
    for (int p = 0; p < 3; ++p)
      for (int q = 0; q < 5; ++q) {
        double s = 0;
        for (int d = 0; d < 4; ++d) s += vx[(n * 3 + p) * 4 + d] * vy3[(n * 5 + q) * 4 + d];
        CHECK(vz[(n * 3 + p) * 5 + q] == Approx(s).epsilon(1e-5));
      }
  const mt::Tensor w = randn({2, 4, 3}), e = randn({2, 4});
  CHECK(ml::Dot({1})({w, e}).shape() == mt::Shape{2, 3});
  // Symbolic shapes agree with the computed ones.
  auto in_w = ml::Input({4, 3}), in_e = ml::Input({4});
  CHECK(ml::Dot({1})({in_w, in_e}).shape() == mt::Shape{-1, 3});
  CHECK(ml::Dot({2, 2})({ml::Input({3, 4}), ml::Input({5, 4})}).shape() == mt::Shape{-1, 3, 5});
}

TEST_CASE("graph: merge layers refuse incompatible inputs, naming the layer and the shapes",
          "[graph]") {
  const std::string add = error_of<mt::ShapeError>([] {
    ml::Add({.name = "join"})({mt::ones({2, 4}), mt::ones({2, 5})});
  });
  CHECK_THAT(add, Contains("join") && Contains("[2, 4]") && Contains("[2, 5]"));
  const std::string sym = error_of<mt::ShapeError>([] {
    ml::Add({.name = "join2"})({ml::Input({4}), ml::Input({5})});
  });
  CHECK_THAT(sym, Contains("join2") && Contains("[None, 4]") && Contains("[None, 5]"));
  const std::string cat = error_of<mt::ShapeError>([] {
    ml::Concatenate({.axis = -1, .name = "cat"})({mt::ones({2, 3, 4}), mt::ones({2, 2, 4})});
  });
  CHECK_THAT(
      cat, Contains("cat") && Contains("[2, 3, 4]") && Contains("[2, 2, 4]") && Contains("axis 1"));
  CHECK_THROWS_AS(ml::Concatenate({.axis = 3})({mt::ones({2, 3}), mt::ones({2, 3})}), mt::Error);
  CHECK_THAT(error_of<mt::ValueError>([] {
               ml::Add({.name = "lonely"})(mt::ones({2, 3}));
             }),
             Contains("lonely") && Contains("at least 2 inputs"));
  CHECK_THAT(error_of<mt::ValueError>([] {
               ml::Subtract()({mt::ones({1}), mt::ones({1}), mt::ones({1})});
             }),
             Contains("exactly 2"));
  CHECK_THAT(error_of<mt::ShapeError>([] {
               ml::Dot({1})({mt::ones({2, 3}), mt::ones({2, 4})});
             }),
             Contains("[2, 3]") && Contains("[2, 4]"));
  CHECK_THROWS_AS(ml::Dot({0}), mt::Error);
  CHECK_THROWS_AS(ml::Dot({1, 1, 1}), mt::ValueError);
}

TEST_CASE("graph: merge inputs of mixed dtypes follow the policy", "[graph]") {
  mt::PolicyScope scope("mixed_float16");
  const mt::Tensor a = randn({2, 3}), b = randn({2, 3}, mt::kBFloat16);
  const mt::Tensor i = mt::ones({2, 3}, mt::kInt32);
  CHECK(ml::Add()({a, b}).dtype() == mt::kFloat16);
  CHECK(ml::Multiply()({a, i}).dtype() == mt::kFloat16);
  CHECK(ml::Concatenate()({a, b}).dtype() == mt::kFloat16);
  auto s = ml::Add()({ml::Input({3}), ml::Input({3}, {.dtype = mt::kBFloat16})});
  CHECK(s.dtype() == mt::kFloat16);
}

TEST_CASE("graph: a model of two inputs and two outputs", "[graph]") {
  mt::manual_seed(13);
  auto a = ml::Input({4}, {.name = "a"});
  auto b = ml::Input({6}, {.name = "b"});
  auto ha = ml::Dense(5, {.name = "ha"})(a);
  auto hb = ml::Dense(5, {.name = "hb"})(b);
  auto sum = ml::Add({.name = "sum"})({ha, hb});
  auto out1 = ml::Dense(2, {.name = "out1"})(sum);
  auto out2 = ml::Dense(3, {.name = "out2"})(ml::Concatenate({.name = "cat"})({sum, hb}));
  mt::Model model({a, b}, {out1, out2}, {.name = "two"});
  REQUIRE(model.layers().size() == 8);
  CHECK(model.layers()[0]->name() == "a");
  CHECK(model.layers()[1]->name() == "b");
  CHECK(out2.shape() == mt::Shape{-1, 3});

  const mt::Tensor xa = randn({7, 4}), xb = randn({7, 6});
  const std::vector<mt::Tensor> ys = model({xa, xb});
  REQUIRE(ys.size() == 2);
  CHECK(ys[0].shape() == mt::Shape{7, 2});
  CHECK(ys[1].shape() == mt::Shape{7, 3});
  // The same as the layers called by hand.
  auto layer = [&](const char* n) { return model.get_layer(n); };
  const mt::Tensor s = (*layer("ha"))(xa) + (*layer("hb"))(xb);
  const auto want1 = values((*layer("out1"))(s));
  const auto got1 = values(ys[0]);
  for (std::size_t i = 0; i < want1.size(); ++i) CHECK(got1[i] == want1[i]);

  // The wrong number of inputs; a single-tensor call of a two-input model.
  CHECK_THAT(error_of<mt::ValueError>([&] { model({xa}); }),
             Contains("two") && Contains("2 inputs") && Contains("a, b") && Contains("got 1"));
  CHECK_THAT(error_of<mt::ValueError>([&] { model(xa); }), Contains("two"));
  // Wrong shape on the second input names that Input.
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               model({xa, randn({7, 5})});
             }),
             Contains("'b'") && Contains("[None, 6]"));
  CHECK(model.summary_string().find("Connected to") != std::string::npos);
}

TEST_CASE("graph: a shared layer shares its weights; a model is a layer of another", "[graph]") {
  mt::manual_seed(14);
  auto shared = ml::Dense(3, {.name = "shared"});
  auto a = ml::Input({3}, {.name = "left"});
  auto b = ml::Input({3}, {.name = "right"});
  auto diff = ml::Subtract()({shared(a), shared(b)});
  mt::Model siamese({a, b}, {diff}, {.name = "siamese"});
  CHECK(siamese.count_params() == 12);  // one kernel and one bias
  CHECK(siamese.trainable_variables().size() == 2);
  const mt::Tensor x = randn({5, 3});
  // The same input on both sides: exactly zero.
  for (double v : values(siamese({x, x}).front())) CHECK(v == 0.0);
  const std::string summary = siamese.summary_string();
  CHECK_THAT(summary, Contains("shared[0][0], shared[1][0]"));
  CHECK_THAT(summary, Contains("left[0][0]") && Contains("right[0][0]"));

  // The model as a layer: held by a shared_ptr, called on symbolic tensors.
  auto inner_in = ml::Input({3});
  auto inner = std::make_shared<mt::Model>(
      inner_in, ml::Dense(4, {.name = "inner_dense"})(inner_in), mt::ModelOptions{.name = "inner"});
  auto outer_in = ml::Input({3}, {.name = "outer_in"});
  ml::LayerPtr<mt::Model> inner_ptr(inner);
  auto h = inner_ptr(outer_in);
  auto outer_out = ml::Dense(2, {.name = "outer_dense"})(ml::Add()({h, inner_ptr(outer_in)}));
  mt::Model outer(outer_in, outer_out, {.name = "outer"});
  CHECK(outer.count_params() == inner->count_params() + 4 * 2 + 2);
  const mt::Tensor y = outer(x);
  const auto want = values((*outer.get_layer("outer_dense"))((*inner)(x) + (*inner)(x)));
  const auto got = values(y);
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).epsilon(1e-6));
  // A model on the stack cannot be a graph node: the error says what to do.
  auto in2 = ml::Input({3});
  mt::Model on_stack(in2, ml::Dense(1)(in2));
  CHECK_THAT(error_of<mt::ValueError>([&] { on_stack(ml::Input({3})); }), Contains("shared_ptr"));
  // Several outputs of a nested model come back as a vector.
  auto two_in = ml::Input({2});
  auto two = std::make_shared<mt::Model>(
      std::vector<ml::SymbolicTensor>{two_in},
      std::vector<ml::SymbolicTensor>{ml::Dense(1)(two_in), ml::Dense(5)(two_in)});
  const std::vector<ml::SymbolicTensor> outs =
      (*two)(std::vector<ml::SymbolicTensor>{ml::Input({2})});
  REQUIRE(outs.size() == 2);
  CHECK(outs[1].shape() == mt::Shape{-1, 5});
}

TEST_CASE("graph: a layer with two outputs in a graph", "[graph]") {
  auto in = ml::Input({3});
  auto split = ml::make_layer<Split>();
  auto parts = split->apply(std::vector<ml::SymbolicTensor>{in});
  REQUIRE(parts.size() == 2);
  CHECK(parts[1].index() == 1);
  mt::Model model({in}, {ml::Add()({parts[0], parts[1]}), parts[1]});
  const mt::Tensor x = randn({2, 3});
  // One input, two outputs: model(x) would be one tensor; apply() returns every output.
  const std::vector<mt::Tensor> ys = model.apply({x});
  REQUIRE(ys.size() == 2);
  for (double v : values(ys[0])) CHECK(v == 0.0);
  const auto neg = values(ys[1]), vx = values(x);
  for (std::size_t i = 0; i < vx.size(); ++i) CHECK(neg[i] == -vx[i]);
  CHECK_THAT(error_of<mt::ValueError>([&] { split(in); }), Contains("2 outputs"));
  CHECK_THAT(model.summary_string(), Contains("split[0][1]"));
}

TEST_CASE("graph: the checks made when a model is built", "[graph]") {
  auto a = ml::Input({3}, {.name = "x_a"});
  auto b = ml::Input({3}, {.name = "x_b"});
  auto c = ml::Input({3}, {.name = "x_c"});
  auto from_a = ml::Dense(2, {.name = "from_a"})(a);
  auto ab = ml::Add({.name = "ab"})({a, b});
  // An output computed from an input that is not given.
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::Model({a}, {ab}, {.name = "m1"}); }),
             Contains("m1") && Contains("x_b") && Contains("not among the model's inputs"));
  // An input nothing uses.
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::Model({a, c}, {from_a}, {.name = "m2"});
             }),
             Contains("m2") && Contains("x_c") && Contains("not used"));
  // An input that is not an Input(); one given twice; undefined ones.
  CHECK_THAT(error_of<mt::ValueError>([&] { mt::Model({from_a}, {from_a}, {.name = "m3"}); }),
             Contains("Input()") && Contains("from_a"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::Model({a, a}, {from_a}, {.name = "m4"});
             }),
             Contains("twice"));
  CHECK_THROWS_AS(mt::Model({a}, {ml::SymbolicTensor()}), mt::ValueError);
  CHECK_THROWS_AS(mt::Model(std::vector<ml::SymbolicTensor>{}, {from_a}), mt::ValueError);
  // Two different layers of one name.
  auto d1 = ml::Dense(2, {.name = "same"})(a);
  auto d2 = ml::Dense(2, {.name = "same"})(a);
  CHECK_THAT(error_of<mt::ValueError>([&] {
               mt::Model({a}, {ml::Add()({d1, d2})});
             }),
             Contains("same"));
  // The topological order: every layer after the layers it reads.
  auto x = ml::Input({4}, {.name = "order_in"});
  auto h1 = ml::Dense(4, {.name = "h1"})(x);
  auto h2 = ml::Dense(4, {.name = "h2"})(h1);
  auto h3 = ml::Dense(4, {.name = "h3"})(x);
  mt::Model m({x}, {ml::Add({.name = "join"})({h2, h3})});
  std::vector<std::string> names;
  for (const auto& l : m.layers()) names.push_back(l->name());
  CHECK(names == std::vector<std::string>{"order_in", "h1", "h2", "h3", "join"});
}

TEST_CASE("graph: output shapes are inferred without running the layers", "[graph]") {
  int with_rule = 0, without_rule = 0;
  auto in = ml::Input({5});
  auto y = ml::make_layer<Counting>(true, &with_rule)(in);
  CHECK(with_rule == 0);
  CHECK(y.shape() == mt::Shape{-1, 5});
  auto z = ml::make_layer<Counting>(false, &without_rule)(in);
  CHECK(without_rule == 1);  // no rule: one probe on a batch of one
  CHECK(z.shape() == mt::Shape{-1, 5});

  // A model whose weights would take 64 GiB in float32 is described without allocating
  // activations: only the weights are made (here: nothing runs, so it is quick).
  auto big_in = ml::Input({256, 256, 3});
  auto conv = ml::Conv2D(8, 3, {.strides = 2, .padding = "same"})(big_in);
  auto pool = ml::MaxPooling2D({.pool_size = 3, .strides = 2})(conv);
  auto gap = ml::GlobalAveragePooling2D()(pool);
  auto flat = ml::Flatten()(ml::Reshape({2, -1})(gap));
  CHECK(conv.shape() == mt::Shape{-1, 128, 128, 8});
  CHECK(pool.shape() == mt::Shape{-1, 63, 63, 8});
  CHECK(gap.shape() == mt::Shape{-1, 8});
  CHECK(flat.shape() == mt::Shape{-1, 8});
  // The rules agree with what the layers compute, for the padding and stride cases.
  for (const char* padding : {"valid", "same"})
    for (std::int64_t stride : {1, 2, 3})
      for (std::int64_t extent : {7, 8}) {
        INFO(padding << " stride " << stride << " extent " << extent);
        auto c = ml::Conv2D(2, {3, 2}, {.strides = stride, .padding = padding});
        auto p = ml::AveragePooling2D({.pool_size = {2, 3}, .strides = stride, .padding = padding});
        auto sym_in = ml::Input({extent, extent + 1, 3});
        auto sc = c(sym_in);
        auto sp = p(sym_in);
        const mt::Tensor x = randn({2, extent, extent + 1, 3});
        CHECK(c(x).shape() == mt::Shape{2, sc.shape()[1], sc.shape()[2], 2});
        CHECK(p(x).shape() == mt::Shape{2, sp.shape()[1], sp.shape()[2], 3});
      }
  CHECK_THROWS_AS(ml::Reshape({7})(ml::Input({6})), mt::ShapeError);
  CHECK_THROWS_AS(ml::Dense(3)(ml::Input(mt::Shape{})), mt::ShapeError);
}

TEST_CASE("graph: gradients through fan-out, a shared layer and a residual add (float64)",
          "[graph][grad]") {
  mt::PolicyScope scope("float64");
  mt::manual_seed(15);
  auto in = ml::Input({4}, {.dtype = mt::kFloat64});
  auto shared = ml::Dense(4, {.activation = "tanh", .name = "g_shared"});
  auto h = shared(in);               // fan-out of h below
  auto twice = shared(h);            // the shared layer's second call
  auto res = ml::Add()({h, twice});  // residual add
  auto side = ml::Dense(4, {.activation = "sigmoid"})(h);
  auto joined = ml::Multiply()({res, side});
  auto out = ml::Dense(2)(ml::Concatenate()({joined, in}));
  mt::Model model(in, out);
  const mt::Tensor x = randn({3, 4}, mt::kFloat64);

  // With respect to the input.
  CHECK_GRADCHECK("graph input", [&](const mtest::Inputs& v) { return model(v[0]); }, {x});

  // With respect to every weight: the tape against central differences.
  const mt::Tensor r = randn({3, 2}, mt::kFloat64);
  auto loss = [&] { return mt::sum(model(x) * r).item<double>(); };
  std::vector<mt::Variable> vars = model.trainable_variables();
  REQUIRE(vars.size() == 6);  // shared (kernel, bias), side, out: not 8
  std::vector<mt::Tensor> grads;
  {
    mt::GradientTape tape;
    grads = tape.gradient(mt::sum(model(x) * r), vars);
  }
  for (std::size_t k = 0; k < vars.size(); ++k) {
    INFO(vars[k].name());
    REQUIRE(grads[k].defined());
    const auto g = values(grads[k]);
    double* p = vars[k].data<double>();
    for (std::int64_t i = 0; i < vars[k].numel(); ++i) {
      const double saved = p[i], eps = 1e-6;
      p[i] = saved + eps;
      const double up = loss();
      p[i] = saved - eps;
      const double down = loss();
      p[i] = saved;
      CHECK(g[static_cast<std::size_t>(i)] ==
            Approx((up - down) / (2 * eps)).margin(1e-7).epsilon(1e-5));
    }
  }
}

namespace {

// Two inputs, two outputs: "bigger" (is sum(a) > sum(b)?) and "first" (is a[0] + b[0] > 0?).
struct TwoTask {
  mt::Tensor a, b, bigger, first;
};
TwoTask two_task(std::int64_t n, std::uint64_t seed) {
  mt::Generator gen(seed);
  TwoTask t;
  t.a = mt::normal({n, 4}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen);
  t.b = mt::normal({n, 4}, 0.0, 1.0, mt::kFloat32, mt::Device::cpu(), &gen);
  t.bigger = mt::cast(mt::greater(mt::sum(t.a, {1}), mt::sum(t.b, {1})), mt::kInt64);
  t.first =
      mt::cast(mt::greater(t.a.slice(1, 0, 1) + t.b.slice(1, 0, 1), mt::zeros({})), mt::kInt64)
          .reshape({n});
  return t;
}

std::unique_ptr<mt::Model> two_head_model() {
  auto a = ml::Input({4}, {.name = "in_a"});
  auto b = ml::Input({4}, {.name = "in_b"});
  auto h = ml::Dense(16, {.activation = "relu", .name = "trunk"})(ml::Concatenate()({a, b}));
  auto bigger = ml::Dense(2, {.name = "bigger"})(h);
  auto first = ml::Dense(2, {.name = "first"})(ml::Concatenate()({h, a, b}));
  return std::make_unique<mt::Model>(std::vector<ml::SymbolicTensor>{a, b},
                                     std::vector<ml::SymbolicTensor>{bigger, first},
                                     mt::ModelOptions{.name = "two_task"});
}

}  // namespace

TEST_CASE("graph: a two-input two-output model trains with fit", "[graph][training]") {
  mt::manual_seed(21);
  const TwoTask train = two_task(4096, 1), test = two_task(1024, 2);
  auto model = two_head_model();
  const auto ce = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  model->compile({.loss = std::vector<mt::losses::Loss>{ce, ce},
                  .optimizer = mt::optim::Adam({.learning_rate = 0.01}),
                  .metrics = {"accuracy"},
                  .loss_weights = {1.0, 0.5}});
  CHECK(model->output_names() == std::vector<std::string>{"bigger", "first"});
  const mt::History h =
      model->fit({train.a, train.b}, {train.bigger, train.first},
                 {.batch_size = 64,
                  .epochs = 12,
                  .validation_data = {{test.a, test.b}, {test.bigger, test.first}},
                  .seed = 3,
                  .verbose = 0});
  for (const char* key : {"loss", "bigger_loss", "first_loss", "bigger_accuracy", "first_accuracy",
                          "val_bigger_accuracy", "val_first_accuracy"})
    CHECK(h.history.count(key) == 1);
  const mt::Logs scores = model->evaluate({test.a, test.b}, {test.bigger, test.first});
  INFO("bigger " << scores.at("bigger_accuracy") << ", first " << scores.at("first_accuracy"));
  CHECK(scores.at("bigger_accuracy") > 0.99);
  CHECK(scores.at("first_accuracy") > 0.99);
  // The total is the weighted sum of the parts.
  CHECK(scores.at("loss") ==
        Approx(scores.at("bigger_loss") + 0.5 * scores.at("first_loss")).epsilon(1e-5));
  // predict returns both outputs, whole.
  const std::vector<mt::Tensor> p = model->predict({test.a, test.b}, {.batch_size = 100});
  REQUIRE(p.size() == 2);
  CHECK(p[0].shape() == mt::Shape{1024, 2});
  CHECK(p[1].shape() == mt::Shape{1024, 2});
  const auto direct = values(model->apply({test.a, test.b})[1]);
  const auto batched = values(p[1]);
  for (std::size_t i = 0; i < direct.size(); ++i)
    CHECK(batched[i] == Approx(direct[i]).margin(1e-5));
}

TEST_CASE("graph: a custom loop over a Dataset of tuples trains the two-input model",
          "[graph][training]") {
  mt::manual_seed(23);
  const TwoTask train = two_task(2048, 6), test = two_task(1024, 7);
  const auto ce = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  auto compiled = [&] {
    auto model = two_head_model();
    model->compile({.loss = std::vector<mt::losses::Loss>{ce, ce},
                    .optimizer = mt::optim::Adam({.learning_rate = 0.01}),
                    .metrics = {"accuracy"}});
    return model;
  };
  auto from_dataset = compiled();
  auto by_hand = compiled();
  by_hand->set_weights(from_dataset->get_weights());
  // The same batches, from a Dataset of tuples (prefetched) and sliced by hand.
  auto ds = mt::data::Dataset::from_tensors({train.a, train.b}, {train.bigger, train.first})
                .batch(64)
                .prefetch();
  for (int epoch = 0; epoch < 6; ++epoch) {
    for (auto& e : ds) from_dataset->train_step(e.inputs, e.labels);
    for (std::int64_t i = 0; i < 2048; i += 64)
      by_hand->train_step({train.a.slice(0, i, i + 64), train.b.slice(0, i, i + 64)},
                          {train.bigger.slice(0, i, i + 64), train.first.slice(0, i, i + 64)});
  }
  const auto p = from_dataset->predict({test.a, test.b});
  const auto q = by_hand->predict({test.a, test.b});
  CHECK(values(p[0]) == values(q[0]));
  CHECK(values(p[1]) == values(q[1]));
  const mt::Logs scores = from_dataset->evaluate({test.a, test.b}, {test.bigger, test.first});
  INFO("bigger " << scores.at("bigger_accuracy") << ", first " << scores.at("first_accuracy"));
  CHECK(scores.at("bigger_accuracy") > 0.95);
  CHECK(scores.at("first_accuracy") > 0.95);
}

TEST_CASE("graph: losses by output name and weights; a zero weight leaves its head alone",
          "[graph][training]") {
  mt::manual_seed(22);
  const TwoTask t = two_task(256, 5);
  auto model = two_head_model();
  model->compile({.loss = mt::LossMap{{"first", "sparse_categorical_crossentropy"},
                                      {"bigger", "sparse_categorical_crossentropy"}},
                  .optimizer = mt::optim::Adam(),
                  .loss_weights = {1.0, 0.0}});
  const auto head = model->get_layer("first")->get_weights();
  const auto trunk = model->get_layer("trunk")->get_weights();
  model->fit({t.a, t.b}, {t.bigger, t.first}, {.batch_size = 32, .epochs = 1, .verbose = 0});
  const auto head_after = model->get_layer("first")->get_weights();
  for (std::size_t k = 0; k < head.size(); ++k) CHECK(values(head[k]) == values(head_after[k]));
  CHECK(values(trunk[0]) != values(model->get_layer("trunk")->get_weights()[0]));
}

TEST_CASE("graph: training a graph model with the wrong lists is refused", "[graph][training]") {
  const TwoTask t = two_task(64, 6);
  auto model = two_head_model();
  const auto ce = mt::losses::SparseCategoricalCrossentropy({.from_logits = true});
  const auto weights = model->get_weights();
  CHECK_THAT(
      error_of<mt::ValueError>(
          [&] { model->compile({.loss = std::vector<mt::losses::Loss>{ce}}); }),
      Contains("two_task") && Contains("1 losses for 2 outputs") && Contains("bigger, first"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               model->compile({.loss = mt::LossMap{{"bigger", ce}, {"second", ce}}});
             }),
             Contains("'second'") && Contains("bigger, first"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               model->compile({.loss = mt::LossMap{{"bigger", ce}}});
             }),
             Contains("no loss for output 'first'"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               model->compile({.loss = ce, .loss_weights = {1.0, 2.0, 3.0}});
             }),
             Contains("3 loss_weights for 2 outputs"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               model->compile({.loss = ce,
                               .metrics = {std::shared_ptr<mt::metrics::Metric>(
                                   std::make_shared<mt::metrics::Accuracy>())}});
             }),
             Contains("by name"));
  CHECK_FALSE(model->compiled());  // nothing of a refused compile stays
  model->compile({.loss = ce, .metrics = {"accuracy"}});
  CHECK_THAT(error_of<mt::ValueError>([&] {
               model->fit({t.a}, {t.bigger, t.first});
             }),
             Contains("takes 2 inputs") && Contains("got 1"));
  CHECK_THAT(error_of<mt::ValueError>([&] {
               model->fit({t.a, t.b}, {t.bigger});
             }),
             Contains("2 outputs (bigger, first)") && Contains("got 1 label"));
  CHECK_THAT(error_of<mt::ShapeError>([&] {
               model->fit({t.a, t.b.slice(0, 0, 10)}, {t.bigger, t.first});
             }),
             Contains("number of samples"));
  CHECK_THAT(error_of<mt::ValueError>([&] { model->fit(t.a, t.bigger); }),
             Contains("takes 2 inputs"));
  CHECK_THAT(error_of<mt::ValueError>([&] { model->predict(t.a); }), Contains("takes 2 inputs"));
  const auto after = model->get_weights();
  for (std::size_t k = 0; k < weights.size(); ++k) CHECK(values(weights[k]) == values(after[k]));
}
