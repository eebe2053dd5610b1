"""The suffix index's batched path (runtime/suffix_index.py `SuffixIndex.propose_many` /
`lookup_many`, with `extend` indexing lazily, all rows at once): on random token streams of
several requests extended by different numbers of tokens a step, finished into the pool
in between, every row's proposal equals a brute-force search's; also where every array
starts tiny (the token rows widen, the rows and the hash table double, the pool's store
moves), where the table never grows (full buckets go to the stash) and where it grows only
once full (stashed keys move into the larger table). And
`SuffixProposals.load` fills its buffer as a row-by-row copy does."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.runtime import native as native_code
from fuser.runtime.suffix import Proposal, SuffixIndex, SuffixProposals
from fuser.runtime.suffix_index import _WAYS, _Table

# The index's tests run on both of its implementations: the compiled core (where a C compiler
# is found and FUSER_NATIVE=0 does not turn it off) and numpy.
_NO_NATIVE = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None) or not native_code.enabled(),
    reason="no C compiler, or FUSER_NATIVE=0")
impls = pytest.mark.parametrize("native", [pytest.param(True, marks=_NO_NATIVE), False],
                                ids=["native", "numpy"])


def _brute(seq: list[int], pool: list[list[int]], max_tokens: int, lo: int, hi: int
           ) -> Proposal:
    """The longest suffix (lo..hi) that occurred earlier in seq (own, wins a tie) or in a
    pooled output (the latest occurrence), and what followed it."""
    def ends(s: list[int], gram: list[int], before: int) -> list[int]:
        n = len(gram)
        return [p for p in range(n - 1, before) if s[p - n + 1:p + 1] == gram]

    if max_tokens < 1:
        return Proposal([], "", 0)
    for n in range(min(hi, len(seq)), lo - 1, -1):
        gram = seq[len(seq) - n:]
        own = ends(seq, gram, len(seq) - 1)
        if own:
            copied = list(seq)
            for j in range(max_tokens):
                copied.append(copied[own[-1] + 1 + j])
            return Proposal(copied[len(seq):], "own", n)
        recent = [(s, p) for s, out in enumerate(pool) for p in ends(out, gram, len(out) - 1)]
        if recent:
            s, p = max(recent)
            return Proposal(pool[s][p + 1:p + 1 + max_tokens], "recent", n)
    return Proposal([], "", 0)


@impls
@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.integers(2, 5), st.integers(1, 5), st.integers(0, 7), st.integers(1, 3),
       st.integers(1, 4),
       st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=4), st.integers(0, 4)),
                min_size=1, max_size=40))
def test_batched_proposals_equal_a_brute_force_search(native, rows, max_ngram, max_tokens,
                                                       min_match, max_recent, steps):
    """Each step extends every live row by a count of tokens (0..4), then looks up all
    rows at once; a row is finished into the pool now and then and a new one takes its
    place."""
    lo = 1 if max_ngram == 1 else 2
    index = SuffixIndex(max_ngram=max_ngram, min_ngram=lo, max_recent=max_recent,
                        native=native)
    seqs: dict[int, list[int]] = {}
    prompts: dict[int, int] = {}
    pool: list[list[int]] = []
    next_id = 0
    for tokens, action in steps:
        while len(seqs) < rows:
            prompt = [(next_id + i) % 3 for i in range(2 * (next_id % 4))]  # 0..6 tokens
            index.add_request(next_id, prompt)
            seqs[next_id], prompts[next_id] = list(prompt), len(prompt)
            next_id += 1
        for k, r in enumerate(seqs):
            # rows emit different counts (odd actions) or the same (even ones)
            new = tokens[:(k + action) % 5] if action % 2 else tokens[:action]
            index.extend(r, new)
            seqs[r] += new
        ids = list(seqs)
        want = [_brute(seqs[r], pool, max_tokens, lo, max_ngram) for r in ids]
        assert index.lookup_many(ids, max_tokens) == want
        assert index.propose_many(ids, max_tokens, min_match) == \
            [w.tokens if w.match >= min_match else [] for w in want]
        tokens, counts = index.propose_arrays(ids, max_tokens, min_match)
        assert tokens.shape == (len(ids), max_tokens) and counts.shape == (len(ids),)
        assert [t[:c] for t, c in zip(tokens.tolist(), counts.tolist())] == \
            [w.tokens if w.match >= min_match else [] for w in want]
        assert [index.lookup(r, max_tokens) for r in ids] == want
        if action == 0:  # the oldest row finishes into the pool
            r = ids[0]
            index.finish(r)
            output = seqs.pop(r)[prompts[r]:]
            if len(output) >= 2:
                pool = (pool + [output])[-max_recent:]
        elif action == 4:  # the newest row is dropped
            index.drop(ids[-1])
            del seqs[ids[-1]]


class _SmallTable(_Table):
    first_bits = 1  # 2 buckets of 8 ways: doubles many times


class _SmallIndex(SuffixIndex):
    _native_bits = 1  # (the native table: 2 places at first)
    _first_slots = 1
    _first_room = 2
    _first_arena = 16
    _first_store = 2
    _table_type = _SmallTable


class _FullTable(_Table):
    first_bits = 1
    max_load = 64.0  # never grows: past 16 keys, every new key goes to the stash


class _StashIndex(_SmallIndex):
    _table_type = _FullTable


class _CrowdedTable(_Table):
    first_bits = 1
    max_load = 1.0  # grows only when full: buckets fill up first, keys go to the stash


class _CrowdedIndex(_SmallIndex):
    _table_type = _CrowdedTable


@impls
@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from([_SmallIndex, _StashIndex, _CrowdedIndex]), st.integers(0, 2**32 - 1),
       st.integers(1, 6), st.integers(2, 5), st.integers(1, 4), st.integers(2, 12),
       st.integers(1, 20))
def test_growth_and_the_stash_keep_the_proposals_of_a_brute_force_search(
        native, kind, seed, rows, max_ngram, vocab, max_recent, recent_tokens):
    """60 steps of rows extended by 0..4 random tokens over a small vocabulary (long
    repeats), finished or dropped now and then, a pool bounded in outputs and tokens: every
    lookup equals the brute force's."""
    rng = random.Random(seed)
    lo = 2
    index = kind(max_ngram=max_ngram, min_ngram=lo, max_recent=max_recent,
                 max_recent_tokens=recent_tokens, native=native)
    seqs: dict[int, list[int]] = {}
    prompts: dict[int, int] = {}
    pool: list[list[int]] = []
    next_id = 0
    for _ in range(60):
        while len(seqs) < rows:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(12))]
            index.add_request(next_id, prompt)
            seqs[next_id], prompts[next_id] = list(prompt), len(prompt)
            next_id += 1
        for r in seqs:
            new = [rng.randrange(vocab) for _ in range(rng.randrange(5))]
            index.extend(r, new)
            seqs[r] += new
        ids = list(seqs)
        rng.shuffle(ids)
        max_tokens = rng.randrange(1, 9)
        assert index.lookup_many(ids, max_tokens) == \
            [_brute(seqs[r], pool, max_tokens, lo, max_ngram) for r in ids]
        action = rng.randrange(8)
        if action == 0:  # a row finishes into the pool (its last recent_tokens tokens)
            r = ids[0]
            index.finish(r)
            output = seqs.pop(r)[prompts[r]:][-recent_tokens:]
            if len(output) >= 2:
                pool.append(output)
                while len(pool) > max_recent or sum(map(len, pool)) > recent_tokens:
                    pool.pop(0)
        elif action == 1:
            index.drop(ids[0])
            del seqs[ids[0]]
    for r in list(seqs):
        assert index.tokens(r) == seqs[r]


def _load_row_by_row(buffer: SuffixProposals, proposals, anchors) -> torch.Tensor:
    """What `load` puts in the buffer, one row at a time."""
    B, K = buffer.buffer.shape
    host = torch.zeros(B, K + 2, dtype=torch.long)
    host[:, K + 1] = -1
    for b, row in enumerate(proposals):
        row = list(row)[:K]
        host[b, :len(row)] = torch.tensor(row, dtype=torch.long)
        host[b, K] = len(row)
        if anchors is not None:
            host[b, K + 1] = anchors[b]
    return host


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 9), st.integers(1, 4),
       st.lists(st.lists(st.integers(0, 99), max_size=20), max_size=9), st.booleans())
def test_load_fills_the_buffer_as_a_row_by_row_copy(batch, gamma, proposals, anchored):
    proposals = proposals[:batch]
    anchors = [7 * b + 1 for b in range(len(proposals))] if anchored else None
    buffer = SuffixProposals(batch, gamma, torch.device("cpu"))
    buffer.packed.fill_(5)  # (what an earlier load left)
    buffer.load(proposals, anchors=anchors)
    assert torch.equal(buffer.packed, _load_row_by_row(buffer, proposals, anchors))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(1, 9), st.integers(1, 4),
       st.lists(st.lists(st.integers(0, 99), max_size=20), max_size=9), st.booleans(),
       st.integers(0, 3))
def test_load_arrays_fills_the_buffer_as_load_does(batch, gamma, proposals, anchored, spare):
    """`load_arrays` (SuffixIndex.propose_arrays' form: padded tokens and counts, whatever
    lies past a row's count) puts in the buffer what `load` puts for the same lists."""
    proposals = proposals[:batch]
    anchors = [7 * b + 1 for b in range(len(proposals))] if anchored else None
    width = max(map(len, proposals), default=0) + spare  # wider or narrower than the buffer
    tokens = np.full((len(proposals), width), 77, np.int64)  # (77: what lies past a count)
    for b, row in enumerate(proposals):
        tokens[b, :len(row)] = row
    counts = np.array([len(row) for row in proposals], np.int64)
    want = SuffixProposals(batch, gamma, torch.device("cpu"))
    want.packed.fill_(5)  # (what an earlier load left)
    want.load(proposals, anchors=anchors)
    got = SuffixProposals(batch, gamma, torch.device("cpu"))
    got.packed.fill_(5)
    got.load_arrays(tokens, counts, anchors=anchors)
    assert torch.equal(got.packed, want.packed)


@impls
@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.integers(2, 8), st.integers(1, 4))
def test_an_index_from_the_least_match_proposes_alike(native, seed, min_match, vocab):
    """What the adaptive scheduler builds: indexing only n >= min_match (its suffix_min_match)
    proposes, at that least match, what the default index (n >= 2) does."""
    rng = random.Random(seed)
    full = SuffixIndex(max_recent=3, native=native)
    narrow = SuffixIndex(min_ngram=min_match, max_recent=3, native=native)
    live: list[int] = []
    for step in range(40):
        while len(live) < 4:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(10))]
            full.add_request(step * 10 + len(live), prompt)
            narrow.add_request(step * 10 + len(live), prompt)
            live.append(step * 10 + len(live))
        for r in live:
            new = [rng.randrange(vocab) for _ in range(rng.randrange(4))]
            full.extend(r, new)
            narrow.extend(r, new)
        width = rng.randrange(1, 9)
        assert narrow.propose_many(live, width, min_match) == \
            full.propose_many(live, width, min_match)
        if rng.random() < 0.2:
            r = live.pop(0)
            full.finish(r)
            narrow.finish(r)


@impls
@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.integers(1, 3), st.sampled_from([SuffixIndex, _SmallIndex]))
def test_dropped_requests_leave_no_key_behind(native, seed, min_match, kind):
    """Requests of any prompt length (0..20 tokens), extended by equal or different counts a
    step (flush's grid and ragged ways), then dropped: the table holds nothing at the end,
    so every key a flush inserted is one its request's removal finds; and it is back to its
    first size."""
    rng = random.Random(seed)
    index = kind(max_ngram=5, min_ngram=min(min_match + 1, 5), native=native)
    live: list[int] = []
    for step in range(30):
        while len(live) < 4:
            rid = step * 10 + len(live)
            index.add_request(rid, [rng.randrange(4) for _ in range(rng.randrange(21))])
            live.append(rid)
        if step % 3:  # the new prompts flushed on their own (rows with no tokens before)
            index.propose_arrays(live, 4, min_match)
        same = rng.randrange(1, 5)
        for r in live:
            index.extend(r, [rng.randrange(4) for _ in range(
                same if step % 2 else rng.randrange(5))])
        index.propose_arrays(live, 4, min_match)
        if rng.random() < 0.3:
            index.drop(live.pop(0))
    for r in live:
        index.drop(r)
    if native:  # (and the table shrank back to its first size)
        core = index._native
        assert core.count == 0 and not core.table.any()
        assert len(core.table) == 2 << kind._native_bits
        return
    table = index._table
    assert np.count_nonzero(table.rows[:, :_WAYS]) == 0 and not table.stash
    assert table.bits == table.first_bits  # (shrunk back after the growth)


@impls
@settings(max_examples=30, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.integers(4, 40))
def test_a_request_pooled_without_indexing_proposes_as_one_indexed_then_finished(
        native, seed, keep_prompts, max_recent_tokens):
    """`pool_finished(prompt, output)` (a request the index never held) leaves the pool as
    `add_request(prompt)`, `extend(output)` and `finish` do: the same recent outputs, the same
    pooled keys, and the same proposals for live requests after it (the evictions too: a
    small max_recent_tokens)."""
    rng = random.Random(seed)
    options = dict(max_ngram=5, min_ngram=2, native=native, keep_prompts=keep_prompts,
                   max_recent=3, max_recent_tokens=max_recent_tokens)
    indexed, pooled = SuffixIndex(**options), SuffixIndex(**options)
    live = [[rng.randrange(5) for _ in range(rng.randrange(2, 12))] for _ in range(3)]
    for r, prompt in enumerate(live):
        for index in (indexed, pooled):
            index.add_request(("live", r), prompt)
    for f in range(6):
        prompt = [rng.randrange(5) for _ in range(rng.randrange(0, 10))]
        output = [rng.randrange(5) for _ in range(rng.randrange(0, 14))]
        indexed.add_request(f, prompt)
        indexed.extend(f, output)
        indexed.finish(f)
        pooled.pool_finished(prompt, output)
        assert (indexed.recent_sequences, indexed.recent_tokens, indexed.pool_entries) == \
            (pooled.recent_sequences, pooled.recent_tokens, pooled.pool_entries)
        ids = [("live", r) for r in range(len(live))]
        for a, b in zip(indexed.propose_arrays(ids, 6, 2), pooled.propose_arrays(ids, 6, 2)):
            assert np.array_equal(a, b)
        for r in range(len(live)):
            new = [rng.randrange(5) for _ in range(rng.randrange(1, 3))]
            for index in (indexed, pooled):
                index.extend(("live", r), new)
