"""The draft catching up after target-only steps (`speculative.resync_draft`): RESYNC steps of
RESYNC_TOKENS tokens leave the draft's cache as a full re-prefill does, greedy output with
speculation toggling off and on stays the target's, the catching up reads nothing on the host,
and a draft without the RESYNC step (an engine file written before it) still re-prefills.

One engine (tiny Llama target, a noisy copy as draft: partial acceptance) serves the file; its
cache is long enough for more than RESYNC_MAX_CHUNKS chunks of lag.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fuser
from engines import (VOCAB, assert_greedy_matches, eos_that_ends_one_row, hf_greedy, llama_target,
                     perturbed, prompts)
from fuser.numerics import LOGITS_TOLERANCE, relative_error
from fuser.runtime import speculative
from fuser.runtime.prompts import check_prompts, pad_batch
from fuser.runtime.speculative import RESYNC_MAX_CHUNKS
from fuser.runtime.step_graphs import Bucket
from fuser.runtime.steps import RESYNC, RESYNC_TOKENS, ModelSteps

# One xdist worker runs the module: its cached engine is built once.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),  # conftest.py
              pytest.mark.xdist_group("resync")]

MAX_SEQ_LEN = 224  # room for a lag of more than RESYNC_MAX_CHUNKS chunks
BATCH = 4
GAMMAS = (1, 3)
W = RESYNC_TOKENS
# The chunked and the full catching up compute the same fp32 math over 16 rows at a time or
# over the whole sequence: only the summation order of their products differs.
TOLERANCE = LOGITS_TOLERANCE[torch.float32]


@functools.cache
def engine() -> fuser.Engine:
    target = llama_target()
    config = fuser.FuserConfig(max_seq_len=MAX_SEQ_LEN, max_batch_size=BATCH, gamma="auto",
                               gamma_candidates=GAMMAS, compile="fx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3), config=config)
    assert built.report().fallbacks == [] and RESYNC in built.draft
    return built


def without_resync(draft: ModelSteps) -> ModelSteps:
    """The same draft (same cache) without its RESYNC step: what an older engine file loads."""
    return ModelSteps(draft.role, draft.cache, draft.vocab_size,
                      {kind: g for kind, g in draft.steps.items() if kind != RESYNC})


def recorded_kinds(monkeypatch: pytest.MonkeyPatch, model: ModelSteps) -> list[str]:
    """The kinds of the steps `model` runs from now on, in order."""
    kinds: list[str] = []
    run = model.run

    def recording(kind, tokens, positions):
        kinds.append(kind.name)
        return run(kind, tokens, positions)
    monkeypatch.setattr(model, "run", recording)
    return kinds


def chunks(behind: int) -> int:
    """The RESYNC steps a lag of `behind` target-only steps takes: behind + 1 tokens (the draft
    was valid up to L-2 after its last speculative step)."""
    return -(-(behind + 1) // W)


def draft_cache(draft: ModelSteps) -> list[torch.Tensor]:
    """The draft cache's tensors: k and v per layer, then seq_lens."""
    return [*draft.cache.k, *draft.cache.v, draft.cache.seq_lens]


def assert_caught_up(got: list[torch.Tensor], ref: list[torch.Tensor], target: ModelSteps
                     ) -> None:
    """Equal lengths, and every layer's k/v of each row's real slots [starts, L) within the
    tolerance. (A padding slot's queries see no key: their later layers' k/v are undefined,
    and masked for every real query.)"""
    assert torch.equal(got[-1], target.cache.seq_lens) and torch.equal(ref[-1], got[-1])
    for b, (start, length) in enumerate(zip(target.cache.starts.tolist(),
                                            target.cache.seq_lens.tolist())):
        for layer, (x, y) in enumerate(zip(got[:-1], ref[:-1])):
            error = relative_error(x[b, start:length], y[b, start:length])
            assert error <= TOLERANCE, (b, layer, error)


# -- (a) after real target-only steps, the same cache as the full re-prefill ---------------------


@pytest.mark.parametrize("behind", [3, W - 1, W, W + 5, 3 * W + 2])
def test_chunks_leave_the_cache_a_reprefill_leaves(behind: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill, speculative steps, `behind` target-only steps, over a ragged batch (left
    padding, a dummy row, a row that finished early): catching up by chunks and by a re-prefill
    leave the same draft cache."""
    built = engine()
    ids, mask = prompts([5, 2, 9], seed=5)
    checked = check_prompts(ids, mask, vocab_size=VOCAB, max_batch_size=BATCH,
                            max_tokens=MAX_SEQ_LEN, device=built.device)
    bucket = built.bucket(checked.batch)
    target, draft, state = bucket.target, bucket.draft, bucket.state
    state.load(MAX_SEQ_LEN - checked.length, [], 1.0, None, None, VOCAB)
    state.max_new_tokens[1] = 6  # row 1 finishes early: frozen while the others go on
    speculative.prefill(target, draft, state, pad_batch(checked, bucket.batch, 2),
                        checked.length, VOCAB, False)
    for _ in range(3):
        speculative.speculative_step(target, draft, state, 3, VOCAB, False)
    for _ in range(behind):
        speculative.plain_step(target, state, VOCAB, False)
    before = [t.clone() for t in draft_cache(draft)]

    speculative.resync_draft(without_resync(draft), target, state, behind)
    ref = [t.clone() for t in draft_cache(draft)]
    for t, saved in zip(draft_cache(draft), before):
        t.copy_(saved)
    kinds = recorded_kinds(monkeypatch, draft)
    speculative.resync_draft(draft, target, state, behind)
    assert kinds == ["resync"] * chunks(behind)
    assert_caught_up(draft_cache(draft), ref, target)
    assert not state.active[1] and state.active[[0, 2]].all()


# -- (a) over lengths, padding, lags and the cache's end ------------------------------------------


@st.composite
def lags(draw: st.DrawFn) -> tuple[int, list[tuple[int, int, int]]]:
    """(behind, per row (start, L, valid)): the draft is valid below `valid` (at least
    L - behind - 1: a row that finished early lags less), L up to the cache's last usable slot
    (chunks that would pass the cache's end start earlier)."""
    behind = draw(st.integers(0, (RESYNC_MAX_CHUNKS - 1) * W))
    rows = []
    for _ in range(BATCH):
        start = draw(st.integers(0, 8))
        length = draw(st.integers(start + 1, MAX_SEQ_LEN - 1))
        valid = draw(st.integers(max(length - behind - 1, 0), length))
        rows.append((start, length, valid))
    return behind, rows


@settings(max_examples=25, deadline=None, derandomize=True)
@given(case=lags(), seed=st.integers(0, 2**16))
def test_chunks_equal_a_reprefill_at_any_lag(case: tuple[int, list[tuple[int, int, int]]],
                                             seed: int) -> None:
    """The draft valid below `valid` per row (made so by a re-prefill there), stale after it:
    catching up to L by chunks leaves the cache the full re-prefill to L leaves."""
    behind, rows = case
    bucket = engine().bucket(BATCH)
    target, draft, state = bucket.target, bucket.draft, bucket.state
    starts, lengths, valid = (torch.tensor(column) for column in zip(*rows))
    generator = torch.Generator().manual_seed(seed)
    state.history.copy_(torch.randint(3, VOCAB, state.history.shape, generator=generator))
    target.cache.begin(starts)
    full = without_resync(draft)

    target.cache.set_lengths(valid)
    speculative.resync_draft(full, target, state, 1)  # valid below `valid`
    for t in draft_cache(draft)[:-1]:  # and stale from there on
        for b, v in enumerate(valid.tolist()):
            t[b, v:] = torch.randn(t[b, v:].shape, generator=generator)
    before = [t.clone() for t in draft_cache(draft)]
    target.cache.set_lengths(lengths)
    speculative.resync_draft(full, target, state, behind)
    ref = [t.clone() for t in draft_cache(draft)]
    for t, saved in zip(draft_cache(draft), before):
        t.copy_(saved)
    speculative.resync_draft(draft, target, state, behind)
    assert_caught_up(draft_cache(draft), ref, target)


def test_far_behind_or_without_the_step_it_reprefills(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than RESYNC_MAX_CHUNKS chunks behind, or a draft without RESYNC: one prefill."""
    bucket = engine().bucket(BATCH)
    target, draft, state = bucket.target, bucket.draft, bucket.state
    target.cache.begin(torch.zeros(BATCH, dtype=torch.long))
    target.cache.set_lengths(torch.tensor([40, 200, 130, 7]))
    kinds = recorded_kinds(monkeypatch, draft)
    last = RESYNC_MAX_CHUNKS * W - 1  # behind + 1 tokens: the most that chunks catch up
    speculative.resync_draft(draft, target, state, last)
    assert kinds == ["resync"] * RESYNC_MAX_CHUNKS
    kinds.clear()
    speculative.resync_draft(draft, target, state, last + 1)
    assert kinds == ["prefill"]
    bare = without_resync(draft)
    bare_kinds = recorded_kinds(monkeypatch, bare)
    speculative.resync_draft(bare, target, state, 1)
    assert bare_kinds == ["prefill"]
    assert torch.equal(draft.cache.seq_lens, target.cache.seq_lens)


# -- (b), (c) greedy output with speculation toggling, no host reads ------------------------------


# The gamma of each issued step (0: target-only); the lags that follow: 5 (< W), 16 (= W),
# 30 (> W), 2, and a 130-step lag (> RESYNC_MAX_CHUNKS chunks: the re-prefill). Then target-only.
# Generations ask for more tokens than a script's steps can emit (at most gamma + 1 each).
SCRIPT = [3] + [0] * 5 + [1] + [0] * W + [3, 3] + [0] * 30 + [1] + [0] * 2 + [3]
FAR_SCRIPT = SCRIPT + [0] * 130 + [3, 3]


def script_gammas(monkeypatch: pytest.MonkeyPatch, built: fuser.Engine, bucket: Bucket,
                  script: list[int]) -> list[int]:
    """Run `script`'s gamma at each step `bucket` issues (then 0); -> the lag of every resync."""
    issued: list[int] = []
    resyncs: list[int] = []
    run, resync = bucket.run, bucket.resync

    def recording_run(gamma: int, do_sample: bool) -> torch.Tensor:
        issued.append(gamma)
        return run(gamma, do_sample)

    def recording_resync(behind: int) -> None:
        resyncs.append(behind)
        resync(behind)
    monkeypatch.setattr(bucket, "run", recording_run)
    monkeypatch.setattr(bucket, "resync", recording_resync)
    monkeypatch.setattr(built, "next_gamma",
                        lambda controller, bucket=None:
                        script[len(issued)] if len(issued) < len(script) else 0)
    return resyncs


HOST_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Any tensor value read on the host (what would sync with a GPU) raises."""
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor value was read on the host")
    with pytest.MonkeyPatch.context() as mp:
        for name in HOST_READS:
            mp.setattr(torch.Tensor, name, refuse)
        yield


def without_host_reads(fn: Callable) -> Callable:
    def guarded(*args, **kwargs):
        with no_host_reads():
            return fn(*args, **kwargs)
    return guarded


def toggling_generate(monkeypatch: pytest.MonkeyPatch, built: fuser.Engine, script: list[int],
                      n: int, guard: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Greedy generate over a ragged batch with one row ending early (eos), under `script`;
    -> (output checked against Hugging Face's, lags of the resyncs)."""
    ids, mask = prompts([6, 2, 9], seed=9)
    eos, _, _ = eos_that_ends_one_row(hf_greedy(llama_target(), ids, mask, 8)[0], ids.shape[1])
    ref, near_tie = hf_greedy(llama_target(), ids, mask, n, eos=eos, pad=0)
    bucket = built.bucket(ids.shape[0])
    resyncs = script_gammas(monkeypatch, built, bucket, script)
    if guard:  # the issued work: steps and catching up (the read-back is the one sync)
        monkeypatch.setattr(bucket, "run", without_host_reads(bucket.run))
        monkeypatch.setattr(bucket, "resync", without_host_reads(bucket.resync))
    out = built.generate(ids, n, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert_greedy_matches(out, ref, near_tie, ids, [eos])
    return out, resyncs


def test_greedy_output_stays_the_targets_with_speculation_toggling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    built = engine()
    kinds = recorded_kinds(monkeypatch, built.bucket(3).draft)
    _, resyncs = toggling_generate(monkeypatch, built, FAR_SCRIPT, 215)
    assert resyncs == [5, W, 30, 2, 130]
    # The prompt's prefill, the chunks of the first four lags, then the far lag's re-prefill.
    assert [k for k in kinds if k in ("prefill", "resync")] == \
        ["prefill"] + ["resync"] * sum(map(chunks, resyncs[:-1])) + ["prefill"]


def test_catching_up_reads_nothing_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """With speculation toggling, neither the issued steps nor the draft's catching up read a
    tensor on the host (on a GPU: no sync but the step's read-back)."""
    _, resyncs = toggling_generate(monkeypatch, engine(), SCRIPT, 100, guard=True)
    assert resyncs == [5, W, 30, 2]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_catching_up_never_syncs_with_the_host_on_cuda() -> None:
    """On CUDA, target-only steps, the draft catching up (its captured chunk replayed) and the
    speculative steps after it queue work without waiting for the device."""
    target = llama_target()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = fuser.optimize(copy.deepcopy(target).cuda(),
                               draft=perturbed(target, 0.05, seed=3).cuda(),
                               # "fx": the subject is the captured chunk, not Inductor (which
                               # took the whole 80 s of a device call's test step)
                               config=fuser.FuserConfig(max_seq_len=64, max_batch_size=4,
                                                        batch_buckets=(4,), gamma=3,
                                                        compile="fx"))
    ids, mask = prompts([5, 3], seed=1)
    checked = check_prompts(ids, mask, vocab_size=VOCAB, max_batch_size=4, max_tokens=64,
                            device=built.device)
    bucket = built.bucket(checked.batch)
    assert bucket.resync_graph is not None
    bucket.state.load(40, [], 1.0, None, None, VOCAB)
    speculative.prefill(bucket.target, bucket.draft, bucket.state,
                        pad_batch(checked, bucket.batch, 2), checked.length, VOCAB, False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for behind in (W + 3, 2):
            for _ in range(behind):
                bucket.run(0, False)
            bucket.resync(behind)
            packed = bucket.run(3, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert packed.cpu().shape == (bucket.batch, 5)
    assert bucket.resync_graph.replays == chunks(W + 3) + chunks(2)


def test_the_guard_sees_host_reads() -> None:
    with no_host_reads(), pytest.raises(AssertionError, match="read on the host"):
        torch.zeros(3).max().item()
    with no_host_reads(), pytest.raises(AssertionError, match="read on the host"):
        speculative.resync_draft(without_resync(engine().draft), engine().target,
                                 engine().bucket(BATCH).state, 1)


# -- (d) an engine file written before the RESYNC step -------------------------------------------


def drop_resync(path: Path) -> None:
    """Make `path` what a save wrote before the RESYNC step: no resync graph, kind or record."""
    manifest = json.loads((path / "manifest.json").read_text())
    key = f"{RESYNC.name}{RESYNC.tokens}"
    draft = manifest["info"]["models"]["draft"]
    draft["kinds"] = [k for k in draft["kinds"] if k != [RESYNC.name, RESYNC.tokens]]
    del draft["graphs"][key]
    del manifest["models"]["draft"]["graphs"][key]
    for suffix in ("json", "py"):
        (path / "draft" / "graphs" / f"{key}.{suffix}").unlink()
        del manifest["files"][f"draft/graphs/{key}.{suffix}"]
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_an_engine_file_without_the_step_loads_and_reprefills(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = engine()
    built.save(tmp_path / "new")
    shutil.copytree(tmp_path / "new", tmp_path / "old")
    drop_resync(tmp_path / "old")
    assert RESYNC in fuser.load(tmp_path / "new").draft
    old = fuser.load(tmp_path / "old")
    assert RESYNC not in old.draft and "draft.resync" not in old.report().graphs
    kinds = recorded_kinds(monkeypatch, old.bucket(3).draft)
    _, resyncs = toggling_generate(monkeypatch, old, SCRIPT, 100)
    assert resyncs == [5, W, 30, 2]
    assert [k for k in kinds if k in ("prefill", "resync")] == ["prefill"] * 5
