"""l2_prefetch: attention prefetches the next GEMV's weight into L2 while it runs.

A fixed-T step's attention (`fuser::rotary_cache_attention`) leaves HBM idle for the ~6 us it
takes a layer, and the GEMV after it (o_proj) is a short weight stream that never reaches the
read bandwidth (fuser/ops/l2_prefetch.py has the figures). This pass hands attention that GEMV's
weight as its `prefetch` argument:

    out = fuser.rotary_cache_attention(q, k, v, ..., softcap)
    y   = fuser.linear(view(out), w_o)            # or fuser.fp8_linear(view(out), w_o, scale)

becomes

    out = fuser.rotary_cache_attention(q, k, v, ..., softcap, prefetch=w_o)
    y   = fuser.linear(view(out), w_o)

No value changes (the prefetch is a hint that loads nothing into registers); the graph gains
one edge, from the weight's get_attr to attention, which moves above attention if it was
below (a get_attr reads nothing the step computes).

Conditions (anything else is left alone): attention's output reaches, through views only, a
decode GEMV (`fuser::linear` or `fuser::fp8_linear`) as its x, and that GEMV's weight is a
get_attr or placeholder node; attention has no `prefetch` yet.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import GraphPass, PassContext
from fuser.passes.fx import VIEWS

ATTENTION = torch.ops.fuser.rotary_cache_attention.default
GEMVS = (torch.ops.fuser.linear.default, torch.ops.fuser.fp8_linear.default)


def next_weight(attention: Node) -> Node | None:
    """The weight node of the GEMV that reads `attention`'s output through views, else None."""
    node = attention
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function":
            return None
        if user.target in VIEWS:
            node = user
            continue
        if user.target in GEMVS and user.args[0] is node and isinstance(user.args[1], Node) \
                and user.args[1].op in ("get_attr", "placeholder"):
            return user.args[1]
        return None
    return None


def add_prefetch(gm: GraphModule, context: PassContext) -> int:
    """Give every fixed-T attention of `gm` its next GEMV's weight to prefetch; returns how many."""
    count = 0
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for attention in [n for n in gm.graph.nodes
                      if n.op == "call_function" and n.target is ATTENTION]:
        weight = next_weight(attention)
        if weight is None or "prefetch" in attention.kwargs or len(attention.args) > 12:
            continue
        if order[weight] > order[attention]:
            if weight.op != "get_attr":
                continue
            attention.prepend(weight)  # its users all come after attention's output
        attention.kwargs = {**attention.kwargs, "prefetch": weight}
        count += 1
    return count


def _fixed_t(context: PassContext) -> bool:
    return context.kind.fixed


# Last: after rotary_attention (which makes the attention op) and every GEMV pass (which make
# the GEMV whose weight it reads).
L2_PREFETCH = GraphPass("l2_prefetch", add_prefetch, when=_fixed_t)
