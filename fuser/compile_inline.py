"""`InlineReferences`: the Inductor post-grad pass that inlines the fused ops' references into a
CPU step (fuser/compile_cpu.py says why). Imports Inductor: only a compile needs it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.pattern_matcher import CallFunctionVarArgs, Match, PatternMatcherPass, \
    register_graph_pattern

from fuser.ops import CPU_INLINE

_SOURCES = tuple(str(p) for p in sorted((Path(__file__).parent / "ops").glob("*.py"))) + \
    (__file__,)


class InlineReferences(CustomGraphPass):
    """Inductor post-grad pass: every call of an op in `fuser.ops.CPU_INLINE` becomes the ATen
    graph of its reference, traced at the call's shapes."""

    def __init__(self) -> None:
        self.patterns = PatternMatcherPass()
        for op in CPU_INLINE:
            register_graph_pattern(CallFunctionVarArgs(op), pass_dict=self.patterns)(_inline)

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.patterns.apply(graph)

    def uuid(self) -> bytes:
        """The sources of the ops and of this pass: an edit invalidates cached compiles."""
        return get_hash_for_files(_SOURCES)


def _inline(match: Match, *args: object, **kwargs: object) -> None:
    """Replace the matched op call by its reference, traced over the call's tensor arguments
    (scalars and strings, e.g. eps and the activation's name, are baked in)."""
    fn = CPU_INLINE[match.nodes[0].target]
    nodes = [a for a in args if isinstance(a, torch.fx.Node)]

    def reference(*tensors: torch.Tensor) -> object:
        it = iter(tensors)
        return fn(*(next(it) if isinstance(a, torch.fx.Node) else a for a in args), **kwargs)

    match.replace_by_example(reference, nodes)


INLINE_REFERENCES = InlineReferences()


__all__ = ["INLINE_REFERENCES", "InlineReferences"]
