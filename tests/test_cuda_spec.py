"""Step graphs on a CUDA device (skipped elsewhere): each decoding iteration is one CUDA graph
replay, and greedy speculative output equals fuser's own target-only greedy output."""

from __future__ import annotations

import pytest
import torch

import fuser
from tiny import random_prompts, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_step_graph_greedy_equals_target_only_and_replays_once_per_step() -> None:
    target = tiny_model("llama", layers=2, dtype=torch.bfloat16).to("cuda")
    draft = tiny_model("llama", layers=1, seed=1, dtype=torch.bfloat16).to("cuda")
    # compile="fx": the subject is the step graphs, not Inductor (which costs minutes here).
    config = fuser.FuserConfig(max_seq_len=96, max_batch_size=4, gamma="auto",
                               gamma_candidates=(1, 3), compile="fx")
    engine = fuser.optimize(target, draft=draft, config=config)
    assert engine.report().fallbacks == []
    assert sorted(engine.buckets) == [1, 2, 4]
    ids, mask = random_prompts(3, [9, 5, 7], target.config.vocab_size, seed=3)
    ids, mask = ids.cuda(), mask.cuda()
    eos = [target.config.vocab_size - 1]
    engine.fix_gamma(0)
    plain = engine.generate(ids, 40, attention_mask=mask, eos_token_id=eos)
    for gamma in (1, 3):
        engine.fix_gamma(gamma)
        before = engine.report().graph_replays.get(f"step.b4.gamma{gamma}.greedy", 0)
        engine.stats.reset()
        out = engine.generate(ids, 40, attention_mask=mask, eos_token_id=eos)
        assert torch.equal(out, plain)  # bf16: speculative greedy == fuser's target-only greedy
        replays = engine.report().graph_replays[f"step.b4.gamma{gamma}.greedy"] - before
        # One replay per speculative step: each counted step is one draft per active row.
        assert replays > 0 and engine.stats.num_drafts <= 3 * replays
        assert engine.bucket(3).uncaptured_runs.get((gamma, False), 0) == 0
    engine.fix_gamma(None)
    # One row on the 4-row engine runs in bucket 1.
    one = engine.generate(ids[:1, -9:], 20, eos_token_id=eos)
    assert engine.report().graph_replays.get("step.b1.plain.greedy", 0) + sum(
        engine.report().graph_replays.get(f"step.b1.gamma{g}.greedy", 0) for g in (1, 3)) > 0
    assert one.shape[0] == 1


def test_seeded_sampling_through_step_graphs_is_reproducible() -> None:
    target = tiny_model("qwen2", layers=2, dtype=torch.bfloat16).to("cuda")
    draft = tiny_model("qwen2", layers=1, seed=1, dtype=torch.bfloat16).to("cuda")
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(max_seq_len=64, gamma=2,
                                                                              compile="fx"))
    ids, _ = random_prompts(1, [6], target.config.vocab_size, seed=2)
    kwargs = dict(do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=7, eos_token_id=[])
    a = engine.generate(ids.cuda(), 30, **kwargs)
    b = engine.generate(ids.cuda(), 30, **kwargs)
    assert torch.equal(a, b)
    assert engine.report().graph_replays["step.b1.gamma2.sample"] > 0


@pytest.mark.xfail(strict=True, reason="on the H200 the overlapped step graph's "
                   "greedy output differed from target-only (cause not found; also with "
                   "FUSER_BRANCHES=serial and with FUSER_PDL=0, so not a race); the engine keeps overlap off on CUDA, so this runs the buckets with "
                   "overlap forced on")
def test_overlapped_step_graph_greedy_equals_target_only() -> None:
    """FuserConfig(overlap=True): the draft's branch runs beside the target's in the step graph;
    greedy output equals fuser's target-only greedy output, one replay per step, and rows
    stream (a draft equal to the target accepts nearly everything)."""
    target = tiny_model("llama", layers=2, dtype=torch.bfloat16).to("cuda")
    import copy

    for draft, gamma in ((tiny_model("llama", layers=1, seed=1, dtype=torch.bfloat16).to("cuda"), 2),
                         (copy.deepcopy(target), 3)):
        config = fuser.FuserConfig(max_seq_len=96, max_batch_size=4, gamma=gamma, compile="fx",
                                   overlap=True)
        engine = fuser.optimize(target, draft=draft, config=config)
        for bucket in engine.buckets.values():  # the engine's CUDA guard, bypassed
            bucket.overlap = True
            bucket.graphs.clear()
        engine.prepare()
        ids, mask = random_prompts(3, [9, 5, 7], target.config.vocab_size, seed=3)
        ids, mask = ids.cuda(), mask.cuda()
        engine.fix_gamma(0)
        plain = engine.generate(ids, 40, attention_mask=mask, eos_token_id=[])
        engine.fix_gamma(gamma)
        name = f"step.b4.gamma{gamma}.greedy"
        before = engine.report().graph_replays.get(name, 0)
        engine.stats.reset()
        out = engine.generate(ids, 40, attention_mask=mask, eos_token_id=[])
        assert torch.equal(out, plain)
        replays = engine.report().graph_replays[name] - before
        assert replays > 0 and engine.stats.num_drafts <= 3 * replays
        assert engine.bucket(3).uncaptured_runs.get((gamma, False), 0) == 0
        if gamma == 3:
            assert engine.stats.num_accepted_tokens >= 0.6 * engine.stats.num_draft_tokens
