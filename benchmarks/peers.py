"""The systems fuser is measured against, as greedy generate-n-tokens callables.

Each `make_*` returns `run() -> LongTensor[1, n]` (the new tokens) over a Hugging Face causal LM
and one prompt; the caller times `run`. Every prompt token is attended: `generate` gets an
all-ones attention mask, since without one it masks every token equal to pad_token_id (0 here),
and the bundled pair's <|bos|> is 0 (with it masked the peers would decode other tokens than
the models' own greedy output). Compilation happens inside the
first call(s), so callers warm up before timing.

- Hugging Face eager: `model.generate` with its dynamic cache.
- Hugging Face static cache + torch.compile: `generate` with `cache_implementation="static"`,
  which makes Hugging Face compile its decoding forward ("reduce-overhead": CUDA graphs).
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
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, cache_implementation=None)
        return out[:, prompt.shape[1]:]
    return run


def make_hf_static_compile(model: nn.Module, prompt: torch.Tensor, n: int
                           ) -> Callable[[], torch.Tensor]:
    """`generate` with a static cache, which Hugging Face compiles itself (its CompileConfig:
    fullgraph, "reduce-overhead") for the decoding steps. Compiling `model.forward` by hand
    instead breaks on transformers 5.17 + torch 2.11: the static cache allocates its tensors
    lazily inside the first compiled call, as outputs of a CUDA graph that the next replay
    overwrites (seen on the H200, benchmarks/RESULTS.md)."""
    from transformers import CompileConfig

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0, cache_implementation="static",
                                 compile_config=CompileConfig(fullgraph=True,
                                                              mode="reduce-overhead"))
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
