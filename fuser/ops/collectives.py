"""Collectives as graph ops: the all-reduce and all-gather that a tensor-parallel step graph
(passes/tensor_parallel.py) carries between its sharded matmuls.

    all_reduce(x)              x: [...]      -> [...]        sum over the ranks
    all_gather(x, world_size)  x: [..., N]   -> [..., N * world_size]  rank r's x at columns
                                                              [r * N, (r + 1) * N)

Both are functional (a new tensor; the input is left as it was), so the graph stays functional
and capture, the passes and CUDA graphs treat them like any other opaque op. They run through
torch.distributed's default process group (gloo on the CPU, NCCL on CUDA); without an
initialized group, or with a group of one rank, all_reduce is a copy and all_gather of
world_size 1 a copy. `world_size` is an argument of all_gather (not read from the group) so that
its fake implementation knows the output's shape.

On CUDA, once `fuser.ops.p2p_all_reduce.install` has run on every rank (the tensor-parallel
engine does it with FUSER_ONE_SHOT_ALL_REDUCE=1: not yet run on several GPUs, hence off by
default), all_reduce takes small messages one-shot over peer-to-peer memory; NCCL the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fuser.ops.p2p_all_reduce import installed


def group_size() -> int:
    """The default process group's world size, 1 where none is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


@torch.library.custom_op("fuser::all_reduce", mutates_args=())
def all_reduce(x: Tensor) -> Tensor:
    """The sum of `x` over the ranks of the default process group (a copy with one rank)."""
    p2p = installed(x.device)  # only ever on CUDA
    if p2p is not None and p2p.fits(x):
        return p2p(x.contiguous())
    out = x.contiguous().clone()
    if group_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@all_reduce.register_fake
def _all_reduce_fake(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("fuser::all_gather", mutates_args=())
def all_gather(x: Tensor, world_size: int) -> Tensor:
    """Every rank's `x` [..., N] side by side along the last dim, in rank order: [..., N * ws]."""
    if world_size != group_size():
        raise ValueError(f"fuser::all_gather: built for world size {world_size}, but the process "
                         f"group has {group_size()} ranks")
    x = x.contiguous()
    if world_size == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


@all_gather.register_fake
def _all_gather_fake(x: Tensor, world_size: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * world_size))


def all_reduce_reference(parts: list[Tensor]) -> Tensor:
    """What all_reduce gives every rank, from each rank's input (rank order)."""
    return torch.stack(parts).sum(0)


def all_gather_reference(parts: list[Tensor]) -> Tensor:
    """What all_gather gives every rank, from each rank's input (rank order)."""
    return torch.cat(parts, dim=-1)
