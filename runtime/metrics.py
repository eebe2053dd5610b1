"""Prometheus metrics of one engine, under vLLM's speculative-decoding names prefixed `fuser_`.

The counters are not a second set of books: a `SpecMetrics` exports the `fuser.SpecStats` it is
given, read at every scrape, so the exposition equals `engine.stats` by construction. What
SpecStats does not hold, the time-per-output-token histogram, lives here. Each instance has its
own `CollectorRegistry` (never prometheus_client's global one), so several engines in one
process do not clash.

    fuser_spec_decode_num_drafts_total                        stats.num_drafts
    fuser_spec_decode_num_draft_tokens_total                  stats.num_draft_tokens
    fuser_spec_decode_num_accepted_tokens_total               stats.num_accepted_tokens
    fuser_spec_decode_num_accepted_tokens_per_pos_total{position="i"}
                                                              stats.accepted_per_position[i]
    fuser_generation_tokens_total                             stats.num_generated_tokens
    fuser_time_per_output_token_seconds (histogram)           record_tokens / observe_...
    fuser_spec_decode_gamma (gauge)                           stats.gamma
    fuser_spec_decode_enabled (gauge, 0 or 1)                 stats.gamma > 0

`SpecStats.reset()` sets the counters back to 0, which Prometheus reads as a counter reset (as
after a restart; `rate()` handles it).

prometheus_client is optional (`pip install fuser[metrics]`): this module imports without it,
and `count_speculation` works without it; `SpecMetrics` raises ImportError.
"""

from __future__ import annotations

import bisect
import copy
import math
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from fuser.report import SpecStats

try:
    import prometheus_client
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, \
        HistogramMetricFamily
    from prometheus_client.utils import floatToGoString
except ImportError:  # the optional extra is not installed
    prometheus_client = None

__all__ = ["MetricsServer", "SpecMetrics", "count_speculation"]

INSTALL_HINT = "pip install fuser[metrics]"

# Seconds per output token: 1 ms (a small model's fused step) to 2.5 s (an eager CPU step).
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1,
                0.25, 0.5, 0.75, 1.0, 2.5)


def _require_prometheus() -> None:
    if prometheus_client is None:
        raise ImportError(f"fuser's Prometheus metrics need prometheus_client: {INSTALL_HINT}")


def count_speculation(stats: SpecStats, num_accepted: Sequence[int],
                      was_active: Sequence[bool] | None, gamma: int) -> None:
    """vLLM's counting rule for one speculative step, into `stats`.

    Per row that was generating: one draft, gamma draft tokens, n accepted tokens, and one
    acceptance at each position i < n (0-based). was_active None means every row was.
    accepted_per_position grows when gamma exceeds its length (adaptive gamma may).
    """
    if was_active is None:
        was_active = [True] * len(num_accepted)
    if len(was_active) != len(num_accepted):
        raise ValueError(f"was_active has {len(was_active)} rows, num_accepted "
                         f"{len(num_accepted)}")
    if len(stats.accepted_per_position) < gamma:
        stats.accepted_per_position.extend([0] * (gamma - len(stats.accepted_per_position)))
    rows_at = [0] * (gamma + 1)  # rows that accepted exactly n, for each n
    for n, active in zip(num_accepted, was_active):
        if not active:
            continue
        if not 0 <= n <= gamma:
            raise ValueError(f"num_accepted {n} must be in 0..{gamma}")
        rows_at[n] += 1
    rows = sum(rows_at)
    stats.num_drafts += rows
    stats.num_draft_tokens += gamma * rows
    stats.num_accepted_tokens += sum(n * k for n, k in enumerate(rows_at))
    beyond = rows  # rows that accepted more than i: an acceptance at position i each
    for i in range(gamma):
        beyond -= rows_at[i]
        if not beyond:
            break
        stats.accepted_per_position[i] += beyond


class _StatsCollector:
    """Yields the SpecStats counters and gauges, read when the registry is scraped
    (a prometheus_client collector: anything with `collect`)."""

    def __init__(self, owner: SpecMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        with self.owner._lock:  # one consistent snapshot against record_* on another thread
            stats = copy.deepcopy(self.owner.stats)
        prefix = "fuser_spec_decode_"
        for name, value, doc in (
            ("num_drafts", stats.num_drafts, "Speculative steps, counted per sequence."),
            ("num_draft_tokens", stats.num_draft_tokens, "Draft tokens proposed."),
            ("num_accepted_tokens", stats.num_accepted_tokens, "Draft tokens accepted."),
        ):
            yield CounterMetricFamily(f"{prefix}{name}_total", doc, value=value)
        per_pos = CounterMetricFamily(f"{prefix}num_accepted_tokens_per_pos_total",
                                      "Draft tokens accepted at each draft position (0-based).",
                                      labels=["position"])
        positions = max(len(stats.accepted_per_position), self.owner.max_gamma)
        for i in range(positions):
            count = stats.accepted_per_position[i] if i < len(stats.accepted_per_position) else 0
            per_pos.add_metric([str(i)], count)
        yield per_pos
        yield CounterMetricFamily("fuser_generation_tokens_total", "Tokens generated.",
                                  value=stats.num_generated_tokens)
        yield GaugeMetricFamily(f"{prefix}gamma", "Draft length in use (0: speculation off).",
                                value=stats.gamma)
        yield GaugeMetricFamily(f"{prefix}enabled", "1 while speculation is on, else 0.",
                                value=1 if stats.gamma > 0 else 0)


class _TokenTimes:
    """fuser_time_per_output_token_seconds: a histogram that takes a step's tokens, which share
    one time per token, in one call (`observe(value, count)`: the bucket and the sum moved by
    `count` at once). prometheus_client's Histogram takes one value a call, ~0.8 us each: 64
    calls a step for 16 rows of speculative steps (tests/test_metrics.py holds the two alike).
    A collector of the registry, read at each scrape."""

    def __init__(self, name: str, doc: str, buckets: Sequence[float]) -> None:
        bounds = sorted(float(b) for b in buckets)
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self.name, self.doc, self.bounds = name, doc, tuple(bounds)
        self._counts = [0] * len(self.bounds)  # per bucket (not cumulative)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float, count: int = 1) -> None:
        at = bisect.bisect_left(self.bounds, value)  # the first bound >= value ("le")
        with self._lock:
            self._counts[at] += count
            self._sum += value * count

    def collect(self) -> Iterator[Any]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip(self.bounds, counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=total)


class SpecMetrics:
    """One engine's metrics in a private registry.

    Args:
        stats: the SpecStats to export (the engine passes `engine.stats`); a fresh one if None.
        max_gamma: positions 0..max_gamma-1 of the per-position counter are always exported
            (at 0 until seen), so the series exist from the first scrape.
        buckets: histogram buckets of fuser_time_per_output_token_seconds.
    """

    def __init__(self, stats: SpecStats | None = None, *, max_gamma: int = 0,
                 buckets: Sequence[float] = TPOT_BUCKETS) -> None:
        _require_prometheus()
        self.stats = stats if stats is not None else SpecStats()
        self.max_gamma = max_gamma
        self._lock = threading.Lock()  # the exporter thread reads while the engine writes
        # auto_describe: the registry learns the collector's names, so a clash raises.
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.registry.register(_StatsCollector(self))
        self._tpot = _TokenTimes("fuser_time_per_output_token_seconds",
                                 "Seconds per generated token.", buckets)
        self.registry.register(self._tpot)

    def record_speculation(self, num_accepted: Sequence[int], gamma: int,
                           was_active: Sequence[bool] | None = None) -> None:
        """One speculative step's read-back: accepted drafts per row (see count_speculation)."""
        with self._lock:
            count_speculation(self.stats, num_accepted, was_active, gamma)

    def record_tokens(self, num_tokens: int, seconds: float) -> None:
        """`num_tokens` tokens generated in `seconds`: counted, and each observed in the
        histogram at seconds / num_tokens."""
        if num_tokens < 0 or seconds < 0:
            raise ValueError(f"num_tokens={num_tokens} and seconds={seconds} must be >= 0")
        with self._lock:
            self.stats.num_generated_tokens += num_tokens
            self.stats.generate_seconds += seconds
        self.observe_time_per_output_token(seconds / num_tokens if num_tokens else 0.0,
                                           num_tokens)

    def observe_time_per_output_token(self, seconds: float, count: int = 1) -> None:
        """Histogram only (for an engine that counts tokens into its stats itself): `count`
        tokens, each at `seconds`."""
        if count > 0:
            self._tpot.observe(seconds, count)

    def set_gamma(self, gamma: int) -> None:
        """The draft length now in use; 0 = speculation off (fuser_spec_decode_enabled 0)."""
        if gamma < 0:
            raise ValueError(f"gamma={gamma} must be >= 0")
        self.stats.gamma = gamma

    def text(self) -> str:
        """Prometheus text exposition of this instance's registry."""
        return prometheus_client.generate_latest(self.registry).decode("utf-8")

    def start_server(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve `text()` over HTTP at addr:port (port 0: a free port, see `.port`)."""
        server, thread = prometheus_client.start_http_server(port, addr=addr,
                                                              registry=self.registry)
        return MetricsServer(server, thread)


class MetricsServer:
    """A running exporter; `shutdown()` stops it and frees the port (also on `with` exit)."""

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread
        self.addr, self.port = server.server_address[:2]

    def shutdown(self) -> None:
        """Stop serving, close the socket, join the thread. Idempotent."""
        if self._server is None:
            return
        self._server.shutdown()  # ends serve_forever
        self._server.server_close()  # releases the port
        self._thread.join(timeout=5.0)
        self._server = None

    def __enter__(self) -> MetricsServer:  # noqa: PYI034 (Self needs Python 3.11)
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
