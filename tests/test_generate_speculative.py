"""Speculative decoding through engine.generate: each shared draft (tests/engines.py) takes the
acceptance paths it is there for, sampling follows the target's distribution whatever the draft
proposes, and (on CUDA) a speculative step never waits for the device."""

from __future__ import annotations

import copy
import warnings
from collections import Counter

import pytest
import torch

import fuser
from engines import MAX_SEQ_LEN, check_stats, llama_target, perturbed, prompts
from fuser.runtime.sampling import process_logits

# The tests/test_generate_*.py modules and tests/test_stream.py run on one xdist worker: the
# `engines` they share (conftest.py, ~5-15 s each) are built once, not on both workers.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.xdist_group("generate_engines")]


@pytest.mark.parametrize("name", ["g1", "g4self", "g8"])
def test_speculation_takes_the_intended_paths(engines, name: str) -> None:
    """Which acceptance paths each draft exercises, so that the greedy tests cover them all."""
    engine, _ = engines(name)
    ids, mask = prompts([8, 3, 10, 5], seed=13)
    engine.stats.reset()
    engine.generate(ids, 24, attention_mask=mask)
    stats = check_stats(engine)
    assert stats.num_drafts > 0 and stats.num_generated_tokens == 4 * 24
    if name == "g4self":  # the draft is the target: every draft accepted, bonus every step
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    elif name == "g1":  # an unrelated draft: mostly rejected
        assert stats.acceptance_rate < 0.5
    else:  # a noisy copy: rows accept several drafts, but not all gamma, and sometimes none
        per_position = stats.accepted_per_position
        assert per_position[1] > 0 and per_position[-1] < per_position[0] < stats.num_drafts
    assert stats.mean_accepted_length == 1 + stats.num_accepted_tokens / stats.num_drafts
    assert stats.generate_seconds > 0


# -- sampling follows the target's distribution, whatever the draft proposes ------------------


def exact_joint(model: torch.nn.Module, prompt: list[int], steps: int, **warpers: object
                ) -> dict[tuple[int, ...], float]:
    """P(t_1..t_steps | prompt) under `model` after process_logits, for every nonzero sequence."""
    joint = {(): 1.0}
    for _ in range(steps):
        nxt = {}
        for seq, prob in joint.items():
            with torch.no_grad():
                logits = model(torch.tensor([prompt + list(seq)])).logits[0, -1]
            probs = process_logits(logits, **warpers)
            for token in torch.nonzero(probs).flatten().tolist():
                nxt[seq + (token,)] = prob * float(probs[token])
        joint = nxt
    return joint


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def test_speculative_sampling_follows_the_target_distribution(engines) -> None:
    """3 new tokens, top_k=2: 8 sequences; the empirical joint from engine.generate (gamma 8,
    a noisy draft: partial acceptance) against the target's exact joint."""
    engine, target = engines("g8")
    draft_model = perturbed(target, 0.05, seed=3)  # the same draft the engine holds
    prompt = [17, 42, 99, 5, 63, 120]
    warpers = dict(temperature=1.5, top_k=2, top_p=None)
    target_joint = exact_joint(target, prompt, 3, **warpers)
    draft_joint = exact_joint(draft_model, prompt, 3, **warpers)

    rows, calls = 64, 40  # 2560 samples
    ids = torch.tensor([prompt] * rows)
    engine.stats.reset()
    counts: Counter = Counter()
    for seed in range(calls):
        out = engine.generate(ids, 3, do_sample=True, seed=seed, **warpers)
        counts.update(tuple(row) for row in out[:, len(prompt):].tolist())
    n = rows * calls
    empirical = {k: c / n for k, c in counts.items()}
    assert set(empirical) <= set(target_joint), "a token outside the target's top-k"
    # With 8 cells and 2560 draws the TV of a correct sampler is about 0.02 (expected
    # 0.5 * sum sqrt(2 q (1 - q) / (pi n))); a sampler that followed the draft would be at
    # TV(target, draft), asserted below to be far beyond the bound.
    bound = 0.05
    assert total_variation(target_joint, draft_joint) > 3 * bound
    assert total_variation(empirical, target_joint) < bound, (empirical, target_joint)
    stats = check_stats(engine)
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects happen


# -- on CUDA, no host sync inside a step -------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_speculative_step_never_syncs_with_the_host(do_sample: bool) -> None:
    """On CUDA a whole step (draft, verify, accept, advance) queues work without waiting for
    the device; the caller's single read-back of `packed()` is the step's only sync."""
    from fuser.runtime import speculative
    from fuser.runtime.prompts import check_prompts, pad_batch

    target = llama_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(copy.deepcopy(target).cuda(),
                                draft=perturbed(target, 0.05, seed=3).cuda(),
                                config=fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4,
                                                         gamma=4, compile="fx"))
    ids, mask = prompts([5, 3], seed=1)
    checked = check_prompts(ids, mask, vocab_size=engine.vocab_size, max_batch_size=4,
                            max_tokens=MAX_SEQ_LEN, device=engine.device)
    bucket = engine.bucket(checked.batch)
    state = bucket.state
    state.load(30, [3], 0.8, 20, 0.9, engine.vocab_size, seed=0)
    speculative.prefill(bucket.target, bucket.draft, state, pad_batch(checked, bucket.batch, 2),
                        checked.length, engine.vocab_size, do_sample)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # uncaptured: what the step graph was captured from
            packed = speculative.speculative_step(bucket.target, bucket.draft, state,
                                                  engine.gamma, engine.vocab_size, do_sample)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert packed.cpu().shape == (bucket.batch, engine.gamma + 2)
