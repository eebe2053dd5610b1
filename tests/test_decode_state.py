"""runtime/speculative.py's DecodeState: the rows an admission loads at once (`load_rows`) hold
what writing each row's values alone gives, and its row moves (`copy_row`) copy every per-row
tensor."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from fuser.runtime.speculative import EOS_SLOTS, DecodeState

VOCAB = 97
BATCH = 6

row_values = st.fixed_dictionaries({
    "max_new_tokens": st.integers(1, 4096),
    "eos": st.lists(st.integers(0, VOCAB - 1), max_size=EOS_SLOTS),
    "temperature": st.floats(0.05, 2.0),
    "top_k": st.one_of(st.none(), st.integers(1, 2 * VOCAB)),
    "top_p": st.one_of(st.none(), st.floats(0.05, 1.0)),
    "seed": st.integers(-2**63, 2**63 - 1),
})


def filled(seed: int) -> DecodeState:
    """A state whose every tensor holds arbitrary values (what earlier requests left)."""
    state = DecodeState.allocate(BATCH, 16, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed)
    for value in vars(state).values():
        if value.dtype == torch.bool:
            value.copy_(torch.rand(value.shape, generator=generator) < 0.5)
        elif value.is_floating_point():
            value.copy_(torch.rand(value.shape, generator=generator))
        else:
            value.copy_(torch.randint(-5, 500, value.shape, generator=generator))
    return state


def load_row(state: DecodeState, row: int, max_new_tokens: int, eos: list[int],
             temperature: float, top_k: int | None, top_p: float | None, seed: int) -> None:
    """One request's values written into `row`, element by element (the reference)."""
    state.max_new_tokens[row] = max_new_tokens
    state.eos[row] = -1
    if eos:
        state.eos[row, : len(eos)] = torch.tensor(eos, dtype=torch.long)
    state.temperature[row] = temperature
    state.top_k[row] = VOCAB if top_k is None else min(top_k, VOCAB)
    state.top_p[row] = 1.0 if top_p is None else top_p
    state.seed[row] = seed


@settings(max_examples=40, deadline=None, derandomize=True)
@given(rows=st.lists(row_values, min_size=1, max_size=BATCH))
def test_rows_loaded_at_once_equal_rows_loaded_one_by_one(rows: list[dict]) -> None:
    at_once, one_by_one = filled(0), filled(0)
    at_once.load_rows([r["max_new_tokens"] for r in rows], [r["eos"] for r in rows],
                      [r["temperature"] for r in rows], [r["top_k"] for r in rows],
                      [r["top_p"] for r in rows], VOCAB, [r["seed"] for r in rows])
    for i, r in enumerate(rows):
        load_row(one_by_one, i, r["max_new_tokens"], r["eos"], r["temperature"], r["top_k"],
                 r["top_p"], r["seed"])
    for name, value in vars(at_once).items():
        assert torch.equal(value, getattr(one_by_one, name)), name


def test_too_many_eos_ids_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=f"eos_token_id has {EOS_SLOTS + 1} ids; at most"):
        filled(0).load_rows([8], [list(range(EOS_SLOTS + 1))], [1.0], [None], [None], VOCAB,
                            [0])


@settings(max_examples=20, deadline=None, derandomize=True)
@given(src=st.integers(0, BATCH - 1), dst=st.integers(0, BATCH - 1), seed=st.integers(0, 99))
def test_a_row_move_copies_every_per_row_tensor(src: int, dst: int, seed: int) -> None:
    state, before = filled(seed), filled(seed)
    state.copy_row(dst, src)
    for name, value in vars(state).items():
        old = getattr(before, name)
        assert torch.equal(value[dst], old[src]), name
        others = [b for b in range(BATCH) if b != dst]
        assert torch.equal(value[others], old[others]), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_rows_load_without_waiting_for_the_device() -> None:
    """On CUDA an admission's `load_rows` queues its copies behind the step in flight without
    making the host wait for the device (`torch.cuda.set_sync_debug_mode("error")`: a copy from
    pageable memory synchronises and raises), and the rows hold what the CPU's load gives; so
    does `to_device` of a prompt group's token rows."""
    from fuser.runtime.host_copies import to_device

    rows = [dict(max_new_tokens=7, eos=[1, 2], temperature=0.7, top_k=5, top_p=0.9, seed=-3),
            dict(max_new_tokens=4096, eos=[], temperature=1.0, top_k=None, top_p=None, seed=11)]
    args = ([r["max_new_tokens"] for r in rows], [r["eos"] for r in rows],
            [r["temperature"] for r in rows], [r["top_k"] for r in rows],
            [r["top_p"] for r in rows], VOCAB, [r["seed"] for r in rows])
    cpu, gpu = filled(1), DecodeState.allocate(BATCH, 16, torch.device("cuda"))
    for name, value in vars(cpu).items():
        getattr(gpu, name).copy_(value)
    cpu.load_rows(*args)
    busy = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # work in flight while the rows load
            busy = busy @ busy / 64
        gpu.load_rows(*args)
        tokens = to_device([[5, 6, 7], [8, 9, 10]], torch.device("cuda"))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for name, value in vars(cpu).items():
        assert torch.equal(value, getattr(gpu, name).cpu()), name
    assert tokens.tolist() == [[5, 6, 7], [8, 9, 10]] and tokens.dtype == torch.long


def test_to_device_takes_rows_of_tokens() -> None:
    from fuser.runtime.host_copies import to_device

    out = to_device([[1, 2], [3, 4]], torch.device("cpu"))
    assert out.dtype == torch.long and out.tolist() == [[1, 2], [3, 4]]
    assert to_device([0.5], torch.device("cpu"), torch.float32).dtype == torch.float32
