"""The command line end to end, each command in a fresh process with its exit status checked:
build, inspect, generate and bench on an engine directory, demo from its cache, user errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine_dirs import BuiltEngine, run_fuser
from fuser.models import bundled_pair
from tiny import tiny_model

# One pytest worker builds the bundled engine for both files (README: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("bundled_engine")


def ok(done: object) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def user_error(done: object, text: str) -> None:
    """Exit status 2, one line on stderr naming the problem, no traceback."""
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [l for l in done.stderr.splitlines() if l.startswith("fuser: error:")]
    assert len(lines) == 1 and text in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_inspect(bundled_engine: BuiltEngine) -> None:
    out = ok(run_fuser("inspect", str(bundled_engine.path)))
    for text in ("torch", "passes", "target.decode", "fused ops: add_rms_norm", "KV cache [B=3",
                 "target/weights.safetensors", "loadable here: yes"):
        assert text in out, out


def test_generate_from_engine_dir(bundled_engine: BuiltEngine) -> None:
    done = run_fuser("generate", str(bundled_engine.path), "--prompt", "def add(a, b):",
                     "--max-new-tokens", "8")
    out = ok(done)
    assert out.startswith("def add(a, b):") and len(out.strip()) > len("def add(a, b):")
    assert "loaded in" in done.stderr  # progress on stderr


def test_bench_engine_dir_writes_json(bundled_engine: BuiltEngine, tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    out = ok(run_fuser("bench", str(bundled_engine.path), "--max-new-tokens", "6", "--runs", "1",
                       "--json", str(report)))
    rows = json.loads(report.read_text())["rows"]
    assert [r["system"] for r in rows][1:] == ["fuser target-only", "Hugging Face generate"]
    assert rows[0]["system"].startswith("fuser speculative")
    assert all(r["tokens_per_second"] > 0 and r["runs"] == 1 for r in rows)
    assert "exactness promised): identical" in out and "device cpu" in out


def test_demo_loads_its_cached_engine(bundled_engine: BuiltEngine, tmp_path: Path) -> None:
    shutil.copytree(bundled_engine.path, tmp_path / "fuser" / "demo-engine")
    done = run_fuser("demo", "--max-new-tokens", "8", "--runs", "1",
                     env={"XDG_CACHE_HOME": str(tmp_path)})
    out = ok(done)
    assert "loaded in" in done.stderr and "building" not in done.stderr
    assert "first token" in done.stderr and "Hugging Face generate" in out
    assert "CPU is a correctness target" not in out


def test_build_then_generate_a_model_directory(tmp_path: Path) -> None:
    """`fuser build` on a small random Llama with the bundled tokenizer, then generate."""
    model_dir = tmp_path / "model"
    tiny_model("llama", vocab=4096, layers=1).save_pretrained(model_dir)
    if bundled_pair() is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(bundled_pair()[0] / name, model_dir / name)
    out = tmp_path / "engine"
    done = run_fuser("build", str(model_dir), "--max-seq-len", "64", "--gamma", "0",
                     "--out", str(out))
    ok(done)
    assert "capturing" in done.stderr and "saved in" in done.stderr
    assert (out / "manifest.json").is_file()
    user_error(run_fuser("build", str(model_dir), "--out", str(out)), "already exists")
    if bundled_pair() is not None:
        ok(run_fuser("generate", str(out), "--prompt", "x =", "--max-new-tokens", "4"))


def test_user_errors_are_one_line(tmp_path: Path) -> None:
    user_error(run_fuser("inspect", str(tmp_path)), "no manifest.json")
    user_error(run_fuser("generate", str(tmp_path / "nope"), "--prompt", "x"), "neither a model directory")


def test_demo_rebuilds_a_refused_cache_and_says_why(bundled_engine: BuiltEngine, tmp_path: Path,
                                                    monkeypatch: object, capsys: object) -> None:
    """A cached engine the manifest refuses (here: another torch) is rebuilt, with the reason."""
    from fuser import cli

    cached = tmp_path / "fuser" / "demo-engine"
    shutil.copytree(bundled_engine.path, cached)
    manifest = json.loads((cached / "manifest.json").read_text())
    manifest["environment"]["torch"] = "2.0.0"
    (cached / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    class Rebuilt(Exception):
        pass

    def build(*args: object) -> None:
        raise Rebuilt

    monkeypatch.setattr(cli, "build_engine_from_args", build)
    try:
        cli.demo_engine(None)
    except Rebuilt:
        pass
    else:
        raise AssertionError("the refused engine was used")
    err = capsys.readouterr().err
    assert "cannot be used" in err and "torch: engine built with '2.0.0'" in err and "rebuilding" in err


def test_build_for_several_rows_keeps_a_bucket_of_1(tmp_path: Path, monkeypatch: object) -> None:
    """`fuser build --max-batch-size 2` on the CPU builds batch bucket 1 beside 2: the scheduler
    (`fuser serve ENGINE_DIR`) prefills through a bucket of 1, so without it the directory
    could not be served."""
    from fuser import cli

    class Built(Exception):
        pass

    seen = {}

    def build(model: object, draft: object, config: object) -> None:
        seen["buckets"] = config.buckets_for(torch.device("cpu"))
        raise Built

    monkeypatch.setattr(cli, "build_engine_from_args", build)
    args = cli.build_parser().parse_args(["build", str(tmp_path / "model"), "--max-batch-size", "2",
                                    "--out", str(tmp_path / "engine")])
    try:
        args.fn(args)
    except Built:
        pass
    assert seen["buckets"] == (1, 2)
