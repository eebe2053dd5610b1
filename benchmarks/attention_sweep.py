"""Tuning sweep of fuser::cache_attention_read's Triton launcher at Llama-3-8B shapes (H200).

    python3 benchmarks/attention_sweep.py --out $OUT/attention_sweep.json

32 query heads over 8 kv heads, head dim 128, bf16, batch 1, contexts 1024 and 8192, T 1 and 9.
For each case, every combination of the launcher's tuning overrides (block_n, target_programs,
num_warps, num_stages) is checked against the reference once and timed (do_bench median); the
table gives the default's time, the best configuration, and both as % of the read bandwidth
(K and V of the visible slots are the bytes that must move).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

from fuser.ops.attention import cache_attention_read_triton, cache_attention_reference

KV, REP, D = 8, 4, 128
CONFIGS = [dict(block_n=b, target_programs=p, num_warps=w, num_stages=s)
           for b, p, w, s in itertools.product([64, 128], [264, 528], [4, 8], [2, 3])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    bandwidth = x.numel() * 2 / (do_bench(lambda: x.sum(), warmup=50, rep=200,
                                          return_mode="median") * 1e-3)
    del x
    print(f"read bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for ctx, T in itertools.product([1024, 8192], [1, 9]):
        S = ctx + 16
        g = torch.Generator(device="cuda").manual_seed(ctx + T)
        q = torch.randn(1, KV * REP, T, D, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, S, KV, D, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, S, KV, D, device="cuda", generator=g, dtype=torch.bfloat16)
        seq_lens = torch.tensor([ctx], device="cuda")
        starts = torch.zeros(1, dtype=torch.long, device="cuda")
        call = (q, k, v, seq_lens, starts, D**-0.5, 0, 0.0)
        ref = cache_attention_reference(*call).float()
        nbytes = 2 * (ctx + T) * KV * D * 2 + 2 * q.numel() * 2
        eager_us = do_bench(lambda: cache_attention_reference(*call), warmup=25, rep=100,
                            return_mode="median") * 1e3
        results = []
        for config in [{}] + CONFIGS:
            out = cache_attention_read_triton(*call, **config).float()
            err = float((out - ref).norm() / ref.norm())
            us = do_bench(lambda: cache_attention_read_triton(*call, **config), warmup=25,
                          rep=100, return_mode="median") * 1e3
            results.append({"config": config or "default", "us": us, "rel_err": err,
                             "pct_bw": 100 * nbytes / (us * 1e-6) / bandwidth})
        best = min(results[1:], key=lambda r: r["us"])
        row = {"ctx": ctx, "T": T, "eager_us": eager_us, "default": results[0], "best": best,
               "all": results, "worst_rel_err": max(r["rel_err"] for r in results)}
        rows.append(row)
        print(f"ctx {ctx} T {T}: eager {eager_us:.1f} us, default {results[0]['us']:.1f} us, "
              f"best {best['us']:.1f} us {best['config']}, worst err {row['worst_rel_err']:.1e}",
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=2)
    print(f"\n{'ctx':>5}{'T':>3}{'eager us':>10}{'default us':>12}{'%bw':>6}{'best us':>9}{'%bw':>6}  best config")
    for r in rows:
        d, b = r["default"], r["best"]
        c = b["config"]
        print(f"{r['ctx']:>5}{r['T']:>3}{r['eager_us']:>10.1f}{d['us']:>12.1f}{d['pct_bw']:>6.1f}"
              f"{b['us']:>9.1f}{b['pct_bw']:>6.1f}  bn{c['block_n']} p{c['target_programs']} "
              f"w{c['num_warps']} s{c['num_stages']}")


if __name__ == "__main__":
    main()
