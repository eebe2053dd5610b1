"""On CPU: does speculative greedy still equal target-only greedy at batch 1 when the verify
graph computes its norms as norm_stats' CUDA kernel does (fuser/ops/norm_stats.py: g * h rounded
once, rstd times the GEMV's fp32 sums) while the one-row decode step keeps the norm's own
roundings (g * (h * rstd).to(dtype))?

    python benchmarks/norm_stats_greedy_sim.py

The CPU engines run the ops' references; here stats_rms_norm_linear's reference (and its CPU
inline) is replaced by that kernel arithmetic, so only the norm's rounding differs between the
two steps. Tiny random bf16 models (tests/tiny.py): Llama, Qwen2 and Mistral, 3 seeds each, 3
prompts each, 24 new tokens; prints each sequence that differs, then the count. With
`--reference` the references stay (the control: nothing may differ); with `--one-row-after` the
one-row add + norm GEMV computes the kernels' arithmetic too (linear.ONE_ROW_NORM_AFTER), as the
decode step then would.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
from torch import Tensor

import fuser
import fuser.ops
from fuser.ops import gated_act, norm_stats
from fuser.ops import linear as linear_module
from fuser.ops.fp8 import dequantize
from fuser.passes import norm_stats as norm_stats_pass

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import random_prompts, tiny_model  # noqa: E402


def kernel_arithmetic(summed: Tensor, gh: Tensor, squares: Tensor, norm_weight: Tensor,
                      eps: float, weight: Tensor, weight_scale: Tensor | None,
                      activation: str | None) -> Tensor:
    """What _linear_kernel computes for fuser::stats_rms_norm_linear (up to summation order):
    the fp32 GEMV of gh, times each row's rstd from the squares, rounded once (gated: each half
    rounded, then act(gate) * up)."""
    rstd = torch.rsqrt(squares.sum(-1) / summed.shape[-1] + eps).reshape(*summed.shape[:-1], 1)
    w = weight.float() if weight_scale is None else dequantize(weight, weight_scale).float()
    acc = (gh.float() @ w.T) * rstd
    if activation is None:
        return acc.to(summed.dtype).contiguous()
    return gated_act.gated_act_reference(acc.to(summed.dtype), activation).contiguous()


def one_row_after(x: Tensor, residual: Tensor, norm_weight: Tensor, eps: float, weight: Tensor,
                  weight_scale: Tensor | None, activation: str | None) -> tuple[Tensor, Tensor]:
    """fuser::add_rms_norm_linear in linear.ONE_ROW_NORM_AFTER's arithmetic (the kernels' at one
    row with plain weights, as stats_rms_norm_linear's at several): (out, summed)."""
    summed = (x + residual).contiguous()
    squares = summed.float().pow(2).sum(-1, keepdim=True)
    out = kernel_arithmetic(summed, norm_weight * summed, squares, norm_weight, eps, weight,
                            weight_scale, activation)
    return out, summed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true",
                        help="keep the references (the control)")
    parser.add_argument("--one-row-after", action="store_true",
                        help="the one-row add + norm GEMV in the same arithmetic too "
                             "(linear.ONE_ROW_NORM_AFTER)")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    norm_stats_pass.ENABLED = True  # the default, pinned: the comparison needs the pass
    if not args.reference:
        norm_stats.stats_rms_norm_linear_reference = kernel_arithmetic
        fuser.ops.CPU_INLINE[torch.ops.fuser.stats_rms_norm_linear.default] = kernel_arithmetic
    if args.one_row_after:  # plain weights only, as the flag (the tiny models' are bf16)
        linear_module.add_rms_norm_linear_reference = one_row_after
        fuser.ops.CPU_INLINE[torch.ops.fuser.add_rms_norm_linear.default] = one_row_after
    differ = total = 0
    for family in ("qwen2", "llama", "mistral"):
        for seed in range(3):
            target = tiny_model(family, layers=2, seed=seed, dtype=torch.bfloat16)
            draft = tiny_model(family, layers=1, seed=seed + 10, dtype=torch.bfloat16)
            config = fuser.FuserConfig(max_seq_len=64, max_batch_size=1, gamma=4)
            plain = fuser.optimize(target, config=config)
            spec = fuser.optimize(target, draft=draft, config=config)
            for p in range(3):
                ids, mask = random_prompts(1, [5 + p], target.config.vocab_size,
                                           seed=p + 7 * seed)
                a = plain.generate(ids, 24, attention_mask=mask, eos_token_id=[])
                b = spec.generate(ids, 24, attention_mask=mask, eos_token_id=[])
                total += 1
                if not torch.equal(a, b):
                    differ += 1
                    first = (a != b).nonzero()[0, 1].item() - ids.shape[1]
                    print(f"{family} seed {seed} prompt {p}: differs from new token {first}")
    verify = "references" if args.reference else "the kernels' arithmetic"
    decode = "that arithmetic" if args.one_row_after else "the norm's roundings"
    print(f"{differ} of {total} greedy sequences differ (verify: {verify}; one-row decode: "
          f"{decode})")


if __name__ == "__main__":
    main()
