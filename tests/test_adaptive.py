"""runtime/adaptive.py: the expected-throughput formula, the per-position acceptance estimates,
and the controller's choice of gamma (including switching speculation off and back on).

Acceptance is scripted deterministically: a row's accepted count n is drawn by inverse CDF from
a uniform u, n = #{j <= g : u < prod_{i<=j} alpha_i}. Over a batch, u is stratified
((b + 0.5) / B), so each step shows the scripted rates up to 1/trials; for a single row, u runs
through the golden-ratio sequence, whose running frequencies converge fast.
"""

from __future__ import annotations

import itertools
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.runtime.adaptive import GammaController, expected_tokens_per_step, leviathan_speedup

GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def accepted(alphas: list[float], gamma: int, u: float) -> int:
    """Accepted drafts of one row at draft length gamma for uniform u (inverse CDF)."""
    n, reach = 0, 1.0
    for alpha in alphas[:gamma]:
        reach *= alpha  # P(first n + 1 drafts accepted)
        if u >= reach:
            break
        n += 1
    return n


def stratified_rows(alphas: list[float], gamma: int, rows: int) -> list[int]:
    return [accepted(alphas, gamma, (b + 0.5) / rows) for b in range(rows)]


def brute_force_gamma(alphas: list[float], costs: dict[int, float], decode: float) -> int:
    """argmax over measured g of tokens/s, written out independently; 0 if none beats decode
    (decode = inf: the best measured g whatever it expects)."""
    best, best_rate = 0, 1.0 / decode
    for g in sorted(costs):
        tokens = 1.0 + sum(math.prod(alphas[:j]) for j in range(1, g + 1))
        if tokens / costs[g] > best_rate:
            best, best_rate = g, tokens / costs[g]
    return best


def true_speedup(alpha: float, gamma: int, c: float) -> float:
    return leviathan_speedup(alpha, gamma, c) if gamma else 1.0


# -- the formula --------------------------------------------------------------------------------


@given(alpha=st.floats(0.0, 1.0), gamma=st.integers(0, 15), c=st.floats(0.0, 2.0))
def test_formula_matches_leviathan_closed_form(alpha: float, gamma: int, c: float) -> None:
    """1 + sum_j alpha^j over (g c + 1) is Leviathan's (1 - a^(g+1)) / ((1 - a)(g c + 1))."""
    ours = expected_tokens_per_step([alpha] * gamma, gamma) / (gamma * c + 1.0)
    assert leviathan_speedup(alpha, gamma, c) == pytest.approx(ours, rel=1e-9, abs=1e-12)


def test_leviathan_known_values_and_alpha_one() -> None:
    # alpha 0.8, gamma 4, c 0.1: (1 - 0.8^5) / 0.2 = 3.3616 tokens over 1.4 step costs.
    assert leviathan_speedup(0.8, 4, 0.1) == pytest.approx(3.3616 / 1.4, rel=1e-12)
    assert leviathan_speedup(1.0, 7, 0.25) == 8 / 2.75  # the limit, no 0/0
    assert leviathan_speedup(0.0, 3, 0.5) == 1 / 2.5
    assert leviathan_speedup(0.5, 0, 0.5) == 1.0
    for bad in [(-0.1, 1, 0.1), (1.1, 1, 0.1), (0.5, -1, 0.1), (0.5, 1.5, 0.1), (0.5, 1, -1)]:
        with pytest.raises(ValueError):
            leviathan_speedup(*bad)


@given(alpha=st.floats(0.0, 1.0), c=st.floats(0.01, 1.0), steps=st.integers(1, 30))
@settings(max_examples=50, deadline=None)
def test_controller_speedup_is_the_formula_at_its_estimates(alpha: float, c: float,
                                                            steps: int) -> None:
    ctl = GammaController.from_cost_ratio(c, 8)
    for _ in range(steps):
        g = ctl.gamma
        ctl.update(stratified_rows([alpha] * 8, g, 16) if g else [0] * 16, g)
    for g in range(1, 9):
        tokens = 1.0 + sum(math.prod(ctl.alphas[:j]) for j in range(1, g + 1))
        assert ctl.expected_speedup(g) == pytest.approx(tokens / (g * c + 1.0), rel=1e-12)
    assert ctl.expected_speedup(0) == 1.0


# -- estimates ------------------------------------------------------------------------------------


@given(rates=st.lists(st.floats(0.3, 1.0), min_size=1, max_size=6), rows=st.integers(50, 200))
@settings(max_examples=60, deadline=None)
def test_positionwise_estimates_converge_to_scripted_rates(rates: list[float], rows: int) -> None:
    gamma = len(rates)
    ctl = GammaController.from_cost_ratio(0.1, gamma)
    step_rows = stratified_rows(rates, gamma, rows)
    steps = 300
    for _ in range(steps):
        ctl.update(step_rows, gamma)
    # Evidence weight after `steps` identical steps: trials * (1 + m + ... + m^(steps-1)).
    weight = (1.0 - ctl.memory ** steps) / (1.0 - ctl.memory)
    for i in range(gamma):
        trials = sum(n >= i for n in step_rows)  # rows that drafted position i + 1
        successes = sum(n >= i + 1 for n in step_rows)
        if trials == 0:  # never drafted: the estimate is the one of the position before
            assert ctl.alphas[i] == pytest.approx(ctl.alphas[i - 1], rel=1e-12)
            continue
        realized = successes / trials
        # (A + w pi) / (N + w) with A / N = realized: off by at most w / (N + w).
        bias = ctl.prior_weight / (trials * weight + ctl.prior_weight)
        assert abs(ctl.alphas[i] - realized) <= bias + 1e-9
        # Stratification puts the realized rate within 1 / trials of the scripted one.
        assert abs(ctl.alphas[i] - rates[i]) <= bias + 1.0 / trials + 1e-9


def test_estimates_converge_for_a_single_row() -> None:
    rates = [0.9, 0.6, 0.8]
    ctl = GammaController.from_cost_ratio(0.1, 3, memory=0.995)
    for t in range(4000):
        ctl.update([accepted(rates, 3, (t * GOLDEN) % 1.0)], 3)
    assert ctl.alphas == pytest.approx(rates, abs=0.05)


def test_unmeasured_positions_borrow_the_deepest_estimate() -> None:
    ctl = GammaController.from_cost_ratio(0.1, 8)
    for _ in range(200):
        ctl.update(stratified_rows([0.5] * 8, 2, 64), 2)
    assert ctl.alphas[2:] == pytest.approx([ctl.alphas[1]] * 6, abs=0.02)
    assert ctl.alphas[1] == pytest.approx(0.5, abs=0.02)


# -- the choice -----------------------------------------------------------------------------------


@pytest.mark.parametrize("alpha, expected", [(0.95, 8), (0.9, 8), (0.8, 6), (0.7, 4), (0.5, 2),
                                             (0.3, 1), (0.0, 0)])
def test_draft_at_ten_percent_picks_the_brute_force_gamma(alpha: float, expected: int) -> None:
    """Draft step = 10% of a target step: high acceptance -> long drafts, low -> short, none -> off.

    `expected` is the argmax of Leviathan's speedup over g = 1..8 (0 when none exceeds 1).
    """
    costs = {g: 1.0 + 0.1 * g for g in range(1, 9)}
    assert brute_force_gamma([alpha] * 8, costs, 1.0) == expected
    ctl = GammaController(costs, 1.0)
    for _ in range(300):
        g = ctl.gamma
        ctl.update(stratified_rows([alpha] * 8, g, 64), g)
    assert ctl.gamma == expected
    assert ctl.gamma == brute_force_gamma(list(ctl.alphas), costs, 1.0)


def test_positionwise_drop_stops_drafting_before_it() -> None:
    """Accepted easily up to position 3, rarely at 4: drafting 3 beats the constant-rate guess."""
    rates = [0.9, 0.9, 0.9, 0.1, 0.9, 0.9, 0.9, 0.9]
    costs = {g: 1.0 + 0.1 * g for g in range(1, 9)}
    assert brute_force_gamma(rates, costs, 1.0) == 3
    ctl = GammaController(costs, 1.0)
    for _ in range(300):
        g = ctl.gamma
        ctl.update(stratified_rows(rates, g, 64), g)
    assert ctl.gamma == 3


def test_only_measured_gammas_are_chosen() -> None:
    costs = {1: 1.1, 2: 1.2, 4: 1.4, 8: 1.8}  # graphs captured for these only
    ctl = GammaController(costs, 1.0)
    for _ in range(300):
        g = ctl.gamma
        assert g in (0, *costs)
        ctl.update(stratified_rows([0.6] * 8, g, 64), g)
    # At alpha 0.6 the contiguous argmax would be 3 (1.684x): 2 and 4 are 1.633x and 1.640x.
    assert ctl.gamma == brute_force_gamma([0.6] * 8, costs, 1.0) == 4


@given(alpha=st.floats(0.0, 1.0), c=st.floats(0.02, 1.0), max_gamma=st.integers(1, 10))
@settings(max_examples=60, deadline=None)
def test_choice_is_near_optimal_throughput(alpha: float, c: float, max_gamma: int) -> None:
    """Over the last steps of a run, the gammas chosen give nearly the best true speedup."""
    ctl = GammaController.from_cost_ratio(c, max_gamma)
    chosen = []
    for _ in range(600):
        g = ctl.gamma
        chosen.append(g)
        ctl.update(stratified_rows([alpha] * max_gamma, g, 64) if g else [0] * 64, g)
        alphas = list(ctl.alphas)
        if g:  # on/off is decided on the evidence of a speculative step
            assert ctl.enabled == (brute_force_gamma(alphas, ctl.step_seconds, 1.0) > 0)
        if ctl.gamma:  # on or probing: the measured gamma of highest throughput
            assert ctl.gamma == brute_force_gamma(alphas, ctl.step_seconds, math.inf)
    best = max(true_speedup(alpha, g, c) for g in range(max_gamma + 1))
    # Time-weighted: tokens over seconds, each step at its true expected tokens and cost.
    tail = chosen[-300:]
    tokens = sum(true_speedup(alpha, g, c) * (g * c + 1.0) for g in tail)
    seconds = sum(g * c + 1.0 for g in tail)
    assert tokens / seconds >= 0.98 * best


def test_single_row_choice_is_near_optimal() -> None:
    c = 0.1
    for alpha in (0.9, 0.7, 0.5):
        ctl = GammaController.from_cost_ratio(c, 8)
        tail = []
        for t in range(3000):
            g = ctl.gamma
            ctl.update([accepted([alpha] * 8, g, (t * GOLDEN) % 1.0)] if g else [0], g)
            if t >= 1000:
                tail.append(true_speedup(alpha, ctl.gamma, c))
        best = max(true_speedup(alpha, g, c) for g in range(9))
        assert sum(tail) / len(tail) >= 0.97 * best, alpha


# -- off and back on --------------------------------------------------------------------------


def run_single_row(ctl: GammaController, alpha: float, steps: int, start: int = 0
                   ) -> tuple[list[int], float, float]:
    """-> (gammas used, tokens emitted, seconds spent) over `steps` single-row steps."""
    used, tokens, seconds = [], 0.0, 0.0
    for t in range(start, start + steps):
        g = ctl.gamma
        n = accepted([alpha] * ctl.max_gamma, g, (t * GOLDEN) % 1.0) if g else 0
        ctl.update([n] if g else [0], g)
        used.append(g)
        tokens += n + 1
        seconds += ctl.step_seconds[g] if g else ctl.decode_seconds
    return used, tokens, seconds


@pytest.mark.parametrize("c", [0.1, 0.3, 1.0])
def test_zero_acceptance_switches_speculation_off(c: float) -> None:
    ctl = GammaController.from_cost_ratio(c, 8)
    used, tokens, seconds = run_single_row(ctl, 0.0, 2000)
    assert 0 in used[:10]  # off within 10 steps
    assert used[-100:].count(0) >= 90
    # Probes and prior-driven retries cost at most 2% of target-only throughput.
    assert tokens / seconds >= 0.98 / ctl.decode_seconds
    # Probes do happen, each failed one doubling the wait before the next, up to the cap.
    spec_steps = [t for t, g in enumerate(used) if g]
    gaps = [b - a - 1 for a, b in itertools.pairwise(spec_steps) if b - a > 1]
    cap = ctl.max_probe_interval
    assert gaps[0] in (64, 128) and len(gaps) >= 3 and gaps[-1] <= cap, gaps
    assert all(later == min(2 * gap, cap) for gap, later in itertools.pairwise(gaps)), gaps


def test_pipelined_double_probe_backs_off_once() -> None:
    """The engine issues a step before the last one's update arrives, so a probe may run
    twice in a row; the wait before the next probe doubles once, not twice."""
    ctl = GammaController.from_cost_ratio(1.0, 4, probe_interval=8)
    while ctl.enabled:
        ctl.update([0], ctl.gamma)
    for _ in range(8):
        ctl.update([0], 0)
    first, second = ctl.gamma, ctl.gamma  # both issued before either update
    assert first >= 1 and second >= 1
    ctl.update([0], first)
    ctl.update([0], second)
    assert ctl.interval == 16 and ctl.gamma == 0


def test_off_reason_and_probe() -> None:
    ctl = GammaController.from_cost_ratio(1.0, 4, probe_interval=16)
    while ctl.enabled:
        ctl.update([0], ctl.gamma)
    assert ctl.gamma == 0
    assert re.fullmatch(r"speculation off: best gamma \d+ expects \d\.\d\dx target-only; "
                        r"next probe after 16 target-only steps", ctl.reason), ctl.reason
    for _ in range(16):
        assert ctl.gamma == 0 and not ctl.probing
        ctl.update([0], 0)
    assert ctl.probing and ctl.gamma >= 1
    assert ctl.reason.startswith(f"probing gamma {ctl.gamma} after 16 target-only steps")
    ctl.update([0], ctl.gamma)  # the probe found nothing accepted: the next waits longer
    assert ctl.gamma == 0 and not ctl.probing and ctl.interval == 32
    assert ctl.reason.endswith("next probe after 32 target-only steps"), ctl.reason


@pytest.mark.parametrize("c", [0.1, 0.3, 0.5])
def test_acceptance_recovering_switches_speculation_back_on(c: float) -> None:
    ctl = GammaController.from_cost_ratio(c, 8)
    run_single_row(ctl, 0.0, 2000)
    waited = ctl.interval  # backed off by the failed probes, at most max_probe_interval
    assert ctl.probe_interval < waited <= ctl.max_probe_interval
    used, _, _ = run_single_row(ctl, 0.9, 3 * ctl.max_probe_interval, start=2000)
    turned_on = next(t for t in range(1, len(used)) if used[t] and used[t - 1])
    assert turned_on <= waited + 2 * ctl.probe_interval
    assert ctl.enabled and ctl.interval == ctl.probe_interval
    assert re.fullmatch(r"gamma \d+: \d+\.\d\d tokens/step expected, \d+\.\d\dx target-only",
                        ctl.reason), ctl.reason


def test_starts_off_when_the_prior_cannot_pay() -> None:
    ctl = GammaController.from_cost_ratio(2.0, 4)  # a draft step dearer than a target step
    assert ctl.gamma == 0 and not ctl.enabled


def test_deterministic() -> None:
    runs = []
    for _ in range(2):
        ctl = GammaController.from_cost_ratio(0.2, 6)
        used, _, _ = run_single_row(ctl, 0.6, 500)
        runs.append((used, ctl.alphas, ctl.reason))
    assert runs[0] == runs[1]


# The bundled pair's step costs on the H200 (measured by benchmarks/e2e.py), ms.
BUNDLED_COSTS = {1: 0.151, 2: 0.185, 3: 0.219}
BUNDLED_DECODE = 0.113


def steps_until_longer_gamma_is_tried(**options: float) -> int:
    """A long run where position 2 is right, then one where it is wrong until gamma drops to 1:
    how many steps at gamma 1 (position 1 right) pass before gamma 2 is tried again."""
    ctl = GammaController(BUNDLED_COSTS, BUNDLED_DECODE, **options)
    for _ in range(40):
        ctl.update([2], 2)
    for _ in range(200):
        if ctl.gamma == 1:
            break
        ctl.update([1], ctl.gamma)
    assert ctl.gamma == 1
    for steps in range(1, 500):
        ctl.update([1], 1)
        if ctl.gamma >= 2:
            return steps
    return 500


def test_positions_a_shorter_gamma_does_not_reach_go_stale_fast() -> None:
    """A step at gamma 1 says nothing about position 2: its low estimate must not keep gamma at
    1 for long (untried_memory), where decaying it at `memory` took 11 steps."""
    assert steps_until_longer_gamma_is_tried() <= 3
    assert steps_until_longer_gamma_is_tried(untried_memory=0.95) > 3  # memory's rate: slower


def test_invalid_untried_memory() -> None:
    for bad in (0.0, 0.96, 1.5):
        with pytest.raises(ValueError, match="untried_memory"):
            GammaController(BUNDLED_COSTS, BUNDLED_DECODE, untried_memory=bad)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="step_seconds"):
        GammaController({}, 1.0)
    with pytest.raises(ValueError, match="step_seconds key"):
        GammaController({0: 1.0}, 1.0)
    with pytest.raises(ValueError, match="decode_seconds"):
        GammaController({1: 1.0}, 0.0)
    ctl = GammaController({1: 1.1, 2: 1.2}, 1.0)
    with pytest.raises(ValueError, match="num_accepted"):
        ctl.update([3], 2)
    with pytest.raises(ValueError, match="gamma_used"):
        ctl.update([0], 3)
    with pytest.raises(ValueError, match="no measured step cost"):
        ctl.expected_speedup(5)
