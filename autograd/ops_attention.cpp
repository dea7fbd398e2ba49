// fused_attention: the op attention and its backward rule (op attention_backward).
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <optional>

#include "autograd/op_util.h"

namespace mixtape {

namespace {

// x [..., rows, width] as the kernels take their operands (kernels.h, mixtape/core/head_rows.h):
// a view [n1, n2, rows, width] of the same elements when x's leading axes fold into two (those
// of extent 1 dropped, neighbours whose strides chain merged) and it has stride 1 along width;
// nullopt otherwise. So the heads of a [batch, positions, heads, width] projection viewed
// [batch, heads, positions, width] are taken where they lie, and so is a broadcast mask.
std::optional<Tensor> fold_heads(const Tensor& x) {
  const std::size_t r = x.rank();
  const std::int64_t rows = x.dim(-2), width = x.dim(-1);
  std::vector<std::int64_t> dims, strides;  // the leading axes, folded outer to inner
  for (std::size_t a = 0; a + 2 < r; ++a) {
    const std::int64_t d = x.shape()[a], st = x.strides()[a];
    if (d == 1) continue;
    if (!dims.empty() && strides.back() == st * d) {
      dims.back() *= d;
      strides.back() = st;
    } else {
      dims.push_back(d);
      strides.push_back(st);
    }
  }
  if (dims.size() > 2 || (width > 1 && x.strides()[r - 1] != 1)) return std::nullopt;
  while (dims.size() < 2) {
    dims.insert(dims.begin(), 1);
    strides.insert(strides.begin(), 0);
  }
  return Tensor::view_of(x, Shape{dims[0], dims[1], rows, width},
                         Strides{strides[0], strides[1], x.strides()[r - 2], 1}, x.offset());
}

// x as the kernels take it: fold_heads(x), or a contiguous copy [1, n, rows, width].
Tensor head_view(const Tensor& x, std::int64_t n) {
  if (auto folded = fold_heads(x)) return *folded;
  const Tensor whole = detail::contiguous_raw(x);
  const std::int64_t rows = x.dim(-2), width = x.dim(-1);
  return Tensor::view_of(whole, Shape{1, n, rows, width},
                         Strides{n * rows * width, rows * width, width, 1}, whole.offset());
}

// An output of the kernels shaped as x with its last axis `width` wide: `whole`, its
// elements (contiguous); `y`, the view of x's shape; `heads`, as the kernels write it. Laid
// out as x is (its axes ordered by x's strides, the last innermost) when the kernels can
// write that: the heads of a [batch, heads, positions, width] view of a [batch, positions,
// heads, width] projection then come out [batch, positions, heads, width] in memory, and
// merging them back is a view. Contiguous otherwise.
struct HeadsOut {
  Tensor whole, y, heads;
};
HeadsOut heads_like(const Tensor& x, std::int64_t width, DType dtype) {
  const std::size_t r = x.rank();
  std::vector<std::int64_t> dims(x.shape().begin(), x.shape().end());
  dims.back() = width;
  std::vector<std::size_t> order(r - 1);  // the axes but the last, outermost first
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return x.strides()[a] > x.strides()[b]; });
  std::vector<std::int64_t> laid;
  for (std::size_t a : order) laid.push_back(dims[a]);
  laid.push_back(width);
  HeadsOut o;
  o.whole = Tensor::empty(Shape(laid), dtype, x.device());
  Strides st(r);
  for (std::size_t i = 0; i < r; ++i) st[i < r - 1 ? order[i] : r - 1] = o.whole.strides()[i];
  o.y = Tensor::view_of(o.whole, Shape(dims), st, o.whole.offset());
  if (auto folded = fold_heads(o.y)) {
    o.heads = *folded;
    return o;
  }
  o.whole = Tensor::empty(Shape(dims), dtype, x.device());
  o.y = o.whole;
  o.heads = *fold_heads(o.y);  // contiguous: always folds
  return o;
}

// The gradients of q, k and v [n, ., .] from g, written with differentiable ops (the weights
// made whole): the backward pass when a tape records it, for second derivatives.
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
  // Dropout: the weights that reach v are P o Z, and the gradient of P is Z o (g v^T) (Z of
  // [n, t, s] is the dropout op's: kernels.h).
  RandomSeed seed(dropout.seed);
  seed.on_device = dropout.seed_at;
  const auto drop = [&](const Tensor& w) { return mixtape::dropout(w, dropout.rate, seed); };
  const Tensor pz = drop(p);
  const Tensor dp = drop(matmul(g, transpose(v, -1, -2)));
  const Tensor ds = p * (dp - sum(dp * p, {-1}, true)) * scale;
  return {matmul(ds, k), matmul(transpose(ds, -1, -2), q), matmul(transpose(pz, -1, -2), g)};
}

// The mask as the kernels read it (kernels.h): mask_in broadcast to the scores' shape, as a
// strided view (strides 0 where it is broadcast: a key-padding mask [batch, 1, 1, s] stays
// batch x s bytes) or a contiguous copy.
Tensor kernel_mask(const Tensor& mask_in, const Shape& scores, std::int64_t n) {
  return head_view(detail::broadcast_view(mask_in, scores), n);
}

// What the backward pass needs of the forward one: the inputs (recorded), their views as the
// kernels took them, the mask and options likewise, out (as the kernels wrote it) and lse.
struct AttentionSaved {
  std::int64_t n;
  Tensor q, k, v, qh, kh, vh, mask;
  bool causal;
  double scale;
  kernels::AttentionDropout dropout;
  Tensor out, lse;
};

// The gradients of q, k and v [..., rows, width] (s's shapes) from g by differentiable ops:
// the backward pass when a tape records it (second derivatives).
detail::Grads recorded_grads(const AttentionSaved& s, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& g) {
  const std::int64_t n = s.n, t = q.dim(-2), keys = k.dim(-2);
  const auto flat = [n](const Tensor& x) { return reshape(x, Shape{n, x.dim(-2), x.dim(-1)}); };
  const Tensor whole_mask =
      s.mask.defined() ? reshape(detail::contiguous_raw(s.mask), Shape{n, t, keys}) : Tensor();
  const detail::Grads d = differentiable_grads(flat(q), flat(k), flat(v), whole_mask, s.causal,
                                               s.scale, s.dropout, flat(g));
  return detail::Grads{reshape(d[0], q.shape()), reshape(d[1], k.shape()),
                       reshape(d[2], v.shape())};
}

// The backward kernel: the gradients of the heads s.qh, s.kh, s.vh from g into dq, dk and dv
// (the kernels' views of tensors shaped as s.q, s.k and s.v; whole: their elements, zero when
// a side has no positions).
void backward_kernel(const AttentionSaved& s, const Tensor& g, const std::array<Tensor, 3>& heads,
                     const std::vector<Tensor>& whole) {
  std::int64_t size = 0;
  for (const Tensor& w : whole) size += w.numel();
  if (size == 0) return;
  if (s.q.dim(-2) == 0 || s.k.dim(-2) == 0) {
    for (const Tensor& w : whole) detail::fill_raw(w, 0.0);
    return;
  }
  const auto backward = detail::kernel_for<kernels::AttentionBackwardFn>(
      OpId::attention_backward, s.qh.dtype(), {s.qh, s.kh, s.vh});
  const Tensor gh = head_view(cast(g, s.qh.dtype()), s.n);
  backward(s.qh, s.kh, s.vh, s.mask, s.causal, s.scale, s.dropout, s.out, s.lse, gh, heads[0],
           heads[1], heads[2]);
}

// The gradients of q, k and v from g (the output's): the backward kernel, or differentiable
// ops when a tape records this backward pass (second derivatives).
detail::Grads attention_grads(const AttentionSaved& s, const Tensor& g) {
  if (should_record({s.q, s.k, s.v, g})) return recorded_grads(s, s.q, s.k, s.v, g);
  // The gradients laid out as their inputs are: a projection's heads go back where they came
  // from with no copy.
  const DType dtype = s.qh.dtype();
  const HeadsOut dq = heads_like(s.q, s.q.dim(-1), dtype), dk = heads_like(s.k, s.k.dim(-1), dtype),
                 dv = heads_like(s.v, s.v.dim(-1), dtype);
  backward_kernel(s, g, {dq.heads, dk.heads, dv.heads}, {dq.whole, dk.whole, dv.whole});
  return detail::Grads{dq.y, dk.y, dv.y};
}

// --- The packed form ---------------------------------------------------------------------------

// The parts of a packed qkv [..., t, heads * (2 key_dim + value_dim)] (stride 1 along its
// last axis) as views [..., heads, t, dim]: q's, k's, v's.
std::array<Tensor, 3> unpack_heads(const Tensor& qkv, const PackedHeads& p) {
  const std::size_t r = qkv.rank();
  std::vector<std::int64_t> dims(qkv.shape().begin(), qkv.shape().end() - 2);
  std::vector<std::int64_t> strides(qkv.strides().begin(), qkv.strides().end() - 2);
  dims.push_back(p.heads);
  dims.push_back(qkv.dim(-2));
  const std::int64_t widths[3] = {p.key_dim, p.key_dim, p.value_dim};
  std::array<Tensor, 3> parts;
  std::int64_t start = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    std::vector<std::int64_t> d = dims, st = strides;
    d.push_back(widths[i]);
    st.insert(st.end(), {widths[i], qkv.strides()[r - 2], 1});
    parts[i] = Tensor::view_of(qkv, Shape(d), Strides(st), qkv.offset() + start);
    start += p.heads * widths[i];
  }
  return parts;
}

// The parts of a packed qkv as unpack_heads's, made by differentiable ops (slice, reshape,
// transpose), and the inverse: a part's gradient [..., heads, t, dim] as [..., t, heads * dim].
std::array<Tensor, 3> recorded_parts(const Tensor& qkv, const PackedHeads& p) {
  std::vector<std::int64_t> dims(qkv.shape().begin(), qkv.shape().end() - 1);
  const std::int64_t widths[3] = {p.key_dim, p.key_dim, p.value_dim};
  std::array<Tensor, 3> parts;
  std::int64_t start = 0;
  for (std::size_t i = 0; i < 3; ++i) {
    std::vector<std::int64_t> d = dims;
    d.insert(d.end(), {p.heads, widths[i]});
    const Tensor part = slice(qkv, -1, start, start + p.heads * widths[i]);
    parts[i] = transpose(reshape(part, Shape(d)), -3, -2);
    start += p.heads * widths[i];
  }
  return parts;
}
Tensor joined_part(const Tensor& grad) {
  const Tensor rows = transpose(grad, -3, -2);  // [..., t, heads, dim]
  std::vector<std::int64_t> d(rows.shape().begin(), rows.shape().end() - 2);
  d.push_back(rows.dim(-2) * rows.dim(-1));
  return reshape(rows, Shape(d));
}

// The gradient of a packed qkv from g: one tensor of qkv's shape, the backward kernel writing
// the three parts where unpack_heads finds them; or, when a tape records this backward pass,
// the differentiable gradients joined along the last axis.
Tensor packed_grads(const AttentionSaved& s, const Tensor& qkv, const PackedHeads& p,
                    const Tensor& g) {
  if (should_record({qkv, g})) {
    const std::array<Tensor, 3> parts = recorded_parts(qkv, p);
    const detail::Grads d = recorded_grads(s, parts[0], parts[1], parts[2], g);
    return concat({joined_part(d[0]), joined_part(d[1]), joined_part(d[2])}, -1);
  }
  const Tensor whole = Tensor::empty(qkv.shape(), s.qh.dtype(), qkv.device());
  const std::array<Tensor, 3> parts = unpack_heads(whole, p);
  // (Views of a contiguous tensor: the leading axes fold, always.)
  backward_kernel(s, g, {*fold_heads(parts[0]), *fold_heads(parts[1]), *fold_heads(parts[2])},
                  {whole});
  return whole;
}

// The forward pass on the op's inputs q, k and v (after op_inputs): the checks, the kernel,
// the result and what the backward pass needs.
struct AttentionRun {
  Tensor y;
  AttentionSaved saved;
};
AttentionRun run_attention(const char* name, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& mask_in, bool causal, double scale,
                           const kernels::AttentionDropout& dropout) {
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
  const auto kernel =
      detail::kernel_for<kernels::AttentionFn>(OpId::attention, q.dtype(), {q, k, v});
  // The heads where they lie when the kernels can read them there (a projection's, viewed
  // [batch, heads, positions, width]), copied otherwise; out laid out as q is.
  const Tensor qh = head_view(q, n), kh = head_view(k, n), vh = head_view(v, n);
  const DType stat = q.dtype() == kFloat64 ? kFloat64 : kFloat32;
  const HeadsOut out = heads_like(q, v.dim(-1), q.dtype());
  Tensor lse = Tensor::empty(Shape{n, t}, stat, q.device());
  if (out.whole.numel() > 0) {
    if (s == 0)
      detail::fill_raw(out.whole, 0.0);  // no keys: every row attends nothing
    else
      kernel(qh, kh, vh, mask, causal, scale, dropout, out.heads, lse);
  }
  return AttentionRun{
      out.y, AttentionSaved{n, q, k, v, qh, kh, vh, mask, causal, scale, dropout, out.heads, lse}};
}

// The checks both forms make of the dropout rate and the seed, and the kernels' dropout.
kernels::AttentionDropout attention_dropout(const char* name, const Tensor& x, double rate,
                                            const RandomSeed& seed) {
  if (!(rate >= 0.0 && rate < 1.0))
    throw ValueError(fmt::format("{}: the dropout rate must be in [0, 1); got {}", name, rate));
  detail::check_seed(name, x, seed);
  return kernels::AttentionDropout{rate, seed.value, rate > 0.0 ? seed.on_device : Tensor()};
}

}  // namespace

Tensor fused_attention(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                       const Tensor& mask_in, bool causal, double scale, double dropout_rate,
                       const RandomSeed& seed) {
  const char* name = op_name(OpId::attention);
  detail::check_inputs(name, {q_in, k_in, v_in});
  const kernels::AttentionDropout dropout = attention_dropout(name, q_in, dropout_rate, seed);
  const auto in = detail::op_inputs(OpId::attention, {q_in, k_in, v_in});
  const Tensor &q = in[0], &k = in[1], &v = in[2];
  AttentionRun run = run_attention(name, q, k, v, mask_in, causal, scale, dropout);
  if (should_record({q, k, v}))
    record_op(name, {q, k, v}, run.y,
              [saved = std::move(run.saved)](const Tensor& g, const std::vector<bool>&) {
                return attention_grads(saved, g);
              });
  return run.y;
}

Tensor fused_attention_packed(const Tensor& qkv_in, const PackedHeads& packed,
                              const Tensor& mask_in, bool causal, double scale, double dropout_rate,
                              const RandomSeed& seed) {
  const char* name = op_name(OpId::attention);
  detail::check_inputs(name, {qkv_in});
  const kernels::AttentionDropout dropout = attention_dropout(name, qkv_in, dropout_rate, seed);
  const PackedHeads& p = packed;
  if (p.heads <= 0 || p.key_dim <= 0 || p.value_dim <= 0 || qkv_in.rank() < 2 ||
      qkv_in.dim(-1) != p.heads * (2 * p.key_dim + p.value_dim))
    throw ShapeError(fmt::format(
        "{}: packed q, k and v need a positive count of heads and dims and qkv [..., positions, "
        "heads * (2 key_dim + value_dim)] = [..., positions, {}]; got {} heads, key_dim {}, "
        "value_dim {} and qkv {}",
        name, p.heads * (2 * p.key_dim + p.value_dim), p.heads, p.key_dim, p.value_dim,
        detail::describe({qkv_in})));
  const Tensor qkv = detail::op_inputs(OpId::attention, {qkv_in})[0];
  // (The parts are views along the last axis: it needs stride 1.)
  const Tensor lined = qkv.strides().back() == 1 ? qkv : detail::contiguous_raw(qkv);
  const std::array<Tensor, 3> parts = unpack_heads(lined, p);
  AttentionRun run =
      run_attention(name, parts[0], parts[1], parts[2], mask_in, causal, scale, dropout);
  if (should_record({qkv}))
    record_op(name, {qkv}, run.y,
              [saved = std::move(run.saved), qkv, p](const Tensor& g, const std::vector<bool>&) {
                return detail::Grads{packed_grads(saved, qkv, p, g)};
              });
  return run.y;
}

}  // namespace mixtape
