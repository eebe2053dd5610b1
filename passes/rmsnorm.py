"""RMSNorm and residual-add + RMSNorm, as Hugging Face's LlamaRMSNorm writes them.

    h = x.to(float32); h = h * rsqrt(mean(h^2, -1) + eps); out = weight * h.to(x.dtype)

Llama, Mistral and Qwen2 share this norm. The residual variant also hands back the sum, which the
next layer keeps as its residual. eps is a captured argument (one pattern for every eps); the
dtypes only change where casts sit, so each pair is traced once for fp32 (no casts) and once for
a half type (casts; the cast's target dtype is a wildcard, so bf16 traces also match fp16).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import fuser.ops  # noqa: F401  (registers torch.ops.fuser.*)
from fuser.passes.base import PatternPass, Replacement

if TYPE_CHECKING:
    from torch._inductor.pattern_matcher import Match

aten = torch.ops.aten


def _hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def rms_norm_search(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _hf_rms_norm(x, weight, eps)


def rms_norm_replace(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.fuser.rms_norm(x, weight, eps)


def add_rms_norm_search(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return _hf_rms_norm(summed, weight, eps), summed


def add_rms_norm_replace(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    normed, summed = torch.ops.fuser.add_rms_norm(x, residual, weight, eps)
    return normed, summed


def _computes_like_hf(match: Match) -> bool:
    """Guard: the matched norm squares in fp32 and casts back to its input dtype before the
    weight multiply, as the fused op does. (The fp32 trace has no casts, so without this it
    would also match a bf16 norm that never upcasts.)"""
    square = next(n for n in match.nodes if n.target is aten.pow.Tensor_Scalar)
    upcast = square.args[0]
    if upcast.meta["val"].dtype != torch.float32:
        return False
    source = upcast.args[0] if upcast.target is aten._to_copy.default else upcast
    in_dtype = source.meta["val"].dtype
    weighted = match.output_nodes()[0]
    normed = weighted.args[1]
    return normed.meta["val"].dtype == in_dtype


def _row_inputs(dtype: torch.dtype, n: int) -> list[torch.Tensor]:
    return [torch.randn(2, 8, dtype=dtype) for _ in range(n)] + [torch.randn(8, dtype=dtype)]


ADD_RMS_NORM = PatternPass("add_rms_norm", [Replacement(
    add_rms_norm_search, add_rms_norm_replace,
    example_inputs=lambda dtype: [*_row_inputs(dtype, 2), 1e-6],
    extra_check=_computes_like_hf, scalar_workaround={"eps": 1e-6},
)])

RMS_NORM = PatternPass("rms_norm", [Replacement(
    rms_norm_search, rms_norm_replace,
    example_inputs=lambda dtype: [*_row_inputs(dtype, 1), 1e-6],
    extra_check=_computes_like_hf, scalar_workaround={"eps": 1e-6},
)])
