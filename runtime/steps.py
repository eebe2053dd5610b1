"""The step graphs a model runs, declared once: which kinds exist, and what one built step holds.

    step(tokens[B, T], positions[B, T], seq_lens[B], starts[B]) -> logits[B, T, V]

A step kind is a name and a token count per step (T fixed, or None for prefill and chunk,
which take any T >= 2). The target and the draft each have their own list (`target_steps`,
`draft_steps`); the engine builds, the runtime runs and the benchmarks time exactly these
kinds, by object.

A `StepGraph` keeps the stages of one built step apart: the exported program, the rewritten FX
graph, the compiled callable and the captured CUDA graph. `ModelSteps` is one model's KV cache
and its step graphs: what `fuser.build` produces and what an `Engine` (or `fuser.load`) runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from fuser.runtime.cuda_graphs import CudaGraphStep
from fuser.runtime.kv_cache import KVCache

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class StepKind(NamedTuple):
    """A kind of step: `name` and its fixed token count T (None: prefill, any T >= 2)."""

    name: str
    tokens: int | None

    @property
    def fixed(self) -> bool:
        """Whether T is fixed (a graph Inductor compiles and a CUDA graph can capture)."""
        return self.tokens is not None

    @property
    def starts_empty(self) -> bool:
        """Whether the step starts from an empty cache and attends among its own tokens only
        (prefill); every other step attends over the cache."""
        return self.name == "prefill"


PREFILL = StepKind("prefill", None)
# A paged engine's prompt after a prefix-cache hit (runtime/scheduler.py): any T >= 2 tokens
# written from each row's seq_lens on, attending over the cache (the cached blocks included).
CHUNK = StepKind("chunk", None)
DECODE = StepKind("decode", 1)
# The draft's first forward of a round re-feeds the last accepted token with the new one
# (runtime/speculative.py, `draft`): two tokens.
CATCHUP = StepKind("catchup", 2)
# The draft catching up after target-only steps (runtime/speculative.py, `resync_draft`): the
# tokens it missed, RESYNC_TOKENS per step. 16 is the most rows the decode-shaped kernels take
# at batch 1 (fuser/ops/linear.py MAX_ROWS) and the longest verify step (gamma 15) the cache
# attention already runs.
RESYNC_TOKENS = 16
RESYNC = StepKind("resync", RESYNC_TOKENS)


def verify(gamma: int) -> StepKind:
    """The target's verification step over gamma drafts: the pending token and the drafts."""
    return StepKind("verify", gamma + 1)


def target_steps(gamma: int, paged: bool = False) -> list[StepKind]:
    """The target's steps: prefill, decode, and verify when a draft proposes gamma > 0 tokens;
    paged: chunk too (prefix-cache hits)."""
    return [PREFILL, DECODE] + ([verify(gamma)] if gamma > 0 else []) + \
        ([CHUNK] if paged else [])


def draft_steps(slots: int, paged: bool = False) -> list[StepKind]:
    """The draft's steps: prefill, catch-up, decode (its gamma - 1 later proposals), and
    resync where a row's `slots` cache slots hold its RESYNC_TOKENS tokens (without it the
    draft catches up by a prefill); paged: chunk too (prefix-cache hits)."""
    return [PREFILL, DECODE, CATCHUP] + ([RESYNC] if slots >= RESYNC_TOKENS else []) + \
        ([CHUNK] if paged else [])


@dataclass
class StepGraph:
    """One built step of one model, each stage its own field.

    Attributes:
        name: "<role>.<kind>", e.g. "target.decode" (report() keys).
        kind: the step kind.
        eager: the step module itself (engine cache, "fuser" attention): what runs when
            nothing else could be built.
        exported: the program torch.export produced (before the passes), or None.
        rewritten: the FX graph after the passes, or None when export failed.
        compiled: what Inductor made of `rewritten`, or None (not compiled: "fx" mode,
            prefill, or a failed export).
        captured: the CUDA graph replaying `compiled`, or None.
        matches: pass name -> matches in this graph.
        fused_ops: fuser op name -> count in `rewritten`.
    """

    name: str
    kind: StepKind
    eager: StepFn
    exported: torch.export.ExportedProgram | None = None
    rewritten: torch.fx.GraphModule | None = None
    compiled: StepFn | None = None
    captured: CudaGraphStep | None = None
    matches: dict[str, int] = field(default_factory=dict)
    fused_ops: dict[str, int] = field(default_factory=dict)

    @property
    def uncaptured(self) -> StepFn:
        """The step without its CUDA graph: compiled, else rewritten, else eager."""
        for fn in (self.compiled, self.rewritten):
            if fn is not None:  # (a module has no truth value to test)
                return fn
        return self.eager

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        step = self.captured if self.captured is not None else self.uncaptured
        return step(tokens, positions, seq_lens, starts)


def last_logits(logits: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """[B, V] of [B, W, V] logits: row b's at position last[b] ([B] int64)."""
    B, _, V = logits.shape
    return logits.gather(1, last[:, None, None].expand(B, 1, V))[:, 0]


class ModelSteps:
    """One model's engine-side state: its KV cache and the step graphs built over it.

    `run(kind, tokens, positions)` is the only way the runtime calls a step; the cache's
    lengths are moved by the cache's own methods (runtime/kv_cache.py), never here.
    """

    def __init__(self, role: str, cache: KVCache, vocab_size: int,
                 steps: dict[StepKind, StepGraph] | None = None,
                 fallbacks: list[str] | None = None) -> None:
        self.role = role
        self.cache = cache
        self.vocab_size = vocab_size
        self.steps: dict[StepKind, StepGraph] = dict(steps or {})
        self.fallbacks: list[str] = list(fallbacks or [])
        # What the passes share across this model's graphs while they are built (PassContext).
        self.build_state: dict = {}
        # Captured prefills (runtime/prefill_graphs.py `PrefillGraphs`) and chunks
        # (`ChunkGraphs`), set on CUDA by the engine's batch buckets; None: the step runs
        # uncaptured.
        self.prefill_graphs: object | None = None
        self.chunk_graphs: object | None = None

    def __getitem__(self, kind: StepKind) -> StepGraph:
        return self.steps[kind]

    def __contains__(self, kind: object) -> bool:
        return kind in self.steps

    @torch.no_grad()
    def run(self, kind: StepKind, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step of `kind` over this model's cache: logits [B, T, V].

        tokens, positions: [B, T] with B the cache's batch size. The step writes its T tokens
        at slots seq_lens[b] + t and does not move the lengths: the caller does (by what it
        keeps), through the cache.
        """
        return self.steps[kind](tokens, positions, self.cache.seq_lens, self.cache.starts)

    def width(self, kind: StepKind, tokens: int, room: int) -> int:
        """The width `run_last(kind, ...)` should be given for `tokens` tokens a row: a
        captured length of at most `room` where `kind` is captured, else `tokens`."""
        graphs = self._graphs(kind)
        return tokens if graphs is None else graphs.width(tokens, room)

    @torch.no_grad()
    def run_last(self, kind: StepKind, tokens: torch.Tensor, positions: torch.Tensor,
                 last: torch.Tensor) -> torch.Tensor:
        """A PREFILL or CHUNK step, as `run`, returning only the logits at position last[b]
        ([B] int64) of each row: [B, V]. Through the captured graphs where they are set
        (`prefill_graphs`, `chunk_graphs`)."""
        graphs = self._graphs(kind)
        if graphs is not None:
            return graphs.run(tokens, positions, last)
        return last_logits(self.run(kind, tokens, positions), last)

    def _graphs(self, kind: StepKind) -> object | None:
        return {PREFILL: self.prefill_graphs, CHUNK: self.chunk_graphs}.get(kind)

    def graph_replays(self) -> dict[str, int]:
        """CUDA graph replays so far, per captured step."""
        return {g.name: g.captured.replays for g in self.steps.values() if g.captured is not None}

    def fallback(self, message: str) -> None:
        """Record (and warn about) something of this model that runs less optimized."""
        warnings.warn(f"fuser: {message}", stacklevel=3)
        self.fallbacks.append(message)
