"""A draft weight swap reaches the compiled and captured draft on a CUDA device (skipped
elsewhere): Inductor's compiled steps and CUDA graphs read the live tensors the swap writes,
so after a swap to other weights the captured draft's logits and the captured speculative
iterations' acceptance change, and after swapping back they are bit for bit what they were.
A step that kept a copy of the weights (constants folded by Inductor, a graph captured over
stale memory) fails here."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import fuser
from fuser.runtime.cuda_graphs import CudaGraphStep
from fuser.runtime.distill import WeightSwap, draft_module
from fuser.runtime.steps import DECODE, PREFILL
from tiny import random_prompts, tiny_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PREFIX = 8
GAMMA = 2


def engine_and_draft() -> tuple[fuser.Engine, torch.nn.Module]:
    """A 1-layer bf16 Llama target and a draft that is a copy of it (accepts nearly every
    token), compiled by Inductor, gamma 2, one row."""
    target = tiny_model("llama", layers=1, dtype=torch.bfloat16).to("cuda")
    draft = copy.deepcopy(target)
    config = fuser.FuserConfig(max_seq_len=96, max_batch_size=1, gamma=GAMMA,
                               compile="inductor")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=draft, config=config)
    assert engine.report().fallbacks == []
    return engine, draft


def captured_decode_logits(steps: object, decode: CudaGraphStep, ids: torch.Tensor
                           ) -> torch.Tensor:
    """The draft's logits [V] for the token after ids [N]: prefill of ids[:-1], then the
    captured decode step over the last token."""
    cache = steps.cache
    n = ids.shape[0]
    tokens = ids[None].expand(cache.batch_size, n).contiguous()
    positions = torch.arange(n, device=ids.device)[None].expand(cache.batch_size, n).contiguous()
    cache.reset()
    steps.run(PREFILL, tokens[:, :-1].contiguous(), positions[:, :-1].contiguous())
    cache.set_lengths(n - 1)
    logits = decode(tokens[:, -1:].contiguous(), positions[:, -1:].contiguous(),
                    cache.seq_lens, cache.starts)
    out = logits[0, -1].float().clone()
    cache.reset()
    return out


def test_a_swap_reaches_the_compiled_and_captured_draft_and_back_bit_for_bit():
    engine, draft = engine_and_draft()
    steps = engine.draft
    assert steps[DECODE].compiled is not None  # Inductor's step, not the FX graph
    # The draft's compiled decode step as a CUDA graph of its own (the engine's iterations
    # hold it inside theirs).
    decode = CudaGraphStep(steps[DECODE].uncaptured, steps.cache.batch_size, 1,
                           steps.cache.seq_lens, steps.cache.starts)
    steps.cache.reset()
    assert (GAMMA, False) in engine.bucket(1).graphs  # the speculative iteration, captured
    swap = WeightSwap.for_engine(engine)
    original = {n: p.detach().clone() for n, p in draft_module(engine).named_parameters()}
    other = tiny_model("llama", layers=1, seed=9, dtype=torch.bfloat16).to("cuda").state_dict()
    vocab = engine.vocab_size
    ids = torch.randint(0, vocab, (PREFIX + 1,), generator=torch.Generator().manual_seed(4)
                        ).cuda()
    prompts, mask = random_prompts(1, [PREFIX], vocab, seed=5)
    prompts, mask = prompts.cuda(), mask.cuda()
    engine.fix_gamma(GAMMA)

    def observe() -> tuple[torch.Tensor, torch.Tensor, int]:
        """(the captured decode's logits, a greedy generation, its accepted draft tokens)
        through the captured speculative iteration."""
        logits = captured_decode_logits(steps, decode, ids)
        engine.stats.reset()
        out = engine.generate(prompts, 40, attention_mask=mask, eos_token_id=[])
        return logits, out, engine.stats.num_accepted_tokens

    try:
        logits, out, accepted = observe()
        assert decode.replays == 1  # the captured graph ran
        assert engine.bucket(1).uncaptured_runs.get((GAMMA, False), 0) == 0
        assert accepted > 0  # a copy of the target: most drafts accepted
        swap.swap(other)
        swapped_logits, swapped_out, swapped_accepted = observe()
        assert not torch.equal(swapped_logits, logits)  # the captured decode saw the new weights
        assert torch.equal(swapped_out, out)  # the target verifies: the output is the same...
        assert swapped_accepted < accepted  # ...and the captured iteration drafted differently
        swap.swap(original)
        back_logits, back_out, back_accepted = observe()
        assert torch.equal(back_logits, logits)  # bit for bit
        assert torch.equal(back_out, out) and back_accepted == accepted
        assert engine.bucket(1).uncaptured_runs.get((GAMMA, False), 0) == 0
    finally:
        engine.fix_gamma(None)
        swap.swap(original)
