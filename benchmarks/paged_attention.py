"""Paged against contiguous decode/verify attention at the Llama-3-8B shape, on the GPU.

    python benchmarks/paged_attention.py [--out paged.json] [--max-ratio 1.05]
    python benchmarks/paged_attention.py --dry-run     # CPU, tiny shapes, untimed

The split-K kernel (`fuser::cache_attention_read`) and the fused rotary + cache write +
attention kernel (`fuser::rotary_cache_attention`), each once over the contiguous cache
[B, S, KV, D] and once over a paged pool [num_blocks, PAGE, KV, D] read through a block table
(runtime/blocks.py), with the rows' blocks scattered over the pool in a random order (the worst
layout a long-running server reaches). 32 query heads, 8 kv heads, D 128, bf16, PAGE 16;
batch 1, 16, 64; context 1024 and 4096 (every row full); T = 1 (decode) and 5 (gamma 4 verify).
The same number of splits on both sides, so the two walk the same slots in the same order:
the outputs must be equal bit for bit (checked), and the time differs only by the table reads.

Time per call by CUDA-graph replay (benchmarks/timing.py; K/V rotated over copies past the
L2). The table prints both times and paged / contiguous; the exit status is 1 when a case's
ratio exceeds --max-ratio (default 1.05) or an output differs, 2 without CUDA (not --dry-run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import copies_for, log, time_us  # noqa: E402

from fuser.ops.attention import (BLOCK_N, TARGET_PROGRAMS, _num_splits,  # noqa: E402
                                 cache_attention_read_triton)
from fuser.ops.rotary_attention import rotary_cache_attention_triton  # noqa: E402

H, KV, D, PAGE = 32, 8, 128, 16


def make(B: int, ctx: int, T: int, device: str, dtype: torch.dtype, seed: int):
    """Inputs of one case: q, k, v (new tokens), cos, sin, seq_lens, starts, the contiguous
    caches, and the paged pools with their table (same contents)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    S = ctx + 16
    max_blocks = -(-S // PAGE)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    q = randn(B, T, H, D).transpose(1, 2)
    k, v = randn(B, T, KV, D).transpose(1, 2), randn(B, T, KV, D).transpose(1, 2)
    angle = torch.rand(1, T, D // 2, generator=g) * 6.28
    cos = torch.cat([angle.cos()] * 2, -1).to(dtype).to(device)
    sin = torch.cat([angle.sin()] * 2, -1).to(dtype).to(device)
    seq_lens = torch.full((B,), ctx, dtype=torch.int64, device=device)
    starts = torch.zeros(B, dtype=torch.int64, device=device)
    k_cache, v_cache = randn(B, S, KV, D), randn(B, S, KV, D)
    num_blocks = 1 + B * max_blocks
    order = torch.randperm(num_blocks - 1, generator=g) + 1           # scattered blocks
    table = order.view(B, max_blocks).to(torch.int32).to(device)
    pad = max_blocks * PAGE - S
    pools = []
    for cache in (k_cache, v_cache):
        padded = torch.cat([cache, cache.new_zeros(B, pad, KV, D)], 1)
        pool = cache.new_zeros(num_blocks, PAGE, KV, D)
        pool[table.long().flatten()] = padded.view(B * max_blocks, PAGE, KV, D)
        pools.append(pool)
    return q, k, v, cos, sin, seq_lens, starts, (k_cache, v_cache), tuple(pools), table


def run_case(B: int, ctx: int, T: int, device: str, dry_run: bool) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, cos, sin, lens, starts, (kc, vc), (kp, vp), table = make(B, ctx, T, device, dtype, 0)
    S = kc.shape[1]
    splits = _num_splits(B * KV, S, BLOCK_N, TARGET_PROGRAMS)
    scale = D**-0.5
    row: dict = {"B": B, "ctx": ctx, "T": T, "page": PAGE, "splits": splits}
    # The caches are rotated over copies (past the L2), as a step streams them from HBM.
    copies = 1 if dry_run else copies_for(2 * kc.numel() * kc.element_size())
    contiguous = [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(copies - 1)]
    paged = [(kp, vp)] + [(kp.clone(), vp.clone()) for _ in range(copies - 1)]
    ops = {
        "read": lambda kk, vv, tab: cache_attention_read_triton(
            q, kk, vv, lens, starts, scale, 0, 0.0, tab, num_splits=splits),
        # the rotary op writes the T new slots each call: same slots each time, same values
        "rotary": lambda kk, vv, tab: rotary_cache_attention_triton(
            q, k, v, cos, sin, kk, vv, lens, starts, scale, 0, 0.0, tab, num_splits=splits),
    }
    for name, op in ops.items():
        want = op(kc, vc, None)
        got = op(kp, vp, table)
        row[f"{name}_equal"] = bool(torch.equal(want, got))
        if dry_run:
            continue
        t_contig = time_us([lambda c=c: op(c[0], c[1], None) for c in contiguous])
        t_paged = time_us([lambda c=c: op(c[0], c[1], table) for c in paged])
        row[f"{name}_contiguous_us"] = t_contig.us
        row[f"{name}_paged_us"] = t_paged.us
        row[f"{name}_ratio"] = t_paged.us / t_contig.us
        row[f"{name}_method"] = t_paged.method
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--max-ratio", type=float, default=1.05,
                        help="fail when paged / contiguous exceeds this (default 1.05)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, no timing")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        log("paged_attention: needs a CUDA GPU (or --dry-run)")
        return 2
    device = "cpu" if args.dry_run else "cuda"
    cases = ([(1, 48, 1), (2, 40, 5)] if args.dry_run else
             [(B, ctx, T) for B in (1, 16, 64) for ctx in (1024, 4096) for T in (1, 5)])
    rows, bad = [], False
    log(f"{'B':>3} {'ctx':>5} {'T':>2}  {'read contig':>11} {'paged':>8} {'ratio':>6}  "
        f"{'rotary contig':>13} {'paged':>8} {'ratio':>6}  equal")
    for B, ctx, T in cases:
        row = run_case(B, ctx, T, device, args.dry_run)
        rows.append(row)
        equal = row["read_equal"] and row["rotary_equal"]
        over = [n for n in ("read", "rotary") if row.get(f"{n}_ratio", 0) > args.max_ratio]
        bad |= not equal or bool(over)
        cells = []
        for n in ("read", "rotary"):
            if args.dry_run:
                cells.append(f"{'-':>11} {'-':>8} {'-':>6}")
            else:
                cells.append(f"{row[f'{n}_contiguous_us']:>9.1f}us {row[f'{n}_paged_us']:>6.1f}us "
                             f"{row[f'{n}_ratio']:>6.3f}")
        log(f"{B:>3} {ctx:>5} {T:>2}  {cells[0]}  {cells[1]:>29}  {equal}"
            + (f"  OVER {args.max_ratio}: {', '.join(over)}" if over else ""))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    if not args.dry_run:
        ratios = [r[f"{n}_ratio"] for r in rows for n in ("read", "rotary")]
        log(f"paged / contiguous: max {max(ratios):.3f}, geomean "
            f"{torch.tensor(ratios).log().mean().exp().item():.3f} over {len(ratios)} cases")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
