"""benchmarks/engine_files.py --dry-run: build, save, load in a fresh process, time both, on CPU
with tiny random models (the H200 run uses the same code at Llama-3-8B shape)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~2 minutes on 2 cores: a benchmark's plumbing, -m slow runs it
def test_engine_files_benchmark_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "engine_files.json"
    proc = subprocess.run([sys.executable, "benchmarks/engine_files.py", "--dry-run", "--serve",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["speculative_tokens_identical"] and r["target_only_tokens_identical"]
    assert r["load_seconds"] < r["build_seconds"]
    assert r["loaded"]["speculative"]["tokens_per_second"] > 0
    assert r["compiles_in_loaded_process"] == 0
    # --serve: `fuser serve DIR` in a new process answers with the in-process engine's tokens
    serve = r["serve"]
    assert "error" not in serve, serve
    assert serve["tokens_identical"] and serve["exit_status"] == 0
    assert serve["first_ttft_over_warm"] > 0 and serve["seconds_to_health_200"] > 0
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("dry run on CPU: load ") and "tokens identical" in last, last
