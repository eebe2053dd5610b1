"""L2 prefetch of a later kernel's weights from inside a kernel that leaves HBM idle.

A decode step's attention (fuser/ops/rotary_attention.py) reads a few MB of KV cache and then
waits on its own latency: on the H200 it takes ~6 us a layer of the Llama-3-8B shape while
the memory system has nothing to do. The kernel after it, o_proj, is a GEMV that streams its
weight from HBM (FP8: 16.8 MB in 8.4 us timed alone, 47% of the read bandwidth: it is too
short to ramp up; benchmarks/shape_lab.py, RESULTS.md). Each attention program therefore
issues, before it waits for its inputs, Hopper's bulk L2 prefetch
(`cp.async.bulk.prefetch.L2.global [address], bytes`) for its share of o_proj's weight: the
copy runs in the memory system while attention computes, and o_proj then reads its weight
from L2. The prefetch is a hint: it moves no data into registers, waits for nothing and
changes no value (a prefetched line is what HBM holds; weights are never written in a step).

    prefetch_l2(base, nbytes, chunk, part, LANES)   # Triton: `part`'s LANES chunks of `chunk`
    prefetch_args(t, programs, lanes) -> (tensor, nbytes, chunk, on)   # the launcher's side

Bytes: none moved by the kernel that prefetches (the memory system moves nbytes HBM -> L2,
the bytes the next kernel would have read anyway). FLOPs: none.

Needs sm_90 (the bulk prefetch is Hopper's) and a compiled kernel: the interpreter and older
GPUs get `on=False` and the kernels compile the prefetch out (a constexpr).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

# How many bytes of the weight to prefetch at most (None: all of it). The H200's L2 is 50 MB;
# what attention's ~6 us can fetch at ~4 TB/s is ~24 MB (FP8 o_proj at the 8B shape: 16.8 MB,
# bf16: 33.6 MB, of which the first MAX_BYTES are fetched). Benchmarks set it (0: off) to
# compare; CUDA graphs keep what they were captured with.
MAX_BYTES: int | None = 24 << 20
ALIGN = 16  # the bulk prefetch's address and size granularity (PTX ISA: multiples of 16 bytes)
_ALIGN: tl.constexpr = tl.constexpr(ALIGN)


# ---------------------------------------------------------------------------------------------
# Triton helper
# ---------------------------------------------------------------------------------------------


@triton.jit
def prefetch_l2(base_ptr, nbytes, chunk, part, LANES: tl.constexpr):
    """Issue the bulk L2 prefetch of bytes [g * chunk, (g + 1) * chunk) of base_ptr (clipped
    to nbytes) for the LANES chunks g of program `part` (g = part * LANES + lane). nbytes and
    chunk are multiples of ALIGN, base_ptr is ALIGN-aligned (prefetch_args checks both); a lane
    past nbytes prefetches nothing (its size is 0 and its instruction predicated off)."""
    lane = tl.arange(0, LANES)
    start = (part * LANES + lane).to(tl.int64) * chunk
    size = tl.minimum(tl.maximum(nbytes - start, 0), chunk).to(tl.int32)
    address = base_ptr.to(tl.pointer_type(tl.int8)) + tl.minimum(start, nbytes - _ALIGN)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.u32 p, $2, 0; "
        "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [address, size], dtype=tl.int32, is_pure=False, pack=1)


# ---------------------------------------------------------------------------------------------
# Launcher side
# ---------------------------------------------------------------------------------------------


def prefetch_supported(device: torch.device) -> bool:
    """CUDA at compute capability >= 9.0, compiled (not TRITON_INTERPRET), and FUSER_L2_PREFETCH
    not "0" (read at each launch; CUDA graphs keep what they were captured with)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1" \
            or os.environ.get("FUSER_L2_PREFETCH", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def prefetch_args(t: Tensor | None, programs: int, lanes: int, fallback: Tensor
                  ) -> tuple[Tensor, int, int, bool]:
    """(tensor, nbytes, chunk, on) for a launch of `programs` programs of `lanes` lanes that
    prefetches the first min(t's bytes, MAX_BYTES) of t: chunk is each lane's share, rounded up
    to ALIGN. Off (fallback, 0, ALIGN, False) without t, on an unsupported device, with
    MAX_BYTES == 0, or where t is not a contiguous ALIGN-aligned tensor of at least ALIGN bytes
    (a hint never worth an error)."""
    off = (fallback, 0, ALIGN, False)
    if t is None or MAX_BYTES == 0 or not prefetch_supported(t.device) or not t.is_contiguous():
        return off
    nbytes = t.numel() * t.element_size()
    if MAX_BYTES is not None:
        nbytes = min(nbytes, MAX_BYTES)
    nbytes -= nbytes % ALIGN
    if nbytes < ALIGN or t.data_ptr() % ALIGN:
        return off
    chunk = triton.cdiv(triton.cdiv(nbytes, programs * lanes), ALIGN) * ALIGN
    return t, nbytes, chunk, True
