"""Draft/target agreement of the bundled pair under FP8, on identical held-out contexts (issue #10).

    python benchmarks/fp8_agreement.py [--rows 16] [--tokens 512] [--prefill 64] [--out FILE]

Greedy speculative decoding accepts a drafted token exactly when the draft's argmax equals the
target's after the same context. This script measures that agreement teacher-forced, on the
same held-out token rows for every variant (benchmarks/fp8_accuracy.py's rows), so the only
difference between variants is the arithmetic: no sequence diverges and no prompt sample
changes, which is what makes an engine's measured acceptance noisy at a few thousand drafts.

Variants are the Hugging Face bf16 models as shipped and the same models under FP8 emulation
(`fuser.ops.fp8.emulated_fp8`: what an FP8 engine computes, in plain PyTorch): per-channel FP8
weights everywhere, and per-token FP8 activations for the first --prefill positions of each row
(the engine's prompt prefill); later positions use FP8 weights only (the engine's decode and
verification steps). Positions before --prefill are not counted (a prompt is not drafted).
Printed: agreement for every (target, draft) combination of bf16 / fp8 / fp8 with a bf16 LM
head, and how often each FP8 model's argmax equals its bf16 argmax.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from fp8_accuracy import heldout_rows  # noqa: E402

from fuser.ops.fp8 import emulated_fp8  # noqa: E402

MODELS = Path(__file__).resolve().parent.parent / "models"
VARIANTS = {"bf16": None, "fp8": True, "fp8-bf16-head": False}  # value: FP8 LM head


def argmaxes(model: torch.nn.Module, rows: torch.Tensor, fp8_head: bool | None,
             prefill: int) -> torch.Tensor:
    """The model's argmax after every position from `prefill` on, all rows concatenated."""
    context = (contextlib.nullcontext() if fp8_head is None
               else emulated_fp8(model, lm_head=fp8_head, prefill_tokens=prefill))
    out = []
    with torch.no_grad(), context:
        for row in rows:
            out.append(model(row[None]).logits[0].float().argmax(-1)[prefill:])
    return torch.cat(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not 0 <= args.prefill < args.tokens:
        parser.error(f"--prefill must be in [0, --tokens), got {args.prefill}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(MODELS / "fuser-code-target")
    rows = heldout_rows(tokenizer, args.rows, args.tokens).to(args.device)
    models = {name: AutoModelForCausalLM.from_pretrained(
        MODELS / f"fuser-code-{name}", dtype=torch.bfloat16).to(args.device).eval()
        for name in ("target", "draft")}
    picks = {(name, variant): argmaxes(model, rows, head, args.prefill)
             for name, model in models.items() for variant, head in VARIANTS.items()}
    positions = picks["target", "bf16"].numel()
    result = {"args": vars(args), "positions": positions, "agreement": {}, "same_as_bf16": {}}
    print(f"{args.rows} held-out rows x {args.tokens} tokens, {positions} positions counted "
          f"(after the first {args.prefill}); {time.perf_counter() - started:.0f} s")
    print(f"{'target':<15}{'draft':<15}{'draft argmax == target argmax':>30}")
    for t in VARIANTS:
        for d in VARIANTS:
            agree = float((picks["draft", d] == picks["target", t]).float().mean())
            result["agreement"][f"{t}/{d}"] = agree
            print(f"{t:<15}{d:<15}{agree:>30.4f}")
    for name in models:
        for v in ("fp8", "fp8-bf16-head"):
            same = float((picks[name, v] == picks[name, "bf16"]).float().mean())
            result["same_as_bf16"][f"{name}/{v}"] = same
            print(f"{name} {v}: argmax equals bf16's at {same:.4f} of positions")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
