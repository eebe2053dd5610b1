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
                           "--serve-runs", "2", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
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
    assert len(serve["runs_seconds_to_health_200"]) == 2  # --serve-runs 2: the median's
    assert serve["seconds_to_health_200"] == max(serve["runs_seconds_to_health_200"])
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("dry run on CPU: load ") and "tokens identical" in last, last


def test_the_median_cold_start_is_reported_with_every_runs_seconds() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from engine_files import median_start
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    starts = [{"seconds_to_health_200": t, "breakdown": [f"run {t}"]} for t in (18.0, 16.5, 21.0)]
    chosen = median_start(starts)
    assert chosen["seconds_to_health_200"] == 18.0 and chosen["breakdown"] == ["run 18.0"]
    assert chosen["runs_seconds_to_health_200"] == [18.0, 16.5, 21.0]
    assert median_start(starts[:2])["seconds_to_health_200"] == 18.0  # of two: the slower
    failed = {"error": "no /health 200 in 300 s"}
    assert median_start([starts[0], failed]) is failed  # a failed start is what is reported
    assert median_start(starts[:1])["runs_seconds_to_health_200"] == [18.0]
