"""The decode GEMV with the RMSNorm (and the residual add) in its prologue.

    rms_norm_linear(x, g, eps, W, w_scale, act) = linear(rms_norm(x, g, eps), W, ...)
    add_rms_norm_linear(x, r, g, eps, W, w_scale, act) -> (linear(normed, W, ...), summed)
        with (normed, summed) = add_rms_norm(x, r, g, eps)

passes/norm_linear.py folds the norm into the GEMV that reads its output: the GEMV's input is
computed in fuser/ops/linear.py's kernel (its NORM prologue) instead of by fuser::rms_norm /
add_rms_norm (one kernel and one launch gap fewer per norm: 2L + 1 per decode step, 65 on
Llama-3-8B; ~2.5 us each on an H200), over any of the four linears (w_scale None: x's dtype;
act None: not gated). Each program first makes one pass over its
rows' K for the sum of squares of h = x (+ r), h rounded to x's dtype before any upcast, and
rstd = rsqrt(sum / K + eps) in fp32 (rmsnorm.py's formula); program 0 also writes h to `summed`
(a separate buffer, never x or r: the other programs still read them). The K loop then loads
x (and r) tiles instead of a normalised tile and forms g * (h * rstd).to(dtype), rounded once
to x's dtype, with rmsnorm.py's own helpers (_load_block, _normalise): the value the norm
kernel writes, bit for bit, except where the sum of squares, summed in another order (BLOCK_K
chunks, then one reduction, against the norm kernel's single row-wide one), moves rstd by an
ulp: in fp32 such a row then differs from norm-then-GEMV by ~2^-24 relative, in bf16/fp16
nearly never (tests/test_ops_norm_linear.py). The kernel takes x, r and g in one dtype; the
ops run the separate kernels for anything else and above MAX_ROWS; on CUDA also above
NORM_PROLOGUE_MAX_ROWS (one row), where the prologue measured slower than the norm kernel.
At one row with FP8 weights, no gated activation and fewer than 2^16 outputs (the 8B qkv:
fuser/ops/gemv_tables.py rstd_last_for) there is no first pass: the K loop multiplies each
weight tile by g * h in fp32 (exact for bf16/fp16: h and g have 8 or 11 significant bits),
gathers h * h from the same tiles, and multiplies each output's fp32 sum by
rstd after the loop (rstd is one number per row: it factors out of the sum). The norm's own
roundings of the normed row are gone, so the result is closer to the exact norm-then-GEMV than
the unfused kernels' (tests/test_ops_norm_linear.py holds both), and not their bits.

At several rows on CUDA the ops run the norm kernel, then the GEMV (the prologue in every
program measured slower there); for bf16 rows and FP8 weights the norm kernel writes its rows as
e4m3 pieces for the FP8 MMA (fuser/ops/e4m3_pieces.py), measured faster than the fp16 MMA on the
normed rows.

Cost: the GEMV's (fuser/ops/linear.py), and from HBM + M * K * (s_r + s_sum) + K * s_g (the
residual, summed written once, the norm weight) and no normed tensor written and read back; from
L2, every program reads its rows of x (and r) twice (the sum-of-squares pass, then the K loop)
and g once: grid * M * K * (2 (s_x + s_r) + s_g) bytes, e.g. 768 programs x 4096 x 10 B ~ 31 MB
for qkv at M = 1 against its 50 MB weight from HBM; the first pass also delays each program's
first weight load by one walk over x. FLOPs + ~5 * M * K per program (the recomputed norm). With
rstd after the sum (one row) x and r are read once per program, in the K loop: grid * K * (s_x +
s_r + s_g) from L2.
"""

import torch
from torch import Tensor

from fuser.ops.e4m3_pieces import add_rms_norm_pieces_triton, pieces_supported
from fuser.ops.fp8 import FP8_DTYPE, fp8_linear_reference
from fuser.ops.fp8_linear import fp8_gated_linear_reference
from fuser.ops.gemv_tables import GEMV_DTYPES, MAX_ROWS, _row_count
from fuser.ops.linear import (_launch, check_gated, gated_linear_reference, linear_pieces_triton,
                              linear_reference)
from fuser.ops.rmsnorm import add_rms_norm_reference, rms_norm_reference


# ---------------------------------------------------------------------------------------------
# Launcher
# ---------------------------------------------------------------------------------------------


def rms_norm_linear_triton(
    x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor, *,
    weight_scale: Tensor | None = None, activation: str | None = None,
    block_n: int | None = None, block_k: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
    prefetch: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """linear_triton(normed, weight, ...) with normed = fuser::rms_norm(x, norm_weight, eps), or
    fuser::add_rms_norm(x, residual, norm_weight, eps)'s first output, in one kernel:
    (out, summed), summed = x + residual ([..., K], as add_rms_norm returns it; None without a
    residual). x, residual and norm_weight share one dtype (bf16/fp16/fp32); `weight` is in it
    too, or e4m3fn with weight_scale.
    """
    if norm_weight.shape != (x.shape[-1],):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not match width "
                         f"{x.shape[-1]}")
    dtypes = {x.dtype, norm_weight.dtype} | ({residual.dtype} if residual is not None else set())
    if len(dtypes) != 1:
        raise ValueError(f"x, residual and norm weight must share a dtype, got {dtypes}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} != x {tuple(x.shape)}")
    return _launch(x, residual, norm_weight, eps, weight, weight_scale, activation,
                   (block_n, block_k, num_warps, num_stages, split_k, prefetch))


# ---------------------------------------------------------------------------------------------
# Custom ops: CPU runs the unfused references; CUDA runs the separate kernels above
# MAX_ROWS or for mixed dtypes, so correctness never depends on shape. Two ops, as
# rms_norm and add_rms_norm are two: the residual form also returns the sum.
# ---------------------------------------------------------------------------------------------


def _linear_op(normed: Tensor, weight: Tensor, weight_scale: Tensor | None,
               activation: str | None) -> Tensor:
    """The fuser op the fused ops stand for, applied to the norm's output."""
    if weight_scale is None:
        if activation is None:
            return torch.ops.fuser.linear(normed, weight)
        return torch.ops.fuser.gated_linear(normed, weight, activation)
    if activation is None:
        return torch.ops.fuser.fp8_linear(normed, weight, weight_scale)
    return torch.ops.fuser.fp8_gated_linear(normed, weight, weight_scale, activation)


def _norm_linear_fake_out(normed_dtype: torch.dtype, x: Tensor, weight: Tensor,
                          activation: str | None) -> Tensor:
    if activation is not None:
        check_gated(weight, activation)
    n = weight.shape[0] // 2 if activation is not None else weight.shape[0]
    return torch.empty((*x.shape[:-1], n), dtype=normed_dtype, device=x.device)


# Rows up to which the norm runs inside the GEMV on CUDA. One row (decode) measured faster
# fused; at 5 rows (verification, the MMA path) the fused kernels made the 8B verify step 1.40x
# the decode step in bf16 and 3.09x in FP8, against 1.09x and 1.48x with separate norm kernels
# (benchmarks/decode.py on the H200, 2026-12-01): there the op runs the norm kernel,
# then the GEMV. Where a GEMV produces the norm's input, passes/norm_stats.py moves the norm into
# the two GEMVs instead (fuser/ops/norm_stats.py).
NORM_PROLOGUE_MAX_ROWS = 1


def _fused_kernel_takes(x: Tensor, residual: Tensor | None, norm_weight: Tensor, weight: Tensor,
                        weight_scale: Tensor | None) -> bool:
    """Whether the one-kernel path computes these: decode rows, one activation dtype (which the
    unfused GEMV also needs: its input is the norm's output, in promote(norm_weight, x))."""
    rows = _row_count(x)
    dtypes = {x.dtype, norm_weight.dtype} | ({residual.dtype} if residual is not None else set())
    return (rows <= NORM_PROLOGUE_MAX_ROWS and len(dtypes) == 1 and x.dtype in GEMV_DTYPES
            and (weight.dtype == x.dtype if weight_scale is None else weight.dtype == FP8_DTYPE))


def _norm_pieces_take(x: Tensor, residual: Tensor | None, norm_weight: Tensor,
                      weight_scale: Tensor | None) -> bool:
    """Whether the several-row norm hands the FP8 GEMV its rows as e4m3 pieces: 2..16 bf16
    rows, FP8 weights."""
    rows = _row_count(x)
    return (weight_scale is not None and 1 < rows <= MAX_ROWS
            and pieces_supported(x, norm_weight, residual))


def _norm_pieces_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                        weight: Tensor, weight_scale: Tensor, activation: str | None
                        ) -> tuple[Tensor, Tensor | None]:
    """The norm kernel writing pieces, then the GEMV on them: (out, summed or None)."""
    hi, lo, inv, summed = add_rms_norm_pieces_triton(x, residual, norm_weight, eps)
    out = linear_pieces_triton(hi, lo, inv, weight, weight_scale, activation=activation,
                               out_dtype=x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1]), summed


@torch.library.custom_op("fuser::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                    weight_scale: Tensor | None, activation: str | None) -> Tensor:
    """x [..., K], norm_weight [K], weight [N, K] (or [2N, K] gated; e4m3fn with weight_scale)
    -> linear(rms_norm(x, norm_weight, eps), weight) [..., N], by the four linears' rules."""
    return rms_norm_linear_reference(x, norm_weight, eps, weight, weight_scale, activation)


@rms_norm_linear.register_fake
def _rms_norm_linear_fake(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                          weight_scale: Tensor | None, activation: str | None) -> Tensor:
    return _norm_linear_fake_out(torch.promote_types(norm_weight.dtype, x.dtype), x, weight,
                                 activation)


def _rms_norm_linear_cuda(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                          weight_scale: Tensor | None, activation: str | None) -> Tensor:
    if _norm_pieces_take(x, None, norm_weight, weight_scale):
        return _norm_pieces_linear(x, None, norm_weight, eps, weight, weight_scale,
                                   activation)[0]
    if not _fused_kernel_takes(x, None, norm_weight, weight, weight_scale):
        return _linear_op(torch.ops.fuser.rms_norm(x, norm_weight, eps), weight, weight_scale,
                          activation)
    out, _ = rms_norm_linear_triton(x, None, norm_weight, eps, weight, weight_scale=weight_scale,
                                    activation=activation)
    return out


rms_norm_linear.register_kernel("cuda")(_rms_norm_linear_cuda)


@torch.library.custom_op("fuser::add_rms_norm_linear", mutates_args=())
def add_rms_norm_linear(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                        weight: Tensor, weight_scale: Tensor | None, activation: str | None
                        ) -> tuple[Tensor, Tensor]:
    """(linear(normed, weight), summed) with (normed, summed) = add_rms_norm(x, residual,
    norm_weight, eps); shapes and the linear's rules as fuser::rms_norm_linear."""
    out, summed = add_rms_norm_linear_reference(x, residual, norm_weight, eps, weight,
                                                weight_scale, activation)
    return out, summed


@add_rms_norm_linear.register_fake
def _add_rms_norm_linear_fake(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                              weight: Tensor, weight_scale: Tensor | None, activation: str | None
                              ) -> tuple[Tensor, Tensor]:
    summed_dtype = torch.promote_types(x.dtype, residual.dtype)
    out = _norm_linear_fake_out(torch.promote_types(norm_weight.dtype, summed_dtype), x, weight,
                                activation)
    return out, torch.empty(x.shape, dtype=summed_dtype, device=x.device)


def _add_rms_norm_linear_cuda(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                              weight: Tensor, weight_scale: Tensor | None, activation: str | None
                              ) -> tuple[Tensor, Tensor]:
    if _norm_pieces_take(x, residual, norm_weight, weight_scale):
        return _norm_pieces_linear(x, residual, norm_weight, eps, weight, weight_scale,
                                   activation)
    if not _fused_kernel_takes(x, residual, norm_weight, weight, weight_scale):
        normed, summed = torch.ops.fuser.add_rms_norm(x, residual, norm_weight, eps)
        return _linear_op(normed, weight, weight_scale, activation), summed
    return rms_norm_linear_triton(x, residual, norm_weight, eps, weight,
                                  weight_scale=weight_scale, activation=activation)


add_rms_norm_linear.register_kernel("cuda")(_add_rms_norm_linear_cuda)


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def linear_any_reference(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                         activation: str | None) -> Tensor:
    """What _linear_op's op computes on CPU: its reference."""
    if weight_scale is None:
        if activation is None:
            return linear_reference(x, weight)
        return gated_linear_reference(x, weight, activation)
    if activation is None:
        return fp8_linear_reference(x, weight, weight_scale)
    return fp8_gated_linear_reference(x, weight, weight_scale, activation)


def rms_norm_linear_reference(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                              weight_scale: Tensor | None, activation: str | None) -> Tensor:
    """fuser::rms_norm's reference, then the linear's: what the two ops compute on CPU."""
    normed = rms_norm_reference(x, norm_weight, eps).contiguous()
    return linear_any_reference(normed, weight, weight_scale, activation)


def add_rms_norm_linear_reference(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                                  weight: Tensor, weight_scale: Tensor | None,
                                  activation: str | None) -> tuple[Tensor, Tensor]:
    """fuser::add_rms_norm's reference, then the linear's: what the two ops compute on CPU."""
    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps)
    out = linear_any_reference(normed.contiguous(), weight, weight_scale, activation)
    return out, summed.contiguous()
