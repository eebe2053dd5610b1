"""ONNX export (fuser/onnx/) run by onnxruntime (runtime/onnx_steps.py): logits equal eager
PyTorch at prefill and at decode over a cache, for every supported family; the exported graphs
hold onnxruntime's fused operators, counted; unsupported pieces and FP8 are refused by name.

Each family's tiny model is exported once (module scope, ~10 s each); hypothesis then varies
what the graphs take dynamically: batch, prompt lengths (left padding), tokens per step and
per-row rollbacks of the cache (as a rejected draft leaves it).
"""

from __future__ import annotations

import functools
import warnings

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fuser.capture import SUPPORTED_MODEL_TYPES  # noqa: E402
from fuser.onnx import OnnxExportError  # noqa: E402
from fuser.onnx.export import export_models  # noqa: E402
from fuser.runtime.onnx_steps import load  # noqa: E402
from fuser.runtime.steps import DECODE, PREFILL  # noqa: E402
from tiny import (engine_examples, hf_logits, model_configs, random_prompts,  # noqa: E402
                  relative_error, tiny_model)

# One worker exports each family once for the whole module (the exports are its cost).
pytestmark = [pytest.mark.xdist_group("onnx_export"),
              pytest.mark.usefixtures("one_intra_op_thread")]

MAX_SEQ_LEN = 48
TOLERANCE = 1e-4  # fp32, relative (the bound)
# Mistral with a sliding window shorter than the prompts (GroupQueryAttention's
# local_window_size); Qwen2 with its q/k/v biases; Llama plain.
FAMILY_SHAPES = {"llama": {}, "mistral": dict(sliding_window=3), "qwen2": {}}


@functools.cache
def exported(family: str, tmp: str) -> tuple[torch.nn.Module, object]:
    """(eager model, Engine over its ONNX export), exported once per family."""
    model = tiny_model(family, seed=5, init_range=0.3, **FAMILY_SHAPES[family])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_models(model, None, f"{tmp}/{family}", max_seq_len=MAX_SEQ_LEN)
    return model, load(f"{tmp}/{family}", max_batch_size=4)


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("onnx"))


def expected_fused_ops(layers: int) -> dict[str, int]:
    """onnxruntime's fused operators a Llama-like decoder of `layers` layers exports: the
    embedding's RMSNorm plain, every later norm after a residual add, two rotations (q, k) and
    one cache attention per layer."""
    return {"SimplifiedLayerNormalization": 1,
            "com.microsoft.SkipSimplifiedLayerNormalization": 2 * layers,
            "com.microsoft.RotaryEmbedding": 2 * layers,
            "com.microsoft.GroupQueryAttention": layers}


def fused(ops: dict[str, int]) -> dict[str, int]:
    return {op: n for op, n in ops.items() if op.startswith("com.microsoft.") or
            op == "SimplifiedLayerNormalization"}


def run_and_compare(model: torch.nn.Module, engine: object, lengths: list[int],
                    chunks: list[int], rollbacks: list[list[int]], seed: int) -> list[float]:
    """Prefill left-padded prompts, then decode `chunks` tokens a step, row b first rolling its
    cache back by rollbacks[step][b]; -> the relative error of each step's logits against
    eager PyTorch over the whole sequence (real positions only)."""
    B = len(lengths)
    T = max(lengths)
    total = T + sum(chunks)
    ids, mask = random_prompts(B, lengths, model.config.vocab_size, seed)
    more = torch.randint(3, model.config.vocab_size, (B, total - T),
                         generator=torch.Generator().manual_seed(seed + 1))
    full = torch.cat([ids, more], dim=1)  # [B, total]
    full_mask = torch.cat([mask, torch.ones_like(more)], dim=1)
    ref = hf_logits(model, full, full_mask)  # [B, total, V]
    starts = (mask == 0).sum(1)  # [B] left padding
    steps = engine.target
    cache = steps.cache
    rows = steps.cache.batch_size  # the engine's bucket; rows past B run padding
    pad = rows - B

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[:1].expand(pad, *t.shape[1:])]) if pad else t

    cache.begin(padded(starts))
    positions = (torch.arange(T)[None] - starts[:, None]).clamp(min=0)
    out = steps[PREFILL].eager(padded(ids), padded(positions), cache.seq_lens, cache.starts)
    real = mask.bool()
    errors = [relative_error(out[:B][real], ref[:, :T][real])]
    cache.set_lengths(T)
    decode = steps[DECODE].eager
    for n, back in zip(chunks, rollbacks):
        lengths_now = cache.seq_lens[:B] - torch.tensor(back)
        cache.set_lengths(padded(lengths_now))
        slots = lengths_now[:, None] + torch.arange(n)  # [B, n]
        tokens = full.gather(1, slots)
        positions = slots - starts[:, None]
        out = decode(padded(tokens), padded(positions), cache.seq_lens, cache.starts)[:B]
        expect = ref.gather(1, slots[..., None].expand(B, n, ref.shape[-1]))
        errors.append(relative_error(out, expect))
        cache.set_lengths(padded(lengths_now + n))
    cache.reset()
    return errors


@st.composite
def step_cases(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[int]], int]:
    batch = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(1, 12), min_size=batch, max_size=batch))
    if max(lengths) < 2:  # prefill takes T >= 2 (the engine pads to that)
        lengths[0] = 2
    chunks = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    # A row may roll back at most what it holds past its first real token (and past the
    # prompt, so that its positions stay those of the reference).
    rollbacks = [draw(st.lists(st.integers(0, 2 if i else 0), min_size=batch, max_size=batch))
                 for i in range(len(chunks))]
    return lengths, chunks, rollbacks, draw(st.integers(0, 999))


@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
@settings(max_examples=12, deadline=None, derandomize=True)
@given(case=step_cases())
def test_logits_equal_eager_at_prefill_and_decode(family, case, export_dir):
    model, engine = exported(family, export_dir)
    lengths, chunks, rollbacks, seed = case
    # A rollback never goes below the previous step's tokens (it undoes part of the last one).
    rollbacks = [[min(r, chunks[i - 1]) if i else 0 for r in row]
                 for i, row in enumerate(rollbacks)]
    errors = run_and_compare(model, engine, lengths, chunks, rollbacks, seed)
    assert max(errors) <= TOLERANCE, errors


@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_graphs_hold_onnxruntime_fused_ops(family, export_dir):
    _, engine = exported(family, export_dir)
    layers = len(engine.target.cache.k)
    for file, graph in engine.manifest["roles"]["target"]["graphs"].items():
        assert fused(graph["ops"]) == expected_fused_ops(layers), (file, graph["ops"])
        # Nothing of a norm, a rotation or an attention is left unfused.
        for op in ("Pow", "ReduceMean", "Sqrt", "Cos", "Sin", "Softmax", "ScatterND"):
            assert op not in graph["ops"], (file, op)
        assert graph["matches"]["rms_norm"] + graph["matches"]["add_rms_norm"] == 2 * layers + 1


@pytest.mark.parametrize("family", ["llama"])
def test_no_reshape_of_a_reshape(family, export_dir):
    """ATen's view pairs export as one Reshape each, not chains (fuser/onnx/aten.py `_view`)."""
    import glob

    import onnx

    exported(family, export_dir)
    for path in glob.glob(f"{export_dir}/{family}/*/*.onnx"):
        graph = onnx.load(path, load_external_data=False).graph
        reshaped = {n.output[0] for n in graph.node if n.op_type == "Reshape"}
        chained = [n.name for n in graph.node if n.op_type == "Reshape" and n.input[0] in reshaped]
        assert not chained, (path, chained)


@pytest.mark.parametrize("family", ["mistral"])
def test_generate_greedy_and_sampling(family, export_dir):
    """The engine's own decoding loop over the onnxruntime steps: greedy equals Hugging Face,
    sampling with top_k=1 equals greedy, a seed repeats."""
    model, engine = exported(family, export_dir)
    ids, mask = random_prompts(3, [5, 9, 2], model.config.vocab_size, seed=11)
    ours = engine.generate(ids, 12, attention_mask=mask)
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                             eos_token_id=2, pad_token_id=0)  # the generation config's

    assert torch.equal(ours, ref)
    assert torch.equal(engine.generate(ids, 12, attention_mask=mask, do_sample=True, top_k=1,
                                       seed=3), ours)
    first = engine.generate(ids, 12, attention_mask=mask, do_sample=True, seed=4)
    assert torch.equal(engine.generate(ids, 12, attention_mask=mask, do_sample=True, seed=4),
                       first)


def test_fp8_is_refused(tmp_path):
    model = tiny_model("llama")
    with pytest.raises(OnnxExportError, match="FP8 engine is not exported"):
        export_models(model, None, tmp_path / "out", precision="fp8")
    assert not (tmp_path / "out").exists()


def test_untranslatable_op_is_refused_by_name():
    from fuser.onnx.translate import translate

    graph = torch.fx.Graph()
    tokens = graph.placeholder("tokens")
    graph.output(graph.call_function(torch.ops.aten.cumsum.default, (tokens, 1)))
    with pytest.raises(OnnxExportError, match=r"target.decode: aten.cumsum.default has no ONNX "
                                              r"translation.*does not approximate"):
        translate(torch.fx.GraphModule({}, graph), "target.decode", 1, 8)


@pytest.mark.slow
@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
@engine_examples
@given(data=st.data())
def test_logits_equal_eager_over_model_configs(family, data, tmp_path_factory):
    """As above, over hypothesis' model configurations (one export each)."""
    config = data.draw(model_configs(family), label="config")
    model = tiny_model(family, seed=data.draw(st.integers(0, 99)), init_range=0.3, **config)
    out = tmp_path_factory.mktemp("onnx_config")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_models(model, None, out, max_seq_len=MAX_SEQ_LEN, overwrite=True)
    engine = load(out, max_batch_size=3)
    errors = run_and_compare(model, engine, [7, 3, 10], [1, 4, 2], [[0] * 3, [1, 0, 2], [1] * 3],
                             seed=1)
    assert max(errors) <= TOLERANCE, errors
    layers = config["layers"]
    for graph in engine.manifest["roles"]["target"]["graphs"].values():
        assert fused(graph["ops"]) == expected_fused_ops(layers)


@pytest.mark.slow
def test_partial_rotary_is_refused_by_name(tmp_path):
    from tiny import tiny_also_matching

    model = tiny_also_matching("phi3", partial_rotary_factor=0.5)
    with pytest.raises(OnnxExportError, match="partial rotary"):
        export_models(model, None, tmp_path / "out", max_seq_len=16)


@pytest.mark.slow
def test_engine_export_onnx(engines, tmp_path):
    """engine.export_onnx of a built engine: onnxruntime's greedy tokens equal the engine's."""
    engine, target = engines("plain")
    engine.export_onnx(tmp_path / "out")
    ours = load(tmp_path / "out", max_batch_size=2)
    ids, mask = random_prompts(2, [6, 3], target.config.vocab_size, seed=2)
    assert torch.equal(ours.generate(ids, 10, attention_mask=mask),
                       engine.generate(ids, 10, attention_mask=mask))
