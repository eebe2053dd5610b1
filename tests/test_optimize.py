"""optimize(): argument errors, fallbacks for other decoders, and the Inductor path."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, GPT2Config, GPT2LMHeadModel

import fuser
import fuser.build
from fuser.numerics import LOGITS_TOLERANCE, relative_error
from tiny import FAMILIES, hf_logits, random_prompts, tiny_model


@pytest.mark.parametrize(("kwargs", "named"), [
    (dict(precision="int3"), "precision"),
    (dict(fp8_lm_head="yes"), "fp8_lm_head"),
    (dict(gamma=-1), "gamma"),
    (dict(gamma=16), "gamma"),
    (dict(gamma=2.5), "gamma"),
    (dict(max_seq_len=0), "max_seq_len"),
    (dict(max_seq_len=-5), "max_seq_len"),
    (dict(max_batch_size=0), "max_batch_size"),
    (dict(max_batch_size=True), "max_batch_size"),
    (dict(compile="tensorrt"), "compile"),
    (dict(device="not-a-device"), "device"),
])
def test_bad_config_raises_value_error_naming_it(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        fuser.FuserConfig(**kwargs)


def test_good_config_defaults() -> None:
    config = fuser.FuserConfig()
    # "auto" builds every candidate gamma; the cache's headroom is the largest.
    assert config.gamma == "auto" and config.gammas == (1, 2, 4, 6)
    assert config.resolved_gamma == 6 and config.max_batch_size == 1
    assert fuser.FuserConfig(gamma=0).resolved_gamma == 0


def test_path_that_is_not_a_model_directory(tmp_path) -> None:
    with pytest.raises(ValueError, match="target"):
        fuser.optimize(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a model directory"):
        fuser.optimize(tmp_path / "empty")
    with pytest.raises(ValueError, match="draft"):
        fuser.optimize(tiny_model("llama", layers=1), draft=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="config"):
        fuser.optimize(tiny_model("llama", layers=1), config={"gamma": 2})


def test_model_directory_loads(tmp_path) -> None:
    model = tiny_model("qwen2", layers=1)
    model.save_pretrained(tmp_path / "m")
    engine = fuser.optimize(str(tmp_path / "m"), config=fuser.FuserConfig(max_seq_len=16))
    ids, _ = random_prompts(1, [6], model.config.vocab_size, seed=0)
    assert relative_error(engine.logits(ids), model(ids).logits) <= LOGITS_TOLERANCE[torch.float32]


def test_kv_cache_too_large_is_a_clear_error() -> None:
    model = tiny_model("llama", layers=1)
    with pytest.raises(ValueError, match="max_seq_len"):
        fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=10**6, max_seq_len=10**6))


def test_logits_input_errors() -> None:
    model = tiny_model("llama", layers=1)
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=2, max_seq_len=8))
    with pytest.raises(ValueError, match="max_batch_size"):
        engine.logits(torch.ones(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.logits(torch.ones(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        engine.logits(torch.ones(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="outside"):
        engine.logits(torch.full((1, 3), 10**6))
    with pytest.raises(ValueError, match="left padding"):
        engine.logits(torch.ones(1, 3, dtype=torch.long), attention_mask=torch.tensor([[1, 1, 0]]))


def _check_matches_eager(model: torch.nn.Module, **config: object) -> fuser.Engine:
    engine = fuser.optimize(model, config=fuser.FuserConfig(max_batch_size=2, max_seq_len=16, **config))
    ids, mask = random_prompts(2, [7, 4], model.config.vocab_size, seed=3)
    ref = hf_logits(model, ids, mask)
    out = engine.logits(ids, attention_mask=mask)
    dtype = next(model.parameters()).dtype
    assert relative_error(out[mask.bool()], ref[mask.bool()]) <= LOGITS_TOLERANCE[dtype]
    return engine


def test_model_without_attention_registry_falls_back_to_eager() -> None:
    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=120, hidden_size=32, n_layer=1, n_head=2)).eval()
    with pytest.warns(UserWarning, match="eager"):
        engine = _check_matches_eager(model)
    assert engine.target is None
    assert any("attention registry" in f for f in engine.report().fallbacks)


def test_other_decoder_works_or_falls_back() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=120, n_embd=32, n_layer=2, n_head=2,
                                       n_positions=64)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = _check_matches_eager(model)
    assert any("gpt2" in f for f in engine.report().fallbacks)  # not a supported family


def test_export_failure_falls_back_with_the_engine_cache(monkeypatch) -> None:
    def broken_export(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated export failure")

    monkeypatch.setattr(fuser.build, "export_step", broken_export)
    with pytest.warns(UserWarning, match="export failed"):
        engine = _check_matches_eager(tiny_model("mistral", layers=2, sliding_window=3))
    assert any("simulated export failure" in f for f in engine.report().fallbacks)
    assert engine.report().passes == {}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_inductor_compiles_the_rewritten_graph(family: str) -> None:
    engine = _check_matches_eager(tiny_model(family, layers=2, sliding_window=None),
                                  compile="inductor")
    # The decode graph's, at the 2-row bucket: each norm rides with the GEMVs around it
    # (passes/norm_stats.py: the producer computes the sum and its squares, the consumer
    # normalises; one row would keep add_rms_norm_linear instead).
    fused = engine.report().fused_ops
    names = ("add_rms_norm_linear", "linear_residual", "stats_rms_norm_linear", "rms_norm_linear")
    assert {name: fused.get(name, 0) for name in names} == {
        "add_rms_norm_linear": 0, "linear_residual": 4, "stats_rms_norm_linear": 4,
        "rms_norm_linear": 1}


def test_graphs_are_dumped_before_and_after_every_pass(tmp_path) -> None:
    from fuser.passes import PASSES, PassContext
    from fuser.runtime.steps import DECODE

    config = fuser.FuserConfig(max_seq_len=8, dump_graphs=str(tmp_path))
    fuser.optimize(tiny_model("llama", layers=1), config=config)
    context = PassContext("target.decode", DECODE, config)
    assert not all(p.applies(context) for p in PASSES)  # fp8_linear: precision="fp8" only
    for index, p in enumerate(PASSES):
        before = tmp_path / f"target.decode.{index:02d}.{p.name}.before.py"
        after = tmp_path / f"target.decode.{index:02d}.{p.name}.after.py"
        # A pass that does not apply to the graph is skipped: nothing to dump.
        assert before.is_file() == after.is_file() == p.applies(context), p.name
    last = max(i for i, p in enumerate(PASSES) if p.applies(context))
    final = (tmp_path / f"target.decode.{last:02d}.{PASSES[last].name}.after.py").read_text()
    assert "torch.ops.fuser.rms_norm" in final and "torch.ops.fuser.add_rms_norm" in final
