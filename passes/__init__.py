"""Graph rewrites, in the one order they run (`PASSES`), and the driver that runs them.

Every pass sees the build's `PassContext` (graph name, step kind, FuserConfig) and says when it
applies (`applies(context)`); a pass that does not apply to a graph is reported with 0 matches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fuser.passes.attention import ATTENTION
from fuser.passes.base import (GraphRewrite, PassContext, deferred_recompile, dump_dir,
                               dump_graph)
from fuser.passes.cache_writes import CACHE_WRITES
from fuser.passes.common_subexpressions import COMMON_SUBEXPRESSIONS
from fuser.passes.fp8 import FP8_LINEAR
from fuser.passes.fx import count_fuser_ops, prepare_graph
from fuser.passes.gated_linear import GATED_LINEAR
from fuser.passes.gated_mlp import GATED_ACT
from fuser.passes.linear import LINEAR
from fuser.passes.norm_linear import NORM_LINEAR
from fuser.passes.norm_stats import NORM_STATS
from fuser.passes.outer_product import OUTER_PRODUCT
from fuser.passes.projections import MERGE_GATE_UP, MERGE_QKV
from fuser.passes.rmsnorm import ADD_RMS_NORM, RMS_NORM
from fuser.passes.rope import ROTARY
from fuser.passes.rotary_attention import ROTARY_ATTENTION
from fuser.passes.rotary_cache import ROTARY_CACHE

PASSES: list[GraphRewrite] = [
    OUTER_PRODUCT,  # the rotary angles' K = 1 bmm (older transformers) as a multiply
    ADD_RMS_NORM,  # before rms_norm: a plain RMSNorm is a subset of add + RMSNorm
    RMS_NORM,
    ROTARY,
    ROTARY_CACHE,  # fixed-T steps, after rotary: fuser::rotary and the KV-cache writes after it
    ATTENTION,  # fixed-T steps, with FuserConfig(fused_attention=True)
    ROTARY_ATTENTION,  # after rotary_cache and attention: folds the write into the read after it
    MERGE_GATE_UP,  # the two linears feeding act(gate) * up; merge_qkv takes every other group
    MERGE_QKV,
    GATED_ACT,  # after merge_gate_up: needs gate and up as the two halves of one GEMM output
    FP8_LINEAR,  # with precision="fp8": after the merges (one scale per merged matrix); takes
    # every linear, so the bf16 GEMV pass below finds none left
    LINEAR,  # every GEMM the merges left, at decode shapes, becomes the GEMV kernel
    GATED_LINEAR,  # last: folds gated_act into the decode GEMV (bf16 or FP8) that feeds it;
    # needs the GEMVs above, and gated_act's op over the merged gate/up output
    NORM_LINEAR,  # after every GEMV pass: folds a norm into the one GEMV (any of the four) that
    # reads it, so it must see the final GEMV op, gated_linear's included
    NORM_STATS,  # after norm_linear: at several rows, its norm moves into the GEMVs around it
    # (norm_stats.ENABLED, on by default with gemv_tables.ONE_ROW_NORM_AFTER)
    CACHE_WRITES,  # prefill and chunk steps (run uncompiled): the KV-cache writes in place
    COMMON_SUBEXPRESSIONS,  # prefill and chunk steps: every layer's copy of the cache indices
    # as one; last, after cache_writes (its in-place writes are what keeps the caches' reads)
]


@dataclass
class PassResult:
    """What running the passes on one graph did."""

    matches: dict[str, int] = field(default_factory=dict)
    fused_ops: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_passes(gm: torch.fx.GraphModule, context: PassContext,
               passes: list[GraphRewrite] | None = None) -> PassResult:
    """Apply every pass of `passes` (default `PASSES`) that applies to `context`, in order, to
    `gm` in place.

    A pass that raises is skipped and reported in `errors` (pattern-matcher replacements are
    applied one match at a time, each complete, so the graph stays valid).
    """
    start = time.perf_counter()
    result = PassResult()
    directory = dump_dir(context.config.dump_graphs)
    # The module's code is regenerated once, after the last pass (`deferred_recompile`), or
    # before a dump reads it.
    with deferred_recompile():
        prepare_graph(gm)
        for index, p in enumerate(PASSES if passes is None else passes):
            if not p.applies(context):
                result.matches[p.name] = 0
                continue
            if directory:
                gm.recompile()
                dump_graph(directory, context.graph_name, index, p.name, "before", gm)
            try:
                result.matches[p.name] = p.apply(gm, context)
            except Exception as e:  # a broken pass must not break optimize(): report it
                result.matches[p.name] = 0
                result.errors.append(f"pass {p.name} failed on {context.graph_name}: "
                                     f"{type(e).__name__}: {e}")
            if directory:
                gm.recompile()
                dump_graph(directory, context.graph_name, index, p.name, "after", gm)
    gm.recompile()
    result.fused_ops = count_fuser_ops(gm)
    result.seconds = time.perf_counter() - start
    return result


__all__ = ["PASSES", "PassContext", "PassResult", "run_passes"]
