"""benchmarks/serve_workloads.py: the workloads and arithmetic of serve.py's issue-#45 cases
(shared-prefix and mixed prompts, Poisson arrivals, the rate search, Prometheus histograms,
token gaps inside a window). Pure Python, milliseconds."""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve_workloads as w  # noqa: E402


def test_shared_prefix_prompts_open_with_the_system_prompt() -> None:
    prompts = w.shared_prefix_prompts([1, 2, 3], [[7, 8], [9]])
    assert prompts == [[1, 2, 3, 7, 8], [1, 2, 3, 9]]


@settings(max_examples=50, deadline=None, derandomize=True)
@given(lo=st.integers(1, 100), span=st.integers(0, 3000), count=st.integers(1, 300),
       seed=st.integers(0, 5))
def test_mixed_lengths_span_the_range(lo: int, span: int, count: int, seed: int) -> None:
    hi = lo + span
    lengths = w.mixed_lengths(lo, hi, count, seed)
    assert len(lengths) == count and all(lo <= n <= hi for n in lengths)
    assert lengths[:2] == [lo, hi][:count]  # both ends served
    assert lengths == w.mixed_lengths(lo, hi, count, seed)  # seeded


def test_mixed_lengths_refuse_an_empty_range() -> None:
    with pytest.raises(ValueError, match="64..32"):
        w.mixed_lengths(64, 32, 4)


def test_windows_are_consecutive_and_wrap() -> None:
    assert w.windows([0, 1, 2, 3, 4], [2, 2, 3]) == [[0, 1], [2, 3], [4, 0, 1]]
    with pytest.raises(ValueError):
        w.windows([], [1])


def test_poisson_offsets_have_the_rate() -> None:
    offsets = w.poisson_offsets(200.0, 20000, seed=1)
    gaps = [b - a for a, b in zip([0.0] + offsets, offsets)]
    assert all(g > 0 for g in gaps)
    assert len(offsets) / offsets[-1] == pytest.approx(200.0, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(statistics.fmean(gaps), rel=0.05)
    assert offsets == w.poisson_offsets(200.0, 20000, seed=1)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(capacity=st.floats(0.5, 5000.0), start=st.floats(1.0, 64.0),
       bisections=st.integers(0, 6))
def test_search_rate_brackets_a_threshold(capacity: float, start: float, bisections: int) -> None:
    """A server that holds every rate up to `capacity`: the search's answer is held, below the
    capacity, and within the bisection's resolution of it."""
    most = 4096.0
    found = w.search_rate(lambda rate: {"held": rate <= capacity}, start, most, bisections)
    rates = [t["rate"] for t in found["trials"]]
    assert found["rate"] <= capacity
    assert all(t["held"] == (t["rate"] <= capacity) for t in found["trials"])
    if capacity >= most:
        assert found["capped"] and found["rate"] == most
        return
    failed = min(r for r in rates if r > capacity)
    # doubling ends with a bracket [last held (or 0), first failed]; each bisection halves it
    first = next(i for i, t in enumerate(found["trials"]) if not t["held"])
    assert rates[:first] == [min(start * 2 ** i, most) for i in range(first)]
    bracket = rates[first] - (rates[first - 1] if first else 0.0)
    assert failed - found["rate"] <= bracket / 2 ** bisections + 1e-9
    assert len(found["trials"]) == first + 1 + bisections
    assert len(rates) == len(set(rates))  # no rate tried twice


def test_search_rate_doubles_then_bisects() -> None:
    found = w.search_rate(lambda rate: {"held": rate <= 100, "x": 1}, 16, 1000, 2)
    assert [t["rate"] for t in found["trials"]] == [16, 32, 64, 128, 96, 112]
    assert found["rate"] == 96 and not found["capped"]
    assert all(t["x"] == 1 for t in found["trials"])  # the trial's figures are kept
    none = w.search_rate(lambda rate: {"held": False}, 16, 1000, 2)
    assert [t["rate"] for t in none["trials"]] == [16, 8, 4] and none["rate"] == 0.0


EXPOSITION = """# HELP fuser_time_to_first_token_seconds Seconds from arrival to the first token.
# TYPE fuser_time_to_first_token_seconds histogram
fuser_time_to_first_token_seconds_bucket{le="0.1"} 10.0
fuser_time_to_first_token_seconds_bucket{le="0.5"} 30.0
fuser_time_to_first_token_seconds_bucket{le="1.0"} 39.0
fuser_time_to_first_token_seconds_bucket{le="+Inf"} 40.0
fuser_time_to_first_token_seconds_count 40.0
fuser_e2e_request_latency_seconds_bucket{le="0.1"} 99.0
"""


def test_parse_histogram_and_delta() -> None:
    after = w.parse_histogram(EXPOSITION, "fuser_time_to_first_token_seconds")
    assert after == {0.1: 10.0, 0.5: 30.0, 1.0: 39.0, math.inf: 40.0}
    before = {0.1: 5.0, 0.5: 5.0, 1.0: 5.0, math.inf: 5.0}
    assert w.histogram_delta(before, after) == {0.1: 5.0, 0.5: 25.0, 1.0: 34.0,
                                                 math.inf: 35.0}
    assert w.parse_histogram(EXPOSITION, "absent") == {}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 10.0, 0.5: 30.0, 1.0: 39.0, math.inf: 40.0}
    assert w.histogram_quantile(0.25, buckets) == pytest.approx(0.1)  # rank 10: the first bound
    assert w.histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.4 * 10 / 20)
    assert w.histogram_quantile(0.125, buckets) == pytest.approx(0.05)  # from 0 in the first
    assert w.histogram_quantile(0.99, buckets) == 1.0  # in +Inf: the highest finite bound
    assert math.isnan(w.histogram_quantile(0.5, {1.0: 0.0, math.inf: 0.0}))


def test_gaps_within_a_window() -> None:
    records = [{"ok": True, "start": 1.0, "ttft": 0.5, "itl": [0.5, 0.5, 2.0]},  # at 1.5 2 2.5 4.5
               {"ok": False, "start": 0.0, "ttft": 0.0, "itl": [3.0]},
               {"ok": True, "start": 2.0, "ttft": 0.1, "itl": [1.0]}]  # at 2.1, 3.1
    assert w.token_times(records[0]) == [1.5, 2.0, 2.5, 4.5]
    assert sorted(w.gaps_within(records, 2.2, 4.5)) == [0.5, 1.0, 2.0]
    assert w.gaps_within(records, 5.0, 6.0) == []
