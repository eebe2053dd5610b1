"""Prefill and chunk graphs captured off a request's path: while the scheduler is idle.

A prefill (or a paged engine's CHUNK step) replays a CUDA graph per (batch bucket, padded
length) (runtime/prefill_graphs.py). Captured the first time a request needs it, each new shape
cost that request its capture (two warm-up runs and the capture: 120-250 ms at the 8B shape),
and a server meeting prompts of many lengths met new shapes long after its start. Instead,
while the scheduler serves, the graphs `defer`: a shape without its graph runs uncaptured (the
same compiled step, its ops launched from the host) and waits in its graphs' `pending`; the
scheduler captures the waiting shapes one at a time when no request runs or waits
(runtime/scheduler.py `Scheduler._capture_idle`), and a request that arrives meanwhile waits
for at most the capture under way.

`IdleCaptures` is that queue over every prefill and chunk graph of an engine: the shapes
requests needed (first), then an optional plan of the likeliest shapes (`plan_likely`:
`Scheduler.precapture`), captured within a time budget once nothing was served for
PLAN_QUIET seconds, and the counters the scheduler shows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from fuser.runtime.prefill_graphs import SHORT_PREFILL_TOKENS, PrefillGraphs, padded_length
from fuser.runtime.steps import PREFILL

# Seconds with nothing served before planned captures start (shapes requests needed start at
# once): a server between two requests of a steady load has shorter gaps than this, so a
# planned capture rarely makes a request wait.
PLAN_QUIET = 1.0

Shape = tuple[PrefillGraphs, int]  # a prefill or chunk graph set and a padded length


class IdleCaptures:
    """The capture queue of one engine's prefill and chunk graphs (see the module docstring).

    graphs: every PrefillGraphs and ChunkGraphs of the engine's buckets (`Bucket.prefills`).
    The counters are kept since this object was made (a scheduler's life):
    `captured_on_path` (captures on a request's path: 0 while `deferring`), `run_uncaptured`
    (runs uncaptured at a shape waiting for its capture), `captured_idle`.
    """

    def __init__(self, graphs: Iterable[PrefillGraphs]) -> None:
        self.graphs = list(graphs)
        self.plan: deque[Shape] = deque()
        self.plan_budget = 0.0  # seconds the plan may still spend capturing
        self.seconds = 0.0  # spent capturing here (pending and planned)
        self._base = self._totals()

    def _totals(self) -> tuple[int, int, int]:
        return (sum(g.captured_on_path for g in self.graphs),
                sum(g.deferred_runs for g in self.graphs),
                sum(g.captured_idle for g in self.graphs))

    @property
    def captured_on_path(self) -> int:
        return self._totals()[0] - self._base[0]

    @property
    def run_uncaptured(self) -> int:
        return self._totals()[1] - self._base[1]

    @property
    def captured_idle(self) -> int:
        return self._totals()[2] - self._base[2]

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Within: every graph set defers its captures (`PrefillGraphs.defer`)."""
        before = [g.defer for g in self.graphs]
        for g in self.graphs:
            g.defer = True
        try:
            yield
        finally:
            for g, defer in zip(self.graphs, before):
                g.defer = defer

    def pending(self) -> bool:
        """Whether a shape that a request needed waits for its capture."""
        return any(g.pending for g in self.graphs)

    def planned(self) -> bool:
        """Whether planned shapes are left within the plan's budget."""
        return bool(self.plan) and self.plan_budget > 0

    def next(self, plan: bool) -> tuple[Shape, bool] | None:
        """The next shape to capture and whether it is a planned one: the first pending one,
        else (with `plan`) the next planned one not captured yet; None when none is left."""
        for g in self.graphs:
            for T in g.pending:
                return (g, T), False
        while plan and self.planned():
            g, T = self.plan.popleft()
            if g.capturable(T):
                return (g, T), True
        return None

    def capture(self, shape: Shape, planned: bool) -> bool:
        """Capture `shape` now (`PrefillGraphs.capture_now`; the caller made its rows safe);
        its seconds count against the plan's budget when `planned`."""
        graphs, T = shape
        start = time.perf_counter()
        try:
            return graphs.capture_now(T)
        finally:
            spent = time.perf_counter() - start
            self.seconds += spent
            if planned:
                self.plan_budget -= spent

    def plan_likely(self, buckets: dict[int, Any], prefill_tokens: int, seconds: float,
                    longest: int = SHORT_PREFILL_TOKENS) -> int:
        """Plan the likeliest shapes for `seconds` of captures (replacing any plan), at the
        captured lengths T up to `longest`: first bucket 1 (a lone request) and the bucket of
        a burst of T-token prompts (the largest of at most `prefill_tokens` // T rows: the
        most a scheduler prefills together), prefills and then chunks; then the buckets
        between them, likewise. Each shape of the target's graphs and of the draft's.
        Returns how many shapes were planned (0 where nothing is captured: CPU engines)."""
        if seconds <= 0:
            self.plan.clear()
            self.plan_budget = 0.0
            return 0
        sizes = sorted(buckets)
        graphs = {size: list(getattr(buckets[size], "prefills", [])) for size in sizes}
        lengths = sorted({padded_length(t, 10**9) for t in range(1, longest + 1)})
        likeliest: list[tuple[int, int]] = []  # (bucket, T)
        between: list[tuple[int, int]] = []
        for T in lengths:
            fits = [b for b in sizes if b <= max(1, prefill_tokens // T)] or sizes[:1]
            likeliest += [(b, T) for b in dict.fromkeys((sizes[0], fits[-1]))]
            between += [(b, T) for b in fits[1:-1]]
        plan: list[Shape] = []
        for tier in (likeliest, between):
            for prefill in (True, False):
                plan += [(g, T) for size, T in tier for g in graphs[size]
                         if (g.kind == PREFILL) == prefill and g.capturable(T)]
        self.plan = deque(plan)
        self.plan_budget = seconds
        return len(plan)
