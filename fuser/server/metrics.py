"""The serving metrics of `fuser serve`, under vLLM's names prefixed `fuser_` (API.md, Serving).

    fuser_num_requests_running (gauge)          scheduler.num_running, read at scrape
    fuser_num_requests_waiting (gauge)          scheduler.num_waiting, read at scrape
    fuser_kv_slots_used (gauge)                 scheduler.slots_used, read at scrape
    fuser_time_to_first_token_seconds           histogram, per request
    fuser_e2e_request_latency_seconds           histogram, per request
    fuser_time_per_output_token_seconds         histogram, per request: (finish - first token)
                                                / (tokens - 1); only where the engine does not
                                                export it already
    fuser_prompt_tokens_total                   counter, per admitted request
    fuser_generation_tokens_total               counter; only where the engine does not export it
    fuser_request_success_total{finished_reason}  counter: "stop", "length", "abort"
    fuser_gpu_memory_used_bytes{gpu}            gauge, NVML, read at scrape (gpu_metrics.py;
    fuser_gpu_utilization_perc{gpu}             absent without nvidia-ml-py or a GPU)
    fuser_kv_cache_usage_perc (gauge)           scheduler.kv_cache_usage (0..1: a paged
                                                cache's blocks in use, else its rows)
    fuser_prefix_cache_queries_total            counter, prompt tokens looked up in the prefix
    fuser_prefix_cache_hits_total               cache and those found (paged; else 0)

`/metrics` serves the engine's exposition (`engine.metrics_text()`) followed by this one's, so
a name the engine exports is left out here: one exposition, no name twice. Private
CollectorRegistry, as the engine's, so several servers in one process do not clash.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fuser.server.gpu_metrics import GpuCollector

# Seconds: TTFT and end-to-end latency span a CPU test's milliseconds to a long request's minutes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
               40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25,
                0.5, 0.75, 1.0, 2.5)
FINISH_REASONS = ("stop", "length", "abort")

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST


def exported_names(text: str) -> set[str]:
    """Sample names in a Prometheus text exposition (`name{labels} value` or `name value`)."""
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{|\s)", text, flags=re.MULTILINE))


class _Collector:
    """Counters and scheduler gauges, read at every scrape."""

    def __init__(self, owner: ServingMetrics) -> None:
        self.owner = owner

    def collect(self) -> Iterator[Any]:
        owner = self.owner
        scheduler = owner.scheduler()
        for name, attribute, doc in (
                ("fuser_num_requests_running", "num_running", "Requests in the running batch."),
                ("fuser_num_requests_waiting", "num_waiting", "Requests waiting for a slot."),
                ("fuser_kv_slots_used", "slots_used", "KV-cache rows (slots) in use.")):
            value = getattr(scheduler, attribute, 0) if scheduler is not None else 0
            yield GaugeMetricFamily(name, doc, value=value)
        yield from kv_cache_metrics(scheduler)
        with owner.lock:
            prompt, generated = owner.prompt_tokens, owner.generation_tokens
            finished = dict(owner.finished)
        yield CounterMetricFamily("fuser_prompt_tokens_total", "Prompt tokens of admitted requests.",
                                  value=prompt)
        if owner.count_generation:
            yield CounterMetricFamily("fuser_generation_tokens_total", "Tokens generated.",
                                      value=generated)
        success = CounterMetricFamily("fuser_request_success_total",
                                      "Finished requests by finish reason.",
                                      labels=["finished_reason"])
        for reason in sorted(set(FINISH_REASONS) | set(finished)):
            success.add_metric([reason], finished.get(reason, 0))
        yield success


def kv_cache_metrics(scheduler: object | None) -> Iterator[Any]:
    """The KV cache's gauge and the prefix cache's counters (vLLM's kv_cache_usage_perc,
    prefix_cache_queries, prefix_cache_hits), read from the scheduler at scrape time."""
    usage = getattr(scheduler, "kv_cache_usage", 0.0) if scheduler is not None else 0.0
    yield GaugeMetricFamily("fuser_kv_cache_usage_perc",
                            "Fraction of the KV cache in use (paged: blocks; else rows), 0..1.",
                            value=usage)
    blocks = getattr(scheduler, "blocks", None)
    for name, attribute, doc in (
            ("fuser_prefix_cache_queries_total", "prefix_queries",
             "Prompt tokens looked up in the prefix cache."),
            ("fuser_prefix_cache_hits_total", "prefix_hits",
             "Prompt tokens found in the prefix cache (not prefilled again).")):
        yield CounterMetricFamily(name, doc, value=getattr(blocks, attribute, 0))


class ServingMetrics:
    """The server's metrics. `scheduler` is a callable returning the scheduler (or None while
    loading); `engine_text` returns the engine's exposition ("" without an engine)."""

    def __init__(self, scheduler: Callable[[], object | None],
                 engine_text: Callable[[], str] = lambda: "") -> None:
        self.scheduler = scheduler
        self.engine_text = engine_text
        self.lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self._engine_names: set[str] | None = None
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))
        self.registry.register(GpuCollector())
        self._ttft = prometheus_client.Histogram(
            "fuser_time_to_first_token_seconds", "Seconds from arrival to the first token.",
            buckets=TTFT_BUCKETS, registry=self.registry)
        self._e2e = prometheus_client.Histogram(
            "fuser_e2e_request_latency_seconds", "Seconds from arrival to the last token.",
            buckets=E2E_BUCKETS, registry=self.registry)
        self._tpot: prometheus_client.Histogram | None = None

    def bind_engine(self, engine_text: Callable[[], str]) -> None:
        """Serve with the engine's exposition (once it is loaded): the names it exports are
        left out of ours."""
        self.engine_text = engine_text
        names = exported_names(engine_text())
        with self.lock:
            self._engine_names = names
            if "fuser_time_per_output_token_seconds_count" not in names and self._tpot is None:
                self._tpot = prometheus_client.Histogram(
                    "fuser_time_per_output_token_seconds", "Seconds per output token after the "
                    "first, per request.", buckets=TPOT_BUCKETS, registry=self.registry)

    @property
    def count_generation(self) -> bool:
        return self._engine_names is None or "fuser_generation_tokens_total" not in self._engine_names

    def admitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens

    def finished_request(self, reason: str, generated: int, arrival: float | None,
                         first_token: float | None, finish: float | None) -> None:
        """One request's end: its finish reason, tokens and (perf_counter) times."""
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.generation_tokens += generated
        if arrival is None:
            return
        if first_token is not None:
            self._ttft.observe(max(0.0, first_token - arrival))
        if finish is not None:
            self._e2e.observe(max(0.0, finish - arrival))
            if self._tpot is not None and first_token is not None and generated > 1:
                self._tpot.observe(max(0.0, finish - first_token) / (generated - 1))

    def text(self) -> str:
        """The engine's exposition, then the serving metrics: one Prometheus text document."""
        ours = prometheus_client.generate_latest(self.registry).decode("utf-8")
        engine = self.engine_text()
        if engine and not engine.endswith("\n"):
            engine += "\n"
        return engine + ours
