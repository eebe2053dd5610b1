"""The prefill's flash attention with its key range split over programs against unsplit (GPU).

    python benchmarks/flash_prefill.py [--out flash_prefill.json] [--splits 2 4 8] [--block-m 64]
    python benchmarks/flash_prefill.py --dry-run   # CPU (Triton interpreter), tiny, untimed

`fuser.ops.flash_prefill.flash_prefill` at the Llama-3-8B shape (32 query heads, 8 kv heads,
D 128, bf16, B 1) in four cases:
  hit128    a prefix-cache hit's chunk: 128 queries after 1,024 cached tokens (1,152 keys),
            paged (16-slot blocks scattered over the pool), as the chunk step runs it
  chunk512  512 queries after 1,536 cached tokens (2,048 keys), paged
  prefill   the plain 2,048-token causal prefill (contiguous k/v, no cache): 512 programs
  prefill1k the same at 1,024 tokens: 256 programs, two waves
each with splits = 1 (the single kernel), every --splits value, and the default (what
flash_prefill runs, marked `*`: `default_splits` over a paged cache, 1 for contiguous k/v), at
the kernel's default query tile (BLOCK_M 128) and every --block-m (default 64);
--mask-all-off adds the rows with mask_all=False. "vs unsplit" is the speedup over splits = 1
at the default tile with every key block masked (today's kernel).

Time per call by CUDA-graph replay (benchmarks/timing.py: warm-up, 20 calls per graph,
do_bench median), as the engine's step graph runs the op, so that the split path's second
launch and scratch allocation cost what they cost in a graph; k/v are rotated over copies past
the L2 (one layer's keys come from HBM in a step), q is not. Inputs are random normal (q x 2).

Each output is checked against the reference (masked_attention, fp32 scores):
||out - ref|| / ||ref|| in fp32, flagged above 2e-2. The table prints the time, the speedup over
today's kernel, and the error. Exit status: 0; 1 if an error was flagged;
2 without CUDA (unless --dry-run).
"""

from __future__ import annotations

import os
import sys

if "--dry-run" in sys.argv:  # before triton is imported: the kernels run interpreted on CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copies_for, log, missing_gpu, time_us  # noqa: E402

from fuser.ops.attention import cache_attention_reference, prefill_attention_reference  # noqa: E402
from fuser.ops.flash_prefill import (_blocks, default_splits, flash_prefill,  # noqa: E402
                                     prefill_splits)

PAGE = 16
MAX_REL_ERR = 2e-2


@dataclass(frozen=True)
class Case:
    name: str
    T: int          # queries
    prefix: int     # cached keys before them (paged); 0 and paged False: a plain prefill
    paged: bool


@dataclass
class Row:
    case: str
    block_m: int
    splits: int
    default: bool
    mask_all: bool
    us: float | None
    method: str
    rel_err: float
    speedup: float | None = None  # over splits = 1, the same mask_all


CASES = [Case("hit128", 128, 1024, True), Case("chunk512", 512, 1536, True),
         Case("prefill", 2048, 0, False), Case("prefill1k", 1024, 0, False)]
DRY_CASES = [Case("hit128", 24, 40, True), Case("chunk512", 40, 60, True),
             Case("prefill", 50, 0, False), Case("prefill1k", 33, 0, False)]


def make(case: Case, H: int, KV: int, D: int, device: str, dtype: torch.dtype, seed: int,
         copies: int):
    """(list of flash_prefill argument tuples, one per k/v copy; the reference output)."""
    g = torch.Generator().manual_seed(seed)
    S = case.prefix + case.T
    q = (torch.randn(1, case.T, H, D, generator=g) * 2).to(dtype).to(device).transpose(1, 2)
    starts = torch.zeros(1, dtype=torch.int64, device=device)
    slots = case.prefix + torch.arange(case.T, device=device)[None]       # [1, T]
    arg_sets = []
    if not case.paged:
        for c in range(copies):
            k = torch.randn(1, KV, S, D, generator=g).to(dtype).to(device)
            v = torch.randn(1, KV, S, D, generator=g).to(dtype).to(device)
            arg_sets.append((q, k, v, slots, starts, D**-0.5, 0, 0.0))
        ref = prefill_attention_reference(*arg_sets[0])
        return arg_sets, ref
    blocks = -(-S // PAGE)
    for c in range(copies):
        k_cache = torch.randn(1, S, KV, D, generator=g).to(dtype).to(device)
        v_cache = torch.randn(1, S, KV, D, generator=g).to(dtype).to(device)
        order = torch.randperm(blocks, generator=g) + 1                  # block 0: unused
        table = order[None].to(torch.int32).to(device)                   # [1, blocks]
        pad = blocks * PAGE - S
        pools = []
        for cache in (k_cache, v_cache):
            pool = torch.zeros(blocks + 1, PAGE, KV, D, dtype=dtype, device=device)
            full = torch.cat([cache[0], cache.new_zeros(pad, KV, D)]).view(blocks, PAGE, KV, D)
            pool[order.to(device)] = full
            pools.append(pool)
        arg_sets.append((q, pools[0], pools[1], slots, starts, D**-0.5, 0, 0.0, table))
        if c == 0:
            lens = torch.tensor([case.prefix], device=device)
            ref = cache_attention_reference(q, k_cache, v_cache, lens, starts, D**-0.5, 0, 0.0)
    return arg_sets, ref


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def run_case(case: Case, args: argparse.Namespace, dry: bool) -> list[Row]:
    H, KV, D = (4, 2, 16) if dry else (32, 8, 128)
    device, dtype = ("cpu", torch.float32) if dry else ("cuda", torch.bfloat16)
    S = case.prefix + case.T
    kv_bytes = 2 * S * KV * D * (4 if dry else 2)
    copies = 2 if dry else copies_for(kv_bytes)
    arg_sets, ref = make(case, H, KV, D, device, dtype, seed=len(case.name), copies=copies)
    default_m, block_n, _, _ = _blocks(D, dtype, not dry)
    n_keys = -(-S // PAGE) * PAGE if case.paged else S
    rows: list[Row] = []
    base_us = None  # splits = 1 at the default tiles, mask_all True: what every row is against
    for block_m in [default_m] + [m for m in args.block_m if m != default_m and not dry]:
        # (flash_prefill splits by default only over a paged cache)
        if not case.paged:
            default = 1
        elif dry:
            default = prefill_splits(triton.cdiv(case.T, block_m) * H,
                                     triton.cdiv(n_keys, block_n))
        else:
            default = default_splits(1, H, case.T, n_keys, D, dtype, block_m)
        for mask_all in (True, False) if args.mask_all_off or dry else (True,):
            for splits in sorted({1, default, *args.splits}):
                fns = [functools.partial(flash_prefill, *a, mask_all=mask_all, splits=splits,
                                         block_m=block_m) for a in arg_sets]
                err = rel_err(fns[0](), ref)
                us, method = None, "untimed"
                if not dry:
                    t = time_us(fns)
                    us, method = t.us, t.method
                row = Row(case.name, block_m, splits, splits == default, mask_all, us, method,
                          err)
                if splits == 1 and block_m == default_m and mask_all:
                    base_us = us
                if us and base_us:
                    row.speedup = base_us / us
                rows.append(row)
                log(f"  {case.name} block_m={block_m} splits={splits}"
                    f"{'*' if row.default else ''} mask_all={mask_all}: "
                    f"{'-' if us is None else f'{us:.1f} us'} err {err:.2e}")
    return rows


def table(rows: list[Row]) -> str:
    lines = ["| case | block_m | splits | mask_all | us | vs unsplit | rel err |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        us = "-" if r.us is None else f"{r.us:.1f}" + ("" if r.method == "cuda-graph" else "~")
        sp = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        flag = " FLAG" if r.rel_err > MAX_REL_ERR else ""
        mark = "*" if r.default else ""
        lines.append(f"| {r.case} | {r.block_m} | {r.splits}{mark} | {r.mask_all} | {us} "
                     f"| {sp} | {r.rel_err:.1e}{flag} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="JSON of the rows")
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8],
                   help="split counts to time besides 1 and the default")
    p.add_argument("--block-m", type=int, nargs="+", default=[128],
                   help="query tiles to time besides the kernel's default (64 at D 128 in 16-bit)")
    p.add_argument("--mask-all-off", action="store_true",
                   help="also time mask_all=False (only the straddling key blocks masked)")
    p.add_argument("--cases", nargs="+", choices=[c.name for c in CASES],
                   default=[c.name for c in CASES])
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, Triton interpreter, tiny shapes, fp32, untimed: the plumbing only")
    args = p.parse_args()
    if missing_gpu("flash_prefill.py", args.dry_run):
        return 2
    if args.dry_run:
        args.splits = [s for s in args.splits if s <= 4]  # the interpreter is slow
    rows: list[Row] = []
    for case in DRY_CASES if args.dry_run else CASES:
        if case.name in args.cases:
            rows += run_case(case, args, args.dry_run)
            if args.out:
                args.out.write_text(json.dumps({
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                    "rows": [asdict(r) for r in rows]}, indent=1))
    log(table(rows))
    flagged = [r for r in rows if r.rel_err > MAX_REL_ERR]
    log(f"{len(rows)} rows, {len(flagged)} flagged (rel err > {MAX_REL_ERR})")
    return 1 if flagged else 0


if __name__ == "__main__":
    sys.exit(main())
