"""The one-row decode GEMV as a stream: `programs_per_sm` programs per SM, one wave, each over
a contiguous run of output columns and the whole of K, its weight tiles read through a pipeline
in registers.

    stream_gemv(x, weight, ...) = x @ weight.T     x: [1, K], weight: [N, K] -> [1, N]

with the same options and the same math as fuser/ops/linear.py's one-row path for weights in
x's dtype (the gated activation over a merged gate/up weight, the RMSNorm with or without the
residual add); it computes what `_linear_kernel` computes at BLOCK_M = 1, only the summation
order differs (K steps of another width). FP8 weights and several rows stay on
`_linear_kernel`: every stream configuration measured slower there (below).

Why another kernel. A decode step at batch 1 is a chain of short weight-streaming kernels (a
bf16 qkv GEMV at the 8B shape reads 50 MB: 11.8 us at the H200's 4.25 TB/s). `_linear_kernel`
gives each program BLOCK_N = 8-32 weight rows and launches hundreds of programs, 1.2-6 waves of
them: each program fills its pipeline from nothing, and at a kernel's end the last wave's
programs leave SMs idle. In a 16-layer chain of 8B GEMVs a layer took 70.2 us in FP8 against
51.3 us of weight bytes (73%) and 118.9 us in bf16 against 102.6 (86%): some 3-5 us per kernel
that do not shrink with the bytes. Here every SM gets the same share of the rows,
ROWS = cdiv(N, programs), so there is one wave and every SM streams the same bytes.

The pipeline. Triton software-pipelines (cp.async) only loads that feed a dot, so at one row a
program's loads are plain register loads. The K loop therefore keeps `depth` weight tiles in
flight itself: it is unrolled by depth, and each slot is summed and at once reloaded with the
step depth ahead, in place (rotating slots, `a, b = b, next`, copies registers whose load is
still in flight, and a copy waits for the load: measured, that pipeline held one tile). Every
slot's first tile loads before anything else.

PDL (fuser/ops/pdl.py). Those first tiles are weights, which no kernel of the step writes, so
they load before the program lets the next kernel launch (`griddepcontrol.launch_dependents`)
and waits for the previous one (`griddepcontrol.wait`); x is read after the wait. With two
programs per SM and 8 KB tiles the next GEMV's programs fit on the SMs beside the running ones,
so they are resident with their first tiles in flight while the running kernel streams its last
bytes. `StreamConfig.pdl` switches it for this kernel alone, apart from FUSER_PDL (a GPU test
holds a dependent chain of its launches, replayed in a CUDA graph, to the ordinary launch's
bits). Completion stays transitive: a program completes only after its wait returned.

Measured on an H200 (16 layers of 8B GEMVs in one CUDA graph): `DEFAULT` (2 programs per SM,
8 KB tiles, depth 4, PDL) 117.1 us a layer in bf16 against 120.0 for `_linear_kernel` (89.0% of
the read bandwidth against 86.8%); without PDL ~5% slower than with it. With FP8 weights every
configuration was slower than `_linear_kernel` (at best 89 us against 71): the per-step x
broadcast (two barriers of the whole program each K step in the sm_90 code) and cross-thread
reductions weigh twice as much per byte there. At 2..16 rows on the MMA every configuration was
slower too (bf16 66% of the bandwidth at best against 80%, FP8 37% against 41%;
docs/performance-notes.md).

Tile: [BLOCK_R, BLOCK_K] with BLOCK_R = next_pow2(ROWS) weight rows (gated: twice that, gate
rows then the matching up rows, as in _linear_kernel) and BLOCK_K = tile_bytes / (BLOCK_R * the
weight's element size), so a K step moves `tile_bytes` whatever the shape. The kernel is used
only where each row's run per step is at least MIN_RUN_BYTES (whole 32-byte sectors, 16-byte
loads): not the LM head (N = 128256: 972 rows a program), which _linear_kernel streams at ~100%.

Cost: as _linear_kernel at one row. Bytes = N * K * s_w + K * s_x (+ the norm prologue's x, r
re-read from L2 by every program) + N * s_out; FLOPs = 2 * N * K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from fuser.ops.gated_act import _gated_epilogue
from fuser.ops.gemv_tables import norm_after_for
from fuser.ops.pdl import gdc_launch_dependents, gdc_wait, pdl_launch, pdl_supported
from fuser.ops.rmsnorm import _load_block, _normalise

MIN_RUN_BYTES = 64  # bytes of one weight row per K step: two whole sectors, 16-byte loads
NORM_BLOCK = 8192   # the norm prologue sums x (+ r) in chunks of at most this many columns


@dataclass(frozen=True)
class StreamConfig:
    """How the stream GEMV is cut and launched.

    programs_per_sm: programs per SM (one wave); tile_bytes: weight bytes per K step and
    program; num_warps; depth: weight tiles in flight per program (1-4: a pipeline in
    registers, all loaded before the PDL wait); pdl: launch with PDL where the GPU supports it,
    whatever FUSER_PDL says (pdl=None: as FUSER_PDL says); wide: the configuration for shapes
    whose tile under this one reads each row only MIN_RUN_BYTES a K step; long_k: the
    configuration for K > LONG_K (both taken by `choose`).
    """

    programs_per_sm: int = 1
    tile_bytes: int = 16384
    num_warps: int = 8
    depth: int = 3
    pdl: bool | None = None
    wide: StreamConfig | None = None
    long_k: StreamConfig | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= 4:
            raise ValueError(f"depth={self.depth}: 1 to 4 tiles in flight")
        if self.programs_per_sm < 1 or self.tile_bytes < 256:
            raise ValueError(f"not a stream configuration: {self}")


# The one-row configuration: the fastest in a 16-layer chain of 8B-shape GEMVs on an H200:
# bf16 117.1 us a layer against _linear_kernel's 120.0 (89.0% of the read bandwidth against
# 86.8%). Its `wide` configuration takes the shapes whose 8 KB tile holds so many rows that each
# is read 64 bytes a step: the 8B gate/up (110 rows of a 128-row tile). Timed alone, 16 launches
# back to back: 57.15 us against 62.73 (98.0% of the read bandwidth against 89.3%; cuBLAS's
# plain GEMV, without the norm or the activation, 57.69); at qkv, o_proj and down_proj 16 KB
# tiles were no faster or slower. Its `long_k` configuration, 16 warps, takes K > LONG_K (the 8B
# down_proj, K = 14336): 28.08 us against 29.36 (98.5% of the read bandwidth against 94.2%),
# where qkv ran slower with 16 warps (22.5 against 15.9 us).
DEFAULT = StreamConfig(programs_per_sm=2, tile_bytes=8192, depth=4, pdl=True,
                       wide=StreamConfig(programs_per_sm=2, tile_bytes=16384, depth=2, pdl=True),
                       long_k=StreamConfig(programs_per_sm=2, tile_bytes=8192, depth=4,
                                           num_warps=16, pdl=True))
LONG_K = 8192

# The configuration linear.py uses at one row on CUDA; None leaves every one-row GEMV to
# _linear_kernel (tests compare the two; a CUDA graph keeps what it was captured with).
CONFIG: StreamConfig | None = DEFAULT


@dataclass(frozen=True)
class StreamPlan:
    """The launch a shape gets: ROWS output columns per program, the tile, the grid."""

    rows: int
    block_r: int
    block_k: int
    programs: int


def stream_plan(N: int, K: int, weight_bytes: int, gated: bool, config: StreamConfig,
                num_sms: int) -> StreamPlan | None:
    """The launch for N output columns (gated: over a [2N, K] merged weight), or None where the
    stream kernel does not take the shape: FP8 weights (weight_bytes 1: measured slower), or a
    program's rows too many for a K step of MIN_RUN_BYTES per row."""
    if weight_bytes == 1:
        return None
    rows = triton.cdiv(N, num_sms * config.programs_per_sm)
    block_r = triton.next_power_of_2(rows) * (2 if gated else 1)
    block_k = config.tile_bytes // (block_r * weight_bytes)
    if block_k * weight_bytes < MIN_RUN_BYTES:
        return None
    block_k = min(triton.next_power_of_2(block_k), triton.next_power_of_2(K))
    return StreamPlan(rows, block_r, block_k, triton.cdiv(N, rows))


def choose(N: int, K: int, weight_bytes: int, gated: bool, config: StreamConfig,
           num_sms: int) -> tuple[StreamConfig, StreamPlan] | None:
    """(the configuration, its plan) for a shape: `config`'s plan, or `config.wide`'s where
    config's tile would read each weight row only MIN_RUN_BYTES a K step, or `config.long_k`'s
    where K > LONG_K; None where the stream kernel does not take the shape (stream_plan)."""
    plan = stream_plan(N, K, weight_bytes, gated, config, num_sms)
    if plan is None:
        return None
    for other, wanted in ((config.wide, plan.block_k * weight_bytes <= MIN_RUN_BYTES),
                          (config.long_k, K > LONG_K)):
        if other is not None and wanted:
            other_plan = stream_plan(N, K, weight_bytes, gated, other, num_sms)
            if other_plan is not None:
                return other, other_plan
    return config, plan


@triton.jit
def _load_tile(w_rows, col_ok, k, K):
    """The weight tile at columns k (masked past K: a predicated-off load moves no bytes)."""
    return tl.load(w_rows + k[None, :], mask=col_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _load_x(x_ptr, r_ptr, g_ptr, k, K, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The raw input tiles at columns k: (x, residual, norm weight); without NORM the last two
    are x again (never used). Loaded a pipeline stage ahead, like the weight tile: a K step
    waits on no load from L2."""
    k_ok = k < K
    x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
    r = x
    g = x
    if NORM:
        g = tl.load(g_ptr + k, mask=k_ok, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + k, mask=k_ok, other=0.0)
    return x, r, g


@triton.jit
def _step(acc, w, x, r, g, rstd, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One K step over loaded tiles: acc + w . x in fp32 on the CUDA cores (linear.py's one-row
    step). With NORM, h = x (+ r) rounded to x's dtype and the input is g * (h * rstd).to(dtype)
    rounded once (what linear.py's _norm_x_tile forms, bit for bit)."""
    if NORM:
        h = x.to(tl.float32)
        if HAS_RESIDUAL:
            h = (h + r.to(tl.float32)).to(x.dtype).to(tl.float32)
        x = _normalise(h, rstd, g, x.dtype).to(x.dtype)
    return acc + tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)


@triton.jit
def _slot(acc, w, x, r, g, k, rstd, w_rows, col_ok, x_ptr, r_ptr, g_ptr, K,
          NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """One pipeline slot's K step: sum its tiles, then reload the slot in place with the tiles
    at columns k (the step DEPTH ahead). Returns (acc, w, x, r, g)."""
    acc = _step(acc, w, x, r, g, rstd, NORM, HAS_RESIDUAL)
    w = _load_tile(w_rows, col_ok, k, K)
    x, r, g = _load_x(x_ptr, r_ptr, g_ptr, k, K, NORM, HAS_RESIDUAL)
    return acc, w, x, r, g


@triton.jit
def _stream_kernel(
    x_ptr,                      # x: [1, K], x's dtype
    w_ptr,                      # weight: [N, K] ([2N, K] gated), row stride stride_wn
    out_ptr,                    # out: [1, N], x's dtype
    r_ptr, g_ptr, sum_ptr,      # residual [K], norm weight [K], summed [K] (NORM)
    N, K, ROWS, stride_wn, eps,
    BLOCK_R: tl.constexpr,      # weight rows per tile: next_pow2(ROWS), twice that if gated
    BLOCK_K: tl.constexpr,
    DEPTH: tl.constexpr,        # weight tiles in flight per program (1-4), all loaded
                                # before the PDL wait
    NORM_K: tl.constexpr,       # the norm prologue's chunk
    ACTIVATION: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
    NORM_AFTER: tl.constexpr = False,  # NORM: the input g * h rounded once, rstd times the sums
                                # after the loop (gemv_tables.ONE_ROW_NORM_AFTER)
):
    pid = tl.program_id(0)
    tile = tl.arange(0, BLOCK_R)
    if ACTIVATION == "":
        local = tile
        w_shift = tile * 0
    else:  # tile rows [0, HALF): gate rows; [HALF, BLOCK_R): the matching up rows, N further
        HALF: tl.constexpr = BLOCK_R // 2
        local = tile % HALF
        w_shift = tl.where(tile < HALF, 0, N)
    cols = pid * ROWS + local
    col_ok = (local < ROWS) & (cols < N)
    w_row = cols + w_shift
    w_rows = w_ptr + w_row[:, None].to(tl.int64) * stride_wn
    k0s = tl.arange(0, BLOCK_K)
    # The pipeline, in registers, DEPTH slots: slot j holds the tiles of K step i * DEPTH + j.
    # Every slot's weight tile loads now (weights only: nothing the previous kernel writes), its
    # x tiles after the wait. The loop, unrolled by DEPTH, sums each slot and at once reloads it
    # with the step DEPTH ahead, so DEPTH - 1 to DEPTH weight tiles are in flight and no step
    # waits on a load issued less than DEPTH - 1 steps before. A slot is consumed and reloaded
    # in place (never copied to another slot: a register copy of a tile still in flight would
    # wait for it). Steps past K are masked off: their loads move no bytes and add zeros.
    STEP: tl.constexpr = DEPTH * BLOCK_K
    wa = _load_tile(w_rows, col_ok, k0s, K)
    if DEPTH >= 2:
        wb = _load_tile(w_rows, col_ok, BLOCK_K + k0s, K)
    if DEPTH >= 3:
        wc = _load_tile(w_rows, col_ok, 2 * BLOCK_K + k0s, K)
    if DEPTH >= 4:
        wd = _load_tile(w_rows, col_ok, 3 * BLOCK_K + k0s, K)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    rstd = 0.0
    if NORM:  # a walk over the row for its squares; program 0 writes h
        squares = tl.zeros([NORM_K], dtype=tl.float32)
        for k0 in range(0, K, NORM_K):
            k = k0 + tl.arange(0, NORM_K)
            k_ok = k < K
            h = _load_block(x_ptr, r_ptr, sum_ptr, k, k_ok, HAS_RESIDUAL, False)
            if HAS_RESIDUAL:
                if pid == 0:  # one writer, never in place: the other programs read x and r
                    tl.store(sum_ptr + k, h.to(sum_ptr.dtype.element_ty), mask=k_ok)
            squares += h * h
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / K + eps)  # fp32, as rmsnorm.py
    row_rstd = rstd
    if NORM_AFTER:  # the loop's tiles: (h * 1).to(dtype) * g = g * h, rounded once
        rstd = rstd * 0.0 + 1.0
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    xa, ra, ga = _load_x(x_ptr, r_ptr, g_ptr, k0s, K, NORM, HAS_RESIDUAL)
    if DEPTH >= 2:
        xb, rb, gb = _load_x(x_ptr, r_ptr, g_ptr, BLOCK_K + k0s, K, NORM, HAS_RESIDUAL)
    if DEPTH >= 3:
        xc, rc, gc = _load_x(x_ptr, r_ptr, g_ptr, 2 * BLOCK_K + k0s, K, NORM, HAS_RESIDUAL)
    if DEPTH >= 4:
        xd, rd, gd = _load_x(x_ptr, r_ptr, g_ptr, 3 * BLOCK_K + k0s, K, NORM, HAS_RESIDUAL)
    for k0 in range(0, K, STEP):
        k = k0 + STEP + k0s  # slot a's next step
        acc, wa, xa, ra, ga = _slot(acc, wa, xa, ra, ga, k, rstd, w_rows, col_ok, x_ptr, r_ptr,
                                    g_ptr, K, NORM, HAS_RESIDUAL)
        if DEPTH >= 2:
            acc, wb, xb, rb, gb = _slot(acc, wb, xb, rb, gb, k + BLOCK_K, rstd, w_rows, col_ok,
                                        x_ptr, r_ptr, g_ptr, K, NORM, HAS_RESIDUAL)
        if DEPTH >= 3:
            acc, wc, xc, rc, gc = _slot(acc, wc, xc, rc, gc, k + 2 * BLOCK_K, rstd, w_rows,
                                        col_ok, x_ptr, r_ptr, g_ptr, K, NORM, HAS_RESIDUAL)
        if DEPTH >= 4:
            acc, wd, xd, rd, gd = _slot(acc, wd, xd, rd, gd, k + 3 * BLOCK_K, rstd, w_rows,
                                        col_ok, x_ptr, r_ptr, g_ptr, K, NORM, HAS_RESIDUAL)
    if NORM_AFTER:
        acc *= row_rstd
    out_dtype = out_ptr.dtype.element_ty
    if ACTIVATION != "":
        acc = _gated_epilogue(acc, HALF, 1, ACTIVATION, out_dtype)
        local = tl.arange(0, HALF)
        cols = pid * ROWS + local
        col_ok = (local < ROWS) & (cols < N)
    tl.store(out_ptr + cols, acc.to(out_dtype), mask=col_ok)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def stream_gemv(x: Tensor, weight: Tensor, out: Tensor, plan: StreamPlan, config: StreamConfig,
                *, activation: str | None = None, residual: Tensor | None = None,
                norm_weight: Tensor | None = None, eps: float = 0.0,
                summed: Tensor | None = None) -> None:
    """Launch the stream kernel: out [1, N] (contiguous) = the GEMV of x [1, K] (unit column
    stride) and a bf16/fp16/fp32 weight [N, K] as fuser/ops/linear.py's _launch defines it, by
    `plan` (stream_plan). With norm_weight the input is rms_norm(x (+ residual)) and summed
    [1, K] receives x + residual."""
    M, K = x.shape
    N = out.shape[-1]
    if M != 1 or weight.element_size() == 1:
        raise ValueError(f"the stream GEMV takes one row and a weight of 2 or 4 bytes a value "
                         f"(FP8 weights and several rows run _linear_kernel), got {M} rows and "
                         f"a {weight.dtype} weight")
    norm = norm_weight is not None
    if config.pdl is None:
        pdl = pdl_launch(x.device, one_row=True)
    else:
        pdl = {"launch_pdl": True} if config.pdl and pdl_supported(x.device) else {}
    _stream_kernel[(plan.programs,)](
        x, weight, out,
        residual if residual is not None else x, norm_weight if norm else x,
        summed if summed is not None else x,
        N, K, plan.rows, weight.stride(0), eps,
        BLOCK_R=plan.block_r, BLOCK_K=plan.block_k, DEPTH=config.depth,
        NORM_K=min(triton.next_power_of_2(K), NORM_BLOCK),
        ACTIVATION=activation or "", NORM=norm, HAS_RESIDUAL=residual is not None, PDL=bool(pdl),
        NORM_AFTER=norm and norm_after_for(M, residual is not None, False, False),
        num_warps=config.num_warps, num_stages=1, **pdl,
    )
