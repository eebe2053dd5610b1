"""gated_linear: the gated activation folded into the decode GEMV that produces its input.

After merge_gate_up, gated_act and linear / fp8_linear, a decode-shaped gated MLP reads

    h = gated_act(view(linear(x, W_gate_up)), act)             two kernels, a [M, 2I] tensor between

and becomes one kernel that streams the merged weight and writes act(gate) * up directly:

    gated_act(view(linear(x, W), ...), act)            ->  view(gated_linear(x, W, act))
    gated_act(view(fp8_linear(x, codes, scale)), act)  ->  view(fp8_gated_linear(x, codes, scale, act))
    gated_act(view(mm(x, permute(W))), act), M <= MAX_ROWS  ->  view(gated_linear(x, W, act))

W is the merged [2I, K] weight as merge_gate_up (or the model, e.g. Phi-3's gate_up_proj) laid
it out, gate rows first; the kernel reads gate row n and up row I + n in the same program
(fuser/ops/linear.py), so no weight is copied or reordered: the prefill graph's cuBLAS GEMM reads
the same tensor, FP8's per-channel scale vector is the same one, and an engine file stores what
it stored before. The fused op rounds gate and up to the model dtype before the activation, as
the two kernels did: the same numbers (on CPU, where the ops run their references, bit for bit).

The third form is a gate/up GEMM that the linear pass left to cuBLAS (`prefers_cublas`: several
rows against a wide weight, where the plain GEMV measured a tie with cuBLAS). With the activation
in its epilogue the GEMV also saves the gated_act kernel and the [M, 2I] round trip, so every
decode-shaped gate/up GEMM is taken. Prefill (symbolic rows, or more than MAX_ROWS) keeps its
GEMM and fuser::gated_act (gated_act_quant under FP8).

No rewrite where the [M, 2I] GEMM output (or a view of it) has another user, or where a bias is
added between the GEMM and the activation (no supported family has one).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import as_linear, fake_value, graph_fake_mode, strip_views

aten = torch.ops.aten
fuser_ops = torch.ops.fuser

GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _decode_gemm(node: Node) -> tuple[object, tuple] | None:
    """(fused op, its arguments before the activation) for a decode-shaped GEMM over a merged
    gate/up weight, or None."""
    if node.op != "call_function":
        return None
    if node.target is fuser_ops.linear.default:
        return fuser_ops.gated_linear.default, tuple(node.args)
    if node.target is fuser_ops.fp8_linear.default:
        return fuser_ops.fp8_gated_linear.default, tuple(node.args)
    linear = as_linear(node)
    if linear is None or linear.bias is not None:
        return None
    x, w = linear.x.meta["val"], linear.weight.meta["val"]
    M = x.shape[0]
    if (isinstance(M, int) and 0 < M <= MAX_ROWS and x.dtype == w.dtype
            and w.dtype in GEMV_DTYPES):
        return fuser_ops.gated_linear.default, (linear.x, linear.weight)
    return None


def fuse_gated_linears(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every gated_act over a private decode GEMM output; returns the count."""
    graph = gm.graph
    fake_mode = None
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not fuser_ops.gated_act.default:
            continue
        gate_up, activation = node.args
        source, views = strip_views(gate_up)
        found = _decode_gemm(source)
        if found is None:
            continue
        # The [M, 2I] output and its views feed this activation only, and the views regroup
        # leading dims only (the row of 2I stays whole: view(gated_linear(...)) is the result).
        chain = [*views, source]
        if not all(len(n.users) == 1 for n in chain):
            continue
        width = source.meta["val"].shape[-1]
        if any(n.meta["val"].shape[-1] != width for n in views):
            continue
        op, args = found
        fake_mode = fake_mode or graph_fake_mode(gm)
        out_shape = list(node.meta["val"].shape)
        with graph.inserting_before(node):
            fused = graph.call_function(op, (*args, activation))
            fused.meta["val"] = fake_value(fake_mode, op, fused.args)
            if list(fused.meta["val"].shape) != out_shape:  # [M, I] -> gated_act's [B, T, I]
                fused = graph.call_function(aten.view.default, (fused, out_shape))
                fused.meta["val"] = fake_value(fake_mode, aten.view.default, fused.args)
        node.replace_all_uses_with(fused)
        graph.erase_node(node)
        count += 1
    return count


GATED_LINEAR = GraphPass("gated_linear", fuse_gated_linears)
