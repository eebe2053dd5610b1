"""engine.generate with eos and pad: rows that stop while others go on, all rows stopping early
(a shorter output), generation up to max_seq_len, and eos/pad defaulting to the target's
generation config. Greedy against Hugging Face `generate` on the shared engines (tests/engines.py)."""

from __future__ import annotations

import pytest

from engines import (ENGINES, MAX_SEQ_LEN, VOCAB, assert_greedy_matches, check_stats,
                     eos_that_ends_one_row, hf_greedy, prompts)

# The tests/test_generate_*.py modules and tests/test_stream.py run on one xdist worker: the
# `engines` they share (conftest.py, ~5-15 s each) are built once, not on both workers.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.xdist_group("generate_engines")]


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_eos_in_the_middle_of_a_batch(engines, name: str) -> None:
    engine, target = engines(name)
    ids, mask = prompts([5, 9, 3], seed=11)
    T, max_new = ids.shape[1], 16
    free_run, _ = hf_greedy(target, ids, mask, max_new)
    token, row, index = eos_that_ends_one_row(free_run, T)
    unused = next(t for t in range(VOCAB) if t not in free_run[:, T:].flatten().tolist())
    eos, pad = [unused, token], VOCAB - 1
    ref, near_tie = hf_greedy(target, ids, mask, max_new, eos=eos, pad=pad)
    # The reference really pads the row that stopped, and the others go on.
    assert (ref[row, T + index + 1:] == pad).all() and ref.shape[1] == T + max_new

    engine.stats.reset()
    ours = engine.generate(ids, max_new, attention_mask=mask, eos_token_id=eos, pad_token_id=pad)
    assert_greedy_matches(ours, ref, near_tie, ids, eos)
    if engine.draft is not None:
        check_stats(engine)
    assert engine.stats.num_generated_tokens == (index + 1) + 2 * max_new


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_up_to_max_seq_len(engines, name: str) -> None:
    """Prompt + max_new_tokens == max_seq_len: the last verify writes into the cache's gamma + 1
    slots of headroom; one row stops early and stays frozen while the others run on."""
    engine, target = engines(name)
    ids, mask = prompts([10, 4, 7], seed=21)
    T = ids.shape[1]
    max_new = MAX_SEQ_LEN - T
    free_run, _ = hf_greedy(target, ids, mask, max_new)
    token, row, index = eos_that_ends_one_row(free_run, T)
    ref, near_tie = hf_greedy(target, ids, mask, max_new, eos=token, pad=0)
    assert ref.shape[1] == MAX_SEQ_LEN and (ref[row, T + index + 1:] == 0).all()
    ours = engine.generate(ids, max_new, attention_mask=mask, eos_token_id=token, pad_token_id=0)
    assert_greedy_matches(ours, ref, near_tie, ids, [token])


def test_all_rows_stop_early_and_the_output_is_shorter(engines) -> None:
    engine, target = engines("g8")
    ids, mask = prompts([4, 6], seed=5)
    T = ids.shape[1]
    free_run, _ = hf_greedy(target, ids, mask, 10)
    eos = [int(free_run[0, T + 1]), int(free_run[1, T + 2])]
    ref, near_tie = hf_greedy(target, ids, mask, 10, eos=eos, pad=0)
    assert ref.shape[1] < T + 10  # the reference stopped early: the case is exercised
    ours = engine.generate(ids, 10, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert_greedy_matches(ours, ref, near_tie, ids, eos)


def test_eos_and_pad_default_to_the_generation_config(engines, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, target = engines("plain")
    ids, mask = prompts([6, 3], seed=7)
    T = ids.shape[1]
    free_run, _ = hf_greedy(target, ids, mask, 8)
    token = int(free_run[1, T + 2])
    ref, near_tie = hf_greedy(target, ids, mask, 8, eos=token, pad=token)  # HF: pad = eos[0]
    monkeypatch.setattr(target.generation_config, "eos_token_id", token)
    ours = engine.generate(ids, 8, attention_mask=mask)
    assert_greedy_matches(ours, ref, near_tie, ids, [token])
    assert (ours[1, T + 3:] == token).all()  # padded with eos[0]: the case is exercised

    monkeypatch.setattr(target.generation_config, "pad_token_id", VOCAB - 1)
    ref, near_tie = hf_greedy(target, ids, mask, 8, eos=token, pad=VOCAB - 1)
    ours = engine.generate(ids, 8, attention_mask=mask)
    assert_greedy_matches(ours, ref, near_tie, ids, [token])
    assert (ours[1, T + 3:] == VOCAB - 1).all()
