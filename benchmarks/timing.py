"""GPU time of decode-sized work as a CUDA graph runs it: no host launch overhead.

    from timing import time_us, copies_for, measure_read_bandwidth, log
    t = time_us([functools.partial(op, *args) for args in arg_sets])   # t.us, t.method

A batch-1 decode op does a few microseconds of GPU work; timed by launching it from Python
(`do_bench(fn)`), what is measured is the host's dispatch and allocation cost (~20-90 us), not
the kernel. The engine replays each step as a CUDA graph, where that cost is gone, so here too:
`graph_time_us` warms `fn` up on a side stream, captures `calls` back-to-back calls of it into
one `torch.cuda.CUDAGraph`, and times `g.replay` with `triton.testing.do_bench` (median; do_bench
flushes the L2 before each replay), per call. The gaps between the kernels of a graph are
included, as they are in the step.

L2 residency: within one replay the same inputs would be read `calls` times, so an input that
fits the L2 (~50-60 MB on an H200) would be served from it after the first call. Inputs that a
decode step streams from HBM (GEMM weights, the KV cache) are therefore rotated: pass a list of
callables over distinct copies (`copies_for(bytes)` of them, >= ROTATE_BYTES together), and call
i runs copy i % len. Small activations (a norm's input, q) need no copies: in a step they were
just written by the previous kernel, so reading them from L2 is what the step does too.

If capture fails (an op that syncs with the host, or a torch.compile'd function that recompiles
under capture), `time_us` falls back to plain `do_bench` of the first callable and says so:
method EAGER_LAUNCH, host overhead included.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from triton.testing import do_bench

CALLS = 20                  # calls per captured graph (at least one per copy)
ROTATE_BYTES = 200e6        # rotated copies together exceed ~4x the L2
WARMUP_ROUNDS = 3           # eager calls of each callable before capture
CUDA_GRAPH = "cuda-graph"
EAGER_LAUNCH = "eager-launch"

Fn = Callable[[], Any]


@dataclass
class Timing:
    us: float               # per call
    method: str             # CUDA_GRAPH or EAGER_LAUNCH
    calls: int = 1          # calls per timed replay
    note: str | None = None  # why capture failed, for EAGER_LAUNCH


def copies_for(nbytes: int, target: float = ROTATE_BYTES) -> int:
    """How many distinct copies of `nbytes` of input make at least `target` bytes together."""
    return max(1, math.ceil(target / nbytes)) if nbytes > 0 else 1


def _sequence(fn: Fn | Sequence[Fn], calls: int) -> tuple[list[Fn], list[Fn]]:
    """(distinct callables, the call sequence): calls rounded up so every copy runs equally."""
    fns = list(fn) if isinstance(fn, (list, tuple)) else [fn]
    if not fns:
        raise ValueError("nothing to time")
    n = len(fns)
    total = math.ceil(max(calls, n) / n) * n
    return fns, [fns[i % n] for i in range(total)]


def graph_time_us(fn: Fn | Sequence[Fn], calls: int = CALLS, *, warmup: int = 25,
                  rep: int = 100) -> float:
    """Microseconds per call of fn by CUDA-graph replay of `calls` back-to-back calls.

    fn: a callable, or a list of callables (one per rotated input copy) that call i cycles
    through. Raises if the capture fails; `time_us` falls back instead.
    """
    fns, seq = _sequence(fn, calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles, autotunes, allocator) off the capture
        for _ in range(WARMUP_ROUNDS):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in seq:
            f()
    graph.replay()
    torch.cuda.synchronize()
    ms = do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median")
    del graph
    return ms * 1e3 / len(seq)


def time_us(fn: Fn | Sequence[Fn], calls: int = CALLS, *, warmup: int = 25,
            rep: int = 100) -> Timing:
    """graph_time_us, or plain do_bench of the first callable if the capture fails."""
    n = len(_sequence(fn, calls)[1])
    try:
        return Timing(graph_time_us(fn, calls, warmup=warmup, rep=rep), CUDA_GRAPH, n)
    except Exception as e:  # noqa: BLE001 -- not capturable: time the launch instead
        root: BaseException = e  # capture_end's "failed due to a previous error" hides the cause
        while root.__context__ is not None:
            root = root.__context__
        note = f"{type(root).__name__}: {root}".splitlines()[0][:300]
    try:  # a failed capture is not sticky, but let any pending error surface here
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001
        pass
    first = fn[0] if isinstance(fn, (list, tuple)) else fn
    ms = do_bench(first, warmup=warmup, rep=rep, return_mode="median")
    return Timing(ms * 1e3, EAGER_LAUNCH, 1, note)


def replay_median_ms(fn: Callable[[], torch.Tensor], replays: int = 30
                     ) -> tuple[float, torch.Tensor]:
    """(median ms per replay of fn captured in one CUDA graph, a copy of its output): warmed up
    twice on a side stream, captured, replayed 3 times, then timed by CUDA events per replay
    (no L2 flush: fn itself streams more than the L2 holds, as a whole decode or verify step
    does)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out.clone()


def step_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: all parameters but the embedding table."""
    embed = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings().weight is embed
    return total - (0 if tied else embed.numel() * embed.element_size())


def measure_read_bandwidth() -> float:
    """Bytes/s of a sum over 2 GiB of bf16 (reads dominate)."""
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x.sum(), warmup=50, rep=200, return_mode="median")
    del x
    return 2**31 / (ms * 1e-3)


def log(message: str) -> None:
    """Print now (the device call's output is read while the script runs)."""
    print(message, flush=True)


def num(v: float | None, spec: str) -> str:
    """`v` formatted, or "-" for a missing or NaN value."""
    return "-" if v is None or v != v else format(v, spec)


def missing_gpu(script: str, dry_run: bool) -> bool:
    """True (after saying why on stderr) when `script` needs a GPU it does not have."""
    if dry_run or torch.cuda.is_available():
        return False
    print(f"benchmarks/{script}: no CUDA device (torch {torch.__version__}); run it on the GPU "
          "machine, or pass --dry-run to check the plumbing on CPU", file=sys.stderr)
    return True
