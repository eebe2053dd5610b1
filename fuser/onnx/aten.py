"""Standard ONNX for the core ATen ops (and the symbolic-size arithmetic) of a step graph,
one node at a time, registered in `graph.HANDLERS`."""

from __future__ import annotations

import operator
from collections.abc import Callable

import numpy as np
import torch
from onnx import numpy_helper

from fuser.onnx.graph import (HANDLERS, GraphTranslator, Sym, handles, np_dtype, onnx_dtype,
                              op_name, out_dtype)

aten = torch.ops.aten

def _elementwise(op_type: str) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> str:
        if node.kwargs.get("alpha", 1) != 1:
            raise t.fail(node, f"{op_name(node.target)} with alpha")
        dtype = out_dtype(t, node)
        return t.b.op1(op_type, [t.value(a, dtype) for a in node.args[:2]])
    return handle


for _op, _onnx in ((aten.add, "Add"), (aten.sub, "Sub"), (aten.mul, "Mul"), (aten.div, "Div"),
                   (aten.maximum, "Max"), (aten.minimum, "Min")):
    HANDLERS[_op] = _elementwise(_onnx)


def _comparison(op_type: str, negate: bool = False) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> str:
        a, b = node.args[:2]
        dtypes = [t.dtype_of(x) for x in (a, b) if isinstance(x, torch.fx.Node)]
        dtype = dtypes[0] if dtypes else torch.int64
        for d in dtypes[1:]:
            dtype = torch.promote_types(dtype, d)
        if any(isinstance(x, float) for x in (a, b)) and not dtype.is_floating_point:
            dtype = torch.float32
        out = t.b.op1(op_type, [t.value(a, dtype), t.value(b, dtype)])
        return t.b.op1("Not", [out]) if negate else out
    return handle


for _op, _onnx, _neg in ((aten.lt, "Less", False), (aten.gt, "Greater", False),
                         (aten.le, "LessOrEqual", False), (aten.ge, "GreaterOrEqual", False),
                         (aten.eq, "Equal", False), (aten.ne, "Equal", True)):
    HANDLERS[_op] = _comparison(_onnx, _neg)


def _unary(op_type: str) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> str:
        return t.b.op1(op_type, [t.value(node.args[0])])
    return handle


for _op, _onnx in ((aten.neg, "Neg"), (aten.cos, "Cos"), (aten.sin, "Sin"),
                   (aten.sigmoid, "Sigmoid"), (aten.tanh, "Tanh"), (aten.exp, "Exp"),
                   (aten.sqrt, "Sqrt"), (aten.reciprocal, "Reciprocal"), (aten.abs, "Abs"),
                   (aten.clone, "Identity"), (aten.alias, "Identity"),
                   (aten.logical_not, "Not"), (aten.bitwise_not, "Not"), (aten.erf, "Erf")):
    HANDLERS[_op] = _unary(_onnx)


@handles(aten.logical_and, aten.bitwise_and)
def _and(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("And", [t.value(node.args[0]), t.value(node.args[1])])


@handles(aten.logical_or, aten.bitwise_or)
def _or(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Or", [t.value(node.args[0]), t.value(node.args[1])])


@handles(aten.rsqrt)
def _rsqrt(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Reciprocal", [t.b.op1("Sqrt", [t.value(node.args[0])])])


@handles(aten.pow)
def _pow(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = out_dtype(t, node)
    return t.b.op1("Pow", [t.value(node.args[0], dtype), t.value(node.args[1], dtype)])


@handles(aten.silu)
def _silu(t: GraphTranslator, node: torch.fx.Node) -> str:
    x = t.value(node.args[0])
    return t.b.op1("Mul", [x, t.b.op1("Sigmoid", [x])])


@handles(aten.gelu)
def _gelu(t: GraphTranslator, node: torch.fx.Node) -> str:
    """GELU by its formula (ONNX's Gelu op arrives in opset 20)."""
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    b, dtype = t.b, out_dtype(t, node)
    x = t.value(node.args[0])
    c = lambda v: b.const(np.array(v, np_dtype(dtype)))  # noqa: E731
    if approximate == "tanh":
        cube = b.op1("Mul", [b.op1("Mul", [x, x]), x])
        inner = b.op1("Mul", [c(0.7978845608028654),
                              b.op1("Add", [x, b.op1("Mul", [c(0.044715), cube])])])
        return b.op1("Mul", [b.op1("Mul", [c(0.5), x]),
                             b.op1("Add", [c(1.0), b.op1("Tanh", [inner])])])
    erf = b.op1("Erf", [b.op1("Mul", [x, c(0.7071067811865476)])])
    return b.op1("Mul", [b.op1("Mul", [c(0.5), x]), b.op1("Add", [c(1.0), erf])])


@handles(aten.where)
def _where_op(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = out_dtype(t, node)
    cond, a, b = node.args[:3]
    return t.b.op1("Where", [t.value(cond), t.value(a, dtype), t.value(b, dtype)])


@handles(aten._to_copy)
def _to_copy(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Cast", [t.value(node.args[0])], to=onnx_dtype(out_dtype(t, node)))


@handles(aten.embedding)
def _embedding(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Gather", [t.value(node.args[0]), t.value(node.args[1])], axis=0)


def _transposed_weight(t: GraphTranslator, arg: object) -> str | None:
    """The weight W when `arg` is permute(W, [1, 0]) of a parameter, else None."""
    if isinstance(arg, torch.fx.Node) and arg.target == aten.permute.default and \
            list(arg.args[1]) == [1, 0] and isinstance(arg.args[0], torch.fx.Node) and \
            arg.args[0].op == "get_attr":
        return t.value(arg.args[0])
    return None


@handles(aten.mm)
def _mm(t: GraphTranslator, node: torch.fx.Node) -> str:
    weight = _transposed_weight(t, node.args[1])
    if weight is not None:  # x @ W.T: the parameter as stored
        return t.b.op1("Gemm", [t.value(node.args[0]), weight], transB=1)
    return t.b.op1("MatMul", [t.value(node.args[0]), t.value(node.args[1])])


@handles(aten.addmm)
def _addmm(t: GraphTranslator, node: torch.fx.Node) -> str:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        raise t.fail(node, "addmm with alpha or beta")
    bias, x, w = node.args[:3]
    weight = _transposed_weight(t, w)
    if weight is not None:
        return t.b.op1("Gemm", [t.value(x), weight, t.value(bias)], transB=1)
    return t.b.op1("Gemm", [t.value(x), t.value(w), t.value(bias)])


@handles(aten.bmm, aten.matmul)
def _bmm(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("MatMul", [t.value(node.args[0]), t.value(node.args[1])])


@handles(aten.permute)
def _permute(t: GraphTranslator, node: torch.fx.Node) -> str:
    rank = len(node.args[1])
    return t.b.op1("Transpose", [t.value(node.args[0])],
                   perm=[d % rank for d in node.args[1]])


@handles(aten.t)
def _t(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Transpose", [t.value(node.args[0])], perm=[1, 0])


@handles(aten.transpose)
def _transpose(t: GraphTranslator, node: torch.fx.Node) -> str:
    rank = t.meta(node).dim()
    perm = list(range(rank))
    a, b = node.args[1] % rank, node.args[2] % rank
    perm[a], perm[b] = perm[b], perm[a]
    return t.b.op1("Transpose", [t.value(node.args[0])], perm=perm)


_VIEWS = (aten.view, aten._unsafe_view, aten.reshape)


def _static_shape(node: torch.fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    shape = getattr(val, "shape", None)
    if shape is None or not all(isinstance(s, int) for s in shape):
        return None
    return tuple(shape)


@handles(*_VIEWS)
def _view(t: GraphTranslator, node: torch.fx.Node) -> str:
    # A view to the shape its input already has is no node at all (chains of Reshapes are
    # folded over the whole graph: graph.py `_fold_reshapes`).
    src = node.args[0]
    shape = _static_shape(node)
    if shape is not None and isinstance(src, torch.fx.Node) and _static_shape(src) == shape:
        return t.value(src)
    return t.b.op1("Reshape", [t.value(src), t.shape(node.args[1])])


@handles(aten.unsqueeze)
def _unsqueeze(t: GraphTranslator, node: torch.fx.Node) -> str:
    dim = node.args[1] % t.meta(node).dim()
    return t.b.op1("Unsqueeze", [t.value(node.args[0]), t.b.const([dim], np.int64)])


@handles(aten.squeeze)
def _squeeze(t: GraphTranslator, node: torch.fx.Node) -> str:
    rank = t.meta(node.args[0]).dim()
    dims = node.args[1] if len(node.args) > 1 else None
    if dims is None:
        return t.b.op1("Squeeze", [t.value(node.args[0])])
    dims = [dims] if isinstance(dims, int) else list(dims)
    shape = t.meta(node.args[0]).shape
    dims = [d % rank for d in dims if shape[d % rank] == 1]
    if not dims:
        return t.b.op1("Identity", [t.value(node.args[0])])
    return t.b.op1("Squeeze", [t.value(node.args[0]), t.b.const(dims, np.int64)])


@handles(aten.expand)
def _expand(t: GraphTranslator, node: torch.fx.Node) -> str:
    sizes = [1 if isinstance(s, int) and s == -1 else s for s in node.args[1]]
    return t.b.op1("Expand", [t.value(node.args[0]), t.shape(sizes)])


@handles(aten.cat)
def _cat(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = out_dtype(t, node)
    dim = node.args[1] if len(node.args) > 1 else 0
    return t.b.op1("Concat", [t.value(x, dtype) for x in node.args[0]],
                   axis=dim % t.meta(node).dim())


@handles(aten.slice)
def _slice(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, dim = node.args[0], node.args[1] if len(node.args) > 1 else 0
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else 2**63 - 1
    step = node.args[4] if len(node.args) > 4 else 1
    rank = t.meta(x).dim()

    def one(v: object) -> str:
        if isinstance(v, torch.fx.Node):
            return t.env[v].name
        return t.b.const([min(v, 2**63 - 1)], np.int64)

    return t.b.op1("Slice", [t.value(x), one(start), one(end),
                             t.b.const([dim % rank], np.int64), one(step)])


@handles(aten.select)
def _select(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, dim, index = node.args[:3]
    rank = t.meta(x).dim()
    return t.b.op1("Gather", [t.value(x), t.scalar(index)], axis=dim % rank)


@handles(aten.mean, aten.sum, aten.amax)
def _reduce(t: GraphTranslator, node: torch.fx.Node) -> str:
    op_type = {aten.mean: "ReduceMean", aten.sum: "ReduceSum", aten.amax: "ReduceMax"}[
        node.target.overloadpacket]
    x = node.args[0]
    rank = t.meta(x).dim()
    dims = node.args[1] if len(node.args) > 1 else list(range(rank))
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None:
        raise t.fail(node, f"{op_name(node.target)} with a dtype")
    dims = [d % rank for d in ([dims] if isinstance(dims, int) else dims)]
    return t.b.op1(op_type, [t.value(x), t.b.const(dims, np.int64)], keepdims=int(keepdim))


@handles(aten._softmax)
def _softmax(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, dim = node.args[:2]
    return t.b.op1("Softmax", [t.value(x)], axis=dim % t.meta(x).dim())


@handles(aten.arange)
def _arange(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = out_dtype(t, node)
    args = list(node.args)
    if node.target == aten.arange.default:
        args = [0, args[0]]
    start, end = args[0], args[1]
    step = args[2] if len(args) > 2 else 1
    return t.b.op1("Range", [t.scalar(start, dtype), t.scalar(end, dtype),
                             t.scalar(step, dtype)])


@handles(aten.full)
def _full(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = out_dtype(t, node)
    value = numpy_helper.from_array(np.array([node.args[1]], np_dtype(dtype)))
    return t.b.op1("ConstantOfShape", [t.shape(node.args[0])], value=value)


@handles(aten.scalar_tensor)
def _scalar_tensor(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.const(np.array(node.args[0], np_dtype(out_dtype(t, node))))


@handles(aten.sym_size.int)
def _sym_size(t: GraphTranslator, node: torch.fx.Node) -> Sym:
    dim = node.args[1] % t.meta(node.args[0]).dim()
    return Sym(t.b.op1("Shape", [t.value(node.args[0])], start=dim, end=dim + 1))


def _sym_binary(op_type: str) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> Sym:
        parts = [t.env[a].name if isinstance(a, torch.fx.Node) else t.b.const([a], np.int64)
                 for a in node.args]
        return Sym(t.b.op1(op_type, parts))
    return handle


for _op, _onnx in ((operator.mul, "Mul"), (operator.add, "Add"), (operator.sub, "Sub"),
                   (operator.floordiv, "Div")):
    HANDLERS[_op] = _sym_binary(_onnx)


@handles(operator.getitem)
def _getitem(t: GraphTranslator, node: torch.fx.Node) -> object:
    value = t.env[node.args[0]]
    if not isinstance(value, (tuple, list)):
        raise t.fail(node, "indexing a value that is not a tuple")
    return value[node.args[1]]


