// The conformance sweep (mixtape-ops): every kernel a backend registers for an op of the op
// table (mixtape/core/op_table.h) is run on random inputs and compared with the CPU
// backend's float64 kernel on the same values, in the spirit of ggml's test-backend-ops.
//
// A driver per kernel signature builds the cases (several shapes: broadcasting, strided
// views, empty and odd sizes; an op-specific input domain) and calls the kernel through the
// dispatch table, as the ops of mixtape/autograd would. The reference is the CPU kernel of
// the same op for float64 on the same values (every dtype's values are exact in float64),
// rounded to the output dtype; floating results must agree within the output dtype's
// tolerance (tolerance(), the one place they are stated), everything else exactly.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "mixtape/core/device.h"
#include "mixtape/core/dispatch.h"
#include "mixtape/core/tensor.h"

namespace mixtape::conformance {

// A result `got` agrees with `want` when
//   |got - want| <= atol + rtol * |want| + acc * (scale.abs + scale.rel * |want|)
// The first two terms are the output dtype's rounding (a few units in the last place: the
// reduced-float kernels compute in float32 and round once); the last is the accumulation's
// (float32's for every dtype but float64), times the size of what a result sums: scale.abs
// bounds the sum of the magnitudes of its terms (k for a matmul of depth k over values in
// [-1, 1]), scale.rel its length where the error is relative (softmax's row sums).
struct Tolerance {
  double rtol;
  double atol;
  double acc;
};
struct Scale {
  double abs = 0.0;
  double rel = 0.0;
};
Tolerance tolerance(DType dtype);

// One (op, dtype, device) under test: its random generator, and what failed.
class Context {
 public:
  Context(OpId op, DType dtype, Device device, std::uint64_t seed);

  OpId op() const { return op_; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  // Uniform in [lo, hi) (integers: whole numbers in [lo, hi]).
  double uniform(double lo, double hi);
  std::int64_t integer(std::int64_t lo, std::int64_t hi);

  // A tensor under test and the reference's copy of it: `tested` in the dtype under test on
  // the device, `ref` the same values in float64 (integers and bools too) on the CPU.
  struct Pair {
    Tensor tested, ref;
  };
  // Values from `draw` (called once per element) stored in the dtype under test; the
  // reference holds what the dtype stored, read back, in float64.
  Pair make(const Shape& shape, const std::function<double()>& draw);
  // The same in another dtype (optimizer slots, where's condition): the reference is in
  // float64 for a floating dtype, in that dtype otherwise.
  Pair make(const Shape& shape, const std::function<double()>& draw, DType dtype);
  // Uniform values in [lo, hi).
  Pair uniform(const Shape& shape, double lo, double hi);
  // The same view (shape, strides in elements, offset) of both.
  static Pair view(const Pair& base, const Shape& shape, const Strides& strides,
                   std::int64_t offset = 0);
  // A view of `t` broadcast to `shape` (stride 0 on the broadcast axes).
  static Pair broadcast(const Pair& t, const Shape& shape);
  // An int64 tensor (the same on both sides: indices are not the dtype under test).
  Pair indices(const Shape& shape, std::int64_t lo, std::int64_t hi);
  // An output in the dtype under test, NaN on the device (elements a kernel leaves unwritten
  // show) and float64 for the reference.
  Pair output(const Shape& shape);
  // In another dtype: the reference's is float64 for a floating dtype, that dtype otherwise
  // (comparisons write bool, argmax int64).
  Pair output(const Shape& shape, DType dtype);

  // Compares the kernel's output with the reference's (rounded to the output's dtype
  // first). `what` names the case in the failure message; `integer_division`: the
  // reference's quotients are truncated toward zero (the integer kernels' rule).
  void expect_close(const std::string& what, const Tensor& got, const Tensor& ref, Scale scale = {},
                    bool integer_division = false);
  // Bit-exact comparison (copies, fills, casts, indices).
  void expect_equal(const std::string& what, const Tensor& got, const Tensor& ref);
  // Whether expect_close would pass, without counting a case or recording a failure: for a
  // kernel that may take one of two documented paths, to choose the reference.
  bool is_close(const Tensor& got, const Tensor& ref, Scale scale = {}) const;

  int cases() const { return cases_; }
  const std::vector<std::string>& failures() const { return failures_; }

 private:
  void fail(const std::string& what, const std::string& detail);
  Pair make_as(const Shape& shape, const std::function<double()>& draw, DType dtype,
               DType ref_dtype);
  Pair output_as(const Shape& shape, DType dtype, DType ref_dtype);
  void compare(const std::string& what, const Tensor& got, const Tensor& ref, Scale scale,
               bool integer_division, bool exact);
  // The elements of got beyond the tolerance of ref, the first of them and the largest error.
  struct Mismatch {
    std::size_t elements = 0, bad = 0, first = 0;
    double got = 0.0, want = 0.0, worst = 0.0;
  };
  Mismatch mismatch(const Tensor& got, const Tensor& ref, Scale scale, bool integer_division,
                    bool exact) const;

  OpId op_;
  DType dtype_;
  Device device_;
  std::mt19937_64 rng_;
  int cases_ = 0;
  std::vector<std::string> failures_;
};

// The kernel of (op, dtype) on the device under test, and the CPU's float64 reference.
template <typename Fn>
Fn* tested_kernel(const Context& c) {
  return find_kernel<Fn>(c.op(), c.device().type(), c.dtype()).raw();
}
template <typename Fn>
Fn* reference_kernel(const Context& c) {
  return find_kernel<Fn>(c.op(), DeviceType::CPU, kFloat64).raw();
}

// Whether the sweep has a driver for the op's kernel signature.
bool has_driver(OpId op);
// Runs every case of (op, dtype) on the context's device.
void run_cases(Context& c);

}  // namespace mixtape::conformance
