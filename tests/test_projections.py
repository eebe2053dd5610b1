"""Merged projections (q/k/v and gate/up) and SwiGLU on Llama, Mistral and Qwen2: numbers,
fused ops present and GEMMs gone, exact counts, the user's model unchanged, no extra memory."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fuser
import fuser.build
from fuser.numerics import LOGITS_TOLERANCE
from fuser.passes import run_passes
from fuser.passes.fx import count_targets
from fuser.passes.projections import MERGED_PREFIX, concatenate_rows
from tiny import (engine_examples, export_like_capture, families_in_ci, hf_logits, model_cases,
                  pass_context, random_prompts, real_logits_error, tiny_model)

aten = torch.ops.aten
MEMORY_HEADROOM = 0.10  # API.md: memory the engine adds stays under 10% of the weights


def gemms(gm: torch.fx.GraphModule) -> int:
    return count_targets(gm, aten.mm.default) + count_targets(gm, aten.addmm.default)


@contextmanager
def gemms_before_passes():
    """Record, per graph name, the GEMMs each graph held before the passes ran."""
    counts: dict[str, int] = {}
    real = fuser.build.run_passes

    def spy(gm, context, *args, **kwargs):
        counts[context.graph_name] = gemms(gm)
        return real(gm, context, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fuser.build, "run_passes", spy)
        yield counts


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def check_engine(model: nn.Module, batch: int, lengths: list[int], seed: int) -> None:
    layers = model.config.num_hidden_layers
    dtype = next(model.parameters()).dtype
    before = copy.deepcopy(model)
    weights_before = storage_bytes(list(model.parameters()))
    with gemms_before_passes() as gemms_before:
        config = fuser.FuserConfig(max_batch_size=batch, batch_buckets=(batch,), max_seq_len=32)
        engine = fuser.optimize(model, config=config)
    report = engine.report()
    assert report.fallbacks == []

    # 1. numbers agree with eager on every real (non-padding) position
    assert real_logits_error(engine, before, batch, lengths, seed) <= LOGITS_TOLERANCE[dtype]

    # 2. fused ops present, unfused gone; 3. exact counts: one merge of each kind and one
    # SwiGLU per layer, in every graph
    passes = report.passes
    assert passes["merge_qkv"] == passes["merge_gate_up"] == passes["gated_act"] == layers
    for graph in engine.target.steps.values():
        name = graph.name
        assert graph.matches["merge_qkv"] == graph.matches["merge_gate_up"] == layers, name
        # the SwiGLU, alone or (decode-shaped graphs) inside gate_up's GEMV: gated_linear
        # (then inside the norm's op with that GEMV: norm_linear)
        gated = graph.matches["gated_linear"]
        assert graph.fused_ops.get("gated_act", 0) + gated == layers, name
        assert count_targets(graph.rewritten, aten.sigmoid.default) == 0, name  # core ATen's silu
        assert count_targets(graph.rewritten, aten.silu.default) == 0, name
        # q, k, v -> one GEMM and gate, up -> one: three fewer per layer (in decode-shaped
        # graphs the linear pass then turns each GEMM into fuser::linear: tests/test_linear_pass.py)
        linears = sum(graph.fused_ops.get(op, 0) for op in (
            "linear", "gated_linear", "rms_norm_linear", "add_rms_norm_linear",
            "linear_residual", "stats_rms_norm_linear"))  # the last two: norm_stats
        assert gemms(graph.rewritten) + linears == gemms_before[name] - 3 * layers, name
    assert gemms_before["target.decode"] == 7 * layers + 1  # q k v o gate up down, lm_head

    # the user's model computes exactly what it did (its parameters now live in the merged
    # storage, with the same values)
    ids, mask = random_prompts(batch, lengths, model.config.vocab_size, seed)
    assert torch.equal(hf_logits(model, ids, mask), hf_logits(before, ids, mask))

    # memory: the merged weights are the parameters' storage, not a copy of it
    merged = [t for graph in engine.target.steps.values()
              for name, t in graph.rewritten.named_buffers() if name.startswith(MERGED_PREFIX)]
    assert len(merged) >= 2 * layers
    weights_after = storage_bytes([*model.parameters(), *merged])
    assert weights_after <= (1 + MEMORY_HEADROOM) * weights_before
    assert weights_after == weights_before  # in fact not one byte more


@pytest.mark.parametrize("family", families_in_ci("llama", "qwen2"))  # Mistral: -m slow
@engine_examples
@given(data=st.data())
def test_projections_merged_and_swiglu_fused(family: str, data: st.DataObject) -> None:
    model, batch, lengths = data.draw(model_cases(family, max_batch=3))
    check_engine(model, batch, lengths, seed=len(lengths))


def test_bf16() -> None:
    check_engine(tiny_model("qwen2", dtype=torch.bfloat16, layers=1), batch=2, lengths=[5, 3], seed=1)


# --- the weight concatenation ---------------------------------------------------------------


def test_concatenate_rows_once_then_alias() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, 8)) for n in (4, 2, 2)]
    values = [p.detach().clone() for p in params]
    merged = concatenate_rows(params)
    assert torch.equal(merged, torch.cat(values))
    for p, v in zip(params, values):
        assert torch.equal(p, v) and p.requires_grad  # same values, still a parameter
        assert p.untyped_storage().data_ptr() == merged.untyped_storage().data_ptr()
    # a second graph of the same model: the parameters are already adjacent, nothing is copied
    again = concatenate_rows(params)
    assert again.data_ptr() == merged.data_ptr() and torch.equal(again, merged)
    # ... but out of order they are not adjacent: a fresh concatenation
    swapped = concatenate_rows([params[1], params[0]])
    assert swapped.untyped_storage().data_ptr() != merged.untyped_storage().data_ptr()
    assert torch.equal(swapped, torch.cat([values[1], values[0]]))


# --- which linears merge ----------------------------------------------------------------------


class _Siblings(nn.Module):
    """Linears over one input, with variations that must keep some of them apart."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.a = nn.Linear(16, 8, bias=variant == "bias")
        self.b = nn.Linear(16, 4, bias=variant == "bias")
        self.c = nn.Linear(16, 4, bias=variant in ("bias", "mixed_bias"))
        if variant == "tied":
            self.b.weight = self.a.weight  # one parameter twice: not two rows of one storage
            self.b.out_features = 8

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        other = y if self.variant == "other_input" else x
        a, b, c = self.a(x), self.b(x), self.c(other)
        return torch.cat([a.sum(-1, keepdim=True) * b.mean(-1, keepdim=True), c.view(*c.shape[:-1], 2, 2)
                          .flatten(-2)], dim=-1)


@pytest.mark.parametrize(("variant", "merges", "gemms_after"), [
    ("plain", 1, 1),        # three siblings, one GEMM
    ("bias", 1, 1),         # addmm with the biases concatenated too
    ("mixed_bias", 1, 2),   # a, b merge; c has a bias, they do not
    ("other_input", 1, 2),  # c reads another tensor
    ("tied", 0, 3),         # a, b share a weight; c alone
])
def test_only_true_siblings_merge(variant: str, merges: int, gemms_after: int) -> None:
    torch.manual_seed(0)
    m = _Siblings(variant).eval()
    x, y = torch.randn(2, 3, 16), torch.randn(2, 3, 16)
    with torch.no_grad():
        want = m(x, y)
    gm = export_like_capture(m, (x, y))
    result = run_passes(gm, pass_context("siblings"))
    assert result.errors == []
    assert result.matches["merge_qkv"] == merges
    # M = 6 rows: the linear pass then makes every GEMM left a fuser::linear
    assert gemms(gm) + count_targets(gm, torch.ops.fuser.linear.default) == gemms_after
    with torch.no_grad():
        torch.testing.assert_close(gm(x, y), want, rtol=1e-6, atol=1e-6)  # GEMM blocking only
        assert torch.equal(m(x, y), want)  # the module's own parameters: same values
