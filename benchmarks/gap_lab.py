"""What a kernel boundary costs in the 5-row (verify) step, and whether one shared-memory split
for every kernel changes it (fuser/ops/carveout.py; issue #10).

The FP8 verify step at the 8B shape loses 1.67 us between kernels where the one-row decode step
loses none (benchmarks/RESULTS.md, twenty-third session). Here, chains of 40 launches in one CUDA
graph (benchmarks/timing.py), per call:

    split      e4m3_pieces' row split of x [5, 4096]: one program a row, no MMA
    norm       the norm kernel writing e4m3 pieces of [5, 4096]: another small kernel
    gemv       the 5-row FP8 GEMV over those pieces (linear_pieces_triton, 1024 x 4096): the MMA
               path's tiles, ~49 KB of shared memory a program

then the alternating chains split/norm (two small kernels: what a boundary between different
kernels costs) and split/gemv (a small kernel and the GEMV: the step's boundaries). A
boundary's extra cost is the pair's time less its two kernels' own chain times. Run it once as
is and once with --smem-carveout 100: if the GEMV's boundaries cost more than the small kernels'
and the carveout removes it, SMs changing their L1/shared split is the gap.

    python3 benchmarks/gap_lab.py [--smem-carveout 100] [--out gap.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import graph_time_us, log, missing_gpu  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smem-carveout", type=int, default=None, metavar="PERCENT")
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dry-run", action="store_true", help="CPU: check the plumbing only")
    args = parser.parse_args()
    if missing_gpu("gap_lab.py", args.dry_run):
        sys.exit(2)
    from fuser.ops import carveout  # noqa: PLC0415  (before any kernel loads)

    if args.smem_carveout is not None:
        carveout.install(args.smem_carveout)
    from fuser.ops.e4m3_pieces import (  # noqa: PLC0415
        add_rms_norm_pieces_triton, split_pieces_triton)
    from fuser.ops.fp8 import quantize_weight  # noqa: PLC0415
    from fuser.ops.linear import linear_pieces_triton  # noqa: PLC0415

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.rows, 4096, generator=gen).to(torch.bfloat16).to(device)
    r = torch.randn(args.rows, 4096, generator=gen).to(torch.bfloat16).to(device)
    g = (1 + 0.1 * torch.randn(4096, generator=gen)).to(torch.bfloat16).to(device)
    w, s = quantize_weight(torch.randn(1024, 4096, generator=gen) * 0.02)
    w, s = w.to(device), s.to(device)
    pieces = split_pieces_triton(x)
    kernels = {
        "split": lambda: split_pieces_triton(x),
        "norm": lambda: add_rms_norm_pieces_triton(x, r, g, 1e-5),
        "gemv": lambda: linear_pieces_triton(*pieces, w, s),
    }
    if args.dry_run:
        for f in kernels.values():
            f()
        log("dry run: the kernels ran once on CPU")
        return
    chains = {name: [f] for name, f in kernels.items()}
    chains["split/norm"] = [kernels["split"], kernels["norm"]]
    chains["split/gemv"] = [kernels["split"], kernels["gemv"]]
    chains["norm/gemv"] = [kernels["norm"], kernels["gemv"]]
    us = {name: graph_time_us(fns, args.calls) for name, fns in chains.items()}
    log(f"carveout {carveout.installed_percent()}, rows {args.rows}, {args.calls} calls a graph "
        f"(us per call):")
    for name, value in us.items():
        log(f"  {name:12s} {value:8.3f}")
    extra = {}
    for pair in ("split/norm", "split/gemv", "norm/gemv"):
        a, b = pair.split("/")
        extra[pair] = 2 * us[pair] - us[a] - us[b]  # two boundaries of the mixed kind a pair
        log(f"  {pair}: {extra[pair] / 2:+.3f} us a boundary against same-kernel chains")
    if args.out:
        Path(args.out).write_text(json.dumps({"carveout": carveout.installed_percent(),
                                              "rows": args.rows, "us": us, "extra": extra},
                                             indent=1))


if __name__ == "__main__":
    main()
