"""The RMSNorm passes on Llama, Mistral and Qwen2: numbers, fused ops present, exact counts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from fuser.numerics import LOGITS_TOLERANCE, relative_error
from fuser.passes import run_passes
from fuser.passes.fx import count_targets
from tiny import (export_like_capture, families_in_ci, hf_logits, model_cases, pass_context,
                  random_prompts, real_logits_error, tiny_model)

aten = torch.ops.aten


def expected_counts(layers: int) -> dict[str, int]:
    # The first layer's input norm has no residual before it; every other norm (the final one
    # included) follows a residual add: 2L of those.
    return {"add_rms_norm": 2 * layers, "rms_norm": 1}


def norm_entries(counts: dict[str, int]) -> dict[str, int]:
    """The RMSNorm entries of a passes / fused_ops dict (other passes report their own). In
    decode-shaped graphs a norm sits inside the GEMV it feeds (norm_linear: fuser::rms_norm_linear,
    fuser::add_rms_norm_linear; at several rows norm_stats' fuser::stats_rms_norm_linear),
    counted here as its norm."""
    entries = {name: counts.get(name, 0) + counts.get(f"{name}_linear", 0)
               for name in ("add_rms_norm", "rms_norm")}
    entries["add_rms_norm"] += counts.get("stats_rms_norm_linear", 0)
    return entries


def check_engine(model: torch.nn.Module, batch: int, lengths: list[int], seed: int) -> None:
    layers = model.config.num_hidden_layers
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=batch,
                                                            batch_buckets=(batch,), max_seq_len=32))
    report = engine.report()

    # 1. numbers agree with eager on every real (non-padding) position
    assert real_logits_error(engine, model, batch, lengths, seed) <= LOGITS_TOLERANCE[torch.float32]

    # 2. fused ops present, unfused gone, in every graph; 3. exact counts
    assert norm_entries(report.passes) == expected_counts(layers)
    assert norm_entries(report.fused_ops) == expected_counts(layers)
    assert report.fallbacks == []
    for name, graph in engine.target.steps.items():
        assert norm_entries(graph.fused_ops) == expected_counts(layers), name
        assert count_targets(graph.rewritten, aten.rsqrt.default) == 0, name
    # the user's model is untouched
    assert model.config._attn_implementation != "fuser"


@pytest.mark.parametrize("family", families_in_ci("llama"))  # the others: -m slow
@settings(max_examples=4, deadline=None, derandomize=True)
@given(data=st.data())
def test_rmsnorm_fused_and_exact(family: str, data: st.DataObject) -> None:
    model, batch, lengths = data.draw(model_cases(family, max_batch=4))
    check_engine(model, batch, lengths, seed=len(lengths))


def test_bf16_counts_and_numbers() -> None:
    model = tiny_model("llama", dtype=torch.bfloat16, layers=2)
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=2,
                                                            batch_buckets=(2,), max_seq_len=16))
    assert norm_entries(engine.report().passes) == expected_counts(2)
    ids, mask = random_prompts(2, [5, 3], model.config.vocab_size, seed=1)
    out = engine.logits(ids, attention_mask=mask)
    ref = hf_logits(model, ids, mask)
    assert relative_error(out[mask.bool()], ref[mask.bool()]) <= LOGITS_TOLERANCE[torch.bfloat16]


def _norm_with_leak(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    out = weight * (h * torch.rsqrt(variance + 1e-6)).to(x.dtype)
    return out, variance * 2  # the intermediate is used outside the norm


class _Leaky(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(24))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _norm_with_leak(x, self.weight)


class _Clean(_Leaky):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = _norm_with_leak(x, self.weight)
        return out, x


@pytest.mark.parametrize(("module", "matches"), [(_Leaky, 0), (_Clean, 1)])
def test_norm_with_used_intermediate_is_not_rewritten(module: type, matches: int) -> None:
    torch.manual_seed(0)
    m = module().eval()
    x = torch.randn(3, 24)
    gm = export_like_capture(m, (x,))
    result = run_passes(gm, pass_context("leak"))
    assert result.matches["rms_norm"] == matches  # the positive twin proves the pattern works
    for got, want in zip(gm(x), m(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
