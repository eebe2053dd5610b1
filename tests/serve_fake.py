"""A stand-in for `fuser.runtime.scheduler.Scheduler` (same API) for the HTTP tests: no model,
deterministic tokens, millisecond steps, so that status codes, streaming, disconnects and
queueing are tested in seconds. The engine-backed tests (tests/test_serve_engine.py) use the
real scheduler.

Tokens: a request's i-th token is a hash of (prompt, i) when greedy, of (prompt, i, seed) when
seeded: what it returns does not depend on what else runs, as with the real scheduler. A step
delivers 1 to 3 tokens (as a speculative step may), varying with the global step count.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import random
import threading
import time
from collections import deque

from fuser.runtime.scheduler import QueueFull, SamplingParams, SchedulerClosed

EOS = 1
FIRST_ORDINARY = 3  # ids 0, 1, 2 are the bundled tokenizer's bos, eos, pad


class FakeStream:
    """RequestStream's API: output_ids, finish_reason, times, cancel/finish, async/sync iteration."""

    _ids = itertools.count()

    def __init__(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.request_id = f"fake-{next(self._ids)}"
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []
        self.requested_end: str | None = None  # cancel()/finish(): applied at the next step
        self._chunks: list[list[int]] = []
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._cond = threading.Condition(self._lock)
        self._rng = random.Random(params.seed) if params.seed is not None else random.Random()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def cancel(self) -> None:
        self.finish("abort")

    def finish(self, reason: str) -> None:
        with self._lock:
            if self.requested_end is None:
                self.requested_end = reason

    # -- scheduler side ------------------------------------------------------------------------

    def _deliver(self, tokens: list[int], end: str | None) -> None:
        now = time.perf_counter()
        with self._lock:
            if tokens:
                self.output_ids += tokens
                self._chunks.append(tokens)
                self.token_times += [now] * len(tokens)
                if self.first_token_time is None:
                    self.first_token_time = now
            if end is not None:
                self.finish_reason = end
                self.finish_time = now
            waiters = list(self._waiters)
            self._cond.notify_all()
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed
                pass

    def next_token(self) -> int:
        i = len(self.output_ids)
        p = self.params
        if p.temperature > 0.0:  # sampled: from the request's own RNG when seeded
            rng = self._rng if p.seed is not None else random
            return FIRST_ORDINARY + rng.randrange(4096 - FIRST_ORDINARY)
        key = f"{self.prompt_ids}|{i}"
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return EOS if h % 61 == 0 else FIRST_ORDINARY + h % (4096 - FIRST_ORDINARY)

    # -- consumer side -------------------------------------------------------------------------

    async def __aiter__(self):  # noqa: ANN204 (an async generator)
        loop = asyncio.get_running_loop()
        event = asyncio.Event()
        with self._lock:
            self._waiters.append((loop, event))
        i = 0
        try:
            while True:
                with self._lock:
                    chunks, done = self._chunks[i:], self.finish_reason is not None
                    if not chunks and not done:
                        event.clear()
                if chunks:
                    i += len(chunks)
                    for chunk in chunks:
                        yield chunk
                    continue
                if done:
                    return
                await event.wait()
        finally:
            with self._lock:
                self._waiters.remove((loop, event))

    def __iter__(self):  # noqa: ANN204
        i = 0
        while True:
            with self._cond:
                while len(self._chunks) <= i and self.finish_reason is None:
                    self._cond.wait(1.0)
                chunks, done = self._chunks[i:], self.finish_reason is not None
            i += len(chunks)
            yield from chunks
            if done and not chunks:
                return


class FakeScheduler:
    """The Scheduler API over FakeStream: `max_slots` rows, a waiting queue bounded by
    `max_waiting`, a step every `step_seconds`. `pause()` holds the stepping (requests then
    wait), `resume()` lets it go. submit raises RuntimeError for a prompt ending in
    `fail_token` (an internal error, for the 500 test); a prompt ending in `error_token` ends
    with finish_reason "error" after its first step (as when the real scheduler's step fails)."""

    def __init__(self, *, max_slots: int = 4, max_waiting: int = 64, max_seq_len: int = 256,
                 step_seconds: float = 0.002, fail_token: int | None = None,
                 error_token: int | None = None) -> None:
        self.max_slots = max_slots
        self.max_waiting = max_waiting
        self.max_seq_len = max_seq_len
        self.step_seconds = step_seconds
        self.fail_token = fail_token
        self.error_token = error_token
        self.closed = False
        self._waiting: deque[FakeStream] = deque()
        self._running: list[FakeStream] = []
        self._lock = threading.Lock()
        self._go = threading.Event()
        self._go.set()
        self._stop = threading.Event()
        self._steps = 0
        self._thread = threading.Thread(target=self._loop, name="fake-scheduler", daemon=True)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def slots_used(self) -> int:
        return len(self._running)

    def start(self) -> None:
        self._thread.start()

    def pause(self) -> None:
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> FakeStream:
        if self.closed:
            raise SchedulerClosed("the scheduler is draining")
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if self.fail_token is not None and prompt_ids[-1] == self.fail_token:
            raise RuntimeError("the fake scheduler's deliberate failure")
        if len(prompt_ids) + params.max_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_tokens ({params.max_tokens}) > "
                             f"max_seq_len ({self.max_seq_len})")
        with self._lock:
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests waiting")
            stream = FakeStream(prompt_ids, params)
            self._waiting.append(stream)
        return stream

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._go.wait(0.05):
                continue
            self._step()
            time.sleep(self.step_seconds)

    def _step(self) -> None:
        with self._lock:
            while self._waiting and len(self._running) < self.max_slots:
                self._running.append(self._waiting.popleft())
            running = list(self._running)
        self._steps += 1
        per_step = 1 + self._steps % 3
        for stream in running:
            end = stream.requested_end
            tokens: list[int] = []
            while end is None and len(tokens) < per_step:
                token = stream.next_token()
                tokens.append(token)
                stream.output_ids.append(token)  # next_token reads the length
                if token == EOS and not stream.params.ignore_eos:
                    end = "stop"
                elif len(stream.output_ids) >= stream.params.max_tokens:
                    end = "length"
            del stream.output_ids[len(stream.output_ids) - len(tokens):]
            if end is None and self.error_token is not None and tokens \
                    and stream.prompt_ids[-1] == self.error_token and stream.output_ids:
                tokens, end = [], "error"
            stream._deliver(tokens, end)
            if end is not None:
                with self._lock:
                    self._running.remove(stream)

    def drain(self, timeout: float | None = None) -> bool:
        self.closed = True
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._running or self._waiting:
            if deadline is not None and time.monotonic() > deadline:
                self._abort_all()
                return False
            time.sleep(0.005)
        return True

    def _abort_all(self) -> None:
        with self._lock:
            streams = list(self._running) + list(self._waiting)
            self._running.clear()
            self._waiting.clear()
        for stream in streams:
            stream._deliver([], "abort")

    def close(self) -> None:
        self.closed = True
        self._abort_all()
        self._stop.set()
        self._go.set()
        if self._thread.is_alive():
            self._thread.join(5.0)


def expected_ids(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What a greedy request returns from the fake: its tokens up to eos or max_tokens."""
    stream = FakeStream(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=ignore_eos))
    while len(stream.output_ids) < max_tokens:
        token = stream.next_token()
        stream.output_ids.append(token)
        if token == EOS and not ignore_eos:
            break
    return stream.output_ids
