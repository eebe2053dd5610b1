"""The KV cache the engine owns: preallocated per-layer slots and per-sequence lengths.

Row b of a batch holds its tokens in slots [starts[b], seq_lens[b]); slots before starts[b] are
left padding, slots at or past seq_lens[b] are stale (masked, then overwritten). Rolling back a
rejected draft is a length update, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Static-address key/value tensors, one pair per layer, and per-row lengths.

    Attributes:
        k, v: per layer, [B, S, kv_heads, head_dim] (S = slots per row).
        seq_lens: [B] int64, slots written so far per row (left padding included).
        starts: [B] int64, first real slot per row (the count of left-padding slots).
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    seq_lens: torch.Tensor
    starts: torch.Tensor

    @staticmethod
    def nbytes(num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
               dtype: torch.dtype) -> int:
        """Bytes the cache will take: 2 (k and v) x layers x B x S x kv_heads x head_dim."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * batch * slots * kv_heads * head_dim * itemsize

    @classmethod
    def allocate(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> KVCache:
        """Zero-filled slots for `batch` rows of `slots` tokens each."""
        shape = (batch, slots, kv_heads, head_dim)  # [B, S, kv_heads, D]
        k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        zeros = torch.zeros(batch, dtype=torch.long, device=device)
        return cls(k, v, seq_lens=zeros.clone(), starts=zeros.clone())

    def rows(self, batch: int) -> KVCache:
        """The first `batch` rows as a cache of their own: views, so the same memory and the
        same static addresses (a batch bucket's steps are built over it)."""
        if batch == self.batch_size:
            return self
        return KVCache([k[:batch] for k in self.k], [v[:batch] for v in self.v],
                       seq_lens=self.seq_lens[:batch], starts=self.starts[:batch])

    @property
    def batch_size(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def slots(self) -> int:
        return self.k[0].shape[1] if self.k else 0

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
