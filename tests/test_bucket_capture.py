"""Bucket 1 first, the other batch buckets in the background (runtime/bucket_capture.py).

On the CPU nothing is captured, so the engine's capture runs a fake (`Engine.capture_graphs`
takes any `capture(bucket, background) -> failures`) that records the order and waits on
events: the tests hold a bucket "under capture" for as long as they need, with no sleeps. What
is real: the engine's choice of bucket while some are not captured, the step gate, and the
background warm-up (`step_graphs.warm_up_in_place`), which runs real iterations over rows that
serve requests and must leave every request's tokens as they were.
"""

from __future__ import annotations

import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

import fuser
from fuser import SamplingParams, Scheduler
from fuser.runtime import speculative
from fuser.runtime.bucket_capture import (CAPTURING, FAILED, PENDING, READY, STOPPED,
                                          BackgroundCapture, CaptureStopped, StepGate)
from fuser.runtime.step_graphs import PLAIN, capture_order, warm_up_in_place
from engines import contiguous_engine, llama_target, perturbed

MAX_SEQ_LEN = 64
VOCAB = 160
TIMEOUT = 60.0  # seconds: every wait is bounded
THREAD = "fuser-bucket-capture"

# The engine: rows 4, buckets 1, 2, 4, a draft (the target with 5% noise), gamma fixed at 3:
# fp32 on the CPU, where a row's tokens do not depend on the bucket it runs in
# (tests/engines.py `contiguous_engine`, shared with tests/test_scheduler.py on one worker).
pytestmark = pytest.mark.xdist_group("contiguous_engine")


@pytest.fixture
def engine() -> Iterator[fuser.Engine]:
    """The engine with every bucket ready (as built on the CPU); afterwards its capture is
    stopped and forgotten, and no capture thread is left."""
    eng = contiguous_engine(True)
    eng._capture = None
    yield eng
    assert eng.close(TIMEOUT)
    eng._capture = None
    assert not [t for t in threading.enumerate() if t.name == THREAD]


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


REQUESTS = [(prompt(4 + 3 * i, seed=i),
             SamplingParams(max_tokens=12 + 2 * i, temperature=0.0 if i % 2 == 0 else 0.8,
                            seed=50 + i, ignore_eos=True))
            for i in range(3)]


def serve(eng: fuser.Engine, requests: list = REQUESTS) -> list[list[int]]:
    """Each request's tokens, all submitted at once to a scheduler over `eng`."""
    sched = Scheduler(eng)
    sched.start()
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        return [s.result(TIMEOUT) for s in streams]
    finally:
        sched.close()


class FakeCapture:
    """capture(bucket, background) for `Engine.capture_graphs`: records the order, and holds
    each bucket in `hold` until its event is set (or the capture is stopped); raises for the
    buckets in `fail`."""

    def __init__(self, hold: tuple[int, ...] = (), fail: tuple[int, ...] = (),
                 work: Callable[[object, tuple], None] | None = None) -> None:
        self.order: list[int] = []
        self.started = {size: threading.Event() for size in (1, 2, 4)}
        self.release = {size: threading.Event() for size in hold}
        self.fail = set(fail)
        self.work = work
        self.threads: dict[int, str] = {}

    def __call__(self, bucket: object, background: tuple | None) -> list[str]:
        size = bucket.batch
        self.order.append(size)
        self.threads[size] = threading.current_thread().name
        self.started[size].set()
        if size in self.release:
            stop = background[1] if background is not None else None
            while not self.release[size].wait(0.01):
                if stop is not None and stop.is_set():
                    raise CaptureStopped
        if size in self.fail:
            raise RuntimeError(f"no graph for bucket {size}")
        if self.work is not None and background is not None:
            self.work(bucket, background)
        return []


def test_capture_order_is_one_then_the_largest_then_the_rest():
    assert capture_order((1,)) == [1]
    assert capture_order((4, 1)) == [1, 4]
    assert capture_order((1, 2, 4, 8, 16)) == [1, 16, 2, 4, 8]


def test_bucket_one_is_ready_before_the_others_finish(engine):
    """capture_graphs returns (fuser.load returns, /health turns 200) once bucket 1 is
    captured on the calling thread; the others capture on the background thread, the largest
    first; wait_for_graphs waits for them."""
    fake = FakeCapture(hold=(4, 2))
    engine.capture_graphs(fake, background=True)
    assert fake.threads[1] == threading.current_thread().name
    assert fake.started[4].wait(TIMEOUT)
    status = engine.graphs_status
    assert status[1] == READY and status[4] == CAPTURING and status[2] == PENDING
    assert not engine.wait_for_graphs(timeout=0.0)
    assert engine.bucket(1).batch == 1
    fake.release[4].set()
    assert engine._capture.wait(4, TIMEOUT)
    assert engine.bucket(2).batch == 4  # 2 is not captured yet: the captured 4 holds two rows
    fake.release[2].set()
    assert engine.wait_for_graphs(TIMEOUT)
    assert fake.order == [1, 4, 2] and fake.threads[4] == fake.threads[2] == THREAD
    assert engine.bucket(2).batch == 2
    assert engine.report().fallbacks == []


def test_capture_up_front_captures_every_bucket_before_returning(engine):
    fake = FakeCapture()
    engine.capture_graphs(fake, background=False)
    assert fake.order == [1, 4, 2] and set(fake.threads.values()) == {
        threading.current_thread().name}
    assert engine.graphs_status == {1: READY, 4: READY, 2: READY}
    assert engine.wait_for_graphs(timeout=0.0)


def test_steps_in_uncaptured_buckets_return_the_same_tokens(engine):
    """While bucket 2 is not captured, two rows step in the captured bucket 4, and while
    neither is, in bucket 2 uncaptured: `generate` and the scheduler return what they return
    with every bucket ready."""
    ids = torch.tensor([prompt(6, seed=11), prompt(6, seed=12)])
    want_generate = engine.generate(ids, max_new_tokens=10)
    want_served = serve(engine)
    fake = FakeCapture(hold=(4, 2))
    engine.capture_graphs(fake, background=True)
    assert fake.started[4].wait(TIMEOUT)
    with engine.stepping():
        assert engine.bucket(2).batch == 2 and engine.bucket(3).batch == 4
    assert torch.equal(engine.generate(ids, max_new_tokens=10), want_generate)
    assert serve(engine) == want_served
    fake.release[4].set()
    assert engine._capture.wait(4, TIMEOUT)
    with engine.stepping():
        assert engine.bucket(2).batch == 4
    assert torch.equal(engine.generate(ids, max_new_tokens=10), want_generate)
    assert serve(engine) == want_served
    fake.release[2].set()
    assert engine.wait_for_graphs(TIMEOUT)


def test_the_bucket_choice_holds_within_one_serving_unit(engine):
    """A bucket captured in the middle of a scheduler iteration is chosen from the next one on
    (the steps and read-backs of one iteration agree on their bucket)."""
    fake = FakeCapture(hold=(4, 2))
    engine.capture_graphs(fake, background=True)
    assert fake.started[4].wait(TIMEOUT)
    with engine.stepping():
        assert engine.bucket(3).batch == 4 and engine.bucket(2).batch == 2
        fake.release[4].set()
        assert engine._capture.wait(4, TIMEOUT)
        assert engine.bucket(2).batch == 2  # still this unit's choice
    with engine.stepping():
        assert engine.bucket(2).batch == 4
    fake.release[2].set()
    assert engine.wait_for_graphs(TIMEOUT)


def test_a_failed_bucket_is_said_and_runs_uncaptured(engine, caplog):
    """An exception in the background capture is logged and warned about, the bucket is marked
    failed (its rows run uncaptured, correctly), the next bucket still captures, and nothing
    waits for ever."""
    ids = torch.tensor([prompt(5, seed=21)] * 3)
    want = engine.generate(ids, max_new_tokens=8)
    fake = FakeCapture(fail=(4,))
    with caplog.at_level(logging.ERROR, logger="fuser"), warnings.catch_warnings(record=True) \
            as caught:
        warnings.simplefilter("always")
        engine.capture_graphs(fake, background=True)
        assert not engine.wait_for_graphs(TIMEOUT)  # returns: one bucket failed
    assert engine.graphs_status == {1: READY, 4: FAILED, 2: READY}
    assert fake.order == [1, 4, 2]
    message = "bucket 4: capture failed (RuntimeError: no graph for bucket 4); it runs uncaptured"
    assert any(message in str(w.message) for w in caught)
    assert "capturing batch bucket 4 failed" in caplog.text
    assert any(message in f for f in engine.report().fallbacks)
    with engine.stepping():
        assert engine.bucket(3).batch == 4  # no captured bucket holds 3 rows: 4, uncaptured
    assert torch.equal(engine.generate(ids, max_new_tokens=8), want)


def test_close_stops_the_background_capture(engine):
    """close() ends the thread while a bucket is under capture: that bucket and the ones after
    it are stopped (they run uncaptured), and waiters return."""
    fake = FakeCapture(hold=(4, 2))
    engine.capture_graphs(fake, background=True)
    assert fake.started[4].wait(TIMEOUT)
    assert engine.close(TIMEOUT)
    assert engine.graphs_status == {1: READY, 4: STOPPED, 2: STOPPED}
    assert not engine.wait_for_graphs(timeout=0.0)
    assert fake.order == [1, 4]
    assert not engine._capture.alive


def test_close_stops_a_warm_up_waiting_for_the_gate(engine):
    """A background warm-up waits for the serving side to let go of the rows; close() ends it
    even while a generation holds them."""
    entered = threading.Event()

    def work(bucket: object, background: tuple) -> None:
        entered.set()
        warm_up_in_place(bucket, *background)(bucket.function(PLAIN, False), 1)

    fake = FakeCapture(work=work)
    with engine.stepping():  # a generation in progress
        engine.capture_graphs(fake, background=True)
        assert entered.wait(TIMEOUT)
        assert engine.close(TIMEOUT)
    assert engine.graphs_status[4] == STOPPED


def test_background_warm_ups_leave_serving_requests_as_they_were(engine):
    """The background warm-up runs real iterations (every gamma, greedy and sampled, and the
    draft's resync) of buckets 4 and 2 over the rows the scheduler's requests live in, between
    its iterations: each request still returns what it returns with nothing beside it."""
    long = [(p, SamplingParams(max_tokens=40, temperature=params.temperature, seed=params.seed,
                               ignore_eos=True)) for p, params in REQUESTS]
    want = serve(engine, long)
    # Not vacuous: an iteration moves the lengths (what the warm-up has to undo).
    bucket = engine.buckets[4]
    bucket.reset_for_timing(10)
    bucket.function(3, False)()
    assert (bucket.target.cache.seq_lens > 10).all()
    bucket.free_rows()

    warm_ups_while_serving = []
    go = threading.Event()
    sched = Scheduler(engine)

    def work(bucket: object, background: tuple) -> None:
        assert go.wait(TIMEOUT)
        for _ in range(3):
            for gamma in (PLAIN, 3):
                for do_sample in (False, True):
                    warm_up_in_place(bucket, *background)(bucket.function(gamma, do_sample), 2)
                    warm_ups_while_serving.append(sched.num_running > 0)
            chunk = functools.partial(speculative.resync_chunk, bucket.draft, bucket.target,
                                      bucket.state)
            warm_up_in_place(bucket, *background)(chunk, 1)

    fake = FakeCapture(work=work)
    engine.capture_graphs(fake, background=True)
    sched.start()
    try:
        streams = [sched.submit(p, params) for p, params in long]
        next(iter(streams[0]))  # the requests run: now the warm-ups come between their steps
        go.set()
        got = [streams[0].result(TIMEOUT)] + [s.result(TIMEOUT) for s in streams[1:]]
    finally:
        sched.close()
    assert engine.wait_for_graphs(TIMEOUT)
    assert got == want
    assert any(warm_ups_while_serving)


def test_step_gate_lets_a_waiting_warm_up_in_before_new_serving():
    gate = StepGate()
    order: list[str] = []
    held, want_exclusive = threading.Event(), threading.Event()

    def warm_up() -> None:
        want_exclusive.set()
        with gate.exclusive() as got:
            assert got
            order.append("warm-up")

    def serving_later() -> None:
        with gate.serving():
            order.append("serving")

    with gate.serving():
        with gate.serving():  # re-entry on one thread never waits
            held.set()
        worker = threading.Thread(target=warm_up)
        worker.start()
        assert want_exclusive.wait(TIMEOUT)
        while not gate._waiting:  # the warm-up waits for this holder (a condition: no sleep)
            with gate._cond:
                gate._cond.wait(0.01)
        later = threading.Thread(target=serving_later)
        later.start()
        with gate.serving():  # re-entry while a warm-up waits does not deadlock
            pass
        assert order == []
    worker.join(TIMEOUT)
    later.join(TIMEOUT)
    assert order == ["warm-up", "serving"]


def test_background_capture_checks_its_order():
    with pytest.raises(ValueError, match="each bucket once"):
        BackgroundCapture([1, 2, 2], lambda size: [])
    job = BackgroundCapture([1], lambda size: [])
    job.capture_now(1)
    job.start()  # nothing left: no thread
    assert job.done and job.wait(timeout=0.0) and not job.alive


def test_the_first_buckets_rest_captures_first_on_the_thread():
    """A first bucket with shapes left (`first_rest`): ready after its foreground part, the
    rest captured first on the thread, then the other buckets; `wait()` waits for the rest,
    `wait(1)` does not."""
    calls: list[object] = []
    hold = threading.Event()

    def rest() -> list[str]:
        calls.append("rest of 1")
        assert hold.wait(TIMEOUT)
        return ["bucket 1, gamma4.sample: failed; it runs uncaptured"]

    lines: list[str] = []
    job = BackgroundCapture([1, 4], lambda size: calls.append(size) or [],
                            log_line=lines.append, first_rest=rest)
    job.capture_now(1)
    assert job.ready(1) and not job.done
    job.start()
    assert job.wait(1, timeout=0.0)
    assert not job.wait(timeout=0.05)  # the rest of bucket 1 is held
    hold.set()
    assert job.wait(timeout=TIMEOUT) and job.done
    assert calls == [1, "rest of 1", 4]
    assert job.failures == ["bucket 1, gamma4.sample: failed; it runs uncaptured"]
    assert lines[-1].startswith("captured the step graphs of the rest of batch bucket 1 and "
                                "batch buckets [4] in the background")
    job.stop()


def test_a_deferred_gamma_is_not_chosen_until_captured():
    """`Engine.next_gamma` with a bucket whose gammas 2 and 4 capture later: the controller
    runs target-only and gamma 1 only (no probe of an uncaptured gamma, whose host-bound cost
    would mislead it); once they are captured it probes them, and settles on the cheapest per
    token (scripted costs)."""
    from types import SimpleNamespace

    from fuser.runtime.controller import DRAFT, TARGET, Controller

    costs = {(TARGET, 0): 1.0, (DRAFT, 1): 1.6, (DRAFT, 2): 1.9, (DRAFT, 4): 2.5}
    controller = Controller({DRAFT: [1, 2, 4]}, costs=costs, probe_steps=2)
    engine = SimpleNamespace(_forced_gamma=None, gammas=[1, 2, 4], gamma=1)
    bucket = SimpleNamespace(deferred={2, 4})
    chosen = []
    for step in range(600):
        if step == 300:
            bucket.deferred = set()  # captured in the background
        gamma = fuser.Engine.next_gamma(engine, controller, bucket)
        chosen.append(gamma)
        controller.update([gamma], gamma)  # every proposal accepted: gamma + 1 tokens
    assert set(chosen[:300]) <= {0, 1} and {0, 1} <= set(chosen[:300])
    assert {2, 4} <= set(chosen[300:])
    assert chosen[-100:].count(4) >= 90  # 2.5 s / 5 tokens, the cheapest per token (between
    # probes, at most ~5% of steps)


def saved_cuda_engine(path, **config: object) -> fuser.Engine:
    """The test target and its 5%-perturbed draft built on CUDA (fx steps, MAX_SEQ_LEN) with
    `config` and saved to `path`; the target goes back to the CPU."""
    target = llama_target()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            draft = perturbed(target, 0.05, seed=3).cuda()
            built = fuser.optimize(target.cuda(), draft=draft, config=fuser.FuserConfig(
                max_seq_len=MAX_SEQ_LEN, compile="fx", **config))
        built.save(path)
        return built
    finally:
        target.cpu()


def held_background_captures(monkeypatch) -> threading.Event:
    """Every background `Bucket.capture` waits for the returned event before it captures."""
    from fuser.runtime.step_graphs import Bucket

    go = threading.Event()
    capture = Bucket.capture

    def held_capture(self, *args, **kwargs):
        if kwargs.get("background") is not None:
            assert go.wait(TIMEOUT)
        return capture(self, *args, **kwargs)

    monkeypatch.setattr(Bucket, "capture", held_capture)
    return go


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_loaded_engine_serves_while_its_buckets_capture(tmp_path, monkeypatch):
    """On CUDA: a loaded engine returns with bucket 1 captured and serves at once; requests
    submitted while buckets 4 and 2 are not yet captured, and still running while they are
    (real captures beside the serving thread's steps), return the tokens of the engine loaded
    with every bucket captured up front, and every bucket ends up captured."""
    built_engine = saved_cuda_engine(tmp_path / "engine", max_batch_size=4, gamma=3)
    assert sorted(built_engine.buckets) == [1, 2, 4]
    long = [(p, SamplingParams(max_tokens=40, temperature=params.temperature, seed=params.seed,
                               ignore_eos=True)) for p, params in REQUESTS]

    up_front = fuser.load(tmp_path / "engine", wait_for_graphs=True)
    assert up_front.graphs_status == {1: READY, 4: READY, 2: READY}
    want = serve(up_front, long)
    two_rows = torch.tensor([long[0][0]] * 2, device="cuda")
    want_generate = up_front.generate(two_rows, max_new_tokens=12)

    go = held_background_captures(monkeypatch)
    loaded = fuser.load(tmp_path / "engine")
    try:
        assert loaded.graphs_status[1] == READY and loaded.graphs_status[4] != READY
        sched = Scheduler(loaded)
        sched.start()
        try:
            streams = [sched.submit(p, params) for p, params in long]
            next(iter(streams[0]))  # serving before buckets 4 and 2 are captured
            go.set()  # and now beside their capture
            got = [s.result(TIMEOUT) for s in streams]
            assert sched.wait_idle(TIMEOUT)
        finally:
            sched.close()
        assert loaded.wait_for_graphs(TIMEOUT)
        assert got == want
        assert loaded.report().fallbacks == up_front.report().fallbacks
        uncaptured = dict(loaded.buckets[2].uncaptured_runs)
        assert torch.equal(loaded.generate(two_rows, max_new_tokens=12), want_generate)
        assert loaded.buckets[2].uncaptured_runs == uncaptured  # two rows: bucket 2's graphs
        assert sum(g.replays for g in loaded.buckets[2].graphs.values()) > 0
    finally:
        loaded.close()
        up_front.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_loaded_bucket_one_serves_before_its_other_gammas_capture(tmp_path, monkeypatch):
    """On CUDA, gamma="auto": the load returns with bucket 1's target-only and gamma-1 graphs
    captured and its other gammas deferred to the background thread; greedy requests served
    meanwhile run no deferred gamma (none runs uncaptured) and give the tokens of the engine
    loaded with every graph up front; then every gamma of bucket 1 is captured."""
    saved_cuda_engine(tmp_path / "engine", max_batch_size=1, gamma="auto",
                      gamma_candidates=(1, 2, 4))
    greedy = [(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
              for p, _ in REQUESTS]
    up_front = fuser.load(tmp_path / "engine", wait_for_graphs=True)
    assert not up_front.buckets[1].deferred
    want = serve(up_front, greedy)

    go = held_background_captures(monkeypatch)
    loaded = fuser.load(tmp_path / "engine")
    try:
        bucket = loaded.buckets[1]
        assert bucket.deferred == {2, 4}
        assert {k for k in bucket.graphs} == {(0, False), (0, True), (1, False), (1, True)}
        assert not loaded.wait_for_graphs(timeout=0.0)
        got = serve(loaded, greedy)
        assert got == want
        assert not {g for g, _ in bucket.uncaptured_runs} & {2, 4}, bucket.uncaptured_runs
        go.set()
        assert loaded.wait_for_graphs(TIMEOUT)
        assert not bucket.deferred
        assert {g for g, _ in bucket.graphs} == {0, 1, 2, 4}
    finally:
        loaded.close()
        up_front.close()

