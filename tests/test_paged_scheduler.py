"""The scheduler over a paged engine (runtime/scheduler.py with runtime/blocks.py), tiny fp32
models on the CPU: a request's tokens are the same alone, in a full batch, after preemption
and with a prefix-cache hit (exactly); a request that finds no blocks waits and then
completes; no block leaks after many requests with cancellations.

Engines: the tests/engines.py Llama target, rows 4, buckets 1, 2, 4, 4-slot blocks; the pool
either holds every row at full length ("full") or 13 usable blocks (52 slots: a little more
than one long request, so requests wait and are preempted).
"""

from __future__ import annotations

import functools
import random
import warnings

import pytest
import torch

import fuser
from fuser import Scheduler
from fuser.runtime import speculative
from engines import MAX_SEQ_LEN, VOCAB, RunningGraph, SyncMode, adaptive_rounds_checked, greedy, \
    llama_target, paged_engine, perturbed, prompt, sampled

BLOCK = 4  # paged_engine's block size
SMALL_POOL = 14  # blocks, the null block included
TIMEOUT = 120.0

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


engine = paged_engine  # (tests/engines.py: shared with tests/test_paged_engine.py)


# Greedy and seeded sampling, prompts of a few lengths (several of one length: they prefill
# together), budgets that end at different steps.
REQUESTS = [(prompt(6 + 3 * (i % 3), seed=i),
             greedy(5 + 3 * i) if i % 2 == 0 else sampled(5 + 3 * i, seed=50 + i))
            for i in range(6)]


def started(eng: fuser.Engine, **options: object) -> Scheduler:
    sched = Scheduler(eng, max_waiting=256, **options)
    sched.start()
    return sched


def alone(eng: fuser.Engine, requests: list) -> list[list[int]]:
    """Each request by itself, prefix caching off (every prompt prefilled whole)."""
    sched = started(eng, prefix_caching=False)
    try:
        return [sched.submit(p, params).result(TIMEOUT) for p, params in requests]
    finally:
        sched.close()


def assert_no_leak(sched: Scheduler) -> None:
    """Every block is free or cached (unreferenced), no row holds any, the table is null (the
    host's: on CUDA the device copy is synced before the next step, not at release)."""
    blocks = sched.blocks
    assert sched.wait_idle(TIMEOUT)
    assert blocks.active_rows() == []
    assert blocks.available_blocks == blocks.usable_blocks
    assert all(blocks.refs(b) == 0 for b in range(blocks.num_blocks))
    assert sorted(blocks.free_blocks() + blocks.lru_blocks()) == list(range(1, blocks.num_blocks))
    assert not blocks.host_table.any()


def test_full_batch_returns_what_each_returns_alone_and_greedy_as_generate(engines) -> None:
    eng = engine()
    want = alone(eng, REQUESTS)
    sched = started(eng)
    try:
        streams = [sched.submit(p, params) for p, params in REQUESTS]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.preemptions == 0
        assert_no_leak(sched)
    finally:
        sched.close()
    contiguous, _ = engines("plain")  # the same target over a contiguous cache
    for (p, params), out in list(zip(REQUESTS, want))[::2]:
        ref = contiguous.generate(torch.tensor([p]), params.max_tokens)[0, len(p):].tolist()
        assert out == ref


def test_prefix_hit_prefills_only_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """B's prompt opens with A's first three blocks: admitted after A, it finds them cached,
    prefills its other 3 tokens through the chunk step, and returns what it returns alone."""
    eng = engine()
    shared = prompt(12, seed=20)
    a = (shared + prompt(2, seed=21), greedy(6))
    b_requests = [(shared + prompt(3, seed=22), greedy(9)),
                  (shared + prompt(3, seed=23), sampled(9, seed=7))]
    want = alone(eng, b_requests)
    chunks = []
    real = speculative.prefill_chunk

    def spy(*args, **kwargs):
        chunks.append(args[4])  # cached tokens per row
        return real(*args, **kwargs)

    monkeypatch.setattr(speculative, "prefill_chunk", spy)
    sched = started(eng)
    try:
        sched.submit(*a).result(TIMEOUT)
        assert sched.blocks.prefix_hits == 0 and sched.blocks.prefix_queries == 14
        got = [sched.submit(p, params).result(TIMEOUT) for p, params in b_requests]
        assert got == want
        assert chunks == [[12], [12]]
        assert sched.blocks.prefix_hits == 24 and sched.blocks.prefix_queries == 14 + 30
        assert_no_leak(sched)
        assert len(sched.blocks.cached_blocks()) >= 3  # the shared blocks stay cached
    finally:
        sched.close()


def test_preempted_requests_return_what_they_return_alone() -> None:
    """Six requests whose rows outgrow a 13-block pool: the newest rows are preempted and
    requeued (several times), resumed from their tokens so far; every output is unchanged."""
    eng = engine(SMALL_POOL)
    assert eng.target.cache.num_blocks == SMALL_POOL
    requests = [(prompt(10, seed=30 + i), greedy(20) if i % 2 == 0 else sampled(20, seed=i))
                for i in range(6)]
    want = alone(eng, requests)
    sched = started(eng)
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.preemptions > 0 and any(s.preemptions for s in streams)
        assert_no_leak(sched)
    finally:
        sched.close()


def test_a_request_without_blocks_waits_then_completes() -> None:
    """Stepped by hand: the first request takes 8 of 13 blocks; the second (8 more) waits
    while the first runs, then runs once its blocks are back, and returns what it returns
    alone."""
    eng = engine(SMALL_POOL)
    first, second = (prompt(30, seed=40), greedy(8)), (prompt(30, seed=41), greedy(8))
    want = alone(eng, [second])[0]
    sched = Scheduler(eng)  # not started: the test runs the loop's iterations itself
    try:
        s1, s2 = sched.submit(*first), sched.submit(*second)
        with eng.generating():
            sched._iteration()
            assert sched.num_running == 1 and sched.num_waiting == 1 and not s2.output_ids
            assert sched.blocks.usage() > 0.5
            while not s1.done:
                sched._iteration()
                assert s2.done or sched.num_waiting == 1
            while not s2.done:
                sched._iteration()
        assert s2.output_ids == want and s1.preemptions == s2.preemptions == 0
        sched._retire()
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.parametrize("budget", [None, 5])
def test_no_block_leaks_after_many_requests_with_cancellations(budget: int | None) -> None:
    """1,000 requests of random lengths and budgets on the small pool, a third cancelled
    (waiting, just admitted or mid-way): afterwards every block is free or cached, also with
    a budget of 5 (prompts in chunks, queued ahead beside decode steps)."""
    eng = engine(SMALL_POOL)
    rng = random.Random(0)
    sched = started(eng, max_num_batched_tokens=budget)
    try:
        streams = []
        for i in range(1000):
            length = rng.randint(1, 24)
            params = greedy(rng.randint(1, 12)) if rng.random() < 0.5 else \
                sampled(rng.randint(1, 12), seed=i)
            # repeated openings: prefix-cache hits, shared blocks released in any order
            ids = prompt(8, seed=rng.randint(0, 3))[:length] + prompt(length, seed=1000 + i)
            streams.append(sched.submit(ids[:length + 4], params))
            if rng.random() < 0.33:
                victim = streams[rng.randrange(len(streams))]
                if rng.random() < 0.5:
                    next(iter(victim), None)  # let it run a step first
                victim.cancel()
        for stream in streams:
            stream.result(TIMEOUT)
        assert all(s.finish_reason in ("abort", "length") for s in streams)
        assert_no_leak(sched)
        assert sched.blocks.prefix_hits > 0
        assert budget is None or sched.chunks_ahead > 0
    finally:
        sched.close()


def test_a_request_the_pool_can_never_hold_is_refused() -> None:
    sched = Scheduler(engine(SMALL_POOL))
    try:
        with pytest.raises(ValueError, match="KV blocks"):
            sched.submit(prompt(40, seed=1), greedy(20))  # 60 slots, 15 blocks > 13
    finally:
        sched.close()


@pytest.mark.slow  # (an engine with a draft: ~30 s more on a 2-core CPU)
def test_speculative_paged_scheduler_with_preemption_and_prefix_hits() -> None:
    """The draft's blocks follow the target's table: speculative steps (gamma 3) over a small
    pool, with preemption and shared openings, return each request's greedy tokens alone."""
    eng = engine(SMALL_POOL, draft=True)
    shared = prompt(8, seed=60)
    requests = [(shared + prompt(4, seed=61 + i), greedy(18)) for i in range(5)]
    want = alone(eng, requests)
    sched = started(eng, capture_at_idle=False)  # (every chunk replays, the first's captured)
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.preemptions > 0 and sched.blocks.prefix_hits > 0
        assert_no_leak(sched)
    finally:
        sched.close()


# -- decoded blocks keyed with a draft (a chat's next turn hits its earlier answer) --------------


@functools.cache
def draft_engine(overlap: bool = False) -> fuser.Engine:
    """The paged engine with its draft (gamma 3), every row at full length; shared by the
    tests below (a draft engine takes ~20 s to build on a 2-core CPU). overlap: greedy
    speculative steps as overlapped rounds (FuserConfig.overlap)."""
    if not overlap:
        return engine(draft=True)
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 2, 4),
                               gamma=3, compile="fx", kv_block_size=BLOCK, overlap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3), config=config)
    assert all(b.overlap for b in built.buckets.values()) and built.target.cache.paged
    return built


def fresh_prefill(eng: fuser.Engine, tokens: list[int]) -> list[list[torch.Tensor]]:
    """[k pools, v pools] of both models, [layers x [blocks, BLOCK, kv_heads, D]] each, of
    `tokens`' full blocks as a fresh whole-prompt prefill writes them (a scheduler of its own,
    stepped by hand, prefix caching off)."""
    sched = Scheduler(eng, prefix_caching=False)
    try:
        sched.submit(tokens, greedy(1))
        with eng.generating():
            sched._admit()
            rows = sched.blocks.row_blocks(0)[:len(tokens) // BLOCK]
            pools = [[layer[rows].clone() for layer in pool]
                     for cache in sched._caches for pool in (cache.k, cache.v)]
            sched._retire()
        return pools
    finally:
        sched.close()


def check_keyed_blocks(sched: Scheduler, tokens: list[int],
                       reference: list[list[torch.Tensor]]) -> int:
    """Every cached block on `tokens`' chain of keys holds, in both models' pools, the k/v a
    fresh prefill of `tokens` writes there (fp32: up to the rounding of the other kernels);
    returns how many leading blocks of `tokens` are cached."""
    from fuser.runtime.blocks import block_key

    by_key = {key: block for block, key in sched.blocks.cached_blocks().items()}
    pools = [pool for cache in sched._caches for pool in (cache.k, cache.v)]
    parent, found = b"", 0
    for i in range(len(tokens) // BLOCK):
        parent = block_key(parent, tokens[i * BLOCK:(i + 1) * BLOCK])
        block = by_key.get(parent)
        if block is None:
            break
        for model_pool, want in zip(pools, reference):
            for layer, layer_want in zip(model_pool, want):
                torch.testing.assert_close(layer[block], layer_want[i], rtol=1e-4, atol=1e-4,
                                           msg=lambda m, i=i: f"keyed block {i}: {m}")
        found += 1
    return found


def scrub(sched: Scheduler) -> None:
    """Fill both models' pools with a constant (what earlier runs of the same tokens left there
    would be right: a slot the run under test never writes must show as wrong)."""
    for cache in sched._caches:
        for pool in (*cache.k, *cache.v):
            pool.fill_(5.0)


# gamma per step: speculative steps, target-only runs that leave the draft behind (each
# followed by a resync), and speculative steps again
GAMMA_PATTERNS = {"speculative": [3], "target_only_runs": [3, 0, 0, 3, 0, 3, 3, 0, 0, 0, 3]}


def chat_turns(eng: fuser.Engine, gammas: list[int]) -> list[tuple[int, int, int]]:
    """Turn 1 (11-token prompt, 30 greedy tokens) on a draft engine stepped by hand, gamma per
    step as `gammas` says (`fix_gamma`, in turn): after every iteration each keyed block holds,
    in the target's and the draft's pools, what a fresh prefill of those tokens writes (so a
    later hit cannot get stale draft k/v: after an all-accepted step the draft's last slot is
    not written, after target-only steps its slots lag until a resync). Turn 2 (turn 1's
    prompt and answer and 3 new tokens) hits blocks of the answer, beyond the prompt's 2, and
    returns what it returns alone; nothing leaks. Returns (gamma, accepted, the target's new
    length) of each draft step."""
    first = prompt(11, seed=120)  # (on the CPU an all-accepted step ends at slot 32)
    answer = alone(eng, [(first, greedy(30))])[0]
    second = first + answer + prompt(3, seed=121)
    want = alone(eng, [(second, greedy(8))])[0]
    reference = fresh_prefill(eng, first + answer)
    sched = Scheduler(eng)
    sched._may_run_ahead = lambda in_flight: False  # one step an iteration
    steps = []
    advanced = sched._draft_advanced

    def spy(stream, gamma, accepted):
        length = len(stream.prompt_ids) + len(stream.output_ids) + accepted
        steps.append((gamma, accepted, length))
        advanced(stream, gamma, accepted)

    sched._draft_advanced = spy
    scrub(sched)
    try:
        s1 = sched.submit(first, greedy(30))
        with eng.generating():
            i = 0
            while not s1.done:
                eng.fix_gamma(gammas[i % len(gammas)])
                i += 1
                sched._iteration()
                assert check_keyed_blocks(sched, first + answer, reference) == \
                    len(sched.blocks.cached_blocks())
            eng.fix_gamma(None)
            sched._retire()
            assert s1.output_ids == answer
            keyed = check_keyed_blocks(sched, first + answer, reference)
            assert keyed > len(first) // BLOCK  # blocks of the answer too
            hits = sched.blocks.prefix_hits
            s2 = sched.submit(second, greedy(8))
            while not s2.done:
                sched._iteration()
            sched._retire()
        assert s2.output_ids == want
        assert sched.blocks.prefix_hits - hits == keyed * BLOCK > len(first) // BLOCK * BLOCK
        assert_no_leak(sched)
    finally:
        eng.fix_gamma(None)
        sched.close()
    return steps


@pytest.mark.xdist_group("paged_draft_engine")
@pytest.mark.parametrize("overlap", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.parametrize("pattern", sorted(GAMMA_PATTERNS))
def test_a_chats_next_turn_hits_its_answer_with_a_draft(pattern: str, overlap: bool) -> None:
    """`chat_turns` with speculative steps, or runs of target-only steps between them;
    overlap (slow: an engine of its own): the greedy speculative steps are overlapped rounds,
    whose draft runs ahead of the verified slots."""
    steps = chat_turns(draft_engine(overlap), GAMMA_PATTERNS[pattern])
    if overlap:  # rounds that streamed (accepted guesses drafted the round before)
        assert any(a > 0 for _, a, _ in steps)
    else:  # all-accepted steps and others; one fills a block whose last draft slot it
        assert {a == g for g, a, _ in steps} == {True, False}  # did not write
        assert any(a == g and length % BLOCK == 0 for g, a, length in steps)


@pytest.mark.xdist_group("paged_draft_engine")
def test_keyed_blocks_under_the_adaptive_schedulers_mixed_steps() -> None:
    """The adaptive scheduler on the draft engine (scripted costs: mostly the draft, target-
    only probes), stepped by hand: a request runs twice, the prefix cache and the pools
    cleared in between, so that the second time its answer is among the suffix index's
    recent outputs and its rows verify the index's proposals in the draft's steps (mixed
    steps: the draft is fed the proposals, all accepted). After every iteration each keyed
    block holds a fresh prefill's k/v in both pools; the answer's blocks are keyed and both
    runs return the greedy tokens alone."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.controller import DRAFT, SUFFIX

    eng = draft_engine()
    first = prompt(11, seed=130)
    answer = alone(eng, [(first, greedy(30))])[0]
    reference = fresh_prefill(eng, first + answer)
    sched = AdaptiveScheduler(eng, suffix=True, adapt_draft=False, background=False,
                              costs={"decode": 1.0, DRAFT: {3: 1.3}},
                              controller_options=dict(probe_share=0.2, refresh=8))
    sched._may_run_ahead = lambda in_flight: False  # one step an iteration
    try:
        with eng.generating():
            for _ in range(2):
                sched.blocks.reset_prefix_cache()
                scrub(sched)
                stream = sched.submit(first, greedy(30))
                while not stream.done:
                    sched._iteration()
                    assert check_keyed_blocks(sched, first + answer, reference) == \
                        len(sched.blocks.cached_blocks())
                sched._retire()
                assert stream.output_ids == answer
                suffix_rows = sched.snapshot()["rows"][SUFFIX]
                assert check_keyed_blocks(sched, first + answer, reference) > len(first) // BLOCK
        snap = sched.snapshot()
        assert suffix_rows > 0 and snap["steps"][DRAFT] > 0, snap
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.xdist_group("paged_draft_engine")
def test_the_adaptive_scheduler_queues_its_mixed_steps_ahead() -> None:
    """Scripted costs (the draft pays): templated traffic, each prompt twice, through the
    adaptive scheduler stepped by hand on the draft engine: steps, mixed ones among them, are
    queued ahead of the read-back, each inside `checking_issues_ahead`'s check (here it only
    records the mode; tests/test_mixed_step.py's CUDA test makes it raise on a sync), no
    read-back runs inside the check, and both rounds return each request's tokens alone."""
    from fuser.runtime.controller import DRAFT, SUFFIX

    eng = draft_engine()
    texts = [prompt(8, seed=140 + i) for i in range(4)]
    batch = [t + t for t in texts]
    want = alone(eng, [(p, greedy(20)) for p in batch])
    sync = SyncMode()
    outputs, counts, snap = adaptive_rounds_checked(eng, batch, 20, sync,
                                                    costs={"decode": 1.0, DRAFT: {3: 1.3}})
    assert sync.mode == 0
    assert counts["checked"] > 0 and counts["mixed"] > 0, counts
    assert snap["rows"][SUFFIX] > 0, snap
    assert outputs == [want, want]


@pytest.mark.xdist_group("paged_draft_engine")
def test_the_adaptive_scheduler_prefills_in_chunks() -> None:
    """AdaptiveScheduler(max_num_batched_tokens=6) on the draft engine (scripted costs: mostly
    the draft, with probes): prompts go in chunks while the other rows decode through the
    draft's, mixed (suffix) and target-only steps; a repeated request is among the recent
    outputs, so its rows verify the index's proposals. Greedy outputs are each request's
    alone; seeded ones have their length (rows in prefill are never the controller's: a
    count above gamma would fail the step). Chunks are queued ahead of read-backs there too
    (the loop is Scheduler's)."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.controller import DRAFT, SUFFIX

    eng = draft_engine()
    repeated = (prompt(11, seed=130), greedy(24))
    requests = [repeated] + REQUESTS[:4] + [(prompt(30, seed=90), greedy(7)), repeated]
    want = alone(eng, requests)
    sched = AdaptiveScheduler(eng, suffix=True, adapt_draft=False, background=False,
                              max_num_batched_tokens=6,
                              costs={"decode": 1.0, DRAFT: {3: 1.3}},
                              controller_options=dict(probe_share=0.2, refresh=8))
    sched.start()
    try:
        got = [sched.submit(p, params).result(TIMEOUT) for p, params in requests[:1]]
        streams = [sched.submit(p, params) for p, params in requests[1:]]
        got += [s.result(TIMEOUT) for s in streams]
        for (_, params), out, alone_out in zip(requests, got, want):
            if params.greedy:  # (a sampled row's draws depend on the step that verified it)
                assert out == alone_out
            else:
                assert len(out) == params.max_tokens and max(out) < VOCAB
        assert sched.prefill_chunks > len(requests)
        snap = sched.snapshot()
        assert snap["steps"][DRAFT] > 0 and snap["rows"][SUFFIX] > 0, snap
        assert snap["chunks_ahead"] == sched.chunks_ahead > 0, snap  # (its loop is the same)
        assert_no_leak(sched)
    finally:
        sched.close()


def swap_turns(eng: fuser.Engine, how: str) -> None:
    """Turn 1 of a chat runs with the draft as built, stepped by hand; its blocks are cached.
    Then new draft weights are swapped into the live draft (runtime/distill.py `WeightSwap`):
    "adaptive", through the adaptive scheduler's own swap, which its next admission notices;
    "chunked", by hand beside chunked prefill (`draft_weights_changed`). Turn 2 (an edit of
    the answer) hits turn 1's first 4 blocks, turn 3 all of them, turn 4 them again: the
    target runs only past each hit (its cached k/v reused); the draft alone runs over the
    stale part of a hit (turn 2: all of it; turn 3: the blocks past turn 2's; turn 4:
    nothing), after which the draft's half of every cached block of turn 1 holds what a
    fresh prefill by the NEW draft writes there (the old draft's k/v would cost acceptance
    until evicted).
    The greedy tokens are the target-only ones. The engine's draft weights are restored at
    the end."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.controller import DRAFT
    from fuser.runtime.distill import WeightSwap, draft_module

    module = draft_module(eng)
    old = {n: p.detach().clone() for n, p in module.named_parameters()}
    new = perturbed(module, 0.3, seed=11).state_dict()
    swap = WeightSwap.for_engine(eng)
    first = prompt(11, seed=140)
    answer = alone(eng, [(first, greedy(30))])[0]
    edit = 4 * BLOCK  # turn 2 keeps the first 16 tokens of turn 1 (first + 5 of the answer)
    turns = [(first + answer[:edit - len(first)] + prompt(3, seed=141), greedy(6)),
             (first + answer + prompt(3, seed=142), greedy(4)),
             (first + answer + prompt(2, seed=143), greedy(2))]
    sched = None
    patch = pytest.MonkeyPatch()
    try:
        eng.fix_gamma(0)  # target-only
        want = alone(eng, turns)
        eng.fix_gamma(None)
        swap.swap(new)
        reference = fresh_prefill(eng, first + answer)  # the target's and the new draft's
        swap.swap(old)
        if how == "adaptive":
            sched = AdaptiveScheduler(eng, suffix=False, adapt_draft=True, background=False,
                                      costs={"decode": 1.0, DRAFT: {3: 1.3}})
        else:
            sched = Scheduler(eng, max_num_batched_tokens=8)
        sched._may_run_ahead = lambda in_flight: False  # one step an iteration
        draft_alone, target_from = [], []  # per prefill call: where each row starts
        real_part, real_chunk = speculative.prefill_part, speculative.prefill_chunk

        def part(target, draft, tokens, progress, width):
            (draft_alone if target is None else target_from).append(list(progress))
            return real_part(target, draft, tokens, progress, width)

        def chunk(target, draft, state, tokens, cached, *args):
            target_from.append(list(cached))
            return real_chunk(target, draft, state, tokens, cached, *args)

        patch.setattr(speculative, "prefill_part", part)
        patch.setattr(speculative, "prefill_chunk", chunk)
        scrub(sched)
        s1 = sched.submit(first, greedy(30))
        outputs = []
        with eng.generating():
            while not s1.done:
                sched._iteration()
            sched._retire()
            keyed = len(sched.blocks.cached_blocks())
            assert keyed > edit // BLOCK  # blocks of the answer past the edit too
            if how == "adaptive":
                sched.swap.swap(new)
            else:
                swap.swap(new)
                sched.draft_weights_changed()
            # Per turn: its hit, the draft-alone prefill's start per row, and the blocks of
            # turn 1 then cached (turn 3's prompt keys the rest of them).
            full = len(first + answer) // BLOCK
            expect = [(edit, [[0]], edit // BLOCK), (keyed * BLOCK, [[edit]], full),
                      (full * BLOCK, [], full)]
            for (tokens, params), (hit, refreshed, checked) in zip(turns, expect):
                hits = sched.blocks.prefix_hits
                del draft_alone[:], target_from[:]
                stream = sched.submit(tokens, params)
                sched._iteration()  # admitted (and a step)
                assert check_keyed_blocks(sched, (first + answer)[:checked * BLOCK],
                                          reference) == checked
                assert sched.blocks.prefix_hits - hits == hit
                assert target_from == [[hit]] and draft_alone == refreshed
                while not stream.done:
                    sched._iteration()
                sched._retire()
                outputs.append(stream.output_ids)
        assert outputs == want
        assert_no_leak(sched)
    finally:
        patch.undo()
        eng.fix_gamma(None)
        swap.swap(old)
        if sched is not None:
            sched.close()


@pytest.mark.xdist_group("paged_draft_engine")
@pytest.mark.parametrize("how", ["adaptive", "chunked"])
def test_a_hit_after_a_draft_swap_gets_the_new_drafts_kv_and_keeps_the_targets(
        how: str) -> None:
    """`swap_turns` on the paged draft engine (gamma 3)."""
    swap_turns(draft_engine(), how)


def test_serving_metrics_move() -> None:
    """/metrics' KV gauge and prefix-cache counters (fuser/server/metrics.py) follow the
    scheduler: usage above 0 while a request holds blocks, 0 after; queries and hits in
    tokens."""
    from fuser.server.metrics import ServingMetrics
    from serve_util import metric

    sched = Scheduler(engine())  # stepped by hand
    metrics = ServingMetrics(lambda: sched)
    try:
        text = metrics.text()
        assert metric(text, "fuser_kv_cache_usage_perc") == 0.0
        assert metric(text, "fuser_prefix_cache_queries_total") == 0.0
        shared = prompt(8, seed=70)
        first = sched.submit(shared + [5], greedy(3))
        scraped = []
        collect = sched._collect

        def scrape_then_collect(step) -> None:  # a scrape while the request runs
            scraped.append(metric(metrics.text(), "fuser_kv_cache_usage_perc"))
            collect(step)

        sched._collect = scrape_then_collect
        with engine().generating():
            while not first.done:
                sched._iteration()
            assert scraped and scraped[0] == 3 / sched.blocks.usable_blocks  # 12 slots: 3 blocks
            sched.submit(shared + [6, 7], greedy(2))
            while sched.num_running or sched.num_waiting:
                sched._iteration()
            sched._retire()
        text = metrics.text()
        assert metric(text, "fuser_kv_cache_usage_perc") == 0.0
        assert metric(text, "fuser_prefix_cache_queries_total") == 9 + 10
        assert metric(text, "fuser_prefix_cache_hits_total") == 8
    finally:
        sched.close()


# -- prompts in chunks between decode steps (max_num_batched_tokens) -----------------------------


def count_prompt_tokens(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on the three prefill functions: the prompt tokens each call runs, appended to the
    returned list."""
    fed: list[int] = []
    real_part, real_chunk, real_whole = (speculative.prefill_part, speculative.prefill_chunk,
                                         speculative.prefill)

    def part(target, draft, tokens, progress, width):
        fed.append(tokens.shape[0] * width)
        return real_part(target, draft, tokens, progress, width)

    def chunk(target, draft, state, tokens, cached, *args):
        fed.append(sum(tokens.shape[1] - c for c in cached))
        return real_chunk(target, draft, state, tokens, cached, *args)

    def whole(target, draft, state, prompts, true_length, *args):
        fed.append(prompts.batch * true_length)
        return real_whole(target, draft, state, prompts, true_length, *args)

    monkeypatch.setattr(speculative, "prefill_part", part)
    monkeypatch.setattr(speculative, "prefill_chunk", chunk)
    monkeypatch.setattr(speculative, "prefill", whole)
    return fed


def test_chunked_prefill_returns_what_each_returns_alone() -> None:
    """A budget of 6 tokens an iteration: every prompt goes in several chunks while others
    decode (chunks queued ahead of the read-backs); greedy and seeded outputs are each
    request's alone, first tokens timed."""
    eng = engine()
    requests = REQUESTS + [(prompt(30, seed=90), greedy(7)), (prompt(21, seed=91), greedy(9))]
    want = alone(eng, requests)
    sched = started(eng, max_num_batched_tokens=6)
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.prefill_chunks >= len(requests) + 30 // 4
        assert sched.chunks_ahead > 0  # (queued ahead of read-backs, sampled rows beside)
        assert all(s.first_token_time is not None and s.first_token_time >= s.arrival_time
                   for s in streams)
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.xdist_group("paged_draft_engine")
@pytest.mark.parametrize("draft", [False, True])
def test_chunks_at_captured_widths_return_what_each_returns_alone(
        draft: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where prefills and chunks replay CUDA graphs (runtime/prefill_graphs.py), each runs at a
    captured width, a chunk's extra tokens repeating the prompt (or its last token) at slots
    past it, and each capture first runs the step on zeros, writing those slots. Simulated on
    the CPU (a stand-in graph that runs the step at capture and at each call): prefix hits,
    chunked prefills (a budget of 6 tokens) and whole prompts return what each request returns
    alone, and every chunk ran at a captured width wider than it needed (with a draft: both
    models')."""
    from fuser.runtime import prefill_graphs
    from fuser.runtime.prefill_graphs import padded_length

    eng = engine(draft=draft)
    shared = prompt(12, seed=20)
    requests = [(shared + prompt(2, seed=21), greedy(6)), (shared + prompt(3, seed=22), greedy(9)),
                (prompt(30, seed=90), greedy(7)), (shared + prompt(5, seed=23), sampled(9, seed=7))]
    want = alone(eng, requests)
    widths: list[tuple[int, int]] = []  # (width run, slots)
    monkeypatch.setattr(prefill_graphs, "CudaGraphStep", RunningGraph)
    for bucket in eng.buckets.values():
        bucket.capture_prefills(None)

    def recorded(graphs: prefill_graphs.ChunkGraphs):
        run = graphs.run

        def record(tokens: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
            widths.append((tokens.shape[1], graphs.model.cache.slots))
            return run(tokens, *args)
        return record

    for bucket in eng.buckets.values():
        bucket.target.chunk_graphs.run = recorded(bucket.target.chunk_graphs)
    try:
        # (captured on the path of the request that first needs a width, so that this one's
        # chunks replay: tests/test_idle_capture.py covers the captures at idle)
        sched = started(eng, max_num_batched_tokens=6, capture_at_idle=False)
        try:
            got = [sched.submit(p, params).result(TIMEOUT) for p, params in requests]
            assert got == want
            assert sched.blocks.prefix_hits > 0 and sched.prefill_chunks > len(requests)
            assert_no_leak(sched)
        finally:
            sched.close()
        replays = eng.report().graph_replays
        assert any(k.startswith("chunk.") and v for k, v in replays.items()), replays
        assert eng.report().fallbacks == []
    finally:
        for bucket in eng.buckets.values():
            for model in (bucket.target, bucket.draft):
                if model is not None:
                    model.prefill_graphs = model.chunk_graphs = None
            bucket.prefills = []
    assert widths and all(padded_length(w, slots) == w for w, slots in widths)
    assert max(w for w, _ in widths) > 6


@pytest.mark.parametrize("budget", [None, 8])
def test_a_running_request_gets_a_token_every_iteration(
        monkeypatch: pytest.MonkeyPatch, budget: int | None) -> None:
    """Stepped by hand: a 40-token prompt joins while a request decodes. In chunks (budget 8:
    4-token chunks beside the running row's token) the running request gets a token every
    iteration and no iteration runs more than the budget; whole (no budget), the iteration
    that admits it runs all 40 prompt tokens before the next decode step."""
    eng = engine()
    runner, long = (prompt(5, seed=80), greedy(30)), (prompt(40, seed=81), greedy(4))
    want = alone(eng, [runner, long])
    fed = count_prompt_tokens(monkeypatch)
    sched = Scheduler(eng, max_num_batched_tokens=budget)
    sched._may_run_ahead = lambda in_flight: False  # one step an iteration
    try:
        r = sched.submit(*runner)
        with eng.generating():
            sched._iteration()
            assert len(r.output_ids) == 2  # its prefill, then its first step
            s = sched.submit(*long)
            per_iteration = []
            while not s.done:
                before, calls = len(r.output_ids), len(fed)
                sched._iteration()
                per_iteration.append((len(r.output_ids) - before, sum(fed[calls:])))
            while not r.done:
                sched._iteration()
        assert [r.output_ids, s.output_ids] == want
        if budget is None:
            assert max(tokens for _, tokens in per_iteration) == 40
        else:
            assert len(per_iteration) >= 40 // 4
            assert sched.prefill_chunks == 1 + 40 // 4  # (the runner's prompt: one chunk)
            assert all(got == 1 and tokens <= budget - 1 for got, tokens in per_iteration), \
                per_iteration
        assert_no_leak(sched)
    finally:
        sched.close()


def test_cancel_during_a_chunked_prefill_frees_its_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A 40-token prompt cancelled after its third chunk: it ends ("abort") at the next
    iteration with its blocks freed, while the running request goes on to its own tokens;
    a prefill that is all cancelled ends at once; nothing leaks."""
    eng = engine()
    runner = (prompt(5, seed=82), greedy(20))
    want = alone(eng, [runner])[0]
    fed = count_prompt_tokens(monkeypatch)
    sched = Scheduler(eng, max_num_batched_tokens=6)
    sched._may_run_ahead = lambda in_flight: False  # one step an iteration
    try:
        r = sched.submit(*runner)
        with eng.generating():
            sched._iteration()
            s = sched.submit(prompt(40, seed=83), greedy(4))
            for _ in range(3):
                sched._iteration()
            assert sched._prefilling() == 1 and sched.blocks.holds(0) and len(fed) == 4
            used = sched.blocks.available_blocks
            s.cancel()
            sched._iteration()
            assert s.finish_reason == "abort" and s.output_ids == []
            assert sched._prefilling() == 0 and sched.blocks.available_blocks > used
            alone_long = sched.submit(prompt(40, seed=84), greedy(3))
            sched._iteration()
            assert sched._prefilling() == 1
            alone_long.cancel()
            while not r.done:
                sched._iteration()
            sched._retire()
        assert r.output_ids == want and alone_long.finish_reason == "abort"
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.parametrize("cancelled", [0, 1])
def test_cancel_one_row_of_a_group_in_chunked_prefill(cancelled: int) -> None:
    """Stepped by hand: two 24-token prompts prefill together (rows 0 and 1, chunks of 2 a
    row); one is cancelled after the second chunk: its blocks are freed at once, its row rides
    along to the group's last chunk, and the other returns what it returns alone."""
    eng = engine()
    requests = [(prompt(24, seed=110), greedy(6)), (prompt(24, seed=111), greedy(9))]
    want = alone(eng, requests)
    sched = Scheduler(eng, max_num_batched_tokens=5)
    sched._may_run_ahead = lambda in_flight: False  # one step an iteration
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        with eng.generating():
            sched._iteration()
            sched._iteration()
            assert sched._prefilling() == 2 and sched.prefill_chunks == 2
            free = sched.blocks.available_blocks
            streams[cancelled].cancel()
            sched._iteration()
            assert streams[cancelled].finish_reason == "abort"
            assert not sched.blocks.holds(cancelled) and sched.blocks.holds(1 - cancelled)
            assert sched.blocks.available_blocks > free and sched._prefilling() == 2
            kept = streams[1 - cancelled]
            while not kept.done:
                sched._iteration()
            sched._retire()
        assert kept.output_ids == want[1 - cancelled] and streams[cancelled].output_ids == []
        assert_no_leak(sched)
    finally:
        sched.close()


def test_chunked_prefill_with_preemption_returns_what_each_returns_alone() -> None:
    """The small pool with prompts in chunks: rows are preempted (a group in prefill first,
    as the newest) and requeued; every output is unchanged."""
    eng = engine(SMALL_POOL)
    requests = [(prompt(10 + 3 * i, seed=30 + i),
                 greedy(18) if i % 2 == 0 else sampled(18, seed=i)) for i in range(6)]
    want = alone(eng, requests)
    sched = started(eng, max_num_batched_tokens=5)
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.preemptions > 0 and sched.prefill_chunks > len(requests)
        assert_no_leak(sched)
    finally:
        sched.close()


def test_a_group_in_prefill_is_preempted_first_and_resumes() -> None:
    """Stepped by hand on the small pool: a 36-token prompt (10 blocks) is admitted beside a
    decoding request (2 blocks) and goes in 2-token chunks; when the running row needs a
    fourth block, the group in prefill (the newest) is preempted, not the running row: its
    blocks freed, its finished chunks cached, it waits and then returns what it returns
    alone."""
    eng = engine(SMALL_POOL)
    runner, long = (prompt(4, seed=100), greedy(40)), (prompt(36, seed=101), greedy(4))
    want = alone(eng, [runner, long])
    sched = Scheduler(eng, max_num_batched_tokens=3)
    sched._may_run_ahead = lambda in_flight: False  # one step an iteration
    try:
        r = sched.submit(*runner)
        with eng.generating():
            while not r.output_ids:  # (its 4 tokens: a chunk of 3, then the last one)
                sched._iteration()
            s = sched.submit(*long)
            sched._iteration()
            assert sched._prefilling() == 1 and sched.blocks.available_blocks == 1
            while sched._prefilling():
                sched._iteration()
            assert s.preemptions == 1 and sched.preemptions == 1 and not s.output_ids
            assert r.preemptions == 0 and sched.num_waiting == 1
            while not (r.done and s.done):
                sched._iteration()
            sched._retire()
        assert [r.output_ids, s.output_ids] == want
        assert sched.preemptions == 1 and sched.blocks.prefix_hits > 0
        assert_no_leak(sched)
    finally:
        sched.close()


# -- chunks queued ahead of the read-back (run-ahead during a chunked prefill) ------------------


def decode_first_tokens(sched: Scheduler, streams: list) -> None:
    """Step `sched` by hand, one step an iteration (nothing queued ahead), until every stream
    has its first token (inside `eng.generating()`)."""
    sched._may_run_ahead = lambda in_flight: False
    while not all(s.output_ids for s in streams):
        sched._iteration()
    del sched._may_run_ahead


def stepped(eng: fuser.Engine, streams: list, sched: Scheduler) -> None:
    """Step `sched` by hand until every stream is done, then retire."""
    with eng.generating():
        while not all(s.done for s in streams):
            sched._iteration()
        sched._retire()


@pytest.mark.xdist_group("paged_draft_engine")
@pytest.mark.parametrize("draft", [False, True])
def test_chunks_run_ahead_beside_running_rows(
        draft: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stepped by hand: a 40-token prompt whose first 16 tokens are cached (a prefix hit) joins
    two decoding rows and goes in 4-token chunks. The iteration that admits it queues each
    chunk but the last, with the decode step after it, before the step in flight is read
    back (`chunks_ahead`, `steps_ahead`), each chunk within the budget; the last chunk waits
    for the next iteration. Every request returns its tokens alone (with a draft: gamma 3
    speculative steps, both models fed every chunk)."""
    eng = draft_engine() if draft else engine()
    shared = prompt(16, seed=140)
    runner, opener = (prompt(5, seed=141), greedy(40)), (shared + prompt(3, seed=142), greedy(30))
    long = (shared + prompt(24, seed=143), greedy(6))
    want = alone(eng, [runner, opener, long])
    budget = 6 + (2 * 3 if draft else 0)  # two running rows' decode tokens, then 4 a chunk
    fed = count_prompt_tokens(monkeypatch)
    sched = Scheduler(eng, max_num_batched_tokens=budget)
    try:
        r, o = sched.submit(*runner), sched.submit(*opener)
        with eng.generating():
            sched._may_run_ahead = lambda in_flight: False  # (else they run to their ends)
            while not (r.output_ids and o.output_ids):
                sched._iteration()
            del sched._may_run_ahead
            assert sched._prefilling() == 0 and sched.chunks_ahead == 0
            s = sched.submit(*long)
            calls, hits = len(fed), sched.blocks.prefix_hits
            sched._iteration()
            assert sched.blocks.prefix_hits - hits == 16  # 24 tokens left: 5 parts, the last
            assert sched._prefilling() == 1 and not s.output_ids
            assert fed[calls:] == [4] * 5  # (the first at admission, 4 queued ahead)
            assert sched.chunks_ahead == 4 and sched.steps_ahead >= 4
            sched._iteration()  # the last chunk (first token), then the three rows decode
            assert sched._prefilling() == 0 and s.output_ids and fed[calls + 5] == 4
            assert sched.chunks_ahead == 4
        stepped(eng, [r, o, s], sched)
        assert [r.output_ids, o.output_ids, s.output_ids] == want
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.xdist_group("paged_draft_engine")
def test_adaptive_chunks_ahead_hold_the_swap_lock_and_see_swaps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The adaptive scheduler with online distillation's swap, stepped by hand on the draft
    engine: a chunk queued ahead holds the swap's lock as one run at admission does (its
    draft k/v are one draft's), and a swap that lands between two read-backs is seen before
    the next chunk ahead (the cached draft halves go stale: `draft_version` moves on). The
    swap puts the same weights back, so the tokens are each request's alone."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.controller import DRAFT
    from fuser.runtime.distill import draft_module

    eng = draft_engine()
    runner, other = (prompt(5, seed=160), greedy(30)), (prompt(9, seed=161), greedy(30))
    long = (prompt(34, seed=162), greedy(5))
    want = alone(eng, [runner, other, long])
    same = {n: p.detach().clone() for n, p in draft_module(eng).named_parameters()}
    sched = AdaptiveScheduler(eng, suffix=False, adapt_draft=True, background=False,
                              max_num_batched_tokens=12, costs={"decode": 1.0, DRAFT: {3: 1.3}})
    chunks: list[tuple[bool, int]] = []  # per part chunk: (lock held, draft version)
    real_part = speculative.prefill_part

    def part(target, draft, tokens, progress, width):
        if target is not None:
            chunks.append((sched.swap.lock.locked(), sched.blocks.draft_version))
        return real_part(target, draft, tokens, progress, width)

    monkeypatch.setattr(speculative, "prefill_part", part)
    try:
        r, o = sched.submit(*runner), sched.submit(*other)
        with eng.generating():
            decode_first_tokens(sched, [r, o])
            s = sched.submit(*long)
            real_collect = sched._collect

            def collect(step) -> None:
                real_collect(step)
                if sched.chunks_ahead == 2 and sched.swap.swaps == 0:
                    sched.swap.swap(same)  # (the loop's thread: nothing else holds the lock)
            sched._collect = collect
            del chunks[:]
            sched._iteration()
            assert sched.chunks_ahead > 2 and sched.swap.swaps == 1
            assert chunks == [(True, 0)] * 3 + [(True, 1)] * (len(chunks) - 3), chunks
        stepped(eng, [r, o, s], sched)
        assert [r.output_ids, o.output_ids, s.output_ids] == want
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.parametrize("victim", ["group", "running"])
def test_cancel_while_chunks_run_ahead(victim: str) -> None:
    """Stepped by hand: two 24-token prompts prefill together (4-token chunks a row) beside a
    decoding request, and one of them ("group") or the decoding one ("running") is cancelled
    just after the second chunk queued ahead: run-ahead stops there, the victim ends
    ("abort") at the next retire with its blocks freed, a cancelled row of the group rides
    along while the group's later chunks run ahead again, and the others return their tokens
    alone (the cancelled runner a prefix of its own); nothing leaks."""
    eng = engine()
    runner = (prompt(5, seed=150), greedy(30))
    group = [(prompt(24, seed=151), greedy(6)), (prompt(24, seed=152), greedy(9))]
    want = alone(eng, [runner] + group)
    sched = Scheduler(eng, max_num_batched_tokens=9)  # (9 - 1 decode token) / 2 rows
    try:
        r = sched.submit(*runner)
        with eng.generating():
            decode_first_tokens(sched, [r])
            streams = [sched.submit(p, params) for p, params in group]
            target = streams[0] if victim == "group" else r
            real = sched._chunk_ahead

            def chunk_ahead() -> None:
                real()
                if sched.chunks_ahead == 2:
                    target.cancel()
            sched._chunk_ahead = chunk_ahead
            sched._iteration()
            assert sched.chunks_ahead == 2 and target.finish_reason == "abort"
            if victim == "group":
                assert sched._prefilling() == 2 and not sched.blocks.holds(0)
                assert sched.blocks.holds(1) and target.output_ids == []
            else:
                assert sched.slots_used == 2 and sched.blocks.active_rows() == [0, 1]
        stepped(eng, [r] + streams, sched)
        outputs = [s.output_ids for s in [r] + streams]
        for out, ref, stream in zip(outputs, want, [r] + streams):
            assert out == (ref[:len(out)] if stream is target else ref)
        assert sched.chunks_ahead == (3 if victim == "group" else 2)
        assert_no_leak(sched)
    finally:
        sched.close()


def test_preempted_while_chunks_run_ahead() -> None:
    """Stepped by hand on the small pool: a 36-token prompt (10 blocks) goes in 2-token
    chunks, queued ahead, beside a decoding request; once that row cannot grow by two steps'
    room, nothing more is queued ahead, and when it cannot grow by one, the group in prefill
    is preempted (its blocks freed, its chunks cached) and later resumes; both return their
    tokens alone and nothing leaks."""
    eng = engine(SMALL_POOL)
    runner, long = (prompt(4, seed=100), greedy(40)), (prompt(36, seed=101), greedy(4))
    want = alone(eng, [runner, long])
    sched = Scheduler(eng, max_num_batched_tokens=3)
    try:
        r = sched.submit(*runner)
        with eng.generating():
            decode_first_tokens(sched, [r])
            s = sched.submit(*long)
            while not s.preemptions:
                ahead = sched.chunks_ahead
                sched._iteration()
            assert ahead > 0 and sched.chunks_ahead == ahead  # (none queued as room ran out)
            assert s.preemptions == 1 and r.preemptions == 0 and not s.output_ids
        stepped(eng, [r, s], sched)
        assert [r.output_ids, s.output_ids] == want
        assert sched.preemptions == 1 and sched.blocks.prefix_hits > 0
        assert_no_leak(sched)
    finally:
        sched.close()


def test_max_num_batched_tokens_must_be_a_count() -> None:
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="max_num_batched_tokens"):
            Scheduler(engine(), max_num_batched_tokens=bad)
    assert Scheduler(engine(), max_num_batched_tokens=0).max_num_batched_tokens is None


@pytest.mark.slow  # (an engine with a draft: ~30 s more on a 2-core CPU)
def test_speculative_chunked_prefill_with_preemption_and_prefix_hits() -> None:
    """Both models get every chunk: speculative steps (gamma 3) beside prompts in chunks over
    the small pool, with shared openings (prefix hits start the chunks at their cached tokens)
    and preemption, return each request's greedy tokens alone."""
    eng = engine(SMALL_POOL, draft=True)
    shared = prompt(8, seed=60)
    requests = [(shared + prompt(10 + i, seed=61 + i), greedy(18)) for i in range(5)]
    want = alone(eng, requests)
    sched = started(eng, max_num_batched_tokens=9)
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.blocks.prefix_hits > 0 and sched.prefill_chunks > len(requests)
        assert sched.preemptions > 0
        assert_no_leak(sched)
    finally:
        sched.close()


def cuda_draft_engine(**config: object) -> fuser.Engine:
    """The paged draft engine (gamma 3, 4 rows) built anew on CUDA in fp32 (the CPU tests
    share the cached one); `config`: more FuserConfig fields."""
    import copy

    target = copy.deepcopy(llama_target()).cuda()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(target, draft=perturbed(target, 0.05, seed=3),
                              config=fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4,
                                                       gamma=3, precision="fp32",
                                                       kv_block_size=BLOCK, **config))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_paged_scheduler_replays_graphs_over_the_managed_table() -> None:
    """On CUDA (fp32; the captured iteration graphs read the block table where it lives, the
    scheduler copies it there before each step): a draft engine (gamma 3) over a 23-block
    pool, requests sharing a 20-token opening (prefix hits: the chunk step of 18 tokens,
    flash_prefill over the pools, replayed at the captured width 32: runtime/prefill_graphs.py
    `ChunkGraphs`) and outgrowing the pool (preemption): each returns its tokens alone, and
    every step and chunk replayed a captured graph."""
    eng = cuda_draft_engine(kv_blocks=24)
    assert sorted(eng.buckets) == [1, 2, 4] and eng.report().fallbacks == []
    shared = prompt(20, seed=80)
    requests = [(shared + prompt(18, seed=81 + i), greedy(12)) for i in range(5)]
    want = alone(eng, requests)
    sched = started(eng, capture_at_idle=False)  # (every chunk replays, the first's captured)
    try:
        streams = [sched.submit(p, params) for p, params in requests]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.preemptions > 0 and sched.blocks.prefix_hits > 0
        assert_no_leak(sched)
    finally:
        sched.close()
    replays = eng.report().graph_replays
    assert sum(v for k, v in replays.items() if k.startswith("step.b")) >= sched.steps
    assert all(n == 0 for b in eng.buckets.values() for n in b.uncaptured_runs.values())
    assert {k.split(".")[2] for k, v in replays.items() if k.startswith("chunk.") and v} \
        == {"target", "draft"}, replays


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chat_next_turn_hits_its_answer_with_a_draft() -> None:
    """On CUDA (fp32; captured step graphs, the fused greedy draft kernels, resync chunks):
    `chat_turns` with speculative steps and with runs of target-only steps: every keyed
    block holds a fresh prefill's k/v in both pools after every iteration, and a chat's next
    turn hits its answer's blocks and returns its tokens alone."""
    eng = cuda_draft_engine()
    for pattern in sorted(GAMMA_PATTERNS):
        steps = chat_turns(eng, GAMMA_PATTERNS[pattern])
        assert steps and any(a == g for g, a, _ in steps), pattern
    replays = eng.report().graph_replays
    assert sum(v for k, v in replays.items() if k.startswith("step.b")) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunked_prefill_between_captured_steps() -> None:
    """On CUDA (fp32): prompts in chunks (budgets 12 and 40; every chunk replayed at a captured
    width, 32 here: runtime/prefill_graphs.py `ChunkGraphs`) between the captured speculative
    steps of a draft engine over a 23-block pool, with prefix hits and preemption: each request
    returns its tokens alone (whole-prompt prefill), and every step and chunk replayed a
    captured graph."""
    eng = cuda_draft_engine(kv_blocks=24)
    shared = prompt(20, seed=85)
    requests = [(shared + prompt(6 + 5 * i, seed=86 + i), greedy(12)) for i in range(5)]
    requests += [(prompt(37, seed=95), sampled(10, seed=9)), (prompt(3, seed=96), greedy(20))]
    want = alone(eng, requests)
    for budget in (12, 40):
        before = sum(v for k, v in eng.report().graph_replays.items() if k.startswith("step.b"))
        chunks_before = sum(v for k, v in eng.report().graph_replays.items()
                            if k.startswith("chunk."))
        # (every chunk replays: the first of a width captures it on its path)
        sched = started(eng, max_num_batched_tokens=budget, capture_at_idle=False)
        try:
            streams = [sched.submit(p, params) for p, params in requests]
            assert [s.result(TIMEOUT) for s in streams] == want, budget
            # Budget 12 cuts prompts into several chunks; at 40 each rest (after its prefix
            # hit) is one chunk of up to 26 queries.
            chunks = sched.prefill_chunks
            assert (chunks > len(requests) if budget == 12 else chunks >= len(requests)), chunks
            assert sched.blocks.prefix_hits > 0
            assert_no_leak(sched)
        finally:
            sched.close()
        replays = eng.report().graph_replays
        assert sum(v for k, v in replays.items() if k.startswith("step.b")) - before \
            >= sched.steps
        assert sum(v for k, v in replays.items() if k.startswith("chunk.")) - chunks_before \
            >= 2 * chunks, replays  # (target and draft, every chunk)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_chunks_ahead_do_not_wait_for_the_device() -> None:
    """On CUDA (fp32, the paged draft engine, captured steps and chunks): a 37-token prompt
    goes in chunks beside two decoding rows, queued ahead of the read-backs, and no chunk
    queued ahead synchronises with the device (`torch.cuda.set_sync_debug_mode("error")`
    around each: a `torch.tensor(..., device="cuda")` or `.item()` there would make the host
    wait for the step in flight, losing the overlap; the error names the op). A first pass
    captures the chunk widths (a capture synchronises); the second is checked. Both return
    each request's tokens alone."""
    eng = cuda_draft_engine()
    requests = [(prompt(5, seed=170), greedy(30)), (prompt(9, seed=171), greedy(30)),
                (prompt(37, seed=172), greedy(6))]
    want = alone(eng, requests)
    for checked in (False, True):
        # (stepped by hand, no loop captures at idle: the first pass captures on the path,
        # and a shape another test's scheduler left waiting on the shared engine's graphs
        # does not hold wait_idle)
        sched = Scheduler(eng, max_num_batched_tokens=12, prefix_caching=False,
                          capture_at_idle=False)
        real = sched._chunk_ahead

        def chunk_ahead(real=real) -> None:
            torch.cuda.set_sync_debug_mode("error" if checked else 0)
            try:
                real()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        sched._chunk_ahead = chunk_ahead
        try:
            r, o = sched.submit(*requests[0]), sched.submit(*requests[1])
            with eng.generating():
                decode_first_tokens(sched, [r, o])
                s = sched.submit(*requests[2])
            stepped(eng, [r, o, s], sched)
            assert [r.output_ids, o.output_ids, s.output_ids] == want
            assert sched.chunks_ahead >= 3, sched.chunks_ahead
            assert_no_leak(sched)
        finally:
            sched.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_hit_after_a_draft_swap_gets_the_new_drafts_kv() -> None:
    """On CUDA (fp32; captured step graphs, the fused greedy draft kernels): `swap_turns`,
    through the adaptive scheduler's swap and by hand beside chunked prefill: after a swap
    of the draft's weights, a hit's blocks hold the new draft's k/v and the target's as
    they were, and the tokens are target-only greedy decoding's."""
    eng = cuda_draft_engine()
    for how in ("adaptive", "chunked"):
        swap_turns(eng, how)
    replays = eng.report().graph_replays
    assert sum(v for k, v in replays.items() if k.startswith("step.b")) > 0


# Prompts that repeat themselves: the suffix index matches them.
REPETITIVE = [(prompt(6, seed=90 + i % 2) * 2, greedy(20)) for i in range(6)]


def suffix_engine(drafted: bool, **config: object) -> fuser.Engine:
    """An engine of its own over the small pool with the suffix index's verify steps: the
    llama target, with a perturbed copy as its draft where `drafted`."""
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 2, 4),
                               compile="fx", kv_block_size=BLOCK, kv_blocks=SMALL_POOL,
                               suffix_speculation=True, **config)
    draft = perturbed(target, 0.05, seed=3) if drafted else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(target, draft=draft, config=config)


@pytest.mark.slow  # (a draft engine of its own with a long suffix verify step: ~40 s on 2 cores)
def test_long_suffix_steps_over_a_small_pool_keep_each_requests_tokens() -> None:
    """The adaptive scheduler's long suffix arm (gamma 8, scripted the cheapest) on a paged
    draft engine over the small pool: rows grow by the long verify step's 9 slots, the draft
    catches up after long steps through the shared block table, preempted requests come back,
    and the greedy tokens are each request's alone."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler
    from fuser.runtime.controller import DRAFT, SUFFIX

    eng = suffix_engine(drafted=True, gamma=3, long_suffix_gammas=(8,))
    want = alone(eng, REPETITIVE)
    sched = AdaptiveScheduler(eng, suffix=True, adapt_draft=False, background=False,
                              suffix_min_match=2,
                              costs={"decode": 1.0, DRAFT: {3: 0.9}, SUFFIX: {3: 0.9, 8: 0.3}})
    sched.start()
    try:
        streams = [sched.submit(p, params) for p, params in REPETITIVE]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched._step_room == 9 and sched.preemptions > 0
        long_steps = sum(c.measured().get("suffix gamma 8", {}).get("steps", 0)
                         for c in sched.controllers.values())
        assert long_steps > 0 and sched.resyncs > 0, sched.snapshot()
        assert_no_leak(sched)
    finally:
        sched.close()


@pytest.mark.slow  # (an engine of its own with suffix verify steps: ~35 s on a 2-core CPU)
def test_adaptive_scheduler_with_suffix_proposals_over_a_small_pool() -> None:
    """The adaptive scheduler's suffix proposals (verify steps added after the build, gamma
    2 on a target-only engine) over the small pool: rows grow by the longest verify step, a
    preempted request is not indexed twice, and the greedy tokens are each request's alone."""
    from fuser.runtime.adaptive_scheduler import AdaptiveScheduler

    eng = suffix_engine(drafted=False, gamma=0, gamma_candidates=(2,))
    want = alone(eng, REPETITIVE)
    sched = AdaptiveScheduler(eng, suffix=True, background=False)
    sched.start()
    try:
        streams = [sched.submit(p, params) for p, params in REPETITIVE]
        assert [s.result(TIMEOUT) for s in streams] == want
        assert sched.preemptions > 0 and sched._step_room == 3
        assert_no_leak(sched)
    finally:
        sched.close()
