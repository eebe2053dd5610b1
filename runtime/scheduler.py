"""Continuous batching: requests join and leave the running batch between steps.

The engine's KV caches and its `DecodeState` have max_batch_size rows; every batch bucket runs
over rows [:bucket] of them (runtime/step_graphs.py). The scheduler treats the rows as slots:

    rows [0, n)   the n running requests, always packed at the front, so that a step runs in
                  the smallest bucket >= n (`Engine.bucket`);
    rows [n, ..)  free: inactive in the state (a step computes them and keeps nothing).

Between two steps, on the host:
    retire  a finished or cancelled request leaves; the last running row moves into its slot
            (`_move_row`: its KV rows in both caches, its lengths and its state row), so the rows
            stay packed;
    admit   waiting requests join in groups of one prompt length: the prompts are prefilled
            into rows [0, k) through the prefill of the smallest bucket b >= k (its captured
            graphs on CUDA; rows [k, b) dummies, free rows, where those fit and are few,
            else the largest bucket <= k), which writes those rows only; the running requests
            in rows [0, b) move to free rows past them first, and back next to the group after
            (`_place`, `_pack`). The first tokens are chosen there (time to first token).
            Admissions per step are bounded by `prefill_tokens` so that running rows wait at
            most about one prefill of that size; while nothing decodes, groups follow one
            another until the rows are full. Requests arriving together join together
            (`_admission_due`): an idle loop gathers a burst until it ends (ADMISSION_QUIET
            without an arrival) or fills the rows, and beside decoding rows waiting requests
            are admitted as a batch (ADMISSION_BATCH of the rows) or once the oldest waited
            ADMISSION_STEPS steps, each admission draining the steps queued ahead once;
    step    one iteration of the bucket (target-only, or draft + verify with the adaptive
            gamma), then one read-back of the packed tokens: each row keeps n + 1 tokens up to
            its eos and budget, exactly as `generate` does.

A paged engine (FuserConfig(kv_block_size=N)) gives blocks to requests as they need them,
through a `BlockManager` over the engine's own block table (runtime/blocks.py):
    admit   a request joins only when its blocks are available (`admit`; else it waits, FCFS),
            keeping a block of headroom per running row; a prompt that opens with cached
            blocks (prefix caching, on by default) prefills only the rest, through the CHUNK
            step at seq_lens = the cached tokens (`speculative.prefill_chunk`); the prompt's
            full blocks are then keyed for later requests (`commit`), and the blocks decoding
            fills once both caches hold their k/v (`_commit_decoded`); after the draft's
            weights changed (`draft_weights_changed`), a hit's blocks keep the target's k/v
            and the draft alone is prefilled over them again (`_refresh_draft`);
    step    before each step every row grows to the slots the step may write (`grow`); when
            blocks run out, the newest row is preempted: its blocks are freed and its request
            goes back to the front of the queue with the tokens it has, to be prefilled again
            (mostly prefix-cache hits) and to go on where it stopped;
    retire  a finished or cancelled request's blocks go back (`release`);
and the table is copied to the device before each step (`sync_table`: on CUDA the captured
graphs read it where it lives). Rows move by moving their table rows, never their blocks.
With `max_num_batched_tokens` (paged engines), admission never stalls the running rows:
    admit   one group at a time takes rows [0, k) with its blocks, inactive in the decode
            state; each iteration runs its next prompt chunk through the CHUNK step (at most
            the budget less the running rows' decode tokens; `speculative.prefill_part`), then
            the running rows' step; the chunk that ends the prompts chooses the first tokens
            and activates the rows (`prefill_chunk`). Meanwhile the group's table rows are null
            on the device for the decode steps (they write nothing into its blocks), a
            cancelled row frees its blocks at once, and the group is the first preempted when
            blocks run out (docs/paged-kv.md);
    ahead   while the rows stay as they are, each chunk but the last is queued with its decode
            step before the step in flight is read back (`_chunk_ahead`: why that is safe), so
            running rows keep the overlap while prompts join; the last chunk reads the first
            tokens back and runs at the next admission. `steps_ahead` / `chunks_ahead` count
            the steps queued ahead and those that carried a chunk.

A request's tokens do not depend on what else runs: its row's arithmetic is the same in any
bucket (up to the rounding of batched kernels; exactly so in fp32 on the CPU), and sampling
draws from the row's own seed and output index (runtime/sampling.py `draw_keys`). A batch in
which some rows sample runs the sampling iteration; its greedy rows then have top_k = 1, which
picks the argmax (and accepts a draft exactly when it is the target's argmax).

Prefill and chunk graphs are never captured on a request's path (`capture_at_idle`, the
default; runtime/idle_capture.py): while the loop serves, a (bucket, padded length) without its
graph runs uncaptured and is queued, and the loop captures the queued shapes one at a time when
no request runs or waits (`_capture_idle`: holding the engine, on free rows whose writes land
nowhere that matters, `_capture_rows`); a request arriving meanwhile waits for at most the
capture under way. `precapture` plans the likeliest shapes for idle time as well.
`graphs_captured_on_path`, `graphs_run_uncaptured` and `graphs_captured_idle` count them.

The stepping runs on one background thread; `submit` and `RequestStream.cancel` are safe from
any thread, and a `RequestStream` is read with a blocking iterator or `async for`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fuser.runtime import speculative
from fuser.runtime.blocks import BlockManager
from fuser.runtime.bucket_capture import capture_waiting, stepping
from fuser.runtime.generate import ReadBack
from fuser.runtime.host_copies import to_device
from fuser.runtime.idle_capture import PLAN_QUIET, IdleCaptures
from fuser.runtime.prompts import Prompts, pad_batch
from fuser.runtime.speculative import EOS_SLOTS
from fuser.runtime.step_graphs import PLAIN

if TYPE_CHECKING:
    from fuser.engine import Engine
    from fuser.runtime.kv_cache import KVCache

__all__ = ["QueueFull", "RequestStream", "SamplingParams", "Scheduler", "SchedulerClosed"]

log = logging.getLogger("fuser")

# Admission (`Scheduler._admission_due`). Beside decoding rows, a batch of ADMISSION_BATCH of
# the rows' count is admitted at once; fewer waiting requests are held back at most
# ADMISSION_STEPS decode steps (the step time measured as the scheduler runs; DEFAULT_STEP_SECONDS
# before the first) so that requests arriving close together share one prefill. While nothing
# runs, they wait until ADMISSION_QUIET seconds pass without a new arrival (a burst's requests
# arrive well under a millisecond apart; one request alone then waits only that long), at most
# ADMISSION_GATHER.
ADMISSION_STEPS = 2
ADMISSION_BATCH = 0.25
DEFAULT_STEP_SECONDS = 0.005
ADMISSION_QUIET = 0.002
ADMISSION_GATHER = 0.05  # the longest an idle scheduler gathers arrivals that never pause
# Arrivals one at a time (a client that waits for each answer, the prefix-cache benchmark's
# timed requests): from the SPARSE_ARRIVALS-th request in a row that arrived more than
# admission_quiet after the one before, a lone request on an idle scheduler is admitted at
# once, not after the quiet time (there is no burst to gather); an arrival within it of the
# one before (a burst) restores the quiet time.
SPARSE_ARRIVALS = 4
# A group of k prompts prefills through the smallest bucket that holds it when its extra rows
# (dummies, computed for nothing) are at most MAX_DUMMIES x k: one prefill reads the weights
# once and syncs once, where the buckets k splits into (15 = 8 + 4 + 2 + 1) would each do both.
MAX_DUMMIES = 0.5
# A group whose prompts have prefix-cache hits of different lengths prefills them through one
# CHUNK step from its shortest hit: every row recomputes its cached tokens past that one. A
# request joins the group while the cached tokens so recomputed stay within MIXED_HIT_TOKENS in
# all; the others wait for the next group, one more prefill (a weights read: on the 8B shape
# that costs about what prefilling ~240 prompt tokens does, from the 28.9 ms prefill of 1,152
# tokens in benchmarks/RESULTS.md, "Prefix caching").
MIXED_HIT_TOKENS = 256
STEP_AVERAGING = 0.2  # weight of a new read-back interval in the step time's moving average
IDLE_CAPTURE_RETRY = 0.05  # seconds before an idle capture tries again (another holds the engine)


class QueueFull(Exception):
    """The waiting queue is at its bound (`Scheduler(max_waiting=...)`): try again later."""


class SchedulerClosed(Exception):
    """The scheduler is draining or closed: it takes no new requests."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's decoding parameters (OpenAI's names).

    temperature 0 is greedy; top_p None or 1.0 and top_k None, 0 or -1 are off. A seeded
    request returns the same tokens whatever else runs beside it. eos_token_id None: the
    engine's generation config; ignore_eos: generate max_tokens tokens whatever comes.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    ignore_eos: bool = False
    eos_token_id: tuple[int, ...] | list[int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class RequestStream:
    """One submitted request: its tokens as they come (iterate, or `async for`), its timing,
    and `cancel` / `finish` to stop it early (from any thread)."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 eos: list[int], seed: int) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.eos = eos
        self.seed = seed
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []
        self._items: deque[list[int]] = deque()
        self._cond = threading.Condition()
        self._stop_reason: str | None = None  # asked for by cancel/finish, acted on by the loop
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._on_stop: Callable[[], None] | None = None  # the scheduler's wake-up
        self.preemptions = 0  # times its blocks were taken back and it was requeued
        self._admitted = 0  # the scheduler's admission counter when it last joined
        # Leading slots of its row whose k/v in the draft's cache are the draft's own over its
        # tokens (a paged draft engine's scheduler keys decoded blocks only below this).
        self._draft_valid = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_requested(self) -> str | None:
        return self._stop_reason

    def cancel(self) -> None:
        """Stop generating (finish_reason "abort"); the slot is free at the next step."""
        self.finish("abort")

    def finish(self, reason: str) -> None:
        """Stop generating with `reason` (e.g. "stop" when the caller found a stop string)."""
        if self.done or self._stop_reason is not None:
            return
        self._stop_reason = reason
        if self._on_stop is not None:
            self._on_stop()

    # -- the scheduler's side --------------------------------------------------------------------

    def _deliver(self, tokens: list[int], finish_reason: str | None = None) -> None:
        now = time.perf_counter()
        with self._cond:
            if self.done:
                return
            if tokens:
                if self.first_token_time is None:
                    self.first_token_time = now
                self.output_ids.extend(tokens)
                self.token_times.append(now)
                self._items.append(tokens)
            if finish_reason is not None:
                self.finish_reason = finish_reason
                self.finish_time = now
            self._cond.notify_all()
            for loop, event in self._waiters:
                if event.is_set():  # (set, not yet cleared: its reader looks at the items
                    continue        # before it waits again, so these tokens are seen)
                try:
                    loop.call_soon_threadsafe(event.set)  # (a write to the loop's self-pipe)
                except RuntimeError:  # the loop is closed: its reader is gone
                    pass

    # -- the reader's side -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        """Blocking: the new token ids of each step, until the request finishes."""
        while True:
            with self._cond:
                while not self._items and not self.done:
                    self._cond.wait()
                if self._items:
                    item = self._items.popleft()
                else:
                    return
            yield item

    async def __aiter__(self) -> AsyncIterator[list[int]]:
        """`async for tokens in stream`: the new token ids of each step."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self._cond:
            self._waiters.append(entry)
        try:
            while True:
                with self._cond:
                    if self._items:
                        item = self._items.popleft()
                    elif self.done:
                        return
                    else:
                        item = None
                        event.clear()  # set again (on this loop) by the next delivery
                if item is None:
                    await event.wait()
                else:
                    yield item
        finally:
            with self._cond:
                self._waiters.remove(entry)

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until the request finishes; its output ids (TimeoutError past `timeout`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        return list(self.output_ids)


@dataclass
class _Step:
    """An issued iteration: the rows it ran (row i: rows[i]), its gamma and controller, its
    packed result on the way to the host, and when it was issued."""

    rows: list[RequestStream]
    gamma: int
    controller: object
    read_back: ReadBack
    start: float
    # rows [0, prefilling) were a group in chunked prefill: inactive (keyword-only, so that
    # subclasses' positional fields follow `start`)
    prefilling: int = field(default=0, kw_only=True)


@dataclass
class _ChunkedPrefill:
    """A group whose prompts go in chunks (rows [0, k), inactive in the decode state until the
    last chunk): its requests, the prompts they prefill (token_lists, tokens [k, T] on the
    device), the tokens of each already in the cache (progress; a prefix hit's cached tokens
    at first), and the sampling facts its last chunk needs."""

    group: list[RequestStream]
    token_lists: list[list[int]]
    tokens: torch.Tensor
    progress: list[int]
    emitted: torch.Tensor | None
    do_sample: bool
    refresh_draft: bool = True  # the first chunk prefills the draft over stale cached blocks


class Scheduler:
    """Continuous batching over an engine (see the module docstring).

        scheduler = Scheduler(engine, max_waiting=256)
        scheduler.start()
        stream = scheduler.submit(prompt_ids, SamplingParams(max_tokens=64, temperature=0))
        async for tokens in stream: ...          # or: for tokens in stream, stream.result()
        scheduler.drain(timeout=30); scheduler.close()

    The engine needs a batch bucket of 1 (a prompt alone is prefilled through it; CUDA engines
    have one, CPU engines are built with FuserConfig(batch_buckets=(1,)) for it). While requests run, the
    scheduler holds the engine: `engine.generate` from another thread raises until it is idle.

    On a paged engine, `prefix_caching` (default True) shares the full blocks of prompts'
    common prefixes between requests; `blocks` is the BlockManager (usage, counters).
    `max_num_batched_tokens` (paged engines; vLLM's name) prefills an admitted group's prompts
    in chunks between decode steps, each iteration at most that many tokens of decode and
    prompt together (a row in prefill takes at least 2 a chunk, the chunk step's least), so
    running rows get a token every iteration; None or 0: each group's whole prompts at once.

    `admission_wait` (seconds; None: ADMISSION_STEPS decode steps as measured) is the longest
    a waiting request is held back for others to share its prefill, and `admission_quiet`
    (seconds) the pause in arrivals that ends a burst on an idle scheduler
    (`_admission_due`); 0 and 0 admit as soon as a request waits.

    `capture_at_idle` (default True; where prefills and chunks replay CUDA graphs): a shape
    whose graph is not captured yet runs uncaptured and is captured while nothing runs or
    waits, never on a request's path (the module docstring); False: captured on the path of
    the first request that needs it, as `generate` does.
    """

    def __init__(self, engine: Engine, *, max_waiting: int = 256,
                 prefill_tokens: int = 2048, prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = None,
                 admission_wait: float | None = None,
                 admission_quiet: float = ADMISSION_QUIET,
                 capture_at_idle: bool = True) -> None:
        if engine.target is None:
            raise ValueError("the scheduler needs an engine whose target was captured; this one "
                             "runs the model in eager Hugging Face (see engine.report().fallbacks)")
        if 1 not in engine.buckets:
            raise ValueError(
                f"the engine has batch buckets {sorted(engine.buckets)} but the scheduler "
                "prefills through a bucket of 1: build it with FuserConfig(batch_buckets=(1,)) "
                "(CUDA engines have it by default)")
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting!r} must be an int >= 0")
        for name, value in (("admission_wait", admission_wait),
                            ("admission_quiet", admission_quiet)):
            if value is not None and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not value >= 0):
                raise ValueError(f"{name}={value!r} must be a number of seconds >= 0")
        self.engine = engine
        self.max_waiting = max_waiting
        self.prefill_tokens = prefill_tokens
        self.max_slots = max(engine.buckets)
        self.max_seq_len = engine.config.max_seq_len
        top = engine.buckets[self.max_slots]
        self._caches: list[KVCache] = [m.cache for m in (top.target, top.draft) if m is not None]
        self._state = engine.state
        self._running: list[RequestStream] = []  # row i holds _running[i]
        self._waiting: deque[RequestStream] = deque()
        self._lock = threading.Condition()
        self._closed = False
        self._stop = False
        self._thread: threading.Thread | None = None
        self._busy = False  # the loop holds the engine (`Engine.generating`)
        self._ids = itertools.count()
        # the most tokens a row moved since the draft last ran (`resync_draft`'s `behind`): one
        # a target-only step
        self._draft_behind = 0
        self._overlapped: int | None = None  # gamma of the last step if an overlapped round
        self._rng = random.Random()
        generation_config = getattr(engine.user_target, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        self._default_eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.steps = 0
        self.steps_ahead = 0  # steps issued before the step in flight was read back
        self.chunks_ahead = 0  # of which the prompt chunk of a group in prefill went first
        self.preemptions = 0
        self.blocks: BlockManager | None = None
        cache = top.target.cache
        if cache.paged:
            if any(c.block_table is not cache.block_table for c in self._caches):
                raise ValueError("the scheduler needs the draft's paged cache to share the "
                                 "target's block table (as fuser.optimize builds it)")
            self.blocks = BlockManager(cache.num_blocks, cache.k[0].shape[1], self.max_slots,
                                       cache.block_table.shape[1],
                                       prefix_caching=prefix_caching, table=cache.block_table)
        self._step_room = 1
        self._step_tokens = 1  # tokens a running row feeds a step (gamma + 1 with a verify)
        self._set_step_room()
        self._admissions = itertools.count(1)
        if max_num_batched_tokens is not None and (
                isinstance(max_num_batched_tokens, bool)
                or not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 0):
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens!r} must be an int "
                             ">= 0 (0 or None: whole prompts)")
        if max_num_batched_tokens and self.blocks is None:
            raise ValueError("max_num_batched_tokens prefills prompts in chunks through a paged "
                             "KV cache; this engine's cache is contiguous (build it with "
                             "FuserConfig(kv_block_size=N), or leave the option unset)")
        self.max_num_batched_tokens = max_num_batched_tokens or None
        self._chunking: _ChunkedPrefill | None = None  # the group in chunked prefill, rows [0, k)
        self.prefill_chunks = 0  # chunks run (the last of each prompt included)
        # Admission (`_admission_due`): how long a waiting request may be held back so that
        # others join its prefill (None: ADMISSION_STEPS steps of the running bucket, measured),
        # and, while nothing runs, the quiet time after the last arrival that closes a burst.
        self.admission_wait = admission_wait
        self.admission_quiet = admission_quiet
        self._last_arrival: float | None = None
        self._sparse = 0  # the latest arrivals in a row that came alone (SPARSE_ARRIVALS)
        self._step_seconds = DEFAULT_STEP_SECONDS  # between read-backs, averaged (`_timed`)
        self._last_read: float | None = None  # the last read-back of the current run of steps
        self.admissions = 0  # admissions that prefilled at least one group
        self.admission_drains = 0  # of which while rows were decoding (each stalls them)
        self.prefill_groups = 0  # groups prefilled whole (one prefill call each)
        self.padded_rows = 0  # dummy rows those groups ran to fill their bucket
        # Prefill and chunk graphs captured while idle, not on a request's path.
        self.capture_at_idle = bool(capture_at_idle)
        self._captures = IdleCaptures(
            g for b in engine.buckets.values() for g in getattr(b, "prefills", []))
        self._served_at = time.perf_counter()  # when the loop last let go of the engine
        self._capture_retry_at = 0.0
        self._capturing = False  # the loop holds the engine for an idle capture

    # -- public ----------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(not s.done for s in self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def slots_used(self) -> int:
        return len(self._running)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the paged KV pool's blocks held by requests (0..1; vLLM's
        kv_cache_usage_perc); a contiguous cache: the fraction of rows in use."""
        if self.blocks is not None:
            return self.blocks.usage()
        return len(self._running) / self.max_slots

    @property
    def graphs_captured_on_path(self) -> int:
        """Prefill and chunk graphs captured on a request's path (0 with `capture_at_idle`)."""
        return self._captures.captured_on_path

    @property
    def graphs_run_uncaptured(self) -> int:
        """Prefills and chunks run uncaptured because their shape waited for its capture."""
        return self._captures.run_uncaptured

    @property
    def graphs_captured_idle(self) -> int:
        """Prefill and chunk graphs captured while nothing ran or waited."""
        return self._captures.captured_idle

    def precapture(self, seconds: float, longest: int = 512) -> int:
        """Plan captures of the likeliest prefill and chunk shapes for idle time, at most
        `seconds` of them (runtime/idle_capture.py `IdleCaptures.plan_likely`: bucket 1 and
        a burst's bucket at each captured length up to `longest` tokens first, then the
        buckets between). They run after
        PLAN_QUIET seconds with nothing served, one at a time, after the shapes requests
        needed; a request that arrives waits for at most the capture under way. Returns how
        many shapes were planned (0 where nothing is captured, or without `capture_at_idle`).
        seconds <= 0 drops the plan."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
            raise ValueError(f"seconds={seconds!r} must be a number")
        if not self.capture_at_idle:
            return 0
        with self._lock:
            count = self._captures.plan_likely(self.engine.buckets, self.prefill_tokens,
                                               float(seconds), longest)
            self._lock.notify_all()
        return count

    def wait_captures(self, timeout: float | None = None, planned: bool = False) -> bool:
        """Block until no shape a request needed waits for its capture (and, with `planned`,
        the `precapture` plan is done or out of budget); False after `timeout` s."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not self._busy_capturing() and not self._captures.pending()
                and not (planned and self._captures.planned()), timeout)

    def start(self) -> None:
        """Start the stepping thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="fuser-scheduler",
                                            daemon=True)
            self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None
               ) -> RequestStream:
        """Queue a request; returns at once. Raises ValueError (a bad prompt or parameter, named),
        QueueFull, or SchedulerClosed."""
        params = params if params is not None else SamplingParams()
        prompt = self._check(prompt_ids, params)
        if params.ignore_eos:
            eos: list[int] = []
        elif params.eos_token_id is not None:
            eos = [int(t) for t in params.eos_token_id]
        else:
            eos = list(self._default_eos)
        if len(eos) > EOS_SLOTS:
            raise ValueError(f"eos_token_id has {len(eos)} ids; at most {EOS_SLOTS} are supported")
        if self.blocks is not None:
            need = self.blocks.blocks_for(self._row_cap(len(prompt), params.max_tokens))
            if need > self.blocks.usable_blocks:
                raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens="
                                 f"{params.max_tokens} needs {need} KV blocks of "
                                 f"{self.blocks.block_size} slots; this engine's pool has "
                                 f"{self.blocks.usable_blocks}")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        with self._lock:
            if self._closed:
                raise SchedulerClosed("the server is shutting down: it takes no new requests")
            if len(self._waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting, the bound "
                                f"(max_waiting={self.max_waiting}): try again later")
            stream = RequestStream(f"req-{next(self._ids)}", prompt, params, eos, seed)
            stream._on_stop = self._wake
            last, self._last_arrival = self._last_arrival, stream.arrival_time
            alone = last is None or stream.arrival_time - last > self.admission_quiet
            self._sparse = self._sparse + 1 if alone else 0
            self._waiting.append(stream)
            self._lock.notify_all()
        return stream

    def draft_weights_changed(self) -> None:
        """The draft's weights were changed in place (runtime/distill.py `WeightSwap`): the
        draft's k/v in cached blocks are stale from now on, and a later prefix-cache hit
        prefills the draft over them again while it keeps the target's
        (`BlockManager.draft_changed`). Call it on the scheduler's thread between steps, or
        while the loop is not running, before the next admission."""
        if self.blocks is not None:
            self.blocks.draft_changed()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing runs or waits (every slot free) and no shape a request needed
        waits for its idle capture (the loop holds the engine while it captures one); False
        after `timeout` s."""
        with self._lock:
            return self._lock.wait_for(
                lambda: not self._running and not self._waiting and not self._busy
                and not (self.capture_at_idle and self._captures.pending()), timeout)

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new requests; let the running and waiting ones finish (aborting what still
        runs after `timeout` seconds). True when everything finished on its own."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
            finished = self._lock.wait_for(lambda: not self._running and not self._waiting,
                                           timeout)
        if not finished:
            for stream in list(self._running) + list(self._waiting):
                stream.cancel()
            with self._lock:
                self._lock.wait_for(lambda: not self._running and not self._waiting, 10.0)
        return finished

    def close(self) -> None:
        """Abort everything and stop the thread (idempotent)."""
        with self._lock:
            self._closed = True
            for stream in list(self._running) + list(self._waiting):
                stream._stop_reason = stream._stop_reason or "abort"
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
        # Whatever the thread did not get to (or when it never ran) ends here.
        for stream in list(self._running) + list(self._waiting):
            stream._deliver([], stream._stop_reason or "abort")
        self._running.clear()
        self._waiting.clear()

    # -- checks ----------------------------------------------------------------------------------

    def _check(self, prompt_ids: object, params: SamplingParams) -> list[int]:
        if isinstance(prompt_ids, torch.Tensor):
            prompt_ids = prompt_ids.flatten().tolist()
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.engine.vocab_size
        if all(type(token) is int for token in prompt_ids) \
                and 0 <= min(prompt_ids) and max(prompt_ids) < vocab:
            prompt = list(prompt_ids)  # (plain ints in range: checked at once, no per-token loop)
        else:
            prompt = []
            for token in prompt_ids:
                if isinstance(token, bool) or not isinstance(token, int) \
                        or not 0 <= token < vocab:
                    raise ValueError(f"the prompt holds {token!r}, not a token id in "
                                     f"[0, {vocab})")
                prompt.append(int(token))
        p = params
        if isinstance(p.max_tokens, bool) or not isinstance(p.max_tokens, int) or p.max_tokens < 1:
            raise ValueError(f"max_tokens={p.max_tokens!r} must be an int >= 1")
        if len(prompt) + p.max_tokens > self.max_seq_len:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_tokens={p.max_tokens} "
                             f"is {len(prompt) + p.max_tokens} tokens, above this engine's "
                             f"max_seq_len={self.max_seq_len}")
        if isinstance(p.temperature, bool) or not isinstance(p.temperature, (int, float)) \
                or not p.temperature >= 0:
            raise ValueError(f"temperature={p.temperature!r} must be a number >= 0")
        if p.top_p is not None and (isinstance(p.top_p, bool) or not isinstance(
                p.top_p, (int, float)) or not 0 < p.top_p <= 1):
            raise ValueError(f"top_p={p.top_p!r} must be a number in (0, 1]")
        if p.top_k is not None and (isinstance(p.top_k, bool) or not isinstance(p.top_k, int)
                                    or p.top_k < -1):
            raise ValueError(f"top_k={p.top_k!r} must be an int >= 1 (or 0 / -1: off)")
        if p.seed is not None and (isinstance(p.seed, bool) or not isinstance(p.seed, int)
                                   or not -2**63 <= p.seed < 2**63):
            raise ValueError(f"seed={p.seed!r} must be an int in [-2**63, 2**63) (int64)")
        for token in p.eos_token_id or ():
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab:
                raise ValueError(f"eos_token_id holds {token!r}, not a token id in [0, {vocab})")
        return prompt

    # -- the loop --------------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify_all()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self._running or self._waiting):
                    due = self._idle_capture_in()
                    if due <= 0:
                        break
                    self._lock.wait(None if due == float("inf") else due)
                if self._stop:
                    return
                capturing = not (self._running or self._waiting)
                self._busy = True
                self._capturing = capturing
            if capturing:
                try:
                    self._capture_idle()
                except Exception:  # noqa: BLE001 -- never the loop's end: serving goes on
                    log.exception("fuser: an idle capture failed")
                with self._lock:
                    self._busy = self._capturing = False
                    self._lock.notify_all()
                continue
            try:
                with self.engine.generating(), self._deferring():
                    while not self._stop and (self._running or self._waiting):
                        if self._gathering():
                            continue
                        with stepping(self.engine):  # a background capture's warm-up waits
                            self._iteration()
            except Exception as e:  # noqa: BLE001 -- a failed step ends its requests, not the server
                log.exception("fuser: a scheduler step failed; its requests end with 'error'")
                self._fail_all(f"error: {type(e).__name__}: {e}")
            with self._lock:
                self._busy = False
                self._served_at = time.perf_counter()
                self._lock.notify_all()  # wait_idle() and drain() wait for this

    # -- captures while idle ---------------------------------------------------------------------

    def _deferring(self) -> contextlib.AbstractContextManager[None]:
        """While serving: prefill and chunk shapes without a graph run uncaptured and wait
        for an idle capture (`capture_at_idle`)."""
        return self._captures.deferring() if self.capture_at_idle \
            else contextlib.nullcontext()

    def _busy_capturing(self) -> bool:
        """Whether the loop is capturing a shape now (lock held)."""
        return self._busy and self._capturing

    def _idle_capture_in(self) -> float:
        """Seconds until the idle loop should capture (lock held; nothing runs or waits):
        <= 0 now (a shape a request needed waits; or planned shapes are left and nothing was
        served for PLAN_QUIET s), inf when there is nothing to capture."""
        if not self.capture_at_idle:
            return float("inf")
        now = time.perf_counter()
        if self._captures.pending():
            return self._capture_retry_at - now
        if self._captures.planned():
            return max(self._served_at + PLAN_QUIET, self._capture_retry_at) - now
        return float("inf")

    def _capture_idle(self) -> None:
        """Capture one queued shape (`IdleCaptures.next`) while nothing runs or waits,
        holding the engine (an `engine.generate` elsewhere makes it try again shortly) and the
        step gate (a background bucket capture's warm-up waits), on rows made safe for it
        (`_capture_rows`). A capture that fails is recorded by its graphs (the shape runs
        uncaptured); anything else is logged, and the shape is not tried again."""
        plan = time.perf_counter() >= self._served_at + PLAN_QUIET
        job = self._captures.next(plan)
        if job is None:
            return
        shape, planned = job
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self.engine.generating())
            except RuntimeError:  # a generation from another thread holds the engine
                self._capture_retry_at = time.perf_counter() + IDLE_CAPTURE_RETRY
                if planned:  # (a pending shape stays pending: `next` left it there)
                    self._captures.plan.appendleft(shape)
                return
            held.enter_context(stepping(self.engine))
            with self._lock:
                arrived = bool(self._running or self._waiting)
            if arrived:  # (while it waited for the gate): the request goes first
                if planned:
                    self._captures.plan.appendleft(shape)
                return
            try:
                with self._capture_rows(shape[0]):
                    self._captures.capture(shape, planned)
            except Exception:  # noqa: BLE001 -- a capture off the path never ends the server
                shape[0].pending.pop(shape[1], None)
                log.exception("fuser: an idle capture of %s at %d tokens failed",
                              type(shape[0]).__name__, shape[1])

    @contextlib.contextmanager
    def _capture_rows(self, graphs: object) -> Iterator[None]:
        """Rows [:B] of `graphs`' cache made safe for a capture's warm-up runs, which write
        slots [seq_lens, seq_lens + T) of each (nothing runs or waits: every row is free):
        lengths 0 (put back after), and a paged cache's device table all null rows (free
        rows' table rows may still name freed blocks there, cached ones among them, until the
        next step's `sync_table`; null, their writes land in the null block)."""
        cache = graphs.model.cache
        if self.blocks is not None:
            self.blocks.sync_table(self.max_slots)
        saved = [(t, t.clone()) for t in (cache.seq_lens, cache.starts) if t is not None]
        for tensor, _ in saved:
            tensor.zero_()
        try:
            yield
        finally:
            for tensor, value in saved:
                tensor.copy_(value)

    def _gathering(self) -> bool:
        """While nothing runs and requests wait whose admission is not due yet (a burst still
        arriving: `_admission_due`), sleep until it is due or another request arrives; True
        when it slept (the loop looks again)."""
        with self._lock:
            if self._running or not self._waiting or self._stop \
                    or any(s.stop_requested is not None for s in self._waiting):
                return False  # (a cancelled request ends at once, in the iteration's retire)
            left = self._admission_due_in()
            if left <= 0:
                return False
            self._lock.wait(left)
        return True

    def _admission_wait(self) -> float:
        """How long the oldest waiting request may be held back for others to join it."""
        if self.admission_wait is not None:
            return self.admission_wait
        return ADMISSION_STEPS * self._step_seconds

    def _admission_due(self) -> bool:
        """Whether waiting requests are to be admitted now (`_admit`; the run of steps queued
        ahead ends for them). Each admission stalls the running rows for a prefill and ends
        the run-ahead, and a prefill of k prompts reads the weights once for all k, so
        requests arriving close together are admitted together. With a row free (a finished
        row counts as free), admission is due when
          - rows decode, and ADMISSION_BATCH of the rows' count wait, or their prompts fill
            the prefill budget: a batch worth a stall (one request a finish, as a closed loop
            of clients sends, would otherwise stall the batch at every finish);
          - nothing runs, and the waiting requests fill every free row (nobody else can
            join), or no request arrived for `admission_quiet` seconds (a burst has ended;
            a lone request on an idle server waits only that long, and not at all while
            requests arrive one at a time: SPARSE_ARRIVALS), or the oldest waited
            ADMISSION_GATHER (or `admission_wait` if longer: arrivals that never pause);
          - rows decode, and the oldest has waited `admission_wait` (default ADMISSION_STEPS
            steps: a request's first token comes at most that much later, and while
            requests trickle in, rows decode about that many steps between two stalls).
        The lock is taken: the run-ahead asks between steps while clients submit, and the
        waiting queue is read whole (a deque changed while iterated raises)."""
        with self._lock:
            return self._admission_due_in() <= 0

    def _admission_due_in(self) -> float:
        """Seconds until admission is due (`_admission_due`): <= 0 when due now, inf while
        no request waits or no row can take one (lock held)."""
        waiting = self._waiting
        if not waiting:
            return float("inf")
        live = sum(not s.done for s in self._running)
        free = self.max_slots - live
        if free <= 0:
            return float("inf")  # (rows free up at a finish: a step's read-back looks again)
        if live:  # an admission stalls them: worth it for a batch, or after the wait
            if len(waiting) >= max(1, int(ADMISSION_BATCH * self.max_slots)) \
                    or sum(len(_tokens(s)) for s in waiting) >= self.prefill_tokens:
                return 0.0
        elif len(waiting) >= free:
            return 0.0
        now = time.perf_counter()
        wait = self._admission_wait()
        if live:
            return waiting[0].arrival_time + wait - now  # (a requeued request: at once)
        # Idle: nobody waits on the prefill but the burst itself, gathered until it pauses,
        # unless requests have come one at a time of late (no burst to gather).
        if len(waiting) == 1 and self._sparse >= SPARSE_ARRIVALS:
            return 0.0
        return min(waiting[0].arrival_time + max(wait, ADMISSION_GATHER),
                   max(s.arrival_time for s in waiting) + self.admission_quiet) - now

    def _timed(self, read: float) -> None:
        """A step was read back at `read` (perf_counter): the interval since the read-back
        before it in the same run of steps updates the average step time."""
        if self._last_read is not None:
            self._step_seconds += STEP_AVERAGING * (read - self._last_read - self._step_seconds)
        self._last_read = read

    def _iteration(self) -> None:
        """Retire and admit (no step in flight), then step; while nothing is to retire or admit,
        the next step is queued on the device before the host reads the last one back, as
        `generate` does, so the GPU does not wait for Python between steps. While a group is
        in chunked prefill, its next chunk is queued first, ahead too, as long as it is not
        the last one (`_may_run_ahead`, `_chunk_ahead`)."""
        self._retire()
        self._admit()
        if any(s.done for s in self._running):
            self._retire()  # rows that ended at their prefill (one token, or eos first)
        if len(self._running) == self._prefilling():
            return  # nothing decodes (no rows, or only a group in prefill: its next chunk)
        if self.blocks is not None:
            self._make_room()  # (preempts rows when blocks ran out)
        self._sync_table()
        in_flight = self._issue()
        self._last_read = None  # (a step issued after a stall times the stall, not a step)
        while True:
            ahead = None
            if self._may_run_ahead(in_flight) and self._grow_rows(steps=2):
                if self._chunking is not None:
                    self._chunk_ahead()  # (shows the group's table rows for the chunk)
                self._sync_table()  # (hides them again for the decode step)
                ahead = self._issue()
                self.steps_ahead += 1
            self._collect(in_flight)
            self._timed(time.perf_counter())
            self.steps += 1
            if ahead is None:
                break
            in_flight = ahead
        self._retire()  # the slots of what these steps finished are free at once

    def _may_run_ahead(self, in_flight: _Step) -> bool:
        """Whether to queue another step before `in_flight` is read back: only while the rows
        stay as they are (nothing to admit or cancel) and some decoding row still needs
        tokens after the step in flight (each gives every active row at least one). Waiting
        requests end the run once their admission is due (`_admission_due`: a batch of them,
        or the oldest waited about two steps), into free rows or finished ones (a finished
        row counts as free; otherwise it rode along in every step until the whole batch had
        finished, and a waiting request waited for the longest running one).

        While a group is in chunked prefill, the step ahead is its next chunk and then the
        decode step (`_chunk_ahead`), unless that chunk is the last one: the last chunk
        chooses the first tokens (read back at once) and activates the rows, so it runs in
        the next iteration's admission, with nothing in flight, as without run-ahead.
        Waiting requests are no reason to stop then: while a group is in prefill no other
        is admitted (`_admit_chunked`), so the next iteration would admit nothing."""
        if self._stop or len(self._running) != len(in_flight.rows) or capture_waiting(self.engine):
            return False
        prefilling = self._prefilling()
        if prefilling:
            if self._part_width() is None:  # the next chunk ends the prompts
                return False
        elif self._admission_due():
            return False  # into a free row, or a finished one (retired next)
        # (A done row has nothing left to stop: a cancelled row of the group, ended at a
        # retire, rides along to the group's last chunk.)
        return all(s.stop_requested is None or s.done for s in self._running) and any(
            not s.done and s.params.max_tokens - len(s.output_ids) > 1
            for s in self._running[prefilling:])

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            streams = list(self._running)
            if self.blocks is not None:
                for row in self.blocks.active_rows():
                    self.blocks.release(row)
            self._running.clear()
            self._chunking = None
            self._state.active.zero_()
        for stream in streams:
            stream._deliver([], "error")
        log.error("fuser: %s", reason)

    def _retire(self) -> None:
        """Free the slots of finished and cancelled requests, keeping the rows packed; end the
        cancelled waiting ones."""
        with self._lock:
            for stream in [s for s in self._waiting if s.stop_requested is not None]:
                self._waiting.remove(stream)
                stream._deliver([], stream.stop_requested)
            running = self._running
            self._retire_prefilling()
            row = self._prefilling()  # (rows in prefill stay where they are)
            while row < len(running):
                stream = running[row]
                if stream.stop_requested is not None and not stream.done:
                    stream._deliver([], stream.stop_requested)
                if not stream.done:
                    row += 1
                    continue
                self._remove_row(row)
            self._lock.notify_all()

    def _retire_prefilling(self) -> None:
        """Cancelled rows of the group in chunked prefill end now and free their blocks; they
        keep their rows (a chunk runs the whole group; theirs then write only the null
        block) until the prefill ends, or it ends now when none is left (lock held)."""
        if self._chunking is None:
            return
        for row, stream in enumerate(self._chunking.group):
            if stream.stop_requested is not None and not stream.done:
                stream._deliver([], stream.stop_requested)
            if stream.done and self.blocks.holds(row):
                self.blocks.release(row)
        if all(s.done for s in self._chunking.group):
            self._chunking = None  # (the rows, done, are removed as finished ones)

    def _prefilling(self) -> int:
        """Rows [0, k) of the group in chunked prefill (0: none)."""
        return 0 if self._chunking is None else len(self._chunking.group)

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, a group at a time. (An iteration starts,
        and admits, when admission is due: the loop gathers a burst while nothing runs, and
        the steps queued ahead end for it, `_admission_due`; or when those end for another
        reason, the pipeline drained already.) While rows decode, the groups' prompts
        together fit `prefill_tokens` (at least one request), so that running rows wait at
        most about one prefill of that size; while none do, nobody waits on the prefills and
        groups of that size follow one another until the requests waiting at the start are
        in or the rows are full. With `max_num_batched_tokens`: one group at a time, a chunk
        per iteration (`_admit_chunked`)."""
        if self.max_num_batched_tokens is not None:
            self._admit_chunked()
            return
        decoding = any(not s.done for s in self._running)
        budget = self.prefill_tokens
        groups, left = 0, len(self._waiting)  # (later arrivals: the next admission's)
        while len(self._running) < self.max_slots and left > 0:
            with self._lock:
                group, rows = self._take_group(budget if decoding else self.prefill_tokens)
                if not group:
                    break
                left -= len(group)
                moves = self._place(group, rows)
            budget -= len(group) * len(_tokens(group[0]))
            self._prefill(group, rows)
            with self._lock:
                self._pack(moves)
            groups += 1
            self.padded_rows += rows - len(group)
        if groups:
            self.admissions += 1
            self.admission_drains += decoding
            self.prefill_groups += groups

    def _place(self, group: list[RequestStream], rows: int | None = None
               ) -> list[tuple[int, int]]:
        """Rows [0, k) take the new prompts, and rows [k, rows) are left free for the dummy
        rows that fill the group's bucket (`rows`, default k: the bucket of k prefills exactly
        those); the running requests there move to free rows past both (lock held). Returns
        the moves that pack the rows again after the prefill (`_pack`): until then
        `_running[i]` is the request that row i will hold, and the rows moved out hold the
        requests bound for rows [k, rows)."""
        running, k = self._running, len(group)
        rows = k if rows is None else rows
        n = len(running)
        base, out = max(n, rows), min(n, rows)
        if n + rows > self.max_slots and rows > k:
            raise RuntimeError(f"a group of {k} padded to {rows} rows does not fit beside {n} "
                               f"running rows of {self.max_slots}")
        where = {i: i for i in range(out, n)}  # running index -> device row
        for i in range(out):
            self._move_row(i, base + i)
            where[i] = base + i
        # Packed: the group, then the running requests; those past the group's rows keep
        # theirs where they can, and the rest take the rows left free.
        final: list[RequestStream | None] = list(group) + [None] * n
        stray = []
        for i, row in sorted(where.items(), key=lambda item: item[1]):
            if k <= row < k + n and final[row] is None:
                final[row] = running[i]
            else:
                stray.append((i, row))
        holes = [row for row in range(k, k + n) if final[row] is None]
        moves = []
        for (i, row), hole in zip(stray, holes):
            final[hole] = running[i]
            moves.append((row, hole))
        self._running = final  # (every entry set: as many holes as strays)
        return moves

    def _pack(self, moves: list[tuple[int, int]]) -> None:
        """After a group's prefill: the running rows that `_place` moved past the group's
        bucket go to the rows that keep the batch packed (lock held)."""
        for src, dst in moves:
            self._move_row(src, dst)
            self._state.active[src] = False

    def _admit_chunked(self) -> None:
        """Admit a group when none is in prefill (its rows inactive, its blocks given), then
        run the next chunk of the group in prefill."""
        if self._chunking is None and len(self._running) < self.max_slots:
            with self._lock:
                group, _ = self._take_group(self.prefill_tokens, pad=False)
                if group:
                    self._place(group)
                    self._start_chunks(group)
        if self._chunking is not None:
            self._next_chunk()

    def _start_chunks(self, group: list[RequestStream]) -> None:
        """Rows [0, k) take the group: sampling values loaded, inactive in the decode state,
        blocks given (`admit`: a prefix hit's cached tokens are its first progress)."""
        self._load_rows(group)
        k = len(group)
        self._state.active[:k] = False
        token_lists = [_tokens(s) for s in group]
        progress = []
        for row, (stream, tokens) in enumerate(zip(group, token_lists)):
            hit = self.blocks.admit(row, tokens, self._admission_slots(stream))
            if hit is None:  # (`_with_blocks` counted them: never)
                raise RuntimeError(f"row {row}: the blocks counted for admission are gone")
            progress.append(hit)
            stream._admitted = next(self._admissions)
        device = self._state.pending.device
        emitted = None
        if any(s.output_ids for s in group):  # resumed after preemption
            emitted = to_device([len(s.output_ids) for s in group], device)
        tokens = to_device(token_lists, device)  # [k, T]
        self._chunking = _ChunkedPrefill(group, token_lists, tokens, progress, emitted,
                                 any(not s.params.greedy for s in group))

    def _part_width(self) -> int | None:
        """The width of the group's next chunk when it is not the last (no row reaches its
        prompt's end: `prefill_part`); None when it is (`prefill_chunk`). Per row W tokens,
        W = (the token budget - the running rows' decode tokens) / k, at least 2, down to
        whole blocks, and short of every prompt's last token by at least 2 (the last chunk's
        least)."""
        p = self._chunking
        k, T = len(p.group), len(p.token_lists[0])
        size = self.blocks.block_size
        decode = (len(self._running) - k) * self._step_tokens
        width = max(2, (self.max_num_batched_tokens - decode) // k)
        if width >= size:
            width -= width % size
        lo, hi = min(p.progress), max(p.progress)
        if T - lo > width and T - 1 - hi >= 2:
            return min(width, T - 1 - hi)
        return None

    def _next_chunk(self) -> None:
        """Run the group's next chunk (`_part_width`); the chunk that reaches every prompt's
        end chooses the first tokens (time to first token) and activates the rows. Full
        blocks are committed (keyed) as chunks land."""
        p = self._chunking
        k, T = len(p.group), len(p.token_lists[0])
        width = self._part_width()
        bucket = self.engine.buckets[k]
        self._sync_table(show_prefill=True)
        if p.refresh_draft:  # (progress is still each row's prefix-cache hit)
            self._refresh_draft(bucket, p.tokens, p.progress)
            p.refresh_draft = False
        self.prefill_chunks += 1
        if width is not None:  # not the last chunk: no row reaches its end
            speculative.prefill_part(bucket.target, bucket.draft, p.tokens, p.progress, width)
            ends = [start + width for start in p.progress]
            self._commit_chunk(p, ends)
            return
        result = speculative.prefill_chunk(bucket.target, bucket.draft, bucket.state, p.tokens,
                                           p.progress, self.engine.vocab_size, p.do_sample,
                                           p.emitted)
        self._commit_chunk(p, [T] * k)
        self._chunking = None
        firsts = result.tokens[:, 0].tolist()  # the last chunk's read-back
        for row, (stream, first) in enumerate(zip(p.group, firsts)):
            if stream.done:  # cancelled during the prefill: removed at the next retire
                self._state.active[row] = False
                continue
            self.engine.stats.num_generated_tokens += 1
            self._deliver(stream, [first], stream.params.max_tokens)

    def _commit_chunk(self, p: _ChunkedPrefill, ends: list[int]) -> None:
        """Record each held row's tokens [progress, end) as written (keying the blocks they
        fill) and move its progress to `end`."""
        for row, (stream, tokens, start, end) in enumerate(zip(p.group, p.token_lists,
                                                               p.progress, ends)):
            if self.blocks.holds(row):
                self.blocks.commit(row, tokens[start:end])
                stream._draft_valid = end  # (both models run every chunk)
        p.progress = ends

    def _chunk_ahead(self) -> None:
        """Queue the group's next chunk, not its last (`_may_run_ahead` checked), while a
        decode step is still in flight: the run-ahead's first half, the decode step ahead
        follows (`_iteration`). The device runs what it runs without run-ahead, in the same
        order (chunk, step, chunk, step, ...); only the host's work moves, and why that is
        safe:

        - The block table. The chunk's copy (`_sync_table(show_prefill=True)`, the group's
          rows shown) and the decode step's (rows [0, k) null) are queued on the stream in
          issue order, each before the step that reads it, as every table copy is
          (`BlockManager.sync_table`); the chunk writes only the group's own blocks (their
          table rows), and the decode step still sees the group's rows as null: it writes
          nothing into the blocks the chunk fills.
        - Keys before writes. `_commit_chunk` keys the chunk's full blocks while the chunk
          (and the step before it) may still be running. A keyed block is found only by an
          admission (`cached_prefix`, `admit`), and admission runs at an iteration's start,
          after every step issued in the iteration before was read back: the chunk, queued
          before the last of those steps on the stream, has written its k/v by then. A
          block is freed only at a retire or a preemption (an iteration's start: `_retire`,
          `_make_room`), and a new owner's writes are queued after the chunk's anyway.
        - Cancellation. A cancel only marks the stream; `_may_run_ahead` stops queueing
          while any row, of the group or running, has a stop requested, and the row's blocks
          are freed at the next retire, when nothing is in flight (`_retire_prefilling`,
          `_remove_row`). A cancel that lands after the check rides the queued steps, as
          without chunks: the chunk writes the row's still-held blocks, the step's tokens for
          a cancelled running row are delivered and the row then ends.
        - Blocks running out. Before a step ahead every running row grows by two steps'
          room (`_grow_rows(steps=2)`); the group's rows need none (admitted with their
          prompt and a step's room). When that fails nothing is queued: the iteration reads
          back and the next one preempts (`_make_room`, the group first: `_abort_prefill`),
          with nothing in flight but its own chunk, as without run-ahead.
        - The budget. The width depends only on the group, its progress and the number of
          running rows (`_part_width`), which do not change while steps run ahead: each
          chunk ahead is the width an iteration of its own would run. (Rows that end in the
          step in flight are still counted and still computed by the step ahead.)
        - The draft. `prefill_part` feeds the chunk to both models and `_commit_chunk`
          moves the rows' `_draft_valid` on, as in `_next_chunk`; a resync before the decode
          step (`_draft_behind`) writes nothing into the group's blocks (null table rows, as
          every decode step), and each chunk sets the caches' lengths of its rows itself
          (whatever a decode step left there). The draft's refresh over a stale hit is the
          first chunk's, always run at admission. `AdaptiveScheduler` takes the weight
          swap's lock around a chunk ahead, as around admission; its steps ahead propose
          (suffix index, mixed steps) only for the rows past the group (`_proposals`) and its
          controller counts only those (`_Step.prefilling`), as for any step.
        - Read-back. The chunk reads nothing back and waits for nothing on the device (its
          lengths and the table go through runtime/host_copies.py: `to_device`,
          `BlockManager.sync_table`); the last chunk, which reads back, never runs ahead.
        """
        if self._part_width() is None:
            raise RuntimeError("the last chunk of a group in prefill was queued ahead")
        self._next_chunk()
        self.chunks_ahead += 1

    def _abort_prefill(self) -> None:
        """Preempt the group in chunked prefill (the newest requests): its rows leave, their
        blocks freed (full chunks stay cached), and its requests go back to the front of the
        queue, in order (lock held)."""
        group = self._chunking.group
        self._chunking = None
        for row in reversed(range(len(group))):
            self._remove_row(row)
        for stream in reversed(group):
            if not stream.done:
                stream.preemptions += 1
                self.preemptions += 1
                self._waiting.appendleft(stream)

    def _take_group(self, budget: int, pad: bool = True) -> tuple[list[RequestStream], int]:
        """Take from the queue the first waiting request and, behind it, more of the same
        prompt length: as many as the free rows and the token budget hold (prompts of one
        length need no padding, so each row's prefill is the one it would get alone), and
        the rows its prefill runs: the smallest batch bucket that holds them, its extra rows
        dummies (free rows), where those fit beside the running rows, are at most
        MAX_DUMMIES of the group's and `pad`; else as many as the largest bucket they fill
        (the rest go in the next group). Returns (group, rows); ([], 0) when none is taken.
        Call with the lock held."""
        if not self._waiting:
            return [], 0
        T = len(_tokens(self._waiting[0]))
        if budget < T and budget != self.prefill_tokens:
            return [], 0
        free = self.max_slots - len(self._running)
        limit = min(free, max(1, budget // T))
        same = [s for s in itertools.islice(self._waiting, 4 * self.max_slots)
                if len(_tokens(s)) == T]
        if self.blocks is not None:
            same = self._with_blocks(same[:limit])
            if not same:
                return [], 0  # the first waiting request waits for blocks (FCFS)
        same = same[:limit]
        buckets = self.engine.buckets
        rows = min((b for b in buckets if b >= len(same)), default=0)
        if not pad or rows == 0 or rows > free or rows - len(same) > MAX_DUMMIES * len(same):
            rows = max(b for b in buckets if b <= len(same))
            same = same[:rows]
        for stream in same:
            self._waiting.remove(stream)
        return same, rows

    def _with_blocks(self, same: list[RequestStream]) -> list[RequestStream]:
        """The leading requests of `same` (one length) whose blocks are available now, keeping
        a block of headroom per running row for its next step, of those whose prefix-cache
        hits go together (`alike_hits`: a group with a hit prefills through the CHUNK step from
        its shortest hit, a miss's from slot 0, `_prefill_paged`)."""
        blocks = self.blocks
        spare = blocks.available_blocks - len(self._running)
        taken = []
        matched = [blocks.prefix_blocks(_tokens(s)) for s in same]
        for i in alike_hits([len(m) * blocks.block_size for m in matched], MIXED_HIT_TOKENS):
            stream = same[i]
            cost = blocks.admission_cost(_tokens(stream), self._admission_slots(stream),
                                         matched[i])
            if cost > spare:
                break
            spare -= cost
            taken.append(stream)
        return taken

    def _load_rows(self, group: list[RequestStream]) -> None:
        """Rows [0, k) of the decode state take the group's sampling values (all rows at
        once, `DecodeState.load_rows`)."""
        params = [stream.params for stream in group]
        self._state.load_rows(
            [p.max_tokens for p in params], [stream.eos for stream in group],
            [1.0 if p.greedy else float(p.temperature) for p in params],
            [1 if p.greedy else (None if p.top_k in (None, 0, -1) else p.top_k) for p in params],
            [None if p.greedy else p.top_p for p in params], self.engine.vocab_size,
            [stream.seed for stream in group])

    def _prefill(self, group: list[RequestStream], rows: int | None = None) -> None:
        """Prefill the group's prompts (one length) into rows [0, k) through the bucket of
        `rows` (default k; rows [k, rows) dummies: free rows, `_place`); deliver each first
        token (and finish those that get no more)."""
        engine = self.engine
        k, T = len(group), len(_tokens(group[0]))
        rows = k if rows is None else rows
        bucket = engine.buckets[rows]
        self._load_rows(group)
        device = self._state.pending.device
        if self.blocks is None:
            tokens = to_device([s.prompt_ids for s in group], device)  # [k, T]
            prompts = Prompts(tokens=tokens,
                              starts=torch.zeros(k, dtype=torch.long, device=device), batch=k)
            padded = pad_batch(prompts, rows, min_length=bucket.prefill_length(T))
            do_sample = any(not s.params.greedy for s in group)
            result = speculative.prefill(bucket.target, bucket.draft, bucket.state, padded, T,
                                         engine.vocab_size, do_sample)
        else:
            result = self._prefill_paged(group, bucket)
        firsts = result.tokens[:, 0].tolist()  # the prefill's read-back
        engine.stats.num_generated_tokens += k
        for stream, first in zip(group, firsts):
            self._deliver(stream, [first], stream.params.max_tokens)

    def _prefill_paged(self, group: list[RequestStream], bucket: object
                       ) -> speculative.StepResult:
        """`_prefill` on a paged engine: rows [0, k) are given their blocks (`admit`, which
        `_with_blocks` checked), the prompts (with the tokens a preempted request already
        emitted) are prefilled, those of a group with a prefix-cache hit by the CHUNK step
        after each row's cached tokens (a miss's from slot 0), and their full blocks are keyed
        for later requests (`commit`). The bucket's rows past k are dummies: free rows, whose
        null table rows take their writes, inactive after."""
        blocks = self.blocks
        k, B = len(group), bucket.batch
        token_lists = [_tokens(s) for s in group]
        cached = []
        for row, (stream, tokens) in enumerate(zip(group, token_lists)):
            hit = blocks.admit(row, tokens, self._admission_slots(stream))
            if hit is None:  # (`_with_blocks` counted them: never)
                raise RuntimeError(f"row {row}: the blocks counted for admission are gone")
            cached.append(hit)
            stream._admitted = next(self._admissions)
        self._sync_table()
        device = self._state.pending.device
        T = len(token_lists[0])
        dummies = B - k
        tokens = to_device(token_lists + [[0] * T] * dummies, device)  # [B, T]
        starts = cached + [min(cached)] * dummies  # (a dummy widens no chunk)
        self._refresh_draft(bucket, tokens, starts)
        emitted = None
        if any(s.output_ids for s in group):  # resumed after preemption
            emitted = to_device([len(s.output_ids) for s in group] + [0] * dummies, device)
        do_sample = any(not s.params.greedy for s in group)
        if any(cached):
            result = speculative.prefill_chunk(bucket.target, bucket.draft, bucket.state, tokens,
                                               starts, self.engine.vocab_size, do_sample, emitted)
            bucket.state.active[k:] = False  # (the chunk starts every row it runs)
        else:
            prompts = Prompts(tokens=tokens[:k],
                              starts=torch.zeros(k, dtype=torch.long, device=device), batch=k)
            padded = pad_batch(prompts, B, min_length=bucket.prefill_length(T))
            result = speculative.prefill(bucket.target, bucket.draft, bucket.state, padded, T,
                                         self.engine.vocab_size, do_sample, emitted)
        for row, (stream, tokens, hit) in enumerate(zip(group, token_lists, cached)):
            blocks.commit(row, tokens[hit:])
            stream._draft_valid = len(tokens)  # (the draft was prefilled too, where there is one)
        return result

    def _refresh_draft(self, bucket: object, tokens: torch.Tensor, hits: list[int]) -> None:
        """Before rows [0, k) are prefilled after their prefix-cache hits: where a hit's
        cached blocks hold an older draft's k/v (the draft's weights changed since they were
        computed: `draft_weights_changed`), the draft alone runs over them again; the
        target's k/v there are reused as they are. tokens: [k, T] the prompts; hits: each
        row's cached tokens (`admit`'s).

        Row b's draft is current up to `draft_hit(b)`. One CHUNK step of the draft, W wide
        (the longest stale span, at least 2), feeds row b the prompt's tokens at slots
        [hit_b - W, hit_b) (from 0 where the hit is shorter than W): slots before
        draft_hit(b) get what they hold again (the current draft over the same tokens),
        slots past the hit (the row's own new blocks, never a shared one) get the prompt's
        tokens, which its prefill writes again. The hit blocks' draft halves are then
        current (`draft_refreshed`): the next hit reuses them."""
        blocks = self.blocks
        held = [row for row in range(len(hits)) if blocks.holds(row)]
        stale = [hits[row] - blocks.draft_hit(row) for row in held]
        if bucket.draft is None or not any(stale):
            return
        width = max(2, *stale)
        starts = [max(0, hit - width) for hit in hits]
        speculative.prefill_part(None, bucket.draft, tokens, starts, width)  # the draft alone
        for row in held:
            blocks.draft_refreshed(row)

    def _set_step_room(self) -> None:
        """Slots a step may write past a row's length: gamma + 1 for the longest verify step
        the engine has (a draft's, or the suffix index's), or, where the draft runs ahead
        (overlapped rounds), 2 x its gamma + 1. Call again when verify steps are added."""
        top = self.engine.buckets[self.max_slots]
        drafted = max([self.engine.config.resolved_gamma, *self.engine.gammas])
        gamma = max([k.tokens - 1 for k in top.target.steps if k.name == "verify"] + [drafted])
        self._step_room = max(gamma + 1, 2 * drafted + 1 if top.overlap else 0)
        self._step_tokens = gamma + 1

    def _admission_slots(self, stream: RequestStream) -> int:
        """Slots a request is admitted with: its prompt (and what it emitted before a
        preemption) and what its first step may write."""
        return min(len(_tokens(stream)) + self._step_room,
                   self._row_cap(len(stream.prompt_ids), stream.params.max_tokens))

    def _row_cap(self, prompt: int, max_tokens: int) -> int:
        """The most slots a request's row ever needs: its last length (prompt + max_tokens - 1)
        plus what a step writes past it, within the row's slots."""
        return min(prompt + max_tokens - 1 + self._step_room, self._caches[0].slots)

    def _grow_rows(self, steps: int = 1) -> bool:
        """Grow every running row to the slots the next `steps` steps may write (its length as
        the host knows it, plus `steps` x the step's room); False as soon as one cannot. The
        rows of a group in chunked prefill have theirs already (admitted with the prompt and
        a step's room; chunks ahead need no more)."""
        if self.blocks is None:
            return True
        prefilling = self._prefilling()
        for row, stream in enumerate(self._running):
            if row < prefilling or not self.blocks.holds(row):  # in chunked prefill, or
                continue                                         # cancelled there: freed
            length = len(stream.prompt_ids) + len(stream.output_ids) - 1
            slots = min(length + steps * self._step_room,
                        self._row_cap(len(stream.prompt_ids), stream.params.max_tokens))
            if not self.blocks.grow(row, slots):
                return False
        return True

    def _make_room(self) -> None:
        """Grow every running row for the next step; while blocks are missing, preempt the
        newest request (its blocks freed, it goes back to the front of the queue with the
        tokens it has: prefilled again on readmission, it continues where it stopped)."""
        while not self._grow_rows():
            with self._lock:
                if self._chunking is not None:  # the newest requests: the group in prefill
                    self._abort_prefill()
                    continue
                running = self._running
                row = max(range(len(running)), key=lambda i: running[i]._admitted)
                stream = running[row]
                self._remove_row(row)
                stream.preemptions += 1
                self.preemptions += 1
                self._waiting.appendleft(stream)
            log.debug("fuser: preempted %s (%d tokens) for blocks", stream.request_id,
                      len(_tokens(stream)))

    def _sync_table(self, show_prefill: bool = False) -> None:
        """Copy the block table to the device; the rows of a group in chunked prefill read as
        null rows there (a decode step computes them and must write nothing into their
        blocks: not at their lengths, not in a draft's catch-up or resync) unless
        `show_prefill` (its chunk runs)."""
        if self.blocks is not None:
            self.blocks.sync_table(0 if show_prefill else self._prefilling())

    def _commit_decoded(self, rows: list[RequestStream], skip: int = 0) -> None:
        """Key the blocks that decoding filled: those whose every slot holds correct k/v in
        both caches. The target's cache holds prompt + output[:-1]; a draft's holds its
        row's first `_draft_valid` slots (`_draft_advanced`), which may lag behind (after
        target-only steps until a resync, or by one slot after an all-accepted step). A
        block keyed before the draft's slots were right would hand a later request wrong
        draft k/v: its tokens stay the target's, but its acceptance drops."""
        if self.blocks is None or not self.blocks.prefix_caching:
            return
        size = self.blocks.block_size
        draft = len(self._caches) > 1
        for row, stream in enumerate(rows):
            if row < skip or not self.blocks.holds(row):  # in chunked prefill (its chunks
                continue                                    # commit), or cancelled there
            have = self.blocks.committed(row)
            written = len(stream.prompt_ids) + len(stream.output_ids) - 1
            if draft:
                written = min(written, stream._draft_valid)
            if written // size > have // size:  # a block filled: key it (and what led to it)
                tokens = stream.prompt_ids + stream.output_ids[:-1]
                self.blocks.commit(row, tokens[have:written])

    def _draft_ran(self, step: _Step) -> bool:
        """Whether the step ran the draft (a speculative step: target-only steps do not)."""
        return step.gamma > PLAIN and len(self._caches) > 1

    @staticmethod
    def _draft_advanced(stream: RequestStream, gamma: int, accepted: int) -> None:
        """Before a step's tokens are delivered: the draft's valid slots of a row after a step
        in which the draft ran (a speculative step of `gamma` drafts, of which `accepted`
        were accepted: the standard, mixed and overlapped kinds).

        With the target at L = prompt + output - 1 slots before the step, the draft was
        valid up to slot L - 2 at least (`speculative.draft`'s invariant; a resync before
        the step restores it after target-only steps). The step's catch-up writes slots
        L - 1 and L with the right tokens, then feeds d_1..d_{gamma-1} at L + 1..: the first
        `accepted` of them are right. So slots [0, L + 1 + min(accepted, gamma - 1)) hold
        the draft's k/v: the target's new length L + accepted + 1 when a draft was rejected,
        one less when all were accepted (d_gamma is never fed). An overlapped round holds at
        least as many (its draft fed the accepted guesses already), so this is a lower
        bound there. Target-only steps leave the count as it was."""
        before = len(stream.prompt_ids) + len(stream.output_ids) - 1
        stream._draft_valid = before + 1 + min(accepted, gamma - 1)

    def _deliver(self, stream: RequestStream, kept: list[int], budget: int) -> None:
        """Hand `kept` to the stream, cut at its first eos; finish it on eos or budget."""
        reason = None
        eos = stream.eos
        if eos:  # (none with ignore_eos)
            for i, token in enumerate(kept):
                if token in eos:
                    kept, reason = kept[: i + 1], "stop"
                    break
        if reason is None and len(stream.output_ids) + len(kept) >= budget:
            reason = "length"
        stream._deliver(kept, reason)

    def _issue(self) -> _Step:
        """Queue one iteration of the bucket holding the running rows (and its read-back)."""
        engine = self.engine
        rows = list(self._running)
        bucket = engine.bucket(len(rows))
        controller = engine.controller(bucket.batch)
        gamma = engine.next_gamma(controller, bucket) if bucket.draft is not None else PLAIN
        if gamma > 0 and self._draft_behind:
            bucket.resync(self._draft_behind)
        self._draft_behind = self._draft_behind + 1 if gamma == PLAIN else 0
        do_sample = any(not s.params.greedy for s in rows)
        self._streams_from(gamma, gamma > PLAIN and bucket.overlap and not do_sample)
        start = time.perf_counter()
        read_back = ReadBack(bucket.run(gamma, do_sample))  # [bucket, gamma + 2]
        if controller is not None:
            controller.sent()  # the host's part of the step ends here
        return _Step(rows, gamma, controller, read_back, start, prefilling=self._prefilling())

    def _streams_from(self, gamma: int, overlapped: bool) -> None:
        """Before a step is issued: an overlapped round goes on from the guesses of the step
        before only when that was an overlapped round of the same gamma (as `generate`
        does); after any other step (target-only, standard, mixed, another gamma) the rows'
        guesses and the draft's slots after the target's length are stale, so `streaming`
        is cleared and the round starts by drafting (`speculative.overlapped_step`). This
        keeps `speculative.draft`'s invariant (the draft valid up to L - 2) that
        `_draft_advanced` counts on."""
        if overlapped and self._overlapped != gamma:
            self._state.streaming.zero_()
        self._overlapped = gamma if overlapped else None

    def _collect(self, step: _Step) -> None:
        """Read one step back: each row keeps n + 1 tokens, cut at its eos and budget."""
        engine = self.engine
        host = step.read_back.wait()  # the step's one sync
        n = len(step.rows)
        tokens, accepted = host[:n, : step.gamma + 1].tolist(), host[:n, -1].tolist()
        was_active = [not s.done and row >= step.prefilling for row, s in enumerate(step.rows)]
        draft_ran = self._draft_ran(step)
        generated = 0
        for row, stream in enumerate(step.rows):
            if not was_active[row]:  # finished, or in chunked prefill (inactive)
                continue
            if draft_ran:
                self._draft_advanced(stream, step.gamma, min(accepted[row], step.gamma))
            budget = stream.params.max_tokens
            kept = tokens[row][: min(accepted[row] + 1, budget - len(stream.output_ids))]
            generated += len(kept)
            self._deliver(stream, kept, budget)
        engine.stats.num_generated_tokens += generated
        engine.record_step(step.controller, accepted, was_active, step.gamma)
        self._commit_decoded(step.rows, step.prefilling)  # (rows move only between iterations)
        elapsed = time.perf_counter() - step.start
        engine.stats.generate_seconds += elapsed
        engine.observe_tokens(generated, elapsed)

    # -- moving a request between rows -----------------------------------------------------------

    def _remove_row(self, row: int) -> None:
        """A running row leaves (finished, cancelled, preempted; the lock held): its blocks are
        freed and the last running row moves into its slot, so the rows stay packed."""
        running = self._running
        if self.blocks is not None and self.blocks.holds(row):  # (a cancelled prefill's: freed)
            self.blocks.release(row)
        last = len(running) - 1
        if row != last:
            self._move_row(last, row)
            running[row] = running[last]
        self._state.active[last] = False
        running.pop()

    def _move_row(self, src: int, dst: int) -> None:
        """Row dst takes row src's request: its KV rows (both models), lengths and state."""
        if self.blocks is not None and self.blocks.holds(src):  # (a cancelled prefill's: freed)
            self.blocks.move(src, dst)  # the table row moves (the draft's: the same table)
        for cache in self._caches:
            # slots copied; a paged cache's table rows are the block manager's
            cache.move_row(src, dst, table=self.blocks is None)
        self._state.copy_row(dst, src)


def alike_hits(hits: Sequence[int], bound: int) -> list[int]:
    """Which requests of a group, given each one's prefix-cache hit (cached prompt tokens, in
    queue order), prefill together: the first, and each next one that keeps the cached tokens
    recomputed (each row's hit past the group's shortest) within `bound` in all."""
    taken: list[int] = []
    low, total, count = 0, 0, 0  # the shortest hit taken, the hits' sum, how many
    for i, hit in enumerate(hits):
        new_low = hit if not taken else min(low, hit)
        if taken and total + hit - (count + 1) * new_low > bound:
            continue
        taken.append(i)
        low, total, count = new_low, total + hit, count + 1
    return taken


def _tokens(stream: RequestStream) -> list[int]:
    """What a request's row holds when it is prefilled: its prompt, and the tokens it emitted
    before a preemption."""
    return stream.prompt_ids + stream.output_ids if stream.output_ids else stream.prompt_ids
