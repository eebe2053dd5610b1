"""What a pass is: a named rewrite of a step graph that sees the build's context, and the two
ways to write one (a traced search/replacement pattern, or a function on the FX graph).

Shared FX helpers live in passes/fx.py; a pass imports from there, from here and from fuser.ops.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fuser.runtime.steps import StepKind

if TYPE_CHECKING:
    # Inductor's pattern matcher (seconds of imports) is imported where a pass is built, so
    # that loading an engine (which reads the pass list) does not import it.
    from torch._inductor.pattern_matcher import Match, PatternMatcherPass
    from fuser.config import FuserConfig


@dataclass(frozen=True)
class PassContext:
    """What a pass may know about the graph it rewrites.

    Attributes:
        graph_name: "<role>.<kind>", e.g. "target.decode" (dumps, error messages).
        kind: the step kind (fixed T or prefill).
        config: the engine's FuserConfig (precision, fused_attention, ...).
        role: "target" or "draft".
    """

    graph_name: str
    kind: StepKind
    config: FuserConfig
    role: str = "target"
    # State the passes share across the graphs of one model (e.g. its weights quantized once);
    # one dict per model build, never shared between models.
    model_state: dict = field(default_factory=dict, compare=False, hash=False)


class GraphRewrite(Protocol):
    """What `PASSES` holds: a named rewrite that says when it applies and counts its matches."""

    name: str

    def applies(self, context: PassContext) -> bool: ...

    def apply(self, gm: torch.fx.GraphModule, context: PassContext) -> int: ...


def always(context: PassContext) -> bool:
    """The default `when` of a pass: it applies to every graph."""
    return True


def uncompiled(context: PassContext) -> bool:
    """A pass for the dynamic-T steps (prefill, chunk) only: they run as FX graphs, where
    the fixed-T steps are compiled by Inductor, which does such rewrites itself."""
    return not context.kind.fixed


# While set (`deferred_recompile`), a pass leaves its graph's Python code stale: `run_passes`
# regenerates it once after the last pass. Each regeneration walks the whole graph; one per pass
# was a fifth of the passes' time on a 24-layer step graph, and a multi-bucket build runs the
# passes once per step and bucket.
_RECOMPILE_DEFERRED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fuser_recompile_deferred", default=False)


def recompile(gm: torch.fx.GraphModule) -> None:
    """`gm.recompile()` after a pass edited `gm.graph`, unless inside `deferred_recompile`
    (then the caller recompiles once at the end; no pass reads `gm.code` or calls `gm`)."""
    if not _RECOMPILE_DEFERRED.get():
        gm.recompile()


@contextlib.contextmanager
def deferred_recompile() -> Iterator[None]:
    """Passes applied inside skip their per-pass `gm.recompile()`: the graph edits are the
    same, only the regeneration of the module's code waits for the caller's one call."""
    token = _RECOMPILE_DEFERRED.set(True)
    try:
        yield
    finally:
        _RECOMPILE_DEFERRED.reset(token)


_CORE_ATEN: dict[tuple, dict] = {}  # core_aten_table's one entry: registrations -> table


def core_aten_table() -> dict:
    """`torch._decomp.core_aten_decompositions()` as the plain table it materializes into.

    Materializing walks every op namespace for CompositeImplicitAutograd ops (~0.13 s on a
    2-core CPU); a pass run traces a dozen replacements, and a multi-bucket build runs the
    passes once per step and bucket. The table is kept while the set of op namespaces and of
    ops with a CompositeImplicitAutograd kernel stays the same (what the walk reads), and
    made again when either changes.
    """
    from torch._decomp import core_aten_decompositions

    def key() -> tuple:
        return (tuple(torch.ops._dir), frozenset(
            torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")))

    found = _CORE_ATEN.get(key())
    if found is None:
        found = dict(core_aten_decompositions().items())
        _CORE_ATEN.clear()
        _CORE_ATEN[key()] = found  # the walk loads namespaces: the key as it is after it
    return found


def trace_like_export(fn: Callable[..., Any], args: Sequence[Any]) -> torch.fx.GraphModule:
    """Trace a search or replacement function into the ATen form that capture produces.

    Inductor's default (`fwd_only`) decomposes with Inductor's own table, where a dtype cast is
    `prims.convert_element_type`; an exported model decomposed to core ATen keeps `_to_copy`,
    so patterns traced that way would never match a bf16 model.
    """
    gm = make_fx(fn, core_aten_table(), tracing_mode="real")(*args)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm


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


@dataclass
class Replacement:
    """One search/replacement pair, registered once per example-input set (e.g. per dtype)."""

    search: Callable[..., Any]
    replace: Callable[..., Any]
    example_inputs: Callable[[torch.dtype], list[Any]]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    extra_check: Callable[[Match], bool] = lambda match: True
    scalar_workaround: dict[str, float] = field(default_factory=dict)


class PatternPass:
    """A named pass: one or more traced replacements searched in one sweep of the graph.

    While `apply` rewrites one graph, replacements traced for identical arguments are reused
    (the pass's own trace cache): the layers of a model match with the same shapes, and tracing
    each replacement again (once per layer) was a third of `fuser.optimize`'s time on a
    32-layer model.
    """

    def __init__(self, name: str, replacements: Sequence[Replacement],
                 when: Callable[[PassContext], bool] = always) -> None:
        self.name = name
        self._replacements = list(replacements)
        self._when = when
        self._patterns: PatternMatcherPass | None = None
        self._traces: dict[tuple, torch.fx.GraphModule] | None = None  # live during `apply`

    def applies(self, context: PassContext) -> bool:
        return self._when(context)

    def _trace(self, fn: Callable[..., Any], args: Sequence[Any], **_: Any) -> torch.fx.GraphModule:
        # Extra keyword arguments that some torch versions pass (get_decomp_fn, ...) are ignored.
        key = _trace_key(fn, args) if self._traces is not None else None
        if key is not None and key in self._traces:
            cached = self._traces[key]
            return torch.fx.GraphModule(cached, copy.deepcopy(cached.graph))
        gm = trace_like_export(fn, args)
        if key is not None:
            self._traces[key] = gm
        return gm

    def _build(self) -> PatternMatcherPass:
        from torch._inductor.pattern_matcher import PatternMatcherPass, register_replacement

        patterns = PatternMatcherPass(pass_name=self.name)
        for r in self._replacements:
            for dtype in r.dtypes:
                register_replacement(
                    r.search, r.replace, r.example_inputs(dtype), self._trace, patterns,
                    extra_check=r.extra_check, scalar_workaround=r.scalar_workaround,
                )
        return patterns

    def apply(self, gm: torch.fx.GraphModule, context: PassContext) -> int:
        """Rewrite every match in `gm`; returns the number of matches."""
        if self._patterns is None:  # tracing the patterns costs ~0.1 s: do it once, when used
            self._patterns = self._build()
        self._traces = {}
        try:
            count = self._patterns.apply(gm.graph)
        finally:
            self._traces = None
        gm.graph.eliminate_dead_code()
        recompile(gm)
        return int(count)


@dataclass
class GraphPass:
    """A named pass written directly on the FX graph, for rewrites that a traced search function
    cannot state (merging sibling GEMMs over weights concatenated at build time; a product whose
    two factors are halves of one tensor, whatever views lie between).

    `rewrite(gm, context)` edits the graph and returns its matches; `when(context)` says
    whether the pass applies to a graph at all.
    """

    name: str
    rewrite: Callable[[torch.fx.GraphModule, PassContext], int]
    when: Callable[[PassContext], bool] = always

    def applies(self, context: PassContext) -> bool:
        return self.when(context)

    def apply(self, gm: torch.fx.GraphModule, context: PassContext) -> int:
        """Rewrite every match in `gm`; returns the number of matches."""
        count = self.rewrite(gm, context)
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        recompile(gm)
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
