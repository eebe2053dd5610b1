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


def _bench(name: str):
    """A module of benchmarks/ by file name (they are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_prediction_over_the_gammas_a_run_used() -> None:
    e2e = _bench("e2e")
    costs = {0: 1.0, 1: 1.5, 2: 2.0, 4: 3.0}
    # one gamma: Leviathan's E(alpha, g) / cost(g)
    assert e2e.predicted_tok_s({2: 7}, 0.5, costs) == pytest.approx(1.75 / 2.0)
    assert e2e.predicted_tok_s({4: 1}, 1.0, costs) == pytest.approx(5 / 3.0)
    # a mix: expected tokens of all steps over all their seconds (not a mean of the ratios)
    mixed = e2e.predicted_tok_s({0: 2, 1: 1, 4: 1}, 0.5, costs)
    assert mixed == pytest.approx((2 * 1 + 1.5 + 1.9375) / (2 * 1.0 + 1.5 + 3.0))


def test_step_trace_counts_active_rows_per_gamma() -> None:
    e2e = _bench("e2e")
    calls, trace = [], {}
    counted = e2e.step_trace(lambda *args: calls.append(args), trace)
    counted(None, [2, 0], [True, True], 2)
    counted(None, [1, 2], [False, True], 2)   # an inactive row emits nothing
    counted(None, [0], [False], 1)            # no active row: not a step
    counted(None, [0], [True], 0)             # target-only
    assert trace == {"steps": {2: 2, 0: 1}, "tokens": {2: 3 + 1 + 3, 0: 1}}
    assert len(calls) == 4  # every call still reaches the engine


def test_merge_concatenates_rows_and_keeps_each_runs_env(tmp_path: Path) -> None:
    e2e = _bench("e2e")
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"rows": [{"system": "x"}], "env": {"command": "a"}, "k": 1}))
    second.write_text(json.dumps({"rows": [{"system": "y"}], "env": {"command": "b"}, "j": 2}))
    e2e.merge([first, second])
    assert [r["system"] for r in e2e.RESULTS["rows"]] == ["x", "y"]
    assert [r["command"] for r in e2e.RESULTS["runs"]] == ["a", "b"]
    assert e2e.RESULTS["k"] == 1 and e2e.RESULTS["j"] == 2


def test_hf_peers_attend_to_a_prompt_token_equal_to_the_pad_id() -> None:
    """The peers pass pad_token_id=0, and the bundled pair's <|bos|> is 0: without an explicit
    mask `generate` would mask it out and decode other tokens than the model's greedy ones."""
    import torch

    peers = _bench("peers")
    tiny = _bench("tiny_models")
    target, _, prompts = tiny.tiny_pair(torch.device("cpu"))
    prompt = torch.cat([torch.zeros(1, 1, dtype=torch.long), prompts[0]], dim=1)  # 0 first
    n = 6
    ids = prompt
    with torch.no_grad():
        for _ in range(n):  # the model's greedy continuation, one full forward a token
            ids = torch.cat([ids, target(ids).logits[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(peers.make_hf_eager(target, prompt, n)(), ids[:, prompt.shape[1]:])
