"""Fixed-shape steps captured once as CUDA graphs and replayed: no launch gaps between kernels.

A captured step reads its inputs from static buffers (tokens and positions are copied in; the
cache's seq_lens and starts are read where they live, so the runtime must update them in
place) and writes its logits to a static output that the next replay overwrites.

Graphs in parts. Launching a graph costs the host time in proportion to its kernels, and the
device starts on it only once the launch returns: the 8B shape's uncompiled chunk step (a
prefix-cache hit) spent 549 us in `cudaGraphLaunch` with the GPU idle, on the request's time
to first token (benchmarks/RESULTS.md, "Prefix caching"). A step run through
`in_parts` ends its graph every PART_NODES ops and goes on in the next, all in one memory pool
and replayed in order: the device runs a part while the host launches the next, and only the
first part's launch is waited for. (The decode loops' steps are launched while the step before
runs: one graph each.)
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Ops (FX call_function nodes) per graph part of a step run `in_parts`: a part's launch is a
# share of the whole graph's, and at the 8B shape its kernels keep the device busy longer
# than the host takes to launch the next part.
PART_NODES = 96

# One capture at a time in the process (torch's rule for CUDA graphs), and no device-wide sync
# or cache emptying while one is under way: a capture (`capture_graphs`, as `torch.cuda.graph`)
# synchronizes the device and empties the allocator's cache on entry, which a capture on
# another thread does not survive (the allocator asserts that none is under way). Every capture of the engine (step graphs on
# the background thread, prefill graphs on the serving thread) and every device-wide sync
# after a failed one holds this lock. Re-entrant: `capture_failed` runs inside it.
CAPTURE_LOCK = threading.RLock()
# Per device: the stream every step-graph capture records on. One stream, so that graphs
# sharing a memory pool can reuse each other's freed blocks (the allocator reuses a block only
# on the stream it was freed on); never the legacy default stream, so the serving thread's work
# there cannot join a capture.
_capture_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream captures on `device` record on."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with CAPTURE_LOCK:
        if index not in _capture_streams:
            _capture_streams[index] = torch.cuda.Stream(index)
        return _capture_streams[index]


def capture_graph(graph: torch.cuda.CUDAGraph, fn: Callable[[], Any], pool: object | None,
                  device: torch.device) -> Any:
    """Record `fn()` into `graph` (memory from `pool`) and return what it returned.

    Safe beside another thread that runs work on the same device: the capture records on its
    own stream, in "thread_local" mode (only this thread is barred from unsafe calls such as
    syncs and cudaMalloc; the serving thread's are not errors and do not end the capture), and
    the pool's allocator routes only this stream's allocations into the graph's pool.
    (`capture_graphs` with `graph` first; fn must not end a part.)"""
    graphs, out = capture_graphs(fn, pool, device, first=graph)
    if len(graphs) != 1:
        raise RuntimeError("capture_graph records one graph: the function ended a graph part "
                           "(capture it with capture_graphs)")
    return out


class _Parts(threading.local):
    """This thread's capture in parts: the graphs so far (the last one capturing), or None."""

    graphs: list[torch.cuda.CUDAGraph] | None = None


_parts = _Parts()


def part_boundary() -> None:
    """Where a step run `in_parts` may end a graph part: inside `capture_graphs` on this thread,
    the graph capturing ends and the next begins (same pool and stream); elsewhere nothing."""
    graphs = _parts.graphs
    if graphs is None:
        return
    graphs[-1].capture_end()
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(pool=graphs[0].pool(), capture_error_mode="thread_local")
    graphs.append(graph)


def capture_graphs(fn: Callable[[], Any], pool: object | None, device: torch.device,
                   first: torch.cuda.CUDAGraph | None = None
                   ) -> tuple[list[torch.cuda.CUDAGraph], Any]:
    """Record `fn()` as one graph (`first`, else a new one), or several where it calls
    `part_boundary` (replay them in order); -> (the graphs, what fn returned). Its own stream,
    "thread_local" mode and memory from `pool`, as `capture_graph` says.

    Python's cyclic garbage collector is held off while it records: a collection on this
    thread that frees an earlier CUDA graph (a dropped engine or scheduler in a cycle) destroys
    it mid-capture, which the capture does not survive. A capture that fails leaves the next
    one into the same pool able to begin (`_release_capture`)."""
    with CAPTURE_LOCK:
        pool = live_pool(pool)
        torch.cuda.synchronize(device)  # (as torch.cuda.graph: the capture starts clean)
        torch.cuda.empty_cache()
        graphs = [first if first is not None else torch.cuda.CUDAGraph()]
        try:
            with collector_held(), torch.no_grad(), torch.cuda.stream(capture_stream(device)):
                graphs[0].capture_begin(*(() if pool is None else (pool,)),
                                        capture_error_mode="thread_local")
                _parts.graphs = graphs
                try:
                    out = fn()
                finally:
                    _parts.graphs = None
                    graphs[-1].capture_end()
        except BaseException:
            _release_capture(device, pool if pool is not None
                             else graphs[0].pool() if len(graphs) > 1 else None)
            raise
        return graphs, out


@contextmanager
def collector_held() -> Iterator[None]:
    """Python's cyclic garbage collector off inside (as it was before, after): around a
    capture, where a collection that frees an old CUDA graph breaks it (`capture_graphs`)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


# Pools whose capture failed -> the pool the captures given them use instead (`live_pool`).
_retired: dict[object, object] = {}


def live_pool(pool: object | None) -> object | None:
    """The memory pool a capture into `pool` records into: `pool`, or where a capture into it
    failed, its replacement (`_release_capture`). None (a private pool) stays None."""
    while pool is not None and pool in _retired:
        pool = _retired[pool]
    return pool


def _release_capture(device: torch.device, pool: object | None) -> None:
    """After a failed capture into `pool`: the device allocator no longer routes to it, later
    captures given it record into a new pool (`live_pool`), and the default generator is out
    of capture mode.

    A capture whose end fails (invalidated) returns before telling the allocators. The device
    allocator can be told here; the pinned host allocator (torch 2.11: it also records per
    pool) cannot from Python, and every later capture into the same pool fails at its start
    ("beginAllocateToPool: already recording to mempool_id"): one failed shape took every shape
    captured after it (the suffix steps' GPU test; the probes in benchmarks/RESULTS.md "GPU
    tests"). The graphs already in the old pool keep their memory."""
    if pool is not None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(index, pool)
        except RuntimeError:  # (the capture's end got that far: nothing routes there)
            pass
        _retired[pool] = torch.cuda.graph_pool_handle()
    release_generator(device)


class PartsRunner(torch.fx.Interpreter):
    """An FX step run op by op with a `part_boundary` after every `every` ops (call_function
    nodes): what `in_parts` captures. Slower on the host than the GraphModule's own code, so
    only inside a capture; the replays run no Python."""

    def __init__(self, module: torch.fx.GraphModule, every: int) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.every, self._ops = every, 0

    def run_node(self, n: torch.fx.Node) -> Any:
        out = super().run_node(n)
        if n.op == "call_function":
            self._ops += 1
            if self._ops % self.every == 0:
                part_boundary()
        return out


def in_parts(step: StepFn, every: int | None = None) -> StepFn:
    """`step` run so that a capture of it ends a graph part every `every` ops (default
    PART_NODES; an FX GraphModule, inside `capture_graphs` on this thread: `PartsRunner`;
    elsewhere, as its warm-up before the capture, the GraphModule's own code, where a boundary
    would do nothing); any other step as it is (one graph)."""
    if not isinstance(step, torch.fx.GraphModule):
        return step
    every = every or PART_NODES

    def run(tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
            starts: torch.Tensor) -> torch.Tensor:
        if _parts.graphs is None:
            return step(tokens, positions, seq_lens, starts)
        return PartsRunner(step, every).run(tokens, positions, seq_lens, starts)
    return run


def release_generator(device: torch.device) -> None:
    """After a failed capture: the device's default CUDA generator out of capture mode.

    A capture puts the generator's state in capture mode at its start and takes it out at its
    end, but a capture whose end fails (an invalidated capture: the usual way one fails) never
    does, and from then on every random number the process draws outside a capture raises
    "Offset increment outside graph capture encountered unexpectedly" (torch.randn, sampling,
    Inductor's autotuning inputs). The state is replaced by a copy of itself (same seed and
    offset), which is not capturing. Call holding CAPTURE_LOCK (no capture under way)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())


def capture_failed(e: Exception) -> str:
    """After a failed capture: let the device settle (a failed capture can leave an error
    behind) and describe the failure in one line, "CUDA graph capture failed (Type: first line)"."""
    try:
        with CAPTURE_LOCK:  # a device-wide sync: never while another thread captures
            torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- the error the failed capture left, already reported
        pass
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"CUDA graph capture failed ({type(e).__name__}: {first})"


class CudaGraphStep:
    """`fn` captured for tokens of one shape [B, T]; call it like `fn`."""

    def __init__(self, fn: StepFn, batch: int, tokens_per_step: int, seq_lens: torch.Tensor,
                 starts: torch.Tensor, pool: object | None = None, warmup: int = 2) -> None:
        device = seq_lens.device
        self.fn = fn  # the uncaptured step (benchmarks profile its kernels one by one)
        self.seq_lens, self.starts = seq_lens, starts
        self.tokens = torch.zeros(batch, tokens_per_step, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens_per_step, device=device)[None].repeat(batch, 1)
        # Warm up on a side stream (lazy initialisation, autotuning) before capturing.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                fn(self.tokens, self.positions, seq_lens, starts)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graphs, self.logits = capture_graphs(  # [B, T, V], static; a graph a part
            lambda: fn(self.tokens, self.positions, seq_lens, starts), pool, device)
        self.replays = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        if seq_lens is not self.seq_lens or starts is not self.starts:
            raise RuntimeError("a captured step must be given the cache's own length tensors")
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        for graph in self.graphs:
            graph.replay()
        self.replays += 1
        return self.logits
