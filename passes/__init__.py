"""Graph rewrites, in the one order they run (`PASSES`), and the driver that runs them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from fuser.passes._matcher import (
    GraphRewrite,
    count_fuser_ops,
    dump_dir,
    dump_graph,
    prepare_graph,
)
from fuser.passes.rmsnorm import ADD_RMS_NORM, RMS_NORM
from fuser.passes.rope import ROTARY
from fuser.passes.gated_mlp import GATED_ACT
from fuser.passes.projections import MERGE_GATE_UP, MERGE_QKV
from fuser.passes.linear import LINEAR

PASSES: list[GraphRewrite] = [
    ADD_RMS_NORM,  # before rms_norm: a plain RMSNorm is a subset of add + RMSNorm
    RMS_NORM,
    ROTARY,
    MERGE_GATE_UP,  # the two linears feeding act(gate) * up; merge_qkv takes every other group
    MERGE_QKV,
    GATED_ACT,  # after merge_gate_up: needs gate and up as the two halves of one GEMM output
    LINEAR,  # last: every GEMM the merges left, at decode shapes, becomes the GEMV kernel
]


@dataclass
class PassResult:
    """What running the passes on one graph did."""

    matches: dict[str, int] = field(default_factory=dict)
    fused_ops: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def run_passes(gm: torch.fx.GraphModule, graph_name: str = "graph",
               dump_to: str | None = None) -> PassResult:
    """Apply every pass of `PASSES` to `gm` in place, in order.

    A pass that raises is skipped and reported in `errors` (the graph is left as that pass
    found it only if the failure happened before any rewrite; pattern-matcher replacements are
    applied one match at a time, each complete).
    """
    start = time.perf_counter()
    result = PassResult()
    directory = dump_dir(dump_to)
    prepare_graph(gm)
    for index, p in enumerate(PASSES):
        if directory:
            dump_graph(directory, graph_name, index, p.name, "before", gm)
        try:
            result.matches[p.name] = p.apply(gm)
        except Exception as e:  # a broken pass must not break optimize(): report it
            result.matches[p.name] = 0
            result.errors.append(f"pass {p.name} failed on {graph_name}: {type(e).__name__}: {e}")
        if directory:
            dump_graph(directory, graph_name, index, p.name, "after", gm)
    result.fused_ops = count_fuser_ops(gm)
    result.seconds = time.perf_counter() - start
    return result


__all__ = ["PASSES", "PassResult", "run_passes"]
