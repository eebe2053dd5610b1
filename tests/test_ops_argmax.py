"""fuser/ops/argmax.py: torch.argmax's answer from two kernels (the interpreter on CPU)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops import argmax as argmax_module
from fuser.ops.argmax import argmax

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def logits_with(rows: int, V: int, dtype: torch.dtype, seed: int, ties: bool, nans: int,
                infs: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=gen)
    if ties:  # few distinct values: the maximum repeats, often across chunks
        x = x.round()
    x = x.to(dtype)
    for _ in range(nans):
        x[torch.randint(rows, (1,), generator=gen), torch.randint(V, (1,), generator=gen)] = \
            float("nan")
    if infs:
        x[0] = float("-inf")
        x[-1, torch.randint(V, (1,), generator=gen)] = float("inf")
    return x


@settings(max_examples=25, deadline=None, derandomize=True)
@given(rows=st.integers(1, 6), V=st.integers(1, 3 * 64 + 5),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       ties=st.booleans(), nans=st.integers(0, 2), infs=st.booleans(),
       seed=st.integers(0, 2**16))
def test_equals_torch_argmax(rows, V, dtype, ties, nans, infs, seed) -> None:
    x = logits_with(rows, V, dtype, seed, ties, nans, infs)
    for single_max in (0, 1 << 20):  # several chunks of 64 at small V; one program a row
        with mock.patch.multiple(argmax_module, CHUNK=64, SINGLE_MAX=single_max):
            out = argmax(x.to(DEVICE), kernels=True).cpu()
        assert torch.equal(out, torch.argmax(x, dim=-1)), (single_max, x, out)


def test_leading_dims_and_strided_rows() -> None:
    x = torch.randn(2, 3, 150).to(torch.bfloat16).round()  # [B, T, V] with ties
    view = x[:, :, :130]  # a vocabulary slice of padded logits: strided rows
    assert torch.equal(argmax(view.to(DEVICE), kernels=True).cpu(), torch.argmax(view, dim=-1))
    assert torch.equal(argmax(x[:, 0, :].to(DEVICE), kernels=True).cpu(),
                       torch.argmax(x[:, 0, :], dim=-1))


def test_cpu_default_is_torch_argmax_and_integers_pass_through() -> None:
    x = torch.randn(3, 50)
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))
    ints = torch.randint(0, 9, (2, 7))
    assert torch.equal(argmax(ints, kernels=True), torch.argmax(ints, dim=-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_llama3_vocabulary() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 128256, device="cuda", generator=gen).to(torch.bfloat16)
    x[1, 77] = x[1, 128000] = x[1].max() + 1  # a tie far apart: the first wins
    x[3, 99999] = float("nan")
    assert torch.equal(argmax(x), torch.argmax(x, dim=-1))
