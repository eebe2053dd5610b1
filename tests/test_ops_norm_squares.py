"""fuser::linear_add_squares and fuser::squares_norm_linear: the GEMV that sums the next norm's
squares in its epilogue, and the GEMV that takes rstd from them instead of a pass over its row.

Without a GPU the kernels run under TRITON_INTERPRET=1 (conftest.py); with one, for real, and
the tests named *gpu* run at Llama-3-8B's o_proj/down_proj -> gate_up/qkv shapes.

What must hold:
- h is the GEMV's output plus the residual, rounded as fuser::linear then fuser::add_rms_norm
  round them: bit for bit what linear_triton (same kernel, same blocking) plus the residual gives;
- squares is sum(h^2) per row over every output column (all programs' partials, split-K too),
  within fp32 summation-order error, and the same bits call after call (the last program adds
  the partials in program order, whichever program it is);
- the counter the programs count in is zero again after each call (graph replays need that);
- squares_norm_linear equals rms_norm_linear over the same h (the norm prologue it replaces)
  within an ulp of rstd, and its references equal the ops they replace bit for bit on CPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fuser.ops.counters import split_counters
from fuser.ops.fp8 import quantize_weight
from fuser.ops.linear import (
    MAX_ROWS,
    PDL_PREFETCH,
    add_rms_norm_linear_reference,
    linear_add_squares_reference,
    linear_add_squares_triton,
    linear_triton,
    rms_norm_linear_triton,
    squares_norm_linear_reference,
    squares_norm_linear_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.usefixtures("interpreter_rounds_bf16_like_gpu")


def _case(M: int, K: int, N: int, dtype: torch.dtype, fp8: bool, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K**-0.5).to(dtype).to(DEVICE)
    scale = None
    if fp8:
        w, scale = quantize_weight(w.float())
    r = torch.randn(1, M, N, generator=g).to(dtype).to(DEVICE)  # the residual stream's shape
    return x, w, scale, r


def check_add_squares(M: int, K: int, N: int, dtype: torch.dtype, fp8: bool, seed: int,
                      **overrides: object) -> tuple[torch.Tensor, torch.Tensor]:
    x, w, scale, r = _case(M, K, N, dtype, fp8, seed)
    h, squares = linear_add_squares_triton(x, w, r, weight_scale=scale, **overrides)
    # the same kernel and blocking (an override, even the default prefetch, keeps linear_triton
    # off the stream GEMV, which one-row bf16 takes on a GPU and linear_add_squares never does)
    y = linear_triton(x, w, weight_scale=scale, prefetch=PDL_PREFETCH, **overrides)
    assert h.shape == r.shape and h.dtype == dtype
    assert torch.equal(h, (y.reshape(r.shape) + r))  # the add rounds as fuser::add_rms_norm's
    want = h.double().square().sum(-1).reshape(-1)
    assert squares.shape == (M,) and squares.dtype == torch.float32
    torch.testing.assert_close(squares.double(), want, rtol=2e-6 * N**0.5, atol=0)
    again = linear_add_squares_triton(x, w, r, weight_scale=scale, **overrides)
    assert torch.equal(again[0], h) and torch.equal(again[1], squares)  # deterministic
    assert not split_counters(x.device, 1).any()  # every counter back at zero
    return h, squares


@settings(max_examples=12, deadline=None)
@given(M=st.sampled_from([1, 2, 5, 9, 16]), K=st.sampled_from([16, 48, 64]),
       N=st.sampled_from([16, 40, 96]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fp8=st.booleans(), seed=st.integers(0, 100))
def test_h_and_squares(M: int, K: int, N: int, dtype: torch.dtype, fp8: bool, seed: int) -> None:
    check_add_squares(M, K, N, dtype, fp8, seed)


@pytest.mark.parametrize("M", [1, 5])
def test_split_k_and_many_programs(M: int) -> None:
    # split-K: only the program that summed a column block's splits counts in; small column
    # blocks: many programs' partials (the BLOCK_P tile, masked past the programs)
    check_add_squares(M, 64, 80, torch.float32, False, 1, split_k=2, block_n=16, block_k=16)
    check_add_squares(M, 64, 112, torch.bfloat16, True, 2, block_n=16)


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("fp8", [False, True])
def test_squares_norm_linear_equals_the_norm_prologue(M: int, activation: str | None,
                                                      fp8: bool) -> None:
    dtype = torch.bfloat16
    h, squares = check_add_squares(M, 32, 64, dtype, False, 3)
    g = torch.Generator(device="cpu").manual_seed(4)
    norm_weight = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype).to(DEVICE)
    w2 = (torch.randn(96 if activation else 48, 64, generator=g) * 0.125).to(dtype).to(DEVICE)
    scale = None
    if fp8:
        w2, scale = quantize_weight(w2.float())
    got = squares_norm_linear_triton(h, squares, norm_weight, 1e-5, w2, weight_scale=scale,
                                     activation=activation)
    want, _ = rms_norm_linear_triton(h, None, norm_weight, 1e-5, w2, weight_scale=scale,
                                     activation=activation)
    assert got.shape == want.shape and got.dtype == want.dtype
    # rstd from the epilogue's squares or from the prologue's pass: fp32 sums in two orders
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    close = torch.isclose(got.float(), want.float(), rtol=1e-3, atol=1e-4).float().mean()
    assert close > 0.97, close  # nearly every output the same bits
    ref = squares_norm_linear_reference(h.cpu(), squares.cpu(), norm_weight.cpu(), 1e-5,
                                        w2.cpu(), None if scale is None else scale.cpu(),
                                        activation)
    torch.testing.assert_close(got.float().cpu(), ref.float(), rtol=3e-2, atol=3e-2)


def test_references_are_the_ops_they_replace() -> None:
    # CPU engines run references: the pair must give add_rms_norm_linear's values bit for bit
    x, w, scale, r = _case(5, 32, 64, torch.bfloat16, True, 7)
    x, w, scale, r = x.cpu(), w.cpu(), scale.cpu(), r.cpu()
    g = 1 + 0.1 * torch.randn(64, dtype=torch.bfloat16)
    w2 = torch.randn(48, 64, dtype=torch.bfloat16)
    y = torch.ops.fuser.fp8_linear(x, w, scale).reshape(r.shape)
    out_want, summed_want = add_rms_norm_linear_reference(r, y, g, 1e-6, w2, None, None)
    h, squares = linear_add_squares_reference(x, w, scale, r)
    out = squares_norm_linear_reference(h, squares, g, 1e-6, w2, None, None)
    assert torch.equal(h, summed_want) and torch.equal(out, out_want)
    assert torch.equal(squares, h.float().square().sum(-1).reshape(-1))
    # the ops on CPU are their references
    h_op, sq_op = torch.ops.fuser.linear_add_squares(x, w, scale, r)
    assert torch.equal(h_op, h) and torch.equal(sq_op, squares)
    assert torch.equal(torch.ops.fuser.squares_norm_linear(h, squares, g, 1e-6, w2, None, None),
                       out)


def test_bad_input_is_named() -> None:
    x, w, scale, r = _case(2, 16, 32, torch.float32, False, 0)
    with pytest.raises(ValueError, match="residual"):
        linear_add_squares_triton(x, w, r[..., :16])
    with pytest.raises(ValueError, match="squares"):
        squares_norm_linear_triton(r, torch.zeros(3, device=DEVICE), torch.ones(32, device=DEVICE),
                                   1e-6, w.t().contiguous())
    assert MAX_ROWS >= 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_llama3_8b_shapes(M: int, fp8: bool) -> None:
    # o_proj (4096 x 4096) and down_proj (4096 x 14336, split-K by default at one row), then
    # gate/up (gated) and qkv over the h they return
    for K in (4096, 14336):
        h, squares = check_add_squares(M, K, 4096, torch.bfloat16, fp8, K)
        g = (1 + 0.1 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
        for rows, activation in ((2 * 14336, "silu"), (6144, None)):
            w2 = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 0.015
            scale = None
            if fp8:
                w2, scale = quantize_weight(w2.float())
            got = squares_norm_linear_triton(h, squares, g, 1e-5, w2, weight_scale=scale,
                                             activation=activation)
            want, _ = rms_norm_linear_triton(h.reshape(M, 4096), None, g, 1e-5, w2,
                                             weight_scale=scale, activation=activation)
            torch.testing.assert_close(got.float().reshape(want.shape), want.float(),
                                       rtol=2e-2, atol=2e-2)
