"""The suffix index: per request, the tokens that followed the longest earlier occurrence of its
suffix, for every row of a decoding step in a few dozen numpy calls (runtime/suffix.py verifies
what it proposes; benchmarks/suffix_index.py measures its host time).

What it finds (prompt-lookup decoding; suffix-tree decoding, Oliaro et al., "SuffixDecoding",
with a hash table in place of the tree): the longest suffix of min_ngram..max_ngram tokens of a
request (prompt and output) that occurred before, in the request itself (own context) or in a
recent finished output (the pool), and what followed its latest occurrence:

    own context:   a match ending at p continues with tokens[p + 1], tokens[p + 2], ...; past
                   the end it copies its own output (the span repeats with period len - 1 - p,
                   as LZ77 copies overlap), so a repeating pattern proposes max_tokens tokens;
    recent outputs: finished requests' outputs (their prompts too with keep_prompts); the
                   oldest is evicted beyond max_recent sequences or max_recent_tokens tokens;
                   a match proposes what followed it in that output, up to its end.
The longer match wins; on a tie the request's own context. Latest: the highest position in
the request; in the pool, the newest output, then the highest position in it.

How. Every n-gram (n = min_ngram..max_ngram) that ends at a position with a next token is a
64-bit key in one table, mapped to where it ended: own n-grams (keys salted per request) to
their end position in the request, pooled ones to their place in the pool's token store. A
key keeps its latest end (ends only grow: latest = largest). The keys are polynomial hashes,
g_n(e) = MIX * sum_{i<n} (t_{e-i} + 1) BASE^i mod 2**64: the window of max_ngram tokens ending
at e times the powers, cumulative-summed, gives every n at once. A hit is trusted as it is:
two different n-grams share a key with probability ~2**-64 (and a wrong proposal would only
be rejected by the target, as any other).

The table (`_Table`) is numpy: buckets of 8 keys, one 64-byte line each, probed for a whole
batch of keys with one gather and one compare; a key whose bucket is full goes to a small dict
(the stash). Finished requests' own keys and evicted outputs' pooled keys are removed, so
every value points at live tokens.

A step's host work (the adaptive scheduler's): `extend` per row only appends to lists; the
lookup (`propose_many`) first indexes every row's new tokens at once (`flush`: write them
into the token rows, hash the windows ending before each of them and at each row's last
token, insert the former's keys, keep the latter's), then probes, for every row at once, the
suffix's own and pooled keys at the longest and the shortest length. A suffix that never
occurred has no longer one that did, so that settles most rows (no match, or the longest);
the lengths between are probed only for rows that matched the shortest and not the longest.
The proposals are one gather from the token rows (own matches, with their period) or the
pool's store.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

__all__ = ["Proposal", "SuffixIndex"]

# Hashes wrap at 64 bits (uint64 arithmetic).
_BASE = np.uint64(1_000_003)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # hashes come times MIX: a key's top bits are its bucket
_POOL = np.uint64(0x5851F42D4C957F2D)  # pooled keys' salt (each request has its own)
_POOLED = 1 << 62  # a pooled key's value: this plus its global offset (own ones: positions)
_GUARD = np.uint64(0xD6E8FEB86659FD93)  # the digit before a first token (no token +1; odd, so
                                      # that its multiples reach the low bits)
_WAYS = 8  # keys a bucket holds: 8 uint64, one cache line
_ONE = np.uint64(1)
_GATHER = np.uint64(0x0102040810204080)  # `_lowest_way`
_FIRST = np.array([_WAYS] + [(m & -m).bit_length() - 1 for m in range(1, 256)],
                  np.intp)  # [256] a mask of ways -> its lowest (_WAYS: none)


@dataclass(frozen=True)
class Proposal:
    """What `SuffixIndex.lookup` found: the proposed tokens, where ("own", "recent" or "" for
    nothing) and the matched suffix's length."""

    tokens: list[int]
    source: str
    match: int


@dataclass
class _Request:
    slot: int  # its row of SuffixIndex's per-request arrays
    prompt_length: int


def _lowest_way(words: np.ndarray) -> np.ndarray:
    """words: uint64, each the 8 bool bytes of a bucket's ways -> the index of its lowest
    nonzero byte (_WAYS for none): times _GATHER, byte w's bit lands at bit 56 + w (the top
    byte: a mask of the ways), read as a signed byte (-128..127 indexes _FIRST from both
    ends)."""
    return np.take(_FIRST, (words * _GATHER).view(np.int64) >> 56)


class _Table:
    """A hash table of uint64 keys (0: empty; a hash is 0 with probability 2**-64) to int64
    values (-1: none), read and written a batch of keys at a time: `nb` buckets of _WAYS keys
    (a row of `keys`, one cache line) and their values (a row of `values`, and a -1 after
    them: what a miss reads); a key lives in bucket key >> (64 - bits) (keys come mixed),
    or, where that bucket was full when it came, in the stash (a dict) with the bucket
    flagged. A batch's lookup is one gather of its buckets and one compare; the bytes of a
    bucket's compare, read as one uint64, say whether and where (`_lowest_way`).

    Values only grow: a key inserted again (or twice in one batch) keeps the largest value,
    and a value inserted for a held key must not be smaller than the held one. A key is in
    its bucket or in the stash, never both (a stashed key that finds room in its bucket
    moves there).

    `count` counts the keys held; a key inserted twice in one batch is counted twice (an
    upper bound, made exact whenever it crosses max_load; the table doubles only where the
    exact count is past half of that)."""

    max_load = 0.25  # keys per way where the count is checked
    first_bits = 12  # 2**12 buckets at first

    def __init__(self) -> None:
        self._reset(self.first_bits)

    def _reset(self, bits: int) -> None:
        self.bits = bits
        self.shift = np.uint64(64 - bits)
        self.keys = np.zeros((1 << bits, _WAYS), np.uint64)  # [nb, W]
        self.flat_keys = self.keys.reshape(-1)  # [nb * W] a view: key w of b at W b + w
        self.values = np.full((_WAYS + 1) << bits, -1, np.int64)  # [nb * (W + 1)] its value
        self.flagged = np.zeros(1 << bits, bool)  # [nb] some key of the bucket is stashed
        self.stash: dict[int, int] = {}
        self.count = 0

    def bucket(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> self.shift).view(np.int64)

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The values of `keys` (any shape), -1 where absent."""
        b = self.bucket(keys)
        hit = (np.take(self.keys, b, axis=0) == keys[..., None]).view(np.uint64)[..., 0]
        values = np.take(self.values, b * (_WAYS + 1) + _lowest_way(hit))  # a miss: way W
        if self.stash:  # a miss in a flagged bucket may be stashed
            maybe = (values < 0) & self.flagged[b]
            if maybe.any():
                get = self.stash.get
                values[maybe] = [get(k, -1) for k in keys[maybe].tolist()]
        return values

    def insert(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Insert keys [m] -> values [m] (class docstring: values only grow); -> how many
        keys were not held (exact for distinct keys)."""
        if self.count + len(keys) > self.max_load * self.keys.size:
            self.count = int(np.count_nonzero(self.keys)) + len(self.stash)
            if self.count + len(keys) > self.max_load / 2 * self.keys.size:
                self._grow(self.count + len(keys))
        b = self.bucket(keys)
        rows = np.take(self.keys, b, axis=0)  # [m, W]
        mine = (rows == keys[:, None]).view(np.uint64)[:, 0]  # [m] the way holding it
        held = mine != 0
        way = _lowest_way(np.where(held, mine, (rows == 0).view(np.uint64)[:, 0]))
        new = 0
        full = way == _WAYS
        if full.any():  # no way holds it and none is free: to the stash
            room = ~full
            new += self._stash(keys[full], values[full], b[full])
            keys, values, b, way, held = keys[room], values[room], b[room], way[room], held[room]
        at = b * _WAYS + way  # [m] its way, or the first free one
        self.flat_keys[at] = keys  # new keys claim it; one wins where several claim a way
        won = np.take(self.flat_keys, at) == keys
        lost = None
        if not won.all():  # (a held key always wins)
            lost = ~won
            lost = keys[lost], values[lost]
            keys, values, b, at, held = keys[won], values[won], b[won], at[won], held[won]
        at += b  # its value
        self.values[at] = values  # a key twice in the batch: either value may land,
        short = np.take(self.values, at) < values  # so the larger is put back
        if short.any():
            np.maximum.at(self.values, at[short], values[short])
        new += len(keys) - int(np.count_nonzero(held))
        if self.stash:  # a stashed key that found room in its bucket leaves the stash
            moved = ~held & self.flagged[b]
            if moved.any():
                new -= self._unstash(keys[moved])
        self.count += new
        if lost is not None:  # a free way went to another key: the next one (few)
            new += self._insert_one_by_one(*lost) if len(lost[0]) <= 8 else \
                self.insert(*lost)
        return new

    def _insert_one_by_one(self, keys: np.ndarray, values: np.ndarray) -> int:
        """`insert` for a few keys, in Python."""
        new = 0
        flat_keys, flat_values, stash = self.flat_keys, self.values, self.stash
        for key, value, b in zip(keys.tolist(), values.tolist(), self.bucket(keys).tolist()):
            row = flat_keys[b * _WAYS:(b + 1) * _WAYS].tolist()
            if key in row:
                at = b * (_WAYS + 1) + row.index(key)
                flat_values[at] = max(int(flat_values[at]), value)
            elif 0 in row:
                way = row.index(0)
                flat_keys[b * _WAYS + way] = key
                flat_values[b * (_WAYS + 1) + way] = value
                new += 1 - self._unstash(np.array([key], np.uint64))
            else:
                self.flagged[b] = True
                new += key not in stash
                stash[key] = max(stash.get(key, value), value)
        self.count += new
        return new

    def _unstash(self, keys: np.ndarray) -> int:
        """Drop `keys` from the stash (a bucket holds them now); -> how many it held."""
        stash = self.stash
        dropped = sum(stash.pop(k, None) is not None for k in keys.tolist())
        if not stash:
            self.flagged[:] = False
        return dropped

    def _stash(self, keys: np.ndarray, values: np.ndarray, b: np.ndarray) -> int:
        self.flagged[b] = True
        stash, new = self.stash, 0
        for k, v in zip(keys.tolist(), values.tolist()):
            old = stash.get(k)
            if old is None:
                new += 1
                stash[k] = v
            elif v > old:
                stash[k] = v
        return new

    def remove(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Remove each key [m] where its held value is values [m] (distinct pairs: a held
        key is matched by one pair at most); -> how many were held."""
        if not len(keys):
            return 0
        b = self.bucket(keys)
        hit = (np.take(self.keys, b, axis=0) == keys[:, None]).view(np.uint64)[:, 0]
        way = _lowest_way(hit)  # [m] W where absent: the -1 after the bucket's values
        at = b * (_WAYS + 1) + way  # [m] its value
        held = np.take(self.values, at) == values
        at = at[held]
        self.values[at] = -1
        self.flat_keys[at - b[held]] = 0
        removed = len(at)
        if self.stash:
            stash = self.stash
            maybe = ~held & self.flagged[b]
            for k, v in zip(keys[maybe].tolist(), values[maybe].tolist()):
                if stash.get(k) == v:
                    del stash[k]
                    removed += 1
            if not stash:
                self.flagged[:] = False
        self.count -= removed
        return removed

    def _grow(self, needed: int) -> None:
        """Double until `needed` keys fill under half of max_load, and insert what is held
        again."""
        bits = self.bits
        while needed > self.max_load / 2 * (_WAYS << bits):
            bits += 1
        held = self.keys != 0  # [nb, W]
        keys = self.keys[held]
        values = self.values.reshape(-1, _WAYS + 1)[:, :_WAYS][held]
        stash = self.stash
        if stash:
            keys = np.concatenate([keys, np.fromiter(stash.keys(), np.uint64, len(stash))])
            values = np.concatenate([values, np.fromiter(stash.values(), np.int64, len(stash))])
        self._reset(bits)
        self.insert(keys, values)


class SuffixIndex:
    """Proposals from the longest earlier occurrence of a request's suffix (module docstring).

    The layout:
        _arena   uint64: every request's tokens + 1, each in a region of its own (G =
                 max_ngram digits of _GUARD, then room for _room[slot] tokens: a window never
                 leaves the region); a region that fills up moves to a twice larger one, and
                 the arena is packed when it runs out. Per request (slot): _len its token
                 count, _end where in _arena its next token goes, _salts its own keys' salt
                 (_salt2 [slots, 2]: that, and _POOL);
        _probe   uint64 [slots, 2L]: the table keys of its suffix, own then pooled, each
                 n = max_ngram .. min_ngram (L lengths);
        _store   uint64: the pool's tokens + 1, outputs one after another (a global offset g
                 is _store[g - _base]); _ends int64 alike: the end (exclusive) of the output
                 that token is in;
        _table   own keys (hash ^ the request's salt) -> the n-gram's end position in the
                 request; pooled keys (hash ^ _POOL) -> _POOLED + its global offset in the
                 store.
    `extend` only appends to a list; the next lookup (or finish) indexes every request's new
    tokens at once (`flush`). `propose_many` looks up all rows of a step at once: first the
    longest and the shortest length of each kind (a suffix that never occurred has no longer
    one that did, so most rows are settled there: no match, or the longest), then the
    lengths between for the rows that matched the shortest but not the longest; after a
    lookup where some row needed those, the next one probes every length at once (a second
    probe costs more than the wider first one).

    Args:
        max_ngram: the longest suffix matched (and indexed): memory and time per token grow
            with max_ngram - min_ngram + 1.
        min_ngram: the shortest match that proposes anything (1-token matches are mostly
            noise).
        max_recent: finished sequences kept in the recent pool.
        max_recent_tokens: tokens kept in the recent pool, all sequences together.
        keep_prompts: pool a finished request's prompt with its output (default: the output).
    """

    _first_slots = 8  # per-request arrays' rows at first (doubled as requests come)
    _first_room = 1024  # tokens a request's region holds at first (at least twice its prompt)
    _first_arena = 1 << 16  # the arena at first (doubled as needed)
    _first_store = 1024  # the pool's store at first (tokens; doubled as needed)
    _table_type = _Table

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2, max_recent: int = 256,
                 max_recent_tokens: int = 1 << 18, keep_prompts: bool = False) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram),
                            ("max_recent", max_recent), ("max_recent_tokens", max_recent_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} must be <= max_ngram={max_ngram}")
        if max_recent_tokens >= 1 << 32:
            raise ValueError(f"max_recent_tokens={max_recent_tokens} must be < 2**32")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_recent, self.max_recent_tokens = max_recent, max_recent_tokens
        self.keep_prompts = keep_prompts
        G, L = max_ngram, max_ngram - min_ngram + 1
        self._G, self._L = G, L
        self._powers = _BASE ** np.arange(G, dtype=np.uint64) * _MIX  # [G] BASE^i MIX
        self._back = np.arange(G)  # [G] a window's offsets back from its end
        self._lengths = np.arange(min_ngram, max_ngram + 1)  # [L] the indexed n, ascending
        # _probe's columns: own n = max..min, then pooled n = max..min; a hit's score 2n + own.
        descending = self._lengths[::-1]
        self._score = np.concatenate([2 * descending + 1, 2 * descending])  # [2L]
        ends = [0, L - 1, L, 2 * L - 1] if L > 1 else [0, 1]  # the first probe: max and min
        self._first = np.array(sorted(set(ends)), np.intp)
        self._between = np.array([c for c in range(2 * L) if c not in ends], np.intp)
        self._all = np.arange(2 * L)
        self._wide = False  # some row of the last lookup was between: every length at once
        self._requests: dict[Hashable, _Request] = {}
        self._arena = np.full(self._first_arena, _GUARD, np.uint64)
        self._top = self._held = 0  # the arena's first unused place; places in live regions
        self._len = np.zeros(self._first_slots, np.int64)
        self._end = np.zeros(self._first_slots, np.int64)
        self._room = np.zeros(self._first_slots, np.int64)
        self._salts = np.zeros(self._first_slots, np.uint64)
        self._salt2 = np.zeros((self._first_slots, 2), np.uint64)
        self._probe = np.zeros((self._first_slots, 2 * L), np.uint64)
        self._free = list(range(self._first_slots - 1, -1, -1))
        self._rng = np.random.default_rng(0)
        self._pending_slots: list[int] = []  # extend's rows, counts and tokens since a flush
        self._pending_counts: list[int] = []
        self._pending_tokens: list[int] = []
        self._table = self._table_type()
        self._store = np.zeros(self._first_store, np.uint64)
        self._ends = np.zeros(self._first_store, np.int64)
        self._base = self._next = 0  # global offsets: _store[0] and the next token's
        self._recent: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, end)
        self._recent_tokens = self._pool_count = self._next_id = 0
        self._last: tuple[list[Hashable], np.ndarray] | None = None

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Start indexing a request from its prompt."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already indexed")
        if not self._free:  # twice the rows
            size = len(self._len)
            self._len = np.concatenate([self._len, np.zeros_like(self._len)])
            self._end = np.concatenate([self._end, np.zeros_like(self._end)])
            self._room = np.concatenate([self._room, np.zeros_like(self._room)])
            self._salts = np.concatenate([self._salts, np.zeros_like(self._salts)])
            self._salt2 = np.concatenate([self._salt2, np.zeros_like(self._salt2)])
            self._probe = np.concatenate([self._probe, np.zeros_like(self._probe)])
            self._free = list(range(2 * size - 1, size - 1, -1))
        slot = self._free.pop()
        self._last = None
        room = max(self._first_room, 2 * len(prompt_ids))
        self._len[slot] = 0
        self._end[slot] = self._allocate(room)
        self._room[slot] = room
        self._salts[slot] = np.uint64(int(self._rng.integers(0, 1 << 63, dtype=np.int64)))
        self._salt2[slot] = (self._salts[slot], _POOL)
        self._requests[request_id] = _Request(slot, len(prompt_ids))
        self.extend(request_id, prompt_ids)

    def extend(self, request_id: Hashable, new_ids: Sequence[int]) -> None:
        """Append tokens (ints) the request emitted (indexed at the next lookup, all rows at
        once)."""
        self._pending_slots.append(self._requests[request_id].slot)
        self._pending_counts.append(len(new_ids))
        self._pending_tokens.extend(new_ids)

    def flush(self) -> None:
        """Index every request's tokens appended since the last flush (the next lookup or
        finish does it otherwise), all rows at once: the tokens written into _arena; the
        window ending before each new token (that n-gram now has a next token) and the one
        ending at each row's new last token hashed; the former's keys inserted, the latter's
        kept in _probe."""
        if not self._pending_slots:
            return
        repeated = len(set(self._pending_slots)) != len(self._pending_slots)
        slots = np.array(self._pending_slots, np.intp)  # [R] one entry per extend
        counts = np.array(self._pending_counts, np.int64)  # [R]
        tokens = np.array(self._pending_tokens, np.uint64)  # [T] the entries' tokens in order
        self._pending_slots, self._pending_counts, self._pending_tokens = [], [], []
        if repeated:  # a row extended more than once: one entry a row
            slots, counts, tokens = _merge(slots, counts, tokens)
        before = np.take(self._len, slots)  # [R] tokens before these
        lengths = before + counts
        outgrown = lengths > np.take(self._room, slots)
        if outgrown.any():
            for slot, length in zip(slots[outgrown].tolist(), lengths[outgrown].tolist()):
                self._move(slot, 2 * length)
        self._len[slots] = lengths
        start = np.take(self._end, slots)  # [R] where each row's first new token goes
        stop = start + counts  # [R]
        self._end[slots] = stop
        T = len(tokens)
        first = np.cumsum(counts) - counts  # [R] each entry's first index into tokens
        at = np.arange(T) + np.repeat(start - first, counts)  # [T] where each new token goes
        self._arena[at] = tokens + _ONE
        # Windows ending before each new token (that n-gram now has a next token), then at
        # each row's last token (its suffix): hashed for every length at once.
        ends = np.concatenate([at - 1, stop - 1])  # [T + R]
        window = np.take(self._arena, ends[:, None] - self._back)  # [T + R, G] t+1, back
        hashes = np.cumsum(window * self._powers, axis=1)[:, self.min_ngram - 1:]  # [T+R, L]
        suffix = hashes[T:, None, ::-1]  # [R, 1, L] n = max..min
        self._probe[slots] = (suffix ^ np.take(self._salt2, slots, axis=0)[:, :, None]
                              ).reshape(len(slots), -1)  # [R, 2L] own, then pooled
        if not T:
            return
        keys = hashes[:T] ^ np.repeat(np.take(self._salts, slots), counts)[:, None]  # [T, L]
        pos = at - np.repeat(start - before + 1, counts)  # [T] the n-grams' end positions
        if int(before.min()) >= self._G:  # every new end has all lengths: no mask
            values = np.repeat(pos, self._L)
            keys = keys.ravel()
        else:  # an n-gram ends at position e only for n <= e + 1
            ok = pos[:, None] >= self._lengths - 1  # [T, L]
            values = np.broadcast_to(pos[:, None], ok.shape)[ok]
            keys = keys[ok]
        self._table.insert(keys, values)

    def _allocate(self, room: int) -> int:
        """A region for `room` tokens after G guard digits: -> the place of its first token."""
        size = self._G + room
        if self._top + size > len(self._arena):
            self._pack(size)
        start = self._top + self._G
        self._arena[self._top:start] = _GUARD
        self._top += size
        self._held += size
        return start

    def _move(self, slot: int, room: int) -> None:
        """The request's tokens to a region for `room` (its old one is left unused)."""
        start = self._allocate(room)  # (first: packing may move the old region)
        length = int(self._len[slot])
        old = int(self._end[slot]) - length
        self._arena[start:start + length] = self._arena[old:old + length]
        self._held -= self._G + int(self._room[slot])
        self._end[slot], self._room[slot] = start + length, room

    def _pack(self, size: int) -> None:
        """Room for `size` more places: the live regions packed into an arena at least twice
        what they and `size` need (a Python loop over the live requests: rare)."""
        length = len(self._arena)
        while 2 * (self._held + size) > length:
            length *= 2
        arena = np.full(length, _GUARD, np.uint64)
        top = 0
        for request in self._requests.values():
            slot, G = request.slot, self._G
            room, count = int(self._room[slot]), int(self._len[slot])
            old = int(self._end[slot]) - count
            arena[top + G:top + G + count] = self._arena[old:old + count]
            self._end[slot] = top + G + count
            top += G + room
        self._arena, self._top, self._held = arena, top, top

    def _own_entries(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of every n-gram the request indexed (ends 0 .. len - 2)."""
        if self._len[slot] < 2:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        start = int(self._end[slot] - self._len[slot])  # its first token's place
        hashes, ok = self._windows(
            self._arena[start - self._G:start + int(self._len[slot]) - 1])
        values = np.broadcast_to(np.arange(len(hashes))[:, None], ok.shape)
        return (hashes ^ self._salts[slot])[ok], values[ok]

    def _windows(self, guarded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For G guard digits then m tokens + 1: the hashes [m, L] of the n-grams (n =
        min..max_ngram) ending at each token, and whether each exists (n <= position + 1)."""
        G = self._G
        window = sliding_window_view(guarded[1:], G)[:, ::-1]  # [m, G] back from each end
        hashes = np.cumsum(window * self._powers, axis=1)[:, self.min_ngram - 1:]  # [m, L]
        ok = np.arange(len(window))[:, None] >= self._lengths - 1  # [m, L]
        return hashes, ok

    def _forget(self, request_id: Hashable) -> _Request | None:
        """Remove a request and its own n-grams (pending extends flushed first)."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.flush()
        del self._requests[request_id]
        self._last = None
        self._table.remove(*self._own_entries(request.slot))
        self._held -= self._G + int(self._room[request.slot])
        self._free.append(request.slot)
        return request

    def finish(self, request_id: Hashable) -> None:
        """The request is done: its output (with its prompt, keep_prompts) joins the recent
        pool, and its own n-grams leave the table."""
        request = self._forget(request_id)
        if request is None:
            raise KeyError(request_id)
        slot, G, size = request.slot, self._G, int(self._len[request.slot])
        start = max(0 if self.keep_prompts else request.prompt_length,
                    size - self.max_recent_tokens)
        first = int(self._end[slot]) - size  # its first token's place
        tokens = self._arena[first + start:first + size].copy()  # [n] t + 1
        if len(tokens) < 2:
            return
        sequence = self._next_id
        self._next_id += 1
        g = self._append(tokens)
        self._recent[sequence] = (g, g + len(tokens))
        self._recent_tokens += len(tokens)
        keys, values = self._pool_entries(tokens, g)
        keys, last = np.unique(keys[::-1], return_index=True)  # each key's latest end
        self._pool_count += self._table.insert(keys, values[::-1][last])
        while len(self._recent) > self.max_recent or self._recent_tokens > self.max_recent_tokens:
            self._evict()

    def _append(self, tokens: np.ndarray) -> int:
        """Put an output (tokens + 1) into the store: -> its global offset."""
        live = next(iter(self._recent.values()))[0] if self._recent else self._next
        if self._next + len(tokens) - self._base > len(self._store):
            keep = slice(live - self._base, self._next - self._base)
            size = len(self._store)
            while self._next - live + len(tokens) > size:
                size *= 2
            store, ends = np.zeros(size, np.uint64), np.zeros(size, np.int64)
            store[:keep.stop - keep.start] = self._store[keep]
            ends[:keep.stop - keep.start] = self._ends[keep]
            self._store, self._ends, self._base = store, ends, live
        g = self._next
        self._store[g - self._base:g - self._base + len(tokens)] = tokens
        self._ends[g - self._base:g - self._base + len(tokens)] = g + len(tokens)
        self._next = g + len(tokens)
        return g

    def _pool_entries(self, tokens: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of a pooled output's n-grams (tokens + 1, at global offset g), by end
        (the last token has no continuation to index)."""
        guarded = np.concatenate([np.full(self._G, _GUARD, np.uint64), tokens[:-1]])
        hashes, ok = self._windows(guarded)
        values = np.broadcast_to(_POOLED + g + np.arange(len(tokens) - 1)[:, None], ok.shape)
        return (hashes ^ _POOL)[ok], values[ok]

    def drop(self, request_id: Hashable) -> None:
        """Forget a request without pooling it (cancelled, failed)."""
        self._forget(request_id)

    def _evict(self) -> None:
        _, (start, end) = self._recent.popitem(last=False)
        self._recent_tokens -= end - start
        tokens = self._store[start - self._base:end - self._base]
        keys, values = self._pool_entries(tokens, start)
        self._pool_count -= self._table.remove(keys, values)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def tokens(self, request_id: Hashable) -> list[int]:
        """The request's tokens so far (prompt, then output); a copy."""
        self.flush()
        slot = self._requests[request_id].slot
        end = int(self._end[slot])
        return (self._arena[end - int(self._len[slot]):end] - _ONE).tolist()

    @property
    def recent_tokens(self) -> int:
        return self._recent_tokens

    @property
    def recent_sequences(self) -> int:
        return len(self._recent)

    @property
    def pool_entries(self) -> int:
        return self._pool_count

    # -- proposals -------------------------------------------------------------------------------

    def propose(self, request_id: Hashable, max_tokens: int) -> list[int]:
        """Up to max_tokens tokens that followed the longest earlier occurrence of the
        request's suffix; empty when no suffix of min_ngram tokens or more occurred."""
        return self.lookup(request_id, max_tokens).tokens

    def lookup(self, request_id: Hashable, max_tokens: int) -> Proposal:
        """`propose`, saying where the proposal comes from and how long the match was."""
        return self.lookup_many([request_id], max_tokens)[0]

    def lookup_many(self, request_ids: Sequence[Hashable], max_tokens: int) -> list[Proposal]:
        """`lookup` for each request, all in one pass."""
        out = [Proposal([], "", 0) for _ in request_ids]
        found = self._search(request_ids, max_tokens, 1)
        if found is not None:
            rows, tokens, counts, pooled, match = found
            for row, row_tokens, count, is_pooled, n in zip(
                    rows.tolist(), tokens.tolist(), counts.tolist(), pooled.tolist(),
                    match.tolist()):
                out[row] = Proposal(row_tokens[:count], "recent" if is_pooled else "own", n)
        return out

    def propose_many(self, request_ids: Sequence[Hashable], max_tokens: int,
                     min_match: int = 1) -> list[list[int]]:
        """Per request, `propose`'s tokens where the match has at least min_match tokens
        (else []): all rows of a step in one pass (the scheduler's per-step call)."""
        out: list[list[int]] = [[] for _ in request_ids]
        found = self._search(request_ids, max_tokens, min_match)
        if found is not None:
            rows, tokens, counts, pooled, _ = found
            if pooled.any():
                for row, row_tokens, count in zip(rows.tolist(), tokens.tolist(),
                                                  counts.tolist()):
                    out[row] = row_tokens[:count]
            else:  # own matches propose max_tokens tokens
                for row, row_tokens in zip(rows.tolist(), tokens.tolist()):
                    out[row] = row_tokens
        return out

    def _search(self, request_ids: Sequence[Hashable], max_tokens: int, min_match: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """For the rows whose suffix matched min_match tokens or more (None: no row): (rows
        [H], tokens [H, max_tokens] (a row's first counts[h] are its proposal), counts [H],
        pooled [H] bool, match [H]). The longest and shortest lengths first (class
        docstring), then the lengths between where needed."""
        self.flush()
        if self._last is not None and self._last[0] == request_ids:
            slots = self._last[1]  # the same rows as the last lookup (a step's)
        else:
            requests = self._requests
            slots = np.fromiter((requests[i].slot for i in request_ids), np.intp,
                                len(request_ids))
            self._last = (list(request_ids), slots)
        R = len(slots)
        if max_tokens < 1 or not R:
            return None
        probe = np.take(self._probe, slots, axis=0)  # [R, 2L]
        first = self._all if self._wide else self._first
        values = self._table.get(probe[:, first])  # [R, F] own max, min; pooled alike
        best = np.where(values >= 0, self._score[first], 0).argmax(1)  # [R] longest, own
        best += np.arange(0, R * len(first), len(first))  # (on a tie) flat in values
        end = np.take(values, best)  # [R] where it ended (-1: nothing)
        top = np.where(end >= 0, np.take(self._score[first], best % len(first)), 0)  # 2n + own
        if self._wide:  # every length probed already
            self._wide = bool(np.count_nonzero((top > 0) & (top < 2 * self.max_ngram)))
        elif len(self._between):  # matched the shortest, not the longest: the lengths between
            rows = np.flatnonzero((top > 0) & (top < 2 * self.max_ngram))
            self._wide = len(rows) > 0
            if len(rows):
                between = self._between
                values = self._table.get(probe[rows][:, between])  # [U, B]
                best = np.where(values >= 0, self._score[between], 0).argmax(1)  # [U]
                inner = np.where(np.take_along_axis(values, best[:, None], 1)[:, 0] >= 0,
                                 self._score[between][best], 0)  # [U]
                longer = inner > top[rows]
                rows = rows[longer]
                top[rows] = inner[longer]
                end[rows] = np.take_along_axis(values, best[:, None], 1)[longer, 0]
        hit = np.flatnonzero(top >= 2 * max(min_match, 1))  # [H]
        if not len(hit):
            return None
        top, end = top[hit], end[hit]  # [H]
        ahead = np.arange(max_tokens)  # [K]
        pooled = end >= _POOLED  # [H]
        counts = np.full(len(hit), max_tokens)  # [H]
        if pooled.all():
            tokens = None
        else:  # own: copy on from end + 1; past the row's end, from what is being copied
            h = slots[hit]
            last = np.take(self._end, h) - 1  # [H] where each row's last token is
            period = np.maximum(np.take(self._len, h) - 1 - end, 1)  # [H] end + 1 .. last
            at = (last - period + 1)[:, None] + ahead % period[:, None]  # [H, K]
            tokens = np.take(self._arena, np.minimum(at, len(self._arena) - 1))
        if pooled.any():  # what followed in that output, up to its end
            g = np.where(pooled, end - (_POOLED + self._base), 0)  # [H] in _store
            at = np.minimum(g[:, None] + 1 + ahead, len(self._store) - 1)  # [H, K]
            theirs = np.take(self._store, at)
            tokens = theirs if tokens is None else np.where(pooled[:, None], theirs, tokens)
            counts = np.where(pooled, np.minimum(self._ends[g] - self._base - g - 1, max_tokens),
                              max_tokens)
        return hit, tokens - _ONE, counts, pooled, top >> 1


def _merge(slots: np.ndarray, counts: np.ndarray, tokens: np.ndarray
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pending extends with a row more than once -> one entry a row, its tokens in order."""
    per: dict[int, list[int]] = {}
    flat = tokens.tolist()
    at = 0
    for slot, count in zip(slots.tolist(), counts.tolist()):
        per.setdefault(slot, []).extend(flat[at:at + count])
        at += count
    merged = list(per.values())
    return (np.fromiter(per.keys(), np.intp, len(per)),
            np.fromiter(map(len, merged), np.int64, len(per)),
            np.array(list(itertools.chain.from_iterable(merged)), np.uint64))
