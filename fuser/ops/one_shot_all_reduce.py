"""The one-shot all-reduce for small messages: every rank reads every rank's buffer (peer to
peer, over NVLink) and sums them itself, in rank order, in one kernel; no multicast.

    one_shot_sum([b_0, ..., b_{W-1}]) = ((b_0 + b_1) + b_2) + ... in fp32, rounded once to
                                        b_0's dtype

Every rank sums the same buffers in the same order, so every rank gets the same bits (as the
collective requires: the ranks' next steps must agree). Per element: W loads (W - 1 of them
from peers' memory) and one store; bytes = (W + 1) * n * s; FLOPs = (W - 1) * n.

`PeerAllReduce` is the all-reduce around the kernel, on CUDA with torch's symmetric memory
(`torch.distributed._symmetric_memory`: one buffer per rank, mapped into every peer, and
signal-pad barriers that CUDA graphs capture): copy the input into this rank's buffer,
barrier (every rank's input is in place), `one_shot_sum` over the W buffers, barrier (no rank
overwrites its buffer while a peer still reads it). Messages above `max_bytes` go to NCCL:
the one-shot reads W times the message, which stops paying once the message is large enough
for NCCL's bandwidth to matter. At batch 1 the 8B shape's all-reduce is 8 KiB (hidden 4096,
bf16). The kernel's arithmetic is tested in one process over several buffers (tests/
test_ops_one_shot_all_reduce.py); the barriers and peer reads need 2 GPUs and are not run yet,
so the engine uses NCCL unless FUSER_ONE_SHOT_ALL_REDUCE=1 (fuser/ops/collectives.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

MAX_WORLD = 8  # peer buffers one launch reads (the pointer arguments of the kernel)
BLOCK = 1024  # elements per program: 8 KiB messages are 4 programs in bf16
DEFAULT_MAX_BYTES = 256 * 1024  # one-shot up to this size, NCCL above


# ---------------------------------------------------------------------------------------------
# Triton kernel
# ---------------------------------------------------------------------------------------------


@triton.jit
def _add(acc, ptr, offs, mask):
    return acc + tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _one_shot_sum_kernel(
    out_ptr,                                  # out: [n], contiguous, the buffers' dtype
    p0, p1, p2, p3, p4, p5, p6, p7,           # rank r's buffer: [n] contiguous (r < WORLD)
    n,
    WORLD: tl.constexpr,                      # buffers to sum, 1..MAX_WORLD
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(p0 + offs, mask=mask, other=0.0).to(tl.float32)
    if WORLD > 1:  # in rank order: the same sum on every rank
        acc = _add(acc, p1, offs, mask)
    if WORLD > 2:
        acc = _add(acc, p2, offs, mask)
    if WORLD > 3:
        acc = _add(acc, p3, offs, mask)
    if WORLD > 4:
        acc = _add(acc, p4, offs, mask)
    if WORLD > 5:
        acc = _add(acc, p5, offs, mask)
    if WORLD > 6:
        acc = _add(acc, p6, offs, mask)
    if WORLD > 7:
        acc = _add(acc, p7, offs, mask)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def one_shot_sum(buffers: list[Tensor], out: Tensor | None = None) -> Tensor:
    """The sum of `buffers` (one per rank, rank order; same shape and dtype, contiguous, at
    most MAX_WORLD) in fp32, rounded once: a new tensor, or `out`."""
    if not 1 <= len(buffers) <= MAX_WORLD:
        raise ValueError(f"one_shot_sum: {len(buffers)} buffers, 1..{MAX_WORLD} supported")
    first = buffers[0]
    for b in buffers:
        if b.shape != first.shape or b.dtype != first.dtype or not b.is_contiguous():
            raise ValueError("one_shot_sum: every buffer must be contiguous, of one shape and "
                             f"dtype; got {[(tuple(x.shape), x.dtype) for x in buffers]}")
    out = torch.empty_like(first) if out is None else out
    n = first.numel()
    pointers = list(buffers) + [first] * (MAX_WORLD - len(buffers))  # unread past WORLD
    grid = (triton.cdiv(n, BLOCK),)
    _one_shot_sum_kernel[grid](out, *pointers, n, WORLD=len(buffers), BLOCK=BLOCK)
    return out


# ---------------------------------------------------------------------------------------------
# The all-reduce around it (CUDA, symmetric memory)
# ---------------------------------------------------------------------------------------------


class PeerAllReduce:
    """Sum over the ranks of the default process group through peer buffers (module
    docstring); `__call__(x)` returns None for a message it does not take (too large, or a
    dtype the buffer was not made for), which the caller sends through NCCL."""

    def __init__(self, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        group = dist.group.WORLD
        self.world_size = dist.get_world_size()
        if self.world_size > MAX_WORLD:
            raise ValueError(f"one-shot all-reduce: {self.world_size} ranks, at most "
                             f"{MAX_WORLD}")
        self.max_bytes = max_bytes
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch releases
            symm_mem.enable_symm_mem_for_group(group.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, group.group_name)  # a collective
        self.rank = self.handle.rank

    def __call__(self, x: Tensor) -> Tensor | None:
        nbytes = x.numel() * x.element_size()
        if nbytes > self.max_bytes or nbytes % x.element_size():
            return None
        x = x.contiguous()
        mine = self.handle.get_buffer(self.rank, (x.numel(),), x.dtype)
        mine.copy_(x.view(-1))
        self.handle.barrier(channel=0)  # every rank's input is in its buffer
        peers = [self.handle.get_buffer(r, (x.numel(),), x.dtype) for r in range(self.world_size)]
        out = one_shot_sum(peers).view(x.shape)
        self.handle.barrier(channel=1)  # every rank has read: buffers may be written again
        return out


# ---------------------------------------------------------------------------------------------
# Reference
# ---------------------------------------------------------------------------------------------


def one_shot_sum_reference(buffers: list[Tensor]) -> Tensor:
    """What one_shot_sum computes: fp32 adds in rank order, rounded once."""
    acc = buffers[0].float()
    for b in buffers[1:]:
        acc = acc + b.float()
    return acc.to(buffers[0].dtype)
