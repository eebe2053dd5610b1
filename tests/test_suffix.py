"""The suffix speculator (runtime/suffix.py): what the index proposes (the continuation of a
repeated span, own context first, bounded memory, and on random sequences exactly the
continuation of the longest, latest earlier occurrence), that point-mass acceptance samples
the target's distribution, and that greedy decoding with suffix proposals on an engine equals
target-only greedy decoding."""

from __future__ import annotations

import functools
import shutil
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from engines import MAX_SEQ_LEN, assert_greedy_matches, hf_greedy, llama_target, prompts
from fuser.runtime import native as native_code
from fuser.runtime import speculative
from fuser.runtime.prompts import check_prompts, pad_batch
from fuser.runtime.sampling import accept_sampling
from fuser.runtime.suffix import Proposal, SuffixIndex, SuffixProposals, accept_proposals, \
    add_verify_steps, proposals_tensor, suffix_step

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

# The index's tests run on both of its implementations: the compiled core (where a C compiler
# is found and FUSER_NATIVE=0 does not turn it off) and numpy.
_NO_NATIVE = pytest.mark.skipif(
    (shutil.which("cc") is None and shutil.which("gcc") is None) or not native_code.enabled(),
    reason="no C compiler, or FUSER_NATIVE=0")
impls = pytest.mark.parametrize("native", [pytest.param(True, marks=_NO_NATIVE), False],
                                ids=["native", "numpy"])


# -- the index ----------------------------------------------------------------------------------


@impls
def test_proposes_the_continuation_of_a_repeated_span(native):
    index = SuffixIndex(native=native)
    index.add_request("a", [9, 1, 2, 3, 4, 5, 6, 8, 1, 2, 3])
    assert index.lookup("a", 4) == index.lookup("a", 4)  # lookups change nothing
    proposal = index.lookup("a", 4)
    assert proposal.tokens == [4, 5, 6, 8] and proposal.source == "own" and proposal.match == 3
    index.extend("a", [4, 5])  # the request follows the span: the match grows with it
    assert index.lookup("a", 3).tokens == [6, 8, 1] and index.lookup("a", 3).match == 5
    index.extend("a", [7])  # leaves it: "5 7" never occurred, nor "7"
    assert index.propose("a", 3) == []


@impls
def test_a_repeating_pattern_proposes_past_the_end_of_what_was_seen(native):
    index = SuffixIndex(max_ngram=4, native=native)
    index.add_request(0, [1, 2, 3, 1, 2, 3, 1, 2])
    assert index.propose(0, 7) == [3, 1, 2, 3, 1, 2, 3]
    index.add_request(1, [4, 4, 4])
    assert index.propose(1, 3) == [4, 4, 4]


@impls
def test_prefers_its_own_context_and_a_longer_match(native):
    index = SuffixIndex(native=native)
    index.add_request("old", [50])
    index.extend("old", [1, 2, 3, 20, 21, 30, 2, 3, 40])
    index.finish("old")  # the recent pool holds its output, 1 2 3 20 21 30 2 3 40
    # "2 3" is the longest earlier match both in the request and in the pool: its own wins.
    index.add_request("tie", [7, 2, 3, 11, 12, 5, 2, 3])
    assert index.lookup("tie", 2) == Proposal([11, 12], "own", 2)
    # Nothing of its own ("2 3" never occurred before in it), "1 2 3" in the pool.
    index.add_request("recent", [60, 61, 8, 9, 1, 2, 3])
    assert index.lookup("recent", 3) == Proposal([20, 21, 30], "recent", 3)
    # Its own "2 3" against the pool's longer "21 30 2 3": the longer match wins.
    index.add_request("longer", [2, 3, 77, 21, 30, 2, 3])
    assert index.lookup("longer", 1) == Proposal([40], "recent", 4)


@impls
def test_recent_outputs_are_bounded_and_evicted_oldest_first(native):
    index = SuffixIndex(max_ngram=4, min_ngram=2, max_recent=3, max_recent_tokens=25,
                        native=native)
    for r in range(10):
        index.add_request(r, [0])
        index.extend(r, [100 + r, 1, 2, 3, 200 + r, 4, 5])  # a span shared by all, then own
        index.finish(r)
        assert index.recent_sequences <= 3 and index.recent_tokens <= 25
        assert index.pool_entries <= index.recent_tokens * 3  # 3 n-gram lengths a position
    assert index.recent_sequences == 3 and index.recent_tokens == 21
    index.add_request("q", [1, 2, 3])
    assert index.propose("q", 1) == [209]  # the latest output wins
    index.drop("q")
    index.add_request("q", [101, 1])  # an evicted output proposes nothing any more
    assert index.propose("q", 2) == []
    index.add_request("q2", [109, 1])
    assert index.propose("q2", 2) == [2, 3]
    with pytest.raises(ValueError, match="already"):
        index.add_request("q2", [1])
    with pytest.raises(ValueError, match="min_ngram"):
        SuffixIndex(max_ngram=2, min_ngram=3)


def _occurrences(seq: list[int], gram: list[int], before: int) -> list[int]:
    """End positions p < before of `gram` in seq."""
    n = len(gram)
    return [p for p in range(n - 1, before) if seq[p - n + 1:p + 1] == gram]


@impls
@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
       st.integers(1, 6), st.integers(1, 4), st.integers(1, 3))
def test_every_proposal_is_the_continuation_of_the_longest_latest_earlier_match(
        native, requests, max_tokens, max_ngram, max_recent):
    """Brute force over the index's contents: the match is the longest suffix (min_ngram..
    max_ngram) that occurred earlier in the request or in a pooled output (own on a tie), and
    the proposal is what followed its latest occurrence (own: copied on past the end)."""
    min_ngram = 1 if max_ngram == 1 else 2
    index = SuffixIndex(max_ngram=max_ngram, min_ngram=min_ngram, max_recent=max_recent,
                        native=native)
    pool: list[list[int]] = []  # the outputs the pool should hold, oldest first
    for r, tokens in enumerate(requests):
        prompt, output = tokens[:len(tokens) // 2], tokens[len(tokens) // 2:]
        index.add_request(r, prompt)
        for i in range(len(output) + 1):
            if i:
                index.extend(r, output[i - 1:i])
            seq = prompt + output[:i]
            got = index.lookup(r, max_tokens)
            best = (0, "", [])
            for n in range(max_ngram, min_ngram - 1, -1):
                if n > len(seq):
                    continue
                gram = seq[len(seq) - n:]
                own = _occurrences(seq, gram, len(seq) - 1)
                recent = [(s, p) for s, out in enumerate(pool)
                          for p in _occurrences(out, gram, len(out) - 1)]
                if own:
                    p = own[-1]
                    copied = list(seq)
                    for j in range(max_tokens):
                        copied.append(copied[p + 1 + j])
                    best = (n, "own", copied[len(seq):])
                    break
                if recent:
                    s, p = max(recent)
                    best = (n, "recent", pool[s][p + 1:p + 1 + max_tokens])
                    break
            assert (got.match, got.source, got.tokens) == best, (seq, pool)
        index.finish(r)
        if len(output) >= 2:
            pool = (pool + [output])[-max_recent:]


def test_proposals_tensor_pads_and_cuts():
    out = proposals_tensor([[5, 6, 7], [], [8]], gamma=2, batch=4, fill=1)
    assert out.tolist() == [[5, 6], [1, 1], [8, 1], [1, 1]]


# -- acceptance of point-mass drafts ------------------------------------------------------------


def test_accept_proposals_is_accept_sampling_with_one_hot_drafts():
    generator = torch.Generator().manual_seed(0)
    B, gamma, V = 64, 3, 7
    q = torch.softmax(torch.randn(B, gamma + 1, V, generator=generator) * 2, dim=-1)
    proposals = torch.randint(0, V, (B, gamma), generator=generator)
    one_hot = torch.nn.functional.one_hot(proposals, V).float()
    for seed in range(5):
        ours = accept_proposals(proposals, q, torch.Generator().manual_seed(seed))
        theirs = accept_sampling(proposals, one_hot, q, torch.Generator().manual_seed(seed))
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    keys = (torch.arange(B), torch.full((B,), 3))
    ours = accept_proposals(proposals, q, keys=keys)
    theirs = accept_sampling(proposals, one_hot, q, keys=keys)
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("rng", ["generator", "keys"])
def test_point_mass_acceptance_samples_the_targets_distribution(rng):
    """Each emitted token follows q at its position, whatever is proposed: the first one q_0,
    the second (where the first was the accepted proposal) q_1, the bonus q_2."""
    N, V = 60000, 5
    q_rows = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05],
                           [0.05, 0.05, 0.6, 0.2, 0.1],
                           [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = q_rows[None].expand(N, 3, V)
    proposals = torch.tensor([[1, 2]]).expand(N, 2)  # x_1 = 1 (q 0.2), x_2 = 2 (q 0.6)
    if rng == "generator":
        n, nxt = accept_proposals(proposals, q, torch.Generator().manual_seed(1))
    else:
        n, nxt = accept_proposals(proposals, q, keys=(torch.arange(N) * 7919, torch.zeros(
            N, dtype=torch.long)))
    first = torch.where(n >= 1, 1, nxt)
    second = torch.where(n >= 2, 2, nxt)[n >= 1]
    bonus = nxt[n == 2]
    for tokens, expected in ((first, q_rows[0]), (second, q_rows[1]), (bonus, q_rows[2])):
        freq = torch.bincount(tokens, minlength=V).double() / tokens.numel()
        # 5 standard errors of each frequency
        bound = 5 * torch.sqrt(expected.double() * (1 - expected.double()) / tokens.numel())
        assert ((freq - expected.double()).abs() <= bound).all(), (freq, expected)
    assert (n == 0).double().mean().item() == pytest.approx(0.8, abs=0.01)  # 1 - q_0(x_1)


# -- on an engine -------------------------------------------------------------------------------


GAMMA = 4


@functools.cache
def plain_engine() -> fuser.Engine:
    """A target-only engine (no draft) given verify steps for the suffix proposals."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(llama_target(), config=fuser.FuserConfig(
            max_seq_len=MAX_SEQ_LEN, max_batch_size=2))
    assert engine.draft is None
    for bucket in engine.buckets.values():
        assert add_verify_steps(bucket.target, [GAMMA], engine.config, engine.device) == [GAMMA]
        assert add_verify_steps(bucket.target, [GAMMA], engine.config, engine.device) == []
    return engine


def suffix_generate(engine: fuser.Engine, ids: torch.Tensor, mask: torch.Tensor,
                    max_new_tokens: int, index: SuffixIndex) -> tuple[torch.Tensor, int, int]:
    """Greedy decoding where each step verifies the index's proposals (a target-only step
    when no row has one): (the prompts followed by the output, steps, accepted proposals)."""
    prompts_ = check_prompts(ids, mask, vocab_size=engine.vocab_size,
                             max_batch_size=engine.config.max_batch_size,
                             max_tokens=engine.config.max_seq_len, device=engine.device)
    B, T, V = prompts_.batch, prompts_.length, engine.vocab_size
    bucket = engine.bucket(B)
    state, target = bucket.state, bucket.target
    state.load(max_new_tokens, [], 1.0, None, None, V)
    padded = pad_batch(prompts_, bucket.batch, min_length=bucket.prefill_length(T))
    first = speculative.prefill(target, None, state, padded, T, V, False).packed()
    out = [[int(first[b, 0])] for b in range(B)]
    for b in range(B):
        index.add_request(b, prompts_.tokens[b, int(prompts_.starts[b]):].tolist() + out[b])
    buffer = SuffixProposals(bucket.batch, GAMMA, engine.device)
    steps = accepted = 0
    while any(len(row) < max_new_tokens for row in out):
        proposals = [index.propose(b, GAMMA) for b in range(B)]
        if any(proposals):
            buffer.load(proposals, GAMMA)
            packed = buffer.iteration(target, state, GAMMA, V, do_sample=False)()
        else:
            packed = speculative.plain_step(target, state, V, False)
        steps += 1
        for b in range(B):
            n = int(packed[b, -1])
            kept = packed[b, :n + 1].tolist()[:max_new_tokens - len(out[b])]
            accepted += min(n, len(kept))
            out[b] += kept
            index.extend(b, kept)
    for b in range(B):
        index.finish(b)
    return torch.cat([ids, torch.tensor(out)], dim=1), steps, accepted


def test_greedy_with_suffix_proposals_equals_target_only_greedy():
    """Each prompt twice: the first time the proposals come from the request itself (the tiny
    target seldom repeats itself: mostly rejected), the second time from the pool, which holds
    the first answer (templated traffic: nearly all accepted). Both equal target-only greedy."""
    engine = plain_engine()
    index = SuffixIndex(max_ngram=4, keep_prompts=True)
    for seed in range(2):
        ids, mask = prompts([9, 14], seed=seed)
        ref, near_tie = hf_greedy(llama_target(), ids, mask, max_new_tokens=40)
        assert torch.equal(ref, engine.generate(ids, max_new_tokens=40, attention_mask=mask))
        steps = []
        for _ in range(2):
            out, step_count, accepted = suffix_generate(engine, ids, mask, 40, index)
            assert_greedy_matches(out, ref, near_tie, ids, [])
            steps.append((step_count, accepted))
        # The replay: 39 tokens after the prefill's, GAMMA + 1 a step when all are accepted.
        replay_steps, replay_accepted = steps[1]
        assert replay_steps <= 39 // (GAMMA + 1) + 2 and replay_accepted >= 2 * 30, steps


def test_suffix_step_samples_like_point_mass_acceptance():
    """Seeded sampling through the engine: suffix_step's tokens are accept_proposals' over the
    target's distribution at the verified positions."""
    engine = plain_engine()
    bucket = engine.bucket(2)
    state, target, V = bucket.state, bucket.target, engine.vocab_size
    ids, mask = prompts([5, 8], seed=7)
    prompts_ = check_prompts(ids, mask, vocab_size=V, max_batch_size=2, max_tokens=MAX_SEQ_LEN,
                             device=engine.device)
    padded = pad_batch(prompts_, bucket.batch, min_length=bucket.prefill_length(8))
    proposals = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])

    def run(step: object) -> torch.Tensor:
        state.load(20, [], 0.8, None, None, V)
        speculative.prefill(target, None, state, padded, 8, V, True)
        return step()

    packed = run(lambda: suffix_step(target, state, proposals, V, True,
                                         torch.Generator().manual_seed(3)))

    def by_hand() -> torch.Tensor:
        logits = speculative.verify(target, state, proposals, V, fused=False)
        q = speculative.probs(state, logits.float())
        n, nxt = accept_proposals(proposals, q, torch.Generator().manual_seed(3))
        return torch.cat([speculative._emit(proposals, n, nxt).tokens, n[:, None]], dim=1)

    expected = run(by_hand)
    assert torch.equal(packed, expected)
