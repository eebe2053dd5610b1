"""Prefill as CUDA graphs: prompts padded on the right to a captured length, one graph per
padded length, captured the first time a request needs it.

Prefill takes any prompt length, so it is not one of the fixed-T steps captured at optimize
time, and run as an FX graph it launches one kernel per op from Python: for a small model the
host's launches, not the GPU, set its time (the bundled target's prefill graph has ~540 ops,
the draft's ~190; on the H200 a generate call spent ~13 ms before its first decode step, more
than the 128 decode steps after it took). A long prompt on a large model is host-bound too when
its ops are cheap to run but costly to launch: at the 8B shape in FP8 a 2048-token prefill took
99.5 ms uncaptured against ~42 ms of kernels (host ~3 ms per layer, ~50 launches). Replayed,
the same kernels run back to back.

Captured lengths: multiples of PREFILL_BLOCK up to SHORT_PREFILL_TOKENS, then steps of 1/8 of
the length's power of two (576, 640, ..., 1024, 1152, ..., 2048, 2304, ...), so that padding
costs at most ~1/8 more work, up to PREFILL_GRAPH_MAX_TOKENS. Each graph keeps its output, the
logits at one position a row ([B, V]), and its share of the pool, so at most MAX_LONG_GRAPHS
graphs longer than SHORT_PREFILL_TOKENS are kept: capturing another drops the least recently
used one. Longer prompts run uncaptured. A paged engine's CHUNK step (a prompt's rest after
cached blocks, a chunked prefill's part) is captured the same way (`ChunkGraphs`).

A graph is captured in parts (runtime/cuda_graphs.py `in_parts`): its launch is on the request's
time to first token, and the device starts on the first part while the host launches the rest.

Padding is safe because prefill attention is causal and a row's padding slots lie past its end:
they are written, then overwritten by the decode steps (runtime/prompts.py `pad_batch`). All
prefill graphs of an engine share one memory pool (they run one at a time, and each graph's
output stays its own).

Off a request's path (`defer`, set by the scheduler while it serves: runtime/idle_capture.py):
a captured length without its graph yet runs uncaptured and waits in `pending`; the scheduler
captures it when nothing runs or waits (`capture_now`). Otherwise (`generate`) a length is
captured the first time a call needs it.
"""

from __future__ import annotations

import warnings

import torch

from fuser.runtime.cuda_graphs import CudaGraphStep, capture_failed, in_parts
from fuser.runtime.steps import CHUNK, PREFILL, ModelSteps, last_logits

PREFILL_BLOCK = 32  # padded prompt lengths up to SHORT_PREFILL_TOKENS are multiples of this
SHORT_PREFILL_TOKENS = 512  # beyond: steps of 1/8 of the length's power of two
PREFILL_GRAPH_MAX_TOKENS = 4096  # longer prompts run uncaptured
MAX_LONG_GRAPHS = 4  # captured lengths above SHORT_PREFILL_TOKENS kept at once (LRU)
# With `defer`, a length runs uncaptured at most this many times before it is captured on the
# caller's path after all: a server that never idles would otherwise run it uncaptured for
# good (an uncaptured 8B prefill is host-bound: ~3 ms a layer of launches in FP8, above), and
# a prompt's chunks of one width run several times in a row.
DEFER_RUNS = 8


def padded_length(tokens: int, slots: int) -> int | None:
    """The captured length a prompt of `tokens` tokens runs at (see the module's docstring), or
    None when it runs uncaptured (too long, or the padded prompt would not fit the cache)."""
    if tokens < 1:
        raise ValueError(f"a prompt needs at least one token, got {tokens}")
    block = PREFILL_BLOCK
    if tokens > SHORT_PREFILL_TOKENS:
        block = max(PREFILL_BLOCK, (1 << ((tokens - 1).bit_length() - 1)) // 8)
    padded = -(-tokens // block) * block
    return padded if padded <= min(PREFILL_GRAPH_MAX_TOKENS, slots) else None


class PrefillGraphs:
    """The captured prefills of one model at one batch bucket, keyed by padded length.

    A graph returns only the logits at one position a row ([B, V]: the position `run` is
    given, the prompt's last), so a captured length keeps a [B, V] output, not [B, T, V]; the
    [B, T, V] logits inside it are the shared pool's, reused by the next graph (a 256-row
    bucket's 128-token prefill would otherwise keep 8.4 GB of logits at the Llama-3 vocab).
    A length whose capture fails runs uncaptured from then on; the failure is recorded in
    `failures` (report().fallbacks) with a warning, once. capture=False (the CPU): the same
    padded lengths, uncaptured.

    defer: a length not captured yet runs uncaptured and joins `pending` (the most recently
    needed last; of the lengths above SHORT_PREFILL_TOKENS, the MAX_LONG_GRAPHS most recent)
    instead of being captured on the caller's path; `capture_now` captures it later. A length
    that ran uncaptured DEFER_RUNS times is captured on the caller's path at its next run.
    Counters: `captured_on_path` (captures made by `run`), `deferred_runs` (runs uncaptured
    while their length waited for its capture), `captured_idle` (captures by `capture_now`).
    """

    kind = PREFILL

    def __init__(self, model: ModelSteps, pool: object, capture: bool = True) -> None:
        self.model = model
        self.pool = pool
        self.capture = capture
        self.graphs: dict[int, CudaGraphStep] = {}
        self.failed: set[int] = set()
        self.failures: list[str] = []
        self.defer = False
        self.pending: dict[int, None] = {}  # lengths waiting for `capture_now` (ordered)
        self.captured_on_path = 0
        self.deferred_runs = 0
        self.captured_idle = 0
        self._deferred: dict[int, int] = {}  # length -> its runs uncaptured while deferred
        cache = model.cache
        # The position per row whose logits a graph returns (static: set before a replay).
        self.last = torch.zeros(cache.batch_size, dtype=torch.long, device=cache.seq_lens.device)

    def width(self, tokens: int, room: int) -> int:
        """The width `tokens` tokens a row run at: a captured length of at most `room` (and
        this cache's slots) where one fits, else `tokens`."""
        return padded_length(tokens, min(room, self.model.cache.slots)) or tokens

    def run(self, tokens: torch.Tensor, positions: torch.Tensor, last: torch.Tensor
            ) -> torch.Tensor:
        """The step over tokens [B, T] at positions [B, T]: the logits at position last[b] of
        each row ([B] int64), [B, V] (a static buffer when captured: read it before the next
        run at T)."""
        model, cache = self.model, self.model.cache
        # (before a capture too: its warm-up runs read `last`, which must lie in [0, T))
        self.last.copy_(last)
        graph = self._graph(tokens.shape[1])
        if graph is None:
            return last_logits(model.run(self.kind, tokens, positions), last)
        return graph(tokens, positions, cache.seq_lens, cache.starts)

    def _graph(self, T: int) -> CudaGraphStep | None:
        """The graph for T tokens, captured now if T is a captured length never tried (with
        `defer`: queued in `pending` instead); None: run uncaptured."""
        graph = self.graphs.get(T)
        if graph is not None:  # most recently used last (dicts keep insertion order)
            self.graphs[T] = self.graphs.pop(T)
        elif self.capturable(T):
            if self.defer and self._deferred.get(T, 0) < DEFER_RUNS:
                self._wait_for_capture(T)
                self._deferred[T] = self._deferred.get(T, 0) + 1
                self.deferred_runs += 1
                return None
            self.pending.pop(T, None)
            self._make_room(T)
            graph = self._capture(T)
            self.captured_on_path += graph is not None
        return graph

    def _wait_for_capture(self, T: int) -> None:
        """T joins `pending` as its most recently needed length; of the long ones (above
        SHORT_PREFILL_TOKENS) only the MAX_LONG_GRAPHS most recent stay, as many as are kept
        captured (capturing more would drop the others again)."""
        self.pending.pop(T, None)
        self.pending[T] = None
        long = [length for length in self.pending if length > SHORT_PREFILL_TOKENS]
        for length in long[:max(0, len(long) - MAX_LONG_GRAPHS)]:
            del self.pending[length]

    def capturable(self, T: int) -> bool:
        """Whether T tokens is a captured length (of this cache) with no graph and no failed
        capture yet."""
        return self.capture and T not in self.graphs and T not in self.failed \
            and padded_length(T, self.model.cache.slots) == T

    def capture_now(self, T: int) -> bool:
        """Capture the graph for T tokens now, off a request's path (it leaves `pending`);
        True when captured, False when T is not `capturable` or its capture failed (then it
        runs uncaptured, as `run`'s failures do).

        The capture's warm-up runs write the cache's rows at slots [seq_lens, seq_lens + T)
        (a paged cache's: through the device block table): the caller sees that those rows
        hold no request and that their writes land nowhere that matters
        (runtime/scheduler.py `Scheduler._capture_rows`: lengths 0, null table rows)."""
        self.pending.pop(T, None)
        if not self.capturable(T):
            return False
        self._make_room(T)
        self.last.zero_()  # (the warm-up runs read it: a position inside [0, T))
        graph = self._capture(T)
        self.captured_idle += graph is not None
        return graph is not None

    def _make_room(self, T: int) -> None:
        """Before capturing a long length: drop the least recently used long graphs so that
        at most MAX_LONG_GRAPHS stay (their memory returns to the shared pool)."""
        if T <= SHORT_PREFILL_TOKENS:
            return
        long = [length for length in self.graphs if length > SHORT_PREFILL_TOKENS]
        for length in long[:max(0, len(long) - MAX_LONG_GRAPHS + 1)]:
            del self.graphs[length]

    def _capture(self, T: int) -> CudaGraphStep | None:
        model, cache = self.model, self.model.cache
        step = in_parts(model[self.kind].uncaptured)  # (its launch is on the request's path)

        def last_only(tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                      starts: torch.Tensor) -> torch.Tensor:
            return last_logits(step(tokens, positions, seq_lens, starts), self.last)

        # Warm-up and capture write slots [seq_lens, seq_lens + T) of the cache (a chunk's:
        # of the rows' own blocks; cached ones lie below seq_lens): the step that follows
        # writes them again, and later slots are masked by the lengths.
        try:
            graph = CudaGraphStep(last_only, cache.batch_size, T, cache.seq_lens, cache.starts,
                                  pool=self.pool)
        except Exception as e:  # noqa: BLE001 -- a length that cannot be captured runs without
            self.failed.add(T)
            self.failures.append(f"{model.role}.{self.kind.name} at {T} tokens (batch "
                                 f"{cache.batch_size}): {capture_failed(e)}; it runs uncaptured")
            warnings.warn(f"fuser: {self.failures[-1]}", stacklevel=4)
            return None
        self.graphs[T] = graph
        return graph

    def replays(self) -> dict[str, int]:
        """Replays per captured length, keyed "<kind>.b<batch>.<role>.t<T>"."""
        batch, role = self.model.cache.batch_size, self.model.role
        return {f"{self.kind.name}.b{batch}.{role}.t{T}": g.replays
                for T, g in self.graphs.items()}


class ChunkGraphs(PrefillGraphs):
    """The CHUNK step (a paged engine's prompt rest after cached blocks, or a part of a
    chunked prefill: runtime/speculative.py `prefill_chunk`, `prefill_part`; positions = the
    slots) through CUDA graphs at the captured lengths of `padded_length`, as prefill's.

    Uncaptured, the step launches every op from the host (milliseconds a layer at the 8B
    shape), whatever its width: a prefix-cache hit's short rest would cost more than the
    captured prefill of the whole prompt.
    """

    kind = CHUNK
