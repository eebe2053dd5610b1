"""The several-row norm without a norm kernel: the GEMV before it adds the residual, multiplies
by the norm weight and sums the squares; the GEMV after it scales its sums by rstd.

At 2..16 rows (the verification step, the draft's catch-up) a layer's two residual-add +
RMSNorms each ran as their own kernel between two GEMVs (fuser::add_rms_norm_linear at several
rows: the norm kernel, then the GEMV; the norm inside every GEMV program measured slower, see
linear.NORM_PROLOGUE_MAX_ROWS). Here the norm's work moves into the two GEMVs around it:

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
x's tiles go to the MMA as loaded. (A first version normalised each x tile in the K loop, as the
norm prologue does: on the H200 the 8B verify step got slower, not faster, and the FP8 one 2.8x
the decode step: benchmarks/RESULTS.md, eighteenth session.)

FP8 on both sides (linear.STATS_FP8_MMA = "block", passes/norm_stats.py): gh travels as e4m3
pieces with a power of two per row and producer tile (fuser::linear_residual_pieces ->
fuser::stats_pieces_rms_norm_linear), which the consumer multiplies on the FP8 MMA; gate/up
hands its output to down_proj the same way, and attention's combine its output to o_proj (one
head a scale). At several rows a layer then runs decode's kernels only. Measured on the H200
(RESULTS.md, twenty-fourth session): the 8B FP8 verify step 1.417x the decode step against 1.293x
on the norm kernel's pieces; the pieces kernels go, but the GEMVs grow, down_proj most (its
64-column K steps: 32.3 against 18.8 us). Off by default.

Numerics: summed is what add_rms_norm writes (the linear's output rounded to its dtype, plus r,
rounded once). The norm's output feeding the GEMV is g * h * rstd with one rounding (g * h, to
the dtype) where fuser::rms_norm rounds twice ((h * rstd) to the dtype, then times g): like
linear.NORM_RSTD_LAST at one row, closer to the exact norm than the unfused kernels (tested).
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

from fuser.ops.e4m3_pieces import split_pieces_blocks_reference, split_pieces_triton
from fuser.ops.fp8 import FP8_DTYPE
from fuser.ops.linear import (
    GEMV_DTYPES,
    MAX_ROWS,
    STAT_COLS,
    _launch,
    _linear_op,
    _norm_linear_fake_out,
    _row_count,
    _split_pieces_take,
    linear_any_reference,
    rms_norm_linear_reference,
)

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
    summed, gh, squares = _residual_launch(
        x, weight, residual, norm_weight, weight_scale, pieces, None,
        (block_n, block_k, num_warps, num_stages, split_k, None))
    return summed, gh.reshape(residual.shape), squares


def _residual_launch(x: Tensor, weight: Tensor, residual: Tensor, norm_weight: Tensor,
                     weight_scale: Tensor | None, pieces: tuple[Tensor, Tensor, Tensor] | None,
                     pieces_block: int | None, overrides: tuple):
    """The residual epilogue's launch for linear_residual_triton (g * summed as gh [M, N] in x's
    dtype) and linear_residual_pieces_triton (pieces_block: as (hi, lo, inv) block pieces):
    (summed shaped as residual, gh or the pieces, squares)."""
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
    if pieces_block is None:
        written = torch.empty((M, N), dtype=x.dtype, device=x.device)
        gx, pieces_out = written, None
    else:
        hi = torch.empty((M, N), dtype=FP8_DTYPE, device=x.device)
        pieces_out = written = (hi, torch.empty_like(hi), torch.empty(
            (M, triton.cdiv(N, pieces_block)), dtype=torch.float32, device=x.device))
        gx = hi
    source, split = (x, None) if pieces is None else (pieces[0], (pieces[1], pieces[2]))
    summed, _ = _launch(source, None, None, 0.0, weight, weight_scale, None, overrides,
                        pieces=split, out_dtype=x.dtype,
                        epilogue=(r2, norm_weight.contiguous(), gx, squares),
                        pieces_out=pieces_out)
    return summed.reshape(residual.shape), written, squares


def linear_residual_pieces_triton(x: Tensor, weight: Tensor, residual: Tensor,
                                  norm_weight: Tensor, block: int, *, weight_scale: Tensor,
                                  pieces: tuple[Tensor, Tensor, Tensor] | None = None,
                                  block_k: int | None = None, split_k: int | None = None,
                                  ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor], Tensor]:
    """linear_residual_triton with g * summed written as block-scaled e4m3 pieces instead of
    bf16: (summed, (hi, lo, inv), squares), hi and lo [M, N] e4m3fn, inv [M, cdiv(N, block)]
    fp32 (split_pieces_blocks_reference(g * summed, block), bit for bit). The GEMV's program
    makes block = its block_n columns, so it knows each block's max. For an FP8 GEMV after the
    norm (normed_pieces_linear_triton): no norm kernel, no split kernel between them."""
    return _residual_launch(x, weight, residual, norm_weight, weight_scale, pieces, block,
                            (block, block_k, None, None, split_k, None))


def normed_pieces_linear_triton(hi: Tensor, lo: Tensor, inv: Tensor, squares: Tensor, eps: float,
                                weight: Tensor, weight_scale: Tensor, block: int, *,
                                activation: str | None = None, out_dtype: torch.dtype =
                                torch.bfloat16, split_k: int | None = None) -> Tensor:
    """normed_linear_triton over g * h given as block-scaled pieces (linear_residual_pieces_
    triton's): the FP8 MMA over the pieces, each K step (= block columns) scaled by its power
    of two, the row's rstd (from h's sums of squares) and the weight's scale after the sum."""
    out, _ = _launch(hi, None, None, eps, weight, weight_scale, activation,
                     (None, block, None, None, split_k, None), pieces=(lo, inv),
                     out_dtype=out_dtype, stats=squares)
    return out


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
    # rms_norm_linear's when linear.ONE_ROW_NORM_AFTER is on.
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


# ---------------------------------------------------------------------------------------------
# The FP8 consumers' form (linear.STATS_FP8_MMA = "block"): g * summed travels as block-scaled
# e4m3 pieces from the producer's epilogue to the consumer's FP8 MMA.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::linear_residual_pieces", mutates_args=())
def linear_residual_pieces(x: Tensor, weight: Tensor, weight_scale: Tensor, residual: Tensor,
                           norm_weight: Tensor, block: int
                           ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(summed, hi, lo, inv, squares): fuser::linear_residual's summed and squares, with
    gh = norm_weight * summed given as split_pieces_blocks_reference(gh [rows, N], block)."""
    return linear_residual_pieces_reference(x, weight, weight_scale, residual, norm_weight, block)


def linear_residual_pieces_reference(x: Tensor, weight: Tensor, weight_scale: Tensor,
                                     residual: Tensor, norm_weight: Tensor, block: int
                                     ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    summed, gh, squares = linear_residual_reference(x, weight, weight_scale, residual,
                                                    norm_weight)
    hi, lo, inv = split_pieces_blocks_reference(gh.reshape(-1, gh.shape[-1]), block)
    return summed, hi, lo, inv, squares


@linear_residual_pieces.register_fake
def _linear_residual_pieces_fake(x: Tensor, weight: Tensor, weight_scale: Tensor,
                                 residual: Tensor, norm_weight: Tensor, block: int
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    N = residual.shape[-1]
    rows = residual.numel() // max(N, 1)
    pieces = torch.empty((rows, N), dtype=FP8_DTYPE, device=residual.device)
    return (torch.empty_like(residual), pieces, torch.empty_like(pieces),
            torch.empty((rows, triton.cdiv(N, block)), dtype=torch.float32,
                        device=residual.device),
            torch.empty((rows, triton.cdiv(N, STAT_COLS)), dtype=torch.float32,
                        device=residual.device))


def _linear_residual_pieces_cuda(x: Tensor, weight: Tensor, weight_scale: Tensor,
                                 residual: Tensor, norm_weight: Tensor, block: int
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    if _producer_takes(x, weight, weight_scale, residual, norm_weight) and \
            weight_scale is not None and x.dtype == torch.bfloat16:
        pieces = split_pieces_triton(x) if _split_pieces_take(x) else None
        summed, (hi, lo, inv), squares = linear_residual_pieces_triton(
            x, weight, residual, norm_weight, block, weight_scale=weight_scale, pieces=pieces)
        return summed, hi, lo, inv, squares
    summed, gh, squares = torch.ops.fuser.linear_residual(x, weight, weight_scale, residual,
                                                          norm_weight)
    hi, lo, inv = split_pieces_blocks_reference(gh.reshape(-1, gh.shape[-1]), block)
    return summed, hi, lo, inv, squares


linear_residual_pieces.register_kernel("cuda")(_linear_residual_pieces_cuda)


@torch.library.custom_op("fuser::stats_pieces_rms_norm_linear", mutates_args=())
def stats_pieces_rms_norm_linear(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor,
                                 squares: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                                 weight_scale: Tensor, activation: str | None, block: int
                                 ) -> Tensor:
    """fuser::stats_rms_norm_linear with gh given as fuser::linear_residual_pieces' pieces: the
    normed output of the add_rms_norm_linear it replaces (on CPU: rms_norm_linear's reference on
    summed, as the stats op); the CUDA kernel computes it from the pieces at 2..16 rows."""
    return rms_norm_linear_reference(summed, norm_weight, eps, weight, weight_scale, activation)


@stats_pieces_rms_norm_linear.register_fake
def _stats_pieces_fake(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor, squares: Tensor,
                       norm_weight: Tensor, eps: float, weight: Tensor, weight_scale: Tensor,
                       activation: str | None, block: int) -> Tensor:
    return _norm_linear_fake_out(torch.promote_types(norm_weight.dtype, summed.dtype), summed,
                                 weight, activation)


def _pieces_consumer_takes(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor, squares: Tensor,
                           norm_weight: Tensor, weight: Tensor, weight_scale: Tensor | None,
                           block: int) -> bool:
    """Whether the pieces consumer's kernel computes this: 2..MAX_ROWS bf16 rows, FP8 weights,
    pieces and squares of summed's shape."""
    rows = _row_count(summed)
    K = summed.shape[-1]
    return (1 < rows <= MAX_ROWS and weight_scale is not None and weight.dtype == FP8_DTYPE and
            hi.shape == lo.shape == (rows, K) and inv.shape == (rows, triton.cdiv(K, block))
            and squares.shape == (rows, triton.cdiv(K, STAT_COLS)) and
            summed.dtype == norm_weight.dtype == torch.bfloat16)


def _stats_pieces_cuda(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor, squares: Tensor,
                       norm_weight: Tensor, eps: float, weight: Tensor, weight_scale: Tensor,
                       activation: str | None, block: int) -> Tensor:
    if _pieces_consumer_takes(summed, hi, lo, inv, squares, norm_weight, weight, weight_scale,
                              block):
        out = normed_pieces_linear_triton(hi, lo, inv, squares, eps, weight, weight_scale, block,
                                          activation=activation, out_dtype=summed.dtype)
        return out.reshape(*summed.shape[:-1], out.shape[-1])
    out, _ = torch.ops.fuser.add_rms_norm_linear(summed, torch.zeros_like(summed), norm_weight,
                                                 eps, weight, weight_scale, activation)
    return out


stats_pieces_rms_norm_linear.register_kernel("cuda")(_stats_pieces_cuda)


# The gated GEMV after the norm (gate/up) can write its output as block pieces too, for the
# GEMV after it (down_proj, itself a residual producer): no split kernel between them.


def normed_pieces_gated_pieces_triton(hi: Tensor, lo: Tensor, inv: Tensor, squares: Tensor,
                                      eps: float, weight: Tensor, weight_scale: Tensor,
                                      block: int, out_block: int, activation: str, *,
                                      split_k: int | None = None
                                      ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
    """normed_pieces_linear_triton with an activation, whose output y [M, I] (bf16) also comes
    as block-scaled pieces, out_block columns a scale (its programs' tiles: block_n =
    2 out_block): (y, (hi, lo, inv)), the pieces split_pieces_blocks_reference(y, out_block)."""
    M, K = hi.shape
    I = weight.shape[0] // 2
    out_hi = torch.empty((M, I), dtype=FP8_DTYPE, device=hi.device)
    out_lo = torch.empty_like(out_hi)
    out_inv = torch.empty((M, triton.cdiv(I, out_block)), dtype=torch.float32, device=hi.device)
    y, _ = _launch(hi, None, None, eps, weight, weight_scale, activation,
                   (2 * out_block, block, None, None, split_k, None), pieces=(lo, inv),
                   out_dtype=torch.bfloat16, stats=squares, pieces_out=(out_hi, out_lo, out_inv))
    return y, (out_hi, out_lo, out_inv)


@torch.library.custom_op("fuser::stats_pieces_gated_pieces", mutates_args=())
def stats_pieces_gated_pieces(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor,
                              squares: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                              weight_scale: Tensor, activation: str, block: int, out_block: int
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, y's block pieces): fuser::stats_pieces_rms_norm_linear's gated output y, and
    split_pieces_blocks_reference(y [rows, I], out_block) for the GEMV after it."""
    y = rms_norm_linear_reference(summed, norm_weight, eps, weight, weight_scale, activation)
    return (y, *split_pieces_blocks_reference(y.reshape(-1, y.shape[-1]), out_block))


@stats_pieces_gated_pieces.register_fake
def _stats_pieces_gated_pieces_fake(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor,
                                    squares: Tensor, norm_weight: Tensor, eps: float,
                                    weight: Tensor, weight_scale: Tensor, activation: str,
                                    block: int, out_block: int
                                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    y = _norm_linear_fake_out(torch.promote_types(norm_weight.dtype, summed.dtype), summed,
                              weight, activation)
    I = y.shape[-1]
    rows = y.numel() // max(I, 1)
    pieces = torch.empty((rows, I), dtype=FP8_DTYPE, device=y.device)
    return y, pieces, torch.empty_like(pieces), torch.empty(
        (rows, triton.cdiv(I, out_block)), dtype=torch.float32, device=y.device)


def _stats_pieces_gated_pieces_cuda(summed: Tensor, hi: Tensor, lo: Tensor, inv: Tensor,
                                    squares: Tensor, norm_weight: Tensor, eps: float,
                                    weight: Tensor, weight_scale: Tensor, activation: str,
                                    block: int, out_block: int
                                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if _pieces_consumer_takes(summed, hi, lo, inv, squares, norm_weight, weight, weight_scale,
                              block):
        y, pieces = normed_pieces_gated_pieces_triton(hi, lo, inv, squares, eps, weight,
                                                      weight_scale, block, out_block, activation)
        return (y.reshape(*summed.shape[:-1], y.shape[-1]), *pieces)
    y = torch.ops.fuser.stats_pieces_rms_norm_linear(summed, hi, lo, inv, squares, norm_weight,
                                                     eps, weight, weight_scale, activation, block)
    return (y, *split_pieces_blocks_reference(y.reshape(-1, y.shape[-1]), out_block))


stats_pieces_gated_pieces.register_kernel("cuda")(_stats_pieces_gated_pieces_cuda)


@torch.library.custom_op("fuser::pieces_linear_residual_pieces", mutates_args=())
def pieces_linear_residual_pieces(x: Tensor, hi: Tensor, lo: Tensor, inv: Tensor, in_block: int,
                                  weight: Tensor, weight_scale: Tensor, residual: Tensor,
                                  norm_weight: Tensor, block: int
                                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """fuser::linear_residual_pieces of x given also as its block pieces (hi, lo, inv, in_block
    columns a scale: fuser::stats_pieces_gated_pieces'), which the CUDA kernel multiplies; on
    CPU the reference on x (the same bits as without the pieces)."""
    return linear_residual_pieces_reference(x, weight, weight_scale, residual, norm_weight, block)


@pieces_linear_residual_pieces.register_fake
def _pieces_linear_residual_pieces_fake(x: Tensor, hi: Tensor, lo: Tensor, inv: Tensor,
                                        in_block: int, weight: Tensor, weight_scale: Tensor,
                                        residual: Tensor, norm_weight: Tensor, block: int
                                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _linear_residual_pieces_fake(x, weight, weight_scale, residual, norm_weight, block)


def _pieces_linear_residual_pieces_cuda(x: Tensor, hi: Tensor, lo: Tensor, inv: Tensor,
                                        in_block: int, weight: Tensor, weight_scale: Tensor,
                                        residual: Tensor, norm_weight: Tensor, block: int
                                        ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, K = _row_count(x), x.shape[-1]
    if _producer_takes(x, weight, weight_scale, residual, norm_weight) and \
            weight_scale is not None and x.dtype == torch.bfloat16 and \
            hi.shape == lo.shape == (rows, K) and inv.shape == (rows, triton.cdiv(K, in_block)):
        summed, (o_hi, o_lo, o_inv), squares = linear_residual_pieces_triton(
            x, weight, residual, norm_weight, block, weight_scale=weight_scale,
            pieces=(hi, lo, inv), block_k=in_block)
        return summed, o_hi, o_lo, o_inv, squares
    return torch.ops.fuser.linear_residual_pieces(x, weight, weight_scale, residual, norm_weight,
                                                  block)


pieces_linear_residual_pieces.register_kernel("cuda")(_pieces_linear_residual_pieces_cuda)
