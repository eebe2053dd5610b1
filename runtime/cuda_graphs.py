"""Fixed-shape steps captured once as CUDA graphs and replayed: no launch gaps between kernels.

A captured step reads its inputs from static buffers (tokens and positions are copied in; the
cache's seq_lens and starts are read where they live, so the runtime must update them in
place) and writes its logits to a static output that the next replay overwrites.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def capture_failed(e: Exception) -> str:
    """After a failed capture: let the device settle (a failed capture can leave an error
    behind) and describe the failure in one line, "CUDA graph capture failed (Type: first line)"."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 -- the error the failed capture left, already reported
        pass
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    return f"CUDA graph capture failed ({type(e).__name__}: {first})"


class CudaGraphStep:
    """`fn` captured for tokens of one shape [B, T]; call it like `fn`."""

    def __init__(self, fn: StepFn, batch: int, tokens_per_step: int, seq_lens: torch.Tensor,
                 starts: torch.Tensor, pool: object | None = None, warmup: int = 2) -> None:
        device = seq_lens.device
        self.fn = fn  # the uncaptured step (benchmarks profile its kernels one by one)
        self.seq_lens, self.starts = seq_lens, starts
        self.tokens = torch.zeros(batch, tokens_per_step, dtype=torch.long, device=device)
        self.positions = torch.arange(tokens_per_step, device=device)[None].repeat(batch, 1)
        # Warm up on a side stream (lazy initialisation, autotuning) before capturing.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(warmup):
                fn(self.tokens, self.positions, seq_lens, starts)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool), torch.no_grad():
            self.logits = fn(self.tokens, self.positions, seq_lens, starts)  # [B, T, V], static
        self.replays = 0

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
                 starts: torch.Tensor) -> torch.Tensor:
        if seq_lens is not self.seq_lens or starts is not self.starts:
            raise RuntimeError("a captured step must be given the cache's own length tensors")
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.graph.replay()
        self.replays += 1
        return self.logits
