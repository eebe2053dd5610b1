"""Split counters: the zeroed int32 buffer that one-launch split-K kernels count arrivals in.

The split-K decode GEMV (fuser/ops/linear.py) cuts one reduction over several programs and lets
the last program to arrive sum the parts, in the same launch: each program increments its
block's counter, and the last one resets it to zero. So between kernels every counter is zero,
and the kernels of one stream, which run one after another, share one buffer per device.

Two branches of one CUDA graph that run at the same time (runtime/speculative.py's overlapped
step: the draft on a side stream while the target verifies) must not share counters: each
branch runs inside its own `counter_lane`, and each lane has its own buffer.

(Attention's split merge was tried the same way, one launch per call, and measured slower on an
H200 than its two-kernel path: benchmarks/RESULTS.md, 2026-12-01.)
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

# Per device: int32, zero between kernels. One buffer serves every call on a device, as
# kernels on one stream run one after another and each leaves the counters it used at zero
# (the last program of each block resets its own); two calls may share counters only if they
# never overlap, which holds as long as these kernels run on one stream at a time (the
# engine's steps do; warm-up on a side stream is joined before capture).
# Allocated on the first call (the engines run an eager warm-up before they capture; torch.zeros
# inside a capture would record a memset in the graph), with room to spare, and never freed: a
# CUDA graph keeps the address it captured, so a buffer grown later keeps the old one alive.
SPLIT_COUNTERS = 1 << 16  # 256 KB: more than any launch's blocks at Llama-3-8B shapes
_counters: dict[tuple[torch.device, int], Tensor] = {}
_retired_counters: list[Tensor] = []
_lane = 0  # the counter lane of the kernels launched now (see `counter_lane`)


@contextmanager
def counter_lane(lane: int) -> Iterator[None]:
    """Split-K kernels launched inside use lane `lane`'s counters (lane 0 outside any): for work
    that runs concurrently with lane 0's, on another stream or graph branch."""
    global _lane
    outer, _lane = _lane, lane
    try:
        yield
    finally:
        _lane = outer


def split_counters(device: torch.device, n: int) -> Tensor:
    """At least n zeroed int32 split counters on device for the current `counter_lane`, the same
    buffer call after call."""
    key = (device, _lane)
    buf = _counters.get(key)
    if buf is not None and buf.numel() >= n:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"a split-K kernel needs {n} split counters on {device}, and "
            f"{0 if buf is None else buf.numel()} exist; they cannot be allocated during CUDA graph "
            "capture: call the op once outside the capture first (as the engines' warm-up does)")
    if buf is not None:
        _retired_counters.append(buf)  # captured graphs may still use it
    _counters[key] = torch.zeros(max(n, SPLIT_COUNTERS), dtype=torch.int32, device=device)
    return _counters[key]
