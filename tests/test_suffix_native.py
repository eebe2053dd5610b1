"""The suffix index's compiled core (runtime/suffix_native.c, built by runtime/native.py): driven
by the same random streams of operations as the numpy index, it proposes the same tokens with
the same counts at every step (and the same sources, match lengths and pool); its table grows
and shrinks back; a build that fails falls back to numpy with one warning; a machine compiles
once."""

from __future__ import annotations

import logging
import random
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.runtime import native, suffix_index
from fuser.runtime.suffix_index import SuffixIndex

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
_OFF = pytest.mark.skipif(not native.enabled(), reason="FUSER_NATIVE=0")


class _SmallIndex(SuffixIndex):
    """Every array tiny at first: the rows move, the arena packs, the store moves, the
    native table doubles and halves many times."""

    _native_bits = 1
    _first_slots = 1
    _first_room = 2
    _first_arena = 16
    _first_store = 2


def _same(a: SuffixIndex, b: SuffixIndex, ids: list[int], width: int, min_match: int) -> None:
    """Both indexes propose alike for `ids`: propose_arrays' tokens up to each count, and the
    counts."""
    tokens_a, counts_a = a.propose_arrays(ids, width, min_match)
    tokens_b, counts_b = b.propose_arrays(ids, width, min_match)
    assert tokens_a.shape == tokens_b.shape == (len(ids), max(width, 0))
    assert counts_a.tolist() == counts_b.tolist()
    assert [t[:c] for t, c in zip(tokens_a.tolist(), counts_a.tolist())] == \
        [t[:c] for t, c in zip(tokens_b.tolist(), counts_b.tolist())]


@_OFF
@settings(max_examples=100, deadline=None, derandomize=True)
@given(st.integers(0, 2**32 - 1), st.sampled_from([SuffixIndex, _SmallIndex]),
       st.integers(1, 8), st.integers(0, 7), st.integers(1, 6), st.integers(4, 400),
       st.booleans(), st.sampled_from([3, 8, 1000]))
def test_native_and_numpy_propose_alike_at_every_step(seed, kind, max_ngram, below, max_recent,
                                                      recent_tokens, keep_prompts, vocab):
    """40 steps of a random stream: requests added with short (0-6) or long (50-300)
    prompts, each live row extended by 1-16 tokens (now and then twice before a lookup:
    merged extends), lookups at min_match 1-8 and widths 0-16, a request finished into the
    pool (evicting by max_recent and max_recent_tokens) or dropped now and then."""
    rng = random.Random(seed)
    options = dict(max_ngram=max_ngram, min_ngram=max(1, max_ngram - below),
                   max_recent=max_recent, max_recent_tokens=recent_tokens,
                   keep_prompts=keep_prompts)
    fast, slow = kind(native=True, **options), kind(native=False, **options)
    assert fast.native and not slow.native
    live: list[int] = []
    next_id = 0
    for _ in range(40):
        while len(live) < rng.randrange(1, 7):
            size = rng.randrange(7) if rng.random() < 0.7 else rng.randrange(50, 300)
            prompt = [rng.randrange(vocab) for _ in range(size)]
            fast.add_request(next_id, prompt)
            slow.add_request(next_id, prompt)
            live.append(next_id)
            next_id += 1
        for r in live + rng.sample(live, rng.randrange(len(live) + 1)):  # some twice
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 17))]
            fast.extend(r, new)
            slow.extend(r, new)
        ids = rng.sample(live, len(live))
        _same(fast, slow, ids, rng.randrange(17), rng.randrange(1, 9))
        if rng.random() < 0.3:
            width = rng.randrange(1, 9)
            assert fast.lookup_many(ids, width) == slow.lookup_many(ids, width)
            assert fast.propose_many(ids, width, 2) == slow.propose_many(ids, width, 2)
        action = rng.random()
        if action < 0.25:
            r = live.pop(rng.randrange(len(live)))
            fast.finish(r)
            slow.finish(r)
        elif action < 0.35:
            r = live.pop(rng.randrange(len(live)))
            fast.drop(r)
            slow.drop(r)
        assert (fast.recent_sequences, fast.recent_tokens, fast.pool_entries) == \
            (slow.recent_sequences, slow.recent_tokens, slow.pool_entries)
    for r in live:
        assert fast.tokens(r) == slow.tokens(r)


@_OFF
def test_the_table_grows_for_a_burst_and_shrinks_after_it():
    """A burst of long requests doubles the native table many times; once they are gone (and
    the pool holds little), it is back near its first size, and still proposes."""
    rng = random.Random(0)
    index = SuffixIndex(native=True, max_recent=2)
    first = len(index._native.table)
    for r in range(16):
        index.add_request(r, [rng.randrange(1000) for _ in range(2000)])
    index.propose_arrays(list(range(16)), 4, 2)
    burst = len(index._native.table)
    assert burst >= 64 * first
    for r in range(16):
        index.finish(r)
    assert index._native.count == index.pool_entries
    assert len(index._native.table) <= burst // 16
    index.add_request("again", [1, 2, 3, 1, 2])
    assert index.propose("again", 2) == [3, 1]


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """No library loaded in this process yet, and an empty cache: the next index builds."""
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(native, "_reasons", {})
    monkeypatch.setenv("FUSER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSER_NATIVE", raising=False)
    monkeypatch.delenv("FUSER_NATIVE_CFLAGS", raising=False)
    return tmp_path


def test_a_failed_build_falls_back_to_numpy_with_one_warning(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "/bin/false")
    with caplog.at_level(logging.WARNING, logger="fuser"):
        first, second = SuffixIndex(), SuffixIndex()
    assert not first.native and not second.native
    warnings = [r for r in caplog.records if "suffix_native" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].exc_info is None
    assert "/bin/false failed" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="cannot be built .*/bin/false failed"):
        SuffixIndex(native=True)
    first.add_request(0, [1, 2, 3, 1, 2])  # (numpy's, as ever)
    assert first.propose(0, 2) == [3, 1]


def test_no_compiler_and_native_off_fall_back(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with caplog.at_level(logging.WARNING, logger="fuser"):
        assert not SuffixIndex().native
    assert "no C compiler found (no-such-compiler-here" in caplog.text
    monkeypatch.delenv("CC")
    caplog.clear()
    monkeypatch.setenv("FUSER_NATIVE", "0")
    with caplog.at_level(logging.WARNING, logger="fuser"):
        assert not SuffixIndex().native  # off: no build, no warning
    assert not caplog.records
    with pytest.raises(RuntimeError, match="FUSER_NATIVE=0"):
        SuffixIndex(native=True)


def test_a_machine_compiles_once(fresh_build, monkeypatch):
    """The library lands in the cache directory under a key of source, compiler and
    platform; another process (here: the loader's memory cleared) loads it without
    compiling."""
    compiles = []
    run = subprocess.run

    def counting(args, **kwargs):
        if "-o" in args:
            compiles.append(args)
        return run(args, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", counting)
    assert SuffixIndex().native
    built = list((fresh_build / "native").iterdir())
    assert len(compiles) == 1 and [p.suffix for p in built] == [".so"]
    monkeypatch.setattr(native, "_loaded", {})
    assert SuffixIndex().native
    assert len(compiles) == 1 and list((fresh_build / "native").iterdir()) == built


@_OFF
def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="native='yes'"):
        SuffixIndex(native="yes")
    with pytest.raises(ValueError, match="max_ngram=65"):
        SuffixIndex(max_ngram=65)
    assert np.array_equal(SuffixIndex(native=True).propose_arrays([], 4)[1], np.zeros(0))
