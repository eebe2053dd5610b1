"""Where the overlapped step (FuserConfig(overlap=True)) goes wrong on CUDA.

    python3 benchmarks/overlap_lab.py [--dry-run]

On the H200 the overlapped step graph's greedy output differed from target-only greedy
(tests/test_cuda_spec.py, xfail), also with its branches run one after the other
(FUSER_BRANCHES=serial) and with PDL off (benchmarks/RESULTS.md, twentieth and twenty-first
sessions), while the CPU tests pass, the fused kernels included. This lab runs the GPU test's
setup (bf16 tiny Llama, 2 layers; a 1-layer draft at gamma 2 and the target's copy at gamma 3;
3 ragged rows in bucket 4; compile="fx") with overlap forced on CUDA, in four ways:
  - captured / uncaptured (FuserConfig.cuda_graphs): is it the capture?
  - fused / eager glue (runtime/step_kernels.py FUSE_OFF_CUDA is for CPU; here
    `speculative.fused_by_default` is patched to False): is it the fused kernels on the GPU?
and prints, for each, whether the output equals target-only greedy and where it first differs.
--dry-run: the same on the CPU (uncaptured, fused kernels under TRITON_INTERPRET).
"""

from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import fuser  # noqa: E402
from fuser.runtime import speculative, step_kernels  # noqa: E402
from timing import log, missing_gpu  # noqa: E402
from tiny import random_prompts, tiny_model  # noqa: E402


def run(device: torch.device, captured: bool, fused: bool) -> list[str]:
    """One way; returns a line per (draft, gamma)."""
    saved = speculative.fused_by_default
    if not fused:
        speculative.fused_by_default = lambda device: False  # type: ignore[assignment]
    step_kernels.FUSE_OFF_CUDA = fused and device.type != "cuda"
    lines = []
    try:
        target = tiny_model("llama", layers=2, dtype=torch.bfloat16).to(device)
        drafts = ((tiny_model("llama", layers=1, seed=1, dtype=torch.bfloat16).to(device), 2),
                  (copy.deepcopy(target), 3))
        for draft, gamma in drafts:
            config = fuser.FuserConfig(max_seq_len=96, max_batch_size=4, gamma=gamma,
                                       compile="fx", overlap=True,
                                       cuda_graphs=captured and device.type == "cuda")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                engine = fuser.optimize(target, draft=draft, config=config)
            for bucket in engine.buckets.values():  # the engine's CUDA guard, bypassed
                bucket.overlap = True
                bucket.graphs.clear()
            if captured and device.type == "cuda":
                engine.prepare()
            ids, mask = random_prompts(3, [9, 5, 7], target.config.vocab_size, seed=3)
            ids, mask = ids.to(device), mask.to(device)
            engine.fix_gamma(0)
            plain = engine.generate(ids, 40, attention_mask=mask, eos_token_id=[])
            engine.fix_gamma(gamma)
            engine.stats.reset()
            out = engine.generate(ids, 40, attention_mask=mask, eos_token_id=[])
            line = (f"gamma {gamma}: accepted {engine.stats.num_accepted_tokens} of "
                    f"{engine.stats.num_draft_tokens}; ")
            if torch.equal(out, plain):
                line += "equal to target-only"
            else:
                where = (out != plain).nonzero()[0].tolist()
                line += (f"DIFFERS first at row {where[0]} column {where[1]} (prompt "
                         f"{ids.shape[1]}): {out[where[0], where[1]:where[1] + 6].tolist()} "
                         f"against {plain[where[0], where[1]:where[1] + 6].tolist()}")
            lines.append(line)
    finally:
        speculative.fused_by_default = saved
        step_kernels.FUSE_OFF_CUDA = False
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if missing_gpu("overlap_lab.py", args.dry_run):
        return
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    ways = [(False, True), (False, False)] if device.type == "cpu" else \
        [(True, True), (False, True), (True, False), (False, False)]
    for captured, fused in ways:
        for line in run(device, captured, fused):
            log(f"[{'captured' if captured else 'uncaptured'}, "
                f"{'fused' if fused else 'eager'} glue] {line}")


if __name__ == "__main__":
    main()
