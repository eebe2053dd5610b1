"""Copies from the host to the device that never make the host wait for the device.

The decoding loops queue the next step before they read the last one back (runtime/scheduler.py,
runtime/generate.py), so anything the host hands a step queued ahead (a block table, proposals,
a chunk's lengths) must reach the device without a synchronisation: `torch.tensor(...,
device="cuda")`, or a copy from pageable memory, waits for the work already on the stream. On
CUDA the copy here is queued on the current stream from a pinned copy of the source; PyTorch's
caching host allocator keeps that pinned block until the copy has run, so the source may change
at once. (The other way, a step's result to the host: runtime/generate.py `ReadBack`.)
"""

from __future__ import annotations

import torch

__all__ = ["copy_from_host", "to_device"]


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst <- src (a CPU tensor of dst's shape): on CUDA queued on the current stream, the host
    not waiting; elsewhere a plain copy."""
    if dst.device.type == "cuda":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device(values: list, device: torch.device, dtype: torch.dtype = torch.long
              ) -> torch.Tensor:
    """`values` (a list, or a list of equal-length lists) as a `dtype` tensor on `device`
    (`copy_from_host`)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    out = torch.empty_like(host, device=device)
    copy_from_host(out, host)
    return out
