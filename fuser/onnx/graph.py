"""The translator's machinery: ONNX names, constants and nodes (`Builder`), the walk over an FX
step graph (`GraphTranslator`) and the registry of node translations (`HANDLERS`, filled by
fuser/onnx/aten.py and fuser/onnx/fused.py; fuser/onnx/translate.py is the entry point).

Values: a tensor node becomes an ONNX value name; a symbolic size (`Sym`) a 1-D [1] int64; a
tuple-valued node a tuple of names; the KV-cache buffers `CacheRef`s, which only the attention
translation may read.
"""

from __future__ import annotations

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


def where(node: torch.fx.Node) -> str:
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


def np_dtype(dtype: torch.dtype) -> np.dtype:
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
        self.rotary: dict[tuple[torch.fx.Node, torch.fx.Node], tuple[str, str]] = {}
        self.dtype: torch.dtype | None = None

    # -- helpers ---------------------------------------------------------------------------

    def fail(self, node: torch.fx.Node, why: str) -> OnnxExportError:
        return OnnxExportError(f"{self.name}: {why}{where(node)}; the ONNX export does not "
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
            if isinstance(v, Sym):
                return v.name if dtype in (None, torch.int64) else \
                    self.b.op1("Cast", [v.name], to=onnx_dtype(dtype))
            if isinstance(v, CacheRef):
                raise self.fail(arg, f"the {v.which[0]} cache of layer {v.which[1]} read "
                                "outside an attention")
            if not isinstance(v, str):
                raise self.fail(arg, f"{op_name(arg.target)}'s result used as one tensor")
            name = v
            src = self.dtype_of(arg)
            if dtype is not None and src is not None and src != dtype:
                name = self.b.op1("Cast", [name], to=onnx_dtype(dtype))
            return name
        if isinstance(arg, (bool, int, float)):
            if dtype == torch.bfloat16:
                return self.b.const_bf16(float(arg))
            return self.b.const(arg, np_dtype(dtype or torch.float32))
        raise OnnxExportError(f"{self.name}: argument {arg!r} is not a tensor or a number")

    def shape(self, sizes: Sequence[object]) -> str:
        """A 1-D int64 shape from ints and symbolic sizes (one Concat per distinct list)."""
        if all(isinstance(s, int) for s in sizes):
            return self.b.const(list(sizes), np.int64)
        parts = [self.env[s].name if isinstance(s, torch.fx.Node) else self.b.const([s], np.int64)
                 for s in sizes]
        return self.shared("shape:" + ",".join(parts),
                           lambda: self.b.op1("Concat", parts, axis=0))

    def scalar(self, arg: object, dtype: torch.dtype = torch.int64) -> str:
        """A 0-d tensor of `arg` (an int, a float or a symbolic size)."""
        if isinstance(arg, torch.fx.Node):
            name = self.env[arg].name
            name = self.b.op1("Squeeze", [name, self.b.const([0], np.int64)])
            return name if dtype == torch.int64 else self.b.op1("Cast", [name],
                                                               to=onnx_dtype(dtype))
        return self.b.const(np.array(arg, dtype=np_dtype(dtype)))

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
        _fold_reshapes(model)
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
                self.env[node] = CacheRef(("key" if kv == "k" else "value", layer))
                self.dtype = tensor.dtype
                return
        if not isinstance(tensor, torch.Tensor):
            raise self.fail(node, f"attribute {target!r} is not a tensor")
        name = target
        self.weights[name] = tensor.detach()
        self.env[node] = name

    def call(self, node: torch.fx.Node) -> None:
        target = node.target
        handler = HANDLERS.get(target)
        if handler is None and isinstance(target, torch._ops.OpOverload):
            handler = HANDLERS.get(target.overloadpacket)
        if handler is None:
            raise self.fail(node, f"{op_name(target)} has no ONNX translation")
        self.env[node] = handler(self, node)

    # -- shared attention inputs ---------------------------------------------------------

    def shared(self, key: str, make: Callable[[], str]) -> str:
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def tokens_T(self) -> str:
        """T as a 1-D [1] int64."""
        return self.shared("T", lambda: self.b.op1("Shape", ["tokens"], start=1, end=2))


@dataclass(frozen=True)
class Sym:
    """A symbolic size: its ONNX name (1-D [1] int64)."""

    name: str


@dataclass(frozen=True)
class CacheRef:
    """A KV-cache buffer of the step graph (read only through the attention that writes it)."""

    which: tuple[str, int]


def op_name(target: object) -> str:
    name = getattr(target, "__name__", None) or str(target)
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    return name


def _fold_reshapes(model: onnx.ModelProto) -> None:
    """A Reshape of a Reshape reads the first one's input instead (the result's shape is the
    outer one's either way: shapes here hold no 0 "copy this dim"); the inner one is pruned
    when nothing else reads it."""
    source = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Reshape"}
    for node in model.graph.node:
        if node.op_type == "Reshape":
            while node.input[0] in source:
                node.input[0] = source[node.input[0]]


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



HANDLERS: dict[object, Callable[[GraphTranslator, torch.fx.Node], object]] = {}


def handles(*targets: object) -> Callable:
    def register(fn: Callable) -> Callable:
        for t in targets:
            HANDLERS[t] = fn
        return fn
    return register


def out_dtype(t: GraphTranslator, node: torch.fx.Node) -> torch.dtype:
    dtype = t.dtype_of(node)
    if dtype is None:
        raise t.fail(node, f"{op_name(node.target)} without a known output dtype")
    return dtype


