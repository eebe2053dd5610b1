"""The Engine: runs built steps (`logits`, `generate`, `stream`) and reports on them.

It builds nothing: `fuser.optimize` (fuser/optimize.py) builds the steps and hands them over.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from fuser import load_profile
from fuser.config import FuserConfig
from fuser.report import Report, SpecStats
from fuser.runtime.bucket_capture import BackgroundCapture, StepGate
from fuser.runtime.controller import DRAFT, TARGET, Controller
from fuser.runtime.metrics import count_speculation
from fuser.runtime.prompts import check_prompts, pad_batch
from fuser.runtime.speculative import DecodeState
from fuser.runtime.step_graphs import PLAIN, Bucket, bucket_for, capture_order
from fuser.runtime.steps import DECODE, PREFILL, ModelSteps


class Engine:
    """An optimized target (and optional draft): `logits`, `generate`, `stream`, `report()`."""

    def __init__(self, target: ModelSteps | None, draft: ModelSteps | None, *,
                 config: FuserConfig, user_target: nn.Module | object, device: torch.device,
                 dtype: torch.dtype, vocab_size: int, gamma: int,
                 tokenizer: object | None = None, fallbacks: list[str] | None = None,
                 compile_seconds: float = 0.0,
                 buckets: dict[int, tuple[ModelSteps, ModelSteps | None]] | None = None,
                 gammas: tuple[int, ...] | None = None) -> None:
        """An engine over built steps (`fuser.optimize` builds them; `fuser.load` reads them).

        target: the target's steps, or None when it runs as plain Hugging Face (user_target).
        user_target: the user's model; for a loaded engine, a `fuser.engine_io.DetachedModel`
            (the generation config only: running it raises).
        draft: the draft's steps, or None (no speculation). gamma: draft tokens per step (with
        config.gamma == "auto": the largest candidate).
        buckets: batch size -> (target steps, draft steps) built at that batch over rows
            [:batch] of the caches; default: one bucket, {max_batch_size: (target, draft)}.
        gammas: the draft lengths with built verify steps (default: (gamma,) with a draft).
            With config.gamma == "auto" a Controller (runtime/controller.py) chooses among
            them per step by measured wall time per emitted token.
        Call `prepare()` once afterwards (capture, cost measurement).
        """
        self.target = target
        self.draft = draft
        self.config = config
        self.user_target = user_target
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = dtype
        self.vocab_size = vocab_size
        self.gamma = gamma
        self.compile_seconds = compile_seconds
        if gammas is None:
            gammas = (gamma,) if gamma > 0 and draft is not None else ()
        self.gammas: tuple[int, ...] = tuple(sorted(gammas)) if draft is not None else ()
        self.adaptive = config.gamma == "auto" and bool(self.gammas)
        self.stats = SpecStats(gamma=gamma if draft is not None else 0,
                               accepted_per_position=[0] * max(self.gammas, default=0))
        self._fallbacks: list[str] = list(fallbacks or [])
        # Held for one generation or one scheduler's run (a lock: a plain flag let a generate
        # and a scheduler's loop both pass its check and share the KV cache rows).
        self._generating = threading.Lock()
        self._forced_gamma: int | None = None
        # Metrics record from the first token when prometheus_client is installed (the
        # time-per-token histogram cannot be rebuilt later); without it they are off.
        self._metrics = None
        try:
            from fuser.runtime.metrics import SpecMetrics

            self._metrics = SpecMetrics(self.stats, max_gamma=max(self.gammas, default=0))
        except ImportError:
            pass
        self.buckets: dict[int, Bucket] = {}
        # Overlapped rounds gave greedy output unlike target-only's in their CUDA step graph
        # (tests/test_cuda_spec.py; cause not yet found): on CUDA they stay off.
        overlap = config.overlap and draft is not None and device.type != "cuda"
        if config.overlap and draft is not None and device.type == "cuda":
            message = ("overlap=True: overlapped rounds are not yet correct on CUDA (their GPU "
                       "test fails); greedy speculative steps run the standard step")
            warnings.warn(f"fuser: {message}", stacklevel=2)
            self._fallbacks.append(message)
        if target is not None:
            if buckets is None:
                buckets = {config.max_batch_size: (target, draft)}
            # One decode state for every bucket (each runs over rows [:size] of it, as over the
            # KV caches): a request keeps its row whichever bucket steps it.
            top = max(buckets)
            self.state = DecodeState.allocate(top, buckets[top][0].cache.slots, device)
            for size, (t, d) in sorted(buckets.items()):
                self.buckets[size] = Bucket(size, t, d if self.gammas else None, vocab_size,
                                            overlap=overlap, state=self.state.rows(size))
        # Per bucket: seconds of one greedy iteration per gamma (0 = target-only), measured by
        # `prepare` (the captured graphs' device time: reports, engine files), and the
        # controller of gamma="auto", which measures the loop's own wall time instead.
        self.step_costs: dict[int, dict[int, float]] = {}
        self._controllers: dict[int, Controller] = {}
        self.load_seconds: float | None = None  # set by fuser.load
        # seconds of each part of fuser.load (read, code, first_run, capture); {} if built
        self.load_timings: dict[str, float] = {}
        self.manifest: dict | None = None  # the engine directory's manifest, set by fuser.load
        # The step graphs' capture (`prepare`): bucket 1 first, the rest maybe on a background
        # thread while the engine serves (runtime/bucket_capture.py); None: nothing to capture.
        self._capture: BackgroundCapture | None = None
        self._gate = StepGate()
        # Per thread: the buckets `bucket()` may choose, fixed for one serving unit
        # (`stepping`); unset: whichever are captured now.
        self._units = threading.local()
        # With FuserConfig(tensor_parallel=N > 1): the follower processes this engine's target
        # steps run on (fuser/distributed.py `TensorParallelGroup`), set by fuser.optimize.
        self.tensor_parallel: object | None = None

    # -- runtime preparation (at optimize/load time) ---------------------------------------------

    def prepare(self, progress: object | None = None,
                known_costs: dict[int, dict[int, float]] | None = None,
                background: bool = True) -> None:
        """Capture the step graphs (CUDA, config.cuda_graphs) and, with gamma="auto", measure
        each iteration's cost per bucket and gamma. Runs once, at optimize (or load) time.

        known_costs: bucket -> gamma -> seconds measured before (an engine file's), used for
        the buckets it covers with every gamma instead of measuring them again.
        background: return once bucket 1's graphs are captured, and capture the other buckets
        on a background thread while the engine serves (`wait_for_graphs` waits for them; a
        step needing one not yet captured runs in a captured larger bucket, or uncaptured).
        Only where no bucket's costs are left to measure (measuring needs every graph, and
        the rows to itself); False: every bucket before returning."""
        if not self.buckets:
            return
        say = progress if callable(progress) else None
        kinds = [PLAIN, *self.gammas]
        length = min(128, self.config.max_seq_len // 2)
        known = {size: dict((known_costs or {}).get(size, {})) for size in self.buckets}
        to_measure = [size for size in self.buckets if set(kinds) - set(known[size])] \
            if self.adaptive else []
        if self.device.type == "cuda" and self.config.cuda_graphs:
            pool = torch.cuda.graph_pool_handle()

            def capture(bucket: Bucket, background: tuple | None) -> list[str]:
                usable = [g for g in kinds if (g == PLAIN or bucket.draft is not None)
                          and (background is not None or g not in bucket.deferred)]
                with load_profile.kernel_work(self.device) if background is None \
                        else nullcontext() as work:
                    failures = bucket.capture(usable, pool, length, background=background)
                for message in failures:
                    warnings.warn(f"fuser: {message}", stacklevel=2)
                if background is None and say is not None and bucket.capture_seconds:
                    say(f"capture of bucket {bucket.batch} by graph: {bucket.capture_line()}")
                    if work is not None:
                        say(f"kernel work in bucket {bucket.batch}'s capture: {work.line()}")
                return failures

            # (Tensor parallel: the followers capture and replay their part of each iteration
            # with rank 0's, fuser/distributed.py, one command at a time, so in the foreground;
            # prefill, captured per length on first use, runs uncaptured there.)
            behind = background and not to_measure and self.tensor_parallel is None
            if behind and self.adaptive and len(self.gammas) > 1:
                # Bucket 1 serves once the arms a controller runs first (target-only and the
                # smallest gamma: runtime/controller.py `first`) are captured; its other gammas
                # capture first thing in the background, unprobed until then.
                self.buckets[capture_order(tuple(self.buckets))[0]].deferred = \
                    set(self.gammas) - {min(self.gammas)}
            self.capture_graphs(capture, background=behind, progress=say)
            prefill_pool = torch.cuda.graph_pool_handle()
            for bucket in self.buckets.values():
                if self.tensor_parallel is None:
                    bucket.capture_prefills(prefill_pool)
        if self.adaptive:
            reps = 10 if self.device.type == "cuda" else 2
            for size, bucket in self.buckets.items():
                self.step_costs[size] = known[size] if size not in to_measure else {
                    g: bucket.measure(g, length, reps) for g in kinds}
                if say is not None:
                    costs = ", ".join(f"{g}: {1e3 * t:.2f} ms"
                                      for g, t in self.step_costs[size].items())
                    say(f"bucket {size} iteration costs by gamma: {costs}")
            self._build_controllers()

    def capture_graphs(self, capture: Callable[[Bucket, tuple | None], list[str]],
                       background: bool = True, progress: Callable[[str], None] | None = None
                       ) -> None:
        """Capture every bucket by `capture(bucket, background)` -> failure messages, in the
        order `capture_order` gives: the first now, the rest now too (background=False) or on
        a background thread (`background` is then (gate, stop) for `Bucket.capture`).
        `prepare` calls it with `Bucket.capture`; tests give a fake."""
        order = capture_order(tuple(self.buckets))
        first = order[0]

        def run(size: int, behind: bool | None = None) -> list[str]:
            behind = background and size != first if behind is None else behind
            # (the background thread's current device is cuda:0 until set)
            with torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext():
                return capture(self.buckets[size],
                               (self._gate, job.stop_event) if behind else None)

        # A first bucket with gammas deferred (`prepare`) captures them on the thread.
        deferred = background and bool(self.buckets[first].deferred)
        job = BackgroundCapture(order, run, log_line=progress,
                                first_rest=(lambda: run(first, True)) if deferred else None)
        self._capture = job
        if not background:
            for size in order:
                job.capture_now(size)
            if progress is not None:
                progress(f"captured the step graphs of batch buckets {order} in "
                         f"{sum(job.seconds.values()):.1f} s")
            return
        later = sorted(self.buckets[first].deferred)
        job.capture_now(first)
        if progress is not None:
            rest = order[1:]
            progress(f"captured the step graphs of batch bucket {first} in "
                     f"{job.seconds.get(first, 0.0):.1f} s"
                     + (f" (gammas {later} capture in the background)" if later else "")
                     + (f"; buckets {rest} capture in the background" if rest else ""))
        job.start()

    def wait_for_graphs(self, timeout: float | None = None) -> bool:
        """Block until every bucket's step graphs are captured (`fuser.load` returns once
        bucket 1's are; `optimize`, once all are); True when all were, False on a timeout, a
        failed bucket or a stopped capture. At once True where nothing is captured (CPU)."""
        return True if self._capture is None else self._capture.wait(timeout=timeout)

    @property
    def graphs_status(self) -> dict[int, str]:
        """Bucket -> "pending", "capturing", "ready", "failed" or "stopped" ({} where nothing is
        captured)."""
        return {} if self._capture is None else dict(self._capture.status)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Stop what runs beside the caller: the background capture (the graph under capture
        finishes; the buckets not captured run uncaptured; its thread joined) and, with
        tensor_parallel > 1, the follower processes (the engine cannot run steps afterwards;
        also done at interpreter exit). Idempotent. True when no capture thread is left."""
        stopped = True if self._capture is None else self._capture.stop(timeout)
        if self.tensor_parallel is not None:
            self.tensor_parallel.close()
        return stopped

    @property
    def capture_waiting(self) -> bool:
        """Whether a background capture's warm-up waits for the rows (`stepping`)."""
        return self._gate.waiting

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Held by whatever runs steps (a scheduler iteration, a generation): a background
        capture's warm-up, which runs on the same rows, waits for it, and the buckets
        `bucket()` chooses among stay fixed within it."""
        with self._gate.serving():
            outer = getattr(self._units, "ready", None)
            if outer is None and self._capture is not None:
                self._units.ready = frozenset(s for s in self.buckets if self._capture.ready(s))
            try:
                yield
            finally:
                self._units.ready = outer

    def set_step_costs(self, costs: dict[int, float], bucket: int | None = None,
                       **controller_options: float) -> None:
        """Replace the measured iteration costs (gamma -> seconds, 0 = target-only; every
        built gamma) of one bucket, or of all: the controllers restart, and take a step's
        seconds from these instead of the clock. controller_options go to `Controller`
        (probe_share, memory, refresh, ...). For tests and for costs measured elsewhere."""
        missing = {PLAIN, *self.gammas} - set(costs)
        if missing:
            raise ValueError(f"costs must give every gamma in {sorted({PLAIN, *self.gammas})}; "
                             f"missing {sorted(missing)}")
        for size in ([bucket] if bucket is not None else list(self.buckets)):
            self.step_costs[size] = dict(costs)
        self._build_controllers(scripted=True, **controller_options)

    def _build_controllers(self, scripted: bool = False, **options: float) -> None:
        """One Controller per bucket over target-only and every built gamma; scripted: a
        step's seconds are `step_costs`' (else the wall clock's)."""
        def arms(costs: dict[int, float]) -> dict[tuple[str, int], float]:
            return {(TARGET, 0): costs[PLAIN], **{(DRAFT, g): costs[g] for g in self.gammas}}

        self._controllers = {
            size: Controller({DRAFT: self.gammas},
                             costs=arms(self.step_costs[size])
                             if scripted and size in self.step_costs else None, **options)
            for size in self.buckets}
        self.stats.gamma = self._controllers[min(self.buckets)].gamma

    # -- the decoding loop's hooks ---------------------------------------------------------------

    def bucket(self, batch: int) -> Bucket:
        """The bucket that steps `batch` rows: the smallest holding them, or while buckets are
        still being captured (`prepare(background=True)`), the smallest captured one holding
        them (its extra rows are free rows), else the smallest, uncaptured."""
        sizes = tuple(self.buckets)
        if self._capture is not None:
            ready = getattr(self._units, "ready", None)
            if ready is None:
                ready = [s for s in sizes if self._capture.ready(s)]
            fits = [s for s in ready if s >= batch]
            if fits:
                return self.buckets[min(fits)]
        return self.buckets[bucket_for(batch, sizes)]

    def controller(self, bucket: int) -> Controller | None:
        """The adaptive controller of a bucket (None: gamma is fixed)."""
        return self._controllers.get(bucket) if self.adaptive else None

    def fix_gamma(self, gamma: int | None) -> None:
        """Force every step to one built gamma (0 = target-only), or None to return to the
        configured behaviour. For benchmarks that sweep gamma on one engine."""
        if gamma is not None and gamma != PLAIN and gamma not in self.gammas:
            raise ValueError(f"gamma={gamma!r} has no built verify step (built: {self.gammas})")
        self._forced_gamma = gamma
        if gamma is not None:
            self.stats.gamma = gamma

    @property
    def forced_gamma(self) -> int | None:
        """The gamma `fix_gamma` forces, or None."""
        return self._forced_gamma

    def next_gamma(self, controller: Controller | None, bucket: Bucket | None = None) -> int:
        """The draft length of the step being issued now (0 = target-only): the controller's
        choice, recorded as issued until `record_step` reads it back. bucket: the one the step
        runs in; a gamma whose graphs it captures later (`Bucket.deferred`) is not chosen yet
        (uncaptured, its cost would mislead the controller)."""
        if self._forced_gamma is not None:
            return self._forced_gamma
        if controller is None:
            return self.gamma if self.gammas else 0
        deferred = bucket.deferred if bucket is not None else None
        if deferred:
            return controller.choose(lambda arm: arm[1] not in deferred).gamma
        return controller.choose().gamma

    @property
    def gamma_reason(self) -> str:
        """Why the engine speculates as it does now, in one line."""
        if not self.gammas:
            return "no draft: target-only decoding"
        if self._forced_gamma is not None:
            return f"gamma fixed at {self._forced_gamma} by fix_gamma()"
        if not self.adaptive:
            return f"gamma fixed at {self.gamma} by FuserConfig(gamma={self.config.gamma})"
        controller = self.controller(min(self.buckets))
        return controller.reason if controller is not None else "costs not measured yet"

    def record_step(self, controller: Controller | None, num_accepted: list[int],
                    was_active: list[bool], gamma: int, modes: list[int] | None = None) -> None:
        """One iteration's read-back: vLLM's counters, and the controller's measurement (the
        step's wall time, and n + 1 tokens per active row).

        modes: an overlapped step's mode code per row (`speculative.overlapped_step`; its
        n is 0 where the row did not stream, so n + 1 is still what the row emitted)."""
        if gamma > 0:
            count_speculation(self.stats, num_accepted[: len(was_active)], was_active, gamma)
        if controller is not None:
            controller.update([min(n, gamma) for n, a in zip(num_accepted, was_active) if a],
                              gamma)
        if self._forced_gamma is not None:
            self.stats.gamma = self._forced_gamma
        else:
            self.stats.gamma = controller.gamma if controller is not None else \
                (self.gamma if self.gammas else 0)

    def observe_tokens(self, count: int, seconds: float) -> None:
        """Time per output token, for the metrics histogram (when metrics are in use)."""
        if self._metrics is not None and count > 0:
            self._metrics.observe_time_per_output_token(seconds / count, count)

    # -- metrics ---------------------------------------------------------------------------------

    def metrics(self) -> object:
        """The engine's `runtime.metrics.SpecMetrics` (created on first use; needs
        prometheus_client)."""
        if self._metrics is None:
            from fuser.runtime.metrics import SpecMetrics

            self._metrics = SpecMetrics(self.stats, max_gamma=max(self.gammas, default=0))
        return self._metrics

    def metrics_text(self) -> str:
        """Prometheus text exposition of the engine's metrics (equal to `engine.stats`)."""
        return self.metrics().text()

    def start_metrics_server(self, port: int, addr: str = "127.0.0.1") -> object:
        """Serve the metrics over HTTP at addr:port (port 0: any free one, see `.port`);
        returns an object with `.shutdown()`."""
        return self.metrics().start_server(port, addr)

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Hold the engine for one generation: its KV caches serve one at a time."""
        if not self._generating.acquire(blocking=False):
            raise RuntimeError("this engine is already generating (an unfinished stream, or a "
                               "scheduler running requests?): its KV cache serves one generation "
                               "at a time; finish or close the stream, or drain the scheduler")
        try:
            yield
        finally:
            self._generating.release()

    # -- public API ---------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
               ) -> torch.Tensor:
        """One full forward through the optimized target, no cache: float32 [B, T, vocab].

        Rows shorter than T are left-padded and marked by attention_mask (values at padded
        positions are unspecified).
        """
        prompts = check_prompts(input_ids, attention_mask, vocab_size=self.vocab_size,
                                max_batch_size=self.config.max_batch_size,
                                max_tokens=self.config.max_seq_len, device=self.device)
        B, T = prompts.batch, prompts.length
        if self.target is None:
            mask = (torch.arange(T, device=self.device)[None] >= prompts.starts[:, None]).long()
            out = self.user_target(input_ids=prompts.tokens, attention_mask=mask).logits
            return out.float()
        padded = pad_batch(prompts, self.config.max_batch_size, min_length=2)
        cache = self.target.cache
        with self.stepping():  # it resets the cache: not beside a capture's warm-up
            cache.begin(padded.starts)
            out = self.target.run(PREFILL, padded.tokens, padded.positions())
            cache.reset()
        return out[:B, :T].float()

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: object
                 ) -> torch.Tensor:
        """Hugging Face `generate` semantics, speculative when a draft is set: LongTensor[B, T + n].

        Keyword arguments (API.md): do_sample, temperature, top_k, top_p, eos_token_id,
        pad_token_id, attention_mask, seed.
        """
        from fuser.runtime.generate import generate

        return generate(self, input_ids, max_new_tokens, **kwargs)

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: object
               ) -> Iterator[torch.Tensor]:
        """Yield LongTensor[B] per position; concatenated they equal generate(...)[:, T:]."""
        from fuser.runtime.generate import stream

        return stream(self, input_ids, max_new_tokens, **kwargs)

    def save(self, path: str | Path, overwrite: bool = False) -> dict:
        """Write this engine as an engine directory (DESIGN.md, engine files); `fuser.load`
        reads it back without capture, passes or code generation. Returns the manifest
        (tensor parallel: one engine directory per rank, rank0/, rank1/, ..., and
        tensor_parallel.json with the world size, which is returned)."""
        from fuser.engine_io import save

        if self.tensor_parallel is not None:  # rank0/, rank1/, ... (fuser/distributed.py)
            with self.generating():  # the followers save between steps, never during one
                return self.tensor_parallel.save(self, path, overwrite=overwrite)
        return save(self, path, overwrite=overwrite)

    def export_onnx(self, path: str | Path, overwrite: bool = False) -> dict:
        """Write the target's (and draft's) prefill and decode steps as ONNX models for
        onnxruntime, with its fused operators, weights as external data and the KV cache as
        explicit inputs and outputs (fuser/onnx/export.py); `fuser.onnx.load(path)` runs them.
        Returns the export's manifest. Needs `pip install 'fuser[onnx]'`; an FP8 engine, or a
        model piece with no exact ONNX form, is refused (`fuser.onnx.OnnxExportError`)."""
        from fuser.onnx.export import export_engine

        return export_engine(self, path, overwrite=overwrite)

    def report(self) -> Report:
        """What optimize() did: passes, fused ops per graph, fallbacks, compile time."""
        report = Report(compile_seconds=self.compile_seconds, fallbacks=list(self._fallbacks))
        if self._capture is not None:
            report.fallbacks += self._capture.failures
        for m in (self.target, self.draft):
            if m is None:
                continue
            report.fallbacks += m.fallbacks
            report.graph_replays.update(m.graph_replays())
            for graph in m.steps.values():
                report.graphs[graph.name] = dict(graph.fused_ops)
        # The iteration graphs: each replay also counts for every model step inside it.
        for bucket in self.buckets.values():
            report.fallbacks += bucket.prefill_failures()
            for name, replays in bucket.replays().items():
                report.graph_replays[name] = report.graph_replays.get(name, 0) + replays
        if self.target is not None and DECODE in self.target:
            decode = self.target[DECODE]
            report.passes = dict(decode.matches)
            report.fused_ops = dict(decode.fused_ops)
        return report
