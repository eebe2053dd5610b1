"""Batch buckets captured one after another: the first before the engine serves, the rest on a
background thread while it serves.

A loaded engine is ready to serve one row as soon as bucket 1's iteration graphs are captured
(runtime/step_graphs.py): with gamma="auto", those of target-only and the smallest gamma, what
a controller runs first; its other gammas (`Bucket.deferred`, not chosen until captured) come
first on the thread of a `BackgroundCapture`, then the other buckets' graphs (10 per bucket
for an engine with a draft and gamma="auto"), in the order it is given (fuser/engine.py: 1,
the largest, then the rest ascending). Until a bucket is ready,
`Engine.bucket` steps its rows in the smallest *ready* bucket that holds them (a larger bucket's
extra rows are free rows: computed and kept by nobody), or, where none is ready, in the bucket
itself uncaptured (`Bucket.run` runs the same function without its graph). Neither waits: a
decode step reads every weight once whatever the batch, so a larger captured bucket costs barely
more than the right one, and an uncaptured step costs host launch time (a few ms), where waiting
for a capture would cost seconds.

Two hazards come with capturing while another thread serves, and this module's two locks
answer them:

- A capture's warm-up runs the iteration for real, over rows [:b] of the engine's one KV cache
  and decode state, which the serving thread's requests live in. `StepGate` keeps them apart:
  the serving side holds it shared for one scheduler iteration (or one `generate`), the
  capturing side exclusively for one graph's warm-up, which `RowSnapshot` undoes: a step only
  writes cache slots past each row's length and then moves the lengths (rollback is a length
  update, runtime/speculative.py), so restoring the lengths and the decode state restores every
  row. The gate prefers the capturing side once it waits: warm-ups are short and rare, and a
  serving loop that re-enters at once would otherwise starve it.
- The capture itself only records kernels: it runs beside the serving thread's steps.
  runtime/cuda_graphs.py `capture_graph` captures on its own stream in "thread_local" mode (the
  serving thread's allocations and syncs do not touch it), into the engine's graph pool (which
  allocates only for work on the capturing stream), one capture at a time in the process.

A bucket whose capture raises is logged and warned about and runs uncaptured; the thread never
leaves a waiter hanging (`wait` returns once every bucket is captured or failed, or when the
thread stops).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

log = logging.getLogger("fuser")

PENDING, CAPTURING, READY, FAILED, STOPPED = "pending", "capturing", "ready", "failed", "stopped"


class CaptureStopped(Exception):
    """Raised by a bucket's capture function that saw the stop event between two graphs (the
    bucket keeps the graphs it has; the rest of its shapes run uncaptured)."""


class StepGate:
    """Shared for serving (many holders at once, re-entrant per thread), exclusive for a capture's
    warm-up; a waiting exclusive holder goes before new shared ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared: dict[int, int] = {}  # thread id -> depth
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Held around one unit of serving work (a scheduler iteration, a generation)."""
        me = threading.get_ident()
        with self._cond:
            if me not in self._shared:  # re-entry (generate inside a held gate) never waits
                self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._shared[me] = self._shared.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                self._shared[me] -= 1
                if not self._shared[me]:
                    del self._shared[me]
                self._cond.notify_all()

    @property
    def waiting(self) -> bool:
        """Whether an exclusive holder waits (serving should let go at its next boundary)."""
        return self._waiting > 0

    @contextmanager
    def exclusive(self, stop: threading.Event | None = None) -> Iterator[bool]:
        """Held around one warm-up; yields False (not held) if `stop` is set while waiting."""
        with self._cond:
            self._waiting += 1
            try:
                while self._shared or self._exclusive:
                    if stop is not None and stop.is_set():
                        break
                    self._cond.wait(0.05 if stop is not None else None)
                held = not (self._shared or self._exclusive)
                if held:
                    self._exclusive = True
            finally:
                self._waiting -= 1
                self._cond.notify_all()
        try:
            yield held
        finally:
            if held:
                with self._cond:
                    self._exclusive = False
                    self._cond.notify_all()


class RowSnapshot:
    """The per-row tensors a step moves (each model's cache lengths, every decode-state tensor),
    copied now and put back by `restore`: what undoes a warm-up over rows that serve requests."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.saved = [t.clone() for t in tensors]

    @classmethod
    def of_bucket(cls, bucket: Any) -> RowSnapshot:
        """The lengths of the bucket's target and draft caches (and a paged cache's block
        table) and its decode state, rows [:bucket.batch] (views of the engine's)."""
        tensors: list[torch.Tensor] = []
        for model in (bucket.target, bucket.draft):
            if model is None:
                continue
            cache = model.cache
            tensors += [cache.seq_lens, cache.starts]
            if cache.block_table is not None:
                tensors.append(cache.block_table)
        tensors += [t for t in vars(bucket.state).values() if isinstance(t, torch.Tensor)]
        return cls(tensors)

    def restore(self) -> None:
        for tensor, saved in zip(self.tensors, self.saved):
            tensor.copy_(saved)


def stepping(engine: object) -> Any:
    """`engine.stepping()` (fuser/engine.py), or nothing for an engine without one (a fake)."""
    hold = getattr(engine, "stepping", None)
    return hold() if hold is not None else contextlib.nullcontext()


def capture_waiting(engine: object) -> bool:
    """Whether a background warm-up waits for `engine`'s rows (the scheduler then ends its
    iteration at the step in flight instead of queuing the next: a warm-up waits one step)."""
    return bool(getattr(engine, "capture_waiting", False))


class BackgroundCapture:
    """Captures buckets in `order`: the first by `capture_now(order[0])` on the calling thread,
    the rest on a thread started by `start()`.

    capture: bucket size -> failure messages (each shape that failed runs uncaptured); an
        exception marks the bucket failed (it runs uncaptured) and is logged, never raised.
    log_line: receives a line per captured bucket and one when all are done.
    first_rest: the first bucket's shapes its foreground capture left (-> failure messages),
        captured first on the thread; the bucket is ready before (its missing shapes run
        uncaptured, or not at all: `Bucket.deferred`), and `wait()` waits for them too.
    """

    def __init__(self, order: list[int], capture: Callable[[int], list[str]],
                 log_line: Callable[[str], None] | None = None,
                 first_rest: Callable[[], list[str]] | None = None) -> None:
        if not order or len(set(order)) != len(order):
            raise ValueError(f"the capture order must name each bucket once, got {order}")
        self.order = list(order)
        self._capture = capture
        self._first_rest = first_rest
        self.first_rest_done = first_rest is None
        self._say = log_line or (lambda message: None)
        self.status: dict[int, str] = {size: PENDING for size in order}
        self.seconds: dict[int, float] = {}
        self.failures: list[str] = []
        self.stop_event = threading.Event()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None

    # -- state ------------------------------------------------------------------------------------

    def ready(self, size: int) -> bool:
        """Whether bucket `size`'s graphs are captured (and so replayed from now on)."""
        return self.status.get(size) == READY

    @property
    def done(self) -> bool:
        """Every bucket captured or failed (the first one's rest too), or the thread stopped."""
        return self.first_rest_done and \
            all(s in (READY, FAILED, STOPPED) for s in self.status.values())

    def wait(self, size: int | None = None, timeout: float | None = None) -> bool:
        """Block until bucket `size` (None: every bucket, the first one's rest included) is
        captured, failed or stopped; True when it was captured (every one of them, for None),
        False on failure or timeout."""
        sizes = self.order if size is None else [size]
        with self._cond:
            self._cond.wait_for(lambda: (size is not None or self.first_rest_done)
                                and all(self.status[s] in (READY, FAILED, STOPPED)
                                        for s in sizes), timeout)
            return (size is not None or self.first_rest_done) and \
                all(self.status[s] == READY for s in sizes)

    # -- capturing --------------------------------------------------------------------------------

    def _run(self, size: int) -> None:
        with self._cond:
            if self.stop_event.is_set():
                self.status[size] = STOPPED
                self._cond.notify_all()
                return
            self.status[size] = CAPTURING
        start = time.perf_counter()
        try:
            failures = self._capture(size)
        except CaptureStopped:
            with self._cond:
                self.status[size] = STOPPED
                self._cond.notify_all()
            return
        except Exception as e:  # noqa: BLE001 -- the bucket runs uncaptured; said, never raised
            log.exception("fuser: capturing batch bucket %d failed", size)
            message = (f"bucket {size}: capture failed ({type(e).__name__}: "
                       f"{str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}); "
                       "it runs uncaptured")
            warnings.warn(f"fuser: {message}", stacklevel=2)
            with self._cond:
                self.failures.append(message)
                self.status[size] = FAILED
                self._cond.notify_all()
            return
        seconds = time.perf_counter() - start
        with self._cond:
            self.failures += failures
            self.seconds[size] = seconds
            self.status[size] = READY
            self._cond.notify_all()

    def capture_now(self, size: int) -> None:
        """Capture bucket `size` on this thread (before `start`: the first, or every one)."""
        if self.status[size] == PENDING:
            self._run(size)

    def start(self) -> None:
        """Capture the other buckets on a background thread (once)."""
        if self._thread is not None:
            return
        rest = [s for s in self.order[1:] if self.status[s] == PENDING]
        if not rest and self.first_rest_done:
            self.finished_at = time.perf_counter()
            return
        self.started_at = time.perf_counter()
        # A daemon thread (a process may exit while it captures), stopped and joined at exit
        # (`_stop_at_exit`) rather than killed inside a CUDA call.
        self._thread = threading.Thread(target=self._loop, args=(rest,),
                                        name="fuser-bucket-capture", daemon=True)
        _running.add(self)
        self._thread.start()

    def _finish_first(self) -> None:
        """The first bucket's shapes its foreground capture left (a failure is logged and
        warned about, never raised: those shapes run uncaptured)."""
        try:
            if not self.stop_event.is_set():
                failures = self._first_rest()
                with self._cond:
                    self.failures += failures
        except CaptureStopped:
            pass
        except Exception as e:  # noqa: BLE001 -- its shapes run uncaptured; said, never raised
            log.exception("fuser: capturing the rest of batch bucket %d failed", self.order[0])
            message = (f"bucket {self.order[0]}: capture of its other shapes failed "
                       f"({type(e).__name__}); they run uncaptured")
            warnings.warn(f"fuser: {message}", stacklevel=2)
            with self._cond:
                self.failures.append(message)
        finally:
            with self._cond:
                self.first_rest_done = True
                self._cond.notify_all()

    def _loop(self, rest: list[int]) -> None:
        try:
            if not self.first_rest_done:
                self._finish_first()
            for size in rest:
                self._run(size)
            self.finished_at = time.perf_counter()
            if not self.stop_event.is_set():
                captured = [s for s in rest if self.status[s] == READY]
                what = f"batch buckets {captured}" if self._first_rest is None else \
                    f"the rest of batch bucket {self.order[0]}" + \
                    (f" and batch buckets {captured}" if captured else "")
                self._say(f"captured the step graphs of {what} in the background in "
                          f"{self.finished_at - (self.started_at or 0.0):.1f} s"
                          + (f" ({len(self.failures)} shapes run uncaptured)"
                             if self.failures else ""))
        finally:
            with self._cond:  # whatever happened, nobody waits on a bucket left pending
                self.first_rest_done = True
                for size in rest:
                    if self.status[size] in (PENDING, CAPTURING):
                        self.status[size] = STOPPED
                self._cond.notify_all()

    def stop(self, timeout: float | None = 30.0) -> bool:
        """Capture nothing more (the graph under capture finishes) and join the thread; True
        when it has ended."""
        self.stop_event.set()
        with self._cond:
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            return not thread.is_alive()
        return True

    @property
    def alive(self) -> bool:
        """Whether the background thread runs."""
        return self._thread is not None and self._thread.is_alive()


_running: weakref.WeakSet[BackgroundCapture] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    """At interpreter exit: stop every background capture after its graph under way."""
    for job in list(_running):
        job.stop(timeout=60.0)
