"""The Engine: runs built steps (`logits`, `generate`, `stream`) and reports on them.

It builds nothing: `fuser.optimize` (fuser/optimize.py) builds the steps and hands them over.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from fuser.config import FuserConfig
from fuser.report import Report, SpecStats
from fuser.runtime.prompts import check_prompts, pad_batch
from fuser.runtime.steps import DECODE, PREFILL, ModelSteps


class Engine:
    """An optimized target (and optional draft): `logits`, `generate`, `stream`, `report()`."""

    def __init__(self, target: ModelSteps | None, draft: ModelSteps | None, *,
                 config: FuserConfig, user_target: nn.Module | object, device: torch.device,
                 dtype: torch.dtype, vocab_size: int, gamma: int,
                 tokenizer: object | None = None, fallbacks: list[str] | None = None,
                 compile_seconds: float = 0.0) -> None:
        """An engine over built steps (`fuser.optimize` builds them; `fuser.load` reads them).

        target: the target's steps, or None when it runs as plain Hugging Face (user_target).
        user_target: the user's model; for a loaded engine, a `fuser.engine_io.DetachedModel`
            (the generation config only: running it raises).
        draft: the draft's steps, or None (no speculation). gamma: draft tokens per step.
        """
        self.target = target
        self.draft = draft
        self.config = config
        self.user_target = user_target
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.compile_seconds = compile_seconds
        self.stats = SpecStats(gamma=gamma, accepted_per_position=[0] * gamma)
        self._fallbacks: list[str] = list(fallbacks or [])
        self._generating = False
        self.load_seconds: float | None = None  # set by fuser.load
        self.manifest: dict | None = None  # the engine directory's manifest, set by fuser.load

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the engine for one generation: its KV caches serve one at a time."""
        if self._generating:
            raise RuntimeError("this engine is already generating (an unfinished stream?): its KV "
                               "cache serves one generation at a time; finish or close the stream")
        self._generating = True
        try:
            yield
        finally:
            self._generating = False

    # -- public API ---------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
               ) -> torch.Tensor:
        """One full forward through the optimized target, no cache: float32 [B, T, vocab].

        Rows shorter than T are left-padded and marked by attention_mask (values at padded
        positions are unspecified).
        """
        prompts = check_prompts(input_ids, attention_mask, vocab_size=self.vocab_size,
                                max_batch_size=self.config.max_batch_size,
                                max_tokens=self.config.max_seq_len, device=self.device)
        B, T = prompts.batch, prompts.length
        if self.target is None:
            mask = (torch.arange(T, device=self.device)[None] >= prompts.starts[:, None]).long()
            out = self.user_target(input_ids=prompts.tokens, attention_mask=mask).logits
            return out.float()
        padded = pad_batch(prompts, self.config.max_batch_size, min_length=2)
        cache = self.target.cache
        cache.begin(padded.starts)
        out = self.target.run(PREFILL, padded.tokens, padded.positions())
        cache.reset()
        return out[:B, :T].float()

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: object
                 ) -> torch.Tensor:
        """Hugging Face `generate` semantics, speculative when a draft is set: LongTensor[B, T + n].

        Keyword arguments (API.md): do_sample, temperature, top_k, top_p, eos_token_id,
        pad_token_id, attention_mask, seed.
        """
        from fuser.runtime.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: object
               ) -> Iterator[torch.Tensor]:
        """Yield LongTensor[B] per position; concatenated they equal generate(...)[:, T:]."""
        from fuser.runtime.generate import stream

        return stream(self, input_ids, max_new_tokens, **kwargs)

    def save(self, path: str | Path, overwrite: bool = False) -> dict:
        """Write this engine as an engine directory (DESIGN.md, engine files); `fuser.load`
        reads it back without capture, passes or code generation. Returns the manifest."""
        from fuser.engine_io import save

        return save(self, path, overwrite=overwrite)

    def report(self) -> Report:
        """What optimize() did: passes, fused ops per graph, fallbacks, compile time."""
        report = Report(compile_seconds=self.compile_seconds, fallbacks=list(self._fallbacks))
        for m in (self.target, self.draft):
            if m is None:
                continue
            report.fallbacks += m.fallbacks
            report.graph_replays.update(m.graph_replays())
            for graph in m.steps.values():
                report.graphs[graph.name] = dict(graph.fused_ops)
        if self.target is not None and DECODE in self.target:
            decode = self.target[DECODE]
            report.passes = dict(decode.matches)
            report.fused_ops = dict(decode.fused_ops)
        return report
