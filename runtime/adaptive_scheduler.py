"""Speculation that adapts to the traffic it serves: the scheduler with the suffix index, the
controller (runtime/controller.py) and online draft distillation plugged in
(`AdaptiveScheduler`).

What it adds to runtime/scheduler.py's loop, on the scheduler's thread:
    admit    each request's prompt goes into the suffix index (runtime/suffix.py), and the
             tokens it is given afterwards, when the index is first read for it: a lookup
             (`_index_rows`, `_index_outputs`: a step that does not look the index up does
             no index work), or at its finish only into the pool of recent outputs;
    issue    per batch bucket, a Controller picks an arm by the wall time per emitted token
             it measured of each: target-only; (draft, g), exactly the plain Scheduler's
             speculative step at gamma g (overlapped rounds where the bucket overlaps and no
             row samples, the draft's catch-up where it is behind, no proposals buffer); and
             (suffix, g), the index's proposals. With a draft, a suffix arm is the mixed step
             at one of the draft's gammas (runtime/suffix.py `mixed_step`): rows whose tokens
             end in a match of at least `suffix_min_match` tokens verify the index's
             proposals, the others the draft's, in the same verify, and the draft, fed the
             verified tokens, stays in step with the target (no resync follows). Without a
             draft it is the target verifying the index's proposals alone, at gammas of its
             own; with one, such steps are the long suffix arms, at gammas longer than the
             draft's (FuserConfig.long_suffix_gammas: where a row's text repeats, a step
             emits up to gamma + 1 tokens, and the draft's gammas stop at 15; a row without
             a match emits one). The draft does not run in them: the next draft or mixed step
             first catches it up (`resync_draft`, by the most tokens a row moved since it
             last ran), and the catch-up's seconds are charged to the arms whose steps left
             it behind (runtime/controller.py `update`'s `behind` and `resync`), not to the
             step that pays them. A suffix arm is usable only when some row matched (the
             index is looked up only when the controller could choose one), so adaptation
             can always run what
             plain speculation runs, and falls back to it when the mixed step does not pay.
             A step is issued holding the weight swap's lock;
    collect  the step's tokens go to the index, its wall time and tokens per row to the
             controller, its acceptance per row to the source that proposed for the row;
    retire   a finished request's output leaves the index for its pool of recent outputs and
             joins the distiller's buffer (the emitted tokens are the target's own choices).
             Every FuserConfig.distill_every finished requests a background thread fine-tunes
             a copy of the draft for at most DistillConfig.max_steps steps and
             distill_budget_s seconds of work (a side CUDA stream), at SERVING_DUTY of the wall
             clock while requests run or wait and unpaced while none does
             (DistillConfig.duty: that share of the wall clock instead), and, if the
             copy agrees better with the target on held-out recent requests, swaps it into the
             engine's draft tensors between two steps (runtime/distill.py); the controllers
             then forget what they measured of the old draft and probe the new one, and the
             paged cache's cached blocks keep their target k/v but not their draft k/v (the
             next admission sees the swap, under the swap's lock: `_admit`).
The target verifies every proposal, whatever its source: a request's tokens are what target-
only decoding gives (greedy: exactly; sampling: in distribution).

Overlap. The next step is queued before the last one is read back, whatever the sources, as in
runtime/scheduler.py. A proposal is made from the tokens the host has seen, which the step in
flight may have moved past: the host sends, per row, the index's continuation of the tokens it
knows, long enough to cover what the step in flight can emit (max gamma + 1 more), with the
count of output tokens it knew (the anchor). On the device, when the step runs, each row skips
the j tokens it emitted since the anchor, provided they are the continuation's first j (else
the row proposes nothing from the index this step), and proposes the next gamma
(`SuffixProposals.aligned`). Nothing is read on the host, so the step is captured as one CUDA
graph (per bucket, gamma and greedy/sampling) like the others, and the buffer's host-to-device
copy is queued on the step's stream behind the steps that read it before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from fuser.runtime.bucket_capture import stepping
from fuser.runtime.controller import DRAFT, NEEDED, PROBE_ONLY, SUFFIX, TARGET, UNUSED, \
    Choice, Controller, ControllerCollector
from fuser.runtime.distill import SERVING_DUTY, DistillConfig, Distiller, UpdateResult, \
    WeightSwap, draft_module, target_module
from fuser.runtime.generate import ReadBack
from fuser.runtime.scheduler import ADMISSION_QUIET, RequestStream, Scheduler, _Step
from fuser.runtime.step_graphs import PLAIN, IterationGraph
from fuser.runtime.steps import verify as verify_kind
from fuser.runtime.suffix import SuffixIndex, SuffixProposals, add_verify_steps

__all__ = ["AdaptiveScheduler"]

log = logging.getLogger("fuser")


# The most steps in a row that skip the index's lookup after lookups that found no row
# matching, while the suffix's arms are only due a probe (`LookupBackoff`).
LOOKUP_BACKOFF_MAX = 8


@dataclass
class LookupBackoff:
    """When to look the suffix index up while its arms are only due a probe (another arm is
    the best). A probe needs some row to match, and a lookup costs host time on the step's
    path (on an H100, a draft step's host work was 0.165 ms with them against 0.094 without:
    benchmarks/RESULTS.md, adaptive speculation), so after k lookups in a row that found no
    row matching, k >= 2, the next min(2**(k-2), `longest`) steps skip theirs (1, 2, 4, 8, 8,
    ...; one miss, as at a request's first token, skips none); a match, or new requests (whose
    prompts may repeat), looks up at the next step again."""

    longest: int = LOOKUP_BACKOFF_MAX
    misses: int = 0  # lookups in a row that found no row matching
    left: int = 0  # steps still to skip

    def due(self) -> bool:
        """Whether this step looks up (a step that does not counts as skipped)."""
        if self.left:
            self.left -= 1
            return False
        return True

    def found(self, matched: bool) -> None:
        """A lookup's outcome: a match resets the backoff, a miss lengthens it."""
        self.misses = 0 if matched else self.misses + 1
        self.left = min(1 << (self.misses - 2), self.longest) if self.misses >= 2 else 0

    def reset(self) -> None:
        """Look up at the next step (new rows may match at once)."""
        self.misses = self.left = 0


@dataclass
class _SourceStep(_Step):
    """An issued step with its choice (the controller's arm)."""

    choice: Choice = field(default_factory=lambda: Choice(TARGET, 0))
    # The step ran over the proposals buffer (a suffix arm: mixed, or the index alone): its
    # packed result carries each row's suffix proposal count in column gamma + 1. A draft arm's
    # overlapped round is as wide, with its mode code there instead; other kinds are gamma + 2
    # wide.
    over_proposals: bool = False
    # Of those, a mixed step: a row without suffix proposals verified the draft's gamma.
    mixed: bool = False
    # The most tokens a row's draft fell behind in the step (it did not run the draft:
    # target-only, or the index's proposals alone, where there is a draft)
    behind: int = 0
    # The seconds of the draft's catch-up the step ran first (read after its read-back)
    resync: Callable[[], float] = field(default=lambda: 0.0)


class AdaptiveScheduler(Scheduler):
    """runtime/scheduler.py's Scheduler with the suffix index, the controller over sources and
    online draft distillation (see the module docstring). Each bucket's controller chooses
    among target-only, the draft's arms (the plain Scheduler's speculative step at each of the
    draft's gammas) and the suffix's arms (with a draft: the mixed step at those gammas, in
    steps where some row matched; without one: the index's proposals verified alone), so with
    the draft's arms the cheapest it runs what the plain Scheduler runs, but for the
    controller's probes (about 5% of steps).

    Args (beyond Scheduler's):
        suffix: propose from the suffix index (default: FuserConfig.suffix_speculation).
        adapt_draft: distil the draft online (default: FuserConfig.adapt_draft; needs a draft
            and the module it was built from, the engine's own unless `module` is given).
        costs: {"decode": seconds, "draft": {gamma: seconds}, "suffix": {gamma: seconds},
            "resync": seconds} for every bucket: a step's seconds for the controllers instead
            of the wall clock (tests; costs measured elsewhere). "draft" is the plain
            speculative step's, "suffix" the mixed step's at the draft's gammas (with a draft;
            default: the draft's seconds) and the index's proposals verified alone at the long
            suffix gammas (with a draft), or at its own (without one: its gammas are the
            suffix arms'); "resync" the draft's catch-up per token it is behind (default 0).
        index: the SuffixIndex to use (default: a new one, from suffix_min_match tokens).
        distill: DistillConfig of the distiller.
        module: the draft module to distil (a loaded engine has none of its own).
        background: run draft updates on a thread of their own (False: inline, between two
            steps, which tests use to be deterministic).
        controller_options: keyword arguments of every Controller (runtime/controller.py).
        suffix_min_match: a row verifies the index's proposals when its tokens end in a match
            of at least this many tokens (shorter matches are mostly chance: the draft's
            proposals are better bets).
        long_suffix_gammas: with a draft, the gammas of the long suffix arms (the index's
            proposals verified alone; default: FuserConfig.long_suffix_gammas). An arm whose
            verify step the engine lacks (built without suffix_speculation, or an engine
            directory saved without it) is left out, with a log line.
        admission_wait, admission_quiet: the Scheduler's (when requests are admitted).
    """

    def __init__(self, engine: object, *, max_waiting: int = 256, prefill_tokens: int = 2048,
                 prefix_caching: bool = True, max_num_batched_tokens: int | None = None,
                 suffix: bool | None = None, adapt_draft: bool | None = None,
                 costs: Mapping[str, object] | None = None, index: SuffixIndex | None = None,
                 distill: DistillConfig | None = None, module: nn.Module | None = None,
                 background: bool = True, controller_options: Mapping[str, object] | None = None,
                 suffix_min_match: int = 4, long_suffix_gammas: Sequence[int] | None = None,
                 admission_wait: float | None = None,
                 admission_quiet: float = ADMISSION_QUIET) -> None:
        super().__init__(engine, max_waiting=max_waiting, prefill_tokens=prefill_tokens,
                         prefix_caching=prefix_caching,
                         max_num_batched_tokens=max_num_batched_tokens,
                         admission_wait=admission_wait, admission_quiet=admission_quiet)
        config = engine.config
        has_draft = any(b.draft is not None for b in engine.buckets.values())
        self.suffix = config.suffix_speculation if suffix is None else suffix
        adapt = config.adapt_draft if adapt_draft is None else adapt_draft
        if adapt and not has_draft:
            raise ValueError("adapt_draft=True needs an engine with a draft")
        if isinstance(suffix_min_match, bool) or not isinstance(suffix_min_match, int) \
                or suffix_min_match < 1:
            raise ValueError(f"suffix_min_match={suffix_min_match!r} must be an int >= 1")
        self.suffix_min_match = suffix_min_match
        self.draft_gammas = tuple(engine.gammas) if has_draft else ()
        # With a draft the index's proposals ride in the draft's steps (its gammas), and are
        # verified alone at the long suffix gammas; without, they are verified alone, at
        # gammas of their own.
        self.suffix_gammas: tuple[int, ...] = ()
        if self.suffix and has_draft:
            self.suffix_gammas = self._long_gammas(
                config.long_suffix_gammas if long_suffix_gammas is None else long_suffix_gammas)
        elif self.suffix:
            given = (costs or {}).get(SUFFIX)
            self.suffix_gammas = tuple(sorted(given)) if given else \
                tuple(config.gammas or config.gamma_candidates)
            for bucket in engine.buckets.values():
                add_verify_steps(bucket.target, self.suffix_gammas, config, engine.device)
            self._set_step_room()  # (a paged cache's rows grow by the longest verify step)
        # (Shorter matches never propose: indexing only n >= suffix_min_match gives the same
        # proposals for less host work.)
        self.index = (index or SuffixIndex(min_ngram=min(suffix_min_match, 8))) \
            if self.suffix else None
        self._indexed: dict[object, int] = {}  # request id -> its output tokens indexed
        longest = max(self.draft_gammas + self.suffix_gammas, default=1)
        self._buffers = {size: SuffixProposals(size, longest, engine.device)
                         for size in engine.buckets} if self.suffix else {}
        self._graphs: dict[tuple[int, int, bool], IterationGraph] = {}
        # CUDA: suffix or mixed steps run without a captured graph, per (bucket, gamma, sample)
        self.suffix_uncaptured: dict[tuple[int, int, bool], int] = {}
        self.lookups = LookupBackoff()
        self.lookup_count = 0  # the index's lookups on the steps' path
        self.resyncs = 0  # the draft's catch-ups (each after steps that did not run it)
        self._resync_cost = float((costs or {}).get("resync", 0.0)) if costs is not None \
            else None  # scripted: seconds per token behind
        if self.suffix and engine.device.type == "cuda" and config.cuda_graphs:
            with stepping(engine):  # its warm-ups reset the rows: not beside a capture's
                self._capture_suffix()
        options = dict(controller_options or {})
        self.controllers = {size: self._controller(size, costs, options)
                            for size in engine.buckets}
        self.distiller: Distiller | None = None
        self.swap: WeightSwap | None = None
        if adapt:
            module = module if module is not None else draft_module(engine)
            self.distiller = Distiller(module, vocab_size=engine.vocab_size, config=distill,
                                       target=target_module(engine))
            self.swap = WeightSwap.for_engine(engine, module)
        self.background = background
        self._updating = threading.Event()
        self._closing = threading.Event()
        self._new_draft = threading.Event()  # set by an accepted update, read by the loop
        self.update_results: list[UpdateResult] = []
        self._swaps_seen = 0  # the swap's count when admission last looked
        self._collector = ControllerCollector(lambda: self.controllers.values(),
                                              (lambda: self.distiller.updates)
                                              if self.distiller is not None else None)
        self._registry = None
        try:  # into the engine's Prometheus registry (one adaptive scheduler at a time)
            engine.metrics().registry.register(self._collector)
            self._registry = engine.metrics().registry
        except ImportError:  # no prometheus_client: no metrics
            pass
        except ValueError as e:  # another scheduler's collector is registered
            log.warning("fuser: adaptive speculation's metrics not registered: %s", e)

    def close(self) -> None:
        self._closing.set()  # a paced update in flight ends its training now
        super().close()
        self.wait_update()
        if self._registry is not None:
            self._registry.unregister(self._collector)
            self._registry = None

    def _long_gammas(self, given: Sequence[int]) -> tuple[int, ...]:
        """The long suffix arms' gammas of `given` whose verify step every drafted bucket's
        target has (the others are logged and left out); each must exceed the draft's."""
        gammas = tuple(sorted(set(given)))
        if any(isinstance(g, bool) or not isinstance(g, int) or g <= max(self.draft_gammas)
               for g in gammas):
            raise ValueError(f"long_suffix_gammas={tuple(given)!r} must be ints above every "
                             f"draft gamma {self.draft_gammas}")
        targets = [b.target for b in self.engine.buckets.values() if b.draft is not None]
        built = tuple(g for g in gammas if all(verify_kind(g) in t for t in targets))
        if built != gammas:
            log.info("fuser: long suffix arms gamma %s left out: the engine has no verify step "
                     "for them (build it with suffix speculation: FuserConfig."
                     "suffix_speculation, fuser build --suffix-steps)",
                     sorted(set(gammas) - set(built)))
        return built

    # -- costs and controllers -------------------------------------------------------------------

    def _controller(self, size: int, costs: Mapping[str, object] | None,
                    options: dict) -> Controller:
        """The bucket's controller over target-only, the draft's plain steps and the suffix's
        (with a draft: mixed steps at the draft's gammas, and the long ones); `costs`
        ({"decode": s, "draft": {g: s}, "suffix": {g: s}}) scripted instead of the wall clock
        (a draft engine's "suffix" defaults to its "draft", where it has no long arms)."""
        arms: dict[str, tuple[int, ...]] = {}
        drafted = bool(self.draft_gammas) and self.engine.buckets[size].draft is not None
        if drafted:
            arms[DRAFT] = self.draft_gammas
        if self.suffix and drafted:
            arms[SUFFIX] = self.draft_gammas + self.suffix_gammas  # mixed steps, long ones
        elif self.suffix_gammas:
            arms[SUFFIX] = self.suffix_gammas
        scripted = None
        if costs is not None:
            scripted = {(TARGET, 0): float(costs["decode"])}
            for source, gammas in arms.items():
                given = costs.get(source)
                if given is None and source == SUFFIX and drafted:
                    given = costs.get(DRAFT)  # (a mixed step at the plain step's seconds)
                if given is None:
                    raise ValueError(f"costs has no {source!r} entry; it needs one per source "
                                     f"({sorted(arms)})")
                missing = [g for g in gammas if g not in given]
                if missing:
                    raise ValueError(f"costs[{source!r}] has no seconds for gamma {missing} "
                                     f"(it needs {list(gammas)})")
                scripted.update({(source, g): float(given[g]) for g in gammas})
        return Controller(arms, costs=scripted, **options)

    def _mixed(self, bucket: object, gamma: int) -> bool:
        """Whether the bucket's suffix step at `gamma` is the mixed step (the draft's gammas,
        with a draft) rather than the target verifying the index's proposals alone."""
        return bucket.draft is not None and gamma in self.draft_gammas

    def _suffix_function(self, bucket: object, gamma: int, do_sample: bool
                         ) -> Callable[[], torch.Tensor]:
        """The bucket's step over the proposals buffer: the mixed step (with a draft, at its
        gammas) or the target verifying the proposals alone; () -> packed [bucket,
        gamma + 3]."""
        buffer = self._buffers[bucket.batch]
        if self._mixed(bucket, gamma):
            return buffer.mixed_iteration(bucket.target, bucket.draft, bucket.state, gamma,
                                          self.engine.vocab_size, do_sample)
        return buffer.iteration(bucket.target, bucket.state, gamma, self.engine.vocab_size,
                                do_sample)

    def _capture_suffix(self) -> None:
        """Each bucket's suffix or mixed step per gamma (the long ones too) and greedy/sampling
        as one CUDA graph (a shape that fails runs uncaptured, with a warning)."""
        pool = torch.cuda.graph_pool_handle()
        length = min(128, self.engine.config.max_seq_len // 2)
        for size, bucket in self.engine.buckets.items():
            gammas = self.draft_gammas + self.suffix_gammas if bucket.draft is not None \
                else self.suffix_gammas
            for gamma in gammas:
                for do_sample in (False, True):
                    fn = self._suffix_function(bucket, gamma, do_sample)
                    bucket.reset_for_timing(length)
                    try:
                        self._graphs[(size, gamma, do_sample)] = IterationGraph(
                            fn, pool, reset=lambda b=bucket: b.reset_for_timing(length))
                    except Exception as e:  # noqa: BLE001 -- that shape runs uncaptured
                        log.warning("fuser: suffix step bucket %d gamma %d %s not captured: "
                                    "%s", size, gamma, "sample" if do_sample else "greedy", e)
            bucket.free_rows()  # every row empty and inactive again

    def _run_suffix(self, bucket: object, gamma: int, do_sample: bool) -> torch.Tensor:
        key = (bucket.batch, gamma, do_sample)
        graph = self._graphs.get(key)
        if graph is not None:
            return graph()
        if self.engine.device.type == "cuda":  # (uncaptured: host-bound, its costs mislead)
            self.suffix_uncaptured[key] = self.suffix_uncaptured.get(key, 0) + 1
        return self._suffix_function(bucket, gamma, do_sample)()

    # -- the scheduler's hooks -------------------------------------------------------------------

    def _admit(self) -> None:
        """Admission holding the swap's lock: no swap lands while prompts are prefilled (their
        draft k/v are one draft's), and a swap since the last admission first makes the
        prefix cache's draft halves stale (`draft_weights_changed`), so a hit prefills the
        new draft over its blocks and keeps the target's k/v. (`WeightSwap.apply` counts
        swaps under the same lock.)"""
        with self._swap_seen():
            super()._admit()

    def _chunk_ahead(self) -> None:
        """A chunk queued ahead of a read-back (Scheduler._chunk_ahead) holds the swap's lock
        too, as a chunk run at admission does: its draft k/v are one draft's, and a swap
        since the last look makes the cached draft halves stale first."""
        with self._swap_seen():
            super()._chunk_ahead()

    @contextlib.contextmanager
    def _swap_seen(self) -> Iterator[None]:
        """Hold the swap's lock (where the draft adapts), a swap since the last look seen
        first (`_see_swaps`)."""
        if self.swap is None:
            yield
            return
        with self.swap.lock:
            self._see_swaps()
            yield

    def _see_swaps(self) -> None:
        """A swap since the last look: the cached blocks' draft halves are stale from now on
        (`draft_weights_changed`). Call holding the swap's lock."""
        if self.swap.swaps != self._swaps_seen:
            self._swaps_seen = self.swap.swaps
            self.draft_weights_changed()

    def _prefill(self, group: list[RequestStream], rows: int | None = None) -> None:
        self._index(group)
        super()._prefill(group, rows)

    def _start_chunks(self, group: list[RequestStream]) -> None:
        self._index(group)
        super()._start_chunks(group)

    def _index(self, group: list[RequestStream]) -> None:
        """A group admitted: the next steps look the index up again (`lookups`). Its prompts
        go into the index only when a lookup first reads their rows (`_proposals`): a request
        that leaves before any goes straight to the pool (`_finished`), without the own
        n-grams the index would have hashed and then removed (host time a request, where
        about one request ends a step)."""
        if self.index is not None:
            self.lookups.reset()

    def _index_rows(self, streams: Iterable[RequestStream]) -> None:
        """Each of `streams` the index does not hold yet goes into it (prompt, then its
        outputs at `_index_outputs`), as if it had been indexed since its admission."""
        index, indexed = self.index, self._indexed
        for stream in streams:
            if stream.request_id not in index:
                index.add_request(stream.request_id, stream.prompt_ids)
                indexed[stream.request_id] = 0

    def _index_outputs(self, streams: Iterable[RequestStream]) -> None:
        """The output tokens the index has not been given yet of each of `streams` (those it
        holds), before it is read for them: a step's tokens are not indexed as they are
        delivered, so a step without a lookup does no index work (measured on an H100: the
        adaptive loop's host time per step held the GPU back where the draft's arm ran,
        benchmarks/RESULTS.md)."""
        indexed = self._indexed
        for stream in streams:
            done = indexed.get(stream.request_id)
            if done is not None and len(stream.output_ids) > done:
                self.index.extend(stream.request_id, stream.output_ids[done:])
                indexed[stream.request_id] = len(stream.output_ids)

    def _retire(self) -> None:
        leaving = [s for s in self._running if s.done or s.stop_requested is not None]
        super()._retire()
        for stream in leaving:
            self._finished(stream)
        if self.distiller is not None and not self._updating.is_set() \
                and self.distiller.due(self.engine.config.distill_every):
            self._updating.set()
            if self.background:
                threading.Thread(target=self._update_draft, name="fuser-distill",
                                 daemon=True).start()
            else:
                self._update_draft()

    def _fail_all(self, reason: str) -> None:
        leaving = list(self._running)
        super()._fail_all(reason)
        for stream in leaving:
            if self.index is not None:
                self.index.drop(stream.request_id)
                self._indexed.pop(stream.request_id, None)

    def _finished(self, stream: RequestStream) -> None:
        """A request left: its output to the pool of recent outputs and to the distiller."""
        if self.index is not None:
            if stream.request_id in self.index:
                self._index_outputs((stream,))
                self.index.finish(stream.request_id)
                self._indexed.pop(stream.request_id, None)
            else:  # (never looked up: pooled as finish would pool it)
                self.index.pool_finished(stream.prompt_ids, stream.output_ids)
        if self.distiller is not None and stream.output_ids:
            self.distiller.add(stream.prompt_ids + stream.output_ids,
                               start=len(stream.prompt_ids))

    def _proposals(self, rows: list[RequestStream]
                   ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """Per row, the index's continuation of the tokens the host knows when the row's suffix
        matched at least suffix_min_match tokens (else none), long enough for the step in
        flight to have moved on: tokens [rows, width] and counts [rows] (row i proposes
        tokens[i, :counts[i]]); and the row's output count it continues (the anchor)."""
        width = self._buffers[self.engine.bucket(len(rows)).batch].width
        prefilling = self._prefilling()  # (rows [0, prefilling): a group in chunked prefill)
        live = [i for i, s in enumerate(rows) if i >= prefilling and not s.done]
        self._index_rows(rows[i] for i in live)
        self._index_outputs(rows[i] for i in live)
        tokens, counts = self.index.propose_arrays([rows[i].request_id for i in live], width,
                                                   self.suffix_min_match)  # all rows at once
        if len(live) < len(rows):  # the others propose nothing
            every = np.zeros((len(rows), width), np.int64), np.zeros(len(rows), np.int64)
            every[0][live], every[1][live] = tokens, counts
            tokens, counts = every
        return tokens, counts, [len(s.output_ids) for s in rows]

    def _issue(self) -> _SourceStep:
        engine = self.engine
        if self._new_draft.is_set():  # a new draft was swapped in: measure it afresh
            self._new_draft.clear()
            for controller in self.controllers.values():
                if DRAFT in controller.sources:
                    controller.forget(DRAFT)
        rows = list(self._running)
        bucket = engine.bucket(len(rows))
        controller = self.controllers[bucket.batch]
        matched = False
        # The step's host work begins here: the lookup is the step's (the controller counts
        # it in the step's own seconds, not in those of the step in flight).
        started = controller.clock()
        # The index is looked up only when a suffix arm could be chosen (the best arm, or one
        # being probed or due a probe): without a match none is usable, so a step that could
        # not choose one skips the host's lookup, as the plain Scheduler's step does; where
        # only a probe of the suffix's arms could use it (no other arm due), lookups that
        # found nothing back off (`LookupBackoff`): a skipped one runs the best arm.
        use = controller.use_of(SUFFIX) if self.index is not None else UNUSED
        if use == NEEDED or (use == PROBE_ONLY and self.lookups.due()):
            tokens, counts, anchors = self._proposals(rows)
            matched = bool(counts.any())
            self.lookups.found(matched)
            self.lookup_count += 1
        deferred = bucket.deferred  # (the draft's gammas whose graphs capture later)
        choice = controller.choose(lambda arm: matched if arm[0] == SUFFIX
                                   else arm[0] != DRAFT or arm[1] not in deferred,
                                   started=started)
        do_sample = any(not s.params.greedy for s in rows)
        gamma = choice.gamma
        start = time.perf_counter()
        over_proposals = choice.source == SUFFIX  # (usable: some row matched)
        mixed = over_proposals and self._mixed(bucket, gamma)
        runs_draft = mixed or choice.source == DRAFT
        # A step without the draft moves a row on by at most gamma + 1 tokens (target-only: 1)
        behind = gamma + 1 if bucket.draft is not None and not runs_draft else 0
        with self.swap.lock if self.swap is not None else contextlib.nullcontext():
            resync = self._catch_up(bucket) if runs_draft else (lambda: 0.0)
            self._draft_behind += behind
            if over_proposals:  # mixed (the draft's rows beside the index's), or the index's
                self._buffers[bucket.batch].load_arrays(tokens, counts, anchors=anchors)
                self._streams_from(gamma, False)
                packed = self._run_suffix(bucket, gamma, do_sample)  # [bucket, gamma + 3]
            elif choice.source == DRAFT:  # the plain Scheduler's speculative step
                self._streams_from(gamma, bucket.overlap and not do_sample)
                packed = bucket.run(gamma, do_sample)  # [bucket, gamma + 2]
            else:
                self._streams_from(PLAIN, False)
                packed = bucket.run(PLAIN, do_sample)
            read_back = ReadBack(packed)
        controller.sent()
        return _SourceStep(rows, gamma, None, read_back, start, choice, over_proposals, mixed,
                           behind, resync, prefilling=self._prefilling())

    def _catch_up(self, bucket: object) -> Callable[[], float]:
        """Before a step that runs the draft: catch it up where steps without it left it
        behind (`bucket.resync`, by the most tokens a row moved since); -> the catch-up's
        seconds, to read once the step is read back (CUDA events around it on CUDA; scripted
        costs: their "resync" per token behind)."""
        behind, self._draft_behind = self._draft_behind, 0
        if not behind:
            return lambda: 0.0
        self.resyncs += 1
        cuda = self.engine.device.type == "cuda"
        if cuda:
            begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            begin.record()
        start = time.perf_counter()
        bucket.resync(behind)
        took = time.perf_counter() - start
        if self._resync_cost is not None:
            return lambda: self._resync_cost * behind
        if cuda:
            end.record()
            return lambda: begin.elapsed_time(end) / 1e3  # (done once the step is read back)
        return lambda: took

    def _collect(self, step: _SourceStep) -> None:
        live = [row for row, s in enumerate(step.rows)
                if not s.done and row >= step.prefilling]  # (the rows the step generated for)
        host = step.read_back.wait()
        n_rows, gamma = len(step.rows), step.gamma
        column = host[:n_rows, -1].tolist()
        accepted = [min(column[i], gamma) for i in live]
        controller = self.controllers[self.engine.bucket(n_rows).batch]
        resync = step.resync()
        if not step.over_proposals:  # every row's proposals the step's source's (or none)
            controller.update(accepted, gamma, behind=step.behind, resync=resync)
        else:
            # Steps over the proposals buffer carry each row's suffix proposals before n. A
            # mixed step's row without any verified the draft's gamma; without a draft every
            # row of a suffix step is the index's (proposing its count, maybe 0).
            column = host[:n_rows, gamma + 1].tolist()
            counts = [column[i] for i in live]
            alone = not step.mixed
            suffix_rows = [c > 0 or alone for c in counts]
            controller.update(accepted, gamma,
                              proposed=[c if s else gamma for c, s in zip(counts, suffix_rows)],
                              row_sources=[SUFFIX if s else DRAFT for s in suffix_rows],
                              behind=step.behind, resync=resync)
        super()._collect(step)
        self.engine.stats.gamma = gamma

    def _draft_ran(self, step: _SourceStep) -> bool:
        """A draft or mixed step ran the draft; target-only and long suffix steps did not."""
        return len(self._caches) > 1 and (step.choice.source == DRAFT or step.mixed)

    # -- the draft's updates ---------------------------------------------------------------------

    def _update_draft(self) -> None:
        """One distillation update (a side CUDA stream on CUDA); an accepted candidate is
        staged there and swapped in between two steps."""
        try:
            cuda = self.engine.device.type == "cuda"
            side = torch.cuda.Stream(self.engine.device) if cuda else None
            # Beside serving (a background thread), by default the update works SERVING_DUTY
            # of the wall clock while requests run or wait (serving is bound by the host's
            # loop: work beside it takes the GIL and the GPU from it) and unpaced while the
            # server idles. With DistillConfig.duty given it works that share, whatever the load.
            duty, idle = self.distiller.config.duty, None
            if duty is None and self.background:
                duty, idle = SERVING_DUTY, self.idle
            result = self.distiller.update(self.engine.config.distill_budget_s, stream=side,
                                           duty=duty or 1.0, stop=self._closing, idle=idle)
            if result.accepted:
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    self.distiller.swap_into(self.swap)
                self._new_draft.set()
            self.update_results.append(result)  # the distiller logs each update itself
        except Exception:  # noqa: BLE001 -- a failed update leaves the draft as it was
            log.exception("fuser: a draft update failed; the draft is unchanged")
        finally:
            self._updating.clear()

    def idle(self) -> bool:
        """Whether no request is running or waiting (read from any thread)."""
        return not self._running and not self._waiting

    def wait_update(self, timeout: float | None = None) -> bool:
        """Block until no draft update runs; False after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._updating.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    # -- what it did -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, object]:
        """The controllers' choices and reasons per bucket, the draft's updates and the
        index's pool: what engine.stats shows of adaptive speculation."""
        out: dict[str, object] = {
            "buckets": {size: c.snapshot() for size, c in self.controllers.items()},
            "steps": {s: sum(c.steps[s] for c in self.controllers.values())
                      for s in (TARGET, DRAFT, SUFFIX)},
            "rows": {s: sum(c.rows[s] for c in self.controllers.values())
                     for s in (DRAFT, SUFFIX)},
            "resyncs": self.resyncs,
            # steps queued before the step in flight was read back (of which after a chunk)
            "steps_ahead": self.steps_ahead,
            "chunks_ahead": self.chunks_ahead,
        }
        if self.distiller is not None:
            d = self.distiller
            out["draft_updates"] = dict(d.updates)
            out["update_seconds"] = d.update_seconds
            out["distill_records"] = d.records
            out["draft_version"] = d.swapped_version
            out["update_in_flight"] = d.progress()  # (None: none runs)
        if self.index is not None:
            out["recent_outputs"] = self.index.recent_sequences
            out["lookups"] = self.lookup_count  # the index's lookups on the steps' path
            out["suffix_uncaptured"] = {  # (CUDA: suffix or mixed steps run uncaptured)
                f"{b} gamma {g} {'sample' if x else 'greedy'}": n
                for (b, g, x), n in self.suffix_uncaptured.items()}
        return out

