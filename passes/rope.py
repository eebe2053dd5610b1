"""Rotary embedding on q and k, as Hugging Face's `apply_rotary_pos_emb` writes it.

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    q_embed = q * cos + rotate_half(q) * sin;  k_embed = k * cos + rotate_half(k) * sin

(Llama, Mistral, Qwen2), and its partial form (Phi-3, StableLM, GPT-NeoX), which rotates the
first R = cos.shape[-1] columns and concatenates the rest back unchanged. One match rewrites q
and k together into one `fuser::rotary`: one match per layer.

cos and sin are pattern inputs, not part of the pattern: how the model's rotary module makes
them (inv_freq, rope_type "default" or "llama3", attention_scaling, the cast to q's dtype) does
not matter, so every such variant takes the same path. The pattern has no casts, so the one
trace matches every dtype; the guard requires q, k, cos and sin to share one (what HF's cast
of cos/sin to q's dtype gives), which is what the op computes in.

Widths are not baked in: the matcher first matches with integer arguments ignored, then re-traces
the search function at the matched shapes, where `x.shape[-1] // 2` and `cos.shape[-1]` take the
graph's values; so one trace at D = 16 (and R = 8 for the partial form) serves every head dim
and rotary dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import PatternPass, Replacement

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_search(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(1)  # [B, 1, T, D]
    sin = sin.unsqueeze(1)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    return q_embed, k_embed


def partial_rotary_search(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(1)  # [B, 1, T, R]
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (_rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (_rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def rotary_replace(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_embed, k_embed = torch.ops.fuser.rotary(q, k, cos, sin)
    return q_embed, k_embed


def _same(a: object, b: object) -> bool:
    """Sizes certainly equal (a dynamic T equals itself; nothing is guarded on)."""
    # Imported here: symbolic_shapes imports sympy (seconds), loaded already while a build
    # rewrites graphs; a load imports the passes for their names only.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_same(x, y) for x, y in zip(a.shape, b.shape))


def _fits_the_op(match: Match, partial: bool) -> bool:
    """Guard: the op computes exactly what was matched.

    - q's and k's chains are different graph nodes (see below);
    - q, k: [B, *, T, D] with one B, T and D; cos, sin: one shape, [B or 1, T or 1, R];
    - R even (rotate_half's halves); R == D for the full form, R < D for the partial one (R == D
      there would leave an empty pass-through, which the full form covers);
    - q, k, cos, sin and both outputs of one dtype (no type promotion);
    - the outputs shaped like q and k (no broadcast widened them).
    """
    # A multi-output pattern does not require its outputs to be distinct: when q's chain cannot
    # match (an intermediate used elsewhere), k's chain alone matches both halves of the pattern
    # (q := k) and would become rotary(k, k). Each graph node must stand for one pattern node.
    if len(set(match.nodes)) != len(match.nodes):
        return False
    q, k, cos, sin = (match.kwargs[name].meta["val"] for name in ("q", "k", "cos", "sin"))
    q_embed, k_embed = (node.meta["val"] for node in match.output_nodes())
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or not _same_shape(cos, sin):
        return False
    if not q.dtype == k.dtype == cos.dtype == sin.dtype == q_embed.dtype == k_embed.dtype:
        return False
    B, _, T, D = q.shape
    R = cos.shape[-1]
    if not (isinstance(R, int) and isinstance(D, int) and R > 0 and R % 2 == 0 and R <= D):
        return False
    if (R < D) != partial:
        return False
    return (_same(k.shape[0], B) and _same(k.shape[2], T) and _same(k.shape[3], D)
            and (_same(cos.shape[0], 1) or _same(cos.shape[0], B))
            and (_same(cos.shape[1], 1) or _same(cos.shape[1], T))
            and _same_shape(q_embed, q) and _same_shape(k_embed, k))


def _full_rotary(match: Match) -> bool:
    return _fits_the_op(match, partial=False)


def _partial_rotary(match: Match) -> bool:
    return _fits_the_op(match, partial=True)


def _qk_cos_sin(rotary_dim: int) -> list[torch.Tensor]:
    # q: [B=2, H=4, T=3, D=16], k: [B, kv_heads=2, T, D], cos/sin: [B, T, R]
    return [torch.randn(2, 4, 3, 16), torch.randn(2, 2, 3, 16),
            torch.randn(2, 3, rotary_dim), torch.randn(2, 3, rotary_dim)]


# One trace each, in fp32: the patterns hold no casts, so the bf16 and fp16 traces are the same
# graph (checked; a second registration would only try every match twice). The guard's dtype
# check is what keeps a bf16 rotary with fp32 cos/sin (promoting products) out.
ROTARY = PatternPass("rotary", [
    Replacement(rotary_search, rotary_replace, example_inputs=lambda dtype: _qk_cos_sin(16),
                dtypes=(torch.float32,), extra_check=_full_rotary),
    Replacement(partial_rotary_search, rotary_replace, example_inputs=lambda dtype: _qk_cos_sin(8),
                dtypes=(torch.float32,), extra_check=_partial_rotary),
])
