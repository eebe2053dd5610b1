"""The overlapped speculative step (FuserConfig.overlap; runtime/speculative.py
`overlapped_step`): its fused kernels against the eager reference bit for bit, greedy output
equal to the target's whatever the draft, streams that engage when the draft agrees, the
round model (runtime/controller.py), and the split-counter
lanes the concurrent branches use.

Without a GPU the kernels run under TRITON_INTERPRET=1 (conftest.py) and the two branches one
after the other; tests/test_cuda_spec.py runs the captured step on the device.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuser
from engines import (MAX_SEQ_LEN, assert_greedy_matches, eos_that_ends_one_row, hf_greedy,
                     llama_target, perturbed, prompts, qwen_target)
from fuser.runtime import speculative
from fuser.runtime.controller import (DRAFT, Controller, expected_tokens_per_round,
                                      expected_tokens_per_step)
from fuser.runtime.draft_kernels import overlap_catchup_inputs
from fuser.runtime.kv_cache import KVCache
from fuser.runtime.speculative import GUESS_SLOTS, DecodeState
from fuser.runtime.steps import ModelSteps

# One xdist worker runs the module: its cached overlapped engines are built once each.
pytestmark = [pytest.mark.usefixtures("one_intra_op_thread"),  # conftest.py
              pytest.mark.xdist_group("overlap")]

VOCAB = 12
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' (interpreted on the CPU)
SETTINGS = {"deadline": None, "derandomize": True, "suppress_health_check": [HealthCheck.too_slow]}


# -- the fused kernels against the eager reference --------------------------------------------


@st.composite
def finish_cases(draw: st.DrawFn) -> tuple[DecodeState, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(state, seq_lens, target_tokens, ahead) of one overlapped round's end."""
    B = draw(st.integers(1, 5))
    gamma = draw(st.integers(1, 6))
    S = 2 * gamma + 4 + draw(st.integers(0, 6))

    def ints(lo: int, hi: int, n: int) -> torch.Tensor:
        return torch.tensor(draw(st.lists(st.integers(lo, hi), min_size=n, max_size=n)))

    state = DecodeState.allocate(B, S, torch.device("cpu"))
    state.guesses.copy_(ints(0, VOCAB - 1, B * GUESS_SLOTS).view(B, GUESS_SLOTS))
    target = ints(0, VOCAB - 1, B * (gamma + 1)).view(B, gamma + 1)
    for b in range(B):  # agree for a drawn prefix, so that streaming rows accept some
        agree = draw(st.integers(0, gamma))
        target[b, :agree] = state.guesses[b, :agree]
    ahead = ints(0, VOCAB - 1, B * (gamma + 1)).view(B, gamma + 1)
    for b in range(B):  # Z_1 often right (about the pending token of either mode)
        if draw(st.booleans()):
            ahead[b, 0] = target[b, draw(st.sampled_from([0, gamma]))]
    state.streaming.copy_(torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B))))
    state.active.copy_(torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B))))
    state.pending.copy_(ints(0, VOCAB - 1, B))
    state.last.copy_(ints(0, VOCAB - 1, B))
    state.generated.copy_(ints(1, 9, B))
    state.max_new_tokens.copy_(state.generated + ints(0, 12, B))
    eos = draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))
    if eos:
        state.eos[:, : len(eos)] = torch.tensor(eos)
    seq_lens = ints(0, S - 2 - gamma, B)
    return state, seq_lens, target, ahead


def finish(state: DecodeState, seq_lens: torch.Tensor, target: torch.Tensor,
           ahead: torch.Tensor, fused: bool) -> torch.Tensor:
    B = seq_lens.shape[0]
    cache = KVCache([], [], seq_lens=seq_lens,
                    starts=torch.zeros(B, dtype=torch.long, device=seq_lens.device))
    steps = ModelSteps("target", cache, VOCAB)
    gamma = target.shape[1] - 1
    return speculative.finish_overlapped(steps, state, state.guesses[:, :gamma], target, ahead,
                                         fused)


def copied(state: DecodeState, device: str = "cpu") -> DecodeState:
    return DecodeState(**{f.name: getattr(state, f.name).to(device, copy=True)
                          for f in dataclasses.fields(state)})


@settings(max_examples=30, **SETTINGS)
@given(case=finish_cases())
def test_finish_kernel_equals_eager(case) -> None:
    state, seq_lens, target, ahead = case
    eager, kernel = copied(state), copied(state, DEVICE)
    lens_eager, lens_kernel = seq_lens.clone(), seq_lens.to(DEVICE)
    expected = finish(eager, lens_eager, target, ahead, fused=False)
    packed = finish(kernel, lens_kernel, target.to(DEVICE), ahead.to(DEVICE), fused=True)
    assert torch.equal(packed.cpu(), expected), (packed, expected)
    assert torch.equal(lens_kernel.cpu(), lens_eager)
    for f in dataclasses.fields(state):
        assert torch.equal(getattr(kernel, f.name).cpu(), getattr(eager, f.name)), f.name


def test_finish_examples() -> None:
    """Worked rows at gamma 2: streaming, all accepted, Z_1 = the bonus (streams on); streaming,
    a correction at 1 (stops streaming); not streaming although the guesses match (nothing
    accepted), Z_1 = the target's token (streams on); not streaming, Z_1 wrong."""
    state = DecodeState.allocate(4, 16, torch.device("cpu"))
    state.guesses[:, :2] = torch.tensor([[1, 2]] * 4)
    state.streaming.copy_(torch.tensor([True, True, False, False]))
    state.active.fill_(True)
    state.generated.fill_(1)
    state.max_new_tokens.fill_(50)
    state.pending.fill_(7)
    target = torch.tensor([[1, 2, 3], [1, 5, 3], [1, 2, 3], [1, 2, 3]])
    ahead = torch.tensor([[3, 8, 9], [3, 8, 9], [1, 4, 6], [9, 4, 6]])
    for fused in (False, True):
        device = DEVICE if fused else "cpu"
        s, lens = copied(state, device), torch.full((4,), 5, device=device)
        packed = finish(s, lens, target.to(device), ahead.to(device), fused).cpu()
        lens, s = lens.cpu(), copied(s)
        assert packed[:, :3].tolist() == [[1, 2, 3], [1, 5, 0], [1, 2, 0], [1, 2, 0]]
        assert packed[:, 3].tolist() == [3, 2, 1, 0]  # 2 * streamed + streams on
        assert packed[:, 4].tolist() == [2, 1, 0, 0]
        assert lens.tolist() == [8, 7, 6, 6]
        assert s.pending.tolist() == [3, 5, 1, 1]
        assert s.last.tolist() == [2, 1, 7, 7]
        assert s.streaming.tolist() == [True, False, True, False]
        assert s.guesses[:, :2].tolist() == [[8, 9], [8, 9], [4, 6], [4, 6]]


@settings(max_examples=20, **SETTINGS)
@given(B=st.integers(1, 4), gamma=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_catchup_kernel_equals_eager(B: int, gamma: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (B,), generator=g)
    starts = torch.randint(0, 3, (B,), generator=g)
    last, pending = (torch.randint(0, VOCAB, (B,), generator=g) for _ in range(2))
    guesses = torch.randint(0, VOCAB, (B, GUESS_SLOTS), generator=g)[:, :gamma]
    streaming = torch.rand(B, generator=g) < 0.5
    cache = KVCache([], [], seq_lens=torch.zeros(B, dtype=torch.long, device=DEVICE),
                    starts=starts.to(DEVICE))
    tokens, positions = overlap_catchup_inputs(
        cache, lens.to(DEVICE), last.to(DEVICE), pending.to(DEVICE),
        guesses.to(DEVICE), streaming.to(DEVICE))
    tokens, positions, cache.seq_lens = tokens.cpu(), positions.cpu(), cache.seq_lens.cpu()
    before = guesses[:, gamma - 2] if gamma >= 2 else pending
    head = torch.where(streaming, before, last)
    tail = torch.where(streaming, guesses[:, gamma - 1], pending)
    length = lens + streaming.long() * gamma - 1
    assert torch.equal(tokens, torch.stack([head, tail], 1))
    assert torch.equal(cache.seq_lens, length)
    assert torch.equal(positions, (length - starts)[:, None] + torch.arange(2))


# -- generate(): lossless whatever the draft, streaming when it agrees -------------------------


@functools.cache
def overlap_engine(name: str) -> tuple[fuser.Engine, torch.nn.Module]:
    """"self3": Qwen2 target, draft = its copy, gamma 3; "noisy2": Llama target, draft = the
    target with 5% weight noise, gamma 2. Both overlapped."""
    config = functools.partial(fuser.FuserConfig, max_seq_len=MAX_SEQ_LEN, max_batch_size=4,
                               overlap=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "self3":
            target = qwen_target()
            engine = fuser.optimize(target, draft=copy.deepcopy(target), config=config(gamma=3))
        else:
            target = llama_target()
            engine = fuser.optimize(target, draft=perturbed(target, 0.05, seed=3),
                                    config=config(gamma=2))
    assert engine.report().fallbacks == [] and engine.draft is not None
    return engine, target


@pytest.mark.parametrize("name", ["self3", "noisy2"])
@pytest.mark.parametrize("fused", [False, True])
def test_overlapped_greedy_equals_the_target(name: str, fused: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Ragged prompts, rows of every mode: the output is the target's greedy output."""
    from fuser.runtime import step_kernels

    monkeypatch.setattr(step_kernels, "FUSE_OFF_CUDA", fused)
    engine, target = overlap_engine(name)
    ids, mask = prompts([8, 3, 10, 5], seed=13)
    ref, near_tie = hf_greedy(target, ids, mask, 20)
    engine.stats.reset()
    ours = engine.generate(ids, 20, attention_mask=mask, eos_token_id=[])
    assert_greedy_matches(ours, ref, near_tie, ids, [])
    stats = engine.stats
    if name == "self3":
        # The draft is the target: every round after a row's first streams, accepting all 3
        # guesses (the first round per row is a restart: nothing to verify yet).
        # Restart rounds verify stale guesses and accept none: fewer than all accepted (the
        # standard step would accept every draft of this draft).
        assert 0.75 * stats.num_draft_tokens <= stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.mean_accepted_length > 3.0
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_overlapped_eos_per_row_and_stream() -> None:
    """An eos that ends one row early; `stream` equals `generate`."""
    engine, target = overlap_engine("noisy2")
    ids, mask = prompts([6, 9, 4], seed=5)
    ref, _ = hf_greedy(target, ids, mask, 16)
    eos, row, index = eos_that_ends_one_row(ref, ids.shape[1])
    ref, near_tie = hf_greedy(target, ids, mask, 16, eos=eos, pad=0)
    ours = engine.generate(ids, 16, attention_mask=mask, eos_token_id=eos, pad_token_id=0)
    assert_greedy_matches(ours, ref, near_tie, ids, [eos])
    streamed = torch.stack(list(engine.stream(ids, 16, attention_mask=mask, eos_token_id=eos,
                                              pad_token_id=0)), dim=1)
    assert torch.equal(streamed, ours[:, ids.shape[1]:])


def test_overlapped_gamma_switches_stay_lossless() -> None:
    """Plain steps and gamma changes between overlapped rounds (the stream restarts each time)."""
    engine, target = overlap_engine("self3")
    ids, mask = prompts([7, 4], seed=21)
    ref, near_tie = hf_greedy(target, ids, mask, 24)
    bucket = engine.bucket(2)
    schedule = iter([3, 3, 0, 0, 3, 0, 3, 3, 3] + [3] * 30)
    original = engine.next_gamma
    engine.next_gamma = lambda controller, bucket=None: next(schedule)  # type: ignore[method-assign]
    try:
        ours = engine.generate(ids, 24, attention_mask=mask, eos_token_id=[])
    finally:
        engine.next_gamma = original  # type: ignore[method-assign]
    assert bucket.overlap
    assert_greedy_matches(ours, ref, near_tie, ids, [])


def test_overlap_sampling_keeps_the_standard_step() -> None:
    engine, _ = overlap_engine("noisy2")
    ids, mask = prompts([5, 8], seed=2)
    a = engine.generate(ids, 10, attention_mask=mask, do_sample=True, seed=4, eos_token_id=[])
    b = engine.generate(ids, 10, attention_mask=mask, do_sample=True, seed=4, eos_token_id=[])
    assert torch.equal(a, b) and a.shape == (2, ids.shape[1] + 10)


def test_overlap_draft_cache_has_headroom() -> None:
    engine, _ = overlap_engine("noisy2")
    gamma = max(engine.gammas)
    assert engine.draft.cache.slots == engine.target.cache.slots + gamma


def test_overlap_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="overlap"):
        fuser.FuserConfig(overlap="yes")  # type: ignore[arg-type]


# -- the adaptive controller's round model -----------------------------------------------------


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_round_model_limits(gamma: int) -> None:
    assert expected_tokens_per_round([1.0] * gamma, gamma) == gamma + 1  # always streaming
    assert expected_tokens_per_round([0.0] * gamma, gamma) == 1.0  # never
    for alpha in (0.3, 0.7, 0.9):  # a restart round costs a token: below the standard step's
        alphas = [alpha] * gamma
        assert 1.0 < expected_tokens_per_round(alphas, gamma) < expected_tokens_per_step(alphas, gamma)


def test_round_model_matches_a_simulation() -> None:
    """Equation (3) against a Monte Carlo run of the rounds with i.i.d. acceptance."""
    g = torch.Generator().manual_seed(0)
    alpha, gamma, rounds = 0.7, 2, 200_000
    tokens, streaming = 0, False
    draws = (torch.rand(rounds, gamma + 1, generator=g) < alpha).tolist()
    for hits in draws:
        if streaming:
            n = next((i for i in range(gamma) if not hits[i]), gamma)
            tokens += n + 1
            streaming = n == gamma and hits[gamma]
        else:
            tokens += 1
            streaming = hits[0]
    assert expected_tokens_per_round([alpha] * gamma, gamma) == pytest.approx(tokens / rounds,
                                                                              rel=0.01)


def test_overlapped_controller_switches_off_and_on() -> None:
    """Costs where an overlapped round at gamma 2 costs 1.1 decode steps: zero acceptance (no
    row streaming, n = 0: one token a round) turns speculation off; probes that find the draft
    right again (every row streaming: n = 2) turn it back on."""
    controller = Controller({DRAFT: (2,)}, costs={("target", 0): 1.0, (DRAFT, 2): 1.1},
                            probe_share=0.25, refresh=4, first=(DRAFT, 2))
    for _ in range(40):
        g = controller.choose().gamma
        controller.update([0], g)
    assert not controller.enabled
    for _ in range(200):
        g = controller.choose().gamma
        controller.update([2] if g else [0], g)
        if controller.enabled:
            break
    assert controller.enabled and controller.gamma == 2


# -- split-counter lanes --------------------------------------------------------------------


def test_counter_lanes_are_separate_buffers() -> None:
    from fuser.ops.counters import counter_lane, split_counters

    device = torch.device("cpu")
    main = split_counters(device, 4)
    with counter_lane(1):
        side = split_counters(device, 4)
        assert split_counters(device, 4) is side
    assert side is not main and split_counters(device, 4) is main
