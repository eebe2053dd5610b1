"""Where block pieces' GEMVs lose what they save (issue #10).

On the H200 (benchmarks/RESULTS.md, twenty-fourth session) norm_stats' FP8 consumers on
block-scaled e4m3 pieces took the pieces kernels out of the 8-layer FP8 verify step (60 -> 2 us)
but its GEMVs grew by 143 us: per layer qkv 9.96 against 8.55 us for its GEMV alone on row
pieces, gate/up 34.9 against 33.2, down_proj 32.2 against 17.9. This lab times, per 8B layer
op at 5 rows, the engine's two forms and the pieces in between, each as a CUDA graph of rotated
weight copies (benchmarks/timing.py):

    qkv, gate_up (after the norm)
      row          the norm kernel writing row pieces, then the GEMV on them (the default)
      row_gemv     that GEMV alone
      block        the block consumer: rstd from the sums of squares (STATS_BLOCK); gate/up also
                   writes its output as 64-column block pieces (PIECES_OUT)
      block_nostats  the GEMV on the same block pieces without the rstd from the squares
      block_stats  gate/up: the consumer with the rstd, its output not written as pieces
    o_proj, down_proj (before the norm)
      row          o_proj: the GEMV on the fp16 MMA (bf16 x); down: the row split, then the GEMV
      row_gemv     down: the GEMV on row pieces alone
      block        the residual epilogue writing g * summed as 128-column block pieces and the
                   sums of squares, x given as block pieces (o_proj: one head, 128 columns;
                   down: gate/up's 64 columns)
      block_gemv   the GEMV on those block pieces without the epilogue
      block_gh     the residual epilogue writing g * summed in bf16, x as row pieces
      down block128: the block form with 128-column input blocks

    python3 benchmarks/block_lab.py [--rows 5] [--out block.json]
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import (copies_for, lab_arguments, log, time_variants,  # noqa: E402
                    write_lab_results)

# name: (weight rows, K, activation)
SHAPES = {"qkv": (6144, 4096, None), "gate_up": (28672, 4096, "silu"),
          "o_proj": (4096, 4096, None), "down": (4096, 14336, None)}
TINY = {"qkv": (96, 256, None), "gate_up": (256, 256, "silu"), "o_proj": (64, 256, None),
        "down": (64, 512, None)}
EPS = 1e-5


def variants(name: str, rows: int, K: int, activation: str | None, weights: list,
             gen: torch.Generator, device: str) -> dict[str, list[Callable[[], object]]]:
    """The callables per variant, one per rotated weight copy."""
    from fuser.ops import linear as linear_module  # noqa: PLC0415
    from fuser.ops import norm_stats  # noqa: PLC0415
    from fuser.ops.e4m3_pieces import (add_rms_norm_pieces_triton,  # noqa: PLC0415
                                       split_pieces_blocks_reference, split_pieces_reference,
                                       split_pieces_triton)

    block = linear_module.STATS_PIECES_BLOCK
    gated_block = linear_module.STATS_GATED_PIECES_BLOCK

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    x = torch.randn(rows, K, generator=gen).to(torch.bfloat16)
    hi, lo, inv = map(on, split_pieces_reference(x))
    out: dict[str, list[Callable[[], object]]] = {}

    def each(fn: Callable[[torch.Tensor, torch.Tensor], object]) -> list[Callable[[], object]]:
        return [(lambda w=w, s=s: fn(w, s)) for w, s in weights]

    if name in ("qkv", "gate_up"):
        r = on(torch.randn(rows, K, generator=gen).to(torch.bfloat16))
        g = on((1 + 0.1 * torch.randn(K, generator=gen)).to(torch.bfloat16))
        xd = on(x)
        h = (x.float() + r.cpu().float()).to(torch.bfloat16)
        gh = (g.cpu().float() * h.float()).to(torch.bfloat16)
        squares = on(norm_stats.group_squares_reference(h))
        bhi, blo, binv = map(on, split_pieces_blocks_reference(gh, block))

        def row(w: torch.Tensor, s: torch.Tensor) -> object:
            p_hi, p_lo, p_inv, _ = add_rms_norm_pieces_triton(xd, r, g, EPS)
            return linear_module.linear_pieces_triton(p_hi, p_lo, p_inv, w, s,
                                                      activation=activation)

        out["row"] = each(row)
        out["row_gemv"] = each(lambda w, s: linear_module.linear_pieces_triton(
            hi, lo, inv, w, s, activation=activation))
        if activation is None:
            out["block"] = each(lambda w, s: norm_stats.normed_pieces_linear_triton(
                bhi, blo, binv, squares, EPS, w, s, block))
        else:
            out["block"] = each(lambda w, s: norm_stats.normed_pieces_gated_pieces_triton(
                bhi, blo, binv, squares, EPS, w, s, block, gated_block, activation))
            out["block_stats"] = each(lambda w, s: norm_stats.normed_pieces_linear_triton(
                bhi, blo, binv, squares, EPS, w, s, block, activation=activation))
        out["block_nostats"] = each(lambda w, s: linear_module.linear_pieces_triton(
            bhi, blo, binv, w, s, activation=activation, scale_block=block))
        return out
    N = weights[0][0].shape[0]
    r = on(torch.randn(rows, N, generator=gen).to(torch.bfloat16))
    g = on((1 + 0.1 * torch.randn(N, generator=gen)).to(torch.bfloat16))
    xd = on(x)
    in_block = block if name == "o_proj" else gated_block
    bhi, blo, binv = map(on, split_pieces_blocks_reference(x, in_block))
    if name == "o_proj":
        out["row"] = each(lambda w, s: linear_module.linear_triton(xd, w, weight_scale=s))
    else:
        def row(w: torch.Tensor, s: torch.Tensor) -> object:
            return linear_module.linear_pieces_triton(*split_pieces_triton(xd), w, s)

        out["row"] = each(row)
        out["row_gemv"] = each(lambda w, s: linear_module.linear_pieces_triton(hi, lo, inv, w, s))
    out["block"] = each(lambda w, s: norm_stats.linear_residual_pieces_triton(
        xd, w, r, g, block, weight_scale=s, pieces=(bhi, blo, binv), block_k=in_block))
    out["block_gemv"] = each(lambda w, s: linear_module.linear_pieces_triton(
        bhi, blo, binv, w, s, scale_block=in_block))
    out["block_gh"] = each(lambda w, s: norm_stats.linear_residual_triton(
        xd, w, r, g, weight_scale=s, pieces=(hi, lo, inv)))
    if name == "down" and in_block != block:
        p_hi, p_lo, p_inv = map(on, split_pieces_blocks_reference(x, block))
        out["block128"] = each(lambda w, s: norm_stats.linear_residual_pieces_triton(
            xd, w, r, g, block, weight_scale=s, pieces=(p_hi, p_lo, p_inv), block_k=block))
    return out


def main() -> None:
    args = lab_arguments("block_lab.py", __doc__)
    from fuser.ops.fp8 import quantize_weight  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    for name, (rows_w, K, activation) in (TINY if args.dry_run else SHAPES).items():
        w, s = quantize_weight(torch.randn(rows_w, K, generator=gen) * 0.02)
        copies = 1 if args.dry_run else copies_for(w.numel())
        weights = [(w.to(device), s.to(device)) for _ in range(copies)]
        fns = variants(name, args.rows, K, activation, weights, gen, device)
        results[name] = time_variants(fns, args.dry_run)
        if results[name]:
            log(f"{name:8s} {rows_w}x{K}: " + ", ".join(
                f"{v} {us:.2f}" for v, us in results[name].items()) + " us")
    write_lab_results(results, args.rows, args.out, args.dry_run)


if __name__ == "__main__":
    main()
