#!/usr/bin/env python3
"""Checks ONNX exports against the framework's own predictions, with independent runtimes.

Usage: check_exports.py DIR [--require-opencv CASE ...]

DIR holds cases. A case NAME is NAME.onnx (opset 17), NAME.json
({"inputs": [npy, ...], "outputs": [npy, ...], "rtol": r, "atol": a, "opencv": bool}) and the
.npy files it names: the inputs, fed to the graph inputs in order, and the framework's
predictions (float32), compared with the graph outputs in order elementwise as
|got - want| <= atol + rtol * |want|.

An exported file is only worth something if a program other than the exporter reads it the
same way, so each case goes through runtimes that share no code with the framework:
  1. ONNX's own checker (onnx.checker.check_model, full_check=True);
  2. ONNX's shape inference (strict, with type checks and data propagation), whose element
     type for each graph output must equal the declared one;
  3. the reference evaluator below, written in NumPy from the ONNX operator specifications
     (opset-17 versions): every floating op computes in float32 (float64 for DOUBLE) and
     rounds its result to the output element type (float16, or bfloat16 held as float32
     values that bfloat16 can represent). It also checks every value's shape against shape
     inference and the declared graph inputs and outputs. An op it does not know fails the case;
  4. OpenCV's DNN module where the case asks for it ("opencv": true) and supports the ops.
     It runs in a child process, so that a crash in it is reported, not fatal. When OpenCV
     refuses a model (an exception) the case is only skipped for OpenCV, unless
     --require-opencv names it; when OpenCV runs the model and disagrees, the case fails.

Exit status: 0 when every case passed, 1 otherwise, 77 (a CTest skip) when numpy or onnx
cannot be imported.
"""
import argparse
import itertools
import json
import math
import os
import re
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import onnx
    from onnx import TensorProto as TP, helper, numpy_helper, shape_inference
except Exception as e:  # noqa: BLE001 - any import failure means "cannot run here"
    print(f"check_exports: SKIP: {e}")
    sys.exit(77)

# ---------------------------------------------------------------------------------------------
# Values: a NumPy array plus its ONNX element type. BFLOAT16 values are float32 arrays whose
# values bfloat16 can represent exactly.

NP_TYPE = {TP.FLOAT: np.float32, TP.FLOAT16: np.float16, TP.BFLOAT16: np.float32,
           TP.DOUBLE: np.float64, TP.INT64: np.int64, TP.INT32: np.int32, TP.INT8: np.int8,
           TP.UINT8: np.uint8, TP.BOOL: np.bool_}
FLOAT_TYPES = {TP.FLOAT, TP.FLOAT16, TP.BFLOAT16, TP.DOUBLE}


def type_name(t):
    return TP.DataType.Name(t) if t in TP.DataType.values() else str(t)


class Val:
    __slots__ = ("a", "t")

    def __init__(self, a, t):
        self.a, self.t = a, t


def bf16_round(x):
    """Rounds float32 values to the nearest bfloat16 (ties to even); NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    bits = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) & np.uint32(0xFFFF0000)
    return np.where(np.isnan(x), np.float32(np.nan), bits.view(np.float32))


def make(a, t):
    """An array converted (rounded) to element type t, as Cast does."""
    if t not in NP_TYPE:
        raise ValueError(f"element type {type_name(t)} is not supported")
    a = np.asarray(a)
    if t == TP.BFLOAT16:
        return Val(bf16_round(a.astype(np.float32)), t)
    return Val(a.astype(NP_TYPE[t]), t)


def calc(v):
    """The array to compute with: float32 for the float types (float64 for DOUBLE), else as is."""
    if v.t in (TP.FLOAT, TP.FLOAT16, TP.BFLOAT16):
        return v.a.astype(np.float32)
    return v.a


def from_proto(tp):
    """A TensorProto (initializer or attribute) as a Val; BFLOAT16 decoded from its bits."""
    if tp.data_type == TP.BFLOAT16:
        if tp.raw_data:
            bits = np.frombuffer(tp.raw_data, dtype="<u2")
        else:
            bits = np.array(tp.int32_data, dtype=np.uint32).astype(np.uint16)
        a = (bits.astype(np.uint32) << 16).view(np.float32).reshape(tuple(tp.dims))
        return Val(a, TP.BFLOAT16)
    return make(numpy_helper.to_array(tp), tp.data_type)


def ints(v):
    return [int(i) for i in np.asarray(v.a).reshape(-1)]


def axis_of(a, rank):
    if not -rank <= a < max(rank, 1):
        raise ValueError(f"axis {a} out of range for rank {rank}")
    return a + rank if a < 0 else a

# ---------------------------------------------------------------------------------------------
# Operators. Each takes (inputs, attributes, number of outputs) and returns a Val or a list.
# Absent optional inputs are None.


def unary(f):
    return lambda x, at, n: make(f(calc(x[0])), x[0].t)


def erf(a):
    return np.vectorize(math.erf, otypes=[np.float64])(a).astype(a.dtype)


def int_div(a, b):
    q = np.abs(a) // np.where(b == 0, 1, np.abs(b))  # truncates toward zero, like C
    return np.where((a < 0) != (b < 0), -q, q)


def binary(f, int_f=None):
    def op(x, at, n):
        a, b = x
        if a.t in FLOAT_TYPES:
            return make(f(calc(a), calc(b)), a.t)
        return make((int_f or f)(a.a, b.a), a.t)
    return op


def compare(f):
    return lambda x, at, n: Val(np.asarray(f(calc(x[0]), calc(x[1]))), TP.BOOL)


def variadic(f, mean=False):
    def op(x, at, n):
        r = calc(x[0])
        for v in x[1:]:
            r = f(r, calc(v))
        return make(r / len(x) if mean else r, x[0].t)
    return op


def op_cast(x, at, n):
    return make(calc(x[0]), at["to"])


def op_castlike(x, at, n):
    return make(calc(x[0]), x[1].t)


def op_gemm(x, at, n):
    a, b = calc(x[0]), calc(x[1])
    a = a.T if at.get("transA", 0) else a
    b = b.T if at.get("transB", 0) else b
    y = at.get("alpha", 1.0) * (a @ b)
    if len(x) > 2 and x[2] is not None:
        y = y + at.get("beta", 1.0) * calc(x[2])
    return make(y, x[0].t)


def softmax(a, axis, log):
    m = np.max(a, axis=axis, keepdims=True)
    e = np.exp(a - m)
    s = np.sum(e, axis=axis, keepdims=True)
    return a - m - np.log(s) if log else e / s


def op_softmax(log):
    def op(x, at, n):
        a = calc(x[0])
        return make(softmax(a, axis_of(at.get("axis", -1), a.ndim), log), x[0].t)
    return op


def op_reshape(x, at, n):
    shape = ints(x[1])
    if not at.get("allowzero", 0):
        shape = [x[0].a.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return Val(x[0].a.reshape(shape), x[0].t)


def op_flatten(x, at, n):
    a = x[0].a
    axis = at.get("axis", 1)
    axis = axis + a.ndim if axis < 0 else axis
    if not 0 <= axis <= a.ndim:
        raise ValueError(f"axis {at.get('axis')} out of range")
    rows = int(np.prod(a.shape[:axis], dtype=np.int64))
    return Val(a.reshape(rows, int(np.prod(a.shape[axis:], dtype=np.int64))), x[0].t)


def op_transpose(x, at, n):
    perm = at.get("perm")
    return Val(np.transpose(x[0].a, list(perm) if perm else None), x[0].t)


def op_squeeze(x, at, n):
    axes = ints(x[1]) if len(x) > 1 and x[1] is not None else None
    return Val(np.squeeze(x[0].a, axis=None if axes is None else tuple(axes)), x[0].t)


def op_unsqueeze(x, at, n):
    return Val(np.expand_dims(x[0].a, tuple(ints(x[1]))), x[0].t)


def op_expand(x, at, n):
    shape = np.broadcast_shapes(x[0].a.shape, tuple(ints(x[1])))
    return Val(np.broadcast_to(x[0].a, shape).copy(), x[0].t)


def op_shape(x, at, n):
    shape = x[0].a.shape
    r = len(shape)
    start, end = at.get("start", 0), at.get("end", r)
    start, end = [min(max(i + r if i < 0 else i, 0), r) for i in (start, end)]
    return Val(np.array(shape[start:end], dtype=np.int64), TP.INT64)


def op_concat(x, at, n):
    return Val(np.concatenate([v.a for v in x], axis=at["axis"]), x[0].t)


def op_slice(x, at, n):
    a = x[0].a
    starts, ends = ints(x[1]), ints(x[2])
    axes = ints(x[3]) if len(x) > 3 and x[3] is not None else list(range(len(starts)))
    steps = ints(x[4]) if len(x) > 4 and x[4] is not None else [1] * len(starts)
    index = [slice(None)] * a.ndim
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis, dim = axis_of(axis, a.ndim), a.shape[axis_of(axis, a.ndim)]
        if step == 0:
            raise ValueError("Slice step 0")
        start, end = (start + dim if start < 0 else start), (end + dim if end < 0 else end)
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, None if end < 0 else end, step)
    return Val(a[tuple(index)].copy(), x[0].t)


def op_gather(x, at, n):
    a, idx = x[0].a, x[1].a.astype(np.int64)
    axis = axis_of(at.get("axis", 0), a.ndim)
    dim = a.shape[axis]
    if np.any((idx < -dim) | (idx >= dim)):
        raise ValueError(f"Gather index out of range [-{dim}, {dim})")
    return Val(np.take(a, np.where(idx < 0, idx + dim, idx), axis=axis), x[0].t)


def op_where(x, at, n):
    return make(np.where(x[0].a.astype(bool), x[1].a, x[2].a), x[1].t)


def op_constant_of_shape(x, at, n):
    v = from_proto(at["value"]) if "value" in at else Val(np.zeros(1, np.float32), TP.FLOAT)
    return Val(np.full(tuple(ints(x[0])), v.a.reshape(-1)[0], dtype=v.a.dtype), v.t)


def op_constant(x, at, n):
    if "value" in at:
        return from_proto(at["value"])
    for key, dtype, t in (("value_float", np.float32, TP.FLOAT), ("value_floats", np.float32, TP.FLOAT),
                          ("value_int", np.int64, TP.INT64), ("value_ints", np.int64, TP.INT64)):
        if key in at:
            return Val(np.array(at[key], dtype=dtype), t)
    raise ValueError(f"Constant with attributes {sorted(at)} not supported")


def reduce_op(f, axes_input=False):
    def op(x, at, n):
        a = calc(x[0])
        if axes_input or (len(x) > 1 and x[1] is not None):
            axes = ints(x[1]) if len(x) > 1 and x[1] is not None else []
            if not axes and at.get("noop_with_empty_axes", 0):
                return Val(x[0].a.copy(), x[0].t)
        else:
            axes = list(at.get("axes", []))
        axes = tuple(axis_of(i, a.ndim) for i in axes) if axes else None
        return make(f(a, axes, bool(at.get("keepdims", 1))), x[0].t)
    return op


REDUCERS = {
    "ReduceMean": lambda a, ax, k: np.mean(a, axis=ax, keepdims=k),
    "ReduceSum": lambda a, ax, k: np.sum(a, axis=ax, keepdims=k),
    "ReduceMax": lambda a, ax, k: np.max(a, axis=ax, keepdims=k),
    "ReduceL2": lambda a, ax, k: np.sqrt(np.sum(a * a, axis=ax, keepdims=k)),
    "ReduceSumSquare": lambda a, ax, k: np.sum(a * a, axis=ax, keepdims=k),
}


def window_pads(at, spatial, kernel, strides, dilations):
    """(begin, end) pads per spatial axis from pads / auto_pad."""
    nd = len(spatial)
    auto_pad = at.get("auto_pad", b"NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if auto_pad in ("NOTSET", ""):
        pads = list(at.get("pads", [0] * 2 * nd))
        return pads[:nd], pads[nd:]
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    if auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        raise ValueError(f"auto_pad {auto_pad!r} unknown")
    begin, end = [], []
    for size, k, s, d in zip(spatial, kernel, strides, dilations):
        out = -(-size // s)
        total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
        small, big = total // 2, total - total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else big)
        end.append(big if auto_pad == "SAME_UPPER" else small)
    return begin, end


def windows(a, at, kernel, fill):
    """Sliding windows of a (N, C, *spatial): an array (N, C, prod(kernel), *out_spatial)."""
    nd = len(kernel)
    if a.ndim != nd + 2:
        raise ValueError(f"input rank {a.ndim} does not match kernel_shape {list(kernel)}")
    if at.get("ceil_mode", 0):
        raise ValueError("ceil_mode=1 not supported")
    strides = list(at.get("strides", [1] * nd))
    dilations = list(at.get("dilations", [1] * nd))
    begin, end = window_pads(at, a.shape[2:], kernel, strides, dilations)
    a = np.pad(a, [(0, 0), (0, 0)] + list(zip(begin, end)), constant_values=fill)
    out = [(a.shape[2 + i] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1 for i in range(nd)]
    if min(out) <= 0:
        raise ValueError(f"window larger than the padded input {list(a.shape[2:])}")
    cols = []
    for offsets in itertools.product(*[range(k) for k in kernel]):
        index = tuple(slice(o * d, o * d + s * (m - 1) + 1, s)
                      for o, d, s, m in zip(offsets, dilations, strides, out))
        cols.append(a[(slice(None), slice(None)) + index])
    return np.stack(cols, axis=2)


def op_conv(x, at, n):
    if at.get("group", 1) != 1:
        raise ValueError(f"Conv group={at['group']} not supported (only group=1)")
    a, w = calc(x[0]), calc(x[1])
    kernel = list(at.get("kernel_shape", w.shape[2:]))
    cols = windows(a, at, kernel, 0)                      # (N, C, K, *out)
    out_spatial = cols.shape[3:]
    cols = cols.reshape(a.shape[0], -1, int(np.prod(out_spatial)))
    y = np.matmul(w.reshape(w.shape[0], -1), cols)          # im2col: (M, C*K) @ (N, C*K, P)
    y = y.reshape((a.shape[0], w.shape[0]) + tuple(out_spatial))
    if len(x) > 2 and x[2] is not None:
        y = y + calc(x[2]).reshape((1, -1) + (1,) * len(out_spatial))
    return make(y, x[0].t)


def op_maxpool(x, at, n):
    if n > 1:
        raise ValueError("MaxPool Indices output not supported")
    a = calc(x[0])
    fill = -np.inf if a.dtype.kind == "f" else np.iinfo(a.dtype).min
    return make(windows(a, at, list(at["kernel_shape"]), fill).max(axis=2), x[0].t)


def op_avgpool(x, at, n):
    a = calc(x[0])
    kernel = list(at["kernel_shape"])
    total = windows(a, at, kernel, 0).sum(axis=2)
    if at.get("count_include_pad", 0):
        count = float(np.prod(kernel))
    else:
        count = windows(np.ones((1, 1) + a.shape[2:], a.dtype), at, kernel, 0).sum(axis=2)
    return make(total / count, x[0].t)


def op_global_avgpool(x, at, n):
    a = calc(x[0])
    return make(np.mean(a, axis=tuple(range(2, a.ndim)), keepdims=True), x[0].t)


def op_batchnorm(x, at, n):
    if at.get("training_mode", 0) or n > 1:
        raise ValueError("BatchNormalization in training mode not supported")
    a = calc(x[0])
    shape = (1, -1) + (1,) * (a.ndim - 2)
    scale, bias, mean, var = [calc(v).astype(a.dtype).reshape(shape) for v in x[1:5]]
    y = (a - mean) / np.sqrt(var + np.float32(at.get("epsilon", 1e-5))) * scale + bias
    return make(y, x[0].t)


def op_layernorm(x, at, n):
    a = calc(x[0])
    stash = at.get("stash_type", 1)
    if stash != TP.FLOAT and stash != TP.DOUBLE:
        raise ValueError(f"stash_type {stash} not supported")
    a = a.astype(NP_TYPE[stash])
    axes = tuple(range(axis_of(at.get("axis", -1), a.ndim), a.ndim))
    mean = np.mean(a, axis=axes, keepdims=True)
    d = a - mean
    inv = 1 / np.sqrt(np.mean(d * d, axis=axes, keepdims=True) + a.dtype.type(at.get("epsilon", 1e-5)))
    y = d * inv * calc(x[1])
    if len(x) > 2 and x[2] is not None:
        y = y + calc(x[2])
    return [make(y, x[0].t), make(mean, stash), make(inv, stash)]


def op_dropout(x, at, n):
    if len(x) > 2 and x[2] is not None and bool(x[2].a):
        raise ValueError("Dropout in training mode not supported")
    return [Val(x[0].a.copy(), x[0].t), Val(np.ones(x[0].a.shape, bool), TP.BOOL)]


OPS = {
    "Identity": lambda x, at, n: Val(x[0].a.copy(), x[0].t),
    "Cast": op_cast, "CastLike": op_castlike,
    "Add": binary(np.add), "Sub": binary(np.subtract), "Mul": binary(np.multiply),
    "Div": binary(np.divide, int_div), "Pow": binary(np.power),
    "Sqrt": unary(np.sqrt), "Reciprocal": unary(lambda a: 1 / a), "Neg": unary(np.negative),
    "Abs": unary(np.abs), "Exp": unary(np.exp), "Log": unary(np.log), "Erf": unary(erf),
    "Tanh": unary(np.tanh), "Sigmoid": unary(lambda a: 1 / (1 + np.exp(-a))),
    "Relu": unary(lambda a: np.maximum(a, 0)),
    "Sum": variadic(np.add), "Mean": variadic(np.add, mean=True),
    "Max": variadic(np.maximum), "Min": variadic(np.minimum),
    "MatMul": lambda x, at, n: make(np.matmul(calc(x[0]), calc(x[1])), x[0].t),
    "Gemm": op_gemm, "Softmax": op_softmax(False), "LogSoftmax": op_softmax(True),
    "Reshape": op_reshape, "Flatten": op_flatten, "Transpose": op_transpose,
    "Squeeze": op_squeeze, "Unsqueeze": op_unsqueeze, "Expand": op_expand, "Shape": op_shape,
    "Concat": op_concat, "Slice": op_slice, "Gather": op_gather, "Where": op_where,
    "Equal": compare(np.equal), "Less": compare(np.less), "Greater": compare(np.greater),
    "And": lambda x, at, n: Val(np.logical_and(x[0].a, x[1].a), TP.BOOL),
    "Not": lambda x, at, n: Val(np.logical_not(x[0].a), TP.BOOL),
    "ConstantOfShape": op_constant_of_shape, "Constant": op_constant,
    "ReduceSum": reduce_op(REDUCERS["ReduceSum"], axes_input=True),
    "Conv": op_conv, "MaxPool": op_maxpool, "AveragePool": op_avgpool,
    "GlobalAveragePool": op_global_avgpool, "BatchNormalization": op_batchnorm,
    "LayerNormalization": op_layernorm, "Dropout": op_dropout,
}
OPS.update({name: reduce_op(f) for name, f in REDUCERS.items() if name != "ReduceSum"})


def static_dims(value_info):
    """[dim or None] for a ValueInfo with a shape, else None."""
    tt = value_info.type.tensor_type
    if not tt.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]


def shape_agrees(dims, shape):
    return dims is None or (len(dims) == len(shape) and all(d is None or d == s for d, s in zip(dims, shape)))


def evaluate(model, feeds, inferred):
    """Runs the graph on feeds (arrays, in graph-input order); returns the output Vals."""
    g = model.graph
    env = {t.name: from_proto(t) for t in g.initializer}
    inputs = [i for i in g.input if i.name not in env]
    if len(feeds) != len(inputs):
        raise ValueError(f"{len(feeds)} input files for {len(inputs)} graph inputs")
    for info, a in zip(inputs, feeds):
        t = info.type.tensor_type.elem_type
        if (t in FLOAT_TYPES) != (a.dtype.kind == "f"):
            raise ValueError(f"input {info.name}: file holds {a.dtype}, the graph takes {type_name(t)}")
        if not shape_agrees(static_dims(info), a.shape):
            raise ValueError(f"input {info.name}: file shape {list(a.shape)}, "
                             f"graph shape {static_dims(info)}")
        env[info.name] = make(a, t)
    with np.errstate(all="ignore"):
        for i, node in enumerate(g.node):
            where = f"node {i} ({node.op_type} {node.name!r})"
            if node.domain not in ("", "ai.onnx") or node.op_type not in OPS:
                raise ValueError(f"{where}: op {node.domain + '.' if node.domain else ''}{node.op_type}"
                                 " is not supported by the reference evaluator")
            missing = [name for name in node.input if name and name not in env]
            if missing:
                raise ValueError(f"{where}: input {missing[0]} not computed yet "
                                 "(graph not in topological order?)")
            x = [env[name] if name else None for name in node.input]
            at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            try:
                outs = OPS[node.op_type](x, at, len(node.output))
            except Exception as e:  # noqa: BLE001 - report which node failed and why
                raise ValueError(f"{where}: {type(e).__name__}: {e}") from e
            outs = outs if isinstance(outs, list) else [outs]
            for name, out in zip(node.output, outs):
                if name:
                    env[name] = out
                    if not shape_agrees(inferred.get(name), out.a.shape):
                        raise ValueError(f"{where}: output {name} has shape {list(out.a.shape)}, "
                                         f"shape inference says {inferred[name]}")
            if any(node.output[len(outs):]):
                raise ValueError(f"{where}: only {len(outs)} outputs supported")
    results = []
    for info in g.output:
        v, t = env[info.name], info.type.tensor_type.elem_type
        if v.t != t:
            raise ValueError(f"output {info.name} evaluates to {type_name(v.t)}, declared {type_name(t)}")
        if not shape_agrees(static_dims(info), v.a.shape):
            raise ValueError(f"output {info.name} has shape {list(v.a.shape)}, declared {static_dims(info)}")
        results.append(v.a)
    return results

# ---------------------------------------------------------------------------------------------
# Checks


def compare_outputs(got, want, names, rtol, atol, reshape=False):
    """(error text or None, max abs error, number of values, notes) comparing lists of arrays.
    With reshape, an output of another shape but as many values is compared in the expected
    shape (OpenCV 4.6 returns 1-D tensors as 2-D, for example)."""
    errors, max_abs, count, notes = [], 0.0, 0, []
    for name, g, w in zip(names, got, want):
        g, w = np.asarray(g).astype(np.float32), np.asarray(w).astype(np.float32)
        if g.shape != w.shape:
            if g.size != w.size or not reshape:
                errors.append(f"{name}: shape {list(g.shape)}, expected {list(w.shape)}")
                continue
            notes.append(f"{name} came back as {list(g.shape)}, compared as {list(w.shape)}")
            g = g.reshape(w.shape)
        count += w.size
        if w.size == 0:
            continue
        with np.errstate(all="ignore"):  # inf - inf: equal infinities count as exact
            same = (g == w) | (np.isnan(g) & np.isnan(w))
            diff = np.where(same, 0, np.abs(g.astype(np.float64) - w))
            diff = np.where(np.isnan(diff), np.inf, diff)
            excess = np.where(same, -1, diff - (atol + rtol * np.abs(w.astype(np.float64))))
        max_abs = max(max_abs, float(diff.max()))
        if excess.max() > 0:
            k = np.unravel_index(int(np.argmax(excess)), w.shape)
            with np.errstate(all="ignore"):
                rel = np.where(diff == 0, 0, diff / np.abs(w))
            errors.append(f"{name}: {int((excess > 0).sum())} of {w.size} values out of tolerance; "
                          f"max abs err {diff.max():.3g}, max rel err {rel.max():.3g}; "
                          f"worst at {list(map(int, k))}: got {g[k]!r}, expected {w[k]!r}")
    if len(got) != len(want):
        errors.append(f"{len(got)} outputs, {len(want)} expected")
    return ("; ".join(errors) or None), max_abs, count, notes


def check_shapes(model):
    """Strict shape inference; returns {value name: static dims} or raises."""
    shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    del bare.graph.output[:]
    bare.graph.output.extend(helper.make_empty_tensor_value_info(o.name) for o in model.graph.output)
    inferred = shape_inference.infer_shapes(bare, check_type=True, strict_mode=True, data_prop=True)
    infos = {v.name: v for v in list(inferred.graph.value_info) + list(inferred.graph.output)}
    for out in model.graph.output:
        declared = out.type.tensor_type.elem_type
        got = infos[out.name].type.tensor_type.elem_type if out.name in infos else 0
        if got != declared:
            raise ValueError(f"output {out.name}: inferred element type {type_name(got)}, "
                             f"declared {type_name(declared)}")
    return {name: static_dims(v) for name, v in infos.items()}


def run_opencv(onnx_path, input_paths, in_names, out_names):
    """Runs the model with OpenCV in a child process; returns the outputs or raises RuntimeError."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "out.npz")
        spec = json.dumps({"model": onnx_path, "inputs": input_paths, "in_names": in_names,
                           "out_names": out_names, "result": result})
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--opencv-worker", spec],
                               capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise RuntimeError("OpenCV took more than 600 s") from None
        if p.returncode != 0:
            lines = [l for l in p.stderr.splitlines() if l.startswith("opencv-error: ")]
            raise RuntimeError(lines[-1][len("opencv-error: "):] if lines else
                               f"OpenCV crashed (signal {-p.returncode})" if p.returncode < 0 else
                               f"OpenCV process exited with status {p.returncode}")
        with np.load(result) as data:
            return [data[f"out{i}"] for i in range(len(out_names))]


def opencv_worker(spec):
    spec = json.loads(spec)
    try:
        import cv2
        net = cv2.dnn.readNetFromONNX(spec["model"])
        blobs = [np.load(p) for p in spec["inputs"]]
        if hasattr(cv2, "_registerMatType"):
            # cv2 reads a 3-D array as a 2-D image with channels; an array of a registered type
            # whose wrap_channels is False travels as a 3-D blob (what cv2.Mat does in newer builds).
            class NDBlob(np.ndarray):
                wrap_channels = False
            cv2._registerMatType(NDBlob)
            blobs = [b.view(NDBlob) for b in blobs]
        if len(blobs) == 1:
            net.setInput(blobs[0])
        else:
            for name, blob in zip(spec["in_names"], blobs):
                net.setInput(blob, name)
        outs = net.forward(spec["out_names"])
        np.savez(spec["result"], **{f"out{i}": np.asarray(o) for i, o in enumerate(outs)})
    except Exception as e:  # noqa: BLE001 - every failure is reported to the parent
        # cv2.error reads "OpenCV(4.6.0) file:line: error: (-2:...) in function 'f'\n> Node [...] ...":
        # keep the lines that name the node, without the source locations.
        lines = [re.sub(r"OpenCV\([^)]*\) \S+:\d+: error: ", "", l).strip(" >") for l in str(e).splitlines()]
        lines = [l for l in lines if l]
        detail = [l for l in lines if l.startswith("Node")] or lines or [type(e).__name__]
        print("opencv-error: " + detail[0], file=sys.stderr)
        sys.exit(3)
    return 0


def check_opencv(model, onnx_path, input_paths, want, rtol, atol, required, have_cv2):
    """(passed, report text) for OpenCV's run of the model; a refusal passes unless required."""
    out_names = [o.name for o in model.graph.output]
    initializers = {t.name for t in model.graph.initializer}
    in_names = [i.name for i in model.graph.input if i.name not in initializers]
    try:
        if not have_cv2:
            raise RuntimeError("not installed")
        got = run_opencv(os.path.abspath(onnx_path), [os.path.abspath(p) for p in input_paths],
                         in_names, out_names)
    except Exception as e:  # noqa: BLE001 - OpenCV refusing the model is a finding, not a crash
        error = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if required:
            return False, f"opencv FAILED (required; {error})"
        return True, "opencv: not installed" if error == "not installed" else f"opencv: skipped ({error})"
    mismatch, max_abs, _, notes = compare_outputs(got, want, out_names, rtol, atol, reshape=True)
    note = "".join("; " + n for n in notes)
    if mismatch:
        return False, f"opencv FAILED ({mismatch}{note})"
    return True, f"opencv ok (max abs err {max_abs:.3g}{note})"


def one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


def check_case(directory, name, require_opencv, have_cv2):
    """Returns (passed, report line)."""
    parts, ok = [], True
    onnx_path, json_path = os.path.join(directory, name + ".onnx"), os.path.join(directory, name + ".json")
    try:
        with open(json_path) as f:
            spec = json.load(f)
        model = onnx.load(onnx_path)
        feeds = [np.load(os.path.join(directory, p)) for p in spec["inputs"]]
        want = [np.load(os.path.join(directory, p)) for p in spec["outputs"]]
        rtol, atol = float(spec["rtol"]), float(spec["atol"])
    except Exception as e:  # noqa: BLE001
        return False, f"{name}: FAILED to read the case ({type(e).__name__}: {one_line(e)})"
    try:
        onnx.checker.check_model(model, full_check=True)
        parts.append("checker ok")
    except Exception as e:  # noqa: BLE001
        ok = False
        parts.append(f"checker FAILED ({one_line(e)})")
    inferred = {}
    try:
        inferred = check_shapes(model)
        parts.append("shapes ok")
    except Exception as e:  # noqa: BLE001
        ok = False
        parts.append(f"shapes FAILED ({one_line(e)})")
    ops = ", ".join(sorted({n.op_type for n in model.graph.node}))
    out_names = [o.name for o in model.graph.output]
    try:
        got = evaluate(model, feeds, inferred)
        error, max_abs, count, _ = compare_outputs(got, want, out_names, rtol, atol)
    except Exception as e:  # noqa: BLE001
        error = one_line(e)
    if error:
        ok = False
        parts.append(f"reference evaluator FAILED ({error}; ops: {ops})")
    else:
        parts.append(f"reference evaluator ok (max abs err {max_abs:.3g} over {count} values; ops: {ops})")
    if spec.get("opencv", False) or name in require_opencv:
        cv_ok, text = check_opencv(model, onnx_path, [os.path.join(directory, p) for p in spec["inputs"]],
                                   want, rtol, atol, name in require_opencv, have_cv2)
        ok = ok and cv_ok
        parts.append(text)
    return ok, f"{name}: " + ", ".join(parts)


def main(argv):
    if len(argv) == 2 and argv[0] == "--opencv-worker":  # the child process of run_opencv
        return opencv_worker(argv[1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="directory of exported cases (NAME.onnx, NAME.json, .npy files)")
    parser.add_argument("--require-opencv", nargs="*", default=[], action="extend", metavar="CASE",
                        help="cases that must also pass with OpenCV's DNN module")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.dir):
        print(f"check_exports: {args.dir} is not a directory")
        return 1
    names = sorted({os.path.splitext(f)[0] for f in os.listdir(args.dir)
                    if f.endswith((".onnx", ".json"))})
    if not names:
        print(f"check_exports: no cases (NAME.onnx + NAME.json) in {args.dir}")
        return 1
    try:
        import cv2  # noqa: F401 - only whether it imports; the worker process uses it
        have_cv2 = True
    except Exception:  # noqa: BLE001
        have_cv2 = False
    failed = [f"{c} (no such case)" for c in args.require_opencv if c not in names]
    for c in failed:
        print(f"{c.split()[0]}: FAILED: --require-opencv names a case that is not in {args.dir}")
    for name in names:
        ok, line = check_case(args.dir, name, set(args.require_opencv), have_cv2)
        print(line, flush=True)
        if not ok:
            failed.append(name)
    total = len(names) + sum(c not in names for c in args.require_opencv)
    if failed:
        print(f"check_exports: {len(failed)} of {total} cases failed: {', '.join(failed)}")
        return 1
    print(f"check_exports: all {total} cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
