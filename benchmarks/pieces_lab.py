"""Does a power of two per K step cost the 5-row FP8 GEMV anything? (issue #10)

The FP8 verify step's GEMVs take x as e4m3 pieces with a power of two per row, which a kernel
of its own has to make (the norm kernel, a row split): a launch and a gap per GEMV that decode
does not pay (benchmarks/RESULTS.md, twenty-third session). Pieces scaled per block of columns
(linear_pieces_triton(..., scale_block=G)) could come out of the kernel before instead, a block
at a time: attention's combine (one head, 128 columns), a GEMV's epilogue. Their GEMV scales
each K step's sums by its block's power of two. Here, per 8B shape at 5 rows, each as a CUDA
graph of rotated weight copies (benchmarks/timing.py):

    rows     the GEMV on row-scaled pieces (today's default path)
    blocks   the same GEMV on block-scaled pieces, K step = scale block (the same tiles)
    f16      bf16 x on the fp16 MMA (o_proj's path today)
    blocksB  block-scaled pieces of B = 64 or 128 columns (a GEMV epilogue's tile width),
             K step B, the launcher's stages (_deeper_stages); blocksB_sS: S stages
    rows_bn256  gate/up on row pieces at 256-row tiles (128 gated columns a program)
    *_w8     rows, blocks, f16 at 8 warps (the 4-warp programs spill: benchmarks/sass_lab.py);
             rows_k128_w8: down_proj at 64 x 128 tiles, 8 warps (no spill at all)
    rows_rR  rows with at most R registers a thread (linear.FP8_ROWS_MAXNREG): 128 lets four
             programs share an SM where 255 let two

--sweep times the row-pieces GEMV alone over its launch shape instead (SWEEP: block_n x block_k
x split-K x stages, 4 warps; named nN kK sS pP), the engine's own choice first as "default":
the several-row FP8 tiles were last swept on the bf16 MMA (fp8_mma_lab.py, tenth session) and
for down_proj's K step (sixteenth), never split-K and stages on the pieces.

    python3 benchmarks/pieces_lab.py [--rows 5] [--sweep [--best tiles.json]] [--out pieces.json]

--best writes, per shape whose fastest launch shape beat the default by BEST_MARGIN or more,
that shape as linear.FP8_PIECES_TILES takes it ({"ROWSxK": [block_n, block_k, split_k,
stages]}; `load_pieces_tiles` reads it back), for `benchmarks/decode.py --pieces-tiles`.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (copies_for, lab_arguments, log, time_variants,  # noqa: E402
                    write_lab_results)

# name: (N, K, gated): N output columns (gated: the merged weight has 2N rows)
SHAPES = {"qkv": (6144, 4096, False), "o_proj": (4096, 4096, False),
          "gate_up": (14336, 4096, True), "down": (4096, 14336, False)}
# --sweep, per shape: (block_n, block_k, split-K, stages) grids; a configuration whose split-K
# does not divide K into whole K steps, or whose tiles overflow the shared memory, is skipped
# Below 64 weight rows a tile leaves the wgmma: Triton 3.6 compiles block_n 16 and 32 on sm_90
# to mma.sync with both pieces widened to fp16 (HMMA.16816.F32, exact products, fp32 sums),
# 16 x 256 without a spill (benchmarks/sass_lab.py-style compile, twenty-fifth session): more,
# smaller programs, as the one-row tiles have. Their K loops issue 2.4-4x the default's SASS
# instructions per weight by the same compile, so they will likely lose. SMALL_TILES times
# them (not yet on a GPU: gpu_all.sh s26a).
SMALL_TILES = [(n, 256, s, 4) for n in (16, 32) for s in (1, 2, 4)]
SWEEP = {
    "qkv": [(n, k, s, p) for n in (64,) for k in (128, 256) for s in (1, 2, 4, 8)
            for p in (3, 4, 6)] + [(128, 128, s, 4) for s in (2, 4, 8)] + SMALL_TILES,
    "o_proj": [(n, k, s, p) for n in (64,) for k in (128, 256) for s in (1, 2, 4, 8)
               for p in (3, 4, 6)] + [(128, 128, s, 4) for s in (2, 4, 8)] + SMALL_TILES,
    "down": [(64, k, s, p) for k in (128, 256, 512) for s in (1, 2, 4, 7, 8, 14)
             for p in (3, 4)] + SMALL_TILES,
    "gate_up": [(n, k, s, p) for n in (64, 128) for k in (128, 256) for s in (1, 2)
                for p in (3, 4, 6)],
}


def capped(cap: int, fn: Callable[[], object]) -> Callable[[], object]:
    """fn launched with linear.FP8_ROWS_MAXNREG = cap (restored after)."""
    from fuser.ops import linear  # noqa: PLC0415

    def call() -> object:
        before, linear.FP8_ROWS_MAXNREG = linear.FP8_ROWS_MAXNREG, cap
        try:
            return fn()
        finally:
            linear.FP8_ROWS_MAXNREG = before
    return call


BEST_MARGIN = 0.02  # --best takes a launch shape 2% or more faster than the default


def best_pieces_tiles(results: dict[str, dict[str, float]], shapes: dict) -> dict[str, list]:
    """--best: {"ROWSxK": [block_n, block_k, split_k, stages]} for each swept shape whose
    fastest launch shape beat "default" by BEST_MARGIN or more."""
    best: dict[str, list] = {}
    for name, timed in results.items():
        variant, us = min(timed.items(), key=lambda item: item[1])
        if variant == "default" or us > timed["default"] * (1 - BEST_MARGIN):
            continue
        N, K, gated = shapes[name]
        best[f"{2 * N if gated else N}x{K}"] = [int(word[1:]) for word in variant.split()]
    return best


def load_pieces_tiles(path: Path) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """A --best file as linear.FP8_PIECES_TILES takes it."""
    tiles = {}
    for key, (bn, bk, split, stages) in json.loads(path.read_text()).items():
        rows, K = (int(v) for v in key.split("x"))
        tiles[(rows, K)] = (int(bn), int(bk), int(split), int(stages))
    return tiles


def sweep_variants(name: str, K: int, hi, lo, inv, weights, act: str | None) -> dict:
    """--sweep's variants for one shape: the engine's default, then SWEEP's launch shapes."""
    from fuser.ops.linear import SHARED_MEMORY_BUDGET, linear_pieces_triton  # noqa: PLC0415
    out = {"default": [functools.partial(linear_pieces_triton, hi, lo, inv, wc, sc,
                                         activation=act) for wc, sc in weights]}
    for bn, bk, split, stages in SWEEP[name]:
        # whole K steps per split; the pipelined weight and pieces tiles (16 rows of two 1-byte
        # pieces a step) within the launcher's shared-memory budget
        if K % (split * bk) or stages * bk * (bn + 2 * 16) > SHARED_MEMORY_BUDGET:
            continue
        out[f"n{bn} k{bk} s{split} p{stages}"] = [
            functools.partial(linear_pieces_triton, hi, lo, inv, wc, sc, activation=act,
                              block_n=bn, block_k=bk, split_k=split, num_stages=stages,
                              num_warps=4) for wc, sc in weights]
    return out


def main() -> None:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sweep", action="store_true",
                            help="the row-pieces GEMV over SWEEP's launch shapes")
        parser.add_argument("--best", type=Path, help="with --sweep: write the fastest tiles")

    args = lab_arguments("pieces_lab.py", __doc__, extra)
    from fuser.ops import linear as linear_module  # noqa: PLC0415
    from fuser.ops.e4m3_pieces import (split_pieces_blocks_reference,  # noqa: PLC0415
                                       split_pieces_reference)
    from fuser.ops.fp8 import quantize_weight  # noqa: PLC0415
    from fuser.ops.linear import linear_pieces_triton, linear_triton  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    shapes = {"tiny": (64, 256, False)} if args.dry_run else SHAPES
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for name, (N, K, gated) in shapes.items():
        rows_w = 2 * N if gated else N
        bn, bk, _, _ = linear_module._default_fp8_config(args.rows, rows_w, K, pieces=True)
        x = torch.randn(args.rows, K, generator=gen).to(torch.bfloat16)
        w, s = quantize_weight(torch.randn(rows_w, K, generator=gen) * 0.02)
        copies = 1 if args.dry_run else copies_for(w.numel())
        weights = [(w.to(device), s.to(device)) for _ in range(copies)]
        hi, lo, inv = (t.to(device) for t in split_pieces_reference(x))
        bhi, blo, binv = (t.to(device) for t in split_pieces_blocks_reference(x, bk))
        act = "silu" if gated else None
        if args.sweep:
            timed = time_variants(sweep_variants(name if not args.dry_run else "qkv", K, hi, lo,
                                                 inv, weights, act), args.dry_run)
            results[name] = timed
            if timed:
                best = sorted(timed.items(), key=lambda item: item[1])[:4]
                log(f"{name:8s} {N}x{K}: default {timed['default']:.2f} us; fastest " +
                    ", ".join(f"{v} {us:.2f}" for v, us in best))
            continue
        variants = {
            "rows": [functools.partial(linear_pieces_triton, hi, lo, inv, wc, sc, activation=act)
                     for wc, sc in weights],
            "blocks": [functools.partial(linear_pieces_triton, bhi, blo, binv, wc, sc,
                                         activation=act, scale_block=bk) for wc, sc in weights],
            "f16": [functools.partial(linear_triton, x.to(device), wc, weight_scale=sc,
                                      activation=act) for wc, sc in weights],
        }
        # Shorter blocks than the K step (a GEMV epilogue's tile width: gate/up's 64 gated
        # columns): the launcher's default stages (as many bytes in flight as the table's
        # step) and a sweep of them.
        for block in (64, 128):
            if bk <= block:
                continue
            bh, bl, bi = (t.to(device) for t in split_pieces_blocks_reference(x, block))
            for stages in (None, 3, 6, 16):
                name_v = f"blocks{block}" + (f"_s{stages}" if stages else "")
                variants[name_v] = [
                    functools.partial(linear_pieces_triton, bh, bl, bi, wc, sc, activation=act,
                                      scale_block=block, num_stages=stages)
                    for wc, sc in weights]
        # 8 warps: the 4-warp programs spill registers (benchmarks/sass_lab.py)
        variants["rows_w8"] = [functools.partial(linear_pieces_triton, hi, lo, inv, wc, sc,
                                                 activation=act, num_warps=8)
                               for wc, sc in weights]
        variants["blocks_w8"] = [functools.partial(linear_pieces_triton, bhi, blo, binv, wc, sc,
                                                   activation=act, scale_block=bk, num_warps=8)
                                 for wc, sc in weights]
        variants["f16_w8"] = [functools.partial(linear_triton, x.to(device), wc, weight_scale=sc,
                                                activation=act, num_warps=8)
                              for wc, sc in weights]
        # a register cap: four 4-warp programs an SM instead of two (linear.FP8_ROWS_MAXNREG)
        for cap in (128, 168):
            variants[f"rows_r{cap}"] = [capped(cap, functools.partial(
                linear_pieces_triton, hi, lo, inv, wc, sc, activation=act))
                for wc, sc in weights]
        if bk > 128:  # down_proj: the 64 x 128 tile that spills nothing at 8 warps
            variants["rows_k128_w8"] = [
                functools.partial(linear_pieces_triton, hi, lo, inv, wc, sc, activation=act,
                                  block_k=128, num_stages=4, num_warps=8) for wc, sc in weights]
        if gated:  # 128 gated columns a program (block_n 256): what 128-column pieces cost
            variants["rows_bn256"] = [
                functools.partial(linear_pieces_triton, hi, lo, inv, wc, sc, activation=act,
                                  block_n=256) for wc, sc in weights]
        results[name] = time_variants(variants, args.dry_run)
        if results[name]:
            log(f"{name:8s} {N}x{K} tiles {bn}x{bk}: " + ", ".join(
                f"{v} {us:.2f} us" for v, us in results[name].items()))
    write_lab_results(results, args.rows, args.out, args.dry_run)
    if args.sweep and args.best:
        best = best_pieces_tiles(results, shapes)
        args.best.write_text(json.dumps(best))
        log(f"fastest pieces tiles: {best}")


if __name__ == "__main__":
    main()
