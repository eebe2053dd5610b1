"""The decode GEMV's launch tables: tiles, split-K and MMA orientation by shape, and the
limits between its paths (fuser/ops/linear.py's _launch reads them; passes read MAX_ROWS and
prefers_cublas).

Each table entry is the fastest configuration measured on an H200 at the Llama-3-8B shapes
(qkv 6144 x 4096, o_proj 4096 x 4096, gate/up 28672 x 4096 merged, down_proj 4096 x 14336, the
LM head 128256 x 4096), at one row (decode) and at five (verification); the figures sit beside
the entries, and docs/performance-notes.md has the configurations and forms that lost.
"""

import torch
from torch import Tensor

MAX_ROWS = 16  # M above this is not a decode shape: the op falls back to the reference
STAT_COLS = 16  # columns per sum of squares that the residual epilogue hands the next norm
GEMV_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # x's dtypes the kernel takes


def _row_count(x: Tensor) -> int:
    """Rows of x [..., K] (its leading dims flattened; 0 for an empty K too)."""
    return x.numel() // max(x.shape[-1], 1)


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
# take x from the norm kernel as e4m3 pieces instead (fuser/ops/norm_linear.py), and
# fuser::fp8_linear splits rows longer than SPLIT_PIECES_MIN_K (down_proj) into pieces first
# (fuser/ops/fp8_linear.py): both on the FP8 MMA
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
