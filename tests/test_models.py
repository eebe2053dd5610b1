"""The bundled model pair: offline loading, sizes, special tokens, held-out perplexity."""

from __future__ import annotations

import os

import pytest
import torch

from fuser.models import DRAFT_PATH, HELDOUT_SAMPLE, TARGET_PATH, bundled_pair
from fuser.models.evaluate import SLICE_PERPLEXITY, heldout_slice, perplexity

pytestmark = pytest.mark.skipif(bundled_pair() is None, reason="bundled model pair not present")


@pytest.fixture(scope="module")
def pair(monkeypatch_module: pytest.MonkeyPatch) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")  # no network: everything from the repository
    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=torch.float32).eval()
    return tokenizer, target, draft


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def dir_bytes(path: os.PathLike) -> int:
    return sum(p.stat().st_size for p in os.scandir(path) if p.is_file())


def test_sizes_and_architecture(pair: tuple) -> None:
    _, target, draft = pair
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert n_target >= 10_000_000
    assert n_draft * 6 <= n_target
    assert draft.config.num_hidden_layers < target.config.num_hidden_layers
    assert type(target).__name__ == type(draft).__name__ == "LlamaForCausalLM"
    assert dir_bytes(TARGET_PATH) + dir_bytes(DRAFT_PATH) <= 25 * 2**20
    assert HELDOUT_SAMPLE.stat().st_size <= 2**20


def test_special_tokens_everywhere(pair: tuple) -> None:
    tokenizer, target, draft = pair
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert None not in ids and len(set(ids)) == 3
    for model in (target, draft):
        gen = model.generation_config
        assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == ids


def test_heldout_perplexity_matches_the_recorded_figure(pair: tuple) -> None:
    tokenizer, target, _ = pair
    ppl = perplexity(target, heldout_slice(tokenizer))
    assert abs(ppl - SLICE_PERPLEXITY) <= 0.10 * SLICE_PERPLEXITY, ppl
