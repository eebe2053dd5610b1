"""One rewritten step graph (ATen FX, after the ONNX subset of the passes) as an ONNX graph.

    (tokens[B, T], positions[B, T], seq_lens[B], starts[B], past_key_i[B, kv, S, D],
     past_value_i[B, kv, S, D] per layer) -> (logits[B, T, V], present_key_i, present_value_i)

Every fused op the passes found becomes onnxruntime's own operator:

| fuser op (passes/) | onnxruntime operator |
|---|---|
| `fuser::rms_norm` (rms_norm) | `SimplifiedLayerNormalization` |
| `fuser::add_rms_norm` (add_rms_norm) | `com.microsoft.SkipSimplifiedLayerNormalization` |
| `fuser::rotary` (rotary) | `com.microsoft.RotaryEmbedding`, one per rotated tensor |
| KV-cache write + `fuser::cache_attention` / `fuser::prefill_attention` (capture) | `com.microsoft.GroupQueryAttention` |

The KV cache is explicit input and output, in GroupQueryAttention's BNSH layout over the whole
cache (past and present of one length S, so a runtime may bind both to one buffer); left
padding (`starts`) is GroupQueryAttention's `attention_bias`. The rotary angles become
RotaryEmbedding's cos/sin tables: the graph's own angle computation evaluated at every position
below S, and checked to be a per-position lookup. Every other node maps to standard ONNX, one
ATen op at a time; a node with no translation, or a fused op in a form the mapping does not
cover, raises `OnnxExportError` naming it. Nothing is approximated.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

OPSET = 18
MS = "com.microsoft"

_DTYPES = {
    torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
    torch.bfloat16: TensorProto.BFLOAT16, torch.float64: TensorProto.DOUBLE,
    torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32, torch.bool: TensorProto.BOOL,
    torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8,
}

aten = torch.ops.aten


class OnnxExportError(ValueError):
    """A model piece, precision or argument the ONNX export does not take (the message names
    it); the export never approximates one."""


def onnx_dtype(dtype: torch.dtype) -> int:
    """The TensorProto element type of a torch dtype."""
    if dtype not in _DTYPES:
        raise OnnxExportError(f"dtype {dtype} has no ONNX element type here")
    return _DTYPES[dtype]


def cache_names(num_layers: int, kind: str) -> list[str]:
    """The graph's cache inputs (kind "past") or outputs ("present"): key then value per layer,
    interleaved by layer."""
    return [f"{kind}_{kv}_{i}" for i in range(num_layers) for kv in ("key", "value")]


@dataclass
class Translated:
    """An ONNX graph of one step and what it reads.

    Attributes:
        model: the ModelProto; initializers named in `weights` are not in it (external data).
        weights: initializer name -> the tensor (the model's parameters, kept by reference).
        op_counts: ONNX op type ("domain.Op" outside the default domain) -> nodes.
    """

    model: onnx.ModelProto
    weights: dict[str, torch.Tensor]
    op_counts: dict[str, int] = field(default_factory=dict)


def op_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Nodes per op type ("com.microsoft.X" for a contrib op), sorted by name."""
    counts = Counter(f"{n.domain}.{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
                     for n in model.graph.node)
    return dict(sorted(counts.items()))


def _where(node: torch.fx.Node) -> str:
    """The model module a node came from, for error messages."""
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return f" (in {path})"
    return ""


class _Builder:
    """ONNX nodes, initializers and fresh names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.constants: list[onnx.TensorProto] = []
        self._names: Counter = Counter()
        self._const_cache: dict[tuple, str] = {}

    def name(self, base: str) -> str:
        self._names[base] += 1
        n = self._names[base]
        return base if n == 1 else f"{base}_{n}"

    def op(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1,
           domain: str = "", base: str | None = None, **attrs: object) -> list[str]:
        if isinstance(outputs, int):
            outputs = [self.name(base or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), list(outputs),
                                           name=self.name(f"/{op_type}"), domain=domain,
                                           **attrs))
        return list(outputs)

    def op1(self, op_type: str, inputs: Sequence[str], domain: str = "",
            **attrs: object) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]

    def const(self, value: np.ndarray | Sequence[int] | int | float,
              dtype: np.dtype | None = None) -> str:
        """An initializer holding `value` (deduplicated)."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._const_cache:
            name = self.name("const")
            self.constants.append(numpy_helper.from_array(array, name))
            self._const_cache[key] = name
        return self._const_cache[key]


    def const_bf16(self, value: float) -> str:
        """A bfloat16 scalar initializer (numpy has no bfloat16)."""
        key = ("bf16", value)
        if key not in self._const_cache:
            name = self.name("const")
            bits = torch.tensor(value, dtype=torch.bfloat16).view(torch.int16).item() & 0xFFFF
            self.constants.append(helper.make_tensor(name, TensorProto.BFLOAT16, [], [bits],
                                                     raw=False))
            self._const_cache[key] = name
        return self._const_cache[key]


def _np_dtype(dtype: torch.dtype) -> np.dtype:
    if dtype == torch.bfloat16:
        raise OnnxExportError("a bfloat16 scalar constant in the graph (export in fp32 or fp16)")
    return torch.empty((), dtype=dtype).numpy().dtype


class GraphTranslator:
    """Translate one FX graph (see the module docstring); `run()` -> Translated."""

    def __init__(self, gm: torch.fx.GraphModule, name: str, num_layers: int,
                 rotary_positions: int) -> None:
        self.gm = gm
        self.name = name
        self.num_layers = num_layers
        self.rotary_positions = rotary_positions
        self.b = _Builder()
        self.env: dict[torch.fx.Node, object] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.cache_nodes: dict[str, tuple[str, int]] = {}  # cache get_attr -> (key|value, layer)
        self.writes: dict[torch.fx.Node, tuple[str, int]] = {}  # cache index_put -> (kv, layer)
        self.presents: dict[tuple[str, int], str] = {}
        self._shared: dict[str, str] = {}
        self._rotary_tables: dict[tuple[torch.fx.Node, torch.fx.Node], tuple[str, str]] = {}
        self.dtype: torch.dtype | None = None

    # -- helpers ---------------------------------------------------------------------------

    def fail(self, node: torch.fx.Node, why: str) -> OnnxExportError:
        return OnnxExportError(f"{self.name}: {why}{_where(node)}; the ONNX export does not "
                               "approximate it")

    def meta(self, node: object) -> object:
        return node.meta.get("val") if isinstance(node, torch.fx.Node) else None

    def dtype_of(self, value: object) -> torch.dtype | None:
        val = self.meta(value)
        return val.dtype if isinstance(val, torch.Tensor) else None

    def value(self, arg: object, dtype: torch.dtype | None = None) -> str:
        """The ONNX name of an FX argument: a node's value, or a constant (of `dtype`)."""
        if isinstance(arg, torch.fx.Node):
            v = self.env[arg]
            if isinstance(v, _Sym):
                return v.name if dtype in (None, torch.int64) else \
                    self.b.op1("Cast", [v.name], to=onnx_dtype(dtype))
            if isinstance(v, _CacheRef):
                raise self.fail(arg, f"the {v.which[0]} cache of layer {v.which[1]} read "
                                "outside an attention")
            if not isinstance(v, str):
                raise self.fail(arg, f"{_op_name(arg.target)}'s result used as one tensor")
            name = v
            src = self.dtype_of(arg)
            if dtype is not None and src is not None and src != dtype:
                name = self.b.op1("Cast", [name], to=onnx_dtype(dtype))
            return name
        if isinstance(arg, (bool, int, float)):
            if dtype == torch.bfloat16:
                return self.b.const_bf16(float(arg))
            return self.b.const(arg, _np_dtype(dtype or torch.float32))
        raise OnnxExportError(f"{self.name}: argument {arg!r} is not a tensor or a number")

    def shape(self, sizes: Sequence[object]) -> str:
        """A 1-D int64 shape from ints and symbolic sizes."""
        if all(isinstance(s, int) for s in sizes):
            return self.b.const(list(sizes), np.int64)
        parts = [self.env[s].name if isinstance(s, torch.fx.Node) else self.b.const([s], np.int64)
                 for s in sizes]
        return self.b.op1("Concat", parts, axis=0)

    def scalar(self, arg: object, dtype: torch.dtype = torch.int64) -> str:
        """A 0-d tensor of `arg` (an int, a float or a symbolic size)."""
        if isinstance(arg, torch.fx.Node):
            name = self.env[arg].name
            name = self.b.op1("Squeeze", [name, self.b.const([0], np.int64)])
            return name if dtype == torch.int64 else self.b.op1("Cast", [name],
                                                               to=onnx_dtype(dtype))
        return self.b.const(np.array(arg, dtype=_np_dtype(dtype)))

    # -- the graph -------------------------------------------------------------------------

    def run(self) -> Translated:
        graph = self.gm.graph
        inputs = []
        for node in graph.nodes:
            if node.op == "placeholder":
                if node.target not in ("tokens", "positions", "seq_lens", "starts"):
                    raise self.fail(node, f"graph input {node.target!r} is not a step input")
                self.env[node] = node.target
                inputs.append(helper.make_tensor_value_info(
                    node.target, TensorProto.INT64, ["batch", "tokens"] if node.target in
                    ("tokens", "positions") else ["batch"]))
            elif node.op == "get_attr":
                self.get_attr(node)
        for node in graph.nodes:
            if node.op == "call_function":
                self.call(node)
            elif node.op == "output":
                result = node.args[0]
                if isinstance(result, (tuple, list)):
                    if len(result) != 1:
                        raise self.fail(node, "a step graph with several outputs")
                    result = result[0]
                logits = self.b.op("Identity", [self.value(result)], ["logits"])[0]
                out_dtype = self.dtype_of(result)
            elif node.op not in ("placeholder", "get_attr"):
                raise self.fail(node, f"FX node kind {node.op!r}")
        dtype = self.dtype or torch.float32
        for (kv, layer) in [(kv, i) for i in range(self.num_layers) for kv in ("key", "value")]:
            if (kv, layer) not in self.presents:
                raise OnnxExportError(f"{self.name}: layer {layer}'s {kv} cache is never "
                                      "written by an attention the export maps")
            cache_shape = ["batch", f"kv_heads_{layer}", "max_seq_len", f"head_dim_{layer}"]
            inputs.append(helper.make_tensor_value_info(f"past_{kv}_{layer}",
                                                        onnx_dtype(dtype), cache_shape))
        out_dtype = out_dtype or dtype
        outputs = [helper.make_tensor_value_info(logits, onnx_dtype(out_dtype),
                                                 ["batch", "tokens", "vocab"])]
        outputs += [helper.make_tensor_value_info(name, onnx_dtype(dtype), None)
                    for name in cache_names(self.num_layers, "present")]
        onnx_graph = helper.make_graph(self.b.nodes, self.name.replace(".", "_"), inputs,
                                       outputs, initializer=self.b.constants)
        model = helper.make_model(onnx_graph, producer_name="fuser", opset_imports=[
            helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
        model.ir_version = 9
        _prune(model)
        used = {i for n in model.graph.node for i in n.input}
        return Translated(model, {k: v for k, v in self.weights.items() if k in used},
                          op_counts(model))

    def get_attr(self, node: torch.fx.Node) -> None:
        target = node.target
        tensor = self.gm
        for part in target.split("."):
            tensor = getattr(tensor, part)
        for kv in ("k", "v"):
            prefix = f"{kv}_cache_"
            if target.startswith(prefix) and target[len(prefix):].isdigit():
                layer = int(target[len(prefix):])
                self.cache_nodes[target] = ("key" if kv == "k" else "value", layer)
                self.env[node] = _CacheRef(("key" if kv == "k" else "value", layer))
                self.dtype = tensor.dtype
                return
        if not isinstance(tensor, torch.Tensor):
            raise self.fail(node, f"attribute {target!r} is not a tensor")
        name = target
        self.weights[name] = tensor.detach()
        self.env[node] = name

    def call(self, node: torch.fx.Node) -> None:
        target = node.target
        handler = _HANDLERS.get(target)
        if handler is None and isinstance(target, torch._ops.OpOverload):
            handler = _HANDLERS.get(target.overloadpacket)
        if handler is None:
            raise self.fail(node, f"{_op_name(target)} has no ONNX translation")
        self.env[node] = handler(self, node)

    # -- shared attention inputs ---------------------------------------------------------

    def shared(self, key: str, make: Callable[[], str]) -> str:
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def tokens_T(self) -> str:
        """T as a 1-D [1] int64."""
        return self.shared("T", lambda: self.b.op1("Shape", ["tokens"], start=1, end=2))

    def attention_inputs(self, dtype: torch.dtype) -> tuple[str, str, str, str]:
        """(seqlens_k int32 [B], total_sequence_length int32 scalar, attention_bias [B, 1, T,
        total], query_seqlens int32 [B]) of GroupQueryAttention, built once per graph."""
        b = self.b

        def seqlens_k() -> str:
            T = self.tokens_T()
            last = b.op1("Sub", [b.op1("Add", ["seq_lens", T]), b.const([1], np.int64)])
            return b.op1("Cast", [last], to=TensorProto.INT32)

        def total64() -> str:
            longest = b.op1("ReduceMax", ["seq_lens"], keepdims=0)
            return b.op1("Add", [longest, b.op1("Squeeze", [self.tokens_T(),
                                                            b.const([0], np.int64)])])

        def total() -> str:
            return b.op1("Cast", [self.shared("total64", total64)], to=TensorProto.INT32)

        def bias() -> str:
            # Key slots before a row's start are its left padding: masked by a large finite
            # negative (a row of padding queries then averages finite values, never NaN).
            columns = b.op1("Range", [b.const(np.array(0, np.int64)),
                                      self.shared("total64", total64),
                                      b.const(np.array(1, np.int64))])
            starts = b.op1("Unsqueeze", ["starts", b.const([1], np.int64)])
            padding = b.op1("Less", [b.op1("Unsqueeze", [columns, b.const([0], np.int64)]),
                                     starts])  # [B, total]
            negative = float(torch.finfo(dtype).min) / 4
            mask = b.op1("Where", [padding, b.const(np.array(negative, _np_dtype(dtype))),
                                   b.const(np.array(0.0, _np_dtype(dtype)))])
            mask = b.op1("Unsqueeze", [mask, b.const([1, 2], np.int64)])  # [B, 1, 1, total]
            rows = b.op1("Concat", [b.const([1, 1], np.int64), self.tokens_T(),
                                    b.const([1], np.int64)], axis=0)
            return b.op1("Expand", [mask, rows])

        def query_seqlens() -> str:
            T = b.op1("Cast", [self.tokens_T()], to=TensorProto.INT32)
            zeros = b.op1("Cast", [b.op1("Mul", ["seq_lens", b.const([0], np.int64)])],
                          to=TensorProto.INT32)
            return b.op1("Add", [zeros, T])

        return (self.shared("seqlens_k", seqlens_k), self.shared("total", total),
                self.shared(f"bias_{dtype}", bias), self.shared("query_seqlens", query_seqlens))

    def rotary_tables(self, node: torch.fx.Node, cos: torch.fx.Node, sin: torch.fx.Node,
                      head_dim: int) -> tuple[str, str]:
        """RotaryEmbedding's cos/sin caches [S, R/2] for the graph's angle tensors `cos`, `sin`
        ([B, T, R]): the subgraph computing them evaluated at positions 0..S-1, after checking
        that it reads nothing but `positions` and looks each position up on its own."""
        key = (cos, sin)
        if key in self._rotary_tables:
            return self._rotary_tables[key]
        table = _evaluate_from_positions(self.gm, [cos, sin],
                                         torch.arange(self.rotary_positions)[None])
        probe = torch.tensor([[3, 0, 7], [1, 5, 2]]) % self.rotary_positions
        probed = _evaluate_from_positions(self.gm, [cos, sin], probe)
        if table is None or probed is None:
            raise self.fail(node, "rotary angles computed from more than the positions")
        tables = []
        for full, check in zip(table, probed):
            full = full[0]  # [S, R]
            R = full.shape[-1]
            if R != head_dim:
                raise self.fail(node, f"partial rotary (rotating {R} of {head_dim} dims)")
            if not torch.equal(full[:, : R // 2], full[:, R // 2:]):
                raise self.fail(node, "a rotary table whose halves differ (not the rotate-half "
                                "layout RotaryEmbedding computes)")
            if not torch.equal(full[probe], check):
                raise self.fail(node, "rotary angles that are not a per-position lookup")
            tables.append(full[:, : R // 2].contiguous())
        names = []
        for which, t in zip(("cos", "sin"), tables):
            name = self.b.name(f"rotary_{which}_cache")
            self.weights[name] = t
            names.append(name)
        self._rotary_tables[key] = (names[0], names[1])
        return names[0], names[1]


@dataclass(frozen=True)
class _Sym:
    """A symbolic size: its ONNX name (1-D [1] int64)."""

    name: str


@dataclass(frozen=True)
class _CacheRef:
    """A KV-cache buffer of the step graph (read only through the attention that writes it)."""

    which: tuple[str, int]


def _op_name(target: object) -> str:
    name = getattr(target, "__name__", None) or str(target)
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return name


def _evaluate_from_positions(gm: torch.fx.GraphModule, outputs: list[torch.fx.Node],
                             positions: torch.Tensor) -> list[torch.Tensor] | None:
    """The values of `outputs` with `positions` as the graph's positions input, evaluating only
    their ancestors; None if they depend on any other input or on the cache."""
    needed: set[torch.fx.Node] = set()
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n in needed:
            continue
        needed.add(n)
        stack.extend(n.all_input_nodes)
    env: dict[torch.fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        if node.op == "placeholder":
            if node.target != "positions":
                return None
            env[node] = positions
        elif node.op == "get_attr":
            if "_cache_" in node.target:
                return None
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            env[node] = value
        elif node.op == "call_function":
            args = torch.fx.map_arg(node.args, env.__getitem__)
            kwargs = torch.fx.map_arg(node.kwargs, env.__getitem__)
            with torch.no_grad():
                env[node] = node.target(*args, **kwargs)
        else:
            return None
    return [env[n] for n in outputs]


def _prune(model: onnx.ModelProto) -> None:
    """Drop nodes and constants no graph output depends on (the rotary angle computation the
    tables replaced, the cache writes GroupQueryAttention performs)."""
    graph = model.graph
    live = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o and o in live for o in node.output):
            kept.append(node)
            live.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    constants = [c for c in graph.initializer if c.name in live]
    del graph.initializer[:]
    graph.initializer.extend(constants)


# -- ATen and fuser ops ----------------------------------------------------------------------

_HANDLERS: dict[object, Callable[[GraphTranslator, torch.fx.Node], object]] = {}


def _handles(*targets: object) -> Callable:
    def register(fn: Callable) -> Callable:
        for t in targets:
            _HANDLERS[t] = fn
        return fn
    return register


def _out_dtype(t: GraphTranslator, node: torch.fx.Node) -> torch.dtype:
    dtype = t.dtype_of(node)
    if dtype is None:
        raise t.fail(node, f"{_op_name(node.target)} without a known output dtype")
    return dtype


def _elementwise(op_type: str) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> str:
        if node.kwargs.get("alpha", 1) != 1:
            raise t.fail(node, f"{_op_name(node.target)} with alpha")
        dtype = _out_dtype(t, node)
        return t.b.op1(op_type, [t.value(a, dtype) for a in node.args[:2]])
    return handle


for _op, _onnx in ((aten.add, "Add"), (aten.sub, "Sub"), (aten.mul, "Mul"), (aten.div, "Div"),
                   (aten.maximum, "Max"), (aten.minimum, "Min")):
    _HANDLERS[_op] = _elementwise(_onnx)


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
    _HANDLERS[_op] = _comparison(_onnx, _neg)


def _unary(op_type: str) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> str:
        return t.b.op1(op_type, [t.value(node.args[0])])
    return handle


for _op, _onnx in ((aten.neg, "Neg"), (aten.cos, "Cos"), (aten.sin, "Sin"),
                   (aten.sigmoid, "Sigmoid"), (aten.tanh, "Tanh"), (aten.exp, "Exp"),
                   (aten.sqrt, "Sqrt"), (aten.reciprocal, "Reciprocal"), (aten.abs, "Abs"),
                   (aten.clone, "Identity"), (aten.alias, "Identity"),
                   (aten.logical_not, "Not"), (aten.bitwise_not, "Not"), (aten.erf, "Erf")):
    _HANDLERS[_op] = _unary(_onnx)


@_handles(aten.logical_and, aten.bitwise_and)
def _and(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("And", [t.value(node.args[0]), t.value(node.args[1])])


@_handles(aten.logical_or, aten.bitwise_or)
def _or(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Or", [t.value(node.args[0]), t.value(node.args[1])])


@_handles(aten.rsqrt)
def _rsqrt(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Reciprocal", [t.b.op1("Sqrt", [t.value(node.args[0])])])


@_handles(aten.pow)
def _pow(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = _out_dtype(t, node)
    return t.b.op1("Pow", [t.value(node.args[0], dtype), t.value(node.args[1], dtype)])


@_handles(aten.silu)
def _silu(t: GraphTranslator, node: torch.fx.Node) -> str:
    x = t.value(node.args[0])
    return t.b.op1("Mul", [x, t.b.op1("Sigmoid", [x])])


@_handles(aten.gelu)
def _gelu(t: GraphTranslator, node: torch.fx.Node) -> str:
    """GELU by its formula (ONNX's Gelu op arrives in opset 20)."""
    approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    b, dtype = t.b, _out_dtype(t, node)
    x = t.value(node.args[0])
    c = lambda v: b.const(np.array(v, _np_dtype(dtype)))  # noqa: E731
    if approximate == "tanh":
        cube = b.op1("Mul", [b.op1("Mul", [x, x]), x])
        inner = b.op1("Mul", [c(0.7978845608028654),
                              b.op1("Add", [x, b.op1("Mul", [c(0.044715), cube])])])
        return b.op1("Mul", [b.op1("Mul", [c(0.5), x]),
                             b.op1("Add", [c(1.0), b.op1("Tanh", [inner])])])
    erf = b.op1("Erf", [b.op1("Mul", [x, c(0.7071067811865476)])])
    return b.op1("Mul", [b.op1("Mul", [c(0.5), x]), b.op1("Add", [c(1.0), erf])])


@_handles(aten.where)
def _where_op(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = _out_dtype(t, node)
    cond, a, b = node.args[:3]
    return t.b.op1("Where", [t.value(cond), t.value(a, dtype), t.value(b, dtype)])


@_handles(aten._to_copy)
def _to_copy(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Cast", [t.value(node.args[0])], to=onnx_dtype(_out_dtype(t, node)))


@_handles(aten.embedding)
def _embedding(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Gather", [t.value(node.args[0]), t.value(node.args[1])], axis=0)


def _transposed_weight(t: GraphTranslator, arg: object) -> str | None:
    """The weight W when `arg` is permute(W, [1, 0]) of a parameter, else None."""
    if isinstance(arg, torch.fx.Node) and arg.target == aten.permute.default and \
            list(arg.args[1]) == [1, 0] and isinstance(arg.args[0], torch.fx.Node) and \
            arg.args[0].op == "get_attr":
        return t.value(arg.args[0])
    return None


@_handles(aten.mm)
def _mm(t: GraphTranslator, node: torch.fx.Node) -> str:
    weight = _transposed_weight(t, node.args[1])
    if weight is not None:  # x @ W.T: the parameter as stored
        return t.b.op1("Gemm", [t.value(node.args[0]), weight], transB=1)
    return t.b.op1("MatMul", [t.value(node.args[0]), t.value(node.args[1])])


@_handles(aten.addmm)
def _addmm(t: GraphTranslator, node: torch.fx.Node) -> str:
    if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
        raise t.fail(node, "addmm with alpha or beta")
    bias, x, w = node.args[:3]
    weight = _transposed_weight(t, w)
    if weight is not None:
        return t.b.op1("Gemm", [t.value(x), weight, t.value(bias)], transB=1)
    return t.b.op1("Gemm", [t.value(x), t.value(w), t.value(bias)])


@_handles(aten.bmm, aten.matmul)
def _bmm(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("MatMul", [t.value(node.args[0]), t.value(node.args[1])])


@_handles(aten.permute)
def _permute(t: GraphTranslator, node: torch.fx.Node) -> str:
    rank = len(node.args[1])
    return t.b.op1("Transpose", [t.value(node.args[0])],
                   perm=[d % rank for d in node.args[1]])


@_handles(aten.t)
def _t(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Transpose", [t.value(node.args[0])], perm=[1, 0])


@_handles(aten.transpose)
def _transpose(t: GraphTranslator, node: torch.fx.Node) -> str:
    rank = t.meta(node).dim()
    perm = list(range(rank))
    a, b = node.args[1] % rank, node.args[2] % rank
    perm[a], perm[b] = perm[b], perm[a]
    return t.b.op1("Transpose", [t.value(node.args[0])], perm=perm)


@_handles(aten.view, aten._unsafe_view, aten.reshape)
def _view(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.op1("Reshape", [t.value(node.args[0]), t.shape(node.args[1])])


@_handles(aten.unsqueeze)
def _unsqueeze(t: GraphTranslator, node: torch.fx.Node) -> str:
    dim = node.args[1] % t.meta(node).dim()
    return t.b.op1("Unsqueeze", [t.value(node.args[0]), t.b.const([dim], np.int64)])


@_handles(aten.squeeze)
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


@_handles(aten.expand)
def _expand(t: GraphTranslator, node: torch.fx.Node) -> str:
    sizes = [1 if isinstance(s, int) and s == -1 else s for s in node.args[1]]
    return t.b.op1("Expand", [t.value(node.args[0]), t.shape(sizes)])


@_handles(aten.cat)
def _cat(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = _out_dtype(t, node)
    dim = node.args[1] if len(node.args) > 1 else 0
    return t.b.op1("Concat", [t.value(x, dtype) for x in node.args[0]],
                   axis=dim % t.meta(node).dim())


@_handles(aten.slice)
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


@_handles(aten.select)
def _select(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, dim, index = node.args[:3]
    rank = t.meta(x).dim()
    return t.b.op1("Gather", [t.value(x), t.scalar(index)], axis=dim % rank)


@_handles(aten.mean, aten.sum, aten.amax)
def _reduce(t: GraphTranslator, node: torch.fx.Node) -> str:
    op_type = {aten.mean: "ReduceMean", aten.sum: "ReduceSum", aten.amax: "ReduceMax"}[
        node.target.overloadpacket]
    x = node.args[0]
    rank = t.meta(x).dim()
    dims = node.args[1] if len(node.args) > 1 else list(range(rank))
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    if node.kwargs.get("dtype") is not None:
        raise t.fail(node, f"{_op_name(node.target)} with a dtype")
    dims = [d % rank for d in ([dims] if isinstance(dims, int) else dims)]
    return t.b.op1(op_type, [t.value(x), t.b.const(dims, np.int64)], keepdims=int(keepdim))


@_handles(aten._softmax)
def _softmax(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, dim = node.args[:2]
    return t.b.op1("Softmax", [t.value(x)], axis=dim % t.meta(x).dim())


@_handles(aten.arange)
def _arange(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = _out_dtype(t, node)
    args = list(node.args)
    if node.target == aten.arange.default:
        args = [0, args[0]]
    start, end = args[0], args[1]
    step = args[2] if len(args) > 2 else 1
    return t.b.op1("Range", [t.scalar(start, dtype), t.scalar(end, dtype),
                             t.scalar(step, dtype)])


@_handles(aten.full)
def _full(t: GraphTranslator, node: torch.fx.Node) -> str:
    dtype = _out_dtype(t, node)
    value = numpy_helper.from_array(np.array([node.args[1]], _np_dtype(dtype)))
    return t.b.op1("ConstantOfShape", [t.shape(node.args[0])], value=value)


@_handles(aten.scalar_tensor)
def _scalar_tensor(t: GraphTranslator, node: torch.fx.Node) -> str:
    return t.b.const(np.array(node.args[0], _np_dtype(_out_dtype(t, node))))


@_handles(aten.sym_size.int)
def _sym_size(t: GraphTranslator, node: torch.fx.Node) -> _Sym:
    dim = node.args[1] % t.meta(node.args[0]).dim()
    return _Sym(t.b.op1("Shape", [t.value(node.args[0])], start=dim, end=dim + 1))


def _sym_binary(op_type: str) -> Callable:
    def handle(t: GraphTranslator, node: torch.fx.Node) -> _Sym:
        parts = [t.env[a].name if isinstance(a, torch.fx.Node) else t.b.const([a], np.int64)
                 for a in node.args]
        return _Sym(t.b.op1(op_type, parts))
    return handle


for _op, _onnx in ((operator.mul, "Mul"), (operator.add, "Add"), (operator.sub, "Sub"),
                   (operator.floordiv, "Div")):
    _HANDLERS[_op] = _sym_binary(_onnx)


@_handles(operator.getitem)
def _getitem(t: GraphTranslator, node: torch.fx.Node) -> object:
    value = t.env[node.args[0]]
    if not isinstance(value, (tuple, list)):
        raise t.fail(node, "indexing a value that is not a tuple")
    return value[node.args[1]]


@_handles(aten.index_put)
def _index_put(t: GraphTranslator, node: torch.fx.Node) -> object:
    """A KV-cache write: checked to be the step's own write (rows, seq_lens + t), then left to
    the GroupQueryAttention that reads the cache (which writes it into its present output)."""
    cache, indices, values = node.args[:3]
    ref = t.env.get(cache)
    if not isinstance(ref, _CacheRef):
        raise t.fail(node, "aten.index_put into a tensor that is not the KV cache")
    if len(node.args) > 3 and node.args[3]:
        raise t.fail(node, "an accumulating KV-cache write")
    if len(indices) != 2 or not _is_slots(indices[1]):
        raise t.fail(node, "a KV-cache write at slots other than seq_lens + t")
    t.writes[node] = ref.which
    return _CacheRef(ref.which)


def _is_slots(node: object) -> bool:
    """Whether `node` is seq_lens[:, None] + arange(T), the new tokens' cache slots."""
    if not (isinstance(node, torch.fx.Node) and node.target == aten.add.Tensor):
        return False
    a, b = node.args[:2]
    return (isinstance(a, torch.fx.Node) and a.target == aten.unsqueeze.default and
            isinstance(a.args[0], torch.fx.Node) and a.args[0].target == "seq_lens" and
            a.args[1] == 1 and isinstance(b, torch.fx.Node) and
            b.target in (aten.arange.start_step, aten.arange.default) and
            (b.target == aten.arange.default or b.args[0] == 0))


@_handles(aten.copy_)
def _copy(t: GraphTranslator, node: torch.fx.Node) -> None:
    """The graph's final write-back of a cache buffer: the written cache is the present output
    GroupQueryAttention produced."""
    dst, src = node.args[:2]
    if not isinstance(t.env.get(dst), _CacheRef) or src not in t.writes:
        raise t.fail(node, "an in-place copy other than the KV cache's write-back")
    which = t.writes[src]
    if which not in t.presents:
        raise t.fail(node, f"layer {which[1]}'s {which[0]} cache written but never attended")
    return None


@_handles(torch.ops.fuser.rms_norm.default)
def _rms_norm(t: GraphTranslator, node: torch.fx.Node) -> str:
    x, weight, eps = node.args[:3]
    return t.b.op1("SimplifiedLayerNormalization", [t.value(x), t.value(weight)],
                   axis=-1, epsilon=float(eps), stash_type=1)


@_handles(torch.ops.fuser.add_rms_norm.default)
def _add_rms_norm(t: GraphTranslator, node: torch.fx.Node) -> tuple[str, str]:
    x, residual, weight, eps = node.args[:4]
    normed, summed = t.b.name("skip_norm"), t.b.name("skip_sum")
    t.b.op("SkipSimplifiedLayerNormalization", [t.value(x), t.value(residual), t.value(weight)],
           [normed, "", "", summed], domain=MS, epsilon=float(eps))
    return normed, summed


@_handles(torch.ops.fuser.rotary.default)
def _rotary(t: GraphTranslator, node: torch.fx.Node) -> tuple[str, str]:
    a, b_, cos, sin = node.args[:4]
    head_dim = t.meta(a).shape[-1]
    if t.meta(a).dim() != 4 or t.meta(b_).dim() != 4:
        raise t.fail(node, "rotary over tensors that are not [B, heads, T, D]")
    cos_cache, sin_cache = t.rotary_tables(node, cos, sin, int(head_dim))
    return tuple(t.b.op1("RotaryEmbedding", [t.value(x), "positions", cos_cache, sin_cache],
                         domain=MS, interleaved=0) for x in (a, b_))


def _gqa(t: GraphTranslator, node: torch.fx.Node, query: torch.fx.Node,
         k_write: torch.fx.Node, v_write: torch.fx.Node, scale: float, window: int,
         softcap: float) -> str:
    """GroupQueryAttention over the cache that `k_write`, `v_write` fill; -> [B, T, H, D]."""
    if softcap:
        raise t.fail(node, "attention logit soft-capping (not mapped to GroupQueryAttention)")
    (kk, layer), (vk, v_layer) = t.writes[k_write], t.writes[v_write]
    if (kk, vk) != ("key", "value") or layer != v_layer:
        raise t.fail(node, "an attention reading another layer's cache")
    qm = t.meta(query)
    B_, H, T_, D = qm.shape
    new_k, new_v = k_write.args[2], v_write.args[2]  # [B, T, kv_heads, D]
    kv_heads = int(t.meta(new_k).shape[2])
    dtype = qm.dtype
    b = t.b
    flat = b.const([0, 0, -1], np.int64)
    q3 = b.op1("Reshape", [b.op1("Transpose", [t.value(query)], perm=[0, 2, 1, 3]), flat])
    k3 = b.op1("Reshape", [t.value(new_k), flat])
    v3 = b.op1("Reshape", [t.value(new_v), flat])
    seqlens_k, total, bias, query_seqlens = t.attention_inputs(dtype)
    out = b.name(f"attention_{layer}")
    b.op("GroupQueryAttention",
         [q3, k3, v3, f"past_key_{layer}", f"past_value_{layer}", seqlens_k, total, "", "", "",
          bias, "", "", "", "", "", query_seqlens],
         [out, f"present_key_{layer}", f"present_value_{layer}"], domain=MS,
         num_heads=int(H), kv_num_heads=kv_heads, scale=float(scale),
         local_window_size=int(window) if window > 0 else -1)
    t.presents[("key", layer)] = f"present_key_{layer}"
    t.presents[("value", layer)] = f"present_value_{layer}"
    return b.op1("Reshape", [out, b.const([0, 0, int(H), int(D)], np.int64)])


@_handles(torch.ops.fuser.cache_attention.default)
def _cache_attention(t: GraphTranslator, node: torch.fx.Node) -> str:
    query, k_cache, v_cache, seq_lens, starts, scale, window, softcap = node.args[:8]
    if k_cache not in t.writes or v_cache not in t.writes:
        raise t.fail(node, "attention over a cache this step does not write")
    if getattr(seq_lens, "target", None) != "seq_lens" or \
            getattr(starts, "target", None) != "starts":
        raise t.fail(node, "attention over lengths other than the step's seq_lens and starts")
    return _gqa(t, node, query, k_cache, v_cache, scale, window, softcap)


@_handles(torch.ops.fuser.prefill_attention.default)
def _prefill_attention(t: GraphTranslator, node: torch.fx.Node) -> str:
    query, key, value, slots, starts, scale, window, softcap = node.args[:8]
    if not _is_slots(slots) or getattr(starts, "target", None) != "starts":
        raise t.fail(node, "prefill attention at slots other than seq_lens + t")

    def writer(source: object, which: str) -> torch.fx.Node:
        for write, (kind, _layer) in t.writes.items():
            written = write.args[2]
            if kind == which and isinstance(written, torch.fx.Node) and \
                    written.target == aten.permute.default and written.args[0] is source and \
                    list(written.args[1]) == [0, 2, 1, 3]:
                return write
        raise t.fail(node, f"prefill attention whose {which}s are not written to the cache")

    return _gqa(t, node, query, writer(key, "key"), writer(value, "value"), scale, window,
                softcap)


def translate(gm: torch.fx.GraphModule, name: str, num_layers: int,
              rotary_positions: int) -> Translated:
    """The ONNX graph of a rewritten step graph `gm` (module docstring).

    name: "<role>.<kind>" for messages; num_layers: the model's layers (cache inputs);
    rotary_positions: the positions the rotary tables cover (the engine's max_seq_len).
    """
    return GraphTranslator(gm, name, num_layers, rotary_positions).run()
