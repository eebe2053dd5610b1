"""One model (target or draft) made ready to run: its cache, its step graphs, what was fused.

Each graph is exported once (`fuser.capture`), rewritten by `fuser.passes.PASSES`, and then run
either as the rewritten FX graph ("fx") or compiled by Inductor ("inductor"). Whatever cannot be
exported or compiled runs in eager PyTorch with an entry in `fallbacks`; it never fails.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fuser.capture import StepModule, export_step
from fuser.passes import run_passes
from fuser.runtime.cuda_graphs import CudaGraphStep
from fuser.runtime.kv_cache import KVCache

StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Graph:
    """A step graph: `fn(tokens, positions, seq_lens, starts) -> logits`.

    tokens_per_step is the fixed T, or None for a prefill graph that takes any T >= 2.
    """

    name: str
    tokens_per_step: int | None
    fn: StepFn
    fused_ops: dict[str, int]
    matches: dict[str, int]


def model_geometry(config: object) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) from a transformers config."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, kv_heads, head_dim


class CompiledModel:
    """A model's engine-side state: the KV cache and the step graphs built over it."""

    def __init__(self, role: str, model: nn.Module, cache: KVCache, compile_mode: str,
                 dump_graphs: str | None = None, fused_attention: bool = False) -> None:
        self.role = role
        self.model = model
        self.cache = cache
        self.compile_mode = compile_mode
        self.dump_graphs = dump_graphs
        self.fused_attention = fused_attention
        self.graphs: dict[str, Graph] = {}
        self.fallbacks: list[str] = []
        self.vocab_size: int = model.config.vocab_size
        self._export_failed = False

    def build(self, name: str, tokens_per_step: int | None) -> Graph:
        """Export, rewrite and compile the graph `name` (idempotent)."""
        if name in self.graphs:
            return self.graphs[name]
        module = StepModule(self.model, self.cache.k, self.cache.v,
                            prefill=tokens_per_step is None,
                            fused_attention=self.fused_attention)
        full_name = f"{self.role}.{name}"
        graph = Graph(full_name, tokens_per_step, module, fused_ops={}, matches={})
        if not self._export_failed:
            try:
                gm = export_step(module, self.cache.batch_size, tokens_per_step,
                                 max_tokens=self.cache.slots)
            except Exception as e:  # unsupported model code: run eagerly, say so once
                self._export_failed = True
                self._fallback(f"{self.role}: torch.export failed ({_first_line(e)}); "
                               "its steps run in eager PyTorch with the engine's KV cache")
            else:
                result = run_passes(gm, full_name, self.dump_graphs)
                for err in result.errors:
                    self._fallback(err)
                graph.fn = self._compile(gm, full_name, dynamic=tokens_per_step is None)
                graph.fused_ops, graph.matches = result.fused_ops, result.matches
        self.graphs[name] = graph
        return graph

    def _compile(self, gm: torch.fx.GraphModule, name: str, dynamic: bool) -> StepFn:
        # Prefill (dynamic T) runs once per request: on the GPU its ATen kernels are long
        # enough; Inductor is kept for the fixed-T steps that run once per token.
        if self.compile_mode != "inductor" or dynamic:
            return gm
        return torch.compile(gm, fullgraph=True, dynamic=False)

    def capture_cuda_graphs(self) -> None:
        """Capture every fixed-T graph as a CUDA graph (call after warm_up; CUDA only)."""
        pool = torch.cuda.graph_pool_handle()
        for graph in self.graphs.values():
            if graph.tokens_per_step is None or isinstance(graph.fn, CudaGraphStep):
                continue
            graph.fn = CudaGraphStep(graph.fn, self.cache.batch_size, graph.tokens_per_step,
                                     self.cache.seq_lens, self.cache.starts, pool=pool)
        self.cache.reset()

    def graph_replays(self) -> dict[str, int]:
        """CUDA graph replays so far, per captured graph."""
        return {g.name: g.fn.replays for g in self.graphs.values() if isinstance(g.fn, CudaGraphStep)}

    def warm_up(self) -> None:
        """Run every graph once so that compilation happens now, not in the first request."""
        device = self.cache.seq_lens.device
        B = self.cache.batch_size
        for graph in self.graphs.values():
            for T in ([2, 3] if graph.tokens_per_step is None else [graph.tokens_per_step]):
                tokens = torch.zeros(B, T, dtype=torch.long, device=device)
                positions = torch.arange(T, device=device)[None].expand(B, T).contiguous()
                self.cache.reset()
                self.run(graph.name.split(".", 1)[1], tokens, positions)
        self.cache.reset()

    @torch.no_grad()
    def run(self, name: str, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One step of graph `name` over this model's cache; returns logits [B, T, V].

        tokens, positions: [B, T] with B the cache's batch size. The caller advances
        cache.seq_lens afterwards (by what it keeps).
        """
        graph = self.graphs[name]
        return graph.fn(tokens, positions, self.cache.seq_lens, self.cache.starts)

    def _fallback(self, message: str) -> None:
        warnings.warn(f"fuser: {message}", stacklevel=3)
        self.fallbacks.append(message)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]
