"""A small-message all-reduce over peer-to-peer memory (CUDA GPUs of one host), beside NCCL.

At batch 1 a tensor-parallel layer all-reduces a few kilobytes twice (the 8B shape: [1, 4096]
in bf16, 8 KiB, after o_proj and after down_proj). NCCL's latency for such a message inside a
CUDA graph was measured at 16-20 µs on 2×H200 (issue #47), about what the halved weight reads
save, which is why tensor parallelism barely pays at batch 1 with NCCL alone.

One shot over peer-to-peer memory instead: every rank keeps one staging buffer in symmetric
memory (`torch.distributed._symmetric_memory`: each rank maps every peer's buffer into its own
address space over NVLink), copies its partial sum there, and one kernel on each rank waits on
the peers' signal pads, reads all of their buffers and adds them up, in rank order (every rank
gets the same bits, as the ranks' lock-step greedy decoding needs), and a second barrier at
its end keeps any rank from overwriting its buffer while a peer still reads it. The kernel is
PyTorch's `symm_mem::one_shot_all_reduce(_copy)` (the copy in the kernel where this torch has
it). No NVLink multicast is used (the `multimem` ops need it:
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NCCL_NVLS_ENABLE=0 stay set, see the device notes).

Messages above `max_bytes` (a one-shot read of every peer's whole message stops paying at a
few hundred KB), dtypes other than bf16 and fp32, or a setup where symmetric memory is not available (the CPU,
gloo, one rank, a GPU pair without peer access) keep NCCL: `install` says why and returns None.

    handle = install(group, device)      # collective: every rank calls it, before any capture
    fuser.ops.collectives.all_reduce(x)  # now one-shot for x up to handle.max_bytes
    uninstall(device)

The next step is to write the row-parallel GEMV's output straight into the staging buffer (the
copy goes) and to reduce in its epilogue (one kernel fewer per all-reduce).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DTYPES", "MAX_BYTES", "P2PAllReduce", "install", "installed", "uninstall"]

log = logging.getLogger("fuser")

# The one-shot kernel reads world_size whole messages on each rank: below about this size that
# costs less than NCCL's extra round trips (to be measured: benchmarks/all_reduce.py).
MAX_BYTES = 512 * 1024
DTYPES = (torch.bfloat16, torch.float32)  # what symm_mem::one_shot_all_reduce dispatches

_INSTALLED: dict[torch.device, P2PAllReduce] = {}


class P2PAllReduce:
    """One rank's staging buffer in symmetric memory and the one-shot all-reduce over it.

    Args:
        group: the process group (NCCL) whose ranks share the buffer.
        device: this rank's CUDA device.
        max_bytes: the largest message taken (the buffer's size).

    Creating it is collective (a rendezvous): every rank of `group` creates one, at the same
    point of its program, before any CUDA graph that uses it is captured.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device,
                 max_bytes: int = MAX_BYTES) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if max_bytes <= 0 or max_bytes % 16:
            raise ValueError(f"max_bytes={max_bytes} must be a positive multiple of 16")
        self.group_name = group.group_name
        self.device = torch.device(device)
        self.max_bytes = max_bytes
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, group)
        self.world_size = group.size()

    def fits(self, x: Tensor) -> bool:
        """Whether `x` goes one-shot (else NCCL)."""
        return (x.device == self.device and x.dtype in DTYPES
                and x.numel() * x.element_size() <= self.max_bytes)

    def staged(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """The start of this rank's buffer as a tensor of `shape` and `dtype`."""
        numel = shape.numel()
        size = numel * torch.empty((), dtype=dtype).element_size()
        return self.buffer[:size].view(dtype).view(shape)

    def __call__(self, x: Tensor) -> Tensor:
        """The sum of `x` (contiguous) over the ranks, in a new tensor (x is left as it was)."""
        staging = self.staged(x.shape, x.dtype)
        ops = torch.ops.symm_mem
        if hasattr(ops, "one_shot_all_reduce_copy"):  # the copy in the kernel: one launch
            return ops.one_shot_all_reduce_copy(staging, x, "sum", self.group_name)
        staging.copy_(x)
        return ops.one_shot_all_reduce(staging, "sum", self.group_name)


def install(group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
            max_bytes: int = MAX_BYTES) -> P2PAllReduce | None:
    """Route small all-reduces on `device` through peer-to-peer memory; None (NCCL stays, the
    reason logged) where that is not possible. Collective: every rank of the group calls it."""
    reason = _unavailable(group, device)
    if reason is None:
        group = group or dist.group.WORLD
        device = torch.device(device if device is not None else "cuda")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        try:
            p2p = P2PAllReduce(group, device, max_bytes)
        except (RuntimeError, ImportError, AttributeError) as e:
            reason = f"symmetric memory could not be set up ({type(e).__name__}: {e})"
        else:
            _INSTALLED[device] = p2p
            log.info("all-reduce: one-shot over peer-to-peer memory up to %d bytes on %s",
                     max_bytes, device)
            return p2p
    log.info("all-reduce: NCCL only (%s)", reason)
    return None


def _unavailable(group: dist.ProcessGroup | None, device: torch.device | str | None
                 ) -> str | None:
    """Why one-shot cannot run here, or None."""
    if not (dist.is_available() and dist.is_initialized()):
        return "no process group"
    group = group or dist.group.WORLD
    if group.size() < 2:
        return "one rank"
    if not torch.cuda.is_available() or (device is not None and
                                         torch.device(device).type != "cuda"):
        return "not on CUDA"
    if dist.get_backend(group) != "nccl":
        return f"backend {dist.get_backend(group)}, not nccl"
    if not hasattr(torch.ops, "symm_mem") or not hasattr(torch.ops.symm_mem,
                                                         "one_shot_all_reduce"):
        return "this torch has no symm_mem::one_shot_all_reduce"
    return None


def installed(device: torch.device) -> P2PAllReduce | None:
    """The one-shot all-reduce installed for `device`, if any."""
    return _INSTALLED.get(device)


def uninstall(device: torch.device | str | None = None) -> None:
    """NCCL only again on `device` (every device if None)."""
    if device is None:
        _INSTALLED.clear()
    else:
        _INSTALLED.pop(torch.device(device), None)
