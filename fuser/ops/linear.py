"""A linear layer for decode: few rows of activations against a weight streamed once.

    linear(x, weight) = x @ weight.T       x: [M, K] (M <= MAX_ROWS), weight: [N, K] -> [M, N]

At batch 1 a decode step (M = 1) or a verification step (M = gamma + 1) is a matrix-vector
product: the weight is read once and each element is used M times, so the time is the weight's
bytes over the memory bandwidth. cuBLAS reaches that only for some shapes at M = 1 (measured on
an H200: ~42% of the read bandwidth for 4096 x 4096, ~58% for 6144 x 4096, ~98% for the
128256 x 4096 LM head), so the decode graphs call this kernel instead (passes/linear.py).

Triton implementation (`_linear_kernel`, launched by `_launch`): grid (cdiv(N, BLOCK_N),); one
program owns BLOCK_N output columns and walks K in BLOCK_K chunks, loading a [BLOCK_N, BLOCK_K]
tile of the weight (contiguous along K: coalesced, 16-byte loads) and the matching [M, BLOCK_K]
slice of x (small, from L2), and keeps fp32 accumulators. M = 1 multiplies and sums on the CUDA
cores, each thread adding its products into a partial per 16-byte run of columns that it
loads, the partials added across threads once after the K loop (fuser/ops/gemv_row.py); M > 1
uses an MMA with the rows padded to 16 (fuser/ops/gemv_rows.py: the matrix units have spare
throughput at these sizes, the kernel stays bound by the weight's bytes). Software pipelining
(num_stages) keeps several weight tiles in flight per program, which is what a memory-bound
stream needs. The tiles, split-K and MMA orientation come from fuser/ops/gemv_tables.py; one
row of bf16/fp16/fp32 weights runs fuser/ops/gemv_stream.py's kernel instead where it takes
the shape.

Several rows, swapped (`_default_swap`, where it measured faster): the weight tile is the MMA's
A operand and x its B, acc[BLOCK_N, BLOCK_M] += w . x.T (`_mma_swapped`), so BLOCK_N (64 or 128
weight rows) is the MMA's M dimension, which on sm_90 makes it a wgmma reading a bf16 tile from
shared memory as it was loaded (the unswapped 16-row MMA is an mma.sync fed by ldmatrix). The
accumulator keeps that layout through the split sum, the scale and the store; only the gated
epilogue transposes it.

Numerics: products and sums in fp32 (bf16/fp16 products are exact in fp32), one rounding to
the output dtype, as cuBLAS does; only the summation order differs.

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

The same kernel also takes FP8 weights (fuser/ops/fp8_linear.py), the RMSNorm in its
prologue (fuser/ops/norm_linear.py) and, at several rows, the residual add and the norm's sums
of squares in its epilogue (fuser/ops/norm_stats.py).

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
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops import gemv_stream
from fuser.ops.counters import split_counters
from fuser.ops.e4m3_pieces import _pow2
from fuser.ops.fp8 import FP8_DTYPE
from fuser.ops.gated_act import ACTIVATIONS, _gated_epilogue, gated_act_reference
from fuser.ops.gemv_row import _row_step, _rstd_last, _sum_splits, _w_tile
from fuser.ops.gemv_rows import (_residual_epilogue, _residual_tiles, _rows_k_step,
                                 _rstd_from_groups, _scale_product)
from fuser.ops.gemv_tables import (MAX_ROWS, ONE_ROW_NORM_K, PDL_PREFETCH, STAT_COLS,
                                   _default_config, _default_fp8_config, _default_split_k,
                                   _default_swap, _fit_shared_memory, _row_count, norm_after_for,
                                   rstd_last_for)
from fuser.ops.pdl import pdl_launch, wait_for_inputs
from fuser.ops.rmsnorm import _load_block


# ---------------------------------------------------------------------------------------------
# Triton kernel (its K steps and epilogues: fuser/ops/gemv_row.py, fuser/ops/gemv_rows.py)
# ---------------------------------------------------------------------------------------------


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
    NORM: tl.constexpr,         # the GEMV's input is rms_norm(h) * g, h = x (+ r)
                                # (fuser/ops/norm_linear.py)
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
                                # >= that): x is g * h, the GEMV's the norm's
                                # (fuser/ops/norm_stats.py)
    STAT_COLS: tl.constexpr = 16,
    MUL_RN: tl.constexpr = False,  # the scale's product rounded on its own (see _scale_product)
    NORM_AFTER: tl.constexpr = False,  # one row, NORM, no RSTD_LAST: the K loop's input is
                                # g * h rounded once, the row's rstd multiplies the sums after it
                                # (norm_stats' arithmetic; gemv_tables.ONE_ROW_NORM_AFTER)
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


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


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

    The other keyword arguments override the tuned defaults (tests, benchmarks/fp8_ops.py's
    sweep). block_n counts rows of `weight` per program either way: a gated
    program streams block_n / 2 gate rows and the block_n / 2 matching up rows in one tile, so
    the tuned tables (looked up at N = 2I, the merged weight's rows) keep their meaning: the
    same tile and the same number of programs as the unfused GEMV over the merged weight.
    """
    out, _ = _launch(x, None, None, 0.0, weight, weight_scale, activation,
                     (block_n, block_k, num_warps, num_stages, split_k, prefetch))
    return out


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
    norm_linear.rms_norm_linear_triton, linear_pieces_triton (pieces: x is hi, pieces (lo,
    inv_scale)), norm_stats.linear_residual_triton (epilogue (residual [M, N], g [N], gx out
    [M, N], squares out [M, cdiv(N, STAT_COLS)]): out is x @ W.T + residual, see EPI_RESIDUAL) and
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
# Custom ops: CPU (and any other device) runs the reference, CUDA runs the Triton kernel.
# fuser::gated_linear: the same kernel over a merged gate/up weight [2I, K] with the gated
# activation in its epilogue (passes/gated_linear.py): one kernel, no [T, 2I] intermediate,
# no separate fuser::gated_act.
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


@torch.library.custom_op("fuser::gated_linear", mutates_args=())
def gated_linear(x: Tensor, weight: Tensor, activation: str) -> Tensor:
    """x [..., K], weight [2I, K] (gate rows, then up rows), x's dtype
    -> act(gate) * up [..., I]."""
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


# ---------------------------------------------------------------------------------------------
# References
# ---------------------------------------------------------------------------------------------


def linear_reference(x: Tensor, weight: Tensor) -> Tensor:
    """x @ weight.T, as the captured graph computes it (aten.mm over a transposed weight)."""
    return torch.nn.functional.linear(x, weight)


def gated_linear_reference(x: Tensor, weight: Tensor, activation: str) -> Tensor:
    """gated_act(linear(x, weight)): the GEMM's [..., 2I] output rounded to x's dtype, then
    Hugging Face's act_fn(gate) * up on its halves (fuser/ops/gated_act.py)."""
    check_gated(weight, activation)
    return gated_act_reference(linear_reference(x, weight), activation).contiguous()
