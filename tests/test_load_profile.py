"""fuser/load_profile.py and the load's breakdown: each step's first run timed (and run again
with FUSER_LOAD_PROFILE=1), each captured graph's parts, and the kernel work counted through
Triton's hooks and around Inductor's methods, which are all put back afterwards."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import fuser
from fuser import load_profile
from fuser.build import warm_up, warm_up_lengths
from fuser.runtime.step_graphs import Bucket
from tiny import tiny_model

CPU = torch.device("cpu")


def test_step_times_time_each_run_and_run_again_when_asked() -> None:
    calls: list[str] = []
    times = load_profile.StepTimes(CPU, again=True)
    times("a", lambda: calls.append("a"))
    times("b", lambda: calls.append("b"))
    assert calls == ["a", "a", "b", "b"]  # each run twice: first, then again
    assert sorted(times.first) == sorted(times.second) == ["a", "b"]
    line = times.line("first run by step:", top=1)
    assert line.startswith("first run by step:") and "(again " in line and "1 more" in line
    once = load_profile.StepTimes(CPU)
    once("a", lambda: calls.append("c"))
    assert calls[-1] == "c" and calls.count("c") == 1 and not once.second


def test_profile_is_asked_for_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(load_profile.ENV, raising=False)
    assert not load_profile.enabled() and not load_profile.python_enabled()
    monkeypatch.setenv(load_profile.ENV, "1")
    assert load_profile.enabled() and not load_profile.python_enabled()
    monkeypatch.setenv(load_profile.ENV, "python")
    assert load_profile.enabled() and load_profile.python_enabled()
    monkeypatch.setenv(load_profile.ENV, "0")
    assert not load_profile.enabled() and not load_profile.python_enabled()
    with load_profile.kernel_work(CPU, on=True) as work:  # nothing to count off CUDA
        assert work is None


def test_kernel_work_counts_through_hooks_and_puts_them_back() -> None:
    """Triton's compilation listener (a previous one still called) and kernel-load hooks, and
    Inductor's precompile and autotuning methods: counted while entered, as before after."""
    from triton import knobs
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    heard: list[bool] = []

    def previous(*, src: object, metadata: dict, metadata_group: dict, times: object,
                 cache_hit: bool) -> None:
        heard.append(cache_hit)

    benchmark = CachingAutotuner.benchmark_all_configs
    old_listener = knobs.compilation.listener
    knobs.compilation.listener = previous
    try:
        with load_profile.KernelWork() as work:
            times = SimpleNamespace(ir_initialization=1500, lowering_stages=[("ttir", 500)],
                                    store_results=0)
            for hit in (True, True, False):
                knobs.compilation.listener(src=None, metadata={}, metadata_group={},
                                           times=times, cache_hit=hit)
            knobs.runtime.kernel_load_start_hook(None, None, "k", {}, "h")
            knobs.runtime.kernel_load_end_hook(None, None, "k", {}, "h")
            assert CachingAutotuner.benchmark_all_configs is not benchmark
            with pytest.raises(Exception):  # noqa: B017 -- not a tuner: the call fails, counted
                CachingAutotuner.benchmark_all_configs(object())
        assert heard == [True, True, False]
        assert work.counts == {"triton lookups": 2, "triton compiles": 1, "modules loaded": 1,
                               "autotuning benchmarks": 1}
        assert work.seconds["triton lookups"] == pytest.approx(0.004)
        assert "triton compiles 1 in" in work.line()
        assert knobs.compilation.listener is previous
        assert CachingAutotuner.benchmark_all_configs is benchmark
        assert not knobs.runtime.kernel_load_start_hook.calls
        assert not knobs.runtime.kernel_load_end_hook.calls
    finally:
        knobs.compilation.listener = old_listener


def _busy_for(seconds: float) -> None:
    import time

    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_python_profile_names_where_the_seconds_went() -> None:
    """load_profile.python_profile: off, nothing profiled and no line; on, one line whose
    cumulative part names the function that took the stretch's seconds (module bodies and the
    import machinery left out), whose own part names where they were spent, and whose callers
    part where the slowest of those was called from."""
    with load_profile.python_profile(False) as lines:
        _busy_for(0.01)
    assert lines == []
    with load_profile.python_profile(True) as lines:
        _busy_for(0.2)
        import importlib
        importlib.import_module("json")  # (already imported: the import machinery, skipped)
        compile("x = 1\n" * 1000, "/some/where/site-packages/pkg/mod.py", "exec")
        compile("y = 2\n", "/tmp/generated/abc.py", "exec")
    assert len(lines) == 1 and lines[0].startswith("cumulative: "), lines
    cumulative, rest = lines[0].split("; own: ")
    own, rest = rest.split("; callers: ")
    callers, compiled = rest.split("; compiled from source: ")
    # (what the profile's thread compiled, by package: site-packages' by its top package)
    assert compiled.startswith("2 files (0.0 MB); by where: pkg 1 (0.0 MB), /tmp/generated 1 "), \
        lines
    with load_profile.python_profile(False):
        compile("z = 3\n", "/tmp/not/seen.py", "exec")  # (no profile: nothing kept)
    assert load_profile._compiled is None
    assert "(_busy_for)" in cumulative.split(", ")[0], lines
    ranked = f"{cumulative}; {own}"  # (the callers may name them: where a call came from)
    assert "<module>" not in ranked and "import_module" not in ranked, lines
    assert "perf_counter" in own or "_busy_for" in own, lines
    # (perf_counter's own seconds were spent where _busy_for called it; _busy_for's caller
    # began before the profile did: cProfile saw none)
    timer = next(c for c in callers.split("; ") if "perf_counter" in c.split(" from ")[0])
    assert "(_busy_for) " in timer.split(" from ")[1], lines


def test_warm_up_names_every_step_and_length() -> None:
    """`warm_up(steps, timed)` hands every step at each of its warm-up lengths to `timed`, by
    the step's name and T, and runs it there."""
    config = fuser.FuserConfig(max_batch_size=1, max_seq_len=32, compile="fx",
                               cuda_graphs=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = fuser.optimize(tiny_model("llama", seed=0), config=config)
    steps = engine.target
    ran: list[str] = []
    warm_up(steps, lambda name, run: (ran.append(name), run()))
    want = [f"{g.name} T={T}" for kind, g in steps.steps.items()
            for T in warm_up_lengths(kind, steps.cache.slots, CPU)]
    assert ran == want and len(set(ran)) == len(ran)
    assert int(steps.cache.seq_lens.sum()) == 0  # reset afterwards, as without `timed`


def test_capture_line_lists_graphs_slowest_first() -> None:
    bucket = Bucket.__new__(Bucket)
    bucket.capture_seconds = {
        "plain.greedy": {"total": 0.2, "warm-up": 0.15, "warm-up run 1": 0.1,
                         "warm-up run 2": 0.05, "capture": 0.04, "first replay": 0.01},
        "gamma4.greedy": {"total": 0.9, "warm-up": 0.8, "capture": 0.1},
    }
    line = bucket.capture_line()
    assert line.index("gamma4.greedy 0.90 s") < line.index("plain.greedy 0.20 s")
    assert "warm-up 0.15 = 0.10 + 0.05, capture 0.04, first replay 0.01" in line


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_load_prints_where_its_time_goes(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA, FUSER_LOAD_PROFILE=python: the load's log names each step's first run (and its
    second), the kernel work of the code load and first run, where the code load's Python
    seconds went, and bucket 1's graphs part by part."""
    from test_engine_load_compiles_nothing import build_saved_cuda_engine

    build_saved_cuda_engine(tmp_path / "engine")
    monkeypatch.setenv(load_profile.ENV, "python")
    lines: list[str] = []
    engine = fuser.load(tmp_path / "engine", log=lines.append, wait_for_graphs=True)
    text = "\n".join(lines)
    assert "first run by step:" in text and "target.decode T=1" in text and "(again " in text
    assert "kernel work in the first run:" in text and "kernel work in the code load:" in text
    # (the code load's own function is among the 10 slowest on CPU, not on CUDA, where
    # Inductor's and Triton's functions take the places: test_engine_load_compiles_nothing)
    assert "code load, Python: cumulative: " in text and "; own: " in text
    assert "before the reading, alone to profile it" in text
    assert "capture of bucket 1 by graph: " in text and "plain.greedy" in text
    assert "first replay" in text
    for bucket in engine.buckets.values():
        for parts in bucket.capture_seconds.values():
            assert parts["total"] >= parts["warm-up"] + parts["capture"] - 1e-6
    assert json.dumps(engine.load_timings)  # plain numbers


def test_tritons_key_is_primed_for_cuda_loads_only() -> None:
    """A CUDA load computes Triton's key (a hash of its 500 MB library) on a thread beside the
    reading (fuser/kernel_store.py `prime_triton_key`); a CPU load leaves it alone."""
    from triton.runtime.cache import triton_key

    from fuser import kernel_store

    triton_key.cache_clear()
    kernel_store.prime_triton_key(CPU)
    assert triton_key.cache_info().currsize == 0
    kernel_store.prime_triton_key(torch.device("cuda"))  # (a device name: no GPU needed)
    assert triton_key.cache_info().currsize == 1
