"""Adaptive draft length (`gamma="auto"`): choose the gamma that maximises expected tokens per
second from measured step costs and the acceptance seen so far, or switch speculation off.

The model. A speculative step at draft length g proposes d_1..d_g; the target accepts a prefix.
Let alpha_i = P(d_i accepted | d_1..d_{i-1} accepted), the conditional acceptance at draft
position i (1-based). The step emits the accepted prefix plus one target token, so

    E[tokens per step at g] = 1 + sum_{j=1..g} prod_{i<=j} alpha_i            (1)

and expected throughput is E(g) / cost(g), with cost(g) the measured seconds of one speculative
step at g (draft catch-up + g - 1 draft decodes + one verify of g + 1 positions). Plain decoding
emits 1 token per cost_decode seconds. The controller picks

    g* = argmax_g E(g) / cost(g),   speculation on  iff  E(g*) * cost_decode / cost(g*) > 1.

For constant alpha, (1) is the geometric sum (1 - alpha^(g+1)) / (1 - alpha); with Leviathan et
al.'s cost model cost(g) = cost_decode * (g c + 1) (c = draft/target step-cost ratio) the ratio
is their expected speedup, `leviathan_speedup` below.

Estimating alpha_i. A row that accepted n of g drafts was a trial at positions 1..min(n+1, g)
and a success at positions 1..n. Per position the controller keeps exponentially weighted
counts, decayed by `memory` every speculative step and by `off_memory` every target-only step:

    A_i <- m A_i + successes_i,   N_i <- m N_i + trials_i
    alpha_i = (A_i + w pi_i) / (N_i + w),   pi_1 = prior,  pi_i = alpha_{i-1}  (i > 1)    (2)

a ratio of exponential moving averages shrunk towards a prior of weight w (pseudo-trials). The
prior of position 1 is an optimistic constant; a deeper position borrows the estimate of the
position before it, so positions never drafted yet look like the deepest one measured. A step at
gamma g says nothing about positions deeper than g: their counts decay by `untried_memory` (faster
than `memory`) each such step, so an estimate that made the controller shorten gamma goes stale
within a few steps, drifts to its prior (the position before it), and the longer gamma is tried
again. Decayed at `memory` instead, a low estimate at position g + 1, never re-measured at
gamma g, kept gamma short for ten steps and more (tests/test_adaptive.py); on the bundled pair's
held-out prompts, where the draft's agreement comes in runs, auto emitted fewer tokens per step
than fixed gamma 2 on the H200 (2.23 against 2.42). While
speculation is off the counts keep decaying, so the estimates drift back to the optimistic prior
and the next probe (one speculative step after `probe_interval` target-only steps) can turn
speculation back on. A probe costs more than its step: the draft first re-reads every token the
target emitted without it. So each probe that leaves speculation off doubles the wait before the
next one, up to `max_probe_interval`; turning speculation on resets it. Everything here is
deterministic and runs on the host between steps.

Overlapped rounds (FuserConfig.overlap, runtime/speculative.py `overlapped_step`). A row that
streams into a round verifies gamma guesses: it emits E_s(g) = (1) tokens on average and streams
on with probability P_s = prod_{i<=g} alpha_i * alpha_g (the bonus token must match the draft's
next guess; alpha_{g+1} is taken as alpha_g). A row that does not stream emits one token and
streams on with probability P_r = alpha_1 (the draft's first guess). The rounds are a two-state
Markov chain; its stationary share of streaming rounds is pi = P_r / (P_r + 1 - P_s), so

    E[tokens per round at g] = pi E_s(g) + (1 - pi)                                     (3)

and cost(g) is the measured overlapped round. Streaming rows update the counts as above;
a row that did not stream is one trial at position 1, a success if it streams on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["GammaController", "expected_tokens_per_round", "expected_tokens_per_step",
           "leviathan_speedup"]


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
    """Equation (3): expected tokens per overlapped round at `gamma`, alphas as in (1)."""
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


class GammaController:
    """Chooses the draft length per step from measured costs and per-position acceptance.

    Use: read `gamma` before issuing a step (0 = a target-only decode step), and after the
    step's read-back call `update(num_accepted_per_row, gamma_used)`. `reason` says why in words.

    Args:
        step_seconds: gamma -> seconds of one speculative step at that gamma, for each gamma the
            engine can run (those it captured graphs for; need not be contiguous).
        decode_seconds: seconds of one target-only decode step (same batch bucket).
        prior: optimistic acceptance assumed at position 1 before (and long after) evidence.
        prior_weight: w in (2), in pseudo-trials.
        memory: count decay per speculative step (evidence half-life ln 2 / -ln(memory) steps).
        untried_memory: count decay per speculative step at the positions deeper than its gamma.
        off_memory: count decay per target-only step, so estimates drift back to the prior.
        probe_interval: while off, one speculative step at the best gamma after this many
            target-only steps; doubled after each probe that leaves speculation off.
        max_probe_interval: the most target-only steps between two probes.
        min_speedup: speculation is on only when the best gamma's expected speedup over
            target-only decoding exceeds this.
        overlapped: the speculative steps are overlapped rounds (equation (3) instead of (1)).
    """

    def __init__(self, step_seconds: Mapping[int, float], decode_seconds: float, *,
                 prior: float = 0.7, prior_weight: float = 1.0, memory: float = 0.95,
                 untried_memory: float = 0.6, off_memory: float = 0.99, probe_interval: int = 64,
                 max_probe_interval: int = 1024, min_speedup: float = 1.0,
                 overlapped: bool = False) -> None:
        if not step_seconds:
            raise ValueError("step_seconds must give the cost of at least one gamma")
        for g, seconds in step_seconds.items():
            if isinstance(g, bool) or not isinstance(g, int) or g < 1:
                raise ValueError(f"step_seconds key {g!r} must be a gamma >= 1")
            if not seconds > 0:
                raise ValueError(f"step_seconds[{g}]={seconds!r} must be > 0")
        if not decode_seconds > 0:
            raise ValueError(f"decode_seconds={decode_seconds!r} must be > 0")
        if not 0.0 < prior <= 1.0:
            raise ValueError(f"prior={prior!r} must be in (0, 1]")
        if not prior_weight > 0:
            raise ValueError(f"prior_weight={prior_weight!r} must be > 0")
        if not 0.0 < memory < 1.0:
            raise ValueError(f"memory={memory!r} must be in (0, 1)")
        if not 0.0 < untried_memory <= memory:
            raise ValueError(f"untried_memory={untried_memory!r} must be in (0, memory={memory}]")
        if not 0.0 < off_memory <= 1.0:
            raise ValueError(f"off_memory={off_memory!r} must be in (0, 1]")
        if isinstance(probe_interval, bool) or not isinstance(probe_interval, int) \
                or probe_interval < 1:
            raise ValueError(f"probe_interval={probe_interval!r} must be an int >= 1")
        if isinstance(max_probe_interval, bool) or not isinstance(max_probe_interval, int) \
                or max_probe_interval < probe_interval:
            raise ValueError(f"max_probe_interval={max_probe_interval!r} must be an int >= "
                             f"probe_interval={probe_interval}")
        self.overlapped = bool(overlapped)
        self.step_seconds = dict(sorted(step_seconds.items()))
        self.decode_seconds = float(decode_seconds)
        self.max_gamma = max(self.step_seconds)
        self.prior, self.prior_weight = float(prior), float(prior_weight)
        self.memory, self.off_memory = float(memory), float(off_memory)
        self.untried_memory = float(untried_memory)
        self.probe_interval = probe_interval
        self.max_probe_interval = max_probe_interval
        self._interval = probe_interval  # the wait before the next probe (backs off)
        self._in_probe = False  # speculation is on (or was tried) because of a probe
        # Plain successes and trials per position since that probe began (no prior, no decay).
        self._probe_accepted = [0] * self.max_gamma
        self._probe_trials = [0] * self.max_gamma
        self.min_speedup = float(min_speedup)
        # Exponentially weighted successes A_i and trials N_i; index i - 1 for position i.
        self._accepted = [0.0] * self.max_gamma
        self._trials = [0.0] * self.max_gamma
        self._steps_off = 0  # target-only steps since the last speculative one
        self._alphas = self._estimate()
        self._best = self._argmax()
        self._on = self.expected_speedup(self._best) > self.min_speedup

    @classmethod
    def from_cost_ratio(cls, c: float, max_gamma: int, **kwargs: float) -> GammaController:
        """Leviathan's cost model: a step at g costs g c + 1 target steps (decode = 1 s)."""
        if not c >= 0:
            raise ValueError(f"c={c!r} must be >= 0")
        costs = {g: g * c + 1.0 for g in range(1, max_gamma + 1)}
        return cls(costs, 1.0, **kwargs)

    # -- estimates ---------------------------------------------------------------------------

    def _estimate(self) -> tuple[float, ...]:
        """Equation (2) at every position, shallowest first (each borrows its prior from the
        one before)."""
        alphas, prior, w = [], self.prior, self.prior_weight
        for a, n in zip(self._accepted, self._trials):
            prior = (a + w * prior) / (n + w)
            alphas.append(prior)
        return tuple(alphas)

    @property
    def alphas(self) -> tuple[float, ...]:
        """Current alpha_i estimates, alphas[i - 1] for draft position i = 1..max_gamma."""
        return self._alphas

    def expected_tokens(self, gamma: int) -> float:
        """Equation (1) at the current estimates, (3) for overlapped rounds (1.0 for gamma 0)."""
        if self.overlapped:
            return expected_tokens_per_round(self._alphas, gamma)
        return expected_tokens_per_step(self._alphas, gamma)

    def expected_speedup(self, gamma: int) -> float:
        """Expected tokens/s at `gamma` over target-only tokens/s:
        E(g) / cost(g) / (1 / cost_decode). 1.0 for gamma 0."""
        if gamma == 0:
            return 1.0
        if gamma not in self.step_seconds:
            raise ValueError(f"gamma={gamma!r} has no measured step cost "
                             f"(measured: {sorted(self.step_seconds)})")
        return self.expected_tokens(gamma) * self.decode_seconds / self.step_seconds[gamma]

    def _argmax(self) -> int:
        """The measured gamma with the highest expected throughput (smallest on a tie)."""
        return max(self.step_seconds, key=lambda g: (self.expected_speedup(g), -g))

    def _probe_pays(self) -> bool:
        """Whether the acceptance seen since the last probe began, alone, makes the best
        gamma beat target-only (a position without trials borrows the one before it)."""
        alphas, alpha = [], 0.0
        for a, n in zip(self._probe_accepted, self._probe_trials):
            alpha = a / n if n else alpha
            alphas.append(alpha)
        g = self._best
        tokens = expected_tokens_per_round if self.overlapped else expected_tokens_per_step
        speedup = tokens(alphas, g) * self.decode_seconds / self.step_seconds[g]
        return speedup > self.min_speedup

    # -- the choice --------------------------------------------------------------------------

    @property
    def probing(self) -> bool:
        """Whether the next step is a probe: speculation is off and a probe is due."""
        return not self._on and self._steps_off >= self._interval

    @property
    def enabled(self) -> bool:
        """Whether speculation is on (probes aside)."""
        return self._on

    @property
    def in_probe(self) -> bool:
        """Whether speculation is on only because a probe turned it on and its own evidence
        has not yet shown that it pays."""
        return self._on and self._in_probe

    @property
    def interval(self) -> int:
        """Target-only steps before the next probe while speculation is off."""
        return self._interval

    @property
    def gamma(self) -> int:
        """The draft length for the next step: 0 = target-only decode.

        With the engine's one-step-ahead pipeline the probe step's update can arrive after the
        next step was issued, so a probe may run twice in a row; that is harmless.
        """
        return self._best if self._on or self.probing else 0

    @property
    def reason(self) -> str:
        """Why `gamma` is what it is, in one line."""
        g, speedup = self._best, self.expected_speedup(self._best)
        if self._on:
            return (f"{'probing ' if self._in_probe else ''}gamma {g}: "
                    f"{self.expected_tokens(g):.2f} tokens/step expected, {speedup:.2f}x target-only")
        if self.probing:
            return (f"probing gamma {g} after {self._steps_off} target-only steps "
                    f"(expects {speedup:.2f}x target-only)")
        return (f"speculation off: best gamma {g} expects {speedup:.2f}x target-only; "
                f"next probe after {self._interval} target-only steps")

    def update(self, num_accepted_per_row: Sequence[int], gamma_used: int,
               restarts: Sequence[bool] = ()) -> None:
        """Account for one finished step.

        num_accepted_per_row: accepted draft tokens n of each row that was generating in that
        step (0 <= n <= gamma_used; ignored for a target-only step); for an overlapped round,
        of each row that streamed into it. gamma_used: the draft length the step ran with, 0
        for a target-only decode step. restarts: an overlapped round's rows that did not
        stream, one trial at position 1 each: whether the draft's first guess was right.
        """
        if isinstance(gamma_used, bool) or not isinstance(gamma_used, int) \
                or not 0 <= gamma_used <= self.max_gamma:
            raise ValueError(f"gamma_used={gamma_used!r} must be an int in 0..{self.max_gamma}")
        was_probe = gamma_used > 0 and self.probing  # (a second, pipelined probe is not)
        if gamma_used == 0:
            decay = self.off_memory
            self._steps_off += 1
        else:
            decay = self.memory
            self._steps_off = 0
        for i in range(self.max_gamma):
            # (a speculative step at gamma_used never reaches positions gamma_used + 1 ...)
            d = self.untried_memory if 0 < gamma_used <= i else decay
            self._accepted[i] *= d
            self._trials[i] *= d
        if gamma_used > 0:
            for n in num_accepted_per_row:
                if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= gamma_used:
                    raise ValueError(f"num_accepted {n!r} must be an int in 0..{gamma_used}")
                # Trial at positions 1..min(n + 1, g); success at positions 1..n.
                for i in range(min(n + 1, gamma_used)):
                    self._trials[i] += 1.0
                for i in range(n):
                    self._accepted[i] += 1.0
            for success in restarts:
                self._trials[0] += 1.0
                self._accepted[0] += float(bool(success))
        self._alphas = self._estimate()
        self._best = self._argmax()
        if gamma_used > 0:
            # On/off changes only on evidence: after a speculative step (a probe included).
            # Between probes the decaying counts only change which gamma the next probe uses.
            if was_probe:
                self._in_probe = True
                self._probe_accepted = [0] * self.max_gamma
                self._probe_trials = [0] * self.max_gamma
            if self._in_probe:
                for n in num_accepted_per_row:
                    for i in range(min(n + 1, gamma_used)):
                        self._probe_trials[i] += 1
                    for i in range(n):
                        self._probe_accepted[i] += 1
                for success in restarts:
                    self._probe_trials[0] += 1
                    self._probe_accepted[0] += int(bool(success))
            self._on = self.expected_speedup(self._best) > self.min_speedup
            if self._in_probe and not self._on:
                # Speculation went off again: the probe found nothing that pays, so wait twice
                # as long before the next one.
                self._interval = min(2 * self._interval, self.max_probe_interval)
                self._in_probe = False
            elif self._in_probe and self._probe_pays():
                # The probe's own evidence (no prior) says speculation pays again: probe at
                # the base rate next time it goes off.
                self._interval = self.probe_interval
                self._in_probe = False
