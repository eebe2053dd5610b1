"""A linear layer for decode: few rows of activations against a weight streamed once.

    linear(x, weight) = x @ weight.T       x: [M, K] (M <= MAX_ROWS), weight: [N, K] -> [M, N]

At batch 1 a decode step (M = 1) or a verification step (M = gamma + 1) is a matrix-vector
product: the weight is read once and each element is used M times, so the time is the weight's
bytes over the memory bandwidth. cuBLAS reaches that only for some shapes at M = 1 (measured on
an H200: ~42% of the read bandwidth for 4096 x 4096, ~58% for 6144 x 4096, ~98% for the
128256 x 4096 LM head; benchmarks/RESULTS.md), so the decode graphs call this kernel instead
(passes/linear.py).

Triton implementation: grid (cdiv(N, BLOCK_N),); one program owns BLOCK_N output columns and
walks K in BLOCK_K chunks, loading a [BLOCK_N, BLOCK_K] tile of the weight (contiguous along
K: coalesced, 16-byte loads) and the matching [M, BLOCK_K] slice of x (small, from L2), and
keeps fp32 accumulators. M = 1 multiplies and sums on the CUDA cores, each thread adding its
products into a partial per 16-byte run of columns that it loads, the partials added across
threads once after the K loop (ONE_ROW_PARTIALS); M > 1 uses an MMA with the rows padded to 16
(the matrix units have spare throughput at these sizes: the kernel stays bound by the weight's
bytes). Software pipelining (num_stages) keeps several weight tiles in flight per program,
which is what a memory-bound stream needs.

Several rows, swapped (`_default_swap`: where it measured faster on an H200, benchmarks/RESULTS.md,
tenth session): the weight tile is the MMA's A operand and x its B, acc[BLOCK_N, BLOCK_M] +=
w . x.T (`_mma_swapped`), so BLOCK_N (64 or 128 weight rows) is the MMA's M dimension, which
on sm_90 makes it a wgmma reading a bf16 tile from shared memory as it was loaded (the
unswapped 16-row MMA is an mma.sync fed by ldmatrix). The accumulator keeps that layout through
the split sum, the scale and the store; only the gated epilogue transposes it.

Numerics: products and sums in fp32 (bf16/fp16 products are exact in fp32), one rounding to
the output dtype, as cuBLAS does; only the summation order differs.

FP8 weights (`fuser::fp8_linear(x, w_fp8, w_scale)`, FuserConfig(precision="fp8")): the same
kernel reads an e4m3fn weight [N, K] (half the bytes) with one fp32 scale per output channel
(fuser/ops/fp8.py). Each weight tile is dequantized in registers (exactly: to fp32 on the
CUDA-core path, to x's bf16/fp16 for the MMA), the sum runs in fp32 as above, and the scale
multiplies each output once after the K loop, before the one rounding to x's dtype. The
activations are not quantized on this path. Its tiles (_default_fp8_config) are the fastest
measured on an H200 (benchmarks/RESULTS.md); FP8_ONE_ROW_TILES lets a benchmark run others.

Gated MLP (`fuser::gated_linear(x, weight, activation)`, `fuser::fp8_gated_linear(x, w_fp8,
w_scale, activation)`, passes/gated_linear.py): the weight is a merged gate/up matrix [2I, K],
gate rows first (as merge_gate_up concatenates them, and as Phi-3 ships gate_up_proj), and the
output is act(gate) * up: [M, I], with the activation in the kernel's epilogue. One kernel
instead of the GEMV and fuser::gated_act, and no [M, 2I] intermediate. A program's weight tile
is BLOCK_N rows as before, gathered differently: BLOCK_N / 2 gate rows n.. and the matching up
rows I + n.. of the same matrix. Each tile row is a contiguous run along K, exactly as in the
plain kernel, and the K loop (one load, one dot per step) is the plain kernel's, so the loads
stay coalesced 16-byte vectors and the tuned tile shapes keep their register and shared-memory
footprint; after the loop the accumulator's columns are split into gate and up for the
epilogue. Compiled for sm_90 (Triton 3.9, Llama-3-8B's gate/up) it has the plain kernel's loads,
MMAs and registers within 5%; two separate [BLOCK_N / 2, BLOCK_K] tiles and two dots per step
had the same loads but, for FP8 weights at M > 1, 255 registers against the plain 96. The
merged weight is not reordered: the prefill GEMM, the FP8 scale vector and engine files read it
as it is. The tuned tables are looked up at N = 2I, block_n counting weight rows: the same
bytes per program and the same grid as the plain GEMV over the merged weight. Numerics: gate
and up each rounded to x's dtype (after their scales, for FP8), as the GEMV's output is, then
act(gate) * up exactly as fuser::gated_act computes it (fuser/ops/gated_act.py act_times_up).

RMSNorm prologue (`fuser::rms_norm_linear(x, g, eps, W, w_scale, act)`,
`fuser::add_rms_norm_linear(x, r, g, eps, W, w_scale, act) -> (out, summed)`,
passes/norm_linear.py): the GEMV's input is the norm's output, computed in the kernel instead of
by fuser::rms_norm / add_rms_norm (one kernel and one launch gap fewer per norm: 2L + 1 per
decode step, 65 on Llama-3-8B; ~2.5 us each on an H200), over any of the four weights above
(w_scale None: x's dtype; act None: not gated). Each program first makes one pass over its
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
At one row with NORM_RSTD_LAST (off by default: measured slower) there is no first pass: the
K loop multiplies each weight tile by g * h in fp32 (exact for bf16/fp16: h and g have 8 or 11
significant bits), gathers h * h from the same tiles, and multiplies each output's fp32 sum by
rstd after the loop (rstd is one number per row: it factors out of the sum). The norm's own
roundings of the normed row are gone, so the result is closer to the exact norm-then-GEMV than
the unfused kernels' (tests/test_ops_norm_linear.py holds both), and not their bits.

Split-K in the same launch (SPLIT_K > 1, `_default_split_k`: down_proj's long K at one row,
and bf16 o_proj): grid (column blocks, SPLIT_K); program (b, s) sums K range s of SPLIT_K, stores
its fp32 partial, and the last program of block b to arrive (an atomic counter per block,
fuser/ops/counters.py) adds the parts in split order 0..SPLIT_K-1, so the result does not depend
on which program finished last, runs the epilogue (scale, activation) and resets the counter
(`_sum_splits`). One launch instead of a GEMV and a reduction kernel; more programs for a
narrow, deep weight (down_proj: 512 column blocks of 8 rows, each K = 14336 long, become 1024
programs). Extra bytes: 2 * SPLIT_K * grid * BLOCK_M * BLOCK_N * 4 of partials (L2).

Cost: bytes = N * K * s_w + M * K * s_x + M * N * s_out (+ 4N for the FP8 scales);
FLOPs = 2 * M * N * K (+ M * N scale multiplies). Gated, with N = 2I weight rows: the same
weight and x bytes, M * I * s_out written; FLOPs = 4 * M * I * K + ~6-10 * M * I (activation).
With the norm prologue: from HBM, + M * K * (s_r + s_sum) + K * s_g (the residual, summed
written once, the norm weight) and no normed tensor written and read back; from L2, every
program reads its rows of x (and r) twice (the sum-of-squares pass, then the K loop) and g
once: grid * M * K * (2 (s_x + s_r) + s_g) bytes, e.g. 768 programs x 4096 x 10 B ~ 31 MB for
qkv at M = 1 against its 50 MB weight from HBM; the first pass also delays each program's
first weight load by one walk over x. FLOPs + ~5 * M * K per program (the recomputed norm).
With NORM_RSTD_LAST (one row) x and r are read once per program, in the K loop:
grid * K * (s_x + s_r + s_g) from L2.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.counters import split_counters
from fuser.ops.e4m3_pieces import (_pow2, add_rms_norm_pieces_triton, pieces_supported,
                                   split_pieces_triton)
from fuser.ops.fp8 import FP8_DTYPE, fp8_linear_reference
from fuser.ops.gated_act import ACTIVATIONS, act_times_up, gated_act_reference
from fuser.ops.pdl import pdl_launch, wait_for_inputs
from fuser.ops.rmsnorm import _load_block, _normalise, add_rms_norm_reference, rms_norm_reference

MAX_ROWS = 16  # M above this is not a decode shape: the op falls back to the reference
STAT_COLS = 16  # columns per sum of squares that the residual epilogue hands the next norm
GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x's dtypes the kernel takes


def _row_count(x: Tensor) -> int:
    """Rows of x [..., K] (its leading dims flattened; 0 for an empty K too)."""
    return x.numel() // max(x.shape[-1], 1)


@triton.jit
def _norm_x_tile(x_ptrs, r_ptrs, g_ptr, k, mask, k_ok, rstd, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr):
    """The GEMV's input tile at columns k, in x's dtype. x_ptrs / r_ptrs: row starts (broadcast
    against k), mask: rows and columns in bounds, k_ok: columns in bounds (k's shape).

    Without NORM that is x. With NORM it is the value fuser::rms_norm / add_rms_norm writes,
    g * (h * rstd).to(dtype) rounded once, h = x (+ r) rounded to x's dtype, computed by
    rmsnorm.py's own helpers (_load_block, _normalise) in the same order: the same bits for the
    same rstd.
    """
    if NORM:
        h = _load_block(x_ptrs, r_ptrs, x_ptrs, k, mask, HAS_RESIDUAL, False)
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0)
        return _normalise(h, rstd, g, x_ptrs.dtype.element_ty).to(x_ptrs.dtype.element_ty)
    return tl.load(x_ptrs + k, mask=mask, other=0.0)


@triton.jit
def _k_ok(k, k_hi, EVEN_K: tl.constexpr):
    """k < k_hi, or a constant True where the launcher knows every K step is whole (EVEN_K):
    the masks then fold away (on sm_90 a 5-row FP8 GEMV's K loop at 128 x 128 tiles drops from
    197 to 178 instructions, the predicate logic gone)."""
    if EVEN_K:
        return tl.full(k.shape, 1, tl.int1)
    return k < k_hi


@triton.jit
def _w_tile(w_rows, col_ok, k, k_hi, EVEN_K: tl.constexpr = False):
    """The weight tile [BLOCK_N, BLOCK_K] at columns k (masked past k_hi: a predicated-off load
    moves no bytes)."""
    return tl.load(w_rows + k[None, :], mask=col_ok[:, None] & _k_ok(k, k_hi, EVEN_K)[None, :],
                   other=0.0)


@triton.jit
def _row_step(acc, squares, w, x_row, r_row, g_ptr, sum_ptr, k, k_hi, rstd, NORM: tl.constexpr,
              HAS_RESIDUAL: tl.constexpr, RSTD_LAST: tl.constexpr, STORE_SUM):
    """One K step of the one-row GEMV: (acc [BLOCK_N] + w [BLOCK_N, BLOCK_K] . x[k] in fp32,
    squares). With acc [BLOCK_N, BLOCK_K // ROW_VEC] (the kernel's ROW_VEC) each run of ROW_VEC
    columns, the run a thread loads as one 16-byte vector, adds its products to its own partial:
    sums inside each thread, no reduction across threads until the loop ends. (x loaded in w's
    tile shape instead, which drops the sm_90 code's shared-memory broadcast of x between two
    barriers per step, measured slower on the H200: benchmarks/RESULTS.md, tenth session.)

    NORM with RSTD_LAST: x[k] is g * h (fp32, h = x (+ r) rounded to x's dtype), squares
    [BLOCK_K] gathers h * h for the rstd that multiplies acc after the loop (_rstd_last), and
    STORE_SUM (program 0) writes h to summed."""
    k_ok = k < k_hi
    if NORM and RSTD_LAST:
        h = _load_block(x_row, r_row, sum_ptr, k, k_ok, HAS_RESIDUAL, False)
        if HAS_RESIDUAL:  # one writer (a predicated store: no branch in the loop)
            tl.store(sum_ptr + k, h.to(sum_ptr.dtype.element_ty),
                     mask=k < tl.where(STORE_SUM, k_hi, 0))
        squares += h * h
        x = h * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    else:
        x = _norm_x_tile(x_row, r_row, g_ptr, k, k_ok, k_ok, rstd, NORM, HAS_RESIDUAL)
    prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
    runs: tl.constexpr = acc.shape[1]  # acc [BLOCK_N, BLOCK_K // ROW_VEC]: one partial per run
    acc += tl.sum(tl.reshape(prod, [acc.shape[0], runs, prod.shape[1] // runs]), axis=2)
    return acc, squares


@triton.jit
def _rstd_last(acc, squares, K, eps):
    """The one-row GEMV's sum times the norm's rstd = rsqrt(sum(h^2) / K + eps) (fp32, as
    rmsnorm.py), from the squares its K loop gathered: rstd is one number per row, so
    sum_k w[n, k] g[k] h[k] rstd = rstd * sum_k w[n, k] (g[k] h[k])."""
    return acc * tl.rsqrt(tl.sum(squares, axis=0) / K + eps)


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
def _gated_epilogue(acc, HALF: tl.constexpr, BLOCK_M: tl.constexpr, ACTIVATION: tl.constexpr,
                    out_dtype: tl.constexpr):
    """act(gate) * up from an accumulator whose tile columns are HALF gate columns, then the
    HALF matching up columns ([BLOCK_N] at one row, [BLOCK_M, BLOCK_N] else): each half rounded
    to the output dtype as the GEMV's output would be, then exactly as fuser::gated_act."""
    if BLOCK_M == 1:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [2, HALF]), [1, 0]))
    else:
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, HALF]), [0, 2, 1]))
    return act_times_up(gate.to(out_dtype).to(tl.float32), up.to(out_dtype).to(tl.float32),
                        ACTIVATION, out_dtype)


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
    differed from them in the last bit (the GPU run of tests/test_ops_norm_stats.py, twenty-third
    session). bf16 and fp16 outputs round y to their dtype first, so nothing fuses there."""
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


@triton.jit
def _sum_splits(acc, part_ptr, count_ptr, pid, SIZE: tl.constexpr, SPLIT_K: tl.constexpr):
    """Split-K in one launch: (sum of the SPLIT_K partial accumulators of column block `pid`,
    whether this program is the one that summed them).

    Every program of the block stores its fp32 partial, then increments the block's counter
    (acq_rel, GPU scope; the barrier first, so that all of this program's warps have stored).
    The program that sees SPLIT_K - 1 arrived last: every other partial is visible to it. It
    reads them with L2-only loads (.cg: an L1 line of this SM could hold a previous call's
    partial), adds them in split order, the same order whichever program is last, so the result
    is deterministic, and resets the counter to zero for the next call or graph replay. The
    others return zeros and store nothing.
    """
    idx = tl.arange(0, SIZE)
    parts = part_ptr + pid.to(tl.int64) * (SPLIT_K * SIZE)
    tl.store(parts + tl.program_id(1) * SIZE + idx, tl.reshape(acc, [SIZE]))
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel")
    last = arrived == SPLIT_K - 1
    total = tl.zeros([SIZE], dtype=tl.float32)
    if last:
        for s in tl.static_range(SPLIT_K):
            total += tl.load(parts + s * SIZE + idx, cache_modifier=".cg")
        tl.store(count_ptr + pid, 0)
    return tl.reshape(total, acc.shape), last


@triton.jit
def _linear_kernel(
    x_ptr,                      # x: [M, K], row stride stride_xm, column stride 1
    w_ptr,                      # weight: [N, K] ([2N, K], gate rows then up rows, if gated);
                                # row stride stride_wn; x's dtype, or e4m3fn
    scale_ptr,                  # w_scale: one fp32 per weight row (read only if HAS_SCALE)
    out_ptr,                    # out: [M, N], row stride stride_om, x's dtype
    part_ptr,                   # SPLIT_K > 1: fp32 workspace [programs, SPLIT_K, BLOCK_M * BLOCK_N]
    count_ptr,                  # SPLIT_K > 1: int32 counter per program, zero between calls
    r_ptr,                      # residual: [M, K] like x, row stride stride_rm (HAS_RESIDUAL)
    g_ptr,                      # norm weight: [K], contiguous, x's dtype (NORM)
    sum_ptr,                    # summed: [M, K], contiguous, x's dtype (HAS_RESIDUAL): x + r
    lo_ptr,                     # X2_PIECES: x is hi, this lo ([M, K] e4m3fn, x's row stride)
    inv_ptr,                    # X2_PIECES: [M] fp32, each row's 2^-t (fuser/ops/e4m3_pieces.py)
    sq_ptr,                     # [M, groups] fp32 sums of squares over groups of STAT_COLS
                                # columns: written with EPI_RESIDUAL, read with STATS_BLOCK
    gx_ptr,                     # EPI_RESIDUAL: [M, N] like out, g * summed (g at g_ptr, [N])
    M, N, K,                    # N: output columns
    stride_xm, stride_wn, stride_om, stride_rm,
    eps,                        # the norm's epsilon (NORM)
    BLOCK_M: tl.constexpr,      # 1 (CUDA-core path) or a power of two >= 16 (MMA path)
    BLOCK_N: tl.constexpr,      # weight rows per program (gated: half gate, half up)
    BLOCK_K: tl.constexpr,
    NORM_K: tl.constexpr,       # one row's norm prologue: columns of x (and r) a step
    FP32_DOTS: tl.constexpr,    # MMA path in fp32 (TRITON_INTERPRET: its bf16 dot is wrong)
    HAS_SCALE: tl.constexpr,    # FP8 weight: dequantized in registers, out = acc * w_scale
    ACTIVATION: tl.constexpr,   # "": out = x @ W.T; else a key of gated_act.ACTIVATIONS:
                                # out = act(x @ W[:N].T) * (x @ W[N:].T), the gated MLP
    NORM: tl.constexpr,         # the GEMV's input is rms_norm(h) * g, h = x (+ r): see above
    HAS_RESIDUAL: tl.constexpr,  # h = x + r (rounded to x's dtype); program 0 writes h to summed
                                # (with SPLIT_K > 1 every split of column block 0: same values)
    SPLIT_K: tl.constexpr = 1,  # programs per column block, each over K / SPLIT_K (see below)
    PDL: tl.constexpr = False,  # one row, launched with PDL (fuser/ops/pdl.py): PREFETCH
    PREFETCH: tl.constexpr = 0,  # weight tiles (0, 1 or 2) load before waiting for the
                                # previous kernel
    SWAP: tl.constexpr = False,  # MMA path: the weight tile as the MMA's A operand (_mma_swapped)
    F16_MMA: tl.constexpr = False,  # SWAP, FP8 weights: the MMA in fp16 (_f16_step)
    X2_PIECES: tl.constexpr = False,  # SWAP, FP8 weights: x given as pieces (hi, lo, inv_ptr)
    RSTD_LAST: tl.constexpr = False,  # one row, NORM: no prologue pass; the K loop gathers the
                                # squares and rstd multiplies the sum (_row_step, _rstd_last)
    ROW_VEC: tl.constexpr = 1,  # one row: acc [BLOCK_N, BLOCK_K // ROW_VEC] of in-thread
                                # partial sums, reduced across threads once, after the K loop
    EVEN_K: tl.constexpr = False,  # several rows: SPLIT_K * BLOCK_K divides K, so the K loop's
                                # tiles need no column masks (_k_ok)
    EPI_RESIDUAL: tl.constexpr = False,  # several rows, no activation: out = x @ W.T (rounded)
                                # + residual (r_ptr [M, N]), rounded: add_rms_norm's summed; g *
                                # summed to gx_ptr; each row's sums of summed^2 per STAT_COLS
                                # columns to sq_ptr (_residual_epilogue)
    STATS_BLOCK: tl.constexpr = 0,  # several rows, no NORM: the sums over K times the row's
                                # rstd, from sq_ptr's cdiv(K, STAT_COLS) sums (a power of two
                                # >= that): x is g * h, the GEMV's the norm's (fuser/ops/norm_stats.py)
    STAT_COLS: tl.constexpr = 16,
    MUL_RN: tl.constexpr = False,  # the scale's product rounded on its own (see _scale_product)
    NORM_AFTER: tl.constexpr = False,  # one row, NORM, no RSTD_LAST: the K loop's input is
                                # g * h rounded once, the row's rstd multiplies the sums after it
                                # (norm_stats' arithmetic; linear.ONE_ROW_NORM_AFTER)
):
    pid = tl.program_id(0)
    # Split-K: program (pid, s) sums K range [s * K / SPLIT_K, (s + 1) * K / SPLIT_K) (the
    # launcher makes SPLIT_K * BLOCK_K divide K): both ends are multiples of 16, which keeps
    # the weight loads 16-byte vectors (FP8 too: K // 2 alone is known only as a multiple of 8).
    k_lo = tl.program_id(1) * (K // SPLIT_K)
    k_hi = k_lo + K // SPLIT_K
    if SPLIT_K > 1:
        k_lo = tl.multiple_of(k_lo, 16)
        k_hi = tl.multiple_of(k_hi, 16)
    tile = tl.arange(0, BLOCK_N)                            # rows of the weight tile
    if ACTIVATION == "":
        cols = pid * BLOCK_N + tile                         # output columns = weight rows
        w_row = cols
    else:
        # Tile rows [0, HALF): the gate rows of output columns pid * HALF + r; rows
        # [HALF, BLOCK_N): the matching up rows, N further down the merged weight. One tile, one
        # load and one dot per K step, as for a plain weight: only the rows it gathers differ.
        HALF: tl.constexpr = BLOCK_N // 2
        cols = pid * HALF + tile % HALF
        w_row = cols + tl.where(tile < HALF, 0, N)
    col_ok = cols < N
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + w_row[:, None].to(tl.int64) * stride_wn
    # PDL (one row): the program's first PREFETCH weight tiles load while the previous kernel
    # finishes (weights never depend on it); everything else waits. The K loop then starts after
    # them and each prefetched tile is summed exactly as a loop step would, in the same order.
    k_loop = k_lo
    if PDL and BLOCK_M == 1 and PREFETCH >= 1:
        k_pre0 = k_lo + offs_k
        w_pre0 = _w_tile(w_rows, col_ok, k_pre0, k_hi)
        k_loop += BLOCK_K
    if PDL and BLOCK_M == 1 and PREFETCH >= 2:
        k_pre1 = k_lo + BLOCK_K + offs_k
        w_pre1 = _w_tile(w_rows, col_ok, k_pre1, k_hi)
        k_loop += BLOCK_K
    wait_for_inputs(PDL)
    if BLOCK_M == 1:
        x_row, r_row = x_ptr, r_ptr
        rstd = 0.0
        if NORM and not RSTD_LAST:
            # Norm prologue: one pass over the row for its sum of squares (program 0 also writes
            # h = x + r out), rstd as rmsnorm.py computes it; the K loop then normalises x's tiles.
            squares = tl.zeros([NORM_K], dtype=tl.float32)
            for k0 in range(0, K, NORM_K):
                k = k0 + tl.arange(0, NORM_K)
                k_ok = k < K
                h = _load_block(x_row, r_row, sum_ptr, k, k_ok, HAS_RESIDUAL, False)
                if HAS_RESIDUAL:
                    if pid == 0:  # one writer; never in place: the other programs read x, r
                        tl.store(sum_ptr + k, h.to(sum_ptr.dtype.element_ty), mask=k_ok)
                squares += h * h
            rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)  # fp32, as rmsnorm.py
        row_rstd = rstd
        if NORM_AFTER:  # the loop's tiles: (h * 1).to(dtype) * g = g * h, rounded once
            rstd = rstd * 0.0 + 1.0
        acc = tl.zeros([BLOCK_N, BLOCK_K // ROW_VEC], dtype=tl.float32)
        row_squares = tl.zeros([BLOCK_K], dtype=tl.float32)  # NORM and RSTD_LAST (SPLIT_K 1)
        first = pid == 0
        if PDL and PREFETCH >= 1:
            acc, row_squares = _row_step(acc, row_squares, w_pre0, x_row, r_row, g_ptr, sum_ptr,
                                         k_pre0, k_hi, rstd, NORM, HAS_RESIDUAL, RSTD_LAST,
                                         first)
        if PDL and PREFETCH >= 2:
            acc, row_squares = _row_step(acc, row_squares, w_pre1, x_row, r_row, g_ptr, sum_ptr,
                                         k_pre1, k_hi, rstd, NORM, HAS_RESIDUAL, RSTD_LAST,
                                         first)
        for k0 in range(k_loop, k_hi, BLOCK_K):
            k = k0 + offs_k
            w = _w_tile(w_rows, col_ok, k, k_hi)
            acc, row_squares = _row_step(acc, row_squares, w, x_row, r_row, g_ptr, sum_ptr, k,
                                         k_hi, rstd, NORM, HAS_RESIDUAL, RSTD_LAST, first)
        acc = tl.sum(acc, axis=1)  # the partials' one reduction across threads
        if NORM_AFTER:
            acc *= row_rstd
        if NORM and RSTD_LAST:
            acc = _rstd_last(acc, row_squares, K, eps)
        if SPLIT_K > 1:
            acc, last = _sum_splits(acc, part_ptr, count_ptr, pid, BLOCK_N, SPLIT_K)
        if HAS_SCALE:  # once per output, after the sum over K
            acc *= tl.load(scale_ptr + w_row, mask=col_ok, other=0.0)
    else:
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < M
        x_rows = x_ptr + rows[:, None] * stride_xm              # [BLOCK_M, 1]
        r_rows = r_ptr + rows[:, None] * stride_rm
        rstd = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
        if NORM:  # the norm prologue, per row (padding rows: h = 0, never stored)
            squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k = k0 + offs_k
                x_ok = row_ok[:, None] & (k < K)[None, :]
                h = _load_block(x_rows, r_rows, sum_ptr, k[None, :], x_ok, HAS_RESIDUAL, False)
                if HAS_RESIDUAL:
                    if pid == 0:
                        tl.store(sum_ptr + rows[:, None] * K + k[None, :],
                                 h.to(sum_ptr.dtype.element_ty), mask=x_ok)
                squares += h * h
            rstd = tl.rsqrt(tl.sum(squares, axis=1) / K + eps)[:, None]
        # Loaded before the K loop, whose weight loads then hide their latency (after it they
        # would add to every program's tail): the norm's sums of squares (STATS_BLOCK), the
        # residual and norm weight tiles of the epilogue (EPI_RESIDUAL).
        if STATS_BLOCK > 0:
            rstd = _rstd_from_groups(sq_ptr, rows, row_ok, K, eps, STATS_BLOCK, STAT_COLS)
        if EPI_RESIDUAL:
            epi_r, epi_g = _residual_tiles(r_ptr, g_ptr, rows, row_ok, cols, col_ok, stride_rm,
                                           SWAP)
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        shift = tl.full([BLOCK_M], 100, dtype=tl.int32)  # F16_MMA: acc holds sums * 2^shift
        lo_rows = lo_ptr + rows[:, None] * stride_xm             # X2_PIECES
        for k0 in range(k_loop, k_hi, BLOCK_K):
            k = k0 + offs_k
            w = _w_tile(w_rows, col_ok, k, k_hi, EVEN_K)
            acc, shift = _rows_k_step(acc, shift, w, k, k_hi, x_rows, r_rows, g_ptr, lo_rows,
                                      row_ok, rstd, FP32_DOTS, HAS_SCALE, NORM, HAS_RESIDUAL,
                                      SWAP, EVEN_K, X2_PIECES, F16_MMA)
        if F16_MMA:  # back to the sums themselves (each split had its own shifts)
            acc *= _pow2(-shift)[None, :]
        if X2_PIECES:  # the rows' 2^-t (acc [BLOCK_N, BLOCK_M]: SWAP)
            acc *= tl.load(inv_ptr + rows, mask=row_ok, other=0.0)[None, :]
        # SWAP keeps acc [BLOCK_N, BLOCK_M] through the split sum (every split stores its partial
        # in that layout), the scale and a plain store; only the gated epilogue transposes it.
        if SPLIT_K > 1:
            acc, last = _sum_splits(acc, part_ptr, count_ptr, pid, BLOCK_M * BLOCK_N, SPLIT_K)
        if STATS_BLOCK > 0:  # x was g * h: the norm's rstd, one per row, after the sum over K
            if SWAP:
                acc *= tl.reshape(rstd, [1, BLOCK_M])
            else:
                acc *= rstd
        if HAS_SCALE:  # once per output column, after the sum over K
            scale = tl.load(scale_ptr + w_row, mask=col_ok, other=0.0)
            if SWAP:
                acc = _scale_product(acc, scale[:, None], MUL_RN)
            else:
                acc = _scale_product(acc, scale[None, :], MUL_RN)
        if SWAP and ACTIVATION != "":
            acc = tl.trans(acc)
    out_dtype = out_ptr.dtype.element_ty
    if ACTIVATION != "":
        # Split the tile's columns into gate [.., HALF] and up [.., HALF] (once, after the K
        # loop), round each to x's dtype as the GEMV's output would be, then act(gate) * up
        # exactly as fuser::gated_act computes it.
        cols = pid * HALF + tl.arange(0, HALF)
        col_ok = cols < N
        acc = _gated_epilogue(acc, HALF, BLOCK_M, ACTIVATION, out_dtype)
    if SPLIT_K > 1:  # only the program that summed the splits writes (see _sum_splits)
        col_ok = (col_ok.to(tl.int32) * last.to(tl.int32)) != 0
    if EPI_RESIDUAL:  # (the launcher: BLOCK_M > 1, no activation)
        acc = _residual_epilogue(acc, epi_r, epi_g, gx_ptr, sq_ptr, rows, row_ok, cols, col_ok,
                                 pid, N, stride_om, out_dtype, BLOCK_N, STAT_COLS, SWAP)
    if BLOCK_M == 1:
        tl.store(out_ptr + cols, acc.to(out_dtype), mask=col_ok)
    elif SWAP and ACTIVATION == "":  # acc [BLOCK_N, BLOCK_M]
        out = out_ptr + rows[None, :] * stride_om + cols[:, None]
        tl.store(out, acc.to(out_dtype), mask=row_ok[None, :] & col_ok[:, None])
    else:
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_dtype), mask=row_ok[:, None] & col_ok[None, :])


# Several rows over a small weight (at most SMALL_WEIGHT elements: the bundled pair's, where a
# GEMV streams its weight in well under a microsecond and the launch's latency is the cost):
# more programs of 16 columns each, unsplit. On an H200 the bundled target's verify step (T = 3)
# took 110.9 us against 127.9 with the 8B-shape tables, the draft's catch-up 37.8 against 41.6,
# logits bit-equal; 16 x 64 tiles took 120.0, 32 x 128 113.2, and splitting K (3 ways) was
# slower every time (docs/performance-notes.md).
SMALL_WEIGHT = 1 << 21
SMALL_ROWS_TILE = (16, 128, 4, 3)  # (block_n, block_k, num_warps, num_stages)


def small_weight(N: int, K: int) -> bool:
    """Whether an N x K weight takes the small-weight several-row tile (SMALL_ROWS_TILE)."""
    return N * K <= SMALL_WEIGHT


def _default_config(M: int, N: int, K: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages): the fastest configurations of a sweep on an
    H200 at Llama-3-8B shapes (docs/performance-notes.md)."""
    if M == 1:
        if K > 8192:                # down_proj, split in 2 (_default_split_k)
            return 8, 512, 4, 4
        if N * K <= 2**25:          # qkv (6144 x 4096), o_proj (4096 x 4096): more programs
            return (8, 512, 4, 4) if N <= 4096 else (8, 512, 8, 4)   # o_proj: split in 2
        return 16, 512, 4, 4        # gate_up, lm_head
    # Several rows: measured at M = 5, swapped where _default_swap says so
    if small_weight(N, K):
        return SMALL_ROWS_TILE
    if K >= 8192:                   # down_proj (swapped, split in 4)
        return 64, 128, 4, 3
    if N <= 4096:                   # o_proj (swapped, split in 2)
        return 64, 128, 4, 5
    if N <= 8192:                   # qkv
        return 64, 256, 4, 4
    if N < 2**16:                   # gate_up, gated (swapped)
        return 128, 128, 4, 3
    return 64, 128, 4, 4            # lm_head


def _default_fp8_config(M: int, N: int, K: int,
                        pieces: bool = False) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_warps, num_stages) for e4m3fn weights: the fastest of a sweep on
    an H200 at Llama-3-8B shapes (benchmarks/fp8_ops.py sweeps it). One 16-byte load carries 16
    weights, so BLOCK_K is twice the bf16 table's. One row, timed as the engine runs each GEMV
    (norm prologue, gated epilogue, PDL) with the in-thread partial sums (_row_step): gate/up
    32.93 us at 128 x 256 tiles against 34.20 at 32 x 512 (a quarter of the programs, each
    making the norm prologue's pass over x). Several rows (4 warps: the 8-warp programs, which
    spill no registers, were slower at every shape; docs/performance-notes.md)."""
    if M == 1:
        if K > 8192:                    # down_proj, unsplit: 15.72 against 17.14 us at 8 x 1024
            return 8, 2048, 8, 4        # split in 2
        if N <= 4096:                   # o_proj: 6.05 against 7.01 us at 8 x 1024, 4 warps
            return 8, 2048, 8, 4
        if N * K <= 2**25:              # qkv: 9.57 against 9.60 us at 8 x 1024, 4 warps
            return 16, 1024, 8, 4
        if N < 2**16:                   # gate_up
            return 128, 256, 8, 4
        return 16, 512, 4, 4            # lm_head
    if pieces and K > 8192:  # down_proj on x's pieces at M = 5: 20.48 against 21.11 us at
        return 64, 256, 4, 3            # 64 x 128
    return 64, 128, 4, 4  # swapped, every shape (measured at M = 5)


def _default_split_k(M: int, N: int, K: int, fp8: bool) -> int:
    """Programs per column block (split-K, summed in the same launch), measured on an H200: 2
    at one row against down_proj's long K in bf16 (30.1 vs 38.7 us unsplit and 31.8 for
    cuBLAS; FP8 down_proj takes 15.72 us unsplit at 8 x 2048 tiles against 17.14 split at
    8 x 1024) and, in bf16, o_proj's 4096 x 4096 (11.2 vs 12.2). Everything else measured no
    gain. Several rows (the swapped MMA's 64-row tiles: few programs on a narrow weight): the
    fastest at M = 5."""
    if M != 1:
        if small_weight(N, K) and not fp8:
            return 1                        # SMALL_ROWS_TILE
        if fp8:
            return 4 if N <= 8192 else 1    # qkv, o_proj, down_proj
        if K >= 8192:
            return 4                        # down_proj
        return 2 if N <= 4096 else 1        # o_proj
    if K > 8192:
        return 1 if fp8 else 2  # FP8 down_proj at 8 x 2048 tiles, 8 warps: 15.72 us unsplit
    return 2 if (not fp8 and N <= 4096) else 1


def _default_swap(M: int, N: int, K: int, fp8: bool) -> bool:
    """Several rows: the weight tile as the MMA's A operand (_mma_swapped) where it measured
    faster on an H200 at M = 5: bf16 down_proj 31.9 vs 35.6 us, o_proj 11.6 vs 13.3, gate_up
    59.2 vs 69.6 (qkv 16.0 vs 15.5 and the LM head 235.2 vs 236.7: not taken); FP8 every shape
    (qkv 14.8 vs 17.0, o_proj 11.3 vs 13.3, down_proj 29.4 vs 37.5, gate_up 54.1 vs 56.1, the
    LM head 183.4 vs 184.7)."""
    if M == 1:
        return False
    return fp8 or K >= 8192 or N <= 4096 or 8192 < N < 2**16


# Several rows, FP8 weights, bf16 x (swapped): the MMA runs in fp16, the weight widened to fp16
# in registers and x scaled by a running power of two per row (_f16_step): a 16-layer chain of
# 5-row FP8 GEMVs took 89.9 us a layer against 109.5 on the bf16 MMA. The GEMVs after a norm
# take x from the norm kernel as e4m3 pieces instead (_norm_pieces_take), and fuser::fp8_linear
# splits rows longer than SPLIT_PIECES_MIN_K (down_proj) into pieces first: both on the FP8 MMA
# (X2_PIECES). The 8B FP8 verify step (T = 5) took 1.442x the decode step with every GEMV on
# the fp16 MMA, 1.248x with the pieces (docs/performance-notes.md: the other forms measured).

# FP8 weights, one row: the norm prologue reads x (and r) this many columns a step. Every
# program makes the pass, one L2 round trip a step: at BLOCK_K a step FP8's qkv and gate/up
# GEMVs (768 and 224 programs) took 1.7 and 3.9 us longer with the prologue than without; 2048
# columns a step took qkv 10.28 against 10.77 us and gate/up 32.02 against 33.23 (1024: 10.79
# and 32.76; the whole row, 4096: 12.56 for qkv). The 8B FP8 decode step took 2.431 ms
# against 2.523. bf16 weights step BLOCK_K columns.
ONE_ROW_NORM_K = 2048


def rstd_last_for(fp8: bool, gated: bool, n: int) -> bool:
    """Whether a one-row GEMV with the norm and n outputs multiplies by rstd after its K loop
    (_rstd_last) rather than making the prologue pass: FP8 weights without the gated
    activation and fewer than 2^16 outputs (qkv). The K loop gathers the row's sum of squares
    from the tiles it loads anyway: out = rstd * sum_k w[n, k] (g[k] h[k]), rstd one number per
    row, one rounding fewer than the norm kernel's (tests/test_ops_norm_linear.py holds both
    forms to the float64 norm-then-GEMV). On an H200 FP8's qkv took 9.60 against 10.17 us with
    it; FP8's gate/up (34.93 against 31.67), bf16's qkv (17.17 against 15.91) and FP8's LM
    head (130.64 against 124.19) were slower, so they make the pass."""
    return fp8 and not gated and n < 2**16


# One row, residual add + norm before plain (not FP8) weights: the GEMV's input g * h rounded
# once and rstd times its fp32 sums (NORM_AFTER), the arithmetic of the several-row
# fuser::stats_rms_norm_linear (fuser/ops/norm_stats.py), so that with passes/norm_stats.py on a
# verify step normalises as the decode step does. On, as that pass is (norm_stats.ENABLED);
# tests switch both off together (tests/conftest.py norm_stats_off).
ONE_ROW_NORM_AFTER = True


def norm_after_for(rows: int, residual: bool, fp8: bool, rstd_last: bool) -> bool:
    """Whether a launch takes ONE_ROW_NORM_AFTER's arithmetic."""
    return ONE_ROW_NORM_AFTER and rows == 1 and residual and not fp8 and not rstd_last


PDL_PREFETCH = 1  # weight tiles a PDL-launched program loads before its wait (fuser/ops/pdl.py)

SHARED_MEMORY_BUDGET = 200 * 1024  # bytes of pipelined tiles (an H200 SM has 227 KiB); every tuned
# bf16 and FP8 configuration fits it unchanged


def _fit_shared_memory(block_m: int, block_n: int, block_k: int, stages: int, w_size: int,
                       x_size: int) -> tuple[int, int]:
    """(num_stages, block_k) whose pipelined tiles fit SHARED_MEMORY_BUDGET.

    The tuned tables are for 2-byte (and FP8) weights; an fp32 model's tiles are twice the
    bytes, and at the MMA path's 64 x 256 tile with 4 stages they ask ~320 KB of shared memory
    (Triton's OutOfResources on an H200). Fewer stages first (down to 2), then shorter K steps.
    """
    def need(stages: int, block_k: int) -> int:
        return stages * block_k * (block_n * w_size + (block_m if block_m > 1 else 1) * x_size)

    while need(stages, block_k) > SHARED_MEMORY_BUDGET and stages > 2:
        stages -= 1
    while need(stages, block_k) > SHARED_MEMORY_BUDGET and block_k > 32:
        block_k //= 2
    return stages, block_k


def prefers_cublas(M: int, N: int, K: int) -> bool:
    """Shapes where cuBLAS measured faster than every configuration of this kernel on an H200:
    several rows against a wide, 4096-deep weight (gate_up: 57.6 vs 57.5-58.2 us, a tie at
    best). passes/linear.py leaves these GEMMs to cuBLAS. (One row against down_proj's long K
    was cuBLAS's too, 32.4 vs 34.7 us, until split-K: 30.1 vs 31.8.)"""
    if M == 1:
        return False
    return N * K > 2**26 and N < 2**16


def linear_triton(
    x: Tensor, weight: Tensor, *, weight_scale: Tensor | None = None,
    activation: str | None = None,
    block_n: int | None = None, block_k: int | None = None,
    num_warps: int | None = None, num_stages: int | None = None, split_k: int | None = None,
    prefetch: int | None = None,
) -> Tensor:
    """x @ weight.T for x [..., K] with at most MAX_ROWS rows in all; weight [N, K].

    With weight_scale ([N] fp32; weight then float8 e4m3fn, see fuser/ops/fp8.py) it is
    (x @ weight.T) * weight_scale, the scale applied once per output in fp32 before the one
    rounding to x's dtype: fuser::fp8_linear. The output is in x's dtype either way.

    With activation (a key of fuser.ops.gated_act.ACTIVATIONS) weight is a merged gate/up
    matrix [2I, K], gate rows first, and the result is act(gate) * up: [..., I], with
    gate = x @ weight[:I].T and up = x @ weight[I:].T (each times its half of weight_scale),
    rounded as fuser::linear then fuser::gated_act round them: fuser::gated_linear and
    fuser::fp8_gated_linear.

    The other keyword arguments override the tuned defaults (tests, benchmarks/linear_sweep.py
    and benchmarks/fp8_ops.py). block_n counts rows of `weight` per program either way: a gated
    program streams block_n / 2 gate rows and the block_n / 2 matching up rows in one tile, so
    the tuned tables (looked up at N = 2I, the merged weight's rows) keep their meaning: the
    same tile and the same number of programs as the unfused GEMV over the merged weight.
    """
    out, _ = _launch(x, None, None, 0.0, weight, weight_scale, activation,
                     (block_n, block_k, num_warps, num_stages, split_k, prefetch))
    return out


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


def linear_pieces_triton(
    hi: Tensor, lo: Tensor, inv_scale: Tensor, weight: Tensor, weight_scale: Tensor, *,
    activation: str | None = None, out_dtype: torch.dtype = torch.bfloat16,
    block_n: int | None = None, block_k: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, split_k: int | None = None, prefetch: int | None = None,
) -> Tensor:
    """linear_triton(x, weight, weight_scale=..., activation=...) for 2..16 rows of x given as
    e4m3 pieces, x = (hi + lo) * inv_scale[:, None] (fuser/ops/e4m3_pieces.py): hi, lo
    [M, K] e4m3fn (one row stride), inv_scale [M] fp32; FP8 weights. The FP8 MMA multiplies
    the weight by both pieces (X2_PIECES); out [M, N] in out_dtype."""
    if hi.shape != lo.shape or hi.dtype != FP8_DTYPE or lo.dtype != FP8_DTYPE or \
            hi.stride() != lo.stride() or hi.stride(-1) != 1 or hi.dim() != 2 or \
            inv_scale.shape != hi.shape[:1] or inv_scale.dtype != torch.float32:
        raise ValueError(f"pieces must be hi, lo [M, K] {FP8_DTYPE} of one layout and "
                         f"inv_scale [M] fp32, got {hi.dtype} {tuple(hi.shape)}, {lo.dtype} "
                         f"{tuple(lo.shape)}, {inv_scale.dtype} {tuple(inv_scale.shape)}")
    out, _ = _launch(hi, None, None, 0.0, weight, weight_scale, activation,
                     (block_n, block_k, num_warps, num_stages, split_k, prefetch),
                     pieces=(lo, inv_scale.contiguous()), out_dtype=out_dtype)
    return out


def _launch(x: Tensor, residual: Tensor | None, norm_weight: Tensor | None, eps: float,
            weight: Tensor, weight_scale: Tensor | None, activation: str | None,
            overrides: tuple, pieces: tuple[Tensor, Tensor] | None = None,
            out_dtype: torch.dtype | None = None,
            epilogue: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
            stats: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The one launcher of _linear_kernel: linear_triton (norm_weight None),
    rms_norm_linear_triton, linear_pieces_triton (pieces: x is hi, pieces (lo, inv_scale)),
    linear_residual_triton (epilogue (residual [M, N], g [N], gx out [M, N], squares out
    [M, cdiv(N, STAT_COLS)]): out is x @ W.T + residual, see EPI_RESIDUAL) and
    norm_stats.normed_linear_triton (stats [M, cdiv(K, STAT_COLS)]: x is g * h and
    these are h's sums of squares; the sums over K times rsqrt(sum / K + eps)).
    Returns (out [..., N] in out_dtype or x's, summed [..., K] or None)."""
    *lead, K = x.shape
    rows_w = weight.shape[0]
    assert weight.shape == (rows_w, K), (x.shape, weight.shape)
    if activation is not None:
        check_gated(weight, activation)
    N = rows_w // 2 if activation is not None else rows_w       # output columns
    fp8 = weight_scale is not None
    if fp8:
        assert weight.dtype == FP8_DTYPE, f"weight_scale given with a {weight.dtype} weight"
        assert weight_scale.shape == (rows_w,) and weight_scale.dtype == torch.float32, (
            f"weight_scale must be [{rows_w}] fp32 (one per weight row), got "
            f"{weight_scale.dtype} {tuple(weight_scale.shape)}")
        weight_scale = weight_scale.contiguous()
    x2 = x.reshape(-1, K)                                       # [M, K]
    M = x2.shape[0]
    assert M <= MAX_ROWS, f"{M} rows: linear_triton is for decode shapes (<= {MAX_ROWS} rows)"
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    norm = norm_weight is not None
    r2 = residual.reshape(-1, K) if residual is not None else x2  # [M, K]
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    summed = torch.empty_like(x2, memory_format=torch.contiguous_format) if residual is not None \
        else None                                               # [M, K]: x + residual
    out = torch.empty((M, N), dtype=out_dtype or x.dtype, device=x.device)
    if out.numel() == 0 or K == 0:  # gated too: act(0) * 0 = 0
        if summed is not None:  # no program runs to write it
            torch.add(x2, r2, out=summed)
        return out.zero_().reshape(*lead, N), _lead(summed, lead, K)
    block_n, block_k, num_warps, num_stages, split_k, prefetch = overrides
    if (epilogue is not None or stats is not None) and (M < 2 or norm) or \
            stats is not None and pieces is not None:
        raise ValueError("the residual epilogue and the rstd from sums of squares take 2 to "
                         f"{MAX_ROWS} rows of x without a norm, the latter not as pieces (got "
                         f"{M} rows)")
    if epilogue is not None and activation is not None:
        raise ValueError("the residual epilogue takes a plain linear (no activation)")
    if stats is not None and (stats.shape != (M, triton.cdiv(K, STAT_COLS))
                              or stats.dtype != torch.float32 or not stats.is_contiguous()):
        raise ValueError(f"stats must be [{M}, {triton.cdiv(K, STAT_COLS)}] contiguous fp32 sums "
                         f"of squares, got {stats.dtype} {tuple(stats.shape)}")
    squares = gx = g_epi = out
    if epilogue is not None:
        r2, g_epi, gx, squares = epilogue  # checked by linear_residual_triton
    elif stats is not None:
        squares = stats
    if x.device.type == "cuda" and M == 1 and pieces is None and epilogue is None and \
            stats is None and all(o is None for o in overrides):
        from fuser.ops import gemv_stream  # noqa: PLC0415  (it imports this module's helpers)

        chosen = None if gemv_stream.CONFIG is None else gemv_stream.choose(
            N, K, weight.element_size(), activation is not None, gemv_stream.CONFIG,
            gemv_stream.num_sms(x.device))
        if chosen is not None:
            config, plan = chosen
            gemv_stream.stream_gemv(
                x2, weight, out, plan, config, activation=activation,
                residual=r2 if residual is not None else None, eps=eps, summed=summed,
                norm_weight=norm_weight.contiguous() if norm_weight is not None else None)
            return out.reshape(*lead, N), _lead(summed, lead, K)
    bn, bk, warps, stages = _default_fp8_config(M, rows_w, K, pieces is not None) if fp8 else \
        _default_config(M, rows_w, K)
    bn, bk = block_n or bn, block_k or bk
    if activation is not None and bn < 2:
        raise ValueError(f"block_n={bn}: a gated program takes block_n / 2 gate rows and as "
                         "many up rows, so block_n must be 2 or more")
    block_m = 1 if M == 1 else max(16, triton.next_power_of_2(M))
    if num_stages is None and block_k is None:  # pieces: two 1-byte tiles of x a step
        stages, bk = _fit_shared_memory(block_m, bn, bk, stages, weight.element_size(),
                                        2 if pieces is not None else x.element_size())
    if block_m > 1 and bn < 16:
        raise ValueError(f"block_n={bn}: the MMA path (more than one row) needs block_n >= 16")
    dot_dtype = x.dtype if fp8 else weight.dtype  # fp8: the MMA runs in x's dtype
    fp32_dots = dot_dtype == torch.float32 or (
        x.device.type != "cuda" and dot_dtype in (torch.bfloat16, FP8_DTYPE))
    cols_per_program = bn // 2 if activation is not None else bn
    programs = triton.cdiv(N, cols_per_program)
    splits = _default_split_k(M, rows_w, K, fp8) if split_k is None else split_k
    rstd_last = norm and M == 1 and rstd_last_for(fp8, activation is not None, N)
    if rstd_last and splits > 1:  # every program needs its row's squares over all of K
        if split_k is not None:
            raise ValueError(f"split_k={split_k}: one row's norm with rstd after the sum "
                             "(rstd_last_for) needs the whole of K in each program")
        splits = 1
    if splits > 1 and K % (splits * bk):
        if split_k is not None:
            raise ValueError(f"split_k={split_k}: needs split_k * block_k ({splits} * {bk}) to "
                             f"divide K={K}")
        splits = 1
    parts = counts = out  # unused unless split
    if splits > 1:
        parts = torch.empty((programs, splits, block_m * bn), dtype=torch.float32,
                            device=x.device)
        counts = split_counters(x.device, programs)
    # PDL at one row only: several-row launches measured slower with it (fuser/ops/pdl.py).
    pdl = pdl_launch(x.device, one_row=block_m == 1)
    swap = block_m > 1 and _default_swap(M, rows_w, K, fp8)
    if pieces is not None and not (swap and fp8 and not norm):
        raise ValueError("x as e4m3 pieces takes FP8 weights at 2 to 16 rows, no norm")
    lo, inv = pieces if pieces is not None else (x2, out)
    _linear_kernel[(programs, splits)](
        x2, weight, weight_scale if fp8 else out, out, parts, counts,
        r2, norm_weight.contiguous() if norm else g_epi, summed if summed is not None else x2,
        lo, inv, squares, gx,
        M, N, K, x2.stride(0), weight.stride(0), out.stride(0), r2.stride(0),
        eps,
        BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        NORM_K=min(ONE_ROW_NORM_K, triton.next_power_of_2(K)) if fp8 else bk,
        FP32_DOTS=fp32_dots, HAS_SCALE=fp8,
        ACTIVATION=activation or "", NORM=norm, HAS_RESIDUAL=residual is not None,
        SPLIT_K=splits, PDL=bool(pdl),
        PREFETCH=PDL_PREFETCH if prefetch is None else prefetch,
        # several bf16 rows against FP8 weights (swapped): the fp16 MMA (_f16_step)
        SWAP=swap, F16_MMA=swap and fp8 and x.dtype == torch.bfloat16,
        X2_PIECES=pieces is not None, RSTD_LAST=rstd_last,
        ROW_VEC=min(16 // weight.element_size(), bk) if block_m == 1 else 0,
        EVEN_K=block_m > 1 and K % (splits * bk) == 0,
        EPI_RESIDUAL=epilogue is not None,
        MUL_RN=epilogue is not None and fp8 and out.dtype == torch.float32 and
        x.device.type == "cuda",
        STATS_BLOCK=triton.next_power_of_2(triton.cdiv(K, STAT_COLS)) if stats is not None else 0,
        STAT_COLS=STAT_COLS,
        NORM_AFTER=norm and norm_after_for(M, residual is not None, fp8, rstd_last),
        num_warps=num_warps or warps, num_stages=num_stages or stages,
        **pdl,
    )
    return out.reshape(*lead, N), _lead(summed, lead, K)


def _lead(t: Tensor | None, lead: list, K: int) -> Tensor | None:
    return None if t is None else t.reshape(*lead, K)


def check_gated(weight: Tensor, activation: str) -> None:
    """Refuse what a gated GEMV cannot compute: an unknown activation, an odd row count."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is not one of {ACTIVATIONS}")
    if weight.dim() != 2 or weight.shape[0] % 2:
        raise ValueError(f"a gated linear's weight is [2I, K] (gate rows, then up rows), got "
                         f"{tuple(weight.shape)}")


# ---------------------------------------------------------------------------------------------
# Custom op: CPU (and any other device) runs the reference, CUDA runs the Triton kernel.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor) -> Tensor:
    return linear_reference(x, weight)


@linear.register_fake
def _linear_fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_cuda(x: Tensor, weight: Tensor) -> Tensor:
    if _row_count(x) > MAX_ROWS or x.dtype != weight.dtype:
        return linear_reference(x, weight)
    return linear_triton(x, weight)


linear.register_kernel("cuda")(_linear_cuda)


def linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T, as the captured graph computes it (aten.mm over a transposed weight)."""
    return torch.nn.functional.linear(x, weight)


# ---------------------------------------------------------------------------------------------
# fuser::fp8_linear: the same kernel over an e4m3fn weight with per-output-channel scales
# (fuser/ops/fp8.py). Activations stay in their dtype: only the weight is FP8 on this path.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::fp8_linear", mutates_args=())
def fp8_linear(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    """x [..., K] (bf16/fp16/fp32), w_fp8 [N, K] e4m3fn, w_scale [N] fp32 -> [..., N], x's dtype."""
    return fp8_linear_reference(x, w_fp8, w_scale)


@fp8_linear.register_fake
def _fp8_linear_fake(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    return x.new_empty((*x.shape[:-1], w_fp8.shape[0]))


def _fp8_linear_cuda(x: Tensor, w_fp8: Tensor, w_scale: Tensor) -> Tensor:
    # Above MAX_ROWS this is not a decode shape; prefill quantizes its activations and calls
    # fuser::fp8_scaled_mm instead (fuser/ops/fp8_quant.py), so this fallback is the
    # reference's fp32 GEMM: correct, not fast.
    if _row_count(x) > MAX_ROWS:
        return fp8_linear_reference(x, w_fp8, w_scale)
    if _split_pieces_take(x):
        out = linear_pieces_triton(*split_pieces_triton(x), w_fp8, w_scale, out_dtype=x.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])
    return linear_triton(x, w_fp8, weight_scale=w_scale)


# fuser::fp8_linear splits several bf16 rows longer than this (down_proj's 14336 at the 8B
# shape) into e4m3 pieces before its GEMV. On an H200 at 5 rows the split kernel and the pieces
# GEMV took down_proj 23.96 us against 25.42 on the fp16 MMA, o_proj (K = 4096) 11.51 against
# 11.45: the split kernel's ~2 us launch eats a short row's gain.
SPLIT_PIECES_MIN_K = 8192


def _split_pieces_take(x: Tensor) -> bool:
    """Whether fuser::fp8_linear splits its rows into e4m3 pieces before the GEMV: 2..16
    bf16 rows of more than SPLIT_PIECES_MIN_K values."""
    rows = _row_count(x)
    return x.dtype == torch.bfloat16 and 1 < rows <= MAX_ROWS and x.shape[-1] > SPLIT_PIECES_MIN_K


fp8_linear.register_kernel("cuda")(_fp8_linear_cuda)


# ---------------------------------------------------------------------------------------------
# fuser::gated_linear, fuser::fp8_gated_linear: the same kernel over a merged gate/up weight
# [2I, K] with the gated activation in its epilogue (passes/gated_linear.py): one kernel, no
# [T, 2I] intermediate, no separate fuser::gated_act. CPU runs the unfused references.
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("fuser::gated_linear", mutates_args=())
def gated_linear(x: Tensor, weight: Tensor, activation: str) -> Tensor:
    """x [..., K], weight [2I, K] (gate rows, then up rows), x's dtype -> act(gate) * up [..., I]."""
    return gated_linear_reference(x, weight, activation)


@gated_linear.register_fake
def _gated_linear_fake(x: Tensor, weight: Tensor, activation: str) -> Tensor:
    check_gated(weight, activation)
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2))


def _gated_linear_cuda(x: Tensor, weight: Tensor, activation: str) -> Tensor:
    if _row_count(x) > MAX_ROWS or x.dtype != weight.dtype:
        return gated_linear_reference(x, weight, activation)
    return linear_triton(x, weight, activation=activation)


gated_linear.register_kernel("cuda")(_gated_linear_cuda)


def gated_linear_reference(x: Tensor, weight: Tensor, activation: str) -> Tensor:
    """gated_act(linear(x, weight)): the GEMM's [..., 2I] output rounded to x's dtype, then
    Hugging Face's act_fn(gate) * up on its halves (fuser/ops/gated_act.py)."""
    check_gated(weight, activation)
    return gated_act_reference(linear_reference(x, weight), activation).contiguous()


@torch.library.custom_op("fuser::fp8_gated_linear", mutates_args=())
def fp8_gated_linear(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    """x [..., K], w_fp8 [2I, K] e4m3fn (gate rows, then up rows), w_scale [2I] fp32
    -> act(gate) * up [..., I] in x's dtype."""
    return fp8_gated_linear_reference(x, w_fp8, w_scale, activation)


@fp8_gated_linear.register_fake
def _fp8_gated_linear_fake(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    check_gated(w_fp8, activation)
    return x.new_empty((*x.shape[:-1], w_fp8.shape[0] // 2))


def _fp8_gated_linear_cuda(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    if _row_count(x) > MAX_ROWS:  # not a decode shape: see _fp8_linear_cuda
        return fp8_gated_linear_reference(x, w_fp8, w_scale, activation)
    return linear_triton(x, w_fp8, weight_scale=w_scale, activation=activation)


fp8_gated_linear.register_kernel("cuda")(_fp8_gated_linear_cuda)


def fp8_gated_linear_reference(x: Tensor, w_fp8: Tensor, w_scale: Tensor, activation: str) -> Tensor:
    """gated_act(fp8_linear(x, w_fp8, w_scale)): each half's scale applied to its own rows
    (the one per-channel scale vector of the merged matrix), rounded to x's dtype, then
    act(gate) * up."""
    check_gated(w_fp8, activation)
    return gated_act_reference(fp8_linear_reference(x, w_fp8, w_scale), activation).contiguous()


# ---------------------------------------------------------------------------------------------
# fuser::rms_norm_linear, fuser::add_rms_norm_linear: the RMSNorm (and residual add) folded into
# the decode GEMV that reads its output (passes/norm_linear.py), over any of the four weights
# above: plain or FP8 (weight_scale), with or without the gated activation. Two ops, as
# rms_norm and add_rms_norm are two: the residual form also returns the sum, the other has none.
# CPU runs the unfused references; CUDA runs the separate kernels above MAX_ROWS or for mixed
# dtypes, so correctness never depends on shape.
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


def _norm_linear_fake_out(normed_dtype: torch.dtype, x: Tensor, weight: Tensor,
                          activation: str | None) -> Tensor:
    if activation is not None:
        check_gated(weight, activation)
    n = weight.shape[0] // 2 if activation is not None else weight.shape[0]
    return torch.empty((*x.shape[:-1], n), dtype=normed_dtype, device=x.device)


# Rows up to which the norm runs inside the GEMV on CUDA. One row (decode) measured faster
# fused; at 5 rows (verification, the MMA path) the fused kernels made the 8B verify step 1.40x
# the decode step in bf16 and 3.09x in FP8, against 1.09x and 1.48x with separate norm kernels
# (benchmarks/decode.py on the H200, 2026-12-01, RESULTS.md): there the op runs the norm kernel,
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


def rms_norm_linear_reference(x: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                              weight_scale: Tensor | None, activation: str | None) -> Tensor:
    """fuser::rms_norm's reference, then the linear's: what the two ops compute on CPU."""
    normed = rms_norm_reference(x, norm_weight, eps).contiguous()
    return linear_any_reference(normed, weight, weight_scale, activation)


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


def add_rms_norm_linear_reference(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float,
                                  weight: Tensor, weight_scale: Tensor | None,
                                  activation: str | None) -> tuple[Tensor, Tensor]:
    """fuser::add_rms_norm's reference, then the linear's: what the two ops compute on CPU."""
    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps)
    out = linear_any_reference(normed.contiguous(), weight, weight_scale, activation)
    return out, summed.contiguous()
