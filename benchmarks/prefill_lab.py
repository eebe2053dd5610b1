"""The FP8 prefill's pieces at the Llama-3-8B shape, against the bf16 GEMMs they replace.

    python benchmarks/prefill_lab.py --tokens 2048 --out $OUT/prefill_lab.json

For each linear of a layer (and the LM head): bf16 cuBLAS (x @ w.T), torch._scaled_mm with
rowwise scales as fuser::fp8_scaled_mm calls it (use_fast_accum False), and the same with
use_fast_accum=True (the FP8 tensor cores' own accumulation between fp32 promotions, which
vLLM's and TensorRT-LLM's FP8 GEMMs use). Then the fused activation-quantization kernels at
the same rows, and fuser::prefill_attention's two CUDA kernels (the Triton flash kernel, SDPA
with a boolean mask). Median of triton.testing.do_bench (L2 flushed), random normal data.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from triton.testing import do_bench

from timing import log, missing_gpu

SHAPES = {  # name: (N, K) of the 8B shape's weights
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "lm_head": (128256, 4096),
}
PER_LAYER = {"qkv": 32, "o_proj": 32, "gate_up": 32, "down": 32, "lm_head": 1}


def bench_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def gemm_rows(M: int) -> list[dict]:
    from fuser.ops.fp8 import quantize_rows

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (N, K) in SHAPES.items():
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        xq, xs = quantize_rows(x)
        wq, ws = quantize_rows(w)
        row = {"name": name, "M": M, "N": N, "K": K,
               "bf16_ms": bench_ms(lambda: x @ w.t())}
        for fast in (False, True):
            def mm(fast=fast):
                return torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                        out_dtype=torch.bfloat16, use_fast_accum=fast)
            row[f"fp8_fast{int(fast)}_ms"] = bench_ms(mm)
        exact = torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                 out_dtype=torch.bfloat16).float()
        fast = torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                out_dtype=torch.bfloat16, use_fast_accum=True).float()
        row["fast_rel_err"] = ((fast - exact).norm() / exact.norm()).item()
        flops = 2 * M * N * K
        row["bf16_tflops"] = flops / row["bf16_ms"] / 1e9
        row["fp8_tflops"] = flops / row["fp8_fast0_ms"] / 1e9
        row["fp8_fast_tflops"] = flops / row["fp8_fast1_ms"] / 1e9
        log(f"{name:8} M={M} N={N:6} K={K:5}: bf16 {row['bf16_ms']:.3f} ms "
            f"({row['bf16_tflops']:.0f} TFLOP/s), fp8 {row['fp8_fast0_ms']:.3f} "
            f"({row['fp8_tflops']:.0f}), fp8 fast accum {row['fp8_fast1_ms']:.3f} "
            f"({row['fp8_fast_tflops']:.0f}); fast vs exact rel err {row['fast_rel_err']:.2e}")
        rows.append(row)
        del x, w, xq, wq
    return rows


def quant_rows(M: int) -> list[dict]:
    from fuser.ops.fp8 import quantize_rows
    from fuser.ops.fp8_quant import add_rms_norm_quant_triton, gated_act_quant_triton

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    r = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16, generator=g)
    nw = torch.rand(4096, device="cuda", dtype=torch.bfloat16, generator=g) + 0.5
    gu = torch.randn(M, 28672, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = {
        "add_rms_norm_quant [M, 4096]": lambda: add_rms_norm_quant_triton(x, r, nw, 1e-5),
        "gated_act_quant [M, 28672]": lambda: gated_act_quant_triton(gu, "silu"),
        "quantize_rows [M, 4096]": lambda: torch.ops.fuser.quantize_rows(x),
        "quantize_rows reference [M, 4096]": lambda: quantize_rows(x),
    }
    rows = []
    for name, fn in cases.items():
        try:
            ms = bench_ms(fn)
        except Exception as error:  # an op missing in this tree: say so, go on
            log(f"{name}: {type(error).__name__}: {error}")
            continue
        log(f"{name.replace('M', str(M), 1)}: {ms * 1e3:.1f} us")
        rows.append({"name": name, "M": M, "us": ms * 1e3})
    return rows


def attention_rows(T: int) -> list[dict]:
    """fuser::prefill_attention's two CUDA kernels at the 8B shape (32 query heads, 8 kv heads,
    head dim 128): the Triton flash kernel and SDPA with the boolean mask, one row."""
    from fuser.ops.attention import prefill_attention_sdpa
    from fuser.ops.flash_prefill import flash_prefill

    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(1, T, 32, 128, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 8, T, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(1, 8, T, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    slots = torch.arange(T, device="cuda")[None]
    starts = torch.zeros(1, dtype=torch.long, device="cuda")
    args = (q, k, v, slots, starts, 128**-0.5, 0, 0.0)
    flops = 2 * 2 * T * T * 32 * 128 / 2  # QK^T and PV, causal half
    rows = []
    def fewer_masks(*a):
        return flash_prefill(*a, mask_all=False)

    for name, fn in (("flash (Triton)", flash_prefill), ("flash, diagonal masks only", fewer_masks),
                     ("SDPA + mask", prefill_attention_sdpa)):
        ms = bench_ms(lambda: fn(*args))
        log(f"prefill attention T={T} {name}: {ms * 1e3:.1f} us ({flops / ms / 1e9:.0f} TFLOP/s)")
        rows.append({"name": name, "T": T, "us": ms * 1e3, "tflops": flops / ms / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--out", default=None)
    parser.add_argument("--attention-only", action="store_true",
                        help="only the prefill attention rows")
    args = parser.parse_args()
    if missing_gpu("prefill_lab.py", dry_run=False):  # FP8 GEMMs and timing need the GPU
        return
    result = {"env": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "command": " ".join(sys.argv)},
              "attention": attention_rows(args.tokens)}
    if not args.attention_only:
        result.update(gemms=gemm_rows(args.tokens), quant=quant_rows(args.tokens))
    for key in ("bf16_ms", "fp8_fast0_ms", "fp8_fast1_ms") if "gemms" in result else ():
        total = sum(r[key] * PER_LAYER[r["name"]] for r in result["gemms"])
        log(f"prefill GEMMs, 32 layers + LM head, {key[:-3]}: {total:.1f} ms")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
