// Dtype policies, the global policy, loss scales and autocast scopes.
#include <catch2/catch.hpp>
#include <string>

#include "mixtape/mixtape.h"

namespace mt = mixtape;

TEST_CASE("policy: the named policies and their dtypes", "[policy]") {
  struct Row {
    const char* name;
    mt::DType compute, variable;
    bool dynamic_scale;
  };
  const Row rows[] = {
      {"float32", mt::kFloat32, mt::kFloat32, false},
      {"float64", mt::kFloat64, mt::kFloat64, false},
      {"float16", mt::kFloat16, mt::kFloat16, false},
      {"bfloat16", mt::kBFloat16, mt::kBFloat16, false},
      {"mixed_float16", mt::kFloat16, mt::kFloat32, true},
      {"mixed_bfloat16", mt::kBFloat16, mt::kFloat32, false},
  };
  for (const auto& r : rows) {
    INFO(r.name);
    const mt::Policy p(r.name);
    CHECK(p.name() == r.name);
    CHECK(p.compute_dtype() == r.compute);
    CHECK(p.variable_dtype() == r.variable);
    CHECK(p.loss_scale().has_value() == r.dynamic_scale);
    if (r.dynamic_scale) {
      CHECK(p.loss_scale()->is_dynamic());
      CHECK(p.loss_scale()->initial_scale() == 32768.0);
      CHECK(p.loss_scale()->growth_interval() == 2000);
      CHECK(p.loss_scale()->multiplier() == 2.0);
    }
    CHECK(p.is_mixed() == (r.compute != r.variable));
  }
}

TEST_CASE("policy: an unknown name throws and lists the valid names", "[policy]") {
  try {
    mt::Policy p("mixed_float4");
    FAIL("no exception");
  } catch (const mt::ValueError& e) {
    const std::string what = e.what();
    CHECK(what.find("mixed_float4") != std::string::npos);
    CHECK(what.find("float32, float64, float16, bfloat16, mixed_float16, mixed_bfloat16, "
                    "mixed_float8") != std::string::npos);
  }
}

TEST_CASE("policy: a number is a fixed loss scale, as in the guide", "[policy]") {
  const mt::Policy fixed("mixed_float16", 1024.0);
  REQUIRE(fixed.loss_scale().has_value());
  CHECK_FALSE(fixed.loss_scale()->is_dynamic());
  CHECK(fixed.loss_scale()->initial_scale() == 1024.0);
  CHECK(fixed.loss_scale()->str() == "FixedLossScale(1024)");
  CHECK(fmt::format("{}", fixed) == "<Policy \"mixed_float16\", loss_scale=FixedLossScale(1024)>");
  CHECK(fmt::format("{}", mt::Policy("float32")) == "<Policy \"float32\">");
  CHECK(fmt::format("{}", mt::Policy("mixed_float16")) ==
        "<Policy \"mixed_float16\", loss_scale=DynamicLossScale(initial_scale=32768, "
        "growth_interval=2000, multiplier=2, min_scale=1)>");

  const mt::Policy custom("mixed_float16",
                          mt::LossScale::dynamic({.initial_scale = 256, .growth_interval = 10}));
  CHECK(custom.loss_scale()->initial_scale() == 256.0);
  CHECK(custom.loss_scale()->growth_interval() == 10);
}

TEST_CASE("policy: bad loss scales throw", "[policy]") {
  CHECK_THROWS_AS(mt::LossScale::fixed(0.0), mt::ValueError);
  CHECK_THROWS_AS(mt::LossScale::fixed(-1.0), mt::ValueError);
  CHECK_THROWS_AS(mt::LossScale::fixed(INFINITY), mt::ValueError);
  CHECK_THROWS_AS(mt::LossScale::dynamic({.growth_interval = 0}), mt::ValueError);
  CHECK_THROWS_AS(mt::LossScale::dynamic({.multiplier = 1.0}), mt::ValueError);
  CHECK_THROWS_AS(mt::LossScale::dynamic({.initial_scale = 2.0, .min_scale = 4.0}), mt::ValueError);
}

TEST_CASE("policy: the global policy defaults to float32 and a scope restores it", "[policy]") {
  CHECK(mt::global_policy().name() == "float32");
  {
    mt::PolicyScope scope("mixed_bfloat16");
    CHECK(mt::global_policy().name() == "mixed_bfloat16");
    {
      mt::PolicyScope inner(mt::Policy("float16"));
      CHECK(mt::global_policy().name() == "float16");
    }
    CHECK(mt::global_policy().name() == "mixed_bfloat16");
  }
  CHECK(mt::global_policy().name() == "float32");
}

TEST_CASE("policy: layers read the global policy when they are made", "[policy][layers]") {
  mt::PolicyScope scope("mixed_float16");
  auto a = mt::layers::Dense(4);
  mt::set_global_policy("float32");  // later changes leave existing layers alone
  auto b = mt::layers::Dense(4);
  CHECK(a->dtype_policy().name() == "mixed_float16");
  CHECK(a->compute_dtype() == mt::kFloat16);
  CHECK(a->variable_dtype() == mt::kFloat32);
  CHECK(b->dtype_policy().name() == "float32");
  // The dtype option overrides the global policy, by name or as a Policy.
  auto c = mt::layers::Dense(4, {.dtype = "bfloat16"});
  auto d = mt::layers::Activation("softmax", {.dtype = mt::Policy("float32")});
  CHECK(c->compute_dtype() == mt::kBFloat16);
  CHECK(c->variable_dtype() == mt::kBFloat16);
  CHECK(d->compute_dtype() == mt::kFloat32);
}

TEST_CASE("autocast: variables flagged autocast are read in the scope's dtype", "[autocast]") {
  mt::Variable w(mt::uniform({3}, 0.5, 1.5), "w");
  mt::Variable plain(mt::uniform({3}, 0.5, 1.5), "plain");
  w.set_autocast(true);
  const mt::Tensor x = mt::uniform({3}, -1.0, 1.0, mt::kFloat16);
  CHECK((x * w).dtype() == mt::kFloat32);  // no scope: promotion to float32
  mt::GradientTape tape;
  mt::Tensor y;
  {
    mt::AutocastScope scope(mt::kFloat16);
    CHECK(mt::autocast_dtype() == mt::kFloat16);
    y = x * w;
    CHECK(y.dtype() == mt::kFloat16);
    CHECK((x * plain).dtype() == mt::kFloat32);                // not flagged: untouched
    CHECK(mt::cast(w, mt::kFloat64).dtype() == mt::kFloat64);  // explicit casts win
  }
  CHECK_FALSE(mt::autocast_dtype().has_value());
  // The gradient goes back to the variable in its own dtype.
  const mt::Tensor g = tape.gradient(mt::sum(y), w);
  REQUIRE(g.defined());
  CHECK(g.dtype() == mt::kFloat32);
  const auto gv = g.to_vector<double>();
  const auto xv = x.to_vector<double>();
  for (std::size_t i = 0; i < gv.size(); ++i) CHECK(gv[i] == Approx(xv[i]));
}
