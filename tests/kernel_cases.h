// Shared by the kernel tests (tests/test_cpu_*.cpp, tests/cuda/*.cpp): matmul cases laid
// out with leading-dimension gaps and batch strides, conv2d geometries with TensorFlow's
// padding rules, NaN-poisoned outputs that show unwritten elements, and the optimizer
// update variants.
#pragma once

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "mixtape/core/kernels.h"
#include "mixtape/core/tensor.h"

namespace mtest {

namespace mt = mixtape;

// Random values in [lo, hi) that are never all zero.
inline mt::Tensor random(const mt::Shape& shape, mt::DType dt, double lo = -1.0, double hi = 1.0) {
  mt::Tensor t = mt::uniform(shape, lo, hi, dt);
  const auto v = t.to_vector<double>();
  REQUIRE(std::any_of(v.begin(), v.end(), [](double x) { return x != 0.0; }));
  return t;
}

// Fills a floating tensor with NaN, so elements a kernel fails to write show up.
inline void poison(const mt::Tensor& t) {
  const auto n = static_cast<std::size_t>(t.numel());
  if (t.dtype() == mt::kFloat32) {
    std::fill_n(t.data<float>(), n, std::numeric_limits<float>::quiet_NaN());
  } else if (t.dtype() == mt::kFloat64) {
    std::fill_n(t.data<double>(), n, std::numeric_limits<double>::quiet_NaN());
  } else if (t.dtype() == mt::kFloat16) {
    std::fill_n(t.data<mt::half>(), n, mt::half::from_bits(0x7e00));
  } else {
    std::fill_n(t.data<mt::bfloat16>(), n, mt::bfloat16::from_bits(0x7fc0));
  }
}

inline mt::Tensor empty_poisoned(const mt::Shape& shape, mt::DType dt) {
  mt::Tensor t = mt::Tensor::empty(shape, dt);
  poison(t);
  return t;
}

// A matmul case: batch x [m x k] x [k x n], transposes, leading-dimension gaps and
// batch-shared operands.
struct GemmCase {
  std::int64_t batch, m, n, k;
  bool ta, tb;
  std::int64_t pad_a, pad_b, pad_c;  // extra leading-dimension elements
  bool share_a, share_b;             // batch stride 0
};

// The kernel arguments of a case, on random operands of `dt` and a poisoned output. A and
// B carry a gap of two elements between batch items.
inline mt::kernels::GemmArgs gemm_args(const GemmCase& cs, mt::DType dt, double lo = -1.0,
                                       double hi = 1.0) {
  const std::int64_t rows_a = cs.ta ? cs.k : cs.m, cols_a = cs.ta ? cs.m : cs.k;
  const std::int64_t rows_b = cs.tb ? cs.n : cs.k, cols_b = cs.tb ? cs.k : cs.n;
  mt::kernels::GemmArgs g;
  g.batch = cs.batch, g.m = cs.m, g.n = cs.n, g.k = cs.k;
  g.trans_a = cs.ta, g.trans_b = cs.tb;
  g.lda = cols_a + cs.pad_a;
  g.ldb = cols_b + cs.pad_b;
  g.ldc = cs.n + cs.pad_c;
  g.stride_a = cs.share_a ? 0 : rows_a * g.lda + 2;
  g.stride_b = cs.share_b ? 0 : rows_b * g.ldb;
  g.stride_c = cs.m * g.ldc;
  const std::int64_t count_a = cs.share_a ? 1 : cs.batch, count_b = cs.share_b ? 1 : cs.batch;
  g.a = random({std::max<std::int64_t>(count_a * (rows_a * g.lda + 2), 1)}, dt, lo, hi);
  g.b = random({std::max<std::int64_t>(count_b * rows_b * g.ldb, 1)}, dt, lo, hi);
  g.out = empty_poisoned({std::max<std::int64_t>(cs.batch * g.stride_c, 1)}, dt);
  return g;
}

// Geometry with TF-style "same" (ceil(in / stride), padding split top/left-first) or
// "valid" padding.
inline mt::kernels::Conv2dGeometry conv_geometry(std::int64_t n, std::int64_t h, std::int64_t w,
                                                 std::int64_t c, std::int64_t kh, std::int64_t kw,
                                                 std::int64_t cout, std::int64_t sh,
                                                 std::int64_t sw, bool same) {
  mt::kernels::Conv2dGeometry g;
  g.n = n, g.h = h, g.w = w, g.c = c, g.kh = kh, g.kw = kw, g.cout = cout;
  g.stride_h = sh, g.stride_w = sw;
  if (same) {
    g.oh = (h + sh - 1) / sh;
    g.ow = (w + sw - 1) / sw;
    g.pad_top = std::max<std::int64_t>((g.oh - 1) * sh + kh - h, 0) / 2;
    g.pad_left = std::max<std::int64_t>((g.ow - 1) * sw + kw - w, 0) / 2;
  } else {
    g.oh = (h - kh) / sh + 1;
    g.ow = (w - kw) / sw + 1;
  }
  return g;
}

// --- Optimizer update variants ---------------------------------------------------------------
// The SGD / RMSprop / Adam(W) flag combinations the optimizer kernel tests run (CPU against
// a double reference, CUDA against the CPU).

enum class Opt { kSgd, kRmsprop, kAdam };

struct Variant {
  std::string name;
  Opt opt;
  mt::kernels::OptimizerUpdate p;  // the scalars and flags (no tensors)
};

inline std::vector<Variant> variants() {
  std::vector<Variant> v;
  auto add = [&](std::string name, Opt opt, auto&& set) {
    mt::kernels::OptimizerUpdate p;
    set(p);
    v.push_back({std::move(name), opt, p});
  };
  add("sgd", Opt::kSgd, [](auto& p) { p.lr = 0.1; });
  add("sgd momentum", Opt::kSgd, [](auto& p) {
    p.lr = 0.05;
    p.momentum = 0.9;
  });
  add("sgd nesterov", Opt::kSgd, [](auto& p) {
    p.lr = 0.05;
    p.momentum = 0.9;
    p.nesterov = true;
  });
  auto rms = [](auto& p) {
    p.lr = 0.01;
    p.beta2 = 0.9;
    p.epsilon = 1e-7;
  };
  add("rmsprop", Opt::kRmsprop, rms);
  add("rmsprop momentum", Opt::kRmsprop, [&](auto& p) {
    rms(p);
    p.momentum = 0.5;
  });
  add("rmsprop centered", Opt::kRmsprop, [&](auto& p) {
    rms(p);
    p.centered = true;
  });
  add("rmsprop centered momentum", Opt::kRmsprop, [&](auto& p) {
    rms(p);
    p.centered = true;
    p.momentum = 0.5;
  });
  auto adam = [](auto& p) {
    p.lr = 0.01;
    p.beta1 = 0.9;
    p.beta2 = 0.999;
    p.epsilon = 1e-7;
  };
  add("adam", Opt::kAdam, adam);
  // beta2 0.6: v falls often enough for its maximum to differ from it.
  add("adam amsgrad", Opt::kAdam, [&](auto& p) {
    adam(p);
    p.beta2 = 0.6;
    p.amsgrad = true;
  });
  add("adamw", Opt::kAdam, [&](auto& p) {
    adam(p);
    p.weight_decay = 0.25;
  });
  add("adamw amsgrad", Opt::kAdam, [&](auto& p) {
    adam(p);
    p.beta2 = 0.6;
    p.amsgrad = true;
    p.weight_decay = 0.25;
  });
  return v;
}

inline mt::OpId op_of(Opt opt) {
  return opt == Opt::kSgd       ? mt::OpId::sgd_update
         : opt == Opt::kRmsprop ? mt::OpId::rmsprop_update
                                : mt::OpId::adam_update;
}

// Which of slot1..slot3 (s = 1, 2, 3) a variant uses.
inline bool uses_slot(const Variant& v, int s) {
  switch (v.opt) {
    case Opt::kSgd:
      return s == 1 && v.p.momentum != 0.0;
    case Opt::kRmsprop:
      return s == 1 || (s == 2 && v.p.momentum > 0.0) || (s == 3 && v.p.centered);
    case Opt::kAdam:
      return s != 3 || v.p.amsgrad;
  }
  return false;
}

}  // namespace mtest
