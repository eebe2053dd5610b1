"""Prefill and chunk graphs captured while the scheduler is idle, never on a request's path
(runtime/idle_capture.py, runtime/prefill_graphs.py `defer`, runtime/scheduler.py).

On the CPU a stand-in graph (tests/engines.py `RunningGraph`: runs the step when "captured" and
at each call) records where each capture happened; on CUDA the real captures are watched.
"""

from __future__ import annotations

import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

import fuser
from fuser import Scheduler
from fuser.runtime import prefill_graphs, scheduler as scheduler_module
from fuser.runtime.idle_capture import IdleCaptures
from fuser.runtime.prefill_graphs import DEFER_RUNS, MAX_LONG_GRAPHS, ChunkGraphs, PrefillGraphs
from engines import RunningGraph, greedy, llama_target, paged_engine, perturbed, prompt

TIMEOUT = 120.0

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def fake_graphs(T: int = 10**6, batch: int = 1, kind: type = PrefillGraphs) -> PrefillGraphs:
    """Graphs over a stand-in model whose captures are recorded, not made."""
    cache = SimpleNamespace(slots=T, seq_lens=torch.zeros(batch, dtype=torch.long),
                            starts=None, batch_size=batch)
    graphs = kind(SimpleNamespace(cache=cache, role="target"), pool=None)
    graphs._capture = lambda length: graphs.graphs.setdefault(length, _Step(length))
    return graphs


class _Step:
    def __init__(self, T: int) -> None:
        self.T, self.replays = T, 0

    def __call__(self, *args: object) -> int:
        self.replays += 1
        return self.T


def run(graphs: PrefillGraphs, T: int) -> object:
    return graphs.run(torch.zeros(1, T), torch.zeros(1, T), torch.zeros(1, dtype=torch.long))


def test_deferred_lengths_wait_for_capture_now() -> None:
    """With `defer`, a captured length without its graph is not captured by `run` (the
    caller's path): it waits in `pending`, and `capture_now` captures it; without, `run`
    captures it at once."""
    graphs = fake_graphs()
    graphs.defer = True
    ran: list[int] = []
    graphs.model.run = lambda kind, tokens, positions: ran.append(tokens.shape[1]) or \
        torch.zeros(1, tokens.shape[1], 3)
    for T in (64, 32, 64):
        run(graphs, T)
    assert ran == [64, 32, 64] and graphs.graphs == {}
    assert list(graphs.pending) == [32, 64] and graphs.deferred_runs == 3  # (recent last)
    assert graphs.capture_now(64) and list(graphs.pending) == [32]
    assert not graphs.capture_now(64)  # (captured already)
    assert not graphs.capture_now(33)  # (not a captured length)
    assert run(graphs, 64) == 64 and graphs.graphs[64].replays == 1 and ran == [64, 32, 64]
    graphs.defer = False
    assert run(graphs, 96) == 96  # captured on the caller's path
    assert (graphs.captured_on_path, graphs.captured_idle) == (1, 1)
    # Long lengths: no more wait than are kept captured (MAX_LONG_GRAPHS, the most recent).
    graphs.defer = True
    for T in (1024, 1152, 1280, 32, 1408, 1536, 1664):
        run(graphs, T)
    assert list(graphs.pending) == [1280, 32, 1408, 1536, 1664] and MAX_LONG_GRAPHS == 4


def test_a_length_deferred_again_and_again_is_captured_on_the_path() -> None:
    """A server that never idles never runs `capture_now`: a length runs uncaptured at most
    DEFER_RUNS times, then its next run captures it on the caller's path (and it leaves
    `pending`)."""
    graphs = fake_graphs()
    graphs.defer = True
    graphs.model.run = lambda kind, tokens, positions: torch.zeros(1, tokens.shape[1], 3)
    for _ in range(DEFER_RUNS):
        run(graphs, 64)
    assert graphs.graphs == {} and graphs.deferred_runs == DEFER_RUNS
    assert run(graphs, 64) == 64 and graphs.captured_on_path == 1 and not graphs.pending
    assert run(graphs, 64) == 64 and graphs.graphs[64].replays == 2


def test_the_plan_takes_bucket_one_and_a_bursts_bucket_first() -> None:
    """`plan_likely`: at each captured length up to 512, bucket 1 and the largest bucket of
    at most 2048 // T rows (a burst the scheduler prefills together), prefills and then
    chunks; then the buckets between, likewise."""
    sizes = (1, 2, 4, 8, 16, 32, 64)
    buckets = {b: SimpleNamespace(prefills=[fake_graphs(batch=b), fake_graphs(batch=b),
                                            fake_graphs(batch=b, kind=ChunkGraphs)])
               for b in sizes}
    queue = IdleCaptures(g for b in buckets.values() for g in b.prefills)
    count = queue.plan_likely(buckets, prefill_tokens=2048, seconds=5.0)
    plan = [(g.kind.name, g.model.cache.batch_size, T) for g, T in queue.plan]
    assert count == len(plan) == len(set(plan)) + count // 3  # (two prefill graph sets)
    first = plan[:16 * 2 * 3]  # 16 lengths, 2 buckets (a burst's is never 1 here), 3 sets
    assert first[:4] == [("prefill", 1, 32), ("prefill", 1, 32), ("prefill", 64, 32),
                         ("prefill", 64, 32)]
    assert {("prefill", 16, 128), ("prefill", 4, 512), ("chunk", 8, 256)} <= set(first)
    assert ("prefill", 8, 128) not in first and ("prefill", 8, 128) in plan
    kinds = [k for k, _, _ in first]
    assert kinds == sorted(kinds, key=lambda k: k != "prefill")  # prefills first
    # every bucket of a group that fits the budget, and no other
    assert {(b, T) for _, b, T in plan} == {(b, T) for b in sizes for T in range(32, 513, 32)
                                            if b == 1 or b * T <= 2048}
    assert queue.plan_likely(buckets, 2048, seconds=0) == 0 and not queue.planned()


def install_recorded_graphs(monkeypatch: pytest.MonkeyPatch, eng: fuser.Engine,
                            sched: list[Scheduler]) -> list[tuple[bool, int]]:
    """Every bucket's prefills and chunks through stand-in graphs; each capture records
    (whether the scheduler `sched[0]` was capturing while idle with its rows' lengths at 0,
    where the warm-up writes nothing a request holds; its running rows then)."""
    made: list[tuple[bool, int]] = []

    class Recorded(RunningGraph):
        def __init__(self, fn: object, batch: int, T: int, seq_lens: torch.Tensor,
                     starts: torch.Tensor, pool: object = None) -> None:
            s = sched[0]
            made.append((s._capturing and threading.current_thread() is s._thread
                         and not seq_lens.any(), len(s._running)))
            super().__init__(fn, batch, T, seq_lens, starts, pool)

    monkeypatch.setattr(prefill_graphs, "CudaGraphStep", Recorded)
    for bucket in eng.buckets.values():
        bucket.capture_prefills(None)
    return made


def remove_graphs(eng: fuser.Engine) -> None:
    for bucket in eng.buckets.values():
        for model in (bucket.target, bucket.draft):
            if model is not None:
                model.prefill_graphs = model.chunk_graphs = None
        bucket.prefills = []


def alone(eng: fuser.Engine, requests: list) -> list[list[int]]:
    sched = Scheduler(eng, prefix_caching=False)
    sched.start()
    try:
        return [sched.submit(p, params).result(TIMEOUT) for p, params in requests]
    finally:
        sched.close()


@pytest.mark.xdist_group("paged_draft_engine")
@pytest.mark.parametrize("budget", [None, 8])
def test_the_request_path_never_captures_and_idle_time_does(
        monkeypatch: pytest.MonkeyPatch, budget: int | None) -> None:
    """A paged draft engine whose prefills and chunks replay (stand-in) graphs: requests of
    new shapes run uncaptured and return what they return without graphs; every capture
    happens on the scheduler's thread while it is idle (no request running), none on a
    request's path; served again, the same requests replay the graphs captured meanwhile and
    run nothing uncaptured."""
    eng = paged_engine(draft=True)
    requests = [(prompt(9, seed=1), greedy(6)), (prompt(40, seed=2), greedy(5)),
                (prompt(20, seed=3), greedy(7))]
    want = alone(eng, requests)
    holder: list[Scheduler] = []
    made = install_recorded_graphs(monkeypatch, eng, holder)
    try:
        sched = Scheduler(eng, prefix_caching=False, max_num_batched_tokens=budget)
        holder.append(sched)
        sched.start()
        try:
            assert [sched.submit(p, params).result(TIMEOUT) for p, params in requests] == want
            assert sched.wait_idle(TIMEOUT)  # (the shapes they needed are captured by now)
            uncaptured = sched.graphs_run_uncaptured
            on_path = sched.graphs_captured_on_path
            assert uncaptured > 0 and sched.graphs_captured_idle + on_path == len(made) > 0
            if budget is None:  # no shape ran more than DEFER_RUNS times before the idle
                assert on_path == 0
                assert all(idle and running == 0 for idle, running in made), made
            else:  # the chunks' one width may run more often while rows decode (as the
                # scheduler's idle moments fall): captured on the path after DEFER_RUNS
                # uncaptured runs, never sooner
                assert uncaptured >= DEFER_RUNS * on_path
            assert not any(g.pending for b in eng.buckets.values() for g in b.prefills)
            before = sum(eng.report().graph_replays.values())
            assert [sched.submit(p, params).result(TIMEOUT) for p, params in requests] == want
            assert sched.wait_idle(TIMEOUT)
            assert sched.graphs_run_uncaptured == uncaptured  # every shape replayed
            assert sum(eng.report().graph_replays.values()) > before
            if budget is not None:
                assert any(k.startswith("chunk.") and v
                           for k, v in eng.report().graph_replays.items())
        finally:
            sched.close()
    finally:
        remove_graphs(eng)


@pytest.mark.xdist_group("paged_draft_engine")
def test_without_capture_at_idle_the_first_request_captures(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """capture_at_idle=False: the request that first needs a shape captures it (the old way)."""
    eng = paged_engine(draft=True)
    holder: list[Scheduler] = []
    made = install_recorded_graphs(monkeypatch, eng, holder)
    try:
        sched = Scheduler(eng, prefix_caching=False, capture_at_idle=False)
        holder.append(sched)
        sched.start()
        try:
            sched.submit(prompt(9, seed=1), greedy(3)).result(TIMEOUT)
            assert sched.wait_idle(TIMEOUT)
            assert sched.graphs_captured_on_path == len(made) > 0
            assert sched.graphs_captured_idle == sched.graphs_run_uncaptured == 0
            assert not any(idle for idle, _ in made)
            assert sched.precapture(10.0) == 0
        finally:
            sched.close()
    finally:
        remove_graphs(eng)


@pytest.mark.xdist_group("paged_draft_engine")
def test_precapture_yields_to_a_request_and_keeps_its_budget(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`precapture` captures the planned shapes in idle time: a request that arrives waits
    for at most the capture under way (none starts between its arrival and its first token),
    the rest follow once it is served, and a budget smaller than one capture stops after
    one."""
    monkeypatch.setattr(scheduler_module, "PLAN_QUIET", 0.0)
    eng = paged_engine(draft=True)
    holder: list[Scheduler] = []
    made = install_recorded_graphs(monkeypatch, eng, holder)
    started: list[float] = []
    real = prefill_graphs.CudaGraphStep

    class Slow(real):
        def __init__(self, *args: object, **kwargs: object) -> None:
            started.append(time.perf_counter())
            time.sleep(0.05)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(prefill_graphs, "CudaGraphStep", Slow)
    try:
        sched = Scheduler(eng, prefix_caching=False)
        holder.append(sched)
        sched.start()
        try:
            planned = sched.precapture(60.0)
            # buckets 1, 4 (2048 // T rows: all four) and 2 at 32 and 64 (the cache's
            # lengths), prefill and chunk, target and draft
            assert planned == 3 * 2 * 2 * 2
            deadline = time.perf_counter() + TIMEOUT
            while not started and time.perf_counter() < deadline:
                time.sleep(0.001)
            stream = sched.submit(prompt(9, seed=1), greedy(3))
            stream.result(TIMEOUT)
            assert not [t for t in started
                        if stream.arrival_time < t < stream.first_token_time], started
            assert sched.wait_captures(TIMEOUT, planned=True)
            assert sched.graphs_captured_idle == len(made) == planned
            assert sched.graphs_captured_on_path == 0
        finally:
            sched.close()
        remove_graphs(eng)
        holder.clear()
        install_recorded_graphs(monkeypatch, eng, holder)
        monkeypatch.setattr(prefill_graphs, "CudaGraphStep", Slow)
        sched = Scheduler(eng, prefix_caching=False)
        holder.append(sched)
        sched.start()
        try:
            count = len(started)
            assert sched.precapture(0.001) == planned
            assert sched.wait_captures(TIMEOUT, planned=True)
            assert len(started) == count + 1  # (the budget ran out in the first capture)
            assert sched.graphs_captured_idle == 1
        finally:
            sched.close()
    finally:
        remove_graphs(eng)


@pytest.mark.xdist_group("paged_draft_engine")  # (the group's engine: built once a run)
def test_precapture_takes_a_number_of_seconds() -> None:
    sched = Scheduler(paged_engine(draft=True))
    with pytest.raises(ValueError, match="seconds"):
        sched.precapture("30")  # type: ignore[arg-type]
    sched.close()


# -- on CUDA: the real captures -----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_new_prompt_length_is_served_uncaptured_and_captured_at_idle(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (fp32, a paged draft engine, prefix caching on): a prompt of a length no graph
    was captured for is served without any capture on its path (watched: every prefill and
    chunk capture runs on the scheduler's thread while it is idle), with `generate`'s tokens;
    the idle capture (its warm-up writes the free rows, whose device table rows it nulls)
    leaves the cached blocks intact: the same prompt again, a prefix-cache hit, returns the
    same tokens, and the graphs captured meanwhile replay."""
    import copy

    target = copy.deepcopy(llama_target()).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3),
                             config=fuser.FuserConfig(max_seq_len=128, max_batch_size=4,
                                                      gamma=3, precision="fp32",
                                                      kv_block_size=4))
    assert eng.report().fallbacks == []
    seen: list[tuple[bool, int]] = []
    holder: list[Scheduler] = []
    real = prefill_graphs.CudaGraphStep

    class Watched(real):
        def __init__(self, *args: object, **kwargs: object) -> None:
            s = holder[0]
            seen.append((s._capturing and threading.current_thread() is s._thread,
                         len(s._running)))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(prefill_graphs, "CudaGraphStep", Watched)
    ids = prompt(70, seed=5)  # padded to 96: no warm-up or build ran it
    sched = Scheduler(eng)
    holder.append(sched)
    sched.start()
    try:
        first = sched.submit(ids, greedy(12)).result(TIMEOUT)
        assert sched.graphs_captured_on_path == 0 and sched.graphs_run_uncaptured > 0
        assert sched.wait_idle(TIMEOUT)
        assert sched.graphs_captured_idle > 0 and seen and all(
            idle and running == 0 for idle, running in seen), seen
        replays = sum(v for k, v in eng.report().graph_replays.items()
                      if k.startswith(("prefill.", "chunk.")))
        uncaptured = sched.graphs_run_uncaptured
        again = sched.submit(ids, greedy(12)).result(TIMEOUT)  # a prefix-cache hit
        assert again == first and sched.blocks.prefix_hits > 0
        other = sched.submit(prompt(70, seed=6), greedy(12)).result(TIMEOUT)  # a miss, 96
        assert sched.wait_idle(TIMEOUT)
        assert sched.graphs_captured_on_path == 0
        assert sum(v for k, v in eng.report().graph_replays.items()
                   if k.startswith(("prefill.", "chunk."))) > replays
        assert sched.graphs_run_uncaptured - uncaptured <= 2  # (the hit's chunk shape, both)
        assert all(idle and running == 0 for idle, running in seen), seen
    finally:
        sched.close()
    assert eng.report().fallbacks == []
    for ids_, out in ((ids, first), (prompt(70, seed=6), other)):
        want = eng.generate(torch.tensor([ids_], device="cuda"), 12, eos_token_id=[])
        assert want[0, len(ids_):].tolist() == out
