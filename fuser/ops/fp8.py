"""FP8 (float8 e4m3fn) quantization: the scales, the casts and the reference math of the FP8 ops.

No op and no kernel lives here: this is the plain-PyTorch definition that the FP8 kernels
(fuser/ops/linear.py's `fuser::fp8_linear`, fuser/ops/fp8_quant.py) reproduce and that the CPU
path runs.

Weights (once, at compile time; no calibration data):
    scale[n] = max(amax_k |w[n, k]|, FP8_MIN_AMAX) / FP8_MAX          per output channel, fp32
    w_fp8[n, k] = e4m3fn(clamp(w[n, k] / scale[n], -FP8_MAX, FP8_MAX))
A merged projection (QKV, gate/up) is quantized after merging: one scale vector for the whole
[N_q + N_k + N_v, K] matrix, one entry per output channel, so merging changes no value.

Activations (prefill, per token = per row of x [M, K], dynamically):
    x_scale[m] = max(amax_k |x[m, k]|, FP8_MIN_AMAX) / FP8_MAX,   x_fp8 = e4m3fn(clamp(x / x_scale))

e4m3fn has no infinity: a cast of anything beyond +-448 is not a number we want (PyTorch
saturates, other casts give NaN), so values are clamped to +-FP8_MAX first. x / scale can exceed
448 only by rounding (amax / (amax / 448) may land an ulp above 448), so the clamp changes no
other value. The floor FP8_MIN_AMAX keeps the scale of an all-zero row positive (no 0 / 0) and
normal in fp32 (a subnormal scale would lose precision in the division); rows whose amax is
below it (~5e-36, far below any real weight or activation) are quantized more coarsely, never to
NaN.

Every division is an IEEE fp32 division (correctly rounded; the Triton kernels use div_rn), and
e4m3fn rounding is to nearest even: a kernel that follows these steps gives the same bits.

Precision: e4m3fn has 3 mantissa bits. A normal code (|v| >= 2^-6) is within half an ulp,
2^-4 of |v|; a subnormal one within 2^-10 absolute. In weight units (times the scale, and
|v| <= 448 so 2^-4 |v| scale <= 2^-4 amax): |dequantize(w) - w| <= max(2^-4 |w|, 2^-10 scale),
plus the fp32 rounding of the division and of the dequantizing multiply.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                                   # largest finite e4m3fn value
# Smallest amax that gets its own scale: keeps every scale >= the smallest normal fp32.
FP8_MIN_AMAX = FP8_MAX * torch.finfo(torch.float32).tiny


def _row_scale(amax: Tensor) -> Tensor:
    """amax: [R] fp32 -> scale [R] fp32 = max(amax, FP8_MIN_AMAX) / FP8_MAX (exact fp32 division).

    The floor is applied to amax, not to the quotient, so that amax / 448 is one correctly
    rounded division of the kernel's amax and the same in every implementation.
    """
    # A tensor divisor, not the Python float: PyTorch's CUDA kernel divides by a scalar as a
    # product with its reciprocal (one ulp off the correctly rounded quotient in some rows,
    # unlike the Triton kernels' div_rn and every CPU path); a 0-dim tensor gets true division.
    amax = amax.clamp_min(FP8_MIN_AMAX)
    return amax / amax.new_full((), FP8_MAX)


def _cast(values: Tensor, scale: Tensor) -> Tensor:
    """values: [R, C] fp32, scale: [R] fp32 -> e4m3fn codes of clamp(values / scale, +-448)."""
    return (values / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """w: [N, K] (any float dtype) -> (w_fp8 [N, K] e4m3fn, scale [N] fp32), per output channel.

    Raises ValueError if w is not a 2-D floating tensor or holds NaN or infinity (a scale from
    an infinite amax would zero the whole row; a NaN would poison it).
    """
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_weight: expected a 2-D float weight [N, K], got "
                         f"{w.dtype} {tuple(w.shape)}")
    w32 = w.float()
    finite = torch.isfinite(w32)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise ValueError(f"quantize_weight: weight holds NaN or infinity ({int((~finite).sum())} "
                         f"values, first at {bad}: {w32[bad[0], bad[1]].item()}); "
                         "cannot compute an FP8 scale")
    amax = w32.abs().amax(dim=1) if w.shape[1] else w32.new_zeros(w.shape[0])   # [N]
    scale = _row_scale(amax)                                                      # [N]
    return _cast(w32, scale), scale


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x: [M, K] -> (x_fp8 [M, K] e4m3fn, scale [M] fp32): dynamic per-token quantization.

    The reference of the fused norm + quantize and activation + quantize kernels
    (fuser/ops/fp8_quant.py). Non-finite inputs are not checked (no host sync); a finite row,
    however large, gives finite codes and a finite scale.
    """
    assert x.dim() == 2, f"quantize_rows: expected [M, K], got {tuple(x.shape)}"
    x32 = x.float()
    amax = x32.abs().amax(dim=1) if x.shape[1] else x32.new_zeros(x.shape[0])    # [M]
    scale = _row_scale(amax)                                                      # [M]
    return _cast(x32, scale), scale


def dequantize(q: Tensor, scale: Tensor) -> Tensor:
    """q: [R, C] e4m3fn, scale: [R] fp32 -> q * scale[:, None] in fp32 (what the kernels use)."""
    return q.float() * scale[:, None]


def fp8_linear_reference(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    """Weight-only FP8 linear (decode): x [..., K] (bf16/fp16/fp32) against w_fp8 [N, K] with
    per-channel w_scale [N] -> [..., N] in x's dtype.

    out = ((x @ w_fp8.T) in fp32) * w_scale, rounded once to x's dtype: the scale applied once
    per output after the sum, as the kernel does.
    """
    return ((x.float() @ w_fp8.float().T) * w_scale).to(x.dtype)


def fp8_scaled_mm_reference(x_fp8: Tensor, x_scale: Tensor, w_fp8: Tensor, w_scale: Tensor,
                            out_dtype: torch.dtype) -> Tensor:
    """FP8 x FP8 GEMM with rowwise scales (prefill): x_fp8 [M, K], x_scale [M], w_fp8 [N, K],
    w_scale [N] -> [M, N] in out_dtype; products and sums in fp32, as the tensor cores do."""
    acc = x_fp8.float() @ w_fp8.float().T                                         # [M, N]
    return (acc * x_scale[:, None] * w_scale[None, :]).to(out_dtype)


@contextmanager
def emulated_fp8(model: torch.nn.Module, lm_head: bool = True,
                 prefill_tokens: int | None = None) -> Iterator[torch.nn.Module]:
    """Within the block, `model`'s linears compute what an FP8 engine computes, in plain
    PyTorch: the weight's FP8 round trip (dequantize(quantize_weight(W)), per output channel)
    and, for the positions a prefill step computes, the activation's per-token round trip.

    prefill_tokens: how many leading positions of each call count as prefill (their inputs are
    quantized; the engine's decode and verification steps do not quantize activations). None:
    every position of a call with more than one position. The model is restored on exit; its
    weights are never modified (the round trip is computed per call).
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None

    def hook(module: torch.nn.Module, args: tuple, output: Tensor) -> Tensor:
        x = args[0]  # [..., T, K]
        T = x.shape[-2] if x.dim() >= 2 else 1
        n = (T if T > 1 else 0) if prefill_tokens is None else min(prefill_tokens, T)
        if n:
            head_rows = x[..., :n, :]
            codes, scale = quantize_rows(head_rows.reshape(-1, x.shape[-1]))
            quantized = dequantize(codes, scale).to(x.dtype).reshape(head_rows.shape)
            x = torch.cat([quantized, x[..., n:, :]], dim=-2)
        codes, scale = quantize_weight(module.weight.detach())
        weight = dequantize(codes, scale).to(module.weight.dtype)
        return torch.nn.functional.linear(x, weight, module.bias)

    handles = [m.register_forward_hook(hook) for m in model.modules()
               if isinstance(m, torch.nn.Linear) and (lm_head or m is not head)]
    try:
        yield model
    finally:
        for handle in handles:
            handle.remove()
