"""The greedy token: argmax over the vocabulary, as torch.argmax, in two short kernels.

    argmax(logits) = torch.argmax(logits, dim=-1)      logits: [..., V] -> [...] int64

torch.argmax reduces a row in one block of threads: over a Llama-3 vocabulary (V = 128256, one
row) it took 37.6 us of the 8B decode iteration on an H200 (benchmarks/decode.py --profile,
docs/performance-notes.md), some 1% of a bf16 token and 1.5% of an FP8 one. Here
the row is cut into CHUNK-wide chunks, one program each (`_chunk_kernel`: the chunk's maximum,
the first index holding it, the first NaN), and one program per row combines the chunks in
order (`_combine_kernel`). A vocabulary of at most SINGLE_MAX tokens takes one program a row
and one kernel.

Semantics are torch.argmax's: the first index of the maximum; a NaN counts as above every number,
so the first NaN wins; a row of -inf gives 0. Comparisons are in fp32, exact for bf16/fp16 (the
upcast keeps order and ties). On CUDA the kernels run; elsewhere torch.argmax does, unless
asked for the kernels (tests run them under TRITON_INTERPRET).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

CHUNK = 2048        # logits per program of the first kernel
SINGLE_MAX = 8192   # vocabularies up to this size: one program a row, one kernel (the bundled
# pair's 4096 tokens: its steps are launch-bound, a second kernel would cost more than it saves)
NUM_WARPS = 4


@triton.jit
def _chunk_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, out_ptr, V, stride_row, CHUNKS,
                  CHUNK: tl.constexpr, SINGLE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    at = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_row + at, mask=at < V, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)  # NaN-free: NaNs are handled apart
    first_top = tl.min(tl.where(x == top, at, V), axis=0)
    first_nan = tl.min(tl.where(x != x, at, V), axis=0)  # NaN: unequal to itself
    if SINGLE:  # the whole row in this chunk: the token itself
        tl.store(out_ptr + row, tl.where(first_nan < V, first_nan, first_top).to(tl.int64))
    else:
        out = row * CHUNKS + chunk
        tl.store(val_ptr + out, top)
        tl.store(idx_ptr + out, first_top)
        tl.store(nan_ptr + out, first_nan)


@triton.jit
def _combine_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, V, CHUNKS, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    ok = c < CHUNKS
    val = tl.load(val_ptr + row * CHUNKS + c, mask=ok, other=float("-inf"))
    idx = tl.load(idx_ptr + row * CHUNKS + c, mask=ok, other=V)
    nan = tl.load(nan_ptr + row * CHUNKS + c, mask=ok, other=V)
    top = tl.max(val, axis=0)
    first_top = tl.min(tl.where(val == top, idx, V), axis=0)  # chunks hold increasing indices
    first_nan = tl.min(nan, axis=0)
    tl.store(out_ptr + row, tl.where(first_nan < V, first_nan, first_top).to(tl.int64))


def argmax(logits: Tensor, *, kernels: bool | None = None) -> Tensor:
    """torch.argmax(logits, dim=-1) for logits [..., V]: the kernels on CUDA (or where
    `kernels` asks), torch.argmax otherwise and for anything but floating-point logits."""
    if kernels is None:
        kernels = logits.device.type == "cuda"
    V = logits.shape[-1]
    if not kernels or V == 0 or logits.numel() == 0 or not logits.is_floating_point():
        return torch.argmax(logits, dim=-1)
    lead = logits.shape[:-1]
    rows = logits.reshape(-1, V)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    R = rows.shape[0]
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if V <= SINGLE_MAX:  # one program a row, one kernel
        _chunk_kernel[(R, 1)](rows, out, out, out, out, V, rows.stride(0), 1,
                              CHUNK=triton.next_power_of_2(V), SINGLE=True, num_warps=NUM_WARPS)
        return out.reshape(lead)
    chunks = triton.cdiv(V, CHUNK)
    val = torch.empty((R, chunks), dtype=torch.float32, device=logits.device)
    idx = torch.empty((R, chunks), dtype=torch.int32, device=logits.device)
    nan = torch.empty_like(idx)
    _chunk_kernel[(R, chunks)](rows, val, idx, nan, out, V, rows.stride(0), chunks, CHUNK=CHUNK,
                               SINGLE=False, num_warps=NUM_WARPS)
    _combine_kernel[(R,)](val, idx, nan, out, V, chunks,
                          BLOCK_C=triton.next_power_of_2(chunks), num_warps=1)
    return out.reshape(lead)
