"""Prefill through CUDA graphs at padded lengths (runtime/prefill_graphs.py): which lengths are
captured, and on a CUDA device, that a replay computes what the uncaptured prefill computes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import fuser
from fuser.runtime.prefill_graphs import PREFILL_BLOCK, PREFILL_GRAPH_MAX_TOKENS, padded_length
from fuser.runtime.steps import PREFILL
from tiny import random_prompts, tiny_model


@given(tokens=st.integers(1, 700), slots=st.integers(1, 700))
def test_padded_length_is_the_next_block_that_fits(tokens: int, slots: int) -> None:
    padded = padded_length(tokens, slots)
    fits = -(-tokens // PREFILL_BLOCK) * PREFILL_BLOCK
    if fits <= min(slots, PREFILL_GRAPH_MAX_TOKENS):
        assert padded == fits and padded % PREFILL_BLOCK == 0 and tokens <= padded < tokens + PREFILL_BLOCK
    else:
        assert padded is None


def test_padded_length_rejects_an_empty_prompt() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        padded_length(0, 64)


def test_cpu_engines_prefill_uncaptured_at_the_prompts_length() -> None:
    engine = fuser.optimize(tiny_model("llama", layers=1), config=fuser.FuserConfig(
        max_seq_len=64, compile="fx"))
    bucket = engine.bucket(1)
    assert bucket.prefills == [] and bucket.target.prefill_graphs is None
    assert [bucket.prefill_length(t) for t in (1, 2, 9, 40)] == [2, 2, 9, 40]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_prefill_graph_replays_the_uncaptured_prefill() -> None:
    # fp32: the last check compares greedy tokens across two prefill widths (9 vs 32 rows in
    # the GEMMs); in bf16 a one-ulp logit difference could flip an argmax of random weights.
    target = tiny_model("llama", layers=2, dtype=torch.float32).to("cuda")
    draft = tiny_model("llama", layers=1, seed=1, dtype=torch.float32).to("cuda")
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        max_seq_len=96, max_batch_size=2, gamma=2, compile="fx"))
    bucket = engine.bucket(2)
    assert bucket.prefill_length(9) == PREFILL_BLOCK
    ids, mask = random_prompts(2, [9, 5], target.config.vocab_size, seed=4)
    out = engine.generate(ids.cuda(), 12, attention_mask=mask.cuda(), eos_token_id=[])
    replays = engine.report().graph_replays
    assert replays[f"prefill.b2.target.t{PREFILL_BLOCK}"] == 1
    assert replays[f"prefill.b2.draft.t{PREFILL_BLOCK}"] == 1
    assert engine.report().fallbacks == []
    # The replay against the uncaptured step at the same padded length, same cache state.
    model = bucket.target
    tokens = torch.randint(0, target.config.vocab_size, (2, PREFILL_BLOCK), device="cuda")
    positions = torch.arange(PREFILL_BLOCK, device="cuda")[None].repeat(2, 1)
    model.cache.begin(torch.zeros(2, dtype=torch.long, device="cuda"))
    captured = model.run(PREFILL, tokens, positions).clone()
    model.cache.begin(torch.zeros(2, dtype=torch.long, device="cuda"))
    plain = model[PREFILL](tokens, positions, model.cache.seq_lens, model.cache.starts)
    assert torch.equal(captured, plain)
    # Greedy output with captured prefill equals the output with it off.
    for prefill in bucket.prefills:
        prefill.model.prefill_graphs = None
    bucket.prefills = []
    again = engine.generate(ids.cuda(), 12, attention_mask=mask.cuda(), eos_token_id=[])
    assert torch.equal(out, again)
