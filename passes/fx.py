"""FX graph helpers every pass may use: cleaning, counting, fake values, and the idioms that
exported decoder graphs share (linears over parameters, views, gated products).

Passes import from here and from fuser.ops only, never from each other.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx import GraphModule, Node

from fuser.passes.base import recompile

aten = torch.ops.aten

VIEWS = (aten.view.default, aten._unsafe_view.default)


def prepare_graph(gm: GraphModule) -> None:
    """Remove export's metadata assertions: they count as users of intermediates, and a node
    with a user outside a pattern is (rightly) never rewritten, so nothing would match."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    recompile(gm)


def count_fuser_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """fuser op name -> occurrences in the graph."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", None) == "fuser":
            counts[target._opname] += 1
    return dict(sorted(counts.items()))


def count_targets(gm: torch.fx.GraphModule, target: object) -> int:
    """How many call_function nodes call `target` (an OpOverload)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def graph_fake_mode(gm: torch.fx.GraphModule) -> Any:
    """The fake-tensor mode that export ran the graph under (its nodes' meta["val"] live in it)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta["val"] for n in gm.graph.nodes
                             if isinstance(n.meta.get("val"), torch.Tensor)])


def fake_value(fake_mode: Any, target: Any, args: Sequence[Any], kwargs: dict | None = None) -> Any:
    """Run `target` on fake tensors: graph nodes in args stand for their meta["val"]. Raises
    where the call would fail on real tensors of those shapes and strides (e.g. an invalid view)."""
    from torch.utils._pytree import tree_map_only

    args, kwargs = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (tuple(args), kwargs or {}))
    with fake_mode:
        return target(*args, **kwargs)


@dataclass(frozen=True)
class Linear:
    """One exported linear: node = mm(x, permute(W)) or addmm(b, x, permute(W))."""

    node: Node
    x: Node  # [M, K]
    weight: Node  # get_attr, W: [N, K]
    bias: Node | None  # get_attr, b: [N]

    @property
    def sibling_key(self) -> tuple:
        """Equal for linears that can share one GEMM: same input, dtype, K, bias presence."""
        x = self.x
        if x.op == "call_function" and x.target in VIEWS:  # export views x once per linear
            source = (x.args[0], *(str(a) if isinstance(a, torch.SymInt) else a for a in x.args[1]))
        else:
            source = (x,)
        w = self.weight.meta["val"]
        return (*source, w.dtype, w.device, w.shape[1], self.bias is not None)


def as_linear(node: Node) -> Linear | None:
    """`node` as a linear over parameters held by the graph module, or None."""
    if node.op != "call_function" or node.kwargs:
        return None
    if node.target is aten.mm.default:
        (x, wt), bias = node.args, None
    elif node.target is aten.addmm.default and len(node.args) == 3:
        bias, x, wt = node.args
        if not (isinstance(bias, Node) and bias.op == "get_attr" and bias.meta["val"].dim() == 1):
            return None
    else:
        return None
    if not (isinstance(wt, Node) and wt.op == "call_function" and wt.target is aten.permute.default
            and list(wt.args[1]) == [1, 0]):
        return None
    weight = wt.args[0]
    if not (isinstance(weight, Node) and weight.op == "get_attr" and weight.meta["val"].dim() == 2):
        return None
    if bias is not None and bias.meta["val"].shape[0] != weight.meta["val"].shape[0]:
        return None
    return Linear(node, x, weight, bias)


@dataclass
class GatedProduct:
    """`mul` = act(gate) * up, as found in the graph (before any check on where gate, up come from)."""

    activation: str  # a key of fuser.ops.gated_act.ACTIVATIONS
    mul: Node
    gate: Node  # what the activation reads
    up: Node  # the other factor
    act_nodes: list[Node]  # the activation's own nodes, act output first


def _is_cast(node: object) -> bool:
    return (isinstance(node, Node) and node.op == "call_function"
            and node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"})


def _bare_activation(node: Node) -> tuple[str, Node, list[Node], bool] | None:
    """(activation, its input, its nodes, whether it rounds once) for an uncast activation."""
    if node.op != "call_function":
        return None
    if node.target is aten.mul.Tensor and all(isinstance(a, Node) for a in node.args[:2]):
        x, s = node.args[:2]
        for x, s in ((x, s), (s, x)):  # core ATen's F.silu: x * sigmoid(x), either order
            if s.op == "call_function" and s.target is aten.sigmoid.default and s.args[0] is x:
                return "silu", x, [node, s], False  # rounds twice unless computed in fp32
    if node.target is aten.silu.default:
        return "silu", node.args[0], [node], True  # PyTorch's kernels compute in fp32
    if node.target is aten.gelu.default:
        approximate = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        if approximate == "tanh":
            return "gelu_tanh", node.args[0], [node], True
    return None


def _activation(node: Node) -> tuple[str, Node, list[Node]] | None:
    """(activation, gate, the activation's nodes, output first) when `node` computes
    act(gate) as the op does: in fp32, rounded once to gate's dtype. Else None.

    Core ATen writes F.silu on a bf16/fp16 gate as cast(x * sigmoid(x)) with x = gate upcast
    to fp32; a bare x * sigmoid(x) on a half gate (two roundings) is not the op, and not matched.
    """
    cast_back = node if _is_cast(node) else None
    found = _bare_activation(node.args[0] if cast_back is not None else node)
    if found is None:
        return None
    activation, x, nodes, rounds_once = found
    if cast_back is None:
        if not rounds_once and x.meta["val"].dtype != torch.float32:
            return None
        return activation, x, nodes
    if not (_is_cast(x) and x.meta["val"].dtype == torch.float32
            and x.args[0].meta["val"].dtype == cast_back.meta["val"].dtype):
        return None
    return activation, x.args[0], [cast_back, *nodes, x]


def gated_product(node: Node) -> GatedProduct | None:
    """`node` as act(gate) * up (either operand order), or None."""
    if node.op != "call_function" or node.target is not aten.mul.Tensor:
        return None
    a, b = node.args[:2]
    if not (isinstance(a, Node) and isinstance(b, Node)) or node.kwargs:
        return None
    for act, up in ((a, b), (b, a)):
        found = _activation(act)
        if found is not None and found[1] is not up:
            activation, gate, act_nodes = found
            return GatedProduct(activation, node, gate, up, act_nodes)
    return None


def strip_views(node: Node) -> tuple[Node, list[Node]]:
    """(source, views): follow `node` up through view ops; views lists them from `node` upward."""
    views = []
    while node.op == "call_function" and node.target in VIEWS:
        views.append(node)
        node = node.args[0]
    return node, views
