"""engine.generate greedy against Hugging Face `generate`, on every shared engine (tests/engines.py:
no draft, and drafts that reject, accept everything, or accept part), and no compilation after
optimize() for prompt shapes not seen before."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
import fuser.build
from engines import ENGINES, assert_greedy_matches, hf_greedy, prompts

# The tests/test_generate_*.py modules and tests/test_stream.py run on one xdist worker: the
# `engines` they share (conftest.py, ~5-15 s each) are built once, not on both workers.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.xdist_group("generate_engines")]


@pytest.mark.parametrize("name", ENGINES)
@settings(max_examples=4, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=4),
       max_new_tokens=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_greedy_matches_hf(engines, name: str, lengths: list[int], max_new_tokens: int,
                           seed: int) -> None:
    engine, target = engines(name)
    ids, mask = prompts(lengths, seed)
    ref, near_tie = hf_greedy(target, ids, mask, max_new_tokens)
    ours = engine.generate(ids, max_new_tokens, attention_mask=mask)
    assert ours.dtype == torch.long and ours.device == ids.device
    assert ours.shape[1] == ids.shape[1] + max_new_tokens  # no eos: every row runs to the end
    assert_greedy_matches(ours, ref, near_tie, ids, eos=[])


@pytest.mark.parametrize("name", ENGINES)
def test_greedy_prompt_of_one_token(engines, name: str) -> None:
    engine, target = engines(name)
    ids = torch.tensor([[7]])
    ref, near_tie = hf_greedy(target, ids, torch.ones_like(ids), 12)
    assert_greedy_matches(engine.generate(ids, 12), ref, near_tie, ids, eos=[])


# -- no compilation after optimize() ----------------------------------------------------------


@pytest.mark.parametrize("name", ["plain", "g8"])
def test_new_prompt_lengths_build_nothing(engines, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, target = engines(name)
    graphs = {m.role: dict(m.steps) for m in (engine.target, engine.draft) if m is not None}

    def no_export(*args: object, **kwargs: object) -> None:
        raise AssertionError("exported a graph after optimize()")

    monkeypatch.setattr(fuser.build, "export_step", no_export)
    monkeypatch.setattr(torch.export, "export", no_export)
    for lengths in ([13], [2, 11, 1], [1]):
        ids, mask = prompts(lengths, seed=len(lengths))
        out = engine.generate(ids, 3, attention_mask=mask)
        assert out.shape == (len(lengths), max(lengths) + 3)
    after = {m.role: dict(m.steps) for m in (engine.target, engine.draft) if m is not None}
    assert after == graphs
