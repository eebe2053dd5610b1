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

    python3 benchmarks/pieces_lab.py [--rows 5] [--out pieces.json]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (copies_for, lab_arguments, log, time_variants,  # noqa: E402
                    write_lab_results)

# name: (N, K, gated): N output columns (gated: the merged weight has 2N rows)
SHAPES = {"qkv": (6144, 4096, False), "o_proj": (4096, 4096, False),
          "gate_up": (14336, 4096, True), "down": (4096, 14336, False)}


def main() -> None:
    args = lab_arguments("pieces_lab.py", __doc__)
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


if __name__ == "__main__":
    main()
