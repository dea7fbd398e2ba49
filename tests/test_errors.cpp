// Error reporting (exception types and messages) and the dtype tables.
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <string>
#include <typeinfo>
#include <vector>

#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using Catch::Matchers::Contains;

namespace {

mt::Tensor f32(const mt::Shape& shape) { return mt::ones(shape, mt::kFloat32); }

// True when `fn` throws a DTypeError or a KernelNotFoundError (either is right for an op
// that has no kernel for a dtype); the message is returned in `msg`.
template <typename Fn>
bool throws_dtype_or_kernel_error(Fn&& fn, std::string& msg) {
  try {
    fn();
  } catch (const mt::DTypeError& e) {
    msg = e.what();
    return true;
  } catch (const mt::KernelNotFoundError& e) {
    msg = e.what();
    return true;
  } catch (const std::exception& e) {
    msg = std::string("wrong exception type: ") + e.what();
    return false;
  }
  msg = "(no exception)";
  return false;
}

}  // namespace

TEST_CASE("errors: every error type derives from mixtape::Error", "[errors]") {
  CHECK_THROWS_AS(throw mt::ShapeError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::DTypeError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::IndexError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::ValueError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::KernelNotFoundError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::AutogradError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::DeviceError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::NumericError("x"), mt::Error);
  CHECK_THROWS_AS(throw mt::Error("x"), std::runtime_error);
}

TEST_CASE("errors: add with mismatched shapes", "[errors]") {
  const auto a = f32({2, 3});
  const auto b = f32({4});
  CHECK_THROWS_AS(mt::add(a, b), mt::ShapeError);
  CHECK_THROWS_WITH(mt::add(a, b), Contains("add") && Contains("[2, 3]") && Contains("[4]"));
  CHECK_THROWS_AS(a + b, mt::ShapeError);
  CHECK_THROWS_AS(mt::mul(f32({3, 2}), f32({2, 3})), mt::ShapeError);
  CHECK_THROWS_WITH(mt::mul(f32({3, 2}), f32({2, 3})),
                    Contains("mul") && Contains("[3, 2]") && Contains("[2, 3]"));
  CHECK_THROWS_AS(
      mt::where(mt::from_vector(std::vector<bool>{true, false}, {2}), f32({3}), f32({3})),
      mt::ShapeError);
  CHECK_THROWS_AS(mt::broadcast_shapes({2, 3}, {4}, "myop"), mt::ShapeError);
  CHECK_THROWS_WITH(mt::broadcast_shapes({2, 3}, {4}, "myop"), Contains("myop"));
  CHECK(mt::broadcast_shapes({2, 1, 4}, {3, 1}, "ok") == mt::Shape{2, 3, 4});
}

TEST_CASE("errors: matmul inner-dimension mismatch", "[errors]") {
  const auto a = f32({2, 3});
  const auto b = f32({4, 5});
  CHECK_THROWS_AS(mt::matmul(a, b), mt::ShapeError);
  CHECK_THROWS_WITH(mt::matmul(a, b),
                    Contains("matmul") && Contains("[2, 3]") && Contains("[4, 5]"));
  // Batch dimensions that do not broadcast.
  CHECK_THROWS_AS(mt::matmul(f32({2, 3, 4}), f32({3, 4, 5})), mt::ShapeError);
  CHECK_THROWS_WITH(mt::matmul(f32({2, 3, 4}), f32({3, 4, 5})), Contains("matmul"));
}

TEST_CASE("errors: conv2d bias of the wrong shape", "[errors]") {
  const auto x = f32({1, 5, 5, 2}), w = f32({3, 3, 2, 4});
  CHECK_THROWS_AS(mt::conv2d(x, w, f32({3})), mt::ShapeError);
  CHECK_THROWS_WITH(mt::conv2d(x, w, f32({3})),
                    Contains("conv2d") && Contains("bias must be [4]") && Contains("[3]"));
  CHECK_THROWS_AS(mt::conv2d(x, w, f32({1, 4})), mt::ShapeError);
  CHECK_NOTHROW(mt::conv2d(x, w, f32({4})));
}

TEST_CASE("errors: ops without a kernel for the dtype", "[errors]") {
  std::string msg;
  const auto b = mt::from_vector(std::vector<bool>{true, false, true, true}, {2, 2});
  CHECK(throws_dtype_or_kernel_error([&] { (void)mt::matmul(b, b); }, msg));
  CHECK_THAT(msg, Contains("matmul") && Contains("bool"));

  const auto i = mt::from_vector(std::vector<std::int32_t>{1, 2, 3}, {3});
  CHECK(throws_dtype_or_kernel_error([&] { (void)mt::softmax(i, -1); }, msg));
  CHECK_THAT(msg, Contains("softmax") && Contains("int32"));
  CHECK(throws_dtype_or_kernel_error([&] { (void)mt::log_softmax(i, -1); }, msg));
  CHECK_THAT(msg, Contains("log_softmax") && Contains("int32"));

  // A missing kernel names the device too.
  CHECK_THROWS_AS(
      mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, mt::DeviceType::CPU, mt::kBool),
      mt::KernelNotFoundError);
  CHECK_THROWS_WITH(
      mt::find_kernel<mt::kernels::RowFn>(mt::OpId::softmax, mt::DeviceType::CPU, mt::kInt32),
      Contains("softmax") && Contains("cpu") && Contains("int32"));
  CHECK_FALSE(mt::supports(mt::OpId::softmax, mt::DeviceType::CPU, mt::kInt32));
  CHECK(mt::supports(mt::OpId::softmax, mt::DeviceType::CPU, mt::kFloat32));
}

TEST_CASE("errors: unknown dtype name lists the valid names", "[errors]") {
  CHECK_THROWS_AS(mt::DType("float17"), mt::ValueError);
  CHECK_THROWS_WITH(mt::DType("float17"),
                    Contains("float17") && Contains("float32") && Contains("float16") &&
                        Contains("bfloat16") && Contains("float64") && Contains("int32") &&
                        Contains("int64") && Contains("uint8") && Contains("bool"));
  CHECK_THROWS_AS(mt::DType(std::string("")), mt::ValueError);
  CHECK_THROWS_AS(mt::DType(std::string_view("FP99")), mt::ValueError);
  const std::string names = mt::DType::valid_names();
  for (const char* n :
       {"float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8", "bool"})
    CHECK_THAT(names, Contains(n));
}

TEST_CASE("errors: out-of-range axes", "[errors]") {
  const auto x = f32({2, 3});
  CHECK_THROWS_AS(mt::sum(x, {2}), mt::IndexError);
  CHECK_THROWS_AS(mt::sum(x, {-3}), mt::IndexError);
  CHECK_THROWS_AS(mt::mean(x, {5}, true), mt::IndexError);
  CHECK_THROWS_AS(mt::max(x, {2}), mt::IndexError);
  CHECK_THROWS_AS(mt::argmax(x, 2), mt::IndexError);
  CHECK_THROWS_AS(mt::softmax(x, 2), mt::IndexError);
  CHECK_THROWS_WITH(mt::softmax(x, 2), Contains("softmax"));
  CHECK_THROWS_AS(mt::log_softmax(x, -3), mt::IndexError);
  CHECK_THROWS_AS(mt::transpose(x, 0, 2), mt::IndexError);
  CHECK_THROWS_AS(mt::squeeze(x, 4), mt::IndexError);
  CHECK_THROWS_AS(mt::unsqueeze(x, 4), mt::IndexError);
  CHECK_THROWS_AS(mt::slice(x, 2, 0, 1), mt::IndexError);
  CHECK_THROWS_AS(mt::concat({x, x}, 2), mt::IndexError);
  CHECK_THROWS_AS(x.shape().dim(2), mt::IndexError);
  CHECK_THROWS_AS(x.dim(-3), mt::IndexError);
  CHECK(x.dim(-1) == 3);
  CHECK_THROWS_AS(mt::normalize_axis(3, 2, "myop"), mt::IndexError);
  CHECK_THROWS_WITH(mt::normalize_axis(3, 2, "myop"), Contains("myop"));
  CHECK(mt::normalize_axis(-1, 2, "myop") == 1);
}

TEST_CASE("errors: gather index out of range", "[errors]") {
  const auto x = f32({2, 3});
  const auto bad = mt::from_vector(std::vector<std::int64_t>{0, 3, 1, 2}, {2, 2});
  CHECK_THROWS_AS(mt::gather(x, bad, 1), mt::IndexError);
  CHECK_THROWS_WITH(mt::gather(x, bad, 1), Contains("gather"));
  const auto bad0 = mt::from_vector(std::vector<std::int64_t>{0, 2, 1}, {1, 3});
  CHECK_THROWS_AS(mt::gather(x, bad0, 0), mt::IndexError);
  const auto ok = mt::from_vector(std::vector<std::int64_t>{2, 0}, {2, 1});
  CHECK_NOTHROW(mt::gather(x, ok, 1));
}

TEST_CASE("errors: reshape to an incompatible size", "[errors]") {
  const auto x = f32({2, 3});
  CHECK_THROWS_AS(mt::reshape(x, {4}), mt::ShapeError);
  CHECK_THROWS_WITH(mt::reshape(x, {4}),
                    Contains("reshape") && Contains("[2, 3]") && Contains("[4]"));
  CHECK_THROWS_AS(x.reshape({5, -1}), mt::ShapeError);
  CHECK_THROWS_AS(mt::expand(f32({2, 3}), {4, 3}), mt::ShapeError);
  CHECK_THROWS_AS(mt::squeeze(x, 0), mt::Error);  // extent 2, not 1
  CHECK_THROWS_AS(mt::concat({f32({2, 3}), f32({2, 4})}, 0), mt::ShapeError);
  CHECK_THROWS_AS(mt::sum_to(f32({2, 3}), {4}), mt::ShapeError);
}

TEST_CASE("errors: item() on a multi-element tensor", "[errors]") {
  CHECK_THROWS_AS(f32({2, 3}).item<float>(), mt::ShapeError);
  CHECK_THROWS_WITH(f32({2, 3}).item<float>(), Contains("item") && Contains("[2, 3]"));
  CHECK(f32({1, 1}).item<float>() == 1.0f);
  CHECK(f32({}).item<double>() == 1.0);
}

TEST_CASE("errors: typed data() with the wrong dtype", "[errors]") {
  CHECK_THROWS_AS(f32({2}).data<double>(), mt::DTypeError);
  CHECK_THROWS_WITH(f32({2}).data<double>(), Contains("float64") && Contains("float32"));
}

TEST_CASE("errors: tape misuse", "[errors]") {
  mt::Variable x(mt::ones({3}, mt::kFloat32), "x");
  {
    mt::GradientTape tape;
    const auto y = x * 2.0;
    CHECK_THROWS_AS(tape.gradient(y, x.value()), mt::AutogradError);
  }
  {
    mt::GradientTape tape;
    const auto y = mt::sum(x * 2.0);
    CHECK_NOTHROW(tape.gradient(y, x.value()));
    CHECK_THROWS_AS(tape.gradient(y, x.value()), mt::AutogradError);
  }
  {
    // A seed of the wrong shape.
    mt::GradientTape tape;
    const auto y = x * 2.0;
    CHECK_THROWS_AS(tape.gradient(y, x.value(), mt::ones({4})), mt::Error);
  }
}

TEST_CASE("errors: devices", "[errors]") {
  CHECK_THROWS_AS(mt::Device::parse("tpu"), mt::ValueError);
  CHECK_THROWS_WITH(mt::Device::parse("tpu"), Contains("tpu"));
  CHECK_THROWS_AS(mt::Device::parse("cuda:x"), mt::ValueError);
  CHECK(mt::Device::parse("cpu") == mt::Device::cpu());
  CHECK(mt::Device::parse("cuda") == mt::Device::cuda(0));
  CHECK(mt::Device::parse("cuda:1") == mt::Device::cuda(1));
  CHECK(mt::Device::cpu().str() == "cpu");
  CHECK(mt::Device::cuda(1).str() == "cuda:1");
  CHECK(fmt::format("{}", mt::Device::cuda(0)) == "cuda:0");

  const auto t = f32({2});
  const bool has_cuda = mt::has_backend(mt::DeviceType::CUDA) &&
                        mt::backend_for(mt::DeviceType::CUDA).device_count() > 0;
  if (!has_cuda) {
    CHECK_THROWS_AS(t.to(mt::Device::cuda(0)), mt::DeviceError);
    CHECK_THROWS_AS(mt::zeros({2}, mt::kFloat32, mt::Device::cuda(0)), mt::DeviceError);
    CHECK_THROWS_AS(mt::check_device(mt::Device::cuda(0)), mt::DeviceError);
    CHECK_THROWS_AS(mt::cuda::profiler_start(0), mt::DeviceError);
  }
  CHECK_THROWS_AS(t.to(mt::Device::cuda(99)), mt::DeviceError);
  CHECK_THROWS_AS(mt::cuda::profiler_stop(99), mt::DeviceError);
  // The CPU has no profiler range to mark: nothing happens.
  mt::backend_for(mt::DeviceType::CPU).profiler_range(0, true);
  mt::backend_for(mt::DeviceType::CPU).profiler_range(0, false);
  CHECK_NOTHROW(mt::check_device(mt::Device::cpu()));
  CHECK(t.to(mt::Device::cpu()).id() == t.id());  // same device: *this
}

// --- The dtype table ----------------------------------------------------------------

TEST_CASE("dtype: canonical names print and parse", "[errors]") {
  const std::vector<std::pair<mt::DType, std::string>> table = {
      {mt::kFloat32, "float32"}, {mt::kFloat16, "float16"}, {mt::kBFloat16, "bfloat16"},
      {mt::kFloat64, "float64"}, {mt::kInt32, "int32"},     {mt::kInt64, "int64"},
      {mt::kUInt8, "uint8"},     {mt::kBool, "bool"}};
  for (const auto& [dt, name] : table) {
    INFO(name);
    CHECK(dt.name() == name);
    CHECK(fmt::format("{}", dt) == name);
    CHECK(mt::DType(name) == dt);
    CHECK(mt::DType(name.c_str()) == dt);
    CHECK(mt::DType(std::string_view(name)) == dt);
  }
  // all() is in code order.
  for (int i = 0; i < mt::DType::kCount; ++i) CHECK(mt::DType::all()[i].index() == i);
  CHECK(mt::DType::all()[0] == mt::kFloat32);
  CHECK(mt::DType::all()[7] == mt::kBool);
  CHECK(mt::DType() == mt::kFloat32);
}

TEST_CASE("dtype: aliases parse to the canonical dtype", "[errors]") {
  const std::vector<std::pair<std::string, mt::DType>> aliases = {
      {"fp32", mt::kFloat32},   {"float", mt::kFloat32}, {"fp16", mt::kFloat16},
      {"half", mt::kFloat16},   {"bf16", mt::kBFloat16}, {"fp64", mt::kFloat64},
      {"double", mt::kFloat64}, {"int", mt::kInt32},     {"long", mt::kInt64},
      {"byte", mt::kUInt8}};
  for (const auto& [name, dt] : aliases) {
    INFO(name);
    CHECK(mt::DType(name) == dt);
    CHECK(mt::DType(name).name() == mt::DType(std::string(dt.name())).name());
  }
}

TEST_CASE("dtype: itemsize and classification", "[errors]") {
  CHECK(mt::kFloat32.itemsize() == 4);
  CHECK(mt::kFloat16.itemsize() == 2);
  CHECK(mt::kBFloat16.itemsize() == 2);
  CHECK(mt::kFloat64.itemsize() == 8);
  CHECK(mt::kInt32.itemsize() == 4);
  CHECK(mt::kInt64.itemsize() == 8);
  CHECK(mt::kUInt8.itemsize() == 1);
  CHECK(mt::kBool.itemsize() == 1);

  for (mt::DType d : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
    CHECK(d.is_floating());
    CHECK_FALSE(d.is_integral());
  }
  for (mt::DType d : {mt::kInt32, mt::kInt64, mt::kUInt8}) {
    CHECK_FALSE(d.is_floating());
    CHECK(d.is_integral());
    CHECK_FALSE(d.is_reduced_float());
  }
  CHECK_FALSE(mt::kBool.is_floating());
  CHECK_FALSE(mt::kBool.is_integral());
  CHECK(mt::kFloat16.is_reduced_float());
  CHECK(mt::kBFloat16.is_reduced_float());
  CHECK_FALSE(mt::kFloat32.is_reduced_float());
  CHECK_FALSE(mt::kFloat64.is_reduced_float());
  static_assert(mt::kFloat16.is_floating() && !mt::kInt32.is_floating());
}

TEST_CASE("dtype: promote_types", "[errors]") {
  using mt::promote_types;
  const mt::DType all[] = {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64,
                           mt::kInt32,   mt::kInt64,   mt::kUInt8,    mt::kBool};
  // Equal dtypes stay; promotion is symmetric.
  for (mt::DType a : all) {
    CHECK(promote_types(a, a) == a);
    for (mt::DType b : all) {
      INFO(a.name() << " , " << b.name());
      CHECK(promote_types(a, b) == promote_types(b, a));
    }
  }
  // Two floating dtypes: the wider; float16 with bfloat16 gives float32.
  CHECK(promote_types(mt::kFloat16, mt::kFloat32) == mt::kFloat32);
  CHECK(promote_types(mt::kBFloat16, mt::kFloat32) == mt::kFloat32);
  CHECK(promote_types(mt::kFloat16, mt::kBFloat16) == mt::kFloat32);
  CHECK(promote_types(mt::kBFloat16, mt::kFloat16) == mt::kFloat32);
  CHECK(promote_types(mt::kFloat32, mt::kFloat64) == mt::kFloat64);
  CHECK(promote_types(mt::kFloat16, mt::kFloat64) == mt::kFloat64);
  CHECK(promote_types(mt::kBFloat16, mt::kFloat64) == mt::kFloat64);
  // Integer or bool with a floating dtype: the floating dtype.
  for (mt::DType f : {mt::kFloat32, mt::kFloat16, mt::kBFloat16, mt::kFloat64}) {
    for (mt::DType i : {mt::kInt32, mt::kInt64, mt::kUInt8, mt::kBool}) {
      INFO(f.name() << " , " << i.name());
      CHECK(promote_types(f, i) == f);
      CHECK(promote_types(i, f) == f);
    }
  }
  // Two integer dtypes: the wider.
  CHECK(promote_types(mt::kInt32, mt::kInt64) == mt::kInt64);
  CHECK(promote_types(mt::kUInt8, mt::kInt32) == mt::kInt32);
  CHECK(promote_types(mt::kUInt8, mt::kInt64) == mt::kInt64);
  CHECK(promote_types(mt::kBool, mt::kBool) == mt::kBool);

  // Binary ops use it.
  const auto h = mt::ones({2}, mt::kFloat16);
  const auto bf = mt::ones({2}, mt::kBFloat16);
  CHECK((h + bf).dtype() == mt::kFloat32);
  CHECK((h * mt::ones({2}, mt::kFloat64)).dtype() == mt::kFloat64);
  CHECK((mt::ones({2}, mt::kInt32) + h).dtype() == mt::kFloat16);
}

namespace {
// Throws E("inner"), catches it as an Error and re-throws it with a prefix.
template <typename E>
void check_rethrow_keeps_type() {
  INFO(typeid(E).name());
  try {
    try {
      throw E("inner");
    } catch (const mt::Error& e) {
      e.rethrow_with_prefix("layer 'x' (Dense): ");
    }
  } catch (const E& e) {
    CHECK(typeid(e) == typeid(E));
    CHECK(std::string(e.what()) == "layer 'x' (Dense): inner");
    return;
  } catch (...) {
  }
  FAIL("re-thrown as another type");
}
}  // namespace

TEST_CASE("errors: re-thrown with a prefix, every error type keeps its type", "[errors]") {
  check_rethrow_keeps_type<mt::Error>();
  check_rethrow_keeps_type<mt::ShapeError>();
  check_rethrow_keeps_type<mt::DTypeError>();
  check_rethrow_keeps_type<mt::IndexError>();
  check_rethrow_keeps_type<mt::ValueError>();
  check_rethrow_keeps_type<mt::IOError>();
  check_rethrow_keeps_type<mt::KernelNotFoundError>();
  check_rethrow_keeps_type<mt::AutogradError>();
  check_rethrow_keeps_type<mt::NumericError>();
  check_rethrow_keeps_type<mt::DeviceError>();
  check_rethrow_keeps_type<mt::OutOfMemoryError>();
}

TEST_CASE("errors: a layer names itself in front of an IOError and keeps its type", "[errors]") {
  // A layer whose call fails with an IOError (say, a file it reads): the error that comes
  // out of the model is still an IOError, with the layer's name in front.
  struct Reader : mt::layers::Layer {
    Reader() : Layer(mt::layers::LayerOptions{.name = "reader"}) {}
    std::string class_name() const override { return "Reader"; }
    mt::Tensor call(const mt::Tensor&, const mt::CallContext&) override {
      throw mt::IOError("cannot read 'weights.bin'");
    }
  };
  auto layer = std::make_shared<Reader>();
  CHECK_THROWS_AS((*layer)(mt::ones({2, 3})), mt::IOError);
  CHECK_THROWS_WITH((*layer)(mt::ones({2, 3})),
                    Contains("layer 'reader' (Reader): cannot read 'weights.bin'"));
}
