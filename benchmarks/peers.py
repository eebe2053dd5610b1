"""The systems fuser is measured against, as greedy generate-n-tokens callables.

Each `make_*` returns `run() -> LongTensor[1, n]` (the new tokens) over a Hugging Face causal LM
and one prompt; the caller times `run`. Compilation happens inside the first call(s), so callers
warm up before timing.

- Hugging Face eager: `model.generate` with its dynamic cache.
- Hugging Face static cache + torch.compile: `generate` with `cache_implementation="static"`
  and the forward compiled in "reduce-overhead" mode (CUDA graphs), as HF documents.
- gpt-fast's approach in plain PyTorch: a static KV cache, the one-token decode step (forward +
  argmax) compiled whole with "reduce-overhead", a Python loop of such steps, prefill eager. It
  runs Hugging Face's model code rather than gpt-fast's own, so it is that design, not that code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def make_hf_eager(model: nn.Module, prompt: torch.Tensor, n: int) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, cache_implementation=None)
        return out[:, prompt.shape[1]:]
    return run


def make_hf_static_compile(model: nn.Module, prompt: torch.Tensor, n: int
                           ) -> Callable[[], torch.Tensor]:
    compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

    def run() -> torch.Tensor:
        eager_forward = model.forward
        model.forward = compiled
        try:
            with torch.no_grad():
                out = model.generate(prompt, max_new_tokens=n, min_new_tokens=n,
                                     do_sample=False, pad_token_id=0,
                                     cache_implementation="static",
                                     disable_compile=True)  # compiled above, once
        finally:
            model.forward = eager_forward
        return out[:, prompt.shape[1]:]
    return run


def make_gpt_fast_style(model: nn.Module, prompt: torch.Tensor, n: int, compile: bool = True
                        ) -> Callable[[], torch.Tensor]:
    from transformers import StaticCache

    T = prompt.shape[1]
    device = prompt.device
    cache = StaticCache(config=model.config, max_cache_len=T + n + 1)

    def step(tokens: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=tokens, cache_position=cache_position,
                       position_ids=cache_position[None], past_key_values=cache,
                       use_cache=True).logits
        return torch.argmax(logits[:, -1], dim=-1, keepdim=True)  # [1, 1]

    decode = torch.compile(step, mode="reduce-overhead", fullgraph=True) if compile else step

    @torch.no_grad()
    def run() -> torch.Tensor:
        cache.reset()
        token = step(prompt, torch.arange(T, device=device))
        position = torch.tensor([T], device=device)
        out = [token]
        for _ in range(n - 1):
            token = decode(token, position).clone()  # a graph's output is overwritten next call
            out.append(token)
            position += 1
        return torch.cat(out, dim=1)
    return run
