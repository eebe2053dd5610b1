"""bf16 activations as two e4m3 pieces, for the FP8 MMA at verification rows.

    split_pieces_reference(x) -> (hi, lo, inv_scale)
      x: [M, K] bf16; hi, lo: [M, K] float8_e4m3fn; inv_scale: [M] fp32 (a power of two)
      with x = (hi + lo) * inv_scale exactly for every value within ~2^10 of its row's max |x|

    add_rms_norm_pieces_triton(x, residual, norm_weight, eps) -> (hi, lo, inv_scale, summed)
      the several-row norm kernel (fuser/ops/rmsnorm.py) writing its normalised rows as pieces
      instead of bf16: fuser::add_rms_norm's (or fuser::rms_norm's) value, bit for bit, split

    split_pieces_triton(x) -> (hi, lo, inv_scale)
      split_pieces_reference's split on the GPU, one program a row: for the GEMVs whose input
      no norm makes (o_proj after attention, down_proj after the gated activation)

The split. A row is scaled by 2^t, the power of two that puts its max |x| in [2^7, 2^8)
(below e4m3's 448); hi is x 2^t cut to its top 4 significant bits (the fp32 bits masked: no
rounding, so no carry) and lo = x 2^t - hi holds the (at most) 4 bits left of bf16's 8, below
hi's last place, so |lo| < 2^4. Both are e4m3 values, unless they fall below e4m3's normal range
(2^-6), where its subnormal step 2^-9 rounds them: values more than ~2^9 below the row's max
lose bits, at most 2^-9 2^-t in all (2^-16 of the row's max). An FP8 x FP8 MMA over (hi, lo)
then multiplies the weight by x's exact value: linear.py's X2_PIECES path takes pieces made
here, once per row, by the kernel that made the row (splitting each K step's tile inside the
GEMV instead, or scaling the pieces per block of columns so that a GEMV's epilogue could write
them, measured slower: docs/performance-notes.md).

Cost of the norm kernel with pieces: it writes 2 bytes per value (hi, lo) instead of bf16's 2,
plus 4 bytes a row; the GEMV then reads 2 bytes of x per value, as before.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.rmsnorm import MAX_SINGLE_PASS, _load_block, _normalise, _num_warps, _rows

E4M3 = torch.float8_e4m3fn
TOP_BITS = -1048576  # 0xFFF00000 as int32: sign, exponent and 3 mantissa bits of an fp32


@triton.jit
def _pow2(e):
    """2^e in fp32 for integer e in [-126, 127], built from its exponent bits (exact)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_rounded(v):
    """fp32 v (|v| < 2^8) rounded to the nearest e4m3 value, ties to even, in fp32 arithmetic:
    4 significant bits, or the subnormals' step 2^-9 below 2^-6. What cvt.rn...e4m3 gives on the
    GPU; used where the Triton interpreter's own fp32 -> e4m3 cast runs (it mishandles a carry:
    31.375 -> 16)."""
    bits = v.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF                                        # |v| in [2^(e-127), ..)
    step = _pow2(tl.maximum(exponent - 127, -6) - 3)                      # e4m3's spacing there
    magic = 12582912.0                                                    # 1.5 * 2^23: RNE
    size = ((tl.abs(v) / step + magic) - magic) * step
    return tl.where(bits < 0, -size, size)                                # -0 stays -0, as cvt


@triton.jit
def _scale_exponent(amax):
    """t with amax 2^t < 2^8 (and >= 2^7 for a normal amax), clamped to [-126, 126]."""
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF       # amax < 2^(exponent - 126)
    return tl.minimum(tl.maximum(134 - exponent, -126), 126)


@triton.jit
def _split(scaled):
    """(hi, lo) in fp32 of x 2^t (|.| < 2^8): the top 4 significant bits, and the rest."""
    top = (scaled.to(tl.int32, bitcast=True) & -1048576).to(tl.float32, bitcast=True)  # TOP_BITS
    return top, scaled - top


@triton.jit
def _store_pieces(hi_ptr, lo_ptr, offsets, scaled, mask, EMULATE_CAST: tl.constexpr):
    """Store the pieces of scaled = x 2^t (fp32, |.| < 2^8) at offsets of hi_ptr and lo_ptr
    (EMULATE_CAST: rounded to e4m3 in fp32 first, for the interpreter's cast)."""
    hi, lo = _split(scaled)
    if EMULATE_CAST:
        hi = _e4m3_rounded(hi)
        lo = _e4m3_rounded(lo)
    tl.store(hi_ptr + offsets, hi.to(hi_ptr.dtype.element_ty), mask=mask)
    tl.store(lo_ptr + offsets, lo.to(lo_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_pieces_kernel(
    x_ptr, residual_ptr,   # [rows, N], row strides x_row_stride, residual_row_stride
    weight_ptr,            # the norm's weight [N], x's dtype
    hi_ptr, lo_ptr,        # [rows, N] e4m3fn, contiguous
    inv_ptr,               # [rows] fp32: 2^-t
    summed_ptr,            # [rows, N] x's dtype (HAS_RESIDUAL)
    x_row_stride, residual_row_stride, N, eps,
    BLOCK: tl.constexpr,   # power of two >= N (one pass: the whole row in registers)
    HAS_RESIDUAL: tl.constexpr,
    EMULATE_CAST: tl.constexpr,  # round to e4m3 in fp32 first (the interpreter's cast is wrong)
):
    """One program per row: the norm as fuser/ops/rmsnorm.py's kernel computes it (the same
    helpers, the same bits), rounded to x's dtype, then split into pieces."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    summed_row = summed_ptr + row * N
    h = _load_block(x_ptr + row * x_row_stride, residual_ptr + row * residual_row_stride,
                    summed_row, cols, mask, HAS_RESIDUAL, True)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    in_dtype = summed_ptr.dtype.element_ty if HAS_RESIDUAL else x_ptr.dtype.element_ty
    y = _normalise(h, rstd, w, in_dtype).to(in_dtype).to(tl.float32)
    t = _scale_exponent(tl.max(tl.abs(y), axis=0))
    _store_pieces(hi_ptr, lo_ptr, row * N + cols, y * _pow2(t), mask, EMULATE_CAST)
    tl.store(inv_ptr + row, _pow2(-t))


@triton.jit
def _split_pieces_kernel(
    x_ptr,                 # [rows, N] bf16, row stride x_row_stride
    hi_ptr, lo_ptr,        # [rows, N] e4m3fn, contiguous
    inv_ptr,               # [rows] fp32: 2^-t
    x_row_stride, N,
    BLOCK: tl.constexpr,   # columns a step (the row in one step when N <= BLOCK)
    EMULATE_CAST: tl.constexpr,
):
    """One program per row: the row's max |x| (a first walk), then its pieces (a second walk;
    from L1/L2 when the row fits, as it does at the 8B shapes' 4096 and 14336 columns)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, N, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < N, other=0.0)
                                       .to(tl.float32)))
    t = _scale_exponent(tl.max(amax, axis=0))
    for k0 in range(0, N, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        _store_pieces(hi_ptr, lo_ptr, row * N + cols, x * _pow2(t), mask, EMULATE_CAST)
    tl.store(inv_ptr + row, _pow2(-t))


SPLIT_BLOCK = 4096  # columns a step of _split_pieces_kernel: 16 warps, 8 values a thread


def split_pieces_triton(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(hi, lo, inv_scale) of bf16 x [..., N]: split_pieces_reference's values, bit for bit
    (hi, lo [rows, N] e4m3fn, inv_scale [rows] fp32)."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"e4m3 pieces take bf16 rows (8 significant bits), got {x.dtype}")
    n = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    x2 = _rows(x, n) if n else x.reshape(rows, 0)
    hi = torch.empty((rows, n), dtype=E4M3, device=x.device)
    lo = torch.empty_like(hi)
    inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows and n:
        block = min(SPLIT_BLOCK, triton.next_power_of_2(n))
        _split_pieces_kernel[(rows,)](x2, hi, lo, inv, x2.stride(0), n, BLOCK=block,
                               EMULATE_CAST=x.device.type != "cuda",
                               num_warps=_num_warps(block))
    elif rows:
        inv.fill_(2.0**-126)  # an empty row's max is 0: the reference's clamp
    return hi, lo, inv


def pieces_supported(x: Tensor, norm_weight: Tensor, residual: Tensor | None) -> bool:
    """Whether add_rms_norm_pieces_triton takes these: bf16 throughout (bf16's 8 significant
    bits fit two pieces of 4), a row that fits one pass."""
    dtypes = {x.dtype, norm_weight.dtype} | ({residual.dtype} if residual is not None else set())
    return dtypes == {torch.bfloat16} and x.shape[-1] <= MAX_SINGLE_PASS


def add_rms_norm_pieces_triton(x: Tensor, residual: Tensor | None, norm_weight: Tensor,
                               eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """(hi, lo, inv_scale, summed): fuser::add_rms_norm(x, residual, norm_weight, eps)'s
    normalised rows (fuser::rms_norm's without a residual) as pieces (module docstring), and
    x + residual (None without one). x [..., N] -> hi, lo [rows, N], inv_scale [rows]."""
    if not pieces_supported(x, norm_weight, residual):
        raise ValueError(f"e4m3 pieces take bf16 rows of at most {MAX_SINGLE_PASS} values, got "
                         f"{x.dtype} x {tuple(x.shape)}, norm weight {norm_weight.dtype}")
    n = x.shape[-1]
    x2 = _rows(x, n)
    r2 = _rows(residual, n) if residual is not None else x2
    rows = x2.shape[0]
    hi = torch.empty((rows, n), dtype=E4M3, device=x.device)
    lo = torch.empty_like(hi)
    inv = torch.empty(rows, dtype=torch.float32, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None \
        else None
    if rows and n:
        block = triton.next_power_of_2(n)
        _norm_pieces_kernel[(rows,)](
            x2, r2, norm_weight.contiguous(), hi, lo, inv, summed if summed is not None else x2,
            x2.stride(0), r2.stride(0), n, eps, BLOCK=block,
            HAS_RESIDUAL=residual is not None, EMULATE_CAST=x.device.type != "cuda",
            num_warps=_num_warps(block))
    return hi, lo, inv, summed


def split_pieces_reference(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The split of x [M, K] (bf16) in plain PyTorch: (hi, lo, inv_scale), as the kernels
    split it (module docstring)."""
    x32 = x.float()
    exponent = (x32.abs().amax(dim=-1).view(torch.int32) >> 23) & 0xFF
    t = torch.clamp(134 - exponent, -126, 126).to(torch.float32)
    scaled = x32 * torch.exp2(t)[..., None]
    top = (scaled.view(torch.int32) & TOP_BITS).view(torch.float32)
    return top.to(E4M3), (scaled - top).to(E4M3), torch.exp2(-t)


def join_pieces(hi: Tensor, lo: Tensor, inv_scale: Tensor) -> Tensor:
    """(hi + lo) * inv_scale in float64: the values an MMA over the pieces multiplies."""
    return (hi.double() + lo.double()) * inv_scale.double()[..., None]
