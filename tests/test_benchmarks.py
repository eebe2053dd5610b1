"""benchmarks/ops.py --dry-run: every case of the per-op GPU benchmark runs once on CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ops_benchmark_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = subprocess.run([sys.executable, "benchmarks/ops.py", "--dry-run", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert rows and not [r for r in rows if r["errors"] or r["flagged"]]
    assert proc.stdout.strip().splitlines()[-1].startswith("dry run on CPU")
