"""attention: a fixed-T step's attention over the KV cache -> fuser::cache_attention_read.

Capture (fuser/capture.py) writes the decode, verify and catch-up steps' attention as one
opaque `fuser::cache_attention(q, k_cache, v_cache, seq_lens, starts, scale, window, softcap)`
per layer: the reference math (fp32 scores over every cache slot, masked by the row lengths).
With `FuserConfig(fused_attention=True)` (the default) this pass retargets each call to
`fuser::cache_attention_read`, the split-K flash-decoding kernel (fuser/ops/attention.py), which
takes the same arguments and computes the same values (its tests hold it to the reference).
Prefill steps attend among their own tokens with ATen ops; there is nothing to rewrite there.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import GraphPass, PassContext


def _fused_attention_wanted(context: PassContext) -> bool:
    return context.kind.fixed and context.config.fused_attention


def fuse_attention(gm: GraphModule, context: PassContext) -> int:
    count = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.fuser.cache_attention.default:
            node.target = torch.ops.fuser.cache_attention_read.default  # same schema, same meta
            count += 1
    return count


ATTENTION = GraphPass("attention", fuse_attention, when=_fused_attention_wanted)
