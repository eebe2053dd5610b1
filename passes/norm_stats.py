"""norm_stats: at several rows, a norm between two GEMVs moves into them (fuser/ops/norm_stats.py).

After norm_linear, a layer of a verification (or catch-up) graph reads

    y = linear(a, W_o)                                     o_proj / down_proj: a GEMV
    out, summed = add_rms_norm_linear(view(y), r, g, eps, W, w_scale, act)
                                                           at several rows: a norm kernel, a GEMV

and becomes

    summed, gh, squares = linear_residual(a, W_o, w_scale_o, r, g)
    out = stats_rms_norm_linear(summed, gh, squares, g, eps, W, w_scale, act)

one kernel fewer per norm (two a layer on a Llama). linear may be fp8_linear (w_scale_o its
scale, else None). The rewrite needs:
  - 2..MAX_ROWS fixed rows (one row keeps add_rms_norm_linear: there the norm runs inside the
    GEMV already);
  - y read only by the norm op, as its x or its residual (the sum is the same either way),
    through views that keep the last dim;
  - r and g available before the producer (the fused op runs where the producer ran) and of
    the producer's dtype;
  - a plain consumer weight: an FP8 consumer keeps add_rms_norm_linear, whose norm kernel
    hands it x as e4m3 pieces for the FP8 MMA (measured faster than the FP8 consumers of this
    rewrite: docs/performance-notes.md);
  - in the target's graphs, every target step of the graph's batch bucket within MAX_ROWS
    rows: B (gamma + 1) <= MAX_ROWS for the largest gamma the engine may verify
    (`_bucket_normalises_alike`). Otherwise a verify step of more rows keeps the norm kernel
    and its roundings while the bucket's decode step would not, and speculative greedy could
    differ from target-only greedy. The draft's graphs need no such care (the target decides
    every token).
On CPU the new ops run their references: the same bits as before.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import VIEWS, fake_value, graph_fake_mode

fuser_ops = torch.ops.fuser

# Whether the pass rewrites at all (read when a graph is built). On, together with
# fuser.ops.gemv_tables.ONE_ROW_NORM_AFTER, which gives the one-row add + norm GEMVs the same norm
# arithmetic (g * h rounded once, rstd after the sum): without it the verify step's logits
# differ from the decode step's by more than summation order, and DESIGN.md's "speculative
# greedy == target-only greedy" can fail (simulated on CPU with the kernels' arithmetic: 2 of
# 27 greedy sequences differed with the pass alone, 0 of 27 with both). On an H200 both
# together: the 8B bf16 verify step 1.078x the decode step, 244.4 tok/s. Tests switch both off
# together (tests/conftest.py norm_stats_off).
ENABLED = True

_PRODUCERS = {
    fuser_ops.linear.default: lambda a, w: (a, w, None),
    fuser_ops.fp8_linear.default: lambda a, w, s: (a, w, s),
}


def _static_rows(value: torch.Tensor) -> int | None:
    if not all(isinstance(d, int) for d in value.shape):
        return None
    return value.numel() // max(value.shape[-1], 1)


def _producer(x: Node, consumer: Node) -> tuple[Node, list[Node]] | None:
    """(the GEMV whose output x is, the views between) when that output is read only by
    `consumer`, once; else None."""
    views: list[Node] = []
    node = x
    width = x.meta["val"].shape[-1]
    while node.op == "call_function" and node.target in VIEWS:
        if len(node.users) != 1 or node.meta["val"].shape[-1] != width:
            return None
        views.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target not in _PRODUCERS or len(node.users) != 1:
        return None
    if node.meta["val"].shape[-1] != width or node.kwargs:
        return None
    if list(consumer.args).count(x) != 1:
        return None
    return node, views


def _bucket_normalises_alike(context: PassContext, rows: int) -> bool:
    """Whether a graph of `rows` rows may take the rewrite: any draft graph; a target graph
    whose batch bucket's decode and verify steps all have at most MAX_ROWS rows, so that each
    of them takes it (one-row decode steps compute the same arithmetic through
    gemv_tables.ONE_ROW_NORM_AFTER)."""
    if context.role != "target":
        return True
    batch = rows // max(context.kind.tokens or 1, 1)
    return batch * (context.config.resolved_gamma + 1) <= MAX_ROWS


def _insert_call(graph, fake_mode, op, args: tuple, before: Node) -> tuple[Node, list[Node]]:
    """op(*args) inserted before `before`, its fake value set; and, for an op of several
    outputs, a getitem node per output, each with its value."""
    with graph.inserting_before(before):
        call = graph.call_function(op, args)
        call.meta["val"] = fake_value(fake_mode, op, args)
        outputs = []
        if isinstance(call.meta["val"], (tuple, list)):
            for i, value in enumerate(call.meta["val"]):
                outputs.append(graph.call_function(operator.getitem, (call, i)))
                outputs[-1].meta["val"] = value
    return call, outputs


def move_norms_into_gemvs(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every several-row add_rms_norm_linear whose x or residual a GEMV produced (and
    nothing else reads); returns the count."""
    graph = gm.graph
    fake_mode = None
    count = 0
    for node in list(graph.nodes) if ENABLED else []:
        if node.op != "call_function" or node.target is not fuser_ops.add_rms_norm_linear.default:
            continue
        x, r, g, eps, weight, scale, activation = node.args
        rows = _static_rows(x.meta["val"])
        if rows is None or not 1 < rows <= MAX_ROWS or \
                not _bucket_normalises_alike(context, rows):
            continue
        if scale is not None:  # FP8 consumers keep the norm kernel's pieces (docstring)
            continue
        items = {u.args[1]: u for u in node.users if u.target is operator.getitem}
        if len(items) != len(node.users):
            continue
        # x + r: either may be the GEMV's output (HF's Llama adds residual + hidden_states)
        found = _producer(x, node) if isinstance(x, Node) else None
        if found is None and isinstance(r, Node):
            found, (x, r) = _producer(r, node), (r, x)
        if found is None:
            continue
        producer, views = found
        a, w_p, s_p = _PRODUCERS[producer.target](*producer.args)
        dtype = a.meta["val"].dtype
        if not isinstance(r, Node) or not isinstance(g, Node) or \
                r.meta["val"].dtype != dtype or g.meta["val"].dtype != dtype or \
                x.meta["val"].dtype != dtype or \
                tuple(r.meta["val"].shape) != tuple(x.meta["val"].shape):
            continue
        # The fused op runs where the producer ran: r and g must exist by then. (Recomputed per
        # match: r may be the summed of an earlier rewrite, a node inserted since.)
        order = {n: i for i, n in enumerate(graph.nodes)}
        if order[r] > order[producer] or order[g] > order[producer]:
            continue
        fake_mode = fake_mode or graph_fake_mode(gm)
        _, outputs = _insert_call(graph, fake_mode, fuser_ops.linear_residual.default,
                                  (a, w_p, s_p, r, g), producer)
        summed = outputs[0]
        out, _ = _insert_call(graph, fake_mode, fuser_ops.stats_rms_norm_linear.default,
                              (summed, *outputs[1:], g, eps, weight, scale, activation), node)
        if 0 in items:
            items[0].replace_all_uses_with(out)
        if 1 in items:
            items[1].replace_all_uses_with(summed)
        for dead in [*items.values(), node, *views, producer]:
            graph.erase_node(dead)
        count += 1
    return count


NORM_STATS = GraphPass("norm_stats", move_norms_into_gemvs)
