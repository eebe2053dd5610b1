"""Decode and verify steps attending through the split-K kernel (the default:
fuser::cache_attention_read, which the rotary_attention pass turns into
fuser::rotary_cache_attention), and the ATen path that FuserConfig(fused_attention=False) keeps."""

from __future__ import annotations

import pytest
import torch

import fuser
from fuser.numerics import LOGITS_TOLERANCE, relative_error
from tiny import families_in_ci, hf_logits, random_prompts, tiny_model


# Mistral is the family tested with a sliding window here; the others attend over everything.
WINDOW = {"mistral": 3}


# Qwen2 (its attention is Llama's; its biases are the projections tests'): -m slow
@pytest.mark.parametrize("family", families_in_ci("llama", "mistral"))
def test_fused_attention_in_decode_and_verify(family: str) -> None:
    window = WINDOW.get(family)
    target = tiny_model(family, layers=2, sliding_window=window)
    draft = tiny_model(family, layers=1, seed=1, sliding_window=window)
    config = fuser.FuserConfig(max_batch_size=2,
                               batch_buckets=(2,), max_seq_len=32, gamma=4, fused_attention=True)
    engine = fuser.optimize(target, draft=draft, config=config)
    graphs = engine.report().graphs
    for name in ("target.decode", "target.verify", "draft.decode", "draft.catchup"):
        layers = (target if name.startswith("target") else draft).config.num_hidden_layers
        # the split-K kernel, with rotary and the cache write folded in (rotary_attention pass)
        assert graphs[name]["rotary_cache_attention"] == layers, name
    for op in ("cache_attention_read", "rotary_cache_attention"):  # prefill attends among new tokens
        assert op not in graphs["target.prefill"]
    assert engine.report().fallbacks == []

    ids, mask = random_prompts(2, [6, 3], target.config.vocab_size, seed=2)
    out = engine.logits(ids, attention_mask=mask)
    ref = hf_logits(target, ids, mask)
    assert relative_error(out[mask.bool()], ref[mask.bool()]) <= LOGITS_TOLERANCE[torch.float32]

    eos = [target.config.vocab_size - 1]
    got = engine.generate(ids, 12, attention_mask=mask, eos_token_id=eos)
    plain = fuser.optimize(target, config=fuser.FuserConfig(max_batch_size=2,
                                                            batch_buckets=(2,), max_seq_len=32))
    want = plain.generate(ids, 12, attention_mask=mask, eos_token_id=eos)
    assert torch.equal(got, want)


def test_default_is_fused_and_false_keeps_aten_attention() -> None:
    target = tiny_model("llama", layers=2)
    ids, mask = random_prompts(1, [5], target.config.vocab_size, seed=4)
    eos = [target.config.vocab_size - 1]
    outputs = []
    for fused in (None, False):
        options = {} if fused is None else {"fused_attention": fused}
        engine = fuser.optimize(target, config=fuser.FuserConfig(max_seq_len=32, **options))
        count = engine.report().graphs["target.decode"].get("rotary_cache_attention", 0)
        assert count == (2 if fused is None else 0)
        outputs.append(engine.generate(ids, 10, attention_mask=mask, eos_token_id=eos))
    assert torch.equal(*outputs)
