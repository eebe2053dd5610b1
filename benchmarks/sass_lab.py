"""Registers and spills of the several-row FP8 GEMV's forms, compiled for sm_90 on the CPU.

No GPU needed: each 8B layer op at `--rows` rows is launched through fuser's own launcher with
the kernel replaced by a recorder (nothing runs), compiled for sm_90 with the GPU's constexprs
(tests/sm90_compile.py) and its SASS read with Triton's cuobjdump: registers per thread, the
stack frame (spills), and the spill loads and stores (LDL, STL) inside loops (backward
branches: the K loop). A spill load in the K loop costs every step. A * marks the launcher's
own number of warps. The Triton installed here
decides the code: use the GPU machine's version (Triton 3.6.0 for the twenty-fourth session's
figures) to read what the GPU runs.

    python3 benchmarks/sass_lab.py [--rows 5] [--warps 4,8] [--cases qkv_row,down_one] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def cases(rows: int) -> dict[str, Callable[[], object]]:
    """The launches to record, by name: the row-pieces GEMVs the FP8 verify step runs today and
    the block-pieces forms (linear.STATS_FP8_MMA = "block"), at the 8B shapes."""
    from fuser.ops import linear
    from fuser.ops import norm_stats as ns
    from fuser.ops.e4m3_pieces import split_pieces_blocks_reference, split_pieces_reference

    def fp8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(n, k, dtype=torch.float8_e4m3fn), torch.ones(n)

    x = torch.randn(rows, 4096).bfloat16()
    xd = torch.randn(rows, 14336).bfloat16()
    row, row_d = split_pieces_reference(x), split_pieces_reference(xd)
    block = split_pieces_blocks_reference(x, linear.STATS_PIECES_BLOCK)
    block_d = split_pieces_blocks_reference(xd, linear.STATS_GATED_PIECES_BLOCK)
    squares = ns.group_squares_reference(x)
    r, g = torch.randn(rows, 4096).bfloat16(), torch.ones(4096).bfloat16()
    eps, pb, gb = 1e-5, linear.STATS_PIECES_BLOCK, linear.STATS_GATED_PIECES_BLOCK
    x1, r1, xd1 = x[:1], r[:1], xd[:1]
    return {
        # one row (decode; "_one": PDL compiled in, as the GPU launches them)
        "qkv_one": lambda: linear.rms_norm_linear_triton(x1, r1, g, eps, *fp8(6144, 4096)[:1],
                                                         weight_scale=torch.ones(6144)),
        "o_proj_one": lambda: linear.linear_triton(x1, fp8(4096, 4096)[0],
                                                   weight_scale=torch.ones(4096)),
        "gate_up_one": lambda: linear.rms_norm_linear_triton(
            x1, r1, g, eps, fp8(28672, 4096)[0], weight_scale=torch.ones(28672),
            activation="silu"),
        "down_one": lambda: linear.linear_triton(xd1, fp8(4096, 14336)[0],
                                                 weight_scale=torch.ones(4096)),
        # several rows (verify)
        "qkv_row": lambda: linear.linear_pieces_triton(*row, *fp8(6144, 4096)),
        "gate_up_row": lambda: linear.linear_pieces_triton(*row, *fp8(28672, 4096),
                                                           activation="silu"),
        "down_row": lambda: linear.linear_pieces_triton(*row_d, *fp8(4096, 14336)),
        "down_row_64x128": lambda: linear.linear_pieces_triton(*row_d, *fp8(4096, 14336),
                                                               block_k=128, num_stages=4),
        "o_proj_f16": lambda: linear.linear_triton(x, *fp8(4096, 4096)[:1],
                                                   weight_scale=torch.ones(4096)),
        "qkv_block": lambda: ns.normed_pieces_linear_triton(*block, squares, eps,
                                                            *fp8(6144, 4096), pb),
        "gate_up_block": lambda: ns.normed_pieces_gated_pieces_triton(
            *block, squares, eps, *fp8(28672, 4096), pb, gb, "silu"),
        "o_proj_block": lambda: ns.linear_residual_pieces_triton(
            x, fp8(4096, 4096)[0], r, g, pb, weight_scale=torch.ones(4096), pieces=block,
            block_k=pb),
        "down_block": lambda: ns.linear_residual_pieces_triton(
            xd, fp8(4096, 14336)[0], r, g, pb, weight_scale=torch.ones(4096), pieces=block_d,
            block_k=gb),
    }


def record(fn: Callable[[], object], pdl: bool) -> dict:
    """The one _linear_kernel launch fn makes, as tests/sm90_compile.py records it (not run).
    pdl: compile the PDL launch's code (linear.PDL_VARIANT), as the GPU launches one row (and
    several rows only with FUSER_PDL_ROWS)."""
    from fuser.ops import linear
    from sm90_compile import record_launches

    pdl_variant, linear.PDL_VARIANT = linear.PDL_VARIANT, pdl
    try:
        seen = record_launches(linear, "_linear_kernel", fn, run_kernels=False)
    finally:
        linear.PDL_VARIANT = pdl_variant
    assert len(seen) == 1, f"expected one launch, got {len(seen)}"
    return seen[0]


def sass_counts(sass: str) -> dict[str, int]:
    """Instructions, spill stores and loads (all and inside loops: between a backward branch's
    target and the branch) of one kernel's SASS (cuobjdump -sass)."""
    code = [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line) for line in sass.splitlines()) if m]
    loops = []
    for address, text in code:
        target = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            loops.append((int(target.group(1), 16), address))

    def in_loop(address: int) -> bool:
        return any(lo <= address <= hi for lo, hi in loops)

    counts = {"instructions": len(code)}
    for op in ("STL", "LDL"):
        hits = [a for a, text in code if re.search(rf"\b{op}\b", text)]
        counts[op] = len(hits)
        counts[f"{op}_in_loops"] = sum(map(in_loop, hits))
    return counts


def inspect(launch: dict) -> dict:
    """Registers, stack and SASS counts of one recorded launch compiled for sm_90."""
    import triton
    from sm90_compile import compile_sm90

    compiled = compile_sm90(launch)
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no register usage in cuobjdump's output: {usage[:300]}")
    return {"registers": int(found.group(1)), "stack": int(found.group(2)), **sass_counts(sass)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5)
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--cases", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("sass_lab.py compiles for the GPU: run it without TRITON_INTERPRET=1")
    import triton

    table = cases(args.rows)
    names = args.cases.split(",") if args.cases else list(table)
    unknown = sorted(set(names) - set(table))
    if unknown:
        sys.exit(f"unknown cases {unknown}; known: {', '.join(table)}")
    print(f"Triton {triton.__version__}, sm_90, {args.rows} rows")
    results = {}
    for name in names:
        launch = record(table[name], pdl=name.endswith("_one"))
        default = launch["kwargs"]["num_warps"]
        for warps in (int(w) for w in args.warps.split(",")):
            launch["kwargs"]["num_warps"] = warps
            key = f"{name} w{warps}" + ("*" if warps == default else "")
            try:
                results[key] = found = inspect(launch)
            except Exception as error:  # noqa: BLE001  (no CUDA backend tools here)
                print(f"SKIP {type(error).__name__}: {str(error)[:300]}")
                return
            tile = {k: launch["kwargs"].get(k) for k in ("BLOCK_N", "BLOCK_K", "SPLIT_K")}
            print(f"{key:22s} {tile} stages {launch['kwargs'].get('num_stages')}: "
                  f"{found['registers']} registers, stack {found['stack']} B, "
                  f"spill loads {found['LDL']} ({found['LDL_in_loops']} in loops), "
                  f"stores {found['STL']} ({found['STL_in_loops']} in loops), "
                  f"{found['instructions']} instructions")
    if args.out:
        Path(args.out).write_text(json.dumps({"triton": triton.__version__, "rows": args.rows,
                                              "kernels": results}, indent=1))


if __name__ == "__main__":
    main()
