"""What every pass shares: tracing patterns the way capture traces models, cleaning, counting."""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch._decomp import core_aten_decompositions
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, register_replacement
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten


def trace_like_export(fn: Callable[..., Any], args: Sequence[Any], **_: Any) -> torch.fx.GraphModule:
    """Trace a search or replacement function into the ATen form that capture produces.

    Inductor's default (`fwd_only`) decomposes with Inductor's own table, where a dtype cast is
    `prims.convert_element_type`; an exported model decomposed to core ATen keeps `_to_copy`,
    so patterns traced that way would never match a bf16 model. The extra keyword arguments
    that some torch versions pass (get_decomp_fn, ...) are ignored on purpose.
    """
    key = _trace_key(fn, args) if _trace_cache is not None else None
    if key is not None and key in _trace_cache:
        cached = _trace_cache[key]
        return torch.fx.GraphModule(cached, copy.deepcopy(cached.graph))
    gm = make_fx(fn, core_aten_decompositions(), tracing_mode="real")(*args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    if key is not None:
        _trace_cache[key] = gm
    return gm


# While a pass rewrites one graph, replacements traced for identical arguments are reused: the
# layers of a model match with the same shapes, and tracing each replacement again (once per
# layer) was a third of `fuser.optimize`'s time on a 32-layer model.
_trace_cache: dict[tuple, torch.fx.GraphModule] | None = None


def _trace_key(fn: Callable[..., Any], args: Sequence[Any]) -> tuple | None:
    """A hashable summary of a trace's inputs, or None (symbolic shapes, unhashable values)."""
    parts: list[object] = [fn]
    for a in args:
        if isinstance(a, torch.Tensor):
            if any(not isinstance(d, int) for d in (*a.shape, *a.stride())):
                return None
            parts.append((tuple(a.shape), a.stride(), a.dtype, a.device.type))
        elif isinstance(a, (int, float, bool, str, type(None), torch.dtype)):
            parts.append((type(a), a))
        else:
            return None
    return tuple(parts)


@contextmanager
def reuse_replacement_traces() -> Iterator[None]:
    """Within the block, `trace_like_export` reuses graphs traced for identical inputs."""
    global _trace_cache
    previous, _trace_cache = _trace_cache, {}
    try:
        yield
    finally:
        _trace_cache = previous


def prepare_graph(gm: torch.fx.GraphModule) -> None:
    """Remove export's metadata assertions: they count as users of intermediates, and a node
    with a user outside a pattern is (rightly) never rewritten, so nothing would match."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
    gm.recompile()


def count_fuser_ops(gm: torch.fx.GraphModule) -> dict[str, int]:
    """fuser op name -> occurrences in the graph."""
    counts: Counter[str] = Counter()
    for node in gm.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", None) == "fuser":
            counts[target._opname] += 1
    return dict(sorted(counts.items()))


def count_targets(gm: torch.fx.GraphModule, target: object) -> int:
    """How many call_function nodes call `target` (an OpOverload)."""
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


@dataclass
class Replacement:
    """One search/replacement pair, registered once per example-input set (e.g. per dtype)."""

    search: Callable[..., Any]
    replace: Callable[..., Any]
    example_inputs: Callable[[torch.dtype], list[Any]]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    extra_check: Callable[[Match], bool] = lambda match: True
    scalar_workaround: dict[str, float] = field(default_factory=dict)


class GraphRewrite(Protocol):
    """What `PASSES` holds: a named rewrite that edits a graph and counts its matches."""

    name: str

    def apply(self, gm: torch.fx.GraphModule) -> int: ...


class PatternPass:
    """A named pass: one or more replacements searched in one sweep of the graph."""

    def __init__(self, name: str, replacements: Sequence[Replacement]) -> None:
        self.name = name
        self._replacements = list(replacements)
        self._patterns: PatternMatcherPass | None = None

    def _build(self) -> PatternMatcherPass:
        patterns = PatternMatcherPass(pass_name=self.name)
        for r in self._replacements:
            for dtype in r.dtypes:
                register_replacement(
                    r.search, r.replace, r.example_inputs(dtype), trace_like_export, patterns,
                    extra_check=r.extra_check, scalar_workaround=r.scalar_workaround,
                )
        return patterns

    def apply(self, gm: torch.fx.GraphModule) -> int:
        """Rewrite every match in `gm`; returns the number of matches."""
        if self._patterns is None:  # tracing the patterns costs ~0.1 s: do it once, when used
            self._patterns = self._build()
        with reuse_replacement_traces():
            count = self._patterns.apply(gm.graph)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return int(count)


def dump_dir(configured: str | None) -> Path | None:
    """Where to dump graphs: the config field, else FUSER_DUMP_GRAPHS, else nowhere."""
    where = configured or os.environ.get("FUSER_DUMP_GRAPHS")
    return Path(where) if where else None


def dump_graph(directory: Path, graph_name: str, index: int, pass_name: str, stage: str,
               gm: torch.fx.GraphModule) -> None:
    """Write the graph's code to DIR/<graph>.<index>.<pass>.<stage>.py."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{graph_name}.{index:02d}.{pass_name}.{stage}.py"
    path.write_text(gm.code)


# ---------------------------------------------------------------------------------------------
# Passes written directly on the FX graph, for rewrites that a traced search function cannot
# state (merging sibling GEMMs over weights concatenated at compile time; a product whose two
# factors are halves of one tensor, whatever views lie between).
# ---------------------------------------------------------------------------------------------


@dataclass
class GraphPass:
    """A named pass with PatternPass's interface: `rewrite(gm)` edits the graph, returns matches."""

    name: str
    rewrite: Callable[[torch.fx.GraphModule], int]

    def apply(self, gm: torch.fx.GraphModule) -> int:
        """Rewrite every match in `gm`; returns the number of matches."""
        count = self.rewrite(gm)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
        return int(count)


def graph_fake_mode(gm: torch.fx.GraphModule) -> Any:
    """The fake-tensor mode that export ran the graph under (its nodes' meta["val"] live in it)."""
    from torch._guards import detect_fake_mode

    return detect_fake_mode([n.meta["val"] for n in gm.graph.nodes
                             if isinstance(n.meta.get("val"), torch.Tensor)])


def fake_value(fake_mode: Any, target: Any, args: Sequence[Any], kwargs: dict | None = None) -> Any:
    """Run `target` on fake tensors: graph nodes in args stand for their meta["val"]. Raises
    where the call would fail on real tensors of those shapes and strides (e.g. an invalid view)."""
    from torch.utils._pytree import tree_map_only

    args, kwargs = tree_map_only(torch.fx.Node, lambda n: n.meta["val"], (tuple(args), kwargs or {}))
    with fake_mode:
        return target(*args, **kwargs)
