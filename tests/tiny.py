"""Tiny random Hugging Face models and hypothesis strategies over their configurations."""

from __future__ import annotations

import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def tiny_config(family: str, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                layers: int = 2, intermediate: int = 72, vocab: int = 160, eps: float = 1e-6,
                rope_theta: float = 10000.0, sliding_window: int | None = None,
                tie: bool = False) -> object:
    """A small config of `family`; hidden = heads * head_dim (so not always a power of two)."""
    config_cls, _ = FAMILIES[family]
    kwargs: dict[str, object] = dict(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=eps, max_position_embeddings=256,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    config = config_cls(**kwargs)
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if family == "mistral":
        config.sliding_window = sliding_window
    if family == "qwen2" and sliding_window is not None:
        config.use_sliding_window = True
        config.sliding_window = sliding_window
        config.max_window_layers = 0
        config.layer_types = ["sliding_attention"] * layers
    return config


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               **kwargs: object) -> torch.nn.Module:
    """A randomly initialised causal LM of `family` in eval mode."""
    _, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(tiny_config(family, **kwargs)).eval()
    return model.to(dtype)


# For hypothesis tests whose every example builds an engine (seconds each): two examples per
# family keep a file within its time budget, derandomized, and no shrinking (many minutes).
engine_examples = settings(max_examples=2, deadline=None, derandomize=True,
                           phases=(Phase.explicit, Phase.reuse, Phase.generate))


@st.composite
def model_configs(draw: st.DrawFn, family: str) -> dict[str, object]:
    """Keyword arguments for tiny_model: what real models vary, at test size."""
    kv_heads = draw(st.sampled_from([1, 2]))
    heads = kv_heads * draw(st.sampled_from([1, 2, 3]))
    return dict(
        heads=heads,
        kv_heads=kv_heads,
        head_dim=draw(st.sampled_from([8, 16, 24])),
        layers=draw(st.integers(1, 2)),
        intermediate=draw(st.sampled_from([40, 64, 72, 100])),
        eps=draw(st.sampled_from([1e-5, 1e-6])),
        rope_theta=draw(st.sampled_from([10000.0, 500000.0])),
        sliding_window=draw(st.sampled_from([None, 3])) if family != "llama" else None,
    )


@st.composite
def model_cases(draw: st.DrawFn, family: str, max_batch: int = 4
                ) -> tuple[torch.nn.Module, int, list[int]]:
    """(tiny model of `family`, batch, per-row prompt lengths) drawn by hypothesis."""
    config = draw(model_configs(family), label="config")
    batch = draw(st.integers(1, max_batch), label="batch")
    lengths = draw(st.lists(st.integers(1, 12), min_size=batch, max_size=batch), label="lengths")
    model = tiny_model(family, seed=draw(st.integers(0, 99), label="seed"), **config)
    return model, batch, lengths


def real_logits_error(engine: object, reference: torch.nn.Module, batch: int,
                      lengths: list[int], seed: int) -> float:
    """Relative error of engine.logits against eager `reference` on left-padded random
    prompts, over the real (non-padding) positions only."""
    ids, mask = random_prompts(batch, lengths, reference.config.vocab_size, seed)
    out = engine.logits(ids, attention_mask=mask)
    ref = hf_logits(reference, ids, mask)
    real = mask.bool()
    return relative_error(out[real], ref[real])


def random_prompts(batch: int, lengths: list[int], vocab: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of the given lengths: (input_ids [B, T], attention_mask [B, T])."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(3, vocab, (batch, T), generator=g)
    mask = torch.zeros(batch, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None
              ) -> torch.Tensor:
    """Eager Hugging Face logits (fp32) with positions counted from each row's first real token,
    as `generate` counts them for left-padded prompts."""
    if mask is None:
        mask = torch.ones_like(ids)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ over the whole tensor (DESIGN.md, numerics contract)."""
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def pass_context(graph_name: str, kind: object = None) -> object:
    """A PassContext for running the passes on a standalone graph (default: a decode step)."""
    import fuser
    from fuser.passes import PassContext
    from fuser.runtime.steps import DECODE

    return PassContext(graph_name, kind or DECODE, fuser.FuserConfig())
