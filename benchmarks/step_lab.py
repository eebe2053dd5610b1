"""Where the bundled pair's speculative step spends its time, kernel by kernel (issue #12).

    python3 benchmarks/step_lab.py [--gammas 1,2,3] [--variants "base;split1;rows:16/128/4/3/1"]
                                   [--out lab.json]

Builds the bundled pair (bf16) as benchmarks/e2e.py does, then for each part of a speculative
iteration (the target's decode and verify(gamma) steps, the draft's decode and catch-up steps):
  - its time as a CUDA graph of back-to-back calls (benchmarks/timing.py `time_us`), and
  - one uncaptured call profiled: every kernel it launches, in launch order, with its duration.
Then, for each variant (module switches set before the parts are timed again, restored after):
each part's time, and whether its logits equal the base run's bit for bit.

Variants (words, ";" between variants):
  base        the engine as built
  split1      several-row and one-row _linear_kernel launches unsplit (split_k 1) where K <= 2048
  pdl         several-row launches with PDL too (FUSER_PDL_ROWS=1, fuser/ops/pdl.py; this lab
              checks the logits)
  bnN         several-row _linear_kernel tiles N columns wide where K <= 2048
  rows:BN/BK/W/S/X
              several-row _linear_kernel launches where K <= 2048: block_n BN, block_k BK,
              W warps, S stages, split_k X (1 where X * BK does not divide K)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import log, missing_gpu, time_us  # noqa: E402

import fuser  # noqa: E402
from fuser.ops import linear as linear_module  # noqa: E402
from fuser.runtime.steps import CATCHUP, DECODE, verify  # noqa: E402

SMALL_K = 2048


def launches(fn: Callable[[], object]) -> list[tuple[str, float]]:
    """(kernel name, us) of every kernel one call of fn launches, in launch order."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA
              and not e.name.startswith("##")]
    events.sort(key=lambda e: e.time_range.start)
    return [(e.name, e.time_range.elapsed_us()) for e in events]


def short(name: str) -> str:
    """A kernel's name without Triton's or Inductor's suffixes."""
    for cut in ("_0d1d", "_0123"):
        name = name.split(cut)[0]
    return name[:48]


def apply(words: list[str]) -> Callable[[], None]:
    """Set the variant's switches; returns what restores them."""
    saved_split = linear_module._default_split_k
    saved_config = linear_module._default_config
    saved_rows_pdl = os.environ.get("FUSER_PDL_ROWS")
    for word in words:
        if word == "split1":
            def split(M: int, N: int, K: int, fp8: bool, _base=linear_module._default_split_k
                      ) -> int:
                return 1 if K <= SMALL_K else _base(M, N, K, fp8)
            linear_module._default_split_k = split
        elif word == "pdl":
            os.environ["FUSER_PDL_ROWS"] = "1"
        elif word.startswith("bn"):
            width = int(word[2:])

            def config(M: int, N: int, K: int, _base=linear_module._default_config,
                       _width=width) -> tuple[int, int, int, int]:
                bn, bk, warps, stages = _base(M, N, K)
                return (_width, bk, warps, stages) if M > 1 and K <= SMALL_K else \
                    (bn, bk, warps, stages)
            linear_module._default_config = config
        elif word.startswith("rows:"):
            bn, bk, warps, stages, split = (int(v) for v in word[5:].split("/"))

            def config(M: int, N: int, K: int, _base=linear_module._default_config,
                       _tile=(bn, bk, warps, stages)) -> tuple[int, int, int, int]:
                return _tile if M > 1 and K <= SMALL_K else _base(M, N, K)

            def split_k(M: int, N: int, K: int, fp8: bool, _base=linear_module._default_split_k,
                        _split=split, _bk=bk) -> int:
                if M > 1 and K <= SMALL_K:
                    return _split if K % (_split * _bk) == 0 else 1
                return _base(M, N, K, fp8)
            linear_module._default_config = config
            linear_module._default_split_k = split_k
        elif word != "base":
            raise SystemExit(f"unknown variant word {word!r}")

    def restore() -> None:
        linear_module._default_split_k = saved_split
        linear_module._default_config = saved_config
        if saved_rows_pdl is None:
            os.environ.pop("FUSER_PDL_ROWS", None)
        else:
            os.environ["FUSER_PDL_ROWS"] = saved_rows_pdl
    return restore


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gammas", default="1,2,3")
    parser.add_argument("--variants", default="base;split1;pdl;split1 pdl")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if missing_gpu("step_lab.py", args.dry_run):
        return
    from transformers import AutoModelForCausalLM

    from fuser.models import DRAFT_PATH, TARGET_PATH

    cpu = not torch.cuda.is_available()  # --dry-run here: the plumbing, nothing timed
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=dtype).to(device).eval()
    gammas = tuple(int(g) for g in args.gammas.split(","))
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        max_seq_len=512, gamma="auto", gamma_candidates=gammas,
        **(dict(compile="fx", cuda_graphs=False) if cpu else {})))
    costs = engine.step_costs.get(1, {})
    log(f"pass matches: {engine.report().passes}")
    log("speculative iteration (the engine's step graphs), ms: "
        + ", ".join(f"g{g} {1e3 * s:.3f}" for g, s in costs.items()))
    bucket = engine.bucket(1)
    parts = [("target decode", bucket.target, DECODE)]
    parts += [(f"target verify({g})", bucket.target, verify(g)) for g in gammas]
    parts += [("draft decode", bucket.draft, DECODE), ("draft catch-up", bucket.draft, CATCHUP)]
    results: dict = {"iteration_ms": {str(g): 1e3 * s for g, s in costs.items()}}
    generator = torch.Generator(device="cpu").manual_seed(0)
    reference: dict[str, torch.Tensor] = {}
    inputs = {name: torch.randint(0, steps.vocab_size, (1, kind.tokens), generator=generator
                                  ).to(device) for name, steps, kind in parts}
    variants = args.variants.split(";")
    for variant in variants:
        words = variant.split()
        restore = apply(words)
        try:
            row = {}
            for name, steps, kind in parts:
                T = kind.tokens
                tokens = inputs[name]
                positions = (128 + torch.arange(T, device=device))[None]
                fn = steps[kind].uncaptured
                cache = steps.cache

                def call() -> torch.Tensor:
                    cache.set_lengths(128)
                    return fn(tokens, positions, cache.seq_lens, cache.starts)

                with torch.no_grad():
                    us = float("nan") if cpu else time_us(call).us
                    logits = call().float()
                    equal = None
                    if name in reference:
                        equal = bool(torch.equal(logits, reference[name]))
                    else:
                        reference[name] = logits
                    listed = None if cpu else launches(call)
                cache.reset()
                row[name] = {"us": us, "equal_to_base": equal}
                log(f"[{variant}] {name:<20} {us:7.1f} us"
                    + ("" if equal is None else f"  logits {'equal' if equal else 'DIFFER'}"))
                if listed:
                    row[name]["kernels"] = listed
                if listed and variant != variants[0]:  # the durations only
                    log("    " + " ".join(f"{k_us:.2f}" for _, k_us in listed))
                elif listed:  # the first variant: every kernel by name
                    total = sum(us for _, us in listed)
                    log(f"    {len(listed)} kernels, {total:.1f} us of kernel time:")
                    for kernel, k_us in listed:
                        log(f"      {k_us:6.2f}  {short(kernel)}")
            results[variant] = row
        finally:
            restore()
    log("part                  " + "".join(f"{v[:14]:>15}" for v in variants))
    for name, _, _ in parts:
        log(f"{name:<22}" + "".join(f"{results[v][name]['us']:>15.1f}" for v in variants))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
