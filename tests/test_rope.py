"""fuser::rotary and the rotary pass: the kernel against the reference, the pass on Llama,
Mistral and Qwen2 through the engine (numbers, fused op present, rotate_half gone, one match per
layer), bf16 with "llama3" rope and Phi-3's partial rotary on exported models, and rotaries
whose intermediates are used elsewhere.

Without a GPU the launcher runs under TRITON_INTERPRET=1 (conftest.py); with one, for real.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

import fuser
from fuser.numerics import LOGITS_TOLERANCE, relative_error
from fuser.ops.rope import rotary_reference, rotary_triton
from fuser.passes import run_passes
from fuser.passes.fx import count_targets
from fuser.passes.rope import ROTARY
from tiny import (export_like_capture, families_in_ci, model_cases, pass_context, random_prompts,
                  real_logits_error, tiny_also_matching, tiny_config)

aten = torch.ops.aten
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# The interpreter must round fp32 -> bf16 as GPUs do for the bf16 checks to mean anything.
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")

# Elementwise bound on |kernel - reference| in units of eps(dtype) * (|x * cos| + |y * sin|)
# (x * cos + y * sin being what one output element sums), keyed by dtype, with the reason.
TOLERANCE = {
    # The kernel performs PyTorch's own roundings (mul, mul, add in fp32, no FMA): bitwise.
    torch.float32: 0.0,
    # Both products are exact in fp32; the kernel rounds their sum once (plus one fp32 rounding),
    # PyTorch rounds each product and then the sum to bf16: at most u|a| + u|b| + u|a + b| of
    # difference beyond the kernel's own u|a + b| (u = eps / 2), so 1.5 eps * (|a| + |b|).
    torch.bfloat16: 1.5,
    torch.float16: 1.5,
}


# --- kernel ---------------------------------------------------------------------------------


def make_inputs(batch: int, heads: int, kv_heads: int, tokens: int, head_dim: int,
                rotary_dim: int, dtype: torch.dtype, seed: int, cos_batch: int | None = None,
                theta: float = 10000.0):
    """q, k as the model has them (transposes of [B, T, heads, D]); cos, sin as HF's rotary
    module makes them ([B, T, R], the two halves equal), at positions up to a few thousand."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, kv_heads, head_dim, generator=g).to(dtype).transpose(1, 2)
    positions = torch.randint(0, 4096, (cos_batch or batch, tokens), generator=g).float()
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    freqs = positions[..., None] * inv_freq  # [B, T, R / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, R]
    return q.to(DEVICE), k.to(DEVICE), emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)


def rounded_once(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """What the kernel computes: HF's formula in fp32, rounded once to x's dtype."""
    out, _ = rotary_reference(x.float(), x.float(), cos.float(), sin.float())
    return out.to(x.dtype)


def error_scale(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """|x * cos| + |rotate_half(x) * sin| per element (pass-through columns: |x|), in fp64."""
    R = cos.shape[-1]
    x = x.double().abs()
    cos, sin = cos.double().abs().unsqueeze(1), sin.double().abs().unsqueeze(1)
    flipped = torch.cat([x[..., R // 2:R], x[..., :R // 2]], dim=-1)  # |rotate_half(x[..., :R])|
    return torch.cat([x[..., :R] * cos + flipped * sin, x[..., R:]], dim=-1)


def check_rotary(q, k, cos, sin) -> None:
    inputs = [t.clone() for t in (q, k, cos, sin)]
    q_out, k_out = rotary_triton(q, k, cos, sin)
    q_ref, k_ref = rotary_reference(q, k, cos, sin)
    for before, after in zip(inputs, (q, k, cos, sin)):  # inputs untouched
        assert torch.equal(before, after)
    for out, ref, x in ((q_out, q_ref, q), (k_out, k_ref, k)):
        assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
        assert all(out.data_ptr() != t.data_ptr() for t in (q, k, cos, sin))
        # the kernel's own contract: fp32 arithmetic rounded once (in fp32: the reference itself)
        assert torch.equal(out, rounded_once(x, cos, sin))
        # against Hugging Face's formula in x's dtype
        bound = TOLERANCE[x.dtype] * torch.finfo(x.dtype).eps * error_scale(x, cos, sin)
        err = (out.double() - ref.double()).abs()
        assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3g}"
        assert torch.equal(out[..., cos.shape[-1]:], x[..., cos.shape[-1]:])  # passed through


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("partial", [False, True], ids=["full", "partial"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_kernel_matches_reference(tokens, head_dim, partial, dtype):
    # batch and GQA ratio vary with the other parameters (3 x 3 x 2 x 2 cases stay fast)
    case = tokens + head_dim // 16 + partial
    batch = 1 + case % 3 if tokens < 16 else 1
    heads, kv_heads = [(4, 1), (6, 2), (3, 3), (8, 2)][case % 4]
    rotary_dim = head_dim // 2 if partial else head_dim
    check_rotary(*make_inputs(batch, heads, kv_heads, tokens, head_dim, rotary_dim, dtype,
                              seed=case))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from([*DTYPES, torch.float16]),
    batch=st.integers(1, 3),
    kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    tokens=st.integers(1, 9),
    head_dim=st.sampled_from([8, 24, 64, 80, 96, 128]),
    rotary_frac=st.sampled_from([1.0, 0.5, 0.25]),
    cos_batch_one=st.booleans(),  # cos/sin [1, T, R] broadcast over the batch
    theta=st.sampled_from([10000.0, 500000.0]),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_reference_random(dtype, batch, kv_heads, group, tokens, head_dim,
                                         rotary_frac, cos_batch_one, theta, seed):
    rotary_dim = max(2, int(head_dim * rotary_frac) // 2 * 2)
    check_rotary(*make_inputs(batch, kv_heads * group, kv_heads, tokens, head_dim, rotary_dim,
                              dtype, seed, cos_batch=1 if cos_batch_one else None, theta=theta))


def test_op_checks_its_arguments():
    q, k, cos, sin = make_inputs(1, 2, 1, 3, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="dtype"):
        torch.ops.fuser.rotary(q, k, cos.double(), sin.double())
    with pytest.raises(ValueError, match="R even"):
        torch.ops.fuser.rotary(q, k, cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="R even"):
        rotary_triton(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_custom_op_cpu_equals_reference_and_opcheck(dtype, rotary_dim):
    q, k, cos, sin = (t.cpu() for t in make_inputs(2, 4, 2, 3, 16, rotary_dim, dtype, seed=1))
    q_out, k_out = torch.ops.fuser.rotary(q, k, cos, sin)
    q_ref, k_ref = rotary_reference(q, k, cos, sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    torch.library.opcheck(torch.ops.fuser.rotary.default, (q, k, cos, sin))


# --- the pass on real model families --------------------------------------------------------


def check_engine(model: torch.nn.Module, batch: int, lengths: list[int], seed: int) -> None:
    layers = model.config.num_hidden_layers
    tolerance = LOGITS_TOLERANCE[next(model.parameters()).dtype]
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=batch,
                                                            batch_buckets=(batch,), max_seq_len=16))
    report = engine.report()

    # 1. numbers agree with eager on every real (non-padding) position
    assert real_logits_error(engine, model, batch, lengths, seed) <= tolerance

    # 3. exact counts: one match per layer, q and k together
    assert report.passes["rotary"] == layers
    # 2. the fused op in every graph (prefill and decode), the unfused rotary gone: rotate_half's
    # neg is the only one a layer has, and no cat over head tensors is left (rotate_half's, and
    # partial rotary's pass-through cat; the rotary module's cat(freqs, freqs) is 3-D). In the
    # decode graph the rotary_cache pass folds it into fuser::rotary_cache_write
    # (tests/test_rotary_cache.py), and rotary_attention that into the attention after it
    # (tests/test_rotary_attention.py).
    assert {kind.name for kind in engine.target.steps} == {"prefill", "decode"}
    for kind, graph in engine.target.steps.items():
        fused = "rotary_cache_attention" if kind.fixed else "rotary"
        assert graph.fused_ops[fused] == layers, graph.name
        assert graph.fused_ops.get("rotary", 0) == (0 if kind.fixed else layers), graph.name
        assert count_targets(graph.rewritten, aten.neg.default) == 0, graph.name
        assert head_cats(graph.rewritten) == 0, graph.name


def head_cats(gm: torch.fx.GraphModule) -> int:
    """cat nodes whose output is 4-D ([B, heads, T, D]-like)."""
    return sum(1 for n in gm.graph.nodes
               if n.target is aten.cat.default and n.meta["val"].dim() == 4)


@pytest.mark.parametrize("family", families_in_ci("llama"))  # the others: -m slow
@settings(max_examples=2, deadline=None, derandomize=True)
@given(data=st.data())
def test_rotary_fused_and_exact(family: str, data: st.DataObject) -> None:
    model, batch, lengths = data.draw(model_cases(family, max_batch=3))
    check_engine(model, batch, lengths, seed=len(lengths))


def fuse_exported(model: torch.nn.Module, ids: torch.Tensor
                  ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """The model's forward exported (as capture does, without the engine), and a copy with only
    the rotary pass applied: (fused, unfused, matches). Cheaper than an engine, and on CPU the
    fused op is the reference, so the two must agree bit for bit."""
    unfused = export_like_capture(model, (ids,), {"use_cache": False})
    fused = copy.deepcopy(unfused)
    return fused, unfused, ROTARY.apply(fused, pass_context("rotary"))


def check_fused_model(model: torch.nn.Module) -> None:
    layers = model.config.num_hidden_layers
    tolerance = LOGITS_TOLERANCE[next(model.parameters()).dtype]
    ids, _ = random_prompts(2, [7, 7], model.config.vocab_size, seed=4)
    fused, unfused, matches = fuse_exported(model, ids)
    assert matches == layers
    assert count_targets(fused, torch.ops.fuser.rotary.default) == layers
    assert count_targets(fused, aten.neg.default) == 0 and head_cats(fused) == 0
    with torch.no_grad():
        out = fused(ids, use_cache=False).logits
        assert torch.equal(out, unfused(ids, use_cache=False).logits)
        assert relative_error(out, model(ids, use_cache=False).logits) <= tolerance


def test_bf16_llama3_rope() -> None:
    # bf16: cos/sin are cast to q's dtype before the pattern (the one fp32 trace matches, since
    # the pattern has no casts); rope_type "llama3" only changes inv_freq, outside the pattern.
    config = tiny_config("llama", layers=2, head_dim=24)
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 16}
    torch.manual_seed(0)
    check_fused_model(LlamaForCausalLM(config).eval().to(torch.bfloat16))


def test_partial_rotary_phi3() -> None:
    # Phi-3 with partial_rotary_factor 0.5 (its qkv_proj is one linear, so q and k are slices
    # of one output): q[..., :R] rotated, q[..., R:] passed through, concatenated back.
    # Phi-3 is not a supported family: a case where the fusion also matches.
    model = tiny_also_matching(
        "phi3", intermediate_size=40, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5})
    check_fused_model(model)


# --- intermediates used elsewhere -------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _hf_rotary(q, k, cos, sin):
    """HF's apply_rotary_pos_emb, also handing back rotate_half(q) and rotate_half(k)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rotated_q, rotated_k = _rotate_half(q), _rotate_half(k)
    return q * cos + rotated_q * sin, k * cos + rotated_k * sin, rotated_q, rotated_k


class _LeakyQ(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        q_embed, k_embed, rotated_q, _ = _hf_rotary(q, k, cos, sin)
        return q_embed, k_embed, rotated_q * 2  # rotate_half(q) is used outside the rotary


class _LeakyK(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        q_embed, k_embed, _, rotated_k = _hf_rotary(q, k, cos, sin)
        return q_embed, k_embed, rotated_k * 2


class _Clean(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        q_embed, k_embed, _, _ = _hf_rotary(q, k, cos, sin)
        return q_embed, k_embed, q * 2


class _Uncast(torch.nn.Module):
    """cos/sin left in fp32 next to bf16 q, k: PyTorch promotes the products to fp32, which the
    op (computing in q's dtype) does not do; the guard must refuse it."""

    def forward(self, q, k, cos, sin):
        q_embed, k_embed, _, _ = _hf_rotary(q.bfloat16(), k.bfloat16(), cos, sin)
        return q_embed, k_embed, q * 2


class _Cast(torch.nn.Module):
    """_Uncast's twin with cos/sin cast to q's dtype, as HF's rotary module does: rewritten."""

    def forward(self, q, k, cos, sin):
        q_embed, k_embed, _, _ = _hf_rotary(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())
        return q_embed, k_embed, q * 2


class _Partial(torch.nn.Module):
    """Partial rotary as Phi-3/StableLM/GPT-NeoX write it: R = 8 of D = 24."""

    def forward(self, q, k, cos, sin):
        cos, sin = cos[..., :8], sin[..., :8]
        q_embed, k_embed, _, _ = _hf_rotary(q[..., :8], k[..., :8], cos, sin)
        return torch.cat([q_embed, q[..., 8:]], -1), torch.cat([k_embed, k[..., 8:]], -1), q * 2


@pytest.mark.parametrize(("module", "matches"), [
    (_LeakyQ, 0), (_LeakyK, 0), (_Uncast, 0), (_Clean, 1), (_Cast, 1), (_Partial, 1),
])
def test_rotary_with_used_intermediate_is_not_rewritten(module: type, matches: int) -> None:
    q, k, cos, sin = (t.cpu() for t in make_inputs(2, 4, 2, 3, 24, 24, torch.float32, seed=3))
    args = (q.contiguous(), k.contiguous(), cos, sin)
    m = module().eval()
    gm = export_like_capture(m, args)
    result = run_passes(gm, pass_context("leak"))
    assert result.errors == []
    assert result.matches["rotary"] == matches  # the positive twins prove the pattern works
    assert result.fused_ops.get("rotary", 0) == matches
    for got, want in zip(gm(*args), m(*args)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# --- GPU --------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize(("tokens", "head_dim", "rotary_dim"), [(1, 128, 128), (7, 128, 64), (300, 80, 80)])
def test_custom_op_cuda_bf16(tokens, head_dim, rotary_dim):
    q, k, cos, sin = make_inputs(4, 32, 8, tokens, head_dim, rotary_dim, torch.bfloat16, seed=tokens)
    q_out, k_out = torch.ops.fuser.rotary(q, k, cos, sin)
    q_tri, k_tri = rotary_triton(q, k, cos, sin)
    assert torch.equal(q_out, q_tri) and torch.equal(k_out, k_tri)  # the CUDA kernel is Triton's
    check_rotary(q, k, cos, sin)
