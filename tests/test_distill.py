"""Online draft distillation (runtime/distill.py): the swap reaches every tensor the compiled
draft reads (plain and FP8 engines), the target's output never changes, a step during a swap
sees old or new weights only, the loss falls and agreement rises on a scripted domain shift,
and a worse candidate is rejected with the old weights kept bit for bit."""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings

import pytest
import torch

import fuser
from engines import MAX_SEQ_LEN, NO_SPECIAL, VOCAB, assert_greedy_matches, hf_greedy, \
    llama_target, prompts
from fuser.ops.fp8 import emulated_fp8
from fuser.passes.fp8 import MAX_ROWS  # the rows up to which the FP8 pass keeps a GEMV
from fuser.runtime.distill import DistillConfig, Distiller, WeightSwap, draft_module, \
    draft_weight_targets, topk_targets
from fuser.runtime.steps import CATCHUP, DECODE, PREFILL, RESYNC
from tiny import relative_error, tiny_model

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

PREFIX = 8  # prompt tokens run by the prefill step before the fixed-T steps


def mistral(seed: int) -> torch.nn.Module:
    """A draft of tests/engines.py's draft shape (1 layer, hidden 32); seed picks its weights."""
    return tiny_model("mistral", seed=seed, vocab=VOCAB, heads=2, kv_heads=1, head_dim=16,
                      intermediate=64, layers=1, init_range=0.3, **NO_SPECIAL)


@functools.cache
def built(precision: str = "auto", compile: str = "auto") -> tuple[fuser.Engine, torch.nn.Module]:
    """(engine of llama_target with a mistral draft at gamma 2, the draft given to it)."""
    draft = mistral(seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(llama_target(), draft=draft, config=fuser.FuserConfig(
            max_seq_len=MAX_SEQ_LEN, max_batch_size=2, gamma=2, precision=precision,
            compile=compile))
    assert engine.draft is not None and engine.report().fallbacks == []
    return engine, draft


def step_logits(steps: object, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The draft's logits over ids [N] through its built steps: prefill of PREFIX tokens, then
    each fixed-T step in turn (resync where built, catch-up, decode): ([N', V] for the first N'
    positions they cover, how many leading positions an FP8 engine quantizes the activations
    of: the prefill's, and the resync's where its B x T rows are beyond the GEMV's)."""
    cache = steps.cache
    B = cache.batch_size
    kinds = [k for k in (RESYNC, CATCHUP, DECODE) if k in steps]
    n = PREFIX + sum(k.tokens for k in kinds)
    tokens = ids[:n][None].expand(B, n).contiguous()
    positions = torch.arange(n)[None].expand(B, n).contiguous()
    cache.reset()
    out = [steps.run(PREFILL, tokens[:, :PREFIX], positions[:, :PREFIX])]
    cache.set_lengths(PREFIX)
    at, quantized = PREFIX, PREFIX
    for kind in kinds:
        T = kind.tokens
        out.append(steps.run(kind, tokens[:, at:at + T].clone(), positions[:, at:at + T].clone()))
        cache.advance(T)
        if quantized == at and B * T > MAX_ROWS:
            quantized += T
        at += T
    cache.reset()
    return torch.cat(out, dim=1)[0].float(), quantized  # [n, V]


def eager_logits(model: torch.nn.Module, ids: torch.Tensor, quantized: int | None = None
                 ) -> torch.Tensor:
    """model's logits over ids [N]: [N, V]; FP8 emulated when `quantized` (the leading
    positions whose activations are quantized) is given."""
    emulate = contextlib.nullcontext() if quantized is None else \
        emulated_fp8(model, prefill_tokens=quantized)
    with torch.no_grad(), emulate:
        return model(input_ids=ids[None], position_ids=torch.arange(ids.shape[0])[None]
                     ).logits[0].float()


SEQUENCE = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("precision,compile", [
    ("auto", "auto"), ("fp8", "auto"),
    # Inductor's compiled steps read the same tensors, lifted to inputs (about 50 s to build)
    pytest.param("auto", "inductor", marks=pytest.mark.slow)])
def test_swap_reaches_every_tensor_the_draft_graphs_read(precision, compile):
    engine, draft = built(precision, compile)
    fp8 = precision == "fp8"
    every_steps = {id(b.draft): b.draft for b in engine.buckets.values()}
    swap = WeightSwap.for_engine(engine)
    names = {t.name for t in swap.targets}
    if fp8:  # the quantized merged QKV and gate/up and the LM head are targets of their own
        assert any("fuser_merged" in n and "q_proj" in n for n in names), names
        assert any("fuser_fp8__" in n and "lm_head" in n for n in names), names
    new = mistral(seed=7)
    old_state = {n: p.detach().clone() for n, p in draft.named_parameters()}
    try:
        for steps in every_steps.values():
            got, quantized = step_logits(steps, SEQUENCE)
            ids, q = SEQUENCE[:got.shape[0]], quantized if fp8 else None
            # Before: the engine computes the old draft, far from the new one.
            assert relative_error(got, eager_logits(draft, ids, q)) < 1e-4
            assert relative_error(got, eager_logits(new, ids, q)) > 0.1
        swap.swap(new.state_dict())
        for steps in every_steps.values():
            got, quantized = step_logits(steps, SEQUENCE)
            ids, q = SEQUENCE[:got.shape[0]], quantized if fp8 else None
            assert relative_error(got, eager_logits(new, ids, q)) < 1e-4
    finally:
        swap.swap(old_state)
    for steps in every_steps.values():  # and back: the old values, the same tensors
        got, quantized = step_logits(steps, SEQUENCE)
        ids, q = SEQUENCE[:got.shape[0]], quantized if fp8 else None
        assert relative_error(got, eager_logits(draft, ids, q)) < 1e-4


def test_a_tensor_not_made_of_the_parameters_is_refused():
    engine, _ = built()
    gm = engine.draft[DECODE].rewritten
    gm.register_buffer("stray_weight", torch.zeros(4, 4))
    node = gm.graph.get_attr("stray_weight")
    try:
        with pytest.raises(ValueError, match="stray_weight"):
            draft_weight_targets(engine)
    finally:
        gm.graph.erase_node(node)
        del gm.stray_weight
    assert draft_weight_targets(engine)


def test_greedy_output_is_the_targets_through_swaps():
    engine, draft = built()
    swap = WeightSwap.for_engine(engine)
    old = {n: p.detach().clone() for n, p in draft.named_parameters()}
    new = mistral(seed=7).state_dict()
    ids, mask = prompts([7, 11], seed=1)
    ref, near_tie = hf_greedy(llama_target(), ids, mask, max_new_tokens=20)
    try:
        for state in (old, new):
            swap.swap(state)
            out = engine.generate(ids, max_new_tokens=20, attention_mask=mask)
            assert_greedy_matches(out, ref, near_tie, ids, [])
        # Swaps between steps of one generation, alternating the two weight sets.
        columns = []
        for i, column in enumerate(engine.stream(ids, max_new_tokens=20, attention_mask=mask)):
            columns.append(column)
            swap.swap(old if i % 2 else new)
        out = torch.cat([ids, torch.stack(columns, dim=1)], dim=1)
        assert_greedy_matches(out, ref, near_tie, ids, [])
    finally:
        swap.swap(old)


def test_a_step_during_swaps_sees_old_or_new_weights_never_a_mix():
    engine, draft = built()
    steps = engine.draft
    swap = WeightSwap.for_engine(engine)
    old = {n: p.detach().clone() for n, p in draft.named_parameters()}
    new = {n: p.detach().clone() for n, p in mistral(seed=7).named_parameters()}
    B = steps.cache.batch_size
    tokens = SEQUENCE[:PREFIX][None].expand(B, PREFIX).contiguous()
    positions = torch.arange(PREFIX + 1)[None].expand(B, PREFIX + 1).contiguous()
    one = SEQUENCE[PREFIX:PREFIX + 1][None].expand(B, 1).contiguous()

    def decode() -> torch.Tensor:
        # The cache holds the prefix under whichever weights prefilled it: only the decode
        # step's own weights vary here.
        return steps.run(DECODE, one, positions[:, PREFIX:].contiguous())[0, 0].clone()

    steps.cache.reset()
    with swap.lock:
        steps.run(PREFILL, tokens, positions[:, :PREFIX].contiguous())
    steps.cache.set_lengths(PREFIX)
    expected = []
    for state in (old, new):
        swap.swap(state)
        expected.append(decode())
    assert not torch.equal(*expected)
    seen, mixed, stop = [], [], threading.Event()

    def reader() -> None:
        while not stop.is_set():
            with swap.lock:  # a step holds the lock while it runs
                logits = decode()
            if torch.equal(logits, expected[0]) or torch.equal(logits, expected[1]):
                seen.append(logits)
            else:
                mixed.append(logits)

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(40):
            swap.swap(new if i % 2 == 0 else old)
    finally:
        stop.set()
        thread.join()
        swap.swap(old)
        steps.cache.reset()
    assert not mixed, f"{len(mixed)} steps saw a mix of old and new weights"
    assert seen


# -- distillation -------------------------------------------------------------------------------


# The scripted domain: after a random prompt, the target continues with perm[previous token]
# with probability 0.9 (else any token, uniformly): q(x | prev) = 0.9 [x = perm[prev]] + 0.1 / V.
# The random draft disagrees with it nearly everywhere (agreement ~ 1 / V).
FOLLOW = 0.9


@functools.cache
def shifted_domain() -> tuple[torch.Tensor, torch.Tensor]:
    """(48 sequences [48, 32]: 8 prompt tokens and 24 sampled from q; perm [V])."""
    generator = torch.Generator().manual_seed(11)
    perm = torch.randperm(VOCAB, generator=generator)
    sequences = torch.randint(0, VOCAB, (48, 32), generator=generator)
    follow = torch.rand(48, 32, generator=generator) < FOLLOW
    for p in range(8, 32):
        sequences[:, p] = torch.where(follow[:, p], perm[sequences[:, p - 1]], sequences[:, p])
    return sequences, perm


def labelled(distiller: Distiller, soft: bool) -> None:
    """Buffer the domain's sequences with the target's labels: its top-8 probabilities after
    each prefix (soft), or the tokens greedy decoding emits (perm applied over and over)."""
    sequences, perm = shifted_domain()
    start = 8
    for seq in sequences:
        if soft:
            q = torch.full((32 - start, VOCAB), (1 - FOLLOW) / VOCAB)  # positions start..31
            q[torch.arange(32 - start), perm[seq[start - 1:-1]]] += FOLLOW
            ids, probs = topk_targets(q.log(), 8)
            distiller.add(seq, start, ids, probs)
        else:
            tokens = seq.clone()
            for p in range(start, 32):
                tokens[p] = perm[tokens[p - 1]]
            distiller.add(tokens, start)


@pytest.mark.parametrize("soft", [True, False], ids=["top-k labels", "token labels"])
def test_distillation_raises_agreement_on_a_domain_shift(soft):
    distiller = Distiller(mistral(seed=2), config=DistillConfig(
        lr=3e-3, batch_tokens=256, holdout_fraction=0.25))
    labelled(distiller, soft)
    result = distiller.update(time_budget_s=120, max_steps=60)
    assert result.steps == 60 and result.holdout_records == 12
    assert result.accepted, result.reason
    assert result.last_loss < 0.7 * result.first_loss, result.losses
    assert result.after.loss < result.before.loss
    assert result.after.agreement > result.before.agreement + 0.1, result.reason
    assert distiller.version == 1 and distiller.updates == {"accepted": 1, "rejected": 0}


def test_a_worse_candidate_is_rejected_and_the_old_weights_kept_bit_for_bit():
    draft = mistral(seed=2)
    before = {n: p.detach().clone() for n, p in draft.named_parameters()}
    distiller = Distiller(draft, config=DistillConfig(lr=50.0, batch_tokens=256))
    labelled(distiller, soft=True)
    accepted = distiller.state_dict()
    result = distiller.update(time_budget_s=60, max_steps=5)
    assert not result.accepted and result.reason.startswith("rejected"), result.reason
    assert distiller.updates == {"accepted": 0, "rejected": 1} and distiller.version == 0
    for name, value in distiller.state_dict().items():
        assert torch.equal(value, accepted[name]) and torch.equal(value, before[name]), name
    for name, p in distiller.student.named_parameters():  # the trainable copy restored too
        assert torch.equal(p, before[name]), name
    # Nothing to swap in: the live weights stay as they were.
    swap = WeightSwap([t for t in draft_targets_of(draft)])
    assert not distiller.swap_into(swap)
    for name, p in draft.named_parameters():
        assert torch.equal(p, before[name]), name


def draft_targets_of(module: torch.nn.Module) -> list:
    """Swap targets over a bare module's parameters (no engine)."""
    from fuser.runtime.distill import WeightTarget

    return [WeightTarget(n, (p,), lambda sd, n=n: (sd[n],)) for n, p in
            module.named_parameters()]


def test_accepted_weights_reach_the_engine_and_speculation_stays_exact():
    """End to end on the engine: distil the draft on the target's own greedy traffic, swap
    the accepted weights in; the draft's steps compute the distilled module and generate
    still equals the target's greedy output."""
    engine, draft = built()
    old = {n: p.detach().clone() for n, p in draft.named_parameters()}
    distiller = Distiller(draft_module(engine), vocab_size=engine.vocab_size,
                          config=DistillConfig(lr=3e-3, batch_tokens=256))
    labelled(distiller, soft=False)
    swap = WeightSwap.for_engine(engine)
    try:
        result = distiller.update(time_budget_s=120, max_steps=30)
        assert result.accepted, result.reason
        assert distiller.swap_into(swap) and not distiller.swap_into(swap)
        got, _ = step_logits(engine.draft, SEQUENCE)
        assert relative_error(got, eager_logits(distiller.student, SEQUENCE[:got.shape[0]])) < 1e-4
        ids, mask = prompts([6, 9], seed=4)
        ref, near_tie = hf_greedy(llama_target(), ids, mask, max_new_tokens=16)
        out = engine.generate(ids, max_new_tokens=16, attention_mask=mask)
        assert_greedy_matches(out, ref, near_tie, ids, [])
    finally:
        swap.swap(old)


def test_buffer_is_bounded_and_holds_the_newest_records():
    distiller = Distiller(mistral(seed=2), config=DistillConfig(max_records=5, max_tokens=40))
    for i in range(20):
        distiller.add(torch.full((10,), i), start=4)
    assert distiller.records == 4 and distiller.buffered_tokens == 40  # max_tokens binds
    assert [int(r.tokens[0]) for r in distiller._records] == [16, 17, 18, 19]
    assert distiller.requests_seen == 20 and distiller.due(20) and not distiller.due(21)
    with pytest.raises(ValueError, match="start"):
        distiller.add([1, 2, 3], start=0)
    with pytest.raises(ValueError, match="ids in"):
        distiller.add([1, VOCAB], start=1)
    with pytest.raises(ValueError, match="topk"):
        distiller.add([1, 2, 3], start=1, topk_ids=torch.zeros(2, 4, dtype=torch.long))
    result = Distiller(mistral(seed=2)).update(time_budget_s=1)
    assert not result.accepted and "too few records" in result.reason


def test_distill_config_is_validated():
    for bad in (dict(lr=0), dict(holdout_fraction=1.0), dict(criterion="loss"),
                dict(batch_tokens=0), dict(topk=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DistillConfig(**bad)


def test_save_keeps_the_swapped_draft(tmp_path):
    """engine.save writes the live tensors: a loaded engine computes the swapped-in draft."""
    engine, draft = built()
    swap = WeightSwap.for_engine(engine)
    old = {n: p.detach().clone() for n, p in draft.named_parameters()}
    new = mistral(seed=7)
    try:
        swap.swap(new.state_dict())
        engine.save(tmp_path / "engine")
    finally:
        swap.swap(old)
    loaded = fuser.load(tmp_path / "engine")
    got, _ = step_logits(loaded.draft, SEQUENCE)
    assert relative_error(got, eager_logits(new, SEQUENCE[:got.shape[0]])) < 1e-4
    with pytest.raises(ValueError, match="no module"):
        draft_weight_targets(loaded)  # a loaded engine has no module to train: give it one
    # Given the module, its tensors resolve by name (they share no memory with it).
    WeightSwap.for_engine(loaded, module=new).swap(draft.state_dict())
    got, _ = step_logits(loaded.draft, SEQUENCE)
    assert relative_error(got, eager_logits(draft, SEQUENCE[:got.shape[0]])) < 1e-4
