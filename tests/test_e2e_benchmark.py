"""benchmarks/e2e.py --dry-run on CPU: every part runs on tiny models and writes its outputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 90 s on a 2-core CPU (three parts, two engines each, peers)
def test_e2e_dry_run_writes_json_plot_and_table(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "e2e.py"), "--dry-run", "--gammas", "1,2",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "e2e.json").read_text())
    assert (tmp_path / "e2e.png").stat().st_size > 0
    systems = [r["system"] for r in results["rows"]]
    for name in ("HF eager", "HF assisted (same draft)", "fuser target-only", "fuser gamma=1",
                 "fuser gamma=2"):
        assert name in systems, systems
    assert any(s.startswith("fuser gamma=auto") for s in systems)
    spec = [r for r in results["rows"] if r["system"] == "fuser gamma=2"][0]
    assert 0 <= spec["acceptance"] <= 1 and spec["predicted_tok_s"] > 0
    # the graph bound: measured tok/s over (tokens per step / the step graph's cost)
    costs = results["bundled_iteration_ms"]
    bound = spec["mean_accepted_length"] / (costs["2"] / 1e3)
    assert spec["pct_of_graph_bound"] == pytest.approx(100 * spec["tok_s"] / bound)
    plain = [r for r in results["rows"] if r["system"] == "fuser target-only"][0]
    assert plain["pct_of_graph_bound"] == pytest.approx(plain["tok_s"] * costs["0"] / 10)
    assert set(results["bundled_iteration_ms"]) == {"0", "1", "2"}
    assert len(results["8b_projected_curve"]) == 21
    assert "8b_auto_over_target_only" in results
    assert sum(r["part"] == "buckets" for r in results["rows"]) == 2
    assert proc.stdout.strip().splitlines()[-1].startswith("buckets")  # the table comes last


def test_glue_step_leaves_the_state_as_it_found_it() -> None:
    """benchmarks/e2e.py times the step's glue kernels by calling `glue_step` over and over:
    each call must leave the caches' lengths and the (inactive) row's state unchanged."""
    import torch

    import fuser

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from e2e import glue_step
    from tiny_models import tiny_pair

    target, draft, _ = tiny_pair(torch.device("cpu"))
    engine = fuser.optimize(target, draft=draft, config=fuser.FuserConfig(
        gamma=2, compile="fx", max_seq_len=256, cuda_graphs=False))
    glue = glue_step(engine, 2)
    bucket = engine.bucket(1)
    first = glue().clone()
    state = {name: getattr(bucket.state, name).clone()
             for name in ("pending", "last", "active", "generated", "history")}
    lens = (bucket.target.cache.seq_lens.clone(), bucket.draft.cache.seq_lens.clone())
    again = glue()
    assert torch.equal(first, again)
    for name, value in state.items():
        assert torch.equal(getattr(bucket.state, name), value), name
    assert torch.equal(bucket.target.cache.seq_lens, lens[0])
    assert torch.equal(bucket.draft.cache.seq_lens, lens[1])
    assert lens[0].tolist() == [128] and lens[1].tolist() == [127 + 2 + 1]  # catch-up, 1 decode
