"""benchmarks/fp8_accuracy.py on CPU: its data is held out, its checks say when a bound is
missed, and a dry run (tiny random pair, real engines) goes through every part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fuser.models import HELDOUT_SAMPLE, bundled_pair

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import fp8_accuracy
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.skipif(bundled_pair() is None, reason="the bundled pair is not installed")
def test_text_comes_from_held_out_files_only() -> None:
    from transformers import AutoTokenizer

    from fuser.models import TARGET_PATH

    corpus = ROOT / "models" / "corpus"
    heldout = set((corpus / "heldout_files.txt").read_text().split())
    train = set((corpus / "train_files.txt").read_text().split())
    labels = [line.split("# ---- file: ", 1)[1].rsplit(" ----", 1)[0]
              for line in HELDOUT_SAMPLE.read_text(encoding="utf-8").splitlines()
              if line.startswith("# ---- file: ")]
    assert labels and set(labels) <= heldout and not set(labels) & train
    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    rows = fp8_accuracy.heldout_rows(tokenizer, 2, 64)
    assert rows.shape == (2, 64) and int(rows[0, 0]) == tokenizer.bos_token_id
    text = HELDOUT_SAMPLE.read_text(encoding="utf-8")
    assert tokenizer.decode(rows[0, 1:]) in text
    prompts = fp8_accuracy.heldout_prompts(tokenizer, 3, 16)
    assert [p.shape for p in prompts] == [(1, 16)] * 3
    assert all(tokenizer.decode(p[0, 1:]) in text for p in prompts)


def _results(fp8_ppl: float, fp8_acceptance: float) -> dict:
    """What main() hands to checks(): bf16 and one FP8 variant."""
    n = 8
    same = [torch.arange(12)[None]]
    diverged = [torch.cat([torch.arange(10), torch.tensor([0, 0])])[None]]
    gaps = [torch.linspace(0.1, 0.8, n)]
    greedy = {"bf16 engine vs HF bf16": fp8_accuracy.divergences(same, same, 4, n),
              "fp8 vs bf16 engine": fp8_accuracy.divergences(diverged, same, 4, n, gaps)}
    variant = dict(fallbacks=[], draft_ppl=9.0)
    return {"greedy": greedy, "variants": {
        "bf16": dict(variant, target_ppl=5.0, acceptance={"acceptance_rate": 0.6}),
        "fp8": dict(variant, target_ppl=fp8_ppl, acceptance={"acceptance_rate": fp8_acceptance}),
    }}


def test_checks_say_met_and_not_met() -> None:
    met = fp8_accuracy.checks(_results(5.07, 0.59))
    assert len(met) == 4 and not any("NOT MET" in line for line in met)
    assert "+1.40%" in met[0] and "-0.0100" in met[3]
    missed = fp8_accuracy.checks(_results(5.08, 0.625))
    assert "NOT MET" in missed[0] and "met" in missed[1] and "NOT MET" in missed[3]
    # greedy: identical rows report None, the first differing generated position otherwise
    greedy = _results(5.0, 0.6)["greedy"]
    assert greedy["bf16 engine vs HF bf16"]["first_divergence"] == [None]
    fp8 = greedy["fp8 vs bf16 engine"]
    assert fp8["first_divergence"] == [6] and fp8["median"] == 6
    assert fp8["gap_at_divergence"] == [pytest.approx(0.7)]


@pytest.mark.slow  # ~1 minute of CI on 2 cores: a benchmark's plumbing, -m slow runs it
def test_dry_run_runs_every_part(tmp_path: Path) -> None:
    out = tmp_path / "fp8_accuracy.json"
    proc = subprocess.run([sys.executable, "benchmarks/fp8_accuracy.py", "--dry-run", "--out",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    variants = results["variants"]
    assert list(variants) == ["bf16", "fp8"]
    assert variants["fp8"]["fp8_linear_sites"] == 5 and variants["bf16"]["fp8_linear_sites"] == 0
    assert not variants["bf16"]["fallbacks"] and not variants["fp8"]["fallbacks"]
    for v in variants.values():
        assert v["target_ppl"] > 1 and v["draft_ppl"] > 1
        assert v["acceptance"]["draft_tokens"] > 0
    assert variants["bf16"]["top1_equals_bf16"] == 1.0
    # the contract: speculative greedy output equals the same engine's target-only output
    for name in variants:
        assert results["greedy"][f"{name}: speculative vs target-only"]["identical"] == 2
    assert results["sensitivity"][0]["case"] == "none (bf16)"
    assert len(results["checks"]) == 4
    lines = proc.stdout.strip().splitlines()
    assert "checks" in lines and lines[-1].startswith("dry run on cpu")
