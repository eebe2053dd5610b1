"""The several-row norm without a norm kernel: the GEMV before it adds the residual, multiplies
by the norm weight and sums the squares; the GEMV after it scales its sums by rstd.

At 2..16 rows (the verification step, the draft's catch-up) a layer's two residual-add +
RMSNorms each ran as their own kernel between two GEMVs (fuser::add_rms_norm_linear at several
rows: the norm kernel, then the GEMV; the norm inside every GEMV program measured slower, see
norm_linear.NORM_PROLOGUE_MAX_ROWS). Here the norm's work moves into the two GEMVs around it:

    y = linear(a, W_o)                                  o_proj (or down_proj): a GEMV
    out, summed = add_rms_norm_linear(y, r, g, eps, W)  norm kernel + GEMV
  becomes
    summed, gh, squares = linear_residual(a, W_o, s_o, r, g)
                                                        the GEMV; its epilogue adds r, writes
                                                        g * summed and sums summed^2 per 16
                                                        columns of each row
    out = stats_rms_norm_linear(summed, gh, squares, g, eps, W, s, act)
                                                        the GEMV of gh; its fp32 sums times the
                                                        row's rstd = rsqrt(sum / K + eps)

one kernel per norm fewer (passes/norm_stats.py), and the second GEMV's K loop is a plain GEMV's:
x's tiles go to the MMA as loaded. (Normalising each x tile in the K loop instead, as the norm
prologue does, made the 8B verify step slower on an H200, and the FP8 one 2.8x the decode step.)
The GEMVs after the norm take plain weights: an FP8 GEMV there keeps fuser::add_rms_norm_linear,
whose norm kernel hands it x as e4m3 pieces for the FP8 MMA (measured faster than every form of
FP8 consumer tried here: docs/performance-notes.md). The GEMV before it may be FP8 (the 8B
down_proj before the final norm and a bf16 LM head).

Numerics: summed is what add_rms_norm writes (the linear's output rounded to its dtype, plus r,
rounded once). The norm's output feeding the GEMV is g * h * rstd with one rounding (g * h, to
the dtype) where fuser::rms_norm rounds twice ((h * rstd) to the dtype, then times g): closer
to the exact norm than the unfused kernels (tested).
rstd comes from the group sums added in one fixed order (deterministic).

On CPU both ops run their references: linear then add, and the norm from summed itself (gh and
the squares are not read), so a CPU graph computes the same bits with or without the pass.

Cost: linear_residual reads the residual and norm weight tiles and writes summed and gh (twice
the linear's output bytes) and M * N / 16 fp32 sums; stats_rms_norm_linear reads M * K / 16 fp32
sums once per program (L2), after its loop; the norm kernel's launch, its read of x and r and
its write of normed and summed are gone.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from fuser.ops.e4m3_pieces import split_pieces_triton
from fuser.ops.fp8 import FP8_DTYPE
from fuser.ops.fp8_linear import _split_pieces_take
from fuser.ops.gemv_tables import GEMV_DTYPES, MAX_ROWS, STAT_COLS, _row_count
from fuser.ops.linear import _launch
from fuser.ops.norm_linear import (_linear_op, _norm_linear_fake_out, linear_any_reference,
                                   rms_norm_linear_reference)

__all__ = [
    "group_squares_reference",
    "residual_outputs",
    "linear_residual_reference",
    "linear_residual_triton",
    "normed_linear_triton",
    "stats_rms_norm_linear_reference",
]


def group_squares_reference(summed: Tensor) -> Tensor:
    """summed [..., N] -> [rows, cdiv(N, STAT_COLS)] fp32: each row's sums of summed^2 over
    consecutive groups of STAT_COLS columns (the last group padded with zeros)."""
    h = summed.reshape(-1, summed.shape[-1]).float()
    pad = -h.shape[-1] % STAT_COLS
    h = torch.nn.functional.pad(h, (0, pad))
    return h.square().reshape(h.shape[0], -1, STAT_COLS).sum(-1)


def residual_outputs(y: Tensor, residual: Tensor, norm_weight: Tensor
                     ) -> tuple[Tensor, Tensor, Tensor]:
    """fuser::linear_residual's outputs from the linear's output y: (summed = y + residual in
    their dtype, shaped as residual; norm_weight * summed; group_squares_reference(summed))."""
    summed = (y.reshape(residual.shape) + residual).contiguous()
    return summed, (norm_weight * summed).contiguous(), group_squares_reference(summed)


def _takes(rows: int, x: Tensor, weight: Tensor, weight_scale: Tensor | None) -> bool:
    """Whether the kernels compute this: CUDA, 2..MAX_ROWS rows, x in a GEMV dtype, the weight
    in x's dtype (or e4m3fn with a scale), nothing empty."""
    return (x.device.type == "cuda" and 1 < rows <= MAX_ROWS and x.dtype in GEMV_DTYPES
            and x.shape[-1] > 0 and weight.shape[0] > 0
            and (weight.dtype == x.dtype if weight_scale is None else weight.dtype == FP8_DTYPE))


def linear_residual_triton(x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor, *,
                           weight_scale: Tensor | None = None, block_n: int | None = None,
                           block_k: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, split_k: int | None = None,
                           pieces: tuple[Tensor, Tensor, Tensor] | None = None
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(summed, gh, squares) for 2..16 rows of x [..., K], weight [N, K] (e4m3fn with
    weight_scale), residual [..., N] and norm_weight [N] in x's dtype: summed =
    linear(x, weight) + residual as fuser::add_rms_norm adds them, shaped as residual; gh =
    norm_weight * summed (rounded once), shaped as residual; squares [M, cdiv(N, STAT_COLS)]
    fp32 (group_squares_reference of summed, in the kernel's order). One _linear_kernel
    launch; the keyword arguments override the tuned blocks (tests). pieces: x's e4m3 pieces
    (hi, lo, inv_scale: split_pieces_triton of x) for FP8 weights, multiplied on the FP8 MMA
    as fuser::fp8_linear multiplies down_proj's (X2_PIECES) instead of x on the fp16 path."""
    K = x.shape[-1]
    M = x.numel() // max(K, 1)
    N = weight.shape[0]
    if residual.numel() != M * N or residual.shape[-1] != N or residual.dtype != x.dtype:
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} does not match the "
                         f"linear's output [{M}, {N}] {x.dtype}")
    if norm_weight.shape != (N,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm weight {norm_weight.dtype} {tuple(norm_weight.shape)} does not "
                         f"match the linear's output [{M}, {N}] {x.dtype}")
    r2 = residual.reshape(M, N)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    squares = torch.empty((M, triton.cdiv(N, STAT_COLS)), dtype=torch.float32, device=x.device)
    gh = torch.empty((M, N), dtype=x.dtype, device=x.device)
    source, split = (x, None) if pieces is None else (pieces[0], (pieces[1], pieces[2]))
    summed, _ = _launch(source, None, None, 0.0, weight, weight_scale, None,
                        (block_n, block_k, num_warps, num_stages, split_k, None),
                        pieces=split, out_dtype=x.dtype,
                        epilogue=(r2, norm_weight.contiguous(), gh, squares))
    return summed.reshape(residual.shape), gh.reshape(residual.shape), squares


def normed_linear_triton(gh: Tensor, squares: Tensor, eps: float, weight: Tensor, *,
                         weight_scale: Tensor | None = None, activation: str | None = None,
                         block_n: int | None = None, block_k: int | None = None,
                         num_warps: int | None = None, num_stages: int | None = None,
                         split_k: int | None = None) -> Tensor:
    """linear(rms_norm(h, g, eps), weight, ...) for 2..16 rows, given gh = g * h (as
    linear_residual_triton writes it) and h's group sums of squares: the GEMV of gh, its fp32
    sums times each row's rstd = rsqrt(sum(h^2) / K + eps) after the loop. One _linear_kernel
    launch whose K loop is a plain GEMV's."""
    out, _ = _launch(gh, None, None, eps, weight, weight_scale, activation,
                     (block_n, block_k, num_warps, num_stages, split_k, None), stats=squares)
    return out


# ---------------------------------------------------------------------------------------------
# Custom ops: CPU (and any other device) runs the reference, CUDA the kernels above.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::linear_residual", mutates_args=())
def linear_residual(x: Tensor, weight: Tensor, weight_scale: Tensor | None, residual: Tensor,
                    norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(summed, gh, squares): summed = fuser::linear (or fp8_linear) of x, plus residual, rounded
    as fuser::add_rms_norm adds (shaped as residual); gh = norm_weight * summed; squares: the
    rows' group sums of summed^2 (group_squares_reference)."""
    return linear_residual_reference(x, weight, weight_scale, residual, norm_weight)


@linear_residual.register_fake
def _linear_residual_fake(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                          residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    rows = residual.numel() // max(residual.shape[-1], 1)
    groups = triton.cdiv(residual.shape[-1], STAT_COLS)
    like = (residual.shape, residual.dtype, residual.device)
    return (torch.empty(like[0], dtype=like[1], device=like[2]),
            torch.empty(like[0], dtype=like[1], device=like[2]),
            torch.empty((rows, groups), dtype=torch.float32, device=residual.device))


def _producer_takes(x: Tensor, weight: Tensor, weight_scale: Tensor | None, residual: Tensor,
                    norm_weight: Tensor) -> bool:
    """Whether the residual epilogue's kernel computes this (_takes, and a residual and norm
    weight of the linear's output shape and x's dtype)."""
    rows = _row_count(x)
    return (_takes(rows, x, weight, weight_scale) and
            residual.dtype == norm_weight.dtype == x.dtype and
            residual.shape[-1] == weight.shape[0] == norm_weight.shape[0] and
            residual.numel() == rows * weight.shape[0])


def _linear_residual_cuda(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                          residual: Tensor, norm_weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    if _producer_takes(x, weight, weight_scale, residual, norm_weight):
        # down_proj's long FP8 rows: split into e4m3 pieces first, as fuser::fp8_linear does
        pieces = split_pieces_triton(x) if weight_scale is not None and _split_pieces_take(x) \
            else None
        return linear_residual_triton(x, weight, residual, norm_weight,
                                      weight_scale=weight_scale, pieces=pieces)
    return residual_outputs(_linear_op(x, weight, weight_scale, None), residual, norm_weight)


linear_residual.register_kernel("cuda")(_linear_residual_cuda)


def linear_residual_reference(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                              residual: Tensor, norm_weight: Tensor
                              ) -> tuple[Tensor, Tensor, Tensor]:
    """The linear's reference, then add_rms_norm's add (in the input dtype), g * summed and
    the sums of squares."""
    return residual_outputs(linear_any_reference(x, weight, weight_scale, None), residual,
                            norm_weight)


@torch.library.custom_op("fuser::stats_rms_norm_linear", mutates_args=())
def stats_rms_norm_linear(summed: Tensor, gh: Tensor, squares: Tensor, norm_weight: Tensor,
                          eps: float, weight: Tensor, weight_scale: Tensor | None,
                          activation: str | None) -> Tensor:
    """The normed output of the fuser::add_rms_norm_linear it replaces, whose x and residual
    summed to `summed` (on CPU: fuser::rms_norm_linear(summed, ...), the same bits), given also
    gh = norm_weight * summed and summed's group sums of squares (fuser::linear_residual's
    outputs), from which the CUDA kernel computes it at 2..16 rows."""
    return stats_rms_norm_linear_reference(summed, gh, squares, norm_weight, eps, weight,
                                           weight_scale, activation)


@stats_rms_norm_linear.register_fake
def _stats_rms_norm_linear_fake(summed: Tensor, gh: Tensor, squares: Tensor, norm_weight: Tensor,
                                eps: float, weight: Tensor, weight_scale: Tensor | None,
                                activation: str | None) -> Tensor:
    return _norm_linear_fake_out(torch.promote_types(norm_weight.dtype, summed.dtype), summed,
                                 weight, activation)


def _stats_rms_norm_linear_cuda(summed: Tensor, gh: Tensor, squares: Tensor, norm_weight: Tensor,
                                eps: float, weight: Tensor, weight_scale: Tensor | None,
                                activation: str | None) -> Tensor:
    rows = _row_count(summed)
    if _takes(rows, gh, weight, weight_scale) and gh.shape == summed.shape and \
            squares.shape == (rows, triton.cdiv(summed.shape[-1], STAT_COLS)) and \
            squares.is_contiguous() and norm_weight.dtype == summed.dtype == gh.dtype:
        out = normed_linear_triton(gh, squares, eps, weight, weight_scale=weight_scale,
                                   activation=activation)
        return out.reshape(*summed.shape[:-1], out.shape[-1])
    # Outside the kernels' rows the op computes what it replaced, fuser::add_rms_norm_linear:
    # summed plus zeros is summed, and at one row that op's arithmetic is not
    # rms_norm_linear's when gemv_tables.ONE_ROW_NORM_AFTER is on.
    out, _ = torch.ops.fuser.add_rms_norm_linear(summed, torch.zeros_like(summed), norm_weight,
                                                 eps, weight, weight_scale, activation)
    return out


stats_rms_norm_linear.register_kernel("cuda")(_stats_rms_norm_linear_cuda)


def stats_rms_norm_linear_reference(summed: Tensor, gh: Tensor, squares: Tensor,
                                    norm_weight: Tensor, eps: float, weight: Tensor,
                                    weight_scale: Tensor | None, activation: str | None
                                    ) -> Tensor:
    """fuser::rms_norm_linear's reference on summed (gh and squares unread: the same bits as
    the norm op, then the linear)."""
    return rms_norm_linear_reference(summed, norm_weight, eps, weight, weight_scale, activation)
