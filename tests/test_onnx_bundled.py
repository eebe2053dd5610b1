"""The bundled pair exported by `fuser export --format onnx` and run by onnxruntime through the
engine's decoding loop: greedy output equals Hugging Face's (speculative and target-only), the
graphs hold onnxruntime's fused operators per layer, and `fuser generate --runtime onnxruntime`
prints those tokens. One export (fp32, ~30 s on a 2-core CPU) serves the module."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import torch  # noqa: E402

from engines import assert_greedy_matches, hf_greedy  # noqa: E402
from fuser.cli import DEMO_PROMPTS, main  # noqa: E402
from fuser.models import bundled_pair  # noqa: E402
from fuser.runtime.onnx_steps import load  # noqa: E402
from test_onnx_export import expected_fused_ops, fused  # noqa: E402

pytestmark = [pytest.mark.xdist_group("onnx_bundled"),
              pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.skipif(bundled_pair() is None,
                                 reason="the bundled pair is not installed")]

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory) -> str:
    target, draft = bundled_pair()
    out = tmp_path_factory.mktemp("onnx_bundled") / "pair"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        status = main(["export", str(target), "--draft", str(draft), "--format", "onnx",
                       "--precision", "fp32", "--max-seq-len", "256", "--out", str(out)])
    assert status == 0
    return str(out)


@pytest.fixture(scope="module")
def reference():
    """The bundled target in fp32 (as fuser runs it on the CPU) and the demo prompts."""
    from fuser.pipeline import load_model

    model, tokenizer = load_model(str(bundled_pair()[0]), "target")
    model = model.float().eval()
    batch = tokenizer(DEMO_PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    return model, tokenizer, batch.input_ids, batch.attention_mask


@pytest.mark.parametrize("gamma", [3, 0])
def test_greedy_equals_hugging_face(export_dir, reference, gamma):
    model, _, ids, mask = reference
    engine = load(export_dir, max_batch_size=len(DEMO_PROMPTS), gamma=gamma)
    assert (engine.draft is not None) == (gamma > 0)
    eos = engine.user_target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    ours = engine.generate(ids, NEW_TOKENS, attention_mask=mask)
    ref, near_tie = hf_greedy(model, ids, mask, NEW_TOKENS, eos=eos or None,
                              pad=engine.user_target.generation_config.pad_token_id)
    assert_greedy_matches(ours, ref, near_tie, ids, eos)
    if gamma:
        assert engine.stats.num_drafts > 0 and engine.stats.num_accepted_tokens > 0


def test_fused_ops_per_layer(export_dir):
    engine = load(export_dir, gamma=1)
    for role in ("target", "draft"):
        info = engine.manifest["roles"][role]
        for graph in info["graphs"].values():
            assert fused(graph["ops"]) == expected_fused_ops(info["layers"]), (role, graph)


def test_cli_generate_with_onnxruntime(export_dir, reference, capsys):
    model, tokenizer, _, _ = reference
    prompt = DEMO_PROMPTS[0]
    capsys.readouterr()
    assert main(["generate", export_dir, "--runtime", "onnxruntime", "--prompt", prompt,
                 "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert printed.rstrip("\n") == prompt + "\n" + tokenizer.decode(ref[0, ids.shape[1]:])


def test_cli_export_refuses_fp8(tmp_path, capsys):
    target, _ = bundled_pair()
    assert main(["export", str(target), "--format", "onnx", "--precision", "fp8",
                 "--out", str(tmp_path / "out")]) == 2
    assert "FP8 engine is not exported" in capsys.readouterr().err


@pytest.mark.slow
def test_cli_export_of_an_engine_directory(bundled_engine, tmp_path):
    """`fuser export ENGINE` exports the models the engine directory records, at its dtype and
    max_seq_len; onnxruntime's greedy tokens equal the engine's."""
    out = tmp_path / "from_engine"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["export", str(bundled_engine.path), "--format", "onnx",
                     "--out", str(out)]) == 0
    engine = load(out, max_batch_size=bundled_engine.ids.shape[0])
    assert engine.manifest["dtype"] == "float32" and engine.draft is not None
    tokens = engine.generate(bundled_engine.ids, bundled_engine.tokens.shape[1] -
                             bundled_engine.ids.shape[1], attention_mask=bundled_engine.mask)
    assert torch.equal(tokens, bundled_engine.tokens)


@pytest.mark.slow
def test_benchmark_script(tmp_path):
    """benchmarks/onnx_cpu.py end to end, short: its JSON and its tables."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "onnx_cpu.json"
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "onnx_cpu.py"),
                          "--skip-fuser-engine", "--new-tokens", "6", "--runs", "1",
                          "--out", str(out)], capture_output=True, text=True, cwd=root,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    results = json.loads(out.read_text())
    assert results["fuser_graphs"]["decode"]["com.microsoft.GroupQueryAttention"] == 6
    assert [r["system"] for r in results["rows"]] == [
        "ORT speculative (auto)", "ORT target-only", "HF generate"]
    assert all(r["note"] == "tokens = HF's" for r in results["rows"][:2])
    assert "GroupQueryAttention" in run.stdout and "HF generate" in run.stdout.splitlines()[-1]
