// matmul: batched GEMM with broadcast batch dimensions; transposed views become GEMM
// transpose flags instead of copies.
#include <optional>

#include "autograd/op_util.h"
#include "mixtape/core/compute_mode.h"

namespace mixtape {

using detail::Grads;

namespace {

// How one operand is handed to the GEMM: the tensor (possibly a copy), whether it is
// transposed, its leading dimension and its batch stride.
struct GemmOperand {
  Tensor t;
  bool trans = false;
  std::int64_t ld = 0;
  std::int64_t batch_stride = 0;
};

// `t` viewed as a batch (of shape `batch`) of rows x cols matrices.
GemmOperand prepare(const Tensor& t, const std::vector<std::int64_t>& batch, std::int64_t rows,
                    std::int64_t cols) {
  std::vector<std::int64_t> dims = batch;
  dims.push_back(rows);
  dims.push_back(cols);
  const Shape full_shape(dims);
  Tensor v = detail::broadcast_view(t, full_shape);
  const std::size_t r = full_shape.rank();

  auto matrix_layout = [&](const Tensor& m, GemmOperand& op) {
    const auto& s = m.strides();
    if ((cols == 1 || s[r - 1] == 1) && (rows == 1 || s[r - 2] >= cols)) {
      op.trans = false;
      op.ld = rows == 1 ? std::max<std::int64_t>(cols, 1) : s[r - 2];
      return true;
    }
    if ((rows == 1 || s[r - 2] == 1) && (cols == 1 || s[r - 1] >= rows)) {
      op.trans = true;
      op.ld = cols == 1 ? std::max<std::int64_t>(rows, 1) : s[r - 1];
      return true;
    }
    return false;
  };
  // One stride for all batch items (0 when every batch axis is broadcast), if possible.
  auto batch_layout = [&](const Tensor& m, GemmOperand& op) {
    const auto& s = m.strides();
    std::int64_t stride = -1, expected = -1;
    bool all_zero = true;
    for (std::size_t i = batch.size(); i-- > 0;) {
      if (batch[i] == 1) continue;
      if (s[i] != 0) all_zero = false;
      if (stride < 0) {
        stride = s[i];
      } else if (s[i] != expected) {
        return false;
      }
      expected = s[i] * batch[i];
    }
    op.batch_stride = stride < 0 || all_zero ? 0 : stride;
    return !(stride == 0 && !all_zero);
  };

  GemmOperand op;
  op.t = v;
  if (matrix_layout(v, op) && batch_layout(v, op)) return op;
  op.t = detail::contiguous_raw(v);
  matrix_layout(op.t, op);
  batch_layout(op.t, op);
  return op;
}

// matmul, accumulating in 16 bits when `low_precision` says so (unset: as the
// MIXTAPE_FP16_USE_FP32_COMPUTE switch says now). The backward products reuse the
// forward's decision, like conv2d's.
Tensor matmul_with(const Tensor& a_in, const Tensor& b_in, std::optional<bool> low_precision) {
  detail::check_inputs("matmul", {a_in, b_in});
  const auto in = detail::op_inputs(OpId::matmul, {a_in, b_in});
  const Tensor &a = in[0], &b = in[1];
  if (a.rank() < 2 || b.rank() < 2)
    throw ShapeError(
        fmt::format("matmul: operands need rank >= 2; got {}", detail::describe({a, b})));
  const std::int64_t m = a.dim(-2), k = a.dim(-1), n = b.dim(-1);
  if (b.dim(-2) != k)
    throw ShapeError(fmt::format("matmul: inner dimensions do not match: {} x {} ({} != {})",
                                 a.shape().str(), b.shape().str(), k, b.dim(-2)));
  const DType dt = promote_types(a.dtype(), b.dtype());
  const auto kernel = detail::kernel_for<kernels::GemmFn>(OpId::matmul, dt, {a, b});
  Tensor ac = cast(a, dt), bc = cast(b, dt);
  const bool low =
      low_precision.value_or(gemm_accumulation_dtype(dt) == dt) && dt.is_reduced_float();

  const Shape a_batch(std::vector<std::int64_t>(a.shape().begin(), a.shape().end() - 2));
  const Shape b_batch(std::vector<std::int64_t>(b.shape().begin(), b.shape().end() - 2));
  const Shape batch = broadcast_shapes(a_batch, b_batch, "matmul");
  std::vector<std::int64_t> out_dims = batch.dims();
  out_dims.push_back(m);
  out_dims.push_back(n);
  Tensor out = Tensor::empty(Shape(out_dims), dt, a.device());

  if (out.numel() > 0) {
    if (k == 0) {
      detail::fill_raw(out, 0.0);
    } else {
      GemmOperand pa = prepare(ac, batch.dims(), m, k);
      GemmOperand pb = prepare(bc, batch.dims(), k, n);
      kernels::GemmArgs args;
      args.a = pa.t;
      args.b = pb.t;
      args.out = out;
      args.batch = batch.numel();
      args.m = m;
      args.n = n;
      args.k = k;
      args.trans_a = pa.trans;
      args.trans_b = pb.trans;
      args.lda = pa.ld;
      args.ldb = pb.ld;
      args.ldc = n;
      args.stride_a = pa.batch_stride;
      args.stride_b = pb.batch_stride;
      args.stride_c = m * n;
      args.low_precision_accumulation = low;
      kernel(args);
    }
  }
  if (should_record({ac, bc}))
    record_op(op_name(OpId::matmul), {ac, bc}, out,
              [ac, bc, low](const Tensor& g, const std::vector<bool>& needs) {
                return Grads{
                    needs[0] ? sum_to(matmul_with(g, transpose(bc), low), ac.shape()) : Tensor(),
                    needs[1] ? sum_to(matmul_with(transpose(ac), g, low), bc.shape()) : Tensor()};
              });
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b) { return matmul_with(a, b, std::nullopt); }

}  // namespace mixtape
