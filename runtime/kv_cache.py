"""The KV cache the engine owns: preallocated per-layer slots and per-sequence lengths.

Row b of a batch holds its tokens in slots [starts[b], seq_lens[b]); slots before starts[b] are
left padding, slots at or past seq_lens[b] are stale (masked, then overwritten). Rolling back a
rejected draft is a length update, nothing else.

A paged cache (block_size > 0) keeps each layer's slots in one pool of blocks
[num_blocks, block_size, kv_heads, D] and a block table [B, max_blocks] int32: row b's slot j is
(block_table[b, j // block_size], j % block_size) (runtime/blocks.py manages tables for
serving; fuser/capture.py and the attention kernels read and write through it). `allocate` gives
every row the blocks of its `slots` up front, interleaved over the pool (row b's block i is
1 + i * B + b; block 0 is the null block) when the pool holds them; `lay_out` does the same
for the rows of one `engine.generate` call, which runs over it. A target and its draft share
one table (their pools have the same block count: the draft's blocks follow the target's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Static-address key/value tensors, one pair per layer, and per-row lengths.

    Attributes:
        k, v: per layer, [B, S, kv_heads, head_dim] (S = slots per row); paged: the pools
            [num_blocks, block_size, kv_heads, head_dim].
        seq_lens: [B] int64, slots written so far per row (left padding included).
        starts: [B] int64, first real slot per row (the count of left-padding slots).
        block_table: paged: [B, max_blocks] int32, static address; None: contiguous.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    seq_lens: torch.Tensor
    starts: torch.Tensor
    block_table: torch.Tensor | None = None

    @staticmethod
    def nbytes(num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
        """Bytes the cache will take: 2 (k and v) x layers x B x S x kv_heads x head_dim."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * batch * slots * kv_heads * head_dim * itemsize

    @classmethod
    def allocate(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, block_size: int = 0,
                 num_blocks: int = 0, table: torch.Tensor | None = None) -> KVCache:
        """Zero-filled slots for `batch` rows of `slots` tokens each; block_size > 0: paged,
        one pool of `num_blocks` blocks (0: 1 + batch * ceil(slots / block_size), every row's
        slots and the null block), each row given its blocks up front where the pool holds
        them (module docstring). table: the [batch, max_blocks] block table to share (a
        draft's: the target's), else a new one."""
        shape = (batch, slots, kv_heads, head_dim)  # [B, S, kv_heads, D]
        if block_size:
            max_blocks = -(-slots // block_size)
            num_blocks = num_blocks or 1 + batch * max_blocks
            if num_blocks < 2:
                raise ValueError(f"a paged KV cache needs at least 2 blocks (block 0 is the null "
                                 f"block), got {num_blocks}")
            shape = (num_blocks, block_size, kv_heads, head_dim)  # the pool
            if table is None:
                table = torch.zeros((batch, max_blocks), dtype=torch.int32, device=device)
                _interleave(table, batch, max_blocks, num_blocks)
            elif tuple(table.shape) != (batch, max_blocks):
                raise ValueError(f"a shared block table must be [{batch}, {max_blocks}], got "
                                 f"{tuple(table.shape)}")
        else:
            table = None
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(k, v, seq_lens=zeros.clone(), starts=zeros.clone(), block_table=table)

    def rows(self, batch: int) -> KVCache:
        """The first `batch` rows as a cache of their own: views, so the same memory and the
        same static addresses (a batch bucket's steps are built over it)."""
        if batch == self.batch_size:
            return self
        if self.paged:  # one pool for every row: only the table is cut
            return KVCache(self.k, self.v, seq_lens=self.seq_lens[:batch],
                           starts=self.starts[:batch], block_table=self.block_table[:batch])
        return KVCache([k[:batch] for k in self.k], [v[:batch] for v in self.v],
                       seq_lens=self.seq_lens[:batch], starts=self.starts[:batch])

    def lay_out(self, batch: int, slots: int) -> None:
        """Give rows [:batch] the blocks of their first `slots` slots, interleaved over the pool
        (as `allocate` does), and the other rows none (the null block): what one
        `engine.generate` call runs over. Raises ValueError when the pool is too small."""
        table = self.block_table
        per_row = min(-(-slots // self.k[0].shape[1]), table.shape[1])
        if 1 + batch * per_row > self.num_blocks:
            raise ValueError(f"{batch} rows of {slots} slots need {1 + batch * per_row} blocks; "
                             f"this engine's paged KV pool has {self.num_blocks}: generate "
                             "fewer rows or tokens at once (or serve them through a Scheduler)")
        table.zero_()
        _interleave(table, batch, per_row, self.num_blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks in each pool (paged; the null block included)."""
        return self.k[0].shape[0] if self.paged else 0

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def paged(self) -> bool:
        return self.block_table is not None

    @property
    def slots(self) -> int:
        """Slots per row (paged: max_blocks x block_size)."""
        if self.paged:
            return self.block_table.shape[1] * self.k[0].shape[1]
        return self.k[0].shape[1] if self.k else 0

    def move_row(self, src: int, dst: int, table: bool = True) -> None:
        """Row dst takes row src's contents and lengths: the slots are copied (src keeps its
        own), or for a paged cache the two rows' tables are swapped (src then holds dst's old
        blocks; nothing is copied, and no block is owned twice). table=False: the lengths
        only (a paged cache whose table a `BlockManager` edits, moving rows itself)."""
        if self.paged:
            if table:
                rows = self.block_table
                rows[[dst, src]] = rows[[src, dst]]
        else:  # every layer's row in one call ([B, S, kv_heads, D] each): a few launches
            layers = (*self.k, *self.v)  # on CUDA, not one a layer (host time per retire)
            torch._foreach_copy_([layer[dst] for layer in layers],
                                 [layer[src] for layer in layers])
        torch._foreach_copy_([self.seq_lens[dst], self.starts[dst]],
                             [self.seq_lens[src], self.starts[src]])

    # The lengths change only through the methods below, in place: captured CUDA graphs read
    # seq_lens and starts where they live. (The greedy step's fused kernels, runtime/
    # step_kernels.py and runtime/draft_kernels.py, make the same updates in their launches.)

    def reset(self) -> None:
        """Forget every sequence (the slots keep their stale values, masked by the lengths)."""
        self.seq_lens.zero_()
        self.starts.zero_()

    def begin(self, starts: torch.Tensor) -> None:
        """Start new sequences: row b's first real slot is starts[b] ([B] int64), none written."""
        self.seq_lens.zero_()
        self.starts.copy_(starts)

    def advance(self, n: torch.Tensor | int) -> None:
        """Row b has written n[b] more slots (an int: every row the same)."""
        self.seq_lens.add_(n)

    def set_lengths(self, lengths: torch.Tensor | int) -> None:
        """Set the written slots per row ([B], or an int for every row): moving back is how a
        rejected draft is rolled back (the later slots become stale, masked, then overwritten)."""
        if isinstance(lengths, int):
            self.seq_lens.fill_(lengths)
        else:
            self.seq_lens.copy_(lengths)

    def limit(self, lengths: torch.Tensor | int) -> None:
        """Keep at most lengths[b] written slots per row ([B], or an int for every row):
        seq_lens = min(seq_lens, lengths)."""
        if isinstance(lengths, int):
            self.seq_lens.clamp_(max=lengths)
        else:
            torch.minimum(self.seq_lens, lengths, out=self.seq_lens)


def _interleave(table: torch.Tensor, batch: int, per_row: int, num_blocks: int) -> None:
    """Rows [:batch] of `table` take blocks 1 + i * batch + b for their first per_row entries
    (where the pool of `num_blocks` holds them; the rest stay as they are)."""
    if 1 + batch * per_row > num_blocks:  # a pool sized from a budget: rows get blocks later
        return
    blocks = 1 + torch.arange(per_row)[None, :] * batch + torch.arange(batch)[:, None]
    table[:batch, :per_row] = blocks.to(torch.int32).to(table.device)


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory on `device` in bytes, or None where it cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None
