"""Why the 5-row FP8 GEMV streams at ~55% of the read bandwidth: the weight's conversion or not.

    python3 benchmarks/fp8_rows_lab.py [--rows 5] [--shapes qkv,o_proj,gate_up,down]
                                       [--variants ...] [--out f.json] [--jobs N]
    python3 benchmarks/fp8_rows_lab.py --compile-only      # no GPU needed: sm_90 SASS counts

The engine's several-row FP8 path (fuser/ops/linear.py, `_linear_kernel` with SWAP and F16_MMA)
puts the e4m3 weight tile [BLOCK_N, BLOCK_K] in the MMA's A operand, widens it to fp16 in
registers with Triton's e4m3 -> f16 conversion (cvt.rn.f16x2.e4m3x2, F2FP in SASS), feeds x as
fp16 scaled by a power of two per row (`_f16_step`, which rescales the accumulator as the row's
max grows) and runs an fp16 wgmma with fp32 accumulators. On an H200 it reaches ~55% of the read
bandwidth at M = 5, against ~90% for bf16 weights at 5 rows and ~80% for FP8 at one row. The
variants here keep that structure and change one thing at a time (one kernel, `_rows_kernel`,
keyed by WEIGHT, how the weight tile reaches the MMA, and X, what x is; VARIANTS lists them):

  default           linear_triton(x, w_fp8, weight_scale=s): the engine's path, as it runs
  f16 cvt           this lab's kernel with the engine's conversion and x handling: the control
                    (should time like default; if not, the lab's structure differs somewhere)
  f16 bits asm      the conversion by bit manipulation (below), inline PTX, 4 weights a call
  f16 bits int      the same formula in plain Triton on the uint8 tile (what the compiler makes)
  f16 bits words    the same on int32 words (4 weights each), bytes placed by shifts and masks
  ... prepass       x's per-row power of two from a first pass over the program's K range
                    (x is small and in L2), fixed for the K loop: no accumulator rescale per step
  ... x16           x converted to fp16 (times 2^shift per row) outside the kernel
  a8 ceiling        x quantized to e4m3 per row outside (scale amax / 448), FP8 x FP8 wgmma with
                    the weight tile straight from shared memory, no conversion: a speed ceiling
                    only (x carries up to 2^-4 relative error: other numerics)
  a8 x2             x split outside into two e4m3 pieces, hi = e4m3(x / s_hi),
                    lo = e4m3((x - hi s_hi) / s_lo), each scale amax / 448 of its row; two FP8
                    dots a K step into two fp32 accumulators, out = (acc_hi s_hi + acc_lo s_lo)
                    * w_scale: up to ~2^-8 relative error in x (tests/test_fp8_rows_lab.py)
  x2 pieces         x split outside exactly as the engine's "x2" splits it inside
                    (linear._x2_step, one power of two 2^t per row here): hi = x 2^t cut to 4
                    significant bits, lo = the rest; lo's dot then hi's onto it from zero each K
                    step, added to an fp32 accumulator (the promotion the H100's FP8 MMA needs):
                    what a producer handing the GEMV x in pieces would give it
  x2 pieces chained the same pieces, both dots chained in the MMA's accumulator over all of K (no
                    promotion: the FP8 MMA's own accumulation, fewer bits; its err column shows)

The bit conversion: for an e4m3fn byte b (never NaN: weights are clamped to +-448), the fp16
with bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) is value(b) * 2^-8 exactly, normals and
subnormals alike (e4m3's 4 exponent bits land in fp16's low 4, its 3 mantissa bits in fp16's top
3; the biases, 7 and 15, differ by 8). The 2^8 joins the per-row weight scale. On a 32-bit word
of four bytes [b3 b2 b1 b0] (_E4M3_TO_F16X2_ASM, 7 instructions for 4 weights):
    m = w & 0x7F7F7F7F;  r = m >> 1          byte i: mag_i >> 1 (bit 6 clear), bit 7 junk
    h = lop3(r, w, 0x80808080: c ? w : r)    byte i: sign_i | mag_i >> 1  (fp16 high byte)
    l = (w << 7) & 0x80808080                byte i: (b_i & 1) << 7      (fp16 low byte)
    out0 = prmt(l, h, 0x5140) = [h1 l1 h0 l0], out1 = prmt(l, h, 0x7362) = [h3 l3 h2 l2]
against 2 cvt.rn.f16x2.e4m3x2 (F2FP.F16.E4M3.UNPACK_B) for 4 weights on the engine's path.

Timing: each shape is a chain of weight copies (~400 MB, more than the L2 holds) captured in one
CUDA graph (benchmarks/timing.py replay_median_ms), as benchmarks/fp8_mma_lab.py does. Every
configuration is compiled first by --jobs worker processes (Triton's compiler holds the GIL:
threads do not help), which fill Triton's on-disk cache; the timed process then loads them.
Per variant and shape: block_n 64/128 x block_k 128/256 x the split-K counts that give 128 to
1024 programs, at 4 stages, then 3 and 5 stages for the fastest; the report prints the fastest:
us per GEMV, TB/s of weight and scale bytes (N K + 4 N), % of the measured HBM read bandwidth,
and the max relative error against x.double() @ (w_fp8.double() * scale[:, None]).T normalised
by the reference's max |.| (bf16 outputs: the "bf16 floor" line is the reference's own rounding
to bf16, which every exact kernel shares). M = 1's linear_triton default comes first per shape
as the reference point. --out writes every timed configuration.

Findings, offline compile (`--compile-only` on a CPU machine: Triton 3.9.0, ptxas 13.4 for
sm_90a; gate_up N = 28672, K = 4096, block_n 64, block_k 128, split 1, 4 stages, 4 warps; static
instruction counts of the whole kernel's SASS, the pipelined loop's prologue included; registers
and ptxas' own notes from `ptxas -v`). No GPU has run any of this yet.
    block_n x block_k = 64 x 128                  128 x 128
    variant               K-loop instr  issue  regs    K-loop instr  issue  regs
    default (engine)           280       29.3   118         399       41.1   175
    f16 cvt (control)          272       30.1   115         379       43.2   173
    f16 cvt prepass            214       38.3    94         311       52.7   167
    f16 cvt x16                199       41.2    76 *       320       51.2   152 *
    f16 bits asm               467       17.5    92         760       21.6   168
    f16 bits asm prepass       406       20.2    87         692       23.7   165
    f16 bits asm x16           394       20.8    71 *       724       22.6   131 *
    f16 bits int               624       13.1   127        1083       15.1   168
    f16 bits words             502       16.3    92         838       19.6   135
    a8 ceiling                  86       95.3    34         120      136.5    54
    a8 x2                      106       77.3    48         161      101.8    72
  "issue": weights per SM clock if the SM only issued the K loop (4 schedulers, one warp
  instruction each a clock); the H200's HBM asks ~18 (4.8 TB/s over 132 SMs at 1.98 GHz), so
  a loop near 30 leaves the SM busy ~60% of the time issuing even with perfect overlap.
  * ptxas C7515 "wgmma.mma_async instructions are serialized due to non wgmma instructions
  defining accumulator registers": with x prepared outside, Triton pipelines the wgmma one step
  deep (wait_group 1) and ptxas then serializes all of them (WARPGROUP.ARRIVE per HGMMA).
  What the SASS shows, per 64 x 128 step and thread (64 weights):
  - The weight tile reaches registers as 32 LDS.U16 (two bytes a load: the wgmma A-operand
    layout has kWidth = 2), in every f16 variant, and was copied in by 8-byte cp.async
    (LDGSTS.E.64: the shared layout's swizzle vector is 8 bytes); a8 copies 16-byte
    (LDGSTS.128) into the 128-byte-swizzled layout the wgmma reads, no LDS.
  - cvt: 32 F2FP.F16.E4M3.UNPACK_B, one per two weights, fed straight by the u16 loads.
  - bits asm: the 7 PTX instructions per 4 weights become ~12: pack = 4 needs the 4 bytes in
    one register, and LLVM assembles them from two u16 loads byte by byte (PRMT 0x7770/0x7771,
    0x3340, 0x5410): PRMT 152, LOP3 48, SHF 19 against F2FP 32. In this layout no integer
    sequence can beat one F2FP per 2 weights on instruction count; only an F2FP issue rate far
    below the integer pipes' would let it win (the GPU run decides).
  - bits int: LLVM widens byte by byte (PRMT 200); bits words: loads 16 bytes (LDS.128) but
    the fp16 tile then takes a trip through shared memory (STS + LDSM) to the A layout.
  - _f16_step's per-step x handling (amax, shuffles, accumulator rescale, fp16 stores of x
    for the wgmma's B, barriers) is 272 - 199 = 73 of cvt's 272 instructions; a prepass
    shift (same numerics rule, per split) removes 58 of them.
  - a8 x FP8: 86-106 instructions a step, QGMMA from shared memory descriptors, 34-48
    registers: the conversion-free ceiling is cheap to issue.
  Offline verdict (to be checked on the H200): the bit trick adds instructions here; what the
  FP8 path pays is instruction issue (conversion + u16 loads + x handling) per weight.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fuser.ops.fp8 import quantize_rows, quantize_weight  # noqa: E402
from fuser.ops.e4m3_pieces import split_pieces_reference, split_pieces_triton  # noqa: E402
from fuser.ops.linear import _f16_step, _pow2, _sum_splits, linear_pieces_triton  # noqa: E402
from fuser.ops.linear import linear_triton  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
DRY_SHAPES = {"tiny": (160, 512)}  # --dry-run: the plumbing on CPU under TRITON_INTERPRET=1

# name -> (WEIGHT, X): how the weight tile reaches the MMA, what x is (see _rows_kernel)
VARIANTS = {
    "f16 cvt": ("cvt", "shift"),
    "f16 cvt prepass": ("cvt", "prepass"),
    "f16 cvt x16": ("cvt", "f16"),
    "f16 bits asm": ("asm", "shift"),
    "f16 bits asm prepass": ("asm", "prepass"),
    "f16 bits asm x16": ("asm", "f16"),
    "f16 bits int": ("int", "shift"),
    "f16 bits words": ("words", "shift"),
    "a8 ceiling": ("fp8", "a8"),
    "a8 x2": ("fp8", "a8x2"),
    "x2 pieces": ("fp8", "x2p"),
    "x2 pieces chained": ("fp8", "x2c"),
}
# name -> linear.FP8_ROWS_MMA: the engine's kernel (linear_triton) with the sweep's tiles
ENGINE_VARIANTS = {"engine f16": "f16", "engine x2": "x2", "engine pieces": "pieces",
                   "engine split pieces": "split pieces"}
DEFAULT_VARIANTS = ["default", "f16 cvt", "f16 cvt prepass", "f16 cvt x16", "f16 bits asm",
                    "f16 bits asm prepass", "f16 bits asm x16", "f16 bits int", "a8 ceiling",
                    "a8 x2"]
BITS_FACTOR = 256.0  # the bit conversion gives value(b) * 2^-8: its 2^8 joins the row's scale

# Four e4m3fn bytes in one b32 ($2, byte 0 = the first weight) -> four fp16 of value * 2^-8 in
# two f16x2 registers ($0: weights 0 and 1, $1: weights 2 and 3); the steps are in the module
# docstring. lop3's table 0xD8 = (b & c) | (a & ~c) for a = 0xF0, b = 0xCC, c = 0xAA; prmt's
# selector nibbles pick bytes of {h, l} (4-7: h's, 0-3: l's), lowest result byte first.
_E4M3_TO_F16X2_ASM = tl.constexpr("""{
.reg .b32 m, r, h, l;
and.b32 m, $2, 0x7F7F7F7F;
shr.u32 r, m, 1;
lop3.b32 h, r, $2, 0x80808080, 0xD8;
shl.b32 l, $2, 7;
and.b32 l, l, 0x80808080;
prmt.b32 $0, l, h, 0x5140;
prmt.b32 $1, l, h, 0x7362;
}""")


@triton.jit
def _bits_asm(w):
    """w: e4m3fn codes as uint8 [..] -> fp16 [..] of value * 2^-8, by _E4M3_TO_F16X2_ASM."""
    return tl.inline_asm_elementwise(_E4M3_TO_F16X2_ASM, "=r,=r,r", [w], dtype=tl.float16,
                                     is_pure=True, pack=4)


@triton.jit
def _bits_int(w):
    """w: e4m3fn codes as uint8 [..] -> fp16 [..] of value * 2^-8: the formula in Triton."""
    b = w.to(tl.uint16)
    return (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def _bits_words(w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """w: [BLOCK_N, BLOCK_K // 4] int32 words of 4 e4m3fn codes each (byte 0 first) -> fp16
    [BLOCK_N, BLOCK_K] of value * 2^-8: _E4M3_TO_F16X2_ASM's steps in Triton, the bytes placed
    by shifts and masks instead of prmt, the halves split off and interleaved back by join."""
    u = w.to(tl.uint32, bitcast=True)
    h = (((u & 0x7F7F7F7F) >> 1) & 0x7F7F7F7F) | (u & 0x80808080)   # byte i: fp16 high byte
    lo = (u << 7) & 0x80808080                                        # byte i: fp16 low byte
    out0 = (lo & 0xFF) | ((h & 0xFF) << 8) | ((lo & 0xFF00) << 8) | ((h & 0xFF00) << 16)
    out1 = ((lo >> 16) & 0xFF) | ((h >> 8) & 0xFF00) | ((lo >> 8) & 0xFF0000) | (h & 0xFF000000)
    e0 = (out0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    e1 = (out0 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    e2 = (out1 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    e3 = (out1 >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    # join stacks on a new last axis: [..., i, j] = (e0, e1, e2, e3)[2 i + j] in flat order
    both = tl.join(tl.join(e0, e2), tl.join(e1, e3))          # [BLOCK_N, BLOCK_K // 4, 2, 2]
    return tl.reshape(both, [BLOCK_N, BLOCK_K])


@triton.jit
def _dot_swapped(acc, w, x, FP32_DOTS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + w [BLOCK_N, BLOCK_K] . x [BLOCK_M, BLOCK_K].T (w, x: one dtype;
    fp16 or e4m3 products are exact in fp32)."""
    if FP32_DOTS:  # TRITON_INTERPRET: its low-precision dots are not exact
        return acc + tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _rows_kernel(
    x_ptr,              # x: [M, K], row stride stride_xm: bf16 (X "shift", "prepass"), fp16
                        # x 2^shift ("f16"), e4m3fn codes ("a8"), the hi piece ("a8x2")
    x_lo_ptr,           # "a8x2": the lo piece, [M, K] e4m3fn like x (else unused)
    xs_ptr,             # [2, M] fp32: "f16": 2^-shift; "a8": the scale; "a8x2": s_hi, s_lo
    w_ptr,              # weight: [N, K] e4m3fn ("cvt", "fp8"), the same bytes as uint8 ("asm",
                        # "int") or int32 words [N, K / 4] ("words"); row stride stride_wn
    ws_ptr,             # w_scale: [N] fp32
    out_ptr,            # out: [M, N], row stride stride_om
    part_ptr,           # SPLIT_K > 1: fp32 [programs, SPLIT_K, BLOCK_N * BLOCK_M]
    count_ptr,          # SPLIT_K > 1: int32 [programs], zero between calls
    M, N, K,            # K: weights per row
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr,      # 16: x's rows padded, the MMA's N
    BLOCK_N: tl.constexpr,      # weight rows per program: the MMA's M (64 or 128)
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,      # programs per column block, summed in the launch (_sum_splits)
    WEIGHT: tl.constexpr,       # "cvt": Triton's e4m3 -> fp16; "asm" / "int" / "words": the
                                # bit conversion (value * 2^-8); "fp8": none (FP8 MMA)
    X: tl.constexpr,            # "shift": _f16_step's running per-row shift; "prepass": the
                                # shift from a first pass over K; "f16": fp16 prepared outside;
                                # "a8" / "a8x2": e4m3 x
    FP32_DOTS: tl.constexpr,
):
    pid = tl.program_id(0)
    k_lo = tl.multiple_of(tl.program_id(1) * (K // SPLIT_K), 16)   # the launcher makes SPLIT_K
    k_hi = k_lo + K // SPLIT_K                                       # * BLOCK_K divide K
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m[:, None] * stride_xm                          # [BLOCK_M, 1]
    x_lo_rows = x_lo_ptr + m[:, None] * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn             # [BLOCK_N, 1]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)          # "a8x2"
    shift = tl.full([BLOCK_M], 100, dtype=tl.int32)  # "shift", "prepass": acc = sums 2^shift
    if X == "prepass":  # _f16_step's bound (max |x| 2^shift < 2^15) over this split's K at once
        amax = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = tl.load(x_rows + (k0 + offs_k)[None, :], mask=m_ok[:, None], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        exponent = (tl.max(amax, axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
        shift = tl.minimum(141 - exponent, 100)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        if WEIGHT == "words":
            w = tl.load(w_rows + (k0 // 4 + tl.arange(0, BLOCK_K // 4))[None, :],
                        mask=n_ok[:, None], other=0)
            w = _bits_words(w, BLOCK_N, BLOCK_K)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
            if WEIGHT == "asm":
                w = _bits_asm(w)
            elif WEIGHT == "int":
                w = _bits_int(w)
            elif WEIGHT == "cvt":
                w = w.to(tl.float16)
        x = tl.load(x_rows + k[None, :], mask=m_ok[:, None], other=0.0)
        if X == "shift":
            acc, shift = _f16_step(acc, shift, w, x, FP32_DOTS)
        elif X == "prepass":
            x = (x.to(tl.float32) * _pow2(shift)[:, None]).to(tl.float16)
            acc = _dot_swapped(acc, w, x, FP32_DOTS)
        elif X != "x2p" and X != "x2c":
            acc = _dot_swapped(acc, w, x, FP32_DOTS)
        if X == "a8x2":
            x_lo = tl.load(x_lo_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            acc_lo = _dot_swapped(acc_lo, w, x_lo, FP32_DOTS)
        elif X == "x2p":  # lo, then hi onto it, from zero; promoted to acc in fp32
            x_lo = tl.load(x_lo_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            part = _dot_swapped(tl.zeros_like(acc), w, x_lo, FP32_DOTS)
            acc += _dot_swapped(part, w, x, FP32_DOTS)
        elif X == "x2c":  # lo and hi chained in the MMA's accumulator
            x_lo = tl.load(x_lo_rows + k[None, :], mask=m_ok[:, None], other=0.0)
            acc = _dot_swapped(_dot_swapped(acc, w, x_lo, FP32_DOTS), w, x, FP32_DOTS)
    # One accumulator of plain sums per split before the split sum (everything here is linear).
    if X == "shift" or X == "prepass":
        acc *= _pow2(-shift)[None, :]
    else:
        acc *= tl.load(xs_ptr + m, mask=m_ok, other=0.0)[None, :]
    if X == "a8x2":
        acc += acc_lo * tl.load(xs_ptr + M + m, mask=m_ok, other=0.0)[None, :]
    if SPLIT_K > 1:
        acc, last = _sum_splits(acc, part_ptr, count_ptr, pid, BLOCK_N * BLOCK_M, SPLIT_K)
    scale = tl.load(ws_ptr + n, mask=n_ok, other=0.0)
    if WEIGHT == "asm" or WEIGHT == "int" or WEIGHT == "words":
        scale *= 256.0                                               # BITS_FACTOR
    acc *= scale[:, None]
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:  # only the program that summed the splits writes
        ok = ok & (tl.zeros_like(ok.to(tl.int32)) + last.to(tl.int32) != 0)
    tl.store(out_ptr + m[None, :] * stride_om + n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=ok)


# --- host side -----------------------------------------------------------------------------


def prepare_x(x: torch.Tensor, X: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] bf16 -> (x for the kernel, the lo piece or x again, xs [2, M] fp32) for X,
    computed outside the kernel (not timed).

    "f16": x 2^s in fp16 with s = min(141 - biased exponent of the row's max |x|, 100), so that
    max |x| 2^s < 2^15 (_f16_step's rule over the whole row), xs = 2^-s: exact unless a value is
    below the row's max by more than ~2^28 (fp16's subnormal step). "a8": quantize_rows(x).
    "a8x2": hi, s_hi = quantize_rows(x); lo, s_lo = quantize_rows(x - hi s_hi), the residual
    formed in fp32. "x2p" / "x2c": linear._x2_step's pieces with one power of two per row,
    xs[0] = 2^-t (exact: hi + lo = x 2^t for values within ~2^10 of the row's max)."""
    M = x.shape[0]
    xs = torch.ones(2, M, device=x.device, dtype=torch.float32)
    if X in ("shift", "prepass"):
        return x, x, xs
    if X == "f16":
        amax = x.float().abs().amax(dim=1)                                   # [M]
        exponent = (amax.view(torch.int32) >> 23) & 0xFF
        s = torch.clamp(141 - exponent, max=100).to(torch.float32)
        xs[0] = torch.exp2(-s)
        return (x.float() * torch.exp2(s)[:, None]).to(torch.float16), x, xs
    if X in ("x2p", "x2c"):  # the engine's split (fuser/ops/e4m3_pieces.py)
        hi, lo, xs[0] = split_pieces_reference(x)
        return hi, lo, xs
    hi, xs[0] = quantize_rows(x)
    if X == "a8":
        return hi, hi, xs
    lo, xs[1] = quantize_rows(x.float() - hi.float() * xs[0][:, None])
    return hi, lo, xs


def weight_view(w: torch.Tensor, WEIGHT: str) -> torch.Tensor:
    """The e4m3fn weight [N, K] as the kernel's WEIGHT reads it (a view, no copy)."""
    if WEIGHT in ("asm", "int"):
        return w.view(torch.uint8)
    if WEIGHT == "words":
        return w.view(torch.int32)                                           # [N, K / 4]
    return w


class EngineGemv:
    """linear_triton (the engine's several-row path) with one FP8_ROWS_MMA and a configuration
    given (block_n, block_k, split_k, stages); called as RowsGemv is, but returns the op's own
    output: copying it into `out` would time a copy kernel too (until the nineteenth session it
    did, ~1-2 us that the sixteenth session read as the engine's kernel being slower than
    _rows_kernel's "x2 pieces"). x is the bf16 x itself
    (prepare_x's "shift" triple: the kernel prepares it). "engine pieces": linear_pieces_triton
    on x split outside (fuser/ops/e4m3_pieces.py, untimed: what the norm kernel would hand it);
    "engine split pieces": split_pieces_triton then linear_pieces_triton, both timed."""

    def __init__(self, variant: str, block_n: int, block_k: int, split_k: int, stages: int):
        self.mma = ENGINE_VARIANTS[variant]
        self.overrides = dict(block_n=block_n, block_k=block_k, split_k=split_k,
                              num_stages=stages)
        self.pieces: tuple | None = None  # (x, its pieces): split once per x

    def __call__(self, xp: tuple, w: torch.Tensor, ws: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        from fuser.ops import linear as linear_module  # noqa: PLC0415

        if self.mma == "split pieces":  # the split kernel timed with the GEMV
            return linear_pieces_triton(*split_pieces_triton(xp[0]), w, ws, **self.overrides)
        if self.mma == "pieces":
            if self.pieces is None or self.pieces[0] is not xp[0]:
                self.pieces = (xp[0], split_pieces_reference(xp[0]))
            return linear_pieces_triton(*self.pieces[1], w, ws, **self.overrides)
        saved, linear_module.FP8_ROWS_MMA = linear_module.FP8_ROWS_MMA, self.mma
        try:
            return linear_triton(xp[0], w, weight_scale=ws, **self.overrides)
        finally:
            linear_module.FP8_ROWS_MMA = saved


def make_gemv(N: int, K: int, variant: str, cfg: tuple, device) -> RowsGemv | EngineGemv:
    """The callable that runs `variant` at configuration cfg (block_n, block_k, split_k,
    stages)."""
    if variant in ENGINE_VARIANTS:
        return EngineGemv(variant, *cfg)
    return RowsGemv(N, K, variant, *cfg, device=device)


class RowsGemv:
    """One configuration of _rows_kernel for one shape, with its split-K buffers."""

    def __init__(self, N: int, K: int, variant: str, block_n: int, block_k: int, split_k: int,
                 stages: int, device: torch.device | str, warps: int = 4):
        if K % (split_k * block_k):
            raise ValueError(f"split_k * block_k = {split_k * block_k} does not divide K = {K}")
        self.weight_mode, self.x_mode = VARIANTS[variant]
        self.cfg = (block_n, block_k, split_k, stages, warps)
        grid_n = triton.cdiv(N, block_n)
        self.grid = (grid_n, split_k)
        self.part = torch.empty(grid_n * split_k * block_n * 16, device=device,
                                dtype=torch.float32)
        self.count = torch.zeros(grid_n, device=device, dtype=torch.int32)

    def __call__(self, xp: tuple, w: torch.Tensor, ws: torch.Tensor,
                 out: torch.Tensor) -> torch.Tensor:
        """xp: prepare_x's triple; w: [N, K] e4m3fn; ws: [N] fp32; out: [M, N] (any float)."""
        block_n, block_k, split_k, stages, warps = self.cfg
        x, x_lo, xs = xp
        M, K = x.shape
        wv = weight_view(w, self.weight_mode)
        _rows_kernel[self.grid](
            x, x_lo, xs, wv, ws, out, self.part, self.count, M, w.shape[0], K,
            x.stride(0), wv.stride(0), out.stride(0), BLOCK_M=16, BLOCK_N=block_n,
            BLOCK_K=block_k, SPLIT_K=split_k, WEIGHT=self.weight_mode, X=self.x_mode,
            FP32_DOTS=x.device.type != "cuda", num_warps=warps, num_stages=stages)
        return out


def reference(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """x.double() @ (w_fp8.double() * scale[:, None]).T: [M, N] float64."""
    return x.double() @ (w.double() * ws.double()[:, None]).T


def max_rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|."""
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def splits_for(N: int, K: int, block_n: int, block_k: int) -> list[int]:
    """Split-K counts to try: those giving 128 to 1024 programs (~1 to 8 per SM of an H200's
    132), else the largest that divides."""
    grid_n = triton.cdiv(N, block_n)
    ok = [s for s in (1, 2, 4) if K % (s * block_k) == 0]
    inside = [s for s in ok if 128 <= grid_n * s <= 1024]
    return inside or [max(ok)]


def first_configs(N: int, K: int) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, split_k, stages) of the sweep's first round (4 stages)."""
    return [(bn, bk, s, 4) for bn in (64, 128) for bk in (128, 256)
            for s in splits_for(N, K, bn, bk)]


# --- offline: compile every variant for sm_90 and count instructions -------------------------


COUNTED = {  # column -> (SASS pattern, PTX pattern)
    "F2FP.E4M3": (r"\bF2FP\.[A-Z0-9_.]*E4M3", r"\bcvt\.rn\.f16x2\.e4m3x2\b"),
    "PRMT": (r"\bPRMT\b", r"\bprmt\.b32\b"),
    "LOP3": (r"\bLOP3\.", r"\blop3\.b32\b"),
    "SHF": (r"\bSHF\.", r"\bsh[lr]\.b32\b"),
    "LDS": (r"\bLDS(?:\.[A-Z0-9]+)*\b", r"\bld\.shared\b"),
    "LDS.U16": (r"\bLDS\.U16\b", r"\bld\.shared\.b16\b"),
    "LDSM": (r"\bLDSM\.", r"\bldmatrix\b"),
    "STS": (r"\bSTS(?:\.[A-Z0-9]+)*\b", r"\bst\.shared\b"),
    "HGMMA": (r"\bHGMMA\.", r"\bwgmma\.mma_async[^;]*\.f16\.f16\b"),
    "QGMMA": (r"\bQGMMA\.", r"\bwgmma\.mma_async[^;]*\.e4m3\.e4m3\b"),
    "WG.ARRIVE": (r"\bWARPGROUP\.ARRIVE\b", r"\bwgmma\.fence\b"),
}


def _cubin_registers(cubin: bytes) -> int | None:
    """Registers per thread of the cubin's one kernel: its EIATTR_REGCOUNT (attribute 0x2f) in
    the ELF's .nv.info section, entries (format 0x04, attribute, u16 size, payload), payload
    (u32 symbol, u32 count); what `ptxas -v` prints as "Used N registers"."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:  # 64-bit ELF
        return None
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)
               for i in range(shnum)]
    strtab = headers[shstrndx][4]
    for sh_name, _type, _flags, _addr, offset, size, *_ in headers:
        if cubin[strtab + sh_name:cubin.index(b"\0", strtab + sh_name)] != b".nv.info":
            continue
        i = offset
        while i < offset + size:
            fmt, attr = cubin[i], cubin[i + 1]
            if fmt != 0x04:  # no payload
                i += 4
                continue
            length, = struct.unpack_from("<H", cubin, i + 2)
            if attr == 0x2F:
                return struct.unpack_from("<I", cubin, i + 8)[0]
            i += 4 + length
    return None


def _ptxas_notes(ptx: str) -> list[str]:
    """ptxas -v's performance notes for this PTX (e.g. C7515: wgmma serialized), run as Triton
    runs it for sm_90a; Triton itself discards that log."""
    from triton.backends.nvidia.compiler import get_ptxas  # noqa: PLC0415

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run([get_ptxas(90).path, "-v", "--regAllocOptLevel=2",
                               "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True)
    log = done.stdout + done.stderr
    return [re.sub(r" in the function '\w+'", "", line.split("info    : ", 1)[-1]).strip()
            for line in log.splitlines() if "Performance" in line or "error" in line.lower()]


def _signature(fn, types: dict, consts: dict) -> tuple:
    """(signature, constexprs, attrs) for ASTSource from fn's parameters: `types` by name
    (pointers, and i32 for any other runtime argument), `consts` by name (else the parameter's
    default), 16-byte alignment and divisibility by 16 assumed where a launch would see them."""
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(i,)] = consts[p.name] if p.name in consts else p.default
        else:
            signature[p.name] = types.get(p.name, "i32")
            if signature[p.name].startswith("*") or p.name in ("N", "K") or \
                    p.name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_sm90(variant: str, N: int, K: int, block_n: int, block_k: int, split_k: int,
                 stages: int, warps: int = 4):
    """`variant` compiled for sm_90 (no GPU needed): the CompiledKernel. "default" is the
    engine's _linear_kernel as linear_triton launches it at 5 rows (SWAP, F16_MMA); "engine
    f16" the same, "engine x2" with X2_MMA instead."""
    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    if variant == "default" or variant in ENGINE_VARIANTS:
        from fuser.ops.linear import _linear_kernel  # noqa: PLC0415

        fn = _linear_kernel
        types = {name: "*bf16" for name in ("x_ptr", "out_ptr", "r_ptr", "g_ptr", "sum_ptr")}
        types.update(w_ptr="*fp8e4nv", scale_ptr="*fp32", part_ptr="*fp32", count_ptr="*i32",
                     eps="fp32", lo_ptr="*fp8e4nv", inv_ptr="*fp32")
        if variant in ("engine pieces", "engine split pieces"):
            types["x_ptr"] = "*fp8e4nv"
        consts = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, NORM_K=block_k,
                      FP32_DOTS=False, HAS_SCALE=True, ACTIVATION="", NORM=False,
                      HAS_RESIDUAL=False, SPLIT_K=split_k, SWAP=True,
                      F16_MMA=ENGINE_VARIANTS.get(variant, "f16") == "f16",
                      X2_MMA=ENGINE_VARIANTS.get(variant) == "x2",
                      X2_PIECES=ENGINE_VARIANTS.get(variant) in ("pieces", "split pieces"),
                      EVEN_K=K % (split_k * block_k) == 0)
    else:
        fn = _rows_kernel
        weight, xm = VARIANTS[variant]
        x_type = {"shift": "*bf16", "prepass": "*bf16", "f16": "*fp16", "a8": "*fp8e4nv",
                  "a8x2": "*fp8e4nv", "x2p": "*fp8e4nv", "x2c": "*fp8e4nv"}[xm]
        w_type = {"cvt": "*fp8e4nv", "fp8": "*fp8e4nv", "asm": "*u8", "int": "*u8",
                  "words": "*i32"}[weight]
        types = dict(x_ptr=x_type, x_lo_ptr=x_type, xs_ptr="*fp32", w_ptr=w_type,
                     ws_ptr="*fp32", out_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32")
        consts = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
                      WEIGHT=weight, X=xm, FP32_DOTS=False)
    src = ASTSource(fn, *_signature(fn, types, consts))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages})


def _main_loop(sass: str) -> str:
    """The SASS of the kernel's longest loop (a label to a backward branch to it): the K loop."""
    lines = sass.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\w+:$", line)}
    loops = [(j - labels[m.group(1)], labels[m.group(1)], j) for j, line in enumerate(lines)
             if (m := re.search(r"\bBRA (\w+);", line)) and labels.get(m.group(1), j) < j]
    if not loops:
        return ""
    _, start, end = max(loops)
    return "\n".join(lines[start:end + 1])


def instruction_counts(kernel, weights_per_step: int, warps: int) -> dict:
    """COUNTED in the main K loop of the kernel's SASS (nvdisasm; else the whole PTX), the
    loop's instructions, what they allow, registers, shared memory and ptxas' notes.

    "issue" is the weights a K step moves per SM clock if the SM did nothing but issue this
    loop: 4 schedulers, one warp instruction each per clock, warps * loop instructions per step.
    The H200's HBM at 4.8 TB/s asks ~18 weights (bytes) per SM clock (132 SMs, 1.98 GHz)."""
    try:
        code, column = _main_loop(kernel.asm["sass"]), 0
    except Exception:  # noqa: BLE001 - no nvdisasm: the PTX says less but still something
        code, column = kernel.asm["ptx"], 1
    counts = {name: len(re.findall(patterns[column], code)) for name, patterns in COUNTED.items()}
    counts["from"] = "sass K loop" if column == 0 else "ptx"
    if column == 0:
        loop = len([line for line in code.splitlines() if "\t" in line])
        counts["loop"] = loop
        counts["issue"] = round(4 * weights_per_step / (warps * loop), 1)
    counts["registers"] = _cubin_registers(kernel.asm["cubin"])
    counts["smem"] = kernel.metadata.shared
    try:
        counts["ptxas"] = _ptxas_notes(kernel.asm["ptx"])
    except Exception as exc:  # noqa: BLE001
        counts["ptxas"] = [f"not run: {type(exc).__name__}"]
    return counts


def compile_only(variants: list[str], cfg: tuple[int, int, int, int]) -> dict:
    """Compile each variant for sm_90 at gate_up and print its instruction counts."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("--compile-only compiles for sm_90: run it without TRITON_INTERPRET=1")
    N, K = SHAPES["gate_up"]
    print(f"sm_90a compile, Triton {triton.__version__}, gate_up N={N} K={K}, "
          f"(block_n, block_k, split_k, stages) = {cfg}, 4 warps; static counts in the K loop")
    results = {}
    for variant in variants:
        start = time.perf_counter()
        try:
            counts = instruction_counts(compile_sm90(variant, N, K, *cfg), cfg[0] * cfg[1], 4)
        except Exception as exc:  # noqa: BLE001 - a lab: report and go on
            print(f"{variant:21s} failed: {type(exc).__name__}: {str(exc)[-400:]}")
            continue
        counts["compile_s"] = round(time.perf_counter() - start, 1)
        results[variant] = counts
        notes = counts.pop("ptxas")
        print(f"{variant:21s} " + " ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
        for note in notes:
            print(f"{'':21s} ptxas: {note}")
        counts["ptxas"] = notes
    return results


# --- on the GPU: compile ahead in worker processes, then the sweep ---------------------------


_WORKER_INPUTS: dict = {}


def _compile_job(job: tuple) -> str | None:
    """In a worker process: launch one configuration once on zeros, so that Triton compiles it
    into its on-disk cache exactly as the timed process's launch will look it up ("default":
    linear_triton at that shape and row count). None, or the error."""
    variant, N, K, M, cfg = job
    key = (N, K, M, VARIANTS[variant][1] if variant in VARIANTS else "shift")
    try:
        if key not in _WORKER_INPUTS:
            w = torch.zeros(N, K, device="cuda", dtype=torch.float8_e4m3fn)
            x = torch.ones(M, K, device="cuda", dtype=torch.bfloat16)
            _WORKER_INPUTS[key] = (x, prepare_x(x, key[3]), w,
                                   torch.ones(N, device="cuda", dtype=torch.float32),
                                   torch.empty(M, N, device="cuda", dtype=torch.bfloat16))
        x, xp, w, ws, out = _WORKER_INPUTS[key]
        if variant == "default":
            linear_triton(x, w, weight_scale=ws)
        else:
            make_gemv(N, K, variant, cfg, "cuda")(xp, w, ws, out)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - reported; the sweep then skips or retries it
        return f"{variant} {cfg}: {type(exc).__name__}: {exc}"[:240]
    return None


def compile_ahead(jobs: list[tuple], workers: int) -> None:
    """Compile every job in `workers` spawned processes (each its own CUDA context)."""
    if workers <= 1 or not jobs:
        return
    import multiprocessing  # noqa: PLC0415
    from concurrent.futures import ProcessPoolExecutor  # noqa: PLC0415

    start = time.perf_counter()
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as ex:
            errors = [e for e in ex.map(_compile_job, jobs, chunksize=4) if e]
    except Exception as exc:  # noqa: BLE001 - the sweep compiles what is missing itself
        print(f"compile ahead failed ({type(exc).__name__}: {exc}); compiling in the sweep")
        return
    print(f"compiled {len(jobs)} configurations in {workers} processes: "
          f"{time.perf_counter() - start:.0f} s, {len(errors)} failed", flush=True)
    for error in errors[:10]:
        print(f"  {error}")


def time_chain(fn, copies: list, replays: int = 20) -> float:
    """Median us per GEMV over the chain of weight copies, captured in one CUDA graph."""
    from timing import replay_median_ms  # noqa: PLC0415

    def run() -> torch.Tensor:
        for w, ws, out in copies:
            fn(w, ws, out)
        return copies[-1][2]
    ms, _ = replay_median_ms(run, replays)
    return ms * 1000 / len(copies)


def _wall_us(fn, copies: list) -> float:
    """--dry-run's stand-in for time_chain: wall-clock us of one pass over the chain (CPU)."""
    start = time.perf_counter()
    for w, ws, out in copies:
        fn(w, ws, out)
    return (time.perf_counter() - start) * 1e6 / len(copies)


def sweep(args, variants: list[str], rows: list[int], shapes: dict) -> list[dict]:
    """Time every variant at every shape and row count; print the fastest configurations."""
    from timing import measure_read_bandwidth  # noqa: PLC0415

    torch.manual_seed(0)
    if args.dry_run:
        device, bandwidth, timer = torch.device("cpu"), 1e12, _wall_us
        print("dry run: CPU, interpreter, wall-clock per call, bandwidth taken as 1 TB/s")
    else:
        device, bandwidth, timer = torch.device("cuda"), measure_read_bandwidth(), time_chain
        print(f"HBM read bandwidth {bandwidth / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}, "
              f"Triton {triton.__version__}, torch {torch.__version__}", flush=True)
    results = []

    def report(row: dict) -> None:
        print(f"{row['shape']:8s} M={row['M']:2d} {row['variant']:21s} {row['config']:18s} "
              f"{row['us']:8.2f} us {row['tbs']:5.2f} TB/s {row['pct']:5.1f}%  "
              f"err {row['err']:.1e}", flush=True)

    for name, (N, K) in shapes.items():
        nbytes = N * K + 4 * N                                  # weight and scales
        n_copies = max(2, (400 * 2**20) // (N * K)) if not args.dry_run else 2
        base = torch.randn(N, K, device=device, dtype=torch.bfloat16)
        weights = [quantize_weight(base.roll(i, dims=1) if i else base) for i in range(n_copies)]
        del base
        w0, ws0 = weights[0]
        for M in [1] + [m for m in rows if m != 1]:
            x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
            ref = reference(x, w0, ws0)
            copies = [(w, ws, torch.empty(M, N, device=device, dtype=x.dtype))
                      for w, ws in weights]

            def row(variant: str, config: str, us: float, err: float, best: bool) -> dict:
                tbs = nbytes / us / 1e6
                return {"shape": name, "N": N, "K": K, "M": M, "variant": variant,
                        "config": config, "us": us, "tbs": tbs,
                        "pct": 100 * tbs * 1e12 / bandwidth, "err": err, "best": best}

            us = timer(lambda w, ws, out: linear_triton(x, w, weight_scale=ws), copies)
            err = max_rel_err(linear_triton(x, w0, weight_scale=ws0), ref)
            results.append(row("default", "linear_triton", us, err, True))
            report(results[-1])
            if M == 1:
                continue
            print(f"{name:8s} M={M:2d} {'bf16 floor':21s} {'ref.to(bf16)':18s} {'':38s}"
                  f"err {max_rel_err(ref.to(x.dtype), ref):.1e}")
            for variant in variants:
                if variant == "default":
                    continue
                xp = prepare_x(x, VARIANTS[variant][1] if variant in VARIANTS else "shift")
                timed = {}

                def attempt(cfg: tuple) -> None:
                    try:
                        fn = make_gemv(N, K, variant, cfg, device)
                        out = torch.empty(M, N, device=device, dtype=x.dtype)
                        err = max_rel_err(fn(xp, w0, ws0, out), ref)
                        us = timer(lambda w, ws, out: fn(xp, w, ws, out), copies)
                    except Exception as exc:  # noqa: BLE001 - a lab: report and go on
                        print(f"  {name} {variant} {cfg}: {type(exc).__name__}: {exc}"[:240])
                        return
                    timed[cfg] = row(variant, str(cfg), us, err, False)
                    results.append(timed[cfg])

                for cfg in first_configs(N, K):
                    attempt(cfg)
                if not timed:
                    continue
                bn, bk, split, _ = min(timed, key=lambda c: timed[c]["us"])
                for stages in (3, 5):
                    attempt((bn, bk, split, stages))
                best = min(timed.values(), key=lambda r: r["us"])
                best["best"] = True
                report(best)
        del weights, copies
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="5", help="comma-separated row counts (M); M = 1's "
                        "default is always timed")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated, of: default, "
                        f"{', '.join([*VARIANTS, *ENGINE_VARIANTS])}")
    parser.add_argument("--out", default=None, help="write every timed configuration as JSON")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                        help="processes compiling ahead (1: compile in the sweep)")
    parser.add_argument("--compile-only", action="store_true",
                        help="compile the variants for sm_90 (no GPU) and print their counts")
    parser.add_argument("--dry-run", action="store_true", help="the sweep's plumbing on CPU at "
                        "a tiny shape (needs TRITON_INTERPRET=1; asm variants fail there)")
    parser.add_argument("--config", default="64,128,1,4",
                        help="--compile-only's block_n,block_k,split_k,stages")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    known = ["default", *VARIANTS, *ENGINE_VARIANTS]
    unknown = [v for v in variants if v not in known]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(known)}")
    if args.compile_only:
        results = compile_only(variants, tuple(int(c) for c in args.config.split(",")))
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    if args.dry_run:
        if os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run runs the kernels under the interpreter: set TRITON_INTERPRET=1")
        results = sweep(args, variants, [int(r) for r in args.rows.split(",")], DRY_SHAPES)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/fp8_rows_lab.py: no CUDA device; run it on the GPU machine, or "
                 "pass --compile-only to compile the kernels for sm_90 here")
    started = time.perf_counter()
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    jobs = [("default", N, K, M, None) for N, K in shapes for M in dict.fromkeys([1] + rows)]
    # N, K and the strides are multiples of 16 at every shape: one compiled kernel serves all
    distinct = {(variant, M, (bn, bk, split, stages)): (variant, N, K, M, (bn, bk, split, stages))
                for variant in variants if variant != "default"
                for N, K in shapes for M in rows if M != 1
                for bn, bk, split, _ in first_configs(N, K) for stages in (4, 3, 5)}
    compile_ahead(jobs + list(distinct.values()), args.jobs)
    results = sweep(args, variants, rows, {s: SHAPES[s] for s in args.shapes.split(",")})
    print(f"(TB/s of N K + 4 N bytes; config = (block_n, block_k, split_k, stages), 4 warps; "
          f"{time.perf_counter() - started:.0f} s in all)")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
