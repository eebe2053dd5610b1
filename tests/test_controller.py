"""The one controller (runtime/controller.py) on scripted costs and a fake clock: it settles on
the arm of lowest measured wall time per emitted token (never a slower one), probes at most ~5%
of the steps over a long run, follows costs that change, and counts host work and the steps
queued ahead of it as the wall clock sees them."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from fuser.runtime.controller import DRAFT, HOLD, MAX_BACKOFF, NEEDED, PROBE_ONLY, SUFFIX, \
    TARGET, UNUSED, Choice, Controller, ControllerCollector, arm_name, expected_tokens_per_step, \
    leviathan_speedup

GAMMAS = (1, 2, 4, 6)


class Clock:
    """A fake clock the scripted steps advance."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Script:
    """Rows that accept each proposal of a source with a fixed probability; a step of an arm
    takes `seconds[arm]` (times a seeded noise factor in [1 - noise, 1 + noise])."""

    def __init__(self, seconds: dict, alpha: dict, rows: int = 8, noise: float = 0.0,
                 seed: int = 0) -> None:
        self.seconds, self.alpha, self.rows, self.noise = dict(seconds), dict(alpha), rows, noise
        self.rng = random.Random(seed)
        self.clock = Clock()

    def accepted(self, choice: Choice) -> list[int]:
        out = []
        for _ in range(self.rows):
            n = 0
            while n < choice.gamma and self.rng.random() < self.alpha.get(choice.source, 0.0):
                n += 1
            out.append(n)
        return out

    def step(self, ctl: Controller) -> Choice:
        choice = ctl.choose()
        noise = 1.0 + self.noise * (2 * self.rng.random() - 1)
        self.clock.now += self.seconds[choice.arm] * noise
        ctl.update(self.accepted(choice), choice.gamma)
        return choice

    def run(self, ctl: Controller, steps: int) -> list[Choice]:
        return [self.step(ctl) for _ in range(steps)]


def true_cost(script: Script, arm: tuple[str, int]) -> float:
    """Expected seconds per emitted token per row of an arm: seconds / E[n + 1]."""
    source, gamma = arm
    a = script.alpha.get(source, 0.0)
    tokens = 1.0 + sum(a ** j for j in range(1, gamma + 1))
    return script.seconds[arm] / tokens


def draft_seconds(target: float, draft_per_token: float) -> dict:
    seconds = {(TARGET, 0): target}
    seconds.update({(DRAFT, g): target * 1.05 + draft_per_token * g for g in GAMMAS})
    return seconds


@settings(max_examples=30, deadline=None, derandomize=True)
@given(alpha=st.floats(0.0, 0.95), draft_per_token=st.floats(0.02, 0.6),
       noise=st.sampled_from([0.0, 0.1]), seed=st.integers(0, 1000))
def test_never_settles_on_an_arm_slower_than_the_best(alpha: float, draft_per_token: float,
                                                      noise: float, seed: int) -> None:
    """Over a run, probes included, the wall time per emitted token is within 6% of the best
    single arm's (acceptance is random: a step's tokens are noisy, and arms within a few
    percent of each other trade places)."""
    script = Script(draft_seconds(1.0, draft_per_token), {DRAFT: alpha}, noise=noise, seed=seed)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    script.run(ctl, 300)
    begin, tokens = script.clock.now, 0.0
    for _ in range(1000):
        choice = ctl.choose()
        script.clock.now += script.seconds[choice.arm] * (
            1.0 + noise * (2 * script.rng.random() - 1))
        accepted = script.accepted(choice)
        ctl.update(accepted, choice.gamma)
        tokens += 1.0 + sum(accepted) / len(accepted)
    best = min(true_cost(script, arm) for arm in script.seconds)
    assert (script.clock.now - begin) / tokens <= 1.06 * best, ctl.reason
    assert ctl.probes <= 0.05 * ctl.step_count + ctl.probe_steps * len(ctl.arms)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
@pytest.mark.parametrize("draft_per_token", [0.05, 0.3, 1.0])
def test_with_exact_measurements_only_probes_leave_the_best(alpha: float,
                                                           draft_per_token: float) -> None:
    """Tokens and seconds without noise: after each arm is measured once, every step that is
    not a probe runs the best arm."""
    script = Script(draft_seconds(1.0, draft_per_token), {DRAFT: alpha})
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    choices = script.run(ctl, 2000)
    best = min(script.seconds, key=lambda arm: (true_cost(script, arm), arm[1]))
    assert all(c.arm == best for c in choices[len(ctl.arms):] if not c.probe), ctl.reason
    assert ctl.best() == best


def test_probes_stay_within_five_percent_over_a_long_run() -> None:
    script = Script(draft_seconds(1.0, 0.1), {DRAFT: 0.7}, noise=0.1, seed=3)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    choices = script.run(ctl, 20000)
    probes = sum(c.probe for c in choices)
    assert probes == ctl.probes
    assert probes <= 0.05 * len(choices) + ctl.probe_steps * len(ctl.arms)
    # Every arm stays measured: each was re-measured within its longest wait lately.
    tail = choices[-(ctl.refresh << MAX_BACKOFF) - ctl.refresh:]
    assert {c.arm for c in tail} == set(ctl.arms)


def test_adapts_when_costs_change() -> None:
    script = Script(draft_seconds(1.0, 0.1), {DRAFT: 0.9}, seed=5)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    script.run(ctl, 500)
    assert ctl.best() == (DRAFT, 6), ctl.reason  # 5.22 tokens for 1.65 s, 4.1 for 1.45 s, ...
    # The draft stops agreeing (the traffic changed): target-only is best within a few steps.
    script.alpha[DRAFT] = 0.0
    after = script.run(ctl, 50)
    assert ctl.best() == (TARGET, 0), ctl.reason
    assert all(c.arm == (TARGET, 0) for c in after[15:] if not c.probe)
    assert not ctl.enabled and "speculation off" in ctl.reason
    # It agrees again: the next probes find it, and the choice moves back.
    script.alpha[DRAFT] = 0.9
    back = script.run(ctl, 3 * ctl.refresh)
    optimum = true_cost(script, (DRAFT, 6))
    assert ctl.best()[0] == DRAFT and true_cost(script, ctl.best()) < 1.2 * optimum, ctl.reason
    assert all(true_cost(script, c.arm) < 1.2 * optimum
               for c in back[-ctl.refresh // 2:] if not c.probe)
    # The draft's steps get slower (its arm in use is measured every step): it leaves it.
    # (Each draft arm it moves to on the way pays one switch step, which is not averaged.)
    for g in GAMMAS:
        script.seconds[(DRAFT, g)] *= 4
    script.run(ctl, 40)
    assert ctl.best() == (TARGET, 0), ctl.reason


class Pipeline:
    """A loop that queues step k + 1 before reading step k back, over a fake device: an arm's
    step costs the host `host[arm]` seconds to issue and the device `device[arm]` seconds; the
    device starts a step when it was issued and the one before it finished."""

    def __init__(self, host: dict, device: dict, alpha: dict, rows: int = 8, seed: int = 0):
        self.host, self.device = host, device
        self.script = Script({}, alpha, rows, seed=seed)
        self.clock = self.script.clock
        self.free = 0.0  # when the device finishes what it was given
        self.tokens = 0

    def issue(self, ctl: Controller) -> tuple[Choice, float]:
        choice = ctl.choose()
        self.clock.now += self.host[choice.arm]
        ctl.sent()
        self.free = max(self.free, self.clock.now) + self.device[choice.arm]
        return choice, self.free

    def run(self, ctl: Controller, steps: int) -> float:
        """-> wall seconds per emitted token per row over these steps."""
        begin, tokens = self.clock.now, 0.0
        in_flight = self.issue(ctl)
        for _ in range(steps):
            ahead = self.issue(ctl)
            choice, done = in_flight
            self.clock.now = max(self.clock.now, done)  # the read-back waits for the device
            accepted = self.script.accepted(choice)
            ctl.update(accepted, choice.gamma)
            tokens += 1 + sum(accepted) / len(accepted)
            in_flight = ahead
        return (self.clock.now - begin) / tokens


def test_host_work_counts_against_an_arm_whose_device_time_is_lower() -> None:
    """The issue's failure: suffix steps cheap on the device (a verify alone) but costly on the
    host (lookups) lost to draft steps that the device-time costs ranked below them."""
    host = {(TARGET, 0): 0.1, (DRAFT, 2): 0.1, (DRAFT, 4): 0.1, (SUFFIX, 4): 2.5}
    device = {(TARGET, 0): 1.0, (DRAFT, 2): 1.3, (DRAFT, 4): 1.6, (SUFFIX, 4): 1.05}
    alpha = {DRAFT: 0.6, SUFFIX: 0.6}
    pipe = Pipeline(host, device, alpha, seed=2)
    ctl = Controller({DRAFT: (2, 4), SUFFIX: (4,)}, clock=pipe.clock)
    pipe.run(ctl, 300)
    assert ctl.best()[0] == DRAFT, ctl.reason
    chosen = Pipeline(host, device, alpha, seed=2)
    achieved = chosen.run(Controller({DRAFT: (2, 4), SUFFIX: (4,)}, clock=chosen.clock), 2000)
    # Each arm alone, through the same pipeline.
    alone = {}
    for arm in host:
        only = Pipeline(host, device, alpha, seed=2)
        alone[arm] = only.run(_Pinned(only.clock, arm), 2000)
    best = min(alone.values())
    assert achieved <= best * 1.06, (achieved, alone)


class _Pinned:
    """A controller stand-in that always issues one arm (the single-arm baselines)."""

    def __init__(self, clock: Clock, arm: tuple[str, int]) -> None:
        self.clock, self.arm = clock, arm

    def choose(self) -> Choice:
        return Choice(self.arm[0], self.arm[1], False, self.clock())

    def sent(self) -> None:
        pass

    def update(self, accepted: list[int], gamma: int) -> None:
        pass



class FirstRunScript(Script):
    """A Script whose arms each pay `first` times their cost on their first step (a CUDA
    graph's upload at its first replay, lazy initialisation)."""

    def __init__(self, *args: object, first: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.first, self.seen = first, set()

    def step(self, ctl: Controller) -> Choice:
        choice = ctl.choose()
        factor = 1.0 if choice.arm in self.seen else self.first
        self.seen.add(choice.arm)
        self.clock.now += self.seconds[choice.arm] * factor
        ctl.update(self.accepted(choice), choice.gamma)
        return choice


@pytest.mark.parametrize("first", [1.0, 20.0, 100.0])
def test_a_first_step_that_costs_more_does_not_rank_its_arm(first: float) -> None:
    """Each arm's first step costs `first` times the rest: the controller still settles on
    the truly best arm (here draft gamma 2, not the first arm run, gamma 1) and runs it on
    nearly every step that is not a probe. (Averaged in, a first sample 100x too high kept its
    arm backed off to a probe every 2**MAX_BACKOFF * refresh steps, each moving it halfway.)"""
    seconds = {(TARGET, 0): 1.0, (DRAFT, 1): 1.1, (DRAFT, 2): 1.2, (DRAFT, 4): 2.4,
               (DRAFT, 6): 3.4}  # per token, at alpha 0.8: 1.0, 0.61, 0.49, 0.71, 0.86
    alpha = {DRAFT: 0.8}
    script = FirstRunScript(seconds, alpha, seed=3, first=first)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    script.run(ctl, 3000)
    best = min(seconds, key=lambda arm: true_cost(script, arm))
    assert best == (DRAFT, 2)
    assert ctl.best() == best, ctl.reason
    chosen = [c.arm for c in script.run(ctl, 500) if not c.probe]
    assert chosen.count(best) >= 0.95 * len(chosen)  # (acceptance noise may swap a step)

def test_scripted_costs_replace_the_clock() -> None:
    seconds = draft_seconds(1.0, 0.1)
    ctl = Controller({DRAFT: GAMMAS}, costs=seconds, clock=lambda: 0.0)
    script = Script(seconds, {DRAFT: 1.0}, seed=1)
    script.run(ctl, 200)
    assert ctl.best() == (DRAFT, 6) and ctl.gamma == 6 and ctl.enabled
    assert ctl.cost(DRAFT, 6) == pytest.approx(seconds[(DRAFT, 6)] / 7)
    assert "draft gamma 6" in ctl.reason


def test_forget_reprobes_the_source_at_once() -> None:
    script = Script(draft_seconds(1.0, 0.1), {DRAFT: 0.9}, seed=5)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    script.run(ctl, 300)
    ctl.forget(DRAFT)
    assert ctl.best() == (TARGET, 0)
    nxt = script.run(ctl, len(GAMMAS) * ctl.probe_steps)  # each a probe of probe_steps steps
    assert [c.arm for c in nxt] == [(DRAFT, g) for g in GAMMAS for _ in range(ctl.probe_steps)]
    assert all(c.probe for c in nxt)
    assert ctl.best()[0] == DRAFT  # (gammas 4 and 6 are 11% apart: a few steps' noise)
    # Held on gamma 4, the steps take gamma 6 once it is measured surely cheaper: its probes
    # (every quarter of `refresh`) bring its error down
    script.run(ctl, 300)
    assert ctl.best() == (DRAFT, 6), ctl.reason


def test_issued_steps_are_matched_in_order_and_forced_gammas_counted() -> None:
    clock = Clock()
    ctl = Controller({DRAFT: (2,)}, clock=clock, first=(DRAFT, 2), probe_steps=2)
    first, second = ctl.choose(), ctl.choose()  # the second queued behind the first
    # Nothing measured: target-only is probed, two steps in a row (probe_steps).
    assert first.arm == second.arm == (TARGET, 0) and first.probe and second.probe
    assert not first.switch and not second.switch  # (the loop's first step; the same arm)
    third = ctl.choose()
    assert third.arm == (DRAFT, 2) and not third.probe and third.switch  # the probe is done
    clock.now = 1.0
    assert ctl.update([0, 0], first.gamma) == first
    clock.now = 1.5
    assert ctl.update([0, 0], second.gamma) == second
    # The second step's time runs from the first's read-back (it was queued behind it).
    assert ctl._measures[second.arm].seconds == pytest.approx(0.5)
    assert ctl.cost(TARGET, 0) == pytest.approx(0.5)
    # The third follows a step of another arm: it pays the switch and is not averaged.
    clock.now = 2.5
    assert ctl.update([2, 2], third.gamma) == third
    assert ctl.cost(DRAFT, 2) == float("inf")
    # A step run at a gamma nobody chose (fix_gamma) is still accounted, as its arm.
    clock.now = 3.0
    assert ctl.update([2, 2], 2).arm == (DRAFT, 2)
    assert ctl.cost(DRAFT, 2) == pytest.approx(0.5 / 3)
    assert ctl.steps == {TARGET: 2, DRAFT: 2, SUFFIX: 0}
    with pytest.raises(ValueError, match="arms"):
        ctl.update([0], 3)


def test_host_work_of_a_step_is_its_own() -> None:
    """Step k + 1 is queued (its lookups, its launches) before step k is read back: that host
    time is step k + 1's, not step k's."""
    clock = Clock()
    ctl = Controller({DRAFT: (2,), SUFFIX: (2,)}, clock=clock)
    a = ctl.choose()
    clock.now += 0.1
    ctl.sent()
    b = ctl.choose()
    clock.now += 0.7  # b's host work
    ctl.sent()
    clock.now = 1.0  # a read back
    ctl.update([0], a.gamma)
    assert ctl._measures[a.arm].seconds == pytest.approx(1.0 - 0.7)
    clock.now = 1.5  # b read back: its device time 0.5 after a's, plus its own host 0.7
    ctl.update([0], b.gamma)
    assert ctl._measures[b.arm].seconds == pytest.approx(0.5 + 0.7)


def test_a_lookup_before_the_choice_is_the_steps_own_host_work() -> None:
    """The adaptive scheduler looks the suffix index up before `choose` (the lookup decides
    which arms are usable): `choose(started=)` makes that host time the new step's, not the
    step in flight's (whose seconds count from the read-back before it to its own)."""
    clock = Clock()
    ctl = Controller({DRAFT: (2,), SUFFIX: (2,)}, clock=clock, probe_steps=2)
    a = ctl.choose()
    clock.now += 0.1
    ctl.sent()
    started = clock.now
    clock.now += 0.5  # b's lookup, queued behind a
    b = ctl.choose(started=started)
    clock.now += 0.2  # b's issue
    ctl.sent()
    clock.now = 1.0  # a read back
    ctl.update([0], a.gamma)
    assert ctl.trace[-1].seconds == pytest.approx(1.0 - 0.7)
    clock.now = 1.5  # b read back: its device time 0.5 after a's, and its host work 0.7
    ctl.update([0], b.gamma)
    assert ctl.trace[-1].seconds == pytest.approx(0.5 + 0.7)
    assert ctl.trace[-1].host == pytest.approx(0.7)


def test_windows_snapshot_and_metrics() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    seconds = {(TARGET, 0): 1.0, (DRAFT, 2): 1.2, (SUFFIX, 2): 1.05}
    ctl = Controller({DRAFT: (2,), SUFFIX: (2,)}, costs=seconds)
    choices = [ctl.choose() for _ in range(1 + 2 * ctl.probe_steps)]  # queued ahead
    assert {c.arm for c in choices} == set(ctl.arms)
    assert sum(c.probe for c in choices) == 2 * ctl.probe_steps  # all but `first`
    ctl._issued.clear()  # (accounted below as steps of forced gammas)
    ctl.update([0, 0], 0)
    ctl.update([2, 1], 2, row_sources=[DRAFT, SUFFIX], proposed=[2, 1])  # per-row sources
    ctl.update([1, 0], 2, proposed=[2, 0])  # the second row proposed nothing
    assert ctl.window_counts(DRAFT) == (3, 4)
    assert ctl.window_counts(SUFFIX) == (1, 1)
    assert ctl.acceptance_window(DRAFT) == pytest.approx(3 / 4)
    snap = ctl.snapshot()
    assert snap["steps"] == {TARGET: 1, DRAFT: 2, SUFFIX: 0}
    assert snap["probes"] == 2 * ctl.probe_steps
    registry = CollectorRegistry()
    registry.register(ControllerCollector(lambda: [ctl]))
    ctl.record_update(True)
    text = generate_latest(registry).decode()
    assert 'fuser_spec_steps_total{source="draft"} 2.0' in text
    assert 'fuser_spec_acceptance_window{source="suffix"} 1.0' in text
    assert 'fuser_draft_updates_total{result="accepted"} 1.0' in text


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="eagle"):
        Controller({"eagle": (1,)})
    with pytest.raises(ValueError, match="gamma"):
        Controller({DRAFT: (0,)})
    with pytest.raises(ValueError, match="probe_share"):
        Controller({DRAFT: (1,)}, probe_share=0.0)
    with pytest.raises(ValueError, match="missing"):
        Controller({DRAFT: (1, 2)}, costs={(TARGET, 0): 1.0, (DRAFT, 1): 1.1})
    with pytest.raises(ValueError, match="must be in 0..2"):
        ctl = Controller({DRAFT: (2,)}, costs={(TARGET, 0): 1.0, (DRAFT, 2): 1.1})
        ctl.choose()
        ctl.update([3], ctl.last.gamma if ctl.last.gamma else 2)


def test_the_suffix_runs_only_where_a_step_may_use_it() -> None:
    """`choose(usable)`: a step where no row has a suffix match never runs the suffix arm,
    not even as its probe; the best usable arm runs instead."""
    seconds = {(TARGET, 0): 1.0, (DRAFT, 2): 1.3, (SUFFIX, 2): 1.02}
    ctl = Controller({DRAFT: (2,), SUFFIX: (2,)}, costs=seconds)
    script = Script(seconds, {DRAFT: 0.5, SUFFIX: 0.9}, seed=4)
    no_match = lambda arm: arm[0] != SUFFIX  # noqa: E731
    for _ in range(300):
        choice = ctl.choose(no_match)
        assert choice.source != SUFFIX
        ctl.update(script.accepted(choice), choice.gamma)
    assert ctl.cost(SUFFIX, 2) == float("inf")
    for _ in range(300):  # matches everywhere: the suffix is probed, and wins
        choice = ctl.choose()
        ctl.update(script.accepted(choice), choice.gamma)
    assert ctl.best() == (SUFFIX, 2)
    assert ctl.choose(no_match).arm == (DRAFT, 2)  # (it measured the draft better than target)


# -- the acceptance model ------------------------------------------------------------------


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


def test_measured_reports_each_arms_counted_seconds_beside_its_read_back_intervals() -> None:
    """`measured()` (what benchmarks print to check the costs against the throughput): per arm
    the steps and probes, and the medians of the seconds counted, of the wall time between
    read-backs, of the host's issuing time and of the tokens per row. Steps one at a time, 2 ms
    of host before each is queued and its device time after: counted seconds and intervals
    agree."""
    script = Script({(TARGET, 0): 0.004, **{(DRAFT, g): 0.002 * (1 + g) for g in GAMMAS}},
                    {DRAFT: 0.6}, rows=4)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    for _ in range(300):
        choice = ctl.choose()
        script.clock.now += 0.002  # the host issues it
        ctl.sent()
        script.clock.now += script.seconds[choice.arm]
        ctl.update(script.accepted(choice), choice.gamma)
    measured = ctl.measured()
    assert sum(m["steps"] for m in measured.values()) == 300
    assert sum(m["probes"] for m in measured.values()) == ctl.probes
    best = ctl.best()
    name = "target-only" if best[0] == TARGET else f"{best[0]} gamma {best[1]}"
    row = measured[name]
    assert row["host"] == pytest.approx(0.002)
    assert row["seconds"] == pytest.approx(0.002 + script.seconds[best])
    assert row["interval"] == pytest.approx(row["seconds"])
    assert 1.0 <= row["tokens"] <= 1 + best[1]


# -- switching costs: an arm's step after a step of another arm costs more --------------------

# As the bundled pair's adaptive server on an H100 measured them (ms per step, benchmarks/
# adapt.py's "measured" lines): the plain draft steps in a row, the mixed suffix steps, and a
# step run after a step of another arm paying ~1.4 ms more (a draft gamma 6 step ran 0.70 ms
# in a row and 2.15 ms as a lone probe among suffix steps). The acceptance is geometric.
SERVER_SECONDS = {(TARGET, 0): 0.45e-3, (DRAFT, 1): 0.52e-3, (DRAFT, 2): 0.56e-3,
                  (DRAFT, 4): 0.63e-3, (DRAFT, 6): 0.70e-3, (SUFFIX, 1): 0.85e-3,
                  (SUFFIX, 2): 0.90e-3, (SUFFIX, 4): 0.95e-3, (SUFFIX, 6): 1.04e-3}
SERVER_ALPHA = {DRAFT: 0.78, SUFFIX: 0.85}
SWITCH = 1.4e-3


class SwitchScript(Script):
    """A Script whose step of a source in `entering` costs `switch` seconds more when the arm
    that ran before it was another (an overlapped draft round restarting, graphs replayed
    cold), and where the suffix's arms are usable only in steps where some row matched
    (probability `match`)."""

    def __init__(self, *args: object, switch: float, match: float = 1.0,
                 entering: tuple[str, ...] = (TARGET, DRAFT, SUFFIX), **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.switch, self.match, self.entering = switch, match, entering
        self.before: tuple[str, int] | None = None
        self.tokens = 0.0

    def step(self, ctl: Controller) -> Choice:
        matched = self.rng.random() < self.match
        choice = ctl.choose(lambda arm: arm[0] != SUFFIX or matched)
        assert choice.source != SUFFIX or matched
        paid = self.before not in (None, choice.arm) and choice.source in self.entering
        self.before = choice.arm
        self.clock.now += self.seconds[choice.arm] + (self.switch if paid else 0.0)
        accepted = self.accepted(choice)
        self.tokens += 1.0 + sum(accepted) / len(accepted)
        ctl.update(accepted, choice.gamma)
        return choice

    def per_token(self, ctl: Controller, steps: int) -> float:
        """Wall seconds per emitted token per row over the next `steps` steps."""
        begin, tokens = self.clock.now, self.tokens
        self.run(ctl, steps)
        return (self.clock.now - begin) / (self.tokens - tokens)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_lone_probe_that_pays_the_switch_does_not_hide_the_best_arm(seed: int) -> None:
    """Every step after a step of another arm costs 1.4 ms more (two steps' worth): probes of
    one step measured each arm at about three times its cost, and the controller stayed on
    the suffix's gamma 6, 23% slower per token than the draft's gamma 6 (the bundled pair's
    server on an H100). Probes of several steps, the first not averaged, measure each arm as
    it runs in a row: the controller serves within 10% of the best arm alone (each probe pays
    two switches), every arm measured within the first probes, probes within 5%."""
    script = SwitchScript(SERVER_SECONDS, SERVER_ALPHA, seed=seed, switch=SWITCH)
    ctl = Controller({DRAFT: GAMMAS, SUFFIX: GAMMAS}, clock=script.clock)
    best = min(SERVER_SECONDS, key=lambda arm: true_cost(script, arm))
    assert best == (DRAFT, 6)
    script.run(ctl, len(ctl.arms) * ctl.probe_steps)
    assert all(ctl.cost(*arm) < float("inf") for arm in ctl.arms), ctl.reason
    script.run(ctl, 500)
    achieved = script.per_token(ctl, 3000)
    assert achieved <= 1.10 * true_cost(script, best), (achieved, ctl.reason)
    assert true_cost(script, ctl.best()) <= (1 + HOLD) * true_cost(script, best), ctl.reason
    assert ctl.probes <= 0.05 * ctl.step_count + ctl.probe_steps * len(ctl.arms)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_an_arm_that_runs_only_where_a_row_matched_pays_for_the_steps_it_cannot_run(
        seed: int) -> None:
    """The suffix's gamma 6 costs less per token than any draft arm where it runs, but only
    40% of the steps can run it (no row matched in the others), and a draft step after a
    step of another arm pays 1.4 ms (its overlapped round restarts). Counted as their own
    arms' steps, the steps that stood in for the suffix (and the switches they paid) left
    the suffix looking best, 23% slower than draft gamma 6 alone. Counted in the suffix's
    cost, they make draft gamma 6 the choice, as it is."""
    seconds = {**SERVER_SECONDS, (SUFFIX, 6): 0.70e-3}  # 0.70 / 4.53 = 0.155 ms a token
    script = SwitchScript(seconds, SERVER_ALPHA, seed=seed, switch=SWITCH, match=0.4,
                          entering=(DRAFT,))
    ctl = Controller({DRAFT: GAMMAS, SUFFIX: GAMMAS}, clock=script.clock)
    script.run(ctl, 500)
    achieved = script.per_token(ctl, 3000)
    assert ctl.best()[0] == DRAFT, ctl.reason
    assert achieved <= 1.10 * true_cost(script, (DRAFT, 6)), (achieved, ctl.reason)
    measured = ctl.measured()
    assert measured[arm_name(ctl.best())]["steady"] == pytest.approx(seconds[ctl.best()])
    assert sum(m["fallbacks"] for m in measured.values()) > 0  # (the suffix's stand-ins)


@pytest.mark.parametrize("switch_seconds", [0.0, 1.4])
def test_the_hold_follows_what_a_switch_is_measured_to_cost(switch_seconds: float) -> None:
    """Where a switch step costs what a steady one does, nothing holds the steps on an arm that
    is measured surely cheaper to leave; where it costs 2x and more, the whole HOLD applies."""
    from fuser.runtime.controller import HOLD

    script = Script(draft_seconds(1.0, 0.3), {DRAFT: 0.7}, seed=3)
    ctl = Controller({DRAFT: GAMMAS}, clock=script.clock)
    assert ctl.hold == HOLD  # no switch measured yet
    last = None
    for _ in range(400):
        choice = ctl.choose()
        extra = switch_seconds if last is not None and choice.arm != last else 0.0
        script.clock.now += script.seconds[choice.arm] + extra
        ctl.update(script.accepted(choice), choice.gamma)
        last = choice.arm
    if switch_seconds:
        assert ctl.hold == pytest.approx(HOLD)
    else:
        assert ctl.hold < 0.1 * HOLD


# -- the draft's catch-up: charged to the arms that left the draft behind ----------------------

LONG = 8  # the suffix's long arm: the index's proposals verified alone, the draft not run


class CatchUpScript(Script):
    """A Script where target-only steps and the suffix's LONG arm leave the draft behind by
    gamma + 1 tokens a row, and the next step that runs the draft (a draft or mixed arm)
    first catches it up at `per_token` seconds a token behind, reported as its `resync`."""

    def __init__(self, *args: object, per_token: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.per_token = per_token
        self.behind = 0
        self.tokens = 0.0

    def step(self, ctl: Controller) -> Choice:
        choice = ctl.choose()
        drafted = choice.source == DRAFT or choice.arm == (SUFFIX, 2)
        resync = self.per_token * self.behind if drafted else 0.0
        self.behind = 0 if drafted else self.behind + choice.gamma + 1
        self.clock.now += self.seconds[choice.arm] + resync
        accepted = self.accepted(choice)
        self.tokens += 1.0 + sum(accepted) / len(accepted)
        ctl.update(accepted, choice.gamma, behind=0 if drafted else choice.gamma + 1,
                   resync=resync)
        return choice

    def per_emitted(self, ctl: Controller, steps: int) -> float:
        """Wall seconds per emitted token per row over the next `steps` steps."""
        begin, tokens = self.clock.now, self.tokens
        self.run(ctl, steps)
        return (self.clock.now - begin) / (self.tokens - tokens)


@pytest.mark.parametrize("per_token", [0.02, 0.5], ids=["cheap-catch-up", "dear-catch-up"])
def test_the_drafts_catch_up_is_a_cost_of_the_arms_that_left_it_behind(per_token: float
                                                                       ) -> None:
    """Repetitive rows: the suffix's LONG arm (1.6 s, ~7.4 tokens a row) costs 0.22 s a token
    on its own, the mixed step (suffix gamma 2) 0.46, the draft's 0.66. Each LONG step puts
    the draft LONG + 1 tokens behind, which the next draft or mixed step catches up first. At
    0.02 s a token the catch-up adds 0.18 s a LONG step: it stays the cheapest, and the
    controller settles on it. At 0.5 s a token it adds 4.5 s (0.83 s a token in all): the
    mixed step is the cheapest. The catch-up runs in the first step after a LONG run, a
    switch (not averaged): counted there, it was nobody's cost, and LONG looked cheapest at
    any price. Charged to LONG, the controller serves within 10% of the cheapest arm's true
    cost, probes within 5%."""
    seconds = {(TARGET, 0): 1.0, (DRAFT, 2): 1.3, (SUFFIX, 2): 1.3, (SUFFIX, LONG): 1.6}
    script = CatchUpScript(seconds, {DRAFT: 0.6, SUFFIX: 0.95}, seed=4, per_token=per_token)
    ctl = Controller({DRAFT: (2,), SUFFIX: (2, LONG)}, clock=script.clock)

    def true(arm: tuple[str, int]) -> float:
        """Seconds per emitted token, the catch-up of the tokens the arm's step leaves."""
        left = arm[1] + 1 if arm[0] == TARGET or arm == (SUFFIX, LONG) else 0
        return true_cost(script, arm) * (1.0 + per_token * left / seconds[arm])

    best = min(seconds, key=true)
    assert best == ((SUFFIX, LONG) if per_token < 0.1 else (SUFFIX, 2))
    script.run(ctl, 1000)
    assert ctl.best() == best, ctl.reason
    achieved = script.per_emitted(ctl, 3000)
    assert achieved <= 1.10 * true(best), (achieved, true(best), ctl.reason)
    assert ctl.probes <= 0.05 * ctl.step_count + ctl.probe_steps * len(ctl.arms)
    charged = ctl.measured()[arm_name((SUFFIX, LONG))]["catch_up"]
    assert charged == pytest.approx(per_token * (LONG + 1)), ctl.reason
    assert ctl.measured()[arm_name(best)]["resyncs"] > 0 or best == (SUFFIX, LONG)


def test_a_catch_up_is_out_of_the_steps_own_seconds() -> None:
    """The step that runs the catch-up first is measured without it: the draft arm's cost is
    its own steps', the catch-up its owners'; `behind` and `resync` are checked."""
    clock = Clock()
    ctl = Controller({DRAFT: (2,), SUFFIX: (LONG,)}, clock=clock)
    for _ in range(3):  # LONG steps of 1 s (issued without `choose`): the draft 27 behind
        clock.now += 1.0
        ctl.update([2, 2], LONG, behind=LONG + 1)
    clock.now += 0.5 + 2.7  # a draft step's 0.5 s after a 2.7 s catch-up
    ctl.update([2, 2], 2, resync=2.7)
    assert ctl.trace[-1].seconds == pytest.approx(0.5) and ctl.trace[-1].resync == 2.7
    assert ctl.measured()[arm_name((SUFFIX, LONG))]["catch_up"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="behind"):
        ctl.update([0], 2, behind=-1)


def test_use_of_a_source_says_when_only_its_probe_could_use_it() -> None:
    """Controller.use_of: where the suffix's arms are never usable (no row matches), a step
    for which it says PROBE_ONLY starts no probe when they are left out (nothing else was
    due), and one for which it says NEEDED does (another arm's probe was due too); once the
    suffix is usable and cheapest and settled on, every step that runs it NEEDS it. A source
    the controller lacks is UNUSED."""
    script = Script({(TARGET, 0): 1.0, (DRAFT, 2): 1.2, (DRAFT, 4): 1.4, (SUFFIX, 2): 0.3,
                     (SUFFIX, 4): 0.35}, {DRAFT: 0.6, SUFFIX: 0.9}, rows=4, seed=3)
    ctl = Controller({DRAFT: (2, 4), SUFFIX: (2, 4)}, clock=script.clock)
    assert Controller({DRAFT: (2,)}, clock=script.clock).use_of(SUFFIX) == UNUSED
    seen = []
    for _ in range(400):
        use = ctl.use_of(SUFFIX)
        assert ctl.may_choose(SUFFIX) == (use != UNUSED)
        choice = ctl.choose(lambda arm: arm[0] != SUFFIX)
        if use == PROBE_ONLY:
            assert not choice.probe and choice.arm == ctl.best(), ctl.reason
        if use == NEEDED:
            assert choice.probe or choice.policy is not None, ctl.reason
        seen.append(use)
        script.clock.now += script.seconds[choice.arm]
        ctl.update(script.accepted(choice), choice.gamma)
    assert {UNUSED, PROBE_ONLY, NEEDED} <= set(seen), seen
    script.run(ctl, 400)  # the suffix usable: it is probed, measured, settled on
    assert ctl.best()[0] == SUFFIX, ctl.reason
    for _ in range(50):  # (but where another source's arm is being probed)
        use = ctl.use_of(SUFFIX)
        if script.step(ctl).source == SUFFIX:
            assert use == NEEDED, ctl.reason


class Uncached(Controller):
    """The controller computing `best` and `_due` afresh at every call (no memo between the
    state's changes)."""

    def best(self) -> tuple[str, int]:
        self._best = None
        return super().best()

    def _due(self, best: tuple[str, int]) -> list[tuple[str, int]]:
        self._due_of = None
        return super()._due(best)


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 10_000), alpha=st.floats(0.1, 0.95),
       usable_share=st.sampled_from([0.0, 0.3, 1.0]), noise=st.sampled_from([0.0, 0.2]))
def test_the_memo_of_the_best_arm_and_the_due_probes_changes_no_choice(
        seed: int, alpha: float, usable_share: float, noise: float) -> None:
    """`best` and `_due` are kept between the state's changes (a step asks for both in
    `use_of`, then in `choose`): over scripted steps, one or two in flight as the
    schedulers queue them, with forgotten sources, catch-ups and pauses, every choice,
    `use_of` answer and cost equals the controller's that computes them afresh at every
    call."""
    seconds = {(TARGET, 0): 1.0, (DRAFT, 2): 1.2, (DRAFT, 4): 1.5, (SUFFIX, 2): 0.9,
               (SUFFIX, 4): 1.1, (SUFFIX, 16): 2.0}
    runs = []
    for cls in (Controller, Uncached):
        script = Script(seconds, {DRAFT: alpha, SUFFIX: min(alpha + 0.1, 0.99)}, rows=4,
                        noise=noise, seed=seed)
        ctl = cls({DRAFT: (2, 4), SUFFIX: (2, 4, 16)}, clock=script.clock, probe_steps=2)
        events = random.Random(seed)
        trace, in_flight = [], []

        def issue() -> None:
            use = ctl.use_of(SUFFIX)
            matched = events.random() < usable_share
            choice = ctl.choose(lambda arm: arm[0] != SUFFIX or matched)
            ctl.sent()
            in_flight.append(choice)
            trace.append((use, choice, ctl.best(), [ctl.cost(*a) for a in ctl.arms]))

        def read_back() -> None:
            choice = in_flight.pop(0)
            script.clock.now += seconds[choice.arm] * (1.0 + noise * events.random())
            behind = choice.gamma + 1 if choice.source == SUFFIX and choice.gamma == 16 else 0
            resync = 0.05 if choice.source == DRAFT and events.random() < 0.2 else 0.0
            ctl.update(script.accepted(choice), choice.gamma, behind=behind, resync=resync)
            trace.append((ctl.best(), [ctl.cost(*a) for a in ctl.arms]))

        issue()
        for i in range(300):
            if events.random() < 0.7:  # the next step queued before this one's read-back
                issue()
            read_back()
            if i % 47 == 46:
                ctl.forget(DRAFT)
            if i % 61 == 60:  # (a loop that stops with a step in flight never reads it back)
                ctl.pause()
                in_flight.clear()
            if not in_flight:
                issue()
        runs.append(trace)
    assert runs[0] == runs[1]
