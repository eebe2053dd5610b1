"""precision="fp8": the fp8_linear pass, and an FP8 engine against an emulated-FP8 eager model.

The emulation is plain PyTorch on the user's model: every linear's weight replaced by its FP8
round trip (dequantize(quantize_weight(W)), per output channel) and, in prefill (T > 1), its
input by the per-token round trip (dequantize(quantize_rows(x))). That is exactly what the FP8
engine computes (decode: weight-only; prefill: weights and activations), so in fp32 on CPU,
where the ops run their references, the engine must match it to the fp32 logits tolerance.
Against the unquantized model the error is that of e4m3 (a few percent), which is not a bound
anything here relies on.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.fx import GraphModule

import fuser
from fuser.numerics import LOGITS_TOLERANCE, NEAR_TIE
from fuser.ops import fp8
from fuser.passes.fx import as_linear
from fuser.runtime.steps import DECODE, PREFILL
from tiny import FAMILIES, hf_logits, random_prompts, relative_error, tiny_model

CONFIG = dict(precision="fp8", max_seq_len=40, max_batch_size=2)


def emulated_fp8(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` that computes what an FP8 engine computes (fuser.ops.fp8.emulated_fp8,
    the same emulation the engine's self-check uses), hooks left on for the test's lifetime."""
    emulated = copy.deepcopy(model)
    emulation = fp8.emulated_fp8(emulated)
    emulation.__enter__()
    emulated.fp8_emulation = emulation  # keep it alive: a collected context would unhook
    return emulated


def norm_gemv_scales(gm: GraphModule) -> list[bool]:
    """For each norm + GEMV op (norm_linear; norm_stats at several rows), whether it reads FP8
    weights (a weight_scale)."""
    ops = (torch.ops.fuser.rms_norm_linear.default, torch.ops.fuser.add_rms_norm_linear.default,
           torch.ops.fuser.stats_rms_norm_linear.default)
    return [n.args[-2] is not None for n in gm.graph.nodes if n.target in ops]


def linear_weight_reads(gm: GraphModule) -> int:
    """GEMMs left that read a model weight (in the model's dtype)."""
    return sum(1 for n in gm.graph.nodes if as_linear(n) is not None)


@pytest.fixture(scope="module")
def llama() -> tuple[torch.nn.Module, fuser.Engine]:
    model = tiny_model("llama", seed=3)
    return model, fuser.optimize(model, config=fuser.FuserConfig(**CONFIG))


def test_counts_and_no_weight_read_left(llama) -> None:
    model, engine = llama
    L = model.config.num_hidden_layers
    report = engine.report()
    assert report.fallbacks == []
    # qkv (merged), o_proj, gate_up (merged), down_proj per layer, and the LM head
    assert report.passes["fp8_linear"] == 4 * L + 1
    assert report.passes["linear"] == 0
    decode, prefill = engine.target[DECODE], engine.target[PREFILL]
    # gate/up's GEMV takes the activation (gated_linear), then every norm the GEMV it feeds
    # (norm_linear: qkv, gate/up, LM head): o_proj and down_proj are left as fp8_linear
    assert report.passes["gated_linear"] == L and report.passes["norm_linear"] == 2 * L + 1
    assert decode.fused_ops["fp8_linear"] == 2 * L and "fp8_gated_linear" not in decode.fused_ops
    assert decode.fused_ops["add_rms_norm_linear"] == 2 * L
    assert decode.fused_ops["rms_norm_linear"] == 1 and "gated_act" not in decode.fused_ops
    assert norm_gemv_scales(decode.rewritten) == [True] * (2 * L + 1)  # all over FP8 weights
    # rotary, the KV-cache write and attention stay one op (the cache keeps the model's dtype)
    assert report.passes["rotary_cache"] == L and report.passes["rotary_attention"] == L
    assert decode.fused_ops["rotary_cache_attention"] == L
    assert prefill.fused_ops["fp8_scaled_mm"] == 4 * L + 1
    # Every prefill activation quantized inside the kernel that produces it, except o_proj's
    # input (the attention output): first norm, 2L - 1 add+norms and the final one, L gated.
    assert prefill.fused_ops["rms_norm_quant"] == 1
    assert prefill.fused_ops["add_rms_norm_quant"] == 2 * L
    assert prefill.fused_ops["gated_act_quant"] == L
    assert prefill.fused_ops["quantize_rows"] == L
    for graph in engine.target.steps.values():
        assert linear_weight_reads(graph.rewritten) == 0, graph.name


def test_prefill_logits_equal_emulated_fp8(llama) -> None:
    model, engine = llama
    reference = emulated_fp8(model)
    ids, mask = random_prompts(2, [7, 4], model.config.vocab_size, seed=5)
    out = engine.logits(ids, attention_mask=mask)
    real = mask.bool()
    ref = hf_logits(reference, ids, mask)
    assert relative_error(out[real], ref[real]) <= LOGITS_TOLERANCE[torch.float32]
    # ... and it is a quantized model: measurably off the unquantized one, but not by much.
    plain = relative_error(out[real], hf_logits(model, ids, mask)[real])
    assert 1e-4 < plain < 0.1


def test_greedy_equals_emulated_fp8_generate(llama) -> None:
    model, engine = llama
    reference = emulated_fp8(model)
    ids, mask = random_prompts(1, [6], model.config.vocab_size, seed=8)
    n = 12
    got = engine.generate(ids, n, attention_mask=mask, eos_token_id=[])
    with torch.no_grad():
        want = reference.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True,
                                  eos_token_id=None, pad_token_id=0)
    T = ids.shape[1]
    for i, logits in enumerate(want.logits):  # compare up to the first near-tie (DESIGN.md)
        top2 = logits[0].float().topk(2).values
        assert got[0, T + i] == want.sequences[0, T + i], f"token {i}"
        if top2[0] - top2[1] < NEAR_TIE:
            break


def test_lm_head_kept_when_asked() -> None:
    model = tiny_model("llama", seed=4)
    engine = fuser.optimize(model, config=fuser.FuserConfig(**CONFIG, fp8_lm_head=False))
    L = model.config.num_hidden_layers
    assert engine.report().passes["fp8_linear"] == 4 * L
    # the bf16/fp32 LM head GEMV, behind the final norm (norm_linear): the one fused op without
    # an FP8 scale
    assert engine.report().passes["norm_linear"] == 2 * L + 1
    assert sorted(norm_gemv_scales(engine.target[DECODE].rewritten)) == [False] + [True] * 2 * L


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_fires_on_every_supported_family(family: str) -> None:
    model = tiny_model(family, seed=1)
    engine = fuser.optimize(model, config=fuser.FuserConfig(**CONFIG))
    L = model.config.num_hidden_layers
    assert engine.report().fallbacks == []
    assert engine.report().passes["fp8_linear"] == 4 * L + 1
    assert engine.report().passes["gated_linear"] == L
    assert engine.report().passes["norm_linear"] == 2 * L + 1
    reference = emulated_fp8(model)
    ids, mask = random_prompts(2, [5, 3], model.config.vocab_size, seed=2)
    out = engine.logits(ids, attention_mask=mask)
    real = mask.bool()
    assert relative_error(out[real], hf_logits(reference, ids, mask)[real]) <= \
        LOGITS_TOLERANCE[torch.float32]


def test_outlier_weights_stay_finite() -> None:
    model = tiny_model("llama", seed=6)
    with torch.no_grad():  # weights far beyond e4m3's +-448, and a zero row
        proj = model.model.layers[0].mlp.down_proj.weight
        proj[0, :3] = torch.tensor([1e4, -3e6, 2e9])
        model.model.layers[1].self_attn.q_proj.weight[5].zero_()
    engine = fuser.optimize(model, config=fuser.FuserConfig(**CONFIG))
    ids, mask = random_prompts(2, [6, 6], model.config.vocab_size, seed=1)
    assert torch.isfinite(engine.logits(ids, attention_mask=mask)).all()
    assert torch.isfinite(engine.generate(ids, 4, attention_mask=mask).float()).all()
