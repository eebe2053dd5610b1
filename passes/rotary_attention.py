"""Rotary + cache write + attention: `fuser::rotary_cache_write` and the
`fuser::cache_attention_read` over its rope(q) become one `fuser::rotary_cache_attention`
(one kernel per layer instead of two: fuser/ops/rotary_attention.py).

What a decode, verify or catch-up graph holds per layer once the rotary_cache and attention
passes have run:

    q_rot = fuser.rotary_cache_write(q, k, v, cos, sin, k_cache, v_cache, seq_lens)
    out   = fuser.cache_attention_read(q_rot, k_cache, v_cache, seq_lens, starts,
                                       scale, window, softcap)

which becomes

    out = fuser.rotary_cache_attention(q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts,
                                       scale, window, softcap)

placed where the attention was (the write moves down to it; nothing between them reads the
caches, see the conditions).

Conditions (anything else is left alone):
- attention reads the write's rope(q) as its q, and that is rope(q)'s only user;
- attention reads the same k_cache, v_cache and seq_lens nodes that the write wrote with;
- each cache's only users are the write and this attention (no other read or write of it
  could see the write moved);
- the step has a fixed T (decode, verify, catch-up; prefill has neither op);
- the op accepts the shapes and dtypes (its fake implementation checks them).
"""

from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import fake_value, graph_fake_mode

WRITE = torch.ops.fuser.rotary_cache_write.default
READ = torch.ops.fuser.cache_attention_read.default
FUSED = torch.ops.fuser.rotary_cache_attention.default


def _call(node: object, target: object) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target is target


def fused_args(write: Node) -> tuple | None:
    """The fused op's arguments when `write` and the one attention reading its rope(q) can
    become one op (module docstring, "Conditions"), else None."""
    users = list(write.users)
    if len(users) != 1 or not _call(users[0], READ) or write.kwargs or users[0].kwargs:
        return None
    read = users[0]
    q_rot, k_cache, v_cache, seq_lens, starts, scale, window, softcap, *read_table = read.args
    q, k, v, cos, sin, write_k, write_v, write_lens, *write_table = write.args
    if q_rot is not write or (k_cache, v_cache, seq_lens) != (write_k, write_v, write_lens):
        return None
    if read_table != write_table:  # both contiguous, or both through one block table
        return None
    if any(set(cache.users) != {write, read} for cache in (k_cache, v_cache)):
        return None
    return (q, k, v, cos, sin, k_cache, v_cache, seq_lens, starts, scale, window, softcap,
            *read_table)


def fuse_rotary_attention(gm: GraphModule, context: PassContext) -> int:
    """Rewrite every write + attention pair of `gm` (module docstring); returns how many."""
    graph: Graph = gm.graph
    fake_mode = graph_fake_mode(gm)
    count = 0
    for write in [n for n in graph.nodes if _call(n, WRITE)]:
        args = fused_args(write)
        if args is None:
            continue
        try:  # the op's fake implementation checks shapes and dtypes (e.g. whole GQA groups)
            val = fake_value(fake_mode, FUSED, args)
        except (ValueError, RuntimeError):
            continue
        read = next(iter(write.users))
        with graph.inserting_before(read):
            fused = graph.call_function(FUSED, args)
        fused.meta["val"] = val
        read.replace_all_uses_with(fused)
        graph.erase_node(read)
        graph.erase_node(write)
        count += 1
    return count


def _fixed_t(context: PassContext) -> bool:
    """Decode, verify and catch-up steps: the ones with both ops."""
    return context.kind.fixed


# After rotary_cache (which makes the write) and attention (which makes the read).
ROTARY_ATTENTION = GraphPass("rotary_attention", fuse_rotary_attention, when=_fixed_t)
