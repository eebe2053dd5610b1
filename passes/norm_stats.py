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
  - a plain consumer weight, or FP8 with `FP8_CONSUMERS` (the FP8 verify's GEMVs take x as e4m3
    pieces from the norm kernel; with it, they run the fp16 MMA on gh, or with
    linear.STATS_FP8_MMA = "x2" the FP8 MMA over pieces of gh split in the GEMV; down_proj,
    the producer before the second norm, keeps its pieces either way; with "block", FP8 on
    both sides, the producer writes g * summed as block-scaled e4m3 pieces and the consumer
    multiplies them: fuser::linear_residual_pieces, fuser::stats_pieces_rms_norm_linear);
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
from fuser.ops.linear import MAX_ROWS
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import VIEWS, fake_value, graph_fake_mode

fuser_ops = torch.ops.fuser

# Whether the pass rewrites at all, and whether FP8 consumers (fp8 weights after the norm) take
# the rewrite (see the docstring). Read when a graph is built.
#
# On by default with fuser.ops.linear.ONE_ROW_NORM_AFTER, which gives the one-row add + norm
# GEMVs the same norm arithmetic (g * h rounded once, rstd after the sum): without it the verify
# step's logits differ from the decode step's by more than summation order, and DESIGN.md's
# "speculative greedy == target-only greedy" can fail (benchmarks/norm_stats_greedy_sim.py, the
# kernels' arithmetic on CPU: 2 of 27 greedy sequences differ with the pass alone, 0 of 27 with
# both). On the H200 both together: 8B bf16 verify step 1.078x the decode step replayed alike,
# 244.4 tok/s, and the CUDA engines' speculative greedy == target-only tests pass
# (benchmarks/RESULTS.md, nineteenth session).
ENABLED = True
FP8_CONSUMERS = False

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
    linear.ONE_ROW_NORM_AFTER)."""
    if context.role != "target":
        return True
    batch = rows // max(context.kind.tokens or 1, 1)
    return batch * (context.config.resolved_gamma + 1) <= MAX_ROWS


def _insert_call(graph, fake_mode, op, args: tuple, before: Node,
                 items: bool = True) -> tuple[Node, list[Node]]:
    """op(*args) inserted before `before`, its fake value set; and, for an op of several
    outputs (unless items is False: the caller moves existing getitems over), a getitem node
    per output, each with its value."""
    with graph.inserting_before(before):
        call = graph.call_function(op, args)
        call.meta["val"] = fake_value(fake_mode, op, args)
        outputs = []
        if items and isinstance(call.meta["val"], (tuple, list)):
            for i, value in enumerate(call.meta["val"]):
                outputs.append(graph.call_function(operator.getitem, (call, i)))
                outputs[-1].meta["val"] = value
    return call, outputs


def _pieces_block(consumer_scale: Node | None, producer_scale: Node | None,
                  dtype: torch.dtype) -> int:
    """The pieces' block when the rewrite takes linear.STATS_FP8_MMA = "block"'s ops (FP8
    weights on both sides, bf16), else 0."""
    from fuser.ops import linear  # noqa: PLC0415  (read when the graph is built)

    if linear.STATS_FP8_MMA != "block" or consumer_scale is None or producer_scale is None or \
            dtype != torch.bfloat16:
        return 0
    return linear.STATS_PIECES_BLOCK


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
        if scale is not None and not FP8_CONSUMERS:
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
        block = _pieces_block(scale, s_p, dtype)
        if block:  # FP8 on both sides: g * summed travels as block-scaled e4m3 pieces
            producer_op, lr_args = fuser_ops.linear_residual_pieces.default, (a, w_p, s_p, r, g,
                                                                              block)
        else:
            producer_op, lr_args = fuser_ops.linear_residual.default, (a, w_p, s_p, r, g)
        _, outputs = _insert_call(graph, fake_mode, producer_op, lr_args, producer)
        summed = outputs[0]
        if block:
            consumer_op = fuser_ops.stats_pieces_rms_norm_linear.default
            norm_args = (summed, *outputs[1:], g, eps, weight, scale, activation, block)
        else:
            consumer_op = fuser_ops.stats_rms_norm_linear.default
            norm_args = (summed, *outputs[1:], g, eps, weight, scale, activation)
        out, _ = _insert_call(graph, fake_mode, consumer_op, norm_args, node)
        if 0 in items:
            items[0].replace_all_uses_with(out)
        if 1 in items:
            items[1].replace_all_uses_with(summed)
        for dead in [*items.values(), node, *views, producer]:
            graph.erase_node(dead)
        count += 1
    return count


def _pieces_reader(value: Node) -> Node | None:
    """The fuser::linear_residual_pieces reading `value` (through views that keep the last dim)
    as its x, when that is value's only reader; else None."""
    node = value
    width = value.meta["val"].shape[-1]
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function":
            return None
        if user.target is fuser_ops.linear_residual_pieces.default:
            return user if user.args[0] is node and list(user.args).count(node) == 1 else None
        if user.target not in VIEWS or user.meta["val"].shape[-1] != width:
            return None
        node = user
    return None


def chain_gated_pieces(gm: GraphModule) -> int:
    """After move_norms_into_gemvs with block pieces: a gated consumer (gate/up) whose output
    only the next producer (down_proj) reads writes that output as block pieces too, and the
    producer multiplies them (no split kernel between them); returns the count."""
    from fuser.ops import linear  # noqa: PLC0415

    graph = gm.graph
    fake_mode = None
    count = 0
    out_block = linear.STATS_GATED_PIECES_BLOCK
    for node in list(graph.nodes):
        if node.op != "call_function" or \
                node.target is not fuser_ops.stats_pieces_rms_norm_linear.default or \
                node.args[9] is None:
            continue
        reader = _pieces_reader(node)
        if reader is None:
            continue
        fake_mode = fake_mode or graph_fake_mode(gm)
        _, (y, *pieces) = _insert_call(graph, fake_mode,
                                       fuser_ops.stats_pieces_gated_pieces.default,
                                       (*node.args, out_block), node)
        node.replace_all_uses_with(y)
        x, w, s, r, g, block = reader.args
        fused, _ = _insert_call(graph, fake_mode, fuser_ops.pieces_linear_residual_pieces.default,
                                (x, *pieces, out_block, w, s, r, g, block), reader, items=False)
        reader.replace_all_uses_with(fused)
        graph.erase_node(reader)
        graph.erase_node(node)
        count += 1
    return count


def _attention_source(x: Node) -> Node | None:
    """The fuser::rotary_cache_attention whose output x is, through views that only flatten
    [B, T, H, D] to rows of H * D values, each read once; else None."""
    node = x
    while node.op == "call_function" and node.target in VIEWS:
        if len(node.users) != 1:
            return None
        node = node.args[0]
    if node.op != "call_function" or node.target is not fuser_ops.rotary_cache_attention.default \
            or len(node.users) != 1 or node is x:
        return None
    out, value = node.meta["val"], x.meta["val"]
    B, T, H, D = out.shape
    if out.dtype != torch.bfloat16 or D < 32 or D & (D - 1) or value.shape[-1] != H * D or \
            value.numel() != out.numel():
        return None
    return node


def chain_attention_pieces(gm: GraphModule) -> int:
    """After move_norms_into_gemvs with block pieces: an o_proj producer
    (fuser::linear_residual_pieces) reading attention's output takes it as block pieces that
    attention's combine kernel writes, one head a scale (fuser::rotary_cache_attention_pieces ->
    fuser::pieces_linear_residual_pieces): o_proj on the FP8 MMA, no split kernel; returns the
    count."""
    graph = gm.graph
    fake_mode = None
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or \
                node.target is not fuser_ops.linear_residual_pieces.default:
            continue
        x, w, s, r, g, block = node.args
        attention = _attention_source(x)
        if attention is None:
            continue
        fake_mode = fake_mode or graph_fake_mode(gm)
        head = attention.meta["val"].shape[-1]
        _, (out, *pieces) = _insert_call(graph, fake_mode,
                                         fuser_ops.rotary_cache_attention_pieces.default,
                                         attention.args, attention)
        attention.replace_all_uses_with(out)
        graph.erase_node(attention)
        reader, _ = _insert_call(graph, fake_mode, fuser_ops.pieces_linear_residual_pieces.default,
                                 (x, *pieces, head, w, s, r, g, block), node, items=False)
        node.replace_all_uses_with(reader)
        graph.erase_node(node)
        count += 1
    return count


def _norm_stats(gm: GraphModule, context: PassContext) -> int:
    count = move_norms_into_gemvs(gm, context)
    if count:
        chain_gated_pieces(gm)
        chain_attention_pieces(gm)
    return count


NORM_STATS = GraphPass("norm_stats", _norm_stats)
