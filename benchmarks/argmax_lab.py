"""The greedy token's cost: torch.argmax against fuser/ops/argmax.py over a Llama-3 vocabulary.

    python3 benchmarks/argmax_lab.py

Rows 1 (the decode iteration) and 5 (the verify step) of bf16 logits [rows, 128256], each op
launched 20 times back to back in one CUDA graph (benchmarks/timing.py; the logits stay in L2, as
the LM head just wrote them in the step). Prints microseconds per call.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import graph_time_us, log  # noqa: E402

from fuser.ops.argmax import argmax  # noqa: E402

VOCAB = 128256


def main() -> None:
    if not torch.cuda.is_available():
        log("argmax_lab.py needs a CUDA GPU; nothing to do")
        return
    for rows in (1, 5):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        logits = torch.randn(rows, VOCAB, device="cuda", generator=gen).to(torch.bfloat16)
        assert torch.equal(argmax(logits), torch.argmax(logits, dim=-1))
        torch_us = graph_time_us(lambda: torch.argmax(logits, dim=-1))
        fuser_us = graph_time_us(lambda: argmax(logits))
        log(f"rows {rows}: torch.argmax {torch_us:6.2f} us, fuser argmax {fuser_us:6.2f} us "
            f"({torch_us / fuser_us:.1f}x)")


if __name__ == "__main__":
    main()
