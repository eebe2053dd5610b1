"""Tiny random Hugging Face models, hypothesis strategies over their configurations, the one
helper that exports a module as capture does, and logits comparisons against eager."""

from __future__ import annotations

import pytest
import torch
import transformers
from hypothesis import Phase, settings
from hypothesis import strategies as st
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from fuser.capture import SUPPORTED_MODEL_TYPES
from fuser.numerics import relative_error

__all__ = ["relative_error"]  # re-exported: the one definition is fuser.numerics.relative_error


def _classes(model_type: str) -> tuple[type, type]:
    """(config class, causal-LM class) of a transformers model type, as AutoModelForCausalLM
    resolves them."""
    return (CONFIG_MAPPING[model_type],
            getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]))


# The supported families (fuser.capture.SUPPORTED_MODEL_TYPES, the one list) -> their classes.
# Tests that run on every supported family iterate this.
FAMILIES: dict[str, tuple[type, type]] = {t: _classes(t) for t in SUPPORTED_MODEL_TYPES}


def families_in_ci(*kept: str) -> list:
    """FAMILIES as pytest parameters, those not in `kept` marked slow (left out of the README's
    test command; `-m slow` runs them). For a pass whose pattern is the same graph in another
    family (the tiny Mistral is Llama's decoder under another class when it has no sliding
    window; Qwen2's norms, rotary and attention are Llama's): each family costs an engine
    build, 20-50 s on a 2-core CPU."""
    return [f if f in kept else pytest.param(f, marks=pytest.mark.slow) for f in sorted(FAMILIES)]


def tiny_config(family: str, *, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
                layers: int = 2, intermediate: int = 72, vocab: int = 160, eps: float = 1e-6,
                rope_theta: float = 10000.0, sliding_window: int | None = None,
                tie: bool = False, init_range: float = 0.02, bos: int | None = 1,
                eos: int | None = 2, pad: int | None = 0) -> object:
    """A small config of `family`; hidden = heads * head_dim (so not always a power of two).

    init_range: the weights' std (HF's initializer_range); 0.3 gives logits of std ~2.4, whose
    greedy continuations vary and rarely nearly tie. bos/eos/pad: the special tokens (None: no
    such token in the config nor in the model's generation config).
    """
    config_cls, _ = FAMILIES[family]
    kwargs: dict[str, object] = dict(
        vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=eps, max_position_embeddings=256,
        tie_word_embeddings=tie, initializer_range=init_range, bos_token_id=bos,
        eos_token_id=eos, pad_token_id=pad,
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


# Families outside SUPPORTED_MODEL_TYPES on which some fusions also match: Phi-3 (projections
# shipped merged, partial rotary) and Gemma-2 (GeGLU, soft-capping, (1 + w) RMSNorm). They show a
# pass is not written for Llama alone; they are not supported families (optimize() warns and
# falls back wherever a pattern does not match), so no test iterates them with FAMILIES.
FUSIONS_ALSO_MATCH: dict[str, dict[str, object]] = {
    "phi3": {},
    "gemma2": dict(head_dim=12, hidden_activation="gelu_pytorch_tanh", sliding_window=3,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
}
_ALSO_MATCH_SHAPE = dict(vocab_size=160, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_also_matching(family: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A random fp32 model of a FUSIONS_ALSO_MATCH family in eval mode; `overrides` are config
    fields (transformers' names) over the family's test shape."""
    config_cls, model_cls = _classes(family)
    torch.manual_seed(seed)
    config = config_cls(**(_ALSO_MATCH_SHAPE | FUSIONS_ALSO_MATCH[family] | overrides))
    return model_cls(config).eval()


def export_like_capture(module: torch.nn.Module, args: tuple, kwargs: dict | None = None
                        ) -> torch.fx.GraphModule:
    """`module` as the passes see a captured step: exported as fuser.capture.export_step does
    (non-strict, under no_grad, decomposed to core ATen, `.module()`), then prepared as
    run_passes prepares every graph (export's metadata assertions removed), so that a single
    pass can be applied to it directly. run_passes preparing it again changes nothing."""
    from fuser.passes.fx import prepare_graph

    with torch.no_grad():
        ep = torch.export.export(module, args, kwargs=kwargs, strict=False)
        gm = ep.run_decompositions().module()
    prepare_graph(gm)
    return gm


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


def pass_context(graph_name: str, kind: object = None) -> object:
    """A PassContext for running the passes on a standalone graph (default: a decode step)."""
    import fuser
    from fuser.passes import PassContext
    from fuser.runtime.steps import DECODE

    return PassContext(graph_name, kind or DECODE, fuser.FuserConfig())
