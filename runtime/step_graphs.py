"""Whole decoding iterations, one CUDA graph each, per batch bucket.

A batch bucket is one fixed batch size (1, 2, 4, 8, 16, ... up to max_batch_size). A call with B
rows runs in the smallest bucket >= B: its steps were built for that batch over rows [:bucket]
of the engine's KV caches, and its `DecodeState` is static, so the iterations of
runtime/speculative.py can be captured:

    ("plain", do_sample):   target decode + choice + state update          -> packed [b, 2]
    (gamma, do_sample):     draft catch-up + gamma - 1 draft decodes + verify over gamma + 1
                            + acceptance + per-row length updates            -> packed [b, gamma + 2]
    resync:                 one chunk of the draft catching up after target-only steps
                            (`speculative.resync_chunk`), replayed as many times as it takes

Each is the same Python function whether it runs uncaptured (CPU; a shape whose capture failed)
or captured once under `torch.cuda.graph` and replayed. Inside a captured iteration the model
steps run their compiled (Inductor) callables, never CUDA graphs of their own (graphs do not
nest). All graphs of an engine share one memory pool. Sampling draws its random numbers from
per-row seeds and counters in the state (runtime/sampling.py `draw_keys`), so a replay needs no
generator state.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Protocol

import torch

from fuser.runtime import speculative
from fuser.runtime.cuda_graphs import capture_failed
from fuser.runtime.prefill_graphs import PrefillGraphs, padded_length
from fuser.runtime.speculative import DecodeState
from fuser.runtime.steps import CATCHUP, DECODE, RESYNC, ModelSteps, StepGraph, verify

PLAIN = 0  # gamma 0: the target-only iteration


def bucket_sizes(max_batch_size: int, every: bool = True) -> tuple[int, ...]:
    """The batch buckets of an engine: powers of two from 1 below max_batch_size, then
    max_batch_size itself (every=False: only max_batch_size)."""
    if not every:
        return (max_batch_size,)
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (max_batch_size,)


def bucket_for(batch: int, sizes: tuple[int, ...]) -> int:
    """The smallest bucket holding `batch` rows."""
    for size in sorted(sizes):
        if size >= batch:
            return size
    raise ValueError(f"batch {batch} is above the largest bucket {max(sizes)}")


class CaptureMirror(Protocol):
    """Other processes that capture and replay their part of an iteration along with this
    one (a tensor-parallel engine's followers, fuser/distributed.py)."""

    def begin(self) -> int: ...  # -> the capture's key; they start capturing
    def end(self, failed: bool) -> None: ...  # they stop (and drop it if failed)
    def replay(self, key: int) -> None: ...  # they replay their capture `key`


class IterationGraph:
    """One iteration function captured as a CUDA graph; calling it replays the graph and
    returns its static packed output (overwritten by the next replay).

    mirror: the processes that capture their own part of `fn` at the same time (told when
    the capture begins and ends) and replay it with every replay of this graph."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: object, warmup: int = 2,
                 reset: Callable[[], None] | None = None,
                 mirror: CaptureMirror | None = None) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):  # lazy initialisation, autotuning: not under capture
                if reset is not None:
                    reset()  # each warm-up step from the same lengths: the cache stays in bounds
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        self.mirror, self.key = mirror, -1
        failed = True
        try:
            with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
                if mirror is not None:
                    self.key = mirror.begin()
                self.output = fn()
            failed = False
        finally:
            if mirror is not None and self.key >= 0:
                mirror.end(failed)
        self.replays = 0

    def __call__(self) -> torch.Tensor:
        if self.mirror is not None:
            self.mirror.replay(self.key)
        self.graph.replay()
        self.replays += 1
        return self.output


class Bucket:
    """One batch bucket: the target's (and draft's) steps at this batch, a static decode state,
    and the captured iterations keyed by (gamma, do_sample), gamma 0 = target-only.

    `run(gamma, do_sample)` replays the iteration's graph if it was captured and otherwise runs
    the same function uncaptured; `resync(behind)` catches the draft up the same way.
    """

    def __init__(self, batch: int, target: ModelSteps, draft: ModelSteps | None,
                 vocab_size: int, overlap: bool = False,
                 state: DecodeState | None = None) -> None:
        """state: rows [:batch] of the engine's one DecodeState (every bucket's are views of
        it, as its caches are of one KV cache, so a request keeps its row across buckets);
        default: a state of its own."""
        self.batch = batch
        # Greedy speculative iterations as `speculative.overlapped_step` (FuserConfig.overlap).
        self.overlap = overlap and draft is not None
        self.target, self.draft = target, draft
        self.vocab_size = vocab_size
        device = target.cache.seq_lens.device
        self.state = state if state is not None else \
            DecodeState.allocate(batch, target.cache.slots, device)
        self.graphs: dict[tuple[int, bool], IterationGraph] = {}
        self.resync_graph: IterationGraph | None = None  # one `resync_chunk`, when captured
        self.uncaptured_runs: dict[tuple[int, bool], int] = {}
        self.prefills: list[PrefillGraphs] = []

    def capture_prefills(self, pool: object) -> None:
        """From now on, prefill at padded lengths through CUDA graphs captured on first use
        (runtime/prefill_graphs.py), all in `pool`."""
        self.prefills = [PrefillGraphs(model, pool) for model in (self.target, self.draft)
                         if model is not None]
        for prefill in self.prefills:
            prefill.model.prefill_graphs = prefill

    def prefill_length(self, tokens: int) -> int:
        """The width a prompt of `tokens` tokens is padded to on the right before prefill: a
        captured length when prefill graphs are on and one applies, else at least 2 (the
        prefill step needs T >= 2)."""
        if self.prefills:
            padded = padded_length(tokens, min(p.model.cache.slots for p in self.prefills))
            if padded is not None:
                return padded
        return max(tokens, 2)

    def prefill_failures(self) -> list[str]:
        """Prefill lengths whose capture failed (they run uncaptured), one message each."""
        return [message for prefill in self.prefills for message in prefill.failures]

    def function(self, gamma: int, do_sample: bool) -> Callable[[], torch.Tensor]:
        """The iteration as a closure over this bucket's static state: () -> packed."""
        if gamma == PLAIN:
            return lambda: speculative.plain_step(self.target, self.state, self.vocab_size,
                                                  do_sample)
        if self.draft is None:
            raise ValueError(f"gamma={gamma} needs a draft; this engine has none")
        if self.overlap and not do_sample:
            return lambda: speculative.overlapped_step(self.target, self.draft, self.state, gamma,
                                                       self.vocab_size)
        return lambda: speculative.speculative_step(self.target, self.draft, self.state, gamma,
                                                    self.vocab_size, do_sample)

    @torch.no_grad()
    def run(self, gamma: int, do_sample: bool) -> torch.Tensor:
        """One iteration: packed [batch, gamma + 2] (gamma 0: [batch, 2])."""
        graph = self.graphs.get((gamma, do_sample))
        if graph is not None:
            return graph()
        key = (gamma, do_sample)
        self.uncaptured_runs[key] = self.uncaptured_runs.get(key, 0) + 1
        return self.function(gamma, do_sample)()

    @torch.no_grad()
    def resync(self, behind: int) -> None:
        """Catch the draft up after `behind` target-only steps (`speculative.resync_draft`),
        its chunks replaying `resync_graph` where it was captured."""
        speculative.resync_draft(self.draft, self.target, self.state, behind,
                                 chunk=self.resync_graph)

    def reset_for_timing(self, length: int) -> None:
        """Dummy state for warm-up, capture and timing: every row active at `length` slots."""
        state = self.state
        for model in (self.target, self.draft):
            if model is not None:
                model.cache.reset()
        self.target.cache.set_lengths(length)
        state.load(max_new_tokens=1 << 30, eos=[], temperature=1.0, top_k=None, top_p=None,
                   vocab_size=self.vocab_size)
        state.active.fill_(True)
        state.generated.fill_(1)
        state.pending.zero_()
        state.last.zero_()
        state.streaming.zero_()

    def capture(self, gammas: list[int], pool: object, timing_length: int) -> list[str]:
        """Capture every (gamma, do_sample) iteration and the draft's resync chunk; -> failures
        (that shape then runs uncaptured). Call after the model steps are warmed up (compiled)."""
        failures = []
        for gamma in gammas:
            for do_sample in (False, True):
                self.reset_for_timing(timing_length)
                try:
                    # Warm-up steps advance the lengths by up to gamma + 1 each: without the
                    # reset, two of them from timing_length could write past a small cache.
                    self.graphs[(gamma, do_sample)] = IterationGraph(
                        self.function(gamma, do_sample), pool,
                        reset=lambda: self.reset_for_timing(timing_length),
                        mirror=getattr(self.target, "capture_mirror", None))
                except Exception as e:  # noqa: BLE001 -- a shape that cannot be captured
                    failures.append(f"bucket {self.batch}, {_name(gamma, do_sample)}: "
                                    f"{capture_failed(e)}; it runs uncaptured")
        if self.draft is not None and RESYNC in self.draft:
            failures += self._capture_resync(pool, timing_length)
        self.reset_for_timing(0)
        return failures

    def _capture_resync(self, pool: object, timing_length: int) -> list[str]:
        """Capture one `resync_chunk` (its warm-up and capture write the draft's first slots,
        which `reset_for_timing` forgets); -> its failure, if any."""
        def chunk() -> None:
            speculative.resync_chunk(self.draft, self.target, self.state)

        self.reset_for_timing(timing_length)
        try:
            self.resync_graph = IterationGraph(chunk, pool,
                                               reset=lambda: self.reset_for_timing(timing_length))
        except Exception as e:  # noqa: BLE001 -- then the chunks run uncaptured
            return [f"bucket {self.batch}, resync: {capture_failed(e)}; it runs uncaptured"]
        return []

    @torch.no_grad()
    def measure(self, gamma: int, length: int, reps: int) -> float:
        """Median seconds of one greedy iteration at `gamma` with every row at `length`
        slots: CUDA events around graph replays on CUDA, wall time elsewhere."""
        cuda = self.target.cache.seq_lens.device.type == "cuda"
        samples = []
        for i in range(reps + 1):
            self.reset_for_timing(length)
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                self.run(gamma, False)
                end.record()
                end.synchronize()
                seconds = begin.elapsed_time(end) * 1e-3
            else:
                start = time.perf_counter()
                self.run(gamma, False)
                seconds = time.perf_counter() - start
            if i > 0:  # the first run warms up
                samples.append(seconds)
        self.reset_for_timing(0)
        # Timing runs are not decoding: they do not count as replays.
        graph = self.graphs.get((gamma, False))
        if graph is not None:
            graph.replays -= reps + 1
        else:
            self.uncaptured_runs[(gamma, False)] -= reps + 1
        samples.sort()
        return samples[len(samples) // 2]

    def replays(self) -> dict[str, int]:
        """Replays so far per captured iteration, keyed as report().graph_replays shows them,
        with each replay also counted for every model step the iteration runs."""
        counts: dict[str, int] = {}
        for (gamma, do_sample), graph in self.graphs.items():
            counts[f"step.b{self.batch}.{_name(gamma, do_sample)}"] = graph.replays
            for step in self.inner_steps(gamma):
                counts[step.name] = counts.get(step.name, 0) + graph.replays
        if self.resync_graph is not None:
            counts[f"step.b{self.batch}.resync"] = self.resync_graph.replays
            name = self.draft[RESYNC].name
            counts[name] = counts.get(name, 0) + self.resync_graph.replays
        for prefill in self.prefills:
            counts.update(prefill.replays())
        return counts

    def inner_steps(self, gamma: int) -> list[StepGraph]:
        """The model steps one iteration at `gamma` runs (runtime/speculative.py)."""
        if gamma == PLAIN:
            return [self.target[DECODE]]
        return ([self.target[verify(gamma)], self.draft[CATCHUP]]
                + ([self.draft[DECODE]] if gamma > 1 else []))


def _name(gamma: int, do_sample: bool) -> str:
    """"plain.greedy", "gamma4.sample", ..."""
    kind = "plain" if gamma == PLAIN else f"gamma{gamma}"
    return f"{kind}.{'sample' if do_sample else 'greedy'}"


def capture_buckets(buckets: list[Bucket], gammas: list[int], timing_length: int,
                    progress: Callable[[str], None] | None = None) -> list[str]:
    """Capture every bucket's iterations in one shared memory pool; -> failure messages (each
    also warned about)."""
    pool = torch.cuda.graph_pool_handle()
    failures: list[str] = []
    total = len(buckets) * len(gammas) * 2
    done = 0
    for bucket in buckets:
        usable = [g for g in gammas if g == PLAIN or bucket.draft is not None]
        start = time.perf_counter()
        failures += bucket.capture(usable, pool, timing_length)
        done += len(gammas) * 2
        if progress is not None:
            progress(f"captured step graphs {done}/{total} (bucket {bucket.batch}: "
                     f"{len(usable) * 2} graphs in {time.perf_counter() - start:.1f} s)")
    for message in failures:
        warnings.warn(f"fuser: {message}", stacklevel=2)
    return failures
