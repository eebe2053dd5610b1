"""runtime/metrics.py: the Prometheus exposition equals the SpecStats the engine counts, over
HTTP too; instances do not clash; shutdown frees the port; the module imports without
prometheus_client.

Each exposition is parsed back with prometheus_client's own parser, never matched as text.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.report import SpecStats


def _count_speculation(stats: SpecStats, n: list[int], was_active: list[bool], gamma: int) -> None:
    """vLLM's counting rule, written out (what generate.py counted before the engine moved to
    runtime/metrics.count_speculation): per active row one draft, gamma draft tokens, n[b]
    accepted, and one accepted token at each position below n[b]."""
    for b, active in enumerate(was_active):
        if not active:
            continue
        stats.num_drafts += 1
        stats.num_draft_tokens += gamma
        stats.num_accepted_tokens += n[b]
        for i in range(n[b]):
            stats.accepted_per_position[i] += 1


prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from fuser.runtime.metrics import SpecMetrics, count_speculation  # noqa: E402

Sample = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str) -> dict[Sample, float]:
    """(sample name, sorted labels) -> value, from a text exposition."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def scrape(port: int) -> dict[Sample, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return parse(response.read().decode("utf-8"))


def expected_samples(stats: SpecStats, positions: int) -> dict[Sample, float]:
    """What SpecStats says each exported sample must be."""
    out = {
        ("fuser_spec_decode_num_drafts_total", ()): stats.num_drafts,
        ("fuser_spec_decode_num_draft_tokens_total", ()): stats.num_draft_tokens,
        ("fuser_spec_decode_num_accepted_tokens_total", ()): stats.num_accepted_tokens,
        ("fuser_generation_tokens_total", ()): stats.num_generated_tokens,
        ("fuser_spec_decode_gamma", ()): stats.gamma,
        ("fuser_spec_decode_enabled", ()): 1 if stats.gamma > 0 else 0,
    }
    for i in range(positions):
        count = stats.accepted_per_position[i] if i < len(stats.accepted_per_position) else 0
        out[("fuser_spec_decode_num_accepted_tokens_per_pos_total", (("position", str(i)),))] \
            = count
    return out


def assert_matches(samples: dict[Sample, float], stats: SpecStats, positions: int) -> None:
    for key, value in expected_samples(stats, positions).items():
        assert samples[key] == value, key
    exported = {k for k in samples if k[0] == "fuser_spec_decode_num_accepted_tokens_per_pos_total"}
    assert len(exported) == positions


# A step: (gamma, [(num_accepted, was_active) per row]).
steps_strategy = st.integers(1, 8).flatmap(lambda max_gamma: st.tuples(
    st.just(max_gamma),
    st.lists(st.integers(1, max_gamma).flatmap(lambda g: st.tuples(
        st.just(g), st.lists(st.tuples(st.integers(0, g), st.booleans()), min_size=1,
                             max_size=8))), max_size=20)))


@given(case=steps_strategy, tokens=st.lists(st.tuples(st.integers(1, 9), st.floats(0, 0.5)),
                                            max_size=10))
@settings(max_examples=50, deadline=None)
def test_exposition_equals_specstats_fed_the_same_steps(case, tokens) -> None:
    max_gamma, steps = case
    metrics = SpecMetrics(max_gamma=max_gamma)
    reference = SpecStats(gamma=max_gamma, accepted_per_position=[0] * max_gamma)
    for gamma, rows in steps:
        n, active = [r[0] for r in rows], [r[1] for r in rows]
        metrics.record_speculation(n, gamma, active)
        _count_speculation(reference, n, active, gamma)  # generate.py's rule
    for count, seconds in tokens:
        metrics.record_tokens(count, seconds)
        reference.num_generated_tokens += count
    metrics.set_gamma(max_gamma)
    samples = parse(metrics.text())
    assert_matches(samples, reference, max_gamma)
    # By hand, too: drafts = active rows; accepted = sum of their n.
    active_rows = [r for _, rows in steps for r in rows if r[1]]
    assert samples[("fuser_spec_decode_num_drafts_total", ())] == len(active_rows)
    assert samples[("fuser_spec_decode_num_accepted_tokens_total", ())] \
        == sum(n for n, _ in active_rows)
    count = sum(c for c, _ in tokens)
    assert samples[("fuser_time_per_output_token_seconds_count", ())] == count
    assert samples[("fuser_time_per_output_token_seconds_sum", ())] \
        == pytest.approx(sum(s for _, s in tokens))


@given(rows=st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=16))
def test_count_speculation_is_generate_rule(rows) -> None:
    ours = SpecStats(accepted_per_position=[0] * 6)
    theirs = SpecStats(accepted_per_position=[0] * 6)
    n, active = [r[0] for r in rows], [r[1] for r in rows]
    count_speculation(ours, n, active, 6)
    _count_speculation(theirs, n, active, 6)
    assert ours == theirs


def test_exports_the_engine_stats_live() -> None:
    """Counting straight into the SpecStats (as generate.py does) shows at the next scrape."""
    stats = SpecStats(gamma=4, accepted_per_position=[0] * 4)
    metrics = SpecMetrics(stats, max_gamma=4)
    _count_speculation(stats, [4, 1, 0], [True, True, False], 4)
    stats.num_generated_tokens += 7
    samples = parse(metrics.text())
    assert_matches(samples, stats, 4)
    assert samples[("fuser_spec_decode_num_accepted_tokens_per_pos_total",
                    (("position", "0"),))] == 2
    assert samples[("fuser_spec_decode_num_accepted_tokens_per_pos_total",
                    (("position", "3"),))] == 1
    stats.gamma = 0  # the adaptive controller switched speculation off
    samples = parse(metrics.text())
    assert samples[("fuser_spec_decode_enabled", ())] == 0
    assert samples[("fuser_spec_decode_gamma", ())] == 0


def test_positions_grow_with_gamma() -> None:
    metrics = SpecMetrics(max_gamma=2)
    metrics.record_speculation([5], 5)  # adaptive gamma went past the first sizing
    samples = parse(metrics.text())
    assert_matches(samples, metrics.stats, 5)


def test_time_per_output_token_histogram() -> None:
    metrics = SpecMetrics(buckets=(0.01, 0.1))
    metrics.record_tokens(4, 0.02)  # 5 ms per token, 4 times
    metrics.record_tokens(1, 0.05)
    samples = parse(metrics.text())
    bucket = "fuser_time_per_output_token_seconds_bucket"
    assert samples[(bucket, (("le", "0.01"),))] == 4
    assert samples[(bucket, (("le", "0.1"),))] == 5
    assert samples[(bucket, (("le", "+Inf"),))] == 5
    assert samples[("fuser_time_per_output_token_seconds_sum", ())] == pytest.approx(0.07)
    assert samples[("fuser_generation_tokens_total", ())] == 5


@settings(max_examples=40, deadline=None, derandomize=True)
@given(steps=st.lists(st.tuples(st.integers(0, 70), st.floats(0.0, 3.0)), max_size=30),
       buckets=st.sampled_from([(0.01, 0.1), (0.001, 0.0025, 0.005, 1.0), (0.5,)]))
def test_a_steps_tokens_observed_at_once_are_prometheus_clients_histogram(steps, buckets) -> None:
    """The time-per-token histogram takes a step's tokens in one call; its buckets, count and
    sum are prometheus_client's Histogram's after one observation per token (values on a
    bucket's bound included)."""
    metrics = SpecMetrics(buckets=buckets)
    registry = prometheus_client.CollectorRegistry()
    reference = prometheus_client.Histogram("fuser_time_per_output_token_seconds", "doc",
                                            buckets=buckets, registry=registry)
    for count, per_token in steps:
        per_token = buckets[count % len(buckets)] if count % 3 == 0 else per_token  # on a bound
        metrics.observe_time_per_output_token(per_token, count)
        for _ in range(count):
            reference.observe(per_token)
    ours, theirs = parse(metrics.text()), parse(prometheus_client.generate_latest(registry)
                                                .decode())
    for (name, labels), value in theirs.items():
        if name.startswith("fuser_time_per_output_token_seconds") and \
                not name.endswith("_created"):
            assert ours[(name, labels)] == pytest.approx(value), (name, labels)


def test_invalid_inputs() -> None:
    metrics = SpecMetrics()
    with pytest.raises(ValueError, match="num_accepted"):
        metrics.record_speculation([3], 2)
    with pytest.raises(ValueError, match="rows"):
        metrics.record_speculation([1, 1], 2, [True])
    with pytest.raises(ValueError):
        metrics.set_gamma(-1)


# -- over HTTP ----------------------------------------------------------------------------------


def test_scraped_over_http_equals_specstats() -> None:
    metrics = SpecMetrics(max_gamma=3)
    reference = SpecStats(gamma=3, accepted_per_position=[0] * 3)
    for n, active in [([3, 0], [True, True]), ([1, 2], [True, False]), ([2], [True])]:
        metrics.record_speculation(n, 3, active)
        _count_speculation(reference, n, active, 3)
    metrics.record_tokens(9, 0.09)
    reference.num_generated_tokens += 9
    metrics.set_gamma(3)
    server = metrics.start_server(0)
    try:
        assert server.addr == "127.0.0.1" and server.port > 0
        samples = scrape(server.port)
        assert_matches(samples, reference, 3)
        assert samples[("fuser_spec_decode_num_drafts_total", ())] == 4
        metrics.record_speculation([1], 3)  # later steps show at the next scrape
        assert scrape(server.port)[("fuser_spec_decode_num_drafts_total", ())] == 5
    finally:
        server.shutdown()


def test_two_instances_do_not_clash() -> None:
    a, b = SpecMetrics(max_gamma=2), SpecMetrics(max_gamma=4)
    a.record_speculation([2, 2], 2)
    b.record_speculation([0], 4)
    with a.start_server(0) as server_a, b.start_server(0) as server_b:
        assert server_a.port != server_b.port
        sa, sb = scrape(server_a.port), scrape(server_b.port)
    assert sa[("fuser_spec_decode_num_drafts_total", ())] == 2
    assert sb[("fuser_spec_decode_num_drafts_total", ())] == 1
    assert_matches(sa, a.stats, 2)
    assert_matches(sb, b.stats, 4)
    # Nothing landed in prometheus_client's global registry.
    glob = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "fuser_" not in glob


def take_port(port: int) -> None:
    """Listen on 127.0.0.1:port, then let go. SO_REUSEADDR lets the bind pass the TIME_WAIT
    entries a closed scrape leaves, but on Linux never a socket still listening there."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()


def test_shutdown_frees_the_port() -> None:
    metrics = SpecMetrics()
    server = metrics.start_server(0)
    port = server.port
    scrape(port)
    if sys.platform == "linux":
        with pytest.raises(OSError):  # the check below can fail: a running exporter holds it
            take_port(port)
    server.shutdown()
    server.shutdown()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
    take_port(port)  # free again
    again = metrics.start_server(port)  # and the exporter can take it back
    try:
        assert again.port == port
        scrape(port)
    finally:
        again.shutdown()


def test_imports_without_prometheus_client() -> None:
    """Blocking prometheus_client: the module imports, counting works, the exporter says what
    to install."""
    code = """
import sys
sys.modules["prometheus_client"] = None  # import prometheus_client now raises ImportError
from fuser.report import SpecStats
from fuser.runtime.metrics import SpecMetrics, count_speculation
stats = SpecStats()
count_speculation(stats, [2], None, 3)
assert stats.num_accepted_tokens == 2 and stats.accepted_per_position == [1, 1, 0]
try:
    SpecMetrics()
except ImportError as e:
    assert "pip install fuser[metrics]" in str(e), e
    print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True,
                            text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
