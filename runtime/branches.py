"""Two pieces of device work at the same time: one on a side stream, one on the current stream.

Inside a CUDA graph capture the side stream's work becomes a parallel branch of the graph (the
fork and the join are the two `wait_stream`s), so on replay the GPU runs both branches' kernels
concurrently. That is what the overlapped speculative step (runtime/speculative.py,
`overlapped_step`) is made of: the draft drafts the next round on the side branch while the
target verifies this round's guesses on the main one. At the bundled pair's sizes every kernel
fills a handful of SMs for a couple of microseconds, so two dependent chains side by side take
about as long as the longer one.

Off CUDA the two run one after the other (side first), with the same results.

The side branch's kernels use their own split-K counters (fuser/ops/counters.py, lane 1): two
split-K GEMVs running at once must not count arrivals in the same slots. Whatever the side branch
returns must be written into tensors the caller allocated on the current stream before the fork
(so no memory allocated on the side stream outlives the branch).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import torch

from fuser.ops.counters import counter_lane

A = TypeVar("A")
B = TypeVar("B")

SIDE_LANE = 1  # the side branch's split-counter lane

_side_streams: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of `device`, created once (a graph keeps the stream it was captured on
    only during capture, so one per device serves every graph)."""
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream


def run_concurrently(side: Callable[[], A], main: Callable[[], B], device: torch.device
                     ) -> tuple[A, B]:
    """(side(), main()): on CUDA `side` on the side stream, forked from and joined back into the
    current stream; elsewhere one after the other. FUSER_BRANCHES=serial runs them one after
    the other on CUDA too (a diagnostic: the same work without the concurrency)."""
    if device.type != "cuda" or os.environ.get("FUSER_BRANCHES") == "serial":
        with counter_lane(SIDE_LANE):
            a = side()
        return a, main()
    current = torch.cuda.current_stream(device)
    branch = side_stream(device)
    branch.wait_stream(current)  # fork: the side branch sees everything issued before
    with torch.cuda.stream(branch), counter_lane(SIDE_LANE):
        a = side()
    b = main()
    current.wait_stream(branch)  # join: what follows sees both branches' writes
    return a, b
