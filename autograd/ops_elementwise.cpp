// Elementwise ops: forward dispatch and backward rule side by side.
#include <cmath>

#include "autograd/op_util.h"

namespace mixtape {

using detail::Grads;

namespace {

// Broadcasts, promotes (through the recorded cast) and runs a binary kernel.
// Returns the output; `ac`/`bc` receive the promoted operands.
Tensor binary_forward(OpId op, const Tensor& a_in, const Tensor& b_in, Tensor& ac, Tensor& bc,
                      bool comparison = false) {
  const char* name = op_name(op);
  detail::check_inputs(name, {a_in, b_in});
  const auto in = detail::op_inputs(op, {a_in, b_in});
  const Tensor &a = in[0], &b = in[1];
  const DType dt = promote_types(a.dtype(), b.dtype());
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), name);
  const auto kernel = detail::kernel_for<kernels::BinaryFn>(op, dt, {a, b});
  ac = cast(a, dt);
  bc = cast(b, dt);
  Tensor out = Tensor::empty(out_shape, comparison ? kBool : dt, a.device());
  if (out.numel() > 0)
    kernel(detail::broadcast_view(ac, out_shape), detail::broadcast_view(bc, out_shape), out);
  return out;
}

Tensor compare(OpId op, const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  return binary_forward(op, a, b, ac, bc, /*comparison=*/true);
}

Tensor unary_forward(OpId op, const Tensor& x) {
  detail::check_inputs(op_name(op), {x});
  const auto kernel = detail::kernel_for<kernels::UnaryFn>(op, x.dtype(), {x});
  Tensor xc = detail::contiguous_raw(x);
  Tensor out = Tensor::empty(x.shape(), x.dtype(), x.device());
  if (out.numel() > 0) kernel(xc, out);
  return out;
}

// Records a unary op whose input gradient is grad * factor(x, y).
template <typename Factor>
Tensor unary(OpId op, const Tensor& x_in, Factor factor) {
  const Tensor x = detail::op_inputs(op, {x_in})[0];
  Tensor y = unary_forward(op, x);
  if (should_record({x}))
    record_op(op_name(op), {x}, y, [x, y, factor](const Tensor& g, const std::vector<bool>&) {
      return Grads{factor(g, x, y)};
    });
  return y;
}

}  // namespace

// --- Binary arithmetic ------------------------------------------------------------------

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  Tensor y = binary_forward(OpId::add, a, b, ac, bc);
  if (should_record({ac, bc}))
    record_op(
        op_name(OpId::add), {ac, bc}, y,
        [sa = ac.shape(), sb = bc.shape()](const Tensor& g, const std::vector<bool>& needs) {
          return Grads{needs[0] ? sum_to(g, sa) : Tensor(), needs[1] ? sum_to(g, sb) : Tensor()};
        });
  return y;
}

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  Tensor y = binary_forward(OpId::sub, a, b, ac, bc);
  if (should_record({ac, bc}))
    record_op(op_name(OpId::sub), {ac, bc}, y,
              [sa = ac.shape(), sb = bc.shape()](const Tensor& g, const std::vector<bool>& needs) {
                return Grads{needs[0] ? sum_to(g, sa) : Tensor(),
                             needs[1] ? sum_to(neg(g), sb) : Tensor()};
              });
  return y;
}

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  Tensor y = binary_forward(OpId::mul, a, b, ac, bc);
  if (should_record({ac, bc}))
    record_op(op_name(OpId::mul), {ac, bc}, y,
              [ac, bc](const Tensor& g, const std::vector<bool>& needs) {
                return Grads{needs[0] ? sum_to(g * bc, ac.shape()) : Tensor(),
                             needs[1] ? sum_to(g * ac, bc.shape()) : Tensor()};
              });
  return y;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  Tensor y = binary_forward(OpId::div, a, b, ac, bc);
  if (should_record({ac, bc}))
    record_op(op_name(OpId::div), {ac, bc}, y,
              [ac, bc, y](const Tensor& g, const std::vector<bool>& needs) {
                Tensor ga = needs[0] || needs[1] ? g / bc : Tensor();
                return Grads{needs[0] ? sum_to(ga, ac.shape()) : Tensor(),
                             needs[1] ? sum_to(neg(ga * y), bc.shape()) : Tensor()};
              });
  return y;
}

namespace {
// maximum/minimum: the gradient goes to a where `a_wins` (a >= b, or a <= b), else to b.
Tensor extremum(OpId op, const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  Tensor y = binary_forward(op, a, b, ac, bc);
  if (should_record({ac, bc}))
    record_op(op_name(op), {ac, bc}, y,
              [op, ac, bc](const Tensor& g, const std::vector<bool>& needs) {
                Tensor a_wins = op == OpId::maximum ? greater_equal(ac, bc) : less_equal(ac, bc);
                Tensor zero = detail::scalar_like(0.0, g);
                return Grads{needs[0] ? sum_to(where(a_wins, g, zero), ac.shape()) : Tensor(),
                             needs[1] ? sum_to(where(a_wins, zero, g), bc.shape()) : Tensor()};
              });
  return y;
}
}  // namespace

Tensor maximum(const Tensor& a, const Tensor& b) { return extremum(OpId::maximum, a, b); }
Tensor minimum(const Tensor& a, const Tensor& b) { return extremum(OpId::minimum, a, b); }

Tensor pow(const Tensor& a, const Tensor& b) {
  Tensor ac, bc;
  Tensor y = binary_forward(OpId::pow, a, b, ac, bc);
  if (should_record({ac, bc}))
    record_op(op_name(OpId::pow), {ac, bc}, y,
              [ac, bc, y](const Tensor& g, const std::vector<bool>& needs) {
                Tensor ga, gb;
                if (needs[0]) ga = sum_to(g * bc * pow(ac, bc - 1.0), ac.shape());
                if (needs[1]) {
                  // d/db a^b = a^b log a, taken as 0 where a <= 0 (as TensorFlow does).
                  Tensor positive = greater(ac, detail::scalar_like(0.0, ac));
                  Tensor safe_a = where(positive, ac, detail::scalar_like(1.0, ac));
                  gb = sum_to(where(positive, g * y * log(safe_a), detail::scalar_like(0.0, g)),
                              bc.shape());
                }
                return Grads{ga, gb};
              });
  return y;
}

Tensor pow(const Tensor& a, double exponent) { return pow(a, detail::scalar_like(exponent, a)); }

Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
Tensor operator+(const Tensor& a, double b) { return add(a, detail::scalar_like(b, a)); }
Tensor operator-(const Tensor& a, double b) { return sub(a, detail::scalar_like(b, a)); }
Tensor operator*(const Tensor& a, double b) { return mul(a, detail::scalar_like(b, a)); }
Tensor operator/(const Tensor& a, double b) { return div(a, detail::scalar_like(b, a)); }
Tensor operator+(double a, const Tensor& b) { return add(detail::scalar_like(a, b), b); }
Tensor operator-(double a, const Tensor& b) { return sub(detail::scalar_like(a, b), b); }
Tensor operator*(double a, const Tensor& b) { return mul(detail::scalar_like(a, b), b); }
Tensor operator/(double a, const Tensor& b) { return div(detail::scalar_like(a, b), b); }
Tensor operator-(const Tensor& a) { return neg(a); }

// --- Unary math -------------------------------------------------------------------------

Tensor neg(const Tensor& x) {
  return unary(OpId::neg, x, [](const Tensor& g, const Tensor&, const Tensor&) { return neg(g); });
}

Tensor abs(const Tensor& x) {
  return unary(OpId::abs, x, [](const Tensor& g, const Tensor& x, const Tensor&) {
    // sign(x), 0 at 0
    Tensor zero = detail::scalar_like(0.0, x);
    Tensor sign = cast(greater(x, zero), x.dtype()) - cast(less(x, zero), x.dtype());
    return g * sign;
  });
}

Tensor exp(const Tensor& x) {
  return unary(OpId::exp, x, [](const Tensor& g, const Tensor&, const Tensor& y) { return g * y; });
}

Tensor log(const Tensor& x) {
  return unary(OpId::log, x, [](const Tensor& g, const Tensor& x, const Tensor&) { return g / x; });
}

Tensor sqrt(const Tensor& x) {
  return unary(OpId::sqrt, x,
               [](const Tensor& g, const Tensor&, const Tensor& y) { return g * 0.5 / y; });
}

Tensor rsqrt(const Tensor& x) {
  return unary(OpId::rsqrt, x, [](const Tensor& g, const Tensor&, const Tensor& y) {
    return g * (-0.5) * y * y * y;
  });
}

Tensor square(const Tensor& x) { return mul(x, x); }

Tensor tanh(const Tensor& x) {
  return unary(OpId::tanh, x,
               [](const Tensor& g, const Tensor&, const Tensor& y) { return g * (1.0 - y * y); });
}

Tensor sigmoid(const Tensor& x) {
  return unary(OpId::sigmoid, x,
               [](const Tensor& g, const Tensor&, const Tensor& y) { return g * y * (1.0 - y); });
}

namespace {
// g where y > 0, else 0 (one kernel pass). Linear in g; its gradient in y is zero.
Tensor relu_backward(const Tensor& y, const Tensor& g) {
  Tensor yc, gc;
  Tensor out = binary_forward(OpId::relu_backward, y, g, yc, gc);
  if (should_record({gc}))
    record_op(op_name(OpId::relu_backward), {yc, gc}, out,
              [yc](const Tensor& gg, const std::vector<bool>& needs) {
                return Grads{Tensor(), needs[1] ? relu_backward(yc, gg) : Tensor()};
              });
  return out;
}
}  // namespace

Tensor relu(const Tensor& x) {
  return unary(OpId::relu, x,
               [](const Tensor& g, const Tensor&, const Tensor& y) { return relu_backward(y, g); });
}

namespace {
// g * gelu'(x) = g (Phi(x) + x phi(x)) in one kernel pass, rounded once. Its own gradient
// (for higher orders): in g, gelu'(x) again; in x, g gelu''(x) = g phi(x) (2 - x^2).
Tensor gelu_backward(const Tensor& x, const Tensor& g) {
  Tensor xc, gc;
  Tensor out = binary_forward(OpId::gelu_backward, x, g, xc, gc);
  if (should_record({xc, gc}))
    record_op(op_name(OpId::gelu_backward), {xc, gc}, out,
              [xc, gc](const Tensor& gg, const std::vector<bool>& needs) {
                constexpr double kInvSqrt2Pi = 0.39894228040143267794;
                Tensor dx, dg;
                if (needs[0]) {
                  const Tensor pdf = exp(xc * xc * (-0.5)) * kInvSqrt2Pi;
                  dx = gg * gc * pdf * (2.0 - xc * xc);
                }
                if (needs[1]) dg = gelu_backward(xc, gg);
                return Grads{dx, dg};
              });
  return out;
}
}  // namespace

Tensor gelu(const Tensor& x) {
  return unary(OpId::gelu, x,
               [](const Tensor& g, const Tensor& x, const Tensor&) { return gelu_backward(x, g); });
}

// gelu_tanh(x) = 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = c (x + 0.044715 x^3), c = sqrt(2/pi)
// (the kernels compute the sigmoid form, which keeps the negative tail accurate).
Tensor gelu_tanh(const Tensor& x) {
  return unary(OpId::gelu_tanh, x, [](const Tensor& g, const Tensor& x, const Tensor&) {
    // d/dx x s(2u) = s + x s (1 - s) 2 u', u' = c (1 + 3 * 0.044715 x^2)
    constexpr double kC = 0.79788456080286535588, kA = 0.044715;
    const Tensor x2 = x * x;
    const Tensor s = sigmoid(2.0 * kC * (x + kA * x2 * x));
    return g * (s + x * s * (1.0 - s) * (2.0 * kC) * (1.0 + 3.0 * kA * x2));
  });
}

Tensor erf(const Tensor& x) {
  return unary(OpId::erf, x, [](const Tensor& g, const Tensor& x, const Tensor&) {
    constexpr double kTwoOverSqrtPi = 1.12837916709551257390;
    return g * exp(neg(x * x)) * kTwoOverSqrtPi;
  });
}

// --- Comparisons and selection ------------------------------------------------------------

Tensor equal(const Tensor& a, const Tensor& b) { return compare(OpId::equal, a, b); }
Tensor not_equal(const Tensor& a, const Tensor& b) { return compare(OpId::not_equal, a, b); }
Tensor less(const Tensor& a, const Tensor& b) { return compare(OpId::less, a, b); }
Tensor less_equal(const Tensor& a, const Tensor& b) { return compare(OpId::less_equal, a, b); }
Tensor greater(const Tensor& a, const Tensor& b) { return compare(OpId::greater, a, b); }
Tensor greater_equal(const Tensor& a, const Tensor& b) {
  return compare(OpId::greater_equal, a, b);
}

Tensor where(const Tensor& cond, const Tensor& a_in, const Tensor& b_in) {
  detail::check_inputs("where", {cond, a_in, b_in});
  const auto in = detail::op_inputs(OpId::where, {a_in, b_in});
  const Tensor &a = in[0], &b = in[1];
  if (cond.dtype() != kBool)
    throw DTypeError(
        fmt::format("where: the condition must be bool; got {}", detail::describe({cond, a, b})));
  const DType dt = promote_types(a.dtype(), b.dtype());
  const Shape shape =
      broadcast_shapes(broadcast_shapes(cond.shape(), a.shape(), "where"), b.shape(), "where");
  const auto kernel = detail::kernel_for<kernels::WhereFn>(OpId::where, dt, {cond, a, b});
  Tensor ac = cast(a, dt), bc = cast(b, dt);
  Tensor out = Tensor::empty(shape, dt, a.device());
  if (out.numel() > 0)
    kernel(detail::broadcast_view(cond, shape), detail::broadcast_view(ac, shape),
           detail::broadcast_view(bc, shape), out);
  if (should_record({ac, bc}))
    record_op(
        op_name(OpId::where), {ac, bc}, out,
        [cond, sa = ac.shape(), sb = bc.shape()](const Tensor& g, const std::vector<bool>& needs) {
          Tensor zero = detail::scalar_like(0.0, g);
          return Grads{needs[0] ? sum_to(where(cond, g, zero), sa) : Tensor(),
                       needs[1] ? sum_to(where(cond, zero, g), sb) : Tensor()};
        });
  return out;
}

}  // namespace mixtape
