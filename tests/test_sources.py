"""The controller over proposal sources (runtime/sources.py) on scripted acceptance: it picks
the source the acceptance favours, switches when acceptance shifts, probes the others, falls
back to target-only and comes back, and says what it did (reason, counters, windows, metrics)."""

from __future__ import annotations

import random

import pytest

from fuser.runtime.adaptive import expected_tokens_per_step
from fuser.runtime.sources import DRAFT, SUFFIX, TARGET, Choice, SourceCollector, \
    SourceController

# Iteration costs in target decode steps: the draft's proposals cost ~0.15 a token plus the
# verification; the suffix's only the verification (a little more per token verified).
DRAFT_COSTS = {1: 1.2, 2: 1.35, 4: 1.65}
SUFFIX_COSTS = {1: 1.03, 2: 1.05, 4: 1.1}
ROWS = 4


def controller(**options: object) -> SourceController:
    return SourceController(1.0, {DRAFT: DRAFT_COSTS, SUFFIX: SUFFIX_COSTS}, **options)


class Scripted:
    """Rows that accept each proposal with a fixed probability per source; the suffix index
    has a match of `suffix_length` tokens for each row (0: none)."""

    def __init__(self, alpha: dict[str, float], suffix_length: int = 4, seed: int = 0) -> None:
        self.alpha = dict(alpha)
        self.suffix_length = suffix_length
        self.rng = random.Random(seed)

    def lengths(self) -> list[int]:
        return [self.suffix_length] * ROWS

    def step(self, ctl: SourceController) -> Choice:
        choice = ctl.choose(self.lengths())
        if choice.source == TARGET:
            ctl.update(choice, [0] * ROWS)
            return choice
        g = choice.gamma
        proposed = [min(g, length) for length in self.lengths()] if choice.source == SUFFIX \
            else [g] * ROWS
        accepted = []
        for p in proposed:
            n = 0
            while n < p and self.rng.random() < self.alpha[choice.source]:
                n += 1
            accepted.append(n)
        ctl.update(choice, accepted, proposed)
        return choice

    def run(self, ctl: SourceController, steps: int) -> list[Choice]:
        return [self.step(ctl) for _ in range(steps)]


def shares(choices: list[Choice]) -> dict[str, float]:
    return {s: sum(c.source == s for c in choices) / len(choices) for s in (TARGET, DRAFT, SUFFIX)}


def test_picks_the_source_its_acceptance_favours():
    ctl = controller()
    script = Scripted({DRAFT: 0.85, SUFFIX: 0.1})
    script.run(ctl, 200)
    late = script.run(ctl, 300)
    assert shares(late)[DRAFT] > 0.9, shares(late)
    # accepted over proposed tokens at gamma 4: sum_j 0.85^j / 4
    assert ctl.acceptance_window(DRAFT) == pytest.approx(
        sum(0.85 ** j for j in range(1, 5)) / 4, abs=0.05)
    assert ctl.reason.startswith("draft gamma 4"), ctl.reason

    ctl = controller()
    script = Scripted({DRAFT: 0.3, SUFFIX: 0.9})
    script.run(ctl, 200)
    late = script.run(ctl, 300)
    assert shares(late)[SUFFIX] > 0.9, shares(late)
    assert ctl.reason.startswith("suffix gamma 4"), ctl.reason


def test_switches_when_acceptance_shifts():
    ctl = controller()
    script = Scripted({DRAFT: 0.85, SUFFIX: 0.2})
    script.run(ctl, 300)
    assert ctl.last.source == DRAFT
    script.alpha = {DRAFT: 0.2, SUFFIX: 0.9}  # the traffic turns repetitive, out of domain
    choices = script.run(ctl, 500)
    # The draft's estimate has to fall below paying before the suffix, off since its last
    # probe (at alpha 0.2 it may have measured below target-only), is probed again.
    first_suffix = next(i for i, c in enumerate(choices) if c.source == SUFFIX)
    assert first_suffix < 200, first_suffix
    assert shares(choices[300:])[SUFFIX] > 0.9, shares(choices[300:])
    script.alpha = {DRAFT: 0.85, SUFFIX: 0.2}  # and back
    choices = script.run(ctl, 600)
    assert shares(choices[300:])[DRAFT] > 0.9, shares(choices[300:])


def test_suffix_only_where_rows_have_matches():
    ctl = controller()
    script = Scripted({DRAFT: 0.5, SUFFIX: 0.95}, suffix_length=0)
    choices = script.run(ctl, 300)
    assert not any(c.source == SUFFIX for c in choices)
    # Half the rows with a match: the expected yield is the mean over rows.
    lengths = [4, 4, 0, 0]
    alphas = ctl.alphas(SUFFIX)
    expected = (2 * expected_tokens_per_step(alphas, 4) + 2 * 1.0) / 4
    assert ctl.expected_tokens(SUFFIX, 4, lengths) == pytest.approx(expected)
    assert ctl.expected_tokens(SUFFIX, 2, [1, 3]) == pytest.approx(
        (expected_tokens_per_step(alphas, 1) + expected_tokens_per_step(alphas, 2)) / 2)


def test_unused_sources_are_probed_with_backoff():
    ctl = controller(probe_interval=16, max_probe_interval=256)
    script = Scripted({DRAFT: 0.0, SUFFIX: 0.0})  # nothing pays: target-only, with probes
    choices = script.run(ctl, 2000)
    assert shares(choices[100:])[TARGET] > 0.95
    assert not ctl.enabled(DRAFT) and not ctl.enabled(SUFFIX)
    probes = {s: [i for i, c in enumerate(choices) if c.source == s and c.probe]
              for s in (DRAFT, SUFFIX)}
    for source, at in probes.items():
        assert 3 <= len(at) <= 12, (source, at)  # 16, 32, 64, 128, 256, 256, ... apart
        gaps = [b - a for a, b in zip(at, at[1:])]
        assert gaps == sorted(gaps) and gaps[-1] <= 256 + 1, (source, gaps)
    assert "target-only" in ctl.reason and "next probes" in ctl.reason
    # Acceptance returns: the next probe finds it and speculation comes back on.
    script.alpha = {DRAFT: 0.9, SUFFIX: 0.0}
    choices = script.run(ctl, 300)
    assert ctl.enabled(DRAFT) and shares(choices[-100:])[DRAFT] > 0.9


def test_a_source_that_loses_is_still_probed_now_and_then():
    """Both pay, the suffix more: the draft is probed, less and less often."""
    ctl = controller()
    script = Scripted({DRAFT: 0.5, SUFFIX: 0.6})
    choices = script.run(ctl, 2000)
    assert shares(choices)[SUFFIX] > 0.95
    probes = [i for i, c in enumerate(choices) if c.source == DRAFT and c.probe]
    assert 3 <= len(probes) <= 8, probes
    # A new draft (an accepted update): forgotten, probed at once, and it wins.
    script.alpha[DRAFT] = 0.95
    ctl.forget(DRAFT)
    assert ctl.choose(script.lengths()) == Choice(DRAFT, 4, True, ctl.last.expected_speedup)
    choices = script.run(ctl, 300)
    assert shares(choices[-100:])[DRAFT] > 0.9, shares(choices[-100:])


def test_counters_windows_snapshot_and_metrics():
    ctl = controller(window=10)
    script = Scripted({DRAFT: 0.85, SUFFIX: 0.1})
    script.run(ctl, 50)
    ctl.record_update(True)
    ctl.record_update(False)
    ctl.record_update(True)
    assert sum(ctl.steps.values()) == 50
    accepted, proposed = ctl.window_counts(DRAFT)
    assert proposed <= 10 * ROWS * 4 and ctl.acceptance_window(DRAFT) == accepted / proposed
    snap = ctl.snapshot()
    assert snap["source"] == ctl.last.source and snap["reason"] == ctl.reason
    assert snap["draft_updates"] == {"accepted": 2, "rejected": 1}
    assert snap["steps"] == ctl.steps
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    other = controller()
    registry.register(SourceCollector(lambda: [ctl, other]))
    text = prometheus_client.generate_latest(registry).decode()
    assert f'fuser_spec_steps_total{{source="draft"}} {float(ctl.steps[DRAFT])}' in text
    assert f'fuser_spec_steps_total{{source="target"}} {float(ctl.steps[TARGET])}' in text
    assert 'fuser_draft_updates_total{result="accepted"} 2.0' in text
    assert 'fuser_draft_updates_total{result="rejected"} 1.0' in text
    assert 'fuser_spec_acceptance_window{source="draft"}' in text


def test_update_checks_its_arguments():
    ctl = controller()
    with pytest.raises(ValueError, match="proposed"):
        ctl.update(Choice(SUFFIX, 2), [0, 1], [2])
    with pytest.raises(ValueError, match="0..2"):
        ctl.update(Choice(DRAFT, 2), [3])
    with pytest.raises(ValueError, match="source"):
        SourceController(1.0, {"eagle": {1: 1.0}})
    with pytest.raises(ValueError, match="gamma"):
        SourceController(1.0, {DRAFT: {0: 1.0}})
    only_suffix = SourceController(1.0, {SUFFIX: SUFFIX_COSTS})
    with pytest.raises(ValueError, match="source"):
        only_suffix.update(Choice(DRAFT, 1), [0])
    assert only_suffix.choose(None).source == TARGET  # no proposals: nothing to verify
