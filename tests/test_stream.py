"""engine.stream yields, column by column, what engine.generate returns (greedy and sampled, with
and without a draft, a row finishing early), on the shared engines (tests/engines.py)."""

from __future__ import annotations

import pytest
import torch

from engines import VOCAB, eos_that_ends_one_row, hf_greedy, prompts

# The tests/test_generate_*.py modules and tests/test_stream.py run on one xdist worker: the
# `engines` they share (conftest.py, ~5-15 s each) are built once, not on both workers.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.xdist_group("generate_engines")]


@pytest.mark.parametrize("name", ["plain", "g8"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_stream_yields_what_generate_returns(engines, name: str, do_sample: bool) -> None:
    engine, target = engines(name)
    ids, mask = prompts([5, 9, 3], seed=11)
    T = ids.shape[1]
    free_run, _ = hf_greedy(target, ids, mask, 12)
    token, _, _ = eos_that_ends_one_row(free_run, T)
    kwargs = dict(attention_mask=mask, eos_token_id=token, pad_token_id=VOCAB - 1,
                  do_sample=do_sample, temperature=0.7, top_k=20, top_p=0.9, seed=5)
    columns = list(engine.stream(ids, 12, **kwargs))
    assert all(c.shape == (3,) and c.dtype == torch.long for c in columns)
    out = engine.generate(ids, 12, **kwargs)
    assert torch.equal(torch.stack(columns, dim=1), out[:, T:])
    if not do_sample:
        assert (out[:, T:] == VOCAB - 1).any()  # a row finished and was padded
