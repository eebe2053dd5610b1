"""norm_linear: the RMSNorm (and residual add) folded into the decode GEMV that reads it.

After the norm passes and the GEMV passes (linear, fp8_linear, gated_linear), a decode-shaped
layer reads, twice, and the final norm once more before the LM head:

    normed, summed = add_rms_norm(x, r, g, eps)            a norm kernel, a [M, K] round trip
    out = linear(view(normed), W)                          the GEMV (or fp8_linear, gated_linear,
                                                           fp8_gated_linear)

and becomes one kernel that normalises x's tiles as it streams W (fuser/ops/linear.py):

    add_rms_norm(x, r, g, eps) -> linear(view(normed), W, ...)
        ->  out, summed = add_rms_norm_linear(x, r, g, eps, W, w_scale, act);  view(out)
    rms_norm(x, g, eps) -> linear(view(normed), W, ...)
        ->  out = rms_norm_linear(x, g, eps, W, w_scale, act);  view(out)

with w_scale (FP8 weights) and act (the gated MLP) None where the GEMV has none. The summed
output's users read the fused op's summed instead. 2L + 1 norms on an L-layer Llama (the input
and post-attention norms of each layer and the final norm; the first layer's input norm has no
residual), each a kernel and a launch gap fewer.

Only where the normed tensor (through views that regroup leading dims only, the row of K left
whole, and aliases) feeds exactly one op, the GEMV, as its x: the fuser GEMV ops exist only at decode shapes
(fixed M <= MAX_ROWS; the GEMV passes decide), and that is checked again here. Prefill keeps its
norm and GEMM (and FP8's rms_norm_quant). On CPU the fused ops run the two references: the same
bits as before.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import VIEWS, fake_value, graph_fake_mode

aten = torch.ops.aten
fuser_ops = torch.ops.fuser

# What may lie between the norm and the GEMV: views, and the alias that the LM head's full
# `hidden_states[:, slice(-0, None)]` (logits_to_keep = 0) leaves after decomposition.
_VIEWS = (*VIEWS, aten.alias.default)

# GEMV op -> how its arguments after x map to (weight, weight_scale, activation)
_GEMVS = {
    fuser_ops.linear.default: lambda w: (w, None, None),
    fuser_ops.gated_linear.default: lambda w, act: (w, None, act),
    fuser_ops.fp8_linear.default: lambda w, s: (w, s, None),
    fuser_ops.fp8_gated_linear.default: lambda w, s, act: (w, s, act),
}


def _normed_and_summed(node: Node) -> tuple[Node, Node | None] | None:
    """(normed, summed) for a fuser norm node, else None: rms_norm's normed is the node itself
    and summed None; add_rms_norm's are its getitem nodes (summed None when never taken)."""
    if node.op != "call_function":
        return None
    if node.target is fuser_ops.rms_norm.default:
        return node, None
    if node.target is not fuser_ops.add_rms_norm.default:
        return None
    items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
    if len(items) != len(node.users) or 0 not in items:
        return None
    return items[0], items.get(1)


def _only_gemv(normed: Node) -> tuple[Node, list[Node]] | None:
    """(the GEMV, the views between) when normed's one user, through views that keep the last
    dim, is a fuser GEMV reading it as x; else None."""
    width = normed.meta["val"].shape[-1]
    views = []
    node = normed
    while len(node.users) == 1:
        (user,) = node.users
        if user.op == "call_function" and user.target in _VIEWS:
            if user.meta["val"].shape[-1] != width:
                return None
            views.append(user)
            node = user
            continue
        if user.op != "call_function" or user.target not in _GEMVS:
            return None
        if user.args[0] is not node or node in user.args[1:] or user.kwargs:
            return None
        x = node.meta["val"]
        M = x.numel() // max(x.shape[-1], 1) if all(isinstance(d, int) for d in x.shape) else None
        if M is None or not 0 < M <= MAX_ROWS:
            return None
        return user, views
    return None


def fuse_norm_linears(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every norm whose output feeds only a decode GEMV; returns the count."""
    graph = gm.graph
    fake_mode = None
    count = 0
    for node in list(graph.nodes):
        found = _normed_and_summed(node)
        if found is None:
            continue
        normed, summed = found
        consumer = _only_gemv(normed)
        if consumer is None:
            continue
        gemv, views = consumer
        order = {n: i for i, n in enumerate(graph.nodes)}
        # The fused op runs where the GEMV ran; summed's readers must all come after it.
        if summed is not None and any(order[u] < order[gemv] for u in summed.users):
            continue
        weight, scale, activation = _GEMVS[gemv.target](*gemv.args[1:])
        fake_mode = fake_mode or graph_fake_mode(gm)
        if node.target is fuser_ops.rms_norm.default:
            x, g, eps = node.args
            op, args = fuser_ops.rms_norm_linear.default, (x, g, eps, weight, scale, activation)
        else:
            x, r, g, eps = node.args
            op = fuser_ops.add_rms_norm_linear.default
            args = (x, r, g, eps, weight, scale, activation)
        with graph.inserting_before(gemv):
            fused = graph.call_function(op, args)
            fused.meta["val"] = fake_value(fake_mode, op, args)
            if op is fuser_ops.add_rms_norm_linear.default:
                outputs = [graph.call_function(operator.getitem, (fused, i)) for i in (0, 1)]
                for i, item in enumerate(outputs):
                    item.meta["val"] = fused.meta["val"][i]
                out, new_summed = outputs
            else:
                out, new_summed = fused, None
            out_shape = list(gemv.meta["val"].shape)
            if list(out.meta["val"].shape) != out_shape:  # [B, T, N] -> the GEMV's [M, N]
                view = graph.call_function(aten.view.default, (out, out_shape))
                view.meta["val"] = fake_value(fake_mode, aten.view.default, view.args)
                out = view
        gemv.replace_all_uses_with(out)
        if summed is not None:
            summed.replace_all_uses_with(new_summed)
        for dead in [gemv, *reversed(views), normed, *([summed] if summed is not None else [])]:
            graph.erase_node(dead)
        if node is not normed:
            graph.erase_node(node)
        count += 1
    return count


NORM_LINEAR = GraphPass("norm_linear", fuse_norm_linears)
