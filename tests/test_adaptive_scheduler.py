"""The scheduler with adaptive speculation (runtime/adaptive_scheduler.py) on tiny fp32 models:
templated traffic (prompts that come back) makes rows verify suffix proposals from recent
outputs beside rows verifying the draft's, in one step; it distils the draft on what it served
and swaps it in, and every request still returns the target's greedy output."""

from __future__ import annotations

import functools
import itertools
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fuser
from fuser import SamplingParams
from fuser.runtime.adaptive_scheduler import LOOKUP_BACKOFF_MAX, AdaptiveScheduler, \
    LookupBackoff
from fuser.runtime.distill import DistillConfig
from fuser.runtime.controller import DRAFT, NEEDED, SUFFIX, TARGET, Choice
from fuser.runtime import speculative
from engines import NO_SPECIAL, llama_target, perturbed
from tiny import tiny_model

# One xdist worker runs the module: its cached engines (~15-20 s each) are built once each.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),  # conftest.py
              pytest.mark.xdist_group("adaptive_scheduler")]

MAX_SEQ_LEN = 64
VOCAB = 160
TIMEOUT = 120.0
# (suffix gamma LONG: the index's proposals verified alone, the long suffix arm)
LONG = 8
COSTS = {"decode": 1.0, DRAFT: {2: 1.3, 4: 1.6}, SUFFIX: {2: 1.04, 4: 1.08, LONG: 50.0}}


@functools.cache
def engine() -> fuser.Engine:
    """Rows 4, buckets 1 and 4; a random draft (it agrees with the target rarely: distilling
    it has something to gain), gamma auto over 2 and 4, the long suffix arm at LONG,
    adaptation on."""
    draft = tiny_model("mistral", seed=2, vocab=VOCAB, heads=2, kv_heads=1, head_dim=16,
                       intermediate=64, layers=1, init_range=0.3, **NO_SPECIAL)
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 4),
                               gamma="auto", gamma_candidates=(2, 4), compile="fx",
                               suffix_speculation=True, long_suffix_gammas=(LONG,),
                               adapt_draft=True, distill_every=8, distill_budget_s=60.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fuser.optimize(llama_target(), draft=draft, config=config)


def prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=generator).tolist()


PROMPTS = [prompt(6 + 3 * i, seed=50 + i) for i in range(4)]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@functools.cache
def references() -> list[list[int]]:
    """Each prompt's greedy output through engine.generate (the target's)."""
    eng = engine()
    return [eng.generate(torch.tensor([p]), max_new_tokens=24)[0, len(p):].tolist()
            for p in PROMPTS]


def run_rounds(scheduler: AdaptiveScheduler, rounds: int) -> None:
    """Every prompt, `rounds` times (a round at a time: later ones find the earlier outputs in
    the pool of recent outputs); each output must be the target's greedy one."""
    for _ in range(rounds):
        streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
        for stream, expected in zip(streams, references()):
            assert stream.result(TIMEOUT) == expected
        assert scheduler.wait_idle(TIMEOUT)  # (finished requests retired)


def test_templated_traffic_uses_every_source_and_distils_the_draft():
    references()
    eng = engine()
    scheduler = AdaptiveScheduler(
        eng, costs=COSTS, background=False,
        # Half held out (4 records): the gate bounds the gain over held-out records.
        distill=DistillConfig(lr=3e-3, batch_tokens=256, holdout_fraction=0.5, max_steps=30),
        controller_options=dict(probe_share=0.2, refresh=8))
    scheduler.start()
    try:
        run_rounds(scheduler, 3)
        snap = scheduler.snapshot()
        # Repeated prompts: rows verify proposals from recent outputs, others the draft's, in
        # mixed steps (the suffix's arms, scripted cheaper than the draft's plain steps, which
        # run where no row matched); the draft never falls behind but after target-only steps
        # and long suffix steps (probes: scripted dear).
        assert snap["rows"][SUFFIX] > 0 and snap["steps"][DRAFT] > 0, snap
        assert snap["rows"][DRAFT] > 0 and snap["steps"][SUFFIX] > 0, snap
        long_steps = sum(c.measured().get(f"suffix gamma {LONG}", {}).get("steps", 0)
                         for c in scheduler.controllers.values())
        assert snap["resyncs"] <= snap["steps"][TARGET] + long_steps, snap
        assert snap["recent_outputs"] == 4 * 3
        # 12 finished requests, distill_every 8: one update, on requests it then sees again.
        assert sum(snap["draft_updates"].values()) == 1, snap
        result = scheduler.update_results[0]
        assert result.accepted, result.reason  # memorised: the prompts come back
        assert scheduler.swap.swaps == 1 and snap["draft_version"] == 1
        run_rounds(scheduler, 2)  # with the distilled draft: still the target's outputs
        reason = scheduler.controllers[4].reason  # (four requests at a time: bucket 4)
        assert reason.split()[0] in ("draft", "suffix", "probing", "target-only:"), reason
        prometheus_client = pytest.importorskip("prometheus_client")
        del prometheus_client
        text = eng.metrics_text()
        assert f'fuser_spec_rows_total{{source="suffix"}} ' \
               f'{float(scheduler.snapshot()["rows"][SUFFIX])}' in text
        assert 'fuser_draft_updates_total{result="accepted"}' in text
        assert 'fuser_spec_acceptance_window{source="suffix"}' in text
    finally:
        scheduler.close()


def test_updates_in_the_background_leave_outputs_alone():
    eng = engine()
    scheduler = AdaptiveScheduler(
        eng, costs=COSTS, background=True,
        distill=DistillConfig(lr=3e-3, batch_tokens=256, holdout_fraction=0.25, max_steps=10))
    references()  # before the scheduler's thread runs steps on the same engine
    scheduler.start()
    try:
        run_rounds(scheduler, 2)  # the update starts at the 8th finished request...
        run_rounds(scheduler, 1)  # ...and these may run during it, or with its result
        assert scheduler.wait_update(TIMEOUT)
        assert sum(scheduler.distiller.updates.values()) >= 1
        run_rounds(scheduler, 1)
    finally:
        scheduler.close()


def test_a_background_update_works_its_serving_duty_under_load():
    """By default a background update works SERVING_DUTY of the wall clock while requests run
    or wait (work beside the host-bound serving loop takes its GIL and GPU time) and unpaced
    while the server is idle (`idle()`: no request running or waiting); with DistillConfig.duty
    given, it works that share of the wall clock, whatever the load."""
    from fuser.runtime.distill import SERVING_DUTY, UpdateResult

    for duty, duty_given in ((None, False), (0.25, True)):
        scheduler = AdaptiveScheduler(engine(), costs=COSTS, background=True,
                                      distill=DistillConfig(duty=duty))
        calls: list[dict] = []
        scheduler.distiller.update = lambda *args, **kwargs: (
            calls.append(kwargs) or UpdateResult(False, "scripted"))
        try:
            assert scheduler.idle()
            stream = scheduler.submit(PROMPTS[0], GREEDY)  # waiting (the loop is not started)
            assert not scheduler.idle()
            scheduler._updating.set()
            scheduler._update_draft()
            (kwargs,) = calls
            assert scheduler.snapshot()["update_in_flight"] is None  # (the update ended)
            if duty_given:
                assert kwargs["idle"] is None and kwargs["duty"] == duty
            else:
                assert kwargs["idle"] == scheduler.idle and kwargs["duty"] == SERVING_DUTY
            stream.cancel()
        finally:
            scheduler.close()


def test_without_a_draft_suffix_proposals_alone():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = fuser.optimize(llama_target(), config=fuser.FuserConfig(
            max_seq_len=MAX_SEQ_LEN, max_batch_size=2, batch_buckets=(1, 2), compile="fx"))
    expected = [plain.generate(torch.tensor([p]), max_new_tokens=24)[0, len(p):].tolist()
                for p in PROMPTS]
    with pytest.raises(ValueError, match="draft"):
        AdaptiveScheduler(plain, suffix=True, adapt_draft=True)
    scheduler = AdaptiveScheduler(plain, suffix=True, costs={"decode": 1.0, SUFFIX: {1: 1.02,
                                                                                    2: 1.04}})
    scheduler.start()
    try:
        for _ in range(2):
            streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
            assert [s.result(TIMEOUT) for s in streams] == expected
            assert scheduler.wait_idle(TIMEOUT)
        steps = scheduler.snapshot()["steps"]
        assert steps[SUFFIX] > 0 and steps[DRAFT] == 0 and steps[TARGET] > 0, steps
        # Sampled requests beside greedy ones: the greedy ones keep their outputs.
        sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=5)
        streams = [scheduler.submit(p, GREEDY if i % 2 else sampled)
                   for i, p in enumerate(PROMPTS)]
        outputs = [s.result(TIMEOUT) for s in streams]
        assert outputs[1::2] == expected[1::2]
        assert all(len(out) == 24 and max(out) < VOCAB for out in outputs[::2])
    finally:
        scheduler.close()


@functools.cache
def overlap_engine() -> tuple[fuser.Engine, list[list[int]]]:
    """FuserConfig.overlap on CPU (rows 4, buckets 1 and 4, gamma 2; a draft close to the
    target: rounds stream on) and each prompt's target-only greedy output."""
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 4),
                               gamma=2, compile="fx", overlap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3), config=config)
    assert all(b.overlap for b in eng.buckets.values())
    eng.fix_gamma(0)
    try:
        expected = [eng.generate(torch.tensor([p]), max_new_tokens=24)[0, len(p):].tolist()
                    for p in PROMPTS]
    finally:
        eng.fix_gamma(None)
    return eng, expected


def test_an_overlapped_round_is_accounted_as_the_drafts_not_as_suffix_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FuserConfig.overlap (CPU): the draft's greedy steps are overlapped rounds, whose packed
    result is gamma + 3 wide as a suffix or mixed step's, with each row's mode code
    (runtime/speculative.py `overlapped_step`) in the column where those carry the row's
    suffix proposal count. Without a suffix index every row is the draft's, proposing gamma:
    a mode code read as a count would make rows the suffix's (or a count above gamma, which
    the controller refuses, failing the step). The outputs are target-only greedy decoding's."""
    eng, expected = overlap_engine()
    codes: list[int] = []
    real = speculative.overlapped_step

    def spy(*args, **kwargs):
        packed = real(*args, **kwargs)  # [B, gamma + 3]: tokens, mode code, n
        codes.extend(packed[:, -2].tolist())
        return packed

    monkeypatch.setattr(speculative, "overlapped_step", spy)
    # Scripted: a draft round costs less than a target step, so the controller keeps choosing
    # it (rows stream on: every mode code comes up).
    scheduler = AdaptiveScheduler(eng, suffix=False, adapt_draft=False,
                                  costs={"decode": 1.0, DRAFT: {2: 0.9}})
    try:
        streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
        with eng.generating():  # stepped by hand: the same steps every run
            while not all(s.done for s in streams):
                scheduler._iteration()
            scheduler._retire()
        assert [s.output_ids for s in streams] == expected
        snap = scheduler.snapshot()
        assert snap["steps"][DRAFT] > 0 and snap["rows"][DRAFT] > 0, snap
        assert snap["rows"][SUFFIX] == 0 and snap["steps"][SUFFIX] == 0, snap
        assert {1, 2, 3} <= set(codes), codes  # (a row that streamed, one that guessed right)
    finally:
        scheduler.close()


def stepped_rounds(scheduler: AdaptiveScheduler, rounds: int) -> list[tuple[bool, bool]]:
    """Every prompt, `rounds` times, the scheduler stepped by hand (the same steps every run);
    each output must be the target's greedy one. Returns per issued decode step (matched: some
    row's suffix matched, mixed: the step ran over the proposals buffer)."""
    steps: list[tuple[bool, bool]] = []
    issue = scheduler._issue

    def issued():
        # (the scheduler looks the index up only when a suffix arm could be chosen: looked
        # up here for every step, which changes nothing)
        matched = bool(scheduler._proposals(list(scheduler._running))[1].any())
        step = issue()
        steps.append((matched, step.over_proposals))
        return step

    scheduler._issue = issued
    eng = scheduler.engine
    with eng.generating():
        for _ in range(rounds):
            streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
            while not all(s.done for s in streams):
                scheduler._iteration()
            scheduler._retire()
            assert [s.output_ids for s in streams] == references()
    return steps


@pytest.mark.parametrize("mixed_pays", [False, True], ids=["draft-pays", "mixed-pays"])
def test_the_controller_chooses_between_the_drafts_step_and_the_mixed_step(mixed_pays: bool):
    """With a draft and the suffix index, the draft's arms run the plain Scheduler's step (no
    proposals buffer) and the suffix's arms the mixed step, usable when some row matched.
    Scripted costs: where a mixed step costs more per emitted token than the draft's step
    (4 s for at most gamma + 1 = 5 tokens a row, against at most 0.6 s for at least one), the
    controller settles on the draft's arms: rows that match still run the draft's step, and
    mixed steps are probes; where it costs less, matched steps run mixed. Every request's
    tokens are target-only greedy decoding's either way."""
    references()
    draft_costs = {2: 0.5, 4: 0.6}
    mixed_costs = {2: 0.1, 4: 0.12, LONG: 50.0} if mixed_pays else {2: 4.0, 4: 4.0, LONG: 50.0}
    scheduler = AdaptiveScheduler(engine(), adapt_draft=False, background=False,
                                  costs={"decode": 1.0, DRAFT: draft_costs,
                                         SUFFIX: mixed_costs},
                                  controller_options=dict(probe_share=0.05))
    try:
        steps = stepped_rounds(scheduler, 3)
        controllers = scheduler.controllers.values()
        matched = [mixed for m, mixed in steps if m]
        mixed = sum(mixed for _, mixed in steps)
        snap = scheduler.snapshot()
        assert snap["steps"][SUFFIX] == mixed, (snap, steps)  # a mixed step counts as "suffix"
        assert snap["steps"][TARGET] + snap["steps"][DRAFT] == len(steps) - mixed, snap
        assert snap["rows"][SUFFIX] > 0, snap
        probes = sum(c.probes for c in controllers)
        allowance = sum(c.probe_steps * len(c.arms) for c in controllers)  # (each arm once)
        assert probes <= 0.05 * len(steps) + allowance, snap
        if mixed_pays:
            assert len(matched) > 8 and sum(matched) >= 0.75 * len(matched), steps
            assert scheduler.controllers[4].best()[0] == SUFFIX, snap
        else:
            # Matched steps ran the draft's plain step but for the suffix arms' probes.
            assert len(matched) > 8 and 0 < mixed <= probes, (steps, snap)
            assert scheduler.controllers[4].best()[0] == DRAFT, snap
            assert snap["rows"][DRAFT] > snap["rows"][SUFFIX], snap
    finally:
        scheduler.close()


def test_the_drafts_arm_is_the_plain_step_overlapped_rounds_included(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """FuserConfig.overlap with the suffix index on: the draft's arm runs what the plain
    Scheduler runs, an overlapped round (greedy rows), also in steps where rows matched the
    index; the mixed step, scripted far dearer per emitted token, runs only as the suffix
    arm's probes. Outputs are target-only greedy decoding's."""
    eng, expected = overlap_engine()
    rounds = [0]
    real = speculative.overlapped_step

    def spy(*args, **kwargs):
        rounds[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(speculative, "overlapped_step", spy)
    scheduler = AdaptiveScheduler(eng, suffix=True, adapt_draft=False, suffix_min_match=2,
                                  costs={"decode": 1.0, DRAFT: {2: 0.9}, SUFFIX: {2: 50.0}})
    steps: list[tuple[bool, str, int]] = []  # (matched, source, overlapped rounds it ran)
    issue = scheduler._issue

    def issued():
        matched = bool(scheduler._proposals(list(scheduler._running))[1].any())
        before = rounds[0]
        step = issue()
        steps.append((matched, step.choice.source, rounds[0] - before))
        return step

    scheduler._issue = issued
    try:
        with eng.generating():  # stepped by hand: the same steps every run
            for _ in range(2):  # (the second time the answers are recent outputs)
                streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
                while not all(s.done for s in streams):
                    scheduler._iteration()
                scheduler._retire()
                assert [s.output_ids for s in streams] == expected
        controller = scheduler.controllers[4]
        plain_matched = [n for matched, source, n in steps if matched and source == DRAFT]
        mixed = [n for _, source, n in steps if source == SUFFIX]
        assert len(plain_matched) > 4 and all(n == 1 for n in plain_matched), steps
        assert mixed and not any(mixed), steps  # (a mixed step is no overlapped round)
        assert len(mixed) <= sum(c.probes for c in scheduler.controllers.values()), steps
        assert controller.best() == (DRAFT, 2), controller.reason
    finally:
        scheduler.close()


def test_scripted_costs_of_a_draft_engine_default_the_mixed_steps_to_the_drafts():
    """A draft engine's scripted costs without a "suffix" entry give the mixed steps the
    draft's seconds (without long suffix arms); a gamma missing from an entry is named."""
    scheduler = AdaptiveScheduler(engine(), adapt_draft=False, long_suffix_gammas=(),
                                  costs={"decode": 1.0, DRAFT: {2: 0.5, 4: 0.6}})
    try:
        assert scheduler.controllers[4].costs == {
            (TARGET, 0): 1.0, (DRAFT, 2): 0.5, (DRAFT, 4): 0.6, (SUFFIX, 2): 0.5,
            (SUFFIX, 4): 0.6}
    finally:
        scheduler.close()
    with pytest.raises(ValueError, match=r"costs\['suffix'\] has no seconds for gamma \[4\]"):
        AdaptiveScheduler(engine(), adapt_draft=False,
                          costs={"decode": 1.0, DRAFT: {2: 0.5, 4: 0.6},
                                 SUFFIX: {2: 0.1, LONG: 0.1}})
    with pytest.raises(ValueError, match=rf"costs\['suffix'\] has no seconds for gamma \[{LONG}\]"):
        AdaptiveScheduler(engine(), adapt_draft=False,
                          costs={"decode": 1.0, DRAFT: {2: 0.5, 4: 0.6}})


# -- the long suffix arms: the index's proposals verified alone, the draft caught up after ----


def remember(scheduler: AdaptiveScheduler, outputs: list[list[int]]) -> None:
    """Each prompt with its output as a finished request of the index (the output in the pool
    of recent outputs): the prompts' rows match from their second output token on
    (repetitive traffic)."""
    for i, (p, output) in enumerate(zip(PROMPTS, outputs)):
        scheduler.index.add_request(("seen", i), p)
        scheduler.index.extend(("seen", i), output)
        scheduler.index.finish(("seen", i))


def script_arms(scheduler: AdaptiveScheduler, arms: list[tuple[str, int]]
                ) -> list[tuple[str, int]]:
    """Every controller runs arms[i % len(arms)] at its i-th step (a suffix arm where no row
    matched: draft gamma 2 instead); -> the arms run, filled in as the steps are issued."""
    ran: list[tuple[str, int]] = []
    for controller in scheduler.controllers.values():
        turn = itertools.count()

        def choose(usable=None, *, started=None, turn=turn):
            arm = arms[next(turn) % len(arms)]
            if usable is not None and not usable(arm):
                arm = (DRAFT, 2)
            ran.append(arm)
            return Choice(*arm)

        controller.choose = choose
        controller.use_of = lambda source: NEEDED  # (looked up each step)
    return ran


def serve_stepped(scheduler: AdaptiveScheduler) -> list[list[int]]:
    """Every prompt once, the scheduler stepped by hand; -> the outputs."""
    with scheduler.engine.generating():
        streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
        while not all(s.done for s in streams):
            scheduler._iteration()
        scheduler._retire()
    return [s.output_ids for s in streams]


ARMS = [(TARGET, 0), (DRAFT, 2), (DRAFT, 4), (SUFFIX, 2), (SUFFIX, 4), (SUFFIX, LONG)]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(arms=st.lists(st.sampled_from(ARMS), min_size=1, max_size=6))
def test_long_suffix_steps_in_any_order_keep_the_targets_tokens(arms: list[tuple[str, int]]
                                                                ) -> None:
    """Long suffix steps (the index's proposals verified alone, the draft not run), the
    draft's steps, mixed steps and target-only steps, in whatever order: every request's
    tokens are target-only greedy decoding's, and a step that runs the draft after steps that
    did not catches it up first (once)."""
    references()
    scheduler = AdaptiveScheduler(engine(), adapt_draft=False, suffix_min_match=2)
    try:
        assert scheduler.suffix_gammas == (LONG,)
        assert scheduler.controllers[4].arms[-1] == (SUFFIX, LONG)
        remember(scheduler, references())
        ran = script_arms(scheduler, arms)
        assert serve_stepped(scheduler) == references()
        if (SUFFIX, LONG) in arms:
            assert (SUFFIX, LONG) in ran, ran
        after_behind = sum(1 for before, arm in zip(ran, ran[1:])
                           if (before[0] == TARGET or before == (SUFFIX, LONG))
                           and arm[0] != TARGET and arm != (SUFFIX, LONG))
        assert scheduler.resyncs == after_behind, (ran, scheduler.resyncs)
    finally:
        scheduler.close()


def test_after_long_suffix_steps_the_draft_is_caught_up_exactly(monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Long suffix steps move a row on by up to LONG + 1 tokens each without the draft: the
    catch-up before the next draft step goes back that far, so that afterwards the draft
    holds every slot of every running row as a full re-prefill leaves it (counted one token
    a step, as target-only steps are, it would take slots it never wrote as valid)."""
    references()
    scheduler = AdaptiveScheduler(engine(), adapt_draft=False, suffix_min_match=2)
    checked: list[int] = []

    def checking(bucket):
        real = bucket.resync

        def resync(behind: int) -> None:
            real(behind)
            target, draft, state = bucket.target, bucket.draft, bucket.state
            rows = [i for i in range(len(scheduler._running)) if bool(state.active[i])]
            assert torch.equal(draft.cache.seq_lens[rows], target.cache.seq_lens[rows])
            got = [t.clone() for t in (*draft.cache.k, *draft.cache.v)]
            speculative._reprefill(draft, target, state)  # (what it leaves is as good)
            for b in rows:
                start, end = int(target.cache.starts[b]), int(target.cache.seq_lens[b])
                for x, y in zip(got, (*draft.cache.k, *draft.cache.v)):
                    torch.testing.assert_close(x[b, start:end], y[b, start:end],
                                               rtol=1e-4, atol=1e-4)
            checked.append(behind)
        return resync

    for bucket in engine().buckets.values():
        monkeypatch.setattr(bucket, "resync", checking(bucket))
    try:
        remember(scheduler, references())
        ran = script_arms(scheduler, [(SUFFIX, LONG)] * 2 + [(DRAFT, 2)])
        assert serve_stepped(scheduler) == references()
        assert ran.count((SUFFIX, LONG)) >= 2 and checked, ran
        assert max(checked) == 2 * (LONG + 1), checked
    finally:
        scheduler.close()


@pytest.mark.parametrize("per_token", [0.0, 1.0], ids=["cheap-catch-up", "dear-catch-up"])
def test_the_long_suffix_arm_pays_for_the_drafts_catch_up(per_token: float) -> None:
    """Repetitive traffic (the rows match from their second output token), scripted costs: a
    long suffix step (0.1 s, up to LONG + 1 tokens a row) is the cheapest per emitted token
    while the draft's catch-up after it costs nothing, and the controller settles on it; at
    1 s a token behind, the catch-up that the next draft or mixed step runs first is the long
    arm's cost (LONG + 1 s a step), and the controller settles elsewhere. The tokens are the
    target's either way."""
    references()
    costs = {"decode": 1.0, DRAFT: {2: 0.5, 4: 0.6}, SUFFIX: {2: 0.5, 4: 0.6, LONG: 0.1},
             "resync": per_token}
    scheduler = AdaptiveScheduler(engine(), adapt_draft=False, suffix_min_match=2, costs=costs,
                                  controller_options=dict(probe_share=0.2, refresh=8))
    try:
        remember(scheduler, references())
        for _ in range(4):
            assert serve_stepped(scheduler) == references()
        controller = scheduler.controllers[4]
        if per_token:
            assert controller.best() != (SUFFIX, LONG), controller.reason
            charged = controller.measured()[f"suffix gamma {LONG}"]["catch_up"]
            assert charged >= per_token, controller.reason
        else:
            assert controller.best() == (SUFFIX, LONG), controller.reason
        assert scheduler.resyncs > 0
    finally:
        scheduler.close()


def test_an_engine_directory_keeps_the_long_suffix_steps(tmp_path) -> None:
    """engine.save writes the long suffix arm's verify steps; the loaded engine has them, its
    draft gammas do not count them, and its adaptive scheduler runs the long arm: the
    target's tokens."""
    from fuser.runtime.steps import verify

    references()
    engine().save(tmp_path / "engine")
    loaded = fuser.load(tmp_path / "engine")
    assert loaded.gammas == (2, 4)
    assert all(verify(LONG) in b.target for b in loaded.buckets.values())
    scheduler = AdaptiveScheduler(loaded, adapt_draft=False, suffix_min_match=2)
    try:
        assert scheduler.suffix_gammas == (LONG,)
        remember(scheduler, references())
        ran = script_arms(scheduler, [(SUFFIX, LONG), (DRAFT, 4)])
        assert serve_stepped(scheduler) == references()
        assert (SUFFIX, LONG) in ran and scheduler.resyncs > 0, ran
    finally:
        scheduler.close()


def test_long_suffix_arms_need_their_verify_steps() -> None:
    """Gammas the engine built no verify step for are left out (the arms absent); gammas
    not above the draft's are refused."""
    scheduler = AdaptiveScheduler(engine(), adapt_draft=False, long_suffix_gammas=(LONG, 12))
    try:
        assert scheduler.suffix_gammas == (LONG,)
    finally:
        scheduler.close()
    with pytest.raises(ValueError, match="above every draft gamma"):
        AdaptiveScheduler(engine(), adapt_draft=False, long_suffix_gammas=(4,))
    with pytest.raises(ValueError, match="long_suffix_gammas"):
        fuser.FuserConfig(gamma_candidates=(2, 4), long_suffix_gammas=(4,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_background_update_distils_while_idle_and_swaps_into_the_captured_draft():
    """On CUDA in fp32 (captured steps, mixed steps and prefills; the update on a side stream),
    the adaptive scheduler's background update as `fuser serve --adapt-draft` runs it (no
    DistillConfig.duty: paced under load, unpaced once the server idles) distils the draft on
    what it served, is accepted (the prompts come back: memorised) and is swapped into the live draft
    that the captured graphs read; the requests after it, with the new draft, still return
    the target's greedy output (Hugging Face's, up to a near-tie), as those before it did."""
    import copy

    from engines import assert_greedy_matches, hf_greedy

    target = copy.deepcopy(llama_target()).cuda()
    draft = tiny_model("mistral", seed=2, vocab=VOCAB, heads=2, kv_heads=1, head_dim=16,
                       intermediate=64, layers=1, init_range=0.3, **NO_SPECIAL).cuda()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 4),
                               gamma="auto", gamma_candidates=(2, 4), compile="fx",
                               precision="fp32", suffix_speculation=True,
                               long_suffix_gammas=(LONG,), adapt_draft=True,
                               distill_every=8, distill_budget_s=60.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = fuser.optimize(target, draft=draft, config=config)
    references = [hf_greedy(target, torch.tensor([p], device="cuda"),
                            torch.ones(1, len(p), dtype=torch.long, device="cuda"), 24)
                  for p in PROMPTS]

    def rounds(scheduler: AdaptiveScheduler, count: int) -> None:
        for _ in range(count):
            streams = [scheduler.submit(p, GREEDY) for p in PROMPTS]
            for p, stream, (ref, near_tie) in zip(PROMPTS, streams, references, strict=True):
                ids = torch.tensor([p])
                assert_greedy_matches(torch.tensor([p + stream.result(TIMEOUT)]), ref.cpu(),
                                      near_tie.cpu(), ids, [])
            assert scheduler.wait_idle(TIMEOUT)

    scheduler = AdaptiveScheduler(
        eng, costs=COSTS, background=True,
        distill=DistillConfig(lr=3e-3, batch_tokens=256, holdout_fraction=0.5, max_steps=30),
        controller_options=dict(probe_share=0.2, refresh=8))
    assert scheduler.distiller.config.duty is None  # SERVING_DUTY under load: the default
    scheduler.start()
    try:
        rounds(scheduler, 3)  # the update starts at the 8th finished request
        assert scheduler.wait_update(TIMEOUT)  # (unpaced once the server idles)
        assert len(scheduler.update_results) == 1
        result = scheduler.update_results[0]
        assert result.accepted, result.reason
        assert scheduler.swap.swaps == 1 and scheduler.snapshot()["draft_version"] == 1
        def replayed() -> int:  # the captured iterations: plain and speculative, mixed
            return sum(v for k, v in eng.report().graph_replays.items()
                       if k.startswith("step.")) + sum(g.replays
                                                       for g in scheduler._graphs.values())

        before = replayed()
        rounds(scheduler, 2)  # with the distilled draft
        assert replayed() > before
    finally:
        scheduler.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_long_suffix_step_is_captured_and_keeps_the_targets_tokens():
    """On CUDA in fp32: the long suffix arm's step is captured as a CUDA graph per bucket
    (greedy and sampling) and replayed, the draft caught up after it before the draft's
    steps; every request's tokens are the target's greedy ones (Hugging Face's, up to a
    near-tie: fp32 kernels at varying batch sizes)."""
    import copy

    from engines import assert_greedy_matches, hf_greedy

    target = copy.deepcopy(llama_target()).cuda()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=4, batch_buckets=(1, 4),
                               gamma="auto", gamma_candidates=(2,), compile="fx",
                               precision="fp32", suffix_speculation=True,
                               long_suffix_gammas=(LONG,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3), config=config)
    references = [hf_greedy(target, torch.tensor([p], device="cuda"),
                            torch.ones(1, len(p), dtype=torch.long, device="cuda"), 24)
                  for p in PROMPTS]
    scheduler = AdaptiveScheduler(eng, adapt_draft=False, suffix_min_match=2)
    try:
        assert {(4, LONG, False), (4, LONG, True)} <= set(scheduler._graphs)
        remember(scheduler, [ref[0, len(p):].tolist() for p, (ref, _) in zip(PROMPTS,
                                                                              references)])
        ran = script_arms(scheduler, [(SUFFIX, LONG)] * 2 + [(DRAFT, 2)])
        outputs = serve_stepped(scheduler)
        for p, out, (ref, near_tie) in zip(PROMPTS, outputs, references, strict=True):
            assert_greedy_matches(torch.tensor([p + out]), ref.cpu(), near_tie.cpu(),
                                  torch.tensor([p]), [])
        assert (SUFFIX, LONG) in ran and scheduler.resyncs > 0, ran
        assert scheduler._graphs[(4, LONG, False)].replays > 0
    finally:
        scheduler.close()


@settings(max_examples=50, deadline=None, derandomize=True)
@given(outcomes=st.lists(st.booleans(), min_size=1, max_size=40),
       resets=st.sets(st.integers(0, 399)))
def test_lookups_back_off_after_misses_and_resume_on_a_match(outcomes: list[bool],
                                                             resets: set[int]) -> None:
    """LookupBackoff: after k lookups in a row that found no row matching, k >= 2, the next
    min(2**(k-2), LOOKUP_BACKOFF_MAX) steps skip theirs; after a match or a single miss none
    does; a reset (new requests) looks up at that step."""
    backoff, outcome = LookupBackoff(), iter(outcomes)
    looked: list[tuple[int, bool]] = []  # (step, matched) of each lookup
    for step in range(400):
        if step in resets:
            backoff.reset()
        if backoff.due():
            matched = next(outcome, None)
            if matched is None:
                break
            backoff.found(matched)
            looked.append((step, matched))
    misses = 0
    for (at, matched), (then, _) in zip(looked, looked[1:]):
        misses = 0 if matched else misses + 1
        skipped = then - at - 1
        want = min(2 ** (misses - 2), LOOKUP_BACKOFF_MAX) if misses >= 2 else 0
        if any(at < r <= then for r in resets):
            assert then in resets and skipped <= want
            misses = 0
        else:
            assert skipped == want, (looked, at, then)


class NeverMatching:
    """A suffix index (the real one) whose lookups never find a match, counted."""

    def __init__(self) -> None:
        from fuser.runtime.suffix import SuffixIndex

        self.index = SuffixIndex(min_ngram=4)
        self.lookups = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.index, name)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.index

    def propose_arrays(self, request_ids, max_tokens: int, min_match: int = 1):
        import numpy as np

        self.lookups += 1
        return (np.zeros((len(request_ids), max_tokens), np.int64),
                np.zeros(len(request_ids), np.int64))


def test_a_suffix_that_never_matches_is_looked_up_on_few_steps():
    """Where no row ever matches and the suffix's arms are only due probes (the draft's arms
    scripted cheaper), the index is looked up on a small share of the steps (after the
    second of the lookups in a row that found nothing, 1, 2, 4 then 8 steps skip theirs; each
    admission looks up again), and every request returns the target's greedy tokens. Without
    the backoff most steps look up (the arms stay due: never usable, never probed)."""
    eng, new_tokens = engine(), 36
    want = [eng.generate(torch.tensor([p]), max_new_tokens=new_tokens)[0, len(p):].tolist()
            for p in PROMPTS]
    index = NeverMatching()
    scheduler = AdaptiveScheduler(eng, adapt_draft=False, background=False, index=index,
                                  costs={"decode": 1.0, DRAFT: {2: 0.5, 4: 0.6},
                                         SUFFIX: {2: 0.55, 4: 0.65, LONG: 50.0}})
    steps = issued_steps(scheduler)
    try:
        with eng.generating():  # stepped by hand: one admission, then only decode steps
            streams = [scheduler.submit(p, SamplingParams(max_tokens=new_tokens,
                                                          temperature=0.0)) for p in PROMPTS]
            while not all(s.done for s in streams):
                scheduler._iteration()
            scheduler._retire()
    finally:
        scheduler.close()
    assert [s.output_ids for s in streams] == want
    assert index.lookups == scheduler.lookup_count
    assert len(steps) >= 15, len(steps)
    assert 0 < index.lookups <= len(steps) // 3, (index.lookups, len(steps))
    assert all(source != SUFFIX for source in steps)


def issued_steps(scheduler: AdaptiveScheduler) -> list[str]:
    """The source of every step `scheduler` issues from now on (appended as issued)."""
    sources: list[str] = []
    issue = scheduler._issue

    def issued():
        step = issue()
        sources.append(step.choice.source)
        return step

    scheduler._issue = issued
    return sources


def test_a_request_that_leaves_before_any_lookup_is_pooled_without_being_indexed():
    """A request is put into the suffix index only when a lookup first reads its row: one
    that ends at its prefill (one token) never is (no `add_request`, whose own n-grams its
    finish would only remove again: host time a request), and still joins the pool of recent
    outputs as its finish would pool it (here with its prompt), so a later request that
    repeats it is proposed its continuation."""
    from fuser.runtime.suffix import SuffixIndex

    class Counted(SuffixIndex):
        added = 0

        def add_request(self, request_id, prompt_ids) -> None:
            Counted.added += 1
            super().add_request(request_id, prompt_ids)

    eng = engine()
    index = Counted(min_ngram=2, keep_prompts=True)
    scheduler = AdaptiveScheduler(eng, adapt_draft=False, background=False, index=index,
                                  costs=COSTS)
    try:
        with eng.generating():  # stepped by hand: admissions and their prefills only
            streams = [scheduler.submit(p, SamplingParams(max_tokens=1, temperature=0.0))
                       for p in PROMPTS]
            while not all(s.done for s in streams):
                scheduler._iteration()
            scheduler._retire()
    finally:
        scheduler.close()
    assert [s.output_ids for s in streams] == [r[:1] for r in references()]
    assert Counted.added == 0 and scheduler.lookup_count == 0
    assert index.recent_sequences == len(PROMPTS)
    assert index.recent_tokens == sum(len(p) + 1 for p in PROMPTS)
    index.add_request("again", PROMPTS[1][:4])
    assert index.propose("again", 3) == PROMPTS[1][4:7]
