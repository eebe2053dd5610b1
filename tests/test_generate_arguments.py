"""engine.generate / engine.stream arguments: bad ones raise ValueError naming them (at the call),
a seed makes sampling reproducible, temperature is ignored when greedy. On the shared engines
(tests/engines.py)."""

from __future__ import annotations

import pytest
import torch

from engines import VOCAB, prompts

# The tests/test_generate_*.py modules and tests/test_stream.py run on one xdist worker: the
# `engines` they share (conftest.py, ~5-15 s each) are built once, not on both workers.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.xdist_group("generate_engines")]

BAD_ARGUMENTS = [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(input_ids=torch.ones(1, 40, dtype=torch.long), max_new_tokens=30),
     "max_new_tokens.*max_seq_len"),
    (dict(input_ids=torch.ones(5, 3, dtype=torch.long)), "max_batch_size"),
    (dict(input_ids=torch.ones(1, 0, dtype=torch.long)), "input_ids"),
    (dict(input_ids=torch.tensor([[1, VOCAB]])), "input_ids"),
    (dict(attention_mask=torch.tensor([[0, 0, 0]])), "attention_mask"),
    (dict(do_sample=True, temperature=0.0), "temperature"),
    (dict(do_sample=True, temperature=-1.0), "temperature"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(eos_token_id=VOCAB), "eos_token_id"),
    (dict(eos_token_id=[2, -1]), "eos_token_id"),
    (dict(eos_token_id="2"), "eos_token_id"),
    (dict(pad_token_id="0"), "pad_token_id"),
    (dict(seed="1"), "seed"),
    (dict(seed=1.0), "seed"),
    (dict(do_sample="yes"), "do_sample"),
]


@pytest.mark.parametrize("call, name", BAD_ARGUMENTS)
def test_bad_arguments_raise_value_error_naming_them(engines, call: dict, name: str) -> None:
    engine, _ = engines("plain")
    kwargs = dict(input_ids=torch.tensor([[3, 4, 5]]), max_new_tokens=4) | call
    with pytest.raises(ValueError, match=name):
        engine.generate(**kwargs)
    with pytest.raises(ValueError, match=name):
        engine.stream(**kwargs)  # checked at the call, not at the first next()


def test_temperature_is_ignored_when_greedy(engines) -> None:
    engine, target = engines("plain")
    ids = torch.tensor([[3, 4, 5]])
    assert torch.equal(engine.generate(ids, 4, temperature=0.0), engine.generate(ids, 4))


def test_sampling_with_a_seed_is_reproducible(engines) -> None:
    for name in ("plain", "g1"):
        engine, _ = engines(name)
        ids, mask = prompts([4, 7], seed=3)
        kwargs = dict(attention_mask=mask, do_sample=True, max_new_tokens=10)
        first = engine.generate(ids, seed=1, **kwargs)
        assert torch.equal(first, engine.generate(ids, seed=1, **kwargs))
        assert not torch.equal(first, engine.generate(ids, seed=2, **kwargs))


def test_an_engine_built_in_process_has_no_manifest(engines) -> None:
    """`fuser.load` sets `manifest` and `load_seconds`; a built engine has both, as None (the
    demo's first run reads them before any load)."""
    engine, _ = engines("plain")
    assert engine.manifest is None and engine.load_seconds is None
