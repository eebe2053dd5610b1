"""Gated MLP activation: act(gate) * up becomes one `fuser::gated_act` over the merged GEMM output.

    down(act(gate(x)) * up(x))      Llama, Mistral, Qwen2 (SiLU), Gemma, Gemma-2 (GELU-tanh)
    down(up * act(gate))            Phi-3, after gate, up = gate_up_proj(x).chunk(2, dim=-1)

The pass needs gate and up to be the two halves of one tensor X: [..., 2I], gate = X[..., :I],
up = X[..., I:] (a slice pair, or split/chunk), with only views between a half and its factor.
`passes/projections.py` makes that so for separate gate/up linears (merge_gate_up runs before
this pass); Phi-3 ships it so. Then

    act(view(X[..., :I])) * view(X[..., I:])   ->   view(gated_act(X, activation))

The activation, recognised in its exported form, is a key of the op (`ACTIVATIONS`):
    "silu":       core ATen decomposes F.silu(g) into g * sigmoid(g) (fp32), or, for a bf16/fp16
                  g, into (h * sigmoid(h)).to(g.dtype) with h = g.to(float32)
    "gelu_tanh":  aten.gelu(g, approximate="tanh")  (gelu_pytorch_tanh)
Either way act runs in fp32 and is rounded once to g's dtype, as the op computes it; a form that
rounds differently (a bare g * sigmoid(g) on a bf16 g) is not matched.

Written on the FX graph rather than as a traced pattern: the views between the halves and the
product differ per model (2-D GEMM output viewed to [B, T, I], or a [B, T, 2I] view chunked), and
"the two halves of one tensor" is a relation between two slices that a pattern cannot state.
Every intermediate from the halves to the product must have no other user, else no rewrite.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.gated_act import ACTIVATIONS
from fuser.passes._matcher import GraphPass, fake_value, graph_fake_mode

aten = torch.ops.aten

VIEWS = (aten.view.default, aten._unsafe_view.default)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _private(product: GatedProduct, gate_chain: list[Node], up_chain: list[Node]) -> bool:
    """Whether every node from the halves to the product is used by the next one only.

    gate_chain / up_chain: the nodes from the factor up to the half, factor first.
    """
    act_output, *act_inner = product.act_nodes
    inside = set(product.act_nodes)
    if list(act_output.users) != [product.mul]:
        return False
    if not all(set(n.users) <= inside for n in [*act_inner, product.gate]):
        return False
    return all(len(n.users) == 1 for n in gate_chain[1:] + up_chain)


def _half(node: Node) -> tuple[Node, int, int] | None:
    """(X, which, I) when `node` is half `which` (0: first, 1: second) of X's last dim 2I."""
    if node.op != "call_function":
        return None
    if node.target is aten.slice.Tensor:
        # slice.Tensor(self, dim=0, start=None, end=None, step=1)
        x, dim, start, end, step = [*node.args, *[None] * (5 - len(node.args))]
        shape = x.meta["val"].shape
        width = shape[-1]
        dim, start, step = dim or 0, start or 0, step or 1
        end = width if end is None else end
        if node.kwargs or dim % len(shape) != len(shape) - 1 or step != 1:
            return None
        end = min(end, width) if isinstance(end, int) and isinstance(width, int) else end
        if not all(isinstance(v, int) for v in (width, start, end)) or width % 2:
            return None
        I = width // 2
        if (start, end) == (0, I):
            return x, 0, I
        if (start, end) == (I, width):
            return x, 1, I
        return None
    if node.target is operator.getitem and isinstance(node.args[0], Node):
        split, index = node.args
        if split.op != "call_function" or len(split.users) != 2:
            return None
        x = split.args[0]
        shape = x.meta["val"].shape
        dim = split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0)
        if dim % len(shape) != len(shape) - 1 or not isinstance(shape[-1], int):
            return None
        I = shape[-1] // 2
        if split.target is aten.split_with_sizes.default and list(split.args[1]) == [I, I]:
            return x, index, I
        if split.target is aten.split.Tensor and split.args[1] == I and shape[-1] == 2 * I:
            return x, index, I
    return None


def fuse_gated_act(gm: GraphModule) -> int:
    """Rewrite every private act(X[..., :I]) * X[..., I:] into gated_act(X); returns the count."""
    graph = gm.graph
    fake_mode = None
    count = 0
    for node in list(graph.nodes):
        product = gated_product(node)
        if product is None or product.activation not in ACTIVATIONS:
            continue
        gate_src, gate_views = strip_views(product.gate)
        up_src, up_views = strip_views(product.up)
        gate_half, up_half = _half(gate_src), _half(up_src)
        if gate_half is None or up_half is None:
            continue
        (x, g_which, I), (x_up, u_which, I_up) = gate_half, up_half
        if x is not x_up or (g_which, u_which) != (0, 1) or I != I_up:
            continue
        if not _private(product, [*gate_views, gate_src], [*up_views, up_src]):
            continue
        out_val = node.meta["val"]
        x_val = x.meta["val"]
        # Views may regroup leading dims only (the row of I stays whole), no broadcasting, and
        # no dtype promotion: then view(gated_act(X)) is exactly the product.
        if any(v.meta["val"].shape[-1] != I for v in gate_views + up_views):
            continue
        if product.gate.meta["val"].shape != out_val.shape or product.up.meta["val"].shape != out_val.shape:
            continue
        if x_val.dtype not in DTYPES or out_val.dtype != x_val.dtype:
            continue

        fake_mode = fake_mode or graph_fake_mode(gm)
        with graph.inserting_before(node):
            fused = graph.call_function(torch.ops.fuser.gated_act.default, (x, product.activation))
            fused.meta["val"] = fake_value(fake_mode, fused.target, fused.args)
            if gate_views:  # X.shape[:-1] != the product's leading dims: the gate's last view
                fused = graph.call_function(aten.view.default, (fused, gate_views[0].args[1]))
                fused.meta["val"] = fake_value(fake_mode, fused.target, fused.args)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        count += 1
    return count


GATED_ACT = GraphPass("gated_act", fuse_gated_act)
