"""runtime/step_kernels.py's fused end of a greedy step against the eager code it replaces
(runtime/speculative.py, `finish_greedy(fused=False)`): the packed result and every tensor the
step mutates bit for bit, over batches, gammas (0: the plain step), agreement prefixes, active
masks, eos lists, budgets near exhaustion and lengths near the end of the history; and
generate() unchanged with the kernel forced on.

Without a GPU the launcher runs under TRITON_INTERPRET=1 (conftest.py); with one, for real.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuser.runtime import speculative, step_kernels
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.speculative import DecodeState
from fuser.runtime.steps import ModelSteps

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
VOCAB = 12  # few ids: drafts agree, and eos ids get hit, often enough by chance

# The tensors a step mutates, by name (seq_lens is the target cache's).
MUTATED = ("history", "last", "pending", "active", "generated", "seq_lens")


@dataclass
class Case:
    """One greedy step's inputs: the state before it, the drafts and the target's argmax."""

    state: DecodeState
    seq_lens: torch.Tensor  # [B] the target cache's lengths
    draft_tokens: torch.Tensor | None  # [B, gamma], None for the plain step (gamma 0)
    target_tokens: torch.Tensor  # [B, gamma + 1]

    def to(self, device: str) -> Case:
        """A deep copy on `device` (each run mutates its own)."""
        fields = {f.name: getattr(self.state, f.name).to(device, copy=True)
                  for f in dataclasses.fields(self.state)}
        draft = None if self.draft_tokens is None else self.draft_tokens.to(device, copy=True)
        return Case(DecodeState(**fields), self.seq_lens.to(device, copy=True), draft,
                    self.target_tokens.to(device, copy=True))

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {name: getattr(self.state, name) for name in MUTATED if name != "seq_lens"}
        return {**named, "seq_lens": self.seq_lens}


def run(case: Case, fused: bool) -> torch.Tensor:
    """The step's end through `finish_greedy` on a target with no layers: packed [B, g + 2]."""
    B = case.seq_lens.shape[0]
    cache = KVCache([], [], seq_lens=case.seq_lens,
                    starts=torch.zeros(B, dtype=torch.long, device=case.seq_lens.device))
    target = ModelSteps("target", cache, VOCAB)
    return speculative.finish_greedy(target, case.state, case.draft_tokens, case.target_tokens,
                                     fused).packed()


@st.composite
def cases(draw: st.DrawFn, clamp: bool = True) -> Case:
    """A random step. clamp=False keeps L + 1 + gamma <= S - 1 (what the runtime guarantees;
    CUDA's eager scatter_ picks an unspecified winner among clamped duplicates)."""
    B = draw(st.integers(1, 5))
    gamma = draw(st.integers(0, 8))
    S = gamma + 2 + draw(st.integers(0, 6))  # room for L + 1 + gamma when L is small

    def ints(lo: int, hi: int, n: int) -> list[int]:
        return draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n))

    # Target argmax agrees with the drafts for a drawn prefix, then (if any drafts are left)
    # disagrees at the next position; the rest is random.
    drafts, targets = [], []
    for _ in range(B):
        d = ints(0, VOCAB - 1, gamma)
        t = ints(0, VOCAB - 1, gamma + 1)
        agree = draw(st.integers(0, gamma))
        t[:agree] = d[:agree]
        if agree < gamma and t[agree] == d[agree]:
            t[agree] = (d[agree] + 1) % VOCAB
        drafts.append(d)
        targets.append(t)

    # Lengths: anywhere, or within gamma + 2 of the history's end (the clamp's region).
    top = S - 1 if clamp else S - 2 - gamma
    near_end = st.integers(max(0, top - gamma - 2), top)
    seq_lens = [draw(st.one_of(st.integers(0, top), near_end)) for _ in range(B)]
    generated = ints(1, 20, B)
    # max_new_tokens - generated: mostly near exhaustion, sometimes room for a whole step
    budget = [draw(st.one_of(st.integers(0, 3), st.integers(4, 12))) for _ in range(B)]
    # eos ids: often tokens of the step (kept ones, or stale drafts past a correction)
    seen = sorted({token for row in drafts + targets for token in row})
    eos = draw(st.lists(st.one_of(st.sampled_from(seen), st.integers(0, VOCAB - 1)), max_size=3))
    history = draw(st.lists(st.integers(0, 999), min_size=B * S, max_size=B * S))

    state = DecodeState.allocate(B, S, torch.device("cpu"))
    state.history.copy_(torch.tensor(history).view(B, S))
    state.pending.copy_(torch.tensor(ints(0, VOCAB - 1, B)))
    state.last.copy_(torch.tensor(ints(0, VOCAB - 1, B)))
    state.active.copy_(torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B))))
    state.generated.copy_(torch.tensor(generated))
    state.max_new_tokens.copy_(torch.tensor([g + b for g, b in zip(generated, budget)]))
    if eos:
        state.eos[:, : len(eos)] = torch.tensor(eos)
    draft_tokens = torch.tensor(drafts, dtype=torch.long).view(B, gamma) if gamma else None
    return Case(state, torch.tensor(seq_lens), draft_tokens,
                torch.tensor(targets, dtype=torch.long).view(B, gamma + 1))


def check(case: Case, device: str) -> None:
    """Kernel and eager from the same state on `device`: same packed, same mutated tensors."""
    eager, fused = case.to(device), case.to(device)
    expected = run(eager, fused=False)
    packed = run(fused, fused=True)
    assert packed.dtype == torch.long and packed.shape == expected.shape
    assert torch.equal(packed, expected), (packed, expected)
    for name, want in eager.tensors().items():
        got = fused.tensors()[name]
        assert got.dtype == want.dtype and torch.equal(got, want), (name, got, want)


SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}


@settings(max_examples=40, **SETTINGS)
@given(case=cases())
def test_kernel_equals_eager(case: Case) -> None:
    check(case, "cuda" if torch.cuda.is_available() else "cpu")


def test_clamped_slots_keep_the_last_token() -> None:
    """Active rows at the history's end: every slot from S - 1 on folds onto S - 1. The eager
    scatter_ on the CPU keeps the last of them (tokens[gamma]); so does the kernel. A change in
    torch's CPU scatter order would show up here first."""
    B, gamma, S = 3, 4, 7
    state = DecodeState.allocate(B, S, torch.device("cpu"))
    state.history.copy_(torch.arange(B * S).view(B, S) + 100)
    state.active.fill_(True)
    state.generated.fill_(1)
    state.max_new_tokens.fill_(50)
    draft = torch.arange(1, gamma + 1).repeat(B, 1)  # [B, gamma]
    target = torch.arange(1, gamma + 2).repeat(B, 1)  # all accepted: tokens [1, 2, 3, 4, 5]
    case = Case(state, torch.tensor([S - 1, S - 3, 2]), draft, target)
    eager = case.to("cpu")
    run(eager, fused=False)
    assert eager.state.history[:, S - 1].tolist() == [5, 5, 5]
    assert eager.state.history[1].tolist()[S - 2:] == [1, 5]  # slot S - 2 unclamped
    check(case, "cpu")


def test_plain_and_speculative_examples() -> None:
    """Worked rows (gamma 3): all accepted with the bonus; a correction at 1 hitting an eos;
    an inactive row (nothing moves); a budget of 1 (one token kept, row finished); an eos
    among the stale drafts past the correction (not emitted: the row goes on)."""
    state = DecodeState.allocate(5, 16, torch.device("cpu"))
    state.pending.fill_(7)
    state.last.fill_(6)
    state.active.copy_(torch.tensor([True, True, False, True, True]))
    state.generated.fill_(2)
    state.max_new_tokens.copy_(torch.tensor([20, 20, 20, 3, 20]))
    state.eos[:, 0] = 9
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 5, 9]])
    target = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4],
                           [1, 2, 3, 4]])
    case = Case(state, torch.tensor([5, 5, 5, 5, 5]), draft, target)
    fused = case.to("cpu")
    packed = run(fused, fused=True)
    assert packed.tolist() == [[1, 2, 3, 4, 3], [1, 9, 3, 0, 1], [1, 2, 3, 4, 3],
                               [1, 2, 3, 4, 3], [1, 2, 9, 0, 1]]
    assert fused.seq_lens.tolist() == [9, 7, 5, 6, 7]
    assert fused.state.generated.tolist() == [6, 4, 2, 3, 4]
    assert fused.state.pending.tolist() == [4, 9, 7, 4, 2]
    assert fused.state.last.tolist() == [3, 1, 6, 3, 1]
    assert fused.state.active.tolist() == [True, False, False, False, True]
    assert fused.state.history[0, 6:10].tolist() == [1, 2, 3, 4]
    assert fused.state.history[2].tolist() == [0] * 16
    check(case, "cpu")

    plain = Case(state, torch.tensor([5] * 5), None, torch.tensor([[9], [8], [8], [8], [8]]))
    assert run(plain.to("cpu"), fused=True).tolist() == [[9, 0]] + [[8, 0]] * 4
    check(plain, "cpu")


@needs_cuda
@pytest.mark.gpu
@settings(max_examples=40, **SETTINGS)
@given(case=cases(clamp=False))
def test_kernel_equals_eager_on_cuda(case: Case) -> None:
    """On CUDA for real (compiled Triton against CUDA's eager ops), within the runtime's slot
    invariant: CUDA's scatter_ has no defined winner among clamped duplicates."""
    check(case, "cuda")


# -- generate() with the kernel forced on -----------------------------------------------------


@pytest.mark.usefixtures("one_intra_op_thread")
# plain and g4self (tests/engines.py): the target-only step, and gamma 4 accepting every draft,
# so that the 13-token budget runs out mid-step (1 + 5 + 5, then 2 of 5). The other acceptance
# paths are the hypothesis test's; each engine costs 10-30 s to build on the CPU.
@pytest.mark.parametrize("name", ["plain", "g4self"])
def test_generate_is_unchanged_with_the_kernel(engines, name: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generate() on the CPU, eager then fused: the same tokens, with and without an
    eos that stops a row early."""
    from engines import prompts

    engine, _ = engines(name)
    ids, mask = prompts([8, 3, 10, 5], seed=21)
    reference = engine.generate(ids, 13, attention_mask=mask, eos_token_id=[])
    eos = [int(reference[0, ids.shape[1] + 4])]  # row 0 stops at its 5th token, others maybe
    reference_eos = engine.generate(ids, 13, attention_mask=mask, eos_token_id=eos)

    calls = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return step_kernels.finish_greedy_step(*args)

    monkeypatch.setattr(step_kernels, "FUSE_OFF_CUDA", True)
    monkeypatch.setattr(speculative, "finish_greedy_step", counted)
    assert torch.equal(engine.generate(ids, 13, attention_mask=mask, eos_token_id=[]), reference)
    assert torch.equal(engine.generate(ids, 13, attention_mask=mask, eos_token_id=eos),
                       reference_eos)
    assert calls, "the kernel never ran"
    assert not torch.equal(reference_eos, reference)  # the eos did stop a row
