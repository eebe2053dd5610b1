"""The one-shot all-reduce's kernel (fuser/ops/one_shot_all_reduce.py) in one process: several
buffers stand for the ranks' peer buffers; the sum is fp32 adds in rank order, rounded once, so
every rank (each launching it over the same buffers) gets the same bits. Under
TRITON_INTERPRET=1 without a GPU. The barriers and peer mappings around it need several GPUs and
are not tested here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops.one_shot_all_reduce import (BLOCK, MAX_WORLD, one_shot_sum,
                                           one_shot_sum_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's fp32 -> bf16 cast rounds as GPUs do (conftest.py), not by truncation.
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")


@settings(max_examples=12, deadline=None, derandomize=True)
@given(world=st.integers(1, MAX_WORLD),
       n=st.sampled_from([1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 4096, 3 * BLOCK + 5]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_sum_in_rank_order(world: int, n: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    buffers = [(torch.randn(n, generator=g) * 4).to(dtype).to(DEVICE) for _ in range(world)]
    out = one_shot_sum(buffers)
    assert out.dtype == dtype and out.shape == (n,)
    assert torch.equal(out, one_shot_sum_reference(buffers))
    # each rank launches over the same buffers in the same order: the same bits
    assert torch.equal(one_shot_sum(buffers, out=torch.empty_like(out)), out)


def test_rank_order_matters_and_is_kept() -> None:
    """fp32 addition is not associative: a sum whose order shows in the result equals the
    rank-order one."""
    big, small = torch.tensor([1e8]), torch.tensor([1.0])  # fp32: 1e8 + 1 == 1e8
    buffers = [x.to(DEVICE) for x in (big, small, -big, small)]
    assert one_shot_sum(buffers).item() == 1.0  # ((1e8 + 1) - 1e8) + 1 in fp32
    assert one_shot_sum([buffers[i] for i in (1, 3, 0, 2)]).item() == 0.0  # ((1 + 1) + 1e8) - 1e8


def test_refuses_mismatched_buffers() -> None:
    a = torch.zeros(8, device=DEVICE)
    with pytest.raises(ValueError, match="one shape and dtype"):
        one_shot_sum([a, torch.zeros(9, device=DEVICE)])
    with pytest.raises(ValueError, match="1..8 supported"):
        one_shot_sum([a] * 9)
