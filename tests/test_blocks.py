"""runtime/blocks.py: the paged KV cache's block manager, against a model of what it must keep.

A stateful hypothesis test drives admissions (with shared prompt prefixes, so prefix hits
happen), prefills, decode and speculative steps (slots written past what is committed, as a
rejected draft leaves them), finishes, cancellations and preemptions with requeueing, over a
pool small enough that waiting, preemption and LRU eviction happen often. A fake pool of token
ids stands for the k/v: every write goes through the block table, so a block handed to two
owners, or a cached block overwritten, shows up as a row reading tokens it never wrote.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from fuser.runtime.blocks import (NULL_BLOCK, BlockManager, CacheShape, block_key, block_keys,
                                  blocks_for_budget)

ROWS = 4
# Prompts open with one of a few shared "system prompts" (so prefix hits happen), then their own.
PREFIXES = [[7] * 9, list(range(20, 33)), [5, 6] * 4]


class Pool:
    """Token ids in place of k/v: pool[block, offset], written and read through the table."""

    def __init__(self, manager: BlockManager) -> None:
        self.m = manager
        self.data = np.full((manager.num_blocks, manager.block_size), -1, dtype=np.int64)

    def write(self, row: int, start: int, tokens: list[int]) -> None:
        table = self.m.host_table[row].tolist()
        bs = self.m.block_size
        for i, tok in enumerate(tokens):
            slot = start + i
            self.data[table[slot // bs], slot % bs] = tok

    def read(self, row: int, n: int) -> list[int]:
        table = self.m.host_table[row].tolist()
        bs = self.m.block_size
        return [int(self.data[table[j // bs], j % bs]) for j in range(n)]


class BlockMachine(RuleBasedStateMachine):
    """The manager and a model: rows' tokens, a pool of token ids, the expected LRU order."""

    @initialize(num_blocks=st.integers(4, 14), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.m = BlockManager(num_blocks, block_size, ROWS, max_blocks=8, prefix_caching=caching)
        self.pool = Pool(self.m)
        self.tokens: dict[int, list[int]] = {}    # committed tokens per admitted row
        self.pending: dict[int, list[int]] = {}   # admitted, prompt not yet prefilled
        self.queue: list[list[int]] = []          # preempted requests to readmit
        self.lru: list[int] = []                  # the LRU order the manager must keep
        self.known: dict[bytes, list[int]] = {}   # key -> the prefix it names
        self.requests = 0

    # -- helpers ---------------------------------------------------------------------------

    def _free_rows(self) -> list[int]:
        return [r for r in range(ROWS) if r not in self.tokens]

    def _snapshot(self):
        return (self.m.host_table.clone(), self.m.free_blocks(), self.m.lru_blocks(),
                [self.m.refs(b) for b in range(self.m.num_blocks)])

    def _unchanged(self, before) -> None:
        table, free, lru, refs = before
        assert torch.equal(table, self.m.host_table)
        assert free == self.m.free_blocks() and lru == self.m.lru_blocks()
        assert refs == [self.m.refs(b) for b in range(self.m.num_blocks)]

    def _took(self, new_blocks: int, hits: list[int], free_before: int) -> None:
        """Update the expected LRU: hits leave it, then evictions take from its front."""
        self.lru = [b for b in self.lru if b not in hits]
        del self.lru[:max(0, new_blocks - free_before)]

    def _admit(self, prompt: list[int]) -> None:
        row = self._free_rows()[0]
        if self.m.blocks_for(len(prompt)) > min(self.m.max_blocks, self.m.usable_blocks):
            with pytest.raises(ValueError, match="at most|could never run"):
                self.m.admit(row, prompt)      # could never fit: an error, not a wait
            return
        before = self._snapshot()
        free_before = len(self.m.free_blocks())
        hit = self.m.admit(row, prompt)
        if hit is None:
            self._unchanged(before)
            hits = self._expected_hits(prompt)   # waiting only when the blocks are missing
            revived = sum(1 for b in hits if self.m.refs(b) == 0)
            assert self.m.blocks_for(len(prompt)) - len(hits) > self.m.available_blocks - revived
            self.queue.append(prompt)
            return
        bs = self.m.block_size
        assert hit % bs == 0 and 0 <= hit < len(prompt)
        if not self.m.prefix_caching:
            assert hit == 0
        blocks = self.m.row_blocks(row)
        assert len(blocks) == self.m.blocks_for(len(prompt))
        # The shared blocks hold the prompt's tokens already.
        assert self.pool.read(row, hit) == prompt[:hit]
        assert blocks[:hit // bs] == self._expected_hits(prompt)
        self._took(len(blocks) - hit // bs, blocks[:hit // bs], free_before)
        self.tokens[row] = prompt[:hit]
        self.pending[row] = prompt[hit:]
        self.requests += 1

    def _expected_hits(self, prompt: list[int]) -> list[int]:
        by_key = {k: b for b, k in self.m.cached_blocks().items()}
        bs, parent, hits = self.m.block_size, b"", []
        for i in range((len(prompt) - 1) // bs):
            parent = block_key(parent, prompt[i * bs:(i + 1) * bs])
            if parent not in by_key:
                break
            hits.append(by_key[parent])
        return hits

    def _release_expect(self, row: int) -> None:
        """Blocks this row's release sends to the LRU list, in order (tail first)."""
        cached = self.m.cached_blocks()
        for b in reversed(self.m.row_blocks(row)):
            if self.m.refs(b) == 1 and b in cached:
                self.lru.append(b)

    def _record_keys(self, row: int) -> None:
        toks = self.tokens[row]
        bs = self.m.block_size
        parent = b""
        for i in range(len(toks) // bs):
            parent = block_key(parent, toks[i * bs:(i + 1) * bs])
            self.known[parent] = toks[:(i + 1) * bs]

    # -- rules -----------------------------------------------------------------------------

    @precondition(lambda self: self._free_rows())
    @rule(prefix=st.sampled_from(PREFIXES),
          own=st.lists(st.integers(0, 3), min_size=0, max_size=6))
    def admit(self, prefix: list[int], own: list[int]) -> None:
        self._admit(prefix + own + [99])

    @precondition(lambda self: self._free_rows() and self.queue)
    @rule()
    def readmit(self) -> None:
        self._admit(self.queue.pop(0))

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def prefill(self, data) -> None:
        row = data.draw(st.sampled_from(sorted(self.pending)))
        rest = self.pending.pop(row)
        self.pool.write(row, len(self.tokens[row]), rest)
        self.m.commit(row, rest)
        self.tokens[row] += rest
        self._record_keys(row)

    @precondition(lambda self: set(self.tokens) - set(self.pending))
    @rule(data=st.data(), written=st.integers(1, 4), accepted=st.integers(1, 4),
          token=st.integers(0, 3))
    def step(self, data, written: int, accepted: int, token: int) -> None:
        """A step writes `written` slots (decode: 1; verify: gamma + 1) and keeps `accepted`."""
        row = data.draw(st.sampled_from(sorted(set(self.tokens) - set(self.pending))))
        n = len(self.tokens[row])
        accepted = min(accepted, written)
        if self.m.blocks_for(n + written) > min(self.m.max_blocks, self.m.usable_blocks):
            with pytest.raises(ValueError, match="at most|could never run"):
                self.m.grow(row, n + written)  # past what a row can ever hold: an error
            return
        before = self._snapshot()
        free_before = len(self.m.free_blocks())
        had = len(self.m.row_blocks(row))
        if not self.m.grow(row, n + written):
            self._unchanged(before)
            return
        self._took(len(self.m.row_blocks(row)) - had, [], free_before)
        new = [token + 100 * (i + 1) for i in range(written)]
        self.pool.write(row, n, new)          # the rejected ones are stale, overwritten later
        self.m.commit(row, new[:accepted])
        self.tokens[row] += new[:accepted]
        self._record_keys(row)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), how=st.sampled_from(["finish", "cancel", "preempt"]))
    def end(self, data, how: str) -> None:
        row = data.draw(st.sampled_from(sorted(self.tokens)))
        self._release_expect(row)
        if how == "preempt":
            got = self.m.preempt(row)
            assert got.tokens == self.tokens[row]
            self.queue.append(got.tokens + self.pending.get(row, []))
        else:
            self.m.release(row)
        del self.tokens[row]
        self.pending.pop(row, None)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def refcounts_are_exact_and_blocks_partitioned(self) -> None:
        m = self.m
        holders: dict[int, int] = {}
        for row in self.tokens:
            blocks = m.row_blocks(row)
            assert len(set(blocks)) == len(blocks) and NULL_BLOCK not in blocks
            for b in blocks:
                holders[b] = holders.get(b, 0) + 1
        assert m.refs(NULL_BLOCK) == 0
        for b in range(1, m.num_blocks):
            assert m.refs(b) == holders.get(b, 0), b
        free, lru = set(m.free_blocks()), set(m.lru_blocks())
        assert len(free) == len(m.free_blocks()) and not free & lru and not (free | lru) & set(holders)
        assert free | lru | set(holders) == set(range(1, m.num_blocks))  # no leak
        assert lru <= set(m.cached_blocks())
        assert m.usage() == pytest.approx(len(holders) / m.usable_blocks)

    @invariant()
    def shared_blocks_are_full_cached_prefix_blocks(self) -> None:
        m = self.m
        where: dict[int, list[tuple[int, int]]] = {}
        for row in self.tokens:
            for i, b in enumerate(m.row_blocks(row)):
                where.setdefault(b, []).append((row, i))
        for b, owners in where.items():
            if len(owners) > 1:
                assert b in m.cached_blocks()
                assert len({i for _, i in owners}) == 1
                for row, i in owners:
                    assert (i + 1) * m.block_size <= len(self.tokens[row])

    @invariant()
    def rows_read_what_they_wrote(self) -> None:
        for row, toks in self.tokens.items():
            assert self.pool.read(row, len(toks)) == toks
            assert self.m.row_tokens(row) == toks

    @invariant()
    def cached_blocks_hold_their_keys_tokens(self) -> None:
        bs = self.m.block_size
        for b, key in self.m.cached_blocks().items():
            prefix = self.known[key]
            assert self.pool.data[b].tolist() == prefix[-bs:]

    @invariant()
    def table_matches_rows(self) -> None:
        for row in range(ROWS):
            blocks = self.m.row_blocks(row) if row in self.tokens else []
            expect = blocks + [NULL_BLOCK] * (self.m.max_blocks - len(blocks))
            assert self.m.host_table[row].tolist() == expect

    @invariant()
    def lru_order(self) -> None:
        assert self.m.lru_blocks() == self.lru


BlockMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestBlockMachine = BlockMachine.TestCase


def test_no_leaks_after_1000_requests_with_cancellations() -> None:
    """1,000 requests over 8 rows and a pool that runs out: random finishes, cancellations
    (mid-prefill too) and preemptions; at the end every block is free or cached, none held."""
    rng = random.Random(0)
    m = BlockManager(num_blocks=40, block_size=4, rows=8, max_blocks=16)
    lengths: dict[int, int] = {}
    started = waits = preemptions = 0
    while started < 1000 or lengths:
        free_rows = [r for r in range(8) if r not in lengths]
        if started < 1000 and free_rows and rng.random() < 0.5:
            prompt = PREFIXES[rng.randrange(3)] + [rng.randrange(50) for _ in range(rng.randrange(12))]
            hit = m.admit(free_rows[0], prompt)
            if hit is None:
                waits += 1
                continue
            started += 1
            if rng.random() < 0.1:          # cancelled before its prefill
                m.release(free_rows[0])
                continue
            m.commit(free_rows[0], prompt[hit:])
            lengths[free_rows[0]] = len(prompt)
            continue
        if not lengths:
            continue
        row = rng.choice(sorted(lengths))
        r = rng.random()
        if r < 0.08:
            m.release(row)                   # cancelled
            del lengths[row]
        elif r < 0.16 or lengths[row] + 3 > 64:
            m.release(row)                   # finished
            del lengths[row]
        elif m.grow(row, lengths[row] + 3):
            m.commit(row, [rng.randrange(50) for _ in range(2)])
            lengths[row] += 2
        else:
            victim = rng.choice(sorted(lengths))
            assert m.preempt(victim).tokens  # requeued elsewhere; its blocks are back
            del lengths[victim]
            preemptions += 1
    assert started == 1000 and waits > 0 and preemptions > 0 and m.prefix_hits > 0
    assert m.usage() == 0.0
    assert all(m.refs(b) == 0 for b in range(m.num_blocks))
    assert sorted(m.free_blocks() + m.lru_blocks()) == list(range(1, 40))
    assert (m.host_table == NULL_BLOCK).all()


def test_prefix_hit_shares_full_blocks_and_counts_tokens() -> None:
    m = BlockManager(num_blocks=10, block_size=4, rows=2, max_blocks=4)
    prompt = list(range(10))                 # 2 full blocks + 2 tokens
    assert m.admit(0, prompt) == 0
    m.commit(0, prompt)
    assert m.admit(1, prompt[:8] + [50, 51, 52]) == 8
    assert m.row_blocks(1)[:2] == m.row_blocks(0)[:2]
    assert m.row_blocks(1)[2] != m.row_blocks(0)[2]
    assert (m.prefix_queries, m.prefix_hits) == (21, 8)


def test_the_last_prompt_token_is_always_computed() -> None:
    """A prompt of exactly two cached blocks hits only the first: its last token's logits are
    needed, and a shared block is never written."""
    m = BlockManager(num_blocks=10, block_size=4, rows=2, max_blocks=4)
    prompt = list(range(8))
    m.admit(0, prompt)
    m.commit(0, prompt)
    assert m.admit(1, prompt) == 4
    m.commit(1, prompt[4:])                  # the same key: the first copy stays the cached one
    assert m.cached_blocks()[m.row_blocks(0)[1]] == block_key(block_key(b"", prompt[:4]), prompt[4:])
    assert m.row_blocks(1)[1] not in m.cached_blocks()
    m.release(1)
    assert m.row_blocks(0)[0] not in m.free_blocks()


def test_lru_evicts_the_least_recently_released_tail_first() -> None:
    m = BlockManager(num_blocks=7, block_size=2, rows=3, max_blocks=3)
    for row, base in ((0, 0), (1, 10)):
        m.admit(row, [base, base + 1, base + 2, base + 3, base + 4])   # 3 blocks, 2 full
        m.commit(row, [base, base + 1, base + 2, base + 3, base + 4])
    a, b = m.row_blocks(0), m.row_blocks(1)
    m.release(0)
    m.release(1)
    # Keyed blocks go to the LRU (row 0's tail first), the partial last blocks to the free list.
    assert m.lru_blocks() == [a[1], a[0], b[1], b[0]]
    assert set(m.free_blocks()) == {a[2], b[2]}
    assert m.admit(2, [90, 91, 92, 93, 94, 95]) == 0   # 3 blocks: 2 free, then evict a[1]
    assert m.lru_blocks() == [a[0], b[1], b[0]]
    # a[0] survived: hit (out of the LRU); the one new block evicts b[1], the next oldest.
    assert m.admit(0, [0, 1, 50]) == 2 and m.row_blocks(0) == [a[0], b[1]]
    assert m.lru_blocks() == [b[0]]


def test_waiting_changes_nothing_and_impossible_requests_raise() -> None:
    m = BlockManager(num_blocks=5, block_size=2, rows=3, max_blocks=5)
    assert m.admit(0, [1, 2, 3, 4, 5]) == 0              # 3 blocks
    assert m.admit(1, [7, 8]) == 0                       # the 4th: the whole pool
    table = m.host_table.clone()
    assert m.admit(2, [9]) is None
    assert torch.equal(table, m.host_table) and m.available_blocks == 0
    assert not m.grow(0, 7) and m.row_blocks(0) == [1, 2, 3]
    assert torch.equal(table, m.host_table)
    with pytest.raises(ValueError, match="could never run"):
        m.admit(2, list(range(9)))                       # 5 blocks: more than the pool
    with pytest.raises(ValueError, match="at most 5"):
        m.grow(0, 11)
    with pytest.raises(ValueError, match="already in use"):
        m.admit(0, [1])
    with pytest.raises(ValueError, match="grow first"):
        m.commit(0, list(range(7)))


def test_sizing_from_a_memory_budget() -> None:
    target = CacheShape(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    draft = CacheShape(layers=16, kv_heads=8, head_dim=64, dtype=torch.bfloat16)
    assert target.bytes_per_slot() == 131072            # 128 KiB per token: Llama-3-8B
    per_block = 16 * (131072 + 32768)
    assert blocks_for_budget(10 * per_block + 5, 16, [target, draft]) == 10
    assert blocks_for_budget(80 * 2**30, 16, [target]) == 80 * 2**30 // (16 * 131072)
    with pytest.raises(ValueError, match="at least 2"):
        blocks_for_budget(per_block, 16, [target, draft])


def test_device_table_keeps_its_address() -> None:
    m = BlockManager(num_blocks=6, block_size=2, rows=2, max_blocks=3, device="meta")
    ptr = m.table.data_ptr()
    m.admit(0, [1, 2, 3])
    m.sync_table()
    assert m.table.data_ptr() == ptr and m.table.shape == (2, 3) and m.table.dtype == torch.int32


def test_manages_an_engines_table_in_place() -> None:
    """Given a KVCache's block table, the manager writes that very tensor (graphs read it)."""
    from fuser.runtime.kv_cache import KVCache

    cache = KVCache.allocate(1, 2, 8, 1, 4, torch.float32, torch.device("cpu"), block_size=4)
    table = cache.block_table
    m = BlockManager(cache.k[0].shape[0], 4, rows=2, max_blocks=2, table=table)
    assert m.table is table and (table == NULL_BLOCK).all()
    m.admit(1, [1, 2, 3, 4, 5])
    assert table[1].tolist() == m.row_blocks(1) and table[0].tolist() == [0, 0]
    with pytest.raises(ValueError, match="table must be"):
        BlockManager(5, 4, rows=2, max_blocks=3, table=table)


def test_queries_change_nothing_and_rows_move_with_their_blocks() -> None:
    """cached_prefix and admission_cost foretell admit without changing anything; move hands
    a row's blocks and tokens to an empty row (the scheduler keeps its rows packed)."""
    m = BlockManager(num_blocks=8, block_size=2, rows=3, max_blocks=4)
    prompt = [1, 2, 3, 4, 5]
    m.admit(0, prompt)
    m.commit(0, prompt)
    m.release(0)                                          # 2 keyed blocks in the LRU, 1 free
    table, lru = m.host_table.clone(), m.lru_blocks()
    other = [1, 2, 3, 4, 9, 9, 9]
    assert m.cached_prefix(other) == 4 and m.cached_prefix([7, 7, 7]) == 0
    assert m.admission_cost(other) == 4                   # 4 blocks, 2 of them revived hits
    assert m.admission_cost(other, slots=3) == 4          # (slots below the prompt: the prompt)
    assert (m.prefix_queries, m.prefix_hits) == (5, 0)
    assert torch.equal(table, m.host_table) and m.lru_blocks() == lru
    assert m.admit(2, other) == 4 and m.available_blocks == 7 - 4
    assert m.committed(2) == 4
    blocks = m.row_blocks(2)
    m.move(2, 0)
    assert m.row_blocks(0) == blocks and m.committed(0) == 4 and m.active_rows() == [0]
    assert m.host_table[0].tolist() == blocks and m.host_table[2].tolist() == [0] * 4
    m.admit(1, [6])
    with pytest.raises(ValueError, match="in use"):
        m.move(0, 1)
    with pytest.raises(ValueError, match="at most 4"):
        m.admission_cost(list(range(9)))


def test_sync_copies_only_a_changed_table() -> None:
    m = BlockManager(num_blocks=6, block_size=2, rows=2, max_blocks=3, device="meta")
    m.sync_table()
    copies = []
    m.table = type("Spy", (), {"device": torch.device("meta"),
                               "copy_": lambda self, *a, **k: copies.append(1)})()
    m.sync_table()
    assert copies == []                                   # nothing changed since
    m.admit(0, [1, 2, 3])
    m.sync_table()
    m.sync_table()
    assert copies == [1]
    m.move(0, 1)
    m.sync_table()
    assert copies == [1, 1]


def test_hidden_rows_read_as_null_on_the_device_until_shown() -> None:
    """sync_table(hidden=k): rows [0, k) are null rows in the device table (a group in chunked
    prefill, which decode steps must not write), the manager's records unchanged; a later sync
    with fewer hidden rows shows them again, even when they grew meanwhile. Both layouts: the
    CPU's one table, and a device table of its own (here a second CPU tensor)."""
    for separate in (False, True):
        m = BlockManager(num_blocks=10, block_size=2, rows=3, max_blocks=4)
        if separate:
            m.host_table = m.table.clone()
        m.admit(0, [1, 2, 3])
        m.admit(1, [4, 5, 6, 7])
        first, second = m.row_blocks(0), m.row_blocks(1)
        m.sync_table(hidden=1)
        assert m.table[0].tolist() == [0] * 4 and m.table[1].tolist() == second + [0, 0]
        assert m.grow(0, 6)
        m.sync_table(hidden=1)
        grown = m.row_blocks(0)
        assert grown[:2] == first and len(grown) == 3 and m.committed(0) == 0
        assert m.table[0].tolist() == [0] * 4
        m.sync_table()
        assert m.table[0].tolist() == grown + [0] and m.table[1].tolist() == second + [0, 0]


def test_a_draft_change_keeps_the_targets_half_of_cached_blocks_only() -> None:
    """After `draft_changed`, a hit still shares the cached blocks (the target's k/v) but its
    draft hit is 0 until the caller refreshes the draft's k/v there; blocks a row admitted
    before the change fills afterwards hold the old draft's k/v: never current."""
    m = BlockManager(num_blocks=16, block_size=4, rows=3, max_blocks=4)
    prompt = list(range(10))                 # 2 full blocks + 2 tokens
    assert m.admit(0, prompt) == 0 and m.draft_hit(0) == 0
    m.commit(0, prompt)
    assert m.admit(1, prompt[:8] + [50, 51]) == 8 and m.draft_hit(1) == 8
    m.release(1)
    m.draft_changed()                        # row 0 runs on with the old draft's k/v
    assert not any(m.draft_current(b) for b in m.cached_blocks())
    assert m.admit(1, prompt[:8] + [60]) == 8 and m.draft_hit(1) == 0
    assert m.row_blocks(1)[:2] == m.row_blocks(0)[:2]  # the target's half is shared as before
    m.draft_refreshed(1)                     # the caller prefilled the draft over [0, 8)
    assert m.draft_hit(1) == 8 and all(m.draft_current(b) for b in m.row_blocks(1)[:2])
    assert m.grow(0, 16)
    m.commit(0, [70, 71, 72, 73, 74, 75])    # row 0 fills its third block: old draft k/v
    third = m.row_blocks(0)[2]
    assert third in m.cached_blocks() and not m.draft_current(third)
    assert m.admit(2, prompt + [70, 71, 72, 73, 74]) == 12 and m.draft_hit(2) == 8
    m.draft_refreshed(0)                     # (a row from before the change: nothing moves)
    assert not m.draft_current(third)
    m.release(2)
    m.reset_prefix_cache()
    assert m.admit(2, prompt) == 0 and m.draft_hit(2) == 0


@settings(max_examples=50, deadline=None, derandomize=True)
@given(tokens=st.lists(st.integers(0, 2**31), max_size=70), block_size=st.integers(1, 9),
       data=st.data())
def test_block_keys_chain_block_key(tokens: list[int], block_size: int, data) -> None:
    """`block_keys` (the prompt made bytes once) yields what chaining `block_key` block by
    block gives, for any count of full blocks."""
    count = data.draw(st.integers(0, len(tokens) // block_size))
    expected, parent = [], b""
    for i in range(count):
        parent = block_key(parent, tokens[i * block_size:(i + 1) * block_size])
        expected.append(parent)
    assert list(block_keys(tokens, block_size, count)) == expected
