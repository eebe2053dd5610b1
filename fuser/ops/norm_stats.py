"""The several-row norm without a norm kernel: the GEMV before it adds the residual and sums the
squares, the GEMV after it takes rstd from those sums.

At 2..16 rows (the verification step, the draft's catch-up) a layer's two residual-add +
RMSNorms each ran as their own kernel between two GEMVs (fuser::add_rms_norm_linear at several
rows: the norm kernel, then the GEMV; the norm inside every GEMV program measured slower, see
linear.NORM_PROLOGUE_MAX_ROWS). Here the norm's work moves into the two GEMVs around it:

    y = linear(a, W_o)                                  o_proj (or down_proj): a GEMV
    out, summed = add_rms_norm_linear(y, r, g, eps, W)  norm kernel + GEMV
  becomes
    summed, squares = linear_residual(a, W_o, s_o, r)   the GEMV; its epilogue adds r and sums
                                                        summed^2 per 16 columns of each row
    out = stats_rms_norm_linear(summed, squares, g, eps, W, s, act)
                                                        the GEMV; rstd from the sums, x's tiles
                                                        normalised as they stream

one kernel per norm fewer (passes/norm_stats.py). summed is what add_rms_norm writes: the
linear's output rounded to its dtype, plus r, rounded once. rstd = rsqrt(sum / K + eps) in fp32
from the group sums added in one fixed order (deterministic; an ulp from the norm kernel's own
order at most), and the normalised tile is rmsnorm.py's g * (h * rstd).to(dtype).

On CPU both ops run their references: linear then add, and the norm from summed itself (the
squares are not read), so a CPU graph computes the same bits with or without the pass.

Cost: linear_residual reads the residual tile and writes summed (the linear's output bytes) and
M * N / 16 fp32 sums; stats_rms_norm_linear reads M * K / 16 fp32 sums per program (L2) and the
norm weight's tiles; the norm kernel's read of x and r and write of normed and summed are gone.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from fuser.ops.fp8 import FP8_DTYPE
from fuser.ops.linear import (
    GEMV_DTYPES,
    MAX_ROWS,
    STAT_COLS,
    _launch,
    _linear_op,
    _norm_linear_fake_out,
    _row_count,
    linear_any_reference,
    rms_norm_linear_reference,
)

__all__ = [
    "group_squares_reference",
    "linear_residual_reference",
    "linear_residual_triton",
    "stats_rms_norm_linear_reference",
    "stats_rms_norm_linear_triton",
]


def group_squares_reference(summed: Tensor) -> Tensor:
    """summed [..., N] -> [rows, cdiv(N, STAT_COLS)] fp32: each row's sums of summed^2 over
    consecutive groups of STAT_COLS columns (the last group padded with zeros)."""
    h = summed.reshape(-1, summed.shape[-1]).float()
    pad = -h.shape[-1] % STAT_COLS
    h = torch.nn.functional.pad(h, (0, pad))
    return h.square().reshape(h.shape[0], -1, STAT_COLS).sum(-1)


def _takes(rows: int, x: Tensor, weight: Tensor, weight_scale: Tensor | None) -> bool:
    """Whether the kernels compute this: CUDA, 2..MAX_ROWS rows, x in a GEMV dtype, the weight
    in x's dtype (or e4m3fn with a scale), nothing empty."""
    return (x.device.type == "cuda" and 1 < rows <= MAX_ROWS and x.dtype in GEMV_DTYPES
            and x.shape[-1] > 0 and weight.shape[0] > 0
            and (weight.dtype == x.dtype if weight_scale is None else weight.dtype == FP8_DTYPE))


def linear_residual_triton(x: Tensor, weight: Tensor, residual: Tensor, *,
                           weight_scale: Tensor | None = None, block_n: int | None = None,
                           block_k: int | None = None, num_warps: int | None = None,
                           num_stages: int | None = None, split_k: int | None = None
                           ) -> tuple[Tensor, Tensor]:
    """(summed, squares) for 2..16 rows of x [..., K], weight [N, K] (e4m3fn with weight_scale),
    residual [..., N] in x's dtype: summed = linear(x, weight) + residual as
    fuser::add_rms_norm adds them, shaped as residual; squares [M, cdiv(N, STAT_COLS)] fp32
    (group_squares_reference of summed, in the kernel's order). One _linear_kernel launch; the
    keyword arguments override the tuned blocks (tests)."""
    return _launch(x, None, None, 0.0, weight, weight_scale, None,
                   (block_n, block_k, num_warps, num_stages, split_k, None),
                   epi_residual=residual)


def stats_rms_norm_linear_triton(summed: Tensor, squares: Tensor, norm_weight: Tensor, eps: float,
                                 weight: Tensor, *, weight_scale: Tensor | None = None,
                                 activation: str | None = None, block_n: int | None = None,
                                 block_k: int | None = None, num_warps: int | None = None,
                                 num_stages: int | None = None, split_k: int | None = None
                                 ) -> Tensor:
    """linear(rms_norm(summed, norm_weight, eps), weight, ...) for 2..16 rows, the norm's rstd
    from `squares` (summed's group sums of squares, as linear_residual_triton writes them), in
    one _linear_kernel launch with no pass over summed before the K loop."""
    if norm_weight.shape != (summed.shape[-1],) or norm_weight.dtype != summed.dtype:
        raise ValueError(f"norm weight {norm_weight.dtype} {tuple(norm_weight.shape)} does not "
                         f"match summed {summed.dtype} [..., {summed.shape[-1]}]")
    out, _ = _launch(summed, None, norm_weight, eps, weight, weight_scale, activation,
                     (block_n, block_k, num_warps, num_stages, split_k, None), stats=squares)
    return out


# ---------------------------------------------------------------------------------------------
# Custom ops: CPU (and any other device) runs the reference, CUDA the kernels above.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::linear_residual", mutates_args=())
def linear_residual(x: Tensor, weight: Tensor, weight_scale: Tensor | None, residual: Tensor
                    ) -> tuple[Tensor, Tensor]:
    """(summed, squares): summed = fuser::linear (or fp8_linear) of x, plus residual, rounded as
    fuser::add_rms_norm adds (shaped as residual); squares: its rows' group sums of squares."""
    return linear_residual_reference(x, weight, weight_scale, residual)


@linear_residual.register_fake
def _linear_residual_fake(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                          residual: Tensor) -> tuple[Tensor, Tensor]:
    rows = residual.numel() // max(residual.shape[-1], 1)
    groups = triton.cdiv(residual.shape[-1], STAT_COLS)
    return (torch.empty(residual.shape, dtype=residual.dtype, device=residual.device),
            torch.empty((rows, groups), dtype=torch.float32, device=residual.device))


def _linear_residual_cuda(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                          residual: Tensor) -> tuple[Tensor, Tensor]:
    if _takes(_row_count(x), x, weight, weight_scale) and residual.dtype == x.dtype and \
            residual.shape[-1] == weight.shape[0] and residual.numel() == \
            _row_count(x) * weight.shape[0]:
        return linear_residual_triton(x, weight, residual, weight_scale=weight_scale)
    summed = (_linear_op(x, weight, weight_scale, None).reshape(residual.shape)
              + residual).contiguous()
    return summed, group_squares_reference(summed)


linear_residual.register_kernel("cuda")(_linear_residual_cuda)


def linear_residual_reference(x: Tensor, weight: Tensor, weight_scale: Tensor | None,
                              residual: Tensor) -> tuple[Tensor, Tensor]:
    """The linear's reference, then add_rms_norm's add (in the input dtype), then the sums."""
    y = linear_any_reference(x, weight, weight_scale, None)
    summed = (y.reshape(residual.shape) + residual).contiguous()
    return summed, group_squares_reference(summed)


@torch.library.custom_op("fuser::stats_rms_norm_linear", mutates_args=())
def stats_rms_norm_linear(summed: Tensor, squares: Tensor, norm_weight: Tensor, eps: float,
                          weight: Tensor, weight_scale: Tensor | None, activation: str | None
                          ) -> Tensor:
    """fuser::rms_norm_linear(summed, norm_weight, eps, weight, weight_scale, activation), where
    squares are summed's group sums of squares (fuser::linear_residual's second output)."""
    return stats_rms_norm_linear_reference(summed, squares, norm_weight, eps, weight,
                                           weight_scale, activation)


@stats_rms_norm_linear.register_fake
def _stats_rms_norm_linear_fake(summed: Tensor, squares: Tensor, norm_weight: Tensor, eps: float,
                                weight: Tensor, weight_scale: Tensor | None,
                                activation: str | None) -> Tensor:
    return _norm_linear_fake_out(torch.promote_types(norm_weight.dtype, summed.dtype), summed,
                                 weight, activation)


def _stats_rms_norm_linear_cuda(summed: Tensor, squares: Tensor, norm_weight: Tensor, eps: float,
                                weight: Tensor, weight_scale: Tensor | None,
                                activation: str | None) -> Tensor:
    rows = _row_count(summed)
    if _takes(rows, summed, weight, weight_scale) and norm_weight.dtype == summed.dtype and \
            squares.shape == (rows, triton.cdiv(summed.shape[-1], STAT_COLS)):
        out = stats_rms_norm_linear_triton(summed, squares, norm_weight, eps, weight,
                                           weight_scale=weight_scale, activation=activation)
        return out.reshape(*summed.shape[:-1], out.shape[-1])
    return torch.ops.fuser.rms_norm_linear(summed, norm_weight, eps, weight, weight_scale,
                                           activation)


stats_rms_norm_linear.register_kernel("cuda")(_stats_rms_norm_linear_cuda)


def stats_rms_norm_linear_reference(summed: Tensor, squares: Tensor, norm_weight: Tensor,
                                    eps: float, weight: Tensor, weight_scale: Tensor | None,
                                    activation: str | None) -> Tensor:
    """fuser::rms_norm_linear's reference on summed (squares unread: the same bits as the norm
    op, then the linear, computed from summed itself)."""
    return rms_norm_linear_reference(summed, norm_weight, eps, weight, weight_scale, activation)
