"""engine.save / fuser.load on the bundled pair: a fresh process reproduces the in-process
engine's greedy tokens, loads in a tenth of the build time, and every kind of unusable engine
directory is refused with a message naming what differs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import fuser
from engine_dirs import BuiltEngine, load_in_fresh_process
from fuser import engine_file as ef
from fuser.passes.fx import count_targets

# One pytest worker builds the bundled engine for both files (README: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("bundled_engine")


def test_fresh_process_reproduces_tokens_and_loads_fast(bundled_engine: BuiltEngine,
                                                        tmp_path: Path) -> None:
    result = load_in_fresh_process(bundled_engine, tmp_path)
    assert torch.equal(torch.tensor(result["tokens"]), bundled_engine.tokens)
    assert result["load_seconds"] <= bundled_engine.build_seconds / 10, result


def test_loaded_engine_has_the_built_graphs_and_no_hf_model(bundled_engine: BuiltEngine) -> None:
    engine = fuser.load(bundled_engine.path)
    report = engine.report()
    assert set(report.graphs) == {"target.prefill", "target.decode", "target.verify",
                                  "draft.prefill", "draft.decode", "draft.catchup",
                                  "draft.resync"}
    assert report.graphs["target.prefill"].get("add_rms_norm", 0) > 0
    assert report.passes["merge_qkv"] > 0
    # decode: the GEMV with its activation, behind its norm in one op (norm_linear); at several
    # rows (this engine's decode bucket) the norm then moves into the GEMVs around it (norm_stats)
    assert report.passes["gated_linear"] > 0 and report.passes["norm_linear"] > 0
    assert report.fused_ops.get("add_rms_norm_linear", 0) + \
        report.fused_ops.get("stats_rms_norm_linear", 0) > 0
    # the loaded fixed-T graphs write the KV cache through fuser::rotary_cache_attention (rotary,
    # cache write and attention in one op), one per layer
    for steps in (engine.target, engine.draft):
        for kind, graph in steps.steps.items():
            writes = count_targets(graph.rewritten,
                                   torch.ops.fuser.rotary_cache_attention.default)
            if kind.fixed:  # as many as the build counted (the manifest), one per layer
                assert writes == graph.fused_ops["rotary_cache_attention"] > 0, graph.name
            else:
                assert writes == 0, graph.name
    assert engine.tokenizer is not None
    assert engine.user_target.generation_config.eos_token_id is not None
    # gamma="auto": the build's iteration costs come with the file; the load does not re-time
    saved = engine.manifest["info"]["engine"]["step_costs"]
    assert {int(b) for b in saved} == set(engine.buckets)
    for costs in saved.values():
        assert {int(g) for g in costs} == {0, *engine.gammas}
    assert engine.step_costs == {int(b): {int(g): s for g, s in costs.items()}
                                 for b, costs in saved.items()}
    logits = engine.logits(bundled_engine.ids[:1, -5:])
    assert logits.shape == (1, 5, engine.vocab_size) and torch.isfinite(logits).all()
    with pytest.raises(RuntimeError, match="no Hugging Face model"):
        engine.user_target.generate(bundled_engine.ids)


def copy_engine(built: BuiltEngine, tmp_path: Path) -> Path:
    path = tmp_path / "engine"
    shutil.copytree(built.path, path)
    return path


def edit_manifest(path: Path, edit: Callable[[dict], None]) -> None:
    manifest = json.loads((path / ef.MANIFEST).read_text())
    edit(manifest)
    (path / ef.MANIFEST).write_text(json.dumps(manifest))


def set_env(key: str, value: object) -> Callable[[dict], None]:
    return lambda m: m["environment"].__setitem__(key, value)


def weights_of(path: Path) -> Path:
    return path / "target" / ef.WEIGHTS


REFUSALS = {
    "torch version": (lambda p: edit_manifest(p, set_env("torch", "2.0.0")),
                      r"torch: engine built with '2\.0\.0'"),
    "device": (lambda p: edit_manifest(p, set_env("device_type", "cuda")),
               r"built for cuda.*no CUDA device|device type"),
    "gpu": (lambda p: edit_manifest(p, set_env("gpu_name", "NVIDIA H999 (no such GPU)")),
            r"GPU: engine built with 'NVIDIA H999 \(no such GPU\)'"),
    "pass hash": (lambda p: edit_manifest(p, lambda m: m["sources"].__setitem__("hash", "0" * 64)),
                  r"pass or kernel sources differ"),
    "pass list": (lambda p: edit_manifest(p, lambda m: m["sources"]["passes"].pop()),
                  r"pass list differs"),
    "missing file": (lambda p: (p / "draft" / "graphs" / "decode1.json").unlink(),
                     r"draft/graphs/decode1\.json is missing"),
    "truncated weights": (lambda p: weights_of(p).write_bytes(weights_of(p).read_bytes()[:1000]),
                          r"target/weights\.safetensors has 1000 bytes.*truncated"),
    "corrupted weights": (lambda p: corrupt(weights_of(p)), r"target/weights\.safetensors is corrupted"),
    "half-written": (lambda p: (p / ef.MANIFEST).unlink(), r"no manifest\.json.*did not finish"),
    "truncated manifest": (lambda p: (p / ef.MANIFEST).write_text((p / ef.MANIFEST).read_text()[:200]),
                           r"not valid JSON"),
}


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_load_refuses(case: str, bundled_engine: BuiltEngine, tmp_path: Path) -> None:
    path = copy_engine(bundled_engine, tmp_path)
    damage, message = REFUSALS[case]
    damage(path)
    with pytest.raises(fuser.EngineFileError, match=message):
        fuser.load(path)
    assert issubclass(fuser.EngineFileError, ValueError)


def test_a_refused_load_leaves_transformers_importable(bundled_engine: BuiltEngine,
                                                       tmp_path: Path) -> None:
    """A load refused while its thread still imports transformers (for the tokenizer): the
    caller imports transformers next (`fuser demo` rebuilds a stale cached engine) and must
    find the whole module, not one half initialised ("cannot import name 'LlamaConfig'").
    In a fresh process, where transformers is not imported yet."""
    path = copy_engine(bundled_engine, tmp_path)
    weights_of(path).write_bytes(weights_of(path).read_bytes()[:1000])  # refused at once
    code = ("import fuser\n"
            "try:\n"
            f"    fuser.load({str(path)!r})\n"
            "except fuser.EngineFileError:\n"
            "    pass\n"
            "from transformers import LlamaConfig\n"
            "print('imported')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "imported" in proc.stdout, proc.stderr[-3000:]


def test_half_written_staging_directory_is_not_an_engine(bundled_engine: BuiltEngine,
                                                         tmp_path: Path) -> None:
    """What an interrupted save leaves (a staging directory without its manifest) is refused."""
    staging = tmp_path / ".engine.x.partial"
    shutil.copytree(bundled_engine.path, staging, ignore=shutil.ignore_patterns(ef.MANIFEST))
    with pytest.raises(fuser.EngineFileError, match="did not finish"):
        fuser.load(staging)
