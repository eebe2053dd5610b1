"""The decode GEMV's K step at 2..16 rows (verification, catch-up) on the MMA, and its
several-row epilogues: the residual add with the next norm's sums of squares (norm_stats'
producer), the rstd from those sums (its consumer), the scale's rounded product.

Pieces of fuser/ops/linear.py's _linear_kernel (Triton functions, inlined where they are
called). The weight tile is the MMA's A operand where _default_swap says so (_mma_swapped), and
several bf16 rows against FP8 weights run the fp16 MMA (_f16_step) or, given as e4m3 pieces, the
FP8 MMA (_pieces_dot).
"""

import triton
import triton.language as tl

from fuser.ops.e4m3_pieces import _pow2
from fuser.ops.gemv_row import _k_ok, _norm_x_tile


@triton.jit
def _rows_x(x_rows, r_rows, g_ptr, k, k_hi, row_ok, rstd, NORM: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, EVEN_K: tl.constexpr = False):
    """The several-row GEMV's input tile [BLOCK_M, BLOCK_K] at columns k (_norm_x_tile)."""
    k_ok = _k_ok(k, k_hi, EVEN_K)
    return _norm_x_tile(x_rows, r_rows, g_ptr, k[None, :], row_ok[:, None] & k_ok[None, :],
                        k_ok[None, :], rstd, NORM, HAS_RESIDUAL)


@triton.jit
def _rows_step(acc, w, x_rows, r_rows, g_ptr, k, k_hi, row_ok, rstd, FP32_DOTS: tl.constexpr,
               HAS_SCALE: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
               SWAP: tl.constexpr = False, EVEN_K: tl.constexpr = False):
    """One K step of the several-row GEMV on the MMA: acc [BLOCK_M, BLOCK_N] + x[:, k] . w.T
    (SWAP: acc [BLOCK_N, BLOCK_M] + w . x[:, k].T)."""
    x = _rows_x(x_rows, r_rows, g_ptr, k, k_hi, row_ok, rstd, NORM, HAS_RESIDUAL, EVEN_K)
    if SWAP:
        acc = _mma_swapped(acc, x, w, FP32_DOTS, HAS_SCALE)
    else:
        acc = _mma(acc, x, w, FP32_DOTS, HAS_SCALE)
    return acc


@triton.jit
def _mma_swapped(acc, x, w, FP32_DOTS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + w [BLOCK_N, BLOCK_K] . x [BLOCK_M, BLOCK_K].T: the weight tile
    is the MMA's A operand (BLOCK_N, 64 or more, its M dimension; the few rows of x its N), so
    on sm_90 a bf16 tile goes from shared memory to the wgmma as it was loaded, and an FP8 tile
    is widened in registers, where the wgmma's A operand may also come from. The same products
    and fp32 sums as _mma, in another order."""
    if FP32_DOTS:
        acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    elif HAS_SCALE:
        acc = tl.dot(w.to(x.dtype), tl.trans(x), acc)
    else:
        acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
    return acc


@triton.jit
def _mma(acc, x, w, FP32_DOTS: tl.constexpr, HAS_SCALE: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] + x [BLOCK_M, BLOCK_K] . w [BLOCK_N, BLOCK_K].T on the MMA."""
    if FP32_DOTS:
        acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
    elif HAS_SCALE:
        # e4m3fn -> bf16/fp16 is exact: the MMA multiplies the activation by the weight's exact
        # value and the activation is never quantized on this path.
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    else:
        acc += tl.dot(x.to(w.dtype), tl.trans(w))
    return acc


@triton.jit
def _f16_step(acc, shift, w, x, FP32_DOTS: tl.constexpr):
    """One K step of F16_MMA (FP8 weights, swapped): (acc, shift) after adding w . (x 2^shift).T
    on an fp16 MMA, acc [BLOCK_N, BLOCK_M] holding each row's sums times 2^shift.

    The weight is widened by one e4m3x2 -> f16x2 conversion per pair (bf16 costs that, two
    f16 -> f32 conversions and a pack: on sm_90 the conversion unit, not the bytes, bounds the
    bf16 path). x goes into fp16 scaled by a power of two per row, shift [BLOCK_M] (int32),
    chosen as the rows stream by so that every scaled |x| stays below 2^15: when a tile's max
    |x| needs a smaller shift, acc's column is multiplied by the exact power of two first (the
    online rescaling of flash attention). So bf16's x is exact in the fp16 unless it is below
    the row's running max |x| by more than 2^28; the products are then exact in fp32, as on the
    bf16 MMA, and only the order of the sum differs. Under FP32_DOTS the same rounding of x,
    then fp32 dots."""
    x32 = x.to(tl.float32)
    amax = tl.max(tl.abs(x32), axis=1)                              # [BLOCK_M]
    exponent = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF       # amax < 2^(exponent - 126)
    new_shift = tl.minimum(shift, tl.minimum(141 - exponent, 100))  # amax 2^shift < 2^15
    # Exact; 1 where unchanged. A drop past 2^-126 (a row growing by more than that) is clamped:
    # the sums so far are then below 2^-126 * 2^15 * 448 * K, against new terms of 2^14 or more.
    acc *= _pow2(tl.maximum(new_shift - shift, -126))[None, :]
    x16 = (x32 * _pow2(new_shift)[:, None]).to(tl.float16)
    if FP32_DOTS:
        acc += tl.dot(w.to(tl.float32), tl.trans(x16.to(tl.float32)), input_precision="ieee")
    else:
        acc = tl.dot(w.to(tl.float16), tl.trans(x16), acc)
    return acc, new_shift


@triton.jit
def _rows_k_step(acc, shift, w, k, k_hi, x_rows, r_rows, g_ptr, lo_rows, row_ok, rstd,
                 FP32_DOTS: tl.constexpr, HAS_SCALE: tl.constexpr, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr,
                 X2_PIECES: tl.constexpr, F16_MMA: tl.constexpr):
    """One K step of the several-row GEMV on its path: (acc, shift) after adding weight tile
    w (columns k) times x's columns k. X2_PIECES: x given as e4m3 pieces (hi at x_rows, lo at
    lo_rows) on the FP8 MMA; F16_MMA: the fp16 MMA (_f16_step, shift its running power of two
    per row); else the MMA in x's dtype (_rows_step)."""
    if X2_PIECES:
        x_ok = row_ok[:, None] & _k_ok(k, k_hi, EVEN_K)[None, :]
        hi = tl.load(x_rows + k[None, :], mask=x_ok, other=0.0)
        lo = tl.load(lo_rows + k[None, :], mask=x_ok, other=0.0)
        acc += _pieces_dot(w, hi, lo, FP32_DOTS)
    elif F16_MMA:
        x = _rows_x(x_rows, r_rows, g_ptr, k, k_hi, row_ok, rstd, NORM, HAS_RESIDUAL, EVEN_K)
        acc, shift = _f16_step(acc, shift, w, x, FP32_DOTS)
    else:
        acc = _rows_step(acc, w, x_rows, r_rows, g_ptr, k, k_hi, row_ok, rstd, FP32_DOTS,
                         HAS_SCALE, NORM, HAS_RESIDUAL, SWAP, EVEN_K)
    return acc, shift


@triton.jit
def _pieces_dot(w, hi, lo, FP32_DOTS: tl.constexpr):
    """w [BLOCK_N, BLOCK_K] . (hi + lo).T from zero, [BLOCK_N, BLOCK_M] fp32: lo's dot, then
    hi's onto it (both e4m3, on the FP8 MMA; fp32 dots of their values under FP32_DOTS). The
    caller adds it to its fp32 accumulator: one K step in the MMA's own accumulation."""
    if FP32_DOTS:
        wide = w.to(tl.float32)
        part = tl.dot(wide, tl.trans(lo.to(tl.float32)), input_precision="ieee")
        return tl.dot(wide, tl.trans(hi.to(tl.float32)), part, input_precision="ieee")
    part = tl.dot(w, tl.trans(lo))
    return tl.dot(w, tl.trans(hi), part)


@triton.jit
def _rstd_from_groups(sq_ptr, rows, row_ok, K, eps, STATS_BLOCK: tl.constexpr,
                      STAT_COLS: tl.constexpr):
    """rstd [BLOCK_M, 1] = rsqrt(sum(h^2) / K + eps) (fp32, as rmsnorm.py) from sq_ptr [M,
    cdiv(K, STAT_COLS)]: each row's sums of h^2 over groups of STAT_COLS columns, added here in
    one fixed order (deterministic: whatever tiles wrote them)."""
    groups = tl.cdiv(K, STAT_COLS)
    idx = tl.arange(0, STATS_BLOCK)
    parts = tl.load(sq_ptr + rows[:, None] * groups + idx[None, :],
                    mask=row_ok[:, None] & (idx < groups)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(parts, axis=1) / K + eps)[:, None]


@triton.jit
def _scale_product(acc, scale, MUL_RN: tl.constexpr):
    """acc * scale (broadcast to acc's shape). MUL_RN (CUDA, fp32 output, the residual
    epilogue): an explicitly rounded PTX multiply, which neither LLVM nor ptxas may contract with
    the residual's add that follows into one FMA. Unfused, fp32's y = acc * scale is rounded
    before y + r, as the plain GEMV's output and fuser::add_rms_norm's add are; fused, summed
    differed from them in the last bit (the GPU run of tests/test_ops_norm_stats.py). bf16 and
    fp16 outputs round y to their dtype first, so nothing fuses there."""
    if MUL_RN:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f",
                                         [acc, tl.broadcast_to(scale, acc.shape)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return acc * scale


@triton.jit
def _residual_tiles(r_ptr, g_ptr, rows, row_ok, cols, col_ok, stride_rm, SWAP: tl.constexpr):
    """The residual epilogue's inputs, in acc's layout: (r [BLOCK_N, BLOCK_M] with SWAP, else
    [BLOCK_M, BLOCK_N], in r's dtype; g [BLOCK_N] in fp32), zeros where out of bounds."""
    g = tl.load(g_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    if SWAP:
        r = tl.load(r_ptr + rows[None, :] * stride_rm + cols[:, None],
                    mask=row_ok[None, :] & col_ok[:, None], other=0.0)
    else:
        r = tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    return r, g


@triton.jit
def _residual_epilogue(acc, r, g, gx_ptr, sq_ptr, rows, row_ok, cols, col_ok, pid, N, stride_om,
                       out_dtype: tl.constexpr, BLOCK_N: tl.constexpr, STAT_COLS: tl.constexpr,
                       SWAP: tl.constexpr):
    """The several-row GEMV's tile of summed = (x @ W.T rounded to out's dtype) + residual r,
    rounded once (what fuser::add_rms_norm adds), in acc's layout, for the caller to store; here
    it stores g * summed (rounded once: a product of two bf16/fp16 values is exact in fp32) to
    gx_ptr and each row's sums of summed^2 over this tile's groups of STAT_COLS columns to
    sq_ptr [M, cdiv(N, STAT_COLS)] (padding rows and columns are zeros: masked loads of x, W
    and r, _residual_tiles). col_ok carries the split-K writer mask."""
    tile_groups: tl.constexpr = BLOCK_N // STAT_COLS
    groups = pid * tile_groups + tl.arange(0, tile_groups)
    width = tl.cdiv(N, STAT_COLS)
    # split-K: only the summing program stores (col_ok is all false in the others)
    width_here = tl.where(tl.max(col_ok.to(tl.int32), axis=0) > 0, width, 0)
    h = (acc.to(out_dtype).to(tl.float32) + r.to(tl.float32)).to(out_dtype).to(tl.float32)
    if SWAP:  # acc [BLOCK_N, BLOCK_M]
        tl.store(gx_ptr + rows[None, :] * stride_om + cols[:, None],
                 (h * g[:, None]).to(out_dtype), mask=row_ok[None, :] & col_ok[:, None])
        sq = tl.sum(tl.reshape(h * h, [tile_groups, STAT_COLS, acc.shape[1]]), axis=1)
        tl.store(sq_ptr + rows[None, :] * width + groups[:, None], sq,
                 mask=row_ok[None, :] & (groups < width_here)[:, None])
    else:  # acc [BLOCK_M, BLOCK_N]
        tl.store(gx_ptr + rows[:, None] * stride_om + cols[None, :],
                 (h * g[None, :]).to(out_dtype), mask=row_ok[:, None] & col_ok[None, :])
        sq = tl.sum(tl.reshape(h * h, [acc.shape[0], tile_groups, STAT_COLS]), axis=2)
        tl.store(sq_ptr + rows[:, None] * width + groups[None, :], sq,
                 mask=row_ok[:, None] & (groups < width_here)[None, :])
    return h
