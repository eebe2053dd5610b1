"""Admission in the continuous-batching scheduler (runtime/scheduler.py `_admission_due`,
`_take_group`, `_place`): requests that arrive together are prefilled together, and requests
that join a running batch one finish at a time are admitted in batches, each request exactly
as it runs alone (fp32 on the CPU).

Engine: the tests/engines.py Llama target over a paged cache of 4-slot blocks, 16 rows,
buckets 1, 2, 4, 8, 16 ("fx": built in a few seconds, shared by the module's tests); for the
padded groups also with a draft (the target with 5% weight noise, gamma 3) over a contiguous
cache, whose row moves copy both caches' slots, and over the paged one; and the same on CUDA
in fp32 (the `cuda` tests: captured graphs with the group's dummy row in them).
"""

from __future__ import annotations

import copy
import functools
import threading
import time
import types
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from fuser import SamplingParams, Scheduler
from fuser.runtime import scheduler as scheduler_module
from engines import MAX_SEQ_LEN, greedy, llama_target, perturbed, prompt, sampled

ROWS = 16
TIMEOUT = 120.0

pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),
              pytest.mark.xdist_group("admission_engine")]


@functools.cache
def engine(kind: str = "paged") -> fuser.Engine:
    """kind "paged" (target-only), "contiguous-draft" or "paged-draft" (see the module
    docstring); "cuda-" before one: built on CUDA in fp32 (captured step, prefill and chunk
    graphs)."""
    cuda = kind.startswith("cuda-")
    paged, draft = kind.removeprefix("cuda-").startswith("paged"), kind.endswith("-draft")
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=ROWS,
                               batch_buckets=(1, 2, 4, 8, 16), gamma=3 if draft else 0,
                               compile="fx", kv_block_size=4 if paged else 0,
                               precision="fp32" if cuda else "auto")
    target = copy.deepcopy(llama_target()).cuda() if cuda else llama_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3) if draft else None,
                               config=config)
    assert built.target.cache.paged is paged and (built.draft is not None) is draft
    if cuda:
        built.wait_for_graphs()
    return built


def alone(requests: list[tuple[list[int], SamplingParams]], kind: str = "paged"
          ) -> list[list[int]]:
    """Each request by itself, prefix caching off (every prompt prefilled whole)."""
    sched = Scheduler(engine(kind), max_waiting=256, prefix_caching=False)
    sched.start()
    try:
        return [sched.submit(p, params).result(TIMEOUT) for p, params in requests]
    finally:
        sched.close()


def count_prefills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Spy on the scheduler's prefills of whole prompts (one call each): (requests, rows
    run) of each."""
    calls: list[tuple[int, int]] = []
    real = Scheduler._prefill

    def prefill(self, group, rows=None):
        calls.append((len(group), rows or len(group)))
        return real(self, group) if rows is None else real(self, group, rows)

    monkeypatch.setattr(Scheduler, "_prefill", prefill)
    return calls


def test_requests_arriving_together_prefill_as_one_group(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """16 requests that arrive a fraction of a millisecond apart on an idle scheduler, 9 of
    them with a prefix-cache hit: one prefill of 16 rows. (They went in six groups: the first
    alone as soon as it arrived, then whatever had arrived during each prefill, hits apart
    from misses, each split into buckets: 15 = 8 + 4 + 2 + 1.)"""
    requests = [(prompt(16, seed=i), greedy(6 + i % 5)) for i in range(ROWS)]
    want = alone(requests)
    sched = Scheduler(engine(), max_waiting=256, admission_quiet=0.05)
    sched.start()
    try:
        for p, params in requests[:9]:  # their blocks cached: hits
            sched.submit(p, greedy(1)).result(TIMEOUT)
        calls = count_prefills(monkeypatch)
        streams = []
        for p, params in requests:
            streams.append(sched.submit(p, params))
            time.sleep(0.0003)
        assert [s.result(TIMEOUT) for s in streams] == want
        assert calls == [(ROWS, ROWS)]
    finally:
        sched.close()


def test_hits_that_would_recompute_their_cached_tokens_prefill_apart(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests of `test_requests_arriving_together_prefill_as_one_group` (9 prefix-cache
    hits of 12 tokens, 7 misses) with MIXED_HIT_TOKENS at 0, as a long cached opening (1,024
    tokens against the default 256) would be: the hits prefill apart from the misses, through
    CHUNK steps that start at their hits (nothing cached recomputed), the misses from slot 0,
    and every request returns what it returns alone. (In one group the chunk ran from slot 0
    for all 16: 9 x 12 cached tokens recomputed.)"""
    requests = [(prompt(16, seed=i), greedy(6 + i % 5)) for i in range(ROWS)]
    want = alone(requests)
    sched = Scheduler(engine(), max_waiting=256, admission_quiet=0.05)
    sched.start()
    try:
        for p, params in requests[:9]:
            sched.submit(p, greedy(1)).result(TIMEOUT)
        monkeypatch.setattr(scheduler_module, "MIXED_HIT_TOKENS", 0)
        calls = count_prefills(monkeypatch)
        starts: list[list[int]] = []
        real_chunk = scheduler_module.speculative.prefill_chunk

        def prefill_chunk(target, draft, state, tokens, chunk_starts, *rest):
            starts.append(list(chunk_starts))
            return real_chunk(target, draft, state, tokens, chunk_starts, *rest)

        monkeypatch.setattr(scheduler_module.speculative, "prefill_chunk", prefill_chunk)
        streams = []
        for p, params in requests:
            streams.append(sched.submit(p, params))
            time.sleep(0.0003)
        assert [s.result(TIMEOUT) for s in streams] == want
        # 9 hits: the 16-row bucket pads too much; then 7 rows are free for the misses
        assert calls == [(8, 8), (1, 1), (4, 4), (2, 2), (1, 1)]
        assert starts == [[12] * 8, [12]]
    finally:
        sched.close()


@settings(max_examples=200, derandomize=True, deadline=None)
@given(hits=st.lists(st.integers(0, 64), min_size=1, max_size=16), bound=st.integers(0, 128))
def test_alike_hits_bounds_the_recomputed_tokens(hits: list[int], bound: int) -> None:
    """`alike_hits` always takes the first request, keeps the cached tokens its group
    recomputes (each hit past the group's shortest) within the bound, and leaves out only a
    request that would have taken it past the bound when it came."""
    taken = scheduler_module.alike_hits(hits, bound)
    assert taken[0] == 0 and taken == sorted(set(taken))
    group = [hits[i] for i in taken]
    assert sum(group) - len(group) * min(group) <= bound
    for j in set(range(len(hits))) - set(taken):
        before = [hits[i] for i in taken if i < j] + [hits[j]]
        assert sum(before) - len(before) * min(before) > bound


@pytest.mark.parametrize("kind", ["paged", "contiguous-draft", "paged-draft"])
def test_a_group_pads_to_its_bucket_beside_running_rows(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stepped by hand: 3 requests decode; 7 more wait (on the paged cache 4 of them
    prefix-cache hits). They are prefilled in one call of bucket 8 (a dummy row, a free one:
    the running rows move past the bucket, and one comes back after), not as 4 + 2 + 1 (split
    by hits and misses), and every request returns what it returns alone: greedy and seeded
    sampling, with a draft over either cache (row moves copy both caches' slots, or move the
    table row both share)."""
    pads_beside_running_rows(engine(kind), kind, monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["cuda-paged-draft", "cuda-contiguous-draft"])
def test_cuda_a_group_pads_to_its_bucket_beside_running_rows(
        kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`test_a_group_pads_to_its_bucket_beside_running_rows` on CUDA in fp32, with a draft:
    the group's prefill (the CHUNK step where hits join misses on the paged cache, else the
    prefill) replays bucket 8's captured graphs of both models with the dummy row in them
    (its table row null, or a free row's slots), the running rows decode in captured steps
    before and after their moves, and every request returns its tokens alone."""
    eng = engine(kind)
    step = "chunk" if kind.startswith("cuda-paged") else "prefill"
    before = dict(eng.report().graph_replays)
    pads_beside_running_rows(eng, kind, monkeypatch)
    after = eng.report().graph_replays
    grown = {k for k, v in after.items() if v > before.get(k, 0)}
    assert {k.split(".")[2] for k in grown if k.startswith(f"{step}.b8.")} \
        == {"target", "draft"}, after
    assert any(k.startswith("step.b16") for k in grown), after  # (10 rows decode in 16)
    uncaptured = {size: b.uncaptured_runs for size, b in eng.buckets.items()}
    assert all(n == 0 for runs in uncaptured.values() for n in runs.values()), uncaptured


def pads_beside_running_rows(eng: fuser.Engine, kind: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The padded group's scenario (the tests above) on engine `kind`."""
    running = [(prompt(12, seed=40 + i), greedy(20) if i != 1 else sampled(20, seed=9))
               for i in range(3)]
    joining = [(prompt(12, seed=60 + i), greedy(5 + i % 4) if i % 3 else sampled(7, seed=i))
               for i in range(7)]
    want = alone(running + joining, kind)
    sched = Scheduler(eng, max_waiting=256, admission_wait=0.0)
    try:
        with eng.generating():
            for p, _ in joining[:4]:  # hits (on the paged cache)
                sched.submit(p, greedy(1))
            while sched.num_waiting or sched.slots_used:
                sched._iteration()
            first = [sched.submit(p, params) for p, params in running]
            sched._may_run_ahead = lambda in_flight: False
            sched._iteration()
            sched._iteration()  # (the three decode)
            calls = count_prefills(monkeypatch)
            streams = [sched.submit(p, params) for p, params in joining]
            sched._iteration()
            assert calls == [(7, 8)]
            assert sched.slots_used == 10 and all(s.output_ids for s in streams)
            while not all(s.done for s in first + streams):
                sched._iteration()
            sched._retire()
        assert [s.output_ids for s in first + streams] == want
        assert sched.slots_used == 0 and (sched.blocks is None or not sched.blocks.active_rows())
        if sched.blocks is not None:
            assert sched.blocks.prefix_hits >= 4
    finally:
        sched.close()


def test_a_steady_stream_at_16_admits_in_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 clients, each sending its next request as soon as its last one ends, with budgets
    that end at different steps (one or two rows finish at most steps). Time is counted in
    steps (a clock the steps move): a request waits at most admission_wait = 2 steps (plus
    the step in flight) for its prefill unless a quarter of the rows wait, so requests are
    admitted a few at a time: at most one admission (one drained pipeline, one prefill) per
    4 requests after the first 16. (Each step with a finish was an admission: 15 here.)
    Every request returns what it returns alone."""

    eng = engine()
    total = 64
    requests = [(prompt(8 + 4 * (i % 2), seed=100 + i), greedy(4 + (5 * i) % 13))

                for i in range(total)]
    want = alone(requests)
    clock = [0.0]
    monkeypatch.setattr(scheduler_module, "time",
                        types.SimpleNamespace(perf_counter=lambda: clock[0]))
    sched = Scheduler(eng, max_waiting=256, admission_wait=2.0)
    calls = count_prefills(monkeypatch)
    admissions = []  # per admission that prefilled: its prompt tokens
    real_admit, real_collect = sched._admit, sched._collect

    def admit() -> None:
        before = len(calls)
        tokens = [len(s.prompt_ids) for s in sched._waiting]
        real_admit()
        if len(calls) > before:
            admissions.append(sum(tokens[: sum(k for k, _ in calls[before:])]))

    streams: list = []
    clients: list = []

    def submit() -> None:
        stream = sched.submit(*requests[len(streams)])
        streams.append(stream)
        clients.append(stream)

    def collect(step) -> None:  # a step takes one unit of time; a client answers at once
        real_collect(step)
        clock[0] += 1.0
        for stream in [s for s in clients if s.done]:
            clients.remove(stream)
            if len(streams) < total:
                submit()

    sched._admit, sched._collect = admit, collect
    try:
        with eng.generating():
            for _ in range(ROWS):
                submit()
            while not (len(streams) == total and all(s.done for s in streams)):
                before = clock[0]
                sched._iteration()
                if clock[0] == before:  # nothing ran: time passes all the same
                    clock[0] += 1.0
            sched._retire()
        assert [s.output_ids for s in streams] == want
        assert len(admissions) <= 1 + (total - ROWS) / 4  # (each finish: 15 admissions)
        assert len(admissions) == sched.admissions
        # Running rows wait at most one prefill of the budget's size at an admission.
        assert max(admissions) <= sched.prefill_tokens
        assert sched.blocks.active_rows() == []
    finally:
        sched.close()


def test_admission_is_due_by_the_rule() -> None:
    """`_admission_due` (not started, times set by hand): an idle scheduler admits once no
    request arrived for admission_quiet, or the oldest waited admission_wait, or the waiting
    fill the free rows; beside decoding rows once the oldest waited admission_wait, a
    quarter of the rows' count waits, or the waiting prompts fill the prefill budget."""

    sched = Scheduler(engine(), max_waiting=256, admission_wait=1.0, admission_quiet=0.1,
                      prefill_tokens=40)
    try:
        now = time.perf_counter()
        first = sched.submit(prompt(8, seed=1), greedy(4))
        first.arrival_time = now - 0.05
        assert not sched._admission_due()
        first.arrival_time = now - 0.2  # quiet since
        assert sched._admission_due()
        second = sched.submit(prompt(8, seed=2), greedy(4))
        second.arrival_time = now - 0.05  # a burst still arriving
        assert not sched._admission_due()
        first.arrival_time = now - 1.5  # the oldest waited long enough
        assert sched._admission_due()
        first.arrival_time = now - 0.2
        # Beside decoding rows: no quiet rule and no filling the free rows; the wait, a
        # batch of a quarter of the rows (4) or the budget.
        sched._running = [types.SimpleNamespace(done=False)] * (ROWS - 3)
        second.arrival_time = now - 0.5
        assert not sched._admission_due()
        sched.submit(prompt(8, seed=3), greedy(4))
        assert not sched._admission_due()  # three free rows, three waiting: not a batch
        sched.submit(prompt(4, seed=4), greedy(4))
        assert sched._admission_due()  # four waiting
        sched._waiting.pop()
        sched.submit(prompt(16, seed=5), greedy(4))  # 40 prompt tokens: the budget of 40
        assert sched._admission_due()
        sched._waiting.pop()
        sched._running = [types.SimpleNamespace(done=False)] * ROWS
        assert not sched._admission_due()  # no free row
        sched._running[0] = types.SimpleNamespace(done=True)  # a finished row is free
        first.arrival_time = now - 1.5
        assert sched._admission_due()  # (the oldest waited long enough)
        first.arrival_time = now
        assert not sched._admission_due()  # one free row, three waiting: not a batch
        sched._running = [types.SimpleNamespace(done=True)] * ROWS  # idle, 16 free rows
        assert not sched._admission_due()
    finally:
        sched._running = []
        sched.close()


def test_admission_times_must_be_seconds() -> None:
    for bad in (-1.0, "2", True):
        with pytest.raises(ValueError, match="admission_wait"):
            Scheduler(engine(), admission_wait=bad)
        with pytest.raises(ValueError, match="admission_quiet"):
            Scheduler(engine(), admission_quiet=bad)


def test_a_lone_request_on_an_idle_scheduler_is_admitted_after_the_quiet_time() -> None:
    """Nothing else arrives: the request waits admission_quiet, not admission_wait."""
    sched = Scheduler(engine(), max_waiting=256, admission_wait=30.0, admission_quiet=0.01)
    sched.start()
    try:
        stream = sched.submit(prompt(8, seed=7), greedy(2))
        assert stream.result(10.0) and stream.first_token_time - stream.arrival_time < 5.0
    finally:
        sched.close()


def test_requests_arriving_one_at_a_time_skip_the_quiet_time() -> None:
    """A client that waits for each answer: from the SPARSE_ARRIVALS-th request in a row that
    arrived more than admission_quiet after the one before, a lone request on an idle
    scheduler is admitted at once; two arriving together (a burst) restore the quiet time."""
    quiet = 0.25  # (far above a tiny engine's prefill on the CPU)
    sched = Scheduler(engine(), max_waiting=256, admission_wait=30.0, admission_quiet=quiet)
    sched.start()

    def ttft(seed: int) -> float:
        stream = sched.submit(prompt(8, seed=seed), greedy(2))
        assert stream.result(30.0)
        time.sleep(quiet + 0.05)  # (the answer read and thought over: a gap past the quiet)
        return stream.first_token_time - stream.arrival_time

    try:
        first = [ttft(seed) for seed in range(scheduler_module.SPARSE_ARRIVALS - 1)]
        assert all(t >= quiet for t in first), first  # (arrivals alone: not yet known)
        assert ttft(10) < quiet / 2 and ttft(11) < quiet / 2
        burst = [sched.submit(prompt(8, seed=20 + i), greedy(2)) for i in range(2)]
        assert all(s.result(30.0) for s in burst)
        assert ttft(12) >= quiet  # after a burst: the quiet time again
    finally:
        sched.close()


def test_requests_submitted_from_threads_at_once_share_prefills(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """8 threads submit at once (a barrier) on an idle scheduler: at most two prefills."""
    requests = [(prompt(10, seed=200 + i), greedy(3)) for i in range(8)]
    want = alone(requests)
    calls = count_prefills(monkeypatch)
    sched = Scheduler(engine(), max_waiting=256, admission_quiet=0.05)
    sched.start()
    barrier = threading.Barrier(len(requests))
    out: dict[int, list[int]] = {}
    try:
        def client(i: int) -> None:
            barrier.wait()
            out[i] = sched.submit(*requests[i]).result(TIMEOUT)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert [out[i] for i in range(len(requests))] == want
        assert len(calls) <= 2
    finally:
        sched.close()


def test_admission_due_beside_a_submit_from_another_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`_admission_due` runs on the stepping thread without the lock (the run-ahead asks it
    between steps) while clients' threads `submit`: it must not read the waiting queue as it
    changes. Here a client submits exactly while it counts the waiting prompts' tokens
    (before: "deque mutated during iteration", which ended every running request)."""
    sched = Scheduler(engine(), max_waiting=256, admission_wait=30.0)
    try:
        for seed in range(2):
            sched.submit(prompt(8, seed=seed), greedy(4))
        sched._running = [types.SimpleNamespace(done=False)] * (ROWS - 4)  # decoding rows
        real, clients = scheduler_module._tokens, []

        def tokens(stream):  # noqa: ANN001, ANN202
            if not clients:  # once: a client arrives in the middle of the count
                client = threading.Thread(target=sched.submit, args=(prompt(8, seed=9),
                                                                     greedy(4)))
                clients.append(client)
                client.start()
                client.join(0.5)  # (where the queue is read under the lock, it waits)
            return real(stream)

        monkeypatch.setattr(scheduler_module, "_tokens", tokens)
        assert not sched._admission_due()
        clients[0].join(TIMEOUT)
        assert sched.num_waiting == 3
    finally:
        sched._running = []
        sched.close()
