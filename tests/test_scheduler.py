"""The continuous-batching scheduler (runtime/scheduler.py) on tiny fp32 models.

What a request returns must not depend on what else runs: each request's tokens, submitted
with many others (more than the engine has rows, so requests wait, join a running batch and
leave it at different steps), equal the same request run alone, and, greedy, `engine.generate`'s.
"""

from __future__ import annotations

import asyncio
import threading
import warnings

import pytest
import torch

import fuser
from fuser import SamplingParams, Scheduler
from fuser.runtime.scheduler import QueueFull, SchedulerClosed
from engines import contiguous_engine as engine, llama_target, perturbed

MAX_SEQ_LEN = 64
VOCAB = 160
TIMEOUT = 120.0  # seconds: every wait is bounded

# engine(draft): rows 4, buckets 1, 2, 4; with a draft, gamma fixed at 3 (tests/engines.py),
# built once for this module and tests/test_bucket_capture.py on one xdist worker.
pytestmark = pytest.mark.xdist_group("contiguous_engine")


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


# Prompts of different lengths, budgets, eos and sampling parameters.
REQUESTS = [
    (prompt(3 + 5 * i % 17, seed=i),
     SamplingParams(max_tokens=4 + (7 * i) % 13, temperature=0.0 if i % 2 == 0 else 0.9,
                    top_k=None if i % 3 else 20, top_p=0.9 if i % 4 == 1 else None,
                    seed=100 + i, eos_token_id=[7 + i % 5] if i % 3 == 0 else [],
                    ignore_eos=i % 5 == 4))
    for i in range(10)
]


@pytest.fixture(params=[False, True], ids=["target-only", "draft"])
def scheduler(request: pytest.FixtureRequest) -> Scheduler:
    sched = Scheduler(engine(request.param), max_waiting=64)
    sched.start()
    try:
        yield sched
    finally:
        sched.close()


def run_alone(sched: Scheduler, prompt_ids: list[int], params: SamplingParams) -> list[int]:
    return sched.submit(prompt_ids, params).result(TIMEOUT)


def test_requests_return_what_they_return_alone(scheduler: Scheduler) -> None:
    alone = [run_alone(scheduler, p, params) for p, params in REQUESTS]
    streams = [scheduler.submit(p, params) for p, params in REQUESTS]
    together = [s.result(TIMEOUT) for s in streams]
    assert together == alone
    for (p, params), out, stream in zip(REQUESTS, together, streams):
        assert 1 <= len(out) <= params.max_tokens
        if stream.finish_reason == "length":
            assert len(out) == params.max_tokens
        else:
            assert stream.finish_reason == "stop" and out[-1] in params.eos_token_id
    assert scheduler.wait_idle(TIMEOUT) and scheduler.slots_used == 0


def test_greedy_equals_generate(scheduler: Scheduler) -> None:
    eng = scheduler.engine
    for p, params in REQUESTS[::2]:  # the greedy ones
        out = run_alone(scheduler, p, params)
        eos = params.eos_token_id if not params.ignore_eos else []
        assert scheduler.wait_idle(TIMEOUT)  # the engine is free again: generate may run
        ref = eng.generate(torch.tensor([p]), params.max_tokens, eos_token_id=list(eos),
                           pad_token_id=0)[0, len(p):].tolist()
        assert out == ref[: len(out)] and (len(out) == len(ref) or out[-1] in eos)


def test_async_stream_yields_the_tokens_in_order(scheduler: Scheduler) -> None:
    p, params = REQUESTS[1]
    expected = run_alone(scheduler, p, params)

    async def collect() -> list[int]:
        stream = scheduler.submit(p, params)
        out: list[int] = []
        async for tokens in stream:
            out += tokens
        return out

    assert asyncio.run(asyncio.wait_for(collect(), TIMEOUT)) == expected


def test_cancel_frees_the_slot_and_the_others_go_on(scheduler: Scheduler) -> None:
    long = SamplingParams(max_tokens=MAX_SEQ_LEN - 8, temperature=0.0, ignore_eos=True)
    reference = run_alone(scheduler, prompt(5, seed=5), long)
    streams = [scheduler.submit(prompt(5, seed=i), long) for i in range(6)]
    streams[4].finish("stop")  # most likely still waiting: it ends all the same
    cancelled_running = 0
    for stream in streams[:4]:
        next(iter(stream))  # it runs
        if not stream.done:
            stream.cancel()
            cancelled_running += 1
    assert cancelled_running >= 1  # (the requests are long: they are still running)
    for stream in streams[:4]:
        out = stream.result(TIMEOUT)
        assert stream.finish_reason == "abort" and len(out) < long.max_tokens or \
            stream.finish_reason == "length"
    assert streams[4].result(TIMEOUT) is not None and streams[4].finish_reason == "stop"
    assert streams[5].result(TIMEOUT) == reference  # its neighbours left mid-way
    assert scheduler.wait_idle(TIMEOUT) and scheduler.slots_used == 0


def test_a_waiting_request_takes_a_finished_rows_slot_while_the_others_decode(
        scheduler: Scheduler) -> None:
    """Continuous batching: a request that waits for a row gets the first one that finishes,
    and finishes long before its neighbours do. (Finished rows used to ride along in every
    step queued ahead until the whole batch had finished: the waiting request then finished
    with the longest running one.)"""
    long = SamplingParams(max_tokens=MAX_SEQ_LEN - 12, temperature=0.0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    run_alone(scheduler, prompt(5, seed=1), short)  # (the steps compiled, the loop idle)
    longs = [scheduler.submit(prompt(5, seed=10 + i), long) for i in range(3)]
    first = scheduler.submit(prompt(5, seed=20), short)  # the engine's 4th and last row
    late = scheduler.submit(prompt(5, seed=21), short)  # waits for a row
    assert len(late.result(TIMEOUT)) == 2 and len(first.result(TIMEOUT)) == 2
    for stream in longs:
        assert len(stream.result(TIMEOUT)) == long.max_tokens
    assert late.finish_time < min(s.finish_time for s in longs)


def test_a_request_that_ends_at_its_prefill_runs_no_decode_step(scheduler: Scheduler) -> None:
    """One token is the prefill's: the request ends there, and its row leaves before any
    decode step is issued (it used to ride along in one)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    run_alone(scheduler, prompt(5, seed=1), one)  # (the steps compiled, the loop idle)
    assert scheduler.wait_idle(TIMEOUT)
    steps = scheduler.steps
    assert len(run_alone(scheduler, prompt(6, seed=2), one)) == 1
    assert scheduler.wait_idle(TIMEOUT) and scheduler.steps == steps


def test_bad_requests_raise_value_errors_that_name_the_problem(scheduler: Scheduler) -> None:
    cases = [
        ([], SamplingParams(), "empty"),
        ([1, VOCAB], SamplingParams(), "token id"),
        ([-1, 2], SamplingParams(), r"holds -1, not a token id"),
        ([1, True], SamplingParams(), r"holds True, not a token id"),  # (a bool is no id)
        ([1, 2.0], SamplingParams(), r"holds 2.0, not a token id"),
        ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
        ([1] * 60, SamplingParams(max_tokens=10), "max_seq_len"),
        ([1], SamplingParams(temperature=-1.0), "temperature"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_k=-5), "top_k"),
        ([1], SamplingParams(seed=1.5), "seed"),
        ([1], SamplingParams(seed=2**63), "seed"),
    ]
    for ids, params, word in cases:
        with pytest.raises(ValueError, match=word):
            scheduler.submit(ids, params)
    assert run_alone(scheduler, [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0))


def test_queue_bound_drain_and_close() -> None:
    sched = Scheduler(engine(False), max_waiting=2)  # not started: nothing leaves the queue
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0)
        waiting = [sched.submit([1, 2], params) for _ in range(2)]
        with pytest.raises(QueueFull):
            sched.submit([1, 2], params)
        sched.start()
        assert sched.drain(TIMEOUT)
        assert all(s.finish_reason == "length" and len(s.output_ids) == 3 for s in waiting)
        with pytest.raises(SchedulerClosed):
            sched.submit([1, 2], params)
    finally:
        sched.close()


def test_submit_from_many_threads() -> None:
    sched = Scheduler(engine(True), max_waiting=64)
    sched.start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0)
        expected = {i: run_alone(sched, prompt(4 + i, seed=i), params) for i in range(8)}
        results: dict[int, list[int]] = {}

        def client(i: int) -> None:
            results[i] = sched.submit(prompt(4 + i, seed=i), params).result(TIMEOUT)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert results == expected
    finally:
        sched.close()


def test_needs_a_bucket_of_one() -> None:
    config = fuser.FuserConfig(max_seq_len=32, max_batch_size=2, compile="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        two_rows = fuser.optimize(llama_target(), config=config)
    if 1 in two_rows.buckets:
        pytest.skip("this device builds a bucket of 1 by default")
    with pytest.raises(ValueError, match="batch_buckets"):
        Scheduler(two_rows)


def test_chunked_prefill_needs_a_paged_cache() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        Scheduler(engine(False), max_num_batched_tokens=64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_scheduler_replays_step_graphs_and_matches_alone() -> None:
    """On CUDA: requests joining and leaving run through the captured iteration graphs (one
    replay per step, none uncaptured), and each returns what it returns alone (fp32)."""
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, gamma=3,
                               compile="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        draft = perturbed(target, 0.05, seed=3).cuda()
        eng = fuser.optimize(target.cuda(), draft=draft, config=config)
    try:
        assert sorted(eng.buckets) == [1, 2, 4]
        sched = Scheduler(eng)
        sched.start()
        try:
            alone = [run_alone(sched, p, params) for p, params in REQUESTS]
            streams = [sched.submit(p, params) for p, params in REQUESTS]
            assert [s.result(TIMEOUT) for s in streams] == alone
            assert sched.wait_idle(TIMEOUT)
        finally:
            sched.close()
        replays = eng.report().graph_replays
        assert sum(v for k, v in replays.items() if k.startswith("step.b")) >= sched.steps
        assert all(n == 0 for b in eng.buckets.values() for n in b.uncaptured_runs.values())
    finally:
        target.cpu()


def test_generate_is_refused_while_a_scheduler_holds_the_engine():
    """A scheduler running requests holds the engine's KV cache: a generate on the same engine
    meanwhile is refused (RuntimeError), never run on the rows the scheduler's requests use."""
    import threading

    eng = engine(False)
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with eng.generating():  # what Scheduler._loop does while it has requests
            held.set()
            release.wait(30.0)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert held.wait(30.0)
        with pytest.raises(RuntimeError, match="already generating"):
            eng.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=2)
    finally:
        release.set()
        thread.join(30.0)
    assert eng.generate(torch.tensor([[5, 9, 14]]), max_new_tokens=2).shape == (1, 5)
