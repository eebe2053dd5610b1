"""runtime/draft_kernels.py's glue against the eager code it replaces (runtime/speculative.py,
`draft(fused=False)` and `verify(fused=False)`): the draft tokens, every model step's inputs
(tokens, positions, strides, the cache lengths it ran at) and every mutated length bit for bit,
over batches, gammas, vocabularies (non-powers of two, several loop blocks, a cut below the
logits' width), bf16/fp32 logits, forced ties, infinities and NaNs, and proposals given in
place of the draft's at some positions (the mixed step's); and speculative steps on a real
engine unchanged with the kernels forced on.

The model steps here are stand-ins that record their inputs and return preset logits: the glue
is what is under test. Without a GPU the launchers run under TRITON_INTERPRET=1 (conftest.py);
with one, for real.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.runtime import draft_kernels, speculative, step_kernels
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.speculative import DecodeState
from fuser.runtime.steps import CATCHUP, DECODE, ModelSteps, StepGraph, StepKind, verify

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Vocabularies: tiny, non-powers of two, the tests' engines' 160 (a multiple of the 16-wide
# test block, see `cases`), one block of 1024. Either side of a real MAX_BLOCK_V block and the
# Llama-3 vocabulary are `test_a_vocabulary_either_side_of_a_block`'s and
# `test_argmax_ties_nans_and_a_large_vocabulary`'s (the interpreter's pace).
VOCABS = (2, 3, 100, 160, 1000)
SPECIALS = (float("nan"), float("inf"), float("-inf"))


@dataclass
class Case:
    """One round's glue inputs: both caches' lengths, the decode state's tokens, and the logits
    each draft step returns."""

    target_lens: torch.Tensor  # [B] L
    target_starts: torch.Tensor  # [B]
    draft_lens: torch.Tensor  # [B] whatever the last round left (the catch-up rewinds it)
    draft_starts: torch.Tensor  # [B]
    last: torch.Tensor  # [B]
    pending: torch.Tensor  # [B]
    logits: list[torch.Tensor]  # per draft step: [B, T, W] (T = 2, then 1), W >= vocab_size
    vocab_size: int
    block_v: int = draft_kernels.MAX_BLOCK_V  # the argmax's loop block (small: many blocks)
    # proposals given (`draft`'s `given`: the suffix index's, in the mixed step): use [B, G]
    # bool, tokens [B, G] int64; None: the draft's own
    given: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def gamma(self) -> int:
        return len(self.logits)

    def to(self, device: str) -> Case:
        """A copy on `device` (each run mutates its own)."""
        fields = {name: value.to(device, copy=True) for name, value in vars(self).items()
                  if isinstance(value, torch.Tensor)}
        given = None if self.given is None else \
            tuple(t.to(device, copy=True) for t in self.given)
        return Case(**fields, logits=[x.to(device, copy=True) for x in self.logits],
                    vocab_size=self.vocab_size, block_v=self.block_v, given=given)


@dataclass
class Run:
    """What one round's glue produced: the drafts, each model step's inputs, the lengths after."""

    draft_tokens: torch.Tensor  # [B, gamma]
    calls: list[tuple]  # (step, tokens, positions, seq_lens, starts, strides) per model step
    draft_lens: torch.Tensor
    target_lens: torch.Tensor


def recording_step(name: str, kind: StepKind, outputs: list[torch.Tensor], calls: list
                   ) -> StepGraph:
    """A stand-in model step: records its inputs, returns the next of `outputs`."""
    queue = iter(outputs)

    def step(tokens: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor,
             starts: torch.Tensor) -> torch.Tensor:
        assert tokens.shape[1] == kind.tokens
        calls.append((name, tokens.clone(), positions.clone(), seq_lens.clone(), starts.clone(),
                      (tokens.stride(), positions.stride())))
        return next(queue)

    return StepGraph(name, kind, step)


def run(case: Case, fused: bool) -> Run:
    """`draft` then `verify`, as a greedy `speculative_step` runs them, over stand-in models."""
    B, G, W = case.last.shape[0], case.gamma, case.logits[0].shape[2]
    calls: list = []
    draft_cache = KVCache([], [], seq_lens=case.draft_lens, starts=case.draft_starts)
    target_cache = KVCache([], [], seq_lens=case.target_lens, starts=case.target_starts)
    draft_model = ModelSteps("draft", draft_cache, W, {
        CATCHUP: recording_step("draft.catchup", CATCHUP, case.logits[:1], calls),
        DECODE: recording_step("draft.decode", DECODE, case.logits[1:], calls)})
    target_logits = torch.zeros(B, G + 1, W, device=case.last.device)
    target = ModelSteps("target", target_cache, W, {
        verify(G): recording_step("target.verify", verify(G), [target_logits], calls)})
    state = DecodeState.allocate(B, 4, case.last.device)
    state.last.copy_(case.last)
    state.pending.copy_(case.pending)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(draft_kernels, "MAX_BLOCK_V", case.block_v)
        draft_tokens, probs = speculative.draft(draft_model, target_cache.seq_lens, state, G,
                                                case.vocab_size, False, fused, given=case.given)
    assert probs is None
    speculative.verify(target, state, draft_tokens, case.vocab_size, fused)
    assert torch.equal(state.last, case.last) and torch.equal(state.pending, case.pending)
    return Run(draft_tokens, calls, draft_cache.seq_lens, target_cache.seq_lens)


def logits(shape: tuple[int, int, int], vocab_size: int, dtype: torch.dtype, seed: int,
           levels: int | None, specials: list[tuple[float, int, int]]) -> torch.Tensor:
    """Random logits [B, T, W]: normal, or integers below `levels` (ties everywhere); then each
    special value (nan, +-inf) at (row, column) of the last position, inside the vocabulary."""
    generator = torch.Generator().manual_seed(seed)
    if levels is None:
        x = torch.randn(shape, generator=generator)
    else:
        x = torch.randint(0, levels, shape, generator=generator).float()
    for value, row, column in specials:
        x[row % shape[0], -1, column % vocab_size] = value
    return x.to(dtype)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """A random round: B in 1..4, gamma in 1..4, a vocabulary and the logits' width past it."""
    B = draw(st.integers(1, 4))
    gamma = draw(st.integers(1, 4))
    vocab_size = draw(st.sampled_from(VOCABS))
    width = vocab_size + draw(st.sampled_from([0, 1, 8, 256]))  # the padded-vocab cut
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    levels = draw(st.sampled_from([None, 2, 5]))  # 2, 5: equal maxima in every row
    # Blocks of 16 over a small vocabulary: many loop blocks, ties within a lane, at the
    # interpreter's pace (the large vocabularies take one or two real blocks).
    small = vocab_size <= 160
    block_v = draw(st.sampled_from([draft_kernels.MAX_BLOCK_V, 16])) if small else \
        draft_kernels.MAX_BLOCK_V

    def ints(lo: int, hi: int) -> torch.Tensor:
        return torch.tensor(draw(st.lists(st.integers(lo, hi), min_size=B, max_size=B)))

    steps = []
    for i in range(gamma):
        specials = draw(st.lists(st.tuples(st.sampled_from(SPECIALS), st.integers(0, 3),
                                           st.integers(0, 1 << 20)), max_size=2))
        steps.append(logits((B, 2 if i == 0 else 1, width), vocab_size, dtype,
                            draw(st.integers(0, 2**31)), levels, specials))
    target_lens = ints(1, 60)
    starts = torch.minimum(ints(0, 20), target_lens - 1)  # left padding before the real slots
    given = None
    if draw(st.booleans()):  # proposals given at some positions (the mixed step's rows)
        use = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=gamma,
                                                  max_size=gamma), min_size=B, max_size=B)))
        proposed = torch.tensor(draw(st.lists(st.lists(
            st.integers(0, vocab_size - 1), min_size=gamma, max_size=gamma),
            min_size=B, max_size=B)))
        given = (use, torch.where(use, proposed, 0))
    return Case(target_lens=target_lens, target_starts=starts, draft_lens=ints(0, 70),
                draft_starts=starts.clone(), last=ints(0, 1 << 17), pending=ints(0, 1 << 17),
                logits=steps, vocab_size=vocab_size, block_v=block_v, given=given)


def check(case: Case, device: str) -> None:
    """Kernels and eager from the same inputs on `device`: the same drafts, the same inputs to
    every model step (values, dtypes, strides, lengths), the same lengths after."""
    eager, fused = run(case.to(device), fused=False), run(case.to(device), fused=True)
    assert fused.draft_tokens.dtype == torch.long
    assert fused.draft_tokens.shape == eager.draft_tokens.shape == (case.last.shape[0],
                                                                     case.gamma)
    assert torch.equal(fused.draft_tokens, eager.draft_tokens), (fused.draft_tokens,
                                                                 eager.draft_tokens)
    assert [c[0] for c in fused.calls] == [c[0] for c in eager.calls]
    for got, want in zip(fused.calls, eager.calls):
        for g, w in zip(got[1:5], want[1:5]):
            assert g.dtype == w.dtype and torch.equal(g, w), (got[0], got, want)
        assert got[5] == want[5], (got[0], "strides", got[5], want[5])
    assert torch.equal(fused.draft_lens, eager.draft_lens), (fused.draft_lens, eager.draft_lens)
    assert torch.equal(fused.target_lens, eager.target_lens)


SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=40, **SETTINGS)
@given(case=cases())
def test_kernels_equal_eager(case: Case) -> None:
    check(case, "cuda" if torch.cuda.is_available() else "cpu")


def test_argmax_ties_nans_and_a_large_vocabulary() -> None:
    """Worked rows over a Llama-3 vocabulary (128256, 16 loop blocks) cut from a wider row:
    equal maxima in different blocks, lanes or both (the first wins), a maximum past the cut
    (ignored), a
    NaN after a maximum and two NaNs (the first NaN wins, as torch.argmax), an all -inf row
    (index 0), a +inf. Each row's expected token is written out, and equals torch.argmax."""
    V, W = 128256, 128264
    x = torch.zeros(6, 2, W, dtype=torch.bfloat16)
    x[0, -1, [9000, 70000, 128255, 9000 + 8192, 808]] = 3.0  # ties across blocks and lanes
    x[0, -1, 808] = 2.0  # (only just below)
    x[1, -1, 5] = 1.0
    x[1, -1, 128260] = 9.0  # past the vocabulary cut
    x[2, -1, 7] = 4.0
    x[2, -1, [100000, 20000]] = float("nan")
    x[3, -1] = float("-inf")
    x[4, -1, [128255, 2]] = float("inf")
    x[5, -1, :] = -1.0  # all equal: the first
    x[5, -1, [3 * 8192 + 1, 8192 + 1, 5 * 8192 + 1]] = 1.0  # ties within one lane of a block
    want = [9000, 5, 20000, 0, 2, 8193]
    draft_cache = KVCache([], [], seq_lens=torch.tensor([4, 5, 6, 7, 8, 9]),
                          starts=torch.tensor([0, 1, 2, 0, 1, 2]))
    drafted = torch.full((6, 3), -5, dtype=torch.long)
    token, position = draft_kernels.draft_advance(x[:, -1, :V], drafted, 1, draft_cache, 2)
    assert torch.argmax(x[:, -1, :V], dim=-1).tolist() == want
    assert token[:, 0].tolist() == want and drafted[:, 1].tolist() == want
    assert drafted[:, [0, 2]].eq(-5).all()  # only column 1 written
    assert draft_cache.seq_lens.tolist() == [6, 7, 8, 9, 10, 11]
    assert position[:, 0].tolist() == [6, 6, 6, 9, 9, 9]

    case = Case(target_lens=torch.tensor([5, 9, 3, 4, 7, 2]), target_starts=torch.zeros(6).long(),
                draft_lens=torch.zeros(6).long(), draft_starts=torch.zeros(6).long(),
                last=torch.arange(6), pending=torch.arange(6) + 10, logits=[x], vocab_size=V)
    check(case, "cpu")


@pytest.mark.parametrize("extra", [-1, 0, 1])
def test_a_vocabulary_either_side_of_a_block(extra: int) -> None:
    """V = MAX_BLOCK_V - 1, MAX_BLOCK_V, MAX_BLOCK_V + 1 in bf16, values in {0, 1} (a tie in
    every row), a NaN in one decode step."""
    V = draft_kernels.MAX_BLOCK_V + extra
    specials = [(float("nan"), 1, V - 1)]
    steps = [logits((3, 2, V + 8), V, torch.bfloat16, 7, 2, []),
             logits((3, 1, V + 8), V, torch.bfloat16, 8, 2, specials)]
    lens = torch.tensor([9, 30, 2])
    case = Case(target_lens=lens, target_starts=torch.tensor([0, 4, 1]),
                draft_lens=torch.tensor([0, 40, 7]), draft_starts=torch.tensor([0, 4, 1]),
                last=torch.tensor([1, 2, 3]), pending=torch.tensor([4, 5, 6]), logits=steps,
                vocab_size=V)
    check(case, "cpu")


def test_the_worked_round() -> None:
    """gamma 2, two rows, written out: the catch-up rewinds the draft to L - 1 and feeds
    [last, pending] at positions L - 1 - starts + [0, 1]; the decode step feeds d_1 one slot
    on; verify feeds [pending, d_1, d_2] from L."""
    x1 = torch.zeros(2, 2, 8)
    x1[0, -1, 3], x1[1, -1, 6] = 1.0, 1.0
    x1[1, 0, 7] = 5.0  # the catch-up's first position: not a draft
    x2 = torch.zeros(2, 1, 8)
    x2[0, 0, 5], x2[1, 0, 2] = 1.0, 1.0
    x2[1, 0, 7] = 9.0  # past the vocabulary cut
    case = Case(target_lens=torch.tensor([10, 6]), target_starts=torch.tensor([0, 2]),
                draft_lens=torch.tensor([12, 3]), draft_starts=torch.tensor([0, 2]),
                last=torch.tensor([41, 42]), pending=torch.tensor([51, 52]), logits=[x1, x2],
                vocab_size=7)
    result = run(case.to("cpu"), fused=True)
    assert result.draft_tokens.tolist() == [[3, 5], [6, 2]]
    (_, tokens, positions, lens, _, _), decode, verify_call = result.calls
    assert tokens.tolist() == [[41, 51], [42, 52]] and lens.tolist() == [9, 5]
    assert positions.tolist() == [[9, 10], [3, 4]]
    assert decode[1].tolist() == [[3], [6]] and decode[2].tolist() == [[11], [5]]
    assert decode[3].tolist() == [11, 7]
    assert verify_call[1].tolist() == [[51, 3, 5], [52, 6, 2]]
    assert verify_call[2].tolist() == [[10, 11, 12], [4, 5, 6]]
    assert result.draft_lens.tolist() == [12, 8] and result.target_lens.tolist() == [10, 6]
    check(case, "cpu")


def count_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Turn the fused glue on (FUSE_OFF_CUDA) and record, by name, every launcher that
    runtime/speculative.py calls from now on."""
    calls: list[str] = []
    for name in ("catchup_inputs", "draft_advance", "verify_inputs"):
        def counted(*args: object, _name: str = name,
                    _launch: object = getattr(draft_kernels, name)) -> object:
            calls.append(_name)
            return _launch(*args)
        monkeypatch.setattr(speculative, name, counted)
    monkeypatch.setattr(step_kernels, "FUSE_OFF_CUDA", True)
    return calls


def test_sampling_keeps_the_eager_glue(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels on by default (FUSE_OFF_CUDA here), a sampled draft runs none of them;
    a greedy one runs each."""
    calls = count_launches(monkeypatch)
    B, W = 2, 8
    cache = KVCache([], [], seq_lens=torch.zeros(B).long(), starts=torch.zeros(B).long())
    outputs = [torch.randn(B, 2, W), torch.randn(B, 1, W)]
    model = ModelSteps("draft", cache, W, {
        CATCHUP: recording_step("c", CATCHUP, outputs * 2, []),
        DECODE: recording_step("d", DECODE, outputs[1:] * 2, [])})
    state = DecodeState.allocate(B, 4, torch.device("cpu"))
    state.load(5, [], 1.0, None, None, W)
    lens = torch.tensor([3, 4])
    _, probs = speculative.draft(model, lens, state, 2, W, True)
    assert probs is not None and calls == []
    speculative.draft(model, lens, state, 2, W, False)
    assert calls == ["catchup_inputs", "draft_advance", "draft_advance"]


@needs_cuda
@pytest.mark.gpu
@settings(max_examples=40, **SETTINGS)
@given(case=cases())
def test_kernels_equal_eager_on_cuda(case: Case) -> None:
    """On CUDA for real: compiled Triton against CUDA's eager ops (argmax, stack, cat, ...)."""
    check(case, "cuda")


# -- speculative steps on a real engine with the kernels forced on ----------------------------


def live(bucket: object) -> dict[str, torch.Tensor]:
    """Everything a step reads or writes, by name: the decode state and both caches (lengths
    and every k/v slot)."""
    tensors = {f"state.{name}": value for name, value in vars(bucket.state).items()}
    for model in (bucket.target, bucket.draft):
        cache = model.cache
        tensors[f"{model.role}.seq_lens"] = cache.seq_lens
        tensors[f"{model.role}.starts"] = cache.starts
        for layer, (k, v) in enumerate(zip(cache.k, cache.v)):
            tensors[f"{model.role}.k{layer}"], tensors[f"{model.role}.v{layer}"] = k, v
    return tensors


def snapshot(bucket: object) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in live(bucket).items()}


@pytest.mark.usefixtures("one_intra_op_thread")
# g4self (tests/engines.py): gamma 4, so the catch-up and three decode steps; the rewinds by
# other amounts (rejected drafts) are the hypothesis test's. Each engine costs 10-30 s to build
# on the CPU.
def test_speculative_steps_are_unchanged_with_the_kernels(engines,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Greedy speculative steps on the CPU from one state after prefill, eager then fused: the
    same packed tokens, and the same decode state and caches (lengths, every k/v slot) after
    every step; the fused glue ran each launch the module docstring counts."""
    from engines import MAX_SEQ_LEN, prompts
    from fuser.runtime.prompts import check_prompts, pad_batch

    engine, _ = engines("g4self")
    ids, mask = prompts([8, 3, 10], seed=21)
    checked = check_prompts(ids, mask, vocab_size=engine.vocab_size, max_batch_size=4,
                            max_tokens=MAX_SEQ_LEN, device=engine.device)
    bucket = engine.bucket(checked.batch)  # 4 rows: one dummy (inactive) row
    bucket.state.load(30, [], 1.0, None, None, engine.vocab_size)
    speculative.prefill(bucket.target, bucket.draft, bucket.state,
                        pad_batch(checked, bucket.batch, 2), checked.length, engine.vocab_size,
                        False)
    start = snapshot(bucket)

    def steps() -> list[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """Three steps from `start`: (packed, snapshot after) each."""
        for key, t in live(bucket).items():
            t.copy_(start[key])
        out = []
        for _ in range(3):
            packed = speculative.speculative_step(bucket.target, bucket.draft, bucket.state,
                                                  engine.gamma, engine.vocab_size, False)
            out.append((packed.clone(), snapshot(bucket)))
        return out

    eager = steps()
    launches = count_launches(monkeypatch)
    fused = steps()
    assert len(launches) == 3 * (engine.gamma + 2), launches
    for i, ((packed, after), (want_packed, want_after)) in enumerate(zip(fused, eager)):
        assert torch.equal(packed, want_packed), (i, packed, want_packed)
        for key, want in want_after.items():
            assert torch.equal(after[key], want), (i, key)
    moved = eager[-1][1]["target.seq_lens"] - start["target.seq_lens"]
    assert moved[:3].min() >= 3, moved  # the real rows did advance: the steps were not no-ops
