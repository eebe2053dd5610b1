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

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.gated_act import ACTIVATIONS
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import GatedProduct, fake_value, gated_product, graph_fake_mode, strip_views

aten = torch.ops.aten

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def fuse_gated_act(gm: GraphModule, context: PassContext) -> int:
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
