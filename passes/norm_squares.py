"""norm_squares: the GEMV before a norm sums the norm's squares; the GEMV after it reads them.

After norm_linear, each decoder layer of a fixed-T step holds twice

    y        = fuser.linear(x, W1)          # o_proj, down_proj (or fuser.fp8_linear(x, W1, s1))
    out, h   = fuser.add_rms_norm_linear(r, view(y), g, eps, W2, s2, act)   # gate/up, qkv

where every program of the second GEMV first passes over its input row for the sum of squares
(one row), or the norm runs as its own kernel (several rows). This pass makes it

    h, sq    = fuser.linear_add_squares(x, W1, s1, r)      # h = y + r; sq = sum(h^2) per row
    out      = fuser.squares_norm_linear(h, sq, g, eps, W2, s2, act)

and the readers of the old h (the next residual add) read the new one. Values: the same ops'
(fuser/ops/linear.py: the references are bit for bit the ops they replace; the CUDA kernels
differ only in rstd's fp32 summation order).

Applies where the kernels run both GEMVs: FP8 weights (any row count) or several rows; a bf16
one-row step keeps its stream GEMVs (fuser/ops/gemv_stream.py), which have no squares mode.
Conditions (anything else is left alone): y is a fuser.linear / fuser.fp8_linear whose only
reader is the add_rms_norm_linear (through views), as its x or its residual; the other operand
has y's number of elements and dtype.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import fake_value, graph_fake_mode, strip_views

NORM_LINEAR = torch.ops.fuser.add_rms_norm_linear.default
GEMVS = (torch.ops.fuser.linear.default, torch.ops.fuser.fp8_linear.default)
ADD_SQUARES = torch.ops.fuser.linear_add_squares.default
SQUARES_NORM = torch.ops.fuser.squares_norm_linear.default


def _gemv_operand(norm: Node) -> tuple[Node, list[Node], Node] | None:
    """(the GEMV, the views between it and the norm, the other operand), or None."""
    x, residual = norm.args[:2]
    for mine, other in ((residual, x), (x, residual)):
        if not isinstance(mine, Node):
            continue
        gemv, views = strip_views(mine)
        if not (gemv.op == "call_function" and gemv.target in GEMVS and not gemv.kwargs):
            continue
        chain = [gemv, *reversed(views)]  # gemv, then each view down to the norm's operand
        if any(len(n.users) != 1 for n in chain):
            continue
        return gemv, views, other
    return None


def _wanted(gemv: Node) -> bool:
    """FP8 weights, or more than one row: where _linear_kernel runs both GEMVs anyway."""
    y = gemv.meta["val"]
    rows = y.numel() // max(y.shape[-1], 1)
    return gemv.target is torch.ops.fuser.fp8_linear.default or rows > 1


def fuse_norm_squares(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every GEMV -> add_rms_norm_linear pair of `gm` (module docstring); -> how many."""
    graph = gm.graph
    fake_mode = graph_fake_mode(gm)
    count = 0
    for norm in [n for n in graph.nodes if n.op == "call_function" and n.target is NORM_LINEAR]:
        found = _gemv_operand(norm)
        if found is None:
            continue
        gemv, views, residual = found
        if not _wanted(gemv):
            continue
        y, r = gemv.meta["val"], residual.meta["val"]
        if y.numel() != r.numel() or y.dtype != r.dtype or y.shape[-1] != r.shape[-1]:
            continue
        x, w1, s1 = (*gemv.args, None)[:3]
        _, _, g, eps, w2, s2, act = norm.args
        outputs = {user.args[1]: user for user in norm.users if user.target is operator.getitem}
        if len(outputs) != len(norm.users):
            continue
        args = (x, w1, s1, residual)
        try:
            pair = fake_value(fake_mode, ADD_SQUARES, args)
        except (ValueError, RuntimeError):
            continue
        with graph.inserting_before(norm):
            both = graph.call_function(ADD_SQUARES, args)
            both.meta["val"] = pair
            h = graph.call_function(operator.getitem, (both, 0))
            h.meta["val"] = pair[0]
            squares = graph.call_function(operator.getitem, (both, 1))
            squares.meta["val"] = pair[1]
            norm_args = (h, squares, g, eps, w2, s2, act)
            out = graph.call_function(SQUARES_NORM, norm_args)
            out.meta["val"] = fake_value(fake_mode, SQUARES_NORM, norm_args)
        if 0 in outputs:
            outputs[0].replace_all_uses_with(out)
        if 1 in outputs:
            outputs[1].replace_all_uses_with(h)
        for node in (*outputs.values(), norm, *views, gemv):
            graph.erase_node(node)
        count += 1
    return count


def _fixed_t(context: PassContext) -> bool:
    return context.kind.fixed


# After norm_linear (which makes the add_rms_norm_linear) and the GEMV passes.
NORM_SQUARES = GraphPass("norm_squares", fuse_norm_squares, when=_fixed_t)
