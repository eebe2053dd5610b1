"""The one speculation controller: which source proposes the next step's tokens and how many,
chosen by the measured wall time per emitted token. `engine.generate` (gamma="auto") and the
adaptive scheduler (runtime/adaptive_scheduler.py) both use it.

Arms. An arm is a (source, gamma) pair: (TARGET, 0) is target-only decoding; (DRAFT, g) a
speculative step at draft length g, the plain one (runtime/scheduler.py's, overlapped rounds
included); (SUFFIX, g) a step over the suffix index's proposals: with a draft, the mixed step
at the draft's gamma g (rows with a long suffix match verify the index's proposals, the others
the draft's, in one verify: runtime/suffix.py `mixed_step`), without one the target verifying
the index's proposals alone. The adaptive scheduler offers the suffix's arms only to steps in
which some row matched (`choose`'s `usable`), so it can always run the plain draft step.

What is measured. Per arm, exponentially weighted averages of

    seconds per step    from the moment the step could start (its issue, or the previous
                        step's read-back when it was queued ahead of it) to its own read-back:
                        the device's time, the host's work around it (lookups, bookkeeping),
                        and the overlap the loop lost, all included;
    tokens per row      the tokens each active row emitted (accepted proposals + 1),
    catch-up per step   the seconds of the draft's catch-up (`resync_draft`) that the arm's
                        steps left to a later step (`update`'s `behind` and `resync`): the
                        steps that did not run the draft (target-only, the suffix index's
                        proposals verified alone) put it behind, and the draft or mixed step
                        that catches it up first reports the catch-up's seconds, taken out of
                        its own and charged to the arms behind it, in proportion to the
                        tokens each put the draft behind, per step of each,

and the arm's cost is (seconds + catch-up) per step over tokens per row, seconds per emitted
token per row. No model of acceptance or
of the captured graphs' GPU time enters the choice: a lookup that costs host time or a step that
stops the pipeline shows up in the seconds, a proposal the target rejects in the tokens.

The choice. The best arm is the measured one with the lowest cost; every step runs it unless a
probe is due. A probe runs another arm for `probe_steps` (PROBE_STEPS) steps in a row, to
measure it: the arm unmeasured, or measured cheaper than the best but not surely enough (below),
or measured the longest ago once `refresh` steps have passed since (an arm whose probe found it
more than FAR_BEHIND times the best's cost waits twice as long each time, up to 2**MAX_BACKOFF
times: hopeless arms cost fewer probes).

Switches. A step that follows a step of another arm pays for the change: an overlapped draft
round starts over by drafting, a graph not replayed for a while runs cold, the draft catches up.
On an H100 the bundled pair's draft gamma 6 ran 0.70 ms a step in a row and 2.15 ms as lone
probes among suffix steps (benchmarks/adapt.py's "measured" lines): probed one step at a time,
every arm but the one in use looked three times dearer than it is, and the best was never
taken. So a step whose arm's policy (below) differs from the step before's is a `switch`: it is
traced, but not averaged into any arm's cost. The switches' cost is real, and it is why the
steps leave the arm they run (`best`) only for one measured at least HOLD cheaper and cheaper
by CONFIDENCE standard errors of the two costs (from the variance of the tokens per row over
each step's rows; an arm measured MAX_HOLD cheaper is taken whatever the errors): arms a few
percent apart otherwise trade places on noise, paying a switch each time.

Stand-ins. An arm that cannot run where its turn comes (the suffix's, in a step where no row
matched: `choose`'s `usable`) gives the step to the cheapest usable measured arm, and the step
is counted in the cost of the arm it stood in for (its policy): what choosing the suffix costs
includes the draft steps run in its place and the switches between the two.

An arm's first averaged sample is provisional: its second replaces it (a first run pays what
only a first run does, a CUDA graph's upload at its first replay). Its tokens per row are
averaged over more steps than its seconds (`token_memory`: they vary far more from step to step)
unless the two part by SURPRISE standard errors (the acceptance moved). Probes are bounded: a
probe starts only while

    probes so far + probe_steps <= probe_share * steps so far + allowance,

where the allowance is one probe of each arm (each must be measured once) plus one per arm
dropped by `forget`: every arm is measured within the first (arms - 1) * probe_steps steps (a
suffix arm: its first steps where some row matched). Over a long run at most about probe_share
(5%) of the steps are probes. The arm in use is measured at every step, so when it gets surely
slower than another arm's measurement the choice moves there; an arm that got faster is found
by its next probe.

Scripted costs. `costs` ({(source, gamma): seconds}) replace the clock: a step's seconds are
its arm's scripted cost (tests; costs measured elsewhere). `clock` replaces time.perf_counter.

Issued steps are read back in the order they were issued (the decoding loops queue one step
ahead). `choose` records each issued choice; `update` takes the oldest, so a loop that keeps one
step in flight needs no bookkeeping of its own.

What it did stays readable: `reason` (one line), `steps` (per source), `acceptance_window`
(accepted over proposed tokens over the last `window` rows' steps of a source), `updates` (draft
updates accepted and rejected), `snapshot()` for engine.stats, and `ControllerCollector` for
Prometheus:

    fuser_spec_steps_total{source}              steps per source ("target", "draft", "suffix";
                                                a mixed step counts as "suffix")
    fuser_spec_rows_total{source}               rows given proposals per source ("draft",
                                                "suffix"; a mixed step counts both)
    fuser_spec_acceptance_window{source}        acceptance_window(source), gauge
    fuser_draft_updates_total{result}           "accepted" | "rejected"

The acceptance model (`expected_tokens_per_step`, `leviathan_speedup`,
`expected_tokens_per_round`) stays here for benchmarks and docs: equation (1) below.

    E[tokens per step at g] = 1 + sum_{j=1..g} prod_{i<=j} alpha_i                      (1)

with alpha_i the acceptance at draft position i given the ones before it; for overlapped rounds
(runtime/speculative.py `overlapped_step`) a round streams on with P_s = prod alpha_i * alpha_g,
restarts streaming with P_r = alpha_1, and emits pi E(g) + (1 - pi), pi = P_r / (P_r + 1 - P_s).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["DRAFT", "NEEDED", "PROBE_ONLY", "SOURCES", "SUFFIX", "TARGET", "UNUSED", "Choice",
           "Controller", "ControllerCollector", "StepSample", "arm_name",
           "expected_tokens_per_round", "expected_tokens_per_step", "leviathan_speedup"]

TARGET, DRAFT, SUFFIX = "target", "draft", "suffix"
SOURCES = (TARGET, DRAFT, SUFFIX)
# Controller.use_of: how a coming step could use a source's arms
UNUSED, PROBE_ONLY, NEEDED = "unused", "probe only", "needed"
# A probe that measures its arm at more than FAR_BEHIND times the best arm's cost doubles the
# arm's wait before the next probe, up to 2**MAX_BACKOFF times `refresh`; one within resets it.
FAR_BEHIND = 1.5
MAX_BACKOFF = 3
# Steps of one probe (the first pays the switch and is not averaged; `Controller`).
PROBE_STEPS = 4
# The steps leave the arm they run for another only when it costs at least HOLD less, and
# less by CONFIDENCE standard errors of the two costs' difference: each change pays a switch,
# and arms a few percent apart trade places on the noise of their tokens alone. An arm
# measured at MAX_HOLD or more below it is taken whatever the errors.
HOLD = 0.05
# The hold scales with what a switch is measured to cost: a switch step's seconds over its
# arm's steady ones, less 1 (averaged at SWITCH_MEMORY), as a share of SWITCH_FULL: where
# switching costs nothing (no overlap to restart) the steps take any surely cheaper arm.
SWITCH_FULL = 0.5
SWITCH_MEMORY = 0.8
CONFIDENCE = 2.0
MAX_HOLD = 0.5
# An arm's slow average of tokens per row jumps to its fast one where they part by SURPRISE
# standard errors of the fast one.
SURPRISE = 3.0
# A step of one row tells nothing of its spread: its tokens count as this uncertain (a
# relative standard deviation).
ONE_ROW_NOISE = 0.5
# Per step of a source, the weight its acceptance counts keep (a step counts every row's
# proposals: a handful of steps are evidence enough to rescale its other gammas).
ACCEPT_MEMORY = 0.6
# An arm's stale tokens per row are rescaled by its source's acceptance only past this change
# (log ratio): smaller moves are the noise of a few steps and would only make arms trade places.
DRIFT_DEADBAND = 0.15
FRESH = 16


# -- the acceptance model ---------------------------------------------------------------------


def leviathan_speedup(alpha: float, gamma: int, c: float) -> float:
    """Leviathan et al.'s expected speedup: (1 - a^(g+1)) / ((1 - a)(g c + 1)).

    alpha: acceptance rate in [0, 1] (the same at every draft position); gamma: draft length
    >= 0; c: cost of one draft step over one target step, >= 0. At alpha = 1 the geometric sum
    (1 - a^(g+1)) / (1 - a) is its limit g + 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must be in [0, 1]")
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma={gamma!r} must be an int >= 0")
    if not c >= 0.0:
        raise ValueError(f"c={c!r} must be >= 0")
    tokens = gamma + 1.0 if alpha == 1.0 else (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)
    return tokens / (gamma * c + 1.0)


def expected_tokens_per_step(alphas: Sequence[float], gamma: int) -> float:
    """Equation (1): 1 + sum_{j=1..g} prod_{i<=j} alpha_i, with alphas[i - 1] = alpha_i."""
    if gamma > len(alphas):
        raise ValueError(f"gamma={gamma} needs {gamma} per-position rates, got {len(alphas)}")
    tokens, reach = 1.0, 1.0
    for alpha in alphas[:gamma]:
        reach *= alpha  # P(d_1..d_j all accepted)
        tokens += reach
    return tokens


def expected_tokens_per_round(alphas: Sequence[float], gamma: int) -> float:
    """Expected tokens per overlapped round at `gamma` (module docstring), alphas as in (1)."""
    streaming = expected_tokens_per_step(alphas, gamma)
    if gamma == 0:
        return 1.0
    reach = 1.0
    for alpha in alphas[:gamma]:
        reach *= alpha
    stay = reach * alphas[gamma - 1]  # P_s
    restart = alphas[0]  # P_r
    if restart == 0.0:
        return 1.0
    share = restart / (restart + 1.0 - stay)
    return share * streaming + (1.0 - share)


# -- the controller ---------------------------------------------------------------------------


def _noise(accepted: Sequence[int]) -> float:
    """The squared standard error of a step's mean tokens per row: its rows' variance over
    their number (one row: ONE_ROW_NOISE of its tokens, squared)."""
    rows = len(accepted)
    mean = sum(accepted) / rows
    if rows < 2:
        return (ONE_ROW_NOISE * (1.0 + mean)) ** 2
    return sum((n - mean) ** 2 for n in accepted) / (rows - 1) / rows

Arm = tuple[str, int]


TRACE_STEPS = 4096  # measured steps a controller keeps in `trace`


def arm_name(arm: Arm) -> str:
    """"target-only", or "<source> gamma <g>": an arm as `reason` and `measured` name it."""
    return "target-only" if arm[0] == TARGET else f"{arm[0]} gamma {arm[1]}"


@dataclass(frozen=True)
class StepSample:
    """One measured step: its arm, whether it was a probe, the seconds its cost counted, the
    wall time from the previous read-back to its own (None for a loop's first step), the host
    seconds spent issuing it, the tokens per row it emitted, the arm it was counted for (its
    policy: another arm's where it ran as that arm's fallback), whether it followed a step
    of another policy (a switch: not averaged) and the seconds of the draft's catch-up it ran
    first (not in its counted seconds: charged to the arms that left the draft behind)."""

    arm: Arm
    probe: bool
    seconds: float
    interval: float | None
    host: float
    tokens: float
    policy: Arm | None = None
    switch: bool = False
    resync: float = 0.0


@dataclass(frozen=True)
class Choice:
    """The next step: `source` proposes `gamma` tokens a row (target: gamma 0); `probe`: run
    to re-measure an arm, not because it is the best; `issued`: the clock when its host work
    began. `policy`: the arm whose measurement the step counts in (None: its own arm): the arm
    the controller meant to run, where this step had to run another (`choose`'s fallback,
    e.g. no suffix match); `switch`: the step follows one of another policy (its seconds pay
    the change: they are not averaged)."""

    source: str
    gamma: int
    probe: bool = False
    issued: float | None = None
    policy: Arm | None = None
    switch: bool = False

    @property
    def arm(self) -> Arm:
        return (self.source, self.gamma)

    @property
    def counted(self) -> Arm:
        """The arm whose measurement this step counts in: its policy, else its own arm."""
        return self.policy if self.policy is not None else self.arm


class _Measure:
    """Exponentially weighted seconds per step and tokens per row of one arm, and the squared
    standard error of a step's tokens per row (its rows' variance over their number)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0.0
        self.fast = 0.0  # the tokens per row averaged as the seconds are
        self.noise = 0.0
        self.samples = 0
        self.at = -1  # the controller's step count at the last sample
        self.backoff = 0  # its probes wait refresh * 2**backoff steps (far behind: it grows)
        self.expected = 1.0  # the model's tokens per row for the arm at the last sample
        # The draft's catch-up charged to the arm: decayed sums of its seconds and of the
        # arm's steps they were charged over (`charge`)
        self.resync_seconds = 0.0
        self.resync_steps = 0.0

    def add(self, seconds: float, tokens: float, noise: float, weight: float,
            token_weight: float, step: int) -> None:
        """One step: its seconds and tokens per row averaged at `weight`, the tokens also
        at `token_weight` (what the cost reads: they vary far more from step to step), and
        their squared standard error `noise`. Where the two averages of the tokens part by
        more than SURPRISE standard errors of the first, the acceptance moved: the second
        takes the first's value."""
        # The first sample is provisional: the second replaces it. An arm's first step pays
        # what only a first run does (a CUDA graph's upload at its first replay, lazy
        # initialisation), and a probed arm is not measured again for `refresh` steps or more.
        first = self.samples <= 1
        w = 1.0 if first else weight
        v = 1.0 if first else max(token_weight, 1.0 / (self.samples + 1))
        self.seconds += w * (seconds - self.seconds)
        self.fast += w * (tokens - self.fast)
        self.tokens += v * (tokens - self.tokens)
        self.noise += max(v, 1.0 / (self.samples + 1)) * (noise - self.noise)
        if abs(self.fast - self.tokens) > SURPRISE * math.sqrt(self.noise * w / (2.0 - w)):
            self.tokens = self.fast
        self.samples += 1
        self.at = step

    def charge(self, seconds: float, steps: float, memory: float) -> None:
        """A catch-up's `seconds`, over the arm's `steps` that left the draft behind since the
        one before; earlier charges keep `memory` of their weight."""
        keep = memory if self.resync_steps else 0.0
        self.resync_seconds = keep * self.resync_seconds + seconds
        self.resync_steps = keep * self.resync_steps + steps

    @property
    def catch_up(self) -> float:
        """The draft's catch-up seconds per step of the arm (0.0: none charged)."""
        return self.resync_seconds / self.resync_steps if self.resync_steps else 0.0

    def error(self, memory: float) -> float:
        """The relative standard error of the arm's tokens per row (so of its cost: a step's
        seconds vary far less than the tokens its rows happen to accept), over the samples
        its average holds (at most those of an exponential average of weight 1 - memory)."""
        held = min(self.samples, (1.0 + memory) / (1.0 - memory))
        return math.sqrt(self.noise / held) / max(self.tokens, 1.0)


class Controller:
    """Chooses each step's arm by measured wall time per emitted token (module docstring).

    Args:
        arms: source -> the gammas it may run at (DRAFT and/or SUFFIX); target-only is always
            an arm.
        probe_share: the share of steps probes may take over a long run (0.05: 5%).
        probe_steps: steps of one probe: the arm runs this many steps in a row, the first
            not averaged (it pays the change from the arm before: `switch`).
        memory: the weight an old sample of seconds keeps per new one while an arm is in use.
        token_memory: the same for the tokens per row (they vary far more from step to step;
            a step SURPRISE standard errors away from the average moves it more).
        probe_weight: the weight of a probe's sample in its arm's averages.
        refresh: steps before a measured arm is due a probe again (default: the other arms'
            probe steps over probe_share, so the probe budget is spread over them).
        window: steps per source kept for `acceptance_window`.
        costs: {(source, gamma): seconds per step} scripted instead of the clock.
        clock: seconds now (default time.perf_counter).
        first: the arm run before anything is measured (default: the draft's smallest gamma,
            else the suffix's, else target-only).
    """

    def __init__(self, arms: Mapping[str, Iterable[int]], *, probe_share: float = 0.05,
                 probe_steps: int = PROBE_STEPS, memory: float = 0.8,
                 token_memory: float = 0.95,
                 probe_weight: float = 0.5, refresh: int | None = None,
                 window: int = 64, costs: Mapping[Arm, float] | None = None,
                 clock: Callable[[], float] = time.perf_counter, first: Arm | None = None
                 ) -> None:
        listed: list[Arm] = [(TARGET, 0)]
        for source, gammas in arms.items():
            if source not in (DRAFT, SUFFIX):
                raise ValueError(f"source {source!r} is not one of {DRAFT!r}, {SUFFIX!r}")
            for g in sorted(set(gammas)):
                if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                    raise ValueError(f"{source} gamma {g!r} must be an int >= 1")
                listed.append((source, g))
        if not 0.0 < probe_share < 1.0:
            raise ValueError(f"probe_share={probe_share!r} must be in (0, 1)")
        if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 2:
            raise ValueError(f"probe_steps={probe_steps!r} must be an int >= 2 (its first step "
                             "is not averaged)")
        if not 0.0 <= memory < 1.0:
            raise ValueError(f"memory={memory!r} must be in [0, 1)")
        if not 0.0 <= token_memory < 1.0:
            raise ValueError(f"token_memory={token_memory!r} must be in [0, 1)")
        if not 0.0 < probe_weight <= 1.0:
            raise ValueError(f"probe_weight={probe_weight!r} must be in (0, 1]")
        if refresh is not None and (isinstance(refresh, bool) or not isinstance(refresh, int)
                                    or refresh < 1):
            raise ValueError(f"refresh={refresh!r} must be an int >= 1")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window={window!r} must be an int >= 1")
        if costs is not None:
            missing = [a for a in listed if a not in costs]
            if missing:
                raise ValueError(f"costs must give every arm's seconds per step; missing "
                                 f"{missing}")
            for arm in listed:
                if not costs[arm] > 0:
                    raise ValueError(f"costs[{arm!r}]={costs[arm]!r} must be > 0")
        self.arms: tuple[Arm, ...] = tuple(listed)
        self.sources = {s for s, _ in listed}
        self.probe_share, self.memory, self.probe_weight = probe_share, memory, probe_weight
        self.token_memory = token_memory
        self.probe_steps = probe_steps
        self.refresh = refresh if refresh is not None else \
            max(1, math.ceil((len(listed) - 1) * probe_steps / probe_share))
        self.costs = dict(costs) if costs is not None else None
        self.clock = clock
        if first is None:
            first = next((a for a in listed if a[0] == DRAFT), None) or \
                next((a for a in listed if a[0] == SUFFIX), (TARGET, 0))
        if first not in listed:
            raise ValueError(f"first={first!r} is not one of the arms {listed}")
        self.first = first
        self._measures = {arm: _Measure() for arm in listed}
        self._issued: deque[Choice] = deque()
        self._host: dict[int, float] = {}  # id(choice) -> host seconds issuing it (`sent`)
        # Per source: decayed accepted proposals and trials (a row that accepted n of p is a
        # trial at positions 1..min(n + 1, p), a success at 1..n): its acceptance rate alpha.
        self._accepts = {s: [0.0, 0.0] for s in (DRAFT, SUFFIX)}
        self._last_done: float | None = None
        self._allowance = probe_steps * len(listed)  # one probe of each arm at once
        self._run: list = []  # the probe under way: [its arm, steps of it left to issue]
        self._last_policy: Arm | None = None  # the policy of the step issued last
        # A switch's seconds over its arm's steady ones, less 1 (None: no switch measured yet,
        # the whole HOLD applies)
        self._switch_premium: float | None = None
        self._settled: Arm | None = None  # the arm the steps run between probes
        # Per arm, its steps read back since the draft's last catch-up that left the draft
        # behind, and the tokens per row they put it behind (`update`'s `behind`)
        self._behind: dict[Arm, list[int]] = {}
        self.step_count = 0  # steps chosen
        self.probes = 0  # of them, probes
        self.steps = {s: 0 for s in SOURCES}  # steps read back, per source
        self.rows = {s: 0 for s in (DRAFT, SUFFIX)}  # rows given proposals, per source
        self._window = {s: deque(maxlen=window) for s in (DRAFT, SUFFIX)}
        self.updates = {"accepted": 0, "rejected": 0}
        self.last = Choice(*first)
        self._chose = False  # (`reason`: "no step yet" before the first choice)
        self._costs: dict[Arm, float] = {}  # cost() per arm, until a sample or a step moves it
        # best() and _due(best), until a sample, a step or a choice moves them (`_changed`):
        # a step asks for both in `use_of` and again in `choose`
        self._best: Arm | None = None
        self._due_of: tuple[Arm, list[Arm]] | None = None
        # The last TRACE_STEPS measured steps: what each arm's cost is made of (`measured`).
        self.trace: deque[StepSample] = deque(maxlen=TRACE_STEPS)

    # -- reading the measurements -------------------------------------------------------------

    def _expected(self, arm: Arm) -> float:
        """Tokens per row a step of the arm emits at its source's acceptance now, equation (1)
        with one alpha at every position (1.0: target-only, or nothing counted yet)."""
        source, gamma = arm
        if source == TARGET or not self._accepts[source][1]:
            return 1.0
        accepted, trials = self._accepts[source]
        return expected_tokens_per_step([accepted / trials] * gamma, gamma)

    def cost(self, source: str, gamma: int) -> float:
        """Measured seconds per emitted token per row of an arm (inf: not measured), the
        draft's catch-up its steps left to others included (`update`'s `resync`). An arm
        measured a while ago has its tokens scaled by how its source's acceptance moved since
        (steps of the source's other gammas measure that): a drop in acceptance seen at one
        gamma makes every gamma of the source look worse at once."""
        arm = (source, gamma)
        cost = self._costs.get(arm)
        if cost is None:
            measure = self._measures[arm]
            cost = math.inf if not measure.samples else \
                (measure.seconds + measure.catch_up) / max(measure.tokens * self._drift(arm), 1.0)
            self._costs[arm] = cost
        return cost

    def _drift(self, arm: Arm) -> float:
        """How the arm's expected tokens moved since its last sample (a ratio; 1.0 inside
        the DRIFT_DEADBAND, where it is the noise of a few steps' acceptance, above 1.0 (the
        source's acceptance over a few steps, of its other gammas, is noisy: an arm that looked
        better by it would be taken on noise; a probe finds an arm that got better), and for an arm
        measured in the last FRESH steps: its own samples say more than the source's
        acceptance over a few steps; rescaled by that at every step, its tokens would walk
        away from what its steps emit)."""
        measure = self._measures[arm]
        if self.step_count - measure.at <= FRESH:
            return 1.0
        drift = self._expected(arm) / measure.expected
        return drift if math.log(drift) < -DRIFT_DEADBAND else 1.0

    def best(self) -> Arm:
        """The measured arm of lowest cost (`first` while none is measured), but the arm the
        steps run now while the lowest is within HOLD of it."""
        if self._best is None:
            self._best = self._find_best()
        return self._best

    def _find_best(self) -> Arm:
        measured = [a for a in self.arms if self._measures[a].samples]
        if not measured:
            return self.first
        lowest = min(measured, key=lambda a: (self.cost(*a), a[1]))
        held = self._settled
        if held is None or held == lowest or not self._measures[held].samples:
            return lowest
        error = math.hypot(self._measures[lowest].error(self.token_memory),
                           self._measures[held].error(self.token_memory))
        margin = min(self.hold + CONFIDENCE * error, MAX_HOLD)
        return held if self.cost(*lowest) > (1.0 - margin) * self.cost(*held) else lowest

    def _changed(self) -> None:
        """A sample, a step or a choice moved what `cost`, `best` and `_due` give: computed
        again at their next call."""
        self._costs.clear()
        self._best = None
        self._due_of = None

    @property
    def hold(self) -> float:
        """How much cheaper another arm must be measured to leave the one the steps run
        (before the errors): HOLD times the measured switch premium's share of SWITCH_FULL."""
        if self._switch_premium is None:
            return HOLD
        return HOLD * min(max(self._switch_premium, 0.0) / SWITCH_FULL, 1.0)

    @property
    def gamma(self) -> int:
        """The best arm's gamma (0: target-only), what the steps run between probes."""
        return self.best()[1]

    @property
    def enabled(self) -> bool:
        """Whether speculation is on: the best arm proposes (probes aside)."""
        return self.best()[0] != TARGET

    @property
    def in_probe(self) -> bool:
        """Whether the last choice was a probe."""
        return self.last.probe

    def may_choose(self, source: str) -> bool:
        """Whether a coming step could use `source`: it is the best arm's, one of its arms is
        being probed, or one could be probed now."""
        return self.use_of(source) != UNUSED

    def use_of(self, source: str) -> str:
        """How a coming step could use `source`'s arms, where their use needs work to know
        whether they are usable (the suffix's need a lookup): UNUSED, it could not (not the
        best arm's, none being probed, none due a probe now); PROBE_ONLY, only by a probe of
        one of them, the only arms due (a step where they are not usable runs the best arm:
        knowing it changes no other arm's turn); else NEEDED (the best arm's, a probe of one
        under way, or a probe due now that goes to another source's arm where they are not
        usable)."""
        if source not in self.sources:
            return UNUSED
        if self._run:
            return NEEDED if self._run[0][0] == source else UNUSED
        best = self.best()
        if best[0] == source:
            return NEEDED
        due = self._due(best)
        if not any(a[0] == source for a in due) or not self._budget():
            return UNUSED
        return PROBE_ONLY if all(a[0] == source for a in due) else NEEDED

    # -- the choice --------------------------------------------------------------------------

    def _budget(self) -> bool:
        """Whether a whole probe (probe_steps steps) fits the probes' share."""
        return self.probes + self.probe_steps <= \
            self.probe_share * self.step_count + self._allowance

    def _due(self, best: Arm) -> list[Arm]:
        """Arms other than `best` (the best arm now) due a probe: the unmeasured first, then
        those measured cheaper than `best` (not surely enough to be taken: `best`), due again
        after a quarter of `refresh`, then the longest unmeasured."""
        if self._due_of is not None and self._due_of[0] == best:
            return list(self._due_of[1])
        pending = {c.counted for c in self._issued if c.probe}  # probed, not yet read back
        bound = self.cost(*best)

        def waited(a: Arm) -> int:
            return self.step_count - self._measures[a].at

        due = [a for a in self.arms if a != best and a not in pending and (
            not self._measures[a].samples
            or (self.cost(*a) < bound and waited(a) >= self.refresh >> 2)
            or waited(a) >= self.refresh << self._measures[a].backoff)]
        due.sort(key=lambda a: (self._measures[a].samples > 0, self.cost(*a) >= bound,
                                self._measures[a].at))
        self._due_of = (best, due)
        return list(due)

    def choose(self, usable: Callable[[Arm], bool] | None = None, *,
               started: float | None = None) -> Choice:
        """The next step's arm; recorded as issued until its `update`.

        usable: which arms this step may run (e.g. the suffix only when some row has a match);
        the best arm runs if no usable arm is due a probe. An arm that is not usable where its
        turn came (the best, or one being probed) gives the step to the cheapest usable
        measured arm, and the step counts in the arm it stood in for (its policy): what that
        arm costs includes the steps it could not run. started: the clock when the step's host
        work began (before the lookups that `usable` needed; default: now).
        """
        if self._run:  # a probe under way: its next step
            policy, probe = self._run[0], True
            self._run[1] -= 1
            if not self._run[1]:
                self._run = []
        else:
            best = self.best()
            due = [a for a in self._due(best) if usable is None or usable(a)]
            probe = bool(due) and self._budget()
            policy = due[0] if probe else best
            self._settled = best  # (best() gives it again until `_changed` below)
            if probe and self.probe_steps > 1:
                self._run = [policy, self.probe_steps - 1]
        arm = policy
        if usable is not None and not usable(arm):
            fallback = [a for a in self.arms if usable(a) and self._measures[a].samples]
            arm = min(fallback, key=lambda a: self.cost(*a)) if fallback \
                else (TARGET, 0)
        switch = self._last_policy is not None and policy != self._last_policy
        self._last_policy = policy
        self.step_count += 1
        self.probes += probe
        choice = Choice(arm[0], arm[1], probe, self.clock() if started is None else started,
                        None if arm == policy else policy, switch)
        self._issued.append(choice)
        self.last = choice
        self._chose = True
        self._changed()  # (an arm's drift depends on the steps since its last sample)
        return choice

    @property
    def reason(self) -> str:
        """One line: the last choice and the measured costs behind it."""
        return self._describe(self.last) if self._chose else "no step yet"

    def sent(self) -> None:
        """The last chosen step is queued: the host's work issuing it (lookups, copies,
        launches) ends now. Without it, a step's host work counts from `choose` to the next
        read-back."""
        if self._issued and self._issued[-1].issued is not None \
                and id(self._issued[-1]) not in self._host:
            last = self._issued[-1]
            self._host[id(last)] = max(self.clock() - last.issued, 0.0)

    def _describe(self, choice: Choice) -> str:
        measured = sorted((a for a in self.arms if self._measures[a].samples),
                          key=lambda a: self.cost(*a))
        notes = ", ".join(f"{arm_name(a)} {1e3 * self.cost(*a):.3g} ms"
                          for a in measured) or "nothing measured yet"
        if choice.probe:
            what = f"probing {arm_name(choice.counted)}"
        elif choice.source == TARGET:
            what = "target-only: speculation off"
        else:
            what = arm_name(choice.arm)
        if choice.policy is not None:
            what += f" (standing in for {arm_name(choice.policy)})"
        return (f"{what} (measured per emitted token: {notes}; probes {self.probes} of "
                f"{self.step_count} steps)")

    def update(self, num_accepted: Sequence[int], gamma: int | None = None, *,
               proposed: Sequence[int] | None = None,
               row_sources: Sequence[str] | None = None, behind: int = 0,
               resync: float = 0.0) -> Choice:
        """Account for the oldest issued step, now read back; -> its choice.

        num_accepted: accepted proposals n of each row that was generating (each emitted
        n + 1 tokens). gamma: the gamma the step ran at, to check against the issued choice
        (a step issued without `choose`, e.g. a gamma forced from outside, is accounted as
        the arm of that gamma: DRAFT, else SUFFIX, 0 target-only). proposed: real proposals
        per row (default gamma each); a row may accept past them (padding that matched):
        counted up to them. row_sources: which source proposed each row's tokens (default:
        the step's), for the acceptance windows. behind: the most tokens a row's draft fell
        behind in this step (it did not run the draft: target-only, the index's proposals
        verified alone; 0: it ran the draft, or there is none). resync: seconds of the draft's
        catch-up this step ran first, for the steps before it that left the draft behind: out
        of its own seconds (where the clock measured them: scripted costs have none of it),
        charged to those steps' arms (their policies) in proportion to the tokens each put
        the draft behind, per step of each (`cost`).
        """
        if behind < 0 or resync < 0:
            raise ValueError(f"behind={behind!r} and resync={resync!r} must be >= 0")
        now = self.clock()
        if self._issued and gamma is not None and self._issued[0].gamma != gamma:
            self._issued.clear()  # the loop ran another gamma than chosen: those are stale
        if self._issued:
            choice = self._issued.popleft()
        else:
            if gamma is None:
                raise ValueError("update() without an issued step needs the step's gamma")
            source = TARGET if gamma == 0 else (DRAFT if (DRAFT, gamma) in self._measures
                                                else SUFFIX)
            if (source, gamma) not in self._measures:
                raise ValueError(f"gamma {gamma} is not one of this controller's arms "
                                 f"{self.arms}")
            choice = Choice(source, gamma, False, None)
        host = self._host.pop(id(choice), 0.0)
        interval = None if self._last_done is None else now - self._last_done
        start = self._last_done if choice.issued is None else (
            choice.issued if self._last_done is None else max(self._last_done, choice.issued))
        seconds = None
        if self.costs is not None:
            seconds = self.costs[choice.arm]
        elif start is not None:
            # From when the step could start to its read-back; the host work of steps queued
            # behind it in that time is theirs, and its own, if done before, is its own.
            seconds = now - start
            for later in self._issued:
                if later.issued is not None and later.issued >= start:
                    seconds -= self._host.get(id(later), 0.0)
            if choice.issued is not None and choice.issued < start:
                seconds += host
            seconds = max(seconds - resync, 0.0)
        self._last_done = now
        self.steps[choice.source] += 1
        if resync:
            self._charge(resync)
        if behind:
            steps, tokens = self._behind.setdefault(choice.counted, [0, 0])
            self._behind[choice.counted] = [steps + 1, tokens + behind]
        g = choice.gamma
        if proposed is None:
            proposed = [g] * len(num_accepted)
        if len(proposed) != len(num_accepted):
            raise ValueError(f"proposed has {len(proposed)} rows, num_accepted "
                             f"{len(num_accepted)}")
        sources = row_sources if row_sources is not None else \
            [choice.source] * len(num_accepted)
        # Per source of proposals: [accepted, proposed, trials, rows]; trials for `_accepts`
        # (a row that accepted n of p tried positions 1..min(n + 1, p)). One pass over the rows.
        counts: dict[str, list[int]] = {}
        for n, p, s in zip(num_accepted, proposed, sources):
            if not 0 <= n <= g or not 0 <= p <= g:
                raise ValueError(f"num_accepted {n} and proposed {p} must be in 0..{g}")
            if s not in self._window:
                continue
            c = counts.get(s)
            if c is None:
                c = counts[s] = [0, 0, 0, 0]
            if p:
                c[0] += min(n, p)
                c[1] += p
                c[2] += min(n + 1, p)
                c[3] += 1
        for s, (n, p, trials, rows) in counts.items():
            if p:
                self._window[s].append((n, p))
                self.rows[s] += rows
            totals = self._accepts[s]  # (decayed where the source had rows, proposing or not)
            totals[0] = totals[0] * ACCEPT_MEMORY + n
            totals[1] = totals[1] * ACCEPT_MEMORY + trials
        self._changed()  # (the acceptance moves the stale arms' costs)
        if num_accepted and seconds is not None:
            tokens = 1.0 + sum(num_accepted) / len(num_accepted)
            counted = choice.counted
            self.trace.append(StepSample(choice.arm, choice.probe, seconds, interval, host,
                                         tokens, choice.policy, choice.switch, resync))
            measured = self._measures[choice.counted]
            if choice.switch and measured.samples > 1 and measured.seconds > 0:
                premium = seconds / measured.seconds - 1.0
                self._switch_premium = premium if self._switch_premium is None else \
                    self._switch_premium + (1.0 - SWITCH_MEMORY) * (premium -
                                                                    self._switch_premium)
                self._changed()
            if not choice.switch:  # (a switch's seconds pay the change, not the arm)
                weight = self.probe_weight if choice.probe else 1.0 - self.memory
                token_weight = self.probe_weight if choice.probe else 1.0 - self.token_memory
                measure = self._measures[counted]
                expected = self._expected(counted)
                if measure.samples:  # what it measured before, at the source's acceptance now
                    drift = self._drift(counted)
                    measure.tokens = max(measure.tokens * drift, 1.0)
                    measure.fast = max(measure.fast * drift, 1.0)
                measure.add(seconds, tokens, _noise(num_accepted), weight, token_weight,
                            self.step_count)
                self._changed()
                measure.expected = expected
                if choice.probe:  # far behind the best: probed less often (up to MAX_BACKOFF)
                    far = self.cost(*counted) > FAR_BEHIND * self.cost(*self.best())
                    measure.backoff = min(measure.backoff + 1, MAX_BACKOFF) if far else 0
        return choice

    def _charge(self, seconds: float) -> None:
        """A catch-up of `seconds`: charged to the arms whose steps left the draft behind since
        the last one, in proportion to the tokens each put it behind, over its steps."""
        total = sum(tokens for _, tokens in self._behind.values())
        for arm, (steps, tokens) in self._behind.items():
            self._measures[arm].charge(seconds * tokens / total, steps, self.memory)
        self._behind.clear()
        self._changed()

    def pause(self) -> None:
        """A decoding loop starts (or was left with steps never read back: a generator not
        consumed to its end): forget the issued steps, and time the next from its own issue."""
        self._last_done = None
        self._issued.clear()
        self._changed()  # (probes pending no more)
        self._host.clear()
        self._run = []  # (a probe cut short is due again)
        self._last_policy = None

    def forget(self, source: str) -> None:
        """Drop what was measured of `source`'s arms (its proposals changed: a new draft was
        swapped in): each is probed at the next chances."""
        for arm in self.arms:
            if arm[0] == source:
                self._measures[arm] = _Measure()
                self._changed()
                self._allowance += self.probe_steps
        if source in self._window:
            self._window[source].clear()
            self._accepts[source] = [0.0, 0.0]

    def record_update(self, accepted: bool) -> None:
        """A draft update ended: its candidate was swapped in (accepted) or dropped."""
        self.updates["accepted" if accepted else "rejected"] += 1

    # -- reading it ------------------------------------------------------------------------------

    def acceptance_window(self, source: str) -> float | None:
        """Accepted over proposed tokens in the source's last `window` steps (None: none)."""
        n, p = self.window_counts(source)
        return n / p if p else None

    def window_counts(self, source: str) -> tuple[int, int]:
        """(accepted, proposed) tokens in the source's last `window` steps."""
        steps = self._window.get(source) or ()
        return sum(n for n, _ in steps), sum(p for _, p in steps)

    def measured(self) -> dict[str, dict[str, float]]:
        """Per arm over the steps in `trace` ("target-only", "draft gamma 4", ...): steps,
        probes, and the medians of the seconds its cost counted, of the wall time between
        read-backs, of the host's issuing time and of the tokens per row; "switches": its
        steps that followed a step of another policy, "fallbacks": its steps run for another
        arm (`choose`'s fallback), and "steady": the median seconds of its other steps, what
        its cost averages; "catch_up": the draft's catch-up seconds per step charged to it
        (`update`'s `resync`), "resyncs": its steps that ran a catch-up first (out of their
        seconds). Where the counted seconds and the read-back intervals part, the
        costs do not follow the throughput; where "seconds" and "steady" part, switching
        costs."""
        by_arm: dict[tuple[str, int], list[StepSample]] = {}
        for sample in self.trace:
            by_arm.setdefault(sample.arm, []).append(sample)

        def median(values: list[float]) -> float:
            values = sorted(values)
            return values[len(values) // 2] if values else float("nan")

        out: dict[str, dict[str, float]] = {}
        for arm, samples in sorted(by_arm.items()):
            out[arm_name(arm)] = {
                "steps": len(samples), "probes": sum(s.probe for s in samples),
                "seconds": median([s.seconds for s in samples]),
                "interval": median([s.interval for s in samples if s.interval is not None]),
                "host": median([s.host for s in samples]),
                "tokens": median([s.tokens for s in samples]),
                "switches": sum(s.switch for s in samples),
                "fallbacks": sum(s.policy is not None for s in samples),
                "steady": median([s.seconds for s in samples
                                  if not s.switch and s.policy is None]),
                "catch_up": self._measures[arm].catch_up,
                "resyncs": sum(s.resync > 0 for s in samples)}
        return out

    def snapshot(self) -> dict[str, Any]:
        """What engine.stats shows: the last choice, why, steps per source, the measured cost
        per arm, windowed acceptance, probes, draft updates."""
        return {
            "source": self.last.source, "gamma": self.last.gamma, "probe": self.last.probe,
            "best": list(self.best()), "reason": self.reason, "steps": dict(self.steps),
            "rows": dict(self.rows),
            "probes": self.probes, "chosen": self.step_count,
            "seconds_per_token": {f"{s}:{g}": self.cost(s, g)
                                  for s, g in self.arms if self._measures[(s, g)].samples},
            "acceptance_window": {s: self.acceptance_window(s) for s in self._window
                                  if s in self.sources},
            "draft_updates": dict(self.updates),
        }


class ControllerCollector:
    """Prometheus collector of one engine's controllers (one per batch bucket: steps and
    updates summed, windows pooled); register it in the engine's registry
    (runtime/metrics.py SpecMetrics.registry). Needs prometheus_client when collected."""

    def __init__(self, controllers: Callable[[], Iterable[Controller]],
                 updates: Callable[[], Mapping[str, int]] | None = None) -> None:
        """updates: the draft updates' counts ({"accepted": n, "rejected": m}) where they are
        kept once (a Distiller's); default: the controllers' own, summed."""
        self.controllers = controllers
        self.updates = updates

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        controllers = list(self.controllers())
        steps = CounterMetricFamily("fuser_spec_steps_total", "Decoding steps per source of "
                                    "proposals (a mixed step, the draft's rows beside the "
                                    "index's: suffix).", labels=["source"])
        for source in SOURCES:
            steps.add_metric([source], sum(c.steps[source] for c in controllers))
        yield steps
        rows = CounterMetricFamily("fuser_spec_rows_total", "Rows of decoding steps given "
                                   "proposals, per source (a step may mix them).",
                                   labels=["source"])
        for source in (DRAFT, SUFFIX):
            rows.add_metric([source], sum(c.rows[source] for c in controllers))
        yield rows
        window = GaugeMetricFamily("fuser_spec_acceptance_window", "Accepted over proposed "
                                   "tokens in each source's recent steps.", labels=["source"])
        for source in (DRAFT, SUFFIX):
            counts = [c.window_counts(source) for c in controllers]
            proposed = sum(p for _, p in counts)
            if proposed:
                window.add_metric([source], sum(n for n, _ in counts) / proposed)
        yield window
        updates = CounterMetricFamily("fuser_draft_updates_total", "Online draft updates, by "
                                      "whether the candidate was swapped in.", labels=["result"])
        counts = self.updates() if self.updates is not None else {
            result: sum(c.updates[result] for c in controllers)
            for result in ("accepted", "rejected")}
        for result in ("accepted", "rejected"):
            updates.add_metric([result], counts.get(result, 0))
        yield updates
