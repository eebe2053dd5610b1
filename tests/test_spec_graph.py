"""The whole-iteration step functions (runtime/step_graphs.py) on CPU, uncaptured: the same
Python functions the CUDA graphs capture. Batch buckets, ragged batches in every bucket, eos per
row, stream == generate, and the per-row (tensor) sampling parameters.

One engine: a Llama target and a noisy copy as draft (partial acceptance), gamma 2, buckets
1 and 2. Greedy output must equal Hugging Face's on the target (fp32, no near-ties at these
logit scales; test_generate.py holds the near-tie rule).
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from fuser.runtime.sampling import process_logits, process_logits_rows
from engines import perturbed
from tiny import random_prompts, tiny_model

MAX_SEQ_LEN = 48


# One xdist worker runs the module: its cached engine is built once.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),  # conftest.py
              pytest.mark.xdist_group("spec_graph")]


@functools.cache
def engine_and_target() -> tuple[fuser.Engine, torch.nn.Module]:
    target = tiny_model("llama", layers=1, seed=7)
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, gamma=2, max_batch_size=2,
                               batch_buckets=(1,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(target, draft=perturbed(target, 0.3, seed=1), config=config)
    assert engine.report().fallbacks == []
    return engine, target


def hf_greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, n: int,
              eos: int | None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              pad_token_id=0, eos_token_id=eos)


def test_buckets_are_built_over_rows_of_one_cache() -> None:
    engine, _ = engine_and_target()
    assert sorted(engine.buckets) == [1, 2]
    one, two = engine.buckets[1], engine.buckets[2]
    assert one.target.cache.batch_size == 1 and two.target.cache.batch_size == 2
    # Same memory: bucket 1's cache is row 0 of bucket 2's.
    assert one.target.cache.k[0].data_ptr() == two.target.cache.k[0].data_ptr()
    assert one.draft.cache.seq_lens.data_ptr() == two.draft.cache.seq_lens.data_ptr()
    assert engine.bucket(1) is one and engine.bucket(2) is two


@pytest.mark.parametrize("lengths", [[5], [7, 3], [2, 9]])
def test_ragged_batches_in_every_bucket_equal_hf_greedy(lengths: list[int]) -> None:
    engine, target = engine_and_target()
    ids, mask = random_prompts(len(lengths), lengths, target.config.vocab_size, seed=len(lengths))
    runs_before = dict(engine.bucket(len(lengths)).uncaptured_runs)
    engine.stats.reset()
    out = engine.generate(ids, 20, attention_mask=mask, eos_token_id=[])
    assert torch.equal(out, hf_greedy(target, ids, mask, 20, None))
    # It ran in its own bucket, speculating with partial acceptance.
    assert engine.bucket(len(lengths)).uncaptured_runs != runs_before
    assert 0 < engine.stats.acceptance_rate < 1


def test_eos_ends_one_row_and_pads_it() -> None:
    engine, target = engine_and_target()
    ids, mask = random_prompts(2, [6, 4], target.config.vocab_size, seed=5)
    free = hf_greedy(target, ids, mask, 16, None)
    eos = int(free[0, ids.shape[1] + 5])  # row 0's 6th new token
    ref = hf_greedy(target, ids, mask, 16, eos)
    out = engine.generate(ids, 16, attention_mask=mask, eos_token_id=[eos], pad_token_id=0)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("batch", [1, 2])
def test_stream_equals_generate_with_sampling(batch: int) -> None:
    engine, target = engine_and_target()
    ids, mask = random_prompts(batch, [5, 3][:batch], target.config.vocab_size, seed=9)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=0.9, top_k=40, top_p=0.95,
                  seed=21, eos_token_id=[3], pad_token_id=0)
    out = engine.generate(ids, 14, **kwargs)
    streamed = torch.stack(list(engine.stream(ids, 14, **kwargs)), dim=1)
    assert torch.equal(out[:, ids.shape[1]:], streamed)
    assert torch.equal(out, engine.generate(ids, 14, **kwargs))  # seeded: reproducible


def test_more_eos_ids_than_the_state_holds_is_a_clear_error() -> None:
    engine, target = engine_and_target()
    ids, _ = random_prompts(1, [3], target.config.vocab_size, seed=2)
    with pytest.raises(ValueError, match="eos_token_id"):
        engine.generate(ids, 4, eos_token_id=list(range(3, 13)))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(temperature=st.sampled_from([0.3, 1.0, 1.7]), top_k=st.sampled_from([None, 1, 5, 64]),
       top_p=st.sampled_from([None, 0.1, 0.8, 1.0]), seed=st.integers(0, 9))
def test_per_row_parameters_match_process_logits(temperature: float, top_k: int | None,
                                                  top_p: float | None, seed: int) -> None:
    # Each row of a batch with its own parameters equals process_logits with Python values.
    logits = torch.randn(3, 2, 64, generator=torch.Generator().manual_seed(seed)) * 3
    rows = [(temperature, top_k, top_p), (1.0, None, None), (0.5, 3, 0.5)]
    t = torch.tensor([r[0] for r in rows])
    k = torch.tensor([64 if r[1] is None else r[1] for r in rows])
    p = torch.tensor([1.0 if r[2] is None else r[2] for r in rows])
    got = process_logits_rows(logits, t, k, p)
    for b, (tb, kb, pb) in enumerate(rows):
        want = process_logits(logits[b], tb, kb, pb)
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-7)
        assert torch.equal(got[b] == 0, want == 0)  # the same tokens filtered out
