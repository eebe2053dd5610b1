"""Timing and comparing generation systems honestly, for `fuser demo` and `fuser bench`.

Every system is warmed up, then timed over the same prompts (median of several runs). Tokens
are compared exactly only where exactness is promised (fp32, DESIGN.md numerics contract);
elsewhere the position where two outputs first diverge is reported next to where Hugging Face's
own two attention kernels (sdpa and eager) diverge from each other on the same prompts.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fuser.engine import Engine

Generate = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class Row:
    """One system's timing over the prompts: median tok/s of `runs` runs."""

    system: str
    tokens_per_second: float
    new_tokens: int
    seconds: float
    runs: int
    note: str = ""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def draft_only(engine: Engine, draft: torch.nn.Module) -> Engine:
    """An Engine over the same draft steps as a target-only engine (its `logits` are the
    optimized draft's); `draft` is the user's draft model. Shares the draft's KV cache: use
    one engine at a time."""
    if engine.draft is None:
        raise ValueError("the engine has no optimized draft (none given, or it fell back)")
    return Engine(engine.draft, None, config=engine.config, user_target=draft,
                  tokenizer=engine.tokenizer, device=engine.device, dtype=engine.dtype,
                  vocab_size=engine.vocab_size, gamma=0, compile_seconds=engine.compile_seconds)


def engine_generate(engine: Engine, eos: object, pad: int, gamma: int | None = None) -> Generate:
    """Greedy `engine.generate` as a Generate; with `gamma` (0: target-only) every step of the
    call runs at that draft length (`Engine.fix_gamma`) on the engine's own captured graphs."""
    def run(ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        previous = engine.forced_gamma
        engine.fix_gamma(gamma if gamma is not None else previous)
        try:
            return engine.generate(ids, n, attention_mask=mask, eos_token_id=eos,
                                   pad_token_id=pad)
        finally:
            engine.fix_gamma(previous)
    return run


def hf_generate(model: torch.nn.Module, eos: object, pad: int) -> Generate:
    """Greedy Hugging Face `generate` as a Generate."""
    def run(ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                  do_sample=False, eos_token_id=eos, pad_token_id=pad)
    return run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_system(name: str, fn: Generate, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                pad: int, runs: int, device: torch.device) -> tuple[Row, torch.Tensor]:
    """Warm `fn` up, then time `runs` runs over the prompts; (row, the last output)."""
    fn(ids, mask, min(4, new_tokens))  # warm-up
    seconds, out = [], ids
    for _ in range(runs):
        synchronize(device)
        start = time.perf_counter()
        out = fn(ids, mask, new_tokens)
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    new = int((out[:, ids.shape[1]:] != pad).sum())
    median = statistics.median(seconds)
    return Row(name, new / median, new, median, runs), out


def first_divergence(a: torch.Tensor, b: torch.Tensor, prompt_length: int) -> int | None:
    """First generated position where any row of `a` and `b` differ (None: identical)."""
    n = min(a.shape[1], b.shape[1])
    differ = (a[:, prompt_length:n] != b[:, prompt_length:n]).any(0).nonzero()
    if len(differ):
        return int(differ[0])
    return None if a.shape == b.shape else n - prompt_length


def describe_divergence(position: int | None) -> str:
    return "identical" if position is None else f"first differ at generated token {position}"


def hf_kernel_divergence(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor,
                         new_tokens: int, eos: object, pad: int) -> int | None:
    """Where HF generate with its sdpa and its eager attention first diverge (a yardstick for
    non-fp32 comparisons)."""
    outs = []
    original = model.config._attn_implementation
    try:
        for impl in ("sdpa", "eager"):
            model.set_attn_implementation(impl)
            outs.append(hf_generate(model, eos, pad)(ids, mask, new_tokens))
    finally:
        model.set_attn_implementation(original)
    return first_divergence(outs[0], outs[1], ids.shape[1])


def table(rows: list[Row]) -> str:
    """Rows as an aligned text table."""
    width = max([28, *(len(r.system) for r in rows)])
    lines = [f"{'system':<{width}} {'tok/s':>9} {'tokens':>7} {'seconds':>8} {'runs':>5}  note"]
    for r in rows:
        lines.append(f"{r.system:<{width}} {r.tokens_per_second:>9.1f} {r.new_tokens:>7} "
                     f"{r.seconds:>8.3f} {r.runs:>5}  {r.note}")
    return "\n".join(lines)
