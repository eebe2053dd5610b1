"""FP8 ops at Llama-3-8B shapes on the GPU: the decode GEMV over e4m3fn weights and the prefill
FP8 GEMM with its fused activation quantization, against bf16.

    python3 benchmarks/fp8_ops.py --out $OUT/fp8_ops.json [--only qkv ...] [--no-sweep]
    python3 benchmarks/fp8_ops.py --dry-run     # CPU (TRITON_INTERPRET), tiny shapes, untimed

Shapes (N, K): qkv 6144x4096, o_proj 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096. Weights: random bf16 (std 0.02), quantized once by fuser.ops.fp8.quantize_weight.

Decode (M = 1, 5, 9 rows of bf16 activations), per shape and M:
  cublas      F.linear(x, w_bf16)
  linear      torch.ops.fuser.linear(x, w_bf16)            (fuser's bf16 GEMV)
  fp8         torch.ops.fuser.fp8_linear(x, w_fp8, scale)  (the same kernel, e4m3fn weights)
  sweep       linear_triton(x, w_fp8, weight_scale=scale, block_n, block_k, num_warps,
              num_stages) over SWEEP configs, each timed by a short scan; the CONFIRM best are
              timed again in full and the best of those is printed, to update
              fuser/ops/gemv_tables.py's _default_fp8_config. The sweep stops (and says so) when the
              run passes SWEEP_BUDGET_S, so the script ends within about 3 minutes.
  Timing (benchmarks/timing.py): CUDA-graph replay of 20 back-to-back calls, do_bench median per
  call, weights rotated over copies_for(their bytes) copies so no call reads them from L2.
  Bytes = weight (+ 4N of scales for FP8) + x + out, as GB/s and % of the measured read
  bandwidth (a sum over 2 GiB of bf16).

Prefill (M = 2048 tokens), per shape:
  bf16        F.linear(x, w_bf16) (cuBLAS)
  fp8_mm      torch.ops.fuser.fp8_scaled_mm(x_fp8, x_scale, w_fp8, w_scale, bf16)
  quant+mm    the producer of the activation with quantization fused, then fp8_mm: rms_norm_quant
              (qkv, gate_up, lm_head), add_rms_norm_quant (o_proj: the residual add + norm
              that follows attention stands in for it), gated_act_quant over gate_up's
              [2048, 2 x 14336] output (down);
  bf16 chain  the same producer in bf16 (fuser::rms_norm / add_rms_norm / gated_act) then
              F.linear: what quant+mm replaces.
  As TFLOP/s (2 M N K) and us; compute-bound, so weights are not rotated.

Each output is checked once against its reference (relative error ||out - ref|| / ||ref|| in
fp32; the FP8 decode GEMV against fuser.ops.fp8.fp8_linear_reference, the prefill GEMMs against
fp8_scaled_mm_reference of the same codes) and flagged above TOLERANCE. Exit status 0; 1 if a
check is flagged or a case failed; 2 without CUDA (unless --dry-run).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys
import time
from typing import Any, Callable

if "--dry-run" in sys.argv:  # before triton.jit runs: the kernels run under the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import fuser.ops  # noqa: E402,F401  (registers torch.ops.fuser.*)
from fuser.ops.fp8 import (fp8_linear_reference, fp8_scaled_mm_reference,  # noqa: E402
                           quantize_rows, quantize_weight)
from fuser.ops.fp8_quant import (add_rms_norm_quant_triton, gated_act_quant_triton,  # noqa: E402
                                 rms_norm_quant_triton)
from fuser.ops.linear import linear_triton  # noqa: E402
from timing import (EAGER_LAUNCH, copies_for, log, measure_read_bandwidth,  # noqa: E402
                    missing_gpu, num, time_us)

DTYPE = torch.bfloat16
EPS = 1e-5
TOLERANCE = 2e-2
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}            # (N, K)
TINY_SHAPES = {"qkv": (96, 64), "gate_up": (160, 64), "down": (64, 80)}
ROWS = (1, 5, 9)
PREFILL_ROWS, TINY_PREFILL_ROWS = 2048, 24
MAX_TILE = 32768  # block_n * block_k elements
# 14 configs at M = 1, 10 at M > 1 (block_n 8 is refused there): each new one costs a Triton
# compile (~1 s), which is what bounds the sweep's size within the 3-minute budget.
SWEEP = [dict(block_n=n, block_k=k, num_warps=w, num_stages=4)
         for n, k, w in itertools.product((8, 16, 32, 64), (512, 1024), (4, 8))
         if n * k <= MAX_TILE]
TINY_SWEEP = [dict(block_n=16, block_k=32, num_warps=4, num_stages=3)]
SWEEP_BUDGET_S = 150.0
SCAN = dict(warmup=5, rep=20)
FULL = dict(warmup=25, rep=100)
CONFIRM = 2


def label(config: dict) -> str:
    return "default" if not config else (
        f"n{config['block_n']} k{config['block_k']} w{config['num_warps']} s{config['num_stages']}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


class Bench:
    """Times callables (or just runs them once in a dry run) and derives GB/s, % of bandwidth."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.bandwidth = float("nan") if dry_run else measure_read_bandwidth()

    def time(self, fns: list[Callable[[], Any]], nbytes: int = 0, flops: int = 0,
             bench: dict = FULL) -> dict:
        if self.dry_run:
            for fn in fns:
                fn()
            return {"us": None}
        t = time_us(fns, **bench)
        r: dict = {"us": t.us, "timing": t.method}
        if t.note:
            r["timing_note"] = t.note
        if nbytes:
            r["gbps"] = nbytes / (t.us * 1e-6) / 1e9
            r["pct_bw"] = 100 * r["gbps"] * 1e9 / self.bandwidth
        if flops:
            r["tflops"] = flops / (t.us * 1e-6) / 1e12
        return r


def fmt(r: dict | None, key: str = "us", spec: str = ".1f") -> str:
    r = r or {}
    mark = "~" if key == "us" and r.get("timing") == EAGER_LAUNCH else ""
    return num(r.get(key), spec) + mark


def attempt(row: dict, stage: str, fn: Callable[[], dict]) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 -- one failing stage must not end the run
        row.setdefault("errors", {})[stage] = f"{type(e).__name__}: {e}"[:300]
        return {}


def decode_cases(bench: Bench, shapes: dict, device: str, sweep: list[dict],
                 started: float) -> list[dict]:
    rows = []
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=device).manual_seed(N + K)
        w = torch.randn(N, K, device=device, generator=g, dtype=DTYPE) * 0.02
        q, s = quantize_weight(w)
        n_bf16 = 2 if bench.dry_run else copies_for(w.numel() * 2)
        n_fp8 = 2 if bench.dry_run else copies_for(q.numel())
        bf16s = [w] + [w.clone() for _ in range(n_bf16 - 1)]
        fp8s = [(q, s)] + [(q.clone(), s.clone()) for _ in range(n_fp8 - 1)]
        for M in ROWS:
            x = torch.randn(M, K, device=device, generator=g, dtype=DTYPE)
            bytes_bf16 = (N * K + M * K + M * N) * 2
            bytes_fp8 = N * K + 4 * N + (M * K + M * N) * 2
            row: dict = {"shape": name, "N": N, "K": K, "M": M, "copies_bf16": n_bf16,
                         "copies_fp8": n_fp8, "bytes_bf16": bytes_bf16, "bytes_fp8": bytes_fp8}
            ref = fp8_linear_reference(x, q, s)

            def check(out: torch.Tensor, r: dict) -> dict:
                r["rel_err"] = rel_err(out, ref)
                r["flagged"] = not r["rel_err"] <= TOLERANCE
                return r

            row["cublas"] = attempt(row, "cublas", lambda: bench.time(
                [functools.partial(F.linear, x, wc) for wc in bf16s], bytes_bf16))
            row["linear"] = attempt(row, "linear", lambda: bench.time(
                [functools.partial(torch.ops.fuser.linear, x, wc) for wc in bf16s], bytes_bf16))
            # the fp8 op (CPU: the reference) and its kernel at the default config
            row["fp8"] = attempt(row, "fp8", lambda: check(
                linear_triton(x, q, weight_scale=s), bench.time(
                    [functools.partial(torch.ops.fuser.fp8_linear, x, qc, sc) for qc, sc in fp8s],
                    bytes_fp8)))
            results = []
            for config in sweep:
                if M > 1 and config["block_n"] < 16:
                    continue  # the MMA path needs block_n >= 16
                if not bench.dry_run and time.perf_counter() - started > SWEEP_BUDGET_S:
                    row["sweep_stopped"] = f"time budget {SWEEP_BUDGET_S:.0f} s reached"
                    break
                r = {"config": label(config), "overrides": config}
                r.update(attempt(r, "run", lambda: check(
                    linear_triton(x, q, weight_scale=s, **config), bench.time(
                        [functools.partial(linear_triton, x, qc, weight_scale=sc, **config)
                         for qc, sc in fp8s], bytes_fp8, bench=SCAN))))
                results.append(r)
            ok = sorted((r for r in results if r.get("us") is not None and not r.get("flagged")),
                        key=lambda r: r["us"])
            for r in ok[:CONFIRM]:
                r["scan_us"] = r["us"]
                r.update(attempt(r, "full", lambda: bench.time(
                    [functools.partial(linear_triton, x, qc, weight_scale=sc, **r["overrides"])
                     for qc, sc in fp8s], bytes_fp8)))
            row["best"] = min(ok[:CONFIRM], key=lambda r: r["us"]) if ok else None
            row["sweep"] = results
            row["flagged"] = sum(bool(r.get("flagged")) for r in [row["fp8"], *results])
            row["failed"] = len(row.get("errors", {})) + sum("errors" in r for r in results)
            rows.append(row)
            best = row["best"] or {}
            log(f"decode {name} M={M}: cuBLAS bf16 {fmt(row['cublas'])} us, fuser bf16 "
                f"{fmt(row['linear'])} us, fp8 {fmt(row['fp8'])} us "
                f"({fmt(row['fp8'], 'pct_bw', '.0f')}% bw), best fp8 {fmt(best)} us "
                f"{best.get('config', '-')}; err {num(row['fp8'].get('rel_err'), '.1e')}"
                f"{'; ' + row['sweep_stopped'] if 'sweep_stopped' in row else ''}")
        del bf16s, fp8s, w, q, s
        if not bench.dry_run:
            torch.cuda.empty_cache()
    return rows


def prefill_cases(bench: Bench, shapes: dict, device: str, M: int) -> list[dict]:
    rows = []
    for name, (N, K) in shapes.items():
        g = torch.Generator(device=device).manual_seed(N + K + 1)
        w = torch.randn(N, K, device=device, generator=g, dtype=DTYPE) * 0.02
        q, s = quantize_weight(w)
        norm_w = 1 + 0.1 * torch.randn(K, device=device, generator=g, dtype=DTYPE)
        flops = 2 * M * N * K
        row: dict = {"shape": name, "N": N, "K": K, "M": M, "flops": flops}
        # the producer of the GEMM's input, bf16 and fused with quantization
        if name == "down":
            src = torch.randn(M, 2 * K, device=device, generator=g, dtype=DTYPE)
            producer = "gated_act"
            bf16_in = functools.partial(torch.ops.fuser.gated_act, src, "silu")
            quant_in = functools.partial(torch.ops.fuser.gated_act_quant, src, "silu")
            kernel_in = functools.partial(gated_act_quant_triton, src, "silu")
        elif name == "o_proj":
            src = torch.randn(M, K, device=device, generator=g, dtype=DTYPE)
            res = torch.randn(M, K, device=device, generator=g, dtype=DTYPE)
            producer = "add_rms_norm"
            bf16_in = lambda: torch.ops.fuser.add_rms_norm(src, res, norm_w, EPS)[0]  # noqa: E731
            quant_in = lambda: torch.ops.fuser.add_rms_norm_quant(src, res, norm_w, EPS)[:2]  # noqa: E731
            kernel_in = lambda: add_rms_norm_quant_triton(src, res, norm_w, EPS)[:2]  # noqa: E731
        else:
            src = torch.randn(M, K, device=device, generator=g, dtype=DTYPE)
            producer = "rms_norm"
            bf16_in = functools.partial(torch.ops.fuser.rms_norm, src, norm_w, EPS)
            quant_in = functools.partial(torch.ops.fuser.rms_norm_quant, src, norm_w, EPS)
            kernel_in = functools.partial(rms_norm_quant_triton, src, norm_w, EPS)
        row["producer"] = producer
        x = bf16_in()
        xq, xs = quantize_rows(x)

        def fp8_mm() -> torch.Tensor:
            return torch.ops.fuser.fp8_scaled_mm(xq, xs, q, s, DTYPE)

        def quant_mm() -> torch.Tensor:
            codes, scale = quant_in()
            return torch.ops.fuser.fp8_scaled_mm(codes, scale, q, s, DTYPE)

        def bf16_chain() -> torch.Tensor:
            return F.linear(bf16_in(), w)

        def checked(fn: Callable[[], torch.Tensor], ref: torch.Tensor, r: dict) -> dict:
            r["rel_err"] = rel_err(fn(), ref)
            r["flagged"] = not r["rel_err"] <= TOLERANCE
            return r

        ref_fp8 = fp8_scaled_mm_reference(xq, xs, q, s, torch.float32)
        row["bf16"] = attempt(row, "bf16", lambda: bench.time([functools.partial(F.linear, x, w)],
                                                              flops=flops))
        row["fp8_mm"] = attempt(row, "fp8_mm", lambda: checked(
            fp8_mm, ref_fp8, bench.time([fp8_mm], flops=flops)))
        row["quant_mm"] = attempt(row, "quant_mm", lambda: checked(
            quant_mm, ref_fp8, bench.time([quant_mm], flops=flops)))
        row["bf16_chain"] = attempt(row, "bf16_chain", lambda: bench.time([bf16_chain],
                                                                          flops=flops))
        # The fused quantization kernel alone. On the GPU its codes must equal quantize_rows of
        # the unfused kernel's output bit for bit (fuser/ops/fp8_quant.py); the dry run does not
        # run it under the interpreter, whose fp32 -> fp8 cast is wrong (tests/test_ops_fp8.py
        # corrects it there and tests the kernels).
        def quant_kernel() -> dict:
            r = bench.time([quant_in], nbytes=src.numel() * 2 + M * K + 4 * M)
            if device == "cuda":
                codes, scale = kernel_in()
                r["codes_equal"] = float((codes.view(torch.uint8) == xq.view(torch.uint8))
                                         .double().mean())
                r["flagged"] = r["codes_equal"] != 1.0 or not torch.equal(scale, xs)
            return r

        row["quant_kernel"] = attempt(row, "quant_kernel", quant_kernel)
        row["flagged"] = sum(bool(row[k].get("flagged")) for k in ("fp8_mm", "quant_mm",
                                                                     "quant_kernel"))
        row["failed"] = len(row.get("errors", {}))
        rows.append(row)
        log(f"prefill {name} M={M}: bf16 {fmt(row['bf16'])} us "
            f"({fmt(row['bf16'], 'tflops', '.0f')} TFLOP/s), fp8_mm {fmt(row['fp8_mm'])} us "
            f"({fmt(row['fp8_mm'], 'tflops', '.0f')}), {producer}_quant+mm "
            f"{fmt(row['quant_mm'])} us vs bf16 {producer}+mm {fmt(row['bf16_chain'])} us; "
            f"quant kernel {fmt(row['quant_kernel'])} us "
            f"({fmt(row['quant_kernel'], 'gbps', '.0f')} GB/s)")
        del w, q, s, x, xq, xs, src
        if not bench.dry_run:
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--only", nargs="+", choices=list(SHAPES), metavar="SHAPE")
    parser.add_argument("--no-sweep", action="store_true", help="skip the fp8 GEMV config sweep")
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU under TRITON_INTERPRET, tiny shapes, no timing")
    args = parser.parse_args()
    if missing_gpu("fp8_ops.py", args.dry_run):
        return 2
    started = time.perf_counter()
    device = "cpu" if args.dry_run else "cuda"
    shapes = TINY_SHAPES if args.dry_run else SHAPES
    if args.only:
        shapes = {k: v for k, v in shapes.items() if k in args.only}
    sweep = [] if args.no_sweep else (TINY_SWEEP if args.dry_run else SWEEP)
    bench = Bench(args.dry_run)
    if not args.dry_run:
        log(f"read bandwidth {bench.bandwidth / 1e12:.2f} TB/s; {len(sweep)} fp8 GEMV configs")
    decode = decode_cases(bench, shapes, device, sweep, started)
    prefill = prefill_cases(bench, shapes, device,
                            TINY_PREFILL_ROWS if args.dry_run else PREFILL_ROWS)
    seconds = time.perf_counter() - started
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"bandwidth": None if bench.bandwidth != bench.bandwidth else bench.bandwidth,
                       "dry_run": args.dry_run, "tolerance": TOLERANCE, "decode": decode,
                       "prefill": prefill, "seconds": seconds}, f, indent=2)

    log(f"\n{'decode':<8}{'M':>3} |{'cuBLAS bf16':>12}{'%bw':>5} |{'fuser bf16':>11}{'%bw':>5} |"
        f"{'fp8 us':>8}{'GB/s':>6}{'%bw':>5} |{'best us':>8}{'%bw':>5}  best fp8 config")
    for r in decode:
        c, lin, f8, b = r["cublas"], r["linear"], r["fp8"], r["best"] or {}
        log(f"{r['shape']:<8}{r['M']:>3} |{fmt(c):>12}{fmt(c, 'pct_bw', '.0f'):>5} |"
            f"{fmt(lin):>11}{fmt(lin, 'pct_bw', '.0f'):>5} |{fmt(f8):>8}"
            f"{fmt(f8, 'gbps', '.0f'):>6}{fmt(f8, 'pct_bw', '.0f'):>5} |{fmt(b):>8}"
            f"{fmt(b, 'pct_bw', '.0f'):>5}  {b.get('config', '-')}")
    log(f"\n{'prefill':<8}{'M':>5} |{'bf16 us':>9}{'TF/s':>6} |{'fp8_mm us':>10}{'TF/s':>6} |"
        f"{'quant+mm':>9} |{'bf16 chain':>11}  producer")
    for r in prefill:
        log(f"{r['shape']:<8}{r['M']:>5} |{fmt(r['bf16']):>9}{fmt(r['bf16'], 'tflops', '.0f'):>6} |"
            f"{fmt(r['fp8_mm']):>10}{fmt(r['fp8_mm'], 'tflops', '.0f'):>6} |"
            f"{fmt(r['quant_mm']):>9} |{fmt(r['bf16_chain']):>11}  {r['producer']}")
    flagged = sum(r["flagged"] for r in decode + prefill)
    failed = sum(r["failed"] for r in decode + prefill)
    if args.dry_run:
        log(f"dry run on CPU (interpreter), tiny shapes, no timing: {len(decode)} decode and "
            f"{len(prefill)} prefill cases, {failed} failed, {flagged} over rel err {TOLERANCE}; "
            f"{seconds:.0f} s")
    else:
        log(f"us per call by CUDA-graph replay (~ = eager launch); decode weights rotated over "
            f">= 200 MB; read bandwidth {bench.bandwidth / 1e12:.2f} TB/s; {failed} failed, "
            f"{flagged} over rel err {TOLERANCE}; {seconds:.0f} s")
    return 1 if failed or flagged else 0


if __name__ == "__main__":
    sys.exit(main())
