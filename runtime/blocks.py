"""The paged KV cache's block manager: fixed-size blocks, a free list, a block table per row,
and prefix caching.

A model's cache is one pool of `num_blocks` blocks of `block_size` slots each
(k, v: [num_blocks, block_size, kv_heads, head_dim] per layer). Row r's slot j lives in block
`table[r, j // block_size]` at offset `j % block_size`; the attention kernels read and write
through the table (fuser/ops/attention.py, rotary_attention.py, rope.py with a block table).
The draft's pool has the same number of blocks: its blocks follow the target's table.

Block 0 is the null block: never handed out, it is what every unused table entry points to,
so a padding row of a batch bucket (or a slot past a row's blocks) reads and writes only it and
never another row's block.

Prefix caching (as vLLM's): a full block whose tokens are all written is keyed by
    key(block i) = sha256(key(block i - 1) || token ids of block i),   key(block -1) = b""
so a key names the whole prefix up to the end of its block. A map key -> block lets a new
request whose prompt opens with cached blocks share them (reference counts) and prefill only
the rest. A block is shared only this way: full, keyed, read-only. A block nobody references
keeps its key and waits in an LRU list; it is evicted (its key forgotten) only when a free
block is needed and the free list is empty. Released rows give their blocks back tail first,
so a chain's last blocks are evicted before its first ones.

A cached block holds two halves: the target's k/v and the draft's (the draft's pool follows the
same table). The draft's half is only as good as the draft weights that computed it: when they
change (online distillation swaps new weights in), every cached draft half goes stale while
every target half stays right. So keys stay what they are (the tokens), and each cached block
records the draft version its draft half was computed by (`draft_version`, moved on by
`draft_changed`). A hit reuses the target's k/v of every hit block, and the draft's only of the
leading ones of the current version (`draft_hit`); the caller prefills the draft's over the rest
of the hit and says so (`draft_refreshed`), which makes those blocks current again. A row
admitted before a change holds the old draft's k/v in every slot (later ones attend over
earlier ones), so the blocks it fills afterwards are recorded with the old version too. Putting
the version in the key instead would be simpler, but a hit after a swap would then miss, and
the target's k/v, the expensive half, would be computed again for nothing.

Nothing here touches the device except the block table: the host keeps `host_table` and
`sync_table` copies it into `table`, a tensor of static address the captured graphs read.

Typical life of a request (the caller is the scheduler):
    hit = manager.admit(row, prompt)        # None: not enough blocks, wait (nothing changed)
    manager.grow(row, len(prompt) + T)      # room for the step's T new slots (False: preempt)
    d = manager.draft_hit(row)              # < hit after `draft_changed`: stale draft k/v
    ... the draft alone over prompt[d:hit] ...; manager.draft_refreshed(row)
    ... prefill prompt[hit:] ...; manager.commit(row, prompt[hit:])
    ... each step: grow, run, commit(row, tokens now written) ...
    manager.release(row)                    # finished or cancelled
    tokens = manager.preempt(row)           # or: free the blocks, requeue with these tokens
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from fuser.runtime.host_copies import copy_from_host

NULL_BLOCK = 0


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: sha256 of the parent block's key and its tokens
    (int64, little-endian as the host stores them). 32 bytes; equal keys mean equal prefixes
    (up to sha256 collisions)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def block_keys(tokens: Sequence[int], block_size: int, count: int) -> Iterator[bytes]:
    """`block_key` of each of the first `count` full blocks of `tokens`, in order (each the
    parent of the next), lazily: the tokens made bytes once, not a block at a time (an
    admission's host time with a long cached prefix)."""
    width = block_size * array("q").itemsize
    data = memoryview(array("q", tokens[: count * block_size]).tobytes())
    parent = b""
    for i in range(count):
        digest = hashlib.sha256(parent)
        digest.update(data[i * width:(i + 1) * width])
        parent = digest.digest()
        yield parent


@dataclass(frozen=True)
class CacheShape:
    """What one model's pool holds per slot: layers x (k and v) x kv_heads x head_dim."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_slot(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


def blocks_for_budget(budget_bytes: int, block_size: int, shapes: Sequence[CacheShape]) -> int:
    """How many blocks (null block included) fit in `budget_bytes` when every model in `shapes`
    (the target, and the draft whose blocks follow the target's table) keeps a pool of that
    many blocks. Raises ValueError when not even two blocks (the null block and one) fit."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    per_block = block_size * sum(s.bytes_per_slot() for s in shapes)
    blocks = int(budget_bytes) // per_block if per_block else 0
    if blocks < 2:
        raise ValueError(f"a KV budget of {budget_bytes} bytes holds {blocks} blocks of "
                         f"{block_size} slots ({per_block} bytes each); at least 2 are needed")
    return blocks


@dataclass
class _Row:
    """A row's blocks (in slot order) and the tokens whose k/v are written in them."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # keys of its full blocks, in order
    draft_version: int = 0  # the draft version its draft k/v are computed by (at admission)
    hit_blocks: int = 0  # leading blocks that were prefix-cache hits at admission
    draft_hit: int = 0  # leading hit tokens whose draft k/v are the current draft's


@dataclass(frozen=True)
class Preempted:
    """What a preempted row needs to be requeued: the tokens that were in its cache (prompt and
    generated, in order). Prefilled again on readmission, mostly as prefix-cache hits."""

    tokens: list[int]


class BlockManager:
    """Blocks of one pool (shared by the target and the draft), the table of `rows` rows of up
    to `max_blocks` blocks each, and the prefix cache.

    Attributes:
        table: [rows, max_blocks] int32 on `device`, static address (read by step graphs).
        host_table: the same on the host, where changes are made; `sync_table` copies it.
        prefix_queries, prefix_hits: prompt tokens looked up in the prefix cache, and those
            found (vLLM's prefix_cache_queries / prefix_cache_hits, in tokens).
        draft_version: the draft weights' version (`draft_changed`); a cached block's draft
            half is reused only when computed by this one.
    """

    def __init__(self, num_blocks: int, block_size: int, rows: int, max_blocks: int, *,
                 prefix_caching: bool = True, device: torch.device | str = "cpu",
                 table: torch.Tensor | None = None) -> None:
        """table: the [rows, max_blocks] int32 tensor to manage in place (an engine's
        KVCache.block_table, which its step graphs read); reset to the null block. Default:
        a new one on `device`."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be at least 2 (block 0 is the null block), got "
                             f"{num_blocks}")
        if block_size <= 0 or rows <= 0 or max_blocks <= 0:
            raise ValueError(f"block_size, rows and max_blocks must be positive, got "
                             f"{block_size}, {rows}, {max_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.rows = rows
        self.max_blocks = max_blocks
        self.prefix_caching = prefix_caching
        if table is not None:
            if tuple(table.shape) != (rows, max_blocks) or table.dtype != torch.int32:
                raise ValueError(f"table must be [{rows}, {max_blocks}] int32, got "
                                 f"{tuple(table.shape)} {table.dtype}")
            table.fill_(NULL_BLOCK)
            device = table.device
        device = torch.device(device)
        self.host_table = (table if table is not None and device.type == "cpu"
                           else torch.zeros((rows, max_blocks), dtype=torch.int32))
        self.table = (self.host_table if device.type == "cpu"
                      else table if table is not None
                      else torch.zeros((rows, max_blocks), dtype=torch.int32, device=device))
        self._free: list[int] = list(range(num_blocks - 1, NULL_BLOCK, -1))  # pop() -> 1, 2, ...
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}          # cached block -> its key
        self._cached: dict[bytes, int] = {}          # key -> cached block
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; evict first one
        self._draft_of: dict[int, int] = {}          # cached block -> its draft half's version
        self.draft_version = 0
        self._rows: dict[int, _Row] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._dirty = True  # the host table changed since the last `sync_table`
        self._hidden = 0  # rows [0, _hidden) are null in the device table (`sync_table`)

    # -- sizes -----------------------------------------------------------------------------

    @property
    def usable_blocks(self) -> int:
        """Blocks that can be handed out (all but the null block)."""
        return self.num_blocks - 1

    @property
    def available_blocks(self) -> int:
        """Blocks an allocation can take now: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._lru)

    def usage(self) -> float:
        """Fraction of usable blocks referenced by some row (vLLM's kv_cache_usage_perc, 0..1)."""
        return (self.usable_blocks - self.available_blocks) / self.usable_blocks

    def blocks_for(self, slots: int) -> int:
        return -(-slots // self.block_size)

    def active_rows(self) -> list[int]:
        return sorted(self._rows)

    def row_blocks(self, row: int) -> list[int]:
        return list(self._rows[row].blocks)

    def row_tokens(self, row: int) -> list[int]:
        return list(self._rows[row].tokens)

    def committed(self, row: int) -> int:
        """Tokens committed to row `row` (the cached prefix at admission included)."""
        return len(self._rows[row].tokens)

    def refs(self, block: int) -> int:
        """How many rows hold `block`."""
        return self._refs[block]

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def lru_blocks(self) -> list[int]:
        """Cached blocks nobody references, the next to be evicted first."""
        return list(self._lru)

    def cached_blocks(self) -> dict[int, bytes]:
        """Block -> key of every block in the prefix cache."""
        return dict(self._key_of)

    def draft_current(self, block: int) -> bool:
        """Whether cached block `block`'s draft half was computed by the current draft."""
        return self._draft_of.get(block) == self.draft_version

    def draft_hit(self, row: int) -> int:
        """Leading tokens of row `row`'s prefix-cache hit (`admit`'s count) whose draft k/v
        are the current draft's: the draft is prefilled from here, the target from the hit
        (equal unless the draft changed since some hit block was computed)."""
        return self._rows[row].draft_hit

    def draft_refreshed(self, row: int) -> None:
        """The caller wrote the current draft's k/v over row `row`'s whole hit (from
        `draft_hit` on, attending over the current ones before): its hit blocks' draft halves
        are current now. Nothing changes for a row admitted before the last `draft_changed`
        (its draft k/v are the old draft's)."""
        state = self._rows[row]
        if state.draft_version != self.draft_version:
            return
        for b in state.blocks[:state.hit_blocks]:
            if b in self._key_of:
                self._draft_of[b] = self.draft_version
        state.draft_hit = state.hit_blocks * self.block_size

    def draft_changed(self) -> None:
        """The draft's weights changed: the draft half of every cached block, and every
        admitted row's draft k/v, are stale from now on; the target halves stay valid. A later
        hit reuses the target's k/v and prefills the draft's again (`draft_hit`)."""
        self.draft_version += 1

    # -- admission and growth ----------------------------------------------------------------

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.rows:
            raise ValueError(f"row {row} is outside the table's {self.rows} rows")

    def _check_fits(self, slots: int) -> int:
        n = self.blocks_for(slots)
        if n > self.max_blocks:
            raise ValueError(f"{slots} slots need {n} blocks of {self.block_size}; a row holds at "
                             f"most {self.max_blocks} ({self.max_blocks * self.block_size} slots)")
        if n > self.usable_blocks:
            raise ValueError(f"{slots} slots need {n} blocks; the pool has only "
                             f"{self.usable_blocks}: the request could never run")
        return n

    def prefix_blocks(self, prompt: Sequence[int]) -> list[int]:
        """Cached blocks holding the prompt's leading full blocks, at most up to its next-to-last
        token (the last one is always computed: its logits start the generation); nothing
        changes."""
        if not self.prefix_caching:
            return []
        hits: list[int] = []
        for key in block_keys(prompt, self.block_size, (len(prompt) - 1) // self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def cached_prefix(self, prompt: Sequence[int]) -> int:
        """How many leading prompt tokens `admit` would find cached now (nothing changes)."""
        return len(self.prefix_blocks(prompt)) * self.block_size

    def admission_cost(self, prompt: Sequence[int], slots: int | None = None,
                       hits: Sequence[int] | None = None) -> int:
        """Blocks `admit` would take from the available ones now (new blocks, and cached hits
        that leave the LRU list); nothing changes. `hits`: the prompt's `prefix_blocks`, where
        the caller has them already (each is a hash per block). Raises ValueError as `admit`
        does for a request that can never fit."""
        slots = len(prompt) if slots is None else max(slots, len(prompt))
        needed = self._check_fits(slots)
        hits = self.prefix_blocks(prompt) if hits is None else hits
        return needed - len(hits) + sum(1 for b in hits if self._refs[b] == 0)

    def admit(self, row: int, prompt: Sequence[int], slots: int | None = None) -> int | None:
        """Give the empty row `row` blocks for `slots` slots (default: the prompt's length),
        sharing the cached blocks of the prompt's longest cached prefix.

        Returns how many leading prompt tokens are already in the cache (a multiple of
        block_size; prefill the rest), or None when the blocks are not available now: the
        request waits and nothing changed. Raises ValueError for a request that can never fit
        (more blocks than a row or the whole pool holds) and for a row already in use.
        """
        self._check_row(row)
        if row in self._rows:
            raise ValueError(f"row {row} is already in use")
        if len(prompt) == 0:
            raise ValueError("a prompt needs at least one token")
        slots = len(prompt) if slots is None else max(slots, len(prompt))
        needed = self._check_fits(slots)
        hits = self.prefix_blocks(prompt)
        revived = sum(1 for b in hits if self._refs[b] == 0)  # hits that leave the LRU list
        if needed - len(hits) > self.available_blocks - revived:
            return None
        if self.prefix_caching:
            self.prefix_queries += len(prompt)
            self.prefix_hits += len(hits) * self.block_size
        state = _Row()
        for b in hits:
            self._ref(b)
        state.blocks = hits + [self._take() for _ in range(needed - len(hits))]
        cached = len(hits) * self.block_size
        state.tokens = list(prompt[:cached])
        state.keys = [self._key_of[b] for b in hits]
        state.draft_version = self.draft_version
        state.hit_blocks = len(hits)
        current = 0
        while current < len(hits) and self.draft_current(hits[current]):
            current += 1
        state.draft_hit = current * self.block_size
        self._rows[row] = state
        self._write_row(row)
        return cached

    def grow(self, row: int, slots: int) -> bool:
        """Make room for `slots` slots in row `row` (e.g. its length plus a step's T new
        tokens). False when the blocks are not available now (nothing changed: preempt a row or
        wait); True when the row holds them. Raises ValueError past the row's max_blocks."""
        state = self._rows[row]
        if slots <= len(state.blocks) * self.block_size:  # (every step but a block's first)
            return True
        needed = self._check_fits(slots) - len(state.blocks)
        if needed <= 0:
            return True
        if needed > self.available_blocks:
            return False
        state.blocks.extend(self._take() for _ in range(needed))
        self._write_row(row)
        return True

    def commit(self, row: int, tokens: Sequence[int]) -> None:
        """The k/v of `tokens` are now written in row `row`'s next slots. Blocks they fill are
        keyed and cached (when a block of the same key is cached already, this one stays
        private and is freed without a key), their draft halves recorded as of the draft
        version the row was admitted with."""
        state = self._rows[row]
        if len(state.tokens) + len(tokens) > len(state.blocks) * self.block_size:
            raise ValueError(f"row {row}: {len(state.tokens) + len(tokens)} tokens committed to "
                             f"{len(state.blocks)} blocks of {self.block_size}; grow first")
        state.tokens.extend(tokens)
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(state.keys) < len(state.tokens) // bs:
            i = len(state.keys)
            parent = state.keys[-1] if state.keys else b""
            key = block_key(parent, state.tokens[i * bs:(i + 1) * bs])
            state.keys.append(key)
            block = state.blocks[i]
            if key not in self._cached:
                self._cached[key] = block
                self._key_of[block] = key
                self._draft_of[block] = state.draft_version

    # -- release ---------------------------------------------------------------------------

    def release(self, row: int) -> None:
        """The row finished or was cancelled: drop its references (tail block first), point its
        table row at the null block. Cached blocks nobody references go to the LRU list, the
        others to the free list."""
        state = self._rows.pop(row)
        for b in reversed(state.blocks):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._key_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        self.host_table[row].fill_(NULL_BLOCK)
        self._dirty = True

    def move(self, src: int, dst: int) -> None:
        """Row dst (empty) takes row src's blocks and tokens; src becomes empty. The host table
        changes (`sync_table` before the next step)."""
        self._check_row(dst)
        if dst in self._rows:
            raise ValueError(f"row {dst} is in use: release it before moving row {src} there")
        self._rows[dst] = self._rows.pop(src)
        self._write_row(dst)
        self.host_table[src].fill_(NULL_BLOCK)
        self._dirty = True

    def preempt(self, row: int) -> Preempted:
        """Free the row's blocks (as `release`) and return what requeueing it needs."""
        tokens = self.row_tokens(row)
        self.release(row)
        return Preempted(tokens)

    def reset_prefix_cache(self) -> None:
        """Forget every cached key (blocks nobody references become free)."""
        for b in self._lru:
            self._free.append(b)
        self._lru.clear()
        self._cached.clear()
        self._key_of.clear()
        self._draft_of.clear()

    # -- table -----------------------------------------------------------------------------

    def sync_table(self, hidden: int = 0) -> None:
        """Copy the host table into the device table (in place: same address), when it
        changed since the last copy; rows [0, hidden) read as null rows there (rows whose
        prompt is still being prefilled in chunks: whatever a decode step writes for them
        lands in the null block, never in their blocks). The manager's records keep those
        rows' blocks; a later `sync_table` with a smaller `hidden` shows them again. On the
        CPU, where the two tables are one tensor, hidden rows read as null in `host_table`
        too until then."""
        if self.table is self.host_table:
            for row in range(hidden, self._hidden):  # shown again
                if row in self._rows:
                    self._write_row(row)
            if hidden:
                self.host_table[:hidden].fill_(NULL_BLOCK)
        elif self._dirty or hidden != self._hidden:
            # (the scheduler syncs while steps are in flight: the copy must not wait for them)
            copy_from_host(self.table, self.host_table)
            if hidden:
                self.table[:hidden].fill_(NULL_BLOCK)
        self._hidden = hidden
        self._dirty = False

    def holds(self, row: int) -> bool:
        """Whether row `row` holds blocks (admitted and not yet released)."""
        return row in self._rows

    def slot_index(self, row: int, slot: int) -> tuple[int, int]:
        """(block, offset) of row `row`'s slot `slot`."""
        return self._rows[row].blocks[slot // self.block_size], slot % self.block_size

    # -- internals -------------------------------------------------------------------------

    def _ref(self, block: int) -> None:
        if self._refs[block] == 0:
            self._lru.pop(block, None)
        self._refs[block] += 1

    def _take(self) -> int:
        """A block with no reference for a new owner: a free one, else evict the least recently
        released cached one (its key is forgotten). The caller checked availability."""
        if self._free:
            block = self._free.pop()
        else:
            block, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(block)
            del self._cached[key]
            del self._draft_of[block]
        self._refs[block] = 1
        return block

    def _write_row(self, row: int) -> None:
        blocks = self._rows[row].blocks
        table_row = self.host_table[row]
        table_row[:len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        table_row[len(blocks):] = NULL_BLOCK
        self._dirty = True
