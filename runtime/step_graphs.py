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

Each is the same Python function whether it runs uncaptured (CPU; a shape whose capture failed
or is not captured yet) or captured once (runtime/cuda_graphs.py `capture_graph`) and
replayed. A loaded engine captures
bucket 1 first and the other buckets on a background thread while it serves
(runtime/bucket_capture.py; `Bucket.capture(background=...)`): until a bucket is captured its
rows step in a captured larger bucket (`Engine.bucket`), or in it uncaptured. Inside a captured iteration the model
steps run their compiled (Inductor) callables, never CUDA graphs of their own (graphs do not
nest). All graphs of an engine share one memory pool. Sampling draws its random numbers from
per-row seeds and counters in the state (runtime/sampling.py `draw_keys`), so a replay needs no
generator state.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Protocol

import torch

from fuser.runtime import speculative
from fuser.runtime.bucket_capture import CaptureStopped, RowSnapshot, StepGate
from fuser.runtime.cuda_graphs import capture_failed, capture_graph
from fuser.runtime.prefill_graphs import ChunkGraphs, PrefillGraphs, padded_length
from fuser.runtime.speculative import DecodeState
from fuser.runtime.steps import CATCHUP, CHUNK, DECODE, RESYNC, ModelSteps, StepGraph, verify

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

    warm_up: runs `fn` `warmup` times before the capture, on a side stream (lazy
    initialisation, autotuning: not under capture); default: with `reset()` before each run.
    The background capture passes its own (under the step gate, undone afterwards:
    runtime/bucket_capture.py).
    reset: with the default warm-up (and no mirror), the graph is also replayed once right
    after its capture, between two resets: a graph's first replay uploads it to the device,
    a one-time cost that the first step served (its latency, and the controller's first
    sample of an arm: runtime/controller.py) would otherwise pay.
    mirror: the processes that capture their own part of `fn` at the same time (told when
    the capture begins and ends) and replay it with every replay of this graph (tensor
    parallel: fuser/distributed.py)."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: object, warmup: int = 2,
                 reset: Callable[[], None] | None = None,
                 warm_up: Callable[[Callable[[], torch.Tensor], int], None] | None = None,
                 mirror: CaptureMirror | None = None) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        # Seconds of each part: "warm-up" (its runs: `warm_up_runs`, the foreground's each),
        # "capture", "first replay" (the foreground's upload).
        self.seconds: dict[str, float] = {}
        self.warm_up_runs: list[float] = []
        start = time.perf_counter()
        if warm_up is None:
            _warm_up_with(reset, self.warm_up_runs)(fn, warmup)
        else:
            warm_up(fn, warmup)
        captured = time.perf_counter()
        self.seconds["warm-up"] = captured - start
        self.graph = torch.cuda.CUDAGraph()
        self.mirror, self.key = mirror, -1

        def record() -> torch.Tensor:
            if mirror is not None:
                self.key = mirror.begin()
            return fn()

        failed = True
        try:
            self.output = capture_graph(self.graph, record, pool, device)
            failed = False
        finally:
            if mirror is not None and self.key >= 0:
                mirror.end(failed)
        replayed = time.perf_counter()
        self.seconds["capture"] = replayed - captured
        if reset is not None and warm_up is None and mirror is None:
            reset()
            self.graph.replay()
            reset()
            torch.cuda.current_stream(device).synchronize()
            self.seconds["first replay"] = time.perf_counter() - replayed
        self.replays = 0

    def __call__(self) -> torch.Tensor:
        if self.mirror is not None:
            self.mirror.replay(self.key)
        self.graph.replay()
        self.replays += 1
        return self.output


def _warm_up_with(reset: Callable[[], None] | None, seconds: list[float] | None = None
                  ) -> Callable[[Callable[[], torch.Tensor], int], None]:
    """The foreground warm-up: `fn` run `times` times on a side stream, `reset()` before each
    (each warm-up step from the same lengths: the cache stays in bounds); each run's seconds
    (the side stream synchronized after it) appended to `seconds`."""
    def warm_up(fn: Callable[[], torch.Tensor], times: int) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(times):
                start = time.perf_counter()
                if reset is not None:
                    reset()
                fn()
                if seconds is not None:
                    side.synchronize()
                    seconds.append(time.perf_counter() - start)
        torch.cuda.current_stream(device).wait_stream(side)
    return warm_up


def warm_up_in_place(bucket: Bucket, gate: StepGate, stop: threading.Event | None = None
                     ) -> Callable[[Callable[[], torch.Tensor], int], None]:
    """The background warm-up of `bucket`'s iterations while other rows of it may serve:
    with the serving side held off (`gate`), `fn` runs from the rows' current state, which
    is put back after each run (`RowSnapshot`: a step writes cache slots past each row's
    length, then moves lengths and state; restoring those undoes it). Raises CaptureStopped
    when `stop` is set while it waits."""
    def warm_up(fn: Callable[[], torch.Tensor], times: int) -> None:
        cuda = bucket.target.cache.seq_lens.device.type == "cuda"
        with gate.exclusive(stop) as held:
            if not held:
                raise CaptureStopped
            if cuda:
                device = bucket.target.cache.seq_lens.device
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.default_stream(device))  # the serving thread's work
                context = torch.cuda.stream(side)
            else:
                context = contextlib.nullcontext()
            with context, torch.no_grad():
                snapshot = RowSnapshot.of_bucket(bucket)
                try:
                    for _ in range(times):
                        fn()
                        snapshot.restore()
                finally:
                    snapshot.restore()
            if cuda:
                side.synchronize()  # restored before the serving thread's next step is issued
    return warm_up


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
        # Gammas whose iterations capture later, in the background (a loaded engine's bucket 1
        # serves once its first shapes are captured: fuser/engine.py `prepare`): the adaptive
        # controller runs none of them until they are (`Engine.next_gamma`).
        self.deferred: set[int] = set()
        self.prefills: list[PrefillGraphs] = []
        # The captures' seconds per graph ("plain.greedy", ..., "resync"), whole and
        # by part (IterationGraph.seconds, and the warm-up's runs where timed one by one).
        self.capture_seconds: dict[str, dict[str, float]] = {}

    def capture_prefills(self, pool: object) -> None:
        """From now on, prefill at padded lengths through CUDA graphs captured on first use
        (runtime/prefill_graphs.py), and chunks (a paged engine's CHUNK step) likewise, all in
        `pool`."""
        models = [model for model in (self.target, self.draft) if model is not None]
        self.prefills = [PrefillGraphs(model, pool) for model in models]
        for prefill in self.prefills:
            prefill.model.prefill_graphs = prefill
        for model in models:
            if CHUNK in model:
                model.chunk_graphs = ChunkGraphs(model, pool)
                self.prefills.append(model.chunk_graphs)

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
        """Catch the draft up by `behind` tokens a row (`speculative.resync_draft`: one a
        target-only step), its chunks replaying `resync_graph` where it was captured."""
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

    def free_rows(self) -> None:
        """After the dummy state of warm-up, capture and timing: every row empty and inactive,
        as the scheduler takes free rows to be (an active free row would move its length on
        every step of a larger bucket, past the end of its cache)."""
        self.reset_for_timing(0)
        self.state.active.zero_()

    def capture(self, gammas: list[int], pool: object, timing_length: int,
                background: tuple[StepGate, threading.Event] | None = None) -> list[str]:
        """Capture every (gamma, do_sample) iteration of `gammas` not captured yet and the
        draft's resync chunk; -> failures (that shape then runs uncaptured). Call after the
        model steps are warmed up (compiled). Each gamma done leaves `deferred`.

        background: (gate, stop) while the engine serves (runtime/bucket_capture.py): each
        warm-up runs from the rows' own state and is undone, nothing is reset, and a set `stop`
        ends the capture between two graphs (CaptureStopped)."""
        failures = []
        for gamma in gammas:
            for do_sample in (False, True):
                if background is not None and background[1].is_set():
                    raise CaptureStopped
                if (gamma, do_sample) in self.graphs:
                    continue
                start = time.perf_counter()
                try:
                    graph = self._graph(self.function(gamma, do_sample), pool, timing_length,
                                        background,
                                        mirror=getattr(self.target, "capture_mirror", None))
                    self.graphs[(gamma, do_sample)] = graph
                    self._timed(_name(gamma, do_sample), graph, start)
                except CaptureStopped:
                    raise
                except Exception as e:  # noqa: BLE001 -- a shape that cannot be captured
                    failures.append(f"bucket {self.batch}, {_name(gamma, do_sample)}: "
                                    f"{capture_failed(e)}; it runs uncaptured")
            self.deferred.discard(gamma)
        if self.draft is not None and RESYNC in self.draft and self.resync_graph is None:
            failures += self._capture_resync(pool, timing_length, background)
        if background is None:
            self.free_rows()
        return failures

    def _graph(self, fn: Callable[[], torch.Tensor], pool: object, timing_length: int,
               background: tuple[StepGate, threading.Event] | None,
               mirror: CaptureMirror | None = None) -> IterationGraph:
        """`fn` warmed up and captured, in the foreground (from dummy lengths) or beside the
        serving thread (never with a mirror: followers run one command at a time)."""
        if background is not None:
            if mirror is not None:
                raise ValueError("a mirrored (tensor-parallel) iteration is captured in the "
                                 "foreground only")
            return IterationGraph(fn, pool, warm_up=warm_up_in_place(self, *background))
        self.reset_for_timing(timing_length)
        # Warm-up steps advance the lengths by up to gamma + 1 each: without the reset, two of
        # them from timing_length could write past a small cache.
        return IterationGraph(fn, pool, reset=lambda: self.reset_for_timing(timing_length),
                              mirror=mirror)

    def _capture_resync(self, pool: object, timing_length: int,
                        background: tuple[StepGate, threading.Event] | None = None) -> list[str]:
        """Capture one `resync_chunk` (its warm-up and capture write the draft's first slots,
        which `reset_for_timing` forgets); -> its failure, if any."""
        def chunk() -> None:
            speculative.resync_chunk(self.draft, self.target, self.state)

        start = time.perf_counter()
        try:
            self.resync_graph = self._graph(chunk, pool, timing_length, background)
            self._timed("resync", self.resync_graph, start)
        except CaptureStopped:
            raise
        except Exception as e:  # noqa: BLE001 -- then the chunks run uncaptured
            return [f"bucket {self.batch}, resync: {capture_failed(e)}; it runs uncaptured"]
        return []

    def _timed(self, name: str, graph: IterationGraph, start: float) -> None:
        """Keep graph `name`'s capture seconds (since `start`, and by part)."""
        parts = {"total": time.perf_counter() - start, **getattr(graph, "seconds", {})}
        for i, seconds in enumerate(getattr(graph, "warm_up_runs", [])):
            parts[f"warm-up run {i + 1}"] = seconds
        self.capture_seconds[name] = parts

    def capture_line(self) -> str:
        """The captures' seconds per graph, slowest first: "gamma4.greedy 0.81 s
        (warm-up 0.70 = 0.65 + 0.05, capture 0.08, first replay 0.03), ..." ("" if none)."""
        parts = []
        for name, p in sorted(self.capture_seconds.items(), key=lambda item: -item[1]["total"]):
            runs = [p[k] for k in sorted(p) if k.startswith("warm-up run ")]
            split = f" = {' + '.join(f'{r:.2f}' for r in runs)}" if len(runs) > 1 else ""
            inner = [f"warm-up {p.get('warm-up', 0.0):.2f}{split}"]
            inner += [f"{k} {p[k]:.2f}" for k in ("capture", "first replay") if k in p]
            parts.append(f"{name} {p['total']:.2f} s ({', '.join(inner)})")
        return ", ".join(parts)

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
        self.free_rows()
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


def capture_order(sizes: tuple[int, ...]) -> list[int]:
    """The order buckets are captured in: the smallest (one row: what the engine serves first),
    the largest (from then on every batch fits a captured bucket: a larger bucket costs barely
    more than the right one, decode reading every weight once whatever the batch), then the
    rest from the smallest up."""
    ordered = sorted(sizes)
    return ordered[:1] + ordered[-1:][: len(ordered) - 1] + ordered[1:-1]
