"""The paged KV cache's addressing, shared by the attention kernels and their references.

A paged cache keeps each layer's k (and v) in one pool [num_blocks, PAGE, kv_heads, D] and a
block table [B, max_blocks] int32 (runtime/blocks.py fills it): row b's slot j is
    (block_table[b, j // PAGE], j % PAGE),
so a row holds max_blocks * PAGE slots. Block 0 is the null block: table entries a row does not
own point there, and nothing a row owns ever lives there.

    _cache_rows   Triton: slots -> pool rows, used under a PAGE constexpr (0: contiguous, the
                  slot itself), so one kernel serves both layouts
    paged_view    PyTorch: the contiguous [B, max_blocks * PAGE, kv_heads, D] a pool stands for
    paged_slots   PyTorch: (block, offset) of each row's slots, for writes
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _cache_rows(j, j_ok, table_row, PAGE: tl.constexpr):
    """Where slots j of a row live, as cache rows of kv_heads * D elements: j itself in the
    contiguous cache (PAGE = 0; the row's own offset is the caller's), else block
    table_row[j // PAGE] of the pool at offset j % PAGE (missing slots, j_ok False, read the
    null block 0)."""
    if PAGE:
        # A slot before the row (j < 0: an idle row's catch-up at seq_lens - 1) is the null
        # block's too: never another block's last slot.
        ok = j_ok & (j >= 0)
        block = tl.load(table_row + j // PAGE, mask=ok, other=0).to(tl.int64)
        return tl.where(ok, block * PAGE + j % PAGE, 0)
    return j


def paged_view(pool: Tensor, block_table: Tensor) -> Tensor:
    """The contiguous cache a paged pool stands for: row b's blocks in table order.

    pool: [num_blocks, PAGE, KV, D]; block_table: [B, max_blocks] int32
    -> [B, max_blocks * PAGE, KV, D] (a gathered copy: slot j of row b is
    pool[block_table[b, j // PAGE], j % PAGE])."""
    return pool[block_table.long()].flatten(1, 2)


def paged_slots(block_table: Tensor, page: int, slots: Tensor) -> tuple[Tensor, Tensor]:
    """(block, offset) of each row's slots: slots [B, T] int64 -> two [B, T] int64 tensors
    indexing a pool [num_blocks, PAGE, ...]. Slots past the table's end give the null block 0
    (slots that a kernel drops; the reference writes them to the null block, which no row reads
    as its own)."""
    max_blocks = block_table.shape[1]
    # (clamped below too: an idle row's draft catch-up writes slot seq_lens - 1 = -1, which
    # lands in its first table entry, the null block for a row without blocks)
    index = (slots // page).clamp(min=0, max=max_blocks - 1)
    blocks = torch.gather(block_table.long(), 1, index)
    blocks = torch.where(slots < max_blocks * page, blocks, 0)
    return blocks, slots % page
