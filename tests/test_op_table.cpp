// The op table (mixtape/core/op_table.h) and what is generated from it: op ids and names,
// the kernels each backend registers, the AMP names and default lists, the checks at
// registration and at start-up.
#include <algorithm>
#include <catch2/catch.hpp>
#include <set>
#include <string>

#include "core/registry_init.h"
#include "mixtape/core/kernels.h"
#include "mixtape/mixtape.h"

namespace mt = mixtape;
using Catch::Matchers::Contains;

TEST_CASE("op table: names are unique and found by name", "[op_table]") {
  std::set<std::string> names;
  for (int i = 0; i < mt::kOpCount; ++i) {
    const auto op = static_cast<mt::OpId>(i);
    INFO(mt::op_name(op));
    CHECK(names.insert(mt::op_name(op)).second);
    REQUIRE(mt::op_by_name(mt::op_name(op)));
    CHECK(*mt::op_by_name(mt::op_name(op)) == op);
    // An op with a kernel requires some dtypes; a view or composition requires none.
    CHECK(mt::op_info(op).has_kernel == !mt::op_info(op).dtypes.empty());
  }
  CHECK_FALSE(mt::op_by_name("lt"));  // the comparisons carry their public names
  CHECK(mt::op_by_name("less") == mt::OpId::less);
  CHECK(mt::op_info(mt::OpId::gelu).kernel == "UnaryFn");
  CHECK(mt::op_info(mt::OpId::reshape).kernel == "NoKernel");
  CHECK(mt::op_info(mt::OpId::matmul).dtypes == mt::dtype_sets::Floating);
  CHECK(mt::op_info(mt::OpId::add).dtypes.contains(mt::kInt32));
  CHECK_FALSE(mt::op_info(mt::OpId::argmax).differentiable);
  CHECK(mt::dtype_sets::Numeric.str() == "float32, float16, bfloat16, float64, int32, int64");
  CHECK(mt::dtype_sets::None.str() == "none");
}

TEST_CASE("op table: the CPU backend registers exactly the dtypes the table requires",
          "[op_table]") {
  for (int i = 0; i < mt::kOpCount; ++i) {
    const auto op = static_cast<mt::OpId>(i);
    for (int d = 0; d < mt::DType::kCount; ++d) {
      const mt::DType dt = mt::DType::all()[d];
      INFO(mt::op_name(op) << " " << dt.name());
      CHECK(mt::supports(op, mt::DeviceType::CPU, dt) == mt::op_info(op).dtypes.contains(dt));
    }
  }
  // The printable table lists the ops with kernels only.
  const std::string table = mt::kernel_table();
  CHECK_THAT(table, Contains("greater_equal") && Contains("adam_update"));
  CHECK_THAT(table, !Contains("reshape"));
}

TEST_CASE("op table: the AMP names and default lists come from the table", "[op_table]") {
  std::set<std::string> names;
  for (auto n : mt::amp_op_names()) names.insert(std::string(n));
  CHECK(names.count("less"));
  CHECK(names.count("reshape"));
  CHECK_FALSE(names.count("lt"));
  CHECK_FALSE(names.count("to_device"));
  CHECK_FALSE(names.count("conv2d_backward_input"));
  CHECK_FALSE(names.count("adam_update"));
  // Every op the lists name by default is one of them, in the table's category.
  const auto lists = mt::AmpLists::defaults();
  CHECK(lists.category("matmul") == mt::AmpCategory::Allow);
  CHECK(lists.category("softmax") == mt::AmpCategory::Infer);
  CHECK(lists.category("sum") == mt::AmpCategory::Deny);
  CHECK(lists.category("less") == mt::AmpCategory::Clear);
  for (auto c : {mt::AmpCategory::Allow, mt::AmpCategory::Infer, mt::AmpCategory::Deny,
                 mt::AmpCategory::Clear})
    for (const auto& op : lists.ops(c)) CHECK(names.count(op));
  std::size_t listed = 0;
  for (auto c : {mt::AmpCategory::Allow, mt::AmpCategory::Infer, mt::AmpCategory::Deny,
                 mt::AmpCategory::Clear})
    listed += lists.ops(c).size();
  CHECK(listed == names.size());  // every name has its default category
}

TEST_CASE("op table: a kernel of another signature, or for an op without kernels, is refused",
          "[op_table]") {
  auto gemm =
      mt::find_kernel<mt::kernels::GemmFn>(mt::OpId::matmul, mt::DeviceType::CPU, mt::kFloat32)
          .raw();
  CHECK_THROWS_WITH(mt::register_kernel<mt::kernels::GemmFn>(mt::OpId::neg, mt::DeviceType::CPU,
                                                             mt::kFloat32, gemm),
                    Contains("neg") && Contains("signature"));
  CHECK_THROWS_WITH(mt::register_kernel<mt::kernels::GemmFn>(mt::OpId::reshape, mt::DeviceType::CPU,
                                                             mt::kFloat32, gemm),
                    Contains("reshape") && Contains("no kernel"));
  // Nothing was replaced.
  CHECK(mt::neg(mt::full({2}, 3.0)).to_vector<float>() == std::vector<float>{-3.0f, -3.0f});
}

// Run in a process of its own (tests/CMakeLists.txt): it takes a kernel out of the table.
TEST_CASE("op table: a backend missing a kernel the table requires is named at start-up",
          "[.kernel_coverage]") {
  mt::detail::ensure_backends();
  mt::detail::register_kernel(mt::OpId::gelu, mt::DeviceType::CPU, mt::kBFloat16, nullptr,
                              typeid(mt::kernels::UnaryFn*));
  CHECK_THROWS_WITH(mt::detail::check_kernel_coverage(mt::DeviceType::CPU),
                    Contains("cpu") && Contains("gelu for bfloat16") && Contains("op_table.h"));
}
