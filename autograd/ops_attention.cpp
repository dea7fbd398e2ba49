// fused_attention: the op attention and its backward rule (op attention_backward).
#include <fmt/format.h>

#include <cmath>

#include "autograd/op_util.h"
#include "mixtape/core/dropout_hash.h"

namespace mixtape {

namespace {

// x [..., a, b] as [n, a, b], contiguous.
Tensor as_heads(const Tensor& x, std::int64_t n) {
  return detail::contiguous_raw(reshape(x, Shape{n, x.dim(-2), x.dim(-1)}));
}

// The gradients of q, k and v [n, ., .] from g, written with differentiable ops (the weights
// made whole): the backward pass when a tape records it, for second derivatives.
// Dropout's factors Z [n, t, s] (kernels.h) as a tensor of `like`'s dtype and device: 1 / (1 -
// rate) where dropout_keeps() keeps the weight, 0 elsewhere (only the recorded backward pass
// makes them whole).
Tensor dropout_factors(std::int64_t n, std::int64_t t, std::int64_t s,
                       const kernels::AttentionDropout& d, const Tensor& like) {
  std::vector<double> z(static_cast<std::size_t>(n * t * s));
  const std::uint32_t threshold = dropout_threshold(d.rate);
  for (std::size_t i = 0; i < z.size(); ++i)
    z[i] = dropout_keeps(d.seed, i, threshold) ? 1.0 / (1.0 - d.rate) : 0.0;
  Tensor f = from_vector(z, Shape{n, t, s}).to(like.dtype());
  return like.device().is_cpu() ? f : to_device(f, like.device());
}

detail::Grads differentiable_grads(const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& mask, bool causal, double scale,
                                   const kernels::AttentionDropout& dropout, const Tensor& g) {
  const std::int64_t t = q.dim(1), s = k.dim(1);
  Tensor keep = mask;
  if (causal) {
    std::vector<std::uint8_t> lower(static_cast<std::size_t>(t * s));
    for (std::int64_t i = 0; i < t; ++i)
      for (std::int64_t j = 0; j < s; ++j) lower[static_cast<std::size_t>(i * s + j)] = j <= i;
    Tensor c = from_vector(lower, Shape{t, s}).to(kBool);
    if (!q.device().is_cpu()) c = to_device(c, q.device());
    keep = keep.defined() ? where(c, keep, c) : c;
  }
  const Tensor p = masked_softmax(matmul(q, transpose(k, -1, -2)), keep, scale);
  // Dropout: the weights that reach v are P o Z, and the gradient of P is Z o (g v^T).
  const Tensor z = dropout.rate > 0.0 ? dropout_factors(q.dim(0), t, s, dropout, q) : Tensor();
  const Tensor pz = z.defined() ? p * z : p;
  const Tensor dpz = matmul(g, transpose(v, -1, -2));
  const Tensor dp = z.defined() ? dpz * z : dpz;
  const Tensor ds = p * (dp - sum(dp * p, {-1}, true)) * scale;
  return {matmul(ds, k), matmul(transpose(ds, -1, -2), q), matmul(transpose(pz, -1, -2), g)};
}

// The mask as the kernels read it (kernels.h): a view [n1, n2, t, s] of mask_in broadcast to
// the scores' shape, strides 0 where it is broadcast, when its leading axes fold into two and
// it is contiguous along s, so that a key-padding mask [batch, 1, 1, s] stays batch x s bytes;
// otherwise a contiguous copy [1, n, t, s].
Tensor kernel_mask(const Tensor& mask_in, const Shape& scores, std::int64_t n) {
  const Tensor b = detail::broadcast_view(mask_in, scores);
  const std::size_t r = scores.rank();
  const std::int64_t t = scores[r - 2], s = scores[r - 1];
  std::vector<std::int64_t> dims, strides;  // the leading axes, folded outer to inner
  for (std::size_t a = 0; a + 2 < r; ++a) {
    const std::int64_t d = scores[a], st = b.strides()[a];
    if (d == 1) continue;
    if (!dims.empty() && strides.back() == st * d) {
      dims.back() *= d;
      strides.back() = st;
    } else {
      dims.push_back(d);
      strides.push_back(st);
    }
  }
  if (dims.size() > 2 || (s > 1 && b.strides()[r - 1] != 1)) {
    const Tensor whole = detail::contiguous_raw(b);
    return Tensor::view_of(whole, Shape{1, n, t, s}, Strides{n * t * s, t * s, s, 1},
                           whole.offset());
  }
  while (dims.size() < 2) {
    dims.insert(dims.begin(), 1);
    strides.insert(strides.begin(), 0);
  }
  return Tensor::view_of(b, Shape{dims[0], dims[1], t, s},
                         Strides{strides[0], strides[1], b.strides()[r - 2], 1}, b.offset());
}

// What the backward pass needs of the forward one: the inputs (recorded), their [n, ., .]
// contiguous forms, the mask and options as the kernels took them, out and lse.
struct Saved {
  Tensor q, k, v, qh, kh, vh, mask;
  bool causal;
  double scale;
  kernels::AttentionDropout dropout;
  Tensor out, lse;
};

// The gradients of q, k and v from g (the output's): the backward kernel, or differentiable
// ops when a tape records this backward pass (second derivatives).
detail::Grads attention_grads(const Saved& s, const Tensor& g) {
  const Shape heads{s.qh.dim(0), s.qh.dim(1), s.vh.dim(2)};
  if (should_record({s.q, s.k, s.v, g})) {
    const Tensor whole_mask =
        s.mask.defined()
            ? reshape(detail::contiguous_raw(s.mask), Shape{s.qh.dim(0), s.qh.dim(1), s.kh.dim(1)})
            : Tensor();
    const detail::Grads d = differentiable_grads(
        reshape(s.q, s.qh.shape()), reshape(s.k, s.kh.shape()), reshape(s.v, s.vh.shape()),
        whole_mask, s.causal, s.scale, s.dropout, reshape(g, heads));
    return detail::Grads{reshape(d[0], s.q.shape()), reshape(d[1], s.k.shape()),
                         reshape(d[2], s.v.shape())};
  }
  auto* backward = detail::kernel_for<kernels::AttentionBackwardFn>(
      OpId::attention_backward, s.qh.dtype(), {s.qh, s.kh, s.vh});
  Tensor dq = Tensor::empty(s.qh.shape(), s.qh.dtype(), s.qh.device());
  Tensor dk = Tensor::empty(s.kh.shape(), s.kh.dtype(), s.kh.device());
  Tensor dv = Tensor::empty(s.vh.shape(), s.vh.dtype(), s.vh.device());
  const Tensor gh = detail::contiguous_raw(reshape(cast(g, s.qh.dtype()), heads));
  if (dq.numel() + dk.numel() + dv.numel() > 0) {
    if (s.qh.dim(1) == 0 || s.kh.dim(1) == 0)
      for (Tensor* x : {&dq, &dk, &dv}) detail::fill_raw(*x, 0.0);
    else
      backward(s.qh, s.kh, s.vh, s.mask, s.causal, s.scale, s.dropout, s.out, s.lse, gh, dq, dk,
               dv);
  }
  return detail::Grads{reshape(dq, s.q.shape()), reshape(dk, s.k.shape()),
                       reshape(dv, s.v.shape())};
}

}  // namespace

Tensor fused_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                       const Tensor& mask_in, bool causal, double scale, double dropout_rate,
                       std::uint64_t seed) {
  const char* name = op_name(OpId::attention);
  if (!(dropout_rate >= 0.0 && dropout_rate < 1.0))
    throw ValueError(
        fmt::format("{}: the dropout rate must be in [0, 1); got {}", name, dropout_rate));
  const kernels::AttentionDropout dropout{dropout_rate, seed};
  detail::check_inputs(name, {q_in, k_in, v_in});
  const auto in = detail::op_inputs(OpId::attention, {q_in, k_in, v_in});
  const Tensor &q = in[0], &k = in[1], &v = in[2];
  const auto fail = [&](const std::string& why) {
    throw ShapeError(fmt::format("{}: {}; got q {}, k {}, v {}", name, why, detail::describe({q}),
                                 detail::describe({k}), detail::describe({v})));
  };
  if (q.rank() < 2 || k.rank() != q.rank() || v.rank() != q.rank())
    fail("q, k and v need one rank >= 2 ([..., positions, features])");
  for (std::size_t a = 0; a + 2 < q.rank(); ++a)
    if (k.dim(static_cast<int>(a)) != q.dim(static_cast<int>(a)) ||
        v.dim(static_cast<int>(a)) != q.dim(static_cast<int>(a)))
      fail("q, k and v need the same leading axes");
  if (k.dim(-1) != q.dim(-1)) fail("q and k need the same last axis (the key dim)");
  if (v.dim(-2) != k.dim(-2)) fail("k and v need the same number of positions");
  if (q.dtype() != k.dtype() || q.dtype() != v.dtype())
    throw DTypeError(
        fmt::format("{}: q, k and v need one dtype; got {}", name, detail::describe({q, k, v})));
  if (!std::isfinite(scale))
    throw ValueError(fmt::format("{}: scale must be finite; got {}", name, scale));
  std::vector<std::int64_t> lead(q.shape().begin(), q.shape().end() - 2);
  std::int64_t n = 1;
  for (auto d : lead) n *= d;
  const std::int64_t t = q.dim(-2), s = k.dim(-2);
  std::vector<std::int64_t> scores_dims = lead;
  scores_dims.push_back(t);
  scores_dims.push_back(s);
  Tensor mask;
  if (mask_in.defined()) {
    detail::check_inputs(name, {q, mask_in});
    if (mask_in.dtype() != kBool)
      throw DTypeError(fmt::format("{}: the mask must be bool (true: attend); got {}", name,
                                   detail::describe({mask_in})));
    const Shape scores(scores_dims);
    if (mask_in.rank() > scores.rank() || broadcast_shapes(mask_in.shape(), scores, name) != scores)
      throw ShapeError(fmt::format("{}: a mask of shape {} does not broadcast to the scores' {}",
                                   name, mask_in.shape(), scores));
    NoGradGuard no_grad;
    mask = kernel_mask(mask_in, scores, n);
  }
  auto* kernel = detail::kernel_for<kernels::AttentionFn>(OpId::attention, q.dtype(), {q, k, v});
  Tensor qh, kh, vh;
  {
    NoGradGuard no_grad;
    qh = as_heads(q, n);
    kh = as_heads(k, n);
    vh = as_heads(v, n);
  }
  const DType stat = q.dtype() == kFloat64 ? kFloat64 : kFloat32;
  Tensor out = Tensor::empty(Shape{n, t, v.dim(-1)}, q.dtype(), q.device());
  Tensor lse = Tensor::empty(Shape{n, t}, stat, q.device());
  if (out.numel() > 0) {
    if (s == 0)
      detail::fill_raw(out, 0.0);  // no keys: every row attends nothing
    else
      kernel(qh, kh, vh, mask, causal, scale, dropout, out, lse);
  }
  std::vector<std::int64_t> out_dims = lead;
  out_dims.push_back(t);
  out_dims.push_back(v.dim(-1));
  Tensor y;
  {
    NoGradGuard no_grad;
    y = reshape(out, Shape(out_dims));
  }
  if (should_record({q, k, v})) {
    const Saved saved{q, k, v, qh, kh, vh, mask, causal, scale, dropout, out, lse};
    record_op(name, {q, k, v}, y, [saved](const Tensor& g, const std::vector<bool>&) {
      return attention_grads(saved, g);
    });
  }
  return y;
}

}  // namespace mixtape
