"""gamma="auto" on a real tiny engine: the controller inside the decoding loop picks gamma from
the acceptance it sees, switches speculation off when the draft never agrees, and on again when
it recovers; greedy output stays Hugging Face's throughout (the draft catching up included).

Acceptance is scripted by changing the draft's weights in place (the engine's draft shares its
parameters with the user's model): a copy of the target accepts everything, a scrambled one
nothing. Costs are scripted too (`Engine.set_step_costs`): on CPU, tiny models' step times are
Python overhead, a draft as slow as the target, and speculation would rightly never pay.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch

import fuser
from tiny import random_prompts, tiny_model

MAX_SEQ_LEN = 96
CANDIDATES = (1, 3)
# Target-only step 1.0; a speculative step at gamma g costs 1 + 0.1 g (draft ~ 1/10 target).
# Iteration costs (target-only = 1): a draft step costs 0.3 here, so a scrambled draft, which
# still agrees ~16% of the time by chance over this 160-token vocabulary, does not pay
# (gamma 1: 1.16 tokens for 1.3) while a perfect one does (gamma 3: 4 tokens for 1.9).
COSTS = {0: 1.0, 1: 1.3, 3: 1.9}


# One xdist worker runs the module: its cached engine is built once.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),  # conftest.py
              pytest.mark.xdist_group("adaptive_engine")]


@functools.cache
def engine_and_models() -> tuple[fuser.Engine, torch.nn.Module, torch.nn.Module]:
    target = tiny_model("llama", layers=1, seed=4)
    draft = copy.deepcopy(target)
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, gamma="auto",
                               gamma_candidates=CANDIDATES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=draft, config=config)
    assert engine.report().fallbacks == []
    assert engine.gammas == CANDIDATES and engine.adaptive
    # Measured at optimize time, for every built gamma and target-only.
    assert set(engine.step_costs[1]) == {0, *CANDIDATES}
    return engine, target, draft


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, n: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0,
                              eos_token_id=None)


def test_gamma_follows_scripted_acceptance_and_output_stays_lossless() -> None:
    engine, target, draft = engine_and_models()
    engine.set_step_costs(COSTS, probe_share=0.25, refresh=4)
    saved = [p.detach().clone() for p in draft.parameters()]
    ids, _ = random_prompts(1, [6], target.config.vocab_size, seed=11)
    n = 24
    ref = hf_greedy(target, ids, n)

    # 1. draft == target: every draft accepted, the largest gamma pays most.
    engine.stats.reset()
    out = engine.generate(ids, n, eos_token_id=[])
    assert torch.equal(out, ref)
    assert engine.stats.gamma == 3, engine.gamma_reason
    assert engine.stats.acceptance_rate == 1.0
    assert "gamma 3" in engine.gamma_reason

    # 2. a scrambled draft never agrees: speculation goes off (probes aside).
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 3)
    engine.stats.reset()
    out = engine.generate(ids, n, eos_token_id=[])
    assert torch.equal(out, ref)  # lossless through target-only stretches and probes
    assert engine.stats.acceptance_rate < 0.2
    controller = engine.controller(1)
    assert not controller.enabled or controller.in_probe, engine.gamma_reason
    assert "speculation off" in engine.gamma_reason or "probing" in engine.gamma_reason
    enabled = 1 if engine.stats.gamma > 0 else 0  # a probe may be due
    assert f"fuser_spec_decode_enabled {enabled}.0" in engine.metrics_text()

    # 3. the draft recovers: a probe sees it, speculation comes back on; the draft first
    # catches up on the tokens it missed, so the output is still the target's.
    with torch.no_grad():
        for p, s in zip(draft.parameters(), saved):
            p.copy_(s)
    engine.stats.reset()
    out = engine.generate(ids, MAX_SEQ_LEN - 6, eos_token_id=[])
    assert torch.equal(out, hf_greedy(target, ids, MAX_SEQ_LEN - 6))
    assert engine.stats.gamma == 3, engine.gamma_reason
    assert engine.stats.num_accepted_tokens > 0


def test_fixed_gamma_override_and_target_only() -> None:
    engine, target, draft = engine_and_models()
    ids, _ = random_prompts(1, [4], target.config.vocab_size, seed=12)
    ref = hf_greedy(target, ids, 10)
    for gamma in (0, 1, 3):
        engine.fix_gamma(gamma)
        engine.stats.reset()
        assert torch.equal(engine.generate(ids, 10, eos_token_id=[]), ref)
        assert engine.stats.gamma == gamma
        assert (engine.stats.num_drafts > 0) == (gamma > 0)
    engine.fix_gamma(None)
    with pytest.raises(ValueError, match="gamma=2"):
        engine.fix_gamma(2)


def test_config_validates_candidates_and_buckets() -> None:
    with pytest.raises(ValueError, match="gamma_candidates"):
        fuser.FuserConfig(gamma_candidates=(0, 2))
    with pytest.raises(ValueError, match="batch_buckets"):
        fuser.FuserConfig(max_batch_size=2, batch_buckets=(4,))
    assert fuser.FuserConfig(gamma=5).gammas == (5,)
    assert fuser.FuserConfig(gamma=0).gammas == ()
    cuda = torch.device("cuda")
    assert fuser.FuserConfig(max_batch_size=16).buckets_for(cuda) == (1, 2, 4, 8, 16)
    assert fuser.FuserConfig(max_batch_size=12).buckets_for(cuda) == (1, 2, 4, 8, 12)
    assert fuser.FuserConfig(max_batch_size=12).buckets_for(torch.device("cpu")) == (12,)


def test_compare_times_target_only_on_the_same_engine() -> None:
    """`compare.engine_generate(engine, ..., gamma=0)` runs the engine's own (captured) steps
    target-only, leaves no draft statistics behind and restores a gamma fixed before."""
    from fuser import compare

    engine, target, _ = engine_and_models()
    ids, _ = random_prompts(1, [4], target.config.vocab_size, seed=13)
    mask = torch.ones_like(ids)
    engine.fix_gamma(3)
    engine.stats.reset()
    out = compare.engine_generate(engine, [], 0, gamma=0)(ids, mask, 10)
    assert torch.equal(out, hf_greedy(target, ids, 10))
    assert engine.stats.num_drafts == 0 and engine.forced_gamma == 3
    engine.fix_gamma(None)
