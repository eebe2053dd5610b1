"""GPU check for the foundation: Triton RMSNorm kernels vs the reference, and an engine on CUDA.

    python benchmarks/gpu_foundation.py --out $OUT/foundation.json

1. The Triton kernels (through their launchers) against the plain-PyTorch reference in bf16, on
   random data, widths around block boundaries and real model widths.
2. Their time against eager PyTorch and torch.compile of the same expression (median of
   triton.testing.do_bench), and GB/s over the bytes each must move.
3. fuser.optimize on a small bf16 Llama on CUDA with Inductor: logits vs eager, fused op counts.
"""

from __future__ import annotations

import argparse
import json
import platform

import torch
import triton
from triton.testing import do_bench

import fuser
from fuser.ops.rmsnorm import (
    add_rms_norm_reference,
    add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)

BF16_TOLERANCE = 1e-2  # relative, over the tensor: one bf16 rounding of the output (2^-8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def check_kernels() -> list[dict]:
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (1, 63, 64, 65, 127, 128, 129, 1000, 2048, 4096, 5120, 8192, 8193, 16384):
        for m in (1, 3, 17):
            x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
            r = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16, generator=g)
            e1 = rel(rms_norm_triton(x, w, 1e-5), rms_norm_reference(x, w, 1e-5))
            got_n, got_s = add_rms_norm_triton(x, r, w, 1e-5)
            ref_n, ref_s = add_rms_norm_reference(x, r, w, 1e-5)
            e2 = max(rel(got_n, ref_n), rel(got_s, ref_s))
            rows.append({"rows": m, "width": n, "rms_norm_rel": e1, "add_rms_norm_rel": e2,
                         "ok": e1 <= BF16_TOLERANCE and e2 <= BF16_TOLERANCE})
    return rows


def time_kernels() -> list[dict]:
    results = []
    compiled = torch.compile(add_rms_norm_reference)
    for m, n in ((1, 4096), (16, 4096), (4096, 4096)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        nbytes = 5 * m * n * 2 + n * 2  # read x, r, w; write sum and out
        times = {
            "fuser_triton": do_bench(lambda: add_rms_norm_triton(x, r, w, 1e-5), return_mode="median"),
            "eager": do_bench(lambda: add_rms_norm_reference(x, r, w, 1e-5), return_mode="median"),
            "torch_compile": do_bench(lambda: compiled(x, r, w, 1e-5), return_mode="median"),
        }
        for name, ms in times.items():
            results.append({"op": "add_rms_norm", "rows": m, "width": n, "impl": name,
                            "us": ms * 1e3, "GB/s": nbytes / (ms * 1e-3) / 1e9})
    return results


def check_engine() -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2)
    model = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=2, max_seq_len=128))
    ids = torch.randint(0, 1024, (2, 33), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.float()
    out = engine.logits(ids)
    report = engine.report()
    return {"rel_error_vs_eager": rel(out, ref), "passes": report.passes,
            "fused_ops": report.fused_ops, "fallbacks": report.fallbacks,
            "compile_seconds": report.compile_seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "python": platform.python_version()}
    import transformers

    env["transformers"] = transformers.__version__
    kernels = check_kernels()
    timings = time_kernels()
    engine = check_engine()
    result = {"env": env, "kernels": kernels, "timings": timings, "engine": engine}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print(json.dumps(env))
    bad = [k for k in kernels if not k["ok"]]
    worst = max(max(k["rms_norm_rel"], k["add_rms_norm_rel"]) for k in kernels)
    print(f"kernels: {len(kernels) - len(bad)}/{len(kernels)} bf16 cases within "
          f"{BF16_TOLERANCE} (worst relative error {worst:.2e})")
    print(f"engine on CUDA (bf16, Inductor): rel error {engine['rel_error_vs_eager']:.2e}, "
          f"passes {engine['passes']}, fallbacks {engine['fallbacks']}")
    print(f"{'op':<14}{'rows':>6}{'width':>7}  {'impl':<14}{'us':>9}{'GB/s':>9}")
    for t in timings:
        print(f"{t['op']:<14}{t['rows']:>6}{t['width']:>7}  {t['impl']:<14}{t['us']:>9.2f}{t['GB/s']:>9.0f}")


if __name__ == "__main__":
    main()
