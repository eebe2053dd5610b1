"""The suffix index's batched path (runtime/suffix.py `SuffixIndex.propose_many` /
`lookup_many`, with `extend` indexing lazily, all rows at once): on random token streams of
several requests extended by different numbers of tokens a step, finished into the pool
in between, every row's proposal equals a brute-force search's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.runtime.suffix import Proposal, SuffixIndex


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


@settings(max_examples=120, deadline=None, derandomize=True)
@given(st.integers(2, 5), st.integers(1, 5), st.integers(0, 7), st.integers(1, 3),
       st.integers(1, 4),
       st.lists(st.tuples(st.lists(st.integers(0, 2), max_size=4), st.integers(0, 4)),
                min_size=1, max_size=40))
def test_batched_proposals_equal_a_brute_force_search(rows, max_ngram, max_tokens, min_match,
                                                       max_recent, steps):
    """Each step extends every live row by a count of tokens (0..4), then looks up all
    rows at once; a row is finished into the pool now and then and a new one takes its
    place."""
    lo = 1 if max_ngram == 1 else 2
    index = SuffixIndex(max_ngram=max_ngram, min_ngram=lo, max_recent=max_recent)
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
