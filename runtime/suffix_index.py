"""The suffix index: per request, the tokens that followed the longest earlier occurrence of its
suffix, for every row of a decoding step in one call to C of our own (runtime/suffix_native.c),
or a few dozen numpy calls where it cannot be built (runtime/suffix.py verifies what it
proposes; benchmarks/suffix_index.py measures its host time).

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

Finished requests' own keys and evicted outputs' pooled keys are removed, so every value
points at live tokens.

Two implementations of the same mapping (key -> latest end), so of the same proposals:
    native  (the default where a C compiler is found; `SuffixIndex(native=...)`): the per-step
            work in C (runtime/suffix_native.c, compiled at first use and cached by
            runtime/native.py, called through ctypes: one call for a step's extends, one for
            its lookups); the table is open addressing over a numpy array (key and value side
            by side), doubled and halved by rehash; the keys of a batch prefetched together;
    numpy   the reference and the fallback (FUSER_NATIVE=0, no compiler, a failed build: one
            warning). The table (`_Table`): buckets of 7 keys and a guard, one 64-byte line
            each, probed for a whole batch of keys with one gather and one compare; a key
            whose bucket is full goes to a small dict (the stash).
Both share the argument checks and the bookkeeping: the requests, the token rows (_arena) and
their regions, the pool's store and its recent outputs. The rest of this docstring is numpy's
way; the C's comments say its own.

A step's host work (the adaptive scheduler's): `extend` per row only appends to lists; the
lookup (`propose_many`) first indexes every row's new tokens at once (`flush`: write them
into the token rows, hash the windows ending at each row's last K + 1 tokens, K the most a
row brought, insert the keys of all but the last, keep the last's), then probes, for every
row at once, the suffix's own and pooled keys at the longest and the shortest length (the
keys flush just made: no second gather). A suffix that never
occurred has no longer one that did, so that settles most rows (no match, or the longest);
the lengths between are probed only for rows that matched the shortest and not the longest.
The proposals are one gather from the token rows (own matches, with their period) or the
pool's store.
"""

from __future__ import annotations

import array
import ctypes
import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fuser.runtime import native as _native_build

__all__ = ["Proposal", "SuffixIndex"]

# Hashes wrap at 64 bits (uint64 arithmetic).
_BASE = np.uint64(1_000_003)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # hashes come times MIX: a key's top bits are its bucket
_POOL = np.uint64(0x5851F42D4C957F2D)  # pooled keys' salt (each request has its own)
_POOLED = 1 << 62  # a pooled key's value: this plus its global offset (own ones: positions)
_FREE = 1 << 62  # a free row's region end (no row is ever short of room)
_GUARD = np.uint64(0xD6E8FEB86659FD93)  # the digit before a first token (no token +1; odd, so
                                      # that its multiples reach the low bits)
_WAYS = 7  # keys a bucket holds
_ROW = 8  # a bucket's keys and a guard key (its values alike: 7 and a guard value)
_ALL = np.uint64(0xFFFFFFFFFFFFFFFF)  # the guard key (never a key, never free), and value -1
_ONE = np.uint64(1)
_GATHER = np.uint64(0x0102040810204080)  # `_lowest_way`
_FIRST = np.array([_WAYS] + [(m & -m).bit_length() - 1 for m in range(1, 256)],
                  np.intp)  # [256] a mask of ways -> its lowest (none: _WAYS, the guard)


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
    values (-1: none), read and written a batch of keys at a time: `nb` buckets, each one
    row of `rows` (64 bytes, one cache line): _WAYS keys and a guard key (all ones: never a
    key, never free), their values alike in `flat_values` (the guard's: -1, what a miss
    reads). A key lives in bucket key >> (64 - bits) (keys come mixed), or, where that
    bucket was full when it came, in the stash (a dict) with the bucket flagged. A batch's
    lookup is one gather of its buckets and one compare; the bytes of a bucket's compare,
    read as one uint64, say whether and where (`_lowest_way`).

    Values only grow: a key inserted again (or twice in one batch) keeps the largest value
    (np.maximum.at over the held one; a free way's value is -1). A key is in its bucket or
    in the stash, never both (a stashed key that finds room in its bucket moves there).

    `count` counts the keys held; a key inserted twice in one batch is counted twice (an
    upper bound, made exact whenever it crosses max_load; the table doubles only where the
    exact count is past half of that, and is rebuilt smaller where it falls far below:
    `shrink`)."""

    max_load = 0.25  # keys per way where the count is checked
    first_bits = 12  # 2**12 buckets at first

    def __init__(self) -> None:
        self._reset(self.first_bits)

    def _reset(self, bits: int) -> None:
        self.bits = bits
        self.shift = np.uint64(64 - bits)
        self.rows = np.full((1 << bits, _ROW), _ALL, np.uint64)  # [nb, 8] keys, guard
        self.rows[:, :_WAYS] = 0
        self.flat = self.rows.reshape(-1)  # [nb * 8] a view: key w of b at 8 b + w
        self.flat_values = np.full((1 << bits) * _ROW, -1, np.int64)  # its value there
        self.capacity = _WAYS << bits
        self.flagged = np.zeros(1 << bits, bool)  # [nb] some key of the bucket is stashed
        self.stash: dict[int, int] = {}
        self.count = 0
        self.removed = 0  # keys removed since count was last made exact (`shrink`)

    def bucket(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> self.shift).view(np.int64)

    def get(self, keys: np.ndarray) -> np.ndarray:
        """The values of `keys` (any shape), -1 where absent."""
        b = self.bucket(keys)
        hit = (np.take(self.rows, b, axis=0) == keys[..., None]).view(np.uint64)[..., 0]
        values = np.take(self.flat_values, b * _ROW + _lowest_way(hit))  # a miss: the guard
        if self.stash:  # a miss in a flagged bucket may be stashed
            maybe = (values < 0) & self.flagged[b]
            if maybe.any():
                get = self.stash.get
                values[maybe] = [get(k, -1) for k in keys[maybe].tolist()]
        return values

    def insert(self, keys: np.ndarray, values: np.ndarray) -> int:
        """Insert keys [m] -> values [m] (class docstring: values only grow); -> how many
        keys were not held (exact for distinct keys)."""
        m = len(keys)
        if self.count + m > self.max_load * self.capacity:
            self.count = int(np.count_nonzero(self.rows[:, :_WAYS])) + len(self.stash)
            self.removed = 0
            if self.count + m > self.max_load / 2 * self.capacity:
                self._grow(self.count + m)
        b = self.bucket(keys)
        rows = np.take(self.rows, b, axis=0)  # [m, 8]
        mine = (rows == keys[:, None]).view(np.uint64)[:, 0]  # [m] its way's byte set, if held
        new = m - np.count_nonzero(mine)
        # The way holding it, else the first free one.
        word = np.where(mine != 0, mine, (rows == 0).view(np.uint64)[:, 0])  # [m] 0: full
        way = _lowest_way(word)  # [m]
        if self.stash and new:  # a stashed key that finds room in its bucket leaves it
            flagged = np.take(self.flagged, b)
            if flagged.any():
                moved = flagged & (way < _WAYS) & (mine == 0)
                if moved.any():
                    new -= self._unstash(keys[moved])
        at = b * _ROW + way  # [m] its way (full buckets: fixed below)
        if np.count_nonzero(word) < m:  # no way holds it and none is free: to the stash
            full = word == 0
            room = ~full
            new += self._stash(keys[full], values[full], b[full]) - int(np.count_nonzero(full))
            keys, values, b, at = keys[room], values[room], b[room], at[room]
        self.flat[at] = keys  # new keys claim it; one wins where several claim a way
        lost = np.take(self.flat, at) != keys  # (a held key always wins)
        if np.count_nonzero(lost):
            won = ~lost
            lost = keys[lost], values[lost]
            keys, values, b, at = keys[won], values[won], b[won], at[won]
            new -= len(lost[0])
        else:
            lost = None
        np.maximum.at(self.flat_values, at, values)  # a free way's value is -1
        self.count += new
        if lost is not None:  # a free way went to another key: the next one (few)
            new += self._insert_one_by_one(*lost) if len(lost[0]) <= 8 else self.insert(*lost)
        return new

    def _insert_one_by_one(self, keys: np.ndarray, values: np.ndarray) -> int:
        """`insert` for a few keys, in Python."""
        new = 0
        flat, flat_values, stash = self.flat, self.flat_values, self.stash
        for key, value, b in zip(keys.tolist(), values.tolist(), self.bucket(keys).tolist()):
            row = flat[b * _ROW:b * _ROW + _WAYS].tolist()
            if key in row:
                at = b * _ROW + row.index(key)
                flat_values[at] = max(int(flat_values[at]), value)
            elif 0 in row:
                way = row.index(0)
                flat[b * _ROW + way] = key
                flat_values[b * _ROW + way] = value
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
        hit = (np.take(self.rows, b, axis=0) == keys[:, None]).view(np.uint64)[:, 0]
        at = b * _ROW + _lowest_way(hit)  # [m] absent: the guard (its value -1)
        held = np.take(self.flat_values, at) == values
        at = at[held]
        self.flat_values[at] = -1
        self.flat[at] = 0
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
        self.removed += removed
        return removed

    def _grow(self, needed: int) -> None:
        """Double until `needed` keys fill under half of max_load, and insert what is held
        again."""
        bits = self.bits
        while needed > self.max_load / 2 * (_WAYS << bits):
            bits += 1
        self._rebuild(bits)

    def shrink(self) -> None:
        """Where the keys fill under max_load / 16 (a burst of requests gone): the smallest
        table (first_bits at least) they fill under half of max_load, rebuilt. (count is an
        upper bound: it is made exact once as many keys as max_load / 8 of the places were
        removed since it last was, a pass over the table for that many removals.)"""
        if self.bits <= self.first_bits:
            return
        threshold = self.max_load / 16 * self.capacity
        if self.count >= threshold and self.removed < 2 * threshold:
            return
        self.count = int(np.count_nonzero(self.rows[:, :_WAYS])) + len(self.stash)
        self.removed = 0
        bits = self.first_bits
        while self.count > self.max_load / 2 * (_WAYS << bits):
            bits += 1
        if bits < self.bits:
            self._rebuild(bits)

    def _rebuild(self, bits: int) -> None:
        """A table of 2**bits buckets holding what this one holds."""
        held = self.rows[:, :_WAYS] != 0  # [nb, W]
        keys = self.rows[:, :_WAYS][held]
        values = self.flat_values.reshape(-1, _ROW)[:, :_WAYS][held]
        stash = self.stash
        if stash:
            keys = np.concatenate([keys, np.fromiter(stash.keys(), np.uint64, len(stash))])
            values = np.concatenate([values, np.fromiter(stash.values(), np.int64, len(stash))])
        self._reset(bits)
        self.insert(keys, values)


class _Context(ctypes.Structure):
    """runtime/suffix_native.c's `sfx_ctx`: the arrays' addresses and the table's state."""

    _fields_ = [("arena", ctypes.c_void_p), ("start", ctypes.c_void_p),
                ("end", ctypes.c_void_p), ("limit", ctypes.c_void_p),
                ("salt", ctypes.c_void_p), ("store", ctypes.c_void_p),
                ("ends", ctypes.c_void_p), ("base", ctypes.c_int64),
                ("store_size", ctypes.c_int64),
                ("table", ctypes.c_void_p),
                ("bits", ctypes.c_int64), ("count", ctypes.c_int64),
                ("max_count", ctypes.c_int64), ("max_ngram", ctypes.c_int64),
                ("min_ngram", ctypes.c_int64), ("powers", ctypes.c_uint64 * 64),
                ("resume", ctypes.c_int64)]


_ZERO = array.array("q", [0])


def _library() -> ctypes.CDLL | None:
    """runtime/suffix_native.c compiled and loaded (runtime/native.py keeps it, once a process),
    its functions typed; None where native code is off or cannot be built (native.py warns
    once why)."""
    lib = _native_build.library("suffix_native")
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        for name, args, result in (("sfx_flush", [ptr, i64, ptr, ptr, ptr, i64, i64], i64),
                                   ("sfx_search", [ptr, i64, ptr, i64, i64, ptr, ptr, ptr], None),
                                   ("sfx_remove_own", [ptr, i64], i64),
                                   ("sfx_pool", [ptr, i64, i64, ctypes.c_int], i64),
                                   ("sfx_rehash", [ptr, ptr, i64], None)):
            function = getattr(lib, name)
            function.argtypes, function.restype = args, result
    return lib


def _address(a: np.ndarray) -> int:
    return a.ctypes.data


class _Native:
    """The compiled core of one SuffixIndex (runtime/suffix_native.c): its context, which
    points at the index's arrays (`sync` after any of them moves), and the hash table, open
    addressing over a numpy array this object owns (`table` [2 << bits] int64: each place's
    key, then its value): `reserve` grows it before a call could pass max_load, `shrink`
    makes it smaller where a burst left it far below that (max_load / 8)."""

    max_load = 0.5  # keys a place before the table doubles

    def __init__(self, lib: ctypes.CDLL, max_ngram: int, min_ngram: int, powers: np.ndarray,
                 first_bits: int) -> None:
        self.lib = lib
        self.ctx = _Context()
        self.ptr = ctypes.addressof(self.ctx)
        self.ctx.max_ngram, self.ctx.min_ngram = max_ngram, min_ngram
        self.ctx.powers[:max_ngram] = powers.tolist()
        self.lengths = max_ngram - min_ngram + 1  # keys an n-gram end brings
        self.first_bits = first_bits
        self.table = np.zeros(2, np.int64)  # (replaced at once: `_resize` needs a table)
        self.ctx.table, self.ctx.bits = _address(self.table), 0
        self._resize(first_bits)
        self.flush, self.search = lib.sfx_flush, lib.sfx_search

    @property
    def count(self) -> int:
        return self.ctx.count

    def _resize(self, bits: int) -> None:
        table = np.zeros(2 << bits, np.int64)
        self.lib.sfx_rehash(self.ptr, _address(table), bits)
        self.table = table  # (the old one is no longer read)
        self.ctx.max_count = int(self.max_load * (1 << bits))

    def _bits(self, keys: int) -> int:
        """The fewest bits (first_bits at least) whose table holds `keys` under half of
        max_load."""
        bits = self.first_bits
        while keys > self.max_load / 2 * (1 << bits):
            bits += 1
        return bits

    def reserve(self, more: int) -> None:
        """Room for `more` keys (the most a call about to run may insert)."""
        if self.ctx.count + more > self.ctx.max_count:
            self._resize(self._bits(self.ctx.count + more))

    def shrink(self) -> None:
        """A table far below its load (after a burst of requests left) to a smaller one."""
        bits = self.ctx.bits
        if bits > self.first_bits and self.ctx.count < self.max_load / 8 * (1 << bits):
            self._resize(self._bits(self.ctx.count))

    def sync(self, index: SuffixIndex) -> None:
        """Point the context at the index's arrays (after any of them was replaced)."""
        ctx = self.ctx
        ctx.arena, ctx.start, ctx.end = (_address(index._arena), _address(index._start),
                                         _address(index._end))
        ctx.limit, ctx.salt = _address(index._limit), _address(index._salts)
        ctx.store, ctx.ends = _address(index._store), _address(index._ends)
        ctx.base, ctx.store_size = index._base, len(index._store)

    def remove_own(self, slot: int) -> int:
        return self.lib.sfx_remove_own(self.ptr, slot)

    def pool(self, g: int, size: int, insert: bool) -> int:
        """The pooled keys of the output at global offset g in (insert) or out: -> how many
        keys were new / removed."""
        if insert:
            self.reserve(max(size - 1, 0) * self.lengths)
        return self.lib.sfx_pool(self.ptr, g, size, int(insert))


class SuffixIndex:
    """Proposals from the longest earlier occurrence of a request's suffix (module docstring).

    The layout:
        _arena   uint64: every request's tokens + 1, each in a region of its own (G =
                 max_ngram digits of _GUARD, then room for its tokens up to _limit: a window never
                 leaves the region); a region that fills up moves to a twice larger one, and
                 the arena is packed when it runs out. Per request (slot): _start where in
                 _arena its first token is, _end where its next token goes (its length: the
                 difference), _limit the end of its region (free rows: _FREE), _salts its
                 own keys' salt;
        _probe   uint64 [slots, 2L] (numpy's): the table keys of its suffix, n = max_ngram
                 .. min_ngram (L lengths), own then pooled for each n: a column's score
                 2n + own falls from left to right;
        _store   uint64: the pool's tokens + 1, outputs one after another (a global offset g
                 is _store[g - _base]); _ends int64 alike: the end (exclusive) of the output
                 that token is in;
        _table   (numpy's; native: `_native`, a `_Native`) own keys (hash + the request's
                 salt) -> the n-gram's end position in the request; pooled keys (hash ^
                 _POOL) -> _POOLED + its global offset in the store.
    `extend` only appends to lists; the next lookup (or finish) indexes every request's new
    tokens at once (`flush`). `propose_many` looks up all rows of a step at once (numpy:
    every length of both kinds in one probe, the best hit the first column that holds one;
    native: one C call over the rows).

    Args:
        max_ngram: the longest suffix matched (and indexed): memory and time per token grow
            with max_ngram - min_ngram + 1.
        min_ngram: the shortest match that proposes anything (1-token matches are mostly
            noise).
        max_recent: finished sequences kept in the recent pool.
        max_recent_tokens: tokens kept in the recent pool, all sequences together.
        keep_prompts: pool a finished request's prompt with its output (default: the output).
        native: the per-step work (flush, the lookups, finish's keys) in compiled C
            (runtime/suffix_native.c, built at first use by runtime/native.py), its hash table
            open addressing over a numpy array: the same key -> latest end mapping, so the
            same proposals, several times faster. None (default): where it can be built
            (FUSER_NATIVE=0 turns it off; a failed build warns once and uses numpy); True:
            required (RuntimeError where it cannot be built); False: numpy.
    """

    _first_slots = 8  # per-request arrays' rows at first (doubled as requests come)
    _first_room = 1024  # tokens a request's region holds at first (at least twice its prompt)
    _first_arena = 1 << 16  # the arena at first (doubled as needed)
    _first_store = 1024  # the pool's store at first (tokens; doubled as needed)
    _table_type = _Table
    _grid = 16  # the most new tokens a row may bring for flush's grid (more: the ragged way)
    _native_bits = 12  # the native table's places at first: 2**12 (doubled as needed)

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2, max_recent: int = 256,
                 max_recent_tokens: int = 1 << 18, keep_prompts: bool = False,
                 native: bool | None = None) -> None:
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram),
                            ("max_recent", max_recent), ("max_recent_tokens", max_recent_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram={min_ngram} must be <= max_ngram={max_ngram}")
        if max_recent_tokens >= 1 << 32:
            raise ValueError(f"max_recent_tokens={max_recent_tokens} must be < 2**32")
        if max_ngram > 64:
            raise ValueError(f"max_ngram={max_ngram} must be <= 64")
        if native is not None and not isinstance(native, bool):
            raise ValueError(f"native={native!r} must be True, False or None")
        lib = None if native is False else _library()
        if native and lib is None:
            why = _native_build.unavailable("suffix_native") or "unknown"
            raise RuntimeError(f"SuffixIndex(native=True): the native index cannot be built "
                               f"({why})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_recent, self.max_recent_tokens = max_recent, max_recent_tokens
        self.keep_prompts = keep_prompts
        G, L = max_ngram, max_ngram - min_ngram + 1
        self._G, self._L = G, L
        self._powers = _BASE ** np.arange(G, dtype=np.uint64) * _MIX  # [G] BASE^i MIX
        self._back = np.arange(G)  # [G] a window's offsets back from its end
        self._back_column, self._power_column = self._back[:, None], self._powers[:, None]
        self._lengths = np.arange(min_ngram, max_ngram + 1)  # [L] the indexed n, ascending
        descending = np.repeat(self._lengths[::-1], 2)  # [2L] _probe's columns' n
        self._score = 2 * descending + np.tile([1, 0], L)  # [2L] 2n + own, falling
        self._behind = np.arange(1, self._grid + 2)  # [J] a grid's ends, back from the length
        self._ahead = np.arange(1 << 10)  # proposal offsets, and row numbers
        self._first: dict[int, np.ndarray] = {}  # `_first_columns`
        self._requests: dict[Hashable, _Request] = {}
        self._slots: dict[Hashable, int] = {}
        self._arena = np.full(self._first_arena, _GUARD, np.uint64)
        self._top = self._held = 0  # the arena's first unused place; places in live regions
        self._start = np.zeros(self._first_slots, np.int64)
        self._end = np.zeros(self._first_slots, np.int64)
        self._limit = np.full(self._first_slots, _FREE, np.int64)
        self._salts = np.zeros(self._first_slots, np.uint64)
        self._probe = np.zeros((self._first_slots, 2 * L), np.uint64)
        self._free = list(range(self._first_slots - 1, -1, -1))
        self._rng = np.random.default_rng(0)
        self._pending_slots: list[int] = []  # extend's rows, counts and tokens since a flush
        self._pending_counts: list[int] = []
        self._pending_tokens: list[int] = []
        self._slack = 0  # no row's region has fewer free places than this (a lower bound)
        self._short: set[int] = set()  # rows never flushed or of fewer than 2 tokens (flush
        # takes the ragged way for them: the n-grams before a first token do not exist)
        self._flushed: tuple[list[int], np.ndarray, np.ndarray, np.ndarray, np.ndarray] | \
            None = None  # the grid flush's rows, probe keys, starts and ends (for _search)
        self._store = np.zeros(self._first_store, np.uint64)
        self._ends = np.zeros(self._first_store, np.int64)
        self._base = self._next = 0  # global offsets: _store[0] and the next token's
        self._recent: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (start, end)
        self._recent_tokens = self._pool_count = self._next_id = 0
        self._last: tuple[list[Hashable], list[int], np.ndarray, int] | None = None  # `_rows`
        self._native = None if lib is None else \
            _Native(lib, max_ngram, min_ngram, self._powers, self._native_bits)
        self._table = self._table_type() if self._native is None else None  # numpy's
        self._sync()

    @property
    def native(self) -> bool:
        """Whether the compiled core does the work (class docstring: `native`)."""
        return self._native is not None

    def _sync(self) -> None:
        """After an array moved: the native core points at the new one."""
        if self._native is not None:
            self._native.sync(self)

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: Hashable, prompt_ids: Sequence[int]) -> None:
        """Start indexing a request from its prompt."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already indexed")
        if not self._free:  # twice the rows
            size = len(self._end)
            self._start = np.concatenate([self._start, np.zeros_like(self._start)])
            self._end = np.concatenate([self._end, np.zeros_like(self._end)])
            self._limit = np.concatenate([self._limit, np.full_like(self._limit, _FREE)])
            self._salts = np.concatenate([self._salts, np.zeros_like(self._salts)])
            self._probe = np.concatenate([self._probe, np.zeros_like(self._probe)])
            self._free = list(range(2 * size - 1, size - 1, -1))
            self._sync()
        slot = self._free.pop()
        self._last = None
        room = max(self._first_room, 2 * len(prompt_ids))
        start = self._allocate(room)
        self._start[slot] = self._end[slot] = start
        self._limit[slot] = start + room
        self._salts[slot] = np.uint64(int(self._rng.integers(0, 1 << 63, dtype=np.int64)))
        self._probe[slot] = 0  # (no tokens: no suffix; its first flush sets it)
        self._requests[request_id] = _Request(slot, len(prompt_ids))
        self._slots[request_id] = slot
        self._short.add(slot)  # (its first flush: the ragged way, from no tokens)
        self.extend(request_id, prompt_ids)

    def extend(self, request_id: Hashable, new_ids: Sequence[int]) -> None:
        """Append tokens (ints) the request emitted (indexed at the next lookup, all rows at
        once)."""
        self._pending_slots.append(self._slots[request_id])
        self._pending_counts.append(len(new_ids))
        self._pending_tokens += new_ids

    def flush(self) -> None:
        """Index every request's tokens appended since the last flush (the next lookup or
        finish does it otherwise), all rows at once: the tokens written into _arena; the
        windows ending before each new token (those n-grams now have a next token) and the
        one ending at each row's new last token hashed; the former's keys inserted, the
        latter's kept in _probe.

        Where every row brings at most _grid tokens (K the most), has room for them, had 2
        tokens or more (`_short`) and is extended once: in a few calls (where every row
        brings K, the windows of a [rows, K + 1] grid, each row's last K + 1 ends);
        otherwise `_flush_ragged` (rows that move, merged extends, new and short rows)."""
        slots = self._pending_slots
        if not slots:
            return
        counts, tokens = self._pending_counts, self._pending_tokens
        self._pending_slots, self._pending_counts, self._pending_tokens = [], [], []
        if self._native is not None:
            self._flush_native(slots, counts, tokens)
            return
        R, K = len(slots), max(counts)
        if K > self._grid or K > self._slack or len(set(slots)) != R or \
                (self._short and not self._short.isdisjoint(slots)):
            self._flush_ragged(slots, counts, tokens)
            return
        self._slack -= K
        rows = np.fromiter(slots, np.intp, R)  # [R]
        counts = np.fromiter(counts, np.int64, R)  # [R]
        tokens = np.fromiter(tokens, np.uint64, len(tokens))  # [T]
        tokens += _ONE
        T = len(tokens)
        end = np.take(self._end, rows)  # [R] where each row's first new token goes
        stop = end + counts  # [R]
        self._end[rows] = stop
        start = np.take(self._start, rows)  # [R]
        salt = np.take(self._salts, rows)  # [R]
        lo = self.min_ngram - 1
        if T == R * K:  # K tokens a row: the windows of a [R, K + 1] grid
            self._arena[(end[:, None] + self._iota(K)).reshape(-1)] = tokens
            ends = (stop - start)[:, None] - self._behind[:K + 1]  # [R, K + 1] last first
            hashes = self._hash((start[:, None] + ends).reshape(-1), np.repeat(salt, K + 1))
            hashes = hashes.reshape(self._G, R, K + 1)  # own keys
            suffix = hashes[:, :, 0]  # [G, R]
            keys = hashes[lo:, :, 1:]  # [L, R, K]
            values = np.empty(keys.shape, np.int64)  # [L, R, K] (np.broadcast_to is slower)
            values[:] = ends[:, 1:]
        else:  # the windows ending before each new token, then at each row's last
            row = np.repeat(self._iota(R), counts)  # [T] each new token's row
            at = self._iota(T) + np.take(stop - np.cumsum(counts), row)  # [T] its place
            self._arena[at] = tokens
            at -= 1  # [T] where the n-gram before it ends
            hashes = self._hash(np.concatenate([at, stop - 1]),  # [G, T + R] own keys
                                np.concatenate([np.take(salt, row), salt]))
            suffix = hashes[:, T:]  # [G, R]
            keys = hashes[lo:, :T]  # [L, T]
            values = np.empty(keys.shape, np.int64)  # [L, T]
            values[:] = at - np.take(start, row)
        own = suffix[:lo - 1 if lo else None:-1].T  # [R, L] n = max..min
        probe = np.empty((R, self._L, 2), np.uint64)  # [R, L, 2] own and pooled
        probe[:, :, 0] = own
        np.bitwise_xor(own - salt[:, None], _POOL, out=probe[:, :, 1])
        probe = probe.reshape(R, -1)  # [R, 2L]
        self._probe[rows] = probe
        self._flushed = (slots, rows, probe, start, stop)
        if T:
            self._table.insert(keys.reshape(-1), values.reshape(-1))

    def _flush_native(self, slots: list[int], counts: list[int], tokens: list[int]) -> None:
        """`flush` in C (`sfx_flush`: entry by entry, in order); where it stops before an
        entry, the entry's row moves to a region twice its new length or the table grows,
        and it goes on from there. (The lists go to C as array.array: the quickest
        conversion, and its address costs nothing.)"""
        core = self._native
        slots, counts = array.array("q", slots), array.array("q", counts)
        tokens = array.array("q", tokens)
        n = len(slots)
        at = (core.ptr, n, slots.buffer_info()[0], counts.buffer_info()[0],
              tokens.buffer_info()[0])
        done = core.flush(*at, 0, 0)  # -> the entry it stopped before (n: all in)
        while done < n:
            slot, count = slots[done], counts[done]
            length = int(self._end[slot] - self._start[slot]) + count
            if int(self._start[slot]) + length > int(self._limit[slot]):
                self._move(slot, 2 * length)
            else:
                core.reserve(count * core.lengths)
            done = core.flush(*at, done, core.ctx.resume)

    def _hash(self, ends: np.ndarray, salts: np.ndarray) -> np.ndarray:
        """The own keys [G, N] of the n-grams (n = 1..G: row n - 1) ending at the places ends
        [N] of _arena, each plus its request's salt [N] (windows back from each end, digits
        summed down the rows: contiguous; the salt added to the first digit reaches all)."""
        window = np.take(self._arena, ends - self._back_column)  # [G, N] t + 1
        window *= self._power_column
        window[0] += salts
        return np.cumsum(window, axis=0, out=window)

    def _flush_ragged(self, slots: list[int], counts: list[int], tokens: list[int]) -> None:
        """`flush` for any extends: the windows ending before each new token."""
        self._flushed = None
        slots = np.array(slots, np.intp)  # [R] one entry per extend
        counts = np.array(counts, np.int64)  # [R]
        tokens = np.array(tokens, np.uint64)  # [T] the entries' tokens in order
        if len(np.unique(slots)) != len(slots):  # a row extended more than once: one entry
            slots, counts, tokens = _merge(slots, counts, tokens)
        before = np.take(self._end, slots) - np.take(self._start, slots)  # [R] tokens before
        lengths = before + counts
        outgrown = np.take(self._start, slots) + lengths > np.take(self._limit, slots)
        if outgrown.any():
            for slot, length in zip(slots[outgrown].tolist(), lengths[outgrown].tolist()):
                self._move(slot, 2 * length)
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
        hashes = np.cumsum(window * self._powers, axis=1)  # [T + R, G]
        suffix = hashes[T:, ::-1][:, :self._L]  # [R, L] the suffixes, n = max..min
        probe = np.empty((len(slots), self._L, 2), np.uint64)  # [R, L, 2] own and pooled
        probe[:, :, 0] = suffix + np.take(self._salts, slots)[:, None]
        probe[:, :, 1] = suffix ^ _POOL
        self._probe[slots] = probe.reshape(len(slots), -1)  # [R, 2L]
        if self._short:
            self._short = {s for s in self._short if self._end[s] - self._start[s] < 2}
        self._slack = int((self._limit - self._end).min())
        if not T:
            return
        keys = hashes[:T, self.min_ngram - 1:] + \
            np.repeat(np.take(self._salts, slots), counts)[:, None]  # [T, L]
        pos = at - np.repeat(start - before + 1, counts)  # [T] the n-grams' end positions
        ok = pos[:, None] >= self._lengths - 1  # [T, L] n-grams end at e only for n <= e + 1
        values = np.broadcast_to(pos[:, None], ok.shape)[ok]
        self._table.insert(keys[ok], values)

    def _allocate(self, room: int) -> int:
        """A region for `room` tokens after G guard digits: -> the place of its first token."""
        size = self._G + room
        if self._top + size > len(self._arena):
            self._pack(size)
        start = self._top + self._G
        self._arena[self._top:start] = _GUARD
        self._top += size
        self._held += size
        self._slack = min(self._slack, room)
        return start

    def _move(self, slot: int, room: int) -> None:
        """The request's tokens to a region for `room` (its old one is left unused)."""
        start = self._allocate(room)  # (first: packing may move the old region)
        old, end = int(self._start[slot]), int(self._end[slot])
        self._arena[start:start + end - old] = self._arena[old:end]
        self._held -= self._G + int(self._limit[slot]) - old
        self._start[slot], self._end[slot], self._limit[slot] = start, start + end - old, \
            start + room
        self._flushed = None

    def _pack(self, size: int) -> None:
        """Room for `size` more places: the live regions packed into an arena at least twice
        what they and `size` need (a Python loop over the live requests: rare)."""
        length = len(self._arena)
        while 2 * (self._held + size) > length:
            length *= 2
        arena = np.full(length, _GUARD, np.uint64)
        top, G = 0, self._G
        for slot in self._slots.values():
            old, end, limit = int(self._start[slot]), int(self._end[slot]), \
                int(self._limit[slot])
            arena[top + G:top + G + end - old] = self._arena[old:end]
            self._start[slot], self._end[slot], self._limit[slot] = \
                top + G, top + G + end - old, top + G + limit - old
            top += G + limit - old
        self._arena, self._top, self._held = arena, top, top
        self._flushed = None
        self._sync()

    def _own_entries(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values) of every n-gram the request may have indexed: ends 0 .. len - 2,
        the windows that reach back into the guard digits too (flush's grid inserts them)."""
        start, end = int(self._start[slot]), int(self._end[slot])
        if end - start < 2:
            return np.zeros(0, np.uint64), np.zeros(0, np.int64)
        hashes, _ = self._windows(self._arena[start - self._G:end - 1])
        hashes = hashes + self._salts[slot]  # [len - 1, L]
        return hashes.reshape(-1), np.repeat(np.arange(len(hashes)), self._L)

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
        del self._slots[request_id]
        self._last = self._flushed = None
        slot = request.slot
        if self._native is not None:
            self._native.remove_own(slot)
        else:
            self._table.remove(*self._own_entries(slot))
        self._held -= self._G + int(self._limit[slot] - self._start[slot])
        self._limit[slot] = _FREE
        self._short.discard(slot)
        self._free.append(slot)
        return request

    def finish(self, request_id: Hashable) -> None:
        """The request is done: its output (with its prompt, keep_prompts) joins the recent
        pool, and its own n-grams leave the table."""
        request = self._forget(request_id)
        if request is None:
            raise KeyError(request_id)
        slot = request.slot
        first, size = int(self._start[slot]), int(self._end[slot] - self._start[slot])
        start = max(0 if self.keep_prompts else request.prompt_length,
                    size - self.max_recent_tokens)
        self._pool_tokens(self._arena[first + start:first + size].copy())  # [n] t + 1

    def pool_finished(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A finished request that was never indexed joins the recent pool as `finish` would
        pool it after `add_request(prompt_ids)` and `extend(output_ids)`: its output (with its
        prompt, keep_prompts), without the own n-grams those would index and `finish` remove
        (the adaptive scheduler indexes a request only when a lookup needs it)."""
        ids = list(prompt_ids) + list(output_ids) if self.keep_prompts else list(output_ids)
        tokens = np.asarray(ids[max(0, len(ids) - self.max_recent_tokens):], np.uint64) + _ONE
        self._pool_tokens(tokens)

    def _pool_tokens(self, tokens: np.ndarray) -> None:
        """Tokens (t + 1) of a finished request into the recent pool, the oldest evicted
        beyond the bounds."""
        if len(tokens) < 2:
            self._shrink()
            return
        sequence = self._next_id
        self._next_id += 1
        g = self._append(tokens)
        self._recent[sequence] = (g, g + len(tokens))
        self._recent_tokens += len(tokens)
        if self._native is not None:
            self._pool_count += self._native.pool(g, len(tokens), True)
        else:
            keys, values = self._pool_entries(tokens, g)
            keys, last = np.unique(keys[::-1], return_index=True)  # each key's latest end
            self._pool_count += self._table.insert(keys, values[::-1][last])
        while len(self._recent) > self.max_recent or self._recent_tokens > self.max_recent_tokens:
            self._evict()
        self._shrink()

    def _shrink(self) -> None:
        """After keys left: a table far below its load becomes a smaller one."""
        if self._native is not None:
            self._native.shrink()
        else:
            self._table.shrink()

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
            self._sync()
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
        if self._forget(request_id) is not None:
            self._shrink()

    def _evict(self) -> None:
        _, (start, end) = self._recent.popitem(last=False)
        self._recent_tokens -= end - start
        if self._native is not None:
            self._pool_count -= self._native.pool(start, end - start, False)
            return
        tokens = self._store[start - self._base:end - self._base]
        keys, values = self._pool_entries(tokens, start)
        self._pool_count -= self._table.remove(keys, values)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def tokens(self, request_id: Hashable) -> list[int]:
        """The request's tokens so far (prompt, then output); a copy."""
        self.flush()
        slot = self._slots[request_id]
        return (self._arena[int(self._start[slot]):int(self._end[slot])] - _ONE).tolist()

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
            tokens, counts, pooled, match = found
            rows = np.flatnonzero(counts)
            for row, row_tokens, count, is_pooled, n in zip(
                    rows.tolist(), tokens[rows].tolist(), counts[rows].tolist(),
                    pooled[rows].tolist(), match[rows].tolist()):
                out[row] = Proposal(row_tokens[:count], "recent" if is_pooled else "own", n)
        return out

    def propose_arrays(self, request_ids: Sequence[Hashable], max_tokens: int,
                       min_match: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """`propose_many` as arrays, no Python list a token: (tokens [R, max_tokens] int64,
        counts [R] int64); request r proposes tokens[r, :counts[r]] (0: nothing; what lies
        past counts[r] is unspecified). `SuffixProposals.load_arrays` takes them as they are."""
        if self._native is not None:
            return self._search_native(request_ids, max_tokens, min_match)[:2]
        found = self._search(request_ids, max_tokens, min_match)
        if found is None:
            R = len(request_ids)
            return np.zeros((R, max(max_tokens, 0)), np.int64), np.zeros(R, np.int64)
        return found[0].view(np.int64), found[1]

    def propose_many(self, request_ids: Sequence[Hashable], max_tokens: int,
                     min_match: int = 1) -> list[list[int]]:
        """Per request, `propose`'s tokens where the match has at least min_match tokens
        (else []): all rows of a step in one pass (the scheduler's per-step call)."""
        found = self._search(request_ids, max_tokens, min_match)
        if found is None:
            return [[] for _ in request_ids]
        tokens, counts, _, _ = found
        R = len(counts)
        cut = np.flatnonzero(counts < max_tokens)  # [S] misses (0) and short pooled ones
        if 2 * len(cut) > R:  # mostly misses: the others' rows alone
            out: list[list[int]] = [[] for _ in range(R)]
            rows = np.flatnonzero(counts)
            for row, row_tokens, count in zip(rows.tolist(), tokens[rows].tolist(),
                                              counts[rows].tolist()):
                out[row] = row_tokens[:count]
            return out
        out = tokens.tolist()
        for row, count in zip(cut.tolist(), counts[cut].tolist()):
            out[row] = out[row][:count]
        return out

    def _rows(self, request_ids: Sequence[Hashable]) -> tuple[list[int], np.ndarray]:
        """The requests' slots, as a list and an array (the last call's again for the same
        requests: a step's)."""
        last = self._last
        if last is not None and last[0] == request_ids:
            return last[1], last[2]
        slots = [self._slots[i] for i in request_ids]
        rows = np.array(slots, np.int64)
        self._last = (list(request_ids), slots, rows, _address(rows))
        return slots, rows

    def _search_native(self, request_ids: Sequence[Hashable], max_tokens: int,
                       min_match: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`_search` in C (`sfx_search`): (tokens [R, K] int64 (0 past a row's count), counts
        [R] (0: no match), score [R] = 2 n + own for a match of n tokens (0: none)), K =
        max(max_tokens, 0)."""
        self.flush()
        R, K = len(request_ids), max(max_tokens, 0)
        out = _ZERO * (R * (K + 2))  # tokens, counts, scores (one allocation)
        at = out.buffer_info()[0]
        found = np.frombuffer(out, np.int64)
        tokens, counts, score = found[:R * K].reshape(R, K), found[R * K:R * K + R], \
            found[R * K + R:]
        if R and K:
            self._rows(request_ids)
            rows = self._last[3]
            self._native.search(self._native.ptr, R, rows, K,
                                max(min_match, self.min_ngram), at, at + 8 * R * K,
                                at + 8 * R * (K + 1))
        return tokens, counts, score

    def _iota(self, n: int) -> np.ndarray:
        """0 .. n - 1 (a view of a kept arange)."""
        if n > len(self._ahead):
            self._ahead = np.arange(2 * n)
        return self._ahead[:n]

    def _search(self, request_ids: Sequence[Hashable], max_tokens: int, min_match: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """Per request, where its suffix matched min_match tokens or more (None: no row):
        (tokens [R, max_tokens] (a row's first counts[r] are its proposal), counts [R] (0: no
        match), pooled [R] bool, match [R]). The longest and the shortest n of both kinds
        first, then the lengths between for rows that matched only the shortest: the best
        hit is the first column of _probe that holds one."""
        if self._native is not None:
            tokens, counts, score = self._search_native(request_ids, max_tokens, min_match)
            return tokens, counts, score & 1 == 0, score >> 1
        self.flush()
        fresh, self._flushed = self._flushed, None
        R = len(request_ids)
        columns = 2 * (self.max_ngram - max(min_match, self.min_ngram) + 1)  # n >= min_match
        if max_tokens < 1 or not R or columns <= 0:
            return None
        slots, rows = self._rows(request_ids)
        if fresh is not None and fresh[0] == slots:  # the rows flush just indexed, in order
            probe, start, stop = fresh[2], fresh[3], fresh[4]
        else:
            probe, start, stop = np.take(self._probe, rows, axis=0), None, None
        first = self._first_columns(columns)  # the longest and the shortest n, own and pooled
        values = self._table.get(probe[:, first] if columns > 4 else probe[:, :columns])  # [R, F]
        best = (values >= 0).argmax(1)  # [R] the first column with a hit (else 0)
        end = np.take(values, best + self._iota(R) * len(first))  # [R] where, -1: none
        hit = end >= 0  # [R]
        H = int(np.count_nonzero(hit))
        if not H:
            return None
        best = np.take(first, best)  # [R] its column in _probe
        if columns > 4:  # matched the shortest n only: the lengths between may match
            between = np.flatnonzero(best >= columns - 2)  # [U]
            if len(between):
                values = self._table.get(probe[between, 2:columns - 2])  # [U, C - 4]
                inner = (values >= 0).argmax(1)  # [U]
                found = np.take(values, inner + self._iota(len(between)) * (columns - 4))
                longer = found >= 0
                between = between[longer]
                best[between] = inner[longer] + 2
                end[between] = found[longer]
        pooled = end >= _POOLED  # [R]
        P = int(np.count_nonzero(pooled))
        ahead = self._iota(max_tokens)  # [K]
        if P < H:  # own: copy on from end + 1; past the row's end, from what is being copied
            if start is None:
                start, stop = np.take(self._start, rows), np.take(self._end, rows)
            period = np.maximum(stop - start - 1 - end, 1)  # [R] end + 1 .. its last token
            tokens = np.take(self._arena, (stop - period)[:, None] + ahead % period[:, None])
            counts = hit * max_tokens  # [R]
        if P:  # what followed in that output, up to its end
            g = np.where(pooled, end - (_POOLED + self._base), 0)  # [R] in _store
            at = np.minimum(g[:, None] + 1 + ahead, len(self._store) - 1)  # [R, K]
            theirs = np.take(self._store, at)
            tokens = theirs if P == H else np.where(pooled[:, None], theirs, tokens)
            own = hit * max_tokens if P == H else counts
            counts = np.where(pooled, np.minimum(np.take(self._ends, g) - (self._base + 1) - g,
                                                 max_tokens), own)
        return tokens - _ONE, counts, pooled, np.take(self._score, best) >> 1

    def _first_columns(self, columns: int) -> np.ndarray:
        """The first columns a lookup probes: the longest n and the shortest (of the first
        `columns`), own and pooled."""
        first = self._first.get(columns)
        if first is None:
            first = self._first[columns] = np.array(sorted({0, 1, columns - 2, columns - 1}),
                                                    np.intp)
        return first


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
