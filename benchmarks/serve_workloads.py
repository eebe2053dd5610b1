"""The workloads and the arithmetic of benchmarks/serve.py's cases beyond its concurrency levels
(issue #45), kept free of torch, HTTP and the engine so that they are tested in milliseconds:

    shared_prefix_prompts   one system prompt, then each request's own tokens
    mixed_lengths           seeded prompt lengths, uniform in [lo, hi]
    windows                 consecutive windows of a token stream, of given lengths
    poisson_offsets         seeded Poisson arrival times (vLLM's --request-rate)
    search_rate             the highest rate a trial holds: doubling, then bisection
    histogram_delta         a Prometheus histogram's bucket counts between two scrapes
    histogram_quantile      a quantile of such counts (Prometheus's histogram_quantile)
    token_times, gaps_within  when each streamed token arrived; the gaps that end in a window
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

__all__ = ["gaps_within", "histogram_delta", "histogram_quantile", "mixed_lengths",
           "parse_histogram", "poisson_offsets", "search_rate", "shared_prefix_prompts",
           "token_times", "windows"]


def shared_prefix_prompts(system: Sequence[int], own: Sequence[Sequence[int]]) -> list[list[int]]:
    """Every prompt opens with `system`, followed by its own tokens: [system + own[i]]."""
    return [list(system) + list(tokens) for tokens in own]


def mixed_lengths(lo: int, hi: int, count: int, seed: int = 0) -> list[int]:
    """`count` prompt lengths drawn uniformly from [lo, hi] (seeded); the first two are lo and
    hi, so that both ends are always served."""
    if not 1 <= lo <= hi:
        raise ValueError(f"mixed lengths {lo}..{hi}: need 1 <= lo <= hi")
    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(count)]
    for i, end in enumerate((lo, hi)[:count]):
        lengths[i] = end
    return lengths


def windows(stream: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Consecutive windows of `stream` with the given lengths (wrapping round its end)."""
    if not stream:
        raise ValueError("an empty token stream")
    out, at = [], 0
    for length in lengths:
        out.append([stream[(at + i) % len(stream)] for i in range(length)])
        at = (at + length) % len(stream)
    return out


def poisson_offsets(rate: float, count: int, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of `count` requests of a Poisson process of
    `rate` per second: exponential gaps of mean 1 / rate, the first after one gap."""
    if not rate > 0:
        raise ValueError(f"rate {rate} must be > 0")
    rng = random.Random(seed)
    at, out = 0.0, []
    for _ in range(count):
        at += rng.expovariate(rate)
        out.append(at)
    return out


def search_rate(trial: Callable[[float], dict], start: float, most: float, bisections: int
                ) -> dict:
    """The highest request rate `trial(rate)` holds (its result's "held" is true), searched by
    doubling from `start` until a trial fails or `most` is reached, then `bisections` trials
    between the highest held rate and the lowest failed one (0 when even `start` failed).

    -> {"rate": the highest held rate (0.0 if none), "trials": [trial results with their
    "rate"], "capped": whether `most` held (the search stopped there)}."""
    if not 0 < start <= most:
        raise ValueError(f"rates: need 0 < start ({start}) <= most ({most})")
    trials: list[dict] = []

    def run(rate: float) -> bool:
        result = dict(trial(rate))
        result["rate"] = rate
        trials.append(result)
        return bool(result["held"])

    held, failed, rate = 0.0, None, start
    while True:
        if run(rate):
            held = rate
            if rate >= most:
                return {"rate": held, "trials": trials, "capped": True}
            rate = min(2 * rate, most)
        else:
            failed = rate
            break
    for _ in range(bisections):
        rate = (held + failed) / 2
        if run(rate):
            held = rate
        else:
            failed = rate
    return {"rate": held, "trials": trials, "capped": False}


def parse_histogram(text: str, name: str) -> dict[float, float]:
    """{upper bound: cumulative count} of histogram `name`'s _bucket samples in a Prometheus
    exposition (unlabelled apart from le); {} when it is absent. +Inf is math.inf."""
    out: dict[float, float] = {}
    prefix = f"{name}_bucket{{"
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        labels, value = line[len(prefix):].rsplit("} ", 1)
        for label in labels.split(","):
            key, _, raw = label.partition("=")
            if key.strip() == "le":
                bound = raw.strip().strip('"')
                out[math.inf if bound == "+Inf" else float(bound)] = float(value)
    return out


def histogram_delta(before: dict[float, float], after: dict[float, float]) -> dict[float, float]:
    """The observations between two scrapes, per bucket (cumulative, as scraped)."""
    return {le: after[le] - before.get(le, 0.0) for le in sorted(after)}


def histogram_quantile(q: float, buckets: dict[float, float]) -> float:
    """The q-quantile (0..1) of cumulative bucket counts, interpolating linearly inside the
    bucket it falls in (as Prometheus does; the lowest bucket from 0). nan without
    observations; the highest finite bound when it falls in +Inf."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return math.nan
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def token_times(record: dict) -> list[float]:
    """When each token-carrying chunk of a streamed record arrived (seconds from its level's
    start): start + ttft, then each inter-token gap added."""
    at = record["start"] + record["ttft"]
    out = [at]
    for gap in record["itl"]:
        at += gap
        out.append(at)
    return out


def gaps_within(records: Sequence[dict], lo: float, hi: float) -> list[float]:
    """The inter-token gaps of the successful `records` that end inside [lo, hi] (seconds on
    their level's clock): what a stream saw while something else ran then."""
    gaps = []
    for r in records:
        if not r["ok"]:
            continue
        times = token_times(r)
        gaps += [gap for gap, end in zip(r["itl"], times[1:]) if lo <= end <= hi]
    return gaps
