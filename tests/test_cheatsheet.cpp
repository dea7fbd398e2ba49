// The dtype cheat sheet (seed 000): for every layer dtype x input dtype x the "fp16 op uses
// fp32 compute" switch, the weight, computation and output dtypes of a Dense layer are
// exactly the table's. The computation column is checked twice: as the trace reports it,
// and numerically (4096 ones summed by the layer's matmul stop at 2048 in float16
// accumulation, 256 in bfloat16).
#include <fmt/format.h>

#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "mixtape/mixtape.h"

namespace mt = mixtape;

namespace {

struct CheatRow {
  const char* layer;  // policy name
  mt::DType input;
  bool use_fp32_compute;
  mt::DType weight;       // storage
  mt::DType weight_read;  // inside call()
  mt::DType computation;
  mt::DType output;
};

// Seed 000's twelve rows, then their bfloat16 analogues.
const std::vector<CheatRow> kTable = {
    {"float32", mt::kFloat32, true, mt::kFloat32, mt::kFloat32, mt::kFloat32, mt::kFloat32},
    {"float32", mt::kFloat32, false, mt::kFloat32, mt::kFloat32, mt::kFloat32, mt::kFloat32},
    {"float32", mt::kFloat16, true, mt::kFloat32, mt::kFloat32, mt::kFloat32, mt::kFloat32},
    {"float32", mt::kFloat16, false, mt::kFloat32, mt::kFloat32, mt::kFloat32, mt::kFloat32},
    {"float16", mt::kFloat32, true, mt::kFloat16, mt::kFloat16, mt::kFloat32, mt::kFloat16},
    {"float16", mt::kFloat32, false, mt::kFloat16, mt::kFloat16, mt::kFloat16, mt::kFloat16},
    {"float16", mt::kFloat16, true, mt::kFloat16, mt::kFloat16, mt::kFloat32, mt::kFloat16},
    {"float16", mt::kFloat16, false, mt::kFloat16, mt::kFloat16, mt::kFloat16, mt::kFloat16},
    {"mixed_float16", mt::kFloat32, true, mt::kFloat32, mt::kFloat16, mt::kFloat32, mt::kFloat16},
    {"mixed_float16", mt::kFloat32, false, mt::kFloat32, mt::kFloat16, mt::kFloat16, mt::kFloat16},
    {"mixed_float16", mt::kFloat16, true, mt::kFloat32, mt::kFloat16, mt::kFloat32, mt::kFloat16},
    {"mixed_float16", mt::kFloat16, false, mt::kFloat32, mt::kFloat16, mt::kFloat16, mt::kFloat16},
    // bfloat16 analogues
    {"float32", mt::kBFloat16, true, mt::kFloat32, mt::kFloat32, mt::kFloat32, mt::kFloat32},
    {"float32", mt::kBFloat16, false, mt::kFloat32, mt::kFloat32, mt::kFloat32, mt::kFloat32},
    {"bfloat16", mt::kFloat32, true, mt::kBFloat16, mt::kBFloat16, mt::kFloat32, mt::kBFloat16},
    {"bfloat16", mt::kFloat32, false, mt::kBFloat16, mt::kBFloat16, mt::kBFloat16, mt::kBFloat16},
    {"bfloat16", mt::kBFloat16, true, mt::kBFloat16, mt::kBFloat16, mt::kFloat32, mt::kBFloat16},
    {"bfloat16", mt::kBFloat16, false, mt::kBFloat16, mt::kBFloat16, mt::kBFloat16, mt::kBFloat16},
    {"mixed_bfloat16", mt::kFloat32, true, mt::kFloat32, mt::kBFloat16, mt::kFloat32,
     mt::kBFloat16},
    {"mixed_bfloat16", mt::kFloat32, false, mt::kFloat32, mt::kBFloat16, mt::kBFloat16,
     mt::kBFloat16},
    {"mixed_bfloat16", mt::kBFloat16, true, mt::kFloat32, mt::kBFloat16, mt::kFloat32,
     mt::kBFloat16},
    {"mixed_bfloat16", mt::kBFloat16, false, mt::kFloat32, mt::kBFloat16, mt::kBFloat16,
     mt::kBFloat16},
};

// What a sum of n ones gives when accumulated in `dt`.
double ones_sum(mt::DType dt, int n) {
  if (dt == mt::kFloat16) return std::min(n, 2048);
  if (dt == mt::kBFloat16) return std::min(n, 256);
  return n;
}

std::string cell(mt::DType stored, mt::DType used) {
  return stored == used ? std::string(stored.name())
                        : fmt::format("{}(=>{})", stored.name(), used.name());
}

}  // namespace

TEST_CASE("cheat sheet: every layer dtype x input dtype x compute switch", "[cheatsheet]") {
  constexpr int kIn = 4096;
  std::string table = fmt::format("{:<15}{:<20}{:<8}{:<20}{:<13}{}\n", "Layer", "Input", "Switch",
                                  "Weight", "Computation", "Output");
  for (const CheatRow& row : kTable) {
    INFO("layer " << row.layer << ", input " << row.input.name() << ", switch "
                  << row.use_fp32_compute);
    mt::Fp16UseFp32ComputeScope mode(row.use_fp32_compute);
    mt::PolicyScope global(row.layer);  // the layer takes the global policy
    auto dense = mt::layers::Dense(
        1, {.use_bias = false, .kernel_initializer = mt::init::ones(), .name = "cheat"});
    const mt::Tensor x = mt::ones({1, kIn}, row.input);

    mt::DTypeTrace trace = mt::trace_dtypes(dense, x);
    REQUIRE(trace.rows.size() == 1);
    const mt::DTypeTraceRow& r = trace.rows[0];
    const mt::DType compute = mt::Policy(row.layer).compute_dtype();
    CHECK(r.input == row.input);
    CHECK(r.input_cast == compute);  // floating inputs are cast to the compute dtype
    REQUIRE(r.weight.has_value());
    CHECK(*r.weight == row.weight);
    CHECK(*r.weight_read == row.weight_read);
    CHECK(r.computation == row.computation);
    CHECK(r.output == row.output);
    CHECK(dense->kernel().dtype() == row.weight);  // the storage dtype

    // The computation column, numerically.
    const mt::Tensor y = dense(x);
    CHECK(y.dtype() == row.output);
    CHECK(y.item<double>() == ones_sum(row.computation, kIn));

    // The gradient of a weight comes back in its storage dtype.
    mt::GradientTape tape;
    const mt::Tensor g = tape.gradient(mt::sum(dense(x)), dense->kernel());
    REQUIRE(g.defined());
    CHECK(g.dtype() == row.weight);

    table += fmt::format("{:<15}{:<20}{:<8}{:<20}{:<13}{}\n", row.layer,
                         cell(r.input, r.input_cast), row.use_fp32_compute ? 1 : 0,
                         cell(*r.weight, *r.weight_read), r.computation.name(), r.output.name());
  }
  // The table as mixtape produced it (in the CTest log).
  fmt::print("{}", table);
}

TEST_CASE("cheat sheet: integer inputs are never cast", "[cheatsheet]") {
  mt::PolicyScope global("mixed_float16");
  auto embedding = mt::layers::Embedding(10, 4);
  const mt::Tensor ids = mt::from_vector<std::int64_t>({1, 2, 3}, {3});
  mt::DTypeTrace trace = mt::trace_dtypes(embedding, ids);
  REQUIRE(trace.rows.size() == 1);
  CHECK(trace.rows[0].input == mt::kInt64);
  CHECK(trace.rows[0].input_cast == mt::kInt64);
  CHECK(trace.rows[0].output == mt::kFloat16);
  CHECK(embedding->embeddings().dtype() == mt::kFloat32);
}
