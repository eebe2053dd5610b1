"""Fixed-shape steps captured once as CUDA graphs and replayed: no launch gaps between kernels.

A captured step reads its inputs from static buffers (tokens and positions are copied in; the
cache's seq_lens and starts are read where they live, so the runtime must update them in
place) and writes its logits to a static output that the next replay overwrites.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# One capture at a time in the process (torch's rule for CUDA graphs), and no device-wide sync
# or cache emptying while one is under way: `torch.cuda.graph` synchronizes the device and
# empties the allocator's cache on entry, which a capture on another thread does not survive
# (the allocator asserts that none is under way). Every capture of the engine (step graphs on
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
    the pool's allocator routes only this stream's allocations into the graph's pool."""
    with CAPTURE_LOCK:
        try:
            with torch.no_grad(), torch.cuda.graph(graph, pool=pool,
                                                   stream=capture_stream(device),
                                                   capture_error_mode="thread_local"):
                return fn()
        except BaseException:
            release_generator(device)
            raise


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
        self.graph = torch.cuda.CUDAGraph()
        self.logits = capture_graph(  # [B, T, V], static
            self.graph, lambda: fn(self.tokens, self.positions, seq_lens, starts), pool, device)
        self.replays = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        if seq_lens is not self.seq_lens or starts is not self.starts:
            raise RuntimeError("a captured step must be given the cache's own length tensors")
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        self.replays += 1
        return self.logits
