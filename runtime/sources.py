"""Which source proposes the next step's tokens: none (target-only), the draft model, or the
suffix index, and how many: runtime/adaptive.py's gamma choice over several sources.

The model (adaptive.py's, per source). A source s proposes up to g tokens a row; alpha_{s,i} is
the probability that its i-th proposal is accepted given that the ones before it were. A step
with source s at gamma g emits per row

    E_s(g) = 1 + sum_{j=1..g_r} prod_{i<=j} alpha_{s,i}                                     (1)

tokens, with g_r = g for the draft (it always proposes g) and g_r = min(g, l_r) for the suffix
index, which proposes the l_r tokens it found for row r (none: the row emits only the target's
token). The host knows every l_r before the step, so the suffix's expected yield is the mean of
(1) over the batch's rows *now*, and a step where no row has a match never picks it. A step
costs cost_s(g) seconds, measured (the draft: its g proposals plus the verification; the suffix:
the verification alone, plus the host's lookups); target-only decoding emits 1 token per
cost_decode. The controller picks

    (s*, g*) = argmax E_s(g) / cost_s(g)   and speculates iff  E_s*(g*) cost_decode / cost_s*(g*)
                                                                  > min_speedup.

Estimates. Per source and position, exponentially weighted successes and trials shrunk towards
a prior, as adaptive.py's equation (2): a row that accepted n of its g_r proposals is a trial
at positions 1..min(n + 1, g_r) and a success at 1..n (rows without proposals are no trial).
The source that ran decays its counts by `memory` (positions past its gamma by the faster
`untried_memory`); the others by `off_memory`, so an unused source's estimate drifts back to
its optimistic prior. A source is on while its own evidence says it pays (decided after its own
steps only; the suffix judged as if every row had a match: the quality of its proposals); the
choice is among the sources that are on. A source that is on but loses to another drifts back
to its prior and may win again on its merits; one that is off comes back only through probes.
A probe: a source unused for its wait (`probe_interval` steps at first) runs once at its best
gamma (the suffix only when some row has a match), and decides on its own measurement, without
the prior: the tokens it emitted per row over its cost. It is on if that beats target-only; its
wait restarts if it also beats the best source that is on, else doubles, up to
`max_probe_interval`. When the source in use turns off, or its expected speedup falls below
half the best it had while in use, the others' waits go back to `probe_interval`. After a
draft update, `forget(DRAFT)` drops the old draft's figures and probes the new one at once.
The draft's first step after others also re-reads what it missed (speculative.resync_draft):
a probe of it costs a little more than it measures.

What it did stays readable: `reason` (one line), `steps` (per source), `acceptance_window`
(accepted over proposed tokens over the last `window` steps of a source), `updates` (draft
updates accepted and rejected, fed by `record_update`), `snapshot()` for engine.stats, and
`SourceCollector` for Prometheus:

    fuser_spec_steps_total{source}              steps per source ("target", "draft", "suffix")
    fuser_spec_acceptance_window{source}        acceptance_window(source), gauge
    fuser_draft_updates_total{result}           "accepted" | "rejected"
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fuser.runtime.adaptive import expected_tokens_per_step

__all__ = ["DRAFT", "SOURCES", "SUFFIX", "TARGET", "Choice", "SourceCollector",
           "SourceController"]

TARGET, DRAFT, SUFFIX = "target", "draft", "suffix"
SOURCES = (TARGET, DRAFT, SUFFIX)
# The others are re-probed when the source in use falls below this share of its best expected
# speedup while in use (or stops paying).
REPROBE_DROP = 0.5


@dataclass(frozen=True)
class Choice:
    """The next step: `source` proposes `gamma` tokens a row (target: gamma 0); `probe`: run
    to re-measure a source, not on its merits; `expected_speedup` over target-only."""

    source: str
    gamma: int
    probe: bool = False
    expected_speedup: float = 1.0


class _Estimate:
    """Per-position acceptance of one source: adaptive.py's equation (2)."""

    def __init__(self, max_gamma: int, prior: float, prior_weight: float) -> None:
        self.prior, self.prior_weight = prior, prior_weight
        self.accepted = [0.0] * max_gamma
        self.trials = [0.0] * max_gamma
        self.alphas = self._estimate()

    def _estimate(self) -> list[float]:
        alphas, prior = [], self.prior
        for a, n in zip(self.accepted, self.trials):
            prior = (a + self.prior_weight * prior) / (n + self.prior_weight)
            alphas.append(prior)
        return alphas

    def decay(self, factor: float, untried_factor: float | None = None,
              gamma: int = 0) -> None:
        """Counts times factor (positions past gamma times untried_factor, if given)."""
        for i in range(len(self.trials)):
            d = untried_factor if untried_factor is not None and i >= gamma else factor
            self.accepted[i] *= d
            self.trials[i] *= d

    def count(self, rows: Iterable[tuple[int, int]]) -> None:
        """rows: (accepted n, proposals g_r) per row with g_r >= 1."""
        for n, g in rows:
            for i in range(min(n + 1, g)):
                self.trials[i] += 1.0
            for i in range(min(n, g)):
                self.accepted[i] += 1.0
        self.alphas = self._estimate()


class SourceController:
    """Chooses target-only, the draft or the suffix index, and gamma, per step.

    Use: `choose(proposal_lengths)` before a step (the suffix index's proposal length per
    generating row, or None without a suffix source); after its read-back,
    `update(choice, num_accepted, proposed)`.

    Args:
        decode_seconds: one target-only step (same batch bucket).
        step_seconds: source ("draft", "suffix") -> gamma -> seconds of one step; a source
            left out is never used.
        prior: optimistic acceptance at position 1 before evidence; one value, or per source.
        prior_weight, memory, untried_memory, off_memory, probe_interval,
            max_probe_interval, min_speedup: as runtime/adaptive.py's GammaController.
        window: steps of a source over which `acceptance_window` is taken.
    """

    def __init__(self, decode_seconds: float, step_seconds: Mapping[str, Mapping[int, float]],
                 *, prior: float | Mapping[str, float] = 0.7, prior_weight: float = 1.0,
                 memory: float = 0.95, untried_memory: float = 0.6, off_memory: float = 0.99,
                 probe_interval: int = 64, max_probe_interval: int = 512,
                 min_speedup: float = 1.0, window: int = 200) -> None:
        if not decode_seconds > 0:
            raise ValueError(f"decode_seconds={decode_seconds!r} must be > 0")
        for source, costs in step_seconds.items():
            if source not in (DRAFT, SUFFIX):
                raise ValueError(f"step_seconds: source {source!r} must be '{DRAFT}' or "
                                 f"'{SUFFIX}'")
            if not costs:
                raise ValueError(f"step_seconds[{source!r}] must give at least one gamma")
            for g, seconds in costs.items():
                if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                    raise ValueError(f"step_seconds[{source!r}] key {g!r} must be a gamma >= 1")
                if not seconds > 0:
                    raise ValueError(f"step_seconds[{source!r}][{g}]={seconds!r} must be > 0")
        priors = prior if isinstance(prior, Mapping) else {s: prior for s in step_seconds}
        for source, value in priors.items():
            if not 0.0 < value <= 1.0:
                raise ValueError(f"prior[{source!r}]={value!r} must be in (0, 1]")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight={prior_weight!r} must be > 0")
        if not 0.0 < memory < 1.0:
            raise ValueError(f"memory={memory!r} must be in (0, 1)")
        if not 0.0 < untried_memory <= memory:
            raise ValueError(f"untried_memory={untried_memory!r} must be in (0, memory={memory}]")
        if not 0.0 < off_memory <= 1.0:
            raise ValueError(f"off_memory={off_memory!r} must be in (0, 1]")
        for name, value in (("probe_interval", probe_interval), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if isinstance(max_probe_interval, bool) or not isinstance(max_probe_interval, int) \
                or max_probe_interval < probe_interval:
            raise ValueError(f"max_probe_interval={max_probe_interval!r} must be an int >= "
                             f"probe_interval={probe_interval}")
        self.decode_seconds = float(decode_seconds)
        self.step_seconds = {s: dict(sorted(c.items())) for s, c in step_seconds.items()}
        self.memory, self.untried_memory, self.off_memory = memory, untried_memory, off_memory
        self.probe_interval, self.max_probe_interval = probe_interval, max_probe_interval
        self.min_speedup = float(min_speedup)
        self.estimates = {s: _Estimate(max(c), priors.get(s, 0.7), prior_weight)
                          for s, c in self.step_seconds.items()}
        self._since = {s: 0 for s in self.step_seconds}  # steps since the source last ran
        self._interval = {s: probe_interval for s in self.step_seconds}
        # On: its own evidence says it pays (decided after its own steps only, so an off
        # source comes back through probes, not through its estimate drifting to the prior).
        self._on = {s: self._best(s, None)[1] > self.min_speedup for s in self.step_seconds}
        self._peak = {s: 0.0 for s in self.step_seconds}  # best expected speedup while in use
        self.steps = {s: 0 for s in SOURCES}
        self._window = {s: deque(maxlen=window) for s in self.step_seconds}
        self.updates = {"accepted": 0, "rejected": 0}
        self.last: Choice = Choice(TARGET, 0)
        self.reason = "no step yet"

    # -- expectations ----------------------------------------------------------------------------

    def alphas(self, source: str) -> list[float]:
        """Acceptance estimates of `source` at positions 1..its largest gamma."""
        return list(self.estimates[source].alphas)

    def expected_tokens(self, source: str, gamma: int,
                        proposal_lengths: Sequence[int] | None = None) -> float:
        """Equation (1) at the current estimates, averaged over the rows (the suffix: each row
        up to its proposal length; 1.0 without rows)."""
        if source == TARGET or gamma == 0:
            return 1.0
        alphas = self.estimates[source].alphas
        if source == DRAFT or proposal_lengths is None:
            return expected_tokens_per_step(alphas, gamma)
        if not proposal_lengths:
            return 1.0
        return sum(expected_tokens_per_step(alphas, min(gamma, max(length, 0)))
                   for length in proposal_lengths) / len(proposal_lengths)

    def expected_speedup(self, source: str, gamma: int,
                         proposal_lengths: Sequence[int] | None = None) -> float:
        """Expected tokens/s of (source, gamma) over target-only tokens/s."""
        if source == TARGET or gamma == 0:
            return 1.0
        tokens = self.expected_tokens(source, gamma, proposal_lengths)
        return tokens * self.decode_seconds / self.step_seconds[source][gamma]

    def _best(self, source: str, lengths: Sequence[int] | None) -> tuple[int, float]:
        """(gamma, expected speedup) of the source's best gamma (smallest on a tie)."""
        g = max(self.step_seconds[source],
                key=lambda g: (self.expected_speedup(source, g, lengths), -g))
        return g, self.expected_speedup(source, g, lengths)

    # -- the choice ------------------------------------------------------------------------------

    def choose(self, proposal_lengths: Sequence[int] | None = None) -> Choice:
        """The next step's source and gamma.

        proposal_lengths: the suffix index's proposal length for each generating row (0: no
        match); None when suffix proposals are not available this step.
        """
        usable = [s for s in self.step_seconds
                  if s != SUFFIX or (proposal_lengths is not None and any(proposal_lengths))]
        lengths = list(proposal_lengths) if proposal_lengths is not None else None
        best = {s: self._best(s, lengths) for s in usable}
        ranked = sorted(best, key=lambda s: best[s][1], reverse=True)
        notes = ", ".join(f"{s}{'' if self._on[s] else ' (off)'} gamma {best[s][0]}: "
                          f"{best[s][1]:.2f}x" for s in ranked)
        merit = [s for s in ranked if self._on[s] and best[s][1] > self.min_speedup]
        due = [s for s in ranked if self._since[s] >= self._interval[s]]
        if due:  # the one unused the longest relative to its wait
            s = max(due, key=lambda s: self._since[s] / self._interval[s])
            choice = Choice(s, best[s][0], True, best[s][1])
            self.reason = (f"probing {s} gamma {choice.gamma} after {self._since[s]} steps "
                           f"without it ({notes})")
        elif merit:
            s = merit[0]
            choice = Choice(s, best[s][0], False, best[s][1])
            tokens = self.expected_tokens(s, choice.gamma, lengths)
            self.reason = (f"{s} gamma {choice.gamma}: {tokens:.2f} tokens/step expected, "
                           f"{choice.expected_speedup:.2f}x target-only ({notes})")
        else:
            choice = Choice(TARGET, 0)
            waits = ", ".join(f"{s} in {max(self._interval[s] - self._since[s], 0)}"
                              for s in self.step_seconds)
            self.reason = (f"target-only: nothing beats it ({notes or 'no source usable'})"
                           + (f"; next probes: {waits} steps" if waits else ""))
        self.last = choice
        return choice

    def update(self, choice: Choice, num_accepted: Sequence[int],
               proposed: Sequence[int] | None = None) -> None:
        """Account for one finished step.

        num_accepted: accepted proposals n of each row that was generating. proposed: how
        many real proposals each row had (the suffix's min(gamma, l_r); default: gamma each,
        the draft's); a row may accept past them (padding that happened to match): counted
        up to them.
        """
        source, gamma = choice.source, choice.gamma
        if source not in SOURCES or (source != TARGET and source not in self.step_seconds):
            raise ValueError(f"source {source!r} is not one of this controller's")
        self.steps[source] += 1
        for s, estimate in self.estimates.items():
            if s == source:
                self._since[s] = 0
                estimate.decay(self.memory, self.untried_memory, gamma)
            else:
                self._since[s] += 1
                estimate.decay(self.off_memory)
                estimate.alphas = estimate._estimate()
        if source == TARGET:
            return
        if proposed is None:
            proposed = [gamma] * len(num_accepted)
        if len(proposed) != len(num_accepted):
            raise ValueError(f"proposed has {len(proposed)} rows, num_accepted "
                             f"{len(num_accepted)}")
        rows = []
        for n, g in zip(num_accepted, proposed):
            if not 0 <= g <= gamma or not 0 <= n <= gamma:
                raise ValueError(f"num_accepted {n} and proposed {g} must be in 0..{gamma}")
            if g:
                rows.append((min(n, g), g))
        self.estimates[source].count(rows)
        self._window[source].append((sum(n for n, _ in rows), sum(g for _, g in rows)))
        if not choice.probe:
            # On or off on the estimates (the suffix as if every row had a match: the quality
            # of its proposals, whatever the availability this step).
            was_on = self._on[source]
            speedup = self._best(source, None)[1]
            self._on[source] = speedup > self.min_speedup
            self._peak[source] = max(self._peak[source], speedup)
            if (was_on and not self._on[source]) or speedup < REPROBE_DROP * self._peak[source]:
                # The source in use stopped paying, or lost much of what it gained (the
                # traffic changed?): the others are probed again soon, not after their
                # backed-off waits.
                self._peak[source] = speedup
                for other in self.step_seconds:
                    if other != source:
                        self._interval[other] = self.probe_interval
            return
        # A probe decides on its own measurement, without the prior: the tokens it emitted
        # per row (rows without proposals: 1) over its cost. It turns the source on if that
        # beats target-only; its wait restarts if it also beats the best source that is on,
        # else doubles.
        emitted = 1.0 + sum(n for n, _ in rows) / max(len(num_accepted), 1)
        measured = emitted * self.decode_seconds / self.step_seconds[source][gamma]
        rivals = [self._best(s, None)[1] for s in self.step_seconds
                  if s != source and self._on[s]]
        self._on[source] = measured > self.min_speedup
        if self._on[source] and measured > max(rivals, default=self.min_speedup):
            self._interval[source] = self.probe_interval
        else:
            self._interval[source] = min(2 * self._interval[source], self.max_probe_interval)

    def forget(self, source: str) -> None:
        """Drop what was measured of `source` (its proposals changed: a new draft was swapped
        in): back to its prior, probed at the next step."""
        estimate = self.estimates[source]
        estimate.decay(0.0)
        estimate.alphas = estimate._estimate()
        self._on[source] = self._best(source, None)[1] > self.min_speedup
        self._interval[source] = self.probe_interval
        self._since[source] = self.probe_interval
        self._peak[source] = 0.0
        self._window[source].clear()

    def record_update(self, accepted: bool) -> None:
        """A draft update ended: its candidate was swapped in (accepted) or dropped."""
        self.updates["accepted" if accepted else "rejected"] += 1

    # -- reading it ------------------------------------------------------------------------------

    def acceptance_window(self, source: str) -> float | None:
        """Accepted over proposed tokens in the source's last `window` steps (None: none)."""
        steps = self._window.get(source)
        if not steps:
            return None
        proposed = sum(g for _, g in steps)
        return sum(n for n, _ in steps) / proposed if proposed else None

    def window_counts(self, source: str) -> tuple[int, int]:
        """(accepted, proposed) tokens in the source's last `window` steps."""
        steps = self._window.get(source) or ()
        return sum(n for n, _ in steps), sum(g for _, g in steps)

    def enabled(self, source: str) -> bool:
        """Whether the source is on (its own evidence says it pays) rather than probed."""
        return self._on[source]

    def may_choose(self, source: str) -> bool:
        """Whether the next step could use `source`: it is on, or its probe is due."""
        return source in self.step_seconds and (
            self._on[source] or self._since[source] >= self._interval[source])

    def snapshot(self) -> dict[str, Any]:
        """What engine.stats shows: the last choice, why, steps and windowed acceptance per
        source, draft updates."""
        return {
            "source": self.last.source, "gamma": self.last.gamma, "probe": self.last.probe,
            "enabled": dict(self._on),
            "reason": self.reason, "steps": dict(self.steps),
            "acceptance_window": {s: self.acceptance_window(s) for s in self.step_seconds},
            "alphas": {s: [round(a, 4) for a in e.alphas] for s, e in self.estimates.items()},
            "draft_updates": dict(self.updates),
        }


class SourceCollector:
    """Prometheus collector of one engine's controllers (one per batch bucket: steps and
    updates summed, windows pooled); register it in the engine's registry
    (runtime/metrics.py SpecMetrics.registry). Needs prometheus_client when collected."""

    def __init__(self, controllers: Callable[[], Iterable[SourceController]],
                 updates: Callable[[], Mapping[str, int]] | None = None) -> None:
        """updates: the draft updates' counts ({"accepted": n, "rejected": m}) where they are
        kept once (a Distiller's); default: the controllers' own, summed."""
        self.controllers = controllers
        self.updates = updates

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        controllers = list(self.controllers())
        steps = CounterMetricFamily("fuser_spec_steps_total", "Decoding steps per source of "
                                    "proposals.", labels=["source"])
        for source in SOURCES:
            steps.add_metric([source], sum(c.steps[source] for c in controllers))
        yield steps
        window = GaugeMetricFamily("fuser_spec_acceptance_window", "Accepted over proposed "
                                   "tokens in each source's recent steps.", labels=["source"])
        for source in (DRAFT, SUFFIX):
            counts = [c.window_counts(source) for c in controllers if source in c.step_seconds]
            proposed = sum(g for _, g in counts)
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
