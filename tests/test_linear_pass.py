"""The linear pass: decode-shaped GEMMs become fuser::linear on Llama, Mistral and Qwen2, and
the gated_linear pass after it folds gate/up's activation into its GEMV (fuser::gated_linear),
and norm_linear then folds each RMSNorm into the GEMV it feeds (fuser::(add_)rms_norm_linear).

Exact counts (every layer's merged QKV, o_proj, merged gate/up, down_proj, and the LM head, in
every fixed-T graph, gate/up then with its activation; none in prefill), numbers against eager through the engine, and negatives:
more rows than the kernel takes, and a mm whose right side is not a parameter.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fuser
from fuser.ops.gemv_tables import MAX_ROWS
from fuser.passes import norm_stats
from fuser.passes.linear import rewrite_linears
from fuser.numerics import LOGITS_TOLERANCE
from fuser.passes.fx import count_targets
from tiny import (engine_examples, export_like_capture, families_in_ci, model_cases, pass_context,
                  random_prompts, real_logits_error, tiny_model)

aten = torch.ops.aten


def gemms(gm: torch.fx.GraphModule) -> int:
    return count_targets(gm, aten.mm.default) + count_targets(gm, aten.addmm.default)


def check(model: nn.Module, batch: int, lengths: list[int], gamma: int, seed: int) -> None:
    layers = model.config.num_hidden_layers
    draft = tiny_model(model.config.model_type, layers=1, seed=seed + 1,
                       dtype=next(model.parameters()).dtype,
                       heads=model.config.num_attention_heads,
                       kv_heads=model.config.num_key_value_heads,
                       head_dim=model.config.head_dim)
    engine = fuser.optimize(model, draft=draft, config=fuser.FuserConfig(
        max_batch_size=batch, batch_buckets=(batch,), max_seq_len=32, gamma=gamma))
    report = engine.report()
    assert report.fallbacks == []
    for compiled in (engine.target, engine.draft):
        n = len(compiled.cache.k)
        for graph in compiled.steps.values():
            rows = None if graph.kind.tokens is None else batch * graph.kind.tokens
            ops = graph.fused_ops
            linears, gated = ops.get("linear", 0), ops.get("gated_linear", 0)
            if rows is not None and rows <= MAX_ROWS:
                # qkv (merged), o_proj, gate_up (merged), down_proj per layer, and the LM head;
                # then gate_up's GEMV takes the activation (gated_linear): one op per layer
                assert graph.matches["linear"] == 4 * n + 1, graph.name
                assert graph.matches["gated_linear"] == n and gated == 0, graph.name
                # then every norm takes the GEMV it feeds (norm_linear): qkv and gate_up behind
                # each layer's two norms, the LM head behind the final one; o_proj, down_proj left
                assert graph.matches["norm_linear"] == 2 * n + 1, graph.name
                assert ops["rms_norm_linear"] == 1, graph.name
                assert "add_rms_norm" not in ops and "rms_norm" not in ops, graph.name
                assert "gated_act" not in ops, graph.name
                # norm_stats: every several-row graph, but in the target's only where all of
                # the bucket's steps fit MAX_ROWS (its verify steps: batch (gamma + 1) rows)
                stats = norm_stats.ENABLED and rows > 1 and (
                    compiled is engine.draft or batch * (gamma + 1) <= MAX_ROWS)
                if not stats:
                    assert ops["add_rms_norm_linear"] == 2 * n and linears == 2 * n, graph.name
                    assert graph.matches["norm_stats"] == 0, graph.name
                else:  # norm_stats: each residual norm moves into o_proj / down_proj before it
                    # (the input norms of layers 1.. and the final norm behind down_proj)
                    assert graph.matches["norm_stats"] == 2 * n, graph.name
                    assert ops["linear_residual"] == ops["stats_rms_norm_linear"] == 2 * n
                    assert "add_rms_norm_linear" not in ops and linears == 0, graph.name
                assert gemms(graph.rewritten) == 0, graph.name
            else:  # prefill (symbolic rows) and too many rows keep their GEMMs and gated_act
                assert linears == gated == 0 and ops["gated_act"] == n, graph.name
                assert graph.matches["norm_linear"] == 0 and ops["add_rms_norm"] == 2 * n, graph.name
                assert gemms(graph.rewritten) == 4 * n + 1, graph.name
    assert report.passes["linear"] == 4 * layers + 1
    assert report.passes["gated_linear"] == layers
    assert report.passes["norm_linear"] == 2 * layers + 1
    # numbers: prefill logits against eager, and greedy speculative == target-only greedy
    dtype = next(model.parameters()).dtype
    assert real_logits_error(engine, model, batch, lengths, seed) <= LOGITS_TOLERANCE[dtype]
    plain = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=batch,
                                                           batch_buckets=(batch,), max_seq_len=32))
    ids, mask = random_prompts(batch, lengths, model.config.vocab_size, seed)
    eos = [model.config.vocab_size - 1]
    assert torch.equal(engine.generate(ids, 8, attention_mask=mask, eos_token_id=eos),
                       plain.generate(ids, 8, attention_mask=mask, eos_token_id=eos))


# Llama in every run; Mistral and Qwen2 (about 70 s each on a 2-core CPU, and the passes' firing
# on them is also checked by test_fp8_pass, test_rmsnorm_pass, test_rope) under -m slow.
@pytest.mark.parametrize("family", families_in_ci("llama"))
@engine_examples
@given(data=st.data())
def test_decode_gemms_become_fuser_linear(family: str, data: st.DataObject) -> None:
    model, batch, lengths = data.draw(model_cases(family, max_batch=4))
    gamma = data.draw(st.sampled_from([2, 4]), label="gamma")  # batch 4 x (gamma + 1) > 16
    check(model, batch, lengths, gamma, seed=len(lengths))


def test_bf16_and_tied_embeddings() -> None:
    model = tiny_model("llama", dtype=torch.bfloat16, tie=True)
    check(model, batch=2, lengths=[6, 3], gamma=3, seed=2)


@pytest.mark.usefixtures("norm_stats_off")
def test_without_norm_stats_every_residual_norm_keeps_its_kernel() -> None:
    # the pass switched off (on by default, as test_bf16_and_tied_embeddings runs it): every
    # several-row graph keeps add_rms_norm_linear; greedy speculative output still equals
    # target-only
    model = tiny_model("llama", dtype=torch.bfloat16, tie=True)
    check(model, batch=2, lengths=[6, 3], gamma=3, seed=2)


class _NotParameters(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + x[:, :8] @ y.T  # the second mm multiplies two activations


def test_only_parameter_weights_at_decode_rows() -> None:
    module = _NotParameters().eval()
    for rows, expected in [(1, 1), (MAX_ROWS, 1), (MAX_ROWS + 1, 0)]:
        x, y = torch.randn(rows, 16), torch.randn(8, 8)
        gm = export_like_capture(module, (x, y))
        before = gemms(gm)
        assert rewrite_linears(gm, pass_context("linears")) == expected
        gm.graph.eliminate_dead_code()
        gm.recompile()
        assert gemms(gm) == before - expected
        assert count_targets(gm, torch.ops.fuser.linear.default) == expected
        torch.testing.assert_close(gm(x, y), module(x, y), rtol=0, atol=0)
