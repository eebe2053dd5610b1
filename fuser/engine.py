"""`fuser.optimize` and the Engine it returns."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from fuser.capture import SUPPORTED_MODEL_TYPES, engine_view, supports_cache_attention
from fuser.compile import CompiledModel, model_geometry
from fuser.config import FuserConfig
from fuser.report import Report, SpecStats
from fuser.runtime.kv_cache import KVCache, free_memory_bytes
from fuser.runtime.prompts import check_prompts, pad_batch

ModelLike = nn.Module | str | Path


def load_model(source: ModelLike, argument: str) -> tuple[nn.Module, object | None]:
    """A causal-LM instance (and its tokenizer, if a directory has one) from `source`."""
    if isinstance(source, nn.Module):
        if not hasattr(source, "config") or not hasattr(source.config, "vocab_size"):
            raise ValueError(f"{argument} must be a transformers causal LM (a module with a "
                             f"config), got {type(source).__name__}")
        return source, None
    if not isinstance(source, (str, Path)):
        raise ValueError(f"{argument} must be a transformers model or a path to a model "
                         f"directory, got {type(source).__name__}")
    path = Path(source)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{argument}={str(source)!r} is not a model directory "
                         "(a folder with config.json and safetensors weights)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{argument}={str(source)!r} could not be loaded as a causal LM: {e}") from None
    tokenizer = None
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def _check_draft_vocab(target: nn.Module, draft: nn.Module) -> int:
    """The vocabulary the pair shares. Sizes may differ only by padding rows; API.md."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    common = min(tv, dv)
    # Padding rows sit at the end: a real difference shows up in special-token ids or a size
    # gap that is not padding-sized (Qwen2.5 pads 151665 real tokens to 151936 / 152064).
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        t, d = getattr(target.config, attr, None), getattr(draft.config, attr, None)
        if t is not None and d is not None and t != d:
            raise ValueError(f"draft is not compatible with target: {attr} differs "
                             f"(target {t}, draft {d}); the draft must use the target's tokenizer")
    if abs(tv - dv) > max(1024, common // 16):
        raise ValueError(f"draft is not compatible with target: vocabulary sizes {dv} and {tv} "
                         "differ by more than padding; the draft must use the target's tokenizer")
    return common


class Engine:
    """An optimized target (and optional draft): `logits`, `generate`, `stream`, `report()`."""

    def __init__(self, target: nn.Module, draft: nn.Module | None, config: FuserConfig,
                 tokenizer: object | None = None) -> None:
        start = time.perf_counter()
        self.config = config
        self.tokenizer = tokenizer
        self.user_target = target
        self.device = torch.device(config.device) if config.device is not None else \
            next(target.parameters()).device
        self.dtype = config.dtype_for(next(target.parameters()).dtype)
        self.gamma = config.resolved_gamma if draft is not None else 0
        self.stats = SpecStats(gamma=self.gamma, accepted_per_position=[0] * self.gamma)
        self._fallbacks: list[str] = []
        self.vocab_size = target.config.vocab_size
        if draft is not None:
            self.vocab_size = _check_draft_vocab(target, draft)
        # Slots per row: max_seq_len plus the gamma + 1 positions a verify step may write.
        self.slots = config.max_seq_len + self.gamma + 1

        self.target = self._prepare("target", target)
        self.draft = self._prepare("draft", draft) if draft is not None and self.gamma > 0 else None
        if self.target is not None:
            self.target.build("prefill", None)
            self.target.build("decode", 1)
            if self.draft is not None:
                self.target.build("verify", self.gamma + 1)
                self.draft.build("prefill", None)
                self.draft.build("decode", 1)
                self.draft.build("catchup", 2)  # re-feeds the last accepted token with the new one
            for m in (self.target, self.draft):
                if m is not None:
                    m.warm_up()
            if not self._agrees_with_eager(self.target, target):
                self.target = self.draft = None
            elif self.draft is not None and not self._agrees_with_eager(self.draft, draft):
                self.draft = None
            if self.device.type == "cuda" and config.cuda_graphs:
                for m in (self.target, self.draft):
                    if m is not None:
                        m.capture_cuda_graphs()
        self.compile_seconds = time.perf_counter() - start

    def _prepare(self, role: str, model: nn.Module) -> CompiledModel | None:
        """The compiled model for `role`, or None when it must run as plain Hugging Face."""
        model_type = getattr(model.config, "model_type", "?")
        if not supports_cache_attention(model):
            self._fallback(f"{role}: {type(model).__name__} does not dispatch attention through "
                           "transformers' attention registry; it runs in eager PyTorch, unfused")
            return None
        if model_type not in SUPPORTED_MODEL_TYPES:
            self._fallback(f"{role}: model type {model_type!r} is not in the supported list "
                           f"{SUPPORTED_MODEL_TYPES}; fusions that match are applied, the rest "
                           "runs in eager PyTorch")
        layers, kv_heads, head_dim = model_geometry(model.config)
        nbytes = KVCache.nbytes(layers, self.config.max_batch_size, self.slots, kv_heads,
                                head_dim, self.dtype)
        free = free_memory_bytes(self.device)
        if free is not None and nbytes > free:
            raise ValueError(
                f"the {role}'s KV cache needs {nbytes / 2**30:.2f} GiB for max_batch_size="
                f"{self.config.max_batch_size} x max_seq_len={self.config.max_seq_len}, but "
                f"only {free / 2**30:.2f} GiB is free on {self.device}: lower one of them")
        cache = KVCache.allocate(layers, self.config.max_batch_size, self.slots, kv_heads,
                                 head_dim, self.dtype, self.device)
        view = engine_view(model, self.dtype, self.device)
        mode = self.config.compile
        if mode == "auto":
            mode = "inductor" if self.device.type == "cuda" else "fx"
        return CompiledModel(role, view, cache, mode, self.config.dump_graphs,
                             fused_attention=self.config.fused_attention)

    @torch.no_grad()
    def _agrees_with_eager(self, compiled: CompiledModel, model: nn.Module) -> bool:
        """Check the captured prefill and decode graphs against the user's eager model on a
        short random prompt. A model family whose capture is subtly wrong then falls back to
        eager PyTorch instead of giving silently wrong answers."""
        T = min(6, self.config.max_seq_len)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, compiled.vocab_size, (1, T), generator=generator)
        user_device = next(model.parameters()).device
        ref = model(input_ids=ids.to(user_device),
                    position_ids=torch.arange(T, device=user_device)[None]).logits.float()
        B = compiled.cache.batch_size
        tokens = ids.to(self.device).expand(B, T).contiguous()
        positions = torch.arange(T, device=self.device)[None].expand(B, T).contiguous()
        cache = compiled.cache
        cache.reset()
        out = compiled.run("prefill", tokens[:, :-1], positions[:, :-1])[:1]
        cache.seq_lens.fill_(T - 1)
        # Fresh [B, 1] tensors: a slice's strides differ from the runtime's, and a compiled
        # step guards on strides (the check would cost a second Inductor compile).
        last = compiled.run("decode", tokens[:, -1:].clone(memory_format=torch.contiguous_format),
                            positions[:, -1:].clone(memory_format=torch.contiguous_format))[:1]
        cache.reset()
        got = torch.cat([out, last], dim=1).float().to(ref.device)
        error = float((got - ref).norm() / ref.norm())
        tolerance = 1e-3 if self.dtype == torch.float32 else 5e-2
        if error <= tolerance:
            return True
        self._fallback(f"{compiled.role}: the captured step disagrees with eager PyTorch "
                       f"(relative error {error:.2e} > {tolerance:g}); it runs in eager "
                       "PyTorch instead" + (", without speculation" if compiled.role == "draft" else ""))
        return False

    def _fallback(self, message: str) -> None:
        warnings.warn(f"fuser: {message}", stacklevel=3)
        self._fallbacks.append(message)

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
        cache.reset()
        cache.starts.copy_(padded.starts)
        out = self.target.run("prefill", padded.tokens, padded.positions())
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

    def report(self) -> Report:
        """What optimize() did: passes, fused ops per graph, fallbacks, compile time."""
        report = Report(compile_seconds=self.compile_seconds, fallbacks=list(self._fallbacks))
        for m in (self.target, self.draft):
            if m is None:
                continue
            report.fallbacks += m.fallbacks
            report.graph_replays.update(m.graph_replays())
            for name, graph in m.graphs.items():
                report.graphs[graph.name] = dict(graph.fused_ops)
        if self.target is not None and "decode" in self.target.graphs:
            decode = self.target.graphs["decode"]
            report.passes = dict(decode.matches)
            report.fused_ops = dict(decode.fused_ops)
        return report


def optimize(target: ModelLike, draft: ModelLike | None = None,
             config: FuserConfig | None = None) -> Engine:
    """Capture, rewrite and compile `target` (and `draft`) into an Engine.

    target, draft: a transformers causal-LM instance or a path to a local model directory.
    The user's models are not modified. Pieces that cannot be optimized run in eager PyTorch
    with a warning and an entry in `report().fallbacks`.
    """
    if config is None:
        config = FuserConfig()
    if not isinstance(config, FuserConfig):
        raise ValueError(f"config must be a fuser.FuserConfig, got {type(config).__name__}")
    target_model, tokenizer = load_model(target, "target")
    draft_model = load_model(draft, "draft")[0] if draft is not None else None
    return Engine(target_model, draft_model, config, tokenizer)
