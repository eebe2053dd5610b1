"""The Hugging Face fallback: a target that cannot be captured still generates and streams,
greedy and sampled, as Hugging Face `generate` does (on tests/engines.py's Llama target)."""

from __future__ import annotations

import pytest
import torch

import fuser
import fuser.pipeline
from engines import MAX_SEQ_LEN, assert_greedy_matches, hf_greedy, llama_target, prompts

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def test_uncapturable_target_falls_back_to_hf_generate(monkeypatch: pytest.MonkeyPatch) -> None:
    target = llama_target()
    # optimize() asks fuser.pipeline whether the model dispatches attention through the registry
    monkeypatch.setattr(fuser.pipeline, "supports_cache_attention", lambda model: False)
    with pytest.warns(UserWarning, match="eager"):
        engine = fuser.optimize(target, config=fuser.FuserConfig(max_batch_size=4,
                                                                 max_seq_len=MAX_SEQ_LEN))
    assert engine.target is None
    ids, mask = prompts([5, 2], seed=9)
    T = ids.shape[1]
    ref, near_tie = hf_greedy(target, ids, mask, 8, eos=3, pad=0)
    ours = engine.generate(ids, 8, attention_mask=mask, eos_token_id=3, pad_token_id=0)
    assert_greedy_matches(ours, ref, near_tie, ids, [3])
    columns = list(engine.stream(ids, 8, attention_mask=mask, eos_token_id=3, pad_token_id=0))
    assert torch.equal(torch.stack(columns, dim=1), ours[:, T:])

    kwargs = dict(attention_mask=mask, do_sample=True, top_k=10, seed=4)
    sampled = engine.generate(ids, 8, **kwargs)
    assert torch.equal(sampled, engine.generate(ids, 8, **kwargs))
    torch.manual_seed(4)
    with torch.no_grad():
        hf = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=10,
                             top_p=1.0, temperature=1.0)
    assert torch.equal(sampled, hf)
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(ids, 8, top_p=2.0)
